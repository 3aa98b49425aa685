"""The starts of :func:`pyperm.nn.weight_matching` that read whole tensors, with the tensors split over ranks.

Both are sums over tensors, so each rank computes its own tensors' part, as the similarities are:

- ``"signatures"``: a group's cost is the sum over the tensors it acts on of the squared distances
  between its units' signatures (:func:`~pyperm.nn.align._starts.signature_cost` on the rank's own
  tensors). The parts go to the group's *home* (the lowest rank holding one), which adds them, solves
  and broadcasts the permutation. A Blocks inner group is solved after its outer group, within the
  blocks that one pairs, as in one process.
- ``"best"``'s test of a stalled identity start (:func:`~pyperm.nn.align._starts.stall_evidence`):
  each rank reads its tensors' cosines and norms; the flags are combined over the ranks.

Messages: one n x n float64 part per group and rank that holds a share of it without being its
home (none where one rank holds the whole group), and every permutation broadcast once.
"""

from __future__ import annotations

from collections.abc import Mapping
import torch

from pyperm._comm import Channel
from pyperm.nn.align._starts import (signature_cost, signature_order, solve_inner_signatures, solve_signatures,
                                     stall_evidence)
from pyperm.nn.permutations import Permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["signature_start_over_ranks", "stalled_over_ranks"]


def _holders(spec: PermutationSpec, owner: Mapping[str, int], chosen: set[str]) -> dict[str, list[int]]:
    return {g: sorted({owner[k] for k, _ in spec.group_axes[g] if k in chosen}) for g in spec.sizes}


def _summed_cost(spec: PermutationSpec, g: str, holders: list[int], sa: Mapping[str, torch.Tensor],
                 sb: Mapping[str, torch.Tensor], local: set[str], chan: Channel) -> torch.Tensor | None:  # fmt: skip
    """At the group's home: the whole cost (its part plus the others' parts); elsewhere None."""
    if chan.rank not in holders:
        return None
    part = signature_cost(spec, sa, sb, g, local)
    home = holders[0]
    if chan.rank != home:
        chan.send(part.to(torch.float64), home)
        return None
    n = spec.sizes[g]
    for r in holders[1:]:  # in rank order, as every rank walks the groups in signature_order
        part = part + chan.recv((n, n), torch.float64, r).to(part.device)
    return part


@torch.no_grad()
def signature_start_over_ranks(spec: PermutationSpec, sa: Mapping[str, torch.Tensor], sb: Mapping[str, torch.Tensor],
                               owner: Mapping[str, int], chosen: set[str], chan: Channel) -> dict[str, torch.Tensor]:  # fmt: skip
    """The ``"signatures"`` start (every rank returns the same permutations, on the CPU)."""
    local = {k for k in chosen if owner[k] == chan.rank}
    holders = _holders(spec, owner, chosen)
    perms: dict[str, torch.Tensor] = {}

    def share(g: str, solved: torch.Tensor | None) -> None:
        home = holders[g][0] if holders[g] else 0
        if not holders[g]:
            solved = torch.arange(spec.sizes[g])
        perm = solved if solved is not None else torch.empty(spec.sizes[g], dtype=torch.int64)
        perms[g] = chan.broadcast(perm.to(torch.int64), home).cpu()

    for g in signature_order(spec):  # the same order on every rank
        cost = _summed_cost(spec, g, holders[g], sa, sb, local, chan)  # None but at the group's home
        if cost is None:
            share(g, None)
        elif g in spec.blocks:
            share(g, solve_inner_signatures(spec, g, cost, perms))
        else:
            share(g, solve_signatures(cost))
        del cost
    return perms


@torch.no_grad()
def stalled_over_ranks(spec: PermutationSpec, sa: Mapping[str, torch.Tensor], sb: Mapping[str, torch.Tensor],
                       perms: Mapping[str, torch.Tensor], local_keys: list[str], chan: Channel) -> bool:  # fmt: skip
    """:func:`~pyperm.nn.align._starts.stalled` over every rank's tensors."""
    aligned, unaligned, same_norms = stall_evidence(spec, sa, sb, Permutations(spec, dict(perms)), local_keys)
    some_aligned, some_unaligned, some_differ = chan.all_reduce(
        [float(aligned), float(unaligned), float(not same_norms)])
    return some_unaligned > 0 and (some_aligned > 0 or some_differ == 0)
