"""Loss and accuracy along the linear path between two models, and its barriers (``barrier``)."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pyperm._plotting import agg_figure
from pyperm._progress import progress_bar
from pyperm.nn._runtime import eval_mode, mean_loss_and_accuracy, module_device
from pyperm.nn._checks import check_model_states, check_module, check_reiterable
from pyperm.nn.eval.batchnorm import batchnorm_modules, reset_bn_stats
from pyperm.nn.state import interpolate

__all__ = ["BarrierResult", "barrier", "plot_paths"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class BarrierResult:
    r"""Loss and accuracy along the linear path :math:`(1 - t)\,\Theta_A + t\,\Theta_B`.

    Attributes
    ----------
    ts : (k,) ndarray of float64
        The points of the path, increasing from 0 to 1.
    loss : (k,) ndarray of float64
        The mean loss over the samples of the data at each point.
    accuracy : (k,) ndarray of float64 or None
        The fraction of correct predictions (argmax of the outputs' axis 1 equal to
        the target class) at each point, in [0, 1]; None when the targets are not
        class indices.
    loss_barrier : float
        :math:`\max_k\, L(t_k) - \big((1 - t_k) L(0) + t_k L(1)\big)` (Definition 2.2
        of Git Re-Basin over the evaluated points; 0 when the path lies on or below
        the chord). Never negative, since :math:`t = 0` is one of the points.
    accuracy_barrier : float or None
        :math:`\max_k\, \big((1 - t_k) \mathrm{acc}(0) + t_k \mathrm{acc}(1)\big) - \mathrm{acc}(t_k)`,
        the largest drop of accuracy below the chord, as a fraction.
    num_samples : int
        Samples evaluated at each point.
    reset_bn : bool
        Whether the BatchNorm statistics were recomputed at every point.
    """

    ts: np.ndarray
    loss: np.ndarray
    accuracy: np.ndarray | None
    loss_barrier: float
    accuracy_barrier: float | None
    num_samples: int
    reset_bn: bool = False

    @property
    def loss_barrier_t(self) -> float:
        """The point of the path where the loss rises highest above the chord."""
        return float(self.ts[int(np.argmax(self.loss - _chord(self.ts, self.loss)))])

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (lists and floats), ready for ``json.dump``."""
        return {
            "ts": [float(t) for t in self.ts],
            "loss": [float(x) for x in self.loss],
            "accuracy": None if self.accuracy is None else [float(x) for x in self.accuracy],
            "loss_barrier": self.loss_barrier,
            "accuracy_barrier": self.accuracy_barrier,
            "loss_barrier_t": self.loss_barrier_t,
            "num_samples": self.num_samples,
            "reset_bn": self.reset_bn,
        }

    def to_markdown(self) -> str:
        """A Markdown table of the path (accuracies in percent) followed by the two barriers."""
        acc = self.accuracy is not None
        lines = ["| t | loss | accuracy (%) |" if acc else "| t | loss |", "|---:|---:|---:|" if acc else "|---:|---:|"]
        for k, t in enumerate(self.ts):
            row = f"| {t:.3f} | {self.loss[k]:.4f} |"
            if acc:
                row += f" {100.0 * self.accuracy[k]:.2f} |"
            lines.append(row)
        lines.append("")
        lines.append(f"loss barrier: {self.loss_barrier:.4f} (at t = {self.loss_barrier_t:.3f})")
        if self.accuracy_barrier is not None:
            lines.append(f"accuracy barrier: {100.0 * self.accuracy_barrier:.2f} percentage points")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()

    def plot(self, path: str | Path, *, title: str | None = None, label: str | None = None) -> Path:
        """Write a PNG of the loss (and accuracy) along the path, with the chord between the endpoints.

        Parameters
        ----------
        path : str or pathlib.Path
            Where to write the image; parent folders must exist.
        title : str, optional
            The figure's title; by default the barriers.
        label : str, optional
            Legend label of the path (e.g. "weight matching").

        Returns
        -------
        pathlib.Path
            ``path``.

        Raises
        ------
        ImportError
            matplotlib is not installed.

        See Also
        --------
        plot_paths : several paths (naive, matched, repaired) in one figure.
        """
        if title is None:
            title = f"loss barrier {self.loss_barrier:.4g}"
            if self.accuracy_barrier is not None:
                title += f", accuracy barrier {100.0 * self.accuracy_barrier:.2f} pp"
        return plot_paths(path, {label or "path": self}, title=title)


def plot_paths(path: str | Path, results: Mapping[str, BarrierResult], *, title: str | None = None) -> Path:
    """Write a PNG of the loss (and, when every result has it, accuracy) along several paths.

    Each path is drawn with markers at its points and its chord (the line between its
    endpoints' values) dashed in the same colour. matplotlib is imported here, not with
    pyperm, and drawn through its Agg canvas directly (no pyplot), so the caller's
    matplotlib backend and open figures are left alone.

    Parameters
    ----------
    path : str or pathlib.Path
        Where to write the image; parent folders must exist.
    results : mapping of str to BarrierResult
        The paths, by legend label (e.g. ``{"naive": r0, "weight matching": r1}``).
    title : str, optional
        The figure's title.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    TypeError
        ``path`` is not a str or Path, or ``results`` is not a mapping of labels to
        BarrierResult.
    ValueError
        ``results`` is empty.
    ImportError
        matplotlib is not installed.
    """
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or pathlib.Path, got {type(path).__name__}")
    if not isinstance(results, Mapping) or not all(isinstance(r, BarrierResult) for r in results.values()):
        raise TypeError("results must be a mapping of labels to BarrierResult")
    if not results:
        raise ValueError("results must hold at least one BarrierResult")
    path = Path(path)
    panels = [("loss", 1.0, lambda r: r.loss)]
    if all(r.accuracy is not None for r in results.values()):
        panels.append(("accuracy (%)", 100.0, lambda r: r.accuracy))
    fig = agg_figure(4.5 * len(panels), 3.6, layout="constrained")
    for k, (name, scale, values_of) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for i, (label, r) in enumerate(results.items()):
            values = values_of(r)
            color = f"C{i % 10}"
            ax.plot(r.ts, scale * values, marker="o", markersize=3, color=color, label=str(label))
            ax.plot(r.ts, scale * _chord(r.ts, values), linestyle="--", linewidth=1, color=color, alpha=0.6)
        ax.set_xlabel("t")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(path, format="png", dpi=120)
    return path


def _own_copy(t: torch.Tensor, device: torch.device, in_model: set[int]) -> torch.Tensor:
    """``t`` on ``device``, copied when it shares storage with the model's own tensors."""
    moved = t.detach().to(device)
    return moved.clone() if moved.untyped_storage().data_ptr() in in_model else moved


def _chord(ts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The line between the endpoints' values: ``(1 - t) v(0) + t v(1)``."""
    return (1.0 - ts) * values[0] + ts * values[-1]


def _check_ts(ts: Any, num_points: Any) -> np.ndarray:
    if ts is None:
        if isinstance(num_points, bool) or not isinstance(num_points, int):
            raise TypeError(f"num_points must be an int, got {type(num_points).__name__}")
        if num_points < 2:
            raise ValueError(f"num_points must be at least 2 (the two endpoints), got {num_points}")
        return np.linspace(0.0, 1.0, num_points)
    if isinstance(ts, torch.Tensor):
        ts = ts.detach().cpu().tolist()
    elif isinstance(ts, np.ndarray):
        ts = ts.tolist()
    if isinstance(ts, (str, bytes)) or not isinstance(ts, Sequence):
        raise TypeError(f"ts must be a sequence of floats, got {type(ts).__name__}")
    values = []
    for k, t in enumerate(ts):
        if isinstance(t, bool) or not isinstance(t, Real):
            raise TypeError(f"ts[{k}] must be a real number, got {type(t).__name__}")
        values.append(float(t))
    out = np.asarray(values, dtype=np.float64)
    if out.size < 2:
        raise ValueError(f"ts must hold at least two points (0 and 1), got {out.size}")
    if not np.all(np.isfinite(out)):
        raise ValueError("ts must be finite")
    if out[0] != 0.0 or out[-1] != 1.0:
        raise ValueError(
            f"ts must start at 0 and end at 1 (the endpoints define the barrier), got {out[0]} ... {out[-1]}"
        )
    if np.any(np.diff(out) <= 0):
        raise ValueError("ts must be strictly increasing")
    return out


def barrier(
    model: nn.Module,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any],
    *,
    num_points: int = 11,
    ts: Sequence[float] | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    reset_bn: Iterable[Any] | bool | None = None,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> BarrierResult:
    r"""Evaluate the linear path between two models and its loss and accuracy barriers.

    At each point :math:`t` the model is loaded with
    :math:`\Theta(t) = (1 - t)\,\Theta_A + t\,\Theta_B` (:func:`~pyperm.nn.state.interpolate`),
    its BatchNorm statistics are recomputed when ``reset_bn`` is given, and its mean
    loss :math:`L(t)` and accuracy :math:`\mathrm{acc}(t)` over all samples of ``data``
    are measured. The barriers are Definition 2.2 of Git Re-Basin, with the chord
    between the endpoints in place of the plain mean (the two agree at the midpoint
    and the chord also covers endpoints of unequal loss):

    .. math::

        B_{\mathrm{loss}} = \max_t \; L(t) - \big((1 - t) L(0) + t L(1)\big), \qquad
        B_{\mathrm{acc}} = \max_t \; \big((1 - t)\,\mathrm{acc}(0) + t\,\mathrm{acc}(1)\big) - \mathrm{acc}(t).

    Parameters
    ----------
    model : torch.nn.Module
        A model of the architecture both states belong to. Its state, training flags
        and device are the same after the call as before (the state is saved and
        loaded back, also when an error is raised).
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints: the model's ``state_dict`` keys and shapes, with the same
        dtypes and devices as each other. Not modified.
    data : iterable of (inputs, targets, ...)
        The evaluation batches (a DataLoader, a list), read once per point, so it must
        be re-iterable. Inputs may be a tensor or a tuple of the forward's inputs.
    num_points : int, default 11
        Evenly spaced points from 0 to 1, endpoints included; ignored when ``ts`` is
        given.
    ts : sequence of float, optional
        The points, strictly increasing from exactly 0 to exactly 1.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)`` returning the batch's mean loss;
        :func:`torch.nn.functional.cross_entropy` by default. Batch means are
        weighted by batch size, so ``loss`` is the mean over samples.
    reset_bn : iterable of batches, or False, optional
        Batches (the training data, in the papers) over which
        :func:`~pyperm.nn.eval.batchnorm.reset_bn_stats` recomputes the BatchNorm
        statistics at every point. Required when the model has BatchNorm layers:
        interpolated running statistics do not describe the interpolated network.
        ``False`` evaluates with the interpolated running statistics knowingly.
        Ignored for a model without BatchNorm.
    device : str or torch.device, optional
        Where to evaluate; the model's own device by default. On another device a
        copy of the model is used and the model itself is not moved.
    progress : bool, default False
        Show a progress bar over the points (needs tqdm).

    Returns
    -------
    BarrierResult
        ``ts``, ``loss``, ``accuracy``, ``loss_barrier``, ``accuracy_barrier``;
        ``plot(path)`` draws the path (:func:`plot_paths` several), ``to_dict()`` and
        ``to_markdown()`` render it.

    Raises
    ------
    TypeError
        ``model`` is not a module; a state is not a mapping of str to tensors; ``data``
        or ``reset_bn`` is not a re-iterable of batches (a generator is refused: it
        would be empty on the second point); ``loss_fn`` is not callable; ``ts`` or
        ``num_points`` has the wrong type.
    ValueError
        The states do not pair up with each other or with the model (the message
        names the key); ``num_points`` < 2; ``ts`` is not increasing from 0 to 1;
        ``data`` yields no batches; the model has BatchNorm layers and ``reset_bn``
        is None; ``loss_fn`` returns more than one value.

    Notes
    -----
    Evaluation runs in eval mode under ``torch.no_grad``; the BatchNorm reset in
    between runs the BatchNorms in train mode (see ``reset_bn_stats``). The work is
    ``len(ts)`` passes over ``data``, plus as many over ``reset_bn``. While the call
    runs, ``model`` holds the interpolated weights (its own are saved on its device and
    loaded back at the end), so it must not be used from another thread meanwhile.

    References
    ----------
    .. [1] S. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
       Permutation Symmetries", ICLR 2023, Definition 2.2.
    .. [2] J. Frankle, G. K. Dziugaite, D. Roy, M. Carbin, "Linear Mode Connectivity and
       the Lottery Ticket Hypothesis", ICML 2020.

    Examples
    --------
    >>> import torch
    >>> model = torch.nn.Linear(4, 3)
    >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    >>> a = model.state_dict()
    >>> result = barrier(model, a, a, [(x, y)], num_points=3)
    >>> result.loss_barrier
    0.0
    """
    check_module(model)
    check_model_states(model, state_a, state_b)
    check_reiterable(data, "data")
    points = _check_ts(ts, num_points)
    if loss_fn is None:
        loss_fn = F.cross_entropy
    elif not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {type(progress).__name__}")
    has_bn = bool(batchnorm_modules(model))
    if reset_bn is True:
        raise TypeError("reset_bn must be an iterable of batches, False or None, not True")
    if reset_bn is not None and reset_bn is not False:
        check_reiterable(reset_bn, "reset_bn")
    if has_bn and reset_bn is None:
        names = [name for name, _ in batchnorm_modules(model)][:3]
        raise ValueError(
            f"the model has BatchNorm layers ({', '.join(repr(n) for n in names)}, ...): interpolated running "
            "statistics do not describe the interpolated network, so pass reset_bn= (batches of the training "
            "data) to recompute them at every point, or reset_bn=False to use the interpolated ones knowingly"
        )
    do_reset = has_bn and reset_bn is not False

    target = module_device(model) if device is None else torch.device(device)
    own = target != module_device(model)
    # On another device a copy runs, so the caller's model is never moved.
    runner = copy.deepcopy(model).to(target) if own else model
    saved = None if own else {k: v.detach().clone() for k, v in model.state_dict().items()}
    # The endpoints on the evaluation device once, so each point's interpolation is computed there.
    # An endpoint that shares memory with the model (``barrier(a, a.state_dict(), ...)``, the
    # usual call) is copied: loading each point into the model would otherwise move it too.
    in_model = {t.untyped_storage().data_ptr() for t in runner.state_dict().values()}
    a = {k: _own_copy(v, target, in_model) for k, v in state_a.items()}
    b = {k: _own_copy(v, target, in_model) for k, v in state_b.items()}

    losses, accuracies = [], []
    samples = 0
    bar = progress_bar(progress, len(points), "barrier", "point")
    try:
        for t in points:
            with torch.no_grad():
                runner.load_state_dict(interpolate(a, b, float(t)))
            if do_reset:
                reset_bn_stats(runner, reset_bn)
            with torch.no_grad(), eval_mode(runner):
                loss, acc, samples = mean_loss_and_accuracy(runner, data, loss_fn, target)
            losses.append(loss)
            accuracies.append(acc)
            logger.debug("barrier: t=%.4f loss=%.6g accuracy=%s", t, loss, acc)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if saved is not None:
            with torch.no_grad():
                model.load_state_dict(saved)

    loss_arr = np.asarray(losses, dtype=np.float64)
    # t = 0 is a point, where the difference is exactly 0, so the max is never negative (NaN propagates).
    loss_barrier = float(np.max(loss_arr - _chord(points, loss_arr)))
    if any(acc is None for acc in accuracies):
        acc_arr, acc_barrier = None, None
    else:
        acc_arr = np.asarray(accuracies, dtype=np.float64)
        acc_barrier = float(np.max(_chord(points, acc_arr) - acc_arr))
    if not math.isfinite(loss_barrier):
        logger.warning("barrier: the loss is not finite along the path (loss = %s)", loss_arr.tolist())
    return BarrierResult(
        ts=points,
        loss=loss_arr,
        accuracy=acc_arr,
        loss_barrier=loss_barrier,
        accuracy_barrier=acc_barrier,
        num_samples=samples,
        reset_bn=do_reset,
    )
