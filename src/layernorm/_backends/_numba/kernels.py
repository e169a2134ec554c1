"""Numba kernels: plain loops over independent rows.

A kernel sees either a 2-D ``(rows, n)`` array (row ``r`` is ``x[r]``) or a 3-D
``(outer, n, inner)`` array (row ``r`` is ``x[r // inner, :, r % inner]``: the
channels-first case). Every row goes through the same row functions below, whatever
its layout, its position in the batch, and the number of threads, so each row's
result is bitwise reproducible.

Row statistics (LayerNorm), one pass over memory
------------------------------------------------
Values are shifted by ``K = x[0]`` (the row's first element), so a constant row has
mean exactly ``K`` and centred values exactly 0. The row is cut into chunks of
``CHUNK = LANES * PER_LANE`` elements; in a chunk, lane ``j`` owns the ``PER_LANE``
elements ``chunk_start + k * LANES + j``. Per chunk and lane the two-pass mean and M2
of those few (register-resident) values are computed, then merged into the lane's
running state with Chan's formula. All lanes hold the same count, so the merge weights
are scalars computed once per chunk (no division in the element loop). Lanes are merged
in a fixed tree (``j`` with ``j + 8``, then ``j + 4``, ...), and the tail of fewer than
``CHUNK`` elements is merged last from its own two-pass statistics. The output pass
computes ``y = ((x - K) - mean_shift) * rstd * w + b``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._scalars import cast, narrow, widen

LANES = 16
PER_LANE = 8
CHUNK = LANES * PER_LANE
#: Rows per parallel work item in the forward kernels (no effect on results).
FORWARD_ROW_BLOCK = 8


def row_of(x, r):  # noqa: ANN001, ANN201
    """Row ``r`` of a 2-D ``(rows, n)`` or 3-D ``(outer, n, inner)`` array."""
    raise NotImplementedError


def row_count(x):  # noqa: ANN001, ANN201
    """Number of rows of a 2-D or 3-D kernel array."""
    raise NotImplementedError


@overload(row_of, inline="always")
def _row_of(x, r):  # noqa: ANN001, ANN202
    if isinstance(x, types.Array) and x.ndim == 2:
        return lambda x, r: x[r]
    if isinstance(x, types.Array) and x.ndim == 3:
        return lambda x, r: x[r // x.shape[2], :, r % x.shape[2]]
    return None


@overload(row_count, inline="always")
def _row_count(x):  # noqa: ANN001, ANN202
    if isinstance(x, types.Array) and x.ndim == 2:
        return lambda x: x.shape[0]
    if isinstance(x, types.Array) and x.ndim == 3:
        return lambda x: x.shape[0] * x.shape[2]
    return None


# --------------------------------------------------------------------------- statistics


@njit(cache=True, error_model="numpy")
def _row_moments(xr, like, lane_mean, lane_m2):  # noqa: ANN001, ANN202
    """(K, shifted mean, M2) of one row; ``like`` is an accumulation-typed scalar."""
    n = xr.shape[0]
    zero = cast(0.0, like)
    one = cast(1.0, like)
    half = cast(0.5, like)
    per_lane_inv = cast(1.0 / PER_LANE, like)
    shift = widen(xr[0])
    full = n // CHUNK
    for c in range(full):
        base = c * CHUNK
        if c > 0:
            w_new = one / cast(c + 1, like)
            w_cross = cast(c * PER_LANE, like) * w_new
        else:
            w_new = zero
            w_cross = zero
        for j in range(LANES):
            s = widen(xr[base + j]) - shift
            for k in range(1, PER_LANE):
                s = s + (widen(xr[base + k * LANES + j]) - shift)
            m = s * per_lane_inv
            q = zero
            for k in range(PER_LANE):
                d = (widen(xr[base + k * LANES + j]) - shift) - m
                q = q + d * d
            if c == 0:
                lane_mean[j] = m
                lane_m2[j] = q
            else:
                delta = m - lane_mean[j]
                lane_mean[j] = lane_mean[j] + delta * w_new
                lane_m2[j] = (lane_m2[j] + q) + (delta * delta) * w_cross
    mean = zero
    m2 = zero
    if full > 0:
        count = cast(full * PER_LANE, like)
        h = LANES // 2
        while h >= 1:
            for j in range(h):
                delta = lane_mean[j + h] - lane_mean[j]
                lane_mean[j] = lane_mean[j] + delta * half
                lane_m2[j] = (lane_m2[j] + lane_m2[j + h]) + (delta * delta) * (count * half)
            count = count + count
            h = h // 2
        mean = lane_mean[0]
        m2 = lane_m2[0]
    start = full * CHUNK
    tail = n - start
    if tail > 0:
        s = zero
        for i in range(start, n):
            s = s + (widen(xr[i]) - shift)
        tail_mean = s / cast(tail, like)
        tail_m2 = zero
        for i in range(start, n):
            d = (widen(xr[i]) - shift) - tail_mean
            tail_m2 = tail_m2 + d * d
        if full == 0:
            mean = tail_mean
            m2 = tail_m2
        else:
            n_a = cast(start, like)
            f_new = cast(tail, like) / (n_a + cast(tail, like))
            f_cross = n_a * f_new
            delta = tail_mean - mean
            mean = mean + delta * f_new
            m2 = (m2 + tail_m2) + (delta * delta) * f_cross
    return shift, mean, m2


@njit(cache=True, error_model="numpy")
def _lane_sum(lanes):  # noqa: ANN001, ANN202
    """Fixed-tree sum of the LANES partial sums (destroys ``lanes``)."""
    h = LANES // 2
    while h >= 1:
        for j in range(h):
            lanes[j] = lanes[j] + lanes[j + h]
        h = h // 2
    return lanes[0]


@njit(cache=True, error_model="numpy")
def _row_sum_squares(xr, like, lanes):  # noqa: ANN001, ANN202
    """Sum of x**2 of one row: lane j sums elements j, j + LANES, ... in order."""
    n = xr.shape[0]
    zero = cast(0.0, like)
    for j in range(LANES):
        lanes[j] = zero
    body = n - n % LANES
    for base in range(0, body, LANES):
        for j in range(LANES):
            v = widen(xr[base + j])
            lanes[j] = lanes[j] + v * v
    for i in range(body, n):
        v = widen(xr[i])
        lanes[i - body] = lanes[i - body] + v * v
    return _lane_sum(lanes)


# --------------------------------------------------------------------------- forward


@njit(cache=True, error_model="numpy")
def _ln_forward_rows(x, w, b, eps, y, mean_out, rstd_out, r0, r1):  # noqa: ANN001, ANN202
    lane_mean = np.empty(LANES, dtype=mean_out.dtype)
    lane_m2 = np.empty(LANES, dtype=mean_out.dtype)
    one = cast(1.0, eps)
    for r in range(r0, r1):
        xr = row_of(x, r)
        yr = row_of(y, r)
        n = xr.shape[0]
        shift, mean, m2 = _row_moments(xr, eps, lane_mean, lane_m2)
        rstd = one / np.sqrt(m2 / cast(n, eps) + eps)
        for i in range(n):
            v = ((widen(xr[i]) - shift) - mean) * rstd
            if w is not None:
                v = v * w[i]
            if b is not None:
                v = v + b[i]
            yr[i] = narrow(v, yr)
        mean_out[r] = shift + mean
        rstd_out[r] = rstd


@njit(cache=True, error_model="numpy")
def ln_forward_serial(x, w, b, eps, y, mean_out, rstd_out):  # noqa: ANN001, ANN201
    """LayerNorm forward on the calling thread."""
    _ln_forward_rows(x, w, b, eps, y, mean_out, rstd_out, 0, row_count(x))


@njit(cache=True, parallel=True, error_model="numpy")
def ln_forward_parallel(x, w, b, eps, y, mean_out, rstd_out):  # noqa: ANN001, ANN201
    """LayerNorm forward, blocks of rows spread over Numba's threads."""
    rows = row_count(x)
    blocks = (rows + FORWARD_ROW_BLOCK - 1) // FORWARD_ROW_BLOCK
    for blk in prange(blocks):
        r0 = blk * FORWARD_ROW_BLOCK
        _ln_forward_rows(x, w, b, eps, y, mean_out, rstd_out, r0,
                         min(rows, r0 + FORWARD_ROW_BLOCK))


@njit(cache=True, error_model="numpy")
def _rms_forward_rows(x, w, eps, y, rstd_out, r0, r1):  # noqa: ANN001, ANN202
    lanes = np.empty(LANES, dtype=rstd_out.dtype)
    one = cast(1.0, eps)
    for r in range(r0, r1):
        xr = row_of(x, r)
        yr = row_of(y, r)
        n = xr.shape[0]
        ss = _row_sum_squares(xr, eps, lanes)
        rstd = one / np.sqrt(ss / cast(n, eps) + eps)
        for i in range(n):
            v = widen(xr[i]) * rstd
            if w is not None:
                v = v * w[i]
            yr[i] = narrow(v, yr)
        rstd_out[r] = rstd


@njit(cache=True, error_model="numpy")
def rms_forward_serial(x, w, eps, y, rstd_out):  # noqa: ANN001, ANN201
    """RMSNorm forward on the calling thread."""
    _rms_forward_rows(x, w, eps, y, rstd_out, 0, row_count(x))


@njit(cache=True, parallel=True, error_model="numpy")
def rms_forward_parallel(x, w, eps, y, rstd_out):  # noqa: ANN001, ANN201
    """RMSNorm forward, blocks of rows spread over Numba's threads."""
    rows = row_count(x)
    blocks = (rows + FORWARD_ROW_BLOCK - 1) // FORWARD_ROW_BLOCK
    for blk in prange(blocks):
        r0 = blk * FORWARD_ROW_BLOCK
        _rms_forward_rows(x, w, eps, y, rstd_out, r0, min(rows, r0 + FORWARD_ROW_BLOCK))


# --------------------------------------------------------------------------- backward


@njit(cache=True, error_model="numpy")
def _ln_backward_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0, r1):  # noqa: ANN001, ANN202
    lanes_g = np.zeros(LANES, dtype=mean_in.dtype)
    lanes_gx = np.zeros(LANES, dtype=mean_in.dtype)
    zero = lanes_g[0]
    like = zero
    dw = partials[0, blk]
    db = partials[1, blk]
    for r in range(r0, r1):
        gyr = row_of(gy, r)
        xr = row_of(x, r)
        gxr = row_of(gx, r)
        n = xr.shape[0]
        mean = mean_in[r]
        rstd = rstd_in[r]
        for j in range(LANES):
            lanes_g[j] = zero
            lanes_gx[j] = zero
        for i in range(n):
            g = widen(gyr[i])
            if w is not None:
                g = g * w[i]
            xhat = (widen(xr[i]) - mean) * rstd
            j = i % LANES
            lanes_g[j] = lanes_g[j] + g
            lanes_gx[j] = lanes_gx[j] + g * xhat
        inv_n = cast(1.0, like) / cast(n, like)
        mean_g = _lane_sum(lanes_g) * inv_n
        mean_gx = _lane_sum(lanes_gx) * inv_n
        for i in range(n):
            dy = widen(gyr[i])
            g = dy
            if w is not None:
                g = g * w[i]
            xhat = (widen(xr[i]) - mean) * rstd
            gxr[i] = narrow(((g - mean_g) - xhat * mean_gx) * rstd, gxr)
            dw[i] = dw[i] + dy * xhat
            db[i] = db[i] + dy


@njit(cache=True, error_model="numpy")
def ln_backward_serial(gy, x, mean_in, rstd_in, w, gx, partials, block_rows):  # noqa: ANN001, ANN201
    """LayerNorm backward on the calling thread (same blocks as the parallel one)."""
    rows = row_count(x)
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _ln_backward_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                          min(rows, r0 + block_rows))


@njit(cache=True, parallel=True, error_model="numpy")
def ln_backward_parallel(gy, x, mean_in, rstd_in, w, gx, partials, block_rows):  # noqa: ANN001, ANN201
    """LayerNorm backward, row blocks spread over threads."""
    rows = row_count(x)
    for blk in prange(partials.shape[1]):
        r0 = blk * block_rows
        _ln_backward_rows(gy, x, mean_in, rstd_in, w, gx, partials, blk, r0,
                          min(rows, r0 + block_rows))


@njit(cache=True, error_model="numpy")
def _rms_backward_rows(gy, x, rstd_in, w, gx, partials, blk, r0, r1):  # noqa: ANN001, ANN202
    lanes = np.zeros(LANES, dtype=rstd_in.dtype)
    zero = lanes[0]
    like = zero
    dw = partials[0, blk]
    for r in range(r0, r1):
        gyr = row_of(gy, r)
        xr = row_of(x, r)
        gxr = row_of(gx, r)
        n = xr.shape[0]
        rstd = rstd_in[r]
        for j in range(LANES):
            lanes[j] = zero
        for i in range(n):
            g = widen(gyr[i])
            if w is not None:
                g = g * w[i]
            j = i % LANES
            lanes[j] = lanes[j] + g * (widen(xr[i]) * rstd)
        mean_gx = _lane_sum(lanes) * (cast(1.0, like) / cast(n, like))
        for i in range(n):
            dy = widen(gyr[i])
            g = dy
            if w is not None:
                g = g * w[i]
            xhat = widen(xr[i]) * rstd
            gxr[i] = narrow((g - xhat * mean_gx) * rstd, gxr)
            dw[i] = dw[i] + dy * xhat


@njit(cache=True, error_model="numpy")
def rms_backward_serial(gy, x, rstd_in, w, gx, partials, block_rows):  # noqa: ANN001, ANN201
    """RMSNorm backward on the calling thread."""
    rows = row_count(x)
    for blk in range(partials.shape[1]):
        r0 = blk * block_rows
        _rms_backward_rows(gy, x, rstd_in, w, gx, partials, blk, r0, min(rows, r0 + block_rows))


@njit(cache=True, parallel=True, error_model="numpy")
def rms_backward_parallel(gy, x, rstd_in, w, gx, partials, block_rows):  # noqa: ANN001, ANN201
    """RMSNorm backward, row blocks spread over threads."""
    rows = row_count(x)
    for blk in prange(partials.shape[1]):
        r0 = blk * block_rows
        _rms_backward_rows(gy, x, rstd_in, w, gx, partials, blk, r0, min(rows, r0 + block_rows))


@njit(cache=True, error_model="numpy")
def sum_blocks(partials):  # noqa: ANN001, ANN201
    """Sum ``partials[:, blk, :]`` over ``blk`` in increasing order (deterministic)."""
    count, blocks, n = partials.shape
    total = np.zeros((count, n), dtype=partials.dtype)
    for c in range(count):
        for blk in range(blocks):
            for i in range(n):
                total[c, i] = total[c, i] + partials[c, blk, i]
    return total
