"""activation_matching: recovers planted permutations, matches a numpy/scipy reference, and validates input."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment as scipy_lsa

from pyperm.nn import PermutationSpec, Permutations, TraceError, activation_matching, apply_permutation, models
from pyperm.testing import random_permutations


def make(factory, seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory()


def batches(shape, n: int = 4, seed: int = 0, targets: bool = False):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(shape, generator=gen) for _ in range(n)]
    return [(x, torch.zeros(len(x), dtype=torch.long)) for x in out] if targets else out


def planted(model: nn.Module, spec: PermutationSpec, seed: int = 1, noise: float = 0.0):
    """Model B = a random permutation of A, plus Gaussian noise of ``noise`` times each tensor's std."""
    gen = torch.Generator().manual_seed(seed)
    perms = random_permutations(spec, gen)
    sd = apply_permutation(spec, perms, model.state_dict())
    if noise:
        for k, t in sd.items():
            if t.is_floating_point() and t.numel() > 1 and "running" not in k:
                sd[k] = t + noise * t.std() * torch.randn(t.shape, generator=gen)
    other = copy.deepcopy(model)
    other.load_state_dict(sd)
    return other, perms


def assert_recovered(result, model_a: nn.Module, model_b: nn.Module) -> None:
    """Permuting B with the result gives back A exactly (a noiseless planted permutation)."""
    aligned = apply_permutation(result.spec, result.perms, model_b.state_dict())
    for k, t in model_a.state_dict().items():
        assert torch.equal(aligned[k], t), k


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random BatchNorm affine parameters, and running statistics measured on random inputs.

    Measured statistics keep every ReLU alive on the test data: a unit that is zero on every
    sample has no correlation with anything, so its match would be arbitrary.
    """
    gen = torch.Generator().manual_seed(seed)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    with torch.no_grad():
        for m in bns:
            m.weight.copy_(1 + 0.2 * torch.randn(m.num_features, generator=gen))
            m.bias.copy_(0.2 * torch.randn(m.num_features, generator=gen))
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the calibration batches
        model.train()(torch.randn(16, 3, 32, 32, generator=gen))
    for m in bns:
        m.momentum = 0.1
    return model.eval()


# --------------------------------------------------------------------------- recovery


@pytest.mark.parametrize("cost", ["correlation", "ols"])
@pytest.mark.parametrize("pre_activation", [False, True])
def test_mlp_recovers_a_planted_permutation(cost, pre_activation, device):
    a = make(lambda: models.MLP([10, 32, 24, 3])).to(device)
    spec = a.permutation_spec()
    b, _ = planted(a, spec)
    data = [x.to(device) for x in batches((64, 10))]
    result = activation_matching(a, b, spec, data, cost=cost, pre_activation=pre_activation)
    assert isinstance(result.perms, Permutations) and result.perms.spec is result.spec is spec
    assert set(result.perms) == {"hidden1", "hidden2"}
    assert all(p.dtype == torch.int64 and p.device.type == "cpu" for p in result.perms.values())
    assert_recovered(result, a, b)
    assert result.num_batches == 4 and result.num_samples == {"hidden1": 256, "hidden2": 256}
    if cost == "correlation":  # 1 for every live unit, 0 for the dead ReLUs (zero variance)
        assert all(0.5 < s <= 1 + 1e-6 for s in result.similarity.values())
    assert all(result.similarity[g] > result.identity_similarity[g] for g in result.perms)
    modules = [s.module for g in ("hidden1", "hidden2") for s in result.sites[g]]
    assert modules == (["layers.0", "layers.1"] if pre_activation else ["", ""])


def test_traced_spec_is_the_default():
    a = make(lambda: nn.Sequential(nn.Linear(5, 20), nn.Tanh(), nn.Linear(20, 12), nn.GELU(), nn.Linear(12, 2)))
    spec = PermutationSpec.from_model(a, torch.randn(1, 5))
    b, _ = planted(a, spec)
    result = activation_matching(a, b, None, batches((50, 5), targets=True))
    assert result.spec.equivalent(spec) and set(result.perms) == {"P_0", "P_2"}
    assert_recovered(result, a, b)


def test_vgg_recovers_with_noise():
    a = randomize_bn(make(lambda: models.VGG11()))
    spec = a.permutation_spec()
    b, perms = planted(a, spec, noise=0.01)
    result = activation_matching(a, b, None, batches((6, 3, 32, 32), n=2))
    hand = result.spec.group_correspondence(spec)
    assert hand is not None
    for g, p in result.perms.items():
        # perms[g] undoes the planted one: B's unit perms[g][i] is A's unit i.
        inv = torch.argsort(perms[hand[g]])
        assert torch.equal(p, inv), g


@pytest.mark.parametrize("shortcut", ["A", "B"])
def test_resnet_residual_groups(shortcut):
    a = randomize_bn(make(lambda: models.ResNet20(shortcut=shortcut)))
    spec = a.permutation_spec()
    b, _ = planted(a, spec)
    result = activation_matching(a, b, spec, batches((4, 3, 16, 16), n=2))
    assert set(result.perms) == set(spec.sizes)
    assert_recovered(result, a, b)
    if shortcut == "B":
        # The residual stream of stage 1 is read after the stem and after each of its 3 blocks.
        assert len(result.sites["stage1"]) == 4
        assert result.num_samples["stage1"] == 4 * (2 * 4 * 16 * 16)


def test_residual_sites_are_averaged_before_one_assignment():
    """The stream's matrix is the mean of its sites' correlation matrices (Tatro et al. appendix D)."""
    a = randomize_bn(make(lambda: models.ResNet20(width_multiplier=1)))
    b = randomize_bn(make(lambda: models.ResNet20(width_multiplier=1), seed=5), seed=5)
    data = batches((6, 3, 8, 8), n=2)
    result = activation_matching(a, b, a.permutation_spec(), data)
    sites = result.sites["stage1"]
    grabbed: dict[str, list[list[np.ndarray]]] = {s.module: [[], []] for s in sites}

    def hook(idx, path):
        def fn(module, inputs, output):
            grabbed[path][idx].append(output.detach().movedim(1, -1).reshape(-1, output.shape[1]).numpy())

        return fn

    # The sites are the F.relu after the stem (module "") and at the end of each block.
    handles = []
    for idx, model in enumerate((a, b)):
        for s in sites:
            if s.module:
                handles.append(model.get_submodule(s.module).register_forward_hook(hook(idx, s.module)))
    with torch.no_grad():
        for x in data:
            a.eval()(x), b.eval()(x)
            for idx, model in enumerate((a, b)):
                grabbed[""][idx].append(F.relu(model.bn1(model.conv1(x))).movedim(1, -1).reshape(-1, 16).numpy())
    for h in handles:
        h.remove()
    corr = []
    for za, zb in grabbed.values():
        za, zb = np.concatenate(za), np.concatenate(zb)
        c = np.corrcoef(za.T, zb.T)[:16, 16:]
        corr.append(np.nan_to_num(c))
    _, want = scipy_lsa(np.mean(corr, axis=0), maximize=True)
    np.testing.assert_array_equal(result.perms["stage1"].numpy(), want)


@pytest.mark.parametrize("cost", ["correlation", "ols"])
def test_matches_a_numpy_reference(cost):
    a = make(lambda: models.MLP([6, 20, 5]))
    b = make(lambda: models.MLP([6, 20, 5]), seed=3)
    data = batches((40, 6), n=3)
    result = activation_matching(a, b, None, data, cost=cost)
    with torch.no_grad():
        za = np.concatenate([F.relu(a.layers[0](x)).numpy() for x in data]).astype(np.float64)
        zb = np.concatenate([F.relu(b.layers[0](x)).numpy() for x in data]).astype(np.float64)
    if cost == "correlation":
        m = np.nan_to_num(np.corrcoef(za.T, zb.T)[:20, 20:])
    else:
        m = za.T @ zb / len(za)
    _, want = scipy_lsa(m, maximize=True)
    (g,) = result.perms
    np.testing.assert_array_equal(result.perms[g].numpy(), want)
    np.testing.assert_allclose(result.similarity[g], m[np.arange(20), want].mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.identity_similarity[g], np.trace(m) / 20, rtol=1e-5, atol=1e-6)


def test_inplace_relu_does_not_corrupt_pre_activations():
    def factory():
        return nn.Sequential(nn.Linear(5, 16), nn.ReLU(inplace=True), nn.Linear(16, 2))

    a = make(factory)
    spec = PermutationSpec.from_model(a, torch.randn(1, 5))
    b, _ = planted(a, spec)
    result = activation_matching(a, b, None, batches((64, 5)), pre_activation=True)
    assert result.sites["P_0"][0].module == "0"
    assert_recovered(result, a, b)


def test_data_forms_and_max_batches():
    a = make(lambda: models.MLP([4, 12, 2]))
    b, _ = planted(a, a.permutation_spec())
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(100, 4), torch.zeros(100)), batch_size=16
    )
    result = activation_matching(a, b, None, loader, max_batches=np.int64(3))  # numpy ints are ints
    assert result.num_batches == 3 and sum(result.num_samples.values()) == 48
    assert_recovered(result, a, b)
    gen = (x for x in batches((16, 4), n=5))  # a one-shot iterator
    assert activation_matching(a, b, None, gen).num_batches == 5


def test_multiple_inputs():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(3, 10), nn.Linear(4, 10), nn.Linear(10, 2)

        def forward(self, x, y):
            return self.out(torch.relu(self.a(x) + self.b(y)))

    a = make(Two)
    spec = PermutationSpec.from_model(a, (torch.randn(1, 3), torch.randn(1, 4)))
    b, _ = planted(a, spec)
    data = [((torch.randn(32, 3), torch.randn(32, 4)), torch.zeros(32)) for _ in range(2)]
    assert_recovered(activation_matching(a, b, None, data), a, b)


def test_models_are_left_as_they_were():
    a = randomize_bn(make(lambda: models.TinyTen())).train()
    b = randomize_bn(make(lambda: models.TinyTen(), seed=1), seed=1)
    b.eval()
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (a, b)]
    activation_matching(a, b, None, batches((2, 3, 32, 32), n=1))
    assert a.training and all(m.training for m in a.modules())
    assert not b.training and not any(m.training for m in b.modules())
    for m, sd in zip((a, b), before):
        for k, v in m.state_dict().items():
            assert torch.equal(v, sd[k]), k


def test_progress_bar_and_no_groups(capsys):
    a = make(lambda: models.MLP([4, 8, 2]))
    b = make(lambda: models.MLP([4, 8, 2]), seed=1)
    result = activation_matching(a, b, None, batches((8, 4), n=2), progress=True)
    assert result.num_batches == 2
    assert "activation matching" in capsys.readouterr().err
    lin_a, lin_b = make(lambda: models.MLP([4, 2])), make(lambda: models.MLP([4, 2]), seed=1)
    empty = activation_matching(lin_a, lin_b, None, batches((8, 4), n=2))
    assert empty.perms == {} and empty.spec.sizes == {}
    assert isinstance(empty.perms, Permutations) and empty.perms.spec is empty.spec


def test_subset_spec():
    """A spec may leave some of the traced groups out (they are not matched)."""
    a = make(lambda: models.MLP([6, 10, 9, 2]))
    full = a.permutation_spec()
    axes = {k: tuple(None if g == "hidden2" else g for g in v) for k, v in full.axes.items()}
    spec = PermutationSpec(axes, {"hidden1": 10})
    b, _ = planted(a, spec)
    result = activation_matching(a, b, spec, batches((32, 6)))
    assert set(result.perms) == {"hidden1"}
    assert_recovered(result, a, b)


# --------------------------------------------------------------------------- errors


def test_error_mismatched_models():
    a = models.MLP([4, 8, 2])
    msg = r"model_a and model_b differ in 'layers\.0\.weight': shapes \(8, 4\) and \(9, 4\)"
    with pytest.raises(ValueError, match=msg):
        activation_matching(a, models.MLP([4, 9, 2]), None, batches((4, 4)))
    with pytest.raises(ValueError, match="model_a and model_b have different keys"):
        activation_matching(a, models.MLP([4, 8, 8, 2]), None, batches((4, 4)))

    class Tanh(models.MLP):
        def forward(self, x):
            return self.layers[1](torch.tanh(self.layers[0](x)))

    with pytest.raises(ValueError, match="trace to different graphs"):
        activation_matching(a, Tanh([4, 8, 2]), None, batches((4, 4)))
    with pytest.raises(TypeError, match="model_b must be a torch.nn.Module"):
        activation_matching(a, a.state_dict(), None, batches((4, 4)))


def test_error_empty_data():
    a, b = models.MLP([4, 8, 2]), models.MLP([4, 8, 2])
    with pytest.raises(ValueError, match="data yielded no batches"):
        activation_matching(a, b, None, [])
    with pytest.raises(ValueError, match="data held no samples for group 'P_layers.0'"):
        activation_matching(a, b, None, [torch.zeros(0, 4)])
    with pytest.raises(TypeError, match="data must be an iterable of batches"):
        activation_matching(a, b, None, 3)
    with pytest.raises(TypeError, match=r"data\[1\] must be a tensor of inputs"):
        activation_matching(a, b, None, [torch.zeros(2, 4), {"x": torch.zeros(2, 4)}])


def test_error_bad_arguments():
    a, b = models.MLP([4, 8, 2]), models.MLP([4, 8, 2])
    data = batches((4, 4))
    with pytest.raises(ValueError, match="cost must be one of 'correlation', 'ols', got 'l2'"):
        activation_matching(a, b, None, data, cost="l2")
    with pytest.raises(ValueError, match="max_batches must be at least 1"):
        activation_matching(a, b, None, data, max_batches=0)
    with pytest.raises(TypeError, match="max_batches must be a positive int"):
        activation_matching(a, b, None, data, max_batches=2.0)
    with pytest.raises(TypeError, match="pre_activation must be a bool"):
        activation_matching(a, b, None, data, pre_activation="yes")
    with pytest.raises(TypeError, match="spec must be a pyperm.nn.PermutationSpec"):
        activation_matching(a, b, {"hidden1": 8}, data)
    with pytest.raises(TypeError, match="positional"):
        activation_matching(a, b, None, data, "ols")  # type: ignore[misc]
    with pytest.raises(ValueError, match="composite must be 'fix' or 'raise'"):
        activation_matching(a, b, None, data, composite="nope")


def test_error_spec_mismatch():
    a, b = models.MLP([4, 8, 6, 2]), models.MLP([4, 8, 6, 2])
    full = a.permutation_spec()
    # One group over both hidden layers is not a symmetry of the model.
    merged = PermutationSpec({k: tuple(None if g is None else "h" for g in v) for k, v in full.axes.items()
                              if k != "layers.1.weight"} | {"layers.1.weight": (None, None)}, {"h": 8, })  # fmt: skip
    with pytest.raises(ValueError, match="spec group 'h' .* matches no group of the traced model"):
        activation_matching(a, b, merged, batches((4, 4)))
    other = models.MLP([4, 8, 2]).permutation_spec()
    with pytest.raises(ValueError, match="spec does not match the models' state_dict"):
        activation_matching(a, b, other, batches((4, 4)))


def test_error_non_finite_activations():
    a, b = models.MLP([4, 8, 2]), models.MLP([4, 8, 2])
    x = torch.randn(4, 4)
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="activations of group 'P_layers.0'"):
        activation_matching(a, b, None, [x])


def test_error_untraceable_model():
    class Dynamic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else x

    with pytest.raises(TraceError, match="could not trace Dynamic"):
        activation_matching(Dynamic(), Dynamic(), None, batches((2, 3)))


def test_the_default_trace_permutes_a_flattened_map_and_a_flat_spec_is_taken_quietly():
    """The traced spec is structured: a flatten of a 2x2 map keeps its channels permutable (nothing left
    unaligned, nothing reported). A given flat spec names the groups, so nothing is reported either."""
    model = make(lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2)))
    data = batches((8, 3, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = activation_matching(model, copy.deepcopy(model), None, data)
        assert {g: len(p) for g, p in result.perms.items()} == {"P_0": 4}
        assert result.perms.spec.structured
        spec = PermutationSpec.from_model(model, data[0], composite="fix", structured=False)
        assert activation_matching(model, copy.deepcopy(model), spec, data).perms == {}
