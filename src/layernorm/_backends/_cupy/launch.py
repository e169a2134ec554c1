"""Kernel selection and launch: which template instantiation, with which grid, on which device.

The CUDA source (``kernels/layernorm.cu``) is read once with :mod:`importlib.resources`
and compiled lazily, one module per device and kernel instantiation, so a first call
compiles only what it runs. Only the supported ``(T, Acc)`` pairs are instantiated:
``(__half, float)``, ``(__nv_bfloat16, float)``, ``(float, float)`` and
``(double, double)``; the fused residual add (``add_fwd_rows``) only for the
``(x, residual, h)`` dtypes of :data:`ADD_DTYPES` (any other residual dtype the engine
routes here is first widened, exactly, to float32: :func:`add_operands`); the quantizing
forwards (``quant_fwd_rows``, ``quant_add_fwd_rows``: 8-bit codes, the format a run-time
argument) for float32 accumulation only (:data:`QUANT_DTYPES`,
:data:`QUANT_ADD_DTYPES`), with float32's configuration whatever x's dtype.

Compilation: NVRTC directly, then :class:`cupy.RawModule` loads the binary
---------------------------------------------------------------------------
:class:`cupy.RawModule` compiling from source appends ``-ftz=true`` after the caller's
options, and NVRTC honours the last occurrence. Flush-to-zero would turn a float32 or
bfloat16 row whose squared deviations are subnormal into ``var = 0`` (``rstd = inf``
with ``eps=0``), where the CPU backend, IEEE throughout, normalizes it. So the kernels
are compiled by :func:`compile_kernels` with exactly :func:`nvrtc_options` (IEEE
subnormals, ``--ftz=false``), through CuPy's own NVRTC binding, into a cubin (or PTX when
NVRTC does not know the device) cached on disk under :func:`cache_dir`, and loaded with
``RawModule(path=...)``. The compile tests call the same :func:`compile_kernels` through
``cuda-bindings``: same source, options, defines and name expressions.

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

#: NVRTC options besides the architecture and the defines. ``--fmad=false`` keeps every
#: rounding step as written, so two kernels that compute the same row give the same bits.
#: Approximate (2 ulp, inline) float division and square root keep subroutine calls,
#: whose register saves spill to local memory, out of the kernels; they are as
#: deterministic as the exact ones. ``--ftz=false``: IEEE subnormals (see above).
OPTIONS: tuple[str, ...] = ("--std=c++17", "--fmad=false", "--prec-div=false",
                             "--prec-sqrt=false", "--ftz=false")

#: Rows per block of the parameter-gradient reduction (fixed: bitwise reproducible).
#: (The Numba backend has its own equal constant; the two need not agree bitwise.)
GRAD_ROW_BLOCK = 64

#: Partials summed by one thread of each level of the parameter-gradient tree
#: (a power of two: the levels nest into one binary tree over the row blocks).
SUM_FAN = 16

#: Resident threads per SM the row kernels are compiled for (``__launch_bounds__``
#: minimum blocks = this / block size): at most 64 registers per thread, 50% occupancy.
THREADS_PER_SM = 1024

#: The same for the backward row kernels with two or four vectors per thread, which hold
#: dy and x: 768 threads (80 registers). (The source keeps the forward's budget for one
#: vector per thread, and 512 threads for four 16- or 64-bit vectors, which spill below
#: about 110 registers: see ``BwdPerSm`` in the CUDA source.)
BWD_THREADS_PER_SM = 768

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

#: The constants the CUDA source takes from here (``-D`` defines; it has no copies).
DEFINES: dict[str, int] = {
    "LNK_GRAD_ROW_BLOCK": GRAD_ROW_BLOCK,
    "LNK_COL_ROWS": COL_ROWS,
    "LNK_COL_MAX_RY": COL_MAX_RY,
    "LNK_SUM_FAN": SUM_FAN,
    "LNK_MAX_G": max(g for g, _ in CONFIGS),
    "LNK_THREADS_PER_SM": THREADS_PER_SM,
    "LNK_BWD_THREADS_PER_SM": BWD_THREADS_PER_SM,
}


#: The ``(x, residual, h)`` dtypes ``add_fwd_rows`` is instantiated for: for 16-bit x, a
#: residual and an h each in x's dtype or float32 (the residual stream kept in bfloat16,
#: or in float32 under 16-bit activations); float32 and float64 alone. (Other residual
#: dtypes are widened first; h is always x's dtype or the accumulation dtype.)
ADD_DTYPES: tuple[tuple[str, str, str], ...] = (
    *((x, r, h) for x in ("float16", "bfloat16") for r in (x, "float32")
      for h in (x, "float32")),
    ("float32", "float32", "float32"),
    ("float64", "float64", "float64"),
)


#: The ``(x, residual, h)`` dtypes ``quant_add_fwd_rows`` is instantiated for: those of
#: :data:`ADD_DTYPES` with float32 accumulation (quantized output is float32-only).
QUANT_ADD_DTYPES: tuple[tuple[str, str, str], ...] = tuple(
    d for d in ADD_DTYPES if d[0] != "float64")

#: Element dtypes of x ``quant_fwd_rows`` is instantiated for.
QUANT_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")

#: The run-time format code of each ``quantize=`` format (``fmt`` in the CUDA source).
QUANT_FORMATS: dict[str, int] = {"int8": 0, "float8_e4m3fn": 1, "float8_e5m2": 2}


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


def add_expression(dtypes: tuple[str, str, str], cfg: tuple[int, int],
                   rms: bool = False) -> str:
    """C++ name expression of one fused residual-add kernel (``(x, residual, h)`` dtypes).

    Examples
    --------
    >>> add_expression(("bfloat16", "float32", "float32"), (32, 2))
    'lnk::add_fwd_rows<__nv_bfloat16, float, float, float, 32, 2, false>'
    """
    tx, tr, th = (CPP_TYPES[d] for d in dtypes)
    a = CPP_TYPES[ACCUMULATION[dtypes[0]]]
    flag = "true" if rms else "false"
    return f"lnk::add_fwd_rows<{tx}, {tr}, {th}, {a}, {cfg[0]}, {cfg[1]}, {flag}>"


def quant_expression(dtype: str, cfg: tuple[int, int], rms: bool = False) -> str:
    """C++ name expression of one quantizing forward kernel (x's dtype; float32 accumulation).

    Examples
    --------
    >>> quant_expression("bfloat16", (32, 4))
    'lnk::quant_fwd_rows<__nv_bfloat16, float, 32, 4, false>'
    """
    flag = "true" if rms else "false"
    return f"lnk::quant_fwd_rows<{CPP_TYPES[dtype]}, float, {cfg[0]}, {cfg[1]}, {flag}>"


def quant_add_expression(dtypes: tuple[str, str, str], cfg: tuple[int, int],
                         rms: bool = False) -> str:
    """C++ name expression of one residual-add-and-quantize kernel (``(x, residual, h)``).

    Examples
    --------
    >>> quant_add_expression(("float16", "float16", "float32"), (4, 1), rms=True)
    'lnk::quant_add_fwd_rows<__half, __half, float, float, 4, 1, true>'
    """
    tx, tr, th = (CPP_TYPES[d] for d in dtypes)
    flag = "true" if rms else "false"
    return f"lnk::quant_add_fwd_rows<{tx}, {tr}, {th}, float, {cfg[0]}, {cfg[1]}, {flag}>"


def quant_expressions(dtype: str) -> list[str]:
    """Every quantizing kernel instantiation for one element dtype of x."""
    if dtype not in QUANT_DTYPES:
        return []
    out = [quant_expression(dtype, cfg, rms) for cfg in CONFIGS for rms in (False, True)]
    out += [quant_add_expression(dtypes, cfg, rms) for dtypes in QUANT_ADD_DTYPES
            if dtypes[0] == dtype for cfg in CONFIGS for rms in (False, True)]
    return out


def all_expressions(dtype: str) -> list[str]:
    """Every kernel instantiation for one element dtype of x (used by the compile tests)."""
    out = [expression(kind, dtype, cfg, rms)
           for kind in ("fwd_rows", "bwd_rows") for cfg in CONFIGS for rms in (False, True)]
    out += [add_expression(dtypes, cfg, rms) for dtypes in ADD_DTYPES if dtypes[0] == dtype
            for cfg in CONFIGS for rms in (False, True)]
    out += quant_expressions(dtype)
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

    CuPy's own compiles add such a folder; the backend's :func:`compile_kernels` retries
    with the first of these when NVRTC cannot find the headers by itself.
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


def nvrtc_options(arch: str) -> list[str]:
    """Every NVRTC option of one compile but the include folder.

    ``arch`` is ``"sm_90"`` (a cubin) or ``"compute_90"`` (PTX).

    Examples
    --------
    >>> opts = nvrtc_options("sm_90")
    >>> opts[0], "--ftz=false" in opts, "-DLNK_GRAD_ROW_BLOCK=64" in opts
    ('--gpu-architecture=sm_90', True, True)
    """
    return [f"--gpu-architecture={arch}", *OPTIONS,
            *(f"-D{name}={value}" for name, value in DEFINES.items())]


def missing_header(log: str) -> bool:
    """Whether an NVRTC log says a CUDA half-precision header was not found.

    Examples
    --------
    >>> missing_header('catastrophic error: cannot open source file "cuda_bf16.h"')
    True
    >>> missing_header("error: identifier x is undefined")
    False
    """
    return "cuda_fp16.h" in log or "cuda_bf16.h" in log


class Compiled(NamedTuple):
    """One NVRTC compile: success, log, lowered kernel names and the cubin or PTX."""

    ok: bool
    log: str
    lowered: dict[str, str]
    binary: bytes


class BindingsNvrtc:
    """NVRTC through ``cuda-bindings`` (``cuda.bindings.nvrtc``); used by the tests."""

    def __init__(self) -> None:
        from cuda.bindings import nvrtc

        self.nvrtc = nvrtc

    def _check(self, result: tuple[Any, ...]) -> Any:
        err, *rest = result
        if err != self.nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC call failed: {err}")
        return rest[0] if rest else None

    def compile(self, src: str, exprs: list[str], opts: list[str]) -> Compiled:
        """Compile ``src`` for the name expressions ``exprs`` with ``opts``."""
        nv = self.nvrtc
        prog = self._check(nv.nvrtcCreateProgram(src.encode(), b"layernorm.cu", 0, [], []))
        try:
            for expr in exprs:
                self._check(nv.nvrtcAddNameExpression(prog, expr.encode()))
            opts_b = [o.encode() for o in opts]
            (err,) = nv.nvrtcCompileProgram(prog, len(opts_b), opts_b)
            size = self._check(nv.nvrtcGetProgramLogSize(prog))
            buf = b" " * size
            self._check(nv.nvrtcGetProgramLog(prog, buf))
            log = buf.decode(errors="replace").rstrip("\x00 ")
            if err != nv.nvrtcResult.NVRTC_SUCCESS:
                return Compiled(False, log, {}, b"")
            lowered = {}
            for expr in exprs:
                name = self._check(nv.nvrtcGetLoweredName(prog, expr.encode()))
                lowered[expr] = name.decode() if isinstance(name, bytes) else str(name)
            cubin = any(o.startswith("--gpu-architecture=sm_") for o in opts)
            get_size, get = ((nv.nvrtcGetCUBINSize, nv.nvrtcGetCUBIN) if cubin
                             else (nv.nvrtcGetPTXSize, nv.nvrtcGetPTX))
            size = self._check(get_size(prog))
            binary = b" " * size
            self._check(get(prog, binary))
            return Compiled(True, log, lowered, binary.rstrip(b"\x00"))
        finally:
            nv.nvrtcDestroyProgram(prog)


class CupyNvrtc:
    """NVRTC through CuPy's own binding (what a CuPy installation always has)."""

    def __init__(self) -> None:
        try:
            from cupy_backends.cuda.libs import nvrtc
        except ImportError:  # older CuPy
            from cupy.cuda import nvrtc
        self.nvrtc = nvrtc

    def compile(self, src: str, exprs: list[str], opts: list[str]) -> Compiled:
        """Compile ``src`` for the name expressions ``exprs`` with ``opts``."""
        nv = self.nvrtc
        prog = nv.createProgram(src, "layernorm.cu", (), ())
        try:
            for expr in exprs:
                nv.addNameExpression(prog, expr)
            try:
                nv.compileProgram(prog, list(opts))
            except Exception:  # NVRTCError: the log says why
                return Compiled(False, nv.getProgramLog(prog), {}, b"")
            log = nv.getProgramLog(prog)
            lowered = {expr: nv.getLoweredName(prog, expr) for expr in exprs}
            cubin = any(o.startswith("--gpu-architecture=sm_") for o in opts)
            binary = nv.getCUBIN(prog) if cubin else nv.getPTX(prog)
            return Compiled(True, log, lowered, binary)
        finally:
            nv.destroyProgram(prog)


def compile_kernels(nvrtc: Any, exprs: list[str], arch: str,
                    extra: tuple[str, ...] = ()) -> Compiled:
    """Compile the kernel instantiations ``exprs`` for ``arch`` as the backend does.

    ``nvrtc`` is a :class:`CupyNvrtc` or :class:`BindingsNvrtc`; ``extra`` options (e.g.
    ``-Xptxas=-v`` in the tests) go last. When NVRTC cannot find ``cuda_fp16.h`` or
    ``cuda_bf16.h`` (an NVRTC without built-in headers) the compile is retried with the
    first folder of :func:`cuda_include_dirs`.
    """
    opts = [*nvrtc_options(arch), *extra]
    result = nvrtc.compile(source(), list(exprs), opts)
    if not result.ok and missing_header(result.log):
        dirs = cuda_include_dirs()
        if dirs:
            result = nvrtc.compile(source(), list(exprs), [*opts, f"-I{dirs[0]}"])
    return result


def cache_dir() -> str:
    """Where compiled kernels are kept (``$LAYERNORM_CUDA_CACHE``, else ``~/.cache``)."""
    import os

    return os.environ.get("LAYERNORM_CUDA_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "layernorm", "cuda")


def _device_arch(nvrtc: Any, device_id: int) -> str:
    """``sm_XY`` when NVRTC can build a cubin for the device, else the newest PTX it can."""
    import cupy

    cc = int(cupy.cuda.Device(device_id).compute_capability)
    try:
        supported = [int(a) for a in nvrtc.nvrtc.getSupportedArchs()]
    except Exception:  # an NVRTC without the query: assume it knows the device
        return f"sm_{cc}"
    if cc in supported:
        return f"sm_{cc}"
    older = [a for a in supported if a <= cc]
    return f"compute_{max(older) if older else cc}"


def _binary_path(expr: str, arch: str, version: str) -> str:
    """Cache file of one instantiation, keyed by everything that shapes the binary."""
    import hashlib
    import os

    key = hashlib.sha256("\n".join([source(), expr, version, *nvrtc_options(arch)]).encode())
    ext = "cubin" if arch.startswith("sm_") else "ptx"
    return os.path.join(cache_dir(), f"{key.hexdigest()[:40]}.{ext}")


@functools.cache
def _kernel(device_id: int, expr: str) -> Any:
    import os
    import tempfile

    import cupy

    with cupy.cuda.Device(device_id):
        nvrtc = CupyNvrtc()
        arch = _device_arch(nvrtc, device_id)
        path = _binary_path(expr, arch, str(nvrtc.nvrtc.getVersion()))
        name_path = path + ".name"
        if not (os.path.isfile(path) and os.path.isfile(name_path)):
            result = compile_kernels(nvrtc, [expr], arch)
            if not result.ok:
                raise RuntimeError(f"NVRTC could not compile {expr} for {arch}:\n"
                                   f"{result.log}")
            folder = os.path.dirname(path)
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError:  # a read-only home: a private folder for this process
                folder = tempfile.mkdtemp(prefix="layernorm-cuda-")
                path = os.path.join(folder, os.path.basename(path))
                name_path = path + ".name"
            # Written to a temporary name and renamed: another process loading the same
            # kernel never sees half a file.
            for target, data in ((path, result.binary),
                                 (name_path, result.lowered[expr].encode())):
                fd, tmp = tempfile.mkstemp(dir=folder)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, target)
        with open(name_path, encoding="utf-8") as fh:
            lowered = fh.read()
        return cupy.RawModule(path=path).get_function(lowered)


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


def _family(x3: Any, device_id: int) -> str:
    """Which kernels read ``x3``: "rows" (a group of threads per row) or "cols".

    Contiguous rows, and strided rows (``inner == 1``, e.g. ``x[:, ::2]``) unless
    neighbouring rows are closer in memory than neighbouring elements and there are
    enough of them to give every SM a block of 32: then (Fortran order with many rows)
    the cols kernels' one-thread-per-row loads coalesce across rows. Channels-first
    views (``inner > 1``) always take the cols kernels. Both families give the same
    bits (see the CUDA source), so this is a speed choice only.
    """
    _, n, inner = x3.shape
    s0, s1, _ = _strides(x3)
    if n == 1 or s1 == 1:
        return "rows"
    if inner > 1:
        return "cols"
    rows = x3.shape[0]
    interleaved = abs(s0) < abs(s1)
    return "cols" if interleaved and rows >= COL_ROWS * _sm_count(device_id) else "rows"


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
    family = _family(arrays[1] if kind == "bwd" else arrays[0], device_id)
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
    """Launch the forward kernel for ``x3`` (``(outer, n, inner)``) into ``y3``.

    An output over the input (``out=x``) goes through a separate array, copied into it
    after the kernel: a row whose squares overflow or underflow is read whole by each of
    its threads (the kernels' rare rescaled path) while the others store their elements,
    which in place raced (found by the host emulation; a barrier there made the fast
    path's register budget spill, so the copy is the fix until it is measured on a GPU).
    """
    import cupy

    outer, n, inner = x3.shape
    rows = outer * inner
    if rows == 0 or n == 0:
        return
    if cupy.may_share_memory(x3, y3):
        separate = cupy.empty(y3.shape, y3.dtype)
        forward(x3, weight, bias, eps, separate, mean, rstd, dtype, rms)
        cupy.copyto(y3, separate)
        return
    device_id = x3.device.id
    with cupy.cuda.Device(device_id):
        inv_n = _scalar(1.0, dtype) / _scalar(n, dtype)  # IEEE, as the kernels would
        args = (x3, y3, _ptr_or_null(weight), _ptr_or_null(bias), _scalar(eps, dtype), inv_n,
                _ptr_or_null(mean), rstd, *_i64(rows, n, inner), np.float64(1.0 / inner),
                *_i64(*_strides(x3), *_strides(y3)))
        _launch("fwd", dtype, rms, n, rows, device_id, args, (x3, y3))


def _rows_unit_stride(what: str, *arrays: Any) -> None:
    _, n, inner = arrays[0].shape
    if inner != 1 or (n > 1 and any(_strides(a)[1] != 1 for a in arrays)):
        raise ValueError(f"the {what} takes rows of unit stride, got shape "
                         f"{arrays[0].shape} and strides {[_strides(a) for a in arrays]}")


def add_operands(r3: Any, dtypes: tuple[str, str, str]) -> tuple[Any, tuple[str, str, str]]:
    """The residual and dtypes ``add_fwd_rows`` is launched with: as given where
    :data:`ADD_DTYPES` has them, else the residual widened to float32.

    Widening a float16 or bfloat16 residual is exact, and ``h`` is the sum of the widened
    operands either way, so ``h`` and ``y`` keep their bits. The copy is contiguous.
    """
    if tuple(dtypes) in ADD_DTYPES:
        return r3, tuple(dtypes)
    x_name, r_name, h_name = dtypes
    if r_name == "bfloat16":  # its bits are the high half of a float32's
        wide = (r3.view("uint16").astype("uint32") << 16).view("float32")
    elif r_name == "float16":
        wide = r3.view("float16").astype("float32")
    else:
        raise ValueError(f"no fused residual add for (x, residual, h) dtypes {dtypes}")
    widened = (x_name, "float32", h_name)
    if widened not in ADD_DTYPES:
        raise ValueError(f"no fused residual add for (x, residual, h) dtypes {dtypes}")
    return wide, widened


def add_forward(x3: Any, r3: Any, weight: Any, bias: Any, eps: float, h3: Any, y3: Any,
                mean: Any, rstd: Any, dtypes: tuple[str, str, str], rms: bool) -> None:
    """Launch ``add_fwd_rows``: ``h3 = x3 + r3`` and the forward of ``h3`` into ``y3``.

    The views are ``(rows, n, 1)`` with unit-stride rows; ``dtypes`` names the dtypes of
    ``x3``, ``r3`` and ``h3`` (``y3`` has x's). The configuration is the one
    :func:`forward` uses for ``h3``'s dtype, so ``y3`` is bit for bit ``forward(h3)``
    rounded to x's dtype. ``h3`` and ``y3`` may each be ``x3`` or ``r3`` itself.
    """
    import cupy

    _rows_unit_stride("fused residual add", x3, r3, h3, y3)
    outer, n, _ = x3.shape
    if outer == 0 or n == 0:
        return
    r3, dtypes = add_operands(r3, dtypes)
    h_name = dtypes[2]
    device_id = x3.device.id
    with cupy.cuda.Device(device_id):
        cfg = row_config(n, h_name)
        kernel = _kernel(device_id, add_expression(dtypes, cfg[:2], rms))
        inv_n = _scalar(1.0, h_name) / _scalar(n, h_name)  # IEEE, as forward's
        vec_ok = all(_aligned(a, vector_width(h_name)) for a in (x3, r3, h3, y3))
        per_block = 1 if cfg.g > 32 else cfg.threads // cfg.g
        grid = _grid(device_id, outer, per_block, cfg.threads)
        kernel((grid,), (cfg.threads,),
               (x3, r3, h3, y3, _ptr_or_null(weight), _ptr_or_null(bias), _scalar(eps, h_name),
                inv_n, _ptr_or_null(mean), rstd,
                *_i64(outer, n, *(_strides(a)[0] for a in (x3, r3, h3, y3))),
                np.int32(1 if vec_ok else 0)))


def quantized_forward(x3: Any, r3: Any, weight: Any, bias: Any, eps: float, h3: Any, q3: Any,
                      mean: Any, rstd: Any, fmt: str, inv_rows: Any, scale_out: Any,
                      dtypes: tuple[str, str, str]) -> None:
    """Launch ``quant_fwd_rows`` (``r3`` None) or ``quant_add_fwd_rows`` into the codes ``q3``.

    ``(rows, n, 1)`` views with unit-stride rows; ``q3`` has 1-byte elements (int8 or a
    float8 type, written as bytes) and shares memory with no input; ``h3`` (with a
    residual) may be ``x3`` or ``r3``. ``fmt`` is a key of :data:`QUANT_FORMATS`;
    ``inv_rows`` (float32, one per row) is ``1 / scale`` of a static scale, or None:
    each row's scale goes to ``scale_out``. ``mean`` None selects RMSNorm. The
    configuration is float32's: the codes quantize fwd_rows<float> of the widened row.
    """
    import cupy

    add = r3 is not None
    arrays = (x3, r3, h3, q3) if add else (x3, q3)
    _rows_unit_stride("quantized forward", *arrays)
    if ACCUMULATION[dtypes[0]] != "float32":
        raise ValueError(f"quantized output takes float32 accumulation, got x of {dtypes[0]}")
    outer, n, _ = x3.shape
    if outer == 0 or n == 0:
        return
    if add:
        r3, dtypes = add_operands(r3, dtypes)
        arrays = (x3, r3, h3, q3)
    device_id = x3.device.id
    rms = mean is None
    with cupy.cuda.Device(device_id):
        cfg = row_config(n, "float32")
        expr = (quant_add_expression(dtypes, cfg[:2], rms) if add
                else quant_expression(dtypes[0], cfg[:2], rms))
        kernel = _kernel(device_id, expr)
        inv_n = np.float32(1.0) / np.float32(n)  # IEEE, as forward's
        vec_ok = all(_aligned(a, vector_width("float32")) for a in arrays)
        per_block = 1 if cfg.g > 32 else cfg.threads // cfg.g
        grid = _grid(device_id, outer, per_block, cfg.threads)
        head = (x3, r3, h3, q3) if add else (x3, q3)
        kernel((grid,), (cfg.threads,),
               (*head, _ptr_or_null(weight), _ptr_or_null(bias), np.float32(eps), inv_n,
                _ptr_or_null(mean), rstd, _ptr_or_null(inv_rows),
                _ptr_or_null(None if inv_rows is not None else scale_out),
                *_i64(outer, n, *(_strides(a)[0] for a in arrays)),
                np.int32(QUANT_FORMATS[fmt]), np.int32(1 if vec_ok else 0)))


def backward(gy3: Any, x3: Any, mean: Any, rstd: Any, weight: Any, gx3: Any, dtype: str,
             rms: bool, grad_residual: Any = None) -> tuple[Any, Any]:
    """Launch grad_x and the parameter-gradient reduction; return (grad_w, grad_b or None).

    ``grad_residual`` (a view like ``x3``, or None) is added to grad_x in the
    accumulation dtype before its one rounding, inside the grad_x kernel.
    """
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
        gres_strides = (0, 0, 0) if grad_residual is None else _strides(grad_residual)
        args = (gy3, x3, _ptr_or_null(mean), rstd, _ptr_or_null(weight), gx3, inv_n,
                *_i64(rows, n, inner), inv_inner,
                *_i64(*_strides(gy3), *_strides(x3), *_strides(gx3)),
                _ptr_or_null(grad_residual), *_i64(*gres_strides))
        arrays = (gy3, x3, gx3) if grad_residual is None else (gy3, x3, gx3, grad_residual)
        _launch("bwd", dtype, rms, n, rows, device_id, args, arrays)

        blocks = -(-rows // GRAD_ROW_BLOCK)
        part = cupy.empty((count, blocks, n), dtype=acc)
        pkernel = _kernel(device_id, expression("param_partials", dtype, rms=rms))
        grid = _grid(device_id, blocks * n, FLAT_THREADS, FLAT_THREADS)
        pkernel((grid,), (FLAT_THREADS,),
                (gy3, x3, _ptr_or_null(mean), rstd, part, *_i64(rows, n, inner), inv_inner,
                 *_i64(*_strides(gy3), *_strides(x3), blocks), np.float64(1.0 / n)))
        return _sum_partials(part, count, blocks, n, acc, device_id)


def _sum_partials(part: Any, count: int, blocks: int, n: int, acc: str,
                  device_id: int) -> tuple[Any, Any]:
    """Reduce ``part`` (``(count, blocks, n)``) over blocks, ``SUM_FAN`` to one per level.

    Each level is one launch in which every output is one thread's fixed tree over
    ``SUM_FAN`` inputs; ``ceil(log_SUM_FAN(blocks))`` levels (4 for a million rows).
    """
    import cupy

    skernel = _kernel(device_id, expression("sum_partials", acc))
    while True:
        out_blocks = -(-blocks // SUM_FAN)
        out = cupy.empty((count, out_blocks, n), dtype=acc)
        grid = _grid(device_id, count * out_blocks * n, FLAT_THREADS, FLAT_THREADS)
        skernel((grid,), (FLAT_THREADS,),
                (part, out, *_i64(count, blocks, n, out_blocks), np.float64(1.0 / n),
                 np.float64(1.0 / out_blocks)))
        part, blocks = out, out_blocks
        if blocks == 1:
            return part[0, 0], (None if count == 1 else part[1, 0])
