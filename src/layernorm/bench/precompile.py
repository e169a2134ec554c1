"""``python -m layernorm compile``: fill Numba's disk cache ahead of time.

A container image or a CI job that runs this once starts every later process with the
kernels already compiled: a first call then loads its kernel instead of compiling it
(seconds each).

What it compiles is exactly what real calls use, because it *makes* real calls: small
``layer_norm``/``rms_norm`` and ``add_layer_norm``/``add_rms_norm`` calls (x plus a
residual of its dtype; with ``backward``, their backwards; with ``quantized``, the same
with ``quantize="int8"``, per-row and given scales) through the public API, once for
each layout that selects a different kernel in the Numba backend's
drivers (``layernorm._backends._numba``):

* rows (the normalized axis last): the serial row kernel, on contiguous rows of at most
  128 elements (the short-row path), rows of 256 (the quantizing kernels' pipelined
  rows), longer rows, rows of at least 2048 elements (the backward's tiles; the
  forward's rows written whole, ``SEQUENTIAL_MIN_ROW``), rows of 4096 (the forward's
  column tiles over groups of rows, ``TILED_MIN_BYTES``), and strided rows; and the
  parallel row
  kernel on inputs of at least ``PARALLEL_MIN_ELEMENTS`` elements, when Numba has more
  than one thread (a process with one thread never runs it);
* columns (the normalized axis not last, so inner size > 1): the serial and parallel
  column kernels;
* each with weight and bias of the input's dtype and without them (an absent parameter
  is replaced by one of the accumulation dtype, a different compiled signature for
  16-bit inputs); the backward's parameter-gradient reduction comes with it;
* the kernels that write with streaming stores (the forward's and the backward's own
  kernels, which real calls take only for outputs larger than half the last-level
  cache): small calls on long rows made with streaming stores forced
  (:func:`layernorm._backends._numba.streaming_stores_everywhere`).

Layouts that reach the same compiled kernel cost only a call once it is compiled, so
the list errs on the side of calling too many.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .impls import numpy_dtype
from .machine import installed


@dataclass(frozen=True)
class Layout:
    """One input layout: how ``x`` is made and which axis is normalized."""

    name: str
    shape: tuple[int, ...]
    axis: int = -1
    #: Step over the last axis (2: every other element, rows with a stride).
    step: int = 1
    parallel: bool = False
    #: Streaming stores forced (see the module's docstring; not for quantized output).
    streamed: bool = False


def layouts(threads: int) -> list[Layout]:
    """The layouts that select different kernels; parallel ones only for ``threads > 1``.

    Examples
    --------
    >>> [lay.name for lay in layouts(1)]  # doctest: +NORMALIZE_WHITESPACE
    ['short rows', 'rows of 256', 'long rows', 'tiled rows', 'rows of 4096', 'strided rows',
     'columns', 'streamed long rows', 'streamed tiled rows', 'streamed rows of 4096']
    >>> all(np.prod(lay.shape) // lay.step >= 1 << 16 for lay in layouts(2) if lay.parallel)
    True
    """
    out = [
        Layout("short rows", (8, 64)),
        # Rows of at most PIPELINED_ROW_ELEMENTS (256): the quantizing kernels' pipelined
        # row loop (the plain forward's kernel is the long rows').
        Layout("rows of 256", (8, 256)),
        # Rows of at least TILE_FROM_N (1024) in cache: the LayerNorm backward's tiles,
        # RMSNorm's rows one by one.
        Layout("long rows", (8, 1024)),
        # Rows of at least PAIR_MIN_N (2048): RMSNorm's pairs; the forward's rows
        # written whole (at least SEQUENTIAL_MIN_ROW).
        Layout("tiled rows", (4, 2048)),
        # Rows of at least TILED_MIN_BYTES of float32 parameters: the forward's column
        # tiles over groups of rows.
        Layout("rows of 4096", (4, 4096)),
        Layout("strided rows", (8, 2048), step=2),
        Layout("columns", (2, 16, 8), axis=1),
        Layout("streamed long rows", (8, 1024), streamed=True),
        Layout("streamed tiled rows", (4, 2048), streamed=True),
        # At least RMS_STREAM_TILED_MIN_BYTES: RMSNorm's streamed column tiles (the
        # LayerNorm forward's above STREAM_ROWS_MAX_BYTES: float32 rows from 1537, the
        # "tiled rows" layout).
        Layout("streamed rows of 4096", (4, 4096), streamed=True),
    ]
    if threads > 1:
        out += [
            Layout("parallel short rows", (1024, 64), parallel=True),
            Layout("parallel rows of 256", (256, 256), parallel=True),
            # Two blocks of the backward's rows; one block (32 rows) splits columns.
            Layout("parallel long rows", (128, 1024), parallel=True),
            Layout("parallel tiled rows", (32, 2048), parallel=True),
            Layout("parallel rows of 4096", (16, 4096), parallel=True),
            Layout("parallel columns", (4, 128, 128), axis=1, parallel=True),
            Layout("parallel streamed long rows", (128, 1024), parallel=True,
                   streamed=True),
            Layout("parallel streamed tiled rows", (128, 2048), parallel=True,
                   streamed=True),
            Layout("parallel streamed rows of 4096", (16, 4096), parallel=True,
                   streamed=True),
        ]
    return out


def _inputs(layout: Layout, dtype: str, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """(x, grad_y, weight, bias) for one layout: seeded, small, of ``dtype``."""
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    x = rng.standard_normal(layout.shape, dtype=np.float32).astype(dt)
    gy = rng.standard_normal(layout.shape, dtype=np.float32).astype(dt)
    if layout.step > 1:
        x, gy = x[..., ::layout.step], gy[..., ::layout.step]
    n = x.shape[layout.axis]
    weight = (1.0 + 0.1 * rng.standard_normal(n)).astype(dt)
    bias = (0.1 * rng.standard_normal(n)).astype(dt)
    return x, gy, weight, bias


def calls(op: str, direction: str, dtype: str, layout: Layout) -> Callable[[], None]:
    """One zero-argument function making the layout's real calls, with and without
    parameters."""
    import layernorm as ln

    x, gy, weight, bias = _inputs(layout, dtype)
    axis = layout.axis
    if layout.streamed:
        if direction == "quantized":
            return lambda: None
        # The fusions' backward is the norm's.
        norm = op[len("add_"):] if direction == "backward" and op.startswith("add_") else op
        return _streamed(norm, direction, x, gy, weight, bias)
    if direction == "quantized":
        # One kernel per (op, dtype, parameters, row path, kind of scale): a per-row
        # (dynamic) and a given (static) scale compile separately; each 8-bit format
        # compiles its own, and int8 is the one compiled here. Layouts the kernels do
        # not take compose from the plain kernels.
        def quantized() -> None:
            fn = getattr(ln, op)
            args = (x, gy) if op.startswith("add_") else (x,)
            for w, b in ((weight, bias), (None, None)):
                params = {"weight": w} if op.endswith("rms_norm") else {"weight": w,
                                                                        "bias": b}
                for scale in (None, 0.05):
                    fn(*args, axis=axis, quantize="int8", scale=scale, **params)

        return quantized
    if op.startswith("add_"):
        # The fusion's own kernels serve its forward (rows; other layouts compose from
        # the norm's kernels); its backward is the norm's.
        if direction == "backward":
            return calls(op[len("add_"):], direction, dtype, layout)

        def add_forward() -> None:
            if op == "add_layer_norm":
                for w, b in ((weight, bias), (None, None)):
                    ln.add_layer_norm(x, gy, weight=w, bias=b, axis=axis)
            else:
                for w in (weight, None):
                    ln.add_rms_norm(x, gy, weight=w, axis=axis)

        return add_forward

    def forward() -> None:
        if op == "layer_norm":
            for w, b in ((weight, bias), (None, None)):
                ln.layer_norm(x, weight=w, bias=b, axis=axis)
        else:
            for w in (weight, None):
                ln.rms_norm(x, weight=w, axis=axis)

    def backward() -> None:
        if op == "layer_norm":
            for w, b in ((weight, bias), (None, None)):
                _, mean, rstd = ln.layer_norm(x, weight=w, bias=b, axis=axis,
                                              return_stats=True)
                ln.layer_norm_backward(gy, x, mean, rstd, w, axis=axis)
        else:
            for w in (weight, None):
                _, rstd = ln.rms_norm(x, weight=w, axis=axis, return_stats=True)
                ln.rms_norm_backward(gy, x, rstd, w, axis=axis)

    return forward if direction == "forward" else backward


def _streamed(op: str, direction: str, x: Any, gy: Any, weight: Any,
              bias: Any) -> Callable[[], None]:
    """The calls of a streamed layout: the general path (``backend="numba"``; the short
    path for small calls never streams), streaming stores forced."""
    import layernorm as ln

    from .._backends._numba import streaming_stores_everywhere

    def backward() -> None:
        with streaming_stores_everywhere():
            for w, b in ((weight, bias), (None, None)):
                if op == "layer_norm":
                    _, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True)
                    ln.layer_norm_backward(gy, x, mean, rstd, w, backend="numba")
                else:
                    _, rstd = ln.rms_norm(x, weight=w, return_stats=True)
                    ln.rms_norm_backward(gy, x, rstd, w, backend="numba")

    if direction == "backward":
        return backward

    def forward() -> None:
        with streaming_stores_everywhere():
            for w, b in ((weight, bias), (None, None)):
                if op == "layer_norm":
                    ln.layer_norm(x, weight=w, bias=b, backend="numba")
                elif op == "rms_norm":
                    ln.rms_norm(x, weight=w, backend="numba")
                elif op == "add_layer_norm":
                    ln.add_layer_norm(x, gy, weight=w, bias=b, backend="numba")
                else:
                    ln.add_rms_norm(x, gy, weight=w, backend="numba")

    return forward


def cache_dir() -> str:
    """Where Numba writes this package's kernels: ``NUMBA_CACHE_DIR`` when set, else the
    ``__pycache__`` folders of the Numba backend."""
    from numba.core import config

    if config.CACHE_DIR:
        return str(config.CACHE_DIR)
    spec = importlib.util.find_spec("layernorm._backends._numba")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else "."


def cache_files(folder: str) -> set[str]:
    """Numba cache files (index ``.nbi`` and data ``.nbc``) under ``folder``."""
    found: set[str] = set()
    for ext in ("nbi", "nbc"):
        found.update(glob.glob(os.path.join(folder, "**", f"*.{ext}"), recursive=True))
    return found


def available_dtypes(dtypes: Sequence[str]) -> tuple[list[str], list[str]]:
    """(dtypes that can be compiled here, those skipped: bfloat16 without ml_dtypes)."""
    ok = [dt for dt in dtypes if dt != "bfloat16" or installed("ml_dtypes")]
    return ok, [dt for dt in dtypes if dt not in ok]


def run(ops: Sequence[str], directions: Sequence[str], dtypes: Sequence[str],
        update: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Make every call; returns what was done, with seconds per (dtype, op, direction,
    layout), the cache folder and the cache files it added."""
    import numba

    from .._backends._numba import parallel_kernels_compiled_at_once

    threads = numba.get_num_threads()
    folder = cache_dir()
    before = cache_files(folder)
    started = time.perf_counter()
    items = []
    for dtype in dtypes:
        for op in ops:
            for direction in directions:
                for layout in layouts(threads):
                    fn = calls(op, direction, dtype, layout)
                    t0 = time.perf_counter()
                    fn()  # the serial kernels (a class's first calls are serial)
                    if layout.parallel:
                        with parallel_kernels_compiled_at_once():
                            fn()
                    items.append({"dtype": dtype, "op": op, "direction": direction,
                                  "layout": layout.name,
                                  "seconds": time.perf_counter() - t0})
                    if update is not None:
                        update(f"{dtype} {op} {direction} {layout.name}")
    added = sorted(cache_files(folder) - before)
    return {"items": items, "threads": threads, "cache_dir": folder,
            "new_cache_files": len(added), "cache_files": len(cache_files(folder)),
            "seconds": time.perf_counter() - started}


def format_report(report: dict[str, Any], skipped: Sequence[str] = ()) -> str:
    """What was compiled (or loaded from the cache), how long it took, and where."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for item in report["items"]:
        groups.setdefault((item["dtype"], item["op"], item["direction"]), []).append(item)
    lines = [f"{'dtype':<9} {'operation':<11} {'direction':<9} {'seconds':>8}  layouts"]
    for (dtype, op, direction), items in groups.items():
        seconds = sum(i["seconds"] for i in items)
        lines.append(f"{dtype:<9} {op:<11} {direction:<9} {seconds:>8.2f}  "
                     + ", ".join(i["layout"] for i in items))
    if report["threads"] < 2:
        lines.append("parallel kernels: not compiled (Numba has 1 thread here; a process "
                     "with one thread never runs them)")
    for dtype in skipped:
        lines.append(f"{dtype}: skipped (needs ml_dtypes)")
    lines.append(f"{len(report['items'])} layouts in {report['seconds']:.1f} s; "
                 f"{report['new_cache_files']} new cache files "
                 f"({report['cache_files']} in all) in {report['cache_dir']}")
    if report["new_cache_files"] == 0 and report["items"]:
        lines.append("nothing new: every kernel was already in the cache")
    return "\n".join(lines)
