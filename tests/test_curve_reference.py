"""pyperm's curve training against an independent implementation of the reference's loop.

The reference is Garipov et al.'s public code (dnn-mode-connectivity), which Tatro et al.
train their curves with. It is written again here, in its own terms and without pyperm:
every parameter of the model kept as ``n`` control points (the first and last fixed, the
others trainable, initialised on the segment), the point of the curve built layer by layer
from the Bernstein (or hat-function) coefficients of ``t``, the regulariser
``0.5 * wd * ||theta(t)||^2`` added to the loss, SGD with momentum and no weight decay, and
``learning_rate_schedule`` setting the learning rate at the start of every epoch. Fed the
same draws of ``t``, the bends of both must agree to 1e-5 relative (float64) after several
epochs, and ``recipe="garipov"`` must be exactly these settings.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.curves import BezierCurve, PolyChain, garipov_schedule, train_curve
from pyperm.testing import one_thread

DTYPE = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def base_model(seed: int) -> nn.Sequential:
    """A CNN with BatchNorm for 6x6 one-channel inputs, in float64."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 36, 4),
        ).to(DTYPE)  # fmt: skip


def problem():
    model = base_model(0)
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = {k: v.detach().clone() for k, v in base_model(1).state_dict().items()}
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(n, 1, 6, 6, generator=g, dtype=DTYPE), torch.randint(0, 4, (n,), generator=g))
            for n in (16, 16, 9)]
    return model, a, b, data


# --------------------------------------------------------------------------- the reference, rewritten


def learning_rate_schedule(base_lr: float, epoch: int, total_epochs: int) -> float:
    """train.py's schedule, as published (``epoch`` from 1)."""
    alpha = epoch / total_epochs
    if alpha <= 0.5:
        factor = 1.0
    elif alpha <= 0.9:
        factor = 1.0 - (alpha - 0.5) / 0.4 * 0.99
    else:
        factor = 0.01
    return factor * base_lr


class ReferenceCurve:
    """Control points per parameter, the coefficients of ``t``, the forward and the l2 term of curves.py."""

    NAMES = ("0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "4.bias")

    def __init__(self, a: dict, b: dict, num_points: int, kind: str) -> None:
        self.n, self.kind = num_points, kind
        self.points = {}
        for name in self.NAMES:
            first, last = a[name].clone(), b[name].clone()
            middle = [((1 - j / (num_points - 1)) * first + j / (num_points - 1) * last).requires_grad_()
                      for j in range(1, num_points - 1)]  # init_linear
            self.points[name] = [first, *middle, last]
        self.running_mean = torch.zeros(3, dtype=DTYPE)
        self.running_var = torch.ones(3, dtype=DTYPE)

    def bends(self) -> list[torch.Tensor]:
        return [p for name in self.NAMES for p in self.points[name][1:-1]]

    def coefficients(self, t: torch.Tensor) -> torch.Tensor:
        j = torch.arange(self.n, dtype=DTYPE)
        if self.kind == "bezier":
            binom = torch.tensor([math.comb(self.n - 1, k) for k in range(self.n)], dtype=DTYPE)
            return binom * t**j * (1.0 - t) ** torch.flip(j, [0])
        return torch.clamp(1.0 - torch.abs(t * (self.n - 1) - j), min=0.0)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.coefficients(t)
        w = {name: sum(c[j] * p for j, p in enumerate(self.points[name])) for name in self.NAMES}
        l2 = sum(torch.sum(v**2) for v in w.values())
        h = F.conv2d(x, w["0.weight"], w["0.bias"], padding=1)
        h = F.batch_norm(h, self.running_mean, self.running_var, w["1.weight"], w["1.bias"], True, 0.1, 1e-5)
        h = F.relu(h).flatten(1)
        return F.linear(h, w["4.weight"], w["4.bias"]), l2


def reference_training(a, b, data, *, num_points, kind, epochs, lr, momentum, wd, seed):
    """train.py's loop for a curve: schedule per epoch, cross-entropy + 0.5 * wd * l2, SGD without weight decay."""
    curve = ReferenceCurve(a, b, num_points, kind)
    optimizer = torch.optim.SGD(curve.bends(), lr=lr, momentum=momentum, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)  # the same draws of t as pyperm's (its documented stream)
    for epoch in range(1, epochs + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_schedule(lr, epoch, epochs)
        for x, y in data:
            t = torch.rand((), generator=g, dtype=torch.float64)
            output, l2 = curve.forward(x, t)
            loss = F.cross_entropy(output, y) + 0.5 * wd * l2
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return curve


# --------------------------------------------------------------------------- the comparison


def assert_same_bends(curve, reference) -> None:
    for k in range(curve.num_bends):
        ours = curve.bend_state(k)
        for name in ReferenceCurve.NAMES:
            theirs = reference.points[name][k + 1].detach()
            torch.testing.assert_close(ours[name], theirs, rtol=1e-5, atol=1e-12 * float(theirs.abs().max()),
                                       msg=lambda m, k=k, name=name: f"bend {k}, {name}: {m}")


@pytest.mark.parametrize("num_bends", [1, 2])
def test_papers_recipe_follows_the_reference_loop(num_bends):
    model, a, b, data = problem()
    epochs, lr, seed = 5, 0.2, 11
    curve = BezierCurve(model, a, b, num_bends=num_bends)
    train_curve(curve, data, epochs=epochs, lr=lr, recipe="garipov", seed=seed)
    reference = reference_training(a, b, data, num_points=num_bends + 2, kind="bezier", epochs=epochs, lr=lr,
                                   momentum=0.9, wd=5e-4, seed=seed)
    assert_same_bends(curve, reference)
    # The bends moved well away from the straight line: the agreement is not the initialisation's.
    start = BezierCurve(model, a, b, num_bends=num_bends).bend_state(0)["4.weight"]
    assert (curve.bend_state(0)["4.weight"] - start).abs().max() > 1e-3


def test_regulariser_and_schedule_each_as_the_reference():
    """A larger coefficient makes the regulariser's share visible; the schedule is the published one."""
    model, a, b, data = problem()
    curve = BezierCurve(model, a, b)
    train_curve(curve, data, epochs=4, lr=0.1, point_decay=0.05, lr_schedule="garipov", seed=2)
    assert_same_bends(curve, reference_training(a, b, data, num_points=3, kind="bezier", epochs=4, lr=0.1,
                                                momentum=0.9, wd=0.05, seed=2))
    # Without the regulariser the bends are elsewhere: the term is not a no-op.
    plain = BezierCurve(model, a, b)
    train_curve(plain, data, epochs=4, lr=0.1, lr_schedule="garipov", seed=2)
    assert (plain.bend_state(0)["4.weight"] - curve.bend_state(0)["4.weight"]).abs().max() > 1e-4


def test_polychain_follows_the_reference_without_momentum():
    """A polygonal chain: the same hat functions. (With momentum the two differ by design: pyperm does not
    step a bend off t's segment, the reference moves it by its momentum; see train_curve's notes.)"""
    model, a, b, data = problem()
    curve = PolyChain(model, a, b, num_bends=2)
    train_curve(curve, data, epochs=6, lr=0.2, momentum=0.0, recipe="garipov", seed=4)
    assert_same_bends(curve, reference_training(a, b, data, num_points=4, kind="polychain", epochs=6, lr=0.2,
                                                momentum=0.0, wd=5e-4, seed=4))


def test_recipe_is_its_settings_and_explicit_arguments_win():
    model, a, b, data = problem()

    def bends(**options):
        curve = BezierCurve(model, a, b)
        train_curve(curve, data, epochs=3, lr=0.1, seed=0, **options)
        return curve.bend_state(0)["4.weight"]

    assert torch.equal(bends(recipe="garipov"), bends(point_decay=5e-4, lr_schedule="garipov"))
    assert torch.equal(bends(recipe="garipov", point_decay=0.0, lr_schedule="constant"), bends())
    assert torch.equal(bends(recipe="garipov", lr_schedule=garipov_schedule), bends(recipe="garipov"))


def test_garipov_schedule_is_the_published_one():
    """The factors train.py of dnn-mode-connectivity gives, worked out by hand from its formula (a literal table:
    comparing with a retyped copy of the function would agree with any mistake the copy shares)."""
    ten_epochs = [1.0, 1.0, 1.0, 1.0, 1.0, 0.7525, 0.505, 0.2575, 0.01, 0.01]
    assert [garipov_schedule(e / 10) for e in range(1, 11)] == pytest.approx(ten_epochs, rel=0, abs=1e-12)
    two_hundred = {1: 1.0, 100: 1.0, 101: 0.987625, 140: 0.505, 150: 0.38125, 179: 0.022375, 180: 0.01, 200: 0.01}
    for epoch, factor in two_hundred.items():
        assert garipov_schedule(epoch / 200) == pytest.approx(factor, rel=0, abs=1e-12), epoch
    assert [learning_rate_schedule(1.0, e, 10) for e in range(1, 11)] == pytest.approx(ten_epochs, rel=0, abs=1e-12)
