"""``pyperm align`` under ``torchrun``: weight matching with the checkpoints' tensors split over the ranks.

``torchrun --nproc-per-node N -m pyperm align A B --model hf --out OUT`` (or any launcher that sets
``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``, or a caller that initialised torch.distributed itself):

1. the process group is initialised over the launcher's rendezvous (``env://``; gloo on the CPU,
   NCCL with ``--device cuda``, each rank on its ``LOCAL_RANK``'s GPU);
2. every rank states its pyperm version, its options and a fingerprint of each checkpoint
   (:func:`pyperm.distributed.check_same`): a rank that differs is refused before any work;
3. the keys are split by B's shards (shard ``i`` of ``n`` to rank ``i * N // n``; a one-file
   checkpoint by contiguous ranges of its keys); each rank maps only its own shards of B and the
   shards of A that hold the same keys (of the others it reads the headers: shapes and dtypes, as
   meta tensors), and :func:`pyperm.distributed.weight_matching` finds the permutations (the same
   as one process's with the same ``--init``). A one-file checkpoint is mapped by every rank, each
   reading its own keys; rank 0 writes the one output file;
4. each rank stages its shards of B permuted (hidden names, fsynced: :mod:`pyperm._staging`);
   once every rank has, rank 0 stages copies of the folder's other files (config, tokenizer),
   renames the shards and the copies into place, then the index (the switch), and writes
   ``permutations.json`` and the reports.

The whole runs inside :func:`pyperm.distributed.failure_guard`: a rank that fails ends every rank
with an error naming it, and the staged files are removed, so nothing partial is left under the
output's names (a killed rank can leave hidden ``*.pyperm-partial`` files, which the next write
into the folder removes). The output folder must be one every rank sees (over several nodes, a
shared filesystem).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyperm.commands._common import CommandError

__all__ = ["RankInputs", "align_over_ranks", "all_gather", "key_owners", "launched", "on_ranks", "open_on_ranks",
           "process_group", "refuse_ranks", "write_shares"]

_LAUNCHER = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


def launched() -> bool:
    """Whether this process is one of several ranks: torch.distributed already initialised with more than one,
    or started by torchrun (its ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``) with ``WORLD_SIZE`` above 1."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if not all(name in os.environ for name in _LAUNCHER):
        return False
    try:
        return int(os.environ["WORLD_SIZE"]) > 1
    except ValueError as exc:
        raise CommandError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment: not a number") from exc


def refuse_ranks(command: str) -> None:
    """Refuse to run ``command`` as one of several ranks: each would do the whole work and write the same
    files (only ``align`` and ``merge`` split their work over ranks)."""
    if launched():
        raise CommandError(f"{command} does not run over ranks (torchrun, WORLD_SIZE above 1) yet: run it as one "
                           "process (pyperm align and pyperm merge do run over ranks)")  # fmt: skip


@contextlib.contextmanager
def process_group(device: Any) -> Iterator[None]:
    """The default process group for the command: the caller's, or one made here over the launcher's
    rendezvous (``env://``) and destroyed at the end."""
    import torch
    import torch.distributed as dist

    from pyperm._comm import init_process_group

    if not dist.is_available():
        raise CommandError("this torch has no torch.distributed: the command cannot run over ranks")
    if dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        local, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        if local >= count:
            raise CommandError(f"--device cuda: this is local rank {local} but the node has {count} GPU(s); "
                               "start at most one rank per GPU (NCCL cannot share one)")  # fmt: skip
        torch.cuda.set_device(local)
        backend = "nccl"
    else:
        backend = "gloo"
    init_process_group(backend, init_method="env://")
    try:
        yield
    finally:
        dist.destroy_process_group()


def key_owners(ckpt: Any, world: int) -> dict[str, int]:
    """The rank that holds each key of ``ckpt``: shard ``i`` of ``n`` (sorted names) goes to rank ``i * world // n``;
    a one-file checkpoint is split in contiguous ranges of its keys; a tied key goes with the key it repeats."""
    keys = [k for k in ckpt.state if k not in ckpt.tied]
    if ckpt.format == "sharded":
        rank_of = _shard_ranks(ckpt.weight_map, world)
        owners = {k: rank_of[ckpt.weight_map[ckpt.prefix + k]] for k in keys}
    else:
        owners = {k: i * world // len(keys) for i, k in enumerate(keys)}
    for key, source in ckpt.tied.items():
        owners[key] = owners[source]
    return owners


def _shard_ranks(weight_map: dict[str, str], world: int) -> dict[str, int]:
    shards = sorted(set(weight_map.values()))
    return {s: i * world // len(shards) for i, s in enumerate(shards)}


def _my_shards(weight_map: dict[str, str], rank: int, world: int) -> list[str]:
    return [s for s, r in _shard_ranks(weight_map, world).items() if r == rank]


def _fingerprint(ckpt: Any, extra: list[Path]) -> str:
    """What identifies a checkpoint without reading its tensors: each file's name, size and first MiB (a
    safetensors header, an index json), and the given extra files (``config.json``)."""
    digest = hashlib.sha256()
    from pyperm.checkpoints import checkpoint_files

    for path in checkpoint_files(ckpt) + [p for p in extra if p.is_file()]:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:20]


def align_over_ranks(args: argparse.Namespace) -> int:
    """``pyperm align`` with weight matching over the ranks (see the module notes)."""
    if args.method != "weight":
        raise CommandError(f"--method {args.method}: over ranks (torchrun) only weight matching runs")
    if args.data:
        raise CommandError("--data: over ranks (torchrun) the barriers do not run; align without --data")
    init = args.init or "best"
    return on_ranks(args, lambda device: _align(args, device, init))


def on_ranks(args: argparse.Namespace, body: Callable[[Any], int]) -> int:
    """``body(device)`` of a command over ranks (align, merge): inside the process group and
    :func:`pyperm.distributed.failure_guard` (``--rank-timeout``), with ``--device cuda`` each rank on
    its own GPU (LOCAL_RANK's, or the caller's current one)."""
    from pyperm.commands._common import resolve_device
    from pyperm.distributed import failure_guard

    device = resolve_device(args.device)
    with process_group(device), failure_guard(timeout=args.rank_timeout):
        if device.type == "cuda":
            import torch

            device = torch.device("cuda", torch.cuda.current_device())
        return body(device)


@dataclass
class RankInputs:
    """What a command over ranks works on, opened by :func:`open_on_ranks` on every rank."""

    rank: int
    world: int
    loaded: Any  # the model, built on the meta device from the first checkpoint's config
    ckpts: list[Any]  # in the order given: of each, this rank's shards mapped and the others' headers
    owners: dict[str, int]  # the rank that holds each key (:func:`key_owners` of the splitting checkpoint)
    out: Path
    ckpt_files: list[Path]  # the output checkpoint's files (:func:`pyperm.commands._common.checkpoint_outputs`)
    copies: list[tuple[Path, Path]]  # (source, destination) of the folder's other files (config, tokenizer)

    @property
    def mine(self) -> list[str]:
        """The spec's keys this rank holds."""
        return [k for k in self.loaded.spec.axes if self.owners.get(k) == self.rank]


def open_on_ranks(args: argparse.Namespace, paths: Sequence[str], *, split_by: int, stem: Callable[[Any], str],
                  reports: Sequence[str], options: Sequence[Any],
                  fingerprint_names: Sequence[str] | None = None) -> RankInputs:  # fmt: skip
    """The set-up that ``align`` and ``merge`` over ranks share, on every rank (collectives inside).

    Builds ``args.model`` from ``paths[0]``; splits the keys by the shards of ``paths[split_by]``
    (:func:`key_owners`) and maps, of every checkpoint, only the shards that hold this rank's keys;
    checks each checkpoint against the first; names the outputs (the checkpoint as
    ``stem(splitting checkpoint)``, its folder's copies, then ``reports``); has every rank state the
    same checkpoints (a fingerprint of each: under ``fingerprint_names`` one fact each, else one
    list called ``inputs``) and ``options`` (:func:`pyperm.distributed.check_same`); refuses outputs
    that are inputs; and lets rank 0 prepare the output folder and remove killed writers' leftovers
    before any rank stages a file (a barrier ends it).
    """
    import torch.distributed as dist

    import pyperm.distributed as pd
    from pyperm import _staging
    from pyperm.checkpoints import DATA_PARALLEL_PREFIX, check_pair
    from pyperm.commands._checkpoint_pair import load_for_model, refuse_inputs
    from pyperm.commands._common import build_model, checkpoint_outputs, prepare_out
    from pyperm.commands._hf import folder_copies, folder_of

    rank, world = dist.get_rank(), dist.get_world_size()
    loaded = build_model(args.model, args.example_input_shape, paths[0], meta=True)
    (splitting,) = load_for_model([paths[split_by]], loaded, [lambda weight_map: _my_shards(weight_map, rank, world)])
    owners = key_owners(splitting, world)

    def holding_mine(weight_map: dict[str, str]) -> set[str]:
        return {shard for stored, shard in weight_map.items()
                if owners.get(stored, owners.get(stored.removeprefix(DATA_PARALLEL_PREFIX))) == rank}  # fmt: skip

    others = [p for i, p in enumerate(paths) if i != split_by]
    opened = iter(load_for_model(others, loaded, [holding_mine] * len(others)))
    ckpts = [splitting if i == split_by else next(opened) for i in range(len(paths))]
    for other in ckpts[1:]:
        check_pair(ckpts[0], other)
    out = Path(args.out)
    hf = args.model == "hf"
    ckpt_files = checkpoint_outputs(splitting, out, stem(splitting), args.model)
    copies = folder_copies(splitting, ckpt_files) if hf else []
    names = [str(p.relative_to(out)) for p in ckpt_files + [dst for _, dst in copies]] + list(reports)
    prints = [_fingerprint(c, [folder_of(c.path) / "config.json"] if hf else []) for c in ckpts]
    facts = dict(zip(fingerprint_names, prints, strict=True)) if fingerprint_names else {"inputs": prints}
    pd.check_same(None, **facts, options=list(options))
    refuse_inputs([out / n for n in names], ckpts)
    if rank == 0:
        prepare_out(out, names, args.force)
        # Leftovers of killed writers, by rank 0 before any rank stages (pyperm._staging removes only those
        # of its own machine and PID namespace: another node's live staging files are never touched).
        _staging.remove_leftovers(ckpt_files[0].parent)
    dist.barrier()
    return RankInputs(rank, world, loaded, ckpts, owners, out, ckpt_files, copies)


def _align(args: argparse.Namespace, device: Any, init: str) -> int:
    import torch.distributed as dist

    import pyperm.distributed as pd
    from pyperm._json import write_json
    from pyperm._memory import peak_resident
    from pyperm._staging import write_text
    from pyperm.checkpoints import LazyState
    from pyperm.commands._common import on_device
    from pyperm.commands._hf import folder_of
    from pyperm.commands.align import _markdown, align_report
    from pyperm.nn.permutations import as_permutations, permute_entry

    def permuted_stem(ckpt_b: Any) -> str:
        return (folder_of(ckpt_b.path).name if args.model == "hf" else ckpt_b.path.name.split(".")[0]) + "_permuted"

    # B's shards are split over the ranks; this rank maps its own, and of A the shards holding the same keys.
    opened = open_on_ranks(args, [args.a, args.b], split_by=1, stem=permuted_stem,
                           reports=["permutations.json", "report.json", "report.md"],
                           options=[args.model, str(Path(args.out).resolve()), args.max_iter, args.seed, init,
                                    args.force, device.type, args.example_input_shape],
                           fingerprint_names=["a", "b"])  # fmt: skip
    rank, world, loaded, out, ckpt_files = opened.rank, opened.world, opened.loaded, opened.out, opened.ckpt_files
    ckpt_a, ckpt_b = opened.ckpts
    mine = opened.mine
    result = pd.weight_matching(loaded.spec, on_device({k: ckpt_a.state[k] for k in mine}, device),
                                on_device({k: ckpt_b.state[k] for k in mine}, device),
                                max_iter=args.max_iter, seed=args.seed, init=init)  # fmt: skip
    perms = result.perms
    ckpt_a.state.clear()
    checked = as_permutations(loaded.spec, perms)
    permuted = LazyState(ckpt_b.state, lambda key, tensor: permute_entry(loaded.spec, checked, key, tensor))

    written = write_shares(ckpt_b, permuted, ckpt_files[0], rank, world, opened.copies)
    peaks = all_gather(peak_resident())
    if rank == 0:
        info = {
            "method": "weight",
            "objective_per_sweep": list(result.objective),
            "iterations": result.iterations,
            "converged": result.converged,
            "seconds": result.seconds["total"],
            "objective": result.objective[-1],
            "identity_objective": result.objective[0],
            "ranks": world,
            "bytes_per_sweep": result.bytes_per_sweep,
        }
        # No function check over ranks (it needs the whole model in one process): no output change to report.
        report = align_report(ckpt_a, ckpt_b, loaded, perms, info, ckpt_files, None, None, peaks)
        report["ranks"] = world
        write_json(out / "permutations.json", perms.to_dict())
        write_json(out / "report.json", report)
        write_text(out / "report.md", _markdown(report, None))
        where = written[0].parent if args.model == "hf" else written[0]
        print(f"B permuted into A's basin by weight matching over {world} ranks in {info['seconds']:.2f} s: {where}")
        print(f"objective vec(A).vec(pi(B)): {info['identity_objective']:.6g} -> {info['objective']:.6g}")
        # One process checks that the written B computes B's function; that needs the whole model in one
        # process, so over ranks it is not run, and the user is told rather than left to assume it was.
        print("not checked over ranks: that permuted B computes B's function (run pyperm align in one process "
              "for that check)")
        print(f"report: {out / 'report.md'}")
    dist.barrier()
    return 0


def write_shares(ckpt: Any, state: Any, path: Path, rank: int, world: int,
                 copies: list[tuple[Path, Path]] = ()) -> list[Path]:  # fmt: skip
    """Write ``state`` (laid out as ``ckpt``) to ``path`` from every rank: each rank stages its own shards
    (:func:`key_owners`), and rank 0 stages the ``copies`` (config, tokenizer) and renames every staged file
    into place once all are staged, the copies just before the index (or the one file): no write is left
    once the new weights are in place. A one-file checkpoint is written by rank 0, which must then be able
    to read every tensor of ``state``. Returns the written files on rank 0 (an empty list elsewhere)."""
    import torch.distributed as dist

    from pyperm import _staging
    from pyperm.checkpoints._write import commit_sharded, stage_copies, stage_file, stage_index, stage_shards

    written: list[Path] = []
    with _staging.staged_files() as staged:
        if ckpt.format == "sharded":
            staged += stage_shards(ckpt, state, path, _my_shards(ckpt.weight_map, rank, world))
        elif rank == 0:
            staged.append(stage_file(ckpt, state, path))
        every = [(Path(t), Path(f)) for part in all_gather([(str(s.tmp), str(s.final)) for s in staged])
                 for t, f in part]  # fmt: skip
        if rank == 0:
            theirs = [_staging.Staged(t, f) for t, f in every if t not in {s.tmp for s in staged}]
            staged += theirs  # discarded by rank 0 too if the index cannot be staged
            copied = stage_copies(copies)
            staged += copied
            if ckpt.format == "sharded":
                staged.append(stage_index(ckpt, state, path))
                written = commit_sharded(ckpt, path, [_staging.Staged(t, f) for t, f in every] + copied + [staged[-1]])
            else:
                for file in [*copied, staged[0]]:  # the copies, then the one file: the switch
                    file.commit()
                _staging.fsync_folder(path.parent)
                written = [path]
            written += [Path(dst) for _, dst in copies]
        # Past the barrier rank 0 owns every staged file: the others' are no longer theirs to remove.
        dist.barrier()
        staged.clear()
    return written


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (a collective of the world)."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every
