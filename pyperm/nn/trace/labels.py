"""Labels of traced tensors and the unit classes they name.

Every tensor the tracer computes gets a :class:`Label`: for each axis, an *atom* (an
integer naming a unit class) or ``None`` when the axis is invariant (never permuted).
An atom is one axis of one ``state_dict`` tensor. Operations that must permute two axes
alike *join* their classes in a union-find (:class:`UnitClasses`); a join with an
invariant axis *fixes* the class, so it is never permuted.

Values that are not tensors (tuples returned by a layer, dicts, sizes) get labels of the
same structure: tuples of labels, dicts of labels, or ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pyperm.nn.trace.errors import TraceError

__all__ = [
    "Label",
    "UnitClasses",
    "has_atoms",
    "invariant_label",
    "is_label",
    "label_leaves",
    "map_tensors",
    "tensor_leaves",
    "tensors",
]


class Label(tuple):
    """The label of one tensor: per axis, an atom (a unit class) or ``None`` (invariant).

    Examples
    --------
    >>> Label((None, 3)), Label.invariant(2)
    ((None, 3), (None, None))
    """

    @classmethod
    def invariant(cls, ndim: int) -> Label:
        """The label of a tensor with ``ndim`` invariant axes."""
        return cls((None,) * ndim)

    def has_atoms(self) -> bool:
        """Whether some axis carries permutable units."""
        return any(a is not None for a in self)


def is_label(x: Any) -> bool:
    """Whether ``x`` is the label of one tensor (not a container of labels)."""
    return isinstance(x, Label)


def label_leaves(label: Any) -> list[Label]:
    """Every tensor label inside a (possibly nested) label structure."""
    return [leaf for leaf in pytree.tree_leaves(label, is_leaf=is_label) if is_label(leaf)]


def tensor_leaves(value: Any, label: Any) -> list[tuple[torch.Tensor, Label]]:
    """Pairs (tensor, label) of every tensor inside a (possibly nested) argument.

    A tensor without a label of its own (a constant inside a list, say) is invariant.
    """
    out: list[tuple[torch.Tensor, Label]] = []
    if isinstance(value, torch.Tensor):
        out.append((value, label if is_label(label) else Label.invariant(value.ndim)))
    elif isinstance(value, (list, tuple)):
        labels = label if isinstance(label, (list, tuple)) and len(label) == len(value) else [None] * len(value)
        for v, lab in zip(value, labels):
            out.extend(tensor_leaves(v, lab))
    elif isinstance(value, Mapping):
        labels = label if isinstance(label, Mapping) else {}
        for k, v in value.items():
            out.extend(tensor_leaves(v, labels.get(k)))
    return out


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` of every tensor in ``value``; tuples (named ones too) and lists become tuples, dicts dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return None


def invariant_label(value: Any) -> Any:
    """A label with every tensor axis invariant, mirroring ``value``'s structure."""
    return map_tensors(value, lambda v: Label.invariant(v.ndim))


def has_atoms(label: Any) -> bool:
    """Whether some tensor label inside ``label`` carries permutable units."""
    return any(leaf.has_atoms() for leaf in label_leaves(label))


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (tuples, named tuples, lists and dicts are searched)."""
    found: list[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


class _UnionFind:
    """Disjoint sets of atoms with their unit count and two flags per class."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.size: list[int] = []
        self.fixed: list[bool] = []
        self.active: list[bool] = []

    def new(self, size: int) -> int:
        self.parent.append(len(self.parent))
        self.size.append(int(size))
        self.fixed.append(False)
        self.active.append(False)
        return len(self.parent) - 1

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:  # path compression
            self.parent[a], a = root, self.parent[a]
        return root

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        self.parent[rb] = ra
        self.fixed[ra] = self.fixed[ra] or self.fixed[rb]
        self.active[ra] = self.active[ra] or self.active[rb]
        return ra


class UnitClasses:
    """The atoms of a model's ``state_dict`` and the classes of units they form.

    Parameters
    ----------
    state_dict : mapping of str to torch.Tensor
        The model's parameters and buffers (detached).

    Notes
    -----
    A class is *fixed* when it meets an invariant axis (it is never permuted) and
    *active* when it reaches an input-dependent tensor (its atoms are units, not just
    parameter axes); only active, unfixed classes become permutation groups.
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.state_dict = state_dict
        self._uf = _UnionFind()
        self._atoms: dict[tuple[str, int], int] = {}
        # Tied parameters (one tensor under two names) must be permuted alike: both names
        # share the atoms of the first.
        self._canon: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for key, t in state_dict.items():
            ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else None
            if ident is not None and ident in seen:
                self._canon[key] = seen[ident]
            else:
                if ident is not None:
                    seen[ident] = key
                self._canon[key] = key

    # ---- atoms
    def atom(self, key: str, axis: int) -> int:
        """The atom of axis ``axis`` of ``state_dict[key]`` (created on first use)."""
        key = self._canon[key]
        a = self._atoms.get((key, axis))
        if a is None:
            a = self._atoms[(key, axis)] = self._uf.new(self.state_dict[key].shape[axis])
        return a

    def atom_of_key(self, key: str, axis: int) -> int | None:
        """The atom of a ``state_dict`` axis if the trace ever read it, else None."""
        return self._atoms.get((self._canon[key], axis))

    def param_label(self, key: str | None) -> Label | None:
        """The label of a ``state_dict`` tensor: its own atoms; None for other names."""
        if key is None or key not in self.state_dict:
            return None
        t = self.state_dict[key]
        return Label(self.atom(key, i) for i in range(t.ndim))

    # ---- classes
    def root(self, atom: int) -> int:
        """The representative atom of ``atom``'s class."""
        return self._uf.find(atom)

    def size(self, atom: int) -> int:
        """The number of units of ``atom``'s class."""
        return self._uf.size[self._uf.find(atom)]

    def is_fixed(self, atom: int) -> bool:
        return self._uf.fixed[self._uf.find(atom)]

    def is_active(self, atom: int) -> bool:
        return self._uf.active[self._uf.find(atom)]

    def is_group(self, atom: int) -> bool:
        """Whether ``atom``'s class becomes a permutation group (active and not fixed)."""
        r = self._uf.find(atom)
        return self._uf.active[r] and not self._uf.fixed[r]

    def activate(self, label: Any) -> None:
        """Marks every class of ``label`` as reaching an activation."""
        for leaf in label_leaves(label):
            for a in leaf:
                if a is not None:
                    self._uf.active[self._uf.find(a)] = True

    def fix(self, *atoms: int | None) -> None:
        """Fixes the classes of ``atoms`` (None entries are ignored)."""
        for a in atoms:
            if a is not None:
                self._uf.fixed[self._uf.find(a)] = True

    def fix_label(self, label: Any) -> None:
        """Fixes every class inside a (possibly nested) label."""
        for leaf in label_leaves(label):
            self.fix(*leaf)

    def join(self, *atoms: int | None) -> int | None:
        """Joins classes that must be permuted alike; an invariant (None) among them fixes them all.

        Returns the joined class's atom, or None when an invariant took part.
        """
        if not atoms:
            return None
        if any(a is None for a in atoms):
            self.fix(*atoms)
            return None
        root = atoms[0]
        for a in atoms[1:]:
            if self.size(root) != self.size(a):
                raise TraceError(f"unit classes of sizes {self.size(root)} and {self.size(a)} meet on one axis")
            root = self._uf.union(root, a)
        return root

    def atoms_of(self, key: str) -> Iterable[tuple[int, int | None]]:
        """(axis, atom or None) for every axis of ``state_dict[key]``."""
        for axis in range(self.state_dict[key].ndim):
            yield axis, self.atom_of_key(key, axis)
