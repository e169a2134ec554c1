"""Numba intrinsics and overloads: 16-bit float conversion and accumulation-typed casts.

Numba has no float16/bfloat16 on the CPU, so 16-bit arrays reach the kernels as their
raw bits: ``int16`` bits are float16, ``uint16`` bits are bfloat16. ``widen`` turns an
element into the accumulation type and ``narrow`` rounds an accumulation value back
to an output element (round to nearest even, NaN kept NaN).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _f32_to_half_bits(typingctx, value):
    sig = types.int16(value)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _f32_bits(typingctx, value):
    sig = types.uint32(value)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _bfloat16_bits_to_f32(typingctx, bits):
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return sig, codegen


# The Python bodies below run only under NUMBA_DISABLE_JIT (Numba's debugging mode, see
# .python_simd), on scalars and on vectors (NumPy arrays); jitted code uses the overloads.


def widen(value):
    """Element -> accumulation type (float32, or float64 for float64)."""
    a = np.array(value)  # a copy: a widened vector never aliases the array it came from
    if a.dtype == np.int16:
        a = a.view(np.float16).astype(np.float32)
    elif a.dtype == np.uint16:
        a = (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a if a.ndim else a[()]


def narrow(value, out):
    """Accumulation value -> element of the array ``out``."""
    element = out.dtype
    if element == np.int16:
        a = np.asarray(value, np.float32).astype(np.float16).view(np.int16)
    elif element == np.uint16:
        f = np.asarray(value, np.float32)
        bits = f.reshape(-1).view(np.uint32)  # arrays: NaN bits wrap without a warning
        nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        a = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40),
                     rounded >> np.uint32(16)).astype(np.uint16).reshape(f.shape)
    else:
        a = np.asarray(value, element)
    return a if a.ndim else a[()]


def cast(value, like):
    """``value`` converted to the float type of the scalar ``like``."""
    return np.asarray(like).dtype.type(value)


@overload(widen, inline="always")
def _widen(value):
    if value == types.int16:
        return lambda value: _half_bits_to_f32(value)
    if value == types.uint16:
        return lambda value: _bfloat16_bits_to_f32(value)
    if value == types.float32 or value == types.float64:
        return lambda value: value
    return None


@overload(narrow, inline="always")
def _narrow(value, out):
    element = out.dtype
    if element == types.int16:
        return lambda value, out: _f32_to_half_bits(np.float32(value))

    if element == types.uint16:

        def to_bfloat16(value, out):
            bits = _f32_bits(np.float32(value))
            if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
            bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
            return np.uint16(bits >> np.uint32(16))

        return to_bfloat16
    if element == types.float32:
        return lambda value, out: np.float32(value)
    if element == types.float64:
        return lambda value, out: np.float64(value)
    return None


@overload(cast, inline="always")
def _cast(value, like):
    if like == types.float32:
        return lambda value, like: np.float32(value)
    if like == types.float64:
        return lambda value, like: np.float64(value)
    return None
