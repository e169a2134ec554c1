"""Serial against 2-thread calls beside busy processes: median and p90, interleaved.

Usage (from the repository root)::

    python benchmarks/contention.py BUSY

starts ``BUSY`` processes that spin (``while True: pass``), then times float32
``layer_norm(x, out=y)`` at (2048, 512) and (8192, 1024) in interleaved rounds: the serial
kernel (``never``), the default choice (``auto``, :mod:`layernorm._backends._numba.schedule`)
and forced parallel kernels (``always``), on 2 Numba threads. Prints each one's median and
p90 and their ratios to the serial ones.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numba
import numpy as np

import layernorm as ln
from layernorm._backends import _numba as backend

SHAPES = [(2048, 512), (8192, 1024)]
ROUNDS, CALLS = 8, 25


def run(policy: str, threads: int, x: np.ndarray, y: np.ndarray, calls: int) -> list[float]:
    backend.chooser.policy = policy
    numba.set_num_threads(threads)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        ln.layer_norm(x, out=y)
        times.append(time.perf_counter() - start)
    return times


def main(busy: int) -> None:
    rng = np.random.default_rng(0)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    time.sleep(0.5)
    try:
        for shape in SHAPES:
            x = rng.standard_normal(shape).astype(np.float32)
            y = np.empty_like(x)
            variants = [("serial", "never", 1), ("auto", "auto", 2), ("always", "always", 2)]
            for _, policy, threads in variants:
                run(policy, threads, x, y, 3)
            res: dict[str, list[float]] = {name: [] for name, _, _ in variants}
            for _ in range(ROUNDS):
                for name, policy, threads in variants:
                    res[name] += run(policy, threads, x, y, CALLS)
            s50, s90 = np.median(res["serial"]), np.percentile(res["serial"], 90)
            line = f"busy={busy} {shape}: serial median {s50 * 1e3:.3f} p90 {s90 * 1e3:.3f} ms"
            for name in ("auto", "always"):
                m, p = np.median(res[name]), np.percentile(res[name], 90)
                line += (f" | {name} median {m * 1e3:.3f} ({m / s50:.2f}x)"
                         f" p90 {p * 1e3:.3f} ({p / s90:.2f}x)")
            print(line, flush=True)
    finally:
        for p in procs:
            p.kill()
        backend.chooser.policy = "auto"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
