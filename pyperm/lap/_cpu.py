"""The CPU backend of the assignment solvers: numpy arrays into the compiled core."""

from __future__ import annotations

from typing import Any

import sys

import numpy as np

from pyperm._arrays import check_finite, like, real_float_array
from pyperm._ext import core

__all__ = ["batch_linear_sum_assignment", "incremental_solver", "linear_sum_assignment", "solve_square_warm"]


def linear_sum_assignment(cost: Any, maximize: bool) -> tuple[Any, Any]:
    """One problem (see :func:`pyperm.linear_sum_assignment`); torch CPU tensors in give tensors out."""
    arr = real_float_array(cost, "cost", 2)
    rows, cols = core.lap_solve(arr, maximize)
    return like(cost, rows, cols)


def solve_plain_tensor(cost: Any, maximize: bool) -> tuple[Any, Any] | None:
    """A CPU tensor that numpy can view as it is (no autograd, no lazy conjugate or negation)
    and the core can read in place, solved through that view with torch tensors out; None for
    any other tensor, which the general path converts. torch's own per-tensor costs (the view,
    two result tensors) are what this path adds to the numpy one."""
    try:
        view = cost.numpy()
    except (RuntimeError, TypeError):  # needs grad, lazy bits set, another device
        return None
    solved = core.lap_solve_plain(view, maximize)
    if solved is None:
        return None
    from_numpy = sys.modules["torch"].from_numpy
    return from_numpy(solved[0]), from_numpy(solved[1])


def batch_linear_sum_assignment(costs: Any, maximize: bool, threads: int) -> tuple[Any, Any]:
    """A (B, n, m) stack on ``threads`` threads (0: all cores); see :func:`pyperm.batch_linear_sum_assignment`."""
    arr = real_float_array(costs, "costs", 3)
    rows, cols = core.lap_solve_batch(arr, maximize, threads)
    return like(costs, rows, cols)


def _check_square(cost: Any, contiguous: bool) -> None:
    """The warm solvers' cost: a square float32/float64 numpy matrix (C-contiguous if asked)."""
    if not isinstance(cost, np.ndarray) or cost.dtype not in (np.float32, np.float64):
        got = f"dtype {cost.dtype}" if isinstance(cost, np.ndarray) else type(cost).__name__
        raise TypeError(f"cost must be a float32 or float64 array, got {got}")
    if cost.ndim != 2 or cost.shape[0] != cost.shape[1] or (contiguous and not cost.flags.c_contiguous):
        what = "square C-contiguous matrix" if contiguous else "square matrix"
        raise ValueError(f"cost must be a {what}, got shape {cost.shape}")


def solve_square_warm(cost: np.ndarray, duals: np.ndarray) -> np.ndarray:
    """Minimising assignment of a square matrix, started from column duals.

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
    check_finite(duals, "duals")
    return core.lap_solve_warm(np.ascontiguousarray(cost), duals)


def incremental_solver(cost: np.ndarray) -> Any:
    """A minimising solver bound to ``cost``, a square C-contiguous float32/float64 array
    of finite or ``+inf`` entries (not checked) that the caller changes in place between
    ``solve()`` calls.

    It keeps its matching and column duals from solve to solve and re-assigns only the rows
    whose matched entry stopped being a minimum of its reduced row; ``warm_start(col, v)``
    hands it another solver's answer and duals (e.g. :func:`solve_square_warm`'s).
    """
    _check_square(cost, contiguous=True)
    kind = core.IncrementalAssignmentF64 if cost.dtype == np.float64 else core.IncrementalAssignmentF32
    return kind(cost)
