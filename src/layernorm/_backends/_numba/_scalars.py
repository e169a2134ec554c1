"""Numba intrinsics and typed builtins: 16-bit float conversion and accumulation-typed casts.

Numba has no float16/bfloat16 on the CPU, so 16-bit arrays reach the kernels as their
raw bits: ``int16`` bits are float16, ``uint16`` bits are bfloat16. ``widen`` turns an
element into the accumulation type and ``narrow`` rounds an accumulation value back
to an output element (round to nearest even, NaN kept NaN).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.typing.templates import AbstractTemplate, infer_global, signature
from numba.extending import intrinsic, lower_builtin


@intrinsic
def _f32_bits(typingctx, value):
    sig = types.uint32(value)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


# The Python bodies below run only under NUMBA_DISABLE_JIT (Numba's debugging mode, see
# .python_simd), on scalars and on vectors (NumPy arrays); jitted code uses the typed
# builtins registered below.


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
    """``value`` converted to the float type of the scalar ``like`` (one beyond its range
    becomes infinity, as the compiled conversion gives, without NumPy's warning)."""
    with np.errstate(over="ignore"):
        return np.asarray(like).dtype.type(value)


# ``widen``, ``narrow`` and ``cast`` are typed by a template and lowered directly (as
# ``_simd`` does its operators) rather than by overloads: an overload compiles a small
# function per signature (or, inlined, is typed again at every call site), which cost a
# tenth of a cold first call; these lower to one or two LLVM instructions where used.


def register_builtin(function, typer, lower) -> None:
    """Type calls of the Python function ``function`` in jitted code with ``typer``
    (argument types -> a signature, or None) and lower them with ``lower`` (Numba's
    ``(context, builder, sig, args)``): a typed builtin, compiled where it is called."""

    @infer_global(function)
    class _Typer(AbstractTemplate):
        def generic(self, args, kws):
            return None if kws else typer(*args)

    lower_builtin(function, types.VarArg(types.Any))(lower)


def _widen_type(value):
    if value == types.int16 or value == types.uint16:
        return signature(types.float32, value)
    if value == types.float32 or value == types.float64:
        return signature(value, value)
    return None


def widen_ir(builder, v, value):
    """LLVM IR of :func:`widen` of the scalar ``v`` of Numba type ``value``."""
    if value == types.int16:
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())
    if value == types.uint16:
        wide = builder.shl(builder.zext(v, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return v


def _widen_lower(context, builder, sig, args):
    return widen_ir(builder, args[0], sig.args[0])


def _to_bfloat16_bits(value):
    bits = _f32_bits(value)
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16(bits >> np.uint32(16))


def _narrow_type(value, out):
    element = getattr(out, "dtype", None)
    if element not in (types.int16, types.uint16, types.float32, types.float64):
        return None
    if not isinstance(value, types.Number):
        return None
    return signature(element, value, out)


def _narrow_lower(context, builder, sig, args):
    element = sig.return_type
    sixteen = element in (types.int16, types.uint16)
    v = context.cast(builder, args[0], sig.args[0], types.float32 if sixteen else element)
    if element == types.int16:
        return builder.bitcast(builder.fptrunc(v, ir.HalfType()), ir.IntType(16))
    if element == types.uint16:
        return context.compile_internal(builder, _to_bfloat16_bits,
                                        signature(types.uint16, types.float32), [v])
    return v


def _cast_type(value, like):
    if like not in (types.float32, types.float64) or not isinstance(value, types.Number):
        return None
    return signature(like, value, like)


def _cast_lower(context, builder, sig, args):
    return context.cast(builder, args[0], sig.args[0], sig.return_type)


def imin(a, b):
    """The smaller of two integers (Python's ``min``, typed and lowered directly)."""
    return min(a, b)


def imax(a, b):
    """The larger of two integers (Python's ``max``, typed and lowered directly)."""
    return max(a, b)


# Numba's own min/max are overloads: each signature compiles a small function, which
# cost a first backward (or short-row forward) 0.15 s; these are one compare and select.


def _integers_type(a, b):
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        return None
    both = a if a == b else types.intp if a.signed or b.signed else types.uintp
    return signature(both, a, b)


def _extremum_lower(predicate: str):
    def lower(context, builder, sig, args):
        a, b = (context.cast(builder, value, ty, sig.return_type)
                for value, ty in zip(args, sig.args, strict=True))
        compare = builder.icmp_signed if sig.return_type.signed else builder.icmp_unsigned
        return builder.select(compare(predicate, a, b), a, b)

    return lower


register_builtin(widen, _widen_type, _widen_lower)
register_builtin(narrow, _narrow_type, _narrow_lower)
register_builtin(cast, _cast_type, _cast_lower)
register_builtin(imin, _integers_type, _extremum_lower("<"))
register_builtin(imax, _integers_type, _extremum_lower(">"))
