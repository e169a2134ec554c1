"""Kernel selection and launch: which template instantiation, with which grid, on which device.

The CUDA source (``kernels/layernorm.cu``) is read once with :mod:`importlib.resources`
and compiled lazily by :class:`cupy.RawModule`, one module per device and kernel
instantiation, so a first call compiles only what it runs (CuPy keeps the compiled
binaries in its on-disk cache). Only the supported ``(T, Acc)`` pairs are instantiated:
``(__half, float)``, ``(__nv_bfloat16, float)``, ``(float, float)`` and
``(double, double)``.

The configuration of a kernel (threads per row ``G`` and vectors per thread and tile
``MAXC``) is a function of the row length and the element size only, never of the
number of rows or of the memory layout, so every row's arithmetic is the same
whatever batch it comes in (see the comment at the top of the CUDA source).

Nothing here imports CuPy at import time.
"""

from __future__ import annotations

import functools
import importlib.resources
from typing import Any, NamedTuple

import numpy as np

from ..._dtypes import ACCUMULATION, CPP_TYPES

#: Extra NVRTC options. ``--fmad=false`` keeps every rounding step as written, so two
#: kernels that compute the same row give the same bits. Approximate (2 ulp, inline)
#: float division and square root keep subroutine calls, whose register saves spill to
#: local memory, out of the kernels; they are as deterministic as the exact ones.
OPTIONS: tuple[str, ...] = ("--std=c++17", "--fmad=false", "--prec-div=false",
                             "--prec-sqrt=false")

#: Rows per block of the parameter-gradient reduction (fixed: bitwise reproducible).
GRAD_ROW_BLOCK = 64

#: Threads per block of the elementwise-style kernels (parameter gradients, sums).
FLAT_THREADS = 256

#: Rows handled by one block of the strided ("cols") kernels, and the most threads
#: that share one row there (``COL_MAX_RY`` in the CUDA source).
COL_ROWS = 32
COL_MAX_RY = 8

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

#: Every (G, MAXC) configuration :func:`row_config` can return.
CONFIGS: tuple[tuple[int, int], ...] = (
    (1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (32, 1),
    (32, 2), (32, 4),
    (128, 2), (128, 4), (256, 4), (512, 4),
)


class Config(NamedTuple):
    """Threads per row, vectors per thread and tile, and the row kernels' block size."""

    g: int
    maxc: int
    threads: int


def vector_width(dtype: str) -> int:
    """Elements per 16-byte vector.

    Examples
    --------
    >>> vector_width("float16"), vector_width("float32"), vector_width("float64")
    (8, 4, 2)
    """
    return 16 // ITEMSIZE[dtype]


def row_config(n: int, dtype: str) -> Config:
    """Kernel configuration for rows of ``n`` elements of ``dtype``.

    Short rows get a few lanes of a warp (several rows per warp), medium rows a warp
    with the row in registers, long rows a block (up to 512 threads) with the row in
    registers, and rows longer than one block tile (2048 vectors: 8192 float32) loop
    over tiles, re-reading the row for the output pass (no length limit).

    Examples
    --------
    >>> row_config(64, "float32")
    Config(g=16, maxc=1, threads=128)
    >>> row_config(512, "float32")
    Config(g=32, maxc=4, threads=128)
    >>> row_config(4096, "float32")
    Config(g=256, maxc=4, threads=256)
    >>> row_config(65536, "float16")
    Config(g=512, maxc=4, threads=512)
    """
    v = max(1, -(-n // vector_width(dtype)))
    if v <= 32:
        g = 1
        while g < v:
            g *= 2
        return Config(g, 1, 128)
    if v <= 128:
        return Config(32, 2 if v <= 64 else 4, 128)
    b = 128
    while b * 4 < v and b < 512:
        b *= 2
    return Config(b, 2 if v <= 2 * b else 4, b)


def _cpp(dtype: str) -> tuple[str, str]:
    return CPP_TYPES[dtype], CPP_TYPES[ACCUMULATION[dtype]]


def expression(kind: str, dtype: str, cfg: tuple[int, int] | None = None,
               rms: bool = False) -> str:
    """C++ name expression of one kernel instantiation.

    Examples
    --------
    >>> expression("fwd_rows", "float16", (32, 8), rms=False)
    'lnk::fwd_rows<__half, float, 32, 8, false>'
    >>> expression("fwd_cols", "float32", rms=True)
    'lnk::fwd_cols<float, float, true>'
    >>> expression("sum_partials", "float64")
    'lnk::sum_partials<double>'
    """
    t, a = _cpp(dtype)
    flag = "true" if rms else "false"
    if kind == "sum_partials":
        return f"lnk::sum_partials<{a}>"
    if kind in ("param_partials", "fwd_cols", "bwd_cols"):
        return f"lnk::{kind}<{t}, {a}, {flag}>"
    assert cfg is not None
    return f"lnk::{kind}<{t}, {a}, {cfg[0]}, {cfg[1]}, {flag}>"


def all_expressions(dtype: str) -> list[str]:
    """Every kernel instantiation for one element dtype (used by the compile tests)."""
    out = [expression(kind, dtype, cfg, rms)
           for kind in ("fwd_rows", "bwd_rows") for cfg in CONFIGS for rms in (False, True)]
    out += [expression(kind, dtype, rms=rms)
            for kind in ("fwd_cols", "bwd_cols", "param_partials") for rms in (False, True)]
    if dtype in ("float32", "float64"):
        out.append(expression("sum_partials", dtype))
    return out


@functools.cache
def source() -> str:
    """The CUDA source shipped with the package."""
    return (importlib.resources.files(__package__) / "kernels" / "layernorm.cu").read_text(
        encoding="utf-8")


def cuda_include_dirs() -> list[str]:
    """Folders holding ``cuda_fp16.h`` (CUDA_PATH, CUDA_HOME, next to nvcc, the wheels).

    CuPy normally finds the CUDA headers itself; these are the fallback when it does not
    (and what the compile tests use with NVRTC directly).
    """
    import os
    import shutil
    import sys

    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    found = []
    for root in roots:
        if root:
            found.append(os.path.join(root, "include"))
    for entry in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            found.append(os.path.join(entry, sub))
    seen = []
    for folder in found:
        if os.path.isfile(os.path.join(folder, "cuda_fp16.h")) and folder not in seen:
            seen.append(folder)
    return seen


@functools.cache
def _kernel(device_id: int, expr: str) -> Any:
    import cupy

    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=source(), options=OPTIONS, name_expressions=[expr])
        try:
            return module.get_function(expr)
        except cupy.cuda.compiler.CompileException as exc:
            # CuPy did not find the CUDA headers (e.g. only the NVRTC wheel is installed):
            # retry with the toolkit's include folder if there is one.
            dirs = cuda_include_dirs()
            if "cuda_fp16.h" not in str(exc) or not dirs:
                raise
        module = cupy.RawModule(code=source(), options=(*OPTIONS, f"-I{dirs[0]}"),
                                name_expressions=[expr])
        return module.get_function(expr)


@functools.cache
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _grid(device_id: int, units: int, per_block: int, threads: int) -> int:
    # Grid-stride loops: any grid gives the same bits, so cap it at a few waves.
    cap = _sm_count(device_id) * max(1, 2048 // threads) * 4
    return max(1, min(-(-units // per_block), cap))


def _strides(arr: Any) -> tuple[int, int, int]:
    size = arr.itemsize
    s0, s1, s2 = (int(s) // size for s in arr.strides)
    return s0, s1, s2


def _aligned(arr: Any, vec: int) -> bool:
    outer, n, inner = arr.shape
    s0, s1, s2 = _strides(arr)
    return (
        arr.data.ptr % 16 == 0
        and (n == 1 or s1 == 1)
        and (outer == 1 or s0 % vec == 0)
        and (inner == 1 or s2 % vec == 0)
    )


def _family(x3: Any) -> str:
    """"rows" when the normalized axis is contiguous, else the strided "cols" kernels."""
    n = x3.shape[1]
    return "rows" if n == 1 or _strides(x3)[1] == 1 else "cols"


def _scalar(value: float, dtype: str) -> Any:
    return np.float64(value) if ACCUMULATION[dtype] == "float64" else np.float32(value)


def _ptr_or_null(arr: Any) -> Any:
    return np.uint64(0) if arr is None else arr


def _i64(*values: int) -> tuple[Any, ...]:
    return tuple(np.int64(v) for v in values)


def _launch(kind: str, dtype: str, rms: bool, n: int, rows: int, device_id: int,
            args: tuple[Any, ...], arrays: tuple[Any, ...]) -> None:
    """Launch the "rows" or "cols" variant of ``kind`` ("fwd" or "bwd") for these arrays.

    ``args`` are the kernel arguments up to and including ``inner`` and ``inv_inner``
    followed by the strides; ``arrays`` are the 3-D views whose alignment decides
    between 16-byte and scalar accesses (which never changes the result).
    """
    cfg = row_config(n, dtype)
    # The layout of x decides: arrays is (x3, y3) forward and (gy3, x3, gx3) backward.
    family = _family(arrays[1] if kind == "bwd" else arrays[0])
    kernel = _kernel(device_id, expression(f"{kind}_{family}", dtype, cfg[:2], rms))
    if family == "rows":
        vec = vector_width(dtype)
        vec_ok = all(_aligned(a, vec) for a in arrays)
        per_block = 1 if cfg.g > 32 else cfg.threads // cfg.g
        grid = _grid(device_id, rows, per_block, cfg.threads)
        kernel((grid,), (cfg.threads,), (*args, np.int32(1 if vec_ok else 0)))
    else:
        ry = min(cfg.g, COL_MAX_RY)
        tile = cfg.g * cfg.maxc * vector_width(dtype)
        tiles = -(-n // tile)
        grid = _grid(device_id, rows, COL_ROWS, COL_ROWS * ry)
        kernel((grid,), (COL_ROWS, ry),
               (*args, np.int32(cfg.g), np.int32(cfg.maxc), np.int64(tiles)))


def forward(x3: Any, weight: Any, bias: Any, eps: float, y3: Any, mean: Any, rstd: Any,
            dtype: str, rms: bool) -> None:
    """Launch the forward kernel for ``x3`` (``(outer, n, inner)``) into ``y3``."""
    import cupy

    outer, n, inner = x3.shape
    rows = outer * inner
    if rows == 0 or n == 0:
        return
    device_id = x3.device.id
    with cupy.cuda.Device(device_id):
        inv_n = _scalar(1.0, dtype) / _scalar(n, dtype)  # IEEE, as the kernels would
        args = (x3, y3, _ptr_or_null(weight), _ptr_or_null(bias), _scalar(eps, dtype), inv_n,
                _ptr_or_null(mean), rstd, *_i64(rows, n, inner), np.float64(1.0 / inner),
                *_i64(*_strides(x3), *_strides(y3)))
        _launch("fwd", dtype, rms, n, rows, device_id, args, (x3, y3))


def backward(gy3: Any, x3: Any, mean: Any, rstd: Any, weight: Any, gx3: Any, dtype: str,
             rms: bool) -> tuple[Any, Any]:
    """Launch grad_x and the parameter-gradient reduction; return (grad_w, grad_b or None)."""
    import cupy

    outer, n, inner = x3.shape
    rows = outer * inner
    acc = ACCUMULATION[dtype]
    device_id = x3.device.id
    count = 1 if rms else 2
    with cupy.cuda.Device(device_id):
        if rows == 0 or n == 0:
            sums = cupy.zeros((count, n), dtype=acc)
            return sums[0], (None if rms else sums[1])
        inv_inner = np.float64(1.0 / inner)
        inv_n = _scalar(1.0, dtype) / _scalar(n, dtype)
        args = (gy3, x3, _ptr_or_null(mean), rstd, _ptr_or_null(weight), gx3, inv_n,
                *_i64(rows, n, inner), inv_inner,
                *_i64(*_strides(gy3), *_strides(x3), *_strides(gx3)))
        _launch("bwd", dtype, rms, n, rows, device_id, args, (gy3, x3, gx3))

        blocks = -(-rows // GRAD_ROW_BLOCK)
        part = cupy.empty((count, blocks, n), dtype=acc)
        pkernel = _kernel(device_id, expression("param_partials", dtype, rms=rms))
        grid = _grid(device_id, blocks * n, FLAT_THREADS, FLAT_THREADS)
        pkernel((grid,), (FLAT_THREADS,),
                (gy3, x3, _ptr_or_null(mean), rstd, part, *_i64(rows, n, inner), inv_inner,
                 *_i64(*_strides(gy3), *_strides(x3), GRAD_ROW_BLOCK, blocks),
                 np.float64(1.0 / n)))
        sums = cupy.empty((count, n), dtype=acc)
        skernel = _kernel(device_id, expression("sum_partials", acc))
        grid = _grid(device_id, count * n, FLAT_THREADS, FLAT_THREADS)
        skernel((grid,), (FLAT_THREADS,),
                (part, sums, *_i64(count, blocks, n), np.float64(1.0 / n)))
        return sums[0], (None if rms else sums[1])
