"""The one table writer of pyperm: reports, benchmarks and the command line print through it.

Two renderings of the same rows: :func:`markdown_table` for report files and docs,
:func:`text_table` for a console. Numbers are written by one rule (:func:`format_value`), so a
value reads the same in a benchmark's console table and in the report that records it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

__all__ = ["format_value", "markdown_table", "text_table"]


def format_value(value: object) -> str:
    """A cell: floats with 4 significant digits (scientific notation outside 1e-3..1e5), NaN and None as ``n/a``."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isnan(value):
            return "n/a"
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return str(value)


def _cells(headers: Sequence[object], rows: Sequence[Sequence[object]]) -> list[list[str]]:
    width = len(headers)
    out = []
    for k, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"row {k} has {len(row)} cells, the header {width}")
        out.append([format_value(c) for c in row])
    return out


def markdown_table(headers: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; columns whose cells are all numbers are right-aligned."""
    cells = _cells(headers, rows)
    numeric = [bool(rows) and all(isinstance(r[j], numbers.Real) or r[j] is None for r in rows)
               for j in range(len(headers))]
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join("---:" if num else "---" for num in numeric) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def text_table(headers: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width console table: the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + _cells(headers, rows)
    widths = [max(len(r[k]) for r in cells) for k in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
