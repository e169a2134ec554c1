"""Errors of NumPy-only inputs (the shared ones are in test_contract.py, on every library)."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln

X = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7.0


# The errors every library shares are in test_contract.py (run on every library); these
# involve what only NumPy inputs have: backend="cupy" for a NumPy x, and out=.
@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"backend": "cupy"}, ValueError, ["backend='cupy'", "numpy"]),
        ({"out": np.empty((2, 3, 5), np.float32)}, ValueError, ["out", "(2, 3, 4)", "(2, 3, 5)"]),
        ({"out": np.empty((2, 3, 4), np.float64)}, ValueError, ["out", "float32", "float64"]),
    ],
)
def test_layer_norm_errors(kwargs, exc, words):
    with pytest.raises(exc) as info:
        ln.layer_norm(X, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# Numeric dtypes every library has are in test_contract.py; object arrays are NumPy's.
@pytest.mark.parametrize("dtype", [object])
def test_unsupported_dtypes(dtype):
    x = np.ones((2, 3), dtype=dtype)
    for fn in (ln.layer_norm, ln.rms_norm):
        with pytest.raises(TypeError, match=np.dtype(dtype).name):
            fn(x)


def test_non_arrays_rejected():
    with pytest.raises(TypeError, match="list"):
        ln.layer_norm([[1.0, 2.0]])
    with pytest.raises(TypeError, match="array"):
        ln.backend_name("abc")


def test_zero_dim_input():
    with pytest.raises(ValueError, match=r"shape \(\)"):
        ln.layer_norm(np.array(1.0, np.float32))


