"""Drop-in :class:`torch.nn.LayerNorm` and :class:`torch.nn.RMSNorm` backed by layernorm.

The classes subclass torch's own modules, so the constructor signature, parameters,
``state_dict`` keys, ``repr``, ``reset_parameters`` and ``isinstance`` checks are exactly
torch's; only ``forward`` runs :func:`layernorm.layer_norm` / :func:`layernorm.rms_norm`
(the Numba kernels for CPU tensors, the CUDA kernels for CUDA tensors, with autograd
through our backward kernels). Importing this module imports torch; importing
:mod:`layernorm` does not.

Examples
--------
>>> import torch
>>> import layernorm.torch as lnt
>>> ref = torch.nn.LayerNorm(8)
>>> layer = lnt.LayerNorm(8)
>>> layer.load_state_dict(ref.state_dict())
<All keys matched successfully>
>>> x = torch.randn(4, 8)
>>> torch.allclose(layer(x), ref(x), atol=1e-6)
True
"""

from __future__ import annotations

from typing import Any

import torch

from ._api import layer_norm, rms_norm
from ._validate import check_weight_offset

__all__ = ["LayerNorm", "RMSNorm"]

# ``torch.fx.symbolic_trace`` of a model holding these modules records their calls of
# layer_norm / rms_norm as graph nodes (run on real tensors when the graph runs) instead
# of tracing into the library's Python code with proxies, which its control flow
# refuses; torch's own norm modules are leaves of such a trace.
torch.fx.wrap("layer_norm")
torch.fx.wrap("rms_norm")


class _OffsetGain:
    """``weight_offset`` on top of a torch norm module: the gain is ``weight + offset``,
    ``reset_parameters`` fills ``weight`` with ``1 - offset``, ``repr`` shows a nonzero one."""

    weight: Any
    weight_offset: float

    def _set_offset(self, weight_offset: Any, elementwise_affine: bool) -> None:
        self.weight_offset = check_weight_offset(weight_offset, elementwise_affine)

    def _fill_offset(self) -> None:
        if self.weight is not None and getattr(self, "weight_offset", 0.0) != 0.0:
            with torch.no_grad():
                self.weight.fill_(1.0 - self.weight_offset)

    def _offset_repr(self) -> str:
        offset = getattr(self, "weight_offset", 0.0)
        return f", weight_offset={offset}" if offset != 0.0 else ""


class LayerNorm(_OffsetGain, torch.nn.LayerNorm):
    """:class:`torch.nn.LayerNorm` computed by :func:`layernorm.layer_norm`.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        Trailing dimensions to normalize.
    eps : float, default 1e-5
        Added to the variance.
    elementwise_affine : bool, default True
        Learn a per-element ``weight`` (initialized to ones) and ``bias`` (zeros).
    bias : bool, default True
        Learn ``bias`` too (only with ``elementwise_affine``).
    weight_offset : float, default 0.0
        Keyword only. The gain is ``weight + weight_offset``; ``weight`` starts at
        ``1 - weight_offset``.
    device, dtype : optional
        Where and in which dtype the parameters are created, as in torch.

    Examples
    --------
    >>> import torch
    >>> from layernorm.torch import LayerNorm
    >>> LayerNorm(768, bias=False)
    LayerNorm((768,), eps=1e-05, elementwise_affine=True, bias=False)
    >>> y = LayerNorm(4)(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    >>> y.grad_fn.name()  # autograd runs layernorm's backward kernels
    '_NormFunctionBackward'
    >>> y.detach().round(decimals=3)
    tensor([[-1.3420, -0.4470,  0.4470,  1.3420]])
    """

    def __init__(self, *args: Any, weight_offset: float = 0.0, **kwargs: Any) -> None:
        # Before torch's __init__, which calls reset_parameters.
        self._set_offset(weight_offset, kwargs.get("elementwise_affine",
                                                   args[2] if len(args) > 2 else True))
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        """torch's initialization, with ``weight = 1 - weight_offset``."""
        super().reset_parameters()
        self._fill_offset()

    def extra_repr(self) -> str:
        """torch's, then a nonzero ``weight_offset``."""
        return super().extra_repr() + self._offset_repr()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize the trailing ``normalized_shape`` dimensions of ``input``."""
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps,
                          weight_offset=self.weight_offset)


class RMSNorm(_OffsetGain, torch.nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` computed by :func:`layernorm.rms_norm`.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        Trailing dimensions to normalize.
    eps : float, optional
        Added to the mean square; ``None`` means the machine epsilon of the
        accumulation dtype, as in torch.
    elementwise_affine : bool, default True
        Learn a per-element ``weight`` (initialized to ones).
    weight_offset : float, default 0.0
        Keyword only. The gain is ``weight + weight_offset`` (Gemma uses 1.0); ``weight``
        starts at ``1 - weight_offset``.
    device, dtype : optional
        Where and in which dtype the parameter is created, as in torch.

    Examples
    --------
    >>> import torch
    >>> from layernorm.torch import RMSNorm
    >>> RMSNorm(4)
    RMSNorm((4,), eps=None, elementwise_affine=True)
    >>> with torch.no_grad():
    ...     RMSNorm(2, eps=0.0)(torch.tensor([[3.0, 4.0]], dtype=torch.float64))
    tensor([[0.8485, 1.1314]], dtype=torch.float64)
    """

    def __init__(self, *args: Any, weight_offset: float = 0.0, **kwargs: Any) -> None:
        self._set_offset(weight_offset, kwargs.get("elementwise_affine",
                                                   args[2] if len(args) > 2 else True))
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        """torch's initialization, with ``weight = 1 - weight_offset``."""
        super().reset_parameters()
        self._fill_offset()

    def extra_repr(self) -> str:
        """torch's, then a nonzero ``weight_offset``."""
        return super().extra_repr() + self._offset_repr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the trailing ``normalized_shape`` dimensions of ``x``."""
        return rms_norm(x, self.normalized_shape, self.weight, self.eps,
                        weight_offset=self.weight_offset)
