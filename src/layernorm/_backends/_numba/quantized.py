"""LayerNorm/RMSNorm (optionally after the residual add) with int8/float8 output, in one pass.

Block of rows by block of rows, a block of ``BLOCK_ELEMENTS`` is normalized into a
float32 scratch block by the same compiled row function as the plain forward
(:func:`.forward_rows.ln_raw_rows` / :func:`.forward_rows.rms_rows_rescued`): that scratch
holds ``y32``, the output in the accumulation precision before any rounding, bit for
bit what the plain forward of the float32-widened input writes. While the block is in
L2 each of its rows is then quantized (:func:`quantize_row`) and only the 1-byte codes
go to memory. With a residual, the block's ``h = x + residual`` is computed and stored
first, exactly as in :mod:`.fused`.

Quantization of one row (the contract's formula, in float32):

* dynamic: ``amax`` is the largest ``|y32|`` of the row, found as the largest integer
  of the bit patterns with the sign cleared (for non-negative floats the integer order
  is the float order, and NaN patterns are above infinity's, so a NaN in the row makes
  ``amax`` NaN as ``max`` would); ``scale = amax / qmax`` (1 for an all-zero row);
* ``inv = 1 / scale`` once per row (given per row for a static scale);
* ``v = y32 * inv``; int8: NaN -> 0, saturate to [-128, 127] (saturating before the
  rounding gives the same integer, the bounds being integers), round half to even by
  adding and subtracting ``1.5 * 2**23`` in float32; float8: saturate to ``+-qmax``
  (NaN kept), then round the float32 bits half to even to the target format,
  subnormals included.

The quantization runs on SIMD vectors (:func:`._simd.vabsmax`, :func:`._simd.store_int8`,
:func:`._simd.store_float8_e4m3fn`, :func:`._simd.store_float8_e5m2`): integer operations
on bit patterns, IEEE comparisons and one exact rounding step per lane, so every lane
gets what the scalar formula gives. Codes are written to a ``uint8`` view of the
output (int8 as its two's-complement byte), so one compiled kernel serves the three
formats. The accumulation precision must be float32 (float16, bfloat16 or float32
input); float64 input is quantized by the engine's composition.

Each kernel comes serial and parallel (blocks over Numba's threads): the same arithmetic
per row, the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._simd import (
    alive,
    get,
    hmax_bits,
    put,
    raw,
    runtime,
    splat,
    store_float8_e4m3fn,
    store_float8_e5m2,
    store_int8,
    vabsmax,
    vload,
)
from .diskcache import cached_njit
from .forward_rows import ln_raw_rows, rms_rows_rescued
from .fused import PARALLEL_BLOCKS, add_block, block_rows
from .rowmath import LANES

#: Elements per block of rows (no effect on results): the float32 scratch block stays
#: in L2 between the normalization and the quantization.
BLOCK_ELEMENTS = 1 << 14

#: Format codes the kernels take (one compiled kernel for all three).
INT8, FLOAT8_E4M3FN, FLOAT8_E5M2 = 0, 1, 2
#: ``qmax`` of each format code.
QMAX = (127.0, 448.0, 57344.0)


@njit(error_model="numpy")
def quantize_row(yv, qv, tv, k, r, n, fmt, dynamic, inv_rows, scale_out):
    """Row ``k`` of the float32 block view ``yv`` quantized into row ``r`` of ``qv``.

    ``yv``'s rows are padded with zeros to a whole number of vectors (a zero changes no
    maximum and its code is never stored); ``tv`` is a one-vector uint8 scratch row for
    the codes of a last partial vector. ``dynamic``: the row's scale is computed and
    stored in ``scale_out[r]``; otherwise ``inv_rows[r]`` is ``1 / scale``.
    """
    body = n // LANES * LANES
    end = body if body == n else body + LANES
    if dynamic:
        top = splat(np.float32(0.0))
        for i in range(0, end, LANES):
            top = vabsmax(top, vload(yv, k, i))
        amax = hmax_bits(top)
        scale = amax / np.float32(QMAX[fmt])
        if amax == 0:
            scale = np.float32(1.0)
        scale_out[r] = scale
        inv = np.float32(1.0) / scale
    else:
        inv = inv_rows[r]
    iv = splat(inv)
    if fmt == INT8:
        for i in range(0, body, LANES):
            store_int8(qv, vload(yv, k, i) * iv, r, i)
        if body < n:
            store_int8(tv, vload(yv, k, body) * iv, 0, 0)
    elif fmt == FLOAT8_E4M3FN:
        for i in range(0, body, LANES):
            store_float8_e4m3fn(qv, vload(yv, k, i) * iv, r, i)
        if body < n:
            store_float8_e4m3fn(tv, vload(yv, k, body) * iv, 0, 0)
    else:
        for i in range(0, body, LANES):
            store_float8_e5m2(qv, vload(yv, k, i) * iv, r, i)
        if body < n:
            store_float8_e5m2(tv, vload(yv, k, body) * iv, 0, 0)
    for i in range(body, n):
        put(qv, r, i, get(tv, 0, i - body))


@njit(inline="always", error_model="numpy")
def _scratch(rows, n):
    """The float32 block ``y32`` is normalized into: rows padded with zeros to a whole
    number of vectors."""
    return np.zeros((rows, -(-n // LANES) * LANES), dtype=np.float32)


@njit(error_model="numpy")
def _quantize_block(y32, q, r0, r1, fmt, dynamic, inv_rows, scale_out):
    tail = np.empty((1, LANES), dtype=np.uint8)
    yv, qv, tv = raw(y32), raw(q), raw(tail)
    for k in range(r1 - r0):
        quantize_row(yv, qv, tv, k, r0 + k, q.shape[1], fmt, dynamic, inv_rows, scale_out)
    alive(tail)


@njit(error_model="numpy")
def _ln_block(xv, w, b, eps, tab, y32, mean_out, rstd_out, q, r0, r1, fmt, dynamic,
              inv_rows, scale_out):
    ln_raw_rows(xv, raw(y32), raw(w), raw(b), raw(tab), eps, q.shape[1], runtime(False),
                 mean_out, rstd_out, runtime(0), r1 - r0, r0)
    _quantize_block(y32, q, r0, r1, fmt, dynamic, inv_rows, scale_out)


@njit(error_model="numpy")
def _rms_block(xv, w, eps, y32, rstd_out, q, r0, r1, fmt, dynamic, inv_rows, scale_out):
    rms_rows_rescued(xv, raw(y32), raw(w), eps, q.shape[1], runtime(False), rstd_out,
                     runtime(0), r1 - r0, r0)
    _quantize_block(y32, q, r0, r1, fmt, dynamic, inv_rows, scale_out)


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


@cached_njit(error_model="numpy")
def ln_quant_forward_serial(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                            dynamic, inv_rows, scale_out):
    """LayerNorm of the rows of ``x`` (of ``h = x + res`` with a residual; ``res`` and
    ``h`` None without) quantized into ``q``, on the calling thread."""
    rows, n = x.shape
    rb = block_rows(rows, n, 1, BLOCK_ELEMENTS)
    y32 = _scratch(rb, n)
    for r0 in range(0, rows, rb):
        r1 = min(rows, r0 + rb)
        _ln_block(_block_input(x, res, h, r0, r1), w, b, eps, tab, y32, mean_out, rstd_out,
                  q, r0, r1, fmt, dynamic, inv_rows, scale_out)


@cached_njit(parallel=True, error_model="numpy")
def ln_quant_forward_parallel(x, res, w, b, eps, h, q, mean_out, rstd_out, tab, fmt,
                              dynamic, inv_rows, scale_out):
    """:func:`ln_quant_forward_serial` with blocks of rows over Numba's threads."""
    rows, n = x.shape
    rb = block_rows(rows, n, PARALLEL_BLOCKS, BLOCK_ELEMENTS)
    for blk in prange((rows + rb - 1) // rb):
        r0 = blk * rb
        r1 = min(rows, r0 + rb)
        y32 = _scratch(rb, n)
        _ln_block(_block_input(x, res, h, r0, r1), w, b, eps, tab, y32, mean_out, rstd_out,
                  q, r0, r1, fmt, dynamic, inv_rows, scale_out)


@cached_njit(error_model="numpy")
def rms_quant_forward_serial(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                             scale_out):
    """RMSNorm of the rows of ``x`` (of ``h = x + res``) quantized into ``q``, on the
    calling thread."""
    rows, n = x.shape
    rb = block_rows(rows, n, 1, BLOCK_ELEMENTS)
    y32 = _scratch(rb, n)
    for r0 in range(0, rows, rb):
        r1 = min(rows, r0 + rb)
        _rms_block(_block_input(x, res, h, r0, r1), w, eps, y32, rstd_out, q, r0, r1, fmt,
                   dynamic, inv_rows, scale_out)


@cached_njit(parallel=True, error_model="numpy")
def rms_quant_forward_parallel(x, res, w, eps, h, q, rstd_out, fmt, dynamic, inv_rows,
                               scale_out):
    """:func:`rms_quant_forward_serial` with blocks of rows over Numba's threads."""
    rows, n = x.shape
    rb = block_rows(rows, n, PARALLEL_BLOCKS, BLOCK_ELEMENTS)
    for blk in prange((rows + rb - 1) // rb):
        r0 = blk * rb
        r1 = min(rows, r0 + rb)
        y32 = _scratch(rb, n)
        _rms_block(_block_input(x, res, h, r0, r1), w, eps, y32, rstd_out, q, r0, r1, fmt,
                   dynamic, inv_rows, scale_out)
