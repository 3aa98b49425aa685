"""ZipIt's greedy pairing of features (Stoica et al. 2024, sec. 4.3), on one group's correlation matrix.

The ``2n`` features of both models (A's ``n`` first, then B's) are merged into ``n`` by ``n``
merges, each of the most correlated pair still allowed. A merged feature is a cluster; its
correlation with every other feature is the smaller of its two members' (a cluster is only
as alike to a feature as its least alike member), times ``alpha``. Merges of two features
of one model (same-model merges) are limited by a budget per model, ``beta`` times ``n / 2``
(the features a model would give up if every merge were one of its own); once a model's
budget is spent its features are never merged with each other again.

The authors' loop removes the merged column from the matrix at every step and searches the
whole matrix for its maximum (cubic work in ``n``). Here the matrix keeps its size, merged
features are masked, and every row keeps its maximum: a step recomputes only the rows whose
maximum the step changed, so the loop costs ``O(n)`` vector work per merge.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ZipPairing", "zip_pairing"]


class ZipPairing:
    """The clusters one zip of a group made.

    Attributes
    ----------
    cluster : (2n,) int64 array
        The merged unit each feature belongs to (A's features first, then B's): merged unit
        ``c`` is the mean of the features with ``cluster == c``. Clusters are numbered in the
        order of their first feature.
    same_model_merges : (2,) int64 array
        Merges of two features of one model, per model.
    merged_similarity : float
        The mean, over the merges, of the similarity of the pair merged (as the loop saw it).
    """

    def __init__(self, cluster: np.ndarray, same_model_merges: np.ndarray, merged_similarity: float) -> None:
        self.cluster = cluster
        self.same_model_merges = same_model_merges
        self.merged_similarity = merged_similarity

    @property
    def n(self) -> int:
        return self.cluster.shape[0] // 2

    def unmerge(self) -> np.ndarray:
        """U, (2n, n): ``U[f, c] = 1`` when feature ``f`` is in cluster ``c`` (a feature is read back as its cluster)."""
        u = np.zeros((2 * self.n, self.n))
        u[np.arange(2 * self.n), self.cluster] = 1.0
        return u

    def merge(self) -> np.ndarray:
        """M, (n, 2n): every merged unit the mean of its cluster's features (``M = U^T`` with rows summing to 1)."""
        u = self.unmerge()
        return (u / u.sum(0, keepdims=True)).T

    def as_permutation(self) -> np.ndarray | None:
        """With every cluster one A feature and one B feature in A's order: the permutation of B's units
        (``perm[i]`` is the B unit merged with A's unit ``i``); otherwise None."""
        n = self.n
        a, b = self.cluster[:n], self.cluster[n:]
        if not np.array_equal(a, np.arange(n)) or np.unique(b).size != n:
            return None
        perm = np.empty(n, dtype=np.int64)
        perm[b] = np.arange(n)
        return perm


def zip_pairing(similarity: np.ndarray, *, alpha: float, beta: float) -> ZipPairing:
    """Greedily merge the ``2n`` features of two models into ``n`` (ZipIt!'s matching).

    Parameters
    ----------
    similarity : (2n, 2n) array
        The correlation of every feature with every other, A's ``n`` features first (symmetric;
        the diagonal is ignored). Must be finite.
    alpha : float in [0, 1]
        A cluster's similarity to others is scaled by ``alpha`` at every merge it takes part in,
        so that features are merged again only when much alike. ``0``: a cluster takes no
        feature of a model it already holds (so a pair of A and B is final).
    beta : float in [0, 1]
        Same-model merges allowed per model, as a fraction of ``n / 2`` (rounded down); ``0``
        forbids them, and with ``alpha = 0`` the zip is then a greedy permutation.

    Returns
    -------
    ZipPairing
    """
    s = np.array(similarity, dtype=np.float64, copy=True)
    if s.ndim != 2 or s.shape[0] != s.shape[1] or s.shape[0] % 2:
        raise ValueError(f"similarity must be a square matrix of even size, got shape {s.shape}")
    if not np.isfinite(s).all():
        raise ValueError("similarity must be finite")
    size = s.shape[0]
    n = size // 2
    model = np.repeat(np.array([0, 1]), n)
    cluster = np.arange(size)
    np.fill_diagonal(s, -np.inf)
    budget = np.full(2, int(beta * (n // 2) + 1e-9))
    same = np.zeros(2, dtype=np.int64)
    for m in (0, 1):
        if budget[m] <= 0:
            _forbid_same_model(s, model, m)
    best = s.max(1)
    where = s.argmax(1)
    total = 0.0
    for _ in range(n):
        i = int(best.argmax())
        j = int(where[i])
        value = best[i]
        if value == -np.inf:
            raise ValueError("no pair of features is left to merge (alpha = 0 and the budget spent?)")
        total += value
        if j < i:
            i, j = j, i
        cluster[cluster == j] = i
        merged = np.minimum(s[:, i], s[:, j])
        if alpha > 0:
            merged *= alpha
        else:  # the cluster takes no more features of the models it holds
            merged[(model == model[i]) | (model == model[j])] = -np.inf
        merged[[i, j]] = -np.inf
        s[:, i] = merged
        s[i, :] = merged
        s[:, j] = -np.inf
        s[j, :] = -np.inf
        stale = (where == i) | (where == j)  # rows whose best pair was with i or j
        stale[[i, j]] = True
        if model[i] == model[j]:
            m = int(model[i])
            same[m] += 1
            budget[m] -= 1
            if budget[m] <= 0:
                _forbid_same_model(s, model, m)
                stale |= model == m
        up = merged > best  # a scaled negative correlation can rise
        best[up], where[up] = merged[up], i
        rows = np.flatnonzero(stale)
        best[rows] = s[rows].max(1)
        where[rows] = s[rows].argmax(1)
    _, order = np.unique(cluster, return_inverse=True)  # clusters numbered by their first feature
    return ZipPairing(order.astype(np.int64), same, total / max(n, 1))


def _forbid_same_model(s: np.ndarray, model: np.ndarray, m: int) -> None:
    """No more merges of two features (or clusters) of model ``m``."""
    sel = np.flatnonzero(model == m)
    s[np.ix_(sel, sel)] = -np.inf
