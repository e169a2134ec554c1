"""Calls from many Python threads at once, and from a forked child after a parallel kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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


_FORK_SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys
    import numpy as np
    import layernorm as ln

    def work():
        x = np.random.default_rng(5).standard_normal((256, 512)).astype(np.float32)
        return float(ln.layer_norm(x).sum())

    def child(queue):
        queue.put(work())

    if __name__ == "__main__":
        expected = work()  # the parent has now run the parallel kernel
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=child, args=(queue,))
        proc.start()
        value = queue.get(timeout=120)
        proc.join(timeout=60)
        sys.exit(0 if proc.exitcode == 0 and value == expected else 1)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method is Linux-only here")
def test_forked_child_after_parallel_kernel(tmp_path):
    # A clean interpreter: the test process may hold threads of other libraries (JAX)
    # that make fork unsafe for reasons of their own.
    script = tmp_path / "fork_after_parallel.py"
    script.write_text(_FORK_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, NUMBA_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr


_FORK_WHILE_COMPILING = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import layernorm as ln

    x = np.random.default_rng(6).standard_normal((512, 1024)).astype(np.float32)
    expected = ln.layer_norm(x)
    for _ in range(2):
        ln.layer_norm(x)  # a call of this size starts the parallel kernel's compilation
    pid = os.fork()  # at once: the parent's hook waits for that compilation
    if pid == 0:
        ok = all(np.array_equal(ln.layer_norm(x), expected) for _ in range(5))
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method is Linux-only here")
def test_fork_while_a_parallel_kernel_compiles(tmp_path):
    # A cache holding the serial kernel only (an earlier process made small calls):
    # a parallel-sized call then compiles the parallel kernel on a thread of its own.
    # A fork at that moment hung in the parent (its hook waited for the compiling
    # thread, which waited for logging's lock, held by logging's own fork hook), and the
    # child was killed by GNU OpenMP once it ran a parallel kernel (the parent had
    # started its threads by compiling one, without running it).
    env = dict(os.environ, NUMBA_NUM_THREADS="2", NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               LAYERNORM_PARALLEL="auto")
    subprocess.run([sys.executable, "-c", "import numpy as np, layernorm as ln; "
                    "ln.layer_norm(np.ones((32, 1024), np.float32))"],
                   check=True, timeout=300, env=env)
    script = tmp_path / "fork_while_compiling.py"
    script.write_text(_FORK_WHILE_COMPILING)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
