r"""The blockwise doubly stochastic relaxation of PAM's permutation subproblem.

Tatro et al. (appendix E.2, E.4) relax each group's permutation matrix :math:`P_g` to a
doubly stochastic matrix :math:`D_g` (the Birkhoff polytope is the convex hull of the
permutation matrices), minimise the relaxed subproblem by projected stochastic gradient
descent, and map the result back to permutations. This module holds the pieces that do
not run the network:

- :func:`one_hot`: a permutation as its matrix, :math:`(P_g)_{i, p(i)} = 1`, so that
  :math:`P_g x` is ``x[p]``, the convention of :func:`~pyperm.nn.apply_permutation`;
- :func:`apply_relaxed`: a state dict with every group's matrix multiplied into every axis
  the group acts on, the relaxed :math:`D\theta_B` (differentiable in :math:`D`);
- :func:`projected_step`: one step of projected SGD with the proximal term,

  .. math::

      D_g \leftarrow \Pi_{\mathcal{DS}}\Big(D_g - \eta\,\big(\nabla_{D_g} \ell
          + \tfrac{1}{\nu_P}(D_g - P^k_g)\big)\Big),

  where :math:`\Pi_{\mathcal{DS}}` is 20 rounds of alternating projections onto the
  matrices with unit row and column sums and onto the non-negative matrices
  (:func:`pyperm.project_doubly_stochastic`), optionally continued until the row and
  column sums are within a tolerance (:func:`project`);
- :func:`nearest_permutations` and :func:`sample_candidates`: the candidates of eq. 51,
  the assignment projection :math:`P_\Pi(D^*) = \arg\max_P \operatorname{tr}(P^\top D^*)`
  (eq. 52, :func:`pyperm.linear_sum_assignment`) and samples from the truncated max-weight
  Birkhoff-von Neumann decomposition of every block (eq. 53-54,
  :func:`pyperm.sample_permutations`).

References
----------
.. [1] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment", NeurIPS
   2020, appendix E.2 and E.4.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

import pyperm
from pyperm.nn.spec import PermutationSpec

__all__ = [
    "apply_relaxed",
    "defect",
    "nearest_permutations",
    "one_hot",
    "project",
    "project_blocks",
    "projected_step",
    "sample_candidates",
]


def one_hot(perms: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float64,
            device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    r"""The permutation matrices :math:`(P_g)_{i, p_g(i)} = 1` of one permutation per group."""
    out = {}
    for g, p in perms.items():
        n = p.numel()
        m = torch.zeros(n, n, dtype=dtype, device=device)
        m[torch.arange(n, device=device), p.to(device)] = 1.0
        out[g] = m
    return out


def _multiply_axis(matrix: torch.Tensor, tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """``matrix`` applied along ``axis``: ``out[..., i, ...] = sum_j matrix[i, j] tensor[..., j, ...]``."""
    moved = tensor.movedim(axis, 0)
    out = (matrix @ moved.reshape(moved.shape[0], -1)).reshape(moved.shape)
    return out.movedim(0, axis)


def apply_relaxed(spec: PermutationSpec, matrices: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                  keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    r"""The relaxed :math:`D\theta`: each group's matrix multiplied into every axis it acts on.

    With permutation matrices this is :func:`~pyperm.nn.apply_permutation` (up to
    rounding); with doubly stochastic ones every unit of the result is a convex
    combination of units of ``state``. Differentiable in ``matrices`` (cast to each
    tensor's dtype and device). Only ``keys`` (default: every key of the spec) are
    computed; entries that no group acts on are returned as they are (not copied).
    """
    out = {}
    for key in spec.axes if keys is None else keys:
        t = state[key]
        for axis, g in enumerate(spec.axes[key]):
            if g is not None:
                t = _multiply_axis(matrices[g].to(dtype=t.dtype, device=t.device), t, axis)
        out[key] = t
    return out


def defect(matrix: torch.Tensor) -> float:
    """How far a matrix (or a batch ``(..., n, n)``) is from doubly stochastic: its most
    negative entry's magnitude or the largest distance of a row or column sum from 1."""
    rows = (matrix.sum(dim=-1) - 1).abs().max()
    cols = (matrix.sum(dim=-2) - 1).abs().max()
    negative = (-matrix).clamp_min(0).max()
    return float(torch.stack([rows, cols, negative]).max())


# Rounds of ``iters`` projections before giving up on ``tol`` (1000 projections at the
# paper's 20: from a gradient step away, the defect falls ~10x per 50 projections).
_MAX_ROUNDS = 50


@torch.no_grad()
def project(matrix: torch.Tensor, iters: int = 20, tol: float | None = 1e-6) -> torch.Tensor:
    r"""Alternating projections of a ``(..., n, n)`` batch onto the doubly stochastic matrices.

    :func:`pyperm.project_doubly_stochastic` with ``iters`` projection pairs (the paper's
    20), then, when ``tol`` is set, more rounds of ``iters`` until :func:`defect` is at
    most ``tol`` (at most 50 rounds). Twenty pairs alone leave the row and column sums of
    a matrix one gradient step away off by up to a few percent; the rounds make the
    result doubly stochastic, which the Birkhoff-von Neumann step needs.
    """
    out = pyperm.project_doubly_stochastic(matrix, iters=iters)
    if tol is not None:
        for _ in range(_MAX_ROUNDS - 1):
            if defect(out) <= tol:
                break
            out = pyperm.project_doubly_stochastic(out, iters=iters)
    return out


@torch.no_grad()
def projected_step(matrices: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
                   anchor: Mapping[str, torch.Tensor], lr: float, nu: float, iters: int = 20,
                   tol: float | None = 1e-6) -> dict[str, torch.Tensor]:
    r"""One projected SGD step on every block, with the proximal term of eq. 34.

    .. math::

        D_g \leftarrow \Pi_{\mathcal{DS}}\big(D_g - \eta\,(G_g + (D_g - A_g) / \nu)\big)

    where :math:`G_g` is the stochastic gradient of the curve's loss, :math:`A_g` the
    previous permutation :math:`P^k_g` as a matrix, and :math:`\Pi_{\mathcal{DS}}` is
    :func:`project` (``iters`` alternating projections, repeated until within ``tol``).
    Returns new matrices.
    """
    stepped = {g: d - lr * (grads[g].to(d.dtype) + (d - anchor[g]) / nu) for g, d in matrices.items()}
    return project_blocks(stepped, iters, tol)


@torch.no_grad()
def project_blocks(matrices: Mapping[str, torch.Tensor], iters: int = 20,
                   tol: float | None = 1e-6) -> dict[str, torch.Tensor]:
    """:func:`project` of every block; blocks of one size are projected as one batch (the
    iterations are a few tensor operations each, whose fixed cost dominates for the small
    blocks of most networks)."""
    by_size: dict[int, list[str]] = {}
    for g, d in matrices.items():
        by_size.setdefault(d.shape[-1], []).append(g)
    out = {}
    for names in by_size.values():
        projected = project(torch.stack([matrices[g] for g in names]), iters, tol)
        out.update(zip(names, projected.unbind(0)))
    return out


def nearest_permutations(matrices: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""The projection onto the permutations, :math:`\arg\max_P \operatorname{tr}(P^\top D_g)` (eq. 52), per block."""
    out = {}
    for g, d in matrices.items():
        _, cols = pyperm.linear_sum_assignment(d.detach().cpu().numpy(), maximize=True)
        out[g] = torch.from_numpy(np.ascontiguousarray(cols, dtype=np.int64))
    return out


def sample_candidates(matrices: Mapping[str, torch.Tensor], num_samples: int, max_terms: int,
                      rng: np.random.Generator) -> list[dict[str, torch.Tensor]]:
    r"""``num_samples`` block permutations :math:`R \sim \Omega` (Tatro et al. E.4).

    Every block is decomposed by the greedy max-weight Birkhoff-von Neumann heuristic
    (eq. 54), truncated to ``max_terms`` terms whose renormalised coefficients are the
    distribution :math:`\Omega_g`; the blocks are drawn independently. The matrices come
    from a finite number of alternating projections, so they are doubly stochastic only
    up to a small defect; the decomposition's tolerance is set just above it (the
    truncated decomposition does not need more).
    """
    per_group = {}
    for g, d in matrices.items():
        arr = d.detach().cpu().to(torch.float64).numpy()
        atol = max(1e-6, 2.0 * defect(torch.from_numpy(arr)))
        per_group[g] = pyperm.sample_permutations(arr, num_samples, max_terms=max_terms, generator=rng, atol=atol)
    return [{g: torch.from_numpy(np.ascontiguousarray(s[i], dtype=np.int64)) for g, s in per_group.items()}
            for i in range(num_samples)]
