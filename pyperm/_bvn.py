"""Doubly stochastic matrices: Birkhoff-von Neumann decomposition, sampling, projection, Sinkhorn.

The decomposition runs in the compiled core (``csrc/bvn``); the projection and Sinkhorn
scaling are a few vectorised array operations, written once for numpy and torch so that
torch tensors stay on their device (and keep autograd) and batches ``(..., n, n)`` work.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any, Callable, Union

import numpy as np

from pyperm import _core
from pyperm._arrays import is_cuda_array, is_torch_tensor, like, real_float_array, to_numpy

__all__ = ["birkhoff_decomposition", "project_doubly_stochastic", "sample_permutations", "sinkhorn"]

logger = logging.getLogger("pyperm")

_METHODS = ("max-weight", "bottleneck")

ProgressArg = Union[bool, Callable[[int, float, float], Any]]


# ----------------------------------------------------------------------------- argument checks
def _check_int(value: Any, name: str, minimum: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def _check_tol(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and non-negative, got {value}")
    return value


def _host_matrix(D: Any, name: str) -> np.ndarray:
    """A C-contiguous float32/float64 numpy copy or view of a square matrix on the host."""
    if is_torch_tensor(D) and D.device.type != "cpu":
        D = D.detach().cpu()  # the decomposition is sequential host work; results go back
    elif is_cuda_array(D):
        raise TypeError(f"{name} is a device array; pass a numpy array or a torch tensor")
    arr = real_float_array(D, name, 2)
    if arr.shape[0] != arr.shape[1]:
        raise ValueError(f"{name} must be square, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite entries")
    return arr


def _default_atol(dtype: np.dtype) -> float:
    return 1e-6 if dtype == np.float64 else 1e-4


def _check_doubly_stochastic(arr: np.ndarray, name: str, atol: float) -> None:
    """Raises ValueError saying how far ``arr`` is from doubly stochastic, if beyond ``atol``."""
    n = arr.shape[0]
    if n == 0:
        return
    smallest = float(arr.min())
    if smallest < -atol:
        i, j = np.unravel_index(int(np.argmin(arr)), arr.shape)
        raise ValueError(
            f"{name} must be non-negative: entry ({i}, {j}) is {smallest:.3g} (tolerance atol={atol:g})"
        )
    # Sums in float64, so that checking adds no rounding of its own.
    rows = np.abs(arr.sum(axis=1, dtype=np.float64) - 1.0)
    cols = np.abs(arr.sum(axis=0, dtype=np.float64) - 1.0)
    i, j = int(np.argmax(rows)), int(np.argmax(cols))
    if rows[i] > atol or cols[j] > atol:
        raise ValueError(
            f"{name} is not doubly stochastic: row sums are off from 1 by up to {rows[i]:.3g} (row {i}), "
            f"column sums by up to {cols[j]:.3g} (column {j}); tolerance atol={atol:g}. "
            "Normalise it first, e.g. with pyperm.sinkhorn"
        )


def _as_generator(generator: Any) -> np.random.Generator:
    if generator is None:
        return np.random.default_rng()
    if isinstance(generator, np.random.Generator):
        return generator
    if isinstance(generator, numbers.Integral) and not isinstance(generator, bool):
        if generator < 0:
            raise ValueError(f"generator seed must be non-negative, got {generator}")
        return np.random.default_rng(int(generator))
    raise TypeError(f"generator must be a numpy Generator, an int seed or None, got {type(generator).__name__}")


def _progress_hook(progress: ProgressArg, method: str, max_terms: int | None):
    """The callable handed to the core, and a function that closes any bar it opened."""
    if progress is False or progress is None:
        return None, lambda: None
    if callable(progress):
        return progress, lambda: None
    if progress is not True:
        raise TypeError(f"progress must be a bool or a callable, got {type(progress).__name__}")
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError("progress=True needs tqdm: pip install tqdm") from None
    bar = tqdm(total=max_terms, desc=f"Birkhoff ({method})", unit="term")

    def hook(terms: int, coeff: float, residual: float) -> None:
        bar.update(terms - bar.n)
        bar.set_postfix(residual=f"{residual:.2e}", refresh=False)

    return hook, bar.close


# ----------------------------------------------------------------------------- decomposition
def birkhoff_decomposition(
    D: Any,
    method: str = "max-weight",
    max_terms: int | None = None,
    tol: float = 1e-9,
    *,
    atol: float | None = None,
    progress: ProgressArg = False,
) -> tuple[Any, Any]:
    r"""Greedy Birkhoff-von Neumann decomposition of a doubly stochastic matrix.

    Writes ``D`` as a convex combination of permutation matrices,

    .. math::

        D \approx \sum_{t=1}^{k} \alpha_t P_t, \qquad \alpha_t > 0, \quad
        \sum_t \alpha_t \le 1, \quad (P_t)_{i, \pi_t(i)} = 1,

    one term at a time: take a perfect matching :math:`P_t` on the support of the residual
    :math:`R_t` (initially ``D``), let :math:`\alpha_t` be the smallest entry of
    :math:`R_t` on it, and set :math:`R_{t+1} = R_t - \alpha_t P_t`. Each term empties at
    least one entry, and every term starts from the previous one's solution (see Notes).

    Parameters
    ----------
    D : (n, n) array-like or torch.Tensor
        A doubly stochastic matrix: non-negative, every row and column summing to 1 within
        ``atol``. float32 and float64 are decomposed in their own precision, other real
        dtypes in float64. A CUDA tensor is decomposed on the host and the results are
        returned on its device.
    method : {"max-weight", "bottleneck"}, default "max-weight"
        Which matching each term takes. ``"max-weight"`` (Tatro et al., eq. 54): the
        matching of largest total weight :math:`\sum_i R_{i, \pi(i)}`, so the first term is
        the projection of ``D`` onto the permutations. ``"bottleneck"`` (eq. 55, the classic
        greedy Birkhoff heuristic): the matching whose smallest entry is largest, which makes
        each coefficient as large as possible and tends to give fewer terms.
    max_terms : int, optional
        Stop after this many terms (at least 1). By default the decomposition goes on until
        the residual mass falls to ``tol``.
    tol : float, default 1e-9
        Stop when the residual mass :math:`\sum_{ij} (R_t)_{ij} / n = 1 - \sum_t \alpha_t`
        is at most ``tol``. Then every entry of ``D - sum_t coeffs[t] P_t`` lies in
        ``[0, tol]`` up to rounding. With float32 input, values below about 1e-6 cannot be
        reached; the decomposition then stops when the residual's support, which is rounding
        noise by then, has no perfect matching left.
    atol : float, optional
        Tolerance of the doubly stochastic check on ``D`` (negative entries and row and
        column sums). Default: 1e-6 for float64, 1e-4 for float32. Entries in
        ``[-atol, 0]`` are treated as zero.
    progress : bool or callable, default False
        ``True`` shows a tqdm progress bar. A callable is called after every term as
        ``progress(terms, coeff, residual_mass)``; it may raise ``StopIteration`` to end the
        decomposition early (the terms so far are returned). Ctrl-C interrupts a long
        decomposition in any case.

    Returns
    -------
    coeffs : (k,) array of D's float dtype
        Positive coefficients, in the order the terms were found.
    perms : (k, n) int64 array
        ``perms[t, i]`` is the column of row ``i`` in term ``t``, so
        ``D[i, perms[t, i]]`` is on the matching. Torch tensors in give torch tensors out.

    Raises
    ------
    ValueError
        ``D`` is not square, contains NaN or infinity, has entries below ``-atol``, or has
        a row or column sum further than ``atol`` from 1 (the message says how far);
        ``method`` is unknown; ``max_terms`` is below 1; ``tol`` or ``atol`` is negative or
        not finite.
    TypeError
        ``D`` is not 2-D numerical data, ``max_terms``, ``tol``, ``atol`` or ``progress``
        has the wrong type.

    See Also
    --------
    sample_permutations : random permutations drawn from the decomposition.
    sinkhorn : makes a positive matrix doubly stochastic.

    Notes
    -----
    A stop before ``tol`` is reached also happens when the residual's support has no
    perfect matching, which for an exactly doubly stochastic ``D`` only happens at rounding
    level, and otherwise means ``D`` was doubly stochastic only within ``atol``.

    Consecutive terms are solved incrementally. Bottleneck: the bottleneck value never
    increases, so the previous term's matching, minus its edges that fell below the previous
    coefficient, is repaired by augmenting paths over each row's entries kept sorted in
    decreasing order, lowering the threshold only when a Hall violator proves it must.
    Max-weight: a Jonker-Volgenant solver keeps its matching and column duals, and
    re-augments only the rows whose matched entry is no longer optimal.

    References
    ----------
    .. [1] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment",
       NeurIPS 2020, appendix E.4.
    .. [2] F. Dufossé and B. Uçar, "Notes on Birkhoff-von Neumann decomposition of doubly
       stochastic matrices", Linear Algebra and its Applications 497, 2016.

    Examples
    --------
    >>> import numpy as np, pyperm
    >>> D = np.array([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5]])
    >>> coeffs, perms = pyperm.birkhoff_decomposition(D)
    >>> coeffs.tolist(), perms.tolist()
    ([0.5, 0.3, 0.2], [[0, 1, 2], [1, 2, 0], [2, 0, 1]])
    >>> recon = sum(c * np.eye(3)[p] for c, p in zip(coeffs, perms))
    >>> bool(np.allclose(recon, D))
    True
    """
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    max_terms = _check_int(max_terms, "max_terms", 1, allow_none=True)
    tol = _check_tol(tol, "tol")
    arr = _host_matrix(D, "D")
    atol = _default_atol(arr.dtype) if atol is None else _check_tol(atol, "atol")
    _check_doubly_stochastic(arr, "D", atol)
    hook, close = _progress_hook(progress, method, max_terms)
    try:
        coeffs, perms, residual, stop = _core.bvn_decompose(
            arr, method, -1 if max_terms is None else max_terms, tol, hook
        )
    finally:
        close()
    logger.debug(
        "birkhoff_decomposition(%s): %d terms, residual mass %.3g, stopped: %s",
        method, len(coeffs), residual, stop,
    )
    return like(D, coeffs, perms)


def sample_permutations(
    D: Any,
    num_samples: int,
    max_terms: int = 10,
    generator: np.random.Generator | int | None = None,
    *,
    method: str = "max-weight",
    atol: float | None = None,
) -> Any:
    """Random permutations near a doubly stochastic matrix (Tatro et al., appendix E.4).

    Decomposes ``D`` (:func:`birkhoff_decomposition`, max-weight by default), keeps the
    first ``max_terms`` terms, renormalises their coefficients to sum to 1 and draws
    ``num_samples`` terms i.i.d. with those probabilities.

    Parameters
    ----------
    D : (n, n) array-like or torch.Tensor
        A doubly stochastic matrix (see :func:`birkhoff_decomposition`).
    num_samples : int
        Number of permutations to draw (0 gives an empty result).
    max_terms : int, default 10
        Terms of the decomposition to sample from (the paper uses 10).
    generator : numpy.random.Generator, int or None
        Source of randomness: a Generator (advanced in place), a seed, or None for fresh
        OS entropy. The same seed gives the same samples.
    method : {"max-weight", "bottleneck"}, default "max-weight"
        Decomposition heuristic.
    atol : float, optional
        Tolerance of the doubly stochastic check, as in :func:`birkhoff_decomposition`.

    Returns
    -------
    perms : (num_samples, n) int64 array
        ``perms[s, i]`` is the column of row ``i`` in sample ``s``. Torch in gives torch
        out, on the input's device.

    Raises
    ------
    ValueError
        As :func:`birkhoff_decomposition`; ``num_samples`` negative; ``max_terms`` below 1;
        a negative seed.
    TypeError
        ``num_samples`` or ``max_terms`` is not an int; ``generator`` is of another type.

    Examples
    --------
    >>> import numpy as np, pyperm
    >>> D = np.full((4, 4), 0.25)
    >>> perms = pyperm.sample_permutations(D, 5, generator=0)
    >>> perms.shape, bool((np.sort(perms, axis=1) == np.arange(4)).all())
    ((5, 4), True)
    """
    num_samples = _check_int(num_samples, "num_samples", 0)
    max_terms = _check_int(max_terms, "max_terms", 1)
    rng = _as_generator(generator)
    coeffs, perms = birkhoff_decomposition(
        _host_matrix(D, "D"), method=method, max_terms=max_terms, atol=atol
    )
    n = perms.shape[1]
    if len(coeffs) == 0:  # n == 0: the only permutation is the empty one
        return like(D, np.zeros((num_samples, n), dtype=np.int64))
    p = np.asarray(coeffs, dtype=np.float64)
    p /= p.sum()
    picks = rng.choice(len(p), size=num_samples, p=p)
    return like(D, np.ascontiguousarray(perms[picks]))


# ----------------------------------------------------------------------------- projection, scaling
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

    def all_finite(self, x) -> bool:
        if self.torch:
            import torch

            return bool(torch.isfinite(x).all())
        return bool(np.isfinite(x).all())


def _square_batch(M: Any, name: str):
    """Validates a (..., n, n) real array; returns it as float32/float64 (torch stays torch)."""
    if is_torch_tensor(M):
        import torch

        if M.is_complex():
            raise ValueError(f"{name} must be real, got complex dtype {M.dtype}")
        if M.dtype not in (torch.float32, torch.float64):
            M = M.to(torch.float64)
        arr = M
    else:
        if is_cuda_array(M):
            raise TypeError(f"{name} is a device array; pass a numpy array or a torch tensor")
        arr = to_numpy(M, name)
        if arr.ndim < 2:
            raise ValueError(f"{name} must be a 2-D (n, n) or batched (..., n, n) array, got shape {arr.shape}")
        arr = real_float_array(arr, name, arr.ndim)
    if arr.ndim < 2:
        raise ValueError(f"{name} must be a 2-D (n, n) or batched (..., n, n) array, got shape {tuple(arr.shape)}")
    if arr.shape[-1] != arr.shape[-2]:
        raise ValueError(f"{name} must be square in its last two dimensions, got shape {tuple(arr.shape)}")
    if not _Ops(arr).all_finite(arr):
        raise ValueError(f"{name} contains NaN or infinite entries")
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
    the projected gradient descent in Tatro et al. (appendix E.2, 20 iterations). The
    result is non-negative; its row and column sums approach 1 as ``iters`` grows (von
    Neumann's alternating projections converge to a point of the intersection, not
    necessarily the nearest one). A doubly stochastic input is returned unchanged.

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
    iters = _check_int(iters, "iters", 0)
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
    iters = _check_int(iters, "iters", 1)
    M = _square_batch(M, "M")
    ops = _Ops(M)
    is64 = str(M.dtype).endswith("float64")
    tol = (1e-9 if is64 else 1e-5) if tol is None else _check_tol(tol, "tol")
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
