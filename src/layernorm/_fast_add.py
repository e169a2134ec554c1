"""The short path for repeated small NumPy ``add_layer_norm``/``add_rms_norm`` calls.

The fused residual add of one ``(1, 768)`` token takes well under a microsecond in its
kernel and about 30 us in the general path's checks (residual, dtypes, outputs and their
overlaps, then the backend's wrapper): the fused call was several times slower than
``np.add`` followed by the norm's own short path (:mod:`._fast`). As there, the first
call with a given shape, dtype, axes and parameter layout goes through full validation
(:func:`._engine.request`) and leaves an :class:`AddPlan`; a later call that matches it
checks only what can change between such calls (the residual's type, shape, dtype and
contiguity, ``eps``, ``residual_dtype`` and the outputs) and calls the one-pass kernel's
compiled entry point directly (large calls: the backend's serial-or-parallel choice,
with streaming stores where the backend would use them). It runs the kernels of the
general path (:func:`._backends._numba.add_layer_norm_forward`) with the same arguments
and completes rows that overflow the same way, so it gives the same bits.

Eligible: ``x`` and ``residual`` plain C-contiguous NumPy arrays of one shape and one
dtype (``h`` in that dtype), the normalized axes trailing, parameters of the
accumulation dtype, and outputs that are fresh, or plain arrays that are ``x`` or
``residual`` themselves or share no memory with any other argument. Anything else
(other layouts and dtypes, a ``residual_dtype`` of another dtype, an offset gain, a
forced backend, outputs that partly overlap) returns ``None`` and takes the general
path, which also raises every error.

Quantized calls (``quantize=``, :func:`add_norm_quantized`) have their short path too,
for float32 ``x``, residual and parameters, a dynamic or a static scale:
the general path's checks cost a one-row call 35-50 us, a (121, 768) one three times
its kernel. They run the quantizing kernels of :func:`._fast.run_quantized`, with the
residual (the same kernels and arguments as the general path: the same bits).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _engine, _fast
from ._backends import _numba
from ._backends._numba import entry as kernel_entry
from ._dispatch import Route
from ._dtypes import HALF_DTYPES, MACHINE_EPS, dtype_name
from ._plans import accumulation_eps, kernel_ready, params_key, remember_by_shapes
from ._validate import plain_axes

_NUMPY_ROUTE = Route("numpy", "numba")
_FLOAT32 = np.dtype(np.float32)


class AddPlan:
    """What a validated ``add_`` call needs to run again: views, dtypes and kernels.

    ``run`` calls the serial one-pass kernel of the call's row length; after its first
    call it is that kernel's compiled entry point
    (:func:`._backends._numba.entry.resolving`): the plan's checks guarantee that every
    later call passes arrays of the same dtypes and dimensions. Calls of at least
    :data:`._backends._numba.PARALLEL_MIN_ELEMENTS` elements run through the backend's
    serial-or-parallel choice (:class:`._backends._numba.PlannedRows`) instead, and
    ``run_streamed`` is that choice between the kernels that write ``y`` with streaming
    stores.

    Parameters
    ----------
    shape : tuple of int
        Shape of ``x`` (and of ``residual``, ``y`` and ``h``).
    rows, n : int
        Rows of the kernels' 2-D view and their length (the normalized size).
    dtype, acc : str
        Names of x's dtype and of the accumulation dtype.
    stats_shape : tuple of int
        Shape of the returned statistics.
    kernels : module
        The Numba backend's kernels (:func:`._backends._numba.load_kernels`).
    rms : bool
        RMSNorm instead of LayerNorm.
    """

    __slots__ = (
        "acc",
        "bits",
        "default_eps",
        "dtype_name",
        "dtypes",
        "eps_scalars",
        "large",
        "n",
        "negative_zeros",
        "no_stats",
        "ones",
        "rows",
        "run",
        "run_streamed",
        "same_shape",
        "shape2",
        "stats_shape",
        "streams",
        "tab",
        "widen",
    )

    def __init__(self, shape: tuple[int, ...], rows: int, n: int, dtype: str, acc: str,
                 stats_shape: tuple[int, ...], kernels: Any, rms: bool) -> None:
        self.rows, self.n, self.stats_shape, self.dtype_name = rows, n, stats_shape, dtype
        #: Some parameter is float16/bfloat16 (set by :func:`_plan`): widened per call.
        self.widen = False
        #: The dtype objects of x, weight and bias (None if absent) of the call that made
        #: the plan (set by :func:`_plan`), which a call found by its shapes alone must
        #: have.
        self.dtypes: tuple[Any, ...] = (None, None, None)
        self.acc = np.dtype(acc)
        bits = _numba.KERNEL_BITS.get(dtype)
        #: For float16/bfloat16: the dtype of the raw bits the kernels read, else None.
        self.bits = None if bits is None else np.dtype(bits)
        self.shape2 = (rows, n)
        #: x, residual, h and y go to the kernel as they are (no reshape).
        self.same_shape = tuple(shape) == self.shape2
        self.default_eps = MACHINE_EPS[acc]
        self.eps_scalars: dict[float, Any] = {}
        #: Stand-ins for an absent weight or bias (the backend's exact identities).
        self.ones, self.negative_zeros = _numba.kernel_params(None, None, n, self.acc)
        #: Statistics outputs of a call that does not return them: an empty array, which
        #: the kernels skip (the same argument types as a call that returns them).
        self.no_stats = np.empty(0, dtype=self.acc)
        #: The LayerNorm kernels' table of n-dependent weights (None for RMSNorm).
        self.tab = None if rms else kernels.merge_table(n, self.acc)
        size = _numba.param_bytes(self.acc)
        if rms:
            serial, parallel = _numba.add_rms_kernels(kernels, n, False, size)
            streamed = _numba.add_rms_kernels(kernels, n, True, size)
            writes = _numba.ADD_RMS_WRITES
        else:
            serial, parallel = _numba.add_ln_kernels(kernels, n, False, size)
            streamed = _numba.add_ln_kernels(kernels, n, True, size)
            writes = _numba.ADD_LN_WRITES
        #: Large calls: the backend picks serial or parallel, plain or streaming stores.
        self.large = rows * n >= _numba.PARALLEL_MIN_ELEMENTS
        #: Large calls whose output is large enough for streaming stores (unless y
        #: overlaps x or the residual): :func:`._backends._numba.streams_by_size`, once.
        itemsize = (np.dtype(dtype) if bits is None else self.bits).itemsize
        self.streams = self.large and _numba.streams_by_size(n, rows * n * itemsize)
        self.run_streamed = None
        if self.large:
            self.run = _numba.PlannedRows(serial, parallel, writes)
            self.run_streamed = _numba.PlannedRows(*streamed, writes)
        else:
            self.run = kernel_entry.resolving(self, "run", serial, writes)


_PLANS: dict[tuple[Any, ...], AddPlan | None] = {}


def _plan(x: Any, normalized_shape: Any, axis: Any, weight: Any, bias: Any,
          rms: bool) -> AddPlan | None:
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    req = _engine.request(x, _NUMPY_ROUTE, normalized_shape, axis, **params)
    layout = req.layout
    names = [dtype_name(p.dtype) for p in params.values() if p is not None]
    if (layout.perm is not None or layout.inner != 1 or layout.n == 0 or layout.rows == 0
            or any(name != req.acc and not (req.acc == "float32" and name in HALF_DTYPES)
                   for name in names)):
        return None
    plan = AddPlan(layout.shape, layout.rows, layout.n, req.dtype, req.acc,
                   layout.stats_shape, _numba.load_kernels(), rms)
    plan.widen = any(name in HALF_DTYPES for name in names)
    plan.dtypes = (x.dtype, *(None if p is None else p.dtype for p in (weight, bias)))
    return plan


def _lookup(shapes: tuple[Any, ...], x: Any, normalized_shape: Any, axis: Any, weight: Any,
            bias: Any, rms: bool) -> AddPlan | None:
    """The plan under the full key (shapes and dtypes; made on a first call), also
    remembered under ``shapes``; None if the call cannot take the short path (see
    :func:`._fast._lookup`)."""
    key = (rms, x.shape, x.dtype, normalized_shape, axis, *params_key(weight, bias))
    return remember_by_shapes(_PLANS, key, shapes,
                              lambda: _plan(x, normalized_shape, axis, weight, bias, rms))


def _keeps_dtype(residual_dtype: Any, dtype: np.dtype) -> bool:
    """``residual_dtype`` names the residual's own dtype ``dtype`` (a dtype, its name or
    type)."""
    if type(residual_dtype) is str:
        return residual_dtype == dtype_name(dtype)
    if type(residual_dtype) is type(dtype):
        return residual_dtype == dtype
    return residual_dtype is dtype.type


def _usable_out(out: Any, x: Any, residual: Any, inputs: tuple[tuple[Any, bool], ...]) -> bool:
    """``out`` (for ``y`` or ``h``) is a plain NumPy array of x's shape and dtype,
    C-contiguous, aligned and writeable, that is ``x`` or ``residual`` itself (in place:
    the kernels read a block's rows before they write them) or shares no memory with it,
    and shares none with the other ``inputs`` (``(array, owns its data)`` pairs)."""
    if type(out) is not np.ndarray or out.shape != x.shape or out.dtype != x.dtype:
        return False
    flags = out.flags
    if not (kernel_ready(out) and flags.writeable):
        return False
    owns = flags.owndata
    for arr, arr_owns in inputs:
        # Two arrays that each own their memory are two allocations: nothing to look for
        # (np.may_share_memory costs a tenth of a one-row call).
        if arr is out:
            if arr is not x and arr is not residual:
                return False
        elif not (owns and arr_owns) and np.may_share_memory(out, arr):
            return False
    return True


def _outputs(x: Any, residual: Any, weight: Any, bias: Any, out: Any,
             residual_out: Any) -> tuple[Any, Any] | None:
    """``(y, h)``: ``out`` and ``residual_out`` where given and usable
    (:func:`_usable_out`, and not the same memory), new arrays where not given; None if
    a given one is not usable (the general path copies through temporaries, or raises)."""
    inputs = tuple((a, a.flags.owndata) for a in (x, residual, weight, bias)
                   if a is not None)
    y = h = None
    if out is not None:
        if not _usable_out(out, x, residual, inputs):
            return None
        y = out
    if residual_out is not None:
        if residual_out is out:
            return None  # y and h need separate arrays: the general path says so
        if y is not None:
            inputs = (*inputs, (y, y.flags.owndata))
        if not _usable_out(residual_out, x, residual, inputs):
            return None
        h = residual_out
    if y is None:
        y = np.empty(x.shape, x.dtype)
    if h is None:
        h = np.empty(x.shape, x.dtype)
    return y, h


def add_norm(x: Any, residual: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any,
             axis: Any, residual_dtype: Any, return_stats: bool, out: Any, residual_out: Any,
             rms: bool) -> Any:
    """The result of :func:`layernorm.add_layer_norm` (``rms``:
    :func:`layernorm.add_rms_norm`, ``bias`` None) for a known call, else None.

    The caller has checked that ``x`` is a NumPy array, that no backend is forced, that
    ``quantize`` and ``scale`` are None and that any ``weight_offset`` is folded into
    ``weight`` (:func:`._fast.offset_weight`).

    Parameters
    ----------
    x, residual, normalized_shape, weight, bias, eps, axis, residual_dtype, return_stats, \
out, residual_out
        As given to the public function.
    rms : bool
        RMSNorm instead of LayerNorm.

    Returns
    -------
    tuple or None
        ``(y, h)``, then ``(mean, rstd)`` (RMSNorm: ``(rstd,)``) with ``return_stats``;
        or None: the call takes the general path.
    """
    if ((normalized_shape is not None and type(normalized_shape) is not int
            and not plain_axes(normalized_shape))
            or (axis is not None and type(axis) is not int and not plain_axes(axis))):
        return None
    # Found by the shapes alone, dtypes compared by identity (as :mod:`._fast` does:
    # hashing dtypes costs a cache-resident call a microsecond).
    if weight is None:
        wshape = None
    elif type(weight) is np.ndarray and kernel_ready(weight):
        wshape = weight.shape
    else:
        return None
    if bias is None:
        bshape = None
    elif type(bias) is np.ndarray and kernel_ready(bias):
        bshape = bias.shape
    else:
        return None
    shapes = (rms, x.shape, normalized_shape, axis, wshape, bshape)
    try:
        plan = _PLANS.get(shapes)
    except TypeError:  # unhashable normalized_shape
        return None
    if (plan is None or plan.dtypes[0] is not x.dtype
            or (wshape is not None and plan.dtypes[1] is not weight.dtype)
            or (bshape is not None and plan.dtypes[2] is not bias.dtype)):
        plan = _lookup(shapes, x, normalized_shape, axis, weight, bias, rms)
        if plan is None:
            return None
    if (not kernel_ready(x) or type(residual) is not np.ndarray
            or residual.shape != x.shape or residual.dtype != x.dtype
            or not kernel_ready(residual)):
        return None
    if residual_dtype is not None and not _keeps_dtype(residual_dtype, x.dtype):
        return None
    if eps is None and rms:
        eps = plan.default_eps
    e = plan.eps_scalars.get(eps) if type(eps) is float else None
    if e is None and (e := accumulation_eps(plan, eps)) is None:
        return None
    if out is None and residual_out is None:
        y, h = np.empty(x.shape, x.dtype), np.empty(x.shape, x.dtype)
    else:
        outputs = _outputs(x, residual, weight, bias, out, residual_out)
        if outputs is None:
            return None
        y, h = outputs
    if plan.same_shape and plan.bits is None:
        x2, r2, h2, y2 = x, residual, h, y
    else:
        shape2 = plan.shape2
        x2, r2 = x.reshape(shape2), residual.reshape(shape2)
        h2, y2 = h.reshape(shape2), y.reshape(shape2)
        if plan.bits is not None:
            bits = plan.bits
            x2, r2, h2, y2 = x2.view(bits), r2.view(bits), h2.view(bits), y2.view(bits)
    if plan.widen:
        # float16/bfloat16 parameters: widened exactly, as the general path does.
        w, b = _numba.kernel_params(None if weight is None else weight.reshape(-1),
                                    None if bias is None else bias.reshape(-1), plan.n,
                                    plan.acc)
    else:
        w = (plan.ones if weight is None
             else weight if weight.ndim == 1 else weight.reshape(-1))
        b = (plan.negative_zeros if bias is None
             else bias if bias.ndim == 1 else bias.reshape(-1))
    nt = (plan.streams and not np.may_share_memory(x2, y2)
          and not np.may_share_memory(r2, y2))
    run = plan.run_streamed if nt else plan.run
    if rms:
        if return_stats:
            rstd = np.empty(plan.stats_shape, plan.acc)
            args = (x2, r2, w, e, h2, y2, rstd.reshape(-1), nt)
        else:
            args = (x2, r2, w, e, h2, y2, plan.no_stats, nt)
        stopped = run(*args)
        if stopped is not None and (type(stopped) is not int or stopped):
            _numba.complete_add_rms_norm_rows(stopped, args)
        return (y, h, rstd) if return_stats else (y, h)
    if return_stats:
        mean = np.empty(plan.stats_shape, plan.acc)
        rstd = np.empty(plan.stats_shape, plan.acc)
        args = (x2, r2, w, b, e, h2, y2, mean.reshape(-1), rstd.reshape(-1), plan.tab, nt)
    else:
        args = (x2, r2, w, b, e, h2, y2, plan.no_stats, plan.no_stats, plan.tab, nt)
    stopped = run(*args)
    # A serial kernel's count of stopped blocks, or a parallel one's (stop, end) pairs
    # (None if none).
    if stopped is not None and (type(stopped) is not int or stopped):
        _numba.complete_add_layer_norm_rows(stopped, args)
    return (y, h, mean, rstd) if return_stats else (y, h)


_QUANT_PLANS: dict[tuple[Any, ...], _fast.QuantPlan | None] = {}


def _usable_codes(out: Any, x: Any, dtype: Any, others: tuple[Any, ...]) -> bool:
    """``out`` (for the 8-bit codes) is a plain NumPy array of x's shape and ``dtype``,
    C-contiguous, aligned and writeable, sharing no memory with any of ``others``."""
    if type(out) is not np.ndarray or out.shape != x.shape or out.dtype != dtype:
        return False
    flags = out.flags
    if not (kernel_ready(out) and flags.writeable):
        return False
    owns = flags.owndata
    return all(arr is not out and ((owns and arr.flags.owndata)
                                   or not np.may_share_memory(out, arr))
               for arr in others)


def add_norm_quantized(x: Any, residual: Any, normalized_shape: Any, weight: Any, bias: Any,
                       eps: Any, axis: Any, residual_dtype: Any, quantize: Any, scale: Any,
                       return_stats: bool, out: Any, residual_out: Any, rms: bool) -> Any:
    """The result of a known ``add_`` call with ``quantize=`` (``rms``:
    :func:`layernorm.add_rms_norm`, ``bias`` None), else None.

    The caller has checked that ``x`` is a NumPy array, that no backend is forced and
    that any ``weight_offset`` is folded into ``weight`` (:func:`._fast.offset_weight`).
    Eligible: float32 ``x``, residual and parameters (``h`` float32), ``scale`` as
    :func:`._fast.short_path_scale` allows, the normalized axes trailing, ``out`` (the
    codes) sharing memory with no other argument and ``residual_out`` as in
    :func:`add_norm`.

    Returns
    -------
    tuple or None
        ``(y, h, scale)``, then ``(mean, rstd)`` (RMSNorm: ``(rstd,)``) with
        ``return_stats``; or None: the call takes the general path.
    """
    if (type(residual) is not np.ndarray or residual.shape != x.shape
            or residual.dtype is not _FLOAT32 or not kernel_ready(residual)
            or (residual_dtype is not None and not _keeps_dtype(residual_dtype, _FLOAT32))):
        return None
    # (x, weight and bias are checked there: float32, their layouts usable)
    plan = _fast.find_quant_plan(_QUANT_PLANS, x, normalized_shape, weight, bias, axis,
                                 quantize, scale, rms)
    if plan is None:
        return None
    params = [p for p in (weight, bias) if p is not None]
    inputs = tuple((a, a.flags.owndata) for a in (x, residual, *params))
    if residual_out is None:
        h = np.empty(x.shape, _FLOAT32)
    elif residual_out is not out and _usable_out(residual_out, x, residual, inputs):
        h = residual_out
    else:
        return None
    if out is None:
        q = np.empty(x.shape, plan.qdtype)
    elif not _usable_codes(out, x, plan.qdtype, (x, residual, h, *params)):
        return None
    else:
        q = out
    tail = _fast.run_quantized(plan, x, residual, h, q, weight, bias, eps, scale,
                               return_stats)
    return None if tail is None else (q, h, *tail)
