"""The CUDA backend of the Birkhoff-von Neumann decomposition (max-weight: Tatro et al.,
"Optimizing Mode Connectivity via Neuron Alignment", 2020, eq. 54).

Each term is the perfect matching of largest total weight on the support of the residual
:math:`R`: a warm-started assignment solve on the device with cost :math:`-R` on the
support and :math:`+\\infty` elsewhere, its coefficient the smallest matched entry. Every
term synchronises the stream twice (the solver's status and the coefficient are read
back), which the stopping rule needs anyway.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from pyperm._arrays import check_finite, check_square, real_float_tensor
from pyperm._cuda_arrays import as_device_array, dtype_name, torch_launch
from pyperm._ext import cuda_module
from pyperm._progress import keep_going

__all__ = ["decompose", "defects", "device_matrix"]


def device_matrix(D: Any, name: str) -> Any:
    """``D`` as a finite, square float32/float64 torch CUDA tensor (other real dtypes become float64)."""
    src = as_device_array(D, name, 2)
    torch = sys.modules["torch"]
    t = src.owner if torch.is_tensor(src.owner) else torch.as_tensor(src.owner, device=f"cuda:{src.device}")
    t = real_float_tensor(t.detach(), name)
    check_square(t.shape, name)
    check_finite(t, name)
    return t


def defects(R: Any) -> tuple[float, tuple[int, int], np.ndarray, np.ndarray]:
    """As :func:`pyperm.bvn._cpu.defects`, computed on the device; the small results come back."""
    torch = sys.modules["torch"]
    flat = int(R.argmin())
    where = (flat // R.shape[1], flat % R.shape[1])
    rows = (R.sum(dim=1, dtype=torch.float64) - 1.0).abs().cpu().numpy()
    cols = (R.sum(dim=0, dtype=torch.float64) - 1.0).abs().cpu().numpy()
    return float(R[where]), where, rows, cols


def decompose(
    D: Any, method: str, max_terms: int | None, tol: float, callback: Callable[..., Any] | None
) -> tuple[Any, Any, float, str]:
    """(coeffs, perms, residual mass, stop reason) of a tensor from :func:`device_matrix`.

    ``method`` must be "max-weight", the only decomposition with a CUDA implementation.

    ``coeffs`` (k,) of D's dtype and ``perms`` (k, n) int64 are on D's device. D is not
    modified. ``callback(terms, coeff, residual_mass)`` is called after every term and stops
    the loop by raising StopIteration.
    """
    if method != "max-weight":
        raise ValueError(f"the CUDA decomposition is max-weight only, got method {method!r}")
    torch = sys.modules["torch"]
    n = D.shape[0]
    coeffs: list[float] = []
    perms: list[Any] = []
    mass, stop = float(n > 0), "converged"
    if n > 0:
        R = D.clamp_min(0).contiguous()  # a copy: D is never modified
        original = R.clone()  # the zeroing rule compares the residual with the entries it came from
        d_max = float(original.max())
        dtype = dtype_name(R)
        device, stream = torch_launch(R)
        v = torch.zeros(n, dtype=R.dtype, device=R.device)
        cost = torch.empty_like(R)
        mod = cuda_module()
        limit = n * n if max_terms is None else int(max_terms)  # each term empties at least one entry
        t = 0
        while True:  # the CPU's order: the mass is checked before a term, then the term budget
            if mass <= tol:
                stop = "converged"
                break
            if t >= limit:
                stop = "max_terms"
                break
            mod.bvn_support_cost(R.data_ptr(), dtype, n, cost.data_ptr(), device, stream)
            perm = torch.empty(n, dtype=torch.int64, device=R.device)
            try:
                mod.lap_solve_square_warm(cost.data_ptr(), dtype, 1, n, v.data_ptr(), perm.data_ptr(), device,
                                          stream, False)
            except ValueError as exc:
                if "infeasible" not in str(exc):
                    raise
                stop = "no_matching"  # the residual's support has no perfect matching: only rounding noise is left
                break
            alpha, mass = mod.bvn_subtract_term(R.data_ptr(), original.data_ptr(), d_max, dtype, n, perm.data_ptr(),
                                                device, stream)
            coeffs.append(alpha)
            perms.append(perm)
            t += 1
            if not keep_going(callback, t, alpha, mass):
                stop = "cancelled"
                break
    out_perms = torch.stack(perms) if perms else torch.empty((0, n), dtype=torch.int64, device=D.device)
    return torch.tensor(coeffs, dtype=D.dtype, device=D.device), out_perms, float(mass), stop
