"""The GPU check script's own logic, without a GPU: arguments, guarding, the final table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gpu_check(monkeypatch, tmp_path):
    """benchmarks/gpu_check.py as a module, writing into a temporary $OUT."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    return gpu_check


def test_help_lists_every_section():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for word in ("--sections", "--probe", "--dry-run", "--sanitizer-timeout", "--layouts"):
        assert word in proc.stdout


def test_arguments(gpu_check):
    args = gpu_check.parse_args([])
    assert args.sections == list(gpu_check.SECTIONS)
    assert set(args.dtypes) == {"float32", "bfloat16"} and set(args.layouts) == {"contig",
                                                                                "strided"}
    args = gpu_check.parse_args(["--no-tests", "--no-bench", "--widths", "64,768"])
    assert "tests" not in args.sections and "bench" not in args.sections
    assert args.widths == [64, 768]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--sections", "tests,nonsense"])


def test_a_failing_section_is_a_row_not_a_crash(gpu_check):
    results = []

    def boom():
        raise RuntimeError("device lost")

    gpu_check.guarded(results, "invariance (bits)", boom)
    gpu_check.guarded(results, "torch agreement", lambda: ("PASS", "fine"))
    gpu_check.guarded(results, "tests", lambda: [gpu_check.Check("tests: cuda", "FAIL", 1.0,
                                                                 "exit 1: 2 failed")])
    assert [c.status for c in results] == ["ERROR", "PASS", "FAIL"]
    text = gpu_check.summary_table(results)
    lines = text.splitlines()
    assert lines[0].startswith("section") and "RuntimeError: device lost" in lines[1]
    assert lines[-1] == "VERDICT: FAILED (invariance (bits), tests: cuda)"
    ok = gpu_check.summary_table([gpu_check.Check("bench", "PASS"),
                                  gpu_check.Check("torch", "SKIP")])
    assert ok.splitlines()[-1] == "VERDICT: all sections passed or skipped"


def test_pytest_options_survive_the_gpu_image(gpu_check, monkeypatch):
    """The GPU image has pytest-benchmark, xdist and pytest-timeout: benchmark's xdist
    warning (an error under filterwarnings) is disabled, a slow test fails alone."""
    found = {"xdist": True, "pytest_timeout": True}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found.get(name))
    opts = gpu_check.pytest_options(8, per_test_timeout=90)
    assert opts[opts.index("no:benchmark") - 1] == "-p"
    assert opts[opts.index("-n") + 1] == "8"
    assert "--timeout=90" in opts and "--timeout-method=thread" in opts
    found.clear()
    bare = gpu_check.pytest_options(8, per_test_timeout=90)
    assert "-n" not in bare and not any(o.startswith("--timeout") for o in bare)


def test_cuda_tests_exist_and_skip_the_slow_compiles(gpu_check):
    """Each node id of the GPU run names a test file or function that exists, and the
    every-instantiation compiles (the compile section's job there) are not among them."""
    for node in gpu_check.CUDA_TESTS:
        path, _, func = node.partition("::")
        text = (ROOT / path).read_text()
        assert not func or f"def {func}(" in text, node
        assert "every_instantiation" not in node


def test_pytest_summary_line(gpu_check):
    text = "....F\n=== 1 failed, 4 passed, 3 skipped in 2.0s ===\n"
    assert gpu_check._pytest_summary(text) == "1 failed, 4 passed, 3 skipped in 2.0s"
    assert gpu_check._pytest_summary("") == "no output"


def test_sanitizer_missing_is_skipped(gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check, "find_sanitizer", lambda: None)
    checks = gpu_check.run_sanitizers(gpu_check.SANITIZER_TOOLS, 10)
    assert [c.name for c in checks] == ["sanitizer: memcheck", "sanitizer: racecheck",
                                        "sanitizer: synccheck"]
    assert {c.status for c in checks} == {"SKIP"}


def test_sanitizer_verdict_reads_the_summary(gpu_check, monkeypatch, tmp_path):
    """A clean exit without "0 errors" (or without the probe finishing) is a failure."""
    script = tmp_path / "fake-sanitizer"
    script.write_text("#!/bin/sh\necho 'probe: done'\necho '========= ERROR SUMMARY: 2 errors'\n")
    script.chmod(0o755)
    monkeypatch.setattr(gpu_check, "find_sanitizer", lambda: str(script))
    (check,) = gpu_check.run_sanitizers(["memcheck"], 10)
    assert check.status == "FAIL" and "2 errors" in check.detail
    script.write_text("#!/bin/sh\necho 'probe: done'\necho '========= ERROR SUMMARY: 0 errors'\n")
    (check,) = gpu_check.run_sanitizers(["memcheck"], 10)
    assert check.status == "PASS"


def test_without_gpu_the_table_still_comes_last(gpu_check, capsys):
    """No CuPy here: exit 2, and the last lines printed are the table with the reason."""
    code = gpu_check.main(["--sections", "invariance"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 2
    assert out[-1].startswith("VERDICT: FAILED") and out[-2].startswith("gpu")


def test_bench_table_has_layout_column(gpu_check):
    rows = [gpu_check.Row("ln_fwd", "bfloat16", 768, 8192, 2 * 8192 * 768 * 2, ours_us=10.0,
                          copy_us=8.0, layout="strided"),
            gpu_check.Row("ln_bwd", "float32", 64, 8192, 0, error="skipped: time budget")]
    text = gpu_check.table(rows, "== header")
    assert "layout" in text.splitlines()[1]
    assert "strided" in text.splitlines()[2] and "80%" in text.splitlines()[2]
    assert "ERROR skipped" in text.splitlines()[3]


@pytest.mark.slow
def test_dry_run(gpu_check, capsys):
    """The benchmark code path on host arrays (Numba kernels), both layouts."""
    code = gpu_check.main(["--dry-run", "--sections", "bench,torch", "--rows", "8",
                           "--widths", "64", "--ops", "ln_fwd,ln_bwd,ln_fwd_q8,add_rms_f8,"
                           "ln_bwd_res", "--dtypes", "float32",
                           "--layouts", "contig,strided"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0, "\n".join(out[-30:])
    assert out[-1] == "VERDICT: all sections passed or skipped"
    assert any("strided" in line and "ln_bwd" in line for line in out)
    saved = json.loads((Path(os.environ["OUT"]) / "bench-dry-run.json").read_text())["rows"]
    assert saved and all(r["host_us"] > 0 for r in saved if not r["error"])


@pytest.mark.slow
def test_device_checks_logic_on_numba(gpu_check):
    """The device sections' own logic (layouts, bit comparisons, the probe's cases) on
    NumPy arrays and the Numba backend, which has the CUDA backend's interface."""
    import numpy as np

    from layernorm._backends import _numba

    assert gpu_check.probe(np, _numba, sms=1) == 0
    status, detail = gpu_check.check_invariance(np, _numba, dtypes=("bfloat16",), max_n=70)
    assert status == "PASS", detail
    status, detail = gpu_check.check_subnormal(np, _numba)
    assert status == "PASS", detail
    status, detail = gpu_check.check_quantized(np, _numba, dtypes=("bfloat16",), max_n=70)
    assert status == "PASS", detail


@pytest.mark.slow
def test_shell_wrapper_bundles_the_logs(tmp_path):
    """gpu_check.sh keeps the exit status and leaves the result files plus one archive
    of the per-run logs (a remote GPU machine may hand back only a few files)."""
    (tmp_path / "pytest-cuda.log").write_text("4 passed")
    (tmp_path / "sanitizer-memcheck.log").write_text("ERROR SUMMARY: 0 errors")
    # The wrapper runs the python3 on PATH: make it this interpreter's (a venv's).
    env = dict(os.environ, OUT=str(tmp_path),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run",
                           "--sections", "bench", "--rows", "8", "--widths", "64", "--ops",
                           "ln_fwd", "--dtypes", "float32", "--layouts", "contig"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "gpu_check.log" in names and "logs.tar.gz" in names
    assert not any(n.startswith(("pytest-", "sanitizer-")) for n in names), names
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["pytest-cuda.log", "sanitizer-memcheck.log"]
    failing = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"),
                              "--sections", "nonsense"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert failing.returncode == 2  # argparse's error status comes through the tee


@pytest.mark.slow
def test_a_failing_torch_peer_keeps_our_numbers(gpu_check):
    """On the first GPU run torch raised for bfloat16 x beside float32 parameters, and
    the whole row was lost; now only the torch column is, with the reason."""
    from layernorm._backends import _numba

    def refuse(*args, **kwargs):
        raise RuntimeError("expected scalar type BFloat16 but found Float")

    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True),
                                  nn=types.SimpleNamespace(functional=None),
                                  from_dlpack=refuse)
    cupy = gpu_check.FakeCupy()
    row = gpu_check.bench_case(cupy, _numba, torch, gpu_check.Timer(cupy), "ln_fwd",
                               "float32", 64, 8, "contig")
    assert not row.error and row.ours_us > 0 and row.copy_us > 0
    assert row.torch_us is None and "BFloat16" in row.extra["torch_error"]
