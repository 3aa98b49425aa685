"""Linear sum assignment: a faster drop-in for ``scipy.optimize.linear_sum_assignment``.

The public functions classify their input once and dispatch: CUDA arrays go to
:mod:`pyperm.lap._cuda` (imported only then), everything else to :mod:`pyperm.lap._cpu`.
Sequences of similar problems have their own home in :mod:`pyperm.lap.warm`.
"""

from __future__ import annotations

from typing import Any

from pyperm._arrays import is_cuda_input
from pyperm._checks import check_threads
from pyperm.lap import _cpu, _torch_route
from pyperm.lap._torch_route import register_torch_ops

__all__ = ["batch_linear_sum_assignment", "linear_sum_assignment", "register_torch_ops"]

_torch_route.register_if_torch_imported()


def linear_sum_assignment(cost: Any, maximize: bool = False) -> tuple[Any, Any]:
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
        dtypes are solved in float64. CUDA arrays (torch tensors, objects exposing
        ``__cuda_array_interface__`` or DLPack) are solved on their device, on the
        current stream, and give int64 arrays on the same device (torch tensors for
        torch input, CuPy arrays for CuPy input, torch tensors otherwise); the call
        then synchronises that stream, because the validity and feasibility flags are
        read back from the device.
    maximize : bool, default False
        Maximise the total instead of minimising it.

    Returns
    -------
    row_ind, col_ind : (min(n, m),) int64 arrays
        ``row_ind`` is increasing; ``cost[row_ind, col_ind]`` is the optimal matching.
        Torch tensors in give torch tensors out.

    Raises
    ------
    ValueError
        ``cost`` is not 2-D ("expected a matrix"), contains NaN or the wrong infinity
        ("matrix contains invalid numeric entries"), or no complete matching avoids
        the forbidden pairs ("cost matrix is infeasible").
    TypeError
        ``cost`` does not hold real numbers (strings, objects, complex: "Cannot cast array
        data", as scipy). The exception is also a ValueError, which pyperm raised before.
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
    if _torch_route.traced(cost):  # torch.compile / torch.export: one custom operator in the graph
        return _torch_route.operators().linear_sum_assignment(cost, bool(maximize))
    if is_cuda_input(cost):
        from pyperm.lap import _cuda

        return _cuda.linear_sum_assignment(cost, bool(maximize))
    return _cpu.linear_sum_assignment(cost, bool(maximize))


def batch_linear_sum_assignment(
    costs: Any, maximize: bool = False, threads: int | None = None
) -> tuple[Any, Any]:
    """Solve a stack of independent assignment problems in parallel.

    Parameters
    ----------
    costs : (B, n, m) array-like or torch.Tensor
        ``B`` cost matrices of one shape, with the dtype rules of
        :func:`linear_sum_assignment`.
    maximize : bool, default False
        Maximise every problem instead of minimising.
    threads : int, optional
        Worker threads (default: all cores). The GIL is released while they run.
        Ignored for CUDA input, which is solved on its device (one thread block per
        problem) and synchronises the current stream before returning.

    Returns
    -------
    row_ind, col_ind : (B, min(n, m)) int64 arrays
        Problem ``b``'s answer equals ``linear_sum_assignment(costs[b], maximize)``.

    Raises
    ------
    ValueError
        As :func:`linear_sum_assignment`, naming the first failing problem's index.
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
    if _torch_route.traced(costs):
        return _torch_route.operators().batch_linear_sum_assignment(costs, bool(maximize), nthreads)
    if is_cuda_input(costs):
        from pyperm.lap import _cuda

        return _cuda.batch_linear_sum_assignment(costs, bool(maximize))
    return _cpu.batch_linear_sum_assignment(costs, bool(maximize), nthreads)
