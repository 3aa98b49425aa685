r"""Weight matching with the pair's tensors split over the ranks of a torch.distributed group.

Each rank holds a share of A's and B's state dicts (any partition of the spec's keys: a range of
layers, the shards of a checkpoint). Each group's similarity (Git Re-Basin eq. 2) is a sum over
the tensors the group acts on, so each rank computes the part of its own tensors, and the *solver*
of the group (the rank holding most of its columns) adds the parts, solves the assignment and
sends the outcome to the ranks that read that permutation. Nothing else moves: a group whose
tensors all live on one rank is solved there without a message, and no tensor of the pair ever
leaves its rank. Memory per rank: its share, its parts of the similarities (held within the
matcher's budget), and at the solver one whole similarity at a time (a few for a
:class:`~pyperm.nn.spec.Blocks` step).

Every rank walks the same seeded visiting order as :func:`pyperm.nn.weight_matching` and takes
part in the steps that read its tensors; steps with disjoint sets of ranks run at the same time
by themselves. Each step sees the permutations it would see in one process, so the
permutations equal one process's for the same seed and start, and the objective equals it up to
the order of summation, except where a step is within rounding of a tie (dead or duplicate units):
the parts are summed in another order and the solvers start from other warm states, so such a step
can go the other way, as between two machines (tied units trade places; the objective and the
permuted model's function stay the same). ``init="best"`` does not look for an exact permuted copy
first, as one process does; the searches find it.

``concurrent=True`` visits each sweep's groups in *waves*: a group joins the first wave after
every earlier group (in the seeded order) that shares a tensor with it, so the groups of a wave
share no tensor and are solved at the same time on their ranks. This is a different visiting
order; since only groups that share no tensor (whose steps do not read each other's
permutations) trade places, it ends at the same permutations in exact arithmetic.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pyperm._checks import check_int, check_merge_weights, check_nonnegative_real, torch_generator
from pyperm._comm import Channel, check_same, shared_errors
from pyperm.nn.align._rank_layout import gather_layout
from pyperm.nn.align._rank_starts import signature_start_over_ranks, stalled_over_ranks
from pyperm.nn.align._ranks import RankMatcher
from pyperm.nn.align._starts import STARTS, _same_seed
from pyperm.nn._checks import check_spec
from pyperm.nn.align._pieces import blocks_index
from pyperm.nn.align._objective import WeightMatchingResult, _check_dtype, _objective, _objective_keys
from pyperm.nn.align.merge import MergeResult, align_many
from pyperm.nn.permutations import Permutations, as_permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["DistributedMatchingResult", "merge_many", "weight_matching"]


@dataclass
class DistributedMatchingResult(WeightMatchingResult):
    """:class:`~pyperm.nn.WeightMatchingResult` with what the ranks sent each other.

    Attributes
    ----------
    bytes_per_sweep : list of int
        Bytes sent by all ranks together in each sweep (similarity parts, permutations, flags,
        the sweep's sums); the final broadcast of the permutations is not in it.
    bytes_total : int
        Every byte the searches sent (with ``init="best"``, both searches'); the exchange of the
        layout and the signature start's cost parts are not counted.
    """

    bytes_per_sweep: list[int] = field(default_factory=list)
    bytes_total: int = 0


def weight_matching(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    *,
    group: Any = None,
    init: Mapping[str, Any] | str | None = "best",
    max_iter: int = 100,
    seed: int | torch.Generator = 0,
    keys: Iterable[str] | None = None,
    tol: float = 1e-12,
    dtype: torch.dtype = torch.float32,
    product_dtype: torch.dtype | None = None,
    concurrent: bool = False,
) -> DistributedMatchingResult:
    r"""Git Re-Basin's weight matching with the pair's tensors split over ranks (a collective).

    Every rank of ``group`` calls it with its own share of both models; every rank returns the
    same result. See the module notes for what is sent and when.

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups (the same on every rank).
    state_a, state_b : mapping of str to torch.Tensor
        This rank's share of each model: the same keys in both, each key on exactly one rank,
        every key of the spec on some rank; a rank may hold none. Tensors on the rank's device
        (the current CUDA device under NCCL).
    group : torch.distributed.ProcessGroup, optional
        The ranks (default: the world).
    init : {"best", "identity", "signatures"}, None, Permutations or mapping of str to (n,) int array, default "best"
        Where the search starts (the same on every rank), as :func:`pyperm.nn.weight_matching`. The
        signatures are computed where the tensors are and summed (see
        :mod:`pyperm.nn.align._rank_starts`); ``"best"`` tries the signatures start when the identity
        start looks stalled. One process's ``"best"`` first looks for an exact permuted copy; over
        ranks that test is not made (a copy is then found by the searches).
    max_iter, seed, keys, tol, dtype, product_dtype
        As :func:`pyperm.nn.weight_matching` (the same on every rank).
    concurrent : bool, default False
        Visit each sweep in waves of groups that share no tensor (a different visiting order;
        see the module notes).

    Returns
    -------
    DistributedMatchingResult
        As :func:`pyperm.nn.weight_matching`, plus the bytes sent per sweep.

    Raises
    ------
    RuntimeError
        torch.distributed is not initialised.
    TypeError, ValueError
        A bad argument (as :func:`pyperm.nn.weight_matching`), shares that overlap, miss a key of
        the spec or differ from it.
    """
    check_spec(spec)
    max_iter = check_int(max_iter, "max_iter", 0)
    tol = check_nonnegative_real(tol, "tol")
    dtype = _check_dtype(dtype)
    if not isinstance(concurrent, bool):
        raise TypeError(f"concurrent must be a bool, got {type(concurrent).__name__}")
    started = time.perf_counter()
    gen = torch_generator(seed)
    if isinstance(init, str) and init not in STARTS:
        raise ValueError(f"init must be one of {', '.join(map(repr, STARTS))}, permutations or None, got {init!r}")
    start = init if init is None or isinstance(init, str) else as_permutations(spec, init, "init")
    keys = keys if keys is None or isinstance(keys, str) else list(keys)  # read twice below
    chan = Channel(group)
    with shared_errors(chan, "weight matching"):
        check_same(chan, spec=_spec_facts(spec),
                   start=start if start is None or isinstance(start, str) else {g: p.tolist() for g, p in start.items()},
                   keys=keys if keys is None or isinstance(keys, str) else sorted(map(repr, keys)),
                   max_iter=max_iter, tol=tol, dtype=dtype, product_dtype=product_dtype, concurrent=concurrent,
                   seed=hashlib.sha256(gen.get_state().numpy().tobytes()).hexdigest())  # fmt: skip
        result = _search(spec, state_a, state_b, start, keys, dtype, product_dtype, chan, max_iter, tol, concurrent,
                         gen)  # fmt: skip
    result.seconds["total"] = time.perf_counter() - started  # the whole call, every start, as in one process
    return result


def _spec_facts(spec: PermutationSpec) -> list:
    """What must agree between the ranks' specs: every key's axes (their groups and forms) and every size."""
    return [sorted((k, repr(v)) for k, v in spec.axes.items()), sorted(spec.sizes.items())]


def _search(spec: PermutationSpec, state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor], start: Any,
            keys: Any, dtype: torch.dtype, product_dtype: Any, chan: Channel, max_iter: int, tol: float,
            concurrent: bool, gen: torch.Generator) -> DistributedMatchingResult:  # fmt: skip
    """The search from ``start`` (or the best of the identity and signatures starts) over the ranks."""
    sa, sb, layout = gather_layout(spec, state_a, state_b, chan)
    chosen = _objective_keys(spec, layout.meta, keys)
    run = _Run(spec, sa, sb, layout, chosen, dtype, product_dtype, chan, max_iter, tol, concurrent)
    if start == "signatures":
        result = run(signature_start_over_ranks(spec, sa, sb, layout.owner, set(chosen), chan), gen)
    elif start != "best":
        result = run(spec.identity() if start in (None, "identity") else start, gen)
    else:
        # As one process: the identity start, and the signatures start too when the first looks stalled (both
        # visit the groups in the same seeded orders); the better objective wins, the identity's on a tie. The
        # first run draws from ``gen`` itself, as the first matching of one process's merge_many does, so that
        # merge_many's later draws stay in step with it.
        again = _same_seed(gen)
        result = run(spec.identity(), gen)
        local = [k for k in chosen if layout.owner[k] == chan.rank]
        if stalled_over_ranks(spec, sa, sb, result.perms, local, chan):
            second = run(signature_start_over_ranks(spec, sa, sb, layout.owner, set(chosen), chan), again)
            total = result.bytes_total + second.bytes_total  # both searches' (bytes_per_sweep: the winner's)
            result = second if second.objective[-1] > result.objective[-1] else result
            result.bytes_total = total
    return result


class _Run:
    """Weight matching over the ranks from one start (a fresh matcher each time)."""

    def __init__(self, spec: PermutationSpec, sa: dict, sb: dict, layout: Any, chosen: list[str], dtype: torch.dtype,
                 product_dtype: Any, chan: Channel, max_iter: int, tol: float, concurrent: bool) -> None:  # fmt: skip
        self.spec, self.sa, self.sb, self.layout, self.chosen = spec, sa, sb, layout, chosen
        self.dtype, self.product_dtype, self.chan = dtype, product_dtype, chan
        self.max_iter, self.tol, self.concurrent = max_iter, tol, concurrent

    def __call__(self, start: Mapping[str, torch.Tensor], gen: torch.Generator) -> DistributedMatchingResult:
        spec, sa, sb, chan, tol = self.spec, self.sa, self.sb, self.chan, self.tol
        matcher = RankMatcher(spec, sa, sb, self.layout, self.chosen, self.dtype, self.product_dtype, chan)
        device = matcher.device
        # Copies: the steps and the final broadcast write into these, never into the caller's start.
        perms: dict[Any, torch.Tensor] = {g: p.to(device, torch.int64, copy=True) for g, p in start.items()}
        for form in matcher.forms:
            perms[form] = blocks_index(form, perms)
        local = _objective(spec, sa, sb, {g: perms[g] for g in spec.sizes}, matcher.local_keys)
        (objective,) = chan.all_reduce([local])
        chan.bytes_sent = 0
        history, per_sweep = [objective], []
        names = list(spec.sizes)
        started = time.perf_counter()
        converged = False
        sweeps = 0
        before = chan.bytes_sent
        for _ in range(self.max_iter):
            sweeps += 1
            order = [names[i] for i in torch.randperm(len(names), generator=gen).tolist()] if names else []
            if self.concurrent:
                order = _waves(matcher, order)
            gains, moved = 0.0, 0
            for g in order:
                if matcher.steps[g] is None or matcher.rank not in matcher.participants[g]:
                    continue  # moved with its outer group, or none of its tensors here
                gain = matcher.visit(g, perms, tol)
                if gain is not None:
                    gains += gain
                    moved += 1
            sent = chan.bytes_sent - before + 24  # with this rank's three sums below
            gains, moved, sent = chan.all_reduce([gains, float(moved), float(sent)])
            before = chan.bytes_sent
            objective += gains
            history.append(objective)
            per_sweep.append(int(sent))
            if not moved:
                converged = True
                break
        final = {}
        for g in names:  # every rank gets every permutation from the rank that solved it
            final[g] = chan.broadcast(perms[g].to(torch.int64), matcher.home.get(g, 0)).cpu()
        seconds = {**matcher.seconds, "total": time.perf_counter() - started}
        (total,) = chan.all_reduce([float(chan.bytes_sent)])
        return DistributedMatchingResult(
            perms=Permutations(spec, final),
            objective=history,
            iterations=sweeps,
            converged=converged,
            seconds=seconds,
            bytes_per_sweep=per_sweep,
            bytes_total=int(total),
        )


def merge_many(
    spec: PermutationSpec,
    states: Sequence[Mapping[str, torch.Tensor]],
    *,
    group: Any = None,
    weights: Sequence[float] | None = None,
    max_iter: int = 100,
    seed: int | torch.Generator = 0,
    progress: bool = False,
) -> MergeResult:
    """Git Re-Basin's MergeMany (:func:`pyperm.nn.merge_many`) with the models' tensors split over ranks.

    Every rank passes its share of every model (the same keys in each, as :func:`weight_matching`
    takes them). Each matching of a model to the mean of the others is a :func:`weight_matching`
    over the ranks from the model's permutations and from the identity (the better kept, as
    :func:`pyperm.nn.merge_many` does; from the identity, ``init="best"``: when that run looks
    stalled, a second runs from the signatures start), drawing its group orders from the same
    generator, so the rounds, the permutations and the merged model equal one process's
    ``merge_many`` for the same seed (up to summation order, and except where a step is within
    rounding of a tie, as :func:`weight_matching`; each matching starts a fresh matcher).

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups (the same on every rank).
    states : sequence of mapping of str to torch.Tensor
        This rank's share of each of at least two models: the same keys in every one, each key on
        exactly one rank, every key of the spec on some rank.
    group : torch.distributed.ProcessGroup, optional
        The ranks (default: the world).
    weights, max_iter, seed, progress
        As :func:`pyperm.nn.merge_many` (the same on every rank).

    Returns
    -------
    MergeResult
        As :func:`pyperm.nn.merge_many`, every rank the same permutations; ``merged`` is this rank's
        share of the merged model (its keys).

    Raises
    ------
    TypeError, ValueError
        ``states`` is not a sequence of at least two shares with the same keys, or a matching
        refuses its shares (see :func:`weight_matching`).
    """
    weights = check_shares(spec, states, weights)
    max_iter = check_int(max_iter, "max_iter", 1)
    gen = torch_generator(seed)
    keys = set(states[0])
    for i, state in enumerate(states):
        if not isinstance(state, Mapping) or set(state) != keys:
            raise ValueError(f"states[{i}] must hold the same keys as states[0] (this rank's share of every model)")
    shares = [{k: v.detach() for k, v in s.items()} for s in states]
    chan = Channel(group)
    with shared_errors(chan, "merge_many"):
        check_same(chan, spec=_spec_facts(spec), models=len(states), weights=weights, max_iter=max_iter,
                   seed=hashlib.sha256(gen.get_state().numpy().tobytes()).hexdigest())  # fmt: skip
        return _merge(spec, shares, group, weights, max_iter, gen, progress)


def check_shares(spec: Any, states: Any, weights: Any) -> list[float] | None:
    """The checks of a merge of many models' shares made before any message: ``spec`` a PermutationSpec,
    ``states`` a sequence of at least two shares, ``weights`` one per model (returned checked); each error
    names its argument."""
    check_spec(spec)
    if isinstance(states, (Mapping, str, bytes)) or not isinstance(states, Sequence):
        raise TypeError(f"states must be a sequence of state dicts (this rank's shares), got {type(states).__name__}")
    if len(states) < 2:
        raise ValueError(f"states must hold at least two state dicts, got {len(states)}")
    return check_merge_weights(weights, len(states))


def _merge(spec: PermutationSpec, shares: list[dict], group: Any, weights: list[float] | None, max_iter: int,
           gen: torch.Generator, progress: bool) -> MergeResult:
    """MergeMany's rounds over the ranks (the arguments checked, the same on every rank)."""

    def match(i: int, others: dict, init: Permutations, g: torch.Generator) -> DistributedMatchingResult:
        # From the identity, weight_matching's "best" looks for a stall and restarts from the signatures, as one
        # process's merge_many does (a planted MobileNetV2 copy stays unaligned from the identity alone).
        return weight_matching(spec, others, shares[i], group=group, init="best" if init.is_identity() else init,
                               seed=g)

    return align_many(spec, shares, match, max_iter, gen, progress, weights)


def _waves(matcher: RankMatcher, order: list[str]) -> list[str]:
    """``order`` regrouped into waves: each group after every earlier one that shares a tensor with it."""
    tensors = {g: matcher.step_keys(g) for g in order if matcher.steps[g] is not None}
    wave_of: dict[str, int] = {}
    for j, g in enumerate(order):
        if g not in tensors:
            continue
        earlier = [wave_of[h] for h in order[:j] if h in wave_of and not tensors[h].isdisjoint(tensors[g])]
        wave_of[g] = 1 + max(earlier, default=-1)
    return sorted(wave_of, key=lambda g: wave_of[g])  # stable: the seeded order within a wave
