"""Adversarial numerics: large offsets, constant rows, eps=0, NaN/Inf isolation."""

from __future__ import annotations

import numpy as np
import pytest

import layernorm as ln

from . import reference
from .conftest import asarray, to_numpy


@pytest.mark.parametrize("n", [64, 768, 1024, 4096])
@pytest.mark.parametrize(("loc", "scale", "bound"), [(1e4, 1.0, 1e-5), (100.0, 0.01, 1e-4)])
def test_large_common_offset_keeps_full_accuracy(native_xp, n, loc, scale, bound):
    rng = np.random.default_rng(n)
    x = (loc + scale * rng.standard_normal((64, n))).astype(np.float32)
    y = to_numpy(ln.layer_norm(asarray(native_xp, x, "float32")))
    y_ref, _, _ = reference.layer_norm(x, (1,))
    assert np.abs(y - y_ref.astype(np.float64)).max() <= bound


def test_large_offset_is_not_computed_as_e_x2_minus_e2():
    # Variance 1 under an offset of 3e4 in float32: E[x^2]-E[x]^2 would return garbage.
    rng = np.random.default_rng(0)
    x = (3e4 + rng.standard_normal((4, 2048))).astype(np.float32)
    _, _, rstd = ln.layer_norm(x, return_stats=True)
    _, _, rstd_ref = reference.layer_norm(x, (1,))
    np.testing.assert_allclose(rstd, rstd_ref.astype(np.float64), rtol=1e-5)


def test_outlier_first_element():
    # The first element is the shift; make it the farthest from the mean.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 1000)).astype(np.float32)
    x[:, 0] = 1e4
    y = ln.layer_norm(x)
    y_ref, _, _ = reference.layer_norm(x, (1,))
    np.testing.assert_allclose(y, y_ref.astype(np.float64), atol=2e-5 * np.abs(y_ref).max())


def test_rms_row_of_inf_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.array([[1.0, np.inf, 3.0], [1.0, 2.0, 3.0]], np.float32)
    np.testing.assert_array_equal(
        ln.rms_norm(x), torch.nn.functional.rms_norm(torch.from_numpy(x), (3,)).numpy())


def test_tiny_and_huge_magnitudes():
    rng = np.random.default_rng(8)
    # float32 variances must stay representable (scale**2 within float32's range).
    for scale in (1e-15, 1e-3, 1e15):
        x = (scale * rng.standard_normal((3, 500))).astype(np.float32)
        y = ln.layer_norm(x, eps=0.0)
        y_ref, _, _ = reference.layer_norm(x, (1,), eps=0.0)
        np.testing.assert_allclose(y, y_ref.astype(np.float64), atol=1e-5, err_msg=str(scale))


def test_float16_with_tiny_eps():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 768)).astype(np.float16)
    y = ln.layer_norm(x, eps=1e-12)
    y_ref, _, _ = reference.layer_norm(x, (1,), eps=1e-12)
    np.testing.assert_allclose(y.astype(np.float64), y_ref.astype(np.float64), atol=4e-3 * 4)


def test_population_variance_not_unbiased():
    x = np.array([[1.0, 3.0, 5.0, 7.0]])
    _, mean, rstd = ln.layer_norm(x, eps=0.0, return_stats=True)
    assert mean[0, 0] == 4.0
    np.testing.assert_allclose(1.0 / rstd[0, 0] ** 2, 5.0, rtol=1e-15)


def _long_rows(n: int) -> np.ndarray:
    """Float32 rows whose sums of squares are biased to round one way: a constant row
    (RMSNorm), a row of alternating signs (LayerNorm: all squared deviations equal),
    and ``1e4 + randn`` (RMSNorm's squares all near 1e8)."""
    rng = np.random.default_rng(n)
    return np.stack([
        np.full(n, 1.1),
        np.where(np.arange(n) % 2 == 0, 1.1, -1.1),
        1e4 + rng.standard_normal(n),
    ]).astype(np.float32)


@pytest.mark.parametrize("n", [(1 << 20) + 37, 1 << 20])
def test_long_rows_keep_full_accuracy(n):
    # D / 128 running float32 additions per lane lost accuracy in proportion to D:
    # 1.4e-5 relative error in the rstd of a constant row of 2**20 (2e-5 in y).
    x = _long_rows(n)
    y_ref, _, _ = reference.layer_norm(x, (1,))
    r_ref, _ = reference.rms_norm(x, (1,))
    for xv, axis in ((x, -1), (np.ascontiguousarray(x.T), 0)):  # rows and columns
        y = np.moveaxis(ln.layer_norm(xv, axis=axis), axis, -1)
        r = np.moveaxis(ln.rms_norm(xv, axis=axis), axis, -1)
        assert np.abs(y - y_ref.astype(np.float64)).max() <= 1e-6
        assert np.abs(r - r_ref.astype(np.float64)).max() <= 1e-6


def test_long_rows_bitwise_on_every_path(monkeypatch):
    # Rows long enough to close blocks of lane sums: every layout, position and thread
    # count closes them alike (the parallel kernels forced, as the default chooser runs
    # a size's first calls serially).
    numba = pytest.importorskip("numba")
    from layernorm._backends import _numba as backend
    from layernorm._backends._numba import schedule

    n = 3 * 8192 + 5
    x = _long_rows(n)
    batch = np.repeat(x, 8, axis=0)
    for norm in (ln.layer_norm, ln.rms_norm):
        y = norm(x)
        assert np.array_equal(np.stack([norm(x[i:i + 1])[0] for i in range(3)]), y)
        assert np.array_equal(norm(np.ascontiguousarray(x.T), axis=0).T, y)
        assert np.array_equal(norm(np.asfortranarray(x)), y)
        assert np.array_equal(norm(x.astype(np.float64)),
                              norm(np.ascontiguousarray(x.T.astype(np.float64)), axis=0).T)
        monkeypatch.setattr(backend, "chooser", schedule.Chooser("always"))
        before = numba.get_num_threads()
        try:
            numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
            assert np.array_equal(norm(batch)[::8], y)
        finally:
            numba.set_num_threads(before)
            monkeypatch.undo()
