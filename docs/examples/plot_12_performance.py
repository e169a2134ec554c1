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
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

SHAPES = ["16384,64", "2048,512", "256,4096", "32,32768"]
command = [
    sys.executable,
    "-m",
    "layernorm",
    "bench",
    "--quick",
    "--op",
    "layer_norm",
    "--dtype",
    "float32",
    "--shape",
    *SHAPES,
    "--repeats",
    "3",
    "--no-progress",
]

report = None
if importlib.util.find_spec("layernorm._bench") is None:
    print("This version of layernorm has no `bench` command yet; nothing to plot.")
else:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        print("$ python -m layernorm bench", " ".join(command[4:]), "--json bench.json")
        subprocess.run([*command, "--json", str(path)], check=True, capture_output=True, text=True)
        report = json.loads(path.read_text())

# %%
# Gather one line per implementation
# ----------------------------------
# Each record of the JSON report is one (implementation, shape) measurement. We keep the
# first measurement phase ("fresh": a new output array per call, as user code does)
# plus the preallocated (``out=``) variants that phase also times.
lines = {}
if report is not None:
    first_phase = report["phases"][0]
    for rec in report["results"]:
        if rec["phase"] != first_phase or "gbps" not in rec:
            continue
        label = f"{rec['impl']} [{rec['regime']}]"
        lines.setdefault(label, {"kind": rec["kind"], "points": {}})
        lines[label]["points"][rec["shape"][1]] = rec["gbps"]

    row_lengths = sorted({d for line in lines.values() for d in line["points"]})
    print(f"{'implementation':42s}" + "".join(f"{'D=' + str(d):>9s}" for d in row_lengths))
    for label, line in sorted(lines.items()):
        cells = "".join(f"{line['points'].get(d, float('nan')):9.1f}" for d in row_lengths)
        print(f"{label:42s}{cells}")
    print("(GB/s: bytes of x read plus bytes of y written, per second)")

# %%
# The plot
# --------
if lines:
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    for label, line in sorted(lines.items()):
        ds = sorted(line["points"])
        is_copy = line["kind"] == "copy"
        ax.plot(
            ds,
            [line["points"][d] for d in ds],
            "--" if is_copy else "-o",
            markersize=4,
            label=label,
            alpha=0.6 if is_copy else 1.0,
        )
    machine = report.get("machine", {})
    threads = report["settings"]["threads"][0]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("row length D (elements normalized together)")
    ax.set_ylabel("GB/s (higher is better)")
    ax.set_title(f"layer_norm forward, float32, 4 MiB per array, {threads} thread(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    plt.show()
    cpu, thr = machine.get("cpu") or {}, machine.get("threads") or {}
    print(
        f"CPU: {cpu.get('model', '?')}, {cpu.get('logical_cores', '?')} logical cores; "
        f"Numba threads: {thr.get('numba_threads_in_use', '?')} "
        f"(threading layer {thr.get('layer', '?')})"
    )
