"""``pyperm reproduce NAME``: a laptop-scale reproduction of a paper's findings, as a markdown report with plots."""

from __future__ import annotations

import argparse

from pyperm._argtypes import int_at_least
from pyperm.commands._common import cli_errors
from pyperm.reproduce import REPORTS

HELP = "reproduce a paper's findings at laptop scale: " + ", ".join(REPORTS)

__all__ = ["HELP", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pyperm reproduce``."""
    parser.epilog = (
        "rebasin: Git Re-Basin Fig. 2 and 4 with MLPs on digits; curves: Tatro et al. Tables 1-2 and Fig. 1; "
        "teacher-student: Zhan, Li and Wu (2025)'s barrier vs width and PQ index; robust: Tatro et al. Fig. 4; "
        "transformers: barriers of character-level GPT-2s and ViTs, naive and aligned (needs transformers). "
        "example: pyperm reproduce rebasin --quick --out rebasin/"
    )
    parser.add_argument("name", choices=list(REPORTS), metavar="NAME", help="the report: " + ", ".join(REPORTS))
    # Without either flag: the default settings, as close to the papers' as a laptop allows
    # (each report's Settings section says where they are scaled down); tens of minutes.
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument(
        "--quick",
        dest="scale",
        action="store_const",
        const="quick",
        help="within 10 minutes on a 2-core laptop (default: the fuller settings, tens of minutes)",
    )
    scale.add_argument(
        "--smoke", dest="scale", action="store_const", const="smoke", help="a tiny setting, under a minute (for tests)"
    )
    parser.set_defaults(scale="full")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for report.md, report.json and the PNGs")
    parser.add_argument("--force", action="store_true", help="overwrite existing output files")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of every random choice (default 0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


@cli_errors("reproduce")
def run(args: argparse.Namespace) -> int:
    """Run the report and print where it is."""
    from pyperm.commands._common import Timer, prepare_out, resolve_device
    from pyperm.reproduce import load_report

    report = load_report(args.name)
    device = resolve_device(args.device)
    out = prepare_out(args.out, list(report.OUTPUTS), args.force)
    with Timer() as timer:
        path = report.run(out, args.scale, device=device, seed=args.seed, progress=args.progress)
    print(f"{args.name} ({args.scale}) done in {timer.seconds:.1f} s: {path}")
    return 0
