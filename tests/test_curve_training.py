"""train_curve and CurveTrainer: the regulariser on the point of the curve, decay of the bends, schedules.

The reference loop itself is in test_curve_reference.py; here each option is checked on
its own against what it promises, one step at a time where a formula says what the step is.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from pyperm.nn.curves import BezierCurve, CurveTrainer, PolyChain, garipov_schedule, train_curve
from pyperm.nn.curves.schedules import SCHEDULES
from pyperm.testing import one_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def problem(dtype=torch.float64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = {k: torch.randn_like(v) for k, v in a.items()}
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(12, 5, generator=g, dtype=dtype), torch.randint(0, 3, (12,), generator=g)) for _ in range(3)]
    return model, a, b, data


def no_loss(outputs, targets):
    """A loss whose gradient is zero: a step is the regulariser's or the decay's alone."""
    return 0.0 * outputs.sum()


def first_t(seed: int) -> float:
    """The first point t a trainer seeded with ``seed`` draws (its documented stream)."""
    return float(torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64))


def test_point_decay_is_the_gradient_of_half_the_squared_norm_of_the_point():
    model, a, b, data = problem()
    curve = BezierCurve(model, a, b)
    before = curve.bend_state(0)
    t = first_t(3)
    point = curve.state_at(t)
    trainer = CurveTrainer(curve, lr=1.0, momentum=0.0, point_decay=0.1, seed=3, loss_fn=no_loss)
    trainer.step(*data[0])
    w = curve.weights(t)[1]
    # d/d(bend) of 0.05 * ||r(t)||^2 = 0.1 * w_1(t) * r(t), for the parameters only.
    for key in ("0.weight", "0.bias", "2.weight"):
        torch.testing.assert_close(curve.bend_state(0)[key], before[key] - 0.1 * w * point[key], rtol=1e-12, atol=1e-14)
    assert float(curve.point_sq_norm(0.0)) == pytest.approx(sum(float((a[k] ** 2).sum()) for k in a))


def test_bend_decay_is_the_optimizers_weight_decay_of_the_bends():
    model, a, b, data = problem()
    curve = BezierCurve(model, a, b)
    before = curve.bend_state(0)
    CurveTrainer(curve, lr=1.0, momentum=0.0, bend_decay=0.1, seed=3, loss_fn=no_loss).step(*data[0])
    for key in ("0.weight", "2.bias"):
        torch.testing.assert_close(curve.bend_state(0)[key], 0.9 * before[key], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="bend_decay=0.1 given, but LBFGS takes no weight_decay"):
        CurveTrainer(curve, lr=1.0, optimizer=torch.optim.LBFGS, bend_decay=0.1)


def test_schedules_per_epoch():
    model, a, b, data = problem()

    def epoch_rates(trainer, epochs, losses=None):
        """The learning rate of each epoch (one step each: torch wants a step before its scheduler's)."""
        seen = []
        for e in range(epochs):
            seen.append(trainer.lr)
            trainer.step(*data[0])
            trainer.end_epoch(math.nan if losses is None else losses[e])
        return seen

    # A function of the epoch fraction: epoch e of E runs at lr * f(e / E).
    curve = BezierCurve(model, a, b)
    trainer = CurveTrainer(curve, lr=0.5, lr_schedule=lambda f: 1.0 - f / 2, epochs=4)
    seen = epoch_rates(trainer, 4)
    assert seen == pytest.approx([0.5 * (1 - e / 8) for e in range(1, 5)])
    # Garipov et al.'s, built in, and a torch scheduler from a factory
    seen = epoch_rates(CurveTrainer(curve, lr=1.0, recipe="garipov", epochs=10), 10)
    assert seen == pytest.approx([garipov_schedule(e / 10) for e in range(1, 11)])
    assert seen[:5] == [1.0] * 5 and seen[-2:] == pytest.approx([0.01, 0.01])
    step = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
    seen = epoch_rates(CurveTrainer(curve, lr=1.0, lr_scheduler=step, epochs=5), 5)
    assert seen == [1.0, 1.0, 0.5, 0.5, 0.25]
    # ReduceLROnPlateau watches the epoch's loss
    plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0, factor=0.1)
    trainer = CurveTrainer(curve, lr=1.0, lr_scheduler=plateau)
    epoch_rates(trainer, 3, losses=[1.0, 2.0, 3.0])
    assert trainer.lr == pytest.approx(0.01)
    # train_curve runs the schedule: the history differs from the constant rate's
    constant = train_curve(BezierCurve(model, a, b), data, epochs=4, lr=0.5, seed=1)
    scheduled = train_curve(BezierCurve(model, a, b), data, epochs=4, lr=0.5, seed=1, lr_schedule="garipov")
    assert constant[:2] == scheduled[:2] and constant[3] != scheduled[3]
    assert sorted(SCHEDULES) == ["constant", "garipov"]


def test_schedule_is_not_read_past_the_end():
    model, a, b, data = problem()
    fractions = []

    def schedule(fraction):
        fractions.append(fraction)
        if fraction > 1:
            raise AssertionError("read past the end")
        return 1.0

    train_curve(BezierCurve(model, a, b), data, epochs=3, lr=0.1, lr_schedule=schedule)
    assert fractions == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_papers_recipe_is_one_argument_away():
    model, a, b, data = problem()
    trainer = CurveTrainer(BezierCurve(model, a, b), lr=0.1, recipe="garipov", epochs=4)
    assert trainer.point_decay == 5e-4 and trainer.bend_decay == 0.0
    assert isinstance(trainer.optimizer, torch.optim.SGD) and trainer.optimizer.defaults["momentum"] == 0.9
    assert trainer.optimizer.defaults["weight_decay"] == 0.0
    assert isinstance(trainer.scheduler, torch.optim.lr_scheduler.LambdaLR)
    plain = CurveTrainer(BezierCurve(model, a, b), lr=0.1)
    assert plain.point_decay == 0.0 and plain.scheduler is None
    # a scheduler of one's own replaces the recipe's schedule and keeps its regulariser
    own = CurveTrainer(BezierCurve(model, a, b), lr=0.1, recipe="garipov",
                       lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1))
    assert own.point_decay == 5e-4 and isinstance(own.scheduler, torch.optim.lr_scheduler.StepLR)


def test_polychain_bends_off_the_segment_do_not_move():
    model, a, b, data = problem()
    chain = PolyChain(model, a, b, num_bends=3)
    trainer = CurveTrainer(chain, lr=0.5, point_decay=0.1, seed=0)
    t = first_t(0)
    before = [p.detach().clone() for p in chain.parameters()]
    trainer.step(*data[0])
    active = {id(p) for p in chain.active_parameters(t)}
    for p, q in zip(chain.parameters(), before):
        assert torch.equal(p, q) != (id(p) in active)


def test_bad_schedules_and_decays():
    model, a, b, data = problem()
    curve = BezierCurve(model, a, b)
    cases = [
        ({"point_decay": -1.0}, ValueError, "point_decay"),
        ({"point_decay": math.nan}, ValueError, "point_decay"),
        ({"bend_decay": -1e-4}, ValueError, "bend_decay"),
        ({"recipe": "tatro"}, ValueError, "recipe must be one of 'garipov', got 'tatro'"),
        ({"lr_schedule": "cosine"}, ValueError, "lr_schedule must be one of 'constant', 'garipov', got 'cosine'"),
        ({"lr_schedule": 3}, TypeError, "lr_schedule"),
        ({"lr_schedule": lambda f: -1.0}, ValueError, "lr_schedule must return a finite, non-negative factor"),
        ({"lr_schedule": "garipov", "lr_scheduler": torch.optim.lr_scheduler.LambdaLR}, ValueError, "not both"),
        ({"lr_scheduler": lambda opt: 0.1}, TypeError, "must return a torch.optim.lr_scheduler scheduler, got float"),
        ({"weight_decay": 1e-4}, TypeError, "weight_decay"),  # renamed: point_decay or bend_decay
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            train_curve(curve, data, epochs=2, lr=0.1, **options)
    with pytest.raises(ValueError, match="give epochs= too"):
        CurveTrainer(curve, lr=0.1, lr_schedule="garipov")


def test_connect_passes_the_recipe_on():
    from pyperm.nn.curves import connect

    model, a, b, data = problem()
    run = connect(model, None, a, b, data, align=None, epochs=3, lr=0.1, recipe="garipov", num_points=3)
    curve = BezierCurve(model, a, b)
    assert train_curve(curve, data, epochs=3, lr=0.1, recipe="garipov") == run.history
    assert torch.equal(run.curve.bend_state(0)["2.weight"], curve.bend_state(0)["2.weight"])
    with pytest.raises(TypeError, match="weight_decay"):
        connect(model, None, a, b, data, align=None, epochs=1, lr=0.1, weight_decay=1e-4)
