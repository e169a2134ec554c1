"""Command line: ``python -m layernorm info``, ``bench`` and ``compile``.

Each subcommand imports what it needs when it runs, so ``--help`` is instant and no
optional library is imported unless it is installed and asked for.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Sequence
from typing import Any

from .settings import Settings, UsageError


def _cmd_info(args: argparse.Namespace) -> int:
    from .machine import collect_info, format_info

    info = collect_info(probe=not args.no_probe)
    if args.json:
        import json

        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .._backends._numba.entry import set_background_compiles

    # Kernels compile in the calls that first want them, as before background
    # compilation (see set_background_compiles); restored for a caller in the same
    # process (the tests run the command in theirs).
    previous = set_background_compiles(False)
    try:
        return _bench(args)
    finally:
        set_background_compiles(previous)


def _bench(args: argparse.Namespace) -> int:
    from . import machine, noise, report, run, settings

    config = settings.settings_from_args(args)
    started = time.perf_counter()
    load_before = machine.load_info()
    cpu_before = noise.sample()
    print(machine.summary_line())
    if args.roofline:
        return _roofline(args, config, started)
    if args.dask:
        if args.regime:
            raise UsageError("--dask measures Dask throughput on arrays larger than any "
                             "cache; it takes no --regime")
        from .dask import format_dask, run_dask

        out: dict[str, Any] = {"results": [], "phases": []}
        out["dask"] = run_dask(quick=args.quick, repeats=min(config.repeats, 5))
        print(format_dask(out["dask"]))
    else:
        out = run.run(config, progress=not args.no_progress)
    # Other processes' load before and after: the report (and a reader of the JSON, such
    # as the docs' performance page) can tell a measurement made on a busy machine.
    out["load"] = {"before": load_before, "after": machine.load_info()}
    # And the CPU time other processes took meanwhile, which says it directly.
    out["conditions"] = noise.conditions(cpu_before, noise.sample(), max(config.threads))
    verdict = noise.assess(out)
    out["verdict"] = {"noisy": verdict.noisy, "reasons": verdict.reasons,
                      "summary": verdict.summary()}
    if not args.dask:
        print(report.format_table(out))
    out["machine"] = machine.collect_info(probe=False)
    out["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out["elapsed_s"] = time.perf_counter() - started
    if args.json:
        report.write_json(out, args.json)
        print(f"\nwrote {args.json}")
    if args.plot:
        report.plot(out, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from . import precompile
    from .run import Progress
    from .settings import ADD_OPS, DTYPES, OPS, split_choices

    dtypes = split_choices(args.dtype, DTYPES, "--dtype") or DTYPES
    ops = split_choices(args.op, OPS + ADD_OPS, "--op") or OPS + ADD_OPS
    directions = ("forward", "backward") if args.backward else ("forward",)
    if args.quantize:
        directions += ("quantized",)
    dtypes, skipped = precompile.available_dtypes(dtypes)
    import numba

    total = len(dtypes) * len(ops) * len(directions) * len(
        precompile.layouts(numba.get_num_threads()))
    bar = Progress(total, enabled=not args.no_progress)
    try:
        report = precompile.run(ops, directions, dtypes, bar.update)
    finally:
        bar.close()
    print(precompile.format_report(report, skipped))
    return 0


def _roofline(args: argparse.Namespace, config: Settings, started: float) -> int:
    from . import report, roofline
    from .run import Progress

    for flag in ("dask", "plot", "dtype", "op", "threads", "regime"):
        if getattr(args, flag, None):
            raise UsageError(f"--roofline measures the float32 LayerNorm (forward, or "
                             f"backward with --backward) on one thread, in memory and in "
                             f"cache; it takes no "
                             f"--{flag}")
    shapes = [s for s in config.shapes if s[0] > 1] or list(config.shapes)
    bar = Progress(len(shapes), enabled=not args.no_progress)
    try:
        results = roofline.run(shapes, config.repeats, config.target_s, bar.update,
                               backward=args.backward)
    finally:
        bar.close()
    print(roofline.format_report(results))
    out = {"results": [], "phases": [], "roofline": results,
           "elapsed_s": time.perf_counter() - started}
    if args.json:
        report.write_json(out, args.json)
        print(f"\nwrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m layernorm``."""
    parser = argparse.ArgumentParser(
        prog="python -m layernorm",
        description="LayerNorm and RMSNorm for NumPy, CuPy, torch, Dask and array-API arrays.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p_info = sub.add_parser("info", help="versions, backends, threads, CPU and GPU")
    p_info.add_argument("--json", action="store_true", help="print the report as JSON")
    p_info.add_argument("--no-probe", action="store_true",
                        help="do not run a parallel kernel to learn Numba's threading layer")
    p_info.set_defaults(func=_cmd_info)

    p_bench = sub.add_parser(
        "bench",
        help="time layernorm against copy bandwidth and the installed peers",
        description=(
            "Measures this machine's copy bandwidth, then times each backend and each "
            "installed peer (NumPy composite, PyTorch, ONNX Runtime, JAX) on a grid of "
            "shapes, interleaving them round-robin and reporting medians."
        ),
    )
    p_bench.add_argument("--quick", action="store_true",
                         help="a small grid and few repeats (about a minute on a quiet "
                              "2-core machine)")
    p_bench.add_argument("--backward", action="store_true",
                         help="also time the backward passes")
    p_bench.add_argument("--shape", nargs="+", metavar="N,D",
                         help="rows,columns of the inputs (default: a grid)")
    p_bench.add_argument("--dtype", nargs="+", metavar="DTYPE",
                         help="float32 (default), float64, float16, bfloat16; "
                              "several allowed, space- or comma-separated")
    p_bench.add_argument("--threads", nargs="+", metavar="T",
                         help="thread counts to run, e.g. 1,2 (default: Numba's)")
    p_bench.add_argument("--op", nargs="+", metavar="OP",
                         help="layer_norm, rms_norm (default: both), add_layer_norm, "
                              "add_rms_norm (the residual add fused in, against the "
                              "unfused add then norm; with --backward, the norm's "
                              "backward with grad_residual against it without)")
    p_bench.add_argument("--quantize", nargs="+", metavar="FORMAT",
                         help="also time each forward quantized into a preallocated "
                              "out= in these formats (int8, float8_e4m3fn, float8_e5m2), "
                              "with per-row and given scales, against the plain call")
    p_bench.add_argument("--regime", nargs="+", metavar="REGIME",
                         help="cache (one working set of <= 1.5 MB, reused: bound by "
                              "arithmetic) and/or memory (inputs rotated over > 128 MiB: "
                              "bound by DRAM bandwidth); default both")
    p_bench.add_argument("--repeats", type=int, metavar="R",
                         help="round-robin repeats per measurement (default 11; 5 with --quick)")
    p_bench.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    p_bench.add_argument("--plot", metavar="FILE.png",
                         help="plot GB/s against row length (needs matplotlib)")
    p_bench.add_argument("--dask", action="store_true",
                         help="Dask throughput with 1 and 2 workers against the NumPy path")
    p_bench.add_argument("--roofline", action="store_true",
                         help="where the LayerNorm forward's (with --backward: "
                              "backward's) time goes instead: the kernel and its passes "
                              "alone, in memory and in cache, against a copy (float32, "
                              "1 thread)")
    p_bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_bench.set_defaults(func=_cmd_bench)

    p_compile = sub.add_parser(
        "compile",
        help="fill Numba's disk cache ahead of time (container images, CI)",
        description=(
            "Compiles the Numba kernels that real calls use, by making small real calls "
            "through the public API for every dtype and every layout that selects a "
            "different kernel (short, long and strided rows, columns; parallel variants "
            "when Numba has more than one thread), and stores them in Numba's disk cache "
            "(NUMBA_CACHE_DIR when set). A second run only loads them."
        ),
    )
    p_compile.add_argument("--dtype", nargs="+", metavar="DTYPE",
                           help="float32, float64, float16, bfloat16 (default: all); "
                                "space- or comma-separated")
    p_compile.add_argument("--op", nargs="+", metavar="OP",
                           help="layer_norm, rms_norm, add_layer_norm, add_rms_norm "
                                "(default: all)")
    p_compile.add_argument("--backward", action="store_true",
                           help="also compile the backward kernels")
    p_compile.add_argument("--quantize", action="store_true",
                           help="also compile the kernels of quantize='int8' calls "
                                "(each 8-bit format compiles its own kernel on first use)")
    p_compile.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_compile.set_defaults(func=_cmd_compile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m layernorm`` and of the ``layernorm`` script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return 0  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
