"""
Performance: GB/s against row length
====================================

LayerNorm reads every element once and writes it once. Whether memory bandwidth or
arithmetic limits it depends on where the data is, so this page measures both regimes of
``python -m layernorm bench``: **memory** (inputs rotated over more than 128 MiB, so every
call reads from DRAM: the ceiling is a copy of the same bytes) and **cache** (one working
set of at most 1.5 MB, reused: the copy runs from cache too, and the arithmetic shows).
It runs a small grid (rows of 64 to 32768 float32 elements) *while the documentation is
built*, and plots the bandwidth of this library and of the installed peers against the
row length. The dashed lines are plain copies of the same bytes in the same regime.

Numbers measured on a busy machine mean little. The page therefore checks the machine
it runs on (the load average against the cores, before and after, and the spread of the
timed rounds) and says so, in a note below and on the figure, when the build was noisy.
Run the command on your own machine for your numbers (see :doc:`/benchmarks`).
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
# Was the machine quiet?
# ----------------------
# Two signs of other processes taking the cores: a 1-minute load average above the
# number of cores (before or after the run), and rounds that disagree (each measurement
# keeps its 90th-percentile round and its median: on a quiet machine their ratio stays
# near 1). Either one makes every number below suspect, so the page says so
# (``layernorm.bench.report.noise`` applies the thresholds: a load above 0.75 per core,
# a median spread above 1.25).
from layernorm.bench.report import noise

busy = noise(report)
noisy, summary = busy["noisy"], busy["text"]
if noisy:
    banner = "!" * 78
    print(banner)
    print("NOTE: this page was built on a BUSY machine, and its numbers show it.")
    print(f"      {summary}")
    print("      Other processes took the cores during the measurement: the library's")
    print("      speed below can be many times lower than on a quiet machine. Run")
    print("      `python -m layernorm bench` on your own (idle) machine for real numbers.")
    print(banner)
else:
    print(f"Quiet build machine: {summary}")

# %%
# One line per implementation and regime
# --------------------------------------
# Each record of the JSON report is one (implementation, shape, regime) measurement. We
# keep the first measurement phase ("fresh": a new output array per call, as user code
# does, plus the preallocated ``out=`` variants timed alongside) and summarize the copies
# by the best preallocated copy at each row length: the ceiling of that regime.
regimes = [r for r in ("memory", "cache") if r in report["settings"]["regimes"]]
lines = {regime: {} for regime in regimes}
ceiling = {regime: {} for regime in regimes}
first_phase = report["phases"][0]
for rec in report["results"]:
    if rec["phase"] != first_phase or "gbps" not in rec:
        continue
    regime, d = rec["regime"], rec["shape"][1]
    if rec["kind"] == "copy":
        if rec["output"] == "prealloc":
            ceiling[regime][d] = max(ceiling[regime].get(d, 0.0), rec["gbps"])
        continue
    label = rec["impl"] if rec["output"] == "fresh" else f"{rec['impl']} ({rec['output']})"
    lines[regime].setdefault(label, {})[d] = rec["gbps"]

for regime in regimes:
    row_lengths = sorted(ceiling[regime])
    header = "".join(f"{'D=' + str(d):>9s}" for d in row_lengths)
    print(f"\n{regime + ' regime, GB/s':36s}{header}")
    rows = [("best copy (ceiling)", ceiling[regime]), *sorted(lines[regime].items())]
    for label, points in rows:
        cells = "".join(f"{points.get(d, float('nan')):9.1f}" for d in row_lengths)
        print(f"{label:36s}{cells}")
print("\n(bytes of x read plus bytes of y written, per second)")

# %%
# The plot
# --------
fig, axes = plt.subplots(
    1, len(regimes), figsize=(6.5 * len(regimes), 4.8), layout="constrained", squeeze=False
)
threads = report["settings"]["threads"][0]
for ax, regime in zip(axes[0], regimes, strict=True):
    ds = sorted(ceiling[regime])
    ax.plot(ds, [ceiling[regime][d] for d in ds], "k--", label="best copy (ceiling)")
    for label, points in sorted(lines[regime].items()):
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
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("row length D")
    ax.set_ylabel("GB/s (higher is better)")
    where = "DRAM-resident, 4 MiB arrays" if regime == "memory" else "cache-resident, <= 1.5 MB"
    ax.set_title(f"{regime}: {where}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
title = f"layer_norm forward, float32, {threads} thread(s)"
if noisy:
    fig.suptitle(
        f"{title}\nMEASURED ON A BUSY MACHINE ({summary}):\n"
        "these numbers understate the library",
        color="red",
        fontsize=10,
    )
else:
    fig.suptitle(title)
plt.show()

machine = report.get("machine") or {}
cpu, thr = machine.get("cpu") or {}, machine.get("threads") or {}
print(
    f"CPU: {cpu.get('model', '?')}, {cpu.get('logical_cores', '?')} logical cores; "
    f"Numba threads: {thr.get('numba_threads_in_use', '?')} "
    f"(threading layer {thr.get('layer', '?')})"
)
