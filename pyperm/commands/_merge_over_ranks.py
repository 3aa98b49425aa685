"""``pyperm merge`` under ``torchrun``: MergeMany or C2M3 (``--method c2m3``) with the checkpoints' tensors split
over the ranks.

As ``pyperm align`` over ranks (:mod:`pyperm.commands._over_ranks`): the keys are split by the first
checkpoint's shards (shard ``i`` of ``n`` to rank ``i * N // n``; a one-file checkpoint by contiguous
ranges of its keys), and each rank maps, of every checkpoint, only the shards that hold its keys (the
others' headers only), with the set-up ``align`` has (:func:`pyperm.commands._over_ranks.open_on_ranks`).
:func:`pyperm.distributed.merge_many` (or :func:`pyperm.distributed.c2m3_merge`) aligns the models on those
shares; each rank stages its shards of the merged model, and rank 0 stages copies of the folder's other files (config, tokenizer), renames the
shards and the copies into place, the index last (the switch), and writes the reports. The merged
checkpoint is one process's, byte for byte, except where a step is within rounding of a tie (see
:mod:`pyperm.nn.align.over_ranks`). A one-file checkpoint is written by rank 0, which first gathers the
merged tensors. ``--data`` (evaluating every model and the merge) needs whole models in one process: it
is refused over ranks.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pyperm.commands._common import CommandError
from pyperm.commands._over_ranks import all_gather, on_ranks, open_on_ranks, write_shares

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
    from pyperm._json import write_json
    from pyperm._memory import peak_resident
    from pyperm._staging import write_text
    from pyperm.checkpoints import LazyState
    from pyperm.commands._common import Timer, on_device
    from pyperm.commands._merge_report import merge_markdown, merge_report

    opened = open_on_ranks(args, args.checkpoints, split_by=0, stem=lambda first: "merged",
                           reports=["report.json", "report.md"],
                           options=[args.model, str(Path(args.out).resolve()), args.max_iter, args.seed, args.force,
                                    device.type, args.example_input_shape, args.weights, args.method])  # fmt: skip
    rank, world, ckpts, out = opened.rank, opened.world, opened.ckpts, opened.out
    first = ckpts[0]
    mine = opened.mine
    states = [on_device({k: c.state[k] for k in mine}, device) for c in ckpts]  # as stored, as in one process
    merge = pd.c2m3_merge if args.method == "c2m3" else pd.merge_many
    with Timer() as timer:
        result = merge(opened.loaded.spec, states, weights=args.weights, max_iter=args.max_iter, seed=args.seed,
                       progress=args.progress and rank == 0)  # fmt: skip
    del states
    for c in ckpts[1:]:
        c.state.clear()
    merged_here = result.merged
    if first.format != "sharded":  # rank 0 writes the one file: it needs every merged tensor
        parts = all_gather({k: v.cpu() for k, v in merged_here.items()})
        merged_here = {k: v for part in parts for k, v in part.items()}
    merged = LazyState(first.state, lambda key, stored: merged_here[key].to(stored.dtype))
    written = write_shares(first, merged, opened.ckpt_files[0], rank, world, opened.copies)
    peaks = all_gather(peak_resident())
    if rank == 0:
        report = merge_report(ckpts, opened.loaded, result, timer.seconds, opened.ckpt_files, args.weights,
                              args.method)  # fmt: skip
        report.update(ranks=world, peak_rss_bytes=peaks, torch_threads=torch.get_num_threads())
        write_json(out / "report.json", report)
        write_text(out / "report.md", merge_markdown(report))
        steps = "Frank-Wolfe iterations of C2M3" if args.method == "c2m3" else "rounds"
        print(f"merged {len(ckpts)} checkpoints over {world} ranks in {result.iterations} {steps} "
              f"({timer.seconds:.2f} s): {written[0]}")  # fmt: skip
        print(f"report: {out / 'report.md'}")
    dist.barrier()
    return 0
