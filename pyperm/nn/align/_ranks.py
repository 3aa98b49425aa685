"""One rank's part of weight matching over ranks: its tensors' similarity terms, and the steps it takes part in.

Every rank lowers the whole spec to pieces (:mod:`pyperm.nn.align._pieces`) from the gathered
layout, so that every rank numbers the pieces, groups and steps alike, but builds similarity
terms (:class:`~pyperm.nn.align._similarity.Term`) only for the pieces it holds: a group's
similarity on a rank is the part its own tensors contribute, kept up to date by the same
incremental corrections as in one process. A step's *participants* are the ranks holding a
piece it reads; its *solver* is the participant holding most of the step's columns. The other
participants send their parts to the solver, which adds them, runs the one-process step on the
sums (:func:`~pyperm.nn.align._matcher.plain_step`, :func:`~pyperm.nn.align._matcher.blocks_step`,
which :class:`~pyperm.nn.align._matcher.WeightMatcher` runs too) and sends the outcome back. A
step with one participant is that rank's alone: no message.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import pyperm
from pyperm._memory import release_free_memory
from pyperm._comm import Channel
from pyperm.nn.align._rank_layout import Layout
from pyperm.lap.warm import INCREMENTAL_UP_TO, WarmAssigner
from pyperm.nn.align._matcher import (
    COST_BUDGET_FRACTION,
    COST_BUDGET_MIN,
    blocks_step,
    check_finite_cost,
    piece_dot,
    plain_step,
    plan_steps,
    similarity_product_dtype,
)
from pyperm.nn.align._pieces import blocks_index, label_groups, lower
from pyperm.nn.align._similarity import CostCache, GroupSimilarity, Products, Term, Work
from pyperm.nn.spec import Blocks, PermutationSpec

__all__ = ["RankMatcher"]

# Message codes from the solver to the other participants.
_KEEP, _TAKE, _EVALUATE = 0, 1, 2


@dataclass
class _Whole:
    """A group's whole similarity at its solver (minus it: the cost), and the solver state that solves it."""

    cost: torch.Tensor
    assigner: WarmAssigner
    has_terms: bool


class RankMatcher:
    """This rank's share of the pair and its part in every step (see the module notes)."""

    def __init__(self, spec: PermutationSpec, sa: Mapping[str, torch.Tensor], sb: Mapping[str, torch.Tensor],
                 layout: Layout, keys: list[str], dtype: torch.dtype, product_dtype: Any, chan: Channel) -> None:  # fmt: skip
        self.spec, self.chan, self.dtype, self.rank = spec, chan, dtype, chan.rank
        self.sa, self.sb = sa, sb
        self.local_keys = [k for k in keys if layout.owner[k] == chan.rank]
        devices = {sb[k].device for k in self.local_keys} | {sa[k].device for k in self.local_keys}
        if len(devices) > 1:
            raise ValueError(f"rank {chan.rank}: its share of state_a and state_b must be on one device, found "
                             f"{sorted(map(str, devices))}")  # fmt: skip
        self.device = devices.pop() if devices else chan.device
        self.product_dtype = similarity_product_dtype(product_dtype, dtype, [layout.meta[k] for k in keys])
        self.pieces = lower(spec, {k: tuple(layout.meta[k].shape) for k in keys}, keys)
        self.piece_rank = [layout.owner[p.key] for p in self.pieces]
        mine = [i for i, r in enumerate(self.piece_rank) if r == chan.rank]
        self.a_views = {i: self.pieces[i].of(sa[self.pieces[i].key]) for i in mine}
        self.b_views = {i: self.pieces[i].of(sb[self.pieces[i].key]) for i in mine}
        # Where each group's similarity is read (as WeightMatcher: a Blocks inner group reads its form's axes).
        where: dict[str, list[tuple[int, int]]] = {g: [] for g in spec.sizes}
        for i, p in enumerate(self.pieces):
            for ax, label in enumerate(p.labels):
                if isinstance(label, str):
                    where[label].append((i, ax))
                elif isinstance(label, Blocks):
                    where[label.inner].append((i, ax))
        self.forms = list(dict.fromkeys(lb for p in self.pieces for lb in p.labels if isinstance(lb, Blocks)))
        self.steps = plan_steps(spec, self.pieces)
        # The ranks that hold terms of each group, and the similarities (here) that read each permutation.
        self.term_ranks = {g: sorted({self.piece_rank[i] for i, _ in w}) for g, w in where.items()}
        self.dependents: dict[str, list[str]] = {g: [] for g in spec.sizes}
        for g, w in where.items():
            for h in {h for i, ax in w if i in self.a_views for a, lb in enumerate(self.pieces[i].labels) if a != ax
                      for h in label_groups(lb)}:  # fmt: skip
                self.dependents[h].append(g)
        self.where = where
        self.participants: dict[str, list[int]] = {}
        self.solver: dict[str, int] = {}
        self.home: dict[str, int] = {}  # the solver of the step that moves each group
        for g, step in self.steps.items():
            if step is None:
                continue
            columns: dict[int, int] = {}
            for x in (g, *step.inners):
                for i, ax in where[x]:
                    r = self.piece_rank[i]
                    columns[r] = columns.get(r, 0) + _numel(self.pieces[i].shape) // max(self.pieces[i].shape[ax], 1)
            for i in step.pieces:
                columns.setdefault(self.piece_rank[i], 0)
            self.participants[g] = sorted(columns) or [0]
            self.solver[g] = min(columns, key=lambda r: (-columns[r], r)) if columns else 0
            for moved in step.moves:
                self.home[moved] = self.solver[g]
        work = Work()
        self.products = Products(dtype, self.product_dtype, work)
        matched = sum(sb[k].numel() * sb[k].element_size() for k in self.local_keys)
        self.cache = CostCache(max(int(COST_BUDGET_FRACTION * matched), COST_BUDGET_MIN))
        self.groups = {
            g: GroupSimilarity(g, n, [Term(ax, self.pieces[i].labels, self.a_views[i], self.b_views[i], work)
                                      for i, ax in where[g] if i in self.a_views], self.products, self.device)
            for g, n in spec.sizes.items()
        }  # fmt: skip
        self.assigners: dict[str, WarmAssigner] = {}  # the solver's, for groups whose terms are on several ranks
        self.buffers: dict[Any, torch.Tensor] = {}
        self.seconds = {"similarity": 0.0, "assignment": 0.0}  # this rank's time in products and in solves
        self.cpu_fallback = self.device.type == "cuda" and not pyperm.cuda_available()

    def step_keys(self, g: str) -> set[str]:
        """The entries the step of ``g`` reads or changes."""
        step = self.steps[g]
        pieces = {i for x in (g, *step.inners) for i, _ in self.where[x]} | set(step.pieces)
        return {self.pieces[i].key for i in pieces}

    # ------------------------------------------------------------------ one step

    def visit(self, g: str, perms: dict[Any, torch.Tensor], tol: float) -> float | None:
        """Take part in the step of group ``g``: the objective's gain at the solver when it moved
        something (None otherwise, and on the other ranks)."""
        step = self.steps[g]
        members, solver = self.participants[g], self.solver[g]
        others = [r for r in members if r != self.rank]
        chan = self.chan
        reads = (g, *step.inners)
        stale = any(self.groups[x].stale for x in reads)
        # Whether to solve at all: stale anywhere (a neighbour moved since the last visit).
        if self.rank != solver:
            chan.send(torch.tensor([int(stale)]), solver)
            if not chan.recv((1,), torch.int64, solver).item():
                return None
        else:
            for r in others:
                stale |= bool(chan.recv((1,), torch.int64, r).item())
            for r in others:
                chan.send(torch.tensor([int(stale)]), r)
            if not stale:
                return None
        for x in reads:
            self.groups[x].stale = False
        self.cache.next_step()
        if self.rank != solver:
            for x in reads:
                if self.groups[x].all_terms:
                    chan.send(self._part(x, perms), solver)
            self._follow(step, solver, perms)
            return None
        return self._solve(step, others, perms, tol)

    def _part(self, x: str, perms: Mapping[Any, torch.Tensor]) -> torch.Tensor:
        started = time.perf_counter()
        cost = self.groups[x].negated_similarity(perms, self.cache)
        self.seconds["similarity"] += time.perf_counter() - started
        return cost

    def _whole(self, x: str, slot: int, others: list[int], perms: Mapping[Any, torch.Tensor]) -> _Whole:
        """Group ``x``'s whole similarity at the solver: its own part plus the others'."""
        group = self.groups[x]
        senders = [r for r in others if r in self.term_ranks[x]]
        if not senders:  # all here: exactly as in one process (the group's own solver state)
            return _Whole(self._part(x, perms), group.assigner, bool(self.term_ranks[x]))
        n = group.n
        # Small groups keep their buffer (an incremental solver stays bound to it); large ones share scratch.
        key = x if n <= INCREMENTAL_UP_TO else (slot, n)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty((n, n), dtype=self.dtype, device=self.device)
        if group.all_terms:
            buf.copy_(self._part(x, perms))
        else:
            buf.zero_()
        for r in senders:
            buf += self.chan.recv((n, n), self.dtype, r).to(self.device)
        return _Whole(buf, self.assigners.setdefault(x, WarmAssigner(incremental_up_to=INCREMENTAL_UP_TO)), True)

    def _solve(self, step: Any, others: list[int], perms: dict[Any, torch.Tensor], tol: float) -> float | None:
        wholes = {x: self._whole(x, j, others, perms) for j, x in enumerate((step.group, *step.inners))}
        for x, whole in wholes.items():  # checked here whatever the bound: the parts came from other ranks
            if whole.has_terms:
                check_finite_cost(x, whole.cost, self.dtype, self.product_dtype)
        if step.inners:
            own = wholes[step.group]
            own_cost = own.cost if not step.fixed and own.has_terms else None
            proposal, old_val, new_val = blocks_step(self.spec, step, {d: wholes[d].cost for d in step.inners},
                                                     own_cost, perms, cpu_fallback=self.cpu_fallback,
                                                     seconds=self.seconds)  # fmt: skip
        else:
            whole = wholes[step.group]
            proposal, old_val, new_val = plain_step(step, whole.cost, whole.assigner, perms,
                                                    cpu_fallback=self.cpu_fallback, seconds=self.seconds)  # fmt: skip
        if self.device.type == "cpu":
            release_free_memory()
        if proposal is not None and step.quadratic:  # the similarity was a linearisation: the exact change
            for r in others:
                self.chan.send(torch.tensor([_EVALUATE]), r)
                self._send_perms(step, proposal, r)
            old_val, new_val = self._exact(step, perms, proposal)
            for r in others:
                old_r, new_r = self.chan.recv_values(2, r)
                old_val, new_val = old_val + old_r, new_val + new_r
        gain = new_val - old_val
        take = proposal is not None and gain > tol * max(abs(old_val), abs(new_val))
        for r in others:
            self.chan.send(torch.tensor([_TAKE if take else _KEEP]), r)
            if take and not step.quadratic:
                self._send_perms(step, proposal, r)
        if not take:
            return None
        self._take(perms, proposal)
        return gain

    def _follow(self, step: Any, solver: int, perms: dict[Any, torch.Tensor]) -> None:
        """A participant's side of the outcome: evaluate a proposal, then take it or not."""
        code = self.chan.recv((1,), torch.int64, solver).item()
        proposal = None
        if code == _EVALUATE:
            proposal = self._recv_perms(step, solver)
            self.chan.send_values(list(self._exact(step, perms, proposal)), solver)
            code = self.chan.recv((1,), torch.int64, solver).item()
            if code == _TAKE:
                self._take(perms, proposal)
            return
        if code == _TAKE:
            self._take(perms, self._recv_perms(step, solver))

    def _send_perms(self, step: Any, proposal: Mapping[str, torch.Tensor], dst: int) -> None:
        for h in step.moves:  # a proposal names exactly the step's moves
            self.chan.send(proposal[h], dst)

    def _recv_perms(self, step: Any, src: int) -> dict[str, torch.Tensor]:
        return {h: self.chan.recv((self.spec.sizes[h],), torch.int64, src).to(self.device) for h in step.moves}

    def _take(self, perms: dict[Any, torch.Tensor], proposal: Mapping[str, torch.Tensor]) -> None:
        self._update(perms, proposal)
        for moved in proposal:
            for other in self.dependents[moved]:
                self.groups[other].stale = True

    def _update(self, perms: dict[Any, torch.Tensor], proposal: Mapping[str, torch.Tensor]) -> None:
        perms.update(proposal)
        for form in self.forms:
            if not set(form.groups()).isdisjoint(proposal):
                perms[form] = blocks_index(form, perms)

    def _exact(self, step: Any, perms: Mapping[Any, torch.Tensor], proposal: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        """This rank's part of the objective over the step's pieces, at the current and the proposed permutations."""
        trial = dict(perms)
        self._update(trial, proposal)
        old = new = 0.0
        for i in step.pieces:
            if i in self.a_views:
                old += piece_dot(self.pieces[i], self.a_views[i], self.b_views[i], perms)
                new += piece_dot(self.pieces[i], self.a_views[i], self.b_views[i], trial)
        return old, new


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
