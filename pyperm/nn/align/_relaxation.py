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

      D_g \leftarrow \Pi_{\mathcal{DS}}\Big(\frac{D_g - \eta_g \nabla_{D_g} \ell
          + (\eta_g / \nu_P)\, P^k_g}{1 + \eta_g / \nu_P}\Big),

  the gradient step on the loss and the exact (implicit) step on the proximal term
  :math:`\|D_g - P^k_g\|_F^2 / (2\nu_P)`, which is stable for any ratio
  :math:`\eta_g / \nu_P`, where :math:`\Pi_{\mathcal{DS}}` is 20 rounds of alternating
  projections onto the matrices with unit row and column sums and onto the non-negative
  matrices (:func:`pyperm.project_doubly_stochastic`), optionally continued until the
  row and column sums are within a tolerance (:func:`project`);
- :class:`StepSizes`: the step :math:`\eta_g` of every group, given, or scaled to the
  gradient (``lr_perm="auto"``), and halved for a group whose step diverged;
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

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import pyperm
from pyperm.nn.spec import Blocks, Interleaved, PermutationSpec, Tiled, entry_groups

__all__ = [
    "StepSizes",
    "apply_relaxed",
    "defect",
    "nearest_permutations",
    "one_hot",
    "project",
    "project_blocks",
    "projected_step",
    "sample_candidates",
]


def one_hot(spec: PermutationSpec, perms: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float64,
            device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    r"""The permutation matrices :math:`(P_g)_{i, p_g(i)} = 1` of one permutation per group.

    A :class:`~pyperm.nn.spec.Blocks` inner group, which permutes units within each block,
    gets one matrix per block, a ``(num_blocks, block_size, block_size)`` batch indexed by
    the units' positions within their block; every other group one ``(n, n)`` matrix.
    """
    out = {}
    for g, p in perms.items():
        local = _local(spec, g, p.to(device))
        rows, n = local.shape
        m = torch.zeros(rows, n, n, dtype=dtype, device=device)
        m.scatter_(2, local.unsqueeze(2), 1.0)
        out[g] = m if g in spec.blocks else m[0]
    return out


def _local(spec: PermutationSpec, group: str, perm: torch.Tensor) -> torch.Tensor:
    """``perm`` as ``(blocks, block_size)`` positions within each block (one block for a plain group)."""
    if group not in spec.blocks:
        return perm.view(1, -1)
    size = spec.block_size(group)
    blocks = perm.view(-1, size)
    return blocks - torch.arange(blocks.shape[0], device=perm.device).view(-1, 1) * size


def _global(spec: PermutationSpec, group: str, local: np.ndarray) -> torch.Tensor:
    """The inverse of :func:`_local`: one permutation of the group's units (int64)."""
    local = np.asarray(local, dtype=np.int64)
    if group in spec.blocks:
        local = local + np.arange(local.shape[0], dtype=np.int64)[:, None] * local.shape[1]
    return torch.from_numpy(np.ascontiguousarray(local.reshape(-1)))


def _multiply_axis(matrix: torch.Tensor, tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """``matrix`` applied along ``axis``: ``out[..., i, ...] = sum_j matrix[i, j] tensor[..., j, ...]``."""
    if axis == tensor.dim() - 1 and tensor.dim() > 1:  # the last axis: one product, no copies of the tensor
        return tensor @ matrix.T
    moved = tensor.movedim(axis, 0)
    out = (matrix @ moved.reshape(moved.shape[0], -1)).reshape(moved.shape)
    return out.movedim(0, axis)


def _relax_axis(spec: PermutationSpec, entry: Any, matrices: Mapping[str, torch.Tensor],
                tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s axis 0 (laid out as ``entry``) with every group's matrix multiplied in: on a plain
    axis the group's matrix; on a Tiled axis the group's within every copy and the outer group's
    across copies; on a Blocks axis each block's matrix within its block and the outer group's across
    blocks; on a Segments axis each part's on its slice; on an Interleaved axis each part's on its
    strided slice."""
    if entry is None or isinstance(entry, int):
        return tensor
    if isinstance(entry, str):
        return _multiply_axis(matrices[entry], tensor, 0)
    rest = tensor.shape[1:]
    if isinstance(entry, Tiled):
        tiles = tensor.reshape(-1, spec.entry_length(entry.group), entry.inner, *rest)
        if isinstance(entry.group, str):
            out = _multiply_axis(matrices[entry.group], tiles, 1)
        else:  # a tiled unit: its own matrices along the unit's axis, alike in every copy
            out = _relax_axis(spec, entry.group, matrices, tiles.movedim(1, 0)).movedim(0, 1)
        if isinstance(entry.outer, str):
            out = _multiply_axis(matrices[entry.outer], out, 0)
        return out.reshape(tensor.shape)
    if isinstance(entry, Blocks):
        d = matrices[entry.inner]  # (blocks, size, size)
        blocks = tensor.reshape(d.shape[0], d.shape[1], -1)
        out = torch.bmm(d, blocks)
        if isinstance(entry.outer, str):
            out = _multiply_axis(matrices[entry.outer], out, 0)
        return out.reshape(tensor.shape)
    if isinstance(entry, Interleaved):
        k, out = len(entry.parts), torch.empty_like(tensor)
        for j, part in enumerate(entry.parts):  # part j's entries sit at j, j + k, ...
            out[j::k] = _relax_axis(spec, part, matrices, tensor[j::k])
        return out
    pieces = tensor.split([spec.entry_length(part) for part in entry.parts])
    return torch.cat([_relax_axis(spec, part, matrices, piece) for part, piece in zip(entry.parts, pieces)])


def apply_relaxed(spec: PermutationSpec, matrices: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                  keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    r"""The relaxed :math:`D\theta`: each group's matrix multiplied into every axis it acts on.

    With permutation matrices (:func:`one_hot`) this is :func:`~pyperm.nn.apply_permutation`
    (up to rounding), in every form of the spec (segments, tiles, blocks and the units
    within them); with doubly stochastic ones every unit of the result is a convex
    combination of units of ``state``. Differentiable in ``matrices`` (cast to each
    tensor's dtype and device). Only ``keys`` (default: every key of the spec) are
    computed; entries that no group acts on are returned as they are (not copied).
    """
    out = {}
    for key in spec.axes if keys is None else keys:
        t = state[key]
        for axis, entry in enumerate(spec.axes[key]):
            if entry is not None:
                cast = {g: matrices[g].to(dtype=t.dtype, device=t.device) for g in entry_groups(entry)}
                t = _relax_axis(spec, entry, cast, t.movedim(axis, 0)).movedim(0, axis)
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
                   anchor: Mapping[str, torch.Tensor], lr: float | Mapping[str, float], nu: float,
                   iters: int = 20, tol: float | None = 1e-6) -> dict[str, torch.Tensor]:
    r"""One projected SGD step on every block, with the proximal term of eq. 34.

    .. math::

        D_g \leftarrow \Pi_{\mathcal{DS}}\Big(\frac{D_g - \eta_g G_g + (\eta_g / \nu) A_g}{1 + \eta_g / \nu}\Big)

    where :math:`G_g` is the stochastic gradient of the curve's loss, :math:`A_g` the
    previous permutation :math:`P^k_g` as a matrix, :math:`\eta_g` the block's step
    (``lr``: one for all, or one per group) and :math:`\Pi_{\mathcal{DS}}` is
    :func:`project` (``iters`` alternating projections, repeated until within ``tol``).
    The proximal term :math:`\|D_g - A_g\|_F^2 / (2\nu)` is stepped exactly (the
    minimiser of the linearised loss plus both quadratics): an explicit gradient step on
    it overshoots :math:`A_g` once :math:`\eta_g / \nu \ge 1`, which a step scaled to a
    small gradient reaches. Returns new matrices; a block whose step is not finite (a
    non-finite gradient, an overflow) is returned unprojected, for the caller to undo.
    """
    stepped = {}
    for g, d in matrices.items():
        rate = lr if isinstance(lr, (int, float)) else lr[g]
        pull = rate / nu
        stepped[g] = (d - rate * grads[g].to(d.dtype) + pull * anchor[g]) / (1.0 + pull)
    broken = {g: m for g, m in stepped.items() if not bool(torch.isfinite(m).all())}
    projected = project_blocks({g: m for g, m in stepped.items() if g not in broken}, iters, tol)
    return {g: broken[g] if g in broken else projected[g] for g in stepped}


class StepSizes:
    r"""The step :math:`\eta_g` of each group's relaxed matrix in projected SGD.

    With a given ``lr``, every group steps by it. With ``lr=None`` (``lr_perm="auto"``),
    :math:`\eta_g = \text{scale} \cdot \sqrt{n_g} / \sqrt{\hat v_g}`, where
    :math:`\hat v_g` is a running mean (decay ``decay``, bias-corrected as in Adam) of
    :math:`\|G_g\|_F^2`: a step then moves each unit's row of :math:`D_g` by about
    ``scale`` (in L2 norm), whatever the size of the weights the gradient scales with.
    (Moving a fraction :math:`f` of the units to other vertices is a distance
    :math:`\sqrt{2 f n_g}`, so steps of :math:`\sqrt{n_g}` per block move a similar
    fraction of every group.) A running mean, not each step's own norm, keeps the
    relative weight of the steps: a point :math:`t` near 0 gives a small gradient, and
    its step stays small.

    :meth:`back_off` halves a group's step for the rest of the permutation step (its
    iterate diverged); ``backoffs`` counts them.
    """

    def __init__(self, sizes: Mapping[str, int], lr: float | None, scale: float, decay: float = 0.9) -> None:
        self.sizes, self.lr, self.scale, self.decay = dict(sizes), lr, scale, decay
        self.factor = dict.fromkeys(self.sizes, 1.0)
        self.second = dict.fromkeys(self.sizes, 0.0)
        self.count = 0
        self.backoffs = 0
        self.last: dict[str, float] = {}

    def __call__(self, grads: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Every group's step for these gradients (and records them in ``last``)."""
        self.count += 1
        out = {}
        for g, grad in grads.items():
            if self.lr is not None:
                rate = self.lr
            else:
                square = float(grad.double().square().sum())
                if math.isfinite(square):  # a step on a non-finite gradient is undone by the caller
                    self.second[g] = self.decay * self.second[g] + (1.0 - self.decay) * square
                mean = self.second[g] / (1.0 - self.decay**self.count)
                # A group whose gradient has been exactly zero throughout does not step.
                rate = self.scale * math.sqrt(self.sizes[g] / mean) if mean > 0.0 else 0.0
            out[g] = rate * self.factor[g]
        self.last = out
        return out

    def back_off(self, group: str) -> None:
        """Halve ``group``'s step from now on."""
        self.factor[group] *= 0.5
        self.backoffs += 1


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
        # A Blocks inner group's matrices are a batch of their own: flattened into the stack and back.
        stacked = torch.cat([matrices[g].reshape(-1, *matrices[g].shape[-2:]) for g in names])
        pieces = project(stacked, iters, tol).split([matrices[g].reshape(-1, *matrices[g].shape[-2:]).shape[0]
                                                     for g in names])  # fmt: skip
        out.update((g, piece.reshape(matrices[g].shape)) for g, piece in zip(names, pieces))
    return out


def nearest_permutations(spec: PermutationSpec, matrices: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""The projection onto the permutations, :math:`\arg\max_P \operatorname{tr}(P^\top D_g)` (eq. 52), per block
    (a Blocks inner group: each block of it)."""
    out = {}
    for g, d in matrices.items():
        batch = np.ascontiguousarray(d.detach().cpu().numpy().reshape(-1, *d.shape[-2:]))
        _, local = pyperm.batch_linear_sum_assignment(batch, maximize=True)  # every block in one call
        out[g] = _global(spec, g, local)
    return out


def sample_candidates(spec: PermutationSpec, matrices: Mapping[str, torch.Tensor], num_samples: int, max_terms: int,
                      rng: np.random.Generator) -> list[dict[str, torch.Tensor]]:
    r"""``num_samples`` block permutations :math:`R \sim \Omega` (Tatro et al. E.4).

    Every block is decomposed by the greedy max-weight Birkhoff-von Neumann heuristic
    (eq. 54), truncated to ``max_terms`` terms whose renormalised coefficients are the
    distribution :math:`\Omega_g`; the blocks are drawn independently (the blocks of a
    Blocks inner group too). The matrices come from a finite number of alternating
    projections, so they are doubly stochastic only up to a small defect; the
    decomposition's tolerance is set just above it (the truncated decomposition does not
    need more).
    """
    per_group = {}
    for g, d in matrices.items():
        batch = d.detach().cpu().to(torch.float64).numpy().reshape(-1, *d.shape[-2:])
        drawn = []
        for block in batch:
            atol = max(1e-6, 2.0 * defect(torch.from_numpy(block)))
            drawn.append(pyperm.sample_permutations(block, num_samples, max_terms=max_terms, generator=rng, atol=atol))
        per_group[g] = np.stack(drawn, axis=1)  # (samples, blocks, size)
    return [{g: _global(spec, g, s[i]) for g, s in per_group.items()} for i in range(num_samples)]
