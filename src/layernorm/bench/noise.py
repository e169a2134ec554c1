"""Was the machine quiet? The conditions of a ``bench`` run and a verdict on its numbers.

A measurement made while other processes take the cores can understate the library many
times over, most of all at more than one thread: a parallel kernel waits for its slowest
thread, while the single-threaded copy it is compared with barely notices. Three kinds
of evidence, each cheap:

* **other processes' CPU time** during the run, from the per-CPU counters of
  ``/proc/stat`` (the cores this process may run on) less this process's own CPU time
  (:func:`sample`, :func:`conditions`). This is the direct measurement; the 1-minute
  load average (which counts this process too, and lags) is recorded beside it, and
  judged alone only where ``/proc/stat`` is missing.
* **spread between rounds**: every measurement keeps its rounds; on a quiet machine a
  measurement's 90th-percentile round stays near its median, for the library and for the
  copy that is the yardstick of "% copy" alike.
* **plausibility**: on a quiet machine this library is faster than the NumPy composite
  (which makes several passes over memory) and, on inputs of more than a few rows, it
  gets a fair fraction of a copy's bandwidth. A measurement that breaks either says the
  machine was busy, or that the library regressed: either way it must not be published
  without a word.

:func:`assess` turns a ``bench`` report (the dict its ``--json`` writes) into a
:class:`Verdict`: noisy or not, the reasons in words, and the conditions to print
beside the numbers.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

#: Other processes may keep at most this many cores busy, on average, beyond the cores
#: the run's own threads leave free ...
OTHERS_SLACK_CORES = 0.25
#: ... and at most this share of all the cores (they share memory bandwidth too).
OTHERS_MAX_SHARE = 0.5
#: Where other processes' CPU time cannot be measured: the 1-minute load average (before
#: or after the run) may exceed this many runnable processes per core.
LOAD_PER_CORE = 0.75
#: The median over a run's measurements of their p90 / median round, and the same over
#: the copies that the bandwidth percentages divide by, may not exceed this.
MAX_SPREAD = 1.25
#: Measurements of at least this many elements are checked for plausibility (smaller
#: ones are dominated by the cost of a call, where any ordering can be right).
PLAUSIBLE_MIN_ELEMENTS = 1 << 16
#: On such inputs, our call into ``out=`` gets at least this percent of the bandwidth of
#: a copy of the same bytes in the same regime: from DRAM, where both are bound by
#: memory (measured: 50-140 % on a quiet machine); in cache, where the copy runs several
#: times faster than any arithmetic over the same bytes (measured: 20-60 %).
MIN_PCT_COPY = {"memory": 10.0, "cache": 3.0}

# Names the records of a bench report use (see .impls); spelled here so that this module
# reads reports without importing the implementations.
_OURS_FRESH, _OURS_OUT, _NUMPY = "layernorm numba", "layernorm numba out=", "numpy composite"


@dataclass(frozen=True)
class CpuSample:
    """What :func:`sample` reads at one instant.

    Attributes
    ----------
    wall_s
        ``time.monotonic()``.
    own_cpu_s
        CPU seconds of this process (all its threads) and its waited-for children.
    busy_s, total_s
        Busy and total CPU seconds since boot, summed over the CPUs this process may run
        on (``/proc/stat``); None where that file is missing.
    cores
        How many CPUs those are (the usable cores).
    load_avg_1m
        The 1-minute load average; None where the platform has none.
    """

    wall_s: float
    own_cpu_s: float
    busy_s: float | None
    total_s: float | None
    cores: int
    load_avg_1m: float | None


def _usable_cpus() -> set[int] | None:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return None


def parse_proc_stat(text: str, cpus: set[int] | None, ticks_per_s: float
                    ) -> tuple[float, float] | None:
    """Busy and total CPU seconds over ``cpus`` (all CPUs when None) from the text of
    ``/proc/stat``; None when it holds no per-CPU line for them.

    Busy is everything but ``idle`` and ``iowait``; ``steal`` (time a hypervisor gave
    to other guests) counts as busy, since it was taken from this machine too.

    Examples
    --------
    >>> text = "cpu  9 0 9 9 0 0 0 0 0 0\\ncpu0 100 0 50 800 50 0 0 0 0 0\\n"
    >>> parse_proc_stat(text, {0}, 100.0)
    (1.5, 10.0)
    """
    busy = total = 0.0
    found = False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            index = int(name[3:])
        except ValueError:
            continue
        if cpus is not None and index not in cpus:
            continue
        fields = [float(v) for v in rest.split()[:8]]
        fields += [0.0] * (8 - len(fields))
        user, nice, system, idle, iowait, irq, softirq, steal = fields
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
        found = True
    return (busy / ticks_per_s, total / ticks_per_s) if found else None


def sample() -> CpuSample:
    """Read this machine's CPU counters, this process's CPU time and the load average.

    Examples
    --------
    >>> s = sample()
    >>> s.cores >= 1 and s.own_cpu_s >= 0
    True
    """
    times = os.times()
    own = times.user + times.system + times.children_user + times.children_system
    cpus = _usable_cpus()
    busy = total = None
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            text = fh.read()
        ticks = float(os.sysconf("SC_CLK_TCK"))
        parsed = parse_proc_stat(text, cpus, ticks)
        if parsed is not None:
            busy, total = parsed
    except (OSError, ValueError, AttributeError):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cores = len(cpus) if cpus else (os.cpu_count() or 1)
    return CpuSample(time.monotonic(), own, busy, total, cores, load)


def conditions(before: CpuSample, after: CpuSample, threads: int) -> dict[str, Any]:
    """The conditions of a run between two samples, as recorded in a bench report.

    Parameters
    ----------
    before, after
        :func:`sample` at the start and at the end of the run.
    threads
        The most threads the run's own calls used.

    Returns
    -------
    dict
        ``wall_s``; ``cores`` (usable); ``threads``; ``load_avg_1m`` (before and after);
        ``own_cores`` (this process's CPU seconds per second); ``others_cores`` (other
        processes' CPU seconds per second on the usable cores, None where
        ``/proc/stat`` is missing).

    Examples
    --------
    >>> a = CpuSample(0.0, 1.0, 100.0, 400.0, 2, 0.5)
    >>> b = CpuSample(10.0, 11.0, 115.0, 420.0, 2, 1.5)
    >>> c = conditions(a, b, threads=1)
    >>> c["own_cores"], c["others_cores"]
    (1.0, 0.5)
    """
    wall = max(after.wall_s - before.wall_s, 1e-9)
    own = max(after.own_cpu_s - before.own_cpu_s, 0.0)
    others = None
    if None not in (before.busy_s, after.busy_s, before.total_s, after.total_s):
        busy = after.busy_s - before.busy_s
        # CPU seconds per wall second from the counters themselves: the clock tick and
        # the number of CPUs counted cancel, and so do small errors in either.
        elapsed = max(after.total_s - before.total_s, 1e-9) / after.cores
        others = max(busy - own, 0.0) / elapsed
    return {
        "wall_s": wall,
        "cores": after.cores,
        "threads": threads,
        "load_avg_1m": {"before": before.load_avg_1m, "after": after.load_avg_1m},
        "own_cores": own / wall,
        "others_cores": others,
    }


@dataclass
class Verdict:
    """What :func:`assess` concludes about a bench report.

    Attributes
    ----------
    noisy
        True when the numbers should not be trusted (or published) as they are.
    reasons
        Why, one sentence each (empty when not noisy).
    conditions
        The evidence, whatever the verdict: ``cores``, ``threads``, ``others_cores``,
        ``load_avg_1m``, ``spread`` and ``worst_spread`` (p90 / median of the
        measurements' rounds), ``copy_spread`` (the same over the copies), ``wall_s``;
        None for what the report does not hold.
    """

    noisy: bool
    reasons: list[str] = field(default_factory=list)
    conditions: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        """The conditions in one line.

        Examples
        --------
        >>> v = Verdict(False, [], {"cores": 2, "threads": 1, "others_cores": 0.05,
        ...                         "load_avg_1m": 0.4, "spread": 1.02})
        >>> print(v.summary().replace("; ", "\\n"))
        other processes used 0.05 of 2 cores (this run: 1 thread(s))
        load average 0.4
        rounds p90/median 1.02
        """
        c = self.conditions
        parts = []
        cores = c.get("cores")
        if c.get("others_cores") is not None:
            parts.append(f"other processes used {c['others_cores']:.2f} of {cores} cores "
                         f"(this run: {c.get('threads')} thread(s))")
        if c.get("load_avg_1m") is not None:
            where = "" if c.get("others_cores") is not None else f" on {cores} cores"
            parts.append(f"load average {c['load_avg_1m']:.1f}{where}")
        if c.get("spread") is not None:
            extra = []
            if c.get("worst_spread") is not None and c["worst_spread"] > c["spread"]:
                extra.append(f"worst {c['worst_spread']:.2f}")
            if c.get("copy_spread") is not None:
                extra.append(f"copies {c['copy_spread']:.2f}")
            parts.append(f"rounds p90/median {c['spread']:.2f}"
                         + (f" ({', '.join(extra)})" if extra else ""))
        return "; ".join(parts) or "no conditions recorded"

    def lines(self) -> list[str]:
        """The verdict as the end of a printed report: one line, plus one per reason.

        Examples
        --------
        >>> print("\\n".join(Verdict(True, ["the rounds disagree"], {}).lines()))
        warning: NOISY run (no conditions recorded); these numbers may understate the library:
          - the rounds disagree
        """
        if not self.noisy:
            return [f"quiet run: {self.summary()}"]
        return ([f"warning: NOISY run ({self.summary()}); these numbers may understate "
                 "the library:"] + [f"  - {reason}" for reason in self.reasons])


def _spread(rec: dict[str, Any]) -> float | None:
    p90, median = rec.get("p90_s"), rec.get("median_s")
    return p90 / median if p90 and median else None


def _cell(rec: dict[str, Any]) -> tuple:
    return (rec.get("phase"), rec.get("regime"), rec.get("threads"), rec.get("op"),
            rec.get("direction"), rec.get("dtype"), tuple(rec.get("shape", ())))


def _shape(key: tuple) -> str:
    _, regime, threads, op, direction, dtype, shape = key
    return (f"{op} {direction} {dtype} {'x'.join(map(str, shape))} "
            f"({regime}, {threads} thread(s))")


def _implausible(results: list[dict[str, Any]]) -> list[str]:
    cells: dict[tuple, dict[str, dict[str, Any]]] = {}
    for rec in results:
        if "median_s" in rec:
            cells.setdefault(_cell(rec), {})[rec.get("impl")] = rec
    slower, below = [], []
    for key, recs in cells.items():
        shape = key[-1]
        if len(shape) != 2 or shape[0] * shape[1] < PLAUSIBLE_MIN_ELEMENTS:
            continue
        ours, numpy = recs.get(_OURS_FRESH), recs.get(_NUMPY)
        if ours and numpy and ours["median_s"] > numpy["median_s"]:
            slower.append(f"{_shape(key)}: {ours['median_s'] / numpy['median_s']:.1f}x "
                          "NumPy's time")
        out = recs.get(_OURS_OUT)
        pct = out.get("pct_copy") if out else None
        least = MIN_PCT_COPY.get(key[1])
        if pct is not None and least is not None and pct < least:
            below.append(f"{_shape(key)} {pct:.1f} % (at least {least:.0f} % expected)")
    reasons = []
    if slower:
        reasons.append("implausible: layernorm was slower than the NumPy composite at "
                       + ", ".join(slower) + " (on a quiet machine it is several times "
                       "faster): the machine was busy, or the library regressed")
    if below:
        reasons.append("implausible: layernorm into out= reached only a small share of "
                       "the copy bandwidth at " + ", ".join(below)
                       + ": the machine was busy, or the library regressed")
    return reasons


def assess(report: dict[str, Any]) -> Verdict:
    """Judge a bench report (as ``bench --json`` writes it) by its recorded conditions,
    the spread of its rounds and the plausibility of its numbers.

    Parameters
    ----------
    report
        ``{"results": [...], "conditions": {...}, "load": {...}, "settings": {...}}``;
        every key may be missing (an old report is judged on what it holds).

    Returns
    -------
    Verdict

    Examples
    --------
    >>> rec = {"impl": "copy np.copyto", "median_s": 1.0, "p90_s": 1.6}
    >>> v = assess({"results": [rec]})
    >>> v.noisy, round(v.conditions["spread"], 2)
    (True, 1.6)
    """
    results = list(report.get("results") or ())
    cond = dict(report.get("conditions") or {})
    load_snapshots = [s for s in (report.get("load") or {}).values() if s]
    recorded = cond.get("load_avg_1m") or {}
    loads = [v for v in recorded.values() if v is not None]
    loads += [s["load_avg_1m"] for s in load_snapshots if s.get("load_avg_1m") is not None]
    cores = cond.get("cores") or max(
        [s.get("logical_cores") or 0 for s in load_snapshots] + [0]) or None
    threads = cond.get("threads") or max((report.get("settings") or {}).get("threads")
                                         or [0]) or None
    others = cond.get("others_cores")
    load = max(loads, default=None)

    spreads = [s for s in map(_spread, results) if s is not None]
    copies = [s for s in (_spread(r) for r in results if r.get("best_copy")) if s is not None]
    spread = statistics.median(spreads) if spreads else None
    copy_spread = statistics.median(copies) if copies else None

    reasons: list[str] = []
    if others is not None and cores:
        free = cores - (threads or 1)
        limit = min(max(free, 0) + OTHERS_SLACK_CORES, OTHERS_MAX_SHARE * cores)
        limit = max(limit, OTHERS_SLACK_CORES)
        if others > limit:
            reasons.append(f"other processes kept {others:.2f} of the {cores} cores busy "
                           f"on average (more than {limit:.2f} with {threads or 1} "
                           "thread(s) of our own)")
    elif load is not None and cores and load > LOAD_PER_CORE * cores:
        reasons.append(f"the 1-minute load average reached {load:.1f} on {cores} cores "
                       f"(more than {LOAD_PER_CORE} per core)")
    if spread is not None and spread > MAX_SPREAD:
        reasons.append(f"the rounds disagree: a measurement's p90 round is {spread:.2f}x "
                       f"its median (median over the measurements; at most {MAX_SPREAD})")
    if copy_spread is not None and copy_spread > MAX_SPREAD:
        reasons.append(f"the copy bandwidth, the yardstick of '% copy', varied between "
                       f"rounds: p90/median {copy_spread:.2f}")
    reasons += _implausible(results)
    evidence = {
        "cores": cores, "threads": threads, "others_cores": others, "load_avg_1m": load,
        "spread": spread, "worst_spread": max(spreads, default=None),
        "copy_spread": copy_spread, "wall_s": cond.get("wall_s"),
    }
    return Verdict(bool(reasons), reasons, evidence)
