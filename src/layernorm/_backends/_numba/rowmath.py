"""Row arithmetic shared by every Numba kernel: constants, widening, affine, moments.

Every kernel computes each row with one fixed sequence of IEEE operations (the *row
arithmetic* below), whatever the row's layout, its position in the batch and the number
of threads, so each row's result is bitwise reproducible. This module holds the pieces
of it that more than one layout uses; :mod:`.forward_rows`, :mod:`.forward_cols` and
:mod:`.backward` put them together (:mod:`.kernels` has the overview).

Row arithmetic, LayerNorm statistics (shifted sums, checked)
-----------------------------------------------------------
Accumulation type ``T`` is float32 (float64 for float64 input). The row is read twice:
once for its statistics, once (from L1/L2) for the output.

1. **Shift.** ``K`` is the mean of the row's first ``LANES`` elements: the lane tree
   ``T`` (lane ``j`` plus lane ``j + h`` for ``h = 8, 4, 2, 1``) of the first vector,
   times ``1/16`` (``K = x[0]`` for rows shorter than ``LANES``). A sum of equal values
   in a tree of pairs is exact, so a constant row has ``K`` equal to its value and
   shifted values ``v_i = x_i - K`` exactly 0.
2. **Shifted sums.** The row is cut into spans of ``SPAN = 512`` elements. In a span,
   element ``i`` goes to lane ``i % LANES`` of accumulator ``(i // LANES) % ACCS``
   (``ACCS = 4`` vector accumulators hide the add latency), in order of ``i``: ``S += v``
   and ``Q = fma(v, v, Q)``; a last partial vector is padded with ``v = K - K = +0.0``.
   Each span's ``(S0 + S1) + (S2 + S3)`` (and the same of the ``Q``) is added, in order,
   to the lane totals, so no chain of roundings is longer than a span's (a chain of 128
   float32 squares biased ``rstd`` by 2e-7 at n = 8192). Then ``s = T(totals of S)``,
   ``ss = T(totals of Q)``.
3. ``mu = s / n`` (the shifted mean) and ``q = fma(s, -mu, ss)`` (the sum of squared
   deviations, ``ss - s * mu`` rounded once).
4. **Check.** ``ss - s * mu`` cancels ``n * mu**2`` of ``ss``, which costs accuracy only
   when ``K`` is far from the mean. A row with ``mu**2 * n > SHIFT_REDO * q``
   (``SHIFT_REDO = 1/4``: its shift more than half a standard deviation from its mean,
   or ``q < 0``) is computed again from step 2 about ``K' = K + mu``, which lies at the
   mean, and keeps ``max(q', 0)``. For rows of random data this happens for a few rows
   in a hundred (the mean of 16 samples is rarely half a deviation off); for sorted or
   trending rows, or an outlying first vector, always. Every other row is computed
   once. The test depends on the row alone, so its result does too.
5. ``rstd = 1 / sqrt(q / n + eps)``, ``mean = K + mu``, and the output pass computes
   ``y = fma(((x - K) - mu) * rstd, w, b)`` element by element. The
   backend passes ``w = 1`` for an absent weight and ``b = -0.0`` for an absent bias:
   ``fma(v, 1, -0.0) = v``, ``fma(v, w, -0.0) = v * w`` and ``fma(v, 1, b) = v + b``
   exactly, so one compiled kernel serves every combination. Float16/bfloat16 ``w`` and
   ``b`` arrive as raw bits and are widened exactly to float32: once per call on the row
   path (:func:`widened`), where they are loaded on the column path.

This replaced a one-pass arithmetic that merged per-chunk moments with Chan's formula
about ``K = x[0]``: the same accuracy (max ``|y - y_float64|`` 6-8e-7 on ``1e4 + randn``
float32 rows of 256-16384), for 1.1-1.2x less time per row of 256 or more from cache.

``fma`` is IEEE fusedMultiplyAdd, written explicitly: one rounding, the same bits on
every machine. The compiler is never allowed to contract or reorder anything itself.

RMSNorm: per chunk and lane, the squares of the chunk's elements are summed in the same
fixed tree as ``q`` above (absent elements are 0), the chunk sums are added to the lane's
sum in order, then the remainder's squares; lanes are summed in the fixed tree,
``rstd = 1 / sqrt(ss / n + eps)``, ``y = x * rstd * w``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ._scalars import cast, widen
from ._simd import (
    WIDTH,
    Vec,
    alive,
    down1,
    down2,
    down4,
    down8,
    fma,
    get,
    lane,
    put,
    raw,
    splat,
    vload,
    vstore,
)
from .diskcache import cached_njit

LANES = WIDTH
#: Vector accumulators of the LayerNorm statistics (``ACCS * LANES`` elements a step).
ACCS = 4
BLOCK = ACCS * LANES
#: Elements per span: each span's accumulators are added to the lane totals, so no lane
#: sums more than ``SPAN // BLOCK`` terms in one chain (rounding errors stay those of
#: short sums: a chain of 128 float32 squares biased rstd by 2e-7 at n = 8192).
SPAN = 8 * BLOCK
#: A row whose shifted mean ``mu`` has ``mu**2 * n > SHIFT_REDO * q`` (its shift more
#: than half a standard deviation from its mean) is computed again about ``K + mu``.
SHIFT_REDO = 0.25
#: Elements per chunk of the RMSNorm sum of squares (``PER_LANE`` vectors in a fixed tree).
PER_LANE = 8
CHUNK = LANES * PER_LANE
#: Elements per parallel work item (no effect on results).
WORK_ELEMENTS = 1 << 15
#: Rows of the table of per-``n`` constants (:func:`row_constants`): ``n`` in every lane.
TAB_ROWS = 1
TAB_N = 0


@cached_njit(error_model="numpy")
def row_constants(n, like):
    """The LayerNorm statistics' constants that depend on ``n`` only (rows: ``TAB_*``)."""
    return np.full((TAB_ROWS, LANES), cast(n, like))


def widened(param):
    """``param`` ready for the row loops: float16/bfloat16 raw bits widened (exactly) to a
    new float32 array once per call, any other array unchanged.

    Widening a 16-bit parameter where each vector is loaded cost about four instructions
    per vector per row in the output pass (measured: 9-17% of a bfloat16/float16 forward
    with 16-bit parameters, against float32 ones). The results are the same bits.
    """
    # Python (NUMBA_DISABLE_JIT) only, as for the other stubs here; jitted code: overloads.
    return widen(param) if param.dtype in (np.int16, np.uint16) else param


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
    return widened(w), widened(b)


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
    return v * (vload(w, 0, i) if isinstance(v, np.ndarray) else widen(get(w, 0, i)))


@overload(times_w, inline="always")
def _times_w(v, w, i):
    if isinstance(v, Vec):
        return lambda v, w, i: v * vload(w, 0, i)
    return lambda v, w, i: v * widen(get(w, 0, i))


def put_stat(out, r, value):
    """``out[r] = value``, or nothing when the caller did not ask for ``out`` (None)."""
    if out is not None:
        out[r] = value


@overload(put_stat, inline="always")
def _put_stat(out, r, value):
    if isinstance(out, types.NoneType):
        return lambda out, r, value: None

    def impl(out, r, value):
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
def square_tree(d0, d1, d2, d3, d4, d5, d6, d7):
    """``d0**2 + ... + d7**2`` in the fixed tree (pairs fused: ``fma(d0, d0, d1 * d1)``).

    Absent leaves are +0.0: their squares add exactly nothing to sums of squares, which
    are never -0.0.
    """
    return ((fma(d0, d0, d1 * d1) + fma(d2, d2, d3 * d3))
            + (fma(d4, d4, d5 * d5) + fma(d6, d6, d7 * d7)))


@njit(inline="always", error_model="numpy")
def _tail(xr, r, i, n, shift, kv, rem):
    """``x[i:n] - K`` as a vector, padded with ``K - K = +0.0`` (``rem``: a scratch row)."""
    for j in range(LANES):
        put(rem, 0, j, widen(get(xr, r, i + j)) if i + j < n else shift)
    return vload(rem, 0, 0) - kv


@njit(inline="always", error_model="numpy")
def _plus_moments(s, ss, xr, r, i, n, shift, kv, rem):
    """Accumulators ``(s, ss)`` plus the shifted vector at ``i`` and its squares (the
    padded tail if partial, nothing past the row's end)."""
    if i + LANES <= n:
        v = vload(xr, r, i) - kv
        return s + v, fma(v, v, ss)
    if i < n:
        v = _tail(xr, r, i, n, shift, kv, rem)
        return s + v, fma(v, v, ss)
    return s, ss


@njit(inline="always", error_model="numpy")
def first_shift(xr, r, n):
    """The shift ``K`` of a row: the mean of its first ``LANES`` elements (step 1)."""
    if n < LANES:
        return widen(get(xr, r, 0))
    return tree_sum(vload(xr, r, 0)) * cast(1.0 / LANES, widen(get(xr, r, 0)))


@njit(inline="always", error_model="numpy")
def moment_lanes(xr, r, n, shift, rem):
    """Step 2 before the lane trees: the lane totals of the shifted sums and of their
    squares, for a unit-stride row."""
    kv = splat(shift)
    zero = splat(cast(0.0, shift))
    ts = tq = zero
    for start in range(0, n, SPAN):
        end = min(n, start + SPAN)
        s0 = s1 = s2 = s3 = zero
        q0 = q1 = q2 = q3 = zero
        body = start + (end - start) // BLOCK * BLOCK
        for i in range(start, body, BLOCK):
            v0 = vload(xr, r, i) - kv
            v1 = vload(xr, r, i + LANES) - kv
            v2 = vload(xr, r, i + 2 * LANES) - kv
            v3 = vload(xr, r, i + 3 * LANES) - kv
            s0 = s0 + v0
            s1 = s1 + v1
            s2 = s2 + v2
            s3 = s3 + v3
            q0 = fma(v0, v0, q0)
            q1 = fma(v1, v1, q1)
            q2 = fma(v2, v2, q2)
            q3 = fma(v3, v3, q3)
        if body < end:
            s0, q0 = _plus_moments(s0, q0, xr, r, body, n, shift, kv, rem)
            s1, q1 = _plus_moments(s1, q1, xr, r, body + LANES, n, shift, kv, rem)
            s2, q2 = _plus_moments(s2, q2, xr, r, body + 2 * LANES, n, shift, kv, rem)
            s3, q3 = _plus_moments(s3, q3, xr, r, body + 3 * LANES, n, shift, kv, rem)
        ts = ts + ((s0 + s1) + (s2 + s3))
        tq = tq + ((q0 + q1) + (q2 + q3))
    return ts, tq


@njit(inline="always", error_model="numpy")
def centred(s, ss, nf):
    """Step 3: ``(mu, q)`` from the shifted sums ``s`` and ``ss`` (scalars or vectors)."""
    mu = s / nf
    # ss - s * mu rounded once; (nf - nf) - mu is -mu exactly (+0.0 for mu = 0).
    q = fma(s, (nf - nf) - mu, ss)
    return mu, q


@njit(inline="always", error_model="numpy")
def needs_new_shift(mu, q, nf):
    """Step 4: the shift ``K`` is too far from the mean for ``ss - s * mu`` to keep full
    accuracy (``q`` below zero included)."""
    return (mu * mu) * nf > cast(SHIFT_REDO, mu) * q


@njit(error_model="numpy")
def _moments(xr, r, n, shift, nf, rem):
    s, ss = moment_lanes(xr, r, n, shift, rem)
    return centred(tree_sum(s), tree_sum(ss), nf)


@njit(error_model="numpy")
def row_stats(xr, r, n, tab, rem):
    """``(K, mu, q)`` of a unit-stride row: shift, shifted mean and the sum of squared
    deviations (steps 1-4). ``tab`` is :func:`row_constants`, ``rem`` a LANES scratch."""
    nf = get(tab, TAB_N, 0)
    shift = first_shift(xr, r, n)
    mu, q = _moments(xr, r, n, shift, nf, rem)
    if needs_new_shift(mu, q, nf):
        shift, mu, q = redo_stats(xr, r, n, shift + mu, nf, rem)
    return shift, mu, q


@njit(error_model="numpy")
def redo_stats(xr, r, n, shift, nf, rem):
    """Step 4's second pass, about the better ``shift``: ``(K', mu', max(q', 0))``."""
    mu, q = _moments(xr, r, n, shift, nf, rem)
    return shift, mu, max(q, cast(0.0, q))


@njit(error_model="numpy")
def copy_row(dst, rd, src, rs):
    # An explicit loop: slice assignment compiles a large generic implementation.
    for i in range(src.shape[1]):
        dst[rd, i] = src[rs, i]


@njit(inline="always", error_model="numpy")
def unit_stride(a):
    return a.strides[1] == a.itemsize
