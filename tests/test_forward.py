"""Forward LayerNorm/RMSNorm against the float64 reference and against PyTorch."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln

from . import reference
from .conftest import ATOL, DTYPES, asarray, random_rows, to_numpy


def _params(rng, shape, dtype="float32"):
    w = (1.0 + 0.5 * rng.standard_normal(shape)).astype(DTYPES[dtype])
    b = (0.3 * rng.standard_normal(shape)).astype(DTYPES[dtype])
    return w, b


@pytest.mark.parametrize("n", [1, 3, 64, 127, 128, 129, 768, 1000, 4099])
def test_layer_norm_matches_reference(native_xp, dtype_name, n):
    rng = np.random.default_rng(n)
    x = random_rows(rng, (5, n), dtype_name, loc=0.5, scale=2.0)
    w, b = _params(rng, (n,))
    y, mean, rstd = ln.layer_norm(asarray(native_xp, x, dtype_name), n,
                                  asarray(native_xp, w, "float32"),
                                  asarray(native_xp, b, "float32"), return_stats=True)
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x, (1,), w, b)
    assert str(y.dtype).endswith(dtype_name)
    scale = np.abs(y_ref).max()
    np.testing.assert_allclose(to_numpy(y), y_ref.astype(np.float64), rtol=0,
                               atol=ATOL[dtype_name] * max(1.0, scale))
    acc_tol = 1e-12 if dtype_name == "float64" else 2e-6
    np.testing.assert_allclose(to_numpy(mean), mean_ref.astype(np.float64), rtol=acc_tol,
                               atol=acc_tol)
    np.testing.assert_allclose(to_numpy(rstd), rstd_ref.astype(np.float64), rtol=acc_tol * 10)
    assert mean.shape == (5, 1) and rstd.shape == (5, 1)
    assert str(mean.dtype) == ("float64" if dtype_name == "float64" else "float32")


@pytest.mark.parametrize("n", [1, 15, 16, 17, 768, 4099])
def test_rms_norm_matches_reference(native_xp, dtype_name, n):
    rng = np.random.default_rng(n + 1)
    x = random_rows(rng, (4, n), dtype_name, loc=0.2)
    w, _ = _params(rng, (n,), "float32")
    y, rstd = ln.rms_norm(asarray(native_xp, x, dtype_name), n, asarray(native_xp, w, "float32"),
                          return_stats=True)
    y_ref, rstd_ref = reference.rms_norm(x, (1,), w)
    np.testing.assert_allclose(to_numpy(y), y_ref.astype(np.float64), rtol=0,
                               atol=ATOL[dtype_name] * max(1.0, np.abs(y_ref).max()))
    acc_tol = 1e-12 if dtype_name == "float64" else 2e-6
    np.testing.assert_allclose(to_numpy(rstd), rstd_ref.astype(np.float64), rtol=acc_tol * 10)


@pytest.mark.parametrize(
    ("shape", "axes"),
    [((2, 3, 4, 5), (1,)), ((2, 3, 4, 5), (1, 2)), ((2, 3, 4, 5), (2, 3)), ((2, 3, 4, 5), (0, 2)),
     ((2, 3, 4, 5), (0, 1, 2, 3)), ((3, 200, 7), (1,)), ((6, 5), (0,)), ((4, 3, 2), (0, 2))],
)
def test_axes_anywhere(native_xp, shape, axes):
    rng = np.random.default_rng(len(shape) + sum(axes))
    x = random_rows(rng, shape, "float64")
    pshape = tuple(shape[a] for a in axes)
    w, b = _params(rng, pshape, "float64")
    xs = asarray(native_xp, x, "float64")
    ws, bs = asarray(native_xp, w, "float64"), asarray(native_xp, b, "float64")
    y, mean, rstd = ln.layer_norm(xs, weight=ws, bias=bs, axis=axes, return_stats=True)
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x, axes, w, b)
    np.testing.assert_allclose(to_numpy(y), y_ref.astype(np.float64), atol=1e-12)
    np.testing.assert_allclose(to_numpy(mean), mean_ref.astype(np.float64), atol=1e-12)
    np.testing.assert_allclose(to_numpy(rstd), rstd_ref.astype(np.float64), rtol=1e-12)
    assert tuple(mean.shape) == tuple(1 if i in axes else s for i, s in enumerate(shape))
    assert to_numpy(y).flags.c_contiguous or hasattr(y, "get")
    yr, rs = ln.rms_norm(xs, weight=ws, axis=axes, eps=1e-6, return_stats=True)
    yr_ref, rs_ref = reference.rms_norm(x, axes, w, eps=1e-6)
    np.testing.assert_allclose(to_numpy(yr), yr_ref.astype(np.float64), atol=1e-12)
    np.testing.assert_allclose(to_numpy(rs), rs_ref.astype(np.float64), rtol=1e-12)


def test_normalized_shape_equals_trailing_axes():
    rng = np.random.default_rng(3)
    x = random_rows(rng, (2, 3, 4, 5), "float32")
    a = ln.layer_norm(x, (4, 5))
    b = ln.layer_norm(x, axis=(-2, -1))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ln.layer_norm(x, 5), ln.layer_norm(x))


def test_weight_of_other_dtype_applied_in_accumulation_precision():
    rng = np.random.default_rng(5)
    x = random_rows(rng, (3, 64), "bfloat16")
    w64 = 1 + 0.1 * rng.standard_normal(64)
    y_w32 = ln.layer_norm(x, weight=w64.astype(np.float32))
    y_w16 = ln.layer_norm(x, weight=w64.astype(DTYPES["bfloat16"]))
    y_ref, _, _ = reference.layer_norm(x, (1,), w64.astype(np.float32))
    np.testing.assert_allclose(to_numpy(y_w32), y_ref.astype(np.float64), atol=3e-2)
    assert y_w32.dtype == DTYPES["bfloat16"] and y_w16.dtype == DTYPES["bfloat16"]


def test_strided_layouts_match_contiguous(native_xp):
    rng = np.random.default_rng(11)
    base = random_rows(rng, (9, 300), "float32")
    views = {
        "reversed rows": base[::-1],
        "negative stride": base[:, ::-1],
        "every other": base[:, ::2],
        "fortran": np.asfortranarray(base),
        "transposed": np.ascontiguousarray(base.T).T,
        "misaligned": base[:, 1:],
    }
    for name, v in views.items():
        x = native_xp.asarray(v) if native_xp is not np else v
        got = to_numpy(ln.layer_norm(x))
        want = to_numpy(ln.layer_norm(np.ascontiguousarray(v)))
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_output_is_new_c_contiguous_and_input_unchanged():
    rng = np.random.default_rng(2)
    x = np.asfortranarray(random_rows(rng, (6, 33), "float32"))
    before = x.copy()
    y = ln.layer_norm(x)
    assert y.flags.c_contiguous and not np.shares_memory(x, y)
    np.testing.assert_array_equal(x, before)
    y2 = ln.layer_norm(x, axis=0)
    assert y2.flags.c_contiguous and y2.shape == x.shape


def test_out_and_in_place():
    rng = np.random.default_rng(7)
    x = random_rows(rng, (8, 200), "float32")
    w, b = _params(rng, (200,))
    want = ln.layer_norm(x, weight=w, bias=b)
    out = np.empty_like(x)
    got = ln.layer_norm(x, weight=w, bias=b, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)
    x2 = x.copy()
    assert ln.layer_norm(x2, weight=w, bias=b, out=x2) is x2
    np.testing.assert_array_equal(x2, want)
    img = random_rows(rng, (2, 8, 5, 5), "float32")
    want_img = ln.layer_norm(img, axis=1)
    fortran_out = np.asfortranarray(np.empty_like(img))
    ln.layer_norm(img, axis=1, out=fortran_out)
    np.testing.assert_array_equal(fortran_out, want_img)
    ln.layer_norm(img, axis=1, out=img)
    np.testing.assert_array_equal(img, want_img)
    r = random_rows(rng, (3, 40), "float64")
    want_r = ln.rms_norm(r)
    ln.rms_norm(r, out=r)
    np.testing.assert_array_equal(r, want_r)


def test_empty_batches_and_zero_width():
    x = np.ones((0, 16), np.float32)
    y, mean, rstd = ln.layer_norm(x, return_stats=True)
    assert y.shape == (0, 16) and mean.shape == (0, 1) and rstd.shape == (0, 1)
    y, rstd = ln.rms_norm(np.ones((0, 3, 16), np.float64), return_stats=True)
    assert y.shape == (0, 3, 16) and rstd.shape == (0, 3, 1) and rstd.dtype == np.float64
    # A normalized size of 0 follows torch: empty y, mean 0, rstd NaN.
    y, mean, rstd = ln.layer_norm(np.ones((3, 0), np.float32), 0, return_stats=True)
    assert y.shape == (3, 0)
    np.testing.assert_array_equal(mean, np.zeros((3, 1), np.float32))
    assert np.isnan(rstd).all()


def test_array_api_backend_agrees_with_numba(dtype_name):
    rng = np.random.default_rng(4)
    x = random_rows(rng, (7, 3, 50), dtype_name, loc=3.0)
    w, b = _params(rng, (3, 50))
    for axis in (-1, 1, (1, 2)):
        pw = w if axis == (1, 2) else (w[0] if axis == -1 else w[:, 0])
        pb = b if axis == (1, 2) else (b[0] if axis == -1 else b[:, 0])
        fast = ln.layer_norm(x, weight=pw, bias=pb, axis=axis)
        generic = ln.layer_norm(x, weight=pw, bias=pb, axis=axis, backend="array_api")
        np.testing.assert_allclose(to_numpy(fast), to_numpy(generic), rtol=0,
                                   atol=2 * ATOL[dtype_name])


class TestTorchParity:
    torch = pytest.importorskip("torch")

    @pytest.mark.parametrize("n", [8, 768, 1000])
    def test_layer_norm(self, dtype_name, n):
        torch = self.torch
        rng = np.random.default_rng(n)
        x = random_rows(rng, (6, n), "float32")
        w, b = _params(rng, (n,))
        tdtype = getattr(torch, dtype_name)
        tx = torch.from_numpy(x).to(tdtype)
        ty = torch.nn.functional.layer_norm(tx, (n,), torch.from_numpy(w).to(tdtype),
                                            torch.from_numpy(b).to(tdtype))
        xx = asarray(np, tx.float().numpy(), dtype_name)
        wt = torch.from_numpy(w).to(tdtype).float().numpy()
        bt = torch.from_numpy(b).to(tdtype).float().numpy()
        y = ln.layer_norm(xx, n, asarray(np, wt, dtype_name), asarray(np, bt, dtype_name))
        np.testing.assert_allclose(to_numpy(y), ty.float().numpy().astype(np.float64),
                                   atol=2.5 * ATOL[dtype_name] * 4)

    @pytest.mark.parametrize("eps", [None, 1e-6])
    def test_rms_norm(self, dtype_name, eps):
        torch = self.torch
        rng = np.random.default_rng(9)
        x = random_rows(rng, (6, 96), "float32", loc=0.3)
        tdtype = getattr(torch, dtype_name)
        tx = torch.from_numpy(x).to(tdtype)
        ty = torch.nn.functional.rms_norm(tx, (96,), eps=eps)
        y = ln.rms_norm(asarray(np, tx.float().numpy(), dtype_name), 96, eps=eps)
        np.testing.assert_allclose(to_numpy(y), ty.float().numpy().astype(np.float64),
                                   atol=2.5 * ATOL[dtype_name] * 4)
