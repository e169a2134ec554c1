"""Backward passes against the float64 reference, PyTorch autograd and finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln

from . import reference

GRAD_ATOL = {"float16": 2e-2, "bfloat16": 1.5e-1, "float32": 5e-5, "float64": 1e-11}


@pytest.mark.parametrize(("shape", "axes"), [((3, 6, 4, 5), (1,)), ((3, 6, 4, 5), (1, 3)),
                                             ((4, 6, 5), (0, 2)), ((200, 3), (0,))])
def test_backward_axes_anywhere(shape, axes):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape)
    gy = rng.standard_normal(shape)
    pshape = tuple(shape[a] for a in axes)
    w = 1 + 0.2 * rng.standard_normal(pshape)
    _, mean, rstd = ln.layer_norm(x, weight=w, axis=axes, return_stats=True)
    got = ln.layer_norm_backward(gy, x, mean, rstd, w, axis=axes)
    want = reference.layer_norm_backward(gy, x, axes, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r.astype(np.float64), atol=1e-11)
    generic = ln.layer_norm_backward(gy, x, mean, rstd, w, axis=axes, backend="array_api")
    for g, r in zip(got, generic, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-12)
    _, rs = ln.rms_norm(x, weight=w, axis=axes, return_stats=True)
    got_r = ln.rms_norm_backward(gy, x, rs, w, axis=axes)
    want_r = reference.rms_norm_backward(gy, x, axes, w)
    for g, r in zip(got_r, want_r, strict=True):
        np.testing.assert_allclose(g, r.astype(np.float64), atol=1e-11)


@pytest.mark.parametrize(("shape", "axes"), [((3, 6, 4, 5), (1, 3)), ((200, 3), (0,))])
def test_forced_generic_backward_agrees_with_numba(shape, axes):
    """backend="array_api" on NumPy inputs (the values on every library: test_contract.py)."""
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape)
    gy = rng.standard_normal(shape)
    w = 1 + 0.2 * rng.standard_normal(tuple(shape[a] for a in axes))
    _, mean, rstd = ln.layer_norm(x, weight=w, axis=axes, return_stats=True)
    got = ln.layer_norm_backward(gy, x, mean, rstd, w, axis=axes)
    generic = ln.layer_norm_backward(gy, x, mean, rstd, w, axis=axes, backend="array_api")
    for g, r, e in zip(got, generic, reference.layer_norm_backward(gy, x, axes, w),
                       strict=True):
        np.testing.assert_allclose(g, r, atol=1e-12)
        np.testing.assert_allclose(r, e.astype(np.float64), atol=1e-11)


def test_finite_differences():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 9))
    w = 1 + 0.5 * rng.standard_normal(9)
    b = rng.standard_normal(9)
    c = rng.standard_normal((3, 9))  # loss = sum(c * y)

    def loss(x_, w_, b_):
        return float((c * ln.layer_norm(x_, weight=w_, bias=b_)).sum())

    _, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True)
    gx, gw, gb = ln.layer_norm_backward(c, x, mean, rstd, w)
    h = 1e-6
    for arr, grad, args in ((x, gx, lambda a: (a, w, b)), (w, gw, lambda a: (x, a, b)),
                            (b, gb, lambda a: (x, w, a))):
        num = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            up, down = arr.copy(), arr.copy()
            up[idx] += h
            down[idx] -= h
            num[idx] = (loss(*args(up)) - loss(*args(down))) / (2 * h)
        np.testing.assert_allclose(grad, num, atol=1e-6)


def test_gradient_is_orthogonal_to_ones_and_xhat():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 64))
    gy = rng.standard_normal((5, 64))
    # Orthogonality to xhat is exact only for eps = 0 (mean(xhat**2) = var / (var + eps)).
    _, mean, rstd = ln.layer_norm(x, eps=0.0, return_stats=True)
    gx, _, _ = ln.layer_norm_backward(gy, x, mean, rstd)
    xhat = (x - mean) * rstd
    np.testing.assert_allclose(gx.sum(axis=1), 0, atol=1e-12)
    np.testing.assert_allclose((gx * xhat).sum(axis=1), 0, atol=1e-12)


