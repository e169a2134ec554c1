"""Bitwise guarantees: batch independence, layout independence, thread-count independence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import layernorm as ln

from .conftest import random_rows


def test_repeated_calls_identical():
    rng = np.random.default_rng(0)
    x = random_rows(rng, (512, 384), "float32")
    gy = random_rows(rng, (512, 384), "float32")
    w = rng.standard_normal(384).astype(np.float32)
    first = ln.layer_norm(x, weight=w, return_stats=True)
    grads = ln.layer_norm_backward(gy, x, first[1], first[2], w)
    for _ in range(3):
        again = ln.layer_norm(x, weight=w, return_stats=True)
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(grads, ln.layer_norm_backward(gy, x, first[1], first[2], w), strict=True):
            np.testing.assert_array_equal(a, b)


_THREAD_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    import layernorm as ln
    from layernorm._backends._numba import entry

    out = {}
    rng = np.random.default_rng(1234)
    # The two accumulation types (16-bit data runs the float32 kernels' arithmetic and
    # block split; each dtype costs its parallel kernels' compile time, ~25 s here).
    for dtype in ("float32", "float64"):
        # unit-stride rows, short rows, channels-first columns, one block of long rows
        # (the backward splits its columns over threads): each its own kernels
        for shape, axis in (((1024, 300), -1), ((64, 96, 40), 1), ((4096, 64), -1),
                            ((40, 2100), -1)):
            x = (3 + rng.standard_normal(shape)).astype(dtype)
            gy = rng.standard_normal(shape).astype(dtype)
            w = rng.standard_normal(shape[axis]).astype(np.float32)
            y, mean, rstd = ln.layer_norm(x, weight=w, bias=w, axis=axis, return_stats=True)
            grads = ln.layer_norm_backward(gy, x, mean, rstd, w, axis=axis)
            yr, rs = ln.rms_norm(x, weight=w, axis=axis, return_stats=True)
            rgrads = ln.rms_norm_backward(gy, x, rs, w, axis=axis)
            h = hashlib.sha256()
            for a in (y, mean, rstd, *grads, yr, rs, *rgrads):
                h.update(np.ascontiguousarray(a).tobytes())
            out[f"{dtype}{shape}"] = h.hexdigest()
    import numba
    out["threads"] = numba.get_num_threads()
    # The entry kernels that ran (each call's kernel is compiled or loaded through entry).
    out["kernels"] = sorted({key[0].py_func.__name__ for key in entry.entry_points})
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_thread_count_does_not_change_any_bit():
    """Forward, stats and gradients are identical with 1 and 2 Numba threads: serial
    kernels in one process, parallel kernels in the other.

    ``LAYERNORM_PARALLEL=always``: by default a size class starts serial, so each
    call of a fresh process would run the serial kernel at 2 threads too. The two
    processes run at once (each compiles its own kernels, one core each).
    """
    procs = []
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads, LAYERNORM_PARALLEL="always")
        procs.append(subprocess.Popen([sys.executable, "-c", _THREAD_SCRIPT], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert results[0].pop("threads") == 1
    assert results[1].pop("threads") == 2
    serial, parallel = (set(r.pop("kernels")) for r in results)
    # Every kernel must differ between the runs, or the comparison would prove nothing.
    assert serial and all(name.endswith("_serial") for name in serial), serial
    # One block of rows: the backward's parallel kernel splits columns (same bits).
    # Float32 LayerNorm rows of 2100: the serial kernel writes rows whole, the parallel
    # one in column tiles (TILED_PARALLEL_MIN_BYTES; the same bits).
    split = {"ln_tiled_backward_serial": "ln_split_backward_parallel",
             "rms_paired_backward_serial": "rms_split_backward_parallel",
             "ln_seq_forward_serial": "ln_tiled_forward_parallel"}
    assert parallel == {split.get(name, name.replace("_serial", "_parallel"))
                        for name in serial}, parallel
    assert results[0] == results[1]
