"""``pyperm barrier A B``: loss and accuracy along the linear path between two checkpoints.

The naive path always; with ``--align weight|activation|ste`` also the path to B permuted into
A's basin. Outputs in ``--out``: ``report.json``, ``report.md`` and ``barrier.png``.

With ``--model hf`` on two diffusers model folders there is no ``--data``: a UNet is evaluated on its
denoising loss and a VAE on its reconstruction error, over fixed random draws
(:func:`pyperm.commands._diffusers.evaluation_data`; ``--max-samples``, default 16, draws, seeded by
``--seed``), and only weight matching aligns. On two diffusers pipeline folders (``model_index.json``) the
pipeline's path is scored on the latents of a few prompts (``--prompts``; ``--vae`` adds the VAE):
:mod:`pyperm.commands._pipeline_barrier`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from pyperm._json import write_json
from pyperm._staging import write_text
from pyperm._tables import markdown_table
from pyperm._argtypes import int_at_least
from pyperm.commands._common import add_common_arguments, add_data_arguments, add_model_arguments, cli_errors
from pyperm.commands._matching import METHODS, add_matching_arguments

HELP = "loss and accuracy along the linear path between two checkpoints, naive and (with --align) matched"

__all__ = ["HELP", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pyperm barrier``."""
    parser.epilog = (
        "example: pyperm barrier a.pt b.pt --model mlp:64,128,10 --data digits --align weight --out barrier/"
    )
    parser.add_argument("a", metavar="A", help="the checkpoint at t = 0")
    parser.add_argument("b", metavar="B", help="the checkpoint at t = 1")
    add_model_arguments(parser)
    add_data_arguments(parser)
    parser.add_argument(
        "--align",
        choices=METHODS,
        action="append",
        default=[],
        help="also the path to B matched by this method (repeatable)",
    )
    add_matching_arguments(parser)
    parser.add_argument(
        "--prompts",
        metavar="P1,P2,...|FILE",
        help="diffusers pipeline folders: the prompts whose latents score the path, separated by commas, or a file "
        "with one prompt a line (default: four short captions)",
    )
    parser.add_argument(
        "--vae",
        action="store_true",
        help="diffusers pipeline folders: also the VAE's path, by its reconstruction error of random images",
    )
    parser.add_argument(
        "--num-points", type=int_at_least(2), default=11, help="evenly spaced points on each path (default 11)"
    )
    add_common_arguments(parser)


@cli_errors("barrier")
def run(args: argparse.Namespace) -> int:
    """Evaluate the paths, write the reports and the plot, print the barriers."""
    from pyperm.commands._over_ranks import refuse_ranks

    refuse_ranks("barrier")
    from pyperm.commands._pipeline import is_pipeline
    from pyperm.commands._pipeline_barrier import check_pipeline_options, pipeline_barrier

    if args.model == "hf" and (is_pipeline(args.a) or is_pipeline(args.b)):
        return pipeline_barrier(args)
    check_pipeline_options(args)
    from pyperm.commands._checkpoint_pair import load_for_model
    from pyperm.commands._diffusers import diffusers_class_name, evaluation_data
    from pyperm.commands._hf import folder_of
    from pyperm.commands._common import build_model, check_inputs, float_state, load_data, prepare_out, resolve_device
    from pyperm.commands._matching import match
    from pyperm.commands.align import path_barriers
    from pyperm.nn import apply_permutation, plot_paths

    device = resolve_device(args.device)
    loaded = build_model(args.model, args.example_input_shape, args.a)
    ckpt_a, ckpt_b = load_for_model([args.a, args.b], loaded)
    diffusers = args.model == "hf" and diffusers_class_name(folder_of(args.a)) is not None
    _check_data_options(args, diffusers)
    out = prepare_out(Path(args.out), ["report.json", "report.md", "barrier.png"], args.force)
    loss_fn = None
    if diffusers:  # no --data: the model's own loss on fixed draws
        data, loss_fn = evaluation_data(loaded, args.max_samples or 16, args.batch_size, args.seed)
    else:
        data = load_data(args, device)
        check_inputs(loaded, data, device)
    state_a = float_state(ckpt_a.state, device)
    state_b = float_state(ckpt_b.state, device)

    paths = {"naive": state_b}
    matchings: dict[str, Any] = {}
    for method in dict.fromkeys(args.align):  # each method once, in the order given
        perms, info = match(method, loaded, state_a, state_b, data, args, device)
        paths[method] = apply_permutation(loaded.spec, perms, state_b)
        matchings[method] = info
    results = path_barriers(loaded, state_a, paths, data, args.num_points, device, args.progress, loss_fn)

    report = {
        "command": "barrier",
        "a": str(ckpt_a.path),
        "b": str(ckpt_b.path),
        "model": loaded.name,
        "data": {"name": data.name, "train_samples": data.num_train, "test_samples": data.num_test},
        "paths": {label: r.to_dict() for label, r in results.items()},
        "matching": matchings,
    }
    write_json(out / "report.json", report)
    plot_paths(results, out / "barrier.png", title=f"{loaded.name} on {data.name} (test split)")
    write_text(out / "report.md", _markdown(report, results))
    for label, r in results.items():
        accuracy = "" if math.isnan(r.accuracy_barrier) else f", accuracy barrier {100 * r.accuracy_barrier:.2f} pp"
        print(f"{label:>10} path: loss barrier {r.loss_barrier:.4f}{accuracy}")
    print(f"report: {out / 'report.md'}")
    return 0


def _check_data_options(args: argparse.Namespace, diffusers: bool) -> None:
    """``--data`` is required, except for diffusers model folders, which take none and align by weights only."""
    from pyperm.commands._common import CommandError

    if not diffusers:
        if not args.data:
            raise CommandError("--data is required (except with --model hf on diffusers model folders)")
        return
    refuse_data(args, "diffusers model folders", "a diffusers model folder is evaluated on its own loss over fixed "
                "random draws (denoising for a UNet, reconstruction for a VAE)")  # fmt: skip


def refuse_data(args: argparse.Namespace, folders: str, scored: str) -> None:
    """Folders scored on their own loss (diffusers models, pipelines) take no ``--data``, so they align by
    weights only: ``--data`` and the other ``--align`` methods are refused, saying how they are ``scored``."""
    from pyperm.commands._common import CommandError

    if args.data:
        raise CommandError(f"--data {args.data}: {scored}, not on --data")
    others = sorted(set(args.align) - {"weight"})
    if others:
        raise CommandError(f"--align {others[0]}: needs --data; {folders} align by --align weight")


def _markdown(report: dict[str, Any], results: dict) -> str:
    d = report["data"]
    lines = [
        f"# pyperm barrier: {report['a']} to {report['b']}",
        "",
        (
            f"- model: `{report['model']}`; data: {d['name']}, test split ({d['test_samples']} samples); "
            "barriers as in Git Re-Basin Definition 2.2 (height above the chord between the endpoints)"
        ),
        "",
        "![paths](barrier.png)",
        "",
    ]
    rows = [[label, r.loss_barrier, 100 * r.accuracy_barrier] for label, r in results.items()]
    lines.append(markdown_table(["path", "loss barrier", "accuracy barrier (pp)"], rows))
    for method, info in report["matching"].items():
        lines.append(f"\n{method} matching took {info['seconds']:.3f} s")
    for label, r in results.items():
        lines += ["", f"## {label} path", "", r.to_markdown()]
    return "\n".join(lines) + "\n"
