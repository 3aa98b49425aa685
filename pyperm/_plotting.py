"""Figures for the PNG plots of results: matplotlib's Agg canvas, imported only when a plot is asked for.

No pyplot: the caller's backend and pyplot's figure registry are left alone, so plotting
from a library call never opens a window or switches a notebook's backend. matplotlib is
optional; without it, only the plots fail, with an ImportError that says how to get it.
Every figure is written through :func:`save_figure`: staged beside its destination and renamed
into place (:mod:`pyperm._staging`), so a plot is never half written nor written through a symlink.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["agg_figure", "plot_lines", "save_figure"]


def agg_figure(width: float, height: float, *, layout: str | None = None) -> Any:
    """A ``matplotlib.figure.Figure`` of ``width`` x ``height`` inches with an Agg canvas attached."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from exc
    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, path: str | Path, *, dpi: int = 120) -> Path:
    """Write ``fig`` at ``path`` (the format from its suffix, PNG without one) through a staged file."""
    from pyperm._staging import write_file

    path = Path(path)
    fmt = path.suffix.lstrip(".").lower() or "png"
    return write_file(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi))


def plot_lines(
    path: str | Path,
    x: Sequence[float],
    panels: Sequence[tuple[str, Mapping[str, Sequence[float]]]],
    *,
    xlabel: str,
    title: str,
    logx: bool = False,
) -> Path:
    """Side-by-side panels of lines against ``x`` in one PNG; returns ``path``.

    Parameters
    ----------
    path : str or pathlib.Path
        The PNG file.
    x : sequence of float
        The shared x values.
    panels : sequence of (str, mapping of str to sequence of float)
        One panel per entry: its y-axis label and its lines by legend label.
    xlabel, title : str
        The x-axis label of every panel and the figure's title.
    logx : bool, default False
        A logarithmic x axis (widths, learning rates). Otherwise integer x values get
        integer ticks (layers, widths: no 1.25).
    """
    fig = agg_figure(4.6 * len(panels), 3.6, layout="constrained")
    for k, (ylabel, lines) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        for label, ys in lines.items():
            ax.plot(list(x), list(ys), marker="o", markersize=3, label=label)
        if logx:
            ax.set_xscale("log")
        elif all(float(v).is_integer() for v in x):
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(title)
    return save_figure(fig, path)
