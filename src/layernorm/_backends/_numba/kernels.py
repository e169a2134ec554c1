"""The entry kernels of the Numba backend, by job: what the drivers in ``__init__`` call.

Every kernel computes each row with one fixed sequence of IEEE operations (the *row
arithmetic*, :mod:`.rowmath`), whatever the row's layout, its position in the batch and the number
of threads, so each row's result is bitwise reproducible. Three code paths perform it:

* **row path** (2-D, row with unit stride): the ``LANES`` lanes of the row arithmetic
  are the lanes of one SIMD vector (:mod:`._simd`), loaded straight from the row. In the
  forward, rows of at most ``SHORT_ROW_MAX`` elements go ``LANES`` at a time:
  each row's lane sums are computed alone, then the lane trees of step 3 and the
  ``rstd`` of step 5 are evaluated for all of them at once on folded vectors (row ``i``
  in lane ``i``, the same additions in the same tree), which removes most of a short
  row's latency; the rare row that step 4 redoes is redone alone. Longer rows are
  software pipelined: the first pass over row ``r + 1`` runs chunk by
  chunk with the output pass of row ``r``;
* **gather path** (any other 2-D row): rows are copied into contiguous scratch rows,
  run through the row path, and the results copied out;
* **column path** (3-D, ``inner > 1``, the channels-first case; and in the forward, rows
  that are the columns of a C-ordered array, a transposed or Fortran-ordered x, as the
  columns of its ``(1, n, rows)`` view): ``WIDTH`` neighbouring
  columns are processed at once, one column per SIMD lane, and the row arithmetic's
  lanes become a loop over lane-state vectors (a column that step 4 redoes is copied
  into a scratch row and redone by the row path's code). A work item copies a tile of up to
  ``8 * WIDTH`` columns into an ``(n, columns)`` scratch tile in row order first (rows
  are far apart; a sequential walk is what the prefetchers follow), padding a last
  partial block by repeating its last column. The backward of this layout gathers each
  column into a scratch row and runs the row path on it.

IEEE operations on a vector are the same operations per lane, and Numba is never asked
for fastmath or FMA contraction (``error_model="numpy"`` also removes Python's
zero-division checks: an ``eps=0`` constant row gives NaN), so all paths give
identical bits (tested in ``tests/test_numba_kernels.py``). Rows reach the per-row
helpers as :class:`._simd.Raw` views: passing arrays would cost reference-count
updates per row.

The kernels see a 2-D ``(rows, n)`` array, or the columns of a 3-D ``(outer, n, inner)``
one, and nothing else. Modules, by job:

* :mod:`.rowmath`: the row arithmetic every path shares (constants, affine step, lane
  sums, moments, the cancellation check and redo, finish, tree sums), and the host-side
  table of its ``n``-dependent constants (:func:`.rowmath.merge_table`, passed to the
  LayerNorm kernels as ``tab``);
* :mod:`.forward_rows`: LayerNorm/RMSNorm forward of rows (row, short-row and gather
  paths, each its own entry kernel, serial and parallel);
* :mod:`.forward_cols`: the channels-first forward (column path);
* :mod:`.backward`: row and column backward (each kernel returns the parameter
  gradients, its partials summed over blocks in a fixed order);
* :mod:`.fused`: residual add then LayerNorm/RMSNorm of rows in one pass (the row
  functions of :mod:`.forward_rows` on the freshly added rows);
* :mod:`.quantized`: the same with int8/float8 output (each row's codes from its output
  pass, through a float32 row in cache for a per-row scale);
* :mod:`.passes`: the forward's two passes alone, for the roofline tool;
* :mod:`.params`: 16-bit parameters widened, and parameter gradients rounded to them,
  a vector at a time (long parameters only);
* :mod:`._simd`, :mod:`._scalars`: the SIMD vectors and 16-bit conversions they are
  written with (:mod:`.python_simd`: their NumPy stand-ins under
  ``NUMBA_DISABLE_JIT=1``);
* :mod:`.diskcache`: the compile cache, keyed to all of these sources;
  :mod:`.entry`: the compiled entry points the drivers call.

Each path has its own entry kernels, serial and parallel, written out one by one: a
call compiles only the kernel of its path, and Numba's disk cache keys a kernel by its
qualified name and source line (kernels made by a factory would share entries), while a
kernel that takes another jitted function as an argument cannot be cached at all (Numba:
"uses dynamic globals"). So the thin loops over blocks repeat, the row code does not.

Importing this module imports neither Numba nor any kernel module: the first use of one
of its names imports the module that defines it (and Numba), so a call defines only the
kernels of its job (measured, warm cache, fresh processes, interleaved: importing every
kernel module cost a plain forward's first call 12-37 ms of its 0.3 s). Nothing compiles
until a kernel is first called (each specialization is then loaded from, or saved to, the
disk cache).
"""

from __future__ import annotations

import importlib
from typing import Any

#: The module defining each name of this one.
_HOMES = {
    "backward": (
        "COL_BLOCK",
        "PAIR_MIN_N",
        "SHORT_BACKWARD_N",
        "SPLIT_COLUMNS",
        "TILE_MIN_N",
        "backward_cols_parallel",
        "backward_cols_serial",
        "ln_backward_parallel",
        "ln_backward_serial",
        "ln_gathered_backward_parallel",
        "ln_gathered_backward_serial",
        "ln_short_backward_parallel",
        "ln_short_backward_serial",
        "ln_split_backward_parallel",
        "ln_stream_backward_parallel",
        "ln_stream_backward_serial",
        "ln_stream_tiled_backward_parallel",
        "ln_stream_tiled_backward_serial",
        "ln_tiled_backward_parallel",
        "ln_tiled_backward_serial",
        "rms_backward_parallel",
        "rms_backward_serial",
        "rms_gathered_backward_parallel",
        "rms_gathered_backward_serial",
        "rms_paired_backward_parallel",
        "rms_paired_backward_serial",
        "rms_split_backward_parallel",
        "rms_stream_backward_parallel",
        "rms_stream_backward_serial",
    ),
    "forward_cols": (
        "SHORT_COLUMN_MAX",
        "ln_forward_cols_parallel",
        "ln_forward_cols_serial",
        "ln_forward_short_cols_parallel",
        "ln_forward_short_cols_serial",
        "rms_forward_cols_parallel",
        "rms_forward_cols_serial",
        "rms_forward_short_cols_parallel",
        "rms_forward_short_cols_serial",
    ),
    "forward_rows": (
        "RMS_STREAM_TILED_MIN_BYTES",
        "SEQUENTIAL_MIN_ROW",
        "SHORT_ROW_MAX",
        "STREAM_ROWS_MAX_BYTES",
        "TILED_MIN_BYTES",
        "TILED_PARALLEL_MIN_BYTES",
        "ln_forward_parallel",
        "ln_forward_serial",
        "ln_gathered_forward_parallel",
        "ln_gathered_forward_serial",
        "ln_seq_forward_parallel",
        "ln_seq_forward_serial",
        "ln_short_forward_parallel",
        "ln_short_forward_serial",
        "ln_stream_forward_parallel",
        "ln_stream_forward_serial",
        "ln_stream_tiled_forward_parallel",
        "ln_stream_tiled_forward_serial",
        "ln_tiled_forward_parallel",
        "ln_tiled_forward_serial",
        "rms_forward_parallel",
        "rms_forward_serial",
        "rms_gathered_forward_parallel",
        "rms_gathered_forward_serial",
        "rms_seq_forward_parallel",
        "rms_seq_forward_serial",
        "rms_short_forward_parallel",
        "rms_short_forward_serial",
        "rms_stream_forward_parallel",
        "rms_stream_forward_serial",
        "rms_stream_tiled_forward_parallel",
        "rms_stream_tiled_forward_serial",
        "rms_tiled_forward_parallel",
        "rms_tiled_forward_serial",
    ),
    "fused": (
        "add_ln_forward_parallel",
        "add_ln_forward_serial",
        "add_ln_seq_forward_parallel",
        "add_ln_seq_forward_serial",
        "add_ln_short_forward_parallel",
        "add_ln_short_forward_serial",
        "add_ln_stream_forward_parallel",
        "add_ln_stream_forward_serial",
        "add_ln_tiled_forward_parallel",
        "add_ln_tiled_forward_serial",
        "add_rms_forward_parallel",
        "add_rms_forward_serial",
        "add_rms_seq_forward_parallel",
        "add_rms_seq_forward_serial",
        "add_rms_short_forward_parallel",
        "add_rms_short_forward_serial",
        "add_rms_stream_forward_parallel",
        "add_rms_stream_forward_serial",
        "add_rms_tiled_forward_parallel",
        "add_rms_tiled_forward_serial",
    ),
    "quantized": (
        "DYNAMIC",
        "FORMAT_TAGS",
        "LN_TILED_MIN_BYTES",
        "STATIC",
        "ln_long_quant_forward_parallel",
        "ln_long_quant_forward_serial",
        "ln_quant_forward_parallel",
        "ln_quant_forward_serial",
        "ln_quant_rescued_serial",
        "ln_short_quant_forward_parallel",
        "ln_short_quant_forward_serial",
        "ln_tiled_quant_forward_parallel",
        "ln_tiled_quant_forward_serial",
        "PIPELINED_ROW_ELEMENTS",
        "rms_long_quant_forward_parallel",
        "rms_long_quant_forward_serial",
        "rms_quant_forward_parallel",
        "rms_quant_forward_serial",
        "rms_quant_rescued_serial",
        "rms_tiled_quant_forward_parallel",
        "rms_tiled_quant_forward_serial",
    ),
    "params": (
        "narrow_param",
        "widen_param",
        "widen_params",
    ),
    "rowmath": (
        "LANES",
        "merge_table",
    ),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_HOME_OF)


def __getattr__(name: str) -> Any:
    """The kernel or constant ``name``, from its module (imported on first use)."""
    try:
        module = _HOME_OF[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
