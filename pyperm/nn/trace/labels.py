"""Labels of traced tensors and the unit classes they name.

Every tensor the tracer computes gets a :class:`Label`: for each axis, an *atom* (an
integer naming a unit class) or ``None`` when the axis is invariant (never permuted).
An atom is one axis of one ``state_dict`` tensor. Operations that must permute two axes
alike *join* their classes in a union-find (:class:`UnitClasses`); a join with an
invariant axis *fixes* the class, so it is never permuted.

Values that are not tensors (tuples returned by a layer, dicts, sizes) get labels of the
same structure: tuples of labels, dicts of labels, or ``None``.

With ``structured=True`` an axis may also be labelled by a structure of classes: a
:class:`CatAxis` (a concatenation, from ``torch.cat`` along units), a :class:`TileAxis`
(one class repeated over a fixed block, from flattening a feature map), a
:class:`BlockAxis` (blocks moved by one class and units within each block by another,
each block its own: attention heads) or a :class:`MovedTileAxis` (blocks moved by one
class and units within every block alike by another: a grouped convolution's input). Joining a plain
class with a structure *binds* the class to it (a BatchNorm's weight after a
concatenation is permuted segment by segment); joining two structures joins them part
by part. These become :class:`~pyperm.nn.spec.Segments`, :class:`~pyperm.nn.spec.Tiled`
and :class:`~pyperm.nn.spec.Blocks` axes of the spec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pyperm.nn.trace.errors import TraceError

__all__ = [
    "BlockAxis",
    "CatAxis",
    "Label",
    "MovedTileAxis",
    "TileAxis",
    "UnitClasses",
    "has_atoms",
    "invariant_label",
    "is_label",
    "is_structure",
    "label_leaves",
    "map_tensors",
    "tensor_leaves",
    "tensors",
]


@dataclass(frozen=True)
class TileAxis:
    """An axis ``(outer, n, inner)`` flattened, class ``atom`` on the middle index."""

    atom: Any  # int, or a structure
    outer: int
    inner: int


@dataclass(frozen=True)
class BlockAxis:
    """An axis ``(blocks, block_size)`` flattened: class ``outer`` moves the blocks, class ``inner``
    (one unit per entry of the axis) the units within each block."""

    outer: int
    inner: int


@dataclass(frozen=True)
class MovedTileAxis:
    """An axis ``(blocks, n)`` flattened: class ``outer`` moves the blocks, class ``atom`` (of ``n``
    units) the units within every block alike."""

    outer: int
    atom: int


@dataclass(frozen=True)
class CatAxis:
    """Consecutive parts of one axis: ``(atom or structure or None, length)`` each."""

    parts: tuple


def is_structure(x: Any) -> bool:
    return isinstance(x, (TileAxis, CatAxis, BlockAxis, MovedTileAxis))


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
        self._bound: dict[int, Any] = {}  # root -> the structure its axis is permuted by
        self.conflicts: list[str] = []
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
        """The label of a ``state_dict`` tensor: its own atoms, None on axes of size 1 (one unit
        has no order: a class token, a broadcast scale); None for other names."""
        if key is None or key not in self.state_dict:
            return None
        t = self.state_dict[key]
        return Label(self.atom(key, i) if t.shape[i] != 1 else None for i in range(t.ndim))

    def new_class(self, size: int) -> int:
        """A class of units that no ``state_dict`` axis names directly (the units within each attention
        head, say): it appears in the spec only inside structured axes."""
        return self._uf.new(size)

    # ---- classes
    def root(self, atom: int) -> int:
        """The representative atom of ``atom``'s class."""
        return self._uf.find(atom)

    def size(self, atom: Any) -> int:
        """The number of units of ``atom``'s class (the length of a structure)."""
        if isinstance(atom, TileAxis):
            return atom.outer * self.size(atom.atom) * atom.inner
        if isinstance(atom, CatAxis):
            return sum(n for _, n in atom.parts)
        if isinstance(atom, BlockAxis):
            return self.size(atom.inner)
        if isinstance(atom, MovedTileAxis):
            return self.size(atom.outer) * self.size(atom.atom)
        return self._uf.size[self._uf.find(atom)]

    def structure(self, atom: Any) -> Any:
        """The structure a class is bound to (a CatAxis or TileAxis), or None; structures are their own."""
        if is_structure(atom):
            return atom
        return self._bound.get(self._uf.find(atom))

    def is_fixed(self, atom: Any) -> bool:
        if is_structure(atom):
            return all(self.is_fixed(a) for a in self._parts(atom))
        return self._uf.fixed[self._uf.find(atom)]

    def is_active(self, atom: int) -> bool:
        return self._uf.active[self._uf.find(atom)]

    def is_group(self, atom: int) -> bool:
        """Whether ``atom``'s class becomes a permutation group (active, not fixed, not bound to a structure)."""
        r = self._uf.find(atom)
        return self._uf.active[r] and not self._uf.fixed[r] and r not in self._bound

    def _parts(self, entry: Any, seen: set[int] | None = None) -> list[int]:
        """The plain classes inside a structure (or a class bound to one), else the class itself."""
        if entry is None:
            return []
        seen = set() if seen is None else seen
        if isinstance(entry, TileAxis):
            return self._parts(entry.atom, seen)
        if isinstance(entry, CatAxis):
            return [a for part, _ in entry.parts for a in self._parts(part, seen)]
        if isinstance(entry, BlockAxis):
            return self._parts(entry.outer, seen) + self._parts(entry.inner, seen)
        if isinstance(entry, MovedTileAxis):
            return self._parts(entry.outer, seen) + self._parts(entry.atom, seen)
        r = self._uf.find(entry)
        if r in seen:  # a class bound to a structure that contains it
            return []
        seen.add(r)
        bound = self._bound.get(r)
        return [entry] + (self._parts(bound, seen) if bound is not None else [])

    def activate(self, label: Any) -> None:
        """Marks every class of ``label`` as reaching an activation."""
        for leaf in label_leaves(label):
            for entry in leaf:
                for a in self._parts(entry):
                    self._uf.active[self._uf.find(a)] = True

    def fix(self, *atoms: Any) -> None:
        """Fixes the classes of ``atoms`` and of the structures among them (None entries are ignored)."""
        for entry in atoms:
            for a in self._parts(entry):
                self._uf.fixed[self._uf.find(a)] = True

    def fix_label(self, label: Any) -> None:
        """Fixes every class inside a (possibly nested) label."""
        for leaf in label_leaves(label):
            self.fix(*leaf)

    def join(self, *atoms: Any) -> Any:
        """Joins classes that must be permuted alike; an invariant (None) among them fixes them all.

        Returns the joined class's atom, or None when an invariant took part. A class
        joined with a structure is bound to it; structures join part by part, and
        structures that do not line up are fixed (listed in :attr:`conflicts`).
        """
        if not atoms:
            return None
        if any(a is None for a in atoms):
            self.fix(*atoms)
            return None
        n = self.size(atoms[0])
        for a in atoms[1:]:
            if self.size(a) != n:
                raise TraceError(f"unit classes of sizes {n} and {self.size(a)} meet on one axis")
        plain = [a for a in atoms if not is_structure(a)]
        structures = [a for a in atoms if is_structure(a)]
        root = None
        for a in plain:
            root = a if root is None else self._union(root, a)
        if not structures:
            return root
        if root is not None:
            bound = self._bound.get(self._uf.find(root))
            if bound is not None:
                structures.append(bound)
        joined = self._join_structures(structures)
        if joined is None:
            self.fix(root)
            return None
        if root is None:
            return joined
        self._bound[self._uf.find(root)] = joined
        return self._uf.find(root)

    def _union(self, a: int, b: int) -> int:
        ra, rb = self._uf.find(a), self._uf.find(b)
        sa, sb = self._bound.get(ra), self._bound.get(rb)
        r = self._uf.union(a, b)
        if sa is not None and sb is not None and ra != rb:
            joined = self._join_structures([sa, sb])
            if joined is None:
                self.fix(r)
            else:
                self._bound[r] = joined
        elif (sa or sb) is not None:
            self._bound[r] = sa or sb
        return r

    def _join_structures(self, structures: list) -> Any:
        first = structures[0]
        moved = [s for s in structures if isinstance(s, MovedTileAxis)]
        blockwise = all(isinstance(s, (BlockAxis, MovedTileAxis)) for s in structures)
        if moved and len(moved) < len(structures) and blockwise:
            return self._restrict_blocks(structures, moved)
        for other in structures[1:]:
            if type(other) is not type(first) or self._shape(other) != self._shape(first):
                self.conflicts.append(f"structures {self._shape(first)} and {self._shape(other)} meet on one axis")
                self.fix(*structures)
                return None
        if isinstance(first, TileAxis):
            return TileAxis(self.join(*[s.atom for s in structures]), first.outer, first.inner)
        if isinstance(first, BlockAxis):
            outer = self.join(*[s.outer for s in structures])
            inner = self.join(*[s.inner for s in structures])
            if outer is None or inner is None:  # one side fixed: a block's units cannot move alone
                self.fix(*structures)
                return None
            return BlockAxis(outer, inner)
        if isinstance(first, MovedTileAxis):
            outer = self.join(*[s.outer for s in structures])
            atom = self.join(*[s.atom for s in structures])
            if outer is None or atom is None:  # one side fixed: fix both, as for BlockAxis
                self.fix(*structures)
                return None
            return MovedTileAxis(outer, atom)
        parts = []
        for i, (_, length) in enumerate(first.parts):
            parts.append((self.join(*[s.parts[i][0] for s in structures]), length))
        return CatAxis(tuple(parts))

    def _restrict_blocks(self, structures: list, moved: list) -> Any:
        """Blocks with their own inner permutation (BlockAxis) meeting blocks permuted alike
        within (MovedTileAxis: a grouped convolution reading a grouped convolution's output):
        the axis keeps what both allow, the blocks moved and one permutation within all."""
        blocks = {self.size(s.outer) for s in structures}
        if len(blocks) > 1 or len({self.size(s) for s in structures}) > 1:
            self.conflicts.append(f"structures {[self._shape(s) for s in structures]} meet on one axis")
            self.fix(*structures)
            return None
        joined = self._join_structures(moved)
        if joined is None:
            self.fix(*structures)
            return None
        (count,) = blocks
        outer = self.join(joined.outer, *[s.outer for s in structures if isinstance(s, BlockAxis)])
        for s in structures:
            if isinstance(s, BlockAxis):  # its inner class: the same permutation in every block
                self.join(s.inner, TileAxis(joined.atom, count, 1))
        return MovedTileAxis(outer, joined.atom)

    def _shape(self, entry: Any) -> Any:
        if isinstance(entry, TileAxis):
            return ("tile", entry.outer, entry.inner)
        if isinstance(entry, CatAxis):
            return ("cat", tuple(n for _, n in entry.parts))
        if isinstance(entry, BlockAxis):
            return ("blocks", self.size(entry.outer), self.size(entry.inner))
        if isinstance(entry, MovedTileAxis):
            return ("moved-tile", self.size(entry.outer), self.size(entry.atom))
        return None

    def atoms_of(self, key: str) -> Iterable[tuple[int, int | None]]:
        """(axis, atom or None) for every axis of ``state_dict[key]``."""
        for axis in range(self.state_dict[key].ndim):
            yield axis, self.atom_of_key(key, axis)
