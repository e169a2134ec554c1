"""CuPy backend: CUDA kernels (``kernels/layernorm.cu``) launched through :mod:`.launch`.

The functions below are the backend interface of :mod:`layernorm._backends`: the four
of every native backend, and the fused residual add and normalization of
:class:`~layernorm._backends.FusedAddBackend` (``add_layer_norm_forward``,
``add_rms_norm_forward``: one kernel reads x and the residual and writes h and y), the
quantized forward (``quantized_forward``: y as int8/float8 codes, with or without the
residual) and ``grad_residual`` added inside the backward kernels. They
take CuPy arrays on one device (16-bit data may arrive as same-size integer views, with
``dtype`` or ``dtypes`` naming the real element types) and launch on CuPy's current
stream. Kernels are compiled on first use, per device; importing this module imports
nothing heavy.
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


#: The backward kernels add ``grad_residual`` to grad_x themselves (before its rounding).
FUSES_GRAD_RESIDUAL = True


def layer_norm_backward(gy3: Any, x3: Any, mean: Any, rstd: Any, weight: Any, gx3: Any,
                        dtype: str, grad_residual: Any = None) -> tuple[Any, Any]:
    """LayerNorm backward into ``gx3`` (plus ``grad_residual``, a view like ``x3``, when
    given); returns ``(grad_weight, grad_bias)`` (1-D, acc dtype)."""
    return launch.backward(gy3, x3, mean, rstd, weight, gx3, dtype, rms=False,
                           grad_residual=grad_residual)


def rms_norm_backward(gy3: Any, x3: Any, rstd: Any, weight: Any, gx3: Any, dtype: str,
                      grad_residual: Any = None) -> Any:
    """RMSNorm backward into ``gx3`` (plus ``grad_residual`` when given); returns
    ``grad_weight`` (1-D, accumulation dtype)."""
    return launch.backward(gy3, x3, None, rstd, weight, gx3, dtype, rms=True,
                           grad_residual=grad_residual)[0]


def add_layer_norm_forward(x3: Any, r3: Any, weight: Any, bias: Any, eps: float, h3: Any,
                           y3: Any, mean: Any, rstd: Any, dtypes: tuple[str, str, str]) -> None:
    """``h3 = x3 + r3`` (rounded once to h's dtype), then LayerNorm of ``h3`` into ``y3``.

    One kernel: rows of unit stride (``(rows, n, 1)`` views), ``dtypes`` the dtypes of
    ``x3``, ``r3`` and ``h3``; ``y3`` has x's and is bit for bit
    :func:`layer_norm_forward` of ``h3``. Fills ``mean`` and ``rstd``. ``h3`` and ``y3``
    may each be ``x3`` or ``r3`` itself.
    """
    launch.add_forward(x3, r3, weight, bias, eps, h3, y3, mean, rstd, dtypes, rms=False)


def add_rms_norm_forward(x3: Any, r3: Any, weight: Any, eps: float, h3: Any, y3: Any,
                         rstd: Any, dtypes: tuple[str, str, str]) -> None:
    """``h3 = x3 + r3``, then RMSNorm of ``h3`` into ``y3`` in one kernel; fills ``rstd``."""
    launch.add_forward(x3, r3, weight, None, eps, h3, y3, None, rstd, dtypes, rms=True)


def quantized_forward(x3: Any, r3: Any, weight: Any, bias: Any, eps: float, h3: Any, q3: Any,
                      mean: Any, rstd: Any, fmt: str, inv_rows: Any, scale_out: Any,
                      dtypes: tuple[str, str, str]) -> None:
    """The norm of ``x3`` (of ``h3 = x3 + r3`` with a residual ``r3``) as 8-bit codes in
    ``q3``, in one kernel.

    ``fmt`` is ``"int8"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"``; ``mean`` None selects
    RMSNorm. A static scale comes as ``inv_rows`` (``1 / scale`` per row, float32),
    otherwise (``inv_rows`` None) each row's scale goes to ``scale_out``. ``dtypes`` are
    the names of x's, the residual's and h's dtypes. Rows of unit stride; float32
    accumulation.
    """
    launch.quantized_forward(x3, r3, weight, bias, eps, h3, q3, mean, rstd, fmt, inv_rows,
                             scale_out, dtypes)
