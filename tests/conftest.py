"""Shared fixtures: array libraries (skipped when missing), dtypes and tolerances."""

from __future__ import annotations

import importlib

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


__all__ = ["ATOL", "DTYPES", "asarray", "importlib", "optional", "random_rows", "to_numpy"]
