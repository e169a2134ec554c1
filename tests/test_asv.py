"""The asv suite in benchmarks/ must not rot: ``asv check`` and a quick run of a subset.

asv runs in this interpreter's environment (``--python=same``), with its machine file,
results and HTML in a temporary directory, so nothing is written into the checkout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("asv")

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

#: One parameter combination of each kind of benchmark (no optional library needed).
QUICK_SUBSET = (
    r"Forward\.time_forward\('layer_norm', 'float32', '4096x768', 'numba'\)",
    r"Backward\.time_backward\('rms_norm', 'float32', '4096x768', 'numba'\)",
    r"ForwardBandwidth\.track_pct_of_copy\('layer_norm', 'float32', '4096x768', 'out'\)",
    r"ForwardPeakMemory\.peakmem_forward\('layer_norm', '4096x768'\)",
    r"ForwardInCache\.time_forward_in_cache\('rms_norm', 'float32', '64x768'\)",
    r"ForwardInCache\.track_pct_of_copy_in_cache\('layer_norm', 'float32', '64x768'\)",
    r"Accuracy\.track_max_abs_error\('layer_norm', 'numba'\)",
    r"Import\.timeraw_import_layernorm",
    r"FirstCall\.timeraw_first_call\('cold', '1x768'\)",
    r"AddNorm\.time_add_norm\('add_rms_norm', 'float32', '4096x768', 'fused'\)",
    r"Quantized\.time_quantized\('layer_norm', 'int8', '4096x768'\)",
)


def asv_workspace(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A copy of benchmarks/asv.conf.json pointing its outputs into ``tmp``, and an
    environment whose HOME (where asv keeps its machine file) is ``tmp``."""
    conf = json.loads((BENCHMARKS / "asv.conf.json").read_text())
    conf.update(
        repo=str(ROOT), benchmark_dir=str(BENCHMARKS), env_dir=str(tmp / "env"),
        results_dir=str(tmp / "results"), html_dir=str(tmp / "html"),
    )
    path = tmp / "asv.conf.json"
    path.write_text(json.dumps(conf, indent=1))
    # asv drops PYTHONPATH from its benchmark processes but passes ASV_PYTHONPATH on, so
    # they import this checkout's layernorm (common.py times with layernorm.bench.timing),
    # not whichever checkout happens to be installed in the interpreter.
    env = dict(os.environ, HOME=str(tmp), PYTHONUNBUFFERED="1",
               ASV_PYTHONPATH=str(ROOT / "src"))
    return path, env


def asv(conf: Path, env: dict[str, str], *args: str, timeout: float = 300
        ) -> subprocess.CompletedProcess:
    """Run asv with this interpreter; fails the test with asv's output on error."""
    proc = subprocess.run(
        [sys.executable, "-m", "asv", *args, "--config", str(conf)], cwd=BENCHMARKS, env=env,
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    assert proc.returncode == 0, f"asv {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def quick_run(tmp: Path, subset: tuple[str, ...] = QUICK_SUBSET, save: bool = False
              ) -> tuple[Path, dict[str, str], subprocess.CompletedProcess]:
    """``asv run --python=same --quick`` on ``subset``; with ``save`` the results are
    recorded against HEAD (what ``asv publish`` needs)."""
    conf, env = asv_workspace(tmp)
    asv(conf, env, "machine", "--yes", "--machine", "ci")
    args = ["run", "--python=same", "--quick", "--show-stderr", "--machine", "ci"]
    for regex in subset:
        args += ["--bench", regex]
    if save:
        args += ["--set-commit-hash", head_commit()]
    return conf, env, asv(conf, env, *args)


def git_usable() -> bool:
    if shutil.which("git") is None:
        return False
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          check=False)
    return proc.returncode == 0


@pytest.mark.slow
def test_asv_check(tmp_path):
    conf, env = asv_workspace(tmp_path)
    asv(conf, env, "machine", "--yes", "--machine", "ci")
    proc = asv(conf, env, "check", "--python=same")
    assert "No problems found" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not git_usable(), reason="asv needs the git checkout")
def test_asv_quick_run(tmp_path):
    _, _, proc = quick_run(tmp_path, save=True)
    out = proc.stdout + proc.stderr
    assert "failed" not in out.lower(), out
    results = list((tmp_path / "results" / "ci").glob("*existing*.json"))
    assert len(results) == 1, out
    data = json.loads(results[0].read_text())
    names = set(data["results"])
    expected = {
        "bench_forward.Forward.time_forward", "bench_backward.Backward.time_backward",
        "bench_forward.ForwardBandwidth.track_pct_of_copy",
        "bench_forward.ForwardPeakMemory.peakmem_forward",
        "bench_forward.ForwardInCache.time_forward_in_cache",
        "bench_forward.ForwardInCache.track_pct_of_copy_in_cache",
        "bench_accuracy.Accuracy.track_max_abs_error",
        "bench_import.Import.timeraw_import_layernorm",
        "bench_import.FirstCall.timeraw_first_call",
        "bench_fusions.AddNorm.time_add_norm", "bench_fusions.Quantized.time_quantized",
    }
    assert expected <= names, names
    # Each selected benchmark produced a positive number (the first entry of a result
    # is the list of values, one per parameter combination; unselected ones are NaN).
    for name in expected:
        measured = measured_values(data["results"][name][0])
        assert len(measured) == 1 and measured[0] > 0, (name, data["results"][name][0])
    accuracy = measured_values(data["results"]["bench_accuracy.Accuracy.track_max_abs_error"][0])
    assert accuracy[0] <= 1e-5  # LayerNorm on 1e4 + randn rows: stable statistics


def measured_values(values: object) -> list[float]:
    """The values asv measured, without the NaN/None of parameters not selected."""
    values = values if isinstance(values, list) else [values]
    return [v for v in values if v is not None and not math.isnan(v)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_benchmark_parameters_run_or_skip(dtype):
    # In-process sweep of every op x backend for one small shape: each combination
    # either runs or raises NotImplementedError (asv's "skipped"), never anything else.
    import itertools
    import warnings

    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import bench_accuracy, bench_backward, bench_forward
    finally:
        sys.path.remove(str(ROOT))
    ran = 0
    cases = [(bench_forward.Forward, "time_forward"), (bench_backward.Backward, "time_backward"),
             (bench_forward.ForwardOut, "time_forward_out")]
    for cls, method in cases:
        for params in itertools.product(*cls.params):
            if params[1] != dtype or params[2] != "1x768":
                continue
            bench = cls()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    bench.setup(*params)
                    getattr(bench, method)(*params)
            except NotImplementedError:
                continue
            ran += 1
    if dtype == "float32":
        for params in itertools.product(*bench_accuracy.Accuracy.params):
            bench = bench_accuracy.Accuracy()
            try:
                bench.setup(*params)
            except NotImplementedError:
                continue
            assert bench.track_max_abs_error(*params) > 0
            ran += 1
    assert ran >= 2 * 2 * 2 + 2  # at least numba and array_api, both ops, both passes


def test_cold_first_call_starts_from_an_empty_numba_cache(monkeypatch):
    # The cold-start benchmark is only cold if its setup points Numba at a new, empty
    # folder before the timed code imports layernorm (and, through it, Numba).
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import bench_import
    finally:
        sys.path.remove(str(ROOT))
    monkeypatch.setenv("NUMBA_CACHE_DIR", "unchanged")
    for shape in bench_import.FirstCall.params[1]:
        timed, setup = bench_import.FirstCall().timeraw_first_call("cold", shape)
        assert "import layernorm" in timed and "layer_norm(x)" in timed
        assert "import layernorm" not in setup
        namespace: dict = {}
        exec(setup.split("import numpy as np")[0], namespace)  # the cache folder part
        folder = Path(namespace["cache_dir"])
        assert os.environ["NUMBA_CACHE_DIR"] == str(folder)
        assert folder.is_dir() and not any(folder.iterdir())
        shutil.rmtree(folder)
