r"""PAM's curve step as Tatro et al.'s code runs it (``pam(..., recipe="tatro")``).

Their ``training/train_curve_pam.py`` and ``utils.train_perm`` (IBM/NeuronAlignment) train the
bend :math:`\theta_c` of the curve, for every batch,

1. one step of SGD with Nesterov momentum 0.9 (no weight decay) on the loss at a drawn
   :math:`t` plus the regulariser :math:`\frac{\lambda}{2}\|r(t)\|^2` on the point of the
   curve, :math:`\lambda = 5\cdot 10^{-4}` (the same one ``train_curve(recipe="garipov")``
   uses: ``point_decay``);
2. then the exact proximal map toward the bend :math:`\theta_c^k` the step started from,
   :math:`\theta_c \leftarrow (\theta_c + \frac{\eta}{\nu}\theta_c^k) / (1 + \frac{\eta}{\nu})`,
   with :math:`\eta` the current learning rate: the minimiser of
   :math:`\frac{1}{2\eta}\|\theta - \theta_c\|^2 + \frac{1}{2\nu}\|\theta - \theta_c^k\|^2`,
   applied outside the optimizer, so it never enters the momentum;

with the learning rate of epoch :math:`e` (from 0)
:math:`\eta_0 \cdot 0.5^{\lfloor e/20 \rfloor} \cdot 0.9996^{e}`, set per epoch (their
``LambdaLR``). This module gives those pieces to :func:`~pyperm.nn.curves.train_curve`: an
optimizer class that takes the proximal map after each of its steps, and the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["POINT_DECAY", "proximal_nesterov_sgd", "tatro_factor", "tatro_scheduler"]

POINT_DECAY = 5e-4  # their --wd, given to curves_pam.l2_regularizer
LR_DROP = 20  # their --lr_drop: the rate halves every 20 epochs
LR_DECAY = 0.9996  # their --lr_decay, per epoch


def tatro_factor(epoch: int) -> float:
    """The factor of the learning rate in epoch ``epoch`` (from 0): ``0.5**(epoch // 20) * 0.9996**epoch``."""
    return 0.5 ** (epoch // LR_DROP) * LR_DECAY**epoch


def tatro_scheduler(first_epoch: int = 0) -> Callable[[torch.optim.Optimizer], Any]:
    """A ``lr_scheduler`` factory for ``train_curve``: their schedule, starting at epoch ``first_epoch``
    (later outer iterations of PAM go on where the earlier ones stopped, as their scheduler does)."""

    def build(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: tatro_factor(first_epoch + e))

    return build


def proximal_nesterov_sgd(nu: float) -> type[torch.optim.Optimizer]:
    r"""An SGD class (Nesterov momentum) whose every step ends with the proximal map toward the
    parameters it was built with, :math:`\theta \leftarrow (\theta + \frac{\eta}{\nu}\theta^k)/(1 + \frac{\eta}{\nu})`.

    A class, because ``train_curve`` builds its optimizer from one (``lr``, ``momentum``,
    ``weight_decay``); the anchors :math:`\theta^k` are the parameters at construction,
    which is the start of the curve step.
    """

    class ProximalNesterovSGD(torch.optim.SGD):
        def __init__(self, params: Any, lr: float, momentum: float = 0.9, weight_decay: float = 0.0) -> None:
            super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=True)
            self.anchors = [[p.detach().clone() for p in group["params"]] for group in self.param_groups]

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = super().step(closure)
            for group, anchors in zip(self.param_groups, self.anchors):
                ratio = group["lr"] / nu
                for p, anchor in zip(group["params"], anchors):
                    p.add_(anchor, alpha=ratio).div_(1.0 + ratio)
            return loss

    return ProximalNesterovSGD
