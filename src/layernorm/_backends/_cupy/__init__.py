"""CuPy backend: CUDA kernels (``kernels/layernorm.cu``) launched through :mod:`.launch`.

The four functions below are the backend interface of :mod:`layernorm._backends`. They
take CuPy arrays on one device (16-bit data may arrive as same-size integer views, with
``dtype`` naming the real element type) and launch on CuPy's current stream. Kernels
are compiled on first use, per device; importing this module imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

from . import launch


def device_scope(x: Any) -> Any:
    """Context in which allocations for ``x`` land on its device (``x.device``).

    CuPy allocates on its *current* device; an ``x`` on another device would otherwise
    get outputs, statistics and parameter copies on the wrong one.
    """
    return x.device


def layer_norm_forward(x3: Any, weight: Any, bias: Any, eps: float, y3: Any, mean: Any,
                       rstd: Any, dtype: str) -> None:
    """LayerNorm forward of the ``(outer, n, inner)`` view ``x3`` into ``y3``.

    Fills ``mean`` and ``rstd`` (1-D, ``outer * inner`` rows, accumulation dtype).
    ``y3`` may be ``x3`` (in place).
    """
    launch.forward(x3, weight, bias, eps, y3, mean, rstd, dtype, rms=False)


def rms_norm_forward(x3: Any, weight: Any, eps: float, y3: Any, rstd: Any,
                     dtype: str) -> None:
    """RMSNorm forward of ``x3`` into ``y3``; fills ``rstd``."""
    launch.forward(x3, weight, None, eps, y3, None, rstd, dtype, rms=True)


def layer_norm_backward(gy3: Any, x3: Any, mean: Any, rstd: Any, weight: Any, gx3: Any,
                        dtype: str) -> tuple[Any, Any]:
    """LayerNorm backward into ``gx3``; returns ``(grad_weight, grad_bias)`` (1-D, acc dtype)."""
    return launch.backward(gy3, x3, mean, rstd, weight, gx3, dtype, rms=False)


def rms_norm_backward(gy3: Any, x3: Any, rstd: Any, weight: Any, gx3: Any, dtype: str) -> Any:
    """RMSNorm backward into ``gx3``; returns ``grad_weight`` (1-D, accumulation dtype)."""
    return launch.backward(gy3, x3, None, rstd, weight, gx3, dtype, rms=True)[0]
