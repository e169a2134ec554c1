"""Forward pass: time, bandwidth against a copy, and peak memory."""

# asv reads params and param_names as plain class-level lists.
# ruff: noqa: RUF012

from __future__ import annotations

from typing import Any

from .common import (
    BACKENDS,
    DTYPES,
    OPS,
    SHAPES,
    copy_callable,
    forward_callable,
    get_array,
    interleaved_medians,
)


class Forward:
    """Time of one forward call, fresh output, for every backend."""

    params = [OPS, DTYPES, SHAPES, BACKENDS]
    param_names = ["op", "dtype", "shape", "backend"]

    def setup(self, op: str, dtype: str, shape: str, backend: str) -> None:
        self.call = forward_callable(op, dtype, shape, backend)
        self.call()  # compile (or load the Numba cache) outside the timing

    def time_forward(self, op: str, dtype: str, shape: str, backend: str) -> None:
        self.call()


class ForwardOut:
    """Time of one forward call into a preallocated ``out=``."""

    params = [OPS, DTYPES, SHAPES, ["numba", "cupy"]]
    param_names = ["op", "dtype", "shape", "backend"]

    def setup(self, op: str, dtype: str, shape: str, backend: str) -> None:
        self.call = forward_callable(op, dtype, shape, backend, out=True)
        self.call()

    def time_forward_out(self, op: str, dtype: str, shape: str, backend: str) -> None:
        self.call()


class ForwardBandwidth:
    """GB/s of the Numba path and its % of a copy of the same bytes, same process.

    The copy (``np.copyto`` into a preallocated array) and our calls are timed
    round-robin in one process, so both see the same machine state.
    """

    params = [OPS, ["float32", "float64", "bfloat16"], ["65536x64", "4096x768", "256x16384"],
              ["out", "fresh"]]
    param_names = ["op", "dtype", "shape", "output"]

    def setup(self, op: str, dtype: str, shape: str, output: str) -> None:
        self.ours = forward_callable(op, dtype, shape, "numba", out=output == "out")
        self.copy = copy_callable(shape, dtype)
        self.ours()
        self.bytes = 2 * get_array(shape, dtype).nbytes  # read x, write y

    def _measure(self) -> dict[str, float]:
        return interleaved_medians({"ours": self.ours, "copy": self.copy})

    def track_gbps(self, op: str, dtype: str, shape: str, output: str) -> float:
        return self.bytes / self._measure()["ours"] / 1e9

    track_gbps.unit = "GB/s"

    def track_pct_of_copy(self, op: str, dtype: str, shape: str, output: str) -> float:
        t = self._measure()
        return 100.0 * t["copy"] / t["ours"]  # same bytes moved by both

    track_pct_of_copy.unit = "%"


class ForwardPeakMemory:
    """Peak resident memory of a process that makes one forward call (fresh output)."""

    params = [OPS, ["4096x768", "16384x2048"]]
    param_names = ["op", "shape"]

    def setup(self, op: str, shape: str) -> None:
        self.call = forward_callable(op, "float32", shape, "numba")
        self.call()

    def peakmem_forward(self, op: str, shape: str) -> Any:
        return self.call()


#: Shapes whose whole working set (x, y, weight, bias, statistics) stays under 1.5 MB
#: for every dtype below, float64 included: reused call after call, it stays in cache.
CACHE_SHAPES = ["64x768", "16x4096"]


class ForwardInCache:
    """The forward on one small working set reused call after call (cache-resident):
    bound by arithmetic, not memory. Time, and % of an in-cache copy of the same bytes
    timed round-robin with it."""

    params = [OPS, ["float32", "float64", "bfloat16"], CACHE_SHAPES]
    param_names = ["op", "dtype", "shape"]

    def setup(self, op: str, dtype: str, shape: str) -> None:
        self.ours = forward_callable(op, dtype, shape, "numba")
        self.copy = copy_callable(shape, dtype)
        self.ours()  # compile (or load the Numba cache) outside the timing

    def time_forward_in_cache(self, op: str, dtype: str, shape: str) -> None:
        self.ours()

    def track_pct_of_copy_in_cache(self, op: str, dtype: str, shape: str) -> float:
        t = interleaved_medians({"ours": self.ours, "copy": self.copy})
        return 100.0 * t["copy"] / t["ours"]  # same bytes moved by both

    track_pct_of_copy_in_cache.unit = "%"
