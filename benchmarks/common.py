"""Shared pieces of the asv suite: parameter grids, seeded cached inputs, backends.

Inputs are made once per (shape, dtype, kind) and cached, so the many benchmarks
that share them do not pay for random numbers. Optional backends raise
``NotImplementedError`` when their library (or device) is missing, which asv
records as "skipped", never as a failure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

OPS = ["layer_norm", "rms_norm"]
DTYPES = ["float32", "float64", "float16", "bfloat16"]
#: Latency (one row), short rows, a transformer width, long rows.
SHAPES = ["1x768", "65536x64", "4096x768", "256x16384"]
#: Our paths, by the array the user passes: NumPy (Numba kernels), NumPy forced onto
#: the generic array-API path, torch tensors (DLPack to Numba), JAX (generic path),
#: CuPy (CUDA kernels); and PyTorch's own F.layer_norm/rms_norm as the peer baseline.
BACKENDS = ["numba", "array_api", "torch", "jax", "cupy", "torch_native"]
EPS = 1e-5


def parse_shape(shape: str) -> tuple[int, int]:
    n, d = shape.split("x")
    return int(n), int(d)


def numpy_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@functools.cache
def get_array(shape: str, dtype: str, kind: str = "x", offset: float = 0.0) -> np.ndarray:
    """Seeded ``randn`` array (``kind`` picks the seed: "x", "grad_y"), read-only."""
    n, d = parse_shape(shape)
    seed = {"x": 0, "grad_y": 1}[kind]
    rng = np.random.default_rng(seed)
    arr = (offset + rng.standard_normal((n, d), dtype=np.float32)).astype(numpy_dtype(dtype))
    arr.flags.writeable = False
    return arr


@functools.cache
def get_params(d: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Seeded weight (near 1) and bias (small) of length ``d``."""
    rng = np.random.default_rng(2)
    w = (1.0 + 0.1 * rng.standard_normal(d)).astype(numpy_dtype(dtype))
    b = (0.1 * rng.standard_normal(d)).astype(numpy_dtype(dtype))
    w.flags.writeable = False
    b.flags.writeable = False
    return w, b


@functools.cache
def get_stats(op: str, shape: str, dtype: str) -> tuple[Any, Any]:
    """Forward statistics (mean or None, rstd) of the cached input, for backward benches."""
    import layernorm as ln

    x = get_array(shape, dtype)
    w, b = get_params(x.shape[1], dtype)
    if op == "layer_norm":
        _, mean, rstd = ln.layer_norm(x, weight=w, bias=b, eps=EPS, return_stats=True)
        return mean, rstd
    _, rstd = ln.rms_norm(x, weight=w, eps=EPS, return_stats=True)
    return None, rstd


# --------------------------------------------------------------------------- converters


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise NotImplementedError(f"{module} is not installed") from None


def _torch_from(arr: Any) -> Any:
    torch = _require("torch")
    if arr is None:
        return None
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(np.array(arr).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr))


def _converter(backend: str, dtype: str) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(to the backend's arrays, wait for a result to be ready) for one backend."""
    if backend in ("numba", "array_api"):
        return (lambda a: a), (lambda r: r)
    if backend in ("torch", "torch_native"):
        _require("torch")
        return _torch_from, (lambda r: r)
    if backend == "jax":
        jax = _require("jax")
        if dtype == "float64" and not jax.config.read("jax_enable_x64"):
            raise NotImplementedError("JAX float64 needs jax_enable_x64")
        cpu = jax.devices("cpu")[0]
        return ((lambda a: None if a is None else jax.device_put(np.asarray(a), cpu)),
                jax.block_until_ready)
    if backend == "cupy":
        cupy = _require("cupy")
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise NotImplementedError("no CUDA device")
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise NotImplementedError(f"no usable CUDA device: {exc}") from None
        if dtype == "bfloat16":
            raise NotImplementedError("CuPy has no bfloat16 arrays")

        def sync(r: Any) -> Any:
            cupy.cuda.get_current_stream().synchronize()
            return r

        return (lambda a: None if a is None else cupy.asarray(a)), sync
    raise ValueError(f"unknown backend {backend!r}")


# --------------------------------------------------------------------------- callables


def forward_callable(op: str, dtype: str, shape: str, backend: str,
                     out: bool = False) -> Callable[[], Any]:
    """A zero-argument call of the forward pass on cached inputs (warm it up yourself)."""
    import layernorm as ln

    conv, ready = _converter(backend, dtype)
    x_np = get_array(shape, dtype)
    w_np, b_np = get_params(x_np.shape[1], dtype)
    x, w, b = conv(x_np), conv(w_np), conv(b_np)
    d = x_np.shape[1]
    if backend == "torch_native":
        import torch
        import torch.nn.functional as F

        if op == "layer_norm":
            def fn() -> Any:
                with torch.no_grad():
                    return F.layer_norm(x, (d,), w, b, EPS)
        else:
            def fn() -> Any:
                with torch.no_grad():
                    return F.rms_norm(x, (d,), w, EPS)
        return fn
    kwargs: dict[str, Any] = {"backend": "array_api"} if backend == "array_api" else {}
    if out:
        if backend not in ("numba", "cupy"):
            raise NotImplementedError("out= is for NumPy and CuPy arrays")
        kwargs["out"] = conv(np.empty_like(x_np))
    if op == "layer_norm":
        return lambda: ready(ln.layer_norm(x, weight=w, bias=b, eps=EPS, **kwargs))
    return lambda: ready(ln.rms_norm(x, weight=w, eps=EPS, **kwargs))


def backward_callable(op: str, dtype: str, shape: str, backend: str) -> Callable[[], Any]:
    """A zero-argument call of the backward pass (grad_x and parameter gradients)."""
    import layernorm as ln

    conv, ready = _converter(backend, dtype)
    x_np = get_array(shape, dtype)
    gy_np = get_array(shape, dtype, "grad_y")
    w_np, b_np = get_params(x_np.shape[1], dtype)
    mean_np, rstd_np = get_stats(op, shape, dtype)
    d = x_np.shape[1]
    if backend == "torch_native":
        import torch
        import torch.nn.functional as F

        xr = _torch_from(x_np).requires_grad_(True)
        wr = _torch_from(w_np).requires_grad_(True)
        if op == "layer_norm":
            br = _torch_from(b_np).requires_grad_(True)
            y = F.layer_norm(xr, (d,), wr, br, EPS)
            inputs: tuple[Any, ...] = (xr, wr, br)
        else:
            y = F.rms_norm(xr, (d,), wr, EPS)
            inputs = (xr, wr)
        gy = _torch_from(gy_np)
        return lambda: torch.autograd.grad(y, inputs, gy, retain_graph=True)
    x, gy, w = conv(x_np), conv(gy_np), conv(w_np)
    rstd = conv(rstd_np)
    kwargs: dict[str, Any] = {"backend": "array_api"} if backend == "array_api" else {}
    if op == "layer_norm":
        mean = conv(mean_np)
        return lambda: ready(ln.layer_norm_backward(gy, x, mean, rstd, w, **kwargs))
    return lambda: ready(ln.rms_norm_backward(gy, x, rstd, w, **kwargs))


# --------------------------------------------------------------------------- bandwidth


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int = 7,
                        target_s: float = 0.005) -> dict[str, float]:
    """Median seconds per call of each callable, timed round-robin in this process by
    layernorm's own timer (:func:`layernorm.bench.timing.median_times`)."""
    # Imported here, not at the top: asv imports this module for every benchmark, and
    # run over old commits, which have no layernorm.bench, only the bandwidth benchmarks
    # that time through it should fail.
    from layernorm.bench.timing import median_times

    return median_times(fns, repeats, target_s)


def copy_callable(shape: str, dtype: str) -> Callable[[], Any]:
    """``np.copyto`` of one input's bytes into a preallocated array."""
    src = get_array(shape, dtype)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def float64_reference(op: str, x: np.ndarray, w: np.ndarray, b: np.ndarray | None
                      ) -> np.ndarray:
    """The exact answer in float64 (two-pass mean and variance)."""
    x64 = x.astype(np.float64)
    w64 = w.astype(np.float64)
    if op == "layer_norm":
        mean = x64.mean(-1, keepdims=True)
        var = ((x64 - mean) ** 2).mean(-1, keepdims=True)
        return (x64 - mean) / np.sqrt(var + EPS) * w64 + b.astype(np.float64)
    ms = (x64 * x64).mean(-1, keepdims=True)
    return x64 / np.sqrt(ms + EPS) * w64
