"""LayerNorm/RMSNorm (optionally after the residual add) with int8/float8 output, in one pass.

Rows longer than ``SHORT_ROW_MAX`` (LayerNorm) and every RMSNorm row go block of rows by
block of rows (``BLOCK_ELEMENTS``; with a residual, the block's ``h = x + res`` is
computed and stored first, exactly as in :mod:`.fused`). Per row the statistics are
computed as the plain forward computes them (:func:`.rowmath.row_moments` and
:func:`.rowmath.finish`, as :func:`.forward_rows.ln_long_rows` does;
:func:`.forward_rows.rms_rstd` for RMSNorm; for rows of at most
:data:`PIPELINED_ROW_ELEMENTS`, the next row's before a row's output pass, so that their
latency overlaps it; for longer rows, a row's own just before its output pass, the row
still in L1), then one output pass forms
each vector of ``y32`` (the output in the accumulation precision before any rounding)
with the plain forward's operations (:func:`ln_row_y32`, :func:`rms_row_y32`: those of
:func:`.forward_rows.ln_row_out` and of the RMSNorm output pass), so ``y32`` is bit for
bit what the plain forward of the float32-widened input writes:

* static scale: each vector is quantized as it is formed (:func:`ln_row_codes`,
  :func:`rms_row_codes`), no float32 row is stored;
* dynamic scale: the pass stores ``y32`` into a float32 buffer while tracking the
  row's ``amax``: a one-row buffer (in L1) whose codes follow at once, except float8
  rows of at most :data:`PIPELINED_ROW_ELEMENTS`, which go into a block buffer whose
  codes are formed after the block's rows (still in cache, the rows' scale chains
  overlapping the heavier float8 rounding).

Rows with at least ``TILED_MIN_BYTES`` of weight (LayerNorm: ``LN_TILED_MIN_BYTES``;
:data:`TILED`) go in blocks of
``TILE_ROWS`` rows whose output pass runs in column tiles over the block's rows, as the
plain forward's tiled rows do (:func:`ln_tiled_quant`): the same values in another order.

The passes that read no memory prefetch what the next statistics pass will read
(:data:`PREFETCH_BYTES`), so that from DRAM the reading overlaps the arithmetic.

LayerNorm rows of at most ``SHORT_ROW_MAX`` get their statistics ``LANES`` rows at a
time, as :func:`.forward_rows.ln_short_rows` computes them, then each row's codes
(:func:`ln_short_quant_rows`): a static scale's straight from the output pass, a dynamic
scale's through the group's float32 rows (in L1), the group's scales and inverses
computed together in one vector (:func:`group_inverses`; measured, int8, 1 thread, in
cache, against one row's at a time, three alternating pairs of processes: (4096, 32)
107-110 -> 92-104 us, (2048, 64) 71-79 -> 68-73 us, (1024, 128) 53-60 -> 47-54 us;
from DRAM within the noise), the codes of the group's rows after its last. Measured,
LayerNorm, float32, public call into ``out=``, 1 thread, through a float32 block (what
the plain forward writes, then quantized) / this: from DRAM (131072, 64) int8 per-row
scale 6.3-6.5 / 5.1-5.4 ms, given scale 5.8-6.1 / 3.9-4.0 ms (the plain norm 3.3-3.7
ms), float8_e4m3fn 7.0-7.2 / 6.0-6.2 and 6.6-6.8 / 5.4 ms; in
cache (2048, 64) int8 66-68 / 70-78 us, given scale 57-60 / 53-57 us. The rescuing
kernels still go through a float32 block (:func:`_quantize_block`).

Quantization of one row (the contract's formula, in float32):

* dynamic: ``amax`` is the largest ``|y32|`` of the row, found as the largest integer
  of the bit patterns with the sign cleared (for non-negative floats the integer order
  is the float order, and NaN patterns are above infinity's, so a NaN in the row makes
  ``amax`` NaN as ``max`` would); ``scale = amax / qmax`` (1 for an all-zero row);
* ``inv = 1 / scale`` once per row (given per row for a static scale);
* ``v = y32 * inv``; int8: NaN -> 0, saturate to [-128, 127] (saturating before the
  rounding gives the same integer, the bounds being integers), round half to even by
  adding ``1.5 * 2**23`` in float32 (the sum's low byte is the code); float8: saturate to ``+-qmax``
  (NaN kept), then round the float32 bits half to even to the target format,
  subnormals included.

The quantization runs on SIMD vectors (:func:`._simd.vabsmax`, :func:`._simd.store_int8`,
:func:`._simd.store_float8_e4m3fn`, :func:`._simd.store_float8_e5m2`): integer operations
on bit patterns, IEEE comparisons and one exact rounding step per lane, so every lane
gets what the scalar formula gives. An int8 row with its own dynamic scale whose
inverse is positive and finite stores its codes without the NaN step and (with
AVX-512) the upper clamp, which none of its lanes need (:func:`bounded_row`,
:func:`._simd.store_int8_bounded`). Codes are written to a ``uint8`` view of the output
(int8 as its two's-complement byte). The format reaches the kernels as a tag
(:data:`FORMAT_TAGS`: an empty array whose dtype stands for it), so each format is a
specialization of its own and a call compiles only the format it asks for. The
accumulation precision must be float32 (float16, bfloat16 or float32 input); float64
input is quantized by the engine's composition.

Each kernel comes serial and parallel (blocks over Numba's threads): the same arithmetic
per row, the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import (
    NativeValue,
    models,
    overload,
    register_model,
    typeof_impl,
    unbox,
)

from ._scalars import cast, imin, narrow, widen
from ._simd import (
    affine,
    alive,
    get,
    hmax_bits,
    itemsize,
    lane,
    prefetch_at,
    put,
    put_stat,
    raw,
    runtime,
    scales_of,
    scratch_block,
    splat,
    store_float8_e4m3fn,
    store_float8_e5m2,
    store_int8,
    store_int8_bounded,
    times_w,
    vabsmax,
    vaddress,
    vload,
    vstore,
)
from .callee import callee_njit
from .diskcache import cached_njit
from .forward_rows import (
    PLAIN,
    TILE_ROWS,
    ln_raw_rows,
    prefetch_target,
    rms_rows_rescued,
    rms_rstd,
    short_group_moments,
    short_row_moments,
    short_rows_ahead,
    short_scratch,
    tile_elements,
)
from .fused import PARALLEL_BLOCKS, add_block, block_rows
from .rescale import needs_rescaling
from .rowmath import (
    LANES,
    aligned_head,
    finish,
    row_maxima,
    row_moments,
)

#: Elements per block of rows (no effect on results): a float8 dynamic scale's float32
#: block buffer (:func:`block_codes_of`) stays in L2 between the output pass and the
#: codes.
BLOCK_ELEMENTS = 1 << 14
#: The row passes that read no memory (a row's output pass, from L1 or L2; a block's
#: codes from its buffer) prefetch (a hint, no effect on results) the row that the next
#: row's statistics pass reads (for a block's codes, the next block's rows), up to this
#: many bytes of each: from DRAM, that row's reading then overlaps the arithmetic
#: instead of following it (measured, float32, 1 thread, int8: rows of 256-2048 took
#: 0.6-0.95x the time, a static scale's codes 0.7-1.3x the plain norm's; longer rows,
#: whose reading the hardware prefetchers follow, unchanged; in cache, where the hints
#: are only instructions, a static scale unchanged and per-row scales up to about 10%
#: slower).
PREFETCH_BYTES = 8192

#: Rows of at most this many elements are software pipelined on the row path (a row's
#: output pass one row behind the statistics: :func:`ln_rows_quant`, the
#: ``ln_quant_forward_*``/``rms_quant_forward_*`` kernels); longer rows take each row's
#: statistics, then its output pass (the ``*_long_quant_forward_*`` kernels). Measured,
#: int8 with a static scale into ``out=``, the kernel alone, float32, 1 thread, pipelined
#: / not: in cache (512, 256) 33 / 38 us, (128, 1024) 28 / 26, (32, 4096) 29 / 24.5; from
#: DRAM (8192, 1024) 2774 / 2071 us, (2048, 4096) 3322 / 3036 (the plain norm 1824 and
#: 2898). With a per-row scale, longer rows store ``y32`` in one L1 row whose codes follow
#: at once instead of in the block buffer whose codes follow the block (measured,
#: LayerNorm int8 into ``out=`` through the public call, float32, 1 thread, two runs
#: alternating with the block buffer, us: from DRAM (4096, 768) 1339-1477 -> 993-1128,
#: (8192, 1024) 3473-3828 -> 2873-2883, (1024, 4096) 2210-2227 -> 2049-2113; in cache
#: (256, 768) 65-83 -> 56, (32, 4096) 43-44 -> 42; float8 e4m3fn within 5%). So do
#: pipelined int8 rows (:func:`block_codes_of`), measured the same way (2026-12-06),
#: block buffer / one row, us: from DRAM LayerNorm (32768, 256) 4598-4696 / 3232-3237,
#: (41943, 200) 5159-5512 / 3905-3937, RMSNorm (32768, 256) 3457-3877 / 2459-2523,
#: (131072, 64) 4399-4672 / 3322-3376; in cache within noise. Float8 e4m3fn, whose
#: rounding is heavier, keeps the block buffer: one row cost RMSNorm (131072, 64)
#: 4351-4392 -> 5073-5081 us from DRAM, LayerNorm's short rows (2048, 64) 79-82 -> 95-98
#: us in cache; the short LayerNorm rows keep their group of ``LANES`` rows for every
#: format (int8 with one row: the same from DRAM, 0-15% slower in cache). Computing
#: ``y32`` twice instead (a pass for ``amax``, then the codes as for a static scale, no
#: buffer) was between the two for pipelined rows and slower for longer ones (LayerNorm
#: (10922, 768) from DRAM 2734-2794 -> 3022-3046 us).
PIPELINED_ROW_ELEMENTS = 256
#: The ``pipelined`` argument of the row loops: ``PIPELINED`` (True) or ``ROW_BY_ROW``
#: (None), chosen by type as ``DYNAMIC``/``STATIC`` are, so that a kernel compiles one
#: loop (a lag chosen at run time inside one loop cost 15% at (512, 256) in cache; both
#: loops in one kernel doubled a cold quantized call's compile time).
PIPELINED = True
ROW_BY_ROW = None
#: The third value of ``pipelined`` (an integer, told apart by type through
#: :func:`ln_quant_rows_by`): rows with at least ``TILED_MIN_BYTES`` of weight go in
#: blocks of ``TILE_ROWS`` rows through :func:`ln_tiled_quant` (the
#: ``*_tiled_quant_forward_*`` kernels), whose output pass reads ``w`` and ``b`` a tile at
#: a time from L1 for every row of the block, as the plain forward's tiled rows do.
#: Measured, LayerNorm int8, float32, 1 thread, in cache, the kernel alone, row by row ->
#: tiled, us: static scale (32, 4096) 26.2 -> 22.8, (16, 8192) 25.5 -> 22.7, (8, 16384)
#: 24.6 -> 22.4; per-row scale 35.9 -> 29.7, 37.3 -> 29.9, 35.7 -> 32.7.
TILED = 0
#: LayerNorm's quantizing kernels take the ``TILED`` loop from this many bytes of
#: (float32) weight, rows of 2048 elements, below the plain forward's
#: ``TILED_MIN_BYTES``: the row-by-row loop's float32 row buffer joins the rows of x, w
#: and b in L1. Measured, int8, float32, public call into ``out=``, row by row / tiled,
#: (89, 2048) in cache, 1 thread: per-row scale 84-85 / 80-81 us, given scale 87 / 85
#: us, float8_e4m3fn 110 / 102-105 us; (4096, 2048) from DRAM, 1 thread: per-row scale
#: 3.91-4.25 / 3.33-3.37 ms, given scale 3.03 / 3.01 ms, float8_e4m3fn 4.40-4.47 /
#: 4.05-4.23 ms; 2 threads per-row 2.05 / 1.82 ms. Rows of 1536: 81 / 83 us in cache,
#: 3.85 / 3.70 ms from DRAM (kept row by row). RMSNorm keeps ``TILED_MIN_BYTES``
#: (from DRAM at 2048: 3.22 / 3.57 ms).
LN_TILED_MIN_BYTES = 8 << 10

#: The format tags the kernels take: an empty array whose dtype (not its contents)
#: selects the format when a kernel is compiled, one specialization per format.
FORMAT_TAGS = {
    "int8": np.empty(0, dtype=np.int8),
    "float8_e4m3fn": np.empty(0, dtype=np.uint8),
    "float8_e5m2": np.empty(0, dtype=np.uint16),
}


class DynamicScale:
    """The type of :data:`DYNAMIC`, the kernels' ``dynamic`` argument for per-row scales.

    Numba prunes a branch on ``arg is None`` before typing only if the argument's type is
    None or has a ``literal_type`` (:class:`DynamicScaleType` does); for ``True``, a
    boolean, it kept both branches, so a per-row-scale call compiled the static scale's
    code too."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DYNAMIC"


class DynamicScaleType(types.Dummy):
    """Numba's type of a :class:`DynamicScale`: no data, never None."""

    def __init__(self) -> None:
        super().__init__(name="DynamicScale")

    @property
    def literal_type(self) -> types.Type:
        """Itself: what dead-branch pruning compares with None (never the same)."""
        return self


_DYNAMIC_SCALE_TYPE = DynamicScaleType()
register_model(DynamicScaleType)(models.OpaqueModel)


@typeof_impl.register(DynamicScale)
def _typeof_dynamic_scale(val, c):
    return _DYNAMIC_SCALE_TYPE


@unbox(DynamicScaleType)
def _unbox_dynamic_scale(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


#: The ``dynamic`` argument of the kernels: ``DYNAMIC`` computes each row's scale,
#: ``STATIC`` (None) takes the given ``1 / scale`` rows. The choice is made by the
#: argument's *type* (Numba prunes ``dynamic is None`` before typing, for a
#: :class:`DynamicScale` as for None), so a call compiles only the scale it uses.
DYNAMIC = DynamicScale()
STATIC = None
#: ``qmax`` of each format, by its tag's dtype.
_QMAX = {np.dtype(np.int8): 127.0, np.dtype(np.uint8): 448.0, np.dtype(np.uint16): 57344.0}


def qmax_of(fmt):
    """``qmax`` (float32) of the format tagged ``fmt`` (a :data:`FORMAT_TAGS` value)."""
    return np.float32(_QMAX[fmt.dtype])


@overload(qmax_of)
def _qmax_of_typed(fmt):
    value = np.float32(_QMAX[np.dtype(fmt.dtype.name)])
    return lambda fmt: value


def store_codes(fmt, view, vec, r, i):
    """The codes of the float32 vector ``vec`` at ``[r, i]`` of the uint8 view ``view``,
    in the format tagged ``fmt``."""
    if fmt.dtype == np.int8:
        store_int8(view, vec, r, i)
    elif fmt.dtype == np.uint8:
        store_float8_e4m3fn(view, vec, r, i)
    else:
        store_float8_e5m2(view, vec, r, i)


@overload(store_codes)
def _store_codes_typed(fmt, view, vec, r, i):
    store = {types.int8: store_int8, types.uint8: store_float8_e4m3fn,
             types.uint16: store_float8_e5m2}[fmt.dtype]
    return lambda fmt, view, vec, r, i: store(view, vec, r, i)


def has_bounded_store(fmt):
    """Whether the format tagged ``fmt`` has a faster store for the vectors of a row
    quantized with its own dynamic scale (:func:`._simd.store_int8_bounded`; int8
    only): known when compiling, so the other formats compile no second loop."""
    return fmt.dtype == np.int8


@overload(has_bounded_store)
def _has_bounded_store_typed(fmt):
    flag = fmt.dtype == types.int8
    return lambda fmt: flag


def store_bounded_codes(fmt, view, vec, r, i):
    """:func:`store_codes` of a vector of a row quantized with its own dynamic scale
    whose inverse is positive and finite (see :func:`bounded_row`): int8's bounded
    store, the other formats' own."""
    if has_bounded_store(fmt):
        store_int8_bounded(view, vec, r, i)
    else:
        store_codes(fmt, view, vec, r, i)


@overload(store_bounded_codes)
def _store_bounded_codes_typed(fmt, view, vec, r, i):
    if fmt.dtype == types.int8:
        return lambda fmt, view, vec, r, i: store_int8_bounded(view, vec, r, i)
    return lambda fmt, view, vec, r, i: store_codes(fmt, view, vec, r, i)


@njit(inline="always", error_model="numpy")
def bounded_row(fmt, own, inv):
    """Whether a row's codes may take :func:`store_bounded_codes`: ``own``, its
    ``inv`` computed from the row's own ``amax`` (a dynamic scale), and ``inv``
    positive and finite. Then ``amax`` is finite (a NaN or infinite ``amax`` makes
    ``inv`` NaN or 0) and so is every ``y32``, and ``|y32 * inv| <= amax * inv``,
    within a few units in the last place of ``qmax`` (``1 / inv`` is a normal float32
    or, if subnormal, at least ``2**-128``: 21 bits of precision): no lane is NaN or
    anywhere near ``2**31``."""
    return (has_bounded_store(fmt) and own and inv > np.float32(0.0)
            and inv < np.float32(np.inf))


@njit(inline="always", error_model="numpy")
def inverse_of(top, r, fmt, scale_out):
    """``1 / scale`` of row ``r`` from ``top``, the :func:`._simd.vabsmax` of its ``y32``
    (the dynamic scale, stored in ``scale_out[r]``)."""
    amax = hmax_bits(top)
    scale = amax / qmax_of(fmt)
    if amax == 0:
        scale = np.float32(1.0)
    scale_out[r] = scale
    return np.float32(1.0) / scale


@njit(inline="always", error_model="numpy")
def group_inverses(tv, count, r, fmt, scale_out, invs):
    """:func:`inverse_of` of the :func:`._simd.vabsmax` vectors in rows ``0 .. count``
    (at most ``LANES``) of the float32 view ``tv``: rows ``r ..`` of the call, whose
    scales go to ``scale_out``, their inverses to ``invs[0 .. count]``.

    The rows' largest magnitudes are folded into one vector (row ``i``'s in lane
    ``i``: maxima are exact, so this is :func:`._simd.hmax_bits` of each row) and
    their scales and inverses are computed for all of them at once: the same IEEE
    divisions per row, so the same bits."""
    amax = row_maxima(tv, runtime(0))
    scale = scales_of(amax, splat(qmax_of(fmt)))
    inv = splat(np.float32(1.0)) / scale
    for i in range(count):
        scale_out[r + i] = lane(scale, i)
        invs[i] = lane(inv, i)


@njit(inline="always", error_model="numpy")
def row_inverse(yv, k, r, n, fmt, dynamic, inv_rows, scale_out):
    """``1 / scale`` of row ``k`` of the float32 block view ``yv`` (row ``r`` of the call).

    ``dynamic`` (``DYNAMIC``): the scale is computed from the row's ``amax`` and stored
    in ``scale_out[r]``; ``STATIC``: ``inv_rows[r]`` is ``1 / scale``. ``yv``'s rows are
    padded with zeros to a whole number of vectors (a zero changes no maximum).
    """
    if dynamic is None:
        return inv_rows[r]
    end = -(-n // LANES) * LANES
    top = splat(np.float32(0.0))
    for i in range(0, end, LANES):
        top = vabsmax(top, vload(yv, k, i))
    return inverse_of(top, r, fmt, scale_out)


@njit(inline="always", error_model="numpy")
def prefetch_ahead(address, start, i, step):
    """Prefetch byte ``start + min(i * step, PREFETCH_BYTES)`` after ``address``: called
    for each vector ``i`` of a pass, it brings in the first :data:`PREFETCH_BYTES` of a
    row whose elements are ``step`` bytes apart."""
    prefetch_at(address, start + imin(i * step, PREFETCH_BYTES), False)


@njit(inline="always", error_model="numpy")
def quantize_row(yv, qv, tv, k, r, n, fmt, inv, ahead, ahead_from, ahead_step, own):
    """Row ``k`` of the float32 block view ``yv`` times ``inv``, quantized into row ``r``
    of ``qv``. A row's codes after its last whole vector are those of its last
    ``LANES`` elements (stored again, the same); in a row shorter than ``LANES`` they go
    through ``tv``, a one-vector uint8 scratch row (``yv``'s padding zeros are never
    stored). Unless ``ahead`` is None, each
    vector prefetches (:func:`prefetch_ahead`) from byte ``ahead_from`` after ``ahead``.
    ``own``: ``inv`` is the row's dynamic scale's (:func:`bounded_row`)."""
    body = n // LANES * LANES
    iv = splat(inv)
    if bounded_row(fmt, own, inv):
        for i in range(0, body, LANES):
            if ahead is not None:
                prefetch_ahead(ahead, ahead_from, i, ahead_step)
            store_bounded_codes(fmt, qv, vload(yv, k, i) * iv, r, i)
    else:
        for i in range(0, body, LANES):
            if ahead is not None:
                prefetch_ahead(ahead, ahead_from, i, ahead_step)
            store_codes(fmt, qv, vload(yv, k, i) * iv, r, i)
    if body < n and n >= LANES:
        # the row's last LANES codes (those before the tail stored again, the same)
        store_codes(fmt, qv, vload(yv, k, n - LANES) * iv, r, n - LANES)
    elif body < n:
        store_codes(fmt, tv, vload(yv, k, body) * iv, 0, 0)
        for i in range(body, n):
            put(qv, r, i, get(tv, 0, i - body))


@njit(inline="always", error_model="numpy")
def quantize_rows_ahead(yv, qv, tv, xv, rows, stop, r0, n, fmt, invs):
    """Rows ``0 .. stop`` of the float32 block view ``yv`` quantized into rows ``r0 ..``
    of ``qv`` (:func:`quantize_row`), each prefetching the next block's row of the same
    index: past the last of the block's ``rows`` rows of ``xv``, where the view's rows are
    contiguous (a prefetch never faults)."""
    last = vaddress(xv, rows - 1, 0)
    for k in range(stop):
        quantize_row(yv, qv, tv, k, r0 + k, n, fmt, invs[k], last,
                     (k + 1) * n * itemsize(xv), itemsize(xv), True)


@njit(inline="always", error_model="numpy")
def ln_span_y32(xv, r, yv, k, start, end, shift, mean, rstd, w, b, top, pf):
    """Elements ``start .. end`` (multiples of ``LANES``) of row ``r`` of ``xv``
    normalized into row ``k`` of the float32 view ``yv`` with the plain forward's
    arithmetic (:func:`.forward_rows.ln_row_out`, element by element the same IEEE
    operations); returns ``top`` updated by their :func:`._simd.vabsmax`. Unless ``pf``
    is None, each vector prefetches the same place of the row at address ``pf``
    (:func:`prefetch_ahead`)."""
    kv = splat(shift)
    mv = splat(mean)
    rv = splat(rstd)
    for i in range(start, end, LANES):
        if pf is not None:
            prefetch_ahead(pf, 0, i, itemsize(xv))
        v = affine(((vload(xv, r, i) - kv) - mv) * rv, w, b, i)
        vstore(yv, v, k, i)
        top = vabsmax(top, v)
    return top


@njit(inline="always", error_model="numpy")
def ln_tail_y32(xv, r, yv, k, n, shift, mean, rstd, w, b, top):
    """:func:`ln_span_y32` of the elements after the row's last whole vector (wherever
    its vectors start; the caller knows there are some): the row's last ``LANES``
    elements again in a row of at least ``LANES`` (the same values stored again), else
    one at a time (the row's padding zeros change no maximum)."""
    if n >= LANES:
        return ln_span_y32(xv, r, yv, k, n - LANES, n, shift, mean, rstd, w, b, top, None)
    for i in range(n):
        v = affine(((widen(get(xv, r, i)) - shift) - mean) * rstd, w, b, i)
        put(yv, k, i, narrow(v, yv))
    return vabsmax(top, vload(yv, k, 0))


@njit(inline="always", error_model="numpy")
def ln_row_y32(xv, r, yv, k, n, shift, mean, rstd, w, b, pf):
    """Row ``r`` of ``xv`` normalized into row ``k`` of the float32 view ``yv`` (padded
    to whole vectors with zeros): :func:`ln_span_y32` of the whole row; returns the
    :func:`._simd.vabsmax` of the row.

    The vectors start at x's first 64-byte boundary (:func:`.rowmath.aligned_head`,
    as the plain forward's output passes do); the elements before it and after the
    last whole vector come from x's first and last vectors, which overlap the others
    and store the same values again (``y32`` is a buffer of its own, never x)."""
    head = aligned_head(xv, r, n)
    body = head + (n - head) // LANES * LANES
    top = ln_span_y32(xv, r, yv, k, head, body, shift, mean, rstd, w, b,
                      splat(np.float32(0.0)), pf)
    if head > 0:
        top = ln_span_y32(xv, r, yv, k, 0, LANES, shift, mean, rstd, w, b, top, None)
    if body < n:
        top = ln_tail_y32(xv, r, yv, k, n, shift, mean, rstd, w, b, top)
    return top


@njit(inline="always", error_model="numpy")
def ln_span_codes(xv, r, qv, qr, start, end, shift, mean, rstd, w, b, fmt, inv, pf):
    """:func:`ln_span_y32`'s values times ``inv``, quantized straight into row ``qr`` of
    ``qv`` (no float32 row is stored)."""
    kv = splat(shift)
    mv = splat(mean)
    rv = splat(rstd)
    iv = splat(inv)
    for i in range(start, end, LANES):
        if pf is not None:
            prefetch_ahead(pf, 0, i, itemsize(xv))
        v = affine(((vload(xv, r, i) - kv) - mv) * rv, w, b, i)
        store_codes(fmt, qv, v * iv, qr, i)


@njit(inline="always", error_model="numpy")
def ln_tail_codes(xv, r, qv, qr, fv, bv8, n, shift, mean, rstd, w, b, fmt, inv):
    """:func:`ln_span_codes` of the elements after the row's last whole vector (as
    :func:`ln_tail_y32`): the row's last ``LANES`` codes again in a row of at least
    ``LANES``, else through the one-vector scratch rows ``fv`` (float32) and ``bv8``
    (uint8)."""
    if n >= LANES:
        ln_span_codes(xv, r, qv, qr, n - LANES, n, shift, mean, rstd, w, b, fmt, inv, None)
        return
    for i in range(n):
        v = affine(((widen(get(xv, r, i)) - shift) - mean) * rstd, w, b, i)
        put(fv, 0, i, narrow(v, fv))
    store_codes(fmt, bv8, vload(fv, 0, 0) * splat(inv), 0, 0)
    for i in range(n):
        put(qv, qr, i, get(bv8, 0, i))


@njit(inline="always", error_model="numpy")
def ln_row_codes(xv, r, qv, qr, fv, bv8, n, shift, mean, rstd, w, b, fmt, inv, pf):
    """Row ``r`` of ``xv`` normalized as :func:`ln_row_y32` does (from x's first 64-byte
    boundary, the edges from overlapping vectors: the same codes stored again), times
    ``inv`` and quantized straight into row ``qr`` of ``qv``; ``pf`` as in
    :func:`ln_span_y32`."""
    head = aligned_head(xv, r, n)
    body = head + (n - head) // LANES * LANES
    ln_span_codes(xv, r, qv, qr, head, body, shift, mean, rstd, w, b, fmt, inv, pf)
    if head > 0:
        ln_span_codes(xv, r, qv, qr, 0, LANES, shift, mean, rstd, w, b, fmt, inv, None)
    if body < n:
        ln_tail_codes(xv, r, qv, qr, fv, bv8, n, shift, mean, rstd, w, b, fmt, inv)


@njit(inline="always", error_model="numpy")
def rms_span_y32(xv, r, yv, k, start, end, rstd, w, top, pf):
    """:func:`ln_span_y32` for RMSNorm (:func:`.forward_rows.rms_raw_rows`' output pass)."""
    rv = splat(rstd)
    for i in range(start, end, LANES):
        if pf is not None:
            prefetch_ahead(pf, 0, i, itemsize(xv))
        v = times_w(vload(xv, r, i) * rv, w, i)
        vstore(yv, v, k, i)
        top = vabsmax(top, v)
    return top


@njit(inline="always", error_model="numpy")
def rms_tail_y32(xv, r, yv, k, n, rstd, w, top):
    """:func:`ln_tail_y32` for RMSNorm."""
    if n >= LANES:
        return rms_span_y32(xv, r, yv, k, n - LANES, n, rstd, w, top, None)
    for i in range(n):
        v = times_w(widen(get(xv, r, i)) * rstd, w, i)
        put(yv, k, i, narrow(v, yv))
    return vabsmax(top, vload(yv, k, 0))


@njit(inline="always", error_model="numpy")
def rms_row_y32(xv, r, yv, k, n, rstd, w, pf):
    """:func:`ln_row_y32` for RMSNorm."""
    head = aligned_head(xv, r, n)
    body = head + (n - head) // LANES * LANES
    top = rms_span_y32(xv, r, yv, k, head, body, rstd, w, splat(np.float32(0.0)), pf)
    if head > 0:
        top = rms_span_y32(xv, r, yv, k, 0, LANES, rstd, w, top, None)
    if body < n:
        top = rms_tail_y32(xv, r, yv, k, n, rstd, w, top)
    return top


@njit(inline="always", error_model="numpy")
def rms_span_codes(xv, r, qv, qr, start, end, rstd, w, fmt, inv, pf):
    """:func:`ln_span_codes` for RMSNorm."""
    rv = splat(rstd)
    iv = splat(inv)
    for i in range(start, end, LANES):
        if pf is not None:
            prefetch_ahead(pf, 0, i, itemsize(xv))
        v = times_w(vload(xv, r, i) * rv, w, i)
        store_codes(fmt, qv, v * iv, qr, i)


@njit(inline="always", error_model="numpy")
def rms_tail_codes(xv, r, qv, qr, fv, bv8, n, rstd, w, fmt, inv):
    """:func:`ln_tail_codes` for RMSNorm."""
    if n >= LANES:
        rms_span_codes(xv, r, qv, qr, n - LANES, n, rstd, w, fmt, inv, None)
        return
    for i in range(n):
        v = times_w(widen(get(xv, r, i)) * rstd, w, i)
        put(fv, 0, i, narrow(v, fv))
    store_codes(fmt, bv8, vload(fv, 0, 0) * splat(inv), 0, 0)
    for i in range(n):
        put(qv, qr, i, get(bv8, 0, i))


@njit(inline="always", error_model="numpy")
def rms_row_codes(xv, r, qv, qr, fv, bv8, n, rstd, w, fmt, inv, pf):
    """:func:`ln_row_codes` for RMSNorm."""
    head = aligned_head(xv, r, n)
    body = head + (n - head) // LANES * LANES
    rms_span_codes(xv, r, qv, qr, head, body, rstd, w, fmt, inv, pf)
    if head > 0:
        rms_span_codes(xv, r, qv, qr, 0, LANES, rstd, w, fmt, inv, None)
    if body < n:
        rms_tail_codes(xv, r, qv, qr, fv, bv8, n, rstd, w, fmt, inv)


@callee_njit
def ln_rows_quant(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt, dynamic, inv_rows,
                  scale_out, bufs, r0, rows, pipelined, block_codes):
    """LayerNorm rows ``0 .. rows`` of the view ``xv`` (rows ``r0 ..`` of the call)
    quantized into ``q``: per row the statistics as :func:`.forward_rows.ln_long_rows`
    computes them, then one output pass (a row behind with ``pipelined``). Static scale:
    the codes straight from the pass. Dynamic: the pass stores ``y32`` into a float32
    row and tracks ``amax``; with ``block_codes`` (:func:`block_codes_of`: pipelined
    float8) into row ``k`` of the block's ``y32`` (small enough for L2), the codes of
    the block's rows following (their ``amax``/scale chains overlap); otherwise into
    one row (in L1), its codes right after. Returns the rows done (stops as
    ``ln_long_rows``)."""
    qv = raw(q)
    y32, fbuf, bbuf, invs = bufs
    yv, fv, bv8 = raw(y32), raw(fbuf), raw(bbuf)
    # With ``pipelined``, iteration k computes row k + 1's statistics, then row k's output
    # (iteration -1 only computes row 0's; the last row's next row is itself,
    # recomputed), so that their latency overlaps an output pass; otherwise a row's
    # statistics, then its output pass, the row still in L1. The lag is a constant once
    # Numba prunes the test of ``pipelined``'s type (see PIPELINED).
    lag = 1 if pipelined is not None else 0
    stop = rows
    shift = mean = mo = rstd = cast(0.0, eps)
    for k in range(-lag if rows > 0 else 0, rows):
        nshift, mu, m2 = row_moments(xv, imin(k + lag, rows - 1), n, tv)
        nmean, nmo, nrstd = finish(nshift, mu, m2, n, eps)
        if lag == 0:
            shift, mean, mo, rstd = nshift, nmean, nmo, nrstd
        if k >= 0:
            if needs_rescaling(xv, k, n, rstd):
                stop = k
                break
            r = r0 + k
            # What the next iteration's statistics pass reads.
            soon = vaddress(xv, imin(k + 1 + lag, rows - 1), 0)
            if dynamic is None:
                ln_row_codes(xv, k, qv, r, fv, bv8, n, shift, mean, rstd, wv, bv, fmt,
                             inv_rows[r], soon)
            elif block_codes is None:
                # The codes right after the row's maximum, from one float32 row in L1
                # (see PIPELINED_ROW_ELEMENTS).
                top = ln_row_y32(xv, k, yv, 0, n, shift, mean, rstd, wv, bv, soon)
                quantize_row(yv, qv, bv8, 0, r, n, fmt, inverse_of(top, r, fmt, scale_out),
                             soon, 0, itemsize(xv), True)
            else:
                top = ln_row_y32(xv, k, yv, k, n, shift, mean, rstd, wv, bv, soon)
                invs[k] = inverse_of(top, r, fmt, scale_out)
            put_stat(mean_out, r, mo)
            put_stat(rstd_out, r, rstd)
        shift, mean, mo, rstd = nshift, nmean, nmo, nrstd
    if dynamic is not None and block_codes is not None and stop > 0:
        quantize_rows_ahead(yv, qv, bv8, xv, rows, stop, r0, n, fmt, invs)
    alive(y32)
    alive(fbuf)
    alive(bbuf)
    alive(invs)
    return stop


@callee_njit
def rms_rows_quant(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows, scale_out, bufs,
                   r0, rows, pipelined, block_codes):
    """:func:`ln_rows_quant` for RMSNorm (statistics as
    :func:`.forward_rows.rms_raw_rows`)."""
    qv = raw(q)
    y32, fbuf, bbuf, invs = bufs
    yv, fv, bv8 = raw(y32), raw(fbuf), raw(bbuf)
    lag = 1 if pipelined is not None else 0  # as in ln_rows_quant
    stop = rows
    rstd = cast(0.0, eps)
    for k in range(-lag if rows > 0 else 0, rows):
        nrstd = rms_rstd(xv, imin(k + lag, rows - 1), n, eps)
        if lag == 0:
            rstd = nrstd
        if k >= 0:
            if needs_rescaling(xv, k, n, rstd):
                stop = k
                break
            r = r0 + k
            soon = vaddress(xv, imin(k + 1 + lag, rows - 1), 0)
            if dynamic is None:
                rms_row_codes(xv, k, qv, r, fv, bv8, n, rstd, wv, fmt, inv_rows[r], soon)
            elif block_codes is None:  # as in ln_rows_quant
                top = rms_row_y32(xv, k, yv, 0, n, rstd, wv, soon)
                quantize_row(yv, qv, bv8, 0, r, n, fmt, inverse_of(top, r, fmt, scale_out),
                             soon, 0, itemsize(xv), True)
            else:
                top = rms_row_y32(xv, k, yv, k, n, rstd, wv, soon)
                invs[k] = inverse_of(top, r, fmt, scale_out)
            put_stat(rstd_out, r, rstd)
        rstd = nrstd
    if dynamic is not None and block_codes is not None and stop > 0:
        quantize_rows_ahead(yv, qv, bv8, xv, rows, stop, r0, n, fmt, invs)
    alive(y32)
    alive(fbuf)
    alive(bbuf)
    alive(invs)
    return stop


@callee_njit
def ln_short_quant_rows(xv, qv, qbv, wv, bv, tv, eps, n, mean_out, rstd_out, fmt, dynamic,
                        inv_rows, scale_out, bufs, r0, rows):
    """:func:`ln_rows_quant` for rows of at most ``SHORT_ROW_MAX``: ``LANES`` rows'
    statistics at once, as :func:`.forward_rows.ln_short_rows` computes them
    (:func:`.forward_rows.short_group_moments`), then row by row the codes: straight
    from the output pass with a static scale (:func:`ln_row_codes`), through the
    group's float32 rows in L1 with a dynamic one (:func:`ln_row_y32`, then the group's
    scales at once, :func:`group_inverses`, then :func:`quantize_row`). ``qbv``
    is the view of the block's rows of ``qv`` (rows ``r0 ..``), which the statistics
    prefetch. Returns as :func:`ln_rows_quant` does."""
    y32, fbuf, bbuf, invs = bufs
    yv, fv, bv8 = raw(y32), raw(fbuf), raw(bbuf)
    sv, wv64 = short_scratch(eps)
    topv = scratch_block(LANES, LANES, np.float32)
    for i in range(LANES):  # a partial group's unused lanes: zeros, never garbage
        vstore(topv, splat(np.float32(0.0)), i, 0)
    ahead = short_rows_ahead(xv, rows, n)
    target = prefetch_target(qbv, n)
    stop = rows
    for first in range(0, rows, LANES):
        if stop < rows:
            break
        short_group_moments(xv, target, sv, wv64, first, rows - 1, n, eps, ahead)
        for i in range(imin(LANES, rows - first)):
            k = first + i
            shift, mean, rstd, mo = short_row_moments(xv, sv, wv64, k, i, n, eps, tv)
            if needs_rescaling(xv, k, n, rstd):
                stop = k
                break
            r = r0 + k
            if dynamic is None:
                ln_row_codes(xv, k, qv, r, fv, bv8, n, shift, mean, rstd, wv, bv, fmt,
                             inv_rows[r], None)
            else:
                vstore(topv, ln_row_y32(xv, k, yv, i, n, shift, mean, rstd, wv, bv, None),
                       i, 0)
            put_stat(mean_out, r, mo)
            put_stat(rstd_out, r, rstd)
        if dynamic is not None:
            group_inverses(topv, imin(LANES, stop - first), r0 + first, fmt, scale_out, invs)
            for i in range(imin(LANES, stop - first)):
                quantize_row(yv, qv, bv8, i, r0 + first + i, n, fmt, invs[i], None, 0, 0,
                             True)
    alive(y32)
    alive(fbuf)
    alive(bbuf)
    alive(invs)
    return stop


@callee_njit
def ln_tiled_quant(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt, dynamic, inv_rows,
                   scale_out, bufs, r0, rows):
    """:func:`ln_rows_quant` for rows with at least ``TILED_MIN_BYTES`` of weight, the
    block's rows (at most ``TILE_ROWS``) as one group, as the plain forward's
    :func:`.forward_rows.ln_tiled_rows` does: every row's statistics, then the output
    pass in column tiles of ``TILE_BYTES`` of ``w``, each tile over every row. Static
    scale: the codes straight from the tiles. Dynamic: the tiles store ``y32`` into the
    block's rows of the buffer and track each row's ``amax``; then row by row its scale
    and codes. The block's statistics and ``amax`` vectors are this function's own
    scratch (one allocation per block of ``TILE_ROWS`` long rows), so the other row
    loops' buffers stay as they were. The same values as :func:`ln_rows_quant` (the
    same bits); returns as it does (a call that stopped is redone whole by the driver)."""
    qv = raw(q)
    y32, fbuf, bbuf, _ = bufs
    # The block's statistics (shift, shifted mean, rstd) and amax vectors, row by row.
    stats = np.empty((3, rows), dtype=np.float32)
    tops = np.empty((rows, LANES), dtype=np.float32)
    yv, fv, bv8, topv = raw(y32), raw(fbuf), raw(bbuf), raw(tops)
    body = n // LANES * LANES
    stop = rows
    for k in range(rows):
        shift, mu, m2 = row_moments(xv, k, n, tv)
        mean, mo, rstd = finish(shift, mu, m2, n, eps)
        if needs_rescaling(xv, k, n, rstd):
            stop = k
            break
        stats[0, k] = shift
        stats[1, k] = mean
        stats[2, k] = rstd
        vstore(topv, splat(np.float32(0.0)), k, 0)
        put_stat(mean_out, r0 + k, mo)
        put_stat(rstd_out, r0 + k, rstd)
    tile = tile_elements(wv)
    for start in range(0, body, tile):
        end = imin(start + tile, body)
        for k in range(stop):
            if dynamic is None:
                ln_span_codes(xv, k, qv, r0 + k, start, end, stats[0, k], stats[1, k],
                              stats[2, k], wv, bv, fmt, inv_rows[r0 + k], None)
            else:
                top = ln_span_y32(xv, k, yv, k, start, end, stats[0, k], stats[1, k],
                                  stats[2, k], wv, bv, vload(topv, k, 0), None)
                vstore(topv, top, k, 0)
    for k in range(stop):
        r = r0 + k
        if dynamic is None:
            if body < n:
                ln_tail_codes(xv, k, qv, r, fv, bv8, n, stats[0, k], stats[1, k],
                              stats[2, k], wv, bv, fmt, inv_rows[r])
        else:
            top = vload(topv, k, 0)
            if body < n:
                top = ln_tail_y32(xv, k, yv, k, n, stats[0, k], stats[1, k], stats[2, k],
                                  wv, bv, top)
            quantize_row(yv, qv, bv8, k, r, n, fmt, inverse_of(top, r, fmt, scale_out),
                         None, 0, 0, True)
    alive(y32)
    alive(fbuf)
    alive(bbuf)
    alive(stats)
    alive(tops)
    return stop


@callee_njit
def rms_tiled_quant(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows, scale_out, bufs,
                    r0, rows):
    """:func:`ln_tiled_quant` for RMSNorm (statistics as :func:`rms_rows_quant`)."""
    qv = raw(q)
    y32, fbuf, bbuf, _ = bufs
    # The block's statistics (shift, shifted mean, rstd) and amax vectors, row by row.
    stats = np.empty((3, rows), dtype=np.float32)
    tops = np.empty((rows, LANES), dtype=np.float32)
    yv, fv, bv8, topv = raw(y32), raw(fbuf), raw(bbuf), raw(tops)
    body = n // LANES * LANES
    stop = rows
    for k in range(rows):
        rstd = rms_rstd(xv, k, n, eps)
        if needs_rescaling(xv, k, n, rstd):
            stop = k
            break
        stats[2, k] = rstd
        vstore(topv, splat(np.float32(0.0)), k, 0)
        put_stat(rstd_out, r0 + k, rstd)
    tile = tile_elements(wv)
    for start in range(0, body, tile):
        end = imin(start + tile, body)
        for k in range(stop):
            if dynamic is None:
                rms_span_codes(xv, k, qv, r0 + k, start, end, stats[2, k], wv, fmt,
                               inv_rows[r0 + k], None)
            else:
                top = rms_span_y32(xv, k, yv, k, start, end, stats[2, k], wv,
                                   vload(topv, k, 0), None)
                vstore(topv, top, k, 0)
    for k in range(stop):
        r = r0 + k
        if dynamic is None:
            if body < n:
                rms_tail_codes(xv, k, qv, r, fv, bv8, n, stats[2, k], wv, fmt, inv_rows[r])
        else:
            top = vload(topv, k, 0)
            if body < n:
                top = rms_tail_y32(xv, k, yv, k, n, stats[2, k], wv, top)
            quantize_row(yv, qv, bv8, k, r, n, fmt, inverse_of(top, r, fmt, scale_out),
                         None, 0, 0, True)
    alive(y32)
    alive(fbuf)
    alive(bbuf)
    alive(stats)
    alive(tops)
    return stop


def block_codes_of(pipelined, fmt):
    """The ``block_codes`` argument of the row loops (:func:`ln_rows_quant`): ``True``
    where a dynamic scale's codes follow the block's rows (``PIPELINED`` float8), ``None``
    where each row's follow its output pass (``ROW_BY_ROW``, and ``PIPELINED`` int8: see
    :data:`PIPELINED_ROW_ELEMENTS`). Chosen by type, so a kernel compiles one of them."""
    # Python (NUMBA_DISABLE_JIT) only; jitted code: the overload.
    return True if pipelined is True and fmt.dtype != np.int8 else None


def _block_codes_by_type(pipelined, fmt):
    """:func:`block_codes_of`'s rule on the Numba types of its arguments."""
    return isinstance(pipelined, types.Boolean) and fmt.dtype != types.int8


@overload(block_codes_of, inline="always")
def _block_codes_of_typed(pipelined, fmt):
    if _block_codes_by_type(pipelined, fmt):
        return lambda pipelined, fmt: True
    return lambda pipelined, fmt: None


def y32_rows(rows, pipelined, fmt):
    """The float32 ``y32`` rows a dynamic scale needs for blocks of up to ``rows`` rows
    in the row loop ``pipelined``: the block's for ``TILED`` (an integer, as
    :func:`ln_quant_rows_by` tells it apart) and with :func:`block_codes_of`, else one."""
    # Python (NUMBA_DISABLE_JIT) only; jitted code: the overload.
    tiled = pipelined is not None and not isinstance(pipelined, bool)
    return rows if tiled or block_codes_of(pipelined, fmt) else 1


@overload(y32_rows, inline="always")
def _y32_rows_typed(rows, pipelined, fmt):
    if isinstance(pipelined, types.Integer) or _block_codes_by_type(pipelined, fmt):
        return lambda rows, pipelined, fmt: rows
    return lambda rows, pipelined, fmt: 1


def ln_quant_rows_by(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt, dynamic, inv_rows,
                     scale_out, bufs, r0, rows, pipelined):
    """:func:`ln_tiled_quant` for the ``TILED`` row loop, else :func:`ln_rows_quant`
    (``PIPELINED`` or ``ROW_BY_ROW``): chosen by ``pipelined``'s type, so that a kernel
    compiles one loop."""
    if pipelined is not None and not isinstance(pipelined, bool):
        return ln_tiled_quant(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt, dynamic,
                              inv_rows, scale_out, bufs, r0, rows)
    return ln_rows_quant(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt, dynamic,
                         inv_rows, scale_out, bufs, r0, rows, pipelined,
                         block_codes_of(pipelined, fmt))


@overload(ln_quant_rows_by, inline="always")
def _ln_quant_rows_by_typed(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt, dynamic,
                            inv_rows, scale_out, bufs, r0, rows, pipelined):
    if isinstance(pipelined, types.Integer):
        def tiled(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt, dynamic, inv_rows,
                  scale_out, bufs, r0, rows, pipelined):
            return ln_tiled_quant(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt,
                                  dynamic, inv_rows, scale_out, bufs, r0, rows)
        return tiled

    def by_row(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt, dynamic, inv_rows,
               scale_out, bufs, r0, rows, pipelined):
        return ln_rows_quant(xv, wv, bv, tv, eps, n, mean_out, rstd_out, q, fmt, dynamic,
                             inv_rows, scale_out, bufs, r0, rows, pipelined,
                             block_codes_of(pipelined, fmt))
    return by_row


def rms_quant_rows_by(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows, scale_out, bufs,
                      r0, rows, pipelined):
    """:func:`ln_quant_rows_by` for RMSNorm."""
    if pipelined is not None and not isinstance(pipelined, bool):
        return rms_tiled_quant(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows,
                               scale_out, bufs, r0, rows)
    return rms_rows_quant(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows, scale_out,
                          bufs, r0, rows, pipelined, block_codes_of(pipelined, fmt))


@overload(rms_quant_rows_by, inline="always")
def _rms_quant_rows_by_typed(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows, scale_out,
                             bufs, r0, rows, pipelined):
    if isinstance(pipelined, types.Integer):
        def tiled(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows, scale_out, bufs, r0,
                  rows, pipelined):
            return rms_tiled_quant(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows,
                                   scale_out, bufs, r0, rows)
        return tiled

    def by_row(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows, scale_out, bufs, r0,
               rows, pipelined):
        return rms_rows_quant(xv, wv, eps, n, rstd_out, q, fmt, dynamic, inv_rows,
                              scale_out, bufs, r0, rows, pipelined,
                              block_codes_of(pipelined, fmt))
    return by_row


@njit(inline="always", error_model="numpy")
def _scratch(rows, n):
    """The float32 block ``y32`` is normalized into: rows padded with zeros to a whole
    number of vectors."""
    return np.zeros((rows, -(-n // LANES) * LANES), dtype=np.float32)


@njit(inline="always", error_model="numpy")
def _row_buffers(rows, y_rows, n, dynamic):
    """The row path's buffers for blocks of up to ``rows`` rows: ``y_rows`` float32
    ``y32`` rows (:func:`_scratch`, :func:`y32_rows`) with a dynamic scale, none for a
    static scale, whose codes come straight from the output pass; one-vector float32
    and uint8 rows for a last partial vector; the rows' inverse scales. Allocated once
    per kernel (per block in parallel)."""
    y_rows = 0 if dynamic is None else y_rows
    return (_scratch(y_rows, n), np.zeros((1, LANES), dtype=np.float32),
            np.empty((1, LANES), dtype=np.uint8), np.empty(rows, dtype=np.float32))


@callee_njit
def _quantize_block(y32, q, r0, r1, fmt, dynamic, inv_rows, scale_out):
    """Rows ``r0 .. r1`` of ``q`` from rows ``0 ..`` of ``y32``: every row's ``1 / scale``
    first, then the codes (the rows' chains of ``amax``, scale and inverse do not depend
    on each other, so they overlap; measured, 1 thread, from L2: 40% less time per
    element at n = 256, 18% at n = 1024 than row by row)."""
    n = q.shape[1]
    tail = np.empty((1, LANES), dtype=np.uint8)
    invs = np.empty(r1 - r0, dtype=np.float32)
    yv, qv, tv = raw(y32), raw(q), raw(tail)
    for k in range(r1 - r0):
        invs[k] = row_inverse(yv, k, r0 + k, n, fmt, dynamic, inv_rows, scale_out)
    for k in range(r1 - r0):
        quantize_row(yv, qv, tv, k, r0 + k, n, fmt, invs[k], None, 0, 0,
                     dynamic is not None)
    alive(tail)
    alive(invs)


def _block_input(x, res, h, r0, r1):
    """The view of the rows ``r0 .. r1`` a block normalizes: x's, or with a residual
    ``h = x + res``, computed and stored first (``res``/``h`` None: compiled without)."""
    # Python (NUMBA_DISABLE_JIT) only; jitted code: the overload, one branch per type.
    return raw(x[r0:r1]) if res is None else add_block(x, res, h, r0, r1)


@overload(_block_input, inline="always")
def _block_input_typed(x, res, h, r0, r1):
    if isinstance(res, types.NoneType):
        return lambda x, res, h, r0, r1: raw(x[r0:r1])
    return lambda x, res, h, r0, r1: add_block(x, res, h, r0, r1)


@callee_njit
def _ln_block(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt, dynamic, inv_rows,
              scale_out, bufs, r0, r1, pipelined):
    """Rows ``r0 .. r1`` on the row path; returns the row the norm stopped at (``r1``:
    all done; see :func:`.forward_rows.ln_long_rows`)."""
    return r0 + ln_quant_rows_by(_block_input(x, res, h, r0, r1), raw(w), raw(b), raw(tab),
                                 eps, q.shape[1], mean_out, rstd_out, q, fmt, dynamic,
                                 inv_rows, scale_out, bufs, r0, r1 - r0, pipelined)


@callee_njit
def _ln_short_block(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt, dynamic,
                    inv_rows, scale_out, bufs, r0, r1):
    """:func:`_ln_block` for rows of at most ``SHORT_ROW_MAX``."""
    return r0 + ln_short_quant_rows(_block_input(x, res, h, r0, r1), raw(q),
                                    raw(q[r0:r1]), raw(w), raw(b), raw(tab), eps,
                                    q.shape[1], mean_out, rstd_out, fmt, dynamic,
                                    inv_rows, scale_out, bufs, r0, r1 - r0)


@callee_njit
def _rms_block(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows, scale_out, bufs,
               r0, r1, pipelined):
    """:func:`_ln_block` for RMSNorm."""
    return r0 + rms_quant_rows_by(_block_input(x, res, h, r0, r1), raw(w), eps, q.shape[1],
                                  rstd_out, q, fmt, dynamic, inv_rows, scale_out, bufs, r0,
                                  r1 - r0, pipelined)


# Entry kernels, one per row path and written out one by one (see .kernels): a call
# compiles only its own path, for its own format. Each returns the number of blocks that
# stopped before an overflowing row; the driver then redoes the call through the
# *_rescued kernels below (from h with a residual: it is complete).


@njit(inline="always", error_model="numpy")
def _ln_quant_serial(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt, dynamic,
                     inv_rows, scale_out, pipelined, elements):
    rows, n = x.shape
    rb = block_rows(rows, n, 1, elements)
    bufs = _row_buffers(rb, y32_rows(rb, pipelined, fmt), n, dynamic)
    stopped = 0
    for r0 in range(0, rows, rb):
        r1 = imin(rows, r0 + rb)
        stopped += _ln_block(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                             dynamic, inv_rows, scale_out, bufs, r0, r1, pipelined) < r1
    return stopped


@cached_njit(error_model="numpy")
def ln_quant_forward_serial(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                            dynamic, inv_rows, scale_out):
    """LayerNorm of the rows of ``x`` (of ``h = x + res`` with a residual; ``res`` and
    ``h`` None without) quantized into ``q``, on the calling thread: rows longer than
    ``SHORT_ROW_MAX`` and at most ``PIPELINED_ROW_ELEMENTS``."""
    return _ln_quant_serial(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt, dynamic,
                            inv_rows, scale_out, PIPELINED, BLOCK_ELEMENTS)


@cached_njit(parallel=True, error_model="numpy")
def ln_quant_forward_parallel(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                              dynamic, inv_rows, scale_out):
    """:func:`ln_quant_forward_serial` with blocks of rows over Numba's threads."""
    # Written out: a prange in an inlined function failed to type a buffer's shape
    # (Numba's parfor lowering) where the serial loop inlines fine.
    rows, n = x.shape
    rb = block_rows(rows, n, PARALLEL_BLOCKS, BLOCK_ELEMENTS)
    blocks = (rows + rb - 1) // rb
    done = np.empty(blocks, dtype=np.bool_)
    for blk in prange(blocks):
        r0 = blk * rb
        r1 = imin(rows, r0 + rb)
        bufs = _row_buffers(rb, y32_rows(rb, PIPELINED, fmt), n, dynamic)
        done[blk] = _ln_block(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                              dynamic, inv_rows, scale_out, bufs, r0, r1, PIPELINED) == r1
    return blocks - done.sum()


@cached_njit(error_model="numpy")
def ln_long_quant_forward_serial(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                                 dynamic, inv_rows, scale_out):
    """:func:`ln_quant_forward_serial` for rows longer than ``PIPELINED_ROW_ELEMENTS``
    (row by row)."""
    return _ln_quant_serial(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt, dynamic,
                            inv_rows, scale_out, ROW_BY_ROW, BLOCK_ELEMENTS)


@cached_njit(parallel=True, error_model="numpy")
def ln_long_quant_forward_parallel(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                                   dynamic, inv_rows, scale_out):
    """:func:`ln_long_quant_forward_serial` with blocks of rows over Numba's threads."""
    # Written out: a prange in an inlined function failed to type a buffer's shape
    # (Numba's parfor lowering) where the serial loop inlines fine.
    rows, n = x.shape
    rb = block_rows(rows, n, PARALLEL_BLOCKS, BLOCK_ELEMENTS)
    blocks = (rows + rb - 1) // rb
    done = np.empty(blocks, dtype=np.bool_)
    for blk in prange(blocks):
        r0 = blk * rb
        r1 = imin(rows, r0 + rb)
        bufs = _row_buffers(rb, y32_rows(rb, ROW_BY_ROW, fmt), n, dynamic)
        done[blk] = _ln_block(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                              dynamic, inv_rows, scale_out, bufs, r0, r1, ROW_BY_ROW) == r1
    return blocks - done.sum()


@cached_njit(error_model="numpy")
def ln_tiled_quant_forward_serial(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                                  dynamic, inv_rows, scale_out):
    """:func:`ln_quant_forward_serial` for rows with at least ``TILED_MIN_BYTES`` of
    weight (blocks of ``TILE_ROWS`` rows, :func:`ln_tiled_quant`)."""
    return _ln_quant_serial(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt, dynamic,
                            inv_rows, scale_out, TILED, TILE_ROWS * x.shape[1])


@cached_njit(parallel=True, error_model="numpy")
def ln_tiled_quant_forward_parallel(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                                    dynamic, inv_rows, scale_out):
    """:func:`ln_tiled_quant_forward_serial` with blocks of rows over Numba's threads
    (at least two blocks)."""
    rows, n = x.shape  # written out, as ln_quant_forward_parallel
    rb = block_rows(rows, n, 2, TILE_ROWS * n)
    blocks = (rows + rb - 1) // rb
    done = np.empty(blocks, dtype=np.bool_)
    for blk in prange(blocks):
        r0 = blk * rb
        r1 = imin(rows, r0 + rb)
        bufs = _row_buffers(rb, y32_rows(rb, TILED, fmt), n, dynamic)
        done[blk] = _ln_block(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                              dynamic, inv_rows, scale_out, bufs, r0, r1, TILED) == r1
    return blocks - done.sum()


@cached_njit(error_model="numpy")
def ln_short_quant_forward_serial(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                                  dynamic, inv_rows, scale_out):
    """:func:`ln_quant_forward_serial` for rows of at most ``SHORT_ROW_MAX``."""
    rows, n = x.shape
    rb = block_rows(rows, n, 1, BLOCK_ELEMENTS)
    bufs = _row_buffers(LANES, LANES, n, dynamic)
    stopped = 0
    for r0 in range(0, rows, rb):
        r1 = imin(rows, r0 + rb)
        stopped += _ln_short_block(x, res, w, b, eps, h, q, mean_out, rstd_out, tab,
                                   fmt, dynamic, inv_rows, scale_out, bufs, r0, r1) < r1
    return stopped


@cached_njit(parallel=True, error_model="numpy")
def ln_short_quant_forward_parallel(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                                    dynamic, inv_rows, scale_out):
    """:func:`ln_short_quant_forward_serial` with blocks of rows over Numba's threads."""
    rows, n = x.shape
    rb = block_rows(rows, n, PARALLEL_BLOCKS, BLOCK_ELEMENTS)
    blocks = (rows + rb - 1) // rb
    done = np.empty(blocks, dtype=np.bool_)
    for blk in prange(blocks):
        r0 = blk * rb
        r1 = imin(rows, r0 + rb)
        done[blk] = _ln_short_block(x, res, w, b, eps, h, q, mean_out, rstd_out, tab,
                                    fmt, dynamic, inv_rows, scale_out,
                                    _row_buffers(LANES, LANES, n, dynamic), r0, r1) == r1
    return blocks - done.sum()


@njit(inline="always", error_model="numpy")
def _rms_quant_serial(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows, scale_out,
                      pipelined, elements):
    rows, n = x.shape
    rb = block_rows(rows, n, 1, elements)
    bufs = _row_buffers(rb, y32_rows(rb, pipelined, fmt), n, dynamic)
    stopped = 0
    for r0 in range(0, rows, rb):
        r1 = imin(rows, r0 + rb)
        stopped += _rms_block(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                              scale_out, bufs, r0, r1, pipelined) < r1
    return stopped


@cached_njit(error_model="numpy")
def rms_quant_forward_serial(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                             scale_out):
    """RMSNorm of the rows of ``x`` (of ``h = x + res``) quantized into ``q``, on the
    calling thread (returns as :func:`ln_quant_forward_serial`): rows of at most
    ``PIPELINED_ROW_ELEMENTS``."""
    return _rms_quant_serial(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                             scale_out, PIPELINED, BLOCK_ELEMENTS)


@cached_njit(parallel=True, error_model="numpy")
def rms_quant_forward_parallel(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows, scale_out):
    """:func:`rms_quant_forward_serial` with blocks of rows over Numba's threads."""
    rows, n = x.shape  # written out, as ln_quant_forward_parallel
    rb = block_rows(rows, n, PARALLEL_BLOCKS, BLOCK_ELEMENTS)
    blocks = (rows + rb - 1) // rb
    done = np.empty(blocks, dtype=np.bool_)
    for blk in prange(blocks):
        r0 = blk * rb
        r1 = imin(rows, r0 + rb)
        bufs = _row_buffers(rb, y32_rows(rb, PIPELINED, fmt), n, dynamic)
        done[blk] = _rms_block(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                               scale_out, bufs, r0, r1, PIPELINED) == r1
    return blocks - done.sum()


@cached_njit(error_model="numpy")
def rms_long_quant_forward_serial(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                                  scale_out):
    """:func:`rms_quant_forward_serial` for rows longer than ``PIPELINED_ROW_ELEMENTS``
    (row by row)."""
    return _rms_quant_serial(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                             scale_out, ROW_BY_ROW, BLOCK_ELEMENTS)


@cached_njit(parallel=True, error_model="numpy")
def rms_long_quant_forward_parallel(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                                    scale_out):
    """:func:`rms_long_quant_forward_serial` with blocks of rows over Numba's threads."""
    rows, n = x.shape  # written out, as ln_quant_forward_parallel
    rb = block_rows(rows, n, PARALLEL_BLOCKS, BLOCK_ELEMENTS)
    blocks = (rows + rb - 1) // rb
    done = np.empty(blocks, dtype=np.bool_)
    for blk in prange(blocks):
        r0 = blk * rb
        r1 = imin(rows, r0 + rb)
        bufs = _row_buffers(rb, y32_rows(rb, ROW_BY_ROW, fmt), n, dynamic)
        done[blk] = _rms_block(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                               scale_out, bufs, r0, r1, ROW_BY_ROW) == r1
    return blocks - done.sum()


@cached_njit(error_model="numpy")
def rms_tiled_quant_forward_serial(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                                   scale_out):
    """:func:`rms_quant_forward_serial` for rows with at least ``TILED_MIN_BYTES`` of
    weight (:func:`rms_tiled_quant`)."""
    return _rms_quant_serial(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                             scale_out, TILED, TILE_ROWS * x.shape[1])


@cached_njit(parallel=True, error_model="numpy")
def rms_tiled_quant_forward_parallel(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                                     scale_out):
    """:func:`rms_tiled_quant_forward_serial` with blocks of rows over Numba's threads."""
    rows, n = x.shape  # written out, as ln_quant_forward_parallel
    rb = block_rows(rows, n, 2, TILE_ROWS * n)
    blocks = (rows + rb - 1) // rb
    done = np.empty(blocks, dtype=np.bool_)
    for blk in prange(blocks):
        r0 = blk * rb
        r1 = imin(rows, r0 + rb)
        bufs = _row_buffers(rb, y32_rows(rb, TILED, fmt), n, dynamic)
        done[blk] = _rms_block(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                               scale_out, bufs, r0, r1, TILED) == r1
    return blocks - done.sum()


@cached_njit(error_model="numpy")
def ln_quant_rescued_serial(x, w, b, eps, q, mean_out, rstd_out, tab, fmt, dynamic,
                            inv_rows, scale_out):
    """LayerNorm of the rows of ``x`` quantized into ``q``, every row done (finite rows
    whose squares overflow or underflow rescaled, see :mod:`.rescale`): what redoes a call of the
    kernels above that met such a row, so only such a call compiles it."""
    rows, n = x.shape
    rb = block_rows(rows, n, 1, BLOCK_ELEMENTS)
    y32 = _scratch(rb, n)
    for r0 in range(0, rows, rb):
        r1 = imin(rows, r0 + rb)
        ln_raw_rows(raw(x[r0:r1]), raw(y32), raw(w), raw(b), raw(tab), eps, n, PLAIN,
                    mean_out, rstd_out, runtime(0), r1 - r0, r0)
        _quantize_block(y32, q, r0, r1, fmt, dynamic, inv_rows, scale_out)


@cached_njit(error_model="numpy")
def rms_quant_rescued_serial(x, w, eps, q, rstd_out, fmt, dynamic, inv_rows, scale_out):
    """:func:`ln_quant_rescued_serial` for RMSNorm."""
    rows, n = x.shape
    rb = block_rows(rows, n, 1, BLOCK_ELEMENTS)
    y32 = _scratch(rb, n)
    for r0 in range(0, rows, rb):
        r1 = imin(rows, r0 + rb)
        rms_rows_rescued(raw(x[r0:r1]), raw(y32), raw(w), eps, n, PLAIN, rstd_out,
                         runtime(0), r1 - r0, r0)
        _quantize_block(y32, q, r0, r1, fmt, dynamic, inv_rows, scale_out)
