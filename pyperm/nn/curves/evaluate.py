r"""Loss and accuracy along a curve, with BatchNorm statistics recomputed once per point for every data set."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from pyperm._checks import check_bool, check_int
from pyperm._progress import progress_bar
from pyperm.nn.curves._points import PointEvaluator, check_datasets
from pyperm.nn._ranks import data_group
from pyperm.nn.curves.train import check_curve
from pyperm.nn.eval.path import CurveResult
from pyperm.nn.eval.robust import check_attack, robust_accuracy

__all__ = ["evaluate_curve"]

logger = logging.getLogger(__name__)


def evaluate_curve(
    curve: Any,
    data: Iterable[Any] | Mapping[str, Iterable[Any]],
    *,
    num_points: int = 21,
    bn_data: Iterable[Any] | bool | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    progress: bool = False,
    adversarial: dict[str, Any] | None = None,
    group: Any = None,
) -> CurveResult | dict[str, CurveResult]:
    r"""Loss and accuracy of the networks along a curve (Tatro et al. Tables 1-2, Figure 3).

    At each of ``num_points`` evenly spaced :math:`t_i = i / (n - 1)`, the network
    :math:`r_\phi(t_i)` (:meth:`~pyperm.nn.curves.BezierCurve.state_at`) is loaded into a
    private copy of the curve's model, its BatchNorm running statistics are recomputed
    over ``bn_data`` (:func:`~pyperm.nn.eval.batchnorm.reset_bn_stats`, Tatro et al.
    appendix B), and its mean loss and accuracy over ``data`` are measured in eval mode.
    Given several data sets (the training loss and the test accuracy of the papers'
    tables), every point is evaluated on each of them after that one recomputation.

    Parameters
    ----------
    curve : BezierCurve or PolyChain
        The curve (trained or not: an untrained curve is the straight line).
    data : re-iterable of (inputs, targets, ...), or mapping of str to one
        Evaluation batches (a DataLoader or a list; a generator is refused, it is read
        once per point), or several data sets by name, e.g.
        ``{"train": train_batches, "test": test_batches}``.
    num_points : int, default 21
        Points from 0 to 1, endpoints included (at least 2).
    bn_data : re-iterable of batches, or False, optional
        Batches (the training data, in the papers) for the BatchNorm statistics of each
        point. Required when the model has BatchNorm layers (``False`` evaluates with
        the straight line's running statistics, knowingly); ignored otherwise.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)`` returning the batch's mean loss;
        :func:`torch.nn.functional.cross_entropy` by default.
    progress : bool, default False
        Show a tqdm progress bar over the points.
    adversarial : dict, optional
        Also measure the robust accuracy at every point, on every data set (Tatro et al.
        Figure 4): :func:`~pyperm.nn.eval.robust.robust_accuracy` of the point's
        network (eval mode, recomputed BatchNorm statistics) with these
        :func:`~pyperm.nn.eval.robust.pgd_attack` keyword arguments (``eps``,
        ``steps``, ``step_size``, ...).
    group : torch.distributed.ProcessGroup, optional
        Split every data set and ``bn_data`` over the ranks of this process group: every
        rank calls with the same curve and its own share of the batches; the BatchNorm
        statistics of each point are all-reduced with exact counts, and so are the
        sample-weighted loss sums and the correct, labelled and sample counts, so every
        rank returns what one process returns on all the shares together. None (the
        default): this process alone. Not with ``adversarial``.

    Returns
    -------
    CurveResult or dict of str to CurveResult
        For one data set, its :class:`~pyperm.nn.eval.path.CurveResult`: ``ts``,
        ``loss``, ``accuracy`` (NaN when the targets are not class indices),
        ``num_samples`` (samples of ``data``), ``robust_accuracy`` (NaN unless
        ``adversarial``) and the summaries ``average_accuracy``, ``min_accuracy``,
        ``max_loss``; ``plot(path)``, ``to_dict()``, ``to_markdown()``. For a mapping,
        a dict with one CurveResult per data set, in its order, which
        :func:`~pyperm.nn.eval.path.plot_paths` and
        :func:`~pyperm.nn.eval.path.summary_table` take as they are.

    Raises
    ------
    TypeError
        ``curve`` is not a pyperm curve; ``data`` (or one of its data sets) or
        ``bn_data`` is not a re-iterable of batches (the message says what was given:
        a bare tensor, one batch not wrapped in a list, a generator); ``num_points`` is
        not an int; ``loss_fn`` is not callable; ``progress`` is not a bool.
    ValueError
        ``num_points`` < 2; the model has BatchNorm layers and ``bn_data`` is None;
        ``data`` is an empty mapping or a data set yields no batches; ``group`` is given
        while torch.distributed is not initialised, or with ``adversarial``.

    Notes
    -----
    Neither the curve nor the user's model is modified: each point is assigned into a
    deep copy of the model made once per call (one model's worth of extra memory). The
    work is ``num_points`` passes over every data set plus, with BatchNorm, as many over
    ``bn_data`` (not one per data set): more than an epoch of curve training, as the
    paper notes.

    References
    ----------
    .. [1] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing
       Mode Connectivity via Neuron Alignment", NeurIPS 2020, appendix B and Table 1.
    .. [2] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss
       Surfaces, Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import BezierCurve, evaluate_curve
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: -v for k, v in a.items()}
    >>> train = [(torch.randn(16, 4), torch.randint(0, 3, (16,)))]
    >>> test = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    >>> result = evaluate_curve(BezierCurve(net, a, b), test, num_points=5)
    >>> result.ts.tolist()
    [0.0, 0.25, 0.5, 0.75, 1.0]
    >>> both = evaluate_curve(BezierCurve(net, a, b), {"train": train, "test": test}, num_points=3)
    >>> sorted(both), both["test"].num_samples
    (['test', 'train'], 8)
    """
    check_curve(curve)
    datasets = check_datasets(data)
    num_points = check_int(num_points, "num_points", 2)
    progress = check_bool(progress, "progress")
    attack = None if adversarial is None else check_attack(adversarial)
    if data_group(group) is not None and attack is not None:
        raise ValueError("group: the robust accuracy (adversarial=) is not measured over ranks; evaluate it in one "
                         "process, or pass group=None")
    evaluator = PointEvaluator(curve.model, datasets, bn_data, loss_fn, group)
    ts = np.linspace(0.0, 1.0, num_points)
    loss = {name: np.empty(num_points) for name in datasets}
    accuracy = {name: np.empty(num_points) for name in datasets}
    robust = {name: np.full(num_points, math.nan) for name in datasets}  # NaN: not measured
    bar = progress_bar(progress, num_points, "curve evaluation", "point")
    try:
        for i, t in enumerate(ts):
            for name, (point_loss, point_accuracy) in evaluator(curve.state_at(float(t))).items():
                loss[name][i], accuracy[name][i] = point_loss, point_accuracy
                if attack is not None:  # evaluator.model holds the point, BatchNorm statistics recomputed
                    robust[name][i] = robust_accuracy(evaluator.model, datasets[name], **attack)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    results = {
        name: CurveResult(ts=ts, loss=loss[name], accuracy=accuracy[name], num_samples=evaluator.num_samples[name],
                          robust_accuracy=robust[name])
        for name in datasets
    }
    for name, result in results.items():
        logger.debug("evaluate_curve(%s): %d points, average accuracy %.4g, min accuracy %.4g, max loss %.4g",
                     name, num_points, result.average_accuracy, result.min_accuracy, result.max_loss)
        if math.isnan(result.max_loss):
            logger.warning("evaluate_curve: the loss on %s is NaN at some point of the curve", name)
    return results if isinstance(data, Mapping) else results["data"]
