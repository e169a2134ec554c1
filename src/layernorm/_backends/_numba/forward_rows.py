"""LayerNorm and RMSNorm forward of contiguous-row 2-D ``(rows, n)`` arrays.

* **row path** (row with unit stride): the ``LANES`` lanes of the row arithmetic
  (:mod:`.rowmath`) are the lanes of one SIMD vector (:mod:`._simd`), loaded straight
  from the row. In the LayerNorm forward, rows of at most ``SHORT_ROW_MAX`` elements go
  ``LANES`` at a time: each row's lane sums are computed alone, then the lane trees of
  step 3 and the ``rstd`` of step 5 are evaluated for all of them at once on folded
  vectors (row ``i`` in lane ``i``, the same additions in the same tree), which removes
  most of a short row's latency; RMSNorm's short rows likewise (:func:`rms_short_rows`).
  Longer rows are software pipelined (:func:`ln_long_rows`, :func:`rms_raw_rows`): the
  first pass over the next row runs chunk by chunk with this row's output pass; from
  ``SEQUENTIAL_MIN_ROW`` elements each row is written whole before the next is read,
  and from ``TILED_MIN_BYTES`` of parameters per row (:func:`ln_tiled_rows`,
  :func:`rms_tiled_rows`) rows go ``TILE_ROWS`` at a time, their output pass in column
  tiles over the group (from ``STREAM_ROWS_MAX_BYTES`` too when written with streaming
  stores);
* **gather path** (any other 2-D row): rows are copied into contiguous scratch rows,
  run through the row path, and the results copied out.

Each path has its own entry kernels (``ln_forward_*`` for unit-stride rows longer than
``SHORT_ROW_MAX``, ``ln_seq_forward_*`` and ``ln_tiled_forward_*`` for the long ones,
``ln_stream_forward_*`` and ``ln_stream_tiled_forward_*``, ``ln_short_forward_*``,
``ln_gathered_forward_*``, and the ``rms_`` twins of each), so that a call compiles
only the path it takes; the driver picks.
Each comes as a serial kernel (the calling thread) and a parallel one (blocks of rows
over Numba's threads); all perform the same arithmetic per row.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._scalars import cast, imax, imin, narrow, widen
from ._simd import (
    affine,
    alive,
    downward_passes_pay,
    fma,
    get,
    itemsize,
    prefetch_at,
    prefetch_pays,
    put,
    put_stat,
    raw,
    rounded,
    runtime,
    scratch_block,
    splat,
    sqrt,
    store_alignment,
    store_fence_by,
    times_w,
    vaddress,
    vload,
    vload_tail,
    vstore,
    vstore_by,
    wide,
)
from .callee import callee_njit
from .diskcache import cached_njit
from .rescale import ln_row_rescaled, needs_rescaling, rms_row_rescaled, usable_rstd
from .rowmath import (
    ALIAS_BYTES,
    BLOCK_CHUNKS,
    BLOCK_MULTIPLE,
    CHUNK,
    LANES,
    PER_LANE,
    PLAIN,
    SEQUENTIAL,
    STREAM,
    STREAM_TILED,
    TILED,
    aligned_head,
    block_end,
    block_span,
    blocked,
    cancelled,
    copy_row,
    even_blocks,
    finish,
    lane_sums,
    lane_sums_from,
    lane_sums_tail,
    moments,
    redo,
    row_chunk,
    row_moments,
    row_shift,
    row_trees,
    short_lane_sums,
    short_redo,
    square_tree,
    total_tree_sum,
    tree_sum,
    wide_row_trees,
)

#: Rows up to this long take the LayerNorm forward's short-row path, ``LANES`` rows at a
#: time (no effect on results). Measured, float32, 1 thread, kernel alone: 16-20% faster
#: at (4096, 64) and 10% at (65536, 64), 25% at (32768, 100); even at (16384, 128); at
#: n = 160-256 faster from L2 but 10-45% slower from L3, so longer rows keep the row
#: path. Such rows never take streaming stores (``STREAM_MIN_ROW`` is larger).
SHORT_ROW_MAX = 128
#: In :func:`ln_long_rows`' pipelined loop (plain stores), the output pass of a row
#: advances one chunk per this many chunks of the next row's first pass, so that the
#: next row's statistics are ready halfway and their latency overlaps the rest of the
#: output (no effect on results). Measured, float32, 1 thread, in cache, fraction of a
#: copy, 1 / 2 / 3 / all chunks first: (1170, 160) 0.46 / 0.47 / 0.47 / 0.47,
#: (724, 256) 0.51 / 0.56 / 0.55 / 0.56, (362, 512) 0.60 / 0.63 / 0.58 / 0.58,
#: (90, 2048) 0.56 / 0.60 / 0.57 / 0.55, (46, 4096) 0.52 / 0.52 / 0.52 / 0.48.
SUMS_PER_OUTPUT_CHUNK = 2
assert SUMS_PER_OUTPUT_CHUNK >= 2  # the interleaved chunks from an aligned_head fit
#: Unit-stride rows of at least this many elements, written with plain stores, take the
#: ``SEQUENTIAL`` order (:data:`.rowmath.PLAIN`; kernels ``ln_seq_forward_*``,
#: ``rms_seq_forward_*``): each row written whole, then the next one read (no effect on
#: results). The pipelined loop keeps two rows of x, a row of y, w and b in flight: from
#: 6 KiB rows on (float32 n = 1536) that is more than a 32 KiB L1. Measured, float32, 1
#: thread, kernel alone, x of 0.7 MiB (in L2), time sequential / pipelined: LayerNorm
#: n = 768 1.10, 1024 1.03, 1280 1.03, 1536 0.89, 2048 0.79, 3072 0.93, 4096 0.95,
#: 8192-16384 0.99-1.00; RMSNorm 1.11, 1.05, 1.08, 0.97, 0.82, 0.86, 0.86, 0.97-0.99;
#: x of 2 MiB (L3) LayerNorm 1536-4096 0.75-0.93, RMSNorm 0.79-0.94; 128 KiB (L1/L2)
#: 0.81-1.03; in place from DRAM (x rotated over 160 MiB; out-of-place outputs that
#: large take streaming stores, which write rows whole already) 0.63-0.91 and RMSNorm
#: 0.84-1.00 for n = 1536-16384, but at 2 threads 0.93-0.97 and 0.99-1.10 at 2048-4096
#: and 1.06-1.21 at 256-1024 (1 thread there: 0.58-1.35, noisy), so shorter rows in
#: place keep the pipelined loop too. Two threads, 1.4 MiB: 0.90-0.99 at 1536-3072,
#: 1.00-1.04 at 4096-16384. float64 gained from n = 1024 (8 KiB rows: 0.82-0.92) and
#: lost 6% (RMSNorm) at 768. Rows of a multiple of 4 KiB are sensitive to where x and y
#: start in their pages (stores and later loads 4 KiB apart look dependent), so the
#: choice was checked over 8 random placements of x and y each, 1 thread, 0.7 MiB:
#: LayerNorm median (range) 1.07 (1.02-1.13) at 1024, 0.94 (0.85-1.05) at 1536, 0.76-0.93
#: at 2048-4096, 0.99 (0.98-1.02) at 8192; RMSNorm 1.03, 1.01 (0.98-1.11), 0.76-0.90,
#: 0.99. The fused add-and-normalize kernels (``.fused``) take the same order from the
#: same length (x, residual, h, y placed at random, 0.5 MiB each): LayerNorm 0.95 at
#: 1536, 0.88 at 2048, 0.98 at 4096, 1.01 at 8192; RMSNorm 1.00, 0.94, 0.93, 1.00;
#: 1.00-1.02 at 1024.
SEQUENTIAL_MIN_ROW = 1536
#: In the ``TILED`` order (:func:`ln_tiled_rows`, :func:`rms_tiled_rows`), rows go
#: this many at a time: their statistics first, then their output pass in column tiles
#: of ``TILE_BYTES`` of ``w`` (and as much of ``b``), each tile over every row of the
#: group before the next tile (no effect on results). Row by row, a row's x and y
#: and the whole of ``w`` and ``b`` (16 KiB each at n = 4096) went through a 32 KiB L1
#: each row, so ``w`` and ``b`` came from L2 every time: the output pass alone took
#: 1.6x the time per element at n = 4096-16384 that it took at 768-1024. A tile of
#: them stays in L1 for the group's rows; x comes from L2 either way. Measured, Zen 4,
#: 1 thread, in cache (x of 0.7 MiB), public call into ``out=``, fraction of a copy,
#: row by row -> tiled: LayerNorm float32 n = 3072 0.44 -> 0.51-0.53, 4096 0.42 -> 0.50,
#: 8192 0.41 -> 0.51, 16384 0.40 -> 0.47; RMSNorm 0.61 -> 0.61, 0.58 -> 0.61, 0.49 ->
#: 0.60, 0.48 -> 0.58; LayerNorm float64 n = 1536-16384 0.38-0.44 -> 0.49-0.57; in
#: place from DRAM (4096, 4096) 4.7-5.0 ms -> 4.2-4.5 ms. Groups of 4 or 16 rows and
#: tiles of 2 or 8 KiB were within the noise of these.
TILE_ROWS = 8
TILE_BYTES = 4096
#: Rows with fewer bytes of ``w`` than this keep the ``SEQUENTIAL`` order, written whole
#: one at a time (their x is then read again from L1): tiled, float32 rows of 1536
#: were 10% slower in cache and rows of 2048 in place from DRAM 5%.
TILED_MIN_BYTES = 12 << 10
#: LayerNorm rows written with streaming stores (outputs from memory) take the
#: ``STREAM_TILED`` order (kernels ``ln_stream_tiled_forward_*``; no effect on results)
#: when the row-by-row loop's L1 working set, two rows of x (row r written, row r + 1
#: read from memory for its statistics) and ``w`` and ``b`` (of the accumulation
#: type), is more than this many bytes: then it no longer fits a 32 KiB L1 beside the
#: rest, and the stream of x from memory slowed down. Measured, Zen 4, public call into
#: ``out=``, x of 32 MiB rotated over 160 MiB, fraction of ``np.copyto`` in the same
#: rounds, row by row -> tiled, 1 thread: float32 n = 1024 (16 KiB) 1.30 -> 0.93,
#: 1280 1.15 -> 0.86, 1536 (24 KiB) 0.90-1.02 -> 0.87-0.99, 1664 0.85 -> 0.82, 1792
#: (28 KiB) 0.76 -> 0.90, 2048 (32 KiB) 0.75-0.88 -> 0.92-1.10, 3072 0.62 -> 0.75, 4096
#: 0.85 -> 0.97, 8192 0.90 -> 0.92, 16384 0.94 -> 0.96; bfloat16 x (float32
#: parameters) 1536 0.71 -> 0.64, 2048 (24 KiB) 0.69-0.86 -> 0.65-0.72, 3072 (36 KiB)
#: 0.56-0.59 -> 0.70-0.72, 4096 0.59 -> 0.71; float64 768 (24 KiB) 0.95 -> 0.91, 1024
#: (32 KiB) 0.88 -> 1.02, 1536 0.93 -> 1.09, 2048 0.98 -> 1.12;
#: 2 threads, float32 2048 1.12 -> 1.22, 3072 1.35 -> 1.34, 4096 0.95 -> 1.36, 16384
#: 1.57 -> 2.12. The fused add-and-normalize kernels keep their rows one by one: they
#: normalize ``h`` from the cache (tiled: 3-6% slower at n = 1024-4096, 10% faster at
#: 16384, float32, 1 thread).
STREAM_ROWS_MAX_BYTES = 24 << 10
#: RMSNorm rows written with streaming stores take the ``STREAM_TILED`` order
#: (``rms_stream_tiled_forward_*``) from this many bytes of ``w`` (of the accumulation
#: type): same measurement, 1 thread, float32 n = 2048 1.28-1.39 -> 1.06, 3072 0.93 ->
#: 1.07, 4096 0.98-1.01 -> 1.12, 16384 1.07 -> 1.12; bfloat16 x 3072 0.70 -> 0.81, 4096
#: 0.67 -> 0.86; float64 1024 0.86 -> 0.76, 1536 0.80 -> 0.77 (tiled: within 3%); 2
#: threads, float32 2048 1.59 -> 1.66, 3072 1.23 -> 1.21, 4096 1.00 -> 1.24, 16384 1.06 ->
#: 1.36. (Two rows of x and ``w`` do not order these lengths as the LayerNorm rule
#: does: bfloat16 rows of 3072 gain at 24 KiB.)
RMS_STREAM_TILED_MIN_BYTES = 12 << 10
#: The parallel LayerNorm kernels take the ``TILED`` order from this many bytes of
#: ``w`` (float32 rows of 2048-3071 elements; the serial ones keep ``SEQUENTIAL`` there:
#: the same bits). Measured 2026-12-05, Zen 4, float32, kernel alone, LayerNorm,
#: sequential / tiled: 2 threads in cache (90, 2048) 17.2-19.4 / 16.4-17.9 us, (120,
#: 1536) 17.6 / 17.8 us (so not below 8 KiB); 1 thread in cache (90, 2048) 29.5-33.5 /
#: 31.0-35.0 us; in place from DRAM (4096, 2048) 2 threads 1.88-1.93 / 1.37-1.55 ms, 1
#: thread 2.50-2.54 / 2.34-2.39 ms. RMSNorm gained nothing at 2048 (2 threads 19.4-21.8
#: / 19.9-21.0 us).
TILED_PARALLEL_MIN_BYTES = 8 << 10
#: The output passes of the ``SEQUENTIAL`` and ``TILED`` orders (plain stores) run
#: downwards when y lies ``1 .. ALIAS_WINDOW`` bytes after x modulo ``ALIAS_BYTES`` (no
#: effect on results): upwards, the loads of x a few vectors ahead then share the low
#: 12 address bits of stores to y still in flight and wait for them (4 KiB aliasing).
#: Measured, Zen 4, float32, 1 thread, in cache, x, w and b at a page boundary, y at
#: x + 64 / 128 / 192-256 / any other offset: (90, 2048) 53 / 38 / 35 / 31 us,
#: (242, 768) 38 / 33 / 31 / 28.6 us. The pipelined order (``PLAIN``, rows below
#: ``SEQUENTIAL_MIN_ROW``) keeps its upward pass: a direction chosen at run time in its
#: interleaved loop cost every call 5-12% at n = 768-1024. Only where downward passes
#: pay (:func:`._simd.downward_passes_pay`, AMD cores; 0 elsewhere): on an Intel Xeon
#: (Sapphire Rapids), float32, 1 thread, in cache, x 16 bytes past a page, w and b
#: apart, y at x + 0 / 16-48 / 64 / 96 / 128-1024 bytes, downwards where the window
#: said so / always upwards, two runs: (44, 4096) 34-36 / 58-65 / 35-37 / 59-61 / 33-38
#: us against 34-34 / 37-41 / 35 / 39-40 / 33-36 us; (90, 2048) 30-33 / 46-54 / 33-35 /
#: 47-48 / 32-36 against 33-34 / 35-37 / 31-33 / 35-36 / 30-33 us; (120, 1536) and
#: (22, 8192) alike. (Arrays allocated one after another often lie 16-48 bytes apart
#: modulo 4 KiB, the allocator's chunk headers: y = np.empty_like(x) lands there.)
ALIAS_WINDOW = 2048 if downward_passes_pay() else 0
#: The short-row path prefetches (a hint, no effect on results) the rows two blocks of
#: ``LANES`` rows ahead, x for reading and y for writing, in runs of rows of at least
#: this many bytes of x (beyond a core's L2, so read from L3 or DRAM: a serial call;
#: the parallel kernels' blocks are smaller), on CPUs where that pays
#: (:data:`SHORT_ROW_PREFETCH`). Measured, float32, 1 thread, from DRAM, fraction of a
#: copy, on an Intel Xeon (Sapphire Rapids): (65536, 64) 0.54-0.67 -> 0.65-0.70,
#: (16384, 128) 0.50-0.64 -> 0.74-0.80; in cache the hints cost 5-10% at (2883, 64).
PREFETCH_MIN_BYTES = 4 << 20
#: Whether the short-row path prefetches on this CPU (:func:`._simd.prefetch_pays`).
#: On an AMD EPYC (Zen 4) the hints cost more than they gained: from DRAM, 1 thread,
#: fraction of a copy without / with them (three runs, 16 MiB arrays): n = 32 0.51-0.69 /
#: 0.45-0.49, n = 48 0.63-0.82 / 0.52-0.58, n = 64 0.49-0.93 / 0.53-0.57, n = 100
#: 0.56-0.85 / 0.51-0.60, n = 128 0.58-0.89 / 0.48-0.55 (n = 16: 0.38-0.41 either way).
SHORT_ROW_PREFETCH = prefetch_pays()
#: The LayerNorm gather path's scratch holds at most this many bytes of rows of x (and
#: as many of y), at least one row (no effect on results). ``LANES`` rows of 2**20
#: float32 elements were 128 MiB allocated and paged in per call: two such rows of a
#: transposed x took 17 ms, 6x the RMSNorm gather path (one scratch row).
GATHER_BYTES = 1 << 20
#: Rows of the short-row path's scratch block: per-row lane sums of ``v`` and of
#: ``v * v`` (LANES rows each), then one row each of shifts, shifted means, rstd and
#: means (row ``i`` of the block in lane ``i``).
_S_A, _S_Q = 0, LANES
_S_SHIFT, _S_MU, _S_RSTD, _S_MEAN_OUT = 2 * LANES, 2 * LANES + 1, 2 * LANES + 2, 2 * LANES + 3
_S_ROWS = 2 * LANES + 4


@njit(inline="always", error_model="numpy")
def output_downwards(xv, yv):
    """Whether the whole-row and tiled output passes of unit-stride rows of ``xv`` into
    ``yv`` run downwards: when y lies ``1 .. ALIAS_WINDOW`` bytes after x modulo
    ``ALIAS_BYTES`` (no effect on results; see :data:`ALIAS_WINDOW`)."""
    d = (vaddress(yv, 0, 0) - vaddress(xv, 0, 0)) % ALIAS_BYTES
    return 0 < d <= ALIAS_WINDOW


@njit(inline="always", error_model="numpy")
def ln_tile_span(xr, yr, r, start, end, shift, mean, rstd, w, b, down, stores):
    """:func:`ln_row_span` upwards or (``down``) downwards, for the ``TILED`` orders,
    with the stores of ``stores`` (:func:`._simd.vstore_by`)."""
    kv = splat(shift)
    mv = splat(mean)
    rv = splat(rstd)
    for k in range(start, end, LANES):
        i = start + end - LANES - k if down else k
        v = ((vload(xr, r, i) - kv) - mv) * rv
        vstore_by(stores, yr, affine(v, w, b, i), r, i)


@njit(inline="always", error_model="numpy")
def ln_row_out_from(xr, yr, r, n, shift, mean, rstd, w, b, start, head, xh, xt):
    """Row ``r``'s output pass from element ``start`` (``head`` plus a multiple of
    ``LANES``) on, ``y = fma(((x - K) - mean) * rstd, w, b)``, plain stores; with
    ``head`` > 0 (:func:`.rowmath.aligned_head`) the vectors start at element ``head`` and the
    first vector's elements are finished from ``xh``, x's first vector loaded before any
    of the row's stores (in place, the vectors from ``head`` overwrite its last
    elements; writing them again from ``xh`` stores the same values). The elements
    after the last whole vector come likewise from ``xt``, x's last vector
    (:func:`row_ends`), in a row of at least ``LANES``."""
    body = head + (n - head) // LANES * LANES
    ln_row_span(xr, yr, r, start, body, shift, mean, rstd, w, b)
    if body < n and n >= LANES:
        v = ((xt - splat(shift)) - splat(mean)) * splat(rstd)
        vstore(yr, affine(v, w, b, n - LANES), r, n - LANES)
    else:
        for i in range(imax(start, body), n):
            v = ((widen(get(xr, r, i)) - shift) - mean) * rstd
            put(yr, r, i, narrow(affine(v, w, b, i), yr))
    if head > 0:
        v = ((xh - splat(shift)) - splat(mean)) * splat(rstd)
        vstore(yr, affine(v, w, b, runtime(0)), r, 0)


@njit(inline="always", error_model="numpy")
def ln_row_span(xr, yr, r, start, end, shift, mean, rstd, w, b):
    """Row ``r``'s output pass over elements ``start .. end`` (multiples of ``LANES``),
    ``y = fma(((x - K) - mean) * rstd, w, b)``, vectors and plain stores."""
    kv = splat(shift)
    mv = splat(mean)
    rv = splat(rstd)
    for i in range(start, end, LANES):
        v = ((vload(xr, r, i) - kv) - mv) * rv
        vstore(yr, affine(v, w, b, i), r, i)


@njit(inline="always", error_model="numpy")
def row_ends(xr, r, n, head, fill):
    """x's first vector of row ``r`` if its output pass peels ``head`` > 0 elements
    (else ``fill``, a vector never used) and its last vector if the row has at least
    ``LANES`` elements and some after its last whole vector from ``head`` (else
    ``fill``): what :func:`ln_row_out_from` and the RMSNorm output pass finish the row's
    ends from, loaded before any of its stores.

    A row's elements after its last whole vector were written one at a time (up to
    ``LANES - 1`` scalar passes a row); one more vector over the row's last ``LANES``
    elements stores the same values again. Measured, RMSNorm, float32, kernel alone,
    1 thread, x 48 bytes past a 64-byte boundary (12 elements after the last vector),
    one scalar element at a time / one vector: in cache (2048, 64) 36.1 / 30.9 us,
    (1024, 128) 24.9 / 21.4 us, (512, 256) 20.4 / 18.7 us; from DRAM (131072, 64) 2.51 /
    2.30 ms; 16 bytes past (four elements) 32.9 / 31.7 us; aligned, no tail, the same.
    A row without such elements loads no last vector (loaded unused, LayerNorm short
    rows of 32-64 took 1-2% longer, kernel alone in cache)."""
    xh = vload(xr, r, 0) if head > 0 else fill
    xt = vload(xr, r, n - LANES) if n >= LANES and (n - head) % LANES != 0 else fill
    return xh, xt


@njit(inline="always", error_model="numpy")
def ln_row_out(xr, yr, r, n, shift, mean, rstd, w, b):
    """Row ``r``'s output pass, ``y = fma(((x - K) - mean) * rstd, w, b)``, plain stores."""
    xh, xt = row_ends(xr, r, n, runtime(0), splat(shift))
    ln_row_out_from(xr, yr, r, n, shift, mean, rstd, w, b, runtime(0), runtime(0), xh, xt)


@njit(inline="always", error_model="numpy")
def ln_row_out_and_sums(xr, yr, r, n, shift, mean, rstd, w, b, rn, nshift, write, head):
    """The first pass over row ``rn`` for the shift ``nshift`` with, interleaved, the
    output pass (:func:`ln_row_out`) of row ``r`` from element ``head`` over one chunk
    per ``SUMS_PER_OUTPUT_CHUNK`` chunks of ``rn``'s first block (if ``write``).

    Returns ``rn``'s lane sums and their totals (:func:`.rowmath.lane_sums`, the same
    operations on the same values) and the element where row ``r``'s output pass
    stopped (the caller finishes it with :func:`ln_row_out_from`)."""
    kv = splat(shift)
    mv = splat(mean)
    rv = splat(rstd)
    knv = splat(nshift)
    a = q = zero = splat(cast(0.0, nshift))
    ta = tq = wide(zero)
    pad = splat(cast(-0.0, nshift))
    first = imin(n // CHUNK, BLOCK_CHUNKS)  # the chunks of the first block
    # From the head on: these chunks cover at most half the row (SUMS_PER_OUTPUT_CHUNK
    # is at least 2) and end within it.
    done = head
    for k in range(first):
        s, ss = row_chunk(xr, rn, k * CHUNK, runtime(PER_LANE), knv, pad)
        a = a + s
        q = q + ss
        if write and k % SUMS_PER_OUTPUT_CHUNK == SUMS_PER_OUTPUT_CHUNK - 1:
            for i in range(done, done + CHUNK, LANES):
                v = ((vload(xr, r, i) - kv) - mv) * rv
                vstore(yr, affine(v, w, b, i), r, i)
            done += CHUNK
    if blocked(n):  # the other blocks, closing each (rare, and long: a call)
        a, q, ta, tq = lane_sums_from(xr, rn, n, nshift, a, q, ta, tq, first)
        return a, q, ta, tq, done
    if n % CHUNK != 0:  # a partial chunk or remainder elements (a call: rare lengths)
        a, q = lane_sums_tail(xr, rn, n, nshift, a, q)
    return a, q, ta, tq, done


@njit(inline="always", error_model="numpy")
def ln_row_out_whole(xr, yr, r, n, shift, mean, rstd, w, b, order, down):
    """:func:`ln_row_out` with the stores of ``order`` (``STREAM``: streaming stores,
    ``SEQUENTIAL``: plain ones; :func:`._simd.vstore_by`), the same values; ``down``:
    the vectors go downwards (:func:`output_downwards`; plain stores only)."""
    kv = splat(shift)
    mv = splat(mean)
    rv = splat(rstd)
    # Streaming stores need y's vectors aligned: peel elements up to y's boundary.
    # Plain stores (alignment 1) start at x's instead (aligned_head).
    align = store_alignment(order, yr)
    i = 0
    head = aligned_head(xr, r, n) if align == 1 else n
    while i < head and (align == 1 or vaddress(yr, r, i) % align != 0):
        v = ((widen(get(xr, r, i)) - shift) - mean) * rstd
        put(yr, r, i, narrow(affine(v, w, b, i), yr))
        i += 1
    peeled = i
    body = i + (n - i) // LANES * LANES
    while i < body:
        # (streaming stores, rows from DRAM, keep the upward pass: not measured there)
        j = peeled + body - LANES - i if down and align == 1 else i
        v = ((vload(xr, r, j) - kv) - mv) * rv
        vstore_by(order, yr, affine(v, w, b, j), r, j)
        i += LANES
    while i < n:
        v = ((widen(get(xr, r, i)) - shift) - mean) * rstd
        put(yr, r, i, narrow(affine(v, w, b, i), yr))
        i += 1


@callee_njit
def ln_long_rows(xv, yv, wv, bv, tv, eps, n, stream, mean_out, rstd_out, r0, r1, s0):
    """Rows ``r0 .. r1`` of unit-stride :class:`._simd.Raw` views on the row path; their
    statistics go to ``s0 ..``; ``stream`` is ``PLAIN``, ``STREAM`` or ``SEQUENTIAL``
    (:data:`.rowmath.PLAIN`: the stores of y and the order of the passes). Correct for
    any ``n``; rows of at most ``SHORT_ROW_MAX`` run faster through
    :func:`ln_short_rows` (the same bits).

    Returns ``r1``, or the first finite row whose squares overflow or underflow: that row is left
    unwritten and the rows after it are not done (see :mod:`.rescale`)."""
    stop = r1
    if r0 >= r1:
        return stop
    # Software pipelined: iteration r reads row r + 1 (its first pass) while it writes
    # row r, so that reading the next row from L2 or memory overlaps writing this one,
    # and finishes the next row's statistics before the rest of row r's output pass,
    # which hides their latency. Streaming stores (rows from memory), and long rows in
    # cache (SEQUENTIAL), write row r whole, then read row r + 1. Iteration r0 - 1 only
    # reads row r0, and the last row's next
    # row is itself again (its sums discarded): one loop, one inlined copy of the row
    # arithmetic (each copy costs a cold call compile time).
    shift = mean = mo = rstd = cast(0.0, eps)
    down = output_downwards(xv, yv)
    for r in range(r0 - 1, r1):
        write = r >= r0
        if write and needs_rescaling(xv, r, n, rstd):
            stop = r
            break
        rn = imin(r + 1, r1 - 1)
        nshift = row_shift(xv, rn, n)
        if stream is None:
            # x's first and last vectors, before the row's stores (see ln_row_out_from)
            rw = imax(r, r0)
            head = aligned_head(xv, rw, n)
            xh, xt = row_ends(xv, rw, n, head, splat(nshift))
            a, q, ta, tq, done = ln_row_out_and_sums(xv, yv, r, n, shift, mean, rstd, wv,
                                                     bv, rn, nshift, write, head)
        else:
            if write:
                ln_row_out_whole(xv, yv, r, n, shift, mean, rstd, wv, bv, stream, down)
            a, q, ta, tq = lane_sums(xv, rn, n, nshift)
            done = n
        mu, m2, ss = moments(a, q, ta, tq, n)
        nmean, nmo, nrstd = finish(nshift, mu, m2, n, eps)
        if write:
            if stream is None:
                ln_row_out_from(xv, yv, r, n, shift, mean, rstd, wv, bv, done, head, xh,
                                xt)
            put_stat(mean_out, s0 + (r - r0), mo)
            put_stat(rstd_out, s0 + (r - r0), rstd)
        # Step 4 for row rn, checked after row r's output pass (rn is written in the
        # next iteration): the rare redo (a call, rowmath.checked_moments) is then no
        # longer between the two halves of the output pass, where the inlined redo's
        # vectors competed with xh and xt for registers (a call there clobbered them).
        # Measured, float32, 1 thread, kernel alone in cache, 15 shapes x placements
        # of (732, 256), (242, 768), (183, 1024), time over a plain Numba kernel
        # without checks, two runs: checked in between 1.10, 1.08; here 1.07, 1.04;
        # no check at all 1.04.
        if cancelled(m2, ss, tv):
            nshift, mu, m2 = redo(xv, rn, n, nshift, cast(mu, nshift), tv)
            nmean, nmo, nrstd = finish(nshift, mu, m2, n, eps)
        shift, mean, mo, rstd = nshift, nmean, nmo, nrstd
    if stream is not None:
        store_fence_by(stream)  # streaming stores done before another thread reads y
    return stop


@njit(inline="always", error_model="numpy")
def tile_head(xv, yv, r, n, stores):
    """Elements of row ``r`` before the first vector of its column tiles, written one
    at a time with the statistics: up to x's 64-byte boundary
    (:func:`.rowmath.aligned_head`) with plain ``stores``, up to y's with streaming ones,
    which need it (``n``, no vectors, if y's elements are not aligned to their size)."""
    align = store_alignment(stores, yv)
    if align == 1:
        return aligned_head(xv, r, n)
    address = vaddress(yv, r, 0)
    if address % itemsize(yv) != 0:
        return n
    return imin((align - address % align) % align // itemsize(yv), n)


@njit(inline="always", error_model="numpy")
def tile_elements(wv):
    """Elements of a column tile of the ``TILED`` order: ``TILE_BYTES`` of the parameter
    view ``wv``, a whole number of vectors (at least one)."""
    return imax(TILE_BYTES // itemsize(wv) // LANES, 1) * LANES


@callee_njit
def ln_tiled_rows(xv, yv, wv, bv, tv, eps, n, stores, mean_out, rstd_out, r0, r1, s0):
    """:func:`ln_long_rows` in the ``TILED`` order, for long rows: ``TILE_ROWS`` rows
    at a time, the statistics of each row (and the elements of its last partial
    vector), then the output pass of all of them in column tiles of ``TILE_BYTES`` of
    ``w``, each tile over every row of the group, with the stores of ``stores``
    (``SEQUENTIAL``: plain, ``STREAM``: streaming). The same operations per row as
    :func:`ln_long_rows` (the same bits); returns as it does. In place (``x`` is
    ``y``) too: a row's elements are read before they are written."""
    stop = r1
    # shift, shifted mean and rstd of the group's rows (widened exactly) and their
    # tile_head (exactly too), on the stack; the rows' vectors start at their
    # tile_head, the elements before it and after the last whole vector written one at
    # a time with the statistics (in place, the tiles never read them)
    sv = scratch_block(4, TILE_ROWS, np.float64)
    body = n // LANES * LANES
    tile = tile_elements(wv)
    down = store_alignment(stores, yv) == 1 and output_downwards(xv, yv)
    g0 = r0
    while g0 < r1:
        g1 = imin(g0 + TILE_ROWS, r1)
        for r in range(g0, g1):
            shift, mu, m2 = row_moments(xv, r, n, tv)
            mean, mo, rstd = finish(shift, mu, m2, n, eps)
            if needs_rescaling(xv, r, n, rstd):
                stop = r
                break
            put(sv, 0, r - g0, np.float64(shift))
            put(sv, 1, r - g0, np.float64(mean))
            put(sv, 2, r - g0, np.float64(rstd))
            put_stat(mean_out, s0 + (r - r0), mo)
            put_stat(rstd_out, s0 + (r - r0), rstd)
            head = tile_head(xv, yv, r, n, stores)
            put(sv, 3, r - g0, np.float64(head))
            end = head + (n - head) // LANES * LANES
            for j in range(head + n - end):
                i = j if j < head else end + j - head
                v = ((widen(get(xv, r, i)) - shift) - mean) * rstd
                put(yv, r, i, narrow(affine(v, wv, bv, i), yv))
        g1 = imin(g1, stop)
        for start in range(0, body, tile):
            for r in range(g0, g1):
                k = r - g0
                head = int(get(sv, 3, k))
                end = imin(head + start + tile, head + (n - head) // LANES * LANES)
                ln_tile_span(xv, yv, r, head + start, end, cast(get(sv, 0, k), eps),
                             cast(get(sv, 1, k), eps), cast(get(sv, 2, k), eps), wv, bv,
                             down, stores)
        g0 = g1 if stop == r1 else r1
    store_fence_by(stores)  # streaming stores done before another thread reads y
    return stop


@njit(inline="always", error_model="numpy")
def tiled_blocks(rows, n):
    """The number of blocks of the parallel ``TILED`` kernels: :func:`.rowmath.even_blocks`
    where that leaves each block a whole group (``TILE_ROWS`` rows), else fewer, so
    that a group's tiles of ``w`` serve its rows (24 blocks of (44, 4096) were groups
    of one or two rows): a multiple of ``BLOCK_MULTIPLE``, or the largest of 12, 8, 6,
    4 that leaves whole groups, or 2 (equal shares for two threads)."""
    blocks = even_blocks(rows, n)
    most = rows // TILE_ROWS
    if blocks <= most:
        return blocks
    if most >= BLOCK_MULTIPLE:
        return most // BLOCK_MULTIPLE * BLOCK_MULTIPLE
    for fewer in (12, 8, 6, 4):
        if fewer <= most:
            return fewer
    return imin(2, imax(rows, 1))


def tiled_stores(order):
    """The stores of a ``TILED`` (``SEQUENTIAL``: plain) or ``STREAM_TILED``
    (``STREAM``) order, None for the row-by-row orders: chosen by ``order``'s type."""
    if isinstance(order, float):
        return SEQUENTIAL
    if isinstance(order, tuple):
        return STREAM
    return None


def _tiled_stores_of_type(order):
    if isinstance(order, types.Float):
        return SEQUENTIAL
    if isinstance(order, types.BaseTuple):
        return STREAM
    return None


def blocks_in_order(rows, n, order):
    """:func:`tiled_blocks` for the ``TILED`` orders, else :func:`.rowmath.even_blocks`
    (chosen by ``order``'s type, as :func:`ln_rows_in_order`)."""
    if tiled_stores(order) is not None:
        return tiled_blocks(rows, n)
    return even_blocks(rows, n)


@overload(blocks_in_order, inline="always")
def _blocks_in_order_typed(rows, n, order):
    if _tiled_stores_of_type(order) is not None:
        return lambda rows, n, order: tiled_blocks(rows, n)
    return lambda rows, n, order: even_blocks(rows, n)


def ln_rows_in_order(xv, yv, wv, bv, tv, eps, n, order, mean_out, rstd_out, r0, r1, s0):
    """:func:`ln_tiled_rows` for the ``TILED`` and ``STREAM_TILED`` orders, else
    :func:`ln_long_rows` (``PLAIN``, ``STREAM`` or ``SEQUENTIAL``): chosen by
    ``order``'s type, so that a kernel compiles only its own row loop; :func:`ln_short_rows`
    for ``SHORT``."""
    if isinstance(order, complex):
        return ln_short_rows(xv, yv, wv, bv, tv, eps, n, mean_out, rstd_out, r0, r1, s0)
    stores = tiled_stores(order)
    if stores is not None:
        return ln_tiled_rows(xv, yv, wv, bv, tv, eps, n, stores, mean_out, rstd_out, r0, r1,
                             s0)
    return ln_long_rows(xv, yv, wv, bv, tv, eps, n, order, mean_out, rstd_out, r0, r1, s0)


@overload(ln_rows_in_order, inline="always")
def _ln_rows_in_order_typed(xv, yv, wv, bv, tv, eps, n, order, mean_out, rstd_out, r0, r1,
                            s0):
    if isinstance(order, types.Complex):
        def short(xv, yv, wv, bv, tv, eps, n, order, mean_out, rstd_out, r0, r1, s0):
            return ln_short_rows(xv, yv, wv, bv, tv, eps, n, mean_out, rstd_out, r0, r1, s0)
        return short
    stores = _tiled_stores_of_type(order)
    if stores is not None:
        def tiled(xv, yv, wv, bv, tv, eps, n, order, mean_out, rstd_out, r0, r1, s0):
            return ln_tiled_rows(xv, yv, wv, bv, tv, eps, n, stores, mean_out, rstd_out, r0,
                                 r1, s0)
        return tiled

    def pipelined(xv, yv, wv, bv, tv, eps, n, order, mean_out, rstd_out, r0, r1, s0):
        return ln_long_rows(xv, yv, wv, bv, tv, eps, n, order, mean_out, rstd_out, r0, r1,
                            s0)
    return pipelined


@callee_njit
def ln_raw_rows(xv, yv, wv, bv, tv, eps, n, stream, mean_out, rstd_out, r0, r1, s0):
    """:func:`ln_short_rows` or :func:`ln_long_rows`, by ``n``, rescaling the rows they
    stop at: every row done, for callers that serve every row length with one compiled
    function (gathered rows, the fusions)."""
    r = r0
    while r < r1:
        s = s0 + (r - r0)
        if n <= SHORT_ROW_MAX:
            stop = ln_short_rows(xv, yv, wv, bv, tv, eps, n, mean_out, rstd_out, r, r1, s)
        else:
            stop = ln_long_rows(xv, yv, wv, bv, tv, eps, n, stream, mean_out, rstd_out, r, r1,
                                s)
        if stop < r1:
            ln_row_rescaled(xv, yv, stop, n, eps, wv, bv, mean_out, rstd_out, s0 + (stop - r0))
        r = stop + 1


@njit(inline="always", error_model="numpy")
def short_scratch(eps):
    """:class:`._simd.Raw` views of the scratch blocks of :func:`short_group_moments`,
    in the caller's stack frame (:func:`._simd.scratch_block`): ``LANES`` rows' lane
    sums and statistics (x's accumulation dtype, that of ``eps``) and their float64
    ``M2`` and sums of squares. Every lane is written before it is read."""
    return scratch_block(_S_ROWS, LANES, eps), scratch_block(2, LANES, np.float64)


@njit(inline="always", error_model="numpy")
def prefetch_target(pv, n):
    """``(address, row bytes, bytes)`` of the output view ``pv`` for :func:`prefetch_row`:
    the address of its row 0, the bytes from one row to the next and the bytes of ``n``
    elements. As plain integers, the output's element type does not enter the
    signature of :func:`short_group_moments`, which the plain and the quantized short
    rows (float32 and uint8 outputs) share as one compiled function."""
    start = vaddress(pv, 0, 0)
    return start, vaddress(pv, 1, 0) - start, n * itemsize(pv)


@njit(inline="always", error_model="numpy")
def prefetch_row(xv, target, r, n):
    """Prefetch (a hint, no effect on results) row ``r`` of ``xv`` for reading and of
    the output ``target`` (:func:`prefetch_target`) for writing, ``n`` elements of
    each: the short-row paths' look ahead (:func:`short_rows_ahead`)."""
    start, row_bytes, size = target
    xpf, ppf = vaddress(xv, r, 0), start + r * row_bytes
    for o in range(0, n * itemsize(xv), 64):
        prefetch_at(xpf, o, False)
    for o in range(0, size, 64):
        prefetch_at(ppf, o, True)


@callee_njit
def short_group_moments(xv, target, sv, wv64, first, last, n, eps, ahead):
    """The statistics of the ``LANES`` rows ``first ..`` of ``xv`` (rows past ``last``
    are ``last`` again), row ``i``'s in lane ``i`` of the scratch blocks ``sv`` and
    ``wv64`` (:func:`short_scratch`; read back by :func:`short_row_moments`).

    A function of its own, called once per ``LANES`` rows, which the plain and the
    quantized short rows share: inlined into both, its body was compiled twice, and
    inlined bodies compile slower than called ones. Measured with Numba's compile
    events, float32, cold cache, Sapphire Rapids: the first plain (64, 64) call 1.88 ->
    1.72 s, a first int8 call after it 3.37 -> 2.8 s (before sharing the signature).

    Each row's lane sums are computed as on the row path and parked in ``sv``; the trees
    of ``LANES`` rows are then folded together and the moments and ``rstd`` computed for
    all of them in one vector: the same IEEE operations per row, so the same bits. With
    ``ahead``, each row prefetches the row ``2 * LANES`` rows on of ``xv`` and (for
    writing) of the output ``target`` (:func:`prefetch_target`)."""
    inv_n = splat(1.0 / np.float64(n))
    for i in range(LANES):
        row = imin(first + i, last)
        if ahead:
            prefetch_row(xv, target, imin(first + 2 * LANES + i, last), n)
        shift = row_shift(xv, row, n)
        put(sv, _S_SHIFT, i, shift)
        a, q = short_lane_sums(xv, row, n, shift)
        vstore(sv, a, _S_A + i, 0)
        vstore(sv, q, _S_Q + i, 0)
    s = wide_row_trees(sv, _S_A)
    ss = wide_row_trees(sv, _S_Q)
    mu = s * inv_n
    m2 = fma(s, mu * splat(-1.0), ss)
    vstore(wv64, m2, 0, 0)
    vstore(wv64, ss, 1, 0)
    mt = rounded(mu, eps)
    vstore(sv, mt, _S_MU, 0)
    vstore(sv, rounded(splat(1.0) / sqrt(m2 * inv_n + splat(np.float64(eps))), eps),
           _S_RSTD, 0)
    vstore(sv, vload(sv, _S_SHIFT, 0) + mt, _S_MEAN_OUT, 0)


@njit(inline="always", error_model="numpy")
def short_row_moments(xv, sv, wv64, r, i, n, eps, tv):
    """Row ``r``'s ``(shift, mean, rstd, mean_out)`` from lane ``i`` of
    :func:`short_group_moments`' blocks; a row whose ``M2`` cancelled is redone alone by
    :func:`.rowmath.short_redo`."""
    shift = get(sv, _S_SHIFT, i)
    mean = get(sv, _S_MU, i)
    rstd = get(sv, _S_RSTD, i)
    mo = get(sv, _S_MEAN_OUT, i)
    if cancelled(get(wv64, 0, i), get(wv64, 1, i), tv):
        shift, mu2, m2r = short_redo(xv, r, n, shift, mean)
        mean, mo, rstd = finish(shift, mu2, m2r, n, eps)
    return shift, mean, rstd, mo


@njit(inline="always", error_model="numpy")
def short_rows_ahead(xv, rows, n):
    """Whether :func:`short_group_moments` prefetches for ``rows`` rows of ``xv``
    (:data:`SHORT_ROW_PREFETCH`, for at least ``PREFETCH_MIN_BYTES``)."""
    return SHORT_ROW_PREFETCH and rows * n * itemsize(xv) >= PREFETCH_MIN_BYTES


@callee_njit
def ln_short_rows(xv, yv, wv, bv, tv, eps, n, mean_out, rstd_out, r0, r1, s0):
    """:func:`ln_long_rows` for rows of at most ``SHORT_ROW_MAX``, ``LANES`` rows at a time.

    A short row's time goes to the latency of its two lane trees and of its ``rstd``:
    :func:`short_group_moments` computes ``LANES`` rows' statistics in one vector (the
    same bits as the row path's), then each row's output pass follows. A last partial
    group fills its unused lanes with its last row again (loops of constant length run
    faster) and stores that row once. Returns as :func:`ln_long_rows` does.
    """
    sv, wv64 = short_scratch(eps)
    ahead = short_rows_ahead(xv, r1 - r0, n)
    target = prefetch_target(yv, n)
    stop = r1
    for first in range(r0, r1, LANES):
        if stop < r1:
            break
        short_group_moments(xv, target, sv, wv64, first, r1 - 1, n, eps, ahead)
        for i in range(imin(LANES, r1 - first)):
            shift, mean, rstd, mo = short_row_moments(xv, sv, wv64, first + i, i, n, eps, tv)
            if needs_rescaling(xv, first + i, n, rstd):
                stop = first + i
                break
            ln_row_out(xv, yv, first + i, n, shift, mean, rstd, wv, bv)
            put_stat(mean_out, s0 + (first - r0) + i, mo)
            put_stat(rstd_out, s0 + (first - r0) + i, rstd)
    return stop


@callee_njit
def _ln_gathered(x, w, b, eps, y, mean_out, rstd_out, tab, r0, r1):
    """Strided rows ``r0 .. r1``: up to ``LANES`` at a time (as many as
    :data:`GATHER_BYTES` hold, at least one) through contiguous scratch rows, computed
    by :func:`ln_raw_rows`."""
    n = x.shape[1]
    per = imax(1, imin(imin(LANES, r1 - r0), GATHER_BYTES // imax(1, n * x.itemsize)))
    xs = np.empty((per, n), dtype=x.dtype)
    ys = np.empty((per, n), dtype=y.dtype)
    xv, yv, wv, bv, tv = raw(xs), raw(ys), raw(w), raw(b), raw(tab)
    for first in range(r0, r1, per):
        count = imin(per, r1 - first)
        for i in range(count):
            copy_row(xs, i, x, first + i)
        ln_raw_rows(xv, yv, wv, bv, tv, eps, n, PLAIN, mean_out, rstd_out,
                     runtime(0), count, first)
        for i in range(count):
            copy_row(y, first + i, ys, i)
    alive(xs)
    alive(ys)


# Entry kernels, one per path, so that a call compiles only the path it takes: rows of
# unit stride (x and y) longer than SHORT_ROW_MAX, short rows of unit stride, and rows
# of any stride. The driver picks; each computes every row the same way whatever it is
# given (so a row gets the same bits on every path). ``tab`` is rowmath.merge_table.


@cached_njit(error_model="numpy")
def ln_forward_serial(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """LayerNorm forward of unit-stride rows of a 2-D ``(rows, n)`` array, calling thread,
    plain stores (``nt`` unused: :func:`ln_stream_forward_serial` streams).

    Returns the number of rows done: all of them, or the index of a finite row whose
    squares overflow or underflow, unwritten (the driver rescales it and resumes after it)."""
    stop = ln_long_rows(raw(x), raw(y), raw(w), raw(b), raw(tab), eps, x.shape[1], PLAIN,
                        mean_out, rstd_out, runtime(0), x.shape[0], runtime(0))
    alive(w)
    alive(b)
    return stop


@cached_njit(error_model="numpy")
def ln_seq_forward_serial(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_serial` writing each row whole before reading the next
    (``SEQUENTIAL``: rows of at least ``SEQUENTIAL_MIN_ROW``; ``nt`` unused)."""
    stop = ln_long_rows(raw(x), raw(y), raw(w), raw(b), raw(tab), eps, x.shape[1], SEQUENTIAL,
                        mean_out, rstd_out, runtime(0), x.shape[0], runtime(0))
    alive(w)
    alive(b)
    return stop


@cached_njit(error_model="numpy")
def ln_stream_forward_serial(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_serial` writing ``y`` with streaming stores (``nt`` unused)."""
    stop = ln_long_rows(raw(x), raw(y), raw(w), raw(b), raw(tab), eps, x.shape[1], STREAM,
                        mean_out, rstd_out, runtime(0), x.shape[0], runtime(0))
    alive(w)
    alive(b)
    return stop


@callee_njit
def stopped_blocks(pending):
    """The ``(stop, end)`` rows of the blocks in ``pending`` that stopped before an
    overflowing row (``stop < end``), in order, moved to its front: a view of them, or
    None when every block is done (the usual case: returning None costs the call a
    tenth of a microsecond, an empty array about half a microsecond more, measured at 2
    threads). Not inlined: a parallel kernel's array analysis rejects the optional
    result written out in its body."""
    k = 0
    for blk in range(pending.shape[0]):
        if pending[blk, 0] < pending[blk, 1]:
            pending[k, 0] = pending[blk, 0]
            pending[k, 1] = pending[blk, 1]
            k += 1
    if k == 0:
        return None
    return pending[:k]


# The parallel block loops are inlined into their entry kernels (each level of jitted
# calls costs a cold call about 0.3 s, see .fused).


@njit(inline="always", error_model="numpy")
def _ln_rows_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, stream):
    rows, n = x.shape
    xv, yv, wv, bv, tv = raw(x), raw(y), raw(w), raw(b), raw(tab)
    blocks = blocks_in_order(rows, n, stream)
    pending = np.empty((blocks, 2), dtype=np.int64)
    for blk in prange(blocks):
        r0, r1 = block_span(blk, blocks, rows, runtime(1))
        pending[blk, 0] = ln_rows_in_order(xv, yv, wv, bv, tv, eps, n, stream, mean_out,
                                           rstd_out, r0, r1, r0)
        pending[blk, 1] = r1
    alive(w)
    alive(b)
    return stopped_blocks(pending)


@cached_njit(parallel=True, error_model="numpy")
def ln_forward_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_serial`, blocks of rows spread over Numba's threads. Returns
    the ``(stop, end)`` rows of each block that stopped before an overflowing row (as
    the serial kernel does), None when none did."""
    return _ln_rows_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, PLAIN)


@cached_njit(parallel=True, error_model="numpy")
def ln_seq_forward_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_parallel` in the order of :func:`ln_seq_forward_serial`."""
    return _ln_rows_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, SEQUENTIAL)


@cached_njit(error_model="numpy")
def ln_tiled_forward_serial(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_serial` in the ``TILED`` order (:func:`ln_tiled_rows`: rows of
    at least ``TILED_MIN_BYTES`` of ``w``; ``nt`` unused)."""
    stop = ln_tiled_rows(raw(x), raw(y), raw(w), raw(b), raw(tab), eps, x.shape[1],
                         SEQUENTIAL, mean_out, rstd_out, runtime(0), x.shape[0], runtime(0))
    alive(w)
    alive(b)
    return stop


@cached_njit(error_model="numpy")
def ln_stream_tiled_forward_serial(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_tiled_forward_serial` writing ``y`` with streaming stores
    (``STREAM_TILED``: long rows from memory; ``nt`` unused)."""
    stop = ln_tiled_rows(raw(x), raw(y), raw(w), raw(b), raw(tab), eps, x.shape[1], STREAM,
                         mean_out, rstd_out, runtime(0), x.shape[0], runtime(0))
    alive(w)
    alive(b)
    return stop


@cached_njit(parallel=True, error_model="numpy")
def ln_tiled_forward_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_parallel` in the order of :func:`ln_tiled_forward_serial`."""
    return _ln_rows_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, TILED)


@cached_njit(parallel=True, error_model="numpy")
def ln_stream_tiled_forward_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_parallel` in the order of :func:`ln_stream_tiled_forward_serial`."""
    return _ln_rows_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, STREAM_TILED)


@cached_njit(parallel=True, error_model="numpy")
def ln_stream_forward_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_parallel` writing ``y`` with streaming stores (``nt`` unused)."""
    return _ln_rows_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, STREAM)


@cached_njit(error_model="numpy")
def ln_short_forward_serial(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_serial` for rows of at most ``SHORT_ROW_MAX`` (``nt`` unused)."""
    stop = ln_short_rows(raw(x), raw(y), raw(w), raw(b), raw(tab), eps, x.shape[1],
                         mean_out, rstd_out, runtime(0), x.shape[0], runtime(0))
    alive(w)
    alive(b)
    return stop


@cached_njit(parallel=True, error_model="numpy")
def ln_short_forward_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_short_forward_serial`, blocks of rows spread over Numba's threads
    (returns as :func:`ln_forward_parallel`)."""
    rows, n = x.shape
    xv, yv, wv, bv, tv = raw(x), raw(y), raw(w), raw(b), raw(tab)
    blocks = even_blocks(rows, n)
    pending = np.empty((blocks, 2), dtype=np.int64)
    for blk in prange(blocks):
        r0, r1 = block_span(blk, blocks, rows, runtime(LANES))
        pending[blk, 0] = ln_short_rows(xv, yv, wv, bv, tv, eps, n, mean_out, rstd_out, r0,
                                        r1, r0)
        pending[blk, 1] = r1
    alive(w)
    alive(b)
    return stopped_blocks(pending)


@cached_njit(error_model="numpy")
def ln_gathered_forward_serial(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_forward_serial` for rows of any stride (``nt`` unused)."""
    _ln_gathered(x, w, b, eps, y, mean_out, rstd_out, tab, runtime(0), x.shape[0])


@cached_njit(parallel=True, error_model="numpy")
def ln_gathered_forward_parallel(x, w, b, eps, y, mean_out, rstd_out, tab, nt):
    """:func:`ln_gathered_forward_serial`, blocks of rows spread over Numba's threads."""
    rows = x.shape[0]
    blocks = even_blocks(rows, x.shape[1])
    for blk in prange(blocks):
        r0, r1 = block_span(blk, blocks, rows, runtime(LANES))
        _ln_gathered(x, w, b, eps, y, mean_out, rstd_out, tab, r0, r1)


@callee_njit
def _row_square_chunk(xr, r, base, g, zero):
    # Leaves written out: a helper called with the constants 0 .. 7 would be compiled
    # once per constant.
    return square_tree(
        vload(xr, r, base) if g > 0 else zero,
        vload(xr, r, base + LANES) if g > 1 else zero,
        vload(xr, r, base + 2 * LANES) if g > 2 else zero,
        vload(xr, r, base + 3 * LANES) if g > 3 else zero,
        vload(xr, r, base + 4 * LANES) if g > 4 else zero,
        vload(xr, r, base + 5 * LANES) if g > 5 else zero,
        vload(xr, r, base + 6 * LANES) if g > 6 else zero,
        vload(xr, r, base + 7 * LANES) if g > 7 else zero)


def _row_sum_squares_from(xr, r, n, acc, total, first, like):
    """The lane sums of squares of a row from chunk ``first`` (0 or the start of a
    block) on, continuing ``acc`` (the chunk sums before it) and their float64 ``total``
    of closed blocks, in the fixed order, as :func:`.rowmath.lane_sums_from` (``like``:
    a scalar of the accumulation type)."""
    zero = splat(cast(0.0, like))
    groups = n // LANES
    full = groups // PER_LANE
    c = first
    while c < full:
        if c > 0:  # a block before this one: close it
            total = total + wide(acc)
            acc = zero
        end = block_end(c, full)
        for k in range(c, end):
            acc = acc + _row_square_chunk(xr, r, k * CHUNK, runtime(PER_LANE), zero)
        c = end
    g = groups - full * PER_LANE
    if g > 0:
        acc = acc + _row_square_chunk(xr, r, full * CHUNK, g, zero)
    body = groups * LANES
    if body < n:
        v = vload_tail(xr, r, body, n - body, cast(0.0, like))
        acc = acc + v * v
    return acc, total


# Inlined into the pipelined loop for rows of one block, where it closes none; a
# function for longer rows (rare, and long), so that their float64 totals and closing
# stay out of the loop of the short ones (which they slowed by 5-9% at n = 128-256).
_row_sum_squares_inlined = njit(inline="always", error_model="numpy")(_row_sum_squares_from)
_row_sum_squares_from = callee_njit(_row_sum_squares_from)


@callee_njit
def _blocked_sum_of_squares(xr, r, n, acc, first, like):
    """:func:`row_sum_of_squares` of a row of several blocks (``like``'s type)."""
    total = wide(splat(cast(0.0, like)))
    acc, total = _row_sum_squares_from(xr, r, n, acc, total, first, like)
    return cast(total_tree_sum(total, acc), like)


@njit(inline="always", error_model="numpy")
def row_sum_of_squares(xr, r, n, acc, first, like):
    """A row's sum of squares (``like``'s type): its lane sums from chunk ``first`` (0 or
    the start of the second block) on, continuing ``acc`` (the lane sums of the chunks
    before it, not yet closed), then their fixed tree (in float64 over closed blocks,
    rounded once)."""
    if blocked(n):
        return _blocked_sum_of_squares(xr, r, n, acc, first, like)
    zero = splat(cast(0.0, like))
    acc, _ = _row_sum_squares_inlined(xr, r, n, acc, wide(zero), first, like)
    return tree_sum(acc)


@njit(inline="always", error_model="numpy")
def _rms_rstd_of(ss, n, eps):
    """``rstd`` from a row's sum of squares: ``1 / sqrt(ss / n + eps)``."""
    return cast(1.0, eps) / np.sqrt(ss / cast(n, eps) + eps)


@njit(inline="always", error_model="numpy")
def _rms_row_out(xr, yr, r, n, rstd, w, start, head, xh, xt):
    """Row ``r``'s RMSNorm output pass from element ``start`` on, ``y = x * rstd * w``,
    plain stores; ``head``, ``xh`` and ``xt`` as in :func:`ln_row_out_from`."""
    body = head + (n - head) // LANES * LANES
    _rms_row_span(xr, yr, r, start, body, rstd, w)
    if body < n and n >= LANES:
        vstore(yr, times_w(xt * splat(rstd), w, n - LANES), r, n - LANES)
    else:
        for i in range(imax(start, body), n):
            put(yr, r, i, narrow(times_w(widen(get(xr, r, i)) * rstd, w, i), yr))
    if head > 0:
        vstore(yr, times_w(xh * splat(rstd), w, runtime(0)), r, 0)


@njit(inline="always", error_model="numpy")
def _rms_row_span(xr, yr, r, start, end, rstd, w):
    """Row ``r``'s RMSNorm output pass over elements ``start .. end`` (multiples of
    ``LANES``), ``y = x * rstd * w``, vectors and plain stores."""
    rv = splat(rstd)
    for i in range(start, end, LANES):
        vstore(yr, times_w(vload(xr, r, i) * rv, w, i), r, i)


@njit(inline="always", error_model="numpy")
def _rms_tile_span(xr, yr, r, start, end, rstd, w, down, stores):
    """:func:`_rms_row_span` upwards or (``down``) downwards, for the ``TILED`` orders,
    with the stores of ``stores``."""
    rv = splat(rstd)
    for k in range(start, end, LANES):
        i = start + end - LANES - k if down else k
        vstore_by(stores, yr, times_w(vload(xr, r, i) * rv, w, i), r, i)


@njit(inline="always", error_model="numpy")
def _rms_row_out_and_squares(xr, yr, r, n, rstd, w, rn, write, head):
    """:func:`ln_row_out_and_sums` for RMSNorm: the sum of squares of row ``rn``
    (:func:`row_sum_of_squares`) with row ``r``'s output pass from element ``head``
    interleaved over its first block (if ``write``); returns it and where the output
    stopped."""
    rv = splat(rstd)
    zero = splat(cast(0.0, rstd))
    acc = zero
    first = imin(n // CHUNK, BLOCK_CHUNKS)  # the chunks of the first block
    # From the head on: these chunks cover at most half the row (SUMS_PER_OUTPUT_CHUNK
    # is at least 2) and end within it.
    done = head
    for c in range(first):
        acc = acc + _row_square_chunk(xr, rn, c * CHUNK, runtime(PER_LANE), zero)
        if write and c % SUMS_PER_OUTPUT_CHUNK == SUMS_PER_OUTPUT_CHUNK - 1:
            for i in range(done, done + CHUNK, LANES):
                vstore(yr, times_w(vload(xr, r, i) * rv, w, i), r, i)
            done += CHUNK
    return row_sum_of_squares(xr, rn, n, acc, first, rstd), done


@njit(inline="always", error_model="numpy")
def _rms_row_out_whole(xr, yr, r, n, rstd, w, order, down):
    """:func:`_rms_row_out` with the stores of ``order`` (see :func:`ln_row_out_whole`)."""
    rv = splat(rstd)
    align = store_alignment(order, yr)
    i = 0
    head = aligned_head(xr, r, n) if align == 1 else n
    while i < head and (align == 1 or vaddress(yr, r, i) % align != 0):
        put(yr, r, i, narrow(times_w(widen(get(xr, r, i)) * rstd, w, i), yr))
        i += 1
    peeled = i
    body = i + (n - i) // LANES * LANES
    while i < body:
        j = peeled + body - LANES - i if down and align == 1 else i
        vstore_by(order, yr, times_w(vload(xr, r, j) * rv, w, j), r, j)
        i += LANES
    while i < n:
        put(yr, r, i, narrow(times_w(widen(get(xr, r, i)) * rstd, w, i), yr))
        i += 1


@callee_njit
def rms_raw_rows(xv, yv, wv, eps, n, stream, rstd_out, r0, r1, s0):
    """RMSNorm of rows ``r0 .. r1`` of unit-stride :class:`._simd.Raw` views; their
    ``rstd`` goes to ``s0 ..`` (the RMSNorm twin of :func:`ln_long_rows`, stopping as
    it does)."""
    stop = r1
    if r0 >= r1:
        return stop
    # Pipelined as ln_long_rows is: row r + 1's sum of squares with row r's output
    # (iteration r0 - 1 only reads row r0).
    rstd = cast(0.0, eps)
    down = output_downwards(xv, yv)
    for r in range(r0 - 1, r1):
        write = r >= r0
        if write and needs_rescaling(xv, r, n, rstd):
            stop = r
            break
        rn = imin(r + 1, r1 - 1)
        if stream is None:
            # x's first and last vectors, before the row's stores (see ln_row_out_from)
            rw = imax(r, r0)
            head = aligned_head(xv, rw, n)
            xh, xt = row_ends(xv, rw, n, head, splat(rstd))
            ss, done = _rms_row_out_and_squares(xv, yv, r, n, rstd, wv, rn, write, head)
        else:
            if write:
                _rms_row_out_whole(xv, yv, r, n, rstd, wv, stream, down)
            zero = splat(cast(0.0, eps))
            ss = row_sum_of_squares(xv, rn, n, zero, runtime(0), eps)
            done = n
        nrstd = _rms_rstd_of(ss, n, eps)
        if write:
            if stream is None:
                _rms_row_out(xv, yv, r, n, rstd, wv, done, head, xh, xt)
            put_stat(rstd_out, s0 + (r - r0), rstd)
        rstd = nrstd
    if stream is not None:
        store_fence_by(stream)
    return stop


@callee_njit
def rms_tiled_rows(xv, yv, wv, eps, n, stores, rstd_out, r0, r1, s0):
    """:func:`rms_raw_rows` in the ``TILED`` order, tiled as :func:`ln_tiled_rows`
    is, with the stores of ``stores`` (the same operations per row, the same bits);
    returns as it does."""
    stop = r1
    sv = scratch_block(2, TILE_ROWS, np.float64)  # rstd and tile_head, as ln_tiled_rows
    body = n // LANES * LANES
    tile = tile_elements(wv)
    down = store_alignment(stores, yv) == 1 and output_downwards(xv, yv)
    g0 = r0
    while g0 < r1:
        g1 = imin(g0 + TILE_ROWS, r1)
        for r in range(g0, g1):
            rstd = rms_rstd(xv, r, n, eps)
            if needs_rescaling(xv, r, n, rstd):
                stop = r
                break
            put(sv, 0, r - g0, np.float64(rstd))
            put_stat(rstd_out, s0 + (r - r0), rstd)
            head = tile_head(xv, yv, r, n, stores)
            put(sv, 1, r - g0, np.float64(head))
            end = head + (n - head) // LANES * LANES
            for j in range(head + n - end):
                i = j if j < head else end + j - head
                put(yv, r, i, narrow(times_w(widen(get(xv, r, i)) * rstd, wv, i), yv))
        g1 = imin(g1, stop)
        for start in range(0, body, tile):
            for r in range(g0, g1):
                head = int(get(sv, 1, r - g0))
                end = imin(head + start + tile, head + (n - head) // LANES * LANES)
                _rms_tile_span(xv, yv, r, head + start, end, cast(get(sv, 0, r - g0), eps),
                               wv, down, stores)
        g0 = g1 if stop == r1 else r1
    store_fence_by(stores)
    return stop


def rms_rows_in_order(xv, yv, wv, eps, n, order, rstd_out, r0, r1, s0):
    """:func:`rms_tiled_rows` for the ``TILED`` orders, else :func:`rms_raw_rows`
    (see :func:`ln_rows_in_order`), :func:`rms_short_rows` for ``SHORT``."""
    if isinstance(order, complex):
        return rms_short_rows(xv, yv, wv, eps, n, rstd_out, r0, r1, s0)
    stores = tiled_stores(order)
    if stores is not None:
        return rms_tiled_rows(xv, yv, wv, eps, n, stores, rstd_out, r0, r1, s0)
    return rms_raw_rows(xv, yv, wv, eps, n, order, rstd_out, r0, r1, s0)


@overload(rms_rows_in_order, inline="always")
def _rms_rows_in_order_typed(xv, yv, wv, eps, n, order, rstd_out, r0, r1, s0):
    if isinstance(order, types.Complex):
        def short(xv, yv, wv, eps, n, order, rstd_out, r0, r1, s0):
            return rms_short_rows(xv, yv, wv, eps, n, rstd_out, r0, r1, s0)
        return short
    stores = _tiled_stores_of_type(order)
    if stores is not None:
        def tiled(xv, yv, wv, eps, n, order, rstd_out, r0, r1, s0):
            return rms_tiled_rows(xv, yv, wv, eps, n, stores, rstd_out, r0, r1, s0)
        return tiled

    def pipelined(xv, yv, wv, eps, n, order, rstd_out, r0, r1, s0):
        return rms_raw_rows(xv, yv, wv, eps, n, order, rstd_out, r0, r1, s0)
    return pipelined


@callee_njit
def rms_rows_rescued(xv, yv, wv, eps, n, stream, rstd_out, r0, r1, s0):
    """:func:`rms_raw_rows` with the rows it stops at rescaled: every row done (for the
    fusions)."""
    r = r0
    while r < r1:
        stop = rms_raw_rows(xv, yv, wv, eps, n, stream, rstd_out, r, r1, s0 + (r - r0))
        if stop < r1:
            rms_row_rescaled(xv, yv, stop, n, eps, wv, rstd_out, s0 + (stop - r0))
        r = stop + 1


@callee_njit
def _rms_gathered(x, w, eps, y, rstd_out, r0, r1):
    """Strided rows ``r0 .. r1`` through a contiguous scratch row."""
    n = x.shape[1]
    xs = np.empty((1, n), dtype=x.dtype)
    ys = np.empty((1, n), dtype=y.dtype)
    xv, yv, wv = raw(xs), raw(ys), raw(w)
    for r in range(r0, r1):
        copy_row(xs, 0, x, r)
        rstd = rms_rstd(xv, runtime(0), n, eps)
        # A finite row whose squares overflow or underflow is written by rms_row_rescaled instead.
        if usable_rstd(rstd) or not rms_row_rescaled(xv, yv, runtime(0), n, eps, wv, rstd_out, r):
            xh, xt = row_ends(xv, runtime(0), n, runtime(0), splat(rstd))
            _rms_row_out(xv, yv, runtime(0), n, rstd, wv, runtime(0), runtime(0), xh, xt)
            put_stat(rstd_out, r, rstd)
        copy_row(y, r, ys, 0)
    alive(xs)
    alive(ys)


@njit(inline="always", error_model="numpy")
def rms_rstd(xr, r, n, eps):
    """RMSNorm ``rstd`` of row ``r`` of a unit-stride view: the sum of squares in the row
    arithmetic's fixed trees (:mod:`.rowmath`), then ``1 / sqrt(ss / n + eps)``."""
    zero = splat(cast(0.0, eps))
    return _rms_rstd_of(row_sum_of_squares(xr, r, n, zero, runtime(0), eps), n, eps)


#: Rows of :func:`rms_short_rows`' scratch block: ``LANES`` rows' lane sums of squares,
#: then their ``rstd``.
_RS_ROWS = LANES + 1


@callee_njit
def rms_short_rows(xv, yv, wv, eps, n, rstd_out, r0, r1, s0):
    """:func:`rms_raw_rows` for rows of at most ``SHORT_ROW_MAX``, ``LANES`` rows at a
    time, as :func:`ln_short_rows`: each row's lane sums of squares alone (as
    :func:`row_sum_of_squares` computes them), then the lane trees and ``rstd`` of the
    ``LANES`` rows in one vector (row ``i`` in lane ``i``: the same IEEE operations per
    row, so the same bits), then each row's output pass. Returns as
    :func:`rms_raw_rows` does. Correct for rows that close no block (up to
    ``BLOCK_CHUNKS * CHUNK`` elements), as the entry kernels' tests call it.

    Measured against the pipelined row path (:func:`rms_raw_rows`), float32, 1 thread,
    the serial kernels alone, interleaved, fraction of a copy of the same bytes: in
    cache (2883, 64) 0.42 -> 0.47, (4096, 32) 0.26 -> 0.39, (2048, 48) 0.32 -> 0.44,
    (1024, 128) 0.57 -> 0.60, (1310, 100) 0.45 / 0.44; from DRAM (131072, 64) 0.86 ->
    0.89, (262144, 32) 0.62 -> 0.87, (174762, 48) 0.83 -> 0.99, (65536, 128) 0.88 /
    0.87. A cold first ``rms_norm`` of (256, 64) compiles 0.45 s less (1.65-1.70 ->
    1.16-1.24 s)."""
    sv = scratch_block(_RS_ROWS, LANES, eps)
    zero = splat(cast(0.0, eps))
    count = splat(cast(n, eps))
    ahead = short_rows_ahead(xv, r1 - r0, n)
    target = prefetch_target(yv, n)
    stop = r1
    for first in range(r0, r1, LANES):
        if stop < r1:
            break
        for i in range(LANES):
            row = imin(first + i, r1 - 1)
            if ahead:  # as short_group_moments
                prefetch_row(xv, target, imin(first + 2 * LANES + i, r1 - 1), n)
            acc, _ = _row_sum_squares_inlined(xv, row, n, zero, wide(zero), runtime(0), eps)
            vstore(sv, acc, i, 0)
        ss = row_trees(sv, runtime(0))
        vstore(sv, splat(cast(1.0, eps)) / sqrt(ss / count + splat(eps)), LANES, 0)
        for i in range(imin(LANES, r1 - first)):
            r = first + i
            rstd = get(sv, LANES, i)
            if needs_rescaling(xv, r, n, rstd):
                stop = r
                break
            xh, xt = row_ends(xv, r, n, runtime(0), splat(rstd))
            _rms_row_out(xv, yv, r, n, rstd, wv, runtime(0), runtime(0), xh, xt)
            put_stat(rstd_out, s0 + (r - r0), rstd)
    return stop


@cached_njit(error_model="numpy")
def rms_short_forward_serial(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_serial` for rows of at most ``SHORT_ROW_MAX`` (``nt``
    unused)."""
    stop = rms_short_rows(raw(x), raw(y), raw(w), eps, x.shape[1], rstd_out, runtime(0),
                          x.shape[0], runtime(0))
    alive(w)
    return stop


@cached_njit(parallel=True, error_model="numpy")
def rms_short_forward_parallel(x, w, eps, y, rstd_out, nt):
    """:func:`rms_short_forward_serial`, blocks of rows spread over Numba's threads
    (returns as :func:`ln_forward_parallel`)."""
    rows, n = x.shape
    xv, yv, wv = raw(x), raw(y), raw(w)
    blocks = even_blocks(rows, n)
    pending = np.empty((blocks, 2), dtype=np.int64)
    for blk in prange(blocks):
        r0, r1 = block_span(blk, blocks, rows, runtime(LANES))
        pending[blk, 0] = rms_short_rows(xv, yv, wv, eps, n, rstd_out, r0, r1, r0)
        pending[blk, 1] = r1
    alive(w)
    return stopped_blocks(pending)


@cached_njit(error_model="numpy")
def rms_forward_serial(x, w, eps, y, rstd_out, nt):
    """RMSNorm forward of unit-stride rows of a 2-D array on the calling thread, plain
    stores (returns as :func:`ln_forward_serial`; ``nt`` unused)."""
    stop = rms_raw_rows(raw(x), raw(y), raw(w), eps, x.shape[1], PLAIN, rstd_out,
                        runtime(0), x.shape[0], runtime(0))
    alive(w)
    return stop


@cached_njit(error_model="numpy")
def rms_seq_forward_serial(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_serial` writing each row whole before reading the next
    (see :func:`ln_seq_forward_serial`)."""
    stop = rms_raw_rows(raw(x), raw(y), raw(w), eps, x.shape[1], SEQUENTIAL, rstd_out,
                        runtime(0), x.shape[0], runtime(0))
    alive(w)
    return stop


@cached_njit(error_model="numpy")
def rms_stream_forward_serial(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_serial` writing ``y`` with streaming stores."""
    stop = rms_raw_rows(raw(x), raw(y), raw(w), eps, x.shape[1], STREAM, rstd_out,
                        runtime(0), x.shape[0], runtime(0))
    alive(w)
    return stop


@njit(inline="always", error_model="numpy")
def _rms_rows_parallel(x, w, eps, y, rstd_out, stream):
    rows, n = x.shape
    xv, yv, wv = raw(x), raw(y), raw(w)
    blocks = blocks_in_order(rows, n, stream)
    pending = np.empty((blocks, 2), dtype=np.int64)
    for blk in prange(blocks):
        r0, r1 = block_span(blk, blocks, rows, runtime(1))
        pending[blk, 0] = rms_rows_in_order(xv, yv, wv, eps, n, stream, rstd_out, r0, r1,
                                            r0)
        pending[blk, 1] = r1
    alive(w)
    return stopped_blocks(pending)


@cached_njit(parallel=True, error_model="numpy")
def rms_forward_parallel(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_serial`, blocks of rows spread over Numba's threads (returns
    as :func:`ln_forward_parallel`)."""
    return _rms_rows_parallel(x, w, eps, y, rstd_out, PLAIN)


@cached_njit(parallel=True, error_model="numpy")
def rms_seq_forward_parallel(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_parallel` in the order of :func:`rms_seq_forward_serial`."""
    return _rms_rows_parallel(x, w, eps, y, rstd_out, SEQUENTIAL)


@cached_njit(error_model="numpy")
def rms_tiled_forward_serial(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_serial` in the ``TILED`` order (:func:`rms_tiled_rows`)."""
    stop = rms_tiled_rows(raw(x), raw(y), raw(w), eps, x.shape[1], SEQUENTIAL, rstd_out,
                          runtime(0), x.shape[0], runtime(0))
    alive(w)
    return stop


@cached_njit(error_model="numpy")
def rms_stream_tiled_forward_serial(x, w, eps, y, rstd_out, nt):
    """:func:`rms_tiled_forward_serial` writing ``y`` with streaming stores
    (``STREAM_TILED``)."""
    stop = rms_tiled_rows(raw(x), raw(y), raw(w), eps, x.shape[1], STREAM, rstd_out,
                          runtime(0), x.shape[0], runtime(0))
    alive(w)
    return stop


@cached_njit(parallel=True, error_model="numpy")
def rms_tiled_forward_parallel(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_parallel` in the order of :func:`rms_tiled_forward_serial`."""
    return _rms_rows_parallel(x, w, eps, y, rstd_out, TILED)


@cached_njit(parallel=True, error_model="numpy")
def rms_stream_tiled_forward_parallel(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_parallel` in the order of :func:`rms_stream_tiled_forward_serial`."""
    return _rms_rows_parallel(x, w, eps, y, rstd_out, STREAM_TILED)


@cached_njit(parallel=True, error_model="numpy")
def rms_stream_forward_parallel(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_parallel` writing ``y`` with streaming stores."""
    return _rms_rows_parallel(x, w, eps, y, rstd_out, STREAM)


@cached_njit(error_model="numpy")
def rms_gathered_forward_serial(x, w, eps, y, rstd_out, nt):
    """:func:`rms_forward_serial` for rows of any stride (``nt`` unused)."""
    _rms_gathered(x, w, eps, y, rstd_out, runtime(0), x.shape[0])


@cached_njit(parallel=True, error_model="numpy")
def rms_gathered_forward_parallel(x, w, eps, y, rstd_out, nt):
    """:func:`rms_gathered_forward_serial`, blocks of rows spread over Numba's threads."""
    rows = x.shape[0]
    blocks = even_blocks(rows, x.shape[1])
    for blk in prange(blocks):
        r0, r1 = block_span(blk, blocks, rows, runtime(1))
        _rms_gathered(x, w, eps, y, rstd_out, r0, r1)
