"""``LayerNorm`` and ``RMSNorm`` layers: parameters, a forward call and its backward.

They mirror :class:`torch.nn.LayerNorm` and :class:`torch.nn.RMSNorm` (constructor,
attributes, ``state_dict`` keys and repr) for arrays of any supported library.
"""

from __future__ import annotations

import importlib
import types
import warnings
from typing import Any, NamedTuple

import numpy as np

from ._api import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward
from ._dtypes import SUPPORTED, array_library, dtype_name
from ._validate import as_int_tuple, check_eps, check_weight_offset


class IncompatibleKeys(NamedTuple):
    """What :meth:`LayerNorm.load_state_dict` did not match, as torch's
    ``load_state_dict`` returns it.

    Parameters
    ----------
    missing_keys : list of str
        The layer's parameters the state did not give.
    unexpected_keys : list of str
        The state's keys that are no parameter of the layer.

    Examples
    --------
    >>> IncompatibleKeys(["bias"], [])
    IncompatibleKeys(missing_keys=['bias'], unexpected_keys=[])
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


class StateDictKeyError(KeyError, RuntimeError):
    """Keys of a state that are not exactly a layer's parameters (``strict=True``): a
    :class:`KeyError`, and a :class:`RuntimeError` as torch's ``load_state_dict``
    raises.

    Examples
    --------
    >>> import layernorm as ln
    >>> try:
    ...     ln.RMSNorm(4).load_state_dict({"weight": [1.0] * 4, "step": 1})
    ... except RuntimeError as error:
    ...     print(type(error).__name__, isinstance(error, KeyError))
    StateDictKeyError True
    """

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; the message reads plainly.
        return str(self.args[0]) if self.args else ""


def _takes_dtype(xp: Any, dtype: Any) -> bool:
    """Whether the namespace ``xp`` takes ``dtype`` as a dtype."""
    try:
        xp.empty((0,), dtype=dtype)
    except (TypeError, ValueError):
        return False
    return True


def _resolve_dtype(xp: Any, dtype: Any) -> Any:
    if not isinstance(dtype, str):
        if not _takes_dtype(xp, dtype):  # another library's (torch.float16, NumPy layer)
            name = getattr(xp, "__name__", type(xp).__name__)
            raise TypeError(f"dtype must be a dtype of {name} or a name such as 'float32' "
                            f"(the parameters' float dtype), got {dtype!r}")
        return dtype
    if dtype == "bfloat16" and getattr(xp, "__name__", "") == "numpy":
        import ml_dtypes

        return ml_dtypes.bfloat16
    found = getattr(xp, dtype, None)
    # a dtype, not another attribute of the namespace (np.e, torch.sum)
    if found is not None and _takes_dtype(xp, found):
        return found
    if getattr(xp, "__name__", "") == "numpy":
        # NumPy's other names of a dtype ("f4", "<f8"), as residual_dtype= takes them
        # (its warning for deprecated codes is not shown).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return np.dtype(dtype).type
            except TypeError:
                pass
    raise TypeError(f"dtype {dtype!r} is not a dtype of {xp.__name__}")


def _is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def _tensor_to_numpy(value: Any) -> Any:
    """A torch tensor's values as a NumPy array; a dtype NumPy lacks (bfloat16) goes
    through float32, which holds it exactly (the caller casts to the layer's dtype)."""
    value = value.detach().cpu()
    try:
        return value.numpy()
    except TypeError:
        return value.float().numpy()


def _copied_as(xp: Any, value: Any, dtype: Any, device: Any) -> Any:
    """``value`` as a new array of ``xp`` and ``dtype`` that shares no memory with it.

    ``torch.nn.Module.load_state_dict`` copies into the parameters: a layer that kept a
    view of the source would change with it. Torch tensors stay tensors for a torch
    layer (any dtype, bfloat16 included); for other namespaces they go through NumPy.
    """
    from array_api_compat import array_namespace

    to_torch = getattr(xp, "__name__", "") == "torch"
    if _is_torch_tensor(value):
        value = value.detach() if to_torch else _tensor_to_numpy(value)
    elif to_torch and hasattr(value, "dtype") and dtype_name(value.dtype) == "bfloat16":
        value = value.astype("float32")  # torch takes no ml_dtypes arrays; this is exact
    kwargs = {} if device is None else {"device": device}
    converted = xp.asarray(value, dtype=dtype, **kwargs)
    # asarray may return the source or a view of it (same namespace and dtype, or a
    # NumPy view of a CPU tensor): copy once more, in the namespace's own terms.
    return array_namespace(converted).asarray(converted, copy=True)


class _Kept:
    """A forward call's argument as ``backward`` will read it: the array as it was at the
    call, so that changing it in place afterwards (a residual stream updated with
    ``x += ...``, an optimizer step on the weight) cannot change the gradients silently.

    torch tensors are kept with their version counter and checked, as torch's autograd
    checks them (a ``RuntimeError`` if modified in place); arrays of immutable libraries
    (JAX, Dask) as they are; every other array (NumPy, CuPy, ...) as a copy.
    """

    __slots__ = ("reusable", "value", "version")

    def __init__(self, value: Any, previous: _Kept | None = None) -> None:
        self.version = None
        #: Whether a later call of the same layer may write its copy into this one's
        #: memory (not once a shallow copy of the layer shares it: :meth:`shared`).
        self.reusable = True
        if value is None or _is_immutable(value):
            self.value = value
        elif _is_torch_tensor(value):
            # detached: the same data and version counter, without the caller's graph
            # (kept alive otherwise, and a non-leaf tensor refuses copy.deepcopy)
            self.value, self.version = value.detach(), value._version
        elif _same_ndarray_kind(value, previous):
            # The last call's copy, which nothing else holds, takes the new values: a new
            # array is paged in anew. A (8192, 1024) float32 call, 1 thread: 11.0 ms with
            # a new copy (the function alone 5.0 ms in the same run), 6.2-7.8 ms reusing
            # it (the function 3.7-4.2 ms).
            np.copyto(previous.value, value)
            self.value = previous.value
        else:
            from array_api_compat import array_namespace

            self.value = array_namespace(value).asarray(value, copy=True)

    def __getstate__(self) -> tuple[Any, bool | None]:
        """For copies of the layer: a copied tensor's version counter starts anew, so
        the state says whether the tensor was modified, not its version."""
        changed = None if self.version is None else self.value._version != self.version
        return self.value, changed

    def __setstate__(self, state: tuple[Any, bool | None]) -> None:
        self.value, changed = state
        self.version = None if changed is None else self.value._version - int(changed)
        self.reusable = True

    def shared(self) -> _Kept:
        """This kept array, from now on shared by two layers (a shallow copy): neither
        writes a later call's copy into its memory."""
        self.reusable = False
        return self

    def get(self, name: str, layer: str) -> Any:
        """The kept array; a torch tensor modified in place since the call is an error."""
        if self.version is not None and self.value._version != self.version:
            raise RuntimeError(
                f"{layer}.backward(): {name} was modified in place after the forward call "
                f"(version {self.version} then, {self.value._version} now); the gradients "
                "would not be those of the call. Call the layer again, or modify a copy")
        return self.value


def _same_ndarray_kind(value: Any, previous: _Kept | None) -> bool:
    """Whether ``previous`` kept a NumPy copy that ``value`` can be copied into."""
    if previous is None or type(value) is not np.ndarray:
        return False
    kept = previous.value
    return (previous.reusable and type(kept) is np.ndarray and kept.shape == value.shape
            and kept.dtype == value.dtype and not np.shares_memory(kept, value))


def _is_immutable(value: Any) -> bool:
    """Arrays of libraries that never change an array in place (JAX, Dask)."""
    return array_library(value) in ("jax", "dask")


class _ModuleName(str):
    """A namespace module's name in a pickled layer (see :meth:`_Norm.__getstate__`)."""


class _Norm:
    _param_names: tuple[str, ...] = ()

    def __init__(self, normalized_shape: Any, eps: Any, elementwise_affine: bool,
                 has_bias: bool, dtype: Any, xp: Any, device: Any,
                 weight_offset: Any = 0.0) -> None:
        if xp is None:
            import numpy as xp
        shape = as_int_tuple(normalized_shape, "normalized_shape")
        if len(shape) == 0 or any(d < 0 for d in shape):
            raise ValueError(f"normalized_shape must be non-empty and non-negative, got {shape}")
        self.normalized_shape: tuple[int, ...] = shape
        self.eps = eps
        self.elementwise_affine = bool(elementwise_affine)
        self.weight_offset = check_weight_offset(weight_offset, self.elementwise_affine)
        self._xp = xp
        self._device = device
        self._dtype = _resolve_dtype(xp, dtype)
        kind = dtype_name(self._dtype)
        if kind not in SUPPORTED:
            raise TypeError(f"dtype must be one of {', '.join(SUPPORTED)} (the parameters' "
                            f"float dtype), got {kind}")
        self.weight: Any = None
        self.bias: Any = None
        self._has_bias = bool(has_bias) and self.elementwise_affine
        self._saved: tuple[Any, ...] | None = None
        self.reset_parameters()

    def _full(self, value: float) -> Any:
        kwargs = {} if self._device is None else {"device": self._device}
        return self._xp.full(self.normalized_shape, value, dtype=self._dtype, **kwargs)

    def reset_parameters(self) -> None:
        """Set ``weight`` to ``1 - weight_offset`` (a gain of one) and ``bias`` to zeros
        (no-op without affine parameters)."""
        if self.elementwise_affine:
            self.weight = self._full(1.0 - self.weight_offset)
            self.bias = self._full(0.0) if self._has_bias else None

    def state_dict(self) -> dict[str, Any]:
        """The parameters under torch's names (``weight``, ``bias``) that exist.

        The values are the layer's own arrays, not copies, as torch's ``state_dict``
        returns tensors that share storage with the parameters: updating one in place
        updates the layer. :meth:`load_state_dict` copies.
        """
        return {name: getattr(self, name) for name in self._names()}

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n in self._param_names if getattr(self, n) is not None)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Load ``weight``/``bias`` (arrays or torch tensors of the right shape).

        The values are copied (cast to the layer's dtype, on its namespace and device),
        as torch's ``load_state_dict`` does: later changes to the source do not reach
        the layer.

        Parameters
        ----------
        state : dict
            ``{"weight": ..., "bias": ...}`` (the layer's parameters; none without
            ``elementwise_affine``).
        strict : bool, default True
            Whether the keys must be exactly the layer's parameters (else
            :class:`StateDictKeyError`, a :class:`KeyError` and, as torch raises, a
            :class:`RuntimeError`). With False, the parameters given are loaded and the
            other keys ignored, as in torch.

        Returns
        -------
        IncompatibleKeys
            ``(missing_keys, unexpected_keys)``, as torch returns them.

        Examples
        --------
        >>> import numpy as np
        >>> import layernorm as ln
        >>> layer = ln.LayerNorm(3)
        >>> layer.load_state_dict({"weight": np.full(3, 2.0), "step": 7}, strict=False)
        IncompatibleKeys(missing_keys=['bias'], unexpected_keys=['step'])
        >>> layer.weight
        array([2., 2., 2.], dtype=float32)
        """
        if type(strict) is not bool:
            raise TypeError(f"strict must be True or False, got {strict!r}")
        expected = set(self._names())
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if strict and (missing or unexpected):
            raise StateDictKeyError(
                f"state_dict keys mismatch for {type(self).__name__}: missing {missing}, "
                f"unexpected {unexpected}; expected exactly {sorted(expected)}"
            )
        values = {}
        for name in sorted(expected - set(missing)):
            value = state[name]
            if not hasattr(value, "shape"):
                raise TypeError(f"state_dict[{name!r}] must be an array or tensor of shape "
                                f"{self.normalized_shape}, got {type(value).__name__}")
            shape = tuple(int(s) for s in value.shape)
            if shape != self.normalized_shape:
                raise ValueError(
                    f"state_dict[{name!r}] must have shape {self.normalized_shape}, got {shape}"
                )
            if isinstance(value, np.ma.MaskedArray):
                raise TypeError(f"state_dict[{name!r}] is a numpy.ma.MaskedArray, whose mask "
                                f"a parameter cannot hold; pass its .filled(value) or .data")
            values[name] = _copied_as(self._xp, value, self._dtype, self._device)
        for name, value in values.items():
            setattr(self, name, value)
        return IncompatibleKeys(missing, unexpected)

    def __getstate__(self) -> dict[str, Any]:
        """The layer's state for :mod:`pickle` and :func:`copy.deepcopy`: its namespace
        (a module, which neither can copy) by name, everything else as it is."""
        state = self.__dict__.copy()
        if isinstance(self._xp, types.ModuleType):
            state["_xp"] = _ModuleName(self._xp.__name__)
        return state

    def __copy__(self) -> _Norm:
        """A shallow copy, as :func:`copy.copy` makes of a torch module: the same
        parameters; the last call's saved arrays shared, never written by either layer's
        later calls (each keeps its own gradients)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        if self._saved is not None:
            x, weight, *stats = self._saved
            new._saved = self._saved = (x.shared(), weight.shared(), *stats)
        return new

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if isinstance(state["_xp"], _ModuleName):
            state["_xp"] = importlib.import_module(state["_xp"])
        self.__dict__.update(state)

    def _keep(self, x: Any, *stats: Any) -> None:
        """Save what ``backward`` needs: ``x`` and the parameters as they are now
        (:class:`_Kept`), and the call's statistics (new arrays of the call)."""
        previous = (None, None) if self._saved is None else self._saved[:2]
        self._saved = (_Kept(x, previous[0]), _Kept(self.weight, previous[1]), *stats)

    def _require_saved(self) -> tuple[Any, ...]:
        """``(x, weight, *stats)`` of the last call, as they were at the call."""
        if self._saved is None:
            raise RuntimeError(f"{type(self).__name__}.backward() needs a forward call first")
        x, weight, *stats = self._saved
        layer = type(self).__name__
        return (x.get("the input x", layer), weight.get("weight", layer), *stats)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self) -> str:
        """Arguments shown by ``repr`` (torch's format)."""
        text = (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")
        if self.weight_offset != 0.0:
            text += f", weight_offset={self.weight_offset}"
        return text


class LayerNorm(_Norm):
    """Layer normalization over the trailing ``normalized_shape``, as ``torch.nn.LayerNorm``.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        Trailing dimensions to normalize.
    eps : float, default 1e-5
        Added to the variance.
    elementwise_affine : bool, default True
        Learnable ``weight`` (ones) and ``bias`` (zeros).
    bias : bool, default True
        Whether to have a ``bias`` when ``elementwise_affine``.
    weight_offset : float, default 0.0
        The gain applied is ``weight + weight_offset`` (zero-centred weights use 1.0);
        ``weight`` starts at ``1 - weight_offset``.
    dtype : str or dtype, default "float32"
        Parameter dtype.
    xp : module, optional
        Array namespace for the parameters (NumPy by default; ``cupy``, ...).
    device : optional
        Device for the parameters, passed to ``xp.full``.

    Attributes
    ----------
    normalized_shape : tuple of int
        The normalized trailing dimensions.
    eps : float
        Added to the variance.
    elementwise_affine : bool
        Whether the layer has ``weight`` (and ``bias``).
    weight, bias : array or None
        Parameters of shape ``normalized_shape`` in the layer's namespace; ``bias`` is None
        with ``bias=False``, both are None without ``elementwise_affine``.
    weight_offset : float
        Added to ``weight`` to form the gain.

    Examples
    --------
    >>> import numpy as np
    >>> import layernorm as ln
    >>> layer = ln.LayerNorm(4)
    >>> layer
    LayerNorm((4,), eps=1e-05, elementwise_affine=True, bias=True)
    >>> y = layer(np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32))
    >>> grad_x, grad_weight, grad_bias = layer.backward(np.ones_like(y))
    >>> grad_bias
    array([1., 1., 1., 1.], dtype=float32)
    """

    _param_names = ("weight", "bias")

    def __init__(self, normalized_shape: Any, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *,
                 weight_offset: float = 0.0, dtype: Any = "float32", xp: Any = None,
                 device: Any = None) -> None:
        super().__init__(normalized_shape, check_eps(eps), elementwise_affine, bias, dtype, xp,
                         device, weight_offset)

    def __call__(self, x: Any) -> Any:
        """Normalize ``x`` and keep what ``backward`` needs."""
        y, mean, rstd = layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                                   weight_offset=self.weight_offset, return_stats=True)
        self._keep(x, mean, rstd)
        return y

    def backward(self, grad_y: Any) -> tuple[Any, Any, Any]:
        """Gradients for the last call, from the statistics it saved.

        Parameters
        ----------
        grad_y : array
            Gradient of the loss with respect to the last output (its shape and dtype).

        Returns
        -------
        grad_x : array
            Gradient with respect to the last input.
        grad_weight, grad_bias : array or None
            Gradients of the parameters; None for a parameter the layer does not have.
        """
        x, weight, mean, rstd = self._require_saved()
        gx, gw, gb = layer_norm_backward(grad_y, x, mean, rstd, weight,
                                         self.normalized_shape,
                                         weight_offset=self.weight_offset)
        return (gx, gw if weight is not None else None,
                gb if self.bias is not None else None)

    def extra_repr(self) -> str:
        """Arguments shown by ``repr``."""
        text = (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}")
        if self.weight_offset != 0.0:
            text += f", weight_offset={self.weight_offset}"
        return text


class RMSNorm(_Norm):
    """Root-mean-square normalization, as ``torch.nn.RMSNorm``.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        Trailing dimensions to normalize.
    eps : float, optional
        Added to the mean square; None means the accumulation dtype's machine epsilon.
    elementwise_affine : bool, default True
        Learnable ``weight`` (ones).
    weight_offset : float, default 0.0
        The gain applied is ``weight + weight_offset`` (Gemma's RMSNorm uses 1.0);
        ``weight`` starts at ``1 - weight_offset``.
    dtype : str or dtype, default "float32"
        Parameter dtype.
    xp : module, optional
        Array namespace for the parameters (NumPy by default).
    device : optional
        Device for the parameters.

    Attributes
    ----------
    normalized_shape : tuple of int
        The normalized trailing dimensions.
    eps : float or None
        Added to the mean square; None means the accumulation dtype's machine epsilon.
    elementwise_affine : bool
        Whether the layer has ``weight``.
    weight : array or None
        Scale of shape ``normalized_shape`` in the layer's namespace; None without
        ``elementwise_affine``.
    weight_offset : float
        Added to ``weight`` to form the gain.

    Examples
    --------
    >>> import numpy as np
    >>> import layernorm as ln
    >>> layer = ln.RMSNorm((2,))
    >>> layer
    RMSNorm((2,), eps=None, elementwise_affine=True)
    >>> layer(np.array([[3.0, 4.0]], dtype=np.float32)).round(4)
    array([[0.8485, 1.1314]], dtype=float32)
    >>> gemma = ln.RMSNorm(2, weight_offset=1.0)
    >>> gemma
    RMSNorm((2,), eps=None, elementwise_affine=True, weight_offset=1.0)
    >>> gemma.weight
    array([0., 0.], dtype=float32)
    """

    _param_names = ("weight",)

    def __init__(self, normalized_shape: Any, eps: float | None = None,
                 elementwise_affine: bool = True, *, weight_offset: float = 0.0,
                 dtype: Any = "float32", xp: Any = None, device: Any = None) -> None:
        super().__init__(normalized_shape, None if eps is None else check_eps(eps),
                         elementwise_affine, False, dtype, xp, device, weight_offset)

    def __call__(self, x: Any) -> Any:
        """Normalize ``x`` and keep what ``backward`` needs."""
        y, rstd = rms_norm(x, self.normalized_shape, self.weight, self.eps,
                           weight_offset=self.weight_offset, return_stats=True)
        self._keep(x, rstd)
        return y

    def backward(self, grad_y: Any) -> tuple[Any, Any]:
        """Gradients for the last call, from the statistics it saved.

        Parameters
        ----------
        grad_y : array
            Gradient of the loss with respect to the last output (its shape and dtype).

        Returns
        -------
        grad_x : array
            Gradient with respect to the last input.
        grad_weight : array or None
            Gradient of ``weight``; None without ``elementwise_affine``.
        """
        x, weight, rstd = self._require_saved()
        gx, gw = rms_norm_backward(grad_y, x, rstd, weight, self.normalized_shape,
                                   weight_offset=self.weight_offset)
        return gx, (gw if weight is not None else None)
