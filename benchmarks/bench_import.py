"""Start-up costs, each in a fresh interpreter: import, and the first call's compile.

``cold``: ``NUMBA_CACHE_DIR`` points at a new empty directory, so the first call
compiles its kernels. ``warm``: it points at a directory this benchmark filled
beforehand, so the first call only loads them. Shapes pick the serial kernel
(one row) or the parallel one (large enough to use threads).
"""

# asv reads params and param_names as plain class-level lists.
# ruff: noqa: RUF012

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

_CALL = """
import numpy as np
import layernorm as ln
x = np.random.default_rng(0).standard_normal(({n}, 768), dtype=np.float32)
"""

_ROWS = {"1x768": 1, "4096x768": 4096}


def _warm_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "layernorm-asv-warm-numba-cache")


class Import:
    """``import layernorm`` in a fresh interpreter (NumPy already imported)."""

    def timeraw_import_layernorm(self) -> tuple[str, str]:
        return "import layernorm", "import numpy"


class FirstCall:
    """Import plus first forward call, with a cold or a warm Numba cache."""

    params = [["cold", "warm"], ["1x768", "4096x768"]]
    param_names = ["cache", "shape"]
    number = 1
    repeat = (1, 3, 60.0)
    timeout = 180

    def setup(self, cache: str, shape: str) -> None:
        if cache == "warm":
            # Fill the persistent cache directory once, in a subprocess.
            env = dict(os.environ, NUMBA_CACHE_DIR=_warm_cache_dir())
            code = _CALL.format(n=_ROWS[shape]) + "ln.layer_norm(x)\n"
            subprocess.run([sys.executable, "-c", code], env=env, check=True)

    def timeraw_first_call(self, cache: str, shape: str) -> tuple[str, str]:
        if cache == "cold":
            # A new empty folder in every process asv starts (each repeat is cold too),
            # removed when that process exits.
            setup = ("import atexit, os, shutil, tempfile\n"
                     "cache_dir = tempfile.mkdtemp(prefix='layernorm-asv-cold-')\n"
                     "atexit.register(shutil.rmtree, cache_dir, True)\n")
        else:
            setup = f"import os\ncache_dir = {_warm_cache_dir()!r}\n"
        setup += "os.environ['NUMBA_CACHE_DIR'] = cache_dir\n"
        setup += _CALL.format(n=_ROWS[shape]).replace("import layernorm as ln\n", "")
        return "import layernorm as ln\nln.layer_norm(x)", setup
