"""The CUDA kernels compile, for every instantiation the CuPy backend can launch, with no spills.

No GPU is needed: NVRTC (from ``cuda-bindings``) compiles the shipped source exactly as
:class:`cupy.RawModule` does (same options, same name expressions) into cubins for
sm_80 (A100) and sm_90 (H100/H200), and ptxas' ``-v`` report, which NVRTC returns in its
log, shows every kernel's registers and local-memory spills.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import types

import ml_dtypes
import numpy as np
import pytest

from layernorm._backends._cupy import launch

DTYPES = ("float16", "bfloat16", "float32", "float64")
ARCHS = (80, 90)


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
    spilled = {k: v for k, v in report.items() if v[1] or v[2]}
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
        assert [int(v) for v in fwd_args[7:10]] == [rows, n, x.shape[2]]
        assert float(fwd_args[10]) == 1.0 / x.shape[2]
        assert [int(v) for v in fwd_args[11:14]] == strides
        if family == "rows":
            aligned = name == "contiguous" and (n * x.itemsize) % 16 == 0
            assert int(fwd_args[-1]) == int(aligned), name
        else:
            cfg = launch.row_config(n, dtype)
            tile = cfg.g * cfg.maxc * launch.vector_width(dtype)
            assert [int(v) for v in fwd_args[-3:]] == [cfg.g, cfg.maxc, -(-n // tile)]
