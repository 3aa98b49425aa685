"""Writing a checkpoint in the layout of the one it came from, so that no instant shows a partial result.

Every file is staged beside its destination (:mod:`pyperm._staging`: created exclusively, never
through a symlink, fsynced) and renamed into place. A single file is replaced atomically. A
sharded checkpoint is a set of files, so it is replaced in an order that keeps the old set valid
until the new one is complete: the new shards are staged and moved to names the old index does
not use, then the new index replaces the old one in one rename (the switch), and only then are
the old shards removed. A kill before the switch leaves the old checkpoint; after it, the new
one (with, for a kill during the clean-up, old shards no index names: the next forced write to
that index replaces them).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from pyperm import _staging
from pyperm.checkpoints._read import read_index
from pyperm.checkpoints._safetensors import write_safetensors
from pyperm.checkpoints._types import Checkpoint, CheckpointError, like

__all__ = ["checkpoint_files", "commit_sharded", "default_name", "output_paths", "save_checkpoint", "stage_file",
           "stage_index", "stage_shards"]


def _old_shards(index: Path) -> set[str]:
    """The shard names of the index json now at ``index`` (a regular file that reads), else none."""
    if not index.is_file() or index.is_symlink():
        return set()
    try:
        return set(read_index(index)[0].values())
    except CheckpointError:  # not a valid checkpoint: nothing of it to keep valid
        return set()


def _shard_names(like_: Checkpoint, index: Path) -> dict[str, str]:
    """The output name of each of ``like_``'s shards when written beside ``index``.

    The input's names, unless the index now at ``index`` (or the input itself, in the same
    folder) uses one of them: then the first free generation ``<stem>.<g><suffix>``, so that the
    old shards stay untouched until the new index names the new ones.
    """
    busy = _old_shards(index)
    if like_.path.parent.resolve() == index.parent.resolve():
        busy |= set(like_.weight_map.values())  # never write over the input's own shards
    shards = sorted(set(like_.weight_map.values()))
    for generation in range(len(busy) + 1):  # each name is busy in at most one generation
        names = {s: _generation(s, generation) for s in shards}
        if not busy & set(names.values()):
            return names
    raise AssertionError("unreachable: one of len(busy) + 1 generations is free")


def _generation(shard: str, generation: int) -> str:
    """``model-00001-of-00002.safetensors`` in generation 2: ``model-00001-of-00002.2.safetensors``."""
    if generation == 0:
        return shard
    suffix = Path(shard).suffix  # a checkpoint suffix: read_index checks every shard name has one
    return f"{shard[: len(shard) - len(suffix)]}.{generation}{suffix}"


def checkpoint_files(ckpt: Checkpoint) -> list[Path]:
    """The files a loaded checkpoint consists of: its file, or its index json and the shards it names."""
    return [ckpt.path] + [ckpt.path.parent / name for name in sorted(set(ckpt.weight_map.values()))]


def output_paths(like_: Checkpoint, path: str | Path) -> list[Path]:
    """The files :func:`save_checkpoint` would write for ``like_``'s layout at ``path`` now.

    For a sharded checkpoint ``path`` is the new index json; the shards go beside it, under the
    input's names (or, when an index already at ``path`` uses those, a new generation of them).
    """
    path = Path(path)
    if like_.format != "sharded":
        return [path]
    return [path] + [path.parent / name for name in sorted(_shard_names(like_, path).values())]


def save_checkpoint(
    like: Checkpoint,
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    force: bool = False,
    copies: Sequence[tuple[str | Path, str | Path]] = (),
) -> list[Path]:
    """Write ``state`` at ``path`` in the layout of ``like`` (wrapper key, prefix, metadata, shards).

    Safetensors files (one, or each shard) are written tensor by tensor: each tensor of
    ``state`` is asked for, written and let go before the next, so a :class:`LazyState`
    (tensors computed on demand) is never whole in memory. A torch file (or torch shard)
    is one :func:`torch.save`, so its tensors exist together while it is written.

    Parameters
    ----------
    like : Checkpoint
        The checkpoint whose layout to reproduce.
    state : mapping of str to torch.Tensor
        The state dict to write (a dict, or a :class:`LazyState`); the same keys as
        ``like.state``, each tensor with its key's shape.
    path : str or pathlib.Path
        The file (the index json for a sharded checkpoint); its folder must exist.
    force : bool, default False
        Replace existing files (a symlink at an output name is replaced itself, never
        written through); without it an existing name is an error and nothing is written.
    copies : sequence of (source, destination) pairs, optional
        Files to copy beside the checkpoint (a Hugging Face folder's config and tokenizer):
        staged with the weights and renamed into place just before the switch to the new
        weights, so that no write is left to do once the new weights are in place.

    Returns
    -------
    list of pathlib.Path
        The files written (the index json first for a sharded checkpoint), then the copies'
        destinations.

    Raises
    ------
    CheckpointError
        A file exists and ``force`` is False, ``state`` lacks a key of ``like``, or a
        computed tensor does not have its key's shape and dtype.

    Notes
    -----
    At every instant ``path`` holds the complete old checkpoint or the complete new one, even
    if the process is killed: each file is staged under a hidden name beside its final one
    (created exclusively, never through a symlink, fsynced) and renamed into place; the shards
    of a sharded checkpoint take names the old index does not use, the index is renamed last,
    and the old shards are removed after it. A write that fails removes its staging files; a
    killed one can leave hidden ``.*.pyperm-partial`` files, which the next write into the
    folder removes.
    """
    path = Path(path)
    targets = output_paths(like, path)
    if not force:
        for target in targets:
            if os.path.lexists(target):  # a dangling symlink is an existing name too
                raise CheckpointError(f"{target}: exists; pass --force to overwrite it")
    missing = [k for k in like.state if k not in state and k not in like.tied]
    if missing:
        raise CheckpointError(f"{path}: key {missing[0]!r} missing from the state to write")
    keys = [k for k in like.state if k not in like.tied]
    _staging.remove_leftovers(path.parent)
    with _staging.staged_files() as staged:
        staged += stage_copies(copies)
        if like.format == "sharded":
            staged[:0] = stage_shards(like, state, path)  # the shards (free names), the copies, the index: the switch
            staged.append(stage_index(like, state, path))
            return commit_sharded(like, path, staged) + [Path(dst) for _, dst in copies]
        staged.append(stage_file(like, state, path))
        for file in staged:  # the copies, then the checkpoint's one file: the switch
            file.commit()
        _staging.fsync_folder(path.parent)
    return [path] + [Path(dst) for _, dst in copies]


def stage_copies(copies: Sequence[tuple[str | Path, str | Path]]) -> list[_staging.Staged]:
    """Stage a copy of every (source, destination) pair beside its destination (not renamed into place)."""
    with _staging.staged_files() as staged:
        for src, dst in copies:
            with open(src, "rb") as source:
                staged.append(_staging.stage(Path(dst), lambda f, s=source: shutil.copyfileobj(s, f)))
    return staged


def stage_file(like_: Checkpoint, state: Mapping[str, torch.Tensor], path: Path) -> _staging.Staged:
    """Stage the one file of ``like_``'s single-file layout (torch or safetensors) at ``path``."""
    keys = _keys(like_)
    if like_.format == "torch":
        full = _compact(like_, state, keys)
        obj = full if like_.wrapper_key is None else {like_.wrapper_key: full}
        return _staging.stage(path, lambda f: torch.save(obj, f))
    metadata = {str(k): str(v) for k, v in like_.metadata.items()}
    names = {like_.prefix + k: k for k in keys}
    return _staging.stage(path, lambda f: write_safetensors(f, names, state, metadata, path))


def _keys(like_: Checkpoint) -> list[str]:
    return [k for k in like_.state if k not in like_.tied]


def stage_shards(like_: Checkpoint, state: Mapping[str, torch.Tensor], path: Path,
                 shards: list[str] | None = None) -> list[_staging.Staged]:
    """Stage (write under hidden names, fsync; not rename) the shards ``shards`` of ``like_``'s sharded layout
    (default: all) for the index at ``path``; if one fails, those staged are removed and the error propagates.

    With :func:`stage_index` and :func:`commit_sharded`, the pieces of :func:`save_checkpoint` for a writer
    that stages its shards in several processes (``pyperm.commands._over_ranks``)."""
    folder, keys = path.parent, _keys(like_)
    names = _shard_names(like_, path)
    with _staging.staged_files() as staged:
        for shard, name in names.items():
            if shards is not None and shard not in shards:
                continue
            part = [k for k in keys if like_.weight_map[like_.prefix + k] == shard]
            staged.append(_staging.stage(folder / name, lambda f, p=part, n=name: _write_shard(like_, state, p, f, folder / n)))
    return staged


def stage_index(like_: Checkpoint, state: Mapping[str, torch.Tensor], path: Path) -> _staging.Staged:
    """Stage the index json of ``like_``'s sharded layout at ``path`` (shapes and dtypes of ``state`` only: a
    lazy state computes nothing)."""
    names = _shard_names(like_, path)
    total = sum(like(state, k).numel() * like(state, k).element_size() for k in _keys(like_))
    weight_map = {key: names[shard] for key, shard in like_.weight_map.items()}
    index = {"metadata": {**like_.metadata, "total_size": total}, "weight_map": weight_map}
    text = (json.dumps(index, indent=2) + "\n").encode()
    return _staging.stage(path, lambda f: f.write(text))


def commit_sharded(like_: Checkpoint, path: Path, staged: list[_staging.Staged]) -> list[Path]:
    """Rename the staged files into place in their order (the shards under free names, any copies beside the
    checkpoint), the index last (the switch from the old checkpoint to the new one), then remove the old
    shards no index names; ``staged`` ends with the index."""
    folder = path.parent
    old = _old_shards(path)
    names = _shard_names(like_, path)
    for file in staged:  # the shards (free names), then the index: the switch from old to new
        file.commit()
    _staging.fsync_folder(folder)
    for name in sorted(old - set(names.values())):  # no index names them any more
        _staging.remove(folder / name)
    _staging.fsync_folder(folder)
    return [path] + [folder / name for name in sorted(names.values())]


def _compact(like_: Checkpoint, state: Mapping[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``keys`` under their stored names for :func:`torch.save`, each owning exactly its bytes
    (a torch file of views stores their storages whole: a mapped safetensors file would be saved whole for
    each of its tensors); one file's (one shard's) at a time."""
    out = {}
    for k in keys:
        t = state[k].detach().cpu()
        exact = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
        out[like_.prefix + k] = t if exact else t.clone(memory_format=torch.contiguous_format)
    return out


def _write_shard(like_: Checkpoint, state: Mapping[str, torch.Tensor], keys: list[str], f: BinaryIO, path: Path) -> None:
    """One shard: a safetensors file tensor by tensor, or a torch file of the shard's tensors."""
    if path.name.endswith(".safetensors"):
        write_safetensors(f, {like_.prefix + k: k for k in keys}, state, {"format": "pt"}, path)
    else:
        torch.save(_compact(like_, state, keys), f)


def default_name(like_: Checkpoint, stem: str) -> str:
    """A file name for a checkpoint of ``like_``'s layout: ``stem`` plus the input's own suffix."""
    if like_.format == "sharded":
        name = like_.path.name
        return stem + name[name.index(".") :] if "." in name else stem + ".index.json"
    return stem + like_.path.suffix
