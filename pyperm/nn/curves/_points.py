"""Loss and accuracy of one architecture at many weight vectors (points of curves and planes).

Every point is loaded into a private copy of the user's model (``load_state_dict`` with
``assign=True``, so the copy takes the point's device and dtype), its BatchNorm statistics
are recomputed on ``bn_data`` (Tatro et al. appendix B: the running statistics of a point
on a curve are not those of its endpoints), and it is evaluated in eval mode. The user's
model is never touched.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn._runtime import eval_mode, mean_loss_and_accuracy, module_device
from pyperm.nn._checks import check_module, check_reiterable
from pyperm.nn.eval.batchnorm import batchnorm_modules, reset_bn_stats

__all__ = ["PointEvaluator"]


class PointEvaluator:
    """``evaluator(state) -> (loss, accuracy)`` for states of ``model``'s architecture.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture; deep-copied once (the copy is what gets loaded).
    data : re-iterable of (inputs, targets, ...)
        The evaluation batches, read once per point.
    bn_data : re-iterable of batches, optional
        Batches for :func:`~pyperm.nn.eval.batchnorm.reset_bn_stats` at every point;
        required when the model has BatchNorm layers with running statistics.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)``, the batch's mean loss; cross-entropy by default.
    """

    def __init__(self, model: nn.Module, data: Iterable[Any], bn_data: Iterable[Any] | None,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None) -> None:
        check_module(model, "model")
        self.data = check_reiterable(data, "data")
        self.has_bn = bool(batchnorm_modules(model))
        if self.has_bn and bn_data is None:
            raise ValueError(
                "bn_data is required: the model has BatchNorm layers, whose running statistics must be recomputed "
                "at every point (the statistics of the endpoints do not describe the networks between them); "
                "pass training batches as bn_data"
            )
        self.bn_data = None if bn_data is None else check_reiterable(bn_data, "bn_data")
        if loss_fn is None:
            loss_fn = F.cross_entropy
        elif not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.model = copy.deepcopy(model)

    def __call__(self, state: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        """Mean loss over the samples of ``data`` and accuracy (NaN unless classification)."""
        self.model.load_state_dict(state, assign=True)
        if self.has_bn:
            reset_bn_stats(self.model, self.bn_data)
        with torch.no_grad(), eval_mode(self.model):
            loss, accuracy, _ = mean_loss_and_accuracy(self.model, self.data, self.loss_fn, module_device(self.model))
        return loss, (math.nan if accuracy is None else accuracy)
