"""The CUDA kernels compile, for every instantiation the CuPy backend can launch, with no spills.

No GPU is needed: NVRTC (from ``cuda-bindings``) compiles the shipped source through
:func:`launch.compile_kernels`, the function the backend itself compiles with (same
source, options, ``-D`` defines, name expressions and header fallback; only the Python
binding of NVRTC differs: the backend uses CuPy's), into cubins for sm_80 (A100) and
sm_90 (H100/H200), and ptxas' ``-v`` report, which NVRTC returns in its log, shows every
kernel's registers and local-memory spills.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
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


def _bindings() -> launch.BindingsNvrtc:
    _nvrtc()
    return launch.BindingsNvrtc()


@functools.cache
def _compile(dtype: str, arch: int) -> launch.Compiled:
    """The backend's compile of every kernel of ``dtype`` for ``sm_<arch>``, with ptxas -v
    (from the background job started at collection, when there is one)."""
    done = background_result(f"nvrtc-{dtype}-{arch}")
    return done if done is not None else _compile_here(dtype, arch)


def _compile_here(dtype: str, arch: int) -> launch.Compiled:
    return launch.compile_kernels(_bindings(), launch.all_expressions(dtype), f"sm_{arch}",
                                  ("-Xptxas=-v",))


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
    """Fallback when NVRTC's log has no ptxas lines: run ptxas on the backend's PTX."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("NVRTC printed no ptxas report and ptxas is not on PATH")
    result = launch.compile_kernels(_bindings(), launch.all_expressions(dtype),
                                    f"compute_{arch}")
    assert result.ok, result.log
    proc = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", "-o", "/dev/null", "-"],
                          input=result.binary, capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stderr.decode()
    return _ptxas_report(proc.stderr.decode() + proc.stdout.decode())


# ------------------------------------------------------- compile policy (FTZ, defines)


def test_compile_options_keep_ieee_subnormals():
    """The backend's options ask for no flush-to-zero, and nothing later overrides it."""
    opts = launch.nvrtc_options("sm_90")
    ftz = [o for o in opts if "ftz" in o]
    assert ftz == ["--ftz=false"], opts
    for name, value in launch.DEFINES.items():
        assert f"-D{name}={value}" in opts


def test_ptx_has_no_flush_to_zero_instructions():
    """What NVRTC emits for the backend's options: no ``.ftz`` float instruction at all."""
    exprs = [launch.expression("fwd_rows", "bfloat16", (32, 1), rms=False),
             launch.expression("fwd_cols", "float32", rms=True),
             launch.expression("sum_partials", "float32")]
    result = launch.compile_kernels(_bindings(), exprs, "compute_90")
    assert result.ok, result.log
    ptx = result.binary.decode()
    assert "sqrt.approx.f32" in ptx or "sqrt.rn.f32" in ptx  # the rstd is in there
    assert ".ftz." not in ptx, [ln for ln in ptx.splitlines() if ".ftz." in ln][:5]


def test_shared_constants_have_one_definition():
    """The CUDA source takes GRAD_ROW_BLOCK, COL_MAX_RY, ... from launch.py, never a copy."""
    src = launch.source()
    for name in launch.DEFINES:
        assert name in src
        assert not re.search(rf"#define\s+{name}\b", src), name
    for copy in ("COL_MAX_RY = ", "GRAD_ROW_BLOCK = ", "block_rows,"):
        assert copy not in src, copy
    # Without the defines the source refuses to compile (instead of using stale values).
    bare = launch.BindingsNvrtc().compile(src, [launch.expression("sum_partials", "float32")],
                                          ["--gpu-architecture=compute_90", *launch.OPTIONS])
    assert not bare.ok and "LNK_" in bare.log


def test_larger_configuration_fails_the_tree_stack_guard(monkeypatch):
    """A 1024-thread configuration would overflow the cols kernels' MAX_LOG stack."""
    _bindings()
    monkeypatch.setitem(launch.DEFINES, "LNK_MAX_G", 1024)
    result = launch.compile_kernels(_bindings(), [launch.expression("fwd_cols", "float32")],
                                    "compute_90")
    assert not result.ok and "MAX_LOG" in result.log


def test_header_fallback_covers_both_half_headers(monkeypatch):
    """A log naming cuda_bf16.h (not only cuda_fp16.h) triggers the include retry."""
    calls = []

    class Fake:
        def compile(self, src, exprs, opts):
            calls.append(opts)
            if any(o.startswith("-I") for o in opts):
                return launch.Compiled(True, "", {e: "_Z" for e in exprs}, b"bin")
            return launch.Compiled(False, 'cannot open source file "cuda_bf16.h"', {}, b"")

    monkeypatch.setattr(launch, "cuda_include_dirs", lambda: ["/opt/cuda/include"])
    result = launch.compile_kernels(Fake(), ["lnk::x"], "sm_90")
    assert result.ok and len(calls) == 2 and calls[1][-1] == "-I/opt/cuda/include"
    assert calls[0] == launch.nvrtc_options("sm_90")


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
                 "sum_partials", "add_fwd_rows"):
        assert f" {kind}(" in src or f"\n{kind}(" in src


# ------------------------------------------------- host/kernel argument contract (no GPU)

_C_SIZES = {"__half": 2, "__nv_bfloat16": 2, "float": 4, "double": 8, "unsigned char": 1}

#: Pointer parameters a launch may pass as null (besides parameters and statistics of
#: the accumulation type): the backward's grad_residual.
_NULLABLE = {("bwd_rows", 20), ("bwd_cols", 20)}


def _signatures() -> dict[str, list[str]]:
    """Parameter types of every kernel, read from the CUDA source."""
    sigs = {}
    pattern = r"__global__ void __launch_bounds__\([^)]*\)\s*\n(\w+)\(([^)]*)\)"
    for m in re.finditer(pattern, launch.source()):
        params = [p.strip() for p in m.group(2).replace("\n", " ").split(",")]
        sigs[m.group(1)] = [re.sub(r"\s*\w+$", "", p) for p in params]
    return sigs


def _template_args(expr: str) -> tuple[str, dict[str, str]]:
    """(kernel, {template parameter name: argument}) of a name expression, the names read
    from the kernel's template declaration in the CUDA source."""
    m = re.fullmatch(r"lnk::(\w+)<([^>]*)>", expr)
    kind, targs = m.group(1), [t.strip() for t in m.group(2).split(",")]
    decl = re.search(r"template <([^>]*)>\s*\n__global__ void __launch_bounds__\([^)]*\)"
                     rf"\s*\n{kind}\(", launch.source())
    names = [p.split()[-1] for p in decl.group(1).split(",")]
    assert len(names) == len(targs), (expr, names)
    return kind, dict(zip(names, targs, strict=True))


def _c_type(ptype: str, args: dict[str, str]) -> str:
    """A parameter type with the template parameters replaced by their arguments."""
    return re.sub(r"\b\w+\b", lambda m: args.get(m.group(0), m.group(0)), ptype)


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

    # The array methods launch.add_operands widens a residual with.
    def view(self, dtype):
        return _FakeArray(self.arr.view(dtype))

    def astype(self, dtype):
        return _FakeArray(self.arr.astype(dtype))

    def __lshift__(self, bits):
        return _FakeArray(self.arr << bits)


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
    mod.copyto = lambda dst, src: np.copyto(dst.arr, src.arr)
    mod.may_share_memory = lambda a, b: np.may_share_memory(a.arr, b.arr)
    mod.zeros = lambda shape, dtype: _FakeArray(np.zeros(shape, dtype))
    return mod


def _check_call(sigs, expr, grid, block, args):
    kind, targs = _template_args(expr)
    a_dtype = np.dtype(targs["A"].replace("float", "float32").replace("double", "float64"))
    params = sigs[kind]
    assert len(args) == len(params), (expr, len(args), len(params))
    for i, (ptype, arg) in enumerate(zip(params, args, strict=True)):
        where = f"{expr} argument {i} ({ptype})"
        if ptype.endswith("*"):
            base = ptype.replace("const", "").replace("*", "").strip()
            if isinstance(arg, np.uint64):
                assert arg == 0 and (base == "A" or (kind, i) in _NULLABLE), \
                    f"{where}: only parameters may be null"
                continue
            assert isinstance(arg, _FakeArray), where
            if base == "A":
                assert arg.dtype == a_dtype, where
            else:
                assert arg.itemsize == _C_SIZES[targs.get(base, base)], where
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
        g = int(targs["G"])
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
    # Strided rows take the row kernels with an element stride (few rows: cols would
    # leave most SMs idle), as does every-other-element slicing.
    yield "fortran", np.asfortranarray(base[:, :n]).reshape(6, n, 1), "rows"
    wide = rng.standard_normal((6, 2 * n)).astype(npdt)
    yield "strided", wide[:, ::2].reshape(6, n, 1), "rows"


def test_strided_rows_family(monkeypatch):
    """Fortran-order rows take the cols kernels only when they fill every SM."""
    monkeypatch.setattr(launch, "_sm_count", lambda device_id: 132)
    x = np.asfortranarray(np.zeros((4096, 300), np.float32)).reshape(4096, 300, 1)
    assert launch._family(_FakeArray(x), 0) == "rows"  # 4096 < 32 rows * 132 SMs
    monkeypatch.setattr(launch, "_sm_count", lambda device_id: 8)
    assert launch._family(_FakeArray(x), 0) == "cols"  # 4096 >= 32 rows * 8 SMs
    assert launch._family(_FakeArray(x[:100]), 0) == "rows"
    strided = np.zeros((4096, 600), np.float32)[:, ::2].reshape(4096, 300, 1)
    assert launch._family(_FakeArray(strided), 0) == "rows"  # elements closer than rows
    assert launch._family(_FakeArray(np.zeros((2, 300, 7), np.float32)), 0) == "cols"


def _record_launches(monkeypatch) -> list:
    """Launches go to a list of ``(expression, grid, block, args)`` instead of a GPU (a
    fake CuPy, an H100-like SM count)."""
    calls = []

    def fake_kernel(device_id, expr):
        def run(grid, block, args):
            calls.append((expr, grid, block, args))
        return run

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(launch, "_kernel", fake_kernel)
    monkeypatch.setattr(launch, "_sm_count", lambda device_id: 132)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [5, 64, 1000, 40000])
def test_launch_arguments_match_kernel_signatures(monkeypatch, dtype, n):
    """Every launch passes the kernel's parameters in order, with the right C types."""
    sigs = _signatures()
    assert set(sigs) == {"fwd_rows", "fwd_cols", "bwd_rows", "bwd_cols", "param_partials",
                         "sum_partials", "add_fwd_rows", "quant_fwd_rows", "quant_add_fwd_rows"}
    calls = _record_launches(monkeypatch)
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
        # grad_residual: a view of another layout than x's (its own strides).
        gres = _FakeArray(np.zeros(x.shape[::-1], x.dtype).transpose(2, 1, 0))
        launch.backward(x3, x3, mean, rstd, w, y3, dtype, rms=False, grad_residual=gres)
        kinds = [re.match(r"lnk::(\w+)<", c[0]).group(1) for c in calls]
        assert kinds == [f"fwd_{family}", f"fwd_{family}",
                         *[f"bwd_{family}", "param_partials", "sum_partials"] * 3], (name, kinds)
        assert all(isinstance(c[3][20], np.uint64) for c in calls[2:8:3])  # no grad_residual
        bwd_args = calls[8][3]
        assert bwd_args[20] is gres
        assert [int(v) for v in bwd_args[21:24]] == [int(s) // x.itemsize
                                                     for s in gres.strides]
        for expr, grid, block, args in calls:
            _check_call(sigs, expr, grid, block, args)
        fwd_args = calls[0][3]
        strides = [int(s) // x.itemsize for s in x.strides]
        assert fwd_args[5] == fwd_args[4].dtype.type(1) / fwd_args[4].dtype.type(n)  # inv_n
        assert [int(v) for v in fwd_args[8:11]] == [rows, n, x.shape[2]]
        assert float(fwd_args[11]) == 1.0 / x.shape[2]
        assert [int(v) for v in fwd_args[12:15]] == strides
        if name == "strided":
            assert [int(v) for v in fwd_args[12:14]] == [2 * n, 2]
        if family == "rows":
            aligned = name == "contiguous" and (n * x.itemsize) % 16 == 0
            assert int(fwd_args[-1]) == int(aligned), name
        else:
            cfg = launch.row_config(n, dtype)
            tile = cfg.g * cfg.maxc * launch.vector_width(dtype)
            assert [int(v) for v in fwd_args[-3:]] == [cfg.g, cfg.maxc, -(-n // tile)]


#: (x, residual, h) dtypes the engine routes to the fused kernels that have no
#: instantiation of their own: the residual is widened to float32 first.
WIDENED_ADD_DTYPES = (("float16", "bfloat16", "float32"), ("bfloat16", "float16", "bfloat16"),
                      ("float32", "float16", "float32"), ("float32", "bfloat16", "float32"))


def _np_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("dtypes", [*launch.ADD_DTYPES, *WIDENED_ADD_DTYPES])
@pytest.mark.parametrize("n", [1, 5, 64, 1000, 40000])
def test_add_launch_arguments_match_kernel_signature(monkeypatch, dtypes, n):
    """add_forward passes add_fwd_rows its parameters in order with the right C types,
    the configuration forward uses for h's dtype, and the widened residual where the
    dtypes have no instantiation."""
    sigs = _signatures()
    calls = _record_launches(monkeypatch)
    x_name, r_name, h_name = dtypes
    acc = "float64" if x_name == "float64" else "float32"
    rng = np.random.default_rng(n)
    rows = 6
    base = {d: rng.standard_normal((rows, n + 9)).astype(_np_dtype(d)) for d in set(dtypes)}
    layouts = {  # name: (x, r, h, y), each (rows, n, 1); rows of unit stride
        "contiguous": [base[d][:, :n].copy() for d in (x_name, r_name, h_name, x_name)],
        "misaligned": [base[d][:, 1:n + 1] for d in (x_name, r_name, h_name, x_name)],
        "row-strided": [base[d][:, :n] for d in (x_name, r_name, h_name, x_name)],
    }
    w = _FakeArray(np.ones(n, acc))
    want = dtypes if dtypes in launch.ADD_DTYPES else (x_name, "float32", h_name)
    cfg = launch.row_config(n, h_name)
    for name, arrays in layouts.items():
        x3, r3, h3, y3 = (_FakeArray(a.reshape(rows, n, 1)) for a in arrays)
        mean, rstd = _FakeArray(np.empty(rows, acc)), _FakeArray(np.empty(rows, acc))
        calls.clear()
        launch.add_forward(x3, r3, w, w, 1e-5, h3, y3, mean, rstd, dtypes, rms=False)
        launch.add_forward(x3, r3, None, None, 1e-5, h3, y3, None, rstd, dtypes, rms=True)
        assert [c[0] for c in calls] == [launch.add_expression(want, cfg[:2], rms)
                                         for rms in (False, True)]
        for expr, grid, block, args in calls:
            _check_call(sigs, expr, grid, block, args)
            assert args[0] is x3 and args[2] is h3 and args[3] is y3
            if want == dtypes:
                assert args[1] is r3
            else:  # the widened copy: the same values, exactly
                np.testing.assert_array_equal(args[1].arr, r3.arr.astype(np.float32))
            acc_t = np.dtype(acc).type
            assert type(args[7]) is acc_t and args[7] == acc_t(1) / acc_t(n)  # inv_n
            strides = [int(a.strides[0]) // a.itemsize for a in args[:4]]
            assert [int(v) for v in args[10:16]] == [rows, n, *strides]
            # Vector accesses of h's width where every array's rows start aligned.
            vec = launch.vector_width(h_name)
            aligned = all(a.data.ptr % 16 == 0 and (int(a.strides[0]) // a.itemsize) % vec == 0
                          for a in args[:4])
            assert int(args[16]) == int(aligned), name
            if name == "contiguous" and n % vec == 0:
                assert aligned
            if name == "misaligned":
                assert not aligned
    # Rows of another stride, or columns, are not the fused kernel's.
    x3 = _FakeArray(base[x_name][:, :n].reshape(rows, 1, n))
    if n > 1:
        with pytest.raises(ValueError, match="unit stride"):
            launch.add_forward(x3, x3, None, None, 1e-5, x3, x3, None, rstd, dtypes, rms=True)


# ------------------------------------------------ the kernels on a host emulation of CUDA
#
# The CUDA source itself, compiled with g++ against a tiny emulation of the CUDA features
# it uses (one fiber per CUDA thread on one host thread, barriers for __syncthreads and
# warp shuffles, blocks one after another) and launched through launch.py's real
# forward/backward code on NumPy memory. This checks the algorithm without a GPU:
# results against the float64 reference, and the bitwise guarantees across layouts,
# alignment and batch position.
# (The GPU's approximate sqrt/division (--prec-sqrt=false --prec-div=false) and float16
# conversions may differ from the host's exact ones in the last bit, so these results
# are compared with each other, never with the GPU's: every bitwise guarantee here is
# "same inputs, same instruction sequence", which holds for any deterministic sqrt.
# Flush-to-zero needs no model: the kernels are compiled with --ftz=false, and the
# host's default arithmetic is IEEE with subnormals, the same policy.)

_EMULATION_PRELUDE = r"""
// Host emulation of the few CUDA features the kernels use. Every CUDA thread of a block
// is a fiber on one host thread; a barrier (__syncthreads, a warp's shuffle)
// parks the fiber until the last thread of its block or warp arrives. The scheduler
// resumes the fibers in turn, in alternate directions from round to round, so a missing
// barrier shows up either way (the first or the last thread runs ahead); it aborts when a
// whole round makes no progress (a barrier some thread never reaches). Blocks run one by
// one, as on a GPU with one SM.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 { unsigned x = 1, y = 1, z = 1; };
dim3 threadIdx, blockIdx, blockDim, gridDim;

struct EmuBarrier { unsigned count = 0, arrived = 0, generation = 0; };
struct EmuWarp { EmuBarrier bar; unsigned size = 0; unsigned char slots[32][16]; };
struct EmuFiber;
static EmuFiber* emu_current;
static void emu_to_scheduler();
static EmuWarp* emu_warp;
static int emu_lane;
static EmuBarrier emu_block;
static unsigned long long emu_progress;  // barrier arrivals and finished threads

__attribute__((noinline)) static void emu_wait(EmuBarrier& bar) {
  const unsigned generation = bar.generation;
  ++emu_progress;
  if (++bar.arrived == bar.count) { bar.arrived = 0; ++bar.generation; return; }
  while (bar.generation == generation) emu_to_scheduler();
}

inline void __syncthreads() { emu_wait(emu_block); }
template <typename V> V __shfl_xor_sync(unsigned, V v, int off) {
  static_assert(sizeof(V) <= 16, "shuffle size");
  EmuWarp* const warp = emu_warp;
  const int lane = emu_lane;
  std::memcpy(warp->slots[lane], &v, sizeof(V));
  emu_wait(warp->bar);
  V o;
  std::memcpy(&o, warp->slots[lane ^ off], sizeof(V));
  emu_wait(warp->bar);
  return o;
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu_wait(emu_warp->bar); }
inline int __any_sync(unsigned, int p) {
  EmuWarp* const warp = emu_warp;
  std::memcpy(warp->slots[emu_lane], &p, sizeof(p));
  emu_wait(warp->bar);
  int any = 0;
  for (unsigned l = 0; l < warp->size; ++l) {
    int v;
    std::memcpy(&v, warp->slots[l], sizeof(v));
    any |= v != 0;
  }
  emu_wait(warp->bar);
  return any;
}
template <typename V> V __ldg(const V* p) { return *p; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __fdiv_rn(float a, float b) { return a / b; }  // IEEE on the host too
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

static void (*emu_body)(void*);
static void* emu_body_arg;

static void emu_thread_main();

#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
// The fiber switch: callee-saved registers, the SSE and x87 control words and the stack
// pointer (glibc's swapcontext also saves the signal mask, a system call per switch).
struct EmuFiber { void* sp; dim3 tid; EmuWarp* warp; int lane; bool done; };
extern "C" void emu_switch(void** save_sp, void* sp);
asm(R"(
  .text
  .p2align 4
  .hidden emu_switch
  .globl emu_switch
  .type emu_switch, @function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch, .-emu_switch
)");
static void* emu_scheduler_sp;
static void emu_to_scheduler() { emu_switch(&emu_current->sp, emu_scheduler_sp); }
static void emu_to_fiber(EmuFiber& f) { emu_switch(&emu_scheduler_sp, f.sp); }
[[noreturn]] static void emu_fiber_entry() {  // entered by emu_switch's ret
  emu_thread_main();
  for (;;) emu_to_scheduler();  // never resumed: the fiber is done
}
static void emu_start(EmuFiber& f, char* stack, size_t bytes) {
  auto* top = reinterpret_cast<uint64_t*>(
      reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15));
  *--top = 0;  // so that the entry sees rsp % 16 == 8, as after a call
  *--top = reinterpret_cast<uint64_t>(&emu_fiber_entry);
  for (int r = 0; r < 6; ++r) *--top = 0;  // rbp rbx r12-r15
  uint32_t control[2] = {0, 0};
  asm volatile("stmxcsr %0" : "=m"(control[0]));
  asm volatile("fnstcw %0" : "=m"(control[1]));
  std::memcpy(--top, control, 8);
  f.sp = top;
}
#else  // elsewhere (and with -DEMU_UCONTEXT): glibc's contexts
struct EmuFiber { ucontext_t ctx; dim3 tid; EmuWarp* warp; int lane; bool done; };
static ucontext_t emu_scheduler;
static void emu_to_scheduler() { swapcontext(&emu_current->ctx, &emu_scheduler); }
static void emu_to_fiber(EmuFiber& f) { swapcontext(&emu_scheduler, &f.ctx); }
static void emu_start(EmuFiber& f, char* stack, size_t bytes) {
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = stack;
  f.ctx.uc_stack.ss_size = bytes;
  f.ctx.uc_link = &emu_scheduler;
  makecontext(&f.ctx, emu_thread_main, 0);
}
#endif

static void emu_thread_main() {
  emu_body(emu_body_arg);
  emu_current->done = true;
  ++emu_progress;
}  // then back to the scheduler, for good

// One stack per CUDA thread, mapped once per library (pages are touched as used).
constexpr size_t emu_stack_bytes = 256 * 1024;
static char* emu_stack(unsigned t) {
  static char* stacks = nullptr;
  if (!stacks) {
    void* p = mmap(nullptr, 1024 * emu_stack_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) { std::perror("emulation: mmap"); std::abort(); }
    stacks = static_cast<char*>(p);
    for (unsigned t = 0; t < 1024; ++t)  // a guard page below each: overflow faults
      mprotect(stacks + t * emu_stack_bytes, 4096, PROT_NONE);
  }
  return stacks + t * emu_stack_bytes;
}

template <typename F>
void emu_launch(unsigned grid, unsigned bx, unsigned by, F body) {
  gridDim = {grid, 1, 1};
  blockDim = {bx, by, 1};
  const unsigned nt = bx * by;
  if (nt > 1024) { std::fprintf(stderr, "emulation: %u threads\n", nt); std::abort(); }
  emu_body = [](void* f) { (*static_cast<F*>(f))(); };
  emu_body_arg = &body;
  std::vector<EmuFiber> fibers(nt);
  std::vector<EmuWarp> warps((nt + 31) / 32);
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx = {b, 0, 0};
    emu_block = {nt, 0, 0};
    for (unsigned w = 0; w < warps.size(); ++w) {
      warps[w].size = std::min(32u, nt - 32 * w);
      warps[w].bar = {warps[w].size, 0, 0};
    }
    for (unsigned t = 0; t < nt; ++t) {
      EmuFiber& f = fibers[t];
      emu_start(f, emu_stack(t), emu_stack_bytes);
      f.tid = {t % bx, t / bx, 0};
      f.warp = &warps[t / 32];
      f.lane = t % 32;
      f.done = false;
    }
    for (unsigned round = 0, live = nt; live; ++round) {
      const unsigned long long before = emu_progress;
      live = 0;
      for (unsigned i = 0; i < nt; ++i) {
        EmuFiber& f = fibers[round % 2 ? nt - 1 - i : i];
        if (f.done) continue;
        threadIdx = f.tid;
        emu_warp = f.warp;
        emu_lane = f.lane;
        emu_current = &f;
        emu_to_fiber(f);
        live += !f.done;
      }
      if (live && emu_progress == before) {
        std::fprintf(stderr, "emulation: deadlock, %u threads wait at a barrier\n", live);
        std::abort();
      }
    }
  }
}
"""


_BARRIER_PROBE = r"""
__global__ void rotate(const int* in, int* out, int* shuffled, int sync) {
  __shared__ int slot[256];
  const unsigned t = threadIdx.x + blockDim.x * threadIdx.y;
  const unsigned n = blockDim.x * blockDim.y;
  slot[t] = in[blockIdx.x * n + t];
  if (sync) __syncthreads();
  out[blockIdx.x * n + t] = slot[(t + 1) % n];
  shuffled[blockIdx.x * n + t] = __shfl_xor_sync(0xffffffffu, (int)t, 5);
  if (sync) __syncthreads();
}
extern "C" void run(unsigned g, unsigned bx, unsigned by, const int* in, int* out,
                    int* shuffled, int sync) {
  emu_launch(g, bx, by, [=] { rotate(in, out, shuffled, sync); });
}
extern "C" void stall(void) {  // thread 0 never reaches the barrier the others wait at
  emu_launch(1, 64, 1, [] { if (threadIdx.x) __syncthreads(); });
}
"""


@pytest.mark.parametrize("switch", ["default", "ucontext"])
def test_emulation_models_barriers_and_shuffles(tmp_path, switch):
    """The emulation itself, with each fiber switch (x86-64's own and glibc's contexts,
    the fallback elsewhere): a kernel that reads its neighbour's shared slot is right
    with the barrier and wrong without it (a missing __syncthreads is caught), warp
    shuffles exchange lanes, blocks and the 2-D thread index are numbered as on a GPU,
    and a barrier that a thread never reaches stops the process instead of hanging."""
    import ctypes

    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the host emulation")
    src = tmp_path / "probe.cpp"
    src.write_text(_EMULATION_PRELUDE + _BARRIER_PROBE)
    lib_path = tmp_path / "probe.so"
    define = ["-DEMU_UCONTEXT"] if switch == "ucontext" else []
    proc = subprocess.run(["g++", "-std=c++20", "-O0", "-shared", "-fPIC", *define, str(src),
                           "-o", str(lib_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    lib = ctypes.CDLL(str(lib_path))
    grid, bx, by = 3, 32, 8
    n = bx * by
    data = np.random.default_rng(0).integers(1, 10**6, (grid, n), dtype=np.int32)
    expected = np.roll(data, -1, axis=1)
    lane = np.arange(n) % 32
    for sync in (1, 0):
        out, shuffled = np.zeros_like(data), np.zeros_like(data)
        lib.run(ctypes.c_uint(grid), ctypes.c_uint(bx), ctypes.c_uint(by),
                data.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                shuffled.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(sync))
        np.testing.assert_array_equal(shuffled, np.broadcast_to(np.arange(n) - lane
                                                                + (lane ^ 5), data.shape))
        if sync:
            np.testing.assert_array_equal(out, expected)
        else:
            assert not np.array_equal(out, expected), "a missing barrier went unnoticed"
    stalled = subprocess.run(
        [sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(lib_path)!r}).stall()"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert stalled.returncode != 0 and "deadlock" in stalled.stderr, stalled.stderr


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
        kind, targs = _template_args(expr)
        name = "run_" + hashlib.sha1(expr.encode()).hexdigest()[:16]
        names[expr] = name
        lines.append(f'extern "C" void {name}(unsigned g, unsigned bx, unsigned by, '
                     "const uint64_t* a) {")
        params = []
        for i, ptype in enumerate(sigs[kind]):
            ctype = _c_type(ptype, targs)
            lines.append(f"  {ctype.replace('i64', 'long long')} p{i}; "
                         f"std::memcpy(&p{i}, &a[{i}], sizeof(p{i}));")
            params.append(f"p{i}")
        lines.append(f"  emu_launch(g, bx, by, [=] {{ {expr}({', '.join(params)}); }});")
        lines.append("}")
    src = workdir / "emulation.cpp"
    src.write_text("\n".join(lines))
    lib = workdir / "emulation.so"
    # The same -D defines as the GPU compile (launch.DEFINES: the one definition).
    defines = [f"-D{k}={v}" for k, v in launch.DEFINES.items()]
    proc = subprocess.run(["g++", "-std=c++20", "-O0", "-fno-strict-aliasing", "-shared",
                           "-ffp-contract=off", "-fPIC", *defines, f"-I{workdir}",
                           f"-I{kdir}", str(src), "-o", str(lib)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return ctypes.CDLL(str(lib)), names


def _pack(arg) -> int:
    if isinstance(arg, _FakeArray):
        return arg.data.ptr
    arg = np.asarray(arg)
    return int(arg.view(np.uint32 if arg.dtype.itemsize == 4 else np.uint64))


def _config_lengths(dtype):
    """{(G, MAXC): row lengths}: per configuration, a length whose rows take the 16-byte
    vector path with some lanes past the row end where the configuration allows (a
    multiple of the vector width), and one with a scalar tail (not a multiple); for the
    largest configuration also two and three tiles (the tile loop)."""
    vec = launch.vector_width(dtype)
    out = {}
    for g, maxc in launch.CONFIGS:
        tile = g * maxc * vec

        def first(candidates, g=g, maxc=maxc):
            return next(n for n in candidates
                        if n > 0 and launch.row_config(n, dtype)[:2] == (g, maxc))

        out[(g, maxc)] = [first((tile - vec, tile)),
                          first(n for n in (tile - 3, tile - 1) if n % vec)]
    out[launch.CONFIGS[-1]] += [2048 * vec + vec, 3 * 2048 * vec - 5]
    return out


_NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
       "float64": np.float64}
_ATOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5, "float64": 1e-12}
_GATOL = {"float16": 2e-2, "bfloat16": 1.5e-1, "float32": 5e-5, "float64": 1e-11}


class _Emulator:
    """launch.py's real forward/backward on NumPy memory, kernels run by the emulation.

    ``cap`` limits every grid (None: launch.py's own grid), standing in for a GPU with
    very few SMs: with a cap of 1 every kernel runs its grid-stride loop.
    """

    def __init__(self, lib, names) -> None:
        self.names, self.cap = {}, 1
        self.add(lib, names)

    def add(self, lib, names) -> None:
        """Kernels of another emulated library (``{expression: symbol}``)."""
        self.names.update({expr: (lib, name) for expr, name in names.items()})

    def kernel(self, device_id, expr):
        import ctypes

        lib, name = self.names[expr]
        fn = getattr(lib, name)

        def run(grid, block, args):
            packed = (ctypes.c_uint64 * len(args))(*[_pack(a) for a in args])
            fn(ctypes.c_uint(int(grid[0])), ctypes.c_uint(int(block[0])),
               ctypes.c_uint(int(block[1]) if len(block) > 1 else 1), packed)
        return run

    def install(self, monkeypatch) -> None:
        grid = launch._grid

        def capped(device_id, units, per_block, threads):
            g = grid(device_id, units, per_block, threads)
            return g if self.cap is None else min(g, self.cap)

        monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
        monkeypatch.setattr(launch, "_kernel", self.kernel)
        monkeypatch.setattr(launch, "_sm_count", lambda device_id: 132)
        monkeypatch.setattr(launch, "_grid", capped)


def _all_emulated_expressions() -> list[str]:
    exprs = set()
    for dtype in DTYPES:
        for cfg in launch.CONFIGS:
            for rms in (False, True):
                exprs |= {launch.expression(k, dtype, cfg, rms) for k in ("fwd_rows",
                                                                          "bwd_rows")}
        for rms in (False, True):
            exprs |= {launch.expression(k, dtype, rms=rms)
                      for k in ("fwd_cols", "bwd_cols", "param_partials")}
    exprs |= {launch.expression("sum_partials", d) for d in ("float32", "float64")}
    return sorted(exprs)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """Every kernel instantiation compiled once for the host (g++), shared by the tests."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the host emulation")
    lib, names = _emulated_library(_all_emulated_expressions(),
                                   tmp_path_factory.mktemp("emulation"))
    return _Emulator(lib, names)


def _emu_forward(x3, dtype, rms, w, b, eps=1e-5, y3=None):
    acc = "float64" if dtype == "float64" else "float32"
    rows = x3.shape[0] * x3.shape[2]
    if y3 is None:  # poisoned: every element is written
        y3 = np.full(x3.shape, np.nan, dtype=x3.dtype)
    mean, rstd = np.full(rows, np.nan, acc), np.full(rows, np.nan, acc)
    launch.forward(_FakeArray(x3), None if w is None else _FakeArray(w),
                   None if b is None else _FakeArray(b), eps, _FakeArray(y3),
                   None if rms else _FakeArray(mean), _FakeArray(rstd), dtype, rms)
    return y3, mean, rstd


def _emu_backward(gy3, x3, mean, rstd, w, dtype, rms):
    gx3 = np.full(x3.shape, np.nan, dtype=x3.dtype)
    gw, gb = launch.backward(_FakeArray(gy3), _FakeArray(x3),
                             None if rms else _FakeArray(mean), _FakeArray(rstd),
                             None if w is None else _FakeArray(w), _FakeArray(gx3), dtype, rms)
    return gx3, gw.arr, (None if gb is None else gb.arr)


def _same_bits(a, b, what):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    ua, ub = a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")
    assert np.array_equal(ua, ub), f"{what}: {int((ua != ub).sum())} elements differ"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulation_every_configuration(emulator, monkeypatch, dtype):
    """Every (G, MAXC) configuration, through launch.py, with grid-stride loops (grids of
    one block): against the reference, and bit for bit across the 16-byte vector
    path, the scalar path (misaligned view), strided rows (row kernels with an element
    stride), channels-first (cols kernels) and a row alone."""
    from . import reference

    emulator.install(monkeypatch)
    emulator.cap = 1
    for (g, _maxc), lengths in _config_lengths(dtype).items():
        for k, n in enumerate(lengths):
            per_block = 1 if g > 32 else 128 // g
            # One block: its grid-stride loop covers the rows (a last partial group);
            # the vector-path length meets the row-kernel layouts, the tail length the
            # cols kernels (both compared with the same contiguous run).
            _check_emulated(reference, dtype, n, rows=per_block + 3,
                            layouts=("misaligned", "strided") if k == 0 else
                            ("channels-first",))


def _check_emulated(reference, dtype, n, rows, layouts):
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
    wide, gwide = np.zeros((rows, 2 * n), x.dtype), np.zeros((rows, 2 * n), x.dtype)
    wide[:, ::2], gwide[:, ::2] = x, gy
    views = {  # name: (x3, gy3, back-to-(rows, n))
        "channels-first": (np.ascontiguousarray(x.T)[None], np.ascontiguousarray(gy.T)[None],
                           lambda a: a[0].T),
        "misaligned": (big[1:, 1:].reshape(rows, n, 1), gbig[1:, 1:].reshape(rows, n, 1),
                       lambda a: a[:, :, 0]),
        "strided": (wide[:, ::2].reshape(rows, n, 1), gwide[:, ::2].reshape(rows, n, 1),
                    lambda a: a[:, :, 0]),
    }
    x3 = x.reshape(rows, n, 1)
    vec = launch.vector_width(dtype)
    assert launch._aligned(_FakeArray(x3), vec) == (n % vec == 0)  # which path is tested
    for rms in (False, True):
        tag = f"{dtype} n={n} rows={rows} {'rms' if rms else 'layer'}_norm"
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
        for name in layouts:
            xv, gv, back = views[name]
            yv, mv, sv = _emu_forward(xv, dtype, rms, w, None if rms else b)
            _same_bits(back(yv), y[:, :, 0], f"{tag} y, {name}")
            _same_bits(sv, rstd, f"{tag} rstd, {name}")
            gxv, gwv, gbv = _emu_backward(gv, xv, mean, rstd, w, dtype, rms)
            _same_bits(back(gxv), gx[:, :, 0], f"{tag} grad_x, {name}")
            _same_bits(gwv, gw, f"{tag} grad_weight, {name}")
            if not rms:
                _same_bits(mv, mean, f"{tag} mean, {name}")
                _same_bits(gbv, gb, f"{tag} grad_bias, {name}")
        r = rows - 1
        alone, _, _ = _emu_forward(x[r:r + 1].reshape(1, n, 1).copy(), dtype, rms, w,
                                   None if rms else b)
        _same_bits(alone[0, :, 0], y[r, :, 0], f"{tag} row {r} alone")
    constant = np.full((3, n), 1e4 / 3).astype(_NP[dtype])
    yc, _, _ = _emu_forward(constant.reshape(3, n, 1), dtype, False, w, b)
    _same_bits(yc[:, :, 0], np.broadcast_to(b.astype(_NP[dtype]), (3, n)),
               f"{dtype} n={n} constant rows give exactly bias")


def _tree_model(parts):
    """The kernel's tree over row blocks, written as levels of SUM_FAN (as launched)."""
    fan = launch.SUM_FAN
    while parts.shape[0] > 1:
        out = []
        for j in range(0, parts.shape[0], fan):
            v = list(parts[j:j + fan])
            w = 1
            while w < fan:
                for k in range(0, fan - w, 2 * w):
                    if k + w < len(v):
                        v[k] = v[k] + v[k + w]
                w *= 2
            out.append(v[0])
        parts = np.stack(out)
    return parts[0]


def _binary_tree(parts):
    """Neighbour pairs, level by level, an odd last one carried up: one binary tree."""
    parts = list(parts)
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_emulation_parameter_gradient_tree(emulator, monkeypatch, dtype):
    """Several gradient blocks and two tree levels: the bits are those of the binary tree
    over fixed 64-row blocks, the same for any grid (1, 3 blocks or launch.py's own)."""
    emulator.install(monkeypatch)
    rows, n = launch.GRAD_ROW_BLOCK * (launch.SUM_FAN + 2) + 5, 7  # 19 blocks, 2 levels
    rng = np.random.default_rng(7)
    x = (1 + rng.standard_normal((rows, n))).astype(_NP[dtype])
    gy = rng.standard_normal((rows, n)).astype(_NP[dtype])
    acc = np.float64 if dtype == "float64" else np.float32
    w = (1 + 0.3 * rng.standard_normal(n)).astype(acc)
    x3, gy3 = x.reshape(rows, n, 1), gy.reshape(rows, n, 1)
    emulator.cap = None
    _, mean, rstd = _emu_forward(x3, dtype, False, w, None)
    results = {}
    for cap in (None, 1, 3):
        emulator.cap = cap
        results[cap] = _emu_backward(gy3, x3, mean, rstd, w, dtype, rms=False)
        fortran = np.asfortranarray(x), np.asfortranarray(gy)
        results[f"{cap}-fortran"] = _emu_backward(fortran[1].reshape(rows, n, 1),
                                                  fortran[0].reshape(rows, n, 1), mean, rstd,
                                                  w, dtype, rms=False)
    for key, (_, gw, gb) in results.items():
        _same_bits(gw, results[None][1], f"grad_weight, grid cap {key}")
        _same_bits(gb, results[None][2], f"grad_bias, grid cap {key}")
    # The partials as param_partials computes them (rows in order within a block) ...
    xa, ga = x.astype(acc), gy.astype(acc)
    sw, sb = [], []
    for r0 in range(0, rows, launch.GRAD_ROW_BLOCK):
        a, b = np.zeros(n, acc), np.zeros(n, acc)
        for r in range(r0, min(rows, r0 + launch.GRAD_ROW_BLOCK)):
            xh = (xa[r] - mean[r]) * rstd[r]
            a = a + ga[r] * xh
            b = b + ga[r]
        sw.append(a)
        sb.append(b)
    sw, sb = np.stack(sw), np.stack(sb)
    # ... summed in the one binary tree: exactly the kernels' bits.
    _same_bits(_tree_model(sw), _binary_tree(sw), "tree levels nest into one binary tree")
    _same_bits(results[None][1], _binary_tree(sw), "grad_weight vs the binary-tree model")
    _same_bits(results[None][2], _binary_tree(sb), "grad_bias vs the binary-tree model")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulation_subnormal_variance_is_normalized(emulator, monkeypatch, dtype):
    """eps=0 and squared deviations below float32's normal range (~1e-38): the kernels
    are compiled without flush-to-zero (launch.OPTIONS), which the host's IEEE arithmetic
    models, and such rows (rstd above 2**59) are rescaled, so the row is normalized as on
    the CPU, to full accuracy, not turned into inf/NaN."""
    from . import reference

    emulator.install(monkeypatch)
    rng = np.random.default_rng(3)
    n = 256
    x = (3e-21 * rng.standard_normal((4, n))).astype(_NP[dtype])
    y, _, rstd = _emu_forward(x.reshape(4, n, 1), dtype, False, None, None, eps=0.0)
    assert np.all(np.isfinite(rstd)) and np.all(np.isfinite(y.astype(np.float64)))
    y_ref, _, _ = reference.layer_norm(x, (1,), None, None, eps=0.0)
    np.testing.assert_allclose(y[:, :, 0].astype(np.float64), y_ref.astype(np.float64),
                               atol=_ATOL[dtype] * np.abs(y_ref).max())


@pytest.mark.slow
def test_emulation_constant_rows_with_a_tiny_eps(emulator, monkeypatch):
    """float64 constant rows with eps = 1e-305: their rstd, 1 / sqrt(eps), is beyond the
    fast path's limit (2**500), so the rescaled path takes them; it must not scale them
    down by their values (eps * s**2 would vanish): y is exactly the bias and rstd
    1 / sqrt(eps), in the row and the cols kernels. With eps = 0 they are NaN."""
    emulator.install(monkeypatch)
    n = 40
    x = np.empty((3, n))
    x[0], x[1], x[2] = 1e10, -7e200, 3.0
    b = np.linspace(-1.0, 1.0, n)
    layouts = {"rows": (x.reshape(3, n, 1), lambda a: a[:, :, 0]),
               "cols": (np.ascontiguousarray(x.T)[None], lambda a: a[0].T)}
    for name, (x3, back) in layouts.items():
        y, mean, rstd = _emu_forward(x3, "float64", False, None, b, eps=1e-305)
        assert np.array_equal(back(y), np.broadcast_to(b, (3, n))), name
        assert np.array_equal(mean, x[:, 0]), name
        np.testing.assert_allclose(rstd, 1 / np.sqrt(1e-305), rtol=1e-12, err_msg=name)
        y, _, _ = _emu_forward(x3, "float64", False, None, b, eps=0.0)
        assert np.isnan(back(y)).all(), name


@pytest.mark.slow
def test_emulation_rows_whose_spread_is_the_smallest_subnormal(emulator, monkeypatch):
    """float64 rows whose differences are units of 2**-1074, eps=0 (audit finding):
    measured on halves (rounded to 0) they looked constant and gave inf/NaN; the
    rescaled path measures them in full, in the row and the cols kernels."""
    emulator.install(monkeypatch)
    t = np.finfo(np.float64).smallest_subnormal
    x = np.array([[t, 0, 0, 0], [0, -t, 0, t], [3 * t, t, 2 * t, 0]], np.float64)
    units = (x - x[:, :1]) * 2.0**1000 * 2.0**74  # exact integers
    d = units - units.mean(1, keepdims=True)
    want = d / np.sqrt((d * d).mean(1, keepdims=True))
    layouts = {"rows": (x.reshape(3, 4, 1), lambda a: a[:, :, 0]),
               "cols": (np.ascontiguousarray(x.T)[None], lambda a: a[0].T)}
    for name, (x3, back) in layouts.items():
        y, _, _ = _emu_forward(x3, "float64", False, None, None, eps=0.0)
        np.testing.assert_allclose(back(y), want, rtol=0, atol=1e-12, err_msg=name)


def _rescaled_reference(x, w, b, rms, eps):
    """Float64 LayerNorm/RMSNorm of finite rows of any magnitude: each row scaled by the
    power of two that brings max|x| into [0.5, 1) (scale invariance), as the contract
    says; returns y and the unscaled row's mean and rstd."""
    x = x.astype(np.float64)
    e = np.frexp(np.abs(x).max(axis=1, keepdims=True))[1]
    xs = np.ldexp(x, -e)
    scaled_eps = np.ldexp(np.float64(eps), -2 * e)  # eps * s**2 (s**2 alone may overflow)
    mean = np.zeros_like(xs[:, :1]) if rms else xs.mean(axis=1, keepdims=True)
    rstd = 1 / np.sqrt(((xs - mean) ** 2).mean(axis=1, keepdims=True) + scaled_eps)
    y = (xs - mean) * rstd * w.astype(np.float64)
    if not rms:
        y = y + b.astype(np.float64)
    return y, np.ldexp(mean, e).ravel(), np.ldexp(rstd, -e).ravel()


@pytest.mark.slow
@pytest.mark.parametrize("magnitude", ["huge", "tiny"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_emulation_rows_whose_squares_overflow(emulator, monkeypatch, dtype, magnitude):
    """Rows scaled by 1e30 (float64: 1e300), whose sums of squares overflow the
    accumulation dtype, or by 1e-30 (1e-300) with eps = 0, whose squares underflow, are
    normalized as if scaled by a power of two first (API.md, Arithmetic), through the
    row kernels (contiguous: a few lanes per row, and a block per row), the strided-row
    kernels and the cols kernels; an ordinary row among them keeps the bits it has
    alone, and such rows holding a NaN or an infinity keep their rules (LayerNorm NaN,
    RMSNorm x * 0)."""
    emulator.install(monkeypatch)
    emulator.cap = 1  # grid-stride loops: the rescaled rows are followed by others
    big = {"huge": 1e300 if dtype == "float64" else 1e30,
           "tiny": 1e-300 if dtype == "float64" else 1e-30}[magnitude]
    acc = np.float64 if dtype == "float64" else np.float32
    eps = 1e-5 if magnitude == "huge" else 0.0
    for n in (40, 1000):  # float32: 8 lanes per row (16 rows a block); 128 threads per row
        rng = np.random.default_rng(n)
        x = (0.5 + 2 * rng.standard_normal((8, n)))
        x[1] *= big
        x[2] = big * (3 + rng.standard_normal(n))  # a large offset too
        x[3] = big * rng.standard_normal(n)
        x[3, 5] = np.nan
        x[4] = big * rng.standard_normal(n)
        x[4, 7] = np.inf
        x[6] = -big * np.abs(rng.standard_normal(n))
        x[7] = big * rng.standard_normal(n)
        x = x.astype(_NP[dtype])
        finite = [0, 1, 2, 5, 6, 7]
        w = (1 + 0.3 * rng.standard_normal(n)).astype(acc)
        b = (0.5 * rng.standard_normal(n)).astype(acc)
        wide = np.zeros((8, 2 * n), x.dtype)
        wide[:, ::2] = x
        layouts = {  # name: (x3, back-to-(rows, n))
            "rows": (x.reshape(8, n, 1), lambda a: a[:, :, 0]),
            "strided": (wide[:, ::2].reshape(8, n, 1), lambda a: a[:, :, 0]),
            "cols": (np.ascontiguousarray(x.T)[None], lambda a: a[0].T),
        }
        for rms in (False, True):
            tag = f"{dtype} n={n} {'rms' if rms else 'layer'}_norm"
            y_ref, mean_ref, rstd_ref = _rescaled_reference(x[finite], w, b, rms, eps)
            first = None
            for name, (x3, back) in layouts.items():
                what = f"{tag} {name}"
                y, mean, rstd = _emu_forward(x3, dtype, rms, w, None if rms else b, eps)
                y = back(y)
                yf = y[finite].astype(np.float64)
                np.testing.assert_allclose(yf, y_ref, rtol=0, err_msg=what,
                                           atol=_ATOL[dtype] * max(1, np.abs(y_ref).max()))
                tol = 1e-11 if dtype == "float64" else 2e-5
                np.testing.assert_allclose(rstd[finite], rstd_ref, rtol=tol, err_msg=what)
                assert np.all(rstd[[1, 2, 6, 7]] > 0), what  # not the overflowed 0
                if not rms:
                    np.testing.assert_allclose(mean[finite], mean_ref, rtol=tol,
                                               atol=tol * np.abs(x[0]).max(), err_msg=what)
                # NaN / infinity rows: the ordinary rules, not the rescaled path.
                if rms:
                    assert np.all(np.isnan(y[3].astype(np.float64))), what
                    y4 = y[4].astype(np.float64)
                    assert np.isnan(y4[7]) and np.all(np.delete(y4, 7) == 0), what
                    assert rstd[4] == 0, what
                else:
                    assert np.all(np.isnan(y[3:5].astype(np.float64))), what
                    assert np.all(np.isnan(rstd[3:5])), what
                # The ordinary row has the bits it has alone, in this layout.
                alone, _, _ = _emu_forward(x3[:1] if name != "cols" else x3[:, :, :1],
                                           dtype, rms, w, None if rms else b, eps)
                _same_bits(back(alone)[0], y[0], f"{what} ordinary row alone")
                # In place (out=x), the same bits: the threads of a rescaled row each
                # read the whole row, which raced with the others' stores into it.
                inplace = x3.copy()
                got, _, _ = _emu_forward(inplace, dtype, rms, w, None if rms else b, eps,
                                         y3=inplace)
                _same_bits(back(got), y, f"{what} in place")
                # The rescaled rows are a function of the row alone: the same bits in
                # every layout (a single sequential loop, whichever threads run it).
                if first is None:
                    first = (y, mean, rstd)
                else:
                    _same_bits(y[finite], first[0][finite], f"{what} y vs rows")
                    _same_bits(rstd[finite], first[2][finite], f"{what} rstd vs rows")
                    if not rms:
                        _same_bits(mean[finite], first[1][finite], f"{what} mean vs rows")


# --------------------------------------- the fused residual add (add_fwd_rows) emulated


@pytest.fixture(scope="module")
def add_emulator(emulator, tmp_path_factory):
    """The emulator, with every add_fwd_rows instantiation compiled for the host too."""
    exprs = [launch.add_expression(dtypes, cfg, rms) for dtypes in launch.ADD_DTYPES
             for cfg in launch.CONFIGS for rms in (False, True)]
    return _emulate_too(emulator, exprs, tmp_path_factory, "emulation-add")


def _emulate_too(emulator, exprs, tmp_path_factory, folder):
    """``emulator`` with the instantiations ``exprs`` compiled for the host too, in two
    g++ processes (about half the wait)."""
    from concurrent.futures import ThreadPoolExecutor

    halves = [exprs[::2], exprs[1::2]]
    with ThreadPoolExecutor(2) as pool:
        libs = list(pool.map(lambda part: _emulated_library(
            part, tmp_path_factory.mktemp(folder)), halves))
    for lib, names in libs:
        emulator.add(lib, names)
    return emulator


def _emu_add(x3, r3, dtypes, rms, w, b, eps=1e-5, h3=None, y3=None):
    """launch.add_forward on NumPy memory: (y3, h3, mean, rstd). ``h3``/``y3`` may be
    ``x3`` or ``r3`` (in place); fresh ones are poisoned with NaN."""
    acc = "float64" if dtypes[0] == "float64" else "float32"
    rows = x3.shape[0]
    if h3 is None:
        h3 = np.full(x3.shape, np.nan, dtype=_NP[dtypes[2]])
    if y3 is None:
        y3 = np.full(x3.shape, np.nan, dtype=x3.dtype)
    mean, rstd = np.full(rows, np.nan, acc), np.full(rows, np.nan, acc)
    launch.add_forward(_FakeArray(x3), _FakeArray(r3), None if w is None else _FakeArray(w),
                       None if b is None else _FakeArray(b), eps, _FakeArray(h3),
                       _FakeArray(y3), None if rms else _FakeArray(mean), _FakeArray(rstd),
                       dtypes, rms)
    return y3, h3, mean, rstd


def _same_bits_or_nan(a, b, what):
    """Bit for bit where ``b`` is a number; NaN exactly where ``b`` is NaN (the payload of a
    NaN rounded to 16 bits is the converter's, not the kernel's)."""
    fa, fb = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nan = np.isnan(fb)
    assert np.array_equal(np.isnan(fa), nan), f"{what}: NaN in other places"
    _same_bits(np.where(nan, 0, a).astype(a.dtype), np.where(nan, 0, b).astype(b.dtype), what)


def _check_add_against_unfused(dtypes, x, r, rms, w, b, what, eps=1e-5, **outs):
    """The fused kernel's h is NumPy's rounded sum and its y, mean and rstd are, bit for bit,
    the emulated unfused forward of that h (y rounded to x's dtype)."""
    x_name, _, h_name = dtypes
    rows, n = x.shape
    acc = np.float64 if x_name == "float64" else np.float32
    h_ref = (x.astype(acc) + r.astype(acc)).astype(_NP[h_name])
    y_u, mean_u, rstd_u = _emu_forward(h_ref.reshape(rows, n, 1).copy(), h_name, rms, w, b,
                                       eps)
    y_ref = y_u[:, :, 0].astype(_NP[x_name])
    y, h, mean, rstd = _emu_add(x.reshape(rows, n, 1), r.reshape(rows, n, 1), dtypes, rms, w,
                                b, eps, **outs)
    _same_bits_or_nan(h[:, :, 0], h_ref, f"{what} h")
    _same_bits_or_nan(y[:, :, 0], y_ref, f"{what} y vs unfused forward of h")
    _same_bits_or_nan(rstd, rstd_u, f"{what} rstd")
    if not rms:
        _same_bits_or_nan(mean, mean_u, f"{what} mean")
    return y, h, mean, rstd


def _add_inputs(dtypes, rows, n, seed):
    x_name, r_name, _ = dtypes
    rng = np.random.default_rng(seed)
    x = (0.5 + 2 * rng.standard_normal((rows, n))).astype(_NP[x_name])
    x[::5] = (300 + 20 * rng.standard_normal((len(x[::5]), n))).astype(_NP[x_name])
    r = (rng.standard_normal((rows, n)) - 0.25).astype(_NP[r_name])
    acc = np.float64 if x_name == "float64" else np.float32
    w = (1 + 0.3 * rng.standard_normal(n)).astype(acc)
    b = (0.5 * rng.standard_normal(n)).astype(acc)
    return x, r, w, b


def _every_configuration(dtypes):
    """{(G, MAXC): row lengths} of h's dtype, as for the unfused kernels."""
    return _config_lengths(dtypes[2])


def _widened_lengths(dtypes):
    """A few lanes per row, a warp, a block, and three tiles (for the widened residual,
    whose kernels the instantiated dtypes test in every configuration)."""
    vec = launch.vector_width(dtypes[2])
    return {launch.row_config(n, dtypes[2])[:2]: [n]
            for n in (3 * vec + 1, 64 * vec, 700 * vec - 3, 2 * 2048 * vec + 3)}


@pytest.mark.slow
@pytest.mark.parametrize("dtypes, lengths",
                         [*((d, _every_configuration) for d in launch.ADD_DTYPES),
                          *((d, _widened_lengths) for d in WIDENED_ADD_DTYPES)])
def test_emulation_add_every_configuration(add_emulator, monkeypatch, dtypes, lengths):
    """add_fwd_rows for every (G, MAXC) configuration of h's dtype (vector path with lanes
    past the row end, scalar tail, the tile loop), grids of one block (grid-stride loops,
    a last partial group): h is NumPy's (x + r) in the accumulation dtype rounded once,
    and y, mean and rstd are the unfused forward of h bit for bit, also from a misaligned
    view (the scalar path; vector-path lengths) or rows of a wider buffer (tail lengths),
    and for a row alone. The dtypes without an instantiation (residual widened first) on
    a few lengths."""
    add_emulator.install(monkeypatch)
    add_emulator.cap = 1
    h_name = dtypes[2]
    for (g, _maxc), ns in lengths(dtypes).items():
        for k, n in enumerate(ns):
            rows = (1 if g > 32 else 128 // g) + 3
            x, r, w, b = _add_inputs(dtypes, rows, n, n)
            vec = launch.vector_width(h_name)
            assert launch._aligned(_FakeArray(x.reshape(rows, n, 1)), vec) == (n % vec == 0)
            for rms in (False, True):
                tag = f"{dtypes} n={n} {'rms' if rms else 'layer'}_norm"
                bias = None if rms else b
                y, h, mean, rstd = _check_add_against_unfused(dtypes, x, r, rms, w, bias, tag)
                # A misaligned copy of every input, or rows of a wider buffer.
                for name, pad in [(("misaligned", (1, 1)), ("row-strided", (0, 3)))[k % 2]]:
                    views = []
                    for a in (x, r):
                        big = np.zeros((rows + 1, n + 4), a.dtype)
                        big[pad[0]:pad[0] + rows, pad[1]:pad[1] + n] = a
                        views.append(big[pad[0]:pad[0] + rows, pad[1]:pad[1] + n])
                    yv, hv, mv, sv = _emu_add(views[0][:, :, None], views[1][:, :, None],
                                              dtypes, rms, w, bias)
                    _same_bits(yv, y, f"{tag} y, {name}")
                    _same_bits(hv, h, f"{tag} h, {name}")
                    _same_bits(sv, rstd, f"{tag} rstd, {name}")
                    if not rms:
                        _same_bits(mv, mean, f"{tag} mean, {name}")
                k = rows - 1
                ya, ha, _, _ = _emu_add(x[k:k + 1, :, None].copy(), r[k:k + 1, :, None].copy(),
                                        dtypes, rms, w, bias)
                _same_bits(ya[0], y[k], f"{tag} row {k} alone")
                _same_bits(ha[0], h[k], f"{tag} h row {k} alone")


def _add_lengths(h_name):
    """Row lengths for a few lanes per row, a block per row, and three tiles."""
    vec = launch.vector_width(h_name)
    return [5 * vec + 3, 150 * vec + 1, 2 * 2048 * vec + 3]


@pytest.mark.slow
@pytest.mark.parametrize("dtypes", [("float32", "float32", "float32"),
                                    ("bfloat16", "bfloat16", "bfloat16"),
                                    ("float16", "float16", "float32"),
                                    ("bfloat16", "float32", "float32"),
                                    ("float64", "float64", "float64")])
def test_emulation_add_constant_and_nan_rows(add_emulator, monkeypatch, dtypes):
    """A row whose h is constant gives exactly the bias (y = 0 * rstd + b) and its rstd is
    1 / sqrt(eps); a NaN in x or r makes its row's h, y and statistics NaN (LayerNorm;
    RMSNorm: y NaN, as the unfused forward) and leaves the other rows' bits alone."""
    add_emulator.install(monkeypatch)
    add_emulator.cap = 1
    x_name, r_name, h_name = dtypes
    acc = np.float64 if x_name == "float64" else np.float32
    for n in _add_lengths(h_name):
        rows = 6
        x, r, w, b = _add_inputs(dtypes, rows, n, n + 1)
        x[1] = _NP[x_name](1e4 / 3)
        r[1] = _NP[r_name](0.375)
        x[3, n // 2] = np.nan
        r[4, n - 1] = np.nan
        for rms in (False, True):
            tag = f"{dtypes} n={n} {'rms' if rms else 'layer'}_norm"
            y, h, mean, rstd = _check_add_against_unfused(dtypes, x, r, rms, w,
                                                          None if rms else b, tag)
            h1 = (acc(x[1, 0]) + acc(r[1, 0])).astype(_NP[h_name])
            assert np.all(h[1] == h1), tag
            if not rms:
                _same_bits(y[1, :, 0], b.astype(_NP[x_name]), f"{tag} constant row is bias")
                assert rstd[1] == acc(1) / np.sqrt(acc(1e-5)) or abs(
                    rstd[1] * np.sqrt(1e-5) - 1) < 1e-6, tag
                assert np.all(np.isnan(mean[3:5])) and np.all(np.isnan(rstd[3:5])), tag
            assert np.all(np.isnan(y[3:5].astype(np.float64))), tag
            assert np.isnan(np.float64(h[3, n // 2, 0])) and np.isnan(np.float64(h[4, n - 1, 0]))
            for k in (0, 2, 5):
                ya, _, _, _ = _emu_add(x[k:k + 1, :, None].copy(), r[k:k + 1, :, None].copy(),
                                       dtypes, rms, w, None if rms else b)
                _same_bits(ya[0], y[k], f"{tag} row {k} beside NaN rows")


@pytest.mark.slow
@pytest.mark.parametrize("dtypes", [("float32", "float32", "float32"),
                                    ("bfloat16", "bfloat16", "bfloat16"),
                                    ("bfloat16", "float32", "float32"),
                                    ("float64", "float64", "float64")])
def test_emulation_add_rows_whose_squares_overflow(add_emulator, monkeypatch, dtypes):
    """Rows of h scaled by 1e30 (float64: 1e300) take the rescaled path: h is stored
    first and the row read back from it; with a NaN or an infinity as well the rescaled
    path declines and the packs are reloaded from h. Bit for bit the unfused forward of
    h, for a few lanes per row, a block per row and three tiles."""
    add_emulator.install(monkeypatch)
    add_emulator.cap = 1
    x_name, r_name, h_name = dtypes
    big = 1e300 if x_name == "float64" else 1e30
    for n in _add_lengths(h_name):
        rng = np.random.default_rng(n)
        rows = 6
        x = 0.5 + 2 * rng.standard_normal((rows, n))
        x[1] *= big
        x[2] = big * (3 + rng.standard_normal(n))
        x[3] = big * rng.standard_normal(n)
        x[3, 5] = np.nan
        x[4] = big * rng.standard_normal(n)
        x[4, 7] = np.inf
        x = x.astype(_NP[x_name])
        r = (big * 1e-3 * rng.standard_normal((rows, n))).astype(_NP[r_name])
        acc = np.float64 if x_name == "float64" else np.float32
        w = (1 + 0.3 * rng.standard_normal(n)).astype(acc)
        b = (0.5 * rng.standard_normal(n)).astype(acc)
        for rms in (False, True):
            tag = f"{dtypes} n={n} {'rms' if rms else 'layer'}_norm"
            y, _, _, rstd = _check_add_against_unfused(dtypes, x, r, rms, w,
                                                       None if rms else b, tag)
            assert np.all(rstd[[1, 2]] > 0) and np.all(np.isfinite(rstd[[1, 2]])), tag
            assert np.all(np.isfinite(y[[0, 1, 2, 5]].astype(np.float64))), tag


#: (out, residual_out) targets: y into x or r, h into x or r, and both.
_ALIASES = [("x", None), ("r", None), (None, "x"), (None, "r"), ("x", "r"), ("r", "x")]


@pytest.mark.slow
@pytest.mark.parametrize("dtypes", [("float32", "float32", "float32"),
                                    ("float16", "float16", "float16"),
                                    ("bfloat16", "float32", "float32"),
                                    ("bfloat16", "bfloat16", "float32"),
                                    ("float64", "float64", "float64")])
def test_emulation_add_in_place(add_emulator, monkeypatch, dtypes):
    """h and y written into x or r themselves (every pairing the dtypes allow), for a few
    lanes per row, a block per row (registers) and three tiles (re-read for the output
    pass), among them rows taking the rescaled path and its reload (float32, float64):
    the bits of the out-of-place call."""
    add_emulator.install(monkeypatch)
    add_emulator.cap = 1
    x_name, r_name, h_name = dtypes
    names = {"x": x_name, "r": r_name}
    for n in _add_lengths(h_name):
        rows = 5
        x0, r0, w, b = _add_inputs(dtypes, rows, n, 3 * n)
        if h_name in ("float32", "float64"):
            big = 1e300 if h_name == "float64" else 1e30
            x0[1] = (big * np.random.default_rng(n).standard_normal(n)).astype(x0.dtype)
            x0[2] = x0[1]
            x0[2, 3] = np.nan  # the rescaled path declines: packs reloaded from h
            r0[2, 4] = r0.dtype.type(big)
        for rms in (False, True):
            bias = None if rms else b
            y_ref, h_ref, mean_ref, rstd_ref = _emu_add(x0[:, :, None], r0[:, :, None], dtypes,
                                                        rms, w, bias)
            for out, res_out in _ALIASES:
                if (out and names[out] != x_name) or (res_out and names[res_out] != h_name):
                    continue
                tag = f"{dtypes} n={n} {'rms' if rms else 'layer'}_norm out={out} " \
                      f"residual_out={res_out}"
                x, r = x0[:, :, None].copy(), r0[:, :, None].copy()
                arrays = {"x": x, "r": r}
                y, h, mean, rstd = _emu_add(x, r, dtypes, rms, w, bias,
                                            h3=arrays.get(res_out), y3=arrays.get(out))
                if out:
                    assert y is arrays[out]
                if res_out:
                    assert h is arrays[res_out]
                _same_bits(y, y_ref, f"{tag} y")
                _same_bits(h, h_ref, f"{tag} h")
                _same_bits(rstd, rstd_ref, f"{tag} rstd")
                if not rms:
                    _same_bits(mean, mean_ref, f"{tag} mean")


# ------------------------------------ quantized output and grad_residual, emulated
#
# quant_fwd_rows / quant_add_fwd_rows against the contract's composition: y32 is the
# emulated fwd_rows<float> of the row widened to float32 (h widened, with a residual), and
# the codes and scales are _quantize_reference of that y32, written here from the
# contract with ml_dtypes (an independent float32 -> float8 rounding).

_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
_CODE_DTYPE = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
               "float8_e5m2": ml_dtypes.float8_e5m2}
#: (x, residual, h) dtypes the quantized add is emulated for (every configuration); the
#: others differ from these only in the load and store types add_fwd_rows tests.
_QUANT_ADD_EMULATED = (("float32", "float32", "float32"), ("bfloat16", "float32", "float32"),
                       ("float16", "float16", "float16"))


def _quantize_reference(y32, fmt, scale=None):
    """(codes, scale) of float32 rows ``y32``: the contract's formula in NumPy float32."""
    y32 = np.asarray(y32, np.float32)
    qmax = np.float32(_QMAX[fmt])
    if scale is None:
        amax = np.max(np.abs(y32), axis=1)  # NaN propagates
        s = np.where(amax == 0, np.float32(1), amax / qmax).astype(np.float32)
    else:
        s = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), y32.shape[:1])
    inv = (np.float32(1) / s).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (y32 * inv[:, None]).astype(np.float32)
        if fmt == "int8":
            v = np.clip(np.where(np.isnan(v), np.float32(0), v), -128, 127)
            return np.rint(v).astype(np.int8), s
        return np.clip(v, -qmax, qmax).astype(_CODE_DTYPE[fmt]), s


def _same_codes(q, ref, what):
    """Bit for bit, NaN codes (any NaN pattern) exactly where the reference is NaN."""
    if ref.dtype == np.int8:
        _same_bits(q, ref, what)
        return
    _same_bits_or_nan(np.asarray(q).view(ref.dtype), ref, what)


@pytest.fixture(scope="module")
def quant_emulator(emulator, tmp_path_factory):
    """The emulator, with quant_fwd_rows (every configuration, three x dtypes) and
    quant_add_fwd_rows (every configuration, _QUANT_ADD_EMULATED) compiled too."""
    exprs = [launch.quant_expression(d, cfg, rms) for d in launch.QUANT_DTYPES
             for cfg in launch.CONFIGS for rms in (False, True)]
    exprs += [launch.quant_add_expression(d, cfg, rms) for d in _QUANT_ADD_EMULATED
              for cfg in launch.CONFIGS for rms in (False, True)]
    return _emulate_too(emulator, exprs, tmp_path_factory, "emulation-quant")


def _emu_quant(x3, fmt, rms, w, b, dtypes, scale=None, eps=1e-5, r3=None, h3=None):
    """launch.quantized_forward on NumPy memory: (codes, scale, mean, rstd, h)."""
    rows = x3.shape[0]
    q3 = np.full(x3.shape, 0x5A, np.uint8)  # poisoned: every code is written
    if r3 is not None and h3 is None:
        h3 = np.full(x3.shape, np.nan, _NP[dtypes[2]])
    mean, rstd = np.full(rows, np.nan, np.float32), np.full(rows, np.nan, np.float32)
    scale_out = np.full(rows, np.nan, np.float32)
    inv = None
    if scale is not None:
        inv = np.ascontiguousarray(
            np.float32(1) / np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), rows))
    fake = [None if a is None else _FakeArray(a) for a in (w, b, r3, h3, inv)]
    launch.quantized_forward(_FakeArray(x3), fake[2], fake[0], fake[1], eps, fake[3],
                             _FakeArray(q3), None if rms else _FakeArray(mean),
                             _FakeArray(rstd), fmt, fake[4], _FakeArray(scale_out), dtypes)
    codes = q3[:, :, 0].view(_CODE_DTYPE[fmt])
    return codes, (scale_out if scale is None else None), mean, rstd, h3


def _check_quant(x, fmt, rms, w, b, dtypes, what, scale=None, eps=1e-5, r=None, **outs):
    """The fused kernel against the composition: the emulated float32 forward of the
    widened x (of h = x + r rounded to h's dtype, then widened), quantized by the
    reference; statistics bit for bit those of that forward. Returns the kernel's
    (codes, scale, mean, rstd, h)."""
    rows, n = x.shape
    if r is None:
        a = x.astype(np.float32)
    else:
        h_ref = (x.astype(np.float32) + r.astype(np.float32)).astype(_NP[dtypes[2]])
        a = h_ref.astype(np.float32)
    y32, mean_u, rstd_u = _emu_forward(a.reshape(rows, n, 1).copy(), "float32", rms, w, b, eps)
    q_ref, s_ref = _quantize_reference(y32[:, :, 0], fmt, scale)
    got = _emu_quant(x.reshape(rows, n, 1), fmt, rms, w, b, dtypes, scale, eps,
                     None if r is None else r.reshape(rows, n, 1), **outs)
    q, s, mean, rstd, h = got
    _same_codes(q, q_ref, f"{what} codes")
    if scale is None:
        _same_bits_or_nan(s, s_ref, f"{what} scale")
    _same_bits_or_nan(rstd, rstd_u, f"{what} rstd")
    if not rms:
        _same_bits_or_nan(mean, mean_u, f"{what} mean")
    if r is not None:
        _same_bits_or_nan(h[:, :, 0], h_ref, f"{what} h")
    return got


_FORMATS = tuple(_QMAX)


@pytest.mark.slow
@pytest.mark.parametrize("dtypes, add", [*(((d, d, d), False) for d in launch.QUANT_DTYPES),
                                         *((d, True) for d in _QUANT_ADD_EMULATED)])
def test_emulation_quantized_every_configuration(quant_emulator, monkeypatch, dtypes, add):
    """quant_fwd_rows (dtypes all x's) and quant_add_fwd_rows for every configuration
    (vector path with lanes past the row end, scalar tail, the tile loop), grids of one
    block: codes, dynamic scales and statistics are the composition's bit for bit, each
    format dynamic and static in turn, with a NaN row; also from misaligned inputs (the
    scalar path) and for a row alone (batch invariance)."""
    quant_emulator.install(monkeypatch)
    quant_emulator.cap = 1
    step = 0
    for (g, _maxc), ns in _config_lengths("float32").items():
        for n in ns:
            rows = (1 if g > 32 else 128 // g) + 3
            x, r, w, b = _add_inputs(dtypes, rows, n, n)
            x[2, n // 3] = np.nan
            for rms in (False, True):
                fmt = _FORMATS[step % 3]
                scale = None if step % 2 == 0 else np.float32(0.03125 + step % 5)
                step += 1
                tag = f"{dtypes} n={n} {'rms' if rms else 'layer'}_norm {fmt} scale={scale}"
                bias = None if rms else b
                res = r if add else None
                q, s, _, rstd, _ = _check_quant(x, fmt, rms, w, bias, dtypes, tag, scale,
                                                r=res)
                assert np.isnan(rstd[2]) or rms, tag
                big = [np.zeros((rows + 1, n + 1), a.dtype) for a in (x, r)]
                for k, a in enumerate((x, r)):
                    big[k][1:, 1:] = a
                qv, sv, _, _, _ = _emu_quant(big[0][1:, 1:, None], fmt, rms, w, bias, dtypes,
                                             scale, r3=big[1][1:, 1:, None] if add else None)
                _same_bits(qv, q, f"{tag} misaligned")
                if scale is None:
                    _same_bits(sv, s, f"{tag} misaligned scale")
                k = rows - 1
                qa, _, _, _, _ = _emu_quant(x[k:k + 1, :, None].copy(), fmt, rms, w, bias,
                                             dtypes, scale,
                                             r3=r[k:k + 1, :, None].copy() if add else None)
                _same_bits(qa[0], q[k], f"{tag} row {k} alone")


def _code_rows(fmt):
    """Rows of y32 values (float32) that probe rounding ties, saturation, subnormal codes,
    infinities and NaN in ``fmt``, and an all-zero row."""
    f32 = np.float32
    if fmt == "int8":
        ties = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, 0.49999997, 2.5000002]
        sat = [127.49998, 127.5, 128.0, 1e6, -128.4, -128.5, -129.0, -1e30]
    else:
        e4 = fmt == "float8_e4m3fn"
        tiny = 2.0 ** (-9 if e4 else -16)  # the smallest subnormal code
        step = 0.125 if e4 else 0.25       # code spacing in [1, 2)
        ties = [1 + step / 2, 1 + 3 * step / 2, -(1 + step / 2), tiny / 2, 3 * tiny / 2,
                -5 * tiny / 2, tiny / 2 * 1.0000001, 2.0 ** (-6 if e4 else -14) - tiny / 2,
                1e-45, 0.0]
        qmax = _QMAX[fmt]
        sat = [qmax, qmax * 1.03, qmax * 1.1, -qmax * 1.0625, 1e30, -1e38, qmax * 0.999,
               -qmax]
    rows = [np.array(ties + sat, f32)]
    rows.append(np.array([*ties[:4], np.inf, *sat[:3]], f32))
    rows.append(np.array([np.nan, *ties[1:], *sat], f32))
    rows.append(np.zeros(len(ties) + len(sat), f32))
    rows.append(-np.array(ties + sat, f32))
    n = max(len(a) for a in rows)
    return np.stack([np.pad(a, (0, n - len(a))) for a in rows])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", _FORMATS)
def test_emulation_quantized_codes(quant_emulator, monkeypatch, fmt):
    """Codes of chosen y32 values: RMSNorm of rows of ones with eps = 0 has rstd = 1 and
    y32 = weight exactly, so each row's y32 is a row of _code_rows (a weight per row: one
    kernel call per row). Ties round half to even, values beyond the range saturate,
    subnormal codes round in units of the smallest one, NaN is 0 (int8) or NaN, an
    all-zero row has scale 1; static scales 1 and 1 / 64 (saturating more)."""
    quant_emulator.install(monkeypatch)
    quant_emulator.cap = None
    table = _code_rows(fmt)
    n = table.shape[1]
    ones = np.ones((1, n, 1), np.float32)
    for i, y32 in enumerate(table):
        for scale in (None, np.float32(1), np.float32(1 / 64)):
            q_ref, s_ref = _quantize_reference(y32[None], fmt, scale)
            q, s, _, rstd, _ = _emu_quant(ones, fmt, True, y32.copy(), None, ("float32",) * 3,
                                          scale, eps=0.0)
            assert rstd[0] == 1, rstd
            what = f"{fmt} row {i} scale={scale}"
            _same_codes(q, q_ref, f"{what} codes")
            if scale is None:
                _same_bits_or_nan(s, s_ref, f"{what} scale")
                if i == 3:
                    assert s[0] == 1 and not np.any(q.view(np.uint8)), what
    # The reference itself, on a few values written out by hand.
    if fmt == "int8":
        codes, _ = _quantize_reference(np.array([[0.5, 1.5, 2.5, -2.5, 300, np.nan]]), fmt, 1.0)
        assert codes.tolist() == [[0, 2, 2, -2, 127, 0]]
    else:
        codes, _ = _quantize_reference(np.array([[1e9, -1e9]], np.float32), fmt, 1.0)
        assert codes.astype(np.float32).tolist() == [[_QMAX[fmt], -_QMAX[fmt]]]


@pytest.mark.slow
@pytest.mark.parametrize("dtypes, add", [(("float32", "float32", "float32"), False),
                                         (("bfloat16", "bfloat16", "bfloat16"), False),
                                         (("float32", "float32", "float32"), True),
                                         (("bfloat16", "float32", "float32"), True),
                                         (("float16", "float16", "float16"), True)])
def test_emulation_quantized_special_rows(quant_emulator, monkeypatch, dtypes, add):
    """Constant rows (y32 exactly the bias: codes of the bias; without a bias y32 = 0:
    scale 1, codes 0), NaN rows (LayerNorm: scale NaN, codes NaN / 0), rows whose
    squares overflow (float32 and bfloat16: the rescaled path, every thread its row's
    amax) and such rows with a NaN (the path declines and the packs are reloaded), for a
    few lanes per row, a block per row and three tiles; the other rows' bits stay."""
    quant_emulator.install(monkeypatch)
    quant_emulator.cap = 1
    x_name, r_name, h_name = dtypes
    for n in _add_lengths("float32"):
        rows = 7
        x, r, w, b = _add_inputs(dtypes, rows, n, n + 5)
        x[1] = _NP[x_name](1e4 / 3)
        r[1] = _NP[r_name](0.375)
        x[3, n // 2] = np.nan
        if h_name != "float16" and x_name != "float16":
            rng = np.random.default_rng(n)
            x[4] = (1e30 * rng.standard_normal(n)).astype(x.dtype)
            x[5] = (1e30 * (3 + rng.standard_normal(n))).astype(x.dtype)
            x[5, 1] = np.nan
        for rms in (False, True):
            for k, fmt in enumerate(_FORMATS):
                scale = None if k != 1 else np.float32(0.5)
                tag = f"{dtypes} n={n} {'rms' if rms else 'layer'}_norm {fmt} scale={scale}"
                bias = None if rms else b
                q, s, _, rstd, h = _check_quant(x, fmt, rms, w, bias, dtypes, tag, scale,
                                                   r=r if add else None)
                if not rms:
                    hb = (h[1, :, 0] if add else x[1]).astype(np.float32)
                    assert np.all(hb == hb[0]), tag
                    q_b, _ = _quantize_reference(b[None], fmt, None if scale is None else scale)
                    _same_codes(q[1:2], q_b, f"{tag} constant row quantizes the bias")
                    if scale is None:
                        assert np.isnan(s[3]), tag
                        qz, sz, _, _, _ = _emu_quant(x[1:2, :, None].copy(), fmt, False, None,
                                                     None, dtypes, None,
                                                     r3=r[1:2, :, None].copy() if add else None)
                        assert sz[0] == 1 and not np.any(qz.view(np.uint8)), tag
                if h_name != "float16" and x_name != "float16" and not add:
                    assert np.isfinite(rstd[4]) and rstd[4] > 0, tag
                for k in (0, 2, 6):
                    qa, _, _, _, _ = _emu_quant(x[k:k + 1, :, None].copy(), fmt, rms, w, bias,
                                                dtypes, scale,
                                                r3=r[k:k + 1, :, None].copy() if add else None)
                    _same_bits(qa[0], q[k], f"{tag} row {k} beside special rows")


@pytest.mark.slow
@pytest.mark.parametrize("dtypes", [("float32", "float32", "float32"),
                                    ("float16", "float16", "float16"),
                                    ("bfloat16", "float32", "float32")])
def test_emulation_quantized_add_in_place(quant_emulator, monkeypatch, dtypes):
    """h written into x or r itself (residual_out=x or r) while the codes go elsewhere,
    with rows taking the rescaled path (float32): the bits of the out-of-place call."""
    quant_emulator.install(monkeypatch)
    quant_emulator.cap = 1
    x_name, r_name, h_name = dtypes
    names = {"x": x_name, "r": r_name}
    for n in _add_lengths("float32"):
        x0, r0, w, b = _add_inputs(dtypes, 5, n, 7 * n)
        if x_name == "float32":
            x0[1] = (1e30 * np.random.default_rng(n).standard_normal(n)).astype(x0.dtype)
            x0[2] = x0[1]
            x0[2, 3] = np.nan
        for rms, fmt in ((False, "int8"), (True, "float8_e4m3fn"), (False, "float8_e5m2")):
            bias = None if rms else b
            ref = _emu_quant(x0[:, :, None], fmt, rms, w, bias, dtypes, r3=r0[:, :, None])
            for target in ("x", "r"):
                if names[target] != h_name:
                    continue
                x, r = x0[:, :, None].copy(), r0[:, :, None].copy()
                arrays = {"x": x, "r": r}
                got = _emu_quant(x, fmt, rms, w, bias, dtypes, r3=r, h3=arrays[target])
                tag = f"{dtypes} n={n} {fmt} residual_out={target}"
                assert got[4] is arrays[target]
                for a, e, what in zip(got, ref, ("codes", "scale", "mean", "rstd", "h"),
                                      strict=True):
                    if not (rms and what == "mean"):
                        _same_bits(a, e, f"{tag} {what}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulation_backward_grad_residual(emulator, monkeypatch, dtype):
    """bwd_rows and bwd_cols with grad_residual, every configuration: float32 and float64
    give the unfused grad_x + grad_residual bit for bit; 16-bit types the sum rounded once
    (a zero grad_residual leaves grad_x's bits; against the float64 reference within one
    rounding). The same bits from a misaligned view, strided rows, channels-first (cols
    kernels), and a grad_residual in Fortran order (its own strides)."""
    from . import reference

    emulator.install(monkeypatch)
    emulator.cap = 1
    acc = np.float64 if dtype == "float64" else np.float32
    for (g, _maxc), lengths in _config_lengths(dtype).items():
        n = lengths[g % 2]  # the vector-path length or the tail length, in turn
        rows = (1 if g > 32 else 128 // g) + 3
        rng = np.random.default_rng(n + 11)
        x = (0.5 + 2 * rng.standard_normal((rows, n))).astype(_NP[dtype])
        gy = rng.standard_normal((rows, n)).astype(_NP[dtype])
        gr = (3 * rng.standard_normal((rows, n))).astype(_NP[dtype])
        w = (1 + 0.3 * rng.standard_normal(n)).astype(acc)
        x3, gy3 = x.reshape(rows, n, 1), gy.reshape(rows, n, 1)
        for rms in (False, True):
            tag = f"{dtype} n={n} {'rms' if rms else 'layer'}_norm"
            _, mean, rstd = _emu_forward(x3, dtype, rms, w, None)
            plain, gw, _ = _emu_backward(gy3, x3, mean, rstd, w, dtype, rms)

            def run(gyv, xv, grv, mean=mean, rstd=rstd, rms=rms, w=w, gw=gw):
                gx3 = np.full(xv.shape, np.nan, dtype=xv.dtype)
                gwv, _ = launch.backward(_FakeArray(gyv), _FakeArray(xv),
                                         None if rms else _FakeArray(mean), _FakeArray(rstd),
                                         _FakeArray(w), _FakeArray(gx3), dtype, rms,
                                         grad_residual=_FakeArray(grv))
                _same_bits(gwv.arr, gw, "grad_weight is grad_residual's to leave alone")
                return gx3

            fused = run(gy3, x3, gr.reshape(rows, n, 1))
            zero = run(gy3, x3, np.zeros((rows, n, 1), x.dtype))
            _same_bits(zero, plain, f"{tag} zero grad_residual")
            if dtype in ("float32", "float64"):
                _same_bits(fused[:, :, 0], plain[:, :, 0] + gr, f"{tag} grad_x + grad_residual")
            else:
                if rms:
                    ref = reference.rms_norm_backward(gy, x, (1,), w, eps=1e-5)[0]
                else:
                    ref = reference.layer_norm_backward(gy, x, (1,), w)[0]
                want = ref.astype(np.float64) + gr.astype(np.float64)
                got = fused[:, :, 0].astype(np.float64)
                ulp = np.abs(want) * (2.0 ** -(8 if dtype == "bfloat16" else 11))
                tol = _GATOL[dtype] * 4 * max(1, np.abs(ref).max())
                assert np.all(np.abs(got - want) <= ulp + tol), tag
            big, gbig, rbig = (np.zeros((rows + 1, n + 1), x.dtype) for _ in range(3))
            big[1:, 1:], gbig[1:, 1:], rbig[1:, 1:] = x, gy, gr
            wide = [np.zeros((rows, 2 * n), x.dtype) for _ in range(3)]
            for a, v in zip(wide, (x, gy, gr), strict=True):
                a[:, ::2] = v
            views = {
                "misaligned": ((big[1:, 1:], gbig[1:, 1:], rbig[1:, 1:]), lambda a: a[:, :, 0]),
                "strided": (tuple(a[:, ::2] for a in wide), lambda a: a[:, :, 0]),
                "fortran grad_residual": ((x, gy, np.asfortranarray(gr)), lambda a: a[:, :, 0]),
            }
            for name, ((xv, gv, rv), back) in views.items():
                got = run(gv[:, :, None], xv[:, :, None], rv[:, :, None])
                _same_bits(back(got), fused[:, :, 0], f"{tag} {name}")
            cf = run(np.ascontiguousarray(gy.T)[None], np.ascontiguousarray(x.T)[None],
                     np.ascontiguousarray(gr.T)[None])
            _same_bits(cf[0].T, fused[:, :, 0], f"{tag} channels-first (cols)")


# ------------------------------------ long float32-accumulated rows: no drift over tiles
#
# A row longer than one tile (the largest configuration) gives each lane one term per
# element of a tile, tile after tile: a float32 running sum of thousands of like terms
# drifts by a rounding error proportional to their count when every addition rounds the
# same way (RMSNorm of a constant row of 2^20 elements was off by 7.8e-6, 2^22 by 1.4e-5;
# the backward's sums of g and g * xhat the same). The kernels close each tile's float
# partial into a double running state (layernorm.cu, Running).

_LONG_N = 2 ** 20


def _biased_row(rms, n, dtype="float32"):
    """RMSNorm: a constant row (1.1); LayerNorm: +1.1, -1.1, ... (the deviations alike)."""
    x = np.full(n, 1.1).astype(_NP[dtype])
    if not rms:
        x[1::2] = -x[1::2]
    return x


def test_only_the_largest_configuration_spans_tiles():
    """The row kernels close their running sums into double only in the largest
    configuration (layernorm.cu, Running: CLOSE): every other one holds its rows in one
    tile, where both sums give the same bits."""
    for dtype in DTYPES:
        vec = launch.vector_width(dtype)
        for n in [*range(1, 2048 * vec + 2), 2**20, 2**31 + 5]:
            g, maxc, _ = launch.row_config(n, dtype)
            if (g, maxc) != launch.CONFIGS[-1]:
                assert n <= g * maxc * vec, (dtype, n, g, maxc)
    assert launch.CONFIGS[-1][0] == launch.DEFINES["LNK_MAX_G"]


@pytest.fixture(scope="module")
def long_row_emulator(emulator, tmp_path_factory):
    """The emulator, with the fused float32 kernels of the largest configuration too."""
    cfg = launch.CONFIGS[-1]
    exprs = [launch.add_expression(("float32",) * 3, cfg, rms) for rms in (False, True)]
    exprs += [launch.quant_expression("float32", cfg, rms) for rms in (False, True)]
    return _emulate_too(emulator, exprs, tmp_path_factory, "emulation-long")


@pytest.mark.parametrize("rms", [True, False], ids=["rms_norm", "layer_norm"])
def test_emulation_long_rows_do_not_drift(long_row_emulator, monkeypatch, rms):
    """Float32 rows of 2^20 elements whose terms all round alike (128 tiles a row): y
    within 1e-6 of float64 (it was 7.8e-6 for RMSNorm), through fwd_rows, fwd_cols
    (channels-first), add_fwd_rows and quant_fwd_rows (the same statistics, bit for bit),
    and grad_x within 2e-7 (torch 2.13's CPU error on the same data: 1.8e-7 for RMSNorm,
    3.5e-4 for LayerNorm; it was 1.1e-5 and 3.2e-6) through bwd_rows and bwd_cols."""
    from . import reference

    emu = long_row_emulator
    emu.install(monkeypatch)
    emu.cap = 1
    n, tag = _LONG_N, "rms_norm" if rms else "layer_norm"
    assert launch.row_config(n, "float32")[:2] == launch.CONFIGS[-1]
    x = _biased_row(rms, n)
    x2 = np.stack([x, x[::-1]])  # the second row for the cols kernels' layout
    if rms:
        y_ref, rstd_ref = reference.rms_norm(x2, (1,), eps=1e-5)
    else:
        y_ref, _, rstd_ref = reference.layer_norm(x2, (1,), eps=1e-5)
    y, mean, rstd = _emu_forward(x2.reshape(2, n, 1), "float32", rms, None, None)
    err = np.abs(y[:, :, 0].astype(np.float64) - y_ref).max()
    assert err <= 1e-6, f"{tag}: y off by {err:.3g}"
    np.testing.assert_allclose(rstd, rstd_ref.ravel(), rtol=1e-6, err_msg=tag)
    yc, mc, sc = _emu_forward(np.ascontiguousarray(x2.T)[None], "float32", rms, None, None)
    _same_bits(yc[0].T, y[:, :, 0], f"{tag} y, channels-first")
    _same_bits(sc, rstd, f"{tag} rstd, channels-first")
    zero = np.zeros((2, n, 1), np.float32)
    ya, _, ma, sa = _emu_add(x2.reshape(2, n, 1), zero, ("float32",) * 3, rms, None, None)
    _same_bits(ya, y, f"{tag} y, add_fwd_rows (x + 0)")
    _same_bits(sa, rstd, f"{tag} rstd, add_fwd_rows")
    _, _, mq, sq, _ = _emu_quant(x2.reshape(2, n, 1), "int8", rms, None, None,
                                 ("float32",) * 3)
    _same_bits(sq, rstd, f"{tag} rstd, quant_fwd_rows")
    if not rms:
        for other, what in ((mc, "channels-first"), (ma, "add_fwd_rows"),
                            (mq, "quant_fwd_rows")):
            _same_bits(other, mean, f"{tag} mean, {what}")

    # grad_y alike too: ones (RMSNorm: g * xhat all alike), x / 1.1 (LayerNorm: +-1).
    gy = np.ones_like(x2) if rms else np.sign(x2)
    if rms:
        gx_ref, _ = reference.rms_norm_backward(gy, x2, (1,), eps=1e-5)
    else:
        gx_ref, _, _ = reference.layer_norm_backward(gy, x2, (1,), eps=1e-5)
    gx, _, _ = _emu_backward(gy.reshape(2, n, 1), x2.reshape(2, n, 1), mean, rstd, None,
                             "float32", rms)
    err = np.abs(gx[:, :, 0].astype(np.float64) - gx_ref).max()
    assert err <= 2e-7, f"{tag}: grad_x off by {err:.3g}"
    gc, _, _ = _emu_backward(np.ascontiguousarray(gy.T)[None], np.ascontiguousarray(x2.T)[None],
                             mean, rstd, None, "float32", rms)
    _same_bits(gc[0].T, gx[:, :, 0], f"{tag} grad_x, channels-first")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_emulation_long_16bit_rows_do_not_drift(emulator, monkeypatch, dtype):
    """16-bit rows accumulate in float32 the same way (32 terms a lane and tile): a
    constant row of 2^20 elements gets rstd within 1e-6 of float64 (it was 2.4e-6 for
    float16, 1.5e-5 for bfloat16)."""
    emulator.install(monkeypatch)
    emulator.cap = 1
    x = _biased_row(True, _LONG_N, dtype)
    x64 = x.astype(np.float64)
    rstd_ref = 1 / np.sqrt(np.mean(x64 * x64) + 1e-5)
    _, _, rstd = _emu_forward(x.reshape(1, _LONG_N, 1), dtype, True, None, None)
    np.testing.assert_allclose(rstd, [rstd_ref], rtol=1e-6, err_msg=dtype)


# ------------------------------------------ the backend's own compile-and-load path


class _CupyNvrtcShim:
    """CuPy's NVRTC binding API (``cupy_backends.cuda.libs.nvrtc``) on cuda-bindings."""

    class NVRTCError(RuntimeError):
        pass

    def __init__(self) -> None:
        from cuda.bindings import nvrtc

        self.nv = nvrtc

    def _ok(self, result):
        err, *rest = result
        if err != self.nv.nvrtcResult.NVRTC_SUCCESS:
            raise self.NVRTCError(str(err))
        return rest[0] if rest else None

    def getVersion(self):  # CuPy's names, camelCase
        _, major, minor = self.nv.nvrtcVersion()
        return (major, minor)

    def getSupportedArchs(self):
        return (75, 80, 86, 89, 90)

    def createProgram(self, src, name, headers, include_names):
        return self._ok(self.nv.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], []))

    def addNameExpression(self, prog, name):
        self._ok(self.nv.nvrtcAddNameExpression(prog, name.encode()))

    def compileProgram(self, prog, options):
        opts = [o.encode() for o in options]
        self._ok(self.nv.nvrtcCompileProgram(prog, len(opts), opts))

    def getProgramLog(self, prog):
        size = self._ok(self.nv.nvrtcGetProgramLogSize(prog))
        buf = b" " * size
        self._ok(self.nv.nvrtcGetProgramLog(prog, buf))
        return buf.decode().rstrip("\x00 ")

    def getLoweredName(self, prog, name):
        return self._ok(self.nv.nvrtcGetLoweredName(prog, name.encode())).decode()

    def getCUBIN(self, prog):
        size = self._ok(self.nv.nvrtcGetCUBINSize(prog))
        buf = b" " * size
        self._ok(self.nv.nvrtcGetCUBIN(prog, buf))
        return buf[:-1]

    def getPTX(self, prog):
        size = self._ok(self.nv.nvrtcGetPTXSize(prog))
        buf = b" " * size
        self._ok(self.nv.nvrtcGetPTX(prog, buf))
        return buf[:-1]

    def destroyProgram(self, prog):
        self.nv.nvrtcDestroyProgram(prog)


def test_kernel_compiles_caches_and_loads_through_cupy(monkeypatch, tmp_path):
    """launch._kernel: CuPy's NVRTC binding (shimmed), a cubin on disk, RawModule(path=)."""
    _nvrtc()
    shim = _CupyNvrtcShim()
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = shim
    loaded = []

    class RawModule:
        def __init__(self, path):
            self.path = path

        def get_function(self, name):
            with open(self.path, "rb") as fh:
                loaded.append((self.path, name, fh.read(4)))
            return name

    cupy_ns = _fake_cupy()
    cupy_ns.RawModule = RawModule

    class Device:
        compute_capability = "90"

        def __init__(self, *args) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    cupy_ns.cuda = types.SimpleNamespace(Device=Device)
    for name, mod in (("cupy", cupy_ns), ("cupy_backends", types.ModuleType("cupy_backends")),
                      ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                      ("cupy_backends.cuda.libs", libs)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv("LAYERNORM_CUDA_CACHE", str(tmp_path))
    expr = launch.expression("fwd_rows", "bfloat16", (4, 1), rms=True)
    launch._kernel.cache_clear()
    try:
        name = launch._kernel(0, expr)
        assert name.startswith("_Z") and loaded[-1][2] == b"\x7fELF"  # a cubin
        assert loaded[-1][0].startswith(str(tmp_path)) and loaded[-1][0].endswith(".cubin")
        launch._kernel.cache_clear()
        monkeypatch.setattr(shim, "compileProgram", None)  # a second process: from disk
        assert launch._kernel(0, expr) == name
    finally:
        launch._kernel.cache_clear()


# ------------------------------------------------------------ in the background
#
# The NVRTC compiles (eight, 30-110 s each on two cores, one thread each) need no GPU and
# nothing from the rest of the suite, and pytest spends most of its time in one thread
# (Numba compiles one kernel at a time): on a 2-core machine one core idles. So
# conftest.py's collection hook calls start_background(), which runs those compiles, in
# order, in one idle-priority process while the rest of the suite runs, and moves their
# tests last. Each test then reads its job's result (the same values and assertions as
# compiling in the test); a test whose job was not started compiles itself.

_BACKGROUND: dict[str, object] = {}

#: test function -> background job names for its parameters
_JOBS = {
    "test_every_instantiation_compiles": lambda p: [f"nvrtc-{p['dtype']}-{p['arch']}"],
    "test_no_local_memory_spills": lambda p: [f"nvrtc-{p['dtype']}-{p['arch']}"],
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
    if not jobs:
        return []
    workdir = Path(tempfile.mkdtemp(prefix="layernorm-cuda-tests-"))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from tests.test_cuda_compile import _background_main; "
         "_background_main(sys.argv[1], sys.argv[2:])", str(workdir), *jobs],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _BACKGROUND.update(proc=proc, workdir=workdir, jobs=jobs)
    return waiting


def stop_background() -> None:
    """Stop the background process (if still running) and remove its results."""
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
    # The foreground tests first: run only on CPU time they leave.
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    out = Path(workdir)
    for job in jobs:
        try:
            _, dtype, arch = job.split("-")
            value = ("ok", _compile_here(dtype, int(arch)))
        except pytest.skip.Exception as exc:
            value = ("skip", str(exc))
        except Exception:
            value = ("error", traceback.format_exc())
        tmp = out / f"{job}.tmp"
        tmp.write_bytes(pickle.dumps(value))
        tmp.replace(out / f"{job}.pickle")
