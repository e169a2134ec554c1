"""Residual add then LayerNorm/RMSNorm in one pass over memory (the pre-norm block).

``h = x + residual`` and ``y = norm(h)`` of 2-D ``(rows, n)`` arrays whose rows have
unit stride, block of rows by block of rows: a block's ``h`` is computed in the
accumulation type (an IEEE add per element of the widened inputs), rounded once to h's
element type and stored, then the block is normalized by the same compiled row function
as the unfused forward (:func:`.forward_rows.ln_raw_rows` /
:func:`.forward_rows.rms_raw_rows`) reading those just-stored, cache-resident ``h``
values. The same operations on the same values: ``y`` is bit for bit
``layer_norm(h)`` / ``rms_norm(h)``, rounded to y's element type.

Where ``h`` goes:

* **direct** (``nt_h`` False): ``h`` is stored into its destination and the row
  function reads it back from there (L1/L2: the block was just written);
* **streamed** (``nt_h`` True, outputs several times the last-level cache): ``h`` is
  stored twice from the same vector, into a scratch block that the row function reads
  and into its destination with streaming stores, so that the destination's lines are
  never read from memory first (a plain store to an uncached line reads it: 5 arrays of
  traffic instead of 4).

Every row of a block is read (``x``, ``residual``) before any row of it is written
(``h``, ``y``), and rows never interact, so ``h`` and ``y`` may be ``x`` or ``residual``
themselves (the same memory, in place); they may not partly overlap them (the driver
checks). All element types share one accumulation type (float32 for
float16/bfloat16/float32, float64 for float64): the driver only fuses such calls.

Each kernel comes serial and parallel (blocks over Numba's threads): the same
arithmetic per row, the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._scalars import narrow, widen
from ._simd import (
    alive,
    get,
    itemsize,
    put,
    raw,
    runtime,
    store_fence,
    vaddress,
    vload,
    vstore,
    vstore_nt,
)
from .diskcache import cached_njit
from .forward_rows import ln_raw_rows, rms_raw_rows
from .rowmath import LANES, merge_weights, widened, widened_pair

#: Elements per block of rows (no effect on results): the block's ``h`` stays in L1/L2
#: between the add and the two passes of the row function over it.
BLOCK_ELEMENTS = 1 << 13


@njit(inline="always", error_model="numpy")
def _add_row(xv, rv, hv, r, n):
    """Row ``r`` of ``h = x + residual`` into ``hv`` (plain stores)."""
    body = n // LANES * LANES
    for i in range(0, body, LANES):
        vstore(hv, vload(xv, r, i) + vload(rv, r, i), r, i)
    for i in range(body, n):
        put(hv, r, i, narrow(widen(get(xv, r, i)) + widen(get(rv, r, i)), hv))


@njit(inline="always", error_model="numpy")
def _add_row_streamed(xv, rv, hv, sv, r, n):
    """Row ``r`` of ``h = x + residual`` into the scratch ``sv`` and, with streaming
    stores, into ``hv`` (both from the same vector: the same bits)."""
    i = 0
    align = min(64, LANES * itemsize(hv))
    while i < n and vaddress(hv, r, i) % align != 0:
        v = narrow(widen(get(xv, r, i)) + widen(get(rv, r, i)), hv)
        put(sv, r, i, v)
        put(hv, r, i, v)
        i += 1
    body = i + (n - i) // LANES * LANES
    while i < body:
        v = vload(xv, r, i) + vload(rv, r, i)
        vstore(sv, v, r, i)
        vstore_nt(hv, v, r, i)
        i += LANES
    while i < n:
        v = narrow(widen(get(xv, r, i)) + widen(get(rv, r, i)), hv)
        put(sv, r, i, v)
        put(hv, r, i, v)
        i += 1


@njit(error_model="numpy")
def _add_block(x, res, h, scratch, nt_h, r0, r1):
    """``h`` of rows ``r0 .. r1``; returns the view the row function reads ``h`` from
    (rows ``0 .. r1 - r0``)."""
    n = x.shape[1]
    xv, rv, hv = raw(x[r0:r1]), raw(res[r0:r1]), raw(h[r0:r1])
    if nt_h:
        sv = raw(scratch)
        for r in range(r1 - r0):
            _add_row_streamed(xv, rv, hv, sv, r, n)
        return sv
    for r in range(r1 - r0):
        _add_row(xv, rv, hv, r, n)
    return hv


@njit(error_model="numpy")
def _add_ln_block(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt_h, nt_y, scratch,
                  r0, r1):
    src = _add_block(x, res, h, scratch, nt_h, r0, r1)
    ln_raw_rows(src, raw(y[r0:r1]), raw(w), raw(b), raw(tab), eps, x.shape[1], nt_y,
                 mean_out, rstd_out, runtime(0), r1 - r0, r0)
    if nt_h:
        store_fence()


@njit(error_model="numpy")
def _add_rms_block(x, res, w, eps, h, y, rstd_out, nt_h, nt_y, scratch, r0, r1):
    src = _add_block(x, res, h, scratch, nt_h, r0, r1)
    rms_raw_rows(src, raw(y[r0:r1]), raw(w), eps, x.shape[1], nt_y, rstd_out, runtime(0),
                 r1 - r0, r0)
    if nt_h:
        store_fence()


@njit(inline="always", error_model="numpy")
def block_rows(n):
    """Rows per block: ``BLOCK_ELEMENTS`` worth, at least one."""
    return max(1, BLOCK_ELEMENTS // max(n, 1))


@njit(inline="always", error_model="numpy")
def _scratch(h, rb, nt_h):
    # Only the streamed path reads h from a scratch block; the direct one needs none.
    return np.empty((rb if nt_h else 1, h.shape[1]), dtype=h.dtype)


@cached_njit(error_model="numpy")
def add_ln_forward_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, nt_h, nt_y):
    """``h = x + res`` and the LayerNorm of ``h`` into ``y``, on the calling thread."""
    rows, n = x.shape
    tab = merge_weights(n, eps)
    w, b = widened_pair(w, b)
    rb = block_rows(n)
    scratch = _scratch(h, rb, nt_h)
    for r0 in range(0, rows, rb):
        _add_ln_block(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt_h, nt_y, scratch,
                      r0, min(rows, r0 + rb))
    alive(scratch)


@cached_njit(parallel=True, error_model="numpy")
def add_ln_forward_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, nt_h, nt_y):
    """:func:`add_ln_forward_serial` with blocks of rows over Numba's threads."""
    rows, n = x.shape
    tab = merge_weights(n, eps)
    w, b = widened_pair(w, b)
    rb = block_rows(n)
    for blk in prange((rows + rb - 1) // rb):
        r0 = blk * rb
        scratch = _scratch(h, rb, nt_h)
        _add_ln_block(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt_h, nt_y, scratch,
                      r0, min(rows, r0 + rb))
        alive(scratch)


@cached_njit(error_model="numpy")
def add_rms_forward_serial(x, res, w, eps, h, y, rstd_out, nt_h, nt_y):
    """``h = x + res`` and the RMSNorm of ``h`` into ``y``, on the calling thread."""
    rows, n = x.shape
    w = widened(w)
    rb = block_rows(n)
    scratch = _scratch(h, rb, nt_h)
    for r0 in range(0, rows, rb):
        _add_rms_block(x, res, w, eps, h, y, rstd_out, nt_h, nt_y, scratch, r0,
                       min(rows, r0 + rb))
    alive(scratch)


@cached_njit(parallel=True, error_model="numpy")
def add_rms_forward_parallel(x, res, w, eps, h, y, rstd_out, nt_h, nt_y):
    """:func:`add_rms_forward_serial` with blocks of rows over Numba's threads."""
    rows, n = x.shape
    w = widened(w)
    rb = block_rows(n)
    for blk in prange((rows + rb - 1) // rb):
        r0 = blk * rb
        scratch = _scratch(h, rb, nt_h)
        _add_rms_block(x, res, w, eps, h, y, rstd_out, nt_h, nt_y, scratch, r0,
                       min(rows, r0 + rb))
        alive(scratch)
