"""
Invariance to scale and shift, and what ``weight`` and ``bias`` give back
=========================================================================

LayerNorm removes each sample's own offset and scale: ``LN(a*x + b) == LN(x)`` for any
``a > 0`` and any ``b`` (scalars, or any per-row values). The learnable ``weight`` and
``bias`` then put a per-feature scale and offset back.
"""

# %%
import numpy as np

import layernorm as ln

rng = np.random.default_rng(0)
x = rng.standard_normal((4, 16))  # float64, so that rounding stays near 1e-16

y = ln.layer_norm(x, eps=0.0)
for a, b in [(3.0, 0.0), (1e3, -50.0), (1e-4, 7.0)]:
    diff = np.abs(ln.layer_norm(a * x + b, eps=0.0) - y).max()
    assert diff < 1e-10
    print(f"a = {a:g}, b = {b:g}: max |LN(a*x + b) - LN(x)| = {diff:.1e}")

# %%
# The differences are float64 rounding. The last one is larger because ``1e-4 * x + 7``
# itself keeps only about 12 significant digits of ``x``: the information is lost when
# the input is formed, not by the normalization.
#
# ``a`` and ``b`` may differ from row to row, since every row is normalized on its own:
a = rng.uniform(0.1, 10.0, size=(4, 1))
b = rng.uniform(-100, 100, size=(4, 1))
diff = np.abs(ln.layer_norm(a * x + b, eps=0.0) - y).max()
print(f"per-row a and b: max |LN(a*x + b) - LN(x)| = {diff:.1e}")

# %%
# A negative scale flips the sign: ``LN(-x) == -LN(x)``.
print("LN(-x) == -LN(x):", np.allclose(ln.layer_norm(-x, eps=0.0), -y, rtol=0, atol=1e-14))

# %%
# ``eps`` breaks the invariance for small scales
# ----------------------------------------------
# ``eps`` is added to the variance, which scales with ``a**2``. Once ``a**2 * var`` is
# comparable to ``eps`` the output shrinks towards 0:
for a in (1.0, 1e-2, 1e-3, 1e-4):
    y_eps = ln.layer_norm(a * x, eps=1e-5)
    print(f"a = {a:g}: std of the output = {y_eps.std():.4f}")

# %%
# What ``weight`` and ``bias`` give back
# --------------------------------------
# After normalization every row has mean 0 and variance 1. ``weight`` and ``bias`` (one
# value per feature) scale and shift every row the same way:
D = x.shape[1]
weight = np.full(D, 2.5)
bias = np.full(D, -1.0)
yw = ln.layer_norm(x, weight=weight, bias=bias, eps=0.0)
print("row means:", yw.mean(axis=1).round(12), " row stds:", yw.std(axis=1).round(12))

# %%
# They can even undo the normalization: for a single row, ``weight = std`` and
# ``bias = mean`` give the row back. LayerNorm with its affine step can represent the
# identity, so a network loses nothing by having it.
row = x[:1]
_, mean, rstd = ln.layer_norm(row, return_stats=True)
back = ln.layer_norm(row, weight=np.full(D, 1 / rstd.item()), bias=np.full(D, mean.item()))
print("max |x - LN(x; weight=std, bias=mean)| =", np.abs(back - row).max())
