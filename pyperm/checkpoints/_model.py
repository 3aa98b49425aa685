"""Checks of loaded checkpoints against a model and against each other."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from pyperm.checkpoints._types import Checkpoint, CheckpointError

__all__ = ["check_against_model", "check_pair", "count_parameters"]


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
        if value.is_floating_point() and not value.is_meta and not bool(torch.isfinite(value).all()):
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


def count_parameters(state: Mapping[str, torch.Tensor]) -> int:
    """Numbers held by the floating tensors of ``state`` (for reports)."""
    return int(sum(math.prod(v.shape) for v in state.values() if v.is_floating_point()))
