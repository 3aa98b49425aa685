r"""Learning-rate schedules for curve training.

A schedule is either a function of the fraction of training done, ``f(fraction) -> factor``,
or a factory of a :mod:`torch.optim.lr_scheduler` scheduler. A function is read per epoch
the way Garipov et al.'s ``train.py`` reads its own: epoch :math:`e` of :math:`E` (counted
from 1) runs at ``lr * f(e / E)``. A scheduler from a factory is stepped once after every
epoch (with the epoch's mean loss for
:class:`~torch.optim.lr_scheduler.ReduceLROnPlateau`).

References
----------
.. [1] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss Surfaces,
   Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018 (and the authors' public
   code, github.com/timgaripov/dnn-mode-connectivity, ``train.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real
from typing import Any

import torch

from pyperm._checks import check_callable, check_choice

__all__ = ["SCHEDULES", "constant_schedule", "garipov_schedule", "make_scheduler", "step_scheduler"]


def garipov_schedule(fraction: float) -> float:
    r"""Garipov et al.'s learning-rate factor at ``fraction`` of the training epochs.

    .. math::

        f(\alpha) = \begin{cases}
            1 & \alpha \le 0.5, \\
            1 - 0.99\,\dfrac{\alpha - 0.5}{0.4} & 0.5 < \alpha \le 0.9, \\
            0.01 & \alpha > 0.9:
        \end{cases}

    the base rate for the first half of training, then a straight line down to 1% of
    it at 90%, then constant. Epoch :math:`e` of :math:`E` (from 1) runs at
    ``lr * garipov_schedule(e / E)``, as in the authors' ``train.py``.

    Examples
    --------
    >>> [round(garipov_schedule(a), 4) for a in (0.1, 0.5, 0.7, 0.9, 1.0)]
    [1.0, 1.0, 0.505, 0.01, 0.01]
    """
    if fraction <= 0.5:
        return 1.0
    if fraction <= 0.9:
        return 1.0 - (fraction - 0.5) / 0.4 * 0.99
    return 0.01


def constant_schedule(fraction: float) -> float:
    """The factor 1 at every epoch: the learning rate as given."""
    return 1.0


SCHEDULES: dict[str, Callable[[float], float]] = {"constant": constant_schedule, "garipov": garipov_schedule}

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def _checked_factor(schedule: Callable[[float], float], name: str) -> Callable[[float], float]:
    """``schedule`` with its value checked: a finite, non-negative real number."""

    def factor(fraction: float) -> float:
        value = schedule(fraction)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must return a finite, non-negative factor of lr; at fraction {fraction:.4g} "
                             f"it returned {value!r}")
        return float(value)

    return factor


def make_scheduler(optimizer: torch.optim.Optimizer, lr_schedule: Any, lr_scheduler: Any,
                   epochs: int | None) -> Any:
    """The scheduler that ``lr_schedule`` or ``lr_scheduler`` describes over ``optimizer``, or None.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer of the bends, at its base learning rate.
    lr_schedule : {"constant", "garipov"} or callable or None
        A function of the fraction of training done returning the factor of the base
        rate (or one of :data:`SCHEDULES` by name); needs ``epochs``.
    lr_scheduler : callable or None
        ``lr_scheduler(optimizer)`` returning a :mod:`torch.optim.lr_scheduler` scheduler,
        e.g. ``functools.partial(torch.optim.lr_scheduler.StepLR, step_size=30)``.
    epochs : int or None
        The number of epochs a fraction is measured against.

    Raises
    ------
    TypeError
        A schedule of the wrong type, or a factory that returns no scheduler.
    ValueError
        Both are given, a schedule name is unknown, a function schedule lacks
        ``epochs``, or a factor is negative or not finite.
    """
    if lr_schedule is not None and lr_scheduler is not None:
        raise ValueError("give lr_schedule (a function of the epoch fraction) or lr_scheduler (a torch scheduler "
                         "factory), not both")
    if lr_scheduler is not None:
        check_callable(lr_scheduler, "lr_scheduler")
        scheduler = lr_scheduler(optimizer)
        if not isinstance(scheduler, (torch.optim.lr_scheduler.LRScheduler,
                                      torch.optim.lr_scheduler.ReduceLROnPlateau)):
            raise TypeError(f"lr_scheduler(optimizer) must return a torch.optim.lr_scheduler scheduler, got "
                            f"{type(scheduler).__name__}")
        return scheduler
    if lr_schedule is None:
        return None
    if isinstance(lr_schedule, str):
        name = check_choice(lr_schedule, "lr_schedule", SCHEDULES)
        if name == "constant":
            return None
        lr_schedule = SCHEDULES[name]
    else:
        check_callable(lr_schedule, "lr_schedule")
    if epochs is None:
        raise ValueError("lr_schedule is a function of the fraction of training done: give epochs= too")
    if epochs == 0:
        return None
    factor = _checked_factor(lr_schedule, "lr_schedule")
    # LambdaLR reads its function at step 0 when built: epoch e (from 1) runs at f(e / epochs).
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: factor((done + 1) / epochs))


def step_scheduler(scheduler: Any, loss: float) -> None:
    """One end-of-epoch step of ``scheduler`` (``ReduceLROnPlateau`` is given the epoch's loss)."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(loss)
    else:
        scheduler.step()
