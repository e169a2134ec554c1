"""Shared fixtures: array libraries (skipped when missing), dtypes and tolerances.

``library`` runs one test body on every array library the contract covers (NumPy,
array_api_strict, torch, JAX, Dask, CuPy): see :class:`Library`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import pytest

DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
}

#: max |y - y_ref| allowed for unit-scale outputs, by dtype (output rounding dominates).
ATOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5, "float64": 1e-12}


def _cupy_or_skip():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # no driver, no device
        pytest.skip(f"no CUDA device: {exc}")
    return cupy


@pytest.fixture(params=["numpy", "cupy"])
def native_xp(request):
    """Namespaces with native kernels: NumPy (Numba) and CuPy (CUDA, skipped without GPU)."""
    if request.param == "cupy":
        return _cupy_or_skip()
    return np


@pytest.fixture(params=list(DTYPES))
def dtype_name(request):
    return request.param


def to_numpy(a):
    """Any array (NumPy, CuPy, torch) -> NumPy float64 copy, for comparisons."""
    if hasattr(a, "get"):
        a = a.get()
    if hasattr(a, "detach"):
        a = a.detach().cpu().float().numpy() if str(a.dtype) == "torch.bfloat16" \
            else a.detach().cpu().numpy()
    return np.asarray(a).astype(np.float64)


def asarray(xp, a, dtype):
    """NumPy data -> array of ``xp`` with a dtype name (bfloat16 via ml_dtypes on NumPy)."""
    host = np.asarray(a).astype(DTYPES[dtype])
    if xp is np:
        return host
    return xp.asarray(host)


def random_rows(rng, shape, dtype, loc=0.0, scale=1.0):
    """Random normal data (never zeros) rounded to ``dtype``."""
    return (loc + scale * rng.standard_normal(shape)).astype(DTYPES[dtype])


def optional(name):
    """Import an optional library or skip the test."""
    return pytest.importorskip(name)


#: Tolerances of the statistics (mean, rstd), by accumulation dtype.
STATS_RTOL = {"float32": 2e-6, "float64": 1e-12}


def acc_dtype(dtype: str) -> str:
    """The accumulation (and statistics) dtype of an input dtype name."""
    return "float64" if dtype == "float64" else "float32"


# --------------------------------------------------------------------------- libraries


@dataclass(frozen=True)
class Library:
    """One array library under test: its namespace and converters to and from NumPy.

    ``native`` says the library computes eagerly on our own kernels (Numba or CUDA),
    where the bitwise guarantees of the contract (batch independence) apply.
    """

    name: str
    xp: Any
    #: dtype name -> that library's dtype, for the float dtypes it has
    dtypes: dict[str, Any]
    #: the device arrays made by ``asarray`` live on (None: no device to check)
    device: Any
    #: computes on layernorm's own kernels (bitwise guarantees hold)
    native: bool
    _from_numpy: Callable[[np.ndarray], Any] = field(repr=False)
    _to_numpy: Callable[[Any], np.ndarray] = field(repr=False)
    _is_array: Callable[[Any], bool] = field(repr=False)
    _device_of: Callable[[Any], Any] = field(repr=False)

    def __str__(self) -> str:
        return self.name

    def has(self, dtype: str) -> bool:
        return dtype in self.dtypes

    def require(self, dtype: str) -> None:
        """Skip the test when this library has no ``dtype``."""
        if dtype in DTYPES and dtype not in self.dtypes:
            pytest.skip(f"{self.name} has no {dtype}")

    def asarray(self, data, dtype: str | None = None):
        """NumPy data -> this library's array; ``dtype`` by name (bfloat16 included)."""
        host = np.asarray(data)
        if dtype is not None:
            self.require(dtype)
            host = host.astype(DTYPES.get(dtype) or np.dtype(dtype))
        return self._from_numpy(host)

    def to_numpy(self, a) -> np.ndarray:
        """This library's array -> a NumPy copy, same dtype (Dask computed, CuPy copied)."""
        return self._to_numpy(a)

    def is_array(self, a) -> bool:
        return self._is_array(a)

    def dtype_name(self, a) -> str:
        return dtype_str(a.dtype)

    def _check_meta(self, actual, dtype: str, shape) -> None:
        assert self.is_array(actual), \
            f"expected a {self.name} array, got {type(actual).__module__}.{type(actual).__name__}"
        assert self.dtype_name(actual) == dtype, (self.dtype_name(actual), dtype)
        if shape is not None:
            assert tuple(actual.shape) == tuple(shape), (tuple(actual.shape), tuple(shape))
        if self.device is not None:
            assert self._device_of(actual) == self.device, (self._device_of(actual), self.device)

    def _desired(self, desired):
        return desired if isinstance(desired, np.ndarray) or np.isscalar(desired) \
            else self.to_numpy(desired)

    def assert_close(self, actual, desired, *, dtype: str | None = None, shape=None,
                     atol: float | None = None, rtol: float = 0.0, err_msg: str = "") -> None:
        """``actual`` is an array of this library with ``dtype`` (default: desired's),
        ``shape`` (default: desired's) and device, whose values are within
        ``atol + rtol * |desired|`` of ``desired`` (NaN where desired is NaN).

        The default ``atol`` is ``ATOL[dtype]`` scaled by ``max(1, max |desired|)``: the
        rounding of the output dominates for unit-scale values.
        """
        want = np.asarray(self._desired(desired))
        dtype = dtype or dtype_str(want.dtype)
        self._check_meta(actual, dtype, want.shape if shape is None else shape)
        got = self.to_numpy(actual).astype(np.float64)
        want = np.broadcast_to(want.astype(np.float64), got.shape)
        if atol is None:
            finite = np.abs(want[np.isfinite(want)])
            atol = ATOL[dtype] * max(1.0, float(finite.max()) if finite.size else 1.0)
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=err_msg)

    def assert_equal(self, actual, desired, *, dtype: str | None = None, err_msg: str = "") -> None:
        """Like :meth:`assert_close`, bit for bit (NaNs compared as bits too)."""
        want = np.ascontiguousarray(self._desired(desired))
        dtype = dtype or dtype_str(want.dtype)
        self._check_meta(actual, dtype, want.shape)
        got = np.ascontiguousarray(self.to_numpy(actual))
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        bits = f"u{got.dtype.itemsize}"
        np.testing.assert_array_equal(got.view(bits), want.view(bits), err_msg=err_msg)


def dtype_str(dtype) -> str:
    """Canonical name of any library's dtype: "float32", "bfloat16", "int64", ..."""
    return str(dtype).rsplit(".", 1)[-1]


def _numpy_library() -> Library:
    # to_numpy copies, as every other library's does: a saved result never aliases.
    return Library("numpy", np, dict(DTYPES), None, True, lambda a: a,
                   lambda a: np.array(a), lambda a: type(a) is np.ndarray, lambda a: None)


def _strict_library() -> Library:
    xps = pytest.importorskip("array_api_strict")
    array_type = type(xps.asarray(0.0))
    return Library(
        "array_api_strict", xps, {"float32": xps.float32, "float64": xps.float64},
        xps.Device("CPU_DEVICE"), False, xps.asarray,
        lambda a: np.array(np.from_dlpack(a)),
        lambda a: type(a) is array_type, lambda a: a.device)


def _torch_library() -> Library:
    torch = pytest.importorskip("torch")

    def from_numpy(host):
        if host.dtype == DTYPES["bfloat16"]:  # exact: every bfloat16 is a float32
            return torch.from_numpy(host.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.array(host))

    def to_numpy(t):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.float().numpy().astype(DTYPES["bfloat16"])
        return t.numpy().copy()

    return Library(
        "torch", torch, {name: getattr(torch, name) for name in DTYPES},
        torch.device("cpu"), True, from_numpy, to_numpy,
        lambda a: type(a) is torch.Tensor, lambda a: a.device)


def _jax_library() -> Library:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    names = ["float16", "bfloat16", "float32"]
    if jax.config.read("jax_enable_x64"):
        names.append("float64")  # without x64 mode JAX silently makes float64 float32
    return Library(
        "jax", jnp, {name: getattr(jnp, name) for name in names}, jax.devices("cpu")[0],
        False, jnp.asarray, lambda a: np.asarray(a), lambda a: isinstance(a, jax.Array),
        lambda a: a.device)


def _dask_library() -> Library:
    da = pytest.importorskip("dask.array")

    def from_numpy(host):
        # Several blocks along every axis: the normalized axes must be rechunked.
        chunks = tuple(max(1, -(-s // 2)) for s in host.shape)
        return da.from_array(host, chunks=chunks)

    return Library(
        "dask", da, dict(DTYPES), None, True, from_numpy,
        lambda a: np.asarray(a.compute(scheduler="sync")),
        lambda a: isinstance(a, da.Array), lambda a: None)


def _cupy_library() -> Library:
    cupy = _cupy_or_skip()
    names = ["float16", "float32", "float64"]
    try:
        cupy.asarray(np.ones(1, DTYPES["bfloat16"]))
        names.append("bfloat16")
    except Exception:  # this CuPy has no bfloat16
        pass
    device = cupy.cuda.Device()
    return Library(
        "cupy", cupy, {name: DTYPES[name] for name in names}, device, True, cupy.asarray,
        lambda a: a.get(), lambda a: isinstance(a, cupy.ndarray), lambda a: a.device)


_LIBRARIES = {
    "numpy": _numpy_library,
    "array_api_strict": _strict_library,
    "torch": _torch_library,
    "jax": _jax_library,
    "dask": _dask_library,
    "cupy": _cupy_library,
}


@pytest.fixture(params=list(_LIBRARIES), scope="session")
def library(request) -> Library:
    """Each array library in turn (skipped when not installed; CuPy also without a GPU)."""
    return _LIBRARIES[request.param]()


@pytest.fixture(scope="session")
def xp(library):
    """The namespace of :func:`library`."""
    return library.xp



@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(session, config, items):
    """Start the CUDA compile jobs in the background and run their tests last.

    See the end of test_cuda_compile.py: minutes of single-threaded compiling overlap
    with the rest of the suite instead of following it.
    """
    import sys

    module = sys.modules.get("tests.test_cuda_compile")
    if module is None or config.option.collectonly:
        return
    waiting = module.start_background(items)
    if waiting:
        config.add_cleanup(module.stop_background)
        ids = {id(item) for item in waiting}
        items[:] = [item for item in items if id(item) not in ids] + waiting


__all__ = ["ATOL", "DTYPES", "STATS_RTOL", "Library", "acc_dtype", "asarray", "dtype_str",
           "importlib", "optional", "random_rows", "to_numpy"]
