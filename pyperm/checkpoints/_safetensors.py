"""The safetensors format, pyperm's one code path for it (checkpoints, shards and curve files alike).

Reading is the safetensors library's ``safe_open``: it checks the header strictly (size capped at
100 MB, no duplicate keys, no overlapping or uncovered bytes, known dtypes, byte counts that
match the shapes) and maps the file lazily and copy-on-write, so a tensor's bytes are read when
first used and writing into one never changes the file. Writing is pyperm's own, because the
library takes the tensors all at once: here each tensor is asked for, written and let go, so a
state computed on demand (:class:`~pyperm.checkpoints.LazyState`) never exists whole in memory.
"""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from pyperm.checkpoints._types import CheckpointError, like, one_line

__all__ = ["check_regular_file", "read_safetensors", "read_safetensors_meta", "read_safetensors_metadata",
           "write_safetensors"]

# The safetensors dtype names (the format's spec) of the torch dtypes this writer stores; a dtype
# this torch lacks is left out.
_NAMES = {
    getattr(torch, attr): name
    for name, attr in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
        "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
    }.items()  # fmt: skip
    if hasattr(torch, attr)
}


# Dtypes that pack several values per element (the library reads "F4" as float4_e2m1fn_x2, its shape counting
# pairs): a permutation of such an axis would move pairs, not units, so they are refused by name.
_PACKED = {getattr(torch, name) for name in ("float4_e2m1fn_x2",) if hasattr(torch, name)}


def _library() -> Any:
    try:
        import safetensors
    except ImportError as exc:
        raise CheckpointError("safetensors files need the safetensors package: pip install safetensors") from exc
    return safetensors


def check_regular_file(path: Path) -> None:
    """Refuse anything but a regular file before opening it (a FIFO or a device would block or never end)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({one_line(exc)})") from exc
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file")


def read_safetensors(path: Path, *, mmap: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the string metadata of the safetensors file ``path``.

    With ``mmap`` every tensor is the library's lazy, copy-on-write view of the file; without it,
    each is copied into memory as it is read and its mapping let go (one copy of the file at the
    peak, no mapping left behind). Any problem is a :class:`CheckpointError` naming the file and,
    where the library names one, the key.
    """
    check_regular_file(path)
    safetensors = _library()
    state: dict[str, torch.Tensor] = {}
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            for key in f.keys():
                try:
                    tensor = f.get_tensor(key)
                except Exception as exc:  # a shape torch cannot hold, a dtype this torch lacks
                    raise CheckpointError(f"{path}: key {key!r} cannot be read ({one_line(exc)})") from exc
                if tensor.dtype in _PACKED:
                    raise CheckpointError(f"{path}: key {key!r} has dtype {tensor.dtype}, which packs several values "
                                          "per element; pyperm cannot permute it")
                state[key] = tensor if mmap else tensor.clone()
                del tensor
    except CheckpointError:
        raise
    except Exception as exc:  # SafetensorError for every header problem, OSError for the file
        raise CheckpointError(f"{path}: not a readable safetensors file ({one_line(exc)})") from exc
    return state, metadata


def read_safetensors_meta(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` as meta tensors (their shapes and dtypes from the header
    checked as by :func:`read_safetensors`; no byte of data is mapped or read)."""
    check_regular_file(path)
    safetensors = _library()
    dtypes = {name: dtype for dtype, name in _NAMES.items()}
    state: dict[str, torch.Tensor] = {}
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                name = piece.get_dtype()
                if name not in dtypes:
                    raise CheckpointError(f"{path}: key {key!r} has dtype {name}, which pyperm cannot permute")
                state[key] = torch.empty(tuple(piece.get_shape()), dtype=dtypes[name], device="meta")
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({one_line(exc)})") from exc
    return state


def read_safetensors_metadata(path: Path) -> dict[str, str]:
    """The string metadata of the safetensors file ``path``, its header checked as by :func:`read_safetensors`
    (no tensor is read)."""
    check_regular_file(path)
    safetensors = _library()
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            return dict(f.metadata() or {})
    except Exception as exc:  # SafetensorError for every header problem, OSError for the file
        raise CheckpointError(f"{path}: not a readable safetensors file ({one_line(exc)})") from exc


def write_safetensors(
    f: BinaryIO, names: Mapping[str, str], state: Mapping[str, torch.Tensor], metadata: Mapping[str, str], path: Path
) -> None:
    """Write a safetensors file to ``f``: ``names`` maps each stored name to its key in ``state``.

    The header is built from the shapes and dtypes alone, then each tensor is asked for,
    checked against its header entry, written and let go. The tensors go in the order the
    library's own writer uses (larger elements first, then by name), so every tensor starts at a
    whole number of its elements after the 8-byte aligned header. ``path`` names the file in
    messages.
    """
    if sys.byteorder != "little":  # the format is little-endian; torch tensors are in the machine's order
        raise CheckpointError(f"{path}: writing safetensors needs a little-endian machine")
    order = sorted(names, key=lambda n: (-like(state, names[n]).element_size(), n))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = like(state, names[name])
        if t.dtype not in _NAMES:
            raise CheckpointError(f"{path}: key {names[name]!r} has dtype {t.dtype}, which safetensors cannot store")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # pad the header with spaces to 8 bytes, as the library does
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for name in order:
        key = names[name]
        t = state[key].detach()
        expected = like(state, key)
        if t.dtype != expected.dtype or t.shape != expected.shape:
            raise CheckpointError(
                f"{path}: key {key!r} has shape {tuple(t.shape)} and dtype {t.dtype}, expected "
                f"{tuple(expected.shape)} and {expected.dtype}"
            )
        if t.numel():
            # Viewed as bytes, through numpy's buffer: no copy beyond .contiguous() of a strided tensor.
            f.write(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        del t
