"""A permutation spec lowered to plain tensor pieces, for the weight-matching similarities.

Every axis form of :mod:`pyperm.nn.spec` permutes by an index built from the groups; weight
matching needs each group's similarity as a sum of matrix products. Both follow from one
observation: every form is a plain axis after a reshape or a cut.

- :class:`~pyperm.nn.spec.Tiled` ``(outer, n, inner)`` is three axes: the copies (permuted by
  the outer group, or not at all), the group's units, and ``inner`` unpermuted entries; a
  tiled unit (a Tiled group) is its own sub-axes in the middle, and a Segments unit one sub-axis
  cut in every copy alike (a piece per part: a slice of the split axis).
- :class:`~pyperm.nn.spec.Segments` is a concatenation: each part is its own piece of the
  tensor (a slice along that axis), and the objective is the sum over the pieces.
- :class:`~pyperm.nn.spec.Interleaved` is a concatenation too, its parts taken in turn: part
  ``j`` of ``k`` is the strided slice ``j::k`` (a part of a part, the product of the strides).
- :class:`~pyperm.nn.spec.Blocks` stays one axis, labelled by the form itself: other groups
  see it permuted by its whole index (the inner permutation with its blocks reordered by the
  outer one), and its inner group's similarity is read off it unpermuted (the assignment of
  assignments needs every pair of blocks).
- One group on two axes of one piece makes the objective quadratic in it: the piece simply
  carries that label twice.

A flat spec lowers to one piece per tensor, its axes as they are, so the flat and the
structured specs run the same code.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pyperm.nn.spec import Blocks, Interleaved, PermutationSpec, Segments, Tiled

Label = Any  # None, a group name, or a Blocks form


@dataclass(frozen=True)
class Piece:
    """One plain part of a state-dict entry.

    Attributes
    ----------
    key : str
        The state-dict entry.
    cuts : tuple of (axis, start, length, step)
        The slices of the entry it takes (its Segments parts; a step > 1 for Interleaved parts).
    shape : tuple of int
        Its shape once every axis is split into its sub-axes.
    labels : tuple
        Per axis of ``shape``: None (not permuted), a group name, or a :class:`Blocks` form.
    grid : tuple of int
        The shape once every axis is split, before ``sub_cuts`` (empty when there are none).
    sub_cuts : tuple of (axis, start, length)
        The slices of ``grid`` axes it takes: a Segments part of a Tiled unit, the same slice of every copy.
    """

    key: str
    cuts: tuple[tuple[int, int, int, int], ...]
    shape: tuple[int, ...]
    labels: tuple[Label, ...]
    grid: tuple[int, ...] = ()
    sub_cuts: tuple[tuple[int, int, int], ...] = ()

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The piece of ``tensor`` (a view when the cuts and the reshape allow one)."""
        for axis, start, length, step in self.cuts:
            if step == 1:
                tensor = tensor.narrow(axis, start, length)
            else:
                tensor = tensor[(slice(None),) * axis + (slice(start, start + step * (length - 1) + 1, step),)]
        if self.sub_cuts:
            tensor = tensor.reshape(self.grid)
            for axis, start, length in self.sub_cuts:
                tensor = tensor.narrow(axis, start, length)
        return tensor.reshape(self.shape)


def label_groups(label: Label) -> tuple[str, ...]:
    """The groups whose permutations move an axis with this label."""
    if label is None:
        return ()
    return (label,) if isinstance(label, str) else label.groups()


# A sub-axis of a part: (length once split, start and length of the slice taken, label).
Sub = tuple[int, int, int, Label]


def lower(spec: PermutationSpec, shapes: Mapping[str, tuple[int, ...]], keys: Iterable[str]) -> list[Piece]:
    """The pieces of the entries ``keys`` (their ``shapes``) that some group acts on; the other
    entries do not depend on the permutations."""
    pieces = []
    for key in keys:
        entries = spec.axes[key]
        if all(e is None for e in entries):
            continue
        per_axis = [_axis_parts(spec, n if e is None else e) for e, n in zip(entries, shapes[key])]
        for combo in itertools.product(*per_axis):
            cuts, grid, sub_cuts, labels = [], [], [], []
            for axis, (start, step, length, subs) in enumerate(combo):
                if length != shapes[key][axis]:
                    cuts.append((axis, start, length, step))
                for full, sub_start, sub_length, label in subs:
                    if sub_length != full:
                        sub_cuts.append((len(grid), sub_start, sub_length))
                    grid.append(full)
                    labels.append(label)
            shape = tuple(sub[2] for part in combo for sub in part[3])
            grid_shape = tuple(grid) if sub_cuts else ()
            pieces.append(Piece(key, tuple(cuts), shape, tuple(labels), grid_shape, tuple(sub_cuts)))
    return pieces


def _axis_parts(spec: PermutationSpec, entry: Any) -> list[tuple[int, int, int, list[Sub]]]:
    """The parts of an axis entry: ``(start, step, length, subs)`` each (the part's entries are
    ``start, start + step, ...``, split into the sub-axes ``subs``)."""
    if isinstance(entry, int):
        return [(0, 1, entry, [(entry, 0, entry, None)])]
    if isinstance(entry, str):
        n = spec.sizes[entry]
        return [(0, 1, n, [(n, 0, n, entry)])]
    if isinstance(entry, Blocks):
        n = spec.sizes[entry.inner]
        return [(0, 1, n, [(n, 0, n, entry)])]
    if isinstance(entry, Tiled):
        n = spec.entry_length(entry)
        # Unpermuted sub-axes of length 1 dropped: Tiled("g") lowers like "g" itself.
        return [(0, 1, n, [sub for sub in subs if sub[3] is not None or sub[0] > 1] or [(1, 0, 1, None)])
                for subs in _tile_axes(spec, entry)]  # fmt: skip
    # A Segments or an Interleaved entry: every part of a part lands at the place its parent gives it.
    parts, offset, k = [], 0, len(entry.parts)
    for j, part in enumerate(entry.parts):
        for start, step, length, subs in _axis_parts(spec, part):
            if isinstance(entry, Interleaved):  # part j's entry i sits at k * i + j
                parts.append((j + k * start, k * step, length, subs))
            else:
                parts.append((offset + start, step, length, subs))
        offset += spec.entry_length(part)
    return parts


def _tile_axes(spec: PermutationSpec, entry: str | Tiled | Segments) -> list[list[Sub]]:
    """The sub-axes of a Tiled form, one list per piece: copies, the unit's own (a Tiled unit is sub-axes
    in turn; a Segments unit one sub-axis, a piece per part, each taking its slice of it), inner entries."""
    if isinstance(entry, str):
        n = spec.sizes[entry]
        return [[(n, 0, n, entry)]]
    if isinstance(entry, Segments):
        n, offset, pieces = spec.entry_length(entry), 0, []
        for part in entry.parts:
            length = part if isinstance(part, int) else spec.sizes[part]
            pieces.append([(n, offset, length, None if isinstance(part, int) else part)])
            offset += length
        return pieces
    copies = spec.sizes[entry.outer] if isinstance(entry.outer, str) else entry.outer
    outer = (copies, 0, copies, entry.outer if isinstance(entry.outer, str) else None)
    return [[outer, *unit, (entry.inner, 0, entry.inner, None)] for unit in _tile_axes(spec, entry.group)]


def blocks_index(form: Blocks, perms: Mapping[Any, torch.Tensor]) -> torch.Tensor:
    """The index that permutes an axis of the Blocks form: the inner permutation with its blocks
    reordered by the outer one (fixed blocks stay in place)."""
    inner = perms[form.inner]
    if isinstance(form.outer, str):
        outer = perms[form.outer]
    else:
        outer = torch.arange(form.outer, device=inner.device)
    return inner.view(outer.numel(), -1)[outer].reshape(-1)


def inner_of_pairs(outer: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The block-diagonal inner permutation that pairs unit ``l`` of A's block ``i`` with unit
    ``cols[i, l]`` of B's block ``outer[i]`` (``cols``: (nb, bs), indices within the block)."""
    nb, bs = cols.shape
    inner = torch.empty(nb * bs, dtype=torch.int64, device=cols.device)
    # The inner permutation belongs to B's block: block outer[i] of it is that block's order.
    inner.view(nb, bs)[outer] = outer.view(-1, 1) * bs + cols
    return inner
