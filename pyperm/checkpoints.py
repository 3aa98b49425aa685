"""Read and write model checkpoints in the formats people have on disk (needs torch).

Three layouts are understood, each written back in its own layout:

- ``torch``: a ``.pt``/``.pth``/``.bin``/``.ckpt`` file from :func:`torch.save` holding a state dict,
  possibly wrapped in a dict under ``"state_dict"`` or ``"model"`` (training scripts and
  Lightning save that way), possibly with every key prefixed ``"module."``
  (``DataParallel``). Read with ``weights_only=True``: a checkpoint cannot run code.
- ``safetensors``: one ``.safetensors`` file (its string metadata is kept).
- ``sharded``: an index json (``*.safetensors.index.json`` or ``*.bin.index.json``) whose
  ``weight_map`` names the shard of every key; a directory holding exactly one index
  json (or exactly one checkpoint file) is read as that file.

Every problem is raised as :class:`CheckpointError` (a ValueError) with a message naming
the file and, where there is one, the key.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "check_against_model",
    "check_pair",
    "count_parameters",
    "default_name",
    "load_checkpoint",
    "output_paths",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
WRAPPER_KEYS = ("state_dict", "model")
DATA_PARALLEL_PREFIX = "module."


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, written, or used with the model it was given for."""


@dataclass
class Checkpoint:
    """A loaded state dict and what is needed to write a changed one back in the same layout.

    Attributes
    ----------
    state : dict of str to torch.Tensor
        The state dict, on the CPU, keys as the model names them (any ``"module."``
        prefix removed).
    path : pathlib.Path
        The file read (the index json of a sharded checkpoint).
    format : {"torch", "safetensors", "sharded"}
        The layout.
    wrapper_key : str or None
        ``"state_dict"`` or ``"model"`` when the torch file wrapped the state dict.
    dropped : list of str
        Other entries of the wrapping dict (optimizer state, epoch, ...); they are not
        written back, since they describe the unpermuted model.
    prefix : str
        ``"module."`` when every key had it, else ``""``; restored on writing.
    metadata : dict of str to str
        The safetensors header metadata, or the index json's ``"metadata"``.
    weight_map : dict of str to str
        For a sharded checkpoint: the shard file name of every key (prefix included).
    tied : dict of str to str
        Keys the model ties to another key (a language model's output layer and its
        token embedding) that the file leaves out: filled in ``state`` from that key for
        the model, and left out again on writing (:func:`save_checkpoint`).
    """

    state: dict[str, torch.Tensor]
    path: Path
    format: str
    wrapper_key: str | None = None
    dropped: list[str] = field(default_factory=list)
    prefix: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_map: dict[str, str] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------------------ reading


def _resolve(path: Path) -> Path:
    """The file to read for ``path``: itself, or the one index json / checkpoint in a directory."""
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


def _load_torch_file(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file (UnpicklingError, RuntimeError, EOFError)
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({_one_line(exc)})") from exc


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise CheckpointError(
            "reading .safetensors files needs the safetensors package: pip install safetensors"
        ) from exc
    return safetensors


def _load_safetensors_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    safetensors = _safetensors()
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (a safe_open handle is not a dict)
    except Exception as exc:  # SafetensorError, OSError, and header errors of several types
        raise CheckpointError(f"{path}: not a readable safetensors file ({_one_line(exc)})") from exc
    return state, metadata


def _load_sharded(path: Path) -> Checkpoint:
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable index json ({_one_line(exc)})") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path}: key 'weight_map' is missing or empty")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or Path(shard).name != shard:
            # A shard name with folders could point outside the checkpoint's directory.
            raise CheckpointError(f"{path}: shard name {shard!r} in 'weight_map' is not a plain file name")
        shard_path = path.parent / shard
        if not shard_path.exists():
            raise CheckpointError(f"{shard_path}: shard named in {path.name} does not exist")
        if shard.endswith(".safetensors"):
            tensors, _ = _load_safetensors_file(shard_path)
        else:
            tensors = dict(_check_tensors(_unwrap(_load_torch_file(shard_path), shard_path)[0], shard_path))
        for key, value in tensors.items():
            if weight_map.get(key) != shard:
                raise CheckpointError(f"{shard_path}: key {key!r} is not mapped to this shard in {path.name}")
            state[key] = value
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise CheckpointError(f"{path}: key {missing[0]!r} is in 'weight_map' but in none of the shards")
    metadata = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
    return Checkpoint(
        state=_check_tensors(state, path), path=path, format="sharded", metadata=metadata, weight_map=dict(weight_map)
    )


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint: a torch file, a safetensors file, a sharded index json, or a directory of one.

    Parameters
    ----------
    path : str or pathlib.Path
        The file (or a directory holding exactly one index json or checkpoint file).

    Returns
    -------
    Checkpoint
        The state dict (CPU tensors) and its layout.

    Raises
    ------
    CheckpointError
        The file is missing, unreadable, corrupt, or holds something other than a state
        dict; the message names the file and the key.
    """
    path = _resolve(Path(path))
    name = path.name
    if name.endswith(".index.json"):
        ckpt = _load_sharded(path)
    elif path.suffix == ".safetensors":
        state, metadata = _load_safetensors_file(path)
        ckpt = Checkpoint(state=_check_tensors(state, path), path=path, format="safetensors", metadata=metadata)
    elif path.suffix in TORCH_SUFFIXES:
        state, wrapper, dropped = _unwrap(_load_torch_file(path), path)
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


# ------------------------------------------------------------------------------ checks


def check_against_model(ckpt: Checkpoint, model_state: Mapping[str, torch.Tensor], model_name: str) -> None:
    """Raise unless the checkpoint has exactly the model's keys and shapes, with finite floats.

    Parameters
    ----------
    ckpt : Checkpoint
        The loaded checkpoint.
    model_state : mapping of str to torch.Tensor
        The model's own ``state_dict()``.
    model_name : str
        How the model was named (``--model``), for the message.

    Raises
    ------
    CheckpointError
        A key is missing or extra, a shape differs, or a float tensor has NaN or inf.

    Notes
    -----
    When every key of the checkpoint carries one extra leading component that the model's
    keys lack (Lightning saves ``model.`` + the module's keys), it is removed from
    ``ckpt.state`` and added to ``ckpt.prefix``, so it is written back on saving.
    """
    _strip_wrapping_module(ckpt, model_state)
    missing = [k for k in model_state if k not in ckpt.state]
    if missing:
        raise CheckpointError(
            f"{ckpt.path}: key {missing[0]!r} of model {model_name} is missing ({len(missing)} keys missing): wrong model?"
        )
    extra = [k for k in ckpt.state if k not in model_state]
    if extra:
        raise CheckpointError(
            f"{ckpt.path}: key {extra[0]!r} is not in model {model_name} ({len(extra)} extra keys): wrong model?"
        )
    for key, ref in model_state.items():
        value = ckpt.state[key]
        if tuple(value.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{ckpt.path}: key {key!r} has shape {tuple(value.shape)}, model {model_name} expects {tuple(ref.shape)}: wrong model?"
            )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{ckpt.path}: key {key!r} holds NaN or inf")


def _strip_wrapping_module(ckpt: Checkpoint, model_state: Mapping[str, torch.Tensor]) -> None:
    """Drop a leading ``"name."`` shared by all keys when what remains is exactly the model's keys."""
    if set(ckpt.state) == set(model_state):
        return
    heads = {k.split(".", 1)[0] for k in ckpt.state}
    if len(heads) != 1 or not all("." in k for k in ckpt.state):
        return
    head = heads.pop() + "."
    stripped = {k[len(head) :]: v for k, v in ckpt.state.items()}
    if set(stripped) == set(model_state):
        ckpt.state = stripped
        ckpt.prefix += head


def check_pair(first: Checkpoint, second: Checkpoint) -> None:
    """Raise unless two checkpoints have the same keys, shapes and dtypes (naming both files and the key)."""
    for key in first.state:
        if key not in second.state:
            raise CheckpointError(f"{second.path}: key {key!r} of {first.path} is missing")
    for key, a in first.state.items():
        b = second.state[key]
        if a.shape != b.shape:
            raise CheckpointError(
                f"{second.path}: key {key!r} has shape {tuple(b.shape)}, {first.path} has {tuple(a.shape)}"
            )
        if a.dtype != b.dtype:
            raise CheckpointError(f"{second.path}: key {key!r} has dtype {b.dtype}, {first.path} has {a.dtype}")
    extra = [k for k in second.state if k not in first.state]
    if extra:
        raise CheckpointError(f"{second.path}: key {extra[0]!r} is not in {first.path}")


# ------------------------------------------------------------------------------ writing


def output_paths(like: Checkpoint, path: str | Path) -> list[Path]:
    """The files :func:`save_checkpoint` would write for ``like``'s layout at ``path``.

    For a sharded checkpoint ``path`` is the new index json; the shards keep their names
    and go beside it.
    """
    path = Path(path)
    if like.format != "sharded":
        return [path]
    return [path] + [path.parent / shard for shard in sorted(set(like.weight_map.values()))]


def save_checkpoint(
    like: Checkpoint, state: Mapping[str, torch.Tensor], path: str | Path, *, force: bool = False
) -> list[Path]:
    """Write ``state`` at ``path`` in the layout of ``like`` (wrapper key, prefix, metadata, shards).

    Parameters
    ----------
    like : Checkpoint
        The checkpoint whose layout to reproduce.
    state : mapping of str to torch.Tensor
        The state dict to write; the same keys as ``like.state``.
    path : str or pathlib.Path
        The file (the index json for a sharded checkpoint); its folder must exist.
    force : bool, default False
        Overwrite existing files; without it an existing file is an error and nothing
        is written.

    Returns
    -------
    list of pathlib.Path
        The files written.

    Raises
    ------
    CheckpointError
        A file exists and ``force`` is False, or ``state`` lacks a key of ``like``.
    """
    targets = output_paths(like, path)
    if not force:
        for target in targets:
            if target.exists():
                raise CheckpointError(f"{target}: exists; pass --force to overwrite it")
    missing = [k for k in like.state if k not in state and k not in like.tied]
    if missing:
        raise CheckpointError(f"{targets[0]}: key {missing[0]!r} missing from the state to write")
    keys = [k for k in like.state if k not in like.tied]
    staged: list[tuple[Path, Path]] = []  # (partial file, final name): renamed only once all are written
    try:
        if like.format == "sharded":
            for shard in sorted(set(like.weight_map.values())):
                part = _contiguous(like, state, [k for k in keys if like.weight_map[like.prefix + k] == shard])
                staged.append(_stage(targets[0].parent / shard, lambda tmp, p=part, s=shard: _write_file(p, tmp, s)))
            total = sum(state[k].numel() * state[k].element_size() for k in keys)
            index = {"metadata": {**like.metadata, "total_size": total}, "weight_map": dict(like.weight_map)}
            staged.append(_stage(targets[0], lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n")))
        elif like.format == "torch":
            full = _contiguous(like, state, keys)
            obj = full if like.wrapper_key is None else {like.wrapper_key: full}
            staged.append(_stage(targets[0], lambda tmp: torch.save(obj, tmp)))
        else:
            full = _contiguous(like, state, keys)
            metadata = {str(k): str(v) for k, v in like.metadata.items()} or None
            staged.append(_stage(targets[0], lambda tmp: _safetensors().torch.save_file(full, str(tmp), metadata)))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in staged:  # the index last: a reader never sees it before its shards
        os.replace(tmp, final)
    return targets


def _contiguous(like: Checkpoint, state: Mapping[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies under the stored names (safetensors refuses views, and a torch file of views
    stores their storages whole); one shard's at a time, so a sharded write holds one shard's copies."""
    return {like.prefix + k: state[k].detach().cpu().contiguous() for k in keys}


def _write_file(tensors: dict[str, torch.Tensor], path: Path, name: str) -> None:
    if name.endswith(".safetensors"):
        _safetensors().torch.save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def _stage(final: Path, write: Any) -> tuple[Path, Path]:
    """Write ``final``'s content to a hidden partial file beside it (never a partial file under the final
    name, even if the process dies mid-write); returns (partial file, final name)."""
    tmp = final.with_name(f".{final.name}.partial")
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, final


def default_name(like: Checkpoint, stem: str) -> str:
    """A file name for a checkpoint of ``like``'s layout: ``stem`` plus the input's own suffix."""
    if like.format == "sharded":
        name = like.path.name
        return stem + name[name.index(".") :] if "." in name else stem + ".index.json"
    return stem + like.path.suffix


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def count_parameters(state: Mapping[str, torch.Tensor]) -> int:
    """Numbers held by the floating tensors of ``state`` (for reports)."""
    return int(sum(math.prod(v.shape) for v in state.values() if v.is_floating_point()))
