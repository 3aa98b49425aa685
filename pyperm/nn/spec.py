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

    @classmethod
    def from_model(cls, model: Any, example_input: Any, *, composite: str | None = None) -> PermutationSpec:
        """Build the spec of ``model`` by tracing it with :mod:`torch.fx`.

        Parameters
        ----------
        model : torch.nn.Module
            The model; it is run once in eval mode under ``torch.no_grad`` on
            ``example_input`` and left as it was.
        example_input : torch.Tensor or tuple
            One input batch, or a tuple of the forward's positional inputs.
        composite : {None, "fix", "raise"}, default None
            Units a spec cannot name (an axis built out of several groups: ``torch.cat``
            or ``F.pad`` along channels, channel slicing, flatten of a convolution
            output larger than 1x1; a group on two axes of one tensor; a module without
            a trace rule) are left unpermuted with a :class:`pyperm.nn.trace.TraceWarning`
            naming each cause and its module path (None), left unpermuted silently
            ("fix"), or make the trace raise ("raise").

        Returns
        -------
        PermutationSpec
            One group per set of hidden units that can be permuted freely; the
            model's inputs and outputs are never permuted. Groups are named ``P_`` +
            the path of the first layer producing their units.

        Raises
        ------
        TypeError
            ``model`` is not a module or ``example_input`` not a tensor or tuple.
        pyperm.nn.TraceError
            The model cannot be traced, or an operation acts on permutable units in a
            way the tracer cannot follow; the message names the operation and its
            module path.

        See Also
        --------
        pyperm.nn.trace_model : the same trace, with the activation sites of every group.
        pyperm.nn.register_trace_rule : teach the tracer a module of your own.

        Examples
        --------
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> spec = PermutationSpec.from_model(model, torch.randn(3, 4))
        >>> spec.axes["0.weight"], spec.axes["2.weight"], spec.axes["2.bias"]
        (('P_0', None), (None, 'P_0'), (None,))
        """
        # Imported here: the tracer needs torch.fx, which a spec itself never does.
        from pyperm.nn.trace.tracer import _trace

        return _trace(model, example_input, composite, stacklevel=2).spec

    def groups_in(self, other: PermutationSpec, name: str = "spec") -> dict[str, str]:
        """Map each group to the group of ``other`` acting on exactly the same axes.

        ``other`` may have more groups (this spec may leave some out), typically the spec
        :meth:`from_model` traces, against which a hand-written spec is checked.

        Raises
        ------
        TypeError
            ``other`` is not a PermutationSpec.
        ValueError
            The two specs cover different ``state_dict`` keys, or a group has no
            counterpart of the same size in ``other`` (the message names it; ``name`` is
            how it calls this spec).
        """
        if not isinstance(other, PermutationSpec):
            raise TypeError(f"other must be a PermutationSpec, got {type(other).__name__}")
        if set(self.axes) != set(other.axes):
            missing = [k for k in other.axes if k not in self.axes]
            extra = [k for k in self.axes if k not in other.axes]
            raise ValueError(
                f"{name} does not match the models' state_dict: missing keys {missing[:5]}, unexpected {extra[:5]}"
            )
        theirs = {frozenset(where): g for g, where in other.group_axes.items()}
        mapping: dict[str, str] = {}
        for g, where in self.group_axes.items():
            h = theirs.get(frozenset(where))
            if h is None or other.sizes[h] != self.sizes[g]:
                raise ValueError(
                    f"{name} group {g!r} (acting on {list(where)[:3]}...) matches no group of the traced model: "
                    "each group must be one of the groups PermutationSpec.from_model finds (it may leave some out)"
                )
            mapping[g] = h
        return mapping

    def group_correspondence(self, other: PermutationSpec) -> dict[str, str] | None:
        """Map each group to the group of ``other`` acting on exactly the same axes.

        Returns ``None`` unless the two specs are :meth:`equivalent`.
        """
        try:
            mapping = self.groups_in(other)
        except ValueError:
            return None
        if any(len(groups) != len(other.axes[key]) for key, groups in self.axes.items()):
            return None
        return mapping if len(mapping) == len(other.sizes) else None

    def equivalent(self, other: PermutationSpec) -> bool:
        """True when both specs describe the same permutation symmetry, whatever the group names.

        Two specs are equivalent when they cover the same ``state_dict`` keys with the
        same number of axes, and their groups partition the (key, axis) pairs the same
        way with the same sizes (so every axis one leaves unpermuted, the other does too).

        Examples
        --------
        >>> a = PermutationSpec({"w1": ("h", None), "w2": (None, "h")}, {"h": 3})
        >>> b = PermutationSpec({"w1": ("P_0", None), "w2": (None, "P_0")}, {"P_0": 3})
        >>> a.equivalent(b), a == b
        (True, False)
        """
        return self.group_correspondence(other) is not None

    def identity(self) -> dict[str, Any]:
        """The identity permutation of every group (int64 torch tensors)."""
        import torch

        return {g: torch.arange(n) for g, n in self.sizes.items()}
