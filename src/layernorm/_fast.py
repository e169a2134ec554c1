"""The short path for repeated small NumPy forward calls.

One token of a transformer is a ``(1, 768)`` row: its kernel takes a third of a
microsecond, so validation, dispatch and allocation would dominate the call; a
cache-resident batch of 128 KiB takes about 20 us in its kernel, as long as the
general path's validation. The first
call with a given shape, dtype and parameter layout goes through full validation
(:func:`._engine.request`) and leaves a :class:`Plan`; a later call that matches it checks
only what can change between such calls (contiguity and alignment, ``eps``, ``out``) and
calls the serial Numba kernel directly (for large calls, the backend's serial-or-parallel choice).
Anything else (strided inputs, axes other than
the trailing ones, forced backends, unusual parameters) returns ``None`` and takes the
general path, which gives the same bits: both run the same kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _engine, _plans
from ._backends import _numba
from ._backends._numba import entry as kernel_entry
from ._dispatch import Route
from ._dtypes import HALF_DTYPES, MACHINE_EPS, SUPPORTED, dtype_name
from ._plans import accumulation_eps, kernel_ready, params_key, remember_by_shapes
from ._validate import check_weight_offset, plain_axes

#: Planned calls at least this large may run in parallel and may write with streaming
#: stores (the Numba backend's own thresholds), so they go through the backend's choice
#: (:class:`._backends._numba.PlannedRows`) instead of the serial kernel alone. The general
#: path's validation costs about 20 us a call: as much as the kernel of a 128 KiB
#: working set, so cache-resident calls of any size take the short path.
SERIAL_MAX_ELEMENTS = _numba.PARALLEL_MIN_ELEMENTS

_NUMPY_ROUTE = Route("numpy", "numba")


class Plan:
    """What a validated call needs to run again: the 2-D view, dtypes and kernels.

    ``run`` calls the serial kernel, with or without statistics outputs (without: the
    empty ``no_stats`` arrays, the same argument types). It starts as a function that
    looks up the kernel's compiled entry point
    (:func:`._backends._numba.entry.entry_point`, which compiles or loads it once per
    dtype) and, after its first call, becomes that entry point: the plan's checks
    guarantee every later call passes arrays of the same dtypes and dimensions, so
    Numba's type resolution, a third of the call, is skipped.
    """

    __slots__ = (
        "acc",
        "bits",
        "cast_params",
        "default_eps",
        "direct",
        "dtypes",
        "eps_scalars",
        "large",
        "n",
        "negative_zeros",
        "no_stats",
        "ones",
        "param_bits",
        "rows",
        "run",
        "run_streamed",
        "same_shape",
        "shape2",
        "stats_shape",
        "streams",
        "tab",
        "widen_pair",
    )

    def __init__(self, shape: tuple[int, ...], rows: int, n: int, dtype: str, acc: str,
                 stats_shape: tuple[int, ...], params: tuple[Any, ...], kernels: Any,
                 rms: bool, x_dtype: Any = None) -> None:
        self.rows, self.n, self.stats_shape = rows, n, stats_shape
        #: The dtype objects of x and each parameter (None if absent) of the call that made
        #: the plan, which a call found by its shapes alone must have (:func:`_lookup`).
        self.dtypes = (x_dtype, *(None if p is None else p.dtype for p in params))
        #: Large calls: the backend picks the serial or parallel kernel and streaming stores.
        self.large = rows * n >= SERIAL_MAX_ELEMENTS
        self.acc = np.dtype(acc)
        bits = _numba.KERNEL_BITS.get(dtype)
        self.bits = None if bits is None else np.dtype(bits)
        #: Large calls whose output is large enough for streaming stores (unless in
        #: place): :func:`._backends._numba.streams_by_size`, asked once.
        itemsize = (np.dtype(dtype) if bits is None else self.bits).itemsize
        self.streams = self.large and _numba.streams_by_size(n, rows * n * itemsize)
        #: Per parameter: for float16/bfloat16 with float32 accumulation, the dtype of its
        #: raw bits (it is widened by the backend's small kernel, as on the general path:
        #: NumPy's float16 cast is slow), else None.
        self.param_bits = tuple(
            np.dtype(_numba.KERNEL_BITS[dtype_name(p.dtype)])
            if p is not None and acc == "float32" and dtype_name(p.dtype) in HALF_DTYPES
            else None for p in params)
        self.cast_params = any(p is not None and bits is None and p.dtype != self.acc
                               for p, bits in zip(params, self.param_bits, strict=True))
        #: Long 16-bit weight and bias: the backend's pair-widening kernel
        #: (:func:`._backends._numba.widened_params`), its entry point resolved on first
        #: use (a call's lookup cost a one-row call about 2 us); None otherwise.
        self.widen_pair = None
        if (len(params) == 2 and None not in self.param_bits
                and 2 * n >= _numba.PARAM_KERNEL_MIN):
            self.widen_pair = kernel_entry.resolving(self, "widen_pair",
                                                     kernels.widen_params, ())
        #: x, y, weight and bias go to the kernel as they are (no view, reshape or cast).
        self.shape2 = (rows, n)
        self.same_shape = tuple(shape) == self.shape2
        self.direct = (self.same_shape and self.bits is None and not self.cast_params
                       and all(bits is None for bits in self.param_bits)
                       and all(p is None or p.ndim == 1 for p in params))
        self.default_eps = MACHINE_EPS[acc]
        self.eps_scalars: dict[float, Any] = {}
        #: Stand-ins for an absent weight or bias (the backend's exact identities).
        self.ones, self.negative_zeros = _numba.kernel_params(None, None, n, self.acc)
        writes = _numba.RMS_FORWARD_WRITES if rms else _numba.LN_FORWARD_WRITES
        #: Statistics outputs of a call that does not return them: an empty array, which
        #: the kernels skip, so that such a call runs the kernel compiled for calls with
        #: statistics (None would be a specialization of its own, seconds to compile).
        self.no_stats = np.empty(0, dtype=self.acc)
        #: The LayerNorm kernels' table of n-dependent weights (None for RMSNorm).
        self.tab = None if rms else kernels.merge_table(n, self.acc)
        # The kernels of contiguous rows (the plan's checks keep x and y contiguous).
        size = _numba.param_bytes(self.acc)
        if rms:
            serial, parallel = _numba.rms_unit_row_kernels(kernels, n, False, size)
            streamed = _numba.rms_unit_row_kernels(kernels, n, True, size)
        else:
            serial, parallel = _numba.ln_unit_row_kernels(kernels, n, False, size)
            streamed = _numba.ln_unit_row_kernels(kernels, n, True, size, itemsize)
        #: ``run`` with streaming stores, for large calls that use them (``nt``).
        self.run_streamed = None
        if self.large:
            self.run = _numba.PlannedRows(serial, parallel, writes)
            self.run_streamed = _numba.PlannedRows(*streamed, writes)
        else:
            self.run = kernel_entry.resolving(self, "run", serial, writes)


_PLANS: dict[tuple[Any, ...], Plan | None] = {}
#: NumPy's dtype singletons (native byte order), compared by identity on the short paths.
_FLOAT32 = np.dtype(np.float32)
_UINT8 = np.dtype(np.uint8)


def _plan(x: Any, normalized_shape: Any, axis: Any, weight: Any, bias: Any,
          rms: bool) -> Plan | None:
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    req = _engine.request(x, _NUMPY_ROUTE, normalized_shape, axis, **params)
    layout = req.layout
    if (layout.perm is not None or layout.inner != 1
            or layout.n == 0 or layout.rows == 0):
        return None
    return Plan(layout.shape, layout.rows, layout.n, req.dtype, req.acc, layout.stats_shape,
                tuple(params.values()), _numba.load_kernels(), rms, x.dtype)


def _lookup(shapes: tuple[Any, ...], x: Any, normalized_shape: Any, axis: Any, weight: Any,
            bias: Any, rms: bool) -> Plan | None:
    """The plan of a call whose plan was not found under ``shapes`` (the key of its
    shapes alone) with x's and the parameters' dtype objects: the plan under the full
    key (shapes and dtypes; made and remembered on a first call), which is remembered
    under ``shapes`` too. None if the call cannot take the short path."""
    if rms:
        key = (x.shape, x.dtype, normalized_shape, axis, *params_key(weight))
    else:
        key = (x.shape, x.dtype, normalized_shape, axis, *params_key(weight, bias))
    return remember_by_shapes(_PLANS, key, shapes,
                              lambda: _plan(x, normalized_shape, axis, weight, bias, rms))


#: What :func:`offset_weight` returns for a call that must take the general path.
GENERAL = object()


def offset_weight(x: np.ndarray, weight: Any, weight_offset: Any) -> Any:
    """The weight a NumPy call's short path takes for ``weight_offset``: ``weight``
    itself for a zero offset; the gain ``weight + weight_offset``, formed as the general
    path forms it (:func:`._engine.gain`: in the accumulation dtype), for a finite float
    or int offset and a NumPy weight of a float dtype; else :data:`GENERAL` (the general
    path checks and raises).

    An offset gain took the general path's checks before: 17-30 us for a (4, 768)
    float32 call against 2-4 us (the Gemma-style ``add_rms_norm(..., weight_offset=1.0)``
    of a pre-norm block).

    Examples
    --------
    >>> w = np.array([0.0, 0.5], dtype=np.float16)
    >>> offset_weight(np.ones((1, 2), np.float32), w, 1.0)
    array([1. , 1.5], dtype=float32)
    """
    kind = type(weight_offset)
    if kind is not float and kind is not int:
        return GENERAL
    acc = "float64" if x.dtype == np.float64 else "float32"
    try:  # the general path's own check (finite there; nonzero only with a weight)
        offset = check_weight_offset(weight_offset, weight is not None, acc)
    except ValueError:  # the general path raises it
        return GENERAL
    if offset == 0.0:
        return weight
    if (type(weight) is not np.ndarray or not weight.dtype.isnative
            or dtype_name(weight.dtype) not in SUPPORTED):
        return GENERAL  # the general path refuses a non-native byte order, as without
    return _engine.gain(np, weight, offset, acc)


def _flat(param: Any, plan: Plan, bits: Any) -> Any:
    if param is None:
        return None
    if param.ndim != 1:
        param = param.reshape(-1)
    if bits is not None:
        return _numba.widened_param(param, plan.acc)
    return param.astype(plan.acc) if plan.cast_params else param


def _apart(out: Any, arr: Any, out_owns: bool | None = None, arr_flags: Any = None) -> bool:
    """``out`` cannot overlap the input ``arr`` (None, another allocation, or disjoint);
    ``out_owns``: ``out.flags.owndata``, ``arr_flags``: ``arr.flags``, if the caller has
    them."""
    # Two arrays that each own their memory are two allocations: no overlap to look for
    # (np.may_share_memory costs a fifth of a one-row call; each ``.flags`` builds an
    # object, 0.1-0.2 us, and more once a kernel has evicted the interpreter's data).
    if arr is None:
        return True
    if out_owns is None:
        out_owns = out.flags.owndata
    if arr_flags is None:
        arr_flags = arr.flags
    return ((arr is not out and out_owns and arr_flags.owndata)
            or not np.may_share_memory(out, arr))


def _usable_out(out: Any, x: Any, weight: Any, bias: Any, dtype: Any = None) -> bool:
    """``out`` fits (type, shape, dtype: ``x``'s unless given, contiguous, writeable) and
    overlaps no input but possibly ``x`` itself (in place)."""
    if (type(out) is not np.ndarray or out.shape != x.shape
            or out.dtype != (x.dtype if dtype is None else dtype)):
        return False
    flags = out.flags  # kernel_ready's flags, read once
    if not (flags.c_contiguous and flags.aligned and flags.writeable):
        return False
    owns = flags.owndata
    return ((out is x or _apart(out, x, owns)) and _apart(out, weight, owns)
            and _apart(out, bias, owns))


def _direct_out(out: Any, x: Any, xflags: Any, weight: Any, wflags: Any, bias: Any,
                bflags: Any) -> bool:
    """``out`` is ``x`` itself (in place, x writeable), or a usable array of x's shape and
    dtype (:func:`_usable_out`) that does not overlap it; neither overlaps a parameter.
    ``xflags``, ``wflags``, ``bflags``: the arrays' flags, read once by the caller (None
    for an absent parameter)."""
    if out is x:
        owns = xflags.owndata
        return (xflags.writeable and _apart(out, weight, owns, wflags)
                and _apart(out, bias, owns, bflags))
    if type(out) is not np.ndarray or out.shape != x.shape or out.dtype != x.dtype:
        return False
    flags = out.flags
    if not (flags.c_contiguous and flags.aligned and flags.writeable):
        return False
    owns = flags.owndata
    return (_apart(out, x, owns, xflags) and _apart(out, weight, owns, wflags)
            and _apart(out, bias, owns, bflags))


def _prepare(plan: Plan, x: Any, weight: Any, bias: Any, out: Any) -> tuple[Any, ...]:
    """Output array and the kernel's views of x, y, weight and bias, or () if unusable."""
    if out is not None and not _usable_out(out, x, weight, bias):
        return ()
    y = np.empty(x.shape, x.dtype) if out is None else out
    x2, y2 = (x, y) if plan.same_shape else (x.reshape(plan.shape2), y.reshape(plan.shape2))
    if plan.bits is not None:
        x2 = x2.view(plan.bits)
        y2 = y2.view(plan.bits)
    bias_bits = plan.param_bits[1] if len(plan.param_bits) > 1 else None
    if plan.widen_pair is not None:
        # Both 16-bit and long (LayerNorm): widened together by one kernel call.
        pair = plan.widen_pair(weight.reshape(-1).view(plan.param_bits[0]),
                               bias.reshape(-1).view(bias_bits))
        return y, x2, y2, pair[0], pair[1]
    return y, x2, y2, _flat(weight, plan, plan.param_bits[0]), _flat(bias, plan, bias_bits)


# The two entry points below are written out flat: at one (1, 768) row every Python
# call and tuple counts (the kernel itself takes about 0.4 us).


def layer_norm(x: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any,
               axis: Any, return_stats: bool, out: Any) -> Any:
    """The result of :func:`layernorm.layer_norm` for a known small call, else None."""
    if ((normalized_shape is not None and type(normalized_shape) is not int
            and not plain_axes(normalized_shape))
            or (axis is not None and type(axis) is not int and not plain_axes(axis))):
        return None
    # The arrays' flags are read once each (C-contiguous and aligned, as the compiled
    # entry points were typed; later, whether out may overlap them), and the plan is
    # found by the shapes alone, its dtypes compared by identity: hashing three dtypes
    # cost a cache-resident call a microsecond (NumPy builds a tuple to hash one).
    if weight is None:
        wshape = wflags = None
    elif type(weight) is np.ndarray:
        wshape, wflags = weight.shape, weight.flags
        if not (wflags.c_contiguous and wflags.aligned):
            return None
    else:
        return None
    if bias is None:
        bshape = bflags = None
    elif type(bias) is np.ndarray:
        bshape, bflags = bias.shape, bias.flags
        if not (bflags.c_contiguous and bflags.aligned):
            return None
    else:
        return None
    xflags = x.flags
    if not (xflags.c_contiguous and xflags.aligned):
        return None
    shapes = (x.shape, normalized_shape, axis, wshape, bshape)
    try:
        plan = _PLANS.get(shapes)
    except TypeError:  # unhashable normalized_shape
        return None
    if (plan is None or plan.dtypes[0] is not x.dtype
            or (wshape is not None and plan.dtypes[1] is not weight.dtype)
            or (bshape is not None and plan.dtypes[2] is not bias.dtype)):
        plan = _lookup(shapes, x, normalized_shape, axis, weight, bias, False)
        if plan is None:
            return None
    e = plan.eps_scalars.get(eps) if type(eps) is float else None
    if e is None and (e := accumulation_eps(plan, eps)) is None:
        return None
    if plan.direct and (out is None or _direct_out(out, x, xflags, weight, wflags, bias,
                                                   bflags)):
        y = np.empty(x.shape, x.dtype) if out is None else out
        x2, y2, w, b = x, y, weight, bias
    else:
        prepared = _prepare(plan, x, weight, bias, out)
        if not prepared:
            return None
        y, x2, y2, w, b = prepared
    if w is None:
        w = plan.ones
    if b is None:
        b = plan.negative_zeros
    nt = plan.streams and not np.may_share_memory(x2, y2)
    run = plan.run_streamed if nt else plan.run
    if return_stats:
        mean = np.empty(plan.stats_shape, plan.acc)
        rstd = np.empty(plan.stats_shape, plan.acc)
        m, r = mean.reshape(-1), rstd.reshape(-1)
        done = run(x2, w, b, e, y2, m, r, plan.tab, nt)
        if done is not None and (type(done) is not int or done != plan.rows):
            _numba.complete_layer_norm_rows(done, (x2, w, b, e, y2, m, r, plan.tab, nt))
        return y, mean, rstd
    done = run(x2, w, b, e, y2, plan.no_stats, plan.no_stats, plan.tab, nt)
    if done is not None and (type(done) is not int or done != plan.rows):
        _numba.complete_layer_norm_rows(done, (x2, w, b, e, y2, plan.no_stats, plan.no_stats,
                                               plan.tab, nt))
    return y


def rms_norm(x: Any, normalized_shape: Any, weight: Any, eps: Any, axis: Any,
             return_stats: bool, out: Any) -> Any:
    """The result of :func:`layernorm.rms_norm` for a known small call, else None."""
    if ((normalized_shape is not None and type(normalized_shape) is not int
            and not plain_axes(normalized_shape))
            or (axis is not None and type(axis) is not int and not plain_axes(axis))):
        return None
    # As layer_norm does.
    if weight is None:
        wshape = wflags = None
    elif type(weight) is np.ndarray:
        wshape, wflags = weight.shape, weight.flags
        if not (wflags.c_contiguous and wflags.aligned):
            return None
    else:
        return None
    xflags = x.flags
    if not (xflags.c_contiguous and xflags.aligned):
        return None
    shapes = (x.shape, normalized_shape, axis, wshape)
    try:
        plan = _PLANS.get(shapes)
    except TypeError:
        return None
    if (plan is None or plan.dtypes[0] is not x.dtype
            or (wshape is not None and plan.dtypes[1] is not weight.dtype)):
        plan = _lookup(shapes, x, normalized_shape, axis, weight, None, True)
        if plan is None:
            return None
    if eps is None:
        eps = plan.default_eps
    e = plan.eps_scalars.get(eps) if type(eps) is float else None
    if e is None and (e := accumulation_eps(plan, eps)) is None:
        return None
    if plan.direct and (out is None or _direct_out(out, x, xflags, weight, wflags, None,
                                                   None)):
        y = np.empty(x.shape, x.dtype) if out is None else out
        x2, y2, w = x, y, weight
    else:
        prepared = _prepare(plan, x, weight, None, out)
        if not prepared:
            return None
        y, x2, y2, w, _ = prepared
    if w is None:
        w = plan.ones
    nt = plan.streams and not np.may_share_memory(x2, y2)
    run = plan.run_streamed if nt else plan.run
    if return_stats:
        rstd = np.empty(plan.stats_shape, plan.acc)
        r = rstd.reshape(-1)
        done = run(x2, w, e, y2, r, nt)
        if done is not None and (type(done) is not int or done != plan.rows):
            _numba.complete_rms_norm_rows(done, (x2, w, e, y2, r, nt))
        return y, rstd
    done = run(x2, w, e, y2, plan.no_stats, nt)
    if done is not None and (type(done) is not int or done != plan.rows):
        _numba.complete_rms_norm_rows(done, (x2, w, e, y2, plan.no_stats, nt))
    return y


# Quantized calls (quantize= on layer_norm / rms_norm): float32 rows, float32 or absent
# parameters, a dynamic scale, a static scalar (:func:`static_scale_value`) or per-row
# array (:func:`row_inverses`). The general path's checks cost several times the kernel
# of a cache-resident call.

#: NumPy's float scalar types, whose values a Python float holds exactly.
_FLOAT_SCALARS = frozenset((np.float16, np.float32, np.float64))
#: The dtypes of a per-row static scale array on the short paths.
_ROW_SCALE_TYPES = frozenset((np.float32, np.float64))


def short_path_scale(scale: Any) -> bool:
    """Whether a quantized call's ``scale`` may take the short paths: None (dynamic), a
    scalar (:func:`static_scale_value`) or a NumPy float32/float64 array (per row: its
    shape and values are checked against the plan by :func:`row_inverses`)."""
    return (scale is None or static_scale_value(scale) is not None
            or (type(scale) is np.ndarray and scale.dtype.type in _ROW_SCALE_TYPES))


def row_inverses(scale: np.ndarray, stats_shape: tuple[int, ...]) -> Any:
    """``1 / scale`` row by row in float32 (as the general path computes it: the scale
    cast to float32, then divided into 1) for a per-row static ``scale`` of the
    statistics' shape, or None: another shape, or a value the general path must
    refuse (not positive and finite, or outside float32's range either way)."""
    if scale.shape != stats_shape:
        return None
    with np.errstate(all="ignore"):
        inv = np.float32(1.0) / scale.astype(np.float32).reshape(-1)
    # 1 / scale is positive and finite exactly where the float32 scale is positive,
    # finite and not so small that its inverse overflows (NaN fails both tests).
    if not (inv.min() > 0 and inv.max() < np.inf):
        return None
    return inv


def static_scale_value(scale: Any) -> float | None:
    """The value of a static ``scale`` that the short paths take, as a Python float: a
    float, a NumPy float16/32/64 scalar, or a NumPy array of one of those dtypes with
    one element (its value; its dimensions are the caller's to check against the
    statistics' shape). None for anything else (the general path checks it).

    Measured, float32 (1, 1024), int8 into ``out=``, 1 thread: a NumPy float32 scalar
    took the general path in 41 us against 3.9 us for a Python float.
    """
    kind = type(scale)
    if kind is float:
        return scale
    if kind in _FLOAT_SCALARS:
        return float(scale)
    if kind is np.ndarray and scale.size == 1 and scale.dtype.type in _FLOAT_SCALARS:
        return float(scale.reshape(()))
    return None


class QuantPlan:
    """What a validated quantized call needs to run again (see :class:`Plan`).

    ``run_dynamic`` / ``run_static`` call the quantizing kernel of the call's row path
    and format, for a dynamic or a static scale, with the arguments
    :func:`._backends._numba.quantized_forward` would pass; the inverse of a
    static scale is kept per value, one array of rows each.
    """

    __slots__ = (
        "acc",
        "default_eps",
        "dynamic",
        "eps_scalars",
        "inverses",
        "n",
        "negative_zeros",
        "no_stats",
        "ones",
        "qdtype",
        "rms",
        "rows",
        "run_dynamic",
        "run_static",
        "same_shape",
        "shape2",
        "static",
        "stats_shape",
        "tab",
        "tag",
    )

    def __init__(self, shape: tuple[int, ...], rows: int, n: int,
                 stats_shape: tuple[int, ...], quantize: str, kernels: Any,
                 rms: bool) -> None:
        self.rows, self.n, self.stats_shape, self.rms = rows, n, stats_shape, rms
        self.shape2 = (rows, n)
        #: x and the codes go to the kernel as they are (no reshape).
        self.same_shape = tuple(shape) == self.shape2
        acc = self.acc = np.dtype(np.float32)
        self.qdtype = _engine.dtype_of(np, quantize)
        self.tag = kernels.FORMAT_TAGS[quantize]
        self.dynamic, self.static = kernels.DYNAMIC, kernels.STATIC
        self.default_eps = MACHINE_EPS["float32"]
        self.eps_scalars: dict[float, Any] = {}
        self.inverses: dict[float, Any] = {}
        self.ones, self.negative_zeros = _numba.kernel_params(None, None, n, acc)
        self.no_stats = np.empty(0, dtype=acc)
        self.tab = None if rms else kernels.merge_table(n, acc)
        serial, parallel = _numba.quantized_kernels(kernels, n, rms)
        writes = _numba.RMS_QUANT_WRITES if rms else _numba.LN_QUANT_WRITES
        # One runner per scale kind: a dynamic and a static scale are two compiled
        # specializations (``kernels.DYNAMIC`` / ``kernels.STATIC`` differ in type).
        for slot in ("run_dynamic", "run_static"):
            if rows * n >= SERIAL_MAX_ELEMENTS:
                setattr(self, slot, _numba.PlannedRows(serial, parallel, writes))
            else:
                setattr(self, slot, kernel_entry.resolving(self, slot, serial, writes))

    def inverse(self, scale: float) -> Any:
        """``1 / scale`` in float32 for every row, or None if it is not a positive finite
        float32 (the general path handles such a scale)."""
        inv = self.inverses.get(scale)
        if inv is None:
            with np.errstate(over="ignore"):
                s = np.float32(scale)
                if not 0 < s < np.inf:
                    return None
                one = np.float32(1.0) / s
            if not one < np.inf:
                return None
            if len(self.inverses) > 64:
                self.inverses.clear()
            inv = self.inverses[scale] = np.full(self.rows, one, dtype=np.float32)
        return inv


def _quant_plan(x: Any, normalized_shape: Any, axis: Any, weight: Any, bias: Any,
                quantize: str, rms: bool) -> QuantPlan | None:
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    req = _engine.request(x, _NUMPY_ROUTE, normalized_shape, axis, **params)
    layout = req.layout
    if (req.dtype != "float32" or layout.perm is not None or layout.inner != 1
            or layout.n == 0 or layout.rows == 0
            or any(p is not None and p.dtype != np.float32 for p in params.values())):
        return None
    return QuantPlan(layout.shape, layout.rows, layout.n, layout.stats_shape, quantize,
                     _numba.load_kernels(), rms)


def find_quant_plan(plans: dict[Any, Any], x: Any, normalized_shape: Any, weight: Any,
                    bias: Any, axis: Any, quantize: Any, scale: Any,
                    rms: bool) -> QuantPlan | None:
    """The :class:`QuantPlan` in ``plans`` for a ``quantize=`` call like this one (made
    and kept there on its first call), or None: the call takes the general path.

    Eligible: float32 ``x`` and parameters (``weight``/``bias`` None or float32 NumPy
    arrays), ``quantize`` a string, ``scale`` as :func:`short_path_scale` allows, the
    normalized axes trailing. ``plans`` is the caller's: a plan's kernel entry point is
    resolved for the arguments its first call passed (with or without a residual).
    """
    if (x.dtype is not _FLOAT32 or type(quantize) is not str
            or not short_path_scale(scale)
            or (normalized_shape is not None and type(normalized_shape) is not int
                and not plain_axes(normalized_shape))
            or (axis is not None and type(axis) is not int and not plain_axes(axis))
            or not kernel_ready(x)):
        return None
    # The plan takes float32 parameters only: compared by identity, their dtypes need
    # not be hashed into the key (a microsecond of a cache-resident call, see
    # layer_norm); another float32 dtype object takes the general path.
    if weight is None:
        wshape = None
    elif type(weight) is np.ndarray and weight.dtype is _FLOAT32 and kernel_ready(weight):
        wshape = weight.shape
    else:
        return None
    if bias is None:
        bshape = None
    elif type(bias) is np.ndarray and bias.dtype is _FLOAT32 and kernel_ready(bias):
        bshape = bias.shape
    else:
        return None
    key = (x.shape, normalized_shape, axis, wshape, bshape, quantize, rms)
    try:
        return plans[key]
    except KeyError:
        try:
            plan = _quant_plan(x, normalized_shape, axis, weight, bias, quantize, rms)
        except (TypeError, ValueError, KeyError):
            plan = None  # the general path raises the error
        if len(plans) >= _plans.PLANS_MAX:
            plans.clear()
        plans[key] = plan
        return plan
    except TypeError:  # unhashable normalized_shape
        return None


def quantized(x: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any, axis: Any,
              return_stats: bool, out: Any, quantize: Any, scale: Any, rms: bool) -> Any:
    """The result of a known small ``quantize=`` call of :func:`layernorm.layer_norm`
    (``rms``: :func:`layernorm.rms_norm`, ``bias`` None), else None."""
    plan = find_quant_plan(_PLANS, x, normalized_shape, weight, bias, axis, quantize, scale,
                           rms)
    if plan is None:
        return None
    if out is None:
        q = np.empty(x.shape, plan.qdtype)
    elif _usable_out(out, x, weight, bias, plan.qdtype):  # 8-bit codes: never x itself
        q = out
    else:
        return None
    tail = run_quantized(plan, x, None, None, q, weight, bias, eps, scale, return_stats)
    return None if tail is None else (q, *tail)


def run_quantized(plan: QuantPlan, x: Any, residual: Any, h: Any, q: Any, weight: Any,
                  bias: Any, eps: Any, scale: Any, return_stats: bool) -> tuple | None:
    """Run ``plan``'s quantizing kernel: the norm of ``x`` (with ``residual``: of
    ``h = x + residual``, written to ``h``) quantized into ``q``.

    The caller has checked every array against the plan (shapes, float32 dtypes,
    contiguity; ``q`` of the plan's 8-bit dtype and sharing no memory with another
    argument; ``h`` usable, possibly ``x`` or ``residual`` itself) and that ``scale`` is
    as :func:`short_path_scale` allows (returned as passed). Returns ``(scale,)``, then
    ``(mean, rstd)`` (RMSNorm: ``(rstd,)``) with ``return_stats``; or None, before
    anything is written, for an ``eps`` or a static scale the general path must check.
    """
    rms = plan.rms
    if rms and eps is None:
        eps = plan.default_eps
    e = plan.eps_scalars.get(eps) if type(eps) is float else None
    if e is None and (e := accumulation_eps(plan, eps)) is None:
        return None
    if scale is None:
        inv = plan.no_stats
        scale = np.empty(plan.stats_shape, np.float32)
        scale_rows = scale.reshape(-1)
    else:
        value = scale if type(scale) is float else static_scale_value(scale)
        if value is None:  # per row: 1 / scale computed for this call
            inv = row_inverses(scale, plan.stats_shape)
        elif type(scale) is np.ndarray and scale.ndim > len(plan.stats_shape):
            inv = None  # it broadcasts to more dimensions: the general path says so
        else:
            inv = plan.inverses.get(value)
            if inv is None:
                inv = plan.inverse(value)
        if inv is None:
            return None
        scale_rows = plan.no_stats
    # Every reshape skipped where the shapes already fit: at one (1, 256) row each costs
    # about a tenth of a microsecond, a thirtieth of the call.
    if plan.same_shape:
        q2, x2, r2, h2 = q.view(_UINT8), x, residual, h
    else:
        shape2 = plan.shape2
        q2, x2 = q.reshape(shape2).view(_UINT8), x.reshape(shape2)
        r2 = None if residual is None else residual.reshape(shape2)
        h2 = None if h is None else h.reshape(shape2)
    w = plan.ones if weight is None else weight if weight.ndim == 1 else weight.reshape(-1)
    if return_stats:
        mean = None if rms else np.empty(plan.stats_shape, np.float32)
        rstd = np.empty(plan.stats_shape, np.float32)
        m = None if rms else mean.reshape(-1)
        r = rstd.reshape(-1)
    else:
        m = r = plan.no_stats
    if inv is plan.no_stats:
        tail, run = (plan.tag, plan.dynamic, inv, scale_rows), plan.run_dynamic
    else:
        tail, run = (plan.tag, plan.static, inv, scale_rows), plan.run_static
    if rms:
        args = (x2, r2, w, e, h2, q2, r, *tail)
    else:
        b = plan.negative_zeros if bias is None else bias if bias.ndim == 1 else bias.reshape(-1)
        args = (x2, r2, w, b, e, h2, q2, m, r, plan.tab, *tail)
    stopped = run(*args)
    if stopped:
        _numba.complete_quantized_rows(stopped, args, rms)
    if not return_stats:
        return (scale,)
    return (scale, rstd) if rms else (scale, mean, rstd)
