"""The short path for repeated NumPy backward calls (``layernorm._fast_backward``).

It must give exactly the general path's bits, dtypes and shapes (``backend="numba"``
always takes the general path), never modify an input, and leave every call it does not
plan (other layouts, dtypes, arguments) and every invalid call to the general path,
which raises the same errors as before.
"""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln
from layernorm import _engine, _fast_backward, _plans
from layernorm._backends import _numba
from layernorm._backends._numba import entry as kernel_entry

from .conftest import DTYPES, random_rows

SHAPES = [(1, 768), (3, 5, 64), (161, 768), (2, 4096), (7, 100), (33,)]


@pytest.fixture
def general_calls(monkeypatch):
    """Counts the calls that reach the general path (:func:`layernorm._engine.gradients`)."""
    calls = []
    real = _engine.gradients

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(_engine, "gradients", spy)
    return calls


def _inputs(rng, shape, dtype, weighted, rms, param_dtype=None):
    """A backward call's arguments: x, grad_y, the forward's statistics and a weight."""
    x = random_rows(rng, shape, dtype, loc=2.0)
    grad_y = random_rows(rng, shape, dtype)
    acc = np.float64 if dtype == "float64" else np.float32
    w = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(param_dtype or acc) \
        if weighted else None
    if rms:
        _, rstd = ln.rms_norm(x, weight=w, return_stats=True)
        return x, grad_y, (rstd,), w
    _, mean, rstd = ln.layer_norm(x, weight=w, return_stats=True)
    return x, grad_y, (mean, rstd), w


def _backward(rms, grad_y, x, stats, w, **kwargs):
    if rms:
        return ln.rms_norm_backward(grad_y, x, *stats, w, **kwargs)
    return ln.layer_norm_backward(grad_y, x, *stats, w, **kwargs)


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is np.ndarray
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(np.ascontiguousarray(g).view(np.uint8),
                              np.ascontiguousarray(w).view(np.uint8))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_short_path_matches_the_general_path_bitwise(general_calls, shape, dtype, weighted,
                                                     rms):
    rng = np.random.default_rng(sum(shape) + 7 * rms + 3 * weighted)
    x, grad_y, stats, w = _inputs(rng, shape, dtype, weighted, rms)
    inputs = [a for a in (x, grad_y, *stats, w) if a is not None]
    before = [a.copy() for a in inputs]
    for _ in range(3):  # the first call plans, later ones run the compiled entry point
        fast = _backward(rms, grad_y, x, stats, w)
    assert not general_calls
    general = _backward(rms, grad_y, x, stats, w, backend="numba")
    assert len(general_calls) == 1
    _assert_same(fast, general)
    n = shape[-1]
    assert all(g.shape == (n,) for g in fast[1:])
    assert all(g.dtype == (x if w is None else w).dtype for g in fast[1:])
    for a, b in zip(inputs, before, strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize(("normalized_shape", "axis"), [((3, 40), None), (None, (-2, -1)),
                                                        (None, (1, 2))])
def test_several_trailing_axes_take_the_short_path(general_calls, rms, normalized_shape, axis):
    rng = np.random.default_rng(11)
    x = random_rows(rng, (2, 3, 40), "float32", loc=1.0)
    grad_y = random_rows(rng, x.shape, "float32")
    w = (1.0 + 0.5 * rng.standard_normal((3, 40))).astype(np.float32)
    kw = {"normalized_shape": normalized_shape, "axis": axis}
    if rms:
        stats = ln.rms_norm(x, weight=w, return_stats=True, **kw)[1:]
    else:
        stats = ln.layer_norm(x, weight=w, return_stats=True, **kw)[1:]
    for _ in range(2):
        fast = _backward(rms, grad_y, x, stats, w, **kw)
    assert not general_calls
    _assert_same(fast, _backward(rms, grad_y, x, stats, w, backend="numba", **kw))
    assert all(g.shape == (3, 40) for g in fast[1:])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rms", [False, True])
def test_grad_residual_is_fused_like_the_general_path(general_calls, dtype, rms):
    rng = np.random.default_rng(12)
    x, grad_y, stats, w = _inputs(rng, (5, 96), dtype, True, rms)
    grad_residual = random_rows(rng, x.shape, dtype)
    kept = grad_residual.copy()
    for _ in range(2):
        fast = _backward(rms, grad_y, x, stats, w, grad_residual=grad_residual)
    assert not general_calls
    _assert_same(fast, _backward(rms, grad_y, x, stats, w, grad_residual=grad_residual,
                                 backend="numba"))
    plain = _backward(rms, grad_y, x, stats, w)
    np.testing.assert_array_equal(fast[0], plain[0] + grad_residual)
    np.testing.assert_array_equal(grad_residual, kept)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_half_inputs_take_the_short_path(general_calls, dtype, weighted, rms):
    rng = np.random.default_rng(13)
    x, grad_y, stats, w = _inputs(rng, (4, 96), dtype, weighted, rms)
    grad_residual = random_rows(rng, x.shape, dtype)
    for _ in range(2):
        fast = _backward(rms, grad_y, x, stats, w)
        fused = _backward(rms, grad_y, x, stats, w, grad_residual=grad_residual)
    assert not general_calls
    _assert_same(fast, _backward(rms, grad_y, x, stats, w, backend="numba"))
    _assert_same(fused, _backward(rms, grad_y, x, stats, w, grad_residual=grad_residual,
                                  backend="numba"))
    assert fast[1].dtype == (DTYPES[dtype] if w is None else np.float32)


def _variants(rng, x, grad_y, stats, w):
    """Calls the short path leaves to the general path (which accepts them)."""
    wide_gy = np.repeat(grad_y, 2, axis=-1)
    yield "strided grad_y", (wide_gy[:, ::2], x, stats, w), {}
    yield "Fortran x", (grad_y, np.asfortranarray(x), stats, w), {}
    yield "float64 statistics", (grad_y, x, tuple(s.astype(np.float64) for s in stats), w), {}
    yield "float64 weight", (grad_y, x, stats, w.astype(np.float64)), {}
    yield "float16 weight", (grad_y, x, stats, w.astype(np.float16)), {}
    yield "weight_offset 0", (grad_y, x, stats, w), {"weight_offset": 0}
    yield "weight_offset", (grad_y, x, stats, w - 1), {"weight_offset": 1.0}
    yield "strided weight", (grad_y, x, stats, np.repeat(w, 2)[::2]), {}
    yield "strided grad_residual", (grad_y, x, stats, w), {
        "grad_residual": np.repeat(random_rows(rng, x.shape, "float32"), 2, axis=-1)[:, ::2]}


@pytest.mark.parametrize("rms", [False, True])
def test_unplanned_calls_take_the_general_path(general_calls, rms):
    rng = np.random.default_rng(14)
    x, grad_y, stats, w = _inputs(rng, (6, 64), "float32", True, rms)
    _backward(rms, grad_y, x, stats, w)
    _backward(rms, grad_y, x, stats, w)
    assert not general_calls
    for name, (gy, xx, st, ww), kw in _variants(rng, x, grad_y, stats, w):
        count = len(general_calls)
        got = _backward(rms, gy, xx, st, ww, **kw)
        assert len(general_calls) == count + 1, name
        _assert_same(got, _backward(rms, gy, xx, st, ww, backend="numba", **kw))


def test_axes_other_than_the_trailing_ones_are_not_planned(general_calls):
    rng = np.random.default_rng(15)
    x = random_rows(rng, (4, 6, 5), "float64")
    grad_y = random_rows(rng, x.shape, "float64")
    _, mean, rstd = ln.layer_norm(x, axis=1, return_stats=True)
    for _ in range(2):
        got = ln.layer_norm_backward(grad_y, x, mean, rstd, axis=1)
    assert len(general_calls) == 2
    assert _fast_backward._PLANS[(False, x.shape, x.dtype, None, 1, None, None)] is None
    _assert_same(got, ln.layer_norm_backward(grad_y, x, mean, rstd, axis=1, backend="numba"))


def _error(call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return info.type, str(info.value)


@pytest.mark.parametrize("rms", [False, True])
def test_invalid_calls_after_a_plan_raise_the_general_paths_errors(rms):
    rng = np.random.default_rng(16)
    x, grad_y, stats, w = _inputs(rng, (6, 64), "float32", True, rms)
    _backward(rms, grad_y, x, stats, w)
    _backward(rms, grad_y, x, stats, w)
    bad = {
        "grad_y shape": ((grad_y[:5], x, stats, w), {}),
        "grad_y dtype": ((grad_y.astype(np.float64), x, stats, w), {}),
        "grad_y int": ((grad_y.astype(np.int32), x, stats, w), {}),
        "grad_y list": ((grad_y.tolist(), x, stats, w), {}),
        "rstd shape": ((grad_y, x, (*stats[:-1], stats[-1].reshape(-1)), w), {}),
        "stats dtype": ((grad_y, x, tuple(s.astype(np.int64) for s in stats), w), {}),
        "weight shape": ((grad_y, x, stats, w[:-1]), {}),
        "weight dtype": ((grad_y, x, stats, w.astype(np.int32)), {}),
        "weight_offset": ((grad_y, x, stats, None), {"weight_offset": 1.0}),
        "grad_residual shape": ((grad_y, x, stats, w), {"grad_residual": grad_y[:5]}),
        "grad_residual dtype": ((grad_y, x, stats, w),
                                {"grad_residual": grad_y.astype(np.float64)}),
    }
    if not rms:
        bad["mean shape"] = ((grad_y, x, (stats[0][:5], stats[1]), w), {})
    for name, (args, kw) in bad.items():
        want = _error(lambda a=args, k=kw: _backward(rms, *a, backend="numba", **k))
        assert _error(lambda a=args, k=kw: _backward(rms, *a, **k)) == want, name


def test_a_planned_call_runs_the_compiled_entry_point():
    """After its first call a small plan skips Numba's type resolution."""
    rng = np.random.default_rng(17)
    x, grad_y, (mean, rstd), _ = _inputs(rng, (3, 40), "float32", False, False)
    for _ in range(2):
        ln.layer_norm_backward(grad_y, x, mean, rstd)
    plan = _fast_backward._PLANS[(False, x.shape, x.dtype, None, None, None, None)]
    assert plan is not None
    assert any(plan.run is compiled for compiled in kernel_entry.entry_points.values())


@pytest.mark.parametrize("rms", [False, True])
def test_large_calls_run_the_backends_serial_or_parallel_choice(monkeypatch, general_calls,
                                                                rms):
    rng = np.random.default_rng(18)
    rows = -(-_numba.PARALLEL_MIN_ELEMENTS // 256) + 3  # not a multiple of the row block
    x, grad_y, stats, w = _inputs(rng, (rows, 256), "float32", True, rms)
    chosen = []

    class Spy(_numba.PlannedRows):
        __slots__ = ()

        def __call__(self, *args):
            chosen.append(self.serial)
            return super().__call__(*args)

    monkeypatch.setattr(_numba, "PlannedRows", Spy)
    monkeypatch.setattr(_fast_backward, "_PLANS", {})  # the next call plans with the spy
    for _ in range(2):
        fast = _backward(rms, grad_y, x, stats, w)
    assert len(chosen) == 2 and not general_calls
    _assert_same(fast, _backward(rms, grad_y, x, stats, w, backend="numba"))


def test_a_full_memo_starts_over_instead_of_refusing_new_shapes(monkeypatch, general_calls):
    monkeypatch.setattr(_fast_backward, "_PLANS", {})
    monkeypatch.setattr(_plans, "PLANS_MAX", 4)
    rng = np.random.default_rng(19)
    for rows in range(1, 10):
        x, grad_y, (mean, rstd), _ = _inputs(rng, (rows, 8), "float32", False, False)
        ln.layer_norm_backward(grad_y, x, mean, rstd)
        assert _fast_backward._PLANS[(False, x.shape, x.dtype, None, None, None, None)]
        assert len(_fast_backward._PLANS) <= 4
    assert not general_calls


@pytest.mark.parametrize("rms", [False, True])
def test_calls_of_one_shape_and_several_dtypes_each_get_their_own_plan(rms):
    """Plans are found by shapes and checked by dtype identity: alternating dtypes of
    one shape, and a dtype equal to float32 but another object, give each the general
    path's bits."""
    rng = np.random.default_rng(32)
    native = np.dtype(np.float32).newbyteorder("=")  # equal to float32, not the same object
    cases = []
    for dtype in ("float32", "float64", native):
        x, grad_y, stats, w = _inputs(rng, (6, 80), "float32", True, rms)
        acc = np.float64 if dtype == "float64" else np.float32
        cases.append((grad_y.astype(dtype), x.astype(dtype), tuple(s.astype(acc) for s in stats),
                      w.astype(acc)))
    grad_y, x, stats, w = cases[1]
    cases.append((grad_y, x, stats, w.astype(np.float32)))  # a float32 weight
    for _ in range(3):
        for grad_y, x, stats, w in cases:
            got = _backward(rms, grad_y, x, stats, w)
            _assert_same(got, _backward(rms, grad_y, x, stats, w, backend="numba"))
            assert got[0].dtype == x.dtype
