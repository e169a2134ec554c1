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
