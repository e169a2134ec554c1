"""
Performance: GB/s against row length
====================================

LayerNorm reads every element once and writes it once, so its speed limit is memory
bandwidth, not arithmetic. This page runs ``python -m layernorm bench`` on a small grid
(4 MiB of float32 per array, rows of 64 to 32768 elements) *while the documentation is
built*, and plots the achieved bandwidth of this library and of the installed peers
against the row length. The dashed lines are plain copies of the same bytes: the
practical ceiling.

The numbers are from the machine that built these pages, measured quickly; run the
command on your own machine for yours (see :doc:`/benchmarks`).
"""

# %%
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

shapes = "16384,64 2048,512 256,4096 32,32768"  # N,D pairs: N x D = 2**20 elements each
args = f"bench --quick --op layer_norm --dtype float32 --shape {shapes} --repeats 3".split()
args.append("--no-progress")
print("$ python -m layernorm", " ".join(args), "--json bench.json")
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "layernorm", *args, "--json", str(path)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"`python -m layernorm bench` failed:\n{proc.stderr}")
    report = json.loads(path.read_text())
print(f"{len(report['results'])} measurements in {report['elapsed_s']:.0f} s")

# %%
# One line per implementation
# ---------------------------
# Each record of the JSON report is one (implementation, shape) measurement. We keep the
# first measurement phase ("fresh": a new output array per call, as user code does, plus
# the preallocated ``out=`` variants timed alongside) and summarize the copies by the
# best preallocated copy at each row length: the ceiling.
lines, ceiling = {}, {}
first_phase = report["phases"][0]
for rec in report["results"]:
    if rec["phase"] != first_phase or "gbps" not in rec:
        continue
    d = rec["shape"][1]
    if rec["kind"] == "copy":
        if rec["output"] == "prealloc":
            ceiling[d] = max(ceiling.get(d, 0.0), rec["gbps"])
        continue
    label = rec["impl"] if rec["output"] == "fresh" else f"{rec['impl']} ({rec['output']})"
    lines.setdefault(label, {})[d] = rec["gbps"]

row_lengths = sorted(ceiling)
print(f"{'GB/s':36s}" + "".join(f"{'D=' + str(d):>9s}" for d in row_lengths))
for label, points in [("best copy (ceiling)", ceiling), *sorted(lines.items())]:
    cells = "".join(f"{points.get(d, float('nan')):9.1f}" for d in row_lengths)
    print(f"{label:36s}{cells}")
print("(bytes of x read plus bytes of y written, per second)")

# %%
# The plot
# --------
fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
ds = sorted(ceiling)
ax.plot(ds, [ceiling[d] for d in ds], "k--", label="best copy (ceiling)")
for label, points in sorted(lines.items()):
    ds = sorted(points)
    ours = label.startswith("layernorm")
    ax.plot(
        ds,
        [points[d] for d in ds],
        "-o" if ours else "-s",
        markersize=4,
        linewidth=2.2 if ours else 1.2,
        label=label,
    )
threads = report["settings"]["threads"][0]
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("row length D (4 MiB float32 arrays: N x D = 2**20)")
ax.set_ylabel("GB/s (higher is better)")
ax.set_title(f"layer_norm forward, float32, {threads} thread(s)")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
plt.show()

machine = report.get("machine") or {}
cpu, thr = machine.get("cpu") or {}, machine.get("threads") or {}
print(
    f"CPU: {cpu.get('model', '?')}, {cpu.get('logical_cores', '?')} logical cores; "
    f"Numba threads: {thr.get('numba_threads_in_use', '?')} "
    f"(threading layer {thr.get('layer', '?')})"
)
