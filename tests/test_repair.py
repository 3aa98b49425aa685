"""repair (REPAIR): the units' statistics after repair equal the interpolated endpoint statistics."""

import copy

import pytest
import torch
from _digits import batches, digits, trained_pair
from torch import nn

from pyperm.nn import PermutationSpec
from pyperm.nn.eval.batchnorm import reset_bn_stats
from pyperm.nn.eval.repair import repair
from pyperm.nn.state import interpolate
from pyperm.testing import one_thread


def _unit_stats(model, state, paths, data, axis=1):
    """Per-unit mean and std (unbiased) of each module's output, over all of ``data``, in eval mode (by hand)."""
    probe = copy.deepcopy(model)
    probe.load_state_dict(state)
    probe.eval()
    seen = {p: [] for p in paths}
    hooks = [
        probe.get_submodule(p).register_forward_hook(lambda m, i, o, p=p: seen[p].append(o.detach())) for p in paths
    ]
    with torch.no_grad():
        for batch in data:
            probe(batch[0] if isinstance(batch, (tuple, list)) else batch)
    for h in hooks:
        h.remove()
    out = {}
    for p, chunks in seen.items():
        z = torch.cat(chunks).double()
        z = z.movedim(axis, -1).reshape(-1, z.shape[axis])
        out[p] = (z.mean(0), z.std(0))
    return out


def _assert_repaired(model, a, b, t, repaired, paths, data, axis=1):
    """Within 1%: std relative to its target, mean to within 1% of the target std."""
    stats_a, stats_b = _unit_stats(model, a, paths, data, axis), _unit_stats(model, b, paths, data, axis)
    stats = _unit_stats(model, repaired, paths, data, axis)
    for p in paths:
        mean = (1 - t) * stats_a[p][0] + t * stats_b[p][0]
        std = (1 - t) * stats_a[p][1] + t * stats_b[p][1]
        got_mean, got_std = stats[p]
        assert torch.all((got_std - std).abs() <= 0.01 * std), p
        assert torch.all((got_mean - mean).abs() <= 0.01 * std), p


@pytest.fixture(scope="module")
def digits_pair():
    return trained_pair()


def test_digits_units_match_their_targets(digits_pair):
    model, a, _, b = digits_pair
    x, y, _, _ = digits()
    data = batches(x, y, 350)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with one_thread():
        repaired = repair(model, None, a, b, data, t=0.5)
        _assert_repaired(model, a, b, 0.5, repaired, ["0", "2"], data)
        # Without the repair the hidden units have collapsed: the test above is not vacuous.
        plain = interpolate(a, b, 0.5)
        stats, goal_a = _unit_stats(model, plain, ["2"], data), _unit_stats(model, a, ["2"], data)
        assert float(stats["2"][1].mean()) < 0.95 * float(goal_a["2"][1].mean())
        # and the repaired midpoint fits the data better than the plain interpolation.
        probe = copy.deepcopy(model)
        losses = []
        for state in (plain, repaired):
            probe.load_state_dict(state)
            with torch.no_grad():
                losses.append(float(nn.functional.cross_entropy(probe(x), y)))
    assert losses[1] < losses[0]
    assert sorted(repaired) == sorted(a)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_endpoints_come_back_unchanged(digits_pair):
    model, a, _, b = digits_pair
    x, y, _, _ = digits()
    with one_thread():
        for t, end in ((0.0, a), (1.0, b)):
            out = repair(model, None, a, b, batches(x, y, 700), t=t)
            for k in end:
                torch.testing.assert_close(out[k], end[k], rtol=1e-4, atol=1e-5)


def _conv_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 5, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(5, 3),
    )


def _conv_states(model, data):
    """Two random endpoints of ``model`` whose BatchNorm statistics are their own (reset on ``data``)."""
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        m = copy.deepcopy(model)
        for p in m.parameters():
            nn.init.normal_(p, std=0.5)
        reset_bn_stats(m, data)
        states.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    return states


def test_conv_batchnorm_units_match_their_targets():
    model = _conv_model()
    gen = torch.Generator().manual_seed(3)
    data = [torch.randn(n, 2, 7, 7, generator=gen) for n in (16, 9, 24)]
    a, b = _conv_states(model, data)
    a_copy = {k: v.clone() for k, v in a.items()}
    repaired = repair(model, None, a, b, data, t=0.3)
    # Site '1' is the BatchNorm output (eval mode), site '3' the second convolution's.
    _assert_repaired(model, a, b, 0.3, repaired, ["1", "3"], data)
    assert all(torch.equal(a[k], a_copy[k]) for k in a)
    # The BatchNorm's running statistics are the exact statistics of its input in the repaired model.
    probe = copy.deepcopy(model)
    probe.load_state_dict(repaired)
    with torch.no_grad():
        h = torch.cat([probe[0](x) for x in data]).movedim(1, -1).reshape(-1, 6).double()
    torch.testing.assert_close(repaired["1.running_mean"].double(), h.mean(0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(repaired["1.running_var"].double(), h.var(0), rtol=1e-4, atol=1e-5)


def test_layernorm_affine_takes_the_correction():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    a = {k: v.clone() for k, v in model.state_dict().items()}
    b = {k: v + 0.3 * torch.randn_like(v) for k, v in a.items()}
    data = [torch.randn(40, 5), torch.randn(13, 5)]
    repaired = repair(model, None, a, b, data, t=0.5)
    _assert_repaired(model, a, b, 0.5, repaired, ["1", "3"], data)


def test_spec_limits_the_repair_to_its_groups():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 2))
    a = {k: v.clone() for k, v in model.state_dict().items()}
    b = {k: torch.randn_like(v) for k, v in a.items()}
    data = [torch.randn(30, 4)]
    full = PermutationSpec.from_model(model, data[0])
    second = next(g for g, where in full.group_axes.items() if ("2.weight", 0) in where)
    only = PermutationSpec(
        {k: tuple(g if g == second else None for g in axes) for k, axes in full.axes.items()},
        {second: full.sizes[second]},
    )
    repaired = repair(model, only, a, b, data, t=0.5)
    plain = interpolate(a, b, 0.5)
    assert torch.equal(repaired["0.weight"], plain["0.weight"]) and torch.equal(repaired["0.bias"], plain["0.bias"])
    assert not torch.equal(repaired["2.weight"], plain["2.weight"])
    _assert_repaired(model, a, b, 0.5, repaired, ["2"], data)


def test_a_model_without_hidden_units_gets_the_interpolation():
    model = nn.Linear(3, 2)
    a = {k: v.clone() for k, v in model.state_dict().items()}
    b = {k: v + 1 for k, v in a.items()}
    out = repair(model, None, a, b, [torch.randn(5, 3)], t=0.25)
    assert all(torch.equal(out[k], interpolate(a, b, 0.25)[k]) for k in a)


class _Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 3))
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.relu(x @ self.w.T))


def test_bad_arguments():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    a = {k: v.clone() for k, v in model.state_dict().items()}
    b = {k: v + 1 for k, v in a.items()}
    data = [torch.randn(8, 3)]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        repair(a, None, a, b, data, t=0.5)
    with pytest.raises(TypeError, match="t must be a real number"):
        repair(model, None, a, b, data, t="half")
    with pytest.raises(ValueError, match=r"t must lie in \[0, 1\]"):
        repair(model, None, a, b, data, t=1.5)
    with pytest.raises(TypeError, match="data is read several times"):
        repair(model, None, a, b, iter(data), t=0.5)
    with pytest.raises(ValueError, match="data yielded no batches"):
        repair(model, None, a, b, [], t=0.5)
    with pytest.raises(ValueError, match="'2.bias' is only in state_a"):
        repair(model, None, a, {k: v for k, v in b.items() if k != "2.bias"}, data, t=0.5)
    with pytest.raises(TypeError, match="spec must be a pyperm.nn.PermutationSpec"):
        repair(model, {"h": 4}, a, b, data, t=0.5)
    with pytest.raises(TypeError, match="takes 5 positional arguments"):
        repair(model, None, a, b, data, 0.5)  # t is keyword-only
    foreign = PermutationSpec(
        {"0.weight": (None, "x"), "0.bias": (None,), "2.weight": (None, None), "2.bias": (None,)}, {"x": 3}
    )
    with pytest.raises(ValueError, match="spec group 'x'"):
        repair(model, foreign, a, b, data, t=0.5)
    functional = _Functional()
    fa = {k: v.clone() for k, v in functional.state_dict().items()}
    with pytest.raises(ValueError, match="repair cannot fold a correction into the pre-activation site"):
        repair(functional, None, fa, {k: v + 1 for k, v in fa.items()}, data, t=0.5)


def test_a_bundled_models_own_spec_names_the_groups():
    from pyperm.nn.models import MLP

    torch.manual_seed(7)
    model = MLP([6, 9, 8, 3])
    a = {k: v.clone() for k, v in model.state_dict().items()}
    b = {k: v + 0.5 * torch.randn_like(v) for k, v in a.items()}
    data = [torch.randn(25, 6), torch.randn(10, 6)]
    by_spec = repair(model, model.permutation_spec(), a, b, data, t=0.5)
    traced = repair(model, None, a, b, data)  # t defaults to the midpoint
    assert all(torch.equal(by_spec[k], traced[k]) for k in a)


class _RMSNorm(nn.Module):
    """RMSNorm written out, as Hugging Face's LlamaRMSNorm (``plus_one``: as Gemma's, scaling by 1 + weight)."""

    def __init__(self, n, plus_one=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n) if plus_one else torch.ones(n))
        self.plus_one = plus_one

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * (1 + self.weight) if self.plus_one else self.weight * x


_NORM_LAYERS = {"layernorm": nn.LayerNorm, "rmsnorm": _RMSNorm, "plus-one": lambda n: _RMSNorm(n, plus_one=True)}


class _PreNorm(nn.Module):
    """A pre-norm transformer block written out (torch.fx traces it): a residual stream read by three norms, an
    attention of two heads, an MLP."""

    def __init__(self, norm):
        super().__init__()
        norm = _NORM_LAYERS[norm]
        self.embed = nn.Linear(6, 16)
        self.norm1, self.norm2, self.norm_f = norm(16), norm(16), norm(16)
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.up, self.down, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 3)

    @staticmethod
    def _heads(x):
        return x.reshape(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)

    def forward(self, x):
        h = self.embed(x)
        a = self.norm1(h)
        y = nn.functional.scaled_dot_product_attention(self._heads(self.q(a)), self._heads(self.k(a)),
                                                       self._heads(self.v(a)))  # fmt: skip
        h = h + self.o(y.transpose(1, 2).flatten(2))
        h = h + self.down(nn.functional.gelu(self.up(self.norm2(h))))
        return self.head(self.norm_f(h)).mean(1)


def _prenorm_pair(norm):
    torch.manual_seed(8)
    model = _PreNorm(norm).double().eval()
    a = {k: v + 0.2 * torch.randn_like(v) for k, v in model.state_dict().items()}
    b = {k: v + 0.5 * torch.randn_like(v) for k, v in a.items()}
    model.load_state_dict(a)
    return model, a, b, [torch.randn(n, 5, 6, dtype=torch.float64) for n in (7, 4)]


def _changed(repaired, a, b, t=0.5):
    plain = interpolate(a, b, t)
    return {k.rpartition(".")[0] for k in a if not torch.equal(repaired[k], plain[k])}


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_a_stream_read_by_norms_is_corrected_at_their_outputs(norm):
    """The residual stream is corrected where the norms read it, not where the embedding and the output projections
    write it; the MLP at its first layer; the query, key and value units are left, with one warning."""
    model, a, b, data = _prenorm_pair(norm)
    with pytest.warns(RuntimeWarning, match="query, key and value units that meet other activations") as caught:
        repaired = repair(model, None, a, b, data, t=0.5)
    assert len(caught) == 1 and all(f"'Linear' of '{p}'" in str(caught[0].message) for p in "qkv")
    assert _changed(repaired, a, b) == {"norm1", "norm2", "norm_f", "up"}
    paths = ["norm1", "norm2", "norm_f", "up"]
    ends = [_unit_stats(model, s, paths, data, axis=-1) for s in (a, b)]
    got = _unit_stats(model, repaired, paths, data, axis=-1)
    for p in paths:
        mean, std = (ends[0][p][i] / 2 + ends[1][p][i] / 2 for i in (0, 1))
        torch.testing.assert_close(got[p][1], std, rtol=1e-6, atol=0, msg=p)
        if p == "up" or norm == "layernorm":  # an RMSNorm has no bias: its units' spread only is corrected
            assert torch.all((got[p][0] - mean).abs() <= 1e-6 * std), p
    with pytest.warns(RuntimeWarning, match="query, key and value"):
        at_a = repair(model, None, a, b, data, t=0.0)
    assert all(torch.allclose(at_a[k], a[k], rtol=1e-9, atol=1e-12) for k in a)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.relu(self.shared(torch.relu(self.shared(torch.relu(self.inp(x)))))))


def test_sites_that_cannot_take_a_correction_are_left_with_one_warning():
    # Norms scaling by 1 + weight: the stream is left (not corrected at the embedding either), the MLP repaired.
    model, a, b, data = _prenorm_pair("plus-one")
    with pytest.warns(RuntimeWarning) as caught:
        repaired = repair(model, None, a, b, data)
    message = str(caught[0].message)
    assert len(caught) == 1 and message.count("_RMSNorm whose output is not linear in its weight") == 3
    assert "query, key and value units" in message and "repair leaves the units at 6 site(s)" in message
    assert _changed(repaired, a, b) == {"up"}
    # A layer applied twice: its correction would act on both calls.
    torch.manual_seed(9)
    twice = _Twice()
    a = {k: v.clone() for k, v in twice.state_dict().items()}
    b = {k: torch.randn_like(v) for k, v in a.items()}
    with pytest.warns(RuntimeWarning, match="'Linear' of 'shared' .*: Linear called 2 times in the forward"):
        repaired = repair(twice, None, a, b, [torch.randn(20, 4)])
    assert _changed(repaired, a, b) == {"inp"}
