"""
Population or unbiased variance? Checking against PyTorch
=========================================================

LayerNorm divides by the *population* standard deviation, ``sum((x - mean)**2) / n``,
not by the unbiased estimate with ``n - 1``. PyTorch's ``layer_norm`` does the same,
but ``torch.var`` and ``torch.std`` default to ``n - 1``: a hand-written LayerNorm built
from them is off by a factor ``sqrt((n - 1) / n)``.
"""

# %%
import numpy as np

import layernorm as ln

try:
    import torch
except ImportError:
    torch = None
    print("PyTorch is not installed: the comparisons with PyTorch are skipped.")

row = np.array([[1.0, 3.0, 5.0, 7.0]])
n = row.shape[-1]
print("population variance (NumPy, ddof=0):", row.var(), "  unbiased (ddof=1):", row.var(ddof=1))
print("ratio:", row.var(ddof=1) / row.var(), "= n/(n-1) =", n / (n - 1))

# %%
# PyTorch agrees on LayerNorm, not on ``var``
# -------------------------------------------
if torch is not None:
    t = torch.from_numpy(row)
    print("torch.var(t):                 ", torch.var(t).item(), "(unbiased by default)")
    print("torch.var(t, correction=0):   ", torch.var(t, correction=0).item())
    ours = ln.layer_norm(row, eps=0.0)
    theirs = torch.nn.functional.layer_norm(t, (n,), eps=0.0).numpy()
    print("layernorm:", ours.round(6))
    print("torch:    ", theirs.round(6))
    print("max |difference| =", np.abs(ours - theirs).max())
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)

# %%
# The discrepancy, as a function of the row length
# ------------------------------------------------
# A LayerNorm written with the unbiased ``torch.var`` produces outputs that are too small
# by ``sqrt((n - 1) / n)``: 13 % for ``n = 4``, still 0.07 % for ``n = 768``, which is
# far above float32 rounding (about ``6e-8``).
rng = np.random.default_rng(0)
if torch is not None:
    for n in (4, 16, 64, 768, 4096):
        x = rng.standard_normal((64, n))
        t = torch.from_numpy(x)
        naive = (t - t.mean(-1, keepdim=True)) / torch.sqrt(t.var(-1, keepdim=True))
        ours = ln.layer_norm(x, eps=0.0)
        ratio = (naive.numpy() / ours).mean()
        print(
            f"n = {n:5d}: unbiased/population = {ratio:.6f}, "
            f"sqrt((n-1)/n) = {np.sqrt((n - 1) / n):.6f}"
        )

# %%
# What the output's spread is
# ---------------------------
# With the population variance each normalized row has population variance exactly 1
# (up to ``eps``); its *unbiased* variance is ``n / (n - 1)``.
x = rng.standard_normal((3, 10))
y = ln.layer_norm(x, eps=0.0)
print("var(y, ddof=0) per row:", y.var(axis=1).round(12))
print("var(y, ddof=1) per row:", y.var(axis=1, ddof=1).round(12), " n/(n-1) =", 10 / 9)

# %%
# How the variance is computed matters too
# ----------------------------------------
# ``var = E[x**2] - E[x]**2`` is algebraically right and numerically wrong: with a large
# common offset both terms are huge and their difference cancels to noise. Rows of
# ``1e4 + N(0, 1)`` in float32, normalized naively in float32 and by the library, against
# a float64 reference:
x32 = (1e4 + rng.standard_normal((4, 768))).astype(np.float32)
reference = ln.layer_norm(x32.astype(np.float64))
m = x32.mean(axis=1, keepdims=True, dtype=np.float32)
naive_var = (x32 * x32).mean(axis=1, keepdims=True, dtype=np.float32) - m * m
naive = (x32 - m) / np.sqrt(np.maximum(naive_var, 0) + np.float32(1e-5))
print("naive E[x^2] - E[x]^2: max |error| =", np.abs(naive - reference).max())
print("layernorm (float32):   max |error| =", np.abs(ln.layer_norm(x32) - reference).max())
