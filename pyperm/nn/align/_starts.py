r"""Where weight matching starts: the identity, the signature start, and the default that picks between them.

Algorithm 1 from the identity depends on the order in which groups meet their neighbours and
can stall far from the optimum when B is a permuted copy of A: a group's similarity is
uninformative while its neighbours are still unaligned (MobileNetV2 with torchvision's
initialisation, whose BatchNorm vectors are all equal, and a ViT's heads). The signature start
matches every group's units on their own, by statistics that no other group's order changes,
and finds such permutations at once; on unrelated models it ends where the identity start
does, at the price of a second search.

The default (``init="best"``) first asks whether B is an exact permuted copy of A (every
tensor's norm equal to its counterpart's): then :func:`copy_start` pairs every group's units by
rank of a fingerprint that no other group's order changes (a few power sums of every slice a
unit owns; one pass over the weights, no sort), and when those permutations attain the upper
bound :math:`\sum_k \|A_k\|\,\|B_k\|` of the objective (Cauchy-Schwarz) they are the
optimum: no start can do better, and no sweep is needed to confirm it (attained means
:math:`\pi(B)` equals A to the last bit, checked tensor by tensor). Otherwise it runs the
identity start, then looks at what it found
(:func:`stalled`): models related by a permutation have some tensors aligned almost exactly
(centred cosine near 1), or, when nothing got aligned, every tensor's norm equal to its
counterpart's; a stall leaves some tensor far from aligned. Only then is the signature start
run too (the same matcher and work buffers), and the higher objective kept, so the default
never ends below the identity start. Unrelated models (every cosine far below 1, norms apart)
and related models aligned everywhere cost one search and the look: a few percent of it
(measured by ``pyperm bench match --starts``), since the look reads up to 64 units per axis
and one norm per tensor. Trying both starts always would cost two to three searches.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

import pyperm
from pyperm._memory import release_free_memory
from pyperm.nn.align._matcher import TRIM_SECONDS, WeightMatcher
from pyperm.nn.align._objective import WeightMatchingResult, _check_state, _objective, _objective_keys
from pyperm.nn.align._pieces import inner_of_pairs
from pyperm.nn.permutations import Permutations, permute_entry
from pyperm.nn.spec import PermutationSpec

__all__ = ["STARTS", "copy_start", "match_from", "optimal_copy", "signature_cost", "signature_order",
           "signature_start", "solve_inner_signatures", "solve_signatures", "stall_evidence", "stalled",
           "unstalled"]

logger = logging.getLogger(__name__)

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
# A permuted copy has every norm equal to its counterpart's, to this relative tolerance (float32
# sums of the same numbers in another order agree to ~1e-6; two independent initialisations differ
# by about sqrt(2 / size), 0.1% at a million entries).
_COPY_TOL = 1e-4
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
    product_dtype: torch.dtype | None = None,
    **options: Any,
) -> WeightMatchingResult:
    """Weight matching from the named start (one of :data:`STARTS`); ``options`` go to
    :meth:`WeightMatcher.match` (each run visits the groups in the same seeded orders)."""
    matcher = WeightMatcher(spec, state_b, keys=keys, dtype=dtype, product_dtype=product_dtype)
    if start == "signatures":
        return matcher.match(state_a, init=signature_start(spec, state_a, state_b, keys), seed=seed, **options)
    if start == "best":
        optimum = optimal_copy(spec, state_a, state_b, matcher.keys)
        if optimum is not None:
            return optimum
    first = matcher.match(state_a, init=None, seed=_same_seed(seed), **options)
    if start == "identity":
        return first
    return unstalled(matcher, first, spec, state_a, state_b, seed, keys, **options)


def unstalled(matcher: WeightMatcher, first: WeightMatchingResult, spec: PermutationSpec,
              state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor], seed: int | torch.Generator,
              keys: Iterable[str] | None, **options: Any) -> WeightMatchingResult:  # fmt: skip
    """``first`` (the identity start's result, by ``matcher``), or, when it stalled (:func:`stalled`), the
    better of it and a second run of ``matcher`` from the signature start."""
    if not stalled(spec, state_a, state_b, first.perms, matcher.keys):
        return first
    # The first run's similarities are given back first: the second start moves most units of the groups
    # it changes, so their similarities are rebuilt anyway (SD-1.5's UNet at 0.7x channels: the second
    # run's one sweep took as long as the first run's first), and holding them (0.29x the model there)
    # under the signature start's own costs made its peak the whole call's.
    matcher.release_similarities()
    init = signature_start(spec, state_a, state_b, keys)
    release_free_memory()  # the signatures' temporaries, before the second run's own (see signature_start)
    second = matcher.match(state_a, init=init, seed=_same_seed(seed), **options)
    return max((first, second), key=lambda r: r.objective[-1])  # the identity start's on a tie


def optimal_copy(spec: PermutationSpec, state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor],
                  keys: list[str]) -> WeightMatchingResult | None:
    """The result for B an exact permuted copy of A, when :func:`copy_start` finds the permutations that make
    B equal to A: they attain the objective's upper bound, so they are optimal and no sweep can raise them.
    Else None."""
    sa, sb = _check_state(spec, state_a, "state_a"), _check_state(spec, state_b, "state_b")
    if len({t[k].device for t in (sa, sb) for k in keys}) > 1:
        return None  # the matcher says what is wrong
    norms = [(_norm(sa[k]), _norm(sb[k])) for k in keys]
    if not norms or any(abs(na - nb) > _COPY_TOL * max(na, nb) for na, nb in norms):
        return None  # a permutation keeps every norm: B is not a permuted copy of A
    perms = copy_start(spec, sa, sb, keys)
    if not all(torch.equal(permute_entry(spec, perms, k, sb[k]), sa[k]) for k in keys):
        return None  # not a permuted copy (or units the fingerprints could not tell apart)
    # pi(B) is A to the last bit: the objective sum ||A_k||^2 is the bound sum ||A_k|| ||B_k||.
    objective = _objective(spec, sa, sb, perms, keys)
    logger.debug("weight_matching: B is a permuted copy of A, found by the copy start (objective %.9g)", objective)
    return WeightMatchingResult(perms=Permutations(spec, perms), objective=[objective], iterations=0, converged=True)


def _norm(t: torch.Tensor) -> float:
    # In the tensor's precision (30x faster than float64 here): a gate only; the copy is checked exactly.
    return float(torch.linalg.vector_norm(t if t.is_floating_point() else t.double()))


@torch.no_grad()
def copy_start(spec: PermutationSpec, sa: Mapping[str, torch.Tensor], sb: Mapping[str, torch.Tensor],
               keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Every group's units paired by rank of a fingerprint that no other group's order changes.

    A unit's fingerprint sums the first three power sums of every slice it owns (its rows of
    the tensors the group acts on along their first axis, else of every tensor it acts on),
    each slice's with its own fixed weights: permuting any
    other axis only reorders a slice, so a unit of B permuted by ``P`` has exactly (up to
    rounding) the fingerprint of the unit it came from. Blocks are paired first (an outer
    unit's slices cover its whole block), then the units within each pair of blocks. Exact
    for a permuted copy whose units have distinct fingerprints; for anything else it is only
    a guess, which the caller checks against the objective's bound.
    """
    chosen = set(keys)
    fa, fb = _fingerprints(spec, sa, chosen), _fingerprints(spec, sb, chosen)
    perms = {g: _by_rank(fa[g], fb[g]) for g in spec.sizes if g not in spec.blocks}
    for inner, outer in spec.blocks.items():
        nb, bs = spec.num_blocks(inner), spec.block_size(inner)
        paired = perms[outer] if isinstance(outer, str) else torch.arange(nb)
        blocks_a, blocks_b = fa[inner].view(nb, bs), fb[inner].view(nb, bs)[paired]
        cols = torch.stack([_by_rank(x, y) for x, y in zip(blocks_a, blocks_b)])
        perms[inner] = inner_of_pairs(paired, cols)
    return perms


def _fingerprints(spec: PermutationSpec, state: Mapping[str, torch.Tensor], chosen: set[str]) -> dict[str, torch.Tensor]:
    """Every group's per-unit fingerprints (float64, on the CPU) for :func:`copy_start`."""
    sums: dict[tuple[str, int], torch.Tensor] = {}  # per (key, axis): every position's weighted power sums
    out = {}
    for g, n in spec.sizes.items():
        total = torch.zeros(n, dtype=torch.float64)
        where = [(key, axis) for key, axis in spec.group_axes[g] if key in chosen]
        # The slices along a tensor's first axis are contiguous rows: read those alone where the group
        # has some (its producer's weight, norms, biases); they tell its units apart as well.
        where = [(key, axis) for key, axis in where if axis == 0] or where
        for key, axis in where:
            if (key, axis) not in sums:
                sums[key, axis] = _power_sums(state[key], axis, len(sums))
            pos = spec.unit_positions(key, axis, g).reshape(n, -1)
            total += sums[key, axis][pos].sum(1)
        out[g] = total
    return out


def _power_sums(t: torch.Tensor, axis: int, salt: int) -> torch.Tensor:
    """For every position along ``axis``: a weighted sum of the first three power sums of its slice.

    Powers are taken elementwise in the tensor's dtype (the same number wherever the entry
    sits) and summed in float64, so a reordering of the slice changes the result by rounding
    only. The weights depend on ``salt`` (one per tensor axis): slices of different tensors
    do not cancel."""
    rows = t.detach().movedim(axis, 0).reshape(t.shape[axis], -1)
    square = rows * rows
    w1, w2, w3 = (math.cos(salt + 1.0 + 0.37 * k) for k in range(3))
    total = w1 * rows.sum(1, dtype=torch.float64) + w2 * square.sum(1, dtype=torch.float64)
    return (total + w3 * (square * rows).sum(1, dtype=torch.float64)).cpu()


def _by_rank(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The permutation ``p`` pairing the ``r``-th smallest of ``a`` with the ``r``-th smallest of ``b``:
    ``b[p]`` sorts like ``a``."""
    p = torch.empty(a.numel(), dtype=torch.int64)
    p[torch.argsort(a, stable=True)] = torch.argsort(b, stable=True)  # equal models: the identity
    return p


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
    aligned, unaligned, same_norms = stall_evidence(spec, state_a, state_b, perms, keys)
    return unaligned and (aligned or same_norms)


@torch.no_grad()
def stall_evidence(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    perms: Mapping[str, torch.Tensor],
    keys: Iterable[str],
) -> tuple[bool, bool, bool]:
    """What :func:`stalled` decides on, for the tensors ``keys``: (some tensor aligned, some tensor
    far from aligned, every tensor's norm equal to its counterpart's). Over ranks each rank reads its
    own tensors and the flags are combined (or, or, and)."""
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
    return aligned, unaligned, same_norms


# Order statistics kept per slice of a unit's signature: the whole sorted slice would make the
# pairwise distances cost n^2 times the slice length (minutes for a wide ResNet).
SIGNATURE_POINTS = 64
# Bytes of a tensor whose units' signatures are taken at once (see _unit_signatures).
SIGNATURE_CHUNK_BYTES = 4 << 20


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
    for g in signature_order(spec):
        cost = signature_cost(spec, sa, sb, g, chosen)
        if g in spec.blocks:
            perms[g] = solve_inner_signatures(spec, g, cost, perms)
        else:
            perms[g] = torch.arange(spec.sizes[g]) if cost is None else solve_signatures(cost)
        del cost
    return perms


def signature_order(spec: PermutationSpec) -> Iterator[str]:
    """The groups in the order the signature start solves them, one cost at a time: the Blocks inner
    groups last, each within the blocks its outer group (solved before it) pairs, so that their
    float64 costs are not all kept at once. Between groups, every ``TRIM_SECONDS``, the free heap
    pages go back to the system: each group's temporaries are freed into the heap, where the next
    group's allocations of other sizes leave them resident (they once took Stable Diffusion's UNet
    past the weight-matching run's own peak)."""
    trimmed = time.perf_counter()
    for g in [g for g in spec.sizes if g not in spec.blocks] + list(spec.blocks):
        yield g
        if time.perf_counter() - trimmed >= TRIM_SECONDS:
            release_free_memory()
            trimmed = time.perf_counter()


def signature_cost(spec: PermutationSpec, sa: Mapping[str, torch.Tensor], sb: Mapping[str, torch.Tensor], g: str,
                   chosen: set[str]) -> torch.Tensor | None:  # fmt: skip
    """Group ``g``'s squared signature distances (n x n, float64) over the tensors ``chosen``, or None
    when it acts on none of them. A sum over tensors: over ranks, each rank's part is added."""
    sig_a, sig_b = [], []
    for key, axis in spec.group_axes[g]:
        if key not in chosen:
            continue
        pos = spec.unit_positions(key, axis, g).reshape(-1)
        whole = pos.numel() == sa[key].shape[axis] and bool((pos == torch.arange(pos.numel())).all())
        for t, out in ((sa[key], sig_a), (sb[key], sig_b)):
            out.append(_unit_signatures(t, axis, None if whole else pos, spec.sizes[g]))
    if not sig_a:
        return None
    return squared_distances(torch.cat(sig_a, 1), torch.cat(sig_b, 1))  # on the weights' device


def squared_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``torch.cdist(x, y) ** 2`` of float64 rows, made in one (n, m) matrix: ``|x|^2 + |y|^2 - 2 x.y``,
    clamped at 0 (cdist's own way for long rows, without its square root and its second matrix for the
    square: at n = 5120, 210 MB each)."""
    out = (x * x).sum(1, keepdim=True) + (y * y).sum(1)
    return out.addmm_(x, y.T, alpha=-2).clamp_(min=0)


def solve_signatures(cost: torch.Tensor) -> torch.Tensor:
    """The units paired by the smallest total distance (a plain group)."""
    return _columns(pyperm.linear_sum_assignment(_solver_input(cost))[1])


def solve_inner_signatures(spec: PermutationSpec, inner: str, cost: torch.Tensor | None,
                           perms: Mapping[str, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """A Blocks inner group's permutation from its signature cost, within the blocks its outer group
    (already in ``perms``) pairs: an outer unit's signature covers its whole block, whatever the order
    within it, so the blocks are paired first; then each pair of blocks pairs its units."""
    if cost is None:
        return torch.arange(spec.sizes[inner])
    outer = spec.blocks[inner]
    nb, bs = spec.num_blocks(inner), spec.block_size(inner)
    paired = perms[outer] if isinstance(outer, str) else torch.arange(nb)  # fixed blocks pair with themselves
    pairs = cost.view(nb, bs, nb, bs)[torch.arange(nb), :, paired]  # (nb, bs, bs)
    _, cols = pyperm.batch_linear_sum_assignment(_solver_input(pairs.contiguous()))
    return inner_of_pairs(paired, _columns(cols))


def _unit_signatures(t: torch.Tensor, axis: int, positions: torch.Tensor | None, n: int) -> torch.Tensor:
    """The signatures of ``n`` units of ``t`` along ``axis``, one row each: unit ``u`` owns the positions
    ``positions[u * m:(u + 1) * m]`` of the axis (None: all positions in order; m is their count over
    ``n``, more than one for an outer group of blocks). Taken in chunks of at most
    ``SIGNATURE_CHUNK_BYTES`` of the tensor, so that its sorted (and arranged, converted) copies are
    never made whole: sorting every tensor whole grew the heap by 0.14x the model between two trims of a
    Stable Diffusion UNet's signature start."""
    m = (t.shape[axis] if positions is None else positions.numel()) // n
    unit_bytes = max(t.numel() // max(t.shape[axis], 1) * m * t.element_size(), 1)
    step = max(1, SIGNATURE_CHUNK_BYTES // unit_bytes)
    parts = []
    for start in range(0, n, step):
        count = min(step, n - start)
        if positions is None:
            rows = t.narrow(axis, start * m, count * m)
        else:
            rows = t.index_select(axis, positions[start * m:(start + count) * m].to(t.device))
        parts.append(_signature(rows.movedim(axis, 0).reshape(count, -1)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
    if rows.dtype not in (torch.float32, torch.float64):  # numpy has no bfloat16; float16 sorts slowly
        rows = rows.float()
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
