"""Calls from many Python threads at once, and from a forked child after a parallel kernel."""

from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import layernorm as ln


def _work(seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((256, 512)).astype(np.float32)  # large enough for threads
    gy = rng.standard_normal((256, 512)).astype(np.float32)
    y, mean, rstd = ln.layer_norm(x, return_stats=True)
    grads = ln.layer_norm_backward(gy, x, mean, rstd)
    return (y, *grads, ln.rms_norm(x))


def test_eight_python_threads_at_once():
    expected = [_work(seed) for seed in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(3):
            results = list(pool.map(_work, range(8)))
            for got, want in zip(results, expected, strict=True):
                for a, b in zip(got, want, strict=True):
                    np.testing.assert_array_equal(a, b)


def _child(queue) -> None:
    queue.put(float(_work(5)[0].sum()))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method is Linux-only here")
def test_forked_child_after_parallel_kernel():
    expected = float(_work(5)[0].sum())  # the parent has now run the parallel kernels
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    value = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert value == expected
