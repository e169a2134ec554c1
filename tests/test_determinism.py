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
    import ml_dtypes
    import layernorm as ln

    out = {}
    rng = np.random.default_rng(1234)
    for dtype in ("float32", "float64", "bfloat16", "float16"):
        for shape, axis in (((1024, 300), -1), ((64, 96, 40), 1), ((4096, 64), -1)):
            dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
            x = (3 + rng.standard_normal(shape)).astype(dt)
            gy = rng.standard_normal(shape).astype(dt)
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
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_thread_count_does_not_change_any_bit(tmp_path):
    """Forward, stats and parameter gradients are identical with 1 and 2 Numba threads."""
    results = []
    for threads in ("1", "2"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads)
        proc = subprocess.run([sys.executable, "-c", _THREAD_SCRIPT], env=env,
                              capture_output=True, text=True, check=True, timeout=600)
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert results[0].pop("threads") == 1
    assert results[1].pop("threads") == 2
    assert results[0] == results[1]

