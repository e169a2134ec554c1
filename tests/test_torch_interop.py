"""torch tensors in, torch tensors out: zero-copy routes, autograd, drop-in modules."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest

import layernorm as ln
from tests import reference

from .conftest import ATOL

torch = pytest.importorskip("torch")
F = torch.nn.functional
lnt = pytest.importorskip("layernorm.torch")
_torch = pytest.importorskip("layernorm._adapters.torch")

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0, dtype=torch.float64, loc: float = 0.0) -> torch.Tensor:
    return (loc + torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)).to(dtype)


def _np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def _assert_same_tensors(got: tuple, want: tuple) -> None:
    """Each pair equal bit for bit, with the same dtype and shape (None where None)."""
    for mine, theirs in zip(got, want, strict=True):
        if theirs is None:
            assert mine is None
            continue
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        assert torch.equal(mine, theirs)


# --------------------------------------------------------------------------- import hygiene


def test_import_layernorm_does_not_import_torch():
    code = (
        "import sys, numpy as np, layernorm as ln; "
        "ln.backend_name(np.ones(2)); "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'dask' not in sys.modules, 'dask imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_layer_norm_matches_torch(dtype):
    tdt = TORCH_DTYPES[dtype]
    x = _randn(6, 5, 40, seed=1, dtype=tdt, loc=3.0)
    w = _randn(40, seed=2, dtype=tdt)
    b = _randn(40, seed=3, dtype=tdt)
    y = ln.layer_norm(x, 40, w, b)
    assert type(y) is torch.Tensor
    assert y.dtype == tdt and y.device == x.device and y.shape == x.shape
    assert y.is_contiguous()
    expected = F.layer_norm(x.double(), (40,), w.double(), b.double()).to(tdt)
    # Both are within one output rounding of the truth, so two roundings apart at most.
    np.testing.assert_allclose(_np64(y), _np64(expected), rtol=0, atol=2 * ATOL[dtype])
    assert ln.backend_name(x) == "numba"


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_rms_norm_matches_torch(dtype):
    tdt = TORCH_DTYPES[dtype]
    x = _randn(7, 3, 33, seed=4, dtype=tdt)
    w = _randn(3, 33, seed=5, dtype=tdt)
    y = ln.rms_norm(x, (3, 33), w)
    assert type(y) is torch.Tensor and y.dtype == tdt and y.shape == x.shape
    # eps=None: both use the accumulation dtype's machine epsilon.
    expected = F.rms_norm(x.double(), (3, 33), w.double(),
                          eps=torch.finfo(torch.float32 if dtype != "float64"
                                          else torch.float64).eps).to(tdt)
    np.testing.assert_allclose(_np64(y), _np64(expected), rtol=0, atol=2 * ATOL[dtype])
    assert torch.equal(y, ln.rms_norm(x, (3, 33), w, eps=None))
    y6 = ln.rms_norm(x, (3, 33), w, eps=1e-6)
    expected6 = F.rms_norm(x.double(), (3, 33), w.double(), eps=1e-6).to(tdt)
    np.testing.assert_allclose(_np64(y6), _np64(expected6), rtol=0, atol=2 * ATOL[dtype])
    if dtype in ("float16", "bfloat16"):
        # torch's own low-precision rms_norm (eps=None) agrees too.
        direct = F.rms_norm(x, (3, 33), w)
        np.testing.assert_allclose(_np64(y), _np64(direct), rtol=0, atol=2 * ATOL[dtype])


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.transpose(0, 2),
        lambda t: t[:, ::2, 1:],
        lambda t: t.permute(2, 0, 1)[..., ::3],
    ],
    ids=["transpose", "slices", "permute-step"],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_non_contiguous_tensors(view, dtype):
    base = _randn(6, 8, 9, seed=7, dtype=TORCH_DTYPES[dtype])
    x = view(base)
    assert not x.is_contiguous()
    before = base.clone()
    n = x.shape[-1]
    w = _randn(n, seed=8, dtype=TORCH_DTYPES[dtype])
    y = ln.layer_norm(x, n, w)
    assert torch.equal(y, ln.layer_norm(x.contiguous(), n, w))
    ry, _, _ = reference.layer_norm(_np64(x), (x.ndim - 1,), _np64(w))
    np.testing.assert_allclose(_np64(y), ry, atol=ATOL[dtype] * 4)
    assert torch.equal(base, before)


def test_cpu_tensors_reach_the_kernels_without_a_copy(monkeypatch):
    from layernorm import _engine

    seen = {}
    real = _engine.forward

    def spy(xp, x, *args, **kwargs):
        seen["x"] = x
        seen["result"] = real(xp, x, *args, **kwargs)
        return seen["result"]

    monkeypatch.setattr(_engine, "forward", spy)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base = _randn(5, 12, seed=9, dtype=dtype)
        x = base[:, 2:10:2]  # strided view
        y, mean, _ = ln.layer_norm(x, return_stats=True)
        xn = seen["x"]
        # The NumPy array the kernels saw is the tensor's own memory, same strides.
        assert xn.ctypes.data == x.data_ptr()
        assert xn.strides == tuple(s * x.element_size() for s in x.stride())
        # ... and the tensors returned are the NumPy results' memory.
        yn, meann, _ = seen["result"]
        assert y.data_ptr() == yn.ctypes.data and mean.data_ptr() == meann.ctypes.data


def test_out_writes_into_tensor_and_in_place():
    x = _randn(3, 16, seed=10, dtype=torch.float32)
    out = torch.empty_like(x)
    y = ln.layer_norm(x, out=out)
    assert y is out
    assert torch.equal(out, ln.layer_norm(x))
    expected = ln.rms_norm(x)
    x2 = x.clone()
    assert ln.rms_norm(x2, out=x2) is x2
    assert torch.equal(x2, expected)
    with pytest.raises(ValueError, match="out"):
        ln.layer_norm(x, out=torch.empty(3, 16, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        ln.layer_norm(x.clone().requires_grad_(), out=out)


def _saved_by_exp(*shape: int, seed: int) -> torch.Tensor:
    a = (0.3 * _randn(*shape, seed=seed)).requires_grad_()
    return a.exp()  # exp saves its output for the backward


@pytest.mark.parametrize("call", ["layer_norm", "rms_norm", "add_out", "add_residual_out",
                                  "generic"])
def test_out_bumps_the_version_counter(call):
    # A tensor saved for backward and then overwritten by out= must make backward
    # raise, as torch's own in-place ops do, not give wrong gradients silently.
    x = _saved_by_exp(2, 6, seed=120)
    r = _randn(2, 6, seed=121)
    with torch.no_grad():
        if call == "layer_norm":
            ln.layer_norm(x, out=x)
        elif call == "rms_norm":
            ln.rms_norm(x, out=x)
        elif call == "add_out":
            ln.add_layer_norm(r, r.clone(), out=x)
        elif call == "add_residual_out":
            ln.add_rms_norm(r, r.clone(), residual_out=x)
        else:
            ln.layer_norm(r, out=x, backend="array_api")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        x.sum().backward()


def test_quantized_out_bumps_the_version_counter():
    a = _randn(2, 6, seed=122).requires_grad_()
    q = torch.zeros(2, 6, dtype=torch.int8)
    z = a * q  # saves q for a's gradient
    with torch.no_grad():
        ln.layer_norm(_randn(2, 6, seed=123, dtype=torch.float32), quantize="int8", out=q)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def _neg_view(values: torch.Tensor) -> torch.Tensor:
    """A float tensor with the lazy negation bit set, holding ``values``."""
    z = torch.complex(torch.zeros_like(values), -values)
    t = z.conj().imag
    assert t.is_neg()
    torch.testing.assert_close(t, values, rtol=0, atol=0)
    return t


def test_out_with_the_negative_bit_is_written():
    x = _randn(3, 7, seed=124, dtype=torch.float32)
    w, b = _randn(7, seed=125, dtype=torch.float32), _randn(7, seed=126, dtype=torch.float32)
    expected = F.layer_norm(x, (7,), w, b)
    out = _neg_view(torch.zeros(3, 7))
    assert ln.layer_norm(x, 7, w, b, out=out) is out
    np.testing.assert_allclose(out.resolve_neg().numpy(), expected.numpy(), atol=1e-6)
    xn = _neg_view(x)  # in place, x itself a negated view
    assert ln.layer_norm(xn, 7, w, b, out=xn) is xn
    np.testing.assert_allclose(xn.resolve_neg().numpy(), expected.numpy(), atol=1e-6)
    xn = _neg_view(x)
    ln.rms_norm(xn, out=xn)
    np.testing.assert_allclose(xn.resolve_neg().numpy(), F.rms_norm(x, (7,)).numpy(), atol=1e-6)


def test_add_norm_outputs_with_the_negative_bit_are_written():
    x, r = _randn(3, 7, seed=127, dtype=torch.float32), _randn(3, 7, seed=128)
    r = r.to(torch.float32)
    h = x + r
    expected = F.layer_norm(h, (7,))
    out, h_out = _neg_view(torch.zeros(3, 7)), _neg_view(torch.zeros(3, 7))
    y, hh = ln.add_layer_norm(x, r, out=out, residual_out=h_out)
    assert y is out and hh is h_out
    np.testing.assert_allclose(out.resolve_neg().numpy(), expected.numpy(), atol=1e-6)
    np.testing.assert_allclose(h_out.resolve_neg().numpy(), h.numpy(), atol=1e-6)
    xn, rn = _neg_view(x), _neg_view(r)  # in place: y into x, h into the residual
    ln.add_layer_norm(xn, rn, out=xn, residual_out=rn)
    np.testing.assert_allclose(xn.resolve_neg().numpy(), expected.numpy(), atol=1e-6)
    np.testing.assert_allclose(rn.resolve_neg().numpy(), h.numpy(), atol=1e-6)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize(("rms", "param"), [(False, "weight"), (False, "bias"), (True, "weight")])
def test_residual_out_over_a_parameter(strided, rms, param):
    # A weight or bias stored in the memory residual_out receives h is read before h
    # overwrites it (strided x takes the composed path, contiguous x the fused kernel's
    # check): y is bit for bit that of the parameter as passed, as on NumPy.
    x = _randn(4, 32 if strided else 16, seed=141, dtype=torch.float32)
    x = x[:, ::2] if strided else x
    r = _randn(4, 16, seed=142, dtype=torch.float32)
    w, b = _randn(16, seed=143, dtype=torch.float32), _randn(16, seed=144, dtype=torch.float32)
    fn = ln.add_rms_norm if rms else ln.add_layer_norm
    params = {"weight": w} if rms else {"weight": w, "bias": b}
    y_ref, h_ref = fn(x, r, **params)
    buf = torch.zeros(4, 16)
    buf[3] = params[param]
    y, h = fn(x, r, **{**params, param: buf[3]}, residual_out=buf)
    assert h is buf
    assert torch.equal(h, h_ref)
    assert torch.equal(y, y_ref)


# --------------------------------------------------------------------------- autograd


def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
@pytest.mark.parametrize("where", ["last", "channels-first", "two-trailing"])
def test_layer_norm_gradcheck(affine, where):
    shape, kw, pshape = {
        "last": ((3, 4, 7), {"normalized_shape": 7}, (7,)),
        "channels-first": ((2, 5, 3, 2), {"axis": 1}, (5,)),
        "two-trailing": ((4, 3, 5), {"normalized_shape": (3, 5)}, (3, 5)),
    }[where]
    x = _randn(*shape, seed=11, loc=0.5).requires_grad_()
    w = _randn(*pshape, seed=12).requires_grad_() if affine != "none" else None
    b = _randn(*pshape, seed=13).requires_grad_() if affine == "weight+bias" else None
    inputs = [t for t in (x, w, b) if t is not None]

    def fn(*args):
        it = iter(args)
        xx = next(it)
        ww = next(it) if w is not None else None
        bb = next(it) if b is not None else None
        y = ln.layer_norm(xx, weight=ww, bias=bb, **kw)
        assert y.grad_fn.name() == "_NormFunctionBackward"
        return y

    _gradcheck(fn, *inputs)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("where", ["last", "channels-first"])
def test_rms_norm_gradcheck(affine, where):
    shape, kw = {"last": ((3, 4, 6), {"normalized_shape": 6}),
                 "channels-first": ((2, 6, 3), {"axis": 1})}[where]
    x = _randn(*shape, seed=14).requires_grad_()
    if affine:
        w = _randn(6, seed=15).requires_grad_()
        _gradcheck(lambda a, b: ln.rms_norm(a, weight=b, eps=1e-5, **kw), x, w)
    else:
        _gradcheck(lambda a: ln.rms_norm(a, eps=1e-5, **kw), x)


def test_grads_match_torch_autograd_and_stats_are_not_differentiable():
    x = _randn(5, 24, seed=16, loc=2.0).requires_grad_()
    w = _randn(24, seed=17).requires_grad_()
    b = _randn(24, seed=18).requires_grad_()
    c = _randn(5, 24, seed=19)
    y, mean, rstd = ln.layer_norm(x, 24, w, b, return_stats=True)
    assert not mean.requires_grad and not rstd.requires_grad
    # ... on every route, as torch.native_layer_norm has them.
    for backend in (None, "array_api"):
        stats = [*ln.layer_norm(x, 24, w, b, return_stats=True, backend=backend)[1:],
                 *ln.rms_norm(x, 24, w, return_stats=True, backend=backend)[1:],
                 *ln.add_layer_norm(x, c, 24, w, b, return_stats=True, backend=backend)[2:],
                 *ln.layer_norm(x, 24, w, b, weight_offset=0.5, return_stats=True,
                                backend=backend)[1:]]
        assert not any(t.requires_grad for t in stats)
    (y * c).sum().backward()
    ours = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    (F.layer_norm(x, (24,), w, b) * c).sum().backward()
    for mine, theirs in zip(ours, (x.grad, w.grad, b.grad), strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-10, atol=1e-12)
    gx, gw, gb = reference.layer_norm_backward(c.numpy(), x.detach().numpy(), (1,),
                                               w.detach().numpy())
    np.testing.assert_allclose(ours[0].numpy(), gx, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(ours[1].numpy(), gw, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(ours[2].numpy(), gb, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_grads_match_torch_autograd(dtype):
    tdt = TORCH_DTYPES[dtype]
    x = _randn(16, 96, seed=42, dtype=tdt).requires_grad_()
    w = (1 + 0.2 * _randn(96, seed=43)).to(tdt).requires_grad_()
    b = _randn(96, seed=44, dtype=tdt).requires_grad_()
    c = _randn(16, 96, seed=45, dtype=tdt)
    ln.layer_norm(x, 96, w, b).backward(c)
    ours = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.layer_norm(x, (96,), w, b).backward(c)
    tol = {"float32": 1e-4, "bfloat16": 0.25}[dtype]
    assert all(g.dtype == tdt for g in ours)
    np.testing.assert_allclose(_np64(ours[0]), _np64(x.grad), atol=tol)
    for mine, theirs in zip(ours[1:], (w.grad, b.grad), strict=True):
        np.testing.assert_allclose(_np64(mine), _np64(theirs), atol=tol * 40, rtol=2e-2)


def test_only_parameters_require_grad_and_mixed_param_dtype():
    x = _randn(6, 32, seed=20, dtype=torch.bfloat16)
    w = _randn(32, seed=21, dtype=torch.float32).requires_grad_()
    b = _randn(32, seed=22, dtype=torch.float32).requires_grad_()
    c = _randn(6, 32, seed=23, dtype=torch.bfloat16)
    y = ln.layer_norm(x, 32, w, b)
    assert y.dtype == torch.bfloat16 and y.requires_grad
    y.backward(c)
    assert x.grad is None
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    _, gw, gb = reference.layer_norm_backward(_np64(c), _np64(x), (1,), _np64(w))
    np.testing.assert_allclose(w.grad.numpy(), gw, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(b.grad.numpy(), gb, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("weight_dtype", [None, torch.bfloat16])
def test_bias_grad_keeps_the_bias_precision(weight_dtype, add):
    # A float32 bias beside a 16-bit weight (or beside 16-bit x without a weight): its
    # gradient is summed in float32 and cast once to float32, never rounded to the
    # weight's (x's) dtype first, which loses digits or overflows to inf.
    rows = 70_000 if weight_dtype is None else 64
    x = _randn(rows, 8, seed=25, dtype=torch.float16 if weight_dtype is None
               else torch.float32).requires_grad_()
    w = None if weight_dtype is None else torch.ones(8, dtype=weight_dtype,
                                                     requires_grad=True)
    b = torch.zeros(8, dtype=torch.float32, requires_grad=True)
    c = _randn(rows, 8, seed=26, dtype=x.dtype, loc=1.0)
    if add:
        y, _ = ln.add_layer_norm(x, torch.zeros_like(x), 8, w, b)
    else:
        y = ln.layer_norm(x, 8, w, b)
    y.backward(c)
    assert b.grad.dtype == torch.float32
    expected = _np64(c).sum(axis=0)
    np.testing.assert_allclose(b.grad.numpy(), expected, rtol=1e-5, atol=1e-3)


def test_no_grad_mode_gives_plain_tensor():
    x = _randn(3, 8, seed=24).requires_grad_()
    with torch.no_grad():
        y = ln.layer_norm(x)
    assert y.grad_fn is None and not y.requires_grad


def _hessians(fn, *inputs):
    return torch.autograd.functional.hessian(fn, tuple(inputs))


def _assert_hessians_close(got, expected):
    for got_row, exp_row in zip(got, expected, strict=True):
        for g, e in zip(got_row, exp_row, strict=True):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("rms", [False, True])
def test_second_derivatives_match_torch(rms):
    x = _randn(2, 5, seed=100, loc=0.4)
    w = 1 + 0.3 * _randn(5, seed=101)
    b = _randn(5, seed=102)
    c = _randn(2, 5, seed=103)
    x.requires_grad_()
    assert ln.layer_norm(x).grad_fn.name() == "_NormFunctionBackward"
    if rms:
        def ours(a, ww):
            return (ln.rms_norm(a, 5, ww, eps=1e-5) ** 3 * c).sum()

        def theirs(a, ww):
            return (F.rms_norm(a, (5,), ww, eps=1e-5) ** 3 * c).sum()

        inputs = (x.detach(), w)
    else:
        def ours(a, ww, bb):
            return (ln.layer_norm(a, 5, ww, bb) ** 3 * c).sum()

        def theirs(a, ww, bb):
            return (F.layer_norm(a, (5,), ww, bb) ** 3 * c).sum()

        inputs = (x.detach(), w, b)
    got, expected = _hessians(ours, *inputs), _hessians(theirs, *inputs)
    assert got[0][0].abs().max() > 0.1  # not silently zero
    _assert_hessians_close(got, expected)


@pytest.mark.parametrize("rms", [False, True])
def test_add_norm_second_derivatives_match_torch(rms):
    x, r = _randn(3, 4, seed=104), _randn(3, 4, seed=105, loc=0.5)
    w, b = 0.2 * _randn(4, seed=106), _randn(4, seed=107)
    c, d = _randn(3, 4, seed=108), _randn(3, 4, seed=109)
    offset = 1.0 if rms else 0.0  # a zero-centred gain: the node sees w + 1

    def ours(xx, rr, ww, bb):
        add = ln.add_rms_norm if rms else ln.add_layer_norm
        extra = {} if rms else {"bias": bb}
        y, h = add(xx, rr, 4, ww, eps=1e-5, weight_offset=offset, **extra)
        assert y.grad_fn.name() == "_AddNormFunctionBackward"
        return (y ** 3 * c).sum() + (h ** 3 * d).sum() + (bb ** 2).sum()

    def theirs(xx, rr, ww, bb):
        h = xx + rr
        if rms:
            y = F.rms_norm(h, (4,), ww + offset, eps=1e-5)
        else:
            y = F.layer_norm(h, (4,), ww, bb, eps=1e-5)
        return (y ** 3 * c).sum() + (h ** 3 * d).sum() + (bb ** 2).sum()

    got, expected = _hessians(ours, x, r, w, b), _hessians(theirs, x, r, w, b)
    assert got[0][0].abs().max() > 0.1
    _assert_hessians_close(got, expected)


def test_second_derivatives_with_shared_parameters():
    # The weight reaches the nodes directly and through their inputs (nested nodes): each
    # node's backward must give its partial derivatives only, or paths are counted twice.
    x, r = _randn(2, 5, seed=114), _randn(2, 5, seed=115)
    w, b = 1 + 0.3 * _randn(5, seed=116), _randn(5, seed=117)
    c = _randn(2, 5, seed=118)

    def ours(xx, ww, bb):
        y = ln.layer_norm(ln.rms_norm(xx, 5, ww, eps=1e-5) * ww, 5, ww, bb)
        y, h = ln.add_layer_norm(y, r * bb, 5, ww, bb)
        return (y ** 3 * c).sum() + (h ** 3).sum()

    def theirs(xx, ww, bb):
        y = F.layer_norm(F.rms_norm(xx, (5,), ww, eps=1e-5) * ww, (5,), ww, bb)
        h = y + r * bb
        return (F.layer_norm(h, (5,), ww, bb) ** 3 * c).sum() + (h ** 3).sum()

    _assert_hessians_close(_hessians(ours, x, w, b), _hessians(theirs, x, w, b))


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("where", ["last", "channels-first"])
def test_gradgradcheck(rms, where):
    shape, kw, pshape = {"last": ((3, 5), {"normalized_shape": 5}, (5,)),
                         "channels-first": ((2, 4, 3), {"axis": 1}, (4,))}[where]
    x = _randn(*shape, seed=110, loc=0.3).requires_grad_()
    w = (1 + 0.3 * _randn(*pshape, seed=111)).requires_grad_()
    b = _randn(*pshape, seed=112).requires_grad_()
    if rms:
        inputs = (x, w)

        def fn(a, ww):
            return ln.rms_norm(a, weight=ww, eps=1e-5, **kw)
    else:
        inputs = (x, w, b)

        def fn(a, ww, bb):
            return ln.layer_norm(a, weight=ww, bias=bb, **kw)
    assert fn(*inputs).grad_fn.name() == "_NormFunctionBackward"
    assert torch.autograd.gradgradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_first_order_backward_still_runs_the_kernels(monkeypatch):
    x = _randn(3, 8, seed=113).requires_grad_()
    calls = []
    native = _torch.backward_with
    monkeypatch.setattr(_torch, "backward_with",
                        lambda *args, **kw: calls.append(1) or native(*args, **kw))
    ln.layer_norm(x).sum().backward()
    assert calls == [1]


@pytest.mark.parametrize("rms", [False, True])
def test_functional_backward_is_differentiable(rms, monkeypatch):
    """layer_norm_backward / rms_norm_backward on tensors that require grad return
    differentiable gradients, as torch's native_layer_norm_backward does (a gradient
    penalty differentiates them): gradcheck with respect to grad_y, x, weight and
    grad_residual (an offset gain), the second derivative of torch's own layer_norm /
    rms_norm, and the same values as the kernels, which run when nothing requires grad."""
    import torch.nn.functional as F

    n = 6
    x = _randn(4, n, seed=120, loc=0.3).requires_grad_()
    gy = _randn(4, n, seed=121).requires_grad_()
    w = (1 + 0.3 * _randn(n, seed=122)).requires_grad_()
    gr = _randn(4, n, seed=123).requires_grad_()
    with torch.no_grad():
        _, *stats = (ln.rms_norm if rms else ln.layer_norm)(x, n, return_stats=True)
    backward = ln.rms_norm_backward if rms else ln.layer_norm_backward

    def fn(g, a, ww, r):
        return backward(g, a, *stats, ww, n, weight_offset=0.5, grad_residual=r)

    grads = fn(gy, x, w, gr)
    assert all(g.requires_grad for g in grads)
    _gradcheck(fn, gy, x, w, gr)

    def through_stats(a):  # the statistics as functions of x, as inside torch's norm
        var = (a * a).mean(-1, keepdim=True) if rms else a.var(-1, unbiased=False,
                                                               keepdim=True)
        rstd = torch.rsqrt(var + 1e-5)
        mean = [] if rms else [a.mean(-1, keepdim=True)]
        return backward(gy, a, *mean, rstd, w, n)[0]

    def theirs(a):
        y = (F.rms_norm(a, (n,), w, 1e-5) if rms else F.layer_norm(a, (n,), w, None, 1e-5))
        return torch.autograd.grad(y, a, gy, create_graph=True)[0]

    v = _randn(4, n, seed=124)
    second = torch.autograd.grad((through_stats(x) * v).sum(), x)[0]
    expected = torch.autograd.grad((theirs(x) * v).sum(), x)[0]
    np.testing.assert_allclose(_np64(second), _np64(expected), atol=1e-12)
    calls = []
    native = _torch.backward_with
    monkeypatch.setattr(_torch, "backward_with",
                        lambda *args, **kw: calls.append(1) or native(*args, **kw))
    with torch.no_grad():
        kernels = fn(gy, x, w, gr)
    assert calls and not any(g.requires_grad for g in kernels)
    for a, b in zip(grads, kernels, strict=True):
        np.testing.assert_allclose(_np64(a), _np64(b), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- routes


def test_array_api_backend_uses_torch_namespace_and_autograd():
    x = _randn(4, 9, seed=28, dtype=torch.float64).requires_grad_()
    w = _randn(9, seed=29).requires_grad_()
    y = ln.layer_norm(x, 9, w, backend="array_api")
    assert type(y) is torch.Tensor
    assert y.grad_fn is not None and y.grad_fn.name() != "_NormFunctionBackward"
    np.testing.assert_allclose(_np64(y), _np64(ln.layer_norm(x, 9, w)), atol=1e-13)
    y.sum().backward()
    _gradcheck(lambda a, b: ln.rms_norm(a, 9, b, backend="array_api"), x, w)


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm", "add_layer_norm", "backward"])
def test_generic_path_outputs_are_c_contiguous(fn):
    x = _randn(12, 7, seed=40, dtype=torch.float32).t()  # (7, 12), not C-contiguous
    if fn == "backward":
        _, mean, rstd = ln.layer_norm(x, return_stats=True)
        out = ln.layer_norm_backward(x.cos(), x, mean, rstd, backend="array_api")[0]
        expected = ln.layer_norm_backward(x.cos(), x, mean, rstd)[0]
    elif fn == "add_layer_norm":
        out, h = ln.add_layer_norm(x, x.sin(), backend="array_api")
        assert h.is_contiguous() and torch.equal(h, x + x.sin())
        expected = ln.add_layer_norm(x, x.sin())[0]
    else:
        out = getattr(ln, fn)(x, backend="array_api")
        expected = getattr(ln, fn)(x)
    assert out.is_contiguous()
    np.testing.assert_allclose(_np64(out), _np64(expected), atol=1e-5)


def test_tensor_subclasses_take_the_torch_route():
    class Subclass(torch.Tensor):
        pass

    x = _randn(3, 8, seed=41, dtype=torch.float32).as_subclass(Subclass)
    w = _randn(8, seed=42, dtype=torch.float32)
    assert ln.backend_name(x) == "numba"
    y = ln.layer_norm(x, 8, w)
    plain = x.as_subclass(torch.Tensor)
    assert torch.equal(y.as_subclass(torch.Tensor), ln.layer_norm(plain, 8, w))
    with pytest.raises(TypeError, match="weight comes from numpy"):
        ln.layer_norm(x, 8, w.numpy())


# torch's forward AD loads its decompositions with the deprecated torch.jit.script.
@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*:DeprecationWarning")
@pytest.mark.parametrize("rms", [False, True])
def test_forward_mode_ad_gives_torch_tangents(rms):
    import torch.autograd.forward_ad as fwad

    x = _randn(4, 10, seed=43)
    tx = _randn(4, 10, seed=44)
    w, tw = _randn(10, seed=45), _randn(10, seed=46)
    ours = ln.rms_norm if rms else ln.layer_norm
    theirs = F.rms_norm if rms else F.layer_norm
    with fwad.dual_level():
        y = ours(fwad.make_dual(x, tx), 10, fwad.make_dual(w, tw))
        tangent = fwad.unpack_dual(y).tangent
        expected = fwad.unpack_dual(theirs(fwad.make_dual(x, tx), (10,),
                                           fwad.make_dual(w, tw))).tangent
    assert tangent is not None
    np.testing.assert_allclose(_np64(tangent), _np64(expected), rtol=1e-10, atol=1e-12)
    with fwad.dual_level():
        y, h = ln.add_layer_norm(fwad.make_dual(x, tx), x.cos())
        np.testing.assert_array_equal(_np64(fwad.unpack_dual(h).tangent), _np64(tx))
        assert fwad.unpack_dual(y).tangent is not None


def test_torch_func_transforms_match_torch():
    tf = pytest.importorskip("torch.func")
    x, t, r = _randn(3, 8, seed=51), _randn(3, 8, seed=52), _randn(3, 8, seed=53)
    w, b = _randn(8, seed=54), _randn(8, seed=55)
    cases = [
        (lambda a: ln.layer_norm(a, 8, w, b).sin().sum(),
         lambda a: F.layer_norm(a, (8,), w, b).sin().sum(), x),
        (lambda v: ln.rms_norm(x, 8, v).sin().sum(),
         lambda v: F.rms_norm(x, (8,), v).sin().sum(), w),
        (lambda a: ln.add_layer_norm(a, r, 8, w, b)[0].sin().sum(),
         lambda a: F.layer_norm(a + r, (8,), w, b).sin().sum(), x),
    ]
    for ours, theirs, arg in cases:
        np.testing.assert_allclose(_np64(tf.grad(ours)(arg)), _np64(tf.grad(theirs)(arg)),
                                   rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_np64(tf.vmap(lambda a: ln.layer_norm(a, 8, w, b))(x)),
                               _np64(F.layer_norm(x, (8,), w, b)), rtol=1e-12, atol=1e-12)
    ours = tf.jvp(lambda a: ln.rms_norm(a, 8, w), (x,), (t,))[1]
    theirs = tf.jvp(lambda a: F.rms_norm(a, (8,), w), (x,), (t,))[1]
    np.testing.assert_allclose(_np64(ours), _np64(theirs), rtol=1e-10, atol=1e-12)
    _, mean, rstd = ln.layer_norm(x, 8, w, b, return_stats=True)
    per_row = tf.vmap(lambda g, a, m, s: ln.layer_norm_backward(g[None], a[None], m[None],
                                                                 s[None], w)[0][0])
    np.testing.assert_allclose(_np64(per_row(t, x, mean, rstd)),
                               _np64(ln.layer_norm_backward(t, x, mean, rstd, w)[0]),
                               rtol=1e-12, atol=1e-12)


@pytest.fixture
def short_path_inputs(monkeypatch):
    """The types of the ``x`` that reach the NumPy short path (``_fast.layer_norm`` /
    ``_fast.rms_norm``), call by call."""
    from layernorm import _fast

    seen = []
    for name in ("layer_norm", "rms_norm"):
        real = getattr(_fast, name)
        monkeypatch.setattr(_fast, name, lambda *a, _real=real: (seen.append(type(a[0])),
                                                                 _real(*a))[1])
    return seen


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_small_cpu_calls_take_the_numpy_short_path(short_path_inputs, dtype):
    seen = short_path_inputs
    tdt = TORCH_DTYPES[dtype]
    for shape in ((1, 768), (7, 300), (3, 4, 64), (64, 1024)):
        n = shape[-1]
        x = _randn(*shape, seed=60, dtype=tdt, loc=3.0)
        w, b = _randn(n, seed=61, dtype=tdt), _randn(n, seed=62, dtype=tdt)
        for _ in range(2):  # the first call of a process may go the general way
            ours = ln.layer_norm(x, n, w, b, return_stats=True)
            ours_rms = ln.rms_norm(x, n, w, return_stats=True)
        general = ln.layer_norm(x, n, w, b, return_stats=True, backend="numba")
        general_rms = ln.rms_norm(x, n, w, return_stats=True, backend="numba")
        for mine, theirs in zip((*ours, *ours_rms), (*general, *general_rms), strict=True):
            assert type(mine) is torch.Tensor and mine.dtype == theirs.dtype
            assert mine.shape == theirs.shape and torch.equal(mine, theirs)
    assert seen and set(seen) == {np.ndarray}


def test_short_path_leaves_what_it_cannot_take_to_the_general_route(monkeypatch):
    from layernorm import _fast

    x = _randn(4, 16, seed=63, dtype=torch.float32)
    ln.layer_norm(x)  # imports the adapter: later calls try the short path
    w = torch.nn.Parameter(_randn(16, seed=64, dtype=torch.float32))
    y = ln.layer_norm(x, 16, w)  # a parameter that requires grad: the autograd node
    assert y.grad_fn is not None
    with torch.no_grad():
        assert torch.equal(ln.layer_norm(x, 16, w), y.detach())
    negated = ln.layer_norm(-x)
    monkeypatch.setattr(_fast, "layer_norm", lambda *a: pytest.fail("short path"))
    # Tensor.numpy() refuses these (the short path relies on it): the lazy negation bit,
    # in any dtype, a sparse layout, a vmap wrapper.
    assert torch.equal(ln.layer_norm(x._neg_view()), negated)
    xb = x.to(torch.bfloat16)
    assert torch.equal(ln.layer_norm(xb._neg_view()), ln.layer_norm(-xb, backend="numba"))
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        ln.layer_norm(x.to_sparse())
    rows = torch.func.vmap(lambda r: ln.layer_norm(r))(x)
    assert torch.allclose(rows, negated.neg(), rtol=0, atol=1e-6)
    # Tensor.numpy() hands these out as views of unrelated memory: a functionalize
    # wrapper (not requiring grad) and a zero tensor (no storage at all).
    wb = _randn(16, seed=65, dtype=torch.float32)
    functional = torch.func.functionalize(lambda t: ln.layer_norm(t, 16, wb, wb))(x)
    assert torch.allclose(functional, ln.layer_norm(x, 16, wb, wb, backend="numba"),
                          rtol=0, atol=1e-6)
    zero = torch._efficientzerotensor(4, 16)
    assert torch.equal(ln.layer_norm(zero, 16, wb, wb), wb.expand(4, 16))
    assert torch.equal(ln.rms_norm(zero), torch.zeros(4, 16))
    ln.layer_norm(x, out=torch.empty_like(x))
    ln.layer_norm(torch.empty(2, 3, device="meta"))
    ln.layer_norm(x.detach(), weight_offset=np.float32(1.0), weight=w.detach())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rms", [False, True])
def test_the_autograd_node_runs_the_numpy_short_paths(monkeypatch, short_path_inputs, dtype,
                                                      rms):
    """A call that autograd records runs our node, whose forward and backward take the
    NumPy short paths (grad mode is off inside them): the general route's bits, for
    y and every gradient."""
    from layernorm import _fast_backward
    from layernorm._adapters import torch as adapter

    backward_calls = []
    real_gradients = _fast_backward.gradients
    monkeypatch.setattr(_fast_backward, "gradients",
                        lambda *a: (backward_calls.append(1), real_gradients(*a))[1])
    tdt = TORCH_DTYPES[dtype]
    n = 96

    def run():
        x = _randn(5, n, seed=70, dtype=tdt, loc=2.0).requires_grad_()
        w = _randn(n, seed=71, dtype=tdt).requires_grad_()
        b = _randn(n, seed=72, dtype=tdt).requires_grad_()
        gy = _randn(5, n, seed=73, dtype=tdt)
        y = ln.rms_norm(x, n, w) if rms else ln.layer_norm(x, n, w, b)
        y.backward(gy)
        return y.detach(), x.grad, w.grad, None if rms else b.grad

    fast = run()
    assert set(short_path_inputs) == {np.ndarray} and backward_calls
    monkeypatch.setattr(adapter, "_short_forward", lambda *a: None)
    monkeypatch.setattr(adapter, "_short_backward", lambda *a: None)
    short_path_inputs.clear()
    backward_calls.clear()
    general = run()
    assert not short_path_inputs and not backward_calls
    _assert_same_tensors(fast, general)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_small_cpu_add_norm_calls_take_the_numpy_short_path(monkeypatch, dtype):
    """``add_layer_norm``/``add_rms_norm`` of CPU tensors that autograd does not record
    run the NumPy fused path on zero-copy views: the general route's bits for y, h and
    the statistics (a float32 residual beside 16-bit x too, and a weight offset)."""
    from layernorm import _fast_add

    seen = []
    real = _fast_add.add_norm
    monkeypatch.setattr(_fast_add, "add_norm",
                        lambda *a: (seen.append(type(a[0])), real(*a))[1])
    tdt = TORCH_DTYPES[dtype]
    for shape, rdt in (((1, 768), tdt), ((7, 300), torch.float32), ((3, 4, 64), tdt)):
        n = shape[-1]
        x = _randn(*shape, seed=81, dtype=tdt, loc=2.0)
        r = _randn(*shape, seed=82, dtype=rdt, loc=-1.0)
        w, b = _randn(n, seed=83, dtype=tdt), _randn(n, seed=84, dtype=tdt)
        for kw in ({}, {"weight_offset": 1.0}):
            for _ in range(2):  # the first call of a process may go the general way
                seen.clear()
                ours = (*ln.add_layer_norm(x, r, n, w, b, return_stats=True, **kw),
                        *ln.add_rms_norm(x, r, n, w, return_stats=True, **kw))
            assert seen == [np.ndarray, np.ndarray]
            general = (*ln.add_layer_norm(x, r, n, w, b, return_stats=True, backend="numba",
                                          **kw),
                       *ln.add_rms_norm(x, r, n, w, return_stats=True, backend="numba", **kw))
            for mine, theirs in zip(ours, general, strict=True):
                assert type(mine) is torch.Tensor and mine.dtype == theirs.dtype
                assert mine.shape == theirs.shape and torch.equal(mine, theirs)
    # Not taken: a residual that is not a tensor (the general route's TypeError); a call
    # autograd records goes to the autograd node (whose forward runs the fused path).
    seen.clear()
    with pytest.raises(TypeError, match="residual"):
        ln.add_layer_norm(x, r.numpy() if rdt != torch.bfloat16 else np.ones(3), n, w, b)
    assert not seen
    y, _ = ln.add_rms_norm(x, r, n, w.clone().requires_grad_())
    assert y.grad_fn.name() == "_AddNormFunctionBackward"


@pytest.mark.parametrize(("dtype", "rdtype"), [("float32", "float32"),
                                              ("bfloat16", "bfloat16"),
                                              ("float16", "float32")])
@pytest.mark.parametrize("rms", [False, True])
def test_the_add_norm_node_runs_the_numpy_fused_path(monkeypatch, dtype, rdtype, rms):
    """The autograd node of a recorded ``add_`` call computes its forward on the NumPy
    fused short path (h in the residual's dtype): the general route's bits for y, h and
    every gradient; with ``residual_dtype`` another dtype, the general route."""
    from layernorm import _fast_add
    from layernorm._adapters import torch as adapter

    calls = []
    real = _fast_add.add_norm
    monkeypatch.setattr(_fast_add, "add_norm", lambda *a: (calls.append(1), real(*a))[1])
    tdt, rdt = TORCH_DTYPES[dtype], TORCH_DTYPES[rdtype]
    n = 72

    def run(**kw):
        x = _randn(5, n, seed=85, dtype=tdt, loc=1.0).requires_grad_()
        r = _randn(5, n, seed=86, dtype=rdt, loc=-2.0).requires_grad_()
        w = _randn(n, seed=87, dtype=tdt).requires_grad_()
        b = _randn(n, seed=88, dtype=tdt).requires_grad_()
        gy, gh = _randn(5, n, seed=89, dtype=tdt), _randn(5, n, seed=90, dtype=rdt)
        y, h = (ln.add_rms_norm(x, r, n, w, weight_offset=0.5, **kw) if rms
                else ln.add_layer_norm(x, r, n, w, b, **kw))
        torch.autograd.backward((y, h), (gy, gh.to(h.dtype)))
        return y.detach(), h.detach(), x.grad, r.grad, w.grad, None if rms else b.grad

    fast = run()
    assert calls
    monkeypatch.setattr(adapter, "short_add_norm", lambda *a: None)
    calls.clear()
    general = run()
    assert not calls
    _assert_same_tensors(fast, general)
    monkeypatch.undo()
    monkeypatch.setattr(_fast_add, "add_norm", lambda *a: (calls.append(1), real(*a))[1])
    run(residual_dtype=torch.float64)
    assert not calls


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rms", [False, True])
def test_recorded_calls_go_straight_to_the_autograd_node(monkeypatch, dtype, rms):
    """A call that autograd records (grad mode on, an input requiring grad) on dense CPU
    tensors reaches our node without the general route's per-call checks, with the
    general route's bits for y, the statistics and every gradient; what that route would
    refuse is refused alike, and what the node cannot view goes the general way."""
    from layernorm._adapters import torch as adapter

    tdt = TORCH_DTYPES[dtype]
    n = 80

    def run(**kw):
        x = _randn(6, n, seed=74, dtype=tdt, loc=-1.5).requires_grad_()
        w = _randn(n, seed=75, dtype=tdt).requires_grad_()
        b = _randn(n, seed=76, dtype=tdt).requires_grad_()
        gy = _randn(6, n, seed=77, dtype=tdt)
        outs = (ln.rms_norm(x, n, w, return_stats=True, **kw) if rms else
                ln.layer_norm(x, n, w, b, return_stats=True, **kw))
        assert outs[0].grad_fn.name() == "_NormFunctionBackward"
        assert all(not s.requires_grad for s in outs[1:])
        outs[0].backward(gy)
        return (*(t.detach() for t in outs), x.grad, w.grad, None if rms else b.grad)

    general = run(backend="numba")  # the general route: its checks, then the node
    checked = []
    real_check = adapter._check_inputs
    monkeypatch.setattr(adapter, "_check_inputs",
                        lambda *a, **k: (checked.append(1), real_check(*a, **k))[1])
    recorded = run()
    assert not checked
    _assert_same_tensors(recorded, general)
    # Refused alike: a weight of another shape; a NumPy weight beside a tensor.
    x = _randn(6, n, seed=78, dtype=tdt).requires_grad_()
    call = ln.rms_norm if rms else ln.layer_norm
    for bad, error in ((_randn(n + 1, seed=79, dtype=tdt).requires_grad_(), ValueError),
                       (np.ones(n, np.float32), TypeError)):
        messages = []
        for kw in ({}, {"backend": "numba"}):
            with pytest.raises(error) as info:
                call(x, n, bad, **kw)
            messages.append(str(info.value))
        assert messages[0] == messages[1]
    # What the node's views cannot read goes the general way (its checks run).
    checked.clear()
    y = call(x._neg_view(), n, _randn(n, seed=80, dtype=tdt).requires_grad_())
    assert checked and y.grad_fn is not None


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_offset_gains_take_the_numpy_short_path(short_path_inputs, dtype):
    """``weight_offset`` without autograd runs the NumPy short path with the gain formed
    as the general route forms it: the same bits as that route, and as the autograd
    node's output when the weight requires grad."""
    seen = short_path_inputs
    tdt = TORCH_DTYPES[dtype]
    x = _randn(5, 300, seed=65, dtype=tdt, loc=3.0)
    w, b = 0.1 * _randn(300, seed=66, dtype=tdt), _randn(300, seed=67, dtype=tdt)
    for offset in (1.0, -0.5, 1):
        for _ in range(2):
            ours = ln.layer_norm(x, 300, w, b, return_stats=True, weight_offset=offset)
            ours_rms = ln.rms_norm(x, 300, w, return_stats=True, weight_offset=offset)
        general = ln.layer_norm(x, 300, w, b, return_stats=True, weight_offset=offset,
                                backend="numba")
        general_rms = ln.rms_norm(x, 300, w, return_stats=True, weight_offset=offset,
                                  backend="numba")
        for mine, theirs in zip((*ours, *ours_rms), (*general, *general_rms), strict=True):
            assert type(mine) is torch.Tensor and mine.dtype == theirs.dtype
            assert torch.equal(mine, theirs)
        assert not torch.equal(ours[0], ln.layer_norm(x, 300, w, b))  # the gain counts
        wg = w.clone().requires_grad_()
        recorded = ln.layer_norm(x, 300, wg, b, weight_offset=offset)
        assert recorded.grad_fn is not None and torch.equal(recorded.detach(), ours[0])
    assert seen and set(seen) == {np.ndarray}


def test_quantized_add_keeps_the_residual_gradient():
    x = _randn(3, 16, seed=47, dtype=torch.float32).requires_grad_()
    r = _randn(3, 16, seed=48, dtype=torch.float64).requires_grad_()
    codes, h, _ = ln.add_rms_norm(x, r, quantize="int8")
    assert not codes.requires_grad and h.requires_grad
    np.testing.assert_array_equal(_np64(h), _np64(x) + _np64(r))
    g = _randn(3, 16, seed=49)
    h.backward(g)
    assert x.grad.dtype == torch.float32 and r.grad.dtype == torch.float64
    np.testing.assert_array_equal(_np64(x.grad), _np64(g.float()))
    np.testing.assert_array_equal(_np64(r.grad), _np64(g))


@pytest.mark.parametrize("name", ["out", "residual_out"])
def test_outputs_that_require_grad_are_refused(name):
    x = _randn(2, 8, seed=50, dtype=torch.float32)
    leaf = torch.zeros(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=f"{name}= is a tensor that requires grad"):
        ln.add_layer_norm(x, x.cos(), **{name: leaf})
    if name == "out":
        with pytest.raises(RuntimeError, match="out= is a tensor that requires grad"):
            ln.layer_norm(x, out=leaf)
    assert torch.equal(leaf, torch.zeros(2, 8))
    with torch.no_grad():
        ln.layer_norm(x, out=leaf)
    assert torch.equal(leaf.detach(), ln.layer_norm(x))


@pytest.mark.parametrize("name", ["out", "residual_out", "in place"])
def test_inference_tensors_are_not_written_outside_inference_mode(name):
    # torch refuses every in-place or out= update of an inference tensor outside
    # inference mode ("Inplace update to inference tensor outside InferenceMode").
    with torch.inference_mode():
        buf = torch.zeros(3, 5)
        xi = _randn(3, 5, seed=51, dtype=torch.float32)
    x = _randn(3, 5, seed=52, dtype=torch.float32)
    if name == "in place":
        with pytest.raises(RuntimeError, match="out= is an inference tensor"):
            ln.rms_norm(xi, 5, out=xi)
        with torch.inference_mode():
            expected = ln.rms_norm(xi.clone(), 5)
            assert ln.rms_norm(xi, 5, out=xi) is xi and torch.equal(xi, expected)
        return
    call = ({"out": buf} if name == "out" else {"residual_out": buf})
    with pytest.raises(RuntimeError, match=f"{name}= is an inference tensor"):
        ln.add_layer_norm(x, x.cos(), **call)
    if name == "out":
        with pytest.raises(RuntimeError, match="out= is an inference tensor"):
            ln.layer_norm(x, 5, out=buf)
    assert torch.equal(buf, torch.zeros(3, 5))
    with torch.inference_mode():
        ln.add_layer_norm(x, x.cos(), **call)
    assert not torch.equal(buf, torch.zeros(3, 5))


def test_other_devices_use_the_generic_path():
    x = torch.empty(2, 3, 4, device="meta")
    assert ln.backend_name(x) == "array_api"
    y, mean, rstd = ln.layer_norm(x, axis=1, return_stats=True)
    assert y.device.type == "meta" and y.shape == (2, 3, 4)
    assert mean.shape == rstd.shape == (2, 1, 4)
    assert ln.rms_norm(x).device.type == "meta"


def test_forced_backends_check_the_device():
    with pytest.raises(ValueError, match="CUDA tensor"):
        ln.layer_norm(torch.ones(2, 3), backend="cupy")
    with pytest.raises(ValueError, match="CPU tensor"):
        ln.layer_norm(torch.ones(2, 3, device="meta"), backend="numba")
    with pytest.raises(ValueError, match="backend"):
        ln.layer_norm(torch.ones(2, 3), backend="jax")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
@pytest.mark.parametrize("kw", [{"axis": -1}, {"axis": 1}, {"axis": (0, 2)}], ids=str)
def test_interface_driver_matches_the_numpy_route(dtype, kw):
    # The CUDA route hands the engine bfloat16 as raw bits (the request names the dtype)
    # and parameters cast to the accumulation dtype. Run that bridge on CPU tensors with
    # NumPy and the Numba backend: it must agree bitwise with the CPU route.
    from layernorm._dispatch import Route

    bridge = _torch.Bridge(np, np.from_dlpack, torch.from_numpy, bfloat16_as_bits=True)
    route = Route("torch", "numba")

    class drv:
        @staticmethod
        def forward(*args):
            return _torch.forward_with(bridge, route, *args)

        @staticmethod
        def backward(*args):
            return _torch.backward_with(bridge, route, *args)

    tdt = TORCH_DTYPES[dtype]
    x = _randn(4, 6, 5, seed=30, dtype=tdt, loc=1.0)
    axes = tuple(a % 3 for a in np.atleast_1d(kw["axis"]))
    pshape = tuple(x.shape[a] for a in sorted(axes))
    w = _randn(*pshape, seed=31, dtype=tdt)
    b = _randn(*pshape, seed=32, dtype=tdt)
    gy = _randn(4, 6, 5, seed=33, dtype=tdt)
    y, mean, rstd = drv.forward(False, x, None, w, b, 1e-5, kw["axis"], None)
    ey, emean, erstd = ln.layer_norm(x, None, w, b, axis=kw["axis"], return_stats=True)
    for got, exp in ((y, ey), (mean, emean), (rstd, erstd)):
        assert got.dtype == exp.dtype and torch.equal(got, exp)
    for got, exp in zip(drv.backward(False, gy, x, mean, rstd, w, None, kw["axis"]),
                        ln.layer_norm_backward(gy, x, mean, rstd, w, axis=kw["axis"]),
                        strict=True):
        assert got.dtype == exp.dtype and torch.equal(got, exp)
    y, _, rstd = drv.forward(True, x, None, None, None, None, kw["axis"], None)
    assert torch.equal(y, ln.rms_norm(x, axis=kw["axis"]))
    for got, exp in zip(drv.backward(True, gy, x, None, rstd, None, None, kw["axis"]),
                        ln.rms_norm_backward(gy, x, rstd, axis=kw["axis"]), strict=True):
        assert got.dtype == exp.dtype and torch.equal(got, exp)


# --------------------------------------------------------------------------- mixed inputs


def test_tensors_on_different_devices_are_a_type_error():
    x = _randn(2, 4, seed=35)
    with pytest.raises(TypeError, match=r"weight is on device meta but x is on device cpu"):
        ln.layer_norm(x, 4, torch.ones(4, device="meta", dtype=torch.float64))
    with pytest.raises(TypeError, match=r"rstd is on device meta"):
        ln.rms_norm_backward(x, x, torch.ones(2, 1, device="meta", dtype=torch.float64))


# --------------------------------------------------------------------------- drop-in modules


def test_modules_are_drop_in_for_torch():
    ref = torch.nn.LayerNorm((3, 8), eps=1e-6, bias=False)
    ours = lnt.LayerNorm((3, 8), eps=1e-6, bias=False)
    assert isinstance(ours, torch.nn.LayerNorm)
    assert repr(ours) == repr(ref)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight"]
    with torch.no_grad():
        ref.weight.copy_(_randn(3, 8, seed=36, dtype=torch.float32))
    ours.load_state_dict(ref.state_dict())
    x = _randn(5, 3, 8, seed=37, dtype=torch.float32)
    np.testing.assert_allclose(ours(x).detach().numpy(), ref(x).detach().numpy(), atol=1e-5)
    assert list(lnt.LayerNorm(4).state_dict()) == ["weight", "bias"]
    assert list(lnt.LayerNorm(4, elementwise_affine=False).state_dict()) == []
    rms = lnt.RMSNorm(8, dtype=torch.float64)
    assert repr(rms) == repr(torch.nn.RMSNorm(8)) and rms.weight.dtype == torch.float64
    assert isinstance(rms, torch.nn.RMSNorm)


def _train(norm_cls, steps=5, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), norm_cls(16, **kwargs), torch.nn.GELU(), torch.nn.Linear(16, 3)
    ).double()
    with torch.no_grad():  # non-trivial norm parameters, the same for both models
        model[1].weight.copy_(1.0 + 0.1 * _randn(16, seed=38))
        if getattr(model[1], "bias", None) is not None:
            model[1].bias.copy_(0.1 * _randn(16, seed=39))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = _randn(32, 6, seed=40), _randn(32, 3, seed=41)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("ours", "theirs", "kwargs"), [
    (lnt.LayerNorm, torch.nn.LayerNorm, {}),
    (lnt.RMSNorm, torch.nn.RMSNorm, {"eps": 1e-6}),
])
def test_training_loop_matches_torch(ours, theirs, kwargs):
    got_losses, got_params = _train(ours, **kwargs)
    exp_losses, exp_params = _train(theirs, **kwargs)
    assert got_losses[-1] < got_losses[0]  # it trains
    np.testing.assert_allclose(got_losses, exp_losses, rtol=1e-10)
    for g, e in zip(got_params, exp_params, strict=True):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- CUDA tensors


def test_cuda_route_choice(monkeypatch):
    from layernorm import _dispatch

    cuda_x = torch.empty(2, 3, device="meta")
    monkeypatch.setattr(type(cuda_x), "device", property(lambda t: torch.device("cuda", 0)))
    monkeypatch.setattr(_dispatch, "cupy_available", lambda: True)
    assert _dispatch.route(cuda_x).backend == "cupy"
    assert ln.backend_name(cuda_x) == "cupy"
    assert _dispatch.route(cuda_x, "array_api").backend == "array_api"
    # Without CuPy (or with a broken install) a CUDA tensor still works, on the generic
    # path with torch's namespace, and backend_name says so; insisting on CuPy says what
    # is missing.
    monkeypatch.setattr(_dispatch, "cupy_available", lambda: False)
    assert _dispatch.route(cuda_x).backend == "array_api"
    assert ln.backend_name(cuda_x) == "array_api"
    with pytest.raises(ImportError, match="CuPy"):
        _dispatch.route(cuda_x, "cupy")


class _RecordingStream:
    """Stands in for a CuPy stream: records how it was made; a context manager."""

    def __init__(self, *args) -> None:
        self.args = args

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


@pytest.mark.parametrize("new_api", [True, False])
def test_torch_streams_reach_cupy_without_deprecated_calls(new_api):
    """CuPy 14 deprecates ``ExternalStream`` (a DeprecationWarning, an error in this
    suite, failed every CUDA tensor call on the first GPU run): ``Stream.from_external``
    gets an object in the CUDA stream protocol; older CuPy still gets ``ExternalStream``."""
    import types

    from layernorm._adapters import torch as adapter

    def external(handle, device):
        warnings.warn("ExternalStream is deprecated", DeprecationWarning, stacklevel=2)
        return _RecordingStream("external", handle, device)

    stream_cls = type("Stream", (), {})
    if new_api:
        stream_cls.from_external = staticmethod(
            lambda obj: _RecordingStream("from_external", obj.__cuda_stream__()))
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=stream_cls,
                                                            ExternalStream=external))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        made = adapter._cupy_stream(fake, 0x7F00, 1)
    assert made.args == (("from_external", (0, 0x7F00)) if new_api else
                         ("external", 0x7F00, 1))


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    pytest.importorskip("cupy")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_tensors_run_the_cupy_kernels(dtype):
    _cuda_or_skip()
    tdt = TORCH_DTYPES[dtype]
    x = _randn(64, 3, 40, seed=50, dtype=tdt).cuda()[:, :, 1:].requires_grad_()
    w = _randn(39, seed=51, dtype=torch.float32).cuda().requires_grad_()
    b = _randn(39, seed=52, dtype=torch.float32).cuda().requires_grad_()
    c = _randn(64, 3, 39, seed=53, dtype=tdt).cuda()
    assert ln.backend_name(x) == "cupy"
    y = ln.layer_norm(x, 39, w, b)
    assert y.device == x.device and y.dtype == tdt
    assert y.grad_fn.name() == "_NormFunctionBackward"
    y.backward(c)
    ours = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.layer_norm(x.float(), (39,), w, b).to(tdt).backward(c)
    scale = 4 * ATOL[dtype]
    np.testing.assert_allclose(_np64(y.cpu()),
                               _np64(F.layer_norm(x.float(), (39,), w, b).cpu()), atol=scale)
    np.testing.assert_allclose(_np64(ours[0].cpu()), _np64(x.grad.cpu()), atol=4 * scale)
    for mine, theirs in zip(ours[1:], (w.grad, b.grad), strict=True):
        np.testing.assert_allclose(mine.cpu().numpy(), theirs.cpu().numpy(), rtol=1e-2,
                                   atol=1e-2)
    r = ln.rms_norm(x.detach(), axis=1)
    np.testing.assert_allclose(
        _np64(r.cpu()), reference.rms_norm(_np64(x.cpu()), (1,))[0], atol=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cuda_tensors_quantize_and_add_grad_residual_in_the_cupy_kernels(dtype):
    # The fused paths of CuPy arrays, taken by CUDA tensors on zero-copy views: int8 and
    # grad_residual give CuPy's bits; float8 (which CuPy lacks) the contract's formula
    # on the float32 forward of the widened row, computed here with NumPy/ml_dtypes.
    _cuda_or_skip()
    import cupy
    import ml_dtypes

    tdt = TORCH_DTYPES[dtype]
    x = _randn(33, 300, seed=60, dtype=tdt).cuda()
    r = _randn(33, 300, seed=61, dtype=torch.float32).cuda()
    w = _randn(300, seed=62, dtype=torch.float32).cuda()
    b = _randn(300, seed=63, dtype=torch.float32).cuda()
    cx, cr, cw, cb = (cupy.from_dlpack(t) for t in (x, r, w, b))
    q, h, s = ln.add_layer_norm(x, r, 300, w, b, quantize="int8")
    cq, ch, cs = ln.add_layer_norm(cx, cr, 300, cw, cb, quantize="int8")
    assert q.dtype == torch.int8 and q.device == x.device
    for t, c in ((q, cq), (h, ch), (s, cs)):
        np.testing.assert_array_equal(t.cpu().numpy(), cupy.asnumpy(c))
    y32 = cupy.asnumpy(ln.layer_norm(cx.astype(cupy.float32), 300, cw, cb))
    for fmt, qmax in (("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0)):
        q8, s8 = ln.layer_norm(x, 300, w, b, quantize=fmt)
        qmax = np.float32(qmax)
        amax = np.abs(y32).max(axis=-1, keepdims=True)
        s_ref = np.where(amax == 0, np.float32(1), amax / qmax).astype(np.float32)
        q_ref = np.clip(y32 * (np.float32(1) / s_ref), -qmax, qmax).astype(
            getattr(ml_dtypes, fmt))
        assert q8.dtype == getattr(torch, fmt) and q8.device == x.device
        np.testing.assert_array_equal(q8.view(torch.uint8).cpu().numpy(),
                                      q_ref.view(np.uint8))
        np.testing.assert_array_equal(s8.cpu().numpy(), s_ref)
    _, mean, rstd = ln.layer_norm(x, 300, w, b, return_stats=True)
    gy = _randn(33, 300, seed=64, dtype=tdt).cuda()
    gr = _randn(33, 300, seed=65, dtype=tdt).cuda()
    got = ln.layer_norm_backward(gy, x, mean, rstd, w, grad_residual=gr)
    want = ln.layer_norm_backward(*(cupy.from_dlpack(t) for t in (gy, x, mean, rstd, w)),
                                  grad_residual=cupy.from_dlpack(gr))
    for t, c in zip(got, want, strict=True):
        np.testing.assert_array_equal(t.cpu().numpy(), cupy.asnumpy(c))


def _block(x, r, w, b):
    """A small pre-norm block through every torch entry point of the library."""
    import layernorm.torch as lnt

    torch.manual_seed(0)
    module = lnt.RMSNorm(x.shape[-1]).to(x.dtype)
    y = ln.layer_norm(x, x.shape[-1], w, b) * 2 + ln.rms_norm(x, x.shape[-1], w)
    y2, h = ln.add_rms_norm(x, r, x.shape[-1], w, weight_offset=1.0)
    return y + y2 + module(h)


@pytest.mark.parametrize("grad", [False, True])
def test_torch_compile_runs_the_calls_eagerly_with_the_same_results(grad):
    # Dynamo's fake tensors have no data for the kernels: compiling raised
    # ("Cannot access data pointer of Tensor"). The calls now break the graph and run
    # on the real tensors.
    x = _randn(4, 16, seed=60, dtype=torch.float32)
    r = _randn(4, 16, seed=61, dtype=torch.float32)
    w = _randn(16, seed=62, dtype=torch.float32).requires_grad_(grad)
    b = _randn(16, seed=63, dtype=torch.float32)
    compiled = torch.compile(_block, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(x, r, w, b)
    # no warning about our code from Dynamo (it ignored a functools.cache wrapper)
    assert not [w for w in caught if "layernorm" in str(w.message)], caught
    want = _block(x, r, w, b)
    assert torch.equal(got, want)
    if grad:
        (gw_got,) = torch.autograd.grad(got.sum(), w)
        (gw_want,) = torch.autograd.grad(want.sum(), w)
        assert torch.equal(gw_got, gw_want)


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm", "add_rms_norm"])
def test_batched_gradients_as_torch_computes_them(fn):
    # is_grads_batched=True (jacobian(vectorize=True)) hands a node's backward batched
    # gradients, which the kernels cannot read ("Batching rule not implemented for
    # aten::detach").
    x = _randn(2, 4, seed=64).requires_grad_()
    call = {"layer_norm": lambda t: ln.layer_norm(t, 4),
            "rms_norm": lambda t: ln.rms_norm(t, 4),
            "add_rms_norm": lambda t: ln.add_rms_norm(t, t.cos(), 4, t[0] * 0.5,
                                                      weight_offset=1.0)[0]}[fn]
    vectorized = torch.autograd.functional.jacobian(call, x, vectorize=True)
    looped = torch.autograd.functional.jacobian(call, x)
    torch.testing.assert_close(vectorized, looped, rtol=0, atol=1e-14)
    # and against torch's own function where it has one
    if fn != "add_rms_norm":
        torch_fn = {"layer_norm": lambda t: torch.nn.functional.layer_norm(t, (4,)),
                    "rms_norm": lambda t: torch.nn.functional.rms_norm(t, (4,))}[fn]
        torch.testing.assert_close(
            vectorized, torch.autograd.functional.jacobian(torch_fn, x, vectorize=True),
            rtol=1e-12, atol=1e-12)


def test_jit_trace_records_the_computation_not_its_result():
    # The kernels write through NumPy views, which a trace records as constants: a trace
    # made without its check returned the traced input's output for every input.
    example = _randn(3, 8, seed=65, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's tracer warnings about Python values
        traced = torch.jit.trace(lambda a: ln.layer_norm(a, 8) + ln.rms_norm(a, 8), (example,),
                                 check_trace=False)
    other = _randn(3, 8, seed=66, dtype=torch.float32) * 5 + 2
    torch.testing.assert_close(traced(other), ln.layer_norm(other, 8) + ln.rms_norm(other, 8),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_make_fx_records_the_computation_not_its_result(mode):
    """``make_fx`` (a proxy dispatch mode; with ``tracing_mode="fake"``, fake tensors)
    records torch's operations only: a graph traced through the kernels returned the
    traced input's output for every input. Norms, the fused add, the backward and a
    gradient through our autograd node, each traced and run on another input."""
    from torch.fx.experimental.proxy_tensor import make_fx

    example = _randn(3, 8, seed=67, dtype=torch.float32)
    other = _randn(3, 8, seed=68, dtype=torch.float32) * 5 + 2
    w = _randn(8, seed=69, dtype=torch.float32)
    calls = {
        "layer_norm": lambda t, w: ln.layer_norm(t, 8, w, w),
        "rms_norm": lambda t, w: ln.rms_norm(t, 8, w),
        "add_layer_norm": lambda t, w: ln.add_layer_norm(t, t.cos(), 8, w)[0],
        "backward": lambda t, w: ln.layer_norm_backward(
            t.sin(), t, *ln.layer_norm(t, 8, w, return_stats=True)[1:], w)[0],
        "grad": lambda t, w: torch.autograd.grad(ln.layer_norm(t, 8, w).pow(3).sum(), t)[0],
    }
    for name, fn in calls.items():
        src = example.clone().requires_grad_() if name == "grad" else example
        graph = make_fx(fn, tracing_mode=mode)(src, w)
        arg = other.clone().requires_grad_() if name == "grad" else other
        want = fn(arg, w)
        torch.testing.assert_close(graph(arg, w), want, rtol=1e-5, atol=1e-5, msg=name)
        assert not torch.allclose(fn(src, w), want, atol=1e-2), name


def test_dispatch_modes_that_run_operations_keep_the_kernels():
    """Dispatch modes that run what they see (``FlopCounterMode``, selective activation
    checkpointing) are no recorders: the kernels run under them, with the bits of a
    call outside them, and a non-reentrant checkpoint whose backward alone runs under
    such a mode recomputes the same tensors (routing the calls under a mode to the
    generic implementation made that a CheckpointError)."""
    import torch.utils.checkpoint as cp
    from torch.utils.flop_counter import FlopCounterMode

    x = _randn(6, 32, seed=74, dtype=torch.float32, loc=1.0)
    w = _randn(32, seed=75, dtype=torch.float32)
    plain = ln.layer_norm(x, 32, w)
    with FlopCounterMode(display=False):
        assert torch.equal(ln.layer_norm(x, 32, w), plain)
        assert torch.equal(ln.rms_norm(x, 32, w), ln.rms_norm(x, 32, w))

    def run(checkpointed_backward_under_mode, sac=False):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        kwargs = {}
        if sac:
            policy = cp.create_selective_checkpoint_contexts(
                lambda ctx, op, *a, **k: cp.CheckpointPolicy.PREFER_RECOMPUTE)
            kwargs["context_fn"] = lambda: policy
        y = cp.checkpoint(lambda a, b: ln.layer_norm(a, 32, b) * 2, xr, wr,
                          use_reentrant=False, **kwargs)
        assert torch.equal(y.detach(), plain * 2)
        if checkpointed_backward_under_mode:
            with FlopCounterMode(display=False):
                y.sum().backward()
        else:
            y.sum().backward()
        return xr.grad, wr.grad

    reference = run(False)
    for got in (run(True), run(False, sac=True)):
        for g, want in zip(got, reference, strict=True):
            assert torch.equal(g, want)


def test_weight_offset_none_is_refused_on_every_path():
    """``weight_offset=None`` is a TypeError (the contract's float), whatever path the
    call would take: the torch short paths' None means "no offset" and took it."""
    x = _randn(3, 8, seed=76, dtype=torch.float32)
    w = _randn(8, seed=77, dtype=torch.float32)
    calls = (lambda a: ln.layer_norm(a, 8, w, weight_offset=None),
             lambda a: ln.rms_norm(a, 8, w, weight_offset=None),
             lambda a: ln.add_layer_norm(a, a, 8, w, weight_offset=None),
             lambda a: ln.add_rms_norm(a, a, 8, w, weight_offset=None))
    for call in calls:
        for a in (x, x, x.clone().requires_grad_()):  # twice: a known shape's plan too
            with pytest.raises(TypeError, match="weight_offset must be a finite real"):
                call(a)


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_torch_export_of_the_modules(module):
    """``torch.export`` traces with fake tensors (no data for a kernel): the drop-in
    modules export as torch's do, and the program computes the norm of a new input."""
    import layernorm.torch as lnt

    ours = getattr(lnt, module)(8)
    with torch.no_grad():
        ours.weight.copy_(_randn(8, seed=70, dtype=torch.float32))
    program = torch.export.export(ours, (_randn(3, 8, seed=71, dtype=torch.float32),))
    other = _randn(3, 8, seed=72, dtype=torch.float32) * 3 - 1
    torch.testing.assert_close(program.module()(other), ours(other), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_fx_symbolic_trace_records_the_modules_calls(module):
    """``torch.fx.symbolic_trace`` of a model holding the drop-in modules records their
    norm calls as graph nodes (run on the real tensors): the graph computes what the
    model does, bit for bit. (Traced into with proxies, the library's Python refused.)"""
    import layernorm.torch as lnt

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = getattr(lnt, module)(8, weight_offset=0.5)
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.lin(self.norm(t))

    net = Net()
    graph = torch.fx.symbolic_trace(net)
    assert any(node.op == "call_function" and "norm" in node.name for node in graph.graph.nodes)
    x = _randn(5, 8, seed=73, dtype=torch.float32) * 3 + 1
    assert torch.equal(graph(x), net(x))


def test_torch_calls_do_not_import_dynamo():
    # torch.compiler.disable imports torch._dynamo, about a second of a first call: the
    # adapter calls it only where Dynamo already traces the call.
    code = ("import sys, torch, layernorm as ln; x = torch.randn(2, 8); "
            "ln.layer_norm(x); ln.rms_norm(x); ln.add_rms_norm(x, x); "
            "ln.layer_norm(x.requires_grad_()).sum().backward(); "
            "print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
