"""The CPU backend of the Birkhoff-von Neumann decomposition: numpy into the compiled core."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pyperm._arrays import check_finite, check_square, is_cuda_input, is_torch_tensor, real_float_array
from pyperm._ext import core

__all__ = ["decompose", "defects", "host_matrix"]


def host_matrix(D: Any, name: str) -> np.ndarray:
    """A C-contiguous, finite, square float32/float64 numpy copy or view of ``D`` on the host.

    A torch CUDA tensor is copied to the host (for the decompositions only the CPU has);
    other device arrays are refused.
    """
    if is_torch_tensor(D) and D.device.type != "cpu":
        D = D.detach().cpu()
    elif is_cuda_input(D):
        raise TypeError(f"{name} is a device array; pass a numpy array or a torch tensor")
    arr = real_float_array(D, name, 2)
    check_square(arr.shape, name)
    check_finite(arr, name)
    return arr


def defects(arr: np.ndarray) -> tuple[float, tuple[int, int], np.ndarray, np.ndarray]:
    """(smallest entry, where it is, |row sums - 1|, |column sums - 1|) of a non-empty matrix.

    Sums in float64, so that checking adds no rounding of its own.
    """
    where = np.unravel_index(int(np.argmin(arr)), arr.shape)
    rows = np.abs(arr.sum(axis=1, dtype=np.float64) - 1.0)
    cols = np.abs(arr.sum(axis=0, dtype=np.float64) - 1.0)
    return float(arr[where]), (int(where[0]), int(where[1])), rows, cols


def decompose(
    arr: np.ndarray, method: str, max_terms: int | None, tol: float, callback: Callable[..., Any] | None
) -> tuple[np.ndarray, np.ndarray, float, str]:
    """(coeffs, perms, residual mass, stop reason): the compiled greedy loop, GIL released.

    ``callback(terms, coeff, residual_mass)`` is called after every term; the core stops
    when it raises StopIteration (the progress contract of :mod:`pyperm._progress`).
    """
    return core.bvn_decompose(arr, method, -1 if max_terms is None else max_terms, tol, callback)
