"""Row arithmetic shared by every Numba kernel: constants, widening, affine, moments.

Every kernel computes each row with one fixed sequence of IEEE operations (the *row
arithmetic* below), whatever the row's layout, its position in the batch and the number
of threads, so each row's result is bitwise reproducible. This module holds the pieces
of it that more than one layout uses; :mod:`.forward_rows`, :mod:`.forward_cols` and
:mod:`.backward` put them together (:mod:`.kernels` has the overview).

Row arithmetic, LayerNorm statistics (one pass over memory, a second on rare rows)
--------------------------------------------------------------------------------
Accumulation type ``T`` is float32 (float64 for float64 input); ``D`` is float64.
Element ``i`` belongs to lane ``i % LANES``; ``G = n // LANES`` full groups give every
lane ``G`` elements and the ``r = n % LANES`` remaining elements go one each to lanes
``0 .. r-1``. ``T(v)`` is the sum of a vector's lanes in the fixed tree (lane ``j`` plus
lane ``j + h`` for ``h = 8, 4, 2, 1``).

1. The shift is ``K = x[0]`` (so a constant row has centred values exactly 0).
2. One pass of sums, per lane, of ``v = x - K`` (in ``T``): groups are taken
   ``PER_LANE`` (8) at a time (a chunk of ``CHUNK`` elements; the last chunk may hold
   ``g < PER_LANE`` groups, its leaves ``v_k`` for ``k >= g`` are ``-0.0``, which adds
   exactly nothing). Per chunk and lane ``s = ((v_0 + v_1) + (v_2 + v_3)) + ((v_4 + v_5)
   + (v_6 + v_7))`` and ``q = (fma(v_0, v_0, v_1 * v_1) + fma(v_2, v_2, v_3 * v_3)) +
   (fma(v_4, v_4, v_5 * v_5) + fma(v_6, v_6, v_7 * v_7))``, added in chunk order to the
   lane's sums ``a = a + s`` and ``q_lane = q_lane + q`` (both start at +0.0). After
   every ``BLOCK_CHUNKS`` full chunks that another full chunk follows (rows longer than
   ``BLOCK_CHUNKS * CHUNK`` elements only), the lane's sums are closed: added, exactly
   widened, to its float64 totals ``ta = ta + D(a)``, ``tq = tq + D(q_lane)`` (both start
   at +0.0), and restarted at +0.0. The remainder element ``v`` of a lane (lanes
   ``>= r``: ``v = K - K``) then adds ``a = a + v`` and ``q_lane = fma(v, v, q_lane)``.
   The fixed trees keep the dependency chains short, summing whole chunks keeps partial
   sums small (a running sum of squares per element was measurably biased on data of a
   coarse grid: ``1e4 + randn`` in float32, squares of multiples of ``2**-10`` round one
   way), and closing blocks bounds the additions of a ``T`` sum (``D/CHUNK`` running
   additions lost accuracy in proportion to ``D``: a relative error of 2e-4 in the
   ``rstd`` of a constant float32 row of ``2**22``).
3. Lanes are combined in the fixed tree: without a closed block, its first level
   (lane ``j`` plus lane ``j + 8``) in ``T``, the others exactly widened to ``D``:
   ``S = T(a)``, ``SS = T(q)``; with closed blocks, the tree of ``ta + D(a)`` (and of
   ``tq + D(q_lane)``) all in ``D``. Then the shifted mean ``mu = S * (1/n)`` and
   ``M2 = fma(S, mu * -1, SS)`` (in ``D``, ``1/n`` rounded in ``D``). The top levels of
   the tree, where a rounding costs most, are float64.
4. Cancellation check: if ``M2 < CANCEL * SS`` (more than five sixths of ``SS``
   cancelled: ``K`` lies more than ``sqrt(1/CANCEL - 1)`` deviations from the mean, an
   outlying first element or a far offset; :data:`CANCEL` is row 0 of the table
   :func:`merge_table`), the row is redone: ``K' = K + T(mu)`` (in ``T``), steps 2-3
   again with ``K'`` (from cache: the row was just read), and ``M2`` clamped at 0. That
   is the corrected two-pass algorithm (``M2 = sum d**2 - (sum d)**2 / n`` with
   ``d = x - K'``, ``sum d`` now small), accurate however far the first element lies.
   The decision depends only on the row's values, so every path takes it alike.
5. ``rstd = T(1 / sqrt(M2 * (1/n) + eps))`` (in ``D``), ``mean_shifted = T(mu)``,
   ``mean = K + mean_shifted`` (in ``T``), and the output pass computes
   ``y = fma(((x - K) - mean_shifted) * rstd, w, b)`` element by element (``K`` being
   ``K'`` on a redone row). The backend passes ``w = 1`` for an absent weight and
   ``b = -0.0`` for an absent bias: ``fma(v, 1, -0.0) = v``, ``fma(v, w, -0.0) = v * w``
   and ``fma(v, 1, b) = v + b`` exactly, so one compiled kernel serves every
   combination. Float16/bfloat16 ``w`` and ``b`` are widened exactly to float32 before
   the kernels see them (by the backend's ``widened_param``).

A finite row whose ``rstd`` is not usable (not positive: its sums of squares overflow
``T``; or huge: they underflow, with ``eps`` near 0) is left to :mod:`.rescale` by the
row loops.

``fma`` is IEEE fusedMultiplyAdd, written explicitly: one rounding, the same bits on
every machine. The compiler is never allowed to contract or reorder anything itself.

RMSNorm: per chunk and lane, the squares of the chunk's elements are summed in the same
fixed tree as ``q`` above (absent elements are 0), the chunk sums are added to the lane's
sum in order (blocks closed into float64 totals as above), then the remainder's squares;
lanes are summed in the fixed tree (in ``T``; with closed blocks, of ``total + D(sum)``
in ``D``, rounded once to ``T``), ``rstd = 1 / sqrt(ss / n + eps)``, ``y = x * rstd * w``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import njit

from ._scalars import cast, imax, imin, widen
from ._simd import (
    WIDTH,
    down1,
    down2,
    down4,
    down8,
    fma,
    fold1,
    fold1_max,
    fold2,
    fold2_max,
    fold4,
    fold4_max,
    fold8,
    fold8_max,
    get,
    itemsize,
    lane,
    runtime,
    splat,
    vaddress,
    vload,
    vload_tail,
    wide,
)
from .callee import callee_njit

LANES = WIDTH
#: The ``stream`` argument of the row loops (:func:`.forward_rows.ln_long_rows`,
#: :func:`.forward_rows.rms_raw_rows`, the backward's skewed rows):
#: ``PLAIN`` (None) writes the output with plain stores, ``STREAM`` with streaming stores. The
#: choice is made by the argument's *type* (Numba prunes ``stream is None`` before
#: typing), so a kernel passing one of them compiles only that output loop: the
#: streaming loop cost a tenth of a cold first call that never uses it. ``PLAIN``
#: overlaps a row's output pass with the next row's first pass; ``STREAM`` writes each
#: row whole, then reads the next, and so does ``SEQUENTIAL`` (an integer: the forward
#: row loops store with :func:`._simd.vstore_by`, which picks plain stores for it), for
#: long cache-resident rows, whose two rows in flight no longer fit in L1.
PLAIN = None
STREAM = True
SEQUENTIAL = 0
#: The forward row loops' fourth order, ``TILED`` (a float): long rows a group at a
#: time, the output pass in column tiles over the group (:func:`.forward_rows.ln_tiled_rows`).
TILED = 0.0
#: The fifth, ``STREAM_TILED`` (a tuple): the ``TILED`` order writing with streaming
#: stores, for long rows from memory.
STREAM_TILED = (TILED, STREAM)
#: The sixth, ``SHORT`` (a complex number): rows of at most ``SHORT_ROW_MAX``, ``LANES``
#: rows at a time (:func:`.forward_rows.ln_short_rows`, :func:`.forward_rows.rms_short_rows`;
#: plain stores).
SHORT = 0j
PER_LANE = 8
CHUNK = LANES * PER_LANE
#: Full chunks summed in ``T`` before a long row's lane sums are closed into float64
#: totals (step 2; rows of up to ``BLOCK_CHUNKS * CHUNK`` elements never close one).
BLOCK_CHUNKS = 64
#: Elements per parallel work item (no effect on results).
WORK_ELEMENTS = 1 << 15
#: Loads and stores whose addresses agree modulo this many bytes look alike to the
#: load-store unit: a load waits for an earlier store still in flight with the same low
#: 12 address bits (4 KiB aliasing). The output passes choose their direction by it
#: (:func:`.forward_rows.output_downwards`, the backward's tiled grad_x pass).
ALIAS_BYTES = 4096


@njit(inline="always", error_model="numpy")
def aligned_head(xr, r, n):
    """Elements of row ``r`` before the first ``min(64, vector bytes)`` boundary of x,
    where the output passes start their vectors (the elements before it through one
    saved vector, :func:`.forward_rows.ln_row_out_from`, or one at a time, as the
    backward's tiles do; no effect on results): 0 for an aligned row, a row shorter
    than two vectors or one whose elements are misaligned.
    A load across a cache line costs a second access: measured, Zen 4, float32, 1
    thread, in cache, x 16 bytes past a 64-byte boundary / aligned, before:
    LayerNorm (242, 768) 35.6 / 30.7 us, (90, 2048) 38.0 / 35.2 us; RMSNorm (242, 768)
    29.0 / 23.8 us."""
    align = imin(64, LANES * itemsize(xr))
    address = vaddress(xr, r, 0)
    head = (align - address % align) % align // itemsize(xr)
    if n < 2 * LANES or address % itemsize(xr) != 0:
        head = 0
    return head


#: The parallel forward kernels cut a call into a multiple of this many blocks (of about
#: ``WORK_ELEMENTS`` or fewer), rows spread evenly over them: Numba's ``prange`` gives each
#: thread an equal run of consecutive iterations, so 1, 2, 3, 4, 6, 8, 12 or 24 threads
#: get equal shares of rows (no effect on results).
BLOCK_MULTIPLE = 24


@njit(inline="always", error_model="numpy")
def even_blocks(rows, n):
    """The number of blocks :func:`block_span` cuts ``rows`` rows of ``n`` elements into.

    A fixed ``WORK_ELEMENTS`` per block split cache-resident calls unevenly between two
    threads: (10, 16384) was 5 blocks of two rows, 6 rows on one thread and 4 on the
    other; (44, 4096) 24 and 20. The thread count is not asked (Numba's
    ``get_num_threads`` in a kernel keeps it out of the disk cache). The backward's
    blocks, which fix its reduction order, are its own."""
    work = -(-rows * imax(n, 1) // WORK_ELEMENTS)
    return -(-imax(work, 1) // BLOCK_MULTIPLE) * BLOCK_MULTIPLE


@njit(inline="always", error_model="numpy")
def block_span(blk, blocks, rows, granule):
    """Rows ``(r0, r1)`` of block ``blk`` of ``blocks`` (:func:`even_blocks`): an even
    share of ``rows``, starting on a multiple of ``granule`` (possibly empty)."""
    r0 = blk * rows // blocks // granule * granule
    if blk + 1 == blocks:
        return r0, rows
    return r0, (blk + 1) * rows // blocks // granule * granule
#: Columns of row 0 of the table of ``n``-dependent constants (:func:`merge_table`):
#: ``1/n`` and the cancellation threshold ``CANCEL``.
TAB_ROWS = 1
TAB_INV_N, TAB_CANCEL = 0, 1
#: A row is redone with a better shift when its one-pass ``M2`` is below ``CANCEL``
#: times its sum of squares: the shift ``x[0]`` lay more than ``sqrt(5)`` deviations
#: from the mean (about 2.5% of ``randn`` rows). Below that the cancellation costs at
#: most a factor 6 on the error of ``M2``. Measured on ``1e4 + randn`` float32 rows,
#: ``max |y - y_float64|``: 5.1e-7 at ``n = 4096`` (1/4: the same, but 8% of rows
#: redone, which cost 15% at ``(1024, 64)``; 1/8: 8.5e-7, too close to the 1e-6 bar).
CANCEL = 1 / 6


@functools.lru_cache(maxsize=256)
def merge_table(n: int, dtype: Any) -> np.ndarray:
    """Constants of the row arithmetic that depend on ``n`` only (row 0, columns ``TAB_*``).

    Computed on the host once per ``(n, dtype)`` and passed to the kernels (a read-only
    array): ``1/n`` rounded in ``dtype`` as a kernel would, and the threshold
    ``CANCEL``, so that nothing in them is compiled in.

    Parameters
    ----------
    n : int
        Row length.
    dtype : numpy.dtype
        Accumulation dtype (float32 or float64).

    Returns
    -------
    numpy.ndarray
        ``(TAB_ROWS, LANES)``, read-only.

    Examples
    --------
    >>> tab = merge_table(20, np.dtype(np.float32))
    >>> float(tab[0, TAB_INV_N]) == float(np.float32(1) / np.float32(20))
    True
    """
    t = np.dtype(dtype).type
    tab = np.zeros((TAB_ROWS, LANES), dtype=dtype)
    tab[0, TAB_INV_N] = t(1.0) / t(max(n, 1))
    tab[0, TAB_CANCEL] = t(CANCEL)
    tab.flags.writeable = False
    return tab


@njit(inline="always", error_model="numpy")
def finish(shift, mu, m2, n, eps):
    """(shifted mean, mean, rstd) in the accumulation type from the float64 shifted mean
    and ``M2`` (step 5)."""
    mt = cast(mu, eps)
    rstd = cast(1.0 / np.sqrt(m2 * (1.0 / np.float64(n)) + np.float64(eps)), eps)
    return mt, shift + mt, rstd


@callee_njit
def tree_sum(v):
    v = v + down8(v)
    v = v + down4(v)
    v = v + down2(v)
    v = v + down1(v)
    return lane(v, 0)


@njit(inline="always", error_model="numpy")
def wide_tree_sum(v):
    """:func:`tree_sum` of ``v`` with its first level (``h = 8``) in ``v``'s type and the
    others in float64."""
    w = wide(v + down8(v))
    w = w + down4(w)
    w = w + down2(w)
    w = w + down1(w)
    return lane(w, 0)


@njit(inline="always", error_model="numpy")
def total_tree_sum(total, v):
    """:func:`tree_sum` of the float64 lane totals ``total`` plus ``v`` (exactly widened),
    every level in float64 (step 3 with closed blocks)."""
    w = total + wide(v)
    w = w + down8(w)
    w = w + down4(w)
    w = w + down2(w)
    w = w + down1(w)
    return lane(w, 0)


@njit(inline="always", error_model="numpy")
def blocked(n):
    """Whether a row of ``n`` elements closes blocks of lane sums (step 2)."""
    return n // CHUNK > BLOCK_CHUNKS


@njit(inline="always", error_model="numpy")
def block_end(c, full):
    """The end of the block of ``BLOCK_CHUNKS`` chunks holding chunk ``c`` (at most
    ``full``). The first-pass loops run chunk by chunk up to it, then close the block's
    lane sums (step 2) if another full chunk follows: the inner loop stays the plain
    chunk loop (a test per chunk cost 3-16% in cache at n = 256-1024)."""
    return imin(full, (c // BLOCK_CHUNKS + 1) * BLOCK_CHUNKS)


@njit(inline="always", error_model="numpy")
def unchanged(v):
    """``v`` itself (the first level of :func:`row_trees`' tree kept in ``v``'s type)."""
    return v


def _trees_of_rows(level8, level4, level2, level1, after_first):
    """A function ``(view, first)`` folding the ``LANES`` vectors in rows ``first ..``
    of a :class:`._simd.Raw` view pairwise with ``level8`` .. ``level1`` (the
    :func:`._simd.fold8` family), ``after_first`` applied to the first level's results:
    row ``first + i``'s tree lands in lane ``i``, by the same operations as the fixed
    tree of that row alone."""

    def trees(sv, first):
        a0 = after_first(level8(vload(sv, first, 0), vload(sv, first + 1, 0)))
        a1 = after_first(level8(vload(sv, first + 2, 0), vload(sv, first + 3, 0)))
        a2 = after_first(level8(vload(sv, first + 4, 0), vload(sv, first + 5, 0)))
        a3 = after_first(level8(vload(sv, first + 6, 0), vload(sv, first + 7, 0)))
        a4 = after_first(level8(vload(sv, first + 8, 0), vload(sv, first + 9, 0)))
        a5 = after_first(level8(vload(sv, first + 10, 0), vload(sv, first + 11, 0)))
        a6 = after_first(level8(vload(sv, first + 12, 0), vload(sv, first + 13, 0)))
        a7 = after_first(level8(vload(sv, first + 14, 0), vload(sv, first + 15, 0)))
        return level1(level2(level4(a0, a1), level4(a2, a3)),
                      level2(level4(a4, a5), level4(a6, a7)))

    return njit(inline="always", error_model="numpy")(trees)


#: :func:`tree_sum` of each of the ``LANES`` vectors in rows ``first ..`` of a view,
#: every level in their type; row ``first + i``'s sum in lane ``i`` (``(view, first)``).
row_trees = _trees_of_rows(fold8, fold4, fold2, fold1, unchanged)
#: :func:`wide_tree_sum` of each of the ``LANES`` vectors in rows ``first ..``: the first
#: level in their type, the others in float64.
wide_row_trees = _trees_of_rows(fold8, fold4, fold2, fold1, wide)
#: :func:`._simd.hmax_bits` of each of the ``LANES`` :func:`._simd.vabsmax` vectors in
#: rows ``first ..`` (maxima are exact: any order gives the same bits).
row_maxima = _trees_of_rows(fold8_max, fold4_max, fold2_max, fold1_max, unchanged)


@njit(inline="always", error_model="numpy")
def tree8(a0, a1, a2, a3, a4, a5, a6, a7):
    """The fixed tree of ``PER_LANE`` accumulators."""
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@njit(inline="always", error_model="numpy")
def square_tree(d0, d1, d2, d3, d4, d5, d6, d7):
    """``d0**2 + ... + d7**2`` in the fixed tree (pairs fused: ``fma(d0, d0, d1 * d1)``).

    Absent leaves are +0.0: their squares add exactly nothing to sums of squares, which
    are never -0.0. (RMSNorm's chunks.)
    """
    return ((fma(d0, d0, d1 * d1) + fma(d2, d2, d3 * d3))
            + (fma(d4, d4, d5 * d5) + fma(d6, d6, d7 * d7)))


@njit(inline="always", error_model="numpy")
def row_shift(xr, r, n):
    """The shift ``K`` of a row: its first element (step 1)."""
    return widen(get(xr, r, 0))


@njit(inline="always", error_model="numpy")
def chunk_sums(v0, v1, v2, v3, v4, v5, v6, v7):
    """Sum and sum of squares of a chunk's ``PER_LANE`` leaves, in the fixed trees."""
    return tree8(v0, v1, v2, v3, v4, v5, v6, v7), square_tree(v0, v1, v2, v3, v4, v5, v6, v7)


@callee_njit
def row_chunk(xr, r, base, g, kv, pad):
    """Sum and sum of squares of a row's chunk at ``base`` (``g`` groups, absent leaves
    ``pad``), of ``v = x - kv``: :func:`chunk_sums` of its leaves."""
    # Leaves written out: a helper called with the constants 0 .. 7 would be compiled
    # once per constant.
    return chunk_sums(
        vload(xr, r, base) - kv if g > 0 else pad,
        vload(xr, r, base + LANES) - kv if g > 1 else pad,
        vload(xr, r, base + 2 * LANES) - kv if g > 2 else pad,
        vload(xr, r, base + 3 * LANES) - kv if g > 3 else pad,
        vload(xr, r, base + 4 * LANES) - kv if g > 4 else pad,
        vload(xr, r, base + 5 * LANES) - kv if g > 5 else pad,
        vload(xr, r, base + 6 * LANES) - kv if g > 6 else pad,
        vload(xr, r, base + 7 * LANES) - kv if g > 7 else pad)


def lane_sums_tail(xr, r, n, shift, a, q):
    """The end of :func:`lane_sums_from`: the last partial chunk and the remainder
    elements added to the lane sums ``a``, ``q`` of the full chunks (which close no
    block after them)."""
    return tail_sums(xr, r, n, shift, a, q, False)


lane_sums_tail = callee_njit(lane_sums_tail)


def _lane_sums_from_ending_with(tail):
    """:func:`lane_sums_from`, its last partial chunk and remainder added by ``tail``
    (:func:`lane_sums_tail`)."""

    def lane_sums_from(xr, r, n, shift, a, q, ta, tq, first):
        """:func:`lane_sums` from chunk ``first`` (0 or the start of a block) on, continuing
        the lane sums ``a``, ``q`` and their float64 totals ``ta``, ``tq`` of the chunks
        before it (the same additions in the same order: a block's sums are closed when the
        next full chunk starts)."""
        kv = splat(shift)
        pad = splat(cast(-0.0, shift))
        zero = splat(cast(0.0, shift))
        groups = n // LANES
        full = groups // PER_LANE
        c = first
        while c < full:
            if c > 0:  # a block before this one: close it
                ta = ta + wide(a)
                tq = tq + wide(q)
                a = q = zero
            end = block_end(c, full)
            for k in range(c, end):
                s, ss = row_chunk(xr, r, k * CHUNK, runtime(PER_LANE), kv, pad)
                a = a + s
                q = q + ss
            c = end
        a, q = tail(xr, r, n, shift, a, q)
        return a, q, ta, tq

    return lane_sums_from


# Compiled as functions: the row paths call them once per row, one compiled copy serving
# them all (the short-row path has its own, :func:`short_lane_sums`). The pipelined row
# loop calls lane_sums_tail, whose arguments and results are the lane sums alone: passing
# the float64 totals through a call too cost 4-16% in cache at n = 256-1024. The called
# lane_sums_from (long rows, rows from DRAM, the rare redo) calls lane_sums_tail in turn
# rather than inlining it: less code to compile on a cold first call (0.1 s of 1.9 s
# measured; inlining lane_sums_from everywhere instead cost 0.3 s more).
lane_sums_from = callee_njit(_lane_sums_from_ending_with(lane_sums_tail))


@njit(inline="always", error_model="numpy")
def lane_sums(xr, r, n, shift):
    """Per-lane sums of ``v = x - shift`` and of ``v * v`` of a unit-stride row, and
    their float64 totals of closed blocks (step 2): ``(a, q, ta, tq)``."""
    zero = splat(cast(0.0, shift))
    return lane_sums_from(xr, r, n, shift, zero, zero, wide(zero), wide(zero), runtime(0))


@njit(inline="always", error_model="numpy")
def counted_chunk(xr, r, base, g, kv, pad):
    """:func:`row_chunk` at ``base`` for a last partial chunk of ``g`` (1 .. ``PER_LANE -
    1``) groups. The common count 4 (rows of 64-79) has a branch of its own that passes
    it as a constant LLVM sees (Numba still compiles the helper once,
    :func:`._simd.runtime`), as a full chunk's ``PER_LANE`` is: inlined there, it adds
    only the leaves present (an absent leaf's ``-0.0`` adds nothing to a sum, its
    ``+0.0`` square nothing to a sum of squares, which is never ``-0.0``), the same bits
    as with the count known only at run time, which the other counts take.

    Measured, LayerNorm, float32, 1 thread, in cache, public calls, with the rest of
    that change (:func:`short_lane_sums`): (2883, 64) 59 -> 52.5 us. A branch for every
    count gained as much at the others ((4096, 32) 62-63 -> 55-56 us, (2048, 48) 37-39 ->
    33.5 us) but cost 0.1-0.15 s more of a cold first call of the short-row path."""
    if g == 4:
        return row_chunk(xr, r, base, runtime(4), kv, pad)
    return row_chunk(xr, r, base, g, kv, pad)


@njit(inline="always", error_model="numpy")
def tail_sums(xr, r, n, shift, a, q, by_count):
    """The last partial chunk and the remainder elements of a row added to the lane sums
    ``a``, ``q`` of its full chunks: the end of :func:`lane_sums_tail` and of
    :func:`short_lane_sums`, a last partial chunk of 4 groups by :func:`counted_chunk`
    with ``by_count`` (a constant at every call)."""
    kv = splat(shift)
    pad = splat(cast(-0.0, shift))
    groups = n // LANES
    g = groups - groups // PER_LANE * PER_LANE
    if g > 0:
        if by_count:
            s, ss = counted_chunk(xr, r, (groups - g) * LANES, g, kv, pad)
        else:
            s, ss = row_chunk(xr, r, (groups - g) * LANES, g, kv, pad)
        a = a + s
        q = q + ss
    start = groups * LANES
    if start < n:
        v = vload_tail(xr, r, start, n - start, shift) - kv
        a = a + v
        q = fma(v, v, q)
    return a, q


@njit(inline="always", error_model="numpy")
def short_lane_sums(xr, r, n, shift, by_count=True):
    """The lane sums ``(a, q)`` of :func:`lane_sums` for a unit-stride row that closes
    no block (at most ``BLOCK_CHUNKS * CHUNK`` elements; the short-row path's are at
    most ``CHUNK``), inlined into the short-row path's loop: the same additions in the
    same order, a last partial chunk of 4 groups by :func:`counted_chunk` (with
    ``by_count``, a constant; without it, less code, for :func:`short_redo`).

    Inlined rather than called: the call and its return through memory took a seventh
    of a row of 64 (12% per row). Measured, LayerNorm short rows, float32, 1 thread,
    the group statistics alone: (2883, 64) in cache 21.0 us with the count known at run
    time, 17.6 us as a constant; from L3/DRAM (65536, 64) 462 / 386 us."""
    kv = splat(shift)
    pad = splat(cast(-0.0, shift))
    a = q = splat(cast(0.0, shift))
    for k in range(n // LANES // PER_LANE):
        s, ss = row_chunk(xr, r, k * CHUNK, runtime(PER_LANE), kv, pad)
        a = a + s
        q = q + ss
    return tail_sums(xr, r, n, shift, a, q, by_count)


@callee_njit
def short_redo(xr, r, n, shift, mu):
    """:func:`redo` of a unit-stride row that closes no block, for the short-row path:
    the same operations, from :func:`short_lane_sums`, so that a first call of that path
    does not compile :func:`lane_sums_from` (measured: 0.2 s of a cold first call)."""
    shift = shift + mu
    a, q = short_lane_sums(xr, r, n, shift, False)
    s = wide_tree_sum(a)
    mu2 = s * (1.0 / np.float64(n))
    m2 = fma(s, mu2 * -1.0, wide_tree_sum(q))
    return shift, mu2, (m2 if not m2 < 0.0 else 0.0)


@njit(inline="always", error_model="numpy")
def lane_total(total, v, n):
    """The fixed tree of a row's lane sums ``v`` (and of their float64 ``total`` of
    closed blocks, if ``n`` closes any), float64 (step 3)."""
    if blocked(n):
        return total_tree_sum(total, v)
    return wide_tree_sum(v)


@njit(inline="always", error_model="numpy")
def moments(a, q, ta, tq, n):
    """(shifted mean, M2, sum of squares), float64, from a row's lane sums (step 3)."""
    s = lane_total(ta, a, n)
    ss = lane_total(tq, q, n)
    mu = s * (1.0 / np.float64(n))
    return mu, fma(s, mu * -1.0, ss), ss


@njit(inline="always", error_model="numpy")
def cancelled(m2, ss, tab):
    """Whether a one-pass ``M2`` lost too much to cancellation (step 4)."""
    return m2 < np.float64(get(tab, 0, TAB_CANCEL)) * ss


@callee_njit
def redo(xr, r, n, shift, mu, tab):
    """(shift, shifted mean, M2) of a unit-stride row, redone with the shift
    ``shift + mu`` (step 4; ``mu`` in the accumulation type): the rare second first
    pass, a called function so that the row loops that check for it do not inline a
    second copy of the first pass."""
    shift = shift + mu
    a, q, ta, tq = lane_sums(xr, r, n, shift)
    mu2, m2, _ = moments(a, q, ta, tq, n)
    return shift, mu2, (m2 if not m2 < 0.0 else 0.0)


@njit(inline="always", error_model="numpy")
def checked_moments(xr, r, n, shift, a, q, ta, tq, tab):
    """(shift, shifted mean, M2) of a unit-stride row from its first pass's lane sums
    ``a``, ``q`` and totals ``ta``, ``tq`` (for ``shift``): steps 3-4 of the row
    arithmetic, the row redone when the first pass cancelled."""
    # The redo is a call (compiled once per process for all the kernels that check):
    # inlined, it made each kernel compile the first pass twice. Cold cache, Numba's
    # compile events, float32 (64, 256) after a plain call, two runs: quantized int8
    # with a given scale 1.83-1.95 -> 1.65-1.69 s, rows of 4096 quantized 2.06-2.08 ->
    # 1.78-1.87 s; the kernels' speed is unchanged (public calls in cache, four
    # placements of x and y each at n = 256-16384, plain and int8). A first pass that
    # is not cancelled has M2 >= CANCEL * SS >= 0 or NaN, so the clamp changes nothing.
    mu, m2, ss = moments(a, q, ta, tq, n)
    if cancelled(m2, ss, tab):
        return redo(xr, r, n, shift, cast(mu, shift), tab)
    return shift, mu, (m2 if not m2 < 0.0 else 0.0)


@njit(inline="always", error_model="numpy")
def column_major(a):
    """Whether the elements of a column of the 2-D ``a`` lie closer together than those
    of a row (a transposed or Fortran-ordered array of more than one row): such arrays
    are copied a column at a time."""
    return a.shape[0] > 1 and abs(a.strides[0]) < abs(a.strides[1])


@njit(inline="always", error_model="numpy")
def row_moments(xr, r, n, tab):
    """(shift, shifted mean, M2) of a unit-stride row: steps 1-4 of the row arithmetic
    (the mean and ``M2`` in float64)."""
    shift = row_shift(xr, r, n)
    a, q, ta, tq = lane_sums(xr, r, n, shift)
    return checked_moments(xr, r, n, shift, a, q, ta, tq, tab)


@callee_njit
def copy_row(dst, rd, src, rs):
    # An explicit loop: slice assignment compiles a large generic implementation.
    for i in range(src.shape[1]):
        dst[rd, i] = src[rs, i]
