"""Legal but unusual inputs: a correct result or a clear error, never a silent wrong answer.

Each test names the case of the robustness issue it covers (byte order, ndarray
subclasses, eps that rounds to 0, overflowing rows, lazy negation bits, the generic
path's accuracy, outputs overlapping inputs, messages).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

import layernorm as ln

from . import reference
from .conftest import ATOL, DTYPES, random_rows

FUNCTIONS = {
    "layer_norm": lambda x, **kw: ln.layer_norm(x, **kw),
    "rms_norm": lambda x, **kw: ln.rms_norm(x, **kw),
}


def _ref(name, x, axes=(-1,), weight=None, bias=None, eps=None):
    x64 = np.asarray(x).astype(np.float64)
    if eps is None:  # each function's default
        eps = 1e-5 if name == "layer_norm" else float(
            np.finfo(np.float64 if np.asarray(x).dtype == np.float64 else np.float32).eps)
    axes = tuple(a % x64.ndim for a in axes)
    w64 = None if weight is None else np.asarray(weight).astype(np.float64)
    if name == "layer_norm":
        b64 = None if bias is None else np.asarray(bias).astype(np.float64)
        return reference.layer_norm(x64, axes, w64, b64, eps)[0]
    return reference.rms_norm(x64, axes, w64, eps)[0]


# ------------------------------------------------------------------ 1, 2: byte order


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from(["float16", "float32", "float64"]),
       which=st.sampled_from(["x", "weight", "bias"]),
       order=st.sampled_from([">", "<"]))
def test_non_native_byte_order_is_a_type_error_naming_the_argument(dtype, which, order):
    # bfloat16 has no byte-swapped NumPy dtype; the three others do.
    rng = np.random.default_rng(0)
    arrays = {"x": random_rows(rng, (3, 5), dtype), "weight": random_rows(rng, 5, dtype),
              "bias": random_rows(rng, 5, dtype)}
    swapped = arrays[which].astype(arrays[which].dtype.newbyteorder(order))
    arrays[which] = swapped
    if swapped.dtype.isnative:  # "<" on a little-endian machine is the native order
        y = ln.layer_norm(arrays["x"], 5, arrays["weight"], arrays["bias"])
        expected = _ref("layer_norm", arrays["x"], weight=arrays["weight"],
                        bias=arrays["bias"])
        np.testing.assert_allclose(y.astype(np.float64), expected, atol=ATOL[dtype] * 4)
        return
    for _ in range(2):  # the same on every call (no memo serves a swapped array)
        with pytest.raises(TypeError, match=rf"{which} must have native byte order"):
            ln.layer_norm(arrays["x"], 5, arrays["weight"], arrays["bias"])
    if which != "bias":
        with pytest.raises(TypeError, match=rf"{which} must have native byte order"):
            ln.rms_norm(arrays["x"], 5, arrays["weight"])


@pytest.mark.parametrize("fortran", [False, True])
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_a_swapped_weight_with_an_offset_is_refused_on_every_layout(name, fortran):
    # The short path forms the gain weight + offset itself; it must not turn a swapped
    # weight into an accepted one where the general path (Fortran x) refuses it.
    rng = np.random.default_rng(4)
    x = random_rows(rng, (4, 8), "float32")
    x = np.asfortranarray(x) if fortran else x
    weight = random_rows(rng, 8, "float32").astype(">f4")
    args = (x,) if name in ("layer_norm", "rms_norm") else (x, x[::-1].copy())
    for _ in range(2):
        with pytest.raises(TypeError, match="weight must have native byte order"):
            getattr(ln, name)(*args, weight=weight, weight_offset=1.0)


def test_a_swapped_out_is_refused():
    x = random_rows(np.random.default_rng(1), (2, 4), "float32")
    out = np.empty((2, 4), np.dtype(">f4"))
    with pytest.raises((TypeError, ValueError), match="out"):
        ln.layer_norm(x, out=out)


# ------------------------------------------------------------------ 3, 4: subclasses


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_masked_arrays_are_refused_on_every_call(name):
    data = random_rows(np.random.default_rng(2), (3, 4), "float32")
    masked = np.ma.masked_array(data, mask=data > 0)
    for _ in range(2):
        with pytest.raises(TypeError, match="MaskedArray"):
            FUNCTIONS[name](masked)
    ln.layer_norm(data)  # a call of the same dtype between must not change the answer
    with pytest.raises(TypeError, match="MaskedArray"):
        FUNCTIONS[name](masked)
    with pytest.raises(TypeError, match=r"weight is a numpy\.ma\.MaskedArray.*pass "
                                        r"weight\.filled\(value\) or weight\.data"):
        ln.layer_norm(data, weight=np.ma.masked_array(data[0]))


def test_matrix_is_refused_with_a_clear_message():
    with pytest.warns(PendingDeprecationWarning):  # NumPy discourages the class itself
        matrix = np.matrix(random_rows(np.random.default_rng(3), (2, 3), "float64"))
    with pytest.raises(TypeError, match=r"numpy\.matrix"):
        ln.layer_norm(matrix)
    with pytest.raises(TypeError, match=r"weight is a numpy\.matrix.*np\.asarray\(weight\)"):
        ln.layer_norm(np.asarray(matrix), weight=matrix[0])


def test_other_ndarray_subclasses_compute_as_ndarrays(tmp_path):
    data = random_rows(np.random.default_rng(4), (5, 6), "float32")
    mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32,
                                   shape=data.shape)
    mm[...] = data
    assert np.array_equal(ln.layer_norm(mm), ln.layer_norm(data))


class _Arithmetic(np.ndarray):
    """A subclass whose operators give other values than NumPy's: a path that computed
    with them would be silently wrong."""

    def __mul__(self, other):
        return np.asarray(np.multiply(np.asarray(self), other) * 2).view(type(self))

    __rmul__ = __mul__

    def __add__(self, other):
        return np.asarray(np.add(np.asarray(self), other) + 1).view(type(self))

    __radd__ = __add__


@pytest.mark.parametrize("backend", [None, "array_api"])
def test_subclass_operators_never_reach_the_computation(backend):
    """Every array argument that is an ndarray subclass computes as its plain ndarray
    view on both NumPy paths (the kernels and the generic one, which computes with the
    arrays' operators; the offset gain adds to the weight on both), and the results are
    plain ndarrays (a given scale comes back as passed)."""
    rng = np.random.default_rng(9)
    x, r, gy = (random_rows(rng, (3, 8), "float32") for _ in range(3))
    w, b = (random_rows(rng, (8,), "float32") for _ in range(2))
    scale = np.full((3, 1), 0.05, np.float32)
    _, mean, rstd = ln.layer_norm(x, 8, w, b, return_stats=True)
    _, rms_rstd = ln.rms_norm(x, 8, w, return_stats=True)

    def odd(a):
        return a.view(_Arithmetic)

    calls = {
        "layer_norm": lambda f: ln.layer_norm(f(x), 8, f(w), f(b), weight_offset=1.0,
                                              backend=backend),
        "rms_norm": lambda f: ln.rms_norm(f(x), 8, f(w), weight_offset=1.0, backend=backend),
        "quantized": lambda f: ln.layer_norm(f(x), 8, f(w), f(b), quantize="int8",
                                             scale=f(scale), backend=backend),
        "add_layer_norm": lambda f: ln.add_layer_norm(f(x), f(r), 8, f(w), f(b),
                                                      weight_offset=1.0, backend=backend),
        "add_rms_norm": lambda f: ln.add_rms_norm(f(x), f(r), 8, f(w), weight_offset=1.0,
                                                  backend=backend),
        "layer_norm_backward": lambda f: ln.layer_norm_backward(
            f(gy), f(x), f(mean), f(rstd), f(w), weight_offset=1.0, grad_residual=f(r),
            backend=backend),
        "rms_norm_backward": lambda f: ln.rms_norm_backward(
            f(gy), f(x), f(rms_rstd), f(w), weight_offset=1.0, backend=backend),
    }
    for name, call in calls.items():
        want, got = call(lambda a: a), call(odd)
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        if name == "quantized":  # a given scale comes back as passed (API.md)
            assert type(got[1]) is _Arithmetic and np.shares_memory(got[1], scale)
            got, want = got[:1], want[:1]
        for g, e in zip(got, want, strict=True):
            assert type(g) is np.ndarray, (name, type(g))
            np.testing.assert_array_equal(g, e, err_msg=name)


# ------------------------------------------------------------------ 5: eps rounding to 0


@pytest.mark.parametrize("dtype, eps", [("float32", 1e-46), ("float16", 1e-46),
                                        ("bfloat16", 1e-46)])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_positive_eps_that_rounds_to_zero_is_a_value_error(name, dtype, eps):
    x = np.full((2, 4), 3.0, DTYPES[dtype])  # constant rows: NaN if eps became 0
    for _ in range(2):
        with pytest.raises(ValueError, match=r"eps=.*rounds to 0"):
            FUNCTIONS[name](x, eps=eps)


@pytest.mark.parametrize("dtype, eps", [("float32", 3.5e38), ("float16", 1e39),
                                        ("bfloat16", 1e300)])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_eps_that_overflows_the_accumulation_dtype_is_a_value_error(name, dtype, eps):
    # float32(3.5e38) is inf: every row would silently become 0 (or the bias), where
    # (x - mean) / sqrt(var + eps) is about 1e-20, well within float32's range.
    x = np.arange(8, dtype=DTYPES[dtype]).reshape(2, 4)
    for _ in range(2):  # the first call plans the short path, the second takes it
        with pytest.raises(ValueError, match=r"eps=.*overflows"):
            FUNCTIONS[name](x, eps=eps)


def test_largest_eps_of_the_accumulation_dtype_is_used():
    x = np.array([[1.0, -1.0, 2.0, 5.0]], np.float32)
    want = (x.astype(np.float64) - x.mean()) / np.sqrt(x.astype(np.float64).var() + 3e38)
    np.testing.assert_allclose(ln.layer_norm(x, eps=3e38), want, rtol=1e-6)


def test_tiny_eps_that_survives_rounding_keeps_constant_rows_finite():
    x = np.full((2, 4), 3.0, np.float32)
    assert np.array_equal(ln.layer_norm(x, eps=1e-44), np.zeros_like(x))


# ------------------------------------------------------------------ 6: overflowing rows


@pytest.mark.parametrize("backend", [None, "array_api"])
@pytest.mark.parametrize("dtype, scale", [("float32", 1e19), ("float32", 1e30),
                                          ("float64", 1e154), ("float64", 1e300)])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_rows_whose_squares_overflow_are_normalized(name, dtype, scale, backend):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 33)) * scale).astype(DTYPES[dtype])
    x[1] = random_rows(rng, 33, dtype)  # an ordinary row beside them
    assert np.isfinite(x).all()
    y = FUNCTIONS[name](x, backend=backend)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, _ref(name, x), atol=ATOL[dtype] * 4)
    # The ordinary row is computed exactly as it is alone.
    assert np.array_equal(y[1], FUNCTIONS[name](x[1:2], backend=backend)[0])


@pytest.mark.parametrize("backend", [None, "array_api"])
def test_float64_rows_whose_spread_is_the_smallest_subnormal(backend):
    """float64 rows whose differences are a few units of 2**-1074 (audit finding): their
    halves round (half of 2**-1074 is 0), so measured on halves the rows looked constant
    and eps=0 gave inf/NaN; measured in full they are scaled up like any tiny row. The
    reference is the same rows times 2**1074 (exact), normalized in float64."""
    t = np.finfo(np.float64).smallest_subnormal
    tiny = np.finfo(np.float64).tiny
    rows = [[t, 0, 0, 0], [0, -t, 0, t], [tiny, np.nextafter(tiny, 1), tiny, tiny],
            [3 * t, t, 2 * t, 0]]
    x = np.array(rows, np.float64)
    units = (x - x[:, :1]) * 2.0**1000 * 2.0**74  # exact integers
    d = units - units.mean(1, keepdims=True)
    want = d / np.sqrt((d * d).mean(1, keepdims=True))
    np.testing.assert_allclose(ln.layer_norm(x, eps=0.0, backend=backend), want,
                               rtol=0, atol=1e-12)
    for row, expected in zip(x, want, strict=True):  # and alone, through the short path
        got = ln.layer_norm(row[None], eps=0.0, backend=backend)[0]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    scaled = x * 2.0**1000 * 2.0**74
    want_rms = scaled / np.sqrt((scaled * scaled).mean(1, keepdims=True))
    np.testing.assert_allclose(ln.rms_norm(x, eps=0.0, backend=backend), want_rms,
                               rtol=0, atol=1e-12)


def _kernel_path_layouts(rng, dtype, scale):
    """(x, axis) pairs of random rows times ``scale`` reaching each kernel path: short
    rows, long rows, strided rows (gathered), columns (inner > 1), and enough elements
    for the parallel kernels."""
    def rows(shape):
        return (rng.standard_normal(shape) * scale).astype(DTYPES[dtype])

    return {
        "short": (rows((20, 40)), -1),
        "long": (rows((5, 300)), -1),
        "strided": (rows((5, 600))[:, ::2], -1),
        "columns": (rows((3, 40, 7)), 1),
        "parallel": (rows((300, 256)), -1),
    }


@pytest.mark.parametrize("layout", ["short", "long", "strided", "columns", "parallel"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_overflowing_rows_on_every_kernel_path(name, layout):
    rng = np.random.default_rng(16)
    x, axis = _kernel_path_layouts(rng, "float32", 1e30)[layout]
    x = x.copy() if layout != "strided" else x
    ordinary = np.take(x, [1], axis=0 if axis == -1 else 2).copy()
    sel = (slice(1, 2),) if axis == -1 else (slice(None), slice(None), slice(1, 2))
    x[sel] = random_rows(rng, x[sel].shape, "float32")  # an ordinary row among them
    ordinary = x[sel].copy()
    kw = {"axis": axis, "return_stats": True}
    y, *stats = FUNCTIONS[name](x, **kw)
    assert np.isfinite(y).all() and all(np.isfinite(s).all() for s in stats)
    np.testing.assert_allclose(y, _ref(name, x, axes=(axis,)), atol=ATOL["float32"] * 4)
    rstd = stats[-1]
    x64 = x.astype(np.float64)
    mean64 = x64.mean(axis, keepdims=True) if name == "layer_norm" else 0.0
    var64 = ((x64 - mean64) ** 2).mean(axis, keepdims=True)
    eps = 1e-5 if name == "layer_norm" else float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(var64 + eps), rtol=1e-5)
    if name == "layer_norm":
        np.testing.assert_allclose(stats[0], mean64, rtol=1e-5, atol=1e-30)
    # Ordinary rows beside them keep the fast path's bits.
    assert np.array_equal(y[sel], FUNCTIONS[name](ordinary, axis=axis))
    # In place gives the same result.
    if layout != "strided":
        inplace = x.copy()
        assert np.array_equal(FUNCTIONS[name](inplace, axis=axis, out=inplace), y)


def test_rows_with_nan_or_inf_keep_their_rules_beside_overflowing_rows():
    rng = np.random.default_rng(17)
    x = (rng.standard_normal((4, 50)) * 1e30).astype(np.float32)
    x[0, 3] = np.inf
    x[1, 7] = np.nan
    y = ln.layer_norm(x)
    assert np.isnan(y[:2]).all() and np.isfinite(y[2:]).all()
    r = ln.rms_norm(x)
    # torch's RMSNorm rules: an infinite row has rstd 0, so y = x * 0 (NaN only where x
    # is infinite); a NaN row has rstd NaN, so y is NaN throughout.
    with np.errstate(invalid="ignore"):
        assert np.array_equal(np.isnan(r[0]), np.isnan(x[0] * np.float32(0.0)))
    assert np.isnan(r[1]).all()
    assert np.isfinite(r[2:]).all()


# ------------------------------------------------------------------ 6b: underflowing rows


def _scaled_ref(name, x, eps, axis=-1):
    """Float64 ``(y, rstd)`` of rows of any magnitude: each row scaled first by the power
    of two that brings max|x| into [0.5, 1), ``eps`` with it (exact; scale invariance)."""
    x64 = np.moveaxis(np.asarray(x).astype(np.float64), axis, -1)
    amax = np.abs(x64).max(-1, keepdims=True)
    e = np.frexp(np.where(amax > 0, amax, 1.0))[1]
    xs = np.ldexp(x64, -e)
    mean = xs.mean(-1, keepdims=True) if name == "layer_norm" else 0.0
    # A float64 row's rstd may exceed the range, and so may eps * s**2 of a tiny row
    # (then eps alone matters, and y, far below 1, comes out as 0: within tolerance).
    with np.errstate(over="ignore"):
        rstd = 1 / np.sqrt(((xs - mean) ** 2).mean(-1, keepdims=True)
                           + np.ldexp(np.float64(eps), -2 * e))
        return (np.moveaxis((xs - mean) * rstd, -1, axis),
                np.moveaxis(np.ldexp(rstd, -e), -1, axis))


@pytest.mark.parametrize("backend", [None, "array_api"])
@pytest.mark.parametrize("dtype, scale", [("float32", 1e-20), ("float32", 1e-30),
                                          ("float32", 1e-42), ("float64", 1e-160),
                                          ("float64", 1e-300), ("float64", 1e-310)])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_rows_whose_squares_underflow_are_normalized(name, dtype, scale, backend):
    # With eps = 0 the squares of such rows are subnormal (1e-20: digits lost) or vanish
    # (inf before the rescaling); 1e-42 and 1e-310 are subnormal inputs themselves.
    rng = np.random.default_rng(18)
    x = (rng.standard_normal((6, 33)) * scale).astype(DTYPES[dtype])
    x[2] = (scale * (3 + rng.standard_normal(33))).astype(DTYPES[dtype])  # an offset
    x[1] = random_rows(rng, 33, dtype)  # an ordinary row beside them
    y = FUNCTIONS[name](x, eps=0.0, backend=backend)
    assert np.isfinite(y).all()
    y_ref, _ = _scaled_ref(name, x, 0.0)
    # Subnormal inputs hold fewer digits; the result is exact for the values they hold.
    np.testing.assert_allclose(y, y_ref, atol=ATOL[dtype] * 4)
    assert np.array_equal(y[1], FUNCTIONS[name](x[1:2], eps=0.0, backend=backend)[0])


def _scaled_ref_rows(name, x, eps):
    """:func:`_scaled_ref`'s y over the last axis, with LayerNorm's constant rows as the
    contract has them (NaN for eps = 0, else 0: the float64 mean of equal values may
    round, the kernels' differences from the first element do not)."""
    with np.errstate(divide="ignore", invalid="ignore"):  # eps = 0: 0 * inf, as meant
        y, _ = _scaled_ref(name, x, eps)
    if name == "layer_norm":
        const = (x == x[:, :1]).all(axis=1, keepdims=True)
        y = np.where(const, np.nan if eps == 0 else 0.0, y)
    return y


@settings(max_examples=60, deadline=None)
@example(dtype="float32", exponent=-20, eps="tiny", n=1, layout="rows", name="rms_norm",
         seed=0)
@given(dtype=st.sampled_from(["float32", "float64"]), exponent=st.integers(-320, 300),
       eps=st.sampled_from([0.0, 1e-5, 1e-40, "tiny"]), n=st.sampled_from([1, 3, 40, 129, 300]),
       layout=st.sampled_from(["rows", "strided", "columns"]),
       name=st.sampled_from(sorted(FUNCTIONS)), seed=st.integers(0, 2**16))
def test_rows_of_any_magnitude_property(dtype, exponent, eps, n, layout, name, seed):
    # Rows from subnormal to near overflow, with eps = 0, a common eps, and ones below
    # the squares of tiny rows (the smallest near the dtype's subnormals); a constant row
    # among them. Every kernel path gives the rescaled float64 reference, and the same
    # non-finite rows (the contract's NaN).
    if eps == "tiny":
        eps = 1e-44 if dtype == "float32" else 1e-305
    scale = 10.0**exponent
    lo, hi = (1e-44, 1e36) if dtype == "float32" else (1e-320, 1e300)
    if not lo < scale < hi:
        scale = 10.0 ** (exponent % 30)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((5, n)) * scale).astype(DTYPES[dtype])
    x[3] = x[3, 0]
    if layout == "strided":
        wide = np.zeros((5, 2 * n), x.dtype)
        wide[:, ::2] = x
        y = FUNCTIONS[name](wide[:, ::2], eps=eps)
    elif layout == "columns":
        y = FUNCTIONS[name](np.ascontiguousarray(x.T)[None], axis=1, eps=eps)[0].T
    else:
        y = FUNCTIONS[name](x, eps=eps)
    # eps is added in the accumulation dtype (float32 here for float32 rows), which
    # rounds a subnormal one: float32(1e-44) is 9.8e-45, 2% less, which moves y by 9e-5
    # on a row whose squares are as small.
    ref = _scaled_ref_rows(name, x, float(DTYPES[dtype](eps)))
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(y), finite)
    if not finite.any():  # n = 1 with eps = 0: every row constant
        return
    # Subnormal inputs hold fewer digits: an absolute bound at the reference's scale.
    np.testing.assert_allclose(y[finite], ref[finite], rtol=0,
                               atol=ATOL[dtype] * 4 * max(1.0, np.abs(ref[finite]).max()))


@pytest.mark.parametrize("layout", ["short", "long", "strided", "columns", "parallel"])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_underflowing_rows_on_every_kernel_path(name, layout):
    rng = np.random.default_rng(19)
    x, axis = _kernel_path_layouts(rng, "float32", 1e-30)[layout]
    x = x.copy() if layout != "strided" else x
    sel = (slice(1, 2),) if axis == -1 else (slice(None), slice(None), slice(1, 2))
    x[sel] = random_rows(rng, x[sel].shape, "float32")  # an ordinary row among them
    ordinary = x[sel].copy()
    kw = {"axis": axis, "return_stats": True, "eps": 0.0}
    y, *stats = FUNCTIONS[name](x, **kw)
    assert np.isfinite(y).all() and all(np.isfinite(s).all() for s in stats)
    y_ref, rstd_ref = _scaled_ref(name, x, 0.0, axis)
    np.testing.assert_allclose(y, y_ref, atol=ATOL["float32"] * 4)
    np.testing.assert_allclose(stats[-1], rstd_ref, rtol=1e-5)
    if name == "layer_norm":
        mean64 = x.astype(np.float64).mean(axis, keepdims=True)
        np.testing.assert_allclose(stats[0], mean64, rtol=1e-5, atol=1e-45)
    # Ordinary rows beside them keep the fast path's bits.
    assert np.array_equal(y[sel], FUNCTIONS[name](ordinary, axis=axis, eps=0.0))
    if layout != "strided":
        inplace = x.copy()
        assert np.array_equal(FUNCTIONS[name](inplace, axis=axis, eps=0.0, out=inplace), y)


@pytest.mark.parametrize("backend", [None, "array_api"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [40, 300])
def test_constant_and_zero_rows_keep_their_rules_with_eps_zero(dtype, n, backend):
    # Their rstd is infinite, as for rows whose squares vanish, but these rows are
    # exactly what it says: LayerNorm NaN for both (0 * inf), RMSNorm NaN for zeros and
    # +-1 for a constant row; with a tiny eps > 0, LayerNorm gives exactly 0 (the bias),
    # also for a constant row of large values (a rescaling by them would make eps vanish).
    x = np.empty((4, n), DTYPES[dtype])
    x[0], x[1], x[2] = 3e-30, 0.0, -7e10
    x[3] = np.linspace(1e-30, 2e-30, n)  # an underflowing row beside them
    y = ln.layer_norm(x, eps=0.0, backend=backend)
    assert np.isnan(y[:3]).all() and np.isfinite(y[3]).all()
    r = ln.rms_norm(x, eps=0.0, backend=backend)
    assert np.isnan(r[1]).all()
    ulps = 4 * np.finfo(x.dtype).eps
    np.testing.assert_allclose(r[0], np.ones(n), rtol=ulps)
    np.testing.assert_allclose(r[2], -np.ones(n), rtol=ulps)
    tiny_eps = 1e-44 if dtype == "float32" else 1e-320
    y, mean, rstd = ln.layer_norm(x[:3], eps=tiny_eps, backend=backend, return_stats=True)
    assert np.array_equal(y, np.zeros((3, n), x.dtype))
    assert np.array_equal(mean.ravel(), x[:3, 0])
    eps_acc = x.dtype.type(tiny_eps)  # as the accumulation dtype holds it
    np.testing.assert_allclose(rstd.astype(np.float64), 1 / np.sqrt(np.float64(eps_acc)),
                               rtol=1e-6)


@pytest.mark.parametrize("backend", [None, "array_api"])
def test_subnormal_rows_with_a_tiny_positive_eps(backend):
    # float64 rows near 1e-310 (subnormal) with eps = 1e-305: var is negligible beside
    # eps, so y = (x - mean) / sqrt(eps); scaling such a row to [0.5, 1) would make
    # eps * s**2 overflow, so the rescaling caps s.
    rng = np.random.default_rng(20)
    x = rng.standard_normal((3, 64)) * 1e-310
    y = ln.layer_norm(x, eps=1e-305, backend=backend)
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(1e-305)
    # (x - mean) of subnormals is exact only to the smallest subnormal: an absolute bound.
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-12 * np.abs(expected).max())
    r = ln.rms_norm(x, eps=1e-305, backend=backend)
    expected = x / np.sqrt(1e-305)
    np.testing.assert_allclose(r, expected, rtol=0, atol=1e-12 * np.abs(expected).max())


# ------------------------------------------------------------------ 7: torch lazy bits


def test_torch_negative_and_conjugate_bits_are_applied():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    c = torch.complex(torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32)),
                      torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32)))
    lazy = c.conj().imag  # a view with the negative bit set
    assert lazy.is_neg()
    plain = lazy.resolve_neg()
    assert torch.equal(ln.layer_norm(lazy, 8), ln.layer_norm(plain, 8))
    w = lazy[0]
    assert torch.equal(ln.layer_norm(plain, 8, w), ln.layer_norm(plain, 8, w.resolve_neg()))
    assert torch.equal(ln.rms_norm(lazy, 8), ln.rms_norm(plain, 8))


def test_torch_sparse_and_nested_tensors_are_type_errors():
    torch = pytest.importorskip("torch")
    dense = torch.randn(3, 4)
    with pytest.raises(TypeError, match="x must be a dense"):
        ln.layer_norm(dense.to_sparse())
    with pytest.raises(TypeError, match="weight must be a dense"):
        ln.layer_norm(dense, 4, torch.randn(4).to_sparse())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises(TypeError, match="nested"):
        ln.layer_norm(nested, 4)


# ------------------------------------------------------------------ 8: generic path accuracy


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_generic_path_keeps_offset_rows_accurate(name):
    rng = np.random.default_rng(7)
    x = (1e4 + rng.standard_normal((64, 256))).astype(np.float32)
    x[3, 0] = 1e4 + 40.0  # an outlying first element
    x[4, -1] = 1e4 - 40.0  # and a last one
    expected = _ref(name, x)
    for backend in (None, "array_api"):
        err = np.abs(FUNCTIONS[name](x, backend=backend).astype(np.float64) - expected).max()
        assert err <= 2e-6, (backend, err)
    xs = pytest.importorskip("array_api_strict")
    err = np.abs(np.asarray(FUNCTIONS[name](xs.asarray(x))).astype(np.float64) - expected)
    assert err.max() <= 2e-6


def test_generic_path_statistics_stay_accurate_on_offset_rows():
    rng = np.random.default_rng(8)
    x = (1e4 + rng.standard_normal((8, 512))).astype(np.float32)
    _, mean, rstd = ln.layer_norm(x, return_stats=True, backend="array_api")
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean[:, 0], x64.mean(1), rtol=1e-7)
    np.testing.assert_allclose(rstd[:, 0], 1 / np.sqrt(x64.var(1) + 1e-5), rtol=2e-6)


# ------------------------------------------------------------------ 9: overlapping outputs


@settings(max_examples=25, deadline=None)
@given(which=st.sampled_from(["weight", "bias"]), rows=st.sampled_from([1, 3, 300]),
       n=st.sampled_from([8, 37, 256]), offset=st.integers(0, 7))
def test_out_overlapping_a_parameter_gives_the_unaliased_result(which, rows, n, offset):
    rng = np.random.default_rng(rows * n + offset)
    x = random_rows(rng, (rows, n), "float32")
    buffer = random_rows(rng, rows * n + 2 * n + offset, "float32")
    params = {"weight": buffer[offset:offset + n], "bias": buffer[offset + n:offset + 2 * n]}
    expected = ln.layer_norm(x, n, params["weight"].copy(), params["bias"].copy())
    start = offset if which == "weight" else offset + n
    out = buffer[start:start + rows * n].reshape(rows, n)
    got = ln.layer_norm(x, n, params["weight"], params["bias"], out=out)
    assert got is out
    assert np.array_equal(got, expected)


def test_in_place_on_rows_that_share_memory_is_a_value_error():
    base = random_rows(np.random.default_rng(9), 16, "float32")
    rows = as_strided(base, shape=(4, 8), strides=(8, 4))  # rows overlap by half
    before = base.copy()
    for name in sorted(FUNCTIONS):
        with pytest.raises(ValueError, match="out has elements that share memory"):
            FUNCTIONS[name](rows, out=rows)
    assert np.array_equal(base, before)
    one_row = as_strided(np.empty(8, np.float32), shape=(4, 8), strides=(0, 4))
    with pytest.raises(ValueError, match="share memory"):
        ln.layer_norm(random_rows(np.random.default_rng(9), (4, 8), "float32"), out=one_row)


@pytest.mark.parametrize("shape, axis", [((0, 16), -1), ((3, 0), -1), ((4, 0, 3), 2),
                                         ((4, 3, 0), 1)])
def test_out_of_an_empty_array_is_accepted(shape, axis):
    # NumPy gives arrays of no elements zero strides: no two of their (no) elements
    # share memory, so np.empty_like(x) is a valid out= and residual_out=.
    x = np.ones(shape, np.float32)
    for name in sorted(FUNCTIONS):
        out = np.empty_like(x)
        assert FUNCTIONS[name](x, axis=axis, out=out) is out
    y, h = np.empty_like(x), np.empty_like(x)
    for add in (ln.add_layer_norm, ln.add_rms_norm):
        got = add(x, x, axis=axis, out=y, residual_out=h)
        assert got[0] is y and got[1] is h
    codes = np.empty(shape, np.int8)
    assert ln.layer_norm(x, axis=axis, quantize="int8", out=codes)[0] is codes


def test_reading_rows_that_share_memory_is_fine():
    base = random_rows(np.random.default_rng(10), 16, "float64")
    rows = as_strided(base, shape=(4, 8), strides=(16, 8), writeable=False)
    np.testing.assert_allclose(ln.layer_norm(rows), _ref("layer_norm", rows), atol=1e-12)


# ------------------------------------------------------------------ 12: messages


def test_out_on_the_generic_path_names_the_backend():
    x = random_rows(np.random.default_rng(11), (2, 4), "float32")
    with pytest.raises(TypeError, match="out= is not supported on the array_api backend"):
        ln.layer_norm(x, out=np.empty_like(x), backend="array_api")


@pytest.mark.parametrize("bad", [{8: 1}, {8}, "8", 8.0])
def test_normalized_shape_must_be_an_int_or_a_sequence_of_ints(bad):
    x = random_rows(np.random.default_rng(12), (2, 8), "float32")
    with pytest.raises(TypeError, match="normalized_shape must be an int or a tuple"):
        ln.layer_norm(x, bad)


def test_normalized_shape_accepts_lists_and_integer_arrays():
    x = random_rows(np.random.default_rng(13), (2, 3, 4), "float32")
    expected = ln.layer_norm(x, (3, 4))
    assert np.array_equal(ln.layer_norm(x, [3, 4]), expected)
    assert np.array_equal(ln.layer_norm(x, np.array([3, 4])), expected)


def test_bfloat16_weight_is_read_as_bfloat16():
    # The 16-bit bits paths must never read a parameter's bytes as another dtype.
    x = random_rows(np.random.default_rng(14), (3, 8), "float32")
    w = np.full(8, 2.0, ml_dtypes.bfloat16)
    assert np.array_equal(ln.layer_norm(x, 8, w), ln.layer_norm(x, 8) * np.float32(2.0))


# ------------------------------------------------------------------ GPU: allocation device


def test_outputs_are_allocated_inside_the_backends_device_scope(monkeypatch):
    """A CuPy x off the current device must get outputs and statistics on its own device.

    Device-agnostic: a fake backend whose ``device_scope`` records entering and leaving,
    and a NumPy namespace wrapper that records whether each allocation happened inside.
    """
    import contextlib
    import types

    from layernorm import _engine
    from layernorm._backends import _numba
    from layernorm._dispatch import Route

    state = {"inside": False, "allocations": []}

    @contextlib.contextmanager
    def device_scope(x):
        state["inside"] = True
        try:
            yield
        finally:
            state["inside"] = False

    def recorded(name):
        def allocate(*args, **kwargs):
            state["allocations"].append((name, state["inside"]))
            return getattr(np, name)(*args, **kwargs)
        return allocate

    fake_backend = types.SimpleNamespace(
        device_scope=device_scope,
        **{name: getattr(_numba, name) for name in (
            "layer_norm_forward", "rms_norm_forward", "layer_norm_backward",
            "rms_norm_backward")})
    fake_xp = types.SimpleNamespace(
        empty=recorded("empty"), zeros=recorded("zeros"),
        ascontiguousarray=recorded("ascontiguousarray"), may_share_memory=np.may_share_memory)
    monkeypatch.setattr(_engine, "native", lambda name: fake_backend)
    route = Route("numpy", "numba")
    rng = np.random.default_rng(15)
    x = random_rows(rng, (6, 5, 4), "float32")
    w = random_rows(rng, 5, "float64")  # cast to float32 inside the scope
    req = _engine.request(x, route, None, 1, weight=w, bias=None)
    y, mean, rstd = _engine.forward(fake_xp, x, req, w, None, 1e-5, None, rms=False)
    np.testing.assert_array_equal(y, ln.layer_norm(x, weight=w, axis=1))
    grads = _engine.backward(fake_xp, y, x, req, mean, rstd, w, rms=False)
    assert all(np.isfinite(g).all() for g in grads)
    assert state["allocations"], "the engine allocated nothing through xp"
    assert all(inside for _, inside in state["allocations"]), state["allocations"]
