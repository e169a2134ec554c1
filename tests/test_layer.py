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
    with pytest.raises(TypeError, match=r"state_dict\['bias'\] must be an array or tensor of "
                                        r"shape \(5,\), got list"):
        layer.load_state_dict({"weight": np.ones(5), "bias": [0.0] * 5})
    masked = np.ma.masked_array(np.full(5, 2.0), mask=[True, False, False, False, False])
    with pytest.raises(TypeError, match=r"state_dict\['weight'\] is a numpy\.ma\.MaskedArray"):
        layer.load_state_dict({"weight": masked, "bias": np.ones(5)})
    np.testing.assert_array_equal(layer.state_dict()["weight"], state["weight"].astype(np.float32))
    # torch's spelling: a mismatch caught as its RuntimeError; strict=False loads what is
    # given and reports the rest.
    with pytest.raises(RuntimeError, match=r"missing \['bias'\]"):
        layer.load_state_dict({"weight": np.ones(5)})
    before = layer.bias.copy()
    result = layer.load_state_dict({"weight": np.full(5, 3.0), "step": 1}, strict=False)
    assert result == (["bias"], ["step"])
    assert result.missing_keys == ["bias"] and result.unexpected_keys == ["step"]
    np.testing.assert_array_equal(layer.weight, 3.0)
    np.testing.assert_array_equal(layer.bias, before)
    assert layer.load_state_dict(layer.state_dict()) == ([], [])
    with pytest.raises(ValueError, match=r"\(5,\).*\(4,\)"):
        layer.load_state_dict({"weight": np.ones(4)}, strict=False)
    with pytest.raises(TypeError, match="strict"):
        layer.load_state_dict(state, strict="no")
    plain = ln.RMSNorm(5, elementwise_affine=False)
    assert plain.load_state_dict({"weight": np.ones(5)}, strict=False) == ([], ["weight"])
    assert plain.weight is None


def _torch_layer_norm(torch, n):
    """A ``torch.nn.LayerNorm(n)`` with random weight and bias (not the ones/zeros)."""
    tl = torch.nn.LayerNorm(n)
    with torch.no_grad():
        tl.weight.normal_()
        tl.bias.normal_()
    return tl


def test_load_torch_state_dict():
    torch = pytest.importorskip("torch")
    tl = _torch_layer_norm(torch, 12)
    layer = ln.LayerNorm(12)
    layer.load_state_dict({k: v.detach().numpy() for k, v in tl.state_dict().items()})
    x = np.random.default_rng(3).standard_normal((4, 12)).astype(np.float32)
    np.testing.assert_allclose(layer(x), tl(torch.from_numpy(x)).detach().numpy(), atol=2e-6)
    tr = torch.nn.RMSNorm(12)
    rms = ln.RMSNorm(12)
    rms.load_state_dict(tr.state_dict())  # torch tensors are accepted directly too
    np.testing.assert_allclose(rms(x), tr(torch.from_numpy(x)).detach().numpy(), atol=2e-6)


@pytest.mark.parametrize("cls", [ln.LayerNorm, ln.RMSNorm])
def test_load_state_dict_copies_and_state_dict_shares(cls):
    rng = np.random.default_rng(5)
    source = cls(6)
    source.load_state_dict({k: rng.standard_normal(6) for k in source.state_dict()})
    before = {k: v.copy() for k, v in source.state_dict().items()}
    layer = cls(6)
    layer.load_state_dict(source.state_dict())
    source.weight *= 3.0  # in place, as an optimizer step is
    for name, value in layer.state_dict().items():
        np.testing.assert_array_equal(value, before[name])
        assert not np.shares_memory(value, getattr(source, name))
    # state_dict() gives the layer's own arrays, as torch's gives tensors sharing storage.
    layer.state_dict()["weight"][0] = 7.0
    assert layer.weight[0] == 7.0


def test_load_torch_state_dict_copies_the_tensors():
    torch = pytest.importorskip("torch")
    tl = _torch_layer_norm(torch, 6)
    before = {k: v.clone() for k, v in tl.state_dict().items()}
    layers = [ln.LayerNorm(6), ln.LayerNorm(6, xp=torch)]
    for layer in layers:
        layer.load_state_dict(tl.state_dict())
    with torch.no_grad():
        tl.weight.mul_(3.0)
        tl.bias.add_(1.0)
    for layer in layers:
        for name, value in layer.state_dict().items():
            got = value.numpy() if isinstance(value, torch.Tensor) else value
            np.testing.assert_array_equal(got, before[name].numpy())


def test_load_bfloat16_torch_state_dict():
    torch = pytest.importorskip("torch")
    tl = torch.nn.LayerNorm(8, dtype=torch.bfloat16)
    with torch.no_grad():
        tl.weight.copy_(torch.linspace(0.5, 2.0, 8))
        tl.bias.copy_(torch.linspace(-1.0, 1.0, 8))
    expected = {k: v.float().numpy() for k, v in tl.state_dict().items()}
    torch_layer = ln.LayerNorm(8, xp=torch, dtype="bfloat16")
    torch_layer.load_state_dict(tl.state_dict())
    assert torch_layer.weight.dtype == torch.bfloat16
    numpy_layers = [ln.LayerNorm(8, dtype=dtype) for dtype in ("bfloat16", "float32")]
    for layer, dtype in zip(numpy_layers, ("bfloat16", "float32"), strict=True):
        layer.load_state_dict(tl.state_dict())
        assert layer.weight.dtype.name == dtype
    with torch.no_grad():
        tl.weight.mul_(3.0)
    for name, want in expected.items():
        np.testing.assert_array_equal(getattr(torch_layer, name).float().numpy(), want)
        for layer in numpy_layers:
            np.testing.assert_array_equal(getattr(layer, name).astype(np.float32), want)
    # And back: a bfloat16 NumPy state dict into a torch layer.
    again = ln.LayerNorm(8, xp=torch, dtype="bfloat16")
    again.load_state_dict(numpy_layers[0].state_dict())
    assert torch.equal(again.weight, torch_layer.weight)


def test_layer_dtype_and_namespace():
    layer = ln.LayerNorm(4, dtype="bfloat16")
    assert layer.weight.dtype.name == "bfloat16"
    layer64 = ln.LayerNorm(4, dtype="float64")
    x = np.random.default_rng(4).standard_normal((3, 4))
    assert layer64(x).dtype == np.float64
    # NumPy's other names of a float dtype, as residual_dtype= takes them.
    for name, want in (("f4", np.float32), ("<f8", np.float64), ("single", np.float32),
                       ("half", np.float16), ("e", np.float16)):
        assert ln.RMSNorm(4, dtype=name).weight.dtype == want, name
    # Names of a namespace's other attributes are no dtype (np.e, np.sum, torch.e).
    for name in ("pi", "sum", "nope"):
        with pytest.raises(TypeError, match=rf"dtype '{name}' is not a dtype of numpy"):
            ln.LayerNorm(4, dtype=name)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"dtype 'e' is not a dtype of torch"):
        ln.LayerNorm(4, dtype="e", xp=torch)
    # Layers of every other library's namespace: test_contract.py.


def test_invalid_constructor_arguments():
    with pytest.raises(ValueError, match="eps"):
        ln.LayerNorm(4, eps=-1)
    with pytest.raises(TypeError, match="normalized_shape"):
        ln.LayerNorm("4")
    with pytest.raises(ValueError, match="normalized_shape"):
        ln.RMSNorm(())
    for bad in ("int32", np.int64, "bool"):
        with pytest.raises(TypeError, match=r"dtype must be one of float16, bfloat16, "
                                            r"float32, float64 .*got (int32|int64|bool)"):
            ln.LayerNorm(4, dtype=bad)
    with pytest.raises(TypeError, match="got complex64"):
        ln.RMSNorm(4, dtype="complex64")
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"dtype must be a dtype of numpy or a name such as "
                                        r"'float32' .*got torch\.float16"):
        ln.LayerNorm(4, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"dtype must be a dtype of torch .*got .*float16"):
        ln.RMSNorm(4, dtype=np.float16, xp=torch)


@pytest.mark.parametrize("cls", [ln.LayerNorm, ln.RMSNorm])
def test_backward_is_that_of_the_call_after_in_place_changes(cls):
    """A residual stream updated in place (x += ...) or an optimizer step on the weight
    between the call and backward: the gradients stay those of the call (NumPy: the
    layer kept copies), or torch's in-place error (version counters), never silently
    other gradients."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((5, 8)).astype(np.float32) + 0.5
    g = rng.standard_normal((5, 8)).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(8)).astype(np.float32)
    for change in ("x", "weight"):
        layer, xc = cls(8), x.copy()
        layer.weight[:] = w
        layer(xc)
        want = layer.backward(g)
        layer(xc)
        if change == "x":
            xc *= 2.0
        else:
            layer.weight *= 3.0
        got = layer.backward(g)
        for a, b in zip(want, got, strict=True):
            if a is not None:
                np.testing.assert_array_equal(a, b, err_msg=change)
    # A later call with other values (its copy reuses the last call's memory) gets its
    # own gradients.
    layer, other = cls(8), x[::-1] * 3.0
    layer(x)
    layer(other)
    fresh = cls(8)
    fresh(other.copy())
    for a, b in zip(layer.backward(g), fresh.backward(g), strict=True):
        np.testing.assert_array_equal(a, b)
    torch = pytest.importorskip("torch")
    for change in ("x", "weight"):
        layer, xt = cls(8, xp=torch), torch.from_numpy(x.copy())
        layer(xt)
        (xt if change == "x" else layer.weight).mul_(2.0)
        with pytest.raises(RuntimeError, match=r"modified in place after the forward call"):
            layer.backward(torch.from_numpy(g))
        layer(xt)  # a new call: its own gradients
        assert layer.backward(torch.from_numpy(g))[0].shape == (5, 8)


@pytest.mark.parametrize("cls", [ln.LayerNorm, ln.RMSNorm])
@pytest.mark.parametrize("copier", ["deepcopy", "pickle"])
@pytest.mark.parametrize("namespace", ["numpy", "torch"])
def test_layers_deep_copy_and_pickle_like_torch_modules(cls, copier, namespace):
    """``copy.deepcopy`` and ``pickle`` copy a layer as they do a ``torch.nn`` module:
    the same parameters, namespace and saved statistics, sharing no memory with the
    original (the namespace, a module, travels by name)."""
    import copy
    import pickle

    xp = np if namespace == "numpy" else pytest.importorskip("torch")
    layer = cls(6, weight_offset=0.5, xp=xp)
    rng = np.random.default_rng(3)
    layer.load_state_dict({name: xp.asarray(rng.standard_normal(6).astype(np.float32))
                           for name in layer.state_dict()})
    x = xp.asarray((2.0 + rng.standard_normal((5, 6))).astype(np.float32))
    y = layer(x)
    twin = copy.deepcopy(layer) if copier == "deepcopy" else pickle.loads(pickle.dumps(layer))
    assert twin._xp is xp and repr(twin) == repr(layer)
    gy = xp.asarray(rng.standard_normal((5, 6)).astype(np.float32))
    for got, want in zip(twin.backward(gy), layer.backward(gy), strict=True):  # saved stats
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(twin(x)), np.asarray(y))
    twin.weight[0] = 100.0
    assert float(layer.weight[0]) != 100.0


@pytest.mark.parametrize("cls", [ln.LayerNorm, ln.RMSNorm])
def test_a_shallow_copy_keeps_each_layers_gradients(cls):
    """``copy.copy`` shares the parameters, as with a torch module, but a call of either
    layer never changes the other's gradients (the last call's kept input was written
    over by the copy's next call of the same shape)."""
    import copy

    rng = np.random.default_rng(22)
    x1, x2 = (rng.standard_normal((3, 8)).astype(np.float32) + k for k in (0.5, -1.0))
    g = rng.standard_normal((3, 8)).astype(np.float32)

    def grads_of(x):
        fresh = cls(8)
        fresh(x.copy())
        return fresh.backward(g)

    a = cls(8)
    a(x1)
    b = copy.copy(a)
    assert b.weight is a.weight
    b(x2)
    a_after = a.backward(g)
    a(x2 * 3.0)
    b_after = b.backward(g)
    for got, want in ((a_after, grads_of(x1)), (b_after, grads_of(x2))):
        for u, v in zip(got, want, strict=True):
            if u is not None:
                np.testing.assert_array_equal(u, v)


def test_a_torch_layer_deep_copies_after_a_call_on_a_non_leaf_tensor():
    import copy
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    layer = ln.LayerNorm(8, xp=torch)
    leaf = torch.randn(4, 8, requires_grad=True)
    inner = leaf * 2.0  # a non-leaf input, as inside a model
    alive = weakref.ref(inner)
    layer(inner)
    twin = copy.deepcopy(layer)
    g = torch.ones(4, 8)
    for got, want in zip(twin.backward(g), layer.backward(g), strict=True):
        assert torch.equal(got, want)
    del inner
    gc.collect()
    assert alive() is None  # the layer keeps the data, not the caller's tensor and graph
