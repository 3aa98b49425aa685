"""The CUDA backend of the assignment solvers: device arrays in, device arrays out.

Every solve reads a status flag back from the device, so each call synchronises the
stream it ran on before returning. The keyword arguments tune the kernels (benchmarks and
tests use them; the defaults choose automatically).
"""

from __future__ import annotations

import sys
from typing import Any

from pyperm._arrays import check_finite, check_ndim, check_square, is_torch_tensor
from pyperm._checks import check_bool, check_choice, check_int
from pyperm._cuda_arrays import as_device_array, dtype_name, empty_int64_like, torch_launch
from pyperm._ext import cuda_module

__all__ = ["batch_linear_sum_assignment", "linear_sum_assignment", "solve_square_warm"]


def _tuning(method: str, threads: int, stage: int, state_smem: int, max_rounds: int, patience: int) -> dict:
    """The kernels' options, type-checked here; the bindings check their ranges (which depend on the kernel)."""
    ints = dict(threads=threads, stage=stage, state_smem=state_smem, max_rounds=max_rounds, patience=patience)
    checked = {name: check_int(value, name) for name, value in ints.items()}
    return {"method": check_choice(method, "method", ("auto", "block", "device")), **checked}


def _solve(costs: Any, maximize: bool, name: str, batched: bool, tuning: dict[str, Any], return_stats: bool):
    src = as_device_array(costs, name, 3 if batched else 2)
    if batched:
        batch, n_rows, n_cols = src.shape
        sb, sr, sc = src.strides
    else:
        batch, (n_rows, n_cols) = 1, src.shape
        sb, (sr, sc) = 0, src.strides
    k = min(n_rows, n_cols)
    out_shape = (batch, k) if batched else (k,)
    rows, rows_ptr = empty_int64_like(src, out_shape)
    cols, cols_ptr = empty_int64_like(src, out_shape)
    stats = None
    if batch > 0 and k > 0:
        stats = cuda_module().lap_solve_strided(
            src.ptr, src.dtype, batch, n_rows, n_cols, sb, sr, sc, maximize, rows_ptr, cols_ptr,
            src.device, src.stream, batched, stats=return_stats, **tuning,
        )
    return (rows, cols, stats) if return_stats else (rows, cols)


def linear_sum_assignment(
    cost: Any,
    maximize: bool = False,
    *,
    method: str = "auto",
    threads: int = 0,
    stage: int = -1,
    state_smem: int = -1,
    max_rounds: int = -1,
    patience: int = -1,
    return_stats: bool = False,
):
    """Solve one assignment problem on its CUDA device (see :func:`pyperm.linear_sum_assignment`).

    ``method`` "block" (one thread block per problem) or "device" (whole-device
    initialisation, then one block per problem), ``threads`` per block, ``stage`` the matrix
    in shared memory (-1 auto, 0, 1), ``state_smem`` the solver state in shared memory (-1
    auto, 0, 1), ``max_rounds`` and ``patience`` of the parallel bidding rounds.
    ``return_stats`` adds a dict describing what ran.
    """
    maximize = check_bool(maximize, "maximize")
    tuning = _tuning(method, threads, stage, state_smem, max_rounds, patience)
    return _solve(cost, maximize, "cost", False, tuning, bool(return_stats))


def batch_linear_sum_assignment(
    costs: Any,
    maximize: bool = False,
    *,
    method: str = "auto",
    threads: int = 0,
    stage: int = -1,
    state_smem: int = -1,
    max_rounds: int = -1,
    patience: int = -1,
    return_stats: bool = False,
):
    """Solve a (B, n, m) stack on its CUDA device (see :func:`pyperm.batch_linear_sum_assignment`).

    Keyword arguments as :func:`linear_sum_assignment`.
    """
    maximize = check_bool(maximize, "maximize")
    tuning = _tuning(method, threads, stage, state_smem, max_rounds, patience)
    return _solve(costs, maximize, "costs", True, tuning, bool(return_stats))


def solve_square_warm(
    cost: Any,
    v: Any,
    *,
    method: str = "auto",
    threads: int = 0,
    stage: int = -1,
    state_smem: int = -1,
    max_rounds: int = -1,
    patience: int = -1,
):
    """Square minimisation warm-started from column duals, on the device (torch tensors).

    The device twin of the CPU ``solve_square_warm``, for sequences of similar problems
    (Birkhoff-von Neumann terms, the steps of weight matching): pass the previous solve's
    duals ``v`` and the next solve starts close to its answer.

    Parameters
    ----------
    cost : (n, n) or (B, n, n) torch.Tensor, float32 or float64, on a CUDA device
        Finite entries, or ``+inf`` for forbidden pairs (NaN is not checked here).
    v : (n,) or (B, n) torch.Tensor of the same dtype and device
        Column duals, any finite values (zeros for a cold start); updated in place with the
        final duals.

    Returns
    -------
    col_of_row : (n,) or (B, n) torch.Tensor, int64
        The column assigned to each row.

    Raises
    ------
    ValueError
        Mismatched shapes, dtypes or devices, non-finite ``v``, or "cost matrix is infeasible".
    TypeError
        ``cost`` or ``v`` is not a torch tensor.
    """
    if not (is_torch_tensor(cost) and is_torch_tensor(v)):
        raise TypeError("solve_square_warm takes torch tensors for cost and v")
    torch = sys.modules["torch"]
    batched = cost.dim() == 3
    check_ndim(tuple(cost.shape), (2, 3), "cost")
    check_square(cost.shape, "cost")
    if cost.device.type != "cuda" or v.device != cost.device:
        raise ValueError(f"cost and v must be on the same CUDA device, got {cost.device} and {v.device}")
    if cost.dtype not in (torch.float32, torch.float64) or v.dtype != cost.dtype:
        raise ValueError(f"cost and v must both be float32 or both float64, got {cost.dtype} and {v.dtype}")
    if tuple(v.shape) != tuple(cost.shape[:-1]):
        raise ValueError(f"v must have shape {tuple(cost.shape[:-1])}, got {tuple(v.shape)}")
    if not v.is_contiguous():
        raise ValueError("v must be contiguous (it is updated in place)")
    check_finite(v, "v")
    cost = cost.detach().contiguous()
    n = cost.shape[-1]
    batch = cost.shape[0] if batched else 1
    out = torch.empty(tuple(cost.shape[:-1]), dtype=torch.int64, device=cost.device)
    if batch == 0 or n == 0:
        return out
    tuning = _tuning(method, threads, stage, state_smem, max_rounds, patience)
    device, stream = torch_launch(cost)
    cuda_module().lap_solve_square_warm(
        cost.data_ptr(), dtype_name(cost), batch, n, v.data_ptr(), out.data_ptr(), device, stream, batched, **tuning
    )
    return out
