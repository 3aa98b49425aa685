"""The assignment solvers as torch custom operators, for ``torch.compile`` and ``torch.export``.

Importing this module imports torch and registers two operators with :mod:`torch.library`:

- ``torch.ops.pyperm.linear_sum_assignment(cost, maximize)`` -> ``(row_ind, col_ind)``,
  each ``(min(n, m),)`` int64 on ``cost``'s device;
- ``torch.ops.pyperm.batch_linear_sum_assignment(costs, maximize, threads)`` ->
  ``(row_ind, col_ind)``, each ``(B, min(n, m))`` int64 on ``costs``' device.

Their kernels are the solvers' own CPU and CUDA backends; their fake implementations give
the output shapes from the input's alone, which is what lets the compiler and the exporter
trace through a solve without running it. The public functions in :mod:`pyperm.lap` call
these operators only while torch compiles or exports: in eager mode the dispatcher would
only add cost to every call.

:mod:`pyperm.lap` imports this module when torch is already imported (and otherwise on the
first tensor it is given), so pyperm itself never imports torch.
"""

from __future__ import annotations

import torch

from pyperm._arrays import check_ndim, real_float_tensor
from pyperm.lap import _cpu, _ragged

__all__ = ["batch_linear_sum_assignment", "linear_sum_assignment", "linear_sum_assignment_limited"]

Pair = tuple[torch.Tensor, torch.Tensor]

# The CUDA kernels read a status flag back from the device, synchronising the stream, which
# a CUDA graph cannot capture: the tag makes inductor keep the operator out of its CUDA graphs.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _cuda_backend():
    # Imported on first use, as pyperm.lap does: the CUDA module loads lazily.
    from pyperm.lap import _cuda

    return _cuda


@torch.library.custom_op("pyperm::linear_sum_assignment", mutates_args=(), device_types="cpu", tags=_TAGS)
def linear_sum_assignment(cost: torch.Tensor, maximize: bool = False) -> Pair:
    """One problem; see :func:`pyperm.linear_sum_assignment`."""
    return _cpu.linear_sum_assignment(cost, maximize)


@linear_sum_assignment.register_kernel("cuda")
def _linear_sum_assignment_cuda(cost: torch.Tensor, maximize: bool = False) -> Pair:
    return _cuda_backend().linear_sum_assignment(cost, maximize)


@linear_sum_assignment.register_fake
def _linear_sum_assignment_fake(cost: torch.Tensor, maximize: bool = False) -> Pair:
    check_ndim(tuple(cost.shape), 2, "cost")
    real_float_tensor(cost, "cost")  # the kernels' dtype errors, raised at trace time
    k = torch.sym_min(cost.shape[0], cost.shape[1])
    return cost.new_empty((k,), dtype=torch.int64), cost.new_empty((k,), dtype=torch.int64)


@torch.library.custom_op("pyperm::batch_linear_sum_assignment", mutates_args=(), device_types="cpu", tags=_TAGS)
def batch_linear_sum_assignment(costs: torch.Tensor, maximize: bool = False, threads: int = 0) -> Pair:
    """A (B, n, m) stack on ``threads`` threads (0: all cores); see :func:`pyperm.batch_linear_sum_assignment`."""
    return _cpu.batch_linear_sum_assignment(costs, maximize, threads)


@batch_linear_sum_assignment.register_kernel("cuda")
def _batch_linear_sum_assignment_cuda(costs: torch.Tensor, maximize: bool = False, threads: int = 0) -> Pair:
    return _cuda_backend().batch_linear_sum_assignment(costs, maximize)


@batch_linear_sum_assignment.register_fake
def _batch_linear_sum_assignment_fake(costs: torch.Tensor, maximize: bool = False, threads: int = 0) -> Pair:
    check_ndim(tuple(costs.shape), 3, "costs")
    real_float_tensor(costs, "costs")
    shape = (costs.shape[0], torch.sym_min(costs.shape[1], costs.shape[2]))
    return costs.new_empty(shape, dtype=torch.int64), costs.new_empty(shape, dtype=torch.int64)



@torch.library.custom_op(
    "pyperm::linear_sum_assignment_limited", mutates_args=(), device_types=("cpu", "cuda"), tags=_TAGS
)
def linear_sum_assignment_limited(cost: torch.Tensor, maximize: bool, cost_limit: float) -> Pair:
    """One problem with lap's cost limit; see :func:`pyperm.linear_sum_assignment` (either device)."""
    return _ragged.linear_sum_assignment_limited(cost, maximize, cost_limit)


@linear_sum_assignment_limited.register_fake
def _linear_sum_assignment_limited_fake(cost: torch.Tensor, maximize: bool, cost_limit: float) -> Pair:
    check_ndim(tuple(cost.shape), 2, "cost")
    real_float_tensor(cost, "cost")
    _ragged.check_cost_limit(cost_limit)
    # How many pairs pay is known only once the solve has run: a new unbacked size, bounded
    # by the full matching's (a bound given as max= must be a static int under dynamic shapes).
    count = torch.library.get_ctx().new_dynamic_size()
    torch._check(count <= torch.sym_min(cost.shape[0], cost.shape[1]))
    return cost.new_empty((count,), dtype=torch.int64), cost.new_empty((count,), dtype=torch.int64)
