"""
Performance: GB/s against row length
====================================

LayerNorm reads every element once and writes it once. Whether memory bandwidth or
arithmetic limits it depends on where the data is, so this page shows both regimes of
``python -m layernorm bench``: **memory** (inputs rotated over more than 128 MiB, so every
call reads from DRAM: the ceiling is a copy of the same bytes) and **cache** (one working
set of at most 1.5 MB, reused: the copy runs from cache too, and the arithmetic shows).
The dashed lines are plain copies of the same bytes in the same regime.

Two measurements of the same small grid (rows of 64 to 32768 float32 elements) stand
side by side:

* a **live** one, ``bench --quick``, run *while this documentation was built*, on
  whatever machine built it and whatever else that machine was doing;
* a **reference** committed with the source (``docs/_data/bench_reference.json``), made
  with more rounds by the command given in :doc:`/benchmarks`, which records the
  machine it came from (CPU, cores, caches, library versions, date) beside its numbers.

Numbers measured on a busy machine mean little, and a page must not publish them
without saying so. Each measurement is therefore judged by
``layernorm.bench.noise.assess``: the CPU time other processes took during the run, the
spread between its rounds, and whether its numbers are plausible (this library slower
than the NumPy composite, or far below the copy, happens only when something is wrong).
A warning box below lists the reasons whenever a measurement was noisy, and the
conditions of both are shown either way. Run the command on your own machine for your
numbers.
"""

# %%
import html
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from layernorm.bench.noise import assess

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
    live = json.loads(path.read_text())
print(f"{len(live['results'])} measurements in {live['elapsed_s']:.0f} s")

# %%
# The committed reference
# -----------------------
# The examples run from ``docs/examples``; the reference lies next to them, in
# ``docs/_data``. Its ``machine`` and ``date`` say where and when it was measured.
REFERENCE = Path("..") / "_data" / "bench_reference.json"
reference = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else None


def machine_line(report):
    """CPU, cores, caches, threads and versions of a report's machine, in one line."""
    machine = report.get("machine") or {}
    cpu, thr, ver = machine.get("cpu") or {}, machine.get("threads") or {}, machine.get(
        "versions") or {}
    caches = ", ".join(f"L{c['level']}{(c.get('type') or '')[:1].lower()} {c['size']}"
                       for c in cpu.get("caches") or () if c.get("type") != "Instruction")
    libs = ", ".join(f"{name} {ver[name]}" for name in ("layernorm", "numpy", "numba", "torch")
                     if ver.get(name))
    return (f"{cpu.get('model', '?')}, {cpu.get('logical_cores', '?')} logical cores "
            f"({caches or 'caches unknown'}); {thr.get('numba_threads_in_use', '?')} Numba "
            f"thread(s); {libs}; measured {report.get('date', 'at an unrecorded date')}")


if reference is None:
    print(f"no committed reference at {REFERENCE}: only the live measurement is shown")
else:
    print("reference:", machine_line(reference))
print("live:     ", machine_line(live))

# %%
# Was the machine quiet?
# ----------------------
# The verdict on each measurement, with its conditions: how many cores' worth of CPU
# time other processes took during the run (against the cores and the run's own
# threads), the 1-minute load average, and how far a measurement's 90th-percentile
# round strays from its median (over all measurements, and over the copies that the
# bandwidth percentages divide by). A noisy verdict lists its reasons in a warning box.
verdicts = {"live": assess(live)}
if reference is not None:
    verdicts["reference"] = assess(reference)


class Boxes:
    """The verdicts as admonitions on the page (HTML) and as text elsewhere."""

    def __init__(self, verdicts):
        self.verdicts = verdicts

    def _what(self, name):
        return ("The live measurement of this build" if name == "live"
                else "The committed reference measurement")

    def _repr_html_(self):
        boxes = []
        for name, v in self.verdicts.items():
            if v.noisy:
                items = "".join(f"<li>{html.escape(r)}</li>" for r in v.reasons)
                boxes.append(
                    '<div class="admonition warning">'
                    f'<p class="admonition-title">{self._what(name)} was noisy</p>'
                    f"<p>Conditions: {html.escape(v.summary())}.</p>"
                    f"<p>Its numbers may understate the library, for these reasons:</p>"
                    f"<ul>{items}</ul></div>")
            else:
                boxes.append(
                    '<div class="admonition note">'
                    f'<p class="admonition-title">{self._what(name)} was quiet</p>'
                    f"<p>Conditions: {html.escape(v.summary())}.</p></div>")
        return "\n".join(boxes)

    def __repr__(self):
        return "\n".join(f"{name}: " + "\n  ".join(v.lines())
                         for name, v in self.verdicts.items())


Boxes(verdicts)

# %%
# One line per implementation and regime
# --------------------------------------
# Each record of a JSON report is one (implementation, shape, regime) measurement. We
# keep the first measurement phase ("fresh": a new output array per call, as user code
# does, plus the preallocated ``out=`` variants timed alongside) and summarize the copies
# by the best preallocated copy at each row length: the ceiling of that regime.


def bandwidths(report):
    """Per regime: the best copy's GB/s by row length, and each implementation's."""
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
    return regimes, ceiling, lines


measured = {"live": bandwidths(live)}
if reference is not None:
    measured["reference"] = bandwidths(reference)

for name, (regimes, ceiling, lines) in measured.items():
    for regime in regimes:
        row_lengths = sorted(ceiling[regime])
        header = "".join(f"{'D=' + str(d):>9s}" for d in row_lengths)
        print(f"\n{name + ', ' + regime + ' regime, GB/s':36s}{header}")
        rows = [("best copy (ceiling)", ceiling[regime]), *sorted(lines[regime].items())]
        for label, points in rows:
            cells = "".join(f"{points.get(d, float('nan')):9.1f}" for d in row_lengths)
            print(f"{label:36s}{cells}")
if reference is not None:
    # How far the live run is from the reference, for the library and for the copy: when
    # only the library fell behind, the copy's bandwidth was not what was taken away.
    for regime in measured["live"][0]:
        live_lines, ref_lines = measured["live"][2][regime], measured["reference"][2][regime]
        rows = [("best copy (ceiling)", measured["live"][1][regime],
                 measured["reference"][1].get(regime, {}))]
        rows += [(label, live_lines[label], ref_lines.get(label, {}))
                 for label in ("layernorm numba", "layernorm numba out= (prealloc)")
                 if label in live_lines]
        ds = sorted(measured["live"][1][regime])
        print(f"\n{'live / reference, ' + regime:36s}"
              + "".join(f"{'D=' + str(d):>9s}" for d in ds))
        for label, now, then in rows:
            cells = "".join(f"{now[d] / then[d]:9.2f}" if then.get(d) and d in now
                            else f"{'-':>9s}" for d in ds)
            print(f"{label:36s}{cells}")
print("\n(bytes of x read plus bytes of y written, per second)")

# %%
# The plot
# --------
# One row per regime; the live measurement on the left, the committed reference on the
# right, on the same axes. A panel whose measurement was judged noisy says so in red.
labels = sorted({label for _, _, lines in measured.values() for regime in lines.values()
                 for label in regime})
colors = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
regimes = measured["live"][0]
fig, axes = plt.subplots(
    len(regimes), len(measured), figsize=(6.0 * len(measured), 4.2 * len(regimes)),
    layout="constrained", squeeze=False, sharey="row",
)
for col, (name, (_, ceiling, lines)) in enumerate(measured.items()):
    report = live if name == "live" else reference
    threads = report["settings"]["threads"][0]
    cpu = ((report.get("machine") or {}).get("cpu") or {}).get("model", "?")
    for row, regime in enumerate(regimes):
        ax = axes[row][col]
        if regime not in ceiling:
            ax.set_visible(False)
            continue
        ds = sorted(ceiling[regime])
        ax.plot(ds, [ceiling[regime][d] for d in ds], "k--", label="best copy (ceiling)")
        for label, points in sorted(lines[regime].items()):
            ds = sorted(points)
            ours = label.startswith("layernorm")
            ax.plot(ds, [points[d] for d in ds], "-o" if ours else "-s", markersize=4,
                    linewidth=2.2 if ours else 1.2, color=colors[label], label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("row length D")
        ax.set_ylabel("GB/s (higher is better)")
        where = "DRAM-resident" if regime == "memory" else "cache-resident, <= 1.5 MB"
        date = report.get("date", "?")[:10]
        when = "live, this build" if name == "live" else f"committed reference, {date}"
        title = f"{when}: {regime} ({where})\n{cpu}, {threads} thread(s)"
        noisy = verdicts[name].noisy
        ax.set_title(title + ("\nNOISY: see the warning above" if noisy else ""),
                     fontsize=9, color="red" if noisy else "black")
        ax.grid(True, which="both", alpha=0.3)
axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
fig.suptitle("layer_norm forward, float32")
plt.show()
