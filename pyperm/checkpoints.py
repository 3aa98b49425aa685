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

Reading maps the files instead of reading them (``load_checkpoint(..., mmap=True)``, the
default): a safetensors file's header is parsed here and every tensor is a view of a private,
copy-on-write mapping of the file, and a torch file is loaded with ``torch.load(mmap=True)``
(same mapping). The tensors' bytes are read from disk when first used, live in the page cache
(the kernel can drop them again), and writing into a tensor changes the process's copy only:
the user's file is never modified. A file truncated or rewritten in place by another process
while it is mapped makes reading the mapped tensors fail (SIGBUS), as for any memory map;
pyperm itself never writes over a file, it writes beside it and renames.

Writing is streamed: a safetensors file (one, or each shard) is written tensor by tensor by
this module's own writer, so a state computed on demand (:class:`LazyState`: a permuted or
merged model) never exists whole in memory; a torch file is one ``torch.save`` per file (per
shard), so its tensors exist together while that file is written. Every file is first written
under a hidden partial name beside its final one and renamed only once all files (the shards
and then the index) are complete: a failed or killed write never leaves a partial file under a
final name.

Every problem is raised as :class:`CheckpointError` (a ValueError) with a message naming
the file and, where there is one, the key.
"""

from __future__ import annotations

import json
import logging
import math
import mmap as _mmap
import os
import sys
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "LazyState",
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

# The safetensors dtype names (the format's spec) and the torch dtypes they stand for; a name whose
# torch dtype this torch lacks is left out, and a file using it is refused by name. "F4" (two
# float4 values packed per byte, its shape counting values) has no unpacked torch dtype and is
# refused too.
_SAFETENSORS_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
        "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
    }.items()  # fmt: skip
    if hasattr(torch, attr)
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


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


class LazyState(Mapping):
    """A state dict whose tensors are computed when asked for, one at a time, and not kept.

    :func:`save_checkpoint` writes such a state tensor by tensor (shard by shard for a torch
    shard), so a permuted or merged model never exists whole beside its inputs.

    Parameters
    ----------
    template : mapping of str to torch.Tensor
        The keys, and each tensor's shape and dtype (which the computed tensor must have):
        usually the state the values are computed from.
    compute : callable
        ``compute(key, template[key])`` returns the tensor of ``key``.

    Examples
    --------
    >>> import torch
    >>> lazy = LazyState({"w": torch.ones(2)}, lambda key, t: -t)
    >>> list(lazy), lazy["w"].tolist()
    (['w'], [-1.0, -1.0])
    """

    def __init__(
        self, template: Mapping[str, torch.Tensor], compute: Callable[[str, torch.Tensor], torch.Tensor]
    ) -> None:
        self.template = template
        self.compute = compute

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.compute(key, self.template[key])

    def __contains__(self, key: object) -> bool:  # without computing the tensor
        return key in self.template

    def __iter__(self) -> Iterator[str]:
        return iter(self.template)

    def __len__(self) -> int:
        return len(self.template)


def _like(state: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    """A tensor with the shape and dtype ``state[key]`` has, without computing a lazy one."""
    return state.template[key] if isinstance(state, LazyState) else state[key]


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


def _load_torch_file(path: Path, mmap: bool) -> Any:
    """``torch.load`` of ``path`` (``weights_only``), memory-mapped when asked and the file allows it."""
    # torch.load maps only files of the zip format (every torch.save since 1.6); an older file is read whole.
    mapped = mmap and zipfile.is_zipfile(path)
    try:
        if not mapped:
            return torch.load(path, map_location="cpu", weights_only=True)
        if sys.platform == "win32" or torch.serialization.get_default_mmap_options() == _mmap.MAP_PRIVATE:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        # Someone set shared mappings as torch's default: writing into a tensor would write the file.
        with torch.serialization.set_default_mmap_options(_mmap.MAP_PRIVATE):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
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


def _safetensors_header(path: Path, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """The tensor entries, the metadata and the offset of the data of the safetensors file ``path``.

    The format: 8 bytes holding the header's length (little-endian), the header (JSON: per tensor
    its dtype, shape and ``data_offsets``, begin and end in bytes from the end of the header, and
    an optional ``"__metadata__"`` of strings), then the tensors' bytes.
    """

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable safetensors file ({what})")

    if size < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > size - 8:
            raise bad(f"the header length {length} exceeds the file's {size} bytes: truncated or not safetensors")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"the header is not JSON: {_one_line(exc)}") from exc
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("'__metadata__' is not an object of strings")
    return header, metadata, 8 + length


def _safetensors_entry(path: Path, key: str, info: Any, data_size: int) -> tuple[torch.dtype, list[int], int, int]:
    """The dtype, shape and byte range (from the start of the data) of one header entry, validated."""
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (key {key!r} has no dtype/shape/offsets entry)")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: not a readable safetensors file (key {key!r} has shape {shape!r})")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):  # fmt: skip
        raise CheckpointError(f"{path}: not a readable safetensors file (key {key!r} has data_offsets {offsets!r})")
    dtype = _SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CheckpointError(f"{path}: key {key!r} has dtype {code!r}, which torch {torch.__version__} cannot hold")
    begin, end = offsets
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(
            f"{path}: not a readable safetensors file (key {key!r}: {end - begin} bytes for shape {shape} of {code})"
        )
    if end > data_size:
        raise CheckpointError(
            f"{path}: not a readable safetensors file (key {key!r} ends at data byte {end}, the file holds "
            f"{data_size}: truncated)"
        )
    return dtype, shape, begin, end


def _load_safetensors_file(path: Path, mmap: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file: views of a private (copy-on-write) map of the file, or
    with ``mmap=False`` copies in memory."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({_one_line(exc)})") from exc
    header, metadata, start = _safetensors_header(path, size)
    entries = {key: _safetensors_entry(path, key, info, size - start) for key, info in header.items()}
    storage = None
    state: dict[str, torch.Tensor] = {}
    for key, (dtype, shape, begin, end) in entries.items():
        if begin == end:  # no bytes to map
            state[key] = torch.empty(shape, dtype=dtype)
        elif (start + begin) % dtype.itemsize:
            # A view must start at a whole element of the storage; safetensors' writers align every
            # tensor (the header is padded to 8 bytes, larger elements first), so this is a file from
            # elsewhere: read this tensor (a copy) with safetensors itself.
            state[key] = _read_one_safetensor(path, key)
        else:
            if storage is None:
                # shared=False maps the file MAP_PRIVATE: pages are read on first use, and a write into a
                # tensor copies its page for this process; the file itself never changes.
                try:
                    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
                except RuntimeError as exc:  # the file cannot be opened or mapped
                    raise CheckpointError(f"{path}: cannot be memory-mapped ({_one_line(exc)})") from exc
            view = torch.empty(0, dtype=dtype).set_(storage, (start + begin) // dtype.itemsize, shape)
            state[key] = view if mmap else view.clone()
    return state, {str(k): v for k, v in metadata.items()}


def _read_one_safetensor(path: Path, key: str) -> torch.Tensor:
    safetensors = _safetensors()
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor(key)
    except Exception as exc:  # SafetensorError, OSError, and header errors of several types
        raise CheckpointError(f"{path}: not a readable safetensors file ({_one_line(exc)})") from exc


def _load_sharded(path: Path, mmap: bool) -> Checkpoint:
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
            tensors, _ = _load_safetensors_file(shard_path, mmap)
        else:
            tensors = dict(_check_tensors(_unwrap(_load_torch_file(shard_path, mmap), shard_path)[0], shard_path))
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


def load_checkpoint(path: str | Path, *, mmap: bool = True) -> Checkpoint:
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
        this module (a tensor whose offset is not a whole number of its elements is read
        instead), torch files by ``torch.load(mmap=True)`` (files of torch's zip format,
        every ``torch.save`` since torch 1.6; an older file is read whole). ``False`` reads
        every tensor into memory.

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
        ckpt = _load_sharded(path, mmap)
    elif path.suffix == ".safetensors":
        state, metadata = _load_safetensors_file(path, mmap)
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
        Overwrite existing files; without it an existing file is an error and nothing
        is written.

    Returns
    -------
    list of pathlib.Path
        The files written.

    Raises
    ------
    CheckpointError
        A file exists and ``force`` is False, ``state`` lacks a key of ``like``, or a
        computed tensor does not have its key's shape and dtype.

    Notes
    -----
    Nothing is ever a partial file under a final name. Each file is written to a hidden
    ``.<name>.partial`` beside its final name; only when every file is complete are they
    renamed (atomically, one by one), the shards first and the index json last, after any
    old index of that name has been removed, so that a reader never sees an index whose
    shards are missing or are a mix of two writes. A write that fails removes its partial
    files; only a process killed mid-write can leave hidden ``.partial`` files behind
    (the next write of the same name replaces them).
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
                part = [k for k in keys if like.weight_map[like.prefix + k] == shard]
                staged.append(_stage(targets[0].parent / shard,
                                     lambda tmp, p=part, s=shard: _write_file(like, state, p, tmp, s)))  # fmt: skip
            total = sum(_like(state, k).numel() * _like(state, k).element_size() for k in keys)
            index = {"metadata": {**like.metadata, "total_size": total}, "weight_map": dict(like.weight_map)}
            staged.append(_stage(targets[0], lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n")))
        elif like.format == "torch":
            full = _compact(like, state, keys)
            obj = full if like.wrapper_key is None else {like.wrapper_key: full}
            staged.append(_stage(targets[0], lambda tmp: torch.save(obj, tmp)))
        else:
            metadata = {str(k): str(v) for k, v in like.metadata.items()}
            staged.append(_stage(targets[0], lambda tmp: _write_safetensors(tmp, like, state, keys, metadata)))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    if like.format == "sharded":
        targets[0].unlink(missing_ok=True)  # an old index (--force) never names a mix of old and new shards
    for tmp, final in staged:  # the index last: a reader never sees it before its shards
        os.replace(tmp, final)
    return targets


def _compact(like: Checkpoint, state: Mapping[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``keys`` under their stored names for :func:`torch.save`, each owning exactly its bytes
    (a torch file of views stores their storages whole: a mapped safetensors file would be saved whole for
    each of its tensors); one file's (one shard's) at a time."""
    out = {}
    for k in keys:
        t = state[k].detach().cpu()
        exact = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
        out[like.prefix + k] = t if exact else t.clone(memory_format=torch.contiguous_format)
    return out


def _write_file(like: Checkpoint, state: Mapping[str, torch.Tensor], keys: list[str], path: Path, name: str) -> None:
    """One shard: a safetensors file tensor by tensor, or a torch file of the shard's tensors."""
    if name.endswith(".safetensors"):
        _write_safetensors(path, like, state, keys, {"format": "pt"})
    else:
        torch.save(_compact(like, state, keys), path)


def _write_safetensors(
    path: Path, like: Checkpoint, state: Mapping[str, torch.Tensor], keys: list[str], metadata: dict[str, str]
) -> None:
    """Write the tensors of ``keys`` (under ``like.prefix`` + key) as the safetensors file ``path``, one tensor
    at a time: the header is built from the shapes and dtypes alone (:func:`_like`), then each tensor is
    asked for, checked against its header entry, written and let go.

    The tensors go in the order safetensors' own writer uses (larger elements first, then by name), so every
    tensor starts at a whole number of its elements after the 8-byte aligned header, and a reader can map
    each as a view (:func:`load_checkpoint`).
    """
    if sys.byteorder != "little":  # the format is little-endian; torch tensors are in the machine's order
        raise CheckpointError(f"{path}: writing safetensors needs a little-endian machine")
    order = sorted(keys, key=lambda k: (-_like(state, k).element_size(), like.prefix + k))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for k in order:
        t = _like(state, k)
        if t.dtype not in _SAFETENSORS_NAMES:
            raise CheckpointError(f"{path}: key {k!r} has dtype {t.dtype}, which safetensors cannot store")
        size = t.numel() * t.element_size()
        header[like.prefix + k] = {
            "dtype": _SAFETENSORS_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]
        }  # fmt: skip
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # pad the header with spaces to 8 bytes, as safetensors does
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for k in order:
            t = state[k].detach()
            expected = header[like.prefix + k]
            if t.dtype != _like(state, k).dtype or list(t.shape) != expected["shape"]:
                raise CheckpointError(
                    f"{path}: key {k!r} has shape {tuple(t.shape)} and dtype {t.dtype}, expected "
                    f"{tuple(expected['shape'])} and {_like(state, k).dtype}"
                )
            if t.numel():
                # Viewed as bytes, through numpy's buffer: no copy beyond .contiguous() of a strided tensor.
                f.write(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            del t


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
