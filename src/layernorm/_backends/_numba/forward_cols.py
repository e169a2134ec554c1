"""LayerNorm and RMSNorm forward over axis 1 of 3-D ``(outer, n, inner)`` arrays.

The **column path** (``inner > 1``, the channels-first case): ``WIDTH`` neighbouring
columns are processed at once, one column per SIMD lane, and the row arithmetic's lanes
(:mod:`.rowmath`) become a loop over lane-state vectors. A work item copies a tile of up
to ``8 * WIDTH`` columns into an ``(n, columns)`` scratch tile in row order first (rows
are far apart; a sequential walk is what the prefetchers follow), padding a last
partial block by repeating its last column. Each column gets the bits the row path
gives the same values as a row.

Columns of at most ``SHORT_COLUMN_MAX`` elements (an image's few channels) have kernels
of their own (``ln_forward_short_cols_*``, ``rms_forward_short_cols_*``: a call compiles
only the kind it takes), which compute the same lane sums and trees from registers and
reference-count-free views, leaving out the lanes that hold ``+0.0``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._scalars import cast, imax, imin, widen
from ._simd import (
    WIDTH,
    alive,
    copy2,
    fma,
    get,
    load2,
    put,
    raw,
    rounded,
    runtime,
    splat,
    sqrt,
    store2,
    vload,
    vstore,
    wide,
)
from .callee import callee_njit
from .diskcache import cached_njit
from .rescale import ln_column_rescaled, rms_column_rescaled, usable_rstd
from .rowmath import (
    CHUNK,
    LANES,
    PER_LANE,
    TAB_CANCEL,
    WORK_ELEMENTS,
    block_end,
    blocked,
    chunk_sums,
    column_major,
    finish,
    redo,
    square_tree,
)


@njit(inline="always", error_model="numpy")
def _lane_tree_sum(lt, top):
    """Row 0 of ``lt`` becomes the sum of its ``2 * top`` rows, in :func:`tree_sum`'s
    tree (its levels ``h = top, ..., 1``)."""
    h = top
    while h >= 1:
        for j in range(h):
            store2(lt, load2(lt, j, 0) + load2(lt, j + h, 0), j, 0)
        h = h // 2


@callee_njit
def _col_chunk(x2, row0, c0, g, kv, pad):
    # Leaves written out: a helper called with the constants 0 .. 7 would be compiled
    # once per constant.
    return chunk_sums(
        load2(x2, row0, c0) - kv if g > 0 else pad,
        load2(x2, row0 + LANES, c0) - kv if g > 1 else pad,
        load2(x2, row0 + 2 * LANES, c0) - kv if g > 2 else pad,
        load2(x2, row0 + 3 * LANES, c0) - kv if g > 3 else pad,
        load2(x2, row0 + 4 * LANES, c0) - kv if g > 4 else pad,
        load2(x2, row0 + 5 * LANES, c0) - kv if g > 5 else pad,
        load2(x2, row0 + 6 * LANES, c0) - kv if g > 6 else pad,
        load2(x2, row0 + 7 * LANES, c0) - kv if g > 7 else pad)


@njit(inline="always", error_model="numpy")
def _col_lane_sums(x2, c0, j, kv, zero, pad):
    """Lane ``j``'s sums of ``v = x - K`` and ``v * v`` for columns ``c0 ..`` and their
    float64 totals: the row path's :func:`.rowmath.lane_sums`, lane ``j`` of every
    vector there."""
    n = x2.shape[0]
    a = q = zero
    ta = tq = wide(zero)
    groups = n // LANES
    full = groups // PER_LANE
    c = 0
    while c < full:
        if c > 0:  # a block before this one: close it (.rowmath.lane_sums_from)
            ta = ta + wide(a)
            tq = tq + wide(q)
            a = q = zero
        end = block_end(c, full)
        for k in range(c, end):
            s, ss = _col_chunk(x2, k * CHUNK + j, c0, runtime(PER_LANE), kv, pad)
            a = a + s
            q = q + ss
        c = end
    g = groups - full * PER_LANE
    if g > 0:
        s, ss = _col_chunk(x2, full * CHUNK + j, c0, g, kv, pad)
        a = a + s
        q = q + ss
    start = groups * LANES
    if start < n:
        v = (load2(x2, start + j, c0) - kv) if start + j < n else (kv - kv)
        a = a + v
        q = fma(v, v, q)
    return a, q, ta, tq


@callee_njit
def _col_redo(x2, c, shift, mu, tab):
    """:func:`.rowmath.redo` of column ``c`` of the tile ``x2``, as a scratch row."""
    n = x2.shape[0]
    xs = np.empty((1, n), dtype=x2.dtype)
    for i in range(n):
        xs[0, i] = x2[i, c]
    out = redo(raw(xs), runtime(0), n, shift, mu, raw(tab))
    alive(xs)
    alive(tab)
    return out


@njit(inline="always", error_model="numpy")
def _ln_cols(x2, y2, c0, w, b, eps, tab, lm, lm2, lt, cs, mean_out, rstd_out, r0, valid):
    """The row arithmetic for columns ``c0 .. c0+WIDTH`` of ``x2`` (unit column stride).

    Writes the outputs of the first ``valid`` columns' statistics at ``r0 ..``.
    """
    n = x2.shape[0]
    like = eps
    zero = splat(cast(0.0, like))
    pad = splat(cast(-0.0, like))
    for k in range(WIDTH):
        cs[2, k] = widen(x2[0, c0 + k])  # the shift K = x[0]
    kv = load2(cs, 2, 0)
    # Lanes to columns: the row path's lane_total, lane j of a vector being row j of
    # the lane-sum tiles here (its first level in the accumulation type, or with closed
    # blocks in float64).
    half = LANES // 2
    for j in range(half):
        a, q, ta, tq = _col_lane_sums(x2, c0, j, kv, zero, pad)
        a2, q2, ta2, tq2 = _col_lane_sums(x2, c0, j + half, kv, zero, pad)
        if blocked(n):
            store2(lm, (ta + wide(a)) + (ta2 + wide(a2)), j, 0)
            store2(lm2, (tq + wide(q)) + (tq2 + wide(q2)), j, 0)
        else:
            store2(lm, wide(a + a2), j, 0)
            store2(lm2, wide(q + q2), j, 0)
    _lane_tree_sum(lm, half // 2)
    _lane_tree_sum(lm2, half // 2)
    # Step 5 for the WIDTH columns at once, lane k being column k: finish's operations
    # on vectors (one column at a time, they took a fifth of a short column's time).
    inv_n = splat(1.0 / np.float64(n))
    s = load2(lm, 0, 0)
    mu = s * inv_n
    m2 = fma(s, mu * splat(-1.0), load2(lm2, 0, 0))
    store2(lm, m2, 1, 0)
    store2(lm2, mu, 1, 0)
    store2(cs, rounded(mu, like), 0, 0)
    store2(cs, rounded(splat(1.0) / sqrt(m2 * inv_n + splat(np.float64(eps))), like), 1, 0)
    for k in range(valid):
        if lm[1, k] < np.float64(tab[0, TAB_CANCEL]) * lm2[0, k]:
            shift, mu1, m21 = _col_redo(x2, c0 + k, cs[2, k], cast(lm2[1, k], like), tab)
            mt, _, rstd = finish(shift, mu1, m21, n, eps)
            cs[0, k] = mt
            cs[1, k] = rstd
            cs[2, k] = shift
        mean_out[r0 + k] = cs[2, k] + cs[0, k]
        rstd_out[r0 + k] = cs[1, k]
    kv = load2(cs, 2, 0)
    mv = load2(cs, 0, 0)
    rv = load2(cs, 1, 0)
    for i in range(n):
        v = ((load2(x2, i, c0) - kv) - mv) * rv
        v = fma(v, splat(widen(w[i])), splat(widen(b[i])))
        store2(y2, v, i, c0)
    for k in range(valid):
        if not usable_rstd(cs[1, k]):  # squares overflow or underflow: redone rescaled
            ln_column_rescaled(x2, y2, c0 + k, eps, w, b, mean_out, rstd_out, r0 + k)


@njit(inline="always", error_model="numpy")
def _tile_columns(n):
    # Columns per work item: several WIDTH blocks, so each visit of a (far away) row
    # reads a few contiguous cache lines, while the tile stays within L2.
    return WIDTH * imax(1, imin(8, 4096 // imax(n, 1)))


@njit(inline="always", error_model="numpy")
def _load_tile(x2, xt, c0, valid, unit):
    """Copy columns ``c0 .. c0+valid`` of ``x2`` into ``xt``, in row order.

    Rows are far apart in memory and a sequential walk is what the hardware prefetchers
    follow. Columns past ``valid`` in the last block repeat the last valid column.
    """
    if not unit and column_major(x2):
        # A transposed x (each column contiguous): one column after the other.
        for k in range(xt.shape[1]):
            for i in range(x2.shape[0]):
                xt[i, k] = x2[i, c0 + imin(k, valid - 1)]
        return
    full = valid // WIDTH if unit else 0
    for i in range(x2.shape[0]):
        for s in range(full):
            copy2(xt, i, s * WIDTH, x2, i, c0 + s * WIDTH)
        for k in range(full * WIDTH, xt.shape[1]):
            xt[i, k] = x2[i, c0 + imin(k, valid - 1)]


@njit(inline="always", error_model="numpy")
def _loaded_tile(x, xt, item):
    """Work item ``item``'s columns of ``x`` copied into the tile ``xt``
    (:func:`_load_tile`); returns ``(outer index, first column, columns)``."""
    inner = x.shape[2]
    tw = xt.shape[1]
    per = (inner + tw - 1) // tw
    o = item // per
    c0 = (item % per) * tw
    valid = imin(tw, inner - c0)
    _load_tile(x[o], xt, c0, valid, x.strides[2] == x.itemsize)
    return o, c0, valid


@njit(inline="always", error_model="numpy")
def _store_tile(yt, y2, c0, valid, unit):
    if not unit and column_major(y2):
        # The columns of a transposed x written as y's rows, each in one sweep: row by
        # row, the tile's columns went to as many rows of y at once, a power-of-two
        # apart in the cases that matter, and thrashed one set of the L1 cache.
        for k in range(valid):
            for i in range(y2.shape[0]):
                y2[i, c0 + k] = yt[i, k]
        return
    full = valid // WIDTH if unit else 0
    for i in range(y2.shape[0]):
        for s in range(full):
            copy2(y2, i, c0 + s * WIDTH, yt, i, s * WIDTH)
        for k in range(full * WIDTH, valid):
            y2[i, c0 + k] = yt[i, k]


@callee_njit
def _ln_col_item(x, w, b, eps, y, mean_out, rstd_out, tab, scratch, tiles, item):
    lm, lm2, lt, cs = scratch
    xt, yt = tiles
    inner = x.shape[2]
    o, c0, valid = _loaded_tile(x, xt, item)
    for s in range(0, valid, WIDTH):
        _ln_cols(xt, yt, s, w, b, eps, tab, lm, lm2, lt, cs, mean_out, rstd_out,
                 o * inner + c0 + s, imin(WIDTH, valid - s))
    _store_tile(yt, y[o], c0, valid, y.strides[2] == y.itemsize)


@njit(inline="always", error_model="numpy")
def _col_scratch(x, y, acc):
    n = x.shape[1]
    tw = _tile_columns(n)
    # float64 lane-sum tiles (LayerNorm; RMSNorm's float64 totals in the first), an
    # accumulation-type tile, column statistics
    scratch = (np.empty((LANES, WIDTH), dtype=np.float64),
               np.empty((LANES, WIDTH), dtype=np.float64),
               np.empty((LANES, WIDTH), dtype=acc), np.empty((3, WIDTH), dtype=acc))
    tiles = (np.empty((n, tw), dtype=x.dtype), np.empty((n, tw), dtype=y.dtype))
    return scratch, tiles


@njit(inline="always", error_model="numpy")
def _col_items(x):
    tw = _tile_columns(x.shape[1])
    return x.shape[0] * ((x.shape[2] + tw - 1) // tw), imax(1, WORK_ELEMENTS // (tw * x.shape[1]))


@cached_njit(error_model="numpy")
def ln_forward_cols_serial(x, w, b, eps, y, mean_out, rstd_out, tab):
    """LayerNorm forward over axis 1 of a 3-D ``(outer, n, inner)`` array."""
    items, _ = _col_items(x)
    scratch, tiles = _col_scratch(x, y, mean_out.dtype)
    for item in range(items):
        _ln_col_item(x, w, b, eps, y, mean_out, rstd_out, tab, scratch, tiles, item)


@cached_njit(parallel=True, error_model="numpy")
def ln_forward_cols_parallel(x, w, b, eps, y, mean_out, rstd_out, tab):
    """Channels-first LayerNorm forward, column tiles spread over Numba's threads."""
    items, per_work = _col_items(x)
    for wk in prange((items + per_work - 1) // per_work):
        scratch, tiles = _col_scratch(x, y, mean_out.dtype)
        for item in range(wk * per_work, imin(items, (wk + 1) * per_work)):
            _ln_col_item(x, w, b, eps, y, mean_out, rstd_out, tab, scratch, tiles, item)


@callee_njit
def _col_square_chunk(x2, row0, c0, g, zero):
    # Leaves written out: a helper called with the constants 0 .. 7 would be compiled
    # once per constant.
    return square_tree(
        load2(x2, row0, c0) if g > 0 else zero,
        load2(x2, row0 + LANES, c0) if g > 1 else zero,
        load2(x2, row0 + 2 * LANES, c0) if g > 2 else zero,
        load2(x2, row0 + 3 * LANES, c0) if g > 3 else zero,
        load2(x2, row0 + 4 * LANES, c0) if g > 4 else zero,
        load2(x2, row0 + 5 * LANES, c0) if g > 5 else zero,
        load2(x2, row0 + 6 * LANES, c0) if g > 6 else zero,
        load2(x2, row0 + 7 * LANES, c0) if g > 7 else zero)


@njit(inline="always", error_model="numpy")
def _rms_cols(x2, y2, c0, w, eps, lanes, totals, cs, rstd_out, r0, valid):
    """The RMSNorm row arithmetic for columns ``c0 .. c0+WIDTH`` of ``x2``: lane ``j``'s
    sums of squares in row ``j`` of ``lanes`` (accumulation type), their float64 totals
    of closed blocks in row ``j`` of ``totals``."""
    n = x2.shape[0]
    zero = splat(cast(0.0, eps))
    for j in range(LANES):
        store2(lanes, zero, j, 0)
        store2(totals, wide(zero), j, 0)
    groups = n // LANES
    full = groups // PER_LANE
    c = 0
    while c < full:
        if c > 0:  # a block before this one: close it
            for j in range(LANES):
                store2(totals, load2(totals, j, 0) + wide(load2(lanes, j, 0)), j, 0)
                store2(lanes, zero, j, 0)
        end = block_end(c, full)
        for k in range(c, end):
            for j in range(LANES):
                sq = _col_square_chunk(x2, k * CHUNK + j, c0, PER_LANE, zero)
                store2(lanes, load2(lanes, j, 0) + sq, j, 0)
        c = end
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
    if blocked(n):  # the row path's total_tree_sum, rounded once
        for j in range(LANES):
            store2(totals, load2(totals, j, 0) + wide(load2(lanes, j, 0)), j, 0)
        _lane_tree_sum(totals, LANES // 2)
        for k in range(WIDTH):
            lanes[0, k] = cast(totals[0, k], eps)
    else:
        _lane_tree_sum(lanes, LANES // 2)
    # rstd of the WIDTH columns at once (lane k: column k), the row path's operations
    rv = splat(cast(1.0, eps)) / sqrt(load2(lanes, 0, 0) / splat(cast(n, eps)) + splat(eps))
    store2(cs, rv, 1, 0)
    for k in range(valid):
        rstd_out[r0 + k] = cs[1, k]
    for i in range(n):
        v = load2(x2, i, c0) * rv
        v = v * splat(widen(w[i]))
        store2(y2, v, i, c0)
    for k in range(valid):
        if not usable_rstd(cs[1, k]):  # squares overflow or underflow: redone rescaled
            rms_column_rescaled(x2, y2, c0 + k, eps, w, rstd_out, r0 + k)


@callee_njit
def _rms_col_item(x, w, eps, y, rstd_out, scratch, tiles, item):
    totals, _, lanes, cs = scratch
    xt, yt = tiles
    inner = x.shape[2]
    o, c0, valid = _loaded_tile(x, xt, item)
    for s in range(0, valid, WIDTH):
        _rms_cols(xt, yt, s, w, eps, lanes, totals, cs, rstd_out, o * inner + c0 + s,
                  imin(WIDTH, valid - s))
    _store_tile(yt, y[o], c0, valid, y.strides[2] == y.itemsize)


@cached_njit(error_model="numpy")
def rms_forward_cols_serial(x, w, eps, y, rstd_out):
    """RMSNorm forward over axis 1 of a 3-D array."""
    items, _ = _col_items(x)
    scratch, tiles = _col_scratch(x, y, rstd_out.dtype)
    for item in range(items):
        _rms_col_item(x, w, eps, y, rstd_out, scratch, tiles, item)


@cached_njit(parallel=True, error_model="numpy")
def rms_forward_cols_parallel(x, w, eps, y, rstd_out):
    """Channels-first RMSNorm forward, column tiles spread over threads."""
    items, per_work = _col_items(x)
    for wk in prange((items + per_work - 1) // per_work):
        scratch, tiles = _col_scratch(x, y, rstd_out.dtype)
        for item in range(wk * per_work, imin(items, (wk + 1) * per_work)):
            _rms_col_item(x, w, eps, y, rstd_out, scratch, tiles, item)


# ---------------------------------------------------------- columns of few elements
#: Columns of at most this many elements take the short-column kernels.
SHORT_COLUMN_MAX = LANES - 1
# Such a column has no chunk: element j is lane j's remainder element, added to +0.0,
# and the lanes past the column add K - K, +0.0 (RMSNorm: squares of zero). The
# functions below compute a tile's lane sums in registers and their fixed trees
# (_lane_tree_sum) on reference-count-free views (._simd.Raw), the same operations
# as _ln_cols and _rms_cols less the additions of the +0.0 lanes, which change nothing
# (no sum here is -0.0, each lane being +0.0 plus its value). Through the general
# loop, most of such a column block's time went to its sixteen lane states and to
# Numba's reference counting of the tile arrays. Measured, float32, 1 thread, into
# out=, channels-first (8, 3, 224, 224): LayerNorm 13.6 -> 2.2 ms, RMSNorm 4.4 ->
# 1.2 ms (the NumPy composites 4-5 and 1-2.5 ms); (8, 8, 128, 128) 3.9 -> 1.1 ms.


@njit(inline="always", error_model="numpy")
def _short_tree(tr, row, m):
    """:func:`_lane_tree_sum` of the ``LANES // 2`` first-level vectors in rows
    ``row ..`` of the view ``tr``, those from ``m`` on being ``+0.0`` (left out)."""
    h = LANES // 4
    while h >= 1:
        for j in range(imin(h, m - h)):
            vstore(tr, vload(tr, row + j, 0) + vload(tr, row + j + h, 0), row + j, 0)
        h = h // 2
    return vload(tr, row, 0)


@njit(inline="always", error_model="numpy")
def _short_sums(xr, n, c0, shift, zero, tr):
    """``(S, SS)``, float64 vectors (lane ``k``: column ``c0 + k``), of a tile of
    ``n`` <= :data:`SHORT_COLUMN_MAX` rows for the shifts ``shift``: :func:`_ln_cols`'
    lane sums (the first tree level, lane ``j`` plus lane ``j + LANES // 2``, in the
    accumulation type) and tree (float64, in ``tr``)."""
    half = LANES // 2
    m = imin(n, half)
    for j in range(m):
        v = vload(xr, j, c0) - shift
        a = zero + v
        q = fma(v, v, zero)
        if j + half < n:
            v = vload(xr, j + half, c0) - shift
            a = a + (zero + v)
            q = q + fma(v, v, zero)
        vstore(tr, wide(a), j, 0)
        vstore(tr, wide(q), half + j, 0)
    return _short_tree(tr, 0, m), _short_tree(tr, half, m)


@njit(inline="always", error_model="numpy")
def _ln_short_cols(xr, yr, n, c0, wv, bv, eps, cancel, cr, sr, tr, mo, ro, r0, valid):
    """:func:`_ln_cols` for columns ``c0 .. c0+WIDTH`` of a tile of ``n`` <=
    :data:`SHORT_COLUMN_MAX` rows (views ``xr``, ``yr``; ``cr`` the ``(3, WIDTH)``
    statistics scratch, ``sr`` and ``tr`` float64 ones of ``LANES`` rows). A column
    whose ``M2`` cancelled is redone as :func:`.rowmath.redo` redoes it (the block's
    sums again with the shifts moved by the means, taken for those columns). Leaves
    the ``rstd`` of each column in row 1 of ``cr``: one that is not usable
    (:func:`.rescale.usable_rstd`) is the caller's to redo rescaled, as in
    :func:`_ln_cols`."""
    like = eps
    zero = splat(cast(0.0, like))
    inv_n = splat(1.0 / np.float64(n))
    kv = vload(xr, 0, c0)  # the shift K = x[0] of each column
    shift = kv
    mu = m2 = wide(zero)
    # One loop, so that the sums are inlined once: the second iteration (rare) redoes
    # the block with the shifts moved by the means, for the columns that cancelled.
    for attempt in range(2):
        s, ss = _short_sums(xr, n, c0, shift, zero, tr)
        mu = s * inv_n
        m2 = fma(s, mu * splat(-1.0), ss)
        if attempt == 0:
            vstore(sr, mu, 0, 0)
            vstore(sr, m2, 1, 0)
            vstore(sr, ss, 2, 0)
            redo = False
            for k in range(valid):
                redo = redo or get(sr, 1, k) < cancel * get(sr, 2, k)
            if not redo:
                break
            shift = kv + rounded(mu, like)
        else:
            vstore(sr, mu, 3, 0)
            vstore(sr, m2, 4, 0)
            vstore(cr, kv, 2, 0)
            vstore(cr, shift, 0, 0)
            for k in range(valid):
                if get(sr, 1, k) < cancel * get(sr, 2, k):
                    put(sr, 0, k, get(sr, 3, k))
                    m = get(sr, 4, k)
                    put(sr, 1, k, m if not m < 0.0 else 0.0)
                    put(cr, 2, k, get(cr, 0, k))
            mu = vload(sr, 0, 0)
            m2 = vload(sr, 1, 0)
            kv = vload(cr, 2, 0)
    mt = rounded(mu, like)
    rv = rounded(splat(1.0) / sqrt(m2 * inv_n + splat(np.float64(eps))), like)
    vstore(cr, rv, 1, 0)
    vstore(cr, kv + mt, 2, 0)
    for k in range(valid):
        put(mo, 0, r0 + k, get(cr, 2, k))
        put(ro, 0, r0 + k, get(cr, 1, k))
    for i in range(n):
        v = ((vload(xr, i, c0) - kv) - mt) * rv
        vstore(yr, fma(v, splat(widen(get(wv, 0, i))), splat(widen(get(bv, 0, i)))), i, c0)


@callee_njit
def _ln_short_col_item(x, w, b, eps, y, mean_out, rstd_out, tab, scratch, tiles, item):
    lm, lm2, _, cs = scratch
    xt, yt = tiles
    n = x.shape[1]
    inner = x.shape[2]
    o, c0, valid = _loaded_tile(x, xt, item)
    xr, yr, cr, sr, tr = raw(xt), raw(yt), raw(cs), raw(lm), raw(lm2)
    wv, bv, mo, ro = raw(w), raw(b), raw(mean_out), raw(rstd_out)
    cancel = np.float64(tab[0, TAB_CANCEL])
    for s in range(0, valid, WIDTH):
        r0 = o * inner + c0 + s
        count = imin(WIDTH, valid - s)
        _ln_short_cols(xr, yr, n, s, wv, bv, eps, cancel, cr, sr, tr, mo, ro, r0, count)
        for k in range(count):
            if not usable_rstd(get(cr, 1, k)):  # squares overflow or underflow
                ln_column_rescaled(xt, yt, s + k, eps, w, b, mean_out, rstd_out, r0 + k)
    _store_tile(yt, y[o], c0, valid, y.strides[2] == y.itemsize)


@cached_njit(error_model="numpy")
def ln_forward_short_cols_serial(x, w, b, eps, y, mean_out, rstd_out, tab):
    """:func:`ln_forward_cols_serial` for columns of at most :data:`SHORT_COLUMN_MAX`."""
    items, _ = _col_items(x)
    scratch, tiles = _col_scratch(x, y, mean_out.dtype)
    for item in range(items):
        _ln_short_col_item(x, w, b, eps, y, mean_out, rstd_out, tab, scratch, tiles, item)


@cached_njit(parallel=True, error_model="numpy")
def ln_forward_short_cols_parallel(x, w, b, eps, y, mean_out, rstd_out, tab):
    """:func:`ln_forward_cols_parallel` for columns of at most :data:`SHORT_COLUMN_MAX`."""
    items, per_work = _col_items(x)
    for wk in prange((items + per_work - 1) // per_work):
        scratch, tiles = _col_scratch(x, y, mean_out.dtype)
        for item in range(wk * per_work, imin(items, (wk + 1) * per_work)):
            _ln_short_col_item(x, w, b, eps, y, mean_out, rstd_out, tab, scratch, tiles,
                               item)


@njit(inline="always", error_model="numpy")
def _rms_short_cols(xr, yr, n, c0, wv, eps, cr, tr, ro, r0, valid):
    """:func:`_ln_short_cols` for RMSNorm (:func:`_rms_cols`' arithmetic; ``tr`` an
    accumulation-type scratch of ``LANES`` rows)."""
    zero = splat(cast(0.0, eps))
    half = LANES // 2
    m = imin(n, half)
    for j in range(m):
        v = vload(xr, j, c0)
        sq = zero + v * v
        if j + half < n:
            v = vload(xr, j + half, c0)
            sq = sq + (zero + v * v)
        vstore(tr, sq, j, 0)
    ss = _short_tree(tr, 0, m)
    rv = splat(cast(1.0, eps)) / sqrt(ss / splat(cast(n, eps)) + splat(eps))
    vstore(cr, rv, 1, 0)
    for k in range(valid):
        put(ro, 0, r0 + k, get(cr, 1, k))
    for i in range(n):
        vstore(yr, (vload(xr, i, c0) * rv) * splat(widen(get(wv, 0, i))), i, c0)


@callee_njit
def _rms_short_col_item(x, w, eps, y, rstd_out, scratch, tiles, item):
    _, _, lanes, cs = scratch
    xt, yt = tiles
    n = x.shape[1]
    inner = x.shape[2]
    o, c0, valid = _loaded_tile(x, xt, item)
    xr, yr, cr, tr, wv, ro = raw(xt), raw(yt), raw(cs), raw(lanes), raw(w), raw(rstd_out)
    for s in range(0, valid, WIDTH):
        r0 = o * inner + c0 + s
        count = imin(WIDTH, valid - s)
        _rms_short_cols(xr, yr, n, s, wv, eps, cr, tr, ro, r0, count)
        for k in range(count):
            if not usable_rstd(get(cr, 1, k)):  # squares overflow or underflow
                rms_column_rescaled(xt, yt, s + k, eps, w, rstd_out, r0 + k)
    _store_tile(yt, y[o], c0, valid, y.strides[2] == y.itemsize)


@cached_njit(error_model="numpy")
def rms_forward_short_cols_serial(x, w, eps, y, rstd_out):
    """:func:`rms_forward_cols_serial` for columns of at most :data:`SHORT_COLUMN_MAX`."""
    items, _ = _col_items(x)
    scratch, tiles = _col_scratch(x, y, rstd_out.dtype)
    for item in range(items):
        _rms_short_col_item(x, w, eps, y, rstd_out, scratch, tiles, item)


@cached_njit(parallel=True, error_model="numpy")
def rms_forward_short_cols_parallel(x, w, eps, y, rstd_out):
    """:func:`rms_forward_cols_parallel` for columns of at most :data:`SHORT_COLUMN_MAX`."""
    items, per_work = _col_items(x)
    for wk in prange((items + per_work - 1) // per_work):
        scratch, tiles = _col_scratch(x, y, rstd_out.dtype)
        for item in range(wk * per_work, imin(items, (wk + 1) * per_work)):
            _rms_short_col_item(x, w, eps, y, rstd_out, scratch, tiles, item)
