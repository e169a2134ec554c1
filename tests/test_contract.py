"""The contract of /work/shared/API.md, one body per behaviour, run on every array library.

Every test takes the ``library`` fixture (see ``conftest.py``): the same body runs on
NumPy (Numba kernels), torch (DLPack to the same kernels), Dask (blocks through them),
array_api_strict and JAX (the generic path) and CuPy (CUDA kernels, skipped without a
GPU). Expected values come from ``tests/reference.py`` (float64 formulas), never from
the code under test. What is specific to one library (autograd, laziness, jit, DLPack
zero-copy, ...) lives in that library's own test file.
"""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln

from . import reference
from .conftest import DTYPES, STATS_RTOL, acc_dtype, random_rows

#: |grad - exact| allowed for unit-scale gradients, by dtype.
GRAD_ATOL = {"float16": 2e-2, "bfloat16": 1.5e-1, "float32": 5e-5, "float64": 1e-11}


def _params(rng, shape, dtype="float32"):
    w = (1.0 + 0.5 * rng.standard_normal(shape)).astype(DTYPES[dtype])
    b = (0.3 * rng.standard_normal(shape)).astype(DTYPES[dtype])
    return w, b


def _widest(library) -> str:
    """float64 where the library has it (JAX without x64 mode has not), else float32."""
    return "float64" if library.has("float64") else "float32"


def _keepdims(shape, axes):
    return tuple(1 if i in axes else s for i, s in enumerate(shape))


# --------------------------------------------------------------------------- forward


def test_layer_norm_matches_reference(library, dtype_name):
    library.require(dtype_name)
    acc = acc_dtype(dtype_name)
    # Lengths around the native kernels' vector and chunk sizes, and long rows with tails
    # (the generic path has no such sizes: a short, an odd and a long row).
    for n in (1, 3, 64, 127, 128, 129, 768, 1000, 4099) if library.native else (1, 129, 4099):
        rng = np.random.default_rng(n)
        x = random_rows(rng, (5, n), dtype_name, loc=0.5, scale=2.0)
        w, b = _params(rng, (n,))
        y, mean, rstd = ln.layer_norm(library.asarray(x), n, library.asarray(w),
                                      library.asarray(b), return_stats=True)
        y_ref, mean_ref, rstd_ref = reference.layer_norm(x, (1,), w, b)
        msg = f"n={n}"
        library.assert_close(y, y_ref, dtype=dtype_name, err_msg=msg)
        tol = STATS_RTOL[acc]
        library.assert_close(mean, mean_ref, dtype=acc, shape=(5, 1), atol=tol, rtol=tol,
                             err_msg=msg)
        library.assert_close(rstd, rstd_ref, dtype=acc, shape=(5, 1), atol=0, rtol=tol * 10,
                             err_msg=msg)


def test_rms_norm_matches_reference(library, dtype_name):
    library.require(dtype_name)
    acc = acc_dtype(dtype_name)
    for n in (1, 15, 16, 17, 768, 4099) if library.native else (1, 17, 4099):
        rng = np.random.default_rng(n + 1)
        x = random_rows(rng, (4, n), dtype_name, loc=0.2)
        w, _ = _params(rng, (n,))
        y, rstd = ln.rms_norm(library.asarray(x), n, library.asarray(w), return_stats=True)
        y_ref, rstd_ref = reference.rms_norm(x, (1,), w)
        library.assert_close(y, y_ref, dtype=dtype_name, err_msg=f"n={n}")
        library.assert_close(rstd, rstd_ref, dtype=acc, shape=(4, 1), atol=0,
                             rtol=STATS_RTOL[acc] * 10, err_msg=f"n={n}")


@pytest.mark.parametrize(
    ("shape", "axes"),
    [((2, 3, 4, 5), (1,)), ((2, 3, 4, 5), (1, 2)), ((2, 3, 4, 5), (2, 3)), ((2, 3, 4, 5), (0, 2)),
     ((2, 3, 4, 5), (0, 1, 2, 3)), ((3, 200, 7), (1,)), ((6, 5), (0,)), ((4, 3, 2), (0, 2))],
    ids=str,
)
def test_axes_anywhere_with_weight_and_bias(library, shape, axes):
    dtype = _widest(library)
    rng = np.random.default_rng(len(shape) + sum(axes))
    x = random_rows(rng, shape, dtype)
    w, b = _params(rng, tuple(shape[a] for a in axes), dtype)
    xs, ws, bs = library.asarray(x), library.asarray(w), library.asarray(b)
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x, axes, w, b)
    tol = STATS_RTOL[dtype]
    # Positive axes, negative axes, and a single axis given as an int.
    negative = tuple(a - len(shape) for a in axes)
    for axis in (axes, negative, *((axes[0],) if len(axes) == 1 else ())):
        y, mean, rstd = ln.layer_norm(xs, weight=ws, bias=bs, axis=axis, return_stats=True)
        library.assert_close(y, y_ref, dtype=dtype, atol=tol * 10, err_msg=str(axis))
        library.assert_close(mean, mean_ref, dtype=dtype, shape=_keepdims(shape, axes),
                             atol=tol * 10)
        library.assert_close(rstd, rstd_ref, dtype=dtype, shape=_keepdims(shape, axes),
                             atol=0, rtol=tol * 10)
    yr, rs = ln.rms_norm(xs, weight=ws, axis=axes, eps=1e-6, return_stats=True)
    yr_ref, rs_ref = reference.rms_norm(x, axes, w, eps=1e-6)
    library.assert_close(yr, yr_ref, dtype=dtype, atol=tol * 10)
    library.assert_close(rs, rs_ref, dtype=dtype, shape=_keepdims(shape, axes), atol=0,
                         rtol=tol * 10)


def test_normalized_shape_is_the_trailing_axes(library):
    rng = np.random.default_rng(3)
    x = library.asarray(random_rows(rng, (2, 3, 4, 5), "float32"))
    by_axis = ln.layer_norm(x, axis=(-2, -1))
    library.assert_equal(ln.layer_norm(x, (4, 5)), by_axis)
    library.assert_equal(ln.layer_norm(x, [4, 5]), by_axis)
    last = ln.layer_norm(x)  # neither: axis=-1
    library.assert_equal(ln.layer_norm(x, 5), last)
    library.assert_equal(ln.layer_norm(x, (5,)), last)
    library.assert_equal(ln.layer_norm(x, axis=3), last)
    library.assert_equal(ln.rms_norm(x, (4, 5)), ln.rms_norm(x, axis=(2, 3)))
    y_ref, _, _ = reference.layer_norm(library.to_numpy(x), (2, 3))
    library.assert_close(by_axis, y_ref, dtype="float32")


def test_parameters_of_another_dtype_are_applied_in_accumulation_precision(library):
    library.require("bfloat16")
    rng = np.random.default_rng(5)
    x = library.asarray(random_rows(rng, (3, 64), "bfloat16"))
    w64 = 1 + 0.1 * rng.standard_normal(64)
    b64 = 0.1 * rng.standard_normal(64)
    y32 = ln.layer_norm(x, weight=library.asarray(w64, "float32"),
                        bias=library.asarray(b64, "float32"))
    y_ref, _, _ = reference.layer_norm(library.to_numpy(x), (1,), w64.astype(np.float32),
                                       b64.astype(np.float32))
    library.assert_close(y32, y_ref, dtype="bfloat16")
    w16 = w64.astype(DTYPES["bfloat16"])
    y16 = ln.layer_norm(x, weight=library.asarray(w16))
    library.assert_close(y16, reference.layer_norm(library.to_numpy(x), (1,), w16)[0],
                         dtype="bfloat16")
    if library.has("float64"):  # a float64 weight on float32 data: y stays float32
        x32 = library.asarray(random_rows(rng, (3, 64), "float32"))
        y = ln.layer_norm(x32, weight=library.asarray(w64))
        library.assert_close(y, reference.layer_norm(library.to_numpy(x32), (1,), w64)[0],
                             dtype="float32")


# --------------------------------------------------------------------------- backward


def test_layer_norm_backward_matches_reference(library, dtype_name):
    library.require(dtype_name)
    tol = GRAD_ATOL[dtype_name]
    for n in (7, 128, 1000):
        for affine in (True, False):
            rng = np.random.default_rng(n)
            x = random_rows(rng, (37, n), dtype_name, loc=1.0, scale=2.0)
            gy = random_rows(rng, (37, n), dtype_name)
            w = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32) if affine else None
            xs = library.asarray(x)
            ws = None if w is None else library.asarray(w)
            _, mean, rstd = ln.layer_norm(xs, weight=ws, return_stats=True)
            gx, gw, gb = ln.layer_norm_backward(library.asarray(gy), xs, mean, rstd, ws)
            gx_ref, gw_ref, gb_ref = reference.layer_norm_backward(gy, x, (1,), w)
            # grad_weight has the weight's dtype, or x's when there is no weight.
            pdt = "float32" if affine else dtype_name
            msg = f"n={n} affine={affine}"
            library.assert_close(gx, gx_ref, dtype=dtype_name, atol=tol * 4, err_msg=msg)
            library.assert_close(gw, gw_ref, dtype=pdt, shape=(n,), atol=tol * 40, rtol=1e-4,
                                 err_msg=msg)
            library.assert_close(gb, gb_ref, dtype=pdt, shape=(n,), atol=tol * 40, rtol=1e-4,
                                 err_msg=msg)


def test_rms_norm_backward_matches_reference(library, dtype_name):
    library.require(dtype_name)
    tol = GRAD_ATOL[dtype_name]
    for n in (5, 300):
        rng = np.random.default_rng(n + 3)
        x = random_rows(rng, (21, n), dtype_name, loc=0.5)
        gy = random_rows(rng, (21, n), dtype_name)
        w = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
        xs, ws = library.asarray(x), library.asarray(w)
        _, rstd = ln.rms_norm(xs, weight=ws, return_stats=True)
        gx, gw = ln.rms_norm_backward(library.asarray(gy), xs, rstd, ws)
        gx_ref, gw_ref = reference.rms_norm_backward(gy, x, (1,), w)
        library.assert_close(gx, gx_ref, dtype=dtype_name, atol=tol * 4, err_msg=f"n={n}")
        library.assert_close(gw, gw_ref, dtype="float32", shape=(n,), atol=tol * 40,
                             rtol=1e-4, err_msg=f"n={n}")


@pytest.mark.parametrize(("shape", "axes"), [((3, 6, 4, 5), (1,)), ((3, 6, 4, 5), (1, 3)),
                                             ((4, 6, 5), (0, 2)), ((200, 3), (0,))], ids=str)
def test_backward_axes_anywhere(library, shape, axes):
    dtype = _widest(library)
    tol = {"float32": 1e-4, "float64": 1e-11}[dtype]
    rng = np.random.default_rng(sum(shape))
    x = random_rows(rng, shape, dtype)
    gy = random_rows(rng, shape, dtype)
    w = (1 + 0.2 * rng.standard_normal(tuple(shape[a] for a in axes))).astype(DTYPES[dtype])
    xs, gys, ws = library.asarray(x), library.asarray(gy), library.asarray(w)
    _, mean, rstd = ln.layer_norm(xs, weight=ws, axis=axes, return_stats=True)
    got = ln.layer_norm_backward(gys, xs, mean, rstd, ws, axis=axes)
    for g, r in zip(got, reference.layer_norm_backward(gy, x, axes, w), strict=True):
        library.assert_close(g, r, dtype=dtype, atol=tol, rtol=tol)
    _, rs = ln.rms_norm(xs, weight=ws, axis=axes, return_stats=True)
    got_r = ln.rms_norm_backward(gys, xs, rs, ws, axis=axes)
    for g, r in zip(got_r, reference.rms_norm_backward(gy, x, axes, w), strict=True):
        library.assert_close(g, r, dtype=dtype, atol=tol, rtol=tol)


def test_weight_none_gives_the_gradient_of_a_unit_weight(library):
    rng = np.random.default_rng(2)
    x = library.asarray(random_rows(rng, (6, 10), "float32"))
    gy = library.asarray(random_rows(rng, (6, 10), "float32"))
    _, mean, rstd = ln.layer_norm(x, return_stats=True)
    none = ln.layer_norm_backward(gy, x, mean, rstd)
    ones = ln.layer_norm_backward(gy, x, mean, rstd, library.asarray(np.ones(10, np.float32)))
    for a, b in zip(none, ones, strict=True):
        library.assert_equal(a, b)
    exact = reference.layer_norm_backward(library.to_numpy(gy), library.to_numpy(x), (1,))
    library.assert_close(none[1], exact[1], dtype="float32", atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- numerics


def test_constant_rows_give_exactly_bias(library, dtype_name):
    # The generic path once took mean = sum(x) / D, a few ulps off most constants (0.1 *
    # 128 rounds); it now takes its statistics of x minus the row's first element.
    library.require(dtype_name)
    values = np.array([0.1, -3.7, 1e4, 1 / 3])
    for n in (1, 5, 128, 300):
        rng = np.random.default_rng(n)
        x = np.repeat(values[:, None], n, axis=1).astype(DTYPES[dtype_name])
        w, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        xs = library.asarray(x)
        y = ln.layer_norm(xs, weight=library.asarray(w), bias=library.asarray(b))
        expected = np.broadcast_to(b.astype(DTYPES[dtype_name]), x.shape)
        library.assert_equal(y, expected, err_msg=f"n={n}")
        # No affine step: exactly +0.0 (nothing to add a -0.0 to).
        library.assert_equal(ln.layer_norm(xs), np.zeros(x.shape, DTYPES[dtype_name]),
                             err_msg=f"n={n}")


def test_constant_row_with_eps_zero_is_nan(library):
    x = np.full((2, 16), 2.5, np.float32)
    x[1] = np.arange(16) / 4
    # (NumPy-backed generic namespaces warn about the 1/0: the result is what counts.)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = library.to_numpy(ln.layer_norm(library.asarray(x), eps=0.0))
    assert np.isnan(y[0]).all()
    y_ref, _, _ = reference.layer_norm(x[1:], (1,), eps=0.0)
    np.testing.assert_allclose(y[1:].astype(np.float64), y_ref.astype(np.float64), atol=2e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_stay_in_their_row(library, dtype_name, bad):
    library.require(dtype_name)
    rng = np.random.default_rng(3)
    x = random_rows(rng, (4, 200), dtype_name)
    x[2, 57] = bad
    clean = np.delete(x, 2, axis=0)
    # Other rows: bit for bit the batch without the bad row on our kernels, within
    # rounding on the generic path (the array library's reductions are its own).
    same = library.assert_equal if library.native else library.assert_close
    # (NumPy-backed generic namespaces warn about the inf - inf: the result is what counts.)
    with np.errstate(divide="ignore", invalid="ignore"):
        yn = library.to_numpy(ln.layer_norm(library.asarray(x)))
        rn = library.to_numpy(ln.rms_norm(library.asarray(x)))
    assert np.isnan(yn[2].astype(np.float64)).all()
    same(library.asarray(np.delete(yn, 2, axis=0)), ln.layer_norm(library.asarray(clean)))
    same(library.asarray(np.delete(rn, 2, axis=0)), ln.rms_norm(library.asarray(clean)))
    # RMSNorm follows torch: with an Inf, rstd = 1/sqrt(inf) = 0 and the row becomes x * 0
    # (NaN where x is Inf, signed zeros elsewhere); with a NaN the whole row is NaN.
    with np.errstate(invalid="ignore"):
        expected = x[2] * x.dtype.type(0) if np.isinf(bad) else np.full(200, np.nan, x.dtype)
    np.testing.assert_array_equal(rn[2].astype(np.float64), expected.astype(np.float64))


def test_empty_batches(library):
    dtype = _widest(library)
    x = library.asarray(np.ones((0, 16), np.float32))
    y, mean, rstd = ln.layer_norm(x, return_stats=True)
    library.assert_close(y, np.ones((0, 16)), dtype="float32")
    library.assert_close(mean, np.ones((0, 1)), dtype="float32")
    library.assert_close(rstd, np.ones((0, 1)), dtype="float32")
    gx, gw, gb = ln.layer_norm_backward(x, x, mean, rstd)
    library.assert_close(gx, np.ones((0, 16)), dtype="float32")
    # No rows: the parameter gradients are sums of nothing.
    library.assert_equal(gw, np.zeros(16, np.float32))
    library.assert_equal(gb, np.zeros(16, np.float32))
    y, rstd = ln.rms_norm(library.asarray(np.ones((0, 3, 16)), dtype), return_stats=True)
    library.assert_close(y, np.ones((0, 3, 16)), dtype=dtype)
    library.assert_close(rstd, np.ones((0, 3, 1)), dtype=dtype)
    img = library.asarray(np.ones((4, 0, 3), np.float32))  # no rows along another axis
    y, mean, _ = ln.layer_norm(img, axis=2, return_stats=True)
    library.assert_close(y, np.ones((4, 0, 3)), dtype="float32")
    library.assert_close(mean, np.ones((4, 0, 1)), dtype="float32")


def test_zero_normalized_size_follows_torch(library):
    # torch gives an empty y, mean 0 and rstd NaN (1/sqrt(0/0 + eps)).
    with np.errstate(divide="ignore", invalid="ignore"):
        y, mean, rstd = ln.layer_norm(library.asarray(np.ones((3, 0), np.float32)), 0,
                                      return_stats=True)
    library.assert_close(y, np.ones((3, 0)), dtype="float32")
    library.assert_equal(mean, np.zeros((3, 1), np.float32))
    library.assert_close(rstd, np.full((3, 1), np.nan), dtype="float32")


# --------------------------------------------------------------------------- errors

#: A float32 array of shape (2, 3, 4) with distinct values.
X = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7.0


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"normalized_shape": (3,)}, ValueError, ["(3,)", "(2, 3, 4)"]),
        ({"normalized_shape": (5, 4)}, ValueError, ["(5, 4)", "(2, 3, 4)"]),
        ({"normalized_shape": (1, 2, 3, 4)}, ValueError, ["(1, 2, 3, 4)", "(2, 3, 4)"]),
        ({"normalized_shape": ()}, ValueError, ["normalized_shape"]),
        ({"normalized_shape": 4, "axis": -1}, TypeError, ["normalized_shape", "axis"]),
        ({"axis": 3}, ValueError, ["axis 3", "(2, 3, 4)"]),
        ({"axis": -4}, ValueError, ["axis -4"]),
        ({"axis": (1, -2)}, ValueError, ["duplicate"]),
        ({"axis": (0, 0)}, ValueError, ["duplicate"]),
        ({"axis": 1.5}, TypeError, ["axis", "1.5"]),
        ({"eps": -1e-5}, ValueError, ["eps", "-1e-05"]),
        ({"eps": float("nan")}, ValueError, ["eps", "nan"]),
        ({"eps": float("inf")}, ValueError, ["eps", "inf"]),
        ({"eps": "1e-5"}, ValueError, ["eps"]),
        ({"weight": np.ones(3, np.float32)}, ValueError, ["weight", "(4,)", "(3,)"]),
        ({"bias": np.ones((1, 4), np.float32)}, ValueError, ["bias", "(4,)", "(1, 4)"]),
        ({"weight": np.ones(4, np.int32)}, TypeError, ["weight", "int32"]),
        ({"axis": 1, "weight": np.ones(4, np.float32)}, ValueError, ["weight", "(3,)", "(4,)"]),
        ({"backend": "gpu"}, ValueError, ["backend", "'gpu'"]),
    ],
    ids=lambda v: repr(v)[:40] if isinstance(v, dict) else "",
)
def test_layer_norm_errors(library, kwargs, exc, words):
    kwargs = {k: library.asarray(v) if isinstance(v, np.ndarray) else v
              for k, v in kwargs.items()}
    with pytest.raises(exc) as info:
        ln.layer_norm(library.asarray(X), **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_zero_dimensional_input_is_a_clear_error(library):
    # A 0-d array has no axis to normalize over; the error says so, on every library.
    x = library.asarray(np.array(3.0, np.float32))
    calls = [lambda: ln.layer_norm(x), lambda: ln.rms_norm(x, axis=0),
             lambda: ln.add_layer_norm(x, x)]
    for call in calls:
        with pytest.raises(ValueError, match=r"at least one dimension .* 0-d array"):
            call()


def test_rms_norm_errors(library):
    x = library.asarray(X)
    with pytest.raises(ValueError, match="eps"):
        ln.rms_norm(x, eps=-1.0)
    with pytest.raises(ValueError, match=r"weight.*\(4,\).*\(5,\)|weight.*\(5,\).*\(4,\)"):
        ln.rms_norm(x, weight=library.asarray(np.ones(5, np.float32)))
    with pytest.raises(TypeError, match="both"):
        ln.rms_norm(x, 4, axis=-1)
    with pytest.raises(ValueError, match=r"\(3,\).*\(2, 3, 4\)"):
        ln.rms_norm(x, 3)


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool", "uint8", "complex64"])
def test_unsupported_dtypes_are_named(library, dtype):
    data = (np.arange(6).reshape(2, 3) % 2).astype(dtype)
    try:
        x = library.asarray(data)
    except (TypeError, ValueError):
        pytest.skip(f"{library} has no {dtype}")
    # (JAX without x64 mode makes int64 data int32: name what the array holds.)
    for fn in (ln.layer_norm, ln.rms_norm):
        with pytest.raises(TypeError, match=library.dtype_name(x)):
            fn(x)


def _foreign(library):
    """(library name, converter) of another library than ``library``'s, for mixing.

    NumPy parameters are fine with a Dask x (Dask arrays hold NumPy blocks), and NumPy
    needs something else: both get array_api_strict; everyone else gets NumPy.
    """
    if library.name in ("numpy", "dask"):
        xps = pytest.importorskip("array_api_strict")
        return "array_api_strict", xps.asarray
    return "numpy", np.asarray


def test_mixed_libraries_are_a_type_error_naming_both(library):
    other, convert = _foreign(library)
    rng = np.random.default_rng(6)
    xn = random_rows(rng, (2, 4), "float32")
    x = library.asarray(xn)
    w = np.ones(4, np.float32)
    own = library.name
    with pytest.raises(TypeError, match=rf"weight comes from {other}.*x comes from {own}"):
        ln.layer_norm(x, weight=convert(w))
    with pytest.raises(TypeError, match=rf"bias comes from {other}.*x comes from {own}"):
        ln.layer_norm(x, weight=library.asarray(w), bias=convert(w))
    with pytest.raises(TypeError, match=rf"weight comes from {other}.*x comes from {own}"):
        ln.rms_norm(x, weight=convert(w))
    _, mean, rstd = ln.layer_norm(x, return_stats=True)
    with pytest.raises(TypeError, match=rf"grad_y comes from {other}.*x comes from {own}"):
        ln.layer_norm_backward(convert(xn), x, mean, rstd)


def test_mixed_library_scales_are_a_type_error_naming_both(library):
    other, convert = _foreign(library)
    rng = np.random.default_rng(16)
    x = library.asarray(random_rows(rng, (2, 4), "float32"))
    scale = convert(np.full((2, 1), 0.02, np.float32))
    with pytest.raises(TypeError, match=rf"scale comes from {other}.*x comes from {library}"):
        ln.layer_norm(x, quantize="int8", scale=scale)
    with pytest.raises(TypeError, match=rf"scale comes from {other}.*x comes from {library}"):
        ln.add_rms_norm(x, x, quantize="int8", scale=scale)


@pytest.mark.parametrize("scalar", [np.float32(0.03), np.float64(0.03), 0.03],
                         ids=["np.float32", "np.float64", "float"])
def test_scalar_scales_go_with_every_library(library, scalar):
    rng = np.random.default_rng(17)
    xn = random_rows(rng, (3, 8), "float32")
    codes, scale = ln.layer_norm(library.asarray(xn), quantize="int8", scale=scalar)
    expected, _ = ln.layer_norm(xn, quantize="int8", scale=0.03)
    np.testing.assert_array_equal(library.to_numpy(codes), expected)
    assert float(scale) == float(scalar)
    codes, _, _ = ln.add_layer_norm(library.asarray(xn), library.asarray(xn), quantize="int8",
                                    scale=scalar)
    expected, _, _ = ln.add_layer_norm(xn, xn, quantize="int8", scale=0.03)
    np.testing.assert_array_equal(library.to_numpy(codes), expected)


def test_backward_errors(library):
    rng = np.random.default_rng(0)
    xn = random_rows(rng, (3, 5), "float32")
    x = library.asarray(xn)
    _, mean, rstd = ln.layer_norm(x, return_stats=True)
    gy = library.asarray(np.ones((3, 5), np.float32) + xn)
    with pytest.raises(ValueError, match=r"grad_y.*\(3, 5\).*\(3, 4\)"):
        ln.layer_norm_backward(library.asarray(library.to_numpy(gy)[:, :4]), x, mean, rstd)
    if library.has("float64"):
        with pytest.raises(TypeError, match=r"grad_y.*float32.*float64"):
            ln.layer_norm_backward(library.asarray(library.to_numpy(gy), "float64"), x, mean,
                                   rstd)
    mean_n, rstd_n = library.to_numpy(mean), library.to_numpy(rstd)
    with pytest.raises(ValueError, match=r"mean.*\(3, 1\).*\(3,\)"):
        ln.layer_norm_backward(gy, x, library.asarray(mean_n.ravel()), rstd)
    with pytest.raises(ValueError, match=r"rstd.*\(3, 1\).*\(1, 1\)"):
        ln.layer_norm_backward(gy, x, mean, library.asarray(rstd_n[:1]))
    with pytest.raises(ValueError, match="weight"):
        ln.layer_norm_backward(gy, x, mean, rstd, library.asarray(np.ones(4, np.float32)))
    with pytest.raises(ValueError, match=r"rstd.*\(3, 1\)"):
        ln.rms_norm_backward(gy, x, library.asarray(rstd_n.ravel()))


# --------------------------------------------------------------------------- guarantees


def test_inputs_are_never_modified(library):
    rng = np.random.default_rng(1)
    host = [random_rows(rng, shape, "float32") for shape in ((4, 130), (130,), (130,), (4, 130))]
    x, w, b, gy = (library.asarray(a) for a in host)
    host = [a.copy() for a in host]  # NumPy's (and Dask's) arrays may be these very buffers
    _, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True)
    stats = [library.to_numpy(mean), library.to_numpy(rstd)]
    ln.layer_norm_backward(gy, x, mean, rstd, w)
    ln.rms_norm(x, weight=w)
    _, r = ln.rms_norm(x, weight=w, return_stats=True)
    r_saved = library.to_numpy(r)
    ln.rms_norm_backward(gy, x, r, w)
    for a, saved in zip((x, w, b, gy, mean, rstd, r), [*host, *stats, r_saved], strict=True):
        library.assert_equal(a, saved)


@pytest.mark.parametrize("n", [3, 64, 768, 1000, 5000])
def test_row_alone_equals_row_in_batch(library, dtype_name, n):
    """Bitwise batch independence: alone, in a batch, at any position, as 1-D or 3-D."""
    if not library.native:
        pytest.skip(f"{library} computes on its own reductions: no bitwise guarantee")
    library.require(dtype_name)
    rng = np.random.default_rng(n)
    # 300 rows of 5000 are enough elements for the parallel kernels.
    batch = random_rows(rng, (300, n), dtype_name, scale=3.0)
    batch[::7] = random_rows(rng, batch[::7].shape, dtype_name, loc=1e3, scale=50.0)
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    xs, ws, bs = library.asarray(batch), library.asarray(w), library.asarray(b)
    y_all, mean_all, rstd_all = (library.to_numpy(a) for a in
                                 ln.layer_norm(xs, weight=ws, bias=bs, return_stats=True))
    r_all, rs_all = (library.to_numpy(a) for a in ln.rms_norm(xs, weight=ws, return_stats=True))
    for r in (0, 1, 150, 299):
        alone = library.asarray(batch[r:r + 1])
        y1, m1, s1 = ln.layer_norm(alone, weight=ws, bias=bs, return_stats=True)
        library.assert_equal(y1, y_all[r:r + 1])
        library.assert_equal(m1, mean_all[r:r + 1])
        library.assert_equal(s1, rstd_all[r:r + 1])
        r1, rs1 = ln.rms_norm(alone, weight=ws, return_stats=True)
        library.assert_equal(r1, r_all[r:r + 1])
        library.assert_equal(rs1, rs_all[r:r + 1])
        y1d = ln.layer_norm(library.asarray(batch[r]), weight=ws, bias=bs)
        library.assert_equal(y1d, y_all[r])
    y3 = ln.layer_norm(library.asarray(batch.reshape(3, 100, n)), weight=ws, bias=bs)
    library.assert_equal(y3, y_all.reshape(3, 100, n))
    y_ref, _, _ = reference.layer_norm(batch, (1,), w, b)
    library.assert_close(library.asarray(y_all), y_ref, dtype=dtype_name)


@pytest.mark.parametrize("n", [5, 130, 1000])
def test_channels_first_equals_rows(library, dtype_name, n):
    """axis=1 of (N, C, H, W) gives, bit for bit, what the rows path gives per pixel."""
    if not library.native:
        pytest.skip(f"{library} computes on its own reductions: no bitwise guarantee")
    library.require(dtype_name)
    rng = np.random.default_rng(n)
    img = random_rows(rng, (2, n, 3, 5), dtype_name, loc=2.0)
    w = rng.standard_normal(n).astype(np.float32)
    xs, ws = library.asarray(img), library.asarray(w)
    y = ln.layer_norm(xs, axis=1, weight=ws)
    rows = np.ascontiguousarray(np.moveaxis(img, 1, -1))
    y_rows = library.to_numpy(ln.layer_norm(library.asarray(rows), weight=ws))
    library.assert_equal(y, np.moveaxis(y_rows, -1, 1))
    r_rows = library.to_numpy(ln.rms_norm(library.asarray(rows)))
    library.assert_equal(ln.rms_norm(xs, axis=1), np.moveaxis(r_rows, -1, 1))
    # And a single pixel normalized alone.
    y_pixel = ln.layer_norm(library.asarray(img[1:2, :, 2:3, 4:5]), axis=1, weight=ws)
    library.assert_equal(y_pixel, library.to_numpy(y)[1:2, :, 2:3, 4:5])
    library.assert_close(y, reference.layer_norm(img, (1,), w)[0], dtype=dtype_name)


# --------------------------------------------------------------------------- layers


@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
def test_layer_classes_equal_the_functions(library, cls):
    """The layer's parameters live in the library; its forward and backward are the
    functions' (bit for bit: the same calls), and its backward is the exact gradient."""
    rng = np.random.default_rng(0)
    layer = getattr(ln, cls)((3, 16), xp=library.xp)
    rms = cls == "RMSNorm"
    library.assert_equal(layer.weight, np.ones((3, 16), np.float32))
    w, b = _params(rng, (3, 16))
    state = {"weight": library.asarray(w)} if rms else \
        {"weight": library.asarray(w), "bias": library.asarray(b)}
    layer.load_state_dict(state)
    library.assert_equal(layer.weight, w)
    x = library.asarray(random_rows(rng, (5, 3, 16), "float32", loc=1.0))
    gy = library.asarray(random_rows(rng, (5, 3, 16), "float32"))
    y = layer(x)
    got = layer.backward(gy)
    if rms:
        want_y, rstd = ln.rms_norm(x, (3, 16), layer.weight, return_stats=True)
        want = ln.rms_norm_backward(gy, x, rstd, layer.weight, (3, 16))
        exact = reference.rms_norm_backward(library.to_numpy(gy), library.to_numpy(x), (1, 2), w)
    else:
        want_y, mean, rstd = ln.layer_norm(x, (3, 16), layer.weight, layer.bias,
                                           return_stats=True)
        want = ln.layer_norm_backward(gy, x, mean, rstd, layer.weight, (3, 16))
        exact = reference.layer_norm_backward(library.to_numpy(gy), library.to_numpy(x),
                                              (1, 2), w)
    library.assert_equal(y, want_y)
    for g, e in zip(got, want, strict=True):
        library.assert_equal(g, e)
    library.assert_close(got[0], exact[0], dtype="float32", atol=1e-4)
    library.assert_close(got[1], exact[1], dtype="float32", atol=1e-4, rtol=1e-4)
