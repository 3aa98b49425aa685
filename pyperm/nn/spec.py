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

Structured axes
---------------
Most axes are acted on by one group, or by none. Some architectures build an axis out
of several groups or out of copies of one; the spec names these with *axis forms*,
which are opt-in: a spec made of group names alone (every hand-written spec of the
bundled models) is *flat*, and stays as it was.

- :class:`Segments`: a concatenation (``torch.cat`` along channels: DenseNet, U-Net
  skips). Each part is a group, a number of units that are never permuted, or a
  :class:`Tiled` part.
- :class:`Tiled`: one group repeated over a fixed block. ``Tiled(g, inner=H*W)`` is the
  flatten of a ``C x H x W`` feature map (unit ``c`` owns ``H*W`` consecutive features);
  ``Tiled(g, outer=heads)`` is the same permutation of ``head_dim`` units within every
  attention head. The repeated unit may be a form itself (a ``Tiled``, or a ``Segments``
  of groups and fixed entries): the same permutation of a structured block in every copy.
- :class:`Blocks`: a group of groups. ``Blocks(h, d)`` permutes whole blocks (attention
  heads, the groups of a grouped convolution) by ``h`` and the units within each block by
  ``d``, a different permutation in every block.
- :class:`Interleaved`: parts taken in turn (ShuffleNet's channel shuffle): with ``k``
  parts, entry ``k * i + j`` is entry ``i`` of part ``j``. ``Interleaved("a", "b")`` is
  ``a0 b0 a1 b1 ...``; its parts may be forms themselves (an interleave of interleaves).
- The same group on two axes of one tensor (a layer applied to its own output, an RNN's
  hidden-to-hidden weight: ``P W P^T``): name the group on both axes.

Every form permutes by ``index_select`` along the axis with the index that
:meth:`PermutationSpec.axis_index` builds, so :func:`pyperm.nn.apply_permutation`
supports them all, and so does every method of :mod:`pyperm.nn`: weight, activation and STE
matching, merging, PAM (whose relaxation gives a Blocks inner group one doubly stochastic
matrix per block), REPAIR, barriers and curves.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyperm._checks import check_positive_int

__all__ = [
    "AxisEntry",
    "Blocks",
    "Interleaved",
    "PermutationSpec",
    "Segments",
    "Tiled",
    "entry_groups",
    "rename_entry",
]

AxisGroups = tuple  # tuple[AxisEntry, ...], one entry per tensor axis


@dataclass(frozen=True)
class Tiled:
    """One group repeated over a fixed block: the axis is ``(outer, n, inner)`` flattened.

    The group permutes the middle index; the ``outer`` copies share the permutation, and
    each unit owns ``inner`` consecutive entries. The axis has ``outer * n * inner`` entries.
    ``outer`` may also name a group: the copies are then permuted as whole blocks by it
    (the input channels of a grouped convolution: its groups move, and the channels
    within every group move alike, since every filter of a group reads them in one order).

    The repeated unit may itself be a form, of ``n`` entries, whose own index permutes every
    copy alike: a ``Tiled`` form (grouped-query attention's output projection reads
    ``(kv_heads, query heads per kv head, head_dim)``, which is
    ``Tiled(Tiled(dims, outer=query_heads), outer=kv_heads)``), or a :class:`Segments` of
    group names and fixed entries (partial rotary embeddings: every head's first ``r`` query
    dims turn in place, the rest move, ``Tiled(Segments(r, dims), outer=heads)``).

    Parameters
    ----------
    group : str, Tiled or Segments
        The group (of ``n`` units), or a form (of ``n`` entries) repeated as a whole: a ``Tiled``
        form, or a ``Segments`` of group names and ints.
    outer : int or str, default 1
        The number of copies, or the group permuting them (its size is the number).
    inner : int, default 1
        The number of entries per unit.

    Examples
    --------
    A Linear reading a flattened ``4 x 2 x 2`` feature map (``flatten(1)`` of a
    convolution with 4 channels), and a ``head_dim`` group of 3 units shared by 2 heads:

    >>> spec = PermutationSpec({"conv.weight": ("c", None, None, None), "fc.weight": (None, Tiled("c", inner=4)),
    ...                         "qkv.weight": (Tiled("d", outer=2), None)}, {"c": 4, "d": 3})
    >>> spec.axis_index("fc.weight", 1, {"c": [1, 0, 2, 3], "d": [0, 1, 2]}).tolist()
    [4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
    >>> spec.axis_index("qkv.weight", 0, {"c": [0, 1, 2, 3], "d": [2, 0, 1]}).tolist()
    [2, 0, 1, 5, 3, 4]

    Two blocks of 2 units, moved by group ``b`` and permuted alike within by ``c``:

    >>> spec = PermutationSpec({"w": (Tiled("c", outer="b"),)}, {"b": 2, "c": 2})
    >>> spec.axis_index("w", 0, {"b": [1, 0], "c": [1, 0]}).tolist()
    [3, 2, 1, 0]

    Copies of a tiled unit: 2 blocks moved by ``k``, each of 2 copies moved by ``q`` of 2 units moved by ``d``:

    >>> spec = PermutationSpec({"w": (Tiled(Tiled("d", outer="q"), outer="k"),)}, {"k": 2, "q": 2, "d": 2})
    >>> spec.axis_index("w", 0, {"k": [1, 0], "q": [1, 0], "d": [1, 0]}).tolist()
    [7, 6, 5, 4, 3, 2, 1, 0]

    Heads of 1 fixed entry and 2 units of ``d``, moved by ``h``:

    >>> spec = PermutationSpec({"w": (Tiled(Segments(1, "d"), outer="h"),)}, {"h": 2, "d": 2})
    >>> spec.axis_index("w", 0, {"h": [1, 0], "d": [1, 0]}).tolist()
    [3, 5, 4, 0, 2, 1]
    """

    group: str | Tiled | Segments
    outer: int | str = 1
    inner: int = 1

    def __post_init__(self) -> None:
        # A Segments unit of groups and fixed entries only: each part lowers to one cut of the unit's sub-axis.
        plain = isinstance(self.group, Segments) and all(isinstance(p, (str, int)) for p in self.group.parts)
        if not isinstance(self.group, (str, Tiled)) and not plain:
            raise TypeError("Tiled group must be a group name, a Tiled form or a Segments of group names and ints, "
                            f"got {self.group!r}")  # fmt: skip
        if isinstance(self.outer, str):
            if self.outer in entry_groups(self.group):
                what = repr(self.group) if isinstance(self.group, str) else f"those of {self.group!r}"
                raise ValueError(f"Tiled outer must be another group than {what}")
        else:
            object.__setattr__(self, "outer", check_positive_int(self.outer, "Tiled outer"))
        object.__setattr__(self, "inner", check_positive_int(self.inner, "Tiled inner"))

    def groups(self) -> tuple[str, ...]:
        """The groups this form names: its unit's, then its outer group if it has one."""
        return entry_groups(self.group) + ((self.outer,) if isinstance(self.outer, str) else ())

    def renamed(self, mapping: Mapping[str, str]) -> Tiled:
        """The same form over the groups ``mapping`` gives for its own (every one must be there)."""
        outer = mapping[self.outer] if isinstance(self.outer, str) else self.outer
        return Tiled(rename_entry(self.group, mapping), outer, self.inner)


@dataclass(frozen=True)
class Blocks:
    """A group of groups: whole blocks permuted by ``outer``, the units of every block by ``inner``.

    The axis is ``(num_blocks, block_size)`` flattened, ``num_blocks = sizes[outer]``. The
    ``inner`` group has ``sizes[inner] = num_blocks * block_size`` units, one per entry of the
    axis, and its permutation is *block-diagonal*: it reorders the units of every block
    among themselves (``perm[j * block_size + k]`` lies in block ``j``), independently in
    each block. Unit ``(i, k)`` of the permuted axis is unit ``perms[inner][j * block_size +
    k]`` of the original, with ``j = perms[outer][i]``: the index is the inner permutation
    with its blocks reordered by the outer one, so each block carries its own inner
    permutation wherever it moves. Keeping the inner permutation an ordinary ``(n,)``
    vector keeps :class:`pyperm.nn.Permutations`, its JSON form and the identity as for
    every other group; its validation checks the block-diagonal structure.

    The outer group may act on other axes too (a per-head parameter); an inner group
    appears only in ``Blocks`` entries with the same outer group. Several inner groups
    may share one outer group: in attention, the heads of q, k, v and the output
    projection move together, while q and k share one within-head permutation and v (with
    the output projection's columns) has its own.

    ``outer`` may also be a number of blocks that stay in place, each with its own inner
    permutation (the output channels of a grouped convolution whose input groups cannot
    move).

    Parameters
    ----------
    outer : str or int
        The group permuting the blocks, or the number of blocks when they stay in place.
    inner : str
        The group permuting the units within each block.

    Examples
    --------
    Two heads of 3 dimensions: new head 0 is old head 1 unchanged, new head 1 is old
    head 0 with its dimensions reordered ``[2, 0, 1]``:

    >>> spec = PermutationSpec({"q.weight": (Blocks("h", "d"), None), "out.weight": (None, Blocks("h", "d"))},
    ...                        {"h": 2, "d": 6})
    >>> spec.axis_index("q.weight", 0, {"h": [1, 0], "d": [2, 0, 1, 3, 4, 5]}).tolist()
    [3, 4, 5, 2, 0, 1]
    """

    outer: str | int
    inner: str

    def __post_init__(self) -> None:
        if not isinstance(self.inner, str):
            raise TypeError(f"Blocks inner must be a group name, got {type(self.inner).__name__}")
        if not isinstance(self.outer, str):
            if isinstance(self.outer, bool) or not isinstance(self.outer, numbers.Integral):
                raise TypeError(f"Blocks outer must be a group name or an int, got {type(self.outer).__name__}")
            object.__setattr__(self, "outer", check_positive_int(self.outer, "Blocks outer"))
        if self.outer == self.inner:
            raise ValueError(f"Blocks outer and inner must be different groups, got {self.outer!r} for both")

    def groups(self) -> tuple[str, ...]:
        """The groups this form names: its outer group if it names one, then its inner group."""
        return (self.outer, self.inner) if isinstance(self.outer, str) else (self.inner,)

    def renamed(self, mapping: Mapping[str, str]) -> Blocks:
        """The same form over the groups ``mapping`` gives for its own (every one must be there)."""
        return Blocks(mapping[self.outer] if isinstance(self.outer, str) else self.outer, mapping[self.inner])


@dataclass(frozen=True, init=False)
class Segments:
    """A concatenation along one axis: consecutive parts, each permuted on its own.

    Parameters
    ----------
    *parts : str, int, Tiled, Blocks or Interleaved
        In axis order: a group name (its units), a number of units that are never
        permuted (a model input concatenated to features, say), a :class:`Tiled` or a
        :class:`Blocks` part (the q, k and v thirds of a fused projection), or an
        :class:`Interleaved` one (a shuffled half).
        A group may appear in several parts (its permutation then acts on each).

    Examples
    --------
    A head reading ``torch.cat([a, b, x], dim=1)`` of two hidden layers (4 and 3 units)
    and 2 input features:

    >>> spec = PermutationSpec({"a.weight": ("a", None), "b.weight": ("b", None),
    ...                         "head.weight": (None, Segments("a", "b", 2))}, {"a": 4, "b": 3})
    >>> spec.axis_index("head.weight", 1, {"a": [3, 2, 1, 0], "b": [0, 2, 1]}).tolist()
    [3, 2, 1, 0, 4, 6, 5, 7, 8]
    """

    parts: tuple

    def __init__(self, *parts: str | int | Tiled | Blocks | Interleaved) -> None:
        if not parts:
            raise ValueError("Segments needs at least one part")
        object.__setattr__(self, "parts", _checked_parts("Segments", parts, (str, Tiled, Blocks, Interleaved)))

    def __repr__(self) -> str:
        return f"Segments({', '.join(map(repr, self.parts))})"

    def groups(self) -> tuple[str, ...]:
        """The groups the parts name, in axis order, each once."""
        return tuple(dict.fromkeys(g for part in self.parts if not isinstance(part, int) for g in entry_groups(part)))

    def renamed(self, mapping: Mapping[str, str]) -> Segments:
        """The same parts over the groups ``mapping`` gives for their own (every one must be there)."""
        return Segments(*[part if isinstance(part, int) else rename_entry(part, mapping) for part in self.parts])


@dataclass(frozen=True, init=False)
class Interleaved:
    """Parts taken in turn along one axis: with ``k`` parts, entry ``k * i + j`` is entry ``i`` of part ``j``.

    ShuffleNet's channel shuffle (``cat(a, b)`` viewed as ``(2, C/2)``, transposed and merged
    back) interleaves two halves, each permuted on its own. The parts have equal lengths, or
    the first ones one entry more than the rest (the parts' lengths are non-increasing and
    differ by at most one): taking them in turn then fills the axis with no gap, as a
    ``chunk`` of an interleave leaves it.

    Parameters
    ----------
    *parts : str, int, Tiled, Blocks, Segments or Interleaved
        At least two, in turn order: a group name (its units), a number of entries that are
        never permuted, or a form laid out along the part (an interleave of interleaves is
        what a deep stack of channel shuffles builds).

    Examples
    --------
    A layer reading two shuffled halves of 3 units each:

    >>> spec = PermutationSpec({"a.weight": ("a", None), "b.weight": ("b", None),
    ...                         "head.weight": (None, Interleaved("a", "b"))}, {"a": 3, "b": 3})
    >>> spec.axis_index("head.weight", 1, {"a": [2, 1, 0], "b": [0, 2, 1]}).tolist()
    [4, 1, 2, 5, 0, 3]
    """

    parts: tuple

    def __init__(self, *parts: str | int | Tiled | Blocks | Segments | Interleaved) -> None:
        if len(parts) < 2:
            raise ValueError(f"Interleaved needs at least two parts, got {len(parts)}")
        object.__setattr__(self, "parts", _checked_parts("Interleaved", parts, (str, Tiled, Blocks, Segments,
                                                                                Interleaved)))  # fmt: skip

    def __repr__(self) -> str:
        return f"Interleaved({', '.join(map(repr, self.parts))})"

    def groups(self) -> tuple[str, ...]:
        """The groups the parts name, in turn order, each once."""
        return tuple(dict.fromkeys(g for part in self.parts if not isinstance(part, int) for g in entry_groups(part)))

    def renamed(self, mapping: Mapping[str, str]) -> Interleaved:
        """The same parts over the groups ``mapping`` gives for their own (every one must be there)."""
        return Interleaved(*[part if isinstance(part, int) else rename_entry(part, mapping) for part in self.parts])


def _checked_parts(form: str, parts: tuple, kinds: tuple) -> tuple:
    """The parts of a Segments or Interleaved form, fixed ones as Python ints (the rest of the spec tells
    them from groups with ``isinstance(part, int)``)."""
    checked = []
    for part in parts:
        if isinstance(part, kinds):
            checked.append(part)
        elif isinstance(part, numbers.Integral) and not isinstance(part, bool):
            checked.append(check_positive_int(part, f"a fixed {form} part"))
        else:
            names = ", ".join(k.__name__ for k in kinds if k is not str)
            raise TypeError(f"{form} parts must be group names, ints, {names}, got {type(part).__name__}")
    return tuple(int(p) if isinstance(p, int) else p for p in checked)


def _leaf_parts(entry: Any) -> list[Any]:
    """The parts of an axis entry that are no concatenation or interleave (groups, ints, Tiled, Blocks),
    found through nested Segments and Interleaved forms."""
    if isinstance(entry, (Segments, Interleaved)):
        return [leaf for part in entry.parts for leaf in _leaf_parts(part)]
    return [] if entry is None else [entry]


AxisEntry = str | Tiled | Blocks | Segments | Interleaved | None


def entry_groups(entry: AxisEntry) -> tuple[str, ...]:
    """The groups an axis entry names, in order, each once (none for ``None``).

    Examples
    --------
    >>> entry_groups("h"), entry_groups(None), entry_groups(Segments("a", 2, Tiled("b", outer="c")))
    (('h',), (), ('a', 'b', 'c'))
    """
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry.groups()


def _entry_blocks(entry: Any) -> list[Blocks]:
    """The Blocks parts of an axis entry."""
    return [part for part in _leaf_parts(entry) if isinstance(part, Blocks)]


def rename_entry(entry: AxisEntry, mapping: Mapping[str, str]) -> AxisEntry:
    """The axis entry with every group it names replaced by ``mapping[group]`` (``None`` stays ``None``).

    Examples
    --------
    >>> rename_entry(Segments("a", 2, Tiled("b", inner=4)), {"a": "P_0", "b": "P_1"})
    Segments('P_0', 2, Tiled(group='P_1', outer=1, inner=4))
    """
    if entry is None:
        return None
    return mapping[entry] if isinstance(entry, str) else entry.renamed(mapping)


@dataclass(frozen=True)
class PermutationSpec:
    """The permutation groups of a model and the tensor axes each one acts on.

    Parameters
    ----------
    axes : mapping of str to tuple of (str, Segments, Tiled, Blocks or None)
        For every ``state_dict`` key of the model, one entry per axis of that tensor:
        the name of the permutation group acting on the axis, a structured form
        (:class:`Segments`, :class:`Tiled`, :class:`Blocks`; see the module notes), or ``None``. Keys
        whose tensors are never permuted (``num_batches_tracked``, the last layer's
        bias) are listed with all-``None`` axes, so a spec covers the whole state dict.
        A group may act on two axes of one tensor (``P W P^T``).
    sizes : mapping of str to int
        The size of every group (number of units it permutes).

    Raises
    ------
    ValueError
        A group is used by no axis, an axis names an unknown group, or a :class:`Blocks`
        inner group is used elsewhere than as the inner group of one outer group, or has
        a size that is not a multiple of its outer group's.
    TypeError
        An axis entry is none of the forms above.

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
        sizes = {str(k): check_positive_int(v, f"sizes[{k!r}]") for k, v in self.sizes.items()}
        used: dict[str, list[tuple[str, int]]] = {g: [] for g in sizes}
        structured = False
        for key, groups in axes.items():
            named = [g for g in groups if isinstance(g, str)]
            structured = structured or len(named) != len(set(named))
            for axis, entry in enumerate(groups):
                if entry is not None and not isinstance(entry, (str, Tiled, Blocks, Segments, Interleaved)):
                    raise TypeError(
                        f"tensor {key!r} axis {axis}: an axis entry must be a group name, Segments, Tiled, Blocks, "
                        f"Interleaved or None, got {type(entry).__name__}"
                    )
                structured = structured or isinstance(entry, (Tiled, Blocks, Segments, Interleaved))
                for g in entry_groups(entry):
                    if g not in sizes:
                        raise ValueError(f"tensor {key!r} axis {axis} names unknown group {g!r}")
                    used[g].append((key, axis))
        unused = [g for g, where in used.items() if not where]
        if unused:
            raise ValueError(f"groups {unused} act on no tensor axis")
        blocks = self._check_blocks(axes, sizes)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "sizes", sizes)
        self._check_interleaves()
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "group_axes", {g: tuple(w) for g, w in used.items()})
        object.__setattr__(self, "_structured", structured)
        object.__setattr__(self, "_blocks", blocks)

    @staticmethod
    def _check_blocks(axes: Mapping[str, AxisGroups], sizes: Mapping[str, int]) -> dict[str, str | int]:
        """Map every Blocks inner group to its outer group, checking it is used only there."""
        outer_of: dict[str, str | int] = {}
        for key, groups in axes.items():
            for axis, entry in enumerate(groups):
                for b in _entry_blocks(entry):
                    if outer_of.setdefault(b.inner, b.outer) != b.outer:
                        raise ValueError(
                            f"tensor {key!r} axis {axis}: Blocks inner group {b.inner!r} has outer group {b.outer!r} "
                            f"here and {outer_of[b.inner]!r} elsewhere; an inner group belongs to one outer group"
                        )
        for key, groups in axes.items():
            for axis, entry in enumerate(groups):
                # Every use of an inner group other than as a Blocks inner (a plain entry, a
                # Tiled or Segments part, an outer group) would permute across its blocks.
                for part in _leaf_parts(entry):
                    named = [part] if isinstance(part, str) else list(part.groups()) if isinstance(part, Tiled) else []
                    named += [part.outer] if isinstance(part, Blocks) and isinstance(part.outer, str) else []
                    for g in named:
                        if g in outer_of:
                            raise ValueError(
                                f"tensor {key!r} axis {axis}: group {g!r} is a Blocks inner group and may only appear "
                                f"as Blocks({outer_of[g]!r}, {g!r})"
                            )
        for inner, outer in outer_of.items():
            count = sizes[outer] if isinstance(outer, str) else outer
            if sizes[inner] % count:
                what = f"outer group {outer!r} size" if isinstance(outer, str) else "the number of blocks,"
                raise ValueError(
                    f"Blocks inner group {inner!r} has size {sizes[inner]}, not a multiple of {what} {count} "
                    "(the inner group has one unit per entry of the axis)"
                )
        return outer_of

    @property
    def blocks(self) -> dict[str, str | int]:
        """Every :class:`Blocks` inner group mapped to its outer group, or to its number of
        blocks when they stay in place (empty for other specs)."""
        return dict(self._blocks)  # type: ignore[attr-defined]

    def num_blocks(self, inner: str) -> int:
        """The number of blocks of the :class:`Blocks` inner group ``inner``."""
        if inner not in self._blocks:  # type: ignore[attr-defined]
            raise ValueError(f"group {inner!r} is not a Blocks inner group")
        outer = self._blocks[inner]  # type: ignore[attr-defined]
        return self.sizes[outer] if isinstance(outer, str) else outer

    def block_size(self, inner: str) -> int:
        """The number of units in each block of the :class:`Blocks` inner group ``inner``."""
        return self.sizes[inner] // self.num_blocks(inner)

    @property
    def structured(self) -> bool:
        """Whether some axis uses a structured form or some tensor names a group on two axes."""
        return self._structured  # type: ignore[attr-defined]

    def axis_length(self, key: str, axis: int) -> int | None:
        """The number of entries the spec gives ``axes[key][axis]`` (None when the axis is not permuted)."""
        return self.entry_length(self.axes[key][axis])

    def entry_length(self, entry: Any) -> int | None:
        """The number of positions an axis entry (or a part of one) spans: a group's size, a fixed
        part's int, a structured form's total; None for an unpermuted axis (``None``)."""
        if entry is None or isinstance(entry, int):
            return entry
        if isinstance(entry, str):
            return self.sizes[entry]
        if isinstance(entry, Tiled):
            return self._copies(entry) * self.entry_length(entry.group) * entry.inner  # type: ignore[operator]
        if isinstance(entry, Blocks):
            return self.sizes[entry.inner]
        return sum(self.entry_length(part) for part in entry.parts)  # type: ignore[misc]

    def _check_interleaves(self) -> None:
        """Raise ValueError unless every Interleaved form's parts fill its axis in turn: their lengths
        non-increasing and within one of each other."""

        def check(entry: Any, key: str, axis: int) -> None:
            if isinstance(entry, (Segments, Interleaved)):
                for part in entry.parts:
                    check(part, key, axis)
            if isinstance(entry, Interleaved):
                lengths = [self.entry_length(part) for part in entry.parts]
                if any(a < b for a, b in zip(lengths, lengths[1:])) or lengths[0] - lengths[-1] > 1:
                    raise ValueError(
                        f"tensor {key!r} axis {axis}: Interleaved parts span {lengths} entries; taken in turn they "
                        "must have equal lengths, or the first ones one entry more than the rest"
                    )

        for key, groups in self.axes.items():
            for axis, entry in enumerate(groups):
                check(entry, key, axis)

    def _copies(self, entry: Tiled) -> int:
        """The number of copies of a Tiled entry (its outer group's size when it names one)."""
        return self.sizes[entry.outer] if isinstance(entry.outer, str) else entry.outer

    def axis_index(self, key: str, axis: int, perms: Mapping[str, Any]) -> Any:
        """The index that permutes ``axes[key][axis]``: ``t.index_select(axis, index)``; None if not permuted.

        Parameters
        ----------
        key : str
            A ``state_dict`` key of the spec.
        axis : int
            An axis of that tensor.
        perms : mapping of str to (n,) int array or tensor
            One permutation per group (checked by the caller; see
            :class:`pyperm.nn.Permutations`).

        Returns
        -------
        torch.Tensor or None
            An int64 index on the device of the permutations.
        """
        import torch

        def index(entry: Any) -> torch.Tensor:
            if isinstance(entry, str):
                return torch.as_tensor(perms[entry], dtype=torch.int64)
            if isinstance(entry, Tiled):
                p = index(entry.group)  # a tiled unit: its own index, alike in every copy
                n = p.numel()
                copies = (
                    torch.as_tensor(perms[entry.outer], dtype=torch.int64).to(p.device)
                    if isinstance(entry.outer, str)
                    else torch.arange(entry.outer, device=p.device)
                )  # copies moved by the outer group, or in place
                outer = copies.view(-1, 1, 1) * (n * entry.inner)
                inner = torch.arange(entry.inner, device=p.device).view(1, 1, -1)
                return (outer + p.view(1, -1, 1) * entry.inner + inner).reshape(-1)
            if isinstance(entry, Blocks):
                # The inner permutation, block-diagonal, with its blocks reordered by the outer one.
                d = torch.as_tensor(perms[entry.inner], dtype=torch.int64)
                fixed = not isinstance(entry.outer, str)
                p = torch.arange(entry.outer) if fixed else torch.as_tensor(perms[entry.outer], dtype=torch.int64)
                return d.view(p.numel(), -1)[p.to(d.device)].reshape(-1)
            parts = [torch.arange(part) if isinstance(part, int) else index(part) for part in entry.parts]
            device = parts[0].device
            if isinstance(entry, Interleaved):
                # Entry k*i + j is entry i of part j: part j's index, scaled into its turns.
                k = len(parts)
                out = torch.empty(sum(p.numel() for p in parts), dtype=torch.int64, device=device)
                for j, part in enumerate(parts):
                    out[j::k] = part.to(device) * k + j
                return out
            offsets = [0] + [p.numel() for p in parts[:-1]]
            return torch.cat([p.to(device) + o for p, o in zip(parts, itertools.accumulate(offsets))])

        entry = self.axes[key][axis]
        return None if entry is None else index(entry)

    def unit_positions(self, key: str, axis: int, group: str, *, outer_blocks: bool = True) -> Any:
        """Where each unit of ``group`` sits along ``axes[key][axis]``: an (n, k) int64 tensor.

        Row ``u`` lists the ``k`` entries of the axis that unit ``u`` owns (one for a
        plain group or a :class:`Blocks` inner group; ``outer * inner`` per :class:`Tiled`
        part; a whole block for a :class:`Blocks` outer group; more when the group is in
        several :class:`Segments` parts). Permuting the group by ``perm`` moves row
        ``perm[i]`` to row ``i``. Weight matching reads a group's similarity from these;
        with ``outer_blocks=False`` it leaves out the :class:`Blocks` parts the group
        permutes as an outer group (those it reads through the inner group).

        Examples
        --------
        >>> spec = PermutationSpec({"w": (Segments("a", Tiled("b", inner=2)),)}, {"a": 2, "b": 3})
        >>> spec.unit_positions("w", 0, "b").tolist()
        [[2, 3], [4, 5], [6, 7]]
        """
        import torch

        if group not in self.sizes:
            raise ValueError(f"unknown group {group!r}")
        n = self.sizes[group]

        def positions(entry: Any, place: torch.Tensor) -> list[Any]:
            # ``place``: the axis position of every entry of ``entry`` (a part sits at a slice or a stride).
            if entry == group:
                return [place.reshape(n, 1)]
            if isinstance(entry, Tiled) and entry.group == group:
                inner = torch.arange(entry.inner).view(1, 1, -1)
                outer = torch.arange(self._copies(entry)).view(1, -1, 1) * (n * entry.inner)
                return [place[(torch.arange(n).view(-1, 1, 1) * entry.inner + outer + inner).reshape(n, -1)]]
            if isinstance(entry, Tiled) and entry.outer == group:  # whole copies
                return [place.reshape(n, -1)]
            if isinstance(entry, Tiled) and group in entry_groups(entry.group):  # a unit form, in every copy
                tiles = place.reshape(self._copies(entry), -1, entry.inner)
                return [torch.cat([torch.cat(positions(entry.group, tile[:, i]), 1)
                                   for tile in tiles for i in range(entry.inner)], 1)]  # fmt: skip
            if isinstance(entry, Blocks) and entry.inner == group:
                return [place.reshape(n, 1)]
            if isinstance(entry, Blocks) and entry.outer == group and outer_blocks:
                return [place.reshape(n, -1)]
            if isinstance(entry, (Segments, Interleaved)):
                found, offset, k = [], 0, len(entry.parts)
                for j, part in enumerate(entry.parts):
                    length = self.entry_length(part)
                    sub = place[j::k] if isinstance(entry, Interleaved) else place[offset : offset + length]
                    found += [] if isinstance(part, int) else positions(part, sub)
                    offset += length  # type: ignore[operator]
                return found
            return []

        entry = self.axes[key][axis]
        found = positions(entry, torch.arange(self.entry_length(entry) or 0))
        if not found:
            if not outer_blocks and (key, axis) in self.group_axes[group]:
                return torch.zeros(n, 0, dtype=torch.int64)  # only Blocks parts here
            raise ValueError(f"group {group!r} does not act on {key!r} axis {axis}")
        return torch.cat(found, dim=1)

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
                n = self.entry_length(g)
                if n is not None and shape[axis] != n:
                    what = f"group {g!r} has size {n}" if isinstance(g, str) else f"{g!r} spans {n} entries"
                    raise ValueError(f"{name}[{key!r}] axis {axis} has size {shape[axis]}; {what}")

    @classmethod
    def from_model(
        cls, model: Any, example_input: Any, *, composite: str | None = None, structured: bool = True
    ) -> PermutationSpec:
        """Build the spec of ``model`` by tracing it with :mod:`torch.fx`, or with :mod:`torch.export`
        where torch.fx cannot trace it (Hugging Face transformers: see :func:`pyperm.nn.trace_model`).

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
        structured : bool, default True
            Describe concatenations, flattened feature maps, head splits and layers
            applied to their own output with structured axes (:class:`Segments`,
            :class:`Tiled`, :class:`Blocks` for the heads of ``nn.MultiheadAttention`` and
            the channel groups of grouped convolutions, one group on two axes), so that
            their units are permuted too; every method of :mod:`pyperm.nn` takes such a
            spec. ``structured=False`` gives the flat spec, one group per axis, with those
            units left unpermuted (as ``composite`` says).

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
        # Imported here, not at the top: the tracer builds specs (pyperm.nn.trace imports this
        # module) and needs torch.fx, which a spec itself never does.
        from pyperm.nn.trace import trace_model

        return trace_model(model, example_input, composite=composite, structured=structured).spec

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
        # A Blocks outer group and its inner groups act on the same axes: size and role tell them apart.
        theirs: dict[frozenset, list[str]] = {}
        for h, where in other.group_axes.items():
            theirs.setdefault(frozenset(where), []).append(h)
        mapping: dict[str, str] = {}
        for g, where in self.group_axes.items():
            candidates = [
                h for h in theirs.get(frozenset(where), [])
                if other.sizes[h] == self.sizes[g] and (h in other.blocks) == (g in self.blocks)
                and h not in mapping.values()
            ]  # fmt: skip
            h = candidates[0] if candidates else None
            if h is None:
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
        if len(mapping) != len(other.sizes):
            return None
        if (self.structured or other.structured) and any(
            rename_entry(entry, mapping) != other.axes[key][axis]
            for key, groups in self.axes.items()
            for axis, entry in enumerate(groups)
        ):
            return None  # the same groups, arranged differently within an axis
        return mapping

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
