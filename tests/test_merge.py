"""merge_many (Git Re-Basin Algorithm 3): flat and structured specs, planted permutations, bad input."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _digits import digits, train
from _structured_models import STRUCTURED, outputs, structured_model

from pyperm.nn import MergeResult, Permutations, apply_permutation, merge_many
from pyperm.nn.models import MLP
from pyperm.testing import one_thread, random_permutations

WIDTHS = [64, 96, 96, 10]


@pytest.fixture(scope="module")
def digits_train():
    x, y, _, _ = digits()
    return x, y


@pytest.fixture(scope="module")
def trained():
    models = []
    with one_thread():
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


def test_merging_permuted_copies_gives_back_the_model():
    torch.manual_seed(0)
    model = MLP([12, 20, 20, 3])
    spec = model.permutation_spec()
    g = torch.Generator().manual_seed(1)
    copies = [model.state_dict()]
    for _ in range(3):
        copies.append(apply_permutation(spec, random_permutations(spec, g), model.state_dict()))
    result = merge_many(spec, copies, seed=0)
    assert isinstance(result, MergeResult)
    assert result.converged and result.perms[0].is_identity()
    assert all(isinstance(p, Permutations) and p.spec is spec for p in result.perms)
    assert isinstance(result.iterations, int) and result.iterations == len(result.history)
    assert result.history[-1] == 0
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
    with pytest.raises(ValueError, match="max_iter must be at least 1"):
        merge_many(spec, [sd, sd], max_iter=0)
    with pytest.raises(TypeError, match="positional"):
        merge_many(spec, [sd, sd], 3)  # type: ignore[misc]
    assert merge_many(spec, [sd, sd], max_iter=np.int64(2), seed=np.int64(0)).converged  # numpy ints are ints


# --------------------------------------------------------------------------- structured specs


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_merging_planted_copies_of_a_structured_model_recovers_the_permutations(name):
    """Copies of one model under planted permutations of every group (heads, blocks, segments, tiles,
    recurrent units): merging finds each planted permutation back, and the merged model is the model."""
    model, spec, x = structured_model(name, seed=0)
    gen = torch.Generator().manual_seed(1)
    planted = [Permutations.identity(spec)] + [Permutations(spec, random_permutations(spec, gen)) for _ in range(2)]
    copies = [p.apply(model.state_dict()) for p in planted]
    result = merge_many(spec, copies, seed=0)
    assert result.converged and result.perms[0].is_identity()
    for found, plant in zip(result.perms, planted):
        assert found.spec is spec and found == plant.inverse()
    for key, t in model.state_dict().items():
        torch.testing.assert_close(result.merged[key], t, msg=key)
    torch.testing.assert_close(outputs(model, result.merged, x), model(x))


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_merging_unrelated_structured_models_keeps_each_models_function(name):
    """Unrelated models: every model, permuted as merge_many says, computes what it computed
    (the permutations respect the spec's forms), and the rounds stop when nothing changes."""
    models = [structured_model(name, seed) for seed in range(3)]
    spec, x = models[0][1], models[0][2]
    states = [m.state_dict() for m, _, _ in models]
    result = merge_many(spec, states, seed=0)
    assert result.converged and result.history[-1] == 0 and result.perms[0].is_identity()
    for (model, _, _), perms, state in zip(models, result.perms, states):
        torch.testing.assert_close(outputs(model, perms.apply(state), x), model(x))
    expected = {k: sum(p.apply(s)[k] for p, s in zip(result.perms, states)) / 3 for k in states[0]}
    for key, t in expected.items():
        torch.testing.assert_close(result.merged[key], t, msg=key)
