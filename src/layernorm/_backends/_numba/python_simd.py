"""Python stand-ins for the :mod:`._simd` intrinsics, for ``NUMBA_DISABLE_JIT=1``.

In Numba's debugging mode ``njit`` returns the Python function itself, and intrinsics
cannot run in Python. :mod:`._simd` then exports these instead: a vector is a NumPy
array of ``WIDTH`` lanes and a :class:`._simd.Raw` view is a 2-D NumPy view, so the
kernels run as Python, slowly, performing the same operations. Not bit for bit:
:func:`fma` here rounds twice where the compiled one rounds once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._scalars import narrow, widen

WIDTH = 16

__all__ = [
    "alive",
    "copy2",
    "down1",
    "down2",
    "down4",
    "down8",
    "fma",
    "fold1",
    "fold1_max",
    "fold2",
    "fold2_max",
    "fold4",
    "fold4_max",
    "fold8",
    "fold8_max",
    "get",
    "hmax_bits",
    "lane",
    "load2",
    "prefetch_at",
    "prefetch_l2_at",
    "put",
    "raw",
    "rounded",
    "runtime",
    "scales_of",
    "scratch_block",
    "splat",
    "sqrt",
    "store2",
    "store_fence",
    "store_float8_e4m3fn",
    "store_float8_e5m2",
    "store_int8",
    "store_int8_bounded",
    "vabsmax",
    "vaddress",
    "vload",
    "vload_tail",
    "vstore",
    "vstore_nt",
    "wide",
]


def scratch_block(rows: int, cols: int, like: Any) -> Any:
    """A new ``(rows, cols)`` NumPy array of ``like``'s dtype (its values undefined)."""
    return np.empty((rows, cols), dtype=np.asarray(like).dtype if not isinstance(like, type)
                    else like)


def runtime(value: Any) -> Any:
    """``value`` itself (compiled: the same value, not typed as a constant)."""
    return value


def alive(value: Any) -> None:
    """Nothing to do: Python keeps referenced arrays alive."""


def splat(value: Any) -> np.ndarray:
    """A vector with every lane ``value`` (of ``value``'s float type)."""
    return np.full(WIDTH, value, dtype=np.asarray(value).dtype)


def fma(a: Any, b: Any, c: Any) -> Any:
    """``a * b + c``; float32 through float64 (both rounded), float64 rounded twice."""
    dtype = np.asarray(a).dtype
    if dtype == np.float32:
        wide = np.float64(1.0) * a * b + np.asarray(c, np.float64)
        return wide.astype(np.float32) if isinstance(wide, np.ndarray) else np.float32(wide)
    return a * b + c


def lane(vec: np.ndarray, index: int) -> Any:
    """Lane ``index`` of ``vec``."""
    return vec[index]


def _down(h: int) -> Any:
    def down(vec: np.ndarray) -> np.ndarray:
        return np.roll(vec, -h)

    down.__doc__ = f"Lane ``j + {h}`` moved to lane ``j`` (lanes wrap around)."
    return down


down8, down4, down2, down1 = _down(8), _down(4), _down(2), _down(1)


def _fold(h: int, largest: bool = False) -> Any:
    per_vector = WIDTH // (2 * h)
    low = []
    for k in range(WIDTH):
        block, offset = divmod(k, h)
        source = block if block < per_vector else block - per_vector
        low.append(source * 2 * h + offset + (0 if block < per_vector else WIDTH))
    low_index = np.array(low)

    def fold(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        both = np.concatenate((a, b))
        if largest:  # the larger bit pattern of the two lanes (float32, as vabsmax)
            bits = both.view(np.int32)
            return np.maximum(bits[low_index], bits[low_index + h]).view(np.float32)
        return both[low_index] + both[low_index + h]

    fold.__doc__ = (f"One level (``h = {h}``) of the lane tree for several rows at once"
                    + (" (largest bit patterns)." if largest else "."))
    return fold


fold8, fold4, fold2, fold1 = _fold(8), _fold(4), _fold(2), _fold(1)
fold8_max, fold4_max, fold2_max, fold1_max = (_fold(h, largest=True) for h in (8, 4, 2, 1))


def sqrt(vec: np.ndarray) -> np.ndarray:
    """Square root of every lane."""
    return np.sqrt(vec)


def wide(vec: np.ndarray) -> np.ndarray:
    """Every lane as float64."""
    return np.asarray(vec, np.float64)


def rounded(vec: np.ndarray, like: Any) -> np.ndarray:
    """The float64 vector rounded to the type of the scalar ``like``."""
    return np.asarray(vec).astype(np.asarray(like).dtype)


def raw(arr: np.ndarray) -> np.ndarray:
    """A 2-D view of ``arr`` (a 1-D array is row 0)."""
    return arr if arr.ndim == 2 else arr[np.newaxis, :]


def vload(view: np.ndarray, r: int, i: int) -> np.ndarray:
    """``WIDTH`` elements of row ``r`` from column ``i``, widened (a copy)."""
    return widen(view[r, i:i + WIDTH])


def vload_tail(view: np.ndarray, r: int, i: int, count: int, fill: Any) -> np.ndarray:
    """Lanes ``j < count`` from ``view[r, i + j]`` (widened), the others ``fill``."""
    out = np.full(WIDTH, fill)
    out[:count] = widen(view[r, i:i + count])
    return out


def vstore(view: np.ndarray, vec: np.ndarray, r: int, i: int) -> None:
    """Row ``r``, columns ``i .. i + WIDTH`` of ``view`` set to ``vec``, narrowed."""
    view[r, i:i + WIDTH] = narrow(vec, view)


vstore_nt = vstore
load2 = vload
store2 = vstore


def store_fence() -> None:
    """Nothing to order: Python stores are plain stores."""


def get(view: np.ndarray, r: int, i: int) -> Any:
    """Element ``[r, i]`` (raw element type)."""
    return view[r, i]


def put(view: np.ndarray, r: int, i: int, value: Any) -> None:
    """Element ``[r, i]`` set to ``value`` (raw element type)."""
    view[r, i] = value


def vaddress(view: np.ndarray, r: int, i: int) -> int:
    """Address of element ``[r, i]``: arithmetic, as the intrinsic's (row ``r`` need not
    exist: :func:`.forward_rows.prefetch_target` takes row 1 of one-row views)."""
    return int(view.ctypes.data) + r * view.strides[0] + i * view.itemsize


def prefetch_at(address: int, offset: int, write: bool) -> None:
    """A cache hint: nothing to do in Python."""
    return None


def prefetch_l2_at(address: int, offset: int) -> None:
    """A cache hint: nothing to do in Python."""
    return None


def copy2(dst: np.ndarray, di: int, dj: int, src: np.ndarray, si: int, sj: int) -> None:
    """``dst[di, dj:dj+WIDTH] = src[si, sj:sj+WIDTH]``, bits unchanged."""
    dst[di, dj:dj + WIDTH] = src[si, sj:sj + WIDTH]


def vabsmax(acc: np.ndarray, vec: np.ndarray) -> np.ndarray:
    """Lanes with the larger bit pattern of ``acc`` and ``|vec|`` (float32)."""
    bits = np.maximum(acc.view(np.int32), vec.view(np.int32) & 0x7FFFFFFF)
    return bits.view(np.float32)


def scales_of(amax: np.ndarray, qmax: np.ndarray) -> np.ndarray:
    """Lane-wise ``amax / qmax``, 1 where ``amax`` is zero (float32)."""
    with np.errstate(divide="ignore", over="ignore", under="ignore", invalid="ignore"):
        return np.where(amax == 0, np.float32(1.0), amax / qmax).astype(np.float32)


def hmax_bits(vec: np.ndarray) -> Any:
    """The lane with the largest bit pattern, as a float32."""
    return vec.view(np.int32).max().view(np.float32)


def _saturated(vec: np.ndarray, low: float, high: float) -> np.ndarray:
    v = np.where(vec < low, np.float32(low), vec)
    return np.where(v > high, np.float32(high), v).astype(np.float32)


def store_int8(view: np.ndarray, vec: np.ndarray, r: int, i: int) -> None:
    """int8 codes of ``vec`` (NaN -> 0, saturated, rounded half to even) as uint8."""
    v = _saturated(np.where(np.isnan(vec), np.float32(0), vec), -128.0, 127.0)
    view[r, i:i + WIDTH] = np.rint(v).astype(np.int8).view(np.uint8)


def store_int8_bounded(view: np.ndarray, vec: np.ndarray, r: int, i: int) -> None:
    """:func:`store_int8` of a vector without NaN lanes (the same codes)."""
    store_int8(view, vec, r, i)


def _float8(name: str, qmax: float) -> Any:
    def store(view: np.ndarray, vec: np.ndarray, r: int, i: int) -> None:
        import ml_dtypes

        v = _saturated(vec, -qmax, qmax)
        view[r, i:i + WIDTH] = v.astype(getattr(ml_dtypes, name)).view(np.uint8)

    store.__doc__ = f"{name} codes of ``vec`` (saturated to +-{qmax:g}) as uint8."
    return store


store_float8_e4m3fn = _float8("float8_e4m3fn", 448.0)
store_float8_e5m2 = _float8("float8_e5m2", 57344.0)
