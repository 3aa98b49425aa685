"""Linear sum assignment: a faster drop-in for ``scipy.optimize.linear_sum_assignment``."""

from __future__ import annotations

from typing import Any

import numpy as np

from pyperm import _core
from pyperm._arrays import check_threads, is_cuda_array, like, real_float_array
from pyperm._cuda_ops import is_dlpack_cuda


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
        ``cost`` is not 2-D or not real, contains NaN or the wrong infinity
        ("matrix contains invalid numeric entries"), or no complete matching avoids
        the forbidden pairs ("cost matrix is infeasible").
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
    if is_cuda_array(cost) or is_dlpack_cuda(cost):
        from pyperm import _cuda_ops

        return _cuda_ops.linear_sum_assignment(cost, bool(maximize))
    arr = real_float_array(cost, "cost", 2)
    rows, cols = _core.lap_solve(arr, bool(maximize))
    return like(cost, rows, cols)


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
    if is_cuda_array(costs) or is_dlpack_cuda(costs):
        from pyperm import _cuda_ops

        return _cuda_ops.batch_linear_sum_assignment(costs, bool(maximize))
    arr = real_float_array(costs, "costs", 3)
    rows, cols = _core.lap_solve_batch(arr, bool(maximize), nthreads)
    return like(costs, rows, cols)


def _check_square(cost: Any, contiguous: bool) -> None:
    """The warm solvers' cost: a square float32/float64 numpy matrix (C-contiguous if asked)."""
    if not isinstance(cost, np.ndarray) or cost.dtype not in (np.float32, np.float64):
        raise TypeError("cost must be a float32 or float64 numpy array")
    if cost.ndim != 2 or cost.shape[0] != cost.shape[1] or (contiguous and not cost.flags.c_contiguous):
        what = "square C-contiguous matrix" if contiguous else "square matrix"
        raise ValueError(f"cost must be a {what}, got shape {cost.shape}")


def solve_square_warm(cost: np.ndarray, duals: np.ndarray) -> np.ndarray:
    """Minimising assignment of a square matrix, started from column duals (internal).

    For sequences of similar problems (the steps of weight matching): the solver skips the
    column reduction and starts its augmenting row reduction from ``duals``, which any
    finite values make correct and the previous problem's final duals make fast.

    Parameters
    ----------
    cost : (n, n) C-contiguous float32 or float64 numpy array
        The costs; ``+inf`` forbids a pair.
    duals : (n,) C-contiguous numpy array of ``cost``'s dtype
        Column duals to start from, overwritten with the final ones.

    Returns
    -------
    (n,) int64 numpy array
        The column of each row.
    """
    _check_square(cost, contiguous=False)
    if not isinstance(duals, np.ndarray) or duals.dtype != cost.dtype or duals.shape != cost.shape[:1]:
        raise ValueError(f"duals must be a ({cost.shape[0]},) numpy array of dtype {cost.dtype}")
    if not (duals.flags.c_contiguous and duals.flags.writeable):
        raise ValueError("duals must be a writeable C-contiguous array (it is updated in place)")
    if not np.isfinite(duals).all():
        raise ValueError("duals must be finite")
    return _core.lap_solve_warm(np.ascontiguousarray(cost), duals)


def incremental_solver(cost: np.ndarray) -> Any:
    """A minimising solver bound to ``cost``, a square C-contiguous float32/float64 array
    of finite or ``+inf`` entries (not checked) that the caller changes in place between
    ``solve()`` calls (internal).

    It keeps its matching and column duals from solve to solve and re-assigns only the rows
    whose matched entry stopped being a minimum of its reduced row; ``warm_start(col, v)``
    hands it another solver's answer and duals (e.g. :func:`solve_square_warm`'s).
    """
    _check_square(cost, contiguous=True)
    kind = _core.IncrementalAssignmentF64 if cost.dtype == np.float64 else _core.IncrementalAssignmentF32
    return kind(cost)
