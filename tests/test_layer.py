"""LayerNorm and RMSNorm classes: parameters, repr, state_dict, forward and backward."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln


def test_layer_norm_defaults_and_repr():
    layer = ln.LayerNorm(768)
    assert layer.normalized_shape == (768,)
    assert layer.eps == 1e-5 and layer.elementwise_affine
    assert repr(layer) == "LayerNorm((768,), eps=1e-05, elementwise_affine=True, bias=True)"
    assert layer.weight.dtype == np.float32 and layer.weight.shape == (768,)
    np.testing.assert_array_equal(layer.weight, 1.0)
    np.testing.assert_array_equal(layer.bias, 0.0)
    assert repr(ln.LayerNorm((2, 3), eps=1e-6, bias=False)) == \
        "LayerNorm((2, 3), eps=1e-06, elementwise_affine=True, bias=False)"
    none = ln.LayerNorm(4, elementwise_affine=False)
    assert none.weight is None and none.bias is None and none.state_dict() == {}
    assert repr(ln.RMSNorm(8)) == "RMSNorm((8,), eps=None, elementwise_affine=True)"


def test_backward_without_affine_and_before_forward():
    layer = ln.LayerNorm(6, elementwise_affine=False)
    with pytest.raises(RuntimeError, match="forward"):
        layer.backward(np.ones((2, 6), np.float32))
    x = np.random.default_rng(1).standard_normal((2, 6)).astype(np.float32)
    layer(x)
    gx, gw, gb = layer.backward(np.ones_like(x))
    assert gx.shape == x.shape and gw is None and gb is None
    rms = ln.RMSNorm(6, elementwise_affine=False)
    rms(x)
    gx, gw = rms.backward(np.ones_like(x))
    assert gw is None and gx.shape == x.shape


def test_reset_parameters():
    layer = ln.LayerNorm(4)
    layer.weight = layer.weight * 3
    layer.bias = layer.bias + 2
    layer.reset_parameters()
    np.testing.assert_array_equal(layer.weight, 1.0)
    np.testing.assert_array_equal(layer.bias, 0.0)


def test_state_dict_round_trip_and_errors():
    rng = np.random.default_rng(2)
    layer = ln.LayerNorm(5)
    state = {"weight": rng.standard_normal(5), "bias": rng.standard_normal(5)}
    layer.load_state_dict(state)
    assert set(layer.state_dict()) == {"weight", "bias"}
    np.testing.assert_array_equal(layer.state_dict()["weight"], state["weight"].astype(np.float32))
    other = ln.LayerNorm(5)
    other.load_state_dict(layer.state_dict())
    np.testing.assert_array_equal(other.bias, layer.bias)
    with pytest.raises(KeyError, match=r"missing.*bias"):
        layer.load_state_dict({"weight": np.ones(5)})
    with pytest.raises(KeyError, match=r"unexpected.*running_mean"):
        layer.load_state_dict({**state, "running_mean": np.ones(5)})
    with pytest.raises(ValueError, match=r"\(5,\).*\(4,\)"):
        layer.load_state_dict({"weight": np.ones(4), "bias": np.ones(5)})


def test_load_torch_state_dict():
    torch = pytest.importorskip("torch")
    tl = torch.nn.LayerNorm(12)
    with torch.no_grad():
        tl.weight.normal_()
        tl.bias.normal_()
    layer = ln.LayerNorm(12)
    layer.load_state_dict({k: v.detach().numpy() for k, v in tl.state_dict().items()})
    x = np.random.default_rng(3).standard_normal((4, 12)).astype(np.float32)
    np.testing.assert_allclose(layer(x), tl(torch.from_numpy(x)).detach().numpy(), atol=2e-6)
    tr = torch.nn.RMSNorm(12)
    rms = ln.RMSNorm(12)
    rms.load_state_dict(tr.state_dict())  # torch tensors are accepted directly too
    np.testing.assert_allclose(rms(x), tr(torch.from_numpy(x)).detach().numpy(), atol=2e-6)


def test_layer_dtype_and_namespace():
    layer = ln.LayerNorm(4, dtype="bfloat16")
    assert layer.weight.dtype.name == "bfloat16"
    layer64 = ln.LayerNorm(4, dtype="float64")
    x = np.random.default_rng(4).standard_normal((3, 4))
    assert layer64(x).dtype == np.float64
    # Layers of every other library's namespace: test_contract.py.


def test_invalid_constructor_arguments():
    with pytest.raises(ValueError, match="eps"):
        ln.LayerNorm(4, eps=-1)
    with pytest.raises(TypeError, match="normalized_shape"):
        ln.LayerNorm("4")
    with pytest.raises(ValueError, match="normalized_shape"):
        ln.RMSNorm(())
