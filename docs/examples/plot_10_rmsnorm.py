"""
RMSNorm next to LayerNorm
=========================

RMSNorm (used by LLaMA, T5, Mistral, ...) drops LayerNorm's centring and its bias::

    LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps)   * weight + bias
    RMSNorm:   y = x            / sqrt(mean(x**2) + eps) * weight

It is cheaper (one statistic instead of two) and keeps scale invariance, but not shift
invariance.
"""

# %%
import numpy as np

import layernorm as ln

x = np.array([[1.0, 3.0, 5.0, 7.0], [-2.0, 1.0, 0.5, 0.5]], dtype=np.float32)
print("LayerNorm:\n", ln.layer_norm(x).round(4))
print("RMSNorm:\n", ln.rms_norm(x).round(4))

# %%
# The second row has mean 0, so both give the same values for it; the first row's
# RMSNorm output keeps the row's positive offset.

# %%
# By hand for the first row: ``mean(x**2) = (1 + 9 + 25 + 49) / 4 = 21``.
y, rstd = ln.rms_norm(x[:1], return_stats=True)
print("rstd =", rstd.item(), " 1/sqrt(21) =", 1 / np.sqrt(21))
print("by hand:", (x[:1] / np.sqrt(21)).round(4))

# %%
# On centred data they agree
# --------------------------
# If a row already has mean 0, ``mean(x**2)`` is its variance and the two coincide (up
# to their different default ``eps``; RMSNorm's default is float32's machine epsilon,
# as in PyTorch).
rng = np.random.default_rng(0)
z = rng.standard_normal((3, 512)).astype(np.float32)
z -= z.mean(axis=1, keepdims=True)
print(
    "centred rows, max |LN - RMS| =",
    np.abs(ln.layer_norm(z, eps=0.0) - ln.rms_norm(z, eps=0.0)).max(),
)

# %%
# Invariances
# -----------
# Both forget a positive scale. Only LayerNorm forgets a shift.
a, b = 3.0, 10.0
for name, f in [("layer_norm", ln.layer_norm), ("rms_norm", ln.rms_norm)]:
    scale = np.abs(f(a * z, eps=0.0) - f(z, eps=0.0)).max()
    shift = np.abs(f(z + b, eps=0.0) - f(z, eps=0.0)).max()
    print(f"{name:10s}: max |f(3x) - f(x)| = {scale:.1e}   max |f(x + 10) - f(x)| = {shift:.1e}")

# %%
# The layers
# ----------
# :class:`layernorm.RMSNorm` mirrors :class:`torch.nn.RMSNorm`: a ``weight`` and no
# ``bias``, and ``eps=None`` by default.
layer_ln, layer_rms = ln.LayerNorm(512), ln.RMSNorm(512)
print(layer_ln, "->", list(layer_ln.state_dict()))
print(layer_rms, "->", list(layer_rms.state_dict()))
y = layer_rms(z)
grad_x, grad_weight = layer_rms.backward(np.ones_like(y))
print("RMSNorm backward:", grad_x.shape, grad_weight.shape)
