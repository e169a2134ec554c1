"""Row arithmetic shared by every Numba kernel: constants, widening, affine, moments.

Every kernel computes each row with one fixed sequence of IEEE operations (the *row
arithmetic* below), whatever the row's layout, its position in the batch and the number
of threads, so each row's result is bitwise reproducible. This module holds the pieces
of it that more than one layout uses; :mod:`.forward_rows`, :mod:`.forward_cols` and
:mod:`.backward` put them together (:mod:`.kernels` has the overview).

Row arithmetic, LayerNorm statistics (one pass over memory)
----------------------------------------------------------
Accumulation type ``T`` is float32 (float64 for float64 input). Values are shifted by
``K = x[0]``, so a constant row has centred values exactly 0. Element ``i`` belongs to
lane ``i % LANES``; ``G = n // LANES`` full groups give every lane ``G`` elements and
the ``r = n % LANES`` remaining elements go one each to lanes ``0 .. r-1``.

1. Groups are taken ``PER_LANE`` (8) at a time (a chunk of ``CHUNK`` elements; the last
   chunk may hold ``g < PER_LANE`` groups). Per chunk and lane, with ``v_k = x - K``
   of the lane's ``g`` elements (``v_k = -0.0`` for ``k >= g``, which adds exactly
   nothing): ``s = ((v_0 + v_1) + (v_2 + v_3)) + ((v_4 + v_5) + (v_6 + v_7))``,
   ``m = s * (1/g)``, ``d_k = v_k - m`` (``+0.0`` for ``k >= g``) and
   ``q = (fma(d_0, d_0, d_1 * d_1) + fma(d_2, d_2, d_3 * d_3)) + (fma(d_4, d_4, d_5 * d_5)
   + fma(d_6, d_6, d_7 * d_7))``. The fixed trees (not running sums) keep the
   dependency chains short: a running sum over the chunk was latency-bound.
2. The chunk is merged into the lane state ``(mean, M2)`` (both start at 0) with Chan's
   formula and scalar weights ``f = g / (a + g)``, ``c = a * f`` where ``a`` is the
   lane's count so far: ``d = m - mean; mean = mean + d * f; M2 = (M2 + q) + (d * d) * c``.
3. The remainder is merged the same way, as a chunk of one element per lane (``m = v``,
   ``q = (v - v)**2``) with per-lane weights that are 0 for lanes ``>= r`` (those lanes
   see ``v = K - K``).
4. Lanes are combined with counts ``c_j`` (``G`` or ``G + 1`` elements): with
   ``T(v)``, the sum of a vector's lanes in the fixed tree (lane ``j`` plus lane
   ``j + h`` for ``h = 8, 4, 2, 1``), ``mean_shifted = T(c * mean) * (1/n)``,
   ``d = mean - mean_shifted`` and ``M2 = T(fma(c * d, d, M2))``: the exact
   decomposition of the total ``M2``, with two short tree sums instead of a chain of
   merges. All weights depend on ``n`` only and are computed once per call
   (:func:`merge_table`).
5. ``rstd = 1 / sqrt(M2 / n + eps)``, ``mean = K + mean_shifted``, and the output pass
   computes ``y = fma(((x - K) - mean_shifted) * rstd, w, b)`` element by element. The
   backend passes ``w = 1`` for an absent weight and ``b = -0.0`` for an absent bias:
   ``fma(v, 1, -0.0) = v``, ``fma(v, w, -0.0) = v * w`` and ``fma(v, 1, b) = v + b``
   exactly, so one compiled kernel serves every combination. Float16/bfloat16 ``w`` and
   ``b`` are widened exactly to float32 before the kernels see them
   (:func:`widen_param`).

``fma`` is IEEE fusedMultiplyAdd, written explicitly: one rounding, the same bits on
every machine. The compiler is never allowed to contract or reorder anything itself.

RMSNorm: per chunk and lane, the squares of the chunk's elements are summed in the same
fixed tree as ``q`` above (absent elements are 0), the chunk sums are added to the lane's
sum in order, then the remainder's squares; lanes are summed in the fixed tree,
``rstd = 1 / sqrt(ss / n + eps)``, ``y = x * rstd * w``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._scalars import cast, widen
from ._simd import (
    WIDTH,
    Vec,
    down1,
    down2,
    down4,
    down8,
    fma,
    get,
    lane,
    put,
    raw,
    runtime,
    splat,
    vload,
    vload_tail,
    vstore,
)
from .diskcache import cached_njit

LANES = WIDTH
PER_LANE = 8
CHUNK = LANES * PER_LANE
#: Elements per parallel work item (no effect on results).
WORK_ELEMENTS = 1 << 15
#: Rows of the merge-weight table: the remainder's (f, c) per lane, the partial chunk's
#: (f, c, 1/g), the lanes' element counts, and 1/n.
TAB_ROWS = 5
TAB_REM_F, TAB_REM_C, TAB_PARTIAL, TAB_COUNTS, TAB_INV_N = 0, 1, 2, 3, 4


@functools.lru_cache(maxsize=256)
def merge_table(n: int, dtype: Any) -> np.ndarray:
    """Weights of the row arithmetic that depend on ``n`` only (rows ``TAB_*``).

    Computed on the host once per ``(n, dtype)`` and passed to the kernels (a read-only
    array): the same IEEE operations in ``dtype`` as in a kernel, so the same bits, and
    nothing to compile.

    Parameters
    ----------
    n : int
        Row length.
    dtype : numpy.dtype
        Accumulation dtype (float32 or float64).

    Returns
    -------
    numpy.ndarray
        ``(TAB_ROWS, LANES)``, read-only.

    Examples
    --------
    >>> tab = merge_table(20, np.dtype(np.float32))
    >>> float(tab[TAB_INV_N, 0]) == float(np.float32(1) / np.float32(20))
    True
    """
    t = np.dtype(dtype).type
    groups, r = divmod(n, LANES)
    tab = np.zeros((TAB_ROWS, LANES), dtype=dtype)
    one = t(1.0)
    for j in range(LANES):
        tab[TAB_COUNTS, j] = t(groups + (1 if j < r else 0))
        if j < r:
            f = one / t(groups + 1)
            tab[TAB_REM_F, j] = f
            tab[TAB_REM_C, j] = t(groups) * f
    full = groups // PER_LANE
    g = groups - full * PER_LANE
    if g > 0:
        # The partial chunk's weights (chunk_weights(full, g)), hoisted out of the rows.
        a = full * PER_LANE
        f = t(g) / t(a + g)
        tab[TAB_PARTIAL, 0] = f
        tab[TAB_PARTIAL, 1] = t(a) * f
        tab[TAB_PARTIAL, 2] = one / t(g)
    tab[TAB_INV_N, 0] = one / t(max(n, 1))
    tab.flags.writeable = False
    return tab


@cached_njit(error_model="numpy")
def widen_param(bits):
    """A float16 (``int16`` bits) or bfloat16 (``uint16`` bits) parameter widened exactly
    to a new float32 array.

    The driver widens 16-bit parameters with this one small kernel before calling any
    other, so the row kernels only ever see float32/float64 parameters: a new parameter
    dtype compiles this kernel (once per bits dtype), never another copy of a row
    kernel. (Widening where each vector is loaded cost 9-17% of a 16-bit forward.)
    """
    n = bits.shape[0]
    out = np.empty((1, n), dtype=np.float32)
    pv, ov = raw(bits), raw(out)
    body = n - n % LANES
    for i in range(0, body, LANES):
        vstore(ov, vload(pv, 0, i), 0, i)
    for i in range(body, n):
        put(ov, 0, i, widen(get(pv, 0, i)))
    return out[0]


def times_w(v, w, i):
    """``v * w[i:i+WIDTH]`` (vector ``v``) or ``v * w[i]`` (scalar), ``w`` widened."""
    return v * (vload(w, 0, i) if isinstance(v, np.ndarray) else widen(get(w, 0, i)))


@overload(times_w, inline="always")
def _times_w(v, w, i):
    if isinstance(v, Vec):
        return lambda v, w, i: v * vload(w, 0, i)
    return lambda v, w, i: v * widen(get(w, 0, i))


def put_stat(out, r, value):
    """``out[r] = value``, or nothing when the caller did not ask for ``out`` (None, or an
    empty array: the short path passes one, so that a call without statistics runs the
    same compiled kernel as a call with them)."""
    if out is not None and out.shape[0] != 0:
        out[r] = value


@overload(put_stat, inline="always")
def _put_stat(out, r, value):
    if isinstance(out, types.NoneType):
        return lambda out, r, value: None

    def impl(out, r, value):
        if out.shape[0] != 0:
            out[r] = value

    return impl


def affine(v, w, b, i):
    """``v * w[i..] + b[i..]`` rounded once (fma); an absent parameter is an identity array."""
    if isinstance(v, np.ndarray):
        return fma(v, vload(w, 0, i), vload(b, 0, i))
    return fma(v, widen(get(w, 0, i)), widen(get(b, 0, i)))


@overload(affine, inline="always")
def _affine(v, w, b, i):
    if isinstance(v, Vec):
        return lambda v, w, b, i: fma(v, vload(w, 0, i), vload(b, 0, i))
    return lambda v, w, b, i: fma(v, widen(get(w, 0, i)), widen(get(b, 0, i)))


@njit(inline="always", error_model="numpy")
def merge(mean, m2, m, q, f, c):
    d = m - mean
    return mean + d * f, (m2 + q) + (d * d) * c


@njit(inline="always", error_model="numpy")
def chunk_weights(chunk, g, like):
    a = chunk * PER_LANE
    f = cast(g, like) / cast(a + g, like)
    return f, cast(a, like) * f


@njit(inline="always", error_model="numpy")
def finish(shift, mean, m2, n, eps):
    rstd = cast(1.0, eps) / np.sqrt(m2 / cast(n, eps) + eps)
    return shift + mean, rstd


@njit(error_model="numpy")
def tree_sum(v):
    v = v + down8(v)
    v = v + down4(v)
    v = v + down2(v)
    v = v + down1(v)
    return lane(v, 0)


@njit(error_model="numpy")
def chunk_tree(v0, v1, v2, v3, v4, v5, v6, v7, g, inv, zero):
    """(m, q) of one chunk from its ``PER_LANE`` shifted leaves (absent ones are -0.0)."""
    s = ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))
    m = s * inv
    d0 = v0 - m
    d1 = v1 - m if g > 1 else zero
    d2 = v2 - m if g > 2 else zero
    d3 = v3 - m if g > 3 else zero
    d4 = v4 - m if g > 4 else zero
    d5 = v5 - m if g > 5 else zero
    d6 = v6 - m if g > 6 else zero
    d7 = v7 - m if g > 7 else zero
    return m, square_tree(d0, d1, d2, d3, d4, d5, d6, d7)


@njit(error_model="numpy")
def square_tree(d0, d1, d2, d3, d4, d5, d6, d7):
    """``d0**2 + ... + d7**2`` in the fixed tree (pairs fused: ``fma(d0, d0, d1 * d1)``).

    Absent leaves are +0.0: their squares add exactly nothing to sums of squares, which
    are never -0.0.
    """
    return ((fma(d0, d0, d1 * d1) + fma(d2, d2, d3 * d3))
            + (fma(d4, d4, d5 * d5) + fma(d6, d6, d7 * d7)))


@njit(error_model="numpy")
def _row_chunk(xr, r, base, g, kv, inv, pad, zero):
    # Leaves written out: a helper called with the constants 0 .. 7 would be compiled
    # once per constant.
    return chunk_tree(
        vload(xr, r, base) - kv if g > 0 else pad,
        vload(xr, r, base + LANES) - kv if g > 1 else pad,
        vload(xr, r, base + 2 * LANES) - kv if g > 2 else pad,
        vload(xr, r, base + 3 * LANES) - kv if g > 3 else pad,
        vload(xr, r, base + 4 * LANES) - kv if g > 4 else pad,
        vload(xr, r, base + 5 * LANES) - kv if g > 5 else pad,
        vload(xr, r, base + 6 * LANES) - kv if g > 6 else pad,
        vload(xr, r, base + 7 * LANES) - kv if g > 7 else pad,
        g, inv, zero)


@njit(inline="always", error_model="numpy")
def row_moments(xr, r, n, shift, tab):
    """(shifted mean, M2) of a unit-stride row."""
    mean, m2 = lane_moments(xr, r, n, shift, tab)
    counts = vload(tab, TAB_COUNTS, 0)
    mu = tree_sum(counts * mean) * get(tab, TAB_INV_N, 0)
    d = mean - splat(mu)
    return mu, tree_sum(fma(counts * d, d, m2))


@njit(inline="always", error_model="numpy")
def lane_moments(xr, r, n, shift, tab):
    """Per-lane (shifted mean, M2) of a unit-stride row: steps 1-3 of the row arithmetic."""
    like = shift
    kv = splat(shift)
    zero = splat(cast(0.0, like))
    pad = splat(cast(-0.0, like))
    mean = zero
    m2 = zero
    groups = n // LANES
    full = groups // PER_LANE
    inv_full = splat(cast(1.0, like) / cast(PER_LANE, like))
    for c in range(full):
        m, q = _row_chunk(xr, r, c * CHUNK, runtime(PER_LANE), kv, inv_full, pad, zero)
        f, cc = chunk_weights(c, PER_LANE, like)
        mean, m2 = merge(mean, m2, m, q, splat(f), splat(cc))
    g = groups - full * PER_LANE
    if g > 0:
        m, q = _row_chunk(xr, r, full * CHUNK, g, kv, splat(get(tab, TAB_PARTIAL, 2)), pad,
                          zero)
        mean, m2 = merge(mean, m2, m, q, splat(get(tab, TAB_PARTIAL, 0)),
                          splat(get(tab, TAB_PARTIAL, 1)))
    start = groups * LANES
    if start < n:
        v = vload_tail(xr, r, start, n - start, shift) - kv
        d = v - v
        mean, m2 = merge(mean, m2, v, d * d, vload(tab, TAB_REM_F, 0),
                          vload(tab, TAB_REM_C, 0))
    return mean, m2


@njit(error_model="numpy")
def copy_row(dst, rd, src, rs):
    # An explicit loop: slice assignment compiles a large generic implementation.
    for i in range(src.shape[1]):
        dst[rd, i] = src[rs, i]

