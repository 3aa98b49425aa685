"""``pyperm.lap.lapjv``: the call of lap (gatagat/lap, lapx) that trackers make, on pyperm's solver."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from pyperm._arrays import is_cuda_input, like, real_float_array
from pyperm._ext import core
from pyperm.lap._ragged import check_cost_limit

__all__ = ["lapjv"]


def lapjv(cost: Any, extend_cost: bool = False, cost_limit: float = math.inf, return_cost: bool = True) -> tuple:
    r"""Solve an assignment problem with lap's arguments and result: a drop-in for ``lap.lapjv``.

    With a finite ``cost_limit`` :math:`c`, every row and every column left unmatched costs
    :math:`c / 2`, so the solution minimises

    .. math::

        \sum_{(i, j) \in M} C_{ij} + \frac{c}{2} \left( n + m - 2 |M| \right)

    over all matchings :math:`M`: a pair is matched only if it costs less than :math:`c`
    (at :math:`c` exactly, either way is optimal). This is lap's definition, which solves it
    on an :math:`(n + m) \times (n + m)` extended matrix; pyperm solves the same problem on a
    :math:`\min(n, m) \times (n + m)` one.

    Parameters
    ----------
    cost : (n, m) array-like or torch CPU tensor
        The costs. ``+inf`` forbids a pair. float32 and float64 are solved in their own
        precision; bool, integers and other real dtypes in float64.
    extend_cost : bool, default False
        Allow a rectangular ``cost`` when ``cost_limit`` is ``inf`` (a finite limit allows
        one anyway); ``min(n, m)`` pairs are then matched.
    cost_limit : float, default inf
        The limit :math:`c`: any real number (a negative one leaves every pair unmatched
        unless it costs less) or ``inf``. With ``inf`` every row of the short side is matched,
        except where forbidden pairs make that impossible: then the matching has as many
        pairs as the allowed pairs permit, at least cost among those.
    return_cost : bool, default True
        Return the total cost first.

    Returns
    -------
    cost : float
        The sum of ``cost[i, x[i]]`` over the matched rows, in float64 (only when
        ``return_cost``). Unmatched rows and columns add nothing to it.
    x : (n,) int32 array
        ``x[i]`` is the column of row ``i``, or -1 if row ``i`` is unmatched.
    y : (m,) int32 array
        ``y[j]`` is the row of column ``j``, or -1 if column ``j`` is unmatched.
        Torch tensors in give torch tensors out.

    Raises
    ------
    ValueError
        ``cost`` is not 2-D, is rectangular (and not empty) with ``extend_cost`` False and
        ``cost_limit`` inf, or holds NaN or ``-inf``; ``cost_limit`` is NaN or ``-inf``;
        ``cost`` is a CUDA array.
    TypeError
        ``cost`` does not hold real numbers; ``cost_limit`` is not a real number;
        ``extend_cost`` or ``return_cost`` is not a bool or an int.

    Notes
    -----
    Where lap and pyperm differ: lap leaves NaN and ``-inf`` undefined (pyperm raises); with
    ``cost_limit=inf`` lap matches forbidden pairs when a full matching needs them and
    reports a total of ``inf`` (pyperm leaves those rows unmatched); lap takes numpy arrays
    only and discards the imaginary part of complex input (pyperm takes array-likes and
    torch CPU tensors, and refuses complex numbers).

    Examples
    --------
    >>> import numpy as np
    >>> from pyperm.lap import lapjv
    >>> cost = np.array([[0.1, 0.9, 0.8], [0.7, 0.95, 0.2]])
    >>> total, x, y = lapjv(cost, extend_cost=True, cost_limit=0.5)
    >>> round(total, 2), x.tolist(), y.tolist()
    (0.3, [0, 2], [0, -1, 1])
    """
    extend = _flag(extend_cost, "extend_cost")
    with_cost = _flag(return_cost, "return_cost")
    limit = check_cost_limit(cost_limit, allow_negative=True)
    if is_cuda_input(cost):
        raise ValueError("lapjv is not supported on CUDA yet; pass a CPU array")
    arr = real_float_array(cost, "cost", 2)
    n, m = arr.shape
    if n != m and n and m and not extend and limit == math.inf:
        raise ValueError(f"cost must be square unless extend_cost=True or cost_limit is finite, got shape {arr.shape}")
    total, x, y = core.lap_lapjv(arr, limit)
    if cost is not arr:
        x, y = like(cost, x, y)
    return (total, x, y) if with_cost else (x, y)


def _flag(value: Any, name: str) -> bool:
    """A bool, or an int read as one (lap takes both)."""
    if not isinstance(value, (numbers.Integral, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)
