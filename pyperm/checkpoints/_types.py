"""The types of :mod:`pyperm.checkpoints`: the error, a loaded checkpoint, and a state computed on demand."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["Checkpoint", "CheckpointError", "LazyState", "like", "one_line"]


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


def like(state: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    """A tensor with the shape and dtype ``state[key]`` has, without computing a lazy one."""
    return state.template[key] if isinstance(state, LazyState) else state[key]


def one_line(exc: BaseException) -> str:
    """An exception as one short line, for a message that names the file."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
