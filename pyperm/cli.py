"""The ``pyperm`` command line: ``pyperm bench NAME``, ``align``, ``barrier``, ``curve``, ``merge``, ``reproduce``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each benchmark lives in its own module of pyperm.benchmarks with
# add_arguments(parser) and run(args) -> int; listed here by sub-command name.
BENCHMARKS = {
    "lap": ("pyperm.benchmarks.lap", "assignment solvers: pyperm vs scipy vs lap/lapx/lapjv"),
    "bvn": ("pyperm.benchmarks.bvn", "Birkhoff-von Neumann decomposition: pyperm vs a scipy-based greedy"),
    "xcorr": ("pyperm.benchmarks.xcorr", "CrossCorrelation.update vs the bare BLAS product xa.T @ xb"),
    "match": ("pyperm.benchmarks.match", "weight matching (Git Re-Basin Algorithm 1): pyperm vs a reference"),
    "ste": ("pyperm.benchmarks.ste", "STE matching (Git Re-Basin Algorithm 2): a step vs its floor and vs re-matching"),
    "sinkhorn": ("pyperm.benchmarks.sinkhorn", "two models: weight matching, STE and Sinkhorn re-basin (both losses), "
                 "test barriers and times"),
    "merge": ("pyperm.benchmarks.merge", "many models: MergeMany, C2M3 (and the authors' Frank-Wolfe), with and without "
              "REPAIR: merged test loss, pair barriers, cycle error, objective, time"),
    "curves": ("pyperm.benchmarks.curves", "a curve training step vs a plain training step of the same model and batch"),
    "teacher-student": (
        "pyperm.benchmarks.teacher_student",
        "the teacher-student model of Zhan, Li and Wu (2025): the K=5 width sweep, batched loss and GD",
    ),
    "pam": ("pyperm.benchmarks.pam", "one PAM outer iteration split into curve, projection, BvN and assignment time"),
    "trace": ("pyperm.benchmarks.trace", "tracing torchvision/timm models: permutable units, causes, time vs targets"),
    "zipit": ("pyperm.benchmarks.zipit", "a ZipIt! zip of two ResNet-20s: whole time, its matching's share, and the "
              "authors' matching on the same correlations"),
}

# The checkpoint and reproduction jobs, one module each in pyperm.commands with
# HELP, add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "align": "pyperm.commands.align",
    "barrier": "pyperm.commands.barrier",
    "curve": "pyperm.commands.curve",
    "merge": "pyperm.commands.merge",
    "reproduce": "pyperm.commands.reproduce",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyperm", description="Fast tools for neural-network permutation symmetry.")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time pyperm against scipy and the other installed solvers")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    for name, module in COMMANDS.items():
        command = importlib.import_module(module)
        p = sub.add_parser(name, help=command.HELP, description=command.HELP)
        p.set_defaults(_module=module)
        command.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
