"""The serial-or-parallel choice (:mod:`layernorm._backends._numba.schedule`).

The chooser only moves time (both variants give the same bits: see
``test_numba_kernels.py``), so these tests drive it with a fake clock and made-up
durations and check each decision.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from layernorm._backends._numba import schedule


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


ELEMENTS = 1 << 20


def make(policy="auto"):
    clock = Clock()
    chooser = schedule.Chooser(policy, clock)
    return chooser, clock, chooser.key("kernel", np.dtype(np.float32), ELEMENTS)


def run_calls(chooser, key, parallel, *seconds):
    """The calls of a probe (parallel) or of a serial refresh: one that is never
    measured (it wakes the pool, or moves the data back from the other core), then
    RECENT measured ones; the chooser runs all of them the same way."""
    assert len(seconds) == schedule.RECENT
    assert chooser.parallel(key) is parallel
    chooser.record(key, parallel, 1.0, ELEMENTS)
    for s in seconds:
        assert chooser.parallel(key) is parallel
        chooser.record(key, parallel, s, ELEMENTS)


def probe(chooser, key, *seconds):
    """A probe: the call that wakes the pool, then RECENT measured parallel calls."""
    run_calls(chooser, key, True, *seconds)


def refresh(chooser, key, *seconds):
    """A serial refresh: the call that moves the data back, then RECENT measured calls."""
    run_calls(chooser, key, False, *seconds)


def test_a_new_class_measures_serial_first_then_goes_parallel():
    chooser, _clock, key = make()
    assert chooser.parallel(key) is False
    chooser.record(key, False, 0.010, ELEMENTS)
    probe(chooser, key, 0.005, 0.006, 0.007)  # faster than serial: stays parallel
    assert chooser.parallel(key) is True
    assert chooser.classes[key].parallel == pytest.approx(0.006 / ELEMENTS)


def test_the_call_that_wakes_the_pool_does_not_count():
    # Starting or waking the thread pool costs as much as a cache-resident call: a
    # class measured by that call would stay serial although parallel is faster.
    chooser, _clock, key = make()
    chooser.record(key, False, 0.010, ELEMENTS)
    chooser.record(key, True, 0.035, ELEMENTS)  # the wake-up: 3.5x the serial time
    assert chooser.classes[key].parallel is None
    assert chooser.parallel(key) is True


def test_one_slow_call_of_a_probe_does_not_turn_the_class_serial():
    chooser, _clock, key = make()
    chooser.record(key, False, 0.010, ELEMENTS)
    probe(chooser, key, 0.005, 0.030, 0.006)  # an interrupt in the second call
    assert chooser.parallel(key) is True


def test_one_slow_parallel_call_does_not_turn_the_class_serial_two_do():
    chooser, _clock, key = make()
    chooser.record(key, False, 0.010, ELEMENTS)
    probe(chooser, key, 0.005, 0.005, 0.005)
    chooser.record(key, True, 0.050, ELEMENTS)  # 5x the serial time, once
    assert chooser.parallel(key) is True
    for seconds in (0.005, 0.005, 0.012):  # 1.2x the serial time: within TAIL_ALLOWANCE
        chooser.record(key, True, seconds, ELEMENTS)
        assert chooser.parallel(key) is True
    chooser.record(key, True, 0.040, ELEMENTS)  # a second slow call among the latest
    assert chooser.parallel(key) is False


def test_parallel_calls_that_collapse_one_in_four_turn_the_class_serial():
    # Beside a busy process: most parallel calls faster than serial (the median too),
    # one in four waiting for a time slice. The default call's p90 must not be theirs.
    chooser, _clock, key = make()
    chooser.record(key, False, 0.0015, ELEMENTS)
    probe(chooser, key, 0.0009, 0.0009, 0.0009)
    states = []
    for seconds in (0.005, 0.0009, 0.0009, 0.0009, 0.005):
        chooser.record(key, True, seconds, ELEMENTS)
        states.append(chooser.parallel(key))
    assert states == [True, True, True, True, False]
    assert chooser.classes[key].parallel > chooser.classes[key].serial


def test_parallel_calls_after_a_pause_count_for_the_median_only():
    # The first calls after another library's work find its thread pool spinning.
    chooser, clock, key = make()
    chooser.record(key, False, 0.0015, ELEMENTS)
    probe(chooser, key, 0.0009, 0.0009, 0.0009)
    for _ in range(3):
        clock.now += 0.005 + 10 * schedule.BACK_TO_BACK_S  # a pause, then a slow call
        chooser.record(key, True, 0.005, ELEMENTS)
        for _ in range(3):
            chooser.record(key, True, 0.0009, ELEMENTS)
        assert chooser.parallel(key) is True
    chooser.record(key, True, 0.005, ELEMENTS)  # two slow back-to-back calls
    chooser.record(key, True, 0.005, ELEMENTS)
    assert chooser.parallel(key) is False


def test_a_slow_parallel_call_is_forgotten_after_the_window():
    chooser, _clock, key = make()
    chooser.record(key, False, 0.010, ELEMENTS)
    probe(chooser, key, 0.005, 0.050, 0.005)
    for _ in range(schedule.PARALLEL_WINDOW - 1):
        chooser.record(key, True, 0.005, ELEMENTS)
    chooser.record(key, True, 0.050, ELEMENTS)  # the first one left the window
    assert chooser.parallel(key) is True


def test_a_collapsed_probe_turns_the_class_serial_until_the_next_probe():
    chooser, clock, key = make()
    chooser.record(key, False, 0.010, ELEMENTS)
    probe(chooser, key, 0.080, 0.080, 0.090)  # a busy machine: 8x the serial time
    assert chooser.parallel(key) is False
    # The next probe waits PROBE_COST_FACTOR times what the collapsed probe cost.
    clock.now += schedule.PROBE_COST_FACTOR * 0.250 - 0.01
    for _ in range(schedule.RECENT + 1):  # serial calls in the meantime
        chooser.record(key, False, 0.010, ELEMENTS)
    assert chooser.parallel(key) is False
    clock.now += 0.02
    probe(chooser, key, 0.004, 0.004, 0.004)  # the machine is quiet again
    assert chooser.parallel(key) is True


def test_probes_are_at_least_the_minimum_pause_apart():
    chooser, clock, key = make()
    # Calls so short that PROBE_COST_FACTOR times the probe is less than the pause.
    fast = schedule.PROBE_PAUSE_S / schedule.PROBE_COST_FACTOR / (4 * schedule.RECENT)
    chooser.record(key, False, fast / 2, ELEMENTS)
    probe(chooser, key, fast, fast, fast)
    clock.now += schedule.PROBE_PAUSE_S / 2
    assert chooser.parallel(key) is False
    clock.now += schedule.PROBE_PAUSE_S
    assert chooser.parallel(key) is True


def test_a_parallel_class_refreshes_its_serial_time():
    chooser, clock, key = make()
    chooser.record(key, False, 0.010, ELEMENTS)
    probe(chooser, key, 0.005, 0.005, 0.005)
    clock.now += schedule.SERIAL_REFRESH_S + 0.1
    refresh(chooser, key, 0.010, 0.010, 0.010)
    assert chooser.parallel(key) is True  # ...then parallel again, a probe first
    probe(chooser, key, 0.005, 0.005, 0.005)
    assert chooser.parallel(key) is True


def test_the_serial_call_after_parallel_ones_does_not_count():
    # Parallel calls leave a cache-resident input in the other cores' caches; the serial
    # call after them moves it back. Measured as a refresh's only call, serial looked
    # slow for good and kept a class parallel that had become slower than serial.
    chooser, clock, key = make()
    chooser.record(key, False, 0.010, ELEMENTS)
    probe(chooser, key, 0.005, 0.005, 0.005)
    clock.now += schedule.SERIAL_REFRESH_S + 0.1
    chooser.record(key, True, 0.005, ELEMENTS)  # the latest parallel call
    assert chooser.parallel(key) is False
    chooser.record(key, False, 0.050, ELEMENTS)  # moving the data back
    assert chooser.classes[key].serial == pytest.approx(0.010 / ELEMENTS)
    for seconds in (0.004, 0.004, 0.004):  # serial is now faster than parallel
        assert chooser.parallel(key) is False
        chooser.record(key, False, seconds, ELEMENTS)
    assert chooser.classes[key].serial == pytest.approx(0.004 / ELEMENTS)
    assert chooser.parallel(key) is False  # until the next probe
    clock.now += 1.0
    assert chooser.parallel(key) is True


def test_serial_time_is_the_lower_quartile_of_the_latest_calls():
    chooser, _clock, key = make()
    times = (0.002, 0.003, 0.010, 0.030, 0.012, 0.050, 0.011, 0.013, 0.009, 0.040)
    for seconds in times:
        chooser.record(key, False, seconds, ELEMENTS)
    # The latest SERIAL_WINDOW (8) calls: 0.010 ... 0.040; ranked 0.009, 0.010, 0.011,
    # ...: the third fastest is 0.011 (the 0.002 and 0.003 left the window).
    assert schedule.SERIAL_WINDOW == 8
    assert chooser.classes[key].serial == pytest.approx(0.011 / ELEMENTS)
    probe(chooser, key, 0.0109, 0.0108, 0.1)  # just under it
    assert chooser.parallel(key) is True
    chooser2, _clock2, key2 = make()
    for seconds in times:
        chooser2.record(key2, False, seconds, ELEMENTS)
    probe(chooser2, key2, 0.0112, 0.0111, 0.1)  # just over it
    assert chooser2.parallel(key2) is False


def test_a_run_of_collapsed_serial_calls_does_not_make_slow_parallel_calls_look_fast():
    # Beside two busy processes a descheduling lasts several calls: five of a class's
    # latest eight serial calls took 5.7 ms against 1.7 ms, and parallel calls took
    # 5.3 ms. The serial median (5.7 ms) made them look faster; the lower quartile
    # (1.7 ms) does not.
    chooser, _clock, key = make()
    for seconds in (0.0017, 0.0018, 0.0017, 0.0057, 0.0058, 0.0056, 0.0057, 0.0059):
        chooser.record(key, False, seconds, ELEMENTS)
    probe(chooser, key, 0.0053, 0.0052, 0.0054)
    assert chooser.parallel(key) is False
    # Parallel calls that are faster than the serial ones that got a core still win.
    chooser2, _clock2, key2 = make()
    for seconds in (0.0017, 0.0018, 0.0017, 0.0057, 0.0058, 0.0056, 0.0057, 0.0059):
        chooser2.record(key2, False, seconds, ELEMENTS)
    probe(chooser2, key2, 0.0010, 0.0011, 0.0010)
    assert chooser2.parallel(key2) is True


def test_a_probe_does_not_count_the_parallel_calls_before_it():
    chooser, clock, key = make()
    chooser.record(key, False, 0.010, ELEMENTS)
    probe(chooser, key, 0.004, 0.004, 0.004)
    chooser.record(key, True, 0.030, ELEMENTS)
    chooser.record(key, True, 0.030, ELEMENTS)  # the machine got busy
    assert chooser.parallel(key) is False
    clock.now += 10.0
    for _ in range(schedule.RECENT + 1):
        chooser.record(key, False, 0.010, ELEMENTS)
    probe(chooser, key, 0.005, 0.005, 0.030)  # quiet again: 0.004 and 0.030s forgotten
    assert chooser.classes[key].parallel == pytest.approx(0.005 / ELEMENTS)
    assert chooser.parallel(key) is True


def choices(seed, calls=3000):
    """The choices of a chooser driven by the times of a made-up machine that is now
    quiet, now busy (seeded): each call runs as chosen, takes a time drawn for its kind
    (a parallel call sometimes collapses), and the clock moves by that time and by a
    gap that is mostly none, sometimes more than BACK_TO_BACK_S, now and then seconds."""
    rng = np.random.default_rng(seed)
    chooser, clock, key = make()
    out = []
    for _ in range(calls):
        parallel = chooser.parallel(key)
        busy = rng.random() < 0.3
        if parallel:
            collapsed = rng.random() < (0.4 if busy else 0.03)
            seconds = rng.uniform(0.03, 0.08) if collapsed else rng.uniform(0.004, 0.012)
        else:
            seconds = rng.uniform(0.009, 0.011) * (rng.uniform(1.0, 5.0) if busy else 1.0)
        clock.now += seconds
        chooser.record(key, parallel, seconds, ELEMENTS)
        out.append(parallel)
        clock.now += rng.choice([0.0, 0.0, 0.0, 2 * schedule.BACK_TO_BACK_S, 0.01,
                                 rng.uniform(0.0, 3.0)], p=[0.5, 0.2, 0.1, 0.1, 0.08, 0.02])
    return out


@pytest.mark.parametrize("seed", range(4))
def test_scoring_parallel_calls_a_few_calls_late_makes_the_same_choices(monkeypatch, seed):
    # RESCORE_EVERY: only calls slower than the serial figure can turn a class serial, so
    # scoring the others a few calls late changes no choice.
    late = choices(seed)
    monkeypatch.setattr(schedule, "RESCORE_EVERY", 0)  # every call scored
    every = choices(seed)
    assert late == every
    assert 0.2 < np.mean(every) < 0.95  # both kinds of calls, and switches between them
    assert np.count_nonzero(np.diff(every)) > 50


def test_classes_are_kernel_dtype_and_size():
    chooser, _clock, key = make()
    chooser.record(key, False, 0.010, ELEMENTS)
    for other in (chooser.key("other", np.dtype(np.float32), ELEMENTS),
                  chooser.key("kernel", np.dtype(np.float64), ELEMENTS),
                  chooser.key("kernel", np.dtype(np.float32), 4 * ELEMENTS)):
        assert chooser.parallel(other) is False  # nothing known about it yet
    assert chooser.parallel(key) is True


@pytest.mark.parametrize(("policy", "want"), [("always", True), ("never", False)])
def test_fixed_policies_ignore_the_measurements(policy, want):
    chooser, _clock, key = make(policy)
    assert chooser.parallel(key) is want
    chooser.record(key, False, 0.010, ELEMENTS)
    chooser.record(key, True, 1.0, ELEMENTS)
    assert chooser.parallel(key) is want
    assert not chooser.classes


def test_policy_from_the_environment(monkeypatch):
    monkeypatch.delenv("LAYERNORM_PARALLEL", raising=False)
    assert schedule.policy_from_environment() == "auto"
    monkeypatch.setenv("LAYERNORM_PARALLEL", " Never ")
    assert schedule.policy_from_environment() == "never"
    monkeypatch.setenv("LAYERNORM_PARALLEL", "sometimes")
    with pytest.raises(ValueError, match=r"LAYERNORM_PARALLEL must be one of auto, always, "
                                         r"never; got 'sometimes'"):
        schedule.policy_from_environment()


def test_the_backend_measures_only_calls_that_did_not_compile(monkeypatch):
    numba = pytest.importorskip("numba")
    import layernorm as ln
    from layernorm import _fast
    from layernorm._backends import _numba as backend

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread: every call runs serially without a choice")
    threads = numba.get_num_threads()  # an earlier test may have left it at 1
    monkeypatch.setattr(backend, "chooser", schedule.Chooser("auto"))
    monkeypatch.setattr(backend.entry, "entry_points", {})  # the next call loads its kernel
    # ... and so does the short path's, whose plans keep the entry points they looked up
    # (an earlier test may have left a plan for this shape)
    monkeypatch.setattr(_fast, "_PLANS", {})
    x = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    try:
        numba.set_num_threads(2)
        y = ln.layer_norm(x)
        assert not backend.chooser.classes  # the loading call is not a measurement
        np.testing.assert_array_equal(ln.layer_norm(x), y)
    finally:
        numba.set_num_threads(threads)
    (c,) = backend.chooser.classes.values()
    assert c.serial is not None and c.serial > 0


def test_the_backend_reads_the_calling_threads_numba_thread_count():
    """Every large call asks the thread count (a cheaper route than Numba's function
    after the first): it must follow ``numba.set_num_threads`` per thread as Numba's
    own function does."""
    numba = pytest.importorskip("numba")
    import threading

    from layernorm._backends import _numba as backend

    threads = numba.get_num_threads()
    try:
        assert backend._num_threads() == threads
        numba.set_num_threads(1)
        assert backend._num_threads() == 1 == numba.get_num_threads()
        seen = []
        other = threading.Thread(target=lambda: seen.append(
            (backend._num_threads(), numba.get_num_threads())))
        other.start()
        other.join()
        assert seen[0][0] == seen[0][1]  # another thread keeps its own count
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert backend._num_threads() == numba.config.NUMBA_NUM_THREADS
    finally:
        numba.set_num_threads(threads)


def test_every_policy_gives_the_same_bits():
    script = (
        "import numpy as np, layernorm as ln\n"
        "x = np.random.default_rng(1).standard_normal((300, 1000)).astype(np.float32)\n"
        "ys = [ln.layer_norm(x) for _ in range(4)]\n"
        "print(ys[-1].view(np.uint32).sum(dtype=np.uint64))\n")
    sums = set()
    for policy in schedule.POLICIES:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "LAYERNORM_PARALLEL": policy,
                                                "NUMBA_NUM_THREADS": "2"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        sums.add(proc.stdout.strip())
    assert len(sums) == 1


def test_serial_kernels_release_the_gil_and_parallel_ones_keep_it():
    # The serial kernels run while a parallel one compiles in the background (and beside
    # a threaded scheduler's other tasks); the parallel ones run one Python thread at a
    # time (see the backend's _parallel_lock).
    pytest.importorskip("numba")
    from layernorm._backends._numba import kernels

    seen = 0
    for name in dir(kernels):
        kernel = getattr(kernels, name)
        options = getattr(kernel, "targetoptions", None)
        if options is None:
            continue
        seen += 1
        assert options["nogil"] is (not options.get("parallel", False)), name
    assert seen > 50


def scaling_kernel(factor):
    """A new parallel Numba kernel ``out = factor * a`` (a dispatcher of its own, never
    compiled yet)."""
    numba = pytest.importorskip("numba")

    @numba.njit(parallel=True)
    def scale(a, out):
        for i in numba.prange(a.shape[0]):
            out[i] = factor * a[i]

    return scale


@pytest.fixture
def background_compiles():
    """Background compilation on (the library's default; ``bench``, which the CLI tests
    run in this process, turns it off while it runs), as it was after the test."""
    pytest.importorskip("numba")
    from layernorm._backends._numba import entry

    previous = entry.set_background_compiles(True)
    yield
    entry.set_background_compiles(previous)


def test_a_parallel_kernel_compiles_in_the_background(background_compiles):
    pytest.importorskip("numba")
    from layernorm._backends._numba import entry

    twice, thrice = scaling_kernel(2.0), scaling_kernel(3.0)
    a = np.arange(1000, dtype=np.float64)
    out = np.empty_like(a)
    entry.finish_compiling()  # what earlier calls started
    assert entry.ready_entry_point(twice, (1,), (a, out)) is None  # compiling
    threads = [t for key, t in list(entry.compiling.items()) if key[0] is twice]
    assert len(threads) == 1
    assert entry.ready_entry_point(twice, (1,), (a, out)) is None  # once
    # Another kernel waits for its turn (the thread holds Numba's compiler lock); a
    # compilation takes far longer than these lines.
    assert entry.ready_entry_point(thrice, (1,), (a, out)) is None
    assert [key[0] for key in entry.compiling] == [twice]
    entry.finish_compiling()
    assert entry.ready_entry_point(thrice, (1,), (a, out)) is None  # its turn now
    entry.finish_compiling()
    entry.ready_entry_point(thrice, (1,), (a, out))(a, out)
    np.testing.assert_array_equal(out, 3.0 * a)
    assert not entry.compiling
    compiled = entry.ready_entry_point(twice, (1,), (a, out))
    compiled(a, out)
    np.testing.assert_array_equal(out, 2.0 * a)
    # a view of another layout: the same compiled entry point
    assert entry.ready_entry_point(twice, (1,), (a[::2], out[::2])) is compiled


def test_background_compilation_can_be_turned_off(background_compiles):
    # ``bench`` compiles in the caller (see set_background_compiles).
    pytest.importorskip("numba")
    from layernorm._backends._numba import entry

    halve = scaling_kernel(0.5)
    a = np.arange(100, dtype=np.float64)
    out = np.empty_like(a)
    entry.finish_compiling()
    previous = entry.set_background_compiles(False)
    try:
        assert previous is True
        compiled = entry.ready_entry_point(halve, (1,), (a, out))
        assert compiled is not None and not entry.compiling
        compiled(a, out)
        np.testing.assert_array_equal(out, 0.5 * a)
    finally:
        assert entry.set_background_compiles(previous) is False


def test_a_failed_background_compilation_raises_in_the_next_call(background_compiles):
    numba = pytest.importorskip("numba")
    from layernorm._backends._numba import entry

    @numba.njit(parallel=True)
    def broken(a):
        return no_such_function(a)  # noqa: F821

    a = np.arange(10.0)
    entry.finish_compiling()
    assert entry.ready_entry_point(broken, (), (a,)) is None
    entry.finish_compiling()
    with pytest.raises(Exception, match="no_such_function"):
        entry.ready_entry_point(broken, (), (a,))


@pytest.mark.parametrize("policy", ["auto", "always"])
def test_a_call_runs_serially_while_its_parallel_kernel_compiles(monkeypatch, policy):
    pytest.importorskip("numba")
    from layernorm._backends import _numba as backend

    monkeypatch.setattr(backend, "chooser", schedule.Chooser(policy))
    monkeypatch.setattr(backend.entry, "ready_entry_point", lambda *args: None)
    monkeypatch.setattr(backend.entry, "entry_point", lambda kernel, writes, args: kernel)
    key = backend.chooser.key("kernel", np.dtype(np.float32), ELEMENTS)
    backend.chooser.record(key, False, 0.010, ELEMENTS)
    assert backend.chooser.parallel(key)  # a probe, or always parallel
    ran = []

    def serial(*args):
        ran.append("serial")

    def parallel(*args):
        ran.append("parallel")

    backend._choose_class(key, ELEMENTS, (np.zeros(4),), lambda args: serial,
                          lambda args: backend.parallel_entry_point(parallel, (), args))
    if policy == "auto":  # serial while it compiles, measured as a serial call
        assert ran == ["serial"]
        assert len(backend.chooser.classes[key].serial_times.order) == 2
        assert backend.chooser.parallel(key)  # it probes once the kernel is there
    else:  # the policy waits for the parallel kernel
        assert ran == ["parallel"]
    # While a kernel compiles in the background (the other core, the GIL at times), no
    # call is measured.
    monkeypatch.setattr(backend.entry, "compiling", {"a kernel": None})
    before = [list(c.serial_times.order) for c in backend.chooser.classes.values()]
    backend._choose_class(key, ELEMENTS, (np.zeros(4),), lambda args: serial,
                          lambda args: backend.parallel_entry_point(parallel, (), args))
    assert [list(c.serial_times.order) for c in backend.chooser.classes.values()] == before
