"""
LayerNorm by hand: the 2x4 example
==================================

LayerNorm normalizes each sample (here: each row) by its own mean and standard
deviation. We work one row out by hand and check the library against it.
"""

# %%
import numpy as np

import layernorm as ln

x = np.array([[1, 2, 3, 4], [10, 20, 30, 40]], dtype=np.float32)
y = ln.layer_norm(x)
print(y.round(3))

# %%
# Both rows give ``[-1.342, -0.447, 0.447, 1.342]``: the second row is the first one
# times 10, and LayerNorm forgets the scale of a row (and its offset, see
# :ref:`sphx_glr_auto_examples_plot_07_invariance.py`). Not quite exactly, though:
# ``eps`` is added to the variance, 1.25 for the first row and 125 for the second, so
# it shrinks the small-variance row a little more. With ``eps=0`` only float32
# rounding is left (about one unit in the last place, ``np.spacing``):
print("row 0 - row 1:         ", y[0] - y[1])
y0 = ln.layer_norm(x, eps=0.0)
print("row 0 - row 1 (eps=0): ", y0[0] - y0[1])
print("float32 spacing at y:  ", np.spacing(y0[0]))

# %%
# One row by hand
# ---------------
# Take the row ``[1, 3, 5, 7]``. Its mean is 4 and its (population) variance is
# ``((-3)**2 + (-1)**2 + 1**2 + 3**2) / 4 = 20 / 4 = 5``.
row = np.array([[1.0, 3.0, 5.0, 7.0]])
mean = row.sum() / row.size
var = ((row - mean) ** 2).sum() / row.size
print(f"mean = {mean}, variance = {var}")

eps = 1e-5
by_hand = (row - mean) / np.sqrt(var + eps)
print("by hand:   ", by_hand.round(6))

y, mu, rstd = ln.layer_norm(row, eps=eps, return_stats=True)
print("layer_norm:", y.round(6))
print(f"mean = {mu.item()}, rstd = {rstd.item():.6f}, 1/sqrt(5 + eps) = {1 / np.sqrt(5 + eps):.6f}")
np.testing.assert_allclose(y, by_hand, rtol=1e-12)

# %%
# The statistics keep the normalized axis as size 1 (``keepdims``), so they broadcast
# back against ``x``:
y, mu, rstd = ln.layer_norm(x, return_stats=True)
print("mean:", mu.ravel(), "shape", mu.shape)
print("rstd:", rstd.ravel(), "shape", rstd.shape)
print("(x - mean) * rstd:\n", ((x - mu) * rstd).round(3))
