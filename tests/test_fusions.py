"""Transformer-block fusions: add_layer_norm/add_rms_norm, weight_offset, grad_residual and
quantized outputs (API.md, "Transformer-block fusions").

Expected values are computed here, independently: float64 references, conversions done
with NumPy/ml_dtypes in the test, and the unfused composition of the public functions
the contract defines the fused ones by ("bit for bit what ``layer_norm(h)`` gives").
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import layernorm as ln

from .conftest import optional

DT = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64, 1: np.uint8}
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(BITS[a.dtype.itemsize])


def assert_bitwise(a, b):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape
    np.testing.assert_array_equal(bits(a), bits(b))


def acc_of(name):
    return np.float64 if name == "float64" else np.float32


def ref_layer_norm(x, w=None, b=None, eps=1e-5):
    x = np.asarray(x, np.float64)
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    y = (x - m) / np.sqrt(v + eps)
    if w is not None:
        y = y * np.asarray(w, np.float64)
    if b is not None:
        y = y + np.asarray(b, np.float64)
    return y


def ref_rms_norm(x, w=None, eps=1e-6):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * np.asarray(w, np.float64)


def data(shape, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale).astype(DT[dtype])


# --------------------------------------------------------------------------- residual add


@settings(max_examples=30, deadline=None)
@given(
    xd=st.sampled_from(list(DT)),
    rd=st.sampled_from(list(DT)),
    hd=st.sampled_from([None, *DT]),
    rows=st.integers(0, 5),
    n=st.integers(1, 40),
    rms=st.booleans(),
    offset=st.sampled_from([0.0, 1.0, -0.5]),
    seed=st.integers(0, 2**16),
)
def test_add_is_bitwise_the_unfused_composition(xd, rd, hd, rows, n, rms, offset, seed):
    x = data((rows, n), xd, seed, 3.0)
    r = data((rows, n), rd, seed + 1, 3.0)
    w = data((n,), "bfloat16", seed + 2)
    b = data((n,), "float32", seed + 3)
    hname = hd or rd
    add = np.float64 if "float64" in (xd, rd, hname) else np.float32
    h_ref = (x.astype(add) + r.astype(add)).astype(DT[hname])
    if rms:
        y, h, rstd = ln.add_rms_norm(x, r, n, w, weight_offset=offset, residual_dtype=hd,
                                     return_stats=True)
        y_ref, rstd_ref = ln.rms_norm(h_ref, n, w, weight_offset=offset, return_stats=True)
        stats, stats_ref = (rstd,), (rstd_ref,)
    else:
        y, h, mean, rstd = ln.add_layer_norm(x, r, n, w, b, weight_offset=offset,
                                             residual_dtype=hd, return_stats=True)
        y_ref, mean_ref, rstd_ref = ln.layer_norm(h_ref, n, w, b, weight_offset=offset,
                                                  return_stats=True)
        stats, stats_ref = (mean, rstd), (mean_ref, rstd_ref)
    assert_bitwise(h, h_ref)
    assert_bitwise(y, y_ref.astype(DT[xd]))
    for s, s_ref in zip(stats, stats_ref, strict=True):
        assert_bitwise(s, s_ref)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", list(DT))
def test_add_against_float64_reference(dtype, rms):
    x, r = data((6, 64), dtype, 0), data((6, 64), dtype, 1)
    w, b = data((64,), "float32", 2), data((64,), "float32", 3)
    h64 = x.astype(np.float64) + r.astype(np.float64)
    if rms:
        y, h = ln.add_rms_norm(x, r, 64, w, eps=1e-6, weight_offset=0.25)
        ref = ref_rms_norm(h.astype(np.float64), w.astype(np.float64) + 0.25)
    else:
        y, h = ln.add_layer_norm(x, r, 64, w, b, weight_offset=0.25)
        ref = ref_layer_norm(h.astype(np.float64), w.astype(np.float64) + 0.25, b)
    tol = {"float16": 2e-2, "bfloat16": 1.5e-1, "float32": 1e-4, "float64": 1e-10}[dtype]
    np.testing.assert_allclose(h.astype(np.float64), h64, rtol=tol, atol=tol)
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=tol, atol=tol)


def test_residual_dtype_keeps_a_float32_stream():
    x = data((3, 16), "bfloat16", 0)
    r = data((3, 16), "bfloat16", 1)
    y, h = ln.add_layer_norm(x, r, residual_dtype="float32")
    assert h.dtype == np.float32 and y.dtype == DT["bfloat16"]
    # bfloat16 + bfloat16 is exact in float32 here (same exponent range, 8-bit mantissas)
    np.testing.assert_array_equal(h, x.astype(np.float32) + r.astype(np.float32))
    _y2, h2 = ln.add_layer_norm(x, r, residual_dtype=np.float64)
    assert h2.dtype == np.float64


@pytest.mark.parametrize("xd", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", ["out=x", "out=residual", "residual_out=residual",
                                  "residual_out=x", "out=x,residual_out=residual",
                                  "out=residual,residual_out=x"])
def test_in_place(case, xd):
    x0 = data((5, 24), xd, 0)
    r0 = data((5, 24), xd if "out=residual" in case else "float32", 1)
    w = data((24,), "float32", 2)
    y_ref, h_ref = ln.add_layer_norm(x0, r0, 24, w, residual_dtype=xd if "residual_out=x"
                                     in case else None)
    x, r = x0.copy(), r0.copy()
    kwargs = {}
    for part in case.split(","):
        name, target = part.split("=")
        kwargs[name] = x if target == "x" else r
    if "residual_out" in kwargs:
        kwargs["residual_dtype"] = kwargs["residual_out"].dtype
    y, h = ln.add_layer_norm(x, r, 24, w, **kwargs)
    if "out" in kwargs:
        assert y is kwargs["out"]
    if "residual_out" in kwargs:
        assert h is kwargs["residual_out"]
    assert_bitwise(h, h_ref)
    assert_bitwise(y, y_ref)


SPLIT_BUFFERS = {  # x and the residual as parts of one buffer that share no element
    "row halves": (lambda buf: (buf[:, :16], buf[:, 16:])),
    "even and odd rows": (lambda buf: (buf[0::2, :16], buf[1::2, :16])),
}


@pytest.mark.parametrize("split", list(SPLIT_BUFFERS))
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("add", [ln.add_layer_norm, ln.add_rms_norm])
def test_in_place_on_parts_of_one_buffer(add, swap, split):
    """y and h into x and the residual where both are parts of one buffer with no element
    in common (their bounds overlap): the one-pass kernel, the same bits as separate
    arrays, never refused as sharing memory."""
    buf = data((8, 32), "float32", 5)
    x, r = SPLIT_BUFFERS[split](buf)
    w = data((16,), "float32", 6)
    y_ref, h_ref = add(x.copy(), r.copy(), weight=w)
    out, residual_out = (r, x) if swap else (x, r)
    with fused_calls() as calls:
        y, h = add(x, r, weight=w, out=out, residual_out=residual_out)
    assert calls  # the one-pass kernel, not the composition
    assert y is out and h is residual_out
    assert_bitwise(y, y_ref)
    assert_bitwise(h, h_ref)
    x, r = SPLIT_BUFFERS[split](buf)  # the buffer holds them
    assert_bitwise(r if swap else x, y_ref)
    assert_bitwise(x if swap else r, h_ref)


def test_outputs_with_an_element_in_common_are_refused():
    """Outputs whose elements overlap in part stay a ValueError: y and h need their own."""
    x, r = data((4, 16), "float32", 0), data((4, 16), "float32", 1)
    buf = data((4, 32), "float32", 2)
    for out, residual_out in ((buf[:, :16], buf[:, 8:24]), (buf[:, 8:24], buf[:, :16]),
                              (buf[:, ::2], buf[:, :16])):
        with pytest.raises(ValueError, match="out and residual_out share memory"):
            ln.add_layer_norm(x, r, out=out, residual_out=residual_out)
    assert_bitwise(x, data((4, 16), "float32", 0))  # nothing written


def test_in_place_rms_strided_out():
    x = data((4, 32), "float32", 0)
    r = data((4, 32), "float32", 1)
    y_ref, h_ref = ln.add_rms_norm(x, r)
    out = np.empty((4, 64), np.float32)[:, ::2]
    y, h = ln.add_rms_norm(x, r, out=out, residual_out=r)
    assert y is out and h is r
    assert_bitwise(np.ascontiguousarray(y), y_ref)
    assert_bitwise(h, h_ref)


def test_add_with_axis():
    x = data((2, 3, 4, 5), "float32", 0)
    r = data((2, 3, 4, 5), "float64", 1)
    y, h = ln.add_layer_norm(x, r, axis=1)
    assert h.dtype == np.float64
    assert_bitwise(y, ln.layer_norm(x.astype(np.float64) + r, axis=1).astype(np.float32))


# --------------------------------------------------------------------------- one-pass kernel
# On the Numba backend, rows of unit stride go through one kernel that adds and normalizes
# block by block (_backends/_numba/fused.py); these tests check it gives the composition's
# bits wherever it is taken, and that it is taken where the contract allows.


@contextlib.contextmanager
def fused_calls(stream=None):
    """Counts the Numba backend's one-pass calls (a list of their names), by the general
    path or the short path; ``stream`` forces streaming stores for y on or off (the
    choice only moves bits around)."""
    from layernorm import _fast_add
    from layernorm._backends import _numba as backend

    calls = []
    real_short = _fast_add.add_norm

    def short_spy(*args):
        result = real_short(*args)
        if result is not None:  # the short path's call of the same kernels
            calls.append("add_rms_norm_forward" if args[-1] else "add_layer_norm_forward")
        return result

    with pytest.MonkeyPatch.context() as mp:
        for name in ("add_layer_norm_forward", "add_rms_norm_forward"):
            real = getattr(backend, name)

            def spy(*args, _real=real, _name=name):
                calls.append(_name)
                return _real(*args)

            mp.setattr(backend, name, spy)
        mp.setattr(_fast_add, "add_norm", short_spy)
        if stream is not None:
            mp.setattr(backend, "fused_add_streams", lambda x, res, y: stream)
            # the short path's plans ask the size test once, when they are made
            mp.setattr(backend, "streams_by_size", lambda n, nbytes: stream)
            mp.setattr(_fast_add, "_PLANS", {})
        yield calls


@contextlib.contextmanager
def quantized_calls(strict=False):
    """Counts the Numba backend's quantizing one-pass calls (their formats), by the
    general path or the short path; ``strict``: a quantization the engine composes
    instead raises."""
    from layernorm import _engine, _fast
    from layernorm._backends import _numba as backend

    calls = []
    real = backend.quantized_forward
    real_short = _fast.run_quantized

    def spy(*args):
        calls.append(args[9])
        return real(*args)

    def short_spy(*args):
        # The short paths' runner (layer_norm/rms_norm and the add_ functions) of the
        # same kernels; its codes array (argument 4) has the format's dtype.
        result = real_short(*args)
        if result is not None:
            calls.append(args[4].dtype.name)
        return result

    def composed(*args, **kwargs):
        raise AssertionError("quantized by the composition, not the kernel")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "quantized_forward", spy)
        mp.setattr(_fast, "run_quantized", short_spy)
        if strict:
            mp.setattr(_engine, "quantize_rows", composed)
        yield calls


def unfused(x, r, hname, rms, **kwargs):
    """(y, h, stats) of the composition the contract defines, computed in the test."""
    add = np.float64 if "float64" in (x.dtype.name, r.dtype.name, hname) else np.float32
    h = (x.astype(add) + r.astype(add)).astype(DT[hname])
    if rms:
        kwargs.pop("bias", None)
        y, *stats = ln.rms_norm(h, return_stats=True, **kwargs)
    else:
        y, *stats = ln.layer_norm(h, return_stats=True, **kwargs)
    return y.astype(x.dtype), h, stats


def fusable(xd, rd, hd):
    acc = "float64" if xd == "float64" else "float32"
    return acc_of(rd) == acc_of(hd) == acc_of(xd) and hd in (xd, acc)


FUSED_DTYPES = [("float32", "float32", None), ("bfloat16", "float32", None),
                ("bfloat16", "bfloat16", "float32"), ("float16", "float16", None),
                ("float64", "float64", None)]


@settings(max_examples=40, deadline=None)
@given(
    dtypes=st.sampled_from(FUSED_DTYPES),
    rows=st.integers(1, 70),
    n=st.sampled_from([1, 15, 16, 17, 100, 128, 129, 300, 1024, 1100, 2050, 3100]),
    rms=st.booleans(),
    params=st.sampled_from(["none", "weight", "both", "offset"]),
    stream=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_pass_kernel_is_bitwise_the_composition(dtypes, rows, n, rms, params, stream,
                                                    seed):
    # Rows of up to 2050 elements across block boundaries (BLOCK_ELEMENTS // n rows per
    # block), short rows (<= 128) and long ones, vector tails, streaming stores or not;
    # 2050: the rows written whole before the next is read (SEQUENTIAL_MIN_ROW); 3100,
    # and float64 rows of 2050: column tiles over groups of rows (TILED_MIN_BYTES).
    xd, rd, hd = dtypes
    x = data((rows, n), xd, seed, 3.0)
    r = data((rows, n), rd, seed + 1, 3.0)
    kwargs = {}
    if params != "none":
        kwargs["weight"] = data((n,), xd, seed + 2)
    if params in ("both", "offset"):
        kwargs["bias"] = data((n,), "float32", seed + 3)
    if params == "offset":
        kwargs["weight_offset"] = 1.0
    y_ref, h_ref, stats_ref = unfused(x, r, hd or rd, rms, **kwargs)
    fn = ln.add_rms_norm if rms else ln.add_layer_norm
    if rms:
        kwargs.pop("bias", None)
    with fused_calls(stream) as calls:
        y, h, *stats = fn(x, r, residual_dtype=hd, return_stats=True, **kwargs)
    assert len(calls) == 1
    assert_bitwise(h, h_ref)
    assert_bitwise(y, y_ref)
    for s, s_ref in zip(stats, stats_ref, strict=True):
        assert_bitwise(s, s_ref)


@pytest.mark.parametrize("xd", list(DT))
@pytest.mark.parametrize("rd", list(DT))
@pytest.mark.parametrize("hd", [None, *DT])
def test_one_pass_kernel_takes_the_dtypes_it_can(xd, rd, hd):
    # y is norm(h) rounded to h's dtype and then to x's: one kernel rounding once to x's
    # dtype agrees only when h has x's dtype or the accumulation dtype; the add needs one
    # accumulation dtype for all three.
    x, r = data((3, 20), xd, 0), data((3, 20), rd, 1)
    with fused_calls() as calls:
        y, h = ln.add_layer_norm(x, r, residual_dtype=hd)
    assert bool(calls) == fusable(xd, rd, hd or rd)
    y_ref, h_ref, _ = unfused(x, r, hd or rd, False)
    assert_bitwise(h, h_ref)
    assert_bitwise(y, y_ref)


@pytest.mark.parametrize("rms", [False, True])
def test_one_pass_kernel_serial_and_parallel_agree(rms):
    numba = pytest.importorskip("numba")
    x = data((300, 1024), "float32", 0)  # above PARALLEL_MIN_ELEMENTS
    r = data((300, 1024), "float32", 1)
    w = data((1024,), "float32", 2)
    fn = ln.add_rms_norm if rms else ln.add_layer_norm
    y_ref, h_ref, _ = unfused(x, r, "float32", rms, weight=w)
    threads = numba.get_num_threads()
    got = []
    try:
        for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(t)
            with fused_calls() as calls:
                got.append(fn(x, r, weight=w))
            assert calls
    finally:
        numba.set_num_threads(threads)
    for y, h in got:
        assert_bitwise(h, h_ref)
        assert_bitwise(y, y_ref)


ALIASES = ["out=x", "out=residual", "residual_out=x", "residual_out=residual",
           "out=x,residual_out=residual", "out=residual,residual_out=x"]


@pytest.mark.parametrize("n", [200, 1100, 2050, 3100])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("case", ALIASES)
def test_one_pass_kernel_in_place(case, rms, stream, n):
    # Rows of 1100 in several blocks (streaming stores peel to an aligned address, then
    # a vector body and a tail), rows of 200 (the next row's first pass overlaps this
    # row's output), of 2050 (each row written whole first) and of 3100 (column tiles
    # over groups of rows), every output either x or residual itself.
    x0, r0 = data((40, n), "float32", 0), data((40, n), "float32", 1)
    w = data((n,), "float32", 2)
    y_ref, h_ref, _ = unfused(x0, r0, "float32", rms, weight=w)
    x, r = x0.copy(), r0.copy()
    kwargs = {}
    for part in case.split(","):
        name, target = part.split("=")
        kwargs[name] = x if target == "x" else r
    fn = ln.add_rms_norm if rms else ln.add_layer_norm
    with fused_calls(stream) as calls:
        y, h = fn(x, r, weight=w, **kwargs)
    assert calls
    for name, arr in (("out", y), ("residual_out", h)):
        if name in kwargs:
            assert arr is kwargs[name]
    assert_bitwise(h, h_ref)
    assert_bitwise(y, y_ref)


def test_streaming_stores_are_chosen_for_large_outputs_of_long_enough_rows(monkeypatch):
    # The plain forward and the fused kernels stream y from rows of STREAM_MIN_ROW on,
    # for outputs large against the last-level cache; never when y is in the cache
    # already (in place of x or the residual).
    from layernorm._backends import _numba as backend

    monkeypatch.setattr(backend, "STREAM_MIN_FRACTION", 0.0)  # any size is "large"
    rows = 8

    def arrays(n):
        return (np.empty((rows, n), np.float32), np.empty((rows, n), np.float32),
                np.empty((rows, n), np.float32))

    n = backend.STREAM_MIN_ROW
    assert backend.load_kernels().SHORT_ROW_MAX < n  # the short-row path has no streaming kernel
    x, r, y = arrays(n)
    assert backend.use_streaming_stores(x, y) and backend.fused_add_streams(x, r, y)
    assert not backend.use_streaming_stores(x, x)
    assert not backend.fused_add_streams(x, r, x) and not backend.fused_add_streams(x, r, r)
    x1, r1, y1 = arrays(n - 1)
    assert not backend.use_streaming_stores(x1, y1)
    assert not backend.fused_add_streams(x1, r1, y1)
    monkeypatch.setattr(backend, "STREAM_MIN_FRACTION", 0.5)  # 8 KiB: stays in cache
    assert not backend.use_streaming_stores(x, y) and not backend.fused_add_streams(x, r, y)
    with backend.streaming_stores_everywhere():
        assert backend.fused_add_streams(*arrays(3))


def test_forward_streams_long_rows_from_a_smaller_output(monkeypatch):
    # Rows of at least LONG_ROW_STREAM_MIN_ROW stream y from LONG_ROW_STREAM_MIN_FRACTION
    # of the last-level cache on, plain and fused; shorter rows from STREAM_MIN_FRACTION
    # on. A 1 MiB cache stands for the machine's.
    from layernorm._backends import _numba as backend

    monkeypatch.setattr(backend, "_last_level_cache_bytes", lambda: 1 << 20)
    long_n = backend.LONG_ROW_STREAM_MIN_ROW
    assert backend.STREAM_MIN_ROW < long_n

    def arrays(nbytes, n):
        shape = (max(1, nbytes // (4 * n)), n)
        return (np.empty(shape, np.float32), np.empty(shape, np.float32),
                np.empty(shape, np.float32))

    small = int(backend.LONG_ROW_STREAM_MIN_FRACTION * (1 << 20)) + (8 << 10)
    big = int(backend.STREAM_MIN_FRACTION * (1 << 20)) + (8 << 10)
    x, r, y = arrays(small, long_n)
    assert backend.use_streaming_stores(x, y) and backend.fused_add_streams(x, r, y)
    assert not backend.use_streaming_stores(x, x)  # in place: y is cached already
    assert not backend.fused_add_streams(x, r, r)
    x, r, y = arrays(small, long_n - 1)
    assert not backend.use_streaming_stores(x, y) and not backend.fused_add_streams(x, r, y)
    x, r, y = arrays(small // 2, long_n)
    assert not backend.use_streaming_stores(x, y) and not backend.fused_add_streams(x, r, y)
    x, r, y = arrays(big, backend.STREAM_MIN_ROW)
    assert backend.use_streaming_stores(x, y) and backend.fused_add_streams(x, r, y)
    x, r, y = arrays(big, long_n)
    assert backend.use_streaming_stores(x, y) and backend.fused_add_streams(x, r, y)


def test_one_pass_kernel_in_place_on_views():
    # Rows of a larger array (a row stride that is not n) and out= the same view of x.
    base_x, base_r = data((12, 64), "bfloat16", 0), data((12, 64), "float32", 1)
    x, r = base_x[::2, 8:40], base_r[1::2, :32]
    y_ref, h_ref, _ = unfused(x, r, "float32", False)
    with fused_calls() as calls:
        y, h = ln.add_layer_norm(x, r, out=base_x[::2, 8:40], residual_out=r)
    assert calls
    assert_bitwise(h, h_ref)
    assert_bitwise(y, y_ref)
    assert_bitwise(base_x[::2, 8:40], y_ref)


@pytest.mark.parametrize("make", ["overlapping residual_out", "strided out", "columns",
                                  "float64 stream", "float64 quantize"])
def test_other_calls_compose(make):
    # Calls the kernel does not take give the composition's result all the same.
    x, r = data((6, 16), "float32", 0), data((6, 16), "float32", 1)
    h_ref = x.astype(np.float64) + r if make.startswith("float64") else x + r
    kwargs = {}
    if make == "overlapping residual_out":  # rows 1..6 of the buffer the residual is 0..5 of
        buf = np.empty((7, 16), np.float32)
        buf[:6] = r
        r, kwargs["residual_out"] = buf[:6], buf[1:]
    elif make == "strided out":
        kwargs["out"] = np.empty((6, 32), np.float32)[:, ::2]
    elif make == "columns":
        kwargs["axis"] = 0
    elif make == "float64 stream":
        kwargs["residual_dtype"] = "float64"
    elif make == "float64 quantize":
        kwargs["quantize"] = "int8"
        kwargs["residual_dtype"] = "float64"
    with fused_calls() as calls, quantized_calls() as qcalls:
        got = ln.add_layer_norm(x, r, **kwargs)
    assert not calls and not qcalls
    if make == "columns":
        y_ref = ln.layer_norm(h_ref, axis=0)
    elif make == "float64 quantize":
        y_ref = qref(ln.layer_norm(h_ref), "int8")[0]
    else:
        y_ref = ln.layer_norm(h_ref).astype(np.float32)
    assert_bitwise(got[1], h_ref)
    assert_bitwise(got[0], y_ref)


@pytest.mark.parametrize("rms, param", [(False, "weight"), (False, "bias"), (True, "weight")])
def test_residual_out_over_a_parameter(rms, param):
    # A weight or bias that lives in the memory residual_out receives h is read before h
    # overwrites it: y is that of the parameter as passed (as out= over a parameter is).
    x, r = data((4, 16), "float32", 0), data((4, 16), "float32", 1)
    w, b = data((16,), "float32", 2), data((16,), "float32", 3)
    y_ref, h_ref, _ = unfused(x, r, "float32", rms, weight=w, bias=b)
    buf = np.zeros((4, 16), np.float32)
    buf[3] = w if param == "weight" else b
    kwargs = {"weight": buf[3] if param == "weight" else w}
    if not rms:
        kwargs["bias"] = buf[3] if param == "bias" else b
    fn = ln.add_rms_norm if rms else ln.add_layer_norm
    y, h = fn(x, r, residual_out=buf, **kwargs)
    assert h is buf
    assert_bitwise(h, h_ref)
    assert_bitwise(y, y_ref)


#: Rows the fast arithmetic cannot compute (rescale.py): (factor of the rows, call
#: arguments). Squares that overflow float32, or (with eps = 0) underflow it.
OUT_OF_RANGE = {"overflow": (np.float32(1e19), {}),
                "underflow": (np.float32(1e-25), {"eps": 0.0})}


@pytest.mark.parametrize("magnitude", sorted(OUT_OF_RANGE))
@pytest.mark.parametrize("shape", [(4, 300), (6, 200), (37, 64), (3000, 48)])
def test_one_pass_kernel_rows_whose_squares_overflow(shape, magnitude):
    # A finite float32 row with a spread near 1e19 (or near 1e-25, with eps = 0) is
    # normalized after an exact rescaling (rescale.py): the one-pass kernel stops before
    # it (h of its block is written), and the driver normalizes the rest of the block
    # from h. The same bits fused or not, for long rows, short rows and enough rows for
    # the parallel kernels, in place too.
    factor, kwargs = OUT_OF_RANGE[magnitude]
    x = data(shape, "float32", 0)
    r = data(shape, "float32", 1)
    x[1::3] *= factor  # such rows of h among ordinary ones, in every block
    r[1::3] *= factor
    for rms in (False, True):
        y_ref, h_ref, stats_ref = unfused(x, r, "float32", rms, **kwargs)
        fn = ln.add_rms_norm if rms else ln.add_layer_norm
        with fused_calls() as calls:
            y, h, *stats = fn(x, r, return_stats=True, **kwargs)
        assert calls and np.isfinite(y).all()
        assert_bitwise(h, h_ref)
        assert_bitwise(y, y_ref)
        for s, s_ref in zip(stats, stats_ref, strict=True):
            assert_bitwise(s, s_ref)
        xi, ri = x.copy(), r.copy()
        with fused_calls() as calls:
            fn(xi, ri, out=xi, residual_out=ri, **kwargs)
        assert calls
        assert_bitwise(xi, y_ref)
        assert_bitwise(ri, h_ref)


@pytest.mark.parametrize("magnitude", sorted(OUT_OF_RANGE))
@pytest.mark.parametrize("shape", [(3000, 48), (400, 300)])
def test_parallel_kernels_report_and_complete_overflowing_rows(monkeypatch, shape, magnitude):
    # The parallel kernels return the (stop, end) rows of only the blocks that stopped
    # before a row whose squares overflow; the driver finishes those from there. Forced
    # parallel (the default chooser runs a size's first calls serially), the plain and
    # fused norms give the serial calls' bits.
    numba = pytest.importorskip("numba")
    from layernorm._backends import _numba as backend
    from layernorm._backends._numba import schedule

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread: no parallel kernels run")
    factor, kwargs = OUT_OF_RANGE[magnitude]
    x = data(shape, "float32", 3)
    r = data(shape, "float32", 4)
    x[7::97] *= factor  # a few such rows, most blocks without one
    r[7::97] *= factor
    calls = {}
    for policy in ("never", "always"):
        monkeypatch.setattr(backend, "chooser", schedule.Chooser(policy))
        threads = numba.get_num_threads()
        numba.set_num_threads(2)
        try:
            calls[policy] = (ln.layer_norm(x, return_stats=True, **kwargs),
                             ln.rms_norm(x, return_stats=True, **kwargs),
                             ln.add_layer_norm(x, r, return_stats=True, **kwargs),
                             ln.add_rms_norm(x, r, return_stats=True, **kwargs))
        finally:
            numba.set_num_threads(threads)
    for got, want in zip(calls["always"], calls["never"], strict=True):
        for a, b in zip(got, want, strict=True):
            assert np.isfinite(a).all()
            assert_bitwise(a, b)


def test_torch_cpu_takes_the_one_pass_kernel():
    torch = pytest.importorskip("torch")
    x = data((33, 300), "bfloat16", 0)
    r = data((33, 300), "float32", 1)
    w = data((300,), "float32", 2)
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    tr, tw = torch.from_numpy(r), torch.from_numpy(w)
    y_ref, h_ref, stats_ref = unfused(x, r, "float32", False, weight=w, weight_offset=1.0)
    with fused_calls() as calls:
        y, h, mean, rstd = ln.add_layer_norm(tx, tr, 300, tw, weight_offset=1.0,
                                             return_stats=True)
        with torch.no_grad():
            ty, th = tx.clone(), tr.clone()
            y2, h2 = ln.add_layer_norm(ty, th, 300, tw, out=ty, residual_out=th)
        tg = tr.clone().requires_grad_()
        y3, _h3 = ln.add_rms_norm(tx, tg, 300, tw)
    assert calls == ["add_layer_norm_forward"] * 2 + ["add_rms_norm_forward"]
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    np.testing.assert_array_equal(y.view(torch.int16).numpy(), y_ref.view(np.int16))
    np.testing.assert_array_equal(h.numpy(), h_ref)
    np.testing.assert_array_equal(mean.numpy(), stats_ref[0])
    np.testing.assert_array_equal(rstd.numpy(), stats_ref[1])
    assert y2 is ty and h2 is th and torch.equal(h2, h)
    assert y3.grad_fn is not None
    y3.float().sum().backward()
    assert tg.grad is not None and tg.grad.shape == tg.shape


# --------------------------------------------------------------------------- weight_offset


def test_offset_gain_is_formed_in_the_accumulation_dtype():
    x = data((3, 8), "bfloat16", 0)
    w = np.full(8, 0.00390625, DT["bfloat16"])  # 2**-8
    gain = np.full(8, 1.00390625, np.float32)
    assert ml_dtypes.bfloat16(1.00390625) == 1.0  # the gain would be 1 in bfloat16
    y = ln.layer_norm(x, weight=w, weight_offset=1.0)
    assert_bitwise(y, ln.layer_norm(x, weight=gain))
    y32 = ln.layer_norm(x.astype(np.float32), weight=w, weight_offset=1.0)
    assert_bitwise(y32, ln.layer_norm(x.astype(np.float32), weight=gain))
    assert not np.array_equal(y32, ln.layer_norm(x.astype(np.float32)))
    # float64 input: the gain in float64
    x64 = x.astype(np.float64)
    w64 = np.full(8, 1e-12)
    assert_bitwise(ln.rms_norm(x64, weight=w64, weight_offset=1.0),
                   ln.rms_norm(x64, weight=w64 + 1.0))


@pytest.mark.parametrize("wd", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("rms", [False, True])
def test_offset_backward_is_with_respect_to_weight(wd, rms):
    x = data((7, 16), "float32", 0)
    gy = data((7, 16), "float32", 1)
    w = data((16,), wd, 2)
    gain = w.astype(np.float32) + np.float32(1.0)
    if rms:
        _, rstd = ln.rms_norm(x, weight=w, weight_offset=1.0, return_stats=True)
        gx, gw = ln.rms_norm_backward(gy, x, rstd, w, weight_offset=1.0)
        rx, rw = ln.rms_norm_backward(gy, x, rstd, gain)
        assert gw.dtype == w.dtype
        assert_bitwise(gx, rx)
        assert_bitwise(gw, rw.astype(w.dtype))
    else:
        _, mean, rstd = ln.layer_norm(x, weight=w, weight_offset=1.0, return_stats=True)
        gx, gw, gb = ln.layer_norm_backward(gy, x, mean, rstd, w, weight_offset=1.0)
        rx, rw, rb = ln.layer_norm_backward(gy, x, mean, rstd, gain)
        assert gw.dtype == gb.dtype == w.dtype
        assert_bitwise(gx, rx)
        assert_bitwise(gw, rw.astype(w.dtype))
        assert_bitwise(gb, rb.astype(w.dtype))


def test_offset_zero_keeps_negative_zero_weights():
    x = data((2, 4), "float32", 0)
    w = np.full(4, -0.0, np.float32)
    y = ln.rms_norm(x, weight=w, weight_offset=0.0, backend="numba")
    assert np.signbit(y[x > 0]).all()


@pytest.mark.parametrize("bad, exc, match", [
    (float("nan"), ValueError, "weight_offset must be a finite"),
    (float("inf"), ValueError, "weight_offset must be a finite"),
    pytest.param(10**400, ValueError, "weight_offset must be a finite", id="10**400"),
    pytest.param(-(10**400), ValueError, "weight_offset must be a finite", id="-10**400"),
    ("1", TypeError, "weight_offset must be a finite real number, got '1'"),
    (1j, TypeError, "weight_offset"),
    (True, TypeError, "weight_offset"),
    (None, TypeError, "weight_offset"),
])
def test_offset_errors(bad, exc, match):
    x = np.ones((2, 4), np.float32)
    w = np.ones(4, np.float32)
    with pytest.raises(exc, match=match):
        ln.layer_norm(x, weight=w, weight_offset=bad)
    with pytest.raises(exc, match=match):
        ln.add_rms_norm(x, x, weight=w, weight_offset=bad)


@pytest.mark.parametrize("lib", ["numpy", "torch", "dask"])
def test_offset_that_overflows_the_accumulation_dtype_is_an_error(lib):
    """The gain weight + weight_offset is formed in the accumulation dtype: an offset
    that is infinite there (1e39 in float32) would make every output inf or NaN."""
    convert = {"numpy": lambda a: a, "torch": lambda a: optional("torch").from_numpy(a),
               "dask": lambda a: optional("dask.array").from_array(a)}[lib]
    x32 = data((3, 4), "float32", 1)
    x, w, b = convert(x32), convert(np.ones(4, np.float32)), convert(np.zeros(4, np.float32))
    _, mean, rstd = ln.layer_norm(x, 4, return_stats=True)
    calls = {
        "layer_norm": lambda o, **k: ln.layer_norm(x, 4, w, b, weight_offset=o, **k),
        "rms_norm": lambda o, **k: ln.rms_norm(x, 4, w, weight_offset=o, **k),
        "add_layer_norm": lambda o, **k: ln.add_layer_norm(x, x, 4, w, b, weight_offset=o,
                                                           **k),
        "add_rms_norm": lambda o, **k: ln.add_rms_norm(x, x, 4, w, weight_offset=o, **k),
        "layer_norm_backward": lambda o: ln.layer_norm_backward(x, x, mean, rstd, w, 4,
                                                                weight_offset=o),
        "rms_norm_backward": lambda o: ln.rms_norm_backward(x, x, rstd, w, 4,
                                                            weight_offset=o),
    }
    # 2**128 - 2**103 is the smallest magnitude that rounds to infinity in float32.
    for offset in (1e39, -1e39, 2.0**128 - 2.0**103):
        for name, call in calls.items():
            for extra in ({}, {"quantize": "int8"}) if "backward" not in name else ({},):
                with pytest.raises(ValueError, match=r"weight_offset=.* overflows the "
                                                     r"accumulation dtype float32"):
                    call(offset, **extra)
    largest = float(np.nextafter(2.0**128 - 2.0**103, 0))  # rounds to float32's max
    y = np.asarray(calls["rms_norm"](largest) if lib != "dask"
                   else calls["rms_norm"](largest).compute())
    assert np.isfinite(y).any()
    if lib == "numpy":  # float64 accumulates in float64, where 1e39 is an ordinary value
        y64 = ln.layer_norm(x32.astype(np.float64), 4, np.ones(4), weight_offset=1e39)
        assert np.isfinite(y64).all()


def test_offset_without_weight_is_an_error():
    x = np.ones((2, 4), np.float32)
    for call in (lambda: ln.layer_norm(x, weight_offset=1.0),
                 lambda: ln.rms_norm(x, weight_offset=1.0),
                 lambda: ln.add_layer_norm(x, x, weight_offset=1.0),
                 lambda: ln.rms_norm_backward(x, x, np.ones((2, 1), np.float32),
                                              weight_offset=1.0)):
        with pytest.raises(ValueError, match=r"weight_offset=1\.0 needs a weight"):
            call()
    with pytest.raises(ValueError, match="weight_offset"):
        ln.LayerNorm(4, elementwise_affine=False, weight_offset=1.0)


def test_layer_classes_with_offset():
    layer = ln.RMSNorm(8, weight_offset=1.0)
    assert repr(layer) == "RMSNorm((8,), eps=None, elementwise_affine=True, weight_offset=1.0)"
    np.testing.assert_array_equal(layer.weight, np.zeros(8, np.float32))
    x = data((3, 8), "float32", 0)
    assert_bitwise(layer(x), ln.rms_norm(x))  # a gain of one
    layer.weight = data((8,), "float32", 1)
    assert_bitwise(layer(x), ln.rms_norm(x, weight=layer.weight, weight_offset=1.0))
    _, gw = layer.backward(x)
    _, rstd = ln.rms_norm(x, weight=layer.weight, weight_offset=1.0, return_stats=True)
    assert_bitwise(gw, ln.rms_norm_backward(x, x, rstd, layer.weight, weight_offset=1.0)[1])
    layer.reset_parameters()
    np.testing.assert_array_equal(layer.weight, np.zeros(8, np.float32))
    lnorm = ln.LayerNorm(4, weight_offset=0.25, dtype="bfloat16")
    assert repr(lnorm).endswith("bias=True, weight_offset=0.25)")
    np.testing.assert_array_equal(lnorm.weight.astype(np.float32), np.full(4, 0.75))
    assert "weight_offset" not in repr(ln.LayerNorm(4))


# --------------------------------------------------------------------------- grad_residual


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", list(DT))
def test_grad_residual(dtype, rms):
    x, gy, gr = data((9, 20), dtype, 0), data((9, 20), dtype, 1), data((9, 20), dtype, 2)
    w = data((20,), "float32", 3)
    if rms:
        _, rstd = ln.rms_norm(x, weight=w, return_stats=True)
        stats = (rstd,)
        backward = ln.rms_norm_backward
    else:
        _, mean, rstd = ln.layer_norm(x, weight=w, return_stats=True)
        stats = (mean, rstd)
        backward = ln.layer_norm_backward
    fused = backward(gy, x, *stats, w, grad_residual=gr)
    plain = backward(gy, x, *stats, w)
    for a, b in zip(fused[1:], plain[1:], strict=True):
        assert_bitwise(a, b)
    if dtype in ("float32", "float64"):
        assert_bitwise(fused[0], plain[0] + gr)
        return
    wide = backward(gy.astype(np.float32), x.astype(np.float32), *stats, w)
    # the 16-bit kernels compute in float32 and round once: the widened run is that value
    assert_bitwise(plain[0], wide[0].astype(DT[dtype]))
    assert_bitwise(fused[0], (wide[0] + gr.astype(np.float32)).astype(DT[dtype]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["short rows", "rows", "long rows in pairs",
                                    "strided rows", "columns", "parallel"])
@pytest.mark.parametrize("rms", [False, True])
def test_grad_residual_in_every_backward_path(rms, layout, dtype):
    from layernorm import _fast_backward
    from layernorm._backends import _numba as backend

    shape, axis = {"short rows": ((9, 20), -1), "rows": ((7, 300), -1),
                   "long rows in pairs": ((5, 2100), -1), "strided rows": ((6, 90), -1),
                   "columns": ((3, 40, 5), 1), "parallel": ((130, 1024), -1)}[layout]
    x, gy, gr = (data(shape, dtype, seed, 2.0) for seed in (0, 1, 2))
    if layout == "strided rows":  # every other column of wider arrays
        x, gy, gr = (np.repeat(a, 2, axis=1)[:, ::2] for a in (x, gy, gr))
    n = shape[axis]
    w = data((n,), "float32", 3) + 1.0
    fwd, bwd = (ln.rms_norm, ln.rms_norm_backward) if rms else (ln.layer_norm,
                                                                ln.layer_norm_backward)
    stats = fwd(x, weight=w, axis=axis, return_stats=True)[1:]
    seen = []
    name = "rms_norm_backward" if rms else "layer_norm_backward"
    real = getattr(backend, name)

    real_short = _fast_backward.gradients

    def spy(*args, **kwargs):
        seen.append("grad_residual" in kwargs)
        return real(*args, **kwargs)

    def short_spy(*args):
        result = real_short(*args)
        if result is not None:  # the short path's call of the same kernels
            seen.append(args[7] is not None)
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, name, spy)
        mp.setattr(_fast_backward, "gradients", short_spy)
        fused = bwd(gy, x, *stats, w, axis=axis, grad_residual=gr)
    assert seen == [True]
    plain = bwd(gy, x, *stats, w, axis=axis)
    for a, b in zip(fused[1:], plain[1:], strict=True):
        assert_bitwise(a, b)
    if dtype == "float32":
        assert_bitwise(fused[0], plain[0] + gr)
    else:  # one rounding of the float32 sum
        wide = bwd(gy.astype(np.float32), x.astype(np.float32), *stats, w, axis=axis)
        assert_bitwise(fused[0], (wide[0] + gr.astype(np.float32)).astype(DT[dtype]))


def test_grad_residual_errors():
    x = np.ones((2, 4), np.float32)
    stats = ln.layer_norm(x, return_stats=True)[1:]
    with pytest.raises(ValueError, match=r"grad_residual must have shape \(2, 4\)"):
        ln.layer_norm_backward(x, x, *stats, grad_residual=np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="grad_residual must have the dtype of x"):
        ln.layer_norm_backward(x, x, *stats, grad_residual=np.ones((2, 4), np.float64))
    with pytest.raises(TypeError, match="grad_residual must have dtype"):
        ln.layer_norm_backward(x, x, *stats, grad_residual=np.ones((2, 4), np.int32))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="grad_residual comes from torch"):
        ln.layer_norm_backward(x, x, *stats, grad_residual=torch.ones(2, 4))


# --------------------------------------------------------------------------- errors


def test_add_errors():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"residual must have shape \(2, 4\)"):
        ln.add_layer_norm(x, np.ones((2, 5), np.float32))
    with pytest.raises(TypeError, match=r"residual must have dtype .* got dtype int32"):
        ln.add_layer_norm(x, np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match=r"residual_dtype must be .* got 'float99'"):
        ln.add_rms_norm(x, x, residual_dtype="float99")
    with pytest.raises(TypeError, match=r"residual_dtype must be .* got <class 'numpy.int32'>"):
        ln.add_rms_norm(x, x, residual_dtype=np.int32)
    # a dtype's name is a dtype too: the wrong kind of dtype is a TypeError either way,
    # and NumPy's other names of a float dtype are that dtype, as the dtype objects are
    for name in ("int8", "complex64", "bool", "i4,i4", "U"):
        with pytest.raises(TypeError, match=r"residual_dtype must be .* got '"):
            ln.add_layer_norm(x, x, residual_dtype=name)
    for name, want in (("f4", np.float32), ("<f4", np.float32), ("single", np.float32),
                       ("float", np.float64), ("double", np.float64), ("half", np.float16)):
        assert ln.add_layer_norm(x, x, residual_dtype=name)[1].dtype == want
        assert ln.add_layer_norm(x, x, residual_dtype=np.dtype(name))[1].dtype == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's deprecated codes warn: never ours to show
        with pytest.raises(TypeError, match="residual_dtype must be"):
            ln.add_layer_norm(x, x, residual_dtype="a")
    with pytest.raises(ValueError, match="residual_out must have the dtype of h"):
        ln.add_rms_norm(x, x, residual_out=np.ones((2, 4), np.float64))
    with pytest.raises(ValueError, match="out must have the dtype of x"):
        ln.add_rms_norm(x, x, out=np.ones((2, 4), np.float64))
    buf = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="out and residual_out share memory"):
        ln.add_rms_norm(x, x.copy(), out=buf, residual_out=buf)
    for add in (ln.add_layer_norm, ln.add_rms_norm):
        with pytest.raises(TypeError, match=r"residual must be an array of x's shape \(2, 4\), "
                                            "got None"):
            add(x, None)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="residual comes from torch"):
        ln.add_layer_norm(x, torch.ones(2, 4))


def test_add_array_api_has_no_out():
    xs = pytest.importorskip("array_api_strict")
    x = xs.ones((2, 4), dtype=xs.float32)
    with pytest.raises(TypeError, match="residual_out= is not supported"):
        ln.add_layer_norm(x, x, residual_out=x)


# --------------------------------------------------------------------------- quantize


def qref(y32, fmt, scale=None):
    """Quantize in the test: per-row dynamic scale or a static one; RNE; saturating."""
    acc = y32.dtype.type
    qmax = acc(QMAX[fmt])
    if scale is None:
        amax = np.max(np.abs(y32), axis=-1, keepdims=True)
        s = np.where(amax == 0, acc(1), amax / qmax).astype(acc)
    else:
        s = np.asarray(scale, acc)
    v = y32 * (acc(1) / s)
    if fmt == "int8":
        v = np.where(np.isnan(v), 0, v)
        return np.clip(np.rint(v), -128, 127).astype(np.int8), s
    v = np.where(v > qmax, qmax, np.where(v < -qmax, -qmax, v))
    if acc is np.float64:
        return nearest_fp8(v, fmt), s
    return v.astype(FP8[fmt]), s


def nearest_fp8(v, fmt):
    """float64 -> float8 by exhaustive search: nearest finite value, ties to even bits."""
    table = np.arange(256, dtype=np.uint8).view(FP8[fmt])
    values = table.astype(np.float64)
    ok = np.isfinite(values)
    cand_bits, cand = np.arange(256)[ok], values[ok]
    flat = v.reshape(-1)
    out = np.empty(flat.shape, np.uint8)
    for i, t in enumerate(flat):
        if np.isnan(t):
            out[i] = np.array(np.nan, FP8[fmt]).view(np.uint8)
            continue
        d = np.abs(cand - t)
        best = np.flatnonzero(d == d.min())
        even = [b for b in best if cand_bits[b] % 2 == 0]
        b = (even or list(best))[0]
        # -0.0 and +0.0 tie: keep t's sign
        if cand[b] == 0.0:
            out[i] = 0x80 if np.signbit(t) else 0
        else:
            out[i] = cand_bits[b]
    return out.view(FP8[fmt]).reshape(v.shape)


FORMATS = ["int8", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("rms", [False, True])
def test_quantize_dynamic(rms, dtype, fmt):
    x = data((6, 33), dtype, 0, 2.0)
    x[2] = 0  # an all-zero row: scale 1.0
    w = data((33,), "float32", 1)
    acc = acc_of(dtype)
    if rms:
        q, s, rstd = ln.rms_norm(x, weight=w, quantize=fmt, return_stats=True)
        y32, rstd_ref = ln.rms_norm(x.astype(acc), weight=w, return_stats=True)
        assert_bitwise(rstd, rstd_ref)
    else:
        q, s = ln.layer_norm(x, weight=w, quantize=fmt)
        y32 = ln.layer_norm(x.astype(acc), weight=w)
    q_ref, s_ref = qref(y32, fmt)
    assert s.shape == (6, 1) and s.dtype == acc
    assert_bitwise(s, s_ref)
    assert s[2, 0] == 1.0 and not q[2].astype(np.float64).any()
    assert_bitwise(q, q_ref)
    # against a float64 reference: within half a step (plus the input's rounding)
    ref = (ref_rms_norm(x, w, 1.1920928955078125e-07 if acc is np.float32 else 2.2e-16)
           if rms else ref_layer_norm(x, w))
    err = np.abs(q.astype(np.float64) * s - ref)
    step = s * (1.0 if fmt == "int8" else np.abs(ref / s) * 2.0**-2 + 2.0**-6)
    assert (err <= step + 1e-3 * np.abs(ref) + 1e-6).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_static_scale_saturates(fmt):
    x = data((5, 16), "float32", 0, 3.0)
    for scale in (1e-3, np.full((5, 1), 1e-3, np.float32), np.float32(0.5),
                  np.array([[0.1], [1.0], [2.0], [0.001], [10.0]])):
        q, s = ln.layer_norm(x, quantize=fmt, scale=scale)
        assert s is scale  # returned as passed
        y32 = ln.layer_norm(x)
        q_ref, _ = qref(y32, fmt, scale)
        assert_bitwise(q, q_ref)
    q, _ = ln.layer_norm(x, quantize=fmt, scale=1e-6)
    top = QMAX[fmt] if fmt != "int8" else 127
    assert q.astype(np.float64).max() == top
    assert q.astype(np.float64).min() == (-128 if fmt == "int8" else -QMAX[fmt])


@pytest.mark.parametrize("lib", ["numpy", "torch", "array_api", "dask"])
def test_quantize_static_scale_of_bfloat16(lib):
    """A bfloat16 scale array is a real dtype like float16 (audit finding: refused as
    "not a real dtype"): used as its values, exactly widened, on every library."""
    rng = np.random.default_rng(31)
    x = data((6, 32), "float32", 0, 2.0)
    scale = (0.01 + rng.random((6, 1))).astype(ml_dtypes.bfloat16)
    want = ln.layer_norm(x, quantize="int8", scale=scale.astype(np.float32))[0]
    if lib == "torch":
        torch = optional("torch")
        got = ln.layer_norm(torch.from_numpy(x), quantize="int8",
                            scale=torch.from_numpy(scale.astype(np.float32)).bfloat16())[0]
        got = got.numpy()
    elif lib == "dask":
        da = optional("dask.array")
        got = ln.layer_norm(da.from_array(x, chunks=(4, 32)), quantize="int8",
                            scale=da.from_array(scale, chunks=(4, 1)))[0].compute()
    else:
        kw = {"backend": "array_api"} if lib == "array_api" else {}
        got = ln.layer_norm(x, quantize="int8", scale=scale, **kw)[0]
    assert_bitwise(got, want)
    bad = scale.copy()
    bad[3] = 0
    with pytest.raises(ValueError, match="scale must be positive and finite"):
        ln.layer_norm(x, quantize="int8", scale=bad)


def test_quantize_rounds_half_to_even():
    x = np.array([[-1.0, 1.0]] * 1, np.float32)  # LayerNorm with eps=0 gives exactly [-1, 1]
    q, _ = ln.layer_norm(x, weight=np.array([2.5, 3.5], np.float32), eps=0.0, quantize="int8",
                         scale=1.0)
    np.testing.assert_array_equal(q, [[-2, 4]])
    q, _ = ln.layer_norm(x, weight=np.array([1.0625, 1.1875], np.float32), eps=0.0,
                         quantize="float8_e4m3fn", scale=1.0)
    np.testing.assert_array_equal(q.astype(np.float32), [[-1.0, 1.25]])
    # float64: one rounding from the float64 value (not through float32, which would
    # first round 1.0625 + 2**-40 to the tie 1.0625 and then to 1.0)
    x64 = x.astype(np.float64)
    w = np.array([1.0625 + 2.0**-40, 1.0625 - 2.0**-40])
    q, _ = ln.layer_norm(x64, weight=w, eps=0.0, quantize="float8_e4m3fn", scale=1.0)
    np.testing.assert_array_equal(q.astype(np.float64), [[-1.125, 1.0]])
    q, _ = ln.rms_norm(np.array([[1.0, 1.0]]), weight=np.array([1.0625 + 2.0**-40, 3.0]),
                       eps=0.0, quantize="float8_e5m2", scale=1.0)
    np.testing.assert_array_equal(q.astype(np.float64), [[1.0, 3.0]])


@pytest.mark.parametrize("lib", ["numpy", "torch", "jax", "jax.jit"])
def test_float64_quantize_rounds_once_on_every_library(lib):
    # 1.0625 + 2**-40 lies above the e4m3fn tie 1.0625 (between 1.0 and 1.125), and
    # 1.125 + 2**-40 above the e5m2 tie 1.125 (between 1.0 and 1.25): a float32 step
    # between would land on the tie and round to even, down.
    x = np.array([[-1.0, 1.0]])
    w = np.array([1.0625 + 2.0**-40, 1.0625 - 2.0**-40])
    w_rms = np.array([1.125 + 2.0**-40, 3.0])
    if lib == "numpy":
        convert, to_numpy, context = np.asarray, np.asarray, contextlib.nullcontext()
    elif lib == "torch":
        torch = pytest.importorskip("torch")
        convert, to_numpy = torch.from_numpy, lambda t: t.numpy()
        context = contextlib.nullcontext()
    else:
        jax = pytest.importorskip("jax")
        if not hasattr(jax, "enable_x64"):
            pytest.skip("this JAX has no enable_x64 context")
        convert, to_numpy, context = jax.numpy.asarray, np.asarray, jax.enable_x64(True)
    with context:
        def quantized(x, w, w_rms):
            q, _ = ln.layer_norm(x, weight=w, eps=0.0, quantize="float8_e4m3fn", scale=1.0)
            r, _ = ln.rms_norm(x * x, weight=w_rms, eps=0.0, quantize="float8_e5m2",
                               scale=1.0)
            return q, r
        if lib == "jax.jit":
            import jax
            quantized = jax.jit(quantized)
        q, r = quantized(convert(x), convert(w), convert(w_rms))
        q = to_numpy(q).astype(np.float64) if lib != "torch" else to_numpy(q.double())
        r = to_numpy(r).astype(np.float64) if lib != "torch" else to_numpy(r.double())
    np.testing.assert_array_equal(q, [[-1.125, 1.0]])
    np.testing.assert_array_equal(r, [[1.25, 3.0]])


def test_quantize_nan():
    x = data((3, 8), "float32", 0)
    x[1, 3] = np.nan
    q, s = ln.layer_norm(x, quantize="int8")
    assert (q[1] == 0).all() and np.isnan(s[1, 0])
    q, s = ln.layer_norm(x, quantize="float8_e4m3fn", scale=0.5)
    assert np.isnan(q[1].astype(np.float32)).all()
    assert not np.isnan(q[[0, 2]].astype(np.float32)).any()
    q, _ = ln.layer_norm(x, quantize="int8", scale=0.5)
    assert (q[1] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_quantize_rows_of_no_elements(fmt, dtype):
    # A dynamic scale of an empty row is that of an all-zero row, 1.0 (was: a NumPy
    # error, a maximum over no elements).
    x = np.empty((4, 0), dtype)
    for call in (lambda: ln.layer_norm(x, quantize=fmt),
                 lambda: ln.rms_norm(x, quantize=fmt),
                 lambda: ln.add_layer_norm(x, x.copy(), quantize=fmt)[::2],
                 lambda: ln.add_rms_norm(x, x.copy(), quantize=fmt)[::2]):
        q, s = call()
        assert q.shape == (4, 0) and q.dtype == (np.int8 if fmt == "int8" else FP8[fmt])
        assert s.shape == (4, 1) and (s == 1.0).all()


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_quantized_nan_row_codes_are_batch_invariant(fmt, dtype):
    # A NaN row's float8 codes are one NaN code, alone or in a batch (float64 input is
    # composed with NumPy, whose multiply loop kept the sign of one NaN or the other
    # depending on the batch's shape).
    x = data((3, 16), dtype, 5)
    x[1, 1] = np.inf  # row 1: NaN after the normalization
    batch, _ = ln.layer_norm(x, quantize=fmt)
    alone, _ = ln.layer_norm(x[1:2], quantize=fmt)
    assert np.isnan(alone.astype(np.float32)).all()
    assert_bitwise(batch[1:2], alone)
    y, _h, _s = ln.add_rms_norm(x, x.copy(), quantize=fmt)
    assert_bitwise(y[1:2], ln.add_rms_norm(x[1:2], x[1:2].copy(), quantize=fmt)[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_float64_matches_nearest_value(fmt):
    x = data((4, 50), "float64", 0, 5.0)
    q, _s = ln.rms_norm(x, quantize=fmt, return_stats=False)
    y64 = ln.rms_norm(x)
    assert_bitwise(q, qref(y64, fmt)[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_add_quantize_and_out(fmt):
    x = data((4, 12), "bfloat16", 0)
    r = data((4, 12), "float32", 1)
    qdt = np.dtype(np.int8) if fmt == "int8" else np.dtype(FP8[fmt])
    out = np.empty((4, 12), qdt)
    y, h, s, mean, _rstd = ln.add_layer_norm(x, r, quantize=fmt, out=out, residual_out=r,
                                            return_stats=True)
    assert y is out and h is r
    h_ref = (x.astype(np.float32) + data((4, 12), "float32", 1)).astype(np.float32)
    assert_bitwise(h, h_ref)
    y32, mean_ref, _rstd_ref = ln.layer_norm(h_ref, return_stats=True)
    q_ref, s_ref = qref(y32, fmt)
    assert_bitwise(y, q_ref)
    assert_bitwise(s, s_ref)
    assert_bitwise(mean, mean_ref)


@pytest.mark.parametrize("static", [False, True])
def test_quantize_float32_dtype_objects_other_than_numpys_own(static):
    # The short path recognises float32 by NumPy's own dtype object; an equal dtype
    # that is another object (native order spelled out, metadata) takes the general
    # path, with the same codes and scales.
    x = data((6, 40), "float32", 0)
    w = data((40,), "float32", 2)
    scale = 0.05 if static else None
    want_q, want_s = ln.layer_norm(x, weight=w, quantize="int8", scale=scale)
    native = np.dtype(np.float32).newbyteorder("=")
    for dtype in (native, np.dtype(np.float32, metadata={"unit": "m"})):
        other = x.astype(dtype)
        for _ in range(2):  # a first and a planned call
            q, s = ln.layer_norm(other, weight=w, quantize="int8", scale=scale)
            assert_bitwise(q, want_q)
            assert_bitwise(np.asarray(s), np.asarray(want_s))


def test_quantize_errors():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"quantize must be None, 'int8'.*got 'int4'"):
        ln.layer_norm(x, quantize="int4")
    with pytest.raises(ValueError, match="quantize must be"):
        ln.add_rms_norm(x, x, quantize=np.int8)
    for bad in (0.0, -1.0, float("inf"), float("nan"), 10**400, -(10**400)):
        with pytest.raises(ValueError, match="scale must be positive and finite"):
            ln.rms_norm(x, quantize="int8", scale=bad)
    with pytest.raises(ValueError, match=r"scale must be positive and finite in every "
                                         r"element, got values from 0\.0 to 1\.0"):
        ln.rms_norm(x, quantize="int8", scale=np.array([[1.0], [0.0]]))
    # A mask cannot be honoured (the masked value would set the codes): rejected, on a
    # first call and on a planned one.
    masked = np.ma.masked_array([[1e-3], [0.5]], mask=[[True], [False]], dtype=np.float32)
    for fn in (ln.layer_norm, ln.rms_norm, ln.add_layer_norm, ln.add_rms_norm):
        args = (x, x) if fn.__name__.startswith("add") else (x,)
        for _ in range(2):
            fn(*args, quantize="int8", scale=np.float32(0.5))
            with pytest.raises(TypeError, match=r"scale is a numpy\.ma\.MaskedArray"):
                fn(*args, quantize="int8", scale=masked)
    with pytest.raises(ValueError, match=r"broadcastable to the statistics' shape \(2, 1\)"):
        ln.rms_norm(x, quantize="int8", scale=np.ones(4))
    # A static scale the accumulation dtype cannot hold, or whose 1 / scale it cannot: in
    # float32 1e-40 would saturate every nonzero code (and turn zeros into NaN in float8).
    for bad in (1e-40, 1e39, np.array([[1.0], [1e-40]]), np.float32(1e-40)):
        for fmt in ("int8", "float8_e4m3fn"):
            with pytest.raises(ValueError, match=r"scale.* outside the range the accumulation "
                                                 r"dtype float32 takes"):
                ln.layer_norm(x, quantize=fmt, scale=bad)
    # float64 input accumulates in float64, which holds them.
    q64, _ = ln.rms_norm(x.astype(np.float64), quantize="int8", scale=1e-40)
    assert (q64 == 127).all()
    with pytest.raises(ValueError, match="out must have the quantized dtype int8"):
        ln.layer_norm(x, quantize="int8", out=np.empty((2, 4), np.float32))
    read_only = np.zeros((2, 4), np.int8)
    read_only.flags.writeable = False
    for call in (lambda: ln.layer_norm(x, quantize="int8", out=read_only),
                 lambda: ln.rms_norm(x, quantize="int8", out=read_only),
                 lambda: ln.add_layer_norm(x, x, quantize="int8", out=read_only)):
        with pytest.raises(ValueError, match="out must be a writeable array, got a read-only"):
            call()
        assert not read_only.any()  # nothing written
    with pytest.raises(ValueError, match="scale= is only used with quantize="):
        ln.layer_norm(x, scale=1.0)
    with pytest.raises(ValueError, match="out must have the quantized dtype float8_e5m2"):
        ln.add_layer_norm(x, x, quantize="float8_e5m2", out=np.empty((2, 4), np.int8))


# --------------------------------------------------------------------------- torch


def test_torch_matches_numpy_bitwise():
    torch = pytest.importorskip("torch")
    x = data((5, 16), "bfloat16", 0)
    r = data((5, 16), "float32", 1)
    w = data((16,), "bfloat16", 2)
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    tr, tw = torch.from_numpy(r), torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    y, h, rstd = ln.add_rms_norm(tx, tr, 16, tw, weight_offset=1.0, return_stats=True)
    ny, nh, nrstd = ln.add_rms_norm(x, r, 16, w, weight_offset=1.0, return_stats=True)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    np.testing.assert_array_equal(y.view(torch.int16).numpy(), ny.view(np.int16))
    np.testing.assert_array_equal(h.numpy(), nh)
    np.testing.assert_array_equal(rstd.numpy(), nrstd)
    for fmt, tdt in (("int8", torch.int8), ("float8_e4m3fn", torch.float8_e4m3fn),
                     ("float8_e5m2", torch.float8_e5m2)):
        q, s = ln.layer_norm(tx, weight=tw, weight_offset=1.0, quantize=fmt)
        nq, ns = ln.layer_norm(x, weight=w, weight_offset=1.0, quantize=fmt)
        assert q.dtype == tdt
        np.testing.assert_array_equal(q.view(torch.int8).numpy(), nq.view(np.int8))
        np.testing.assert_array_equal(s.numpy(), ns)
    gx, gw = ln.rms_norm_backward(tx, tx, rstd, tw, weight_offset=1.0, grad_residual=tx)
    ngx, ngw = ln.rms_norm_backward(x, x, nrstd, w, weight_offset=1.0, grad_residual=x)
    assert gw.dtype == torch.bfloat16
    np.testing.assert_array_equal(gx.view(torch.int16).numpy(), ngx.view(np.int16))
    np.testing.assert_array_equal(gw.view(torch.int16).numpy(), ngw.view(np.int16))


def as_tensor(a):
    """A CPU tensor sharing the memory of the NumPy array ``a`` (bfloat16 through its bits)."""
    import torch

    if a.dtype == DT["bfloat16"]:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def tensor_bits(t):
    """The bits of a CPU tensor as a NumPy array of signed integers (any float dtype)."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()]).numpy()


def assert_tensor_bitwise(t, a):
    a = np.ascontiguousarray(a)
    assert tuple(t.shape) == a.shape
    assert str(t.dtype).removeprefix("torch.") == a.dtype.name, (t.dtype, a.dtype)
    np.testing.assert_array_equal(tensor_bits(t), a.view(f"i{a.dtype.itemsize}"))


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_torch_cpu_quantizes_in_the_kernel(fn):
    # quantize= on CPU tensors runs the quantizing kernel on zero-copy views (the
    # composition raises here), and gives NumPy's bits: codes, scale, h and statistics.
    torch = pytest.importorskip("torch")
    add, rms = fn.startswith("add_"), "rms" in fn
    x = data((9, 300), "bfloat16", 0, 3.0)
    r = data((9, 300), "float32", 1)
    w = data((300,), "bfloat16", 2)
    b = data((300,), "float32", 3)
    static = data((9, 1), "float32", 4) ** 2 + np.float32(0.01)
    params = {"weight": w} if rms else {"weight": w, "bias": b}
    np_args = (x, r) if add else (x,)
    t_args = tuple(as_tensor(a).requires_grad_() for a in np_args)
    t_params = {k: as_tensor(v) for k, v in params.items()}
    f = getattr(ln, fn)
    sp = 2 if add else 1  # where the scale is in the results
    for fmt in QMAX:
        for scale, t_scale in ((None, None), (0.02, 0.02), (static, torch.from_numpy(static))):
            want = f(*np_args, weight_offset=1.0, quantize=fmt, scale=scale,
                     return_stats=True, **params)
            out = torch.empty(9, 300, dtype=getattr(torch, fmt))
            with quantized_calls(strict=True) as calls:
                got = f(*t_args, weight_offset=1.0, quantize=fmt, scale=t_scale,
                        return_stats=True, **t_params)
                with torch.no_grad():  # out= takes no inputs that require grad
                    got_out = f(*t_args, weight_offset=1.0, quantize=fmt, scale=t_scale,
                                out=out, **t_params)
            assert calls == [fmt, fmt]
            assert len(got) == len(want)
            assert got[0].dtype == getattr(torch, fmt) and not got[0].requires_grad
            for k, (g, n) in enumerate(zip(got, want, strict=True)):
                if k == sp and scale is not None:
                    assert g is t_scale  # a static scale is returned as passed
                else:
                    assert_tensor_bitwise(g, n)
            assert got_out[0] is out
            assert_tensor_bitwise(out, want[0])


def test_torch_cpu_quantize_composes_where_numpy_does():
    # float64 input (float64 accumulation) and normalized columns have no quantizing
    # kernel: composed, for tensors as for NumPy arrays, with the same bits.
    pytest.importorskip("torch")
    cases = [(data((5, 16), "float64", 0), {}), (data((16, 5), "float32", 1), {"axis": 0})]
    for x, kw in cases:
        want = ln.rms_norm(x, quantize="float8_e4m3fn", return_stats=True, **kw)
        with quantized_calls() as calls:
            got = ln.rms_norm(as_tensor(x), quantize="float8_e4m3fn", return_stats=True, **kw)
        assert calls == []
        for g, n in zip(got, want, strict=True):
            assert_tensor_bitwise(g, n)


@contextlib.contextmanager
def fused_grad_residual(name):
    """Records whether each call of the Numba backward ``name`` got ``grad_residual``; the
    composition (grad_x + grad_residual after the backward) raises."""
    from layernorm import _engine
    from layernorm._backends import _numba as backend

    seen = []
    real = getattr(backend, name)

    def spy(*args, **kwargs):
        seen.append("grad_residual" in kwargs)
        return real(*args, **kwargs)

    def composed(*args, **kwargs):
        raise AssertionError("grad_residual added by the composition, not the kernel")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, name, spy)
        mp.setattr(_engine, "with_grad_residual", composed)
        yield seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rms", [False, True])
def test_torch_cpu_adds_grad_residual_in_the_kernel(rms, dtype):
    torch = pytest.importorskip("torch")
    x, gy, gr = (data((9, 300), dtype, seed, 2.0) for seed in (0, 1, 2))
    strided = np.repeat(gr, 2, axis=1)[:, ::2]  # every other column of a wider array
    w = data((300,), "bfloat16", 3)
    fwd, bwd = (ln.rms_norm, ln.rms_norm_backward) if rms else (ln.layer_norm,
                                                                ln.layer_norm_backward)
    stats = fwd(x, weight=w, weight_offset=1.0, return_stats=True)[1:]
    want = bwd(gy, x, *stats, w, weight_offset=1.0, grad_residual=gr)
    t_stats = [torch.from_numpy(s) for s in stats]
    with fused_grad_residual("rms_norm_backward" if rms else "layer_norm_backward") as seen:
        got = bwd(as_tensor(gy), as_tensor(x), *t_stats, as_tensor(w), weight_offset=1.0,
                  grad_residual=as_tensor(gr))
        got_strided = bwd(as_tensor(gy), as_tensor(x), *t_stats, as_tensor(w),
                          weight_offset=1.0, grad_residual=as_tensor(strided))
    assert seen == [True, True]
    for g, gs, n in zip(got, got_strided, want, strict=True):
        assert_tensor_bitwise(g, n)
        assert_tensor_bitwise(gs, n)


@pytest.mark.parametrize("rms", [False, True])
def test_torch_cpu_add_autograd_adds_grad_residual_in_the_kernel(rms):
    # Through add_*'s autograd node the gradient of h reaches the backward kernels as
    # grad_residual: x and residual get NumPy's grad_x + grad_residual, bit for bit.
    torch = pytest.importorskip("torch")
    x, r, gy, gh = (data((9, 300), "float32", seed) for seed in (0, 1, 2, 3))
    w, b = data((300,), "float32", 4), data((300,), "float32", 5)
    params = {"weight": w} if rms else {"weight": w, "bias": b}
    f, bwd = (ln.add_rms_norm, ln.rms_norm_backward) if rms else (ln.add_layer_norm,
                                                                  ln.layer_norm_backward)
    _, h, *stats = f(x, r, weight_offset=1.0, return_stats=True, **params)
    want = bwd(gy, h, *stats, w, weight_offset=1.0, grad_residual=gh)
    tx, tr = as_tensor(x).requires_grad_(), as_tensor(r).requires_grad_()
    t_params = {k: as_tensor(v).requires_grad_() for k, v in params.items()}
    with fused_grad_residual("rms_norm_backward" if rms else "layer_norm_backward") as seen:
        y, th = f(tx, tr, weight_offset=1.0, **t_params)
        torch.autograd.backward((y, th), (as_tensor(gy), as_tensor(gh)))
    assert seen == [True]
    assert_tensor_bitwise(tx.grad, want[0])
    assert_tensor_bitwise(tr.grad, want[0])
    for t, n in zip(t_params.values(), want[1:], strict=True):
        assert_tensor_bitwise(t.grad, n)


@pytest.mark.parametrize("backend", [None, "array_api"])
def test_torch_autograd_gradcheck(backend):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)

    x, r, w, b = make(3, 7), make(3, 7), make(7), make(7)
    assert torch.autograd.gradcheck(
        lambda x, r, w, b: ln.add_layer_norm(x, r, 7, w, b, weight_offset=1.0,
                                             backend=backend), (x, r, w, b))
    assert torch.autograd.gradcheck(
        lambda x, r, w: ln.add_rms_norm(x, r, 7, w, weight_offset=-0.5, backend=backend),
        (x, r, w))
    assert torch.autograd.gradcheck(
        lambda x, w: ln.rms_norm(x, 7, w, weight_offset=1.0, backend=backend), (x, w))


def test_torch_autograd_against_unfused_torch():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 10, generator=g, requires_grad=True)
    r = torch.randn(4, 10, generator=g, requires_grad=True)
    w = torch.randn(10, generator=g).to(torch.bfloat16).requires_grad_()
    b = torch.randn(10, generator=g, requires_grad=True)
    y, h = ln.add_layer_norm(x, r, 10, w, b, weight_offset=1.0)
    assert y.grad_fn is not None and h.grad_fn is not None
    (y.square().sum() + (h * 3).sum()).backward()
    grads = [t.grad.clone() for t in (x, r, w, b)]
    for t in (x, r, w, b):
        t.grad = None
    h2 = x + r
    y2 = torch.nn.functional.layer_norm(h2, (10,), w.float() + 1.0, b)
    (y2.square().sum() + (h2 * 3).sum()).backward()
    assert grads[2].dtype == torch.bfloat16
    for got, want in zip(grads, (x.grad, r.grad, w.grad, b.grad), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)
    q, h, _s = ln.add_rms_norm(x, r, quantize="int8")
    assert not q.requires_grad


def test_torch_modules_with_offset():
    torch = pytest.importorskip("torch")
    import layernorm.torch as lnt

    m = lnt.RMSNorm(6, weight_offset=1.0)
    assert repr(m) == "RMSNorm((6,), eps=None, elementwise_affine=True, weight_offset=1.0)"
    assert (m.weight == 0).all()
    m2 = lnt.LayerNorm(6, 1e-5, True, False, weight_offset=0.5)
    assert (m2.weight == 0.5).all() and m2.bias is None
    assert repr(lnt.LayerNorm(6)) == repr(torch.nn.LayerNorm(6))
    x = torch.randn(3, 6)
    with torch.no_grad():
        m.weight.copy_(torch.randn(6))
        want = torch.nn.functional.rms_norm(x, (6,), m.weight + 1.0)
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    m.reset_parameters()
    assert (m.weight == 0).all()


def test_torch_errors():
    torch = pytest.importorskip("torch")
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match="needs a weight"):
        ln.rms_norm(x, weight_offset=1.0)
    with pytest.raises(ValueError, match="quantize must be"):
        ln.layer_norm(x, quantize="fp8")
    with pytest.raises(ValueError, match="scale= is only used with quantize="):
        ln.rms_norm(x, scale=2.0)
    with pytest.raises(TypeError, match="residual comes from numpy"):
        ln.add_layer_norm(x, np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="out must have the quantized dtype int8"):
        ln.rms_norm(x, quantize="int8", out=torch.empty(2, 4))
    out = torch.empty(2, 4, dtype=torch.int8)
    q, _s = ln.rms_norm(x, quantize="int8", out=out)
    assert q is out
    # the kernels write outputs in place: one whose elements alias is refused
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="out has elements that share memory"):
        ln.rms_norm(x, quantize="int8", out=torch.empty(1, 8, dtype=torch.int8).expand(3, 8))
    with pytest.raises(ValueError, match="out has elements that share memory"):
        ln.add_rms_norm(x, x.clone(), out=torch.empty(1, 8).expand(3, 8))
    with pytest.raises(ValueError, match="residual_out has elements that share memory"):
        ln.add_layer_norm(x, x.clone(), residual_out=torch.empty(1, 8).expand(3, 8))


# --------------------------------------------------------------------------- Dask


def test_dask_is_lazy_and_blockwise():
    da = pytest.importorskip("dask.array")
    calls = []

    def source(block):
        calls.append(1)
        return block

    x = data((10, 8), "float32", 0)
    r = data((10, 8), "bfloat16", 1)
    w = data((8,), "float32", 2)
    dx = da.from_array(x, chunks=(3, 4)).map_blocks(source, dtype=x.dtype)
    dr = da.from_array(r, chunks=(5, 8))
    calls.clear()  # map_blocks ran source once on an empty array, to learn its output
    outs = ln.add_layer_norm(dx, dr, 8, w, weight_offset=1.0, quantize="int8",
                             return_stats=True)
    assert not calls and all(isinstance(o, da.Array) for o in outs)
    want = ln.add_layer_norm(x, r, 8, w, weight_offset=1.0, quantize="int8",
                             return_stats=True)
    for got, ref in zip(outs, want, strict=True):
        assert_bitwise(got.compute(), ref)
    y = ln.rms_norm(dx, weight=w, weight_offset=1.0)
    assert_bitwise(y.compute(), ln.rms_norm(x, weight=w, weight_offset=1.0))
    _, rstd = ln.rms_norm(x, weight=w, return_stats=True)
    grads = ln.rms_norm_backward(dx, dx, rstd, w, weight_offset=1.0, grad_residual=dx)
    want = ln.rms_norm_backward(x, x, rstd, w, weight_offset=1.0, grad_residual=x)
    assert_bitwise(grads[0].compute(), want[0])
    np.testing.assert_allclose(grads[1].compute(), want[1], rtol=1e-5)
    with pytest.raises(TypeError, match="residual_out= is not supported for Dask"):
        ln.add_rms_norm(dx, dx, residual_out=x)
    with pytest.raises(ValueError, match="weight_offset"):
        ln.add_rms_norm(dx, dx, weight_offset=1.0)
    with pytest.raises(ValueError, match="scale= is only used with quantize="):
        ln.layer_norm(dx, scale=2.0)


# --------------------------------------------------------------------------- array API


def test_array_api_strict():
    xs = pytest.importorskip("array_api_strict")
    x = data((4, 16), "float32", 0)
    r = data((4, 16), "float32", 1)
    w = data((16,), "float32", 2)
    X, R, W = xs.asarray(x), xs.asarray(r), xs.asarray(w)
    y, h, s, _rstd = ln.add_rms_norm(X, R, 16, W, weight_offset=1.0, quantize="int8",
                                    return_stats=True)
    ny, nh, ns, nrstd = ln.add_rms_norm(x, r, 16, w, weight_offset=1.0, quantize="int8",
                                        return_stats=True)
    assert y.dtype == xs.int8 and h.dtype == xs.float32
    assert_bitwise(np.asarray(h), nh)
    assert np.abs(np.asarray(y).astype(int) - ny.astype(int)).max() <= 1
    np.testing.assert_allclose(np.asarray(s), ns, rtol=1e-5)
    gx, _gw = ln.rms_norm_backward(X, X, xs.asarray(nrstd), W, weight_offset=1.0,
                                  grad_residual=R)
    ngx, _ngw = ln.rms_norm_backward(x, x, nrstd, w, weight_offset=1.0, grad_residual=r)
    np.testing.assert_allclose(np.asarray(gx), ngx, rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="array_api_strict has no float8_e4m3fn dtype"):
        ln.layer_norm(X, quantize="float8_e4m3fn")


def test_jax_float8():
    jnp = pytest.importorskip("jax.numpy")
    x = data((3, 16), "float32", 0)
    q, _s = ln.layer_norm(jnp.asarray(x), quantize="float8_e4m3fn")
    nq, _ns = ln.layer_norm(x, quantize="float8_e4m3fn")
    assert str(q.dtype) == "float8_e4m3fn"
    diff = np.abs(np.asarray(q).astype(np.float32) - nq.astype(np.float32))
    assert (diff <= np.abs(nq.astype(np.float32)) * 2.0**-3 + 2.0**-6).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_float64_quantize_rounds_once(fmt):
    torch = pytest.importorskip("torch")
    x = data((3, 40), "float64", 5, 4.0)
    q, s = ln.rms_norm(torch.from_numpy(x), quantize=fmt)
    nq, ns = ln.rms_norm(x, quantize=fmt)
    np.testing.assert_array_equal(q.view(torch.int8).numpy(), nq.view(np.int8))
    np.testing.assert_array_equal(s.numpy(), ns)


def test_torch_in_place_and_grad_errors():
    torch = pytest.importorskip("torch")
    x0 = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    r0 = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    y_ref, h_ref = ln.add_layer_norm(x0, r0)
    x, r = x0.clone(), r0.clone()
    y, h = ln.add_layer_norm(x, r, out=x, residual_out=r)
    assert y is x and h is r
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    x, r = x0.clone(), r0.clone()
    y, h = ln.add_rms_norm(x, r, out=r, residual_out=x)
    assert torch.equal(h, x0 + r0) and torch.equal(y, ln.rms_norm(x0 + r0))
    xg = x0.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="residual_out= does not support automatic"):
        ln.add_layer_norm(xg, r0, residual_out=r0.clone())
    with pytest.raises(RuntimeError, match="out= does not support automatic"):
        ln.add_layer_norm(xg, r0, out=torch.empty(3, 8))
    with pytest.raises(ValueError, match="out and residual_out share memory"):
        ln.add_layer_norm(x0, r0, out=x, residual_out=x)
    buf0 = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    for swap in (False, True):  # the two halves of each row of one tensor
        buf = buf0.clone()
        x, r = buf[:, :8], buf[:, 8:]
        y_ref, h_ref = ln.add_rms_norm(x.clone(), r.clone())
        out, residual_out = (r, x) if swap else (x, r)
        y, h = ln.add_rms_norm(x, r, out=out, residual_out=residual_out)
        assert y is out and h is residual_out
        assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
        with pytest.raises(ValueError, match="out and residual_out share memory"):
            ln.add_rms_norm(buf0[:, :8], buf0[:, 8:], out=buf[:, :8], residual_out=buf[:, 4:12])


# The quantizing one-pass kernels (Numba): rows normalized into float32 scratch, then
# quantized from the cache. The expected values are the test's own quantization (qref)
# of the unfused float32 output.

KERNEL_DTYPES = [("float32", "float32", "float32"), ("bfloat16", "bfloat16", "bfloat16"),
                 ("float16", "float32", "float32")]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_quantize_kernel_is_the_composition(rms, add, fmt, static):
    # Row lengths around a vector (16 lanes), blocks of rows (BLOCK_ELEMENTS) apart, and
    # on each row path (LayerNorm: short rows, pipelined rows, rows one by one).
    # Rows with 12 KiB of weight or more (LayerNorm: 8 KiB, so 2100 too) in tiles over
    # blocks of 8 rows (a partial last block, a vector tail).
    for (xd, rd, hd), (rows, n) in zip(KERNEL_DTYPES * 4, [(3, 1), (5, 15), (70, 300),
                                                          (9, 16), (4, 17), (2, 2100),
                                                          (90, 200), (3, 256), (3, 257),
                                                          (11, 3075), (9, 4096), (3, 8200)],
                                       strict=True):
        x = data((rows, n), xd, 0, 3.0)
        x[0, n // 2] = np.nan if rows > 2 else x[0, n // 2]
        x[rows - 1] = 0.25  # a constant row: y32 = bias (or 0: scale 1)
        r = data((rows, n), rd, 1)
        w = data((n,), "float32", 2)
        b = data((n,), "float32", 3)
        scale = data((rows, 1), "float32", 4) ** 2 + 0.01 if static else None
        params = {"weight": w} if rms else {"weight": w, "bias": b}
        with quantized_calls(strict=True) as calls:
            if add:
                fn = ln.add_rms_norm if rms else ln.add_layer_norm
                got = fn(x, r, quantize=fmt, scale=scale, residual_dtype=hd,
                         return_stats=True, **params)
                y, h, s, *stats = got
            else:
                fn = ln.rms_norm if rms else ln.layer_norm
                y, s, *stats = fn(x, quantize=fmt, scale=scale, return_stats=True, **params)
        assert calls == [fmt]
        base = x
        if add:
            base = (x.astype(np.float32) + r.astype(np.float32)).astype(DT[hd])
            assert_bitwise(h, base)
        norm = ln.rms_norm if rms else ln.layer_norm
        y32, *stats_ref = norm(base.astype(np.float32), return_stats=True, **params)
        q_ref, s_ref = qref(y32, fmt, scale)
        assert_bitwise(y, q_ref)
        if static:
            assert s is scale
        else:
            assert_bitwise(s, s_ref)
        for got_stat, want in zip(stats, stats_ref, strict=True):
            assert_bitwise(got_stat, want)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rms", [False, True])
def test_quantize_kernel_at_any_alignment_of_x(rms, fmt, static):
    # The row path's output passes start at x's first 64-byte boundary and take the
    # row's edges from overlapping first and last vectors: x at each offset into a
    # cache line (heads of 15, 12, 7 and 1 elements), rows pipelined (200, 300) and one
    # by one (1000, 1037), must give the composition's codes and scales.
    for rows, n in [(37, 200), (37, 300), (11, 1000), (11, 1037)]:
        x0 = data((rows, n), "float32", 5, 3.0)
        w = data((n,), "float32", 6)
        b = data((n,), "float32", 7)
        scale = data((rows, 1), "float32", 8) ** 2 + 0.01 if static else None
        params = {"weight": w} if rms else {"weight": w, "bias": b}
        fn = ln.rms_norm if rms else ln.layer_norm
        q_ref, s_ref = qref(fn(x0, **params), fmt, scale)
        for offset in (4, 16, 36, 60):
            buf = np.empty(x0.nbytes + 128, np.uint8)
            skip = (offset - buf.ctypes.data) % 64
            x = buf[skip:skip + x0.nbytes].view(np.float32).reshape(x0.shape)
            x[...] = x0
            with quantized_calls(strict=True) as calls:
                y, s = fn(x, quantize=fmt, scale=scale, **params)
            assert calls == [fmt]
            assert_bitwise(y, q_ref)
            if not static:
                assert_bitwise(s, s_ref)


@pytest.mark.parametrize("shape", [(300, 1000), (700, 200), (40, 4100)])  # by row, pipelined, tiled
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_kernel_serial_and_parallel_agree(fmt, shape):
    numba = pytest.importorskip("numba")
    x = data(shape, "float32", 0)  # above PARALLEL_MIN_ELEMENTS; a partial vector
    r = data(shape, "float32", 1)
    threads = numba.get_num_threads()
    got = []
    try:
        for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(t)
            with quantized_calls(strict=True):
                got.append(ln.add_layer_norm(x, r, quantize=fmt))
    finally:
        numba.set_num_threads(threads)
    q_ref, s_ref = qref(ln.layer_norm(x + r), fmt)
    for y, h, s in got:
        assert_bitwise(h, x + r)
        assert_bitwise(y, q_ref)
        assert_bitwise(s, s_ref)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rms", [False, True])
def test_quantize_short_path_is_the_composition(rms, fmt):
    # Repeated small float32 calls take the short path (layernorm._fast): planned on the
    # first call, the kernel called directly after. Trailing axes of several shapes,
    # short and long rows, one call large enough for the parallel choice, with and
    # without out= and statistics, dynamic and static scales.
    from layernorm import _fast
    from layernorm._backends import _numba as backend

    def general(*args):
        raise AssertionError("the general path, not the short path")

    for shape, ns in [((33, 300), None), ((4, 5, 48), 48), ((2, 3, 40), (3, 40)),
                      ((130, 600), None)]:
        x = data(shape, "float32", 0, 3.0)
        x.reshape(-1, x.shape[-1])[1] = 0.5  # a constant row
        x.reshape(-1, x.shape[-1])[2, 3] = np.nan
        pshape = x.shape[-1:] if not isinstance(ns, tuple) else ns
        params = {"weight": data(pshape, "float32", 2)}
        if not rms:
            params["bias"] = data(pshape, "float32", 3)
        norm = ln.rms_norm if rms else ln.layer_norm
        y32, *stats_ref = norm(x, ns, return_stats=True, **params)
        n = int(np.prod(pshape))
        stats_shape = stats_ref[0].shape
        for scale in (None, 0.02):
            q_ref, s_ref = qref(y32.reshape(-1, n), fmt, scale)
            q_ref = q_ref.reshape(shape)
            out = np.empty(shape, q_ref.dtype)
            for k in range(3):
                with quantized_calls(strict=True) as calls, pytest.MonkeyPatch.context() as mp:
                    mp.setattr(backend, "quantized_forward", general)
                    got = norm(x, ns, quantize=fmt, scale=scale, return_stats=k == 2,
                               out=out if k == 1 else None, **params)
                assert calls == [fmt]
                assert_bitwise(got[0], q_ref)
                if scale is None:
                    assert_bitwise(got[1], s_ref.reshape(stats_shape))
                else:
                    assert got[1] is scale
                if k == 1:
                    assert got[0] is out
                if k == 2:
                    for got_stat, want in zip(got[2:], stats_ref, strict=True):
                        assert_bitwise(got_stat, want)
        assert any(isinstance(p, _fast.QuantPlan) and p.rows * p.n == x.size
                   for p in _fast._PLANS.values())
    with pytest.raises(ValueError, match="quantized dtype"):
        norm(x, quantize=fmt, out=np.empty(x.shape, np.float32), **params)
    with pytest.raises(ValueError, match="scale must be positive"):
        norm(x, quantize=fmt, scale=-1.0, **params)


@pytest.mark.parametrize("magnitude", sorted(OUT_OF_RANGE))
@pytest.mark.parametrize("shape", [(4, 300), (37, 64), (3000, 48), (12, 3072)])
def test_quantize_kernel_rows_whose_squares_overflow(shape, magnitude):
    # Overflowing (or, with eps = 0, underflowing) rows (see rescale.py) among ordinary
    # ones, in every block: the kernel stops before such a row and the driver finishes
    # the block (from h with a residual, here written over x itself); long rows, short
    # rows, enough rows for the parallel kernels; dynamic and static scales.
    factor, eps_kwargs = OUT_OF_RANGE[magnitude]
    x = data(shape, "float32", 0)
    r = data(shape, "float32", 1)
    x[1::3] *= factor
    r[1::3] *= factor
    scale = np.float32(0.03)
    for rms, add, static in itertools.product((False, True), repeat=3):
        base = x + r if add else x
        y32 = (ln.rms_norm if rms else ln.layer_norm)(base, **eps_kwargs)
        assert np.isfinite(y32).all()
        q_ref, s_ref = qref(y32, "int8", scale if static else None)
        kwargs = {"quantize": "int8", "scale": scale if static else None, **eps_kwargs}
        with quantized_calls(strict=True) as calls:
            if add:
                xi = x.copy()
                fn = ln.add_rms_norm if rms else ln.add_layer_norm
                q, h, s = fn(xi, r, residual_out=xi, **kwargs)
                assert h is xi
                assert_bitwise(xi, base)
            else:
                q, s = (ln.rms_norm if rms else ln.layer_norm)(x, **kwargs)
        assert calls == ["int8"]
        assert_bitwise(q, q_ref)
        if static:
            assert s is scale
        else:
            assert_bitwise(s, s_ref)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_quantize_kernel_float8_codes_of_every_kind_of_value(fmt):
    # y32 = bias exactly: LayerNorm of +-1 rows (mean 0, var 1, eps 0) with weight 0. The
    # bias runs over random bit patterns (saturated by the quantizer, NaN kept), the
    # subnormal range and its boundaries, ties between neighbours and signed zeros.
    qmax = np.float32(QMAX[fmt])
    rng = np.random.default_rng(7)
    table = np.arange(256, dtype=np.uint8).view(FP8[fmt]).astype(np.float32)
    finite = np.sort(table[np.isfinite(table)])
    ties = (finite[1:] + finite[:-1]) / 2  # exact in float32
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)),
                           np.nextafter(ties, np.float32(-np.inf))])
    randoms = rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    tiny = rng.random(1 << 14, dtype=np.float32) * np.float32(2.0**-5)
    values = np.concatenate([randoms.view(np.float32), tiny, -tiny, ties, near, finite,
                             np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan])])
    values = values.astype(np.float32)
    n = values.size + values.size % 2
    values = np.resize(values, n).astype(np.float32)
    x = np.tile(np.float32([1.0, -1.0]), n // 2)[None, :]
    with quantized_calls(strict=True):
        q, _ = ln.layer_norm(x, weight=np.zeros(n, np.float32), bias=values, eps=0.0,
                             quantize=fmt, scale=1.0)
    y32 = ln.layer_norm(x, weight=np.zeros(n, np.float32), bias=values, eps=0.0)[0]
    np.testing.assert_array_equal(y32, values)  # up to the sign of a zero sum
    want = np.where(y32 > qmax, qmax, np.where(y32 < -qmax, -qmax, y32))
    assert_bitwise(q[0], want.astype(np.float32).astype(FP8[fmt]))


def test_quantize_kernel_int8_ties_saturation_and_nan():
    values = np.float32([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, 1e30, -128.5, -1e30,
                         np.nan, np.inf, -np.inf, -0.0, 3.4999998, 2**-140, -127.5, -129.0,
                         128.0, -2.0**31, 2.0**31, -3e9, 3e9, 127.49999, -128.49998, 0.49999997])
    n = values.size + 1
    values = np.resize(values, n).astype(np.float32)
    x = np.tile(np.float32([1.0, -1.0]), n // 2)[None, :]
    with quantized_calls(strict=True):
        q, _ = ln.layer_norm(x, weight=np.zeros(n, np.float32), bias=values, eps=0.0,
                             quantize="int8", scale=1.0)
    y32 = ln.layer_norm(x, weight=np.zeros(n, np.float32), bias=values, eps=0.0)[0]
    np.testing.assert_array_equal(y32, values)
    want = np.clip(np.rint(np.where(np.isnan(y32), 0, y32)), -128, 127)
    assert_bitwise(q[0], want.astype(np.int8))


@pytest.mark.parametrize("gain", [1.0, 3e30, 1e-38, 2e-41, 1e-44, 0.0])
@pytest.mark.parametrize("rms", [False, True])
def test_quantize_kernel_int8_dynamic_scales_of_every_size(rms, gain):
    # A row's int8 codes take a shorter store when its inverse scale is positive and
    # finite (no NaN lane, none past qmax by more than rounding): gains that make the
    # rows' scales normal, huge, subnormal (1e-38, 2e-41) and zero by underflow (1e-44:
    # the inverse is infinite) must give the contract's codes, as must rows whose amax
    # is NaN or infinite (an inverse of NaN or 0) and an all-zero row, on every row
    # path (short, pipelined, one by one, tiled).
    for rows, n in [(40, 64), (40, 300), (6, 2100), (6, 5000)]:
        x = data((rows, n), "float32", 5, 2.0)
        x[1, 3] = np.nan
        x[2, 5] = np.inf
        x[3] = 0.0
        x[4, 0] = -1e4
        w = np.abs(data((n,), "float32", 6)) * np.float32(gain) + np.float32(gain)
        params = {"weight": w} if rms else {"weight": w, "bias": np.zeros(n, np.float32)}
        norm = ln.rms_norm if rms else ln.layer_norm
        with quantized_calls(strict=True):
            q, s = norm(x, quantize="int8", **params)
        y32 = norm(x, **params)
        with np.errstate(all="ignore"):
            q_ref, s_ref = qref(y32, "int8")
        assert_bitwise(q, q_ref)
        assert_bitwise(s, s_ref)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("count", [16, 5, 1])
def test_group_scales_are_each_rows_own(fmt, count):
    # Short LayerNorm rows get their per-row scales sixteen rows at a time
    # (quantized.group_inverses): each row's largest |y32| folded into one lane, the
    # contract's divisions done once for all lanes. Rows whose maximum is zero (scale
    # 1), subnormal (amax / qmax rounds to 0: inverse inf), infinite, NaN, ordinary;
    # a partial group writes only its own rows.
    import numba

    from layernorm._backends._numba import quantized
    from layernorm._backends._numba._simd import raw

    @numba.njit
    def scales(tops, count, fmt, scale_out, invs):
        quantized.group_inverses(raw(tops), count, 2, fmt, scale_out, invs)

    rng = np.random.default_rng(count)
    y = (rng.standard_normal((16, 16)) * 10.0 ** rng.integers(-3, 4, (16, 1))).astype(
        np.float32)
    y[0] = 0.0
    y[1] = -0.0
    y[2, :] = 0.0
    y[2, 5] = np.float32(1e-45)
    y[3, 7] = -np.inf
    y[4, 9] = np.nan
    y[5, :] = np.float32(-3e-39)
    y[6, 0] = np.float32(3.4e38)
    y = y[rng.permutation(16)]
    tops = (y.view(np.uint32) & np.uint32(0x7FFFFFFF)).view(np.float32)  # vabsmax lanes
    scale_out = np.full(2 + 16, 7.0, np.float32)
    invs = np.full(16, 7.0, np.float32)
    scales(tops, count, quantized.FORMAT_TAGS[fmt], scale_out, invs)
    amax = np.abs(y).max(axis=1)  # NaN wherever a row holds one
    want = np.where(amax == 0, np.float32(1.0), amax / np.float32(QMAX[fmt]))
    want = want.astype(np.float32)
    np.testing.assert_array_equal(scale_out[2:2 + count], want[:count])
    with np.errstate(divide="ignore", over="ignore"):  # 1 / 0 and 1 / subnormal
        np.testing.assert_array_equal(invs[:count], np.float32(1.0) / want[:count])
    assert (scale_out[:2] == 7.0).all() and (scale_out[2 + count:] == 7.0).all()
    assert (invs[count:] == 7.0).all()


@pytest.mark.parametrize("case", ["codes over x", "float64", "columns"])
def test_quantize_kernel_leaves_other_calls_to_the_composition(case):
    x = data((6, 32), "float32", 0)
    if case == "columns":  # normalized (and quantized) down each column
        want_q, want_s = (a.T for a in qref(ln.layer_norm(x, axis=0).T, "int8"))
    else:
        want_q, want_s = qref(ln.layer_norm(x.astype(np.float64) if case == "float64" else x),
                              "int8")
    kwargs = {}
    if case == "codes over x":  # the codes would overwrite rows not yet read
        buf = x.copy()
        x, kwargs["out"] = buf, buf.view(np.int8)[:, 64:96]
        want = x.copy()
        want_q, want_s = qref(ln.layer_norm(want), "int8")
    elif case == "float64":
        x = x.astype(np.float64)
    else:
        kwargs["axis"] = 0
    with quantized_calls() as calls:
        q, s = ln.layer_norm(x, quantize="int8", **kwargs)
    assert not calls
    assert_bitwise(q, want_q)
    assert_bitwise(s, want_s)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("pipelined", [True, False, "tiled"])
@pytest.mark.parametrize("rms", [False, True])
def test_quantize_row_path_y32_is_the_plain_forward(rms, pipelined, fmt):
    # The quantizing row path computes y32 in its own output pass (quantized.py), which
    # must be bit for bit the plain forward's: every kind of row (ordinary, constant,
    # NaN, cancelling with an outlying first element so the statistics are redone, and
    # a finite row whose squares overflow, where the rows stop), with a vector tail;
    # with the output pass a row behind the statistics (pipelined), right after them,
    # and in column tiles over the rows (tiled, here tiles of a 300-element row); a
    # per-row scale's codes after each row (int8) or after the block's rows (float8,
    # pipelined).
    numba = pytest.importorskip("numba")
    from layernorm._backends._numba import quantized as qz
    from layernorm._backends._numba import rowmath
    from layernorm._backends._numba._simd import raw

    lag = {True: qz.PIPELINED, False: qz.ROW_BY_ROW, "tiled": qz.TILED}[pipelined]
    rows, n = 6, 300
    x = data((rows, n), "float32", 0, 3.0)
    x[1] = np.float32(0.75)
    x[2, 17] = np.nan
    x[3] = np.float32(1e4) + data((n,), "float32", 5)
    x[3, 0] = np.float32(1.2e4)
    x[5] *= np.float32(1e19)
    w = data((n,), "float32", 2)
    b = data((n,), "float32", 3)
    eps = np.float32(1e-5)
    pad = -(-n // rowmath.LANES) * rowmath.LANES

    @numba.njit
    def run(x, w, b, tab, eps, q, fmt, dynamic, inv, scale, mean, rstd, bufs, lag):
        if rms:
            return qz.rms_quant_rows_by(raw(x), raw(w), eps, x.shape[1], rstd, q, fmt,
                                        dynamic, inv, scale, bufs, 0, x.shape[0], lag)
        return qz.ln_quant_rows_by(raw(x), raw(w), raw(b), raw(tab), eps, x.shape[1], mean,
                                   rstd, q, fmt, dynamic, inv, scale, bufs, 0, x.shape[0],
                                   lag)

    ref_fn = ln.rms_norm if rms else ln.layer_norm
    params = {"weight": w} if rms else {"weight": w, "bias": b}
    y_ref, *stats_ref = ref_fn(x[:5], eps=float(eps), return_stats=True, **params)
    tab = rowmath.merge_table(n, np.dtype(np.float32))
    for dynamic in (qz.DYNAMIC, qz.STATIC):
        bufs = (np.zeros((rows, pad), np.float32), np.zeros((1, rowmath.LANES), np.float32),
                np.empty((1, rowmath.LANES), np.uint8), np.empty(rows, np.float32))
        q = np.zeros((rows, n), np.uint8)
        mean, rstd = np.empty(rows, np.float32), np.empty(rows, np.float32)
        scale = np.empty(rows, np.float32)
        inv = np.full(rows, np.float32(1 / 0.04), np.float32)
        stop = run(x, w, b, tab, eps, q, qz.FORMAT_TAGS[fmt], dynamic, inv, scale, mean,
                   rstd, bufs, lag)
        assert stop == 5  # stopped before the overflowing row
        want_q, want_s = qref(y_ref, fmt, None if dynamic else np.float32(0.04))
        assert_bitwise(q[:5], want_q.view(np.uint8))
        if dynamic:
            # Tiled, and pipelined float8, the block's rows stay in the buffer;
            # otherwise its first row holds the last row done.
            block = pipelined == "tiled" or (pipelined is True and fmt != "int8")
            got_y = bufs[0][:5, :n] if block else bufs[0][:1, :n]
            assert_bitwise(got_y, y_ref if block else y_ref[4:5])
            assert not bufs[0][:, n:].any()  # the padding stays zero
            assert_bitwise(scale[:5], want_s[:, 0])
        assert_bitwise(rstd[:5], stats_ref[-1].reshape(-1))
        if not rms:
            assert_bitwise(mean[:5], stats_ref[0].reshape(-1))


# --------------------------------------------------------------------------- composed blocks


def _blocked_and_whole(monkeypatch, call):
    """``call()`` composed in blocks of a few samples and whole (one block)."""
    from layernorm import _engine

    calls = []
    composed = _engine._composed

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return composed(*args, **kwargs)

    monkeypatch.setattr(_engine, "_composed", counted)
    monkeypatch.setattr(_engine, "COMPOSE_BLOCK_BYTES", 1 << 40)
    whole = call()
    assert len(calls) == 1  # the call is composed, in one block
    monkeypatch.setattr(_engine, "COMPOSE_BLOCK_BYTES", 200)
    blocked = call()
    assert len(calls) > 3  # then in several
    return blocked, whole


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["float64", "fortran", "channels_first", "per_row_scale",
                                  "broadcast_scale", "out", "add_float16_h"])
def test_composed_blocks_are_the_whole_composition(monkeypatch, case, fmt):
    # A composed forward goes block of samples by block of samples (bounded memory);
    # every result must be bit for bit the whole array's composition, and the codes
    # the contract's formula of the float64 / float32 output.
    wide = case in ("float64", "per_row_scale", "broadcast_scale")
    x = data((7, 5, 24), "float64" if wide else "float32", 3, 2.0)
    x[1, 2] = 0.0  # an all-zero row: scale 1
    w = data((24,), "float32", 4)
    kw = {"return_stats": True}
    if case in ("fortran", "out", "add_float16_h"):
        x = np.asfortranarray(x.reshape(35, 24))  # rows the kernels do not take
    if case == "channels_first":
        x = np.ascontiguousarray(np.moveaxis(x, 2, 1))  # (7, 24, 5), normalized axis 1

        def call():
            return ln.layer_norm(x, axis=1, weight=w, quantize=fmt, **kw)
    elif case in ("per_row_scale", "broadcast_scale"):
        # a static scale per row, sliced with the blocks, or one broadcast over them
        shape = (7, 5, 1) if case == "per_row_scale" else (5, 1)
        scale = data(shape, "float32", 5, 1.0) ** 2 + 0.01

        def call():
            return ln.rms_norm(x, weight=w, quantize=fmt, scale=scale, **kw)
    elif case == "out":
        target = {"int8": np.int8, **FP8}[fmt]

        def call():
            out = np.full(x.shape, 3, dtype=target)
            res = ln.layer_norm(x, weight=w, quantize=fmt, out=out, **kw)
            assert res[0] is out
            return res
    elif case == "add_float16_h":
        r = np.asfortranarray(data(x.shape, "float32", 6))

        def call():
            # h in float16: x's float32 output is composed from it (another dtype)
            return ln.add_layer_norm(x, r, 24, w, residual_dtype="float16", **kw)
    else:
        def call():
            return ln.layer_norm(x, weight=w, quantize=fmt, **kw)
    blocked, whole = _blocked_and_whole(monkeypatch, call)
    assert len(blocked) == len(whole)
    for got, want in zip(blocked, whole, strict=True):
        if isinstance(want, np.ndarray):
            assert got.flags.c_contiguous
            assert_bitwise(got, want)
        else:
            assert got is want  # a static scale, returned as passed
    if case in ("float64", "fortran"):
        q, s = blocked[0], blocked[1]
        q_ref, s_ref = qref(ln.layer_norm(np.ascontiguousarray(x), weight=w), fmt)
        assert_bitwise(s, s_ref)
        assert_bitwise(q, q_ref)


def test_composed_torch_calls_are_not_blocked(monkeypatch):
    # torch compositions run whole: under torch.func.vmap a batched block cannot be
    # copied into an unbatched output (a blocked composition raised there), and blocks
    # would be separate autograd nodes.
    torch = pytest.importorskip("torch")
    from layernorm import _engine

    monkeypatch.setattr(_engine, "COMPOSE_BLOCK_BYTES", 100)
    x = torch.from_numpy(data((3, 9, 40), "float64", 7, 2.0))
    got = torch.func.vmap(lambda a: ln.layer_norm(a, (40,), quantize="int8")[0])(x)
    want = torch.stack([ln.layer_norm(a, (40,), quantize="int8")[0] for a in x])
    assert torch.equal(got, want)
    h = torch.from_numpy(data((3, 9, 40), "float32", 8)).to(torch.bfloat16)
    r = torch.from_numpy(data((3, 9, 40), "float32", 9))
    got = torch.func.vmap(lambda a, c: ln.add_layer_norm(a, c, (40,),
                                                         residual_dtype="float32")[0])(h, r)
    want = torch.stack([ln.add_layer_norm(a, c, (40,), residual_dtype="float32")[0]
                        for a, c in zip(h, r, strict=True)])
    assert torch.equal(got, want)
    # transposed: composed, whole, the same bits as NumPy's blocked composition
    xt = torch.from_numpy(data((9, 40), "float64", 10)).T
    q, s = ln.rms_norm(xt, 9, quantize="int8")
    qn, sn = ln.rms_norm(xt.numpy(), 9, quantize="int8")
    np.testing.assert_array_equal(q.numpy(), qn)
    np.testing.assert_array_equal(s.numpy(), sn)


def test_composed_quantize_memory_is_bounded(monkeypatch):
    # A float64 x quantized whole held five arrays of x's size; in blocks its peak is
    # the int8 output (an eighth of x) plus a few blocks.
    import tracemalloc

    from layernorm import _engine

    x = data((2048, 1024), "float64", 9)  # 16 MiB, four blocks
    ln.layer_norm(x[:64], quantize="int8")  # compile outside the measurement

    def peak_of_call():
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            q, _ = ln.layer_norm(x, quantize="int8")
            return tracemalloc.get_traced_memory()[1] - base, q
        finally:
            tracemalloc.stop()

    # The least of three calls: traced allocations of another thread (a kernel that a
    # call of this size compiles in the background, see README) count in a call's peak.
    blocked, q = min((peak_of_call() for _ in range(3)), key=lambda pair: pair[0])
    monkeypatch.setattr(_engine, "COMPOSE_BLOCK_BYTES", 1 << 40)
    whole, q_whole = peak_of_call()
    assert_bitwise(q, q_whole)
    assert blocked < x.nbytes / 8 + 8 * (4 << 20), (blocked, x.nbytes)
    assert blocked < whole / 2, (blocked, whole)
