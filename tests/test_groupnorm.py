"""GroupNorm as a structure: whole channel groups move, and the channels within each group, each group on its own.

A traced GroupNorm gives the classes it normalises a Blocks axis (one partition: every norm of a residual stream
alike), or cuts them into pieces that stay in place (several partitions meet: a U-Net skip concatenation normalised
with other groups than its stream); either way the permuted model computes the same function.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyperm.nn import (
    PermutationSpec,
    Permutations,
    TraceError,
    TraceWarning,
    activation_matching,
    trace_model,
    weight_matching,
)
from pyperm.nn.spec import Blocks, Segments
from pyperm.testing import assert_same_function, random_permutations

from _diffusion import moved_share


class Block(nn.Module):
    """A pre-activation residual block normalised by GroupNorm (the GN ResNets of the re-basin ports)."""

    def __init__(self, c_in: int, c_out: int, groups: int, stride: int = 1) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride) if (c_in, stride) != (c_out, 1) else nn.Identity()

    def forward(self, x):
        h = self.conv1(torch.relu(self.norm1(x)))
        return self.shortcut(x) + self.conv2(torch.relu(self.norm2(h)))


class GNResNet(nn.Module):
    def __init__(self, groups: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(Block(8, 8, groups), Block(8, 16, groups, 2), Block(16, 16, groups))
        self.norm = nn.GroupNorm(groups, 16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu(self.norm(self.blocks(self.stem(x))))
        return self.fc(h.mean((2, 3)))


class CatThenNorm(nn.Module):
    """Two branches of ``a`` and ``b`` channels concatenated and normalised in ``groups`` groups, each branch
    normalised on its own first in ``own`` groups (0: not at all)."""

    def __init__(self, a: int, b: int, groups: int, own: int = 0) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, a, 1)
        self.b = nn.Conv2d(3, b, 1)
        self.norm_a = nn.GroupNorm(own, a) if own else nn.Identity()
        self.norm_b = nn.GroupNorm(own, b) if own else nn.Identity()
        self.norm = nn.GroupNorm(groups, a + b)
        self.out = nn.Conv2d(a + b, 2, 1)

    def forward(self, x):
        h = torch.cat([torch.relu(self.norm_a(self.a(x))), torch.relu(self.norm_b(self.b(x)))], dim=1)
        return self.out(torch.relu(self.norm(h)))


def _x(seed: int = 0, batch: int = 2, size: int = 6) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _planted_is_found(model: nn.Module, spec: PermutationSpec) -> None:
    sa = {k: v.double() for k, v in model.state_dict().items()}
    plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(2)))
    assert plant != Permutations(spec, spec.identity())
    assert weight_matching(spec, sa, plant.apply(sa)).perms == plant.inverse()


def test_a_group_norm_moves_whole_groups_and_the_channels_within_each():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 6, 1), nn.ReLU(),
                          nn.Conv2d(6, 2, 1))  # fmt: skip
    spec = PermutationSpec.from_model(model, _x())
    entry = spec.axes["0.weight"][0]
    assert isinstance(entry, Blocks) and spec.sizes[entry.outer] == 2 and spec.sizes[entry.inner] == 8
    assert spec.axes["1.weight"] == (entry,) and spec.axes["1.bias"] == (entry,)
    assert spec.axes["3.weight"][1] == entry
    assert_same_function(model, spec, _x(1), train=True, rtol=1e-5, atol=1e-6)
    _planted_is_found(model, spec)


@pytest.mark.parametrize("groups", [1, 8])
def test_one_group_or_one_channel_a_group_is_a_plain_group(groups):
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(groups, 8), nn.ReLU(), nn.Conv2d(8, 2, 1))
    spec = PermutationSpec.from_model(model, _x())
    assert isinstance(spec.axes["0.weight"][0], str) and spec.axes["1.weight"] == (spec.axes["0.weight"][0],)


def test_a_resnet_with_group_norm_moves_every_channel_and_keeps_its_function():
    torch.manual_seed(0)
    model = GNResNet().eval()
    result = trace_model(model, _x(size=8))
    spec = result.spec
    assert result.composites == ()
    assert moved_share(model, spec, ("fc",)) == 1.0
    # The stream of the last two blocks is one Blocks: its norms, the shortcut and the conv writing into it.
    stream = spec.axes["blocks.1.shortcut.weight"][0]
    assert isinstance(stream, Blocks) and spec.sizes[stream.outer] == 4
    for key in ("blocks.1.conv2.weight", "blocks.2.norm1.weight", "blocks.2.conv2.weight", "norm.weight"):
        assert spec.axes[key][0] == stream, key
    assert_same_function(model, spec, _x(1, size=8), rtol=1e-5, atol=1e-6)
    _planted_is_found(model, spec)


def test_activation_matching_finds_a_planted_permutation_of_channel_groups():
    torch.manual_seed(0)
    model = GNResNet().eval()
    spec = PermutationSpec.from_model(model, _x(size=8))
    plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(3)))
    other = GNResNet().eval()
    other.load_state_dict(plant.apply(model.state_dict()))
    data = [_x(10 + i, batch=4, size=8) for i in range(3)]
    assert activation_matching(model, other, spec, data).perms == plant.inverse()


def test_a_concatenation_along_group_boundaries_is_permuted_part_by_part():
    """Parts of 4 and 8 channels normalised in groups of 4: the first part is one group (free within, in place),
    the second two groups that may swap."""
    model = CatThenNorm(4, 8, 3)
    spec = PermutationSpec.from_model(model, _x())
    entry = spec.axes["norm.weight"][0]
    assert isinstance(entry, Segments) and isinstance(entry.parts[0], str) and isinstance(entry.parts[1], Blocks)
    assert spec.sizes[entry.parts[1].outer] == 2
    assert spec.axes["b.weight"][0] == entry.parts[1]
    assert_same_function(model, spec, _x(1), rtol=1e-5, atol=1e-6)
    _planted_is_found(model, spec)


def _parts(spec, entry) -> tuple:
    """A Segments entry's parts: fixed ones as ints, groups as their sizes, Blocks as ("blocks", count, size)."""
    def part(p):
        if isinstance(p, int):
            return p
        if isinstance(p, Blocks):
            return ("blocks", spec.sizes[p.outer], spec.block_size(p.inner))
        return spec.sizes[p]

    return tuple(part(p) for p in entry.parts)


@pytest.mark.parametrize(("groups", "own", "parts"), [
    # groups of 6 over parts of 6 normalised in groups of 3: one partition per part, blocks move
    (2, 2, (("blocks", 2, 3), ("blocks", 2, 3))),
    # groups of 4 over parts of 6 normalised in groups of 3: pieces between every two boundaries stay in
    # place (the second part begins inside a group; pieces of one unit are fixed)
    (3, 2, (3, 1, 2, 2, 1, 3)),
])  # fmt: skip
def test_classes_normalised_with_several_partitions_are_cut_into_pieces_in_place(groups, own, parts):
    """A skip concatenation in a U-Net: each part was normalised in its own groups, the concatenation in others."""
    model = CatThenNorm(6, 6, groups, own)
    result = trace_model(model, _x())
    spec = result.spec
    assert result.composites == ()
    entry = spec.axes["norm.weight"][0]
    assert isinstance(entry, Segments) and _parts(spec, entry) == parts
    assert_same_function(model, spec, _x(1), rtol=1e-5, atol=1e-6)
    _planted_is_found(model, spec)


class ShuffledThenNormalised(nn.Module):
    """Two branches taken in turn (ShuffleNet's channel shuffle), then normalised in groups of 4."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)
        self.norm = nn.GroupNorm(2, 8)
        self.hidden = nn.Conv2d(8, 6, 1)
        self.out = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        h = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], dim=1)
        n, c, height, width = h.shape
        h = h.view(n, 2, c // 2, height, width).transpose(1, 2).reshape(n, c, height, width)
        return self.out(torch.relu(self.hidden(self.norm(h))))


def test_a_partition_no_structure_can_take_is_fixed_and_named():
    """Groups laid over an interleave of two halves: the units are fixed, the warning names the GroupNorm."""
    model = ShuffledThenNormalised()
    what = r"GroupNorm .*module 'norm'\) normalises groups of 4 channels of an axis whose structure"
    with pytest.warns(TraceWarning, match=what):
        spec = PermutationSpec.from_model(model, _x())
    assert spec.axes["norm.weight"] == (None,) and spec.axes["a.weight"][0] is None
    assert_same_function(model, spec, _x(1), rtol=1e-5, atol=1e-6)
    with pytest.raises(TraceError, match=what):
        trace_model(model, _x(), composite="raise")
