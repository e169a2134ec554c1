"""Hypothesis: any shape, any strides, any axes, any dtype agree with the float64 reference."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import layernorm as ln

from . import reference
from .conftest import ATOL, DTYPES

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def arrays_and_axes(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    if draw(st.booleans()):  # sometimes a long normalized axis crossing chunk boundaries
        shape = (*shape[:-1], draw(st.integers(100, 700)))
    dtype = draw(st.sampled_from(list(DTYPES)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    loc = draw(st.sampled_from([0.0, 3.0, -50.0]))
    base = (loc + rng.standard_normal(shape)).astype(DTYPES[dtype])
    # A view with arbitrary layout: Fortran order, reversed axes, steps, transposes.
    view = np.asfortranarray(base) if draw(st.booleans()) else base
    flips = tuple(slice(None, None, -1) if draw(st.booleans()) else slice(None)
                  for _ in range(ndim))
    view = view[flips]
    if draw(st.booleans()):
        padded = np.repeat(view, 2, axis=ndim - 1)
        view = padded[..., ::2]
    if draw(st.booleans()):
        axes_order = draw(st.permutations(range(ndim)))
        view = view.transpose(axes_order)
    k = draw(st.integers(1, ndim))
    use_axis = draw(st.booleans())
    if use_axis:
        axes = tuple(sorted(draw(st.lists(st.integers(0, ndim - 1), min_size=k, max_size=k,
                                          unique=True))))
        spec = {"axis": tuple(a - ndim if draw(st.booleans()) else a for a in axes)}
        if len(axes) == 1 and draw(st.booleans()):
            spec = {"axis": spec["axis"][0]}
    else:
        axes = tuple(range(ndim - k, ndim))
        ns = tuple(view.shape[ndim - k:])
        spec = {"normalized_shape": ns[0] if k == 1 and draw(st.booleans()) else ns}
    return view, axes, spec, dtype, rng


@SETTINGS
@given(arrays_and_axes(), st.booleans())
def test_layer_norm_any_layout(case, affine):
    x, axes, spec, dtype, rng = case
    pshape = tuple(x.shape[a] for a in axes)
    w = (1 + 0.5 * rng.standard_normal(pshape)).astype(np.float32) if affine else None
    b = rng.standard_normal(pshape).astype(np.float32) if affine else None
    before = x.copy()
    y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True, **spec)
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x, axes, w, b)
    np.testing.assert_allclose(rstd, rstd_ref.astype(np.float64), rtol=1e-3)
    np.testing.assert_allclose(mean, mean_ref.astype(np.float64), rtol=1e-5, atol=1e-5)
    assert y.shape == x.shape and y.dtype == x.dtype and y.flags.c_contiguous
    assert mean.shape == tuple(1 if i in axes else s for i, s in enumerate(x.shape))
    np.testing.assert_allclose(y.astype(np.float64), y_ref.astype(np.float64), rtol=0,
                               atol=ATOL[dtype] * max(1.0, float(np.abs(y_ref).max())) * 2)
    np.testing.assert_array_equal(x, before)
    # The same values, contiguous, give the same bits.
    y_c = ln.layer_norm(np.ascontiguousarray(x), weight=w, bias=b, **spec)
    np.testing.assert_array_equal(y, y_c)


@SETTINGS
@given(arrays_and_axes())
def test_rms_norm_any_layout(case):
    x, axes, spec, dtype, _ = case
    y, rstd = ln.rms_norm(x, return_stats=True, **spec)
    y_ref, rstd_ref = reference.rms_norm(x, axes)
    np.testing.assert_allclose(rstd, rstd_ref.astype(np.float64), rtol=1e-3)
    np.testing.assert_allclose(y.astype(np.float64), y_ref.astype(np.float64), rtol=0,
                               atol=ATOL[dtype] * max(1.0, float(np.abs(y_ref).max())) * 2)
    np.testing.assert_array_equal(ln.rms_norm(np.ascontiguousarray(x), **spec), y)


@settings(max_examples=25, deadline=None)
@given(arrays_and_axes())
def test_backward_any_layout(case):
    x, axes, spec, dtype, rng = case
    if dtype not in ("float32", "float64"):
        return
    gy = rng.standard_normal(x.shape).astype(x.dtype)
    _, mean, rstd = ln.layer_norm(x, return_stats=True, **spec)
    gx, gw, gb = ln.layer_norm_backward(gy, x, mean, rstd, **spec)
    # From the statistics the backward is given: with two elements near -50 of nearly
    # equal value, grad_x from exact statistics differs by up to 0.2 (float32 mean and
    # rstd), while the kernel's own error stays near 1e-5 (see the reference).
    keep = tuple(1 if i in axes else s for i, s in enumerate(x.shape))
    gx_ref, gw_ref, gb_ref = reference.layer_norm_backward(
        gy, x, axes, mean=np.reshape(mean, keep), rstd=np.reshape(rstd, keep))
    tol = 1e-9 if dtype == "float64" else 2e-4
    np.testing.assert_allclose(gx, gx_ref.astype(np.float64), atol=tol * 10)
    np.testing.assert_allclose(gw, gw_ref.astype(np.float64), atol=tol * 100, rtol=1e-4)
    np.testing.assert_allclose(gb, gb_ref.astype(np.float64), atol=tol * 100, rtol=1e-4)
