"""torch adapter: tensors in, tensors out, through the engine on the tensor's device.

Routes (decided by :func:`layernorm._dispatch.route` from ``x.device``, or forced with
``backend=``):

* **CPU** -> the Numba kernels. The tensors are viewed as NumPy arrays zero-copy through
  DLPack (bfloat16, which NumPy's DLPack does not know, travels as int16 bits and is
  viewed as ``ml_dtypes.bfloat16``); fresh results come back zero-copy with
  :func:`torch.from_numpy`.
* **CUDA** -> the CuPy kernels, zero-copy through DLPack on torch's current stream and
  device (bfloat16 as uint16 bits, the dtype named by the request, as the backend
  interface in :mod:`layernorm._backends` allows). Without CuPy, CUDA tensors take the
  generic path below (still on the GPU, still differentiable, only slower).
* **Any other device** (``mps``, ``meta``, ...) and ``backend="array_api"`` -> the generic
  implementation written with torch's own array-API namespace; torch's autograd
  differentiates it directly.

Both native routes validate the tensors (:func:`layernorm._engine.request`) and run
:func:`layernorm._engine.forward` / :func:`~layernorm._engine.backward` on the views: one
driver for every library. A result that needs gradients (``x``, ``weight`` or ``bias``
requires grad and grad mode is on) is produced by a :class:`torch.autograd.Function`
whose backward runs our backward kernels (or, when a graph of the backward is asked
for, ``create_graph=True``, torch's autograd through the generic implementation, so
higher derivatives follow torch); the statistics returned by ``return_stats=True`` are
marked non-differentiable. Outputs written in place (``out=``, ``residual_out=``) have
their autograd version counter bumped, as torch's own in-place ops do.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import numpy as np
import torch
import torch.autograd.forward_ad as fwad

from .. import _engine, _fast, _fast_add, _fast_backward, _layout
from .._dispatch import Route, check_companions, given_array
from .._dtypes import accumulation_name, dtype_name
from .._validate import check_float_dtype, check_no_internal_overlap, check_out

_ACC_TORCH = {"float32": torch.float32, "float64": torch.float64}


# --------------------------------------------------------------------------- checks


def _check_inputs(x: Any, *, scale: Any = None, **others: Any) -> None:
    """Dense tensors of one library on one device; a supported dtype for ``x``; an array
    ``scale`` of x's library (any device: it is moved to x's)."""
    check_companions(x, "torch", scale=given_array(scale), **others)
    for name, arr in {"x": x, **others}.items():
        if arr is None:
            continue
        if arr.layout != torch.strided or arr.is_nested:
            kind = "nested" if arr.is_nested else str(arr.layout).replace("torch.", "")
            raise TypeError(f"{name} must be a dense (strided) tensor, got a {kind} tensor")
        if arr.device != x.device:
            raise TypeError(
                f"{name} is on device {arr.device} but x is on device {x.device}; "
                "pass tensors on one device"
            )
    # Fail with our wording (not a DLPack error) on dtypes NumPy/CuPy cannot view.
    check_float_dtype(x, "x")


def _wants_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors
    )


def _check_out(out: Any, *tensors: Any, name: str = "out") -> None:
    """No ``out=`` that torch's own ``out=`` ops refuse: an inference tensor outside
    inference mode, or a write autograd would need to see."""
    if out is None:
        return
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{name}= is an inference tensor, which cannot be written outside "
            "torch.inference_mode() (torch refuses such in-place updates too); call "
            f"under torch.inference_mode() or pass {name}.clone()"
        )
    if not torch.is_grad_enabled():
        return
    if out.requires_grad:
        raise RuntimeError(
            f"{name}= is a tensor that requires grad, which the kernels cannot overwrite "
            f"in place (torch refuses such in-place writes too); pass {name}.detach() or a "
            "tensor that does not require grad, or call under torch.no_grad()"
        )
    if _wants_grad(*tensors):
        raise RuntimeError(
            f"{name}= does not support automatic differentiation (an input requires grad); "
            f"call without {name}= or under torch.no_grad()"
        )


def _has_tangent(*tensors: Any) -> bool:
    """Whether forward-mode AD is active and one of ``tensors`` is a dual tensor.

    Cheap when no ``forward_ad.dual_level`` is open (a module-level counter)."""
    if getattr(fwad, "_current_level", 0) < 0:
        return False
    return any(t is not None and fwad.unpack_dual(t).tangent is not None for t in tensors)


#: ``torch._C._functorch.is_functorch_wrapped_tensor``, where this torch has it.
_IS_WRAPPED = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                      None)


#: ``torch._C._functorch.is_legacy_batchedtensor``: the batched gradients autograd hands
#: a node's backward under ``is_grads_batched=True`` (``jacobian(..., vectorize=True)``).
_IS_BATCHED = getattr(getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor", None)
#: ``torch._C._functorch.maybe_current_level``: the innermost active ``torch.func``
#: transform's level, None outside every transform (and where this torch has none).
_transform_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level",
                           lambda: None)
#: ``torch.compiler.is_compiling`` (False where this torch has none).
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def _transformed(*tensors: Any) -> bool:
    """Whether one of ``tensors`` is wrapped by a ``torch.func`` transform (``grad``,
    ``vmap``, ``jvp``, ...) or batched by autograd (``is_grads_batched``): such a wrapper
    has no data of its own to hand to a kernel."""
    for t in tensors:
        if t is not None and ((_IS_WRAPPED is not None and _IS_WRAPPED(t))
                              or (_IS_BATCHED is not None and _IS_BATCHED(t))):
            return True
    return False


def _tracing() -> bool:
    """Whether ``torch.jit.trace`` records this call: it would record the outputs that
    the kernels write through NumPy as constants (the trace then returns them for any
    input); torch's own operations on the generic path it records."""
    return torch._C._get_tracing_state() is not None


#: ``torch._C._get_dispatch_mode`` and the keys of torch's own recording dispatch modes:
#: the proxy mode of ``make_fx``, fake tensors (``torch.export``, ``make_fx`` with
#: ``tracing_mode="fake"``), functionalization. Other dispatch modes (``FlopCounterMode``,
#: selective activation checkpointing, ``allow_mutation_on_saved_tensors``) run the
#: operations they see, and the kernels with them: counting every mode sent such calls
#: to the generic implementation, whose different saved tensors broke a checkpoint's
#: recomputation and took 8x the time under selective checkpointing (found by a review).
_get_dispatch_mode = getattr(torch._C, "_get_dispatch_mode", None)
#: ``torch._C._len_torch_dispatch_stack``: how many dispatch modes are active, torch's
#: own included (a cheaper first test; 1 where this torch cannot tell).
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_KEYS = getattr(torch._C, "_TorchDispatchModeKey", None)
_RECORDING_MODES = tuple(getattr(_KEYS, name) for name in ("PROXY", "FAKE", "FUNCTIONAL")
                         if hasattr(_KEYS, name))


def _traced() -> bool:
    """Whether the call is recorded rather than run: ``torch.jit.trace``
    (:func:`_tracing`) or one of torch's recording dispatch modes
    (:data:`_RECORDING_MODES`: ``make_fx``, ``torch.export``). Such a recorder sees
    torch's own operations only: the outputs the kernels write through NumPy it would
    keep as constants (a traced graph then returns them for any input), and a fake
    tensor has no data to read."""
    if _get_dispatch_mode is not None and _dispatch_modes() > 0:
        for key in _RECORDING_MODES:
            if _get_dispatch_mode(key) is not None:
                return True
    return _tracing()


def _differentiable_route(route: Route, *tensors: Any) -> Route:
    """``route``, or the generic route where forward-mode AD needs tangents, a
    ``torch.func`` transform wraps an input or the call is recorded (:func:`_traced`):
    the kernels have no forward derivative, cannot read a wrapper and are invisible to a
    recorder; torch's own operations on the generic path are not."""
    if route.backend != "array_api" and (_has_tangent(*tensors) or _transformed(*tensors)
                                         or _traced()):
        return Route(route.library, "array_api")
    return route


def _written(*tensors: Any) -> None:
    """Bump the autograd version counters of caller tensors our kernels wrote in place.

    The kernels write through zero-copy views, which torch does not see: without this a
    tensor saved for a backward and then overwritten would give wrong gradients silently
    instead of the error torch raises for its own in-place ops.
    """
    torch.autograd.graph.increment_version([t for t in tensors if t is not None])


def _is_neg(t: Any) -> bool:
    # A tensor with the lazy negation bit (``c.conj().imag``) cannot be written through a
    # view (:func:`_plain` resolves it into a copy); such an output is written by copy_.
    return t is not None and t.is_neg()


# --------------------------------------------------------------------------- views


def _plain(t: Any) -> Any:
    # DLPack exports the stored values: a tensor with the lazy negation or conjugation
    # bit set (``c.conj().imag``) must have it applied first (a no-op when unset), and
    # a zero tensor (autograd's ``_efficientzerotensor``), which stores nothing, made
    # real.
    t = t.detach()
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t.resolve_neg().resolve_conj()


def to_numpy(t: Any) -> Any:
    """Zero-copy NumPy view of a CPU tensor (any strides; bfloat16 via ml_dtypes).

    Examples
    --------
    >>> import torch
    >>> t = torch.arange(6, dtype=torch.float64).reshape(2, 3)[:, ::2]
    >>> a = to_numpy(t)
    >>> a.strides, bool(a.ctypes.data == t.data_ptr())
    ((24, 16), True)
    """
    if t is None:
        return None
    t = _plain(t)
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return np.from_dlpack(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return np.from_dlpack(t)


def from_numpy(a: Any) -> Any:
    """Zero-copy tensor sharing the memory of a NumPy array (bfloat16 via int16 bits)."""
    if a is None:
        return None
    if a.dtype.kind == "V":  # ml_dtypes.bfloat16 (the only non-native dtype we return)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class Bridge:
    """Zero-copy views between tensors and the arrays of one native backend.

    Parameters
    ----------
    xp : module
        NumPy or CuPy.
    to_xp, to_torch : callable
        DLPack conversions between tensors and ``xp`` arrays.
    bfloat16_as_bits : bool
        Whether ``xp`` lacks bfloat16, so bfloat16 data travels as uint16 bits (the
        request names the dtype) and parameters and statistics are cast to the
        accumulation dtype on the torch side (CuPy); else bfloat16 is viewed as
        ``ml_dtypes.bfloat16`` and parameters go as they are (NumPy).
    """

    def __init__(self, xp: Any, to_xp: Any, to_torch: Any, bfloat16_as_bits: bool) -> None:
        self.xp, self.to_xp, self.to_torch = xp, to_xp, to_torch
        self.bits = bfloat16_as_bits

    def array(self, t: Any) -> Any:
        """``t`` as an ``xp`` array sharing its memory."""
        if t is None:
            return None
        if not self.bits:
            return to_numpy(t)
        t = _plain(t)
        if t.dtype == torch.bfloat16:
            return self.to_xp(t.view(torch.int16)).view(self.xp.uint16)
        return self.to_xp(t)

    def param(self, t: Any, acc: str) -> Any:
        """A parameter or statistic for the engine (cast to ``acc`` where ``xp`` must)."""
        if t is None:
            return None
        if self.bits and t.dtype not in (torch.float32, torch.float64):
            t = t.detach().to(_ACC_TORCH[acc])
        return self.array(t)

    def tensor(self, a: Any, dtype: torch.dtype) -> Any:
        """An engine result as a tensor of ``dtype`` sharing its memory."""
        if a is None:
            return None
        if not self.bits:
            return from_numpy(a)
        t = self.to_torch(a)
        return t.view(dtype) if t.dtype != dtype else t


CPU_BRIDGE = Bridge(np, np.from_dlpack, torch.from_numpy, bfloat16_as_bits=False)


@functools.cache
def _cuda_bridge() -> Bridge:
    import cupy

    return Bridge(cupy, cupy.from_dlpack, torch.from_dlpack, bfloat16_as_bits=True)


class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cupy_stream(cupy: Any, handle: int, device_index: int) -> Any:
    """CuPy's view of torch's stream ``handle``.

    CuPy 14 deprecates ``ExternalStream`` for ``Stream.from_external`` (an object with
    ``__cuda_stream__``; the stream's device is the current one); older CuPy has only
    the former.
    """
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device_index)


@contextlib.contextmanager
def _cuda_scope(x: Any) -> Any:
    """Run CuPy on the tensor's device and on torch's current stream there."""
    import cupy

    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(x.device)
    with cupy.cuda.Device(index), _cupy_stream(cupy, stream.cuda_stream, index):
        yield


def _bridge_and_scope(route: Route, x: Any) -> tuple[Bridge, Any]:
    if route.backend == "cupy":
        return _cuda_bridge(), _cuda_scope(x)
    return CPU_BRIDGE, contextlib.nullcontext()


# --------------------------------------------------------------------------- forward, backward


def forward_with(bridge: Bridge, route: Route, rms: bool, x: Any, ns: Any, weight: Any,
                 bias: Any, eps: Any, axis: Any, out: Any) -> tuple[Any, Any, Any]:
    """Validated native forward of tensors through ``bridge``: ``(y, mean, rstd)`` tensors.

    ``mean`` is None for RMSNorm.
    """
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    req = _engine.request(x, route, ns, axis, **params)
    eps = _engine.resolve_eps(eps, req, rms)
    if out is not None:
        check_out(out, req.layout.shape, req.dtype)
    direct = out is not None and not _is_neg(out)  # else computed fresh, then copied
    xa = bridge.array(x)
    outa = None
    if direct:
        outa = xa if out is x else bridge.array(out)
        check_no_internal_overlap(outa, "out")
    y, mean, rstd = _engine.forward(
        bridge.xp, xa, req, bridge.param(weight, req.acc),
        None if rms else bridge.param(bias, req.acc), eps, outa, rms)
    if direct:
        _written(out)
        y = out
    else:
        y = bridge.tensor(y, x.dtype)
        if out is not None:
            y = out.copy_(y)
    acc = _ACC_TORCH[req.acc]
    return y, bridge.tensor(mean, acc), bridge.tensor(rstd, acc)


def backward_with(bridge: Bridge, route: Route, rms: bool, gy: Any, x: Any, mean: Any,
                  rstd: Any, weight: Any, ns: Any, axis: Any,
                  grad_residual: Any = None, bias_dtype: Any = None) -> tuple[Any, ...]:
    """Validated native backward of tensors through ``bridge``: gradient tensors.

    ``grad_residual`` (checked by the caller; only where the backend fuses it,
    :func:`layernorm._engine.fuses_grad_residual`) is added to ``grad_x`` by the kernels.
    The parameter gradients come in the dtype of ``weight`` (of ``x`` without one), as
    the functional backward returns them; ``bias_dtype`` (autograd, for a bias of its
    own dtype) gives ``grad_bias`` that dtype instead, cast once from the accumulation
    dtype.
    """
    req = _engine.request(x, route, ns, axis, weight=weight)
    stats = {"rstd": rstd} if rms else {"mean": mean, "rstd": rstd}
    _engine.check_backward(gy, req, **stats)
    grads = _engine.backward(
        bridge.xp, bridge.array(gy), bridge.array(x), req,
        None if rms else bridge.param(mean, req.acc), bridge.param(rstd, req.acc),
        bridge.param(weight, req.acc), rms, bridge.array(grad_residual))
    dtypes = _param_grad_dtypes(weight, x, bias_dtype, len(grads) - 1)
    acc = _ACC_TORCH[req.acc]
    return (bridge.tensor(grads[0], x.dtype),
            *(bridge.tensor(g, acc).to(d) for g, d in zip(grads[1:], dtypes, strict=True)))


def _param_grad_dtypes(weight: Any, x: Any, bias_dtype: Any, count: int) -> tuple[Any, ...]:
    """Dtypes of the ``count`` parameter gradients: the weight's (else x's), and
    ``bias_dtype`` for ``grad_bias`` when given."""
    pdtype = (weight if weight is not None else x).dtype
    dtypes = [pdtype] * count
    if bias_dtype is not None and count == 2:
        dtypes[1] = bias_dtype
    return tuple(dtypes)


def _generic_forward(route: Route, rms: bool, x: Any, ns: Any, weight: Any, bias: Any,
                     eps: Any, axis: Any, out: Any) -> tuple[Any, Any, Any]:
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    req = _engine.request(x, route, ns, axis, **params)
    eps = _engine.resolve_eps(eps, req, rms)
    if out is not None:
        check_out(out, req.layout.shape, req.dtype)
    xp = _engine.namespace("torch", x)
    y, mean, rstd = _engine.forward(xp, x, req, weight, bias, eps, None, rms)
    if out is not None:
        out.copy_(y)
        y = out
    return y, mean, rstd


def _generic_backward(route: Route, rms: bool, gy: Any, x: Any, mean: Any, rstd: Any,
                      weight: Any, ns: Any, axis: Any, bias_dtype: Any = None
                      ) -> tuple[Any, ...]:
    req = _engine.request(x, route, ns, axis, weight=weight)
    stats = {"rstd": rstd} if rms else {"mean": mean, "rstd": rstd}
    _engine.check_backward(gy, req, **stats)
    xp = _engine.namespace("torch", x)
    grads = _engine.backward(xp, gy, x, req, mean, rstd, weight, rms)
    dtypes = _param_grad_dtypes(weight, x, bias_dtype, len(grads) - 1)
    return (grads[0], *(g.to(d) for g, d in zip(grads[1:], dtypes, strict=True)))


def _forward(route: Route, rms: bool, x: Any, ns: Any, weight: Any, bias: Any, eps: Any,
             axis: Any, out: Any) -> tuple[Any, Any, Any]:
    if route.backend == "array_api":
        return _generic_forward(route, rms, x, ns, weight, bias, eps, axis, out)
    bridge, scope = _bridge_and_scope(route, x)
    with scope:
        return forward_with(bridge, route, rms, x, ns, weight, bias, eps, axis, out)


def _backward(route: Route, rms: bool, gy: Any, x: Any, mean: Any, rstd: Any, weight: Any,
              ns: Any, axis: Any, grad_residual: Any = None,
              bias_dtype: Any = None) -> tuple[Any, ...]:
    if route.backend == "array_api":
        return _generic_backward(route, rms, gy, x, mean, rstd, weight, ns, axis, bias_dtype)
    bridge, scope = _bridge_and_scope(route, x)
    with scope:
        return backward_with(bridge, route, rms, gy, x, mean, rstd, weight, ns, axis,
                             grad_residual, bias_dtype)


def _backward_plus(route: Route, rms: bool, req: Any, gy: Any, x: Any, mean: Any, rstd: Any,
                   weight: Any, ns: Any, axis: Any, grad_residual: Any,
                   bias_dtype: Any = None) -> tuple[Any, ...]:
    """The backward with ``grad_residual`` added to ``grad_x``: inside the kernels where
    the backend fuses it (as the engine does for NumPy/CuPy arrays), else composed
    (:func:`layernorm._engine.with_grad_residual`). ``bias_dtype``: as for
    :func:`backward_with`."""
    route = _differentiable_route(route, gy, grad_residual)  # batched gradients
    if (grad_residual is not None and route.backend != "array_api"
            and _engine.fuses_grad_residual(req)):
        return _backward(route, rms, gy, x, mean, rstd, weight, ns, axis, grad_residual,
                         bias_dtype)

    def run(gy_: Any, x_: Any) -> tuple[Any, ...]:
        return _backward(route, rms, gy_, x_, mean, rstd, weight, ns, axis,
                         bias_dtype=bias_dtype)

    return _engine.with_grad_residual(_namespace(x), gy, x, req, run, grad_residual)


def _graph_grads(fn: Any, inputs: tuple[Any, ...], need: tuple[bool, ...],
                 grad_y: Any) -> tuple[Any, ...]:
    """The gradients of ``fn(*inputs)`` (for ``grad_y``) by torch, themselves
    differentiable: the backward of our nodes under ``create_graph=True``.

    ``fn`` recomputes the node's output with the generic implementation on torch tensors
    from the saved ``inputs``, which unpack with their autograd history, so the graph of
    the gradients reaches them. :func:`torch.func.vjp` differentiates with respect to the
    inputs themselves (:func:`torch.autograd.grad` would add any path between them, such
    as an ``x`` computed from the weight). One gradient per input, None where ``need``
    is false.
    """
    wanted = [i for i, n in enumerate(need) if n]

    def partial(*args: Any) -> Any:
        full = list(inputs)
        for i, arg in zip(wanted, args, strict=True):
            full[i] = arg
        return fn(*full)

    _, vjp = torch.func.vjp(partial, *(inputs[i] for i in wanted))
    grads = iter(vjp(grad_y))
    return tuple(next(grads) if n else None for n in need)


def _generic_norm(route: Route, rms: bool, ns: Any, eps: Any, axis: Any) -> Any:
    """``f(x, weight, bias) -> y`` on the generic route, which torch differentiates."""
    generic = Route(route.library, "array_api")

    def norm(x: Any, weight: Any, bias: Any) -> Any:
        return _generic_forward(generic, rms, x, ns, weight, bias, eps, axis, None)[0]

    return norm


class _NormFunction(torch.autograd.Function):
    """Autograd node for the native routes: our forward, our backward kernels.

    Under ``create_graph=True`` (grad mode on inside the backward) the gradients come
    from torch's autograd through the generic implementation instead, so that second
    derivatives exist, as they do for :func:`torch.nn.functional.layer_norm`.
    """

    @staticmethod
    def forward(ctx: Any, x: Any, weight: Any, bias: Any, spec: tuple[Any, ...]) -> Any:
        route, rms, ns, eps, axis = spec
        short = _short_forward(route, rms, x, ns, weight, bias, eps, axis)
        y, mean, rstd = (short if short is not None
                         else _forward(route, rms, x, ns, weight, bias, eps, axis, None))
        ctx.spec = spec
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        if rms:
            ctx.mark_non_differentiable(rstd)
            return y, rstd
        ctx.mark_non_differentiable(mean, rstd)
        return y, mean, rstd

    @staticmethod
    def backward(ctx: Any, grad_y: Any, *_stats_grads: Any) -> tuple[Any, ...]:
        route, rms, ns, eps, axis = ctx.spec
        x, weight, bias, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True
            norm = _generic_norm(route, rms, ns, eps, axis)
            return (*_graph_grads(norm, (x, weight, bias), need[:3], grad_y), None)
        grads = _short_backward(route, rms, grad_y, x, mean, rstd, weight, bias, ns, axis)
        if grads is None:
            # grad_bias in the bias's own dtype: rounded to the weight's (or x's) first, a
            # float32 bias beside a 16-bit weight or x would get a 16-bit (or inf)
            # gradient.
            grads = _backward(_differentiable_route(route, grad_y), rms, grad_y, x, mean,
                              rstd, weight, ns, axis,
                              bias_dtype=None if bias is None else bias.dtype)
        gx = grads[0] if need[0] else None
        gw = grads[1] if need[1] else None
        gb = grads[2] if (not rms and need[2]) else None
        return gx, gw, gb, None


# --------------------------------------------------------------------------- short path

#: Tensor types whose forward calls try :func:`short_layer_norm` / :func:`short_rms_norm`
#: (module parameters are often the weights).
SHORT_PATH_TYPES = (torch.Tensor, torch.nn.Parameter)
#: Dtypes whose CPU tensors ``Tensor.numpy()`` views, and bfloat16, whose int16 bits it
#: views as ``ml_dtypes.bfloat16`` (as :func:`to_numpy` does).
_NUMPY_VIEWABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


#: What :func:`_numpy_views` returns where autograd records the call (grad mode on, an
#: input requiring grad): :func:`short_layer_norm` then hands it to the autograd node
#: itself (:func:`_recordable`).
RECORDED: list[Any] = []


def _plain_tensor(t: Any) -> bool:
    """Whether ``t`` is a plain tensor (or parameter) of a dtype the short paths view,
    neither batched by autograd nor a zero tensor (``Tensor.numpy()`` hands out
    unrelated memory for one, which has no storage)."""
    return (type(t) in SHORT_PATH_TYPES and t.dtype in _NUMPY_VIEWABLE
            and not (_IS_BATCHED is not None and _IS_BATCHED(t)) and not t._is_zerotensor())


def _numpy_views(*tensors: Any) -> list[Any] | None:
    """Zero-copy NumPy views of CPU tensors (None stays None) for the NumPy short path,
    :data:`RECORDED` where autograd records the call, or None where the call needs this
    adapter's general route: forward-mode AD or a ``torch.func`` transform, another
    device, dtype, layout or tensor subclass, the lazy negation bit; ``torch.compile``
    (fake tensors) or a recorder (:func:`_traced`)."""
    if (getattr(fwad, "_current_level", 0) >= 0 or _compiling() or _traced()
            or _transform_level() is not None):
        # (A torch.func transform wraps its inputs; Tensor.numpy() hands out unrelated
        # memory for a functionalize wrapper.)
        return None
    if torch.is_grad_enabled():
        # Checked for every tensor before any view is made: autograd records the call.
        for t in tensors:
            if type(t) in SHORT_PATH_TYPES and t.requires_grad:
                return RECORDED
    views = []
    for t in tensors:
        if t is None:
            views.append(None)
            continue
        dtype = t.dtype
        if not _plain_tensor(t):
            return None
        if t.requires_grad:
            t = t.detach()
        # ``Tensor.numpy()`` itself refuses the rest of what the kernels cannot read
        # (checking first cost a one-row call more than the kernel): another device, a
        # sparse layout, the negation bit.
        try:
            if dtype is torch.bfloat16:
                views.append(t.view(torch.int16).numpy().view(_bfloat16()))
            else:
                views.append(t.numpy())
        except (RuntimeError, TypeError):
            return None
    return views


@functools.cache
def _bfloat16() -> Any:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _gain_view(views: list[Any], weight_offset: Any) -> Any:
    # The weight's view, or the offset gain (None: no offset given).
    if weight_offset is None:
        return views[1]
    return _fast.offset_weight(views[0], views[1], weight_offset)


def _tensors(result: Any) -> Any:
    if result is None:
        return None
    if type(result) is tuple:
        return tuple(from_numpy(a) for a in result)
    return from_numpy(result)


#: The route of CPU tensors: the Numba kernels.
_CPU_ROUTE = Route("torch", "numba")


def _recordable(*tensors: Any) -> bool:
    """Whether a recorded call (:data:`RECORDED`) of ``tensors`` may go straight to the
    autograd node on :data:`_CPU_ROUTE`, as the general route would send it after its
    checks: plain tensors (:func:`_plain_tensor`; None allowed), dense and on the CPU,
    none wrapped by a ``torch.func`` transform or with the negation or conjugation bit
    (whose views the node's short forward cannot make).
    :func:`_numpy_views` has ruled out forward-mode AD, ``torch.compile``, recorders
    (:func:`_traced`) and active transforms."""
    for t in tensors:
        if t is None:
            continue
        if (not _plain_tensor(t) or not t.is_cpu or t.layout is not torch.strided
                or t.is_nested or (_IS_WRAPPED is not None and _IS_WRAPPED(t))
                or t.is_neg() or t.is_conj()):
            return False
    return True


def _recorded_norm(rms: bool, x: Any, normalized_shape: Any, weight: Any, bias: Any,
                   eps: Any, axis: Any, return_stats: bool) -> Any:
    """A recorded call through the autograd node (:class:`_NormFunction`), without the
    general route's per-call checks, which :func:`_recordable` stands for (a one-row
    call spent about half its time in them); None where it does not apply."""
    if not _recordable(x, weight, bias):
        return None
    if rms:
        y, rstd = _NormFunction.apply(x, weight, None,
                                      (_CPU_ROUTE, True, normalized_shape, eps, axis))
        return (y, rstd) if return_stats else y
    y, mean, rstd = _NormFunction.apply(x, weight, bias,
                                        (_CPU_ROUTE, False, normalized_shape, eps, axis))
    return (y, mean, rstd) if return_stats else y


def short_layer_norm(x: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any,
                     axis: Any, return_stats: bool, weight_offset: Any = None) -> Any:
    """:func:`layernorm.layer_norm` of CPU tensors through the NumPy short path
    (:mod:`layernorm._fast`) on zero-copy views: the same kernels and bits as the general
    route, without its per-call conversions (an offset gain formed as that route forms
    it, :func:`layernorm._fast.offset_weight`; None: not given); a call autograd records
    (without an offset) straight through the autograd node. None where that path does
    not take the call (then the caller goes the general way)."""
    views = _numpy_views(x, weight, bias)
    if views is RECORDED:
        return None if weight_offset is not None else _recorded_norm(
            False, x, normalized_shape, weight, bias, eps, axis, return_stats)
    if views is None:
        return None
    w = _gain_view(views, weight_offset)
    if w is _fast.GENERAL:
        return None
    return _tensors(_fast.layer_norm(views[0], normalized_shape, w, views[2], eps,
                                     axis, return_stats, None))


def short_rms_norm(x: Any, normalized_shape: Any, weight: Any, eps: Any, axis: Any,
                   return_stats: bool, weight_offset: Any = None) -> Any:
    """:func:`short_layer_norm` for :func:`layernorm.rms_norm`."""
    views = _numpy_views(x, weight)
    if views is RECORDED:
        return None if weight_offset is not None else _recorded_norm(
            True, x, normalized_shape, weight, None, eps, axis, return_stats)
    if views is None:
        return None
    w = _gain_view(views, weight_offset)
    if w is _fast.GENERAL:
        return None
    return _tensors(_fast.rms_norm(views[0], normalized_shape, w, eps, axis,
                                   return_stats, None))


def short_add_norm(x: Any, residual: Any, normalized_shape: Any, weight: Any, bias: Any,
                   eps: Any, axis: Any, weight_offset: Any, return_stats: bool,
                   rms: bool) -> Any:
    """:func:`layernorm.add_layer_norm` (``rms``: :func:`layernorm.add_rms_norm`, ``bias``
    None) of CPU tensors through the NumPy short path (:mod:`layernorm._fast_add`) on
    zero-copy views, as :func:`short_layer_norm` does (a call autograd records goes the
    general way, to its autograd node). None where that path does not take the call."""
    views = _numpy_views(x, residual, weight, bias)
    if views is None or views is RECORDED:
        return None
    w = views[2] if weight_offset is None else _fast.offset_weight(views[0], views[2],
                                                                   weight_offset)
    if w is _fast.GENERAL:
        return None
    return _tensors(_fast_add.add_norm(views[0], views[1], normalized_shape, w, views[3],
                                       eps, axis, None, return_stats, None, None, rms))


def _short_forward(route: Route, rms: bool, x: Any, ns: Any, weight: Any, bias: Any,
                   eps: Any, axis: Any) -> tuple[Any, Any, Any] | None:
    """``(y, mean, rstd)`` (``mean`` None for RMSNorm) of the autograd node's forward
    (grad mode off) through the NumPy short path, or None: the general route's bits
    without its per-call conversions (a one-row call spent about 60 us in them)."""
    if route.backend != "numba":
        return None
    if rms:
        result = short_rms_norm(x, ns, weight, eps, axis, True)
        return None if result is None else (result[0], None, result[1])
    return short_layer_norm(x, ns, weight, bias, eps, axis, True)


def _short_backward(route: Route, rms: bool, grad_y: Any, x: Any, mean: Any, rstd: Any,
                    weight: Any, bias: Any, ns: Any, axis: Any) -> tuple[Any, ...] | None:
    """The autograd node's gradients (grad mode off) through the NumPy backward short
    path (:mod:`layernorm._fast_backward`), or None where it does not take the call, or
    where ``grad_bias`` would have another dtype than the bias (that path rounds it to
    the weight's, or x's, dtype)."""
    if route.backend != "numba" or (
            bias is not None and bias.dtype != (x if weight is None else weight).dtype):
        return None
    views = _numpy_views(grad_y, x, mean, rstd, weight)
    if views is None or views is RECORDED:
        return None
    grads = _fast_backward.gradients(views[0], views[1], views[2], views[3], views[4], ns,
                                     axis, None, rms)
    return None if grads is None else tuple(from_numpy(g) for g in grads)


# --------------------------------------------------------------------------- entry points


def _plain_forward(route: Route, rms: bool, x: Any, ns: Any, weight: Any, bias: Any, eps: Any,
                   axis: Any, out: Any) -> tuple[Any, Any, Any]:
    """``(y, mean, rstd)``, through our autograd node when a gradient is wanted.

    The statistics are not differentiable on any route (as torch's
    ``native_layer_norm`` has them): the generic route's are detached."""
    if route.backend != "array_api" and _wants_grad(x, weight, bias):
        if rms:
            y, rstd = _NormFunction.apply(x, weight, None, (route, True, ns, eps, axis))
            return y, None, rstd
        return _NormFunction.apply(x, weight, bias, (route, False, ns, eps, axis))
    y, mean, rstd = _forward(route, rms, x, ns, weight, bias, eps, axis, out)
    return y, _detached(mean), _detached(rstd)


def _detached(t: Any) -> Any:
    return t.detach() if t is not None and t.requires_grad else t


def _namespace(x: Any) -> Any:
    return _engine.namespace("torch", x)


def _extended_forward(route: Route, rms: bool, x: Any, ns: Any, weight: Any, bias: Any,
                      eps: Any, axis: Any, return_stats: bool, out: Any, weight_offset: Any,
                      quantize: Any, scale: Any) -> Any:
    """A forward with ``weight_offset`` or ``quantize``: the engine's composition, with
    torch ops (the gain is differentiable; quantized outputs are not)."""
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    req = _engine.request(x, route, ns, axis, **params)
    xp = _namespace(x)
    offset, quantize = _engine.check_extras(xp, req, weight, weight_offset, quantize, scale,
                                            out)
    g = _engine.gain(xp, weight, offset, req.acc)
    if quantize is None:
        y, mean, rstd = _plain_forward(route, rms, x, ns, g, bias, eps, axis, out)
        return _engine.results(y, None, None, mean, rstd, None, return_stats, rms, add=False)

    def norm(a: Any, o: Any) -> tuple[Any, Any, Any]:
        return _forward(route, rms, a, ns, g, bias, eps, axis, o)

    with torch.no_grad():  # quantized outputs are not differentiable
        fused = None if route.backend == "array_api" else _fused_rows(
            route, rms, x, None, ns, g, bias, eps, axis, None, out, None, quantize, scale)
        if fused is not None:
            y, _, s, mean, rstd = fused
        else:
            y, s, mean, rstd = _engine.compose(xp, x, req, norm, req.dtype, out, quantize,
                                               scale)
    return _engine.results(y, None, s, mean, rstd, quantize, return_stats, rms, add=False)


def layer_norm(x: Any, route: Route, normalized_shape: Any, weight: Any, bias: Any, eps: Any,
               *, axis: Any, return_stats: bool, out: Any, weight_offset: Any = 0.0,
               quantize: Any = None, scale: Any = None) -> Any:
    """:func:`layernorm.layer_norm` for a torch tensor ``x``; returns torch tensors."""
    _check_inputs(x, weight=weight, bias=bias, out=out, scale=scale)
    _check_out(out, x, weight, bias)
    route = _differentiable_route(route, x, weight, bias)
    if (quantize is not None or scale is not None or type(weight_offset) is not float
            or weight_offset != 0.0):
        return _extended_forward(route, False, x, normalized_shape, weight, bias, eps, axis,
                                 return_stats, out, weight_offset, quantize, scale)
    y, mean, rstd = _plain_forward(route, False, x, normalized_shape, weight, bias, eps, axis,
                                   out)
    return (y, mean, rstd) if return_stats else y


def rms_norm(x: Any, route: Route, normalized_shape: Any, weight: Any, eps: Any, *, axis: Any,
             return_stats: bool, out: Any, weight_offset: Any = 0.0, quantize: Any = None,
             scale: Any = None) -> Any:
    """:func:`layernorm.rms_norm` for a torch tensor ``x``; returns torch tensors."""
    _check_inputs(x, weight=weight, out=out, scale=scale)
    _check_out(out, x, weight)
    route = _differentiable_route(route, x, weight)
    if (quantize is not None or scale is not None or type(weight_offset) is not float
            or weight_offset != 0.0):
        return _extended_forward(route, True, x, normalized_shape, weight, None, eps, axis,
                                 return_stats, out, weight_offset, quantize, scale)
    y, _, rstd = _plain_forward(route, True, x, normalized_shape, weight, None, eps, axis, out)
    return (y, rstd) if return_stats else y


def _extended_backward(route: Route, rms: bool, gy: Any, x: Any, mean: Any, rstd: Any,
                       weight: Any, ns: Any, axis: Any, weight_offset: Any,
                       grad_residual: Any) -> tuple[Any, ...]:
    req = _engine.request(x, route, ns, axis, weight=weight)
    offset = _engine.check_weight_offset(weight_offset, weight is not None, req.acc)
    _engine.check_grad_residual(grad_residual, req)
    g = _engine.gain(_namespace(x), weight, offset, req.acc)
    grads = _backward_plus(route, rms, req, gy, x, mean, rstd, g, ns, axis, grad_residual)
    pdtype = (weight if weight is not None else x).dtype
    return (grads[0], *(gr.to(pdtype) for gr in grads[1:]))


def layer_norm_backward(grad_y: Any, x: Any, route: Route, mean: Any, rstd: Any, weight: Any,
                        normalized_shape: Any, *, axis: Any, weight_offset: Any = 0.0,
                        grad_residual: Any = None) -> Any:
    """:func:`layernorm.layer_norm_backward` for torch tensors (differentiable where an
    input requires grad: :func:`_backward_route`)."""
    _check_inputs(x, grad_y=grad_y, mean=mean, rstd=rstd, weight=weight,
                  grad_residual=grad_residual)
    route, scope = _backward_route(route, grad_y, x, mean, rstd, weight, grad_residual)
    with scope:
        return _extended_backward(route, False, grad_y, x, mean, rstd, weight,
                                  normalized_shape, axis, weight_offset, grad_residual)


def rms_norm_backward(grad_y: Any, x: Any, route: Route, rstd: Any, weight: Any,
                      normalized_shape: Any, *, axis: Any, weight_offset: Any = 0.0,
                      grad_residual: Any = None) -> Any:
    """:func:`layernorm.rms_norm_backward` for torch tensors (differentiable where an
    input requires grad: :func:`_backward_route`)."""
    _check_inputs(x, grad_y=grad_y, rstd=rstd, weight=weight, grad_residual=grad_residual)
    route, scope = _backward_route(route, grad_y, x, rstd, weight, grad_residual)
    with scope:
        return _extended_backward(route, True, grad_y, x, None, rstd, weight,
                                  normalized_shape, axis, weight_offset, grad_residual)


def _backward_route(route: Route, *tensors: Any) -> tuple[Route, Any]:
    """The route and grad mode of a functional backward call.

    Where autograd records the call (grad mode on and an input requiring grad), its
    gradients must be differentiable, as those of torch's ``native_layer_norm_backward``
    are (a gradient penalty differentiates them): they are computed by the generic
    implementation, whose torch operations autograd records. Otherwise the backend's
    kernels run under ``no_grad``.
    """
    if _wants_grad(*tensors):
        return Route(route.library, "array_api"), contextlib.nullcontext()
    return _differentiable_route(route, *tensors), torch.no_grad()


# --------------------------------------------------------------------------- fusions


def _fused_rows(route: Route, rms: bool, x: Any, residual: Any, ns: Any, gain: Any,
                bias: Any, eps: Any, axis: Any, h_name: str | None, out: Any,
                residual_out: Any, quantize: str | None, scale: Any) -> tuple[Any, ...] | None:
    """``(y, h, scale, mean, rstd)`` tensors by the backend's one-pass kernel on zero-copy
    views (:func:`layernorm._engine.fused_rows`), or None where it has none for this call
    (then the caller composes).

    Serves the ``add_`` calls (``residual`` given; ``h`` None without one) and the
    quantized forwards. The codes are written into a tensor of the format's dtype
    (``out``, or a new one) through its bytes: NumPy and CuPy view no torch float8.
    ``scale`` is the per-row scale tensor (dynamic) or the caller's, as passed.
    """
    req = _engine.request(x, route, ns, axis, weight=gain, bias=bias)
    if residual is not None and accumulation_name(h_name) != req.acc:
        return None
    if _is_neg(out) or _is_neg(residual_out):  # the composition writes them by copy_
        return None
    if residual is None:  # fused_rows resolves eps for h itself
        eps = _engine.resolve_eps(eps, req, rms)
    bridge, scope = _bridge_and_scope(route, x)
    y = out
    if quantize is not None and out is None:
        y = torch.empty(x.shape, dtype=_engine.dtype_of(torch, quantize), device=x.device)
    with scope:
        xa = bridge.array(x)
        if y is None:
            ya = None
        elif y is x:
            ya = xa
        else:
            ya = bridge.array(y.view(torch.uint8) if quantize is not None else y)
        ha = bridge.array(residual_out)
        # The kernels write outputs in place (torch's copy_ would refuse such an output).
        for name, given in (("out", None if out is None else ya), ("residual_out", ha)):
            if given is not None:
                check_no_internal_overlap(given, name)
        s = scale
        if isinstance(scale, torch.Tensor):
            s = bridge.param(scale.to(x.device), req.acc)
        fused = _engine.fused_rows(
            bridge.xp, xa, bridge.array(residual), req, h_name, bridge.param(gain, req.acc),
            None if rms else bridge.param(bias, req.acc), eps, rms, ya, ha, quantize, s)
    if fused is None:
        return None
    _written(out, residual_out)
    ya, h, s, mean, rstd = fused
    acc = _ACC_TORCH[req.acc]
    if y is None:
        y = bridge.tensor(ya, x.dtype)
    if residual is not None and residual_out is not None:
        h = residual_out
    elif residual is not None:
        h = bridge.tensor(h, getattr(torch, h_name))
    if quantize is not None:
        s = scale if scale is not None else bridge.tensor(s, acc)
    return y, h, s, bridge.tensor(mean, acc), bridge.tensor(rstd, acc)


def _add_forward(route: Route, rms: bool, x: Any, residual: Any, ns: Any, gain: Any,
                 bias: Any, eps: Any, axis: Any, add: str, h_name: str, quantize: Any,
                 scale: Any, out: Any, residual_out: Any) -> tuple[Any, ...]:
    """An ``add_`` call on tensors: ``(y, h, scale, mean, rstd)``, by the one-pass kernel
    where the backend has one for it (:func:`_fused_rows`), else the engine's composition.

    Differentiable by torch itself on the generic route; the native routes run it inside
    :class:`_AddNormFunction` (or without gradients).
    """
    if route.backend != "array_api":
        fused = _fused_rows(route, rms, x, residual, ns, gain, bias, eps, axis, h_name, out,
                            residual_out, quantize, scale)
        if fused is not None:
            return fused
    xp = _namespace(x)
    h = _engine.residual_sum(xp, x, residual, add, h_name)
    if residual_out is not None:
        gain, bias = _engine.unshared(xp, _share_storage, residual_out, gain, bias)
        residual_out.copy_(h)
        h = residual_out
    req = _engine.request(h, route, ns, axis, weight=gain, bias=bias)

    def norm(a: Any, o: Any) -> tuple[Any, Any, Any]:
        return _forward(route, rms, a, ns, gain, bias, eps, axis, o)

    y, s, mean, rstd = _engine.compose(xp, h, req, norm, dtype_name(x.dtype), out, quantize,
                                       scale)
    return y, h, s, mean, rstd


class _AddNormFunction(torch.autograd.Function):
    """Autograd node of ``add_layer_norm``/``add_rms_norm`` on the native routes.

    The gradient reaching ``h`` from the residual stream goes to the backward as
    ``grad_residual``; their sum is the gradient of both ``x`` and ``residual``. Under
    ``create_graph=True`` the gradient of ``y`` with respect to ``h`` comes from torch's
    autograd through the generic implementation, as in :class:`_NormFunction`; the saved
    ``h`` unpacks as this node's output, so its own derivatives come back through here.
    """

    @staticmethod
    def forward(ctx: Any, x: Any, residual: Any, gain: Any, bias: Any,
                spec: tuple[Any, ...]) -> Any:
        route, rms, ns, eps, axis, add, h_name = spec
        short = None
        if route.backend == "numba" and h_name == dtype_name(residual.dtype):
            # The NumPy fused short path (grad mode is off here), h in residual's dtype.
            short = short_add_norm(x, residual, ns, gain, bias, eps, axis, None, True, rms)
        if short is not None:
            y, h, mean, rstd = (short[0], short[1], None, short[2]) if rms else short
        else:
            y, h, _, mean, rstd = _add_forward(route, rms, x, residual, ns, gain, bias, eps,
                                               axis, add, h_name, None, None, None, None)
        ctx.spec = spec
        ctx.dtypes = (x.dtype, residual.dtype)
        ctx.save_for_backward(h, gain, bias, mean, rstd)
        if rms:
            ctx.mark_non_differentiable(rstd)
            return y, h, rstd
        ctx.mark_non_differentiable(mean, rstd)
        return y, h, mean, rstd

    @staticmethod
    def backward(ctx: Any, grad_y: Any, grad_h: Any, *_stats_grads: Any) -> tuple[Any, ...]:
        route, rms, ns, eps, axis, _add, _h_name = ctx.spec
        h, gain, bias, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True
            norm = _generic_norm(route, rms, ns, eps, axis)
            g_h, g_gain, g_bias = _graph_grads(
                lambda h_, w_, b_: norm(h_, w_, b_).to(ctx.dtypes[0]), (h, gain, bias),
                (need[0] or need[1], need[2], not rms and need[3]), grad_y)
            total = grad_h.to(h.dtype) if g_h is None else g_h + grad_h.to(h.dtype)
            return (total.to(ctx.dtypes[0]) if need[0] else None,
                    total.to(ctx.dtypes[1]) if need[1] else None, g_gain, g_bias, None)
        req = _engine.request(h, route, ns, axis, weight=gain)
        grads = _backward_plus(route, rms, req, grad_y.to(h.dtype), h, mean, rstd, gain, ns,
                               axis, grad_h.to(h.dtype),
                               None if bias is None else bias.dtype)
        total = grads[0]
        return (total.to(ctx.dtypes[0]) if need[0] else None,
                total.to(ctx.dtypes[1]) if need[1] else None,
                grads[1] if need[2] else None,
                grads[2] if (not rms and need[3]) else None,
                None)


class _ResidualSum(torch.autograd.Function):
    """``h = x + residual``, computed without gradients (a quantized ``add_`` call), made
    differentiable: its gradient goes to ``x`` and to ``residual`` unchanged (in their
    dtypes), as for torch's own ``x + residual``."""

    @staticmethod
    def forward(ctx: Any, h: Any, x: Any, residual: Any) -> Any:
        ctx.dtypes = (x.dtype, residual.dtype)
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad_h: Any) -> tuple[Any, ...]:
        x_dtype, r_dtype = ctx.dtypes
        return None, grad_h.to(x_dtype), grad_h.to(r_dtype)


def _share_storage(a: Any, b: Any) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _share_elements(a: Any, b: Any) -> bool:
    """Whether the tensors ``a`` and ``b`` have a byte in common (exactly: two halves of
    each row of one storage do not)."""
    if not _share_storage(a, b):
        return False
    return _layout.share_bytes(*(_layout.Extent(
        t.data_ptr(), tuple(t.shape), tuple(s * t.element_size() for s in t.stride()),
        t.element_size()) for t in (a, b)))


def add_norm(x: Any, residual: Any, route: Route, normalized_shape: Any, weight: Any,
             bias: Any, eps: Any, *, axis: Any, rms: bool, weight_offset: Any,
             residual_dtype: Any, quantize: Any, scale: Any, return_stats: bool, out: Any,
             residual_out: Any) -> Any:
    """:func:`layernorm.add_layer_norm` / :func:`layernorm.add_rms_norm` for torch tensors."""
    if rms:
        bias = None
    _check_inputs(x, residual=residual, weight=weight, bias=bias, out=out,
                  residual_out=residual_out, scale=scale)
    _check_out(out, x, residual, weight, bias)
    _check_out(residual_out, x, residual, weight, bias, name="residual_out")
    route = _differentiable_route(route, x, residual, weight, bias)
    params = {"weight": weight} if rms else {"weight": weight, "bias": bias}
    req_x = _engine.request(x, route, normalized_shape, axis, **params)
    r_name = _engine.check_residual(residual, req_x)
    add, h_name = _engine.sum_dtypes(req_x.dtype, r_name, residual_dtype)
    xp = _namespace(x)
    offset, quantize = _engine.check_extras(xp, req_x, weight, weight_offset, quantize, scale,
                                            out)
    if residual_out is not None:
        _engine.check_residual_out(residual_out, req_x, h_name)
        _engine.check_distinct_outputs(_share_elements, out, residual_out)
    gain = _engine.gain(xp, weight, offset, accumulation_name(h_name))
    if route.backend != "array_api" and quantize is None and _wants_grad(x, residual, gain,
                                                                          bias):
        spec = (route, rms, normalized_shape, eps, axis, add, h_name)
        outs = _AddNormFunction.apply(x, residual, gain, bias, spec)
        y, h, mean, rstd = (outs[0], outs[1], None, outs[2]) if rms else outs
        s = None
    elif quantize is not None:
        with torch.no_grad():  # quantized outputs are not differentiable
            y, h, s, mean, rstd = _add_forward(route, rms, x, residual, normalized_shape, gain,
                                               bias, eps, axis, add, h_name, quantize, scale,
                                               out, residual_out)
        if _wants_grad(x, residual):  # h, the residual stream, is
            h = _ResidualSum.apply(h, x, residual)
    else:
        y, h, s, mean, rstd = _add_forward(route, rms, x, residual, normalized_shape, gain,
                                           bias, eps, axis, add, h_name, quantize, scale, out,
                                           residual_out)
    return _engine.results(y, h, s, _detached(mean), _detached(rstd), quantize, return_stats,
                           rms, add=True)


def _eager(fn: Any) -> Any:
    """``fn``, run eagerly under ``torch.compile``/``torch.export``: Dynamo's fake
    tensors have no data to hand to a kernel, so there the call goes through
    ``torch.compiler.disable`` (Dynamo stops its graph at it and runs it on the real
    tensors). Outside Dynamo, ``fn`` itself: wrapping it at import would import
    ``torch._dynamo``, a second of a first call."""

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return entry


layer_norm = _eager(layer_norm)
rms_norm = _eager(rms_norm)
layer_norm_backward = _eager(layer_norm_backward)
rms_norm_backward = _eager(rms_norm_backward)
add_norm = _eager(add_norm)


__all__ = ["CPU_BRIDGE", "SHORT_PATH_TYPES", "Bridge", "add_norm", "backward_with",
           "forward_with", "from_numpy", "layer_norm", "layer_norm_backward", "rms_norm",
           "rms_norm_backward", "short_add_norm", "short_layer_norm", "short_rms_norm",
           "to_numpy"]
