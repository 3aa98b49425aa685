"""The assignment forms of ML pipelines on the CPU: ragged lists, padded stacks with sizes,
and lap's cost limit.

Each form is recognised once and has one path into the compiled core, which solves every
problem of a call on its threads with the GIL released:

- a list or tuple of 2-D costs (any shapes, empty ones included);
- a padded ``(B, N, M)`` stack with ``sizes`` (problem ``b`` is ``costs[b, :n_b, :m_b]``), or
  with a cost limit and no sizes (every problem full size);
- one matrix with a cost limit.

The batch forms give a list of ``(row_ind, col_ind)``, one per problem, each in the array type
of its input (torch CPU tensors give torch tensors).

CUDA arrays take every form to :mod:`pyperm.lap._padded_batch`, which lays the problems into one
uniform stack on their device for one launch of the CUDA solver.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from typing import Any

import numpy as np

from pyperm._arrays import check_real_dtype, is_cuda_input, is_torch_tensor, like, real_float_array, to_numpy
from pyperm._cuda_arrays import as_cuda_tensor, like_input
from pyperm._ext import core
from pyperm.lap import _padded_batch
from pyperm.lap._sparse import is_scipy_sparse

__all__ = ["batch_linear_sum_assignment", "check_batch_costs", "check_cost_limit", "linear_sum_assignment_limited"]


def check_cost_limit(value: Any, *, allow_negative: bool = False) -> float:
    """A ``cost_limit=``: a real scalar, finite or ``+inf``, non-negative unless allowed.

    Raises TypeError for what is not a real number and ValueError for NaN, ``-inf``, a
    negative limit (unless ``allow_negative``) or an array of more than one value; each
    message names ``cost_limit``.
    """
    if isinstance(value, (int, float)):
        # Plain numbers first, with no attribute lookups: under torch.compile with dynamic
        # shapes the limit is a symbolic float, which Dynamo cannot ask for a shape or a dtype.
        return _checked_limit(float(value), allow_negative)
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"cost_limit must be a real number, got {type(value).__name__}")
    # A numpy string or object scalar would pass float() below.
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind not in "biuf":
        raise TypeError(f"cost_limit must be a real number, got an array of dtype {value.dtype}")
    if is_torch_tensor(value) and (value.is_complex() or value.is_quantized):
        raise TypeError(f"cost_limit must be a real number, got a tensor of dtype {value.dtype}")
    shape = getattr(value, "shape", None)
    if shape is None and isinstance(value, (list, tuple)):
        shape = np.shape(value)
    if shape is not None and tuple(shape) != ():
        raise ValueError(f"cost_limit must be a scalar, got shape {tuple(shape)}")
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        raise TypeError(f"cost_limit must be a real number, got {type(value).__name__}")
    try:
        limit = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"cost_limit must be a real number, got {type(value).__name__}") from None
    return _checked_limit(limit, allow_negative)


def _checked_limit(limit: float, allow_negative: bool) -> float:
    # limit != limit is the NaN test that a symbolic float under torch.compile also answers.
    if limit != limit or limit == -math.inf or (limit < 0 and not allow_negative):
        what = "finite or +inf" if allow_negative else "non-negative (finite or +inf)"
        raise ValueError(f"cost_limit must be {what}, got {limit}")
    return limit


def linear_sum_assignment_limited(cost: Any, maximize: bool, cost_limit: Any) -> tuple[Any, Any]:
    """One matrix with a cost limit (see :func:`pyperm.linear_sum_assignment`)."""
    limit = check_cost_limit(cost_limit)
    if is_cuda_input(cost):
        tensor, kind = as_cuda_tensor(cost, "cost", 2)
        problems = _padded_batch.padded_problems(tensor[None], None, limit)
        (rows, cols), = _solve_on_device(problems, maximize, limit, "cost")
        return like_input(kind, rows), like_input(kind, cols)
    arr = real_float_array(cost, "cost", 2)
    rows, cols = core.lap_solve_limited(arr, maximize, limit)
    return like(cost, rows, cols)


def check_batch_costs(costs: Any) -> None:
    """Refuses, with a TypeError naming ``costs``, what numpy would misread as an array of
    another shape: an iterator (read as one object) and an object array of matrices."""
    if isinstance(costs, Iterator):
        raise TypeError(f"costs must be a list or tuple of matrices or a (B, n, m) stack, got "
                        f"{type(costs).__name__}: pass list(costs)")
    if isinstance(costs, np.ndarray) and costs.dtype == object:
        raise TypeError(f"costs is a numpy object array of shape {costs.shape}: pass a list of matrices "
                        "(costs.tolist()) or a (B, n, m) stack of numbers")


def batch_linear_sum_assignment(
    costs: Any, maximize: bool, threads: int, sizes: Any, cost_limit: Any
) -> list[tuple[Any, Any]]:
    """A ragged list, or a padded stack with ``sizes`` and/or a cost limit (see
    :func:`pyperm.batch_linear_sum_assignment`); ``threads`` 0 means all cores."""
    limit = None if cost_limit is None else check_cost_limit(cost_limit)
    if isinstance(costs, (list, tuple)):
        if sizes is not None:
            raise ValueError("sizes applies to a padded (B, N, M) stack, not to a sequence of matrices")
        return _solve_sequence(costs, maximize, threads, limit)
    return _solve_padded(costs, maximize, threads, sizes, limit)


def _solve_sequence(costs: list | tuple, maximize: bool, threads: int, limit: float | None) -> list:
    """Each element read as a 2-D real array, all in float32 when all are float32, else float64."""
    on_device = [is_cuda_input(cost) for cost in costs]
    if any(on_device):
        return _solve_sequence_on_device(costs, on_device, maximize, limit)
    arrays = []
    for b, cost in enumerate(costs):
        name = f"costs[{b}]"
        if is_scipy_sparse(cost):
            raise TypeError(f"{name} is a scipy.sparse matrix: the batch forms take dense matrices; solve each "
                            "sparse one with pyperm.linear_sum_assignment")
        arr = to_numpy(cost, name)
        if arr.ndim != 2:
            raise ValueError(f"{name} must be a 2-D array, got shape {arr.shape}")
        check_real_dtype(arr.dtype, name)
        arrays.append(arr)
    dtype = np.float32 if arrays and all(a.dtype == np.float32 for a in arrays) else np.float64
    # The core reads rows at any stride but wants each row's entries adjacent, aligned and native
    # (a fresh copy is all three; ascontiguousarray would hand an unaligned array back unchanged).
    arrays = [a if a.dtype == dtype and _rows_readable(a) else np.array(a, dtype=dtype, order="C") for a in arrays]
    rows, cols, bounds = core.lap_solve_many(arrays, maximize, limit, threads)
    return [like(cost, rows[lo:hi], cols[lo:hi]) for cost, lo, hi in zip(costs, bounds[:-1], bounds[1:])]


def _solve_sequence_on_device(costs: list | tuple, on_device: list[bool], maximize: bool, limit: float | None) -> list:
    """Every element a CUDA array of one device, solved in one launch."""
    if not all(on_device):
        b = on_device.index(False)
        raise ValueError(f"costs[{b}] is not a CUDA array but costs[{on_device.index(True)}] is: "
                         "pass every matrix on one device")
    tensors, kinds = zip(*(as_cuda_tensor(cost, f"costs[{b}]", 2) for b, cost in enumerate(costs)))
    devices = [t.device for t in tensors]
    if len(set(devices)) > 1:
        b = next(b for b, d in enumerate(devices) if d != devices[0])
        raise ValueError(f"costs[{b}] is on {devices[b]} but costs[0] is on {devices[0]}: "
                         "pass every matrix on one device")
    answers = _solve_on_device(_padded_batch.sequence_problems(list(tensors), limit), maximize, limit, "costs")
    return [(like_input(kind, rows), like_input(kind, cols)) for kind, (rows, cols) in zip(kinds, answers)]


def _solve_on_device(problems: _padded_batch.Problems, maximize: bool, limit: float | None, name: str) -> list:
    from pyperm.lap import _cuda

    return _padded_batch.solve_problems(problems, maximize, limit, _cuda.batch_linear_sum_assignment, name)


def _rows_readable(a: np.ndarray) -> bool:
    """Whether the core can read ``a`` in place: aligned native-order entries, contiguous within a
    row, rows in order."""
    if a.size == 0:
        return True
    if not (a.flags.aligned and a.dtype.isnative):
        return False
    item = a.itemsize
    n, m = a.shape
    return (m <= 1 or a.strides[1] == item) and (n <= 1 or (a.strides[0] % item == 0 and a.strides[0] >= m * item))


def _solve_padded(costs: Any, maximize: bool, threads: int, sizes: Any, limit: float | None) -> list:
    if is_cuda_input(costs):
        tensor, kind = as_cuda_tensor(costs, "costs", 3)
        size_arr = None if sizes is None else _check_sizes(sizes, tuple(tensor.shape))
        answers = _solve_on_device(_padded_batch.padded_problems(tensor, size_arr, limit), maximize, limit, "costs")
        return [(like_input(kind, rows), like_input(kind, cols)) for rows, cols in answers]
    arr = real_float_array(costs, "costs", 3)
    batch, n_max, m_max = arr.shape
    if sizes is None:
        size_arr = np.empty((batch, 2), dtype=np.int64)
        size_arr[:] = (n_max, m_max)
    else:
        size_arr = _check_sizes(sizes, arr.shape)
    rows, cols, bounds = core.lap_solve_padded(arr, size_arr, maximize, limit, threads)
    return [like(costs, rows[lo:hi], cols[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _check_sizes(sizes: Any, shape: tuple[int, int, int]) -> np.ndarray:
    """``sizes`` as a C-contiguous (B, 2) int64 array of (n_b, m_b) within the stack's (N, M)."""
    if is_cuda_input(sizes):
        raise ValueError("sizes must be on the CPU (a list, a numpy array or a CPU tensor)")
    arr = to_numpy(sizes, "sizes")
    batch, n_max, m_max = shape
    if batch == 0 and arr.size == 0:  # an empty list reads as float64
        return np.empty((0, 2), dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"sizes must hold integers, got dtype {arr.dtype}")
    if arr.shape != (batch, 2):
        raise ValueError(f"sizes must have shape (B, 2) = ({batch}, 2), one (rows, columns) per problem, "
                         f"got shape {arr.shape}")
    bad = np.flatnonzero((arr[:, 0] < 0) | (arr[:, 0] > n_max) | (arr[:, 1] < 0) | (arr[:, 1] > m_max))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"sizes[{b}] = ({int(arr[b, 0])}, {int(arr[b, 1])}) is out of range for costs of "
                         f"shape {shape}: each (n_b, m_b) must satisfy 0 <= n_b <= {n_max}, 0 <= m_b <= {m_max}")
    return np.ascontiguousarray(arr, dtype=np.int64)
