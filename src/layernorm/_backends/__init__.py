"""Backends. Each native backend module exposes the same four functions.

All of them work on the kernels' canonical ``(outer, n, inner)`` views built by
:mod:`layernorm._layout`, with statistics as flat ``(outer * inner,)`` arrays in the
accumulation dtype and parameters as 1-D ``(n,)`` arrays already in the
accumulation dtype (or None)::

    layer_norm_forward(x3, weight, bias, eps, y3, mean, rstd, dtype) -> None
    rms_norm_forward(x3, weight, eps, y3, rstd, dtype) -> None
    layer_norm_backward(gy3, x3, mean, rstd, weight, gx3, dtype) -> (grad_weight, grad_bias)
    rms_norm_backward(gy3, x3, rstd, weight, gx3, dtype) -> grad_weight

``dtype`` is the canonical name of the element type of ``x3``/``y3``/``gy3``/``gx3``
("float16", "bfloat16", "float32", "float64"); 16-bit arrays may arrive as
same-size integer views. ``y3`` may be ``x3`` itself (in place). The returned
parameter gradients are 1-D ``(n,)`` arrays in the accumulation dtype, reduced over
fixed-size row blocks in a fixed order so that they are bitwise reproducible for any
thread count.
"""
