"""Backward pass: grad_x and the parameter gradients."""

# asv reads params and param_names as plain class-level lists.
# ruff: noqa: RUF012

from __future__ import annotations

from .common import (
    BACKENDS,
    DTYPES,
    OPS,
    SHAPES,
    backward_callable,
    copy_callable,
    get_array,
    interleaved_medians,
)


class Backward:
    """Time of one backward call for every backend."""

    params = [OPS, DTYPES, SHAPES, BACKENDS]
    param_names = ["op", "dtype", "shape", "backend"]

    def setup(self, op: str, dtype: str, shape: str, backend: str) -> None:
        self.call = backward_callable(op, dtype, shape, backend)
        self.call()

    def time_backward(self, op: str, dtype: str, shape: str, backend: str) -> None:
        self.call()


class BackwardBandwidth:
    """GB/s of the Numba backward (reads grad_y and x, writes grad_x) and % of a copy."""

    params = [OPS, ["float32", "float64"], ["65536x64", "4096x768", "256x16384"]]
    param_names = ["op", "dtype", "shape"]

    def setup(self, op: str, dtype: str, shape: str) -> None:
        self.ours = backward_callable(op, dtype, shape, "numba")
        self.copy = copy_callable(shape, dtype)
        self.ours()
        self.array_bytes = get_array(shape, dtype).nbytes

    def _measure(self) -> dict[str, float]:
        return interleaved_medians({"ours": self.ours, "copy": self.copy})

    def track_gbps(self, op: str, dtype: str, shape: str) -> float:
        return 3 * self.array_bytes / self._measure()["ours"] / 1e9

    track_gbps.unit = "GB/s"

    def track_pct_of_copy(self, op: str, dtype: str, shape: str) -> float:
        t = self._measure()
        ours_gbps = 3 * self.array_bytes / t["ours"]
        copy_gbps = 2 * self.array_bytes / t["copy"]
        return 100.0 * ours_gbps / copy_gbps

    track_pct_of_copy.unit = "%"


class BackwardPeakMemory:
    """Peak resident memory of one backward call."""

    params = [OPS, ["4096x768", "16384x2048"]]
    param_names = ["op", "shape"]

    def setup(self, op: str, shape: str) -> None:
        self.call = backward_callable(op, "float32", shape, "numba")
        self.call()

    def peakmem_backward(self, op: str, shape: str) -> object:
        return self.call()
