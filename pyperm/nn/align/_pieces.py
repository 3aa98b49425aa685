"""A permutation spec lowered to plain tensor pieces, for the weight-matching similarities.

Every axis form of :mod:`pyperm.nn.spec` permutes by an index built from the groups; weight
matching needs each group's similarity as a sum of matrix products. Both follow from one
observation: every form is a plain axis after a reshape or a cut.

- :class:`~pyperm.nn.spec.Tiled` ``(outer, n, inner)`` is three axes: the copies (permuted by
  the outer group, or not at all), the group's units, and ``inner`` unpermuted entries.
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
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pyperm.nn.spec import Blocks, Interleaved, PermutationSpec, Tiled

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
    """

    key: str
    cuts: tuple[tuple[int, int, int, int], ...]
    shape: tuple[int, ...]
    labels: tuple[Label, ...]

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The piece of ``tensor`` (a view when the cuts and the reshape allow one)."""
        for axis, start, length, step in self.cuts:
            if step == 1:
                tensor = tensor.narrow(axis, start, length)
            else:
                tensor = tensor[(slice(None),) * axis + (slice(start, start + step * (length - 1) + 1, step),)]
        return tensor.reshape(self.shape)


def label_groups(label: Label) -> tuple[str, ...]:
    """The groups whose permutations move an axis with this label."""
    if label is None:
        return ()
    return (label,) if isinstance(label, str) else label.groups()


def lower(spec: PermutationSpec, shapes: Mapping[str, tuple[int, ...]], keys: Iterable[str]) -> list[Piece]:
    """The pieces of the entries ``keys`` (their ``shapes``) that some group acts on; the other
    entries do not depend on the permutations."""
    pieces = []
    for key in keys:
        entries = spec.axes[key]
        if all(e is None for e in entries):
            continue
        per_axis = [
            _axis_parts(spec, e) if e is not None else [(0, 1, n, [n], [None])] for e, n in zip(entries, shapes[key])
        ]
        for combo in itertools.product(*per_axis):
            cuts, shape, labels = [], [], []
            for axis, (start, step, length, sub_shape, sub_labels) in enumerate(combo):
                if length != shapes[key][axis]:
                    cuts.append((axis, start, length, step))
                shape += sub_shape
                labels += sub_labels
            pieces.append(Piece(key, tuple(cuts), tuple(shape), tuple(labels)))
    return pieces


def _axis_parts(spec: PermutationSpec, entry: Any) -> list[tuple[int, int, int, list[int], list[Label]]]:
    """The parts of an axis entry: ``(start, step, length, sub_shape, sub_labels)`` each (the part's
    entries are ``start, start + step, ...``)."""
    if isinstance(entry, int):
        return [(0, 1, entry, [entry], [None])]
    if isinstance(entry, str):
        n = spec.sizes[entry]
        return [(0, 1, n, [n], [entry])]
    if isinstance(entry, Blocks):
        n = spec.sizes[entry.inner]
        return [(0, 1, n, [n], [entry])]
    if isinstance(entry, Tiled):
        copies = spec.sizes[entry.outer] if isinstance(entry.outer, str) else entry.outer
        subs = [(copies, entry.outer if isinstance(entry.outer, str) else None),
                (spec.sizes[entry.group], entry.group), (entry.inner, None)]  # fmt: skip
        # Unpermuted sub-axes of length 1 dropped: Tiled("g") lowers like "g" itself.
        subs = [(n, label) for n, label in subs if label is not None or n > 1] or [(1, None)]
        return [(0, 1, math.prod(n for n, _ in subs), [n for n, _ in subs], [label for _, label in subs])]
    # A Segments or an Interleaved entry: every part of a part lands at the place its parent gives it.
    parts, offset, k = [], 0, len(entry.parts)
    for j, part in enumerate(entry.parts):
        for start, step, length, shape, labels in _axis_parts(spec, part):
            if isinstance(entry, Interleaved):  # part j's entry i sits at k * i + j
                parts.append((j + k * start, k * step, length, shape, labels))
            else:
                parts.append((offset + start, step, length, shape, labels))
        offset += part if isinstance(part, int) else spec._length(part)
    return parts


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
