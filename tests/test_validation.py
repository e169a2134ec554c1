"""Every error in the contract: the right exception, naming argument, expected and actual."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln

X = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7.0


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"normalized_shape": (3,)}, ValueError, ["(3,)", "(2, 3, 4)"]),
        ({"normalized_shape": (5, 4)}, ValueError, ["(5, 4)", "(2, 3, 4)"]),
        ({"normalized_shape": (1, 2, 3, 4)}, ValueError, ["(1, 2, 3, 4)", "(2, 3, 4)"]),
        ({"normalized_shape": ()}, ValueError, ["normalized_shape"]),
        ({"normalized_shape": 4, "axis": -1}, TypeError, ["normalized_shape", "axis"]),
        ({"axis": 3}, ValueError, ["axis 3", "(2, 3, 4)"]),
        ({"axis": -4}, ValueError, ["axis -4"]),
        ({"axis": (1, -2)}, ValueError, ["duplicate"]),
        ({"axis": (0, 0)}, ValueError, ["duplicate"]),
        ({"axis": 1.5}, TypeError, ["axis", "1.5"]),
        ({"eps": -1e-5}, ValueError, ["eps", "-1e-05"]),
        ({"eps": float("nan")}, ValueError, ["eps", "nan"]),
        ({"eps": float("inf")}, ValueError, ["eps", "inf"]),
        ({"eps": "1e-5"}, ValueError, ["eps"]),
        ({"weight": np.ones(3, np.float32)}, ValueError, ["weight", "(4,)", "(3,)"]),
        ({"bias": np.ones((1, 4), np.float32)}, ValueError, ["bias", "(4,)", "(1, 4)"]),
        ({"weight": np.ones(4, np.int32)}, TypeError, ["weight", "int32"]),
        ({"axis": 1, "weight": np.ones(4, np.float32)}, ValueError, ["weight", "(3,)", "(4,)"]),
        ({"backend": "gpu"}, ValueError, ["backend", "'gpu'"]),
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


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64, np.uint8, object])
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


def test_rms_norm_errors():
    with pytest.raises(ValueError, match="eps"):
        ln.rms_norm(X, eps=-1.0)
    with pytest.raises(ValueError, match="weight"):
        ln.rms_norm(X, weight=np.ones(5, np.float32))
    with pytest.raises(TypeError, match="both"):
        ln.rms_norm(X, 4, axis=-1)


def test_mixed_libraries():
    xp = pytest.importorskip("array_api_strict")
    xs = xp.asarray(np.ones((2, 4), np.float32))
    with pytest.raises(TypeError, match=r"weight comes from numpy.*x comes from array_api_strict"):
        ln.layer_norm(xs, weight=np.ones(4, np.float32))
    with pytest.raises(TypeError, match=r"bias comes from array_api_strict.*x comes from numpy"):
        ln.layer_norm(np.ones((2, 4), np.float32), bias=xp.ones(4))


def test_backward_errors():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    _, mean, rstd = ln.layer_norm(x, return_stats=True)
    gy = np.ones_like(x)
    with pytest.raises(ValueError, match=r"grad_y.*\(3, 5\).*\(3, 4\)"):
        ln.layer_norm_backward(gy[:, :4], x, mean, rstd)
    with pytest.raises(TypeError, match=r"grad_y.*float32.*float64"):
        ln.layer_norm_backward(gy.astype(np.float64), x, mean, rstd)
    with pytest.raises(ValueError, match=r"mean.*\(3, 1\).*\(3,\)"):
        ln.layer_norm_backward(gy, x, mean.ravel(), rstd)
    with pytest.raises(ValueError, match=r"rstd.*\(3, 1\).*\(1, 1\)"):
        ln.layer_norm_backward(gy, x, mean, rstd[:1])
    with pytest.raises(ValueError, match="weight"):
        ln.layer_norm_backward(gy, x, mean, rstd, np.ones(4, np.float32))
    with pytest.raises(ValueError, match=r"rstd.*\(3, 1\)"):
        ln.rms_norm_backward(gy, x, rstd.ravel())


def test_inputs_never_modified():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 130)).astype(np.float32)
    w = rng.standard_normal(130).astype(np.float32)
    b = rng.standard_normal(130).astype(np.float32)
    gy = rng.standard_normal((4, 130)).astype(np.float32)
    saved = [a.copy() for a in (x, w, b, gy)]
    _, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True)
    stats = [mean.copy(), rstd.copy()]
    ln.layer_norm_backward(gy, x, mean, rstd, w)
    ln.rms_norm(x, weight=w)
    _, r = ln.rms_norm(x, weight=w, return_stats=True)
    r_saved = r.copy()
    ln.rms_norm_backward(gy, x, r, w)
    for a, s in zip((x, w, b, gy, mean, rstd, r), [*saved, *stats, r_saved], strict=True):
        np.testing.assert_array_equal(a, s)
