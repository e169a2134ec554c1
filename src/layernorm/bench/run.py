"""``python -m layernorm bench``: layernorm against the copy floor and the peers.

How it measures
---------------
* Every grid cell (operation, direction, dtype, shape, thread count) builds its inputs
  once (seeded), then times every implementation **interleaved**: round ``r`` calls each
  implementation once in turn (order reversed on odd rounds), so drift in clock speed
  or in a noisy neighbour hits all of them alike. Each timed sample runs the callable
  ``number`` times, ``number`` calibrated so a sample lasts about ``target_s``; the
  reported time is the median over rounds.
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
  (``fresh`` with ``fresh``, ``heap reuse`` with ``heap reuse``); > 1 means we are faster.
* After every ``fresh`` measurement, when torch is installed on glibc, a second pass
  switches malloc to reuse freed memory (see :mod:`.impls`) and times torch and
  us again in that regime.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from . import impls as impls_mod
from .cli import UsageError, installed
from .impls import COPY, OURS, PEER, Case, Impl

#: Rows of 64 to 16384, output sizes from cache-resident to the page-fault regime.
FULL_SHAPES = (
    (1, 768), (65536, 64), (16384, 256), (4096, 768), (8192, 1024), (2048, 4096),
    (512, 16384), (16384, 2048),
)
QUICK_SHAPES = ((1, 768), (65536, 64), (4096, 768), (8192, 1024))

FRESH, HEAP_REUSE = "fresh", "heap reuse"


@dataclass
class Settings:
    """What one ``bench`` run measures."""

    ops: tuple[str, ...]
    directions: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    threads: tuple[int, ...]
    repeats: int
    target_s: float
    heap_reuse: bool = True


def _split(values: Iterable[str] | None) -> list[str]:
    out: list[str] = []
    for value in values or ():
        out += [v.strip() for v in value.split(",") if v.strip()]
    return out


def parse_shape(text: str) -> tuple[int, int]:
    """``"N,D"`` (or ``NxD``) -> ``(N, D)``.

    Examples
    --------
    >>> parse_shape("4096,768")
    (4096, 768)
    >>> parse_shape("1x64")
    (1, 64)
    """
    parts = text.lower().replace("x", ",").split(",")
    try:
        n, d = (int(p) for p in parts)
    except ValueError:
        raise UsageError(f"--shape takes N,D with two positive integers; got {text!r}") from None
    if n < 1 or d < 1:
        raise UsageError(f"--shape takes N,D with two positive integers; got {text!r}")
    return n, d


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate the command line into :class:`Settings`."""
    import numba

    shapes = tuple(parse_shape(s) for s in args.shape or ()) or (
        QUICK_SHAPES if args.quick else FULL_SHAPES)
    dtypes = tuple(_split(args.dtype)) or ("float32",)
    for dt in dtypes:
        if dt not in impls_mod.DTYPES:
            raise UsageError(f"--dtype must be among {', '.join(impls_mod.DTYPES)}; got {dt!r}")
    ops = tuple(_split(args.op)) or impls_mod.OPS
    for op in ops:
        if op not in impls_mod.OPS:
            raise UsageError(f"--op must be among {', '.join(impls_mod.OPS)}; got {op!r}")
    available = numba.config.NUMBA_NUM_THREADS
    try:
        threads = tuple(int(t) for t in _split(args.threads)) or (numba.get_num_threads(),)
    except ValueError:
        raise UsageError(f"--threads takes integers like 1,2; got {args.threads!r}") from None
    for t in threads:
        if not 1 <= t <= available:
            raise UsageError(
                f"--threads must be between 1 and {available} (NUMBA_NUM_THREADS); got {t}")
    repeats = args.repeats or (5 if args.quick else 11)
    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1; got {repeats}")
    directions = ("forward", "backward") if args.backward else ("forward",)
    return Settings(ops, directions, dtypes, shapes, threads, repeats,
                    target_s=0.002 if args.quick else 0.01)


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


# --------------------------------------------------------------------------- timing


def set_threads(threads: int) -> None:
    """Thread count for Numba and, when loaded, torch."""
    import numba

    numba.set_num_threads(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def _time_calls(fn: Callable[[], Any], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def time_interleaved(impls: Sequence[Impl], repeats: int, target_s: float
                     ) -> dict[str, dict[str, Any]]:
    """Warm up and calibrate each implementation, then time them round-robin.

    Returns, per implementation name, ``median_s``, ``min_s``, ``samples_s`` and
    ``number`` (calls per sample), or ``error`` when it failed in warm-up.
    """
    out: dict[str, dict[str, Any]] = {}
    live: list[tuple[Impl, int]] = []
    for impl in impls:
        try:
            impl.fn()  # first call: compiles (Numba, XLA), builds caches
            t = _time_calls(impl.fn, 1)
        except Exception as exc:
            out[impl.name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        number = 1 if t >= target_s else min(100_000, math.ceil(target_s / max(t, 1e-9)))
        live.append((impl, number))
        out[impl.name] = {"number": number, "samples_s": []}
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            for impl, number in (live if r % 2 == 0 else reversed(live)):
                out[impl.name]["samples_s"].append(_time_calls(impl.fn, number))
    finally:
        if enabled:
            gc.enable()
    for impl, _ in live:
        samples = out[impl.name]["samples_s"]
        out[impl.name]["median_s"] = statistics.median(samples)
        out[impl.name]["min_s"] = min(samples)
    return out


def summarize(case: Case, impls: Sequence[Impl], timings: dict[str, dict[str, Any]],
              threads: int, phase: str) -> list[dict[str, Any]]:
    """One record per implementation, with GB/s, % of the best copy and speed-up."""
    # The floor: the best preallocated baseline that moves the operation's own bytes.
    floor_arrays = case.moved_bytes // case.array_bytes if case.array_bytes else 2
    best_copy, best_copy_gbps = None, 0.0
    for impl in impls:
        t = timings[impl.name]
        if (impl.kind == COPY and impl.regime == "prealloc" and "median_s" in t
                and impl.arrays == floor_arrays):
            gbps = impl.arrays * case.array_bytes / t["median_s"] / 1e9
            if gbps > best_copy_gbps:
                best_copy, best_copy_gbps = impl.name, gbps
    ours_by_regime = {
        impl.regime: timings[impl.name].get("median_s")
        for impl in impls if impl.kind == OURS and impl.name == "layernorm numba"
    }
    records = []
    for impl in impls:
        t = timings[impl.name]
        moved = impl.arrays * case.array_bytes if impl.kind == COPY else case.moved_bytes
        rec: dict[str, Any] = {
            "op": case.op, "direction": case.direction, "dtype": case.dtype,
            "shape": list(case.shape), "threads": threads, "phase": phase,
            "impl": impl.name, "kind": impl.kind, "regime": impl.regime, "note": impl.note,
            "bytes": moved, "copy_impl": best_copy, "copy_gbps": best_copy_gbps or None,
        }
        if "error" in t:
            rec["error"] = t["error"]
            records.append(rec)
            continue
        median = t["median_s"]
        gbps = moved / median / 1e9
        ours = ours_by_regime.get(impl.regime)
        rec.update(
            median_s=median, min_s=t["min_s"], us=median * 1e6, samples_s=t["samples_s"],
            number=t["number"], gbps=gbps,
            pct_copy=(100.0 * gbps / best_copy_gbps) if best_copy_gbps else None,
            best_copy=impl.name == best_copy,
            speedup=(median / ours) if impl.kind == PEER and ours else None,
        )
        records.append(rec)
    return records


# --------------------------------------------------------------------------- the run


def _cases(settings: Settings) -> list[tuple[str, str, str, tuple[int, int]]]:
    return [(op, direction, dtype, shape)
            for direction in settings.directions for op in settings.ops
            for dtype in settings.dtypes for shape in settings.shapes]


def build_impls(case: Case, phase: str) -> list[Impl]:
    """Implementations timed together for one cell in one phase."""
    impls = impls_mod.copy_impls(case)
    if phase == FRESH:
        return impls + impls_mod.ours_impls(case, FRESH) + impls_mod.peer_impls(case)
    impls = [i for i in impls if i.regime == "prealloc"]
    ours = [i for i in impls_mod.ours_impls(case, HEAP_REUSE) if i.regime == HEAP_REUSE]
    return impls + ours + impls_mod.torch_impls(case, HEAP_REUSE)


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
                for op, direction, dtype, shape in cells:
                    case = impls_mod.make_case(op, direction, dtype, shape)
                    case.extras["threads"] = threads
                    impls = build_impls(case, phase)
                    timings = time_interleaved(impls, settings.repeats, settings.target_s)
                    results += summarize(case, impls, timings, threads, phase)
                    bar.update(f"{case.title} {shape[0]}x{shape[1]} t={threads} {phase}")
                    del case, impls, timings
    finally:
        bar.close()
    return {"settings": asdict(settings), "phases": phases, "results": results}


# --------------------------------------------------------------------------- output


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def format_table(report: dict[str, Any]) -> str:
    """The printed report: one table per (phase, threads, operation, dtype)."""
    lines: list[str] = []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for rec in report["results"]:
        key = (rec["phase"], rec["threads"], rec["op"], rec["direction"], rec["dtype"])
        groups.setdefault(key, []).append(rec)
    header = (f"{'shape':>11}  {'implementation':<27} {'regime':<11} {'µs':>9} "
              f"{'GB/s':>7} {'% copy':>7} {'speed-up':>9}")
    for (phase, threads, op, direction, dtype), recs in groups.items():
        name = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm"}[op]
        regime = ("outputs as they come" if phase == FRESH
                  else "malloc reuses freed memory (no mmap, no trim)")
        lines += ["", f"{name} {direction}, {dtype}, {threads} thread(s); {regime}",
                  header, "-" * len(header)]
        last_shape = None
        for rec in recs:
            shape = "x".join(str(s) for s in rec["shape"])
            if last_shape is not None and shape != last_shape:
                lines.append("")
            label = shape if shape != last_shape else ""
            last_shape = shape
            impl = rec["impl"] + (" *" if rec.get("best_copy") else "")
            if "error" in rec:
                lines.append(f"{label:>11}  {impl:<27} {rec['regime']:<11} "
                             f"failed: {rec['error'][:60]}")
                continue
            speed = f"{rec['speedup']:.2f}" if rec.get("speedup") else ""
            lines.append(
                f"{label:>11}  {impl:<27} {rec['regime']:<11} {_fmt(rec['us'], 2):>9} "
                f"{_fmt(rec['gbps']):>7} {_fmt(rec['pct_copy']):>7} {speed:>9}")
        lines.extend(_summary_lines(recs))
    lines += [
        "",
        "GB/s: forward reads x and writes y; backward reads grad_y, x and writes grad_x.",
        "% copy: of the best preallocated baseline moving the same bytes, timed in the same "
        "rounds (marked *): a copy for forward, grad_y + x into out= for backward.",
        "speed-up: the peer's time / layernorm numba's with the same output regime "
        "(>1: layernorm is faster).",
        "Regimes: prealloc = into memory allocated before timing (out=); fresh = a new "
        "output per call; heap reuse = fresh, with freed memory reused by malloc.",
        "Medians of interleaved rounds; JAX uses XLA's own threads whatever --threads says.",
    ]
    return "\n".join(lines)


def _summary_lines(recs: list[dict[str, Any]]) -> list[str]:
    by_peer: dict[tuple[str, str], list[float]] = {}
    for rec in recs:
        if rec.get("speedup"):
            by_peer.setdefault((rec["impl"], rec["regime"]), []).append(rec["speedup"])
    if not by_peer:
        return []
    parts = [f"{name} ({regime}) {min(v):.2f}-{max(v):.2f}x"
             for (name, regime), v in by_peer.items()]
    return ["  layernorm vs " + "; ".join(parts)]


def write_json(report: dict[str, Any], path: str) -> None:
    """Write the report (settings, machine, every measurement) as JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)


def plot(report: dict[str, Any], path: str) -> None:
    """GB/s against row length, one line per implementation (matplotlib, lazily)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple, dict[tuple[str, str], dict[int, tuple[int, float]]]] = {}
    for rec in report["results"]:
        if "gbps" not in rec:
            continue
        if rec["phase"] == HEAP_REUSE and rec["kind"] == COPY:
            continue
        key = (rec["op"], rec["direction"], rec["dtype"], rec["threads"])
        line = panels.setdefault(key, {}).setdefault((rec["impl"], rec["regime"]), {})
        n, d = rec["shape"]
        # One point per row length: the shape with the most rows (a single row is latency).
        if d not in line or line[d][0] < n:
            line[d] = (n, rec["gbps"])
    keys = sorted(panels)
    cols = min(2, len(keys))
    rows = math.ceil(len(keys) / cols)
    labels = sorted({line for panel in panels.values() for line in panel})
    colors = plt.get_cmap("tab20")
    markers = "os^vD<>ph*"
    fig, axes = plt.subplots(rows, cols, figsize=(9.5 * cols, 4.5 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        op, direction, dtype, threads = key
        for (impl, regime), points in sorted(panels[key].items()):
            ds = sorted(points)
            i = labels.index((impl, regime))
            style = "--" if impl.startswith("copy") else "-"
            ax.plot(ds, [points[d][1] for d in ds], style, color=colors(i % 20),
                    marker=markers[i % len(markers)], markersize=4, label=f"{impl} [{regime}]")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("row length D")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{op} {direction} {dtype}, {threads} thread(s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- entry


def header() -> str:
    """One line on the machine and the libraries being compared."""
    from .cli import cpu_info, versions

    cpu = cpu_info()
    ver = versions()
    libs = ", ".join(f"{name} {ver[name]}" for name in
                     ("layernorm", "numpy", "numba", "torch", "jax", "onnxruntime", "dask")
                     if ver.get(name))
    line = f"{cpu['model']}, {cpu['logical_cores']} logical cores; {libs}"
    if hasattr(os, "getloadavg") and cpu["logical_cores"]:
        load = os.getloadavg()[0]
        if load > 0.5 * cpu["logical_cores"]:
            line += (f"\nwarning: the machine is busy (load average {load:.1f} on "
                     f"{cpu['logical_cores']} cores): other processes will add noise, "
                     "most of all at more than one thread")
    return line



def _main_roofline(args: argparse.Namespace, settings: Settings, report: dict[str, Any],
                   started: float) -> int:
    from . import roofline

    for flag in ("dask", "plot", "dtype", "op", "threads"):
        if getattr(args, flag, None):
            raise UsageError(f"--roofline measures the float32 LayerNorm (forward, or "
                              f"backward with --backward) on one thread; it takes no "
                              f"--{flag}")
    shapes = [s for s in settings.shapes if s[0] > 1] or list(settings.shapes)
    bar = Progress(len(shapes), enabled=not args.no_progress)
    try:
        results = roofline.run(shapes, settings.repeats, settings.target_s, bar.update,
                                      backward=args.backward)
    finally:
        bar.close()
    print(roofline.format_report(results))
    report["roofline"] = results
    report["elapsed_s"] = time.perf_counter() - started
    if args.json:
        write_json(report, args.json)
        print(f"\nwrote {args.json}")
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``bench`` from parsed command-line arguments."""
    settings = settings_from_args(args)
    started = time.perf_counter()
    report: dict[str, Any] = {"results": [], "phases": []}
    print(header())
    if getattr(args, "roofline", False):
        return _main_roofline(args, settings, report, started)
    if not args.dask:
        report = run(settings, progress=not args.no_progress)
        print(format_table(report))
    else:
        from .dask import format_dask, run_dask

        report["dask"] = run_dask(quick=args.quick, repeats=min(settings.repeats, 5))
        print(format_dask(report["dask"]))
    from .cli import collect_info

    report["machine"] = collect_info(probe=False)
    report["elapsed_s"] = time.perf_counter() - started
    if args.json:
        write_json(report, args.json)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
