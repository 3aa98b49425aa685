"""Tests of pyperm.nn.curves: Bezier curves and polygonal chains on any model, Algorithm 2, evaluation.

The experiment tests train two small CNNs with BatchNorm on scikit-learn's 8x8 digits once
per module (fixed seeds) and check the claims of Tatro et al. on them: curve training
raises the worst accuracy along the path above the straight line's, and the curve between
aligned models is at least as good as the one between unaligned models.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn import Permutations, PermutationSpec
from pyperm.nn.curves import (
    BezierCurve,
    ConnectResult,
    CurveResult,
    PolyChain,
    connect,
    correlation_signature,
    evaluate_curve,
    loss_plane,
    train_curve,
)
from pyperm.nn.eval.path import PathResult
from pyperm.nn.state import interpolate
from pyperm.testing import one_thread

CURVES = [BezierCurve, PolyChain]


def cnn(width: int = 8, seed: int = 0) -> nn.Sequential:
    """A two-convolution CNN with BatchNorm for 8x8 one-channel images."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10),
        )  # fmt: skip


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def random_pair(width: int = 4, seed: int = 0):
    """A model and two different states with non-trivial BatchNorm statistics."""
    model = cnn(width, seed)
    a = clone_state(model)
    b = clone_state(cnn(width, seed + 1))
    g = torch.Generator().manual_seed(seed)
    for state in (a, b):
        for k, v in state.items():
            if k.endswith("running_mean"):
                v.copy_(torch.randn(v.shape, generator=g) * 0.1)
            elif k.endswith("running_var"):
                v.copy_(torch.rand(v.shape, generator=g) + 0.5)
    return model, a, b


def loaded(model: nn.Module, state) -> nn.Module:
    out = copy.deepcopy(model)
    out.load_state_dict(state)
    return out


# --------------------------------------------------------------------------- digits data and endpoints


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These models are tiny: one intra-op thread is fastest, and far faster on a shared machine."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train_idx, test_idx = order[:1200], order[1200:]

    def batches(idx, size):
        return [(x[idx[i:i + size]], y[idx[i:i + size]]) for i in range(0, len(idx), size)]

    return {"train": batches(train_idx, 64), "test": batches(test_idx, 300), "x": x[train_idx], "y": y[train_idx]}


@pytest.fixture(scope="module")
def endpoints(digits):
    """Two CNNs trained from different seeds (Adam, 6 epochs): about 95% test accuracy each."""
    states = []
    for seed in (1, 2):
        model = cnn(8, seed)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(seed)
        x, y = digits["x"], digits["y"]
        for _ in range(6):
            order = torch.randperm(len(y), generator=g)
            for i in range(0, len(y), 64):
                idx = order[i:i + 64]
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
        states.append(clone_state(model))
    return cnn(8, 0), states[0], states[1]


@pytest.fixture(scope="module")
def digits_curves(digits, endpoints):
    """Linear, unaligned and aligned (activation matching) curves, trained alike, evaluated."""
    model, a, b = endpoints
    common = {"epochs": 4, "lr": 0.05, "seed": 0, "test_data": digits["test"], "num_points": 11, "linear": True}
    unaligned = connect(model, None, a, b, digits["train"], align=None, **common)
    aligned = connect(model, None, a, b, digits["train"], align="activation", align_batches=5, **common)
    return {"unaligned": unaligned, "aligned": aligned}


# --------------------------------------------------------------------------- the curve itself


@pytest.mark.parametrize("cls", CURVES)
@pytest.mark.parametrize("num_bends", [1, 3])
def test_curve_passes_through_endpoints(cls, num_bends, device):
    model, a, b = random_pair()
    model = model.to(device)
    a = {k: v.to(device) for k, v in a.items()}
    b = {k: v.to(device) for k, v in b.items()}
    curve = cls(model, a, b, num_bends=num_bends).eval()
    x = torch.randn(6, 1, 8, 8, device=device)
    with torch.no_grad():
        assert torch.equal(curve(x, 0.0), loaded(model, a).eval()(x))
        assert torch.equal(curve(x, 1), loaded(model, b).eval()(x))
    for key, value in curve.state_at(0.0).items():
        assert torch.equal(value, a[key]), key
    for key, value in curve.state_at(1.0).items():
        assert torch.equal(value, b[key]), key


@pytest.mark.parametrize("cls", CURVES)
@pytest.mark.parametrize("num_bends", [1, 2, 4])
@pytest.mark.parametrize("train", [False, True])
def test_initial_curve_is_the_linear_path(cls, num_bends, train):
    model, a, b = random_pair(seed=3)
    curve = cls(model, a, b, num_bends=num_bends).train(train)
    x = torch.randn(8, 1, 8, 8)
    for t in (0.1, 0.25, 0.5, 0.8):
        reference = loaded(model, interpolate(a, b, t)).train(train)
        with torch.no_grad():
            torch.testing.assert_close(curve(x, t), reference(x), rtol=1e-5, atol=1e-5)


def test_weights_are_bernstein_and_hat_functions():
    model, a, b = random_pair()
    for t in (0.0, 0.3, 0.5, 1.0):
        assert BezierCurve(model, a, b).weights(t) == pytest.approx([(1 - t) ** 2, 2 * t * (1 - t), t**2])
    chain = PolyChain(model, a, b, num_bends=3)
    assert chain.weights(0.0) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert chain.weights(1.0) == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert chain.weights(0.375) == pytest.approx([0.0, 0.5, 0.5, 0.0, 0.0])
    for t in np.linspace(0, 1, 13):
        assert sum(BezierCurve(model, a, b, num_bends=4).weights(t)) == pytest.approx(1.0)
        assert sum(chain.weights(t)) == pytest.approx(1.0)


@pytest.mark.parametrize("cls", CURVES)
def test_gradients_reach_only_the_bends(cls):
    model, a, b = random_pair()
    curve = cls(model, a, b, num_bends=2).train()
    numel = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in curve.parameters()) == 2 * numel
    assert all(not buf.requires_grad for buf in curve.buffers())
    assert {n.split(".")[-2] for n, _ in curve.named_parameters()} == {"bends"}
    out = curve(torch.randn(8, 1, 8, 8), 0.4)
    F.cross_entropy(out, torch.arange(8)).backward()
    active = {id(p) for p in curve.active_parameters(0.4)}
    for p in curve.parameters():
        assert (p.grad is not None) == (id(p) in active)
        if p.grad is not None:
            assert p.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())


def test_curve_leaves_model_and_states_alone(digits):
    model, a, b = random_pair()
    model.train()
    model[1].eval()  # a deliberately mixed mode must survive
    before_model = clone_state(model)
    before_a = {k: v.clone() for k, v in a.items()}
    curve = BezierCurve(model, a, b)
    train_curve(curve, digits["train"][:3], epochs=1, lr=0.1)
    curve.eval()(torch.randn(2, 1, 8, 8), 0.5)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_model[k]), k
    for k, v in a.items():
        assert torch.equal(v, before_a[k]), k
    assert model.training and not model[1].training
    # num_batches_tracked (integer, from A) is not counted up by train-mode forwards
    assert torch.equal(curve.state_at(0.5)["1.num_batches_tracked"], a["1.num_batches_tracked"])


def test_state_at_and_bend_state():
    model, a, b = random_pair()
    curve = PolyChain(model, a, b, num_bends=1)
    with torch.no_grad():
        curve.bends()[0].add_(1.0)
    assert list(curve.state_at(0.5)) == list(a)
    mid = curve.state_at(0.5)
    bend = curve.bend_state(0)
    for k in a:
        torch.testing.assert_close(mid[k], bend[k])
    assert torch.equal(mid["0.weight"], interpolate(a, b, 0.5)["0.weight"] + 1.0) or torch.allclose(
        mid["0.weight"], interpolate(a, b, 0.5)["0.weight"] + 1.0
    )
    # running statistics follow the straight line
    torch.testing.assert_close(mid["1.running_mean"], interpolate(a, b, 0.5)["1.running_mean"])
    loaded(model, mid)  # load_state_dict accepts it


def test_tied_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(4, 4)
            self.dec = nn.Linear(4, 4)
            self.dec.weight = self.enc.weight

        def forward(self, x):
            return self.dec(torch.relu(self.enc(x)))

    torch.manual_seed(0)
    model = Tied()
    a = clone_state(model)
    b = {k: v + 1 for k, v in a.items()}
    curve = BezierCurve(model, a, b)
    assert sum(p.numel() for p in curve.parameters()) == sum(p.numel() for p in model.parameters())
    x = torch.randn(3, 4)
    torch.testing.assert_close(curve(x, 0.0), model(x))
    state = curve.state_at(0.3)
    assert state["enc.weight"] is state["dec.weight"] or torch.equal(state["enc.weight"], state["dec.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes(dtype, digits):
    model, a, b = random_pair()
    model = model.to(dtype)
    a = {k: v.to(dtype) if v.is_floating_point() else v for k, v in a.items()}
    b = {k: v.to(dtype) if v.is_floating_point() else v for k, v in b.items()}
    curve = BezierCurve(model, a, b)
    assert all(p.dtype == dtype for p in curve.parameters())
    x = torch.randn(4, 1, 8, 8, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(curve.eval()(x, 0.0), loaded(model, a).eval()(x))
    start = [p.detach().clone() for p in curve.parameters()]
    data = [(xb.to(dtype), yb) for xb, yb in digits["train"][:2]]
    history = train_curve(curve, data, epochs=1, lr=0.1)
    assert math.isfinite(history[0])
    assert any(not torch.equal(p, s) for p, s in zip(curve.parameters(), start))
    result = evaluate_curve(curve, data, num_points=3, bn_data=data)
    assert np.all(np.isfinite(result.loss))
    assert curve.state_at(0.5)["0.weight"].dtype == dtype


# --------------------------------------------------------------------------- training and evaluation


def test_train_curve_is_seeded_and_stoppable(digits):
    model, a, b = random_pair()
    data = digits["train"][:4]
    runs = []
    for _ in range(2):
        curve = BezierCurve(model, a, b)
        history = train_curve(curve, data, epochs=2, lr=0.05, seed=3)
        runs.append((history, [p.detach().clone() for p in curve.parameters()]))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 2
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1]))
    seen = []
    history = train_curve(BezierCurve(model, a, b), data, epochs=5, lr=0.05, optimizer="adam",
                          callback=lambda epoch, loss: seen.append(epoch) or epoch == 2)
    assert seen == [1, 2] and len(history) == 2
    # The one rule of every pyperm callback: anything but True, False or None is refused (this one stopped the
    # matcher, which took any truthy value, but not train_curve, which took only True).
    with pytest.raises(TypeError, match=r"callback must return True \(stop\), False or None, got int"):
        train_curve(BezierCurve(model, a, b), data, epochs=3, lr=0.05, callback=lambda epoch, loss: 1)
    chain = PolyChain(model, a, b, num_bends=2)
    history = train_curve(chain, data, epochs=1, lr=0.05, optimizer=torch.optim.RMSprop, progress=True)
    assert len(history) == 1
    assert evaluate_curve(chain, data[:1], num_points=2, bn_data=data, progress=True).ts.shape == (2,)


def test_evaluate_needs_batchnorm_data(digits):
    model, a, b = random_pair()
    with pytest.raises(ValueError, match="bn_data"):
        evaluate_curve(BezierCurve(model, a, b), digits["test"])
    # a model without BatchNorm needs none
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    result = evaluate_curve(BezierCurve(mlp, clone_state(mlp), clone_state(mlp)), digits["test"], num_points=3)
    assert result.ts.tolist() == [0.0, 0.5, 1.0] and np.all(result.accuracy <= 1)
    # bn_data=False: the straight line's running statistics, knowingly
    kept = evaluate_curve(BezierCurve(model, a, b), digits["test"][:1], num_points=2, bn_data=False)
    assert np.isfinite(kept.loss).all()


def test_curve_result_is_a_path_result(digits, tmp_path):
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    curve = BezierCurve(mlp, clone_state(mlp), {k: -v for k, v in clone_state(mlp).items()})
    r = evaluate_curve(curve, digits["test"], num_points=3)
    assert isinstance(r, CurveResult) and isinstance(r, PathResult)
    assert r.num_samples == sum(len(y) for _, y in digits["test"])
    assert np.isnan(r.robust_accuracy).all() and r.robust_accuracy.shape == (3,)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["min_accuracy"] == pytest.approx(r.min_accuracy) and d["num_samples"] == r.num_samples
    assert r.plot(tmp_path / "curve.png").stat().st_size > 1000
    # a loss without an accuracy: NaN, never None
    regression = [(x, torch.randn(len(x), 10)) for x, _ in digits["test"][:2]]
    r = evaluate_curve(curve, regression, num_points=2, loss_fn=F.mse_loss)
    assert np.isnan(r.accuracy).all() and math.isnan(r.min_accuracy)


def test_digits_training_raises_the_worst_accuracy(digits_curves):
    for name, run in digits_curves.items():
        assert isinstance(run, ConnectResult) and isinstance(run.perms, Permutations)
        assert run.result.min_accuracy > run.linear.min_accuracy, name
        assert run.result.max_loss < run.linear.max_loss, name
        assert run.history[-1] < run.history[0], name


def test_digits_aligned_curve_is_at_least_as_good(digits_curves, endpoints):
    aligned, unaligned = digits_curves["aligned"].result, digits_curves["unaligned"].result
    assert aligned.min_accuracy >= unaligned.min_accuracy
    assert aligned.average_accuracy >= unaligned.average_accuracy
    # and the straight line between aligned models is already far better (Tatro et al. Figure 3)
    assert digits_curves["aligned"].linear.min_accuracy > digits_curves["unaligned"].linear.min_accuracy
    # align=None: the identity, and B itself
    unaligned = digits_curves["unaligned"]
    assert unaligned.perms.is_identity() and len(unaligned.perms) > 0
    assert all(unaligned.aligned_state[k] is v for k, v in endpoints[2].items())
    assert not digits_curves["aligned"].perms.is_identity()


def test_connect_aligns_by_weights(digits, endpoints):
    model, a, b = endpoints
    spec = PermutationSpec.from_model(model, digits["x"][:2])
    run = connect(model, spec, a, b, digits["train"][:4], align="weight", epochs=1, lr=0.01,
                  test_data=digits["test"], num_points=3, curve="polychain")
    aligned = run.aligned_state
    assert isinstance(run.curve, PolyChain) and run.result.ts.shape == (3,)
    assert isinstance(run.perms, Permutations) and run.perms.spec is spec
    for k, v in run.perms.apply(b).items():
        assert torch.equal(v, aligned[k]), k
    # the aligned B computes the same function as B
    x = digits["test"][0][0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(model, aligned).eval()(x), loaded(model, b).eval()(x), rtol=1e-4,
                                   atol=1e-4)
    assert any(not torch.equal(aligned[k], b[k]) for k in b)


@pytest.mark.parametrize("align", ["weight", "activation"])
def test_connect_uses_a_bundled_models_spec(digits, align):
    from pyperm.nn.models import ResNet20

    model = ResNet20(in_channels=1)
    a = clone_state(model)
    b = clone_state(ResNet20(in_channels=1))
    data = [(digits["x"][:32], digits["y"][:32])]
    run = connect(model, None, a, b, data, align=align, epochs=1, lr=0.01, num_points=2)
    assert isinstance(run.perms, Permutations) and set(run.perms) == set(model.permutation_spec().groups)
    x = digits["test"][0][0][:16]
    with torch.no_grad():
        torch.testing.assert_close(loaded(model, run.aligned_state).eval()(x), loaded(model, b).eval()(x),
                                   rtol=1e-4, atol=1e-4)


def test_evaluation_recomputes_batchnorm_statistics(digits, endpoints):
    from pyperm.nn.eval.batchnorm import reset_bn_stats

    model, a, b = endpoints
    result = evaluate_curve(BezierCurve(model, a, b), digits["test"], num_points=2, bn_data=digits["train"])
    reference = reset_bn_stats(loaded(model, b), digits["train"]).eval()
    with torch.no_grad():
        logits = torch.cat([reference(x) for x, _ in digits["test"]])
    labels = torch.cat([y for _, y in digits["test"]])
    assert result.loss[-1] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert result.accuracy[-1] == pytest.approx((logits.argmax(1) == labels).double().mean().item())


def test_loss_plane(digits, endpoints, tmp_path):
    model, a, b = endpoints
    curve = BezierCurve(model, a, b)
    with torch.no_grad():
        curve.bends()[0].mul_(0.9)
    plane = loss_plane(model, [a, b, curve.bend_state(0)], digits["test"], grid=3, bn_data=digits["train"][:4],
                       curve=curve)
    assert plane.loss.shape == (3, 3) and plane.accuracy.shape == (3, 3)
    assert plane.points[0].tolist() == [0.0, 0.0] and plane.points[1, 1] == 0.0
    # the curve starts and ends at A and B in plane coordinates
    np.testing.assert_allclose(plane.curve_points[[0, -1]], plane.points[:2], atol=1e-6 * plane.points[1, 0])
    assert plane.plot(tmp_path / "plane.png", metric="accuracy").exists()
    json.dumps(plane.to_dict())
    with pytest.raises(ValueError, match="collinear"):
        loss_plane(model, [a, b, interpolate(a, b, 0.5)], digits["test"], grid=2, bn_data=digits["train"][:2])


def test_correlation_signature(digits, endpoints, tmp_path):
    model, a, b = endpoints
    sig = correlation_signature(loaded(model, a), loaded(model, b), None, digits["train"][:5])
    assert len(sig.groups) == 2
    assert np.all(sig.after >= sig.before - 1e-12) and np.all(sig.after <= 1.0 + 1e-9)
    assert sig.plot(tmp_path / "signature.png").exists()
    # given permutations are measured as given: the identity changes nothing
    spec = PermutationSpec.from_model(model, digits["x"][:2])
    same = correlation_signature(loaded(model, a), loaded(model, b), spec, iter(digits["train"][:5]),
                                 perms=Permutations.identity(spec))
    np.testing.assert_allclose(same.after, same.before, atol=1e-12)
    np.testing.assert_allclose(same.before, sig.before, atol=1e-12)


# --------------------------------------------------------------------------- bad input


def test_bad_input(digits):
    model, a, b = random_pair()
    with pytest.raises(TypeError, match="model"):
        BezierCurve("model", a, b)
    with pytest.raises(TypeError, match="num_bends"):
        BezierCurve(model, a, b, num_bends=1.0)
    with pytest.raises(ValueError, match="num_bends"):
        PolyChain(model, a, b, num_bends=0)
    with pytest.raises(ValueError, match="state_a"):
        BezierCurve(model, {k: v for k, v in a.items() if k != "0.bias"}, {k: v for k, v in b.items() if k != "0.bias"})
    with pytest.raises(ValueError, match="0.bias"):
        BezierCurve(model, a, {**b, "0.bias": b["0.bias"][:2]})
    with pytest.raises(TypeError, match="state_b"):
        BezierCurve(model, a, [1, 2])
    curve = BezierCurve(model, a, b)
    x = torch.randn(2, 1, 8, 8)
    with pytest.raises(ValueError, match="t must lie in"):
        curve(x, 1.5)
    with pytest.raises(ValueError, match="t must lie in"):
        curve.state_at(float("nan"))
    with pytest.raises(TypeError, match="t must be"):
        curve(x, "0.5")
    with pytest.raises(ValueError, match="index"):
        curve.bend_state(1)
    data = digits["train"][:2]
    with pytest.raises(TypeError, match="curve"):
        train_curve(model, data, epochs=1, lr=0.1)
    with pytest.raises(ValueError, match="epochs"):
        train_curve(curve, data, epochs=-1, lr=0.1)
    with pytest.raises(TypeError, match="epochs"):
        train_curve(curve, data, epochs=1.0, lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        train_curve(curve, data, epochs=1, lr=0.0)
    with pytest.raises(ValueError, match="momentum"):
        train_curve(curve, data, epochs=1, lr=0.1, momentum=-1)
    with pytest.raises(ValueError, match="optimizer"):
        train_curve(curve, data, epochs=1, lr=0.1, optimizer="lbfgs")
    with pytest.raises(TypeError, match="optimizer"):
        train_curve(curve, data, epochs=1, lr=0.1, optimizer=3)
    with pytest.raises(TypeError, match="seed"):
        train_curve(curve, data, epochs=1, lr=0.1, seed=1.5)
    with pytest.raises(TypeError, match="data"):
        train_curve(curve, [torch.randn(2, 1, 8, 8)], epochs=1, lr=0.1)
    with pytest.raises(TypeError, match="data is read several times and must be re-iterable"):
        train_curve(curve, iter(data), epochs=2, lr=0.1)  # a generator is empty on its second epoch
    assert len(train_curve(curve, iter(data), epochs=1, lr=0.1)) == 1  # read once: a generator will do
    with pytest.raises(TypeError, match="data"):
        evaluate_curve(curve, iter(data), bn_data=data)
    with pytest.raises(ValueError, match="num_points"):
        evaluate_curve(curve, data, num_points=1, bn_data=data)
    with pytest.raises(TypeError, match="curve"):
        evaluate_curve(model, data, bn_data=data)
    with pytest.raises(ValueError, match="align must be one of 'activation', 'weight', got 'random'"):
        connect(model, None, a, b, data, epochs=1, lr=0.1, align="random")
    with pytest.raises(ValueError, match="curve must be one of 'bezier', 'polychain', got 'spline'"):
        connect(model, None, a, b, data, epochs=1, lr=0.1, align=None, curve="spline")
    with pytest.raises(TypeError, match="curve must be 'bezier', 'polychain' or a curve class"):
        connect(model, None, a, b, data, epochs=1, lr=0.1, align=None, curve=3)
    with pytest.raises(TypeError, match="spec must be a pyperm.nn.PermutationSpec"):
        connect(model, {"g": 3}, a, b, data, epochs=1, lr=0.1)
    with pytest.raises(TypeError, match="takes 5 positional arguments"):
        connect(model, None, a, b, data, "weight", epochs=1, lr=0.1)
    with pytest.raises(TypeError, match="takes 4 positional arguments"):
        correlation_signature(model, model, None, data, {})
    with pytest.raises(TypeError, match="perms must be a Permutations or a mapping"):
        correlation_signature(model, model, None, data, perms=[0, 1])
    with pytest.raises(ValueError, match="states"):
        loss_plane(model, [a, b], data, bn_data=data)
    with pytest.raises(ValueError, match="grid"):
        loss_plane(model, [a, b, a], data, grid=1, bn_data=data)
    with pytest.raises(ValueError, match="no plane"):
        loss_plane(model, [a, a, b], data, grid=2, bn_data=data)
