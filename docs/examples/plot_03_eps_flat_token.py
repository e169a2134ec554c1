"""
The flat token and ``eps``
==========================

A "flat" token is a row whose elements are all equal (padding, a saturated activation,
a constant feature vector). Its variance is exactly 0, so the normalization divides 0 by
``sqrt(0 + eps)``. ``eps`` decides what comes out.
"""

# %%
import numpy as np

import layernorm as ln

flat = np.full((1, 8), 3.25, dtype=np.float32)
bias = np.linspace(-0.3, 0.4, 8, dtype=np.float32)

# %%
# ``eps > 0``: exactly zeros (exactly ``bias`` after the affine step)
# -------------------------------------------------------------------
y, mean, rstd = ln.layer_norm(flat, eps=1e-5, return_stats=True)
print("y        =", y)
print("mean     =", mean.item(), " rstd =", rstd.item(), "= 1/sqrt(1e-5)")
print("all exactly 0:", np.all(y == 0))
assert np.all(y == 0)
print("with bias:", ln.layer_norm(flat, bias=bias, eps=1e-5))
print("equals bias exactly:", np.array_equal(ln.layer_norm(flat, bias=bias, eps=1e-5)[0], bias))

# %%
# These zeros are exact because the library computes ``(x - mean) * rstd``: ``x - mean``
# is exactly 0 for every element. The algebraically equal ``x * rstd - mean * rstd``
# is not, once a compiler fuses it into ``fma(x, rstd, -(mean * rstd))``: the FMA uses
# the exact product ``x * rstd`` while ``mean * rstd`` was rounded to float32, so the
# result is the rounding error of that product instead of 0. Emulated here in float64:
x0 = np.float32(3.1)  # a flat row of 3.1: mean == x
r = np.float32(1 / np.sqrt(np.float32(1e-5)))
mean_times_rstd = np.float32(x0 * r)  # rounded to float32
fma = np.float64(x0) * np.float64(r) - np.float64(mean_times_rstd)  # exact product
print(f"fma(x, rstd, -(mean*rstd)) = {fma:.3e}  instead of 0")

# %%
# ``eps = 0``: NaN, as in PyTorch
# -------------------------------
# With nothing added, ``rstd = 1/sqrt(0)`` is infinite and ``0 * inf`` is NaN.
# ``eps=0`` is allowed (it is what some papers mean), but only non-constant rows survive
# it. Rows are independent: the other row is untouched.
two_rows = np.stack([flat[0], np.arange(8, dtype=np.float32)])
y_eps0 = ln.layer_norm(two_rows, eps=0.0)
print(y_eps0)
assert np.isnan(y_eps0[0]).all() and np.isfinite(y_eps0[1]).all()

# %%
# float16 input and a tiny ``eps``
# --------------------------------
# ``1e-12`` is below the smallest float16 (about ``6e-8``): added in float16 it would
# vanish, ``eps`` would effectively be 0, and a flat float16 token would become NaN.
# The library accumulates float16 in float32, where ``1e-12`` is representable, so the
# flat token still gives zeros and ordinary tokens are normalized as usual.
print("float16(1e-12) =", np.float16(1e-12), "  float32(1e-12) =", np.float32(1e-12))
tokens16 = np.stack([np.full(8, 0.1), np.linspace(-2, 2, 8)]).astype(np.float16)
y16, mean16, rstd16 = ln.layer_norm(tokens16, eps=1e-12, return_stats=True)
print("y dtype:", y16.dtype, " stats dtype:", rstd16.dtype)
print(y16)
assert np.all(y16[0] == 0)
reference = ln.layer_norm(tokens16.astype(np.float64), eps=1e-12)
print("max |float16 result - float64 result| =", np.abs(y16 - reference).max())
