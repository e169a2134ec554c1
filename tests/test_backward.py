"""Backward passes against the float64 reference, PyTorch autograd and finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln

from . import reference
from .conftest import DTYPES, asarray, random_rows, to_numpy

GRAD_ATOL = {"float16": 2e-2, "bfloat16": 1.5e-1, "float32": 5e-5, "float64": 1e-11}


@pytest.mark.parametrize("n", [7, 128, 1000])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_backward_matches_reference(native_xp, dtype_name, n, affine):
    rng = np.random.default_rng(n)
    x = random_rows(rng, (37, n), dtype_name, loc=1.0, scale=2.0)
    gy = random_rows(rng, (37, n), dtype_name)
    w = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32) if affine else None
    xs = asarray(native_xp, x, dtype_name)
    ws = None if w is None else asarray(native_xp, w, "float32")
    _, mean, rstd = ln.layer_norm(xs, weight=ws, return_stats=True)
    gx, gw, gb = ln.layer_norm_backward(asarray(native_xp, gy, dtype_name), xs, mean, rstd, ws)
    gx_ref, gw_ref, gb_ref = reference.layer_norm_backward(gy, x, (1,), w)
    tol = GRAD_ATOL[dtype_name]
    np.testing.assert_allclose(to_numpy(gx), gx_ref.astype(np.float64), atol=tol * 4, rtol=0)
    np.testing.assert_allclose(to_numpy(gw), gw_ref.astype(np.float64), atol=tol * 40, rtol=1e-4)
    np.testing.assert_allclose(to_numpy(gb), gb_ref.astype(np.float64), atol=tol * 40, rtol=1e-4)
    assert str(gx.dtype).endswith(dtype_name)
    assert str(gw.dtype).endswith("float32" if affine else dtype_name)
    assert gw.shape == (n,) and gb.shape == (n,)


@pytest.mark.parametrize("n", [5, 300])
def test_rms_norm_backward_matches_reference(native_xp, dtype_name, n):
    rng = np.random.default_rng(n + 3)
    x = random_rows(rng, (21, n), dtype_name, loc=0.5)
    gy = random_rows(rng, (21, n), dtype_name)
    w = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    xs = asarray(native_xp, x, dtype_name)
    _, rstd = ln.rms_norm(xs, weight=asarray(native_xp, w, "float32"), return_stats=True)
    gx, gw = ln.rms_norm_backward(asarray(native_xp, gy, dtype_name), xs, rstd,
                                  asarray(native_xp, w, "float32"))
    gx_ref, gw_ref = reference.rms_norm_backward(gy, x, (1,), w)
    tol = GRAD_ATOL[dtype_name]
    np.testing.assert_allclose(to_numpy(gx), gx_ref.astype(np.float64), atol=tol * 4, rtol=0)
    np.testing.assert_allclose(to_numpy(gw), gw_ref.astype(np.float64), atol=tol * 40, rtol=1e-4)


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


def test_weight_none_gives_gradient_of_unit_weight():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    gy = rng.standard_normal((6, 10)).astype(np.float32)
    _, mean, rstd = ln.layer_norm(x, return_stats=True)
    a = ln.layer_norm_backward(gy, x, mean, rstd)
    b = ln.layer_norm_backward(gy, x, mean, rstd, np.ones(10, np.float32))
    for g, h in zip(a, b, strict=True):
        np.testing.assert_array_equal(g, h)
    assert a[1].dtype == np.float32


def test_empty_and_zero_width_backward():
    x = np.ones((0, 8), np.float32)
    _, mean, rstd = ln.layer_norm(x, return_stats=True)
    gx, gw, gb = ln.layer_norm_backward(x, x, mean, rstd)
    assert gx.shape == (0, 8)
    np.testing.assert_array_equal(gw, np.zeros(8, np.float32))
    np.testing.assert_array_equal(gb, np.zeros(8, np.float32))


class TestTorchAutograd:
    torch = pytest.importorskip("torch")

    @pytest.mark.parametrize("dtype_name", ["float32", "float64", "bfloat16"])
    def test_layer_norm_backward(self, dtype_name):
        torch = self.torch
        rng = np.random.default_rng(3)
        x = rng.standard_normal((16, 96)).astype(np.float32)
        gy = rng.standard_normal((16, 96)).astype(np.float32)
        w = (1 + 0.2 * rng.standard_normal(96)).astype(np.float32)
        b = rng.standard_normal(96).astype(np.float32)
        tdt = getattr(torch, dtype_name)
        tx = torch.from_numpy(x).to(tdt).requires_grad_()
        tw = torch.from_numpy(w).to(tdt).requires_grad_()
        tb = torch.from_numpy(b).to(tdt).requires_grad_()
        tgy = torch.from_numpy(gy).to(tdt)
        torch.nn.functional.layer_norm(tx, (96,), tw, tb).backward(tgy)
        xs = asarray(np, tx.detach().float().numpy(), dtype_name)
        ws = asarray(np, tw.detach().float().numpy(), dtype_name)
        gys = asarray(np, tgy.float().numpy(), dtype_name)
        _, mean, rstd = ln.layer_norm(xs, weight=ws, return_stats=True)
        gx, gw, gb = ln.layer_norm_backward(gys, xs, mean, rstd, ws)
        tol = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 0.25}[dtype_name]
        np.testing.assert_allclose(to_numpy(gx), to_numpy(tx.grad), atol=tol)
        np.testing.assert_allclose(to_numpy(gw), to_numpy(tw.grad), atol=tol * 40, rtol=2e-2)
        np.testing.assert_allclose(to_numpy(gb), to_numpy(tb.grad), atol=tol * 40, rtol=2e-2)
        assert gw.dtype == DTYPES[dtype_name]

    def test_rms_norm_backward(self):
        torch = self.torch
        rng = np.random.default_rng(4)
        x = rng.standard_normal((8, 50))
        gy = rng.standard_normal((8, 50))
        w = 1 + 0.2 * rng.standard_normal(50)
        tx = torch.from_numpy(x).requires_grad_()
        tw = torch.from_numpy(w).requires_grad_()
        torch.nn.functional.rms_norm(tx, (50,), tw).backward(torch.from_numpy(gy))
        _, rstd = ln.rms_norm(x, weight=w, return_stats=True)
        gx, gw = ln.rms_norm_backward(gy, x, rstd, w)
        np.testing.assert_allclose(gx, tx.grad.numpy(), atol=1e-12)
        np.testing.assert_allclose(gw, tw.grad.numpy(), atol=1e-11)
