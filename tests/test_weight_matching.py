"""weight_matching: planted permutations, agreement with a plain implementation, properties, errors."""

import math
import sys

import numpy as np
import pytest
import torch
from torch import nn

import pyperm
from pyperm.testing import random_permutations, reference_weight_matching
from pyperm.nn import (
    PermutationSpec,
    Permutations,
    WeightMatchingResult,
    apply_permutation,
    matching_objective,
    weight_matching,
)
from pyperm.nn.spec import Blocks, Segments, Tiled
from pyperm.nn.models import MLP, VGG11, VGG16, ResNet20, TinyTen


def _make(factory, seed: int) -> nn.Module:
    """A model with seeded initialisation, leaving the global RNG state alone."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = factory()
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():  # BatchNorm defaults are constant: give them something to match
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))
                m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
    return model


def _planted(spec: PermutationSpec, state: dict, seed: int, noise: float = 0.01):
    """B = a random permutation of A plus Gaussian noise of ``noise`` times each tensor's std."""
    g = torch.Generator().manual_seed(seed)
    perms = random_permutations(spec, g)
    permuted = apply_permutation(spec, perms, state)
    out = {}
    for k, t in permuted.items():
        if t.is_floating_point() and t.numel() > 1:
            t = t + noise * t.std() * torch.randn(t.shape, generator=g)
        out[k] = t
    return perms, out


def _inverse(p: torch.Tensor) -> torch.Tensor:
    return torch.argsort(p)


BUNDLED = {
    "mlp": lambda: MLP([784, 512, 512, 512, 10]),
    "vgg11": lambda: VGG11(),
    "vgg16": lambda: VGG16(),
    "resnet20-B": lambda: ResNet20(width_multiplier=2),
    "resnet20-A": lambda: ResNet20(shortcut="A"),
    "tinyten": lambda: TinyTen(),
}


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_recovers_planted_permutation_exactly(name):
    model = _make(BUNDLED[name], 0)
    spec = model.permutation_spec()
    sa = model.state_dict()
    planted, sb = _planted(spec, sa, seed=1)
    result = weight_matching(spec, sa, sb, seed=0)
    assert result.converged
    # apply_permutation(perms, B) must undo the planted permutation
    for g in spec.sizes:
        assert torch.equal(result.perms[g], _inverse(planted[g])), g
    # and the permuted B is within the noise of A
    aligned = apply_permutation(spec, result.perms, sb)
    for k, t in sa.items():
        if t.is_floating_point() and t.numel() > 1:
            assert (aligned[k] - t).abs().max() <= 0.1 * t.std() + 1e-6, k


# Independently initialised models: the incremental algorithm must follow the plain one
# step by step (same seeded order, same assignments), so the answers are identical.
INDEPENDENT = {
    "mlp": lambda: MLP([20, 48, 40, 32, 5]),
    "mlp-wide": lambda: MLP([24, 1100, 1100, 6]),  # groups over 1024 units: warm JV solves
    "resnet20-B": lambda: ResNet20(),
    "resnet20-A": lambda: ResNet20(shortcut="A"),
    "tinyten": lambda: TinyTen(),
}


@pytest.mark.parametrize("name", ["mlp", "mlp-wide", "resnet20-B", "resnet20-A", "tinyten"])
@pytest.mark.parametrize("seed", [0, 3])
def test_matches_plain_implementation(name, seed):
    a = _make(INDEPENDENT[name], 10)
    b = _make(INDEPENDENT[name], 20)
    spec = a.permutation_spec()
    sa, sb = a.state_dict(), b.state_dict()
    result = weight_matching(spec, sa, sb, seed=seed, init="identity")
    ref, sweeps = reference_weight_matching(spec, sa, sb, seed=seed, lsa=pyperm.linear_sum_assignment)
    assert result.converged
    assert result.iterations == sweeps
    for g in spec.sizes:
        assert torch.equal(result.perms[g], ref[g]), g
    exact = matching_objective(spec, sa, sb, result.perms)
    assert result.objective[-1] == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize("name", ["mlp", "resnet20-B"])
def test_rebuilds_after_every_correction_give_the_same_answer(name, monkeypatch):
    """With at most one correction between rebuilds, every kept similarity (a linear group's
    sum, a convolution term's value) is rebuilt from scratch at almost every visit: the
    answer must not depend on how a similarity was kept up to date."""
    wm_module = sys.modules["pyperm.nn.align._similarity"]  # where the correction limit lives
    a = _make(INDEPENDENT[name], 10)
    b = _make(INDEPENDENT[name], 20)
    spec = a.permutation_spec()
    sa, sb = a.state_dict(), b.state_dict()
    kept = weight_matching(spec, sa, sb, seed=1)
    monkeypatch.setattr(wm_module, "_MAX_CORRECTIONS", 1)
    rebuilt = weight_matching(spec, sa, sb, seed=1)
    assert rebuilt.iterations == kept.iterations
    for g in spec.sizes:
        assert torch.equal(rebuilt.perms[g], kept.perms[g]), g


def test_history_is_non_decreasing_and_consistent():
    a = _make(lambda: MLP([30, 64, 64, 64, 4]), 1)
    b = _make(lambda: MLP([30, 64, 64, 64, 4]), 2)
    spec = a.permutation_spec()
    result = weight_matching(spec, a.state_dict(), b.state_dict(), seed=5, init="identity")
    hist = result.objective
    assert len(hist) == result.iterations + 1
    assert hist[0] == pytest.approx(matching_objective(spec, a.state_dict(), b.state_dict()), rel=1e-9)
    assert all(y >= x - 1e-9 * abs(x) for x, y in zip(hist, hist[1:]))
    assert hist[-1] > hist[0]
    assert result.converged and hist[-1] == hist[-2]  # the last sweep improved nothing
    assert hist[-1] == pytest.approx(matching_objective(spec, a.state_dict(), b.state_dict(), result.perms), rel=1e-6)


def test_result_types():
    a = _make(lambda: ResNet20(), 1)
    b = _make(lambda: ResNet20(), 2)
    spec = a.permutation_spec()
    result = weight_matching(spec, a.state_dict(), b.state_dict(), max_iter=2)
    assert isinstance(result, WeightMatchingResult)
    assert isinstance(result.perms, Permutations) and result.perms.spec is spec
    assert set(result.perms) == set(spec.sizes)
    for g, p in result.perms.items():
        assert p.dtype == torch.int64 and p.device.type == "cpu"
        assert torch.equal(torch.sort(p).values, torch.arange(spec.sizes[g]))
    assert isinstance(result.iterations, int) and result.iterations <= 2
    assert isinstance(result.converged, bool)
    assert all(isinstance(x, float) for x in result.objective)


def test_options_are_keyword_only_and_numpy_ints_are_ints():
    a = _make(lambda: MLP([8, 12, 3]), 1)
    b = _make(lambda: MLP([8, 12, 3]), 2)
    spec = a.permutation_spec()
    with pytest.raises(TypeError, match="positional"):
        weight_matching(spec, a.state_dict(), b.state_dict(), 10)  # type: ignore[misc]
    plain = weight_matching(spec, a.state_dict(), b.state_dict(), max_iter=3, seed=1)
    numpy = weight_matching(spec, a.state_dict(), b.state_dict(), max_iter=np.int64(3), seed=np.int32(1))
    assert numpy.perms == plain.perms and numpy.iterations == plain.iterations


def test_init_takes_permutations_and_a_structured_spec_returns_them():
    a = _make(lambda: MLP([8, 12, 10, 3]), 1)
    b = _make(lambda: MLP([8, 12, 10, 3]), 2)
    spec = a.permutation_spec()
    start = Permutations(spec, random_permutations(spec, 3))
    none = weight_matching(spec, a.state_dict(), b.state_dict(), init=start, max_iter=0)
    assert none.perms == start and none.iterations == 0
    # A spec with a structured axis: the same matcher, the same result type.
    tiled = PermutationSpec({"w1": ("h", None), "w2": (None, Tiled("h", inner=2))}, {"h": 3})
    sa = {"w1": torch.randn(3, 2), "w2": torch.randn(1, 6)}
    found = weight_matching(tiled, sa, sa)
    assert isinstance(found.perms, Permutations) and found.perms.spec is tiled and found.perms.is_identity()
    assert isinstance(found.iterations, int) and found.converged


def test_seed_reproducible_and_generator_accepted():
    a = _make(lambda: MLP([16, 40, 40, 40, 40, 3]), 1)
    b = _make(lambda: MLP([16, 40, 40, 40, 40, 3]), 2)
    spec = a.permutation_spec()
    r1 = weight_matching(spec, a.state_dict(), b.state_dict(), seed=7)
    r2 = weight_matching(spec, a.state_dict(), b.state_dict(), seed=7)
    r3 = weight_matching(spec, a.state_dict(), b.state_dict(), seed=torch.Generator().manual_seed(7))
    for g in spec.sizes:
        assert torch.equal(r1.perms[g], r2.perms[g]) and torch.equal(r1.perms[g], r3.perms[g])
    assert r1.objective == r2.objective
    # the global RNG is neither used nor advanced
    state = torch.random.get_rng_state()
    weight_matching(spec, a.state_dict(), b.state_dict(), seed=1)
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("name", ["mlp", "resnet20-B", "tinyten"])
def test_identical_models_give_identity(name):
    model = _make(INDEPENDENT[name], 4)
    spec = model.permutation_spec()
    result = weight_matching(spec, model.state_dict(), model.state_dict())
    # A copy of A: the permutations attain the objective's bound, so no sweep is needed.
    assert result.converged and result.iterations == 0
    assert weight_matching(spec, model.state_dict(), model.state_dict(), init="identity").iterations == 1
    for g, n in spec.sizes.items():
        assert torch.equal(result.perms[g], torch.arange(n))


def test_no_groups():
    model = MLP([6, 3])
    spec = model.permutation_spec()
    result = weight_matching(spec, model.state_dict(), model.state_dict(), init="identity")
    assert result.perms == {} and result.converged and result.iterations == 1


def test_duplicate_units_keep_identity():
    """Ties (two identical hidden units) must not move the identity."""
    model = MLP([6, 4, 3])
    with torch.no_grad():
        model.layers[0].weight[1] = model.layers[0].weight[0]
        model.layers[0].bias[1] = model.layers[0].bias[0]
        model.layers[1].weight[:, 1] = model.layers[1].weight[:, 0]
    spec = model.permutation_spec()
    result = weight_matching(spec, model.state_dict(), model.state_dict())
    assert torch.equal(result.perms["hidden1"], torch.arange(4))


def test_init_at_the_answer_stops_after_one_sweep():
    model = _make(lambda: MLP([10, 24, 24, 3]), 0)
    spec = model.permutation_spec()
    planted, sb = _planted(spec, model.state_dict(), seed=3)
    init = {g: _inverse(p) for g, p in planted.items()}
    result = weight_matching(spec, model.state_dict(), sb, init=init)
    assert result.iterations == 1 and result.converged
    for g in spec.sizes:
        assert torch.equal(result.perms[g], init[g])
    none = weight_matching(spec, model.state_dict(), sb, max_iter=0, init=init)
    assert none.iterations == 0 and not none.converged and len(none.objective) == 1
    assert all(torch.equal(none.perms[g], init[g]) for g in spec.sizes)


def test_keys_restrict_the_objective():
    model = _make(lambda: TinyTen(), 0)
    spec = model.permutation_spec()
    planted, sb = _planted(spec, model.state_dict(), seed=2)
    weights_only = [k for k in spec.axes if k.endswith("weight")]
    result = weight_matching(spec, model.state_dict(), sb, keys=weights_only)
    for g in spec.sizes:
        assert torch.equal(result.perms[g], _inverse(planted[g]))
    full = matching_objective(spec, model.state_dict(), sb, result.perms)
    partial = matching_objective(spec, model.state_dict(), sb, result.perms, keys=weights_only)
    assert result.objective[-1] == pytest.approx(partial, rel=1e-6)
    assert partial != pytest.approx(full)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_general_tensor_with_three_groups_and_float64(seed):
    """A tensor carrying three groups takes the whole-recompute path; float64 similarities."""
    g = torch.Generator().manual_seed(seed)
    spec = PermutationSpec(
        {"t": ("x", "y", "z"), "u": ("y", None), "v": (None, "z"), "w": ("x",)}, {"x": 5, "y": 6, "z": 7}
    )

    def state():
        return {
            "t": torch.randn(5, 6, 7, generator=g),
            "u": torch.randn(6, 3, generator=g),
            "v": torch.randn(2, 7, generator=g),
            "w": torch.randn(5, generator=g),
        }

    sa, sb = state(), state()
    ref, sweeps = reference_weight_matching(spec, sa, sb, seed=seed, lsa=pyperm.linear_sum_assignment)
    for dtype in (torch.float32, torch.float64):
        result = weight_matching(spec, sa, sb, seed=seed, dtype=dtype, init="identity")
        assert result.iterations == sweeps
        for name in spec.sizes:
            assert torch.equal(result.perms[name], ref[name])


def test_float64_state_and_non_float_entries():
    model = _make(lambda: ResNet20(), 0).double()
    spec = model.permutation_spec()
    planted, sb = _planted(spec, model.state_dict(), seed=5)
    assert sb["bn1.num_batches_tracked"].dtype == torch.int64  # not matched, not an error
    result = weight_matching(spec, model.state_dict(), sb)
    for g in spec.sizes:
        assert torch.equal(result.perms[g], _inverse(planted[g]))


def test_matching_objective_brute_force():
    a = _make(lambda: MLP([5, 4, 3, 2]), 0)
    b = _make(lambda: MLP([5, 4, 3, 2]), 1)
    spec = a.permutation_spec()
    perms = {"hidden1": torch.tensor([2, 0, 3, 1]), "hidden2": torch.tensor([1, 2, 0])}
    pb = apply_permutation(spec, perms, b.state_dict())
    expected = sum(float((a.state_dict()[k].double() * pb[k].double()).sum()) for k in spec.axes)
    assert matching_objective(spec, a.state_dict(), b.state_dict(), perms) == pytest.approx(expected, rel=1e-12)


def test_progress_bar(capsys):
    pytest.importorskip("tqdm")
    a = _make(lambda: MLP([8, 16, 16, 2]), 0)
    b = _make(lambda: MLP([8, 16, 16, 2]), 1)
    spec = a.permutation_spec()
    quiet = weight_matching(spec, a.state_dict(), b.state_dict())
    assert capsys.readouterr().err == ""
    loud = weight_matching(spec, a.state_dict(), b.state_dict(), progress=True)
    assert "weight matching" in capsys.readouterr().err
    assert all(torch.equal(quiet.perms[g], loud.perms[g]) for g in spec.sizes)


def test_cuda_matches_cpu(device):
    a = _make(lambda: ResNet20(), 1)
    b = _make(lambda: ResNet20(), 2)
    spec = a.permutation_spec()
    cpu = weight_matching(spec, a.state_dict(), b.state_dict())
    sa = {k: v.to(device) for k, v in a.state_dict().items()}
    sb = {k: v.to(device) for k, v in b.state_dict().items()}
    other = weight_matching(spec, sa, sb)
    for g in spec.sizes:
        assert other.perms[g].device.type == "cpu"
        assert torch.equal(other.perms[g], cpu.perms[g])


# ---------------------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def small():
    a = _make(lambda: MLP([6, 5, 4, 3]), 0)
    b = _make(lambda: MLP([6, 5, 4, 3]), 1)
    return a.permutation_spec(), a.state_dict(), b.state_dict()


def test_error_spec_type(small):
    _, sa, sb = small
    with pytest.raises(TypeError, match="spec must be a pyperm.nn.PermutationSpec"):
        weight_matching({"hidden1": 5}, sa, sb)
    with pytest.raises(TypeError, match="spec must be a pyperm.nn.PermutationSpec"):
        matching_objective(None, sa, sb)


def test_error_state_dict_mismatch(small):
    spec, sa, sb = small
    missing = dict(sb)
    del missing["layers.1.bias"]
    with pytest.raises(ValueError, match=r"state_b does not match the spec: missing keys \['layers.1.bias'\]"):
        weight_matching(spec, sa, missing)
    with pytest.raises(TypeError, match="state_a must be a mapping"):
        weight_matching(spec, [1, 2], sb)
    wrong = dict(sa)
    wrong["layers.0.weight"] = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"state_a\['layers.0.weight'\] axis 0 has size 4"):
        weight_matching(spec, wrong, sb)
    not_tensor = dict(sb)
    not_tensor["layers.2.bias"] = [0.0, 0.0, 0.0]
    with pytest.raises(TypeError, match=r"state_b\['layers.2.bias'\] must be a torch.Tensor"):
        weight_matching(spec, sa, not_tensor)


def test_error_shape_differs_on_an_unpermuted_axis():
    spec = PermutationSpec({"w": ("h", None)}, {"h": 3})
    with pytest.raises(ValueError, match=r"state_a\['w'\] has shape \(3, 2\) but state_b has \(3, 4\)"):
        weight_matching(spec, {"w": torch.zeros(3, 2)}, {"w": torch.zeros(3, 4)})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("which", ["state_a", "state_b"])
def test_error_not_finite(small, bad, which):
    spec, sa, sb = small
    broken = {k: v.clone() for k, v in (sa if which == "state_a" else sb).items()}
    broken["layers.1.weight"][2, 1] = bad
    args = (broken, sb) if which == "state_a" else (sa, broken)
    with pytest.raises(ValueError, match=rf"{which}\['layers.1.weight'\] contains NaN or infinite values"):
        weight_matching(spec, *args)


def test_error_overflow():
    spec = PermutationSpec({"w": ("h",)}, {"h": 2})
    big = {"w": torch.tensor([3e38, 3e38])}
    with pytest.raises(ValueError, match="the similarity matrix of group 'h' is not finite"):
        weight_matching(spec, big, big, init="identity")
    assert weight_matching(spec, big, big).iterations == 0  # the default sees a copy: no similarity needed
    assert weight_matching(spec, big, big, dtype=torch.float64).converged
    spec = PermutationSpec({"w": ("h", None)}, {"h": 2})
    big = {"w": torch.full((2, 1024), 3e38)}
    with pytest.raises(ValueError, match=r"the product of state_a\['w'\] and state_b\['w'\] overflows"):
        weight_matching(spec, big, big)


def test_float16_products_that_overflow_are_the_clear_error():
    """float16 products overflow at 65504, long before the float32 similarity: the overflow bound must be
    float16's (it was float32's, and inf costs reached the solver: "cost matrix is infeasible")."""
    spec = PermutationSpec({"w": ("h", None)}, {"h": 2})
    a = {"w": torch.full((2, 8), 300.0)}  # entries of the similarity: 8 * 300 * 300 = 720000 > 65504
    b = {"w": a["w"] + torch.tensor([[0.0], [1.0]])}
    with pytest.raises(ValueError, match=r"group 'h' is not finite: .* \(products in torch.float16\)"):
        weight_matching(spec, a, b, init="identity", product_dtype=torch.float16)
    assert weight_matching(spec, a, b, init="identity").converged  # float32 products hold them


@pytest.mark.parametrize("returned, stops", [(True, True), (False, False), (None, False)])
def test_callback_stops_on_true_only(small, returned, stops):
    """One rule for every callback (weight_matching's, train_curve's): True stops, False or None goes on."""
    spec, sa, sb = small
    calls = []

    def callback(sweep, perms, objective):
        calls.append(sweep)
        return returned

    weight_matching(spec, sa, sb, init="identity", callback=callback)
    assert (calls == [1]) == stops and calls


@pytest.mark.parametrize("returned", [1, "stop", 0.0, torch.tensor(True)])
def test_callback_returning_anything_else_is_a_type_error(small, returned):
    """The matcher once stopped on any truthy value (a logged number, a string) and train_curve only on True."""
    spec, sa, sb = small
    with pytest.raises(TypeError, match="callback must return True \\(stop\\), False or None"):
        weight_matching(spec, sa, sb, init="identity", callback=lambda *args: returned)


def test_error_devices(small):
    spec, sa, sb = small
    meta = {k: v.to("meta") for k, v in sb.items()}
    with pytest.raises(ValueError, match="must be on one device"):
        weight_matching(spec, sa, meta)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"max_iter": -1}, ValueError, "max_iter must be at least 0"),
        ({"max_iter": 2.0}, TypeError, "max_iter must be an int"),
        ({"max_iter": True}, TypeError, "max_iter must be an int"),
        ({"seed": -3}, ValueError, "seed must be non-negative"),
        ({"seed": "0"}, TypeError, "seed must be an int or a torch.Generator"),
        ({"tol": -1.0}, ValueError, "tol must be finite and non-negative"),
        ({"tol": math.nan}, ValueError, "tol must be finite and non-negative"),
        ({"tol": "0"}, TypeError, "tol must be a real number"),
        ({"callback": 3}, TypeError, "callback must be a callable or None"),
        ({"init": "random"}, ValueError, "init must be one of 'best', 'identity', 'signatures', got 'random'"),
        ({"init": 3}, TypeError, "init must be a mapping of group names to permutations"),
        ({"dtype": torch.float16}, TypeError, "dtype must be torch.float32 or torch.float64"),
        ({"keys": "layers.0.weight"}, TypeError, "keys must be an iterable of state_dict keys"),
        ({"keys": ["layers.0.weight", "nope"]}, ValueError, "keys names 'nope', which is not in the spec"),
        (
            {"init": {"hidden1": [0, 1, 2, 3, 3], "hidden2": [0, 1, 2, 3]}},
            ValueError,
            r"init\['hidden1'\] is not a permutation",
        ),
        (
            {"init": {"hidden1": [0, 1, 2, 3, 4]}},
            ValueError,
            r"init does not match the spec's groups: missing \['hidden2'\]",
        ),
        (
            {"init": {"hidden1": [0.0, 1, 2, 3, 4], "hidden2": [0, 1, 2, 3]}},
            TypeError,
            r"init\['hidden1'\] must hold integers",
        ),
    ],
)
def test_error_arguments(small, kwargs, exc, match):
    spec, sa, sb = small
    with pytest.raises(exc, match=match):
        weight_matching(spec, sa, sb, **kwargs)


def test_error_keys_non_float():
    spec = PermutationSpec({"w": ("h", None), "n": ()}, {"h": 2})
    s = {"w": torch.zeros(2, 2), "n": torch.tensor(3)}
    with pytest.raises(ValueError, match="keys names 'n', whose dtype torch.int64 is not floating point"):
        weight_matching(spec, s, s, keys=["w", "n"])


# ---------------------------------------------------------------------------------- the benchmark


def test_bench_match_runs(capsys, tmp_path):
    import argparse

    from pyperm.benchmarks import match

    parser = argparse.ArgumentParser()
    match.add_arguments(parser)
    code = match.run(parser.parse_args(["--models", "mlp512", "--repeat", "1", "--plot", str(tmp_path / "m.png")]))
    out = capsys.readouterr().out
    assert code == 0
    assert "MLP 784-512-512-512-10" in out and "True" in out  # same permutations as the reference
    assert (tmp_path / "m.png").stat().st_size > 0
    with pytest.raises(SystemExit) as refused:  # an unknown model is refused with the choices
        parser.parse_args(["--models", "mlp512,nope"])
    assert refused.value.code == 2 and "nope" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        match.build_model("nope", 0)


def test_bench_match_structured_and_starts_tables(capsys):
    """The structured table (flat and structured specs of one pair, their sweep flops) and the starts table
    (identity, signatures, the default) come from one command."""
    import argparse

    from pyperm.benchmarks import match

    parser = argparse.ArgumentParser()
    match.add_arguments(parser)
    args = parser.parse_args(["--no-flat", "--repeat", "1", "--threads", "1", "--clock", "cpu", "--markdown",
                              "--structured", "mlp512-tiled", "--starts", "mlp512", "--planted"])  # fmt: skip
    assert match.run(args) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| MLP 784-512-512-512-10")]
    flat, structured, independent, planted = lines
    # Every axis written as Tiled(g): the same groups and products as the flat spec (first sweep, whole run).
    assert "| flat |" in flat and "| structured |" in structured
    assert flat.split("|")[3:5] == structured.split("|")[3:5] and flat.split("|")[10:12] == structured.split("|")[10:12]
    assert structured.split("|")[-3:-1] == [" 1.000x ", " 1.000x "]
    assert "| independent |" in independent and "| planted |" in planted
    assert independent.rstrip(" |").endswith("| identity")  # unrelated models: the signature start is not tried
    assert planted.rstrip(" |").endswith("| copy start")  # a permuted copy: found without a sweep
    with pytest.raises(SystemExit):
        parser.parse_args(["--starts", "nope"])


@pytest.mark.parametrize("name", ["mlp", "resnet20-B"])
def test_reused_matcher_equals_fresh_matchings(name):
    """A WeightMatcher keeps B's arrangement and its warm solvers from match to match (STE
    and merge_many reuse one): each match must still be weight matching of that A."""
    from pyperm.nn.align.weight import WeightMatcher

    b = _make(INDEPENDENT[name], 20)
    spec = b.permutation_spec()
    matcher = WeightMatcher(spec, b.state_dict())
    perms = None
    for seed in (10, 11, 12):
        sa = _make(INDEPENDENT[name], seed).state_dict()
        reused = matcher.match(sa, init=perms, seed=seed)
        fresh = weight_matching(spec, sa, b.state_dict(), init=perms, seed=seed)
        assert reused.objective[-1] == pytest.approx(fresh.objective[-1], rel=1e-6)
        assert reused.objective[-1] == pytest.approx(
            matching_objective(spec, sa, b.state_dict(), reused.perms), rel=1e-6
        )
        perms = reused.perms


@pytest.mark.parametrize("name", ["mlp", "resnet20-B"])
def test_match_without_the_objective_takes_the_same_steps(name):
    """``objective=False`` (STE's projections) skips the start's objective: the same permutations, a
    history of the gains alone, and a NaN or infinity in A or B is still an error naming the entry."""
    from pyperm.nn.align.weight import WeightMatcher

    b = _make(INDEPENDENT[name], 20).state_dict()
    spec = _make(INDEPENDENT[name], 20).permutation_spec()
    full, lean = WeightMatcher(spec, b), WeightMatcher(spec, b)
    perms = None
    for seed in (10, 11):
        sa = _make(INDEPENDENT[name], seed).state_dict()
        with_objective = full.match(sa, init=perms, seed=seed)
        without = lean.match(sa, init=perms, seed=seed, objective=False)
        assert without.perms == with_objective.perms and without.iterations == with_objective.iterations
        assert without.objective[0] == 0.0
        gains = [v - with_objective.objective[0] for v in with_objective.objective]
        assert without.objective == pytest.approx(gains, rel=1e-6, abs=1e-6 * abs(with_objective.objective[0]))
        perms = with_objective.perms
    key = next(k for k, axes in spec.axes.items() if any(axes) and b[k].is_floating_point())
    for value in (float("nan"), float("inf")):
        bad = dict(sa)
        bad[key] = sa[key].clone()
        bad[key].view(-1)[0] = value
        with pytest.raises(ValueError, match=rf"state_a\[{key!r}\] contains NaN or infinite values"):
            lean.match(bad, objective=False)
        with pytest.raises(ValueError, match=rf"state_b\[{key!r}\] contains NaN or infinite values"):
            WeightMatcher(spec, bad).match(sa, objective=False)


def test_the_allocator_is_trimmed_after_every_sweep_unless_the_caller_says_not(monkeypatch):
    """Free pages go back to the system after every sweep (a large model's temporaries), not after every
    visit (the next visit would fault them in again), and never for a matcher made with trim_memory=False
    (STE matching, whose training frees far more between matches)."""
    from pyperm.nn.align import _matcher

    trims, visits = [], []
    monkeypatch.setattr(_matcher, "release_free_memory", lambda: trims.append(1))
    monkeypatch.setattr(_matcher, "plain_step",
                        lambda *args, f=_matcher.plain_step, **kwargs: visits.append(1) or f(*args, **kwargs))
    b = _make(INDEPENDENT["mlp"], 20)
    spec, sb = b.permutation_spec(), b.state_dict()
    sa = _make(INDEPENDENT["mlp"], 10).state_dict()
    result = _matcher.WeightMatcher(spec, sb).match(sa)
    assert len(trims) == result.iterations > 1 and len(visits) > len(trims)
    trims.clear()
    _matcher.WeightMatcher(spec, sb, trim_memory=False).match(sa)
    assert not trims


# ------------------------------------------------------------------------------ structured specs

# Every axis form, alone and combined: (axes, sizes, shapes of the unpermuted axes where the spec
# cannot tell them). The fast matcher must take the plain reference's steps, one by one.
FORMS = {
    "segments": (
        {"w1": ("a", None), "b1": ("a",), "w2": ("b", "a"), "w3": (None, Segments("a", 3, "b", "a"))},
        {"a": 5, "b": 4},
    ),
    "tiled": (
        {"w1": ("c", None), "w2": ("d", Tiled("c", inner=3)), "w3": (Tiled("e", outer=2), "d"),
         "w4": (None, Tiled("e", outer=2, inner=2))},
        {"c": 4, "d": 5, "e": 3},
    ),
    "tiled-outer-group": (
        {"w1": (Tiled("d", outer="h"), None), "w2": (None, Tiled("d", outer="h")), "s": ("h",)},
        {"h": 3, "d": 4},
    ),
    "blocks": (
        {"q": (Blocks("h", "qk"), None), "k": (Blocks("h", "qk"), "x"), "v": (Blocks("h", "v"), "x"),
         "o": ("x", Blocks("h", "v")), "s": ("h",), "e": ("x", None)},
        {"h": 3, "qk": 6, "v": 9, "x": 4},
    ),
    "fixed-blocks": (
        {"w": (Blocks(3, "d"), "x"), "u": (None, Blocks(3, "d")), "e": ("x", None)},
        {"d": 6, "x": 4},
    ),
    "segments-of-blocks": (
        {"qkv": (Segments(Blocks("h", "qk"), Blocks("h", "qk"), Blocks("h", "v")), "x"),
         "o": ("x", Blocks("h", "v")), "e": ("x", None)},
        {"h": 2, "qk": 6, "v": 4, "x": 3},
    ),
    "two-axes": ({"w": ("a", "a"), "u": ("a", None), "v": (None, "a")}, {"a": 6}),
    "recurrent": (
        {"ih": (Segments("a", "a"), "x"), "hh": (Segments("a", "a"), "a"), "x": ("x", None), "out": (None, "a")},
        {"a": 5, "x": 4},
    ),
}


def _form_states(name: str, seed: int, dtype=torch.float32):
    """The spec of ``FORMS[name]`` and two random state dicts for it (unpermuted axes of length 2)."""
    axes, sizes = FORMS[name]
    spec = PermutationSpec(axes, sizes)
    g = torch.Generator().manual_seed(seed)
    shapes = {k: tuple(spec.axis_length(k, ax) or 2 for ax in range(len(entries))) for k, entries in spec.axes.items()}
    return spec, *({k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()} for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", sorted(FORMS))
def test_structured_specs_take_the_reference_steps(name, dtype):
    """Segments, Tiled (copies in place or moved by a group), Blocks (moved or in place, in Segments) and one
    group on two axes: the fast matcher finds what the plain reference finds, sweep for sweep, and its
    objective is the exact one and never decreases."""
    from pyperm.nn.align._structured import reference_matching

    for seed in range(3):
        spec, sa, sb = _form_states(name, seed, dtype)
        assert spec.structured
        fast = weight_matching(spec, sa, sb, seed=seed, init="identity", dtype=dtype)
        plain = reference_matching(spec, sa, sb, seed=seed, dtype=dtype)
        assert fast.perms == plain.perms and fast.iterations == plain.iterations and fast.converged
        assert fast.objective == sorted(fast.objective)
        assert fast.objective[-1] == pytest.approx(matching_objective(spec, sa, sb, fast.perms), rel=1e-5)
        assert fast.objective[-1] > fast.objective[0]  # something moved: the steps were exercised


@pytest.mark.parametrize("name", sorted(FORMS))
def test_structured_specs_recover_a_planted_permutation(name):
    spec, sa, _ = _form_states(name, 0, torch.float64)
    planted = Permutations(spec, random_permutations(spec, 1))
    sb = planted.apply(sa)
    found = weight_matching(spec, sa, sb, seed=0, dtype=torch.float64)
    assert found.perms == planted.inverse()
    assert found.objective[-1] == pytest.approx(matching_objective(spec, sa, sa), rel=1e-12)


def test_a_group_on_two_axes_never_lowers_the_objective():
    """P W P^T is quadratic in P: each step solves its linearisation, and is kept only when the exact
    objective rises (a tensor of the group alone, where the linearisation misleads most)."""
    spec = PermutationSpec({"w": ("a", "a")}, {"a": 8})
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        sa, sb = {"w": torch.randn(8, 8, generator=g)}, {"w": torch.randn(8, 8, generator=g)}
        result = weight_matching(spec, sa, sb, seed=seed, init="identity")
        assert result.objective == sorted(result.objective)
        assert result.objective[-1] == pytest.approx(matching_objective(spec, sa, sb, result.perms), rel=1e-6)


@pytest.mark.parametrize("name", ["blocks", "recurrent", "tiled-outer-group"])
def test_reused_matcher_on_structured_specs_equals_fresh_matchings(name):
    from pyperm.nn.align.weight import WeightMatcher

    spec, _, sb = _form_states(name, 0)
    matcher = WeightMatcher(spec, sb)
    perms = None
    for seed in (1, 2, 3):
        sa = _form_states(name, seed)[1]
        reused = matcher.match(sa, init=perms, seed=seed)
        fresh = weight_matching(spec, sa, sb, init=perms, seed=seed)
        assert reused.perms == fresh.perms and reused.objective == pytest.approx(fresh.objective, rel=1e-6)
        perms = reused.perms


def test_a_group_no_key_reads_keeps_its_permutation():
    """``keys`` can leave a group without any entry: its similarity is zero and it stays where it starts."""
    spec = PermutationSpec({"w1": ("h", None), "w2": ("k", "h"), "w3": (None, "k")}, {"h": 4, "k": 5})
    g = torch.Generator().manual_seed(0)
    sa = {"w1": torch.randn(4, 3, generator=g), "w2": torch.randn(5, 4, generator=g), "w3": torch.randn(2, 5, generator=g)}
    sb = {k: torch.randn(v.shape, generator=g) for k, v in sa.items()}
    start = random_permutations(spec, 1)
    for _ in range(3):
        result = weight_matching(spec, sa, sb, init=start, keys=["w1"])
        assert torch.equal(result.perms["k"], start["k"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("init", ["best", "identity", "signatures"])
def test_half_precision_models_recover_a_planted_permutation(dtype, init):
    """bfloat16 and float16 state dicts, as most current models are stored: every start takes them."""
    model = MLP([16, 24, 20, 5])
    spec = model.permutation_spec()
    sa = {k: v.to(dtype) for k, v in model.state_dict().items()}
    plant = Permutations(spec, random_permutations(spec, 3))
    result = weight_matching(spec, sa, plant.apply(sa), init=init)
    assert result.perms == plant.inverse()
