"""The command line: ``python -m layernorm info`` and ``python -m layernorm bench``.

No timing assertions: the bench tests check structure and that every number is a
positive, finite measurement consistent with the bytes it claims to have moved.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from layernorm.bench import cli, impls, machine, report, run, settings, timing


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layernorm", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


# --------------------------------------------------------------------------- info


@pytest.mark.slow
def test_info_prints_versions_backends_and_threads():
    proc = _run("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for section in ("versions:", "backends:", "threads:", "cpu:", "gpu:"):
        assert section in out
    assert f"numpy              {importlib.metadata.version('numpy')}" in out
    assert f"numba              {importlib.metadata.version('numba')}" in out
    backends = out.split("backends:")[1].split("threads:")[0]
    assert "numba      available" in backends
    assert "array_api  available" in backends


@pytest.mark.slow
def test_info_json_reports_the_threading_layer():
    proc = _run("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["versions"]["layernorm"] == importlib.metadata.version("layernorm")
    threads = info["threads"]
    assert threads["numba_num_threads"] >= 1
    # The probe ran a parallel kernel (when there is more than one thread), so Numba
    # knows which threading layer it loaded.
    if threads["numba_threads_in_use"] > 1:
        assert threads["layer"] in ("tbb", "omp", "workqueue")
    assert info["cpu"]["logical_cores"] >= 1


def test_info_never_imports_optional_libraries_it_only_versions(monkeypatch):
    # versions() reads metadata only: a library that is not imported yet stays so.
    absent = [m for _, m, req in machine.PACKAGES if not req and m not in sys.modules]
    machine.versions()
    machine.backends_info()
    for module in absent:
        assert module not in sys.modules


@pytest.mark.parametrize("lib", ["torch", "dask"])
def test_info_reports_the_adapter_of_an_installed_library_as_available(lib):
    if not machine.installed(lib):
        pytest.skip(f"{lib} is not installed")
    assert machine.backends_info()[lib].startswith("available"), machine.backends_info()


def test_installed_and_distribution_version():
    assert machine.installed("numpy")
    assert not machine.installed("layernorm_no_such_module")
    assert machine.distribution_version("numpy", "numpy") == np.__version__
    assert machine.distribution_version("no-such-dist-xyz", "no_such_dist_xyz") is None


# --------------------------------------------------------------------------- bench


@pytest.fixture(scope="module")
def bench_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    path = folder / "bench.json"
    args = ["bench", "--quick", "--backward", "--shape", "64,128", "--threads", "1",
            "--repeats", "2", "--no-progress", "--json", str(path)]
    if machine.installed("matplotlib"):
        args += ["--plot", str(folder / "bench.png")]
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(path.read_text()), folder


@pytest.mark.slow
def test_bench_json_structure(bench_report):
    _, report, _ = bench_report
    assert report["settings"]["shapes"] == [[64, 128]]
    assert report["settings"]["threads"] == [1]
    results = report["results"]
    cells = {(r["op"], r["direction"]) for r in results}
    assert cells == {(op, d) for op in ("layer_norm", "rms_norm")
                     for d in ("forward", "backward")}
    for rec in results:
        assert rec["shape"] == [64, 128]
        assert rec["threads"] == 1
        assert "error" not in rec, rec
        assert len(rec["samples_s"]) == 2
        for key in ("median_s", "min_s", "us", "gbps", "pct_copy", "copy_gbps"):
            assert rec[key] > 0 and math.isfinite(rec[key]), (key, rec)
        assert rec["min_s"] <= rec["median_s"]
        # GB/s is the bytes the record claims over its median time.
        assert rec["gbps"] == pytest.approx(rec["bytes"] / rec["median_s"] / 1e9)
        itemsize = 4
        per_array = 64 * 128 * itemsize
        if rec["kind"] == "copy":
            # copies move two arrays; the backward's baselines (grad_y + x) three
            arrays = 3 if rec["impl"].startswith("stream") else 2
            assert rec["bytes"] == arrays * per_array
        else:
            assert rec["bytes"] == (2 if rec["direction"] == "forward" else 3) * per_array
    names = {r["impl"] for r in results}
    assert {"copy np.copyto", "layernorm numba", "layernorm numba out=",
            "layernorm array_api", "numpy composite"} <= names
    # Exactly one best copy per cell and phase, and it is the denominator.
    groups: dict[tuple, list] = {}
    for rec in results:
        key = (rec["op"], rec["direction"], rec["phase"])
        groups.setdefault(key, []).append(rec)
    for recs in groups.values():
        best = [r for r in recs if r.get("best_copy")]
        assert len(best) == 1
        assert best[0]["pct_copy"] == pytest.approx(100.0)
        assert best[0]["output"] == "prealloc"
        assert all(r["copy_impl"] == best[0]["impl"] for r in recs)
        # The floor moves the operation's own bytes: a copy forward, grad_y + x backward.
        floor_kind = "stream" if recs[0]["direction"] == "backward" else "copy"
        assert best[0]["impl"].startswith(floor_kind)
    peers = [r for r in results if r["kind"] == "peer"]
    assert peers and all(r["speedup"] > 0 for r in peers)
    assert "machine" in report and report["machine"]["cpu"]["logical_cores"] >= 1
    # The load before and after, so that a reader can tell a run on a busy machine.
    for when in ("before", "after"):
        assert report["load"][when]["logical_cores"] >= 1
    # ... and the CPU time other processes took meanwhile (see test_noise.py).
    cond = report["conditions"]
    assert cond["cores"] >= 1 and cond["threads"] == 1 and cond["wall_s"] > 0
    assert cond["others_cores"] is None or cond["others_cores"] >= 0
    assert report["date"].endswith("+00:00")
    # The verdict drawn from them travels with the numbers.
    assert isinstance(report["verdict"]["noisy"], bool)
    assert bool(report["verdict"]["reasons"]) is report["verdict"]["noisy"]
    assert "rounds p90/median" in report["verdict"]["summary"]


@pytest.mark.slow
def test_bench_torch_is_measured_in_both_regimes(bench_report):
    pytest.importorskip("torch")
    _, report, _ = bench_report
    regimes = {r["output"] for r in report["results"] if r["impl"].startswith("torch")}
    assert "fresh" in regimes
    if impls.heap_reuse_available():
        assert "heap reuse" in regimes


@pytest.mark.slow
def test_bench_prints_a_table(bench_report):
    out, _, _ = bench_report
    assert "LayerNorm forward, float32, 1 thread(s)" in out
    assert "RMSNorm backward, float32, 1 thread(s)" in out
    for name in ("layernorm numba", "copy np.copyto", "numpy composite"):
        assert name in out
    assert "% copy" in out and "GB/s" in out
    # The shape is one small working set: the cache regime only, and the tables say so.
    assert "cache-resident" in out and "DRAM-resident" not in out
    # The verdict on the machine closes the report, whichever it is.
    verdict = [line for line in out.splitlines()
               if line.startswith(("quiet run: ", "warning: NOISY run ("))]
    assert len(verdict) == 1, out[-2000:]


@pytest.mark.slow
def test_bench_records_carry_their_data_regime(bench_report):
    _, report, _ = bench_report
    assert report["settings"]["regimes"] == ["cache", "memory"]
    for rec in report["results"]:
        # 64 x 128 float32 is far below 128 MiB even in 64 copies: cache regime only.
        assert rec["regime"] == "cache" and rec["sets"] == 1, rec
        assert rec["working_set_bytes"] <= impls.CACHE_BYTES


def test_cache_shape_fits_the_working_set_in_the_cache():
    for op in ("layer_norm", "rms_norm"):
        for direction in ("forward", "backward"):
            for dtype in ("float32", "float64", "bfloat16"):
                for shape in settings.FULL_SHAPES:
                    small = impls.cache_shape(op, direction, dtype, shape)
                    assert small is not None and small[1] == shape[1]
                    assert 1 <= small[0] <= shape[0]
                    case = impls.make_case(op, direction, dtype, small)
                    assert case.working_set_bytes <= impls.CACHE_BYTES
                    if small[0] < shape[0]:  # as many rows as fit, not fewer
                        bigger = impls.make_case(op, direction, dtype, (small[0] + 1, shape[1]))
                        assert bigger.working_set_bytes > impls.CACHE_BYTES
    # A row longer than the cache budget cannot be measured in cache.
    assert impls.cache_shape("layer_norm", "forward", "float64", (2, 1 << 20)) is None


def test_memory_regime_rotates_over_distinct_copies(monkeypatch):
    monkeypatch.setattr(impls, "MEMORY_BYTES", 1 << 20)
    sets = impls.regime_cases("layer_norm", "forward", "float32", (64, 256), "memory")
    one = sets[0].working_set_bytes
    assert len(sets) == -(-(1 << 20) // one) and len(sets) * one >= 1 << 20
    assert all(c.extras["regime"] == "memory" and c.extras["sets"] == len(sets) for c in sets)
    for case in sets[1:]:
        assert not np.shares_memory(case.x, sets[0].x)
        np.testing.assert_array_equal(case.x, sets[0].x)
    # A single row would need thousands of copies: not measured from DRAM.
    assert impls.regime_cases("layer_norm", "forward", "float32", (1, 64), "memory") == []
    with pytest.raises(ValueError, match="regime"):
        impls.regime_cases("layer_norm", "forward", "float32", (1, 64), "l2")


def test_regime_impls_rotate_every_implementation_over_the_sets(monkeypatch):
    # Every implementation, the copies included, cycles through the input sets.
    monkeypatch.setattr(impls, "MEMORY_BYTES", 1 << 20)
    sets = impls.regime_cases("rms_norm", "forward", "float32", (64, 256), "memory")
    assert len(sets) > 1
    seen: list[int] = []
    monkeypatch.setattr(run, "build_impls", lambda case, phase: [
        impls.Impl("copy", "copy", "prealloc", lambda case=case: seen.append(id(case))),
        impls.Impl("ours", "layernorm", "fresh", lambda: None)])
    built = run.build_regime_impls(sets, "fresh")
    assert [i.name for i in built] == ["copy", "ours"]
    for _ in range(len(sets) + 1):
        built[0].fn()
    assert seen == [id(c) for c in sets] + [id(sets[0])]


def test_memory_regime_in_a_run(monkeypatch):
    monkeypatch.setattr(impls, "MEMORY_BYTES", 1 << 20)
    config = settings.Settings(("rms_norm",), ("forward",), ("float32",), ((64, 256),), (1,),
                               repeats=1, target_s=0.0, heap_reuse=False,
                               regimes=("memory",))
    out = run.run(config, progress=False)
    recs = out["results"]
    assert recs and {r["regime"] for r in recs} == {"memory"}
    assert all(r["sets"] > 1 and r["shape"] == [64, 256] for r in recs)
    assert "DRAM-resident" in report.format_table(out)


@pytest.mark.parametrize("argv, message", [
    (["--shape", "0,5"], "--shape"),
    (["--shape", "12"], "--shape"),
    (["--dtype", "int8"], "--dtype"),
    (["--threads", "999"], "--threads"),
    (["--op", "batch_norm"], "--op"),
    (["--regime", "l2"], "--regime"),
    (["--quantize", "int4"], "--quantize"),
    (["--roofline", "--regime", "cache"], "--regime"),
    (["--dask", "--regime", "memory"], "--regime"),
    (["--repeats", "0"], "--repeats must be >= 1; got 0"),
    (["--quick", "--repeats", "0"], "--repeats must be >= 1; got 0"),
    (["--repeats", "-3"], "--repeats must be >= 1; got -3"),
])
def test_bench_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--no-progress", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_bench_refuses_an_output_it_could_not_write_before_measuring(flag, tmp_path, capsys,
                                                                     monkeypatch):
    # Checked before the run, not after minutes of measurements.
    monkeypatch.setattr(run, "run", lambda *a, **k: pytest.fail("measured anyway"))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for path, message in ((a_file / "out.json", "does not exist or is not a directory"),
                          (tmp_path, "must name a file, not a directory")):
        with pytest.raises(SystemExit) as info:
            cli.main(["bench", "--quick", "--no-progress", flag, str(path)])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and message in err


def test_parse_shape():
    assert settings.parse_shape("3,7") == (3, 7)
    assert settings.parse_shape("3x7") == (3, 7)
    with pytest.raises(ValueError, match="N,D"):
        settings.parse_shape("3,7,9")


def test_time_interleaved_round_robin():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    timings = timing.time_interleaved(fns, repeats=4, target_s=0.0)
    # With target 0 every sample is one call; warm-up and calibration are 3 calls each
    # (after a warm-up, one long calibration call is not the last).
    assert calls[:9] == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    timed = calls[9:]
    assert timed == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    for name in "abc":
        t = timings[name]
        assert len(t["samples_s"]) == 4 and t["number"] == 1
        assert 0 < t["min_s"] <= t["median_s"] <= t["p90_s"] <= max(t["samples_s"])


def test_time_interleaved_reports_a_failing_implementation():
    def broken():
        raise RuntimeError("no such kernel")

    timings = timing.time_interleaved({"ok": lambda: None, "broken": broken}, repeats=2,
                                      target_s=0.0)
    assert "no such kernel" in timings["broken"]["error"]
    assert len(timings["ok"]["samples_s"]) == 2
    with pytest.raises(RuntimeError, match="broken failed: RuntimeError: no such kernel"):
        timing.median_times({"ok": lambda: None, "broken": broken}, 2, 0.0)


class FakeClock:
    """A clock that only the timed functions advance (by setting ``now``)."""

    def __init__(self):
        self.now = self.t0 = 0.0

    def start(self):
        self.t0 = self.now

    def stop(self):
        return self.now - self.t0


def test_time_interleaved_calibrates_calls_per_sample_with_any_clock():
    clock = FakeClock()  # every call of the timed function advances it by 1 ms

    def tick():
        clock.now += 1e-3

    t = timing.time_interleaved({"tick": tick}, repeats=3, target_s=0.01, clock=clock,
                                warmup=0)
    assert t["tick"]["number"] == 10
    assert t["tick"]["samples_s"] == pytest.approx([1e-3] * 3)
    capped = timing.time_interleaved({"tick": tick}, 1, 0.01, clock=clock, max_number=4)
    assert capped["tick"]["number"] == 4
    floored = timing.time_interleaved({"tick": tick}, 1, 0.0, clock=clock, min_number=3)
    assert floored["tick"]["number"] == 3


def test_time_interleaved_calibrates_from_the_fastest_of_several_calls():
    # One slow call (a thread pool waking up) must not shrink the samples to a few calls.
    clock = FakeClock()
    durations = iter([5e-3] + [1e-3] * 1000)

    def call():
        clock.now += next(durations)

    t = timing.time_interleaved({"call": call}, repeats=2, target_s=0.01, clock=clock,
                                warmup=0)
    assert t["call"]["number"] == 10
    # A call as long as a sample is calibrated from itself alone (not called again).
    calls = []

    def slow():
        calls.append(1)
        clock.now += 0.02

    t = timing.time_interleaved({"slow": slow}, repeats=1, target_s=0.01, clock=clock,
                                warmup=0)
    assert t["slow"]["number"] == 1 and len(calls) == 2
    # After a warm-up, one slow first call (a kernel loading) is not enough.
    durations = iter([1e-3, 0.05] + [1e-3] * 1000)
    t = timing.time_interleaved({"call": call}, repeats=2, target_s=0.01, clock=clock)
    assert t["call"]["number"] == 10
    calls.clear()
    t = timing.time_interleaved({"slow": slow}, repeats=1, target_s=0.01, clock=clock)
    assert t["slow"]["number"] == 1 and len(calls) == 1 + 2 + 1  # warm-up, 2, the round


def test_cuda_event_clock_reads_the_events_elapsed_milliseconds():
    class Event:
        def __init__(self):
            self.t = None

        def record(self):
            self.t = len(recorded)
            recorded.append(self)

        def synchronize(self):
            pass

    recorded: list = []
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=Event, get_elapsed_time=lambda a, b: 250.0 * (b.t - a.t)))
    clock = timing.CudaEventClock(fake_cupy)
    clock.start()
    assert clock.stop() == pytest.approx(0.25)  # 250 ms between the two records


def test_summarize_bandwidth_and_speedup():
    case = impls.make_case("layer_norm", "forward", "float32", (8, 16))
    candidates = [impls.Impl("copy fast", "copy", "prealloc", lambda: None),
                  impls.Impl("copy slow", "copy", "prealloc", lambda: None),
                  impls.Impl("layernorm numba", "layernorm", "fresh", lambda: None),
                  impls.Impl("peer", "peer", "fresh", lambda: None)]
    times = {"copy fast": 1e-6, "copy slow": 4e-6, "layernorm numba": 2e-6, "peer": 6e-6}
    timings = {k: {"median_s": v, "min_s": v, "samples_s": [v], "number": 1}
               for k, v in times.items()}
    recs = {r["impl"]: r for r in run.summarize(case, candidates, timings, 1, "fresh")}
    nbytes = 8 * 16 * 4
    assert recs["copy fast"]["best_copy"] and not recs["copy slow"]["best_copy"]
    assert recs["copy slow"]["pct_copy"] == pytest.approx(25.0)
    # Ours moves x and y (2 arrays) in twice the copy's time: half the copy's GB/s.
    assert recs["layernorm numba"]["gbps"] == pytest.approx(2 * nbytes / 2e-6 / 1e9)
    assert recs["layernorm numba"]["pct_copy"] == pytest.approx(50.0)
    assert recs["peer"]["speedup"] == pytest.approx(3.0)
    assert recs["layernorm numba"]["speedup"] is None


def test_numpy_composites_match_layernorm():
    import layernorm as ln

    rng = np.random.default_rng(5)
    x = (3 + rng.standard_normal((6, 40))).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True)
    np.testing.assert_allclose(impls.numpy_layer_norm(x, w, b, 1e-5), y,
                               rtol=1e-5, atol=1e-5)
    gy = rng.standard_normal(x.shape).astype(np.float32)
    ours = ln.layer_norm_backward(gy, x, mean, rstd, w)
    theirs = impls.numpy_layer_norm_backward(gy, x, mean, rstd, w)
    for a, b_ in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(b_, a, rtol=1e-4, atol=1e-4)
    yr, r = ln.rms_norm(x, weight=w, eps=1e-5, return_stats=True)
    np.testing.assert_allclose(impls.numpy_rms_norm(x, w, 1e-5), yr, rtol=1e-5,
                               atol=1e-5)
    ours = ln.rms_norm_backward(gy, x, r, w)
    theirs = impls.numpy_rms_norm_backward(gy, x, r, w)
    for a, b_ in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(b_, a, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_bench_plot_option(bench_report):
    pytest.importorskip("matplotlib")
    *_, folder = bench_report
    assert (folder / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    recs = []
    for impl, kind in (("layernorm numba", "layernorm"), ("copy np.copyto", "copy")):
        for d, gbps in ((64, 3.0), (768, 9.0)):
            recs.append({"op": "layer_norm", "direction": "forward", "dtype": "float32",
                         "threads": 1, "phase": "fresh", "impl": impl, "kind": kind,
                         "output": "fresh", "regime": "memory", "shape": [100, d],
                         "gbps": gbps})
    path = tmp_path / "plot.png"
    report.plot({"results": recs}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A noisy run's figure carries the warning in its title (and still draws).
    busy = {"cores": 2, "threads": 1, "others_cores": 1.9, "load_avg_1m": {}}
    path.unlink()
    report.plot({"results": recs, "conditions": busy}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_settings_defaults_and_lists():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--quick", "--dtype", "float32,float64", "bfloat16",
                              "--threads", "1"])
    config = settings.settings_from_args(args)
    assert config.dtypes == ("float32", "float64", "bfloat16")
    assert config.threads == (1,)
    assert config.shapes == settings.QUICK_SHAPES
    assert config.directions == ("forward",)
    assert isinstance(args, argparse.Namespace)


@pytest.mark.slow
def test_dask_bench_structure():
    pytest.importorskip("distributed")
    from layernorm.bench import dask as bench_dask

    report = bench_dask.run_dask(repeats=2, shape=(2048, 64, 512), workers=(1,))
    assert report["shape"] == [2048, 64]
    assert report["bytes"] == 2 * 2048 * 64 * 4
    kinds = [(r["impl"], r.get("workers"), r.get("threads")) for r in report["results"]]
    assert ("dask.distributed", 1, None) in kinds
    assert ("numpy (numba)", None, 1) in kinds
    for r in report["results"]:
        assert len(r["samples_s"]) == 2
        assert r["median_s"] > 0
        assert r["gbps"] == pytest.approx(report["bytes"] / r["median_s"] / 1e9)
    text = bench_dask.format_dask(report)
    assert "dask.distributed 1 worker(s)" in text and "numpy (numba) 1 thread(s)" in text


def _first_output(result):
    if isinstance(result, (tuple, list)):
        result = result[0]
    if hasattr(result, "detach"):
        result = result.detach().float().numpy()
    return np.asarray(result, dtype=np.float64)


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_every_timed_implementation_computes_the_same_thing(op, direction):
    # A benchmark that compares against a peer computing something else is worthless:
    # every peer's output (grad_x for the backward) must match layernorm's.
    case = impls.make_case(op, direction, "float32", (16, 64), seed=3)
    case.extras["threads"] = 1
    candidates = impls.ours_impls(case) + impls.peer_impls(case)
    assert {"layernorm numba", "numpy composite"} <= {i.name for i in candidates}
    reference = _first_output(candidates[0].fn())
    assert np.abs(reference).max() > 0.1
    for impl in candidates[1:]:
        np.testing.assert_allclose(_first_output(impl.fn()), reference, rtol=1e-4, atol=1e-4,
                                   err_msg=impl.name)


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_every_timed_fusion_computes_the_same_thing(op):
    # The fused call, the unfused add then norm (preallocated and fresh) and torch's
    # x + r then F.layer_norm/F.rms_norm all compute y = norm(x + residual).
    case = impls.make_case(op, "forward", "float32", (16, 64), seed=3)
    case.extras["threads"] = 1
    candidates = impls.ours_impls(case) + impls.peer_impls(case)
    names = {i.name for i in candidates}
    assert {"layernorm numba", "layernorm numba out=", "unfused add, norm out=",
            "unfused add, norm"} <= names
    if machine.installed("torch"):
        assert f"torch x + r, F.{op[len('add_'):]}" in names
    reference = _first_output(candidates[0].fn())
    assert np.abs(reference).max() > 0.1
    for impl in candidates[1:]:
        np.testing.assert_allclose(_first_output(impl.fn()), reference, rtol=1e-4, atol=1e-4,
                                   err_msg=impl.name)
    # Their floor copies x and the residual (4 arrays of traffic), timed as one call.
    copies = {i.name: i for i in impls.copy_impls(case)}
    assert copies["copy 2x np.copyto"].arrays == 4 == case.moved_bytes // case.array_bytes
    assert copies["copy 2x np.copyto"].output == "prealloc"


@pytest.mark.slow
def test_bench_fusions_structure(tmp_path):
    path = tmp_path / "bench.json"
    proc = _run("bench", "--op", "add_layer_norm", "add_rms_norm", "--backward", "--shape",
                "64,128", "--threads", "1", "--repeats", "2", "--no-progress", "--json",
                str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(path.read_text())["results"]
    # A fusion's backward cell is its norm's backward with grad_residual.
    assert {(r["op"], r["direction"]) for r in results} == {
        (op, d) for op in ("add_layer_norm", "add_rms_norm") for d in ("forward", "backward")}
    per_array = 64 * 128 * 4
    for rec in results:
        assert "error" not in rec, rec
        assert rec["gbps"] == pytest.approx(rec["bytes"] / rec["median_s"] / 1e9)
        if rec["direction"] == "forward":
            if rec["kind"] != "copy":  # reads x and residual, writes h and y
                assert rec["bytes"] == 4 * per_array
            # The floor: the best preallocated baseline moving those 4 arrays.
            assert rec["copy_impl"] in ("copy 2x np.copyto", "copy 2x torch copy_")
            continue
        # backward: grad_y, x and grad_residual read, grad_x written; without the
        # residual gradient three arrays; the floor is grad_y + x (by bandwidth)
        if rec["impl"] == impls.OURS_NO_RESIDUAL:
            assert rec["bytes"] == 3 * per_array
        elif rec["kind"] != "copy":
            assert rec["bytes"] == 4 * per_array
        assert rec["copy_impl"] in ("stream np.add", "stream torch add")
    fresh = [r for r in results if r["phase"] == "fresh"]
    speedups = {(r["op"], r["direction"], r["impl"]): r["speedup"]
                for r in fresh if r["kind"] == "peer"}
    for op in ("add_layer_norm", "add_rms_norm"):
        # prealloc peers against our out= call, fresh ones against our fresh call
        assert speedups[(op, "forward", "unfused add, norm out=")] > 0
        assert speedups[(op, "forward", "unfused add, norm")] > 0
        assert speedups[(op, "backward", "unfused backward, + g_res")] > 0
        # the fused backward against the same backward without grad_residual
        fused = [r for r in fresh if r["op"] == op and r["direction"] == "backward"
                 and r["impl"] == impls.OURS_FRESH]
        assert len(fused) == 1 and fused[0]["relative_to"] == impls.OURS_NO_RESIDUAL
        plain = next(r for r in fresh if r["op"] == op and r["direction"] == "backward"
                     and r["impl"] == impls.OURS_NO_RESIDUAL)
        assert fused[0]["vs_base"] == pytest.approx(fused[0]["median_s"] / plain["median_s"])
    assert "add + LayerNorm forward, float32, 1 thread(s)" in proc.stdout
    assert "add + RMSNorm backward, float32, 1 thread(s)" in proc.stdout
    assert "copy 2x np.copyto" in proc.stdout and "vs base" in proc.stdout


@pytest.mark.slow
def test_bench_times_quantized_output_against_the_plain_call(tmp_path):
    path = tmp_path / "bench.json"
    proc = _run("bench", "--op", "layer_norm", "add_rms_norm", "--quantize", "int8",
                "float8_e5m2", "--shape", "64,128", "--threads", "1", "--repeats", "2",
                "--no-progress", "--json", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["settings"]["quantize"] == ["int8", "float8_e5m2"]
    per_array = 64 * 128 * 4
    fresh = [r for r in report["results"] if r["phase"] == "fresh"]
    for op, arrays in (("layer_norm", 2), ("add_rms_norm", 4)):
        cell = {r["impl"]: r for r in fresh if r["op"] == op}
        base = cell[impls.OURS_OUT]
        for fmt in ("int8", "float8_e5m2"):
            for suffix in ("", " scale="):
                rec = cell[f"{impls.OURS_OUT} {fmt}{suffix}"]
                assert "error" not in rec, rec
                assert rec["output"] == "prealloc" and rec["relative_to"] == impls.OURS_OUT
                assert rec["vs_base"] == pytest.approx(rec["median_s"] / base["median_s"])
                # y's 4 bytes per element become one byte of codes
                assert rec["bytes"] == (arrays - 1) * per_array + 64 * 128
                assert rec["gbps"] == pytest.approx(rec["bytes"] / rec["median_s"] / 1e9)
    assert "vs base" in proc.stdout and "time vs base:" in proc.stdout


def test_timed_quantized_and_fusion_backward_calls_compute_what_they_claim():
    # The quantized calls' codes are the plain call's y quantized; the fusion's
    # backward is the norm's backward plus grad_residual, as its peers compute it.
    import layernorm as ln

    case = impls.make_case("layer_norm", "forward", "float32", (16, 64), seed=3)
    case.extras["quantize"] = ("int8",)
    timed = {i.name: i for i in impls.ours_impls(case)}
    y = ln.layer_norm(case.x, weight=case.weight, bias=case.bias, eps=impls.EPS)
    codes, scale = timed[f"{impls.OURS_OUT} int8"].fn()
    np.testing.assert_allclose(codes * scale, y, atol=float(scale.max()))
    codes, scale = timed[f"{impls.OURS_OUT} int8 scale="].fn()
    assert scale == impls.STATIC_SCALE and np.abs(codes).max() > 10
    np.testing.assert_allclose(codes * scale, np.clip(y, -128 * scale, 127 * scale),
                               atol=scale)
    for op in ("add_layer_norm", "add_rms_norm"):
        case = impls.make_case(op, "backward", "float32", (16, 64), seed=5)
        case.extras["threads"] = 1
        timed = impls.ours_impls(case) + impls.peer_impls(case)
        names = {i.name: i for i in timed}
        plain = _first_output(names[impls.OURS_NO_RESIDUAL].fn())
        want = plain + case.grad_residual
        assert np.abs(case.grad_residual).max() > 0.1
        for impl in timed:
            if impl.name != impls.OURS_NO_RESIDUAL and impl.name != "layernorm array_api":
                np.testing.assert_allclose(_first_output(impl.fn()), want, rtol=1e-4,
                                           atol=1e-4, err_msg=impl.name)


def test_fusions_are_opt_in_ops():
    parser = cli.build_parser()
    config = settings.settings_from_args(parser.parse_args(["bench", "--threads", "1"]))
    assert config.ops == ("layer_norm", "rms_norm")
    config = settings.settings_from_args(parser.parse_args(
        ["bench", "--threads", "1", "--op", "add_layer_norm,add_rms_norm", "layer_norm"]))
    assert config.ops == ("add_layer_norm", "add_rms_norm", "layer_norm")


def test_compile_calls_the_fusions():
    from layernorm.bench import precompile

    layout = precompile.layouts(1)[0]
    for op in ("add_layer_norm", "add_rms_norm"):
        for direction in ("forward", "backward"):
            precompile.calls(op, direction, "float32", layout)()


def test_compile_quantized_calls_the_quantizing_kernels(monkeypatch):
    from layernorm._backends import _numba as backend
    from layernorm.bench import precompile

    seen = []
    real = backend.quantized_forward

    def spy(*args):
        seen.append((args[1] is not None, args[10] is None))  # a residual; dynamic scale
        return real(*args)

    monkeypatch.setattr(backend, "quantized_forward", spy)
    layout = precompile.layouts(1)[0]
    for op in ("layer_norm", "add_rms_norm"):
        precompile.calls(op, "quantized", "bfloat16", layout)()
    # with and without parameters, each with a per-row and a given scale
    assert seen == [(res, dynamic) for res in (False, True) for _ in range(2)
                    for dynamic in (True, False)]


def test_onnxruntime_workers_block_instead_of_spinning(monkeypatch):
    """ONNX Runtime's spinning idle workers would take the cores from the next timed
    implementation, so the bench builds its session with spinning off."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    created = []
    real_session = ort.InferenceSession

    def recording_session(model, options, **kwargs):
        created.append(options)
        return real_session(model, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recording_session)
    case = impls.make_case("layer_norm", "forward", "float32", (8, 16))
    case.extras["threads"] = 2
    (impl,) = impls.onnxruntime_impls(case)
    import layernorm as ln

    (y,) = impl.fn()
    np.testing.assert_allclose(y, ln.layer_norm(case.x, weight=case.weight, bias=case.bias),
                               rtol=1e-5, atol=1e-5)
    (options,) = created
    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


# --------------------------------------------------------------------------- compile


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "int8"], "--dtype"),
    (["--op", "batch_norm"], "--op"),
    (["--dtype", "float32", "--unknown"], "unrecognized"),
])
def test_compile_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["compile", "--no-progress", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_compile_layouts_select_every_kernel_family():
    from layernorm._backends._numba import PARALLEL_MIN_ELEMENTS
    from layernorm.bench import precompile

    serial = precompile.layouts(1)
    assert not any(lay.parallel for lay in serial)
    both = precompile.layouts(2)
    for lay in both:
        x, _, w, _ = precompile._inputs(lay, "float32")
        n = x.shape[lay.axis]
        assert w.shape == (n,)
        assert (x.size >= PARALLEL_MIN_ELEMENTS) == lay.parallel, lay
        if lay.axis == -1:
            assert ("short" in lay.name) == (n <= 128), lay
            assert ("strided" in lay.name) == (not x.flags.c_contiguous), lay
        else:
            assert x.shape[-1] > 1  # columns: inner size > 1
    assert {"columns", "parallel columns", "strided rows"} <= {lay.name for lay in both}


def test_compile_streamed_layouts_run_the_streaming_kernels():
    # Small calls, streaming stores forced: the streaming entry kernels of every op and
    # direction run (a real call takes them only for outputs larger than half the
    # last-level cache).
    code = textwrap.dedent("""
        from layernorm._backends._numba import entry, kernels as k
        from layernorm.bench import precompile
        for layout in precompile.layouts(1):
            if not layout.streamed:
                continue
            for op in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"):
                for direction in ("forward", "backward", "quantized"):
                    precompile.calls(op, direction, "float32", layout)()
        used = {key[0] for key in entry.entry_points}
        print(sorted(f.__name__ for f in (
            k.ln_stream_forward_serial, k.rms_stream_forward_serial,
            k.ln_stream_tiled_forward_serial, k.rms_stream_tiled_forward_serial,
            k.add_ln_stream_forward_serial, k.add_rms_stream_forward_serial,
            k.ln_stream_backward_serial, k.ln_stream_tiled_backward_serial,
            k.rms_stream_backward_serial) if f in used))
        """)
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[0] == str(sorted([
        "add_ln_stream_forward_serial", "add_rms_stream_forward_serial",
        "ln_stream_forward_serial", "rms_stream_forward_serial",
        "ln_stream_tiled_forward_serial", "rms_stream_tiled_forward_serial",
        "ln_stream_backward_serial", "ln_stream_tiled_backward_serial",
        "rms_stream_backward_serial"]))


def test_compile_parallel_layouts_compile_their_parallel_kernels_at_once():
    # A class's first calls run serially, and a library call compiles a parallel kernel
    # in the background (the serial one runs meanwhile): the compile command's parallel
    # layouts must leave both compiled when they return (they compiled only the serial
    # kernels until 2026-12-06).
    code = textwrap.dedent("""
        from layernorm._backends._numba import entry, kernels as k
        from layernorm._backends._numba import parallel_kernels_compiled_at_once
        from layernorm.bench import precompile
        layout = next(lay for lay in precompile.layouts(2)
                      if lay.name == "parallel long rows")
        precompile.calls("layer_norm", "forward", "float32", layout)()
        with parallel_kernels_compiled_at_once():
            precompile.calls("layer_norm", "forward", "float32", layout)()
            used = {key[0] for key in entry.entry_points}
            print(bool(entry.compiling), k.ln_forward_serial in used,
                  k.ln_forward_parallel in used)
        """)
    env = dict(os.environ, NUMBA_NUM_THREADS="2", LAYERNORM_PARALLEL="auto")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[0] == "False True True"


@pytest.mark.slow
def test_compile_fills_an_empty_numba_cache(tmp_path):
    # One small dtype and op, one thread (no parallel kernels): the cheapest real run.
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "layernorm", "compile", "--dtype", "float32", "--op",
         "rms_norm", "--no-progress"],
        capture_output=True, text=True, timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = list(tmp_path.rglob("*.nbi"))
    data = list(tmp_path.rglob("*.nbc"))
    assert index and data, proc.stdout
    assert "float32   rms_norm    forward" in proc.stdout
    assert f"{len(index) + len(data)} new cache files" in proc.stdout
    assert str(tmp_path) in proc.stdout
    assert "parallel kernels: not compiled" in proc.stdout
