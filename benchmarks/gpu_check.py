"""One-call GPU check for the CuPy backend: tests, sanitizers, bit checks, torch, benchmark.

Run from the repository root on a machine with a CUDA GPU::

    bash benchmarks/gpu_check.sh              # everything (under 8 minutes on an H200)
    python benchmarks/gpu_check.py --no-tests # skip the pytest runs
    python benchmarks/gpu_check.py --sections invariance,torch   # a subset
    python benchmarks/gpu_check.py --dry-run  # no GPU: host arrays, Numba kernels, same code

Sections, each guarded (a failure or crash is a row of the final table, never the end of
the run): ``compile`` (every kernel, in parallel, into the on-disk kernel cache),
``tests`` (the CUDA tests, then every cupy-parametrized test), ``sanitizer``
(``compute-sanitizer`` memcheck, racecheck and synccheck on ``--probe``, a small workload
that launches every kernel family: row and cols kernels, vector and scalar paths, strided
rows, the tile loop, several parameter-gradient tree levels), ``invariance`` (bit checks
on the real binary: layouts, a row alone, and grids capped to 1 block against the
default), ``subnormal`` (``eps=0`` rows with subnormal squared deviations stay finite:
no flush-to-zero), ``quantized`` (the quantizing kernels, with and without the residual,
every configuration and format, dynamic and static scales: codes and scales bit for bit
the contract's formula applied to the composition's y32, chosen y32 values for ties,
saturation and NaN, a row alone, grids of one block; and ``grad_residual`` inside the
backward kernels: bit for bit grad_x + grad_residual for float32/float64, the same bits
under every layout), ``torch`` (values against ``torch.nn.functional`` on the same
device) and ``bench`` (GB/s against a device copy, forward and backward, contiguous and
strided rows, float32 and bfloat16; the fused ops ``ln_fwd_q8`` (LayerNorm to int8
codes, dynamic scale), ``add_rms_f8`` (residual add and RMSNorm to float8_e4m3fn codes)
and ``ln_bwd_res`` (backward with grad_residual), contiguous rows only). The last thing
printed is the table of sections.

Nothing is downloaded: the script uses what is importable (CuPy is required for the GPU
part; PyTorch only for the comparison columns, which are left empty without it) and
puts ``src/`` on the path instead of installing the package. Logs, the pytest output and
the results (JSON and CSV) go to ``$OUT`` when it is set (else ``artifacts/gpu_check``).

The benchmark times the backend's kernels on prepared arrays (what ``ln.layer_norm``
launches, without the argument checks), PyTorch's ``torch.nn.functional.layer_norm`` /
``rms_norm`` and their autograd backward, and a device-to-device copy of the same number
of bytes, each as the median over several batches of back-to-back calls timed with CUDA
events, rotating over several input buffers when one would stay in L2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

OPS = ("ln_fwd", "rms_fwd", "ln_bwd", "rms_bwd", "ln_fwd_q8", "add_rms_f8", "ln_bwd_res")
#: Ops of the fused kernels, which take rows of unit stride (timed on contiguous rows).
FUSED_OPS = ("ln_fwd_q8", "add_rms_f8", "ln_bwd_res")
DTYPES = ("float32", "bfloat16")
LAYOUTS = ("contig", "strided")
ROWS = 8192
WIDTHS = (64, 768, 1024, 1000, 4096, 8192, 16384, 65536)
EPS = 1e-5
#: In run order: the quick bit checks first, then the suites, the benchmark last (its
#: budget shrinks to what is left of --budget).
SECTIONS = ("compile", "invariance", "subnormal", "quantized", "torch", "tests", "sanitizer",
            "bench")
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
#: Kernels are compiled once into this cache and reused by every later process (tests,
#: sanitizer runs), so no sanitizer run pays for NVRTC.
KERNEL_CACHE = "/tmp/layernorm-gpu-check-cache"


def log(msg: str) -> None:
    print(msg, flush=True)


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or (ROOT / "artifacts" / "gpu_check"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def try_import(name: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:  # missing, or broken without a driver
        log(f"  {name}: not usable ({type(exc).__name__}: {exc})")
        return None


def ensure_paths() -> None:
    """Use the working tree's package without installing it (no network on the GPU box)."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    os.environ.setdefault("LAYERNORM_CUDA_CACHE", KERNEL_CACHE)


# --------------------------------------------------------------------------- sections


@dataclass
class Check:
    """One section's outcome: PASS, FAIL, SKIP or ERROR (it raised), with a detail."""

    name: str
    status: str
    seconds: float = 0.0
    detail: str = ""


def guarded(results: list[Check], name: str, fn, *args) -> Check:
    """Run one section; whatever it raises becomes an ERROR row, never the end of the run.

    ``fn`` returns ``(status, detail)`` or a list of :class:`Check` (several rows).
    """
    log(f"== {name}")
    t0 = time.monotonic()
    try:
        out = fn(*args)
    except BaseException as exc:  # SystemExit too: a section must not end the run
        if isinstance(exc, KeyboardInterrupt):
            raise
        out = ("ERROR", f"{type(exc).__name__}: {exc}")
    if isinstance(out, list):
        results.extend(out)
        return out[-1] if out else Check(name, "SKIP")
    status, detail = out
    check = Check(name, status, time.monotonic() - t0, detail)
    results.append(check)
    log(f"  -> {status} {detail}")
    return check


def summary_table(results: list[Check]) -> str:
    """The final table: one row per section; the verdict line is last."""
    lines = [f"{'section':<24}{'status':<8}{'seconds':>9}  detail"]
    for c in results:
        detail = " ".join(c.detail.split())
        lines.append(f"{c.name:<24}{c.status:<8}{c.seconds:9.1f}  {detail[:110]}")
    bad = [c.name for c in results if c.status in ("FAIL", "ERROR")]
    lines.append("VERDICT: " + ("FAILED (" + ", ".join(bad) + ")" if bad else
                                "all sections passed or skipped"))
    return "\n".join(lines)


def environment() -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in ("numpy", "numba", "ml_dtypes", "cupy", "torch", "pytest", "xdist",
                 "cuda.bindings", "array_api_compat", "hypothesis"):
        try:
            mod = importlib.import_module(name)
            info[name] = getattr(mod, "__version__", "present")
        except Exception as exc:
            info[name] = f"MISSING ({type(exc).__name__})"
    cupy = try_import("cupy")
    if cupy is not None:
        try:
            dev = cupy.cuda.Device(0)
            props = cupy.cuda.runtime.getDeviceProperties(0)
            info["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) \
                else str(props["name"])
            info["compute_capability"] = dev.compute_capability
            info["sms"] = dev.attributes["MultiProcessorCount"]
            info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        except Exception as exc:
            info["gpu"] = f"none ({type(exc).__name__}: {exc})"
    return info


# --------------------------------------------------------------------------- kernels


def _compile_one(expr: str) -> tuple[str, float, str]:
    t0 = time.perf_counter()
    try:
        from layernorm._backends._cupy import launch

        launch._kernel(0, expr)
        return expr, time.perf_counter() - t0, ""
    except Exception as exc:
        return expr, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


def precompile(workers: int) -> bool:
    """Compile every kernel in parallel processes, filling CuPy's on-disk cache."""
    from layernorm._backends._cupy import launch

    exprs = [e for d in ("float16", "bfloat16", "float32", "float64")
             for e in launch.all_expressions(d)]
    log(f"precompiling {len(exprs)} kernels with {workers} processes ...")
    t0 = time.perf_counter()
    failures = []
    ctx = __import__("multiprocessing").get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        for expr, _, err in pool.map(_compile_one, exprs, chunksize=4):
            if err:
                failures.append((expr, err))
    log(f"  done in {time.perf_counter() - t0:.1f} s, {len(failures)} failures")
    for expr, err in failures[:5]:
        log(f"  FAILED {expr}: {err[:2000]}")
    return not failures


# --------------------------------------------------------------------------- tests


def _pytest_summary(text: str) -> str:
    """pytest's last "N passed, M failed ..." line, or the last line."""
    lines = [ln.strip("= ") for ln in text.strip().splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.search(r"\d+ (passed|failed|error|skipped|deselected)", line):
            return line
    return lines[-1] if lines else "no output"


def pytest_options(workers: int, per_test_timeout: int) -> list[str]:
    """Options of every pytest run on the GPU machine.

    pytest-benchmark, when installed there, warns under xdist, and the project's
    ``filterwarnings = error`` turns that into an INTERNALERROR before any test runs: it
    is disabled. With pytest-timeout, a test that runs past ``per_test_timeout`` fails
    with its stack instead of stopping the whole run silently.
    """
    opts = ["-q", "-rs", "-p", "no:cacheprovider", "-p", "no:benchmark", "--durations=10"]
    if importlib.util.find_spec("xdist") is not None and workers > 1:
        opts += ["-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        opts += [f"--timeout={per_test_timeout}", "--timeout-method=thread"]
    return opts


#: The tests that need the device. tests/test_cuda_compile.py otherwise compiles every
#: instantiation in one NVRTC program per dtype (minutes of one core each; CI runs it):
#: the compile section has already compiled every kernel, in parallel, on this machine.
CUDA_TESTS = ("tests/test_cupy_backend.py",
              "tests/test_cuda_compile.py::test_kernel_compiles_caches_and_loads_through_cupy")


def run_tests(timeout: int, workers: int) -> list[Check]:
    """The GPU test suite: the CUDA tests, then every cupy-parametrized test elsewhere."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    opts = pytest_options(workers, per_test_timeout=max(30, timeout // 2))
    runs = [
        ("tests: cuda", [sys.executable, "-m", "pytest", *opts, *CUDA_TESTS,
                         "-k", "not numpy"]),
        ("tests: cupy params", [sys.executable, "-m", "pytest", *opts,
                                "--continue-on-collection-errors",
                                "tests", "-k", "cupy and not test_cupy_backend",
                                "--ignore=tests/test_cupy_backend.py",
                                "--ignore=tests/test_cuda_compile.py"]),
    ]
    checks = []
    deadline = time.monotonic() + timeout
    for name, cmd in runs:
        left = max(30, int(deadline - time.monotonic()))
        log(f"$ {' '.join(cmd)}   (timeout {left} s)")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=left)
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            text = (exc.stdout or b"").decode(errors="replace") if isinstance(
                exc.stdout, bytes) else (exc.stdout or "")
            text += "\nTIMEOUT"
            code = -1
        (out_dir() / f"pytest-{name.split()[-1]}.log").write_text(text)
        log("\n".join(text.strip().splitlines()[-25:]))
        # pytest exit 5: nothing collected (e.g. no cupy params elsewhere): not a failure.
        status = "PASS" if code in (0, 5) else "FAIL"
        detail = ("TIMEOUT; " if code == -1 else "") + f"exit {code}: {_pytest_summary(text)}"
        checks.append(Check(name, status, time.monotonic() - t0, detail))
        log(f"  -> {status} {detail}")
    return checks


# ----------------------------------------------------------------- device checks


def _host(a):
    return a.get() if hasattr(a, "get") else a


def _bits(a):
    import numpy as np

    h = np.ascontiguousarray(_host(a))
    return h.view(f"u{h.dtype.itemsize}")


def _device_inputs(cp, dtype: str, rows: int, n: int, seed: int):
    """x, dy (raw bits for 16-bit types, as the backend takes them), w, b on the device."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = 0.5 + 2 * rng.standard_normal((rows, n))
    x[::5] += 300
    gy = rng.standard_normal((rows, n))
    acc = "float64" if dtype == "float64" else "float32"
    w = (1 + 0.3 * rng.standard_normal(n)).astype(acc)
    b = (0.5 * rng.standard_normal(n)).astype(acc)
    return (cp.asarray(_encode(x, dtype)), cp.asarray(_encode(gy, dtype)), cp.asarray(w),
            cp.asarray(b))


def _encode(a, dtype: str):
    """Host float64 values in the backend's storage: uint16 bits for bfloat16."""
    import numpy as np

    if dtype == "bfloat16":
        bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.astype(np.uint16)
    return a.astype(dtype)


def _decode(a, dtype: str):
    import numpy as np

    a = np.ascontiguousarray(_host(a))
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _run_all(cp, backend, dtype: str, x3, gy3, w, b):
    """Forward and backward, LayerNorm and RMSNorm, of one (outer, n, inner) layout."""
    outer, _, inner = x3.shape
    acc = "float64" if dtype == "float64" else "float32"
    rows = outer * inner
    out = {}
    y = cp.empty(x3.shape, x3.dtype)
    mean, rstd = cp.empty(rows, acc), cp.empty(rows, acc)
    backend.layer_norm_forward(x3, w, b, EPS, y, mean, rstd, dtype)
    gx = cp.empty(x3.shape, x3.dtype)
    gw, gb = backend.layer_norm_backward(gy3, x3, mean, rstd, w, gx, dtype)
    out.update(y=y, mean=mean, rstd=rstd, gx=gx, gw=gw, gb=gb)
    yr, rs = cp.empty(x3.shape, x3.dtype), cp.empty(rows, acc)
    backend.rms_norm_forward(x3, w, EPS, yr, rs, dtype)
    rgx = cp.empty(x3.shape, x3.dtype)
    rgw = backend.rms_norm_backward(gy3, x3, rs, w, rgx, dtype)
    out.update(rms_y=yr, rms_rstd=rs, rms_gx=rgx, rms_gw=rgw)
    return out


def _layouts(cp, x, gy):
    """(name, x3, gy3, to_rows) views of the same (rows, n) values in several layouts."""
    rows, n = x.shape

    def misaligned(a):
        buf = cp.zeros((rows * n + 1,), a.dtype)
        view = buf[1:].reshape(rows, n)
        view[...] = a
        return view[:, :, None]

    def strided(a):
        buf = cp.zeros((rows, 2 * n), a.dtype)
        buf[:, ::2] = a
        return buf[:, ::2][:, :, None]

    def fortran(a):
        return cp.asfortranarray(a)[:, :, None]

    def channels_first(a):
        return cp.ascontiguousarray(a.T)[None]

    def rows_back(a):
        return a[:, :, 0]

    def cf_back(a):
        return a[0].T

    yield "contiguous", x[:, :, None], gy[:, :, None], rows_back
    yield "misaligned", misaligned(x), misaligned(gy), rows_back
    yield "strided", strided(x), strided(gy), rows_back
    yield "fortran", fortran(x), fortran(gy), rows_back
    yield "channels-first", channels_first(x), channels_first(gy), cf_back


def _device_modules(cp=None, backend=None):
    """(array module, backend): CuPy and the CUDA backend unless given (the tests pass
    NumPy and the Numba backend, which share the interface, to run the checks' logic)."""
    if cp is None:
        import cupy as cp
    if backend is None:
        from layernorm._backends import _cupy as backend
    return cp, backend


def _sync(cp) -> None:
    if hasattr(cp, "cuda"):
        cp.cuda.Device().synchronize()


def probe(cp=None, backend=None, sms: int | None = None) -> int:
    """A small workload that launches every kernel family (the sanitizers' target)."""
    from layernorm._backends._cupy import launch

    cp, backend = _device_modules(cp, backend)

    cases = [("float32", 37, 5), ("float32", 37, 100), ("float32", 5, 3000),
             ("float32", 3, 8193), ("bfloat16", 37, 1000), ("bfloat16", 3, 16392),
             ("float16", 37, 1021), ("float64", 37, 254),
             # several gradient blocks and two tree levels
             ("float32", launch.GRAD_ROW_BLOCK * (launch.SUM_FAN + 2) + 5, 7)]
    for dtype, rows, n in cases:
        x, gy, w, b = _device_inputs(cp, dtype, rows, n, n)
        for name, x3, gy3, _ in _layouts(cp, x, gy):
            _run_all(cp, backend, dtype, x3, gy3, w, b)
            log(f"probe {dtype} {rows}x{n} {name}: ok")
            if dtype != "float64":
                _run_fused(cp, backend, dtype, x3, gy3, w, b)
                log(f"probe {dtype} {rows}x{n} {name} fused: ok")
    # Fortran order with enough rows for the cols kernels (32 rows per SM)
    sms = launch._sm_count(0) if sms is None else sms
    x, gy, w, b = _device_inputs(cp, "float32", 32 * sms + 3, 6, 1)
    _run_all(cp, backend, "float32", cp.asfortranarray(x)[:, :, None],
             cp.asfortranarray(gy)[:, :, None], w, b)
    _sync(cp)
    log("probe: done")
    return 0


def find_sanitizer() -> str | None:
    import shutil

    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "bin", "compute-sanitizer")):
            return os.path.join(root, "bin", "compute-sanitizer")
    return None


def run_sanitizers(tools, timeout: int) -> list[Check]:
    """compute-sanitizer on ``--probe``, once per tool; a row per tool."""
    exe = find_sanitizer()
    if exe is None:
        return [Check(f"sanitizer: {t}", "SKIP", 0.0, "compute-sanitizer not found")
                for t in tools]
    checks = []
    for tool in tools:
        cmd = [exe, "--tool", tool, "--error-exitcode", "86", "--print-limit", "20",
               sys.executable, str(Path(__file__).resolve()), "--probe"]
        if tool == "racecheck":
            cmd[3:3] = ["--racecheck-report", "all"]
        log(f"$ {' '.join(cmd)}")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  timeout=timeout)
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired:
            text, code = "TIMEOUT", -1
        (out_dir() / f"sanitizer-{tool}.log").write_text(text)
        summary = [ln for ln in text.splitlines() if "ERROR SUMMARY" in ln or
                   "RACECHECK SUMMARY" in ln]
        probe_ok = "probe: done" in text
        ok = code == 0 and probe_ok and all(" 0 error" in ln or " 0 hazard" in ln
                                            for ln in summary)
        detail = (f"exit {code}; " + ("; ".join(summary) or "no summary line")
                  + ("" if probe_ok else "; probe did not finish"))
        checks.append(Check(f"sanitizer: {tool}", "PASS" if ok else "FAIL",
                            time.monotonic() - t0, detail))
        log(f"  -> {checks[-1].status} {detail}")
    return checks


def check_invariance(cp=None, backend=None, dtypes=("float32", "bfloat16", "float16",
                                                    "float64"), max_n: int | None = None
                     ) -> tuple[str, str]:
    """Bits of the real binary: every configuration, five layouts, a row alone, and
    every grid capped to one block (grid-stride loops) against the default grids."""
    from layernorm._backends._cupy import launch

    cp, backend = _device_modules(cp, backend)
    bad, cases = [], 0
    for dtype in dtypes:
        vec = launch.vector_width(dtype)
        # per configuration a full tile (16-byte vector path) and a scalar tail
        lengths = sorted({g * m * vec for g, m in launch.CONFIGS}
                         | {g * m * vec - 3 for g, m in launch.CONFIGS if g * m * vec > 3}
                         | {2048 * vec + 1})
        for n in [n for n in lengths if max_n is None or n <= max_n]:
            rows = 37
            x, gy, w, b = _device_inputs(cp, dtype, rows, n, n)
            ref = _run_all(cp, backend, dtype, x[:, :, None], gy[:, :, None], w, b)
            for name, x3, gy3, back in _layouts(cp, x, gy):
                got = _run_all(cp, backend, dtype, x3, gy3, w, b)
                for key, val in got.items():
                    v = back(val) if val.ndim == 3 else val
                    r = ref[key][:, :, 0] if ref[key].ndim == 3 else ref[key]
                    cases += 1
                    if not (_bits(v) == _bits(r)).all():
                        bad.append(f"{dtype} n={n} {name} {key}")
            alone = _run_all(cp, backend, dtype, x[rows - 1:, :, None], gy[rows - 1:, :, None],
                             w, b)
            cases += 1
            if not (_bits(alone["y"][0]) == _bits(ref["y"][rows - 1])).all():
                bad.append(f"{dtype} n={n} row alone")
            grid = launch._grid
            launch._grid = lambda *args: 1
            try:
                small = _run_all(cp, backend, dtype, x[:, :, None], gy[:, :, None], w, b)
            finally:
                launch._grid = grid
            for key, val in small.items():
                cases += 1
                if not (_bits(val) == _bits(ref[key])).all():
                    bad.append(f"{dtype} n={n} grid=1 {key}")
    # several gradient blocks: the tree's bits under any grid
    rows = launch.GRAD_ROW_BLOCK * (2 * launch.SUM_FAN + 1) + 5
    x, gy, w, b = _device_inputs(cp, "float32", rows, 33, 5)
    ref = _run_all(cp, backend, "float32", x[:, :, None], gy[:, :, None], w, b)
    grid = launch._grid
    for cap in (1, 3):
        launch._grid = lambda *args, cap=cap: min(grid(*args), cap)
        try:
            got = _run_all(cp, backend, "float32", x[:, :, None], gy[:, :, None], w, b)
        finally:
            launch._grid = grid
        for key in ("gw", "gb", "rms_gw"):
            cases += 1
            if not (_bits(got[key]) == _bits(ref[key])).all():
                bad.append(f"{rows} rows grid<={cap} {key}")
    if bad:
        return "FAIL", f"{len(bad)}/{cases} differ: " + ", ".join(bad[:6])
    return "PASS", f"{cases} comparisons bit-identical"


# ------------------------------------------------ quantized output, grad_residual

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantize_reference(y32, fmt: str, scale=None):
    """(codes as bytes, scale) of float32 rows ``y32`` by the contract's formula (host
    NumPy float32; float8 rounding by ml_dtypes), for comparison with the kernels."""
    import numpy as np

    y32 = np.asarray(y32, np.float32)
    qmax = np.float32(QMAX[fmt])
    if scale is None:
        amax = np.max(np.abs(y32), axis=1)
        s = np.where(amax == 0, np.float32(1), amax / qmax).astype(np.float32)
    else:
        s = np.full(y32.shape[0], scale, np.float32)
    inv = (np.float32(1) / s).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (y32 * inv[:, None]).astype(np.float32)
        if fmt == "int8":
            v = np.clip(np.where(np.isnan(v), np.float32(0), v), -128, 127)
            return np.rint(v).astype(np.int8).view(np.uint8), s
        import ml_dtypes

        return np.clip(v, -qmax, qmax).astype(getattr(ml_dtypes, fmt)).view(np.uint8), s


def _same_codes(got, want, fmt: str) -> bool:
    """Bytes equal; for float8 any NaN code where the reference has a NaN code."""
    import numpy as np

    got, want = np.ascontiguousarray(_host(got)).view(np.uint8), np.asarray(want, np.uint8)
    if fmt == "int8":
        return bool((got == want).all())
    nan = {"float8_e4m3fn": (0x7F,), "float8_e5m2": (0x7D, 0x7E, 0x7F)}[fmt]
    is_nan = lambda c: np.isin(c & 0x7F, nan)  # noqa: E731
    return bool((is_nan(got) == is_nan(want)).all() and (got[~is_nan(want)]
                                                         == want[~is_nan(want)]).all())


def _same_or_nan(got, want) -> bool:
    import numpy as np

    g, w = np.asarray(_host(got), np.float64), np.asarray(_host(want), np.float64)
    return bool(np.array_equal(np.isnan(g), np.isnan(w)) and (g[~np.isnan(w)]
                                                              == w[~np.isnan(w)]).all())


def _quantized(cp, backend, x3, fmt, rms, w, b, dtypes, scale=None, r3=None, eps=EPS):
    """One quantized_forward call: (codes (rows, n) bytes, scale or None, mean, rstd, h)."""
    rows, n, _ = x3.shape
    q = cp.empty((rows, n), cp.uint8)
    mean, rstd = cp.empty(rows, "float32"), cp.empty(rows, "float32")
    scale_out = cp.empty(rows, "float32")
    inv = None if scale is None else cp.asarray(
        __import__("numpy").full(rows, 1 / __import__("numpy").float32(scale), "float32"))
    h = None
    if r3 is not None:  # h in float32, or stored as x is
        h = cp.empty((rows, n), "float32" if dtypes[2] == "float32" else x3.dtype)[:, :, None]
    backend.quantized_forward(x3, r3, w, None if rms else b, eps, h, q[:, :, None],
                              None if rms else mean, rstd, fmt, inv,
                              scale_out if scale is None else cp.empty(0, "float32"), dtypes)
    return q, (scale_out if scale is None else None), mean, rstd, h


def _run_fused(cp, backend, dtype: str, x3, gy3, w, b) -> None:
    """The probe's fused launches for one layout: quantized (rows of unit stride only)
    and grad_residual."""
    outer, n, inner = x3.shape
    rows = outer * inner
    if inner == 1 and (n == 1 or x3.strides[1] == x3.itemsize):
        for k, fmt in enumerate(QMAX):
            _quantized(cp, backend, x3, fmt, k == 1, w, b, (dtype,) * 3,
                       None if k != 2 else 0.25)
        r3 = cp.zeros((outer, n), "float32")[:, :, None] + 0.5
        _quantized(cp, backend, x3, "int8", False, w, b, (dtype, "float32", "float32"),
                   r3=r3)
    mean, rstd = cp.empty(rows, "float32"), cp.empty(rows, "float32")
    y = cp.empty(x3.shape, x3.dtype)
    backend.layer_norm_forward(x3, w, b, EPS, y, mean, rstd, dtype)
    gx = cp.empty(x3.shape, x3.dtype)
    backend.layer_norm_backward(gy3, x3, mean, rstd, w, gx, dtype, grad_residual=gy3)
    backend.rms_norm_backward(gy3, x3, rstd, w, gx, dtype, grad_residual=gy3)


def _code_table(fmt: str):
    """y32 rows probing ties, saturation, subnormal codes, infinity and NaN in ``fmt``."""
    import numpy as np

    if fmt == "int8":
        vals = [0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.5, 127.5, 128.0, 1e6, -128.5, -1e30]
    else:
        e4 = fmt == "float8_e4m3fn"
        tiny, step, qmax = 2.0 ** (-9 if e4 else -16), (0.125 if e4 else 0.25), QMAX[fmt]
        vals = [1 + step / 2, 1 + 3 * step / 2, -(1 + step / 2), tiny / 2, 3 * tiny / 2,
                -5 * tiny / 2, 1e-45, qmax, qmax * 1.03, -qmax * 1.0625, 1e30, -1e38]
    base = np.array(vals, np.float32)
    table = [base, -base, np.where(np.arange(base.size) == 3, np.inf, base),
             np.where(np.arange(base.size) == 0, np.nan, base), np.zeros_like(base)]
    return [t.astype(np.float32) for t in table]


def check_quantized(cp=None, backend=None, dtypes=("float32", "bfloat16", "float16"),
                    max_n: int | None = None) -> tuple[str, str]:
    """The quantizing kernels and grad_residual on the real binary (see the module
    docstring): codes, scales and statistics against the composition (the plain float32
    forward of the widened row, quantized by :func:`quantize_reference`), bit for bit."""
    import numpy as np

    from layernorm._backends._cupy import launch

    cp, backend = _device_modules(cp, backend)
    bad, cases = [], 0

    def expect(ok, what):
        nonlocal cases
        cases += 1
        if not ok:
            bad.append(what)

    lengths = sorted({g * m * 4 for g, m in launch.CONFIGS}
                     | {g * m * 4 - 3 for g, m in launch.CONFIGS if g * m * 4 > 3}
                     | {2048 * 4 + 1})
    step = 0
    for dtype in dtypes:
        for n in [n for n in lengths if max_n is None or n <= max_n]:
            rows = 37
            x, _, w, b = _device_inputs(cp, dtype, rows, n, n)
            xh = _decode(x, dtype).astype(np.float32)
            xh[3, n // 2] = np.nan
            x = cp.asarray(_encode(xh.astype(np.float64), dtype))
            rng = np.random.default_rng(n)
            r32 = rng.standard_normal((rows, n)).astype(np.float32)
            for add in (False, True):
                dtypes3 = (dtype, "float32", "float32") if add else (dtype,) * 3
                a = (xh + r32).astype(np.float32) if add else xh
                a_dev = cp.asarray(a)
                r3 = cp.asarray(r32)[:, :, None] if add else None
                for rms in (False, True):
                    fmt = tuple(QMAX)[step % 3]
                    scale = None if step % 2 == 0 else 0.0625
                    step += 1
                    tag = f"{dtypes3} n={n} {'rms' if rms else 'ln'} {fmt} scale={scale}"
                    y32 = cp.empty((rows, n), "float32")
                    mean, rstd = cp.empty(rows, "float32"), cp.empty(rows, "float32")
                    if rms:
                        backend.rms_norm_forward(a_dev[:, :, None], w, EPS, y32[:, :, None],
                                                 rstd, "float32")
                    else:
                        backend.layer_norm_forward(a_dev[:, :, None], w, b, EPS,
                                                   y32[:, :, None], mean, rstd, "float32")
                    q_ref, s_ref = quantize_reference(_host(y32), fmt, scale)
                    q, s, qm, qr, h = _quantized(cp, backend, x[:, :, None], fmt, rms, w, b,
                                                 dtypes3, scale, r3)
                    expect(_same_codes(q, q_ref, fmt), f"{tag} codes")
                    if scale is None:
                        expect(_same_or_nan(s, s_ref), f"{tag} scale")
                    expect(_same_or_nan(qr, rstd), f"{tag} rstd")
                    if not rms:
                        expect(_same_or_nan(qm, mean), f"{tag} mean")
                    if add:
                        expect(_same_or_nan(h[:, :, 0], a), f"{tag} h")
                    alone = _quantized(cp, backend, x[rows - 1:, :, None], fmt, rms, w, b,
                                       dtypes3, scale, None if r3 is None else r3[rows - 1:])
                    expect((_bits(alone[0][0]) == _bits(q[rows - 1])).all(), f"{tag} alone")
                    grid = launch._grid
                    launch._grid = lambda *args: 1
                    try:
                        one = _quantized(cp, backend, x[:, :, None], fmt, rms, w, b, dtypes3,
                                         scale, r3)
                    finally:
                        launch._grid = grid
                    expect((_bits(one[0]) == _bits(q)).all(), f"{tag} grid=1")
    # Chosen y32 values: RMSNorm of ones with eps = 0 gives y32 = weight exactly.
    for fmt in QMAX:
        for k, y32 in enumerate(_code_table(fmt)):
            ones = cp.ones((1, y32.size), "float32")[:, :, None]
            for scale in (None, 1.0):
                q, s, _, _, _ = _quantized(cp, backend, ones, fmt, True, cp.asarray(y32), None,
                                           ("float32",) * 3, scale, eps=0.0)
                q_ref, s_ref = quantize_reference(y32[None], fmt, scale)
                expect(_same_codes(q, q_ref, fmt), f"{fmt} code table row {k} scale={scale}")
                if scale is None:
                    expect(_same_or_nan(s, s_ref), f"{fmt} code table row {k} scale")
    # grad_residual: grad_x + grad_residual bit for bit (float32, float64), every layout.
    for dtype in ("float32", "float64", "bfloat16"):
        for n in (5, 1000, 8193):
            x, gy, w, b = _device_inputs(cp, dtype, 37, n, n + 1)
            gr, _, _, _ = _device_inputs(cp, dtype, 37, n, n + 2)
            ref = _run_all(cp, backend, dtype, x[:, :, None], gy[:, :, None], w, b)
            acc = "float64" if dtype == "float64" else "float32"
            first = {}  # 16-bit: the contiguous layout's grad_x, which the others must equal
            for name, x3, gy3, back in _layouts(cp, x, gy):
                gr3 = next(v for nm, v, _, _ in _layouts(cp, gr, gr) if nm == name)
                for rms in (False, True):
                    gx = cp.empty(x3.shape, x3.dtype)
                    if rms:
                        backend.rms_norm_backward(gy3, x3, ref["rms_rstd"], w, gx, dtype,
                                                  grad_residual=gr3)
                        plain = ref["rms_gx"]
                    else:
                        backend.layer_norm_backward(gy3, x3, ref["mean"], ref["rstd"], w, gx,
                                                    dtype, grad_residual=gr3)
                        plain = ref["gx"]
                    tag = f"grad_residual {dtype} n={n} {name} {'rms' if rms else 'ln'}"
                    if dtype == acc:
                        want = _host(plain)[:, :, 0] + _host(gr)
                        expect((_bits(back(gx)) == _bits(want)).all(), tag)
                    elif name == "contiguous":
                        first[rms] = back(gx)
                    else:
                        expect((_bits(back(gx)) == _bits(first[rms])).all(), tag)
    if bad:
        return "FAIL", f"{len(bad)}/{cases} differ: " + ", ".join(bad[:6])
    return "PASS", f"{cases} comparisons bit-identical"


def check_subnormal(cp=None, backend=None) -> tuple[str, str]:
    """eps=0, squared deviations below 1e-38: finite rstd and normalized rows (no FTZ)."""
    import numpy as np

    cp, backend = _device_modules(cp, backend)

    rng = np.random.default_rng(3)
    problems = []
    for dtype in ("float32", "bfloat16"):
        xh = 3e-21 * rng.standard_normal((4, 256))
        x = cp.asarray(_encode(xh, dtype))
        y, mean, rstd = cp.empty_like(x), cp.empty(4, "float32"), cp.empty(4, "float32")
        backend.layer_norm_forward(x[:, :, None], None, None, 0.0, y[:, :, None], mean, rstd,
                                   dtype)
        xv = _decode(x, dtype)
        ref = (xv - xv.mean(1, keepdims=True)) / xv.std(1, keepdims=True)
        got = _decode(y, dtype)
        err = float(np.nanmax(np.abs(got - ref))) if np.isfinite(got).all() else float("inf")
        if not (np.isfinite(_host(rstd)).all() and err < 0.05):
            problems.append(f"{dtype}: max error {err:.3g}, rstd {_host(rstd)[:2]}")
    return ("FAIL", "; ".join(problems)) if problems else ("PASS", "float32, bfloat16 ok")


def check_torch() -> tuple[str, str]:
    """Forward and backward values against torch.nn.functional on the same device."""
    import cupy as cp
    import numpy as np

    from layernorm._backends import _cupy as backend

    torch = try_import("torch")
    if torch is None or not torch.cuda.is_available():
        return "SKIP", "torch with CUDA not available"
    F = torch.nn.functional
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    tol = {"float32": 1e-4, "bfloat16": 6e-2, "float16": 8e-3}
    worst = []
    for dtype in ("float32", "bfloat16", "float16"):
        for rows, n in ((64, 768), (8, 4096), (3, 65537), (300, 5)):
            x, gy, w, b = _device_inputs(cp, dtype, rows, n, n)
            ours = _run_all(cp, backend, dtype, x[:, :, None], gy[:, :, None], w, b)
            tx = torch.tensor(_decode(x, dtype), device="cuda").to(tdt[dtype])
            tg = torch.tensor(_decode(gy, dtype), device="cuda").to(tdt[dtype])
            tw = torch.from_dlpack(w).clone().requires_grad_(True)
            tb = torch.from_dlpack(b).clone().requires_grad_(True)
            txr = tx.clone().requires_grad_(True)
            ty = F.layer_norm(txr, (n,), tw.to(tx.dtype), tb.to(tx.dtype), EPS)
            tgx, tgw, tgb = torch.autograd.grad(ty, (txr, tw, tb), tg)
            pairs = {"y": ty, "gx": tgx, "gw": tgw, "gb": tgb}
            if hasattr(F, "rms_norm"):  # torch >= 2.4
                txr2 = tx.clone().requires_grad_(True)
                tyr = F.rms_norm(txr2, (n,), tw.to(tx.dtype), EPS)
                rgx, rgw = torch.autograd.grad(tyr, (txr2, tw), tg)
                pairs.update(rms_y=tyr, rms_gx=rgx, rms_gw=rgw)
            for key, tval in pairs.items():
                t = tval.detach().double().cpu().numpy()
                o = _decode(ours[key], dtype) if ours[key].ndim == 3 else _host(
                    ours[key]).astype(np.float64)
                o = o[:, :, 0] if o.ndim == 3 else o
                scale = max(1.0, float(np.abs(t).max()))
                # parameter gradients sum over rows: allow for the row count
                k = tol[dtype] * (np.sqrt(rows) if key.endswith("gw") or key == "gb" else 1)
                err = float(np.abs(o - t).max()) / scale
                worst.append((err / k, f"{dtype} {rows}x{n} {key} err {err:.2e}"))
    worst.sort(reverse=True)
    bad = [w for r, w in worst if r > 1]
    if bad:
        return "FAIL", f"{len(bad)} beyond tolerance: " + "; ".join(bad[:4])
    return "PASS", f"{len(worst)} comparisons; closest to tolerance: {worst[0][1]}"


# --------------------------------------------------------------------------- bench


@dataclass
class Row:
    op: str
    dtype: str
    n: int
    rows: int
    bytes: int
    ours_us: float | None = None
    #: Host time to issue one of our calls (see host_issue_us).
    host_us: float | None = None
    torch_us: float | None = None
    copy_us: float | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)
    layout: str = "contig"

    @property
    def gbps(self) -> float | None:
        return None if not self.ours_us else self.bytes / self.ours_us / 1e3

    @property
    def pct_copy(self) -> float | None:
        if not self.ours_us or not self.copy_us:
            return None
        return 100.0 * self.copy_us / self.ours_us

    @property
    def speedup(self) -> float | None:
        if not self.ours_us or not self.torch_us:
            return None
        return self.torch_us / self.ours_us


def moved_bytes(op: str, rows: int, n: int, itemsize: int) -> int:
    """Fewest bytes the op must move: each input read once, each output written once."""
    elems = rows * n
    if op == "ln_fwd_q8":
        return elems * (itemsize + 1)  # x in, codes out
    if op == "add_rms_f8":
        return elems * (3 * itemsize + 1)  # x, residual in, h and codes out
    if op == "ln_bwd_res":
        return 4 * elems * itemsize  # x, dy, grad_residual in, dx out
    if op.endswith("fwd"):
        return 2 * elems * itemsize  # x in, y out (parameters and stats are negligible)
    return 3 * elems * itemsize  # x and dy in, dx out


class Timer:
    """Median per-call time (us) of back-to-back calls between CUDA events.

    layernorm's one timer (``layernorm.bench.timing``) on a CUDA-event clock, rotating
    over ``fns`` (one callable per input set) so that every batch touches all of them.
    """

    def __init__(self, cupy, batches: int = 7, target_ms: float = 2.0) -> None:
        from layernorm.bench import timing  # after ensure_paths(): src/ is importable

        self.timing = timing
        self.clock = timing.CudaEventClock(cupy)
        self.batches = batches
        self.target_ms = target_ms

    def __call__(self, fns) -> float:
        fns = list(fns)
        t = self.timing.median_times(
            {"fns": self.timing.rotating(fns)}, self.batches, self.target_ms / 1e3,
            clock=self.clock, warmup=len(fns), min_number=len(fns), max_number=2000)
        return t["fns"] * 1e6


def _buffers(nbytes: int) -> int:
    """Input sets to rotate over so that repeated calls do not just hit the 60 MB L2."""
    return max(1, min(8, (256 << 20) // max(nbytes, 1)))


def copy_bytes(dst, src) -> None:
    """Device-to-device copy (cudaMemcpyAsync on the current stream)."""
    if hasattr(dst, "data") and hasattr(dst.data, "copy_from_device_async"):
        dst.data.copy_from_device_async(src.data, src.nbytes)
    else:  # the dry run's host arrays
        dst[...] = src


def host_issue_us(fns, calls: int = 50) -> float:
    """Host time (us) to issue one call, without waiting for the device.

    The Python side of a launch (argument checks, CuPy's kernel call): where it is about
    as long as the device time per call, the launches, not the kernel, set the speed.
    """
    fns = list(fns)
    for fn in fns:
        fn()
    t0 = time.perf_counter()
    for k in range(calls):
        fns[k % len(fns)]()
    return (time.perf_counter() - t0) / calls * 1e6


def bench_case(cp, backend, torch, timer, op: str, dtype: str, n: int, rows: int,
               layout: str = "contig") -> Row:
    """Time one case. ``layout="strided"``: x and dy are ``[:, ::2]`` views of rows twice
    as wide (element stride 2, the row kernels' strided path); GB/s still counts only the
    elements used."""
    itemsize = 4 if dtype == "float32" else 2
    row = Row(op, dtype, n, rows, moved_bytes(op, rows, n, itemsize), layout=layout)
    sets = _buffers(row.bytes)
    rng = cp.random.default_rng(n)

    def make(shift: float):
        width = 2 * n if layout == "strided" else n
        data = rng.standard_normal((rows, width), dtype=cp.float32) * 2.0 + shift
        return encode(data)[:, ::2] if layout == "strided" else encode(data)

    def encode(data):
        if dtype == "float32":
            return data
        if dtype == "float16":
            return data.astype(cp.float16)
        # bfloat16 bits (round to nearest even) in a uint16 array
        bits = data.view(cp.uint32)
        bits = bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))
        return (bits >> 16).astype(cp.uint16)

    xs = [make(0.5 + k) for k in range(sets)]
    gys = [make(0.0) for _ in range(sets)] if "bwd" in op or op == "add_rms_f8" else []
    w = cp.asarray(rng.standard_normal(n, dtype=cp.float32) * 0.1 + 1.0)
    b = cp.asarray(rng.standard_normal(n, dtype=cp.float32) * 0.1)
    ys = [cp.empty((rows, n), dtype=x.dtype) for x in xs]
    mean = cp.empty(rows, dtype=cp.float32)
    rstd = cp.empty(rows, dtype=cp.float32)
    x3 = [x[:, :, None] for x in xs]
    y3 = [y[:, :, None] for y in ys]
    gy3 = [g[:, :, None] for g in gys]

    if op == "ln_fwd":
        fns = [lambda k=k: backend.layer_norm_forward(x3[k], w, b, EPS, y3[k], mean, rstd, dtype)
               for k in range(sets)]
    elif op == "rms_fwd":
        fns = [lambda k=k: backend.rms_norm_forward(x3[k], w, EPS, y3[k], rstd, dtype)
               for k in range(sets)]
    elif op == "ln_bwd":
        backend.layer_norm_forward(x3[0], w, b, EPS, y3[0], mean, rstd, dtype)
        fns = [lambda k=k: backend.layer_norm_backward(gy3[k], x3[k], mean, rstd, w, y3[k],
                                                       dtype) for k in range(sets)]
    elif op == "rms_bwd":
        backend.rms_norm_forward(x3[0], w, EPS, y3[0], rstd, dtype)
        fns = [lambda k=k: backend.rms_norm_backward(gy3[k], x3[k], rstd, w, y3[k], dtype)
               for k in range(sets)]
    elif op == "ln_bwd_res":  # grad_residual: dy itself (another buffer of the same size)
        backend.layer_norm_forward(x3[0], w, b, EPS, y3[0], mean, rstd, dtype)
        fns = [lambda k=k: backend.layer_norm_backward(gy3[k], x3[k], mean, rstd, w, y3[k],
                                                       dtype, grad_residual=gy3[k - 1])
               for k in range(sets)]
    else:  # the quantized forwards: codes into uint8 rows, a scale per row
        qs = [cp.empty((rows, n), dtype=cp.uint8)[:, :, None] for _ in range(sets)]
        scale = cp.empty(rows, dtype=cp.float32)
        if op == "ln_fwd_q8":
            fns = [lambda k=k: backend.quantized_forward(
                x3[k], None, w, b, EPS, None, qs[k], mean, rstd, "int8", None, scale,
                (dtype,) * 3) for k in range(sets)]
        else:  # h = x + residual in x's dtype, stored as x is
            hs = [cp.empty((rows, n), dtype=x.dtype)[:, :, None] for x in xs]
            fns = [lambda k=k: backend.quantized_forward(
                x3[k], gy3[k], w, None, EPS, hs[k], qs[k], None, rstd, "float8_e4m3fn", None,
                scale, (dtype,) * 3) for k in range(sets)]
    row.ours_us = timer(fns)
    row.host_us = host_issue_us(fns)
    if hasattr(cp, "cuda"):
        cp.cuda.Device().synchronize()

    # Device-to-device copy of the same bytes (half read, half written).
    half = row.bytes // 2
    src = [cp.ones(half, dtype=cp.uint8) for _ in range(min(sets, 4))]
    dst = cp.empty(half, dtype=cp.uint8)
    row.copy_us = timer([lambda s=s: copy_bytes(dst, s) for s in src])

    if torch is not None and torch.cuda.is_available() and op not in FUSED_OPS:
        # torch's failure (a dtype it does not take, say) leaves our numbers standing.
        try:
            def to_torch(a):
                if dtype == "bfloat16":  # uint16 bits -> int16 (DLPack-safe) -> bfloat16 view
                    return torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)
                return torch.from_dlpack(a)

            F = torch.nn.functional
            tx = [to_torch(x) for x in xs]
            # Parameters in x's dtype, as a module cast with .to(bfloat16) holds them (torch's
            # CUDA LayerNorm backward takes no float32 weight beside a bfloat16 input).
            tw, tb = (torch.from_dlpack(p).to(tx[0].dtype) for p in (w, b))
            if op == "ln_fwd":
                tfns = [lambda t=t: F.layer_norm(t, (n,), tw, tb, EPS) for t in tx]
            elif op == "rms_fwd":
                tfns = [lambda t=t: F.rms_norm(t, (n,), tw, EPS) for t in tx]
            else:
                tg = [to_torch(g) for g in gys]
                xr = [t.detach().requires_grad_(True) for t in tx]
                twr = tw.detach().requires_grad_(True)
                tbr = tb.detach().requires_grad_(True)
                if op == "ln_bwd":
                    outs = [F.layer_norm(t, (n,), twr, tbr, EPS) for t in xr]
                    tfns = [lambda k=k: torch.autograd.grad(outs[k], (xr[k], twr, tbr), tg[k],
                                                            retain_graph=True)
                            for k in range(sets)]
                else:
                    outs = [F.rms_norm(t, (n,), twr, EPS) for t in xr]
                    tfns = [lambda k=k: torch.autograd.grad(outs[k], (xr[k], twr), tg[k],
                                                            retain_graph=True)
                            for k in range(sets)]
            row.torch_us = timer(tfns)
        except Exception as exc:
            row.extra["torch_error"] = f"{type(exc).__name__}: {exc}"
    return row


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``format(value, spec) + suffix``, or a right-aligned "-" of the same width."""
    if value is None:
        width = int(spec.split(".")[0] or 0) + len(suffix)
        return "-".rjust(width)
    return format(value, spec) + suffix


def table(rows: list[Row], header: str) -> str:
    lines = [header,
             f"{'op':<11}{'dtype':<10}{'layout':<9}{'rows x n':>14}{'ours us':>11}{'GB/s':>9}"
             f"{'% copy':>8}{'torch us':>11}{'speed-up':>10}{'copy us':>10}{'host us':>9}"]
    for r in rows:
        shape = f"{r.rows}x{r.n}"
        head = f"{r.op:<11}{r.dtype:<10}{r.layout:<9}{shape:>14}"
        if r.error:
            lines.append(f"{head}  ERROR {r.error[:60]}")
            continue
        lines.append(
            f"{head}{fmt(r.ours_us, '11.1f')}"
            f"{fmt(r.gbps, '9.0f')}{fmt(r.pct_copy, '7.0f', '%')}{fmt(r.torch_us, '11.1f')}"
            f"{fmt(r.speedup, '9.2f', 'x')}{fmt(r.copy_us, '10.1f')}{fmt(r.host_us, '9.1f')}")
    lines.append("GB/s counts each input read once and each output written once; % copy is "
                 "the copy's time for the same bytes over ours; speed-up is torch us / ours us;"
                 " host us is the Python time to issue one of our calls (near ours us: "
                 "launch-bound).")
    return "\n".join(lines)


def save(rows: list[Row], info: dict, name: str = "bench") -> None:
    out = out_dir()
    records = [dict(asdict(r), gbps=r.gbps, pct_copy=r.pct_copy, speedup=r.speedup)
               for r in rows]
    (out / f"{name}.json").write_text(json.dumps({"env": info, "rows": records}, indent=1))
    keys = ["op", "dtype", "layout", "rows", "n", "bytes", "ours_us", "gbps", "pct_copy",
            "torch_us", "speedup", "copy_us", "host_us", "error"]
    csv = [",".join(keys)] + [",".join("" if rec[k] is None else str(rec[k]) for k in keys)
                              for rec in records]
    (out / f"{name}.csv").write_text("\n".join(csv) + "\n")


def run_bench(rows_n: int, widths, dtypes, ops, budget_s: float, dry: bool = False,
              layouts=LAYOUTS) -> list[Row]:
    if dry:
        from layernorm._backends import _numba as backend

        cupy, torch = FakeCupy(), None
    else:
        import cupy

        from layernorm._backends import _cupy as backend

        torch = try_import("torch")
        if torch is not None and not torch.cuda.is_available():
            log("  torch has no CUDA here: torch columns left empty")
            torch = None
    timer = Timer(cupy)
    rows: list[Row] = []
    t_end = time.monotonic() + budget_s
    cases = [(op, dtype, layout, n) for op in ops for dtype in dtypes for layout in layouts
             for n in widths if op not in FUSED_OPS or layout == "contig"]
    for op, dtype, layout, n in cases:
        if time.monotonic() > t_end:
            rows.append(Row(op, dtype, n, rows_n, 0, error="skipped: time budget",
                            layout=layout))
            continue
        try:
            row = bench_case(cupy, backend, torch, timer, op, dtype, n, rows_n, layout)
        except Exception as exc:  # keep going: one failure must not hide the rest
            row = Row(op, dtype, n, rows_n, 0, error=f"{type(exc).__name__}: {exc}",
                      layout=layout)
        rows.append(row)
        log(f"  {op} {dtype} {layout} {rows_n}x{n}: ours {fmt(row.ours_us, '.1f')} us, "
            f"torch {fmt(row.torch_us, '.1f')} us, copy {fmt(row.copy_us, '.1f')} us"
            + (f" [{row.error}]" if row.error else "")
            + (f" [torch: {row.extra['torch_error']}]" if "torch_error" in row.extra else ""))
        cupy.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    return rows


class FakeCupy:
    """Just enough of CuPy, on the host, for the dry run to go through bench_case.

    Arrays are NumPy arrays, kernels are the Numba backend's (same interface), events
    read the host clock.
    """

    def __init__(self) -> None:
        import types

        import numpy as np

        self._np = np
        for name in ("float32", "float16", "uint16", "int16", "uint32", "uint8"):
            setattr(self, name, getattr(np, name))
        self.random = types.SimpleNamespace(default_rng=np.random.default_rng)
        self.empty, self.empty_like, self.ones, self.asarray = (
            np.empty, np.empty_like, np.ones, np.asarray)

        class Event:
            def record(self) -> None:
                self.t = time.perf_counter()

            def synchronize(self) -> None:
                pass

        device = types.SimpleNamespace(synchronize=lambda: None)
        self.cuda = types.SimpleNamespace(
            Event=Event, Device=lambda *a: device,
            get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3)
        pool = types.SimpleNamespace(free_all_blocks=lambda: None)
        self.get_default_memory_pool = lambda: pool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (also used by the tests, which have no GPU)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: fake timings through the table and file code paths")
    parser.add_argument("--probe", action="store_true",
                        help="only the small every-kernel workload (the sanitizers' target)")
    parser.add_argument("--sections", type=lambda s: [v for v in s.split(",") if v],
                        default=list(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest runs")
    parser.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds for the whole run: later sections get what is left, "
                             "and are skipped (a SKIP row) when it is spent")
    parser.add_argument("--test-timeout", type=int, default=200)
    parser.add_argument("--sanitizer-timeout", type=int, default=90,
                        help="seconds per compute-sanitizer tool")
    parser.add_argument("--bench-budget", type=float, default=100.0,
                        help="seconds after which remaining benchmark cases are skipped")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--widths", type=lambda s: [int(v) for v in s.split(",")],
                        default=list(WIDTHS))
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES))
    parser.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS))
    parser.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS))
    args = parser.parse_args(argv)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {SECTIONS}")
    if args.no_tests:
        args.sections = [s for s in args.sections if s != "tests"]
    if args.no_bench:
        args.sections = [s for s in args.sections if s != "bench"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    ensure_paths()
    if args.probe:
        return probe()
    log("== environment")
    info = environment()
    for key, value in info.items():
        log(f"  {key}: {value}")
    (out_dir() / "env.json").write_text(json.dumps(info, indent=1, default=str))
    results: list[Check] = []

    if args.dry_run:
        # Host arrays and the Numba kernels through the same benchmark code; small sizes.
        rows_n = min(args.rows, 64)
        widths = [n for n in args.widths if n <= 4096]
        log("== DRY RUN: host arrays, Numba kernels, host clock")
        rows: list[Row] = []

        def bench_dry():
            rows.extend(run_bench(rows_n, widths, args.dtypes, args.ops, args.bench_budget,
                                  dry=True, layouts=args.layouts))
            save(rows, info, "bench-dry-run")
            errors = [r for r in rows if r.error]
            return ("FAIL" if errors else "PASS"), f"{len(rows)} cases, {len(errors)} errors"

        for name in args.sections:
            if name == "bench":
                guarded(results, "bench (dry run)", bench_dry)
            else:
                results.append(Check(name, "SKIP", 0.0, "dry run: needs a GPU"))
        log("")
        log(table(rows, f"== DRY RUN (CPU, not GPU numbers), {rows_n} rows"))
        log("")
        log(summary_table(results))
        return 0 if all(c.status in ("PASS", "SKIP") for c in results) else 1

    if not str(info.get("gpu", "none")).strip() or str(info.get("gpu", "none")).startswith(
            "none") or info.get("cupy", "").startswith("MISSING"):
        log("no usable CuPy + GPU: nothing to check (try --dry-run)")
        log(summary_table([Check("gpu", "ERROR", 0.0, f"no usable CuPy + GPU: "
                                                     f"{info.get('gpu')}")]))
        return 2

    rows = []
    deadline = t_start + args.budget
    order = [name for name in SECTIONS if name in args.sections]
    for name in order:
        left = int(deadline - time.monotonic())
        if left < 20:
            results.append(Check(name, "SKIP", 0.0, f"--budget {args.budget:.0f} s spent"))
            continue
        if name == "compile":
            guarded(results, "compile", lambda: (
                ("PASS", "every kernel") if precompile(max(1, min(16, os.cpu_count() or 1)))
                else ("FAIL", "see the log")))
        elif name == "tests":
            guarded(results, "tests", run_tests, min(args.test_timeout, left - 10),
                    args.workers)
        elif name == "sanitizer":
            guarded(results, "sanitizer", run_sanitizers, SANITIZER_TOOLS,
                    max(20, min(args.sanitizer_timeout, (left - 10) // len(SANITIZER_TOOLS))))
        elif name == "invariance":
            guarded(results, "invariance (bits)", check_invariance)
        elif name == "subnormal":
            guarded(results, "subnormal (no FTZ)", check_subnormal)
        elif name == "quantized":
            guarded(results, "quantized + grad_residual (bits)", check_quantized)
        elif name == "torch":
            guarded(results, "torch agreement", check_torch)
        elif name == "bench":
            def bench(left=left):
                budget = max(5.0, min(args.bench_budget, left - 15.0))
                rows.extend(run_bench(args.rows, args.widths, args.dtypes, args.ops, budget,
                                      layouts=args.layouts))
                save(rows, info)
                errors = [r for r in rows if r.error]
                return ("FAIL" if errors else "PASS"), (
                    f"{len(rows)} cases, {len(errors)} errors"
                    + (f" (first: {errors[0].error[:60]})" if errors else ""))
            guarded(results, "bench", bench)
    log(f"== total {time.monotonic() - t_start:.0f} s")
    if rows:
        gpu = info.get("gpu", "?")
        log("")
        log(table(rows, f"== LayerNorm/RMSNorm on {gpu}, {args.rows} rows, CUDA-event medians"))
    log("")
    log(summary_table(results))
    (out_dir() / "checks.json").write_text(json.dumps([asdict(c) for c in results], indent=1))
    return 0 if all(c.status in ("PASS", "SKIP") for c in results) else 1


if __name__ == "__main__":
    sys.exit(main())
