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
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import _layout
from ._backends import _array_api as generic
from ._dispatch import Route, check_companions, given_array, plain_ndarrays
from ._dtypes import (
    HALF_DTYPES,
    MACHINE_EPS,
    SUPPORTED,
    accumulation_name,
    array_library,
    bit_view,
    dtype_name,
)
from ._layout import c_contiguous
from ._validate import (
    QUANTIZE_QMAX,
    check_eps,
    check_float_dtype,
    check_given,
    check_no_internal_overlap,
    check_out,
    check_param,
    check_quantize,
    check_residual_dtype,
    check_same_shape,
    check_weight_offset,
    check_writeable,
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
    check_given(grad_y, "grad_y", f"an array of x's shape {layout.shape}")
    check_same_shape(grad_y, "grad_y", layout.shape, "the shape of x")
    gdtype = check_float_dtype(grad_y, "grad_y")
    if gdtype != req.dtype:
        raise TypeError(f"grad_y must have the dtype of x ({req.dtype}), got dtype {gdtype}")
    for name, stat in stats.items():
        check_given(stat, name, f"the {name} array returned by the forward call with "
                                f"return_stats=True (shape {layout.stats_shape})")
        check_same_shape(stat, name, layout.stats_shape,
                         "x's shape with the normalized axes kept as 1")
        check_float_dtype(stat, name)


def resolve_eps(eps: Any, req: Request, rms: bool) -> float:
    """``eps`` checked; for RMSNorm ``None`` means the accumulation dtype's epsilon.

    A positive ``eps`` that rounds to 0 in the accumulation dtype (``1e-46`` for
    float32) is a ``ValueError``: it would silently turn constant rows into NaN. So is
    one that rounds to infinity there (``1e39`` for float32): every row would become 0.
    """
    if rms and eps is None:
        return MACHINE_EPS[req.acc]
    value = check_eps(eps)
    with np.errstate(over="ignore"):
        rounded = np.dtype(req.acc).type(value)
    if value > 0.0 and rounded == 0.0:
        raise ValueError(
            f"eps={eps!r} rounds to 0 in the accumulation dtype {req.acc} of {req.dtype} "
            f"input; pass 0.0 or at least {np.finfo(req.acc).smallest_subnormal}"
        )
    if rounded == np.inf:
        raise ValueError(
            f"eps={eps!r} overflows the accumulation dtype {req.acc} of {req.dtype} "
            f"input; pass at most {np.finfo(req.acc).max}"
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
    empty : callable, optional
        ``empty(shape, dtype)`` allocates the temporary (default ``xp.empty``).
    """

    def __init__(self, xp: Any, x: Any, layout: _layout.Layout, out: Any,
                 params: tuple[Any, ...] = (), empty: Any = None) -> None:
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
            self.buffer = (xp.empty(shape, dtype=x.dtype) if empty is None
                           else empty(shape, x.dtype))
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
        # The contract fixes the NaN and infinite results (eps = 0 on a constant row, an
        # rstd beyond float32); NumPy's warnings on them would be noise, and the native
        # kernels give none.
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
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
    x, weight, bias = plain_ndarrays(route.library, x, weight, bias)
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
             rms: bool, grad_residual: Any = None) -> tuple[Any, ...]:
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
    grad_residual : array or None
        Added to ``grad_x`` by the kernels (x's shape and dtype); only for a native
        backend that fuses it (:func:`fuses_grad_residual`).

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
        # The backend's own allocation when it has one (the Numba backend's is aligned
        # for streaming stores).
        target = Output(xp, x, layout, None, empty=getattr(backend, "empty_output", None))
        if layout.n == 0 or layout.rows == 0:
            gw = xp.zeros(layout.n, dtype=req.acc)
            gb = None if rms else xp.zeros(layout.n, dtype=req.acc)
        else:
            gy3 = _layout.canonical(grad_y, layout)
            x3 = _layout.canonical(x, layout)
            w = _flat_param(xp, weight, req)
            r = _flat_stat(xp, rstd, req)
            extra = {} if grad_residual is None else {
                "grad_residual": _layout.canonical(grad_residual, layout)}
            if rms:
                gw = backend.rms_norm_backward(gy3, x3, r, w, target.view, req.dtype, **extra)
                gb = None
            else:
                m = _flat_stat(xp, mean, req)
                gw, gb = backend.layer_norm_backward(gy3, x3, m, r, w, target.view, req.dtype,
                                                     **extra)
        gx = target.result()
    if rms:
        return gx, gw.reshape(layout.param_shape)
    return gx, gw.reshape(layout.param_shape), gb.reshape(layout.param_shape)


def gradients(grad_y: Any, x: Any, route: Route, mean: Any, rstd: Any, weight: Any,
              normalized_shape: Any, axis: Any, rms: bool, weight_offset: Any = 0.0,
              grad_residual: Any = None) -> tuple[Any, ...]:
    """Check every argument of a NumPy/CuPy/array-API backward call, then run it.

    The parameter gradients come back in the dtype of ``weight`` (of ``x`` without one).
    With ``weight_offset`` the kernels see the gain ``weight + weight_offset``
    (:func:`gain`); with ``grad_residual`` ``grad_x`` is ``grad_x + grad_residual``
    (:func:`with_grad_residual`).
    """
    grad_y, x, mean, rstd, weight, grad_residual = plain_ndarrays(
        route.library, grad_y, x, mean, rstd, weight, grad_residual)
    stats = {"rstd": rstd} if rms else {"mean": mean, "rstd": rstd}
    check_companions(x, route.library, grad_y=grad_y, weight=weight,
                     grad_residual=grad_residual, **stats)
    req = request(x, route, normalized_shape, axis, weight=weight)
    check_backward(grad_y, req, **stats)
    offset = check_weight_offset(weight_offset, weight is not None, req.acc)
    check_grad_residual(grad_residual, req)
    xp = namespace(route.library, x)
    g = gain(xp, weight, offset, req.acc)

    def run(gy: Any, xx: Any) -> tuple[Any, ...]:
        r = req if xx is x else request(xx, route, normalized_shape, axis, weight=g)
        return backward(xp, gy, xx, r, mean, rstd, g, rms)

    if grad_residual is not None and fuses_grad_residual(req):
        grads = backward(xp, grad_y, x, req, mean, rstd, g, rms, grad_residual)
    else:
        grads = with_grad_residual(xp, grad_y, x, req, run, grad_residual)
    dtype = (weight if weight is not None else x).dtype
    if route.backend == "array_api":
        return (grads[0], *(xp.astype(g, dtype) for g in grads[1:]))
    if route.backend == "numba":
        return (grads[0], *(native("numba").narrowed_param(g, dtype) for g in grads[1:]))
    return (grads[0], *(g.astype(dtype, copy=False) for g in grads[1:]))


# --------------------------------------------------------------------------- fusions
# The transformer-block fusions (residual add, offset gain, quantized output, gradient
# of the residual stream) composed from the kernels above, in each array's namespace.
# Every library runs these same functions; a fused kernel can later replace a
# composition here without changing a bit of the results.


def _is_native_namespace(xp: Any) -> bool:
    return xp is np or getattr(xp, "__name__", "") == "cupy"


def dtype_of(xp: Any, name: str) -> Any:
    """The dtype called ``name`` in namespace ``xp`` (NumPy's 16/8-bit floats: ml_dtypes).

    ``TypeError`` if the library has no such dtype (CuPy has no bfloat16 or float8).
    """
    if xp is np:
        if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, name))
        return np.dtype(name)
    dtype = getattr(xp, name, None)
    if dtype is None and getattr(xp, "__name__", "").endswith("torch"):
        import torch

        dtype = getattr(torch, name, None)
    if dtype is None:
        library = getattr(xp, "__name__", type(xp).__name__)
        raise TypeError(f"{library} has no {name} dtype; use NumPy (with ml_dtypes) or torch "
                        f"for {name} arrays")
    return dtype


def astype(xp: Any, arr: Any, name: str) -> Any:
    """``arr`` converted (rounding to nearest even) to the dtype called ``name``."""
    dtype = dtype_of(xp, name)
    if _is_native_namespace(xp):
        return arr.astype(dtype, copy=False)
    return xp.astype(arr, dtype)


def gain(xp: Any, weight: Any, offset: float, acc: str) -> Any:
    """The gain ``weight + offset`` formed in the accumulation dtype ``acc``.

    With no offset the weight goes to the kernels as it is (adding 0.0 would turn a
    ``-0.0`` weight into ``+0.0``).
    """
    if weight is None or offset == 0.0:
        return weight
    return astype(xp, weight, acc) + offset


def sum_dtypes(x_name: str, residual_name: str, residual_dtype: Any) -> tuple[str, str]:
    """``(add, h)``: the dtype ``x + residual`` is computed in and the dtype of ``h``.

    The sum is computed in float64 if any of x, residual and residual_dtype is float64,
    else in float32; ``h`` has ``residual_dtype`` (default: the residual's dtype).
    """
    h_name = check_residual_dtype(residual_dtype) or residual_name
    add = "float64" if "float64" in (x_name, residual_name, h_name) else "float32"
    return add, h_name


def residual_sum(xp: Any, x: Any, residual: Any, add: str, h_name: str) -> Any:
    """``h = x + residual`` computed in ``add`` and rounded once to ``h_name``."""
    if _is_native_namespace(xp):
        # Into a C-ordered array, the inputs widened inside the ufunc's loop: no copy of
        # either input, and no reordering copy of a transposed or Fortran-ordered sum.
        h = xp.empty(tuple(x.shape), dtype=dtype_of(xp, add))
        xp.add(x, residual, out=h, dtype=h.dtype)
        return astype(xp, h, h_name)
    return c_contiguous(astype(xp, astype(xp, x, add) + astype(xp, residual, add), h_name))


def check_grad_residual(grad_residual: Any, req: Request) -> None:
    """``grad_residual`` has x's shape and dtype (it is a gradient of x's stream)."""
    if grad_residual is None:
        return
    check_same_shape(grad_residual, "grad_residual", req.layout.shape, "the shape of x")
    got = check_float_dtype(grad_residual, "grad_residual")
    if got != req.dtype:
        raise TypeError(f"grad_residual must have the dtype of x ({req.dtype}), got dtype {got}")


def fuses_grad_residual(req: Request) -> bool:
    """Whether the call's backend adds ``grad_residual`` inside its backward kernels."""
    return req.backend != "array_api" and getattr(native(req.backend), "FUSES_GRAD_RESIDUAL",
                                                   False)


def with_grad_residual(xp: Any, grad_y: Any, x: Any, req: Request, run: Any,
                       grad_residual: Any) -> tuple[Any, ...]:
    """``run(grad_y, x)`` (the backward), with ``grad_residual`` added to ``grad_x``.

    The sum is taken in the accumulation dtype and rounded once to x's dtype: for
    16-bit ``x`` the backward runs on exactly widened copies of ``x`` and ``grad_y``
    (the kernels' arithmetic is float32 either way), so ``grad_x`` is not rounded
    before the addition.
    """
    if grad_residual is None:
        return run(grad_y, x)
    if req.dtype == req.acc:
        grads = run(grad_y, x)
        return (grads[0] + grad_residual, *grads[1:])
    grads = run(astype(xp, grad_y, req.acc), astype(xp, x, req.acc))
    total = grads[0] + astype(xp, grad_residual, req.acc)
    return (astype(xp, total, req.dtype), *grads[1:])


def _saturate(xp: Any, v: Any, low: float, high: float) -> Any:
    # Comparisons are False for NaN, so NaN passes through unchanged.
    v = xp.where(v > high, xp.full_like(v, high), v)
    return xp.where(v < low, xp.full_like(v, low), v)


def _float32_round_to_odd(xp: Any, v: Any) -> Any:
    """float64 ``v`` (finite or NaN, inside float32's range) as float32, rounded to odd.

    Rounding to float32 by "round to odd" and then to float8 gives the float8 value
    nearest to ``v`` (ties to even): a direct float64 -> float8 conversion goes through
    float32 in NumPy/ml_dtypes and torch, rounding twice. Without an integer view of
    the array (namespaces other than NumPy, CuPy, torch and JAX) ``v`` is returned
    as it is, for the library's own float64 -> float8 conversion: rounding it to
    float32 here would round twice for certain.
    """
    t = astype(xp, v, "float32")
    bits = bit_view(t, "int32")
    if bits is None:
        return v
    back = astype(xp, t, "float64")
    inexact = back != v
    # Truncate towards zero: one step down in magnitude is one step down in the bits.
    toward_zero = inexact & (xp.abs(back) > xp.abs(v))
    bits = xp.where(toward_zero, bits - 1, bits)
    bits = xp.where(inexact, bits | 1, bits)
    return bit_view(bits, "float32")


def check_scale(xp: Any, scale: Any, stats_shape: tuple[int, ...], acc: str) -> None:
    """A static ``scale``: positive and finite, broadcastable to the statistics' shape,
    and usable in the accumulation dtype ``acc``: neither it nor ``1 / scale`` may round
    to 0 or overflow there (``scale=1e-40`` in float32 would saturate every code)."""
    if scale is None:
        return
    import numbers

    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        try:
            finite = math.isfinite(scale)
        except OverflowError:  # an int or Fraction beyond the float range, e.g. 10**400
            finite = False
        if not (finite and scale > 0):
            raise ValueError(f"scale must be positive and finite, got {scale!r}")
        with np.errstate(over="ignore", divide="ignore"):
            s = np.dtype(acc).type(scale)
            usable = bool(np.isfinite(s) and np.isfinite(np.dtype(acc).type(1) / s))
        if not usable:
            raise ValueError(_unusable_scale(f"scale={scale!r}", acc))
        return
    shape = getattr(scale, "shape", None)
    if shape is None or isinstance(scale, bool):
        raise TypeError(f"scale must be a positive finite number or an array, got {scale!r}")
    shape = tuple(int(s) for s in shape)
    try:
        ok = np.broadcast_shapes(shape, stats_shape) == stats_shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"scale must be broadcastable to the statistics' shape {stats_shape}, "
                         f"got shape {shape}")
    kind = dtype_name(scale.dtype)
    if not kind.startswith(("float", "bfloat", "int", "uint")):
        raise TypeError(f"scale must have a real dtype, got dtype {kind}")
    good = _known(xp.all((scale > 0) & xp.isfinite(scale)))
    if good is False:
        low, high = float(xp.min(scale)), float(xp.max(scale))
        raise ValueError("scale must be positive and finite in every element, got values "
                         f"from {low!r} to {high!r}")
    with np.errstate(over="ignore", divide="ignore"):
        s = astype(xp, scale, acc)
        usable = _known(xp.all(xp.isfinite(s) & xp.isfinite(1 / s)))
    if usable is False:
        raise ValueError(_unusable_scale("an element of scale", acc))


def _known(flag: Any) -> bool | None:
    """``bool(flag)`` for a 0-d boolean array, or None where its value is not known
    when the call is traced or lazy: under ``jax.jit`` an argument's values exist only
    when the compiled function runs, so a traced ``scale`` is checked for its shape and
    dtype only and used as given; a Dask ``scale`` likewise, its values checked in each
    block when the result is computed (computing them here would run its graph)."""
    if array_library(flag) == "dask":
        return None
    try:
        return bool(flag)
    except Exception as exc:  # jax's ConcretizationTypeError family, without importing jax
        if array_library(exc) == "jax":
            return None
        raise


def _unusable_scale(what: str, acc: str) -> str:
    info = np.finfo(acc)
    return (f"{what} is outside the range the accumulation dtype {acc} takes (it or "
            f"1 / scale would round to 0 or overflow there); pass a scale between "
            f"{info.tiny} and {info.max}")


def quantize_rows(xp: Any, y32: Any, axes: tuple[int, ...], fmt: str, scale: Any,
                  acc: str) -> tuple[Any, Any]:
    """``(q, scale)``: ``y32`` (accumulation dtype) quantized to ``fmt`` per row.

    Dynamic (``scale=None``): ``scale = amax_row(|y32|) / qmax`` in keepdims shape (1.0
    for an all-zero row). ``q = convert(y32 * (1 / scale))``, ``1 / scale`` computed once
    per row in ``acc``; ``convert`` rounds half to even and saturates (int8 to
    [-128, 127] with NaN -> 0; float8 to +-qmax with NaN kept).
    """
    qmax = QUANTIZE_QMAX[fmt]
    target = dtype_of(xp, fmt)  # TypeError early for libraries without the format
    if scale is None:
        if math.prod(y32.shape[a] for a in axes) == 0:  # rows of no elements: amax 0
            kept = tuple(1 if i in axes else d for i, d in enumerate(y32.shape))
            amax = xp.zeros(kept, dtype=y32.dtype)
        else:
            amax = xp.max(xp.abs(y32), axis=axes, keepdims=True)
        s = amax / qmax
        s = xp.where(amax == 0, xp.ones_like(s), s)
        returned = s
    else:
        inv = static_inverse(xp, scale, acc)
        returned = scale
    # A row whose amax / qmax rounds to 0 has 1 / scale = inf, and its codes saturate
    # (zeros: NaN -> int8 0), as the kernels write; NumPy-backed namespaces would warn.
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if scale is None:
            inv = 1.0 / s
        v = y32 * inv
        if fmt == "int8":
            v = xp.where(xp.isnan(v), xp.zeros_like(v), v)
            v = _saturate(xp, xp.round(v), -128.0, 127.0)
        else:
            v = _saturate(xp, v, -qmax, qmax)
            if acc == "float64":
                v = _float32_round_to_odd(xp, v)
            # One NaN code, as the kernels write: the sign of y32 * (1 / scale) for a NaN
            # row would depend on the library's multiply loop (so on the batch's shape).
            v = xp.where(xp.isnan(v), xp.full_like(v, math.nan), v)
        if _is_native_namespace(xp):
            return v.astype(target), returned
        return xp.astype(v, target), returned


def _into(out: Any, value: Any) -> Any:
    if out is None:
        return value
    if hasattr(out, "copy_"):  # torch
        out.copy_(value)
    else:
        out[...] = value
    return out


#: A composed forward that needs intermediate arrays (a quantized output, or an output of
#: another dtype than its input) computes them for blocks of samples holding about this
#: many bytes of accumulation-dtype values (no effect on results: every step is per
#: sample), so that its peak memory is the output's plus a few such blocks instead of
#: several arrays of the input's size (a float64 ``x`` quantized whole took 5 times its
#: own size). NumPy and CuPy only: other namespaces compose whole (JAX has no writes
#: into parts of an array; torch's blocks would be separate autograd nodes, and under
#: ``torch.func.vmap`` a batched block cannot be copied into an unbatched output).
COMPOSE_BLOCK_BYTES = 4 << 20


def _sample_blocks(xp: Any, shape: tuple[int, ...], axes: tuple[int, ...],
                   acc: str) -> tuple[int, list[slice]] | None:
    """``(axis, slices)`` cutting ``shape`` along one sample axis (not in ``axes``) into
    blocks of about :data:`COMPOSE_BLOCK_BYTES` of ``acc`` values, or None: one block
    will do, or ``xp`` cannot write an array in parts."""
    if not _is_native_namespace(xp):
        return None
    total = math.prod(shape) * np.dtype(acc).itemsize
    if total <= COMPOSE_BLOCK_BYTES:
        return None
    # The outermost sample axis that has several samples: the largest steps in memory.
    axis = next((i for i, d in enumerate(shape) if i not in axes and d > 1), None)
    if axis is None:
        return None
    step = max(1, COMPOSE_BLOCK_BYTES // (total // shape[axis]))
    return axis, [slice(i, min(i + step, shape[axis])) for i in range(0, shape[axis], step)]


def _scale_part(scale: Any, axis: int, ndim: int, part: slice) -> Any:
    """The part of a static ``scale`` (broadcastable to the statistics' shape, ``ndim``
    dimensions) that the samples ``part`` of ``axis`` use."""
    if scale is None or not hasattr(scale, "shape"):
        return scale
    at = axis - (ndim - len(scale.shape))
    if at < 0 or scale.shape[at] == 1:
        return scale
    return scale[(slice(None),) * at + (part,)]


def _composed(xp: Any, h: Any, req: Request, norm: Any, y_name: str, quantize: Any,
              scale: Any) -> tuple[Any, Any, Any, Any]:
    """:func:`compose`'s ``(y, scale, mean, rstd)`` of ``h`` (all or part of the call's
    samples), ``y`` a new array."""
    if quantize is None:
        yh, mean, rstd = norm(h, None)
        return astype(xp, yh, y_name), None, mean, rstd
    wide = h if req.dtype == req.acc else astype(xp, h, req.acc)
    y32, mean, rstd = norm(wide, None)
    q, s = quantize_rows(xp, y32, req.layout.axes, quantize, scale, req.acc)
    return q, s, mean, rstd


def _concat(xp: Any, parts: list[Any], axis: int) -> Any:
    if parts[0] is None:
        return None
    return xp.concatenate(parts, axis=axis)


def compose(xp: Any, h: Any, req: Request, norm: Any, y_name: str, out: Any, quantize: Any,
            scale: Any) -> tuple[Any, Any, Any, Any]:
    """The output of a (fused) forward from its normalization: ``(y, scale, mean, rstd)``.

    ``norm(a, out) -> (y, mean, rstd)`` normalizes ``a`` (``h`` itself, part of its
    samples, or either widened exactly to the accumulation dtype) with the call's gain,
    bias and eps. ``y`` is that of ``h`` cast to ``y_name``, or with ``quantize`` the
    quantized ``y32`` (the output of the widened ``h``, which the kernels compute in the
    same float32 arithmetic as for ``h`` itself, before its rounding); ``scale`` is None
    without ``quantize``. Where intermediate arrays are needed, large NumPy and CuPy calls
    go block of samples by block of samples (:data:`COMPOSE_BLOCK_BYTES`), with the same
    results.
    """
    if quantize is None and y_name == req.dtype:
        y, mean, rstd = norm(h, out)
        return y, None, mean, rstd
    blocks = _sample_blocks(xp, tuple(h.shape), req.layout.axes, req.acc)
    if blocks is None:
        y, s, mean, rstd = _composed(xp, h, req, norm, y_name, quantize, scale)
        return _into(out, y), s, mean, rstd
    axis, parts = blocks
    ndim = len(h.shape)
    y = out
    results: list[tuple[Any, Any, Any]] = []
    for part in parts:
        index = (slice(None),) * axis + (part,)
        yb, sb, mean, rstd = _composed(xp, h[index], req, norm, y_name, quantize,
                                       _scale_part(scale, axis, ndim, part))
        if y is None:
            y = xp.empty(tuple(h.shape), dtype=yb.dtype)
        y[index] = yb
        results.append((sb, mean, rstd))
    s = scale if quantize is None or scale is not None else _concat(
        xp, [r[0] for r in results], axis)
    return (y, s, _concat(xp, [r[1] for r in results], axis),
            _concat(xp, [r[2] for r in results], axis))


def check_extras(xp: Any, req: Request, weight: Any, weight_offset: Any, quantize: Any,
                 scale: Any, out: Any) -> tuple[float, str | None]:
    """Check ``weight_offset``, ``quantize``, ``scale`` and ``out`` of a forward call.

    Returns the offset as a float and the quantize format (or None).
    """
    offset = check_weight_offset(weight_offset, weight is not None, req.acc)
    quantize = check_quantize(quantize)
    if quantize is not None:
        dtype_of(xp, quantize)
        check_scale(xp, scale, req.layout.stats_shape, req.acc)
    elif scale is not None:
        raise ValueError("scale= is only used with quantize=; pass quantize='int8', "
                         "'float8_e4m3fn' or 'float8_e5m2', or drop scale")
    _no_array_api_out(req, out=out)
    if out is not None:
        check_fused_out(out, req, quantize)
    return offset, quantize


def check_fused_out(out: Any, req: Request, quantize: Any, name: str = "out") -> None:
    """``out=`` has x's shape and x's dtype, or the quantized dtype with ``quantize``."""
    if quantize is None:
        check_out(out, req.layout.shape, req.dtype)
    else:
        check_same_shape(out, name, req.layout.shape, "the shape of x")
        got = dtype_name(out.dtype)
        if got != quantize:
            raise ValueError(f"{name} must have the quantized dtype {quantize} "
                             f"(quantize={quantize!r}), got dtype {got}")
        check_writeable(out, name)
    if hasattr(out, "strides"):  # torch checks its own outputs when it copies into them
        check_no_internal_overlap(out, name)


def _no_array_api_out(req: Request, **outs: Any) -> None:
    for name, arr in outs.items():
        if arr is not None and req.backend == "array_api":
            raise TypeError(
                f"{name}= is not supported on the array_api backend (the generic path writes "
                f"no array in place); call without {name}= or with the native backend"
            )


def normalize_ex(x: Any, route: Route, normalized_shape: Any, weight: Any, bias: Any,
                 eps: Any, axis: Any, out: Any, rms: bool, want_stats: bool,
                 weight_offset: Any = 0.0, quantize: Any = None,
                 scale: Any = None) -> tuple[Any, Any, Any, Any]:
    """:func:`normalize` with ``weight_offset`` and ``quantize``: ``(y, scale, mean, rstd)``."""
    x, weight, bias = plain_ndarrays(route.library, x, weight, bias)
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    check_companions(x, route.library, out=out, scale=given_array(scale), **params)
    req = request(x, route, normalized_shape, axis, **params)
    eps = resolve_eps(eps, req, rms)
    xp = namespace(route.library, x)
    offset, quantize = check_extras(xp, req, weight, weight_offset, quantize, scale, out)
    g = gain(xp, weight, offset, req.acc)
    b = None if rms else bias
    if quantize is not None:
        fused = fused_rows(xp, x, None, req, None, g, b, eps, rms, out, None, quantize, scale)
        if fused is not None:
            return fused[0], fused[2], fused[3], fused[4]

    def norm(a: Any, o: Any) -> tuple[Any, Any, Any]:
        r = req if a is x else request(a, route, normalized_shape, axis, weight=g, bias=b)
        return forward(xp, a, r, g, b, eps, o, rms, want_stats)

    return compose(xp, x, req, norm, req.dtype, out, quantize, scale)


def check_residual(residual: Any, req: Request) -> str:
    """``residual`` has x's shape and a supported float dtype; returns the dtype's name."""
    check_given(residual, "residual", f"an array of x's shape {req.layout.shape}")
    check_same_shape(residual, "residual", req.layout.shape, "the shape of x")
    return check_float_dtype(residual, "residual")


def check_residual_out(residual_out: Any, req: Request, h_name: str) -> None:
    """``residual_out=`` has x's shape and h's dtype, and is writeable."""
    check_same_shape(residual_out, "residual_out", req.layout.shape, "the shape of x")
    got = check_float_dtype(residual_out, "residual_out")
    if got != h_name:
        raise ValueError(f"residual_out must have the dtype of h ({h_name}), got dtype {got}")
    if hasattr(residual_out, "strides"):
        check_no_internal_overlap(residual_out, "residual_out")
    check_writeable(residual_out, "residual_out")


def unshared(xp: Any, may_share: Any, target: Any, *params: Any) -> tuple[Any, ...]:
    """``params`` with each one that shares memory with ``target`` (per ``may_share``)
    replaced by a copy: ``target`` is written (``h`` into ``residual_out``) before they
    are read, and the results must be those of the parameters as passed."""
    return tuple(p if p is None or not may_share(target, p) else xp.asarray(p, copy=True)
                 for p in params)


def check_distinct_outputs(share: Any, out: Any, residual_out: Any) -> None:
    """``out`` (y) and ``residual_out`` (h) cannot have an element in common; ``share``
    tells exactly (:func:`shares_elements`), so that the two halves of each row of one
    buffer, or its even and odd rows, can take y and h in place of x and the residual."""
    if out is not None and residual_out is not None and (
            out is residual_out or share(out, residual_out)):
        raise ValueError("out and residual_out share memory; y and h need separate arrays")


def _interface(arr: Any) -> dict[str, Any]:
    """A NumPy or CuPy array's array interface (CuPy's is the CUDA one)."""
    return getattr(arr, "__array_interface__", None) or arr.__cuda_array_interface__


def extent(arr: Any) -> _layout.Extent:
    """Where a NumPy or CuPy array's elements lie (its array interface)."""
    iface = _interface(arr)
    itemsize = np.dtype(iface["typestr"]).itemsize
    shape = tuple(iface["shape"])
    strides = iface.get("strides")
    if strides is None:  # C-contiguous
        strides = tuple(itemsize * math.prod(shape[i + 1:]) for i in range(len(shape)))
    return _layout.Extent(int(iface["data"][0]), shape, tuple(strides), itemsize)


def shares_elements(a: Any, b: Any) -> bool:
    """Whether the NumPy or CuPy arrays ``a`` and ``b`` have a byte in common (exactly:
    ``may_share_memory`` only compares their bounds)."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    return _layout.share_bytes(extent(a), extent(b))


def _address(a: Any) -> int:
    return int(_interface(a)["data"][0])


def _same_view(a: Any, b: Any) -> bool:
    """Whether the arrays ``a`` and ``b`` are the same elements in the same order (in
    place); the strides of axes of length one do not matter."""
    return a.shape == b.shape and _address(a) == _address(b) and all(
        size == 1 or sa == sb for size, sa, sb in zip(a.shape, a.strides, b.strides, strict=True))


def _rows_view(xp: Any, arr: Any, layout: _layout.Layout) -> Any:
    """The canonical view of ``arr`` if it is one with unit-stride rows, else None."""
    view = _layout.writable_canonical(arr, layout, xp.may_share_memory)
    if view is None or (layout.n > 1 and view.strides[1] != view.itemsize):
        return None
    return view


def fused_add(xp: Any, x: Any, residual: Any, req: Request, h_name: str, gain_: Any,
              bias: Any, eps: Any, rms: bool, out: Any, residual_out: Any
              ) -> tuple[Any, Any, Any, Any] | None:
    """``(y, h, mean, rstd)`` of a validated ``add_`` call by the backend's one-pass kernel,
    or None where there is none for this call (then the caller composes).

    The backend fuses rows (``inner == 1``, no transpose) of unit stride whose x,
    residual and h dtypes share one accumulation dtype (``req.acc``: any of float16,
    bfloat16, float32, or all float64), with h in x's dtype or in the accumulation
    dtype; ``y`` has x's dtype. An output may be ``x`` or
    ``residual`` itself; one that partly overlaps an input, a parameter or the other
    output leaves the call to the composition (which copies through temporaries).
    ``gain_`` is the gain (:func:`gain`); statistics come back in
    keepdims shape (``mean`` None for RMSNorm). ``eps`` is the caller's, resolved here
    for ``h`` (the array normalized), as the composition resolves it.
    """
    fused = fused_rows(xp, x, residual, req, h_name, gain_, bias, eps, rms, out,
                       residual_out)
    return None if fused is None else (fused[0], fused[1], fused[3], fused[4])


def _fusable_rows(xp: Any, req: Request, *arrays: Any) -> tuple[Any, ...] | None:
    """The canonical 2-D row views of ``arrays`` if the call is one a one-pass kernel
    takes (native backend, ``inner == 1``, no transpose, no empty axis, rows of unit
    stride), else None."""
    layout = req.layout
    if req.backend == "array_api" or layout.inner != 1 or layout.perm is not None \
            or layout.n == 0 or layout.rows == 0:
        return None
    views = tuple(_layout.canonical(a, layout) for a in arrays)
    if layout.n > 1 and any(v.strides[1] != v.itemsize for v in views):
        return None
    return views


def static_inverse(xp: Any, scale: Any, acc: str) -> Any:
    """``1 / scale`` of a static ``scale``, computed in ``acc`` (as the contract says:
    once per row, in the statistics dtype)."""
    s = astype(xp, xp.asarray(scale), acc) if hasattr(scale, "shape") \
        else xp.asarray(scale, dtype=dtype_of(xp, acc))
    return 1.0 / s


def fused_rows(xp: Any, x: Any, residual: Any, req: Request, h_name: str | None,
               gain_: Any, bias: Any, eps: Any, rms: bool, out: Any, residual_out: Any,
               quantize: str | None = None, scale: Any = None
               ) -> tuple[Any, Any, Any, Any, Any] | None:
    """``(y, h, scale, mean, rstd)`` by a one-pass kernel of the backend, or None.

    Serves :func:`fused_add` (``h = x + residual`` then the norm) and the quantized
    forwards, with or without a residual (``residual`` None: ``h`` is None and ``eps`` is
    already resolved). With ``quantize`` the backend's kernel normalizes into float32
    and quantizes from the cache (accumulation dtype float32 only); ``y`` (the codes)
    may share no memory with an input, ``scale`` is the per-row scale (dynamic) or the
    caller's; an ``out`` for the codes may be any array of 1-byte elements (their bits).
    Statistics come back in keepdims shape (``mean`` None for RMSNorm).
    """
    layout = req.layout
    backend = None if req.backend == "array_api" else native(req.backend)
    if quantize is not None:
        kernel = getattr(backend, "quantized_forward", None)
        if req.acc != "float32":
            return None
    else:
        kernel = getattr(backend, "add_rms_norm_forward" if rms else "add_layer_norm_forward",
                         None)
    inputs = (x,) if residual is None else (x, residual)
    views = None if kernel is None else _fusable_rows(xp, req, *inputs)
    if views is None:
        return None
    x3 = views[0]
    r3 = None if residual is None else views[1]
    r_name = None if residual is None else dtype_name(residual.dtype)
    if residual is not None:
        if r_name not in SUPPORTED:
            # Bits of a dtype the library lacks (torch's bfloat16 travels to CuPy as
            # uint16): a residual stored as x is has x's dtype; any other is composed.
            if residual.dtype != x.dtype:
                return None
            r_name = req.dtype
        # y is norm(h) rounded to h's dtype, then to x's: one rounding to x's dtype only
        # when h's dtype is x's or the accumulation dtype itself.
        if h_name not in (req.dtype, req.acc) or accumulation_name(r_name) != req.acc:
            return None
        eps = resolve_eps(eps, replace(req, dtype=h_name), rms)
    # A given ``out`` for codes may be a 1-byte view (CuPy has no float8 dtype): the
    # format's dtype is only looked up where the codes are allocated here.
    y_dtype = x.dtype if quantize is None else (None if out is not None
                                                 else dtype_of(xp, quantize))
    # h in x's dtype is stored as x is (bits, where the library lacks the dtype).
    h_dtype = None if residual is None else (
        x.dtype if h_name == req.dtype else dtype_of(xp, h_name))
    wanted = [(out, y_dtype)] + ([] if residual is None else [(residual_out, h_dtype)])
    with _device_scope(backend, x):
        outs = []
        for given, dtype in wanted:
            view = None if given is None else _rows_view(xp, given, layout)
            if given is not None and view is None:
                return None
            if view is None:
                given = xp.empty(layout.shape, dtype=dtype)
                view = given.reshape(layout.outer, layout.n, 1)
            outs.append((given, view))
        params = [p for p in (gain_, bias) if p is not None]
        views_out = [v for _, v in outs]
        def overlap(a: Any, b: Any) -> bool:  # bounds first: the exact test costs more
            return bool(xp.may_share_memory(a, b)) and shares_elements(a, b)

        for k, o3 in enumerate(views_out):
            exact_ok = quantize is None or k == 1  # the codes never alias an input
            if any(overlap(o3, a) and not (exact_ok and _same_view(o3, a)) for a in views) \
                    or any(overlap(o3, other) for j, other in enumerate(views_out) if j != k) \
                    or any(overlap(o3, p) for p in params):
                return None
        y, y3 = outs[0]
        h, h3 = outs[1] if residual is not None else (None, None)
        w = _flat_param(xp, gain_, req)
        b = None if rms else _flat_param(xp, bias, req)
        rstd = xp.empty(layout.rows, dtype=req.acc)
        mean = None if rms else xp.empty(layout.rows, dtype=req.acc)
        dtypes = (req.dtype, r_name, h_name)
        returned = None
        if quantize is not None:
            scale_out = xp.empty(layout.rows if scale is None else 0, dtype=req.acc)
            inv = None
            if scale is not None:
                inv = xp.ascontiguousarray(xp.broadcast_to(
                    static_inverse(xp, scale, req.acc), layout.stats_shape)).reshape(-1)
                returned = scale
            kernel(x3, r3, w, b, eps, h3, y3, mean, rstd, quantize, inv, scale_out, dtypes)
            if scale is None:
                returned = scale_out.reshape(layout.stats_shape)
        elif rms:
            kernel(x3, r3, w, eps, h3, y3, rstd, dtypes)
        else:
            kernel(x3, r3, w, b, eps, h3, y3, mean, rstd, dtypes)
    stats = layout.stats_shape
    return (y, h, returned, None if mean is None else mean.reshape(stats),
            rstd.reshape(stats))


def add_normalize(x: Any, residual: Any, route: Route, normalized_shape: Any, weight: Any,
                  bias: Any, eps: Any, axis: Any, rms: bool, want_stats: bool,
                  weight_offset: Any, residual_dtype: Any, quantize: Any, scale: Any,
                  out: Any, residual_out: Any) -> tuple[Any, Any, Any, Any, Any]:
    """Check every argument of an ``add_`` call, then run it: ``(y, h, scale, mean, rstd)``.

    Where the backend has a one-pass kernel for the call (:func:`fused_add`), it computes
    ``h`` and ``y`` block of rows by block of rows. Otherwise ``h = x + residual``
    (:func:`residual_sum`) is computed whole, and written to ``residual_out`` if given,
    before ``y`` is written. Either way ``out`` and ``residual_out`` may be ``x`` or
    ``residual`` themselves, and ``y`` is bit for bit the composition's.
    """
    x, residual, weight, bias = plain_ndarrays(route.library, x, residual, weight, bias)
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    check_companions(x, route.library, residual=residual, out=out, residual_out=residual_out,
                     scale=given_array(scale), **params)
    req_x = request(x, route, normalized_shape, axis, **params)
    r_name = check_residual(residual, req_x)
    add, h_name = sum_dtypes(req_x.dtype, r_name, residual_dtype)
    xp = namespace(route.library, x)
    _no_array_api_out(req_x, residual_out=residual_out)
    offset, quantize = check_extras(xp, req_x, weight, weight_offset, quantize, scale, out)
    if residual_out is not None:
        check_residual_out(residual_out, req_x, h_name)
        check_distinct_outputs(shares_elements, out, residual_out)
    if accumulation_name(h_name) == req_x.acc:
        fused = fused_rows(xp, x, residual, req_x, h_name, gain(xp, weight, offset, req_x.acc),
                           None if rms else bias, eps, rms, out, residual_out, quantize, scale)
        if fused is not None:
            return fused
    h = residual_sum(xp, x, residual, add, h_name)
    if residual_out is not None:
        weight, bias = unshared(xp, xp.may_share_memory, residual_out, weight, bias)
        h = _into(residual_out, h)
    req = request(h, route, normalized_shape, axis, **params)
    eps = resolve_eps(eps, req, rms)
    g = gain(xp, weight, offset, req.acc)
    b = None if rms else bias

    def norm(a: Any, o: Any) -> tuple[Any, Any, Any]:
        r = request(a, route, normalized_shape, axis, weight=g, bias=b)
        return forward(xp, a, r, g, b, eps, o, rms, want_stats)

    y, s, mean, rstd = compose(xp, h, req, norm, req_x.dtype, out, quantize, scale)
    return y, h, s, mean, rstd


def results(y: Any, h: Any, scale: Any, mean: Any, rstd: Any, quantize: Any,
            return_stats: bool, rms: bool, add: bool) -> Any:
    """What a public forward returns: ``y``, then ``h`` (``add_`` functions), then
    ``scale`` (with ``quantize``), then the statistics (with ``return_stats``)."""
    parts = [y]
    if add:
        parts.append(h)
    if quantize is not None:
        parts.append(scale)
    if return_stats:
        parts += [rstd] if rms else [mean, rstd]
    return parts[0] if len(parts) == 1 else tuple(parts)
