"""Numba kernels: rows of a 2-D ``(rows, n)`` array, or columns of ``(outer, n, inner)``.

Every kernel computes each row with one fixed sequence of IEEE operations (the *row
arithmetic* below), whatever the row's layout, its position in the batch and the number
of threads, so each row's result is bitwise reproducible. Three code paths perform it:

* **row path** (2-D, row with unit stride): the ``LANES`` lanes of the row arithmetic
  are the lanes of one SIMD vector (:mod:`._simd`), loaded straight from the row. In the
  LayerNorm forward, rows of at most ``SHORT_ROW_MAX`` elements go ``LANES`` at a time:
  each row's lane state is computed alone, then the lane trees of step 4 and the
  ``rstd`` of step 5 are evaluated for all of them at once on folded vectors (row ``i``
  in lane ``i``, the same additions in the same tree), which removes most of a short
  row's latency;
* **gather path** (any other 2-D row): rows are copied into contiguous scratch rows,
  run through the row path, and the results copied out;
* **column path** (3-D, ``inner > 1``, the channels-first case): ``WIDTH`` neighbouring
  columns are processed at once, one column per SIMD lane, and the row arithmetic's
  lanes become a loop over lane-state vectors. A work item copies a tile of up to
  ``8 * WIDTH`` columns into an ``(n, columns)`` scratch tile in row order first (rows
  are far apart; a sequential walk is what the prefetchers follow), padding a last
  partial block by repeating its last column. The backward of this layout gathers each
  column into a scratch row and runs the row path on it.

IEEE operations on a vector are the same operations per lane, and Numba is never asked
for fastmath or FMA contraction (``error_model="numpy"`` also removes Python's
zero-division checks: an ``eps=0`` constant row gives NaN), so all paths give
identical bits (tested in ``tests/test_numba_kernels.py``). Rows reach the per-row
helpers as :class:`._simd.Raw` views: passing arrays would cost reference-count
updates per row.

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
   (:func:`merge_weights`).
5. ``rstd = 1 / sqrt(M2 / n + eps)``, ``mean = K + mean_shifted``, and the output pass
   computes ``y = fma(((x - K) - mean_shifted) * rstd, w, b)`` element by element. The
   backend passes ``w = 1`` for an absent weight and ``b = -0.0`` for an absent bias:
   ``fma(v, 1, -0.0) = v``, ``fma(v, w, -0.0) = v * w`` and ``fma(v, 1, b) = v + b``
   exactly, so one compiled kernel serves every combination. Float16/bfloat16 ``w`` and
   ``b`` arrive as raw bits and are widened exactly to float32: once per call on the row
   path (:func:`widened`), where they are loaded on the column path.

``fma`` is IEEE fusedMultiplyAdd, written explicitly: one rounding, the same bits on
every machine. The compiler is never allowed to contract or reorder anything itself.

RMSNorm: per chunk and lane, the squares of the chunk's elements are summed in the same
fixed tree as ``q`` above (absent elements are 0), the chunk sums are added to the lane's
sum in order, then the remainder's squares; lanes are summed in the fixed tree,
``rstd = 1 / sqrt(ss / n + eps)``, ``y = x * rstd * w``.

Backward (LayerNorm): lane ``i % LANES`` accumulates ``g = dy * w`` and ``g * xhat``
(``xhat = (x - mean) * rstd``) in order; tree sums; ``grad_x = ((g - mean_g) - xhat *
mean_gxhat) * rstd``. ``grad_weight``/``grad_bias`` partials are accumulated per fixed
block of rows (2-D: ``block_rows`` consecutive rows in order; 3-D: one partial per
``(outer index, COL_BLOCK columns)``), then summed over blocks in order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._scalars import cast, narrow, widen
from ._simd import (
    WIDTH,
    Vec,
    alive,
    copy2,
    down1,
    down2,
    down4,
    down8,
    fma,
    fold1,
    fold2,
    fold4,
    fold8,
    get,
    itemsize,
    lane,
    load2,
    put,
    raw,
    runtime,
    splat,
    sqrt,
    store2,
    store_fence,
    vaddress,
    vload,
    vstore,
    vstore_nt,
)

LANES = WIDTH
PER_LANE = 8
CHUNK = LANES * PER_LANE
#: Rows at least this long run the backward two rows per pass (no effect on results;
#: measured: it pays once the partial sums no longer fit in L1, and costs below).
PAIR_MIN_N = 2048
#: Columns per grad_weight/grad_bias partial block in the channels-first backward.
COL_BLOCK = 64
#: Elements per parallel work item (no effect on results).
WORK_ELEMENTS = 1 << 15
#: Rows up to this long take the LayerNorm forward's short-row path, ``LANES`` rows at a
#: time (no effect on results). Measured, float32, 1 thread, kernel alone: 16-20% faster
#: at (4096, 64) and 10% at (65536, 64), 25% at (32768, 100); even at (16384, 128); at
#: n = 160-256 faster from L2 but 10-45% slower from L3, so longer rows keep the row
#: path. Such rows never take streaming stores (``STREAM_MIN_ROW`` is larger).
SHORT_ROW_MAX = 128
#: Rows of the short-row path's scratch block: lane means, lane M2s, per-row work
#: vectors (LANES rows each), then one row each of shifts, shifted means, rstd, means.
_S_MEAN, _S_M2, _S_WORK = 0, LANES, 2 * LANES
_S_SHIFT, _S_MU, _S_RSTD, _S_MEAN_OUT = 3 * LANES, 3 * LANES + 1, 3 * LANES + 2, 3 * LANES + 3
_S_ROWS = 3 * LANES + 4
#: Rows of the merge-weight table: the remainder's (f, c) per lane, the partial chunk's
#: (f, c, 1/g), the lanes' element counts, and 1/n.
_TAB_ROWS = 5
_TAB_REM_F, _TAB_REM_C, _TAB_PARTIAL, _TAB_COUNTS, _TAB_INV_N = 0, 1, 2, 3, 4


# --------------------------------------------------------------------------- weights


@njit(cache=True, error_model="numpy")
def merge_weights(n, like):
    """Weights of the row arithmetic that depend on ``n`` only (rows: ``_TAB_*``)."""
    groups = n // LANES
    r = n % LANES
    tab = np.full((_TAB_ROWS, LANES), cast(0.0, like))
    one = cast(1.0, like)
    for j in range(LANES):
        tab[_TAB_COUNTS, j] = cast(groups + (1 if j < r else 0), like)
        if j < r:
            f = one / cast(groups + 1, like)
            tab[_TAB_REM_F, j] = f
            tab[_TAB_REM_C, j] = cast(groups, like) * f
    full = groups // PER_LANE
    g = groups - full * PER_LANE
    if g > 0:
        # The partial chunk's weights, hoisted out of the row loop (same formula).
        f, c = _chunk_weights(full, g, like)
        tab[_TAB_PARTIAL, 0] = f
        tab[_TAB_PARTIAL, 1] = c
        tab[_TAB_PARTIAL, 2] = one / cast(g, like)
    tab[_TAB_INV_N, 0] = one / cast(max(n, 1), like)
    return tab


def widened(param):
    """``param`` ready for the row loops: float16/bfloat16 raw bits widened (exactly) to a
    new float32 array once per call, any other array unchanged.

    Widening a 16-bit parameter where each vector is loaded cost about four instructions
    per vector per row in the output pass (measured: 9-17% of a bfloat16/float16 forward
    with 16-bit parameters, against float32 ones). The results are the same bits.
    """
    raise NotImplementedError


def _is_bits(param: types.Type) -> bool:
    return isinstance(param, types.Array) and param.dtype in (types.int16, types.uint16)


@njit(inline="always", error_model="numpy")
def _widen_into(out, row, param):
    pv, ov = raw(param), raw(out)
    n = param.shape[0]
    body = n - n % LANES
    for i in range(0, body, LANES):
        vstore(ov, vload(pv, 0, i), row, i)
    for i in range(body, n):
        put(ov, row, i, widen(get(pv, 0, i)))
    alive(param)


@overload(widened, inline="always")
def _widened(param):
    if not _is_bits(param):
        return lambda param: param

    def impl(param):
        out = np.empty((1, param.shape[0]), dtype=np.float32)
        _widen_into(out, 0, param)
        return out[0]

    return impl


def widened_pair(w, b):
    """:func:`widened` of ``w`` and ``b``, with one allocation when both are 16-bit."""
    raise NotImplementedError


@overload(widened_pair, inline="always")
def _widened_pair(w, b):
    if not (_is_bits(w) and _is_bits(b)):
        return lambda w, b: (widened(w), widened(b))

    def impl(w, b):
        out = np.empty((2, w.shape[0]), dtype=np.float32)
        _widen_into(out, 0, w)
        _widen_into(out, 1, b)
        return out[0], out[1]

    return impl


def times_w(v, w, i):
    """``v * w[i:i+WIDTH]`` (vector ``v``) or ``v * w[i]`` (scalar), ``w`` widened."""
    raise NotImplementedError


@overload(times_w, inline="always")
def _times_w(v, w, i):
    if isinstance(v, Vec):
        return lambda v, w, i: v * vload(w, 0, i)
    return lambda v, w, i: v * widen(get(w, 0, i))


def put_stat(out, r, value):
    """``out[r] = value``, or nothing when the caller did not ask for ``out`` (None)."""
    raise NotImplementedError


@overload(put_stat, inline="always")
def _put_stat(out, r, value):
    if isinstance(out, types.NoneType):
        return lambda out, r, value: None

    def impl(out, r, value):
        out[r] = value

    return impl


def affine(v, w, b, i):
    """``v * w[i..] + b[i..]`` rounded once (fma); an absent parameter is an identity array."""
    raise NotImplementedError


@overload(affine, inline="always")
def _affine(v, w, b, i):
    if isinstance(v, Vec):
        return lambda v, w, b, i: fma(v, vload(w, 0, i), vload(b, 0, i))
    return lambda v, w, b, i: fma(v, widen(get(w, 0, i)), widen(get(b, 0, i)))


@njit(inline="always", error_model="numpy")
def _merge(mean, m2, m, q, f, c):
    d = m - mean
    return mean + d * f, (m2 + q) + (d * d) * c


@njit(inline="always", error_model="numpy")
def _chunk_weights(chunk, g, like):
    a = chunk * PER_LANE
    f = cast(g, like) / cast(a + g, like)
    return f, cast(a, like) * f


@njit(inline="always", error_model="numpy")
def _finish(shift, mean, m2, n, eps):
    rstd = cast(1.0, eps) / np.sqrt(m2 / cast(n, eps) + eps)
    return shift + mean, rstd


# --------------------------------------------------------------------------- row path


@njit(error_model="numpy")
def _chunk_tree(v0, v1, v2, v3, v4, v5, v6, v7, g, inv, zero):
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
    return m, _square_tree(d0, d1, d2, d3, d4, d5, d6, d7)


@njit(error_model="numpy")
def _square_tree(d0, d1, d2, d3, d4, d5, d6, d7):
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
    return _chunk_tree(
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
def _row_moments(xr, r, n, shift, tab, rem):
    """(shifted mean, M2) of a unit-stride row; ``rem`` is a LANES scratch."""
    mean, m2 = _lane_moments(xr, r, n, shift, tab, rem)
    counts = vload(tab, _TAB_COUNTS, 0)
    mu = _tree_sum(counts * mean) * get(tab, _TAB_INV_N, 0)
    d = mean - splat(mu)
    return mu, _tree_sum(fma(counts * d, d, m2))


@njit(inline="always", error_model="numpy")
def _lane_moments(xr, r, n, shift, tab, rem):
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
        m, q = _row_chunk(xr, r, c * CHUNK, PER_LANE, kv, inv_full, pad, zero)
        f, cc = _chunk_weights(c, PER_LANE, like)
        mean, m2 = _merge(mean, m2, m, q, splat(f), splat(cc))
    g = groups - full * PER_LANE
    if g > 0:
        m, q = _row_chunk(xr, r, full * CHUNK, g, kv, splat(get(tab, _TAB_PARTIAL, 2)), pad,
                          zero)
        mean, m2 = _merge(mean, m2, m, q, splat(get(tab, _TAB_PARTIAL, 0)),
                          splat(get(tab, _TAB_PARTIAL, 1)))
    start = groups * LANES
    if start < n:
        for j in range(LANES):
            put(rem, 0, j, widen(get(xr, r, start + j)) if start + j < n else shift)
        v = vload(rem, 0, 0) - kv
        d = v - v
        mean, m2 = _merge(mean, m2, v, d * d, vload(tab, _TAB_REM_F, 0),
                          vload(tab, _TAB_REM_C, 0))
    return mean, m2


@njit(inline="always", error_model="numpy")
def _ln_row_out(xr, yr, r, n, shift, mean, rstd, w, b, nt):
    kv = splat(shift)
    mv = splat(mean)
    rv = splat(rstd)
    i = 0
    if nt:
        # Streaming stores need aligned addresses: peel elements up to the boundary.
        align = min(64, LANES * itemsize(yr))
        while i < n and vaddress(yr, r, i) % align != 0:
            v = ((widen(get(xr, r, i)) - shift) - mean) * rstd
            v = affine(v, w, b, i)
            put(yr, r, i, narrow(v, yr))
            i += 1
    body = i + (n - i) // LANES * LANES
    if nt:
        while i < body:
            v = ((vload(xr, r, i) - kv) - mv) * rv
            v = affine(v, w, b, i)
            vstore_nt(yr, v, r, i)
            i += LANES
    else:
        while i < body:
            v = ((vload(xr, r, i) - kv) - mv) * rv
            v = affine(v, w, b, i)
            vstore(yr, v, r, i)
            i += LANES
    while i < n:
        v = ((widen(get(xr, r, i)) - shift) - mean) * rstd
        v = affine(v, w, b, i)
        put(yr, r, i, narrow(v, yr))
        i += 1


@njit(error_model="numpy")
def _copy_row(dst, rd, src, rs):
    # An explicit loop: slice assignment compiles a large generic implementation.
    for i in range(src.shape[1]):
        dst[rd, i] = src[rs, i]


@njit(inline="always", error_model="numpy")
def _unit(a):
    return a.strides[1] == a.itemsize


@njit(error_model="numpy")
def _ln_rows(x, w, b, eps, y, mean_out, rstd_out, tab, nt, r0, r1):
    if not (_unit(x) and _unit(y)):
        _ln_rows_gathered(x, w, b, eps, y, mean_out, rstd_out, tab, r0, r1)
        return
    _ln_raw_rows(raw(x), raw(y), raw(w), raw(b), raw(tab), eps, x.shape[1], nt, mean_out,
                 rstd_out, r0, r1, r0)


@njit(error_model="numpy")
def _ln_raw_rows(xv, yv, wv, bv, tv, eps, n, nt, mean_out, rstd_out, r0, r1, s0):
    """Rows ``r0 .. r1`` of unit-stride :class:`._simd.Raw` views; their statistics go to
    ``s0 ..``. Compiled once per dtype: the contiguous rows and the gathered ones (whose
    views are of scratch rows) share it."""
    rem = np.full((1, LANES), eps)
    remv = raw(rem)
    if n <= SHORT_ROW_MAX:
        _ln_rows_short(xv, yv, wv, bv, tv, remv, eps, n, mean_out, rstd_out, r0, r1, s0)
        alive(rem)
        return
    for r in range(r0, r1):
        shift = widen(get(xv, r, 0))
        mean, m2 = _row_moments(xv, r, n, shift, tv, remv)
        mo, rstd = _finish(shift, mean, m2, n, eps)
        _ln_row_out(xv, yv, r, n, shift, mean, rstd, wv, bv, nt)
        put_stat(mean_out, s0 + (r - r0), mo)
        put_stat(rstd_out, s0 + (r - r0), rstd)
    alive(rem)
    if nt:
        store_fence()  # streaming stores done before another thread reads y


@njit(inline="always", error_model="numpy")
def _folded_tree_sums(sv, first):
    """:func:`_tree_sum` of each of the LANES vectors in rows ``first ..`` of ``sv``; the
    sum of row ``first + i`` lands in lane ``i`` (the same additions, see ``fold8``)."""
    a0 = fold8(vload(sv, first, 0), vload(sv, first + 1, 0))
    a1 = fold8(vload(sv, first + 2, 0), vload(sv, first + 3, 0))
    a2 = fold8(vload(sv, first + 4, 0), vload(sv, first + 5, 0))
    a3 = fold8(vload(sv, first + 6, 0), vload(sv, first + 7, 0))
    a4 = fold8(vload(sv, first + 8, 0), vload(sv, first + 9, 0))
    a5 = fold8(vload(sv, first + 10, 0), vload(sv, first + 11, 0))
    a6 = fold8(vload(sv, first + 12, 0), vload(sv, first + 13, 0))
    a7 = fold8(vload(sv, first + 14, 0), vload(sv, first + 15, 0))
    b0 = fold4(a0, a1)
    b1 = fold4(a2, a3)
    b2 = fold4(a4, a5)
    b3 = fold4(a6, a7)
    return fold1(fold2(b0, b1), fold2(b2, b3))


@njit(inline="always", error_model="numpy")
def _ln_rows_short(xv, yv, wv, bv, tv, remv, eps, n, mean_out, rstd_out, r0, r1, s0):
    """:func:`_ln_rows` for rows of at most ``SHORT_ROW_MAX``, ``LANES`` rows at a time.

    A short row's time goes to the latency of its two lane trees and of its ``rstd``.
    Here each row's lane state is computed as on the row path and parked in a scratch
    block; the trees of ``LANES`` rows are then folded together (row ``i`` in lane ``i``)
    and ``rstd`` is computed for all of them in one vector: the same IEEE operations per
    row, so the same bits. A last partial block fills its unused lanes with its last row
    again (loops of constant length run faster) and stores that row once.
    """
    scratch = np.full((_S_ROWS, LANES), eps)
    sv = raw(scratch)
    counts = vload(tv, _TAB_COUNTS, 0)
    inv_n = splat(get(tv, _TAB_INV_N, 0))
    n_vec = splat(cast(n, eps))
    eps_vec = splat(eps)
    one = splat(cast(1.0, eps))
    last = r1 - 1
    for first in range(r0, r1, LANES):
        for i in range(LANES):
            row = min(first + i, last)
            shift = widen(get(xv, row, 0))
            put(sv, _S_SHIFT, i, shift)
            mean, m2 = _lane_moments(xv, row, n, shift, tv, remv)
            vstore(sv, mean, _S_MEAN + i, 0)
            vstore(sv, m2, _S_M2 + i, 0)
            vstore(sv, counts * mean, _S_WORK + i, 0)
        mu = _folded_tree_sums(sv, _S_WORK) * inv_n
        vstore(sv, mu, _S_MU, 0)
        for i in range(LANES):
            d = vload(sv, _S_MEAN + i, 0) - splat(get(sv, _S_MU, i))
            vstore(sv, fma(counts * d, d, vload(sv, _S_M2 + i, 0)), _S_WORK + i, 0)
        m2 = _folded_tree_sums(sv, _S_WORK)
        vstore(sv, one / sqrt(m2 / n_vec + eps_vec), _S_RSTD, 0)
        vstore(sv, vload(sv, _S_SHIFT, 0) + mu, _S_MEAN_OUT, 0)
        for i in range(min(LANES, r1 - first)):
            rstd = get(sv, _S_RSTD, i)
            _ln_row_out(xv, yv, first + i, n, get(sv, _S_SHIFT, i), get(sv, _S_MU, i), rstd,
                        wv, bv, False)
            put_stat(mean_out, s0 + (first - r0) + i, get(sv, _S_MEAN_OUT, i))
            put_stat(rstd_out, s0 + (first - r0) + i, rstd)
    alive(scratch)


@njit(error_model="numpy")
def _ln_rows_gathered(x, w, b, eps, y, mean_out, rstd_out, tab, r0, r1):
    """:func:`_ln_rows` for strided rows: ``LANES`` at a time through contiguous scratch
    rows, computed by the same compiled :func:`_ln_raw_rows`."""
    n = x.shape[1]
    xs = np.empty((LANES, n), dtype=x.dtype)
    ys = np.empty((LANES, n), dtype=y.dtype)
    xv, yv, wv, bv, tv = raw(xs), raw(ys), raw(w), raw(b), raw(tab)
    for first in range(r0, r1, LANES):
        count = min(LANES, r1 - first)
        for i in range(count):
            _copy_row(xs, i, x, first + i)
        _ln_raw_rows(xv, yv, wv, bv, tv, eps, n, runtime(False), mean_out, rstd_out,
                     runtime(0), count, first)
        for i in range(count):
            _copy_row(y, first + i, ys, i)
    alive(xs)
    alive(ys)


@njit(inline="always", error_model="numpy")
def _row_block(rows, n):
    return max(1, min(rows, WORK_ELEMENTS // max(n, 1)))


@njit(cache=True, error_model="numpy")
def ln_forward_serial(x, w, b, eps, y, mean_out, rstd_out, nt):
    """LayerNorm forward of a 2-D ``(rows, n)`` array on the calling thread."""
    tab = merge_weights(x.shape[1], eps)
    w, b = widened_pair(w, b)
    _ln_rows(x, w, b, eps, y, mean_out, rstd_out, tab, nt, runtime(0), x.shape[0])


@njit(cache=True, parallel=True, error_model="numpy")
def ln_forward_parallel(x, w, b, eps, y, mean_out, rstd_out, nt):
    """LayerNorm forward of a 2-D array, blocks of rows spread over Numba's threads."""
    rows = x.shape[0]
    tab = merge_weights(x.shape[1], eps)
    w, b = widened_pair(w, b)
    rb = _row_block(rows, x.shape[1])
    for blk in prange((rows + rb - 1) // rb):
        r0 = blk * rb
        _ln_rows(x, w, b, eps, y, mean_out, rstd_out, tab, nt, r0, min(rows, r0 + rb))


# --------------------------------------------------------------------------- column path


@njit(error_model="numpy")
def _col_chunk(x2, row0, c0, g, kv, inv, pad, zero):
    # Leaves written out: a helper called with the constants 0 .. 7 would be compiled
    # once per constant.
    return _chunk_tree(
        load2(x2, row0, c0) - kv if g > 0 else pad,
        load2(x2, row0 + LANES, c0) - kv if g > 1 else pad,
        load2(x2, row0 + 2 * LANES, c0) - kv if g > 2 else pad,
        load2(x2, row0 + 3 * LANES, c0) - kv if g > 3 else pad,
        load2(x2, row0 + 4 * LANES, c0) - kv if g > 4 else pad,
        load2(x2, row0 + 5 * LANES, c0) - kv if g > 5 else pad,
        load2(x2, row0 + 6 * LANES, c0) - kv if g > 6 else pad,
        load2(x2, row0 + 7 * LANES, c0) - kv if g > 7 else pad,
        g, inv, zero)


@njit(inline="always", error_model="numpy")
def _lane_tree_sum(lt):
    """Row 0 of ``lt`` becomes the sum of its LANES rows, in :func:`_tree_sum`'s tree."""
    h = LANES // 2
    while h >= 1:
        for j in range(h):
            store2(lt, load2(lt, j, 0) + load2(lt, j + h, 0), j, 0)
        h = h // 2


@njit(inline="always", error_model="numpy")
def _ln_cols(x2, y2, c0, w, b, eps, tab, lm, lm2, lt, cs, mean_out, rstd_out, r0, valid):
    """The row arithmetic for columns ``c0 .. c0+WIDTH`` of ``x2`` (unit column stride).

    Writes the outputs of the first ``valid`` columns' statistics at ``r0 ..``.
    """
    n = x2.shape[0]
    like = eps
    kv = load2(x2, 0, c0)
    zero = splat(cast(0.0, like))
    pad = splat(cast(-0.0, like))
    for j in range(LANES):
        store2(lm, zero, j, 0)
        store2(lm2, zero, j, 0)
    groups = n // LANES
    full = groups // PER_LANE
    inv_full = splat(cast(1.0, like) / cast(PER_LANE, like))
    for c in range(full):
        f, cc = _chunk_weights(c, PER_LANE, like)
        fv = splat(f)
        cv = splat(cc)
        for j in range(LANES):
            m, q = _col_chunk(x2, c * CHUNK + j, c0, PER_LANE, kv, inv_full, pad, zero)
            mean, m2 = _merge(load2(lm, j, 0), load2(lm2, j, 0), m, q, fv, cv)
            store2(lm, mean, j, 0)
            store2(lm2, m2, j, 0)
    g = groups - full * PER_LANE
    if g > 0:
        f, cc = _chunk_weights(full, g, like)
        fv = splat(f)
        cv = splat(cc)
        inv = splat(cast(1.0, like) / cast(g, like))
        for j in range(LANES):
            m, q = _col_chunk(x2, full * CHUNK + j, c0, g, kv, inv, pad, zero)
            mean, m2 = _merge(load2(lm, j, 0), load2(lm2, j, 0), m, q, fv, cv)
            store2(lm, mean, j, 0)
            store2(lm2, m2, j, 0)
    start = groups * LANES
    r = n - start
    if r > 0:
        for j in range(LANES):
            v = (load2(x2, start + j, c0) - kv) if j < r else (kv - kv)
            d = v - v
            mean, m2 = _merge(load2(lm, j, 0), load2(lm2, j, 0), v, d * d,
                              splat(tab[_TAB_REM_F, j]), splat(tab[_TAB_REM_C, j]))
            store2(lm, mean, j, 0)
            store2(lm2, m2, j, 0)
    # Lanes to columns: the row path's two tree sums, lane j of a vector being row j of
    # the lane-state tiles here.
    for j in range(LANES):
        store2(lt, splat(tab[_TAB_COUNTS, j]) * load2(lm, j, 0), j, 0)
    _lane_tree_sum(lt)
    mu = load2(lt, 0, 0) * splat(tab[_TAB_INV_N, 0])
    for j in range(LANES):
        d = load2(lm, j, 0) - mu
        store2(lt, fma(splat(tab[_TAB_COUNTS, j]) * d, d, load2(lm2, j, 0)), j, 0)
    _lane_tree_sum(lt)
    store2(cs, mu, 0, 0)
    # cs rows: 0 shifted mean, 1 rstd (per column)
    for k in range(LANES):
        mean = cs[0, k]
        mo, rstd = _finish(lane(kv, k), mean, lt[0, k], n, eps)
        cs[0, k] = mean
        cs[1, k] = rstd
        if k < valid:
            mean_out[r0 + k] = mo
            rstd_out[r0 + k] = rstd
    mv = load2(cs, 0, 0)
    rv = load2(cs, 1, 0)
    for i in range(n):
        v = ((load2(x2, i, c0) - kv) - mv) * rv
        v = fma(v, splat(widen(w[i])), splat(widen(b[i])))
        store2(y2, v, i, c0)


@njit(inline="always", error_model="numpy")
def _tile_columns(n):
    # Columns per work item: several WIDTH blocks, so each visit of a (far away) row
    # reads a few contiguous cache lines, while the tile stays within L2.
    return WIDTH * max(1, min(8, 4096 // max(n, 1)))


@njit(inline="always", error_model="numpy")
def _load_tile(x2, xt, c0, valid, unit):
    """Copy columns ``c0 .. c0+valid`` of ``x2`` into ``xt``, in row order.

    Rows are far apart in memory and a sequential walk is what the hardware prefetchers
    follow. Columns past ``valid`` in the last block repeat the last valid column.
    """
    full = valid // WIDTH if unit else 0
    for i in range(x2.shape[0]):
        for s in range(full):
            copy2(xt, i, s * WIDTH, x2, i, c0 + s * WIDTH)
        for k in range(full * WIDTH, xt.shape[1]):
            xt[i, k] = x2[i, c0 + min(k, valid - 1)]


@njit(inline="always", error_model="numpy")
def _store_tile(yt, y2, c0, valid, unit):
    full = valid // WIDTH if unit else 0
    for i in range(y2.shape[0]):
        for s in range(full):
            copy2(y2, i, c0 + s * WIDTH, yt, i, s * WIDTH)
        for k in range(full * WIDTH, valid):
            y2[i, c0 + k] = yt[i, k]


@njit(error_model="numpy")
def _ln_col_item(x, w, b, eps, y, mean_out, rstd_out, tab, scratch, tiles, item):
    lm, lm2, lt, cs = scratch
    xt, yt = tiles
    inner = x.shape[2]
    tw = xt.shape[1]
    per = (inner + tw - 1) // tw
    o = item // per
    c0 = (item % per) * tw
    valid = min(tw, inner - c0)
    unit = x.strides[2] == x.itemsize and y.strides[2] == y.itemsize
    _load_tile(x[o], xt, c0, valid, unit)
    for s in range(0, valid, WIDTH):
        _ln_cols(xt, yt, s, w, b, eps, tab, lm, lm2, lt, cs, mean_out, rstd_out,
                 o * inner + c0 + s, min(WIDTH, valid - s))
    _store_tile(yt, y[o], c0, valid, unit)


@njit(inline="always", error_model="numpy")
def _col_scratch(x, y, acc):
    n = x.shape[1]
    tw = _tile_columns(n)
    scratch = (np.empty((LANES, WIDTH), dtype=acc), np.empty((LANES, WIDTH), dtype=acc),
               np.empty((LANES, WIDTH), dtype=acc), np.empty((2, WIDTH), dtype=acc))
    tiles = (np.empty((n, tw), dtype=x.dtype), np.empty((n, tw), dtype=y.dtype))
    return scratch, tiles


@njit(inline="always", error_model="numpy")
def _col_items(x):
    tw = _tile_columns(x.shape[1])
    return x.shape[0] * ((x.shape[2] + tw - 1) // tw), max(1, WORK_ELEMENTS // (tw * x.shape[1]))


@njit(cache=True, error_model="numpy")
def ln_forward_cols_serial(x, w, b, eps, y, mean_out, rstd_out):
    """LayerNorm forward over axis 1 of a 3-D ``(outer, n, inner)`` array."""
    tab = merge_weights(x.shape[1], eps)
    items, _ = _col_items(x)
    scratch, tiles = _col_scratch(x, y, mean_out.dtype)
    for item in range(items):
        _ln_col_item(x, w, b, eps, y, mean_out, rstd_out, tab, scratch, tiles, item)


@njit(cache=True, parallel=True, error_model="numpy")
def ln_forward_cols_parallel(x, w, b, eps, y, mean_out, rstd_out):
    """Channels-first LayerNorm forward, column tiles spread over Numba's threads."""
    tab = merge_weights(x.shape[1], eps)
    items, per_work = _col_items(x)
    for wk in prange((items + per_work - 1) // per_work):
        scratch, tiles = _col_scratch(x, y, mean_out.dtype)
        for item in range(wk * per_work, min(items, (wk + 1) * per_work)):
            _ln_col_item(x, w, b, eps, y, mean_out, rstd_out, tab, scratch, tiles, item)


# --------------------------------------------------------------------------- RMSNorm


@njit(error_model="numpy")
def _tree_sum(v):
    v = v + down8(v)
    v = v + down4(v)
    v = v + down2(v)
    v = v + down1(v)
    return lane(v, 0)


@njit(error_model="numpy")
def _row_square_chunk(xr, r, base, g, zero):
    # Leaves written out: a helper called with the constants 0 .. 7 would be compiled
    # once per constant.
    return _square_tree(
        vload(xr, r, base) if g > 0 else zero,
        vload(xr, r, base + LANES) if g > 1 else zero,
        vload(xr, r, base + 2 * LANES) if g > 2 else zero,
        vload(xr, r, base + 3 * LANES) if g > 3 else zero,
        vload(xr, r, base + 4 * LANES) if g > 4 else zero,
        vload(xr, r, base + 5 * LANES) if g > 5 else zero,
        vload(xr, r, base + 6 * LANES) if g > 6 else zero,
        vload(xr, r, base + 7 * LANES) if g > 7 else zero)


@njit(inline="always", error_model="numpy")
def _row_sum_squares(xr, r, n, like, rem):
    zero = splat(cast(0.0, like))
    acc = zero
    groups = n // LANES
    full = groups // PER_LANE
    for c in range(full):
        acc = acc + _row_square_chunk(xr, r, c * CHUNK, PER_LANE, zero)
    g = groups - full * PER_LANE
    if g > 0:
        acc = acc + _row_square_chunk(xr, r, full * CHUNK, g, zero)
    body = groups * LANES
    if body < n:
        for j in range(LANES):
            put(rem, 0, j, widen(get(xr, r, body + j)) if body + j < n else cast(0.0, like))
        v = vload(rem, 0, 0)
        acc = acc + v * v
    return _tree_sum(acc)


@njit(inline="always", error_model="numpy")
def _rms_row_out(xr, yr, r, n, rstd, w, nt):
    rv = splat(rstd)
    i = 0
    if nt:
        align = min(64, LANES * itemsize(yr))
        while i < n and vaddress(yr, r, i) % align != 0:
            v = widen(get(xr, r, i)) * rstd
            v = times_w(v, w, i)
            put(yr, r, i, narrow(v, yr))
            i += 1
    body = i + (n - i) // LANES * LANES
    if nt:
        while i < body:
            v = vload(xr, r, i) * rv
            v = times_w(v, w, i)
            vstore_nt(yr, v, r, i)
            i += LANES
    else:
        while i < body:
            v = vload(xr, r, i) * rv
            v = times_w(v, w, i)
            vstore(yr, v, r, i)
            i += LANES
    while i < n:
        v = widen(get(xr, r, i)) * rstd
        v = times_w(v, w, i)
        put(yr, r, i, narrow(v, yr))
        i += 1


@njit(error_model="numpy")
def _rms_rows(x, w, eps, y, rstd_out, nt, r0, r1):
    if not (_unit(x) and _unit(y)):
        _rms_rows_gathered(x, w, eps, y, rstd_out, r0, r1)
        return
    n = x.shape[1]
    rem = np.full((1, LANES), eps)
    xv, yv, wv, remv = raw(x), raw(y), raw(w), raw(rem)
    for r in range(r0, r1):
        rstd = _rms_rstd(xv, r, n, eps, remv)
        _rms_row_out(xv, yv, r, n, rstd, wv, nt)
        put_stat(rstd_out, r, rstd)
    alive(rem)
    if nt:
        store_fence()


@njit(error_model="numpy")
def _rms_rows_gathered(x, w, eps, y, rstd_out, r0, r1):
    """:func:`_rms_rows` for strided rows, through a contiguous scratch row."""
    n = x.shape[1]
    rem = np.full((1, LANES), eps)
    xs = np.empty((1, n), dtype=x.dtype)
    ys = np.empty((1, n), dtype=y.dtype)
    xv, yv, wv, remv = raw(xs), raw(ys), raw(w), raw(rem)
    for r in range(r0, r1):
        _copy_row(xs, 0, x, r)
        rstd = _rms_rstd(xv, runtime(0), n, eps, remv)
        _rms_row_out(xv, yv, runtime(0), n, rstd, wv, False)
        _copy_row(y, r, ys, 0)
        put_stat(rstd_out, r, rstd)
    alive(rem)


@njit(inline="always", error_model="numpy")
def _rms_rstd(xr, r, n, eps, rem):
    ss = _row_sum_squares(xr, r, n, eps, rem)
    return cast(1.0, eps) / np.sqrt(ss / cast(n, eps) + eps)


@njit(cache=True, error_model="numpy")
def rms_forward_serial(x, w, eps, y, rstd_out, nt):
    """RMSNorm forward of a 2-D array on the calling thread."""
    _rms_rows(x, widened(w), eps, y, rstd_out, nt, runtime(0), x.shape[0])


@njit(cache=True, parallel=True, error_model="numpy")
def rms_forward_parallel(x, w, eps, y, rstd_out, nt):
    """RMSNorm forward of a 2-D array, blocks of rows spread over Numba's threads."""
    rows = x.shape[0]
    w = widened(w)
    rb = _row_block(rows, x.shape[1])
    for blk in prange((rows + rb - 1) // rb):
        r0 = blk * rb
        _rms_rows(x, w, eps, y, rstd_out, nt, r0, min(rows, r0 + rb))


@njit(error_model="numpy")
def _col_square_chunk(x2, row0, c0, g, zero):
    # Leaves written out: a helper called with the constants 0 .. 7 would be compiled
    # once per constant.
    return _square_tree(
        load2(x2, row0, c0) if g > 0 else zero,
        load2(x2, row0 + LANES, c0) if g > 1 else zero,
        load2(x2, row0 + 2 * LANES, c0) if g > 2 else zero,
        load2(x2, row0 + 3 * LANES, c0) if g > 3 else zero,
        load2(x2, row0 + 4 * LANES, c0) if g > 4 else zero,
        load2(x2, row0 + 5 * LANES, c0) if g > 5 else zero,
        load2(x2, row0 + 6 * LANES, c0) if g > 6 else zero,
        load2(x2, row0 + 7 * LANES, c0) if g > 7 else zero)


@njit(inline="always", error_model="numpy")
def _rms_cols(x2, y2, c0, w, eps, lanes, cs, rstd_out, r0, valid):
    n = x2.shape[0]
    zero = splat(cast(0.0, eps))
    for j in range(LANES):
        store2(lanes, zero, j, 0)
    groups = n // LANES
    full = groups // PER_LANE
    for c in range(full):
        for j in range(LANES):
            sq = _col_square_chunk(x2, c * CHUNK + j, c0, PER_LANE, zero)
            store2(lanes, load2(lanes, j, 0) + sq, j, 0)
    g = groups - full * PER_LANE
    if g > 0:
        for j in range(LANES):
            sq = _col_square_chunk(x2, full * CHUNK + j, c0, g, zero)
            store2(lanes, load2(lanes, j, 0) + sq, j, 0)
    body = groups * LANES
    if body < n:
        for j in range(LANES):
            v = load2(x2, body + j, c0) if body + j < n else zero
            store2(lanes, load2(lanes, j, 0) + v * v, j, 0)
    h = LANES // 2
    while h >= 1:
        for j in range(h):
            store2(lanes, load2(lanes, j, 0) + load2(lanes, j + h, 0), j, 0)
        h = h // 2
    one = cast(1.0, eps)
    for k in range(WIDTH):
        rstd = one / np.sqrt(lanes[0, k] / cast(n, eps) + eps)
        cs[1, k] = rstd
        if k < valid:
            rstd_out[r0 + k] = rstd
    rv = load2(cs, 1, 0)
    for i in range(n):
        v = load2(x2, i, c0) * rv
        v = v * splat(widen(w[i]))
        store2(y2, v, i, c0)


@njit(error_model="numpy")
def _rms_col_item(x, w, eps, y, rstd_out, scratch, tiles, item):
    lanes, _, _, cs = scratch
    xt, yt = tiles
    inner = x.shape[2]
    tw = xt.shape[1]
    per = (inner + tw - 1) // tw
    o = item // per
    c0 = (item % per) * tw
    valid = min(tw, inner - c0)
    unit = x.strides[2] == x.itemsize and y.strides[2] == y.itemsize
    _load_tile(x[o], xt, c0, valid, unit)
    for s in range(0, valid, WIDTH):
        _rms_cols(xt, yt, s, w, eps, lanes, cs, rstd_out, o * inner + c0 + s,
                  min(WIDTH, valid - s))
    _store_tile(yt, y[o], c0, valid, unit)


@njit(cache=True, error_model="numpy")
def rms_forward_cols_serial(x, w, eps, y, rstd_out):
    """RMSNorm forward over axis 1 of a 3-D array."""
    items, _ = _col_items(x)
    scratch, tiles = _col_scratch(x, y, rstd_out.dtype)
    for item in range(items):
        _rms_col_item(x, w, eps, y, rstd_out, scratch, tiles, item)


@njit(cache=True, parallel=True, error_model="numpy")
def rms_forward_cols_parallel(x, w, eps, y, rstd_out):
    """Channels-first RMSNorm forward, column tiles spread over threads."""
    items, per_work = _col_items(x)
    for wk in prange((items + per_work - 1) // per_work):
        scratch, tiles = _col_scratch(x, y, rstd_out.dtype)
        for item in range(wk * per_work, min(items, (wk + 1) * per_work)):
            _rms_col_item(x, w, eps, y, rstd_out, scratch, tiles, item)


# --------------------------------------------------------------------------- backward


@njit(inline="always", error_model="numpy")
def _ln_bwd_means(gyr, xr, r, n, mean, rstd, w, rg, rx):
    """(mean of g, mean of g * xhat) of row ``r``, ``g = dy * w``."""
    like = mean
    zero = splat(cast(0.0, like))
    mv = splat(mean)
    rv = splat(rstd)
    acc_g = zero
    acc_gx = zero
    body = n - n % LANES
    for i in range(0, body, LANES):
        g = vload(gyr, r, i)
        g = times_w(g, w, i)
        xh = (vload(xr, r, i) - mv) * rv
        acc_g = acc_g + g
        acc_gx = acc_gx + g * xh
    if body < n:
        for j in range(LANES):
            if body + j < n:
                gj = widen(get(gyr, r, body + j))
                gj = times_w(gj, w, body + j)
                put(rg, 0, j, gj)
                put(rx, 0, j, widen(get(xr, r, body + j)))
            else:
                put(rg, 0, j, cast(0.0, like))
                put(rx, 0, j, mean)
        g = vload(rg, 0, 0)
        xh = (vload(rx, 0, 0) - mv) * rv
        acc_g = acc_g + g
        acc_gx = acc_gx + g * xh
    inv_n = cast(1.0, like) / cast(n, like)
    return _tree_sum(acc_g) * inv_n, _tree_sum(acc_gx) * inv_n


@njit(inline="always", error_model="numpy")
def _ln_bwd_rows_out(gyr, xr, gxr, ra, rb, two, n, sa, sb, w, dw, db):
    """grad_x of rows ``ra`` and (if ``two``) ``rb``; their terms added to dw/db in order.

    ``sa``/``sb`` are (mean, rstd, mean_g, mean_gx) of each row. Two rows per pass read
    and write the partial sums once for both: ``dw = (dw + a) + b`` is exactly what two
    single-row passes compute.
    """
    mva, rva, mga, mgxa = splat(sa[0]), splat(sa[1]), splat(sa[2]), splat(sa[3])
    mvb, rvb, mgb, mgxb = splat(sb[0]), splat(sb[1]), splat(sb[2]), splat(sb[3])
    body = n - n % LANES
    for i in range(0, body, LANES):
        dya = vload(gyr, ra, i)
        xha = (vload(xr, ra, i) - mva) * rva
        vstore(gxr, ((times_w(dya, w, i) - mga) - xha * mgxa) * rva, ra, i)
        tw = vload(dw, 0, i) + dya * xha
        tb = vload(db, 0, i) + dya
        if two:
            dyb = vload(gyr, rb, i)
            xhb = (vload(xr, rb, i) - mvb) * rvb
            vstore(gxr, ((times_w(dyb, w, i) - mgb) - xhb * mgxb) * rvb, rb, i)
            tw = tw + dyb * xhb
            tb = tb + dyb
        vstore(dw, tw, 0, i)
        vstore(db, tb, 0, i)
    for i in range(body, n):
        dya = widen(get(gyr, ra, i))
        xha = (widen(get(xr, ra, i)) - sa[0]) * sa[1]
        put(gxr, ra, i, narrow(((times_w(dya, w, i) - sa[2]) - xha * sa[3]) * sa[1], gxr))
        tw = get(dw, 0, i) + dya * xha
        tb = get(db, 0, i) + dya
        if two:
            dyb = widen(get(gyr, rb, i))
            xhb = (widen(get(xr, rb, i)) - sb[0]) * sb[1]
            put(gxr, rb, i, narrow(((times_w(dyb, w, i) - sb[2]) - xhb * sb[3]) * sb[1], gxr))
            tw = tw + dyb * xhb
            tb = tb + dyb
        put(dw, 0, i, tw)
        put(db, 0, i, tb)


@njit(inline="always", error_model="numpy")
def _ln_bwd_vector(gyr, xr, gxr, r, i, w, mv, rv, mgv, mgxv, dwk, dbk):
    """grad_x of one vector of row ``r``; returns the updated dw/db partial vectors."""
    dy = vload(gyr, r, i)
    xh = (vload(xr, r, i) - mv) * rv
    vstore(gxr, ((times_w(dy, w, i) - mgv) - xh * mgxv) * rv, r, i)
    return dwk + dy * xh, dbk + dy


@njit(error_model="numpy")
def _ln_bwd_rows_short(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0, r1):
    """:func:`_ln_bwd_rows` for contiguous rows shorter than ``5 * LANES`` (four vectors + tail).

    The block's dw/db partial vectors stay in registers across its rows instead of being
    read and written per row (the same additions in the same order, so the same bits).
    """
    n = x.shape[1]
    nv = n // LANES
    acc = mean_in.dtype
    rg = np.empty((1, LANES), dtype=acc)
    rx = np.empty((1, LANES), dtype=acc)
    xv, gyv, gxv, wv, rgv, rxv = raw(x), raw(gy), raw(gx), raw(w), raw(rg), raw(rx)
    dw = raw(partials[0, blk])
    db = raw(partials[1, blk])
    zero = splat(cast(0.0, mean_in[0]))
    dw0 = vload(dw, 0, 0) if nv > 0 else zero
    db0 = vload(db, 0, 0) if nv > 0 else zero
    dw1 = vload(dw, 0, LANES) if nv > 1 else zero
    db1 = vload(db, 0, LANES) if nv > 1 else zero
    dw2 = vload(dw, 0, 2 * LANES) if nv > 2 else zero
    db2 = vload(db, 0, 2 * LANES) if nv > 2 else zero
    dw3 = vload(dw, 0, 3 * LANES) if nv > 3 else zero
    db3 = vload(db, 0, 3 * LANES) if nv > 3 else zero
    for r in range(r0, r1):
        m, s = mean_in[r], rstd_in[r]
        mg, mgx = _ln_bwd_means(gyv, xv, r, n, m, s, wv, rgv, rxv)
        mv, rv, mgv, mgxv = splat(m), splat(s), splat(mg), splat(mgx)
        if nv > 0:
            dw0, db0 = _ln_bwd_vector(gyv, xv, gxv, r, 0, wv, mv, rv, mgv, mgxv, dw0, db0)
        if nv > 1:
            dw1, db1 = _ln_bwd_vector(gyv, xv, gxv, r, LANES, wv, mv, rv, mgv, mgxv, dw1,
                                      db1)
        if nv > 2:
            dw2, db2 = _ln_bwd_vector(gyv, xv, gxv, r, 2 * LANES, wv, mv, rv, mgv, mgxv,
                                      dw2, db2)
        if nv > 3:
            dw3, db3 = _ln_bwd_vector(gyv, xv, gxv, r, 3 * LANES, wv, mv, rv, mgv, mgxv,
                                      dw3, db3)
        for i in range(nv * LANES, n):
            dy = widen(get(gyv, r, i))
            xh = (widen(get(xv, r, i)) - m) * s
            put(gxv, r, i, narrow(((times_w(dy, wv, i) - mg) - xh * mgx) * s, gxv))
            put(dw, 0, i, get(dw, 0, i) + dy * xh)
            put(db, 0, i, get(db, 0, i) + dy)
    if nv > 0:
        vstore(dw, dw0, 0, 0)
        vstore(db, db0, 0, 0)
    if nv > 1:
        vstore(dw, dw1, 0, LANES)
        vstore(db, db1, 0, LANES)
    if nv > 2:
        vstore(dw, dw2, 0, 2 * LANES)
        vstore(db, db2, 0, 2 * LANES)
    if nv > 3:
        vstore(dw, dw3, 0, 3 * LANES)
        vstore(db, db3, 0, 3 * LANES)
    alive(rg)
    alive(rx)


@njit(error_model="numpy")
def _ln_bwd_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0, r1):
    n = x.shape[1]
    if n < 5 * LANES and _unit(x) and _unit(gy) and _unit(gx):
        _ln_bwd_rows_short(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0, r1)
        return
    acc = mean_in.dtype
    rg = np.empty((1, LANES), dtype=acc)
    rx = np.empty((1, LANES), dtype=acc)
    strided = not (_unit(x) and _unit(gy) and _unit(gx))
    xs = np.empty((2, n if strided else 0), dtype=x.dtype)
    gys = np.empty((2, n if strided else 0), dtype=gy.dtype)
    gxs = np.empty((2, n if strided else 0), dtype=gx.dtype)
    xv, gyv, gxv, xsv, gysv, gxsv = raw(x), raw(gy), raw(gx), raw(xs), raw(gys), raw(gxs)
    wv, rgv, rxv = raw(w), raw(rg), raw(rx)
    dw = raw(partials[0, blk])
    db = raw(partials[1, blk])
    a, b, c = (gysv, xsv, gxsv) if strided else (gyv, xv, gxv)
    # Long rows in pairs (a last single row alone): the parameter-gradient partial sums,
    # too long for L1 then, are read and written once per pair. Each row's arithmetic is
    # the same either way.
    step = 2 if n >= PAIR_MIN_N else 1
    for r in range(r0, r1, step):
        two = step == 2 and r + 1 < r1
        if strided:
            _copy_row(xs, 0, x, r)
            _copy_row(gys, 0, gy, r)
            if two:
                _copy_row(xs, 1, x, r + 1)
                _copy_row(gys, 1, gy, r + 1)
        ra = 0 if strided else r
        rb = ra + 1 if two else ra
        ma, sa_ = mean_in[r], rstd_in[r]
        mb, sb_ = mean_in[r + 1] if two else ma, rstd_in[r + 1] if two else sa_
        ga, gxa = _ln_bwd_means(a, b, ra, n, ma, sa_, wv, rgv, rxv)
        gb, gxb = _ln_bwd_means(a, b, rb, n, mb, sb_, wv, rgv, rxv) if two else (ga, gxa)
        _ln_bwd_rows_out(a, b, c, ra, rb, two, n, (ma, sa_, ga, gxa), (mb, sb_, gb, gxb),
                         wv, dw, db)
        if strided:
            _copy_row(gx, r, gxs, 0)
            if two:
                _copy_row(gx, r + 1, gxs, 1)
    alive(rg)
    alive(rx)
    alive(xs)
    alive(gys)
    alive(gxs)


@njit(cache=True, error_model="numpy")
def ln_backward_serial(gy, x, mean_in, rstd_in, w, gx, partials, block_rows):
    """LayerNorm backward of 2-D arrays on the calling thread (same blocks as parallel)."""
    rows = x.shape[0]
    w = widened(w)
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _ln_bwd_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                     min(rows, r0 + block_rows))


@njit(cache=True, parallel=True, error_model="numpy")
def ln_backward_parallel(gy, x, mean_in, rstd_in, w, gx, partials, block_rows):
    """LayerNorm backward of 2-D arrays, row blocks spread over threads."""
    rows = x.shape[0]
    w = widened(w)
    for blk in prange(partials.shape[1]):
        r0 = blk * block_rows
        _ln_bwd_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                     min(rows, r0 + block_rows))


@njit(inline="always", error_model="numpy")
def _rms_bwd_mean(gyr, xr, r, n, rstd, w, rg, rx):
    """Mean of ``g * xhat`` of row ``r`` (``g = dy * w``, ``xhat = x * rstd``)."""
    like = rstd
    zero = splat(cast(0.0, like))
    rv = splat(rstd)
    acc = zero
    body = n - n % LANES
    for i in range(0, body, LANES):
        g = vload(gyr, r, i)
        g = times_w(g, w, i)
        acc = acc + g * (vload(xr, r, i) * rv)
    if body < n:
        for j in range(LANES):
            if body + j < n:
                gj = widen(get(gyr, r, body + j))
                gj = times_w(gj, w, body + j)
                put(rg, 0, j, gj)
                put(rx, 0, j, widen(get(xr, r, body + j)))
            else:
                put(rg, 0, j, cast(0.0, like))
                put(rx, 0, j, cast(0.0, like))
        acc = acc + vload(rg, 0, 0) * (vload(rx, 0, 0) * rv)
    return _tree_sum(acc) * (cast(1.0, like) / cast(n, like))


@njit(inline="always", error_model="numpy")
def _rms_bwd_rows_out(gyr, xr, gxr, ra, rb, two, n, sa, sb, w, dw):
    """grad_x of rows ``ra`` and (if ``two``) ``rb``, like :func:`_ln_bwd_rows_out`.

    ``sa``/``sb`` are (rstd, mean_gx) of each row.
    """
    rva, mgxa = splat(sa[0]), splat(sa[1])
    rvb, mgxb = splat(sb[0]), splat(sb[1])
    body = n - n % LANES
    for i in range(0, body, LANES):
        dya = vload(gyr, ra, i)
        xha = vload(xr, ra, i) * rva
        vstore(gxr, (times_w(dya, w, i) - xha * mgxa) * rva, ra, i)
        tw = vload(dw, 0, i) + dya * xha
        if two:
            dyb = vload(gyr, rb, i)
            xhb = vload(xr, rb, i) * rvb
            vstore(gxr, (times_w(dyb, w, i) - xhb * mgxb) * rvb, rb, i)
            tw = tw + dyb * xhb
        vstore(dw, tw, 0, i)
    for i in range(body, n):
        dya = widen(get(gyr, ra, i))
        xha = widen(get(xr, ra, i)) * sa[0]
        put(gxr, ra, i, narrow((times_w(dya, w, i) - xha * sa[1]) * sa[0], gxr))
        tw = get(dw, 0, i) + dya * xha
        if two:
            dyb = widen(get(gyr, rb, i))
            xhb = widen(get(xr, rb, i)) * sb[0]
            put(gxr, rb, i, narrow((times_w(dyb, w, i) - xhb * sb[1]) * sb[0], gxr))
            tw = tw + dyb * xhb
        put(dw, 0, i, tw)


@njit(error_model="numpy")
def _rms_bwd_rows(gy, x, rstd_in, w, gx, partials, blk, r0, r1):
    n = x.shape[1]
    acc = rstd_in.dtype
    rg = np.empty((1, LANES), dtype=acc)
    rx = np.empty((1, LANES), dtype=acc)
    strided = not (_unit(x) and _unit(gy) and _unit(gx))
    xs = np.empty((2, n if strided else 0), dtype=x.dtype)
    gys = np.empty((2, n if strided else 0), dtype=gy.dtype)
    gxs = np.empty((2, n if strided else 0), dtype=gx.dtype)
    xv, gyv, gxv, xsv, gysv, gxsv = raw(x), raw(gy), raw(gx), raw(xs), raw(gys), raw(gxs)
    wv, rgv, rxv = raw(w), raw(rg), raw(rx)
    dw = raw(partials[0, blk])
    a, b, c = (gysv, xsv, gxsv) if strided else (gyv, xv, gxv)
    step = 2 if n >= PAIR_MIN_N else 1
    for r in range(r0, r1, step):
        two = step == 2 and r + 1 < r1
        if strided:
            _copy_row(xs, 0, x, r)
            _copy_row(gys, 0, gy, r)
            if two:
                _copy_row(xs, 1, x, r + 1)
                _copy_row(gys, 1, gy, r + 1)
        ra = 0 if strided else r
        rb = ra + 1 if two else ra
        sa_ = rstd_in[r]
        sb_ = rstd_in[r + 1] if two else sa_
        ma = _rms_bwd_mean(a, b, ra, n, sa_, wv, rgv, rxv)
        mb = _rms_bwd_mean(a, b, rb, n, sb_, wv, rgv, rxv) if two else ma
        _rms_bwd_rows_out(a, b, c, ra, rb, two, n, (sa_, ma), (sb_, mb), wv, dw)
        if strided:
            _copy_row(gx, r, gxs, 0)
            if two:
                _copy_row(gx, r + 1, gxs, 1)
    alive(rg)
    alive(rx)
    alive(xs)
    alive(gys)
    alive(gxs)


@njit(cache=True, error_model="numpy")
def rms_backward_serial(gy, x, rstd_in, w, gx, partials, block_rows):
    """RMSNorm backward of 2-D arrays on the calling thread."""
    rows = x.shape[0]
    w = widened(w)
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _rms_bwd_rows(gy, x, rstd_in, w, gx, partials, blk, r0, min(rows, r0 + block_rows))


@njit(cache=True, parallel=True, error_model="numpy")
def rms_backward_parallel(gy, x, rstd_in, w, gx, partials, block_rows):
    """RMSNorm backward of 2-D arrays, row blocks spread over threads."""
    rows = x.shape[0]
    w = widened(w)
    for blk in prange(partials.shape[1]):
        r0 = blk * block_rows
        _rms_bwd_rows(gy, x, rstd_in, w, gx, partials, blk, r0, min(rows, r0 + block_rows))


@njit(error_model="numpy")
def _bwd_col_item(gy, x, mean_in, rstd_in, w, gx, partials, item, rms, cols):
    n = x.shape[1]
    inner = x.shape[2]
    per = (inner + COL_BLOCK - 1) // COL_BLOCK
    o = item // per
    c0 = (item % per) * COL_BLOCK
    xs, gys, gxs, rg, rx = cols
    xsv, gysv, gxsv, rgv, rxv = raw(xs), raw(gys), raw(gxs), raw(rg), raw(rx)
    wv = raw(w)
    dw = raw(partials[0, item])
    db = raw(partials[partials.shape[0] - 1, item])
    for c in range(c0, min(inner, c0 + COL_BLOCK)):
        r = o * inner + c
        for i in range(n):
            xs[0, i] = x[o, i, c]
            gys[0, i] = gy[o, i, c]
        if rms:
            sd = rstd_in[r]
            mgx = _rms_bwd_mean(gysv, xsv, 0, n, sd, wv, rgv, rxv)
            _rms_bwd_rows_out(gysv, xsv, gxsv, 0, 0, False, n, (sd, mgx), (sd, mgx), wv, dw)
        else:
            m, sd = mean_in[r], rstd_in[r]
            mg, mgx = _ln_bwd_means(gysv, xsv, 0, n, m, sd, wv, rgv, rxv)
            _ln_bwd_rows_out(gysv, xsv, gxsv, 0, 0, False, n, (m, sd, mg, mgx),
                             (m, sd, mg, mgx), wv, dw, db)
        for i in range(n):
            gx[o, i, c] = gxs[0, i]


@njit(inline="always", error_model="numpy")
def _bwd_col_scratch(gy, x, gx, acc):
    n = x.shape[1]
    return (np.empty((1, n), dtype=x.dtype), np.empty((1, n), dtype=gy.dtype),
            np.empty((1, n), dtype=gx.dtype), np.empty((1, LANES), dtype=acc),
            np.empty((1, LANES), dtype=acc))


@njit(cache=True, error_model="numpy")
def backward_cols_serial(gy, x, mean_in, rstd_in, w, gx, partials, rms):
    """Backward over axis 1 of 3-D arrays; one partial per (outer, COL_BLOCK columns).

    ``rms`` selects RMSNorm (``mean_in`` is then ignored and ``partials`` has one row).
    """
    cols = _bwd_col_scratch(gy, x, gx, rstd_in.dtype)
    for item in range(partials.shape[1]):
        _bwd_col_item(gy, x, mean_in, rstd_in, w, gx, partials, item, rms, cols)


@njit(cache=True, parallel=True, error_model="numpy")
def backward_cols_parallel(gy, x, mean_in, rstd_in, w, gx, partials, rms):
    """Parallel :func:`backward_cols_serial` (same partial blocks)."""
    for item in prange(partials.shape[1]):
        cols = _bwd_col_scratch(gy, x, gx, rstd_in.dtype)
        _bwd_col_item(gy, x, mean_in, rstd_in, w, gx, partials, item, rms, cols)


@njit(cache=True, error_model="numpy")
def sum_blocks(partials):
    """Sum ``partials[:, blk, :]`` over ``blk`` in increasing order (deterministic)."""
    count, blocks, n = partials.shape
    total = partials[:, 0, :].copy()
    for c in range(count):
        for blk in range(1, blocks):
            for i in range(n):
                total[c, i] = total[c, i] + partials[c, blk, i]
    return total
