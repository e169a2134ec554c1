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

from .conftest import asarray, random_rows, to_numpy


@pytest.mark.parametrize("n", [3, 64, 768, 1000, 5000])
def test_row_alone_equals_row_in_batch(native_xp, dtype_name, n):
    rng = np.random.default_rng(n)
    batch = random_rows(rng, (300, n), dtype_name, scale=3.0)
    batch[::7] = random_rows(rng, batch[::7].shape, dtype_name, loc=1e3, scale=50.0)
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    xs = asarray(native_xp, batch, dtype_name)
    ws, bs = asarray(native_xp, w, "float32"), asarray(native_xp, b, "float32")
    y_all, mean_all, rstd_all = ln.layer_norm(xs, weight=ws, bias=bs, return_stats=True)
    r_all, rs_all = ln.rms_norm(xs, weight=ws, return_stats=True)
    for r in (0, 1, 150, 299):
        alone = asarray(native_xp, batch[r:r + 1], dtype_name)
        y1, m1, s1 = ln.layer_norm(alone, weight=ws, bias=bs, return_stats=True)
        np.testing.assert_array_equal(to_numpy(y1)[0], to_numpy(y_all)[r])
        np.testing.assert_array_equal(to_numpy(m1)[0], to_numpy(mean_all)[r])
        np.testing.assert_array_equal(to_numpy(s1)[0], to_numpy(rstd_all)[r])
        r1, rs1 = ln.rms_norm(alone, weight=ws, return_stats=True)
        np.testing.assert_array_equal(to_numpy(r1)[0], to_numpy(r_all)[r])
        np.testing.assert_array_equal(to_numpy(rs1)[0], to_numpy(rs_all)[r])
        # The same row as a 1-D input and inside a 3-D batch.
        y1d = ln.layer_norm(asarray(native_xp, batch[r], dtype_name), weight=ws, bias=bs)
        np.testing.assert_array_equal(to_numpy(y1d), to_numpy(y_all)[r])
    y3 = ln.layer_norm(asarray(native_xp, batch.reshape(3, 100, n), dtype_name), weight=ws,
                       bias=bs)
    np.testing.assert_array_equal(to_numpy(y3).reshape(300, n), to_numpy(y_all))


@pytest.mark.parametrize("n", [5, 130, 1000])
def test_channels_first_equals_rows(native_xp, dtype_name, n):
    """axis=1 of (N, C, H, W) gives, bit for bit, what the rows path gives per pixel."""
    rng = np.random.default_rng(n)
    img = random_rows(rng, (2, n, 3, 5), dtype_name, loc=2.0)
    w = rng.standard_normal(n).astype(np.float32)
    xs = asarray(native_xp, img, dtype_name)
    y = to_numpy(ln.layer_norm(xs, axis=1, weight=asarray(native_xp, w, "float32")))
    rows = np.ascontiguousarray(np.moveaxis(img, 1, -1))
    y_rows = to_numpy(ln.layer_norm(asarray(native_xp, rows, dtype_name),
                                    weight=asarray(native_xp, w, "float32")))
    np.testing.assert_array_equal(y, np.moveaxis(y_rows, -1, 1))
    r = to_numpy(ln.rms_norm(xs, axis=1))
    r_rows = to_numpy(ln.rms_norm(asarray(native_xp, rows, dtype_name)))
    np.testing.assert_array_equal(r, np.moveaxis(r_rows, -1, 1))
    # And a single pixel normalized alone.
    pixel = asarray(native_xp, img[1:2, :, 2:3, 4:5], dtype_name)
    y_pixel = to_numpy(ln.layer_norm(pixel, axis=1, weight=asarray(native_xp, w, "float32")))
    np.testing.assert_array_equal(y_pixel[0, :, 0, 0], y[1, :, 2, 4])


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

