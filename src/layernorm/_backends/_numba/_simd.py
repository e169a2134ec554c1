"""Fixed-width SIMD vectors for the Numba kernels, built from LLVM vector types.

Numba does not vectorize floating-point reductions (LLVM may not reorder them without
reassociation, which would also make results depend on the machine). The kernels
therefore spell out their lanes as an explicit ``<WIDTH x float>`` (or ``double``)
value, :class:`Vec`. Every operation on a :class:`Vec` is an IEEE operation per lane,
exactly the one a scalar loop over the lanes would perform, so a vectorized kernel and
any other kernel doing the same per-lane operations agree bit for bit, on any machine.

Only jitted code can use what this module defines:

* ``a + b``, ``a - b``, ``a * b``, ``a / b`` on two vectors of the same type;
* :func:`fma` ``(a, b, c)``: ``a * b + c`` rounded once (IEEE fusedMultiplyAdd), on three
  vectors or three scalars of one type: an exact operation, so the same bits on every
  machine (never a contraction the compiler chose);
* :func:`splat` (scalar -> vector), :func:`lane` (vector -> scalar);
* :func:`load2` / :func:`store2` of ``WIDTH`` consecutive elements of a row of a 2-D
  array whose last axis has unit stride, and :func:`vload` / :func:`vstore` of a row of
  a :class:`Raw` view, widening 16-bit floats (float16 as ``int16`` bits, bfloat16 as
  ``uint16`` bits) to float32 and rounding back to nearest even on store;
  :func:`vstore_nt` is :func:`vstore` with a non-temporal (streaming) hint, for
  addresses aligned to ``min(64, vector bytes)`` only, and :func:`store_fence` orders
  them before the stores that follow (a kernel ends with it, before other threads read
  its output);
* :func:`down8`, :func:`down4`, :func:`down2`, :func:`down1`: lane ``j + h`` moved to
  lane ``j`` (the fixed lane tree of the reductions);
* :func:`fold8`, :func:`fold4`, :func:`fold2`, :func:`fold1` ``(a, b)``: one level of that
  tree for several rows at once. ``a`` and ``b`` hold blocks of ``2h`` lanes, one block
  per row; the result holds every block's ``lane j + lane j + h`` (``j < h``), ``a``'s
  blocks first. Folding 16 row vectors pairwise with ``h = 8, 4, 2, 1`` leaves row
  ``i``'s tree sum in lane ``i``, computed by the same additions as the tree of one row;
* :func:`sqrt` of every lane; :func:`wide` (every lane to float64, exactly) and
  :func:`rounded` (a float64 vector back to the accumulation type, to nearest);
* :func:`vabsmax` / :func:`hmax_bits` (the running and final ``max |v|`` of float32
  vectors, NaN-propagating, on bit patterns) and :func:`store_int8`,
  :func:`store_float8_e4m3fn`, :func:`store_float8_e5m2` (saturate, round half to even
  and store a vector's 8-bit codes into a ``uint8`` :class:`Raw`), for the quantized
  outputs;
* :func:`vaddress` of an element, for alignment decisions, and :func:`prefetch_at`
  (:func:`prefetch_l2_at`: into L2 only) of a cache line at such an address (a hint: no
  effect on results);
* :func:`runtime` of an integer constant, so that passing it to a helper does not compile
  a specialization per value;
* :func:`alive` keeps a local array allocated up to that point (views borrow memory);
  :func:`scratch_block` is a small :class:`Raw` block on the stack instead of an array.
"""

from __future__ import annotations

import operator
import platform

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.core.typing.templates import AbstractTemplate, infer_global, signature
from numba.extending import intrinsic, lower_builtin, models, register_model

from ._scalars import register_builtin, widen, widen_ir

WIDTH = 16


class Vec(types.Type):
    """A ``WIDTH``-lane vector of float32 or float64 (the accumulation type)."""

    def __init__(self, dtype: types.Float) -> None:
        self.dtype = dtype
        super().__init__(name=f"Vec{WIDTH}({dtype})")


vec_f32 = Vec(types.float32)
vec_f64 = Vec(types.float64)


def _ir_float(dtype: types.Type) -> ir.Type:
    return ir.DoubleType() if dtype == types.float64 else ir.FloatType()


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(_ir_float(fe_type.dtype), WIDTH))


def _vec_of(dtype: types.Type) -> Vec:
    return vec_f64 if dtype == types.float64 else vec_f32


def _acc_of(element: types.Type) -> types.Float:
    """Accumulation type of an array element type (16-bit bits -> float32)."""
    return types.float64 if element == types.float64 else types.float32


# --------------------------------------------------------------------------- arithmetic


def _register_operator(op, instruction: str) -> None:
    # A typing template plus a direct lowering: cheaper to compile than an @overload
    # (no per-call-site inlining) and exactly one LLVM vector instruction.
    @infer_global(op)
    class _Typer(AbstractTemplate):
        def generic(self, args, kws):
            if len(args) == 2 and isinstance(args[0], Vec) and args[0] == args[1]:
                return signature(args[0], *args)
            return None

    @lower_builtin(op, Vec, Vec)
    def _lower(context, builder, sig, args):
        return getattr(builder, instruction)(args[0], args[1])


for _op, _instruction in ((operator.add, "fadd"), (operator.sub, "fsub"), (operator.mul, "fmul"),
                          (operator.truediv, "fdiv")):
    _register_operator(_op, _instruction)


@intrinsic
def runtime(typingctx, value):
    """``value`` typed as an ordinary integer or bool, not as the constant it may be.

    Numba compiles a jitted helper once per distinct *constant* argument: a row loop
    called with the constant first row 0 (serial kernels, gathered rows) would compile
    again beside the one the parallel kernels call with a variable row. LLVM still sees
    the constant.
    """
    if not isinstance(value, (types.Integer, types.Boolean)):
        return None
    plain = types.unliteral(value)

    def codegen(context, builder, sig, args):
        return context.cast(builder, args[0], value, plain)

    return plain(value), codegen


@intrinsic
def alive(typingctx, value):
    """Nothing: a use of ``value``, which Numba therefore frees no earlier.

    Numba frees a local array right after its last use in the source. A :class:`Raw`
    view only borrows its array's memory, so a function that reads or writes a local
    array through a view calls ``alive(array)`` after its last access (measured: without
    it, the next allocation of the same size reuses the memory).
    """

    def codegen(context, builder, sig, args):
        return context.get_dummy_value()

    return types.none(value), codegen


@intrinsic
def splat(typingctx, value):
    """A vector with every lane equal to the float32/float64 scalar ``value``."""
    if value not in (types.float32, types.float64):
        return None
    vt = _vec_of(value)

    def codegen(context, builder, sig, args):
        llty = ir.VectorType(_ir_float(value), WIDTH)
        one = builder.insert_element(ir.Constant(llty, ir.Undefined), args[0],
                                     ir.Constant(ir.IntType(32), 0))
        mask = ir.Constant(ir.VectorType(ir.IntType(32), WIDTH), [0] * WIDTH)
        return builder.shuffle_vector(one, ir.Constant(llty, ir.Undefined), mask)

    return vt(value), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` with a single rounding: three vectors, or three float scalars."""
    if not (a == b == c and (isinstance(a, Vec) or a in (types.float32, types.float64))):
        return None

    def codegen(context, builder, sig, args):
        return _fma_ir(builder, *args)

    return a(a, b, c), codegen


def _fma_ir(builder, a, b, c):
    ty = a.type
    element = ty.element if isinstance(ty, ir.VectorType) else ty
    suffix = "f64" if element == ir.DoubleType() else "f32"
    if isinstance(ty, ir.VectorType):
        suffix = f"v{WIDTH}{suffix}"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * 3),
                                        f"llvm.fma.{suffix}")
    return builder.call(fn, [a, b, c])


@intrinsic
def lane(typingctx, vec, index):
    """Lane ``index`` of ``vec`` as a scalar."""
    if not isinstance(vec, Vec) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        idx = builder.trunc(args[1], ir.IntType(32)) if index.bitwidth > 32 else args[1]
        return builder.extract_element(args[0], idx)

    return vec.dtype(vec, index), codegen


def _down(h: int):
    @intrinsic
    def impl(typingctx, vec):
        if not isinstance(vec, Vec):
            return None

        def codegen(context, builder, sig, args):
            mask = ir.Constant(ir.VectorType(ir.IntType(32), WIDTH),
                               [(j + h) % WIDTH for j in range(WIDTH)])
            return builder.shuffle_vector(args[0], args[0], mask)

        return vec(vec), codegen

    return impl


down8 = _down(8)
down4 = _down(4)
down2 = _down(2)
down1 = _down(1)


def _fold(h: int, largest: bool = False):
    # a and b each hold WIDTH // (2h) blocks of 2h lanes; the result holds their
    # WIDTH // h blocks of h lanes, a's first: block lane j is lane j + lane j + h
    # (``largest``: the larger bit pattern of the two lanes, as :func:`vabsmax`).
    per_vector = WIDTH // (2 * h)
    low = []
    for k in range(WIDTH):
        block, offset = divmod(k, h)
        source = block if block < per_vector else block - per_vector
        low.append(source * 2 * h + offset + (0 if block < per_vector else WIDTH))
    low_mask = ir.Constant(ir.VectorType(ir.IntType(32), WIDTH), low)
    high_mask = ir.Constant(ir.VectorType(ir.IntType(32), WIDTH), [i + h for i in low])

    @intrinsic
    def impl(typingctx, a, b):
        if not isinstance(a, Vec) or a != b:
            return None

        def codegen(context, builder, sig, args):
            low_lanes = builder.shuffle_vector(args[0], args[1], low_mask)
            high_lanes = builder.shuffle_vector(args[0], args[1], high_mask)
            if not largest:
                return builder.fadd(low_lanes, high_lanes)
            low_bits = _bits_of(builder, low_lanes)
            high_bits = _bits_of(builder, high_lanes)
            top = builder.select(builder.icmp_signed(">", high_bits, low_bits), high_bits,
                                 low_bits)
            return builder.bitcast(top, args[0].type)

        if largest and not _is_f32_vec(a):
            return None
        return a(a, b), codegen

    return impl


fold8 = _fold(8)
fold4 = _fold(4)
fold2 = _fold(2)
fold1 = _fold(1)
#: :func:`fold8` .. :func:`fold1` of :func:`vabsmax` vectors: the larger bit pattern of
#: each pair of lanes instead of their sum (exact, so any order gives the same bits).
fold8_max = _fold(8, largest=True)
fold4_max = _fold(4, largest=True)
fold2_max = _fold(2, largest=True)
fold1_max = _fold(1, largest=True)


@intrinsic
def sqrt(typingctx, vec):
    """The IEEE square root of every lane (correctly rounded, like the scalar one)."""
    if not isinstance(vec, Vec):
        return None

    def codegen(context, builder, sig, args):
        ty = args[0].type
        suffix = "f64" if ty.element == ir.DoubleType() else "f32"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty]),
                                            f"llvm.sqrt.v{WIDTH}{suffix}")
        return builder.call(fn, args)

    return vec(vec), codegen


@intrinsic
def wide(typingctx, vec):
    """``vec`` with every lane converted exactly to float64 (a float64 vector unchanged)."""
    if not isinstance(vec, Vec):
        return None

    def codegen(context, builder, sig, args):
        if vec.dtype == types.float64:
            return args[0]
        return builder.fpext(args[0], ir.VectorType(ir.DoubleType(), WIDTH))

    return vec_f64(vec), codegen


@intrinsic
def rounded(typingctx, vec, like):
    """The float64 vector ``vec`` rounded to nearest to the type of the scalar ``like``."""
    if vec != vec_f64 or like not in (types.float32, types.float64):
        return None

    def codegen(context, builder, sig, args):
        if like == types.float64:
            return args[0]
        return builder.fptrunc(args[0], ir.VectorType(ir.FloatType(), WIDTH))

    return _vec_of(like)(vec, like), codegen


# --------------------------------------------------------------------------- memory


def _element_pointer(context, builder, arrty, arr, indices):
    ary = context.make_array(arrty)(context, builder, arr)
    shapes = cgutils.unpack_tuple(builder, ary.shape, arrty.ndim)
    strides = cgutils.unpack_tuple(builder, ary.strides, arrty.ndim)
    return cgutils.get_item_pointer2(context, builder, ary.data, shapes, strides,
                                     arrty.layout, indices)


def _index_types_ok(arr: types.Type, indices: tuple) -> bool:
    return (isinstance(arr, types.Array) and arr.ndim == len(indices)
            and all(isinstance(i, types.Integer) for i in indices)
            and arr.dtype in (types.float32, types.float64, types.int16, types.uint16))


def _widen_vector(builder, raw, element):
    if element == types.int16:  # float16 bits
        half = builder.bitcast(raw, ir.VectorType(ir.HalfType(), WIDTH))
        return builder.fpext(half, ir.VectorType(ir.FloatType(), WIDTH))
    if element == types.uint16:  # bfloat16 bits: the high half of a float32
        wide = builder.zext(raw, ir.VectorType(ir.IntType(32), WIDTH))
        wide = builder.shl(wide, _splat_i32(16))
        return builder.bitcast(wide, ir.VectorType(ir.FloatType(), WIDTH))
    return raw


def _load_widened(context, builder, ptr, element):
    """The ``WIDTH`` elements of type ``element`` at ``ptr``, widened to a :class:`Vec`."""
    raw_ty = ir.VectorType(_element_ir(context, element), WIDTH)
    loaded = builder.load(builder.bitcast(ptr, raw_ty.as_pointer()),
                          align=element.bitwidth // 8)
    return _widen_vector(builder, loaded, element)


def _splat_i32(value: int) -> ir.Constant:
    return ir.Constant(ir.VectorType(ir.IntType(32), WIDTH), [value] * WIDTH)


def _narrow_vector(builder, value, element):
    if element == types.int16:
        half = builder.fptrunc(value, ir.VectorType(ir.HalfType(), WIDTH))
        return builder.bitcast(half, ir.VectorType(ir.IntType(16), WIDTH))
    if element == types.uint16:
        bits = builder.bitcast(value, ir.VectorType(ir.IntType(32), WIDTH))
        if not _bfloat16_instruction():
            return _bfloat16_software(builder, bits)
        return _bfloat16_hardware(builder, value, bits)
    return value


def _bfloat16_software(builder, bits):
    # Round to nearest even; a NaN stays a (quiet) NaN. Same as the scalar narrow.
    is_nan = builder.icmp_unsigned(">", builder.and_(bits, _splat_i32(0x7FFFFFFF)),
                                   _splat_i32(0x7F800000))
    high = builder.lshr(bits, _splat_i32(16))
    quiet = builder.or_(high, _splat_i32(0x40))
    odd = builder.and_(high, _splat_i32(1))
    rounded = builder.lshr(builder.add(builder.add(bits, _splat_i32(0x7FFF)), odd),
                           _splat_i32(16))
    chosen = builder.select(is_nan, quiet, rounded)
    return builder.trunc(chosen, ir.VectorType(ir.IntType(16), WIDTH))


class _BFloat(ir.types.Type):
    """LLVM's ``bfloat`` (llvmlite's IR builder has no type for it)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _bfloat16_instruction() -> bool:
    """Whether the target CPU has AVX512-BF16 (Numba compiles for the host's features)."""
    return WIDTH == 16 and _has_feature("avx512bf16")


def _has_feature(name: str) -> bool:
    """Whether the target CPU has ``name`` (Numba compiles for the host's features)."""
    import llvmlite.binding as ll
    from numba.core import config

    features = config.CPU_FEATURES
    if features is None:
        features = ll.get_host_cpu_features().flatten()
    return f"+{name}" in features.split(",")


def _denormal_lanes(builder, value, bits):
    """An ``i1`` per lane: is that lane a denormal (nonzero, exponent 0)?"""
    if _has_feature("avx512dq"):
        # vfpclassps, category 0x20 (denormal): one instruction.
        mask_ty = ir.VectorType(ir.IntType(1), WIDTH)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(mask_ty, [value.type, ir.IntType(32)]),
            "llvm.x86.avx512.fpclass.ps.512")
        return builder.call(fn, [value, ir.Constant(ir.IntType(32), 0x20)])
    exponent = builder.and_(bits, _splat_i32(0x7F800000))
    fraction = builder.and_(bits, _splat_i32(0x007FFFFF))
    return builder.and_(builder.icmp_unsigned("==", exponent, _splat_i32(0)),
                        builder.icmp_unsigned("!=", fraction, _splat_i32(0)))


def _bfloat16_hardware(builder, value, bits):
    """``vcvtneps2bf16``: the same rounding as the software path, except that it flushes
    denormal inputs to zero. A vector holding one runs the software path instead."""
    i16x = ir.VectorType(ir.IntType(16), WIDTH)
    denormal = _denormal_lanes(builder, value, bits)
    mask = builder.bitcast(denormal, ir.IntType(WIDTH))
    any_denormal = builder.icmp_unsigned("!=", mask, ir.Constant(ir.IntType(WIDTH), 0))
    with builder.if_else(any_denormal, likely=False) as (exact, fast):
        with exact:
            software = _bfloat16_software(builder, bits)
            exact_block = builder.block
        with fast:
            bf16x = ir.VectorType(_BFloat(), WIDTH)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(bf16x, [value.type]),
                "llvm.x86.avx512bf16.cvtneps2bf16.512")
            hardware = builder.bitcast(builder.call(fn, [value]), i16x)
            fast_block = builder.block
    result = builder.phi(i16x)
    result.add_incoming(software, exact_block)
    result.add_incoming(hardware, fast_block)
    return result


def _element_ir(context, element):
    return context.get_data_type(element)


def _load_impl(ndim: int):
    def typer(typingctx, arr, *indices):
        if len(indices) != ndim or not _index_types_ok(arr, indices):
            return None
        vt = _vec_of(_acc_of(arr.dtype))

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, arr, args[0], args[1:])
            return _load_widened(context, builder, ptr, arr.dtype)

        return vt(arr, *indices), codegen

    return intrinsic(lambda typingctx, arr, i, j: typer(typingctx, arr, i, j))


def _store_impl(ndim: int):
    def typer(typingctx, arr, vec, *indices):
        if len(indices) != ndim or not _index_types_ok(arr, indices):
            return None
        if not isinstance(vec, Vec) or vec.dtype != _acc_of(arr.dtype):
            return None

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, arr, args[0], args[2:])
            raw = _narrow_vector(builder, args[1], arr.dtype)
            vptr = builder.bitcast(ptr, raw.type.as_pointer())
            builder.store(raw, vptr, align=arr.dtype.bitwidth // 8)
            return context.get_dummy_value()

        return types.none(arr, vec, *indices), codegen

    return intrinsic(lambda typingctx, arr, vec, i, j: typer(typingctx, arr, vec, i, j))


#: ``load2(arr, i, j)``: ``arr[i, j:j + WIDTH]`` of a 2-D array, widened to the
#: accumulation type.
load2 = _load_impl(2)
#: ``store2(arr, vec, i, j)``: ``arr[i, j:j + WIDTH] = vec`` (rounded to the element type).
store2 = _store_impl(2)


# --------------------------------------------------------------------------- raw views


class Raw(types.Type):
    """A borrowed, reference-count-free view of a 1-D or 2-D array's data.

    Passing arrays through the kernels' helper functions makes Numba emit reference
    count updates (atomic calls) per row; a :class:`Raw` is just a data pointer and a
    row stride in bytes, so the per-row helpers cost nothing to call. The array it was
    made from must outlive it (it is always a kernel argument or a kernel's scratch).
    Elements along a row are assumed contiguous (unit stride).
    """

    def __init__(self, dtype: types.Type) -> None:
        self.dtype = dtype
        super().__init__(name=f"Raw({dtype})")


@register_model(Raw)
class _RawModel(models.StructModel):
    def __init__(self, dmm, fe_type):
        members = [("data", types.CPointer(fe_type.dtype)), ("stride", types.intp)]
        super().__init__(dmm, fe_type, members)


@intrinsic
def raw(typingctx, arr):
    """Borrowed :class:`Raw` view of a 1-D or 2-D array (row ``r`` starts at ``r * stride``)."""
    if not isinstance(arr, types.Array) or arr.ndim not in (1, 2):
        return None
    rt = Raw(arr.dtype)

    def codegen(context, builder, sig, args):
        ary = context.make_array(arr)(context, builder, args[0])
        out = cgutils.create_struct_proxy(rt)(context, builder)
        out.data = ary.data
        if arr.ndim == 2:
            out.stride = cgutils.unpack_tuple(builder, ary.strides, 2)[0]
        else:
            out.stride = context.get_constant(types.intp, 0)
        return out._getvalue()

    return rt(arr), codegen


@intrinsic
def scratch_block(typingctx, rows, cols, like):
    """A :class:`Raw` view of ``rows`` x ``cols`` (integer constants) uninitialized
    elements of ``like``'s type (a float scalar or type) in the calling function's stack
    frame, 64-byte aligned: a small scratch block that needs no NumPy allocation, whose
    implementation (``np.empty``, ``np.full``, ``np.zeros``: about a quarter of a second
    of a cold first call, measured) would otherwise be compiled with the kernel. It lives
    as long as the function it is lowered into (that of the kernel it is inlined into)."""
    dtype = like.instance_type if isinstance(like, types.NumberClass) else like
    if not (isinstance(rows, types.IntegerLiteral) and isinstance(cols, types.IntegerLiteral)
            and isinstance(dtype, types.Float)):
        return None
    rt = Raw(dtype)
    width = cols.literal_value
    count = rows.literal_value * width

    def codegen(context, builder, sig, args):
        lty = context.get_data_type(dtype)
        slot = cgutils.alloca_once(builder, ir.ArrayType(lty, count))
        slot.align = 64
        out = cgutils.create_struct_proxy(rt)(context, builder)
        out.data = builder.bitcast(slot, lty.as_pointer())
        out.stride = context.get_constant(types.intp, width * dtype.bitwidth // 8)
        return out._getvalue()

    return rt(rows, cols, like), codegen


def _raw_pointer(context, builder, rawty, value, r, i):
    view = cgutils.create_struct_proxy(rawty)(context, builder, value=value)
    base = builder.ptrtoint(view.data, ir.IntType(64))
    size = rawty.dtype.bitwidth // 8
    off = builder.add(builder.mul(r, view.stride),
                      builder.mul(i, ir.Constant(ir.IntType(64), size)))
    return builder.inttoptr(builder.add(base, off),
                            context.get_data_type(rawty.dtype).as_pointer())


def _int_ok(*tys: types.Type) -> bool:
    return all(isinstance(t, types.Integer) for t in tys)


def _as_i64(builder, value, ty):
    if ty.bitwidth < 64:
        return builder.sext(value, ir.IntType(64)) if ty.signed else \
            builder.zext(value, ir.IntType(64))
    return value


@intrinsic
def vload(typingctx, view, r, i):
    """``WIDTH`` elements of row ``r`` of a :class:`Raw` from column ``i``, widened."""
    if not isinstance(view, Raw) or not _int_ok(r, i):
        return None
    vt = _vec_of(_acc_of(view.dtype))

    def codegen(context, builder, sig, args):
        ptr = _raw_pointer(context, builder, view, args[0], _as_i64(builder, args[1], r),
                           _as_i64(builder, args[2], i))
        return _load_widened(context, builder, ptr, view.dtype)

    return vt(view, r, i), codegen


@intrinsic
def vload_tail(typingctx, view, r, i, count, fill):
    """Lanes ``j < count`` from row ``r`` of a :class:`Raw` at column ``i + j`` (widened),
    the other lanes ``fill`` (a scalar of the vector's type); ``1 <= count <= WIDTH``.

    A row's last partial vector without a scratch array: only elements ``i ..
    i + count - 1`` are read (a lane past the end reads the last one again and discards
    it), so the load never leaves the row.
    """
    if not isinstance(view, Raw) or not _int_ok(r, i, count):
        return None
    acc = _acc_of(view.dtype)
    if fill != acc:
        return None
    vt = _vec_of(acc)

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        row = _as_i64(builder, args[1], r)
        start = _as_i64(builder, args[2], i)
        n = _as_i64(builder, args[3], count)
        last = builder.sub(n, ir.Constant(i64, 1))
        element = _element_ir(context, view.dtype)
        loaded = ir.Constant(ir.VectorType(element, WIDTH), ir.Undefined)
        for j in range(WIDTH):
            k = ir.Constant(i64, j)
            at = builder.select(builder.icmp_signed("<", k, n), k, last)
            ptr = _raw_pointer(context, builder, view, args[0], row, builder.add(start, at))
            loaded = builder.insert_element(loaded, builder.load(ptr),
                                            ir.Constant(ir.IntType(32), j))
        wide = _widen_vector(builder, loaded, view.dtype)
        lanes = ir.Constant(ir.VectorType(i64, WIDTH), list(range(WIDTH)))
        counts = builder.insert_element(ir.Constant(ir.VectorType(i64, WIDTH), ir.Undefined),
                                        n, ir.Constant(ir.IntType(32), 0))
        counts = builder.shuffle_vector(counts, ir.Constant(counts.type, ir.Undefined),
                                        ir.Constant(ir.VectorType(ir.IntType(32), WIDTH),
                                                    [0] * WIDTH))
        fills = builder.insert_element(ir.Constant(wide.type, ir.Undefined), args[4],
                                       ir.Constant(ir.IntType(32), 0))
        fills = builder.shuffle_vector(fills, ir.Constant(wide.type, ir.Undefined),
                                       ir.Constant(ir.VectorType(ir.IntType(32), WIDTH),
                                                   [0] * WIDTH))
        return builder.select(builder.icmp_signed("<", lanes, counts), wide, fills)

    return vt(view, r, i, count, fill), codegen


def _vstore_impl(nontemporal: bool):
    def typer(typingctx, view, vec, r, i):
        if not isinstance(view, Raw) or not isinstance(vec, Vec) or not _int_ok(r, i):
            return None
        if vec.dtype != _acc_of(view.dtype):
            return None

        def codegen(context, builder, sig, args):
            ptr = _raw_pointer(context, builder, view, args[0],
                               _as_i64(builder, args[2], r), _as_i64(builder, args[3], i))
            value = _narrow_vector(builder, args[1], view.dtype)
            vptr = builder.bitcast(ptr, value.type.as_pointer())
            if nontemporal:
                st = builder.store(value, vptr,
                                   align=min(64, WIDTH * view.dtype.bitwidth // 8))
                md = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
                st.set_metadata("nontemporal", md)
            else:
                builder.store(value, vptr, align=view.dtype.bitwidth // 8)
            return context.get_dummy_value()

        return types.none(view, vec, r, i), codegen

    return typer


@intrinsic
def store_fence(typingctx):
    """Order earlier streaming stores before later stores (``sfence`` on x86)."""

    def codegen(context, builder, sig, args):
        _fence(builder)
        return context.get_dummy_value()

    return types.none(), codegen


def _fence(builder) -> None:
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse.sfence")
        builder.call(fn, [])
    else:
        builder.fence("seq_cst")


def _vstore(typingctx, view, vec, r, i):
    return _vstore_impl(False)(typingctx, view, vec, r, i)


def _vstore_nt(typingctx, view, vec, r, i):
    return _vstore_impl(True)(typingctx, view, vec, r, i)


#: ``vstore(view, vec, r, i)``: row ``r``, columns ``i .. i+WIDTH`` of a :class:`Raw`.
vstore = intrinsic(_vstore)
#: Non-temporal :func:`vstore`; the address must be aligned to ``min(64, vector bytes)``.
vstore_nt = intrinsic(_vstore_nt)


def _streams(order: types.Type) -> bool | None:
    # A bool order streams, an integer one does not (see vstore_by), anything else: no.
    if isinstance(order, types.Boolean):
        return True
    if isinstance(order, types.Integer):
        return False
    return None


@intrinsic
def vstore_by(typingctx, order, view, vec, r, i):
    """:func:`vstore_nt` if ``order`` is a bool, :func:`vstore` if it is an integer: the
    row loops' ``STREAM`` and ``SEQUENTIAL`` tags (:mod:`.rowmath`), told apart by
    their *type*, so that a loop compiles only its own store."""
    nontemporal = _streams(order)
    if nontemporal is None:
        return None
    typed = _vstore_impl(nontemporal)(typingctx, view, vec, r, i)
    if typed is None:
        return None
    _sig, store = typed

    def codegen(context, builder, sig, args):
        return store(context, builder, sig, args[1:])

    return types.none(order, view, vec, r, i), codegen


@intrinsic
def store_alignment(typingctx, order, view):
    """The alignment :func:`vstore_by` needs for ``order`` (a constant): ``min(64,
    vector bytes)`` for streaming stores, 1 for plain ones."""
    nontemporal = _streams(order)
    if nontemporal is None or not isinstance(view, Raw):
        return None
    value = min(64, WIDTH * view.dtype.bitwidth // 8) if nontemporal else 1

    def codegen(context, builder, sig, args):
        return context.get_constant(types.intp, value)

    return types.intp(order, view), codegen


@intrinsic
def store_fence_by(typingctx, order):
    """:func:`store_fence` after streaming stores (``order`` a bool), nothing after
    plain ones (an integer)."""
    nontemporal = _streams(order)
    if nontemporal is None:
        return None

    def codegen(context, builder, sig, args):
        if nontemporal:
            _fence(builder)
        return context.get_dummy_value()

    return types.none(order), codegen


@intrinsic
def get(typingctx, view, r, i):
    """Element ``[r, i]`` of a :class:`Raw` (raw element type)."""
    if not isinstance(view, Raw) or not _int_ok(r, i):
        return None

    def codegen(context, builder, sig, args):
        ptr = _raw_pointer(context, builder, view, args[0], _as_i64(builder, args[1], r),
                           _as_i64(builder, args[2], i))
        return builder.load(ptr)

    return view.dtype(view, r, i), codegen


@intrinsic
def put(typingctx, view, r, i, value):
    """``view[r, i] = value`` (``value`` already of the element type)."""
    if not isinstance(view, Raw) or not _int_ok(r, i) or value != view.dtype:
        return None

    def codegen(context, builder, sig, args):
        ptr = _raw_pointer(context, builder, view, args[0], _as_i64(builder, args[1], r),
                           _as_i64(builder, args[2], i))
        builder.store(args[3], ptr)
        return context.get_dummy_value()

    return types.none(view, r, i, value), codegen


@intrinsic
def vaddress(typingctx, view, r, i):
    """Address of element ``[r, i]`` of a :class:`Raw` as an integer."""
    if not isinstance(view, Raw) or not _int_ok(r, i):
        return None

    def codegen(context, builder, sig, args):
        ptr = _raw_pointer(context, builder, view, args[0], _as_i64(builder, args[1], r),
                           _as_i64(builder, args[2], i))
        return builder.ptrtoint(ptr, ir.IntType(64))

    return types.uint64(view, r, i), codegen


# Parameter loads fused into an operation, and statistics stores: typed builtins (as
# widen and the vector operators are), not overloads, which compiled a small function
# per signature on every cold first call (0.1-0.2 s of one).


def _param_ir(context, builder, view_ty, view, i_ty, i, vector):
    """LLVM IR of element ``i`` (a scalar) or elements ``i .. i + WIDTH`` (a vector) of
    row 0 of a :class:`Raw`, widened to the accumulation type."""
    ptr = _raw_pointer(context, builder, view_ty, view, ir.Constant(ir.IntType(64), 0),
                       _as_i64(builder, i, i_ty))
    if not vector:
        return widen_ir(builder, builder.load(ptr), view_ty.dtype)
    return _load_widened(context, builder, ptr, view_ty.dtype)


def _param_operand_ok(v, view) -> bool:
    if not isinstance(view, Raw):
        return False
    acc = _acc_of(view.dtype)
    return v == acc or v == _vec_of(acc)


def affine(v, w, b, i):
    """``v * w[i..] + b[i..]`` rounded once (fma), ``w`` and ``b`` row 0 of :class:`Raw`
    views (widened); ``v`` a vector (``WIDTH`` parameters from ``i``) or a scalar."""
    if isinstance(v, np.ndarray):
        return fma(v, vload(w, 0, i), vload(b, 0, i))
    return fma(v, widen(get(w, 0, i)), widen(get(b, 0, i)))


def _affine_type(v, w, b, i):
    if _param_operand_ok(v, w) and _param_operand_ok(v, b) and isinstance(i, types.Integer):
        return signature(v, v, w, b, i)
    return None


def _affine_lower(context, builder, sig, args):
    v, w, b, i = args
    vt, wt, bt, it = sig.args
    vector = isinstance(vt, Vec)
    return _fma_ir(builder, v, _param_ir(context, builder, wt, w, it, i, vector),
                   _param_ir(context, builder, bt, b, it, i, vector))


def times_w(v, w, i):
    """``v * w[i..]`` (a vector ``v``: ``WIDTH`` elements from ``i``) or ``v * w[i]``
    (a scalar), ``w`` row 0 of a :class:`Raw` (widened)."""
    return v * (vload(w, 0, i) if isinstance(v, np.ndarray) else widen(get(w, 0, i)))


def _times_w_type(v, w, i):
    if _param_operand_ok(v, w) and isinstance(i, types.Integer):
        return signature(v, v, w, i)
    return None


def _times_w_lower(context, builder, sig, args):
    v, w, i = args
    vt, wt, it = sig.args
    return builder.fmul(v, _param_ir(context, builder, wt, w, it, i, isinstance(vt, Vec)))


def put_stat(out, r, value):
    """``out[r] = value``, or nothing when the caller did not ask for ``out`` (None, or an
    empty array: the short path passes one, so that a call without statistics runs the
    same compiled kernel as a call with them)."""
    if out is not None and out.shape[0] != 0:
        out[r] = value


def _put_stat_type(out, r, value):
    if not (isinstance(r, types.Integer) and isinstance(value, types.Float)):
        return None
    if isinstance(out, types.NoneType) or (
            isinstance(out, types.Array) and out.ndim == 1 and out.mutable
            and isinstance(out.dtype, types.Float)):
        return signature(types.none, out, r, value)
    return None


def _put_stat_lower(context, builder, sig, args):
    out_ty, r_ty, value_ty = sig.args
    if isinstance(out_ty, types.Array):
        ary = context.make_array(out_ty)(context, builder, args[0])
        (count,) = cgutils.unpack_tuple(builder, ary.shape, 1)
        with builder.if_then(builder.icmp_signed("!=", count, count.type(0))):
            ptr = _element_pointer(context, builder, out_ty, args[0],
                                   [context.cast(builder, args[1], r_ty, types.intp)])
            builder.store(context.cast(builder, args[2], value_ty, out_ty.dtype), ptr)
    return context.get_dummy_value()


register_builtin(affine, _affine_type, _affine_lower)
register_builtin(times_w, _times_w_type, _times_w_lower)
register_builtin(put_stat, _put_stat_type, _put_stat_lower)


def itemsize(view):
    """Bytes per element of a :class:`Raw` (a compile-time constant)."""
    return view.itemsize  # Python (NUMBA_DISABLE_JIT) only; jitted code: the builtin below


@infer_global(itemsize)
class _ItemsizeTyper(AbstractTemplate):
    # A template and a constant lowering: an overload compiled a function for it.
    def generic(self, args, kws):
        if len(args) == 1 and not kws and isinstance(args[0], Raw):
            return signature(types.intp, *args)
        return None


@lower_builtin(itemsize, Raw)
def _itemsize_lower(context, builder, sig, args):
    return context.get_constant(types.intp, sig.args[0].dtype.bitwidth // 8)


@intrinsic
def copy2(typingctx, dst, di, dj, src, si, sj):
    """``dst[di, dj:dj+WIDTH] = src[si, sj:sj+WIDTH]``, bits unchanged (same dtype)."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
            and dst.ndim == 2 and src.ndim == 2 and dst.dtype == src.dtype
            and _int_ok(di, dj, si, sj)):
        return None

    def codegen(context, builder, sig, args):
        sptr = _element_pointer(context, builder, src, args[3], args[4:6])
        dptr = _element_pointer(context, builder, dst, args[0], args[1:3])
        vty = ir.VectorType(_element_ir(context, src.dtype), WIDTH)
        align = src.dtype.bitwidth // 8
        value = builder.load(builder.bitcast(sptr, vty.as_pointer()), align=align)
        builder.store(value, builder.bitcast(dptr, vty.as_pointer()), align=align)
        return context.get_dummy_value()

    return types.none(dst, di, dj, src, si, sj), codegen


# --------------------------------------------------------------------------- 8-bit codes
# Quantization of float32 vectors (:mod:`.quantized`). Integer operations on the lanes'
# bit patterns, IEEE comparisons and one exact round-half-to-even step; no
# reassociation, so every lane gets what the scalar formula gives.

_I32 = ir.IntType(32)
_ROUNDER = 12582912.0  # 1.5 * 2**23: (v + R) - R is v rounded half to even (|v| < 2**22)


def _f32_splat(value: float) -> ir.Constant:
    return ir.Constant(ir.VectorType(ir.FloatType(), WIDTH), [value] * WIDTH)


def _bits_of(builder, vec):
    return builder.bitcast(vec, ir.VectorType(_I32, WIDTH))


def _is_f32_vec(vec: types.Type) -> bool:
    return isinstance(vec, Vec) and vec.dtype == types.float32


@intrinsic
def vabsmax(typingctx, acc, vec):
    """Lanes with the largest bit pattern of ``acc`` and ``|vec|`` (float32 vectors).

    For non-negative floats the integer order of the bit patterns is the float order and
    NaN patterns lie above infinity's: starting from zeros, this is the running
    ``max(|v|)`` that a NaN makes NaN.
    """
    if not (_is_f32_vec(acc) and acc == vec):
        return None

    def codegen(context, builder, sig, args):
        a = _bits_of(builder, args[0])
        b = builder.and_(_bits_of(builder, args[1]), _splat_i32(0x7FFFFFFF))
        top = builder.select(builder.icmp_signed(">", b, a), b, a)
        return builder.bitcast(top, args[0].type)

    return acc(acc, vec), codegen


@intrinsic
def scales_of(typingctx, amax, qmax):
    """Lane-wise ``amax / qmax``, 1 where ``amax`` is zero (float32 vectors): the
    dynamic scales of the rows whose largest magnitudes (:func:`hmax_bits`) the lanes
    of ``amax`` hold."""
    if not (_is_f32_vec(amax) and amax == qmax):
        return None

    def codegen(context, builder, sig, args):
        top = args[0]
        return builder.select(builder.fcmp_ordered("==", top, _f32_splat(0.0)),
                              _f32_splat(1.0), builder.fdiv(top, args[1]))

    return amax(amax, qmax), codegen


@intrinsic
def hmax_bits(typingctx, vec):
    """The lane of a :func:`vabsmax` vector with the largest bit pattern, as a float32."""
    if not _is_f32_vec(vec):
        return None

    def codegen(context, builder, sig, args):
        # A tree of lane-wise maxima (exact, so any order gives the same bits): a few
        # dependent steps instead of one per lane.
        bits = _bits_of(builder, args[0])
        h = WIDTH // 2
        while h:
            mask = ir.Constant(ir.VectorType(_I32, WIDTH), [(j + h) % WIDTH for j in range(WIDTH)])
            other = builder.shuffle_vector(bits, bits, mask)
            bits = builder.select(builder.icmp_signed(">", other, bits), other, bits)
            h //= 2
        top = builder.extract_element(bits, ir.Constant(_I32, 0))
        return builder.bitcast(top, ir.FloatType())

    return types.float32(vec), codegen


def _store_bytes(context, builder, view, args, r, i, codes_i32, narrowed=False):
    """Store the low bytes of the ``<WIDTH x i32>`` codes (``narrowed``: ``codes_i32`` is
    already the ``<WIDTH x i8>`` vector) at ``[r, i]`` of the uint8 view."""
    ptr = _raw_pointer(context, builder, view, args[0], _as_i64(builder, args[2], r),
                       _as_i64(builder, args[3], i))
    codes = codes_i32 if narrowed else builder.trunc(codes_i32,
                                                     ir.VectorType(ir.IntType(8), WIDTH))
    # An empty asm keeps the truncation in a register: folded into the store, it is a
    # truncating store (vpmovdb to memory), several times slower on some x86 cores.
    if platform.machine().lower() in ("x86_64", "amd64"):
        codes = builder.asm(ir.FunctionType(codes.type, [codes.type]), "", "=v,0", [codes],
                            False)
    builder.store(codes, builder.bitcast(ptr, codes.type.as_pointer()), align=1)
    return context.get_dummy_value()


def _saturate(builder, v, low: float, high: float):
    # Ordered comparisons are false for NaN: NaN passes through.
    v = builder.select(builder.fcmp_ordered("<", v, _f32_splat(low)), _f32_splat(low), v)
    return builder.select(builder.fcmp_ordered(">", v, _f32_splat(high)), _f32_splat(high), v)


def _int8_codes_avx512(builder, v, bounded=False):
    """:func:`store_int8`'s codes of ``v`` in four AVX-512 instructions.

    ``vcmpordps`` marks the lanes that are not NaN; ``vminps`` lowers the rest to at most
    127 (NaN passes); ``vcvtps2dq`` rounds each to an integer in the current rounding
    mode (half to even, as the portable path's addition; a NaN lane, masked off, becomes
    0, and one below ``-2**31`` the integer indefinite ``-2**31``); ``vpmovsdb`` narrows
    with signed saturation (everything below -128 becomes -128). The same integer as the
    portable path's saturate-then-round in every lane, in four instructions where that
    path compiles to six (NaN mask and zeroing, two clamps, the rounding addition, the
    narrowing). ``bounded`` (no NaN lane, none beyond ``2**31``): the conversion and
    the narrowing alone.
    """
    i16 = ir.IntType(16)
    i32x = ir.VectorType(_I32, WIDTH)
    i8x = ir.VectorType(ir.IntType(8), WIDTH)
    if bounded:  # no NaN lane, none past 2**31: the conversion and narrowing alone
        ordered = ir.Constant(i16, -1)
    else:
        ordered = builder.bitcast(builder.fcmp_ordered("ord", v, v), i16)
        v = builder.select(builder.fcmp_ordered(">", v, _f32_splat(127.0)),
                           _f32_splat(127.0), v)
    cvt = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(i32x, [v.type, i32x, i16, _I32]),
        "llvm.x86.avx512.mask.cvtps2dq.512")
    # Rounding argument 4: the current direction (MXCSR), as any float32 arithmetic.
    ints = builder.call(cvt, [v, ir.Constant(i32x, None), ordered, ir.Constant(_I32, 4)])
    narrow = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(i8x, [i32x, i8x, i16]),
        "llvm.x86.avx512.mask.pmovs.db.512")
    return builder.call(narrow, [ints, ir.Constant(i8x, None), ir.Constant(i16, -1)])


def _int8_store(bounded: bool):
    """An intrinsic storing int8 codes of a float32 vector at ``[r, i]`` of a uint8
    :class:`Raw`: NaN becomes 0; the rest saturates to [-128, 127] and rounds half to
    even (the bounds are integers, so saturating first gives the same integer).

    ``bounded``: for vectors with no NaN lane and every lane below ``2**31`` in
    magnitude (a dynamic scale's ``y32 * inv`` of a finite row with a positive finite
    ``inv``: within about ``qmax``), the same codes without the steps such lanes never
    need: with AVX-512 the NaN mask and the upper clamp (the narrowing saturates, the
    conversion cannot overflow), elsewhere the NaN select. Measured, int8 with per-row
    scales into ``out=``, float32, 1 thread, in cache, two alternating pairs of
    processes: LayerNorm (732, 256) 70.5-81.1 -> 66.6-70.9 us, (183, 1024) 53.1-60.7 ->
    48.2-52.5 us; RMSNorm 48.4-55.5 -> 45.6-50.1 and 38.9-44.8 -> 34.6-38.4 us; from DRAM
    within the noise.
    """

    def typer(typingctx, view, vec, r, i):
        if not (isinstance(view, Raw) and view.dtype == types.uint8 and _is_f32_vec(vec)
                and _int_ok(r, i)):
            return None

        def codegen(context, builder, sig, args):
            v = args[1]
            if WIDTH == 16 and _has_feature("avx512f"):
                return _store_bytes(context, builder, view, args, r, i,
                                    _int8_codes_avx512(builder, v, bounded), narrowed=True)
            if not bounded:
                v = builder.select(builder.fcmp_unordered("uno", v, v), _f32_splat(0.0), v)
            # v + 1.5 * 2**23 rounds v half to even to an integer k in [-128, 127] whose
            # bit pattern is 0x4B400000 + k: its low byte is k's two's-complement byte (no
            # subtraction, no conversion).
            v = builder.fadd(_saturate(builder, v, -128.0, 127.0), _f32_splat(_ROUNDER))
            return _store_bytes(context, builder, view, args, r, i, _bits_of(builder, v))

        return types.none(view, vec, r, i), codegen

    return typer


#: ``store_int8(view, vec, r, i)``: int8 codes of ``vec`` (:func:`_int8_store`).
store_int8 = intrinsic(_int8_store(False))
#: ``store_int8_bounded(view, vec, r, i)``: the same codes of a vector without NaN lanes
#: and within ``2**31`` (:func:`_int8_store`).
store_int8_bounded = intrinsic(_int8_store(True))


def _float8_store(drop: int, min_normal: int, nan: int, qmax: float):
    """An intrinsic storing float8 codes: saturate to ``+-qmax`` (NaN kept), then round
    the magnitude half to even to the format (``23 - drop`` mantissa bits, subnormals
    included) and read the code off the rounding sum's bits. NaN keeps its sign and
    becomes ``nan``.

    The rounding adds ``C = 1.5 * 2**(E + drop)`` to the magnitude, ``E`` being its
    binary exponent raised to at least that of ``min_normal`` (the format's smallest
    normal): ``C``'s unit in the last place is the format's spacing in the magnitude's
    binade (in the subnormal range, the subnormal spacing), so the float32 sum is the
    magnitude rounded half to even (``C`` is an even number of units) and
    ``m = bits(sum) - bits(C)`` counts units: the subnormal code itself below
    ``min_normal``, ``2**mb`` plus the mantissa code in a normal binade (``2**(mb + 1)``
    when the rounding carries into the next binade, which is that binade's code). The
    code is then ``m + (E + bias - 1) * 2**mb``, an integer sum: four integer
    operations and one floating-point addition per lane, no float32 subnormal (whose
    arithmetic costs a microcode assist, about 50x, on many x86 cores)."""
    mantissa_bits = 23 - drop
    exponent_mask = 0x7F800000
    # bits(C) = e_bits + (drop << 23) + 0x400000 and (E + bias - 1) * 2**mb =
    # (e_bits >> drop) - (min_normal >> drop), so code = bits(sum) - e_bits
    # + (e_bits >> drop) - offset.
    offset = (drop << 23) + 0x400000 + (min_normal >> drop)
    assert min_normal & ~exponent_mask == 0 and mantissa_bits in (2, 3)

    def typer(typingctx, view, vec, r, i):
        if not (isinstance(view, Raw) and view.dtype == types.uint8 and _is_f32_vec(vec)
                and _int_ok(r, i)):
            return None

        def codegen(context, builder, sig, args):
            v = _saturate(builder, args[1], -qmax, qmax)
            bits = _bits_of(builder, v)
            sign = builder.and_(builder.lshr(bits, _splat_i32(24)), _splat_i32(0x80))
            mag = builder.and_(bits, _splat_i32(0x7FFFFFFF))
            e_bits = builder.and_(mag, _splat_i32(exponent_mask))
            e_bits = builder.select(builder.icmp_unsigned("<", e_bits, _splat_i32(min_normal)),
                                    _splat_i32(min_normal), e_bits)
            rounder = builder.add(e_bits, _splat_i32((drop << 23) + 0x400000))
            total = builder.fadd(builder.bitcast(mag, v.type),
                                 builder.bitcast(rounder, v.type))
            code = builder.sub(_bits_of(builder, total), e_bits)
            code = builder.add(code, builder.lshr(e_bits, _splat_i32(drop)))
            code = builder.sub(code, _splat_i32(offset))
            code = builder.select(builder.icmp_unsigned(">", mag, _splat_i32(0x7F800000)),
                                  _splat_i32(nan), code)
            return _store_bytes(context, builder, view, args, r, i, builder.or_(sign, code))

        return types.none(view, vec, r, i), codegen

    return typer


#: ``store_float8_e4m3fn(view, vec, r, i)``: float8 e4m3fn codes of ``vec`` (|v| <= 448).
store_float8_e4m3fn = intrinsic(_float8_store(20, 0x3C800000, 0x7F, 448.0))
#: ``store_float8_e5m2(view, vec, r, i)``: float8 e5m2 codes of ``vec`` (|v| <= 57344).
store_float8_e5m2 = intrinsic(_float8_store(21, 0x38800000, 0x7E, 57344.0))


def _prefetch_codegen(rw: int, locality: int):
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        i64 = ir.IntType(64)
        off = args[1] if sig.args[1].bitwidth == 64 else builder.sext(args[1], i64)
        ptr = builder.inttoptr(builder.add(args[0], off), ir.IntType(8).as_pointer())
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [ptr.type], fnty)
        builder.call(fn, [ptr, ir.Constant(i32, rw), ir.Constant(i32, locality),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def prefetch_at(typingctx, address, offset, write):
    """A hint that the cache line at byte ``address + offset`` will be read (``write``
    False) or written (True) soon: ``llvm.prefetch``, never a fault, no effect on results.
    ``address`` is an integer (:func:`vaddress`), ``write`` a literal bool."""
    if not isinstance(address, types.Integer) or not isinstance(offset, types.Integer) \
            or not isinstance(write, types.BooleanLiteral):
        return None
    return (types.none(address, offset, write),
            _prefetch_codegen(1 if write.literal_value else 0, 3))


@intrinsic
def prefetch_l2_at(typingctx, address, offset):
    """:func:`prefetch_at` for reading, into the level-2 cache only (``prefetcht1`` on
    x86): for lines needed after the current working set, which it does not evict
    from L1."""
    if not isinstance(address, types.Integer) or not isinstance(offset, types.Integer):
        return None
    return types.none(address, offset), _prefetch_codegen(0, 2)


#: LLVM's names of AMD cores start so (``znver4``, ``bdver2``, ...).
_AMD_CPU_PREFIXES = ("znver", "bdver", "btver", "amdfam", "athlon", "opteron", "barcelona")


def prefetch_pays(cpu_name: str | None = None) -> bool:
    """Whether software prefetching of rows ahead (:func:`prefetch_at`) pays on this CPU.

    No on AMD cores, whose hardware prefetchers already follow the rows (measured on Zen
    4: the hints made the short-row LayerNorm forward slower, see
    :data:`.forward_rows.SHORT_ROW_PREFETCH`); yes elsewhere (measured on Intel Xeon).

    Parameters
    ----------
    cpu_name : str, optional
        LLVM's name of the CPU (default: the host's, as Numba compiles for it).

    Returns
    -------
    bool

    Examples
    --------
    >>> prefetch_pays("znver4"), prefetch_pays("sapphirerapids")
    (False, True)
    """
    return not _amd(cpu_name)


def downward_passes_pay(cpu_name: str | None = None) -> bool:
    """Whether an output pass should run downwards when its output lies just after its
    input modulo 4 KiB (:data:`.forward_rows.ALIAS_WINDOW`).

    Yes on AMD cores: upwards, the loads a few vectors ahead share the low 12 address
    bits of stores still in flight and wait for them (measured on Zen 4). No elsewhere:
    on an Intel Xeon (Sapphire Rapids) the downward pass was the slow one, 1.3-1.8x the
    upward pass's time wherever y lay 16-96 bytes after x (not a multiple of 64), and
    no faster at any other offset.

    Parameters
    ----------
    cpu_name : str, optional
        LLVM's name of the CPU (default: the host's, as Numba compiles for it).

    Returns
    -------
    bool

    Examples
    --------
    >>> downward_passes_pay("znver4"), downward_passes_pay("sapphirerapids")
    (True, False)
    """
    return _amd(cpu_name)


def _amd(cpu_name: str | None) -> bool:
    """Whether ``cpu_name`` (default: the host's, LLVM's name) is an AMD core."""
    if cpu_name is None:
        from llvmlite import binding

        cpu_name = binding.get_host_cpu_name()
    return cpu_name.lower().startswith(_AMD_CPU_PREFIXES)


if config.DISABLE_JIT:
    # Numba's debugging mode runs the kernels as Python, where intrinsics cannot run:
    # export NumPy stand-ins under the same names instead.
    from . import python_simd

    globals().update({name: getattr(python_simd, name) for name in python_simd.__all__})
