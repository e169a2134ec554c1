"""From the user's array and normalized axes to the ``(outer, n, inner)`` view kernels see.

Kernels only ever see a 3-D view: ``n`` is the product of the normalized axes,
``outer`` of the axes before them and ``inner`` of the axes after them. When the
normalized axes are not adjacent (``axis=(0, 2)``) they are transposed to the end
first, which may copy; adjacent axes never copy unless merging them needs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Layout:
    """How an array of ``shape`` maps onto the kernels' ``(outer, n, inner)`` view."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]
    outer: int
    n: int
    inner: int
    #: transpose that moves non-adjacent normalized axes last, or None.
    perm: tuple[int, ...] | None

    @property
    def rows(self) -> int:
        """Number of independent rows (``outer * inner``)."""
        return self.outer * self.inner

    @cached_property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of ``weight``/``bias``: the normalized axes' sizes."""
        return tuple(self.shape[a] for a in self.axes)

    @cached_property
    def stats_shape(self) -> tuple[int, ...]:
        """Shape of ``mean``/``rstd``: ``shape`` with normalized axes kept as 1."""
        return tuple(1 if i in self.axes else s for i, s in enumerate(self.shape))

    @cached_property
    def param_broadcast_shape(self) -> tuple[int, ...]:
        """Shape that broadcasts ``weight`` against ``x``."""
        return tuple(s if i in self.axes else 1 for i, s in enumerate(self.shape))


def plan(shape: tuple[int, ...], axes: tuple[int, ...]) -> Layout:
    """The layout for normalizing ``axes`` (sorted, non-negative) of ``shape``.

    Examples
    --------
    >>> plan((8, 3, 4, 5), (1,))
    Layout(shape=(8, 3, 4, 5), axes=(1,), outer=8, n=3, inner=20, perm=None)
    >>> plan((8, 3, 4), (0, 2)).perm
    (1, 0, 2)
    """
    first, last = axes[0], axes[-1]
    n = math.prod(shape[a] for a in axes)
    if last - first + 1 == len(axes):
        return Layout(shape, axes, math.prod(shape[:first]), n, math.prod(shape[last + 1 :]), None)
    kept = tuple(i for i in range(len(shape)) if i not in axes)
    return Layout(shape, axes, math.prod(shape[i] for i in kept), n, 1, kept + axes)


def canonical(arr: Any, layout: Layout) -> Any:
    """The ``(outer, n, inner)`` view of ``arr`` (a copy only when no view exists)."""
    if layout.perm is not None:
        arr = arr.transpose(layout.perm)
    return arr.reshape(layout.outer, layout.n, layout.inner)


def writable_canonical(out: Any, layout: Layout, may_share_memory: Any) -> Any | None:
    """The canonical view of ``out`` if it is a true view, else None (compute, then copy)."""
    if layout.perm is not None:
        return None
    view = out.reshape(layout.outer, layout.n, layout.inner)
    if view.size and not may_share_memory(view, out):
        return None
    return view


def c_contiguous(arr: Any) -> Any:
    """``arr``, or a C-ordered copy of it where its library shows a layout and it is not.

    The contract's outputs are new C-contiguous arrays; elementwise operations keep the
    layout of their input (NumPy, CuPy and torch alike), so the generic path's results
    on a transposed or Fortran-ordered ``x`` are not. torch tensors (``is_contiguous``)
    and NumPy/CuPy arrays (``flags``) are copied where needed; other array-API arrays
    show no layout and are returned as they are. torch's ``contiguous`` is
    differentiable.

    Examples
    --------
    >>> import numpy as np
    >>> c_contiguous(np.ones((2, 3), order="F")).flags.c_contiguous
    True
    """
    if hasattr(arr, "is_contiguous"):
        return arr if arr.is_contiguous() else arr.contiguous()
    flags = getattr(arr, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous") and not flags.c_contiguous:
        return arr.copy(order="C")
    return arr


@dataclass(frozen=True)
class Extent:
    """Where a strided array's elements lie: the address of its first element, its shape,
    its strides in bytes and its element size. Any library's array has one (NumPy's
    ``__array_interface__``, CuPy's ``__cuda_array_interface__``, torch's ``data_ptr``)."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @property
    def __array_interface__(self) -> dict[str, Any]:
        # Read by NumPy to lay an address-only array over the extent; its elements are
        # never read (the address may be a GPU's).
        return {"data": (self.address, True), "shape": self.shape, "strides": self.strides,
                "typestr": f"|V{self.itemsize}", "version": 3}


def share_bytes(a: Extent, b: Extent) -> bool:
    """Whether two strided arrays have a byte in common: exactly, not only whether their
    bounds overlap (two halves of each row of one buffer share no byte).

    Examples
    --------
    >>> rows = Extent(4096, (4, 16), (128, 4), 4)      # elements 0-15 of rows of 32
    >>> share_bytes(rows, Extent(4096 + 64, (4, 16), (128, 4), 4))  # elements 16-31
    False
    >>> share_bytes(rows, Extent(4096 + 32, (4, 16), (128, 4), 4))  # elements 8-23
    True
    """
    if 0 in a.shape or 0 in b.shape:
        return False
    return bool(np.shares_memory(np.asarray(a), np.asarray(b)))
