"""Laptop-scale reproductions of the papers' findings: ``pyperm reproduce NAME``.

Each report is one module here with

- ``TITLE``: one line saying what it reproduces;
- ``OUTPUTS``: the file names it writes into the output folder (checked before any work, so
  nothing is overwritten without ``--force``);
- ``run(out, scale, *, device, seed, progress) -> pathlib.Path``: writes ``report.md`` (tables,
  PNG plots, each paper's finding beside ours and whether ours agrees) and ``report.json``,
  and returns the markdown's path. ``scale`` is ``"smoke"`` (under a minute, for the test
  suite), ``"quick"`` (under 10 minutes on a 2-core laptop), ``"full"`` (fuller laptop
  settings) or ``"paper"`` (the paper's architectures, recipes, epochs and batch sizes,
  each written in the report beside the paper's line that states it);
- optionally ``DATASETS`` (the names ``--data`` may give; ``run`` then takes ``data=``, e.g.
  ``"mnist:DIR"``) and ``estimate_seconds(scale, data, device)`` (the expected wall time on
  this machine, which the command says before it starts).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["REPORTS", "SCALES", "load_report"]

REPORTS = {
    "rebasin": "pyperm.reproduce.rebasin",
    "teacher-student": "pyperm.reproduce.teacher_student",
    "curves": "pyperm.reproduce.curves",
    "robust": "pyperm.reproduce.robust",
    "transformers": "pyperm.reproduce.transformers",
    "zipit": "pyperm.reproduce.zipit",
}
SCALES = ("smoke", "quick", "full", "paper")


def load_report(name: str) -> ModuleType:
    """The module of report ``name``.

    Raises
    ------
    ValueError
        ``name`` is not a known report.
    """
    if name not in REPORTS:
        raise ValueError(f"unknown report {name!r}; expected one of {', '.join(REPORTS)}")
    return importlib.import_module(REPORTS[name])
