"""Argument checks shared by the evaluation functions."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from pyperm.nn.state import check_pair

__all__ = ["check_model_states", "check_reiterable"]


def check_reiterable(data: Any, name: str) -> Iterable[Any]:
    """``data`` itself, or a TypeError naming ``name`` when it cannot be read more than once.

    The evaluation functions read their data once per point or layer; a generator or
    an iterator would be empty on the second pass and silently give wrong numbers.
    """
    if isinstance(data, (torch.Tensor, str, bytes, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(f"{name} must be an iterable of batches (a DataLoader, a list), got {type(data).__name__}")
    if isinstance(data, Iterator):
        raise TypeError(
            f"{name} is read several times and must be re-iterable (a DataLoader, a list), "
            f"got a one-shot {type(data).__name__}: wrap it in list(...)"
        )
    return data


def check_model_states(model: nn.Module, state_a: Any, state_b: Any) -> None:
    """The two states pair up with each other (keys, shapes, dtypes, devices) and with the model (keys, shapes)."""
    check_pair(state_a, state_b)
    check_pair(model.state_dict(), state_a, ("model.state_dict()", "state_a"), strict=False)
