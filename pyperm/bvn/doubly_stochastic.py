"""Doubly stochastic matrices by iteration: alternating projections and Sinkhorn scaling.

A few vectorised array operations, written once for numpy and torch, so that torch tensors
stay on their device (and keep autograd) and batches ``(..., n, n)`` work.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from pyperm._arrays import (
    check_finite,
    check_square,
    is_cuda_input,
    is_torch_tensor,
    real_float_array,
    real_float_tensor,
    to_numpy,
)
from pyperm._checks import check_int, check_nonnegative_real

__all__ = ["project_doubly_stochastic", "sinkhorn"]

logger = logging.getLogger("pyperm")


class _Ops:
    """The handful of array operations the iterations need, for numpy or torch."""

    def __init__(self, x: Any):
        self.torch = is_torch_tensor(x)

    def sum(self, x, axis):
        return x.sum(dim=axis, keepdim=True) if self.torch else x.sum(axis=axis, keepdims=True)

    def clamp_min0(self, x):
        return x.clamp_min(0) if self.torch else np.maximum(x, 0)

    def matvec(self, M, x):  # (..., n, n) @ (..., n) -> (..., n)
        return (M @ x.unsqueeze(-1)).squeeze(-1) if self.torch else np.matmul(M, x[..., None])[..., 0]

    def rmatvec(self, M, x):  # M^T x
        return self.matvec(M.transpose(-1, -2) if self.torch else np.swapaxes(M, -1, -2), x)

    def ones(self, like, shape):
        if self.torch:
            import torch

            return torch.ones(shape, dtype=like.dtype, device=like.device)
        return np.ones(shape, dtype=like.dtype)

    def max_abs(self, x) -> float:
        return float(x.abs().max()) if self.torch else float(np.abs(x).max())


def _square_batch(M: Any, name: str):
    """Validates a (..., n, n) real array; returns it as float32/float64 (torch stays torch)."""
    if is_torch_tensor(M):
        arr = real_float_tensor(M, name)
    elif is_cuda_input(M):
        raise TypeError(f"{name} is a device array; pass a numpy array or a torch tensor")
    else:
        arr = to_numpy(M, name)
        arr = real_float_array(arr, name, arr.ndim)
    if arr.ndim < 2:
        raise ValueError(f"{name} must be a 2-D (n, n) or batched (..., n, n) array, got shape {tuple(arr.shape)}")
    check_square(arr.shape, name)
    check_finite(arr, name)
    return arr


def project_doubly_stochastic(M: Any, iters: int = 20) -> Any:
    r"""Move a matrix towards the doubly stochastic matrices by alternating projections.

    The doubly stochastic matrices are the intersection of two convex sets: the affine set
    :math:`\{X : X \mathbf{1} = \mathbf{1},\ X^\top \mathbf{1} = \mathbf{1}\}` and the
    non-negative matrices. Each iteration projects (in the Frobenius norm) onto the first,

    .. math::

        X \leftarrow X - \tfrac{1}{n}(X\mathbf{1})\mathbf{1}^\top
            - \tfrac{1}{n}\mathbf{1}(X^\top\mathbf{1})^\top
            + \tfrac{\mathbf{1}^\top X \mathbf{1} + n}{n^2}\,\mathbf{1}\mathbf{1}^\top,

    then onto the second, :math:`X \leftarrow \max(X, 0)`. This is the projection step of
    the projected gradient descent of PAM in Tatro et al., "Optimizing Mode Connectivity
    via Neuron Alignment" (NeurIPS 2020), appendix E.2, with 20 iterations. The result is
    non-negative; its row and column sums approach 1 as ``iters`` grows (von Neumann's
    alternating projections converge to a point of the intersection, not necessarily the
    nearest one). A doubly stochastic input is returned unchanged.

    Parameters
    ----------
    M : (..., n, n) array-like or torch.Tensor
        Real matrix or batch of matrices. float32/float64 keep their dtype, other dtypes
        become float64. Torch tensors stay on their device and the operations are
        differentiable.
    iters : int, default 20
        Number of (affine, non-negative) projection pairs (0 returns a copy).

    Returns
    -------
    X : (..., n, n) array or torch.Tensor
        Non-negative, approximately doubly stochastic.

    Raises
    ------
    ValueError
        ``M`` is not (..., n, n), not real, or contains NaN or infinity; ``iters`` < 0.
    TypeError
        ``iters`` is not an int.

    Examples
    --------
    >>> import numpy as np, pyperm
    >>> X = pyperm.project_doubly_stochastic(np.array([[2.0, 0.0], [1.0, 1.0]]), iters=50)
    >>> np.round(X, 6).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    iters = check_int(iters, "iters", 0)
    X = _square_batch(M, "M")
    ops = _Ops(X)
    n = X.shape[-1]
    X = X.clone() if ops.torch else X.copy()
    if n == 0:
        return X
    for _ in range(iters):
        rows = ops.sum(X, -1)  # (..., n, 1)
        cols = ops.sum(X, -2)  # (..., 1, n)
        total = ops.sum(rows, -2)  # (..., 1, 1)
        X = ops.clamp_min0(X - (rows + cols) / n + (total + n) / (n * n))
    return X


def sinkhorn(M: Any, iters: int = 1000, tol: float | None = None) -> Any:
    r"""Scale a non-negative matrix to a doubly stochastic one (Sinkhorn-Knopp).

    Finds positive vectors :math:`r, c` with :math:`X = \mathrm{diag}(r)\, M\, \mathrm{diag}(c)`
    doubly stochastic by alternately normalising the rows and the columns, each iteration
    costing two matrix-vector products:
    :math:`r \leftarrow 1 / (M c)`, then :math:`c \leftarrow 1 / (M^\top r)`.

    Convergence criterion: after each row normalisation the rows of X sum to 1 (up to
    rounding), and the iteration stops as soon as every column sum is within ``tol`` of 1,
    i.e. :math:`\max_j |c_j (M^\top r)_j - 1| \le` ``tol``, or after ``iters`` iterations
    (then a warning is logged on the ``pyperm`` logger and the last iterate returned). A
    positive matrix always converges, linearly; a matrix with zeros converges when its
    pattern has total support (every positive entry lies on a perfect matching of positive
    entries) and may need many more iterations otherwise.

    Parameters
    ----------
    M : (..., n, n) array-like or torch.Tensor
        Non-negative matrix or batch, each row and each column with a positive entry.
        float32/float64 keep their dtype, other dtypes become float64. Torch tensors stay
        on their device and the operations are differentiable.
    iters : int, default 1000
        Maximum number of iterations (at least 1).
    tol : float, optional
        Largest column-sum deviation accepted. Default: 1e-9 for float64, 1e-5 for float32.

    Returns
    -------
    X : (..., n, n) array or torch.Tensor
        The scaled matrix, of M's dtype.

    Raises
    ------
    ValueError
        ``M`` is not (..., n, n), not real, contains NaN, infinity or negative entries, or
        has a row or column without a positive entry; ``iters`` < 1; ``tol`` negative.
    TypeError
        ``iters`` is not an int or ``tol`` not a real number.

    References
    ----------
    .. [1] R. Sinkhorn and P. Knopp, "Concerning nonnegative matrices and doubly
       stochastic matrices", Pacific J. Math. 21(2), 1967.

    Examples
    --------
    >>> import numpy as np, pyperm
    >>> X = pyperm.sinkhorn(np.array([[1.0, 2.0], [3.0, 4.0]]))
    >>> np.round(X.sum(axis=0), 9).tolist(), np.round(X.sum(axis=1), 9).tolist()
    ([1.0, 1.0], [1.0, 1.0])
    """
    iters = check_int(iters, "iters", 1)
    M = _square_batch(M, "M")
    ops = _Ops(M)
    is64 = str(M.dtype).endswith("float64")
    tol = (1e-9 if is64 else 1e-5) if tol is None else check_nonnegative_real(tol, "tol")
    n = M.shape[-1]
    if (M.numel() if ops.torch else M.size) == 0:
        return M.clone() if ops.torch else M.copy()
    if float(M.min()) < 0:
        raise ValueError(f"M must be non-negative, its smallest entry is {float(M.min()):.3g}")
    positive = M > 0
    empty_rows = ~(positive.any(-1))
    empty_cols = ~(positive.any(-2))
    if bool(empty_rows.any()) or bool(empty_cols.any()):
        which = "row" if bool(empty_rows.any()) else "column"
        raise ValueError(f"M has a {which} without a positive entry; it cannot be scaled to doubly stochastic")
    batch = tuple(M.shape[:-2])
    c = ops.ones(M, batch + (n,))
    converged = False
    for _ in range(iters):
        r = 1.0 / ops.matvec(M, c)
        mtr = ops.rmatvec(M, r)
        if ops.max_abs(c * mtr - 1.0) <= tol:
            converged = True
            break
        c = 1.0 / mtr
    if not converged:
        # c was just updated, so re-normalise the rows: the rows stay exact, as promised.
        r = 1.0 / ops.matvec(M, c)
        logger.warning(
            "sinkhorn: column sums still off by %.3g after %d iterations (tol %.3g)",
            ops.max_abs(c * ops.rmatvec(M, r) - 1.0), iters, tol,
        )
    return r[..., :, None] * M * c[..., None, :]
