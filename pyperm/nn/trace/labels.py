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

A channel shuffle (a concatenation of ``k`` equal parts viewed as ``(k, n)``, transposed and merged
back) builds an :class:`InterleaveAxis`: its parts taken in turn, each permuted on its own. On the
way, the ``(k, n)`` view labels its units axis with a :class:`PartsAxis` (the class differs from
part to part) beside a fixed class of the ``k`` parts.

A class may also be *cut* (:meth:`UnitClasses.cut`: ``chunk``/``split`` along units, a
channel shuffle's halves): it is refined into sub-classes, one per piece, by binding it to
a concatenation of them, so every axis it acts on becomes ``Segments`` of the pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pyperm.nn.state import shared_tensors
from pyperm.nn.trace.errors import TraceError

__all__ = [
    "BlockAxis",
    "CatAxis",
    "InterleaveAxis",
    "Label",
    "MovedTileAxis",
    "PartsAxis",
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


@dataclass(frozen=True)
class InterleaveAxis:
    """Parts taken in turn: with ``k`` parts, entry ``k * i + j`` is entry ``i`` of part ``j``; ``(atom or
    structure or None, length)`` each, lengths non-increasing and within one of each other."""

    parts: tuple


@dataclass(frozen=True)
class PartsAxis:
    """The units axis of a concatenation of ``k`` equal parts viewed as ``(k, n)``: entry ``(j, i)`` is unit
    ``i`` of part ``j``. ``selector`` is the (fixed) class of the ``k`` axis; ``parts`` the concatenation's
    ``(entry, n)`` parts.
    Only merging the two axes back (in either order) names it; anything else fixes its parts."""

    selector: int
    parts: tuple


def is_structure(x: Any) -> bool:
    return isinstance(x, (TileAxis, CatAxis, BlockAxis, MovedTileAxis, InterleaveAxis, PartsAxis))


def _split(entry: Any, length: int, points: Sequence[int]) -> list[tuple[Any, int]]:
    """``length`` entries of ``entry`` as runs between ``points``."""
    ends = [0] + list(points) + [length]
    return [(entry, hi - lo) for lo, hi in zip(ends, ends[1:])]


def _tile(atom: Any, outer: int, inner: int) -> Any:
    """``atom`` repeated over ``outer`` copies of blocks of ``inner`` (the atom itself when there is one of each)."""
    return atom if (outer, inner) == (1, 1) else TileAxis(atom, outer, inner)


def _ends(cat: CatAxis) -> list[int]:
    """Where the parts of a concatenation end."""
    ends, total = [], 0
    for _, n in cat.parts:
        total += n
        ends.append(total)
    return ends[:-1]


def _pieces(runs: list[tuple[Any, int]], points: list[int], length: int) -> list[Any]:
    """One entry per piece between consecutive ``points`` for ``runs`` that never straddle a point."""
    pieces, current, done = [], [], 0
    ends = iter(points + [length])
    end = next(ends)
    for run in runs:  # group the runs between consecutive points
        current.append(run)
        done += run[1]
        if done == end:
            pieces.append(_concatenation(current))
            current, end = [], next(ends, length)
    return pieces


def _concatenation(runs: list[tuple[Any, int]]) -> Any:
    """One entry for consecutive runs: the run itself, None when all are invariant, else a CatAxis
    (neighbouring invariant runs merged, nested concatenations spliced in)."""
    if len(runs) == 1 or all(entry is None for entry, _ in runs):
        return runs[0][0]
    parts: list[tuple[Any, int]] = []
    for entry, n in runs:
        for part in entry.parts if isinstance(entry, CatAxis) else [(entry, n)]:
            if part[0] is None and parts and parts[-1][0] is None:
                parts[-1] = (None, parts[-1][1] + part[1])
            else:
                parts.append(part)
    return CatAxis(tuple(parts))


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
        self.pieces: dict[int, tuple[int, int]] = {}  # sub-class made by a cut -> (the class cut, piece index)
        self._alone = 0  # entries a cut leaves in one-unit blocks (see _refine)
        self.conflicts: list[str] = []
        # Tied parameters (one tensor under two names) must be permuted alike: both names
        # share the atoms of the first.
        self._canon: dict[str, str] = {key: key for key in state_dict}
        for keys in shared_tensors(state_dict):
            for key in keys[1:]:
                self._canon[key] = keys[0]

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
        if isinstance(atom, (CatAxis, InterleaveAxis)):
            return sum(n for _, n in atom.parts)
        if isinstance(atom, PartsAxis):
            return atom.parts[0][1]
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

    def reaches_activation(self, entry: Any) -> bool:
        """Whether some class of ``entry`` (a class or a structure) has reached an activation so far."""
        return any(self._uf.active[self._uf.find(a)] for a in self._parts(entry))

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
        if isinstance(entry, (CatAxis, InterleaveAxis)):
            return [a for part, _ in entry.parts for a in self._parts(part, seen)]
        if isinstance(entry, PartsAxis):
            return [entry.selector] + [a for part, _ in entry.parts for a in self._parts(part, seen)]
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
        if any(isinstance(a, PartsAxis) for a in atoms):  # units that differ from part to part, met by others
            self.conflicts.append("the parts of a concatenation viewed as (parts, units) meet other units")
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
        blockwise = all(isinstance(s, (BlockAxis, MovedTileAxis)) for s in structures)
        if not blockwise:  # meeting a concatenation or a tile: blocks that cannot move are a tile
            structures = [self.canonical(s) for s in structures]
        first = structures[0]
        moved = [s for s in structures if isinstance(s, MovedTileAxis)]
        if moved and len(moved) < len(structures) and blockwise:
            return self._restrict_blocks(structures, moved)
        if moved and len(moved) < len(structures) and all(isinstance(s, (CatAxis, MovedTileAxis)) for s in structures):
            return self._join_halves(structures, moved)
        cut_apart = all(isinstance(s, (CatAxis, TileAxis)) for s in structures)
        if cut_apart and any(isinstance(s, CatAxis) for s in structures) and len(set(map(self._shape, structures))) > 1:
            return self._join_refined(structures)
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
        return type(first)(tuple(parts))  # a CatAxis or an InterleaveAxis, joined part by part

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

    def _join_halves(self, structures: list, moved: list) -> Any:
        """Blocks moved as wholes (a split of an axis of units: a channel shuffle's halves) meeting a
        concatenation: its blocks hold different classes, so they stay in place (the block class is
        fixed), and the units within every block are permuted alike: each block of the concatenation
        joins the class within blocks."""
        joined = moved[0] if len(moved) == 1 else self._join_structures(moved)
        if not isinstance(joined, MovedTileAxis):
            self.fix(*structures)
            return None
        count, n = self.size(joined.outer), self.size(joined.atom)
        blocks: list[Any] = []
        for s in structures:
            if isinstance(s, CatAxis):
                pieces = self.cut(s, [n * i for i in range(1, count)])
                if pieces is None:
                    self.conflicts.append(f"structures {[self._shape(s) for s in structures]} meet on one axis")
                    self.fix(*structures)
                    return None
                blocks += pieces
        self.fix(joined.outer)
        if self.join(joined.atom, *blocks) is None:  # an invariant block: every block stays as it is
            return None
        return TileAxis(joined.atom, count, 1)

    def _join_refined(self, structures: list) -> Any:
        """Concatenations (and tiles) with different boundaries meeting on one axis: every one is cut at
        all their boundaries (the classes cut through are refined) and the pieces join one by one."""
        points = sorted({end for s in structures if isinstance(s, CatAxis) for end in _ends(s)})
        cuts = [self.cut(s, points) for s in structures]
        if any(c is None for c in cuts):
            self.conflicts.append(f"structures {[self._shape(s) for s in structures]} meet on one axis")
            self.fix(*structures)
            return None
        lengths = [hi - lo for lo, hi in zip([0] + points, points + [self.size(structures[0])])]
        return CatAxis(tuple((self.join(*column), n) for column, n in zip(zip(*cuts), lengths)))

    # ---- cutting an axis into pieces
    def canonical(self, entry: Any) -> Any:
        """A MovedTileAxis with one side fixed as the TileAxis it is: blocks that stay in place are
        copies, units that stay in place within blocks moved as wholes are a tile. Anything else as it is."""
        if isinstance(entry, MovedTileAxis):
            if self.is_fixed(entry.outer):
                return TileAxis(entry.atom, self.size(entry.outer), 1)
            if self.is_fixed(entry.atom):
                return TileAxis(entry.outer, 1, self.size(entry.atom))
        return entry

    def cut(self, entry: Any, points: Sequence[int]) -> list[Any] | None:
        """The pieces of an axis labelled ``entry`` between the cut ``points`` (``chunk``/``split`` along units).

        A class the points go through is *refined*: bound to a concatenation of new classes, one
        per piece, so every axis it acts on is permuted piece by piece (a spec names it
        ``Segments`` of the pieces' groups), and a tile is cut through its class. A unit whose
        block of a tile the cut goes through is cut off alone and fixed (its entries land in two
        pieces). Returns one entry (a class, a structure or None) per piece, or None when a
        structure cannot be cut exactly (a cut inside one of several copies, through blocks with
        their own permutation): the caller then fixes it.
        """
        length = self.size(entry)
        points = sorted({int(p) for p in points if 0 < p < length})
        self._alone = 0
        runs = self._runs(entry, length, points, frozenset())
        if self._alone:  # say why these entries stay: the ties come from earlier operations
            self.conflicts.append(f"the cut leaves {self._alone} entries in blocks of one unit each (tied by earlier "
                                  "operations: units within blocks that a split permutes alike)")
        return None if runs is None else _pieces(runs, points, length)

    def _runs(self, entry: Any, length: int, points: list[int], seen: frozenset,
              scale: int = 1) -> list[tuple[Any, int]] | None:  # fmt: skip
        """``entry`` as consecutive ``(entry, length)`` runs, none of them straddling a point (``scale``:
        how many entries of the axis cut each of its entries is, inside tiles)."""
        if not points:
            return [(entry, length)]
        if entry is None or self.is_fixed(entry):
            return _split(None, length, points)
        entry = self.canonical(entry)
        if isinstance(entry, CatAxis):
            runs, offset = [], 0
            for part, n in entry.parts:
                inside = [p - offset for p in points if offset < p < offset + n]
                part_runs = self._runs(part, n, inside, seen, scale)
                if part_runs is None:
                    return None
                runs += part_runs
                offset += n
            return runs
        if isinstance(entry, TileAxis):
            return self._tile_runs(entry, points, seen, scale)
        if isinstance(entry, InterleaveAxis):
            return self._interleave_runs(entry, length, points, seen, scale)
        if is_structure(entry):
            return None  # blocks with their own permutation, or moved as wholes: no piece is a form
        r = self._uf.find(entry)
        if r in seen:
            return None  # a class bound to a structure that contains it
        if r in self._bound:
            return self._runs(self._bound[r], length, points, seen | {r}, scale)
        return self._refine(r, length, points, scale)

    def _refine(self, r: int, length: int, points: list[int], scale: int) -> list[tuple[int, int]]:
        """Cut class ``r`` into new classes at ``points`` (bound to their concatenation): its pieces.

        A piece of one unit cannot move; inside a tile (``scale`` > 1) that unit owns a block of
        entries that earlier operations tied together, which the cut then leaves unpermuted."""
        ends = [0] + points + [length]
        subs = []
        for i, (lo, hi) in enumerate(zip(ends, ends[1:])):
            sub = self._uf.new(hi - lo)
            self._uf.active[sub] = self._uf.active[r]  # the pieces are units wherever the class was
            self._uf.fixed[sub] = hi - lo == 1  # one unit has no order
            self._alone += scale if hi - lo == 1 and scale > 1 else 0
            self.pieces[sub] = (r, i)
            subs.append((sub, hi - lo))
        self._bound[r] = CatAxis(tuple(subs))
        return subs

    def _interleave_runs(self, entry: InterleaveAxis, length: int, points: list[int], seen: frozenset,
                         scale: int) -> list[tuple[Any, int]] | None:  # fmt: skip
        """Runs of an interleave, one per piece between the points: every part is cut where the points fall
        among its units (part ``j`` has ``ceil((p - j) / k)`` units before point ``p``), and each piece
        interleaves the parts' pieces in turn from the part its first entry belongs to."""
        k, ends = len(entry.parts), [0] + points + [length]
        columns = []  # per part: its piece (or None where it has no unit) in every piece of the axis
        for j, (part, n) in enumerate(entry.parts):
            bounds = [min(n, max(0, -(-(p - j) // k))) for p in ends]
            inner = sorted({b for b in bounds if 0 < b < n})
            runs = self._runs(part, n, inner, seen, scale)  # a unit owns one entry of its part
            if runs is None:
                return None
            sub = iter(_pieces(runs, inner, n))
            columns.append([(next(sub), hi - lo) if hi > lo else None for lo, hi in zip(bounds, bounds[1:])])
        runs = []
        for i, (lo, hi) in enumerate(zip(ends, ends[1:])):
            turns = [columns[(lo + t) % k][i] for t in range(k)]  # the part of entry lo comes first
            members = tuple(m for m in turns if m is not None)
            whole = None if all(e is None for e, _ in members) else InterleaveAxis(members)
            runs.append((members[0][0] if len(members) == 1 else whole, hi - lo))
        return runs

    def _tile_runs(self, tile: TileAxis, points: list[int], seen: frozenset,
                   scale: int) -> list[tuple[Any, int]] | None:  # fmt: skip
        """Runs of a tile: between copies the class stays whole; within the only copy, the class is cut
        at the units the points fall between, and a unit whose block a point goes through is fixed."""
        n, inner = self.size(tile.atom), tile.inner
        copy = n * inner
        if all(p % copy == 0 for p in points):
            ends = [0] + [p // copy for p in points] + [tile.outer]
            return [(_tile(tile.atom, hi - lo, inner), (hi - lo) * copy) for lo, hi in zip(ends, ends[1:])]
        if tile.outer != 1:
            return None  # a cut inside one of several copies: its pieces are no form
        straddled = {p // inner for p in points if p % inner}
        units = sorted(({p // inner for p in points} | {u + 1 for u in straddled}) - {0, n})
        unit_runs = self._runs(tile.atom, n, units, seen, scale * inner)
        if unit_runs is None:
            return None
        runs: list[tuple[Any, int]] = []
        u = 0
        for sub, m in unit_runs:
            if u in straddled:  # a run of one unit (it was cut at u and u + 1)
                self.fix(sub)
                runs += _split(None, inner, [p - u * inner for p in points if u * inner < p < (u + 1) * inner])
            else:
                runs.append((_tile(sub, 1, inner) if sub is not None else None, m * inner))
            u += m
        return runs

    def _shape(self, entry: Any) -> Any:
        if isinstance(entry, TileAxis):
            return ("tile", entry.outer, entry.inner)
        if isinstance(entry, CatAxis):
            return ("cat", tuple(n for _, n in entry.parts))
        if isinstance(entry, InterleaveAxis):
            return ("interleave", tuple(n for _, n in entry.parts))
        if isinstance(entry, BlockAxis):
            return ("blocks", self.size(entry.outer), self.size(entry.inner))
        if isinstance(entry, MovedTileAxis):
            return ("moved-tile", self.size(entry.outer), self.size(entry.atom))
        return None

    def atoms_of(self, key: str) -> Iterable[tuple[int, int | None]]:
        """(axis, atom or None) for every axis of ``state_dict[key]``."""
        for axis in range(self.state_dict[key].ndim):
            yield axis, self.atom_of_key(key, axis)
