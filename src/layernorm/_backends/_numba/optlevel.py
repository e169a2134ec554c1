"""The LLVM optimization level the kernels compile at: 2 instead of Numba's default 3.

The kernels spell out their SIMD vectors and every floating-point operation
(:mod:`._simd`), so what LLVM's level 3 adds to level 2 (more aggressive inlining, loop
unswitching, argument promotion) has little left to improve, while it costs compile
time, which a user pays on every first call (an empty cache). Measured, float32,
first ``layer_norm`` of a (64, 256) array in a fresh process with an empty cache, on a
2-core Xeon (Sapphire Rapids) VM: 2.98-3.72 s at level 3, 2.18-2.40 s at level 2 (the
first backward 1.84-2.20 s more at level 3, 1.65 s at level 2). At run time, two
``bench --quick --backward`` runs of each, as fractions of the same run's copy: the
geometric means of level 2 over level 3 were 0.98 (forward) and 0.99 (backward) from
DRAM, 0.95 and 0.94 in cache, where single cells moved by up to 35% either way between
runs of one level; interleaved processes at (2883, 64), (242, 768), (1932, 64) and
(161, 768) gave 0.92-1.07 per cell. Level 1 was slower at run time. Results do not
depend on the level: no level may reassociate, contract or otherwise change an IEEE
operation the kernels spell out (tested).

Numba reads the level from ``numba.config.OPT`` whenever it builds a pass pipeline, so
:func:`at_kernel_opt_level` sets it around a kernel's compilation only, under Numba's
global compiler lock (no other compilation, the user's own included, can run meanwhile),
and restores it. A level the user chose (``NUMBA_OPT`` in the environment) is left alone.
"""

from __future__ import annotations

import os
from typing import Any

#: LLVM optimization level of the kernels (Numba's default is 3).
KERNEL_OPT = 2


def at_kernel_opt_level(kernel: Any) -> Any:
    """Make the Numba dispatcher ``kernel`` compile at :data:`KERNEL_OPT`.

    Its ``compile`` method (through which both a first call and an explicit
    ``kernel.compile(sig)`` compile) is replaced, on this dispatcher only, by one that
    lowers ``numba.config.OPT`` while it runs. Functions the kernel calls are compiled
    within it, at the same level. Nothing changes when ``NUMBA_OPT`` is set or Numba's
    level is not its default 3.

    Parameters
    ----------
    kernel : numba.core.registry.CPUDispatcher
        A jitted function.

    Returns
    -------
    numba.core.registry.CPUDispatcher
        ``kernel`` itself.
    """
    if "NUMBA_OPT" in os.environ or not hasattr(kernel, "compile"):
        return kernel
    compile_default = kernel.compile

    def compile_at_kernel_level(sig: Any) -> Any:
        from numba.core import config
        from numba.core.compiler_lock import global_compiler_lock

        with global_compiler_lock:
            saved = config.OPT
            if saved != 3 or getattr(saved, "is_opt_max", False):
                return compile_default(sig)
            config.OPT = type(saved)(KERNEL_OPT)
            try:
                return compile_default(sig)
            finally:
                config.OPT = saved

    kernel.compile = compile_at_kernel_level
    return kernel
