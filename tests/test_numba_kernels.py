"""Kernel-level tests of the Numba backend: every code path gives the same bits per row.

The kernels have a vectorized row path (contiguous rows), a gather path (strided rows),
a column path vectorized over ``inner`` (channels-first), streaming stores, and serial
and parallel variants. The contract is that a row's result does not depend on which of
them computed it, so each test computes the same rows through two paths and compares
the raw bytes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import layernorm as ln
from layernorm._backends import _numba as backend

from . import reference

#: Row lengths covering: remainder only, one group, partial chunk, full chunks + tail
#: (the long-row loop overlaps a row's output with the next row's first pass chunk by
#: chunk, see forward_rows.SUMS_PER_OUTPUT_CHUNK: 200 has one full chunk, 300 two, 1000
#: seven and a tail).
SIZES = [1, 5, 16, 64, 100, 128, 200, 300, 1000]
#: Enough elements for the parallel kernels (PARALLEL_MIN_ELEMENTS) at every size.
BATCH_ELEMENTS = 1 << 17


def _rows(rows, n, seed, dtype=np.float32, offset=3.0):
    rng = np.random.default_rng(seed)
    return (offset + rng.standard_normal((rows, n))).astype(dtype)


def _params(n, seed):
    rng = np.random.default_rng(seed + 1000)
    return (rng.standard_normal(n).astype(np.float32),
            rng.standard_normal(n).astype(np.float32))


def _same_bits(a, b):
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n", SIZES)
def test_row_alone_equals_row_in_batch(n):
    rows = max(8, BATCH_ELEMENTS // n)
    x = _rows(rows, n, n)
    w, b = _params(n, n)
    y, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    yr, rr = ln.rms_norm(x, n, w, return_stats=True)
    for i in (0, rows // 2 + 1, rows - 1):
        y1, m1, r1 = ln.layer_norm(x[i : i + 1], n, w, b, return_stats=True)
        _same_bits(y1[0], y[i])
        _same_bits(m1[0], mean[i])
        _same_bits(r1[0], rstd[i])
        z1, s1 = ln.rms_norm(x[i : i + 1], n, w, return_stats=True)
        _same_bits(z1[0], yr[i])
        _same_bits(s1[0], rr[i])


@pytest.mark.parametrize("n", [5, 64, 300])
def test_strided_rows_match_contiguous(n):
    rows = 40
    base = _rows(rows, 2 * n, n)
    w, b = _params(n, n)
    for view in (base[:, ::2], base[:, ::-2], np.asfortranarray(base[:, :n])):
        dense = np.ascontiguousarray(view)
        _same_bits(ln.layer_norm(view, n, w, b), ln.layer_norm(dense, n, w, b))
        _same_bits(ln.rms_norm(view, n, w), ln.rms_norm(dense, n, w))
        # A strided output too, and the backward through the gather path.
        out = np.empty((rows, 2 * n), np.float32)[:, ::2]
        ln.layer_norm(view, n, w, b, out=out)
        _same_bits(out, ln.layer_norm(dense, n, w, b))
        gy = _rows(rows, n, n + 1)[:, ::-1]
        _, mean, rstd = ln.layer_norm(dense, n, w, b, return_stats=True)
        got = ln.layer_norm_backward(gy, view, mean, rstd, w)
        want = ln.layer_norm_backward(np.ascontiguousarray(gy), dense, mean, rstd, w)
        for g, e in zip(got, want, strict=False):
            _same_bits(g, e)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64],
                         ids=["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("n", [4, 37, 300])
def test_transposed_rows_take_the_column_path_with_the_rows_bits(monkeypatch, dtype, n):
    """Rows that are the columns of a C-ordered array (a transposed or Fortran-ordered
    x) run the column kernels on the transposed view: the bits of contiguous rows, for
    y and the statistics, with plain, rescued (squares overflowing) and cancelling
    (outlying first element) rows, into a new, a Fortran or a strided ``out``, serial
    and parallel."""
    kernels = backend.load_kernels()
    called = []
    short = n <= kernels.SHORT_COLUMN_MAX  # columns of few elements: kernels of their own
    kind = "short_cols" if short else "cols"
    for name in (f"ln_forward_{kind}_serial", f"ln_forward_{kind}_parallel",
                 f"rms_forward_{kind}_serial", f"rms_forward_{kind}_parallel"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name,
                            lambda *a, _real=real, _name=name: (called.append(_name),
                                                                _real(*a))[1])
    rows = 70
    x = _rows(rows, n, 3 * n, dtype=np.float64)
    x[5] *= 1e30  # squares overflow float32: the rescaled rows
    x[6, 0] += 1e6  # an outlying first element: the row is redone
    x = x.astype(dtype)
    w, b = _params(n, n)
    dense = np.ascontiguousarray(x)
    want = ln.layer_norm(dense, n, w, b, return_stats=True)
    want_rms = ln.rms_norm(dense, n, w, return_stats=True)
    for view in (np.asfortranarray(x), np.ascontiguousarray(x.T).T):
        called.clear()
        got = ln.layer_norm(view, n, w, b, return_stats=True)
        got_rms = ln.rms_norm(view, n, w, return_stats=True)
        assert called == [f"ln_forward_{kind}_serial", f"rms_forward_{kind}_serial"]
        for g, e in zip((*got, *got_rms), (*want, *want_rms), strict=True):
            _same_bits(g, e)
        assert got[0].flags.c_contiguous
        for out in (np.empty_like(view, order="F"), np.empty((rows, 2 * n), x.dtype)[:, ::2]):
            ln.layer_norm(view, n, w, b, out=out)
            _same_bits(out, want[0])
        # Fewer rows than a vector's lanes would be mostly padding: gathered instead.
        called.clear()
        _same_bits(ln.layer_norm(view[:5], n, w, b), want[0][:5])
        assert not called
    # The parallel kernel on the same transposed view (the driver runs it for larger x).
    monkeypatch.undo()
    bits = backend.KERNEL_BITS.get(np.dtype(dtype).name)
    xv = x.T.copy().T if bits is None else x.T.copy().T.view(bits)
    y = np.empty_like(xv)
    acc = np.float64 if dtype == np.float64 else np.float32
    mean, rstd = np.empty(rows, acc), np.empty(rows, acc)
    wa, ba = w.astype(acc), b.astype(acc)
    for kernel in ((kernels.ln_forward_cols_parallel, kernels.ln_forward_short_cols_parallel)
                   if short else (kernels.ln_forward_cols_parallel,)):
        y[...] = 0
        backend.entry.call(kernel, backend.LN_FORWARD_WRITES,
                           xv[:, :, None].transpose(2, 1, 0), wa, ba, acc(1e-5),
                           y[:, :, None].transpose(2, 1, 0), mean, rstd,
                           kernels.merge_table(n, np.dtype(acc)))
        _same_bits(y if bits is None else y.view(dtype), want[0])
        _same_bits(mean, want[1].reshape(-1))
        _same_bits(rstd, want[2].reshape(-1))


@pytest.mark.parametrize("n", [37, 300, 2100])  # 2100: rows go in pairs (PAIR_MIN_N)
def test_backward_of_transposed_rows_gives_the_rows_bits(n):
    """The any-stride backward gathers rows that are the columns of a C-ordered array
    (transposed x, grad_y or grad_residual) a column at a time: the bits of contiguous
    rows, grad_x and the parameter gradients (blocks of 64 rows, an odd last one)."""
    rows = 77
    x = _rows(rows, n, n + 7)
    x[3] *= 1e30  # squares overflow float32 (rescaled rows)
    gy = _rows(rows, n, n + 8, offset=0.5)
    gres = _rows(rows, n, n + 9, offset=-1.0)
    w, b = _params(n, n)
    _, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    _, rms_rstd = ln.rms_norm(x, n, w, return_stats=True)
    want = ln.layer_norm_backward(gy, x, mean, rstd, w, grad_residual=gres)
    want_rms = ln.rms_norm_backward(gy, x, rms_rstd, w, grad_residual=gres)

    def transposed(a):
        return np.ascontiguousarray(a.T).T

    for tx, tg, tr in ((True, False, False), (False, True, False), (True, True, True)):
        xv = transposed(x) if tx else x
        gv = transposed(gy) if tg else gy
        rv = transposed(gres) if tr else gres
        got = ln.layer_norm_backward(gv, xv, mean, rstd, w, grad_residual=rv)
        got_rms = ln.rms_norm_backward(gv, xv, rms_rstd, w, grad_residual=rv)
        for g, e in zip((*got, *got_rms), (*want, *want_rms), strict=True):
            _same_bits(g, e)


@pytest.mark.parametrize(("rows", "n"), [(3, 300_000), (40, 20_000)])
def test_long_strided_rows_gathered_in_fewer_scratch_rows(rows, n):
    """The gather path holds at most GATHER_BYTES of rows at a time (one 1.2 MB row,
    13 rows of 80 KB): the bits of contiguous rows."""
    base = _rows(rows, 2 * n, n)
    w, b = _params(n, n)
    view = base[:, ::2]
    dense = np.ascontiguousarray(view)
    for got, want in zip(ln.layer_norm(view, n, w, b, return_stats=True),
                         ln.layer_norm(dense, n, w, b, return_stats=True), strict=True):
        _same_bits(got, want)


@pytest.mark.parametrize("inner", [3, 16, 37, 150])
@pytest.mark.parametrize("n", [7, 64, 150, 700])
def test_channels_first_matches_rows(n, inner):
    outer = 3
    rng = np.random.default_rng(n * inner)
    x = (5.0 + rng.standard_normal((outer, n, inner))).astype(np.float32)
    w, b = _params(n, n)
    as_rows = np.ascontiguousarray(np.moveaxis(x, 1, -1)).reshape(-1, n)
    y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, axis=1, return_stats=True)
    yr, mr, rr = ln.layer_norm(as_rows, n, w, b, return_stats=True)
    _same_bits(np.moveaxis(y, 1, -1).reshape(-1, n), yr)
    _same_bits(mean.reshape(-1), mr.reshape(-1))
    _same_bits(rstd.reshape(-1), rr.reshape(-1))
    z, s = ln.rms_norm(x, weight=w, axis=1, return_stats=True)
    zr, sr = ln.rms_norm(as_rows, n, w, return_stats=True)
    _same_bits(np.moveaxis(z, 1, -1).reshape(-1, n), zr)
    _same_bits(s.reshape(-1), sr.reshape(-1))
    # A non-unit stride over inner takes the tile-copy path.
    wide = np.repeat(x, 2, axis=2)[:, :, ::2]
    _same_bits(ln.layer_norm(wide, weight=w, bias=b, axis=1), y)
    # Backward: grad_x per row is the row path's; the parameter gradients use other
    # (fixed) blocks, so they agree to rounding only.
    gy = rng.standard_normal(x.shape).astype(np.float32)
    gyr = np.ascontiguousarray(np.moveaxis(gy, 1, -1)).reshape(-1, n)
    gx, gw, gb = ln.layer_norm_backward(gy, x, mean, rstd, w, axis=1)
    gxr, gwr, gbr = ln.layer_norm_backward(gyr, as_rows, mr, rr, w, n)
    _same_bits(np.moveaxis(gx, 1, -1).reshape(-1, n), gxr)
    # Columns of another stride (copied by indexing, not through raw views): the same
    # bits, the parameter gradients' too (the same blocks, in the same order).
    wide_gy = np.repeat(gy, 2, axis=2)[:, :, ::2]
    for got, want in zip(ln.layer_norm_backward(wide_gy, wide, mean, rstd, w, axis=1),
                         (gx, gw, gb), strict=True):
        _same_bits(got, want)
    np.testing.assert_allclose(gw, gwr, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gb, gbr, rtol=1e-5, atol=1e-4)
    hx, hw = ln.rms_norm_backward(gy, x, s, w, axis=1)
    hxr, hwr = ln.rms_norm_backward(gyr, as_rows, sr, w, n)
    _same_bits(np.moveaxis(hx, 1, -1).reshape(-1, n), hxr)
    np.testing.assert_allclose(hw, hwr, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 15, 16])
def test_columns_of_fewer_than_lanes_rows_match_the_row_path(dtype, n):
    """Channels of fewer than LANES (16) elements take kernels of their own (the lane
    sums from registers, the cancelled columns redone in the block, overflowing and
    non-finite ones rescaled): every column must still get the row path's bits, its
    statistics too, in blocks with and without such columns, serial and parallel."""
    npdt = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
            "bfloat16": ml_dtypes.bfloat16}[dtype]
    kernels = backend.load_kernels()
    rng = np.random.default_rng(100 + n)
    inner = 16 * 9 + 5  # a partial column block and a partial tile
    x = (2.0 + rng.standard_normal((3, n, inner)) * 3).astype(npdt)
    big = 3e4 if dtype == "float16" else 1e30  # (float16 squares never overflow float32)
    if n > 1:
        x[0, 0, ::7] = (50.0 if dtype in ("float16", "bfloat16") else 1e4)  # outlying first
        x[0, :, 5] = 7.0  # a constant column
        x[1, n - 1, 20] = np.nan
        x[1, 0, 40] = np.inf
        steps = 1.0 + np.arange(n) / n
        x[2, :, 60] = big * steps  # squares overflow: rescaled
        x[2, :, 61] = big  # constant and large
        tiny = 1e-7 if dtype == "float16" else 1e-30
        x[2, :, 62] = tiny * steps  # squares underflow: with eps = 0, rescaled
    w, b = (p.astype(npdt) for p in _params(n, n))
    rows = np.ascontiguousarray(np.moveaxis(x, 1, -1)).reshape(-1, n)
    for eps in (1e-5, 0.0):
        y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, eps=eps, axis=1,
                                      return_stats=True)
        yr, mr, rr = ln.layer_norm(rows, n, w, b, eps=eps, return_stats=True)
        _same_bits(np.moveaxis(y, 1, -1).reshape(-1, n), yr)
        _same_bits(mean.reshape(-1), mr.reshape(-1))
        _same_bits(rstd.reshape(-1), rr.reshape(-1))
        z, s = ln.rms_norm(x, weight=w, eps=eps, axis=1, return_stats=True)
        zr, sr = ln.rms_norm(rows, n, w, eps=eps, return_stats=True)
        _same_bits(np.moveaxis(z, 1, -1).reshape(-1, n), zr)
        _same_bits(s.reshape(-1), sr.reshape(-1))
        if dtype == "float32" and n <= kernels.SHORT_COLUMN_MAX:
            # the parallel kernels, called directly: the same bits
            yp, mp, rp = np.zeros_like(x), np.zeros(mean.size, np.float32), np.zeros(
                mean.size, np.float32)
            backend.entry.call(kernels.ln_forward_short_cols_parallel,
                               backend.LN_FORWARD_WRITES, x, w, b, np.float32(eps), yp, mp,
                               rp, kernels.merge_table(n, np.dtype(np.float32)))
            _same_bits(yp, y)
            _same_bits(mp, mean.reshape(-1))
            _same_bits(rp, rstd.reshape(-1))
            zp, sp = np.zeros_like(x), np.zeros(mean.size, np.float32)
            backend.entry.call(kernels.rms_forward_short_cols_parallel,
                               backend.RMS_FORWARD_WRITES, x, w, np.float32(eps), zp, sp)
            _same_bits(zp, z)
            _same_bits(sp, s.reshape(-1))
        if n > 2 and dtype == "float32" and eps > 0:
            # the redone columns are accurate, not only the row path's bits
            top = np.abs(rows).max(axis=1)
            usual = np.isfinite(rows).all(axis=1) & (top < 1e20) & (top > 1e-20)
            ref = reference.layer_norm(rows[usual], (1,), w, b, eps)[0]
            np.testing.assert_allclose(yr[usual], ref, atol=2e-5 * max(1, np.abs(ref).max()))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("n", [1, 17, 64, "short_max", "short_max+1"])
def test_short_rows_in_blocks_match_the_column_path(dtype, n):
    """Short rows (LayerNorm and RMSNorm) go 16 at a time with their lane trees folded
    together; the column path runs the same arithmetic another way. Row counts cover
    partial last blocks, and constant and non-finite rows sit at several positions in a
    block."""
    short_max = backend.load_kernels().SHORT_ROW_MAX
    n = {"short_max": short_max, "short_max+1": short_max + 1}.get(n, n)
    npdt = {"float16": np.float16, "float32": np.float32, "float64": np.float64}[dtype]
    rng = np.random.default_rng(n)
    w, b = (p.astype(npdt) for p in _params(n, n))
    for rows in (1, 16, 17, 35):
        x = (4.0 + rng.standard_normal((rows, n)) * 3).astype(npdt)
        if rows > 16:
            x[3] = 2.5
            x[16, -1] = np.inf
            x[rows - 1, 0] = np.nan
        columns = np.ascontiguousarray(x.T)[None]  # (1, n, rows): normalized over axis 1
        y, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
        yc, mc, rc = ln.layer_norm(columns, weight=w, bias=b, axis=1, return_stats=True)
        _same_bits(y, yc[0].T)
        _same_bits(mean.reshape(-1), mc.reshape(-1))
        _same_bits(rstd.reshape(-1), rc.reshape(-1))
        work = x.copy()
        assert ln.layer_norm(work, n, w, b, out=work) is work  # in place
        _same_bits(work, y)
        finite = np.isfinite(x).all(axis=1)
        ref = reference.layer_norm(x[finite], (1,), w, b, 1e-5)[0].astype(np.float64)
        tol = 8 * np.finfo(npdt).eps * max(1.0, np.abs(ref).max())
        np.testing.assert_allclose(y[finite].astype(np.float64), ref, atol=tol, rtol=0)
        # RMSNorm's short rows: 16 at a time too, against its column path
        y, rstd = ln.rms_norm(x, n, w, return_stats=True)
        yc, rc = ln.rms_norm(columns, weight=w, axis=1, return_stats=True)
        _same_bits(y, yc[0].T)
        _same_bits(rstd.reshape(-1), rc.reshape(-1))
        work = x.copy()
        assert ln.rms_norm(work, n, w, out=work) is work
        _same_bits(work, y)
        ref = reference.rms_norm(x[finite], (1,), w)[0].astype(np.float64)
        tol = 8 * np.finfo(npdt).eps * max(1.0, np.abs(ref).max())
        np.testing.assert_allclose(y[finite].astype(np.float64), ref, atol=tol, rtol=0)


#: 2050: the rows written whole (SEQUENTIAL_MIN_ROW); 3075: the tiled rows
#: (TILED_MIN_BYTES, STREAM_ROWS_MAX_BYTES), in groups of TILE_ROWS with a last partial
#: tile and a tail.
@pytest.mark.parametrize("n", [1, 7, 16, 100, 129, 300, 2050, 3075])
def test_every_row_entry_kernel_gives_the_same_bits_at_any_length(n):
    """The driver picks one entry kernel per path (long rows, short rows, any stride);
    each computes every row length itself, with the same bits. The unit-stride kernels
    stop before a row whose squares overflow, unwritten, and the driver finishes the
    call through the strided-rows kernel, which rescales such rows in its loop."""
    k = backend.load_kernels()
    rows = 37
    x = _rows(rows, n, 21)
    x[5] = 2.5  # constant row
    x[9, -1] = np.nan
    x[11] = np.linspace(-3e19, 4e19, n, dtype=np.float32)  # squares overflow float32
    x[30] *= np.float32(4e19)
    w, b = _params(n, 21)
    eps = np.float32(1e-5)
    tab = k.merge_table(n, np.dtype(np.float32))
    results = []
    for fn in (k.ln_forward_serial, k.ln_short_forward_serial, k.ln_gathered_forward_serial,
               k.ln_stream_forward_serial, k.ln_seq_forward_serial, k.ln_tiled_forward_serial,
               k.ln_stream_tiled_forward_serial, k.ln_forward_parallel,
               k.ln_short_forward_parallel, k.ln_gathered_forward_parallel,
               k.ln_stream_forward_parallel, k.ln_seq_forward_parallel,
               k.ln_tiled_forward_parallel, k.ln_stream_tiled_forward_parallel):
        y = np.full_like(x, np.nan)
        mean = np.full(rows, np.nan, np.float32)
        rstd = np.full(rows, np.nan, np.float32)
        args = (x, w, b, eps, y, mean, rstd, tab, False)
        done = backend.entry.call(fn, backend.LN_FORWARD_WRITES, *args)
        if fn in (k.ln_forward_serial, k.ln_stream_forward_serial, k.ln_seq_forward_serial,
                  k.ln_tiled_forward_serial, k.ln_stream_tiled_forward_serial) and n > 1:
            # (one element has no deviation)
            assert done == 11 and np.isnan(y[11:]).all()  # stopped, rows after it not done
        if fn in (k.ln_forward_parallel, k.ln_stream_forward_parallel,
                  k.ln_seq_forward_parallel, k.ln_tiled_forward_parallel,
                  k.ln_stream_tiled_forward_parallel) and n > 1:
            # (stop, end) of the blocks that stopped, and only those: row 11's block
            assert len(done) >= 1 and done[0, 0] == 11 and (done[:, 0] < done[:, 1]).all()
        backend.complete_layer_norm_rows(done, args)
        results.append((y, mean, rstd))
    for other in results[1:]:
        for a, e in zip(other, results[0], strict=True):
            _same_bits(a, e)
    y = results[0][0]
    assert np.isfinite(y[[11, 30]]).all() and np.isnan(y[9]).all()
    good = np.ones(rows, bool)
    good[9] = False
    ref = reference.layer_norm(x[good].astype(np.float64), (1,), w, b, 1e-5)[0]
    np.testing.assert_allclose(y[good], ref, atol=2e-5 * max(1.0, np.abs(ref).max()))
    rms = []
    for fn in (k.rms_forward_serial, k.rms_short_forward_serial, k.rms_gathered_forward_serial,
               k.rms_stream_forward_serial, k.rms_seq_forward_serial,
               k.rms_tiled_forward_serial, k.rms_stream_tiled_forward_serial,
               k.rms_forward_parallel, k.rms_short_forward_parallel,
               k.rms_gathered_forward_parallel, k.rms_stream_forward_parallel,
               k.rms_seq_forward_parallel, k.rms_tiled_forward_parallel,
               k.rms_stream_tiled_forward_parallel):
        y = np.full_like(x, np.nan)
        rstd = np.full(rows, np.nan, np.float32)
        args = (x, w, eps, y, rstd, False)
        done = backend.entry.call(fn, backend.RMS_FORWARD_WRITES, *args)
        if fn in (k.rms_forward_serial, k.rms_short_forward_serial, k.rms_stream_forward_serial,
                  k.rms_seq_forward_serial, k.rms_tiled_forward_serial,
                  k.rms_stream_tiled_forward_serial):
            assert done == 11
        if fn in (k.rms_forward_parallel, k.rms_short_forward_parallel,
                  k.rms_stream_forward_parallel, k.rms_seq_forward_parallel,
                  k.rms_tiled_forward_parallel, k.rms_stream_tiled_forward_parallel):
            assert len(done) >= 1 and done[0, 0] == 11 and (done[:, 0] < done[:, 1]).all()
        backend.complete_rms_norm_rows(done, args)
        rms.append((y, rstd))
    for other in rms[1:]:
        for a, e in zip(other, rms[0], strict=True):
            _same_bits(a, e)
    assert np.isfinite(rms[0][0][[11, 30]]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_other_dtypes_paths_agree(dtype):
    npdt = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64}[dtype]
    n, rows = 100, 2000
    x = _rows(rows, n, 7, npdt)
    w, b = _params(n, 7)
    y, _mean, _rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    for i in (0, rows - 1):
        _same_bits(ln.layer_norm(x[i : i + 1], n, w, b)[0], y[i])
    x3 = np.ascontiguousarray(x.reshape(20, 100, n).transpose(0, 2, 1))  # (20, n, 100)
    y3 = ln.layer_norm(x3, weight=w, bias=b, axis=1)
    _same_bits(np.moveaxis(y3, 1, -1).reshape(-1, n), y)
    ref = x.astype(np.float64)
    m = ref.mean(-1, keepdims=True)
    want = (ref - m) / np.sqrt(((ref - m) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b
    tol = {"float16": 2e-2, "bfloat16": 1e-1, "float64": 1e-12}[dtype]
    assert np.abs(y.astype(np.float64) - want).max() <= tol


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n", [37, 300, 1100])
def test_16_bit_outputs_are_the_float32_result_rounded_to_nearest_even(dtype, n, monkeypatch):
    """Outputs are rounded once from the float32 result, exactly as ml_dtypes/NumPy round
    (to nearest even, denormals included, NaN stays NaN), in vector stores, streaming
    stores and scalar tails. A weight of about 1e-39 puts bfloat16 outputs among the
    denormals, next to normal ones in the same vectors (the AVX512-BF16 instruction, used
    where the CPU has it, flushes those to zero)."""
    npdt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    rows = 40
    x = _rows(rows, n, n, npdt)
    x[7, n // 2] = np.nan
    w, b = _params(n, n)
    tiny = {"bfloat16": 3e-39, "float16": 3e-6}[dtype]
    w[::3] *= np.float32(tiny)
    b[::3] *= np.float32(tiny)
    want = ln.layer_norm(x.astype(np.float32), n, w, b).astype(npdt)
    smallest_normal = {"bfloat16": 2.0**-126, "float16": 2.0**-14}[dtype]
    assert np.count_nonzero(np.abs(want.astype(np.float32)) < smallest_normal) > n
    got = ln.layer_norm(x, n, w, b)
    _same_bits(np.isnan(got), np.isnan(want))
    _same_bits(np.where(np.isnan(want), 0, got), np.where(np.isnan(want), 0, want))
    monkeypatch.setattr(backend, "use_streaming_stores", lambda x, y: True)
    streamed = ln.layer_norm(x, n, w, b, backend="numba")
    _same_bits(streamed, got)


@pytest.mark.parametrize("n", [1000, 3075])
def test_streaming_stores_give_same_bits(n, monkeypatch):
    """Streaming stores, row by row (1000) and in column tiles over groups of rows
    (3075: ``STREAM_ROWS_MAX_BYTES`` and ``RMS_STREAM_TILED_MIN_BYTES``; rows that
    start at different offsets within a cache line), give the plain stores' bits."""
    k = backend.load_kernels()
    tiled = 16 * n > k.STREAM_ROWS_MAX_BYTES  # float32: two rows of x, w and b
    assert tiled == (n * 4 >= k.RMS_STREAM_TILED_MIN_BYTES)
    rows = 64 if n < 2048 else 19
    x = _rows(rows, n, 3)
    w, b = _params(n, 3)
    plain = ln.layer_norm(x, n, w, b)
    plain_rms = ln.rms_norm(x, n, w)
    monkeypatch.setattr(backend, "STREAM_MIN_FRACTION", 0.0)
    monkeypatch.setattr(backend, "STREAM_MIN_ROW", 1)
    for shift in (0, 1, 5):  # misaligned outputs exercise the peeled head
        out = np.empty(rows * n + shift, np.float32)[shift:].reshape(rows, n)
        # backend= takes the general path (the short path for small calls never streams)
        ln.layer_norm(x, n, w, b, out=out, backend="numba")
        _same_bits(out, plain)
        ln.rms_norm(x, n, w, out=out, backend="numba")
        _same_bits(out, plain_rms)
    assert (backend.ln_row_kernels(k, x, out, True)[0]
            is k.ln_stream_tiled_forward_serial) == tiled
    assert (backend.rms_row_kernels(k, x, out, True)[0]
            is k.rms_stream_tiled_forward_serial) == tiled


def test_streamed_outputs_pick_their_kernels_by_row_length():
    """Large outputs (streaming stores): LayerNorm's column tiles once two rows of x, w
    and b exceed STREAM_ROWS_MAX_BYTES, RMSNorm's from RMS_STREAM_TILED_MIN_BYTES of
    weight, rows one by one below; on one thread, LayerNorm rows below
    SERIAL_STREAM_MIN_ROW keep plain stores."""
    k = backend.load_kernels()
    ln_kernels = {
        256: (k.ln_forward_serial, k.ln_stream_forward_parallel),
        383: (k.ln_forward_serial, k.ln_stream_forward_parallel),
        384: (k.ln_stream_forward_serial, k.ln_stream_forward_parallel),
        1536: (k.ln_stream_forward_serial, k.ln_stream_forward_parallel),  # 24 KiB
        1537: (k.ln_stream_tiled_forward_serial, k.ln_stream_tiled_forward_parallel),
    }
    for n, want in ln_kernels.items():
        x = np.empty((4, n), np.float32)
        assert backend.ln_row_kernels(k, x, np.empty_like(x), True) == want, n
    rms_kernels = {
        256: (k.rms_stream_forward_serial, k.rms_stream_forward_parallel),
        3071: (k.rms_stream_forward_serial, k.rms_stream_forward_parallel),
        3072: (k.rms_stream_tiled_forward_serial, k.rms_stream_tiled_forward_parallel),
    }
    for n, want in rms_kernels.items():
        assert backend.rms_unit_row_kernels(k, n, True) == want, n
    # float64: 1024 elements are 32 KiB, 768 are 24; bfloat16 x (float32 parameters):
    # 2048 elements are 24 KiB, 2049 more (the 2-byte kernel arrays of the driver)
    tiled = k.ln_stream_tiled_forward_serial
    assert backend.ln_unit_row_kernels(k, 1024, True, 8)[0] is tiled
    assert backend.ln_unit_row_kernels(k, 768, True, 8)[0] is not tiled
    half = np.empty((4, 2048), np.uint16)
    assert backend.ln_row_kernels(k, half, half, True)[0] is not tiled
    assert backend.ln_unit_row_kernels(k, 2049, True, 4, 2)[0] is tiled


def test_serial_and_parallel_kernels_agree():
    k = backend.load_kernels()
    rows, n = 333, 300
    x = _rows(rows, n, 11)
    w, b = _params(n, 11)
    eps = np.float32(1e-5)
    tab = k.merge_table(n, np.dtype(np.float32))
    results = []
    for fn in (k.ln_forward_serial, k.ln_forward_parallel):
        y = np.empty_like(x)
        mean = np.empty(rows, np.float32)
        rstd = np.empty(rows, np.float32)
        # Through the library's entry points: the specializations every other call uses
        # (calling the dispatcher directly would compile C-layout ones just for this test).
        done = backend.entry.call(fn, backend.LN_FORWARD_WRITES, x, w, b, eps, y, mean,
                                  rstd, tab, False)
        # every row done: the row count, or no stopped blocks (None)
        assert done == rows if fn is k.ln_forward_serial else done is None
        results.append((y, mean, rstd))
    for a, e in zip(*results, strict=False):
        _same_bits(a, e)
    gy = _rows(rows, n, 12)
    mean, rstd = results[0][1], results[0][2]
    # Every backward path (unit-stride, short-row, any-stride kernels compute any rows
    # they are given), serial and parallel: the same grad_x and the same parameter
    # gradients, which each kernel returns summed over its blocks in order.
    grads = []
    for fn in (k.ln_backward_serial, k.ln_backward_parallel, k.ln_short_backward_serial,
               k.ln_short_backward_parallel, k.ln_tiled_backward_serial,
               k.ln_tiled_backward_parallel, k.ln_gathered_backward_serial,
               k.ln_gathered_backward_parallel, k.ln_split_backward_parallel):
        gx = np.empty_like(x)
        partials = np.zeros((2, -(-rows // backend.GRAD_ROW_BLOCK), n), np.float32)
        sums = backend.entry.call(fn, backend.LN_BACKWARD_WRITES, gy, x, mean, rstd, w, gx,
                                  partials, backend.GRAD_ROW_BLOCK, x, False)
        grads.append((gx, partials, sums))
    for other in grads[1:]:
        for a, e in zip(other, grads[0], strict=True):
            _same_bits(a, e)
    # The parameter gradients against float64 sums of the same per-row terms.
    sums = grads[0][2]
    xhat = (x.astype(np.float64) - mean[:, None]) * rstd[:, None]
    want = np.stack([(gy * xhat).sum(axis=0), gy.astype(np.float64).sum(axis=0)])
    np.testing.assert_allclose(sums, want, rtol=1e-4, atol=1e-3)
    rms = []
    for fn in (k.rms_backward_serial, k.rms_backward_parallel, k.rms_paired_backward_serial,
               k.rms_paired_backward_parallel, k.rms_gathered_backward_serial,
               k.rms_gathered_backward_parallel, k.rms_split_backward_parallel):
        gx = np.empty_like(x)
        partials = np.zeros((1, -(-rows // backend.GRAD_ROW_BLOCK), n), np.float32)
        sums = backend.entry.call(fn, backend.RMS_BACKWARD_WRITES, gy, x, rstd, w, gx,
                                  partials, backend.GRAD_ROW_BLOCK, x, False)
        rms.append((gx, partials, sums))
    for other in rms[1:]:
        for a, e in zip(other, rms[0], strict=True):
            _same_bits(a, e)


@pytest.mark.parametrize("has_res", [False, True])
@pytest.mark.parametrize("n", [80, 83, 300, "tiled"])
@pytest.mark.parametrize("rows", [1, 3, 133])
def test_backward_skewed_and_tiled_rows(rows, n, has_res):
    """The skewed and the tiled (RMSNorm: paired) row schedules (tiles of four rows, a
    shorter last tile, blocks of GRAD_ROW_BLOCK rows that tiles never cross: 133 rows are
    two full blocks and five rows) and the column-split parallel kernels give the
    any-stride kernel's bits, serial and parallel, with and without grad_residual, and
    the float64 reference's values."""
    k = backend.load_kernels()
    n = k.TILE_MIN_N + 37 if n == "tiled" else n
    x = _rows(rows, n, 31)
    gy = _rows(rows, n, 32, offset=0.0)
    gres = _rows(rows, n, 33, offset=0.0) if has_res else x
    w, b = _params(n, 31)
    _, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    mean, rstd = mean.reshape(rows), rstd.reshape(rows)
    results = []
    for fn in (k.ln_gathered_backward_serial, k.ln_backward_serial, k.ln_backward_parallel,
               k.ln_tiled_backward_serial, k.ln_tiled_backward_parallel,
               k.ln_split_backward_parallel):
        gx = np.empty_like(x)
        partials = np.zeros((2, -(-rows // backend.GRAD_ROW_BLOCK), n), np.float32)
        sums = backend.entry.call(fn, backend.LN_BACKWARD_WRITES, gy, x, mean, rstd, w, gx,
                                  partials, backend.GRAD_ROW_BLOCK, gres, has_res)
        results.append((gx, partials, sums))
    for other in results[1:]:
        for a, e in zip(other, results[0], strict=True):
            _same_bits(a, e)
    gx, _, sums = results[0]
    want_x, want_w, want_b = reference.layer_norm_backward(gy, x, (1,), w)
    if has_res:
        want_x = want_x + gres
    np.testing.assert_allclose(gx, want_x, rtol=1e-4, atol=5e-5)
    np.testing.assert_allclose(sums[0], want_w, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(sums[1], want_b, rtol=1e-4, atol=1e-3)
    # RMSNorm: skewed rows and (long rows) pairs.
    _, rstd = ln.rms_norm(x, n, w, return_stats=True)
    rstd = rstd.reshape(rows)
    results = []
    for fn in (k.rms_gathered_backward_serial, k.rms_backward_serial, k.rms_backward_parallel,
               k.rms_paired_backward_serial, k.rms_paired_backward_parallel,
               k.rms_split_backward_parallel):
        gx = np.empty_like(x)
        partials = np.zeros((1, -(-rows // backend.GRAD_ROW_BLOCK), n), np.float32)
        sums = backend.entry.call(fn, backend.RMS_BACKWARD_WRITES, gy, x, rstd, w, gx,
                                  partials, backend.GRAD_ROW_BLOCK, gres, has_res)
        results.append((gx, partials, sums))
    for other in results[1:]:
        for a, e in zip(other, results[0], strict=True):
            _same_bits(a, e)
    gx, _, sums = results[0]
    want_x, want_w = reference.rms_norm_backward(gy, x, (1,), w)
    if has_res:
        want_x = want_x + gres
    np.testing.assert_allclose(gx, want_x, rtol=1e-4, atol=5e-5)
    np.testing.assert_allclose(sums[0], want_w, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("has_res", [False, True])
@pytest.mark.parametrize(("dtype", "n"), [(np.float32, 512), (np.float64, 264)])
def test_backward_streaming_stores_give_same_bits(dtype, n, has_res):
    """The backward kernels that write grad_x with streaming stores (aligned rows of a
    multiple of 64 bytes; float64 rows of 264 also have a scalar tail) give the plain
    kernels' bits, serial and parallel, over blocks of rows (the tiled one: full tiles
    and a last partial one), with and without grad_residual."""
    k = backend.load_kernels()
    rows = 133
    x = _rows(rows, n, 41, dtype)
    gy = _rows(rows, n, 42, dtype, offset=0.0)
    gres = _rows(rows, n, 43, dtype, offset=0.0) if has_res else x
    w = _params(n, 41)[0].astype(dtype)
    _, mean, rstd = ln.layer_norm(x, n, w, return_stats=True)
    mean, rstd = mean.reshape(rows), rstd.reshape(rows)
    blocks = -(-rows // backend.GRAD_ROW_BLOCK)
    for plain, streamed, writes, stats, count in (
            ((k.ln_backward_serial,), (k.ln_stream_backward_serial,
                                       k.ln_stream_backward_parallel,
                                       k.ln_stream_tiled_backward_serial,
                                       k.ln_stream_tiled_backward_parallel),
             backend.LN_BACKWARD_WRITES, (mean, rstd), 2),
            ((k.rms_backward_serial,), (k.rms_stream_backward_serial,
                                        k.rms_stream_backward_parallel),
             backend.RMS_BACKWARD_WRITES, (rstd,), 1)):
        results = []
        for fn in plain + streamed:
            gx = backend.empty_output((rows, n), dtype)
            partials = np.zeros((count, blocks, n), dtype)
            sums = backend.entry.call(fn, writes, gy, x, *stats, w, gx, partials,
                                      backend.GRAD_ROW_BLOCK, gres, has_res)
            results.append((gx, partials, sums))
        for other in results[1:]:
            for a, e in zip(other, results[0], strict=True):
                _same_bits(a, e)


def test_backward_takes_streaming_stores_for_large_aligned_gradients(monkeypatch):
    """The driver streams grad_x only when every row starts on a 64-byte boundary and the
    output is far larger than the caches; both public paths (the short path for
    repeated calls and the general one) allocate grad_x aligned, and a streamed call
    gives the bits of a plain one."""
    rows, n = 64, 512
    x = _rows(rows, n, 51)
    gy = _rows(rows, n, 52, offset=0.0)
    w, b = _params(n, 51)
    _, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    gx = backend.empty_output((rows, n), np.float32)
    assert gx.ctypes.data % backend.STREAM_ALIGN == 0
    assert not backend.streams_gradient(gx)  # 128 KiB: stays in cache
    plain = ln.layer_norm_backward(gy, x, mean, rstd, w)
    _, rstd_rms = ln.rms_norm(x, n, w, return_stats=True)
    plain_rms = ln.rms_norm_backward(gy, x, rstd_rms, w)
    monkeypatch.setattr(backend, "BACKWARD_STREAM_MIN_FRACTION", 0.0)
    assert backend.streams_gradient(gx)
    assert not backend.streams_gradient(backend.empty_output((rows, n + 1), np.float32)[:, :n])
    shifted = backend.empty_output((rows * n + 4,), np.float32)[4:].reshape(rows, n)
    assert not backend.streams_gradient(shifted)  # rows 16 bytes past a boundary
    k = backend.load_kernels()
    assert backend.ln_backward_kernels(k, gy, x, gx)[0] is k.ln_stream_backward_serial
    assert backend.rms_backward_kernels(k, gy, x, gx)[0] is k.rms_stream_backward_serial
    assert backend.ln_backward_kernels(k, gy, x, gx, stream=False)[0] is not \
        k.ln_stream_backward_serial
    lanes = k.SHORT_BACKWARD_N // 5
    # Rows of the short-row kernels keep plain stores; the skewed kernels' rows stream.
    assert not backend.streams_gradient(backend.empty_output((4, 4 * lanes), np.float32))
    assert backend.streams_gradient(backend.empty_output((4, 8 * lanes), np.float32))
    long = backend.empty_output((4, k.TILE_MIN_N), np.float32)
    assert backend.streams_gradient(long)
    assert backend.ln_backward_kernels(k, long, long, long)[0] is \
        k.ln_stream_tiled_backward_serial
    from layernorm import _fast_backward

    monkeypatch.setattr(_fast_backward, "_PLANS", {})  # plans made before the patch
    chosen = []
    for name in ("ln_backward_kernels", "rms_backward_kernels"):
        real = getattr(backend, name)

        def spy(*args, real=real, **kwargs):
            pair = real(*args, **kwargs)
            chosen.append(pair[0].py_func.__name__)
            return pair

        monkeypatch.setattr(backend, name, spy)
    for route in ({}, {"backend": "numba"}):
        got = ln.layer_norm_backward(gy, x, mean, rstd, w, **route)
        for a, e in zip(got, plain, strict=True):
            _same_bits(a, e)
        assert got[0].ctypes.data % backend.STREAM_ALIGN == 0
        got = ln.rms_norm_backward(gy, x, rstd_rms, w, **route)
        for a, e in zip(got, plain_rms, strict=True):
            _same_bits(a, e)
    assert chosen == ["ln_stream_backward_serial", "rms_stream_backward_serial"] * 2



def test_backward_row_kernels_by_length_and_size():
    """Plain stores: LayerNorm rows of at least TILE_FROM_N take the tiles while x is at
    most TILE_MAX_BYTES (in cache), the skewed rows otherwise; RMSNorm rows of at least
    RMS_ROWS_FROM_N go row by row. The stand-in's item size counts, not its dtype."""
    k = backend.load_kernels()

    def ln_serial(rows, n, dtype=np.float32):
        a = np.empty((1, n), dtype)
        return backend.ln_backward_kernels(k, a, a, a, stream=False, rows=rows)[0]

    def rms_serial(n):
        a = np.empty((1, n), np.float32)
        return backend.rms_backward_kernels(k, a, a, a, stream=False, rows=1000)[0]

    n = backend.TILE_FROM_N
    fits = backend.TILE_MAX_BYTES // (4 * n)
    assert ln_serial(fits, n) is k.ln_tiled_backward_serial
    assert ln_serial(fits + 1, n) is k.ln_backward_serial
    assert ln_serial(2 * fits, n, np.float16) is k.ln_tiled_backward_serial
    assert ln_serial(2 * fits + 1, n, np.uint16) is k.ln_backward_serial
    assert ln_serial(4, n - 1) is k.ln_backward_serial
    assert ln_serial(4, k.SHORT_BACKWARD_N - 1) is k.ln_short_backward_serial
    assert rms_serial(backend.RMS_ROWS_FROM_N) is k.rms_paired_backward_serial
    assert rms_serial(backend.RMS_ROWS_FROM_N - 1) is k.rms_backward_serial

@pytest.mark.parametrize("rms", [False, True])
def test_a_single_block_of_rows_splits_columns_over_threads(rms):
    """A parallel backward of at most GRAD_ROW_BLOCK unit-stride rows (one block, which
    the row-block kernels run on one thread) takes the column-split kernel, whatever
    the row kernel of its length; more rows, or rows shorter than two column items,
    keep the row blocks. The serial kernel is always the row length's own."""
    k = backend.load_kernels()
    pick = backend.rms_backward_kernels if rms else backend.ln_backward_kernels
    split = k.rms_split_backward_parallel if rms else k.ln_split_backward_parallel
    block = backend.GRAD_ROW_BLOCK
    for n in (2 * k.SPLIT_COLUMNS, k.TILE_MIN_N + 3):
        one = np.empty((block, n), np.float32)
        serial, parallel = pick(k, one, one, one, stream=False)
        assert parallel is split
        assert serial is pick(k, one[:1], one[:1], one[:1], stream=False, rows=block + 1)[0]
        assert pick(k, one[:1], one[:1], one[:1], stream=False, rows=block + 1)[1] is not split
        assert pick(k, one[:1], one[:1], one[:1], stream=False, rows=block)[1] is split
        more = np.empty((block + 1, n), np.float32)
        assert pick(k, more, more, more, stream=False)[1] is not split
    short = np.empty((4, 2 * k.SPLIT_COLUMNS - 1), np.float32)
    assert pick(k, short, short, short, stream=False)[1] is not split
    strided = np.empty((4, 4 * k.SPLIT_COLUMNS), np.float32)[:, ::2]
    assert pick(k, strided, strided, strided)[1] is not split  # the any-stride kernels


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_parallel_backward_hands_out_the_short_block_first_then_in_order(threads):
    """Numba's prange gives each thread an equal run of iterations, the first threads
    one more where the threads do not divide the blocks: the short last block must go
    into the first (longest) run, and each run's blocks must still rise through memory
    (runs in reverse order defeat the prefetchers on rows from DRAM)."""
    from layernorm._backends._numba import backward

    for blocks in range(1, 12):
        order = [backward.short_block_first(j, blocks) for j in range(blocks)]
        assert sorted(order) == list(range(blocks))
        size, extra = divmod(blocks, threads)
        first_run = order[: size + (extra > 0)]
        assert blocks - 1 in first_run
        start = 0
        for t in range(threads):
            run = order[start: start + size + (t < extra)]
            start += len(run)
            rising = [b for b in run if b != blocks - 1]
            assert rising == sorted(rising)


_THREADS_SCRIPT = textwrap.dedent(
    """
    import hashlib, numpy as np, layernorm as ln
    rng = np.random.default_rng(0)
    x = (7.0 + rng.standard_normal((500, 300))).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    b = rng.standard_normal(300).astype(np.float32)
    gy = rng.standard_normal(x.shape).astype(np.float32)
    y, m, r = ln.layer_norm(x, 300, w, b, return_stats=True)
    out = [y, m, r, *ln.layer_norm_backward(gy, x, m, r, w)]
    z, s = ln.rms_norm(x, 300, w, return_stats=True)
    out += [z, s, *ln.rms_norm_backward(gy, x, s, w)]
    x3 = np.ascontiguousarray(x.reshape(5, 100, 300).transpose(0, 2, 1))
    y3, m3, r3 = ln.layer_norm(x3, weight=w, bias=b, axis=1, return_stats=True)
    out += [y3, *ln.layer_norm_backward(gy.reshape(x3.shape), x3, m3, r3, w, axis=1)]
    print(hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in out)).hexdigest())
    """
)


@pytest.mark.slow
def test_one_and_two_threads_give_same_bits():
    digests = []
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads)
        proc = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], env=env,
                              capture_output=True, text=True, check=True)
        digests.append(proc.stdout.strip())
    assert digests[0] == digests[1]
    assert len(digests[0]) == 64


@pytest.mark.parametrize("n", [64, 100, 768, 4096])
def test_accuracy_with_large_offset(n):
    rng = np.random.default_rng(n)
    for offset, scale, tol in ((1e4, 1.0, 1e-5), (100.0, 0.01, 1e-4)):
        x = (offset + scale * rng.standard_normal((16, n))).astype(np.float32)
        ref = x.astype(np.float64)
        m = ref.mean(-1, keepdims=True)
        want = (ref - m) / np.sqrt(((ref - m) ** 2).mean(-1, keepdims=True) + 1e-5)
        assert np.abs(ln.layer_norm(x, n).astype(np.float64) - want).max() <= tol
        x3 = np.ascontiguousarray(x.T)[None]  # (1, n, 16): the column path
        got3 = ln.layer_norm(x3, axis=1)[0].T
        assert np.abs(got3.astype(np.float64) - want).max() <= tol


@pytest.mark.parametrize("n", [1, 20, 64, 300])
def test_constant_and_nonfinite_rows(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((6, n)).astype(np.float32)
    x[1] = 3.7
    x[3, n // 2] = np.nan
    x[4, 0] = np.inf
    w, b = _params(n, n)
    y = ln.layer_norm(x, n, w, b)
    _same_bits(y[1], b)
    assert np.isnan(y[3]).all() and np.isnan(y[4]).all()
    clean = np.delete(x, [3, 4], axis=0)
    _same_bits(np.delete(y, [3, 4], axis=0), ln.layer_norm(clean, n, w, b))
    assert np.isnan(ln.layer_norm(x[1:2], n, eps=0.0)).all()
    x3 = np.ascontiguousarray(x.T)[None]
    _same_bits(ln.layer_norm(x3, weight=w, bias=b, axis=1)[0].T, y)


def test_threads_script_is_deterministic_in_process():
    # The subprocess script's digest is stable across calls in one process as well.
    ns: dict = {}
    digests = []
    for _ in range(2):
        buf = []
        ns["print"] = buf.append
        exec(_THREADS_SCRIPT, ns)
        digests.append(buf[0])
    assert digests[0] == digests[1]
    assert digests[0] != hashlib.sha256(b"").hexdigest()


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("n", [5, 16, 40, 64, 79, 80, "pairs"])
def test_backward_rows_in_batch_match_rows_alone(rms, n):
    """Short rows keep grad_weight partials in registers, long rows run in tiles (and in
    pairs when strided): each row's grad_x and its grad_weight/grad_bias terms must have
    the single-row bits."""
    k = backend.load_kernels()
    n = max(k.PAIR_MIN_N, k.TILE_MIN_N) + 37 if n == "pairs" else n
    rows = 7  # three pairs and a single row; a tile of four and one of three
    x = _rows(rows, n, 21)
    gy = _rows(rows, n, 22, offset=0.0)
    w, b = _params(n, 21)
    wide = np.zeros((rows, 2 * n), np.float32)
    wide[:, ::2] = x
    gwide = np.zeros_like(wide)
    gwide[:, ::2] = gy
    if rms:
        _, rstd = ln.rms_norm(x, n, w, return_stats=True)
        batch = ln.rms_norm_backward(gy, x, rstd, w)
        strided = ln.rms_norm_backward(gwide[:, ::2], wide[:, ::2], rstd, w)
        alone = [ln.rms_norm_backward(gy[i:i + 1], x[i:i + 1], rstd[i:i + 1], w)
                 for i in range(rows)]
    else:
        _, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
        batch = ln.layer_norm_backward(gy, x, mean, rstd, w)
        strided = ln.layer_norm_backward(gwide[:, ::2], wide[:, ::2], mean, rstd, w)
        alone = [ln.layer_norm_backward(gy[i:i + 1], x[i:i + 1], mean[i:i + 1],
                                        rstd[i:i + 1], w) for i in range(rows)]
    for i, single in enumerate(alone):
        _same_bits(single[0][0], batch[0][i])
    for got, want in zip(strided, batch, strict=True):
        _same_bits(got, want)
    # Each row's terms are added to grad_weight (and grad_bias) in row order.
    for j in range(1, len(batch)):
        total = np.zeros(n, np.float32)
        for single in alone:
            total = total + single[j]
        _same_bits(total, batch[j])


def test_layouts_and_absent_parameters_share_one_compiled_kernel():
    """C, Fortran, strided and read-only inputs, with or without weight/bias, reuse one
    specialization per dtype: each would otherwise cost seconds of compilation."""
    kernels = backend.load_kernels()
    rng = np.random.default_rng(7)
    base = (2.0 + rng.standard_normal((24, 50))).astype(np.float64)
    w, b = rng.standard_normal(50), rng.standard_normal(50)
    read_only = base.copy()
    read_only.flags.writeable = False
    inputs = [base, np.asfortranarray(base), base[::2], base[:, ::-1], read_only]
    row_kernels = (kernels.ln_short_forward_serial, kernels.ln_gathered_forward_serial)
    # The general path, once on unit-stride rows and once on strided ones (two paths).
    ln.layer_norm(base, weight=w, bias=b, axis=-1, return_stats=True)
    ln.layer_norm(base[:, ::-1], weight=w, bias=b, axis=-1, return_stats=True)
    before = [len(kernel.overloads) for kernel in row_kernels]
    assert all(before), "each path compiled"
    for x in inputs:
        for params in ({}, {"weight": w}, {"bias": b}, {"weight": w, "bias": b}):
            y, mean, rstd = ln.layer_norm(x, axis=-1, return_stats=True, **params)
            ref_rstd = 1 / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
            ref = (x - x.mean(-1, keepdims=True)) * ref_rstd
            np.testing.assert_allclose(y, ref * params.get("weight", 1) + params.get("bias", 0),
                                       rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(mean, x.mean(-1, keepdims=True), rtol=1e-13)
            np.testing.assert_allclose(rstd, ref_rstd, rtol=1e-12)
    assert [len(kernel.overloads) for kernel in row_kernels] == before


def test_absent_parameters_are_exact_identities():
    """No weight is weight 1 and no bias adds nothing, bit for bit (zeros keep their sign)."""
    rng = np.random.default_rng(8)
    x = (3.0 + rng.standard_normal((40, 37))).astype(np.float32)
    x[5] = 1.5  # a constant row: its centred values are exactly zero
    w = rng.standard_normal(37).astype(np.float32)
    plain = ln.layer_norm(x, axis=-1)
    np.testing.assert_array_equal(plain.view(np.int32),
                                  ln.layer_norm(x, weight=np.ones(37, np.float32)).view(np.int32))
    # y * w, then + b: the result of the two-step formula, computed here in float64
    xhat = plain.astype(np.float64)
    expected = (xhat * w.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(ln.layer_norm(x, weight=w).view(np.int32),
                                  expected.view(np.int32))
    b = rng.standard_normal(37).astype(np.float32)
    np.testing.assert_array_equal(ln.layer_norm(x, bias=b).view(np.int32),
                                  (plain + b).view(np.int32))
    assert not np.signbit(plain[5]).any()


def test_calls_with_and_without_statistics_share_one_compiled_kernel():
    """The short path passes empty statistics arrays (which the kernels skip) when the
    caller does not ask for them, not None: one specialization serves both calls."""
    kernels = backend.load_kernels()
    rng = np.random.default_rng(13)
    x = (2 + rng.standard_normal((30, 96))).astype(np.float32)
    y, _, rstd = ln.layer_norm(x, 96, return_stats=True)
    y_rms, _ = ln.rms_norm(x, 96, return_stats=True)
    before = (len(kernels.ln_short_forward_serial.overloads),
              len(kernels.rms_short_forward_serial.overloads))
    _same_bits(ln.layer_norm(x, 96), y)  # the same kernel, statistics skipped
    _same_bits(ln.rms_norm(x, 96), y_rms)
    assert (len(kernels.ln_short_forward_serial.overloads),
            len(kernels.rms_short_forward_serial.overloads)) == before
    assert np.array_equal(ln.layer_norm(x, 96, return_stats=True)[2], rstd)


def test_a_new_parameter_dtype_compiles_no_row_kernel():
    """float32 x with bfloat16 or float16 parameters runs the float32 kernels: the
    parameters are widened exactly before any kernel sees them, so no kernel is
    specialized for them."""
    kernels = backend.load_kernels()
    rng = np.random.default_rng(12)
    x = (1 + rng.standard_normal((40, 200))).astype(np.float32)
    w32 = (1 + 0.5 * rng.standard_normal(200)).astype(np.float32)
    _, mean, rstd = ln.layer_norm(x, 200, w32, w32, return_stats=True)
    ln.layer_norm_backward(x, x, mean, rstd, w32)
    row_kernels = [getattr(kernels, name) for name in kernels.__all__
                   if hasattr(getattr(kernels, name), "overloads")]
    before = [len(kernel.overloads) for kernel in row_kernels]
    for dtype in (ml_dtypes.bfloat16, np.float16):
        w = w32.astype(dtype)
        _, m, r = ln.layer_norm(x, 200, w, w, return_stats=True)
        ln.layer_norm_backward(x, x, m, r, w)
    assert [len(kernel.overloads) for kernel in row_kernels] == before


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_parameter_kernels_convert_as_numpy_casts(dtype):
    """The small kernels that widen long 16-bit parameters and round their gradients
    give NumPy's casts' bits: widening every one of the 65536 bit patterns, rounding
    float32 values of every kind (random bits, ties, overflow, subnormals, the body and
    the scalar tail of the loops)."""
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    assert every.size >= backend.PARAM_KERNEL_MIN
    reversed_ = every[::-1].copy()
    pair = backend.widened_params(every, reversed_, np.float32)
    for got, source in ((backend.widened_param(every, np.float32), every),
                        (pair[0], every), (pair[1], reversed_)):
        want = source.astype(np.float32)
        assert got.dtype == np.float32 and got.shape == want.shape
        # NaN payloads may differ (the hardware quiets a signalling NaN).
        finite = ~np.isnan(want)
        _same_bits(got[finite], want[finite])
        assert np.isnan(got[~finite]).all()
    rng = np.random.default_rng(3)
    n = 5 * backend.PARAM_KERNEL_MIN + 7  # a scalar tail after the vectors
    values = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    top = 16 if dtype == ml_dtypes.bfloat16 else 13  # bits dropped by the rounding
    ties = rng.integers(0, 1 << 20, 500).astype(np.uint32) << np.uint32(top)
    values[:500] = (ties | np.uint32(1 << (top - 1))).view(np.float32)  # exact ties
    values[500:600] = np.float32(65520.0) * rng.choice([-1, 1], 100)  # float16 overflow
    values[600:700] = rng.standard_normal(100).astype(np.float32) * np.float32(2.0**-20)
    values[-3:] = [np.inf, -np.inf, np.nan]
    with np.errstate(over="ignore", invalid="ignore"):
        want = values.astype(dtype)
    got = backend.narrowed_param(values, np.dtype(dtype))
    assert got.dtype == np.dtype(dtype) and got.shape == values.shape
    finite = ~np.isnan(values)
    _same_bits(got[finite], want[finite])
    assert np.isnan(got[~finite].astype(np.float32)).all()
    small = values[:700]  # below PARAM_KERNEL_MIN: NumPy's cast itself, no warning
    _same_bits(backend.narrowed_param(small, np.dtype(dtype)), want[:700])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("n", [768, 4096])
def test_half_precision_parameters_give_the_widened_parameters_bits(dtype, n):
    """16-bit weight and bias (widened by a NumPy cast at 768, by a kernel at 4096) give
    the bits of float32 parameters of the same values, forward (short and general
    paths) and backward, whose float32 parameter gradients are then rounded as NumPy
    rounds them."""
    rng = np.random.default_rng(n)
    x = _rows(3, n, n)
    gy = rng.standard_normal((3, n)).astype(np.float32)
    w16 = (1 + 0.5 * rng.standard_normal(n)).astype(dtype)
    b16 = (0.3 * rng.standard_normal(n)).astype(dtype)
    w32, b32 = w16.astype(np.float32), b16.astype(np.float32)
    for backend_name in (None, "numba"):
        y, mean, rstd = ln.layer_norm(x, n, w16, b16, return_stats=True,
                                      backend=backend_name)
        want = ln.layer_norm(x, n, w32, b32, return_stats=True)
        for got, expected in zip((y, mean, rstd), want, strict=True):
            _same_bits(got, expected)
        _same_bits(ln.rms_norm(x, n, w16, backend=backend_name), ln.rms_norm(x, n, w32))
        gx, gw, gb = ln.layer_norm_backward(gy, x, mean, rstd, w16, backend=backend_name)
        wx, ww, wb = ln.layer_norm_backward(gy, x, mean, rstd, w32)
        _same_bits(gx, wx)
        _same_bits(gw, ww.astype(dtype))
        _same_bits(gb, wb.astype(dtype))
        rgx, rgw = ln.rms_norm_backward(gy, x, rstd, w16, backend=backend_name)
        wrx, wrw = ln.rms_norm_backward(gy, x, rstd, w32)
        _same_bits(rgx, wrx)
        _same_bits(rgw, wrw.astype(dtype))


def test_only_calls_that_stream_load_the_streaming_kernels():
    """Streaming stores have entry kernels of their own: a fresh process whose calls
    never stream (small outputs) loads or compiles only the plain ones, and a call that
    streams gives the plain kernels' bits (test_streaming_stores_give_same_bits)."""
    code = textwrap.dedent("""
        import numpy as np
        import layernorm as ln
        from layernorm._backends._numba import kernels as k
        x = np.random.default_rng(0).standard_normal((64, 1500)).astype(np.float32)
        ln.layer_norm(x)
        ln.rms_norm(x)
        def loaded(*kernels):
            return sum(len(f.overloads) for f in kernels)
        print(loaded(k.ln_forward_serial, k.ln_forward_parallel),
              loaded(k.rms_forward_serial, k.rms_forward_parallel),
              loaded(k.ln_stream_forward_serial, k.ln_stream_forward_parallel,
                     k.rms_stream_forward_serial, k.rms_stream_forward_parallel))
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=600)
    plain_ln, plain_rms, streaming = (int(v) for v in proc.stdout.split())
    assert plain_ln >= 1 and plain_rms >= 1 and streaming == 0


@pytest.mark.parametrize(("x_dtype", "param_dtype"), [
    (np.float16, np.float16), (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
    (np.float32, ml_dtypes.bfloat16), (np.float64, np.float16)])
def test_half_parameters_equal_their_float32_values(x_dtype, param_dtype):
    """16-bit weight/bias are widened exactly before the kernels (one small kernel);
    the result must be bit for bit that of the same values given in float32, on every
    path. (The pairs are the common ones, plus a float64 input, whose parameters are cast
    to float64.)"""
    rng = np.random.default_rng(9)

    def bits(a):
        return np.ascontiguousarray(a).view(np.uint8)

    # (1800, 40) is large enough for the parallel kernels (their parameters are widened
    # once per call, before the row blocks).
    for shape, axis in (((1, 40), -1), ((300, 24), -1), ((3, 24, 7), 1), ((1800, 40), -1)):
        x = (3 + rng.standard_normal(shape)).astype(x_dtype)
        d = shape[axis]
        w = (1 + 0.5 * rng.standard_normal(d)).astype(param_dtype)
        b = rng.standard_normal(d).astype(param_dtype)
        w32, b32 = w.astype(np.float32), b.astype(np.float32)
        both = ({"weight": w, "bias": b}, {"weight": w32, "bias": b32})
        # A weight or a bias alone (the other one is a float32 identity) is its own
        # specialization of each kernel: check it on the serial rows path only, where the
        # widening code is the same as in the column and parallel kernels (each of which
        # has both parameters half above); the full grid compiled 12 more kernels.
        alone = (({"weight": w}, {"weight": w32}), ({"bias": b}, {"bias": b32}))
        for kw, kw32 in (both, *(alone if shape == (300, 24) else ())):
            assert np.array_equal(bits(ln.layer_norm(x, axis=axis, **kw)),
                                  bits(ln.layer_norm(x, axis=axis, **kw32)))
        assert np.array_equal(bits(ln.rms_norm(x, weight=w, axis=axis)),
                              bits(ln.rms_norm(x, weight=w32, axis=axis)))
        _, mean, rstd = ln.layer_norm(x, weight=w, bias=b, axis=axis, return_stats=True)
        gx, gw, gb = ln.layer_norm_backward(x, x, mean, rstd, w, axis=axis)
        gx32, gw32, gb32 = ln.layer_norm_backward(x, x, mean, rstd, w32, axis=axis)
        assert np.array_equal(bits(gx), bits(gx32))
        assert gw.dtype == w.dtype  # the gradient has the weight's dtype
        assert np.array_equal(bits(gw), bits(gw32.astype(w.dtype)))
        assert np.array_equal(bits(gb), bits(gb32.astype(w.dtype)))


@pytest.mark.parametrize("n", [64, 256, 1024, 4096, 16384])
def test_offset_rows_keep_float32_accuracy(n):
    """The issue's accuracy bar: max |y - y_float64| <= 1e-6 on ``1e4 + randn`` rows
    (float32 has ulp(1e4) = 1e-3: a formula that loses the offset's bits fails by far)."""
    rng = np.random.default_rng(n + 7)
    x = (1e4 + rng.standard_normal((max(16, 1 << 20 >> n.bit_length()), n))).astype(np.float32)
    y_ref, _, rstd_ref = reference.layer_norm(x, (1,))
    y, _, rstd = ln.layer_norm(x, return_stats=True)
    assert np.abs(y - y_ref).max() <= 1e-6
    assert np.abs(rstd / rstd_ref - 1).max() <= 3e-7


def _far_shift_rows(rows, n, seed):
    """``1e4 + randn`` rows, some of whose shift (the mean of the first 16 elements) lies
    far from the row's mean: an outlying first vector, an outlying first element, a sorted
    row (its first elements are its smallest)."""
    rng = np.random.default_rng(seed)
    x = (1e4 + rng.standard_normal((rows, n))).astype(np.float32)
    x[1, :16] += 1000.0
    x[5, 0] += 300.0
    x[6] = np.sort(x[6])
    x[rows - 2, :16] -= 50.0
    return x


@pytest.mark.parametrize("n", [17, 64, 300, 2049, 4096])
def test_rows_with_a_far_shift_have_the_same_bits_on_every_path(n):
    """Rows whose first elements lie far from their mean (where a shifted arithmetic
    is weakest) give the same bits alone, in a batch, strided and as columns."""
    x = _far_shift_rows(35, n, n)
    w, b = _params(n, n)
    y, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    y_ref, _, _ = reference.layer_norm(x, (1,), w, b)
    assert np.all(np.abs(y - y_ref) <= 5e-5 * np.maximum(1.0, np.abs(y_ref)))
    for r in (1, 5, 6, 33):
        _same_bits(ln.layer_norm(x[r:r + 1], n, w, b), y[r:r + 1])
    strided = np.empty((35, 2 * n), np.float32)[:, ::2]
    strided[...] = x
    _same_bits(ln.layer_norm(strided, n, w, b), y)
    columns = np.ascontiguousarray(x.T)[None]
    yc, mc, rc = ln.layer_norm(columns, weight=w, bias=b, axis=1, return_stats=True)
    _same_bits(yc[0].T, y)
    _same_bits(mc.reshape(-1), mean.reshape(-1))
    _same_bits(rc.reshape(-1), rstd.reshape(-1))


def _redo_rows(n, seed):
    """Rows whose one-pass moments cancel, so that the row arithmetic redoes them with a
    better shift (rows 0-3), between ordinary rows: an outlying first element, far
    offsets whose first element lies several deviations from the mean, a sorted row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((9, n)).astype(np.float32)
    x[0, 0] = 1e4  # the shift K = x[0] is the outlier
    x[1] = 1e4 + x[1]
    x[1, 0] = np.float32(1e4 + 6.0)  # K six deviations above the mean
    x[2] = np.sort(x[2]) - 3e3  # its first element is its smallest
    x[3, 0] = x[3, 1:].mean() - 40.0 * x[3, 1:].std()
    x[5, -1] = 1e4  # an outlying last element (K stays near the mean: no redo needed)
    x[6] = 1e4 + x[6]
    return x


@pytest.mark.parametrize("n", [7, 64, 300, 4096])
def test_an_outlying_first_element_keeps_full_accuracy(n):
    """The shift is the row's first element; when it is far from the mean the one-pass
    M2 cancels and the row is redone with the shift moved to the mean. Without the redo
    these rows lose up to 1e-2 relative accuracy."""
    x = _redo_rows(n, n)
    w, b = _params(n, n)
    y, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    y_ref, mean_ref, rstd_ref = (a.astype(np.float64)
                                 for a in reference.layer_norm(x.astype(np.float64), (1,), w, b))
    assert np.all(np.abs(y - y_ref) <= 2e-6 * np.maximum(1.0, np.abs(y_ref)))
    np.testing.assert_allclose(rstd.reshape(-1), rstd_ref.reshape(-1), rtol=3e-7)
    x64 = x.astype(np.float64)
    spread = np.abs(x64 - x64.mean(1, keepdims=True)).max(1)
    rounding = np.spacing(np.abs(mean_ref.reshape(-1)).astype(np.float32))  # mean in float32
    assert np.all(np.abs(mean.reshape(-1) - mean_ref.reshape(-1)) <= rounding + 1e-6 * spread)


@pytest.mark.parametrize("n", [17, 64, 128, 300, 2049])
def test_redone_rows_give_the_same_bits_on_every_path(n):
    """A redone row gets the same bits alone, at any batch position, strided, as a
    column, through the fused add + norm kernels and with any number of threads."""
    import numba

    x = _redo_rows(n, 3 * n)
    w, b = _params(n, 3 * n)
    y, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    filler = _rows(300, n, n)
    for r in range(x.shape[0]):
        _same_bits(ln.layer_norm(x[r:r + 1], n, w, b), y[r:r + 1])
        for pos in (0, 17, 299):
            batch = filler.copy()
            batch[pos] = x[r]
            _same_bits(ln.layer_norm(batch, n, w, b)[pos], y[r])
    strided = np.empty((x.shape[0], 3 * n), np.float32)[:, ::3]
    strided[...] = x
    _same_bits(ln.layer_norm(strided, n, w, b), y)
    yc, mc, rc = ln.layer_norm(np.ascontiguousarray(x.T)[None], weight=w, bias=b, axis=1,
                               return_stats=True)
    _same_bits(yc[0].T, y)
    _same_bits(mc.reshape(-1), mean.reshape(-1))
    _same_bits(rc.reshape(-1), rstd.reshape(-1))
    zero = np.zeros_like(x)  # h = x + 0 = x exactly
    yf, _ = ln.add_layer_norm(x, zero, n, w, b)
    _same_bits(yf, y)
    big = np.concatenate([filler] * 20 + [x])  # enough rows for the parallel kernels
    want = ln.layer_norm(big, n, w, b)
    _same_bits(want[-x.shape[0]:], y)
    threads = numba.get_num_threads()
    try:
        for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(t)
            _same_bits(ln.layer_norm(big, n, w, b), want)
            _same_bits(ln.add_layer_norm(big, np.zeros_like(big), n, w, b)[0], want)
    finally:
        numba.set_num_threads(threads)


@pytest.mark.parametrize("n", [64, 100])
def test_short_rows_of_a_call_that_prefetches_equal_rows_alone(monkeypatch, n):
    """A serial short-row call of PREFETCH_MIN_BYTES or more prefetches the rows ahead
    (a hint: the same bits as small calls of the same rows)."""
    from layernorm._backends._numba import forward_rows

    monkeypatch.setattr(backend.chooser, "policy", "never")  # the serial kernel
    rows = forward_rows.PREFETCH_MIN_BYTES // (4 * n) + 37  # not a multiple of LANES
    x = _rows(rows, n, n + 1)
    w, b = _params(n, n + 1)
    y, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    for start in (0, rows // 3, rows - 40):
        y1, m1, r1 = ln.layer_norm(x[start:start + 40], n, w, b, return_stats=True)
        _same_bits(y1, y[start:start + 40])
        _same_bits(m1, mean[start:start + 40])
        _same_bits(r1, rstd[start:start + 40])


@pytest.mark.parametrize("granule", [1, 16])
def test_parallel_forward_blocks_share_rows_evenly(granule):
    """The parallel forward kernels' blocks (rowmath.even_blocks / block_span) cover the
    rows once, in order, each starting on a multiple of ``granule``, and any 1, 2, 3, 4,
    6 or 8 threads, each running an equal run of consecutive blocks, get equal shares
    (each boundary moved down by less than a granule)."""
    from layernorm._backends._numba import rowmath

    for rows, n in ((1, 4096), (10, 16384), (37, 300), (44, 4096), (90, 2048),
                    (2883, 64), (100_000, 64), (7, 1)):
        blocks = rowmath.even_blocks(rows, n)
        assert blocks % rowmath.BLOCK_MULTIPLE == 0
        assert blocks * rowmath.WORK_ELEMENTS >= rows * n  # no block above its share
        spans = [rowmath.block_span(blk, blocks, rows, granule) for blk in range(blocks)]
        assert spans[0][0] == 0 and spans[-1][1] == rows
        for (r0, r1), (s0, _) in zip(spans, [*spans[1:], (rows, rows)], strict=True):
            assert r0 <= r1 == s0 and r0 % granule == 0
        for threads in (1, 2, 3, 4, 6, 8):
            per = blocks // threads
            shares = [spans[t * per + per - 1][1] - spans[t * per][0] for t in range(threads)]
            assert sum(shares) == rows
            assert max(shares) - min(shares) <= 2 * granule, (rows, n, threads, shares)


def _empty_at(shape, offset):
    """An empty float32 array whose address is ``offset`` bytes past a page boundary."""
    size = int(np.prod(shape)) * 4
    buf = np.empty(size + 8192, np.uint8)
    skip = (offset - buf.ctypes.data) % 4096
    return buf[skip:skip + size].view(np.float32).reshape(shape)


def _placed_after(x, offset):
    """An empty float32 array of x's shape whose address is x's plus ``offset``
    modulo 4 KiB."""
    return _empty_at(x.shape, (x.ctypes.data + offset) % 4096)


def _placed_at(x, offset):
    """A float32 copy of x whose address is ``offset`` bytes past a page boundary."""
    out = _empty_at(x.shape, offset)
    out[...] = x
    return out


def _check_ln_rows(fn, x, y, w, b, tab, want):
    """Forward kernel ``fn`` (its stopped rows completed) of x into y, which it must
    fill (y NaN unless it is x), against ``want``'s bits (y, mean, rstd)."""
    rows = x.shape[0]
    if y is not x:
        y[...] = np.nan
    mean = np.full(rows, np.nan, np.float32)
    rstd = np.full(rows, np.nan, np.float32)
    args = (x, w, b, np.float32(1e-5), y, mean, rstd, tab, False)
    backend.complete_layer_norm_rows(
        backend.entry.call(fn, backend.LN_FORWARD_WRITES, *args), args)
    for got, exp in zip((y, mean, rstd), want, strict=True):
        _same_bits(got, exp.reshape(got.shape))


def _check_rms_rows(fn, x, y, w, want):
    """:func:`_check_ln_rows` for an RMSNorm kernel (y, rstd)."""
    if y is not x:
        y[...] = np.nan
    rstd = np.full(x.shape[0], np.nan, np.float32)
    args = (x, w, np.float32(1e-5), y, rstd, False)
    backend.complete_rms_norm_rows(
        backend.entry.call(fn, backend.RMS_FORWARD_WRITES, *args), args)
    for got, exp in zip((y, rstd), want, strict=True):
        _same_bits(got, exp.reshape(got.shape))


@pytest.mark.parametrize("n", [771, 1541, 2048, 3085])
def test_downward_output_passes_give_the_same_bits(n):
    """With y 1..2048 bytes after x modulo 4 KiB the whole-row and tiled loops write
    each row downwards (forward_rows.output_downwards, against 4 KiB aliasing): every
    kernel must give the bits of the upward pass, tails and stopped rows included."""
    k = backend.load_kernels()
    rows = 37
    x = _rows(rows, n, 5)
    x[11] = np.linspace(-3e19, 4e19, n, dtype=np.float32)  # squares overflow: a stop
    w, b = _params(n, 5)
    tab = k.merge_table(n, np.dtype(np.float32))

    want = ln.layer_norm(x, n, w, b, return_stats=True, backend="numba")
    for fn in (k.ln_forward_serial, k.ln_seq_forward_serial, k.ln_tiled_forward_serial,
               k.ln_stream_forward_serial, k.ln_forward_parallel, k.ln_seq_forward_parallel,
               k.ln_tiled_forward_parallel, k.ln_stream_forward_parallel):
        for offset in (64, 200, 2048, 3000):  # downwards, downwards, downwards, upwards
            _check_ln_rows(fn, x, _placed_after(x, offset), w, b, tab, want)


@pytest.mark.parametrize("n", [17, 40, 64, 100, 300, 771, 1541, 2048, 3085])
def test_output_passes_from_an_aligned_head_give_the_same_bits(n):
    """The row path's output passes start their vectors at x's first 64-byte boundary
    (forward_rows.aligned_head) and finish the elements before it from a saved vector
    (rows in the pipelined order) or one at a time (whole and tiled rows), and the
    elements after the last whole vector from x's last vector: at every misalignment
    of x, in place too, every LayerNorm and RMSNorm row kernel must give the bits of
    the aligned call, tails and a stopped row included."""
    k = backend.load_kernels()
    rows = 37
    x0 = _rows(rows, n, 8)
    x0[11] = np.linspace(-3e19, 4e19, n, dtype=np.float32)  # squares overflow: a stop
    w, b = _params(n, 8)
    tab = k.merge_table(n, np.dtype(np.float32))
    want = ln.layer_norm(_placed_at(x0, 0), n, w, b, return_stats=True, backend="numba")
    want_rms = ln.rms_norm(_placed_at(x0, 0), n, w, eps=1e-5, return_stats=True,
                           backend="numba")
    for offset in (4, 16, 36, 60):  # heads of 15, 12, 7 and 1 elements
        for in_place in (False, True):
            for fn in (k.ln_forward_serial, k.ln_seq_forward_serial,
                       k.ln_tiled_forward_serial, k.ln_short_forward_serial,
                       k.ln_forward_parallel, k.ln_seq_forward_parallel,
                       k.ln_tiled_forward_parallel, k.ln_short_forward_parallel):
                x = _placed_at(x0, offset)
                _check_ln_rows(fn, x, x if in_place else _placed_after(x, 1000), w, b, tab,
                               want)
            for fn in (k.rms_forward_serial, k.rms_seq_forward_serial,
                       k.rms_tiled_forward_serial, k.rms_short_forward_serial,
                       k.rms_forward_parallel, k.rms_seq_forward_parallel,
                       k.rms_tiled_forward_parallel, k.rms_short_forward_parallel):
                x = _placed_at(x0, offset)
                _check_rms_rows(fn, x, x if in_place else _placed_after(x, 1000), w,
                                want_rms)


@pytest.mark.parametrize("n", [1024, 1037, 2048])
def test_tiled_backward_at_any_placement_gives_the_same_bits(n):
    """The tiled LayerNorm backward starts grad_x's vectors at a 64-byte boundary (one
    element at a time before it) and runs its grad_x pass downwards when grad_x lies
    just after grad_y or x modulo 4 KiB (backward.gx_downwards): at every placement of
    grad_y and grad_x (both directions, heads of 0-15 elements), with and without
    grad_residual, it must give the any-stride kernel's bits, partials included."""
    k = backend.load_kernels()
    rows = 37  # nine tiles and a row
    x = _placed_after(np.empty((rows, n), np.float32), 16)
    x[...] = _rows(rows, n, 41)
    w, b = _params(n, 41)
    _, mean, rstd = ln.layer_norm(x, n, w, b, return_stats=True)
    mean, rstd = mean.reshape(rows), rstd.reshape(rows)
    blocks = -(-rows // backend.GRAD_ROW_BLOCK)

    def run(fn, gy, gx, gres, has_res):
        gx[...] = np.nan
        partials = np.zeros((2, blocks, n), np.float32)
        sums = backend.entry.call(fn, backend.LN_BACKWARD_WRITES, gy, x, mean, rstd, w, gx,
                                  partials, backend.GRAD_ROW_BLOCK, gres, has_res)
        return gx.copy(), partials, sums

    # (grad_y, grad_x) bytes after x modulo 4 KiB: grad_x just after x (downwards),
    # just after both, just before both (upwards); misaligned by 4-60 bytes.
    for gy_at, gx_at in ((2048, 64), (2048, 84), (0, 36), (16, 16), (2048, 3500),
                         (1000, 940), (3000, 4092)):
        gy = _placed_after(x, gy_at)
        gy[...] = _rows(rows, n, 42, offset=0.0)
        gres = _placed_after(x, 512)
        gres[...] = _rows(rows, n, 43, offset=0.0)
        for has_res in (False, True):
            want = run(k.ln_gathered_backward_serial, gy, np.empty_like(x),
                       gres if has_res else x, has_res)
            for fn in (k.ln_tiled_backward_serial, k.ln_tiled_backward_parallel):
                got = run(fn, gy, _placed_after(x, gx_at), gres if has_res else x,
                          has_res)
                for a, e in zip(got, want, strict=True):
                    _same_bits(a, e)


@pytest.mark.parametrize("n", [771, 2048, 3085])
def test_downward_rms_output_passes_give_the_same_bits(n):
    """:func:`test_downward_output_passes_give_the_same_bits` for RMSNorm."""
    k = backend.load_kernels()
    rows = 37
    x = _rows(rows, n, 6)
    x[11] = np.linspace(-3e19, 4e19, n, dtype=np.float32)  # squares overflow: a stop
    w, _ = _params(n, 6)

    want = ln.rms_norm(x, n, w, eps=1e-5, return_stats=True, backend="numba")
    for fn in (k.rms_forward_serial, k.rms_seq_forward_serial, k.rms_tiled_forward_serial,
               k.rms_stream_forward_serial, k.rms_forward_parallel,
               k.rms_seq_forward_parallel, k.rms_tiled_forward_parallel,
               k.rms_stream_forward_parallel):
        for offset in (64, 200, 2048, 3000):
            _check_rms_rows(fn, x, _placed_after(x, offset), w, want)


def test_scratch_blocks_are_aligned_separate_and_keep_their_values():
    """``_simd.scratch_block``: a 64-byte aligned block of the given shape and dtype in
    the function's stack frame, rows of ``cols`` elements; two blocks do not overlap."""
    from numba import njit

    from layernorm._backends._numba._simd import get, put, scratch_block, vaddress

    @njit
    def blocks(out64, out32):
        a = scratch_block(3, 16, np.float64)
        b = scratch_block(2, 16, np.float32)
        for r in range(3):
            for i in range(16):
                put(a, r, i, np.float64(100 * r + i + 0.5))
        for r in range(2):
            for i in range(16):
                put(b, r, i, np.float32(-(100 * r + i) - 0.25))
        for r in range(3):
            for i in range(16):
                out64[r, i] = get(a, r, i)
        for r in range(2):
            for i in range(16):
                out32[r, i] = get(b, r, i)
        return (vaddress(a, 0, 0) % 64, vaddress(b, 0, 0) % 64,
                vaddress(a, 1, 0) - vaddress(a, 0, 0), vaddress(b, 1, 0) - vaddress(b, 0, 0))

    out64 = np.zeros((3, 16))
    out32 = np.zeros((2, 16), np.float32)
    assert blocks(out64, out32) == (0, 0, 16 * 8, 16 * 4)
    rows, cols = np.mgrid[0:3, 0:16]
    np.testing.assert_array_equal(out64, 100.0 * rows + cols + 0.5)
    np.testing.assert_array_equal(out32, (-(100.0 * rows + cols) - 0.25)[:2].astype(np.float32))


def test_each_scale_kind_prunes_the_others_code_before_typing():
    """The quantizing kernels branch on ``dynamic is None``; Numba drops the branch not
    taken before typing for both ``DYNAMIC`` and ``STATIC`` (None), so a call compiles
    only its own scale's code. A branch that cannot be typed shows it: with ``True``
    as ``DYNAMIC`` (a boolean, whose branches are both kept) the first call failed."""
    from numba import njit

    from layernorm._backends._numba import quantized

    @njit
    def per_row_only(dynamic):
        if dynamic is None:
            return "a static scale".no_such_method()  # untypable
        return 1

    @njit
    def static_only(dynamic):
        if dynamic is not None:
            return "a per-row scale".no_such_method()
        return 2

    assert per_row_only(quantized.DYNAMIC) == 1
    assert static_only(quantized.STATIC) == 2
    with pytest.raises(Exception, match="no_such_method"):
        per_row_only(True)
