"""torch glue: tensors in, tensors out, through the fastest path for the tensor's device.

Routes, chosen from ``x.device`` (or forced with ``backend=``):

* **CPU** -> the Numba kernels. The tensors are handed to NumPy zero-copy through
  DLPack (bfloat16, which NumPy's DLPack does not know, travels as int16 bits and is
  viewed as ``ml_dtypes.bfloat16`` on the NumPy side); the public functions of
  :mod:`layernorm._api` then validate and compute, and their fresh NumPy results come
  back zero-copy with :func:`torch.from_numpy`.
* **CUDA** -> the CuPy kernels, zero-copy through DLPack on torch's current stream
  (bfloat16 as uint16 bits with the dtype name "bfloat16", as the backend interface in
  :mod:`layernorm._backends` allows). When CuPy is not installed, CUDA tensors fall back
  to the generic path below (still on the GPU, still differentiable, only slower);
  ``backend="cupy"`` insists on CuPy and raises ``ImportError`` without it.
* **Any other device** (``mps``, ``meta``, ...) and ``backend="array_api"`` -> the generic
  implementation written with torch's own array-API namespace; torch's autograd
  differentiates it directly.

On the native routes a result that needs gradients (``x``, ``weight`` or ``bias``
requires grad and grad mode is on) is produced by a :class:`torch.autograd.Function`
whose backward runs our backward kernels; the statistics returned by
``return_stats=True`` are marked non-differentiable.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import numpy as np
import torch

from .. import _api, _layout
from .._dispatch import check_companions
from .._dtypes import MACHINE_EPS
from .._validate import check_backend_name, check_eps, check_float_dtype, check_out

_ACC_TORCH = {"float32": torch.float32, "float64": torch.float64}


# --------------------------------------------------------------------------- checks


def _check_inputs(x: Any, **others: Any) -> None:
    """Same library (torch) and same device for every array argument."""
    check_companions(x, "torch", **others)
    for name, arr in others.items():
        if arr is not None and arr.device != x.device:
            raise TypeError(
                f"{name} is on device {arr.device} but x is on device {x.device}; "
                "pass tensors on one device"
            )


def _wants_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors
    )


def _no_out_with_grad(out: Any, *tensors: Any) -> None:
    if out is not None and _wants_grad(*tensors):
        raise RuntimeError(
            "out= does not support automatic differentiation (an input requires grad); "
            "call without out= or under torch.no_grad()"
        )


@functools.cache
def _cupy_or_none() -> Any:
    try:
        return importlib.import_module("cupy")
    except ImportError:
        return None


def _route(x: Any, backend: str | None) -> str:
    """"numba", "cupy" or "array_api" for a tensor on ``x.device``."""
    check_backend_name(backend)
    device = x.device.type
    if backend == "array_api":
        return backend
    if backend == "numba" and device != "cpu":
        raise ValueError(f"backend='numba' needs a CPU tensor as x, got one on {x.device}")
    if backend == "cupy":
        if device != "cuda":
            raise ValueError(f"backend='cupy' needs a CUDA tensor as x, got one on {x.device}")
        if _cupy_or_none() is None:
            raise ImportError("backend='cupy' needs CuPy installed (pip install cupy-cuda13x)")
        return backend
    if device == "cpu":
        return "numba"
    if device == "cuda" and _cupy_or_none() is not None:
        return "cupy"
    return "array_api"


# --------------------------------------------------------------------------- CPU: NumPy views


def to_numpy(t: Any) -> Any:
    """Zero-copy NumPy view of a CPU tensor (any strides; bfloat16 via ml_dtypes).

    Examples
    --------
    >>> import torch
    >>> t = torch.arange(6, dtype=torch.float64).reshape(2, 3)[:, ::2]
    >>> a = to_numpy(t)
    >>> a.strides, bool(a.ctypes.data == t.data_ptr())
    ((24, 16), True)
    """
    if t is None:
        return None
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return np.from_dlpack(t)


def from_numpy(a: Any) -> Any:
    """Zero-copy tensor sharing the memory of a NumPy array (bfloat16 via int16 bits)."""
    if a is None:
        return None
    if a.dtype.kind == "V":  # ml_dtypes.bfloat16 (the only non-native dtype we return)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _numba_forward(rms: bool, x: Any, ns: Any, weight: Any, bias: Any, eps: Any, axis: Any,
                   out: Any) -> tuple[Any, Any, Any]:
    xn, wn, outn = to_numpy(x), to_numpy(weight), to_numpy(out)
    if rms:
        y, rstd = _api.rms_norm(xn, ns, wn, eps, axis=axis, return_stats=True, out=outn)
        mean = None
    else:
        y, mean, rstd = _api.layer_norm(xn, ns, wn, to_numpy(bias), eps, axis=axis,
                                        return_stats=True, out=outn)
    y = out if out is not None else from_numpy(y)
    return y, from_numpy(mean), from_numpy(rstd)


def _numba_backward(rms: bool, gy: Any, x: Any, mean: Any, rstd: Any, weight: Any, ns: Any,
                    axis: Any) -> tuple[Any, ...]:
    args = (to_numpy(gy), to_numpy(x))
    if rms:
        grads = _api.rms_norm_backward(*args, to_numpy(rstd), to_numpy(weight), ns, axis=axis)
    else:
        grads = _api.layer_norm_backward(*args, to_numpy(mean), to_numpy(rstd),
                                         to_numpy(weight), ns, axis=axis)
    return tuple(from_numpy(g) for g in grads)


# ------------------------------------------------------------------ CUDA: backend interface


class _Interface:
    """Drives a native backend module through the interface of :mod:`layernorm._backends`.

    Used for CUDA tensors with ``xp=cupy`` and the CuPy backend. The arrays handed over
    are DLPack views of the tensors (16-bit floats as same-size integer bits), so this
    class does what :mod:`layernorm._api` does for NumPy/CuPy arrays: validation (on the
    tensors), the ``(outer, n, inner)`` views, output allocation and parameter casts.
    The tests run it on CPU tensors with ``xp=numpy`` and the Numba backend.
    """

    def __init__(self, xp: Any, backend: Any, to_xp: Any, to_torch: Any) -> None:
        self.xp, self.be, self.to_xp, self.to_torch = xp, backend, to_xp, to_torch

    def _bits(self, t: Any) -> Any:
        # 16-bit floats as same-size integers: the kernels read the bits and the dtype name.
        if t.dtype == torch.bfloat16:
            return self.to_xp(t.detach().view(torch.int16)).view(self.xp.uint16)
        return self.to_xp(t.detach())

    def _from_bits(self, a: Any, dtype: torch.dtype) -> Any:
        t = self.to_torch(a)
        return t.view(dtype) if t.dtype != dtype else t

    def _param(self, p: Any, acc: str) -> Any:
        if p is None:
            return None
        return self.xp.ascontiguousarray(self.to_xp(p.detach().to(_ACC_TORCH[acc]).reshape(-1)))

    def _stat(self, s: Any, acc: str) -> Any:
        return self.xp.ascontiguousarray(self.to_xp(s.detach().to(_ACC_TORCH[acc]).reshape(-1)))

    def _empty_like_x(self, xb: Any, layout: _layout.Layout) -> tuple[Any, Any]:
        shape = layout.shape
        if layout.perm is not None:
            shape = tuple(shape[i] for i in layout.perm)
        buf = self.xp.empty(shape, dtype=xb.dtype)
        return buf, buf.reshape(layout.outer, layout.n, layout.inner)

    def _finish(self, buf: Any, layout: _layout.Layout) -> Any:
        if layout.perm is not None:
            buf = self.xp.ascontiguousarray(
                buf.transpose(tuple(int(i) for i in np.argsort(layout.perm))))
        return buf

    def forward(self, rms: bool, x: Any, ns: Any, weight: Any, bias: Any, eps: Any, axis: Any,
                out: Any) -> tuple[Any, Any, Any]:
        req = _api._request(x, "torch", ns, axis, None, weight=weight, bias=bias)
        layout, acc = req.layout, req.acc
        eps = MACHINE_EPS[acc] if (rms and eps is None) else check_eps(eps)
        if out is not None:
            check_out(out, layout.shape, req.dtype)
        xb = self._bits(x)
        buf, y3 = self._empty_like_x(xb, layout)
        mean = None if rms else self.xp.empty(layout.rows, dtype=acc)
        rstd = self.xp.empty(layout.rows, dtype=acc)
        if layout.n == 0:
            if mean is not None:
                mean[...] = 0
            rstd[...] = np.nan
        elif layout.rows > 0:
            x3 = _layout.canonical(xb, layout)
            w = self._param(weight, acc)
            if rms:
                self.be.rms_norm_forward(x3, w, eps, y3, rstd, req.dtype)
            else:
                b = self._param(bias, acc)
                self.be.layer_norm_forward(x3, w, b, eps, y3, mean, rstd, req.dtype)
        y = self._from_bits(self._finish(buf, layout), x.dtype)
        if out is not None:
            out.copy_(y)
            y = out
        stats = layout.stats_shape
        mean_t = None if mean is None else self.to_torch(mean).reshape(stats)
        return y, mean_t, self.to_torch(rstd).reshape(stats)

    def backward(self, rms: bool, gy: Any, x: Any, mean: Any, rstd: Any, weight: Any, ns: Any,
                 axis: Any) -> tuple[Any, ...]:
        req = _api._request(x, "torch", ns, axis, None, weight=weight)
        stats = {"rstd": rstd} if rms else {"mean": mean, "rstd": rstd}
        _api._check_backward(gy, x, req, **stats)
        layout, acc = req.layout, req.acc
        xb = self._bits(x)
        buf, gx3 = self._empty_like_x(xb, layout)
        if layout.n == 0 or layout.rows == 0:
            gw = self.xp.zeros(layout.n, dtype=acc)
            gb = self.xp.zeros(layout.n, dtype=acc)
        else:
            gy3 = _layout.canonical(self._bits(gy), layout)
            x3 = _layout.canonical(xb, layout)
            w = self._param(weight, acc)
            r = self._stat(rstd, acc)
            if rms:
                gw = self.be.rms_norm_backward(gy3, x3, r, w, gx3, req.dtype)
                gb = None
            else:
                m = self._stat(mean, acc)
                gw, gb = self.be.layer_norm_backward(gy3, x3, m, r, w, gx3, req.dtype)
        gx = self._from_bits(self._finish(buf, layout), x.dtype)
        pdtype = (weight if weight is not None else x).dtype

        def param_grad(g: Any) -> Any:
            return self.to_torch(g).reshape(layout.param_shape).to(pdtype)

        if rms:
            return gx, param_grad(gw)
        return gx, param_grad(gw), param_grad(gb)


@functools.cache
def _cuda_interface() -> _Interface:
    cupy = _cupy_or_none()
    backend = importlib.import_module("layernorm._backends._cupy")
    return _Interface(cupy, backend, cupy.from_dlpack, torch.from_dlpack)


class _CudaContext:
    """Run CuPy on the tensor's device and on torch's current stream there."""

    def __init__(self, x: Any) -> None:
        cupy = _cupy_or_none()
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        self._device = cupy.cuda.Device(index)
        stream = torch.cuda.current_stream(x.device)
        self._stream = cupy.cuda.ExternalStream(stream.cuda_stream, index)

    def __enter__(self) -> None:
        self._device.__enter__()
        self._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


# --------------------------------------------------------------------------- generic path


def _generic_forward(rms: bool, x: Any, ns: Any, weight: Any, bias: Any, eps: Any, axis: Any,
                     out: Any) -> tuple[Any, Any, Any]:
    req = _api._request(x, "torch", ns, axis, "array_api", weight=weight, bias=bias)
    eps = MACHINE_EPS[req.acc] if (rms and eps is None) else check_eps(eps)
    if out is not None:
        check_out(out, req.layout.shape, req.dtype)
    y, mean, rstd = _api._forward(x, "torch", req, weight, bias, eps, None, rms=rms)
    if out is not None:
        out.copy_(y)
        y = out
    return y, mean, rstd


def _generic_backward(rms: bool, gy: Any, x: Any, mean: Any, rstd: Any, weight: Any, ns: Any,
                      axis: Any) -> tuple[Any, ...]:
    req = _api._request(x, "torch", ns, axis, "array_api", weight=weight)
    stats = {"rstd": rstd} if rms else {"mean": mean, "rstd": rstd}
    _api._check_backward(gy, x, req, **stats)
    return _api._backward(gy, x, "torch", req, mean, rstd, weight, rms=rms)


# --------------------------------------------------------------------------- dispatch


def _forward(route: str, rms: bool, x: Any, ns: Any, weight: Any, bias: Any, eps: Any,
             axis: Any, out: Any) -> tuple[Any, Any, Any]:
    if route == "numba":
        return _numba_forward(rms, x, ns, weight, bias, eps, axis, out)
    if route == "cupy":
        with _CudaContext(x):
            return _cuda_interface().forward(rms, x, ns, weight, bias, eps, axis, out)
    return _generic_forward(rms, x, ns, weight, bias, eps, axis, out)


def _backward(route: str, rms: bool, gy: Any, x: Any, mean: Any, rstd: Any, weight: Any,
              ns: Any, axis: Any) -> tuple[Any, ...]:
    if route == "numba":
        return _numba_backward(rms, gy, x, mean, rstd, weight, ns, axis)
    if route == "cupy":
        with _CudaContext(x):
            return _cuda_interface().backward(rms, gy, x, mean, rstd, weight, ns, axis)
    return _generic_backward(rms, gy, x, mean, rstd, weight, ns, axis)


class _NormFunction(torch.autograd.Function):
    """Autograd node for the native routes: our forward, our backward kernels."""

    @staticmethod
    def forward(ctx: Any, x: Any, weight: Any, bias: Any, spec: tuple[Any, ...]) -> Any:
        route, rms, ns, eps, axis = spec
        y, mean, rstd = _forward(route, rms, x, ns, weight, bias, eps, axis, None)
        ctx.spec = spec
        ctx.save_for_backward(x, weight, mean, rstd)
        if rms:
            ctx.mark_non_differentiable(rstd)
            return y, rstd
        ctx.mark_non_differentiable(mean, rstd)
        return y, mean, rstd

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_y: Any, *_stats_grads: Any) -> tuple[Any, ...]:
        route, rms, ns, _eps, axis = ctx.spec
        x, weight, mean, rstd = ctx.saved_tensors
        grads = _backward(route, rms, grad_y, x, mean, rstd, weight, ns, axis)
        need = ctx.needs_input_grad
        gx = grads[0] if need[0] else None
        gw = grads[1] if need[1] else None
        gb = grads[2] if (not rms and need[2]) else None
        return gx, gw, gb, None


def _name_dtype(x: Any) -> None:
    # Fail with our wording (not a DLPack error) on dtypes NumPy/CuPy cannot view.
    check_float_dtype(x, "x")


def layer_norm(x: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any, *, axis: Any,
               return_stats: bool, out: Any, backend: str | None) -> Any:
    """:func:`layernorm.layer_norm` for a torch tensor ``x``; returns torch tensors."""
    _check_inputs(x, weight=weight, bias=bias, out=out)
    _name_dtype(x)
    route = _route(x, backend)
    _no_out_with_grad(out, x, weight, bias)
    if route != "array_api" and _wants_grad(x, weight, bias):
        spec = (route, False, normalized_shape, eps, axis)
        y, mean, rstd = _NormFunction.apply(x, weight, bias, spec)
    else:
        y, mean, rstd = _forward(route, False, x, normalized_shape, weight, bias, eps, axis,
                                 out)
    return (y, mean, rstd) if return_stats else y


def rms_norm(x: Any, normalized_shape: Any, weight: Any, eps: Any, *, axis: Any,
             return_stats: bool, out: Any, backend: str | None) -> Any:
    """:func:`layernorm.rms_norm` for a torch tensor ``x``; returns torch tensors."""
    _check_inputs(x, weight=weight, out=out)
    _name_dtype(x)
    route = _route(x, backend)
    _no_out_with_grad(out, x, weight)
    if route != "array_api" and _wants_grad(x, weight):
        y, rstd = _NormFunction.apply(x, weight, None, (route, True, normalized_shape, eps, axis))
    else:
        y, _, rstd = _forward(route, True, x, normalized_shape, weight, None, eps, axis, out)
    return (y, rstd) if return_stats else y


def layer_norm_backward(grad_y: Any, x: Any, mean: Any, rstd: Any, weight: Any,
                        normalized_shape: Any, *, axis: Any, backend: str | None) -> Any:
    """:func:`layernorm.layer_norm_backward` for torch tensors (not itself differentiable)."""
    _check_inputs(x, grad_y=grad_y, mean=mean, rstd=rstd, weight=weight)
    _name_dtype(x)
    route = _route(x, backend)
    with torch.no_grad():
        return _backward(route, False, grad_y, x, mean, rstd, weight, normalized_shape, axis)


def rms_norm_backward(grad_y: Any, x: Any, rstd: Any, weight: Any, normalized_shape: Any, *,
                      axis: Any, backend: str | None) -> Any:
    """:func:`layernorm.rms_norm_backward` for torch tensors (not itself differentiable)."""
    _check_inputs(x, grad_y=grad_y, rstd=rstd, weight=weight)
    _name_dtype(x)
    route = _route(x, backend)
    with torch.no_grad():
        return _backward(route, True, grad_y, x, None, rstd, weight, normalized_shape, axis)


__all__ = ["from_numpy", "layer_norm", "layer_norm_backward", "rms_norm",
           "rms_norm_backward", "to_numpy"]
