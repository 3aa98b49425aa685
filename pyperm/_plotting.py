"""Figures for the PNG plots of results: matplotlib's Agg canvas, imported only when a plot is asked for.

No pyplot: the caller's backend and pyplot's figure registry are left alone, so plotting
from a library call never opens a window or switches a notebook's backend. matplotlib is
optional; without it, only the plots fail, with an ImportError that says how to get it.
"""

from __future__ import annotations

from typing import Any


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
