"""The short path for repeated small NumPy backward calls.

The backward of one ``(1, 768)`` float32 row takes about 2 us in its kernel and 20 us in
validation and dispatch. As in the forward's short path (:mod:`._fast`), the first call
with a given shape, dtype, axes and weight layout goes through full validation
(:func:`._engine.request`) and leaves a :class:`BackwardPlan`; a later call that matches
it checks only what can change between such calls (the types, shapes, dtypes and
contiguity of ``grad_y``, the statistics and ``grad_residual``, and the contiguity of
``x`` and ``weight``) and calls the serial Numba kernel's compiled entry point directly
(for large calls, the backend's serial-or-parallel choice). It runs the kernels of the
general path (:func:`._backends._numba.layer_norm_backward`) with the same arguments and
the same partial-sum blocks, so it gives the same bits. Anything else (strided or
non-NumPy arrays, axes other than the trailing ones, statistics or weights of another
dtype, forced backends, a nonzero ``weight_offset``) returns ``None`` and takes the
general path, which also raises every error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _engine
from ._backends import _numba
from ._backends._numba import entry as kernel_entry
from ._dispatch import Route
from ._dtypes import dtype_name
from ._plans import kernel_ready, remember_by_shapes
from ._validate import plain_axes

_NUMPY_ROUTE = Route("numpy", "numba")


class BackwardPlan:
    """What a validated backward call needs to run again: views, dtypes and kernels.

    ``run`` calls the serial backward kernel of the call's row length; after its first
    call it is that kernel's compiled entry point (:func:`._backends._numba.entry.resolving`):
    the plan's checks guarantee that every later call passes arrays of the same dtypes
    and dimensions. Calls of at least :data:`._backends._numba.PARALLEL_MIN_ELEMENTS`
    elements run through the backend's serial-or-parallel choice
    (:class:`._backends._numba.PlannedRows`) instead.

    Parameters
    ----------
    shape : tuple of int
        Shape of ``x``.
    rows, n : int
        Rows of the kernels' 2-D view and their length (the normalized size).
    dtype, acc : str
        Names of x's dtype and of the accumulation dtype.
    stats_shape, param_shape : tuple of int
        Shapes of ``mean``/``rstd`` and of ``weight`` and the parameter gradients.
    grad_dtype : numpy.dtype
        Dtype of the returned parameter gradients (the weight's, else x's).
    rms : bool
        RMSNorm instead of LayerNorm.
    """

    __slots__ = (
        "acc",
        "bits",
        "cast_grads",
        "dtypes",
        "flat_params",
        "grad_dtype",
        "ones",
        "param_shape",
        "partials_shape",
        "run",
        "same_shape",
        "shape2",
        "stats_shape",
        "streams",
    )

    def __init__(self, shape: tuple[int, ...], rows: int, n: int, dtype: str, acc: str,
                 stats_shape: tuple[int, ...], param_shape: tuple[int, ...],
                 grad_dtype: np.dtype, rms: bool, itemsize: int) -> None:
        self.acc = np.dtype(acc)
        #: The dtype objects of x and the weight (None if absent) of the call that made
        #: the plan (set by :func:`_plan`), which a call found by its shapes must have.
        self.dtypes: tuple[Any, ...] = (None, None)
        self.stats_shape, self.param_shape, self.grad_dtype = stats_shape, param_shape, grad_dtype
        self.shape2 = (rows, n)
        #: grad_y, x and grad_x go to the kernel as they are (no reshape).
        self.same_shape = tuple(shape) == self.shape2
        #: The parameter gradients are returned as the kernel's rows (no reshape).
        self.flat_params = param_shape == (n,)
        #: The parameter gradients are returned in another dtype than the kernel's.
        self.cast_grads = grad_dtype != self.acc
        bits = _numba.KERNEL_BITS.get(dtype)
        #: For float16/bfloat16: the dtype of the raw bits the kernels read, else None.
        self.bits = None if bits is None else np.dtype(bits)
        #: The stand-in for an absent weight (the backend's exact identity).
        self.ones = _numba.kernel_params(None, None, n, self.acc)[0]
        count = 1 if rms else 2  # grad_weight only, or grad_weight and grad_bias
        #: The partial sums of the parameter gradients, one per block of rows.
        self.partials_shape = (count, -(-rows // _numba.GRAD_ROW_BLOCK), n)
        # The kernels of unit-stride rows (the plan's checks keep every array contiguous);
        # a stand-in 2-D array of the row length and item size (and the row count) picks
        # them as the backend does.
        like = np.empty((1, n), f"u{itemsize}")
        #: grad_x is allocated aligned and written with streaming stores.
        self.streams = _numba.streams_gradient_rows(rows, n, itemsize)
        kernels = _numba.load_kernels()
        if rms:
            serial, parallel = _numba.rms_backward_kernels(kernels, like, like, like,
                                                           stream=self.streams, rows=rows)
            writes = _numba.RMS_BACKWARD_WRITES
        else:
            serial, parallel = _numba.ln_backward_kernels(kernels, like, like, like,
                                                          stream=self.streams, rows=rows)
            writes = _numba.LN_BACKWARD_WRITES
        if rows * n >= _numba.PARALLEL_MIN_ELEMENTS:
            self.run = _numba.PlannedRows(serial, parallel, writes)
        else:
            self.run = kernel_entry.resolving(self, "run", serial, writes)


_PLANS: dict[tuple[Any, ...], BackwardPlan | None] = {}


def _plan(x: Any, normalized_shape: Any, axis: Any, weight: Any,
          rms: bool) -> BackwardPlan | None:
    req = _engine.request(x, _NUMPY_ROUTE, normalized_shape, axis, weight=weight)
    layout = req.layout
    if (layout.perm is not None or layout.inner != 1 or layout.n == 0 or layout.rows == 0
            or (weight is not None and dtype_name(weight.dtype) != req.acc)):
        return None
    grad_dtype = (x if weight is None else weight).dtype
    plan = BackwardPlan(layout.shape, layout.rows, layout.n, req.dtype, req.acc,
                        layout.stats_shape, layout.param_shape, grad_dtype, rms,
                        x.dtype.itemsize)
    plan.dtypes = (x.dtype, None if weight is None else weight.dtype)
    return plan


def _lookup(shapes: tuple[Any, ...], x: Any, normalized_shape: Any, axis: Any, weight: Any,
            rms: bool) -> BackwardPlan | None:
    """The plan under the full key (shapes and dtypes; made on a first call), also
    remembered under ``shapes``; None if the call cannot take the short path (see
    :func:`._fast._lookup`)."""
    wkey = (None, None) if weight is None else (weight.shape, weight.dtype)
    key = (rms, x.shape, x.dtype, normalized_shape, axis, *wkey)
    return remember_by_shapes(_PLANS, key, shapes,
                              lambda: _plan(x, normalized_shape, axis, weight, rms))


def _fits(arr: Any, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """``arr`` is a plain NumPy array of ``shape`` and ``dtype``, C-contiguous and aligned
    (the compiled entry points were typed for aligned arrays)."""
    if type(arr) is not np.ndarray or arr.shape != shape or arr.dtype != dtype:
        return False
    return kernel_ready(arr)


def gradients(grad_y: Any, x: Any, mean: Any, rstd: Any, weight: Any, normalized_shape: Any,
              axis: Any, grad_residual: Any, rms: bool) -> tuple[Any, ...] | None:
    """The result of :func:`layernorm.layer_norm_backward` (``rms``:
    :func:`layernorm.rms_norm_backward`, ``mean`` None) for a known call, else None.

    The caller has checked that ``x`` is a NumPy array, that no backend is forced and
    that ``weight_offset`` is 0.

    Parameters
    ----------
    grad_y, x, mean, rstd, weight, normalized_shape, axis, grad_residual
        As given to the public function.
    rms : bool
        RMSNorm instead of LayerNorm.

    Returns
    -------
    tuple or None
        ``(grad_x, grad_weight, grad_bias)`` for LayerNorm, ``(grad_x, grad_weight)`` for
        RMSNorm, or None: the call takes the general path.
    """
    if ((normalized_shape is not None and type(normalized_shape) is not int
            and not plain_axes(normalized_shape))
            or (axis is not None and type(axis) is not int and not plain_axes(axis))):
        return None
    if weight is None:
        wshape = None
    elif type(weight) is np.ndarray:
        wshape = weight.shape
    else:
        return None
    # Found by the shapes alone, dtypes compared by identity (as :mod:`._fast` does:
    # hashing dtypes costs a cache-resident call a microsecond).
    shapes = (rms, x.shape, normalized_shape, axis, wshape)
    try:
        plan = _PLANS.get(shapes)
    except TypeError:  # unhashable normalized_shape
        return None
    if (plan is None or plan.dtypes[0] is not x.dtype
            or (wshape is not None and plan.dtypes[1] is not weight.dtype)):
        plan = _lookup(shapes, x, normalized_shape, axis, weight, rms)
    if (plan is None or not kernel_ready(x) or not _fits(grad_y, x.shape, x.dtype)
            or not _fits(rstd, plan.stats_shape, plan.acc)
            or (not rms and not _fits(mean, plan.stats_shape, plan.acc))
            or (weight is not None and not kernel_ready(weight))
            or (grad_residual is not None and not _fits(grad_residual, x.shape, x.dtype))):
        return None
    grad_x = (_numba.empty_output(x.shape, x.dtype) if plan.streams
              else np.empty(x.shape, x.dtype))
    arrays = (grad_y, x, grad_x) if grad_residual is None else (grad_y, x, grad_x,
                                                                   grad_residual)
    if not plan.same_shape:
        arrays = tuple(a.reshape(plan.shape2) for a in arrays)
    if plan.bits is not None:
        arrays = tuple(a.view(plan.bits) for a in arrays)
    gy2, x2, gx2 = arrays[:3]
    # Without grad_residual x stands in for it (the backend's convention: never read).
    gres2, has_res = (x2, False) if grad_residual is None else (arrays[3], True)
    if weight is None:
        w = plan.ones
    else:
        w = weight if weight.ndim == 1 else weight.reshape(-1)
    partials = np.zeros(plan.partials_shape, plan.acc)
    r = rstd.reshape(-1)
    if rms:
        sums = plan.run(gy2, x2, r, w, gx2, partials, _numba.GRAD_ROW_BLOCK, gres2, has_res)
        return grad_x, _param_grad(sums[0], plan)
    sums = plan.run(gy2, x2, mean.reshape(-1), r, w, gx2, partials, _numba.GRAD_ROW_BLOCK,
                    gres2, has_res)
    return grad_x, _param_grad(sums[0], plan), _param_grad(sums[1], plan)


def _param_grad(row: Any, plan: BackwardPlan) -> Any:
    """One parameter gradient as the general path returns it: the normalized axes' shape,
    the weight's (else x's) dtype."""
    if not plan.flat_params:
        row = row.reshape(plan.param_shape)
    # The kernel returns a view of the partials it summed in place: a copy (or the cast)
    # keeps the gradient from holding them alive.
    return _numba.narrowed_param(row, plan.grad_dtype) if plan.cast_grads else row.copy()
