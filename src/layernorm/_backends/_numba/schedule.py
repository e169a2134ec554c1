"""Serial or parallel: a per-call choice from measured times, so a busy machine never
makes a parallel call collapse.

Every kernel comes serial and parallel with the same arithmetic per row (the same
bits), so the choice only moves time. GNU OpenMP, Numba's fast threading layer, ends a
parallel region at a barrier: when another process keeps a core busy, the worker thread
on it is descheduled and the call waits for the scheduler's next time slice (measured:
a (2048, 512) forward took 8 ms at 2 threads against 0.5 ms serial beside one busy
process; TBB's work stealing avoids that but collapsed beside torch's OpenMP threads).

:class:`Chooser` keeps, per kernel, input dtype and size class (``elements.bit_length()``),
the seconds per element of the latest parallel call and a running mean of the serial
ones. A call runs parallel unless the latest parallel call of its class was slower than
the serial mean; while serial, one parallel call probes again after a pause of at least
``PROBE_PAUSE_S`` and ``PROBE_COST_FACTOR`` times what the last probe cost, so probing
costs at most a few percent of the time even when every probe collapses; while
parallel, a serial call refreshes the serial mean every ``SERIAL_REFRESH_S``. A class
starts with one serial call. Calls that compiled or loaded a kernel are not measured.

``LAYERNORM_PARALLEL`` (environment, read at import) sets the policy: ``auto`` (the
default, as above), ``always`` (parallel whenever the call is large enough: what the
benchmarks of the parallel kernels use), ``never`` (serial only).
"""

from __future__ import annotations

import os
import time
from typing import Any

#: The policies ``LAYERNORM_PARALLEL`` may name.
POLICIES = ("auto", "always", "never")
#: Least seconds between two parallel probes of a class run serially.
PROBE_PAUSE_S = 0.05
#: A parallel probe waits at least this many times its predecessor's duration.
PROBE_COST_FACTOR = 20.0
#: Seconds between two serial calls refreshing the serial mean of a parallel class.
SERIAL_REFRESH_S = 2.0
#: Weight of a new serial time in the running mean.
SERIAL_WEIGHT = 0.25


def policy_from_environment() -> str:
    """``LAYERNORM_PARALLEL`` (``auto`` when unset); ``ValueError`` for another value."""
    value = os.environ.get("LAYERNORM_PARALLEL", "auto").strip().lower() or "auto"
    if value not in POLICIES:
        raise ValueError(f"LAYERNORM_PARALLEL must be one of {', '.join(POLICIES)}; "
                         f"got {value!r}")
    return value


class _Class:
    """What is known about one (kernel, dtype, size class)."""

    __slots__ = ("last_parallel_s", "parallel", "parallel_at", "serial", "serial_at")

    def __init__(self) -> None:
        self.serial: float | None = None  # running mean, seconds per element
        self.parallel: float | None = None  # latest, seconds per element
        self.serial_at = -1e300  # clock of the latest serial measurement
        self.parallel_at = -1e300
        self.last_parallel_s = 0.0  # duration of the latest parallel call


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

    def parallel(self, key: Any) -> bool:
        """Whether the call of class ``key`` should run parallel."""
        if self.policy != "auto":
            return self.policy == "always"
        c = self.classes.get(key)
        if c is None or c.serial is None:
            return False
        now = self.clock()
        if c.parallel is None:
            return True
        if c.parallel < c.serial:
            return now - c.serial_at < SERIAL_REFRESH_S
        pause = max(PROBE_PAUSE_S, PROBE_COST_FACTOR * c.last_parallel_s)
        return now - c.parallel_at >= pause

    def record(self, key: Any, parallel: bool, seconds: float, elements: int) -> None:
        """Learn from a call of class ``key`` that took ``seconds``."""
        if self.policy != "auto":
            return
        c = self.classes.get(key)
        if c is None:
            if len(self.classes) > 4096:
                self.classes.clear()
            c = self.classes[key] = _Class()
        rate = seconds / max(elements, 1)
        now = self.clock()
        if parallel:
            c.parallel, c.parallel_at, c.last_parallel_s = rate, now, seconds
        else:
            c.serial = rate if c.serial is None else (
                (1.0 - SERIAL_WEIGHT) * c.serial + SERIAL_WEIGHT * rate)
            c.serial_at = now
