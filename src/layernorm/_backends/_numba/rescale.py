"""Rows the fast row arithmetic cannot compute: squares that overflow or underflow.

A finite float32 row with a spread near ``1e19`` (float64: ``1e154``) has a sum of
squared deviations beyond the largest float: the fast row arithmetic ends with
``rstd = 0`` (or NaN, when a partial sum overflows first) and a row of zeros or NaN.
At the other end, with ``eps = 0`` (or an ``eps`` as small), a row with a spread below
about ``1e-19`` (float64: ``1e-154``) has squares in the subnormal range or below it:
they lose digits or vanish, and the row ends with a huge or infinite ``rstd`` and a row
of wrong values or infinities. Yet the normalized row is well defined and finite,
because normalization is scale invariant. The kernels therefore check each row's
``rstd`` (:func:`usable_rstd`: one comparison per row, nothing on rows that pass) and
hand a finite row whose ``rstd`` fails it to these functions, which:

* return False without writing anything when the row holds a NaN or an infinity (its
  ordinary result, NaN for LayerNorm and ``x * 0`` for RMSNorm, stands), and otherwise
* scale the row by the power of two ``s`` that brings its largest magnitude
  (LayerNorm: of its differences from its first element) into ``[0.5, 1)`` (exact: only
  the exponents change; ``eps`` becomes ``eps * s**2``, and ``s`` is capped so that
  this stays finite), compute its statistics two-pass in float64 (LayerNorm: of the
  differences from the row's first element, so a constant row has exactly zero
  deviations, as on the fast path), write the normalized row through the same affine
  step and rounding as the fast path, and store the statistics of the unscaled row
  (``mean / s``, ``rstd * s``; a float32 ``rstd`` beyond the largest float32 is stored
  as infinity). A row of zeros, and for LayerNorm a constant row (whose ``rstd`` is
  ``1 / sqrt(eps)``, beyond the limit for an ``eps`` that small), is normalized
  unscaled.

The row loops of unit-stride rows stop before such a row (a finite row whose ``rstd``
is not usable, :func:`needs_rescaling`), leave it unwritten and return its index. Loops
that must finish every row (gathered rows, the fusions) rescale it and resume after it;
the plain forward kernels return, and the driver finishes the call through the
gathered-rows kernel, so that a first call never compiles these functions (about half
a second) for a row that almost never comes. Unwritten rows keep in-place calls exact.

The result of such a row depends on that row alone (batch and thread invariance hold),
but it is computed by this different sequence of operations, so its bits are not those
any formula of the fast path would give: it is a rare row that the fast path cannot
compute at all.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._scalars import cast, narrow, widen
from ._simd import affine, alive, get, put, put_stat, raw, times_w
from .callee import callee_njit

#: The largest ``rstd`` of the fast row arithmetic that :func:`usable_rstd` accepts, for
#: float32 and for float64 accumulation. A larger one means ``var + eps`` below
#: ``2**-118`` (float64: ``2**-1000``), where squares of the row's deviations are
#: subnormal or vanish: the sum of squares may then be off by up to ``2**-149`` per
#: element (float64: ``2**-1074``), more than float32 (float64) rounding once the row
#: gets there. Only ``eps`` below those values lets a row get there.
RSTD_LIMIT_FLOAT32 = 2.0**59
RSTD_LIMIT_FLOAT64 = 2.0**500
#: Largest ``eps * s**2`` the rescaling lets ``s`` make (float64; see the module).
_SCALED_EPS_MAX_EXPONENT = 1000


@njit(inline="always", error_model="numpy")
def usable_rstd(rstd):
    """Whether the fast row arithmetic's ``rstd`` (float32 or float64) is the row's:
    positive, finite and at most :data:`RSTD_LIMIT_FLOAT32` (float64:
    :data:`RSTD_LIMIT_FLOAT64`). False for NaN."""
    limit = cast(RSTD_LIMIT_FLOAT64, rstd)
    if limit == math.inf:  # rstd is a float32 (known when compiling: folded away)
        limit = cast(RSTD_LIMIT_FLOAT32, rstd)
    return rstd > 0 and rstd <= limit


@callee_njit
def _power_of_two_scale(xr, r, n, eps, shifted):
    """``2**-e`` with ``m * 2**-e`` in ``[0.5, 1)``, ``m`` the largest ``|x|`` of the row
    (with ``shifted``, the largest ``|x - x[0]|``), at most what keeps ``eps * 2**-2e``
    finite and at most ``2**1000``; 1.0 when ``m`` is 0 (a row of zeros, or with
    ``shifted`` a constant row: nothing to scale, and a scaling down could only make
    ``eps`` underflow); 0.0 for a row holding a NaN or an infinity (no rescaling can
    help those).

    ``m`` is measured in full where the differences are finite (a difference of
    subnormals is exact, their halves are not: a float64 row ``[2**-1074, 0, 0, 0]``
    measured on halves looked constant) and on halves where they overflow."""
    first = np.float64(widen(get(xr, r, 0))) if shifted else 0.0
    half_first = first * 0.5
    half_max = full_max = 0.0
    for i in range(n):
        v = np.float64(widen(get(xr, r, i)))
        if not abs(v) < math.inf:  # NaN or infinity
            return 0.0
        half_max = max(half_max, abs(v * 0.5 - half_first))
        full_max = max(full_max, abs(v - first))  # infinity if it overflows
    if full_max == 0.0:
        return 1.0
    if full_max < math.inf:
        exponent = -math.frexp(full_max)[1]
    else:
        exponent = -(math.frexp(half_max)[1] + 1)
    if exponent > 0:  # a tiny row: scaled up, eps with it
        limit = _SCALED_EPS_MAX_EXPONENT
        e = np.float64(eps)
        if e > 0.0:
            limit = (_SCALED_EPS_MAX_EXPONENT - math.frexp(e)[1]) // 2
        exponent = min(exponent, limit, _SCALED_EPS_MAX_EXPONENT)
    return math.ldexp(1.0, exponent)


@njit(inline="always", error_model="numpy")
def _scaled(xr, r, i, scale):
    """Element ``[r, i]`` in double times the power of two ``scale`` (exact)."""
    return np.float64(widen(get(xr, r, i))) * scale


@callee_njit
def ln_row_rescaled(xr, yr, r, n, eps, w, b, mean_out, rstd_out, s):
    """LayerNorm of row ``r`` of the :class:`._simd.Raw` view ``xr`` into ``yr``, rescaled.

    Statistics go to index ``s`` of ``mean_out``/``rstd_out`` (None: not stored).
    Returns False, having written nothing, if the row holds a NaN or an infinity.
    """
    scale = _power_of_two_scale(xr, r, n, eps, True)
    if scale == 0.0:
        return False
    first = _scaled(xr, r, 0, scale)
    total = 0.0
    for i in range(n):
        total += _scaled(xr, r, i, scale) - first
    shifted_mean = total / n
    m2 = 0.0
    for i in range(n):
        d = (_scaled(xr, r, i, scale) - first) - shifted_mean
        m2 += d * d
    rstd = 1.0 / math.sqrt(m2 / n + np.float64(eps) * scale * scale)
    for i in range(n):
        v = cast(((_scaled(xr, r, i, scale) - first) - shifted_mean) * rstd, eps)
        put(yr, r, i, narrow(affine(v, w, b, i), yr))
    put_stat(mean_out, s, cast((first + shifted_mean) / scale, eps))
    put_stat(rstd_out, s, cast(rstd * scale, eps))
    return True


@callee_njit
def rms_row_rescaled(xr, yr, r, n, eps, w, rstd_out, s):
    """RMSNorm of row ``r`` of ``xr`` into ``yr``, rescaled; ``rstd`` to ``rstd_out[s]``.

    Returns False, having written nothing, if the row holds a NaN or an infinity.
    """
    scale = _power_of_two_scale(xr, r, n, eps, False)
    if scale == 0.0:
        return False
    ss = 0.0
    for i in range(n):
        v = _scaled(xr, r, i, scale)
        ss += v * v
    rstd = 1.0 / math.sqrt(ss / n + np.float64(eps) * scale * scale)
    for i in range(n):
        v = cast(_scaled(xr, r, i, scale) * rstd, eps)
        put(yr, r, i, narrow(times_w(v, w, i), yr))
    put_stat(rstd_out, s, cast(rstd * scale, eps))
    return True


@callee_njit
def _column_row(x2, c):
    # A column of a tile as a contiguous scratch row (the rescaled functions read rows).
    n = x2.shape[0]
    xs = np.empty((1, n), dtype=x2.dtype)
    for i in range(n):
        xs[0, i] = x2[i, c]
    return xs


@callee_njit
def ln_column_rescaled(x2, y2, c, eps, w, b, mean_out, rstd_out, s):
    """:func:`ln_row_rescaled` for column ``c`` of the 2-D tiles ``x2``/``y2``
    (``w``, ``b``: 1-D arrays)."""
    xs = _column_row(x2, c)
    ys = np.empty_like(xs, dtype=y2.dtype)
    done = ln_row_rescaled(raw(xs), raw(ys), 0, xs.shape[1], eps, raw(w), raw(b), mean_out,
                           rstd_out, s)
    if done:
        for i in range(xs.shape[1]):
            y2[i, c] = ys[0, i]
    alive(xs)
    alive(ys)
    alive(w)
    alive(b)
    return done


@callee_njit
def rms_column_rescaled(x2, y2, c, eps, w, rstd_out, s):
    """:func:`rms_row_rescaled` for column ``c`` of the 2-D tiles ``x2``/``y2``."""
    xs = _column_row(x2, c)
    ys = np.empty_like(xs, dtype=y2.dtype)
    done = rms_row_rescaled(raw(xs), raw(ys), 0, xs.shape[1], eps, raw(w), rstd_out, s)
    if done:
        for i in range(xs.shape[1]):
            y2[i, c] = ys[0, i]
    alive(xs)
    alive(ys)
    alive(w)
    return done


@njit(inline="always", error_model="numpy")
def finite_row(xr, r, n):
    """Whether row ``r`` of a :class:`._simd.Raw` view holds no NaN and no infinity."""
    for i in range(n):
        if not abs(widen(get(xr, r, i))) < math.inf:
            return False
    return True


@njit(inline="always", error_model="numpy")
def needs_rescaling(xr, r, n, rstd):
    """Whether row ``r``, whose fast-path ``rstd`` is ``rstd``, must be normalized by
    :func:`ln_row_rescaled` / :func:`rms_row_rescaled` (which then accept it): a finite
    row whose ``rstd`` is not usable (:func:`usable_rstd`)."""
    return not usable_rstd(rstd) and finite_row(xr, r, n)
