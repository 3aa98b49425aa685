"""Weight matching on structured specs (Segments, Tiled, Blocks, one group on two axes).

A plain implementation of Algorithm 1 over :meth:`PermutationSpec.unit_positions`: each
step rebuilds its group's similarity from every row its units own, and is kept only when
the exact objective rises, so the objective never decreases. :func:`_signature_init`
gives the start that does not depend on the other groups' order (``init="signatures"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

import pyperm
from pyperm._checks import torch_generator
from pyperm.nn.align._objective import (
    WeightMatchingResult,
    _check_state,
    _objective,
    _objective_keys,
)
from pyperm.nn.permutations import as_permutations
from pyperm.nn.spec import PermutationSpec, _entry_groups


# Order statistics kept per slice of a unit's signature: the whole sorted slice would make the
# pairwise distances cost n^2 times the slice length (minutes for a wide ResNet).
SIGNATURE_POINTS = 64


def _signature_init(
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
    if not isinstance(spec, PermutationSpec):
        raise TypeError(f"spec must be a PermutationSpec, got {type(spec).__name__}")
    sa = _check_state(spec, state_a, "state_a", flat=False)
    sb = _check_state(spec, state_b, "state_b", flat=False)
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
        perms[inner] = _inner_of_pairs(paired, _columns(cols))
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


def _inner_of_pairs(outer: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The block-diagonal inner permutation that pairs unit ``l`` of A's block ``i`` with unit
    ``cols[i, l]`` of B's block ``outer[i]`` (``cols``: (nb, bs), local indices)."""
    nb, bs = cols.shape
    inner = torch.empty(nb * bs, dtype=torch.int64)
    # The inner permutation belongs to B's block: block outer[i] of it is that block's order.
    inner.view(nb, bs)[outer] = outer.view(-1, 1) * bs + cols
    return inner


def _row_similarity(
    spec: PermutationSpec,
    sa: Mapping[str, torch.Tensor],
    sb: Mapping[str, torch.Tensor],
    perms: Mapping[str, torch.Tensor],
    key: str,
    axis: int,
    held: Mapping[str, torch.Tensor],
    pos: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The products of A's rows at ``pos`` (n, k) along ``axis`` with B's, B permuted by
    ``perms`` along every axis and by ``{**perms, **held}`` along this one: (n, n)."""
    b = sb[key]
    for ax in range(b.ndim):
        index = spec.axis_index(key, ax, perms if ax != axis else {**perms, **held})
        if index is not None:
            b = b.index_select(ax, index.to(b.device))
    n = pos.shape[0]
    rows_a = sa[key].index_select(axis, pos.reshape(-1).to(sa[key].device)).movedim(axis, 0)
    rows_b = b.index_select(axis, pos.reshape(-1).to(b.device)).movedim(axis, 0)
    return (rows_a.reshape(n, -1).to(dtype) @ rows_b.reshape(n, -1).to(dtype).T).cpu()


def _blocks_step(
    spec: PermutationSpec,
    sa: Mapping[str, torch.Tensor],
    sb: Mapping[str, torch.Tensor],
    perms: Mapping[str, torch.Tensor],
    outer: str | int,
    chosen: set[str],
    dtype: torch.dtype,
    fixed_inner: str | None = None,
) -> dict[str, torch.Tensor]:
    """The best outer permutation of ``outer`` and inner permutations of its Blocks groups, the
    other groups held: an assignment of assignments.

    With ``fixed_inner`` (a Blocks group whose ``outer`` blocks stay in place) only that
    group's blocks are matched, each with itself.

    For every inner group and every pair (block ``i`` of A, block ``j`` of B) the units of
    the two blocks are paired by one assignment problem (all ``nb * nb`` of them in one
    batched solve); the best values, summed over the inner groups and added to the
    outer group's own similarity on its other axes, are the outer assignment's
    similarity; each block then keeps the inner assignment of the pair it is matched in.
    """
    inners = [fixed_inner] if fixed_inner is not None else [d for d, o in spec.blocks.items() if o == outer]
    nb = spec.num_blocks(inners[0])
    held = {d: torch.arange(spec.sizes[d]) for d in inners}
    outer_sim = torch.zeros(nb, nb, dtype=torch.float64)
    if fixed_inner is None:
        held[outer] = torch.arange(nb)  # type: ignore[index]
        for key, axis in spec.group_axes[outer]:  # type: ignore[index]
            pos = spec.unit_positions(key, axis, outer, outer_blocks=False)  # type: ignore[arg-type]
            if key in chosen and pos.shape[1]:
                outer_sim += _row_similarity(spec, sa, sb, perms, key, axis, held, pos, dtype).double()
    pairs = {}
    for d in inners:
        n, bs = spec.sizes[d], spec.block_size(d)
        sim = torch.zeros(n, n, dtype=dtype)
        for key, axis in spec.group_axes[d]:
            if key in chosen:
                sim += _row_similarity(spec, sa, sb, perms, key, axis, held, spec.unit_positions(key, axis, d), dtype)
        # (A block i, B block j) -> the (bs, bs) similarity of their units.
        stack = sim.double().view(nb, bs, nb, bs).permute(0, 2, 1, 3).reshape(nb * nb, bs, bs).contiguous()
        _, cols = pyperm.batch_linear_sum_assignment(stack.numpy(), maximize=True)
        cols = torch.as_tensor(cols, dtype=torch.int64)
        outer_sim += stack.gather(2, cols.unsqueeze(2)).sum((1, 2)).view(nb, nb)
        pairs[d] = cols.view(nb, nb, bs)
    if fixed_inner is not None:  # the blocks stay: each keeps the matching with itself
        best = torch.arange(nb)
        step = {}
    else:
        _, cols_outer = pyperm.linear_sum_assignment(outer_sim.numpy(), maximize=True)
        best = torch.as_tensor(cols_outer, dtype=torch.int64)
        step = {outer: best}
    for d, cols in pairs.items():
        step[d] = _inner_of_pairs(best, cols[torch.arange(nb), best])
    return step


def _check_sweeps(max_iter: Any, tol: Any) -> None:
    """The checks of ``max_iter`` and ``tol`` shared by both matchers."""
    if isinstance(max_iter, bool) or not isinstance(max_iter, (int, np.integer)):
        raise TypeError(f"max_iter must be an int, got {type(max_iter).__name__}")
    if max_iter < 0:
        raise ValueError(f"max_iter must be non-negative, got {max_iter}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol must be a non-negative finite number, got {tol!r}")


def _match_structured(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    max_iter: int,
    seed: Any,
    init: Mapping[str, Any] | None,
    keys: Iterable[str] | None,
    tol: float,
    dtype: torch.dtype,
    callback: Callable[[int, Mapping[str, torch.Tensor], float], bool | None] | None,
) -> WeightMatchingResult:
    """Algorithm 1 on a spec with structured axes: a plain reference implementation, not the fast matcher.

    A group's similarity sums, over every axis it acts on, the products of the rows its
    units own there (:meth:`PermutationSpec.unit_positions`) with B permuted along every
    other axis. A group acting on two axes of one tensor makes the objective quadratic
    in its permutation; each step then solves the linearisation with the other
    occurrence held at its current value (coordinate descent), and a step is kept only
    if the exact objective rises, so the objective never decreases. A :class:`~pyperm.nn.spec.Blocks` outer
    group and its inner groups move in one step (:func:`_blocks_step`), kept likewise only
    if the exact objective rises.
    """
    _check_sweeps(max_iter, tol)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    gen = torch_generator(seed)
    sa = _check_state(spec, state_a, "state_a", flat=False)
    sb = _check_state(spec, state_b, "state_b", flat=False)
    chosen = _objective_keys(spec, sa, keys)
    perms = as_permutations(spec, init) if init is not None else dict(spec.identity())
    objective = [_objective(spec, sa, sb, perms, chosen)]
    current = objective[0]
    chosen_set = set(chosen)
    # Groups acting on two axes of one tensor make the objective quadratic in their permutation.
    quadratic = {g for g, where in spec.group_axes.items() if len({k for k, _ in where}) < len(where)}
    block_outers = {o for o in spec.blocks.values() if isinstance(o, str)}

    acting = {k: {g for entry in spec.axes[k] for g in _entry_groups(entry)} for k in chosen}  # groups per tensor

    def gain(step: Mapping[str, torch.Tensor]) -> float:
        """The exact change of the objective if ``step`` replaced those permutations: only the
        tensors its groups act on change."""
        touched = [k for k in chosen if not acting[k].isdisjoint(step)]
        return _objective(spec, sa, sb, {**perms, **step}, touched) - _objective(spec, sa, sb, perms, touched)

    sweeps, converged = 0, max_iter == 0
    for sweeps in range(1, max_iter + 1):
        improved = False
        for gi in torch.randperm(len(spec.groups), generator=gen).tolist():
            g = spec.groups[gi]
            n = spec.sizes[g]
            fixed_blocks = g in spec.blocks and not isinstance(spec.blocks[g], str)
            if g in spec.blocks and not fixed_blocks:  # moved with its outer group (alone it would cross blocks)
                continue
            if g in block_outers or fixed_blocks:
                step = _blocks_step(spec, sa, sb, perms, spec.blocks[g] if fixed_blocks else g, chosen_set, dtype,
                                    fixed_inner=g if fixed_blocks else None)  # fmt: skip
                if all(torch.equal(p, perms[h]) for h, p in step.items()):
                    continue
                value = current + gain(step)
                if value > current + tol * max(abs(current), 1.0):
                    perms.update(step)
                    current, improved = value, True
                continue
            sim = torch.zeros(n, n, dtype=dtype)
            for key, axis in spec.group_axes[g]:
                if key in chosen_set:
                    # B permuted everywhere except where g sits on this axis (the other groups
                    # of the axis are not read: only g's rows enter).
                    pos = spec.unit_positions(key, axis, g)
                    sim += _row_similarity(spec, sa, sb, perms, key, axis, {g: torch.arange(n)}, pos, dtype)
            _, cols = pyperm.linear_sum_assignment(sim.double().numpy(), maximize=True)
            candidate = torch.as_tensor(cols, dtype=torch.int64)
            if torch.equal(candidate, perms[g]):
                continue
            if g in quadratic:  # the step changed the other occurrence too: evaluate it exactly
                value = current + gain({g: candidate})
            else:  # linear in P_g: the gain reads off the similarity
                rows = torch.arange(n)
                value = current + float(sim[rows, candidate].double().sum() - sim[rows, perms[g]].double().sum())
            if value > current + tol * max(abs(current), 1.0):
                perms[g], current, improved = candidate, value, True
        objective.append(current)
        stop = callback(sweeps, perms, current) if callback is not None else None
        if not improved:
            converged = True
            break
        if stop:
            break
    return WeightMatchingResult(perms={g: p.cpu() for g, p in perms.items()}, objective=objective, sweeps=sweeps,
                                converged=converged)  # fmt: skip
