"""Activation matching of groups that share structured readings (Blocks, Tiled copies moved by a group).

:func:`pyperm.nn.activation_matching` solves every plain group on its own; the groups of a
grouped convolution or of attention heads are tied together by the forms of the axes they
are read from, and are solved here, together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import pyperm
from pyperm.nn.align._matcher import WeightMatcher
from pyperm.nn.align._pieces import inner_of_pairs
from pyperm.nn.spec import Blocks, PermutationSpec, Tiled, entry_groups

__all__ = ["solve_joint"]


def solve_joint(
    spec: PermutationSpec, forms: Sequence[Any], mats: Sequence[np.ndarray], groups: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The permutations of ``groups``, which share structured readings, solved together.

    Reading ``i`` holds units in the form ``forms[i]`` (a group name or a structured spec
    entry) and has the similarity ``mats[i]`` (A's units by B's); readings naming other
    groups are left out. Each is matched by the permutation of its axis that its form builds
    out of the groups: maximise the sum over readings of ``M[p, index[p]]``. That is weight
    matching's objective for a tensor pair ``(M^T, I)`` whose second axis has the reading's
    form, so the weight matcher does it (assignments of assignments for
    Blocks, coordinate ascent that never decreases), from :func:`_relaxed_start`.
    """
    axes: dict[str, tuple[Any, ...]] = {}
    state_a: dict[str, torch.Tensor] = {}
    state_b: dict[str, torch.Tensor] = {}
    for i, form in enumerate(forms):
        if set(entry_groups(form)) <= set(groups):
            axes[f"r{i}"] = (None, form)
            m = torch.from_numpy(mats[i])
            state_a[f"r{i}"], state_b[f"r{i}"] = m.T.contiguous(), torch.eye(m.shape[0], dtype=torch.float64)
    joint = PermutationSpec(axes, {g: spec.sizes[g] for g in groups})
    start = _relaxed_start(joint, {key: mats[int(key[1:])] for key in axes})
    found = WeightMatcher(joint, state_b, dtype=torch.float64).match(state_a, init=start)
    return dict(found.perms)


def _pair_blocks(m: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """For every (A block, B block) pair of an (n, n) similarity cut into ``nb`` blocks: the best
    matching of their units, on its own. Returns its value (nb, nb) and its columns (nb, nb, bs)."""
    bs = m.shape[0] // nb
    stack = np.ascontiguousarray(m.reshape(nb, bs, nb, bs).transpose(0, 2, 1, 3).reshape(nb * nb, bs, bs))
    _, cols = pyperm.batch_linear_sum_assignment(stack, maximize=True)
    value = np.take_along_axis(stack, cols[:, :, None], 2).sum((1, 2)).reshape(nb, nb)
    return value, cols.reshape(nb, nb, bs)


def _relaxed_start(joint: PermutationSpec, mats: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """A start for the joint solve that no group's order biases (coordinate ascent from the
    identity stalls on heads and head dims, as weight matching does).

    Every outer group pairs the blocks by the best matching of their units, each pair on its
    own (exact for Blocks, a relaxation for Tiled copies, whose units move alike in every block);
    every other group is then solved given its outer group.
    """
    forms: dict[Any, np.ndarray] = {}  # the readings' similarities summed per form
    for key, m in mats.items():
        form = joint.axes[key][1]
        forms[form] = forms[form] + m if form in forms else m
    start: dict[str, torch.Tensor] = {}
    pairs: dict[Any, np.ndarray] = {}
    for o in joint.groups:
        nb = joint.sizes[o]
        value = np.zeros((nb, nb))
        for form, m in forms.items():
            if form == o:
                value += m
            elif isinstance(form, (Tiled, Blocks)) and form.outer == o:
                v, pairs[form] = _pair_blocks(m, nb)
                value += v
        if value.any():
            start[o] = torch.as_tensor(pyperm.linear_sum_assignment(value, maximize=True)[1], dtype=torch.int64)
    for g in joint.groups:
        n = joint.sizes[g]
        cost = np.zeros((n, n))
        for form, m in forms.items():
            if form == g and g not in start:
                cost += m
            elif isinstance(form, Tiled) and form.group == g and form.outer in start:
                outer = start[form.outer].numpy()  # A's block k meets B's block outer[k]
                blocks = m.reshape(len(outer), n, form.inner, len(outer), n, form.inner)
                # A's unit i of block k meets B's unit j of block outer[k], entry by entry of their inner copies.
                cost += np.einsum("kitjt->ij", blocks[np.arange(len(outer)), :, :, outer])
            elif isinstance(form, Blocks) and form.inner == g and form.outer in start:
                outer = start[form.outer]
                start[g] = inner_of_pairs(outer, torch.as_tensor(pairs[form][np.arange(len(outer)), outer.numpy()]))
        if g not in start and cost.any():
            start[g] = torch.as_tensor(pyperm.linear_sum_assignment(cost, maximize=True)[1], dtype=torch.int64)
    return {g: start.get(g, torch.arange(n)) for g, n in joint.sizes.items()}
