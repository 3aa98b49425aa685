"""PAM (Tatro et al. appendix E): the relaxation, the driver's guarantees, its arguments."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _digits import batches, cnn, digits, mlp, train
from pyperm.nn import PermutationSpec, Permutations, apply_permutation, weight_matching
from pyperm.nn.align import _relaxation as relax
from pyperm.nn.curves.bezier import BezierCurve
from pyperm.nn.align.proximal import PAMIteration, PAMResult, pam
from pyperm.testing import random_permutations

# The curve step is SGD on a stochastic objective: between outer iterations the estimate
# of Q may rise by that noise. With these settings (learning rates halved every outer
# iteration, Q estimated on 700 fixed samples at 3 points) it moves by well under 0.02.
CURVE_NOISE = 0.02


@pytest.fixture(scope="module")
def mlp_pair():
    x, _, _, _ = digits()
    model_a, model_b = mlp(32), mlp(32)
    sa, sb = train(model_a, 1, epochs=10), train(model_b, 2, epochs=10)
    spec = PermutationSpec.from_model(model_a, x[:2])
    return model_a, spec, sa, sb


@pytest.fixture(scope="module")
def data():
    x, y, _, _ = digits()
    return batches(x, y, 100)


@pytest.fixture(scope="module")
def unaligned(mlp_pair, data):
    """PAM Unaligned on the digits MLPs, three outer iterations."""
    model, spec, sa, sb = mlp_pair
    saved_a = {k: v.clone() for k, v in sa.items()}
    saved_b = {k: v.clone() for k, v in sb.items()}
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    result = pam(model, spec, sa, sb, data, init="identity", max_iter=3, perm_steps=30, curve_epochs=3,
                 lr_perm=1.0, lr_curve=0.05, perm_samples=16, judge_batches=7, seed=0)
    # Nothing of the caller's changed.
    for k in sa:
        assert torch.equal(sa[k], saved_a[k]) and torch.equal(sb[k], saved_b[k])
        assert torch.equal(model.state_dict()[k], saved_model[k])
    return result


# ---------------------------------------------------------------------- the relaxation


def _plain(sizes):
    """A spec of plain groups of these sizes (or of these permutations' lengths), one vector each."""
    sizes = {g: n if isinstance(n, int) else len(n) for g, n in sizes.items()}
    return PermutationSpec({f"w_{g}": (g,) for g in sizes}, sizes)


@pytest.mark.parametrize("lr", [0.1, 1.0, 10.0])
def test_projected_step_returns_doubly_stochastic(lr):
    g = torch.Generator().manual_seed(0)
    perms = {"a": torch.randperm(16, generator=g), "b": torch.randperm(16, generator=g), "c": torch.randperm(40)}
    anchor = relax.one_hot(_plain(perms), perms)
    grads = {k: torch.randn(m.shape, generator=g, dtype=torch.float64) for k, m in anchor.items()}
    out = relax.projected_step(anchor, grads, anchor, lr=lr, nu=10.0)
    for k, d in out.items():
        assert d.shape == anchor[k].shape
        assert float(d.min()) >= 0.0
        np.testing.assert_allclose(d.sum(0).numpy(), 1.0, atol=1e-6)
        np.testing.assert_allclose(d.sum(1).numpy(), 1.0, atol=1e-6)
    # Not the trivial answer: the step moved away from the vertex.
    assert any(float((out[k] - anchor[k]).abs().max()) > 1e-3 for k in out)


def test_paper_projection_alone_is_approximate():
    """The paper's 20 alternating projections leave a defect that the extra rounds remove."""
    g = torch.Generator().manual_seed(1)
    m = relax.one_hot(_plain({"a": 32}), {"a": torch.randperm(32, generator=g)})["a"] - torch.randn(32, 32, generator=g,
                                                                                     dtype=torch.float64)
    assert relax.defect(relax.project(m, 20, tol=None)) > 1e-4
    assert relax.defect(relax.project(m, 20, tol=1e-8)) <= 1e-8


def test_one_hot_matches_apply_permutation(mlp_pair):
    _, spec, sa, _ = mlp_pair
    perms = random_permutations(spec, 3)
    relaxed = relax.apply_relaxed(spec, relax.one_hot(spec, perms), sa)
    exact = apply_permutation(spec, perms, sa)
    for k in sa:
        torch.testing.assert_close(relaxed[k], exact[k], rtol=0, atol=1e-6)


def test_candidates_are_permutations():
    g = torch.Generator().manual_seed(2)
    d = relax.project(torch.rand(12, 12, generator=g, dtype=torch.float64), 20, 1e-9)
    nearest = relax.nearest_permutations(_plain({"h": 12}), {"h": d})["h"]
    assert torch.equal(torch.sort(nearest).values, torch.arange(12))
    # eq. 52: no permutation has a larger trace(P^T D) than the projection; a sample's is at most it.
    best = float(d[torch.arange(12), nearest].sum())
    samples = relax.sample_candidates(_plain({"h": 12}), {"h": d}, 8, 10, np.random.default_rng(0))
    assert len(samples) == 8
    for s in samples:
        assert torch.equal(torch.sort(s["h"]).values, torch.arange(12))
        assert float(d[torch.arange(12), s["h"]].sum()) <= best + 1e-12


def test_proximal_term_is_stepped_exactly():
    """However large the step against nu, the proximal term pulls the iterate to P^k, never past it."""
    g = torch.Generator().manual_seed(3)
    anchor = relax.one_hot(_plain({"h": 10}), {"h": torch.randperm(10, generator=g)})
    start = {"h": relax.project(torch.rand(10, 10, generator=g, dtype=torch.float64), 20, 1e-9)}
    zero = {"h": torch.zeros(10, 10, dtype=torch.float64)}
    out = relax.projected_step(start, zero, anchor, lr=1e6, nu=1.0)
    torch.testing.assert_close(out["h"], anchor["h"], rtol=0, atol=1e-5)
    # A per-group step: the group with no step stays where it is.
    both = relax.projected_step({"h": start["h"], "k": start["h"]}, {"h": zero["h"], "k": zero["h"]},
                                {"h": anchor["h"], "k": anchor["h"]}, lr={"h": 1e6, "k": 0.0}, nu=1.0)
    torch.testing.assert_close(both["k"], relax.project(start["h"], 20, 1e-6), rtol=0, atol=1e-9)


def test_auto_step_sizes_scale_with_the_gradient():
    g = torch.Generator().manual_seed(4)
    grads = {"small": torch.randn(8, 8, generator=g, dtype=torch.float64),
             "large": torch.randn(32, 32, generator=g, dtype=torch.float64)}
    auto = relax.StepSizes({"small": 8, "large": 32}, None, scale=0.2)
    rates = auto(grads)
    # the step moves each row by about the scale (L2), whatever the gradient's size
    for name, grad in grads.items():
        assert rates[name] * float(grad.norm()) / grad.shape[0] ** 0.5 == pytest.approx(0.2)
    scaled = relax.StepSizes({"small": 8, "large": 32}, None, scale=0.2)({k: 1e-4 * v for k, v in grads.items()})
    assert scaled["large"] == pytest.approx(1e4 * rates["large"])
    auto.back_off("large")
    assert auto(grads)["large"] < rates["large"] and auto.backoffs == 1
    fixed = relax.StepSizes({"small": 8, "large": 32}, 3.0, scale=0.2)
    assert fixed(grads) == {"small": 3.0, "large": 3.0}
    # a non-finite gradient leaves the running mean as it was (its step is undone by the driver)
    before = dict(auto.second)
    auto({"small": grads["small"], "large": torch.full((32, 32), float("nan"), dtype=torch.float64)})
    assert auto.second["large"] == before["large"]


# ---------------------------------------------------------------------- the driver


def test_pam_permutations_valid_and_preserve_function(unaligned, mlp_pair):
    model, spec, sa, sb = mlp_pair
    assert isinstance(unaligned, PAMResult)
    assert isinstance(unaligned.perms, Permutations)
    for g, n in spec.sizes.items():
        assert torch.equal(torch.sort(unaligned.perms[g]).values, torch.arange(n))
    x, _, _, _ = digits()
    permuted = copy.deepcopy(model)
    permuted.load_state_dict(unaligned.perms.apply(sb))
    original = copy.deepcopy(model)
    original.load_state_dict(sb)
    with torch.no_grad():
        torch.testing.assert_close(permuted(x), original(x), rtol=1e-5, atol=1e-5)
    # The curve runs from A to P B.
    assert isinstance(unaligned.curve, BezierCurve)
    end = unaligned.curve.state_at(1.0)
    start = unaligned.curve.state_at(0.0)
    for k, v in unaligned.perms.apply(sb).items():
        torch.testing.assert_close(end[k], v, rtol=0, atol=1e-6)
        torch.testing.assert_close(start[k], sa[k], rtol=0, atol=1e-6)


def test_pam_objective_does_not_increase(unaligned):
    obj = unaligned.objective
    assert unaligned.iterations == len(unaligned.history) == 3 and len(obj) == 4
    assert all(isinstance(it, PAMIteration) for it in unaligned.history)
    for k, it in enumerate(unaligned.history):
        # The permutation step keeps P^k among its candidates: it never increases Q-hat.
        assert it.objective_after_perm <= obj[k] + 1e-12
        assert it.objective == obj[k + 1]
        # The curve step is stochastic: at most CURVE_NOISE above.
        assert obj[k + 1] <= it.objective_after_perm + CURVE_NOISE
    assert obj[-1] < 0.7 * obj[0]  # the curve learned something
    # PAM Unaligned found a better permutation than the identity at least once.
    assert any(it.choice != "previous" and sum(it.moved.values()) > 0 for it in unaligned.history)
    assert all(it.relaxed_defect <= 1e-6 for it in unaligned.history)
    assert set(unaligned.timings) >= {"relaxed_forward_backward", "projection", "assignment", "bvn_sampling"}


def test_pam_curve_carries_the_offset(unaligned, mlp_pair):
    """The returned curve's bend is the midpoint of A and P B plus the trained offset (eq. 35)."""
    _, _, sa, sb = mlp_pair
    bend = unaligned.curve.bend_state(0)
    end = unaligned.perms.apply(sb)
    offset = {k: bend[k] - 0.5 * (sa[k] + end[k]) for k in sa}
    assert max(float(v.abs().max()) for v in offset.values()) > 1e-3


def test_pam_inits(mlp_pair, data):
    model, spec, sa, sb = mlp_pair
    wm = weight_matching(spec, sa, sb, seed=0).perms
    by_weight = pam(model, spec, sa, sb, data[:2], init="weight", max_iter=0)
    assert isinstance(by_weight.init_perms, Permutations) and by_weight.init_perms.spec is spec
    assert by_weight.init_perms == wm and by_weight.perms == wm and len(by_weight.objective) == 1
    assert by_weight.iterations == 0 and by_weight.history == []
    given = random_permutations(spec, 5)
    assert pam(model, spec, sa, sb, data[:2], init=given, max_iter=0).perms == given
    assert pam(model, spec, sa, sb, data[:2], init=Permutations(spec, given), max_iter=0).init_perms == given
    by_activation = pam(model, spec, sa, sb, data[:2], init="activation", max_iter=0)
    assert not by_activation.perms.is_identity()
    # Aligned starts have a lower objective than the identity (the straight line A -> B).
    identity = pam(model, spec, sa, sb, data[:2], max_iter=0)
    assert by_weight.objective[0] < identity.objective[0]
    assert by_activation.objective[0] < identity.objective[0]


def test_pam_with_batchnorm_cnn(data):
    """BatchNorm buffers are permuted and the train-mode objective runs; the function is preserved."""
    x, _, _, _ = digits()
    model_a, model_b = cnn(4), cnn(4)
    sa, sb = train(model_a, 3, epochs=2), train(model_b, 4, epochs=2)
    spec = PermutationSpec.from_model(model_a, x[:2])
    result = pam(model_a, spec, sa, sb, data[:4], init="weight", max_iter=1, perm_steps=4, curve_epochs=1,
                 perm_samples=4, judge_batches=2, lr_perm=100.0, nu_perm=1e4)
    assert len(result.objective) == 2
    assert result.history[0].objective_after_perm <= result.objective[0] + 1e-12
    model_b.load_state_dict(sb)
    permuted = copy.deepcopy(model_b)
    permuted.load_state_dict(result.perms.apply(sb))
    with torch.no_grad():
        torch.testing.assert_close(permuted.eval()(x[:50]), model_b.eval()(x[:50]), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def cnn_pair():
    x, _, _, _ = digits()
    model_a, model_b = cnn(4), cnn(4)
    sa, sb = train(model_a, 3, epochs=2), train(model_b, 4, epochs=2)
    return model_a, PermutationSpec.from_model(model_a, x[:2]), sa, sb


@pytest.fixture(scope="module")
def small_gradient_pair():
    """The benchmark's digits CNN (no BatchNorm, small weights after a few plain gradient steps): its
    gradient in the relaxed permutations is about 100 times the MLP's smaller (it needed lr_perm=1000)."""
    from pyperm.benchmarks.pam import setup

    return setup("digits-cnn", 8, 128)


@pytest.mark.parametrize("case", ["mlp", "cnn with BatchNorm", "cnn with small weights"])
def test_pam_defaults_move_the_relaxation_on_differently_scaled_models(case, mlp_pair, cnn_pair,
                                                                       small_gradient_pair, data):
    """lr_perm="auto" moves the relaxed permutations off P^k whatever the scale of the gradient in them."""
    if case == "cnn with small weights":
        model, spec, sa, sb, batches_ = small_gradient_pair
    else:
        model, spec, sa, sb = mlp_pair if case == "mlp" else cnn_pair
        batches_ = data
    options = dict(max_iter=1, perm_steps=10, curve_epochs=0, perm_samples=4, judge_batches=1)
    result = pam(model, spec, sa, sb, batches_[:3], **options)  # no warning: the suite makes warnings errors
    it = result.history[0]
    assert 0.01 < it.relaxed_spread < 0.9 and it.backoffs == 0
    assert it.objective_after_perm <= result.objective[0] + 1e-12
    if case == "cnn with small weights":
        # The steps chosen are about 100 times the MLP's; the old default, lr_perm=1, barely moved.
        assert min(it.lr_perm.values()) > 30.0
        old = pam(model, spec, sa, sb, batches_[:3], **{**options, "lr_perm": 1.0}).history[0]
        assert old.relaxed_spread < it.relaxed_spread / 10


def test_pam_warns_when_the_relaxation_did_not_move(mlp_pair, data):
    model, spec, sa, sb = mlp_pair
    expected = r"did not move \(relaxed_spread .*raise lr_perm=0.001, or raise nu_perm=1000"
    with pytest.warns(RuntimeWarning, match=expected):
        result = pam(model, spec, sa, sb, data[:2], max_iter=1, perm_steps=5, curve_epochs=0, perm_samples=2,
                     judge_batches=1, lr_perm=1e-3)  # fmt: skip
    assert result.history[0].relaxed_spread < 1e-3
    # No relaxed step asked for: nothing to warn about.
    pam(model, spec, sa, sb, data[:2], max_iter=1, perm_steps=0, curve_epochs=0, perm_samples=2, judge_batches=1)


def test_pam_backs_off_a_diverging_step_instead_of_crashing(cnn_pair, data):
    """An lr_perm far too large (the issue's lr_perm=1000 on a BatchNorm CNN) is undone and halved, with a
    warning naming lr_perm; the decomposition never sees a diverged matrix."""
    model, spec, sa, sb = cnn_pair
    with pytest.warns(RuntimeWarning, match=r"diverged and were undone.*lr_perm=1000 is too large"):
        result = pam(model, spec, sa, sb, data[:3], max_iter=1, perm_steps=6, curve_epochs=0, perm_samples=4,
                     judge_batches=1, lr_perm=1000.0, nu_perm=1e4)  # fmt: skip
    it = result.history[0]
    assert it.backoffs > 0 and min(it.lr_perm.values()) < 1000.0
    assert it.relaxed_defect <= 1e-6
    assert it.objective_after_perm <= result.objective[0] + 1e-12
    for g, n in spec.sizes.items():
        assert torch.equal(torch.sort(result.perms[g]).values, torch.arange(n))


def test_pam_gives_up_on_a_gradient_that_is_never_finite(mlp_pair, data):
    model, spec, sa, sb = mlp_pair

    def nan_loss(outputs, targets):
        return F.cross_entropy(outputs, targets) * float("nan")

    with pytest.raises(ValueError, match="diverged at every step size.*lr_perm='auto'"):
        pam(model, spec, sa, sb, data[:1], max_iter=1, perm_steps=40, curve_epochs=0, perm_samples=2,
            judge_batches=1, loss_fn=nan_loss)  # fmt: skip


def test_pam_deterministic_and_numpy_ints_are_ints(mlp_pair, data):
    model, spec, sa, sb = mlp_pair
    kwargs = dict(max_iter=1, perm_steps=3, curve_epochs=1, perm_samples=4, judge_batches=1, seed=7)
    r1 = pam(model, spec, sa, sb, data[:3], **kwargs)
    r2 = pam(model, spec, sa, sb, data[:3], **{k: np.int64(v) for k, v in kwargs.items()})
    assert r1.objective == r2.objective and r1.perms == r2.perms
    assert isinstance(r2.iterations, int) and r2.iterations == 1


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"init": "random"}, ValueError, "init must be one of"),
        ({"init": 3}, TypeError, "init must be"),
        ({"init": {"P_0": [0, 1]}}, ValueError, "init does not match the spec's groups"),
        ({"lr_perm": 0.0}, ValueError, "lr_perm"),
        ({"nu_curve": -1.0}, ValueError, "nu_curve"),
        ({"max_iter": 1.5}, TypeError, "max_iter must be an int"),
        ({"max_iter": -1}, ValueError, "max_iter must be at least 0"),
        ({"perm_samples": -1}, ValueError, "perm_samples must be at least 0"),
        ({"seed": "0"}, TypeError, "seed must be an int"),
        ({"judge_batches": 0}, ValueError, "judge_batches must be at least 1"),
        ({"loss_fn": "mse"}, TypeError, "loss_fn must be a callable or None"),
        ({"anneal": 2.0}, ValueError, "anneal"),
        ({"momentum": 1.0}, ValueError, "momentum"),
        ({"momentum": "0.9"}, TypeError, "momentum"),
        ({"projection_tol": 0.0}, ValueError, "projection_tol"),
        ({"lr_curve": 0.5, "nu_curve": 0.1}, ValueError, "lr_curve / nu_curve"),
        ({"lr_perm": "fast"}, ValueError, "lr_perm must be 'auto' or a finite positive number, got 'fast'"),
        ({"lr_perm": None}, TypeError, "lr_perm must be 'auto' or a finite positive number, got NoneType"),
        ({"lr_perm": float("inf")}, ValueError, "lr_perm must be a finite positive number"),
    ],
)
def test_pam_argument_errors(mlp_pair, data, kwargs, exc, match):
    model, spec, sa, sb = mlp_pair
    with pytest.raises(exc, match=match):
        pam(model, spec, sa, sb, data[:1], **{"max_iter": 0, **kwargs})


def test_pam_input_errors(mlp_pair, data):
    model, spec, sa, sb = mlp_pair
    with pytest.raises(TypeError, match="spec"):
        pam(model, {"P_0": 3}, sa, sb, data)
    with pytest.raises(TypeError, match="model"):
        pam("model", spec, sa, sb, data)
    with pytest.raises(TypeError, match="re-iterable"):
        pam(model, spec, sa, sb, iter(data))
    bad = dict(sb)
    bad.pop("0.bias")
    with pytest.raises(ValueError, match="0.bias"):
        pam(model, spec, sa, bad, data)
    with pytest.raises(TypeError, match="positional"):
        pam(model, spec, sa, sb, data, "weight")  # type: ignore[misc]
