r"""The teacher, and uniform samples from the manifold of global minima of the student.

With teacher rows :math:`w^*_1, \dots, w^*_K` (pairwise non-parallel) and a student of
:math:`m \ge K` neurons, Lemma 2 of Zhan et al. (2025, from Lin et al. 2024) says the global minima
are exactly

.. math::

    \mathcal M = \Big\{ W : w_j = a_j\, w^*_{\tau(j)},\ a_j \ge 0,\
        \sum_{j : \tau(j) = k} a_j = 1 \text{ for every } k \Big\},

every neuron a non-negative multiple of one teacher neuron (its *type* :math:`\tau(j)`), the
multiples of each type summing to one, and every type present.

"Uniform" on :math:`\mathcal M` is the paper's Assumption 3, sampled as its Appendix B.1
describes: the type counts are :math:`N_k = 1 + n_k` with
:math:`(n_1, \dots, n_K) \sim \mathrm{Multinomial}(m - K; \tfrac1K, \dots, \tfrac1K)` (one
neuron of every type is guaranteed, the other :math:`m - K` pick a type uniformly), the
multiples within a type are uniform on the simplex :math:`\Delta_{N_k - 1}` (i.i.d.
:math:`\mathrm{Exp}(1)` draws normalised by their sum, i.e. Dirichlet(1, ..., 1), Lemma 8),
and the types are dealt to the neuron positions by a uniformly random permutation, so that
two samples are not aligned by construction. No neuron is zero (the paper's "no sparsity").
"""

from __future__ import annotations

import torch

from pyperm._checks import check_positive_int
from pyperm.teacher_student._checks import DTYPE, as_teacher, generator, seed_list

__all__ = ["sample_minimum", "teacher_weights"]


def teacher_weights(K: int, d: int | None = None, *, device: torch.device | str | None = None) -> torch.Tensor:
    r"""The teacher of Zhan et al.'s Assumption 1: :math:`w^*_k = e_k`, orthonormal rows.

    Parameters
    ----------
    K : int
        Number of teacher neurons, at least 1.
    d : int, optional
        Input dimension, at least ``K`` (default ``2 * K``).
    device : torch.device or str, optional
        Where the tensor lives (default: the CPU).

    Returns
    -------
    (K, d) torch.Tensor
        float64, the first ``K`` rows of the identity.

    References
    ----------
    Zhan, Li and Wu (2025), Assumption 1 (by rotational symmetry, any orthonormal teacher is equivalent).
    """
    K = check_positive_int(K, "K")
    d = 2 * K if d is None else check_positive_int(d, "d")
    if d < K:
        raise ValueError(f"d must be >= K for orthonormal teacher rows, got d={d}, K={K}")
    return torch.eye(K, d, dtype=DTYPE, device=device)


def _one_minimum(wt: torch.Tensor, m: int, gen: torch.Generator) -> torch.Tensor:
    K = wt.shape[0]
    # One neuron of every type, and m - K neurons of uniformly drawn types: the counts are then
    # 1 + Multinomial(m - K; 1/K, ..., 1/K) without forming them.
    types = torch.arange(K, device=wt.device)
    if m > K:
        uniform = torch.ones(K, dtype=DTYPE, device=wt.device)
        types = torch.cat([types, torch.multinomial(uniform, m - K, replacement=True, generator=gen)])
    types = types[torch.randperm(m, generator=gen, device=wt.device)]
    draws = torch.empty(m, dtype=DTYPE, device=wt.device).exponential_(generator=gen)
    type_sums = torch.zeros(K, dtype=DTYPE, device=wt.device).index_add_(0, types, draws)
    return (draws / type_sums[types])[:, None] * wt[types]


def sample_minimum(W_teacher: torch.Tensor, m: int, *, seed: int | list[int]) -> torch.Tensor:
    r"""A uniform sample from the manifold of global minima (Zhan et al. 2025, Assumption 3).

    .. math::

        w_j = a_j\, w^*_{\tau(j)}, \qquad
        N_k = 1 + n_k,\ n \sim \mathrm{Multinomial}\big(m - K; \tfrac1K, \dots, \tfrac1K\big), \qquad
        (a_j)_{\tau(j) = k} \sim \mathrm{Dirichlet}(1, \dots, 1) \in \Delta_{N_k - 1},

    with the types placed at uniformly random neuron positions (see the module docstring).
    The loss is zero at every sample, to rounding.

    Parameters
    ----------
    W_teacher : (K, d) torch.Tensor
        Teacher weights (any non-parallel rows; the sample lives on their device).
    m : int
        Student width, at least ``K`` (below ``K`` no student reaches zero loss).
    seed : int or sequence of int
        One seed per sample: an int gives one ``(m, d)`` sample, a sequence of ``R`` seeds a
        ``(R, m, d)`` batch whose ``r``-th sample equals ``sample_minimum(..., seed=seeds[r])``.

    Returns
    -------
    (m, d) or (R, m, d) torch.Tensor
        float64.

    References
    ----------
    Zhan, Li and Wu (2025), Lemma 2, Assumption 3, Lemma 8 and Appendix B.1.
    """
    wt = as_teacher(W_teacher).detach()
    m = check_positive_int(m, "m")
    if m < wt.shape[0]:
        raise ValueError(f"m must be >= K = {wt.shape[0]} for a global minimum to exist, got m={m}")
    seeds, batched = seed_list(seed)
    samples = [_one_minimum(wt, m, generator(s, wt.device)) for s in seeds]
    return torch.stack(samples) if batched else samples[0]
