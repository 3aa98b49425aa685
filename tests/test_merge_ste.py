"""merge_many (Git Re-Basin Algorithm 3) and ste_matching (Algorithm 2)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from _digits import digits, train

from pyperm.nn import (
    Permutations,
    apply_permutation,
    interpolate,
    merge_many,
    ste_matching,
    weight_matching,
)
from pyperm.nn.models import MLP

WIDTHS = [64, 96, 96, 10]


@pytest.fixture(scope="module")
def digits_train():
    x, y, _, _ = digits()
    return x, y


@pytest.fixture(scope="module")
def trained():
    models = []
    for seed in range(3):
        model = MLP(WIDTHS)
        train(model, seed, epochs=15)
        models.append(model)
    return models


def _loss(model, state, x, y):
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    with torch.no_grad():
        return float(F.cross_entropy(m(x), y))


def _batches(x, y, size=128):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


# --------------------------------------------------------------------------- merge_many


def test_merging_permuted_copies_gives_back_the_model():
    torch.manual_seed(0)
    model = MLP([12, 20, 20, 3])
    spec = model.permutation_spec()
    g = torch.Generator().manual_seed(1)
    copies = [model.state_dict()]
    for _ in range(3):
        perms = {name: torch.randperm(n, generator=g) for name, n in spec.sizes.items()}
        copies.append(apply_permutation(spec, perms, model.state_dict()))
    result = merge_many(spec, copies, seed=0)
    assert result.converged and result.perms[0].is_identity()
    x = torch.randn(32, 12, generator=g)
    merged = copy.deepcopy(model)
    merged.load_state_dict(result.merged)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), model(x), atol=1e-5, rtol=1e-5)
    for p, state in zip(result.perms, copies):
        aligned = apply_permutation(spec, p, state)
        assert all(torch.allclose(aligned[k], model.state_dict()[k]) for k in aligned)


def test_merging_trained_models_beats_the_naive_average(digits_train, trained):
    x, y = digits_train
    spec = trained[0].permutation_spec()
    states = [m.state_dict() for m in trained]
    result = merge_many(spec, states, seed=0)
    assert len(result.perms) == 3 and all(isinstance(p, Permutations) for p in result.perms)
    naive = {k: sum(s[k] for s in states) / len(states) for k in states[0]}
    assert _loss(trained[0], result.merged, x, y) < 0.8 * _loss(trained[0], naive, x, y)
    # every model is left unchanged
    assert all(torch.equal(states[0][k], trained[0].state_dict()[k]) for k in states[0])


def test_merge_many_bad_input():
    model = MLP([4, 6, 2])
    spec = model.permutation_spec()
    sd = model.state_dict()
    with pytest.raises(TypeError, match="spec"):
        merge_many({}, [sd, sd])
    with pytest.raises(TypeError, match="states must be a sequence"):
        merge_many(spec, sd)
    with pytest.raises(ValueError, match="at least two"):
        merge_many(spec, [sd])
    with pytest.raises(ValueError, match=r"states\[1\]"):
        merge_many(spec, [sd, MLP([4, 7, 2]).state_dict()])
    with pytest.raises(ValueError, match="max_iter"):
        merge_many(spec, [sd, sd], max_iter=0)


# --------------------------------------------------------------------------- ste_matching


def test_ste_midpoint_loss_is_no_worse_than_weight_matching(digits_train, trained):
    x, y = digits_train
    a, b = trained[0], trained[1]
    spec = a.permutation_spec()
    sa, sb = a.state_dict(), b.state_dict()
    wm = weight_matching(spec, sa, sb, seed=0, init="identity")  # Algorithm 1, where Algorithm 2 starts
    ste = ste_matching(a, spec, sa, sb, _batches(x, y), epochs=2, lr=1e-3, seed=0)
    assert ste.initial_perms == wm.perms
    assert len(ste.loss) == 2 * len(_batches(x, y)) and len(ste.sweeps) == len(ste.loss) - 1
    mid_wm = _loss(a, interpolate(sa, apply_permutation(spec, wm.perms, sb), 0.5), x, y)
    mid_ste = _loss(a, interpolate(sa, apply_permutation(spec, ste.perms, sb), 0.5), x, y)
    naive = _loss(a, interpolate(sa, sb, 0.5), x, y)
    assert mid_ste <= mid_wm * 1.02 and mid_ste < naive
    # the projections are warm starts: most take one or two sweeps
    assert sorted(ste.sweeps)[len(ste.sweeps) // 2] <= 2
    assert all(torch.equal(sa[k], a.state_dict()[k]) for k in sa)  # the model is unchanged


def test_ste_bad_input(digits_train):
    x, y = digits_train
    model = MLP([64, 8, 10])
    spec = model.permutation_spec()
    sd = model.state_dict()
    data = _batches(x[:64], y[:64])
    with pytest.raises(TypeError, match="model"):
        ste_matching("mlp", spec, sd, sd, data)
    with pytest.raises(TypeError, match="spec"):
        ste_matching(model, None, sd, sd, data)
    with pytest.raises(ValueError, match="lr"):
        ste_matching(model, spec, sd, sd, data, lr=-1.0)
    with pytest.raises(ValueError, match="epochs"):
        ste_matching(model, spec, sd, sd, data, epochs=0)
    with pytest.raises(ValueError, match="no batches"):
        ste_matching(model, spec, sd, sd, [])
    with pytest.raises(TypeError, match="targets"):
        ste_matching(model, spec, sd, sd, [x[:8]])


def test_structured_specs_are_refused_by_name():
    from pyperm.nn import PermutationSpec, pam
    from pyperm.nn.spec import Tiled

    spec = PermutationSpec({"w1": ("h", None), "w2": (None, Tiled("h", inner=2))}, {"h": 3})
    sd = {"w1": torch.zeros(3, 2), "w2": torch.zeros(1, 6)}
    model = torch.nn.Linear(2, 3)
    with pytest.raises(ValueError, match="merge_many supports one group per axis"):
        merge_many(spec, [sd, sd])
    with pytest.raises(ValueError, match="ste_matching supports one group per axis"):
        ste_matching(model, spec, sd, sd, [])
    with pytest.raises(ValueError, match="pam supports one group per axis"):
        pam(model, sd, sd, [], spec)
