"""``python -m layernorm bench``: the grid of cases, each timed against the copy floor and
the peers.

How it measures
---------------
* Every grid cell (operation, direction, dtype, shape, thread count, data regime) builds
  its inputs once (seeded), then times every implementation together with
  :func:`.timing.time_interleaved`: round-robin rounds of calibrated samples, medians.
* The data regime is a property of the inputs, not of the timer
  (:func:`.impls.regime_cases`): ``cache`` times one working set of at most 1.5 MB,
  reused; ``memory`` builds every implementation (the copies included) once per copy
  of the inputs and times their rotation (:func:`.timing.rotating`), over more than
  128 MiB, so every call starts from DRAM. Copies, ours and peers of a cell share the
  regime and the rounds.
* Bandwidth counts the floor of memory traffic: forward reads ``x`` and writes ``y``;
  backward reads ``grad_y`` and ``x`` and writes ``grad_x``. Statistics and parameter
  gradients are negligible and not counted.
* The denominator of "% copy" is the best *preallocated* streaming baseline that moves
  the operation's own bytes, timed in the same rounds: for forward a copy of ``x``
  (``np.copyto``, or torch's multi-threaded ``copy_`` when torch is installed), for
  backward ``grad_y + x`` into a preallocated array (NumPy's, or torch's threaded add),
  which reads two arrays and writes one like the backward does. It is the best regime
  such an operation has: no allocation, no page faults.
* "speed-up" is a peer's time divided by ours with the same output regime
  (``fresh`` with ``fresh``, ``heap reuse`` with ``heap reuse``, ``prealloc`` with our
  ``out=`` call); > 1 means we are faster.
* The fusions (``add_layer_norm``, ``add_rms_norm``) read ``x`` and ``residual`` and
  write ``h`` and ``y``: their floor is two preallocated copies timed as one call (``x``
  into one buffer, ``residual`` into another), and their peers are the unfused add then
  norm (into preallocated arrays, and with fresh ones) and torch's ``x + residual``
  then ``F.layer_norm`` / ``F.rms_norm``. Their backward is the norm's with
  ``grad_residual`` (``grad_x + grad_residual`` in one pass, reading four arrays): it is
  reported against the same backward without it (``vs base``), against the norm's
  backward followed by the addition, and against torch's autograd followed by it; its
  floor is the backward's (``grad_y + x``, by bandwidth).
* ``--quantize FORMAT``: every forward cell also times the call quantized into a
  preallocated 8-bit ``out=`` (per-row scales, and a given scale), reported against the
  plain call into ``out=`` (``vs base``: its time over the plain one's); their bytes
  count the 8-bit output.
* After every ``fresh`` measurement, when torch is installed on glibc, a second pass
  switches malloc to reuse freed memory (see :mod:`.impls`) and times torch and
  us again in that regime.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from . import impls as impls_mod
from .impls import (
    COPY,
    FRESH,
    HEAP_REUSE,
    MEMORY,
    OURS,
    OURS_FRESH,
    OURS_OUT,
    PEER,
    PREALLOC,
    Case,
    Impl,
)
from .machine import installed
from .settings import Settings
from .timing import rotating, time_interleaved

# --------------------------------------------------------------------------- progress


class Progress:
    """tqdm when installed, else a one-line bar on stderr."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if enabled and installed("tqdm"):
            from tqdm import tqdm

            self._bar = tqdm(total=total, file=sys.stderr, unit="cell", leave=False,
                             dynamic_ncols=True)

    def update(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description(label, refresh=False)
            self._bar.update(1)
            return
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] "
                         f"{self.done}/{self.total} {label[:40]:<40}")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\r" + " " * 90 + "\r")
            sys.stderr.flush()


# --------------------------------------------------------------------------- one cell


def set_threads(threads: int) -> None:
    """Thread count for Numba and, when loaded, torch."""
    import numba

    numba.set_num_threads(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def summarize(case: Case, impls: Sequence[Impl], timings: dict[str, dict[str, Any]],
              threads: int, phase: str) -> list[dict[str, Any]]:
    """One record per implementation, with GB/s, % of the best copy and speed-up."""
    # The floor: the best preallocated baseline that moves the operation's own bytes.
    floor_arrays = impls_mod.floor_arrays(case.op, case.direction)
    best_copy, best_copy_gbps = None, 0.0
    for impl in impls:
        t = timings[impl.name]
        if (impl.kind == COPY and impl.output == PREALLOC and "median_s" in t
                and impl.arrays == floor_arrays):
            gbps = impl.arrays * case.array_bytes / t["median_s"] / 1e9
            if gbps > best_copy_gbps:
                best_copy, best_copy_gbps = impl.name, gbps
    ours_by_output = {
        impl.output: timings[impl.name].get("median_s")
        for impl in impls if impl.kind == OURS and impl.name in (OURS_FRESH, OURS_OUT)
    }
    records = []
    for impl in impls:
        t = timings[impl.name]
        if impl.kind == COPY:
            moved = impl.arrays * case.array_bytes
        else:
            moved = case.moved_bytes if impl.moved is None else impl.moved
        rec: dict[str, Any] = {
            "op": case.op, "direction": case.direction, "dtype": case.dtype,
            "shape": list(case.shape), "threads": threads, "phase": phase,
            "regime": case.extras.get("regime", MEMORY), "sets": case.extras.get("sets", 1),
            "working_set_bytes": case.working_set_bytes,
            "impl": impl.name, "kind": impl.kind, "output": impl.output, "note": impl.note,
            "bytes": moved, "copy_impl": best_copy, "copy_gbps": best_copy_gbps or None,
        }
        if "error" in t:
            rec["error"] = t["error"]
            records.append(rec)
            continue
        median = t["median_s"]
        gbps = moved / median / 1e9
        ours = ours_by_output.get(impl.output)
        rec.update(
            median_s=median, min_s=t["min_s"], p90_s=t.get("p90_s"), us=median * 1e6,
            samples_s=t["samples_s"],
            number=t["number"], gbps=gbps,
            pct_copy=(100.0 * gbps / best_copy_gbps) if best_copy_gbps else None,
            best_copy=impl.name == best_copy,
            speedup=(median / ours) if impl.kind == PEER and ours else None,
        )
        base = timings.get(impl.relative_to, {}).get("median_s")
        if base:
            rec.update(relative_to=impl.relative_to, vs_base=median / base)
        records.append(rec)
    return records


# --------------------------------------------------------------------------- the run


def _cases(settings: Settings) -> list[tuple[str, str, str, str, tuple[int, int]]]:
    # A fusion's backward cell is its norm's backward with grad_residual.
    return [(regime, op, direction, dtype, shape)
            for regime in settings.regimes
            for direction in settings.directions for op in settings.ops
            for dtype in settings.dtypes for shape in settings.shapes]


def time_cell(impls: Sequence[Impl], repeats: int, target_s: float
              ) -> dict[str, dict[str, Any]]:
    """:func:`.timing.time_interleaved` over the implementations of one cell, by name."""
    fns = {impl.name: impl.fn for impl in impls}
    if len(fns) != len(impls):
        names = [impl.name for impl in impls]
        raise ValueError(f"implementations of one cell need distinct names; got {names}")
    return time_interleaved(fns, repeats, target_s)


def build_impls(case: Case, phase: str) -> list[Impl]:
    """Implementations timed together for one cell in one phase."""
    impls = impls_mod.copy_impls(case)
    if phase == FRESH:
        return impls + impls_mod.ours_impls(case, FRESH) + impls_mod.peer_impls(case)
    impls = [i for i in impls if i.output == PREALLOC]
    ours = [i for i in impls_mod.ours_impls(case, HEAP_REUSE) if i.output == HEAP_REUSE]
    return impls + ours + impls_mod.torch_impls(case, HEAP_REUSE)


def build_regime_impls(cases: Sequence[Case], phase: str) -> list[Impl]:
    """:func:`build_impls` for each input set of a cell, each implementation's calls
    rotating over the sets (one set: its implementations as they are)."""
    per_set = [build_impls(case, phase) for case in cases]
    if len(per_set) == 1:
        return per_set[0]
    names = [impl.name for impl in per_set[0]]
    for impls in per_set[1:]:
        if [impl.name for impl in impls] != names:
            raise RuntimeError(f"input sets of one cell built different implementations: "
                               f"{names} and {[impl.name for impl in impls]}")
    return [replace(impl, fn=rotating([impls[i].fn for impls in per_set]))
            for i, impl in enumerate(per_set[0])]


def run(settings: Settings, progress: bool = True) -> dict[str, Any]:
    """Run the whole grid; returns ``{"settings", "phases", "results"}``."""
    cells = _cases(settings)
    phases = [FRESH]
    if settings.heap_reuse and installed("torch") and impls_mod.heap_reuse_available():
        phases.append(HEAP_REUSE)
    if installed("torch"):
        import torch  # noqa: F401  (so set_threads reaches it)
    bar = Progress(len(phases) * len(settings.threads) * len(cells), progress)
    results: list[dict[str, Any]] = []
    try:
        for phase in phases:
            if phase == HEAP_REUSE and not impls_mod.enable_heap_reuse():
                break
            for threads in settings.threads:
                set_threads(threads)
                for regime, op, direction, dtype, shape in cells:
                    label = f"{regime} {op} {direction} {dtype} {shape[0]}x{shape[1]} " \
                            f"t={threads} {phase}"
                    sets = impls_mod.regime_cases(op, direction, dtype, shape, regime)
                    if not sets:
                        bar.update(label)
                        continue
                    for case in sets:
                        case.extras["threads"] = threads
                        case.extras["quantize"] = settings.quantize
                    impls = build_regime_impls(sets, phase)
                    timings = time_cell(impls, settings.repeats, settings.target_s)
                    results += summarize(sets[0], impls, timings, threads, phase)
                    bar.update(label)
                    del sets, impls, timings
    finally:
        bar.close()
    return {"settings": asdict(settings), "phases": phases, "results": results}
