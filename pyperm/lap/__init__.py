"""Linear sum assignment: a faster drop-in for ``scipy.optimize.linear_sum_assignment``.

The public functions classify their input once and dispatch: CUDA arrays go to
:mod:`pyperm.lap._cuda` (imported only then), everything else to :mod:`pyperm.lap._cpu`.
Sequences of similar problems have their own home in :mod:`pyperm.lap.warm`.
"""

from __future__ import annotations

from typing import Any

from pyperm._arrays import is_cuda_input, is_torch_tensor
from pyperm._checks import check_threads
import numpy as np

from pyperm._ext import core
from pyperm.lap import _cpu, _ragged, _torch_route
from pyperm.lap._lapjv import lapjv
from pyperm.lap._result_form import ResultFormWarning, warn_if_unpacked_as_stack
from pyperm.lap._sparse import is_scipy_sparse, linear_sum_assignment_sparse
from pyperm.lap._torch_route import register_torch_ops

__all__ = [
    "ResultFormWarning",
    "batch_linear_sum_assignment",
    "lapjv",
    "linear_sum_assignment",
    "register_torch_ops",
]

_torch_route.register_if_torch_imported()

_ndarray = np.ndarray  # one global lookup on the per-call path


def linear_sum_assignment(cost: Any, maximize: bool = False, *, cost_limit: float | None = None) -> tuple[Any, Any]:
    r"""Solve the linear sum assignment problem.

    Finds the matching of rows to columns that minimises (or maximises) the total cost

    .. math::

        \min_X \sum_i \sum_j C_{ij} X_{ij}, \quad X \in \{0, 1\}^{n \times m},\;
        \sum_j X_{ij} \le 1,\; \sum_i X_{ij} \le 1,\; \sum_{ij} X_{ij} = \min(n, m).

    Same semantics as :func:`scipy.optimize.linear_sum_assignment`, solved by the
    Jonker-Volgenant algorithm in C++ with SIMD scans chosen at run time.

    Parameters
    ----------
    cost : (n, m) array-like or torch.Tensor
        The cost matrix. ``+inf`` (``-inf`` when maximising) forbids a pair. float32
        and float64 are solved in their own precision; bool, integers and other real
        dtypes (float16, and torch's bfloat16 and float8 formats) are solved in float64.
        Every finite cost is valid: costs so large that the solver's dual updates could
        overflow are solved in a float64 copy (float32 input) or a copy scaled by a power
        of two (float64 input). CUDA arrays (torch tensors, objects exposing
        ``__cuda_array_interface__`` or DLPack) are solved on their device, on the
        current stream, and give int64 arrays on the same device (torch tensors for
        torch input, CuPy arrays for CuPy input, torch tensors otherwise); the call
        then synchronises that stream, because the validity and feasibility flags are
        read back from the device. A ``scipy.sparse`` matrix or array is solved without
        densifying it, with the semantics of
        :func:`scipy.sparse.csgraph.min_weight_full_bipartite_matching`: only stored
        entries (explicit zeros included) are pairs, and a ValueError says when no
        complete matching exists.
    maximize : bool, default False
        Maximise the total instead of minimising it.
    cost_limit : float, optional
        lap's threshold :math:`c \ge 0` (finite or ``inf``): rows and columns may stay
        unmatched, each costing :math:`c / 2`. Minimising, the matching minimises
        :math:`\sum_{(i,j) \in M} C_{ij} + \tfrac{c}{2}(n + m - 2|M|)`, so a pair is
        matched only if it costs less than :math:`c` (at :math:`c` exactly, either way is
        optimal). Maximising mirrors it (the same as minimising ``-cost`` with the same
        limit): it maximises :math:`\sum_{(i,j) \in M} C_{ij} - \tfrac{c}{2}(n + m - 2|M|)`,
        so a pair is matched only if its value exceeds :math:`-c`, and a larger limit never
        matches fewer pairs (to match only values above a threshold :math:`t`, pass
        ``cost - t`` with ``cost_limit=0``). The limit is compared with the costs in float64,
        as lap compares it, whatever their dtype: float32 costs with a finite limit are
        solved in float64 (``float32(0.1)`` is above a limit of 0.1). Forbidden pairs stay
        unmatched instead of making the problem infeasible. ``inf`` means no pair is too
        expensive: the matching has as many pairs as the allowed
        pairs permit (``min(n, m)`` when none is forbidden), the best among those. CUDA
        arrays are solved on their device, except that with ``inf`` a matrix whose forbidden
        pairs leave no complete matching raises a ValueError there (pass it on the CPU).
        scipy.sparse input with a ``cost_limit`` raises a ValueError.

    Returns
    -------
    row_ind, col_ind : (min(n, m),) int64 arrays
        ``row_ind`` is increasing; ``cost[row_ind, col_ind]`` is the optimal matching.
        Torch tensors in give torch tensors out. With ``cost_limit``, the matched pairs
        only (possibly fewer than ``min(n, m)``), ``row_ind`` increasing.

    Raises
    ------
    ValueError
        ``cost`` is not 2-D ("expected a matrix"), contains NaN or the wrong infinity
        ("matrix contains invalid numeric entries"), or no complete matching avoids
        the forbidden pairs ("cost matrix is infeasible"); ``cost_limit`` is NaN,
        negative or not a scalar, or is given with scipy.sparse ``cost``; a scipy.sparse
        side reaches 2**31 - 1.
    TypeError
        ``cost`` does not hold real numbers (strings, objects, complex: "Cannot cast array
        data", as scipy). The exception is also a ValueError, which pyperm raised before.
        ``cost_limit`` is not a real number (a string, or an array of strings).
    RuntimeError
        ``cost`` is a CUDA array but pyperm was built without CUDA or no GPU is visible.

    Examples
    --------
    >>> import numpy as np, pyperm
    >>> cost = np.array([[4, 1, 3], [2, 0, 5], [3, 2, 2]])
    >>> row, col = pyperm.linear_sum_assignment(cost)
    >>> col.tolist(), int(cost[row, col].sum())
    ([1, 0, 2], 5)
    """
    if cost.__class__ is _ndarray:
        if cost_limit is None and maximize.__class__ is bool:
            # The commonest input, a float64/float32 numpy matrix that can be read in place,
            # in one call to the core; None for anything else, which is classified below.
            solved = core.lap_solve_plain(cost, maximize)
            if solved is not None:
                return solved
    elif is_torch_tensor(cost):
        if _torch_route.traced(cost):
            # torch.compile / torch.export: one custom operator in the graph (before any call
            # into the core, which Dynamo cannot trace).
            if cost_limit is None:
                return _torch_route.operators().linear_sum_assignment(cost, bool(maximize))
            limit = _ragged.check_cost_limit(cost_limit)
            return _torch_route.operators().linear_sum_assignment_limited(cost, bool(maximize), limit)
        if cost_limit is None and maximize.__class__ is bool:
            solved = _cpu.solve_plain_tensor(cost, maximize)
            if solved is not None:
                return solved
    if is_scipy_sparse(cost):
        if cost_limit is not None:
            raise ValueError("cost_limit is not supported for scipy.sparse input: pass a dense cost")
        return linear_sum_assignment_sparse(cost, bool(maximize))
    if cost_limit is not None:
        return _ragged.linear_sum_assignment_limited(cost, bool(maximize), cost_limit)
    if is_cuda_input(cost):
        from pyperm.lap import _cuda

        return _cuda.linear_sum_assignment(cost, bool(maximize))
    return _cpu.linear_sum_assignment(cost, bool(maximize))


def batch_linear_sum_assignment(
    costs: Any,
    maximize: bool = False,
    threads: int | None = None,
    *,
    sizes: Any = None,
    cost_limit: float | None = None,
) -> tuple[Any, Any] | list[tuple[Any, Any]]:
    """Solve many independent assignment problems in parallel.

    Three forms of ``costs``, and what each returns:

    - a ``(B, n, m)`` stack: ``B`` problems of one shape; stacked ``(B, min(n, m))``
      ``row_ind`` and ``col_ind`` arrays (a list of B pairs with ``cost_limit``);
    - a list or tuple of 2-D costs of any shapes (empty ones included), equal shapes too: a
      list of B ``(row_ind, col_ind)`` pairs, one per matrix; all are solved in float32 when
      all are float32, else in float64;
    - a padded ``(B, N, M)`` stack with ``sizes``: problem ``b`` is
      ``costs[b, :n_b, :m_b]`` (a detector's matcher: queries x padded targets); a list of
      B pairs.

    A list of equal-shape matrices was read as a ``(B, n, m)`` stack before 2026-11-29 (see the
    changelog). With two matrices, old code's ``rows, cols = batch_linear_sum_assignment([c0,
    c1])`` would still run, with each name holding one problem's pair: that unpacking gives a
    :class:`ResultFormWarning`. Pass ``np.stack(costs)`` for stacked arrays.

    Parameters
    ----------
    costs : (B, n, m) array-like or torch.Tensor, or a sequence of (n_b, m_b) ones
        The cost matrices, with the dtype rules of :func:`linear_sum_assignment`.
    maximize : bool, default False
        Maximise every problem instead of minimising.
    threads : int, optional
        Worker threads (default: all cores). The GIL is released while they run.
        Ignored for CUDA input, which is solved on its device (one thread block per
        problem) and synchronises the current stream before returning.
    sizes : (B, 2) array-like of int, optional
        ``(n_b, m_b)`` per problem of a padded stack, ``0 <= n_b <= N``, ``0 <= m_b <= M``.
    cost_limit : float, optional
        lap's threshold, as in :func:`linear_sum_assignment`, for every problem.

    Returns
    -------
    row_ind, col_ind : (B, min(n, m)) int64 arrays
        For a stack without ``sizes`` and ``cost_limit``: problem ``b``'s answer equals
        ``linear_sum_assignment(costs[b], maximize)``.
    list of B (row_ind, col_ind) tuples
        For a sequence, for ``sizes`` and for ``cost_limit``: tuple ``b`` equals
        ``linear_sum_assignment(problem_b, maximize, cost_limit=cost_limit)``, as int64
        numpy arrays, or torch tensors where that problem (or the stack) was a torch
        tensor. Indices refer to the problem itself (within ``n_b`` and ``m_b``).
        CUDA arrays (every element of a sequence on one device) are solved on their
        device in one launch: the problems are laid into one padded stack there (each
        oriented with its smaller side as rows), and the answers are int64 tensors on
        that device (``sizes`` stays on the host).

    Raises
    ------
    ValueError
        As :func:`linear_sum_assignment`, naming the first failing problem's index; an
        element of a sequence that is not 2-D; ``sizes`` of the wrong shape or out of
        range; a bad ``cost_limit``.
    TypeError
        ``costs`` is an iterator (pass a list), a numpy object array (pass a list), or a
        sequence holding a scipy.sparse matrix (solve those one at a time with
        :func:`linear_sum_assignment`).
    RuntimeError
        ``costs`` is a CUDA array but pyperm was built without CUDA or no GPU is visible.

    Examples
    --------
    >>> import numpy as np, pyperm
    >>> costs = np.random.default_rng(0).random((8, 5, 5))
    >>> rows, cols = pyperm.batch_linear_sum_assignment(costs)
    >>> rows.shape, cols.shape
    ((8, 5), (8, 5))
    """
    nthreads = check_threads(threads)
    _ragged.check_batch_costs(costs)
    if isinstance(costs, (list, tuple)):
        warn_if_unpacked_as_stack(costs)
    if sizes is not None or cost_limit is not None or isinstance(costs, (list, tuple)):
        return _ragged.batch_linear_sum_assignment(costs, bool(maximize), nthreads, sizes, cost_limit)
    if _torch_route.traced(costs):  # torch.compile / torch.export: one custom operator in the graph
        return _torch_route.operators().batch_linear_sum_assignment(costs, bool(maximize), nthreads)
    if is_cuda_input(costs):
        from pyperm.lap import _cuda

        return _cuda.batch_linear_sum_assignment(costs, bool(maximize))
    return _cpu.batch_linear_sum_assignment(costs, bool(maximize), nthreads)
