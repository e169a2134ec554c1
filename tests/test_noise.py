"""The verdict on a bench run's machine (``layernorm.bench.noise``).

No timing here: every test feeds made-up counters, rounds and bandwidths into the
detector and checks what it concludes.
"""

from __future__ import annotations

import pytest

from layernorm.bench import noise, report

MS = 1e-3


def _rec(impl, median=1.0, p90=None, *, regime="memory", shape=(4096, 768), pct=None,
         best_copy=False, threads=2, op="layer_norm"):
    """One record as ``bench --json`` writes it (times in ms)."""
    return {"impl": impl, "op": op, "direction": "forward", "dtype": "float32",
            "shape": list(shape), "threads": threads, "phase": "fresh", "regime": regime,
            "median_s": median * MS, "p90_s": (p90 if p90 is not None else median) * MS,
            "pct_copy": pct, "best_copy": best_copy}


def _cell(ours=1.0, numpy=4.0, pct=60.0, spread=1.02, copy_spread=1.02, **kw):
    """The records of one healthy cell: a copy, our two calls and the NumPy composite."""
    return [
        _rec("copy np.copyto", 0.6, 0.6 * copy_spread, pct=100.0, best_copy=True, **kw),
        _rec("layernorm numba out=", ours, ours * spread, pct=pct, **kw),
        _rec("layernorm numba", ours * 1.1, ours * 1.1 * spread, **kw),
        _rec("numpy composite", numpy, numpy * spread, **kw),
    ]


def _conditions(others=0.05, cores=2, threads=2, load=0.3):
    return {"wall_s": 30.0, "cores": cores, "threads": threads, "own_cores": 1.8,
            "load_avg_1m": {"before": load, "after": load}, "others_cores": others}


def test_a_quiet_plausible_run_is_not_noisy_and_states_its_conditions():
    v = noise.assess({"results": _cell(), "conditions": _conditions()})
    assert not v.noisy and v.reasons == []
    assert v.conditions["others_cores"] == 0.05 and v.conditions["cores"] == 2
    assert v.conditions["spread"] == pytest.approx(1.02)
    assert v.conditions["copy_spread"] == pytest.approx(1.02)
    (line,) = v.lines()
    assert line.startswith("quiet run: other processes used 0.05 of 2 cores")
    assert line.endswith("rounds p90/median 1.02 (copies 1.02)")


@pytest.mark.parametrize(("others", "cores", "threads", "noisy"), [
    (0.20, 2, 2, False),   # within the slack
    (0.60, 2, 2, True),    # one core's worth taken from a 2-thread run on 2 cores
    (0.60, 2, 1, False),   # the run leaves a core free for them
    (1.20, 2, 1, True),    # ... but not more than half the machine
    (10.0, 64, 2, False),  # plenty of free cores
    (40.0, 64, 2, True),   # more than half of them
])
def test_other_processes_cpu_time_against_the_free_cores(others, cores, threads, noisy):
    v = noise.assess({"results": _cell(threads=threads),
                      "conditions": _conditions(others, cores, threads)})
    assert v.noisy is noisy
    if noisy:
        assert f"kept {others:.2f} of the {cores} cores busy" in v.reasons[0]


def test_the_load_average_is_judged_only_without_cpu_counters():
    busy_load = {"before": {"load_avg_1m": 0.1, "logical_cores": 4},
                 "after": {"load_avg_1m": 3.5, "logical_cores": 4}}
    # An old report (no "conditions"): the load average decides, 3.5 > 0.75 x 4.
    old = noise.assess({"results": _cell(threads=1), "load": busy_load})
    assert old.noisy and "load average reached 3.5 on 4 cores" in old.reasons[0]
    assert not noise.assess({"results": _cell(threads=1), "load": {
        "after": {"load_avg_1m": 2.5, "logical_cores": 4}}}).noisy
    # With the counters the load (which counts this run's own threads) is only shown.
    v = noise.assess({"results": _cell(), "conditions": _conditions(0.05, load=1.9)})
    assert not v.noisy and "load average 1.9" in v.summary()


def test_rounds_that_disagree_make_a_run_noisy():
    v = noise.assess({"results": _cell(spread=1.6), "conditions": _conditions()})
    assert v.noisy and v.conditions["spread"] == pytest.approx(1.6)
    assert any("rounds disagree" in r and "1.60x" in r for r in v.reasons)
    # One wild measurement among steady ones moves the worst spread, not the verdict.
    results = _cell() + _cell(shape=(2048, 4096))
    results[1]["p90_s"] = 20 * results[1]["median_s"]
    v = noise.assess({"results": results, "conditions": _conditions()})
    assert not v.noisy and v.conditions["worst_spread"] == pytest.approx(20.0)
    assert "rounds p90/median 1.02 (worst 20.00, copies 1.02)" in v.summary()


def test_a_scattered_copy_makes_a_run_noisy():
    v = noise.assess({"results": _cell(copy_spread=1.5), "conditions": _conditions()})
    assert v.noisy
    assert any("copy bandwidth" in r and "1.50" in r for r in v.reasons)


def test_slower_than_the_numpy_composite_is_implausible():
    # The reported symptom: the library at a third of NumPy's speed on 2048 x 512.
    v = noise.assess({"results": _cell(ours=3.0, numpy=1.0, shape=(2048, 512)),
                      "conditions": _conditions()})
    assert v.noisy
    (reason,) = v.reasons
    assert "slower than the NumPy composite" in reason
    assert "layer_norm forward float32 2048x512 (memory, 2 thread(s)): 3.3x NumPy's time" in reason
    # On a shape too small to judge (call overhead dominates) any ordering is fine.
    tiny = noise.assess({"results": _cell(ours=3.0, numpy=1.0, shape=(1, 768)),
                         "conditions": _conditions()})
    assert not tiny.noisy


@pytest.mark.parametrize(("regime", "pct", "noisy"), [
    ("memory", 2.0, True), ("memory", 40.0, False), ("cache", 2.0, True),
    ("cache", 15.0, False),
])
def test_far_below_the_copy_is_implausible(regime, pct, noisy):
    v = noise.assess({"results": _cell(pct=pct, regime=regime), "conditions": _conditions()})
    assert v.noisy is noisy
    if noisy:
        assert "small share of the copy bandwidth" in v.reasons[0]
        assert f"{pct:.1f} %" in v.reasons[0]


def test_every_reason_is_listed_under_the_warning():
    results = _cell(ours=3.0, numpy=1.0, pct=2.0, spread=1.5, copy_spread=1.5)
    v = noise.assess({"results": results, "conditions": _conditions(others=1.5)})
    assert len(v.reasons) == 5
    lines = v.lines()
    assert lines[0].startswith("warning: NOISY run (other processes used 1.50 of 2 cores")
    assert lines[1:] == [f"  - {r}" for r in v.reasons]


def test_a_report_without_anything_is_not_noisy():
    v = noise.assess({})
    assert not v.noisy and v.summary() == "no conditions recorded"
    failed = {"impl": "layernorm numba", "error": "RuntimeError: boom"}
    assert not noise.assess({"results": [failed]}).noisy


def test_conditions_subtract_this_process_from_the_busy_cores():
    # 10 s of wall time on 2 cores (20 CPU-seconds of counters): 15 busy, 11 of them ours.
    before = noise.CpuSample(wall_s=100.0, own_cpu_s=5.0, busy_s=1000.0, total_s=5000.0,
                             cores=2, load_avg_1m=0.5)
    after = noise.CpuSample(wall_s=110.0, own_cpu_s=16.0, busy_s=1015.0, total_s=5020.0,
                            cores=2, load_avg_1m=1.5)
    c = noise.conditions(before, after, threads=2)
    assert c["wall_s"] == pytest.approx(10.0)
    assert c["own_cores"] == pytest.approx(1.1)
    assert c["others_cores"] == pytest.approx(0.4)
    assert c["load_avg_1m"] == {"before": 0.5, "after": 1.5}
    # Without /proc/stat: no counters, no estimate (and no division by zero).
    blind = noise.CpuSample(110.0, 16.0, None, None, 2, None)
    assert noise.conditions(before, blind, threads=2)["others_cores"] is None


def test_parse_proc_stat_keeps_only_the_usable_cpus_and_counts_steal_as_busy():
    text = ("cpu  900 0 900 900 0 0 0 0 0 0\n"
            "cpu0 100 10 40 800 30 5 5 10 0 0\n"
            "cpu1 700 0 100 200 0 0 0 0 0 0\n"
            "cpu2 50 0 50 900 0 0 0 0 0 0\n"
            "intr 1 2 3\n")
    # busy: user + nice + system + irq + softirq + steal; total adds idle and iowait
    assert noise.parse_proc_stat(text, {0}, 100.0) == pytest.approx((1.7, 10.0))
    assert noise.parse_proc_stat(text, {0, 2}, 100.0) == pytest.approx((2.7, 20.0))
    assert noise.parse_proc_stat(text, None, 10.0) == pytest.approx((107.0, 300.0))
    assert noise.parse_proc_stat(text, {7}, 100.0) is None
    assert noise.parse_proc_stat("", None, 100.0) is None


def test_sample_reads_this_machine():
    s = noise.sample()
    assert s.cores >= 1 and s.own_cpu_s > 0
    if s.busy_s is not None:
        assert 0 <= s.busy_s <= s.total_s


def test_the_printed_table_ends_with_the_verdict():
    quiet = report.format_table({"results": [], "conditions": _conditions()})
    assert quiet.splitlines()[-1].startswith("quiet run: other processes used 0.05")
    busy = report.format_table({"results": [], "conditions": _conditions(others=1.5)})
    assert "warning: NOISY run (other processes used 1.50 of 2 cores" in busy
    assert busy.splitlines()[-1].startswith("  - other processes kept 1.50")
