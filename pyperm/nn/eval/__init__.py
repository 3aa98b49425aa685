"""Evaluating interpolated models: BatchNorm statistics, loss barriers, REPAIR, robustness.

- :func:`reset_bn_stats`: exact BatchNorm running statistics for a model's current weights.
- :class:`PathResult`: loss and accuracy at points along a path of networks, the base of
  :class:`BarrierResult` and :class:`CurveResult`; :func:`plot_paths` draws several paths
  in one PNG and :func:`summary_table` tabulates them.
- :func:`barrier`: loss and accuracy along the linear path between two models, and the
  barriers of Git Re-Basin's Definition 2.2 (Ainsworth, Hayase and Srinivasa, 2023).
- :func:`repair`: REPAIR (Jordan, Sedghi, Saukh, Entezari and Neyshabur, 2023), the
  interpolated model with every permuted unit's pre-activation statistics renormalised to
  the interpolation of the endpoints'; :func:`repair_many` the same for a merge of several
  aligned models.
- :func:`pgd_attack` and :func:`robust_accuracy`: PGD adversarial examples (Madry et al.,
  2018) and the accuracy under them (the robust curves of Tatro et al., 2020, section 5,
  train and evaluate with these).
"""

from pyperm.nn.eval.barrier import barrier
from pyperm.nn.eval.batchnorm import reset_bn_stats
from pyperm.nn.eval.path import BarrierResult, CurveResult, PathResult, plot_paths, summary_table
from pyperm.nn.eval.repair import repair, repair_many
from pyperm.nn.eval.robust import pgd_attack, robust_accuracy

__all__ = [
    "BarrierResult",
    "CurveResult",
    "PathResult",
    "barrier",
    "pgd_attack",
    "plot_paths",
    "repair",
    "repair_many",
    "reset_bn_stats",
    "robust_accuracy",
    "summary_table",
]
