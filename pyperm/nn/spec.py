"""The permutation spec: which parameter and buffer axes each permutation group acts on.

Every method in :mod:`pyperm.nn` speaks this one structure. A permutation group ``g``
of size ``n`` is a reordering of ``n`` hidden units (neurons or channels); the spec lists,
for every entry of a model's ``state_dict``, which group (or ``None``) acts on each axis.
Errors in a spec are found when it is built or checked against a state dict, never deep
inside a solve.

Convention used throughout pyperm: a permutation is an int64 array ``perm`` of length
``n``, and permuting a tensor along an axis acted on by ``g`` means
``permuted.index_select(axis, perm)``: unit ``i`` of the permuted model is unit
``perm[i]`` of the original.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

AxisGroups = tuple  # tuple[str | None, ...], one entry per tensor axis


@dataclass(frozen=True)
class PermutationSpec:
    """The permutation groups of a model and the tensor axes each one acts on.

    Parameters
    ----------
    axes : mapping of str to tuple of (str or None)
        For every ``state_dict`` key of the model, one entry per axis of that tensor:
        the name of the permutation group acting on the axis, or ``None``. Keys whose
        tensors are never permuted (``num_batches_tracked``, the last layer's bias)
        are listed with all-``None`` axes, so a spec covers the whole state dict.
    sizes : mapping of str to int
        The size of every group (number of units it permutes).

    Raises
    ------
    ValueError
        A group is used by no axis, an axis names an unknown group, or a tensor
        names the same group on two axes.

    Examples
    --------
    A two-layer MLP with one hidden group of 16 units:

    >>> spec = PermutationSpec(
    ...     axes={"0.weight": ("h", None), "0.bias": ("h",), "2.weight": (None, "h"), "2.bias": (None,)},
    ...     sizes={"h": 16})
    >>> spec.group_axes["h"]
    (('0.weight', 0), ('0.bias', 0), ('2.weight', 1))
    """

    axes: Mapping[str, AxisGroups]
    sizes: Mapping[str, int]
    group_axes: Mapping[str, tuple[tuple[str, int], ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        axes = {str(k): tuple(v) for k, v in self.axes.items()}
        sizes = {str(k): int(v) for k, v in self.sizes.items()}
        for name, n in sizes.items():
            if n < 1:
                raise ValueError(f"group {name!r} has size {n}; sizes must be positive")
        used: dict[str, list[tuple[str, int]]] = {g: [] for g in sizes}
        for key, groups in axes.items():
            named = [g for g in groups if g is not None]
            if len(named) != len(set(named)):
                raise ValueError(f"tensor {key!r} names the same group on two axes: {groups}")
            for axis, g in enumerate(groups):
                if g is None:
                    continue
                if g not in sizes:
                    raise ValueError(f"tensor {key!r} axis {axis} names unknown group {g!r}")
                used[g].append((key, axis))
        unused = [g for g, where in used.items() if not where]
        if unused:
            raise ValueError(f"groups {unused} act on no tensor axis")
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "group_axes", {g: tuple(w) for g, w in used.items()})

    @property
    def groups(self) -> tuple[str, ...]:
        """The group names, in a stable order (the order of ``sizes``)."""
        return tuple(self.sizes)

    def check_state_dict(self, state_dict: Mapping[str, Any], name: str = "state_dict") -> None:
        """Raise ValueError unless ``state_dict`` has exactly the spec's keys and matching shapes."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{name} must be a mapping of names to tensors, got {type(state_dict).__name__}")
        missing = [k for k in self.axes if k not in state_dict]
        extra = [k for k in state_dict if k not in self.axes]
        if missing or extra:
            raise ValueError(f"{name} does not match the spec: missing keys {missing[:5]}, unexpected keys {extra[:5]}")
        for key, groups in self.axes.items():
            shape = tuple(state_dict[key].shape)
            if len(shape) != len(groups):
                raise ValueError(f"{name}[{key!r}] has shape {shape}; the spec expects {len(groups)} axes")
            for axis, g in enumerate(groups):
                if g is not None and shape[axis] != self.sizes[g]:
                    raise ValueError(
                        f"{name}[{key!r}] axis {axis} has size {shape[axis]}; group {g!r} has size {self.sizes[g]}"
                    )

    def identity(self) -> dict[str, Any]:
        """The identity permutation of every group (int64 torch tensors)."""
        import torch

        return {g: torch.arange(n) for g, n in self.sizes.items()}
