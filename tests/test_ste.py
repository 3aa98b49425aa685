"""ste_matching (Git Re-Basin Algorithm 2): the answer is judged on fixed batches, its arguments."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _digits import batches, digits, train

from pyperm.nn import Permutations, STEMatchingResult, interpolate, ste_matching, weight_matching
from pyperm.nn.models import MLP
from pyperm.testing import random_permutations

WIDTHS = [64, 96, 96, 10]


@pytest.fixture(scope="module")
def pair():
    """Two digits MLPs trained from seeds 0 and 1, their spec, and the training batches."""
    x, y, _, _ = digits()
    model = MLP(WIDTHS)
    sa, sb = train(model, 0, epochs=15), train(model, 1, epochs=15)
    return model, model.permutation_spec(), sa, sb, batches(x, y, 128)


def _midpoint_loss(model, spec, sa, sb, perms, data):
    """The mean loss of the midpoint of A and permuted B over ``data`` (an MLP: train and eval mode agree)."""
    m = copy.deepcopy(model)
    m.load_state_dict(interpolate(sa, perms.apply(sb), 0.5))
    with torch.no_grad():
        total = sum(float(F.cross_entropy(m(x), y, reduction="sum")) for x, y in data)
    return total / sum(len(y) for _, y in data)


def test_ste_answer_no_worse_than_weight_matching_on_the_judge(pair):
    model, spec, sa, sb, data = pair
    wm = weight_matching(spec, sa, sb, seed=0, init="identity")  # Algorithm 1, where Algorithm 2 starts
    saved = [{k: v.clone() for k, v in s.items()} for s in (sa, sb, model.state_dict())]
    ste = ste_matching(model, spec, sa, sb, data, epochs=2, seed=0, judge_batches=4)
    assert isinstance(ste, STEMatchingResult)
    assert isinstance(ste.perms, Permutations) and isinstance(ste.init_perms, Permutations)
    assert ste.init_perms == wm.perms
    # The judge is the midpoint loss on the first judge_batches batches of data, the start included.
    judge = data[:4]
    assert ste.judged[0] == pytest.approx(_midpoint_loss(model, spec, sa, sb, wm.perms, judge), rel=1e-5)
    assert ste.judged[ste.best_step] == pytest.approx(_midpoint_loss(model, spec, sa, sb, ste.perms, judge), rel=1e-5)
    assert ste.judged[ste.best_step] == min(ste.judged.values()) <= ste.judged[0]
    # On this pair the training moves the answer off weight matching's, to a better midpoint on the whole split.
    assert ste.best_step > 0 and ste.perms != wm.perms
    x, y, _, _ = digits()
    whole = [(x, y)]
    assert _midpoint_loss(model, spec, sa, sb, ste.perms, whole) < _midpoint_loss(model, spec, sa, sb, wm.perms, whole)
    # The caller's states and model are unchanged.
    for before, after in zip(saved, (sa, sb, model.state_dict())):
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_ste_records_steps_and_projections(pair):
    model, spec, sa, sb, data = pair
    ste = ste_matching(model, spec, sa, sb, data, epochs=2, seed=0, judge_batches=2)
    n = len(data)
    assert ste.iterations == len(ste.loss) == 2 * n
    assert len(ste.projection_iterations) == ste.iterations  # one projection after every update
    # the projections are warm starts: most take one or two sweeps
    assert sorted(ste.projection_iterations)[len(ste.projection_iterations) // 2] <= 2
    # judged: the start, every 20 steps and the end of every epoch, each distinct permutation once
    assert 0 in ste.judged and set(ste.judged) <= {0, n, 2 * n} | set(range(20, 2 * n + 1, 20))
    assert list(ste.judged) == sorted(ste.judged)


def test_more_epochs_never_worse_on_the_judge(pair):
    model, spec, sa, sb, data = pair
    short = ste_matching(model, spec, sa, sb, data[:6], epochs=1, seed=0, judge_data=data[6:9], judge_every=2)
    long = ste_matching(model, spec, sa, sb, data[:6], epochs=3, seed=0, judge_data=data[6:9], judge_every=2)
    # The longer run repeats the shorter one and judges a superset of its candidates.
    assert long.loss[: short.iterations] == short.loss
    assert all(long.judged[step] == value for step, value in short.judged.items())
    assert long.judged[long.best_step] <= short.judged[short.best_step]


def test_judge_data_is_held_out_and_judge_every_one_judges_every_new_permutation(pair):
    model, spec, sa, sb, data = pair
    held_out = data[-2:]
    ste = ste_matching(model, spec, sa, sb, data[:4], epochs=2, lr=1e-2, seed=0, judge_data=held_out,
                       judge_batches=None, judge_every=1)  # fmt: skip
    assert ste.judged[0] == pytest.approx(_midpoint_loss(model, spec, sa, sb, ste.init_perms, held_out), rel=1e-5)
    # every step that changed the permutations (a projection of more than one sweep) was judged,
    # unless it came back to one judged before
    changed = [k + 1 for k, sweeps in enumerate(ste.projection_iterations) if sweeps > 1]
    assert set(ste.judged) <= {0, *changed}
    assert len(ste.judged) >= 2


def test_ste_bad_input(pair):
    model, spec, _, _, data = pair
    small = MLP([64, 8, 10])
    spec = small.permutation_spec()
    sd = small.state_dict()
    data = data[:1]
    with pytest.raises(TypeError, match="model"):
        ste_matching("mlp", spec, sd, sd, data)
    with pytest.raises(TypeError, match="spec"):
        ste_matching(small, None, sd, sd, data)
    with pytest.raises(ValueError, match="lr"):
        ste_matching(small, spec, sd, sd, data, lr=-1.0)
    with pytest.raises(ValueError, match="epochs"):
        ste_matching(small, spec, sd, sd, data, epochs=0)
    with pytest.raises(ValueError, match="no batches"):
        ste_matching(small, spec, sd, sd, [])
    with pytest.raises(TypeError, match="targets"):
        ste_matching(small, spec, sd, sd, [data[0][0][:8]])
    with pytest.raises(TypeError, match="data is read several times"):
        ste_matching(small, spec, sd, sd, iter(data))
    with pytest.raises(TypeError, match="epochs must be a positive int"):
        ste_matching(small, spec, sd, sd, data, epochs=1.0)
    with pytest.raises(TypeError, match="loss_fn must be a callable or None"):
        ste_matching(small, spec, sd, sd, data, loss_fn="mse")
    with pytest.raises(ValueError, match=r"init does not match the spec's groups"):
        ste_matching(small, spec, sd, sd, data, init={"nope": [0]})
    with pytest.raises(ValueError, match="judge_batches must be at least 1"):
        ste_matching(small, spec, sd, sd, data, judge_batches=0)
    with pytest.raises(ValueError, match="judge_every must be at least 1"):
        ste_matching(small, spec, sd, sd, data, judge_every=0)
    with pytest.raises(TypeError, match="judge_data must be an iterable of batches"):
        ste_matching(small, spec, sd, sd, data, judge_data=data[0][0])
    with pytest.raises(ValueError, match="judge_data yielded no batches"):
        ste_matching(small, spec, sd, sd, data, judge_data=[])
    with pytest.raises(TypeError, match="positional"):
        ste_matching(small, spec, sd, sd, data, None)  # type: ignore[misc]


def test_ste_starts_at_init_and_takes_numpy_ints(pair):
    *_, data = pair
    model = MLP([64, 8, 10])
    spec = model.permutation_spec()
    sd = model.state_dict()
    start = Permutations(spec, random_permutations(spec, 0))
    result = ste_matching(model, spec, sd, sd, data[:2], init=dict(start), epochs=np.int64(1),
                          max_batches=np.int64(2), seed=np.int64(0), judge_batches=np.int64(1),
                          judge_every=np.int64(1))  # fmt: skip
    assert result.init_perms == start and result.init_perms.spec is spec
    assert result.iterations == 2 and len(result.projection_iterations) == 2
    # A and B are the same model: the start is a random permutation, the first projection undoes it,
    # and that new permutation is judged (judge_every=1) beside the start.
    assert sorted(result.judged) == [0, 1]
    assert result.judged[result.best_step] == min(result.judged.values())




def test_projections_are_one_sweep_between_judgements_and_converge_where_judged(pair, monkeypatch):
    """Between judgements a projection is one sweep of weight matching (continued at the next step); the
    permutations of every judged step (each judge_every-th and every epoch's last) are a converged projection."""
    from pyperm.nn.align.weight import WeightMatcher

    model, spec, sa, sb, data = pair
    calls = []
    match = WeightMatcher.match

    def recording(self, *args, **kwargs):
        out = match(self, *args, **kwargs)
        calls.append((kwargs.get("max_iter"), out.converged, out.iterations))
        return out

    monkeypatch.setattr(WeightMatcher, "match", recording)
    result = ste_matching(model, spec, sa, sb, data[:7], epochs=2, lr=1e-2, seed=0, judge_every=3, judge_batches=1)
    steps = calls[1:]  # the first is the start (weight matching from the identity)
    assert len(steps) == result.iterations == 14
    judged = {3, 6, 7, 9, 12, 14}
    for step, (max_iter, converged, sweeps) in enumerate(steps, 1):
        if step in judged:
            assert converged, step
        else:
            assert max_iter == 1 and sweeps == 1, step
    assert result.projection_iterations == [sweeps for _, _, sweeps in steps]
    assert set(result.judged) <= {0} | judged


def test_the_kept_midpoint_is_recomputed_where_a_group_moved():
    """The midpoint kept between steps equals the one computed afresh after any change of the permutations,
    BatchNorm statistics included, and keeps the tensors of the entries no moved group permutes."""
    from pyperm.nn.align.ste import _Midpoint
    from pyperm.nn.models import ResNet20

    torch.manual_seed(0)
    model = ResNet20(width_multiplier=1)
    spec = model.permutation_spec()
    sa, sb = model.state_dict(), ResNet20(width_multiplier=1).state_dict()
    free = {n: sa[n] for n, _ in model.named_parameters()}
    kept = _Midpoint(spec, sa, sb, free)
    perms = Permutations(spec, random_permutations(spec, 1))
    first, leaves = kept.at(perms)
    group = next(iter(spec.sizes))
    moved = dict(perms)
    moved[group] = torch.roll(perms[group], 1)
    moved = Permutations(spec, moved)
    second, second_leaves = kept.at(moved)
    expected = interpolate(sa, moved.apply(sb), 0.5)
    for k, v in expected.items():
        if v.is_floating_point():
            assert torch.allclose(second[k], v, rtol=0, atol=1e-6), k
        else:
            assert torch.equal(second[k], v), k
    assert list(second_leaves) == [k for k in sa if k in free]
    touched = {key for key, _ in spec.group_axes[group]}
    for k in free:
        assert (second_leaves[k] is leaves[k]) == (k not in touched), k
        assert second_leaves[k].requires_grad and second[k] is second_leaves[k]
    buffer = next(k for k in sa if k.endswith("running_mean"))
    assert second[buffer] is not kept.entries[buffer]  # BatchNorm writes its running statistics in place
