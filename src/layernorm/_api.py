"""The public functions: docstrings, then hand off.

Each function asks the router (:func:`._dispatch.route`) where the call runs, hands
torch tensors and Dask arrays to their adapters (:mod:`._adapters`), and everything
else to the engine (:mod:`._engine`), which checks every argument and runs the native
kernels or the generic array-API implementation. Repeated small NumPy forward calls
take the short path (:mod:`._fast`) first.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import numpy as np

from . import _engine, _fast
from ._dispatch import route

_ADAPTERS = {"torch": "._adapters.torch", "dask": "._adapters.dask"}


@functools.cache
def _adapter(library: str) -> Any:
    return importlib.import_module(_ADAPTERS[library], __package__)


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
    where = route(x, backend)
    if where.library == "torch":
        return _adapter("torch").layer_norm(
            x, where, normalized_shape, weight, bias, eps, axis=axis,
            return_stats=return_stats, out=out)
    if where.library == "dask":
        return _adapter("dask").layer_norm(
            x, where, normalized_shape, weight, bias, eps, axis=axis,
            return_stats=return_stats, out=out, backend=backend)
    y, mean, rstd = _engine.normalize(x, where, normalized_shape, weight, bias, eps, axis, out,
                                      rms=False, want_stats=return_stats)
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
    where = route(x, backend)
    if where.library == "torch":
        return _adapter("torch").rms_norm(
            x, where, normalized_shape, weight, eps, axis=axis, return_stats=return_stats,
            out=out)
    if where.library == "dask":
        return _adapter("dask").rms_norm(
            x, where, normalized_shape, weight, eps, axis=axis, return_stats=return_stats,
            out=out, backend=backend)
    y, _, rstd = _engine.normalize(x, where, normalized_shape, weight, None, eps, axis, out,
                                   rms=True, want_stats=return_stats)
    return (y, rstd) if return_stats else y


# --------------------------------------------------------------------------- backward


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
    where = route(x, backend)
    if where.library == "torch":
        return _adapter("torch").layer_norm_backward(
            grad_y, x, where, mean, rstd, weight, normalized_shape, axis=axis)
    if where.library == "dask":
        return _adapter("dask").layer_norm_backward(
            grad_y, x, where, mean, rstd, weight, normalized_shape, axis=axis, backend=backend)
    return _engine.gradients(grad_y, x, where, mean, rstd, weight, normalized_shape, axis,
                             rms=False)


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
    where = route(x, backend)
    if where.library == "torch":
        return _adapter("torch").rms_norm_backward(
            grad_y, x, where, rstd, weight, normalized_shape, axis=axis)
    if where.library == "dask":
        return _adapter("dask").rms_norm_backward(
            grad_y, x, where, rstd, weight, normalized_shape, axis=axis, backend=backend)
    return _engine.gradients(grad_y, x, where, None, rstd, weight, normalized_shape, axis,
                             rms=True)
