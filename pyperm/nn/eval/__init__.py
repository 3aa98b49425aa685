"""Evaluating interpolated models: BatchNorm statistics, loss barriers, REPAIR.

- :func:`reset_bn_stats`: exact BatchNorm running statistics for a model's current weights.
- :func:`barrier` and :class:`BarrierResult`: loss and accuracy along the linear path
  between two models, and the barriers of Git Re-Basin's Definition 2.2;
  :func:`plot_paths` draws several paths in one PNG.
- :func:`repair`: REPAIR (Jordan et al., 2023), the interpolated model with every permuted
  unit's pre-activation statistics renormalised to the interpolation of the endpoints'.
"""

from pyperm.nn.eval.barrier import BarrierResult, barrier, plot_paths
from pyperm.nn.eval.batchnorm import reset_bn_stats
from pyperm.nn.eval.repair import repair

__all__ = ["BarrierResult", "barrier", "plot_paths", "repair", "reset_bn_stats"]
