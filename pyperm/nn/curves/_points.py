"""Loss and accuracy of one architecture at many weight vectors (points of curves and planes).

Every point is loaded into a private copy of the user's model (``load_state_dict`` with
``assign=True``, so the copy takes the point's device and dtype), its BatchNorm statistics
are recomputed on ``bn_data`` (Tatro et al. 2020, appendix B: the running statistics of a point
on a curve are not those of its endpoints), and it is evaluated in eval mode on every data
set given, from that one recomputation. The user's model is never touched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyperm._checks import check_callable
from pyperm.nn._checks import check_module
from pyperm.nn._ranks import data_group
from pyperm.nn._runtime import check_batches, eval_mode, mean_loss_and_accuracy, module_device
from pyperm.nn.eval.batchnorm import reset_bn_stats, resolve_bn_data

__all__ = ["PointEvaluator", "check_datasets"]


def check_datasets(data: Any, name: str = "data") -> dict[str, Iterable[Any]]:
    """``data`` as named data sets: a mapping name -> re-iterable of ``(inputs, targets)``
    batches as it is (each checked), a single re-iterable as ``{name: data}``."""
    if isinstance(data, Mapping):
        if not data:
            raise ValueError(f"{name} must name at least one data set, got an empty mapping")
        for key in data:
            if not isinstance(key, str):
                raise TypeError(f"{name} must be keyed by data set names (str), got {type(key).__name__} key {key!r}")
        return {key: check_batches(value, f"{name}[{key!r}]", reiterable=True) for key, value in data.items()}
    return {name: check_batches(data, name, reiterable=True)}


class PointEvaluator:
    """``evaluator(state) -> {name: (loss, accuracy)}`` for states of ``model``'s architecture.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture; deep-copied once (the copy is what gets loaded).
    datasets : mapping of str to re-iterable of (inputs, targets, ...)
        The evaluation data sets by name (see :func:`check_datasets`), each read once
        per point.
    bn_data : re-iterable of batches, False or None
        Batches for :func:`~pyperm.nn.eval.batchnorm.reset_bn_stats` at every point;
        required when the model has BatchNorm layers with running statistics (False:
        keep the point's own, knowingly). See
        :func:`~pyperm.nn.eval.batchnorm.resolve_bn_data`.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)``, the batch's mean loss; cross-entropy by default.

    Attributes
    ----------
    model : torch.nn.Module
        The private copy, holding the last point evaluated (statistics recomputed).
    num_samples : dict of str to int
        Samples of each data set read at each point (0 before the first).
    """

    def __init__(self, model: nn.Module, datasets: Mapping[str, Iterable[Any]], bn_data: Iterable[Any] | bool | None,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None, group: Any = None) -> None:
        check_module(model, "model")
        self.group = group
        self.ranks = data_group(group)
        self.datasets = dict(datasets)
        if bn_data is not None and not isinstance(bn_data, bool):
            check_batches(bn_data, "bn_data", supervised=False, reiterable=True)
        self.bn_data = resolve_bn_data(model, bn_data)
        self.loss_fn = F.cross_entropy if loss_fn is None else check_callable(loss_fn, "loss_fn")
        self.model = copy.deepcopy(model)
        self.num_samples = dict.fromkeys(self.datasets, 0)

    def __call__(self, state: Mapping[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
        """Mean loss over the samples of each data set and accuracy (NaN unless classification)."""
        self.model.load_state_dict(state, assign=True)
        if self.bn_data is not None:
            reset_bn_stats(self.model, self.bn_data, group=self.group)
        out = {}
        device = module_device(self.model)
        with torch.no_grad(), eval_mode(self.model):
            for name, data in self.datasets.items():
                loss, accuracy, self.num_samples[name] = mean_loss_and_accuracy(
                    self.model, data, self.loss_fn, device, name, ranks=self.ranks)
                out[name] = (loss, accuracy)
        return out
