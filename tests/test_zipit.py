"""ZipIt!: the greedy pairing against a direct transcription of the paper's loop, the zip of a model with itself
(full and stopped at every group) on every kind of traced spec, the zip as a permutation when same-model merges are
forbidden (activation matching's), the merged weights against M W U written out, and the errors."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from _attention_models import tiny_lm
from _structured_models import STRUCTURED, structured_model

from pyperm.nn import PermutationSpec, activation_matching, apply_permutation
from pyperm.nn.align._zip_pairing import zip_pairing
from pyperm.nn.align.zipit import ZippedModel, zipit
from pyperm.nn.models import create_model


def reference_pairing(corr: np.ndarray, alpha: float, beta: float) -> list[tuple[int, ...]]:
    """The paper's loop as written: the matrix shrinks by one column and row per merge."""
    s = corr.astype(np.float64).copy()
    size = s.shape[0]
    n = size // 2
    np.fill_diagonal(s, -np.inf)
    members = [[i] for i in range(size)]
    model = [0] * n + [1] * n
    budget = [int(beta * (n // 2) + 1e-9)] * 2
    for m in (0, 1):
        if budget[m] <= 0:
            sel = [k for k in range(len(model)) if model[k] == m]
            s[np.ix_(sel, sel)] = -np.inf
    while len(members) > n:
        i, j = np.unravel_index(np.argmax(s), s.shape)
        i, j = min(i, j), max(i, j)
        col = np.minimum(s[:, i], s[:, j])
        if alpha > 0:
            col = col * alpha
        else:
            col[[k for k in range(len(model)) if model[k] in (model[i], model[j])]] = -np.inf
        s[:, i] = col
        s[i, :] = col
        s[i, i] = -np.inf
        members[i] += members[j]
        same = model[i] == model[j]
        keep = [k for k in range(len(members)) if k != j]
        s = s[np.ix_(keep, keep)]
        del members[j], model[j]
        if same:
            budget[model[i]] -= 1
            if budget[model[i]] <= 0:
                sel = [k for k in range(len(model)) if model[k] == model[i]]
                s[np.ix_(sel, sel)] = -np.inf
    return sorted(tuple(sorted(m)) for m in members)


def partition(cluster: np.ndarray) -> list[tuple[int, ...]]:
    return sorted(tuple(np.flatnonzero(cluster == c).tolist()) for c in np.unique(cluster))


def correlated_features(n: int, seed: int) -> np.ndarray:
    """The correlation of two models' features: B's partly A's, each model with a few near-duplicates."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((400, 2 * n))
    x[:, n:] += x[:, :n][:, rng.permutation(n)] * rng.uniform(0, 2, n)
    x[:, 1] += 2 * x[:, 0]
    x[:, n + 3] += 2 * x[:, n + 2]
    return np.corrcoef(x.T)


@pytest.mark.parametrize("alpha,beta", [(0.3, 0.125), (0.5, 0.5), (1.0, 1.0), (0.3, 0.0), (0.0, 0.5), (0.0, 0.0)])
@pytest.mark.parametrize("n", [6, 17])
def test_pairing_is_the_papers_loop(n, alpha, beta):
    corr = correlated_features(n, n)
    found = zip_pairing(corr, alpha=alpha, beta=beta)
    assert partition(found.cluster) == reference_pairing(corr, alpha, beta)
    assert np.unique(found.cluster).size == n
    budget = int(beta * (n // 2) + 1e-9)
    assert (found.same_model_merges <= max(budget, 0)).all()
    u, m = found.unmerge(), found.merge()
    assert np.array_equal(u.sum(1), np.ones(2 * n)) and np.allclose(m.sum(1), 1.0) and np.allclose(m @ u > 0, np.eye(n))


def test_pairing_without_same_model_merges_is_a_permutation():
    corr = correlated_features(12, 0)
    found = zip_pairing(corr, alpha=0.0, beta=0.0)
    perm = found.as_permutation()
    assert perm is not None and sorted(perm.tolist()) == list(range(12))
    assert found.same_model_merges.tolist() == [0, 0]
    # Same-model merges are taken where a model's features are near-duplicates, and only then.
    merged = zip_pairing(corr, alpha=0.3, beta=1.0)
    assert merged.same_model_merges.sum() > 0 and merged.as_permutation() is None


def test_pairing_errors():
    with pytest.raises(ValueError, match="even size"):
        zip_pairing(np.eye(3), alpha=0.3, beta=0.1)
    bad = np.eye(4)
    bad[0, 1] = np.nan
    with pytest.raises(ValueError, match="finite"):
        zip_pairing(bad, alpha=0.3, beta=0.1)


# --------------------------------------------------------------------------- models


class GroupNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.c2, self.n2 = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.n1(self.c1(x)))
        h = h + torch.relu(self.n2(self.c2(h)))
        return self.fc(h.mean((2, 3)))


def _spread(model: nn.Module, seed: int, x: torch.Tensor) -> nn.Module:
    """Weights spread from their initialisation, BatchNorm statistics of ``x``: no two units alike."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
            if any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
                model.train()
                model(x)
    return model.eval()


def tiny_model(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """A model and 32 inputs (the data and the test inputs)."""
    g = torch.Generator().manual_seed(seed)
    if name in STRUCTURED:
        model, _, x = structured_model(name, seed)
        return model, torch.randn(32, *x.shape[1:], generator=g, dtype=torch.float64)
    if name == "tiny-lm":
        return tiny_lm("untied", seed), torch.randint(0, 40, (16, 7), generator=g)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name == "mlp":
            model, shape = create_model("mlp:6,12,10,3").double(), (32, 6)
        elif name == "vgg-batchnorm":
            model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 4)).double()  # fmt: skip
            shape = (32, 3, 8, 8)
        elif name == "resnet20":
            model, shape = create_model("resnet20:1").double(), (16, 3, 8, 8)
        elif name == "groupnorm":
            model, shape = GroupNormNet().double(), (32, 3, 6, 6)
        else:
            raise KeyError(name)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return _spread(model, seed, x), x


MODELS = ["mlp", "vgg-batchnorm", "resnet20", "groupnorm", "tiny-lm", *STRUCTURED]


def _zip(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # units the tracer leaves in place
        return zipit(*args, **kwargs)


@pytest.mark.parametrize("name", MODELS)
def test_zip_of_a_model_with_itself_is_the_model_stopped_anywhere(name):
    model, x = tiny_model(name)
    full = _zip(model, model, None, [x])
    with torch.no_grad():
        want = model(x)
        assert torch.allclose(full.model(x), want, atol=1e-8)
    assert full.state is not None and full.zipped == full.spec.groups and full.stops
    for stop in full.stops:
        zipped = full.partial(stop)
        assert isinstance(zipped, ZippedModel)
        with torch.no_grad():
            out_a, out_b = zipped(x)
        assert torch.allclose(out_a, want, atol=1e-8) and torch.allclose(out_b, want, atol=1e-8)
        assert zipped.shared_nodes  # the trunk is computed once
    if name != "mlp":
        return
    part = _zip(model, model, None, [x], stop=full.stops[0])  # the same, asked of zipit itself
    assert isinstance(part.model, ZippedModel) and part.state is None and part.zipped[-1] == full.stops[0]


@pytest.mark.parametrize("name", ["mlp", "resnet20", "attention-heads", "grouped-convolution", "tiny-lm"])
def test_zip_without_same_model_merges_is_activation_matching(name):
    """A planted B (A permuted, with noise): the zip with beta = 0 and alpha = 0 pairs every unit of A with
    the one of B that activation matching finds, and merges them into the mean of A and the permuted B."""
    a, x = tiny_model(name)
    spec = _zip(a, a, None, [x], stop=None).spec
    g = torch.Generator().manual_seed(1)
    planted = {}
    for grp in spec.groups:
        planted[grp] = torch.randperm(spec.sizes[grp], generator=g)
    planted = spec_permutation(spec, planted)
    b = copy.deepcopy(a)
    state = apply_permutation(spec, planted, a.state_dict())
    b.load_state_dict({k: v + 1e-3 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
                       for k, v in state.items()})  # fmt: skip
    zipped = _zip(a, b, None, [x], alpha=0.0, beta=0.0)
    perms = zipped.permutations()
    assert perms is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        matched = activation_matching(a, b, None, [x]).perms
    for grp in spec.groups:
        assert torch.equal(perms[grp], matched[grp]), grp
    aligned = matched.apply(b.state_dict())
    for k, v in a.state_dict().items():
        if v.is_floating_point():
            assert torch.allclose(zipped.state[k], (v + aligned[k]) / 2, atol=1e-12), k


def spec_permutation(spec: PermutationSpec, perms: dict) -> dict:
    """Random permutations made valid for the spec (Blocks inner groups permuted within their blocks)."""
    out = dict(perms)
    for inner, outer in spec.blocks.items():
        nb = spec.num_blocks(inner)
        bs = spec.sizes[inner] // nb
        out[inner] = torch.cat([torch.randperm(bs) + j * bs for j in range(nb)])
    return out


def test_merged_weights_are_m_w_u():
    """A one-hidden-layer MLP written out: W1* = M [W1_A; W1_B], W2* = (W2_A U_A + W2_B U_B) / 2."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 3)).double()
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_()
        b[0].weight[:4] = a[0].weight[:4] * 1.5  # some features of B are A's
    x = torch.randn(200, 5, dtype=torch.float64)
    z = _zip(a, b, None, [x], alpha=0.5, beta=1.0)
    (g,) = z.spec.groups
    m, u = z.merge[g].double(), z.unmerge[g].double()
    assert z.pairings[g].same_model_merges.sum() > 0
    sa, sb = a.state_dict(), b.state_dict()
    w1 = m @ torch.cat([sa["0.weight"], sb["0.weight"]])
    b1 = m @ torch.cat([sa["0.bias"], sb["0.bias"]])
    w2 = (sa["2.weight"] @ u[:10] + sb["2.weight"] @ u[10:]) / 2
    b2 = (sa["2.bias"] + sb["2.bias"]) / 2
    for key, want in {"0.weight": w1, "0.bias": b1, "2.weight": w2, "2.bias": b2}.items():
        assert torch.allclose(z.state[key].double(), want, atol=1e-6), key
    # The partial zip stopped at the hidden group: the trunk's features read back by each model's last layer.
    part = _zip(a, b, None, [x], alpha=0.5, beta=1.0, stop=g)
    h = torch.relu(x @ w1.T + b1)
    with torch.no_grad():
        out_a, out_b = part.model(x)
    assert torch.allclose(out_a, h @ (sa["2.weight"] @ u[:10]).T + sa["2.bias"], atol=1e-6)
    assert torch.allclose(out_b, h @ (sb["2.weight"] @ u[10:]).T + sb["2.bias"], atol=1e-6)
    # The same heads as two checkpoints of the architecture, sharing the trunk's entries.
    head_a, head_b = z.partial_states(g)
    assert torch.equal(head_a["0.weight"], head_b["0.weight"])
    for state, out in ((head_a, out_a), (head_b, out_b)):
        copied = copy.deepcopy(a)
        copied.load_state_dict(state)
        with torch.no_grad():
            assert torch.allclose(copied(x), out, atol=1e-10)


def test_structured_groups_are_zipped_as_permutations():
    a, x = tiny_model("attention-heads")
    b, _ = tiny_model("attention-heads", seed=1)
    z = _zip(a, b, None, [x])
    assert z.structured
    for g in z.structured:
        u = z.unmerge[g]
        n = u.shape[1]
        assert torch.equal(u[:n], torch.eye(n, dtype=u.dtype)) and torch.equal(u[n:].sum(0), torch.ones(n, dtype=u.dtype))


def test_a_stop_where_the_trunk_would_read_a_tail_is_refused():
    a, x = tiny_model("resnet20")
    z = _zip(a, a, None, [x], stop=None)
    inside = [g for g in z.spec.groups if g not in z.stops]
    assert inside  # a block's inner group: the stream it reads is produced after it
    with pytest.raises(ValueError, match="cannot stop at"):
        z.partial(inside[0])


def test_errors():
    a, x = tiny_model("mlp")
    with pytest.raises(ValueError, match="alpha"):
        zipit(a, a, None, [x], alpha=1.5)
    with pytest.raises(ValueError, match="beta"):
        zipit(a, a, None, [x], beta=-0.1)
    with pytest.raises(TypeError, match="beta"):
        zipit(a, a, None, [x], beta="0.1")
    with pytest.raises(TypeError, match="stop"):
        zipit(a, a, None, [x], stop=3)
    with pytest.raises(ValueError, match="not a group"):
        zipit(a, a, None, [x], stop="nope")
    with pytest.raises(TypeError, match="model_b"):
        zipit(a, "b", None, [x])
    with pytest.raises(ValueError, match="NaN or infinite"):
        zipit(a, a, None, [x * float("inf")])
