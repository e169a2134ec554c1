"""``python -m layernorm bench --roofline``: its parts time the kernel's own arithmetic.

No timing assertions: these check that the separately compiled passes give the fused
kernel's bits (otherwise the breakdown would time other code), that the in-cache views
compute every row, and the report's structure.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import layernorm as ln
from layernorm._backends import _numba as backend
from layernorm._backends._numba import passes
from layernorm.bench import cli, roofline


def _inputs(rows, n, seed=3):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * 3.0 + 50.0).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    return x, w, b


@pytest.mark.parametrize("rows, n", [(5, 129), (9, 300), (3, 2048)])
def test_the_two_passes_alone_give_layer_norms_bits(rows, n):
    x, w, b = _inputs(rows, n)
    expected = ln.layer_norm(x, (n,), w, b, eps=float(roofline.EPS))
    shift, mu, rstd = (np.empty(rows, np.float32) for _ in range(3))
    tab = backend.load_kernels().merge_table(n, np.dtype(np.float32))
    passes.statistics_pass(x, roofline.EPS, tab, shift, mu, rstd)
    y = np.full_like(x, np.nan)
    passes.output_pass(x, w, b, shift, mu, rstd, y, False)
    np.testing.assert_array_equal(y, expected)
    streamed = np.full_like(x, np.nan)  # the streaming-store pass: the same bits
    passes.output_pass(x, w, b, shift, mu, rstd, streamed, True)
    np.testing.assert_array_equal(streamed, expected)
    # The statistics themselves against float64 (shift + shifted mean is the mean).
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(shift.astype(np.float64) + mu, x64.mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x64.var(axis=1) + 1e-5), rtol=1e-5)


def test_check_parts_catches_passes_that_differ():
    x, w, b = _inputs(4, 256)
    parts = roofline._Parts(x, w, b, np.empty_like(x), False)
    roofline.check_parts(parts)  # the real passes agree
    parts.output = lambda: parts.y.fill(0.5)  # a wrong output pass
    with pytest.raises(RuntimeError, match="differ"):
        roofline.check_parts(parts)


@pytest.mark.parametrize("n", [64, 300])
def test_in_cache_views_compute_every_row_from_one_row(n):
    x, w, b = _inputs(1, n)
    rows = 37
    xs = roofline._one_row_repeated(x[0], rows)
    ys = roofline._one_row_repeated(np.empty(n, np.float32), rows)
    assert xs.strides[0] == 0 and ys.strides[0] == 0
    parts = roofline._Parts(xs, w, b, ys, False)
    parts.kernel()
    np.testing.assert_array_equal(ys[0], ln.layer_norm(x, (n,), w, b)[0])
    expected_rstd = parts.rstd[0]
    assert np.all(parts.rstd == expected_rstd) and np.isfinite(expected_rstd)


def test_read_and_write_passes():
    x, _, _ = _inputs(7, 100)
    assert passes.read_pass(x) == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-5)
    y = np.zeros_like(x)
    passes.write_pass(y, np.float32(2.5))
    assert np.all(y == 2.5)


def test_measure_reports_every_part():
    res = roofline.measure((16, 256), repeats=1, target_s=0.0)
    times = res["seconds"]
    assert set(times) == {"copy", "read x", "write y", "kernel", "statistics pass",
                          "output pass", "in cache: kernel", "in cache: statistics pass",
                          "in cache: output pass"}
    assert all(t > 0 and math.isfinite(t) for t in times.values())
    # Short rows take the short-row path: only the fused kernel is timed.
    short = roofline.measure((16, 64), repeats=1, target_s=0.0)["seconds"]
    assert "statistics pass" not in short and "in cache: kernel" in short
    text = roofline.format_report([res])
    assert "16x256" in text and "floor:" in text and "in cache: output pass" in text


def test_measure_backward_reports_the_kernel_and_its_floors():
    res = roofline.measure_backward((16, 256), repeats=1, target_s=0.0)
    assert res["direction"] == "backward"
    times = res["seconds"]
    assert set(times) == {"copy", "kernel", "in cache: kernel"}
    assert all(t > 0 and math.isfinite(t) for t in times.values())
    text = roofline.format_report([res])
    assert "LayerNorm backward" in text and "grad_y + x (np.add)" in text


def test_in_cache_backward_views_compute_every_row_from_one_row():
    from layernorm._backends._numba import GRAD_ROW_BLOCK, LN_BACKWARD_WRITES, entry
    from layernorm._backends._numba import kernels as k

    rows, n = 70, 300
    x, w, _ = _inputs(1, n)
    gy = _inputs(1, n, seed=8)[0] - 50.0
    _, mean, rstd = ln.layer_norm(x, (n,), w, return_stats=True)
    expected = ln.layer_norm_backward(gy, x, mean, rstd, w)[0][0]
    views = [roofline._one_row_repeated(a, rows) for a in (gy[0], x[0], np.empty(n, np.float32))]
    partials = np.zeros((2, -(-rows // GRAD_ROW_BLOCK), n), np.float32)
    entry.call(k.ln_backward_serial, LN_BACKWARD_WRITES, views[0], views[1],
                np.repeat(mean.ravel(), rows), np.repeat(rstd.ravel(), rows), w, views[2],
                partials, GRAD_ROW_BLOCK, views[1], False)
    np.testing.assert_array_equal(views[2][0], expected)


@pytest.mark.slow
def test_cli_roofline(tmp_path):
    path = tmp_path / "roofline.json"
    proc = subprocess.run(
        [sys.executable, "-m", "layernorm", "bench", "--roofline", "--shape", "32,512",
         "--repeats", "1", "--no-progress", "--json", str(path)],
        capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "where the time goes" in proc.stdout and "32x512" in proc.stdout
    (res,) = json.loads(path.read_text())["roofline"]
    assert res["shape"] == [32, 512] and res["seconds"]["kernel"] > 0


@pytest.mark.parametrize("flag", [["--dtype", "float64"], ["--threads", "1"],
                                  ["--op", "rms_norm"]])
def test_cli_roofline_rejects_what_it_does_not_measure(flag, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--roofline", "--no-progress", *flag])
    assert info.value.code == 2
    assert "--roofline" in capsys.readouterr().err


def test_ceiling_kernels_compute_layer_norm(tmp_path):
    """benchmarks/ceiling.py compares the library with hand-written C of the same row
    arithmetic: that C must be a correct LayerNorm (a fast wrong kernel is no ceiling),
    on both of its paths (rows of 64 and 128 sixteen at a time, longer rows pipelined)."""
    import platform

    from benchmarks import ceiling

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("needs x86-64")
    try:
        binary = ceiling.compile_kernels(tmp_path)
    except RuntimeError as error:  # no C compiler, or no AVX-512 here
        pytest.skip(str(error)[:300])
    for n, rows in [(64, 40), (128, 20), (256, 9), (1024, 3)]:
        out = subprocess.run([str(binary), str(n), str(rows), "16", "2064"],
                             capture_output=True, text=True, check=True).stdout.split()
        ran, kernel_us, copy_us, error = int(out[0]), *map(float, out[1:])
        assert ran == (rows // 16 * 16 if n <= 128 else rows)
        assert kernel_us > 0 and copy_us > 0
        assert error < 5e-6, (n, error)  # outputs of magnitude ~2 against float64
    bad = subprocess.run([str(binary), "100", "8", "0", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "N must be" in bad.stderr
    few = subprocess.run([str(binary), "64", "15", "0", "0"], capture_output=True, text=True)
    assert few.returncode == 2 and "ROWS must be" in few.stderr
