"""PAM's curve step with ``recipe="tatro"`` against an independent rewrite of Tatro et al.'s loop.

The reference is their public code (IBM/NeuronAlignment: ``training/train_curve_pam.py`` and
``utils.train_perm``), written again here in its own terms and without pyperm: the bend of a
quadratic Bezier curve kept as plain tensors, started at the midpoint of the endpoints; for
every batch the loss at a drawn ``t`` plus ``0.5 * 5e-4 * ||theta(t)||^2``, one step of
``torch.optim.SGD(momentum=0.9, nesterov=True)``, then the proximal map
``theta = (theta + lr/nu * theta_old) / (1 + lr/nu)`` with the scheduler's current rate, and
``LambdaLR(0.5 ** (e // 20) * 0.9996 ** e)`` stepped after every epoch. With the permutation
step switched off (no relaxed steps, no samples) PAM's curve is that curve; fed the same
draws of ``t`` the two must agree to 1e-9 (float64) after several epochs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pyperm.nn import PermutationSpec, pam
from pyperm.testing import one_thread

DTYPE = torch.float64
EPOCHS = 3
LR, NU = 0.1, 1e3
WD = 5e-4


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _net(seed: int) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).to(DTYPE)


def _problem():
    model = _net(0)
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = {k: v.detach().clone() for k, v in _net(1).state_dict().items()}
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(n, 5, generator=g, dtype=DTYPE), torch.randint(0, 3, (n,), generator=g)) for n in (8, 8, 5)]
    return model, a, b, data


def _pam_curve_seed(seed: int) -> int:
    """The seed pam gives its curve step: the first draw of its generator (no permutation step draws before)."""
    return int(torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(seed)))


def reference_curve_step(model, a, b, data, epochs, seed):
    """Tatro et al.'s curve step, rewritten: returns the bend after ``epochs`` epochs."""
    theta = {k: (0.5 * (a[k] + b[k])).clone().requires_grad_() for k in a}  # init_linear: the segment's midpoint
    old = {k: v.detach().clone() for k, v in theta.items()}  # params_before: the bend the subproblem starts at
    optimizer = torch.optim.SGD(list(theta.values()), lr=LR, momentum=0.9, weight_decay=0.0, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.5 ** (e // 20) * 0.9996**e)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for x, y in data:
            t = torch.rand((), generator=g, dtype=DTYPE)
            point = {k: (1 - t) ** 2 * a[k] + 2 * t * (1 - t) * theta[k] + t**2 * b[k] for k in a}
            loss = F.cross_entropy(functional_call(model, point, (x,)), y)
            loss = loss + 0.5 * WD * sum((w**2).sum() for w in point.values())  # l2_regularizer(wd)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            lr = scheduler.get_last_lr()[0]
            with torch.no_grad():
                for k in theta:
                    theta[k].copy_(1 / (1 + lr / NU) * (theta[k] + lr / NU * old[k]))
        scheduler.step()
    return {k: v.detach() for k, v in theta.items()}


def _pam(model, a, b, data, **options):
    spec = PermutationSpec.from_model(model, data[0][0][:2])
    return pam(model, spec, a, b, data, perm_steps=0, perm_samples=0, curve_epochs=EPOCHS, lr_curve=LR,
               nu_curve=NU, seed=7, **options)  # fmt: skip


def test_tatro_recipe_is_their_curve_step():
    model, a, b, data = _problem()
    ours = _pam(model, a, b, data, recipe="tatro")
    assert ours.history[0].choice == "previous"  # the permutation stayed: only the curve step ran
    bend = reference_curve_step(model, a, b, data, EPOCHS, _pam_curve_seed(7))
    mid = ours.curve.state_at(0.5)
    for k in a:
        # r(1/2) = A/4 + bend/2 + B/4
        expected = 0.25 * a[k] + 0.5 * bend[k] + 0.25 * b[k]
        torch.testing.assert_close(mid[k].detach(), expected, rtol=1e-9, atol=1e-12)
    moved = max(float((bend[k] - 0.5 * (a[k] + b[k])).abs().max()) for k in a)
    assert moved > 1e-3  # the bend did move: the comparison is not of two untouched midpoints


def test_default_curve_step_is_not_theirs():
    """Without the recipe the curve step differs (plain momentum, no regulariser, the term as a gradient)."""
    model, a, b, data = _problem()
    default = _pam(model, a, b, data).curve.state_at(0.5)
    bend = reference_curve_step(model, a, b, data, EPOCHS, _pam_curve_seed(7))
    gap = max(float((default[k].detach() - (0.25 * a[k] + 0.5 * bend[k] + 0.25 * b[k])).abs().max()) for k in a)
    assert gap > 1e-6


def test_tatro_allows_lr_above_nu():
    """The exact proximal map is stable for any rate: the lr_curve / nu_curve < 1 rule is the gradient form's."""
    model, a, b, data = _problem()
    spec = PermutationSpec.from_model(model, data[0][0][:2])
    with pytest.raises(ValueError, match="lr_curve / nu_curve"):
        pam(model, spec, a, b, data, perm_steps=0, perm_samples=0, curve_epochs=1, lr_curve=0.5, nu_curve=0.1)
    out = pam(model, spec, a, b, data, perm_steps=0, perm_samples=0, curve_epochs=1, lr_curve=0.5, nu_curve=0.1,
              recipe="tatro")  # fmt: skip
    assert all(torch.isfinite(v).all() for v in out.curve.state_at(0.5).values())


def test_unknown_recipe_is_named():
    model, a, b, data = _problem()
    with pytest.raises(ValueError, match="recipe"):
        _pam(model, a, b, data, recipe="garipov")
