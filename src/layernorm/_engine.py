"""The one native driver: validated requests, output planning, forward and backward.

Every call that computes, whatever library it came from, ends here:

* :func:`normalize` and :func:`gradients` serve NumPy, CuPy and array-API arrays from
  the public functions (and the Dask adapter's blocks): they check every argument, then
  run :func:`forward` / :func:`backward`.
* The torch adapter validates the tensors itself (:func:`request`,
  :func:`check_backward`) and hands :func:`forward` / :func:`backward` zero-copy NumPy or
  CuPy views of them.

:func:`forward` and :func:`backward` run either the native kernels of a backend on the
``(outer, n, inner)`` view (:mod:`._layout`; the backend interface is written down in
:mod:`._backends`) or the generic implementation in the array's own namespace.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _layout
from ._backends import _array_api as generic
from ._dispatch import Route, check_companions
from ._dtypes import HALF_DTYPES, MACHINE_EPS, accumulation_name, dtype_name
from ._validate import (
    check_eps,
    check_float_dtype,
    check_no_internal_overlap,
    check_out,
    check_param,
    check_same_shape,
    memo_axes,
    resolve_axes,
    shape_of,
)

_NATIVE_MODULES = {"numba": "._backends._numba", "cupy": "._backends._cupy"}


@dataclass(frozen=True)
class Request:
    """Everything validated about one call.

    Attributes
    ----------
    layout : Layout
        How ``x`` maps onto the kernels' ``(outer, n, inner)`` view.
    dtype : str
        Canonical name of x's dtype.
    acc : str
        Accumulation (and statistics) dtype name.
    backend : str
        "numba", "cupy" or "array_api".
    """

    layout: _layout.Layout
    dtype: str
    acc: str
    backend: str


@functools.cache
def native(backend: str) -> Any:
    """The module of a native backend ("numba" or "cupy"), imported on first use."""
    return importlib.import_module(_NATIVE_MODULES[backend], __package__)


def namespace(library: str, x: Any) -> Any:
    """The array namespace of ``x`` (NumPy and CuPy without array_api_compat's wrappers)."""
    if library == "numpy":
        return np
    if library == "cupy":
        import cupy

        return cupy
    from array_api_compat import array_namespace

    return array_namespace(x)


_REQUESTS: dict[tuple[Any, ...], Request] = {}
_REQUESTS_MAX = 512


def request(x: Any, route: Route, normalized_shape: Any, axis: Any, **params: Any) -> Request:
    """Validated facts about one call, memoized on everything they depend on.

    A repeated call (same type, shape and dtype of every array, same axes and route)
    skips the checks it passed before: for a one-row input these checks cost more than
    the kernel. Types lead the key so dtypes of different libraries are never compared.

    Parameters
    ----------
    x : array
        The input (any supported library; only ``shape`` and ``dtype`` are read).
    route : Route
        Where the call runs (:func:`layernorm._dispatch.route`).
    normalized_shape, axis
        As given to the public function.
    **params : array or None
        ``weight`` and ``bias`` (shape and dtype checked against the normalized axes).

    Returns
    -------
    Request
    """
    try:
        key: tuple[Any, ...] | None = (
            type(x), x.dtype, tuple(x.shape), memo_axes(normalized_shape), memo_axes(axis),
            route,
            *((name, None) if p is None else (name, type(p), p.dtype, tuple(p.shape))
              for name, p in params.items()),
        )
        cached = _REQUESTS.get(key)
    except TypeError:  # axes of other types, or unhashable ones: no memo
        key, cached = None, None
    if cached is not None:
        return cached
    req = _validated_request(x, route, normalized_shape, axis, params)
    if key is not None:
        if len(_REQUESTS) >= _REQUESTS_MAX:
            _REQUESTS.clear()  # start over: the shapes seen now stay fast
        _REQUESTS[key] = req
    return req


def cached_requests() -> int:
    """How many validated requests are memoized (bounded; for tests)."""
    return len(_REQUESTS)


def _validated_request(x: Any, route: Route, normalized_shape: Any, axis: Any,
                       params: dict[str, Any]) -> Request:
    dtype = check_float_dtype(x, "x")
    shape = shape_of(x)
    axes = resolve_axes(shape, normalized_shape, axis)
    layout = _layout.plan(shape, axes)
    for name, param in params.items():
        if param is not None:
            check_param(param, name, layout.param_shape, shape)
    return Request(layout, dtype, accumulation_name(dtype), route.backend)


def check_backward(grad_y: Any, req: Request, **stats: Any) -> None:
    """``grad_y`` has x's shape and dtype; each statistic has the keepdims shape."""
    layout = req.layout
    check_same_shape(grad_y, "grad_y", layout.shape, "the shape of x")
    gdtype = check_float_dtype(grad_y, "grad_y")
    if gdtype != req.dtype:
        raise TypeError(f"grad_y must have the dtype of x ({req.dtype}), got dtype {gdtype}")
    for name, stat in stats.items():
        check_same_shape(stat, name, layout.stats_shape,
                         "x's shape with the normalized axes kept as 1")
        check_float_dtype(stat, name)


def resolve_eps(eps: Any, req: Request, rms: bool) -> float:
    """``eps`` checked; for RMSNorm ``None`` means the accumulation dtype's epsilon.

    A positive ``eps`` that rounds to 0 in the accumulation dtype (``1e-46`` for
    float32) is a ``ValueError``: it would silently turn constant rows into NaN.
    """
    if rms and eps is None:
        return MACHINE_EPS[req.acc]
    value = check_eps(eps)
    if value > 0.0 and np.dtype(req.acc).type(value) == 0.0:
        raise ValueError(
            f"eps={eps!r} rounds to 0 in the accumulation dtype {req.acc} of {req.dtype} "
            f"input; pass 0.0 or at least {np.finfo(req.acc).smallest_subnormal}"
        )
    return value


def _flat_param(xp: Any, param: Any, req: Request) -> Any:
    """``param`` as a contiguous 1-D array in the accumulation dtype.

    The Numba kernels widen float16/bfloat16 parameters where they load them (exactly,
    as a cast to float32 would), so there such a parameter keeps its dtype: NumPy's
    float16 cast takes 1.4 us for 768 elements, more than a (1, 768) row's kernel.
    """
    if param is None:
        return None
    dtype = req.acc
    if req.backend == "numba" and req.acc == "float32" \
            and dtype_name(param.dtype) in HALF_DTYPES:
        dtype = param.dtype
    if param.ndim == 1 and param.dtype == dtype and param.flags.c_contiguous:
        return param
    return xp.ascontiguousarray(param.reshape(-1)).astype(dtype, copy=False)


def _flat_stat(xp: Any, stat: Any, req: Request) -> Any:
    return xp.ascontiguousarray(stat.reshape(-1)).astype(req.acc, copy=False)


class Output:
    """Where a native kernel writes: a canonical view of the result, or a temporary.

    Parameters
    ----------
    xp : module
        NumPy or CuPy.
    x : array
        The input (its dtype is the output's; 16-bit floats may be raw bits).
    layout : Layout
        The request's layout.
    out : array or None
        A caller's output array, already checked for shape and dtype.
    params : tuple of array or None
        The other inputs the kernel reads (weight, bias).
    """

    def __init__(self, xp: Any, x: Any, layout: _layout.Layout, out: Any,
                 params: tuple[Any, ...] = ()) -> None:
        self.xp, self.layout, self.out = xp, layout, out
        self.view = None
        # An out that overlaps an input (x without being x, or weight or bias) would
        # overwrite values not yet read: compute into a temporary, then copy.
        if out is not None and (out is x or not xp.may_share_memory(out, x)) and not any(
                p is not None and xp.may_share_memory(out, p) for p in params):
            if layout.perm is None and out.flags.c_contiguous:
                self.view = out.reshape(layout.outer, layout.n, layout.inner)
            else:
                self.view = _layout.writable_canonical(out, layout, xp.may_share_memory)
        if self.view is None:
            shape = layout.shape
            if layout.perm is not None:
                shape = tuple(shape[i] for i in layout.perm)
            self.buffer = xp.empty(shape, dtype=x.dtype)
            self.view = self.buffer.reshape(layout.outer, layout.n, layout.inner)
        else:
            self.buffer = None

    def result(self) -> Any:
        """The output array: ``out`` (filled) or a new C-contiguous array."""
        if self.buffer is None:
            return self.out
        value = self.buffer
        if self.layout.perm is not None:
            value = value.transpose(tuple(int(i) for i in np.argsort(self.layout.perm)))
        if self.out is not None:
            self.out[...] = value
            return self.out
        return self.xp.ascontiguousarray(value)


def _device_scope(backend: Any, x: Any) -> Any:
    # Allocations must land on x's device, not the current one (CuPy allocates on its
    # current device): the backend names the scope, the engine allocates inside it.
    scope = getattr(backend, "device_scope", None)
    return contextlib.nullcontext() if scope is None else scope(x)


# --------------------------------------------------------------------------- forward


def forward(xp: Any, x: Any, req: Request, weight: Any, bias: Any, eps: float, out: Any,
            rms: bool, want_stats: bool = True) -> tuple[Any, Any, Any]:
    """Run a validated forward call: ``(y, mean or None, rstd)``.

    Parameters
    ----------
    xp : module
        The namespace of ``x``: NumPy or CuPy for the native backends, the array's
        array-API namespace for the generic one.
    x : array
        The input; for the native backends a NumPy/CuPy array whose dtype is
        ``req.dtype`` or, for 16-bit floats, their same-size integer bits.
    req : Request
        From :func:`request`.
    weight, bias : array or None
        Parameters in ``xp`` (any float dtype; ``bias`` is ignored for RMSNorm).
    eps : float
        Checked ``eps`` (:func:`resolve_eps`).
    out : array or None
        Checked output array in ``xp`` (native backends only).
    rms : bool
        RMSNorm instead of LayerNorm.
    want_stats : bool, default True
        Return the statistics (in keepdims shape) rather than None.

    Returns
    -------
    tuple
        ``(y, mean, rstd)``; ``mean`` is None for RMSNorm, both are None unless wanted.
    """
    layout = req.layout
    if req.backend == "array_api":
        bshape = layout.param_broadcast_shape
        if rms:
            y, rstd = generic.rms_norm(xp, x, layout.axes, bshape, weight, eps, req.acc)
            return y, None, rstd
        return generic.layer_norm(xp, x, layout.axes, bshape, weight, bias, eps, req.acc)

    backend = native(req.backend)
    with _device_scope(backend, x):
        target = Output(xp, x, layout, out, (weight, bias))
        rows = layout.rows
        mean = None if rms else xp.empty(rows, dtype=req.acc)
        rstd = xp.empty(rows, dtype=req.acc)
        if layout.n == 0:
            if mean is not None:
                mean[...] = 0
            rstd[...] = np.nan
        elif rows > 0:
            x3 = _layout.canonical(x, layout)
            w = _flat_param(xp, weight, req)
            if rms:
                backend.rms_norm_forward(x3, w, eps, target.view, rstd, req.dtype)
            else:
                b = _flat_param(xp, bias, req)
                backend.layer_norm_forward(x3, w, b, eps, target.view, mean, rstd, req.dtype)
        y = target.result()
    if not want_stats:
        return y, None, None
    stats = layout.stats_shape
    return y, (None if mean is None else mean.reshape(stats)), rstd.reshape(stats)


def normalize(x: Any, route: Route, normalized_shape: Any, weight: Any, bias: Any, eps: Any,
              axis: Any, out: Any, rms: bool, want_stats: bool) -> tuple[Any, Any, Any]:
    """Check every argument of a NumPy/CuPy/array-API forward call, then run it.

    Returns ``(y, mean, rstd)`` as :func:`forward` does.
    """
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    check_companions(x, route.library, out=out, **params)
    req = request(x, route, normalized_shape, axis, **params)
    eps = resolve_eps(eps, req, rms)
    if out is not None:
        if req.backend == "array_api":
            raise TypeError(
                "out= is not supported on the array_api backend (the generic path writes "
                "no array in place); call without out= or with the native backend"
            )
        check_out(out, req.layout.shape, req.dtype)
        check_no_internal_overlap(out, "out")
    xp = namespace(route.library, x)
    return forward(xp, x, req, weight, None if rms else bias, eps, out, rms, want_stats)


# --------------------------------------------------------------------------- backward


def _param_grad(xp: Any, grad: Any, layout: _layout.Layout, dtype: Any) -> Any:
    return xp.reshape(xp.astype(grad, dtype), layout.param_shape)


def backward(xp: Any, grad_y: Any, x: Any, req: Request, mean: Any, rstd: Any, weight: Any,
             rms: bool) -> tuple[Any, ...]:
    """Run a validated backward call.

    Parameters
    ----------
    xp : module
        As for :func:`forward`.
    grad_y, x : array
        The upstream gradient and the forward input (same conventions as ``x`` in
        :func:`forward`).
    req : Request
        From :func:`request`.
    mean, rstd : array
        The forward statistics (``mean`` None for RMSNorm).
    weight : array or None
        The forward weight.
    rms : bool
        RMSNorm instead of LayerNorm.

    Returns
    -------
    tuple
        ``(grad_x, grad_weight, grad_bias)`` for LayerNorm, ``(grad_x, grad_weight)``
        for RMSNorm; the parameter gradients in the accumulation dtype, shaped like the
        normalized axes (the caller casts them to the parameters' dtype).
    """
    layout = req.layout
    if req.backend == "array_api":
        bshape = layout.param_broadcast_shape
        if rms:
            gx, gw = generic.rms_norm_backward(xp, grad_y, x, rstd, weight, layout.axes,
                                               bshape, req.acc)
            return gx, xp.reshape(gw, layout.param_shape)
        gx, gw, gb = generic.layer_norm_backward(xp, grad_y, x, mean, rstd, weight,
                                                 layout.axes, bshape, req.acc)
        return gx, xp.reshape(gw, layout.param_shape), xp.reshape(gb, layout.param_shape)

    backend = native(req.backend)
    with _device_scope(backend, x):
        target = Output(xp, x, layout, None)
        if layout.n == 0 or layout.rows == 0:
            gw = xp.zeros(layout.n, dtype=req.acc)
            gb = None if rms else xp.zeros(layout.n, dtype=req.acc)
        else:
            gy3 = _layout.canonical(grad_y, layout)
            x3 = _layout.canonical(x, layout)
            w = _flat_param(xp, weight, req)
            r = _flat_stat(xp, rstd, req)
            if rms:
                gw = backend.rms_norm_backward(gy3, x3, r, w, target.view, req.dtype)
                gb = None
            else:
                m = _flat_stat(xp, mean, req)
                gw, gb = backend.layer_norm_backward(gy3, x3, m, r, w, target.view, req.dtype)
        gx = target.result()
    if rms:
        return gx, gw.reshape(layout.param_shape)
    return gx, gw.reshape(layout.param_shape), gb.reshape(layout.param_shape)


def gradients(grad_y: Any, x: Any, route: Route, mean: Any, rstd: Any, weight: Any,
              normalized_shape: Any, axis: Any, rms: bool) -> tuple[Any, ...]:
    """Check every argument of a NumPy/CuPy/array-API backward call, then run it.

    The parameter gradients come back in the dtype of ``weight`` (of ``x`` without one).
    """
    stats = {"rstd": rstd} if rms else {"mean": mean, "rstd": rstd}
    check_companions(x, route.library, grad_y=grad_y, weight=weight, **stats)
    req = request(x, route, normalized_shape, axis, weight=weight)
    check_backward(grad_y, req, **stats)
    xp = namespace(route.library, x)
    grads = backward(xp, grad_y, x, req, mean, rstd, weight, rms)
    dtype = (weight if weight is not None else x).dtype
    return (grads[0], *(xp.astype(g, dtype) if route.backend == "array_api"
                        else g.astype(dtype, copy=False) for g in grads[1:]))
