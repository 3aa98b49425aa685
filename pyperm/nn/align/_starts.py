"""Where weight matching starts: the identity, the signature start, and the default that picks between them.

Algorithm 1 from the identity depends on the order in which groups meet their neighbours and
can stall far from the optimum when B is a permuted copy of A: a group's similarity is
uninformative while its neighbours are still unaligned (MobileNetV2 with torchvision's
initialisation, whose BatchNorm vectors are all equal, and a ViT's heads). The signature start
matches every group's units on their own, by statistics that no other group's order changes,
and finds such permutations at once; on unrelated models it ends where the identity start
does, at the price of a second search.

The default (``init="best"``) therefore runs the identity start, then looks at what it found
(:func:`stalled`): models related by a permutation have some tensors aligned almost exactly
(centred cosine near 1), or, when nothing got aligned, every tensor's norm equal to its
counterpart's; a stall leaves some tensor far from aligned. Only then is the signature start
run too (the same matcher, so B stays arranged), and the higher objective kept, so the default
never ends below the identity start. Unrelated models (every cosine far below 1, norms apart)
and related models aligned everywhere cost one search and the look: a few percent of it
(measured by ``pyperm bench match --starts``), since the look reads up to 64 units per axis
and one norm per tensor. Trying both starts always would cost two to three searches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

import pyperm
from pyperm.nn.align._matcher import WeightMatcher
from pyperm.nn.align._objective import WeightMatchingResult, _check_state, _objective_keys
from pyperm.nn.align._pieces import inner_of_pairs
from pyperm.nn.spec import PermutationSpec

__all__ = ["STARTS", "match_from", "signature_start", "stalled"]

# The starts init= names.
STARTS = ("best", "identity", "signatures")

# Whether the models are related by a permutation, and whether the identity start stalled, is
# read off the tensors with a permuted axis and at least two axes longer than one (vectors say
# little: BatchNorm's start out constant). A tensor aligned by a permutation of a related model
# has a centred cosine of 1 up to noise; after weight matching, unrelated models' tensors stay far
# below (at most 0.46 measured on the bundled models, torchvision's MobileNetV2 and timm's ViT).
# Related models: some tensor of at least _MIN_ENTRIES entries at _RELATED or above (a tiny one
# could get there by chance), or every tensor's norm equal to its counterpart's within
# _SAME_NORM (a permutation keeps norms; two independent initialisations differ by about
# sqrt(2 / size), 0.1% at a million entries). A stall: some tensor below _STALLED (a group
# partly misplaced leaves its small tensors at 0.6 to 0.8).
_RELATED = 0.95
_STALLED = 0.9
_MIN_ENTRIES = 64
_SAME_NORM = 1e-3
# Units per permuted axis the cosines read (evenly spaced): enough to tell 1 from 0.9, at a
# cost that does not grow with the model.
_COSINE_UNITS = 64


def match_from(
    start: str,
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    seed: int | torch.Generator,
    *,
    keys: Iterable[str] | None,
    dtype: torch.dtype,
    **options: Any,
) -> WeightMatchingResult:
    """Weight matching from the named start (one of :data:`STARTS`); ``options`` go to
    :meth:`WeightMatcher.match` (each run visits the groups in the same seeded orders)."""
    matcher = WeightMatcher(spec, state_b, keys=keys, dtype=dtype)
    if start == "signatures":
        return matcher.match(state_a, init=signature_start(spec, state_a, state_b, keys), seed=seed, **options)
    first = matcher.match(state_a, init=None, seed=_same_seed(seed), **options)
    if start == "identity" or not stalled(spec, state_a, state_b, first.perms, matcher.keys):
        return first
    second = matcher.match(state_a, init=signature_start(spec, state_a, state_b, keys), seed=_same_seed(seed),
                           **options)  # fmt: skip
    return max((first, second), key=lambda r: r.objective[-1])  # the identity start's on a tie


def _same_seed(seed: int | torch.Generator) -> int | torch.Generator:
    """``seed`` for one of several runs: a Generator is copied, so that every run visits the
    groups in the same orders (as an int seed does)."""
    if not isinstance(seed, torch.Generator):
        return seed
    copy = torch.Generator(device=seed.device)
    copy.set_state(seed.get_state())
    return copy


@torch.no_grad()
def stalled(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    perms: Mapping[str, torch.Tensor],
    keys: Iterable[str],
) -> bool:
    """Whether B looks like a permuted copy of A (up to noise) that ``perms`` leaves partly unaligned.

    Related: ``perms`` aligns some tensor almost exactly, or every tensor has its counterpart's
    norm. Stalled: some tensor stays far from aligned. The cosines read up to 64 evenly spaced
    units per permuted axis (see the module's constants).
    """
    aligned = unaligned = False
    same_norms = True
    for key in keys:
        a, b = state_a[key], state_b[key]
        if all(e is None for e in spec.axes[key]) or sum(n > 1 for n in a.shape) < 2:
            continue
        norm_a, norm_b = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
        same_norms = same_norms and abs(norm_a - norm_b) <= _SAME_NORM * max(norm_a, norm_b)
        for axis, n in enumerate(a.shape):
            index = spec.axis_index(key, axis, perms)
            if index is not None:
                picks = torch.linspace(0, n - 1, min(n, _COSINE_UNITS)).round().long()
                a = a.index_select(axis, picks.to(a.device))
                b = b.index_select(axis, index[picks].to(b.device))
        x, y = a.double().flatten(), b.double().flatten()
        x, y = x - x.mean(), y - y.mean()
        norms = float(x.norm() * y.norm())
        if norms > 0:  # else a constant tensor: no evidence either way
            cosine = float(x @ y) / norms
            aligned = aligned or (cosine >= _RELATED and x.numel() >= _MIN_ENTRIES)
            unaligned = unaligned or cosine < _STALLED
    return unaligned and (aligned or same_norms)


# Order statistics kept per slice of a unit's signature: the whole sorted slice would make the
# pairwise distances cost n^2 times the slice length (minutes for a wide ResNet).
SIGNATURE_POINTS = 64


def signature_start(
    spec: PermutationSpec, state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor], keys: Any
) -> dict[str, torch.Tensor]:
    """Every group's units matched on their own, whatever the other groups' order.

    A unit's signature is the sorted entries of every slice it owns (its rows of every
    tensor the group acts on): permuting any other axis only reorders a slice, so the
    signature of a unit of B permuted by ``P`` is that of the unit it came from. A long
    slice is summarised by 64 evenly spaced order statistics. Units are paired by the
    smallest total squared distance between signatures (exact for a planted permutation
    of distinct units).
    """
    sa = _check_state(spec, state_a, "state_a")
    sb = _check_state(spec, state_b, "state_b")
    chosen = set(_objective_keys(spec, sa, keys))
    perms: dict[str, torch.Tensor] = {}
    costs: dict[str, torch.Tensor] = {}
    for g, n in spec.sizes.items():
        sig_a, sig_b = [], []
        for key, axis in spec.group_axes[g]:
            if key not in chosen:
                continue
            pos = spec.unit_positions(key, axis, g).reshape(-1)
            whole = pos.numel() == sa[key].shape[axis] and bool((pos == torch.arange(pos.numel())).all())
            for t, out in ((sa[key], sig_a), (sb[key], sig_b)):
                rows = t if whole else t.index_select(axis, pos.to(t.device))
                out.append(_signature(rows.movedim(axis, 0).reshape(n, -1)))
        if not sig_a:
            perms[g] = torch.arange(n)
            continue
        cost = torch.cdist(torch.cat(sig_a, 1), torch.cat(sig_b, 1)) ** 2  # on the weights' device
        if g in spec.blocks:  # solved below, within the blocks its outer group pairs
            costs[g] = cost
            continue
        perms[g] = _columns(pyperm.linear_sum_assignment(_solver_input(cost))[1])
    for inner, outer in spec.blocks.items():
        # An outer unit's signature covers its whole block, whatever the order within it,
        # so the blocks are paired first; then each pair of blocks pairs its units.
        nb, bs = spec.num_blocks(inner), spec.block_size(inner)
        if inner not in costs:
            perms[inner] = torch.arange(spec.sizes[inner])
            continue
        paired = perms[outer] if isinstance(outer, str) else torch.arange(nb)  # fixed blocks pair with themselves
        pairs = costs[inner].view(nb, bs, nb, bs)[torch.arange(nb), :, paired]  # (nb, bs, bs)
        _, cols = pyperm.batch_linear_sum_assignment(_solver_input(pairs.contiguous()))
        perms[inner] = inner_of_pairs(paired, _columns(cols))
    return perms


def _signature(rows: torch.Tensor) -> torch.Tensor:
    """Every row's entries sorted, as float64 on the rows' device; a long row is summarised by
    ``SIGNATURE_POINTS`` evenly spaced order statistics (min and max included), scaled so
    that it keeps its share of the distance."""
    length = rows.shape[1]
    if rows.is_cuda:  # CUDA weights are never copied to the host
        ranked = torch.sort(rows, dim=1).values
        if length > SIGNATURE_POINTS:
            picks = torch.linspace(0, length - 1, SIGNATURE_POINTS, device=rows.device).round().long()
            return ranked[:, picks].double() * math.sqrt(length / SIGNATURE_POINTS)
        return ranked.double()
    ranked = np.sort(rows.numpy(), axis=1)  # numpy's sort: 8x torch's on the CPU
    if length > SIGNATURE_POINTS:
        picks = np.linspace(0, length - 1, SIGNATURE_POINTS).round().astype(np.int64)
        ranked = ranked[:, picks].astype(np.float64) * math.sqrt(length / SIGNATURE_POINTS)
    return torch.from_numpy(ranked.astype(np.float64, copy=False))


def _solver_input(cost: torch.Tensor) -> Any:
    """A cost for pyperm's assignment solvers: CUDA tensors as they are (the CUDA solver), else numpy."""
    return cost if cost.is_cuda else cost.numpy()


def _columns(cols: Any) -> torch.Tensor:
    """A solver's columns as an int64 CPU tensor."""
    return torch.as_tensor(cols).to("cpu", torch.int64)
