"""Applying permutations to a state dict: the permuted network computes the same function."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pyperm.nn.spec import PermutationSpec


def as_permutations(spec: PermutationSpec, perms: Mapping[str, Any], name: str = "perms") -> dict[str, torch.Tensor]:
    """Validates ``perms`` (one permutation per group) and returns int64 CPU tensors."""
    if not isinstance(perms, Mapping):
        raise TypeError(f"{name} must be a mapping of group names to permutations, got {type(perms).__name__}")
    missing = [g for g in spec.sizes if g not in perms]
    extra = [g for g in perms if g not in spec.sizes]
    if missing or extra:
        raise ValueError(f"{name} does not match the spec's groups: missing {missing[:5]}, unexpected {extra[:5]}")
    out = {}
    for g, n in spec.sizes.items():
        p = perms[g]
        p = p.detach().cpu() if isinstance(p, torch.Tensor) else torch.as_tensor(np.asarray(p))
        if p.ndim != 1 or p.shape[0] != n:
            raise ValueError(f"{name}[{g!r}] must have shape ({n},), got {tuple(p.shape)}")
        if p.dtype.is_floating_point or p.dtype == torch.bool or p.dtype.is_complex:
            raise TypeError(f"{name}[{g!r}] must hold integers, got {p.dtype}")
        p = p.to(torch.int64)
        if not torch.equal(torch.sort(p).values, torch.arange(n)):
            raise ValueError(f"{name}[{g!r}] is not a permutation of 0..{n - 1}")
        out[g] = p
    return out


def apply_permutation(
    spec: PermutationSpec, perms: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Permute every tensor of ``state_dict`` as the spec says; the input is not modified.

    Parameters
    ----------
    spec : PermutationSpec
        The model's permutation groups.
    perms : mapping of str to (n,) int array or tensor
        One permutation per group; unit ``i`` of the result is unit ``perms[g][i]``
        of the input along every axis that group ``g`` acts on.
    state_dict : mapping of str to torch.Tensor
        The model's parameters and buffers, exactly the spec's keys.

    Returns
    -------
    dict of str to torch.Tensor
        New tensors on the input tensors' devices; a model loading it computes the same
        function as one loading ``state_dict`` (in train and eval mode).

    Raises
    ------
    ValueError, TypeError
        ``perms`` is not one valid permutation per group, or ``state_dict`` does not
        match the spec.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import PermutationSpec, apply_permutation
    >>> spec = PermutationSpec({"w1": ("h", None), "w2": (None, "h")}, {"h": 3})
    >>> sd = {"w1": torch.eye(3)[:, :2], "w2": torch.ones(1, 3)}
    >>> apply_permutation(spec, {"h": [2, 0, 1]}, sd)["w1"]
    tensor([[0., 0.],
            [1., 0.],
            [0., 1.]])
    """
    spec.check_state_dict(state_dict)
    checked = as_permutations(spec, perms)
    out = {}
    for key, groups in spec.axes.items():
        t = state_dict[key]
        for axis, g in enumerate(groups):
            if g is not None:
                t = t.index_select(axis, checked[g].to(t.device))
        out[key] = t if t is not state_dict[key] else t.clone()
    return out
