"""
The backward pass
=================

:func:`layernorm.layer_norm_backward` computes the gradients from the statistics saved
by the forward pass::

    xhat   = (x - mean) * rstd
    g      = grad_y * weight
    grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat))

We check it against finite differences, then look at the structure of ``grad_x``: it is
orthogonal to ``1`` and to ``xhat``, the two directions in which LayerNorm's output does
not move.
"""

# %%
import matplotlib.pyplot as plt
import numpy as np

import layernorm as ln

rng = np.random.default_rng(0)
N, D = 3, 10
x = rng.standard_normal((N, D)) * 2.0 + 0.5
weight = rng.uniform(0.5, 1.5, D)
bias = rng.standard_normal(D)
G = rng.standard_normal((N, D))  # the upstream gradient: the loss is sum(G * y)


def loss(x, weight, bias):
    return float((G * ln.layer_norm(x, weight=weight, bias=bias)).sum())


y, mean, rstd = ln.layer_norm(x, weight=weight, bias=bias, return_stats=True)
grad_x, grad_w, grad_b = ln.layer_norm_backward(G, x, mean, rstd, weight)

# %%
# Against central finite differences
# ----------------------------------
# ``(L(x + h e) - L(x - h e)) / 2h`` for every element, in float64.


def numerical_grad(f, a, h=1e-6):
    grad = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        step = np.zeros_like(a)
        step[i] = h
        grad[i] = (f(a + step) - f(a - step)) / (2 * h)
    return grad


num_x = numerical_grad(lambda a: loss(a, weight, bias), x)
num_w = numerical_grad(lambda a: loss(x, a, bias), weight)
num_b = numerical_grad(lambda a: loss(x, weight, a), bias)
for name, ours, num in [
    ("grad_x", grad_x, num_x),
    ("grad_weight", grad_w, num_w),
    ("grad_bias", grad_b, num_b),
]:
    rel = np.abs(ours - num).max() / np.abs(num).max()
    assert rel < 1e-6
    print(f"{name:12s} max relative difference to finite differences: {rel:.1e}")

# %%
# The step size matters: too large and the truncation error of the difference formula
# dominates, too small and rounding does. The V below is the classic picture; the
# analytic gradient is what the bottom of the V approaches.
steps = np.logspace(-12, -1, 23)
errors = [
    np.abs(numerical_grad(lambda a: loss(a, weight, bias), x, h) - grad_x).max() for h in steps
]
fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
ax.loglog(steps, errors, "o-")
ax.set_xlabel("finite-difference step h")
ax.set_ylabel("max |numerical - analytic|")
ax.set_title("Finite differences against layer_norm_backward")
plt.show()

# %%
# The projection property
# -----------------------
# With ``eps = 0``, ``LN(x + c)`` and ``LN(mean + (1 + s) * (x - mean))`` equal
# ``LN(x)``: moving a row along ``1`` or along its own ``xhat`` does not change the
# output, so the gradient has no component in those two directions. Per row,
# ``grad_x`` is ``rstd`` times the orthogonal projection of ``g = grad_y * weight``
# onto the complement of ``span{1, xhat}``.
y0, mean0, rstd0 = ln.layer_norm(x, weight=weight, eps=0.0, return_stats=True)
grad_x0, _, _ = ln.layer_norm_backward(G, x, mean0, rstd0, weight)
xhat0 = (x - mean0) * rstd0
print("eps=0:    grad_x . 1    per row:", grad_x0.sum(axis=1))
print("eps=0:    grad_x . xhat per row:", (grad_x0 * xhat0).sum(axis=1))

g = G * weight
for r in range(N):
    # 1/sqrt(D) and xhat/sqrt(D) are orthonormal: xhat has mean 0 and variance 1.
    basis = np.stack([np.ones(D), xhat0[r]]) / np.sqrt(D)
    projected = g[r] - basis.T @ (basis @ g[r])
    err = np.abs(rstd0[r, 0] * projected - grad_x0[r]).max()
    assert err < 1e-12
    print(f"row {r}: max |rstd * projection(g) - grad_x| = {err:.1e}")

# %%
# With ``eps > 0`` the shift invariance remains but the scale invariance does not
# (``eps`` does not scale with the row, see
# :ref:`sphx_glr_auto_examples_plot_07_invariance.py`), and the gradient keeps a small
# component along ``xhat``: ``rstd * sum(g * xhat) * (1 - mean(xhat**2))``, with
# ``mean(xhat**2) = var / (var + eps)``.
xhat = (x - mean) * rstd
predicted = rstd[:, 0] * (g * xhat).sum(axis=1) * (1 - (xhat**2).mean(axis=1))
print("eps=1e-5: grad_x . 1    per row:", grad_x.sum(axis=1))
print("eps=1e-5: grad_x . xhat per row:", (grad_x * xhat).sum(axis=1))
print("          predicted            :", predicted)
