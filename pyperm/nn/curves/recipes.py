r"""Named recipes of curve training: the settings of a paper's code, one argument away.

``train_curve(..., recipe="garipov")`` trains the way Garipov et al.'s public code
(``dnn-mode-connectivity``) does, which Tatro et al. train their curves with: SGD with momentum
0.9 (:func:`~pyperm.nn.curves.train_curve`'s defaults), no optimizer weight decay, the
regulariser :math:`\frac{\lambda}{2}\|r_\phi(t)\|^2` on the point of the curve with
:math:`\lambda = 5 \cdot 10^{-4}` (their published curve runs' ``--wd``), and their
learning-rate schedule (:func:`~pyperm.nn.curves.schedules.garipov_schedule`). A recipe only
fills in what the caller leaves unset.

References
----------
.. [1] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss Surfaces,
   Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018 (code: ``train.py``,
   ``curves.l2_regularizer``).
.. [2] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing Mode
   Connectivity via Neuron Alignment", NeurIPS 2020.
"""

from __future__ import annotations

from typing import Any

from pyperm._checks import check_choice, check_nonnegative_real

__all__ = ["RECIPES", "resolve_recipe"]

# What each recipe fills in among the arguments the caller left unset (None).
# "garipov": Garipov et al.'s public code, which Tatro et al. train their curves with: SGD with
# momentum 0.9 (the defaults), no optimizer weight decay, the regulariser on the point of the
# curve with the coefficient of their published curve runs (--wd=5e-4), and their schedule.
RECIPES: dict[str, dict[str, Any]] = {"garipov": {"point_decay": 5e-4, "lr_schedule": "garipov"}}


def resolve_recipe(recipe: str | None, point_decay: float | None, lr_schedule: Any,
                   lr_scheduler: Any) -> tuple[float, Any]:
    """``point_decay`` and ``lr_schedule`` with what ``recipe`` fills in where they are None."""
    defaults: dict[str, Any] = {"point_decay": 0.0, "lr_schedule": None}
    if recipe is not None:
        defaults = RECIPES[check_choice(recipe, "recipe", RECIPES)]
    if point_decay is None:
        point_decay = defaults["point_decay"]
    if lr_schedule is None and lr_scheduler is None:
        lr_schedule = defaults["lr_schedule"]  # a scheduler the caller gives replaces the recipe's schedule
    return check_nonnegative_real(point_decay, "point_decay"), lr_schedule
