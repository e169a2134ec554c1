"""JAX and array_api_strict arrays: the generic path, in their own array types."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln
from tests import reference

from .conftest import random_rows

# --------------------------------------------------------------------------- JAX

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
xps = pytest.importorskip("array_api_strict")


def _is_jax(a) -> bool:
    return isinstance(a, jax.Array)


def test_jax_jit_equals_eager():
    rng = np.random.default_rng(1)
    x = jnp.asarray(random_rows(rng, (6, 5, 7), "float32", loc=1.0))
    w = jnp.asarray(random_rows(rng, (5,), "float32"))
    b = jnp.asarray(random_rows(rng, (5,), "float32"))

    def f(x, w, b):
        return ln.layer_norm(x, weight=w, bias=b, axis=1, return_stats=True)

    def g(x, w):
        return ln.rms_norm(x, 7, w[0] * jnp.ones(7), eps=1e-6)

    for eager, jitted in zip(f(x, w, b), jax.jit(f)(x, w, b), strict=True):
        assert _is_jax(jitted) and jitted.shape == eager.shape and jitted.dtype == eager.dtype
        # XLA may fuse differently than eager op-by-op execution: float32 rounding only.
        np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6,
                                   atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(g)(x, w)), np.asarray(g(x, w)), rtol=1e-6,
                               atol=1e-6)


def test_jax_jit_takes_a_static_scale_array():
    """Under ``jax.jit`` a ``scale`` array is traced: its values cannot be checked then
    (only its shape and dtype), and the call runs as eagerly; eagerly a bad value is
    still a ValueError."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(random_rows(rng, (4, 16), "float32"))
    scale = jnp.asarray(np.linspace(0.01, 0.04, 4, dtype=np.float32).reshape(4, 1))

    def f(x, s):
        return (ln.rms_norm(x, quantize="int8", scale=s)[0],
                ln.add_layer_norm(x, x, quantize="float8_e4m3fn", scale=s)[0])

    for jitted, eager in zip(jax.jit(f)(x, scale), f(x, scale), strict=True):
        assert _is_jax(jitted) and jitted.dtype == eager.dtype
        # XLA may round y32 differently than eager execution: one code step at most
        # (int8: 1; float8_e4m3fn: 3 mantissa bits)
        np.testing.assert_allclose(np.asarray(jitted).astype(np.float32),
                                   np.asarray(eager).astype(np.float32), rtol=0.125, atol=1)
    with pytest.raises(ValueError, match="scale must be positive and finite"):
        ln.rms_norm(x, quantize="int8", scale=-scale)


@pytest.mark.parametrize("kw", [{}, {"axis": 1}], ids=str)
def test_jax_grad_matches_reference_gradient(kw):
    rng = np.random.default_rng(2)
    xn = random_rows(rng, (5, 6, 9), "float32", loc=2.0)
    axes = (1,) if kw else (2,)
    n = xn.shape[axes[0]]
    wn = random_rows(rng, (n,), "float32")
    bn = random_rows(rng, (n,), "float32")
    c = random_rows(rng, xn.shape, "float32")

    def loss(x, w, b):
        return jnp.sum(ln.layer_norm(x, weight=w, bias=b, **kw) * jnp.asarray(c))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jnp.asarray(xn), jnp.asarray(wn),
                                                        jnp.asarray(bn))
    eager = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(xn), jnp.asarray(wn), jnp.asarray(bn))
    expected = reference.layer_norm_backward(c, xn, axes, wn)
    for got, again, exp in zip(grads, eager, expected, strict=True):
        assert _is_jax(got) and got.shape == exp.shape
        scale = np.abs(exp).max()
        np.testing.assert_allclose(np.asarray(got, np.float64), exp, rtol=0, atol=1e-5 * scale)
        np.testing.assert_allclose(np.asarray(again, np.float64), exp, rtol=0,
                                   atol=1e-5 * scale)

    def rms_loss(x, w):
        return jnp.sum(ln.rms_norm(x, weight=w, **kw) * jnp.asarray(c))

    gx, gw = jax.grad(rms_loss, argnums=(0, 1))(jnp.asarray(xn), jnp.asarray(wn))
    rgx, rgw = reference.rms_norm_backward(c, xn, axes, wn)
    np.testing.assert_allclose(np.asarray(gx, np.float64), rgx, rtol=0,
                               atol=1e-5 * np.abs(rgx).max())
    np.testing.assert_allclose(np.asarray(gw, np.float64), rgw, rtol=0,
                               atol=1e-5 * np.abs(rgw).max())


def test_jax_functional_backward_matches_jax_grad():
    rng = np.random.default_rng(3)
    x = jnp.asarray(random_rows(rng, (8, 12), "float32"))
    w = jnp.asarray(random_rows(rng, (12,), "float32"))
    c = jnp.asarray(random_rows(rng, (8, 12), "float32"))
    _, mean, rstd = ln.layer_norm(x, weight=w, return_stats=True)
    gx, gw, gb = ln.layer_norm_backward(c, x, mean, rstd, w)
    assert all(_is_jax(g) for g in (gx, gw, gb))
    auto = jax.grad(lambda x, w: jnp.sum(ln.layer_norm(x, weight=w) * c), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(auto[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(auto[1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gb), np.asarray(c.sum(axis=0)), rtol=1e-5, atol=1e-5)


def test_out_is_refused_on_the_generic_path():
    # (Mixed libraries, shared by every library, are in test_contract.py.)
    x = jnp.ones((2, 4)) * jnp.arange(4.0)
    with pytest.raises(TypeError, match="out="):
        ln.layer_norm(x, out=x)


# --------------------------------------------------------------------------- huge rows

#: Finite rows whose spread (not only whose squares) overflows the dtype, and a plain row.
HUGE_ROWS = {
    "float32": [[3e38, -3e38, 1e38, 0.0], [3e38, -3e38, -3e38, -3e38], [1.0, 2.5, -0.5, 4.0]],
    "float64": [[1.5e308, -1.5e308, 5e307, 0.0], [1.5e308, -1.5e308, -1.5e308, -1.5e308],
                [1.0, 2.5, -0.5, 4.0]],
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("lib", ["numpy", "jax", "array_api_strict"])
def test_generic_path_normalizes_finite_rows_whose_spread_overflows(lib, dtype):
    if lib == "jax" and dtype == "float64" and not jax.config.read("jax_enable_x64"):
        pytest.skip("JAX without x64 mode has no float64")
    xn = np.array(HUGE_ROWS[dtype], dtype)
    w = np.linspace(0.5, 2.0, 4).astype(dtype)
    b = np.linspace(-1.0, 1.0, 4).astype(dtype)
    convert = {"numpy": np.asarray, "jax": jnp.asarray, "array_api_strict": xps.asarray}[lib]
    x, wx, bx = convert(xn), convert(w), convert(b)
    kw = {"backend": "array_api"} if lib == "numpy" else {}
    ry = reference.layer_norm(xn, (1,), w, b)[0]
    rr = reference.rms_norm(xn, (1,), w)[0]
    tol = {"rtol": 2e-6, "atol": 2e-6} if dtype == "float32" else {"rtol": 1e-13, "atol": 1e-13}
    results = [
        (ln.layer_norm(x, weight=wx, bias=bx, **kw), ry),
        (ln.add_layer_norm(x, convert(np.zeros_like(xn)), weight=wx, bias=bx, **kw)[0], ry),
        (ln.rms_norm(x, weight=wx, **kw), rr),
    ]
    for got, expected in results:
        got = np.from_dlpack(got)
        assert got.dtype == xn.dtype and np.isfinite(got).all()
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), **tol)
    # The same values as the native kernels, which never lose these rows.
    np.testing.assert_allclose(np.from_dlpack(results[0][0]), ln.layer_norm(xn, weight=w, bias=b),
                               **tol)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("lib", ["numpy", "jax", "array_api_strict"])
def test_generic_path_returns_and_reads_a_subnormal_rstd(lib, jit):
    # A float32 row of spread 2e38 has rstd 4.6e-39, a subnormal: XLA flushed it to 0,
    # and a backward from those statistics gave grad_weight 0 for the row.
    if jit and lib != "jax":
        pytest.skip("jax.jit is JAX's")
    xn = np.array([[3e38, -3e38, 1e38, 0.0], [1.0, 2.5, -0.5, 4.0]], np.float32)
    gn = np.array([[0.5, -1.0, 2.0, 0.25], [1.0, -0.5, 0.75, -2.0]], np.float32)
    w = np.linspace(0.5, 2.0, 4).astype(np.float32)
    convert = {"numpy": np.asarray, "jax": jnp.asarray, "array_api_strict": xps.asarray}[lib]
    kw = {"backend": "array_api"} if lib == "numpy" else {}

    def both(x, g, w):
        _, mean, rstd = ln.layer_norm(x, weight=w, return_stats=True, **kw)
        _, rstd_r = ln.rms_norm(x, weight=w, return_stats=True, **kw)
        return (mean, rstd, rstd_r, *ln.layer_norm_backward(g, x, mean, rstd, w, **kw),
                *ln.rms_norm_backward(g, x, rstd_r, w, **kw))

    run = jax.jit(both) if jit else both
    got = [np.from_dlpack(a) for a in run(convert(xn), convert(gn), convert(w))]
    _, mean, rstd = ln.layer_norm(xn, weight=w, return_stats=True)
    _, rstd_r = ln.rms_norm(xn, weight=w, return_stats=True)
    want = (mean, rstd, rstd_r, *ln.layer_norm_backward(gn, xn, mean, rstd, w),
            *ln.rms_norm_backward(gn, xn, rstd_r, w))
    assert 0 < got[1][0, 0] < 2.0**-126 and 0 < got[2][0, 0] < 2.0**-126
    names = ["mean", "rstd", "rms rstd", "grad_x", "grad_weight", "grad_bias", "rms grad_x",
             "rms grad_weight"]
    for name, a, b in zip(names, got, want, strict=True):
        if name.endswith("grad_x"):  # grad_x of the huge row is subnormal: XLA flushes it
            a, b = a[1:], b[1:]
        # a subnormal float32 rstd has 21 significant bits here
        np.testing.assert_allclose(a, b, rtol=4e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("lib", ["numpy", "jax", "array_api_strict"])
def test_generic_path_keeps_a_subnormal_eps(lib, dtype):
    # A positive eps below the dtype's smallest normal number: XLA flushes such numbers
    # to zero, which turned a constant row into NaN (the contract: eps > 0 gives the
    # bias, never NaN) and dropped eps beside a tiny row's variance. Every library must
    # give the native kernels' values.
    if lib == "jax" and dtype == "float64" and not jax.config.read("jax_enable_x64"):
        pytest.skip("JAX without x64 mode has no float64")
    eps, tiny = (1e-40, 1e-23) if dtype == "float32" else (1e-310, 1e-160)
    xn = np.array([[3.0, 3.0, 3.0, 3.0], [1.0, -2.0, 3.0, 0.5], [1.0, 2.5, -0.5, 4.0],
                   [0.0, 0.0, 0.0, 0.0]], dtype)
    xn[1] *= tiny
    w = np.linspace(0.5, 2.0, 4).astype(dtype)
    b = np.linspace(-1.0, 1.0, 4).astype(dtype)
    convert = {"numpy": np.asarray, "jax": jnp.asarray, "array_api_strict": xps.asarray}[lib]
    kw = {"backend": "array_api"} if lib == "numpy" else {}
    y, mean, rstd = (np.from_dlpack(a) for a in ln.layer_norm(
        convert(xn), weight=convert(w), bias=convert(b), eps=eps, return_stats=True, **kw))
    yr, rstd_r = (np.from_dlpack(a) for a in ln.rms_norm(
        convert(xn), weight=convert(w), eps=eps, return_stats=True, **kw))
    want = ln.layer_norm(xn, weight=w, bias=b, eps=eps, return_stats=True)
    want_r = ln.rms_norm(xn, weight=w, eps=eps, return_stats=True)
    np.testing.assert_array_equal(y[[0, 3]], np.broadcast_to(b, (2, 4)))  # exactly the bias
    np.testing.assert_array_equal(yr[3], np.zeros(4, dtype))
    # the tiny row: eps dominates its variance, so y is far below the unit scale
    assert np.abs(want[0][1] - b).max() < 0.01
    tol = {"rtol": 2e-6, "atol": 1e-6} if dtype == "float32" else {"rtol": 1e-13, "atol": 1e-14}
    for got, expected in zip((y, mean, rstd, yr, rstd_r), (*want, *want_r), strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, **tol)


# --------------------------------------------------------------------------- array_api_strict


def test_array_api_strict_arrays_on_different_devices_are_a_type_error():
    x = xps.asarray(np.linspace(-1.0, 1.0, 8).reshape(2, 4))
    other = xps.Device("device1")
    with pytest.raises(TypeError, match="device"):
        ln.layer_norm(x, weight=xps.ones(4, dtype=xps.float64, device=other))


@pytest.mark.parametrize("backend", ["numba", "cupy"])
def test_a_native_backend_refused_names_the_arrays_library(backend):
    x = xps.asarray(np.linspace(-1.0, 1.0, 8).reshape(2, 4))
    with pytest.raises(ValueError, match=rf"backend='{backend}' needs a .* as x, got an "
                                         r"array of array_api_strict \(Array\)"):
        ln.layer_norm(x, backend=backend)


def test_strict_empty_rows_backward_and_underflowing_scale_are_quiet():
    """Rows of no elements (backward) and a row whose dynamic scale amax / qmax rounds to
    0 give what the NumPy path gives, without NumPy's warnings leaking out (the test
    suite turns warnings into errors): the mean of an empty slice, a division by 0."""
    x0 = np.ones((4, 0), np.float32)
    x, w = xps.asarray(x0), xps.asarray(np.ones(0, np.float32))
    _, mean, rstd = ln.layer_norm(x, weight=w, return_stats=True)
    for got, want in zip(ln.layer_norm_backward(x, x, mean, rstd, weight=w),
                         ln.layer_norm_backward(x0, x0, np.asarray(mean), np.asarray(rstd),
                                                weight=np.asarray(w)), strict=True):
        assert got.shape == want.shape
    _, rstd = ln.rms_norm(x, weight=w, return_stats=True)
    gx, gw = ln.rms_norm_backward(x, x, rstd, weight=w)
    assert (gx.shape, gw.shape) == ((4, 0), (0,))
    tiny = np.array([[1e-30, -2e-30, 3e-30, 0, 0, 0, 0, 0]], np.float32)
    q, s = ln.rms_norm(xps.asarray(tiny), eps=1e30, quantize="int8")
    q_np, s_np = ln.rms_norm(tiny, eps=1e30, quantize="int8")
    assert float(np.asarray(s)[0, 0]) == float(s_np[0, 0]) == 0.0
    np.testing.assert_array_equal(np.asarray(q), q_np)
    assert q_np.tolist() == [[127, -128, 127, 0, 0, 0, 0, 0]]  # saturated, zeros kept
