"""Dask adapter: lazy LayerNorm/RMSNorm over row chunks, one kernel call per block.

The normalized axes are rechunked into a single block (rows are independent, so every
block holds whole rows) and each block is handed to the engine, which runs the Numba
kernels on NumPy blocks (the CUDA kernels on CuPy blocks). Nothing is computed until
the user asks, and nothing but the blocks' results moves between tasks, so the same
graph runs on the threaded scheduler or on a ``dask.distributed`` cluster, for arrays
larger than any one machine's memory.

When rechunking is needed, the other axes are re-split ("auto") so that blocks stay
about as large as the input's largest block; if a block must still exceed
:data:`BLOCK_WARN_BYTES` (rows that are themselves huge), a :class:`LargeBlockWarning`
says so.

The backward returns ``grad_x`` lazily, block by block, and ``grad_weight`` /
``grad_bias`` as one task that adds the per-block partial sums (in the accumulation
dtype) in C order of the block grid: the result is deterministic for a given chunking,
whatever the scheduler or the number of workers.
"""

from __future__ import annotations

import math
import operator
import warnings
from typing import Any

import numpy as np

from .. import _engine
from .._dispatch import Route, check_companions, describe, given_array, library_of, route
from .._dtypes import accumulation_name
from .._validate import check_given

#: Blocks larger than this after rechunking the normalized axes raise a warning.
BLOCK_WARN_BYTES = 256 * 2**20


class LargeBlockWarning(UserWarning):
    """Rechunking the normalized axes into one block made blocks very large."""


# --------------------------------------------------------------------------- block functions
# Module-level functions: a distributed worker unpickles them by reference.


def _forward_block(xb: Any, wb: Any, bb: Any, *, rms: bool, axes: tuple[int, ...], eps: Any,
                   backend: Any, stats: bool) -> Any:
    y, mean, rstd = _engine.normalize(xb, route(xb, backend), None, wb, bb, eps, axes, None,
                                      rms, stats)
    if not stats:
        return y
    return (y, rstd) if rms else (y, mean, rstd)


def _fused_block(xb: Any, rb: Any, wb: Any, bb: Any, sb: Any, *, rms: bool,
                 axes: tuple[int, ...], eps: Any, backend: Any, weight_offset: float,
                 residual_dtype: Any, quantize: Any, scale: Any, stats: bool) -> tuple[Any, ...]:
    """One block of a forward with a residual, an offset or quantize: every output."""
    if sb is not None:
        scale = sb
    where = route(xb, backend)
    if rb is None:
        y, s, mean, rstd = _engine.normalize_ex(xb, where, None, wb, bb, eps, axes, None, rms,
                                                stats, weight_offset, quantize, scale)
        h = None
    else:
        y, h, s, mean, rstd = _engine.add_normalize(xb, rb, where, None, wb, bb, eps, axes, rms,
                                                    stats, weight_offset, residual_dtype,
                                                    quantize, scale, None, None)
    return y, h, s, mean, rstd


def _backward_block(gyb: Any, xb: Any, mb: Any, rb: Any, wb: Any, grb: Any = None, *,
                    rms: bool, axes: tuple[int, ...], acc: str, backend: Any,
                    weight_offset: float = 0.0) -> tuple[Any, ...]:
    from array_api_compat import array_namespace

    xp = array_namespace(xb)
    pshape = tuple(xb.shape[a] for a in axes)
    # Partials stay in the accumulation dtype until the final ordered sum: a weight in
    # that dtype (ones for no weight, which multiplies exactly) makes the API return them so.
    w = xp.ones(pshape, dtype=acc) if wb is None else wb.astype(acc)
    keep = tuple(s if i in axes else 1 for i, s in enumerate(xb.shape))
    grads = _engine.gradients(gyb, xb, route(xb, backend), mb, rb, w, None, axes, rms,
                              weight_offset, grb)
    return grads[0], *(g.reshape(keep) for g in grads[1:])


def _sum_in_block_order(parts: Any, *, axes: tuple[int, ...], out_dtype: Any) -> Any:
    """Add per-block partials (one per block along the non-normalized axes) in C order."""
    other = tuple(i for i in range(parts.ndim) if i not in axes)
    pshape = tuple(parts.shape[a] for a in axes)
    # The block count is spelled out: -1 cannot be inferred when a normalized size is 0.
    blocks = math.prod(parts.shape[i] for i in other)
    stacked = parts.transpose(other + axes).reshape((blocks, *pshape))
    total = stacked[0].copy()
    for part in stacked[1:]:
        total += part
    return total.astype(out_dtype)


# --------------------------------------------------------------------------- helpers


def _da() -> Any:
    import dask.array as da

    return da


def _meta(x: Any, ndim: int, dtype: Any) -> Any:
    from dask.array.utils import meta_from_array

    return meta_from_array(x, ndim=ndim, dtype=dtype)


def _block_library(x: Any) -> str:
    meta = getattr(x, "_meta", None)
    return "numpy" if meta is None else library_of(meta)


#: Arguments that share x's rows (every non-normalized axis): with a Dask x whose row
#: counts are unknown (NaN chunk sizes, as after boolean indexing), these may have
#: unknown sizes too, on the same axes and in as many chunks; every other array
#: argument (weight, bias, scale) must have known sizes.
_ROW_COMPANIONS = ("residual", "grad_y", "grad_residual", "mean", "rstd")


def _unknown_axes(arr: Any) -> tuple[int, ...]:
    """Axes of ``arr`` (a Dask array) whose chunk sizes are unknown (NaN); () for others."""
    return tuple(i for i, s in enumerate(getattr(arr, "shape", ()))
                 if isinstance(s, float) and math.isnan(s))


def _check_known_shape(x: Any, name: str = "x") -> None:
    if _unknown_axes(x):
        raise ValueError(
            f"{name} has unknown chunk sizes (shape {x.shape}); call "
            f"{name}.compute_chunk_sizes() first"
        )


def _check_like_x(x: Any, arr: Any, name: str) -> None:
    """A row companion of ``x`` has unknown sizes exactly where ``x`` has, along which
    both have as many chunks (blockwise pairs their blocks; each block's call then
    checks that the sizes agree)."""
    mine, xs = set(_unknown_axes(arr)), set(_unknown_axes(x))
    if mine - xs:
        _check_known_shape(arr, name)
    if not xs:
        return
    if getattr(arr, "ndim", None) != x.ndim or xs - mine:
        raise ValueError(
            f"x has unknown chunk sizes along axes {sorted(xs)} (shape {x.shape}), so "
            f"{name} must be a Dask array with x's number of dimensions and unknown chunk "
            f"sizes along the same axes; got {describe(arr)} of shape {arr.shape} (or call "
            f"x.compute_chunk_sizes() and pass arrays of known shape)"
        )
    for i in sorted(xs):
        if len(arr.chunks[i]) != len(x.chunks[i]):
            raise ValueError(
                f"{name} has {len(arr.chunks[i])} chunks of unknown size along axis {i} "
                f"where x has {len(x.chunks[i])}; pass arrays chunked alike along axes "
                f"of unknown size (or call compute_chunk_sizes() on both)"
            )


def _check_rows_known(x: Any, normalized_shape: Any, axis: Any) -> None:
    """The normalized axes of ``x`` have known sizes (the kernels need whole rows of a
    known length); only the other axes may be unknown."""
    unknown = _unknown_axes(x)
    if not unknown:
        return
    ndim = x.ndim
    try:
        if axis is not None:
            given = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
            axes = {int(a) % ndim for a in given if -ndim <= int(a) < ndim}
        elif normalized_shape is not None:
            count = (1 if isinstance(normalized_shape, (int, np.integer))
                     else len(tuple(normalized_shape)))
            axes = set(range(max(ndim - count, 0), ndim))
        else:
            axes = {ndim - 1}
    except (TypeError, ValueError):  # not axes at all: the engine's error
        return
    bad = sorted(axes.intersection(unknown))
    if bad:
        raise ValueError(
            f"x has unknown chunk sizes along the normalized axes {bad} (shape {x.shape}); "
            f"call x.compute_chunk_sizes() first (only the other axes may be unknown)"
        )


def _standin(arr: Any) -> Any:
    """``arr``, or for a Dask array with unknown sizes a NumPy array of its dtype that
    takes no memory, each unknown size as 1: what the engine's checks of shapes and
    dtypes see (:func:`_check_like_x` has checked the unknown axes)."""
    unknown = _unknown_axes(arr)
    if not unknown:
        return arr
    shape = tuple(1 if i in unknown else int(s) for i, s in enumerate(arr.shape))
    return np.broadcast_to(np.zeros((), arr.dtype), shape)


class _UnknownSizesShown:
    """Re-raises the engine's ValueError or TypeError about a call on :func:`_standin`
    shapes with a note that the unknown sizes of ``x`` appear as 1 in it."""

    def __init__(self, x: Any) -> None:
        self.x = x

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if kind in (ValueError, TypeError) and _unknown_axes(self.x):
            raise kind(f"{error} (x has shape {self.x.shape}: its unknown chunk sizes "
                       f"appear as 1 here)") from error


def _check_common(x: Any, out: Any, **others: Any) -> str:
    """Library/meta checks shared by every entry point; returns the blocks' library."""
    check_companions(x, "dask", **others)
    if out is not None:
        raise TypeError(
            "out= is not supported for Dask arrays (they are immutable); store the lazy "
            "result with dask.array.store instead"
        )
    blocks = _block_library(x)
    for name, arr in others.items():
        if arr is None:
            continue
        lib = library_of(arr)
        if name in _ROW_COMPANIONS:
            _check_like_x(x, arr, name)
        elif lib == "dask":
            _check_known_shape(arr, name)
        if lib == "dask":
            lib = _block_library(arr)
        if lib != blocks:
            raise TypeError(
                f"{name} holds {lib} data but the blocks of x are {blocks} arrays "
                f"({describe(arr)} with {describe(x)}); pass arrays of one library"
            )
    return blocks


def _rows_rechunked(x: Any, axes: tuple[int, ...]) -> Any:
    """``x`` with every normalized axis in one block, blocks kept about the input's size
    (with unknown row counts, :func:`_unknown_axes`, the other axes as they are)."""
    if all(len(x.chunks[a]) <= 1 for a in axes):
        return x
    if _unknown_axes(x):
        return x.rechunk({a: x.shape[a] for a in axes})
    itemsize = x.dtype.itemsize
    target = max(_largest_block_bytes(x), 1)
    block = [max(c) if c else 0 for c in x.chunks]
    spec: dict[int, int] = {}
    for a in axes:
        block[a] = spec[a] = x.shape[a]
    # Merging the normalized axes grows blocks; split the outer axes (batch first) until
    # they are back to the input's largest block, leaving the other axes as they were.
    for i in (i for i in range(x.ndim) if i not in axes):
        size = math.prod(block) * itemsize
        if size <= target:
            break
        block[i] = spec[i] = max(1, block[i] // -(-size // target))
    y = x.rechunk(spec)
    biggest = _largest_block_bytes(y)
    if biggest > BLOCK_WARN_BYTES:
        warnings.warn(
            f"layernorm: putting the normalized axes {axes} of a Dask array of shape "
            f"{x.shape} into one block makes blocks of {biggest / 2**20:.0f} MiB (more than "
            f"{BLOCK_WARN_BYTES / 2**20:.0f} MiB); each task needs whole rows in memory",
            LargeBlockWarning,
            stacklevel=4,
        )
    return y


def _largest_block_bytes(x: Any) -> int:
    return math.prod(max(c) if c else 0 for c in x.chunks) * x.dtype.itemsize


def _as_dask(arr: Any, chunks: Any) -> Any:
    da = _da()
    if arr is None:
        return None
    if isinstance(arr, da.Array):
        return arr.rechunk(chunks)
    return da.from_array(arr, chunks=chunks)


def _param(p: Any) -> Any:
    if p is None:
        return None
    return _as_dask(p, tuple((s,) for s in p.shape))


def _stats_chunks(chunks: Any, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple((1,) if i in axes else c for i, c in enumerate(chunks))


def _args(pairs: list[tuple[Any, Any]]) -> list[Any]:
    flat: list[Any] = []
    for arr, ind in pairs:
        flat += [arr, None if arr is None else ind]
    return flat


def _pick(tmp: Any, i: int, chunks: Any, dtype: Any) -> Any:
    return tmp.map_blocks(operator.getitem, i, chunks=chunks, dtype=dtype,
                          meta=_meta(tmp._meta, tmp.ndim, dtype))


# --------------------------------------------------------------------------- forward


def _forward(rms: bool, x: Any, dask_route: Route, ns: Any, weight: Any, bias: Any, eps: Any,
             axis: Any, return_stats: bool, out: Any, backend: Any) -> Any:
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    _check_common(x, out, **params)
    _check_rows_known(x, ns, axis)
    with _UnknownSizesShown(x):
        req = _engine.request(_standin(x), dask_route, ns, axis, **params)
    eps = _engine.resolve_eps(eps, req, rms)
    axes = req.layout.axes
    xr = _rows_rechunked(x, axes)
    ind = tuple(range(x.ndim))
    pairs = [(xr, ind), (_param(weight), axes), (_param(bias), axes)]
    da = _da()
    kwargs = {"rms": rms, "axes": axes, "eps": eps, "backend": backend}
    name = "rms_norm" if rms else "layer_norm"
    if not return_stats:
        return da.blockwise(_forward_block, ind, *_args(pairs), dtype=x.dtype, stats=False,
                            meta=_meta(xr._meta, x.ndim, x.dtype), token=name, **kwargs)
    tmp = da.blockwise(_forward_block, ind, *_args(pairs), dtype=x.dtype, stats=True,
                       meta=_meta(xr._meta, x.ndim, x.dtype), token=f"{name}-stats", **kwargs)
    y = _pick(tmp, 0, xr.chunks, x.dtype)
    stats_chunks = _stats_chunks(xr.chunks, axes)
    acc = np.dtype(req.acc)
    if rms:
        return y, _pick(tmp, 1, stats_chunks, acc)
    return y, _pick(tmp, 1, stats_chunks, acc), _pick(tmp, 2, stats_chunks, acc)


def _fused(rms: bool, x: Any, residual: Any, dask_route: Route, ns: Any, weight: Any,
           bias: Any, eps: Any, axis: Any, return_stats: bool, backend: Any, weight_offset: Any,
           residual_dtype: Any, quantize: Any, scale: Any, out: Any = None,
           residual_out: Any = None) -> Any:
    """A lazy forward with a residual, an offset or quantize: blockwise over the engine."""
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    _check_common(x, out, **params, **({} if residual is None else {"residual": residual}))
    if residual_out is not None:
        raise TypeError(
            "residual_out= is not supported for Dask arrays (they are immutable); store the "
            "lazy h with dask.array.store instead"
        )
    _check_rows_known(x, ns, axis)
    with _UnknownSizesShown(x):
        req = _engine.request(_standin(x), dask_route, ns, axis, **params)
    y_dtype = x.dtype
    h_dtype = None
    stats_req = req
    if residual is not None:
        with _UnknownSizesShown(x):
            r_name = _engine.check_residual(_standin(residual), req)
        _, h_name = _engine.sum_dtypes(req.dtype, r_name, residual_dtype)
        h_dtype = _engine.dtype_of(np, h_name)
        stats_req = _engine.Request(req.layout, h_name, accumulation_name(h_name), req.backend)
    eps = _engine.resolve_eps(eps, stats_req, rms)
    scale_array = given_array(scale)
    lazy_scale = scale_array is not None and library_of(scale_array, "scale") == "dask"
    if lazy_scale:
        _check_known_shape(scale_array, "scale")
    if scale_array is not None and _unknown_axes(x):
        raise ValueError(
            f"scale= as an array needs x's row counts, but x has unknown chunk sizes "
            f"(shape {x.shape}); pass a float scale or call x.compute_chunk_sizes() first"
        )
    check_companions(x, "dask", scale=scale_array)
    offset, quantize = _engine.check_extras(np, req, weight, weight_offset, quantize, scale,
                                            None)
    if quantize is not None:
        y_dtype = _engine.dtype_of(np, quantize)
    axes = req.layout.axes
    xr = _rows_rechunked(x, axes)
    stats_chunks = _stats_chunks(xr.chunks, axes)
    ind = tuple(range(x.ndim))
    da = _da()
    static = None
    if scale_array is not None:  # a Dask scale's values are checked block by block
        broadcast = da.broadcast_to if lazy_scale else np.broadcast_to
        static = _as_dask(broadcast(scale, req.layout.stats_shape), stats_chunks)
    pairs = [(xr, ind), (_as_dask(residual, xr.chunks), ind), (_param(weight), axes),
             (_param(bias), axes), (static, ind)]
    tmp = da.blockwise(_fused_block, ind, *_args(pairs), dtype=y_dtype,
                       meta=_meta(xr._meta, x.ndim, y_dtype),
                       token="add_norm" if residual is not None else "norm_ex", rms=rms,
                       axes=axes, eps=eps, backend=backend, weight_offset=offset,
                       residual_dtype=residual_dtype, quantize=quantize,
                       scale=None if static is not None else scale, stats=return_stats)
    y = _pick(tmp, 0, xr.chunks, y_dtype)
    h = None if residual is None else _pick(tmp, 1, xr.chunks, h_dtype)
    acc = np.dtype(stats_req.acc)
    s = None
    if quantize is not None:
        s = scale if scale is not None else _pick(tmp, 2, stats_chunks, acc)
    mean = rstd = None
    if return_stats:
        mean = None if rms else _pick(tmp, 3, stats_chunks, acc)
        rstd = _pick(tmp, 4, stats_chunks, acc)
    return _engine.results(y, h, s, mean, rstd, quantize, return_stats, rms,
                           add=residual is not None)


def _plain(weight_offset: Any, quantize: Any, scale: Any) -> bool:
    return (quantize is None and scale is None and type(weight_offset) is float
            and weight_offset == 0.0)


def layer_norm(x: Any, dask_route: Route, normalized_shape: Any, weight: Any, bias: Any,
               eps: Any, *, axis: Any, return_stats: bool, out: Any, backend: Any,
               weight_offset: Any = 0.0, quantize: Any = None, scale: Any = None) -> Any:
    """:func:`layernorm.layer_norm` for a Dask array: lazy Dask arrays back.

    ``dask_route`` is the call's route; ``backend`` the forced name each block re-routes by.
    """
    if not _plain(weight_offset, quantize, scale):
        return _fused(False, x, None, dask_route, normalized_shape, weight, bias, eps, axis,
                      return_stats, backend, weight_offset, None, quantize, scale, out)
    return _forward(False, x, dask_route, normalized_shape, weight, bias, eps, axis,
                    return_stats, out, backend)


def rms_norm(x: Any, dask_route: Route, normalized_shape: Any, weight: Any, eps: Any, *,
             axis: Any, return_stats: bool, out: Any, backend: Any, weight_offset: Any = 0.0,
             quantize: Any = None, scale: Any = None) -> Any:
    """:func:`layernorm.rms_norm` for a Dask array: lazy Dask arrays back."""
    if not _plain(weight_offset, quantize, scale):
        return _fused(True, x, None, dask_route, normalized_shape, weight, None, eps, axis,
                      return_stats, backend, weight_offset, None, quantize, scale, out)
    return _forward(True, x, dask_route, normalized_shape, weight, None, eps, axis,
                    return_stats, out, backend)


def add_norm(x: Any, residual: Any, dask_route: Route, normalized_shape: Any, weight: Any,
             bias: Any, eps: Any, *, axis: Any, rms: bool, backend: Any, weight_offset: Any,
             residual_dtype: Any, quantize: Any, scale: Any, return_stats: bool, out: Any,
             residual_out: Any) -> Any:
    """:func:`layernorm.add_layer_norm` / :func:`layernorm.add_rms_norm` for Dask arrays:
    ``h`` and ``y`` (and the per-row scales) lazily, block by block."""
    # _fused reads a None residual as none at all (the plain forwards' fused path).
    check_given(residual, "residual", f"an array of x's shape {tuple(x.shape)}")
    return _fused(rms, x, residual, dask_route, normalized_shape, weight,
                  None if rms else bias, eps, axis, return_stats, backend, weight_offset,
                  residual_dtype, quantize, scale, out, residual_out)


# --------------------------------------------------------------------------- backward


def _backward(rms: bool, grad_y: Any, x: Any, dask_route: Route, mean: Any, rstd: Any,
              weight: Any, ns: Any, axis: Any, backend: Any, weight_offset: Any = 0.0,
              grad_residual: Any = None) -> tuple[Any, ...]:
    stats = {"rstd": rstd} if rms else {"mean": mean, "rstd": rstd}
    extra = {} if grad_residual is None else {"grad_residual": grad_residual}
    _check_common(x, None, grad_y=grad_y, weight=weight, **stats, **extra)
    _check_rows_known(x, ns, axis)
    with _UnknownSizesShown(x):
        req = _engine.request(_standin(x), dask_route, ns, axis, weight=weight)
        _engine.check_backward(_standin(grad_y), req,
                               **{k: _standin(v) for k, v in stats.items()})
        _engine.check_grad_residual(_standin(grad_residual), req)
    offset = _engine.check_weight_offset(weight_offset, weight is not None, req.acc)
    axes = req.layout.axes
    xr = _rows_rechunked(x, axes)
    stats_chunks = _stats_chunks(xr.chunks, axes)
    ind = tuple(range(x.ndim))
    pairs = [
        (_as_dask(grad_y, xr.chunks), ind),
        (xr, ind),
        (_as_dask(mean, stats_chunks), ind),
        (_as_dask(rstd, stats_chunks), ind),
        (_param(weight), axes),
        (_as_dask(grad_residual, xr.chunks), ind),
    ]
    da = _da()
    acc = np.dtype(req.acc)
    tmp = da.blockwise(_backward_block, ind, *_args(pairs), dtype=x.dtype,
                       meta=_meta(xr._meta, x.ndim, x.dtype), rms=rms, axes=axes,
                       acc=req.acc, backend=backend, weight_offset=offset,
                       token="rms_norm_backward" if rms else "layer_norm_backward")
    grad_x = _pick(tmp, 0, xr.chunks, x.dtype)
    part_chunks = tuple(c if i in axes else (1,) * len(c) for i, c in enumerate(xr.chunks))
    pdtype = (weight if weight is not None else x).dtype
    other = tuple(i for i in range(x.ndim) if i not in axes)

    def reduce(i: int) -> Any:
        parts = _pick(tmp, i, part_chunks, acc).rechunk(-1)
        return parts.map_blocks(_sum_in_block_order, axes=axes, out_dtype=pdtype, dtype=pdtype,
                                drop_axis=other, chunks=tuple((s,) for s in req.layout.param_shape),
                                meta=_meta(parts._meta, len(axes), pdtype))

    if rms:
        return grad_x, reduce(1)
    return grad_x, reduce(1), reduce(2)


def layer_norm_backward(grad_y: Any, x: Any, dask_route: Route, mean: Any, rstd: Any,
                        weight: Any, normalized_shape: Any, *, axis: Any, backend: Any,
                        weight_offset: Any = 0.0, grad_residual: Any = None) -> tuple[Any, ...]:
    """:func:`layernorm.layer_norm_backward` for Dask arrays: lazy gradients."""
    return _backward(False, grad_y, x, dask_route, mean, rstd, weight, normalized_shape, axis,
                     backend, weight_offset, grad_residual)


def rms_norm_backward(grad_y: Any, x: Any, dask_route: Route, rstd: Any, weight: Any,
                      normalized_shape: Any, *, axis: Any, backend: Any,
                      weight_offset: Any = 0.0, grad_residual: Any = None) -> tuple[Any, ...]:
    """:func:`layernorm.rms_norm_backward` for Dask arrays: lazy gradients."""
    return _backward(True, grad_y, x, dask_route, None, rstd, weight, normalized_shape, axis,
                     backend, weight_offset, grad_residual)
