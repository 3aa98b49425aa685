r"""Permutations that align student B's neurons to student A's: by type, or by assignment.

Both functions return ``perm`` with ``W_b[..., perm, :]`` the neurons of B matched to A (row
``i`` of the result is paired with A's neuron ``i``); permuting the hidden neurons of a
two-layer network whose output weights are all one leaves its function unchanged.

*Type matching* is our reading of Algorithm 1 of Zhan et al. (2025). A neuron's type is the teacher
neuron it points along (largest cosine); a zero neuron has no type. Within each type the
neurons of A and of B are sorted by norm, largest first, and paired rank by rank, so the
largest neurons of a type are matched and whatever is left over is small. Zero neurons of A
and B are paired the same way. The neurons left unmatched on both sides (a type with more
neurons in A than in B, and the reverse) are then paired in increasing index order. Between
two global minima with equal type counts every pair has one type, and the linear path stays
on the manifold of minima: the barrier is zero.

*LAP matching* ignores types: it maximises :math:`\sum_i w^A_i \cdot w^B_{\pi(i)}`, equivalently
minimises :math:`\sum_i \lVert w^A_i - w^B_{\pi(i)}\rVert^2` (Git Re-Basin's weight matching,
which for one hidden layer with fixed output weights is a single assignment problem), solved
exactly by pyperm's Jonker-Volgenant solver. It applies at any width, also below ``K``.
"""

from __future__ import annotations

import numpy as np
import torch

import pyperm
from pyperm.teacher_student._checks import as_teacher, as_weights, check_pair, check_same_shape

__all__ = ["lap_matching", "neuron_types", "type_matching"]


def neuron_types(W: torch.Tensor, W_teacher: torch.Tensor) -> torch.Tensor:
    r"""The type of each student neuron: the teacher neuron it is most aligned with.

    .. math::

        \tau(j) = \arg\max_k \frac{w_j^\top w^*_k}{\lVert w_j\rVert\, \lVert w^*_k\rVert},
        \qquad \tau(j) = -1 \text{ if } w_j = 0.

    Parameters
    ----------
    W : (..., m, d) torch.Tensor
        Student weights.
    W_teacher : (K, d) torch.Tensor
        Teacher weights.

    Returns
    -------
    (..., m) torch.Tensor
        int64 in ``{-1, 0, ..., K - 1}``, on ``W``'s device.

    References
    ----------
    Zhan, Li and Wu (2025), Section 3 ("the neuron is said to belong to Type k").
    """
    W = as_weights(W, "W").detach()
    wt = as_teacher(W_teacher).detach()
    check_pair(W, "W", wt)
    return _types(W, wt)


def _types(W: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    teacher_dirs = wt / torch.linalg.vector_norm(wt, dim=-1, keepdim=True)
    # The student's norm is positive and common to a row, so it does not change the argmax.
    types = (W @ teacher_dirs.T).argmax(dim=-1)
    return torch.where(torch.linalg.vector_norm(W, dim=-1) > 0, types, -1)


def _match_by_type(types_a: np.ndarray, norms_a: np.ndarray, types_b: np.ndarray, norms_b: np.ndarray) -> np.ndarray:
    """Algorithm 1 for one pair of students (numpy; ``types`` use -1 for zero neurons)."""
    m = len(types_a)
    perm = np.full(m, -1, dtype=np.int64)
    # Sort by type, then by norm, largest first (lexsort's last key is the primary one).
    order_a = np.lexsort((-norms_a, types_a))
    order_b = np.lexsort((-norms_b, types_b))
    for k in np.union1d(types_a, types_b):
        rows_a = order_a[types_a[order_a] == k]
        rows_b = order_b[types_b[order_b] == k]
        n = min(len(rows_a), len(rows_b))
        perm[rows_a[:n]] = rows_b[:n]
    left_a = np.flatnonzero(perm < 0)
    used = np.zeros(m, dtype=bool)
    used[perm[perm >= 0]] = True
    perm[left_a] = np.flatnonzero(~used)
    return perm


def type_matching(W_a: torch.Tensor, W_b: torch.Tensor, W_teacher: torch.Tensor) -> torch.Tensor:
    r"""Zhan et al.'s Algorithm 1: match B's neurons to A's type by type, largest first.

    Neurons get the type of the teacher neuron they point along (:func:`neuron_types`).
    For each type :math:`k`, A's and B's neurons of type :math:`k` are sorted by norm in
    decreasing order and the :math:`\min(N^A_k, N^B_k)` largest of each are paired rank by
    rank; the rest, left over on both sides, are paired in increasing index order (see the
    module docstring for what the paper leaves open and how it is read here).

    Parameters
    ----------
    W_a, W_b : (..., m, d) torch.Tensor
        Two students of one width (a batch of pairs in the leading dimensions).
    W_teacher : (K, d) torch.Tensor
        Teacher weights, defining the types.

    Returns
    -------
    (..., m) torch.Tensor
        int64 permutation(s) on the inputs' device; ``W_b[..., perm, :]`` is B matched to A
        (use :func:`torch.gather` for a batch).

    Raises
    ------
    TypeError, ValueError
        Not tensors, shapes or devices differ, non-finite entries, bad teacher.

    References
    ----------
    Zhan, Li and Wu (2025), Algorithm 1 and Section 4.
    """
    A = as_weights(W_a, "W_a").detach()
    B = as_weights(W_b, "W_b").detach()
    check_same_shape(A, B, "W_a", "W_b")
    wt = as_teacher(W_teacher).detach()
    check_pair(A, "W_a", wt)
    m = A.shape[-2]
    # The bookkeeping is a few sorts of at most m entries per pair: numpy on the host.
    fields = [_types(A, wt), torch.linalg.vector_norm(A, dim=-1), _types(B, wt), torch.linalg.vector_norm(B, dim=-1)]
    ta, na, tb, nb = (f.reshape(-1, m).cpu().numpy() for f in fields)
    perms = np.stack([_match_by_type(ta[i], na[i], tb[i], nb[i]) for i in range(len(ta))])
    return torch.from_numpy(perms.reshape(*A.shape[:-1])).to(A.device)


def lap_matching(W_a: torch.Tensor, W_b: torch.Tensor) -> torch.Tensor:
    r"""Match B's neurons to A's by an exact linear assignment on their weights.

    .. math::

        \pi = \arg\max_{\pi \in S_m} \sum_{i=1}^m w^A_i \cdot w^B_{\pi(i)}
            = \arg\min_{\pi \in S_m} \sum_{i=1}^m \lVert w^A_i - w^B_{\pi(i)}\rVert^2,

    solved by :func:`pyperm.batch_linear_sum_assignment` (on the GPU when the inputs are CUDA
    tensors and pyperm's CUDA core is available, else on the host).

    Parameters
    ----------
    W_a, W_b : (..., m, d) torch.Tensor
        Two students of one width (a batch of pairs in the leading dimensions); any width,
        including ``m < K``.

    Returns
    -------
    (..., m) torch.Tensor
        int64 permutation(s) on the inputs' device; ``W_b[..., perm, :]`` is B matched to A.

    References
    ----------
    Ainsworth, Hayase and Srinivasa, "Git Re-Basin", ICLR 2023, Section 3.2 (weight matching).
    """
    A = as_weights(W_a, "W_a").detach()
    B = as_weights(W_b, "W_b").detach()
    check_same_shape(A, B, "W_a", "W_b")
    m = A.shape[-2]
    similarity = (A @ B.mT).reshape(-1, m, m)
    if similarity.device.type == "cuda" and not pyperm.cuda_available():
        similarity = similarity.cpu()
    _, cols = pyperm.batch_linear_sum_assignment(similarity.contiguous(), maximize=True)
    return torch.as_tensor(cols).to(device=A.device, dtype=torch.int64).reshape(*A.shape[:-1])
