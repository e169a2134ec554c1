"""What the short paths share: the memo of call plans and the ``eps`` they convert.

:mod:`._fast` (forward), :mod:`._fast_backward` and :mod:`._fast_add` each validate the
first call of a kind through the general path and keep a plan for it; a later call that
matches its key checks only what can change. These are the pieces they have in common.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

#: Plans each short path keeps at most before it starts over.
PLANS_MAX = 512


def kernel_ready(arr: Any) -> bool:
    """``arr`` (a NumPy array) is C-contiguous and aligned, as the compiled entry points
    the plans call were typed for.

    Examples
    --------
    >>> import numpy as np
    >>> kernel_ready(np.ones((2, 3))), kernel_ready(np.ones((2, 3)).T)
    (True, False)
    """
    flags = arr.flags
    return flags.c_contiguous and flags.aligned


#: ``params_key``'s ``bias`` for a norm without one (RMSNorm): the key records the weight
#: only.
NO_BIAS: Any = object()


def params_key(weight: Any, bias: Any = NO_BIAS) -> tuple[Any, ...] | None:
    """What a plan's key records of ``weight`` and ``bias``: ``(shape, dtype)`` of each
    (``None, None`` for an absent one; nothing for ``bias`` :data:`NO_BIAS`), or None if
    either is not a C-contiguous, aligned NumPy array (such a call takes the general
    path).

    Examples
    --------
    >>> params_key(np.ones(3, np.float32), None)
    ((3,), dtype('float32'), None, None)
    >>> params_key(None)
    (None, None)
    >>> params_key(np.ones(6)[::2]) is None
    True
    """
    if weight is None:
        wshape = wdtype = None
    elif type(weight) is np.ndarray and kernel_ready(weight):
        wshape, wdtype = weight.shape, weight.dtype
    else:
        return None
    if bias is NO_BIAS:
        return wshape, wdtype
    if bias is None:
        return wshape, wdtype, None, None
    if type(bias) is np.ndarray and kernel_ready(bias):
        return wshape, wdtype, bias.shape, bias.dtype
    return None


def remember(plans: dict[Any, Any], key: Any, build: Callable[[], Any]) -> Any:
    """The plan ``build()`` makes for a call first seen under ``key``, memoized in
    ``plans`` (None: the call is not eligible). An invalid call (``build`` raises
    TypeError or ValueError) is not memoized and gives None: the general path raises
    the error, after the checks it makes first.

    Examples
    --------
    >>> plans = {}
    >>> remember(plans, "k", lambda: 42), plans
    (42, {'k': 42})
    >>> remember(plans, "bad", lambda: int("x")) is None, "bad" in plans
    (True, False)
    """
    try:
        plan = build()
    except (TypeError, ValueError):
        return None
    if len(plans) >= PLANS_MAX:
        # Start over rather than stop planning: a server that sees many shapes (varying
        # sequence lengths) keeps the short path for the shapes it sees now.
        plans.clear()
    plans[key] = plan
    return plan


def remember_by_shapes(plans: dict[Any, Any], key: Any, shapes: Any,
                       build: Callable[[], Any]) -> Any:
    """The plan under the full ``key`` (made by ``build`` and remembered on a first
    call, see :func:`remember`), also remembered under ``shapes``, the key of the call's
    shapes alone, where the short paths look first (they compare the plan's dtypes by
    identity: hashing dtypes into every call's key cost a cache-resident call a
    microsecond). None if the call cannot take the short path.

    Examples
    --------
    >>> plans = {}
    >>> remember_by_shapes(plans, ("s", "f4"), ("s",), lambda: 7), plans
    (7, {('s', 'f4'): 7, ('s',): 7})
    """
    try:
        plan = plans[key]
    except KeyError:
        plan = remember(plans, key, build)
    if plan is not None:
        if len(plans) >= PLANS_MAX:
            plans.clear()
            plans[key] = plan
        plans[shapes] = plan
    return plan


def accumulation_eps(plan: Any, eps: Any) -> Any:
    """``eps`` in ``plan.acc`` (remembered in ``plan.eps_scalars``) if it is a finite
    float >= 0 that does not round to 0 there (unless it is 0) nor to infinity, else None
    (the general path says what is wrong).

    Examples
    --------
    >>> import numpy as np
    >>> class P:
    ...     acc, eps_scalars = np.dtype(np.float32), {}
    >>> accumulation_eps(P, 1e-5) == np.float32(1e-5), accumulation_eps(P, 1e-46)
    (np.True_, None)
    """
    if type(eps) is not float or not 0.0 <= eps < math.inf:
        return None
    with np.errstate(over="ignore"):
        scalar = plan.acc.type(eps)
    if (scalar == 0.0 and eps != 0.0) or scalar == math.inf:
        return None
    if len(plan.eps_scalars) > 64:
        plan.eps_scalars.clear()
    plan.eps_scalars[eps] = scalar
    return scalar
