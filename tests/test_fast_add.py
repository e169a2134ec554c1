"""The short path for repeated NumPy ``add_layer_norm``/``add_rms_norm`` calls
(``layernorm._fast_add``).

It must give exactly the general path's bits, dtypes, shapes and return structure
(``backend="numba"`` always takes the general path), write ``out``/``residual_out`` in
place as the general path does, never modify any other input, and leave every call it
does not plan (other layouts, dtypes, arguments, overlapping outputs) and every invalid
call to the general path, which raises the same errors as before.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import layernorm as ln
from layernorm import _engine, _fast_add
from layernorm._backends import _numba

from .conftest import random_rows

SHAPES = [(1, 768), (3, 5, 64), (121, 768), (2, 4096), (7, 100), (33,)]


@pytest.fixture
def general_calls(monkeypatch):
    """Counts the calls that reach the general path (:func:`layernorm._engine.add_normalize`)."""
    calls = []
    real = _engine.add_normalize

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(_engine, "add_normalize", spy)
    return calls


def _inputs(rng, shape, dtype, params):
    """x, residual, weight and bias (``params``: "none", "weight" or "both")."""
    x = random_rows(rng, shape, dtype, loc=0.5)
    r = random_rows(rng, shape, dtype, loc=-1.0, scale=2.0)
    acc = np.float64 if dtype == "float64" else np.float32
    n = shape[-1]
    w = (1.0 + 0.5 * rng.standard_normal(n)).astype(acc) if params != "none" else None
    b = (0.3 * rng.standard_normal(n)).astype(acc) if params == "both" else None
    return x, r, w, b


def _add(rms, x, r, w, b, **kwargs):
    if rms:
        return ln.add_rms_norm(x, r, weight=w, **kwargs)
    return ln.add_layer_norm(x, r, weight=w, bias=b, **kwargs)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _assert_same(got, want):
    assert type(got) is tuple and len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if type(w) is not np.ndarray:  # a static scale, returned as passed
            assert type(g) is type(w) and g == w
            continue
        assert type(g) is np.ndarray
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(_bits(g), _bits(w))


def _planned(rms, x):
    """The plans the short path holds for calls like ``x`` (RMSNorm or LayerNorm)."""
    # (the full keys: plans are also kept under a key of shapes alone, without dtypes)
    return [plan for key, plan in _fast_add._PLANS.items()
            if isinstance(key[2], np.dtype) and key[0] == rms and key[1] == x.shape
            and key[2] == x.dtype]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("params", ["none", "weight", "both"])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("return_stats", [False, True])
def test_short_path_matches_the_general_path_bitwise(general_calls, shape, dtype, params,
                                                     rms, return_stats):
    rng = np.random.default_rng(sum(shape) + 7 * rms + 3 * len(params))
    x, r, w, b = _inputs(rng, shape, dtype, params)
    inputs = [a for a in (x, r, w, b) if a is not None]
    before = [a.copy() for a in inputs]
    for _ in range(3):  # the first call plans, later ones run the compiled entry point
        fast = _add(rms, x, r, w, b, return_stats=return_stats)
    assert not general_calls
    assert any(isinstance(plan, _fast_add.AddPlan) for plan in _planned(rms, x))
    general = _add(rms, x, r, w, b, return_stats=return_stats, backend="numba")
    assert len(general_calls) == 1
    _assert_same(fast, general)
    stats_count = (1 if rms else 2) if return_stats else 0
    assert len(fast) == 2 + stats_count
    assert fast[0].dtype == fast[1].dtype == x.dtype
    for a, kept in zip(inputs, before, strict=True):
        assert np.array_equal(_bits(a), _bits(kept))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 768), (4, 100), (121, 768)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rms", [False, True])
def test_half_precision_rows_take_the_short_path(general_calls, dtype, shape, rms):
    rng = np.random.default_rng(5 + rms)
    x, r, w, b = _inputs(rng, shape, dtype, "both")
    for _ in range(2):
        fast = _add(rms, x, r, w, b, return_stats=True)
    assert not general_calls
    _assert_same(fast, _add(rms, x, r, w, b, return_stats=True, backend="numba"))


@pytest.mark.parametrize("param_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(2, 768), (3, 4096)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rms", [False, True])
def test_half_precision_parameters_take_the_short_path(general_calls, param_dtype, x_dtype,
                                                       shape, rms):
    """16-bit weight and bias are widened exactly (a NumPy cast at 768, the backend's
    small kernel at 4096): the bits of the general path, and of float32 parameters
    holding the same values."""
    rng = np.random.default_rng(11 + rms)
    x, r, w, b = _inputs(rng, shape, x_dtype, "both")
    w16, b16 = w.astype(param_dtype), b.astype(param_dtype)
    for _ in range(2):
        fast = _add(rms, x, r, w16, b16, return_stats=True)
    assert not general_calls
    _assert_same(fast, _add(rms, x, r, w16, b16, return_stats=True, backend="numba"))
    _assert_same(fast, _add(rms, x, r, w16.astype(np.float32), b16.astype(np.float32),
                            return_stats=True))


ALIASES = ["out=x", "out=residual", "residual_out=x", "residual_out=residual",
           "out=x,residual_out=residual", "out=residual,residual_out=x", "out=new",
           "residual_out=new", "out=new,residual_out=new"]


@pytest.mark.parametrize("shape", [(1, 768), (3, 5, 64), (121, 768), (7, 100)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("case", ALIASES)
def test_outputs_in_place_and_given(general_calls, shape, rms, case):
    rng = np.random.default_rng(len(case) + rms)
    x0, r0, w, b = _inputs(rng, shape, "float32", "both")
    want = _add(rms, x0, r0, w, b, return_stats=True, backend="numba")
    general_calls.clear()

    def call():
        x, r = x0.copy(), r0.copy()
        kwargs = {}
        for part in case.split(","):
            name, target = part.split("=")
            kwargs[name] = {"x": x, "residual": r}.get(target)
            if kwargs[name] is None:
                kwargs[name] = random_rows(rng, shape, "float32")  # fresh, never zeros
        got = _add(rms, x, r, w, b, return_stats=True, **kwargs)
        for name, arr in (("out", got[0]), ("residual_out", got[1])):
            if name in kwargs:
                assert arr is kwargs[name]
        # Inputs not named as an output keep their values.
        targets = [id(a) for a in kwargs.values()]
        if id(x) not in targets:
            assert np.array_equal(_bits(x), _bits(x0))
        if id(r) not in targets:
            assert np.array_equal(_bits(r), _bits(r0))
        return got

    for _ in range(2):
        got = call()
    assert not general_calls
    _assert_same(got, want)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize(("normalized_shape", "axis"), [((3, 40), None), (None, (-2, -1))])
def test_several_trailing_axes_take_the_short_path(general_calls, rms, normalized_shape,
                                                   axis):
    rng = np.random.default_rng(11)
    x = random_rows(rng, (2, 3, 40), "float32", loc=1.0)
    r = random_rows(rng, x.shape, "float32")
    w = (1.0 + 0.5 * rng.standard_normal((3, 40))).astype(np.float32)
    b = (0.5 * rng.standard_normal((3, 40))).astype(np.float32)
    kw = {"normalized_shape": normalized_shape, "axis": axis, "return_stats": True}
    for _ in range(2):
        fast = _add(rms, x, r, w, b, **kw)
    assert not general_calls
    _assert_same(fast, _add(rms, x, r, w, b, backend="numba", **kw))
    assert fast[2].shape == (2, 1, 1)


@pytest.mark.parametrize("residual_dtype", ["float32", np.float32, np.dtype(np.float32)],
                         ids=["name", "type", "dtype"])
def test_residual_dtype_of_the_residual_takes_the_short_path(general_calls, residual_dtype):
    rng = np.random.default_rng(3)
    x, r, w, b = _inputs(rng, (4, 96), "float32", "both")
    for _ in range(2):
        fast = _add(False, x, r, w, b, residual_dtype=residual_dtype, eps=1e-3)
    assert not general_calls
    _assert_same(fast, _add(False, x, r, w, b, eps=1e-3, backend="numba"))


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_large_calls_choose_kernels_as_the_general_path(general_calls, monkeypatch, rms,
                                                        stream):
    # Above PARALLEL_MIN_ELEMENTS: the backend's serial-or-parallel choice, and streaming
    # stores where the backend's decision says so (forced here: only bits' route changes).
    monkeypatch.setattr(_numba, "fused_add_streams", lambda x, res, y: stream)
    rng = np.random.default_rng(9)
    x, r, w, b = _inputs(rng, (40, 2048), "float32", "both")
    for _ in range(2):
        fast = _add(rms, x, r, w, b, return_stats=True)
    assert not general_calls
    _assert_same(fast, _add(rms, x, r, w, b, return_stats=True, backend="numba"))


@pytest.mark.parametrize("shape", [(4, 300), (37, 64), (121, 768)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rms", [False, True])
def test_rows_whose_squares_overflow_are_completed(general_calls, shape, rms):
    # The kernels stop before such a row; the rest of its block is normalized from h
    # (the backend's completion, shared with the general path).
    rng = np.random.default_rng(2)
    x, r, w, b = _inputs(rng, shape, "float32", "both")
    x[1::3] *= np.float32(1e19)
    want = _add(rms, x, r, w, b, return_stats=True, backend="numba")
    general_calls.clear()
    for _ in range(2):
        got = _add(rms, x, r, w, b, return_stats=True)
    assert not general_calls and np.isfinite(got[0]).all()
    _assert_same(got, want)
    xi, ri = x.copy(), r.copy()
    y, h = _add(rms, xi, ri, w, b, out=xi, residual_out=ri)
    assert y is xi and h is ri and not general_calls
    _assert_same((y, h), want[:2])


def _fallbacks():
    rng = np.random.default_rng(4)
    x, r, w, b = _inputs(rng, (6, 32), "float32", "both")
    buf = np.empty((7, 32), np.float32)
    buf[:6] = r
    return {
        "strided x": dict(x=random_rows(rng, (6, 64), "float32")[:, ::2]),
        "strided out": dict(out=np.empty((6, 64), np.float32)[:, ::2]),
        "other residual dtype": dict(r=r.astype(np.float16)),
        "float64 stream": dict(residual_dtype="float64"),
        "columns": dict(axis=0, w=None, b=None),
        "offset of a NumPy type": dict(weight_offset=np.float32(1.0)),
        "float64 weight": dict(w=w.astype(np.float64)),
        "overlapping residual_out": dict(r=buf[:6], residual_out=buf[1:]),
        "out a view of x": dict(out_view_of_x=True),
        "numpy eps": dict(eps=np.float32(1e-5)),
    }, (x, r, w, b)


def _fallback_call(case, rms, **kwargs):
    """Run fallback ``case`` on fresh inputs (an output may overwrite one of them)."""
    cases, (x, r, w, b) = _fallbacks()
    spec = dict(cases[case])
    x, r = spec.pop("x", x), spec.pop("r", r)
    w, b = spec.pop("w", w), spec.pop("b", b)
    if spec.pop("out_view_of_x", False):
        spec["out"] = x[:]
    return _add(rms, x, r, w, b, **spec, **kwargs)


@pytest.mark.parametrize("case", list(_fallbacks()[0]))
@pytest.mark.parametrize("rms", [False, True])
def test_other_calls_take_the_general_path(general_calls, case, rms):
    want = _fallback_call(case, rms, backend="numba")
    general_calls.clear()
    got = _fallback_call(case, rms)
    assert len(general_calls) == 1
    _assert_same(got, want)


def _errors():
    rng = np.random.default_rng(6)
    x, r, w, b = _inputs(rng, (3, 64), "float32", "both")
    read_only = np.empty_like(x)
    read_only.flags.writeable = False
    return x, r, w, b, {
        "residual shape": dict(r=r[:, :32].copy()),
        "residual list": dict(r=r.tolist()),
        "residual int": dict(r=r.astype(np.int32)),
        "negative eps": dict(eps=-1.0),
        "nan eps": dict(eps=float("nan")),
        "eps rounds to 0": dict(eps=1e-50),
        "string eps": dict(eps="1e-5"),
        "out dtype": dict(out=np.empty(x.shape, np.float64)),
        "out shape": dict(out=np.empty((3, 32), np.float32)),
        "read-only out": dict(out=read_only),
        "residual_out dtype": dict(residual_out=np.empty(x.shape, np.float16)),
        "out is residual_out": dict(out="x", residual_out="x"),
        "weight shape": dict(w=w[:32].copy()),
        "bad residual_dtype": dict(residual_dtype="int8"),
        "scale without quantize": dict(scale=1.0),
    }


def _assert_same_errors(rms, x, r, w, b, **spec):
    """The call fails with the same error type and message on the general path
    (``backend="numba"``) and by the short path's hand-off."""
    errors = []
    for backend in ("numba", None):
        with pytest.raises((TypeError, ValueError)) as info:
            _add(rms, x, r, w, b, backend=backend, **spec)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("case", list(_errors()[-1]))
@pytest.mark.parametrize("rms", [False, True])
def test_invalid_calls_raise_the_general_paths_errors(case, rms):
    x, r, w, b, cases = _errors()
    _add(rms, x, r, w, b)  # the valid call first: the invalid one finds a plan for x
    spec = dict(cases[case])
    r, w = spec.pop("r", r), spec.pop("w", w)
    if isinstance(spec.get("out"), str):
        spec["out"] = spec["residual_out"] = x
    _assert_same_errors(rms, x, r, w, b, **spec)


@pytest.mark.parametrize("offset", [1.0, -0.5, 1], ids=["1.0", "-0.5", "int 1"])
@pytest.mark.parametrize("weight_dtype", ["float32", "float16"])
@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("rms", [False, True])
def test_offset_gains_take_the_short_path(general_calls, offset, weight_dtype, quantize, rms):
    """``weight_offset`` (Gemma's zero-centred gain) on the short path: the gain formed
    as the general path forms it, the same bits, and the weight left as it was."""
    rng = np.random.default_rng(46)
    x, r, w, b = _inputs(rng, (7, 200), "float32", "both")
    w = (0.1 * rng.standard_normal(200)).astype(weight_dtype)  # small, as such weights are
    w0 = w.copy()
    for return_stats in (False, True):
        want = _add(rms, x, r, w, b, weight_offset=offset, quantize=quantize,
                    return_stats=return_stats, backend="numba")
        general_calls.clear()
        for _ in range(2):
            got = _add(rms, x, r, w, b, weight_offset=offset, quantize=quantize,
                       return_stats=return_stats)
        assert not general_calls
        _assert_same(got, want)
    # and not the result without the offset (which the gain must change)
    plain = _add(rms, x, r, w, b, quantize=quantize)
    assert not np.array_equal(plain[0], got[0])
    assert np.array_equal(w, w0)


@pytest.mark.parametrize("rms", [False, True])
def test_layer_norm_without_eps_is_an_error_and_rms_norm_defaults(general_calls, rms):
    rng = np.random.default_rng(8)
    x, r, _, _ = _inputs(rng, (2, 48), "float32", "none")
    if rms:
        for _ in range(2):
            got = ln.add_rms_norm(x, r, eps=None)
        assert not general_calls
        _assert_same(got, ln.add_rms_norm(x, r, eps=None, backend="numba"))
    else:
        with pytest.raises(ValueError, match="eps"):
            ln.add_layer_norm(x, r, eps=None)


@pytest.mark.parametrize("rms", [False, True])
def test_calls_of_one_shape_and_several_dtypes_each_get_their_own_plan(rms):
    """Plans are found by shapes and checked by dtype identity: alternating dtypes of
    one shape, and a dtype equal to float32 but another object, give each the general
    path's bits."""
    rng = np.random.default_rng(31)
    native = np.dtype(np.float32).newbyteorder("=")  # equal to float32, not the same object
    cases = []
    for dtype in ("float32", "float64", native):
        x, r, w, b = _inputs(rng, (6, 80), "float64", "both")
        acc = np.float64 if dtype == "float64" else np.float32
        cases.append((x.astype(dtype), r.astype(dtype), w.astype(acc), b.astype(acc)))
    x, r, w, b = cases[1]
    cases.append((x, r, w.astype(np.float32), b.astype(np.float32)))  # float32 parameters
    for _ in range(3):
        for x, r, w, b in cases:
            got = _add(rms, x, r, w, b, return_stats=True)
            _assert_same(got, _add(rms, x, r, w, b, return_stats=True, backend="numba"))
            assert got[0].dtype == x.dtype


# --------------------------------------------------------------------------- quantized

FORMATS = ["int8", "float8_e4m3fn", "float8_e5m2"]


def _quant_planned(rms, x, quantize):
    # keys: (x's shape, normalized_shape, axis, weight's and bias's shapes, quantize, rms)
    return [plan for key, plan in _fast_add._QUANT_PLANS.items()
            if key[0] == x.shape and key[-2] == quantize and key[-1] == rms]


# int8 on every row path; the float8 formats (each compiles kernels of its own) on one.
@pytest.mark.parametrize(("shape", "quantize"),
                         [(s, "int8") for s in SHAPES]
                         + [((121, 768), f) for f in FORMATS[1:]],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
@pytest.mark.parametrize("scale", [None, 0.03])
@pytest.mark.parametrize("rms", [False, True])
def test_quantized_short_path_matches_the_general_path_bitwise(general_calls, shape,
                                                               quantize, scale, rms):
    rng = np.random.default_rng(41)
    x, r, w, b = _inputs(rng, shape, "float32", "both")
    x0, r0 = x.copy(), r.copy()
    for return_stats in (False, True):
        want = _add(rms, x, r, w, b, quantize=quantize, scale=scale,
                    return_stats=return_stats, backend="numba")
        general_calls.clear()
        for _ in range(2):  # the plan's first call, then a call that finds it
            got = _add(rms, x, r, w, b, quantize=quantize, scale=scale,
                       return_stats=return_stats)
        assert not general_calls
        _assert_same(got, want)
        # the scale: per-row (keepdims, float32) or the caller's, as the general path
        assert (got[2] is scale) if scale is not None else got[2].shape == want[2].shape
    assert len(_quant_planned(rms, x, quantize)) == 1
    assert np.array_equal(x, x0) and np.array_equal(r, r0)  # inputs untouched
    # Given outputs: the codes into out=, h into residual_out= or in place into x or r.
    want = _add(rms, x, r, w, b, quantize=quantize, scale=scale, backend="numba")
    general_calls.clear()
    for target in ("fresh", "x", "residual"):
        xi, ri = x.copy(), r.copy()
        q = np.empty(shape, want[0].dtype)
        h = {"fresh": np.empty_like(x), "x": xi, "residual": ri}[target]
        got = _add(rms, xi, ri, w, b, quantize=quantize, scale=scale, out=q, residual_out=h)
        assert got[0] is q and got[1] is h and not general_calls
        _assert_same(got, want)
        if target != "x":
            assert np.array_equal(xi, x)
        if target != "residual":
            assert np.array_equal(ri, r)


#: Static scales the short paths take besides a Python float: NumPy float scalars,
#: one-element NumPy float arrays (of at most the statistics' dimensions) and per-row
#: float32/float64 arrays of the statistics' shape.
SCALAR_SCALES = {
    "float32 scalar": np.float32(0.0625),
    "float64 scalar": np.float64(0.03),
    "float16 scalar": np.float16(0.03),
    "0-d array": np.array(0.03, np.float32),
    "(1, 1) array": np.full((1, 1), 0.03, np.float64),
    # per row (the statistics' shape), float32 or float64
    "per-row float32": (0.01 + np.arange(5, dtype=np.float32) / 50).reshape(5, 1),
    "per-row float64": np.linspace(0.01, 0.2, 5).reshape(5, 1),
}


@pytest.mark.parametrize("kind", list(SCALAR_SCALES))
@pytest.mark.parametrize("rms", [False, True])
def test_numpy_scalar_scales_take_the_short_path(general_calls, kind, rms):
    """A NumPy scalar, one-element array or per-row array scale gives the general path's
    codes, bit for bit, on the short path, and comes back as passed (the same object)."""
    scale = SCALAR_SCALES[kind]
    rng = np.random.default_rng(44)
    x, r, w, b = _inputs(rng, (5, 96), "float32", "both")
    for quantize in ("int8", "float8_e4m3fn"):
        want = _add(rms, x, r, w, b, quantize=quantize, scale=scale, return_stats=True,
                    backend="numba")
        if scale.size == 1:  # the same codes as its value as a Python float
            as_float = _add(rms, x, r, w, b, quantize=quantize,
                            scale=np.asarray(scale).item(), return_stats=True,
                            backend="numba")
            np.testing.assert_array_equal(want[0].view(np.uint8),
                                          as_float[0].view(np.uint8))
        general_calls.clear()
        for _ in range(2):  # the plan's first call, then a call that finds it
            got = _add(rms, x, r, w, b, quantize=quantize, scale=scale, return_stats=True)
        assert not general_calls
        _assert_same(got, want)
        assert got[2] is scale


@pytest.mark.parametrize("rms", [False, True])
def test_quantized_rows_whose_squares_overflow_are_completed(general_calls, rms):
    rng = np.random.default_rng(43)
    x, r, w, b = _inputs(rng, (37, 300), "float32", "both")
    x[1::3] *= np.float32(1e19)
    for scale in (None, 0.5):
        want = _add(rms, x, r, w, b, quantize="int8", scale=scale, return_stats=True,
                    backend="numba")
        general_calls.clear()
        for _ in range(2):
            got = _add(rms, x, r, w, b, quantize="int8", scale=scale, return_stats=True)
        assert not general_calls and np.abs(got[0]).max() > 0
        _assert_same(got, want)


def _quantized_fallbacks():
    rng = np.random.default_rng(45)
    x, r, w, b = _inputs(rng, (6, 32), "float32", "both")
    return {
        "float64 x": dict(x=x.astype(np.float64), r=r.astype(np.float64),
                          w=w.astype(np.float64), b=b.astype(np.float64)),
        "float16 residual": dict(r=r.astype(np.float16)),
        "float64 stream": dict(residual_dtype="float64"),
        "float16 per-row scale": dict(scale=np.full((6, 1), 0.25, np.float16)),
        "per-row scale of another shape": dict(scale=np.full(6, 0.25, np.float32)),
        "int scale": dict(scale=2),
        "scale of too many dimensions": dict(scale=np.full((1, 1, 1), 0.25, np.float32)),
        "offset of a NumPy type": dict(weight_offset=np.float64(1.0)),
        "float64 weight": dict(w=w.astype(np.float64)),
        "strided out": dict(out=np.empty((6, 64), np.int8)[:, ::2]),
        "out a view of h": dict(out_in_h=True),
    }, (x, r, w, b)


@pytest.mark.parametrize("case", list(_quantized_fallbacks()[0]))
@pytest.mark.parametrize("rms", [False, True])
def test_other_quantized_calls_take_the_general_path(general_calls, case, rms):
    def call(**kwargs):
        cases, (x, r, w, b) = _quantized_fallbacks()
        spec = dict(cases[case])
        x, r = spec.pop("x", x), spec.pop("r", r)
        w, b = spec.pop("w", w), spec.pop("b", b)
        if spec.pop("out_in_h", False):
            h = np.empty((6, 32), np.float32)
            spec.update(residual_out=h, out=h.view(np.int8)[:, :32])
        return _add(rms, x, r, w, b, quantize="int8", **spec, **kwargs)

    try:
        want = call(backend="numba")
    except (TypeError, ValueError) as exc:  # the general path refuses it: so must both
        with pytest.raises(type(exc), match=re.escape(str(exc))):
            call()
        return
    general_calls.clear()
    got = call()
    assert len(general_calls) == 1
    _assert_same(got, want)


@pytest.mark.parametrize("spec", [dict(scale=-1.0), dict(scale=0.0),
                                  dict(scale=float("inf")), dict(scale=1e-45),
                                  dict(scale=np.float32(-0.5)), dict(scale=np.float64(1e39)),
                                  dict(scale=np.array(np.nan, np.float32)),
                                  dict(scale=np.zeros((1, 1), np.float16)),
                                  dict(scale=np.array([[0.5], [np.inf], [0.5]], np.float32)),
                                  dict(scale=np.array([[0.5], [-0.5], [0.5]])),
                                  dict(scale=np.array([[0.5], [1e-50], [0.5]])),
                                  dict(quantize="int4"), dict(quantize="float8_e4m3fn",
                                                              out="int8 codes")],
                         ids=["negative", "zero", "inf", "inverse overflows",
                              "negative float32", "float64 beyond float32", "NaN 0-d array",
                              "zero float16 array", "an infinite row scale",
                              "a negative row scale", "a row scale below float32",
                              "int4", "out dtype"])
@pytest.mark.parametrize("rms", [False, True])
def test_invalid_quantized_calls_raise_the_general_paths_errors(spec, rms):
    rng = np.random.default_rng(47)
    x, r, w, b = _inputs(rng, (3, 64), "float32", "both")
    _add(rms, x, r, w, b, quantize="int8")  # a plan for x first
    spec = {"quantize": "int8", **spec}
    if spec.get("out") == "int8 codes":
        spec["out"] = np.empty(x.shape, np.int8)
    _assert_same_errors(rms, x, r, w, b, **spec)
