"""Assignment on ``scipy.sparse`` input: only the stored entries are candidate pairs.

The matrix is never densified. Its CSR (or CSC) arrays go to the compiled sparse solver
(``csrc/lap/lap_sparse_cpu.h``), which copies the stored entries once into its own
layout; memory stays proportional to the stored entries plus the two dimensions.
scipy is never imported here: a sparse matrix in means scipy is already loaded.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from pyperm._arrays import check_ndim, check_real_dtype
from pyperm._ext import core

__all__ = ["is_scipy_sparse", "linear_sum_assignment_sparse"]

_MAX_SIDE = 2**31 - 1  # the core's indices are int32, and a side of 2**31 - 1 leaves no room for its end


def is_scipy_sparse(x: Any) -> bool:
    """Whether ``x`` is a ``scipy.sparse`` matrix or array (any format), without importing scipy."""
    sparse = sys.modules.get("scipy.sparse")
    return sparse is not None and bool(sparse.issparse(x))


def linear_sum_assignment_sparse(cost: Any, maximize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Minimum (or maximum) weight full matching over the stored entries of a sparse matrix.

    The semantics of :func:`scipy.sparse.csgraph.min_weight_full_bipartite_matching`, with
    one difference: an explicitly stored zero is an edge (scipy removes explicit zeros
    with a warning). See :func:`pyperm.linear_sum_assignment`, which dispatches here.

    Parameters
    ----------
    cost : (n, m) scipy.sparse matrix or array
        The candidate pairs and their costs: every stored entry, explicit zeros included,
        is an edge; an entry not stored is no edge. csr and csc are read in place; coo
        and the other formats are converted to csr (coo's duplicate entries are summed;
        dia cannot store an explicit zero, so its zeros are no edges). float32 data is
        solved in float32, other real dtypes in float64. ``+inf`` (``-inf`` when
        maximising) marks a forbidden pair, as no entry would.
    maximize : bool
        Maximise the total instead of minimising it.

    Returns
    -------
    row_ind, col_ind : (min(n, m),) int64 numpy arrays
        ``row_ind`` is increasing; every pair is a stored entry.

    Raises
    ------
    ValueError
        ``cost`` is not 2-D, its stored entries hold NaN or the wrong infinity, its sparse
        structure is broken, or no matching of ``min(n, m)`` pairs uses only stored
        entries ("no full matching exists").
    TypeError
        ``cost`` holds complex or non-numeric data.
    """
    check_ndim(cost.shape, 2, "cost")
    check_real_dtype(cost.dtype, "cost")
    if max(cost.shape) >= _MAX_SIDE:
        raise ValueError(f"cost has shape {cost.shape}: the sparse solver takes sides below 2**31 - 1 "
                         "(its row and column indices are 32-bit)")
    if cost.format == "csc":
        # A CSC matrix's arrays are the CSR arrays of its transpose: solve that and swap.
        cols, rows = _solve_csr(cost, cost.shape[1], cost.shape[0], maximize)
        order = np.argsort(rows, kind="stable")
        return rows[order], cols[order]
    if cost.format != "csr":
        cost = cost.tocsr()  # sums duplicate coo entries, keeping the zeros they may make
    return _solve_csr(cost, cost.shape[0], cost.shape[1], maximize)


def _solve_csr(compressed: Any, n_major: int, n_minor: int, maximize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Solves the CSR matrix held by ``compressed``'s arrays (n_major x n_minor)."""
    if not compressed.has_canonical_format:
        # Duplicate entries count once, summed, as scipy's conversions do; unsorted indices
        # alone would not matter to the solver.
        compressed = compressed.copy()
        compressed.sum_duplicates()
    data = compressed.data
    if data.dtype not in (np.float32, np.float64):
        data = data.astype(np.float64)
    _check_entries(data, maximize)
    indptr, indices = compressed.indptr, compressed.indices
    if indptr.dtype != indices.dtype or indptr.dtype not in (np.int32, np.int64):
        indptr, indices = indptr.astype(np.int64), indices.astype(np.int64)
    _check_structure(indptr, indices, data, n_major, n_minor)
    return core.lap_solve_sparse(
        np.ascontiguousarray(indptr),
        np.ascontiguousarray(indices),
        np.ascontiguousarray(data),
        n_major,
        n_minor,
        maximize,
    )


def _check_entries(data: np.ndarray, maximize: bool) -> None:
    """NaN and the infinity that does not mean "forbidden" are errors, as for dense costs."""
    if np.isnan(data).any():
        raise ValueError("cost contains invalid numeric entries: a stored entry is NaN")
    wrong = np.inf if maximize else -np.inf
    if (data == wrong).any():
        sense, forbid = ("maximizing", "-inf") if maximize else ("minimizing", "+inf")
        raise ValueError(
            f"cost contains invalid numeric entries: a stored entry is {wrong}, which has no meaning "
            f"when {sense} ({forbid} marks a forbidden pair)"
        )


def _check_structure(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, n_major: int, n_minor: int) -> None:
    """The index arrays scipy's constructors accept without a full check."""
    ok = (
        indptr.ndim == 1
        and indptr.shape[0] == n_major + 1
        and indices.shape == data.shape
        and int(indptr[0]) == 0
        and int(indptr[-1]) == indices.shape[0]
        and bool((np.diff(indptr) >= 0).all())
        and (indices.size == 0 or (int(indices.min()) >= 0 and int(indices.max()) < n_minor))
    )
    if not ok:
        raise ValueError(
            "cost has an invalid sparse structure (indptr not increasing from 0 to the number of "
            "stored entries, or indices out of range)"
        )
