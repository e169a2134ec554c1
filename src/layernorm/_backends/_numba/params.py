"""16-bit parameters and parameter gradients converted on SIMD vectors.

The row kernels see float32/float64 parameters only (a new parameter dtype never
compiles another copy of them): float16/bfloat16 weights and biases are widened exactly
before the call, and the float32 parameter gradients are rounded to the weight's dtype
after it. NumPy's casts do that one element at a time (float16 about 1.5 ns an element
each way, bfloat16 0.4-1 ns on a Zen 4), which on a few long rows cost more than the
norm itself: a (1, 65536) float16 LayerNorm with float16 weight and bias took 10x
torch's time, all of it in the two casts. These small kernels convert a vector at a
time with the same IEEE rounding (widening is exact; narrowing rounds to nearest even,
subnormals and overflow included, as :func:`._simd.vstore` does for every 16-bit
output): NumPy's bits for every number. A NaN stays a NaN, with another payload at
times (the hardware quiets a signalling float16 NaN; ml_dtypes' bfloat16 cast makes
every NaN the canonical one, these kernels keep its payload). The backend calls them
only for parameters of at least its ``PARAM_KERNEL_MIN`` elements, where a kernel
call's fixed cost (about 2 us: an entry point lookup, a dispatcher call, an
allocation) is below the cast's; a first call of each bits dtype compiles them (a
fraction of a second).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._scalars import narrow, widen
from ._simd import get, put, raw, vload, vstore
from .diskcache import cached_njit
from .rowmath import LANES


@njit(inline="always", error_model="numpy")
def _widen_into(ov, r, bits):
    n = bits.shape[0]
    pv = raw(bits)
    body = n - n % LANES
    for i in range(0, body, LANES):
        vstore(ov, vload(pv, 0, i), r, i)
    for i in range(body, n):
        put(ov, r, i, widen(get(pv, 0, i)))


@cached_njit(error_model="numpy")
def widen_param(bits):
    """A float16 (``int16`` bits) or bfloat16 (``uint16`` bits) parameter (1-D)
    widened exactly to a new float32 array."""
    out = np.empty(bits.shape[0], dtype=np.float32)
    _widen_into(raw(out), 0, bits)
    return out


@cached_njit(error_model="numpy")
def widen_params(weight_bits, bias_bits):
    """Two 16-bit parameters of ``n`` elements (as for :func:`widen_param`) widened
    exactly into the rows of a new ``(2, n)`` float32 array: one call for a LayerNorm's
    pair."""
    out = np.empty((2, weight_bits.shape[0]), dtype=np.float32)
    ov = raw(out)
    _widen_into(ov, 0, weight_bits)
    _widen_into(ov, 1, bias_bits)
    return out


@cached_njit(error_model="numpy")
def narrow_param(values, bits):
    """The float32 ``values`` (1-D) rounded to nearest even into ``bits``, a float16
    (``int16`` bits) or bfloat16 (``uint16`` bits) array of their length."""
    n = values.shape[0]
    pv, ov = raw(values), raw(bits)
    body = n - n % LANES
    for i in range(0, body, LANES):
        vstore(ov, vload(pv, 0, i), 0, i)
    for i in range(body, n):
        put(ov, 0, i, narrow(get(pv, 0, i), ov))
    return 0
