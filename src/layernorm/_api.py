"""The public functions: docstrings, then hand off.

Each function asks the router (:func:`._dispatch.route`) where the call runs, hands
torch tensors and Dask arrays to their adapters (:mod:`._adapters`), and everything
else to the engine (:mod:`._engine`), which checks every argument and runs the native
kernels or the generic array-API implementation. Repeated NumPy calls take the short
path first (:mod:`._fast` forward, :mod:`._fast_add` the fused residual add,
:mod:`._fast_backward` backward).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from . import _engine, _fast, _fast_add, _fast_backward
from ._dispatch import route

_ADAPTERS = {"torch": "._adapters.torch", "dask": "._adapters.dask"}

#: The default ``weight_offset``: an identity test on it is the fast path's cheapest check.
_NO_OFFSET = 0.0


def _no_offset(weight_offset: Any) -> bool:
    """Whether ``weight_offset`` adds nothing: the default, or any float zero (the gain is
    then the weight itself, see :func:`._engine.gain`), as the layer classes pass it."""
    return weight_offset is _NO_OFFSET or (type(weight_offset) is float
                                           and weight_offset == 0.0)
#: Types of the torch tensors whose forward calls try the torch adapter's short path
#: (filled when that adapter is first imported: no torch import here).
_TORCH_TENSORS: set[type] = set()


#: The adapters imported so far, by library.
_LOADED: dict[str, Any] = {}


def _adapter(library: str) -> Any:
    # A dict, not functools.cache: torch.compile traces this function, and warns about
    # cache wrappers (whose cache it ignores).
    module = _LOADED.get(library)
    if module is None:
        module = _LOADED[library] = importlib.import_module(_ADAPTERS[library], __package__)
        _TORCH_TENSORS.update(getattr(module, "SHORT_PATH_TYPES", ()))
    return module


def layer_norm(
    x: Any,
    normalized_shape: int | tuple[int, ...] | None = None,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    *,
    axis: int | tuple[int, ...] | None = None,
    weight_offset: float = _NO_OFFSET,
    quantize: str | None = None,
    scale: Any = None,
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
    weight_offset : float, default 0.0
        The gain applied is ``weight + weight_offset``, formed in the accumulation
        precision (Gemma-style zero-centred weights use 1.0); nonzero needs a ``weight``.
    quantize : {None, "int8", "float8_e4m3fn", "float8_e5m2"}, optional
        Return ``y`` quantized to that dtype with a per-row (or static) ``scale``.
    scale : float or array, optional
        With ``quantize``: a static positive scale broadcastable to the statistics'
        shape; None (default) computes ``amax_row(|y|) / qmax`` per row.
    return_stats : bool, default False
        Also return ``mean`` and ``rstd`` (shape of ``x`` with normalized axes kept as 1,
        float32 for 16/32-bit input, float64 for float64).
    out : array, optional
        Preallocated output of ``x``'s shape and dtype (the quantized dtype with
        ``quantize``; NumPy and CuPy); may be ``x``.
    backend : {"numba", "cupy", "array_api"}, optional
        Force a backend instead of choosing it from the type of ``x``.

    Returns
    -------
    y : array
        Normalized array, same shape, dtype and library as ``x``; a new C-contiguous
        array unless ``out`` is given.
    scale : array
        Only with ``quantize``: the dynamic per-row scale (keepdims shape, statistics
        dtype), or the static ``scale`` as passed.
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
        w = weight if weight_offset is _NO_OFFSET else _fast.offset_weight(x, weight,
                                                                             weight_offset)
        # (a scale without quantize= is the general path's error)
        if w is not _fast.GENERAL and (quantize is not None or scale is None):
            result = (_fast.layer_norm(x, normalized_shape, w, bias, eps, axis, return_stats,
                                       out) if quantize is None else
                      _fast.quantized(x, normalized_shape, w, bias, eps, axis, return_stats,
                                      out, quantize, scale, False))
            if result is not None:
                return result
    elif (type(x) in _TORCH_TENSORS and backend is None and out is None and quantize is None
            and scale is None and weight_offset is not None):
        # (weight_offset=None is the general path's TypeError: the short path's None is
        # "no offset")
        result = _adapter("torch").short_layer_norm(
            x, normalized_shape, weight, bias, eps, axis, return_stats,
            None if _no_offset(weight_offset) else weight_offset)
        if result is not None:
            return result
    where = route(x, backend)
    extras = {"weight_offset": weight_offset, "quantize": quantize, "scale": scale}
    if where.library == "torch":
        return _adapter("torch").layer_norm(
            x, where, normalized_shape, weight, bias, eps, axis=axis,
            return_stats=return_stats, out=out, **extras)
    if where.library == "dask":
        return _adapter("dask").layer_norm(
            x, where, normalized_shape, weight, bias, eps, axis=axis,
            return_stats=return_stats, out=out, backend=backend, **extras)
    y, s, mean, rstd = _engine.normalize_ex(x, where, normalized_shape, weight, bias, eps, axis,
                                            out, False, return_stats, **extras)
    return _engine.results(y, None, s, mean, rstd, quantize, return_stats, rms=False,
                           add=False)


def rms_norm(
    x: Any,
    normalized_shape: int | tuple[int, ...] | None = None,
    weight: Any = None,
    eps: float | None = None,
    *,
    axis: int | tuple[int, ...] | None = None,
    weight_offset: float = _NO_OFFSET,
    quantize: str | None = None,
    scale: Any = None,
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
    weight_offset : float, default 0.0
        The gain is ``weight + weight_offset`` in the accumulation precision.
    quantize : {None, "int8", "float8_e4m3fn", "float8_e5m2"}, optional
        Return ``y`` quantized, with its ``scale`` (see :func:`layer_norm`).
    scale : float or array, optional
        Static scale for ``quantize``; None means per-row ``amax / qmax``.
    return_stats : bool, default False
        Also return ``rstd`` (keepdims shape, accumulation dtype).
    out : array, optional
        Preallocated output of ``x``'s shape and dtype (the quantized dtype with
        ``quantize``; NumPy and CuPy); may be ``x``.
    backend : {"numba", "cupy", "array_api"}, optional
        Force a backend.

    Returns
    -------
    y : array
        Normalized array in the library, shape and dtype of ``x``.
    scale : array
        Only with ``quantize``.
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
        w = weight if weight_offset is _NO_OFFSET else _fast.offset_weight(x, weight,
                                                                             weight_offset)
        if w is not _fast.GENERAL and (quantize is not None or scale is None):
            result = (_fast.rms_norm(x, normalized_shape, w, eps, axis, return_stats, out)
                      if quantize is None else
                      _fast.quantized(x, normalized_shape, w, None, eps, axis, return_stats,
                                      out, quantize, scale, True))
            if result is not None:
                return result
    elif (type(x) in _TORCH_TENSORS and backend is None and out is None and quantize is None
            and scale is None and weight_offset is not None):  # as layer_norm
        result = _adapter("torch").short_rms_norm(
            x, normalized_shape, weight, eps, axis, return_stats,
            None if _no_offset(weight_offset) else weight_offset)
        if result is not None:
            return result
    where = route(x, backend)
    extras = {"weight_offset": weight_offset, "quantize": quantize, "scale": scale}
    if where.library == "torch":
        return _adapter("torch").rms_norm(
            x, where, normalized_shape, weight, eps, axis=axis, return_stats=return_stats,
            out=out, **extras)
    if where.library == "dask":
        return _adapter("dask").rms_norm(
            x, where, normalized_shape, weight, eps, axis=axis, return_stats=return_stats,
            out=out, backend=backend, **extras)
    y, s, _, rstd = _engine.normalize_ex(x, where, normalized_shape, weight, None, eps, axis,
                                         out, True, return_stats, **extras)
    return _engine.results(y, None, s, None, rstd, quantize, return_stats, rms=True,
                           add=False)


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
    weight_offset: float = _NO_OFFSET,
    grad_residual: Any = None,
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
    weight_offset : float, default 0.0
        As given to the forward call; ``grad_weight`` is still with respect to ``weight``.
    grad_residual : array, optional
        Gradient reaching the normalized input from elsewhere (the residual stream of
        :func:`add_layer_norm`), of x's shape and dtype: ``grad_x + grad_residual`` is
        returned, added in the accumulation precision and rounded once.
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
    if (type(x) is np.ndarray and backend is None
            and _no_offset(weight_offset)):
        grads = _fast_backward.gradients(grad_y, x, mean, rstd, weight, normalized_shape, axis,
                                         grad_residual, False)
        if grads is not None:
            return grads
    where = route(x, backend)
    extras = {"weight_offset": weight_offset, "grad_residual": grad_residual}
    if where.library == "torch":
        return _adapter("torch").layer_norm_backward(
            grad_y, x, where, mean, rstd, weight, normalized_shape, axis=axis, **extras)
    if where.library == "dask":
        return _adapter("dask").layer_norm_backward(
            grad_y, x, where, mean, rstd, weight, normalized_shape, axis=axis, backend=backend,
            **extras)
    return _engine.gradients(grad_y, x, where, mean, rstd, weight, normalized_shape, axis,
                             False, **extras)


def rms_norm_backward(
    grad_y: Any,
    x: Any,
    rstd: Any,
    weight: Any = None,
    normalized_shape: int | tuple[int, ...] | None = None,
    *,
    axis: int | tuple[int, ...] | None = None,
    weight_offset: float = _NO_OFFSET,
    grad_residual: Any = None,
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
    weight_offset : float, default 0.0
        As given to the forward call; ``grad_weight`` is with respect to ``weight``.
    grad_residual : array, optional
        Gradient reaching the normalized input from elsewhere, of x's shape and dtype;
        ``grad_x + grad_residual`` is returned (see :func:`layer_norm_backward`).
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
    if (type(x) is np.ndarray and backend is None
            and _no_offset(weight_offset)):
        grads = _fast_backward.gradients(grad_y, x, None, rstd, weight, normalized_shape, axis,
                                         grad_residual, True)
        if grads is not None:
            return grads
    where = route(x, backend)
    extras = {"weight_offset": weight_offset, "grad_residual": grad_residual}
    if where.library == "torch":
        return _adapter("torch").rms_norm_backward(
            grad_y, x, where, rstd, weight, normalized_shape, axis=axis, **extras)
    if where.library == "dask":
        return _adapter("dask").rms_norm_backward(
            grad_y, x, where, rstd, weight, normalized_shape, axis=axis, backend=backend,
            **extras)
    return _engine.gradients(grad_y, x, where, None, rstd, weight, normalized_shape, axis,
                             True, **extras)


# --------------------------------------------------------------------------- fusions


def _add_norm(x: Any, residual: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any,
              axis: Any, weight_offset: Any, residual_dtype: Any, quantize: Any, scale: Any,
              return_stats: bool, out: Any, residual_out: Any, backend: str | None, *,
              rms: bool) -> Any:
    """The hand-off shared by :func:`add_layer_norm` and :func:`add_rms_norm`."""
    if type(x) is np.ndarray and backend is None:
        w = weight if weight_offset is _NO_OFFSET else _fast.offset_weight(x, weight,
                                                                             weight_offset)
        if w is not _fast.GENERAL and (quantize is not None or scale is None):
            result = (_fast_add.add_norm(x, residual, normalized_shape, w, bias, eps, axis,
                                         residual_dtype, return_stats, out, residual_out, rms)
                      if quantize is None else
                      _fast_add.add_norm_quantized(x, residual, normalized_shape, w, bias,
                                                   eps, axis, residual_dtype, quantize, scale,
                                                   return_stats, out, residual_out, rms))
            if result is not None:
                return result
    elif (type(x) in _TORCH_TENSORS and backend is None and out is None
            and residual_out is None and quantize is None and scale is None
            and residual_dtype is None and weight_offset is not None):  # as layer_norm
        result = _adapter("torch").short_add_norm(
            x, residual, normalized_shape, weight, bias, eps, axis,
            None if _no_offset(weight_offset) else weight_offset, return_stats, rms)
        if result is not None:
            return result
    where = route(x, backend)
    extras = {"weight_offset": weight_offset, "residual_dtype": residual_dtype,
              "quantize": quantize, "scale": scale, "return_stats": return_stats, "out": out,
              "residual_out": residual_out}
    if where.library == "torch":
        return _adapter("torch").add_norm(x, residual, where, normalized_shape, weight, bias,
                                          eps, axis=axis, rms=rms, **extras)
    if where.library == "dask":
        return _adapter("dask").add_norm(x, residual, where, normalized_shape, weight, bias,
                                         eps, axis=axis, rms=rms, backend=backend, **extras)
    y, h, s, mean, rstd = _engine.add_normalize(
        x, residual, where, normalized_shape, weight, bias, eps, axis, rms, return_stats,
        weight_offset, residual_dtype, quantize, scale, out, residual_out)
    return _engine.results(y, h, s, mean, rstd, quantize, return_stats, rms=rms, add=True)


def add_layer_norm(
    x: Any,
    residual: Any,
    normalized_shape: int | tuple[int, ...] | None = None,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    *,
    axis: int | tuple[int, ...] | None = None,
    weight_offset: float = 0.0,
    residual_dtype: Any = None,
    quantize: str | None = None,
    scale: Any = None,
    return_stats: bool = False,
    out: Any = None,
    residual_out: Any = None,
    backend: str | None = None,
) -> Any:
    """Residual add then LayerNorm, the pre-norm transformer block's ``h = x + residual;
    y = layer_norm(h)``.

    ``h`` is ``x + residual`` computed in float64 if any of ``x``, ``residual`` and
    ``residual_dtype`` is float64 (else float32) and rounded once to ``residual_dtype``.
    ``y`` is bit for bit ``layer_norm(h, ...)`` with the same arguments, cast to x's
    dtype. NumPy arrays and CPU torch tensors of one accumulation dtype, rows of unit
    stride, take one kernel that adds, stores ``h`` and normalizes it block of rows by
    block of rows (x and the residual are read once); other calls are composed from
    the kernels of :func:`layer_norm`, with the same bits.

    Parameters
    ----------
    x : array
        The branch output (float16, bfloat16, float32 or float64).
    residual : array
        The residual stream: x's shape and library, any supported float dtype.
    normalized_shape, weight, bias, eps, axis
        As for :func:`layer_norm`.
    weight_offset : float, default 0.0
        The gain is ``weight + weight_offset`` in the accumulation precision.
    residual_dtype : dtype or str, optional
        Dtype of ``h``; default ``residual.dtype``.
    quantize : {None, "int8", "float8_e4m3fn", "float8_e5m2"}, optional
        Return ``y`` quantized (from the unrounded normalized ``h``), with its scale.
    scale : float or array, optional
        Static scale for ``quantize``; None means per-row ``amax / qmax``.
    return_stats : bool, default False
        Also return ``mean`` and ``rstd`` of ``h``.
    out : array, optional
        Receives ``y`` (x's shape; x's dtype, or the quantized one); may be ``x`` or
        ``residual``.
    residual_out : array, optional
        Receives ``h`` (x's shape, h's dtype); may be ``x`` or ``residual``.
    backend : {"numba", "cupy", "array_api"}, optional
        Force a backend.

    Returns
    -------
    y : array
        The normalized ``h`` in x's dtype (or quantized).
    h : array
        The new residual stream.
    scale : array
        Only with ``quantize``.
    mean, rstd : array
        Only with ``return_stats=True``; statistics of ``h``.

    Examples
    --------
    >>> import numpy as np
    >>> import layernorm as ln
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    >>> residual = np.array([[1.0, 0.0, 1.0, 0.0]], dtype=np.float32)
    >>> y, h = ln.add_layer_norm(x, residual)
    >>> h
    array([[2., 2., 4., 4.]], dtype=float32)
    >>> bool((y == ln.layer_norm(h)).all())
    True
    """
    return _add_norm(x, residual, normalized_shape, weight, bias, eps, axis, weight_offset,
                     residual_dtype, quantize, scale, return_stats, out, residual_out, backend,
                     rms=False)


def add_rms_norm(
    x: Any,
    residual: Any,
    normalized_shape: int | tuple[int, ...] | None = None,
    weight: Any = None,
    eps: float | None = None,
    *,
    axis: int | tuple[int, ...] | None = None,
    weight_offset: float = 0.0,
    residual_dtype: Any = None,
    quantize: str | None = None,
    scale: Any = None,
    return_stats: bool = False,
    out: Any = None,
    residual_out: Any = None,
    backend: str | None = None,
) -> Any:
    """Residual add then RMSNorm: ``h = x + residual; y = rms_norm(h)``.

    Exactly as :func:`add_layer_norm`, with :func:`rms_norm` (no ``bias``; ``eps=None``
    is the accumulation dtype's machine epsilon).

    Parameters
    ----------
    x : array
        The branch output (float16, bfloat16, float32 or float64).
    residual : array
        The residual stream: x's shape and library, any supported float dtype.
    normalized_shape, weight, eps, axis
        As for :func:`rms_norm`.
    weight_offset : float, default 0.0
        The gain is ``weight + weight_offset`` in the accumulation precision.
    residual_dtype : dtype or str, optional
        Dtype of ``h``; default ``residual.dtype``.
    quantize : {None, "int8", "float8_e4m3fn", "float8_e5m2"}, optional
        Return ``y`` quantized, with its scale.
    scale : float or array, optional
        Static scale for ``quantize``; None means per-row ``amax / qmax``.
    return_stats : bool, default False
        Also return ``rstd`` of ``h``.
    out, residual_out : array, optional
        Receive ``y`` and ``h``; either may be ``x`` or ``residual``.
    backend : {"numba", "cupy", "array_api"}, optional
        Force a backend.

    Returns
    -------
    y : array
        The normalized ``h`` in x's dtype (or quantized).
    h : array
        The new residual stream.
    scale : array
        Only with ``quantize``.
    rstd : array
        Only with ``return_stats=True``.

    Examples
    --------
    >>> import numpy as np
    >>> import layernorm as ln
    >>> x = np.array([[1.0, 2.0]], dtype=np.float64)
    >>> y, h = ln.add_rms_norm(x, np.array([[2.0, 2.0]]), eps=0.0)
    >>> y
    array([[0.84852814, 1.13137085]])
    """
    return _add_norm(x, residual, normalized_shape, weight, None, eps, axis, weight_offset,
                     residual_dtype, quantize, scale, return_stats, out, residual_out, backend,
                     rms=True)
