"""Float64 NumPy truth for LayerNorm and RMSNorm, written from the formulas alone.

Independent of the library: two-pass mean/variance in float64 (or longdouble for
float64 inputs), so the library's kernels can be checked against it.
"""

from __future__ import annotations

import numpy as np


def _wide(a: np.ndarray, like: np.dtype) -> np.ndarray:
    wide = np.longdouble if np.dtype(like) == np.float64 else np.float64
    return np.asarray(a).astype(np.float64).astype(wide)


def layer_norm(x, axes, weight=None, bias=None, eps=1e-5):
    """Return ``(y, mean, rstd)`` in high precision (keepdims stats)."""
    xw = _wide(x, x.dtype)
    mean = xw.mean(axis=axes, keepdims=True)
    var = ((xw - mean) ** 2).mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    y = (xw - mean) * rstd
    bshape = tuple(s if i in axes else 1 for i, s in enumerate(x.shape))
    if weight is not None:
        y = y * _wide(weight, x.dtype).reshape(bshape)
    if bias is not None:
        y = y + _wide(bias, x.dtype).reshape(bshape)
    return y, mean, rstd


def rms_norm(x, axes, weight=None, eps=None):
    """Return ``(y, rstd)`` in high precision."""
    if eps is None:
        eps = float(np.finfo(np.float64 if x.dtype == np.float64 else np.float32).eps)
    xw = _wide(x, x.dtype)
    rstd = 1.0 / np.sqrt((xw * xw).mean(axis=axes, keepdims=True) + eps)
    y = xw * rstd
    if weight is not None:
        bshape = tuple(s if i in axes else 1 for i, s in enumerate(x.shape))
        y = y * _wide(weight, x.dtype).reshape(bshape)
    return y, rstd


def layer_norm_backward(grad_y, x, axes, weight=None, eps=1e-5, mean=None, rstd=None):
    """Exact gradients ``(grad_x, grad_weight, grad_bias)``: from exact statistics, or,
    given ``mean`` and ``rstd`` (keepdims shape), from those, as the backward is defined.

    ``grad_x`` is ill-conditioned where the variance is not much larger than ``eps`` and
    the row is far from zero (the part of it that survives is ``eps / (var + eps)`` of
    its terms): there the float32 statistics a forward returns (the mean rounded to a
    float32 near 50, say) move it by far more than the backward's own arithmetic does,
    so tests of the backward's arithmetic on such inputs pass the statistics it gets.
    """
    xw = _wide(x, x.dtype)
    gy = _wide(grad_y, x.dtype)
    if mean is None or rstd is None:
        mean = xw.mean(axis=axes, keepdims=True)
        rstd = 1.0 / np.sqrt(((xw - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
    else:
        mean, rstd = _wide(mean, x.dtype), _wide(rstd, x.dtype)
    xhat = (xw - mean) * rstd
    bshape = tuple(s if i in axes else 1 for i, s in enumerate(x.shape))
    g = gy * _wide(weight, x.dtype).reshape(bshape) if weight is not None else gy
    gx = rstd * (g - g.mean(axis=axes, keepdims=True)
                 - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    other = tuple(i for i in range(x.ndim) if i not in axes)
    pshape = tuple(x.shape[a] for a in axes)
    return gx, (gy * xhat).sum(axis=other).reshape(pshape), gy.sum(axis=other).reshape(pshape)


def rms_norm_backward(grad_y, x, axes, weight=None, eps=None):
    """Exact gradients ``(grad_x, grad_weight)``."""
    if eps is None:
        eps = float(np.finfo(np.float64 if x.dtype == np.float64 else np.float32).eps)
    xw = _wide(x, x.dtype)
    gy = _wide(grad_y, x.dtype)
    rstd = 1.0 / np.sqrt((xw * xw).mean(axis=axes, keepdims=True) + eps)
    xhat = xw * rstd
    bshape = tuple(s if i in axes else 1 for i, s in enumerate(x.shape))
    g = gy * _wide(weight, x.dtype).reshape(bshape) if weight is not None else gy
    gx = rstd * (g - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    other = tuple(i for i in range(x.ndim) if i not in axes)
    pshape = tuple(x.shape[a] for a in axes)
    return gx, (gy * xhat).sum(axis=other).reshape(pshape)
