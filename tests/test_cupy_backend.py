"""The CUDA kernels of the CuPy backend, one kernel variant at a time.

Tests taking ``native_xp`` run the same body on NumPy (Numba kernels) and on CuPy (CUDA
kernels; skipped without a device), so the test logic itself is exercised on every
machine. Tests taking ``cp`` need CuPy and a CUDA device.

Every configuration of :func:`layernorm._backends._cupy.launch.row_config` (threads per
row and vectors per thread; plus the tile loop for rows longer than a tile) is hit for
every dtype, each through the contiguous "rows" kernels and the strided "cols" kernels,
and each must give the same bits for a row alone, inside a batch, under another layout
and from a misaligned view.
"""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln
from layernorm._backends._cupy import launch

from . import reference
from .conftest import ATOL, DTYPES, _cupy_or_skip, asarray, random_rows, to_numpy

GRAD_ATOL = {"float16": 2e-2, "bfloat16": 1.5e-1, "float32": 5e-5, "float64": 1e-11}


@pytest.fixture
def cp():
    """CuPy with a CUDA device, else skip."""
    return _cupy_or_skip()


def variant_lengths(dtype: str) -> list[int]:
    """Row lengths that reach every kernel configuration (and the tile loop) for ``dtype``."""
    vec = launch.vector_width(dtype)
    lengths = set()
    for g, maxc in launch.CONFIGS:
        tile = g * maxc * vec
        lengths.add(tile)
        if tile > 3:
            lengths.add(tile - 3)  # a partial last vector: the scalar tail path
    lengths.update({2048 * vec + 1, 3 * 2048 * vec + 7})  # two and four tiles
    covered = {launch.row_config(n, dtype)[:2] for n in lengths}
    assert covered == set(launch.CONFIGS)
    return sorted(lengths)


VARIANTS = [(d, n) for d in DTYPES for n in variant_lengths(d)]
#: A few variants whose test bodies also run on NumPy (Numba), so that the test logic is
#: exercised on machines without a GPU; the GPU runs all of VARIANTS.
SMOKE_VARIANTS = [("float32", 61), ("float16", 1021), ("bfloat16", 16385), ("float64", 2048)]


def _bits(a) -> np.ndarray:
    """Host copy of an array's raw bits (NaN-safe bitwise comparison)."""
    host = a.get() if hasattr(a, "get") else np.asarray(a)
    host = np.ascontiguousarray(host)
    return host.view(f"u{host.dtype.itemsize}")


def assert_same_bits(a, b) -> None:
    assert tuple(a.shape) == tuple(b.shape)
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _inputs(xp, dtype, rows, n, seed):
    rng = np.random.default_rng(seed)
    x = random_rows(rng, (rows, n), dtype, loc=0.5, scale=2.0)
    x[::5] = random_rows(rng, x[::5].shape, dtype, loc=300.0, scale=20.0)  # large offsets
    gy = random_rows(rng, (rows, n), dtype)
    acc = "float64" if dtype == "float64" else "float32"  # parameters in the acc dtype
    w = (1 + 0.3 * rng.standard_normal(n)).astype(acc)
    b = (0.5 * rng.standard_normal(n)).astype(acc)
    return (x, gy, w, b), (asarray(xp, x, dtype), asarray(xp, gy, dtype),
                           asarray(xp, w, acc), asarray(xp, b, acc))


def _all_outputs(x, gy, w, b, axis=-1):
    """Forward (y, mean, rstd), RMS (y, rstd) and both backward results for one layout."""
    y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, axis=axis, return_stats=True)
    gx, gw, gb = ln.layer_norm_backward(gy, x, mean, rstd, w, axis=axis)
    yr, rs = ln.rms_norm(x, weight=w, axis=axis, return_stats=True)
    rgx, rgw = ln.rms_norm_backward(gy, x, rs, w, axis=axis)
    return {"y": y, "mean": mean, "rstd": rstd, "gx": gx, "gw": gw, "gb": gb,
            "rms_y": yr, "rms_rstd": rs, "rms_gx": rgx, "rms_gw": rgw}


# ----------------------------------------------------------------- accuracy


@pytest.mark.parametrize(("dtype", "n"), VARIANTS)
def test_every_variant_matches_reference(cp, dtype, n):
    check_against_reference(cp, dtype, n)


@pytest.mark.parametrize(("dtype", "n"), SMOKE_VARIANTS)
def test_reference_checks_on_numpy(dtype, n):
    check_against_reference(np, dtype, n)


def check_against_reference(xp, dtype, n):
    rows = 37
    (x, gy, w, b), (xs, gys, ws, bs) = _inputs(xp, dtype, rows, n, n)
    out = _all_outputs(xs, gys, ws, bs)
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x, (1,), w, b)
    scale = max(1.0, float(np.abs(y_ref).max()))
    np.testing.assert_allclose(to_numpy(out["y"]), y_ref.astype(np.float64), rtol=0,
                               atol=ATOL[dtype] * scale)
    acc_tol = 1e-12 if dtype == "float64" else 2e-6
    np.testing.assert_allclose(to_numpy(out["mean"]), mean_ref.astype(np.float64),
                               rtol=acc_tol, atol=acc_tol)
    np.testing.assert_allclose(to_numpy(out["rstd"]), rstd_ref.astype(np.float64),
                               rtol=acc_tol * 10)
    yr_ref, rs_ref = reference.rms_norm(x, (1,), w)
    np.testing.assert_allclose(to_numpy(out["rms_y"]), yr_ref.astype(np.float64), rtol=0,
                               atol=ATOL[dtype] * max(1.0, float(np.abs(yr_ref).max())))
    np.testing.assert_allclose(to_numpy(out["rms_rstd"]), rs_ref.astype(np.float64),
                               rtol=acc_tol * 10)
    tol = GRAD_ATOL[dtype]
    gx_ref, gw_ref, gb_ref = reference.layer_norm_backward(gy, x, (1,), w)
    gscale = max(1.0, float(np.abs(gx_ref).max()))
    np.testing.assert_allclose(to_numpy(out["gx"]), gx_ref.astype(np.float64), rtol=0,
                               atol=tol * 4 * gscale)
    wscale = max(1.0, float(np.abs(gw_ref).max()))
    np.testing.assert_allclose(to_numpy(out["gw"]), gw_ref.astype(np.float64), rtol=0,
                               atol=tol * 40 * wscale)
    np.testing.assert_allclose(to_numpy(out["gb"]), gb_ref.astype(np.float64), rtol=0,
                               atol=tol * 40 * max(1.0, float(np.abs(gb_ref).max())))
    rgx_ref, rgw_ref = reference.rms_norm_backward(gy, x, (1,), w)
    np.testing.assert_allclose(to_numpy(out["rms_gx"]), rgx_ref.astype(np.float64), rtol=0,
                               atol=tol * 4 * max(1.0, float(np.abs(rgx_ref).max())))
    np.testing.assert_allclose(to_numpy(out["rms_gw"]), rgw_ref.astype(np.float64), rtol=0,
                               atol=tol * 40 * max(1.0, float(np.abs(rgw_ref).max())))


# ------------------------------------------------------- bitwise invariance


@pytest.mark.parametrize(("dtype", "n"), VARIANTS)
def test_every_variant_is_batch_and_layout_invariant(cp, dtype, n):
    check_invariance(cp, dtype, n)


@pytest.mark.parametrize(("dtype", "n"), SMOKE_VARIANTS)
def test_invariance_checks_on_numpy(dtype, n):
    check_invariance(np, dtype, n)


def check_invariance(xp, dtype, n):
    """Alone, in a batch, channels-first, Fortran order, misaligned: the same bits."""
    rows = 37  # more than one 32-row block of the cols kernels, not a multiple of it
    _, (xs, gys, ws, bs) = _inputs(xp, dtype, rows, n, n + 1)
    ref = _all_outputs(xs, gys, ws, bs)
    stats = ("mean", "rstd", "rms_rstd")

    # Each row alone (rows kernels, one row: the grid shrinks to one block).
    for r in (0, 5, rows - 1):
        alone = _all_outputs(xs[r:r + 1], gys[r:r + 1], ws, bs)
        for key in ("y", "gx", "rms_y", "rms_gx", *stats):
            assert_same_bits(alone[key][0], ref[key][r])

    # Channels-first (1, n, rows) with axis=1: the strided kernels, inner > 1.
    xcf = xp.ascontiguousarray(xs.T)[None]
    gcf = xp.ascontiguousarray(gys.T)[None]
    cf = _all_outputs(xcf, gcf, ws, bs, axis=1)
    for key in ("y", "gx", "rms_y", "rms_gx"):
        assert_same_bits(cf[key][0].T, ref[key])
    for key in stats:
        assert_same_bits(cf[key].reshape(-1), ref[key].reshape(-1))
    for key in ("gw", "gb", "rms_gw"):  # same rows in the same order: same sums
        assert_same_bits(cf[key], ref[key])

    # Fortran order (rows, n) with strides (1, rows): the strided kernels, inner == 1.
    xf = xp.asfortranarray(xs)
    gf = xp.asfortranarray(gys)
    fo = _all_outputs(xf, gf, ws, bs)
    for key in ("y", "gx", "rms_y", "rms_gx", *stats, "gw", "gb", "rms_gw"):
        assert_same_bits(fo[key], ref[key])

    # Misaligned views x[1:, 1:] of a larger array: scalar loads instead of 16-byte ones.
    big = xp.zeros((rows + 1, n + 1), dtype=xs.dtype)
    big[1:, 1:] = xs
    gbig = xp.zeros((rows + 1, n + 1), dtype=xs.dtype)
    gbig[1:, 1:] = gys
    mis = _all_outputs(big[1:, 1:], gbig[1:, 1:], ws, bs)
    for key in ("y", "gx", "rms_y", "rms_gx", *stats, "gw", "gb", "rms_gw"):
        assert_same_bits(mis[key], ref[key])


def test_misaligned_half_views(native_xp):
    """x[:, 1:] and x[1:] of float16 arrays (2-byte offsets, odd row strides)."""
    xp = native_xp
    rng = np.random.default_rng(7)
    for n in (64, 768, 1000, 4096):
        x = random_rows(rng, (9, n + 1), "float16", loc=1.0)
        xs = asarray(xp, x, "float16")
        for view, host in ((xs[:, 1:], x[:, 1:]), (xs[1:], x[1:]), (xs[1:, 1:], x[1:, 1:])):
            y = ln.layer_norm(view)
            assert_same_bits(y, ln.layer_norm(xp.ascontiguousarray(view)))
            y_ref, _, _ = reference.layer_norm(np.ascontiguousarray(host), (1,))
            np.testing.assert_allclose(to_numpy(y), y_ref.astype(np.float64), rtol=0,
                                       atol=ATOL["float16"] * float(np.abs(y_ref).max()))
            assert_same_bits(ln.rms_norm(view), ln.rms_norm(xp.ascontiguousarray(view)))


def test_negative_strides(native_xp):
    xp = native_xp
    rng = np.random.default_rng(8)
    x = asarray(xp, random_rows(rng, (20, 300), "float32"), "float32")
    for view in (x[::-1], x[:, ::-1], x[::-2, ::-1]):
        assert_same_bits(ln.layer_norm(view), ln.layer_norm(xp.ascontiguousarray(view)))
        assert_same_bits(ln.rms_norm(view), ln.rms_norm(xp.ascontiguousarray(view)))


def test_channels_first_images(native_xp, dtype_name):
    """axis=1 of NCHW images against the reference and, bitwise, against channels-last rows."""
    xp = native_xp
    rng = np.random.default_rng(11)
    for c in (3, 96, 768):
        img = random_rows(rng, (2, c, 7, 9), dtype_name, loc=3.0)
        w = (1 + 0.2 * rng.standard_normal(c)).astype(np.float32)
        b = rng.standard_normal(c).astype(np.float32)
        xs = asarray(xp, img, dtype_name)
        ws, bs = asarray(xp, w, "float32"), asarray(xp, b, "float32")
        y, mean, rstd = ln.layer_norm(xs, weight=ws, bias=bs, axis=1, return_stats=True)
        y_ref, _, _ = reference.layer_norm(img, (1,), w, b)
        np.testing.assert_allclose(to_numpy(y), y_ref.astype(np.float64), rtol=0,
                                   atol=ATOL[dtype_name] * max(1.0, float(np.abs(y_ref).max())))
        assert tuple(mean.shape) == (2, 1, 7, 9) and tuple(rstd.shape) == (2, 1, 7, 9)
        last = xp.ascontiguousarray(xp.moveaxis(xs, 1, -1))
        y_last = ln.layer_norm(last, weight=ws, bias=bs)
        assert_same_bits(xp.moveaxis(y, 1, -1), y_last)
        # channels_last memory seen as NCHW: normalized axis contiguous, inner > 1.
        nchw_view = xp.moveaxis(last, -1, 1)
        assert_same_bits(ln.layer_norm(nchw_view, weight=ws, bias=bs, axis=1), y)


# ------------------------------------------------------------ out= and in place


@pytest.mark.parametrize("n", [100, 1024, 20000])
def test_out_and_in_place(native_xp, dtype_name, n):
    xp = native_xp
    rng = np.random.default_rng(n)
    x = asarray(xp, random_rows(rng, (6, n), dtype_name, loc=2.0), dtype_name)
    w = asarray(xp, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32), "float32")
    expected = ln.layer_norm(x, weight=w, bias=w)
    expected_rms = ln.rms_norm(x, weight=w)
    out = xp.empty_like(x)
    res = ln.layer_norm(x, weight=w, bias=w, out=out)
    assert res is out
    assert_same_bits(out, expected)
    inplace = x.copy()
    assert ln.layer_norm(inplace, weight=w, bias=w, out=inplace) is inplace
    assert_same_bits(inplace, expected)
    inplace = x.copy()
    ln.rms_norm(inplace, weight=w, out=inplace)
    assert_same_bits(inplace, expected_rms)
    # Channels-first in place: the strided kernels read a row before writing it.
    cf = xp.ascontiguousarray(x.T)[None]
    ln.layer_norm(cf, weight=w, bias=w, axis=1, out=cf)
    assert_same_bits(cf[0].T, expected)
    # A Fortran-ordered out for a C-ordered x.
    fout = xp.asfortranarray(xp.empty_like(x))
    ln.layer_norm(x, weight=w, bias=w, out=fout)
    assert_same_bits(fout, expected)


def test_empty_inputs(native_xp):
    xp = native_xp
    for shape in ((0, 16), (0, 5000), (4, 0, 3)):
        x = xp.zeros(shape, dtype=xp.float32)
        axis = 1 if len(shape) == 3 else -1
        y, mean, rstd = ln.layer_norm(x, axis=axis, return_stats=True)
        assert tuple(y.shape) == shape
        gx, gw, gb = ln.layer_norm_backward(x, x, mean, rstd, axis=axis)
        assert tuple(gx.shape) == shape
        assert tuple(gw.shape) == (shape[axis],) and tuple(gb.shape) == (shape[axis],)
        assert not np.any(to_numpy(gw)) and not np.any(to_numpy(gb))


# --------------------------------------------------------------- determinism


def test_parameter_gradients_are_reproducible(native_xp):
    xp = native_xp
    for rows, n in ((1000, 768), (70, 5000), (4096, 64)):
        (x, gy, w, _), (xs, gys, ws, bs) = _inputs(xp, "float32", rows, n, rows)
        first = _all_outputs(xs, gys, ws, bs)
        again = _all_outputs(xs, gys, ws, bs)
        for key in ("gw", "gb", "rms_gw", "gx", "y"):
            assert_same_bits(first[key], again[key])
        _, gw_ref, gb_ref = reference.layer_norm_backward(gy, x, (1,), w)
        np.testing.assert_allclose(to_numpy(first["gb"]), gb_ref.astype(np.float64),
                                   rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(to_numpy(first["gw"]), gw_ref.astype(np.float64),
                                   rtol=1e-4, atol=1e-2)


def test_many_rows_use_grid_stride_loops(native_xp):
    """More rows than one grid holds: every row still comes out as when alone."""
    xp = native_xp
    rows = 300_000 if xp is not np else 3_000
    rng = np.random.default_rng(5)
    x = asarray(xp, random_rows(rng, (rows, 64), "float32", scale=3.0), "float32")
    y = ln.layer_norm(x)
    for r in (0, rows // 2 + 1, rows - 1):
        assert_same_bits(ln.layer_norm(x[r:r + 1])[0], y[r])
    cf = xp.ascontiguousarray(x.T)[None]
    assert_same_bits(ln.layer_norm(cf, axis=1)[0].T, y)


def test_constant_rows_and_nan_rows_in_every_family(native_xp):
    xp = native_xp
    for n in (40, 3000, 40000):
        x = np.full((6, n), 1e4 / 3, np.float32)
        x[2, n // 2] = np.nan
        x[4, 0] = np.inf
        b = np.linspace(-1, 1, n).astype(np.float32)
        xs, bs = asarray(xp, x, "float32"), asarray(xp, b, "float32")
        for arr, axis in ((xs, -1), (xp.ascontiguousarray(xs.T)[None], 1)):
            y = to_numpy(ln.layer_norm(arr, bias=bs, axis=axis))
            y = y if axis == -1 else y[0].T
            for r in (0, 1, 3, 5):
                np.testing.assert_array_equal(y[r], b.astype(np.float64))
            assert np.isnan(y[2]).all() and np.isnan(y[4]).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_subnormal_deviations_with_eps_zero(native_xp, dtype):
    """eps=0 and squared deviations below 1e-38 (subnormal in float32): the row is still
    normalized. (The CUDA kernels are compiled without flush-to-zero for this.)"""
    xp = native_xp
    rng = np.random.default_rng(11)
    for n in (64, 3000):  # short rows (a few lanes) and a block per row
        x = random_rows(rng, (3, n), dtype, scale=3e-21)
        y, _, rstd = ln.layer_norm(asarray(xp, x, dtype), eps=0.0, return_stats=True)
        assert np.isfinite(to_numpy(rstd)).all()
        y_ref, _, _ = reference.layer_norm(x, (1,), eps=0.0)
        np.testing.assert_allclose(to_numpy(y), y_ref.astype(np.float64), rtol=0,
                                   atol=5e-2 if dtype == "bfloat16" else 2e-3)


# ------------------------------------------------------------------ CuPy only


def test_strided_rows_take_the_row_kernels(cp):
    """x[:, ::2] and few Fortran-order rows: row kernels with an element stride; many
    Fortran-order rows: the cols kernels. Every one gives the contiguous bits."""
    sms = launch._sm_count(cp.cuda.Device().id)
    for rows, n in ((37, 1000), (32 * sms + 5, 40), (5, 20000)):
        _, (xs, gys, ws, bs) = _inputs(cp, "float32", rows, n, rows + n)
        ref = _all_outputs(xs, gys, ws, bs)
        wide = cp.zeros((rows, 2 * n), cp.float32)
        wide[:, ::2] = xs
        gwide = cp.zeros((rows, 2 * n), cp.float32)
        gwide[:, ::2] = gys
        for xv, gv in ((wide[:, ::2], gwide[:, ::2]),  # element stride 2
                       (cp.asfortranarray(xs), cp.asfortranarray(gys))):
            got = _all_outputs(xv, gv, ws, bs)
            for key in ref:
                assert_same_bits(got[key], ref[key])


def test_parameter_gradient_tree_is_grid_independent(cp, monkeypatch):
    """Many row blocks (three tree levels): the same bits with grids of 1 block."""
    rows = launch.GRAD_ROW_BLOCK * launch.SUM_FAN ** 2 + 7
    (_, _, _, _), (xs, gys, ws, bs) = _inputs(cp, "float32", rows, 48, 9)
    ref = _all_outputs(xs, gys, ws, bs)
    grid = launch._grid
    monkeypatch.setattr(launch, "_grid", lambda *args: min(grid(*args), 1))
    got = _all_outputs(xs, gys, ws, bs)
    for key in ("gw", "gb", "rms_gw", "gx", "y"):
        assert_same_bits(got[key], ref[key])


def test_bfloat16_as_uint16_bits(cp):
    """The backend interface takes bfloat16 data as uint16 bits with dtype="bfloat16"."""
    import ml_dtypes

    from layernorm._backends import _cupy as backend

    rng = np.random.default_rng(0)
    for n in (8, 768, 5000):
        host = random_rows(rng, (5, n), "bfloat16", loc=1.0)
        x3 = cp.asarray(host.view(np.uint16)).reshape(5, n, 1)
        y3 = cp.empty_like(x3)
        mean = cp.empty(5, dtype=cp.float32)
        rstd = cp.empty(5, dtype=cp.float32)
        w = cp.asarray(np.linspace(0.5, 1.5, n, dtype=np.float32))
        backend.layer_norm_forward(x3, w, None, 1e-5, y3, mean, rstd, "bfloat16")
        y = y3.get().reshape(5, n).view(ml_dtypes.bfloat16).astype(np.float64)
        y_ref, mean_ref, _ = reference.layer_norm(host, (1,), w.get())
        np.testing.assert_allclose(y, y_ref.astype(np.float64), rtol=0,
                                   atol=ATOL["bfloat16"] * float(np.abs(y_ref).max()))
        np.testing.assert_allclose(mean.get(), mean_ref.ravel().astype(np.float64), rtol=1e-5)
        gx3 = cp.empty_like(x3)
        gw, gb = backend.layer_norm_backward(x3, x3, mean, rstd, w, gx3, "bfloat16")
        assert gw.dtype == cp.float32 and gb.shape == (n,)
        gw_r = backend.rms_norm_backward(x3, x3, rstd, None, gx3, "bfloat16")
        assert gw_r.shape == (n,)


def test_runs_on_the_current_stream_and_device(cp):
    rng = np.random.default_rng(1)
    x = cp.asarray(random_rows(rng, (64, 1024), "float32"))
    expected = ln.layer_norm(x)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        y = ln.layer_norm(x)
        gx, _, _ = ln.layer_norm_backward(x, x, *ln.layer_norm(x, return_stats=True)[1:])
    stream.synchronize()
    assert_same_bits(y, expected)
    assert gx.shape == x.shape
    if cp.cuda.runtime.getDeviceCount() > 1:
        with cp.cuda.Device(1):
            x1 = cp.asarray(x.get())
        assert_same_bits(ln.layer_norm(x1), expected)
        assert ln.layer_norm(x1).device.id == 1


def test_kernels_are_compiled_once_per_device(cp):
    x = cp.ones((4, 100), dtype=cp.float32)
    x[:, ::2] = 3
    ln.layer_norm(x)
    before = launch._kernel.cache_info()
    ln.layer_norm(x)
    after = launch._kernel.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


@pytest.mark.slow
def test_more_than_2_to_31_elements(cp):
    """64-bit offsets: rows beyond element 2**31 come out right (half data, ~4.3 GB each)."""
    n = 4096
    rows = (1 << 31) // n + 3
    try:
        x = cp.empty((rows, n), dtype=cp.float16)
        y = cp.empty_like(x)
    except cp.cuda.memory.OutOfMemoryError:
        pytest.skip("not enough device memory for a 2**31-element array")
    rng = np.random.default_rng(2)
    tail = random_rows(rng, (4, n), "float16", loc=5.0)
    x[:1] = cp.asarray(tail[:1])
    x[-3:] = cp.asarray(tail[1:])
    x[1:-3] = 1
    ln.layer_norm(x, out=y)
    y_ref, _, _ = reference.layer_norm(tail, (1,))
    got = np.concatenate([y[:1].get(), y[-3:].get()]).astype(np.float64)
    np.testing.assert_allclose(got, y_ref.astype(np.float64), rtol=0,
                               atol=ATOL["float16"] * float(np.abs(y_ref).max()))
    assert not cp.any(y[1:-3]).item()  # constant rows: exactly 0
    del y
    # The strided kernels with element offsets past 2**31: normalize axis 0 (columns of
    # 524291 elements, element stride n).
    yc = ln.layer_norm(x, axis=0)
    for j in (0, n - 1):
        col = x[:, j].get()[:, None]
        yc_ref, _, _ = reference.layer_norm(col, (0,))
        np.testing.assert_allclose(yc[:, j].get().astype(np.float64)[:, None],
                                   yc_ref.astype(np.float64), rtol=0,
                                   atol=ATOL["float16"] * float(np.abs(yc_ref).max()))



# ------------------------------------------------------ fused residual add


#: (x, residual, h) dtypes of the fused kernels CuPy can hold (it has no bfloat16); the
#: last has no instantiation of its own (the residual is widened to float32 first).
ADD_CASES = [("float32", "float32", "float32"), ("float16", "float16", "float16"),
             ("float16", "float16", "float32"), ("float16", "float32", "float32"),
             ("float16", "float32", "float16"), ("float64", "float64", "float64"),
             ("float32", "float16", "float32")]


def _backend_module(xp):
    import importlib

    return importlib.import_module("layernorm._backends." + ("_numba" if xp is np else "_cupy"))


@pytest.mark.parametrize("dtypes", ADD_CASES)
def test_fused_add_is_the_composition(native_xp, monkeypatch, dtypes):
    """add_layer_norm / add_rms_norm take the backend's one-kernel fusion (every kernel
    configuration of h's dtype on CuPy, a few lengths on NumPy) and give, bit for bit, the
    composition h = (x + r) rounded once, then layer_norm(h) / rms_norm(h) cast to x's
    dtype, with the statistics of h; in place too (h into r, y into x)."""
    xp = native_xp
    x_name, r_name, h_name = dtypes
    backend = _backend_module(xp)
    calls = []
    for fn in ("add_layer_norm_forward", "add_rms_norm_forward"):
        real = getattr(backend, fn)
        monkeypatch.setattr(backend, fn, lambda *a, _real=real, _fn=fn: (calls.append(_fn),
                                                                         _real(*a))[1])
    if xp is np:  # repeated NumPy calls run the same kernels through the short path
        from layernorm import _fast_add

        real_short = _fast_add.add_norm

        def short_spy(*args):
            result = real_short(*args)
            if result is not None:
                calls.append("short path")
            return result

        monkeypatch.setattr(_fast_add, "add_norm", short_spy)
    lengths = variant_lengths(h_name) if xp is not np else [7, 300, 4099]
    acc = np.float64 if x_name == "float64" else np.float32
    for n in lengths:
        rng = np.random.default_rng(n)
        rows = 9
        x = asarray(xp, random_rows(rng, (rows, n), x_name, loc=0.5, scale=2.0), x_name)
        r = asarray(xp, random_rows(rng, (rows, n), r_name, loc=-0.25), r_name)
        w = asarray(xp, (1 + 0.3 * rng.standard_normal(n)).astype(acc), acc.__name__)
        b = asarray(xp, (0.5 * rng.standard_normal(n)).astype(acc), acc.__name__)
        h_ref = (x.astype(acc) + r.astype(acc)).astype(h_name)
        for rms in (False, True):
            kw = {"weight": w} if rms else {"weight": w, "bias": b}
            norm, add = (ln.rms_norm, ln.add_rms_norm) if rms else (ln.layer_norm,
                                                                     ln.add_layer_norm)
            y_ref, *stats_ref = norm(h_ref, return_stats=True, **kw)
            y_ref = y_ref.astype(x_name)
            calls.clear()
            y, h, *stats = add(x, r, residual_dtype=h_name, return_stats=True, **kw)
            assert len(calls) == 1, (n, rms)
            assert_same_bits(h, h_ref)
            assert_same_bits(y, y_ref)
            for s, s_ref in zip(stats, stats_ref, strict=True):
                assert_same_bits(s, s_ref)
            xi, ri = x.copy(), r.copy()
            res_out = ri if r_name == h_name else None
            y2, h2 = add(xi, ri, residual_dtype=h_name, out=xi, residual_out=res_out, **kw)
            assert y2 is xi and (res_out is None or h2 is ri)
            assert_same_bits(y2, y_ref)
            assert_same_bits(h2, h_ref)


# ------------------------------------------- quantized output and grad_residual


def test_cupy_backend_offers_the_fused_quantize_and_grad_residual():
    """The engine finds the CUDA backend's fusions (no GPU needed): ``quantized_forward``
    with the Numba backend's signature, and backward functions that take
    ``grad_residual`` themselves (``FUSES_GRAD_RESIDUAL``)."""
    import inspect
    import types

    from layernorm import _engine
    from layernorm._backends import _cupy, _numba

    assert _engine.fuses_grad_residual(types.SimpleNamespace(backend="cupy"))
    for name in ("quantized_forward", "layer_norm_backward", "rms_norm_backward"):
        ours = list(inspect.signature(getattr(_cupy, name)).parameters)
        theirs = list(inspect.signature(getattr(_numba, name)).parameters)
        assert ours == theirs, name


def _quantize_rows(y32, fmt, scale=None):
    """The contract's quantization of float32 rows, in NumPy (float8 via ml_dtypes)."""
    import ml_dtypes

    qmax = np.float32({"int8": 127, "float8_e4m3fn": 448, "float8_e5m2": 57344}[fmt])
    y32 = np.asarray(y32, np.float32)
    if scale is None:
        amax = np.max(np.abs(y32), axis=1, keepdims=True)
        s = np.where(amax == 0, np.float32(1), amax / qmax).astype(np.float32)
    else:
        s = np.full((y32.shape[0], 1), scale, np.float32)
    v = (y32 * (np.float32(1) / s)).astype(np.float32)
    if fmt == "int8":
        return np.rint(np.clip(np.where(np.isnan(v), 0, v), -128, 127)).astype(np.int8), s
    return np.clip(v, -qmax, qmax).astype(getattr(ml_dtypes, fmt)), s


@pytest.mark.parametrize("x_name", ["float32", "float16"])
def test_quantized_forward_is_fused(native_xp, monkeypatch, x_name):
    """layer_norm / rms_norm / add_* with quantize= run the backend's one-kernel
    quantization (never the engine's quantize_rows) and give the contract's codes and
    scales for the y32 of the composition (the float32 forward of the widened x or h),
    bit for bit; every kernel configuration on CuPy (int8: CuPy has no float8 dtypes)."""
    from layernorm import _engine, _fast

    xp = native_xp
    backend = _backend_module(xp)
    calls = []
    real = backend.quantized_forward
    monkeypatch.setattr(backend, "quantized_forward",
                        lambda *a: (calls.append(a[9]), real(*a))[1])
    real_short = _fast.run_quantized

    def short_spy(*args):
        # Small NumPy float32 calls reach the same kernels through the short paths'
        # runner (its codes array, argument 4, has the format's dtype).
        result = real_short(*args)
        if result is not None:
            calls.append(args[4].dtype.name)
        return result

    monkeypatch.setattr(_fast, "run_quantized", short_spy)
    monkeypatch.setattr(_engine, "quantize_rows", lambda *a, **k: pytest.fail("composed"))
    formats = ["int8"] if xp is not np else ["int8", "float8_e4m3fn", "float8_e5m2"]
    lengths = variant_lengths("float32") if xp is not np else [7, 300, 4099]
    for n in lengths:
        rng = np.random.default_rng(n)
        rows = 9
        x = random_rows(rng, (rows, n), x_name, loc=0.5, scale=2.0)
        x[4, n // 2] = np.nan
        r = random_rows(rng, (rows, n), "float32", loc=-0.25)
        w = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
        b = (0.5 * rng.standard_normal(n)).astype(np.float32)
        xs, rs, ws, bs = (asarray(xp, a, d) for a, d in ((x, x_name), (r, "float32"),
                                                          (w, "float32"), (b, "float32")))
        h = x.astype(np.float32) + r
        for k, fmt in enumerate(formats * 2):
            rms = k % 2 == 1
            scale = None if k < len(formats) else 0.125
            kw = {"weight": ws} if rms else {"weight": ws, "bias": bs}
            norm, add = (ln.rms_norm, ln.add_rms_norm) if rms else (ln.layer_norm,
                                                                     ln.add_layer_norm)
            for a, residual in ((x, None), (h, rs)):
                y32 = to_numpy(norm(asarray(xp, a.astype(np.float32), "float32"), **kw))
                q_ref, s_ref = _quantize_rows(y32.astype(np.float32), fmt, scale)
                calls.clear()
                if residual is None:
                    q, s = norm(xs, quantize=fmt, scale=scale, **kw)
                else:
                    q, _, s = add(xs, residual, residual_dtype="float32", quantize=fmt,
                                  scale=scale, **kw)
                assert calls == [fmt], (n, fmt)
                q = q.get() if hasattr(q, "get") else q
                if fmt == "int8":
                    assert_same_bits(q, q_ref)
                else:
                    nan = np.isnan(q_ref.astype(np.float32))
                    assert np.array_equal(np.isnan(q.astype(np.float32)), nan)
                    assert_same_bits(np.where(nan, 0, q), np.where(nan, 0, q_ref))
                if scale is None:
                    assert_same_bits(np.nan_to_num(to_numpy(s)).astype(np.float32),
                                     np.nan_to_num(s_ref))
                else:
                    assert s == scale


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_grad_residual_is_fused(native_xp, monkeypatch, dtype):
    """layer_norm_backward / rms_norm_backward hand grad_residual to the backend's
    backward kernels; float32 and float64 give grad_x + grad_residual bit for bit, 16-bit
    the sum rounded once (a zero grad_residual leaves grad_x's bits); rows and the
    channels-first (cols) kernels."""
    from layernorm import _fast_backward

    xp = native_xp
    backend = _backend_module(xp)
    seen = []
    for fn in ("layer_norm_backward", "rms_norm_backward"):
        real = getattr(backend, fn)
        monkeypatch.setattr(backend, fn, lambda *a, _real=real, **k: (
            seen.append("grad_residual" in k), _real(*a, **k))[1])
    real_short = _fast_backward.gradients

    def short_spy(*args):
        # Repeated NumPy calls reach the same kernels through the short path.
        result = real_short(*args)
        if result is not None:
            seen.append(args[7] is not None)
        return result

    monkeypatch.setattr(_fast_backward, "gradients", short_spy)
    lengths = variant_lengths(dtype) if xp is not np else [7, 1000]
    for n in lengths:
        _, (xs, gys, ws, bs) = _inputs(xp, dtype, 9, n, n)
        gr = random_rows(np.random.default_rng(n + 1), (9, n), dtype, scale=3.0)
        grs = asarray(xp, gr, dtype)
        for axis, t in ((-1, lambda a: a), (0, lambda a: a.T.copy())):
            xa, gya, gra = (t(a) for a in (xs, gys, grs))
            _, mean, rstd = ln.layer_norm(xa, weight=ws, bias=bs, axis=axis, return_stats=True)
            _, rs = ln.rms_norm(xa, weight=ws, axis=axis, return_stats=True)
            for rms in (False, True):
                stats = (rs,) if rms else (mean, rstd)
                bwd = ln.rms_norm_backward if rms else ln.layer_norm_backward
                plain = bwd(gya, xa, *stats, ws, axis=axis)
                seen.clear()
                fused = bwd(gya, xa, *stats, ws, axis=axis, grad_residual=gra)
                zero = bwd(gya, xa, *stats, ws, axis=axis, grad_residual=xp.zeros_like(gra))
                assert seen == [True, True], seen  # both handed to the backend
                assert_same_bits(zero[0], plain[0])
                for p, f in zip(plain[1:], fused[1:], strict=True):
                    assert_same_bits(f, p)
                if dtype in ("float32", "float64"):
                    assert_same_bits(fused[0], plain[0] + gra)
                else:
                    want = to_numpy(plain[0]) + to_numpy(gra)
                    np.testing.assert_allclose(to_numpy(fused[0]), want, rtol=2e-3,
                                               atol=2e-3 * np.abs(want).max())
