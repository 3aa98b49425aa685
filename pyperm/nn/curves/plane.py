r"""Loss and accuracy on the plane through three weight vectors (Garipov et al.; Tatro et al. Figure 3)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pyperm._checks import check_bool, check_choice, check_int, check_nonnegative_real
from pyperm._plotting import agg_figure, save_figure
from pyperm._progress import progress_bar
from pyperm.nn._checks import check_module, check_pair, check_state
from pyperm.nn._runtime import check_batches
from pyperm.nn.curves._points import PointEvaluator
from pyperm.nn.curves.train import check_curve
from pyperm.nn.state import is_mixable

__all__ = ["PlaneResult", "loss_plane"]

logger = logging.getLogger(__name__)


@dataclass
class PlaneResult:
    """Loss and accuracy on a grid of the plane through three networks.

    Attributes
    ----------
    xs, ys : (gx,), (gy,) numpy.ndarray
        Grid coordinates along the orthonormal directions :math:`\\hat u`, :math:`\\hat v`.
    loss, accuracy : (gy, gx) numpy.ndarray
        ``loss[j, i]`` is the loss of the network at ``(xs[i], ys[j])``.
    points : (3, 2) numpy.ndarray
        Coordinates of the three networks: ``(0, 0)``, ``(|u|, 0)`` and the third's.
    labels : tuple of str
        Names of the three networks in the plot.
    curve_points : (m, 2) numpy.ndarray or None
        A curve's path projected onto the plane (when ``curve`` was given).
    """

    xs: np.ndarray
    ys: np.ndarray
    loss: np.ndarray
    accuracy: np.ndarray
    points: np.ndarray
    labels: tuple[str, str, str]
    curve_points: np.ndarray | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (nested lists), ready for ``json.dump``."""
        return {
            "xs": self.xs.tolist(),
            "ys": self.ys.tolist(),
            "loss": self.loss.tolist(),
            "accuracy": self.accuracy.tolist(),
            "points": self.points.tolist(),
            "labels": list(self.labels),
            "curve_points": None if self.curve_points is None else self.curve_points.tolist(),
        }

    def plot(self, path: str | Path, *, metric: str = "loss", levels: int = 20, title: str | None = None) -> Path:
        """Contours of ``metric`` ("loss" or "accuracy") with the three networks marked; a PNG."""
        check_choice(metric, "metric", ("loss", "accuracy"))
        values = self.loss if metric == "loss" else 100 * self.accuracy
        fig = agg_figure(5.5, 4.5)
        ax = fig.subplots()
        filled = ax.contourf(self.xs, self.ys, values, levels=levels, cmap="viridis" if metric == "loss" else "magma")
        ax.contour(self.xs, self.ys, values, levels=levels, colors="k", linewidths=0.3, alpha=0.5)
        fig.colorbar(filled, ax=ax, label=metric if metric == "loss" else "accuracy (%)")
        if self.curve_points is not None:
            ax.plot(self.curve_points[:, 0], self.curve_points[:, 1], color="white", linewidth=1.5, label="curve")
        ax.scatter(self.points[:, 0], self.points[:, 1], color="white", edgecolor="black", zorder=3)
        for (x, y), name in zip(self.points, self.labels):
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), color="white", fontsize=9)
        ax.set_xlabel("$\\hat u$")
        ax.set_ylabel("$\\hat v$")
        ax.set_aspect("equal")
        if title:
            ax.set_title(title)
        fig.tight_layout()
        path = Path(path)
        save_figure(fig, path)
        return path


def _dot(x: Mapping[str, torch.Tensor], y: Mapping[str, torch.Tensor], keys: Sequence[str]) -> float:
    return float(sum(torch.sum(x[k].double() * y[k].double()) for k in keys))


def _diff(x: Mapping[str, torch.Tensor], y: Mapping[str, torch.Tensor], keys: Sequence[str]) -> dict:
    return {k: x[k].detach().to(device=y[k].device, dtype=torch.float64) - y[k].detach().double() for k in keys}


def _combine(states: Sequence[Mapping[str, torch.Tensor]], w: Sequence[float]) -> dict[str, torch.Tensor]:
    """The affine combination sum_i w_i states[i] (floating entries); integers from states[0]."""
    out = {}
    for key, first in states[0].items():
        if not is_mixable(first):
            out[key] = first.detach().clone()
            continue
        acc = first.detach().double() * w[0]
        for wi, s in zip(w[1:], states[1:]):
            acc.add_(s[key].detach().double(), alpha=wi)
        out[key] = acc.to(first.dtype)
    return out


def loss_plane(
    model: nn.Module,
    states: Sequence[Mapping[str, torch.Tensor]],
    data: Iterable[Any],
    *,
    grid: int = 21,
    margin: float = 0.2,
    bn_data: Iterable[Any] | bool | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    labels: Sequence[str] = ("A", "B", "C"),
    curve: Any = None,
    progress: bool = False,
) -> PlaneResult:
    r"""Loss and accuracy on the plane through three networks, in Gram-Schmidt coordinates.

    With :math:`w_1, w_2, w_3` the parameter vectors of ``states``,
    :math:`u = w_2 - w_1` and :math:`v = (w_3 - w_1) - \frac{\langle w_3 - w_1, u\rangle}
    {\|u\|^2} u`, the point :math:`(x, y)` of the plane is the network

    .. math::

        P(x, y) = w_1 + x\,\hat u + y\,\hat v, \qquad \hat u = u / \|u\|,\ \hat v = v / \|v\|,

    an affine combination :math:`(1 - \alpha - \beta) w_1 + \alpha w_2 + \beta w_3`,
    which is also applied to the floating-point buffers (integer buffers come from the
    first state). A ``grid`` x ``grid`` lattice covering the three points plus ``margin``
    times their extent on each side is evaluated like a point of a curve: BatchNorm
    statistics recomputed on ``bn_data``, then loss and accuracy over ``data`` in eval mode.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture; not modified.
    states : sequence of three state dicts
        E.g. A, B and a curve's bend (:meth:`~pyperm.nn.curves.BezierCurve.bend_state`),
        or A, B and the aligned :math:`P B` (Tatro et al. Figure 3).
    data : re-iterable of (inputs, targets, ...)
        Evaluation batches, read once per grid point.
    grid : int, default 21
        Points per axis (at least 2).
    margin : float, default 0.2
        Extra room around the three points, as a fraction of their extent.
    bn_data : re-iterable of batches, or False, optional
        Batches for the BatchNorm statistics of each grid point; required when the
        model has BatchNorm layers (``False``: the combination's running statistics,
        knowingly). See :func:`~pyperm.nn.curves.evaluate_curve`.
    loss_fn : callable, optional
        The batch's mean loss; cross-entropy by default.
    labels : sequence of three str, default ("A", "B", "C")
        Names of the states in the plot.
    curve : BezierCurve or PolyChain, optional
        A curve whose path (projected onto the plane) the plot also draws.
    progress : bool, default False
        Show a progress bar over the grid points.

    Returns
    -------
    PlaneResult
        ``xs``, ``ys``, ``loss``, ``accuracy``, ``points``; ``plot(path)``.

    Raises
    ------
    TypeError
        ``model`` is not a module, ``states`` is not a sequence of three state dicts,
        ``grid``/``margin`` have the wrong type, ``curve`` is not a pyperm curve.
    ValueError
        The states do not pair up, two of them coincide or the three are collinear (no
        plane), ``grid`` < 2, ``margin`` negative, or ``bn_data`` missing for a model
        with BatchNorm.

    References
    ----------
    .. [1] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss
       Surfaces, Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018, footnote
       on the planes of Figure 1.
    .. [2] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing
       Mode Connectivity via Neuron Alignment", NeurIPS 2020, Figures 3 and 7.
    """
    check_module(model, "model")
    if isinstance(states, (Mapping, str, bytes)) or not isinstance(states, Sequence):
        raise TypeError(f"states must be a sequence of three state dicts, got {type(states).__name__}")
    if len(states) != 3:
        raise ValueError(f"states must hold exactly three state dicts, got {len(states)}")
    check_state(states[0], "states[0]")
    for i in (1, 2):
        check_pair(states[0], states[i], ("states[0]", f"states[{i}]"))
    grid = check_int(grid, "grid", 2)
    margin = check_nonnegative_real(margin, "margin")
    progress = check_bool(progress, "progress")
    if isinstance(labels, str) or len(labels) != 3:
        raise ValueError("labels must be three names")
    if curve is not None:
        check_curve(curve)
    evaluator = PointEvaluator(model, {"data": check_batches(data, "data", reiterable=True)}, bn_data, loss_fn)

    # The plane is spanned by the trainable weights, as in Garipov et al.
    keys = [k for k, p in model.named_parameters() if is_mixable(p) and k in states[0]]
    w1 = states[0]
    du = _diff(states[1], w1, keys)
    dw = _diff(states[2], w1, keys)
    norm_u = math.sqrt(_dot(du, du, keys))
    if norm_u == 0:
        raise ValueError("states[0] and states[1] have the same parameters: they span no plane")
    c = _dot(dw, du, keys) / norm_u**2
    norm_v = math.sqrt(max(_dot(dw, dw, keys) - c * c * norm_u**2, 0.0))
    # float32 states on one line still leave a residual of about 1e-7 of their norm.
    if norm_v <= 1e-5 * max(norm_u, math.sqrt(_dot(dw, dw, keys))):
        raise ValueError("the three states are collinear: they span no plane")
    points = np.array([[0.0, 0.0], [norm_u, 0.0], [c * norm_u, norm_v]])

    def coordinates_of(p: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        d = _diff(p, w1, keys)
        x = _dot(d, du, keys) / norm_u
        y = (_dot(d, dw, keys) - c * _dot(d, du, keys)) / norm_v
        return x, y

    lo, hi = points.min(axis=0), points.max(axis=0)
    extent = hi - lo
    xs = np.linspace(lo[0] - margin * extent[0], hi[0] + margin * extent[0], grid)
    ys = np.linspace(lo[1] - margin * extent[1], hi[1] + margin * extent[1], grid)
    loss = np.empty((grid, grid))
    accuracy = np.empty((grid, grid))
    bar = progress_bar(progress, grid * grid, "loss plane", "point")
    try:
        for j, y in enumerate(ys):
            for i, x in enumerate(xs):
                # P = w1 + x u/|u| + y v/|v| with v = (w3 - w1) - c u, as weights on w1, w2, w3.
                alpha = x / norm_u - y * c / norm_v
                beta = y / norm_v
                state = _combine(states, (1.0 - alpha - beta, alpha, beta))
                loss[j, i], accuracy[j, i] = evaluator(state)["data"]
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    curve_points = None
    if curve is not None:
        curve_points = np.array([coordinates_of(curve.state_at(float(t))) for t in np.linspace(0, 1, 41)])
    logger.debug("loss_plane: %dx%d grid, loss in [%.4g, %.4g]", grid, grid, np.nanmin(loss), np.nanmax(loss))
    return PlaneResult(xs=xs, ys=ys, loss=loss, accuracy=accuracy, points=points, labels=tuple(labels),
                       curve_points=curve_points)
