"""Transformer-block fusions: add + norm, quantized output, backward with grad_residual."""

# asv reads params and param_names as plain class-level lists.
# ruff: noqa: RUF012

from __future__ import annotations

from typing import Any

import numpy as np

from .common import EPS, get_array, get_params, get_stats, interleaved_medians, numpy_dtype

ADD_OPS = ["add_layer_norm", "add_rms_norm"]
FUSION_SHAPES = ["4096x768", "8192x1024"]


def _add_callables(op: str, dtype: str, shape: str) -> dict[str, Any]:
    """The fused call, the unfused composition into the same outputs, and the traffic
    floor (two copies moving the bytes the fused call reads), all into preallocated
    arrays."""
    import layernorm as ln

    x = get_array(shape, dtype)
    r = get_array(shape, dtype, "grad_y")
    w, b = get_params(x.shape[1], dtype)
    y, h = np.empty_like(x), np.empty_like(x)
    kw = {"weight": w, "eps": EPS} if op == "add_rms_norm" else {"weight": w, "bias": b,
                                                                  "eps": EPS}
    fused = getattr(ln, op)
    norm = ln.rms_norm if op == "add_rms_norm" else ln.layer_norm
    c1, c2 = np.empty_like(x), np.empty_like(x)

    def unfused() -> None:
        np.add(x, r, out=h)
        norm(h, out=y, **kw)

    def floor() -> None:
        np.copyto(c1, x)
        np.copyto(c2, r)

    return {"fused": lambda: fused(x, r, out=y, residual_out=h, **kw), "unfused": unfused,
            "floor": floor}


class AddNorm:
    """Time of the fused add + norm and of the unfused composition (into ``out=``)."""

    params = [ADD_OPS, ["float32", "bfloat16"], FUSION_SHAPES, ["fused", "unfused"]]
    param_names = ["op", "dtype", "shape", "variant"]

    def setup(self, op: str, dtype: str, shape: str, variant: str) -> None:
        self.call = _add_callables(op, dtype, shape)[variant]
        self.call()

    def time_add_norm(self, op: str, dtype: str, shape: str, variant: str) -> None:
        self.call()


class AddNormRatios:
    """The fused call against the unfused composition and the traffic floor, timed
    round-robin in one process."""

    params = [ADD_OPS, FUSION_SHAPES]
    param_names = ["op", "shape"]

    def setup(self, op: str, shape: str) -> None:
        self.fns = _add_callables(op, "float32", shape)
        for fn in self.fns.values():
            fn()

    def track_speedup_over_unfused(self, op: str, shape: str) -> float:
        t = interleaved_medians(self.fns)
        return t["unfused"] / t["fused"]

    track_speedup_over_unfused.unit = "x"

    def track_pct_of_floor(self, op: str, shape: str) -> float:
        t = interleaved_medians(self.fns)
        return 100.0 * t["floor"] / t["fused"]

    track_pct_of_floor.unit = "%"


def _quantized_dtype(quantize: str | None) -> Any:
    if quantize is None:
        return numpy_dtype("float32")
    if quantize == "int8":
        return np.dtype(np.int8)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, quantize))


class Quantized:
    """Time of a forward with int8/float8 output (None: the plain norm into ``out=``)."""

    params = [["layer_norm", "rms_norm"], [None, "int8", "float8_e4m3fn"], FUSION_SHAPES]
    param_names = ["op", "quantize", "shape"]

    def setup(self, op: str, quantize: str | None, shape: str) -> None:
        import layernorm as ln

        x = get_array(shape, "float32")
        w, _ = get_params(x.shape[1], "float32")
        out = np.empty(x.shape, _quantized_dtype(quantize))
        fn = getattr(ln, op)
        self.call = lambda: fn(x, weight=w, quantize=quantize, out=out)
        self.call()

    def time_quantized(self, op: str, quantize: str | None, shape: str) -> None:
        self.call()


class BackwardGradResidual:
    """Time of a backward with and without ``grad_residual``."""

    params = [["layer_norm", "rms_norm"], FUSION_SHAPES, [False, True]]
    param_names = ["op", "shape", "grad_residual"]

    def setup(self, op: str, shape: str, grad_residual: bool) -> None:
        import layernorm as ln

        x = get_array(shape, "float32")
        gy = get_array(shape, "float32", "grad_y")
        w, _ = get_params(x.shape[1], "float32")
        mean, rstd = get_stats(op, shape, "float32")
        gr = np.flip(gy, axis=0) if grad_residual else None
        if op == "layer_norm":
            self.call = lambda: ln.layer_norm_backward(gy, x, mean, rstd, w, grad_residual=gr)
        else:
            self.call = lambda: ln.rms_norm_backward(gy, x, rstd, w, grad_residual=gr)
        self.call()

    def time_backward(self, op: str, shape: str, grad_residual: bool) -> None:
        self.call()
