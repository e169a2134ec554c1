"""The implementations ``python -m layernorm bench`` times, one factory per library.

Every factory takes a :class:`Case` (inputs already made) and returns a list of
:class:`Impl`: a zero-argument callable plus the words that say what it measures.
Peers are only built when their library is installed; their imports happen here,
inside the factories, never at ``import layernorm``.

Data regimes (where the inputs are when a call starts; see :func:`regime_cases`):

``cache``
    One working set of at most ``CACHE_BYTES`` (x, y, the parameters, and for the
    backward grad_y, grad_x and the statistics), reused call after call: its rows stay
    in L2/L3, so what is measured is the arithmetic. Grid shapes that do not fit keep
    their row length and lose rows.
``memory``
    The shape as given, in as many copies as make the inputs and outputs of the
    rotation exceed ``MEMORY_BYTES``, called in turn (:func:`.timing.rotating`), so
    every call reads inputs evicted from the caches: what is measured is DRAM bandwidth.

Output regimes (how the output memory is obtained; they change the numbers a lot for
outputs of tens of MiB, where a fresh allocation is mapped and page-faulted):

``prealloc``
    Writes into memory allocated once before timing (``out=``, ``np.copyto``).
``fresh``
    A new output every call, with the process's allocator as it comes.
``heap reuse``
    A new output every call, with glibc malloc told never to return memory to the OS
    (no ``mmap`` for large blocks, no trimming), so a freed output is reused without
    page faults. Applied process-wide by :func:`enable_heap_reuse`, after every
    ``fresh`` measurement of the run.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .machine import installed
from .settings import DTYPES

EPS = 1e-5

#: Kinds of implementation: the copy baselines, our own paths, and other libraries.
COPY, OURS, PEER = "copy", "layernorm", "peer"
#: Our Numba path with a fresh output and into ``out=``: the denominators of speed-ups.
OURS_FRESH, OURS_OUT = "layernorm numba", "layernorm numba out="
#: A fusion's backward without ``grad_residual`` (what the fused one is reported against).
OURS_NO_RESIDUAL = "layernorm numba, no grad_residual"
#: Table titles of the operations.
TITLES = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm",
          "add_layer_norm": "add + LayerNorm", "add_rms_norm": "add + RMSNorm"}
#: Output regimes: how an implementation gets its output memory (see above).
PREALLOC, FRESH, HEAP_REUSE = "prealloc", "fresh", "heap reuse"
#: Data regimes: where the inputs are when a call starts (see above).
CACHE, MEMORY = "cache", "memory"
#: The cache regime's whole working set, in bytes (fits in the L2 of recent server
#: cores, and well within any last-level cache).
CACHE_BYTES = 1_500_000
#: The memory regime rotates over copies of the inputs until they and their outputs
#: exceed this (above the last-level cache of any current CPU socket).
MEMORY_BYTES = 1 << 27
#: At most this many copies: a shape that would need more (a single row) is too small
#: to measure from DRAM and is only shown in the cache regime.
MEMORY_MAX_SETS = 64


@dataclass
class Case:
    """One cell of the grid: an operation, a direction, a dtype and a shape, with inputs."""

    op: str
    direction: str
    dtype: str
    shape: tuple[int, int]
    x: Any = None
    weight: Any = None
    bias: Any = None
    grad_y: Any = None
    residual: Any = None
    #: A fusion's backward: the gradient reaching h from the residual stream.
    grad_residual: Any = None
    mean: Any = None
    rstd: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def itemsize(self) -> int:
        return self.x.dtype.itemsize

    @property
    def array_bytes(self) -> int:
        """Bytes of one ``(N, D)`` array of the case's dtype."""
        return self.shape[0] * self.shape[1] * self.itemsize

    @property
    def moved_bytes(self) -> int:
        """The floor of memory traffic: forward reads x and writes y (a fusion also reads
        the residual and writes h); backward reads grad_y and x and writes grad_x (a
        fusion's also reads grad_residual); statistics and parameters are negligible."""
        return _arrays(self.op, self.direction) * self.array_bytes

    @property
    def working_set_bytes(self) -> int:
        """Bytes one call touches: the arrays it reads and writes (``moved_bytes``), the
        parameters and the statistics."""
        extra = sum(a.nbytes for a in (self.weight, self.bias, self.mean, self.rstd)
                    if a is not None)
        if self.mean is None and self.rstd is None:  # forward: it writes them
            acc = acc_dtype(self.dtype).itemsize
            extra += (2 if has_bias(self.op) else 1) * self.shape[0] * acc
        return self.moved_bytes + extra

    @property
    def title(self) -> str:
        return f"{TITLES[self.op]} {self.direction} {self.dtype}"


def is_add(op: str) -> bool:
    """Whether ``op`` is a fusion (``add_layer_norm``, ``add_rms_norm``)."""
    return op.startswith("add_")


def has_bias(op: str) -> bool:
    """Whether ``op`` is a LayerNorm (which has a bias and a mean)."""
    return op.endswith("layer_norm")


def _arrays(op: str, direction: str) -> int:
    if direction == "backward":
        return 4 if is_add(op) else 3
    return 4 if is_add(op) else 2


def floor_arrays(op: str, direction: str) -> int:
    """Arrays of x's size the cell's bandwidth floor (its best preallocated baseline)
    moves: the operation's own traffic, except for a fusion's backward (4 arrays: no
    NumPy call reads three and writes one), whose floor is the backward's three-array
    ``grad_y + x``, compared by bandwidth.

    Examples
    --------
    >>> floor_arrays("add_layer_norm", "forward"), floor_arrays("add_rms_norm", "backward")
    (4, 3)
    """
    return 3 if direction == "backward" else _arrays(op, direction)


def quantized_dtype(fmt: str) -> Any:
    """The NumPy dtype of ``quantize=fmt`` output (``ml_dtypes`` for the float8 formats).

    Examples
    --------
    >>> quantized_dtype("int8")
    dtype('int8')
    """
    if fmt == "int8":
        return np.dtype(np.int8)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, fmt))


#: The static scale the ``scale=`` quantized calls are given: ``4 / qmax`` of int8 (the
#: randn rows' outputs within about 4 standard deviations are not saturated).
STATIC_SCALE = 4.0 / 127.0


@dataclass
class Impl:
    """A timed callable and what it is."""

    name: str
    kind: str
    output: str
    fn: Callable[[], Any]
    note: str = ""
    #: Arrays of x's size it reads and writes in all (baselines only; 2 for a copy).
    arrays: int = 2
    #: Bytes it reads and writes, where not the case's (``Case.moved_bytes``): 8-bit
    #: outputs, a fusion's backward without its residual gradient.
    moved: int | None = None
    #: The implementation of the same cell whose time this one's is reported against
    #: (``vs_base`` in the records: a quantized call against the plain one into
    #: ``out=``, a backward with ``grad_residual`` against the one without).
    relative_to: str = ""


def numpy_dtype(name: str) -> Any:
    """NumPy dtype for a dtype name (bfloat16 through ml_dtypes).

    Examples
    --------
    >>> numpy_dtype("float32")
    dtype('float32')
    """
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    return np.dtype(name)


def acc_dtype(name: str) -> Any:
    """Accumulation dtype of the library's policy: float64 for float64, else float32."""
    return np.dtype(np.float64 if name == "float64" else np.float32)


def make_case(op: str, direction: str, dtype: str, shape: tuple[int, int],
              seed: int = 0) -> Case:
    """Seeded inputs for one grid cell (``randn`` rows, weight near 1, small bias)."""
    import layernorm as ln

    rng = np.random.default_rng(seed)
    n, d = shape
    dt = numpy_dtype(dtype)
    x = rng.standard_normal((n, d), dtype=np.float32).astype(dt)
    weight = (1.0 + 0.1 * rng.standard_normal(d)).astype(dt)
    bias = (0.1 * rng.standard_normal(d)).astype(dt) if has_bias(op) else None
    case = Case(op, direction, dtype, (n, d), x=x, weight=weight, bias=bias)
    if is_add(op) and direction == "forward":
        case.residual = rng.standard_normal((n, d), dtype=np.float32).astype(dt)
    if direction == "backward":
        # A fusion's backward is its norm's (x standing for h) with grad_residual.
        case.grad_y = rng.standard_normal((n, d), dtype=np.float32).astype(dt)
        if is_add(op):
            case.grad_residual = rng.standard_normal((n, d), dtype=np.float32).astype(dt)
        if has_bias(op):
            _, case.mean, case.rstd = ln.layer_norm(x, weight=weight, bias=bias, eps=EPS,
                                                    return_stats=True)
        else:
            _, case.rstd = ln.rms_norm(x, weight=weight, eps=EPS, return_stats=True)
    return case


def cache_shape(op: str, direction: str, dtype: str, shape: tuple[int, int]
                ) -> tuple[int, int] | None:
    """``shape`` with as many of its rows as fit in ``CACHE_BYTES`` (all of the
    working set: see :attr:`Case.working_set_bytes`); None if not even one row fits.

    Examples
    --------
    >>> cache_shape("layer_norm", "forward", "float32", (4096, 768))
    (242, 768)
    >>> cache_shape("layer_norm", "forward", "float32", (1, 768))
    (1, 768)
    """
    n, d = shape
    item = numpy_dtype(dtype).itemsize
    acc = acc_dtype(dtype).itemsize
    arrays = _arrays(op, direction)
    stats = 2 if has_bias(op) else 1
    params = (2 if has_bias(op) else 1) * d * item
    rows = (CACHE_BYTES - params) // (arrays * d * item + stats * acc)
    return (min(n, rows), d) if rows >= 1 else None


def replica(case: Case) -> Case:
    """The same case with every array copied to new memory (same values)."""
    def fresh(a: Any) -> Any:
        return None if a is None else a.copy()

    return Case(case.op, case.direction, case.dtype, case.shape, x=fresh(case.x),
                weight=fresh(case.weight), bias=fresh(case.bias),
                grad_y=fresh(case.grad_y), residual=fresh(case.residual),
                grad_residual=fresh(case.grad_residual),
                mean=fresh(case.mean), rstd=fresh(case.rstd), extras=dict(case.extras))


def regime_cases(op: str, direction: str, dtype: str, shape: tuple[int, int],
                 regime: str) -> list[Case]:
    """The input sets one grid cell is timed on in a data regime: one set (of a shape
    cut to fit the cache, see :func:`cache_shape`) for ``cache``; enough copies of the
    shape's inputs to exceed ``MEMORY_BYTES`` for ``memory``. An empty list when the
    shape cannot be measured in that regime.
    """
    if regime == CACHE:
        small = cache_shape(op, direction, dtype, shape)
        if small is None:
            return []
        case = make_case(op, direction, dtype, small)
        case.extras.update(regime=CACHE, sets=1)
        return [case]
    if regime != MEMORY:
        raise ValueError(f"regime must be {CACHE!r} or {MEMORY!r}; got {regime!r}")
    case = make_case(op, direction, dtype, shape)
    sets = -(-MEMORY_BYTES // case.working_set_bytes)
    if sets > MEMORY_MAX_SETS:
        return []
    case.extras.update(regime=MEMORY, sets=sets)
    return [case] + [replica(case) for _ in range(sets - 1)]


# --------------------------------------------------------------------------- copies


def copy_impls(case: Case) -> list[Impl]:
    """Streaming baselines over the case's arrays: the bandwidth denominators.

    A forward moves the bytes of a copy of ``x``. A backward reads two arrays and writes
    a third, so its baselines are ``grad_y + x`` into a preallocated array: exactly its
    traffic and working set (a copy of one ``x`` may fit in a cache the three arrays do
    not). The copies are timed for backward cases too, for reference. A fusion reads x
    and the residual and writes h and y: its baselines copy x into one preallocated
    array and the residual into another, timed as one call.
    """
    src = case.x
    dst = np.empty_like(src)
    impls = [
        Impl("copy np.copyto", COPY, PREALLOC, lambda: np.copyto(dst, src),
             "single-threaded"),
        Impl("copy np.copy", COPY, FRESH, lambda: np.copy(src),
             "single-threaded, allocates its output like a fresh-output call"),
    ]
    torch_ok = installed("torch")
    if torch_ok:
        ts, td = _to_torch(src), _to_torch(dst)
        impls.append(Impl("copy torch copy_", COPY, PREALLOC, lambda: td.copy_(ts),
                          "uses torch's threads"))
    if is_add(case.op) and case.direction == "forward":
        res = case.residual
        dst2 = np.empty_like(res)

        def copies() -> None:
            np.copyto(dst, src)
            np.copyto(dst2, res)

        impls.append(Impl("copy 2x np.copyto", COPY, PREALLOC, copies,
                          "x and residual, each into its own array; single-threaded", 4))
        if torch_ok:
            tr, td2 = _to_torch(res), _to_torch(dst2)

            def torch_copies() -> None:
                td.copy_(ts)
                td2.copy_(tr)

            impls.append(Impl("copy 2x torch copy_", COPY, PREALLOC, torch_copies,
                              "uses torch's threads", 4))
    if case.direction == "backward":
        gy = case.grad_y
        impls.append(Impl("stream np.add", COPY, PREALLOC,
                          lambda: np.add(gy, src, out=dst), "grad_y + x into out=", 3))
        if torch_ok:
            tg = _to_torch(gy)
            impls.append(Impl("stream torch add", COPY, PREALLOC,
                              lambda: torch_add(tg, ts, td), "uses torch's threads", 3))
    return impls


def torch_add(a: Any, b: Any, out: Any) -> Any:
    """``torch.add(a, b, out=out)`` (torch imported by the caller's tensors already)."""
    import torch

    return torch.add(a, b, out=out)


# --------------------------------------------------------------------------- ours


def ours_impls(case: Case, output: str = FRESH) -> list[Impl]:
    """Our Numba path (into ``out=`` and with a fresh output) and our generic path; the
    quantized forward into ``out=`` in each format of ``case.extras["quantize"]``; a
    fusion's backward with and without ``grad_residual``."""
    import layernorm as ln

    x, w, b, eps = case.x, case.weight, case.bias, EPS
    impls: list[Impl] = []
    quantized = quantized_impls(case) if case.direction == "forward" else []
    if is_add(case.op) and case.direction == "backward":
        return fusion_backward_impls(case, output)
    if is_add(case.op):
        res, y, h = case.residual, np.empty_like(x), np.empty_like(case.residual)
        fn = ln.add_layer_norm if case.op == "add_layer_norm" else ln.add_rms_norm
        kw = {"bias": b} if has_bias(case.op) else {}
        return [
            Impl(OURS_OUT, OURS, PREALLOC,
                 lambda: fn(x, res, weight=w, eps=eps, out=y, residual_out=h, **kw),
                 "one pass: h into residual_out=, y into out="),
            Impl(OURS_FRESH, OURS, output, lambda: fn(x, res, weight=w, eps=eps, **kw),
                 "one pass: fresh h and y"),
            *quantized,
        ]
    if case.direction == "forward":
        out = np.empty_like(x)
        if case.op == "layer_norm":
            impls.append(Impl(OURS_OUT, OURS, PREALLOC,
                              lambda: ln.layer_norm(x, weight=w, bias=b, eps=eps, out=out)))
            impls.append(Impl(OURS_FRESH, OURS, output,
                              lambda: ln.layer_norm(x, weight=w, bias=b, eps=eps)))
            if output == FRESH:
                impls.append(Impl(
                    "layernorm array_api", OURS, output,
                    lambda: ln.layer_norm(x, weight=w, bias=b, eps=eps, backend="array_api"),
                    "generic path on NumPy"))
        else:
            impls.append(Impl(OURS_OUT, OURS, PREALLOC,
                              lambda: ln.rms_norm(x, weight=w, eps=eps, out=out)))
            impls.append(Impl(OURS_FRESH, OURS, output,
                              lambda: ln.rms_norm(x, weight=w, eps=eps)))
            if output == FRESH:
                impls.append(Impl("layernorm array_api", OURS, output,
                                  lambda: ln.rms_norm(x, weight=w, eps=eps, backend="array_api"),
                                  "generic path on NumPy"))
        return impls + quantized

    gy, mean, rstd = case.grad_y, case.mean, case.rstd
    if case.op == "layer_norm":
        impls.append(Impl("layernorm numba", OURS, output,
                          lambda: ln.layer_norm_backward(gy, x, mean, rstd, w),
                          "grad_x, grad_weight, grad_bias"))
        if output == FRESH:
            impls.append(Impl(
                "layernorm array_api", OURS, output,
                lambda: ln.layer_norm_backward(gy, x, mean, rstd, w, backend="array_api"),
                "generic path on NumPy"))
    else:
        impls.append(Impl("layernorm numba", OURS, output,
                          lambda: ln.rms_norm_backward(gy, x, rstd, w),
                          "grad_x, grad_weight"))
        if output == FRESH:
            impls.append(Impl(
                "layernorm array_api", OURS, output,
                lambda: ln.rms_norm_backward(gy, x, rstd, w, backend="array_api"),
                "generic path on NumPy"))
    return impls


# --------------------------------------------------------------------------- NumPy


def quantized_impls(case: Case) -> list[Impl]:
    """The forward of ``case`` (a norm, or a fusion with ``h`` into ``residual_out=``)
    quantized into a preallocated 8-bit ``out=``, in each format of
    ``case.extras["quantize"]``: with per-row scales (``scale=None``) and with a static
    scale (:data:`STATIC_SCALE`), each reported against the plain call into ``out=``."""
    import layernorm as ln

    formats = case.extras.get("quantize", ())
    if not formats:
        return []
    x, w, b, eps = case.x, case.weight, case.bias, EPS
    kw: dict[str, Any] = {"weight": w, "eps": eps}
    if has_bias(case.op):
        kw["bias"] = b
    if is_add(case.op):
        res, h = case.residual, np.empty_like(case.residual)
        fn = ln.add_layer_norm if case.op == "add_layer_norm" else ln.add_rms_norm
        args: tuple[Any, ...] = (x, res)
        kw["residual_out"] = h
    else:
        fn = ln.layer_norm if case.op == "layer_norm" else ln.rms_norm
        args = (x,)
    # The 8-bit codes replace y's bytes; the rest of the traffic is the case's.
    moved = case.moved_bytes - case.array_bytes + x.size
    impls = []
    for fmt in formats:
        q = np.empty(x.shape, dtype=quantized_dtype(fmt))
        for scale, words in ((None, "per-row scales"), (STATIC_SCALE, "a given scale")):
            name = f"{OURS_OUT} {fmt}" + (" scale=" if scale is not None else "")
            impls.append(Impl(
                name, OURS, PREALLOC,
                lambda fmt=fmt, q=q, scale=scale: fn(*args, quantize=fmt, scale=scale,
                                                     out=q, **kw),
                f"{fmt} codes into out=, {words}; vs the plain call into out=",
                moved=moved, relative_to=OURS_OUT))
    return impls


def _norm_backward(case: Case) -> Callable[..., Any]:
    """Our backward of ``case``'s norm (a fusion's: x stands for h) on its inputs, a
    callable taking the keyword arguments to add (``grad_residual=``)."""
    import layernorm as ln

    gy, x, w, mean, rstd = case.grad_y, case.x, case.weight, case.mean, case.rstd
    if has_bias(case.op):
        return lambda **kw: ln.layer_norm_backward(gy, x, mean, rstd, w, **kw)
    return lambda **kw: ln.rms_norm_backward(gy, x, rstd, w, **kw)


def fusion_backward_impls(case: Case, output: str = FRESH) -> list[Impl]:
    """A fusion's backward: its norm's backward with ``grad_residual`` (grad_x +
    grad_residual in one pass), reported against the same backward without it."""
    backward, gr = _norm_backward(case), case.grad_residual

    def plain() -> Any:
        return backward()

    def fused() -> Any:
        return backward(grad_residual=gr)

    return [
        Impl(OURS_FRESH, OURS, output, fused,
             "grad_x + grad_residual in one pass; vs the backward without it",
             relative_to=OURS_NO_RESIDUAL),
        Impl(OURS_NO_RESIDUAL, OURS, output, plain, "grad_x alone",
             moved=3 * case.array_bytes),
    ]


def numpy_layer_norm(x: Any, w: Any, b: Any, eps: float) -> Any:
    """The composite a NumPy user would write (accumulating in float32/float64)."""
    xa = x.astype(acc_dtype(x.dtype.name), copy=False)
    mean = xa.mean(axis=-1, keepdims=True)
    xc = xa - mean
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    y = xc / np.sqrt(var + eps) * w + b
    return y.astype(x.dtype, copy=False)


def numpy_rms_norm(x: Any, w: Any, eps: float) -> Any:
    """RMSNorm composite in NumPy."""
    xa = x.astype(acc_dtype(x.dtype.name), copy=False)
    ms = np.mean(xa * xa, axis=-1, keepdims=True)
    return (xa / np.sqrt(ms + eps) * w).astype(x.dtype, copy=False)


def numpy_layer_norm_backward(gy: Any, x: Any, mean: Any, rstd: Any, w: Any) -> tuple:
    """LayerNorm backward composite in NumPy."""
    acc = acc_dtype(x.dtype.name)
    xhat = (x.astype(acc, copy=False) - mean) * rstd
    gya = gy.astype(acc, copy=False)
    g = gya * w
    gx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return gx.astype(x.dtype, copy=False), (gya * xhat).sum(0), gya.sum(0)


def numpy_rms_norm_backward(gy: Any, x: Any, rstd: Any, w: Any) -> tuple:
    """RMSNorm backward composite in NumPy."""
    acc = acc_dtype(x.dtype.name)
    xhat = x.astype(acc, copy=False) * rstd
    gya = gy.astype(acc, copy=False)
    g = gya * w
    gx = rstd * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    return gx.astype(x.dtype, copy=False), (gya * xhat).sum(0)


def unfused_impls(case: Case) -> list[Impl]:
    """A fusion unfused, as a caller would write it: NumPy's add into a preallocated h,
    then our norm into a preallocated y; and ``h = x + residual`` then our norm, fresh."""
    import layernorm as ln

    x, res, w, b, eps = case.x, case.residual, case.weight, case.bias, EPS
    norm = ln.layer_norm if case.op == "add_layer_norm" else ln.rms_norm
    kw = {"bias": b} if has_bias(case.op) else {}
    h, y = np.empty_like(res), np.empty_like(x)

    def prealloc() -> Any:
        np.add(x, res, out=h)
        return norm(h, weight=w, eps=eps, out=y, **kw)

    def fresh() -> Any:
        return norm(x + res, weight=w, eps=eps, **kw)

    return [Impl("unfused add, norm out=", PEER, PREALLOC, prealloc,
                 "np.add(x, r, out=h); norm(h, out=y)"),
            Impl("unfused add, norm", PEER, FRESH, fresh, "h = x + r; norm(h)")]


def unfused_backward_impls(case: Case) -> list[Impl]:
    """A fusion's backward unfused, as a caller would write it: our norm's backward, then
    ``grad_x + grad_residual`` with NumPy."""
    backward, gr = _norm_backward(case), case.grad_residual

    def unfused() -> Any:
        gx, *grads = backward()
        return gx + gr, *grads

    return [Impl("unfused backward, + g_res", PEER, FRESH, unfused,
                 "norm backward, then grad_x + grad_residual")]


def numpy_impls(case: Case) -> list[Impl]:
    """The NumPy composite reference (fresh temporaries, single-threaded)."""
    if is_add(case.op):
        if case.direction == "backward":
            return unfused_backward_impls(case)
        return unfused_impls(case)
    acc = acc_dtype(case.dtype)
    x = case.x
    w = case.weight.astype(acc)
    eps = EPS
    if case.direction == "forward":
        if case.op == "layer_norm":
            b = case.bias.astype(acc)
            fn = lambda: numpy_layer_norm(x, w, b, eps)  # noqa: E731
        else:
            fn = lambda: numpy_rms_norm(x, w, eps)  # noqa: E731
    else:
        gy, rstd = case.grad_y, case.rstd
        if case.op == "layer_norm":
            mean = case.mean
            fn = lambda: numpy_layer_norm_backward(gy, x, mean, rstd, w)  # noqa: E731
        else:
            fn = lambda: numpy_rms_norm_backward(gy, x, rstd, w)  # noqa: E731
    return [Impl("numpy composite", PEER, FRESH, fn, "single-threaded")]


# --------------------------------------------------------------------------- torch


def _to_torch(arr: Any) -> Any:
    import torch

    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def torch_impls(case: Case, output: str = FRESH) -> list[Impl]:
    """PyTorch's CPU ``F.layer_norm``/``F.rms_norm`` and their autograd backward."""
    if not installed("torch"):
        return []
    import torch
    import torch.nn.functional as F

    x, w = _to_torch(case.x), _to_torch(case.weight)
    b = None if case.bias is None else _to_torch(case.bias)
    shape = (case.shape[1],)
    eps = EPS
    label = "as it comes" if output == FRESH else output
    if is_add(case.op) and case.direction == "forward":
        tr = _to_torch(case.residual)
        if case.op == "add_layer_norm":
            def fn_add() -> Any:
                with torch.no_grad():
                    return F.layer_norm(x + tr, shape, w, b, eps)

            return [Impl("torch x + r, F.layer_norm", PEER, output, fn_add, label)]

        def fn_add_rms() -> Any:
            with torch.no_grad():
                return F.rms_norm(x + tr, shape, w, eps)

        return [Impl("torch x + r, F.rms_norm", PEER, output, fn_add_rms, label)]
    if case.direction == "forward":
        if case.op == "layer_norm":
            def fn() -> Any:
                with torch.no_grad():
                    return F.layer_norm(x, shape, w, b, eps)

            return [Impl("torch F.layer_norm", PEER, output, fn, label)]

        def fn_rms() -> Any:
            with torch.no_grad():
                return F.rms_norm(x, shape, w, eps)

        return [Impl("torch F.rms_norm", PEER, output, fn_rms, label)]

    # Backward as users get it: autograd over a graph built once, kept with retain_graph.
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    inputs: tuple[Any, ...]
    if has_bias(case.op):
        br = b.clone().requires_grad_(True)
        y = F.layer_norm(xr, shape, wr, br, eps)
        inputs = (xr, wr, br)
        name = "torch autograd layer_norm"
    else:
        y = F.rms_norm(xr, shape, wr, eps)
        inputs = (xr, wr)
        name = "torch autograd rms_norm"
    gy = _to_torch(case.grad_y)
    if is_add(case.op):
        # A fusion's: the gradient reaching h from the residual stream added after.
        gr = _to_torch(case.grad_residual)

        def fn_back_res() -> Any:
            gx, *rest = torch.autograd.grad(y, inputs, gy, retain_graph=True)
            return gx + gr, *rest

        return [Impl(f"{name} + g_res", PEER, output, fn_back_res,
                     f"{label}; graph built once; then grad_x + grad_residual")]

    def fn_back() -> Any:
        return torch.autograd.grad(y, inputs, gy, retain_graph=True)

    return [Impl(name, PEER, output, fn_back, f"{label}; graph built once")]


# --------------------------------------------------------------------------- JAX


def jax_impls(case: Case) -> list[Impl]:
    """A jitted JAX composite on the CPU (XLA picks its own threads)."""
    if not installed("jax") or is_add(case.op):
        return []
    import jax
    import jax.numpy as jnp

    acc = jnp.float64 if case.dtype == "float64" else jnp.float32
    if case.dtype == "float64" and not jax.config.read("jax_enable_x64"):
        return []
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(case.x, cpu)
    w = jax.device_put(case.weight, cpu)
    eps = EPS

    if case.direction == "forward":
        if case.op == "layer_norm":
            b = jax.device_put(case.bias, cpu)

            @jax.jit
            def f(x: Any, w: Any, b: Any) -> Any:
                xa = x.astype(acc)
                mean = xa.mean(-1, keepdims=True)
                var = jnp.mean((xa - mean) ** 2, -1, keepdims=True)
                return ((xa - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)

            fn = lambda: f(x, w, b).block_until_ready()  # noqa: E731
        else:
            @jax.jit
            def f(x: Any, w: Any) -> Any:
                xa = x.astype(acc)
                ms = jnp.mean(xa * xa, -1, keepdims=True)
                return (xa * jax.lax.rsqrt(ms + eps) * w).astype(x.dtype)

            fn = lambda: f(x, w).block_until_ready()  # noqa: E731
        return [Impl("jax jit", PEER, FRESH, fn, "XLA threads")]

    gy = jax.device_put(case.grad_y, cpu)
    rstd = jax.device_put(case.rstd, cpu)
    if case.op == "layer_norm":
        mean = jax.device_put(case.mean, cpu)

        @jax.jit
        def g(gy: Any, x: Any, mean: Any, rstd: Any, w: Any) -> Any:
            xhat = (x.astype(acc) - mean) * rstd
            gya = gy.astype(acc)
            gw = gya * w
            gx = rstd * (gw - gw.mean(-1, keepdims=True)
                         - xhat * (gw * xhat).mean(-1, keepdims=True))
            return gx.astype(x.dtype), (gya * xhat).sum(0), gya.sum(0)

        fn = lambda: jax.block_until_ready(g(gy, x, mean, rstd, w))  # noqa: E731
    else:
        @jax.jit
        def g(gy: Any, x: Any, rstd: Any, w: Any) -> Any:
            xhat = x.astype(acc) * rstd
            gya = gy.astype(acc)
            gw = gya * w
            gx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdims=True))
            return gx.astype(x.dtype), (gya * xhat).sum(0)

        fn = lambda: jax.block_until_ready(g(gy, x, rstd, w))  # noqa: E731
    return [Impl("jax jit", PEER, FRESH, fn, "XLA threads; composite backward")]


# --------------------------------------------------------------------------- ONNX Runtime


def onnxruntime_impls(case: Case) -> list[Impl]:
    """ONNX Runtime's ``LayerNormalization`` (opset 17), LayerNorm forward only."""
    if case.op != "layer_norm" or case.direction != "forward" or case.dtype not in (
            "float32", "float64", "float16"):
        return []
    if not (installed("onnxruntime") and installed("onnx")):
        return []
    import onnxruntime as ort
    from onnx import TensorProto, helper

    elem = {"float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE,
            "float16": TensorProto.FLOAT16}[case.dtype]
    n, d = case.shape
    node = helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], axis=-1,
                            epsilon=EPS)
    graph = helper.make_graph(
        [node], "ln",
        [helper.make_tensor_value_info("x", elem, [n, d]),
         helper.make_tensor_value_info("w", elem, [d]),
         helper.make_tensor_value_info("b", elem, [d])],
        [helper.make_tensor_value_info("y", elem, [n, d])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 9)
    opts = ort.SessionOptions()
    threads = case.extras.get("threads")
    if threads:
        opts.intra_op_num_threads = int(threads)
    # ONNX Runtime's idle workers spin by default and take the cores from whatever runs
    # next in the interleave (measured at 2 threads, (4096, 768): torch 0.67 -> 1.2-8 ms,
    # layernorm 0.5 -> 4 ms; ONNX Runtime's own time unchanged). Blocking workers keep
    # every implementation's time its own.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    feeds = {"x": case.x, "w": case.weight, "b": case.bias}
    return [Impl("onnxruntime", PEER, FRESH, lambda: sess.run(None, feeds),
                 "CPUExecutionProvider")]


# --------------------------------------------------------------------------- registry


def peer_impls(case: Case) -> list[Impl]:
    """Every installed peer for this case (regime ``fresh``)."""
    impls = numpy_impls(case)
    impls += torch_impls(case)
    for factory in (onnxruntime_impls, jax_impls):
        try:
            impls += factory(case)
        except Exception as exc:  # a broken optional install must not stop the run
            print(f"skipping {factory.__name__[:-6]}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
    return impls


def heap_reuse_available() -> bool:
    """Whether :func:`enable_heap_reuse` can work here (glibc on Linux)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def enable_heap_reuse() -> bool:
    """Make glibc malloc keep and reuse freed memory for the rest of the process.

    ``M_MMAP_MAX = 0`` serves every block from the heap instead of a fresh ``mmap``
    (which is page-faulted on first touch, on every call, for large outputs), and a
    huge ``M_TRIM_THRESHOLD`` stops the heap from being returned to the OS.
    Irreversible for the process; returns False where it is not available.
    """
    if not heap_reuse_available():
        return False
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_max = -1, -4
    ok = libc.mallopt(m_mmap_max, 0) == 1
    ok = ok and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1
    return bool(ok)
