"""``python -m layernorm bench --roofline``: where the LayerNorm forward's time goes.

The forward kernel makes two passes over each row: a **statistics pass** reads the row
(from memory) and computes its mean and ``rstd``; an **output pass** reads the row again
(now from L1) and writes ``y``. For each shape this times, interleaved round by round
like the rest of ``bench`` (float32, one thread, into preallocated outputs):

* ``copy``: ``np.copyto(y, x)``, the memory floor for the same bytes;
* ``read x`` and ``write y``: a vector sum over ``x`` and a vector fill of ``y`` alone;
* ``kernel``: the fused serial kernel, as ``layer_norm(x, ..., out=)`` runs it;
* ``statistics pass`` and ``output pass``: the kernel's own two passes run alone
  (compiled from the same inlined row helpers, so the same instructions and bits), the
  output pass reading ``x`` from wherever it lives;
* the same three **in cache**: on views of the shape whose rows all alias one row of
  ``x`` and one of ``y`` (row stride 0), so every row is read from and written to L1
  (L2 for rows over 4096 elements). This is the same work with no memory traffic: the
  compute floor of the roofline.

The kernel can be no faster than the larger of the copy (memory) and the in-cache time
(compute); where the kernel exceeds both, the two passes serialize (each row's output
pass waits for its statistics).

Rows of at most ``SHORT_ROW_MAX`` elements take the short-row path, which computes the
statistics of 16 rows together: its passes are not separable, and only the fused kernel
is shown for them.

With ``--backward``, :func:`measure_backward` times the LayerNorm backward kernel against
``np.add(grad_y, x, out=grad_x)`` (the same bytes) and in cache, without its passes apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._backends._numba import LN_FORWARD_WRITES, ln_row_kernels, use_streaming_stores
from .._backends._numba import kernels as k
from .._backends._numba.entry import entry_point
from .._backends._numba.passes import output_pass, read_pass, statistics_pass, write_pass
from .timing import median_times

EPS = np.float32(1e-5)


class _Parts:
    """Arrays and the timed callables of the kernel and of its two passes alone."""

    def __init__(self, x: np.ndarray, w: np.ndarray, b: np.ndarray, y: np.ndarray,
                 nt: bool) -> None:
        rows = x.shape[0]
        self.x, self.w, self.b, self.y, self.nt = x, w, b, y, nt
        self.mean = np.empty(rows, np.float32)
        self.rstd = np.empty(rows, np.float32)
        self.shift = np.empty(rows, np.float32)
        self.mu = np.empty(rows, np.float32)
        self.tab = k.merge_table(x.shape[1], np.dtype(np.float32))
        args = (x, w, b, EPS, y, self.mean, self.rstd, self.tab, nt)
        kernel = entry_point(ln_row_kernels(k, x, y, nt)[0], LN_FORWARD_WRITES, args)
        self.kernel: Callable[[], Any] = lambda: kernel(*args)
        self.separable = x.shape[1] > k.SHORT_ROW_MAX

    def statistics(self) -> None:
        statistics_pass(self.x, EPS, self.tab, self.shift, self.mu, self.rstd)

    def output(self) -> None:
        output_pass(self.x, self.w, self.b, self.shift, self.mu, self.rstd, self.y, self.nt)

    def callables(self) -> dict[str, Callable[[], Any]]:
        fns: dict[str, Callable[[], Any]] = {"kernel": self.kernel}
        if self.separable:
            fns["statistics pass"] = self.statistics
            fns["output pass"] = self.output
        return fns


def _one_row_repeated(row: np.ndarray, rows: int) -> np.ndarray:
    """A writable ``(rows, n)`` view whose rows are all ``row`` (row stride 0)."""
    return np.lib.stride_tricks.as_strided(row, (rows, row.shape[0]), (0, row.strides[0]))


def check_parts(parts: _Parts) -> None:
    """Raise unless the separate passes give the fused kernel's bits (they time the same
    arithmetic only if they do)."""
    parts.kernel()
    y, rstd = parts.y.copy(), parts.rstd.copy()
    parts.y.fill(np.nan)
    parts.statistics()
    parts.output()
    if not (np.array_equal(parts.rstd, rstd) and np.array_equal(parts.y, y, equal_nan=True)):
        raise RuntimeError("the separate statistics and output passes differ from the "
                             "fused kernel")


def _inputs(shape: tuple[int, int], seed: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """The seeded generator, float32 rows ``x`` (offset, not centred) and a weight."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2.0 + 3.0).astype(np.float32)
    w = rng.standard_normal(shape[1]).astype(np.float32)
    return rng, x, w


def measure(shape: tuple[int, int], repeats: int = 11, target_s: float = 0.01,
            seed: int = 0) -> dict[str, Any]:
    """Time the parts of the LayerNorm forward at ``shape`` (float32, one thread).

    Returns ``{"shape": shape, "streaming": bool, "seconds": {part: median seconds}}``
    (``streaming``: whether the kernel writes ``y`` with streaming stores, as
    ``layer_norm`` would for this output).
    """
    rows, n = shape
    rng, x, w = _inputs(shape, seed)
    b = rng.standard_normal(n).astype(np.float32)
    y = np.empty_like(x)
    full = _Parts(x, w, b, y, use_streaming_stores(x, y))  # streaming stores as layer_norm chooses
    cached = _Parts(_one_row_repeated(x[0], rows), w, b,
                    _one_row_repeated(np.empty(n, np.float32), rows), False)
    for parts in (full, cached):
        if parts.separable:
            check_parts(parts)
    fns = {"copy": lambda: np.copyto(full.y, x),
           "read x": lambda: read_pass(x),
           "write y": lambda: write_pass(full.y, np.float32(1.5))}
    fns.update(full.callables())
    fns.update({f"in cache: {name}": fn for name, fn in cached.callables().items()})
    return {"shape": shape, "direction": "forward", "streaming": full.nt,
            "seconds": median_times(fns, repeats, target_s)}


def measure_backward(shape: tuple[int, int], repeats: int = 11, target_s: float = 0.01,
                     seed: int = 0) -> dict[str, Any]:
    """Time the LayerNorm backward kernel at ``shape`` against its memory floor and its
    compute floor (float32, one thread).

    The memory floor is ``np.add(grad_y, x, out=grad_x)`` (the same two reads and one
    write, key ``"copy"`` as for the forward); the compute floor is the kernel on row
    views that alias one row of each array. Its two passes are not timed apart.
    """
    from .._backends._numba import GRAD_ROW_BLOCK, LN_BACKWARD_WRITES, ln_backward_kernels

    rows, n = shape
    rng, x, w = _inputs(shape, seed)
    gy = rng.standard_normal(shape).astype(np.float32)
    gx = np.empty_like(x)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=1).astype(np.float32)
    rstd = (1.0 / np.sqrt(x64.var(axis=1) + 1e-5)).astype(np.float32)
    partials = np.zeros((2, -(-rows // GRAD_ROW_BLOCK), n), np.float32)

    def kernel_of(*arrays: np.ndarray) -> Callable[[], Any]:
        args = (*arrays[:2], mean, rstd, w, arrays[2], partials, GRAD_ROW_BLOCK, arrays[1],
                False)
        serial = ln_backward_kernels(k, arrays[0], arrays[1], arrays[2])[0]
        entry = entry_point(serial, LN_BACKWARD_WRITES, args)
        return lambda: entry(*args)

    fns = {"copy": lambda: np.add(gy, x, out=gx),
           "kernel": kernel_of(gy, x, gx),
           "in cache: kernel": kernel_of(*(_one_row_repeated(a[0].copy(), rows)
                                           for a in (gy, x, gx)))}
    return {"shape": shape, "direction": "backward", "streaming": False,
            "seconds": median_times(fns, repeats, target_s)}


def _bound(times: dict[str, float], floor_name: str) -> str:
    copy, kernel, compute = times["copy"], times["kernel"], times["in cache: kernel"]
    floor = max(copy, compute)
    which = (f"compute (in-cache time > {floor_name})" if compute > copy
             else f"memory ({floor_name})")
    return (f"floor: {which}; the kernel takes {kernel / floor:.2f}x its floor and "
            f"{100 * copy / kernel:.0f}% of {floor_name} speed")


def format_report(results: Sequence[dict[str, Any]]) -> str:
    """The measurements as a text table, one block per shape."""
    order = ("copy", "read x", "write y", "kernel", "statistics pass", "output pass",
             "in cache: kernel", "in cache: statistics pass", "in cache: output pass")
    backward = bool(results) and results[0].get("direction") == "backward"
    floor_name = "grad_y + x" if backward else "copy"
    lines = [("LayerNorm backward, float32, 1 thread, into preallocated grad_x"
              if backward else "LayerNorm forward, float32, 1 thread, into out=")
             + ": where the time goes",
             f"{'shape':>11}  {'part':<28} {'us':>9} {'x floor':>8}",
             "-" * 60]
    for res in results:
        times = res["seconds"]
        label = "{}x{}".format(*res["shape"])
        for name in order:
            if name not in times:
                continue
            shown = floor_name + (" (np.add)" if backward else " (np.copyto)") \
                if name == "copy" else name
            lines.append(f"{label:>11}  {shown:<28} {times[name] * 1e6:>9,.0f} "
                         f"{times[name] / times['copy']:>8.2f}")
            label = ""
        if res["streaming"]:
            lines.append(f"{'':>11}  (the kernel and the output pass use streaming stores)")
        lines.append(f"{'':>11}  {_bound(times, floor_name)}")
        lines.append("")
    lines.append(
        f"x floor: the part's time over the memory floor's ({floor_name} of the same "
        "bytes into preallocated memory; 1.00 = its speed). In-cache parts run on rows "
        "that all alias one row, which stays in L1/L2: the compute floor.")
    return "\n".join(lines)


def run(shapes: Sequence[tuple[int, int]], repeats: int, target_s: float,
        progress: Callable[[str], None] | None = None, backward: bool = False
        ) -> list[dict[str, Any]]:
    """:func:`measure` (or :func:`measure_backward`) every shape on one Numba thread
    (restored afterwards)."""
    timed = measure_backward if backward else measure
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        results = []
        for shape in shapes:
            if progress is not None:
                progress("{}x{}".format(*shape))
            results.append(timed(shape, repeats, target_s))
        return results
    finally:
        numba.set_num_threads(before)
