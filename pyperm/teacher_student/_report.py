"""Tables (markdown) and statistics shared by the sweep results."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def mean_and_sem(values: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n)); NaN-free input."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return math.nan, math.nan
    sem = float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else math.nan
    return float(values.mean()), sem


def fmt(value: object) -> str:
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if value == 0 or 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table, numbers right-aligned."""
    cells = [[fmt(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


