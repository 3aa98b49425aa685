"""Permutations of a spec's groups, and applying them to a state dict.

:class:`Permutations` is what every method of :mod:`pyperm.nn` returns and accepts: one
int64 permutation per group of a :class:`~pyperm.nn.PermutationSpec`, validated once.
:func:`apply_permutation` permutes a state dict so that the network computes the same
function.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from pyperm._gather import index_select
from pyperm.nn._checks import check_spec
from pyperm.nn.spec import PermutationSpec


def as_permutations(spec: PermutationSpec, perms: Mapping[str, Any], name: str = "perms") -> dict[str, torch.Tensor]:
    """Validates ``perms`` (one permutation per group) and returns int64 CPU tensors."""
    if isinstance(perms, Permutations) and perms.spec is spec:
        return dict(perms._perms)  # validated when it was built
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
    for inner, outer in spec.blocks.items():
        # A Blocks inner permutation reorders units within each block only: entry
        # j * block_size + k must stay in block j.
        nb = spec.num_blocks(inner)
        block = out[inner].view(nb, -1) // spec.block_size(inner)
        if not bool((block == torch.arange(nb).view(-1, 1)).all()):
            first = int((block != torch.arange(nb).view(-1, 1)).any(1).nonzero()[0])
            raise ValueError(
                f"{name}[{inner!r}] moves units between blocks (block {first} takes units of another block): "
                f"group {inner!r} is the inner group of Blocks({outer!r}, {inner!r}) and permutes the "
                f"{spec.block_size(inner)} units within each of its {nb} blocks"
            )
    return out


def _outer(perms: Mapping[str, torch.Tensor], outer: str | int) -> torch.Tensor:
    """The permutation of a Blocks pair's blocks: its outer group's, or the identity of fixed blocks."""
    return perms[outer] if isinstance(outer, str) else torch.arange(outer)


def _blocks_full(outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """The permutation of the whole axis that a Blocks pair makes (see :class:`pyperm.nn.spec.Blocks`)."""
    return inner.view(outer.numel(), -1)[outer].reshape(-1)


def _blocks_inner(outer: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The inner permutation of a Blocks pair, given its outer one and the whole axis's permutation."""
    # full's row i is block outer[i] of the inner permutation: undo that reordering.
    return full.view(outer.numel(), -1)[torch.argsort(outer)].reshape(-1)


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
    for key in spec.axes:
        t = permute_entry(spec, checked, key, state_dict[key])
        out[key] = t if t is not state_dict[key] else t.clone()
    return out


def permute_entry(spec: PermutationSpec, perms: Mapping[str, torch.Tensor], key: str,
                  tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (the entry ``key`` of a state dict) permuted along every axis a group acts on, in any of the
    spec's forms; ``perms`` already checked (:func:`as_permutations`). The tensor itself when no axis is
    permuted (not a copy)."""
    for axis in range(len(spec.axes[key])):
        index = spec.axis_index(key, axis, perms)  # structured axes too (Segments, Tiled, Blocks, Interleaved)
        if index is not None:
            tensor = index_select(tensor, axis, index.to(tensor.device))
    return tensor


class Permutations(Mapping):
    """One permutation per group of a spec: int64 CPU tensors, validated when built.

    A read-only mapping from group names to ``(n,)`` tensors, so it goes wherever a dict
    of permutations goes (``apply_permutation``, ``weight_matching(init=...)``). Unit
    ``i`` of a permuted model is unit ``perms[g][i]`` of the original.

    Parameters
    ----------
    spec : PermutationSpec
        The spec the permutations belong to.
    perms : mapping of str to (n,) int array or tensor
        One permutation per group of ``spec``.

    Raises
    ------
    TypeError, ValueError
        ``perms`` is not one permutation of the right size per group.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import PermutationSpec, Permutations
    >>> spec = PermutationSpec({"w1": ("h", None), "w2": (None, "h")}, {"h": 3})
    >>> p = Permutations(spec, {"h": [2, 0, 1]})
    >>> p.inverse()["h"], p.compose(p.inverse()) == Permutations.identity(spec)
    (tensor([1, 2, 0]), True)
    >>> p.to_dict()
    {'h': [2, 0, 1]}

    For a :class:`~pyperm.nn.Blocks` pair, :meth:`inverse` and :meth:`compose` act on the
    permutation of the whole axis the pair makes, since the inner permutation of a block
    travels with the block:

    >>> from pyperm.nn.spec import Blocks
    >>> spec = PermutationSpec({"w": (Blocks("h", "d"),)}, {"h": 2, "d": 4})
    >>> p = Permutations(spec, {"h": [1, 0], "d": [1, 0, 2, 3]})
    >>> p.inverse().to_dict(), p.compose(p.inverse()).is_identity()
    ({'h': [1, 0], 'd': [0, 1, 3, 2]}, True)
    """

    def __init__(self, spec: PermutationSpec, perms: Mapping[str, Any]) -> None:
        self.spec = check_spec(spec)
        self._perms = as_permutations(spec, perms)

    @classmethod
    def identity(cls, spec: PermutationSpec) -> Permutations:
        """The identity permutation of every group."""
        return cls(spec, spec.identity())

    @classmethod
    def from_dict(cls, spec: PermutationSpec, data: Mapping[str, Any]) -> Permutations:
        """The inverse of :meth:`to_dict`: lists of ints (as read from JSON) per group."""
        return cls(spec, data)

    def to_dict(self) -> dict[str, list[int]]:
        """Plain lists of ints per group, for JSON."""
        return {g: p.tolist() for g, p in self._perms.items()}

    def __getitem__(self, group: str) -> torch.Tensor:
        return self._perms[group]

    def __iter__(self) -> Iterator[str]:
        return iter(self._perms)

    def __len__(self) -> int:
        return len(self._perms)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        if set(self) != set(other):
            return False
        for g, p in self.items():
            q = other[g]
            q = q.detach().cpu() if isinstance(q, torch.Tensor) else torch.as_tensor(np.asarray(q))
            if not torch.equal(p, q.to(torch.int64)):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable-looking mapping semantics, as dict

    def __repr__(self) -> str:
        return f"Permutations({', '.join(f'{g}: {p.numel()} units' for g, p in self.items())})"

    def inverse(self) -> Permutations:
        """The permutations that undo these: ``apply(p.inverse(), apply(p, sd)) == sd``."""
        out = {g: torch.argsort(p) for g, p in self.items()}
        for inner, outer in self.spec.blocks.items():
            full = torch.argsort(_blocks_full(_outer(self, outer), self[inner]))
            out[inner] = _blocks_inner(_outer(out, outer), full)
        return Permutations(self.spec, out)

    def compose(self, other: Mapping[str, Any]) -> Permutations:
        """``self`` after ``other``: ``apply(p.compose(q), sd) == apply(p, apply(q, sd))``."""
        q = as_permutations(self.spec, other, "other")
        out = {g: q[g][p] for g, p in self.items()}
        for inner, outer in self.spec.blocks.items():
            full = _blocks_full(_outer(q, outer), q[inner])[_blocks_full(_outer(self, outer), self[inner])]
            out[inner] = _blocks_inner(_outer(out, outer), full)
        return Permutations(self.spec, out)

    def is_identity(self) -> bool:
        """Whether every group keeps its units in place."""
        return all(torch.equal(p, torch.arange(p.numel())) for p in self.values())

    def apply(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``apply_permutation(self.spec, self, state_dict)``."""
        return apply_permutation(self.spec, self, state_dict)

