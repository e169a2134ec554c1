"""Generic LayerNorm/RMSNorm written only with the input's own array-API namespace.

Used for every array that has no native kernels (JAX, array_api_strict, torch on
devices other than CPU/CUDA, ...), and as an independent second implementation that
the tests compare the kernels against. Works under ``jax.jit`` and ``jax.grad``: no
data-dependent Python control flow, no in-place updates.

Two guards keep it as accurate as the native kernels:

* **Offset rows.** The statistics are taken of ``x - shift`` with ``shift`` each row's
  first element: for rows like ``1e4 + N(0, 1)`` in float32 the differences are exact
  and small, so neither the mean nor ``x - mean`` loses the digits a float32 mean of
  1e4 cannot hold (1.0e-3 error without the shift, ~6e-7 with it).
* **Overflowing and underflowing rows.** A finite row whose squares would overflow the
  accumulation dtype is scaled by a power of two (exact) before its statistics, and
  before the shift is subtracted (the difference of two huge values may itself
  overflow; the spread that picks the scale is measured on halves); the normalized row
  is scale invariant, so ``y`` is the same as with infinite range. With an ``eps``
  too small to hide them (below ``2**-100``; float64: ``2**-980``), rows whose
  deviations are so small that their squares would be subnormal or vanish are scaled
  up likewise (``eps`` scaled with them, the scale capped so that it stays finite).
  Other rows are multiplied by 1, which changes no bit.
* **Subnormal eps.** XLA (JAX on CPU) flushes subnormal numbers to zero, an ``eps``
  below the dtype's smallest normal among them: a constant row's ``rstd`` would be
  infinite and its ``y`` NaN. Such an eps is carried times ``2**64`` (exact) and never
  stands alone in an array; the rows whose variance is that small are normalized in
  units lifted likewise (:func:`_inverse_sqrt`). With IEEE arithmetic (NumPy,
  array_api_strict) the values are those of the plain formula, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._dtypes import array_library, bit_view
from .._layout import c_contiguous


def _acc(xp: Any, acc_name: str) -> Any:
    return xp.float64 if acc_name == "float64" else xp.float32


def _param(xp: Any, param: Any, shape: tuple[int, ...], acc: Any) -> Any:
    return xp.reshape(xp.astype(param, acc), shape)


#: Rows whose largest magnitude reaches this are rescaled: squares of such values summed
#: over up to 2**47 (float32) or 2**500 (float64) elements stay finite.
_RESCALE_FROM = {"float32": 2.0**40, "float64": 2.0**250}

#: With an ``eps`` below ``_TINY_EPS``, rows whose largest magnitude is below
#: ``_TINY_BELOW`` (and not 0) are scaled up: smaller squares may be subnormal, off by
#: up to 2**-149 (float64: 2**-1074) each, which an eps this small does not hide.
_TINY_BELOW = {"float32": 2.0**-40, "float64": 2.0**-250}
_TINY_EPS = {"float32": 2.0**-100, "float64": 2.0**-980}
#: A scaled-up row's scale keeps ``eps * scale**2`` below ``2**_SCALED_EPS_EXPONENT``.
_SCALED_EPS_EXPONENT = {"float32": 100, "float64": 1000}

#: Exponent of the smallest normal number: a smaller scale would be subnormal, which
#: XLA (JAX) flushes to zero. Rows in the top binade are then brought to [2, 4).
_MIN_EXPONENT = {"float32": -126.0, "float64": -1022.0}
#: Exponent of the largest power of two of the dtype (a scale for a tiny row).
_MAX_EXPONENT = {"float32": 127.0, "float64": 1023.0}


#: The smallest normal number of each accumulation dtype (a smaller positive eps is
#: subnormal: see :func:`_inverse_sqrt`).
_SMALLEST_NORMAL = {"float32": 2.0**-126, "float64": 2.0**-1022}
#: A subnormal eps is carried times ``2**_EPS_LIFT``; rows whose variance is below
#: ``2**-_SMALL_VAR`` are normalized in units lifted by it.
_EPS_LIFT = 64
_SMALL_VAR = 60


#: Per accumulation dtype: the exponent of its smallest subnormal (``2**-149``,
#: ``2**-1074``), its mantissa bits and the integer type of its bits.
_SUBNORMAL = {"float32": (149, 23, "int32"), "float64": (1074, 52, "int64")}


def _flushes(arr: Any) -> bool:
    """Whether ``arr``'s library flushes subnormal numbers to zero, in results and when
    it reads them (XLA: JAX)."""
    return array_library(arr) == "jax"


def _times_scale(xp: Any, value: Any, scale: Any, acc_name: str) -> Any:
    """``value * scale`` for a positive ``value`` and per-row powers of two ``scale``:
    the ``rstd`` of rows scaled by ``scale``. A huge row's ``rstd`` may be subnormal
    (``4.6e-39`` for a float32 row of spread ``2e38``), which XLA flushes to zero:
    there it is built from its bits, rounded half to even as an IEEE product is."""
    product = value * scale
    if not _flushes(product):
        return product
    places, mantissa_bits, int_name = _SUBNORMAL[acc_name]
    below = 2.0**mantissa_bits
    # value * scale in units of the smallest subnormal, by exact power-of-two steps
    # (scale <= 1 here: a tiny row's rstd is never subnormal), capped short of inf
    units = xp.minimum(value * (xp.minimum(scale, 1.0) * 2.0**100), below * 2.0**(100 - places))
    units = units * 2.0 ** (places - 100)
    bits = xp.astype(xp.round(xp.minimum(units, below)), getattr(xp, int_name))
    subnormal = bit_view(bits, acc_name)
    return xp.where(units < below, subnormal, product)


def _lifted(xp: Any, r: Any, acc_name: str) -> tuple[Any, Any]:
    """``(lifted, down)`` with ``r == lifted * down`` exactly and ``lifted`` normal: a
    positive subnormal ``r`` (:func:`_times_scale`) is read from its bits where the
    library would read it as zero (XLA), times ``2**64``; elsewhere ``(r, 1)``."""
    if not _flushes(r):
        return r, 1.0
    places, mantissa_bits, int_name = _SUBNORMAL[acc_name]
    bits = bit_view(r, int_name)
    subnormal = (bits > 0) & (bits < 2**mantissa_bits)  # sign clear, exponent field 0
    units = xp.astype(xp.where(subnormal, bits, 0), _acc(xp, acc_name))  # exact
    lifted = xp.where(subnormal, units * 2.0 ** (64 - places), r)
    return lifted, xp.where(subnormal, 2.0**-64, 1.0)


def _inverse_sqrt(xp: Any, var: Any, eps: float, scale: Any, acc_name: str) -> Any:
    """``1 / sqrt(var + eps * scale**2)``: the ``rstd`` of rows scaled by ``scale`` (powers
    of two; ``eps`` scaled with them one factor at a time, since ``scale**2`` alone may
    leave the dtype's range).

    A positive ``eps`` below the dtype's smallest normal is subnormal, and XLA flushes
    it to zero wherever it stands in an array. It enters as ``eps * 2**64`` (exact,
    normal) times ``scale``, then ``2**-64``, then ``scale``: zero only where
    ``eps * scale`` is itself subnormal, and then negligible beside ``var`` unless
    ``var`` is tiny too. Those rows (constant rows, ``scale`` at most 1) get
    ``2**32 / sqrt(var * 2**64 + eps * 2**64 * scale**2)``, the same real value in
    normal numbers. Both branches stay finite, so ``jax.grad`` sees no NaN."""
    if not 0.0 < eps < _SMALLEST_NORMAL[acc_name]:
        return 1.0 / xp.sqrt(var + (eps * scale) * scale)
    lift = 2.0**_EPS_LIFT
    # eps in the accumulation dtype (rounded as the kernels round it), then lifted
    eps_lifted = float(np.asarray(eps, dtype=acc_name)) * lift
    small = (var < 2.0**-_SMALL_VAR) & (scale <= 1.0)
    plain = xp.where(small, xp.ones_like(var), var + ((eps_lifted * scale) / lift) * scale)
    tiny_var = xp.minimum(var, 2.0**-_SMALL_VAR)
    lifted = 2.0 ** (_EPS_LIFT // 2) / xp.sqrt(tiny_var * lift + (eps_lifted * scale) * scale)
    return xp.where(small, lifted, 1.0 / xp.sqrt(plain))


def _row_scale(xp: Any, amax: Any, acc_name: str, eps: float, *,
               amax_half: Any = None) -> Any:
    """Per-row power of two that brings a huge finite row's magnitude ``amax`` (keepdims,
    its largest ``|x|``) to [1, 2), or a tiny one's up (when ``eps`` is too small to hide
    its squares), else 1.

    With ``amax_half`` (the same measured on halves of the values), a row whose
    ``amax`` overflowed is measured on its halves; the scale returned is still the one
    for the full values. (Halves alone would not do: half a subnormal is rounded, and a
    float64 row of differences ``[2**-1074, 0, 0, 0]`` then looked constant.)
    """
    half = xp.zeros_like(amax)
    if amax_half is not None:
        overflowed = ~xp.isfinite(amax) & xp.isfinite(amax_half)
        amax = xp.where(overflowed, amax_half, amax)
        half = xp.where(overflowed, xp.ones_like(amax), half)
    shrink = xp.pow(0.5, half)  # 1, or 1/2 where measured on halves
    huge = (amax >= _RESCALE_FROM[acc_name] * shrink) & xp.isfinite(amax)
    if eps < _TINY_EPS[acc_name]:
        tiny = (amax < _TINY_BELOW[acc_name] * shrink) & (amax > 0)
        most = _MAX_EXPONENT[acc_name]
        if eps > 0:
            most = min(most, float((_SCALED_EPS_EXPONENT[acc_name] - math.log2(eps)) // 2))
    else:
        tiny = xp.zeros_like(huge)
        most = 0.0
    scaled = huge | tiny
    # Only scaled rows reach log2 (others see 1.0): no -inf from zero rows, under
    # jax.grad too.
    safe = xp.where(scaled, amax, xp.ones_like(amax))
    exponent = xp.minimum(xp.maximum(-xp.floor(xp.log2(safe)) - half,
                                     _MIN_EXPONENT[acc_name]), most)
    return xp.where(scaled, xp.pow(2.0, exponent), xp.ones_like(amax))


def _empty_rows(xp: Any, x: Any, axes: tuple[int, ...], acc: Any) -> tuple[Any, Any]:
    """Statistics of rows of zero elements, as torch gives them: mean 0, rstd NaN."""
    shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape))
    zeros = xp.zeros(shape, dtype=acc, device=x.device)
    return zeros, zeros + float("nan")


def _is_empty_row(x: Any, axes: tuple[int, ...]) -> bool:
    # Shapes are static (also under jax.jit): this is no data-dependent control flow.
    return any(x.shape[a] == 0 for a in axes)


def _first_of_rows(x: Any, axes: tuple[int, ...]) -> Any:
    index = tuple(slice(0, 1) if i in axes else slice(None) for i in range(x.ndim))
    return x[index]


def layer_norm(
    xp: Any, x: Any, axes: tuple[int, ...], bshape: tuple[int, ...], weight: Any, bias: Any,
    eps: float, acc_name: str,
) -> tuple[Any, Any, Any]:
    """LayerNorm over ``axes``; returns ``(y, mean, rstd)`` (stats keep dims)."""
    acc = _acc(xp, acc_name)
    if _is_empty_row(x, axes):
        mean, rstd = _empty_rows(xp, x, axes, acc)
        return c_contiguous(xp.astype(x, x.dtype, copy=True)), mean, rstd
    xa = xp.astype(x, acc)
    shift = _first_of_rows(xa, axes)
    # The largest |x - shift| of a row is that of its largest or its smallest element (a
    # rounded difference grows with x): two reductions, no array of differences. The
    # difference of two huge finite values (3e38 - -3e38 in float32) overflows: the
    # scale of such a row is measured on halves, and both terms are scaled (exactly)
    # before subtracting.
    top = xp.max(xa, axis=axes, keepdims=True)
    bottom = xp.min(xa, axis=axes, keepdims=True)
    scale = _row_scale(xp, xp.maximum(top - shift, shift - bottom), acc_name, eps,
                       amax_half=xp.maximum(top * 0.5 - shift * 0.5,
                                            shift * 0.5 - bottom * 0.5))
    shift_scaled = shift * scale
    d = xa * scale - shift_scaled
    mean_d = xp.mean(d, axis=axes, keepdims=True)
    centred = d - mean_d
    var = xp.mean(centred * centred, axis=axes, keepdims=True)
    # In the scaled units eps is eps * scale**2 (scale is 1 on every ordinary row;
    # multiplied one factor at a time, since scale**2 alone may leave the dtype's range).
    rstd_scaled = _inverse_sqrt(xp, var, eps, scale, acc_name)
    y = centred * rstd_scaled
    mean = (shift_scaled + mean_d) / scale
    rstd = _times_scale(xp, rstd_scaled, scale, acc_name)
    if weight is not None:
        y = y * _param(xp, weight, bshape, acc)
    if bias is not None:
        y = y + _param(xp, bias, bshape, acc)
    return c_contiguous(xp.astype(y, x.dtype)), c_contiguous(mean), c_contiguous(rstd)


def rms_norm(
    xp: Any, x: Any, axes: tuple[int, ...], bshape: tuple[int, ...], weight: Any, eps: float,
    acc_name: str,
) -> tuple[Any, Any]:
    """RMSNorm over ``axes``; returns ``(y, rstd)``."""
    acc = _acc(xp, acc_name)
    if _is_empty_row(x, axes):
        return c_contiguous(xp.astype(x, x.dtype, copy=True)), _empty_rows(xp, x, axes, acc)[1]
    xa = xp.astype(x, acc)
    scale = _row_scale(xp, xp.max(xp.abs(xa), axis=axes, keepdims=True), acc_name, eps)
    xs = xa * scale
    rstd_scaled = _inverse_sqrt(xp, xp.mean(xs * xs, axis=axes, keepdims=True), eps, scale,
                                acc_name)
    y = xs * rstd_scaled
    rstd = _times_scale(xp, rstd_scaled, scale, acc_name)
    if weight is not None:
        y = y * _param(xp, weight, bshape, acc)
    return c_contiguous(xp.astype(y, x.dtype)), c_contiguous(rstd)


def _other_axes(ndim: int, axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i not in axes)


def _row_mean(xp: Any, a: Any, axes: tuple[int, ...]) -> Any:
    """The mean over the normalized axes, keepdims; 0 for rows of no elements (NumPy
    warns of an empty slice there; the value is never used: grad_x has no element)."""
    if _is_empty_row(a, axes):
        return xp.sum(a, axis=axes, keepdims=True)
    return xp.mean(a, axis=axes, keepdims=True)


def layer_norm_backward(
    xp: Any, grad_y: Any, x: Any, mean: Any, rstd: Any, weight: Any, axes: tuple[int, ...],
    bshape: tuple[int, ...], acc_name: str,
) -> tuple[Any, Any, Any]:
    """``(grad_x, grad_weight, grad_bias)``; parameter grads in the accumulation dtype."""
    acc = _acc(xp, acc_name)
    dy = xp.astype(grad_y, acc)
    r, down = _lifted(xp, xp.astype(rstd, acc), acc_name)
    xhat = ((xp.astype(x, acc) - xp.astype(mean, acc)) * r) * down
    g = dy * _param(xp, weight, bshape, acc) if weight is not None else dy
    mean_g = _row_mean(xp, g, axes)
    mean_gx = _row_mean(xp, g * xhat, axes)
    grad_x = (((g - mean_g) - xhat * mean_gx) * r) * down
    other = _other_axes(x.ndim, axes)
    grad_w = xp.sum(dy * xhat, axis=other)
    grad_b = xp.sum(dy, axis=other)
    return c_contiguous(xp.astype(grad_x, x.dtype)), grad_w, grad_b


def rms_norm_backward(
    xp: Any, grad_y: Any, x: Any, rstd: Any, weight: Any, axes: tuple[int, ...],
    bshape: tuple[int, ...], acc_name: str,
) -> tuple[Any, Any]:
    """``(grad_x, grad_weight)``; the parameter grad in the accumulation dtype."""
    acc = _acc(xp, acc_name)
    dy = xp.astype(grad_y, acc)
    r, down = _lifted(xp, xp.astype(rstd, acc), acc_name)
    xhat = (xp.astype(x, acc) * r) * down
    g = dy * _param(xp, weight, bshape, acc) if weight is not None else dy
    mean_gx = _row_mean(xp, g * xhat, axes)
    grad_x = ((g - xhat * mean_gx) * r) * down
    grad_w = xp.sum(dy * xhat, axis=_other_axes(x.ndim, axes))
    return c_contiguous(xp.astype(grad_x, x.dtype)), grad_w
