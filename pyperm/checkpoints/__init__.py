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
default): safetensors files through the safetensors library's ``safe_open`` (strict about the
header, lazy, copy-on-write), torch files with ``torch.load(mmap=True)`` (a private mapping
too). The tensors' bytes are read from disk when first used, live in the page cache (the kernel
can drop them again), and writing into a tensor changes the process's copy only: the user's file
is never modified. A file truncated or rewritten in place by another process while it is mapped
makes reading the mapped tensors fail (SIGBUS), as for any memory map; pyperm itself never
writes over a file, it writes beside it and renames.

Writing is streamed: a safetensors file (one, or each shard) is written tensor by tensor by
this package's own writer (the library's takes all tensors at once), so a state computed on
demand (:class:`LazyState`: a permuted or merged model) never exists whole in memory; a torch
file is one ``torch.save`` per file (per shard). Every file is staged beside its destination
and renamed into place, and a sharded checkpoint's index last (:func:`save_checkpoint`): at
every instant an output path holds the complete old checkpoint or the complete new one.

Every problem is raised as :class:`CheckpointError` (a ValueError) with a message naming
the file and, where there is one, the key.
"""

from pyperm.checkpoints._model import check_against_model, check_pair, count_parameters
from pyperm.checkpoints._read import DATA_PARALLEL_PREFIX, TORCH_SUFFIXES, load_checkpoint
from pyperm.checkpoints._safetensors import read_safetensors, read_safetensors_metadata, write_safetensors
from pyperm.checkpoints._types import Checkpoint, CheckpointError, LazyState
from pyperm.checkpoints._write import checkpoint_files, default_name, output_paths, save_checkpoint

__all__ = [
    "DATA_PARALLEL_PREFIX",
    "TORCH_SUFFIXES",
    "Checkpoint",
    "CheckpointError",
    "LazyState",
    "check_against_model",
    "check_pair",
    "checkpoint_files",
    "count_parameters",
    "default_name",
    "load_checkpoint",
    "output_paths",
    "read_safetensors",
    "read_safetensors_metadata",
    "save_checkpoint",
    "write_safetensors",
]
