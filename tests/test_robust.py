"""PGD attacks and robust accuracy (Madry et al.; Tatro et al. section 5) on digits models."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from _digits import accuracy, batches, digits, mlp, train
from pyperm.nn.eval.robust import check_attack, pgd_attack, robust_accuracy

EPS = 0.1  # on [0, 1] pixels: moderate (a digit's strokes are near 1, the background 0)
ATTACK = {"eps": EPS, "steps": 10, "step_size": 0.025}


@pytest.fixture(scope="module")
def trained():
    model = mlp(32)
    train(model, 1, epochs=10)
    return model


@pytest.fixture(scope="module")
def test_data():
    _, _, x, y = digits()
    return x, y


def test_pgd_lowers_accuracy_substantially(trained, test_data):
    x, y = test_data
    clean = accuracy(trained, x, y)
    adv = pgd_attack(trained, x, y, **ATTACK)
    robust = accuracy(trained, adv, y)
    assert clean > 0.9
    assert robust < clean - 0.4, (clean, robust)
    # The random start alone does far less than the attack.
    noisy = accuracy(trained, pgd_attack(trained, x, y, eps=EPS, steps=0, step_size=0.0), y)
    assert noisy > clean - 0.1


@pytest.mark.parametrize("norm", ["inf", "2"])
@pytest.mark.parametrize("eps", [0.05, 0.3, 2.0])
def test_pgd_stays_in_ball_and_range(trained, test_data, norm, eps):
    x, y = test_data
    x = x[:100]
    adv = pgd_attack(trained, x, y[:100], eps=eps, steps=5, step_size=eps / 2, norm=norm)
    assert adv.shape == x.shape and adv.dtype == x.dtype and not adv.requires_grad
    assert float(adv.min()) >= 0.0 and float(adv.max()) <= 1.0
    delta = adv - x
    size = delta.abs().amax(dim=1) if norm == "inf" else delta.norm(dim=1)
    assert float(size.max()) <= eps * (1 + 1e-6) + 1e-7


def test_pgd_range_and_clamp_none(trained, test_data):
    x, y = test_data
    shifted = x[:50] * 2 - 1  # inputs in [-1, 1]
    adv = pgd_attack(trained, shifted, y[:50], eps=0.2, steps=3, step_size=0.1, clamp=(-1.0, 1.0))
    assert float(adv.min()) >= -1.0 and float(adv.max()) <= 1.0
    free = pgd_attack(trained, x[:50], y[:50], eps=0.2, steps=3, step_size=0.1, clamp=None)
    assert float(free.min()) < 0.0  # background pixels pushed below 0 without a range


def test_pgd_leaves_model_and_inputs_alone(trained, test_data):
    x, y = test_data
    x0 = x[:20].clone()
    trained.train()
    state = {k: v.clone() for k, v in trained.state_dict().items()}
    try:
        a = pgd_attack(trained, x[:20], y[:20], **ATTACK, seed=3)
        b = pgd_attack(trained, x[:20], y[:20], **ATTACK, seed=3)
        c = pgd_attack(trained, x[:20], y[:20], **ATTACK, seed=4)
        assert trained.training  # flag restored
    finally:
        trained.eval()
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(x[:20], x0)
    assert all(p.grad is None for p in trained.parameters())
    for k, v in trained.state_dict().items():
        assert torch.equal(v, state[k])


def test_pgd_on_a_callable(trained, test_data):
    x, y = test_data
    adv = pgd_attack(lambda inputs: trained(inputs), x[:30], y[:30], **ATTACK)
    assert float((adv - x[:30]).abs().max()) <= EPS + 1e-6


def test_robust_accuracy(trained, test_data):
    x, y = test_data
    data = batches(x, y, 128)
    value = robust_accuracy(trained, data, **ATTACK)
    assert 0.0 <= value < accuracy(trained, x, y) - 0.4
    assert robust_accuracy(trained, data, max_batches=1, eps=0.0, steps=0, step_size=0.0) == pytest.approx(
        accuracy(trained, x[:128], y[:128])
    )


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"eps": -0.1}, ValueError, "eps"),
        ({"eps": float("nan")}, ValueError, "eps"),
        ({"steps": 1.5}, TypeError, "steps"),
        ({"steps": -1}, ValueError, "steps"),
        ({"step_size": "a"}, TypeError, "step_size"),
        ({"norm": "1"}, ValueError, "norm"),
        ({"clamp": (1.0, 0.0)}, ValueError, "clamp"),
        ({"clamp": 1.0}, TypeError, "clamp"),
        ({"seed": 1.0}, TypeError, "seed"),
    ],
)
def test_pgd_argument_errors(trained, test_data, kwargs, exc, match):
    x, y = test_data
    with pytest.raises(exc, match=match):
        pgd_attack(trained, x[:4], y[:4], **{**ATTACK, **kwargs})


def test_pgd_input_errors(trained, test_data):
    x, y = test_data
    with pytest.raises(TypeError, match="inputs"):
        pgd_attack(trained, x[:4].long(), y[:4], **ATTACK)
    with pytest.raises(ValueError, match="targets"):
        pgd_attack(trained, x[:4], y[:5], **ATTACK)
    with pytest.raises(TypeError, match="model"):
        pgd_attack(3, x[:4], y[:4], **ATTACK)
    with pytest.raises(ValueError, match="missing"):
        robust_accuracy(trained, [(x[:4], y[:4])], eps=0.1)
    with pytest.raises(TypeError, match="adversarial"):
        check_attack([0.1, 3, 0.01])
    with pytest.raises(ValueError, match="unknown"):
        check_attack({**ATTACK, "epsilon": 0.1})


# ---------------------------------------------------------------------- robust curves


@pytest.fixture(scope="module")
def endpoints():
    model_a, model_b = mlp(32), mlp(32)
    return model_a, train(model_a, 1, epochs=10), train(model_b, 2, epochs=10)


def _robust_at(curve, t, data, attack):
    """Robust accuracy of the network at ``t`` (no BatchNorm in these models: no statistics to recompute)."""
    model = copy.deepcopy(curve.model)
    model.load_state_dict(curve.state_at(t))
    return robust_accuracy(model, data, **attack)


def test_robust_curve_training_raises_midpoint_robust_accuracy(endpoints, test_data):
    """Tatro et al. section 5: a curve trained on the robust loss is more robust at t = 1/2 than the straight
    line, and than the same curve trained on the clean loss."""
    from pyperm.nn.curves.bezier import BezierCurve
    from pyperm.nn.curves.train import train_curve

    model, sa, sb = endpoints
    x, y, _, _ = digits()
    xt, yt = test_data
    attack = {"eps": 0.1, "steps": 3, "step_size": 0.05}
    evaluation = batches(xt, yt, 200)
    line = BezierCurve(model, sa, sb)
    robust = BezierCurve(model, sa, sb)
    train_curve(robust, batches(x, y, 100), epochs=3, lr=0.05, adversarial={**attack, "seed": 1})
    clean = BezierCurve(model, sa, sb)
    train_curve(clean, batches(x, y, 100), epochs=3, lr=0.05)
    at_line, at_robust, at_clean = (_robust_at(c, 0.5, evaluation, attack) for c in (line, robust, clean))
    # Measured: 0.36 on the line, 0.51 clean-trained, 0.65 robust-trained (endpoints 0.46, 0.49).
    assert at_robust > at_line + 0.2, (at_line, at_robust)
    assert at_robust > at_clean + 0.05, (at_clean, at_robust)
    # The endpoints are not trained.
    assert _robust_at(robust, 0.0, evaluation, attack) == _robust_at(line, 0.0, evaluation, attack)


def test_check_attack_seed_and_loss():
    with pytest.raises(TypeError, match="seed"):
        check_attack({**ATTACK, "seed": 0.5})
    with pytest.raises(ValueError, match="seed"):
        check_attack({**ATTACK, "seed": -1})
    with pytest.raises(TypeError, match="loss_fn"):
        check_attack({**ATTACK, "loss_fn": 3})
    assert check_attack({**ATTACK, "seed": torch.Generator()})["eps"] == EPS


def test_evaluate_curve_adversarial(endpoints, test_data):
    """evaluate_curve(adversarial=...): robust accuracy per point, the same as attacking the point's network."""
    from pyperm.nn.curves.bezier import BezierCurve
    from pyperm.nn.curves.evaluate import evaluate_curve

    model, sa, sb = endpoints
    xt, yt = test_data
    attack = {"eps": 0.1, "steps": 3, "step_size": 0.05}
    evaluation = batches(xt, yt, 200)
    line = BezierCurve(model, sa, sb)
    result = evaluate_curve(line, evaluation, num_points=3, adversarial=attack)
    assert result.has_robust_accuracy and result.robust_accuracy.shape == (3,)
    assert all(r <= a for r, a in zip(result.robust_accuracy, result.accuracy))
    assert result.robust_accuracy[1] == pytest.approx(_robust_at(line, 0.5, evaluation, attack))
    assert result.to_dict()["robust_accuracy"] == [float(v) for v in result.robust_accuracy]
    assert np.isnan(evaluate_curve(line, evaluation, num_points=2).robust_accuracy).all()  # not measured: NaN
    with pytest.raises(ValueError, match="adversarial"):
        evaluate_curve(line, evaluation, num_points=2, adversarial={"eps": 0.1})


def test_numpy_integers_and_numeric_norms_are_accepted(trained, test_data):
    """The shared checks treat numpy integers as ints and the numbers 2 and inf as the norms' names."""
    x, y = test_data
    x, y = x[:16], y[:16]
    want = pgd_attack(trained, x, y, **ATTACK, seed=3)
    assert torch.equal(pgd_attack(trained, x, y, **{**ATTACK, "steps": np.int64(10)}, seed=np.int64(3)), want)
    assert torch.equal(pgd_attack(trained, x, y, **ATTACK, seed=3, norm=float("inf")), want)
    l2 = pgd_attack(trained, x, y, **ATTACK, seed=3, norm="2")
    assert torch.equal(pgd_attack(trained, x, y, **ATTACK, seed=3, norm=2), l2)
    data = batches(x, y, 8)
    assert robust_accuracy(trained, data, **ATTACK, seed=np.int64(5)) == robust_accuracy(trained, data, **ATTACK,
                                                                                          seed=5)
    with pytest.raises(ValueError, match="attack: seed must be non-negative"):
        robust_accuracy(trained, data, **ATTACK, seed=-1)
