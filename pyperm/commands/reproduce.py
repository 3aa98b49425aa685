"""``pyperm reproduce NAME``: a laptop-scale reproduction of a paper's findings, as a markdown report with plots."""

from __future__ import annotations

import argparse

from pyperm._argtypes import int_at_least
from pyperm.commands._common import cli_errors
from pyperm.reproduce import REPORTS, SCALES

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
    # Without a scale: the default settings, as close to the papers' as a laptop allows
    # (each report's Settings section says where they are scaled down); tens of minutes.
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument(
        "--scale",
        choices=SCALES,
        help="smoke, quick, full (the default) or paper: the papers' architectures, recipes, epochs and batch "
        "sizes (the command says the expected time first)",
    )
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
    parser.add_argument(
        "--data",
        default="digits",
        metavar="NAME",
        help="rebasin, zipit, curves, robust: digits (default, scikit-learn's), mnist:DIR (the idx files), "
        "cifar10:DIR or cifar100:DIR (the python pickles); nothing is downloaded",
    )
    parser.add_argument(
        "--split-fractions",
        type=_fractions,
        default=None,
        metavar="F1,F2",
        help="rebasin: model A's shares of the examples of the first and of the second half of the labels in the "
        "split-data experiment (sec. 5.4); B holds the rest (default: the paper's 0.2,0.8)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for report.md, report.json and the PNGs")
    parser.add_argument("--force", action="store_true", help="overwrite existing output files")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of every random choice (default 0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _fractions(text: str) -> tuple[float, float]:
    """Two comma-separated shares in [0, 1] (``0.2,0.8``)."""
    from pyperm._checks import check_fraction

    try:
        shares = tuple(check_fraction(float(v), "value") for v in text.split(","))
    except (TypeError, ValueError):
        shares = ()
    if len(shares) != 2:
        raise argparse.ArgumentTypeError(f"expected two shares in [0, 1] such as 0.2,0.8, got {text!r}")
    return shares  # type: ignore[return-value]


@cli_errors("reproduce")
def run(args: argparse.Namespace) -> int:
    """Run the report and print where it is."""
    from pyperm.commands._common import Timer, prepare_out, resolve_device
    from pyperm.reproduce import load_report

    report = load_report(args.name)
    device = resolve_device(args.device)
    if args.scale not in report.SETTINGS:
        raise ValueError(f"--scale {args.scale}: the {args.name} report has no such scale (it has "
                         f"{', '.join(report.SETTINGS)})")  # fmt: skip
    options = _data_option(args, report)
    if args.split_fractions is not None:
        import inspect

        if "split_fractions" not in inspect.signature(report.run).parameters:
            raise ValueError(f"--split-fractions: the {args.name} report has no split-data experiment (rebasin has)")
        options["split_fractions"] = args.split_fractions
    out = prepare_out(args.out, list(report.OUTPUTS), args.force)
    _say_expected_time(args, report, device)
    with Timer() as timer:
        path = report.run(out, args.scale, device=device, seed=args.seed, progress=args.progress, **options)
    print(f"{args.name} ({args.scale}) done in {timer.seconds:.1f} s: {path}")
    return 0


def _data_option(args: argparse.Namespace, report: object) -> dict:
    """``{"data": ...}`` for a report that takes ``--data``; refuses ``--data`` for one that does not."""
    from pyperm.reproduce._data import check_data

    accepted = getattr(report, "DATASETS", None)
    if accepted is None:
        if args.data != "digits":
            raise ValueError(f"--data: the {args.name} report takes no data option (rebasin, curves and robust do)")
        return {}
    check_data(args.data, accepted)
    return {"data": args.data}


def _say_expected_time(args: argparse.Namespace, report: object, device: object) -> None:
    """Before a long run, the expected time on this machine, and whether it is reasonable."""
    import sys

    from pyperm.reproduce._estimate import REASONABLE_SECONDS, describe_seconds

    estimate = getattr(report, "estimate_seconds", None)
    if estimate is None or args.scale in ("smoke", "quick"):
        return
    seconds = estimate(args.scale, args.data, device)
    print(f"{args.name} ({args.scale}, {args.data}): expected time on this machine ({device}): "
          f"{describe_seconds(seconds)}", file=sys.stderr, flush=True)  # fmt: skip
    if seconds > REASONABLE_SECONDS:
        print(f"this machine cannot run {args.name} at --scale {args.scale} in reasonable time "
              f"({describe_seconds(seconds)}); run it on a GPU (--device cuda) or pass --scale quick",
              file=sys.stderr, flush=True)  # fmt: skip
