"""Reading a checkpoint: a torch file, a safetensors file, a sharded index json, or a folder of one."""

from __future__ import annotations

import json
import mmap as _mmap
import sys
import zipfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from pyperm.checkpoints._safetensors import check_regular_file, read_safetensors, read_safetensors_meta
from pyperm.checkpoints._types import Checkpoint, CheckpointError, one_line

__all__ = ["DATA_PARALLEL_PREFIX", "INDEX_BYTES_MAX", "TORCH_SUFFIXES", "load_checkpoint", "read_index"]

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
WRAPPER_KEYS = ("state_dict", "model")
DATA_PARALLEL_PREFIX = "module."
# An index json larger than this is refused unread: the cap the safetensors library puts on a header
# (an index of a model with a million tensors is about 100 MB too).
INDEX_BYTES_MAX = 100_000_000


def _resolve(path: Path) -> Path:
    """The file to read for ``path``: itself, or the one index json / checkpoint in a folder."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.is_dir():
        return path
    indexes = sorted(path.glob("*.index.json"))
    if len(indexes) == 1:
        return indexes[0]
    if len(indexes) > 1:
        raise CheckpointError(f"{path}: holds {len(indexes)} index files; name one of them")
    files = sorted(p for p in path.iterdir() if p.suffix in TORCH_SUFFIXES + (".safetensors",))
    if len(files) != 1:
        raise CheckpointError(
            f"{path}: a directory must hold one index json or one checkpoint file, found {len(files)} checkpoint files"
        )
    return files[0]


def _check_tensors(state: Mapping[Any, Any], path: Path) -> dict[str, torch.Tensor]:
    """``state`` as a dict of str to CPU tensors; names the first key that is not one."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{path}: key {key!r} is not a string")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: key {key!r} holds a {type(value).__name__}, not a tensor")
        out[key] = value
    if not out:
        raise CheckpointError(f"{path}: holds no tensors")
    return out


def _unwrap(obj: Any, path: Path) -> tuple[Mapping[Any, Any], str | None, list[str]]:
    """The state dict inside a torch checkpoint, the key it was wrapped under and the other keys."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict (a dict of tensors)")
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj, None, []
    for key in WRAPPER_KEYS:
        inner = obj.get(key)
        if isinstance(inner, Mapping):
            return inner, key, sorted(str(k) for k in obj if k != key)
    # Not wrapped: report the first entry that is not a tensor.
    bad = next(k for k, v in obj.items() if not isinstance(v, torch.Tensor))
    raise CheckpointError(
        f"{path}: key {bad!r} holds a {type(obj[bad]).__name__}, and no 'state_dict' or 'model' entry holds a state dict"
    )


def _load_torch_file(path: Path, mmap: bool) -> Any:
    """``torch.load`` of ``path`` (``weights_only``), memory-mapped when asked and the file allows it."""
    check_regular_file(path)
    try:
        # torch.load maps only files of the zip format (every torch.save since 1.6); an older file is read whole.
        mapped = mmap and zipfile.is_zipfile(path)
        if not mapped:
            return torch.load(path, map_location="cpu", weights_only=True)
        if sys.platform == "win32" or torch.serialization.get_default_mmap_options() == _mmap.MAP_PRIVATE:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        # Someone set shared mappings as torch's default: writing into a tensor would write the file.
        with torch.serialization.set_default_mmap_options(_mmap.MAP_PRIVATE):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a bad file (UnpicklingError, RuntimeError, EOFError)
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({one_line(exc)})") from exc


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that refuses a repeated key (``json`` would keep the last one silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def read_index(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The ``weight_map`` and ``metadata`` of the index json ``path``, every entry checked.

    Every problem is a :class:`CheckpointError` naming the file (and the key): a file over
    :data:`INDEX_BYTES_MAX`, JSON that does not parse (deep nesting and huge numbers included),
    a ``weight_map`` that is not an object of plain file names of checkpoint files.
    """
    check_regular_file(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(INDEX_BYTES_MAX + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({one_line(exc)})") from exc
    if len(raw) > INDEX_BYTES_MAX:
        raise CheckpointError(f"{path}: an index json over {INDEX_BYTES_MAX} bytes is refused")
    try:
        index = json.loads(raw, object_pairs_hook=_object)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, a 5000-digit number
        raise CheckpointError(f"{path}: not a readable index json ({one_line(exc)})") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path}: key 'weight_map' is missing or empty")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
            # A shard name with folders could point outside the checkpoint's folder.
            raise CheckpointError(f"{path}: key {key!r}: shard name {shard!r} in 'weight_map' is not a plain file name")
        if not shard.endswith(TORCH_SUFFIXES + (".safetensors",)):
            raise CheckpointError(f"{path}: key {key!r}: shard {shard!r} is not a checkpoint file")
    metadata = index.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: key 'metadata' is a {type(metadata).__name__}, not an object")
    return weight_map, metadata


def _load_sharded(path: Path, mmap: bool, shards: Callable[[dict[str, str]], Collection[str]] | None) -> Checkpoint:
    weight_map, metadata = read_index(path)
    state: dict[str, torch.Tensor] = {}
    wanted = None if shards is None else set(shards(dict(weight_map)))
    for shard in sorted(set(weight_map.values())):
        shard_path = path.parent / shard
        if not shard_path.exists():
            raise CheckpointError(f"{shard_path}: shard named in {path.name} does not exist")
        if wanted is not None and shard not in wanted and shard.endswith(".safetensors"):
            tensors = read_safetensors_meta(shard_path)  # another rank's: shapes and dtypes only
        elif shard.endswith(".safetensors"):
            tensors, _ = read_safetensors(shard_path, mmap=mmap)
        else:
            tensors = _check_tensors(_unwrap(_load_torch_file(shard_path, mmap), shard_path)[0], shard_path)
        for key, value in tensors.items():
            if weight_map.get(key) != shard:
                raise CheckpointError(f"{shard_path}: key {key!r} is not mapped to this shard in {path.name}")
            state[key] = value
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise CheckpointError(f"{path}: key {missing[0]!r} is in 'weight_map' but in none of the shards")
    return Checkpoint(
        state=_check_tensors(state, path), path=path, format="sharded", metadata=metadata, weight_map=dict(weight_map)
    )


def load_checkpoint(
    path: str | Path, *, mmap: bool = True, shards: Callable[[dict[str, str]], Collection[str]] | None = None
) -> Checkpoint:
    """Read a checkpoint: a torch file, a safetensors file, a sharded index json, or a directory of one.

    Parameters
    ----------
    path : str or pathlib.Path
        The file (or a directory holding exactly one index json or checkpoint file).
    mmap : bool, default True
        Map the files rather than read them: every tensor is a view of a private
        (copy-on-write) memory map of its file, read from disk when first used, so a
        checkpoint larger than memory can be loaded and the file is never changed (writing
        into a tensor changes this process's copy only). Safetensors files are mapped by
        the safetensors library (``safe_open``), torch files by ``torch.load(mmap=True)``
        (files of torch's zip format, every ``torch.save`` since torch 1.6; an older file is
        read whole). ``False`` reads every tensor into memory: one copy, no mapping kept.
    shards : callable, optional
        For a sharded checkpoint: given the index's weight map (stored key to shard name),
        the shards to map. The tensors of the other safetensors shards are meta tensors
        (shape and dtype from their headers; no data mapped): one rank's share of a
        checkpoint split over ranks. Shards in torch's format are always mapped.

    Returns
    -------
    Checkpoint
        The state dict (CPU tensors) and its layout.

    Raises
    ------
    CheckpointError
        The file is missing, unreadable, corrupt, hostile (a header over 100 MB, duplicate
        keys, overlapping tensors, impossible shapes or offsets, unknown dtypes), or holds
        something other than a state dict; the message names the file and the key.
    """
    path = _resolve(Path(path))
    if path.name.endswith(".index.json"):
        ckpt = _load_sharded(path, mmap, shards)
    elif path.suffix == ".safetensors":
        state, metadata = read_safetensors(path, mmap=mmap)
        ckpt = Checkpoint(state=_check_tensors(state, path), path=path, format="safetensors", metadata=metadata)
    elif path.suffix in TORCH_SUFFIXES:
        state, wrapper, dropped = _unwrap(_load_torch_file(path, mmap), path)
        ckpt = Checkpoint(
            state=_check_tensors(state, path), path=path, format="torch", wrapper_key=wrapper, dropped=dropped
        )
    else:
        raise CheckpointError(
            f"{path}: unknown checkpoint type {path.suffix!r} (expected {', '.join(TORCH_SUFFIXES)}, .safetensors or an index json)"
        )
    if all(k.startswith(DATA_PARALLEL_PREFIX) for k in ckpt.state):
        ckpt.prefix = DATA_PARALLEL_PREFIX
        ckpt.state = {k[len(DATA_PARALLEL_PREFIX) :]: v for k, v in ckpt.state.items()}
    return ckpt
