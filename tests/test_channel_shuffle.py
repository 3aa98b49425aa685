"""ShuffleNet's channel shuffle, traced structured: a concatenation of two halves split into (2, C/2),
transposed and merged back interleaves the halves, and the next block's ``chunk(2)`` cuts through the
units of both. The tracer names the interleaved axis ``Interleaved(a, b)`` (each half its own permutation)
and cuts the classes of both halves into sub-classes where a chunk goes through them.

torchvision is optional: its ShuffleNetV2 and the ``pyperm bench trace --all`` survey are checked when
it is installed."""

from __future__ import annotations

import copy

import pytest
import torch
from _vision import import_torchvision
from torch import nn

from pyperm.nn import (
    Permutations,
    activation_matching,
    apply_permutation,
    merge_many,
    trace_model,
    weight_matching,
)
from pyperm.nn.spec import Interleaved, Segments
from pyperm.nn.trace import TraceWarning
from pyperm.testing import assert_same_function, permutable_share, random_permutations

# --------------------------------------------------------------------------- a small ShuffleNetV2


def channel_shuffle(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    return x.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)


def conv_bn(cin: int, cout: int, k: int = 1, stride: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([nn.ReLU()] if relu else []))


class Unit(nn.Module):
    """torchvision's InvertedResidual: two branches (stride 2) or the second half through one (stride 1),
    concatenated, then shuffled."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        half, self.stride = cout // 2, stride
        if stride == 2:
            self.branch1 = nn.Sequential(conv_bn(cin, cin, 3, 2, cin, relu=False), conv_bn(cin, half))
        self.branch2 = nn.Sequential(conv_bn(cin if stride == 2 else half, half),
                                     conv_bn(half, half, 3, stride, half, relu=False), conv_bn(half, half))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out)


class TinyShuffleNet(nn.Module):
    def __init__(self, width: int = 32, repeats: int = 3) -> None:
        super().__init__()
        self.conv1 = conv_bn(3, 8, 3, 2)
        self.stage = nn.Sequential(Unit(8, width, 2), *[Unit(width, width, 1) for _ in range(repeats - 1)])
        self.conv5 = conv_bn(width, 24)
        self.fc = nn.Linear(24, 5)
        self.fc.is_head = True  # the model's output: not hidden units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv5(self.stage(self.conv1(x))).mean((2, 3)))


def build(**kwargs) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TinyShuffleNet(**kwargs).double()
        with torch.no_grad():
            for p in model.parameters():  # spread the weights: random-init BatchNorm has ties between units
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def example() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def fixed_parts(spec) -> list[str]:
    """The axes that hold fixed units beside permuted ones (a Segments with a number of fixed units)."""
    return [key for key, axes in spec.axes.items() for e in axes
            if isinstance(e, Segments) and any(isinstance(p, int) for p in e.parts)]  # fmt: skip


def planted_pair(model: nn.Module, spec, seed: int = 3) -> tuple[dict, dict, Permutations]:
    sa = model.state_dict()
    planted = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(seed)))
    return sa, apply_permutation(spec, planted, sa), planted


# --------------------------------------------------------------------------- the small model


def test_every_unit_of_a_shallow_shufflenet_is_permuted():
    model = build()
    result = trace_model(model, example(), composite="raise")  # nothing left unpermuted, so nothing raises
    spec = result.spec
    assert permutable_share(model, spec) == 1.0 and not fixed_parts(spec) and result.composites == ()
    # The stride-2 unit's two branches are interleaved by the shuffle, each with its own permutation; each is
    # cut in two by the next unit's chunk (its first half passes on, the second feeds the branch), and the
    # first half in two again by the unit after.
    first, second = spec.axes["stage.0.branch1.1.0.weight"][0], spec.axes["stage.0.branch2.2.0.weight"][0]
    assert isinstance(first, Segments) and [spec.sizes[g] for g in first.parts] == [4, 4, 8]
    assert isinstance(second, Segments) and [spec.sizes[g] for g in second.parts] == [4, 4, 8]
    assert not set(first.parts) & set(second.parts)
    # The next unit's branch reads the second halves of both, interleaved.
    assert spec.axes["stage.1.branch2.0.0.weight"][1] == Interleaved(first.parts[2], second.parts[2])
    # The last unit's branch reads the second quarters, interleaved, interleaved with the second unit's branch.
    third = spec.axes["stage.1.branch2.2.0.weight"][0]
    assert spec.axes["stage.2.branch2.0.0.weight"][1] == Interleaved(Interleaved(first.parts[1], second.parts[1]),
                                                                     third.parts[1])  # fmt: skip


def test_shuffled_units_keep_the_function():
    model = build()
    spec = trace_model(model, example(), composite="raise").spec
    for seed in range(3):
        assert_same_function(model, spec, example(), seed=seed, train=True, rtol=1e-12, atol=1e-12)


def test_weight_matching_finds_a_planted_permutation():
    model = build()
    spec = trace_model(model, example(), composite="raise").spec
    sa, sb, planted = planted_pair(model, spec)
    for init in ("identity", "best"):
        found = weight_matching(spec, sa, sb, seed=0, init=init, dtype=torch.float64)
        assert found.perms == planted.inverse(), init
    assert not planted.is_identity()


def test_merge_and_activation_matching_find_a_planted_permutation():
    model = build()
    spec = trace_model(model, example(), composite="raise").spec
    sa, sb, planted = planted_pair(model, spec)
    merged = merge_many(spec, [sa, sb], seed=0)
    assert merged.perms[1] == planted.inverse()
    other = copy.deepcopy(model)
    other.load_state_dict(sb)
    data = [torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
            for k in range(3)]  # fmt: skip
    found = activation_matching(model, other, spec, data, pre_activation=True)
    seen = [g for g in spec.groups if found.sites[g]]
    assert len(seen) == len(spec.groups)  # every group, the pieces of a cut one too, has an activation site
    undo = planted.inverse()
    assert all(found.perms[g].equal(undo[g]) for g in seen)


def test_deep_shuffles_keep_every_unit():
    """Every chunk halves the classes of the half it passes on (interleaved ever deeper); pieces of one unit
    have no order to change, and nothing is left unpermuted. The spec stays exact."""
    model = build(width=16, repeats=5)
    result = trace_model(model, example(), composite="raise")
    spec = result.spec
    assert permutable_share(model, spec) == 1.0 and result.composites == ()
    assert isinstance(spec.axes["conv5.0.weight"][1], Interleaved)
    assert_same_function(model, spec, example(), train=True, rtol=1e-12, atol=1e-12)
    sa, sb, planted = planted_pair(model, spec)
    assert weight_matching(spec, sa, sb, seed=0, dtype=torch.float64).perms == planted.inverse()


def test_flat_trace_reports_the_concatenation():
    model = build()
    with pytest.warns(TraceWarning, match=r"torch\.cat .*module 'stage\.0'\) concatenates along axis 1"):
        result = trace_model(model, example(), structured=False)
    assert permutable_share(model, result.spec) < 0.8
    assert_same_function(model, result.spec, example())


def test_a_chunk_cuts_a_class_in_pieces_wherever_it_is_used():
    """A chunk of a plain class refines it: each piece is a group, and the layer producing the class is
    permuted piece by piece (Segments)."""

    class Chunked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(3, 9), nn.Linear(4, 2), nn.Linear(5, 2)
            self.b.is_head = self.c.is_head = True

        def forward(self, x):
            h = torch.relu(self.a(x))
            left, right = h.split([4, 5], dim=1)
            return self.b(left) + self.c(right) + h.sum(1, keepdim=True)

    torch.manual_seed(0)
    model = Chunked().double()
    spec = trace_model(model, torch.randn(2, 3, dtype=torch.float64), composite="raise").spec
    assert spec.sizes == {"P_a_0": 4, "P_a_1": 5}
    assert spec.axes["a.weight"] == (Segments("P_a_0", "P_a_1"), None)
    assert spec.axes["b.weight"] == (None, "P_a_0") and spec.axes["c.weight"] == (None, "P_a_1")
    assert_same_function(model, spec, torch.randn(3, 3, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_concatenations_with_different_boundaries_meet_piece_by_piece():
    """cat(a, b) + cat(c, d) with parts of 4 + 6 and 6 + 4 units: every class is cut at both boundaries and
    the pieces join (a with c's first 4, c's last 2 with b's first 2, b's last 4 with d)."""

    class Sums(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = nn.Linear(3, 4), nn.Linear(3, 6), nn.Linear(3, 6), nn.Linear(3, 4)
            self.head = nn.Linear(10, 2)
            self.head.is_head = True

        def forward(self, x):
            return self.head(torch.relu(torch.cat([self.a(x), self.b(x)], 1) + torch.cat([self.c(x), self.d(x)], 1)))

    torch.manual_seed(0)
    model = Sums().double()
    spec = trace_model(model, torch.randn(2, 3, dtype=torch.float64), composite="raise").spec
    assert spec.sizes == {"P_a": 4, "P_d": 4, "P_b_0": 2}
    assert spec.axes["b.weight"][0] == Segments("P_b_0", "P_d") and spec.axes["c.weight"][0] == Segments("P_a", "P_b_0")
    assert spec.axes["head.weight"][1] == Segments("P_a", "P_b_0", "P_d")
    assert_same_function(model, spec, torch.randn(4, 3, dtype=torch.float64), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- torchvision (optional)


def test_torchvision_shufflenet_v2():
    tv = import_torchvision()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = tv.models.shufflenet_v2_x0_5(weights=None).eval()
    model.fc.is_head = True
    x = torch.randn(2, 3, 64, 64)
    result = trace_model(model, x, composite="fix")
    # 56% before the cut, 92% with the halves tied. Interleaved, every half keeps its own permutation; only
    # the pieces of one unit that deep chunks leave (stage 3: 8 units) have no order to change.
    assert permutable_share(model, result.spec) > 0.99 and result.composites == ()
    assert_same_function(model, result.spec, x)
    sa = {k: t + 0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(2)) if t.ndim == 1
          and t.is_floating_point() else t for k, t in model.state_dict().items()}  # fmt: skip
    planted = Permutations(result.spec, random_permutations(result.spec, 3))
    found = weight_matching(result.spec, sa, apply_permutation(result.spec, planted, sa), seed=0)
    assert found.perms == planted.inverse()


def test_survey_table_of_two_models():
    import_torchvision()
    from pyperm.benchmarks import trace as bench

    rows = bench.survey(["resnet18", "shufflenet_v2_x0_5"], size=32)
    resnet, shufflenet = rows
    assert (resnet.share, resnet.kept, resnet.recovered) == (1.0, True, "yes") and not resnet.failures()
    # Interleaved halves: only units left alone in pieces of one (no order to change) are not moved.
    assert bench.SURVEY_TARGET <= shufflenet.share < 1.0 and shufflenet.kept and shufflenet.recovered == "yes"
    assert shufflenet.max_diff < 1e-9 and shufflenet.hidden == 3976 and shufflenet.unpermuted
    table = bench.survey_table(rows, markdown=True)
    assert table.count("\n") == 3 and "| resnet18 | 32 |" in table and "BELOW 99%" not in table
    assert bench.survey_flags(rows) == []
    inception = bench.survey_model("inception_v3", size=32)  # built at the 75x75 it needs, not skipped
    assert inception.size == 75 and not inception.skipped and inception.share == 1.0
