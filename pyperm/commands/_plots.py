"""PNG figures of the command line and the reproductions (matplotlib's Agg canvas; pyplot untouched)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pyperm._plotting import agg_figure

__all__ = ["plot_lines", "plot_paths"]


def _figure(panels: int, width: float = 4.6, height: float = 3.6) -> Any:
    return agg_figure(width * panels, height, layout="constrained")


def plot_paths(path: Path, results: Mapping[str, Any], title: str) -> Path:
    """Loss and accuracy along several interpolation paths (``BarrierResult`` by label) in one PNG."""
    with_acc = all(r.accuracy is not None for r in results.values())
    fig = _figure(2 if with_acc else 1)
    panels = [("loss", "loss", 1.0)] + ([("accuracy", "accuracy (%)", 100.0)] if with_acc else [])
    for k, (attr, ylabel, scale) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for label, result in results.items():
            ax.plot(result.ts, scale * getattr(result, attr), marker="o", markersize=3, label=label)
        ax.set_xlabel("t (0 = model A, 1 = model B)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, format="png", dpi=120)
    return path


def plot_lines(
    path: Path,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    panels: Sequence[tuple[str, Mapping[str, Sequence[float]]]] | None = None,
) -> Path:
    """Lines of ``series`` against ``x`` (or several panels of ``(ylabel, series)``) in one PNG."""
    panels = list(panels) if panels is not None else [(ylabel, series)]
    fig = _figure(len(panels))
    for k, (label_y, lines) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for label, ys in lines.items():
            ax.plot(list(x), list(ys), marker="o", markersize=3, label=label)
        if logx:
            ax.set_xscale("log")
        elif all(float(v).is_integer() for v in x):
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers and widths: no 1.25
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label_y)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, format="png", dpi=120)
    return path
