"""Importing layernorm is cheap: no optional library, no Numba, no compilation."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import layernorm
    elapsed = time.perf_counter() - t0
    heavy = [m for m in ("numba", "llvmlite", "torch", "cupy", "dask", "jax", "array_api_strict",
                         "matplotlib", "ml_dtypes") if m in sys.modules]
    print(json.dumps({"heavy": heavy, "elapsed": elapsed, "all": layernorm.__all__}))
    """
)


def test_import_loads_no_optional_library_and_compiles_nothing():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          check=True, timeout=120)
    info = json.loads(proc.stdout)
    # numba not imported means nothing can have been compiled.
    assert info["heavy"] == []
    assert set(info["all"]) >= {"layer_norm", "layer_norm_backward", "rms_norm",
                                "rms_norm_backward", "backend_name", "LayerNorm", "RMSNorm"}


def test_backend_names():
    import numpy as np

    import layernorm as ln

    assert ln.backend_name(np.ones(3, np.float32)) == "numba"
    import array_api_strict as xps

    assert ln.backend_name(xps.ones(3)) == "array_api"


_WARM_PROBE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import layernorm as ln
    from layernorm._backends import _numba as backend

    kernels = backend.load_kernels()
    refreshed = []
    context = kernels.ln_forward_serial.targetctx
    original = context.refresh

    def refresh():
        refreshed.append(True)
        original()

    context.refresh = refresh
    x, w, b, gy = (np.load(sys.argv[1] + f"/{name}.npy") for name in ("x", "w", "b", "gy"))
    y, mean, rstd = ln.layer_norm(x, w.shape, w, b, return_stats=True)
    grads = ln.layer_norm_backward(gy, x, mean, rstd, w, w.shape)
    for name, value in zip(("y", "gx", "gw", "gb"), (y, *grads)):
        np.save(sys.argv[1] + f"/out_{name}.npy", value)
    print(len(refreshed))
    """
)


def test_first_call_with_a_warm_cache_loads_kernels_without_refreshing_numba(tmp_path):
    """A cached kernel is loaded without Numba's registry refresh (a quarter second of
    imports) and runs the same machine code: same bits as this process's results."""
    import numpy as np

    import layernorm as ln

    rng = np.random.default_rng(11)
    x = (2.0 + rng.standard_normal((6, 300))).astype(np.float32)
    w, b, gy = (rng.standard_normal(300).astype(np.float32),
                rng.standard_normal(300).astype(np.float32),
                rng.standard_normal((6, 300)).astype(np.float32))
    y, mean, rstd = ln.layer_norm(x, 300, w, b, return_stats=True)  # fills the disk cache
    grads = ln.layer_norm_backward(gy, x, mean, rstd, w, 300)
    for name, value in (("x", x), ("w", w), ("b", b), ("gy", gy)):
        np.save(tmp_path / f"{name}.npy", value)
    proc = subprocess.run([sys.executable, "-c", _WARM_PROBE, str(tmp_path)],
                          capture_output=True, text=True, check=True, timeout=300)
    assert proc.stdout.split() == ["0"]
    for name, expected in zip(("y", "gx", "gw", "gb"), (y, *grads), strict=True):
        assert np.load(tmp_path / f"out_{name}.npy").tobytes() == expected.tobytes()


def test_kernel_not_in_the_cache_or_unknown_internals_take_the_public_path(monkeypatch):
    import numpy as np
    from numba import types

    import layernorm as ln
    from layernorm import _fast
    from layernorm._backends import _numba as backend
    from layernorm._backends._numba import entry

    kernels = backend.load_kernels()
    kernel = kernels.rms_forward_serial
    # A signature never compiled (int8 data): not in the cache, and nothing compiled.
    array = types.Array(types.int8, 2, "A", readonly=True)
    sig = (array, array, types.float32, types.Array(types.int8, 2, "A"),
           types.Array(types.float32, 1, "A"), types.boolean)
    before = len(kernel.overloads)
    assert entry._load_cached(kernel, sig) is None
    assert len(kernel.overloads) == before

    attempts = []

    def broken(kernel, sig):
        attempts.append(kernel)
        raise AttributeError("internals of another Numba")

    monkeypatch.setattr(entry, "_load_cached", broken)
    monkeypatch.setattr(entry, "entry_points", {})
    monkeypatch.setattr(_fast, "_PLANS", {})
    rng = np.random.default_rng(12)
    x = (1.0 + rng.standard_normal((3, 40))).astype(np.float32)
    y = ln.rms_norm(x, 40)
    assert attempts
    ss = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    np.testing.assert_allclose(y, x / np.sqrt(ss + np.finfo(np.float32).eps), rtol=2e-6)


_FORWARD_ONLY_PROBE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import layernorm as ln

    x = np.arange(24, dtype=np.float32).reshape(3, 8) % 5
    ln.layer_norm(x)
    ln.rms_norm(x)
    prefix = "layernorm._backends._numba."
    print(json.dumps(sorted(m[len(prefix):] for m in sys.modules if m.startswith(prefix))))
    """
)


def test_a_forward_call_defines_only_the_forward_kernels():
    """The kernels module imports a kernel's module on first use: a process that only
    normalizes never defines the backward, fused, quantized or column kernels."""
    proc = subprocess.run([sys.executable, "-c", _FORWARD_ONLY_PROBE], capture_output=True,
                          text=True, check=True, timeout=300)
    loaded = set(json.loads(proc.stdout))
    assert {"kernels", "forward_rows"} <= loaded
    assert not loaded & {"backward", "fused", "quantized", "forward_cols"}


def test_every_kernel_name_resolves_from_its_module():
    from layernorm._backends import _numba as backend

    kernels = backend.load_kernels()
    assert sorted(dir(kernels)) == sorted(kernels.__all__)
    for name in kernels.__all__:
        value = getattr(kernels, name)
        assert callable(value) == name.islower(), name  # kernels and helpers; constants
    try:
        kernels.no_such_kernel  # noqa: B018
    except AttributeError as err:
        assert "no_such_kernel" in str(err)
    else:
        raise AssertionError("an unknown name resolved")
