"""Forward LayerNorm/RMSNorm against the float64 reference and against PyTorch."""

from __future__ import annotations

import numpy as np

import layernorm as ln

from .conftest import ATOL, DTYPES, random_rows, to_numpy


def _params(rng, shape, dtype="float32"):
    w = (1.0 + 0.5 * rng.standard_normal(shape)).astype(DTYPES[dtype])
    b = (0.3 * rng.standard_normal(shape)).astype(DTYPES[dtype])
    return w, b


def test_strided_layouts_match_contiguous(native_xp):
    rng = np.random.default_rng(11)
    base = random_rows(rng, (9, 300), "float32")
    views = {
        "reversed rows": base[::-1],
        "negative stride": base[:, ::-1],
        "every other": base[:, ::2],
        "fortran": np.asfortranarray(base),
        "transposed": np.ascontiguousarray(base.T).T,
        "misaligned": base[:, 1:],
    }
    for name, v in views.items():
        x = native_xp.asarray(v) if native_xp is not np else v
        got = to_numpy(ln.layer_norm(x))
        # The same backend on a contiguous copy (backends need not agree bit for bit).
        want = to_numpy(ln.layer_norm(native_xp.asarray(np.ascontiguousarray(v))))
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_output_is_new_c_contiguous_and_input_unchanged():
    rng = np.random.default_rng(2)
    x = np.asfortranarray(random_rows(rng, (6, 33), "float32"))
    before = x.copy()
    y = ln.layer_norm(x)
    assert y.flags.c_contiguous and not np.shares_memory(x, y)
    np.testing.assert_array_equal(x, before)
    y2 = ln.layer_norm(x, axis=0)
    assert y2.flags.c_contiguous and y2.shape == x.shape


def test_statistics_are_c_contiguous_on_both_numpy_paths():
    """Outputs are new C-contiguous arrays on the generic path too, statistics
    included: elementwise operations and reductions keep a Fortran x's layout."""
    rng = np.random.default_rng(3)
    x = np.asfortranarray(random_rows(rng, (6, 5, 8), "float32"))
    for backend in ("numba", "array_api"):
        for out in (ln.layer_norm(x, return_stats=True, backend=backend),
                    ln.rms_norm(x, return_stats=True, backend=backend),
                    ln.layer_norm(x, return_stats=True, backend=backend, quantize="int8"),
                    ln.add_rms_norm(x, x, return_stats=True, backend=backend)):
            assert all(a.flags.c_contiguous for a in out), (backend, [a.flags for a in out])
    kernel, generic = (ln.layer_norm(x, return_stats=True, backend=b)
                       for b in ("numba", "array_api"))
    for a, b in zip(kernel, generic, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)


def test_out_and_in_place():
    rng = np.random.default_rng(7)
    x = random_rows(rng, (8, 200), "float32")
    w, b = _params(rng, (200,))
    want = ln.layer_norm(x, weight=w, bias=b)
    out = np.empty_like(x)
    got = ln.layer_norm(x, weight=w, bias=b, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)
    x2 = x.copy()
    assert ln.layer_norm(x2, weight=w, bias=b, out=x2) is x2
    np.testing.assert_array_equal(x2, want)
    img = random_rows(rng, (2, 8, 5, 5), "float32")
    want_img = ln.layer_norm(img, axis=1)
    fortran_out = np.asfortranarray(np.empty_like(img))
    ln.layer_norm(img, axis=1, out=fortran_out)
    np.testing.assert_array_equal(fortran_out, want_img)
    ln.layer_norm(img, axis=1, out=img)
    np.testing.assert_array_equal(img, want_img)
    r = random_rows(rng, (3, 40), "float64")
    want_r = ln.rms_norm(r)
    ln.rms_norm(r, out=r)
    np.testing.assert_array_equal(r, want_r)


def test_array_api_backend_agrees_with_numba(dtype_name):
    rng = np.random.default_rng(4)
    x = random_rows(rng, (7, 3, 50), dtype_name, loc=3.0)
    w, b = _params(rng, (3, 50))
    for axis in (-1, 1, (1, 2)):
        pw = w if axis == (1, 2) else (w[0] if axis == -1 else w[:, 0])
        pb = b if axis == (1, 2) else (b[0] if axis == -1 else b[:, 0])
        fast = ln.layer_norm(x, weight=pw, bias=pb, axis=axis)
        generic = ln.layer_norm(x, weight=pw, bias=pb, axis=axis, backend="array_api")
        np.testing.assert_allclose(to_numpy(fast), to_numpy(generic), rtol=0,
                                   atol=2 * ATOL[dtype_name])


