"""The teacher-student functions' own argument checks: weights, teachers, seeds (each error names its argument).

Plain numbers go through :mod:`pyperm._checks`; these are the checks only this model needs.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from pyperm._checks import check_int

DTYPE = torch.float64


def as_weights(x: object, name: str, *, batched: bool = True) -> torch.Tensor:
    """``x`` as a finite float64 tensor of shape ``(..., n, d)`` (``(n, d)`` when not ``batched``).

    Any real floating dtype is accepted and computed in float64; the device is kept, and
    autograd still flows through the conversion.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")
    if x.dim() < 2 or (not batched and x.dim() != 2):
        shape = "(..., n, d)" if batched else "(n, d)"
        raise ValueError(f"{name} must have shape {shape} (one neuron per row), got {tuple(x.shape)}")
    if x.shape[-1] < 1 or x.shape[-2] < 1:
        raise ValueError(f"{name} needs at least one neuron and one input dimension, got {tuple(x.shape)}")
    if not bool(torch.isfinite(x.detach()).all()):
        raise ValueError(f"{name} contains NaN or infinite entries")
    return x.to(DTYPE)


def as_teacher(x: object, name: str = "W_teacher") -> torch.Tensor:
    """A teacher matrix: ``(K, d)``, finite, without a zero row (a zero neuron has no type)."""
    wt = as_weights(x, name, batched=False)
    if bool((wt.detach().norm(dim=-1) == 0).any()):
        raise ValueError(f"{name} has a zero row; every teacher neuron needs a direction")
    return wt


def check_pair(w: torch.Tensor, name: str, wt: torch.Tensor) -> None:
    """``w`` (a student) and ``wt`` (the teacher) share the input dimension and the device."""
    if w.shape[-1] != wt.shape[-1]:
        raise ValueError(
            f"{name} has input dimension {w.shape[-1]} but W_teacher has {wt.shape[-1]} "
            f"(shapes {tuple(w.shape)} and {tuple(wt.shape)})"
        )
    if w.device != wt.device:
        raise ValueError(f"{name} is on {w.device} but W_teacher is on {wt.device}")


def check_same_shape(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{name_a} is on {a.device} but {name_b} is on {b.device}")


def seed_list(seed: object, name: str = "seed") -> tuple[list[int], bool]:
    """The seeds of a call and whether it was a sequence (a batch of runs) or one int."""
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        return [_one_seed(seed, name)], False
    if isinstance(seed, torch.Tensor) and seed.dim() == 1 and not seed.is_floating_point():
        seed = seed.tolist()
    if isinstance(seed, Sequence) and not isinstance(seed, (str, bytes)):
        seeds = [_one_seed(s, f"{name}[{i}]") for i, s in enumerate(seed)]
        if not seeds:
            raise ValueError(f"{name} must not be an empty sequence")
        return seeds, True
    raise TypeError(f"{name} must be an int or a sequence of ints, got {type(seed).__name__}")


def _one_seed(s: object, name: str) -> int:
    s = check_int(s, name, 0)
    if s >= 2**63:  # within int64, so a seed reads the same given as an int or in a tensor of seeds
        raise ValueError(f"{name} must be below 2**63, got {s}")
    return s


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator of its own for one run, so a run's result does not depend on its batch."""
    return torch.Generator(device=device).manual_seed(seed)
