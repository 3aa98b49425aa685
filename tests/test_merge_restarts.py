"""merge_many's restarts from the identity: only in a round after one that changed nothing; they still find a stall."""

import pytest
import torch

from pyperm.nn import Permutations, merge_many
from pyperm.nn.align._objective import WeightMatchingResult
from pyperm.nn.align.merge import GAIN_TOLERANCE, align_many
from pyperm.nn.models import MLP


def _swap(spec, i: int) -> Permutations:
    """A permutation of the one hidden group that swaps its units 0 and ``i`` (identity for 0)."""
    (group,) = spec.sizes
    p = torch.arange(spec.sizes[group])
    p[[0, i]] = p[[i, 0]]
    return Permutations(spec, {group: p})


def _roll(spec) -> Permutations:
    """The permutation of the hidden group that moves every unit one place on (the restarts' answer)."""
    (group,) = spec.sizes
    return Permutations(spec, {group: torch.roll(torch.arange(spec.sizes[group]), 1)})


def _scripted(spec, restart_gains: dict[tuple[int, int], float]):
    """A matcher whose warm start never changes anything (objective 1) and whose start from the identity
    gives model i the swap of units 0 and i + 1 from the identity itself (the first round), and from
    other permutations (a restart) :func:`_roll` with objective ``restart_gains[(model, its restarts so far)]``
    (0.5 when not named).
    Records each call as (model, from the identity, its permutations at the call)."""
    calls, restarts = [], {}

    def match(i, others, init, gen):
        gen.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))  # each matching uses the generator
        calls.append((i, init.is_identity(), init))
        if not init.is_identity():
            return WeightMatchingResult(perms=init, objective=[1.0], iterations=1, converged=True)
        if calls[-2:-1] and calls[-2][0] == i and not calls[-2][1]:  # a restart: the warm start just ran
            k = restarts.get(i, 0)
            restarts[i] = k + 1
            return WeightMatchingResult(perms=_roll(spec), objective=[restart_gains.get((i, k), 0.5)],
                                        iterations=1, converged=True)  # fmt: skip
        return WeightMatchingResult(perms=_swap(spec, i + 1), objective=[1.0], iterations=1, converged=True)

    return match, calls


@pytest.fixture
def spec_and_states():
    torch.manual_seed(0)
    models = [MLP([2, 4, 2]) for _ in range(3)]
    return models[0].permutation_spec(), [{k: v.detach() for k, v in m.state_dict().items()} for m in models]


def test_a_restart_round_follows_a_round_that_changed_nothing_and_only_it_ends_the_rounds(spec_and_states):
    spec, states = spec_and_states
    # Model 1's first restart finds a higher objective: its permutations change, warm rounds go on, and
    # a second round of restarts that changes nothing ends the merge.
    match, calls = _scripted(spec, {(1, 0): 2.0})
    result = align_many(spec, states, match, 20, torch.Generator().manual_seed(0), False)
    assert result.converged and result.history == [3, 0, 1, 0, 0] and result.iterations == 5
    # From the identity (True) or not, call by call: three first matchings, a warm round, a round of warm starts
    # each followed by its restart, a warm round, and a round of restarts again.
    warm, restart = [False], [False, True]
    expected = [True] * 3 + warm * 3 + restart * 3 + warm * 3 + restart * 3
    assert [from_identity for _, from_identity, _ in calls] == expected
    # the restart's permutations are kept, then made relative to model 0's
    assert result.perms[0].is_identity()
    assert result.perms[1] == _swap(spec, 1).inverse().compose(_roll(spec))


def test_a_warm_round_that_changes_nothing_is_not_the_end(spec_and_states):
    spec, states = spec_and_states
    match, calls = _scripted(spec, {})
    result = align_many(spec, states, match, 2, torch.Generator().manual_seed(0), False)
    assert result.history == [3, 0] and not result.converged  # max_iter stopped it before its restarts
    result = align_many(spec, states, _scripted(spec, {})[0], 3, torch.Generator().manual_seed(0), False)
    assert result.history == [3, 0, 0] and result.converged
    # restarts that find nothing higher leave the warm rounds' permutations: those of the first round here
    assert result.perms[2] == _swap(spec, 1).inverse().compose(_swap(spec, 3))


def test_a_first_round_that_changes_nothing_ends_the_rounds(spec_and_states):
    # The first round starts every model from the identity: it is a round of restarts already.
    spec, states = spec_and_states

    def match(i, others, init, gen):
        return WeightMatchingResult(perms=init, objective=[1.0], iterations=1, converged=True)

    result = align_many(spec, states, match, 20, torch.Generator().manual_seed(0), False)
    assert result.history == [0] and result.converged


def test_merging_trained_models_restarts_on_the_same_matcher_and_group_orders(monkeypatch):
    """On real matchings: each restart runs on the model's matcher with the generator's state of its warm
    start (the same group orders), and the merge ends on two rounds that changed nothing (warm, then restarts)."""
    from pyperm.nn.align import _matcher

    calls = []
    real = _matcher.WeightMatcher.match

    def spy(self, state_a, *, init=None, seed=0, **kwargs):
        identity = init is None or Permutations(self.spec, dict(init)).is_identity()
        state = seed.get_state().clone() if isinstance(seed, torch.Generator) else None
        result = real(self, state_a, init=init, seed=seed, **kwargs)
        calls.append((self, identity, state))
        return result

    monkeypatch.setattr(_matcher.WeightMatcher, "match", spy)
    torch.manual_seed(0)
    models = [MLP([16, 24, 24, 4]) for _ in range(3)]
    result = merge_many(models[0].permutation_spec(), [m.state_dict() for m in models], seed=0)
    assert result.converged and result.history[-2:] == [0, 0]
    restarts = [j for j in range(1, len(calls)) if calls[j][1] and not calls[j - 1][1]]
    assert len(restarts) >= 3  # the last round at least
    for j in restarts:
        assert calls[j][0] is calls[j - 1][0] and torch.equal(calls[j][2], calls[j - 1][2])
    warm = sum(1 for c in calls if not c[1])
    assert len(restarts) < warm  # not every warm matching restarts


def test_a_restart_finds_a_planted_stall(monkeypatch):
    """A planted copy of MobileNetV2 plus noise, on which the identity start alone stalls. With this seed the
    first round's matchings from the identity miss the copy (their group orders leave no tensor aligned, so
    the stall check sees no relation), the warm round after them changes nothing, and the round of restarts
    that follows finds the copy by its stall check: the merge keeps the planted units."""
    from _planted import planted_mobilenet_v2

    from pyperm.nn.align import merge

    found = []  # per matching from the identity: whether the stall check's second start gave the planted units
    real = merge.unstalled

    def spy(matcher, first, spec, state_a, state_b, seed, keys, **options):
        result = real(matcher, first, spec, state_a, state_b, seed, keys, **options)
        found.append(first.perms != result.perms and result.perms in (planted.inverse(), planted))
        return result

    monkeypatch.setattr(merge, "unstalled", spy)
    spec, a, b, planted = planted_mobilenet_v2(torch.Generator().manual_seed(1))
    result = merge_many(spec, [a, b], seed=4)
    assert result.history == [1, 0, 1, 0, 0]  # the first round's change is not the planted one (see below)
    assert not any(found[:2]) and any(found[2:])  # the first round's two matchings missed it, a restart found it
    assert result.converged and result.perms[1] == planted.inverse()


def test_a_restart_that_gains_less_than_the_tolerance_is_not_kept(spec_and_states):
    # Warm objective 1; a restart higher by half the tolerance is rounding-sized, not worth the rounds it
    # would start (the rule before GAIN_TOLERANCE kept anything above 1e-6: history [3, 0, 1, 0, 0]).
    spec, states = spec_and_states
    below = {(1, 0): 1.0 + GAIN_TOLERANCE / 2}
    result = align_many(spec, states, _scripted(spec, below)[0], 20, torch.Generator().manual_seed(0), False)
    assert result.history == [3, 0, 0] and result.converged
    assert result.perms[1] == _swap(spec, 1).inverse().compose(_swap(spec, 2))  # the warm rounds' permutations
    # Above it (of the model's objective) the restart is kept; a round whose gains, the restart's among them, sum
    # to at most the tolerance of the round's objectives (here 3) still ends the rounds.
    for gain, history in ((2 * GAIN_TOLERANCE, [3, 0, 1]), (4 * GAIN_TOLERANCE, [3, 0, 1, 0, 0])):
        match = _scripted(spec, {(1, 0): 1.0 + gain})[0]
        result = align_many(spec, states, match, 20, torch.Generator().manual_seed(0), False)
        assert result.history == history and result.converged
        assert result.perms[1] == _swap(spec, 1).inverse().compose(_roll(spec))


def _drifting(spec, warm_gain: float):
    """A matcher whose first matchings (from the identity) give model i the swap of units 0 and i + 1, whose warm
    starts always move to other permutations (one more place of :func:`_roll`) gaining ``warm_gain`` over their
    start's objective 1, and whose restarts find objective 0.5 (never kept)."""

    def match(i, others, init, gen):
        gen.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
        if init.is_identity():
            return WeightMatchingResult(perms=_swap(spec, i + 1), objective=[0.25, 0.5], iterations=1, converged=True)
        return WeightMatchingResult(perms=init.compose(_roll(spec)), objective=[1.0, 1.0 + warm_gain], iterations=1,
                                    converged=True)  # fmt: skip

    return match


def test_warm_rounds_that_gain_less_than_the_tolerance_end_in_a_round_of_restarts(spec_and_states):
    # Every warm matching changes its permutations, by gains below the tolerance: the rule that waited for a
    # round changing nothing ran to max_iter ([3] * 20, not converged).
    spec, states = spec_and_states
    tiny = _drifting(spec, GAIN_TOLERANCE / 10)
    result = align_many(spec, states, tiny, 20, torch.Generator().manual_seed(0), False)
    assert result.history == [3, 3, 3] and result.converged and result.iterations == 3  # first, warm, restarts
    # gains above it are worth more rounds
    result = align_many(spec, states, _drifting(spec, 10 * GAIN_TOLERANCE), 6, torch.Generator().manual_seed(0), False)
    assert result.history == [3] * 6 and not result.converged


def test_after_a_round_of_restarts_that_kept_none_the_next_settled_round_is_the_last(spec_and_states):
    """The warm starts' gains per round of a model's warm matchings: below the tolerance (a round of restarts
    follows), above it in that round (so the rounds go on although every restart lost), then below it again:
    that round ends the merge, with no second round of restarts (the rule before: [3, 3, 3, 3, 3])."""
    spec, states = spec_and_states
    gains = [GAIN_TOLERANCE / 10, 10 * GAIN_TOLERANCE, GAIN_TOLERANCE / 10, GAIN_TOLERANCE / 10]
    warm_calls, restarts = {}, []

    def match(i, others, init, gen):
        gen.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
        if init.is_identity():
            if i in warm_calls:  # a restart (after its warm start): never higher
                restarts.append(i)
                return WeightMatchingResult(perms=_roll(spec), objective=[0.5], iterations=1, converged=True)
            return WeightMatchingResult(perms=_swap(spec, i + 1), objective=[0.25, 0.5], iterations=1, converged=True)
        k = warm_calls.get(i, 0)
        warm_calls[i] = k + 1
        return WeightMatchingResult(perms=init.compose(_roll(spec)), objective=[1.0, 1.0 + gains[k]], iterations=1,
                                    converged=True)  # fmt: skip

    result = align_many(spec, states, match, 20, torch.Generator().manual_seed(0), False)
    assert result.history == [3, 3, 3, 3] and result.converged
    assert sorted(restarts) == [0, 1, 2]  # one round of restarts only
