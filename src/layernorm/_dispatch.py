"""Which library an array comes from, and so which backend serves it.

The answer is cached per ``type(x)`` (einops style). Optional libraries are never
imported here: an array can only be a CuPy/torch/Dask array if its library is
already loaded, so classifying by the type's module is enough.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: library name -> backend that computes for it (torch and dask are routed by device/meta).
_LIBRARY_BY_TYPE: dict[type, str] = {np.ndarray: "numpy"}


def _classify(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    root = type(x).__module__.split(".", 1)[0]
    if root in ("cupy", "torch", "dask"):
        return root
    from array_api_compat import is_array_api_obj

    if is_array_api_obj(x) and not isinstance(x, np.generic):
        return "array_api"
    raise TypeError(
        f"x must be an array (NumPy, CuPy, torch, Dask or any array-API array), "
        f"got {type(x).__module__}.{type(x).__qualname__}"
    )


def library_of(x: Any, name: str = "x") -> str:
    """Library of an array: "numpy", "cupy", "torch", "dask" or "array_api".

    Examples
    --------
    >>> import numpy as np
    >>> library_of(np.ones(3))
    'numpy'
    """
    kind = _LIBRARY_BY_TYPE.get(type(x))
    if kind is None:
        try:
            kind = _classify(x)
        except TypeError:
            if name != "x":
                raise TypeError(
                    f"{name} must be an array, got {type(x).__module__}."
                    f"{type(x).__qualname__}"
                ) from None
            raise
        _LIBRARY_BY_TYPE[type(x)] = kind
    return kind


def backend_name(x: Any) -> str:
    """Name of the backend that normalizes ``x``: "numba", "cupy" or "array_api".

    NumPy arrays (and torch CPU tensors, and Dask arrays of NumPy blocks) run on the
    Numba kernels, CuPy arrays (and torch CUDA tensors) on the CUDA kernels, anything
    else on the generic array-API implementation.

    Parameters
    ----------
    x : array
        Any array the library accepts.

    Returns
    -------
    str
        "numba", "cupy" or "array_api".

    Examples
    --------
    >>> import numpy as np
    >>> import layernorm as ln
    >>> ln.backend_name(np.ones((2, 3), dtype=np.float32))
    'numba'
    """
    lib = library_of(x)
    if lib == "numpy":
        return "numba"
    if lib == "cupy":
        return "cupy"
    if lib == "torch":
        device = x.device.type
        if device == "cpu":
            return "numba"
        if device == "cuda":
            # Without CuPy, CUDA tensors take the generic path on torch's namespace.
            from importlib.util import find_spec

            return "cupy" if find_spec("cupy") is not None else "array_api"
        return "array_api"
    if lib == "dask":
        meta = getattr(x, "_meta", None)
        return backend_name(meta) if meta is not None else "numba"
    return "array_api"


def describe(x: Any) -> str:
    """Short description of an array's library, for error messages."""
    return f"{type(x).__module__.split('.', 1)[0]} ({type(x).__qualname__})"


def _device(arr: Any) -> Any:
    from array_api_compat import device

    return device(arr)


def check_companions(x: Any, lib: str, **arrays: Any) -> None:
    """Every other array argument must come from the library and device of ``x``.

    NumPy parameters are accepted with a Dask ``x`` (Dask arrays hold NumPy blocks).
    """
    if lib == "numpy" and all(arr is None or type(arr) is np.ndarray for arr in arrays.values()):
        return
    for name, arr in arrays.items():
        if arr is None:
            continue
        other = library_of(arr, name)
        if other == lib:
            if lib == "array_api":
                from array_api_compat import array_namespace

                if array_namespace(arr) is not array_namespace(x):
                    raise TypeError(
                        f"{name} comes from {describe(arr)} but x comes from {describe(x)}; "
                        "pass arrays of one library"
                    )
            if lib in ("array_api", "cupy"):
                dev_x, dev_arr = _device(x), _device(arr)
                # A JAX tracer (under jax.jit / jax.grad) has no device: nothing to compare.
                if dev_x is not None and dev_arr is not None and dev_arr != dev_x:
                    raise TypeError(
                        f"{name} is on device {dev_arr} but x is on device {dev_x}; "
                        "pass arrays on one device"
                    )
            continue
        if lib == "dask" and other == "numpy":
            continue
        raise TypeError(
            f"{name} comes from {describe(arr)} but x comes from {describe(x)}; "
            "pass arrays of one library"
        )
