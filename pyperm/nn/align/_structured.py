"""A plain reference implementation of weight matching on any spec, to check the fast matcher against.

Algorithm 1 over :meth:`PermutationSpec.unit_positions`: each step rebuilds its group's
similarity from every row its units own, and is kept only when the exact objective rises.
:class:`~pyperm.nn.align._matcher.WeightMatcher` takes the same steps in the same seeded order
(the tests compare them step by step, as they compare the flat case with
:func:`pyperm.testing.reference_weight_matching`); nothing else calls this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

import pyperm
from pyperm._checks import callback_stops, torch_generator
from pyperm._progress import progress_bar
from pyperm.nn.align._objective import (
    WeightMatchingResult,
    _check_state,
    _objective,
    _objective_keys,
)
from pyperm.nn.align._pieces import inner_of_pairs
from pyperm.nn.permutations import Permutations, as_permutations
from pyperm.nn.spec import PermutationSpec, entry_groups


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
        step[d] = inner_of_pairs(best, cols[torch.arange(nb), best])
    return step


def reference_matching(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    *,
    init: Mapping[str, Any] | None = None,
    max_iter: int = 100,
    seed: Any = 0,
    keys: Iterable[str] | None = None,
    tol: float = 1e-12,
    dtype: torch.dtype = torch.float32,
    callback: Callable[[int, Mapping[str, torch.Tensor], float], bool | None] | None = None,
    progress: bool = False,
) -> WeightMatchingResult:
    """Algorithm 1 on any spec, written plainly (the reference the fast matcher is tested against).

    A group's similarity sums, over every axis it acts on, the products of the rows its
    units own there (:meth:`PermutationSpec.unit_positions`) with B permuted along every
    other axis. A group acting on two axes of one tensor makes the objective quadratic
    in its permutation; each step then solves the linearisation with the other
    occurrence held at its current value (coordinate descent), and a step is kept only
    if the exact objective rises, so the objective never decreases. A :class:`~pyperm.nn.spec.Blocks` outer
    group and its inner groups move in one step (:func:`_blocks_step`), kept likewise only
    if the exact objective rises.

    The arguments are those of :func:`~pyperm.nn.weight_matching`.
    """
    gen = torch_generator(seed)
    sa = _check_state(spec, state_a, "state_a")
    sb = _check_state(spec, state_b, "state_b")
    chosen = _objective_keys(spec, sa, keys)
    perms = as_permutations(spec, init) if init is not None else dict(spec.identity())
    objective = [_objective(spec, sa, sb, perms, chosen)]
    current = objective[0]
    chosen_set = set(chosen)
    # Groups acting on two axes of one tensor make the objective quadratic in their permutation.
    quadratic = {g for g, where in spec.group_axes.items() if len({k for k, _ in where}) < len(where)}
    block_outers = {o for o in spec.blocks.values() if isinstance(o, str)}

    acting = {k: {g for entry in spec.axes[k] for g in entry_groups(entry)} for k in chosen}  # groups per tensor

    def gain(step: Mapping[str, torch.Tensor]) -> float:
        """The exact change of the objective if ``step`` replaced those permutations: only the
        tensors its groups act on change."""
        touched = [k for k in chosen if not acting[k].isdisjoint(step)]
        return _objective(spec, sa, sb, {**perms, **step}, touched) - _objective(spec, sa, sb, perms, touched)

    sweeps, converged = 0, max_iter == 0
    bar = progress_bar(progress, max_iter, "weight matching", "sweep")
    try:
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
            if bar is not None:
                bar.update(1)
                bar.set_postfix(objective=f"{current:.6g}")
            stop = callback is not None and callback_stops(callback(sweeps, perms, current))
            if not improved:
                converged = True
                break
            if stop:
                break
    finally:
        if bar is not None:
            bar.close()
    return WeightMatchingResult(perms=Permutations(spec, {g: p.cpu() for g, p in perms.items()}),
                                objective=objective, iterations=sweeps, converged=converged)  # fmt: skip
