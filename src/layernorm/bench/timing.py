"""The one timer of ``bench``, the roofline, the asv suite and the GPU check.

How it measures
---------------
* Each callable is warmed up (first calls compile kernels, fill caches, allocate), then
  timed to **calibrate** ``number``: the calls per sample that make a sample last
  about ``target_s`` (at least ``min_number``, at most ``max_number``), from the fastest
  of up to ``CALIBRATION_CALLS`` single calls (one for a call of ``target_s`` or more,
  two after a warm-up: the library's first calls run serially and its first parallel
  call loads the parallel kernel, which made the calibration's first call last longer
  than a sample and gave cache-resident cells samples of one call each, every one
  right after another library's thread pool ran: 200-330 us against 45-60 us at
  (242, 768), 2 threads).
  One call alone can be several times slower than the next ones: a parallel call
  right after another library's thread pool ran (measured: 300-440 us against 55-80 us
  at (242, 768), 2 threads), and a calibration from it gave samples of 5-10 calls whose
  first call dominated their median.
* Kernels the library compiles in the background (its parallel ones, on first use) are
  waited for before the rounds (:func:`finish_background_compiles`).
* The callables are then timed **interleaved**: round ``r`` takes one sample of each in
  turn, in reverse order on odd rounds, so drift in clock speed or a noisy neighbour hits
  all of them alike and none always runs right after the same other one.
* A sample is the time of ``number`` back-to-back calls divided by ``number``, read from
  a **clock**: :class:`HostClock` (``time.perf_counter``) for work that is done when the
  call returns, :class:`CudaEventClock` (events on the current CUDA stream) for kernels
  launched asynchronously on a GPU.
* The garbage collector is off during the rounds, so none of them pays for a collection
  the others' garbage caused.

The result per callable is ``number``, every sample, and their median, minimum and 90th
percentile; a callable that raised during warm-up gets ``error`` instead and is left out
of the rounds.
"""

from __future__ import annotations

import gc
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

#: Most single calls timed to calibrate ``number`` (the fastest counts).
CALIBRATION_CALLS = 3


class Clock(Protocol):
    """Something that measures the seconds between ``start()`` and ``stop()``."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


class HostClock:
    """Wall-clock seconds from ``time.perf_counter``."""

    def __init__(self) -> None:
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self._t0


class CudaEventClock:
    """Device seconds between two CUDA events recorded on the current stream.

    ``cupy`` is the CuPy module (or anything with its ``cuda.Event`` and
    ``cuda.get_elapsed_time``); it is passed in so this module never imports CuPy.
    ``stop`` waits for the work launched since ``start`` to finish.
    """

    def __init__(self, cupy: Any) -> None:
        self._cuda = cupy.cuda
        self._start, self._end = cupy.cuda.Event(), cupy.cuda.Event()

    def start(self) -> None:
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return self._cuda.get_elapsed_time(self._start, self._end) / 1e3


def rotating(fns: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """One callable that calls ``fns`` in turn, one per call.

    For inputs that would stay in a cache if one set were timed over and over: give one
    callable per input set and time the rotation.

    Examples
    --------
    >>> calls = []
    >>> fn = rotating([lambda: calls.append("a"), lambda: calls.append("b")])
    >>> for _ in range(3):
    ...     fn()
    >>> calls
    ['a', 'b', 'a']
    """
    if not fns:
        raise ValueError("rotating() needs at least one callable; got none")
    cycle = itertools.cycle(fns)
    return lambda: next(cycle)()


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``samples``, interpolated linearly between ranks.

    Examples
    --------
    >>> percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90)
    4.6
    >>> percentile([7.0], 90)
    7.0
    """
    if not samples:
        raise ValueError("percentile() needs at least one sample; got none")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _sample(fn: Callable[[], Any], number: int, clock: Clock) -> float:
    clock.start()
    for _ in range(number):
        fn()
    return clock.stop() / number


def time_interleaved(fns: Mapping[str, Callable[[], Any]], repeats: int, target_s: float,
                     *, clock: Clock | None = None, warmup: int = 1, min_number: int = 1,
                     max_number: int = 100_000) -> dict[str, dict[str, Any]]:
    """Warm up and calibrate each callable, then time them in ``repeats`` interleaved rounds.

    Parameters
    ----------
    fns
        Zero-argument callables by name; the rounds call them in this order (reversed
        on odd rounds).
    repeats
        Rounds, hence samples per callable.
    target_s
        Seconds a sample should last; ``number`` (calls per sample) is calibrated to it.
        0 times every sample as a single call.
    clock
        :class:`HostClock` (the default) or :class:`CudaEventClock`.
    warmup
        Untimed calls before calibration (the calibration calls come on top, so
        ``warmup=0`` lets the first of them double as the warm-up of something too slow
        to call twice: a call of ``target_s`` or more is calibrated from itself alone).
    min_number, max_number
        Bounds on ``number``.

    Returns
    -------
    dict
        Per name: ``number``, ``samples_s`` (seconds per call, one per round),
        ``median_s``, ``min_s`` and ``p90_s``; or only ``error`` (``"Type: message"``)
        when the callable raised during warm-up or calibration.

    Examples
    --------
    >>> t = time_interleaved({"sum": lambda: sum(range(100))}, repeats=3, target_s=1e-4)
    >>> len(t["sum"]["samples_s"]), t["sum"]["min_s"] <= t["sum"]["median_s"]
    (3, True)
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats}")
    clock = clock if clock is not None else HostClock()
    out: dict[str, dict[str, Any]] = {}
    live: list[tuple[str, Callable[[], Any], int]] = []
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            once = _sample(fn, 1, clock)
            for i in range(CALIBRATION_CALLS - 1):
                # After a warm-up, the first call may still load a kernel (the
                # library's first parallel call follows its serial ones): one more.
                if once >= target_s and (warmup == 0 or i > 0):
                    break
                once = min(once, _sample(fn, 1, clock))
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        number = 1 if once >= target_s else math.ceil(target_s / max(once, 1e-9))
        number = max(min_number, min(max_number, number))
        live.append((name, fn, number))
        out[name] = {"number": number, "samples_s": []}
    finish_background_compiles()
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            for name, fn, number in (live if r % 2 == 0 else reversed(live)):
                out[name]["samples_s"].append(_sample(fn, number, clock))
    finally:
        if enabled:
            gc.enable()
    for name, _, _ in live:
        samples = out[name]["samples_s"]
        out[name].update(median_s=statistics.median(samples), min_s=min(samples),
                         p90_s=percentile(samples, 90))
    return out


def finish_background_compiles() -> None:
    """Wait for the kernels this library compiles on a thread of their own (a parallel
    kernel the first time a call wants it, while the serial one runs): a compilation
    during the rounds takes the other core and, in its Python parts, the GIL (measured,
    ``bench --regime cache --threads 2`` with an empty cache: (44, 4096) LayerNorm 121 us
    against 23 us). Does nothing unless the Numba backend is loaded (never imports it)."""
    entry = sys.modules.get("layernorm._backends._numba.entry")
    if entry is not None:
        entry.finish_compiling()


def median_times(fns: Mapping[str, Callable[[], Any]], repeats: int, target_s: float,
                 **options: Any) -> dict[str, float]:
    """Median seconds per call of each callable, from :func:`time_interleaved` (same
    ``options``); raises ``RuntimeError`` if any of them failed.

    Examples
    --------
    >>> sorted(median_times({"a": lambda: None, "b": lambda: None}, 3, 1e-4))
    ['a', 'b']
    """
    timings = time_interleaved(fns, repeats, target_s, **options)
    for name, timing in timings.items():
        if "error" in timing:
            raise RuntimeError(f"{name} failed: {timing['error']}")
    return {name: timing["median_s"] for name, timing in timings.items()}
