"""How the jitted functions that only other kernels call are compiled.

Numba compiles a jitted function that a kernel calls as a function of its own, with two
entry points for callers outside compiled code: a CPython wrapper (unboxing Python
arguments) and a C-callable wrapper. Our helpers are only ever called from other
kernels, whose compiled code calls them directly, so both wrappers were compile time
spent for nothing on every first call: measured, float32 (64, 1024), fresh process,
empty cache, CPU seconds of three runs each, with / without the wrappers: first
``layer_norm_backward`` (nine helpers) 2.03-2.12 / 1.72-1.81 s, first ``layer_norm``
(four) 2.14-2.36 / 2.14-2.21 s. The machine code is the same.

A function compiled this way must not be called from Python: with no CPython entry
point, Numba would jump to a null one. Only the kernels of this package call them (the
entry points, :func:`.diskcache.cached_njit`, keep their wrappers), and under
``NUMBA_DISABLE_JIT`` they are plain Python functions again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba import njit

#: ``numba.njit``'s options for a kernel's helper: the kernels' error model, no wrappers.
CALLEE_OPTIONS = {"error_model": "numpy", "no_cpython_wrapper": True, "no_cfunc_wrapper": True}


def callee_njit(fn: Callable[..., Any]) -> Any:
    """Compile ``fn`` as a helper that only other kernels call (no Python entry points).

    Parameters
    ----------
    fn : callable
        A function of the kernels' code.

    Returns
    -------
    numba.core.registry.CPUDispatcher or callable
        The jitted function (``fn`` itself under ``NUMBA_DISABLE_JIT``).

    Examples
    --------
    >>> import numpy as np
    >>> from numba import njit
    >>> @callee_njit
    ... def twice(v):
    ...     return v + v
    >>> @njit
    ... def kernel(v):
    ...     return twice(v)
    >>> int(kernel(np.int64(21)))
    42
    """
    return njit(**CALLEE_OPTIONS)(fn)
