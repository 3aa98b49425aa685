"""``pyperm merge A B C ...``: align several checkpoints to each other and average them (Git Re-Basin Algorithm 3,
or C2M3 with ``--method c2m3``).

Outputs in ``--out``: the merged checkpoint (``merged`` with the first input's suffix and layout),
``report.json`` and ``report.md``; with ``--data`` the test loss and accuracy of every input, of
their plain average and of the merged model (BatchNorm statistics recomputed on the training split).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pyperm._json import write_json
from pyperm._staging import write_text
from pyperm._argtypes import positive_floats, positive_int
from pyperm.commands._common import (
    add_common_arguments,
    add_data_arguments,
    add_model_arguments,
    add_rank_timeout,
    cli_errors,
)

HELP = "align several checkpoints to each other and average them (merge_many, Git Re-Basin Algorithm 3)"

__all__ = ["HELP", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pyperm merge``."""
    parser.epilog = "example: pyperm merge m1.pt m2.pt m3.pt --model mlp:64,128,128,10 --data digits --out merged/"
    parser.add_argument("checkpoints", nargs="+", metavar="CKPT", help="two or more checkpoints of one architecture")
    add_model_arguments(parser)
    add_data_arguments(parser)
    parser.add_argument(
        "--max-iter", type=positive_int, default=100, help="most rounds over the models (default 100)"
    )
    parser.add_argument(
        "--method", choices=("mergemany", "c2m3", "zipit"), default="mergemany",
        help="mergemany: Git Re-Basin's Algorithm 3 (default); c2m3: cycle-consistent Frank-Wolfe in a universe "
             "(Crisostomi et al. 2024; one process; --max-iter counts its iterations); zipit: ZipIt! (Stoica et "
             "al. 2024) of two checkpoints, merging features within and across them (needs --data)",
    )  # fmt: skip
    parser.add_argument("--alpha", type=float, default=0.3, help="zipit: the paper's alpha, in [0, 1] (default 0.3)")
    parser.add_argument(
        "--beta", type=float, default=0.125,
        help="zipit: same-model merges per model as a fraction of half a group, in [0, 1] (default 0.125; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--stop", default=None, metavar="GROUP",
        help="zipit: a partial zip up to this group of the spec (two heads written: zipped_a, zipped_b); the report "
             "of a full zip lists the groups it can stop at",
    )  # fmt: skip
    parser.add_argument(
        "--weights", type=positive_floats, default=None, metavar="W1,W2,...",
        help="one positive weight per checkpoint, summing to 1: each aligned model's share of the merge "
             "(default: equal weights)",
    )  # fmt: skip
    add_common_arguments(parser)
    add_rank_timeout(parser)


def _evaluate(loaded: Any, state: dict, data: Any, device: Any) -> dict[str, float]:
    """Test loss and accuracy of one state (BatchNorm statistics reset on the training batches first)."""
    import copy

    import torch

    from pyperm.commands._common import has_batchnorm
    from pyperm.nn import reset_bn_stats
    from pyperm.nn._runtime import mean_loss_and_accuracy

    model = copy.deepcopy(loaded.module).to(device)
    model.load_state_dict(state)
    if has_batchnorm(model):
        reset_bn_stats(model, data.train)
    model.eval()
    with torch.no_grad():
        loss, accuracy, _ = mean_loss_and_accuracy(model, data.test, torch.nn.functional.cross_entropy, device)
    return {"loss": loss, "accuracy": accuracy}


def check_weights(args: argparse.Namespace) -> None:
    """``--weights``: one per checkpoint, summing to 1 (a CommandError naming the option otherwise)."""
    from pyperm._checks import check_merge_weights
    from pyperm.commands._common import CommandError

    try:
        check_merge_weights(args.weights, len(args.checkpoints), "--weights")
    except ValueError as exc:
        raise CommandError(str(exc)) from None


@cli_errors("merge")
def run(args: argparse.Namespace) -> int:
    """Merge, write the merged checkpoint and the reports.

    The checkpoints are memory-mapped (:func:`pyperm.checkpoints.load_checkpoint`); without ``--data``
    the model is built on the meta device (only its spec, keys and shapes are used). The merged model
    is written tensor by tensor, shard by shard, each tensor cast to the stored dtype when its turn
    comes. The models are merged in their stored dtypes.
    """
    from pyperm._memory import peak_resident
    from pyperm.checkpoints import LazyState, save_checkpoint
    from pyperm.commands._checkpoint_pair import load_for_model, refuse_inputs
    from pyperm.commands._merge_report import merge_markdown, merge_report
    from pyperm.commands._common import (
        CommandError,
        Timer,
        build_model,
        check_inputs,
        checkpoint_outputs,
        load_data,
        on_device,
        prepare_out,
        resolve_device,
    )
    from pyperm.commands._hf import folder_copies
    from pyperm.commands._over_ranks import launched
    from pyperm.commands._pipeline import is_pipeline
    from pyperm.nn import average, merge_many

    check_weights(args)
    if args.model == "hf" and any(is_pipeline(p) for p in args.checkpoints):  # component by component
        return _merge_pipelines(args)
    if launched() and args.method == "zipit":
        raise CommandError("--method zipit runs in one process: start it without torchrun")
    if args.method == "zipit":
        from pyperm.commands._zip import run_zipit

        return run_zipit(args)
    if launched():  # under torchrun: the tensors split over the ranks
        from pyperm.commands._merge_over_ranks import merge_over_ranks

        return merge_over_ranks(args)

    if len(args.checkpoints) < 2:
        raise CommandError(f"merge needs at least two checkpoints, got {len(args.checkpoints)}")
    device = resolve_device(args.device)
    loaded = build_model(args.model, args.example_input_shape, args.checkpoints[0], meta=not args.data)
    ckpts = load_for_model(args.checkpoints, loaded)
    out = Path(args.out)
    # A pipeline's component (pyperm.commands._pipeline) names its place in the output pipeline.
    ckpt_files = checkpoint_outputs(ckpts[0], out, getattr(args, "output_stem", None) or "merged", args.model)
    copies = folder_copies(ckpts[0], ckpt_files) if args.model == "hf" else []
    names = [str(p.relative_to(out)) for p in ckpt_files + [dst for _, dst in copies]] + ["report.json", "report.md"]
    refuse_inputs([out / n for n in names], ckpts)
    prepare_out(out, names, args.force)
    data = load_data(args, device)
    check_inputs(loaded, data, device)

    # As stored (load_for_model has checked that the checkpoints agree on every dtype): merge_many matches in
    # the models' dtypes, as align does, and rounds each merged entry to it once, from a float64 mean. Two
    # bfloat16 SDXL UNets stay bfloat16, read from the mapped files: float32 copies alone would be 20 GB.
    states = [on_device(c.state, device) for c in ckpts]
    with Timer() as timer:
        if args.method == "c2m3":
            from pyperm.nn.align.c2m3 import c2m3_merge

            result = c2m3_merge(loaded.spec, states, weights=args.weights, max_iter=args.max_iter, seed=args.seed,
                                progress=args.progress)  # fmt: skip
        else:
            result = merge_many(loaded.spec, states, weights=args.weights, max_iter=args.max_iter, seed=args.seed,
                                progress=args.progress)  # fmt: skip
    # Write in the first input's dtypes, as the inputs were stored: one tensor at a time, when written.
    merged = LazyState(ckpts[0].state, lambda key, stored: result.merged[key].to(stored.dtype))
    report = merge_report(ckpts, loaded, result, timer.seconds, ckpt_files, args.weights, args.method)
    if data is not None:
        evaluations = {str(c.path): _evaluate(loaded, s, data, device) for c, s in zip(ckpts, states)}
        evaluations["plain average (no alignment)"] = _evaluate(loaded, average(states, args.weights), data, device)
        evaluations["merged"] = _evaluate(loaded, result.merged, data, device)
        report["data"] = {"name": data.name, "test_samples": data.num_test}
        report["evaluation"] = evaluations
    written = save_checkpoint(ckpts[0], merged, ckpt_files[0], force=args.force, copies=copies)  # --model hf: the config and tokenizer beside the weights
    report["peak_rss_bytes"] = [peak_resident()]  # after writing, which reads every merged tensor once more
    write_json(out / "report.json", report)
    write_text(out / "report.md", merge_markdown(report))
    steps = "Frank-Wolfe iterations of C2M3" if args.method == "c2m3" else "rounds"
    print(f"merged {len(ckpts)} checkpoints in {result.iterations} {steps} ({timer.seconds:.2f} s): {written[0]}")
    if data is not None:
        for name, e in report["evaluation"].items():
            print(f"  {name}: test loss {e['loss']:.4f}, accuracy {100 * e['accuracy']:.2f}%")
    print(f"report: {out / 'report.md'}")
    return 0


def _merge_pipelines(args: argparse.Namespace) -> int:
    """Diffusers pipeline folders: each model component merged as above, the rest copied from the first."""
    from pyperm.commands._pipeline import PipelineRun, run_pipeline

    def component_args(sub: argparse.Namespace, folders: list[str]) -> None:
        sub.checkpoints = folders

    job = PipelineRun("merge", list(args.checkpoints), args.checkpoints[0], "merged", component_args, run.__wrapped__)
    return run_pipeline(args, job)
