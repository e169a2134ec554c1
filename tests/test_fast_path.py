"""The short path for repeated small NumPy calls (``layernorm._fast``).

It must give exactly the general path's bits (``backend="numba"`` always takes the
general path), and every call that differs from the planned one in something the plan
did not check (contiguity, eps, out, argument types) must still be validated.
"""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln
from layernorm import _fast, _plans

from . import reference
from .conftest import ATOL, DTYPES, random_rows

CASES = [
    # (x shape, normalized_shape, param shape)
    ((1, 768), None, (768,)),
    ((3, 5, 7), 7, (7,)),
    ((2, 3, 4), (3, 4), (3, 4)),
    ((33,), None, (33,)),
    ((2, 1), (2, 1), (2, 1)),  # 2-D, but normalized over both axes: one row of 2
    ((3, 40), (3, 40), (3, 40)),
]


def _args(rng, dtype, shape, pshape, param_dtype=None):
    x = random_rows(rng, shape, dtype, loc=3.0)
    pdt = DTYPES[param_dtype or dtype]
    w = (1.0 + 0.5 * rng.standard_normal(pshape)).astype(pdt)
    b = (0.1 * rng.standard_normal(pshape)).astype(pdt)
    return x, w, b


@pytest.mark.parametrize(("shape", "normalized_shape", "pshape"), CASES)
@pytest.mark.parametrize("return_stats", [False, True])
def test_layer_norm_matches_general_path_bitwise(dtype_name, shape, normalized_shape, pshape,
                                                 return_stats):
    rng = np.random.default_rng(1)
    x, w, b = _args(rng, dtype_name, shape, pshape)
    x_before = x.copy()
    for _ in range(3):  # first call plans, later ones take the compiled entry point
        fast = ln.layer_norm(x, normalized_shape, w, b, 1e-5, return_stats=return_stats)
    general = ln.layer_norm(x, normalized_shape, w, b, 1e-5, return_stats=return_stats,
                            backend="numba")
    fast = fast if return_stats else (fast,)
    general = general if return_stats else (general,)
    for got, want in zip(fast, general, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    axes = tuple(range(x.ndim - len(pshape), x.ndim))
    y_ref, _, _ = reference.layer_norm(x, axes, w, b, 1e-5)
    np.testing.assert_allclose(fast[0].astype(np.float64), y_ref.astype(np.float64),
                               atol=ATOL[dtype_name] * 4, rtol=0)
    np.testing.assert_array_equal(x.view(np.uint8), x_before.view(np.uint8))


@pytest.mark.parametrize(("shape", "normalized_shape", "pshape"), CASES)
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_rms_norm_matches_general_path_bitwise(dtype_name, shape, normalized_shape, pshape,
                                               eps):
    rng = np.random.default_rng(2)
    x, w, _ = _args(rng, dtype_name, shape, pshape)
    for _ in range(3):
        y, rstd = ln.rms_norm(x, normalized_shape, w, eps, return_stats=True)
        y_plain = ln.rms_norm(x, normalized_shape, w, eps)
    gy, grstd = ln.rms_norm(x, normalized_shape, w, eps, return_stats=True, backend="numba")
    assert np.array_equal(y.view(np.uint8), gy.view(np.uint8))
    assert np.array_equal(y_plain.view(np.uint8), gy.view(np.uint8))
    assert np.array_equal(rstd, grstd)


@pytest.mark.parametrize(("axis", "planned"), [
    (-1, True), (2, True), ((1, 2), True), ((-2, -1), True),
    (0, False), ((0, 2), False), (1, False),
])
def test_axis_keyword_matches_general_path_bitwise(axis, planned):
    """Trailing axes given as ``axis`` take the short path; other axes do not."""
    rng = np.random.default_rng(5)
    x = random_rows(rng, (3, 5, 7), "float32", loc=3.0)
    axes = (axis,) if type(axis) is int else axis
    pshape = tuple(x.shape[a] for a in axes)
    w = (1.0 + 0.5 * rng.standard_normal(pshape)).astype(np.float32)
    b = (0.1 * rng.standard_normal(pshape)).astype(np.float32)
    for _ in range(3):
        y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, axis=axis, return_stats=True)
        yr = ln.rms_norm(x, weight=w, axis=axis)
    plan = _fast._PLANS[(x.shape, x.dtype, None, axis, w.shape, w.dtype, b.shape, b.dtype)]
    assert (plan is not None) == planned
    general = ln.layer_norm(x, weight=w, bias=b, axis=axis, return_stats=True,
                            backend="numba")
    for got, want in zip((y, mean, rstd), general, strict=True):
        assert got.shape == want.shape
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    gr = ln.rms_norm(x, weight=w, axis=axis, backend="numba")
    assert np.array_equal(yr.view(np.uint8), gr.view(np.uint8))
    y_ref, _, _ = reference.layer_norm(x, tuple(a % 3 for a in axes), w, b, 1e-5)
    np.testing.assert_allclose(y, y_ref, atol=ATOL["float32"] * 4, rtol=0)


def test_parameters_of_another_dtype_are_cast_like_the_general_path():
    rng = np.random.default_rng(3)
    x, w, b = _args(rng, "float32", (4, 96), (96,), param_dtype="float64")
    for _ in range(2):
        fast = ln.layer_norm(x, weight=w, bias=b)
    general = ln.layer_norm(x, weight=w, bias=b, backend="numba")
    assert np.array_equal(fast, general)


def test_out_and_in_place_match_the_general_path():
    rng = np.random.default_rng(4)
    x, w, b = _args(rng, "float32", (2, 3, 64), (64,))
    want = ln.layer_norm(x, weight=w, bias=b, backend="numba")
    out = np.full_like(x, 7.0)
    for _ in range(2):
        got = ln.layer_norm(x, weight=w, bias=b, out=out)
        assert got is out
    assert np.array_equal(out, want)
    inplace = x.copy()
    for _ in range(2):
        inplace[...] = x
        assert ln.layer_norm(inplace, weight=w, bias=b, out=inplace) is inplace
    assert np.array_equal(inplace, want)


@pytest.mark.parametrize("rows", [4, 2048])
@pytest.mark.parametrize("kwargs", [{}, {"axis": -1}])
def test_out_overlapping_x_gives_the_result_of_a_copy(rows, kwargs):
    # out is x shifted by one row: both contiguous, partially overlapping.
    rng = np.random.default_rng(5)
    buf = random_rows(rng, (rows + 1, 64), "float32")
    x, out = buf[:rows], buf[1:]
    want = ln.layer_norm(x.copy(), **kwargs)
    ln.layer_norm(x.copy(), **kwargs)  # a plan for this shape exists
    got = ln.layer_norm(x, out=out, **kwargs)
    assert got is out
    np.testing.assert_array_equal(out, want)


def test_out_owning_the_memory_x_views_gives_the_result_of_a_copy():
    # out owns its buffer and x is another array object over the same bytes.
    rng = np.random.default_rng(15)
    out = random_rows(rng, (4, 64), "float32")
    x = out.view()
    want = ln.layer_norm(out.copy())
    ln.layer_norm(out.copy())  # a plan for this shape exists
    assert ln.layer_norm(x, out=out) is out
    np.testing.assert_array_equal(out, want)


def test_strided_arrays_after_a_plan_give_correct_results():
    rng = np.random.default_rng(6)
    wide = random_rows(rng, (4, 128), "float32", loc=2.0)
    x = np.ascontiguousarray(wide[:, ::2])
    w_wide = (1 + 0.3 * rng.standard_normal(128)).astype(np.float32)
    w = np.ascontiguousarray(w_wide[::2])
    for _ in range(2):
        planned = ln.layer_norm(x, weight=w)
    strided_x = ln.layer_norm(wide[:, ::2], weight=w)
    strided_w = ln.layer_norm(x, weight=w_wide[::2])
    assert np.array_equal(strided_x, planned)
    assert np.array_equal(strided_w, planned)
    col = np.asfortranarray(x)
    assert np.array_equal(ln.layer_norm(col, weight=w), planned)


def test_read_only_input_and_read_only_out():
    rng = np.random.default_rng(7)
    x = random_rows(rng, (2, 48), "float32")
    want = ln.layer_norm(x)
    frozen = x.copy()
    frozen.flags.writeable = False
    assert np.array_equal(ln.layer_norm(frozen), want)
    out = np.empty_like(x)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out must be a writeable array"):
        ln.layer_norm(x, out=out)
    with pytest.raises(ValueError, match="out must be a writeable array"):
        ln.rms_norm(x, out=out)


@pytest.mark.parametrize("eps", [float("nan"), -1.0, float("inf"), "1e-5", None, True])
def test_bad_eps_after_a_plan_is_still_rejected(eps):
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    ln.layer_norm(x, eps=1e-5)
    with pytest.raises(ValueError, match="eps"):
        ln.layer_norm(x, eps=eps)


def test_eps_of_other_real_types_gives_the_same_result():
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    want = ln.layer_norm(x, eps=0.5)
    assert np.array_equal(ln.layer_norm(x, eps=np.float32(0.5)), want)
    assert np.array_equal(ln.layer_norm(x, eps=np.float64(0.5)), want)
    assert not np.array_equal(ln.layer_norm(x, eps=1e-5), want)


@pytest.mark.parametrize("bad", [4.0, (4.0,), True, (True,), np.float32(4)])
def test_axes_equal_to_a_memoized_valid_value_are_still_validated(bad):
    # 4.0 == 4 and True == 1 as dict keys: the memo must not let them through.
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    ln.layer_norm(x, 4)
    ln.layer_norm(x, (4,))
    ln.rms_norm(x, 4)
    with pytest.raises(TypeError, match="normalized_shape"):
        ln.layer_norm(x, bad)
    with pytest.raises(TypeError, match="normalized_shape"):
        ln.rms_norm(x, bad)


def test_axis_equal_to_a_memoized_valid_value_is_still_validated():
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    ln.layer_norm(x, axis=1)
    with pytest.raises(TypeError, match="axis"):
        ln.layer_norm(x, axis=1.0)


def test_parameters_from_another_library_or_shape_are_rejected_after_a_plan():
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    w = np.ones(4, np.float32)
    ln.layer_norm(x, weight=w)
    with pytest.raises(ValueError, match="weight"):
        ln.layer_norm(x, weight=np.ones(5, np.float32))
    with pytest.raises(TypeError, match="weight"):
        ln.layer_norm(x, weight=[1.0, 1.0, 1.0, 1.0])
    with pytest.raises(TypeError, match="weight"):
        ln.layer_norm(x, weight=np.ones(4, np.int32))


def test_a_planned_call_runs_the_compiled_entry_point():
    """After its first call a plan skips Numba's type resolution (the point of the path)."""
    from layernorm._backends._numba import kernels

    x = np.linspace(-1, 1, 3 * 40, dtype=np.float32).reshape(3, 40)
    ln.layer_norm(x)
    ln.layer_norm(x)
    plan = _fast._PLANS[(x.shape, x.dtype, None, None, None, None, None, None)]
    assert plan is not None and plan.direct
    assert callable(plan.run) and plan.run is not kernels.ln_forward_serial


def test_a_full_memo_starts_over_instead_of_refusing_new_shapes(monkeypatch):
    """Many distinct shapes (varying sequence lengths) must not end the short path."""
    from layernorm import _engine

    monkeypatch.setattr(_fast, "_PLANS", {})
    monkeypatch.setattr(_plans, "PLANS_MAX", 4)
    monkeypatch.setattr(_engine, "_REQUESTS", {})
    monkeypatch.setattr(_engine, "_REQUESTS_MAX", 4)
    for rows in range(1, 12):
        x = np.linspace(-1, 1, rows * 8, dtype=np.float32).reshape(rows, 8)
        ln.layer_norm(x)
        key = (x.shape, x.dtype, None, None, None, None, None, None)
        assert _fast._PLANS[key] is not None
        assert len(_fast._PLANS) <= 4 and _engine.cached_requests() <= 4


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("streaming", [False, True])
def test_large_inputs_take_the_short_path_with_the_backends_choice(monkeypatch, rms, streaming):
    """Large planned calls run the backend's serial/parallel and streaming-store choice."""
    from layernorm._backends import _numba

    if streaming:  # make a 1 MiB output "large" so that the streaming stores are used
        monkeypatch.setattr(_numba, "STREAM_MIN_FRACTION", 0.0)
        monkeypatch.setattr(_numba, "STREAM_MIN_ROW", 1)
    monkeypatch.setattr(_fast, "_PLANS", {})  # plans made under these thresholds
    rng = np.random.default_rng(5)
    x = random_rows(rng, (64, _fast.SERIAL_MAX_ELEMENTS // 16), "float32", loc=2.0)
    w = (1.0 + 0.5 * rng.standard_normal(x.shape[1])).astype(np.float32)
    b = (0.1 * rng.standard_normal(x.shape[1])).astype(np.float32)
    call = (lambda **kw: ln.rms_norm(x, None, w, **kw)) if rms else \
        (lambda **kw: ln.layer_norm(x, None, w, b, **kw))
    out = np.full_like(x, np.nan)
    call(return_stats=True)
    key = (x.shape, x.dtype, None, None, w.shape, w.dtype) if rms else \
        (x.shape, x.dtype, None, None, w.shape, w.dtype, b.shape, b.dtype)
    plan = _fast._PLANS[key]
    assert plan is not None and plan.large
    assert plan.streams == streaming == _numba.use_streaming_stores(x, out)
    ran = []  # which of the plan's runners each call takes

    def spy(runner, streamed):
        def run(*args):
            ran.append(streamed)
            return runner(*args)
        return run

    monkeypatch.setattr(plan, "run", spy(plan.run, False))
    monkeypatch.setattr(plan, "run_streamed", spy(plan.run_streamed, True))
    for _ in range(2):
        fast = call(return_stats=True)
        into = call(out=out)
    assert ran == [streaming] * 4
    in_place = x.copy()
    call_in_place = (lambda: ln.rms_norm(in_place, None, w, out=in_place)) if rms else \
        (lambda: ln.layer_norm(in_place, None, w, b, out=in_place))
    call_in_place()
    assert ran[-1] is False  # in place: the lines are cached already
    general = call(return_stats=True, backend="numba")
    for got, want in zip(fast, general, strict=True):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert into is out and np.array_equal(out.view(np.uint8), general[0].view(np.uint8))


@pytest.mark.parametrize("parallel", [False, True])
def test_large_planned_calls_look_up_each_kernel_once(monkeypatch, parallel):
    """The plan's runner resolves the compiled entry point of the variant it runs once,
    then calls it directly (the lookup costs a tenth of a cache-resident call)."""
    numba = pytest.importorskip("numba")
    from layernorm._backends import _numba
    from layernorm._backends._numba import entry as kernel_entry

    if parallel and numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread: every call runs serially")
    policy = "always" if parallel else "never"
    monkeypatch.setattr(_numba.chooser, "policy", policy)
    lookups = []
    real = kernel_entry.entry_point

    def spy(kernel, writes, args):
        lookups.append(kernel)
        return real(kernel, writes, args)

    monkeypatch.setattr(kernel_entry, "entry_point", spy)
    monkeypatch.setattr(_fast, "_PLANS", {})
    rng = np.random.default_rng(15)
    x = random_rows(rng, (_fast.SERIAL_MAX_ELEMENTS // 96 + 1, 96), "float32", loc=-1.0)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(2 if parallel else 1)
        got = [ln.layer_norm(x) for _ in range(4)]
    finally:
        numba.set_num_threads(threads)
    plan = _fast._PLANS[(x.shape, x.dtype, None, None, None, None, None, None)]
    assert isinstance(plan.run, _numba.PlannedRows)
    # The first call plans and runs through the plan: one lookup in four calls.
    assert len(lookups) == 1
    want = ln.layer_norm(x, backend="numba")
    for y in got:
        np.testing.assert_array_equal(y, want)


def _unaligned(arr):
    """A copy of ``arr`` whose data starts one byte past an allocation's start: C-contiguous
    but not aligned for its dtype."""
    buffer = np.empty(arr.nbytes + 1, np.uint8)
    view = buffer[1:].view(arr.dtype).reshape(arr.shape)
    view[...] = arr
    assert view.flags.c_contiguous and not view.flags.aligned
    return view


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("which", ["x", "weight", "out"])
def test_unaligned_arrays_after_a_plan_take_the_general_path(rms, which):
    # The planned entry points were compiled for aligned arrays: an unaligned one must not
    # reach them, and the general path gives the same bits.
    rng = np.random.default_rng(11)
    x = random_rows(rng, (3, 40), "float32", loc=1.5)
    w = (1 + 0.25 * rng.standard_normal(40)).astype(np.float32)
    norm = ln.rms_norm if rms else ln.layer_norm
    for _ in range(2):
        want = norm(x, weight=w)
    args = {"x": x, "weight": w, "out": np.empty_like(x)}
    args[which] = _unaligned(args[which])
    if rms:
        short = _fast.rms_norm(args["x"], None, args["weight"], None, None, False,
                               args["out"])
    else:
        short = _fast.layer_norm(args["x"], None, args["weight"], None, 1e-5, None, False,
                                 args["out"])
    assert short is None
    got = norm(args["x"], weight=args["weight"], out=args["out"])
    assert got is args["out"]
    np.testing.assert_array_equal(got, want)


def test_unaligned_input_after_a_plan_of_a_quantized_call_takes_the_general_path():
    rng = np.random.default_rng(12)
    x = random_rows(rng, (3, 40), "float32", loc=-0.5)
    for _ in range(2):
        want_q, want_scale = ln.layer_norm(x, quantize="int8")
    x_unaligned = _unaligned(x)
    assert _fast.quantized(x_unaligned, None, None, None, 1e-5, None, False, None, "int8",
                           None, False) is None
    q, scale = ln.layer_norm(x_unaligned, quantize="int8")
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(scale, want_scale)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("owner", ["out", "buffer"])
def test_a_parameter_viewing_out_gives_the_result_of_a_copy(rms, owner):
    # The weight (or bias) is row 0 of out's memory: writing row 0 would change the
    # parameter row 1 reads, unless the short path sees the overlap. ``out`` owns its
    # memory, or both are views of another buffer.
    rng = np.random.default_rng(16)
    x = random_rows(rng, (2, 64), "float32", loc=1.0)
    norm = ln.rms_norm if rms else ln.layer_norm
    for name in ("weight",) if rms else ("weight", "bias"):
        params = {"weight": (1 + 0.5 * rng.standard_normal(64)).astype(np.float32)}
        if not rms:
            params["bias"] = (0.5 * rng.standard_normal(64)).astype(np.float32)
        want = norm(x, **params)
        norm(x, **params)  # a plan for these shapes exists
        out = np.empty((2, 64), np.float32)
        if owner == "buffer":
            out = np.empty(2 * 64 + 16, np.float32)[16:].reshape(2, 64)
        out[0] = params[name]
        params[name] = out[0]
        assert norm(x, out=out, **params) is out
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("rms", [False, True])
def test_calls_of_one_shape_and_several_dtypes_each_get_their_own_plan(rms):
    """Plans are found by shapes and checked by dtype identity: alternating dtypes of
    one shape, and a dtype equal to float32 but another object, give each its own
    result, bitwise the general path's."""
    rng = np.random.default_rng(17)
    base = random_rows(rng, (8, 96), "float64", loc=2.0)
    w64 = 1 + 0.5 * rng.standard_normal(96)
    native = np.dtype(np.float32).newbyteorder("=")  # equal to float32, not the same object
    cases = [(base.astype(np.float32), w64.astype(np.float32)), (base, w64),
             (base.astype(native), w64.astype(np.float32)), (base, w64.astype(np.float32)),
             (base.astype(np.float32), w64)]
    norm = ln.rms_norm if rms else ln.layer_norm
    for _ in range(3):
        for x, w in cases:
            got = norm(x, weight=w)
            want = norm(x, weight=w, backend="numba")
            assert got.dtype == x.dtype
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("scale", [np.float32(0.0625), np.float64(0.03), np.float16(0.03),
                                   np.array(0.03, np.float32), np.full((1, 1), 0.03),
                                   np.linspace(0.01, 0.2, 5, dtype=np.float32).reshape(5, 1)],
                         ids=["float32", "float64", "float16", "0-d array", "(1, 1) array",
                              "per row"])
@pytest.mark.parametrize("rms", [False, True])
def test_numpy_scalar_scales_take_the_short_path(monkeypatch, scale, rms):
    """A static NumPy scalar, one-element or per-row array scale runs the short path's kernel
    (the general path is not reached), gives the general path's codes and stats bit for
    bit, and comes back as passed."""
    from layernorm import _engine

    rng = np.random.default_rng(14)
    x = random_rows(rng, (5, 96), "float32", loc=0.5, scale=2.0)
    w = (1 + 0.3 * rng.standard_normal(96)).astype(np.float32)
    b = (0.2 * rng.standard_normal(96)).astype(np.float32)
    params = {"weight": w} if rms else {"weight": w, "bias": b}
    norm = ln.rms_norm if rms else ln.layer_norm
    want = norm(x, quantize="int8", scale=scale, return_stats=True, backend="numba", **params)
    if scale.size == 1:
        as_float = norm(x, quantize="int8", scale=np.asarray(scale).item(), backend="numba",
                        **params)
        np.testing.assert_array_equal(want[0], as_float[0])
    assert np.abs(want[0].astype(np.int32)).max() > 8  # codes that a wrong scale moves

    def general(*args, **kwargs):
        pytest.fail("a NumPy scalar scale reached the general path")

    monkeypatch.setattr(_engine, "normalize_ex", general)
    for _ in range(2):  # the plan's first call, then a call that finds it
        got = norm(x, quantize="int8", scale=scale, return_stats=True, **params)
    assert got[1] is scale
    np.testing.assert_array_equal(got[0], want[0])
    for g, wv in zip(got[2:], want[2:], strict=True):
        np.testing.assert_array_equal(g, wv)


@pytest.mark.parametrize("offset", [1.0, 1], ids=["1.0", "int 1"])
@pytest.mark.parametrize(("x_dtype", "w_dtype", "quantize"),
                         [("float32", "float32", None), ("bfloat16", "bfloat16", None),
                          ("float64", "float16", None), ("float32", "float32", "int8"),
                          ("float32", "float16", "int8")])
@pytest.mark.parametrize("rms", [False, True])
def test_offset_gains_take_the_short_path(monkeypatch, offset, x_dtype, w_dtype, quantize,
                                          rms):
    """``weight_offset`` runs the short path (the general path is not reached) with the
    gain formed as the general path forms it: the same bits. Quantized: float32 x (the
    quantized short path's)."""
    from layernorm import _engine

    rng = np.random.default_rng(15)
    x = random_rows(rng, (6, 96), x_dtype, loc=0.5, scale=2.0)
    w = (0.1 * rng.standard_normal(96)).astype(DTYPES[w_dtype])
    # (the quantized short path takes float32 parameters: a float16 weight's gain is one)
    b = (0.2 * rng.standard_normal(96)).astype(DTYPES["float32" if quantize else w_dtype])
    params = {"weight": w} if rms else {"weight": w, "bias": b}
    norm = ln.rms_norm if rms else ln.layer_norm
    kwargs = {"weight_offset": offset, "return_stats": True, "quantize": quantize}
    want = norm(x, backend="numba", **kwargs, **params)
    unshifted = norm(x, return_stats=True, quantize=quantize, **params)
    assert not np.array_equal(want[0], unshifted[0])

    def general(*args, **kw):
        pytest.fail("an offset gain reached the general path")

    monkeypatch.setattr(_engine, "normalize_ex", general)
    for _ in range(2):  # the plan's first call, then a call that finds it
        got = norm(x, **kwargs, **params)
    for g, wv in zip(got, want, strict=True):
        assert g.dtype == wv.dtype
        np.testing.assert_array_equal(g.view(np.uint8), wv.view(np.uint8))


def test_offset_without_a_weight_is_still_an_error():
    x = random_rows(np.random.default_rng(16), (2, 8), "float32")
    for norm in (ln.layer_norm, ln.rms_norm):
        with pytest.raises(ValueError, match="needs a weight"):
            norm(x, weight_offset=1.0)
