"""The pipeline forms (ragged lists, padded stacks with sizes, a cost limit) as one uniform stack.

The CUDA kernels solve uniform ``(B, R, K)`` stacks, one thread block per problem. This module
turns every pipeline form into such a stack with torch operations on the input's own device,
so the whole call is one solver launch, and reads the answers back in each form's terms. The
code is device-agnostic: the tests run it on CPU tensors with the CPU solver.

Each problem ``b`` (``n_b x m_b``) is laid into rows ``0..R-1`` and columns ``0..K-1``:

- oriented so that its smaller side is the rows (transposed when ``n_b > m_b``): ``r_b`` rows,
  ``c_b`` real columns;
- with a cost limit ``c``, row ``i`` also gets a private column ``c_b + i`` of cost ``c`` (of value
  ``-c`` when maximising: lap's objective mirrored, as on the CPU): taking it leaves the row
  unmatched. Any matching ``M`` costs ``C_M + c/2 (n + m - 2|M|)`` in lap's
  terms, which is ``C_M + c (r - |M|)`` plus a constant, so this is exact, with no arithmetic on
  the costs. A finite limit makes the stack float64, whatever the costs' dtype, so that the limit
  is compared with them as lap compares it (in float64). ``c = inf`` needs no private columns:
  every row is matched, which is lap's answer whenever a complete matching exists (and an error
  names the case when none does);
- rows ``r_b..R-1`` fill the stack: they cost 0 on the columns past the problem's own and are
  forbidden elsewhere, so they take nothing a real row could want. ``K`` leaves each of them a
  column of its own.

Every other entry is forbidden (``+inf``, or ``-inf`` when maximising). A complete matching of
the stack exists exactly when the problem's own does, and its optimum restricted to the real
rows is the problem's optimum.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["Problems", "padded_problems", "sequence_problems", "solve_problems"]

# solve_stack(stack, maximize) -> (rows, cols): a uniform-stack solver (the CUDA or CPU one).
StackSolver = Callable[[Any, bool], tuple[Any, Any]]


@dataclass
class Problems:
    """B problems read from one flat buffer: problem ``b``'s entry ``(i, j)`` is
    ``flat[offsets[b] + i * row_strides[b] + j]`` for ``i < n[b]``, ``j < m[b]``."""

    flat: Any  # 1-D float32/float64 tensor
    offsets: np.ndarray  # (B,) int64, on the host
    row_strides: np.ndarray  # (B,) int64
    n: np.ndarray  # (B,) int64
    m: np.ndarray  # (B,) int64


def _solver_dtype(tensors: list, limit: float | None) -> Any:
    """float32 when every tensor is float32 and no finite limit is to be compared with them, else
    float64 (the CPU path's rule)."""
    torch = sys.modules["torch"]
    single = tensors and all(t.dtype == torch.float32 for t in tensors)
    return torch.float32 if single and (limit is None or limit == math.inf) else torch.float64


def padded_problems(stack: Any, sizes: np.ndarray | None, limit: float | None) -> Problems:
    """A ``(B, N, M)`` tensor and its checked ``(B, 2)`` sizes (None: every problem full size),
    in the solver's dtype for ``limit``."""
    batch, n_max, m_max = stack.shape
    flat = stack.detach().to(_solver_dtype([stack], limit)).contiguous().reshape(-1)
    if sizes is None:
        sizes = np.tile(np.array([n_max, m_max], dtype=np.int64), (batch, 1))
    offsets = np.arange(batch, dtype=np.int64) * (n_max * m_max)
    return Problems(flat, offsets, np.full(batch, m_max, dtype=np.int64), sizes[:, 0].copy(), sizes[:, 1].copy())


def sequence_problems(costs: list, limit: float | None) -> Problems:
    """2-D tensors of any shapes on one device, concatenated into one buffer (one copy), in the
    solver's dtype for ``limit``."""
    torch = sys.modules["torch"]
    dtype = _solver_dtype(costs, limit)
    shapes = np.array([tuple(c.shape) for c in costs], dtype=np.int64).reshape(-1, 2)
    counts = shapes[:, 0] * shapes[:, 1]
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    flat = torch.cat([c.detach().reshape(-1).to(dtype) for c in costs]) if costs else None
    return Problems(flat, offsets, shapes[:, 1].copy(), shapes[:, 0].copy(), shapes[:, 1].copy())


def _uniform_stack(p: Problems, maximize: bool, limit: float | None):
    """The (B, R, K) stack of the module docstring, and a (3, B, 1) int64 tensor on the device of the
    per-problem rows ``r``, real columns ``c`` and whether the problem was transposed."""
    torch = sys.modules["torch"]
    device, dtype = p.flat.device, p.flat.dtype
    transposed = p.n > p.m
    r, c = np.minimum(p.n, p.m), np.maximum(p.n, p.m)
    private = r if limit is not None else np.zeros_like(r)
    rows = int(r.max())
    cols = int((c + private + rows - r).max())
    # Every per-problem number in one copy to the device.
    facts = torch.as_tensor(np.stack([r, c, transposed, p.offsets, p.row_strides, c + private]),
                            dtype=torch.int64).to(device)
    r_t, c_t, t_t, offset_t, stride_t, fill_from_t = facts.view(6, -1, 1, 1)
    t_t = t_t.bool()
    i = torch.arange(rows, device=device).view(1, -1, 1)
    j = torch.arange(cols, device=device).view(1, 1, -1)
    real = (i < r_t) & (j < c_t)
    # Entry (i, j) of the oriented problem is the input's (i, j), or (j, i) when transposed.
    src_row, src_col = torch.where(t_t, j, i), torch.where(t_t, i, j)
    index = offset_t + src_row * stride_t + src_col
    values = p.flat[torch.where(real, index, torch.zeros((), dtype=torch.int64, device=device))]

    def scalar(value: float):  # in the stack's dtype, so that a float64 limit keeps its digits
        return torch.tensor(value, dtype=dtype, device=device)

    fill = torch.where((i >= r_t) & (j >= fill_from_t), scalar(0.0), scalar(-math.inf if maximize else math.inf))
    if limit is not None:
        fill = torch.where((i < r_t) & (j == c_t + i), scalar(-limit if maximize else limit), fill)
    return torch.where(real, values, fill), facts[:3].view(3, -1, 1)


def solve_problems(
    p: Problems, maximize: bool, limit: float | None, solve_stack: StackSolver, name: str
) -> list[tuple[Any, Any]]:
    """Each problem's ``(row_ind, col_ind)``, int64 tensors on the buffer's device, row_ind
    increasing: ``min(n_b, m_b)`` pairs, or with ``limit`` the matched pairs only.

    ``name`` (the argument) goes into the message when ``limit`` is inf and a problem has no
    complete matching: lap's answer (the largest matching) is not computed here.
    """
    torch = sys.modules["torch"]
    batch = len(p.n)
    r = np.minimum(p.n, p.m)
    if batch == 0 or r.max() == 0:
        device = p.flat.device if p.flat is not None else "cpu"
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return [(empty, empty) for _ in range(batch)]
    # An infinite limit leaves no row unmatched while a complete matching exists: the plain problem.
    stack_limit = None if limit == math.inf else limit
    stack, (r_t, c_t, t_t) = _uniform_stack(p, maximize, stack_limit)
    try:
        _, col_of_row = solve_stack(stack, maximize)
    except ValueError as err:
        if limit == math.inf and "infeasible" in str(err):
            raise ValueError(f"{err}; with cost_limit=inf, a problem of {name} whose forbidden pairs leave no "
                             "complete matching needs the largest matching, which is solved on the CPU only; "
                             "pass CPU arrays or a finite cost_limit") from None
        raise
    t_t = t_t.bool()
    i = torch.arange(col_of_row.shape[1], device=col_of_row.device).view(1, -1)
    matched = (i < r_t) & (col_of_row < c_t)  # not a fill row, not a private (unmatched) column
    row_ind = torch.where(t_t, col_of_row, i)
    col_ind = torch.where(t_t, i, col_of_row)
    # Sort each problem's pairs by the input's row; unmatched and fill rows go last.
    key = torch.where(matched, row_ind, torch.iinfo(torch.int64).max)
    key, order = key.sort(dim=1)
    col_ind = col_ind.gather(1, order)
    counts = r if stack_limit is None else matched.sum(dim=1).cpu().numpy()
    return [(key[b, :k], col_ind[b, :k]) for b, k in enumerate(counts.tolist())]
