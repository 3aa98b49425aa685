r"""Merging many models: Git Re-Basin's MergeMany (Ainsworth et al. 2023, Algorithm 3).

Every model in turn is weight-matched to the mean of the others (permuted as they are now), until a
round gains nothing worth another (see below); the merged model is the mean of the permuted models
(weighted means when weights are given).

Each matching runs from the model's current permutations (warm: a sweep or two of cheap corrections,
with the model's matcher, its similarities and warm solvers kept from round to round). The warm
start alone is a monotone ascent of MergeMany's objective that settles in the first local optimum it
meets: on three MNIST MLPs it ended below Algorithm 3 run plainly, whose restarts from the identity
move away from such optima. So a round of warm starts that gains nothing worth a round, which would
end the rounds, is followed by a round that also restarts each matching from the identity (Algorithm
3's own start, a search from scratch) and keeps the higher objective; only a round of restarts that
gains nothing worth a round ends the rounds (restarting in every round would add a search from
scratch to every matching), or, once a round of restarts has kept none, the next round of warm
starts that gains nothing worth a round. A gain is worth a round when it is above
:data:`GAIN_TOLERANCE` of the objective: on the paper's MNIST MLPs the warm rounds' tail and most of
the restarts' wins gain less than that, and the warm rounds such a win started did not lower the
merged test loss (bench/merge_many_restarts.py). A matching from the identity (a model's first, and
the restarts) also looks for a stall and then runs the signature start, as
:func:`~pyperm.nn.weight_matching`'s default does (over ranks too:
:func:`pyperm.distributed.merge_many`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pyperm._checks import check_choice, check_merge_weights, check_positive_int, torch_generator
from pyperm._progress import progress_bar
from pyperm.nn._checks import check_spec, check_state
from pyperm.nn.align._objective import WeightMatchingResult
from pyperm.nn.align._starts import _same_seed, unstalled
from pyperm.nn.align.weight import WeightMatcher
from pyperm.nn.permutations import Permutations, permute_entry
from pyperm.nn.spec import PermutationSpec
from pyperm.nn.state import average

__all__ = ["MergeResult", "align_many", "check_merge_states", "merge_many"]

logger = logging.getLogger(__name__)

# The least gain worth a round, relative to the objective (see align_many): a restart from the identity
# replaces the warm start only when its objective is higher by more than this, and a round whose kept
# changes gain no more than this counts as one that changed nothing. Well above the rounding of the
# objectives' float64 sums of float32 values (two starts ending at one optimum must not take turns).
GAIN_TOLERANCE = 1e-5


@dataclass
class MergeResult:
    """What :func:`merge_many` found.

    Attributes
    ----------
    perms : list of Permutations
        One per model, in the order given; the first model's are the identity (the
        merged model lives in its basin). ``apply_permutation(spec, perms[i], states[i])``
        is model ``i`` aligned to the others.
    merged : dict of str to torch.Tensor
        The mean of the permuted models (integer buffers from the first model).
    iterations : int
        Rounds over the models that were run (at most ``max_iter``).
    converged : bool
        Whether the rounds ended on one that gained nothing worth a round (see the module's notes;
        otherwise ``max_iter`` stopped them).
    history : list of int
        Per round, how many models' permutations changed. A round of warm starts that gains
        nothing worth a round (see the module's notes; often a 0) is followed by a round of restarts
        from the identity.
    """

    perms: list[Permutations]
    merged: dict[str, torch.Tensor]
    iterations: int = 0
    converged: bool = False
    history: list[int] = field(default_factory=list)


def merge_many(
    spec: PermutationSpec,
    states: Sequence[Mapping[str, torch.Tensor]],
    *,
    weights: Sequence[float] | None = None,
    max_iter: int = 100,
    seed: int | torch.Generator = 0,
    progress: bool = False,
    method: str = "mergemany",
) -> MergeResult:
    r"""Align several models to each other and average them (Git Re-Basin, Algorithm 3).

    Repeats, for every model :math:`i` in a random order:

    .. math::

        \Theta' = \frac{1}{N-1} \sum_{j \ne i} \pi_j(\Theta_j), \qquad
        \pi_i \leftarrow \operatorname{WeightMatching}(\Theta', \Theta_i),

    until a round that also restarts every matching from the identity (see the module's notes)
    leaves every :math:`\pi_i` unchanged or raises the objective by at most a relative
    ``GAIN_TOLERANCE`` (1e-5, in :mod:`pyperm.nn.align.merge`), then returns
    :math:`\frac{1}{N} \sum_j \pi_j(\Theta_j)`. With ``weights`` :math:`w`, both means are
    weighted: :math:`\Theta' = \sum_{j \ne i} w_j \pi_j(\Theta_j) / \sum_{j \ne i} w_j` and the result
    is :math:`\sum_j w_j \pi_j(\Theta_j)`. All permutations are finally composed with
    the inverse of the first model's, which changes no alignment but makes the first
    model's the identity.

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups, any axis form (:class:`~pyperm.nn.spec.Segments`,
        :class:`~pyperm.nn.spec.Tiled`, :class:`~pyperm.nn.spec.Blocks`, one group on two
        axes), as :func:`~pyperm.nn.weight_matching` takes them.
    states : sequence of mapping of str to torch.Tensor
        At least two state dicts of one architecture (the spec's keys, equal shapes),
        on one device.
    weights : sequence of float, optional
        One positive weight per state, summing to 1 (within 1e-6): the share of each aligned
        model in the merge (see Notes). Equal weights when omitted.
    max_iter : int, default 100
        Most rounds over the models.
    seed : int or torch.Generator, default 0
        Seeds the order of the models in each round and the weight matchings' group orders.
    progress : bool, default False
        Show a progress bar over the rounds.
    method : {"mergemany", "c2m3"}, default "mergemany"
        ``"c2m3"``: C2M3's cycle-consistent Frank-Wolfe in a universe instead
        (:func:`~pyperm.nn.c2m3_merge` with its defaults; ``max_iter`` counts its iterations,
        ``seed`` seeds its start), which returns a :class:`~pyperm.nn.C2M3Result`.

    Returns
    -------
    MergeResult
        ``perms`` (one :class:`~pyperm.nn.Permutations` per model), ``merged``,
        ``iterations`` (rounds), ``converged`` and the per-round ``history``.

    Raises
    ------
    TypeError, ValueError
        ``spec`` is not a PermutationSpec, ``states`` is not a
        sequence of at least two matching state dicts, ``weights`` are not positive, do not
        sum to 1 or are not one per state, or ``max_iter`` or ``seed`` is invalid.

    Notes
    -----
    A weight applies to a model *after* alignment: unit ``u`` of the merge is the weighted
    sum, over the models, of the unit of each that the alignment pairs with ``u``, not of
    the units that happen to share its index. Merging two fine-tunes at
    ``weights=[0.7, 0.3]`` thus takes 0.7 of each of the first model's units and 0.3 of the
    second model's unit matched to it. With two models the permutations do not depend on the weights (each
    model is matched to the other); with more, each is matched to the weighted mean of the
    others. The merged model lives in the first model's basin whatever the weights.

    A model with BatchNorm needs its statistics recomputed after merging
    (:func:`~pyperm.nn.reset_bn_stats`), as for any point off the endpoints.

    References
    ----------
    S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
    Permutation Symmetries", ICLR 2023, section 5 and Algorithm 3 (appendix A.6).

    Examples
    --------
    >>> from pyperm.nn import merge_many
    >>> from pyperm.nn.models import MLP
    >>> models = [MLP([8, 16, 4]) for _ in range(3)]
    >>> result = merge_many(models[0].permutation_spec(), [m.state_dict() for m in models])
    >>> result.perms[0].is_identity(), sorted(result.merged) == sorted(models[0].state_dict())
    (True, True)
    """
    if check_choice(method, "method", ("mergemany", "c2m3")) == "c2m3":
        from pyperm.nn.align.c2m3 import c2m3_merge  # c2m3 builds on this module: imported when asked for

        return c2m3_merge(spec, states, weights=weights, max_iter=max_iter, seed=seed, progress=progress)
    weights = check_merge_states(spec, states, weights)
    max_iter = check_positive_int(max_iter, "max_iter")
    gen = torch_generator(seed)
    states = [{k: v.detach() for k, v in s.items()} for s in states]
    # One matcher per model, which is always the B side of its matchings: its arrangement
    # and warm solvers carry over from round to round (and between a matching's two starts).
    matchers = [WeightMatcher(spec, s) for s in states]

    def match(i: int, others: dict[str, torch.Tensor], init: Permutations,
              gen: torch.Generator) -> WeightMatchingResult:  # fmt: skip
        try:
            if not init.is_identity():
                return matchers[i].match(others, init=init, seed=gen)
            # Algorithm 3's start, with weight_matching's look for a stall: planted copies of a CLIP text
            # encoder merged from the identity alone kept one layer's attention heads unaligned.
            again = _same_seed(gen)  # a second start visits the groups in the first one's orders
            first = matchers[i].match(others, init=None, seed=gen)
            return unstalled(matchers[i], first, spec, others, states[i], again, None)
        finally:
            matchers[i].release_a()  # the next matching of model i has new others: nothing to keep of these

    return align_many(
        spec,
        states,
        match,
        max_iter,
        gen,
        progress,
        weights,
    )


def check_merge_states(spec: Any, states: Any, weights: Any) -> list[float] | None:
    """The checks every merge of many models makes, each error naming its argument: ``spec`` a
    PermutationSpec, ``states`` a sequence of at least two state dicts that fit it, ``weights``
    one non-negative weight per model (or None); returns the checked weights."""
    check_spec(spec)
    if isinstance(states, (Mapping, str, bytes)) or not isinstance(states, Sequence):
        raise TypeError(f"states must be a sequence of state dicts, got {type(states).__name__}")
    if len(states) < 2:
        raise ValueError(f"states must hold at least two state dicts, got {len(states)}")
    weights = check_merge_weights(weights, len(states))
    for i, state in enumerate(states):
        spec.check_state_dict(check_state(state, f"states[{i}]"), f"states[{i}]")
    return weights


def align_many(
    spec: PermutationSpec,
    states: list[dict[str, torch.Tensor]],
    match: Callable[[int, dict[str, torch.Tensor], Permutations, torch.Generator], WeightMatchingResult],
    max_iter: int,
    gen: torch.Generator,
    progress: bool,
    weights: list[float] | None = None,
    tol: float = GAIN_TOLERANCE,
) -> MergeResult:
    """MergeMany's rounds on ``states`` (whole state dicts, or one rank's shares of them): ``match(i,
    others, init, gen)`` weight-matches model ``i`` to the (weighted) mean of the others from ``init``
    (its result's ``objective[0]`` is the objective at ``init``, ``objective[-1]`` the matching's final one;
    both the same on every rank). Permutations are applied entry by entry (any subset of the keys; an
    entry no group permutes is the input tensor, not a copy). ``weights``: checked ones, or None for
    equal weights. ``tol``: the least gain worth a round, relative to the objective.

    Each matching runs from the model's current permutations. In a round of restarts (the first,
    whose permutations are all the identity, and each after a round that gained nothing worth a
    round) a matching from other permutations runs from the identity too, with the generator's state
    at the matching (the same group orders); the identity's result is kept only when its objective
    is higher by more than ``tol`` (relative), so that two starts ending at one optimum, their sums
    rounded differently, do not keep a round from being the last. A round gains nothing worth a
    round when it changes no permutation, or when the objectives its kept matchings gained sum to at
    most ``tol`` times the sum of the round's objectives (so a kept restart can end the rounds, its
    permutations kept); a model's change from the identity (it has no warm start to measure against)
    is always worth a round. A round of restarts that gains nothing worth a round ends the rounds.
    One whose warm starts still gained, but whose restarts all lost, restarts no more: the next
    round of warm starts that gains nothing worth a round is the last (else the warm rounds' gains,
    which hover about ``tol`` as they settle, could bring a search from scratch for every model
    every few rounds)."""
    n = len(states)
    w = [1.0] * n if weights is None else weights  # unnormalised ones: the equal-weight sums stay as they were
    identity = Permutations.identity(spec)
    perms = [identity for _ in range(n)]
    permuted = [dict(s) for s in states]
    # A running weighted sum of the permuted models, so each model's "mean of the others" is one subtraction.
    # Two models need none: each one's "others" is the other model as it is permuted now (the sum's float64
    # round trip gives back the same float32 entries), which spares two float64 copies of a model and a
    # third of its size per matching (Stable Diffusion's UNet in float32: 10 GB).
    total = None if n == 2 else {k: sum(wj * s[k].double() for wj, s in zip(w, states)) if v.is_floating_point()
                                 else v for k, v in states[0].items()}  # fmt: skip
    rest = [sum(w) - wi for wi in w]  # the weight of the others of each model

    def others_of(i: int) -> dict[str, torch.Tensor]:
        if total is None:
            return {k: v.to(states[i][k].dtype) if v.is_floating_point() else states[0][k]
                    for k, v in permuted[1 - i].items()}  # fmt: skip
        return {k: ((v - w[i] * permuted[i][k].double()) / rest[i]).to(states[i][k].dtype)
                if v.is_floating_point() else v for k, v in total.items()}  # fmt: skip

    def best_match(i: int, others: dict[str, torch.Tensor], restart: bool) -> tuple[Permutations, float, float]:
        """Model i's new permutations, what they gain over its current ones, and their objective."""
        at_start = gen.get_state()
        result = match(i, others, perms[i], gen)
        if perms[i] == identity:  # no warm start: objective[0] may be the stall check's second start's
            return result.perms, (0.0 if result.perms == identity else math.inf), abs(result.objective[-1])
        before = result.objective[0]  # at the current permutations
        if restart:  # Algorithm 3's start too (the same orders), kept only when better
            gen.set_state(at_start)
            plain = match(i, others, identity, gen)
            warm = result.objective[-1]
            if plain.objective[-1] > warm + tol * abs(warm):
                result = plain
                restarts_kept.append(i)
        return result.perms, result.objective[-1] - before, abs(result.objective[-1])

    bar = progress_bar(progress, max_iter, "merge many", "round")
    rounds, converged, history = 0, False, []
    restart = True  # the first round starts from the identity: a round of restarts
    restarts_kept: list[int] = []  # the models whose restart won, this round
    restarts_lost = False  # whether the last round of restarts (not the first round) kept none
    try:
        for _ in range(max_iter):
            rounds += 1
            changed, gained, size = 0, 0.0, 0.0
            for i in torch.randperm(n, generator=gen).tolist():
                new, gain, objective = best_match(i, others_of(i), restart)
                size += objective
                if new == perms[i]:
                    continue
                changed += 1
                gained += gain
                perms[i] = new
                # Entry by entry, each old permuted tensor let go as its new one is made: not two whole models.
                old, permuted[i] = permuted[i], {}
                for k, t in states[i].items():
                    v = permute_entry(spec, new, k, t)
                    if total is not None and v.is_floating_point():
                        total[k] += w[i] * (v.double() - old[k].double())
                    permuted[i][k] = v
                    del old[k]
            history.append(changed)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(changed=changed)
            settled = changed == 0 or gained <= tol * size
            if settled and (restart or restarts_lost):
                converged = True
                break
            if restart:  # its warm starts still moved: rounds go on
                restarts_lost = rounds > 1 and not restarts_kept
            restarts_kept.clear()
            restart = settled  # warm starts found nothing worth a round: restart before ending (unless they lost)
    finally:
        if bar is not None:
            bar.close()
    # The first model's basin: compose every permutation with the inverse of its.
    back = perms[0].inverse()
    perms = [back.compose(p) for p in perms]
    del permuted, total  # before the merged model is made
    merged = {}
    for key in states[0]:  # one key at a time: one permuted tensor of each model at once, not whole models
        merged.update(average([{key: permute_entry(spec, p, key, s[key])} for p, s in zip(perms, states)], weights))
    logger.debug("merge_many: %d models, %d rounds, converged=%s", n, rounds, converged)
    return MergeResult(perms=perms, merged=merged, iterations=rounds, converged=converged, history=history)
