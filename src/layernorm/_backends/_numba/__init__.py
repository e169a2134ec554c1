"""Numba CPU backend: thin wrappers that pick serial or parallel kernels.

Nothing here compiles at import; the kernels (:mod:`.kernels`, and Numba itself) are
imported on first use, and every kernel is compiled lazily per signature, cached on disk
(:mod:`.diskcache`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..._dtypes import dtype_name
from . import entry, schedule

#: Below this many elements a call runs on the calling thread: starting threads for a
#: microsecond problem costs more than it saves.
PARALLEL_MIN_ELEMENTS = 1 << 16

#: Rows per block of the parameter-gradient reduction. Fixed (never derived from the
#: thread count) so that grad_weight/grad_bias are bitwise identical for any threads.
GRAD_ROW_BLOCK = 64

# Two guards keep Numba's threading layers safe without giving up the fast one (measured:
# at 2 threads "omp" halves the time of a (4096, 768) forward, "workqueue" doubles it).
# 1. Only one Python thread at a time runs a parallel kernel ("workqueue", the fallback
#    layer, aborts on concurrent use); the others run the serial variant, which performs
#    exactly the same arithmetic per row.
# 2. GNU OpenMP kills a forked child that enters a parallel region after its parent
#    started Numba's thread pool, which compiling or loading a parallel kernel does (not
#    only running one); such a child runs serial kernels only (same bits, one thread).
_parallel_lock = threading.Lock()
_parallel_ran = False
_serial_only = False


def _threads_launched() -> bool:
    """Whether Numba's threading layer has started in this process (without importing
    Numba where nothing did)."""
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    return bool(getattr(parallel, "_is_initialized", True)) if parallel is not None else False


def _after_fork_in_child() -> None:
    global _parallel_lock, _serial_only
    _parallel_lock = threading.Lock()
    if _parallel_ran or _threads_launched():
        _serial_only = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.cache
def load_kernels() -> Any:
    """The :mod:`.kernels` module, whose names import their kernel module (and Numba) on
    first use."""
    from . import kernels

    return kernels


#: Numba has no float16/bfloat16 on the CPU: the kernels see the raw bits and convert
#: (int16 bits mean float16, uint16 bits mean bfloat16). Dtype name -> bits dtype.
KERNEL_BITS = {"float16": np.int16, "bfloat16": np.uint16}


def _as_kernel_array(arr: Any, dtype: str) -> Any:
    bits = KERNEL_BITS.get(dtype)
    return arr if bits is None else arr.view(bits)


_eps_scalars: dict[tuple[float, bool], Any] = {}


def _acc_scalar(value: float, dtype: str) -> Any:
    # Memoized: building a NumPy scalar costs as much as a small kernel's arithmetic.
    key = (value, dtype == "float64")
    scalar = _eps_scalars.get(key)
    if scalar is None:
        if len(_eps_scalars) > 64:
            _eps_scalars.clear()
        scalar = _eps_scalars[key] = (np.float64 if key[1] else np.float32)(value)
    return scalar


#: Serial or parallel per call, from measured times (:mod:`.schedule`).
chooser = schedule.Chooser(schedule.policy_from_environment())


def _run(serial: Any, parallel: Any, elements: int, writes: tuple[int, ...],
         *args: Any) -> Any:
    """Run the parallel kernel when it pays, no other thread is in one and it is
    compiled (:func:`parallel_entry_point`), else serial.

    Both perform the same arithmetic per row; small inputs never touch the thread pool.
    Larger ones go parallel unless :data:`chooser` measured that parallel calls of their
    class are slower than serial ones (a busy machine). ``writes`` are the positions of
    the arrays the kernels write (see :mod:`.entry`).
    """
    return _choose(serial, elements, args, lambda a: entry.entry_point(serial, writes, a),
                   lambda a: parallel_entry_point(parallel, writes, a))


def parallel_entry_point(kernel: Any, writes: tuple[int, ...], args: tuple[Any, ...]) -> Any:
    """The compiled parallel ``kernel`` for ``args``, or None while it compiles in the
    background (:func:`.entry.ready_entry_point`; the serial kernel runs meanwhile),
    except under the ``always`` policy (:func:`parallel_kernels_compiled_at_once`),
    which waits for it."""
    if chooser.policy == "always":
        return entry.entry_point(kernel, writes, args)
    return entry.ready_entry_point(kernel, writes, args)


@contextlib.contextmanager
def parallel_kernels_compiled_at_once() -> Iterator[None]:
    """Within it, the chooser's policy is ``always``: a call large enough runs the
    parallel kernel, compiled before the call returns (``python -m layernorm compile``
    fills the cache with them). Not thread-safe: for tools, never for library calls."""
    saved = chooser.policy
    entry.finish_compiling()
    chooser.policy = "always"
    try:
        yield
    finally:
        chooser.policy = saved


def _choose(serial: Any, elements: int, args: tuple[Any, ...], serial_entry: Any,
            parallel_entry: Any) -> Any:
    """:func:`_run` with the compiled entry points given by two functions of ``args``
    (called only for the variant that runs)."""
    if elements < PARALLEL_MIN_ELEMENTS or _serial_only or _num_threads() < 2:
        return serial_entry(args)(*args)
    return _choose_class(chooser.key(serial, args[0].dtype, elements), elements, args,
                         serial_entry, parallel_entry)


def _choose_class(key: Any, elements: int, args: tuple[Any, ...], serial_entry: Any,
                  parallel_entry: Any) -> Any:
    """:func:`_choose` of a call of more than one thread's work, of the chooser's class
    ``key``."""
    global _parallel_ran
    known = len(entry.entry_points)
    ran_parallel = False
    if chooser.parallel(key) and _parallel_lock.acquire(blocking=False):
        try:
            kernel = parallel_entry(args)
            if kernel is not None:  # else it is compiling: serial meanwhile
                _parallel_ran = ran_parallel = True
                start = time.perf_counter()
                result = kernel(*args)
        finally:
            _parallel_lock.release()
    if not ran_parallel:
        kernel = serial_entry(args)
        start = time.perf_counter()
        result = kernel(*args)
    # Not measured: a call that compiled or loaded a kernel, or one made while a kernel
    # compiles in the background (it takes the other core and the GIL at times).
    if len(entry.entry_points) == known and not entry.compiling:
        chooser.record(key, ran_parallel, time.perf_counter() - start, elements)
    return result


def run_rows(serial: Any, parallel: Any, writes: tuple[int, ...], *args: Any) -> Any:
    """Run a 2-D row kernel (``args[0]`` is ``x``) serially or in parallel, as the drivers do.

    Both variants give the same bits.
    """
    return _run(serial, parallel, args[0].size, writes, *args)


class PlannedRows:
    """:func:`run_rows` for the short paths' plans (:mod:`layernorm._fast` and the like),
    which the backend chooses to run serially or in parallel.

    A plan's checks guarantee that every call passes arrays of the same dtypes, ranks and
    alignment and scalars of the same types, so each variant's compiled entry point is
    looked up once, on its first use (:func:`.entry.entry_point`; the lookup costs about
    5 us a call, a tenth of a cache-resident (242, 768) call).

    Parameters
    ----------
    serial, parallel : numba.core.registry.CPUDispatcher
        The kernel's two variants (the same bits).
    writes : tuple of int
        Positions of the arrays the kernels write.
    """

    __slots__ = ("_class", "_elements", "_key", "_parallel", "_serial", "parallel", "serial",
                 "writes")

    def __init__(self, serial: Any, parallel: Any, writes: tuple[int, ...]) -> None:
        self.serial, self.parallel, self.writes = serial, parallel, writes
        self._serial: Any = None
        self._parallel: Any = None
        #: The chooser's class of the plan's calls, its state, and their size (x's dtype
        #: and shape are the plan's): set on the first call.
        self._key: Any = None
        self._class: Any = None
        self._elements = 0

    def __call__(self, *args: Any) -> Any:
        key = self._key
        if key is None:
            x = args[0]
            self._elements = x.size
            key = self._key = chooser.key(self.serial, x.dtype, x.size)
        serial, parallel = self._serial, self._parallel
        if self._elements < PARALLEL_MIN_ELEMENTS or _serial_only or _num_threads() < 2:
            return (serial or self._serial_entry(args))(*args)
        c = self._class
        if c is None:
            if serial is None or parallel is None:  # the first calls load the kernels
                return _choose_class(key, self._elements, args, self._serial_entry,
                                     self._parallel_entry)
            c = self._class = chooser.class_of(key)
        # _choose_class written out with the class state at hand: a cache-resident call
        # at 2 threads is 15-20 us, and each layer of calls and lookups here cost a
        # few tenths of a microsecond.
        global _parallel_ran
        if chooser.parallel_in(c) and _parallel_lock.acquire(blocking=False):
            try:
                _parallel_ran = True
                start = time.perf_counter()
                result = parallel(*args)
                seconds = time.perf_counter() - start
            finally:
                _parallel_lock.release()
            if not entry.compiling:  # see _choose_class
                chooser.record_in(c, True, seconds, self._elements)
            return result
        start = time.perf_counter()
        result = serial(*args)
        if not entry.compiling:
            chooser.record_in(c, False, time.perf_counter() - start, self._elements)
        return result

    def _serial_entry(self, args: tuple[Any, ...]) -> Any:
        if self._serial is None:
            self._serial = entry.entry_point(self.serial, self.writes, args)
        return self._serial

    def _parallel_entry(self, args: tuple[Any, ...]) -> Any:
        if self._parallel is None:  # None again while it compiles
            self._parallel = parallel_entry_point(self.parallel, self.writes, args)
        return self._parallel


#: What ``numba.get_num_threads`` returns, minus its cost (set by :func:`_num_threads`).
_thread_count: Any = None


def _num_threads() -> int:
    """``numba.get_num_threads()`` (the calling thread's count), asked on every call
    large enough to go parallel.

    Numba's function takes two locks per call (to start the threading layer once), about
    2 us, a tenth of a cache-resident call's overhead, and more once its kernel has
    evicted the interpreter's data from L2. Once the layer is up, the function it reads
    the count from (``numba.np.ufunc.parallel._get_num_threads``, the same per-thread
    value) takes 0.3 us; it is used when it gives the same answer, else Numba's own."""
    global _thread_count
    if _thread_count is not None:
        return _thread_count()
    import numba
    from numba.np.ufunc import parallel

    count = numba.get_num_threads()  # starts the threading layer
    read = getattr(parallel, "_get_num_threads", None)
    try:
        usable = callable(read) and read() == count
    except Exception:  # another Numba's internals: its public function is right
        usable = False
    _thread_count = read if usable else numba.get_num_threads
    return count


def _grad_partials(blocks: int, n: int, acc: Any, count: int) -> Any:
    return np.zeros((count, max(1, blocks), n), dtype=acc)


@functools.cache
def _last_level_cache_bytes() -> int:
    try:
        base = "/sys/devices/system/cpu/cpu0/cache"
        sizes = []
        for entry in os.listdir(base):
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        return max(sizes)
    except (OSError, ValueError):
        return 32 << 20


#: Streaming stores pay only for outputs this many times larger than the last-level
#: cache and for rows of at least STREAM_MIN_ROW elements (measured, float32, DRAM-resident
#: inputs, interleaved, 16 and 32 MiB arrays, 1 and 2 threads: with them rows of 384-768
#: took 0.62-0.96x the time of plain stores, rows of 256 0.72-1.15x for LayerNorm and
#: 0.81-0.94x for RMSNorm; the fused add-and-normalize kernels, which normalize ``h``
#: from the cache, 0.63-0.97x at rows of 256-768; rows of 64 and 128, whose unaligned
#: ends are stored one element at a time, 1.04-1.22x).
STREAM_MIN_FRACTION = 0.5
STREAM_MIN_ROW = 256
#: The forward also streams rows of at least ``LONG_ROW_STREAM_MIN_ROW`` elements from
#: ``LONG_ROW_STREAM_MIN_FRACTION`` of the last-level cache on (4 MiB here), as the
#: backward does: y's reader then finds it in memory, not in the cache, yet the pair is
#: faster. Measured, float32, x rotated from DRAM, the forward into one ``out=`` and
#: then a reader of it, time plain / streaming in us, 1 thread: (2048, 768) 6 MiB
#: forward 585 / 376, then a column sum 697 / 605, then ``y @ W`` (W 768 x 256) 4689 /
#: 4597; (4096, 768) 12 MiB 1128-1374 / 688-957, 1375-1680 / 1113-1646, 9519-11519 /
#: 9103-10575; (1536, 1024) 558 / 347, 724 / 581; (768, 4096) 1665 / 1281, 2143 / 1914;
#: (1536, 2048) 1560 / 1214, 1940 / 1790; (1365, 768) 4 MiB 434 / 277, 568 / 410;
#: RMSNorm alike ((3072, 1024) 1152 / 769, 1636 / 1257). At
#: 2 threads the pairs were 0.71-0.91x with streaming ((4096, 768) sum 1664 / 1403,
#: (3072, 1024) 1984 / 1414). Shorter rows gained nothing or lost: (12288, 256) forward
#: 1070 / 1362 and sum 1705 / 2025; (6144, 512) at 2 threads sum 1731 / 2415. The fused
#: add-and-normalize (y streamed, h not) alike, into ``out=``/``residual_out=``, alone /
#: then a column sum of y: (4096, 768) 2311 / 2114 and 2877 / 2670, (768, 4096) 3925 /
#: 3328 and 5623 / 4594, (1536, 1024) 968 / 866; 2 threads (4096, 768) 1677 / 1346 and
#: 2035 / 1746; add_rms_norm (4096, 768) 3180 / 2599 and 3774 / 3307.
LONG_ROW_STREAM_MIN_FRACTION = 1 / 8
LONG_ROW_STREAM_MIN_ROW = 768
#: The serial LayerNorm forward streams only rows of at least this many elements;
#: shorter ones that :func:`use_streaming_stores` would stream keep the pipelined loop
#: and plain stores on one thread (its parallel kernel streams them). Written whole,
#: each row's statistics wait for its output pass, and on a row of 256 elements that
#: latency is not hidden. Measured, Zen 4, float32, public call into ``out=``, x of 16
#: and 32 MiB rotated over 160 MiB, fraction of ``np.copyto`` in the same rounds,
#: streaming / plain: 1 thread n = 256 0.70-0.83 / 0.85-1.04 (five runs), 320 0.79-0.80 /
#: 0.81-0.84, 384 0.74-0.77 / 0.75-0.79, 512 0.86-1.26 / 0.84-1.04; 2 threads n = 256
#: 1.14-1.36 / 1.02-1.33, 320 0.88-1.15 / 0.93-1.19. RMSNorm streams from 256 on one
#: thread too (n = 256: 1.30 / 1.10).
SERIAL_STREAM_MIN_ROW = 384


@contextlib.contextmanager
def streaming_stores_everywhere() -> Iterator[None]:
    """Within it, every output :func:`use_streaming_stores` is asked about takes them,
    whatever its size (``python -m layernorm compile`` compiles the streaming kernels
    with small calls). Not thread-safe: for tools, never for library calls."""
    global STREAM_MIN_FRACTION, STREAM_MIN_ROW, BACKWARD_STREAM_MIN_FRACTION
    global BACKWARD_STREAM_MIN_ROW
    saved = (STREAM_MIN_FRACTION, STREAM_MIN_ROW, BACKWARD_STREAM_MIN_FRACTION,
             BACKWARD_STREAM_MIN_ROW)
    STREAM_MIN_FRACTION, STREAM_MIN_ROW = 0.0, 1
    BACKWARD_STREAM_MIN_FRACTION, BACKWARD_STREAM_MIN_ROW = 0.0, 1
    try:
        yield
    finally:
        (STREAM_MIN_FRACTION, STREAM_MIN_ROW, BACKWARD_STREAM_MIN_FRACTION,
         BACKWARD_STREAM_MIN_ROW) = saved


def use_streaming_stores(x: Any, y: Any) -> bool:
    """Whether the forward of ``x`` into ``y`` should write ``y`` with streaming stores
    (:data:`STREAM_MIN_FRACTION`, :data:`LONG_ROW_STREAM_MIN_FRACTION`)."""
    # In place, the lines are already cached: a streaming store would only evict them.
    return streams_by_size(y.shape[-1], y.nbytes) and not np.may_share_memory(x, y)


def streams_by_size(n: int, nbytes: int) -> bool:
    """The size half of :func:`use_streaming_stores`: whether an output of ``nbytes``
    in rows of ``n`` elements takes streaming stores unless it overlaps the input.
    The short paths' plans ask it once (their calls all have one size): on every call,
    it cost a cache-resident call half a microsecond."""
    size = nbytes / _last_level_cache_bytes()
    return ((n >= STREAM_MIN_ROW and size >= STREAM_MIN_FRACTION)
            or (n >= LONG_ROW_STREAM_MIN_ROW and size >= LONG_ROW_STREAM_MIN_FRACTION))


#: Positions of the arrays each kernel family writes (the others are typed read-only).
LN_FORWARD_WRITES = (4, 5, 6)  # y, mean, rstd
RMS_FORWARD_WRITES = (3, 4)  # y, rstd
LN_BACKWARD_WRITES = (5, 6)  # grad_x, partials (also the shared column backward)
RMS_BACKWARD_WRITES = (4, 5)  # grad_x, partials


@functools.lru_cache(maxsize=64)
def _identity_params(n: int, acc: Any) -> tuple[Any, Any]:
    ones = np.ones(n, dtype=acc)
    negative_zeros = np.full(n, -0.0, dtype=acc)
    ones.flags.writeable = negative_zeros.flags.writeable = False
    return ones, negative_zeros


#: float16/bfloat16 parameters (or parameter gradients) of at least this many elements
#: in one call are converted by the small kernels of :mod:`.params`, shorter ones by a
#: NumPy cast. Measured, Zen 4, 1 thread, per call: float16 -> float32 cast 3.1 us at
#: 2048 elements, 6.0 us at 4096, 107 us at 65536; bfloat16 1.1 / 2.2 / 28 us; float32
#: -> float16 5.2 / 10.5 / 160 us, -> bfloat16 2.0 / 4.0 / 56 us; a kernel call about
#: 2 us (a pair of parameters 3-4 us) plus 0.1 ns an element.
PARAM_KERNEL_MIN = 2048


def widened_param(param: Any, acc: Any) -> Any:
    """A parameter as the kernels take it: float16/bfloat16 widened exactly to the
    accumulation dtype, any other array unchanged. The row kernels therefore see
    float32/float64 parameters only: a new parameter dtype never compiles another copy
    of them.

    A NumPy cast widens short parameters (a kernel call's fixed cost is more), one small
    kernel (:func:`.params.widen_param`) float32 ones of at least
    :data:`PARAM_KERNEL_MIN` elements: NumPy's float16 cast takes about 1.5 ns an
    element, more than a few long rows' whole norm.
    """
    bits = KERNEL_BITS.get(dtype_name(param.dtype))
    if bits is None:
        return param
    if not _by_kernel(param, acc):
        return param.astype(acc)
    out = entry.call(load_kernels().widen_param, (), param.reshape(-1).view(bits))
    return out if param.ndim == 1 else out.reshape(param.shape)


def widened_params(weight: Any, bias: Any, acc: Any) -> tuple[Any, Any]:
    """``(widened_param(weight, acc), widened_param(bias, acc))``, two 16-bit ones of
    ``n`` elements each widened by one kernel call (:func:`.params.widen_params`) when
    ``2 * n`` reach :data:`PARAM_KERNEL_MIN`: at a few rows of a few thousand
    elements, a kernel call's fixed cost is a fair part of the whole call."""
    wbits = KERNEL_BITS.get(dtype_name(weight.dtype))
    bbits = KERNEL_BITS.get(dtype_name(bias.dtype))
    if (wbits is None or bbits is None or weight.shape != bias.shape
            or not (_by_kernel(weight, acc, 2) and _by_kernel(bias, acc, 2))):
        return widened_param(weight, acc), widened_param(bias, acc)
    out = entry.call(load_kernels().widen_params, (), weight.reshape(-1).view(wbits),
                     bias.reshape(-1).view(bbits))
    if weight.ndim == 1:
        return out[0], out[1]
    return out[0].reshape(weight.shape), out[1].reshape(bias.shape)


def narrowed_param(values: Any, dtype: Any) -> Any:
    """``values`` (a parameter gradient in the accumulation dtype, which it may
    return) as ``dtype``: float32 values rounded to float16/bfloat16 by one small kernel
    (:func:`.params.narrow_param`) when there are at least :data:`PARAM_KERNEL_MIN`,
    by NumPy's cast otherwise (the same bits for every number: IEEE round to nearest
    even; a NaN stays a NaN, its payload may differ). A value beyond float16's range
    becomes an infinity either way, without NumPy's warning (as torch rounds
    gradients)."""
    dtype = np.dtype(dtype)
    bits = KERNEL_BITS.get(dtype_name(dtype))
    if bits is None:
        return values.astype(dtype, copy=False)
    if not _by_kernel(values, values.dtype):
        if bits is np.int16:
            with np.errstate(over="ignore"):
                return values.astype(dtype)
        return values.astype(dtype)
    out = np.empty(values.shape, dtype=dtype)
    entry.call(load_kernels().narrow_param, (1,), values.reshape(-1),
               out.reshape(-1).view(bits))
    return out


def _by_kernel(param: Any, acc: Any, count: int = 1) -> bool:
    # ``count`` such arrays in one call. Only float32 conversions, only C-contiguous
    # arrays (whose (1, n) view is free).
    return (count * param.size >= PARAM_KERNEL_MIN and np.dtype(acc) == np.float32
            and param.flags.c_contiguous and param.dtype.isnative)


def kernel_params(weight: Any, bias: Any, n: int, acc: Any) -> tuple[Any, Any]:
    """``weight`` and ``bias`` widened (:func:`widened_param`), an absent one replaced by
    its exact identity.

    The kernels compute ``fma(v, w, b)``: with ``w = 1`` and ``b = -0.0`` that is ``v``,
    ``v * w`` or ``v + b`` bit for bit (``-0.0`` is the only addend that leaves a ``+0.0``
    or ``-0.0`` product unchanged), so one compiled kernel serves every combination.
    """
    if weight is not None and bias is not None:
        return widened_params(weight, bias, acc)
    ones, negative_zeros = _identity_params(n, np.dtype(acc))
    return (ones if weight is None else widened_param(weight, acc),
            negative_zeros if bias is None else widened_param(bias, acc))


def _unit_stride(a: Any) -> bool:
    return a.strides[1] == a.itemsize or a.shape[1] <= 1


def ln_row_kernels(k: Any, x: Any, y: Any, stream: bool = False) -> tuple[Any, Any]:
    """The (serial, parallel) LayerNorm row kernels for 2-D ``x`` into ``y``: one entry
    kernel per path, so a call compiles only its own (all give the same bits).
    ``stream``: :func:`use_streaming_stores` said yes (only the long-row path streams)."""
    if not (_unit_stride(x) and _unit_stride(y)):
        return k.ln_gathered_forward_serial, k.ln_gathered_forward_parallel
    return ln_unit_row_kernels(k, x.shape[1], stream, param_bytes(x.dtype), x.itemsize)


def param_bytes(dtype: Any) -> int:
    """Bytes per element of the parameters the kernels take for inputs of ``dtype`` (the
    accumulation type's: float64 for float64, else float32)."""
    return 8 if np.dtype(dtype) == np.float64 else 4


def ln_unit_row_kernels(k: Any, n: int, stream: bool = False, param_size: int = 4,
                        item_size: int | None = None) -> tuple[Any, Any]:
    """:func:`ln_row_kernels` for rows of ``n`` elements of unit stride (x and y), whose
    parameters have ``param_size`` bytes per element (:func:`param_bytes`) and x
    ``item_size`` (default: ``param_size``)."""
    if n <= k.SHORT_ROW_MAX:
        return k.ln_short_forward_serial, k.ln_short_forward_parallel
    item_size = param_size if item_size is None else item_size
    # two rows of x, w and b (see STREAM_ROWS_MAX_BYTES)
    if stream and 2 * n * (item_size + param_size) > k.STREAM_ROWS_MAX_BYTES:
        return k.ln_stream_tiled_forward_serial, k.ln_stream_tiled_forward_parallel
    if stream and n < SERIAL_STREAM_MIN_ROW:
        return k.ln_forward_serial, k.ln_stream_forward_parallel
    if stream:
        return k.ln_stream_forward_serial, k.ln_stream_forward_parallel
    if n * param_size >= k.TILED_MIN_BYTES:
        return k.ln_tiled_forward_serial, k.ln_tiled_forward_parallel
    if n * param_size >= k.TILED_PARALLEL_MIN_BYTES:
        return k.ln_seq_forward_serial, k.ln_tiled_forward_parallel
    if n >= k.SEQUENTIAL_MIN_ROW:
        return k.ln_seq_forward_serial, k.ln_seq_forward_parallel
    return k.ln_forward_serial, k.ln_forward_parallel


def rms_row_kernels(k: Any, x: Any, y: Any, stream: bool = False) -> tuple[Any, Any]:
    """The (serial, parallel) RMSNorm row kernels for 2-D ``x`` into ``y`` (see
    :func:`ln_row_kernels`)."""
    if not (_unit_stride(x) and _unit_stride(y)):
        return k.rms_gathered_forward_serial, k.rms_gathered_forward_parallel
    return rms_unit_row_kernels(k, x.shape[1], stream, param_bytes(x.dtype))


def rms_unit_row_kernels(k: Any, n: int, stream: bool = False,
                         param_size: int = 4) -> tuple[Any, Any]:
    """:func:`rms_row_kernels` for rows of ``n`` elements of unit stride (x and y) (see
    :func:`ln_unit_row_kernels`)."""
    if n <= k.SHORT_ROW_MAX:
        return k.rms_short_forward_serial, k.rms_short_forward_parallel
    if stream and n * param_size >= k.RMS_STREAM_TILED_MIN_BYTES:
        return k.rms_stream_tiled_forward_serial, k.rms_stream_tiled_forward_parallel
    if stream:
        return k.rms_stream_forward_serial, k.rms_stream_forward_parallel
    if n * param_size >= k.TILED_MIN_BYTES:
        return k.rms_tiled_forward_serial, k.rms_tiled_forward_parallel
    if n >= k.SEQUENTIAL_MIN_ROW:
        return k.rms_seq_forward_serial, k.rms_seq_forward_parallel
    return k.rms_forward_serial, k.rms_forward_parallel


def add_ln_kernels(k: Any, n: int, stream: bool = False,
                   param_size: int = 4) -> tuple[Any, Any]:
    """The (serial, parallel) one-pass add-and-LayerNorm kernels for rows of ``n``
    (``stream``: :func:`fused_add_streams` said yes; short rows never stream; parameters
    of ``param_size`` bytes, see :func:`ln_unit_row_kernels`)."""
    if n <= k.SHORT_ROW_MAX:
        return k.add_ln_short_forward_serial, k.add_ln_short_forward_parallel
    if stream:
        return k.add_ln_stream_forward_serial, k.add_ln_stream_forward_parallel
    if n * param_size >= k.TILED_MIN_BYTES:
        return k.add_ln_tiled_forward_serial, k.add_ln_tiled_forward_parallel
    if n >= k.SEQUENTIAL_MIN_ROW:
        return k.add_ln_seq_forward_serial, k.add_ln_seq_forward_parallel
    return k.add_ln_forward_serial, k.add_ln_forward_parallel


def add_rms_kernels(k: Any, n: int, stream: bool = False,
                    param_size: int = 4) -> tuple[Any, Any]:
    """:func:`add_ln_kernels` for RMSNorm."""
    if n <= k.SHORT_ROW_MAX:
        return k.add_rms_short_forward_serial, k.add_rms_short_forward_parallel
    if stream:
        return k.add_rms_stream_forward_serial, k.add_rms_stream_forward_parallel
    if n * param_size >= k.TILED_MIN_BYTES:
        return k.add_rms_tiled_forward_serial, k.add_rms_tiled_forward_parallel
    if n >= k.SEQUENTIAL_MIN_ROW:
        return k.add_rms_seq_forward_serial, k.add_rms_seq_forward_parallel
    return k.add_rms_forward_serial, k.add_rms_forward_parallel


#: Positions of the per-row arrays (x, y, statistics) among the row kernels' arguments.
LN_FORWARD_ROWS = (0, 4, 5, 6)
RMS_FORWARD_ROWS = (0, 3, 4)


def _rows_of(args: tuple[Any, ...], positions: tuple[int, ...], start: int,
             stop: int) -> tuple[Any, ...]:
    return tuple(a[start:stop] if i in positions and a is not None else a
                 for i, a in enumerate(args))


def _pending(result: Any, rows: int) -> list[tuple[int, int]]:
    # A serial kernel returns the rows it did, a parallel one the (stop, end) rows of its
    # blocks that stopped (.forward_rows.stopped_blocks).
    if isinstance(result, int):
        return [(result, rows)] if result < rows else []
    return [(stop, end) for stop, end in result.tolist()]


def _complete(result: Any, rescue: Any, writes: tuple[int, ...], positions: tuple[int, ...],
              args: tuple[Any, ...]) -> None:
    """Finish a row kernel's call that stopped before finite rows whose squares overflow
    or underflow.

    The plain row kernels leave such a row unwritten and stop (see :mod:`.rescale`):
    here the rest of each stopped range goes through ``rescue``, the gathered kernel,
    which rescales in its loop (the same bits for every other row), so only a call that
    meets such a row compiles the rescaling code, and a batch full of them costs one
    call per stopped range.
    """
    for stop, end in _pending(result, args[0].shape[0]):
        entry.call(rescue, writes, *_rows_of(args, positions, stop, end))


def _every_row_done(result: Any, rows: int) -> bool:
    # A serial row kernel's count of rows done, a parallel one's stopped blocks (None if
    # none; the gathered kernels return None too: they rescale in their loop).
    return result is None or (type(result) is int and result == rows)


def complete_layer_norm_rows(result: Any, args: tuple[Any, ...]) -> None:
    """Finish a LayerNorm row kernel's call (``args`` as the kernel took them) that
    returned ``result`` (see :func:`_complete`); nothing to do if it did every row."""
    if _every_row_done(result, args[0].shape[0]):
        return
    _complete(result, load_kernels().ln_gathered_forward_serial, LN_FORWARD_WRITES,
              LN_FORWARD_ROWS, args)


def complete_rms_norm_rows(result: Any, args: tuple[Any, ...]) -> None:
    """:func:`complete_layer_norm_rows` for the RMSNorm row kernels."""
    if _every_row_done(result, args[0].shape[0]):
        return
    _complete(result, load_kernels().rms_gathered_forward_serial, RMS_FORWARD_WRITES,
              RMS_FORWARD_ROWS, args)


#: Transposed rows (:func:`_transposed_rows`) longer than this many bytes keep the
#: gather path: the column kernels' tiles hold ``LANES`` whole rows of x and of y.
TRANSPOSED_ROW_MAX_BYTES = 256 << 10


def _transposed_rows(x3: Any) -> bool:
    """Whether the rows of the ``(rows, n, 1)`` view ``x3`` are the columns of a
    C-ordered array (a transposed or Fortran-ordered x: unit stride across rows, not
    along them), at least ``LANES`` of them, of at most
    :data:`TRANSPOSED_ROW_MAX_BYTES`. The column path reads such rows as the columns
    of the ``(1, n, rows)`` view (:func:`_columns_view`), with the same bits as the row
    path: gathered row by row they took 3-4x as long (float32, 1 thread, kernel alone:
    (2048, 1024) 8.5 -> 2.7 ms, (1024, 4096) 33 -> 8.4 ms, (4096, 64) 0.95 -> 0.24 ms;
    even at n = 4 and 8). Fewer rows would fill the column tiles with padding (the
    column kernels compute ``LANES`` columns at a time): (8, 65536) took 4x, (2, 2**20)
    8x the gather path's time."""
    return (x3.shape[0] >= load_kernels().LANES and x3.shape[1] > 1
            and x3.strides[0] == x3.itemsize and x3.strides[1] != x3.itemsize
            and x3.shape[1] * x3.itemsize <= TRANSPOSED_ROW_MAX_BYTES)


def _columns_view(x3: Any, y3: Any) -> tuple[Any, Any]:
    # (rows, n, 1) views of transposed rows as (1, n, rows) (the columns of x.T);
    # channels-first (outer, n, inner) views as they are.
    if x3.shape[2] == 1:
        return x3.transpose(2, 1, 0), y3.transpose(2, 1, 0)
    return x3, y3


def layer_norm_forward(x3, weight, bias, eps, y3, mean, rstd, dtype) -> None:
    """LayerNorm forward into ``y3``; fills ``mean`` and ``rstd``."""
    k = load_kernels()
    x = _as_kernel_array(x3, dtype)
    y = _as_kernel_array(y3, dtype)
    e = _acc_scalar(eps, dtype)
    w, b = kernel_params(weight, bias, x3.shape[1], mean.dtype)
    tab = k.merge_table(x3.shape[1], mean.dtype)
    if x.shape[2] == 1 and not _transposed_rows(x):
        x = x[:, :, 0]
        y = y[:, :, 0]
        nt = use_streaming_stores(x, y)
        serial, parallel = ln_row_kernels(k, x, y, nt)
        args = (x, w, b, e, y, mean, rstd, tab, nt)
        complete_layer_norm_rows(_run(serial, parallel, x.size, LN_FORWARD_WRITES, *args),
                                 args)
    else:
        x, y = _columns_view(x, y)
        short = x.shape[1] <= k.SHORT_COLUMN_MAX
        _run(k.ln_forward_short_cols_serial if short else k.ln_forward_cols_serial,
             k.ln_forward_short_cols_parallel if short else k.ln_forward_cols_parallel,
             x.size, LN_FORWARD_WRITES, x, w, b, e, y, mean, rstd, tab)


def rms_norm_forward(x3, weight, eps, y3, rstd, dtype) -> None:
    """RMSNorm forward into ``y3``; fills ``rstd``."""
    k = load_kernels()
    x = _as_kernel_array(x3, dtype)
    y = _as_kernel_array(y3, dtype)
    e = _acc_scalar(eps, dtype)
    w = kernel_params(weight, None, x3.shape[1], rstd.dtype)[0]
    if x.shape[2] == 1 and not _transposed_rows(x):
        x = x[:, :, 0]
        y = y[:, :, 0]
        nt = use_streaming_stores(x, y)
        serial, parallel = rms_row_kernels(k, x, y, nt)
        args = (x, w, e, y, rstd, nt)
        complete_rms_norm_rows(_run(serial, parallel, x.size, RMS_FORWARD_WRITES, *args),
                               args)
    else:
        x, y = _columns_view(x, y)
        short = x.shape[1] <= k.SHORT_COLUMN_MAX
        _run(k.rms_forward_short_cols_serial if short else k.rms_forward_cols_serial,
             k.rms_forward_short_cols_parallel if short else k.rms_forward_cols_parallel,
             x.size, RMS_FORWARD_WRITES, x, w, e, y, rstd)


def _col_blocks(x3: Any) -> int:
    return x3.shape[0] * -(-x3.shape[2] // load_kernels().COL_BLOCK)


#: The backward kernels add ``grad_residual`` to grad_x themselves (see :mod:`.backward`).
FUSES_GRAD_RESIDUAL = True


def _grad_residual_arg(grad_residual: Any, x: Any, dtype: str) -> tuple[Any, bool]:
    # Without one, x itself stands in (same type, one compiled kernel); it is never read.
    if grad_residual is None:
        return x, False
    return _as_kernel_array(grad_residual, dtype), True


def _unit_strides(gy: Any, x: Any, gx: Any, grad_residual: Any) -> bool:
    arrays = (gy, x, gx) if grad_residual is None else (gy, x, gx, grad_residual)
    return all(_unit_stride(a) for a in arrays)


#: Byte alignment of every row of a grad_x that the backward writes with streaming
#: stores (a SIMD vector's, at most a cache line's).
STREAM_ALIGN = 64
#: The backward streams rows of at least this many elements; None: those of its skewed
#: kernels (``SHORT_BACKWARD_N``, 80 with AVX-512; aligned rows have no
#: element-by-element ends).
#: Measured, float32, kernel alone, from DRAM, fraction of the ``np.add`` floor,
#: streaming / plain, 1 thread: n = 96 1.09 / 0.76, 128 0.61-1.03 / 0.59-0.81, 160
#: 0.68 / 0.70, 192 1.02 / 0.75; 2 threads: 96 1.31 / 1.01, 128 1.26-1.27 / 1.03-1.08,
#: 160 0.99 / 1.07, 192 1.11 / 1.02. Shorter rows keep the short-row kernels (16-64:
#: 0.71-0.79 against the skewed streaming kernel's 0.40-0.59 at 1 thread).
BACKWARD_STREAM_MIN_ROW: int | None = None
#: The backward streams a grad_x of at least this fraction of the last-level cache (the
#: forward: ``STREAM_MIN_FRACTION``, a half). Its reader then finds it in memory, not in
#: the cache, yet the pair is faster: float32, 1 thread, inputs rotated from DRAM, the
#: backward kernel then a reader of grad_x, time plain / streaming, in us: (1024, 768)
#: 3 MiB, then a column sum 584 / 479, then ``grad_x @ W`` (W 768 x 256) 2622 / 2527;
#: (2048, 768) 1097 / 880 and 5299 / 4958; (4096, 768) 2461-2949 / 1749-2116 and
#: 10463-12071 / 9599-11105; at 2 threads streaming took 0.96-1.10x the time (noisy).
BACKWARD_STREAM_MIN_FRACTION = 1 / 8


def empty_output(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new C-contiguous array whose data starts on a ``STREAM_ALIGN``-byte boundary.

    Large NumPy allocations start 16 bytes into a page; the backward allocates grad_x
    with this, so that rows of a multiple of 64 bytes are aligned for streaming stores
    (:func:`streams_gradient`).

    Examples
    --------
    >>> a = empty_output((3, 256), np.float32)
    >>> a.shape, a.dtype, a.ctypes.data % STREAM_ALIGN, a.flags.c_contiguous
    ((3, 256), dtype('float32'), 0, True)
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(count * dtype.itemsize + STREAM_ALIGN, np.uint8)
    skip = -raw.ctypes.data % STREAM_ALIGN
    return raw[skip:skip + count * dtype.itemsize].view(dtype).reshape(shape)


def streams_gradient(gx: Any) -> bool:
    """Whether the backward writes ``gx`` (2-D, unit-stride rows, a fresh array that no
    input overlaps) with streaming stores: rows of at least ``BACKWARD_STREAM_MIN_ROW``
    elements, at least ``BACKWARD_STREAM_MIN_FRACTION`` of the last-level cache, every
    row starting on a ``STREAM_ALIGN``-byte boundary (the streaming kernels store whole
    aligned vectors).

    Measured, float32, kernel alone, inputs rotated from DRAM, interleaved, 2-core Zen 4,
    time with / without, LayerNorm at 1 thread: (16384, 256) 0.77, (4096, 1024) 0.57,
    (8192, 1024) 0.67, (2048, 4096) 0.57-0.59, (512, 16384) 0.66; at 2 threads 0.64-0.76;
    RMSNorm 0.57-0.83 and 0.71-0.81."""
    return (gx.ctypes.data % STREAM_ALIGN == 0 and gx.strides[0] % STREAM_ALIGN == 0
            and streams_gradient_rows(gx.shape[0], gx.shape[1], gx.itemsize))


def streams_gradient_rows(rows: int, n: int, itemsize: int) -> bool:
    """:func:`streams_gradient` for a contiguous grad_x of ``rows`` rows of ``n``
    elements of ``itemsize`` bytes allocated by :func:`empty_output`."""
    least = BACKWARD_STREAM_MIN_ROW
    if least is None:
        least = load_kernels().SHORT_BACKWARD_N
    return (n >= least and n * itemsize % STREAM_ALIGN == 0
            and rows * n * itemsize
            >= BACKWARD_STREAM_MIN_FRACTION * _last_level_cache_bytes())


def _splits(k: Any, rows: int, n: int) -> bool:
    """Whether a parallel backward of unit-stride rows splits columns over threads
    (``*_split_backward_parallel``) instead of row blocks: a call of one block of rows
    (which the row-block kernels run on one thread) of at least two column items.

    Measured, float32, kernel alone, in cache, 2 threads, LayerNorm / RMSNorm time split
    / row blocks: (60, 2048) 0.42 / 0.71, (29, 4096) 0.86 / 0.78, (6, 16384) 0.62 / 0.81,
    (64, 16384) 0.45 / 0.69; with two blocks or more it is not faster ((121, 1024)
    1.02 / 1.09, (161, 768) 1.05 / 1.28, (486, 256) 3.8 / 2.7).
    """
    return rows <= GRAD_ROW_BLOCK and n >= 2 * k.SPLIT_COLUMNS


#: LayerNorm rows of at least this many elements take the tiled backward (plain stores)
#: while x takes at most ``TILE_MAX_BYTES``; other rows the skewed one (no effect on
#: results). Measured, float32, 1 thread, kernel alone, medians over 6 placements of
#: the arrays (us, skewed / tiled), in cache: (121, 1024) 52-55 / 44-46, (81, 1536)
#: 54 / 44-45, (242, 512) 36-37 / 39, (161, 768) 40-42 / 42-43; larger, time tiled /
#: skewed: x of 2 MiB (512, 1024) 0.83, (256, 2048) 0.75, (128, 4096) 0.75; x of 4 MiB
#: (1024, 1024) 1.3, (256, 4096) 1.3, (64, 16384) 1.16; from DRAM (8192, 1024) 1.42,
#: (4096, 2048) 1.22, (2048, 4096) 1.32, (512, 16384) 1.18 (2 threads 1.15-1.29).
#: Remeasured after the tiles lost their prefetches and gained aligned, downward-capable
#: grad_x passes (public call, medians of five alternating processes, time with tiles
#: from 768 / from 1024): 1 thread (81, 768) 0.89, (161, 768) 0.94, (320, 768) 1.06,
#: (600, 768) 0.95; 2 threads 0.93, 1.05, 1.01, 1.08: within the noise, kept.
TILE_FROM_N = 1024
#: See :data:`TILE_FROM_N`.
TILE_MAX_BYTES = 2 << 20
#: RMSNorm rows of at least this many elements take the row-by-row backward
#: (``rms_paired_backward_*``, plain stores; pairs of rows from ``PAIR_MIN_N``), shorter
#: ones the skewed one (no effect on results). Measured, float32, 1 thread, kernel alone,
#: time row by row / skewed: in cache (medians over 6 placements) n = 256 1.1, 512 1.0,
#: 1024 0.79-0.82, 1536 0.78, 2048 0.77, 4096 0.86, 16384 0.86; from DRAM (16384, 512)
#: 0.76, (8192, 1024) 0.77, (4096, 2048) 0.90, (2048, 4096) 0.89, (512, 16384) 0.90.
RMS_ROWS_FROM_N = 512


def ln_backward_kernels(k: Any, gy: Any, x: Any, gx: Any, grad_residual: Any = None,
                        stream: bool | None = None, rows: int | None = None
                        ) -> tuple[Any, Any]:
    """The (serial, parallel) LayerNorm backward kernels for 2-D rows: one per path
    (unit-stride rows, short ones, long ones, streaming stores, any stride), all giving
    the same bits. ``stream``: whether unit-stride rows take streaming stores (None:
    :func:`streams_gradient` of ``gx`` decides). ``rows``: the call's row count, if not
    ``x``'s (a stand-in of its row length and item size); a call of one block of rows
    splits columns over threads (:func:`_splits`)."""
    if not _unit_strides(gy, x, gx, grad_residual):
        return k.ln_gathered_backward_serial, k.ln_gathered_backward_parallel
    n = x.shape[1]
    rows = x.shape[0] if rows is None else rows
    stream = streams_gradient(gx) if stream is None else stream
    if stream:
        if n >= k.TILE_MIN_N:
            serial, parallel = (k.ln_stream_tiled_backward_serial,
                                k.ln_stream_tiled_backward_parallel)
        else:
            serial, parallel = k.ln_stream_backward_serial, k.ln_stream_backward_parallel
    elif n < k.SHORT_BACKWARD_N:
        serial, parallel = k.ln_short_backward_serial, k.ln_short_backward_parallel
    elif n >= TILE_FROM_N and rows * n * x.itemsize <= TILE_MAX_BYTES:
        serial, parallel = k.ln_tiled_backward_serial, k.ln_tiled_backward_parallel
    else:
        serial, parallel = k.ln_backward_serial, k.ln_backward_parallel
    if _splits(k, rows, n):
        return serial, k.ln_split_backward_parallel
    return serial, parallel


def rms_backward_kernels(k: Any, gy: Any, x: Any, gx: Any, grad_residual: Any = None,
                         stream: bool | None = None, rows: int | None = None
                         ) -> tuple[Any, Any]:
    """The (serial, parallel) RMSNorm backward kernels for 2-D rows (see
    :func:`ln_backward_kernels`; there is no short-row path, rows of at least
    ``RMS_ROWS_FROM_N`` run row by row)."""
    if not _unit_strides(gy, x, gx, grad_residual):
        return k.rms_gathered_backward_serial, k.rms_gathered_backward_parallel
    n = x.shape[1]
    if streams_gradient(gx) if stream is None else stream:
        serial, parallel = k.rms_stream_backward_serial, k.rms_stream_backward_parallel
    elif n >= RMS_ROWS_FROM_N:
        serial, parallel = k.rms_paired_backward_serial, k.rms_paired_backward_parallel
    else:
        serial, parallel = k.rms_backward_serial, k.rms_backward_parallel
    if _splits(k, x.shape[0] if rows is None else rows, n):
        return serial, k.rms_split_backward_parallel
    return serial, parallel


def _unit_columns(gy: Any, x: Any, gres: Any, has_res: bool,
                  gx: Any) -> tuple[Any, Any, Any, Any]:
    """The column backward's ``(gy, x, gres, gx)`` with unit-stride last axes (the
    kernel reads and writes them through raw views): copies of inputs of another
    stride, a new array for such a ``gx`` (the caller copies it back)."""
    def unit(a: Any) -> bool:
        return a.strides[2] == a.itemsize

    def readable(a: Any) -> Any:
        return a if unit(a) else np.ascontiguousarray(a)

    x = readable(x)
    gres = readable(gres) if has_res else x
    return readable(gy), x, gres, gx if unit(gx) else np.empty(gx.shape, gx.dtype)


def layer_norm_backward(gy3, x3, mean, rstd, weight, gx3, dtype, grad_residual=None):
    """LayerNorm backward into ``gx3`` (plus ``grad_residual``, a view like ``x3``, when
    given); returns ``(grad_weight, grad_bias)``."""
    k = load_kernels()
    gy = _as_kernel_array(gy3, dtype)
    x = _as_kernel_array(x3, dtype)
    gx = _as_kernel_array(gx3, dtype)
    gres, has_res = _grad_residual_arg(grad_residual, x, dtype)
    n = x3.shape[1]
    w = kernel_params(weight, None, n, mean.dtype)[0]
    if x.shape[2] == 1:
        partials = _grad_partials(-(-mean.shape[0] // GRAD_ROW_BLOCK), n, mean.dtype, 2)
        gy2, x2, gx2, gres2 = gy[:, :, 0], x[:, :, 0], gx[:, :, 0], gres[:, :, 0]
        serial, parallel = ln_backward_kernels(k, gy2, x2, gx2, gres2 if has_res else None)
        sums = _run(serial, parallel, x.size, LN_BACKWARD_WRITES, gy2, x2, mean, rstd, w,
                    gx2, partials, GRAD_ROW_BLOCK, gres2, has_res)
    else:
        partials = _grad_partials(_col_blocks(x3), n, mean.dtype, 2)
        gy, x, gres, gxk = _unit_columns(gy, x, gres, has_res, gx)
        sums = _run(k.backward_cols_serial, k.backward_cols_parallel, x.size,
                    LN_BACKWARD_WRITES, gy, x, mean, rstd, w, gxk, partials, False, gres,
                    has_res)
        if gxk is not gx:
            gx[...] = gxk
    # The kernels sum the partials in place and return a view of them: copy the sums
    # out so that the gradients do not keep the (blocks x n) partials alive.
    return sums[0].copy(), sums[1].copy()


def rms_norm_backward(gy3, x3, rstd, weight, gx3, dtype, grad_residual=None):
    """RMSNorm backward into ``gx3`` (plus ``grad_residual`` when given); returns
    ``grad_weight``."""
    k = load_kernels()
    gy = _as_kernel_array(gy3, dtype)
    x = _as_kernel_array(x3, dtype)
    gx = _as_kernel_array(gx3, dtype)
    gres, has_res = _grad_residual_arg(grad_residual, x, dtype)
    n = x3.shape[1]
    w = kernel_params(weight, None, n, rstd.dtype)[0]
    if x.shape[2] == 1:
        partials = _grad_partials(-(-rstd.shape[0] // GRAD_ROW_BLOCK), n, rstd.dtype, 1)
        gy2, x2, gx2, gres2 = gy[:, :, 0], x[:, :, 0], gx[:, :, 0], gres[:, :, 0]
        serial, parallel = rms_backward_kernels(k, gy2, x2, gx2, gres2 if has_res else None)
        sums = _run(serial, parallel, x.size, RMS_BACKWARD_WRITES, gy2, x2, rstd, w, gx2,
                    partials, GRAD_ROW_BLOCK, gres2, has_res)
    else:
        partials = _grad_partials(_col_blocks(x3), n, rstd.dtype, 1)
        gy, x, gres, gxk = _unit_columns(gy, x, gres, has_res, gx)
        sums = _run(k.backward_cols_serial, k.backward_cols_parallel, x.size,
                    LN_BACKWARD_WRITES, gy, x, rstd, rstd, w, gxk, partials, True, gres,
                    has_res)
        if gxk is not gx:
            gx[...] = gxk
    return sums[0].copy()  # out of the partials, as above


#: Positions of the arrays the fused add-and-normalize kernels write.
ADD_LN_WRITES = (5, 6, 7, 8)  # h, y, mean, rstd
ADD_RMS_WRITES = (4, 5, 6)  # h, y, rstd


def fused_add_streams(x: Any, res: Any, y: Any) -> bool:
    """Whether the fused add-and-normalize of ``x`` and ``res`` into ``y`` should write
    ``y`` with streaming stores (its streaming entry kernels)."""
    # y in place of either input is in the cache already (see use_streaming_stores).
    return use_streaming_stores(x, y) and not np.may_share_memory(res, y)


def _add_arrays(x3, r3, h3, y3, dtypes):
    x_name, r_name, h_name = dtypes
    return (_as_kernel_array(x3[:, :, 0], x_name), _as_kernel_array(r3[:, :, 0], r_name),
            _as_kernel_array(h3[:, :, 0], h_name), _as_kernel_array(y3[:, :, 0], x_name))


def _all_done(pending: Any) -> bool:
    # A serial kernel's count of stopped blocks, or a parallel one's (stop, end) rows of
    # its blocks that stopped (None if none did).
    return pending is None or (type(pending) is int and pending == 0)


def _stopped_ranges(pending: Any, rows: int) -> Any:
    """(stop, end) pairs to finish: a parallel kernel's own, or all rows of a serial
    call whose blocks stopped (it reports only how many; its ``h`` is complete)."""
    return np.array([[0, rows]], dtype=np.int64) if type(pending) is int else pending


def complete_add_layer_norm_rows(pending: Any, args: tuple[Any, ...]) -> None:
    """Finish a fused add-and-LayerNorm kernel's call (``args`` as the kernel took them:
    ``x, res, w, b, eps, h, y, mean, rstd, tab, nt``) that returned ``pending`` (a
    serial kernel's count of stopped blocks, a parallel one's (stop, end) rows of each
    block that stopped).

    Blocks stopped before a finite row whose squares overflow or underflow: their ``h``
    is complete, and the rest of each such block is normalized from it by the gathered
    kernel, which rescales (see :func:`_complete`). Nothing to do if every block is
    done.
    """
    if _all_done(pending):
        return
    _x, _res, w, b, e, h, y, mean, rstd, tab, _nt = args
    _complete(_stopped_ranges(pending, h.shape[0]),
              load_kernels().ln_gathered_forward_serial, LN_FORWARD_WRITES,
              LN_FORWARD_ROWS, (h, w, b, e, y, mean, rstd, tab, False))


def complete_add_rms_norm_rows(pending: Any, args: tuple[Any, ...]) -> None:
    """:func:`complete_add_layer_norm_rows` for the fused add-and-RMSNorm kernels
    (``args``: ``x, res, w, eps, h, y, rstd, nt``)."""
    if _all_done(pending):
        return
    _x, _res, w, e, h, y, rstd, _nt = args
    _complete(_stopped_ranges(pending, h.shape[0]),
              load_kernels().rms_gathered_forward_serial, RMS_FORWARD_WRITES,
              RMS_FORWARD_ROWS, (h, w, e, y, rstd, False))


def add_layer_norm_forward(x3, r3, weight, bias, eps, h3, y3, mean, rstd, dtypes) -> None:
    """``h3 = x3 + r3`` and the LayerNorm of ``h3`` into ``y3``, in one pass (:mod:`.fused`)."""
    k = load_kernels()
    x, r, h, y = _add_arrays(x3, r3, h3, y3, dtypes)
    e = _acc_scalar(eps, dtypes[2])
    w, b = kernel_params(weight, bias, x.shape[1], mean.dtype)
    tab = k.merge_table(x.shape[1], mean.dtype)
    nt = fused_add_streams(x, r, y)
    serial, parallel = add_ln_kernels(k, x.shape[1], nt, param_bytes(mean.dtype))
    args = (x, r, w, b, e, h, y, mean, rstd, tab, nt)
    complete_add_layer_norm_rows(_run(serial, parallel, x.size, ADD_LN_WRITES, *args), args)


def add_rms_norm_forward(x3, r3, weight, eps, h3, y3, rstd, dtypes) -> None:
    """``h3 = x3 + r3`` and the RMSNorm of ``h3`` into ``y3``, in one pass (:mod:`.fused`)."""
    k = load_kernels()
    x, r, h, y = _add_arrays(x3, r3, h3, y3, dtypes)
    e = _acc_scalar(eps, dtypes[2])
    w = kernel_params(weight, None, x.shape[1], rstd.dtype)[0]
    nt = fused_add_streams(x, r, y)
    serial, parallel = add_rms_kernels(k, x.shape[1], nt, param_bytes(rstd.dtype))
    args = (x, r, w, e, h, y, rstd, nt)
    complete_add_rms_norm_rows(_run(serial, parallel, x.size, ADD_RMS_WRITES, *args), args)


LN_QUANT_WRITES = (5, 6, 7, 8, 13)  # h, q, mean, rstd, scale
RMS_QUANT_WRITES = (4, 5, 6, 10)  # h, q, rstd, scale
#: Arrays written by the kernels that redo a quantized call with overflowing rows.
LN_QUANT_RESCUED_WRITES = (4, 5, 6, 11)  # q, mean, rstd, scale
RMS_QUANT_RESCUED_WRITES = (3, 4, 8)  # q, rstd, scale

_NO_ROWS = np.empty(0, dtype=np.float32)


def quantized_kernels(k: Any, n: int, rms: bool) -> tuple[Any, Any]:
    """The serial and parallel quantizing kernels for rows of ``n`` elements (``k``: the
    kernels module)."""
    long_rows = n > k.PIPELINED_ROW_ELEMENTS
    weight_bytes = n * param_bytes(np.float32)  # float32 parameters
    if rms:
        if weight_bytes >= k.TILED_MIN_BYTES:
            return k.rms_tiled_quant_forward_serial, k.rms_tiled_quant_forward_parallel
        if long_rows:
            return k.rms_long_quant_forward_serial, k.rms_long_quant_forward_parallel
        return k.rms_quant_forward_serial, k.rms_quant_forward_parallel
    if n <= k.SHORT_ROW_MAX:
        return k.ln_short_quant_forward_serial, k.ln_short_quant_forward_parallel
    if weight_bytes >= k.LN_TILED_MIN_BYTES:
        return k.ln_tiled_quant_forward_serial, k.ln_tiled_quant_forward_parallel
    if long_rows:
        return k.ln_long_quant_forward_serial, k.ln_long_quant_forward_parallel
    return k.ln_quant_forward_serial, k.ln_quant_forward_parallel


def complete_quantized_rows(stopped: int, args: tuple[Any, ...], rms: bool) -> None:
    """Finish a quantizing kernel's call (``args`` as the kernel took them) whose
    ``stopped`` blocks (its result) met a finite row whose squares overflow or
    underflow: the call is redone by the rescuing kernel, from ``h`` with a residual
    (complete by then), else from ``x``. Nothing to do if no block stopped."""
    if not stopped:
        return
    k = load_kernels()
    if rms:
        x, _res, w, e, h, q, rstd, *tail = args
        entry.call(k.rms_quant_rescued_serial, RMS_QUANT_RESCUED_WRITES,
                   x if h is None else h, w, e, q, rstd, *tail)
    else:
        x, _res, w, b, e, h, q, mean, rstd, *tail = args
        entry.call(k.ln_quant_rescued_serial, LN_QUANT_RESCUED_WRITES,
                   x if h is None else h, w, b, e, q, mean, rstd, *tail)


def quantized_forward(x3, r3, weight, bias, eps, h3, q3, mean, rstd, fmt, inv_rows,
                      scale_out, dtypes) -> None:
    """The norm of ``x3`` (of ``h3 = x3 + r3`` with a residual ``r3``) quantized into ``q3``.

    ``fmt`` is ``"int8"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"``; ``mean`` None selects
    RMSNorm. A static scale comes as ``inv_rows`` (``1 / scale`` per row, float32),
    otherwise (``inv_rows`` None) each row's scale goes to ``scale_out``. ``dtypes`` are
    the names of x's, the residual's and h's dtypes (the last two unused without a
    residual). Rows of unit stride; the accumulation dtype must be float32.
    """
    k = load_kernels()
    x_name, r_name, h_name = dtypes
    x = _as_kernel_array(x3[:, :, 0], x_name)
    q = q3[:, :, 0].view(np.uint8)
    e = _acc_scalar(eps, x_name)
    dynamic = inv_rows is None
    inv = _NO_ROWS if dynamic else inv_rows
    w, b = kernel_params(weight, bias, x.shape[1], rstd.dtype)
    tail = (k.FORMAT_TAGS[fmt], k.DYNAMIC if dynamic else k.STATIC, inv, scale_out)
    res = None if r3 is None else _as_kernel_array(r3[:, :, 0], r_name)
    h = None if r3 is None else _as_kernel_array(h3[:, :, 0], h_name)
    rms = mean is None
    serial, parallel = quantized_kernels(k, x.shape[1], rms)
    if rms:
        args = (x, res, w, e, h, q, rstd, *tail)
    else:
        args = (x, res, w, b, e, h, q, mean, rstd, k.merge_table(x.shape[1], rstd.dtype),
                *tail)
    stopped = _run(serial, parallel, x.size, RMS_QUANT_WRITES if rms else LN_QUANT_WRITES,
                   *args)
    complete_quantized_rows(stopped, args, rms)
