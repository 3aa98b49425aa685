"""Evaluating interpolated models: BatchNorm statistics, loss barriers, REPAIR.

- :func:`reset_bn_stats`: exact BatchNorm running statistics for a model's current weights.
- :func:`barrier` and :class:`BarrierResult`: loss and accuracy along the linear path
  between two models, and the barriers of Git Re-Basin's Definition 2.2;
  :func:`plot_paths` draws several paths in one PNG.
- :func:`repair`: REPAIR (Jordan et al., 2023), the interpolated model with every permuted
  unit's pre-activation statistics renormalised to the interpolation of the endpoints'.
- :func:`pgd_attack` and :func:`robust_accuracy`: PGD adversarial examples and the accuracy
  under them (the robust curves of Tatro et al. section 5 train and evaluate with these).
"""

from pyperm.nn.eval.barrier import BarrierResult, barrier, plot_paths
from pyperm.nn.eval.batchnorm import reset_bn_stats
from pyperm.nn.eval.repair import repair
from pyperm.nn.eval.robust import pgd_attack, robust_accuracy

__all__ = ["BarrierResult", "barrier", "pgd_attack", "plot_paths", "repair", "reset_bn_stats", "robust_accuracy"]
