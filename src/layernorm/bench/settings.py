"""What one ``python -m layernorm bench`` run measures, validated from the command line.

A bad value raises :class:`UsageError`, which the command line reports like one of
argparse's own errors (exit status 2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass

#: The operations, directions and dtypes a run can time.
OPS = ("layer_norm", "rms_norm")
#: The transformer-block fusions (forward only): ``h = x + residual``, then the norm of h.
ADD_OPS = ("add_layer_norm", "add_rms_norm")
DIRECTIONS = ("forward", "backward")
#: The 8-bit formats ``--quantize`` can time (the ``quantize=`` argument's values).
QUANTIZE_FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2")
DTYPES = ("float32", "float64", "float16", "bfloat16")
#: Where the inputs are when a call starts: one reused working set of at most 1.5 MB,
#: or a rotation over more than 128 MiB (see :mod:`.impls`).
REGIMES = ("cache", "memory")


class UsageError(ValueError):
    """A bad command-line value, reported like an argparse error."""


#: Rows of 64 to 16384, output sizes from cache-resident to the page-fault regime.
FULL_SHAPES = (
    (1, 768), (65536, 64), (16384, 256), (4096, 768), (8192, 1024), (2048, 4096),
    (512, 16384), (16384, 2048),
)
QUICK_SHAPES = ((1, 768), (65536, 64), (4096, 768), (8192, 1024))


@dataclass
class Settings:
    """What one ``bench`` run measures."""

    ops: tuple[str, ...]
    directions: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    threads: tuple[int, ...]
    repeats: int
    target_s: float
    heap_reuse: bool = True
    regimes: tuple[str, ...] = REGIMES
    #: 8-bit formats whose quantized forward is timed beside the plain one.
    quantize: tuple[str, ...] = ()


def _split(values: Iterable[str] | None) -> list[str]:
    out: list[str] = []
    for value in values or ():
        out += [v.strip() for v in value.split(",") if v.strip()]
    return out


def split_choices(values: Iterable[str] | None, choices: tuple[str, ...], flag: str
                  ) -> tuple[str, ...]:
    """Space- or comma-separated values of ``flag``, each one of ``choices``.

    Examples
    --------
    >>> split_choices(["float32,float64", "float16"], DTYPES, "--dtype")
    ('float32', 'float64', 'float16')
    """
    out = tuple(_split(values))
    for value in out:
        if value not in choices:
            raise UsageError(f"{flag} must be among {', '.join(choices)}; got {value!r}")
    return out


def parse_shape(text: str) -> tuple[int, int]:
    """``"N,D"`` (or ``NxD``) -> ``(N, D)``.

    Examples
    --------
    >>> parse_shape("4096,768")
    (4096, 768)
    >>> parse_shape("1x64")
    (1, 64)
    """
    parts = text.lower().replace("x", ",").split(",")
    try:
        n, d = (int(p) for p in parts)
    except ValueError:
        raise UsageError(f"--shape takes N,D with two positive integers; got {text!r}") from None
    if n < 1 or d < 1:
        raise UsageError(f"--shape takes N,D with two positive integers; got {text!r}")
    return n, d


def check_output_path(path: str | None, flag: str) -> None:
    """A file ``flag`` will write after the measurements: its directory must exist, and
    it must not be a directory itself, so that a long run's results are not lost at the
    end.

    Examples
    --------
    >>> check_output_path("results.json", "--json")
    >>> check_output_path(".", "--json")
    Traceback (most recent call last):
    ...
    layernorm.bench.settings.UsageError: --json must name a file, not a directory; got '.'
    """
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"{flag} must name a file, not a directory; got {path!r}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{flag}: the directory {directory!r} of {path!r} does not exist "
                         "or is not a directory")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate the command line into :class:`Settings`."""
    import numba

    for flag in ("json", "plot"):
        check_output_path(getattr(args, flag, None), f"--{flag}")

    shapes = tuple(parse_shape(s) for s in args.shape or ()) or (
        QUICK_SHAPES if args.quick else FULL_SHAPES)
    dtypes = split_choices(args.dtype, DTYPES, "--dtype") or ("float32",)
    ops = split_choices(args.op, OPS + ADD_OPS, "--op") or OPS
    available = numba.config.NUMBA_NUM_THREADS
    try:
        threads = tuple(int(t) for t in _split(args.threads)) or (numba.get_num_threads(),)
    except ValueError:
        raise UsageError(f"--threads takes integers like 1,2; got {args.threads!r}") from None
    for t in threads:
        if not 1 <= t <= available:
            raise UsageError(
                f"--threads must be between 1 and {available} (NUMBA_NUM_THREADS); got {t}")
    regimes = split_choices(getattr(args, "regime", None), REGIMES, "--regime") or REGIMES
    regimes = tuple(r for r in REGIMES if r in regimes)  # each once, cache first
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 11)
    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1; got {repeats}")
    directions = ("forward", "backward") if args.backward else ("forward",)
    quantize = split_choices(getattr(args, "quantize", None), QUANTIZE_FORMATS,
                             "--quantize")
    return Settings(ops, directions, dtypes, shapes, threads, repeats,
                    target_s=0.002 if args.quick else 0.01, regimes=regimes,
                    quantize=quantize)

