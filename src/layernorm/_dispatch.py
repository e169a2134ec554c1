"""The one router: which library an array comes from, and which backend computes for it.

:func:`route` is the only place that decides where a call runs; :func:`backend_name`,
the public functions, the engine and the torch and Dask adapters all ask it. The
library of an array is cached per ``type(x)`` (einops style). Optional libraries are
never imported to classify an array: an array can only be a CuPy/torch/Dask array if
its library is already loaded, so the type's module is enough. Only a torch CUDA tensor
asks whether CuPy can be imported (:func:`cupy_available`), once per process.
"""

from __future__ import annotations

import functools
import importlib
import numbers
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._dtypes import array_library
from ._validate import check_backend_name

#: The library names :func:`library_of` answers.
LIBRARIES = ("numpy", "cupy", "torch", "dask", "array_api")

#: Libraries whose arrays the native kernels take directly.
NATIVE_BACKEND = {"numpy": "numba", "cupy": "cupy"}

_LIBRARY_BY_TYPE: dict[type, str] = {np.ndarray: "numpy"}


@dataclass(frozen=True)
class Route:
    """Where one call runs.

    Attributes
    ----------
    library : str
        The library of ``x``: "numpy", "cupy", "torch", "dask" or "array_api".
    backend : str
        What computes: "numba" (CPU kernels), "cupy" (CUDA kernels) or "array_api"
        (the generic implementation in the array's own namespace). For Dask, the
        backend that computes each block.
    """

    library: str
    backend: str


def _classify(x: Any, name: str = "x") -> str:
    if isinstance(x, np.ndarray):
        if isinstance(x, np.ma.MaskedArray):
            raise TypeError(
                f"{name} is a numpy.ma.MaskedArray: a mask cannot be honoured by a "
                f"normalization over whole rows; pass {name}.filled(value) or {name}.data "
                "explicitly"
            )
        if isinstance(x, np.matrix):
            raise TypeError(
                f"{name} is a numpy.matrix, whose operations do not follow ndarray "
                f"semantics; pass np.asarray({name})"
            )
        return "numpy"
    root = array_library(x)
    if root in ("cupy", "torch", "dask"):
        return root
    # Subclasses defined elsewhere (a tensor subclass of a user's module) belong to the
    # library of their base class; an unimported library has no arrays to check for.
    for library, module_name, base in _ARRAY_TYPES:
        module = sys.modules.get(module_name)
        cls = getattr(module, base, None) if module is not None else None
        if cls is not None and isinstance(x, cls):
            return library
    from array_api_compat import is_array_api_obj

    if is_array_api_obj(x) and not isinstance(x, np.generic):
        return "array_api"
    raise TypeError(
        f"{name} must be an array (NumPy, CuPy, torch, Dask or any array-API array), "
        f"got {type(x).__module__}.{type(x).__qualname__}"
    )


#: The array base class of each library with a native route: (library, module, class).
_ARRAY_TYPES = (("torch", "torch", "Tensor"), ("cupy", "cupy", "ndarray"),
                ("dask", "dask.array", "Array"))


def given_array(value: Any) -> Any:
    """``value`` where it is an array, None for None and numbers (Python or NumPy scalars).

    For the library checks of arguments that may be either (``scale=``): a number goes
    with arrays of any library.

    Examples
    --------
    >>> import numpy as np
    >>> given_array(np.float32(0.5)) is None, given_array(np.ones(2)).shape
    (True, (2,))
    """
    if value is None or isinstance(value, (numbers.Number, np.generic)):
        return None
    return value


def plain_ndarrays(library: str, *arrays: Any) -> tuple[Any, ...]:
    """``arrays`` with every ``ndarray`` subclass instance (of a NumPy-library call) as a
    plain ``ndarray`` view of the same memory; anything else as it is.

    The generic path computes with the arrays' own operators, which a subclass may
    redefine (a ``__mul__`` that scales its result would scale the output silently), and
    would return the subclass; the kernels read memory only. Masked arrays and
    ``np.matrix`` stay as they are, to be refused. Outputs (``out=``) and a static
    ``scale`` are not passed here: a call returns the objects it was given (a scale's
    values are read through ``asarray``, :func:`._engine.static_inverse`).

    Examples
    --------
    >>> import numpy as np
    >>> class Tagged(np.ndarray):
    ...     pass
    >>> a, b = plain_ndarrays("numpy", np.ones(2).view(Tagged), None)
    >>> type(a).__name__, b
    ('ndarray', None)
    """
    if library != "numpy":
        return arrays
    return tuple(np.asarray(a) if isinstance(a, np.ndarray) and type(a) is not np.ndarray
                 and not isinstance(a, _REFUSED_SUBCLASSES) else a for a in arrays)


#: The ``ndarray`` subclasses refused with their own ``TypeError`` (:func:`library_of`).
_REFUSED_SUBCLASSES = (np.ma.MaskedArray, np.matrix)


def library_of(x: Any, name: str = "x") -> str:
    """Library of an array: "numpy", "cupy", "torch", "dask" or "array_api".

    ``ndarray`` subclasses that NumPy itself computes with ndarray semantics (memmaps,
    for instance) count as NumPy arrays; masked arrays and ``np.matrix`` are refused
    with a ``TypeError`` (a mask cannot be honoured; a matrix is always 2-D).

    Examples
    --------
    >>> import numpy as np
    >>> library_of(np.ones(3))
    'numpy'
    """
    kind = _LIBRARY_BY_TYPE.get(type(x))
    if kind is None:
        kind = _classify(x, name)
        _LIBRARY_BY_TYPE[type(x)] = kind
    return kind


@functools.cache
def cupy_available() -> bool:
    """Whether CuPy imports (asked once per process, only for CUDA tensors)."""
    try:
        importlib.import_module("cupy")
    except Exception:  # not installed, or an install broken in any way
        return False
    return True


def _torch_backend(x: Any, backend: str | None) -> str:
    device = x.device.type
    if backend == "array_api":
        return backend
    if backend == "numba" and device != "cpu":
        raise ValueError(f"backend='numba' needs a CPU tensor as x, got one on {x.device}")
    if backend == "cupy":
        if device != "cuda":
            raise ValueError(f"backend='cupy' needs a CUDA tensor as x, got one on {x.device}")
        if not cupy_available():
            raise ImportError("backend='cupy' needs CuPy installed (pip install cupy-cuda13x)")
        return backend
    if device == "cpu":
        return "numba"
    if device == "cuda" and cupy_available():
        return "cupy"
    return "array_api"


def backend_for(library: str, backend: str | None, x: Any = None) -> str:
    """The backend for arrays of ``library`` (not torch), or ``backend`` if it fits
    (else a ``ValueError`` naming ``x``'s library, when given, for an array-API array).

    Examples
    --------
    >>> backend_for("numpy", None)
    'numba'
    >>> backend_for("numpy", "array_api")
    'array_api'
    """
    native = NATIVE_BACKEND.get(library)
    if backend is None:
        return native or "array_api"
    if backend == "array_api" or backend == native:
        return backend
    needs = {"numba": "a NumPy array", "cupy": "a CuPy array"}[backend]
    got = f"an array of {describe(x)}" if library == "array_api" and x is not None \
        else f"a {library} array"
    raise ValueError(f"backend={backend!r} needs {needs} as x, got {got}")


def route(x: Any, backend: str | None = None) -> Route:
    """Where a call with input ``x`` runs, with ``backend=`` forced or not.

    Parameters
    ----------
    x : array
        The input of the call.
    backend : {"numba", "cupy", "array_api"}, optional
        A forced backend; ``ValueError`` if it cannot compute ``x``.

    Returns
    -------
    Route
        The library of ``x`` and the backend that computes (for Dask, each block).

    Examples
    --------
    >>> import numpy as np
    >>> route(np.ones(3))
    Route(library='numpy', backend='numba')
    """
    check_backend_name(backend)
    library = library_of(x)
    if library == "torch":
        return Route(library, _torch_backend(x, backend))
    if library == "dask":
        meta = getattr(x, "_meta", None)
        blocks = "numpy" if meta is None else library_of(meta)
        if blocks == "torch":
            return Route(library, _torch_backend(meta, backend))
        return Route(library, backend_for(blocks, backend))
    return Route(library, backend_for(library, backend, x))


def backend_name(x: Any) -> str:
    """Name of the backend that normalizes ``x``: "numba", "cupy" or "array_api".

    NumPy arrays (and torch CPU tensors, and Dask arrays of NumPy blocks) run on the
    Numba kernels, CuPy arrays (and torch CUDA tensors, where CuPy imports) on the CUDA
    kernels, anything else on the generic array-API implementation.

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
    return route(x).backend


def describe(x: Any) -> str:
    """Short description of an array's library, for error messages."""
    return f"{type(x).__module__.split('.', 1)[0]} ({type(x).__qualname__})"


def _device(arr: Any) -> Any:
    from array_api_compat import device

    return device(arr)


def check_companions(x: Any, library: str, **arrays: Any) -> None:
    """Every other array argument must come from the library and device of ``x``.

    NumPy parameters are accepted with a Dask ``x`` (Dask arrays hold NumPy blocks).
    """
    if library == "numpy" and all(arr is None or type(arr) is np.ndarray
                                  for arr in arrays.values()):
        return
    for name, arr in arrays.items():
        if arr is None:
            continue
        other = library_of(arr, name)
        if other == library:
            if library == "array_api":
                from array_api_compat import array_namespace

                if array_namespace(arr) is not array_namespace(x):
                    raise TypeError(
                        f"{name} comes from {describe(arr)} but x comes from {describe(x)}; "
                        "pass arrays of one library"
                    )
            if library in ("array_api", "cupy"):
                dev_x, dev_arr = _device(x), _device(arr)
                # A JAX tracer (under jax.jit / jax.grad) has no device: nothing to compare.
                if dev_x is not None and dev_arr is not None and dev_arr != dev_x:
                    raise TypeError(
                        f"{name} is on device {dev_arr} but x is on device {dev_x}; "
                        "pass arrays on one device"
                    )
            continue
        if library == "dask" and other == "numpy":
            continue
        raise TypeError(
            f"{name} comes from {describe(arr)} but x comes from {describe(x)}; "
            "pass arrays of one library"
        )
