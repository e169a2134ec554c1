"""The kernels' disk cache, keyed to every source file the kernels are built from.

Numba's cache checks only the file that defines a kernel, but our kernels inline code
from several modules (:mod:`.rowmath`, :mod:`._simd`, :mod:`._scalars`, ...): after an
edit of one of those, Numba would load stale machine code. :func:`cached_njit` therefore
keeps each kernel's cache in a directory named after one hash of every ``.py`` file of
this package (:func:`source_salt`), inside the directory Numba itself would have chosen
(``NUMBA_CACHE_DIR``, the package's ``__pycache__`` or the user-wide cache directory):
any edit of any of them selects a new, empty directory.

It degrades to a correct, slower behaviour, never to a stale or failing one:

* no writable location (a read-only install without ``NUMBA_CACHE_DIR``): the kernels
  compile in memory in every process, instead of Numba's ``cannot cache function``
  error;
* a Numba whose cache internals differ from the ones used here: the same, no disk cache;
* ``NUMBA_DISABLE_JIT=1``: the kernels are Python functions, there is nothing to cache.

Directories of earlier salts are left in place (another installation sharing
``NUMBA_CACHE_DIR`` may still use them). ``NUMBA_CACHE_LOCATOR_CLASSES``, where set,
replaces the salted locator as it replaces Numba's own: that user's choice is honoured.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any

from .optlevel import at_kernel_opt_level

#: The directory whose ``.py`` files the salt covers (this package).
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
#: Cache directories are named this prefix plus :func:`source_salt`.
SALT_PREFIX = "layernorm-kernels-"


@functools.cache
def source_salt(directory: str = PACKAGE_DIR) -> str:
    """One hash of the names and contents of every ``.py`` file under ``directory``.

    Computed once per process (about a millisecond), when the kernels are first defined:
    importing ``layernorm`` never computes it.

    Parameters
    ----------
    directory : str
        The package directory (default: this one).

    Returns
    -------
    str
        16 hexadecimal digits.
    """
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    data = f.read()
                relative = os.path.relpath(path, directory).replace(os.sep, "/")
                digest.update(relative.encode() + b"\0" + len(data).to_bytes(8, "little"))
                digest.update(data)
    return digest.hexdigest()[:16]


@functools.cache
def _salted_cache_class() -> type | None:
    """Numba's ``FunctionCache`` with a salted locator, or None for a Numba whose cache
    internals differ (then :func:`disk_cache` gives no cache, which is always correct)."""
    try:
        from numba.core import caching

        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
        base_locators = list(impl._locator_classes)

        class SaltedLocator(caching._CacheLocator):
            """The locator Numba would pick, one salted directory further down."""

            def __init__(self, base: Any, salt: str) -> None:
                self._base = base
                self._cache_path = os.path.join(base.get_cache_path(), SALT_PREFIX + salt)
                # Numba's "cannot cache" warning names the source file through this.
                self._py_file = getattr(base, "_py_file", PACKAGE_DIR)

            def get_cache_path(self) -> str:
                return self._cache_path

            def get_source_stamp(self) -> Any:
                return self._base.get_source_stamp()

            def get_disambiguator(self) -> str:
                return self._base.get_disambiguator()

            @classmethod
            def from_function(cls, py_func: Any, py_file: str) -> Any:
                for base_class in base_locators:
                    base = base_class.from_function(py_func, py_file)
                    if base is None:
                        continue
                    locator = cls(base, source_salt())
                    try:
                        locator.ensure_cache_path()
                    except OSError:
                        continue
                    return locator
                return None

        class SaltedImpl(caching.CompileResultCacheImpl):
            _locator_classes = (SaltedLocator,)  # iterated only

        class SaltedFunctionCache(caching.FunctionCache):
            _impl_class = SaltedImpl

        return SaltedFunctionCache
    except Exception:  # another Numba: no disk cache rather than a stale one
        return None


def disk_cache(py_func: Callable[..., Any]) -> Any:
    """A Numba cache for ``py_func`` in the salted directory, or None where there is none.

    Parameters
    ----------
    py_func : function
        The Python function of a kernel.

    Returns
    -------
    numba.core.caching.FunctionCache or None
        None when no location is writable or Numba's internals differ.
    """
    cache_class = _salted_cache_class()
    if cache_class is None:
        return None
    try:
        return cache_class(py_func)
    except Exception:  # RuntimeError "no locator available", or another Numba
        return None


def cached_njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, **options)`` with the cache of :func:`disk_cache`,
    compiled at the kernels' optimization level (:mod:`.optlevel`).

    A kernel that is not ``parallel`` releases the GIL while it runs (``nogil``, unless
    ``options`` say otherwise; 0.05 us a call): other Python threads run meanwhile, such
    as a parallel kernel's compilation in the background
    (:func:`.entry.ready_entry_point`) or a threaded scheduler's other tasks. The
    parallel kernels keep it: one Python thread at a time runs them (see the backend's
    ``_parallel_lock``), and a Numba threading layer of another library's code must not
    meet them from a second thread.

    Compilation stays lazy: the decorator defines the kernel, its first call compiles it
    or loads it from the cache.

    Parameters
    ----------
    **options
        Options of ``numba.njit`` other than ``cache``.

    Returns
    -------
    callable
        The decorator.
    """
    from numba import njit

    def decorate(fn: Callable[..., Any]) -> Any:
        kernel = njit(**{"nogil": not options.get("parallel", False), **options})(fn)
        # Under NUMBA_DISABLE_JIT njit returns ``fn`` itself: nothing to cache.
        if getattr(kernel, "py_func", None) is fn and hasattr(kernel, "_cache"):
            cache = disk_cache(fn)
            if cache is not None:
                kernel._cache = cache
            at_kernel_opt_level(kernel)
        return kernel

    return decorate
