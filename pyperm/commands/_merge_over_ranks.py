"""``pyperm merge`` under ``torchrun``: MergeMany with the checkpoints' tensors split over the ranks.

As ``pyperm align`` over ranks (:mod:`pyperm.commands._over_ranks`): the keys are split by the first
checkpoint's shards (shard ``i`` of ``n`` to rank ``i * N // n``; a one-file checkpoint by contiguous
ranges of its keys), and each rank maps, of every checkpoint, only the shards that hold its keys (the
others' headers only). :func:`pyperm.distributed.merge_many` aligns the models on those shares; each
rank stages its shards of the merged model, and rank 0 renames them into place, the index last, then
copies the folder's other files and writes the reports. The merged checkpoint is one process's, byte
for byte, except where a step is within rounding of a tie (see :mod:`pyperm.nn.align.over_ranks`). A one-file checkpoint is written by rank 0, which first gathers the merged tensors. ``--data``
(evaluating every model and the merge) needs whole models in one process: it is refused over ranks.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pyperm.commands._common import CommandError
from pyperm.commands._over_ranks import _fingerprint, _gather, _my_shards, key_owners, on_ranks, write_shares

__all__ = ["merge_over_ranks"]


def merge_over_ranks(args: argparse.Namespace) -> int:
    """``pyperm merge`` with MergeMany over the ranks (see the module notes)."""
    if len(args.checkpoints) < 2:
        raise CommandError(f"merge needs at least two checkpoints, got {len(args.checkpoints)}")
    if args.data:
        raise CommandError("--data: over ranks (torchrun) the models are not evaluated; merge without --data")
    return on_ranks(args, lambda device: _merge(args, device))


def _merge(args: argparse.Namespace, device: Any) -> int:
    import torch
    import torch.distributed as dist

    import pyperm.distributed as pd
    from pyperm import _staging
    from pyperm._json import write_json
    from pyperm._memory import peak_resident
    from pyperm._staging import write_text
    from pyperm.checkpoints import DATA_PARALLEL_PREFIX, LazyState, check_pair
    from pyperm.commands._checkpoint_pair import load_for_model, refuse_inputs
    from pyperm.commands._common import Timer, build_model, checkpoint_outputs, float_state, prepare_out
    from pyperm.commands._hf import folder_copies, folder_of
    from pyperm.commands._merge_report import merge_markdown, merge_report

    rank, world = dist.get_rank(), dist.get_world_size()
    loaded = build_model(args.model, args.example_input_shape, args.checkpoints[0], meta=True)
    (first,) = load_for_model(args.checkpoints[:1], loaded, [lambda weight_map: _my_shards(weight_map, rank, world)])
    owners = key_owners(first, world)

    def holding_mine(weight_map: dict[str, str]) -> set[str]:
        return {shard for stored, shard in weight_map.items()
                if owners.get(stored, owners.get(stored.removeprefix(DATA_PARALLEL_PREFIX))) == rank}  # fmt: skip

    ckpts = [first, *load_for_model(args.checkpoints[1:], loaded, [holding_mine] * (len(args.checkpoints) - 1))]
    for other in ckpts[1:]:
        check_pair(first, other)
    out = Path(args.out)
    ckpt_files = checkpoint_outputs(first, out, "merged", args.model)
    copies = folder_copies(first, ckpt_files) if args.model == "hf" else []
    names = [str(p.relative_to(out)) for p in ckpt_files + [dst for _, dst in copies]] + ["report.json", "report.md"]
    hf = args.model == "hf"
    pd.check_same(None, inputs=[_fingerprint(c, [folder_of(c.path) / "config.json"] if hf else []) for c in ckpts],
                  options=[args.model, str(out.resolve()), args.max_iter, args.seed, args.force, device.type,
                           args.example_input_shape, args.weights])  # fmt: skip
    refuse_inputs([out / n for n in names], ckpts)
    if rank == 0:
        prepare_out(out, names, args.force)
        _staging.remove_leftovers(ckpt_files[0].parent)  # by rank 0, before any rank stages
    dist.barrier()

    mine = [k for k in loaded.spec.axes if owners.get(k) == rank]
    states = [float_state({k: c.state[k] for k in mine}, device) for c in ckpts]
    with Timer() as timer:
        result = pd.merge_many(loaded.spec, states, weights=args.weights, max_iter=args.max_iter, seed=args.seed,
                               progress=args.progress and rank == 0)  # fmt: skip
    del states
    for c in ckpts[1:]:
        c.state.clear()
    merged_here = result.merged
    if first.format != "sharded":  # rank 0 writes the one file: it needs every merged tensor
        merged_here = {k: v for part in _gather({k: v.cpu() for k, v in merged_here.items()}) for k, v in part.items()}
    merged = LazyState(first.state, lambda key, stored: merged_here[key].to(stored.dtype))
    written = write_shares(first, merged, ckpt_files[0], rank, world, copies)
    peaks = _gather(peak_resident())
    if rank == 0:
        report = merge_report(ckpts, loaded, result, timer.seconds, ckpt_files, args.weights)
        report.update(ranks=world, peak_rss_bytes=peaks, torch_threads=torch.get_num_threads())
        write_json(out / "report.json", report)
        write_text(out / "report.md", merge_markdown(report))
        print(f"merged {len(ckpts)} checkpoints over {world} ranks in {result.iterations} rounds "
              f"({timer.seconds:.2f} s): {written[0]}")  # fmt: skip
        print(f"report: {out / 'report.md'}")
    dist.barrier()
    return 0
