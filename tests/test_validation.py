"""Errors of NumPy-only inputs (the shared ones are in test_contract.py, on every library)."""

from __future__ import annotations

from fractions import Fraction

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




@pytest.mark.parametrize("eps", [10**400, -(10**400), Fraction(10**400, 3)],
                         ids=["int", "negative-int", "Fraction"])
def test_eps_beyond_the_float_range_is_a_value_error(eps):
    x = X.reshape(6, 4)
    calls = [
        lambda: ln.layer_norm(x, eps=eps),
        lambda: ln.rms_norm(x, eps=eps),
        lambda: ln.add_layer_norm(x, x, eps=eps),
        lambda: ln.add_rms_norm(x, x, eps=eps),
        lambda: ln.LayerNorm(4, eps=eps),
        lambda: ln.RMSNorm(4, eps=eps),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="eps must be a finite float"):
            call()


# A required array given as None is a clear TypeError naming it on every route (the
# engine's, and the torch and Dask adapters', which check before anything reads its shape;
# Dask's fused forward reads a None residual as "no residual", so it checks first).
@pytest.mark.parametrize("lib", ["numpy", "torch", "dask", "jax"])
def test_required_arrays_given_as_none_are_a_type_error_naming_them(lib):
    x = X.reshape(6, 4)
    _, mean, rstd = ln.layer_norm(x, return_stats=True)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        x, mean, rstd = (torch.from_numpy(a) for a in (x, mean, rstd))
    elif lib == "dask":
        da = pytest.importorskip("dask.array")
        x, mean, rstd = (da.from_array(a, chunks=2) for a in (x, mean, rstd))
    elif lib == "jax":
        jnp = pytest.importorskip("jax.numpy")
        x, mean, rstd = (jnp.asarray(a) for a in (x, mean, rstd))
    stats = r"the \w+ array returned by the forward call with return_stats=True \(shape \(6, 1\)\)"
    shaped = r"an array of x's shape \(6, 4\)"
    cases = [
        ("mean", stats, lambda: ln.layer_norm_backward(x, x, None, rstd)),
        ("rstd", stats, lambda: ln.layer_norm_backward(x, x, mean, None)),
        ("rstd", stats, lambda: ln.rms_norm_backward(x, x, None)),
        ("grad_y", shaped, lambda: ln.layer_norm_backward(None, x, mean, rstd)),
        ("grad_y", shaped, lambda: ln.rms_norm_backward(None, x, rstd)),
        ("residual", shaped, lambda: ln.add_layer_norm(x, None)),
        ("residual", shaped, lambda: ln.add_rms_norm(x, None)),
    ]
    for name, wanted, call in cases:
        with pytest.raises(TypeError, match=rf"^{name} must be {wanted}, got None$"):
            call()
