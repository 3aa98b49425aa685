"""Doubly stochastic matrices: Birkhoff-von Neumann decomposition, sampling, projection, Sinkhorn.

The decomposition classifies its input once and dispatches: the max-weight decomposition of
a CUDA array runs on its device (:mod:`pyperm.bvn._cuda`), everything else in the compiled
CPU core (:mod:`pyperm.bvn._cpu`). Projection and Sinkhorn scaling live in
:mod:`pyperm.bvn.doubly_stochastic`.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import numpy as np

from pyperm._arrays import is_cuda_input, like
from pyperm._checks import check_choice, check_int, check_nonnegative_real, numpy_generator
from pyperm._progress import ProgressArg, progress_callback
from pyperm.bvn import _cpu
from pyperm.bvn.doubly_stochastic import project_doubly_stochastic, sinkhorn

__all__ = ["birkhoff_decomposition", "project_doubly_stochastic", "sample_permutations", "sinkhorn"]

logger = logging.getLogger("pyperm")

_METHODS = ("max-weight", "bottleneck")


def _cuda_backend() -> ModuleType:
    from pyperm.bvn import _cuda

    return _cuda


def _default_atol(dtype: Any) -> float:
    """1e-6 for float64, 1e-4 for float32 (numpy or torch dtypes, both have itemsize)."""
    return 1e-6 if dtype.itemsize == 8 else 1e-4


def _check_doubly_stochastic(defects: tuple[float, tuple[int, int], np.ndarray, np.ndarray], name: str,
                             atol: float) -> None:
    """Raises ValueError saying how far a matrix is from doubly stochastic, if beyond ``atol``.

    ``defects``: the smallest entry, where it is, and the row and column sums' distances
    from 1 (computed by the backend that holds the matrix).
    """
    smallest, (i, j), rows, cols = defects
    if smallest < -atol:
        raise ValueError(
            f"{name} must be non-negative: entry ({i}, {j}) is {smallest:.3g} (tolerance atol={atol:g})"
        )
    r, c = int(np.argmax(rows)), int(np.argmax(cols))
    if rows[r] > atol or cols[c] > atol:
        raise ValueError(
            f"{name} is not doubly stochastic: row sums are off from 1 by up to {rows[r]:.3g} (row {r}), "
            f"column sums by up to {cols[c]:.3g} (column {c}); tolerance atol={atol:g}. "
            "Normalise it first, e.g. with pyperm.sinkhorn"
        )


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
        dtypes in float64. A CUDA array is decomposed on its device by ``"max-weight"``
        (torch tensors out, on that device); ``"bottleneck"`` decomposes a CUDA tensor on
        the host and returns the results on its device.
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
        ``True`` shows a tqdm progress bar (without tqdm installed, a warning is logged). A callable is called after every term as
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
    method = check_choice(method, "method", _METHODS)
    max_terms = check_int(max_terms, "max_terms", 1, allow_none=True)
    tol = check_nonnegative_real(tol, "tol")
    if is_cuda_input(D) and method == "max-weight":
        backend = _cuda_backend()
        arr = backend.device_matrix(D, "D")
    else:  # bottleneck has no CUDA twin: a CUDA tensor asking for it is decomposed on the host
        backend, arr = _cpu, _cpu.host_matrix(D, "D")
    atol = _default_atol(arr.dtype) if atol is None else check_nonnegative_real(atol, "atol")
    if arr.shape[0] > 0:
        _check_doubly_stochastic(backend.defects(arr), "D", atol)
    hook, close = progress_callback(
        progress, total=max_terms, desc=f"Birkhoff ({method})", unit="term",
        postfix=lambda coeff, residual: {"residual": f"{residual:.2e}"},
    )
    try:
        coeffs, perms, residual, stop = backend.decompose(arr, method, max_terms, tol, hook)
    finally:
        close()
    logger.debug(
        "birkhoff_decomposition(%s): %d terms, residual mass %.3g, stopped: %s",
        method, len(coeffs), residual, stop,
    )
    return like(D, coeffs, perms) if backend is _cpu else (coeffs, perms)


def sample_permutations(
    D: Any,
    num_samples: int,
    max_terms: int = 10,
    generator: np.random.Generator | int | None = None,
    *,
    method: str = "max-weight",
    atol: float | None = None,
) -> Any:
    """Random permutations near a doubly stochastic matrix (Tatro et al., 2020, appendix E.4).

    The sampling of PAM in N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron
    Alignment" (NeurIPS 2020).

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
    num_samples = check_int(num_samples, "num_samples", 0)
    max_terms = check_int(max_terms, "max_terms", 1)
    method = check_choice(method, "method", _METHODS)  # before D may be copied to the host for it
    rng = numpy_generator(generator)
    on_device = is_cuda_input(D) and method == "max-weight"
    source = D if on_device else _cpu.host_matrix(D, "D")
    coeffs, perms = birkhoff_decomposition(source, method=method, max_terms=max_terms, atol=atol)
    n = perms.shape[1]
    if len(coeffs) == 0:  # n == 0: the only permutation is the empty one
        picks = np.zeros(num_samples, dtype=np.int64)
        perms = np.zeros((1, n), dtype=np.int64) if not on_device else perms.new_zeros((1, n))
    else:
        p = np.asarray(coeffs.cpu() if on_device else coeffs, dtype=np.float64)
        picks = rng.choice(len(p), size=num_samples, p=p / p.sum())
    if on_device:
        import torch

        return perms[torch.as_tensor(picks, device=perms.device)].contiguous()
    return like(D, np.ascontiguousarray(perms[picks]))
