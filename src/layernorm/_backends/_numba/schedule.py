"""Serial or parallel: a per-call choice from measured times, so a busy machine never
makes a parallel call collapse.

Every kernel comes serial and parallel with the same arithmetic per row (the same
bits), so the choice only moves time. GNU OpenMP, Numba's fast threading layer, ends a
parallel region at a barrier: when another process keeps a core busy, the worker thread
on it is descheduled and the call waits for the scheduler's next time slice (measured:
a (2048, 512) forward took 8 ms at 2 threads against 0.5 ms serial beside one busy
process; TBB's work stealing avoids that but collapsed beside torch's OpenMP threads).

:class:`Chooser` keeps, per kernel, input dtype and size class (``elements.bit_length()``),
the seconds per element of its latest ``SERIAL_WINDOW`` serial and ``PARALLEL_WINDOW``
parallel calls. The serial lower quartile stands for serial calls (see
:data:`SERIAL_WINDOW`); the parallel median, or the
second slowest parallel call over ``TAIL_ALLOWANCE`` where that is more, for parallel
ones (a tail of collapsed calls, see :data:`PARALLEL_WINDOW`). A call runs parallel
unless the parallel figure is above the serial one; while serial, the class probes
parallel again after a pause of at least
``PROBE_PAUSE_S`` and ``PROBE_COST_FACTOR`` times what the last probe cost, so probing
costs at most a few percent of the time even when every probe collapses; while
parallel, ``RECENT`` serial calls refresh the serial times every ``SERIAL_REFRESH_S``. A
class starts with one serial call. Calls that compiled or loaded a kernel are not
measured.

A probe is a parallel call that follows a serial one of its class (the first parallel
call of a class is one) and ``RECENT`` parallel calls after it. Its first call is not
measured: it wakes the thread pool, whose workers have gone to sleep during the serial
calls (or starts it), and that costs as much as a cache-resident call itself. Medians,
not the latest call or a mean, because one call in fifty or so is several times slower
for reasons that do not last (an interrupt; another library's thread pool, spinning on
the other core after its own call). Measured, (242, 768) float32, 2 threads, beside
torch's calls in one process, quiet machine: with the latest call alone, the pool's
wake-up made a class look 3.5x slower parallel than serial, and with a running mean a
single 270 us call among 37 us ones turned the class serial for the next pause; either
way half the calls ran serial, 55-70 us against 35-40 us parallel. A busy machine slows
most calls, and two slow ones in a row move the median.

Likewise the first serial call after parallel ones is not measured: the parallel calls
left part of a cache-resident input and output in the other cores' caches, and moving
them back costs that call 2-6x a serial call's time. A serial refresh of a parallel
class is therefore that call and ``RECENT`` measured ones. Measured, (242, 768)
float32, 2 threads, a torch call before every ten calls: with the refresh's one call
measured, the serial times were all such first calls (99-309 us against 55 us), and a
class whose parallel calls had slowed to 120-170 us beside torch's threads stayed
parallel.

``LAYERNORM_PARALLEL`` (environment, read at import) sets the policy: ``auto`` (the
default, as above), ``always`` (parallel whenever the call is large enough: what the
benchmarks of the parallel kernels use), ``never`` (serial only).
"""

from __future__ import annotations

import os
import time
from bisect import insort
from typing import Any

#: The policies ``LAYERNORM_PARALLEL`` may name.
POLICIES = ("auto", "always", "never")
#: Least seconds between two parallel probes of a class run serially. Another library's
#: thread pool that keeps spinning after its own call (ONNX Runtime's, XLA's) makes the
#: parallel calls just after it slow for a moment: a probe then turns a class serial
#: until the next one. Measured, ``bench --regime cache --threads 2`` (torch, ONNX
#: Runtime and JAX calls between this library's), LayerNorm forward speed-up over torch:
#: with 50 ms, one or two of the eight shapes ran serial in each run (1.05x and 1.11x);
#: with 5 ms none did (1.29-1.98x over two runs).
PROBE_PAUSE_S = 0.005
#: A probe waits at least this many times the duration of the previous probe's calls.
PROBE_COST_FACTOR = 30.0
#: Parallel calls a probe measures (after the one that wakes the pool), and serial calls
#: a serial refresh measures (after the one that moves the data back).
RECENT = 3
#: Parallel calls whose times a parallel class keeps (a probe starts them again). Beside
#: a busy process some parallel calls collapse (their worker thread waits for a time
#: slice) while the others stay faster than serial: at (8192, 1024) beside one spinning
#: process, one parallel call in three took 5 ms against 1.3-1.5 ms for the rest and
#: 1.5 ms serial, so the median of three stayed below the serial one and the default
#: call's p90 was 2.4-2.8x the serial p90. So once ``TAIL_MIN`` back-to-back parallel
#: times are known, the second largest of them, divided by ``TAIL_ALLOWANCE``, must be
#: below the serial figure too: two collapsed calls among the latest eight turn the
#: class serial, a single one (an interrupt) does not. With it, the default call's p90
#: was 0.78-1.35x the serial p90 over four runs beside one busy process.
PARALLEL_WINDOW = 8
TAIL_MIN = 4
#: How much slower than the serial figure the tail of parallel calls may be: a
#: collapsed call waits for a time slice, several times the serial time. With 1.3, the
#: calls right after one of ``bench``'s peers also counted (LayerNorm at 2 threads in
#: cache 1.12-1.49x torch over two runs, 1.15-1.53x with 2.0).
TAIL_ALLOWANCE = 2.0
#: Only parallel calls that start within this many seconds of the end of the previous
#: measured one count for the tail. The first calls after another library's thread pool
#: ran are slow while its threads spin (``bench`` interleaves torch, ONNX Runtime and
#: JAX between samples of this library's calls, and a model runs its matrix products
#: between norms): they are not the tail of this library's parallel calls. Busy
#: processes slow back-to-back calls too.
BACK_TO_BACK_S = 1e-4
#: Serial calls whose lower quartile (the third fastest of eight) stands for a class's
#: serial time. Serial calls collapse beside a busy process too (two of a refresh's three
#: took 5.9 ms against 1.8 ms), and a descheduling lasts several calls, so collapsed
#: serial calls come in runs: a median of three then stood for the slow ones and
#: parallel calls that collapsed one in four looked faster; later, beside two busy
#: processes at (8192, 1024), a median of eight still did (5.6-6.0 ms against 1.7 ms)
#: and the default call ran parallel at 5.3 ms, 2.4x the serial median, for seconds at
#: a time (one run in six). The lower quartile stands for the serial calls that got a
#: core unless six of the eight collapsed; parallel calls must beat it, which costs a
#: class whose parallel calls are barely faster (a few percent) its parallel runs.
SERIAL_WINDOW = 8
#: Seconds between two serial refreshes of a parallel class's serial figure.
SERIAL_REFRESH_S = 2.0
#: The parallel figure of a class that runs parallel is worked out again (median and
#: tail, two sorts) after a call slower than the serial figure, when the tail starts to
#: count (``TAIL_MIN``), on the next serial measurement, and otherwise once in this many
#: calls; at the end of a probe and while the class is serial, after every parallel
#: call. Only a call slower than the serial figure can turn the class serial (the median
#: rises above it only once half the window is above it, the tail only once two of its
#: calls are above ``TAIL_ALLOWANCE`` times it), so the choices are those of working it
#: out on every call: a faster call only lowers the figure, a few calls late. Measured,
#: the bookkeeping of a parallel call (``parallel_in``, two clock reads, ``record_in``)
#: took 1.26 us scoring every call, 0.75 us so, against 15-25 us for a cache-resident
#: 2-thread call in all.
RESCORE_EVERY = 4


def policy_from_environment() -> str:
    """``LAYERNORM_PARALLEL`` (``auto`` when unset); ``ValueError`` for another value."""
    value = os.environ.get("LAYERNORM_PARALLEL", "auto").strip().lower() or "auto"
    if value not in POLICIES:
        raise ValueError(f"LAYERNORM_PARALLEL must be one of {', '.join(POLICIES)}; "
                         f"got {value!r}")
    return value


class _Window:
    """The latest ``keep`` values, in the order they came and ranked (sorted), so that
    the lower quartile is one index (the serial times, read on every serial call)."""

    __slots__ = ("keep", "order", "ranked")

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.order: list[float] = []
        self.ranked: list[float] = []

    def push(self, value: float) -> float:
        """Add ``value`` (dropping the oldest beyond ``keep``); the median."""
        ranked = self.ranked
        self.order.append(value)
        insort(ranked, value)
        if len(ranked) > self.keep:
            ranked.remove(self.order.pop(0))
        return ranked[len(ranked) // 2]

    def lower_quartile(self) -> float:
        """The value of rank ``len // 4`` (the third smallest of eight)."""
        return self.ranked[len(self.ranked) // 4]

    def clear(self) -> None:
        self.order.clear()
        self.ranked.clear()


class _Class:
    """What is known about one (kernel, dtype, size class)."""

    __slots__ = ("left", "parallel", "parallel_at", "parallel_times", "probe_s", "serial",
                 "serial_at", "serial_left", "serial_times", "slept", "tail_times",
                 "unscored")

    def __init__(self) -> None:
        self.serial_times = _Window(SERIAL_WINDOW)  # seconds per element
        # The latest PARALLEL_WINDOW parallel times, oldest first, and those of them that
        # came right after another (see BACK_TO_BACK_S): sorted only when scored.
        self.parallel_times: list[float] = []
        self.tail_times: list[float] = []
        self.serial: float | None = None  # lower quartile of serial_times
        # _parallel_score of parallel_times, once a probe is done
        self.parallel: float | None = None
        self.unscored = 0  # parallel calls since parallel was worked out
        self.serial_at = -1e300  # clock of the latest serial measurement
        self.parallel_at = -1e300  # clock of the latest measured parallel call
        self.probe_s = 0.0  # seconds the measured calls of the latest probe took
        # The latest call was serial (or none was parallel yet): the next parallel one
        # wakes the pool. Otherwise the latest was parallel: the next serial one moves
        # the data back.
        self.slept = True
        self.left = 0  # measured calls left in the current probe
        self.serial_left = 0  # measured calls left in the current serial refresh


def _parallel_score(times: list[float], tail: list[float]) -> float:
    """What the latest parallel ``times`` stand for against the serial figure: their
    median (the upper one), or, once ``tail`` (those of them that came right after
    another, see :data:`BACK_TO_BACK_S`) holds ``TAIL_MIN``, its second largest divided
    by ``TAIL_ALLOWANCE`` where that is more (a tail of slow calls, see
    :data:`PARALLEL_WINDOW`)."""
    median = sorted(times)[len(times) // 2]
    if len(tail) >= TAIL_MIN:
        return max(median, sorted(tail)[-2] / TAIL_ALLOWANCE)
    return median


class Chooser:
    """Chooses serial or parallel per call and learns from the time each call took.

    Parameters
    ----------
    policy : {"auto", "always", "never"}
        See the module docstring.
    clock : callable, optional
        Seconds, monotonic (tests pass a fake one).

    Examples
    --------
    >>> chooser = Chooser("auto")
    >>> key = chooser.key("kernel", "float32", 1 << 20)
    >>> chooser.parallel(key)  # a new class starts with one serial call
    False
    >>> chooser.record(key, False, 0.010, 1 << 20)
    >>> chooser.parallel(key)
    True
    """

    def __init__(self, policy: str = "auto", clock: Any = time.perf_counter) -> None:
        self.policy = policy
        self.clock = clock
        self.classes: dict[Any, _Class] = {}

    @staticmethod
    def key(kernel: Any, dtype: Any, elements: int) -> tuple[Any, Any, int]:
        """The class of a call: its serial kernel, x's dtype and its size class."""
        return kernel, dtype, elements.bit_length()

    def class_of(self, key: Any) -> _Class:
        """The state of class ``key`` (new if unknown). A caller that makes many calls
        of one class (:class:`.PlannedRows`) holds it and uses :meth:`parallel_in` and
        :meth:`record_in`, which skip hashing the key twice a call."""
        c = self.classes.get(key)
        if c is None:
            if len(self.classes) > 4096:
                self.classes.clear()
            c = self.classes[key] = _Class()
        return c

    def parallel(self, key: Any) -> bool:
        """Whether the call of class ``key`` should run parallel."""
        c = self.classes.get(key)
        if c is None:
            return self.policy == "always"
        return self.parallel_in(c)

    def parallel_in(self, c: _Class) -> bool:
        """:meth:`parallel` of the class whose state is ``c`` (:meth:`class_of`)."""
        if self.policy != "auto":
            return self.policy == "always"
        if c.serial is None:
            return False
        if c.parallel is None or c.left > 0:
            return True
        now = self.clock()
        if c.parallel < c.serial:  # parallel, but a serial refresh runs all its calls
            return c.serial_left == 0 and now - c.serial_at < SERIAL_REFRESH_S
        pause = max(PROBE_PAUSE_S, PROBE_COST_FACTOR * c.probe_s)
        return now - c.parallel_at >= pause

    def record(self, key: Any, parallel: bool, seconds: float, elements: int) -> None:
        """Learn from a call of class ``key`` that took ``seconds``."""
        if self.policy == "auto":
            self.record_in(self.class_of(key), parallel, seconds, elements)

    def record_in(self, c: _Class, parallel: bool, seconds: float, elements: int) -> None:
        """:meth:`record` for the class whose state is ``c`` (:meth:`class_of`)."""
        if self.policy != "auto":
            return
        rate = seconds / elements if elements > 0 else seconds
        now = self.clock()
        if not parallel:
            moved = not c.slept  # moving the data back from the other cores: not measured
            c.slept = True
            if moved:
                c.serial_left = RECENT
                return
            c.serial_times.push(rate)
            c.serial = c.serial_times.lower_quartile()
            c.serial_at = now
            if c.unscored:  # the parallel figure against the new serial one
                c.parallel = _parallel_score(c.parallel_times, c.tail_times)
                c.unscored = 0
            if c.serial_left > 0:
                c.serial_left -= 1
            return
        if c.slept:  # a probe's first call, waking the pool: not measured
            c.slept = False
            c.left, c.probe_s = RECENT, 0.0
            c.parallel_times.clear()
            c.tail_times.clear()
            return
        times = c.parallel_times
        times.append(rate)
        if len(times) > PARALLEL_WINDOW:
            del times[0]
        if now - seconds - c.parallel_at <= BACK_TO_BACK_S:
            tail = c.tail_times
            tail.append(rate)
            if len(tail) > PARALLEL_WINDOW:
                del tail[0]
            elif len(tail) == TAIL_MIN:  # the tail starts to count: score this call
                c.unscored = RESCORE_EVERY
        c.parallel_at = now
        if c.left > 0:
            c.probe_s += seconds
            c.left -= 1
            if c.left == 0:
                c.parallel = _parallel_score(times, c.tail_times)
                c.unscored = 0
        elif c.parallel is not None:
            if (rate > c.serial or c.parallel >= c.serial  # see RESCORE_EVERY
                    or c.unscored >= RESCORE_EVERY):
                c.parallel = _parallel_score(times, c.tail_times)
                c.unscored = 0
            else:
                c.unscored += 1
