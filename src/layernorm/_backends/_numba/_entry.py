"""Compiled kernels looked up by dtype and rank: one specialization serves every layout.

Numba compiles one specialization per distinct combination of argument types, and an
array's type records its layout (C, F or any) and whether it is read-only. The kernels
read rows through raw pointers and test strides at run time, so a C-contiguous, a
Fortran-ordered, a strided and a read-only input all run the same machine code. Calling
the dispatcher directly would still compile each of them (seconds each). Here every
array argument is typed as layout ``"A"``, read-only unless the kernel writes it, and
the compiled entry point is memoized by what still matters: dtype, rank and alignment
of the arrays and the Python types of the scalars.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

_entry_points: dict[tuple[Any, ...], Callable[..., Any]] = {}


def _key(kernel: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (kernel, *[(a.dtype, a.ndim, a.flags.aligned) if isinstance(a, np.ndarray)
                      else type(a) for a in args])


def _signature(writes: tuple[int, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
    from numba import typeof

    sig = []
    for position, arg in enumerate(args):
        numba_type = typeof(arg)
        if isinstance(arg, np.ndarray):
            numba_type = numba_type.copy(layout="A", readonly=position not in writes)
        sig.append(numba_type)
    return tuple(sig)


def entry_point(kernel: Any, writes: tuple[int, ...], args: tuple[Any, ...]) -> Any:
    """The compiled ``kernel`` for arguments like ``args`` (compiled or loaded once).

    Parameters
    ----------
    kernel : numba.core.registry.CPUDispatcher
        A jitted kernel.
    writes : tuple of int
        Positions of the array arguments the kernel writes (typed writable).
    args : tuple
        Arguments of the call. Arrays may have any layout; the others are scalars or
        None.

    Returns
    -------
    callable
        The compiled function; it takes the same arguments as ``kernel``.
    """
    key = _key(kernel, args)
    entry = _entry_points.get(key)
    if entry is None:
        entry = _entry_points[key] = kernel.compile(_signature(writes, args))
    return entry


def call(kernel: Any, writes: tuple[int, ...], *args: Any) -> Any:
    """Call ``kernel`` through :func:`entry_point` (same arguments, same result)."""
    return entry_point(kernel, writes, args)(*args)
