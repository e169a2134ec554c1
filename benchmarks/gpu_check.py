"""One-call GPU check for the CuPy backend: the whole GPU test suite, then a benchmark table.

Run from the repository root on a machine with a CUDA GPU::

    python benchmarks/gpu_check.py            # tests, then the table (about 5 minutes)
    python benchmarks/gpu_check.py --no-tests # the table only
    python benchmarks/gpu_check.py --dry-run  # no GPU: host arrays, Numba kernels, same code

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
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

OPS = ("ln_fwd", "rms_fwd", "ln_bwd", "rms_bwd")
DTYPES = ("float32", "float16", "bfloat16")
ROWS = 8192
WIDTHS = (64, 768, 1024, 1000, 4096, 8192, 16384, 65536)
EPS = 1e-5


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


def run_tests(timeout: int, workers: int) -> bool:
    """The GPU test suite: our two files, then every cupy-parametrized test elsewhere."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    have_xdist = importlib.util.find_spec("xdist") is not None
    par = ["-n", str(workers)] if have_xdist and workers > 1 else []
    runs = [
        ("gpu-suite", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                       *par, "tests/test_cupy_backend.py", "tests/test_cuda_compile.py",
                       "-k", "not numpy and not emulation"]),
        ("cupy-params", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                         *par, "--continue-on-collection-errors",
                         "tests", "-k", "cupy and not test_cupy_backend",
                         "--ignore=tests/test_cupy_backend.py",
                         "--ignore=tests/test_cuda_compile.py"]),
    ]
    ok = True
    deadline = time.monotonic() + timeout
    for name, cmd in runs:
        left = max(30, int(deadline - time.monotonic()))
        log(f"$ {' '.join(cmd)}   (timeout {left} s)")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=left)
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            text = (exc.stdout or b"").decode(errors="replace") if isinstance(
                exc.stdout, bytes) else (exc.stdout or "")
            text += "\nTIMEOUT"
            code = -1
        (out_dir() / f"pytest-{name}.log").write_text(text)
        tail = "\n".join(text.strip().splitlines()[-25:])
        log(tail)
        log(f"  [{name}] exit {code} in {time.perf_counter() - t0:.0f} s")
        # pytest exit 5: nothing collected (e.g. no cupy params elsewhere): not a failure.
        ok = ok and code in (0, 5)
    return ok


# --------------------------------------------------------------------------- bench


@dataclass
class Row:
    op: str
    dtype: str
    n: int
    rows: int
    bytes: int
    ours_us: float | None = None
    torch_us: float | None = None
    copy_us: float | None = None
    error: str = ""
    extra: dict = field(default_factory=dict)

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


def bench_case(cp, backend, torch, timer, op: str, dtype: str, n: int, rows: int) -> Row:
    itemsize = 4 if dtype == "float32" else 2
    row = Row(op, dtype, n, rows, moved_bytes(op, rows, n, itemsize))
    sets = _buffers(rows * n * itemsize * (2 if op.endswith("fwd") else 3))
    rng = cp.random.default_rng(n)

    def make(shift: float):
        data = rng.standard_normal((rows, n), dtype=cp.float32) * 2.0 + shift
        if dtype == "float32":
            return data
        if dtype == "float16":
            return data.astype(cp.float16)
        # bfloat16 bits (round to nearest even) in a uint16 array
        bits = data.view(cp.uint32)
        bits = bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))
        return (bits >> 16).astype(cp.uint16)

    xs = [make(0.5 + k) for k in range(sets)]
    gys = [make(0.0) for _ in range(sets)] if op.endswith("bwd") else []
    w = cp.asarray(rng.standard_normal(n, dtype=cp.float32) * 0.1 + 1.0)
    b = cp.asarray(rng.standard_normal(n, dtype=cp.float32) * 0.1)
    ys = [cp.empty_like(x) for x in xs]
    mean = cp.empty(rows, dtype=cp.float32)
    rstd = cp.empty(rows, dtype=cp.float32)
    x3 = [x.reshape(rows, n, 1) for x in xs]
    y3 = [y.reshape(rows, n, 1) for y in ys]
    gy3 = [g.reshape(rows, n, 1) for g in gys]

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
    else:
        backend.rms_norm_forward(x3[0], w, EPS, y3[0], rstd, dtype)
        fns = [lambda k=k: backend.rms_norm_backward(gy3[k], x3[k], rstd, w, y3[k], dtype)
               for k in range(sets)]
    row.ours_us = timer(fns)

    # Device-to-device copy of the same bytes (half read, half written).
    half = row.bytes // 2
    src = [cp.ones(half, dtype=cp.uint8) for _ in range(min(sets, 4))]
    dst = cp.empty(half, dtype=cp.uint8)
    row.copy_us = timer([lambda s=s: copy_bytes(dst, s) for s in src])

    if torch is not None and torch.cuda.is_available():
        def to_torch(a):
            if dtype == "bfloat16":  # uint16 bits -> int16 (DLPack-safe) -> bfloat16 view
                return torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)
            return torch.from_dlpack(a)

        F = torch.nn.functional
        tx = [to_torch(x) for x in xs]
        tw, tb = torch.from_dlpack(w), torch.from_dlpack(b)
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
    return row


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``format(value, spec) + suffix``, or a right-aligned "-" of the same width."""
    if value is None:
        width = int(spec.split(".")[0] or 0) + len(suffix)
        return "-".rjust(width)
    return format(value, spec) + suffix


def table(rows: list[Row], header: str) -> str:
    lines = [header,
             f"{'op':<8}{'dtype':<10}{'rows x n':>14}{'ours us':>11}{'GB/s':>9}"
             f"{'% copy':>8}{'torch us':>11}{'speed-up':>10}{'copy us':>10}"]
    for r in rows:
        shape = f"{r.rows}x{r.n}"
        if r.error:
            lines.append(f"{r.op:<8}{r.dtype:<10}{shape:>14}  ERROR {r.error[:60]}")
            continue
        lines.append(
            f"{r.op:<8}{r.dtype:<10}{shape:>14}{fmt(r.ours_us, '11.1f')}"
            f"{fmt(r.gbps, '9.0f')}{fmt(r.pct_copy, '7.0f', '%')}{fmt(r.torch_us, '11.1f')}"
            f"{fmt(r.speedup, '9.2f', 'x')}{fmt(r.copy_us, '10.1f')}")
    lines.append("GB/s counts each input read once and each output written once; % copy is "
                 "the copy's time for the same bytes over ours; speed-up is torch us / ours us.")
    return "\n".join(lines)


def save(rows: list[Row], info: dict, name: str = "bench") -> None:
    out = out_dir()
    records = [dict(asdict(r), gbps=r.gbps, pct_copy=r.pct_copy, speedup=r.speedup)
               for r in rows]
    (out / f"{name}.json").write_text(json.dumps({"env": info, "rows": records}, indent=1))
    keys = ["op", "dtype", "rows", "n", "bytes", "ours_us", "gbps", "pct_copy", "torch_us",
            "speedup", "copy_us", "error"]
    csv = [",".join(keys)] + [",".join("" if rec[k] is None else str(rec[k]) for k in keys)
                              for rec in records]
    (out / f"{name}.csv").write_text("\n".join(csv) + "\n")


def run_bench(rows_n: int, widths, dtypes, ops, budget_s: float, dry: bool = False
              ) -> list[Row]:
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
    for op in ops:
        for dtype in dtypes:
            for n in widths:
                if time.monotonic() > t_end:
                    rows.append(Row(op, dtype, n, rows_n, 0, error="skipped: time budget"))
                    continue
                try:
                    row = bench_case(cupy, backend, torch, timer, op, dtype, n, rows_n)
                except Exception as exc:  # keep going: one failure must not hide the rest
                    row = Row(op, dtype, n, rows_n, 0, error=f"{type(exc).__name__}: {exc}")
                rows.append(row)
                log(f"  {op} {dtype} {rows_n}x{n}: ours {fmt(row.ours_us, '.1f')} us, "
                    f"torch {fmt(row.torch_us, '.1f')} us, copy {fmt(row.copy_us, '.1f')} us"
                    + (f" [{row.error}]" if row.error else ""))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: fake timings through the table and file code paths")
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest runs")
    parser.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    parser.add_argument("--test-timeout", type=int, default=300)
    parser.add_argument("--bench-budget", type=float, default=150.0,
                        help="seconds after which remaining benchmark cases are skipped")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--widths", type=lambda s: [int(v) for v in s.split(",")],
                        default=list(WIDTHS))
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES))
    parser.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS))
    args = parser.parse_args(argv)

    t_start = time.monotonic()
    ensure_paths()
    log("== environment")
    info = environment()
    for key, value in info.items():
        log(f"  {key}: {value}")
    (out_dir() / "env.json").write_text(json.dumps(info, indent=1, default=str))

    if args.dry_run:
        # Host arrays and the Numba kernels through the same benchmark code; small sizes.
        rows_n = min(args.rows, 64)
        widths = [n for n in args.widths if n <= 4096]
        log("== DRY RUN: host arrays, Numba kernels, host clock")
        rows = run_bench(rows_n, widths, args.dtypes, args.ops, args.bench_budget, dry=True)
        save(rows, info, "bench-dry-run")
        log("")
        log(table(rows, f"== DRY RUN (CPU, not GPU numbers), {rows_n} rows"))
        return 0 if not any(r.error for r in rows) else 1

    if not str(info.get("gpu", "none")).strip() or str(info.get("gpu", "none")).startswith(
            "none") or info.get("cupy", "").startswith("MISSING"):
        log("no usable CuPy + GPU: nothing to check (try --dry-run)")
        return 2

    ok = True
    if not args.no_tests or not args.no_bench:
        log("== compile")
        ok = precompile(max(1, min(16, os.cpu_count() or 1))) and ok
    if not args.no_tests:
        log("== tests")
        ok = run_tests(args.test_timeout, args.workers) and ok
    rows: list[Row] = []
    if not args.no_bench:
        log("== benchmark")
        rows = run_bench(args.rows, args.widths, args.dtypes, args.ops, args.bench_budget)
        save(rows, info)
    log(f"== total {time.monotonic() - t_start:.0f} s; tests "
        f"{'skipped' if args.no_tests else ('PASSED' if ok else 'FAILED')}")
    if rows:
        gpu = info.get("gpu", "?")
        log("")
        log(table(rows, f"== LayerNorm/RMSNorm on {gpu}, {args.rows} rows, CUDA-event medians"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
