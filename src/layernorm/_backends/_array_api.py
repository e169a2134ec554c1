"""Generic LayerNorm/RMSNorm written only with the input's own array-API namespace.

Used for every array that has no native kernels (JAX, array_api_strict, torch on
devices other than CPU/CUDA, ...), and as an independent second implementation that
the tests compare the kernels against. Works under ``jax.jit`` and ``jax.grad``: no
data-dependent Python control flow, no in-place updates.
"""

from __future__ import annotations

from typing import Any


def _acc(xp: Any, acc_name: str) -> Any:
    return xp.float64 if acc_name == "float64" else xp.float32


def _param(xp: Any, param: Any, shape: tuple[int, ...], acc: Any) -> Any:
    return xp.reshape(xp.astype(param, acc), shape)


def layer_norm(
    xp: Any, x: Any, axes: tuple[int, ...], bshape: tuple[int, ...], weight: Any, bias: Any,
    eps: float, acc_name: str,
) -> tuple[Any, Any, Any]:
    """LayerNorm over ``axes``; returns ``(y, mean, rstd)`` (stats keep dims)."""
    acc = _acc(xp, acc_name)
    xa = xp.astype(x, acc)
    mean = xp.mean(xa, axis=axes, keepdims=True)
    centred = xa - mean
    var = xp.mean(centred * centred, axis=axes, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + eps)
    y = centred * rstd
    if weight is not None:
        y = y * _param(xp, weight, bshape, acc)
    if bias is not None:
        y = y + _param(xp, bias, bshape, acc)
    return xp.astype(y, x.dtype), mean, rstd


def rms_norm(
    xp: Any, x: Any, axes: tuple[int, ...], bshape: tuple[int, ...], weight: Any, eps: float,
    acc_name: str,
) -> tuple[Any, Any]:
    """RMSNorm over ``axes``; returns ``(y, rstd)``."""
    acc = _acc(xp, acc_name)
    xa = xp.astype(x, acc)
    rstd = 1.0 / xp.sqrt(xp.mean(xa * xa, axis=axes, keepdims=True) + eps)
    y = xa * rstd
    if weight is not None:
        y = y * _param(xp, weight, bshape, acc)
    return xp.astype(y, x.dtype), rstd


def _other_axes(ndim: int, axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i not in axes)


def layer_norm_backward(
    xp: Any, grad_y: Any, x: Any, mean: Any, rstd: Any, weight: Any, axes: tuple[int, ...],
    bshape: tuple[int, ...], acc_name: str,
) -> tuple[Any, Any, Any]:
    """``(grad_x, grad_weight, grad_bias)``; parameter grads in the accumulation dtype."""
    acc = _acc(xp, acc_name)
    dy = xp.astype(grad_y, acc)
    xhat = (xp.astype(x, acc) - xp.astype(mean, acc)) * xp.astype(rstd, acc)
    g = dy * _param(xp, weight, bshape, acc) if weight is not None else dy
    mean_g = xp.mean(g, axis=axes, keepdims=True)
    mean_gx = xp.mean(g * xhat, axis=axes, keepdims=True)
    grad_x = ((g - mean_g) - xhat * mean_gx) * xp.astype(rstd, acc)
    other = _other_axes(x.ndim, axes)
    grad_w = xp.sum(dy * xhat, axis=other)
    grad_b = xp.sum(dy, axis=other)
    return xp.astype(grad_x, x.dtype), grad_w, grad_b


def rms_norm_backward(
    xp: Any, grad_y: Any, x: Any, rstd: Any, weight: Any, axes: tuple[int, ...],
    bshape: tuple[int, ...], acc_name: str,
) -> tuple[Any, Any]:
    """``(grad_x, grad_weight)``; the parameter grad in the accumulation dtype."""
    acc = _acc(xp, acc_name)
    dy = xp.astype(grad_y, acc)
    r = xp.astype(rstd, acc)
    xhat = xp.astype(x, acc) * r
    g = dy * _param(xp, weight, bshape, acc) if weight is not None else dy
    mean_gx = xp.mean(g * xhat, axis=axes, keepdims=True)
    grad_x = (g - xhat * mean_gx) * r
    grad_w = xp.sum(dy * xhat, axis=_other_axes(x.ndim, axes))
    return xp.astype(grad_x, x.dtype), grad_w
