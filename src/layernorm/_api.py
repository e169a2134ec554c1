"""The public functions: validate once, pick the backend, delegate.

Every public function follows the same steps: find the library of ``x``
(:mod:`._dispatch`), hand torch tensors and Dask arrays to their glue modules (which
call back into these functions with NumPy/CuPy arrays), check every argument
(:mod:`._validate`), then run either the native kernels on the ``(outer, n, inner)``
view (:mod:`._layout`) or the generic array-API implementation.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _fast, _layout
from ._backends import _array_api
from ._dispatch import check_companions, library_of
from ._dtypes import HALF_DTYPES, MACHINE_EPS, accumulation_name, dtype_name
from ._validate import (
    check_backend_name,
    check_eps,
    check_float_dtype,
    check_out,
    check_param,
    check_same_shape,
    memo_axes,
    resolve_axes,
    shape_of,
)

_NATIVE_MODULES = {"numba": "._backends._numba", "cupy": "._backends._cupy"}
_GLUE_MODULES = {"torch": "._backends._torch", "dask": "._backends._dask"}


@dataclass(frozen=True)
class Request:
    """Everything validated about one call."""

    layout: _layout.Layout
    dtype: str
    acc: str
    target: str


@functools.cache
def _glue(lib: str) -> Any:
    return importlib.import_module(_GLUE_MODULES[lib], __package__)


@functools.cache
def _native(target: str) -> Any:
    return importlib.import_module(_NATIVE_MODULES[target], __package__)


def _namespace(lib: str, x: Any) -> Any:
    if lib == "numpy":
        return np
    if lib == "cupy":
        import cupy

        return cupy
    from array_api_compat import array_namespace

    return array_namespace(x)


def _target(lib: str, backend: str | None) -> str:
    check_backend_name(backend)
    native = {"numpy": "numba", "cupy": "cupy"}.get(lib)
    if backend is None:
        return native or "array_api"
    if backend == "array_api" or backend == native:
        return backend
    needs = {"numba": "a NumPy array", "cupy": "a CuPy array"}[backend]
    raise ValueError(f"backend={backend!r} needs {needs} as x, got a {lib} array")


_REQUESTS: dict[tuple[Any, ...], Request] = {}
_REQUESTS_MAX = 512


def _request(x: Any, lib: str, normalized_shape: Any, axis: Any, backend: str | None,
             **params: Any) -> Request:
    """Validated facts about one call, memoized on everything they depend on.

    A repeated call (same type, shape and dtype of every array, same axes and backend)
    skips the checks it passed before: for a one-row input these checks cost more than
    the kernel. Types lead the key so dtypes of different libraries are never compared.
    """
    try:
        key: tuple[Any, ...] | None = (
            type(x), x.dtype, tuple(x.shape), memo_axes(normalized_shape), memo_axes(axis),
            backend, lib,
            *((name, None) if p is None else (name, type(p), p.dtype, tuple(p.shape))
              for name, p in params.items()),
        )
        cached = _REQUESTS.get(key)
    except TypeError:  # axes of other types, or unhashable ones: no memo
        key, cached = None, None
    if cached is not None:
        return cached
    req = _validated_request(x, lib, normalized_shape, axis, backend, params)
    if key is not None:
        if len(_REQUESTS) >= _REQUESTS_MAX:
            _REQUESTS.clear()  # start over: the shapes seen now stay fast
        _REQUESTS[key] = req
    return req


def _validated_request(x: Any, lib: str, normalized_shape: Any, axis: Any,
                       backend: str | None, params: dict[str, Any]) -> Request:
    dtype = check_float_dtype(x, "x")
    shape = shape_of(x)
    axes = resolve_axes(shape, normalized_shape, axis)
    layout = _layout.plan(shape, axes)
    for name, param in params.items():
        if param is not None:
            check_param(param, name, layout.param_shape, shape)
    return Request(layout, dtype, accumulation_name(dtype), _target(lib, backend))


def _flat_param(xp: Any, param: Any, acc: str, target: str) -> Any:
    """``param`` as a contiguous 1-D array in the accumulation dtype.

    The Numba kernels widen float16/bfloat16 parameters where they load them (exactly,
    as a cast to float32 would), so there such a parameter keeps its dtype: NumPy's
    float16 cast takes 1.4 us for 768 elements, more than a (1, 768) row's kernel.
    """
    if param is None:
        return None
    dtype = acc
    if target == "numba" and acc == "float32" and dtype_name(param.dtype) in HALF_DTYPES:
        dtype = param.dtype
    if param.ndim == 1 and param.dtype == dtype and param.flags.c_contiguous:
        return param
    return xp.ascontiguousarray(param.reshape(-1)).astype(dtype, copy=False)


class _Output:
    """Where a native kernel writes: a canonical view of the result, or a temporary."""

    def __init__(self, xp: Any, x: Any, layout: _layout.Layout, out: Any) -> None:
        self.xp, self.layout, self.out = xp, layout, out
        self.view = None
        # An out that overlaps x without being x would overwrite rows not yet read:
        # compute into a temporary, then copy.
        if out is not None and (out is x or not xp.may_share_memory(out, x)):
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
        if self.buffer is None:
            return self.out
        value = self.buffer
        if self.layout.perm is not None:
            value = value.transpose(tuple(int(i) for i in np.argsort(self.layout.perm)))
        if self.out is not None:
            self.out[...] = value
            return self.out
        return self.xp.ascontiguousarray(value)


def _stats_for_kernel(xp: Any, stat: Any, req: Request) -> Any:
    return xp.ascontiguousarray(stat.reshape(-1)).astype(req.acc, copy=False)


# --------------------------------------------------------------------------- forward


def _forward(x: Any, lib: str, req: Request, weight: Any, bias: Any, eps: float, out: Any,
             rms: bool, want_stats: bool = True) -> tuple[Any, Any, Any]:
    """(y, mean or None, rstd) with stats in keepdims shape (None, None unless wanted)."""
    layout = req.layout
    if req.target == "array_api":
        if out is not None:
            raise TypeError(
                f"out= is supported for NumPy and CuPy arrays only, got a {lib} array "
                "(on the array_api backend)"
            )
        xp = _namespace(lib, x)
        bshape = layout.param_broadcast_shape
        if rms:
            y, rstd = _array_api.rms_norm(xp, x, layout.axes, bshape, weight, eps, req.acc)
            return y, None, rstd
        return _array_api.layer_norm(xp, x, layout.axes, bshape, weight, bias, eps, req.acc)

    xp = _namespace(lib, x)
    if out is not None:
        check_out(out, layout.shape, req.dtype)
    target = _Output(xp, x, layout, out)
    rows = layout.rows
    mean = None if rms else xp.empty(rows, dtype=req.acc)
    rstd = xp.empty(rows, dtype=req.acc)
    if layout.n == 0:
        if mean is not None:
            mean[...] = 0
        rstd[...] = np.nan
    elif rows > 0:
        be = _native(req.target)
        x3 = _layout.canonical(x, layout)
        w = _flat_param(xp, weight, req.acc, req.target)
        if rms:
            be.rms_norm_forward(x3, w, eps, target.view, rstd, req.dtype)
        else:
            b = _flat_param(xp, bias, req.acc, req.target)
            be.layer_norm_forward(x3, w, b, eps, target.view, mean, rstd, req.dtype)
    y = target.result()
    if not want_stats:
        return y, None, None
    stats = layout.stats_shape
    return y, (None if mean is None else mean.reshape(stats)), rstd.reshape(stats)


def layer_norm(
    x: Any,
    normalized_shape: int | tuple[int, ...] | None = None,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    *,
    axis: int | tuple[int, ...] | None = None,
    return_stats: bool = False,
    out: Any = None,
    backend: str | None = None,
) -> Any:
    """Layer normalization over the trailing ``normalized_shape`` or over ``axis``.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` where ``mean`` and the
    population variance ``var`` are taken over the normalized axes of each sample.

    Parameters
    ----------
    x : array
        Input of dtype float16, bfloat16, float32 or float64 (NumPy, CuPy, torch,
        Dask or any array-API array).
    normalized_shape : int or tuple of int, optional
        Trailing dimensions to normalize, as in :func:`torch.nn.functional.layer_norm`.
    weight, bias : array, optional
        Per-element affine parameters with the shape of the normalized axes; they
        broadcast over every other axis and are applied in the accumulation precision.
    eps : float, default 1e-5
        Added to the variance; a finite float >= 0.
    axis : int or tuple of int, optional
        Axes to normalize, anywhere in ``x`` (``axis=1`` normalizes the channels of an
        NCHW tensor). Mutually exclusive with ``normalized_shape``; the default is the
        last axis.
    return_stats : bool, default False
        Also return ``mean`` and ``rstd`` (shape of ``x`` with normalized axes kept as 1,
        float32 for 16/32-bit input, float64 for float64).
    out : array, optional
        Preallocated output of ``x``'s shape and dtype (NumPy and CuPy); may be ``x``.
    backend : {"numba", "cupy", "array_api"}, optional
        Force a backend instead of choosing it from the type of ``x``.

    Returns
    -------
    y : array
        Normalized array, same shape, dtype and library as ``x``; a new C-contiguous
        array unless ``out`` is given.
    mean, rstd : array
        Only with ``return_stats=True``.

    Examples
    --------
    >>> import numpy as np
    >>> import layernorm as ln
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]], dtype=np.float32)
    >>> ln.layer_norm(x).round(3)
    array([[-1.342, -0.447,  0.447,  1.342],
           [-1.342, -0.447,  0.447,  1.342]], dtype=float32)
    >>> y, mean, rstd = ln.layer_norm(x, return_stats=True)
    >>> mean.ravel()
    array([ 2.5, 25. ], dtype=float32)
    """
    if type(x) is np.ndarray and backend is None:
        result = _fast.layer_norm(x, normalized_shape, weight, bias, eps, axis, return_stats,
                                  out)
        if result is not None:
            return result
    lib = library_of(x)
    if lib in _GLUE_MODULES:
        return _glue(lib).layer_norm(
            x, normalized_shape, weight, bias, eps, axis=axis, return_stats=return_stats,
            out=out, backend=backend,
        )
    check_companions(x, lib, weight=weight, bias=bias, out=out)
    eps = check_eps(eps)
    req = _request(x, lib, normalized_shape, axis, backend, weight=weight, bias=bias)
    y, mean, rstd = _forward(x, lib, req, weight, bias, eps, out, rms=False,
                             want_stats=return_stats)
    return (y, mean, rstd) if return_stats else y


def rms_norm(
    x: Any,
    normalized_shape: int | tuple[int, ...] | None = None,
    weight: Any = None,
    eps: float | None = None,
    *,
    axis: int | tuple[int, ...] | None = None,
    return_stats: bool = False,
    out: Any = None,
    backend: str | None = None,
) -> Any:
    """Root-mean-square normalization: ``y = x / sqrt(mean(x**2) + eps) * weight``.

    Parameters
    ----------
    x : array
        Input of dtype float16, bfloat16, float32 or float64.
    normalized_shape : int or tuple of int, optional
        Trailing dimensions to normalize (PyTorch style).
    weight : array, optional
        Per-element scale with the shape of the normalized axes.
    eps : float, optional
        Added to the mean square. ``None`` (default) means the machine epsilon of the
        accumulation dtype, as :func:`torch.nn.functional.rms_norm` does.
    axis : int or tuple of int, optional
        Axes to normalize; exclusive with ``normalized_shape``; default the last axis.
    return_stats : bool, default False
        Also return ``rstd`` (keepdims shape, accumulation dtype).
    out : array, optional
        Preallocated output of ``x``'s shape and dtype (NumPy and CuPy); may be ``x``.
    backend : {"numba", "cupy", "array_api"}, optional
        Force a backend.

    Returns
    -------
    y : array
        Normalized array in the library, shape and dtype of ``x``.
    rstd : array
        Only with ``return_stats=True``.

    Examples
    --------
    >>> import numpy as np
    >>> import layernorm as ln
    >>> x = np.array([[3.0, 4.0]], dtype=np.float64)
    >>> ln.rms_norm(x, eps=0.0)
    array([[0.84852814, 1.13137085]])
    """
    if type(x) is np.ndarray and backend is None:
        result = _fast.rms_norm(x, normalized_shape, weight, eps, axis, return_stats, out)
        if result is not None:
            return result
    lib = library_of(x)
    if lib in _GLUE_MODULES:
        return _glue(lib).rms_norm(
            x, normalized_shape, weight, eps, axis=axis, return_stats=return_stats, out=out,
            backend=backend,
        )
    check_companions(x, lib, weight=weight, out=out)
    req = _request(x, lib, normalized_shape, axis, backend, weight=weight)
    eps = MACHINE_EPS[req.acc] if eps is None else check_eps(eps)
    y, _, rstd = _forward(x, lib, req, weight, None, eps, out, rms=True,
                          want_stats=return_stats)
    return (y, rstd) if return_stats else y


# --------------------------------------------------------------------------- backward


def _check_backward(grad_y: Any, x: Any, req: Request, **stats: Any) -> None:
    layout = req.layout
    check_same_shape(grad_y, "grad_y", layout.shape, "the shape of x")
    gdtype = check_float_dtype(grad_y, "grad_y")
    if gdtype != req.dtype:
        raise TypeError(f"grad_y must have the dtype of x ({req.dtype}), got dtype {gdtype}")
    for name, stat in stats.items():
        check_same_shape(stat, name, layout.stats_shape,
                         "x's shape with the normalized axes kept as 1")
        check_float_dtype(stat, name)


def _param_grad(grad: Any, layout: _layout.Layout, like: Any) -> Any:
    return grad.reshape(layout.param_shape).astype(like.dtype, copy=False)


def _backward(grad_y: Any, x: Any, lib: str, req: Request, mean: Any, rstd: Any,
              weight: Any, rms: bool) -> tuple[Any, ...]:
    layout = req.layout
    like = weight if weight is not None else x
    xp = _namespace(lib, x)
    if req.target == "array_api":
        bshape = layout.param_broadcast_shape
        if rms:
            gx, gw = _array_api.rms_norm_backward(
                xp, grad_y, x, rstd, weight, layout.axes, bshape, req.acc)
            return gx, xp.reshape(xp.astype(gw, like.dtype), layout.param_shape)
        gx, gw, gb = _array_api.layer_norm_backward(
            xp, grad_y, x, mean, rstd, weight, layout.axes, bshape, req.acc)
        return (gx, xp.reshape(xp.astype(gw, like.dtype), layout.param_shape),
                xp.reshape(xp.astype(gb, like.dtype), layout.param_shape))

    target = _Output(xp, x, layout, None)
    if layout.n == 0 or layout.rows == 0:
        gw = xp.zeros(layout.n, dtype=req.acc)
        gb = xp.zeros(layout.n, dtype=req.acc)
    else:
        be = _native(req.target)
        gy3 = _layout.canonical(grad_y, layout)
        x3 = _layout.canonical(x, layout)
        w = _flat_param(xp, weight, req.acc, req.target)
        r = _stats_for_kernel(xp, rstd, req)
        if rms:
            gw = be.rms_norm_backward(gy3, x3, r, w, target.view, req.dtype)
            gb = None
        else:
            m = _stats_for_kernel(xp, mean, req)
            gw, gb = be.layer_norm_backward(gy3, x3, m, r, w, target.view, req.dtype)
    gx = target.result()
    if rms:
        return gx, _param_grad(gw, layout, like)
    return gx, _param_grad(gw, layout, like), _param_grad(gb, layout, like)


def layer_norm_backward(
    grad_y: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any = None,
    normalized_shape: int | tuple[int, ...] | None = None,
    *,
    axis: int | tuple[int, ...] | None = None,
    backend: str | None = None,
) -> tuple[Any, Any, Any]:
    """Gradients of :func:`layer_norm` from the statistics of the forward pass.

    ``grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = grad_y * weight``
    and ``xhat = (x - mean) * rstd``, means taken over the normalized axes.

    Parameters
    ----------
    grad_y : array
        Gradient of the loss with respect to ``y``; shape and dtype of ``x``.
    x : array
        The forward input.
    mean, rstd : array
        Statistics returned by ``layer_norm(..., return_stats=True)``.
    weight : array, optional
        The forward ``weight``; ``None`` means a weight of ones.
    normalized_shape, axis : optional
        The normalized axes, exactly as given to the forward call.
    backend : {"numba", "cupy", "array_api"}, optional
        Force a backend.

    Returns
    -------
    grad_x : array
        Shape and dtype of ``x``.
    grad_weight, grad_bias : array
        Shape of the normalized axes, dtype of ``weight`` (of ``x`` when weight is None);
        bitwise reproducible for any thread count.

    Examples
    --------
    >>> import numpy as np
    >>> import layernorm as ln
    >>> x = np.array([[1.0, 3.0, 5.0, 7.0]])
    >>> y, mean, rstd = ln.layer_norm(x, return_stats=True, eps=0.0)
    >>> gx, gw, gb = ln.layer_norm_backward(np.ones_like(x), x, mean, rstd)
    >>> np.abs(gx).max() < 1e-12  # a constant upstream gradient does not move y
    np.True_
    >>> gb
    array([1., 1., 1., 1.])
    """
    lib = library_of(x)
    if lib in _GLUE_MODULES:
        return _glue(lib).layer_norm_backward(
            grad_y, x, mean, rstd, weight, normalized_shape, axis=axis, backend=backend)
    check_companions(x, lib, grad_y=grad_y, mean=mean, rstd=rstd, weight=weight)
    req = _request(x, lib, normalized_shape, axis, backend, weight=weight)
    _check_backward(grad_y, x, req, mean=mean, rstd=rstd)
    return _backward(grad_y, x, lib, req, mean, rstd, weight, rms=False)


def rms_norm_backward(
    grad_y: Any,
    x: Any,
    rstd: Any,
    weight: Any = None,
    normalized_shape: int | tuple[int, ...] | None = None,
    *,
    axis: int | tuple[int, ...] | None = None,
    backend: str | None = None,
) -> tuple[Any, Any]:
    """Gradients of :func:`rms_norm` from the forward pass's ``rstd``.

    ``grad_x = rstd * (g - xhat * mean(g * xhat))`` with ``g = grad_y * weight`` and
    ``xhat = x * rstd``.

    Parameters
    ----------
    grad_y : array
        Gradient with respect to ``y``; shape and dtype of ``x``.
    x : array
        The forward input.
    rstd : array
        Returned by ``rms_norm(..., return_stats=True)``.
    weight : array, optional
        The forward ``weight``; ``None`` means ones.
    normalized_shape, axis : optional
        The normalized axes, as given to the forward call.
    backend : {"numba", "cupy", "array_api"}, optional
        Force a backend.

    Returns
    -------
    grad_x : array
        Shape and dtype of ``x``.
    grad_weight : array
        Shape of the normalized axes, dtype of ``weight`` (of ``x`` if None).

    Examples
    --------
    >>> import numpy as np
    >>> import layernorm as ln
    >>> x = np.array([[3.0, 4.0]])
    >>> y, rstd = ln.rms_norm(x, return_stats=True, eps=0.0)
    >>> gx, gw = ln.rms_norm_backward(np.ones_like(x), x, rstd)
    >>> gw.shape
    (2,)
    """
    lib = library_of(x)
    if lib in _GLUE_MODULES:
        return _glue(lib).rms_norm_backward(
            grad_y, x, rstd, weight, normalized_shape, axis=axis, backend=backend)
    check_companions(x, lib, grad_y=grad_y, rstd=rstd, weight=weight)
    req = _request(x, lib, normalized_shape, axis, backend, weight=weight)
    _check_backward(grad_y, x, req, rstd=rstd)
    return _backward(grad_y, x, lib, req, None, rstd, weight, rms=True)
