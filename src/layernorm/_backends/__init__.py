"""Backends: the native kernels (``_numba``, ``_cupy``) and the generic ``_array_api`` path.

A native backend is a module with the functions of :class:`NativeBackend`. The engine
(:mod:`layernorm._engine`) hands them the kernels' canonical ``(outer, n, inner)``
views built by :mod:`layernorm._layout`, statistics as flat ``(outer * inner,)``
arrays in the accumulation dtype, and parameters as 1-D ``(n,)`` arrays in the
accumulation dtype (the Numba backend also takes float16/bfloat16 parameters and
widens them itself), or None.

``dtype`` is the canonical name of the element type of ``x3``/``y3``/``gy3``/``gx3``
("float16", "bfloat16", "float32", "float64"); 16-bit arrays may arrive as
same-size integer views. ``y3`` may be ``x3`` itself (in place). The returned
parameter gradients are 1-D ``(n,)`` arrays in the accumulation dtype, reduced over
fixed-size row blocks in a fixed order so that they are bitwise reproducible for any
thread count.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class NativeBackend(Protocol):
    """The interface every native backend module implements."""

    def layer_norm_forward(self, x3: Any, weight: Any, bias: Any, eps: float, y3: Any,
                           mean: Any, rstd: Any, dtype: str) -> None:
        """LayerNorm forward of ``x3`` into ``y3``; fills ``mean`` and ``rstd``."""

    def rms_norm_forward(self, x3: Any, weight: Any, eps: float, y3: Any, rstd: Any,
                         dtype: str) -> None:
        """RMSNorm forward of ``x3`` into ``y3``; fills ``rstd``."""

    def layer_norm_backward(self, gy3: Any, x3: Any, mean: Any, rstd: Any, weight: Any,
                            gx3: Any, dtype: str) -> tuple[Any, Any]:
        """LayerNorm backward into ``gx3``; returns ``(grad_weight, grad_bias)``."""

    def rms_norm_backward(self, gy3: Any, x3: Any, rstd: Any, weight: Any, gx3: Any,
                          dtype: str) -> Any:
        """RMSNorm backward into ``gx3``; returns ``grad_weight``."""


class FusedAddBackend(NativeBackend, Protocol):
    """A native backend that also adds the residual and normalizes in one pass.

    Optional: the engine (:func:`layernorm._engine.fused_add`) looks these functions up
    and composes ``x + residual`` and the forward where a backend has none. It calls
    them only on rows (``inner == 1``) of unit stride whose x, residual and h dtypes
    share one accumulation dtype, with h in x's dtype or in the accumulation dtype;
    ``dtypes`` names the dtypes of ``x3``, ``r3`` and ``h3`` (``y3`` has x's).
    ``h3`` and ``y3`` may each be ``x3`` or ``r3`` itself, never a partial overlap, and
    never each other. ``h3`` gets ``x3 + r3`` computed in the accumulation dtype and
    rounded once; ``y3`` the forward of ``h3``, bit for bit what ``*_forward`` gives.
    """

    def add_layer_norm_forward(self, x3: Any, r3: Any, weight: Any, bias: Any, eps: float,
                               h3: Any, y3: Any, mean: Any, rstd: Any,
                               dtypes: tuple[str, str, str]) -> None:
        """``h3 = x3 + r3``, then LayerNorm of ``h3`` into ``y3``; fills ``mean``, ``rstd``."""

    def add_rms_norm_forward(self, x3: Any, r3: Any, weight: Any, eps: float, h3: Any,
                             y3: Any, rstd: Any, dtypes: tuple[str, str, str]) -> None:
        """``h3 = x3 + r3``, then RMSNorm of ``h3`` into ``y3``; fills ``rstd``."""


class DeviceBackend(NativeBackend, Protocol):
    """A native backend whose arrays live on one of several devices (CUDA)."""

    def device_scope(self, x: Any) -> AbstractContextManager[Any]:
        """Context in which new arrays are allocated on the device of ``x``."""
