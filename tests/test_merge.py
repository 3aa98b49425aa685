"""merge_many (Git Re-Basin Algorithm 3): flat and structured specs, planted permutations, bad input."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _digits import digits, train
from torch import nn

from pyperm.nn import MergeResult, Permutations, apply_permutation, merge_many, trace_model
from pyperm.nn.models import MLP
from pyperm.nn.spec import Blocks, Segments, Tiled, entry_groups
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


class DenseBlock(nn.Module):
    """Concatenation: every layer reads the concatenated outputs of the ones before it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.convs = nn.ModuleList([nn.Conv2d(6, 4, 3, padding=1), nn.Conv2d(10, 4, 3, padding=1)])
        self.fc = nn.Linear(14, 3)

    def forward(self, x):
        h = self.stem(x)
        for conv in self.convs:
            h = torch.cat([h, F.relu(conv(F.relu(h)))], 1)
        return self.fc(h.mean((2, 3)))


class FlattenHead(nn.Module):
    """Flatten of a 6 x 3 x 3 feature map into a Linear: each channel owns 9 consecutive inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(54, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(F.relu(self.conv(x)).flatten(1))))


class GroupedConv(nn.Module):
    """A 1x1 convolution, a grouped 3x3 one (2 groups of 4 channels) and a 1x1 head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 1)
        self.b = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.c = nn.Conv2d(8, 6, 1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(F.relu(self.c(F.relu(self.b(F.relu(self.a(x)))))).mean((2, 3)))


class Attention(nn.Module):
    """A residual nn.MultiheadAttention block (4 heads of 3 dimensions) between an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 12)
        self.attn = nn.MultiheadAttention(12, 4, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


class Recurrent(nn.Module):
    """A GRU (its hidden-to-hidden weights carry the hidden group on both axes) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.rnn = nn.GRU(6, 10, batch_first=True)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        return self.head(self.rnn(torch.tanh(self.inp(x)))[0][:, -1])


# name: (model, example input shape, the form the structured spec must hold)
STRUCTURED = {
    "concatenation": (DenseBlock, (2, 3, 5, 5), Segments),
    "flatten": (FlattenHead, (2, 3, 3, 3), Tiled),
    "grouped-convolution": (GroupedConv, (2, 3, 5, 5), Blocks),
    "attention-heads": (Attention, (2, 6, 5), Blocks),
    "recurrent": (Recurrent, (2, 5, 4), "two axes"),
}


def _structured(name: str, seed: int):
    """A model of ``STRUCTURED`` (float64, weights spread so that no two units tie), its traced structured
    spec and an input."""
    factory, shape, form = STRUCTURED[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = factory().double().eval()
        x = torch.randn(*shape, dtype=torch.float64)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
    spec = trace_model(model, x, composite="raise", structured=True).spec
    entries = [e for axes in spec.axes.values() for e in axes]
    if form == "two axes":  # a group on two axes of one tensor (the recurrent weight, P W P^T)
        named = [[g for e in axes for g in entry_groups(e)] for axes in spec.axes.values()]
        assert any(len(groups) > len(set(groups)) for groups in named)
    else:
        assert any(isinstance(e, form) or (isinstance(e, Segments) and any(isinstance(p, form) for p in e.parts))
                   for e in entries)  # fmt: skip
    return model, spec, x


def _outputs(model: nn.Module, state: dict, x: torch.Tensor) -> torch.Tensor:
    other = copy.deepcopy(model)
    other.load_state_dict(state)
    with torch.no_grad():
        return other(x)


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_merging_planted_copies_of_a_structured_model_recovers_the_permutations(name):
    """Copies of one model under planted permutations of every group (heads, blocks, segments, tiles,
    recurrent units): merging finds each planted permutation back, and the merged model is the model."""
    model, spec, x = _structured(name, seed=0)
    gen = torch.Generator().manual_seed(1)
    planted = [Permutations.identity(spec)] + [Permutations(spec, random_permutations(spec, gen)) for _ in range(2)]
    copies = [p.apply(model.state_dict()) for p in planted]
    result = merge_many(spec, copies, seed=0)
    assert result.converged and result.perms[0].is_identity()
    for found, plant in zip(result.perms, planted):
        assert found.spec is spec and found == plant.inverse()
    for key, t in model.state_dict().items():
        torch.testing.assert_close(result.merged[key], t, msg=key)
    torch.testing.assert_close(_outputs(model, result.merged, x), model(x))


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_merging_unrelated_structured_models_keeps_each_models_function(name):
    """Unrelated models: every model, permuted as merge_many says, computes what it computed
    (the permutations respect the spec's forms), and the rounds stop when nothing changes."""
    models = [_structured(name, seed) for seed in range(3)]
    spec, x = models[0][1], models[0][2]
    states = [m.state_dict() for m, _, _ in models]
    result = merge_many(spec, states, seed=0)
    assert result.converged and result.history[-1] == 0 and result.perms[0].is_identity()
    for (model, _, _), perms, state in zip(models, result.perms, states):
        torch.testing.assert_close(_outputs(model, perms.apply(state), x), model(x))
    expected = {k: sum(p.apply(s)[k] for p, s in zip(result.perms, states)) / 3 for k in states[0]}
    for key, t in expected.items():
        torch.testing.assert_close(result.merged[key], t, msg=key)
