r"""Loss and accuracy along a curve, with BatchNorm statistics recomputed at every point."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pyperm._plotting import agg_figure
from pyperm._progress import progress_bar
from pyperm.nn.curves._points import PointEvaluator
from pyperm.nn.eval.robust import check_attack, robust_accuracy
from pyperm.nn.curves.train import check_curve

__all__ = ["CurveResult", "evaluate_curve", "plot_curve_results", "summary_table"]

logger = logging.getLogger(__name__)


@dataclass
class CurveResult:
    r"""Loss and accuracy of the networks :math:`r_\phi(t)` at evenly spaced points ``ts``.

    Attributes
    ----------
    ts : (n,) numpy.ndarray
        The points, from 0 to 1.
    loss : (n,) numpy.ndarray
        Mean loss over the samples of the evaluation data at each point.
    accuracy : (n,) numpy.ndarray
        Fraction of correctly classified samples at each point (NaN when the targets are
        not class indices).
    robust_accuracy : (n,) numpy.ndarray or None
        Accuracy on PGD adversarial examples at each point (``evaluate_curve(...,
        adversarial=...)``), else None.

    Notes
    -----
    ``average_accuracy``, ``min_accuracy`` and ``max_loss`` are the columns of Tatro et
    al.'s Tables 1-2; over evenly spaced points the mean estimates
    :math:`\int_0^1 \mathrm{acc}(r_\phi(t))\,dt`, as the paper reports it.
    """

    ts: np.ndarray
    loss: np.ndarray
    accuracy: np.ndarray
    robust_accuracy: np.ndarray | None = None

    @property
    def average_accuracy(self) -> float:
        """Mean accuracy over the points."""
        return float(np.mean(self.accuracy))

    @property
    def min_accuracy(self) -> float:
        """Accuracy of the worst network on the curve."""
        return float(np.min(self.accuracy))

    @property
    def max_loss(self) -> float:
        """Loss of the worst network on the curve."""
        return float(np.max(self.loss))

    @property
    def average_loss(self) -> float:
        """Mean loss over the points."""
        return float(np.mean(self.loss))

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (lists and floats), ready for ``json.dump``."""
        out = {
            "ts": [float(t) for t in self.ts],
            "loss": [float(x) for x in self.loss],
            "accuracy": [float(x) for x in self.accuracy],
            "average_accuracy": self.average_accuracy,
            "min_accuracy": self.min_accuracy,
            "max_loss": self.max_loss,
            "average_loss": self.average_loss,
        }
        if self.robust_accuracy is not None:
            out["robust_accuracy"] = [float(x) for x in self.robust_accuracy]
        return out

    def to_markdown(self) -> str:
        """A Markdown table of the points, after a line with the summary."""
        lines = [
            (f"average accuracy {self.average_accuracy:.4f}, min accuracy {self.min_accuracy:.4f}, "
             f"max loss {self.max_loss:.4f}"),
            "",
            "| t | loss | accuracy |",
            "| ---: | ---: | ---: |",
        ]
        lines += [f"| {t:.3f} | {x:.4f} | {a:.4f} |" for t, x, a in zip(self.ts, self.loss, self.accuracy)]
        return "\n".join(lines)

    def plot(self, path: str | Path, *, label: str = "curve", title: str | None = None) -> Path:
        """Write a PNG of the loss and accuracy along the curve; returns the path."""
        return plot_curve_results({label: self}, path, title=title)


def summary_table(results: Mapping[str, CurveResult]) -> str:
    """A Markdown table with one row per curve: Tatro et al.'s Table 1-2 columns."""
    lines = ["| curve | average accuracy | min accuracy | average loss | max loss |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r.average_accuracy:.4f} | {r.min_accuracy:.4f} | {r.average_loss:.4f} | "
                     f"{r.max_loss:.4f} |")
    return "\n".join(lines)


def plot_curve_results(results: Mapping[str, CurveResult], path: str | Path, *, title: str | None = None,
                       dashed: Iterable[str] = ()) -> Path:
    """Loss (left) and accuracy (right) against ``t`` for several curves, as a PNG.

    Parameters
    ----------
    results : mapping of str to CurveResult
        One line per entry, labelled by its key (e.g. ``"aligned"``, ``"unaligned"``).
    path : str or pathlib.Path
        Where to write the PNG.
    title : str, optional
        A title over both panels.
    dashed : iterable of str, optional
        Labels drawn with dashed lines (e.g. the straight lines before training).

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    if not isinstance(results, Mapping) or not results:
        raise TypeError("results must be a non-empty mapping of labels to CurveResult")
    for name, r in results.items():
        if not isinstance(r, CurveResult):
            raise TypeError(f"results[{name!r}] must be a CurveResult, got {type(r).__name__}")
    fig = agg_figure(9, 3.6)
    ax_loss, ax_acc = fig.subplots(1, 2)
    dashed = set(dashed)
    for k, (name, r) in enumerate(results.items()):
        style = {"marker": "o", "markersize": 3, "label": name, "color": f"C{k % 10}",
                 "linestyle": "--" if name in dashed else "-"}
        ax_loss.plot(r.ts, r.loss, **style)
        ax_acc.plot(r.ts, 100 * np.asarray(r.accuracy), **style)
        if r.robust_accuracy is not None:  # Tatro et al. Figure 4: robust accuracy dotted, same colour
            ax_acc.plot(r.ts, 100 * np.asarray(r.robust_accuracy),
                        **{**style, "marker": "x", "linestyle": ":", "label": f"{name} (robust)"})
    ax_loss.set_xlabel("t")
    ax_loss.set_ylabel("loss")
    ax_acc.set_xlabel("t")
    ax_acc.set_ylabel("accuracy (%)")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def evaluate_curve(
    curve: Any,
    data: Iterable[Any],
    *,
    num_points: int = 21,
    bn_data: Iterable[Any] | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    progress: bool = False,
    adversarial: dict[str, Any] | None = None,
) -> CurveResult:
    r"""Loss and accuracy of the networks along a curve (Tatro et al. Tables 1-2, Figure 3).

    At each of ``num_points`` evenly spaced :math:`t_i = i / (n - 1)`, the network
    :math:`r_\phi(t_i)` (:meth:`~pyperm.nn.curves.BezierCurve.state_at`) is loaded into a
    private copy of the curve's model, its BatchNorm running statistics are recomputed
    over ``bn_data`` (:func:`~pyperm.nn.eval.batchnorm.reset_bn_stats`, Tatro et al.
    appendix B), and its mean loss and accuracy over ``data`` are measured in eval mode.

    Parameters
    ----------
    curve : BezierCurve or PolyChain
        The curve (trained or not: an untrained curve is the straight line).
    data : re-iterable of (inputs, targets, ...)
        Evaluation batches (a DataLoader or a list; a generator is refused, it is read
        once per point).
    num_points : int, default 21
        Points from 0 to 1, endpoints included (at least 2).
    bn_data : re-iterable of batches, optional
        Batches (the training data, in the papers) for the BatchNorm statistics of each
        point. Required when the model has BatchNorm layers; ignored otherwise.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)`` returning the batch's mean loss;
        :func:`torch.nn.functional.cross_entropy` by default.
    progress : bool, default False
        Show a tqdm progress bar over the points.
    adversarial : dict, optional
        Also measure the robust accuracy at every point (Tatro et al. Figure 4):
        :func:`~pyperm.nn.eval.robust.robust_accuracy` of the point's network (eval
        mode, recomputed BatchNorm statistics) on ``data`` with these
        :func:`~pyperm.nn.eval.robust.pgd_attack` keyword arguments (``eps``,
        ``steps``, ``step_size``, ...).

    Returns
    -------
    CurveResult
        ``ts``, ``loss``, ``accuracy`` and the summaries ``average_accuracy``,
        ``min_accuracy``, ``max_loss``; ``plot(path)``, ``to_dict()``,
        ``to_markdown()``.

    Raises
    ------
    TypeError
        ``curve`` is not a pyperm curve; ``data`` or ``bn_data`` is not a re-iterable of
        batches; ``num_points`` is not an int; ``loss_fn`` is not callable.
    ValueError
        ``num_points`` < 2; the model has BatchNorm layers and ``bn_data`` is None;
        ``data`` yields no batches.

    Notes
    -----
    Neither the curve nor the user's model is modified: each point is assigned into a
    deep copy of the model made once per call (one model's worth of extra memory). The
    work is ``num_points`` passes over ``data`` plus, with BatchNorm, as many over
    ``bn_data``: more than an epoch of curve training, as the paper notes.

    References
    ----------
    .. [1] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment",
       NeurIPS 2020, appendix B and Table 1.
    .. [2] T. Garipov et al., "Loss Surfaces, Mode Connectivity, and Fast Ensembling of
       DNNs", NeurIPS 2018.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import BezierCurve, evaluate_curve
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: -v for k, v in a.items()}
    >>> data = [(torch.randn(16, 4), torch.randint(0, 3, (16,)))]
    >>> result = evaluate_curve(BezierCurve(net, a, b), data, num_points=5)
    >>> result.ts.tolist()
    [0.0, 0.25, 0.5, 0.75, 1.0]
    """
    check_curve(curve)
    if isinstance(num_points, bool) or not isinstance(num_points, int):
        raise TypeError(f"num_points must be an int, got {type(num_points).__name__}")
    if num_points < 2:
        raise ValueError(f"num_points must be at least 2, got {num_points}")
    attack = None if adversarial is None else check_attack(adversarial)
    evaluator = PointEvaluator(curve.model, data, bn_data, loss_fn)
    ts = np.linspace(0.0, 1.0, num_points)
    loss = np.empty(num_points)
    accuracy = np.empty(num_points)
    robust = None if attack is None else np.empty(num_points)
    bar = progress_bar(progress, num_points, "curve evaluation", "point")
    try:
        for i, t in enumerate(ts):
            loss[i], accuracy[i] = evaluator(curve.state_at(float(t)))
            if robust is not None:  # evaluator.model now holds the point, BatchNorm statistics recomputed
                robust[i] = robust_accuracy(evaluator.model, data, **attack)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    result = CurveResult(ts=ts, loss=loss, accuracy=accuracy, robust_accuracy=robust)
    logger.debug("evaluate_curve: %d points, average accuracy %.4g, min accuracy %.4g, max loss %.4g",
                 num_points, result.average_accuracy, result.min_accuracy, result.max_loss)
    if math.isnan(result.max_loss):
        logger.warning("evaluate_curve: the loss is NaN at some point of the curve")
    return result
