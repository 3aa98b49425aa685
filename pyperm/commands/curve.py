"""``pyperm curve train A B`` and ``pyperm curve eval A B CURVE``: mode-connecting curves between two checkpoints.

``train`` learns a Bezier curve (or polygonal chain) from checkpoint A to checkpoint B, by
default with the papers' recipe (Garipov et al.'s regulariser on the point of the curve and
their learning-rate schedule; ``--recipe none`` for plain SGD), and evaluates it. ``eval``
evaluates a curve file written by ``train`` (or by :func:`pyperm.nn.curves.save_curve`)
between the same two checkpoints.

Outputs in ``--out``: ``curve.safetensors`` (``train`` only: the bends, the curve's kind
and the endpoints' fingerprints), ``report.json``, ``report.md`` and ``curve.png`` (loss and
accuracy along the curve on the training and test splits, BatchNorm statistics recomputed
at every point from one pass over the training split). For Tatro et al.'s aligned curves,
permute B first with ``pyperm align A B`` and give its output as B.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pyperm._argtypes import int_at_least, nonnegative_float, positive_float, positive_int
from pyperm._json import write_json
from pyperm._staging import write_text
from pyperm._tables import markdown_table
from pyperm.commands._common import (
    Timer,
    add_common_arguments,
    add_data_arguments,
    add_model_arguments,
    cli_errors,
)

HELP = "train a mode-connecting curve between two checkpoints (the papers' recipe), or evaluate one"

__all__ = ["HELP", "add_arguments", "run"]

CURVE_FILE = "curve.safetensors"
OUTPUTS = ("report.json", "report.md", "curve.png")


def _add_endpoints(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="the checkpoint at t = 0")
    parser.add_argument("b", metavar="B", help="the checkpoint at t = 1 (for an aligned curve: the output of pyperm align)")


def _add_evaluation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-points", type=int_at_least(2), default=21,
                        help="evenly spaced points along the curve where it is evaluated (default 21)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sub-commands ``train`` and ``eval`` and their options."""
    sub = parser.add_subparsers(dest="curve_command", required=True, metavar="{train,eval}")
    train = sub.add_parser("train", help="train a curve from A to B and evaluate it",
                           description="Train a curve from checkpoint A to checkpoint B (Garipov et al. 2018; "
                           "Tatro et al. 2020, Algorithm 2) and evaluate it.")
    train.epilog = ("example: pyperm curve train a.pt b_aligned.pt --model tinyten:1,in_channels=1 --data digits "
                    "--epochs 20 --out curve/")
    _add_endpoints(train)
    add_model_arguments(train)
    add_data_arguments(train, required=True)
    train.add_argument("--curve", choices=("bezier", "polychain"), default="bezier", help="the curve family (default bezier)")
    train.add_argument("--num-bends", type=positive_int, default=1, help="trainable bends (default 1: a quadratic Bezier)")
    train.add_argument("--epochs", type=int_at_least(0), required=True, help="passes over the training split")
    train.add_argument("--lr", type=positive_float, default=0.01, help="base learning rate of SGD (default 0.01)")
    train.add_argument("--momentum", type=nonnegative_float, default=0.9, help="SGD momentum (default 0.9)")
    train.add_argument("--recipe", choices=("garipov", "none"), default="garipov",
                       help="garipov (default): the papers' recipe, Garipov et al.'s regulariser 0.5 * wd * "
                       "||theta(t)||^2 on the point of the curve (wd 5e-4) and their schedule (lr for half the epochs, "
                       "then down to 1%% at 90%%); none: plain SGD at a constant lr")
    train.add_argument("--point-decay", type=nonnegative_float, default=None, metavar="WD",
                       help="wd of the regulariser 0.5 * wd * ||theta(t)||^2 (default: the recipe's, 5e-4 or 0)")
    train.add_argument("--bend-decay", type=nonnegative_float, default=0.0, metavar="WD",
                       help="weight decay of the bends through the optimizer (default 0)")
    train.add_argument("--lr-schedule", choices=("constant", "garipov"), default=None,
                       help="learning-rate schedule (default: the recipe's)")
    train.add_argument("--linear", action="store_true", help="also evaluate the straight line from A to B")
    _add_evaluation(train)
    add_common_arguments(train)

    evaluate = sub.add_parser("eval", help="evaluate a curve file between A and B",
                              description="Evaluate a curve written by 'pyperm curve train' between its two "
                              "checkpoints (refused if they are not the ones it was trained between).")
    evaluate.epilog = "example: pyperm curve eval a.pt b_aligned.pt curve/curve.safetensors --model ... --data digits --out eval/"
    _add_endpoints(evaluate)
    evaluate.add_argument("curve", metavar="CURVE", help="the curve file (curve.safetensors)")
    add_model_arguments(evaluate)
    add_data_arguments(evaluate, required=True)
    _add_evaluation(evaluate)
    add_common_arguments(evaluate)


@cli_errors("curve")
def run(args: argparse.Namespace) -> int:
    """Train or evaluate, write the curve (train), the reports and the plot; print where they are."""
    from pyperm.commands._checkpoint_pair import load_for_model, refuse_inputs
    from pyperm.commands._common import build_model, check_inputs, float_state, load_data, prepare_out, resolve_device
    from pyperm.nn import plot_paths

    device = resolve_device(args.device)
    loaded = build_model(args.model, args.example_input_shape, args.a)
    ckpt_a, ckpt_b = load_for_model([args.a, args.b], loaded)
    out = Path(args.out)
    names = ([CURVE_FILE] if args.curve_command == "train" else []) + list(OUTPUTS)
    refuse_inputs([out / n for n in names], [ckpt_a, ckpt_b])
    prepare_out(out, names, args.force)
    data = load_data(args, device)
    check_inputs(loaded, data, device)
    state_a, state_b = float_state(ckpt_a.state, device), float_state(ckpt_b.state, device)
    model = loaded.module.to(device)
    report: dict[str, Any] = {
        "command": f"curve {args.curve_command}",
        "a": str(ckpt_a.path),
        "b": str(ckpt_b.path),
        "model": loaded.name,
        "data": {"name": data.name, "train_samples": data.num_train, "test_samples": data.num_test},
    }
    if args.curve_command == "train":
        curve, linear = _train(args, model, state_a, state_b, data, out, report)
    else:
        curve, linear = _load(args, model, state_a, state_b, report), None
    results = _evaluate(curve, data, args.num_points, args.progress)
    report["results"] = {split: r.to_dict() for split, r in results.items()}
    paths = dict(results)
    if linear is not None:
        report["linear"] = {split: r.to_dict() for split, r in linear.items()}
        paths.update({f"{split} (straight line)": r for split, r in linear.items()})
    plot_paths(paths, out / "curve.png", dashed=[label for label in paths if "straight line" in label],
               title=f"{loaded.name}: {report['curve']['kind']} curve, {data.name}")
    write_json(out / "report.json", report)
    write_text(out / "report.md", _markdown(report, results, linear))
    test = results["test"]
    print(f"curve from A to B: test accuracy min {100 * test.min_accuracy:.2f}%, average "
          f"{100 * test.average_accuracy:.2f}%; train loss max {results['train'].max_loss:.4f}")
    if args.curve_command == "train":
        print(f"curve: {out / CURVE_FILE}")
    print(f"report: {out / 'report.md'}")
    return 0


def _train(args: argparse.Namespace, model: Any, state_a: dict, state_b: dict, data: Any, out: Path,
           report: dict) -> tuple[Any, dict | None]:
    """Train the curve, write it, fill the report's ``curve`` and ``training``; the straight line's results with ``--linear``."""
    from pyperm.commands._common import has_batchnorm
    from pyperm.nn.curves import save_curve, train_curve
    from pyperm.nn.curves.checkpoint import CURVE_KINDS
    from pyperm.nn.curves.recipes import resolve_recipe

    curve = CURVE_KINDS[args.curve](model, state_a, state_b, num_bends=args.num_bends)
    linear = _evaluate(curve, data, args.num_points, args.progress) if args.linear else None
    recipe = None if args.recipe == "none" else args.recipe
    with Timer() as timer:
        history = train_curve(curve, data.train, epochs=args.epochs, lr=args.lr, momentum=args.momentum,
                              point_decay=args.point_decay, bend_decay=args.bend_decay,
                              lr_schedule=args.lr_schedule, recipe=recipe, seed=args.seed, progress=args.progress)
    save_curve(curve, out / CURVE_FILE, model_name=None if ".py:" in args.model else args.model)
    report["curve"] = {"kind": args.curve, "num_bends": args.num_bends, "file": str(out / CURVE_FILE)}
    # The values train_curve used: the recipe's where an option was left out.
    point_decay, schedule = resolve_recipe(recipe, args.point_decay, args.lr_schedule, None)
    report["training"] = {
        "epochs": args.epochs,
        "lr": args.lr,
        "momentum": args.momentum,
        "recipe": args.recipe,
        "point_decay": point_decay,
        "bend_decay": args.bend_decay,
        "lr_schedule": schedule or "constant",
        "batch_size": args.batch_size,
        "batchnorm": has_batchnorm(model),
        "loss_per_epoch": history,
        "seconds": timer.seconds,
    }
    return curve, linear


def _load(args: argparse.Namespace, model: Any, state_a: dict, state_b: dict, report: dict) -> Any:
    """The curve file of ``eval``, checked to join A and B; fills the report's ``curve``."""
    from pyperm.nn.curves import load_curve
    from pyperm.nn.curves.checkpoint import curve_kind

    curve = load_curve(args.curve, model, state_a, state_b)
    report["curve"] = {"kind": curve_kind(curve), "num_bends": curve.num_bends, "file": str(args.curve)}
    return curve


def _evaluate(curve: Any, data: Any, num_points: int, progress: bool) -> dict:
    """The curve on the training and test splits, BatchNorm statistics from the training split once per point."""
    from pyperm.commands._common import has_batchnorm
    from pyperm.nn.curves import evaluate_curve

    bn_data = data.train if has_batchnorm(curve.model) else None
    return evaluate_curve(curve, {"train": data.train, "test": data.test}, num_points=num_points, bn_data=bn_data,
                          progress=progress)


def _markdown(report: dict[str, Any], results: dict, linear: dict | None) -> str:
    from pyperm.nn import summary_table

    d, c = report["data"], report["curve"]
    lines = [
        f"# pyperm {report['command']}: {report['a']} to {report['b']}",
        "",
        f"- model: `{report['model']}`; data: {d['name']} ({d['train_samples']} training, {d['test_samples']} test "
        "samples); BatchNorm statistics recomputed on the training split at every point",
        f"- curve: {c['kind']}, {c['num_bends']} bend(s), `{c['file']}`",
    ]
    training = report.get("training")
    if training is not None:
        lines.append(
            f"- training: {training['epochs']} epochs of SGD (momentum {training['momentum']}), lr {training['lr']}, "
            f"schedule {training['lr_schedule']}, regulariser 0.5 * {training['point_decay']} * ||theta(t)||^2 on the "
            f"point of the curve, bend decay {training['bend_decay']}, batch {training['batch_size']}; "
            f"{training['seconds']:.1f} s"
        )
    lines += ["", "![curve](curve.png)", ""]
    rows = {f"curve, {split}": r for split, r in results.items()}
    if linear is not None:
        rows.update({f"straight line, {split}": r for split, r in linear.items()})
    lines.append(summary_table(rows))
    if training is not None and training["loss_per_epoch"]:
        lines += ["", "## Training loss per epoch", "",
                  markdown_table(["epoch", "mean loss"], [[i + 1, v] for i, v in enumerate(training["loss_per_epoch"])])]
    for split, r in results.items():
        lines += ["", f"## Along the curve, {split} split", "", r.to_markdown()]
    return "\n".join(lines) + "\n"
