"""The Numba kernels under their environment: the disk cache's key and location, a
read-only install without a cache location, and Numba's debugging mode."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np

import layernorm as ln
from layernorm._backends import _numba as backend
from layernorm._backends._numba import diskcache

TESTS = pathlib.Path(__file__).parent


def _salt(directory):
    return diskcache.source_salt.__wrapped__(str(directory))  # not the memoized value


def test_the_cache_salt_changes_with_every_kernel_source(tmp_path):
    """Numba checks only a kernel's own file; the salt covers every file it inlines."""
    package = tmp_path / "_numba"
    shutil.copytree(diskcache.PACKAGE_DIR, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    sources = sorted(package.glob("*.py"))
    assert {p.name for p in sources} >= {"_simd.py", "_scalars.py", "rowmath.py",
                                         "forward_rows.py", "kernels.py"}
    original = _salt(package)
    assert original == _salt(diskcache.PACKAGE_DIR) == diskcache.source_salt()
    seen = {original}
    for path in sources:
        text = path.read_bytes()
        path.write_bytes(text + b"\n# an edit\n")
        seen.add(_salt(package))
        path.write_bytes(text)
    assert len(seen) == len(sources) + 1  # each edit gives its own salt
    (package / "new_helpers.py").write_text("X = 1\n")
    assert _salt(package) not in seen
    (package / "new_helpers.py").unlink()
    assert _salt(package) == original
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "stale.py").write_text("ignored")
    assert _salt(package) == original  # compiled files are not sources


def test_kernel_cache_files_land_under_the_salted_directory():
    x = np.linspace(-1.0, 2.0, 4 * 33, dtype=np.float32).reshape(4, 33)
    _, mean, rstd = ln.layer_norm(x, 33, return_stats=True)
    ln.layer_norm_backward(np.ones_like(x), x, mean, rstd, None, 33)
    kernels = backend.load_kernels()
    salted = diskcache.SALT_PREFIX + diskcache.source_salt()
    for name in kernels.__all__:
        kernel = getattr(kernels, name)
        if hasattr(kernel, "overloads"):  # a jitted kernel (merge_table is host code)
            assert os.path.basename(kernel._cache.cache_path) == salted, name
    for kernel in (kernels.ln_short_forward_serial, kernels.ln_short_backward_serial):
        files = os.listdir(kernel._cache.cache_path)
        stem = f"{kernel.py_func.__module__.rsplit('.', 1)[1]}.{kernel.py_func.__name__}-"
        assert any(f.startswith(stem) and f.endswith(".nbi") for f in files), (stem, files)
        assert any(f.startswith(stem) and f.endswith(".nbc") for f in files), (stem, files)


_READ_ONLY = textwrap.dedent(
    """
    import sys
    import numpy as np
    import numba
    from numba.core import caching

    def unwritable(self):
        raise PermissionError(13, "Read-only file system", self.get_cache_path())

    # What a read-only install without NUMBA_CACHE_DIR and without a writable home
    # gives every locator: no cache directory can be made writable.
    caching._CacheLocator.ensure_cache_path = unwritable
    try:
        numba.njit(cache=True)(lambda a: a + 1)
    except RuntimeError as exc:
        assert "no locator available" in str(exc), exc
    else:
        raise AssertionError("the simulation does not reproduce Numba's error")

    sys.path.insert(0, sys.argv[1])
    import reference
    import layernorm as ln
    from layernorm._backends import _numba as backend

    rng = np.random.default_rng(5)
    x = (3.0 + rng.standard_normal((6, 40))).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    gy = rng.standard_normal((6, 40)).astype(np.float32)
    y, mean, rstd = ln.layer_norm(x, 40, w, return_stats=True)
    np.testing.assert_allclose(y, reference.layer_norm(x, (1,), w)[0], atol=2e-5)
    grads = ln.layer_norm_backward(gy, x, mean, rstd, w, 40)
    for got, want in zip(grads, reference.layer_norm_backward(gy, x, (1,), w)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ln.rms_norm(x, 40, w), reference.rms_norm(x, (1,), w)[0],
                               atol=2e-5)
    kernels = backend.load_kernels()
    # Rows of 40: the short-row kernels.
    for kernel in (kernels.ln_short_forward_serial, kernels.ln_short_backward_serial,
                   kernels.rms_short_forward_serial):
        assert kernel.overloads, "the kernel ran compiled"
        assert type(kernel._cache).__name__ == "NullCache", kernel._cache
    print("ok")
    """
)


def test_without_a_writable_cache_location_the_kernels_compile_in_memory():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    proc = subprocess.run([sys.executable, "-c", _READ_ONLY, str(TESTS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok"]


_NO_ALLOCATIONS = textwrap.dedent(
    """
    import numpy as np
    import layernorm as ln
    from layernorm._backends._numba import forward_rows

    rng = np.random.default_rng(7)
    short = rng.standard_normal((40, 64)).astype(np.float32)
    ln.layer_norm(short)
    ln.rms_norm(short)
    long = rng.standard_normal((4, 4096)).astype(np.float32)  # tiled rows
    ln.layer_norm(long)
    ln.rms_norm(long)
    for loop in (forward_rows.ln_short_rows, forward_rows.ln_tiled_rows,
                 forward_rows.rms_short_rows, forward_rows.rms_tiled_rows):
        irs = loop.inspect_llvm()
        assert irs, loop
        for ir in irs.values():
            assert "NRT_MemInfo_alloc" not in ir, loop
    print("ok")
    """
)


def test_short_and_tiled_row_loops_allocate_no_arrays(tmp_path):
    """The short-row paths' and the tiled rows' scratch blocks live on the stack
    (``_simd.scratch_block``): their row loops compile no NumPy allocation (``np.empty``,
    ``np.full``, ``np.zeros`` cost a cold first call about a quarter of a second).
    Compiled with an empty cache: a kernel loaded from the cache compiles no helper."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _NO_ALLOCATIONS], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok"]


_NO_JIT = textwrap.dedent(
    """
    import sys
    import types
    import numpy as np

    sys.path.insert(0, sys.argv[1])
    import reference
    import layernorm as ln
    from layernorm._backends import _numba as backend

    rng = np.random.default_rng(6)
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        # Rows (LayerNorm's short-row path and the long-row path) and channels-first.
        for shape, axes in (((5, 20), (1,)), ((1, 20), (1,)), ((3, 150), (1,)),
                            ((2, 6, 3), (1,))):
            n = shape[1]
            x = (4.0 + rng.standard_normal(shape)).astype(dtype)
            w, b = (rng.standard_normal(n).astype(dtype) for _ in range(2))
            gy = rng.standard_normal(shape).astype(dtype)
            y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, axis=1, return_stats=True)
            np.testing.assert_allclose(y, reference.layer_norm(x, axes, w, b)[0],
                                       rtol=tol, atol=tol)
            np.testing.assert_allclose(ln.rms_norm(x, weight=w, axis=1),
                                       reference.rms_norm(x, axes, w)[0], rtol=tol, atol=tol)
            grads = ln.layer_norm_backward(gy, x, mean, rstd, w, axis=1)
            want = reference.layer_norm_backward(gy, x, axes, w)
            for got, expected in zip(grads, want):
                np.testing.assert_allclose(got, expected, rtol=20 * tol, atol=20 * tol)
    # The quantizing kernels (their SIMD stand-ins) against the engine's composition.
    from layernorm import _engine
    for fmt in ("int8", "float8_e4m3fn", "float8_e5m2"):
        x = (rng.standard_normal((3, 37)) * 2).astype(np.float32)
        q, _h, s = ln.add_rms_norm(x, x, quantize=fmt)
        want_q, want_s = _engine.quantize_rows(np, ln.rms_norm(x + x), (1,), fmt, None,
                                               "float32")
        assert q.dtype == want_q.dtype
        np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8))
        np.testing.assert_array_equal(s, want_s)
        # LayerNorm: short rows (scales of sixteen rows at once) and long ones.
        for shape in ((3, 37), (1, 20), (4, 300)):
            x = (rng.standard_normal(shape) * 2).astype(np.float32)
            q, s = ln.layer_norm(x, quantize=fmt)
            want_q, want_s = _engine.quantize_rows(np, ln.layer_norm(x), (1,), fmt, None,
                                                   "float32")
            np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8))
            np.testing.assert_array_equal(s, want_s)
    # Really Python: the kernels are plain functions, not dispatchers.
    assert isinstance(backend.load_kernels().ln_forward_serial, types.FunctionType)
    print("ok")
    """
)


def test_numba_disable_jit_runs_the_kernels_as_python():
    """Numba's debugging mode: the kernels run as Python (slowly) and stay correct."""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    proc = subprocess.run([sys.executable, "-c", _NO_JIT, str(TESTS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok"]


def test_kernels_compile_at_their_opt_level_and_numba_keeps_its_own(monkeypatch):
    """A kernel's compilation runs at KERNEL_OPT; Numba's level is restored after it, so
    the user's own jitted functions keep theirs."""
    import numba
    from numba.core import codegen, config

    from layernorm._backends._numba import optlevel

    monkeypatch.delenv("NUMBA_OPT", raising=False)
    levels = []
    real = codegen.CPUCodegen._pass_builder

    def spy(self, **kwargs):
        levels.append(int(kwargs.get("opt", config.OPT)))
        return real(self, **kwargs)

    monkeypatch.setattr(codegen.CPUCodegen, "_pass_builder", spy)
    before = config.OPT
    kernel = optlevel.at_kernel_opt_level(numba.njit(lambda a: a * 3.0 + 1.0))
    assert kernel(2.0) == 7.0
    assert optlevel.KERNEL_OPT in levels and max(levels) == optlevel.KERNEL_OPT
    assert config.OPT == before
    levels.clear()
    user = numba.njit(lambda a: a * 5.0)
    assert user(2.0) == 10.0
    assert int(before) in levels  # not lowered for a function of the user's


def test_a_level_the_user_chose_is_left_alone(monkeypatch):
    import numba

    from layernorm._backends._numba import optlevel

    monkeypatch.setenv("NUMBA_OPT", "3")
    kernel = numba.njit(lambda a: a + 1.0)
    assert optlevel.at_kernel_opt_level(kernel) is kernel
    assert "compile" not in vars(kernel)


_BITS = textwrap.dedent(
    """
    import sys
    import numpy as np
    import layernorm as ln

    rng = np.random.default_rng(8)
    out = []
    for shape in ((37, 64), (9, 300), (5, 1000)):
        x = (1e4 + rng.standard_normal(shape)).astype(np.float32)
        w, b = (rng.standard_normal(shape[1]).astype(np.float32) for _ in range(2))
        y, mean, rstd = ln.layer_norm(x, weight=w, bias=b, return_stats=True)
        gy = rng.standard_normal(shape).astype(np.float32)
        grads = ln.layer_norm_backward(gy, x, mean, rstd, w)
        out += [y, mean, rstd, *grads, ln.rms_norm(x, weight=w)]
    np.save(sys.argv[1], np.concatenate([a.ravel().view(np.uint32) for a in out]))
    """
)


def test_results_do_not_depend_on_the_opt_level(tmp_path):
    """The kernels give the same bits compiled at Numba's default level 3 (NUMBA_OPT=3,
    each run with an empty cache of its own) as at KERNEL_OPT."""
    bits = []
    for level in (None, "3"):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / f"cache-{level}"))
        env.pop("NUMBA_OPT", None)
        if level is not None:
            env["NUMBA_OPT"] = level
        path = tmp_path / f"bits-{level}.npy"
        proc = subprocess.run([sys.executable, "-c", _BITS, str(path)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        bits.append(np.load(path))
    assert bits[0].size > 10_000
    np.testing.assert_array_equal(bits[0], bits[1])
