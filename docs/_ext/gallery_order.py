"""The order of the gallery's examples: from the solvers up to the analyses built on them."""

from __future__ import annotations

import os

ORDER = [
    "plot_solvers.py",
    "plot_pipelines.py",
    "plot_weight_matching.py",
    "plot_activation_repair.py",
    "plot_zipit.py",
    "plot_curve.py",
    "plot_teacher_student.py",
]


class ExampleOrder:
    """sphinx-gallery's ``within_subsection_order``: the examples of ORDER first, in that order, then the rest by name."""

    def __init__(self, src_dir: str) -> None:
        self.src_dir = src_dir

    def __call__(self, filename: str) -> tuple[int, str]:
        name = os.path.basename(filename)
        return (ORDER.index(name) if name in ORDER else len(ORDER), name)
