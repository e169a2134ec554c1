"""LayerNorm and RMSNorm backward: rows of 2-D arrays, columns of 3-D ones.

Backward (LayerNorm): lane ``i % LANES`` accumulates ``g = dy * w`` and ``g * xhat``
(``xhat = (x - mean) * rstd``) in order; tree sums; ``grad_x = ((g - mean_g) - xhat *
mean_gxhat) * rstd``. ``grad_weight``/``grad_bias`` partials are accumulated per fixed
block of rows (2-D: ``block_rows`` consecutive rows in order; 3-D: one partial per
``(outer index, COL_BLOCK columns)``), then summed over blocks in order by the kernel
itself, which returns the sums.

Unit-stride rows take one of three schedules, all with the same per-row arithmetic (the
same bits): rows shorter than ``SHORT_BACKWARD_N`` keep the partials in registers; rows
that come from memory, or are shorter than the driver's ``TILE_FROM_N``, run *skewed*,
the second pass of row ``r`` in one loop with the first pass of row ``r + 1`` (DRAM
reads in flight while the cached row is finished); longer cache-resident rows (and,
with streaming stores, rows of at least ``TILE_MIN_N``) run in tiles of ``TILE_ROWS``
rows, first passes of the tile interleaved,
then one read-modify-write of the dw/db partial vectors for the tile's rows
(``dw = ((dw + a) + b) + ...``, exactly the single-row passes in row order); the
tile's grad_x pass starts its vectors at a 64-byte boundary of grad_x and runs
downwards when grad_x lies just after grad_y or x modulo 4 KiB (:func:`gx_downwards`).
The skewed schedule prefetches (:func:`._simd.prefetch_at`) what the next loop reads
from memory and the grad_x lines it is about to write (measured: without it, a single
thread keeps too few memory reads in flight while it computes from cache); the plain
tiles, whose rows are cache-resident (at most the driver's ``TILE_MAX_BYTES``), do not
(measured, float32, 1 thread, tiles with / without the hints: (121, 1024) in cache
50-55 / 48-53 us at placements without aliasing; x of 2 MiB, (512, 1024), 237 / 175
us, (128, 4096) 257 / 220 us, medians of five alternating processes). RMSNorm runs rows shorter
than the driver's ``RMS_ROWS_FROM_N`` skewed too, longer ones row by row, and rows of at
least ``PAIR_MIN_N`` two per pass. A grad_x far larger than the
caches, with every row's vectors aligned, is written with streaming stores instead
(``*_stream_backward_*``: the skewed schedule, LayerNorm rows of at least
``TILE_MIN_N`` in tiles, ``ln_stream_tiled_backward_*``), which saves reading its lines
before writing them; these prefetch into L2 only, the skewed rows
``STREAM_PREFETCH_BYTES`` of rows ahead. Measured, float32, 1 thread, from DRAM,
fraction of the ``np.add`` floor, streaming tiles / streaming skewed rows: (2048, 4096)
0.73 / 0.65-0.66, (4096, 2048) 0.74 / 0.68, (512, 16384) 0.71 / 0.63; (8192, 1024)
0.72-0.73 / 0.79-0.84, (16384, 256) 0.66 / 0.82.

The parallel kernels hand out the short last block first, then the others in order
(``short_block_first``): Numba gives each thread an equal run of iterations, the first
threads one more where they do not divide, so the short last block joins a longer run
(blocks of 64, 64 and 12 rows on 2 threads: 76 and 64 rows instead of 128 and 12;
measured, (140, 1024) float32 in cache, 2 threads, LayerNorm 55-60 -> 48 us; (161, 768)
35-37 -> 28-32 us). Each thread still walks its blocks upwards through memory: taking
all blocks last first made rows from DRAM 1.2-1.3x slower at 2 threads ((65536, 64),
(16384, 256)), the hardware prefetchers restarting at every block. Which thread computes
a block changes no bit.

A parallel call of at most one block of rows (``block_rows``), which the row-block
kernels would run on one thread, takes ``*_split_backward_parallel`` instead: the rows'
sums spread over threads, then the output pass in items of ``SPLIT_COLUMNS`` columns of
every row, each item adding its columns' dw/db terms block by block in row order (the
same operations per element and the same order per partial, so the same bits).

The column layout (``inner > 1``) gathers each column into a scratch row and runs the
row helpers on it; so do rows of any other stride (``*_gathered_backward_*``), through
a pair of scratch rows, or up to :data:`GATHER_BYTES` of them gathered column by column where
an array's rows are the columns of a C-ordered one (a transposed x).

``grad_residual`` (the gradient reaching the normalized input from the residual stream)
is fused into the grad_x stores: every kernel takes it as ``gres`` with a flag
``has_res``, adds it to grad_x in the accumulation type and rounds once, exactly the
unfused ``grad_x + grad_residual`` for float32/float64 and the contract's single
rounding for 16-bit types. Without it, ``gres`` is x itself (same type: one compiled
kernel serves both) and is never read.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._scalars import cast, imax, imin, narrow, widen
from ._simd import (
    alive,
    get,
    itemsize,
    prefetch_at,
    prefetch_l2_at,
    put,
    raw,
    runtime,
    splat,
    store_fence,
    times_w,
    vaddress,
    vload,
    vload_tail,
    vstore,
    vstore_nt,
)
from .callee import callee_njit
from .diskcache import cached_njit
from .rowmath import (
    ALIAS_BYTES,
    LANES,
    PLAIN,
    STREAM,
    aligned_head,
    column_major,
    copy_row,
    tree_sum,
)

#: Rows at least this long run the backward two rows per pass in the any-stride path
#: (no effect on results; measured: it pays once the partial sums no longer fit in L1).
PAIR_MIN_N = 2048
#: Unit-stride rows at least this long take the tiled backward kernels (four rows per
#: tile) where grad_x is written with streaming stores, shorter ones the skewed kernels
#: (no effect on results; measured, see below). With plain stores the driver picks by
#: length and size (its ``TILE_FROM_N``).
TILE_MIN_N = 2048
#: Rows per tile of the tiled backward.
TILE_ROWS = 4
#: Columns per grad_weight/grad_bias partial block in the channels-first backward.
COL_BLOCK = 64
#: Unit-stride rows shorter than this take the short-row backward kernels, which keep
#: the partial sums in registers (no effect on results).
SHORT_BACKWARD_N = 5 * LANES
#: Columns per work item of the column-split parallel kernels (``*_split_backward_parallel``:
#: a multiple of every ``LANES``; no effect on results).
SPLIT_COLUMNS = 128
#: The streaming backward kernels prefetch grad_y and x this many bytes of rows ahead
#: (at least two rows) into L2 (:func:`._simd.prefetch_l2_at`; no effect on results).
#: Measured, float32, 1 thread, from DRAM, fraction of the ``np.add`` floor, against
#: two rows ahead into L1 (the plain kernels' hints): (8192, 1024) 0.68-0.88 /
#: 0.47-0.60, (16384, 256) 0.79-1.03 / 0.82-0.89, (2048, 4096) 0.71 / 0.55, (512, 16384)
#: 0.66 / 0.53, (4096, 768) 0.87 / 0.65 (8-64 KiB ahead: within a few percent).
STREAM_PREFETCH_BYTES = 32 << 10


@njit(inline="always", error_model="numpy")
def _ln_bwd_means(gyr, xr, r, n, mean, rstd, w):
    """(mean of g, mean of g * xhat) of row ``r``, ``g = dy * w``."""
    like = mean
    zero = splat(cast(0.0, like))
    mv = splat(mean)
    rv = splat(rstd)
    acc_g = zero
    acc_gx = zero
    body = n - n % LANES
    for i in range(0, body, LANES):
        g = vload(gyr, r, i)
        g = times_w(g, w, i)
        xh = (vload(xr, r, i) - mv) * rv
        acc_g = acc_g + g
        acc_gx = acc_gx + g * xh
    if body < n:
        # Lanes past the row: g = 0 and x = mean, so they add exactly nothing.
        count = n - body
        g = vload_tail(gyr, r, body, count, cast(0.0, like)) * vload_tail(
            w, 0, body, count, cast(0.0, like))
        xh = (vload_tail(xr, r, body, count, mean) - mv) * rv
        acc_g = acc_g + g
        acc_gx = acc_gx + g * xh
    inv_n = cast(1.0, like) / cast(n, like)
    return tree_sum(acc_g) * inv_n, tree_sum(acc_gx) * inv_n


@njit(inline="always", error_model="numpy")
def _ln_bwd_rows_out(gyr, xr, gxr, ra, rb, two, c0, c1, sa, sb, w, dw, db, grr, has_res):
    """grad_x of columns ``c0 .. c1`` of rows ``ra`` and (if ``two``) ``rb``; their terms
    added to dw/db in order.

    ``sa``/``sb`` are (mean, rstd, mean_g, mean_gx) of each row. Two rows per pass read
    and write the partial sums once for both: ``dw = (dw + a) + b`` is exactly what two
    single-row passes compute. With ``has_res`` the same rows of ``grr`` (grad_residual)
    are added to grad_x in the accumulation type before its one rounding.
    """
    mva, rva, mga, mgxa = splat(sa[0]), splat(sa[1]), splat(sa[2]), splat(sa[3])
    mvb, rvb, mgb, mgxb = splat(sb[0]), splat(sb[1]), splat(sb[2]), splat(sb[3])
    body = c0 + (c1 - c0) // LANES * LANES
    for i in range(c0, body, LANES):
        dya = vload(gyr, ra, i)
        xha = (vload(xr, ra, i) - mva) * rva
        ga = ((times_w(dya, w, i) - mga) - xha * mgxa) * rva
        vstore(gxr, ga + vload(grr, ra, i) if has_res else ga, ra, i)
        tw = vload(dw, 0, i) + dya * xha
        tb = vload(db, 0, i) + dya
        if two:
            dyb = vload(gyr, rb, i)
            xhb = (vload(xr, rb, i) - mvb) * rvb
            gb = ((times_w(dyb, w, i) - mgb) - xhb * mgxb) * rvb
            vstore(gxr, gb + vload(grr, rb, i) if has_res else gb, rb, i)
            tw = tw + dyb * xhb
            tb = tb + dyb
        vstore(dw, tw, 0, i)
        vstore(db, tb, 0, i)
    for i in range(body, c1):
        dya = widen(get(gyr, ra, i))
        xha = (widen(get(xr, ra, i)) - sa[0]) * sa[1]
        ga = ((times_w(dya, w, i) - sa[2]) - xha * sa[3]) * sa[1]
        put(gxr, ra, i, narrow(ga + widen(get(grr, ra, i)) if has_res else ga, gxr))
        tw = get(dw, 0, i) + dya * xha
        tb = get(db, 0, i) + dya
        if two:
            dyb = widen(get(gyr, rb, i))
            xhb = (widen(get(xr, rb, i)) - sb[0]) * sb[1]
            gb = ((times_w(dyb, w, i) - sb[2]) - xhb * sb[3]) * sb[1]
            put(gxr, rb, i, narrow(gb + widen(get(grr, rb, i)) if has_res else gb, gxr))
            tw = tw + dyb * xhb
            tb = tb + dyb
        put(dw, 0, i, tw)
        put(db, 0, i, tb)


@njit(inline="always", error_model="numpy")
def _ln_bwd_vector(gyr, xr, gxr, r, i, w, mv, rv, mgv, mgxv, dwk, dbk, grr, has_res):
    """grad_x of one vector of row ``r`` (plus grad_residual with ``has_res``); returns
    the updated dw/db partial vectors."""
    dy = vload(gyr, r, i)
    xh = (vload(xr, r, i) - mv) * rv
    g = ((times_w(dy, w, i) - mgv) - xh * mgxv) * rv
    vstore(gxr, g + vload(grr, r, i) if has_res else g, r, i)
    return dwk + dy * xh, dbk + dy


@callee_njit
def _ln_bwd_rows_short(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0, r1, gres, has_res):
    """:func:`_ln_bwd_rows` for contiguous rows shorter than ``5 * LANES`` (four vectors + tail).

    The block's dw/db partial vectors stay in registers across its rows instead of being
    read and written per row (the same additions in the same order, so the same bits).
    """
    n = x.shape[1]
    nv = imin(n // LANES, 4)
    xv, gyv, gxv, wv = raw(x), raw(gy), raw(gx), raw(w)
    grv = raw(gres)
    dw = raw(partials[0, blk])
    db = raw(partials[1, blk])
    zero = splat(cast(0.0, mean_in[0]))
    dw0 = vload(dw, 0, 0) if nv > 0 else zero
    db0 = vload(db, 0, 0) if nv > 0 else zero
    dw1 = vload(dw, 0, LANES) if nv > 1 else zero
    db1 = vload(db, 0, LANES) if nv > 1 else zero
    dw2 = vload(dw, 0, 2 * LANES) if nv > 2 else zero
    db2 = vload(db, 0, 2 * LANES) if nv > 2 else zero
    dw3 = vload(dw, 0, 3 * LANES) if nv > 3 else zero
    db3 = vload(db, 0, 3 * LANES) if nv > 3 else zero
    for r in range(r0, r1):
        m, s = mean_in[r], rstd_in[r]
        mg, mgx = _ln_bwd_means(gyv, xv, r, n, m, s, wv)
        mv, rv, mgv, mgxv = splat(m), splat(s), splat(mg), splat(mgx)
        if nv > 0:
            dw0, db0 = _ln_bwd_vector(gyv, xv, gxv, r, 0, wv, mv, rv, mgv, mgxv, dw0, db0,
                                      grv, has_res)
        if nv > 1:
            dw1, db1 = _ln_bwd_vector(gyv, xv, gxv, r, LANES, wv, mv, rv, mgv, mgxv, dw1,
                                      db1, grv, has_res)
        if nv > 2:
            dw2, db2 = _ln_bwd_vector(gyv, xv, gxv, r, 2 * LANES, wv, mv, rv, mgv, mgxv,
                                      dw2, db2, grv, has_res)
        if nv > 3:
            dw3, db3 = _ln_bwd_vector(gyv, xv, gxv, r, 3 * LANES, wv, mv, rv, mgv, mgxv,
                                      dw3, db3, grv, has_res)
        for i in range(nv * LANES, n):
            dy = widen(get(gyv, r, i))
            xh = (widen(get(xv, r, i)) - m) * s
            g = ((times_w(dy, wv, i) - mg) - xh * mgx) * s
            put(gxv, r, i, narrow(g + widen(get(grv, r, i)) if has_res else g, gxv))
            put(dw, 0, i, get(dw, 0, i) + dy * xh)
            put(db, 0, i, get(db, 0, i) + dy)
    if nv > 0:
        vstore(dw, dw0, 0, 0)
        vstore(db, db0, 0, 0)
    if nv > 1:
        vstore(dw, dw1, 0, LANES)
        vstore(db, db1, 0, LANES)
    if nv > 2:
        vstore(dw, dw2, 0, 2 * LANES)
        vstore(db, db2, 0, 2 * LANES)
    if nv > 3:
        vstore(dw, dw3, 0, 3 * LANES)
        vstore(db, db3, 0, 3 * LANES)


#: The any-stride backward gathers rows this many bytes (of each array) at a time, up to
#: a block of rows, when one of its arrays has its rows as the columns of a C-ordered
#: array (a transposed or Fortran-ordered x, grad_y or grad_x): a sweep over the
#: columns then reads or writes many neighbouring elements of each line instead of one
#: per row (no effect on results: an even number of rows, so the pairs of rows stay
#: those of a whole block). Measured, float32, 1 thread, LayerNorm backward of a
#: transposed x, C-ordered grad_y: (2048, 1024) 11.4 ms row by row, 6.5 / 5.9 / 4.2 ms
#: gathering 16 / 32 / 64 rows (torch 4.0-4.5 ms); (8192, 256) 4.8 / 8.5 / 4.7 ms;
#: (1024, 4096) 13.0 / 12.2 / 12.5 ms.
GATHER_BYTES = 256 << 10


@njit(inline="always", error_model="numpy")
def _gathered_scratch(rows, n, like):
    # Scratch rows padded by a vector: rows a multiple of 4 KiB apart, written a column
    # at a time, would all fall in one set of the L1 cache.
    return np.empty((rows, n + LANES), dtype=like.dtype)[:, :n]


@njit(inline="always", error_model="numpy")
def _gather_block(dst, src, s0, s1, by_columns):
    """Rows ``s0 .. s1`` of ``src`` into rows ``0 ..`` of ``dst``: column by column
    (``by_columns``) or row by row."""
    if by_columns:
        for i in range(src.shape[1]):
            for r in range(s0, s1):
                dst[r - s0, i] = src[r, i]
    else:
        for r in range(s0, s1):
            copy_row(dst, r - s0, src, r)


@njit(inline="always", error_model="numpy")
def _scatter_block(dst, src, s0, s1, by_columns):
    """Rows ``0 ..`` of ``src`` into rows ``s0 .. s1`` of ``dst`` (as
    :func:`_gather_block`)."""
    if by_columns:
        for i in range(dst.shape[1]):
            for r in range(s0, s1):
                dst[r, i] = src[r - s0, i]
    else:
        for r in range(s0, s1):
            copy_row(dst, r, src, r - s0)


@njit(inline="always", error_model="numpy")
def _gathered_scratches(gy, x, gx, gres, has_res, rows):
    """The any-stride backward's scratch for a block of ``rows`` rows: ``(count,
    columns, xs, gys, gxs, grs)``, the rows per gather (when an array is column-major,
    as many even rows as :data:`GATHER_BYTES` hold, else 2), which of x, grad_y,
    grad_x and grad_residual are column-major, and their scratch rows."""
    n = x.shape[1]
    columns = (column_major(x), column_major(gy), column_major(gx),
               has_res and column_major(gres))
    count = 2
    if columns[0] or columns[1] or columns[2] or columns[3]:
        count = imax(2, imin(rows, GATHER_BYTES // imax(1, n * x.itemsize)) // 2 * 2)
    return (count, columns, _gathered_scratch(count, n, x), _gathered_scratch(count, n, gy),
            _gathered_scratch(count, n, gx), _gathered_scratch(count, n if has_res else 0,
                                                               gres))


@njit(inline="always", error_model="numpy")
def _pair_rows(r, s0, s1, n):
    """``(two, ra, rb)``: whether row ``r`` of a gather ``s0 .. s1`` goes with ``r + 1``
    (rows of at least ``PAIR_MIN_N``, the pairs of a whole block) and their scratch
    rows (``rb = ra`` alone)."""
    two = n >= PAIR_MIN_N and r + 1 < s1
    ra = r - s0
    return two, ra, ra + 1 if two else ra


@njit(inline="always", error_model="numpy")
def _gather_inputs(xs, gys, grs, x, gy, gres, s0, s1, columns, has_res):
    """Rows ``s0 .. s1`` of x, grad_y and (``has_res``) grad_residual into their scratch
    (:func:`_gathered_scratches`)."""
    _gather_block(xs, x, s0, s1, columns[0])
    _gather_block(gys, gy, s0, s1, columns[1])
    if has_res:
        _gather_block(grs, gres, s0, s1, columns[3])


@njit(inline="always", error_model="numpy")
def _store_gx(gxr, g, r, i, stream):
    """A vector of grad_x stored: plainly, or with ``stream`` (:data:`.rowmath.STREAM`)
    a streaming store to an aligned address."""
    if stream is None:
        vstore(gxr, g, r, i)
    else:
        vstore_nt(gxr, g, r, i)


@njit(inline="always", error_model="numpy")
def _read_hint(address, offset, stream):
    """The line at ``address + offset`` will be read soon: into L1 for the plain kernels,
    into L2 only for the streaming ones (``stream``)."""
    if stream is None:
        prefetch_at(address, offset, False)
    else:
        prefetch_l2_at(address, offset)


def _gx_value(gyr, xr, r, i, wvec, mv, rv, mgv, mgxv, grr, has_res):
    """grad_x of one vector of row ``r`` (plus grad_residual with ``has_res``), not
    stored, and its (dy, dy * xhat), the row's dw/db terms."""
    dy = vload(gyr, r, i)
    xh = (vload(xr, r, i) - mv) * rv
    g = ((dy * wvec - mgv) - xh * mgxv) * rv
    return (g + vload(grr, r, i) if has_res else g), dy, dy * xh


def _gx_vec(gyr, xr, gxr, r, i, wvec, mv, rv, mgv, mgxv, grr, has_res, stream):
    """grad_x of one vector of row ``r`` stored (plus grad_residual with ``has_res``;
    a streaming store with ``stream``, :data:`.rowmath.STREAM`, to an aligned address);
    returns its (dy, dy * xhat), the row's dw/db terms."""
    g, dy, t = _gx_value(gyr, xr, r, i, wvec, mv, rv, mgv, mgxv, grr, has_res)
    _store_gx(gxr, g, r, i, stream)
    return dy, t


def _gx_scalar(gyr, xr, gxr, r, i, w, m, s, mg, mgx, grr, has_res):
    """:func:`_gx_vec` of element ``i`` alone."""
    dy = widen(get(gyr, r, i))
    xh = (widen(get(xr, r, i)) - m) * s
    g = ((times_w(dy, w, i) - mg) - xh * mgx) * s
    put(gxr, r, i, narrow(g + widen(get(grr, r, i)) if has_res else g, gxr))
    return dy, dy * xh


def _acc_means(gyr, xr, r, i, wvec, mv, rv, ag, ax):
    """One vector of row ``r`` added to its sums of g and g * xhat."""
    g = vload(gyr, r, i) * wvec
    return ag + g, ax + g * ((vload(xr, r, i) - mv) * rv)


def _acc_means_tail(gyr, xr, r, body, count, wt, m, mv, rv, ag, ax):
    """The last partial vector of row ``r`` (lanes past the row add exactly nothing)."""
    g = vload_tail(gyr, r, body, count, cast(0.0, m)) * wt
    return ag + g, ax + g * ((vload_tail(xr, r, body, count, m) - mv) * rv)


# The row helpers twice: inlined into the skewed loops (measured about 20% faster
# there), and compiled once as functions for the tiled kernel, whose four rows per
# loop would otherwise be typed once per call site (compile time).
_gx_value_fn = callee_njit(_gx_value)
_gx_value = njit(inline="always", error_model="numpy")(_gx_value)
_gx_scalar_fn = callee_njit(_gx_scalar)
_acc_means_fn = callee_njit(_acc_means)
_acc_means_tail_fn = callee_njit(_acc_means_tail)
_gx_vec = njit(inline="always", error_model="numpy")(_gx_vec)
_gx_scalar = njit(inline="always", error_model="numpy")(_gx_scalar)
_acc_means = njit(inline="always", error_model="numpy")(_acc_means)
_acc_means_tail = njit(inline="always", error_model="numpy")(_acc_means_tail)


@callee_njit
def _ln_bwd_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0, r1, gres, has_res,
                 stream):
    """Unit-stride rows ``r0 .. r1`` (partial block ``blk``), skewed: one loop computes
    grad_x of row ``r`` (in cache) and the means of row ``r + 1`` (from memory),
    prefetching row ``r + 2`` and, for writing, the grad_x of row ``r + 1``. With
    ``stream`` (:data:`.rowmath.STREAM`; grad_x's vectors aligned, see
    the driver's ``streams_gradient``) grad_x is written with streaming stores instead,
    and the rows ``STREAM_PREFETCH_BYTES`` ahead are prefetched into L2.

    Each row's sums, grad_x and dw/db terms are those of :func:`_ln_bwd_means` and
    :func:`_ln_bwd_rows_out` (the same operations in the same order).
    """
    n = x.shape[1]
    last = x.shape[0] - 1
    gyv, xv, gxv, grv, wv = raw(gy), raw(x), raw(gx), raw(gres), raw(w)
    dw = raw(partials[0, blk])
    db = raw(partials[1, blk])
    like = mean_in[r0]
    zero = splat(cast(0.0, like))
    inv_n = cast(1.0, like) / cast(n, like)
    body = n - n % LANES
    ahead = 2 if stream is None else imax(2, -(-STREAM_PREFETCH_BYTES // (n * itemsize(gyv))))
    mg, mgx = _ln_bwd_means(gyv, xv, r0, n, mean_in[r0], rstd_in[r0], wv)
    for r in range(r0, r1):
        # The block's last row computes the means of itself again, unused.
        rn = r + 1 if r + 1 < r1 else r
        gpf = vaddress(gyv, imin(r + ahead, last), 0)
        xpf = vaddress(xv, imin(r + ahead, last), 0)
        wpf = vaddress(gxv, imin(r + 1, last), 0)
        # grad_residual is read by the grad_x pass only, a row after grad_y and x
        rpf = vaddress(grv, imin(r + ahead - 1, last), 0)
        m, s = mean_in[r], rstd_in[r]
        mn = mean_in[rn]
        mv, rv, mgv, mgxv = splat(m), splat(s), splat(mg), splat(mgx)
        mvn, rvn = splat(mn), splat(rstd_in[rn])
        ag = zero
        ax = zero
        for i in range(0, body, LANES):
            o = i * itemsize(gyv)
            _read_hint(gpf, o, stream)
            _read_hint(xpf, o, stream)
            if has_res:
                _read_hint(rpf, o, stream)
            if stream is None:
                prefetch_at(wpf, i * itemsize(gxv), True)
            wvec = vload(wv, 0, i)
            # Every load of the iteration before its first store: a load from a pending
            # store's offset in the 4 KiB page waits for it (the rows of db sit a
            # multiple of 4 KiB after dw's for rows of 1024 float32).
            ag, ax = _acc_means(gyv, xv, rn, i, wvec, mvn, rvn, ag, ax)
            dwv = vload(dw, 0, i)
            dbv = vload(db, 0, i)
            dy, t = _gx_vec(gyv, xv, gxv, r, i, wvec, mv, rv, mgv, mgxv, grv, has_res,
                            stream)
            vstore(dw, dwv + t, 0, i)
            vstore(db, dbv + dy, 0, i)
        for i in range(body, n):
            dy, t = _gx_scalar(gyv, xv, gxv, r, i, wv, m, s, mg, mgx, grv, has_res)
            put(dw, 0, i, get(dw, 0, i) + t)
            put(db, 0, i, get(db, 0, i) + dy)
        if body < n:
            wt = vload_tail(wv, 0, body, n - body, cast(0.0, like))
            ag, ax = _acc_means_tail(gyv, xv, rn, body, n - body, wt, mn, mvn, rvn, ag, ax)
        mg = tree_sum(ag) * inv_n
        mgx = tree_sum(ax) * inv_n
    if stream is not None:
        store_fence()  # streaming stores done before another thread reads grad_x


@njit(inline="always", error_model="numpy")
def gx_downwards(gyv, xv, gxv):
    """Whether the tiled kernels' grad_x pass runs downwards: when grad_x lies nearer
    after grad_y or x than before them, modulo ``ALIAS_BYTES`` (no effect on results).

    Upwards, a load of grad_y or x a few vectors ahead shares the low 12 address bits
    of a grad_x store still in flight when grad_x lies a little after it, and waits
    (4 KiB aliasing); downwards, when it lies a little before. Measured, Zen 4,
    float32, 1 thread, in cache, x at a page boundary, grad_y 2 KiB after it, grad_x
    1 KiB / 64 / 144 / 256 bytes after x, upwards: (121, 1024) 50 / 66 / 59 / 50 us,
    (60, 2048) 47 / 63 / 68 / 61 us."""
    dx = (vaddress(gxv, 0, 0) - vaddress(xv, 0, 0)) % ALIAS_BYTES
    dg = (vaddress(gxv, 0, 0) - vaddress(gyv, 0, 0)) % ALIAS_BYTES
    after = imin(dx if dx > 0 else ALIAS_BYTES, dg if dg > 0 else ALIAS_BYTES)
    before = imin(ALIAS_BYTES - dx, ALIAS_BYTES - dg)
    return before > after


@callee_njit
def _ln_bwd_tile_means(gyr, xr, gxr, r, n, mean_in, rstd_in, w, stream):
    """(mean of g, mean of g * xhat) of the ``TILE_ROWS`` rows from ``r``, their first
    passes interleaved (each row's additions as :func:`_ln_bwd_means` makes them)."""
    rb, rc, rd = r + 1, r + 2, r + 3
    ma, mb, mc, md = mean_in[r], mean_in[rb], mean_in[rc], mean_in[rd]
    mva, mvb, mvc, mvd = splat(ma), splat(mb), splat(mc), splat(md)
    rva, rvb = splat(rstd_in[r]), splat(rstd_in[rb])
    rvc, rvd = splat(rstd_in[rc]), splat(rstd_in[rd])
    zero = splat(cast(0.0, ma))
    aga, axa, agb, axb, agc, axc, agd, axd = zero, zero, zero, zero, zero, zero, zero, zero
    body = n - n % LANES
    for i in range(0, body, LANES):
        wvec = vload(w, 0, i)
        aga, axa = _acc_means_fn(gyr, xr, r, i, wvec, mva, rva, aga, axa)
        agb, axb = _acc_means_fn(gyr, xr, rb, i, wvec, mvb, rvb, agb, axb)
        agc, axc = _acc_means_fn(gyr, xr, rc, i, wvec, mvc, rvc, agc, axc)
        agd, axd = _acc_means_fn(gyr, xr, rd, i, wvec, mvd, rvd, agd, axd)
    if body < n:
        count = n - body
        wt = vload_tail(w, 0, body, count, cast(0.0, ma))
        aga, axa = _acc_means_tail_fn(gyr, xr, r, body, count, wt, ma, mva, rva, aga, axa)
        agb, axb = _acc_means_tail_fn(gyr, xr, rb, body, count, wt, mb, mvb, rvb, agb, axb)
        agc, axc = _acc_means_tail_fn(gyr, xr, rc, body, count, wt, mc, mvc, rvc, agc, axc)
        agd, axd = _acc_means_tail_fn(gyr, xr, rd, body, count, wt, md, mvd, rvd, agd, axd)
    inv_n = cast(1.0, ma) / cast(n, ma)
    return ((tree_sum(aga) * inv_n, tree_sum(axa) * inv_n),
            (tree_sum(agb) * inv_n, tree_sum(axb) * inv_n),
            (tree_sum(agc) * inv_n, tree_sum(axc) * inv_n),
            (tree_sum(agd) * inv_n, tree_sum(axd) * inv_n))


@callee_njit
def _ln_bwd_tile_out(gyr, xr, gxr, r, n, mean_in, rstd_in, sums, w, dw, db, grr, has_res,
                     nxt, down, stream):
    """grad_x of the ``TILE_ROWS`` rows from ``r`` and their dw/db terms, added in row
    order with one read and write of the partial vectors per tile: ``dw = ((dw + a) + b)
    + ...`` is exactly the single-row passes. The vectors go downwards with ``down``
    (:func:`gx_downwards`). With ``stream`` (streaming stores, rows from memory),
    prefetches grad_y and x of the rows from ``nxt`` (the next tile) into L2."""
    (mga, mgxa), (mgb, mgxb), (mgc, mgxc), (mgd, mgxd) = sums
    rb, rc, rd = r + 1, r + 2, r + 3
    ma, sa, mb, sb = mean_in[r], rstd_in[r], mean_in[rb], rstd_in[rb]
    mc, sc, md, sd = mean_in[rc], rstd_in[rc], mean_in[rd], rstd_in[rd]
    mva, rva, mgva, mgxva = splat(ma), splat(sa), splat(mga), splat(mgxa)
    mvb, rvb, mgvb, mgxvb = splat(mb), splat(sb), splat(mgb), splat(mgxb)
    mvc, rvc, mgvc, mgxvc = splat(mc), splat(sc), splat(mgc), splat(mgxc)
    mvd, rvd, mgvd, mgxvd = splat(md), splat(sd), splat(mgd), splat(mgxd)
    # grad_x's vectors start at its first 64-byte boundary (aligned_head; the elements
    # before it, and after the last whole vector, one at a time): a misaligned vector
    # spans two lines, and rows a multiple of 4 KiB long put the tile's lines of
    # grad_y, x and grad_x in one L1 set, which then holds too few of them (measured,
    # (121, 1024) float32, 1 thread, in cache, all three 16 bytes past a page, with the
    # loads before the stores: 81-86 -> 68-69 us, 61-63 us once the prefetches went).
    # Each element's arithmetic is the same whichever vector holds it (the same bits).
    head = aligned_head(gxr, r, n)
    body = head + (n - head) // LANES * LANES
    _ln_bwd_tile_cols(gyr, xr, gxr, r, mean_in, rstd_in, sums, w, dw, db, grr, has_res,
                      runtime(0), head)  # (a literal 0 would compile a second copy)
    gbase = vaddress(gyr, nxt, 0)
    xbase = vaddress(xr, nxt, 0)
    rbase = vaddress(grr, nxt, 0)
    step = TILE_ROWS * itemsize(gyr)
    for k in range(head, body, LANES):
        i = head + body - LANES - k if down else k
        if stream is not None:
            o = i * step
            prefetch_l2_at(gbase, o)
            prefetch_l2_at(gbase, o + 64)
            prefetch_l2_at(gbase, o + 128)
            prefetch_l2_at(gbase, o + 192)
            prefetch_l2_at(xbase, o)
            prefetch_l2_at(xbase, o + 64)
            prefetch_l2_at(xbase, o + 128)
            prefetch_l2_at(xbase, o + 192)
            # (without grad_residual, x stands in: its lines again, no branch)
            prefetch_l2_at(rbase, o)
            prefetch_l2_at(rbase, o + 64)
            prefetch_l2_at(rbase, o + 128)
            prefetch_l2_at(rbase, o + 192)
        wvec = vload(w, 0, i)
        dwv = vload(dw, 0, i)  # before the stores (4K aliasing, as in _ln_bwd_rows)
        dbv = vload(db, 0, i)
        # The four rows' loads before their stores: the rows of grad_y, x and grad_x
        # are a multiple of 4 KiB long for rows of 1024 float32, so a load from the
        # next row's offset in the page would wait on the pending store of this one.
        ga, dya, ta = _gx_value_fn(gyr, xr, r, i, wvec, mva, rva, mgva, mgxva, grr,
                                   has_res)
        gb, dyb, tb = _gx_value_fn(gyr, xr, rb, i, wvec, mvb, rvb, mgvb, mgxvb, grr,
                                   has_res)
        gc, dyc, tc = _gx_value_fn(gyr, xr, rc, i, wvec, mvc, rvc, mgvc, mgxvc, grr,
                                   has_res)
        gd, dyd, td = _gx_value_fn(gyr, xr, rd, i, wvec, mvd, rvd, mgvd, mgxvd, grr,
                                   has_res)
        _store_gx(gxr, ga, r, i, stream)
        _store_gx(gxr, gb, rb, i, stream)
        _store_gx(gxr, gc, rc, i, stream)
        _store_gx(gxr, gd, rd, i, stream)
        vstore(dw, (((dwv + ta) + tb) + tc) + td, 0, i)
        vstore(db, (((dbv + dya) + dyb) + dyc) + dyd, 0, i)
    _ln_bwd_tile_cols(gyr, xr, gxr, r, mean_in, rstd_in, sums, w, dw, db, grr, has_res,
                      body, n)


@callee_njit
def _ln_bwd_tile_cols(gyr, xr, gxr, r, mean_in, rstd_in, sums, w, dw, db, grr, has_res,
                      c0, c1):
    """:func:`_ln_bwd_tile_out` of columns ``c0 .. c1``, one element at a time."""
    for i in range(c0, c1):
        tw = get(dw, 0, i)
        tb = get(db, 0, i)
        for q in range(TILE_ROWS):  # one loop body, not four (compile time)
            mg, mgx = sums[q]
            dy, t = _gx_scalar_fn(gyr, xr, gxr, r + q, i, w, mean_in[r + q], rstd_in[r + q],
                                  mg, mgx, grr, has_res)
            tw = tw + t
            tb = tb + dy
        put(dw, 0, i, tw)
        put(db, 0, i, tb)


@callee_njit
def _ln_bwd_tiles(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0, r1, gres, has_res,
                  stream):
    """Unit-stride rows ``r0 .. r1`` (partial block ``blk``) in tiles of ``TILE_ROWS``
    rows; the rows after the block's last full tile one by one (tiles never cross blocks).

    The tile code has no per-row conditions, so that LLVM does not version its loops
    (compile time)."""
    n = x.shape[1]
    rows = x.shape[0]
    gyv, xv, gxv, grv, wv = raw(gy), raw(x), raw(gx), raw(gres), raw(w)
    dw = raw(partials[0, blk])
    db = raw(partials[1, blk])
    full = r0 + (r1 - r0) // TILE_ROWS * TILE_ROWS
    # (streaming stores, rows from DRAM, keep the upward pass: not measured there)
    down = stream is None and gx_downwards(gyv, xv, gxv)
    for r in range(r0, full, TILE_ROWS):
        sums = _ln_bwd_tile_means(gyv, xv, gxv, r, n, mean_in, rstd_in, wv, stream)
        # The last tile prefetches itself again (cached already).
        nxt = r + TILE_ROWS if r + 2 * TILE_ROWS <= rows else r
        _ln_bwd_tile_out(gyv, xv, gxv, r, n, mean_in, rstd_in, sums, wv, dw, db, grv,
                         has_res, nxt, down, stream)
    # The last rows one by one, from the tile's compiled helpers (compile time).
    body = n - n % LANES
    for r in range(full, r1):
        m, s = mean_in[r], rstd_in[r]
        mv, rv = splat(m), splat(s)
        ag = splat(cast(0.0, m))
        ax = ag
        for i in range(0, body, LANES):
            ag, ax = _acc_means_fn(gyv, xv, r, i, vload(wv, 0, i), mv, rv, ag, ax)
        if body < n:
            wt = vload_tail(wv, 0, body, n - body, cast(0.0, m))
            ag, ax = _acc_means_tail_fn(gyv, xv, r, body, n - body, wt, m, mv, rv, ag, ax)
        inv_n = cast(1.0, m) / cast(n, m)
        mg = tree_sum(ag) * inv_n
        mgx = tree_sum(ax) * inv_n
        mgv, mgxv = splat(mg), splat(mgx)
        for i in range(0, body, LANES):
            g, dy, t = _gx_value_fn(gyv, xv, r, i, vload(wv, 0, i), mv, rv, mgv, mgxv, grv,
                                    has_res)
            _store_gx(gxv, g, r, i, stream)
            vstore(dw, vload(dw, 0, i) + t, 0, i)
            vstore(db, vload(db, 0, i) + dy, 0, i)
        for i in range(body, n):
            dy, t = _gx_scalar_fn(gyv, xv, gxv, r, i, wv, m, s, mg, mgx, grv, has_res)
            put(dw, 0, i, get(dw, 0, i) + t)
            put(db, 0, i, get(db, 0, i) + dy)
    if stream is not None:
        store_fence()  # streaming stores done before another thread reads grad_x


@callee_njit
def _ln_bwd_gathered(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0, r1, gres, has_res):
    """Rows ``r0 .. r1`` of any stride: copied (in pairs for long rows) into contiguous
    scratch rows, computed as :func:`_ln_bwd_rows` computes them, copied back."""
    n = x.shape[1]
    count, columns, xs, gys, gxs, grs = _gathered_scratches(gy, x, gx, gres, has_res,
                                                            r1 - r0)
    a, b, c, d, wv = raw(gys), raw(xs), raw(gxs), raw(grs), raw(w)
    dw = raw(partials[0, blk])
    db = raw(partials[1, blk])
    for s0 in range(r0, r1, count):
        s1 = imin(r1, s0 + count)
        _gather_inputs(xs, gys, grs, x, gy, gres, s0, s1, columns, has_res)
        for r in range(s0, s1, 2 if n >= PAIR_MIN_N else 1):
            two, ra, rb = _pair_rows(r, s0, s1, n)
            ma, sa_ = mean_in[r], rstd_in[r]
            mb, sb_ = mean_in[r - ra + rb], rstd_in[r - ra + rb]
            ga, gxa = _ln_bwd_means(a, b, ra, n, ma, sa_, wv)
            gb, gxb = _ln_bwd_means(a, b, rb, n, mb, sb_, wv) if two else (ga, gxa)
            _ln_bwd_rows_out(a, b, c, ra, rb, two, 0, n, (ma, sa_, ga, gxa),
                             (mb, sb_, gb, gxb), wv, dw, db, d, has_res)
        _scatter_block(gx, gxs, s0, s1, columns[2])
    alive(xs)
    alive(gys)
    alive(gxs)
    alive(grs)


@njit(inline="always", error_model="numpy")
def _block_sums(partials):
    """``partials[:, blk, :]`` summed over ``blk`` in increasing order (deterministic),
    into ``partials[:, 0, :]``, which is returned (a view: the driver copies it out).

    In place: a new array here compiled Numba's ``np.empty`` for the signature, a
    quarter of a second of a cold first backward."""
    count, blocks, n = partials.shape
    for c in range(count):
        for blk in range(1, blocks):
            for i in range(n):
                partials[c, 0, i] = partials[c, 0, i] + partials[c, blk, i]
    return partials[:, 0, :]


@njit(inline="always")
def short_block_first(j, blocks):
    """The block a parallel loop's iteration ``j`` takes: the short last block first, then
    the others in order (module docstring)."""
    return blocks - 1 if j == 0 else j - 1


# Entry kernels, one per path so that a call compiles only its own: unit-stride rows
# (skewed), long cache-resident unit-stride rows (tiled), unit-stride rows shorter than
# SHORT_BACKWARD_N, rows of any stride. The driver picks;
# all give a row the same bits. Each returns the parameter-gradient partials summed
# over blocks in order, ``(count, n)``.


@cached_njit(error_model="numpy")
def ln_backward_serial(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres, has_res):
    """LayerNorm backward of unit-stride 2-D rows on the calling thread (the same blocks
    as the parallel kernel).

    With ``has_res``, ``gres`` (grad_residual, x's type) is added to grad_x; without,
    ``gres`` is any array of its type (x itself), never read.
    """
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _ln_bwd_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                     imin(rows, r0 + block_rows), gres, has_res, PLAIN)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def ln_backward_parallel(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres,
                         has_res):
    """:func:`ln_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _ln_bwd_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                     imin(rows, r0 + block_rows), gres, has_res, PLAIN)
    return _block_sums(partials)


@cached_njit(error_model="numpy")
def ln_stream_backward_serial(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres,
                              has_res):
    """:func:`ln_backward_serial` writing grad_x with streaming stores (grad_x's vectors
    aligned: the driver's ``streams_gradient``), for rows shorter than ``TILE_MIN_N``."""
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _ln_bwd_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                     imin(rows, r0 + block_rows), gres, has_res, STREAM)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def ln_stream_backward_parallel(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres,
                                has_res):
    """:func:`ln_stream_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _ln_bwd_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                     imin(rows, r0 + block_rows), gres, has_res, STREAM)
    return _block_sums(partials)


@cached_njit(error_model="numpy")
def ln_tiled_backward_serial(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres,
                             has_res):
    """:func:`ln_backward_serial` in tiles of ``TILE_ROWS`` rows (for long rows in
    cache)."""
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _ln_bwd_tiles(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                      imin(rows, r0 + block_rows), gres, has_res, PLAIN)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def ln_tiled_backward_parallel(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres,
                               has_res):
    """:func:`ln_tiled_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _ln_bwd_tiles(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                      imin(rows, r0 + block_rows), gres, has_res, PLAIN)
    return _block_sums(partials)


@cached_njit(error_model="numpy")
def ln_stream_tiled_backward_serial(gy, x, mean_in, rstd_in, w, gx, partials, block_rows,
                                    gres, has_res):
    """:func:`ln_tiled_backward_serial` writing grad_x with streaming stores (grad_x's
    vectors aligned: the driver's ``streams_gradient``)."""
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _ln_bwd_tiles(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                      imin(rows, r0 + block_rows), gres, has_res, STREAM)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def ln_stream_tiled_backward_parallel(gy, x, mean_in, rstd_in, w, gx, partials, block_rows,
                                      gres, has_res):
    """:func:`ln_stream_tiled_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _ln_bwd_tiles(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                      imin(rows, r0 + block_rows), gres, has_res, STREAM)
    return _block_sums(partials)


@cached_njit(error_model="numpy")
def ln_gathered_backward_serial(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres,
                                has_res):
    """:func:`ln_backward_serial` for rows of any stride."""
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _ln_bwd_gathered(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                         imin(rows, r0 + block_rows), gres, has_res)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def ln_gathered_backward_parallel(gy, x, mean_in, rstd_in, w, gx, partials, block_rows,
                                  gres, has_res):
    """:func:`ln_gathered_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _ln_bwd_gathered(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                         imin(rows, r0 + block_rows), gres, has_res)
    return _block_sums(partials)


@cached_njit(error_model="numpy")
def ln_short_backward_serial(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres,
                             has_res):
    """:func:`ln_backward_serial` for unit-stride rows shorter than ``SHORT_BACKWARD_N``
    (the partial sums kept in registers across each block's rows)."""
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _ln_bwd_rows_short(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                           imin(rows, r0 + block_rows), gres, has_res)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def ln_short_backward_parallel(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres,
                               has_res):
    """:func:`ln_short_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _ln_bwd_rows_short(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                           imin(rows, r0 + block_rows), gres, has_res)
    return _block_sums(partials)


@callee_njit
def _ln_bwd_columns(gy, x, mean_in, rstd_in, w, gx, partials, stats, block_rows, c0, c1,
                    gres, has_res):
    """grad_x of columns ``c0 .. c1`` of every row and their dw/db terms, block by block
    and row by row (:func:`_ln_bwd_rows_out` of one row; each partial's additions in row
    order, as the row kernels make them); ``stats[2 * r]``/``stats[2 * r + 1]`` are row
    ``r``'s (mean of g, mean of g * xhat)."""
    rows = x.shape[0]
    gyv, xv, gxv, grv, wv = raw(gy), raw(x), raw(gx), raw(gres), raw(w)
    for blk in range(partials.shape[1]):
        dw = raw(partials[0, blk])
        db = raw(partials[1, blk])
        for r in range(blk * block_rows, imin(rows, (blk + 1) * block_rows)):
            row = (mean_in[r], rstd_in[r], stats[2 * r], stats[2 * r + 1])
            _ln_bwd_rows_out(gyv, xv, gxv, r, r, False, c0, c1, row, row, wv, dw, db, grv,
                             has_res)


@cached_njit(parallel=True, error_model="numpy")
def ln_split_backward_parallel(gy, x, mean_in, rstd_in, w, gx, partials, block_rows, gres,
                               has_res):
    """:func:`ln_backward_serial` (and the tiled and short-row kernels: the same bits)
    for calls of few row blocks: the rows' sums spread over threads, then the output
    pass in items of ``SPLIT_COLUMNS`` columns of every row. Each item adds its columns'
    dw/db terms block by block in row order, so a call of one block of rows keeps every
    thread busy and the parameter gradients are those of the serial kernel."""
    rows, n = x.shape
    stats = np.empty(2 * rows, dtype=mean_in.dtype)
    for r in prange(rows):
        mg, mgx = _ln_bwd_means(raw(gy), raw(x), r, n, mean_in[r], rstd_in[r], raw(w))
        stats[2 * r] = mg
        stats[2 * r + 1] = mgx
    for c in prange(-(-n // SPLIT_COLUMNS)):
        c0 = c * SPLIT_COLUMNS
        _ln_bwd_columns(gy, x, mean_in, rstd_in, w, gx, partials, stats, block_rows, c0,
                        imin(n, c0 + SPLIT_COLUMNS), gres, has_res)
    return _block_sums(partials)


@njit(inline="always", error_model="numpy")
def _rms_bwd_mean(gyr, xr, r, n, rstd, w):
    """Mean of ``g * xhat`` of row ``r`` (``g = dy * w``, ``xhat = x * rstd``)."""
    like = rstd
    zero = splat(cast(0.0, like))
    rv = splat(rstd)
    acc = zero
    body = n - n % LANES
    for i in range(0, body, LANES):
        g = vload(gyr, r, i)
        g = times_w(g, w, i)
        acc = acc + g * (vload(xr, r, i) * rv)
    if body < n:
        count = n - body
        g = vload_tail(gyr, r, body, count, cast(0.0, like)) * vload_tail(
            w, 0, body, count, cast(0.0, like))
        acc = acc + g * (vload_tail(xr, r, body, count, cast(0.0, like)) * rv)
    return tree_sum(acc) * (cast(1.0, like) / cast(n, like))


@njit(inline="always", error_model="numpy")
def _rms_bwd_rows_out(gyr, xr, gxr, ra, rb, two, c0, c1, sa, sb, w, dw, grr, has_res):
    """grad_x of columns ``c0 .. c1`` of rows ``ra`` and (if ``two``) ``rb``, like
    :func:`_ln_bwd_rows_out`.

    ``sa``/``sb`` are (rstd, mean_gx) of each row.
    """
    rva, mgxa = splat(sa[0]), splat(sa[1])
    rvb, mgxb = splat(sb[0]), splat(sb[1])
    body = c0 + (c1 - c0) // LANES * LANES
    for i in range(c0, body, LANES):
        dya = vload(gyr, ra, i)
        xha = vload(xr, ra, i) * rva
        ga = (times_w(dya, w, i) - xha * mgxa) * rva
        vstore(gxr, ga + vload(grr, ra, i) if has_res else ga, ra, i)
        tw = vload(dw, 0, i) + dya * xha
        if two:
            dyb = vload(gyr, rb, i)
            xhb = vload(xr, rb, i) * rvb
            gb = (times_w(dyb, w, i) - xhb * mgxb) * rvb
            vstore(gxr, gb + vload(grr, rb, i) if has_res else gb, rb, i)
            tw = tw + dyb * xhb
        vstore(dw, tw, 0, i)
    for i in range(body, c1):
        dya = widen(get(gyr, ra, i))
        xha = widen(get(xr, ra, i)) * sa[0]
        ga = (times_w(dya, w, i) - xha * sa[1]) * sa[0]
        put(gxr, ra, i, narrow(ga + widen(get(grr, ra, i)) if has_res else ga, gxr))
        tw = get(dw, 0, i) + dya * xha
        if two:
            dyb = widen(get(gyr, rb, i))
            xhb = widen(get(xr, rb, i)) * sb[0]
            gb = (times_w(dyb, w, i) - xhb * sb[1]) * sb[0]
            put(gxr, rb, i, narrow(gb + widen(get(grr, rb, i)) if has_res else gb, gxr))
            tw = tw + dyb * xhb
        put(dw, 0, i, tw)


@callee_njit
def _rms_bwd_rows(gy, x, rstd_in, w, gx, partials, blk, r0, r1, gres, has_res):
    """Unit-stride rows ``r0 .. r1`` (partial block ``blk``), as :func:`_ln_bwd_rows`."""
    n = x.shape[1]
    gyv, xv, gxv, grv, wv = raw(gy), raw(x), raw(gx), raw(gres), raw(w)
    dw = raw(partials[0, blk])
    step = 2 if n >= PAIR_MIN_N else 1
    for r in range(r0, r1, step):
        two = step == 2 and r + 1 < r1
        rb = r + 1 if two else r
        sa_, sb_ = rstd_in[r], rstd_in[rb]
        ma = _rms_bwd_mean(gyv, xv, r, n, sa_, wv)
        mb = _rms_bwd_mean(gyv, xv, rb, n, sb_, wv) if two else ma
        _rms_bwd_rows_out(gyv, xv, gxv, r, rb, two, 0, n, (sa_, ma), (sb_, mb), wv, dw, grv,
                          has_res)


@callee_njit
def _rms_bwd_skewed(gy, x, rstd_in, w, gx, partials, blk, r0, r1, gres, has_res, stream):
    """Unit-stride rows ``r0 .. r1``, skewed and prefetched as :func:`_ln_bwd_rows` (each
    row's operations those of :func:`_rms_bwd_mean` and :func:`_rms_bwd_rows_out`;
    ``stream`` as there)."""
    n = x.shape[1]
    last = x.shape[0] - 1
    gyv, xv, gxv, grv, wv = raw(gy), raw(x), raw(gx), raw(gres), raw(w)
    dw = raw(partials[0, blk])
    like = rstd_in[r0]
    zero = splat(cast(0.0, like))
    inv_n = cast(1.0, like) / cast(n, like)
    body = n - n % LANES
    ahead = 2 if stream is None else imax(2, -(-STREAM_PREFETCH_BYTES // (n * itemsize(gyv))))
    mgx = _rms_bwd_mean(gyv, xv, r0, n, rstd_in[r0], wv)
    for r in range(r0, r1):
        rn = r + 1 if r + 1 < r1 else r
        gpf = vaddress(gyv, imin(r + ahead, last), 0)
        xpf = vaddress(xv, imin(r + ahead, last), 0)
        wpf = vaddress(gxv, imin(r + 1, last), 0)
        rpf = vaddress(grv, imin(r + ahead - 1, last), 0)  # as in _ln_bwd_rows
        s = rstd_in[r]
        rv, mgxv, rvn = splat(s), splat(mgx), splat(rstd_in[rn])
        acc = zero
        for i in range(0, body, LANES):
            o = i * itemsize(gyv)
            _read_hint(gpf, o, stream)
            _read_hint(xpf, o, stream)
            if has_res:
                _read_hint(rpf, o, stream)
            if stream is None:
                prefetch_at(wpf, i * itemsize(gxv), True)
            wvec = vload(wv, 0, i)
            dy = vload(gyv, r, i)
            xh = vload(xv, r, i) * rv
            g = (dy * wvec - xh * mgxv) * rv
            _store_gx(gxv, g + vload(grv, r, i) if has_res else g, r, i, stream)
            vstore(dw, vload(dw, 0, i) + dy * xh, 0, i)
            gn = vload(gyv, rn, i) * wvec
            acc = acc + gn * (vload(xv, rn, i) * rvn)
        for i in range(body, n):
            dy = widen(get(gyv, r, i))
            xh = widen(get(xv, r, i)) * s
            g = (times_w(dy, wv, i) - xh * mgx) * s
            put(gxv, r, i, narrow(g + widen(get(grv, r, i)) if has_res else g, gxv))
            put(dw, 0, i, get(dw, 0, i) + dy * xh)
        if body < n:
            count = n - body
            gn = vload_tail(gyv, rn, body, count, cast(0.0, like)) * vload_tail(
                wv, 0, body, count, cast(0.0, like))
            acc = acc + gn * (vload_tail(xv, rn, body, count, cast(0.0, like)) * rvn)
        mgx = tree_sum(acc) * inv_n
    if stream is not None:
        store_fence()  # streaming stores done before another thread reads grad_x


@callee_njit
def _rms_bwd_gathered(gy, x, rstd_in, w, gx, partials, blk, r0, r1, gres, has_res):
    """Rows of any stride through scratch rows, as :func:`_ln_bwd_gathered`."""
    n = x.shape[1]
    count, columns, xs, gys, gxs, grs = _gathered_scratches(gy, x, gx, gres, has_res,
                                                            r1 - r0)
    a, b, c, d, wv = raw(gys), raw(xs), raw(gxs), raw(grs), raw(w)
    dw = raw(partials[0, blk])
    for s0 in range(r0, r1, count):
        s1 = imin(r1, s0 + count)
        _gather_inputs(xs, gys, grs, x, gy, gres, s0, s1, columns, has_res)
        for r in range(s0, s1, 2 if n >= PAIR_MIN_N else 1):
            two, ra, rb = _pair_rows(r, s0, s1, n)
            sa_, sb_ = rstd_in[r], rstd_in[r - ra + rb]
            ma = _rms_bwd_mean(a, b, ra, n, sa_, wv)
            mb = _rms_bwd_mean(a, b, rb, n, sb_, wv) if two else ma
            _rms_bwd_rows_out(a, b, c, ra, rb, two, 0, n, (sa_, ma), (sb_, mb), wv, dw, d,
                              has_res)
        _scatter_block(gx, gxs, s0, s1, columns[2])
    alive(xs)
    alive(gys)
    alive(gxs)
    alive(grs)


@cached_njit(error_model="numpy")
def rms_backward_serial(gy, x, rstd_in, w, gx, partials, block_rows, gres, has_res):
    """RMSNorm backward of unit-stride 2-D rows on the calling thread, skewed (``gres``:
    as for :func:`ln_backward_serial`)."""
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _rms_bwd_skewed(gy, x, rstd_in, w, gx, partials, blk, r0,
                        imin(rows, r0 + block_rows), gres, has_res, PLAIN)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def rms_backward_parallel(gy, x, rstd_in, w, gx, partials, block_rows, gres, has_res):
    """:func:`rms_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _rms_bwd_skewed(gy, x, rstd_in, w, gx, partials, blk, r0,
                        imin(rows, r0 + block_rows), gres, has_res, PLAIN)
    return _block_sums(partials)


@cached_njit(error_model="numpy")
def rms_stream_backward_serial(gy, x, rstd_in, w, gx, partials, block_rows, gres, has_res):
    """:func:`rms_backward_serial` writing grad_x with streaming stores, for any row
    length (grad_x's vectors aligned: the driver's ``streams_gradient``)."""
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _rms_bwd_skewed(gy, x, rstd_in, w, gx, partials, blk, r0,
                        imin(rows, r0 + block_rows), gres, has_res, STREAM)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def rms_stream_backward_parallel(gy, x, rstd_in, w, gx, partials, block_rows, gres,
                                 has_res):
    """:func:`rms_stream_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _rms_bwd_skewed(gy, x, rstd_in, w, gx, partials, blk, r0,
                        imin(rows, r0 + block_rows), gres, has_res, STREAM)
    return _block_sums(partials)


@cached_njit(error_model="numpy")
def rms_paired_backward_serial(gy, x, rstd_in, w, gx, partials, block_rows, gres, has_res):
    """:func:`rms_backward_serial` unskewed, two rows per pass once rows are at least
    ``PAIR_MIN_N`` long (the driver's choice for rows of at least ``RMS_ROWS_FROM_N``)."""
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _rms_bwd_rows(gy, x, rstd_in, w, gx, partials, blk, r0, imin(rows, r0 + block_rows),
                      gres, has_res)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def rms_paired_backward_parallel(gy, x, rstd_in, w, gx, partials, block_rows, gres,
                                 has_res):
    """:func:`rms_paired_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _rms_bwd_rows(gy, x, rstd_in, w, gx, partials, blk, r0, imin(rows, r0 + block_rows),
                      gres, has_res)
    return _block_sums(partials)


@cached_njit(error_model="numpy")
def rms_gathered_backward_serial(gy, x, rstd_in, w, gx, partials, block_rows, gres,
                                 has_res):
    """:func:`rms_backward_serial` for rows of any stride."""
    rows = x.shape[0]
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _rms_bwd_gathered(gy, x, rstd_in, w, gx, partials, blk, r0,
                          imin(rows, r0 + block_rows), gres, has_res)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def rms_gathered_backward_parallel(gy, x, rstd_in, w, gx, partials, block_rows, gres,
                                   has_res):
    """:func:`rms_gathered_backward_serial`, row blocks spread over threads."""
    rows = x.shape[0]
    blocks = partials.shape[1]
    for j in prange(blocks):
        blk = short_block_first(j, blocks)
        r0 = blk * block_rows
        _rms_bwd_gathered(gy, x, rstd_in, w, gx, partials, blk, r0,
                          imin(rows, r0 + block_rows), gres, has_res)
    return _block_sums(partials)


@callee_njit
def _rms_bwd_columns(gy, x, rstd_in, w, gx, partials, stats, block_rows, c0, c1, gres,
                     has_res):
    """:func:`_ln_bwd_columns` for RMSNorm (``stats[r]``: row ``r``'s mean of g * xhat;
    :func:`_rms_bwd_rows_out` of one row)."""
    rows = x.shape[0]
    gyv, xv, gxv, grv, wv = raw(gy), raw(x), raw(gx), raw(gres), raw(w)
    for blk in range(partials.shape[1]):
        dw = raw(partials[0, blk])
        for r in range(blk * block_rows, imin(rows, (blk + 1) * block_rows)):
            row = (rstd_in[r], stats[r])
            _rms_bwd_rows_out(gyv, xv, gxv, r, r, False, c0, c1, row, row, wv, dw, grv,
                              has_res)


@cached_njit(parallel=True, error_model="numpy")
def rms_split_backward_parallel(gy, x, rstd_in, w, gx, partials, block_rows, gres, has_res):
    """:func:`ln_split_backward_parallel` for RMSNorm (the bits of
    :func:`rms_backward_serial` and :func:`rms_paired_backward_serial`)."""
    rows, n = x.shape
    stats = np.empty(rows, dtype=rstd_in.dtype)
    for r in prange(rows):
        stats[r] = _rms_bwd_mean(raw(gy), raw(x), r, n, rstd_in[r], raw(w))
    for c in prange(-(-n // SPLIT_COLUMNS)):
        c0 = c * SPLIT_COLUMNS
        _rms_bwd_columns(gy, x, rstd_in, w, gx, partials, stats, block_rows, c0,
                         imin(n, c0 + SPLIT_COLUMNS), gres, has_res)
    return _block_sums(partials)


@callee_njit
def _bwd_col_item(gy, x, mean_in, rstd_in, w, gx, partials, item, rms, cols, gres, has_res):
    n = x.shape[1]
    inner = x.shape[2]
    per = (inner + COL_BLOCK - 1) // COL_BLOCK
    o = item // per
    c0 = (item % per) * COL_BLOCK
    c1 = imin(inner, c0 + COL_BLOCK)
    xs, gys, gxs, grs = cols
    xsv, gysv, gxsv, grsv = raw(xs), raw(gys), raw(gxs), raw(grs)
    wv = raw(w)
    dw = raw(partials[0, item])
    db = raw(partials[partials.shape[0] - 1, item])
    group = xs.shape[0]
    # (The arrays' columns have unit stride: the driver copies any other.)
    xo, gyo, gxo, gro = raw(x[o]), raw(gy[o]), raw(gx[o]), raw(gres[o])
    for g0 in range(c0, c1, group):
        count = imin(group, c1 - g0)
        # The group's columns into scratch rows, a row of the array at a time (its
        # columns are neighbours in memory); each column then in order, as one row.
        for i in range(n):
            for j in range(count):
                put(xsv, j, i, get(xo, i, g0 + j))
                put(gysv, j, i, get(gyo, i, g0 + j))
            if has_res:
                for j in range(count):
                    put(grsv, j, i, get(gro, i, g0 + j))
        for j in range(count):
            r = o * inner + g0 + j
            if rms:
                sd = rstd_in[r]
                mgx = _rms_bwd_mean(gysv, xsv, j, n, sd, wv)
                _rms_bwd_rows_out(gysv, xsv, gxsv, j, j, False, 0, n, (sd, mgx), (sd, mgx),
                                  wv, dw, grsv, has_res)
            else:
                m, sd = mean_in[r], rstd_in[r]
                mg, mgx = _ln_bwd_means(gysv, xsv, j, n, m, sd, wv)
                _ln_bwd_rows_out(gysv, xsv, gxsv, j, j, False, 0, n, (m, sd, mg, mgx),
                                 (m, sd, mg, mgx), wv, dw, db, grsv, has_res)
        for i in range(n):
            for j in range(count):
                put(gxo, i, g0 + j, get(gxsv, j, i))


#: Bytes of one scratch array of the channels-first backward's column groups (a group
#: of columns is copied into scratch rows a row of the array at a time).
COL_GROUP_BYTES = 16 << 10


@njit(inline="always", error_model="numpy")
def _bwd_col_scratch(gy, x, gx, has_res):
    # Scratch rows padded by a vector: rows a power of two apart, written a column at
    # a time, would share a few sets of the L1 cache.
    n = x.shape[1]
    group = imax(1, imin(COL_BLOCK, COL_GROUP_BYTES // imax(1, n * x.itemsize)))
    wide_n = n + LANES
    return (np.empty((group, wide_n), dtype=x.dtype)[:, :n],
            np.empty((group, wide_n), dtype=gy.dtype)[:, :n],
            np.empty((group, wide_n), dtype=gx.dtype)[:, :n],
            np.empty((group, wide_n if has_res else 0), dtype=x.dtype)[:, :n])


@cached_njit(error_model="numpy")
def backward_cols_serial(gy, x, mean_in, rstd_in, w, gx, partials, rms, gres, has_res):
    """Backward over axis 1 of 3-D arrays whose last axis has unit stride; one partial
    per (outer, COL_BLOCK columns).

    ``rms`` selects RMSNorm (``mean_in`` is then ignored and ``partials`` has one row);
    ``gres``/``has_res``: as for :func:`ln_backward_serial`.
    """
    cols = _bwd_col_scratch(gy, x, gx, has_res)
    for item in range(partials.shape[1]):
        _bwd_col_item(gy, x, mean_in, rstd_in, w, gx, partials, item, rms, cols, gres,
                      has_res)
    return _block_sums(partials)


@cached_njit(parallel=True, error_model="numpy")
def backward_cols_parallel(gy, x, mean_in, rstd_in, w, gx, partials, rms, gres, has_res):
    """Parallel :func:`backward_cols_serial` (same partial blocks)."""
    for item in prange(partials.shape[1]):
        cols = _bwd_col_scratch(gy, x, gx, has_res)
        _bwd_col_item(gy, x, mean_in, rstd_in, w, gx, partials, item, rms, cols, gres,
                      has_res)
    return _block_sums(partials)
