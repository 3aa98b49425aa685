"""The fast weight matcher: Git Re-Basin's Algorithm 1 on any spec, reusing all it can between matches.

The spec is lowered to plain tensor pieces (:mod:`pyperm.nn.align._pieces`), so every axis form
takes the same incremental similarity products (:mod:`pyperm.nn.align._similarity`). A visit of a
group is one of three steps:

- a plain group: one assignment of its similarity;
- the outer group of :class:`~pyperm.nn.spec.Blocks` forms (attention heads, the groups of a
  grouped convolution) moves with its inner groups: for every inner group and every pair
  (block ``i`` of A, block ``j`` of B) the units of the two blocks are paired by an assignment
  (all ``nb * nb`` of them in one batched solve); their values, summed over the inner groups and
  added to the outer group's own similarity, are the outer assignment's similarity, and each
  block keeps the inner assignment of the pair it ends in (an assignment of assignments);
- the inner group of blocks that stay in place: one batched solve over its blocks.

A step is taken only when it raises the objective. The gain is read off the similarities,
except where a group acts on two axes of one tensor (``P W P^T``): the objective is then
quadratic in it, the step solves its linearisation at the current permutation, and the gain
is computed exactly from the tensors it touches, so the objective never decreases.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

import pyperm
from pyperm._checks import callback_stops, check_callable, check_int, check_nonnegative_real, torch_generator
from pyperm._gather import index_select
from pyperm._memory import release_free_memory
from pyperm._progress import progress_bar
from pyperm.lap.warm import WarmAssigner
from pyperm.nn._checks import check_spec
from pyperm.nn.align._objective import (
    WeightMatchingResult,
    _check_dtype,
    _check_state,
    _objective,
    _objective_keys,
)
from pyperm.nn.align._pieces import Piece, blocks_index, inner_of_pairs, label_groups, lower
from pyperm.nn.align._similarity import (
    CostCache,
    GroupSimilarity,
    Products,
    Term,
    Work,
    accurate_dot,
    frobenius_norm,
)
from pyperm.nn.permutations import Permutations, as_permutations
from pyperm.nn.spec import Blocks, PermutationSpec

__all__ = ["Step", "WeightMatcher", "blocks_step", "check_finite_cost", "piece_dot", "plain_step", "plan_steps",
           "similarity_product_dtype"]

logger = logging.getLogger(__name__)

# The similarity matrices kept between visits take at most this fraction of model B's matched
# bytes, or COST_BUDGET_MIN bytes when that is more (small models keep all of theirs).
COST_BUDGET_FRACTION = 0.4
COST_BUDGET_MIN = 64 << 20
# A match whose largest similarity (n x n, summed over its terms' columns) takes fewer multiply-adds than
# this runs on one torch thread: starting and joining threads then costs more than the products they
# would share, and on a busy machine the threads also wait for each other at every small operation.
SERIAL_BELOW = 1 << 26
# Within a sweep, the free pages are also returned after a visit once this many seconds of visits
# have passed since the last return: a long sweep (Stable Diffusion's UNet, minutes over 637 groups)
# otherwise keeps a sweep's worth of freed temporaries resident, 0.1x the model at its peak; a short
# sweep (every model of a second or less) is trimmed once, at its end, as before.
TRIM_SECONDS = 1.0


def _serial_if_small(groups: Iterable[Any], device: torch.device) -> int | None:
    """Sets one torch thread on the CPU when every group's similarity is small (below SERIAL_BELOW
    multiply-adds); returns the thread count to restore afterwards, or None when nothing changed."""
    work = max((g.n * g.n * sum(t.columns for t in g.all_terms) for g in groups), default=0)
    before = torch.get_num_threads()
    if device.type != "cpu" or before == 1 or work >= SERIAL_BELOW:
        return None
    torch.set_num_threads(1)
    return before


def similarity_product_dtype(product_dtype: Any, dtype: torch.dtype, tensors: list[torch.Tensor]) -> torch.dtype:
    """The dtype of the similarity products: as asked, else bfloat16 for a bfloat16 model (the
    hardware's float32 accumulation), else the similarity's own."""
    if product_dtype is None:
        floats = {t.dtype for t in tensors if t.is_floating_point()}
        return torch.bfloat16 if floats == {torch.bfloat16} and dtype == torch.float32 else dtype
    if product_dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise TypeError(f"product_dtype must be None or a floating-point torch.dtype, got {product_dtype!r}")
    return product_dtype


@dataclass(frozen=True)
class Step:
    """What a visit of one group does.

    ``moves``: the groups it may change (a Blocks outer group with its inner groups);
    ``inners``: the Blocks inner groups it solves as an assignment of assignments (``fixed``:
    their blocks stay in place); ``pieces``: the pieces whose value it changes; ``quadratic``:
    whether one of them carries its groups on two axes (the gain is then computed exactly).
    """

    group: str
    moves: tuple[str, ...]
    inners: tuple[str, ...]
    fixed: bool
    pieces: tuple[int, ...]
    quadratic: bool


def plan_steps(spec: PermutationSpec, pieces: list[Piece]) -> dict[str, Step | None]:
    """Every group's step; None for a Blocks inner group, which moves with its outer group."""
    inners_of: dict[str, list[str]] = {}
    for inner, outer in spec.blocks.items():
        if isinstance(outer, str):
            inners_of.setdefault(outer, []).append(inner)
    steps: dict[str, Step | None] = {}
    # The groups of each axis of each piece, read once (ResNet50: 37 groups x 320 pieces).
    axis_groups = [[set(label_groups(label)) for label in p.labels] for p in pieces]
    for g in spec.sizes:
        fixed = g in spec.blocks and not isinstance(spec.blocks[g], str)
        if g in spec.blocks and not fixed:
            steps[g] = None
            continue
        inners = (g,) if fixed else tuple(inners_of.get(g, ()))
        moves = (g,) if fixed else (g, *inners)
        moved = set(moves)
        per_piece = [sum(1 for groups in axes if groups & moved) for axes in axis_groups]
        touched = tuple(i for i, k in enumerate(per_piece) if k)
        steps[g] = Step(g, moves, inners, fixed, touched, any(k > 1 for k in per_piece))
    return steps


class WeightMatcher:
    """Weight matching of any number of models A against one model B, reusing all it can.

    Holds views of B's tensors, the similarity matrices (within a byte budget) and
    every group's warm-started assignment solver. :meth:`match` takes a new A and runs
    Algorithm 1 from the given permutations; between calls with nearby A's (the free
    weights of successive STE steps, the mean of the other models in ``merge_many``) the
    solvers start from the previous answer, so a match costs about one sweep of
    similarity products. :func:`~pyperm.nn.weight_matching` is one match of a fresh matcher
    (or two, from two starts). Every spec form is handled (see the module notes).

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups.
    state_b : mapping of str to torch.Tensor
        The model to be permuted: the spec's keys, finite values, one device.
    keys : iterable of str, optional
        The entries that enter the objective (default: every floating-point entry).
    dtype : torch.dtype, default torch.float32
        Precision of the similarity matrices.
    product_dtype : torch.dtype, optional
        The dtype the similarity products run in (see :func:`~pyperm.nn.weight_matching`).
    trim_memory : bool, default True
        On the CPU, return the allocator's free pages to the system after every sweep
        (glibc ``malloc_trim``), so that the sweeps' freed temporaries do not stay resident
        over a long run. (After every group visit, as it once was, the next visit faulted
        its temporaries' pages in again: GPT-2 124M's first bfloat16 sweep took 1.93x the
        products' floor that way, 1.77x now; the peak memory of a 1.1B Llama's run is the
        same.) A caller that frees much memory of its own between matches passes
        False: a trim would return that too, to be faulted in again (STE matching's
        training steps on ResNet20x4: a trim took 38 ms and the next forward and backward
        pass 10% longer).

    Notes
    -----
    Memory: the tensors are read where they are stored (views; blocks of
    ``BLOCK_BYTES`` (32 MiB) gathered and arranged into reused work buffers), and the
    similarity matrices kept between visits (so that a visit only corrects them) are held
    within :data:`COST_BUDGET_FRACTION` of model B's matched bytes (at least
    :data:`COST_BUDGET_MIN` bytes); beyond it the least recently used one is rebuilt at its
    next visit.
    """

    def __init__(
        self,
        spec: PermutationSpec,
        state_b: Mapping[str, torch.Tensor],
        *,
        keys: Iterable[str] | None = None,
        dtype: torch.dtype = torch.float32,
        product_dtype: torch.dtype | None = None,
        trim_memory: bool = True,
    ) -> None:
        self.spec = check_spec(spec)
        self.trim_memory = bool(trim_memory)
        self.dtype = _check_dtype(dtype)
        self.state_b = _check_state(spec, state_b, "state_b")
        self.keys = _objective_keys(spec, self.state_b, keys)
        devices = {self.state_b[k].device for k in self.keys}
        if len(devices) > 1:
            raise ValueError(f"state_b must be on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.product_dtype = similarity_product_dtype(product_dtype, self.dtype, [self.state_b[k] for k in self.keys])
        self._work = Work()
        self._products = Products(self.dtype, self.product_dtype, self._work)
        matched = sum(self.state_b[k].numel() * self.state_b[k].element_size() for k in self.keys)
        self._cache = CostCache(max(int(COST_BUDGET_FRACTION * matched), COST_BUDGET_MIN), self._work)
        self._pieces = lower(spec, {k: tuple(self.state_b[k].shape) for k in self.keys}, self.keys)
        self._b_views = [p.of(self.state_b[p.key]) for p in self._pieces]
        # Where each group's similarity is read: the axes it labels; a Blocks inner group's are
        # the axes of its form (read unpermuted there, for the assignment of assignments).
        self._where: dict[str, list[tuple[int, int]]] = {g: [] for g in spec.sizes}
        for i, p in enumerate(self._pieces):
            for ax, label in enumerate(p.labels):
                if isinstance(label, str):
                    self._where[label].append((i, ax))
                elif isinstance(label, Blocks):
                    self._where[label.inner].append((i, ax))
        self._forms = list(dict.fromkeys(label for p in self._pieces for label in p.labels if isinstance(label, Blocks)))
        self._steps = plan_steps(spec, self._pieces)
        # The similarities that read each group's permutation (through another axis of their pieces).
        self._dependents: dict[str, list[str]] = {g: [] for g in spec.sizes}
        for g, where in self._where.items():
            reads = {h for i, ax in where for a, label in enumerate(self._pieces[i].labels) if a != ax
                     for h in label_groups(label)}  # fmt: skip
            for h in reads:
                self._dependents[h].append(g)
        self._norms_b: dict[str, float] | None = None  # ||B|| of the grouped entries (overflow bounds)
        self._groups: dict[str, GroupSimilarity] | None = None  # built at the first match (they need an A)
        self._a_views: list[torch.Tensor] | None = None
        self._state_a: Mapping[str, torch.Tensor] = {}
        self._seconds = {"similarity": 0.0, "assignment": 0.0}

    def _arrange(self, sa: Mapping[str, torch.Tensor]) -> dict[str, GroupSimilarity]:
        """Every group's similarity state for a new A (built once, then re-pointed at each A)."""
        spec, dtype = self.spec, self.dtype
        self._state_a, self._a_views = sa, None
        if self._groups is None:
            self._groups = {}
            # Arranged copies of the tensors that cannot be read as matrices take only what the
            # budget has left once every similarity fits (VGG16-BN: all of them, 1.22 s -> 0.8 s).
            size = torch.empty((), dtype=dtype).element_size()
            self._cache.reserve = sum(n * n * size for n in spec.sizes.values())
            for g, n in spec.sizes.items():
                terms = [
                    Term(ax, self._pieces[i].labels, self._pieces[i].of(sa[self._pieces[i].key]),
                         self._b_views[i], self._work)
                    for i, ax in self._where[g]
                ]  # fmt: skip
                self._groups[g] = GroupSimilarity(g, n, terms, self._products, self.device)
        else:
            for g, group in self._groups.items():
                for t, (i, _) in zip(group.all_terms, self._where[g]):
                    t.set_a(self._pieces[i].of(sa[self._pieces[i].key]))
                group.a_changed()
        keys_of = {g: [self._pieces[i].key for i, _ in where] for g, where in self._where.items()}
        if self._norms_b is None:
            self._norms_b = {k: frobenius_norm(self.state_b[k]) for ks in keys_of.values() for k in ks}
        # The products may run in a narrower dtype than the similarity (float16: 65504): its range bounds them.
        largest = min(torch.finfo(dtype).max, torch.finfo(self.product_dtype).max)
        norms_a = {k: frobenius_norm(sa[k]) for k in self._norms_b}
        # The finiteness check of every entry the similarities read, at no extra pass (a match that
        # skips the objective has no other): a NaN or infinity makes the norm non-finite.
        for name, state, norms in (("state_a", sa, norms_a), ("state_b", self.state_b, self._norms_b)):
            for k, norm in norms.items():
                if not math.isfinite(norm) and not bool(torch.isfinite(state[k]).all()):
                    raise ValueError(f"{name}[{k!r}] contains NaN or infinite values")
        for g, group in self._groups.items():
            # By Cauchy-Schwarz no similarity entry (nor partial sum) exceeds this bound: below
            # it, the matrices need no finiteness check (an outer group's sums are float64).
            bound = sum(norms_a[k] * self._norms_b[k] for k in keys_of[g])
            group.may_overflow = not bound < largest / 2
        return self._groups

    def match(
        self,
        state_a: Mapping[str, torch.Tensor],
        *,
        init: Permutations | Mapping[str, Any] | None = None,
        max_iter: int = 100,
        seed: int | torch.Generator = 0,
        tol: float = 1e-12,
        progress: bool = False,
        callback: Callable[[int, Mapping[str, torch.Tensor], float], bool | None] | None = None,
        objective: bool = True,
    ) -> WeightMatchingResult:
        """Permutations of B maximising its match with ``state_a`` (see :func:`~pyperm.nn.weight_matching`).

        ``objective=False`` skips computing the objective at the start (a pass over both models,
        gathers of B included): the result's ``objective`` history (and the value the callback and
        the progress bar see) then starts at 0 and holds the gains since the start. The
        permutations are the same; for callers that need only them (the projections of STE
        matching).
        """
        spec = self.spec
        max_iter = check_int(max_iter, "max_iter", 0)
        tol = check_nonnegative_real(tol, "tol")
        check_callable(callback, "callback", allow_none=True)
        gen = torch_generator(seed)
        sa = _check_state(spec, state_a, "state_a")
        devices = {sa[k].device for k in self.keys} | ({self.device} if self.keys else set())
        if len(devices) > 1:
            raise ValueError(f"state_a and state_b must be on one device, found {sorted(map(str, devices))}")
        device = self.device
        start = as_permutations(spec, init, "init") if init is not None else spec.identity()
        perms: dict[Any, torch.Tensor] = {g: p.to(device) for g, p in start.items()}
        for form in self._forms:  # the whole index of every Blocks axis, as other groups see it
            perms[form] = blocks_index(form, perms)
        if objective:  # validates shapes and finiteness of every matched entry in the same pass
            value = _objective(spec, sa, self.state_b, {g: perms[g] for g in spec.sizes}, self.keys)
        else:  # shapes here; the finiteness of what the similarities read in _arrange
            value = 0.0
            for k in self.keys:
                if sa[k].shape != self.state_b[k].shape:
                    raise ValueError(f"state_a[{k!r}] has shape {tuple(sa[k].shape)} but state_b has "
                                     f"{tuple(self.state_b[k].shape)}")
        objective = value
        groups = self._arrange(sa)
        cpu_fallback = device.type == "cuda" and not pyperm.cuda_available()
        if cpu_fallback:
            warnings.warn(
                "weight_matching: pyperm's CUDA solvers are not available, so the assignments of these CUDA "
                "tensors are solved on the CPU (slower); see pyperm.cuda_available()",
                UserWarning,
                stacklevel=3,
            )
        # Every group is visited (in the seeded order), even one whose similarity is all zero:
        # its assignment then changes nothing, and the visiting order matches the reference
        # implementations' for a given seed.
        names = list(spec.sizes)
        history = [objective]
        self._seconds = {"similarity": 0.0, "assignment": 0.0}
        started = time.perf_counter()
        bar = progress_bar(progress, max_iter, "weight matching", "sweep")
        converged = False
        sweeps = 0
        restore = _serial_if_small(groups.values(), device)
        trim = self.trim_memory and device.type == "cpu"
        trimmed = time.perf_counter()
        try:
            for _ in range(max_iter):
                sweeps += 1
                improved = False
                order = [names[i] for i in torch.randperm(len(names), generator=gen).tolist()] if names else []
                for g in order:
                    step = self._steps[g]
                    reads = (g, *step.inners) if step is not None else ()
                    if step is None or not any(groups[x].stale for x in reads):
                        continue  # moved with its outer group, or no neighbour moved: the same answer
                    for x in reads:
                        groups[x].stale = False
                    if trim and time.perf_counter() - trimmed >= TRIM_SECONDS:
                        release_free_memory()  # the last visits' temporaries (see TRIM_SECONDS)
                        trimmed = time.perf_counter()
                    self._cache.next_step()
                    if step.inners:
                        proposal, old_val, new_val = self._blocks_step(step, groups, perms, cpu_fallback)
                    else:
                        proposal, old_val, new_val = self._plain_step(step, groups[g], perms, cpu_fallback)
                    if proposal is None:
                        continue
                    if step.quadratic:  # the similarity was a linearisation: the exact change
                        old_val, new_val = self._exact_values(step, perms, proposal)
                    gain = new_val - old_val
                    if gain <= tol * max(abs(old_val), abs(new_val)):
                        continue  # a tie, or rounding: keep the current permutations
                    self._update(perms, proposal)
                    objective += gain
                    improved = True
                    for moved in proposal:
                        for other in self._dependents[moved]:
                            groups[other].stale = True
                history.append(objective)
                if trim:
                    release_free_memory()  # the sweep's temporaries, freed, are not kept resident
                    trimmed = time.perf_counter()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(objective=f"{objective:.6g}")
                stop = callback is not None and callback_stops(callback(sweeps, {g: perms[g] for g in names}, objective))
                if not improved:
                    converged = True
                    break
                if stop:
                    break
        finally:
            if bar is not None:
                bar.close()
            if restore is not None:
                torch.set_num_threads(restore)
        logger.debug("weight_matching: %d sweeps, converged=%s, objective %.6g", sweeps, converged, history[-1])
        return WeightMatchingResult(
            perms=Permutations(spec, {g: perms[g].cpu() for g in names}),
            objective=history,
            iterations=sweeps,
            converged=converged,
            seconds={**self._seconds, "total": time.perf_counter() - started},
        )

    def release_a(self) -> None:
        """Lets go of the last model A (the tensors :meth:`match` was given; its held arranged copies stay,
        the matcher's own): between matches of a new A each (MergeMany's rounds) they would stay alive
        until the next match, a whole model per matcher. The next match rebuilds every similarity, as
        for any new A."""
        self._state_a, self._a_views = {}, None
        for group in (self._groups or {}).values():
            group.a_changed()
            for t in group.all_terms:
                t.release_a()

    def release_similarities(self) -> None:
        """Frees the kept similarity matrices (up to the cost budget; each is rebuilt, and its group's
        solver starts cold, at its next visit), and returns the free pages to the system."""
        self._cache.release()
        release_free_memory()

    def _update(self, perms: dict[Any, torch.Tensor], proposal: Mapping[str, torch.Tensor]) -> None:
        """Takes the proposal's permutations, and the Blocks indices made of them."""
        perms.update(proposal)
        for form in self._forms:
            if not set(form.groups()).isdisjoint(proposal):
                perms[form] = blocks_index(form, perms)

    def _cost(self, group: GroupSimilarity, perms: Mapping[Any, torch.Tensor]) -> torch.Tensor:
        """Minus the group's similarity at the current permutations, checked for overflow."""
        started = time.perf_counter()
        cost = group.negated_similarity(perms, self._cache)
        self._seconds["similarity"] += time.perf_counter() - started
        if group.may_overflow:
            check_finite_cost(group.name, cost, self.dtype, self.product_dtype)
        return cost

    def _plain_step(
        self, step: Step, group: GroupSimilarity, perms: Mapping[Any, torch.Tensor], cpu_fallback: bool
    ) -> tuple[dict[str, torch.Tensor] | None, float, float]:
        cost = self._cost(group, perms)
        return plain_step(step, cost, group.assigner, perms, cpu_fallback=cpu_fallback, seconds=self._seconds)

    def _blocks_step(
        self, step: Step, groups: Mapping[str, GroupSimilarity], perms: Mapping[Any, torch.Tensor], cpu_fallback: bool
    ) -> tuple[dict[str, torch.Tensor] | None, float, float]:
        costs = {d: self._cost(groups[d], perms) for d in step.inners}
        own = groups[step.group]
        own_cost = self._cost(own, perms) if not step.fixed and own.all_terms else None
        return blocks_step(self.spec, step, costs, own_cost, perms, cpu_fallback=cpu_fallback, seconds=self._seconds)

    def _exact_values(
        self, step: Step, perms: Mapping[Any, torch.Tensor], proposal: Mapping[str, torch.Tensor]
    ) -> tuple[float, float]:
        """The objective's part from the pieces the step changes, at the current and the proposed permutations."""
        if self._a_views is None:
            self._a_views = [p.of(self._state_a[p.key]) for p in self._pieces]
        trial = dict(perms)
        self._update(trial, proposal)
        old = new = 0.0
        for i in step.pieces:
            old += piece_dot(self._pieces[i], self._a_views[i], self._b_views[i], perms)
            new += piece_dot(self._pieces[i], self._a_views[i], self._b_views[i], trial)
        return old, new


def check_finite_cost(name: str, cost: torch.Tensor, dtype: torch.dtype, product_dtype: torch.dtype) -> None:
    """Raise unless group ``name``'s cost (minus its similarity) is finite: an overflow of ``dtype``."""
    if not bool(torch.isfinite(cost).all()):
        products = f" (products in {product_dtype})" if product_dtype != dtype else ""
        raise ValueError(
            f"the similarity matrix of group {name!r} is not finite: the weights are too large "
            f"for {dtype}{products}; rescale them or pass dtype=torch.float64"
        )


# A step's outcome: the proposed permutations (None: nothing moves), and the similarity's values at
# the current and the proposed permutations (the gain is their difference).
StepOutcome = tuple[dict[str, torch.Tensor] | None, float, float]


def plain_step(step: Step, cost: torch.Tensor, assigner: WarmAssigner, perms: Mapping[Any, torch.Tensor], *,
               cpu_fallback: bool, seconds: dict[str, float]) -> StepOutcome:  # fmt: skip
    """The best permutation of a plain group, the others held.

    ``cost`` is minus the group's whole similarity at ``perms`` (checked finite by the caller),
    solved by ``assigner`` (warm; bound to ``cost`` when small), or cold on the CPU with
    ``cpu_fallback``. The solve's time is added to ``seconds["assignment"]``. Shared by
    :class:`WeightMatcher` and the solver rank of weight matching over ranks.
    """
    started = time.perf_counter()
    new = pyperm.linear_sum_assignment(cost.cpu())[1].to(cost.device) if cpu_fallback else assigner.solve(cost)
    seconds["assignment"] += time.perf_counter() - started
    old = perms[step.group]
    if torch.equal(new, old):
        return None, 0.0, 0.0
    # The similarity is minus the cost.
    old_val = -float(cost.gather(1, old[:, None]).double().sum())
    new_val = -float(cost.gather(1, new[:, None]).double().sum())
    return {step.group: new}, old_val, new_val


def blocks_step(spec: PermutationSpec, step: Step, costs: Mapping[str, torch.Tensor], own_cost: torch.Tensor | None,
                perms: Mapping[Any, torch.Tensor], *, cpu_fallback: bool,
                seconds: dict[str, float]) -> StepOutcome:  # fmt: skip
    """The best outer permutation and inner permutations of a Blocks outer group (or of blocks that
    stay in place), the other groups held: an assignment of assignments.

    ``costs``: minus the whole similarity of each inner group (``step.inners``) at ``perms``;
    ``own_cost``: minus the outer group's own similarity, None when it has none (or the blocks
    stay in place). Checked finite by the caller. Solves are cold (batched); their time is
    added to ``seconds["assignment"]``.
    """
    nb = spec.num_blocks(step.inners[0])
    device = next(iter(costs.values())).device
    outer_cost = None
    if not step.fixed:
        # A float64 copy: the sums below must not touch the group's own cost, which it keeps.
        outer_cost = torch.zeros(nb, nb, dtype=torch.float64, device=device)
        if own_cost is not None:
            outer_cost += own_cost
    pairs = {}
    for d, cost in costs.items():
        bs = spec.block_size(d)
        blocks = cost.view(nb, bs, nb, bs)
        if step.fixed:  # block i with block i only
            stack = blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()
        else:  # (A block i, B block j) -> the (bs, bs) cost of pairing their units
            stack = blocks.permute(0, 2, 1, 3).reshape(nb * nb, bs, bs).contiguous()
        started = time.perf_counter()
        cols = _batch_assign(stack, cpu_fallback)
        seconds["assignment"] += time.perf_counter() - started
        if step.fixed:
            pairs[d] = cols
        else:
            outer_cost += stack.gather(2, cols.unsqueeze(2)).double().sum((1, 2)).view(nb, nb)
            pairs[d] = cols.view(nb, nb, bs)
    if step.fixed:
        new_outer = torch.arange(nb, device=device)
        proposal = {d: inner_of_pairs(new_outer, cols) for d, cols in pairs.items()}
    else:
        started = time.perf_counter()
        new_outer = _assign(outer_cost, cpu_fallback)
        seconds["assignment"] += time.perf_counter() - started
        rows = torch.arange(nb, device=device)
        proposal = {step.group: new_outer}
        proposal |= {d: inner_of_pairs(new_outer, cols[rows, new_outer]) for d, cols in pairs.items()}
    if all(torch.equal(p, perms[h]) for h, p in proposal.items()):
        return None, 0.0, 0.0

    def value(chosen: Mapping[str, torch.Tensor]) -> float:
        outer = chosen[step.group] if not step.fixed else new_outer
        total = 0.0
        if own_cost is not None and not step.fixed:
            total -= float(own_cost.gather(1, outer[:, None]).double().sum())
        for d, cost in costs.items():
            index = chosen[d].view(nb, -1)[outer].reshape(-1)
            total -= float(cost.gather(1, index[:, None]).double().sum())
        return total

    return proposal, value(perms), value(proposal)


def piece_dot(piece: Piece, a: torch.Tensor, b: torch.Tensor, perms: Mapping[Any, torch.Tensor]) -> float:
    """``sum(a * pi(b))`` of one piece."""
    for ax, label in enumerate(piece.labels):
        if label is not None:
            b = index_select(b, ax, perms[label])
    return accurate_dot(a, b)


def _assign(cost: torch.Tensor, cpu_fallback: bool) -> torch.Tensor:
    """The minimising assignment of one cost, on its device."""
    if cpu_fallback:
        return pyperm.linear_sum_assignment(cost.cpu())[1].to(cost.device)
    return pyperm.linear_sum_assignment(cost)[1]


def _batch_assign(stack: torch.Tensor, cpu_fallback: bool) -> torch.Tensor:
    """The minimising assignments of a (B, n, n) stack, on its device."""
    if cpu_fallback:
        return pyperm.batch_linear_sum_assignment(stack.cpu())[1].to(stack.device)
    return pyperm.batch_linear_sum_assignment(stack)[1]
