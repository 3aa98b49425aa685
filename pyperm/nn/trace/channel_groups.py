"""Channel groups: the symmetry GroupNorm leaves to the channels it normalises.

GroupNorm computes its statistics over consecutive groups of channels and scales every
channel by its own affine parameters. A permutation of its input's channels keeps its
function (up to the same permutation of the output) exactly when it maps every group onto
a group: whole groups may move, and the channels within each group may be reordered, each
group on its own. That is a :class:`~pyperm.nn.trace.labels.BlockAxis` (a spec's
:class:`~pyperm.nn.spec.Blocks`).

One class of units often meets several GroupNorms: every resnet block of a residual stream
normalises it alike (the same groups: one ``Blocks`` for them all), while a U-Net's skip
concatenation normalises ``cat([h, skip])`` with groups whose boundaries differ from those the
skip's own stream was normalised with. A class that must keep several different partitions
cannot move its blocks (the spec has no form for partitions that must both be kept); it is cut
at every boundary of every partition instead (:meth:`UnitClasses.cut`), so that each piece
between two boundaries (a subset of one group of each partition) is permuted on its own and
stays in place. A piece of one unit has no order and stays where it is.

The constraints are collected while the graph is labelled (:meth:`ChannelGroups.add`) and
resolved once it has run (:meth:`ChannelGroups.resolve`), when every class has met all its
partitions and every concatenation is known, so the outcome does not depend on the order in
which the GroupNorms ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyperm.nn.trace.labels import BlockAxis, CatAxis, UnitClasses

__all__ = ["ChannelGroups"]


@dataclass
class _Partition:
    """The group boundaries a class meets, relative to its own first unit, and where they came from."""

    points: tuple[int, ...]
    block: int | None  # the group size when the class is exactly a run of whole groups, else None
    where: str
    name: str


@dataclass
class ChannelGroups:
    """The channel partitions GroupNorms put on classes of units, resolved into spec structures.

    Attributes
    ----------
    constraints : list of (entry, group_size, where, name)
        One per GroupNorm over permutable channels: the label of its channel axis, the
        number of channels per group, the operation (for messages) and its module path
        (new groups are named after it).
    """

    constraints: list[tuple[Any, int, str, str]] = field(default_factory=list)

    def add(self, entry: Any, group_size: int, where: str, name: str) -> None:
        """Records that the axis labelled ``entry`` is normalised in groups of ``group_size``."""
        if entry is not None and group_size > 1:
            self.constraints.append((entry, int(group_size), where, name))

    def resolve(self, units: UnitClasses, new_units: Callable[[int, str], int]) -> list[str]:
        """Binds every class met by a GroupNorm to the structure its partitions allow.

        ``new_units(size, name)`` makes a new class of units (the blocks, and the units
        within them). Returns one line per GroupNorm whose channels could not be described
        (its units were fixed): the callers list them as causes of units left unpermuted.
        """
        per_class: dict[int, list[_Partition]] = {}
        failed: list[str] = []
        for entry, group_size, where, name in self.constraints:
            if not self._push(units, entry, 0, units.size(entry), group_size, (where, name), per_class):
                units.fix(entry)
                failed.append(f"{where} normalises groups of {group_size} channels of an axis whose structure "
                              "(a tile, heads, an interleave) a group partition cannot be laid over")  # fmt: skip
        for root, partitions in per_class.items():
            if units.is_fixed(root) or not units.is_active(root):
                continue
            size = units.size(root)
            kinds = {(p.points, p.block) for p in partitions}
            if len(kinds) == 1 and partitions[0].block is not None:
                # One partition into whole groups: blocks move, units within each block too.
                name = partitions[0].name
                outer = new_units(size // partitions[0].block, f"{name}.groups")
                inner = new_units(size, f"{name}.channels")
                units.join(root, BlockAxis(outer, inner))
            else:
                # Several partitions, or groups cut by the class's ends: every piece between two
                # boundaries stays in place and is permuted within.
                points = sorted({p for partition in partitions for p in partition.points})
                if units.cut(root, points) is None:
                    units.fix(root)
                    failed.append(f"{partitions[0].where} normalises channel groups that a cut cannot follow")
        return failed

    def _push(self, units: UnitClasses, entry: Any, start: int, length: int, group_size: int, where: tuple[str, str],
              per_class: dict[int, list[_Partition]]) -> bool:  # fmt: skip
        """Lays the partition (groups of ``group_size`` from position 0 of the normalised axis) over
        ``entry``, which spans ``[start, start + length)`` of it: on a plain class directly, on a
        concatenation part by part. False when the entry is a structure no partition fits."""
        if entry is None or units.is_fixed(entry):
            return True
        structure = units.structure(entry)
        if structure is None:
            first = -(-start // group_size) * group_size  # the first boundary at or after start
            points = tuple(p - start for p in range(first, start + length, group_size) if p > start)
            if not points:  # inside one group: free within, and the class cannot leave it
                return True
            whole = start % group_size == 0 and length % group_size == 0
            per_class.setdefault(units.root(entry), []).append(
                _Partition(points, group_size if whole else None, *where))
            return True
        if isinstance(structure, CatAxis):
            offset = start
            for part, n in structure.parts:
                if not self._push(units, part, offset, n, group_size, where, per_class):
                    return False
                offset += n
            return True
        return False
