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


def widen(value):
    """Element -> accumulation type (float32, or float64 for float64)."""
    raise NotImplementedError  # only callable from jitted code


def narrow(value, out):
    """Accumulation value -> element of the array ``out``."""
    raise NotImplementedError


def cast(value, like):
    """``value`` converted to the float type of the scalar ``like``."""
    raise NotImplementedError


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
