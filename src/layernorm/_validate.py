"""Argument checks and their error messages: one place, one wording.

Every message names the argument, what was expected and what was given.
Nothing here imports an array library; arrays are only asked for ``shape``
and ``dtype``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from ._dtypes import SUPPORTED, dtype_name

_SUPPORTED_TEXT = "float16, bfloat16, float32 or float64"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def shape_of(arr: Any) -> tuple[int, ...]:
    """The shape of an array as a tuple of Python ints."""
    return tuple(int(s) for s in arr.shape)


def check_eps(eps: Any, name: str = "eps") -> float:
    """Return ``eps`` as a Python float, or raise ``ValueError``.

    Examples
    --------
    >>> check_eps(1e-5)
    1e-05
    >>> check_eps(-1.0)
    Traceback (most recent call last):
    ...
    ValueError: eps must be a finite float >= 0, got -1.0
    """
    if type(eps) is float and 0.0 <= eps < math.inf:
        return eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise ValueError(f"{name} must be a finite float >= 0, got {eps!r} of type "
                         f"{type(eps).__name__}")
    try:
        value = float(eps)
    except OverflowError:  # an int or Fraction beyond the float range, e.g. 10**400
        raise ValueError(f"{name} must be a finite float >= 0, got a value of type "
                         f"{type(eps).__name__} too large to convert to a float") from None
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be a finite float >= 0, got {eps!r}")
    return value


def check_float_dtype(arr: Any, name: str) -> str:
    """Canonical dtype name of ``arr``; ``TypeError`` unless it is a supported float.

    Floats of non-native byte order (NumPy's ``'>f4'`` on a little-endian machine) are
    refused: the kernels read native numbers, and a byte-swapped copy is the caller's
    choice to make.

    Examples
    --------
    >>> import numpy as np
    >>> check_float_dtype(np.ones(2, np.float32), "x")
    'float32'
    >>> check_float_dtype(np.ones(2, np.dtype(np.float32).newbyteorder()), "x")
    Traceback (most recent call last):
    ...
    TypeError: x must have native byte order, got dtype float32 of byte order '>'...
    """
    dtype = arr.dtype
    dname = dtype_name(dtype)
    if dname not in SUPPORTED:
        raise TypeError(f"{name} must have dtype {_SUPPORTED_TEXT}, got dtype {dname}")
    if not getattr(dtype, "isnative", True):
        raise TypeError(
            f"{name} must have native byte order, got dtype {dname} of byte order "
            f"{dtype.byteorder!r}; pass {name}.astype({name}.dtype.newbyteorder('='))"
        )
    return dname


def as_int_tuple(value: Any, name: str) -> tuple[int, ...]:
    """``value`` (an int, or a sequence of ints such as a tuple, list or torch.Size) as a
    tuple of Python ints; ``TypeError`` naming ``name`` otherwise.

    Unordered or keyed collections (sets, dicts) are refused: their order is not the
    order of the axes the caller meant.

    Examples
    --------
    >>> as_int_tuple(3, "axis")
    (3,)
    >>> as_int_tuple([2, 3], "normalized_shape")
    (2, 3)
    >>> as_int_tuple({8: 1}, "normalized_shape")
    Traceback (most recent call last):
    ...
    TypeError: normalized_shape must be an int or a tuple of ints, got {8: 1}
    """
    if _is_int(value):
        return (int(value),)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = tuple(value)
        if all(_is_int(v) for v in items):
            return tuple(int(v) for v in items)
    elif _is_int_array(value):
        return tuple(int(v) for v in value.tolist())
    raise TypeError(f"{name} must be an int or a tuple of ints, got {value!r}")


def _is_int_array(value: Any) -> bool:
    # A 1-D integer array (NumPy, or a tensor's shape arithmetic) names axes in order.
    dtype = getattr(value, "dtype", None)
    return (getattr(value, "ndim", None) == 1 and hasattr(value, "tolist")
            and getattr(dtype, "kind", "") in "iu" and dtype is not None)


def resolve_axes(shape: tuple[int, ...], normalized_shape: Any, axis: Any) -> tuple[int, ...]:
    """Sorted, non-negative normalized axes of an array of ``shape``.

    ``normalized_shape`` names trailing dimensions (PyTorch style); ``axis`` names
    any axes. Giving both is a ``TypeError``; giving neither means ``axis=-1``.

    Examples
    --------
    >>> resolve_axes((2, 3, 4), None, None)
    (2,)
    >>> resolve_axes((2, 3, 4), (3, 4), None)
    (1, 2)
    >>> resolve_axes((2, 3, 4, 5), None, 1)
    (1,)
    >>> resolve_axes((2, 3), 4, None)
    Traceback (most recent call last):
    ...
    ValueError: normalized_shape=(4,) expects input whose trailing dimensions are (4,), got input...
    """
    ndim = len(shape)
    if normalized_shape is not None and axis is not None:
        raise TypeError(
            "give either normalized_shape or axis, not both "
            f"(got normalized_shape={normalized_shape!r}, axis={axis!r})"
        )
    if normalized_shape is not None:
        ns = as_int_tuple(normalized_shape, "normalized_shape")
        if len(ns) == 0:
            raise ValueError("normalized_shape must name at least one dimension, got ()")
        if any(d < 0 for d in ns):
            raise ValueError(f"normalized_shape must be non-negative, got {ns}")
        if len(ns) > ndim or shape[ndim - len(ns):] != ns:
            raise ValueError(
                f"normalized_shape={ns} expects input whose trailing dimensions are {ns}, "
                f"got input of shape {shape}"
            )
        return tuple(range(ndim - len(ns), ndim))
    axes = (-1,) if axis is None else as_int_tuple(axis, "axis")
    if len(axes) == 0:
        raise ValueError("axis must name at least one axis, got ()")
    if ndim == 0:
        raise ValueError("x must have at least one dimension to normalize over, got a 0-d "
                         "array (shape ()); pass x.reshape(1) or x[None]")
    resolved = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(
                f"axis {a} is out of range for input of shape {shape} (ndim={ndim}); "
                f"expected an axis in [{-ndim}, {ndim - 1}]"
            )
        resolved.append(a % ndim)
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"axis contains duplicate axes: {axes} for input of shape {shape}")
    return tuple(sorted(resolved))


def check_param(param: Any, name: str, expected: tuple[int, ...], x_shape: tuple[int, ...]) -> str:
    """Check ``weight``/``bias`` shape and dtype; return its canonical dtype name."""
    got = shape_of(param)
    if got != expected:
        raise ValueError(
            f"{name} must have the shape of the normalized axes {expected} "
            f"(input shape {x_shape}), got shape {got}"
        )
    return check_float_dtype(param, name)


def check_given(arr: Any, name: str, wanted: str) -> None:
    """``TypeError`` naming ``name`` and what it must be when a required array is None
    (checked before anything reads its shape)."""
    if arr is None:
        raise TypeError(f"{name} must be {wanted}, got None")


def check_same_shape(arr: Any, name: str, expected: tuple[int, ...], what: str) -> None:
    """``ValueError`` unless ``arr.shape == expected``."""
    got = shape_of(arr)
    if got != expected:
        raise ValueError(f"{name} must have shape {expected} ({what}), got shape {got}")


def check_out(out: Any, x_shape: tuple[int, ...], x_dtype: str) -> None:
    """``out=`` must have exactly the shape and dtype of ``x``."""
    check_same_shape(out, "out", x_shape, "the shape of x")
    got = dtype_name(out.dtype)
    if got != x_dtype:
        raise ValueError(f"out must have the dtype of x ({x_dtype}), got dtype {got}")
    check_float_dtype(out, "out")  # byte order
    check_writeable(out, "out")


def check_writeable(arr: Any, name: str) -> None:
    """``ValueError`` if ``arr`` is a read-only array (one without flags passes)."""
    if not getattr(getattr(arr, "flags", None), "writeable", True):
        raise ValueError(f"{name} must be a writeable array, got a read-only one")


def check_no_internal_overlap(arr: Any, name: str) -> None:
    """``ValueError`` if elements of a strided array may share memory with each other.

    An output whose elements alias one another (a broadcast view, ``as_strided`` rows
    over one buffer) would be written several times through different elements: the
    result depends on the order of the writes. The test is the classic sufficient one
    (each axis, in order of stride, steps past everything the smaller axes span), which
    every view made by slicing, transposing or reshaping passes.

    Examples
    --------
    >>> import numpy as np
    >>> check_no_internal_overlap(np.ones((2, 3))[:, ::2], "out")
    >>> check_no_internal_overlap(np.empty((0, 3)), "out")
    >>> check_no_internal_overlap(np.broadcast_to(np.ones(3), (2, 3)), "out")
    Traceback (most recent call last):
    ...
    ValueError: out has elements that share memory (shape (2, 3), strides (0, 8))...
    """
    shape, strides = tuple(arr.shape), tuple(arr.strides)
    if 0 in shape:  # no elements, none to share (NumPy gives such arrays zero strides)
        return
    span = 0  # bytes covered by the axes already visited, minus one element
    for size, stride in sorted(((n, abs(s)) for n, s in zip(shape, strides, strict=True)
                                if n > 1), key=lambda item: item[1]):
        if stride <= span or stride < arr.itemsize:
            raise ValueError(
                f"{name} has elements that share memory (shape {shape}, strides {strides}); "
                "pass an array whose elements are distinct, e.g. a fresh np.empty_like"
            )
        span += (size - 1) * stride


def check_backend_name(backend: Any) -> None:
    """``backend=`` must be None or one of the known names."""
    if backend is not None and backend not in ("numba", "cupy", "array_api"):
        raise ValueError(
            f"backend must be None, 'numba', 'cupy' or 'array_api', got {backend!r}"
        )


def memo_axes(value: Any) -> Any:
    """``value`` if it is None, an int or a tuple of ints (exact types), else raise.

    Memo keys compare by ``==``, under which ``4.0``, ``True`` and ``np.int64(4)`` equal
    ``4``: a key built from them could serve a call its validation would reject, so such
    values are never memoized (``TypeError`` tells the caller to validate instead).
    """
    kind = type(value)
    if value is None or kind is int:
        return value
    if kind is tuple:
        for item in value:
            if type(item) is not int:
                raise TypeError("not memoizable")
        return value
    raise TypeError("not memoizable")


def plain_axes(value: Any) -> bool:
    """Whether ``value`` may stand in a memo key (:func:`memo_axes` accepts it).

    Examples
    --------
    >>> plain_axes((1, 2)), plain_axes(4.0)
    (True, False)
    """
    try:
        memo_axes(value)
    except TypeError:
        return False
    return True


#: The ``quantize=`` formats and the largest magnitude each represents.
QUANTIZE_QMAX: dict[str, float] = {"int8": 127.0, "float8_e4m3fn": 448.0,
                                   "float8_e5m2": 57344.0}


#: The smallest magnitude that rounds to infinity in float32 (half an ulp above its
#: largest finite value, where round-to-nearest-even goes up).
FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def check_weight_offset(offset: Any, has_weight: bool, acc: str | None = None) -> float:
    """``weight_offset`` as a Python float: a finite real, and 0 unless there is a weight.

    With the accumulation dtype ``acc`` (a call's, not a layer's construction) it must
    also be finite there: the gain ``weight + weight_offset`` is formed in ``acc``, and
    an offset that overflows it (``1e39`` in float32) would make every output infinite
    or NaN.

    Examples
    --------
    >>> check_weight_offset(1, True)
    1.0
    >>> check_weight_offset(1.0, False)
    Traceback (most recent call last):
    ...
    ValueError: weight_offset=1.0 needs a weight (the gain is weight + weight_offset)...
    >>> check_weight_offset(1e39, True, "float32")
    Traceback (most recent call last):
    ...
    ValueError: weight_offset=1e+39 overflows the accumulation dtype float32...
    """
    if type(offset) is float and math.isfinite(offset):
        value = offset
    elif isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"weight_offset must be a finite real number, got {offset!r} of type "
                        f"{type(offset).__name__}")
    else:
        try:
            value = float(offset)
        except OverflowError:  # an int or Fraction beyond the float range, e.g. 10**400
            raise ValueError(f"weight_offset must be a finite real number, got a value of "
                             f"type {type(offset).__name__} too large to convert to a "
                             "float") from None
        if not math.isfinite(value):
            raise ValueError(f"weight_offset must be a finite real number, got {offset!r}")
    if value != 0.0 and not has_weight:
        raise ValueError(f"weight_offset={offset!r} needs a weight (the gain is weight + "
                         "weight_offset), got weight=None")
    if acc == "float32" and abs(value) >= FLOAT32_OVERFLOW:
        raise ValueError(f"weight_offset={offset!r} overflows the accumulation dtype float32, "
                         "where the gain weight + weight_offset is formed; pass at most "
                         "3.4028235e+38 in magnitude")
    return value


def check_quantize(quantize: Any) -> str | None:
    """``quantize=`` must be None, "int8", "float8_e4m3fn" or "float8_e5m2"."""
    if quantize is None or (isinstance(quantize, str) and quantize in QUANTIZE_QMAX):
        return quantize
    raise ValueError(
        "quantize must be None, 'int8', 'float8_e4m3fn' or 'float8_e5m2', "
        f"got {quantize!r}"
    )


def _numpy_dtype_name(name: str) -> str | None:
    """The canonical name of the dtype NumPy parses ``name`` as (``"f4"`` and
    ``"single"`` name float32, ``"int8"`` int8), or None if it parses none; asked only
    for names that are not canonical already."""
    import warnings

    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated codes such as "a" warn
        try:
            return dtype_name(np.dtype(name))
        except TypeError:
            return None


def check_residual_dtype(residual_dtype: Any) -> str | None:
    """Canonical name of ``residual_dtype=`` (None stays None); a supported float only."""
    if residual_dtype is None:
        return None
    if isinstance(residual_dtype, str):
        if residual_dtype in SUPPORTED:
            return residual_dtype
        # Another name NumPy knows is that dtype: a float ("f4", "single") as the dtype
        # object is, another kind ("int8") the wrong type as the dtype itself would be;
        # a name that is no dtype ("float99") is a wrong value.
        name = _numpy_dtype_name(residual_dtype)
        if name in SUPPORTED:
            return name
        error = ValueError if name is None else TypeError
        raise error(f"residual_dtype must be {_SUPPORTED_TEXT} (a dtype or its name), "
                    f"got {residual_dtype!r}")
    try:
        name = dtype_name(residual_dtype)
    except Exception:  # an object that is no dtype at all
        name = None
    if name not in SUPPORTED:
        raise TypeError(f"residual_dtype must be {_SUPPORTED_TEXT} (a dtype or its name), "
                        f"got {residual_dtype!r}")
    return name
