"""What a ``bench`` run shows: the printed tables, the JSON file and the plot."""

from __future__ import annotations

import json
import math
from typing import Any

from . import noise
from .impls import CACHE, CACHE_BYTES, COPY, FRESH, HEAP_REUSE, MEMORY, MEMORY_BYTES, TITLES

#: Section headings of the data regimes.
REGIME_TITLES = {
    CACHE: f"cache-resident (one working set of <= {CACHE_BYTES / 1e6:.1f} MB, reused)",
    MEMORY: f"DRAM-resident (inputs rotated over > {MEMORY_BYTES >> 20} MiB)",
}


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def format_table(report: dict[str, Any]) -> str:
    """The printed report: one table per (phase, data regime, threads, operation, dtype)."""
    lines: list[str] = []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for rec in report["results"]:
        key = (rec["phase"], rec.get("regime", MEMORY), rec["threads"], rec["op"],
               rec["direction"], rec["dtype"])
        groups.setdefault(key, []).append(rec)
    plain_header = (f"{'shape':>11}  {'implementation':<27} {'output':<11} {'µs':>9} "
                    f"{'GB/s':>7} {'% copy':>7} {'speed-up':>9}")
    for (phase, data, threads, op, direction, dtype), recs in groups.items():
        # A column of time against a base implementation, where the group has one.
        relative = any(rec.get("vs_base") for rec in recs)
        header = plain_header + (f" {'vs base':>8}" if relative else "")
        name = TITLES[op]
        outputs = ("outputs as they come" if phase == FRESH
                   else "malloc reuses freed memory (no mmap, no trim)")
        lines += ["", f"{name} {direction}, {dtype}, {threads} thread(s); "
                      f"{REGIME_TITLES.get(data, data)}; {outputs}",
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
                lines.append(f"{label:>11}  {impl:<27} {rec['output']:<11} "
                             f"failed: {rec['error'][:60]}")
                continue
            speed = f"{rec['speedup']:.2f}" if rec.get("speedup") else ""
            vs_base = f" {rec['vs_base']:>8.2f}" if rec.get("vs_base") else ""
            lines.append(
                f"{label:>11}  {impl:<27} {rec['output']:<11} {_fmt(rec['us'], 2):>9} "
                f"{_fmt(rec['gbps']):>7} {_fmt(rec['pct_copy']):>7} {speed:>9}{vs_base}")
        lines.extend(_summary_lines(recs))
        lines.extend(_relative_lines(recs))
    lines += [
        "",
        "GB/s: forward reads x and writes y (add + norm: also reads the residual and "
        "writes h); backward reads grad_y, x and writes grad_x.",
        "% copy: of the best preallocated baseline moving the same bytes in the same data "
        "regime, timed in the same rounds (marked *): a copy for forward (add + norm: "
        "x and the residual copied, timed as one), grad_y + x into out= for backward.",
        "Data regimes: cache = one working set reused (rows cut to fit; bound by "
        "arithmetic); memory = the shape as given, inputs rotated over copies so every "
        "call reads from DRAM (bound by bandwidth; single rows are too small for it).",
        "speed-up: the peer's time / layernorm numba's with the same data and output "
        "regimes (prealloc: layernorm numba out=; >1: layernorm is faster).",
        "vs base: a variant's time / the call it extends, same cell and rounds (quantized "
        "into out= / the plain call into out=; backward with grad_residual / without it; "
        "< 1.10 and < 1.15 are the fusion issue's targets).",
        "Output regimes: prealloc = into memory allocated before timing (out=); fresh = a new "
        "output per call; heap reuse = fresh, with freed memory reused by malloc.",
        "Medians of interleaved rounds; JAX uses XLA's own threads whatever --threads says.",
    ]
    # The verdict on the machine, always: a reader must see whether to trust the table.
    lines += ["", *noise.assess(report).lines()]
    return "\n".join(lines)


def _summary_lines(recs: list[dict[str, Any]]) -> list[str]:
    by_peer: dict[tuple[str, str], list[float]] = {}
    for rec in recs:
        if rec.get("speedup"):
            by_peer.setdefault((rec["impl"], rec["output"]), []).append(rec["speedup"])
    if not by_peer:
        return []
    parts = [f"{name} ({regime}) {min(v):.2f}-{max(v):.2f}x"
             for (name, regime), v in by_peer.items()]
    return ["  layernorm vs " + "; ".join(parts)]


def _relative_lines(recs: list[dict[str, Any]]) -> list[str]:
    """The range of each variant's time over its base's across the group's shapes."""
    by_variant: dict[str, list[float]] = {}
    for rec in recs:
        if rec.get("vs_base"):
            by_variant.setdefault(rec["impl"], []).append(rec["vs_base"])
    if not by_variant:
        return []
    parts = [f"{name} {min(v):.2f}-{max(v):.2f}x" for name, v in by_variant.items()]
    return ["  time vs base: " + "; ".join(parts)]


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
        key = (rec["op"], rec["direction"], rec["dtype"], rec["threads"],
               rec.get("regime", MEMORY))
        line = panels.setdefault(key, {}).setdefault((rec["impl"], rec["output"]), {})
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
        op, direction, dtype, threads, data = key
        for (impl, regime), points in sorted(panels[key].items()):
            ds = sorted(points)
            i = labels.index((impl, regime))
            style = "--" if impl.startswith("copy") else "-"
            ax.plot(ds, [points[d][1] for d in ds], style, color=colors(i % 20),
                    marker=markers[i % len(markers)], markersize=4, label=f"{impl} [{regime}]")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("row length D")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{op} {direction} {dtype}, {threads} thread(s), {data}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    verdict = noise.assess(report)
    if verdict.noisy:
        # A figure travels without its table: it must carry the warning itself.
        fig.suptitle(f"NOISY run ({verdict.summary()}):\nthese numbers may understate "
                     "the library", color="red", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

