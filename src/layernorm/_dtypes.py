"""Supported dtypes and the accumulation-precision policy, in one place.

Every backend names dtypes by their canonical string ("float16", "bfloat16",
"float32", "float64") so that NumPy, ml_dtypes, CuPy, torch and JAX dtypes can be
compared without importing any of those libraries here.
"""

from __future__ import annotations

from typing import Any

SUPPORTED: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
#: The 16-bit floats (stored as raw bits where a library has no native type).
HALF_DTYPES: tuple[str, ...] = ("float16", "bfloat16")

#: Statistics are accumulated in float32 for 16- and 32-bit inputs, float64 for float64.
ACCUMULATION: dict[str, str] = {
    "float16": "float32",
    "bfloat16": "float32",
    "float32": "float32",
    "float64": "float64",
}

#: C++ element and accumulation type names used by the CUDA kernels.
CPP_TYPES: dict[str, str] = {
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
    "float64": "double",
}

#: Machine epsilon of each accumulation dtype (the default RMSNorm eps, as in torch).
MACHINE_EPS: dict[str, float] = {
    "float32": 1.1920928955078125e-07,
    "float64": 2.220446049250313e-16,
}


def dtype_name(dtype: Any) -> str:
    """Canonical short name of a dtype from any array library (cached per dtype).

    Examples
    --------
    >>> import numpy as np
    >>> dtype_name(np.dtype("float32"))
    'float32'
    >>> dtype_name(np.int64)
    'int64'
    """
    # Keyed by type first, so dtypes of different libraries are never compared for
    # equality (array_api_strict warns when one of its dtypes meets a NumPy dtype).
    try:
        key = (type(dtype), dtype)
        name = _NAMES.get(key)
    except TypeError:  # an unhashable dtype object
        return _name(dtype)
    if name is None:
        name = _NAMES[key] = _name(dtype)
    return name


_NAMES: dict[tuple[type, Any], str] = {}


def _name(dtype: Any) -> str:
    name = getattr(dtype, "name", None)
    if not isinstance(name, str) and isinstance(dtype, type):
        # NumPy scalar types (np.float32, ml_dtypes.bfloat16) name themselves via np.dtype.
        import numpy as np

        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
    if not isinstance(name, str):
        # torch.float32 -> "torch.float32"; array_api_strict dtypes print similarly.
        name = str(dtype)
    name = name.rsplit(".", 1)[-1]
    if name.startswith("dtype("):
        name = name[6:].strip("')\"")
    return name


def accumulation_name(name: str) -> str:
    """Accumulation dtype name for a supported input dtype name."""
    return ACCUMULATION[name]


def array_library(arr: Any) -> str:
    """The top-level package of ``arr``'s type: "numpy", "cupy", "torch", "jax" (its
    arrays' types live in ``jaxlib``; under ``jax.jit``, tracers in ``jax``), ...

    Examples
    --------
    >>> import numpy as np
    >>> array_library(np.zeros(2))
    'numpy'
    """
    library = type(arr).__module__.split(".", 1)[0]
    return "jax" if library == "jaxlib" else library


def bit_view(arr: Any, name: str) -> Any:
    """``arr``'s bits as the dtype called ``name`` of the same size (an integer type to
    read a float's bits, a float type to read them back), or None for a library
    without such a view (array_api_strict, Dask, ...). A view where the library has one
    (NumPy, CuPy, torch), a bitcast under JAX (arrays and ``jax.jit`` tracers).

    Examples
    --------
    >>> import numpy as np
    >>> bit_view(np.array([1.0], np.float32), "int32")
    array([1065353216], dtype=int32)
    """
    library = array_library(arr)
    if library in ("numpy", "cupy"):
        return arr.view(name)
    if library == "torch":
        import torch

        return arr.view(getattr(torch, name))
    if library == "jax":
        import jax

        return jax.lax.bitcast_convert_type(arr, getattr(jax.numpy, name))
    return None
