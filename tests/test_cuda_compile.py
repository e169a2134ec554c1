"""The CUDA kernels compile, for every instantiation the CuPy backend can launch, with no spills.

No GPU is needed: NVRTC (from ``cuda-bindings``) compiles the shipped source exactly as
:class:`cupy.RawModule` does (same options, same name expressions) into cubins for
sm_80 (A100) and sm_90 (H100/H200), and ptxas' ``-v`` report, which NVRTC returns in its
log, shows every kernel's registers and local-memory spills.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from layernorm._backends._cupy import launch

DTYPES = ("float16", "bfloat16", "float32", "float64")
ARCHS = (80, 90)

#: Most bytes of local-memory spill (stores, and loads) a kernel may have. Register
#: pressure in the row loops shows up as hundreds of bytes (the first block kernels of
#: 1024 threads spilled 680); ptxas alone adds a word or two in cold code of some
#: kernels as an occupancy trade-off (seen: 4 to 40 bytes, varying with the toolkit), which
#: forcing more registers (--maxrregcount) removes at a cost in occupancy.
SPILL_LIMIT = 64


def _nvrtc():
    return pytest.importorskip("cuda.bindings.nvrtc")


def _include_dirs() -> list[str]:
    dirs = launch.cuda_include_dirs()
    if not dirs:
        pytest.skip("no CUDA headers (cuda_fp16.h) found: set CUDA_PATH or put nvcc on PATH")
    return dirs


def _check(nvrtc, result):
    """The value of a cuda-bindings NVRTC call's ``(err, value)`` result."""
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC call failed: {err}")
    return rest[0] if rest else None


def _log(nvrtc, prog) -> str:
    size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog))
    buf = b" " * size
    _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf))
    return buf.decode(errors="replace").rstrip("\x00 ")


@functools.cache
def _compile(dtype: str, arch: int) -> tuple[bool, str, dict[str, str], bytes]:
    """(success, log, {expression: lowered name}, cubin) for all kernels of ``dtype``."""
    done = background_result(f"nvrtc-{dtype}-{arch}")
    return done if done is not None else _compile_here(dtype, arch)


def _compile_here(dtype: str, arch: int) -> tuple[bool, str, dict[str, str], bytes]:
    nvrtc = _nvrtc()
    exprs = launch.all_expressions(dtype)
    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(launch.source().encode(), b"layernorm.cu",
                                                 0, [], []))
    try:
        for expr in exprs:
            _check(nvrtc, nvrtc.nvrtcAddNameExpression(prog, expr.encode()))
        opts = [f"--gpu-architecture=sm_{arch}", *launch.OPTIONS, "-Xptxas=-v"]
        opts += [f"-I{d}" for d in _include_dirs()[:1]]
        opts_b = [o.encode() for o in opts]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts_b), opts_b)
        log = _log(nvrtc, prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return False, log, {}, b""
        lowered = {}
        for expr in exprs:
            name = _check(nvrtc, nvrtc.nvrtcGetLoweredName(prog, expr.encode()))
            lowered[expr] = name.decode() if isinstance(name, bytes) else str(name)
        size = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin))
        return True, log, lowered, cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _ptxas_report(log: str) -> dict[str, tuple[int, int, int]]:
    """{mangled kernel: (registers, spill store bytes, spill load bytes)} from ptxas -v."""
    report = {}
    current = None
    spills = (0, 0)
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            spills = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            report[current] = (int(m.group(1)), *spills)
            current, spills = None, (0, 0)
    return report


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_instantiation_compiles(dtype, arch):
    ok, log, lowered, cubin = _compile(dtype, arch)
    assert ok, f"NVRTC failed for {dtype} on sm_{arch}:\n{log}"
    exprs = launch.all_expressions(dtype)
    assert set(lowered) == set(exprs)
    assert all(name.startswith("_Z") for name in lowered.values())
    assert len(set(lowered.values())) == len(exprs)  # one kernel per expression
    assert len(cubin) > 1000
    assert "warning" not in log.lower(), log


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_local_memory_spills(dtype, arch):
    ok, log, lowered, _ = _compile(dtype, arch)
    assert ok, log
    report = _ptxas_report(log)
    if not report:
        report = _ptxas_binary_report(dtype, arch)
    missing = set(lowered.values()) - set(report)
    assert not missing, f"no ptxas report for {sorted(missing)[:3]}"
    spilled = {k: v for k, v in report.items() if v[1] > SPILL_LIMIT or v[2] > SPILL_LIMIT}
    assert not spilled, f"kernels spill (registers, store bytes, load bytes): {spilled}"
    # The register-resident row kernels must leave room for more than one block per SM.
    assert max(v[0] for v in report.values()) <= 255


def _ptxas_binary_report(dtype: str, arch: int) -> dict[str, tuple[int, int, int]]:
    """Fallback when NVRTC's log has no ptxas lines: run ptxas on NVRTC's PTX."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("NVRTC printed no ptxas report and ptxas is not on PATH")
    nvrtc = _nvrtc()
    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(launch.source().encode(), b"layernorm.cu",
                                                 0, [], []))
    try:
        for expr in launch.all_expressions(dtype):
            _check(nvrtc, nvrtc.nvrtcAddNameExpression(prog, expr.encode()))
        opts = [f"--gpu-architecture=compute_{arch}", *launch.OPTIONS]
        opts += [f"-I{d}" for d in _include_dirs()[:1]]
        opts_b = [o.encode() for o in opts]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts_b), opts_b)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, _log(nvrtc, prog)
        size = _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog))
        ptx = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    proc = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", "-o", "/dev/null", "-"],
                          input=ptx.rstrip(b"\x00 "), capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stderr.decode()
    return _ptxas_report(proc.stderr.decode() + proc.stdout.decode())


def test_configurations_cover_every_row_length():
    """Every configuration row_config returns is instantiated, for any n and dtype."""
    seen = set()
    for dtype in DTYPES:
        for n in [*range(1, 5000), 8191, 8192, 8193, 16384, 65536, 10**6, 2**31 + 5]:
            cfg = launch.row_config(n, dtype)
            assert (cfg.g, cfg.maxc) in launch.CONFIGS
            assert cfg.threads == (cfg.g if cfg.g > 32 else 128)
            seen.add((cfg.g, cfg.maxc))
    assert seen == set(launch.CONFIGS)


def test_row_config_depends_on_length_and_element_size_only():
    assert launch.row_config(768, "float16") == launch.row_config(768, "bfloat16")
    assert launch.row_config(1000, "float32") != launch.row_config(1000, "float64")
    # A tile holds a whole row up to 2048 16-byte vectors, then the kernel loops.
    for dtype in DTYPES:
        vec = launch.vector_width(dtype)
        cfg = launch.row_config(2048 * vec, dtype)
        assert cfg.g * cfg.maxc * vec == 2048 * vec
        cfg = launch.row_config(2048 * vec + 1, dtype)
        assert cfg.g * cfg.maxc * vec < 2048 * vec + 1


def test_source_is_package_data():
    src = launch.source()
    assert "namespace lnk" in src
    for kind in ("fwd_rows", "fwd_cols", "bwd_rows", "bwd_cols", "param_partials",
                 "sum_partials"):
        assert f" {kind}(" in src or f"\n{kind}(" in src


# ------------------------------------------------- host/kernel argument contract (no GPU)

_C_SIZES = {"__half": 2, "__nv_bfloat16": 2, "float": 4, "double": 8}


def _signatures() -> dict[str, list[str]]:
    """Parameter types of every kernel, read from the CUDA source."""
    sigs = {}
    pattern = r"__global__ void __launch_bounds__\([^)]*\)\s*\n(\w+)\(([^)]*)\)"
    for m in re.finditer(pattern, launch.source()):
        params = [p.strip() for p in m.group(2).replace("\n", " ").split(",")]
        sigs[m.group(1)] = [re.sub(r"\s*\w+$", "", p) for p in params]
    return sigs


class _FakeArray:
    """What launch.py reads from a CuPy array, backed by a NumPy array."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.shape, self.strides, self.itemsize, self.dtype = (
            arr.shape, arr.strides, arr.itemsize, arr.dtype)
        self.data = types.SimpleNamespace(ptr=arr.__array_interface__["data"][0])
        self.device = types.SimpleNamespace(id=0)

    def __getitem__(self, key):
        return _FakeArray(self.arr[key])


def _fake_cupy() -> types.ModuleType:
    class Device:
        def __init__(self, *args) -> None:
            pass

        def __enter__(self) -> Device:
            return self

        def __exit__(self, *exc) -> None:
            pass

    mod = types.ModuleType("cupy")
    mod.cuda = types.SimpleNamespace(Device=Device)
    mod.empty = lambda shape, dtype: _FakeArray(np.empty(shape, dtype))
    mod.zeros = lambda shape, dtype: _FakeArray(np.zeros(shape, dtype))
    return mod


def _check_call(sigs, expr, grid, block, args):
    m = re.fullmatch(r"lnk::(\w+)<([^>]*)>", expr)
    kind, targs = m.group(1), [t.strip() for t in m.group(2).split(",")]
    t_name = targs[0]
    a_name = targs[1] if len(targs) > 1 else targs[0]
    a_dtype = np.dtype(a_name.replace("float", "float32").replace("double", "float64"))
    params = sigs[kind]
    assert len(args) == len(params), (expr, len(args), len(params))
    for i, (ptype, arg) in enumerate(zip(params, args, strict=True)):
        where = f"{expr} argument {i} ({ptype})"
        if ptype.endswith("*"):
            if isinstance(arg, np.uint64):
                assert arg == 0 and "A" in ptype, f"{where}: only parameters may be null"
                continue
            assert isinstance(arg, _FakeArray), where
            if "T" in ptype:
                assert arg.itemsize == _C_SIZES[t_name], where
            else:
                assert arg.dtype == a_dtype, where
        elif ptype == "A":
            assert type(arg) is a_dtype.type, where
        elif ptype == "i64":
            assert type(arg) is np.int64, where
        elif ptype == "double":
            assert type(arg) is np.float64, where
        else:
            assert ptype == "int" and type(arg) is np.int32, where
    assert all(int(g) >= 1 for g in grid)
    threads = int(np.prod(block))
    assert 1 <= threads <= 1024
    if kind.endswith("_rows"):
        g = int(targs[2])
        assert block == ((g if g > 32 else 128),), (expr, block)
    if kind.endswith("_cols"):
        assert block[0] == 32 and block[1] in (1, 2, 4, 8), (expr, block)


def _layouts(n, dtype):
    """(name, x3 array, axis family) for the layouts the wrapper can hand over."""
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(n)
    base = rng.standard_normal((6, n + 1)).astype(npdt)
    yield "contiguous", base[:, :n].copy().reshape(6, n, 1), "rows"
    yield "misaligned", base[:, 1:].reshape(6, n, 1), "rows"
    yield "channels-first", np.ascontiguousarray(base[:, :n].T)[None], "cols"
    yield "fortran", np.asfortranarray(base[:, :n]).reshape(6, n, 1), "cols"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [5, 64, 1000, 40000])
def test_launch_arguments_match_kernel_signatures(monkeypatch, dtype, n):
    """Every launch passes the kernel's parameters in order, with the right C types."""
    sigs = _signatures()
    assert set(sigs) == {"fwd_rows", "fwd_cols", "bwd_rows", "bwd_cols", "param_partials",
                         "sum_partials"}
    calls = []

    def fake_kernel(device_id, expr):
        def run(grid, block, args):
            calls.append((expr, grid, block, args))
        return run

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(launch, "_kernel", fake_kernel)
    monkeypatch.setattr(launch, "_sm_count", lambda device_id: 132)
    acc = "float64" if dtype == "float64" else "float32"
    for name, x, family in _layouts(n, dtype):
        x3 = _FakeArray(x)
        rows = x.shape[0] * x.shape[2]
        w = _FakeArray(np.ones(n, acc))
        mean, rstd = _FakeArray(np.empty(rows, acc)), _FakeArray(np.empty(rows, acc))
        y3 = _FakeArray(np.empty_like(x))
        calls.clear()
        launch.forward(x3, w, w, 1e-5, y3, mean, rstd, dtype, rms=False)
        launch.forward(x3, None, None, 1e-5, y3, None, rstd, dtype, rms=True)
        gw, gb = launch.backward(x3, x3, mean, rstd, w, y3, dtype, rms=False)
        gw2, gb2 = launch.backward(x3, x3, None, rstd, None, y3, dtype, rms=True)
        assert gb2 is None and gw.arr.shape == gb.arr.shape == gw2.arr.shape == (n,)
        kinds = [re.match(r"lnk::(\w+)<", c[0]).group(1) for c in calls]
        assert kinds == [f"fwd_{family}", f"fwd_{family}",
                         f"bwd_{family}", "param_partials", "sum_partials",
                         f"bwd_{family}", "param_partials", "sum_partials"], (name, kinds)
        for expr, grid, block, args in calls:
            _check_call(sigs, expr, grid, block, args)
        fwd_args = calls[0][3]
        strides = [int(s) // x.itemsize for s in x.strides]
        assert fwd_args[5] == fwd_args[4].dtype.type(1) / fwd_args[4].dtype.type(n)  # inv_n
        assert [int(v) for v in fwd_args[8:11]] == [rows, n, x.shape[2]]
        assert float(fwd_args[11]) == 1.0 / x.shape[2]
        assert [int(v) for v in fwd_args[12:15]] == strides
        if family == "rows":
            aligned = name == "contiguous" and (n * x.itemsize) % 16 == 0
            assert int(fwd_args[-1]) == int(aligned), name
        else:
            cfg = launch.row_config(n, dtype)
            tile = cfg.g * cfg.maxc * launch.vector_width(dtype)
            assert [int(v) for v in fwd_args[-3:]] == [cfg.g, cfg.maxc, -(-n // tile)]


# ------------------------------------------------ the kernels on a host emulation of CUDA
#
# The CUDA source itself, compiled with g++ against a tiny emulation of the CUDA features
# it uses (one std::thread per CUDA thread, barriers for __syncthreads and warp shuffles,
# blocks one after another) and launched through launch.py's real forward/backward code
# on NumPy memory. This checks the algorithm without a GPU: results against the float64
# reference, and the bitwise guarantees across layouts, alignment and batch position.
# (The GPU's rsqrt and float16 conversions may differ from the host's in the last bit,
# so these results are compared with each other, never with the GPU's.)

_EMULATION_PRELUDE = r"""
// Host emulation of the few CUDA features the kernels use: one std::thread per CUDA
// thread, std::barrier for __syncthreads and warp shuffles, blocks run one by one.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

struct EmuWarp { std::barrier<>* bar; unsigned char slots[32][16]; };
thread_local EmuWarp* emu_warp;
thread_local int emu_lane;
thread_local std::barrier<>* emu_block;

inline void __syncthreads() { emu_block->arrive_and_wait(); }
template <typename V> V __shfl_xor_sync(unsigned, V v, int off) {
  static_assert(sizeof(V) <= 16, "shuffle size");
  std::memcpy(emu_warp->slots[emu_lane], &v, sizeof(V));
  emu_warp->bar->arrive_and_wait();
  V o;
  std::memcpy(&o, emu_warp->slots[emu_lane ^ off], sizeof(V));
  emu_warp->bar->arrive_and_wait();
  return o;
}
template <typename V> V __ldg(const V* p) { return *p; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
inline long long __double_as_longlong(double d) { long long v; std::memcpy(&v, &d, 8); return v; }

struct __half { _Float16 v; };
inline float __half2float(__half h) { return (float)h.v; }
inline __half __float2half_rn(float f) { __half h; h.v = (_Float16)f; return h; }
struct __nv_bfloat16 { uint16_t bits; };
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = (uint32_t)b.bits << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {uint16_t(u >> 16)};
}

template <typename F>
void emu_launch(unsigned grid, unsigned bx, unsigned by, F body) {
  gridDim = {grid, 1, 1};
  blockDim = {bx, by, 1};
  const unsigned nt = bx * by;
  for (unsigned b = 0; b < grid; ++b) {
    std::barrier<> block(nt);
    const unsigned nw = (nt + 31) / 32;
    std::vector<std::unique_ptr<std::barrier<>>> bars;
    std::vector<EmuWarp> warps(nw);
    for (unsigned w = 0; w < nw; ++w) {
      bars.emplace_back(new std::barrier<>(std::min(32u, nt - 32 * w)));
      warps[w].bar = bars.back().get();
    }
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < nt; ++t) {
      ts.emplace_back([&, t, b] {
        threadIdx = {t % bx, t / bx, 0};
        blockIdx = {b, 0, 0};
        emu_warp = &warps[t / 32];
        emu_lane = t % 32;
        emu_block = &block;
        body();
      });
    }
    for (auto& th : ts) th.join();
  }
}
"""


def _emulated_library(exprs, workdir):
    import ctypes
    import hashlib
    import os

    sigs = _signatures()
    kdir = os.path.join(os.path.dirname(launch.__file__), "kernels")
    for header in ("cuda_fp16.h", "cuda_bf16.h"):  # the prelude defines the types
        (workdir / header).write_text("// host emulation\n")
    lines = [_EMULATION_PRELUDE, '#include "layernorm.cu"']
    names = {}
    for expr in exprs:
        m = re.fullmatch(r"lnk::(\w+)<([^>]*)>", expr)
        kind, targs = m.group(1), [t.strip() for t in m.group(2).split(",")]
        t_name, a_name = targs[0], targs[1] if len(targs) > 1 else targs[0]
        name = "run_" + hashlib.sha1(expr.encode()).hexdigest()[:16]
        names[expr] = name
        lines.append(f'extern "C" void {name}(unsigned g, unsigned bx, unsigned by, '
                     "const uint64_t* a) {")
        params = []
        for i, ptype in enumerate(sigs[kind]):
            ctype = re.sub(r"\bT\b", t_name, re.sub(r"\bA\b", a_name, ptype))
            lines.append(f"  {ctype.replace('i64', 'long long')} p{i}; "
                         f"std::memcpy(&p{i}, &a[{i}], sizeof(p{i}));")
            params.append(f"p{i}")
        lines.append(f"  emu_launch(g, bx, by, [=] {{ {expr}({', '.join(params)}); }});")
        lines.append("}")
    src = workdir / "emulation.cpp"
    src.write_text("\n".join(lines))
    lib = workdir / "emulation.so"
    proc = subprocess.run(["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-shared",
                           "-fPIC", "-pthread", f"-I{workdir}", f"-I{kdir}", str(src), "-o",
                           str(lib)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return ctypes.CDLL(str(lib)), names


def _pack(arg) -> int:
    if isinstance(arg, _FakeArray):
        return arg.data.ptr
    arg = np.asarray(arg)
    return int(arg.view(np.uint32 if arg.dtype.itemsize == 4 else np.uint64))


def _emulation_lengths(dtype):
    vec = launch.vector_width(dtype)
    # a few lanes per row, a warp with several vectors, a 4-warp block, two 512-thread tiles
    return [5, 16 * vec - 3, 32 * 4 * vec, 128 * 2 * vec - 3, 2048 * vec + 1]


@pytest.mark.slow
def test_kernels_on_host_emulation(monkeypatch, tmp_path):
    done = background_result("emulation")
    if done is None:
        done = run_emulation(tmp_path, monkeypatch.setitem, monkeypatch.setattr)
    if done != "passed":
        pytest.fail(done, pytrace=False)


def run_emulation(workdir, setitem, setattr_) -> str:
    """Build the emulation, run every check; "passed" or the failure's traceback."""
    import ctypes

    from . import reference

    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the host emulation")
    exprs = set()
    for dtype in DTYPES:
        for n in _emulation_lengths(dtype):
            cfg = launch.row_config(n, dtype)
            for rms in (False, True):
                exprs |= {launch.expression(k, dtype, cfg[:2], rms) for k in ("fwd_rows",
                                                                             "bwd_rows")}
                exprs |= {launch.expression(k, dtype, rms=rms)
                          for k in ("fwd_cols", "bwd_cols", "param_partials")}
    exprs |= {launch.expression("sum_partials", d) for d in ("float32", "float64")}
    lib, names = _emulated_library(sorted(exprs), workdir)

    def kernel(device_id, expr):
        fn = getattr(lib, names[expr])

        def run(grid, block, args):
            packed = (ctypes.c_uint64 * len(args))(*[_pack(a) for a in args])
            fn(ctypes.c_uint(int(grid[0])), ctypes.c_uint(int(block[0])),
               ctypes.c_uint(int(block[1]) if len(block) > 1 else 1), packed)
        return run

    setitem(sys.modules, "cupy", _fake_cupy())
    setattr_(launch, "_kernel", kernel)
    setattr_(launch, "_sm_count", lambda device_id: 1)  # small grids: loops
    try:
        for dtype in DTYPES:
            for n in _emulation_lengths(dtype):
                _check_emulated(reference, dtype, n)
    except AssertionError:
        return traceback.format_exc()
    return "passed"


_NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
       "float64": np.float64}
_ATOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5, "float64": 1e-12}
_GATOL = {"float16": 2e-2, "bfloat16": 1.5e-1, "float32": 5e-5, "float64": 1e-11}


def _emu_forward(x3, dtype, rms, w, b):
    acc = "float64" if dtype == "float64" else "float32"
    rows = x3.shape[0] * x3.shape[2]
    y3 = np.full(x3.shape, np.nan, dtype=x3.dtype)  # poisoned: every element is written
    mean, rstd = np.full(rows, np.nan, acc), np.full(rows, np.nan, acc)
    launch.forward(_FakeArray(x3), None if w is None else _FakeArray(w),
                   None if b is None else _FakeArray(b), 1e-5, _FakeArray(y3),
                   None if rms else _FakeArray(mean), _FakeArray(rstd), dtype, rms)
    return y3, mean, rstd


def _emu_backward(gy3, x3, mean, rstd, w, dtype, rms):
    gx3 = np.full(x3.shape, np.nan, dtype=x3.dtype)
    gw, gb = launch.backward(_FakeArray(gy3), _FakeArray(x3),
                             None if rms else _FakeArray(mean), _FakeArray(rstd),
                             _FakeArray(w), _FakeArray(gx3), dtype, rms)
    return gx3, gw.arr, (None if gb is None else gb.arr)


def _same_bits(a, b, what):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    ua, ub = a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")
    assert np.array_equal(ua, ub), f"{what}: {int((ua != ub).sum())} elements differ"


def _check_emulated(reference, dtype, n):
    rows = 37 if n <= 4096 else 5
    rng = np.random.default_rng(n)
    x = (0.5 + 2 * rng.standard_normal((rows, n))).astype(_NP[dtype])
    x[::5] = (300 + 20 * rng.standard_normal((len(x[::5]), n))).astype(_NP[dtype])
    gy = rng.standard_normal((rows, n)).astype(_NP[dtype])
    acc = np.float64 if dtype == "float64" else np.float32
    w = (1 + 0.3 * rng.standard_normal(n)).astype(acc)
    b = (0.5 * rng.standard_normal(n)).astype(acc)
    big = np.zeros((rows + 1, n + 1), x.dtype)
    big[1:, 1:] = x
    gbig = np.zeros((rows + 1, n + 1), x.dtype)
    gbig[1:, 1:] = gy
    layouts = {  # name: (x3, gy3, back-to-(rows, n))
        "channels-first": (np.ascontiguousarray(x.T)[None], np.ascontiguousarray(gy.T)[None],
                           lambda a: a[0].T),
        "fortran": (np.asfortranarray(x).reshape(rows, n, 1),
                    np.asfortranarray(gy).reshape(rows, n, 1), lambda a: a[:, :, 0]),
        "misaligned": (big[1:, 1:].reshape(rows, n, 1), gbig[1:, 1:].reshape(rows, n, 1),
                       lambda a: a[:, :, 0]),
    }
    for rms in (False, True):
        tag = f"{dtype} n={n} {'rms' if rms else 'layer'}_norm"
        x3 = x.reshape(rows, n, 1)
        y, mean, rstd = _emu_forward(x3, dtype, rms, w, None if rms else b)
        if rms:
            y_ref, rstd_ref = reference.rms_norm(x, (1,), w, eps=1e-5)
        else:
            y_ref, mean_ref, rstd_ref = reference.layer_norm(x, (1,), w, b)
            np.testing.assert_allclose(mean, mean_ref.ravel().astype(np.float64),
                                       rtol=1e-6, atol=1e-6, err_msg=tag)
        np.testing.assert_allclose(y[:, :, 0].astype(np.float64), y_ref.astype(np.float64),
                                   rtol=0, atol=_ATOL[dtype] * max(1, np.abs(y_ref).max()),
                                   err_msg=tag)
        np.testing.assert_allclose(rstd, rstd_ref.ravel().astype(np.float64),
                                   rtol=1e-11 if dtype == "float64" else 2e-5, err_msg=tag)
        gx, gw, gb = _emu_backward(gy.reshape(rows, n, 1), x3, mean, rstd, w, dtype, rms)
        if rms:
            gx_ref, gw_ref = reference.rms_norm_backward(gy, x, (1,), w, eps=1e-5)
        else:
            gx_ref, gw_ref, gb_ref = reference.layer_norm_backward(gy, x, (1,), w)
            np.testing.assert_allclose(gb, gb_ref.astype(np.float64), rtol=1e-4,
                                       atol=1e-3 * max(1, np.abs(gb_ref).max()), err_msg=tag)
        tol = _GATOL[dtype]
        np.testing.assert_allclose(gx[:, :, 0].astype(np.float64), gx_ref.astype(np.float64),
                                   rtol=0, atol=tol * 4 * max(1, np.abs(gx_ref).max()),
                                   err_msg=tag)
        np.testing.assert_allclose(gw, gw_ref.astype(np.float64), rtol=1e-3,
                                   atol=tol * 40 * max(1, np.abs(gw_ref).max()), err_msg=tag)
        for name, (xv, gv, back) in layouts.items():
            yv, mv, sv = _emu_forward(xv, dtype, rms, w, None if rms else b)
            _same_bits(back(yv), y[:, :, 0], f"{tag} y, {name}")
            _same_bits(sv, rstd, f"{tag} rstd, {name}")
            gxv, gwv, gbv = _emu_backward(gv, xv, mean, rstd, w, dtype, rms)
            _same_bits(back(gxv), gx[:, :, 0], f"{tag} grad_x, {name}")
            _same_bits(gwv, gw, f"{tag} grad_weight, {name}")
            if not rms:
                _same_bits(mv, mean, f"{tag} mean, {name}")
                _same_bits(gbv, gb, f"{tag} grad_bias, {name}")
        for r in (0, rows - 1):
            alone, _, _ = _emu_forward(x[r:r + 1].reshape(1, n, 1).copy(), dtype, rms, w,
                                       None if rms else b)
            _same_bits(alone[0, :, 0], y[r, :, 0], f"{tag} row {r} alone")
    constant = np.full((3, n), 1e4 / 3).astype(_NP[dtype])
    yc, _, _ = _emu_forward(constant.reshape(3, n, 1), dtype, False, w, b)
    _same_bits(yc[:, :, 0], np.broadcast_to(b.astype(_NP[dtype]), (3, n)),
               f"{dtype} n={n} constant rows give exactly bias")


# ------------------------------------------------------------ in the background
#
# The NVRTC compiles (eight, 30-110 s each on two cores, one thread each) and the host
# emulation (a minute or more of std::threads taking turns at barriers) need no GPU and
# nothing from the rest of the suite, and pytest spends most of its time in one thread
# (Numba compiles one kernel at a time): on a 2-core machine one core idles.
# So conftest.py's collection hook calls start_background(), which runs those jobs, in
# order, in one idle-priority process while the rest of the suite runs, and moves these
# tests last. Each test then reads its job's result (the same values and assertions as
# computing it in the test); a test whose job was not started computes it itself.

_BACKGROUND: dict[str, object] = {}

#: test function -> background job names for its parameters
_JOBS = {
    "test_every_instantiation_compiles": lambda p: [f"nvrtc-{p['dtype']}-{p['arch']}"],
    "test_no_local_memory_spills": lambda p: [f"nvrtc-{p['dtype']}-{p['arch']}"],
    "test_kernels_on_host_emulation": lambda p: ["emulation"],
}


def start_background(items) -> list:
    """Start the jobs the selected ``items`` need; return the items that wait for them."""
    jobs, waiting = [], []
    for item in items:
        make = _JOBS.get(getattr(item, "originalname", ""))
        if make is None:
            continue
        waiting.append(item)
        params = item.callspec.params if hasattr(item, "callspec") else {}
        jobs += [job for job in make(params) if job not in jobs]
    # The emulation first: it is the longest job and needs no CUDA headers.
    jobs.sort(key=lambda job: job != "emulation")
    if not jobs:
        return []
    workdir = Path(__import__("tempfile").mkdtemp(prefix="layernorm-cuda-tests-"))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from tests.test_cuda_compile import _background_main; "
         "_background_main(sys.argv[1], sys.argv[2:])", str(workdir), *jobs],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _BACKGROUND.update(proc=proc, workdir=workdir, jobs=jobs)
    return waiting


def stop_background() -> None:
    proc = _BACKGROUND.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if "workdir" in _BACKGROUND:
        shutil.rmtree(_BACKGROUND["workdir"], ignore_errors=True)
    _BACKGROUND.clear()


def background_result(job: str):
    """The result of a background ``job`` (waiting for it), or None if it did not run.

    A job that skipped skips the test; one that crashed is computed again in the test.
    """
    if job not in _BACKGROUND.get("jobs", ()):
        return None
    path = _BACKGROUND["workdir"] / f"{job}.pickle"
    proc = _BACKGROUND["proc"]
    while not path.exists() and proc.poll() is None:
        time.sleep(0.2)
    if not path.exists():
        return None
    kind, value = pickle.loads(path.read_bytes())
    if kind == "skip":
        pytest.skip(value)
    return value if kind == "ok" else None


def _background_main(workdir: str, jobs: list[str]) -> None:
    """Run ``jobs`` one by one, pickling ("ok" | "skip" | "error", value) per job."""
    # The foreground tests first: run only on CPU time they leave. (SCHED_IDLE, which the
    # emulation's threads inherit: at nice 5 its hundreds of runnable threads, spinning at
    # barriers, took most of both cores from the foreground.)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    out = Path(workdir)
    for job in jobs:
        try:
            if job == "emulation":
                emu = out / "emulation"
                emu.mkdir()
                value = ("ok", run_emulation(emu, lambda d, k, v: d.__setitem__(k, v),
                                             setattr))
            else:
                _, dtype, arch = job.split("-")
                value = ("ok", _compile_here(dtype, int(arch)))
        except pytest.skip.Exception as exc:
            value = ("skip", str(exc))
        except Exception:
            value = ("error", traceback.format_exc())
        tmp = out / f"{job}.tmp"
        tmp.write_bytes(pickle.dumps(value))
        tmp.replace(out / f"{job}.pickle")
