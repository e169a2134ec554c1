"""Compiled kernels looked up by dtype and rank: one specialization serves every layout.

Numba compiles one specialization per distinct combination of argument types, and an
array's type records its layout (C, F or any) and whether it is read-only. The kernels
read rows through raw pointers and test strides at run time, so a C-contiguous, a
Fortran-ordered, a strided and a read-only input all run the same machine code. Calling
the dispatcher directly would still compile each of them (seconds each). Here every
array argument is typed as layout ``"A"``, read-only unless the kernel writes it, and
the compiled entry point is memoized by what still matters: dtype, rank and alignment
of the arrays and the Python types of the scalars.

A first call that finds its kernel in Numba's disk cache loads it without the refresh
Numba's public ``compile`` performs first: that refresh imports every typing and lowering
registry Numba has (SciPy's linear algebra included), about 0.25 s, and a cached kernel
needs none of them, only Numba's runtime (:func:`_load_cached`). A kernel not in the
cache, or a Numba whose internals differ, takes the public path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

#: Compiled entry points by kernel and argument types (grows when a call compiles or loads).
entry_points: dict[tuple[Any, ...], Callable[..., Any]] = {}
#: The threads compiling entry points in the background (:func:`ready_entry_point`), by
#: key, and the keys whose background compilation failed.
compiling: dict[tuple[Any, ...], threading.Thread] = {}
_failed: set[tuple[Any, ...]] = set()


#: Whether :func:`ready_entry_point` compiles in the background (see
#: :func:`set_background_compiles`).
_background = True


def set_background_compiles(enabled: bool) -> bool:
    """Whether :func:`ready_entry_point` compiles a kernel on a thread of its own
    (``True``, the default) or in the caller, as :func:`entry_point` does; returns the
    previous setting.

    ``python -m layernorm bench`` compiles in the caller: in a process with an empty
    cache, a background compilation left the library's and torch's calls with fresh
    outputs slower in the first timed rounds after it (measured, 2 threads, (44, 4096)
    in cache: 45-82 us and 190-280 us against 21 and 36 us; not seen outside ``bench``,
    where those outputs come from ``malloc`` in its default mode).
    """
    global _background
    previous, _background = _background, bool(enabled)
    return previous


def finish_compiling() -> None:
    """Wait for the background compilations (:func:`ready_entry_point`): before a
    fork, whose child would inherit Numba's compiler lock held by a thread it does not
    have, and so hang on its first compilation."""
    for thread in list(compiling.values()):
        thread.join()


if hasattr(os, "register_at_fork"):
    # Hooks run before a fork in the reverse order of their registration. logging's
    # holds its module lock through the fork; a compiling thread that imports a module
    # which asks for a logger (Numba's registries import SciPy) waited for it while
    # finish_compiling waited for that thread: the fork never returned. Importing
    # logging first registers its hook before this one, so this one runs first.
    import logging  # noqa: F401

    os.register_at_fork(before=finish_compiling)


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
        A jitted kernel (a plain function under ``NUMBA_DISABLE_JIT=1``, returned as
        it is).
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
    if not hasattr(kernel, "overloads"):
        # NUMBA_DISABLE_JIT=1 (Numba's debugging mode): the kernel is a Python function.
        return kernel
    key = _key(kernel, args)
    entry = entry_points.get(key)
    if entry is None:
        entry = entry_points[key] = _compiled(kernel, _signature(writes, args))
    return entry


def ready_entry_point(kernel: Any, writes: tuple[int, ...],
                      args: tuple[Any, ...]) -> Callable[..., Any] | None:
    """:func:`entry_point` if the kernel for arguments like ``args`` is compiled or in
    Numba's disk cache (loaded now), else None, its compilation started on a thread of
    its own (once; the caller runs another kernel meanwhile). While any such thread
    runs, a kernel that is not compiled yet gets None without a look at the disk cache:
    the thread holds Numba's compiler lock, which loading from the cache takes too.

    For the parallel variants, whose first use the backend can put off (the serial
    kernel gives the same bits): compiling one took 1.2-1.5 s, which a user's second
    call of a shape paid. The thread is not a daemon: a process that ends while it
    compiles waits for it, and the kernel is in the disk cache for the next; a fork
    waits for it too (:func:`finish_compiling`). A compilation that failed is redone by
    the next call, in the caller's thread, whose error it raises. The serial kernels
    release the GIL (:func:`.diskcache.cached_njit`), so that the compilation has the
    other core while they run: measured, (64, 1024) float32 at 2 threads, empty cache,
    a loop of calls, the parallel kernel was ready 1.4 s after the first call, 50,000
    serial calls later (5.5-13.4 s, 180,000-530,000 calls, with the GIL held).
    """
    if not hasattr(kernel, "overloads"):
        return kernel
    key = _key(kernel, args)
    entry = entry_points.get(key)
    if entry is not None:
        return entry
    if not _background:
        return entry_point(kernel, writes, args)
    if compiling:  # this one, or another holding Numba's compiler lock: ask again later
        return None
    if key in _failed:
        _failed.discard(key)
        return entry_point(kernel, writes, args)
    sig = _signature(writes, args)
    entry = _cached(kernel, sig)
    if entry is not None:
        entry_points[key] = entry
        return entry

    def compile_in_background() -> None:
        try:
            entry_points[key] = kernel.compile(sig)
        except BaseException:
            _failed.add(key)
        finally:
            compiling.pop(key, None)

    thread = compiling[key] = threading.Thread(target=compile_in_background,
                                               name="layernorm-compile")
    thread.start()
    return None


def _compiled(kernel: Any, sig: tuple[Any, ...]) -> Callable[..., Any]:
    entry = _cached(kernel, sig)
    return entry if entry is not None else kernel.compile(sig)


def _cached(kernel: Any, sig: tuple[Any, ...]) -> Callable[..., Any] | None:
    """:func:`_load_cached`, or None where it fails (internals of another Numba version:
    the public path, ``kernel.compile``, is right)."""
    try:
        return _load_cached(kernel, sig)
    except Exception:
        return None


def _load_cached(kernel: Any, sig: tuple[Any, ...]) -> Callable[..., Any] | None:
    """``kernel.compile(sig)`` for a kernel in the disk cache, minus the registry refresh.

    The steps of Numba's ``Dispatcher.compile`` on a cache hit, except
    ``target_context.refresh()``: only the runtime it initializes (the kernels allocate
    scratch arrays) is needed to run machine code that is already compiled. Returns None
    on a cache miss.
    """
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.runtime import rtsys

    load = getattr(kernel._cache, "_load_overload", None)
    if load is None:  # no disk cache (see .diskcache): compile
        return None
    with global_compiler_lock:
        existing = kernel.overloads.get(sig)
        if existing is not None:
            return existing.entry_point
        context = kernel.targetctx
        rtsys.initialize(context)
        result = load(sig, context)
        if result is None or result.objectmode:
            return None
        context.insert_user_function(result.entry_point, result.fndesc, [result.library])
        kernel.add_overload(result)
        return result.entry_point


def resolving(owner: Any, slot: str, kernel: Any, writes: tuple[int, ...]) -> Callable[..., Any]:
    """A stand-in for ``kernel`` that replaces itself with the compiled entry point.

    Its first call looks up the entry point for its arguments (:func:`entry_point`),
    runs it and stores it as ``owner.<slot>``, so that later calls through that
    attribute skip Numba's type resolution. Only for an owner whose own checks
    guarantee that every later call passes arguments of the same dtypes, ranks and
    scalar types (the short paths' plans).

    Parameters
    ----------
    owner : object
        Holds the stand-in in the attribute ``slot``.
    slot : str
        Name of that attribute.
    kernel : numba.core.registry.CPUDispatcher
        The jitted kernel.
    writes : tuple of int
        Positions of the arrays the kernel writes (see :func:`entry_point`).

    Returns
    -------
    callable
        Takes the kernel's arguments and returns its result.
    """
    def first_call(*args: Any) -> Any:
        entry = entry_point(kernel, writes, args)
        result = entry(*args)
        setattr(owner, slot, entry)
        return result

    return first_call


def call(kernel: Any, writes: tuple[int, ...], *args: Any) -> Any:
    """Call ``kernel`` through :func:`entry_point` (same arguments, same result)."""
    return entry_point(kernel, writes, args)(*args)
