"""Statistics shared by the sweep results (their tables go through :func:`pyperm._tables.markdown_table`)."""

from __future__ import annotations

import math

import numpy as np


def mean_and_sem(values: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n)); NaN-free input."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return math.nan, math.nan
    sem = float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else math.nan
    return float(values.mean()), sem
