"""Residual add then LayerNorm/RMSNorm in one pass over memory (the pre-norm block).

``h = x + residual`` and ``y = norm(h)`` of 2-D ``(rows, n)`` arrays whose rows have
unit stride, block of rows by block of rows: a block's ``h`` is computed in the
accumulation type (an IEEE add per element of the widened inputs), rounded once to h's
element type and stored, then the block is normalized by the same compiled row functions
as the unfused forward (:func:`.forward_rows.ln_long_rows` /
:func:`.forward_rows.ln_short_rows` / :func:`.forward_rows.rms_raw_rows` /
:func:`.forward_rows.rms_short_rows`) reading those
just-stored, cache-resident ``h`` values. The same operations on the same values: ``y``
is bit for bit ``layer_norm(h)`` / ``rms_norm(h)``, rounded to y's element type. A
block whose row function stops before a finite row whose squares overflow or underflow
(see :mod:`.rescale`) is finished by the driver from its ``h``.

``h`` is stored with plain stores and read back from the cache: streaming it to memory
from the same vector while the row function read a scratch copy (so that h's lines are
never read from memory before they are written) was measured slower (float32, 1 thread,
(8192, 1024) and (4096, 4096) from DRAM: 7-12%); ``y`` takes streaming stores where the
unfused forward does. Blocks are large (``BLOCK_ELEMENTS``): the add streams from memory
while the row function computes from the cache, and switching between the two less
often pays (measured: 1 << 13 elements per block 15-25% slower than 1 << 16).

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

from ._scalars import imax, imin, narrow, widen
from ._simd import (
    get,
    put,
    raw,
    runtime,
    vload,
    vstore,
)
from .callee import callee_njit
from .diskcache import cached_njit
from .forward_rows import (
    ln_rows_in_order,
    rms_rows_in_order,
    stopped_blocks,
)
from .rowmath import LANES, PLAIN, SEQUENTIAL, SHORT, STREAM, TILED

#: Elements per block of rows (no effect on results): the block's ``h`` stays in L2
#: between the add and the two passes of the row function over it.
BLOCK_ELEMENTS = 1 << 16
#: The parallel kernels cut an input into at least this many blocks (when it has that
#: many rows), so that every thread gets work.
PARALLEL_BLOCKS = 16


@njit(inline="always", error_model="numpy")
def _add_row(xv, rv, hv, r, n):
    """Row ``r`` of ``h = x + residual`` into ``hv`` (plain stores)."""
    body = n // LANES * LANES
    for i in range(0, body, LANES):
        vstore(hv, vload(xv, r, i) + vload(rv, r, i), r, i)
    for i in range(body, n):
        put(hv, r, i, narrow(widen(get(xv, r, i)) + widen(get(rv, r, i)), hv))


@callee_njit
def add_block(x, res, h, r0, r1):
    """``h`` of rows ``r0 .. r1``; returns its view (rows ``0 .. r1 - r0``)."""
    n = x.shape[1]
    xv, rv, hv = raw(x[r0:r1]), raw(res[r0:r1]), raw(h[r0:r1])
    for r in range(r1 - r0):
        _add_row(xv, rv, hv, r, n)
    return hv


@njit(inline="always", error_model="numpy")
def _add_ln_block(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, stream, r0, r1):
    """``h`` of rows ``r0 .. r1``, then their LayerNorm on the row path (``stream``: the
    stores of y, see :data:`.rowmath.PLAIN`); returns the row the norm stopped at
    (``r1``: all done; see :func:`.forward_rows.ln_long_rows`)."""
    hv = add_block(x, res, h, r0, r1)
    return r0 + ln_rows_in_order(hv, raw(y[r0:r1]), raw(w), raw(b), raw(tab), eps,
                                 x.shape[1], stream, mean_out, rstd_out, runtime(0), r1 - r0,
                                 r0)


@njit(inline="always", error_model="numpy")
def _add_rms_block(x, res, w, eps, h, y, rstd_out, stream, r0, r1):
    hv = add_block(x, res, h, r0, r1)
    return r0 + rms_rows_in_order(hv, raw(y[r0:r1]), raw(w), eps, x.shape[1], stream,
                                  rstd_out, runtime(0), r1 - r0, r0)


@njit(inline="always", error_model="numpy")
def block_rows(rows, n, blocks, elements):
    """Rows per block: ``elements`` worth, fewer where that would leave fewer than
    ``blocks`` blocks (work for every thread), at least one."""
    return imax(1, imin(elements // imax(n, 1), -(-rows // blocks)))


# Entry kernels, one per path (rows longer than SHORT_ROW_MAX, shorter ones): a call
# compiles only its own. A block whose norm stopped before a finite row whose squares
# overflow has h written for the whole block and y from that row on not; the driver
# finishes it through the gathered rows kernel on h, which rescales such rows (see
# .rescale). A parallel kernel returns the (stop, end) rows of its blocks that stopped
# (:func:`.forward_rows.stopped_blocks`: None if none did); a serial one, the
# number of blocks that stopped (its h is then complete, and the driver redoes all of
# y from it: such rows are rare, and a serial call with nothing to report allocates
# and returns no array, which was a third of a one-row call's time in the kernel).


@njit(inline="always", error_model="numpy")
def _add_ln_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, stream):
    rows, n = x.shape
    rb = block_rows(rows, n, 1, BLOCK_ELEMENTS)
    stopped = 0
    for r0 in range(0, rows, rb):
        r1 = imin(rows, r0 + rb)
        stopped += _add_ln_block(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, stream,
                                 r0, r1) < r1
    return stopped


@njit(inline="always", error_model="numpy")
def _add_ln_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, stream):
    rows, n = x.shape
    rb = block_rows(rows, n, PARALLEL_BLOCKS, BLOCK_ELEMENTS)
    pending = np.empty(((rows + rb - 1) // rb, 2), dtype=np.int64)
    for blk in prange(pending.shape[0]):
        r0 = blk * rb
        r1 = imin(rows, r0 + rb)
        pending[blk, 0] = _add_ln_block(x, res, w, b, eps, h, y, mean_out, rstd_out, tab,
                                        stream, r0, r1)
        pending[blk, 1] = r1
    return stopped_blocks(pending)


# Plain and streaming stores of y are separate entry kernels (``nt`` unused): a call
# compiles only the output loop it uses (see rowmath.PLAIN). The block loops and
# blocks above are inlined into them: Numba optimizes and generates machine code for a
# jitted callee again inside every caller's module, so each extra level of calls
# between an entry kernel and the row function cost about 0.3 s of a cold first call
# (measured: add_layer_norm 3.0 -> 2.5 s).


@cached_njit(error_model="numpy")
def add_ln_forward_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """``h = x + res`` and the LayerNorm of ``h`` into ``y``, on the calling thread."""
    return _add_ln_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, PLAIN)


@cached_njit(parallel=True, error_model="numpy")
def add_ln_forward_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """:func:`add_ln_forward_serial` with blocks of rows over Numba's threads."""
    return _add_ln_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, PLAIN)


@cached_njit(error_model="numpy")
def add_ln_seq_forward_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """:func:`add_ln_forward_serial` writing each row of ``y`` whole before reading the
    next row of ``h`` (rows of at least ``SEQUENTIAL_MIN_ROW``, see
    :data:`.rowmath.PLAIN`)."""
    return _add_ln_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, SEQUENTIAL)


@cached_njit(parallel=True, error_model="numpy")
def add_ln_seq_forward_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """:func:`add_ln_forward_parallel` in the order of :func:`add_ln_seq_forward_serial`."""
    return _add_ln_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, SEQUENTIAL)


@cached_njit(error_model="numpy")
def add_ln_tiled_forward_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """:func:`add_ln_forward_serial` normalizing ``h`` in the ``TILED`` order (rows with
    at least ``TILED_MIN_BYTES`` of weight, see :func:`.forward_rows.ln_tiled_rows`)."""
    return _add_ln_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, TILED)


@cached_njit(parallel=True, error_model="numpy")
def add_ln_tiled_forward_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """:func:`add_ln_forward_parallel` in the order of :func:`add_ln_tiled_forward_serial`."""
    return _add_ln_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, TILED)


@cached_njit(error_model="numpy")
def add_ln_stream_forward_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """:func:`add_ln_forward_serial` writing ``y`` with streaming stores."""
    return _add_ln_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, STREAM)


@cached_njit(parallel=True, error_model="numpy")
def add_ln_stream_forward_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """:func:`add_ln_forward_parallel` writing ``y`` with streaming stores."""
    return _add_ln_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, STREAM)


@cached_njit(error_model="numpy")
def add_ln_short_forward_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """:func:`add_ln_forward_serial` for rows of at most ``SHORT_ROW_MAX`` (``nt``
    unused)."""
    return _add_ln_serial(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, SHORT)


@cached_njit(parallel=True, error_model="numpy")
def add_ln_short_forward_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, nt):
    """:func:`add_ln_short_forward_serial` with blocks of rows over Numba's threads."""
    return _add_ln_parallel(x, res, w, b, eps, h, y, mean_out, rstd_out, tab, SHORT)


@njit(inline="always", error_model="numpy")
def _add_rms_serial(x, res, w, eps, h, y, rstd_out, stream):
    rows, n = x.shape
    rb = block_rows(rows, n, 1, BLOCK_ELEMENTS)
    stopped = 0
    for r0 in range(0, rows, rb):
        r1 = imin(rows, r0 + rb)
        stopped += _add_rms_block(x, res, w, eps, h, y, rstd_out, stream, r0, r1) < r1
    return stopped


@njit(inline="always", error_model="numpy")
def _add_rms_parallel(x, res, w, eps, h, y, rstd_out, stream):
    rows, n = x.shape
    rb = block_rows(rows, n, PARALLEL_BLOCKS, BLOCK_ELEMENTS)
    pending = np.empty(((rows + rb - 1) // rb, 2), dtype=np.int64)
    for blk in prange(pending.shape[0]):
        r0 = blk * rb
        r1 = imin(rows, r0 + rb)
        pending[blk, 0] = _add_rms_block(x, res, w, eps, h, y, rstd_out, stream, r0, r1)
        pending[blk, 1] = r1
    return stopped_blocks(pending)


@cached_njit(error_model="numpy")
def add_rms_forward_serial(x, res, w, eps, h, y, rstd_out, nt):
    """``h = x + res`` and the RMSNorm of ``h`` into ``y``, on the calling thread
    (returns as :func:`add_ln_forward_serial`)."""
    return _add_rms_serial(x, res, w, eps, h, y, rstd_out, PLAIN)


@cached_njit(parallel=True, error_model="numpy")
def add_rms_forward_parallel(x, res, w, eps, h, y, rstd_out, nt):
    """:func:`add_rms_forward_serial` with blocks of rows over Numba's threads."""
    return _add_rms_parallel(x, res, w, eps, h, y, rstd_out, PLAIN)


@cached_njit(error_model="numpy")
def add_rms_short_forward_serial(x, res, w, eps, h, y, rstd_out, nt):
    """:func:`add_rms_forward_serial` for rows of at most ``SHORT_ROW_MAX`` (``nt``
    unused)."""
    return _add_rms_serial(x, res, w, eps, h, y, rstd_out, SHORT)


@cached_njit(parallel=True, error_model="numpy")
def add_rms_short_forward_parallel(x, res, w, eps, h, y, rstd_out, nt):
    """:func:`add_rms_short_forward_serial` with blocks of rows over Numba's threads."""
    return _add_rms_parallel(x, res, w, eps, h, y, rstd_out, SHORT)


@cached_njit(error_model="numpy")
def add_rms_seq_forward_serial(x, res, w, eps, h, y, rstd_out, nt):
    """:func:`add_rms_forward_serial` in the order of :func:`add_ln_seq_forward_serial`."""
    return _add_rms_serial(x, res, w, eps, h, y, rstd_out, SEQUENTIAL)


@cached_njit(parallel=True, error_model="numpy")
def add_rms_seq_forward_parallel(x, res, w, eps, h, y, rstd_out, nt):
    """:func:`add_rms_forward_parallel` in the order of :func:`add_ln_seq_forward_serial`."""
    return _add_rms_parallel(x, res, w, eps, h, y, rstd_out, SEQUENTIAL)


@cached_njit(error_model="numpy")
def add_rms_tiled_forward_serial(x, res, w, eps, h, y, rstd_out, nt):
    """:func:`add_rms_forward_serial` in the order of :func:`add_ln_tiled_forward_serial`."""
    return _add_rms_serial(x, res, w, eps, h, y, rstd_out, TILED)


@cached_njit(parallel=True, error_model="numpy")
def add_rms_tiled_forward_parallel(x, res, w, eps, h, y, rstd_out, nt):
    """:func:`add_rms_forward_parallel` in the order of :func:`add_ln_tiled_forward_serial`."""
    return _add_rms_parallel(x, res, w, eps, h, y, rstd_out, TILED)


@cached_njit(error_model="numpy")
def add_rms_stream_forward_serial(x, res, w, eps, h, y, rstd_out, nt):
    """:func:`add_rms_forward_serial` writing ``y`` with streaming stores."""
    return _add_rms_serial(x, res, w, eps, h, y, rstd_out, STREAM)


@cached_njit(parallel=True, error_model="numpy")
def add_rms_stream_forward_parallel(x, res, w, eps, h, y, rstd_out, nt):
    """:func:`add_rms_forward_parallel` writing ``y`` with streaming stores."""
    return _add_rms_parallel(x, res, w, eps, h, y, rstd_out, STREAM)
