"""The LayerNorm forward's two passes alone, and pure memory passes, for the roofline.

``python -m layernorm bench --roofline`` times the fused forward kernel against its
parts: :func:`statistics_pass` and :func:`output_pass` are compiled from the same inlined
row helpers as :func:`.forward_rows.ln_forward_serial` (so the same instructions and
bits), :func:`read_pass` and :func:`write_pass` only read or only write memory.
"""

from __future__ import annotations

import numpy as np

from ._simd import lane, raw, splat, store_fence, vload, vstore
from .diskcache import cached_njit
from .forward_rows import ln_row_out, ln_row_out_whole
from .rowmath import LANES, STREAM, finish, row_moments

#: Vector accumulators of the read pass (enough to hide the add latency).
READ_UNROLL = 4


@cached_njit(error_model="numpy")
def statistics_pass(x, eps, tab, shift_out, mu_out, rstd_out):
    """The forward kernel's statistics pass alone: per row its shift ``K``, shifted
    mean and ``rstd`` (what the output pass takes); ``tab`` is ``rowmath.merge_table``."""
    n = x.shape[1]
    xv, tv = raw(x), raw(tab)
    for r in range(x.shape[0]):
        shift, mu, m2 = row_moments(xv, r, n, tv)
        mean, _, rstd = finish(shift, mu, m2, n, eps)
        shift_out[r] = shift
        mu_out[r] = mean
        rstd_out[r] = rstd


@cached_njit(error_model="numpy")
def output_pass(x, w, b, shift, mu, rstd, y, nt):
    """The forward kernel's output pass alone, given :func:`statistics_pass`'s results
    (``nt``: streaming stores, as the kernel chooses them)."""
    n = x.shape[1]
    xv, yv, wv, bv = raw(x), raw(y), raw(w), raw(b)
    if nt:
        for r in range(x.shape[0]):
            ln_row_out_whole(xv, yv, r, n, shift[r], mu[r], rstd[r], wv, bv, STREAM, False)
        store_fence()
    else:
        for r in range(x.shape[0]):
            ln_row_out(xv, yv, r, n, shift[r], mu[r], rstd[r], wv, bv)


@cached_njit(error_model="numpy")
def read_pass(x):
    """Sum of ``x`` (float32 rows) in ``READ_UNROLL`` vector accumulators: a pure read."""
    xv = raw(x)
    n = x.shape[1]
    step = READ_UNROLL * LANES
    body = n // step * step
    a0 = a1 = a2 = a3 = splat(np.float32(0.0))
    tail = np.float32(0.0)
    for r in range(x.shape[0]):
        for i in range(0, body, step):
            a0 = a0 + vload(xv, r, i)
            a1 = a1 + vload(xv, r, i + LANES)
            a2 = a2 + vload(xv, r, i + 2 * LANES)
            a3 = a3 + vload(xv, r, i + 3 * LANES)
        for i in range(body, n):
            tail += x[r, i]
    total = (a0 + a1) + (a2 + a3)
    for j in range(LANES):
        tail += lane(total, j)
    return tail


@cached_njit(error_model="numpy")
def write_pass(y, value):
    """Fill ``y`` (float32 rows) with ``value``, vector stores: a pure write."""
    yv = raw(y)
    n = y.shape[1]
    body = n // LANES * LANES
    v = splat(value)
    for r in range(y.shape[0]):
        for i in range(0, body, LANES):
            vstore(yv, v, r, i)
        for i in range(body, n):
            y[r, i] = value
