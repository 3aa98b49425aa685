"""``pyperm align A B``: permute checkpoint B into checkpoint A's basin and write it in B's own format.

Outputs in ``--out``: B permuted (``<B>_permuted`` with B's suffix; a sharded B keeps its shard
names), ``permutations.json`` (unit ``i`` of the permuted model is unit ``perm[i]`` of B),
``report.json`` and ``report.md`` (groups, the objective per sweep, time, and with ``--data``
the barriers before and after), and with ``--data`` ``barrier.png``.

Under ``torchrun`` (``WORLD_SIZE`` above 1) weight matching runs with the checkpoints' tensors split
over the ranks and each rank writes its share of B permuted (:mod:`pyperm.commands._over_ranks`);
the files written are byte for byte those of one process with the same ``--init`` (the reports aside), except
where a step is within rounding of a tie (see :mod:`pyperm.nn.align.over_ranks`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pyperm._json import write_json
from pyperm._staging import write_text
from pyperm._tables import markdown_table
from pyperm._argtypes import int_at_least
from pyperm.commands._common import (
    add_common_arguments,
    add_data_arguments,
    add_model_arguments,
    add_rank_timeout,
    cli_errors,
)
from pyperm.commands._matching import METHODS, add_matching_arguments

HELP = "permute checkpoint B into checkpoint A's basin (weight, activation or STE matching)"

__all__ = ["HELP", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pyperm align``."""
    parser.epilog = (
        "example: pyperm align a.safetensors b.safetensors --model mlp:784,512,512,10 --method weight --out aligned/ ; "
        "checkpoints are .pt/.pth/.bin state dicts (possibly under 'state_dict' or 'model'), .safetensors, "
        "or a sharded checkpoint's index json"
    )
    parser.add_argument("a", metavar="A", help="the reference checkpoint (left as it is)")
    parser.add_argument("b", metavar="B", help="the checkpoint to permute")
    add_model_arguments(parser)
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="weight",
        help="how to match units (default weight; the others need --data)",
    )
    add_data_arguments(parser)
    add_matching_arguments(parser)
    parser.add_argument(
        "--num-points", type=int_at_least(2), default=11, help="points on each path for the barriers (default 11)"
    )
    add_common_arguments(parser)
    add_rank_timeout(parser)


def path_barriers(
    loaded: Any, state_a: dict, paths: dict[str, dict], data: Any, num_points: int, device: Any, progress: bool,
    loss_fn: Any = None,
) -> dict:
    """``barrier`` of A with each state of ``paths`` on the test batches (BatchNorm reset on the training batches),
    under ``loss_fn`` (cross-entropy when None).

    Shared with ``pyperm barrier``.
    """
    import copy

    from pyperm import nn as pnn
    from pyperm.commands._common import has_batchnorm

    model = copy.deepcopy(loaded.module).to(device)
    bn_data = data.train if has_batchnorm(model) else None
    return {
        label: pnn.barrier(
            model, state_a, state_b, data.test, num_points=num_points, bn_data=bn_data, progress=progress,
            loss_fn=loss_fn,
        )
        for label, state_b in paths.items()
    }


@cli_errors("align")
def run(args: argparse.Namespace) -> int:
    """Align, write the permuted checkpoint and the reports; print where they are.

    The checkpoints are memory-mapped, not read (:func:`pyperm.checkpoints.load_checkpoint`), and
    weight matching reads them in their stored dtypes. B permuted is written tensor by tensor, each
    computed when its turn comes (:class:`pyperm.checkpoints.LazyState`), shard by shard. Without
    ``--data`` weight matching needs no model values: the model is built on the meta device, and
    the function check runs B and the written file (mapped again) in their own dtype. With
    ``--data`` the barriers and the other methods run float32 copies of the models, as before.
    """
    from pyperm.commands._over_ranks import align_over_ranks, launched
    from pyperm.commands._pipeline import is_pipeline

    if args.model == "hf" and (is_pipeline(args.a) or is_pipeline(args.b)):  # component by component
        return _align_pipelines(args)
    if launched():  # under torchrun: the tensors split over the ranks
        return align_over_ranks(args)
    from pyperm._memory import peak_resident
    from pyperm.checkpoints import LazyState, save_checkpoint
    from pyperm.commands._checkpoint_pair import function_gap, load_for_model, refuse_inputs
    from pyperm.commands._common import (
        build_model,
        check_inputs,
        checkpoint_outputs,
        float_state,
        load_data,
        on_device,
        prepare_out,
        resolve_device,
    )
    from pyperm.commands._hf import folder_copies, folder_of
    from pyperm.commands._matching import match
    from pyperm.nn import apply_permutation, plot_paths
    from pyperm.nn.permutations import as_permutations, permute_entry

    device = resolve_device(args.device)
    # Weight matching without data needs only the spec and the keys and shapes: no model values.
    loaded = build_model(args.model, args.example_input_shape, args.a, meta=args.method == "weight" and not args.data)
    ckpt_a, ckpt_b = load_for_model([args.a, args.b], loaded)
    out = Path(args.out)
    # A pipeline's component (pyperm.commands._pipeline) names its place in the output pipeline.
    stem = getattr(args, "output_stem", None) or (
        (folder_of(ckpt_b.path).name if args.model == "hf" else ckpt_b.path.name.split(".")[0]) + "_permuted")
    ckpt_files = checkpoint_outputs(ckpt_b, out, stem, args.model)
    copies = folder_copies(ckpt_b, ckpt_files) if args.model == "hf" else []
    names = (
        [str(p.relative_to(out)) for p in ckpt_files + [dst for _, dst in copies]]
        + ["permutations.json", "report.json", "report.md"]
        + (["barrier.png"] if args.data else [])
    )
    refuse_inputs([out / n for n in names], [ckpt_a, ckpt_b])
    prepare_out(out, names, args.force)
    data = load_data(args, device)
    check_inputs(loaded, data, device)

    if args.method == "weight":
        # As stored (a bfloat16 model stays bfloat16, read from the mapped files): no float32 copy of either.
        perms, info = match(args.method, loaded, on_device(ckpt_a.state, device), on_device(ckpt_b.state, device),
                            data, args, device)  # fmt: skip
    else:
        perms, info = match(args.method, loaded, float_state(ckpt_a.state, device),
                            float_state(ckpt_b.state, device), data, args, device)  # fmt: skip
    # B permuted as stored (its own dtypes), so the written file differs from B by the permutation only;
    # each tensor is permuted when the writer reaches it, and let go once written.
    checked = as_permutations(loaded.spec, perms)
    permuted = LazyState(ckpt_b.state, lambda key, tensor: permute_entry(loaded.spec, checked, key, tensor))

    barriers = gap = gap_dtype = None
    if data is not None:
        # The barriers run float32 models: B permuted whole, as the paths need it.
        state_a, state_b = float_state(ckpt_a.state, device), float_state(ckpt_b.state, device)
        permuted_f32 = float_state(apply_permutation(loaded.spec, perms, ckpt_b.state), device)
        gap, gap_dtype = function_gap(loaded, state_b, permuted_f32, data.test[0][0])
        barriers = path_barriers(
            loaded, state_a, {"naive": state_b, args.method: permuted_f32}, data, args.num_points, device, args.progress
        )
        del permuted_f32, state_a, state_b
    # A is no longer read: let its mapped pages go before B permuted is written and checked (the matcher
    # holds no reference cycle: its similarities and views went when it returned).
    ckpt_a.state.clear()

    written = save_checkpoint(ckpt_b, permuted, ckpt_files[0], force=args.force, copies=copies)  # --model hf: the config and tokenizer beside the weights
    probe = loaded.example_input(device)
    if data is None and probe is not None:
        # Check that the written file (mapped again, not kept in memory) computes B's function.
        (ckpt_out,) = load_for_model([str(ckpt_files[0])], loaded)
        gap, gap_dtype = function_gap(loaded, on_device(ckpt_b.state, device), on_device(ckpt_out.state, device),
                                      probe)  # fmt: skip
        del ckpt_out

    report = align_report(ckpt_a, ckpt_b, loaded, perms, info, ckpt_files, gap, gap_dtype, [peak_resident()])
    if barriers is not None:
        report["data"] = {"name": data.name, "train_samples": data.num_train, "test_samples": data.num_test}
        report["barriers"] = {label: r.to_dict() for label, r in barriers.items()}
    write_json(out / "permutations.json", perms.to_dict())
    write_json(out / "report.json", report)
    if barriers is not None:
        plot_paths(barriers, out / "barrier.png", title=f"{loaded.name}: naive vs {args.method} matching")
    write_text(out / "report.md", _markdown(report, barriers))

    where = written[0].parent if args.model == "hf" else written[0]
    print(f"B permuted into A's basin by {args.method} matching in {info['seconds']:.2f} s: {where}")
    print(f"objective vec(A).vec(pi(B)): {info['identity_objective']:.6g} -> {info['objective']:.6g}")
    if barriers is not None:
        for label, r in barriers.items():
            print(
                f"{label:>10} path: loss barrier {r.loss_barrier:.4f}, accuracy barrier {100 * r.accuracy_barrier:.2f} pp"
            )
    print(f"report: {out / 'report.md'}")
    return 0


def _align_pipelines(args: argparse.Namespace) -> int:
    """Two diffusers pipeline folders: each model component aligned as above, the rest copied from B."""
    from pyperm.commands._pipeline import PipelineRun, run_pipeline

    def component_args(sub: argparse.Namespace, folders: list[str]) -> None:
        sub.a, sub.b = folders

    b = Path(args.b)
    job = PipelineRun("align", [args.a, args.b], args.b, f"{b.resolve().name}_permuted", component_args, run.__wrapped__)
    return run_pipeline(args, job)


def align_report(ckpt_a: Any, ckpt_b: Any, loaded: Any, perms: Any, info: dict[str, Any], outputs: list[Path],
                 gap: float | None, gap_dtype: str | None, peaks: list[int | None]) -> dict[str, Any]:  # fmt: skip
    """What report.json says of an alignment (one process, or over ranks with ``peaks`` per rank)."""
    import torch

    return {
        "command": "align",
        "a": str(ckpt_a.path),
        "b": str(ckpt_b.path),
        "model": loaded.name,
        "format": ckpt_b.format,
        "groups": [{"name": g, "size": p.numel(), "units_moved": _moved(p)} for g, p in perms.items()],
        "matching": info,
        "max_output_change_of_b": gap,
        "output_check_dtype": gap_dtype,
        "dropped_wrapper_entries": ckpt_b.dropped,
        "outputs": [str(p) for p in outputs],
        "peak_rss_bytes": peaks,
        "torch_threads": torch.get_num_threads(),
    }


def _moved(p: Any) -> int:
    """How many units a permutation moves."""
    import torch

    return int((p != torch.arange(p.numel())).sum())


def _markdown(report: dict[str, Any], barriers: dict | None) -> str:
    from pyperm.commands._common import peak_memory_lines

    info = report["matching"]
    gap = report["max_output_change_of_b"]
    gap_text = (
        ("not checked over ranks" if report.get("ranks") else "not checked (no --data or --example-input-shape)")
        if gap is None
        else f"{gap:.3g} (the models run in {report['output_check_dtype']})"
    )
    lines = [
        f"# pyperm align: {report['b']} into {report['a']}'s basin",
        "",
        f"- model: `{report['model']}`, checkpoint format: {report['format']}",
        f"- method: {info['method']} matching, {info['seconds']:.3f} s",
        f"- objective vec(A)·vec(π(B)): {info['identity_objective']:.6g} before, {info['objective']:.6g} after",
        f"- largest change of B's outputs after permuting (should be ~0): {gap_text}",
        f"- written: {', '.join(f'`{p}`' for p in report['outputs'])}",
    ]
    lines += peak_memory_lines(report.get("peak_rss_bytes", []))
    if report["dropped_wrapper_entries"]:
        lines.append(
            f"- entries of B's checkpoint not written back (they describe the unpermuted model): {report['dropped_wrapper_entries']}"
        )
    lines += [
        "",
        "## Groups",
        "",
        markdown_table(
            ["group", "units", "units moved"], [[g["name"], g["size"], g["units_moved"]] for g in report["groups"]]
        ),
    ]
    if "objective_per_sweep" in info:
        # The first value is the objective before any sweep (B as it is).
        rows = [[i if i else "0 (B as is)", v] for i, v in enumerate(info["objective_per_sweep"])]
        lines += [
            "",
            f"## Objective per sweep ({info['iterations']} sweeps, converged: {info['converged']})",
            "",
            markdown_table(["sweep", "objective"], rows),
        ]
    if "similarity" in info:
        rows = [[g, info["identity_similarity"][g], v] for g, v in info["similarity"].items()]
        lines += ["", "## Mean correlation of matched units", "", markdown_table(["group", "before", "after"], rows)]
    if "midpoint_loss_per_step" in info:
        losses = info["midpoint_loss_per_step"]
        lines += ["", f"## STE: midpoint batch loss, {len(losses)} steps, best step {info['best_step']}", ""]
        lines.append(markdown_table(["step", "midpoint loss"], [[i, v] for i, v in enumerate(losses)]))
    if barriers is not None:
        d = report["data"]
        lines += [
            "",
            f"## Barriers on {d['name']} (test split, {d['test_samples']} samples)",
            "",
            "![paths](barrier.png)",
            "",
        ]
        rows = [
            [
                label,
                r.loss_barrier,
                100 * r.accuracy_barrier,
                float(r.loss[len(r.loss) // 2]),
                100 * float(r.accuracy[len(r.accuracy) // 2]),
            ]
            for label, r in barriers.items()
        ]
        lines.append(
            markdown_table(
                ["path", "loss barrier", "accuracy barrier (pp)", "midpoint loss", "midpoint accuracy (%)"], rows
            )
        )
        for label, r in barriers.items():
            lines += ["", f"### {label} path", "", r.to_markdown()]
    return "\n".join(lines) + "\n"
