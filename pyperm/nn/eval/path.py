r"""Loss and accuracy at points along a path of networks: the one result type, table and plot.

A barrier (the straight line between two models, :func:`~pyperm.nn.barrier`) and a
trained curve (:func:`~pyperm.nn.evaluate_curve`) are both measured at points
:math:`t \in [0, 1]` of a path from model A (:math:`t = 0`) to model B (:math:`t = 1`).
:class:`PathResult` holds what every such path has (``ts``, ``loss``, ``accuracy``,
``num_samples``) and renders it (:meth:`~PathResult.to_dict`, :meth:`~PathResult.to_markdown`,
:meth:`~PathResult.plot`); :class:`BarrierResult` and :class:`CurveResult` add their own
fields. :func:`plot_paths` draws several paths in one PNG and :func:`summary_table` writes
one markdown row per path, whatever their kinds.

A missing value is NaN, never None: ``accuracy`` is NaN at every point when the loss has
no accuracy (regression targets), and so are the summaries computed from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyperm._plotting import agg_figure, save_figure
from pyperm._tables import markdown_table

__all__ = ["BarrierResult", "CurveResult", "PathResult", "chord", "plot_paths", "summary_table"]


def chord(ts: np.ndarray, values: np.ndarray) -> np.ndarray:
    r"""The line between the endpoints' values, :math:`(1 - t)\,v(0) + t\,v(1)`, at every ``t``.

    The barriers of Git Re-Basin's Definition 2.2 are measured against it; ``values[0]``
    and ``values[-1]`` must be the values at :math:`t = 0` and :math:`t = 1`.
    """
    return (1.0 - ts) * values[0] + ts * values[-1]


def _unit(name: str) -> str:
    """How a summary number is written: accuracies in percent, an accuracy barrier (a drop
    between two percentages) in percentage points, anything else as it is."""
    if "accuracy" not in name:
        return ""
    return "pp" if "barrier" in name else "%"


def _float_array(values: Any, name: str, size: int | None) -> np.ndarray:
    """``values`` as a 1-d float64 array of ``size`` entries (None: all NaN)."""
    if values is None:
        if size is None:
            raise TypeError(f"{name} must be a sequence of floats, got None")
        return np.full(size, math.nan)
    out = np.asarray(values, dtype=np.float64)
    if out.ndim != 1 or (size is not None and out.size != size):
        expected = "a 1-d sequence" if size is None else f"{size} values (one per point of ts)"
        raise ValueError(f"{name} must hold {expected}, got shape {out.shape}")
    return out


@dataclass(frozen=True, eq=False)
class PathResult:
    r"""Loss and accuracy at points :math:`t_0 = 0 < \dots < t_{k-1} = 1` of a path of networks.

    The fields are stored as given, converted to float64 arrays; ``accuracy=None`` is
    stored as NaN at every point (a loss without an accuracy).

    Attributes
    ----------
    ts : (k,) ndarray of float64
        The points of the path, increasing from 0 (model A) to 1 (model B).
    loss : (k,) ndarray of float64
        The mean loss over the samples of the evaluation data at each point.
    accuracy : (k,) ndarray of float64
        The fraction of correct predictions (argmax of the outputs' axis 1 equal to the
        target class) at each point, in [0, 1]; NaN when the targets are not class
        indices.
    num_samples : int
        How many data samples were evaluated at each point.

    Notes
    -----
    ``average_accuracy``, ``min_accuracy``, ``average_loss`` and ``max_loss`` are the
    columns of Tatro et al.'s Tables 1-2; over evenly spaced points the mean estimates
    :math:`\int_0^1 \mathrm{acc}(t)\,dt`, as the paper reports it.

    References
    ----------
    .. [1] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing
       Mode Connectivity via Neuron Alignment", NeurIPS 2020, Tables 1-2.

    Examples
    --------
    >>> import numpy as np
    >>> r = PathResult(ts=[0.0, 0.5, 1.0], loss=[0.1, 0.4, 0.2], accuracy=None, num_samples=64)
    >>> r.max_loss, bool(np.isnan(r.min_accuracy))
    (0.4, True)
    """

    ts: np.ndarray
    loss: np.ndarray
    accuracy: np.ndarray
    num_samples: int

    def __post_init__(self) -> None:
        ts = _float_array(self.ts, "ts", None)
        # Frozen: the canonical arrays are written past the dataclass's __setattr__ guard.
        object.__setattr__(self, "ts", ts)
        object.__setattr__(self, "loss", _float_array(self.loss, "loss", ts.size))
        object.__setattr__(self, "accuracy", _float_array(self.accuracy, "accuracy", ts.size))

    # ------------------------------------------------------------------ summaries

    @property
    def has_accuracy(self) -> bool:
        """Whether any point has an accuracy (False for a loss without one)."""
        return bool(np.any(np.isfinite(self.accuracy)))

    @property
    def average_accuracy(self) -> float:
        """Mean accuracy over the points (NaN without an accuracy)."""
        return float(np.mean(self.accuracy))

    @property
    def min_accuracy(self) -> float:
        """Accuracy of the worst network on the path (NaN without an accuracy)."""
        return float(np.min(self.accuracy))

    @property
    def average_loss(self) -> float:
        """Mean loss over the points."""
        return float(np.mean(self.loss))

    @property
    def max_loss(self) -> float:
        """Loss of the worst network on the path."""
        return float(np.max(self.loss))

    def summary(self) -> dict[str, float]:
        """The path's summary numbers by name (accuracies as fractions): one row of :func:`summary_table`."""
        return {
            "average accuracy": self.average_accuracy,
            "min accuracy": self.min_accuracy,
            "average loss": self.average_loss,
            "max loss": self.max_loss,
        }

    # ------------------------------------------------------------------ rendering

    def _columns(self) -> dict[str, np.ndarray]:
        """The per-point columns of :meth:`to_markdown`, accuracies in percent."""
        columns = {"t": self.ts, "loss": self.loss}
        if self.has_accuracy:
            columns["accuracy (%)"] = 100.0 * self.accuracy
        return columns

    def _default_title(self) -> str | None:
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (lists, floats, ints, bools), ready for ``json.dump``.

        Missing values are ``float("nan")``, which :func:`json.dump` writes as ``NaN``
        (and :func:`json.load` reads back).
        """
        out: dict[str, Any] = {
            "ts": self.ts.tolist(),
            "loss": self.loss.tolist(),
            "accuracy": self.accuracy.tolist(),
            "num_samples": int(self.num_samples),
        }
        out.update({name.replace(" ", "_"): value for name, value in self.summary().items()})
        return out

    def to_markdown(self) -> str:
        """A markdown table of the points (accuracies in percent), then the summary, one line each."""
        columns = self._columns()
        rows = [[float(values[k]) for values in columns.values()] for k in range(self.ts.size)]
        lines = [markdown_table(list(columns), rows), ""]
        for name, value in self.summary().items():
            unit = _unit(name)
            if math.isnan(value):
                continue
            if unit:
                lines.append(f"{name}: {100.0 * value:.2f}{'%' if unit == '%' else ' ' + unit}")
            else:
                lines.append(f"{name}: {value:.4f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Write a PNG of the loss and accuracy along this path; see :func:`plot_paths`.

        Parameters
        ----------
        path : str or pathlib.Path
            Where to write the image; parent folders must exist.
        title : str, optional
            The figure's title; by default the result's own summary (the barriers of a
            :class:`BarrierResult`), or none.

        Returns
        -------
        pathlib.Path
            ``path``.
        """
        return plot_paths({"path": self}, path, title=self._default_title() if title is None else title)


@dataclass(frozen=True, eq=False)
class BarrierResult(PathResult):
    r"""Loss and accuracy along the linear path :math:`(1 - t)\,\Theta_A + t\,\Theta_B`, and its barriers.

    Attributes
    ----------
    ts, loss, accuracy, num_samples
        As in :class:`PathResult`.
    loss_barrier : float
        :math:`\max_k\, L(t_k) - \big((1 - t_k) L(0) + t_k L(1)\big)` (Definition 2.2
        of Git Re-Basin over the evaluated points; 0 when the path lies on or below
        the chord).
    accuracy_barrier : float
        :math:`\max_k\, \big((1 - t_k) \mathrm{acc}(0) + t_k \mathrm{acc}(1)\big) - \mathrm{acc}(t_k)`,
        the largest drop of accuracy below the chord, as a fraction; NaN without an
        accuracy.
    bn_reset : bool, default False
        Whether the BatchNorm statistics were recomputed at every point.

    References
    ----------
    .. [1] S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
       Permutation Symmetries", ICLR 2023, Definition 2.2.
    """

    loss_barrier: float
    accuracy_barrier: float
    bn_reset: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "loss_barrier", float(self.loss_barrier))
        object.__setattr__(self, "accuracy_barrier", float(self.accuracy_barrier))

    @property
    def loss_barrier_t(self) -> float:
        """The point of the path where the loss rises highest above the chord."""
        return float(self.ts[int(np.argmax(self.loss - chord(self.ts, self.loss)))])

    def summary(self) -> dict[str, float]:
        """:meth:`PathResult.summary` plus ``loss barrier`` and ``accuracy barrier``."""
        return {**super().summary(), "loss barrier": self.loss_barrier, "accuracy barrier": self.accuracy_barrier}

    def to_dict(self) -> dict[str, Any]:
        """As :meth:`PathResult.to_dict`, plus ``loss_barrier_t`` and ``bn_reset``."""
        return {**super().to_dict(), "loss_barrier_t": self.loss_barrier_t, "bn_reset": bool(self.bn_reset)}

    def _default_title(self) -> str:
        title = f"loss barrier {self.loss_barrier:.4g}"
        if not math.isnan(self.accuracy_barrier):
            title += f", accuracy barrier {100.0 * self.accuracy_barrier:.2f} pp"
        return title


@dataclass(frozen=True, eq=False)
class CurveResult(PathResult):
    r"""Loss and accuracy of the networks :math:`r_\phi(t)` at evenly spaced points of a curve.

    Attributes
    ----------
    ts, loss, accuracy, num_samples
        As in :class:`PathResult`.
    robust_accuracy : (k,) ndarray of float64
        Accuracy on PGD adversarial examples at each point (``evaluate_curve(...,
        adversarial=...)``, Tatro et al. Figure 4); NaN at every point when not
        measured (the default).

    References
    ----------
    .. [1] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing
       Mode Connectivity via Neuron Alignment", NeurIPS 2020, Tables 1-2 and Figure 4.
    """

    robust_accuracy: np.ndarray | None = field(default=None)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(
            self, "robust_accuracy", _float_array(self.robust_accuracy, "robust_accuracy", self.ts.size)
        )

    @property
    def has_robust_accuracy(self) -> bool:
        """Whether the robust accuracy was measured."""
        return bool(np.any(np.isfinite(self.robust_accuracy)))

    def summary(self) -> dict[str, float]:
        """:meth:`PathResult.summary` plus the average and minimum robust accuracy (NaN when not measured)."""
        robust = self.robust_accuracy
        return {**super().summary(), "average robust accuracy": float(np.mean(robust)),
                "min robust accuracy": float(np.min(robust))}

    def to_dict(self) -> dict[str, Any]:
        """As :meth:`PathResult.to_dict`, plus ``robust_accuracy`` (a list, NaN when not measured)."""
        return {**super().to_dict(), "robust_accuracy": self.robust_accuracy.tolist()}

    def _columns(self) -> dict[str, np.ndarray]:
        columns = super()._columns()
        if self.has_robust_accuracy:
            columns["robust accuracy (%)"] = 100.0 * self.robust_accuracy
        return columns


def _check_results(results: Any) -> Mapping[str, PathResult]:
    if not isinstance(results, Mapping):
        raise TypeError(f"results must be a mapping of labels to PathResult, got {type(results).__name__}")
    if not results:
        raise ValueError("results must hold at least one PathResult, got an empty mapping")
    for label, r in results.items():
        if not isinstance(r, PathResult):
            raise TypeError(f"results[{label!r}] must be a PathResult (a BarrierResult, a CurveResult), "
                            f"got {type(r).__name__}")
    return results


def plot_paths(
    results: Mapping[str, PathResult],
    path: str | Path,
    *,
    title: str | None = None,
    dashed: Iterable[str] = (),
) -> Path:
    """Write a PNG of the loss (left) and accuracy (right) along several paths.

    Each path is one colour, with markers at its points. A :class:`BarrierResult` also
    gets its chord (the line between its endpoints' values, which its barriers are
    measured against) as a thin dotted line; a :class:`CurveResult` with a robust
    accuracy gets it as a dotted line with crosses in the accuracy panel (Tatro et al.
    Figure 4). The accuracy panel is left out when no path has an accuracy.
    matplotlib is imported here, not with pyperm, and drawn through its Agg canvas
    (:func:`pyperm._plotting.agg_figure`, no pyplot), so the caller's backend and open
    figures are left alone.

    Parameters
    ----------
    results : mapping of str to PathResult
        The paths, by legend label (e.g. ``{"naive": r0, "weight matching": r1}``).
    path : str or pathlib.Path
        Where to write the image; parent folders must exist.
    title : str, optional
        The figure's title.
    dashed : iterable of str, optional
        Labels of ``results`` drawn with dashed lines (e.g. the straight lines before
        curve training).

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    TypeError
        ``results`` is not a mapping of labels to PathResult, ``path`` is not a str or
        Path, ``title`` is not a str, or ``dashed`` is not an iterable of labels.
    ValueError
        ``results`` is empty, or ``dashed`` names a label that is not in ``results``.
    ImportError
        matplotlib is not installed.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import barrier, plot_paths
    >>> model = torch.nn.Linear(4, 3)
    >>> data = [(torch.randn(16, 4), torch.randint(0, 3, (16,)))]
    >>> a, b = model.state_dict(), {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    >>> same, other = barrier(model, a, a, data, num_points=3), barrier(model, a, b, data, num_points=3)
    >>> plot_paths({"A to A": same, "A to B": other}, "paths.png")  # doctest: +SKIP
    PosixPath('paths.png')
    """
    results = _check_results(results)
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or pathlib.Path, got {type(path).__name__}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a str or None, got {type(title).__name__}")
    if isinstance(dashed, str) or not isinstance(dashed, Iterable):
        raise TypeError(f"dashed must be an iterable of labels, got {type(dashed).__name__}")
    dashed = set(dashed)
    unknown = sorted(map(str, dashed - set(results)))
    if unknown:
        raise ValueError(f"dashed names labels that are not in results: {unknown}")

    panels = [("loss", lambda r: r.loss)]
    if any(r.has_accuracy for r in results.values()):
        panels.append(("accuracy (%)", lambda r: 100.0 * r.accuracy))
    fig = agg_figure(4.6 * len(panels), 3.6, layout="constrained")
    for k, (ylabel, values_of) in enumerate(panels):
        accuracy_panel = k == 1
        ax = fig.add_subplot(1, len(panels), k + 1)
        for i, (label, r) in enumerate(results.items()):
            values = values_of(r)
            color = f"C{i % 10}"
            linestyle = "--" if label in dashed else "-"
            ax.plot(r.ts, values, marker="o", markersize=3, color=color, linestyle=linestyle, label=str(label))
            if isinstance(r, BarrierResult):
                ax.plot(r.ts, chord(r.ts, values), linestyle=":", linewidth=1, color=color, alpha=0.7)
            if accuracy_panel and isinstance(r, CurveResult) and r.has_robust_accuracy:
                ax.plot(r.ts, 100.0 * r.robust_accuracy, marker="x", markersize=4, linestyle=":", color=color,
                        label=f"{label} (robust)")
        ax.set_xlabel("t (0: model A, 1: model B)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    if title:
        fig.suptitle(title)
    path = Path(path)
    save_figure(fig, path)
    return path


def summary_table(results: Mapping[str, PathResult]) -> str:
    """A markdown table with one row per path: its summary numbers (Tatro et al.'s Tables 1-2 columns).

    The columns are the union of the rows' :meth:`PathResult.summary` names, in order of
    appearance (so barriers add their barrier columns), less those that no path has (all
    NaN, e.g. a robust accuracy nobody measured); accuracies are in percent, and a value
    one path lacks is written ``n/a``.

    Parameters
    ----------
    results : mapping of str to PathResult
        The paths, by row label.

    Returns
    -------
    str
        The table (through :func:`pyperm._tables.markdown_table`).

    Raises
    ------
    TypeError, ValueError
        ``results`` is not a non-empty mapping of labels to PathResult.

    Examples
    --------
    >>> r = CurveResult(ts=[0.0, 0.5, 1.0], loss=[0.1, 0.5, 0.2], accuracy=[0.9, 0.7, 0.8], num_samples=10)
    >>> print(summary_table({"curve": r}))
    | path | average accuracy (%) | min accuracy (%) | average loss | max loss |
    |---|---:|---:|---:|---:|
    | curve | 80 | 70 | 0.2667 | 0.5 |
    """
    results = _check_results(results)
    summaries = {label: r.summary() for label, r in results.items()}
    names: list[str] = []
    for summary in summaries.values():
        names += [name for name, value in summary.items() if name not in names and not math.isnan(value)]

    headers = ["path"] + [f"{name} ({_unit(name)})" if _unit(name) else name for name in names]
    scales = [100.0 if _unit(name) else 1.0 for name in names]
    rows = [[str(label)] + [scale * s.get(name, math.nan) for name, scale in zip(names, scales)]
            for label, s in summaries.items()]
    return markdown_table(headers, rows)
