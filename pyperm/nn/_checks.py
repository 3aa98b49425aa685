"""The argument checks of :mod:`pyperm.nn`, on top of :mod:`pyperm._checks` (plain values).

One home for the checks every method of ``pyperm.nn`` makes on what a user passes: a
model, a permutation spec, a state dict or a pair of them, a point ``t`` on a path. Batches
are checked where they are parsed (``pyperm.nn._runtime.check_batches``). Each check raises
TypeError for the wrong type and ValueError for a wrong value, with a message that names the
argument, and returns the value when it is good.
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Real
from typing import Any

import torch
from torch import nn

from pyperm.nn.spec import PermutationSpec

__all__ = [
    "check_model_states",
    "check_module",
    "check_pair",
    "check_spec",
    "check_state",
    "check_t",
]


def check_spec(spec: Any, name: str = "spec") -> PermutationSpec:
    """``spec`` itself, or a TypeError naming ``name`` when it is not a :class:`~pyperm.nn.PermutationSpec`."""
    if not isinstance(spec, PermutationSpec):
        raise TypeError(f"{name} must be a pyperm.nn.PermutationSpec, got {type(spec).__name__}")
    return spec


def check_module(model: Any, name: str = "model") -> nn.Module:
    """``model`` itself, or a TypeError naming ``name`` when it is not a torch module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(model).__name__}")
    return model


def check_state(state: Any, name: str = "state") -> Mapping[str, torch.Tensor]:
    """``state`` itself, or a TypeError naming ``name`` (and the key) when it is not a mapping of str to tensors."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{name} must be a mapping of names to tensors (a state dict), got {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} must have str keys, got {type(key).__name__} key {key!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    return state


def check_pair(
    state_a: Any, state_b: Any, names: tuple[str, str] = ("state_a", "state_b"), *, strict: bool = True
) -> tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]:
    """Check that two state dicts have the same keys, shapes, dtypes and devices.

    Parameters
    ----------
    state_a, state_b : mapping of str to torch.Tensor
        The two state dicts.
    names : (str, str)
        How error messages call them.
    strict : bool, default True
        Also compare dtypes and devices (needed to mix the tensors); with False only
        keys and shapes (enough to load one into a model holding the other).

    Returns
    -------
    (mapping, mapping)
        The two inputs, unchanged.

    Raises
    ------
    TypeError
        Either is not a mapping of str to tensors.
    ValueError
        A key is in one and not the other, or an entry differs in shape, dtype or
        device (with ``strict``); the message names the key.
    """
    name_a, name_b = names
    check_state(state_a, name_a)
    check_state(state_b, name_b)
    only_a = [k for k in state_a if k not in state_b]
    only_b = [k for k in state_b if k not in state_a]
    if only_a or only_b:
        first = only_a[0] if only_a else only_b[0]
        raise ValueError(
            f"{name_a} and {name_b} have different keys: {first!r} is only in {name_a if only_a else name_b} "
            f"(only in {name_a}: {only_a[:5]}, only in {name_b}: {only_b[:5]})"
        )
    for key, a in state_a.items():
        b = state_b[key]
        if a.shape != b.shape:
            raise ValueError(f"{name_a} and {name_b} differ in {key!r}: shapes {tuple(a.shape)} and {tuple(b.shape)}")
        if not strict:
            continue
        if a.dtype != b.dtype:
            raise ValueError(f"{name_a} and {name_b} differ in {key!r}: dtypes {a.dtype} and {b.dtype}")
        if a.device != b.device:
            raise ValueError(f"{name_a} and {name_b} differ in {key!r}: devices {a.device} and {b.device}")
    return state_a, state_b




def check_model_states(model: nn.Module, state_a: Any, state_b: Any) -> None:
    """The two states pair up with each other (keys, shapes, dtypes, devices) and with the model (keys, shapes)."""
    check_pair(state_a, state_b)
    check_pair(model.state_dict(), state_a, ("model.state_dict()", "state_a"), strict=False)


def check_t(t: Any, name: str = "t") -> float:
    """``t`` as a float in [0, 1]: a real number or a one-element tensor."""
    if isinstance(t, torch.Tensor):
        if t.numel() != 1 or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number or a one-element real tensor, got a tensor of shape "
                            f"{tuple(t.shape)} and dtype {t.dtype}")
        t = t.item()
    if isinstance(t, bool) or not isinstance(t, Real):
        raise TypeError(f"{name} must be a real number in [0, 1], got {type(t).__name__}")
    t = float(t)
    if not 0.0 <= t <= 1.0:  # also refuses NaN
        raise ValueError(f"{name} must lie in [0, 1], got {t}")
    return t
