"""``python -m layernorm bench --dask``: Dask throughput against the NumPy path.

The input is generated on the workers (seeded) and persisted there, so the timing
covers what a cluster user pays to normalize data that already lives on it: the
``map_blocks`` graph of :func:`layernorm.layer_norm` on a Dask array, run with
``persist`` and waited for, nothing gathered back to the client. The NumPy path
times ``layernorm.layer_norm`` on the same data gathered into one NumPy array.

Worker processes run Numba with one thread each (``NUMBA_NUM_THREADS=1``) so that
``n`` workers use ``n`` cores; the NumPy path is timed at 1 and at all threads.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from .timing import time_interleaved

#: (rows, columns, rows per chunk) of the float32 input.
QUICK_SHAPE = (32768, 1024, 4096)
FULL_SHAPE = (262144, 1024, 16384)
WORKERS = (1, 2)


def _same_block(block: Any) -> Any:
    return block


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """One call per sample: a call takes long enough (a cluster round trip, or a whole
    large array) to need no batching. The first, untimed call is the calibration's,
    which also warms up (workers import layernorm and load or compile the kernels)."""
    (timing,) = time_interleaved({"call": fn}, repeats, target_s=0.0, warmup=0).values()
    if "error" in timing:
        raise RuntimeError(f"the timed call failed: {timing['error']}")
    return timing["median_s"], timing["samples_s"]


def run_dask(quick: bool = False, repeats: int = 3, shape: tuple[int, int, int] | None = None,
             workers: tuple[int, ...] = WORKERS) -> dict[str, Any]:
    """Time layer_norm on a ``dask.distributed`` LocalCluster and on NumPy.

    Returns ``{"shape", "chunk_rows", "bytes", "results": [...]}``; each result has
    ``impl``, ``workers`` or ``threads``, ``median_s``, ``samples_s`` and ``gbps``
    (read x + write y over the whole array).
    """
    import dask.array as da
    import numba
    from distributed import Client, LocalCluster, wait

    import layernorm as ln

    n, d, chunk = shape or (QUICK_SHAPE if quick else FULL_SHAPE)
    nbytes = n * d * 4
    moved = 2 * nbytes
    results: list[dict[str, Any]] = []
    x_np = None
    for count in workers:
        with LocalCluster(
            n_workers=count, threads_per_worker=1, processes=True, dashboard_address=None,
            silence_logs=logging.ERROR, env={"NUMBA_NUM_THREADS": "1"},
        ) as cluster, Client(cluster) as client:
            x = da.random.default_rng(0).standard_normal((n, d), chunks=(chunk, d),
                                                         dtype=np.float32)
            x = x.persist()
            wait(x)
            if x_np is None:
                x_np = x.compute()

            def once(x: Any = x) -> None:
                # A fresh name per call: Dask would otherwise find the previous call's
                # identically named result still in worker memory and compute nothing.
                fresh = x.map_blocks(_same_block, dtype=x.dtype,
                                     name=f"bench-input-{uuid.uuid4().hex}")
                y = ln.layer_norm(fresh).persist()
                wait(y)
                client.cancel(y)

            median, samples = _median_time(once, repeats)
            results.append({"impl": "dask.distributed", "workers": count,
                            "threads_per_worker": 1, "median_s": median,
                            "samples_s": samples, "gbps": moved / median / 1e9})
            client.cancel(x)
    assert x_np is not None
    threads_before = numba.get_num_threads()
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            median, samples = _median_time(lambda: ln.layer_norm(x_np), repeats)
            results.append({"impl": "numpy (numba)", "threads": threads, "median_s": median,
                            "samples_s": samples, "gbps": moved / median / 1e9})
    finally:
        numba.set_num_threads(threads_before)
    return {"shape": [n, d], "chunk_rows": chunk, "dtype": "float32", "bytes": moved,
            "results": results}


def format_dask(report: dict[str, Any]) -> str:
    """Table of :func:`run_dask`'s results."""
    n, d = report["shape"]
    lines = ["", f"Dask: LayerNorm forward of a float32 ({n}, {d}) array "
             f"({report['bytes'] / 2 / 2**20:.0f} MiB), chunks of {report['chunk_rows']} rows",
             f"{'implementation':<40} {'ms':>9} {'GB/s':>7} {'vs numpy 1 thread':>18}"]
    base = next((r["median_s"] for r in report["results"]
                 if r["impl"].startswith("numpy") and r.get("threads") == 1), None)
    for r in report["results"]:
        if "workers" in r:
            label = f"{r['impl']} {r['workers']} worker(s) x 1 thread"
        else:
            label = f"{r['impl']} {r['threads']} thread(s)"
        ratio = f"{base / r['median_s']:.2f}" if base else ""
        lines.append(f"{label:<40} {r['median_s'] * 1e3:>9.1f} {r['gbps']:>7.2f} {ratio:>18}")
    lines.append("Dask: input persisted on the workers, output persisted there (not gathered).")
    return "\n".join(lines)
