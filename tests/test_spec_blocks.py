"""The group-of-groups axis form (Blocks): attention heads and grouped convolutions permuted as whole
blocks and within every block, each block with its own inner permutation. A planted permutation keeps
the function, weight matching finds it back, and permutations that cross blocks are refused."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn import Permutations, PermutationSpec, apply_permutation, matching_objective, weight_matching
from pyperm.nn.spec import Blocks, Segments, Tiled
from pyperm.testing import random_permutations


def planted(spec: PermutationSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random permutation of every group; a Blocks inner group's is random within each block."""
    return random_permutations(spec, torch.Generator().manual_seed(seed))


def spread_and_plant(model: nn.Module, spec: PermutationSpec, seed: int) -> tuple[Permutations, nn.Module]:
    """Spread the model's weights (no ties between units), then plant a random permutation of every
    group: the permutations and the permuted copy."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    perms = Permutations(spec, planted(spec, seed=seed))
    other = copy.deepcopy(model)
    other.load_state_dict(apply_permutation(spec, perms, model.state_dict()))
    return perms, other


class HandAttention(nn.Module):
    """Self-attention written out: q, k, v and output projections, 4 heads of 3 dims, a per-head scale."""

    def __init__(self, d_in: int = 5, heads: int = 4, head_dim: int = 3) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        e = heads * head_dim
        self.q, self.k, self.v = nn.Linear(d_in, e), nn.Linear(d_in, e), nn.Linear(d_in, e)
        self.out = nn.Linear(e, d_in)
        self.scale = nn.Parameter(torch.rand(heads) + 0.5)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)  # (b, heads, n, head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) * self.scale.view(1, -1, 1, 1)
        o = torch.softmax(scores, dim=-1) @ v
        return x + self.out(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


def attention_spec(model: HandAttention) -> PermutationSpec:
    # Heads move together in q, k, v and the output projection; q and k share the within-head
    # permutation (their dot product), v and the output projection's columns have their own.
    qk, v = Blocks("heads", "qk"), Blocks("heads", "v")
    e = model.heads * model.head_dim
    return PermutationSpec(
        {"scale": ("heads",), "q.weight": (qk, None), "q.bias": (qk,), "k.weight": (qk, None), "k.bias": (qk,),
         "v.weight": (v, None), "v.bias": (v,), "out.weight": (None, v), "out.bias": (None,)},
        {"heads": model.heads, "qk": e, "v": e},
    )  # fmt: skip


class FusedAttention(HandAttention):
    """The same attention with one fused qkv projection (rows: q, then k, then v)."""

    def __init__(self) -> None:
        super().__init__()
        e = self.heads * self.head_dim
        self.qkv = nn.Linear(self.q.in_features, 3 * e)
        del self.q, self.k, self.v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) * self.scale.view(1, -1, 1, 1)
        o = torch.softmax(scores, dim=-1) @ v
        return x + self.out(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


def fused_spec(model: FusedAttention) -> PermutationSpec:
    qkv = Segments(Blocks("heads", "qk"), Blocks("heads", "qk"), Blocks("heads", "v"))
    e = model.heads * model.head_dim
    return PermutationSpec(
        {"scale": ("heads",), "out.weight": (None, Blocks("heads", "v")), "out.bias": (None,),
         "qkv.weight": (qkv, None), "qkv.bias": (qkv,)},
        {"heads": model.heads, "qk": e, "v": e},
    )  # fmt: skip


class GroupedConvBlock(nn.Module):
    """ResNeXt style: a 1x1 convolution, a grouped 3x3 convolution (4 groups, 2 -> 3 channels each), a 1x1 head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 1)
        self.conv2 = nn.Conv2d(8, 12, 3, padding=1, groups=4)
        self.conv3 = nn.Conv2d(12, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(F.relu(self.conv2(F.relu(self.conv1(x)))))


def grouped_conv_spec(model: GroupedConvBlock) -> PermutationSpec:
    # The groups move as blocks everywhere; the grouped convolution's output channels are also
    # permuted within each group, each group its own. Its input channels move alike within
    # every group: every output channel of a group reads them in one order (conv2.weight axis 1).
    out, inside = Blocks("groups", "channels"), Tiled("in", outer="groups")
    return PermutationSpec(
        {"conv1.weight": (inside, None, None, None), "conv1.bias": (inside,),
         "conv2.weight": (out, "in", None, None), "conv2.bias": (out,),
         "conv3.weight": (None, out, None, None), "conv3.bias": (None,)},
        {"groups": 4, "in": 2, "channels": 12},
    )  # fmt: skip


MODELS = {
    "attention": (HandAttention, attention_spec, (2, 6, 5)),
    "fused-qkv": (FusedAttention, fused_spec, (2, 6, 5)),
    "grouped-conv": (GroupedConvBlock, grouped_conv_spec, (2, 3, 5, 5)),
}


def build(name: str) -> tuple[nn.Module, PermutationSpec, torch.Tensor]:
    torch.manual_seed(0)
    factory, make_spec, shape = MODELS[name]
    model = factory().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # spread the weights: no ties between units
    return model, make_spec(model), torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_planted_blocks_permutation_keeps_the_function(name):
    model, spec, x = build(name)
    assert spec.structured and set(spec.blocks.values()) == {"heads" if name != "grouped-conv" else "groups"}
    perms = Permutations(spec, planted(spec))
    permuted = apply_permutation(spec, perms, model.state_dict())
    assert all(not torch.equal(permuted[k], v) for k, v in model.state_dict().items() if k != "out.bias"
               and k != "conv3.bias")  # fmt: skip
    other = copy.deepcopy(model)
    other.load_state_dict(permuted)
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-12)
    back = apply_permutation(spec, perms.inverse(), permuted)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    twice = apply_permutation(spec, perms.compose(perms), model.state_dict())
    assert all(torch.equal(twice[k], v) for k, v in apply_permutation(spec, perms, permuted).items())


def test_blocks_moves_each_block_with_its_own_inner_permutation():
    model, spec, _ = build("attention")
    perms = {"heads": [1, 0, 3, 2], "qk": [2, 0, 1] + list(range(3, 12)), "v": list(range(12))}
    q = apply_permutation(spec, perms, model.state_dict())["q.weight"]
    w = model.state_dict()["q.weight"]
    # New head 0 is old head 1 as it was; new head 1 is old head 0 with its dims reordered [2, 0, 1].
    torch.testing.assert_close(q[0:3], w[3:6], rtol=0, atol=0)
    torch.testing.assert_close(q[3:6], w[[2, 0, 1]], rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_weight_matching_recovers_a_planted_blocks_permutation(name):
    model, spec, _ = build(name)
    sa = model.state_dict()
    perms = Permutations(spec, planted(spec, seed=3))
    sb = apply_permutation(spec, perms, sa)
    for init in (None, "signatures"):
        result = weight_matching(spec, sa, sb, seed=0, init=init, dtype=torch.float64)
        assert result.objective == sorted(result.objective)  # never decreases
        assert result.perms == perms.inverse()
        aligned = apply_permutation(spec, result.perms, sb)
        for key, t in sa.items():
            torch.testing.assert_close(aligned[key], t, rtol=0, atol=0, msg=key)
        assert result.objective[-1] == pytest.approx(matching_objective(spec, sa, sa), rel=1e-12)


def test_weight_matching_of_blocks_never_decreases_from_any_start():
    model, spec, _ = build("fused-qkv")
    other = FusedAttention().double()
    sa, sb = model.state_dict(), other.state_dict()
    for seed in range(3):
        start = planted(spec, seed)
        result = weight_matching(spec, sa, sb, seed=seed, init=start, dtype=torch.float64)
        assert result.objective == sorted(result.objective)
        assert result.objective[0] == pytest.approx(matching_objective(spec, sa, sb, start), rel=1e-12)
        # A Permutations of the spec: validated, so its inner permutations are block-diagonal.
        assert isinstance(result.perms, Permutations) and result.perms.spec is spec


def test_inner_permutation_that_crosses_blocks_is_refused():
    model, spec, _ = build("attention")
    perms = planted(spec)
    perms["v"] = perms["v"].clone()
    perms["v"][[2, 3]] = perms["v"][[3, 2]]  # units 2 and 3 belong to heads 0 and 1
    with pytest.raises(ValueError, match=r"perms\['v'\] moves units between blocks .* Blocks\('heads', 'v'\)"):
        Permutations(spec, perms)
    with pytest.raises(ValueError, match=r"perms\['v'\] moves units between blocks"):
        apply_permutation(spec, perms, model.state_dict())


def test_bad_blocks_specs_are_refused():
    with pytest.raises(TypeError, match="Blocks inner must be a group name, got int"):
        Blocks("h", 3)
    with pytest.raises(ValueError, match="Blocks outer and inner must be different groups"):
        Blocks("h", "h")
    with pytest.raises(ValueError, match=r"Blocks inner group 'd' has size 7, not a multiple of outer group 'h'"):
        PermutationSpec({"w": (Blocks("h", "d"),)}, {"h": 2, "d": 7})
    with pytest.raises(ValueError, match=r"tensor 'v' axis 0: group 'd' is a Blocks inner group .* Blocks\('h', 'd'\)"):
        PermutationSpec({"w": (Blocks("h", "d"),), "v": ("d",)}, {"h": 2, "d": 6})
    with pytest.raises(ValueError, match=r"tensor 'v' axis 0: group 'd' is a Blocks inner group"):
        PermutationSpec({"w": (Blocks("h", "d"),), "v": (Tiled("e", outer="d"),)}, {"h": 2, "d": 6, "e": 1})
    with pytest.raises(ValueError, match=r"Tiled outer must be another group than 'a'"):
        Tiled("a", outer="a")
    with pytest.raises(ValueError, match=r"Blocks inner group 'd' has outer group 'g' here and 'h' elsewhere"):
        PermutationSpec({"w": (Blocks("h", "d"),), "v": (Blocks("g", "d"),)}, {"h": 2, "g": 3, "d": 6})
    with pytest.raises(ValueError, match=r"group 'e' is not a Blocks inner group"):
        PermutationSpec({"w": (Blocks("h", "d"), "e")}, {"h": 2, "d": 6, "e": 2}).block_size("e")
    spec = PermutationSpec({"w": (Segments(Blocks("h", "d"), 2),)}, {"h": 2, "d": 6})
    with pytest.raises(ValueError, match=r"state_dict\['w'\] axis 0 has size 7; Segments\(Blocks"):
        spec.check_state_dict({"w": torch.zeros(7)})
    assert spec.unit_positions("w", 0, "h").tolist() == [[0, 1, 2], [3, 4, 5]]
    assert spec.unit_positions("w", 0, "d").view(-1).tolist() == list(range(6))


def test_blocks_permutations_round_trip_through_json():
    model, spec, _ = build("fused-qkv")
    perms = Permutations(spec, planted(spec, seed=1))
    data = json.loads(json.dumps(perms.to_dict()))
    assert Permutations.from_dict(spec, data) == perms
    assert Permutations.identity(spec).is_identity() and not perms.is_identity()
    assert perms.compose(perms.inverse()).is_identity() and perms.inverse().compose(perms).is_identity()


def test_blocks_specs_compare_by_structure():
    a = PermutationSpec({"w": (Blocks("h", "d"), None), "o": (None, Blocks("h", "d"))}, {"h": 2, "d": 6})
    renamed = PermutationSpec({"w": (Blocks("x", "y"), None), "o": (None, Blocks("x", "y"))}, {"x": 2, "y": 6})
    assert a.equivalent(renamed) and a.group_correspondence(renamed) == {"h": "x", "d": "y"}
    assert renamed.blocks == {"y": "x"} and renamed.block_size("y") == 3


class MHABlock(nn.Module):
    """A residual nn.MultiheadAttention block (4 heads of 3 dims) between an embedding and a head."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 12)
        self.attn = nn.MultiheadAttention(12, 4, batch_first=True, **options)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


@pytest.mark.parametrize("options", [{}, {"add_bias_kv": True, "add_zero_attn": True}], ids=["plain", "bias-kv"])
def test_traced_multihead_attention_moves_heads_as_blocks(options):
    from pyperm.nn import trace_model

    torch.manual_seed(0)
    model = MHABlock(**options).double()
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    spec = trace_model(model, x, composite="raise", structured=True).spec
    qk, vo = Blocks("P_attn.heads", "P_attn.qk"), Blocks("P_attn.heads", "P_attn.vo")
    assert spec.axes["attn.in_proj_weight"] == (Segments(qk, qk, vo), "P_embed")
    if options:  # the extra key and value: per-head units like the projected ones
        assert spec.axes["attn.bias_k"] == (None, None, qk) and spec.axes["attn.bias_v"] == (None, None, vo)
    assert spec.axes["attn.out_proj.weight"] == ("P_embed", vo)
    assert spec.blocks == {"P_attn.qk": "P_attn.heads", "P_attn.vo": "P_attn.heads"}
    perms = Permutations(spec, planted(spec, seed=2))
    other = copy.deepcopy(model)
    other.load_state_dict(apply_permutation(spec, perms, model.state_dict()))
    model.eval()
    other.eval()
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # spread the weights: no ties between units
    sa = model.state_dict()
    sb = apply_permutation(spec, perms, sa)
    result = weight_matching(spec, sa, sb, seed=0, init="best", dtype=torch.float64)
    assert result.perms == perms.inverse()
    assert result.objective[-1] == pytest.approx(matching_objective(spec, sa, sa), rel=1e-12)


class ResNeXtBlock(nn.Module):
    """A 1x1 convolution, a grouped 3x3 one (2 groups of 4 -> 4 channels) with BatchNorm, a 1x1 one, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 1)
        self.b, self.bn = nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.BatchNorm2d(8)
        self.c = nn.Conv2d(8, 6, 1)
        self.fc = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.b(F.relu(self.a(x)))))
        return self.fc(F.relu(self.c(h)).mean((2, 3)))


def test_traced_grouped_convolution_moves_its_groups_as_blocks():
    from pyperm.nn import trace_model

    torch.manual_seed(0)
    model = ResNeXtBlock().double().eval()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    spec = trace_model(model, x, composite="raise", structured=True).spec
    out = Blocks("P_b.groups", "P_b.out")
    assert spec.axes["a.weight"][0] == Tiled("P_b.in", outer="P_b.groups")
    assert spec.axes["b.weight"][:2] == (out, "P_b.in")
    assert spec.axes["bn.running_mean"] == (out,) and spec.axes["c.weight"][1] == out
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # spread the weights: no ties between units
        model.bn.running_mean.normal_()
    perms = Permutations(spec, planted(spec, seed=4))
    other = copy.deepcopy(model)
    other.load_state_dict(apply_permutation(spec, perms, model.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-12)
    sa = model.state_dict()
    sb = apply_permutation(spec, perms, sa)
    result = weight_matching(spec, sa, sb, seed=0, dtype=torch.float64)
    assert result.perms == perms.inverse()
    assert result.objective[-1] == pytest.approx(matching_objective(spec, sa, sa), rel=1e-12)


class SplitHeads(nn.Module):
    """HF style attention: separate q, k, v projections, view(b, n, heads, head_dim), scaled dot-product."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 12)
        self.q, self.k, self.v, self.o = (nn.Linear(12, 12) for _ in range(4))
        self.head = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        b, n, _ = h.shape
        q, k, v = (f(h).view(b, n, 4, 3).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 12)
        return self.head((h + self.o(a)).mean(1))


def test_traced_head_split_moves_whole_heads():
    from pyperm.nn import trace_model

    torch.manual_seed(0)
    model = SplitHeads().double().eval()
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    spec = trace_model(model, x, composite="raise", structured=True).spec
    # A reshape labels each axis on its own: the heads move as wholes, the head dims alike in every head.
    qk, vo = spec.axes["q.weight"][0], spec.axes["o.weight"][1]
    assert isinstance(qk, Tiled) and isinstance(qk.outer, str) and spec.axes["k.weight"][0] == qk
    assert vo == spec.axes["v.weight"][0] and vo.outer == qk.outer and vo.group != qk.group
    perms, other = spread_and_plant(model, spec, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-12)
    sa = model.state_dict()
    sb = apply_permutation(spec, perms, sa)
    result = weight_matching(spec, sa, sb, seed=0, init="best", dtype=torch.float64)
    assert result.perms == perms.inverse()


class GroupedChain(nn.Module):
    """Two grouped convolutions in a row (2 groups each): the second reads the first's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 1)
        self.b = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.c = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.d = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(F.relu(self.c(F.relu(self.b(F.relu(self.a(x)))))))


def test_traced_chain_of_grouped_convolutions_shares_one_group_of_blocks():
    from pyperm.nn import trace_model

    torch.manual_seed(0)
    model = GroupedChain().double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    spec = trace_model(model, x, composite="raise", structured=True).spec
    # b's output channels are c's input: moved as blocks with one permutation within every block
    # (c reads them in one order); c's own output channels have one permutation per block.
    assert spec.axes["b.weight"][0] == Tiled("P_c.in", outer="P_b.groups") and spec.axes["c.weight"][1] == "P_c.in"
    assert spec.axes["c.weight"][0] == Blocks("P_b.groups", "P_c.out")
    perms, other = spread_and_plant(model, spec, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-12)
    sa = model.state_dict()
    sb = apply_permutation(spec, perms, sa)
    result = weight_matching(spec, sa, sb, seed=0, init="best", dtype=torch.float64)
    assert result.perms == perms.inverse()


def test_blocks_that_stay_in_place():
    model, _, x = build("grouped-conv")
    # The groups stay in place; the grouped convolution's output channels move within each group,
    # each group its own permutation (conv1 and conv2's input channels are not permuted here).
    out = Blocks(4, "channels")
    axes = {k: (None,) * t.ndim for k, t in model.state_dict().items()}
    axes |= {"conv2.weight": (out, None, None, None), "conv2.bias": (out,), "conv3.weight": (None, out, None, None)}
    spec = PermutationSpec(axes, {"channels": 12})
    assert spec.blocks == {"channels": 4} and spec.num_blocks("channels") == 4 and spec.block_size("channels") == 3
    perms = Permutations(spec, planted(spec, seed=7))
    other = copy.deepcopy(model)
    other.load_state_dict(apply_permutation(spec, perms, model.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-12)
    assert perms.compose(perms.inverse()).is_identity()
    sa = model.state_dict()
    sb = apply_permutation(spec, perms, sa)
    for init in (None, "signatures"):
        result = weight_matching(spec, sa, sb, seed=0, init=init, dtype=torch.float64)
        assert result.objective == sorted(result.objective)
        assert result.perms == perms.inverse()
    bad = perms["channels"].clone()
    bad[[2, 3]] = bad[[3, 2]]
    with pytest.raises(ValueError, match=r"perms\['channels'\] moves units between blocks .* Blocks\(4, 'channels'\)"):
        Permutations(spec, {"channels": bad})
    with pytest.raises(TypeError, match="Blocks outer must be a group name or an int, got float"):
        Blocks(2.0, "d")
    with pytest.raises(ValueError, match="Blocks outer must be at least 1"):
        Blocks(0, "d")
    with pytest.raises(ValueError, match=r"Blocks inner group 'd' has size 7, not a multiple of the number of blocks"):
        PermutationSpec({"w": (Blocks(2, "d"),)}, {"d": 7})


class ShuffledGroups(nn.Module):
    """A channel shuffle (4 halves of 2 after the transpose) feeding a grouped convolution of 2 groups of 4:
    the two block structures do not line up, so the groups stay in place (Blocks(2, ...))."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.c = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        n, ch, hh, ww = h.shape
        h = h.view(n, 2, ch // 2, hh, ww).transpose(1, 2).reshape(n, ch, hh, ww)
        return self.c(F.relu(self.b(h)))


def test_traced_grouped_convolution_after_a_shuffle_keeps_its_units_within_groups():
    from pyperm.nn import trace_model

    torch.manual_seed(0)
    model = ShuffledGroups().double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    spec = trace_model(model, x, composite="fix", structured=True).spec
    assert spec.axes["b.weight"][0] == Blocks(2, "P_b.out") and spec.axes["c.weight"][1] == Blocks(2, "P_b.out")
    perms = Permutations(spec, planted(spec, seed=8))
    other = copy.deepcopy(model)
    other.load_state_dict(apply_permutation(spec, perms, model.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-12)


class CrossAttention(nn.Module):
    """nn.MultiheadAttention with keys and values of their own widths (separate projection weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(5, 12), nn.Linear(5, 7)
        self.attn = nn.MultiheadAttention(12, 4, batch_first=True, kdim=7, vdim=7)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.tanh(self.kv(x))
        return self.head(self.attn(self.q(x), c, c, need_weights=False)[0].mean(1))


SEQUENCE_MODELS = (SplitHeads, MHABlock, CrossAttention)


@pytest.mark.parametrize(
    "model_type",
    [ResNeXtBlock, GroupedChain, SplitHeads, ShuffledGroups, MHABlock, lambda: MHABlock(add_bias_kv=True),
     CrossAttention],
    ids=["resnext", "grouped-chain", "split-heads", "shuffled-groups", "mha", "mha-bias-kv", "cross-attention"],
)
def test_activation_matching_recovers_structured_groups(model_type):
    """Blocks (grouped convolution outputs, fixed blocks, the heads of nn.MultiheadAttention, read from its
    inputs projected) and Tiled copies moved by a group (grouped convolution inputs, split heads) are read
    from the axis they shape and solved together: a planted permutation of every group is undone exactly."""
    from pyperm.nn import activation_matching, trace_model

    torch.manual_seed(0)
    model = model_type().double().eval()
    sequence = isinstance(model, SEQUENCE_MODELS)
    x = torch.randn(2, 6, 5, dtype=torch.float64) if sequence else torch.randn(2, 3, 5, 5).double()
    spec = trace_model(model, x, composite="fix", structured=True).spec
    assert spec.structured
    perms, other = spread_and_plant(model, spec, seed=9)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn((16, *x.shape[1:]), generator=gen, dtype=torch.float64) for _ in range(4)]
    result = activation_matching(model, other, spec, data)
    assert all(result.sites[g] for g in spec.groups)  # every group was seen
    assert result.perms == perms.inverse()
    for g in spec.groups:
        assert result.similarity[g] == pytest.approx(1.0)  # identical activations once aligned
        assert result.similarity[g] >= result.identity_similarity[g]
    aligned = apply_permutation(spec, result.perms, other.state_dict())
    for key, t in model.state_dict().items():
        torch.testing.assert_close(aligned[key], t, msg=key)
    # The uncentred products see the biases of projected sites too.
    ols = activation_matching(model, other, spec, data, cost="ols")
    assert ols.perms == perms.inverse()


@pytest.mark.parametrize(
    "model_type",
    [ResNeXtBlock, GroupedChain, SplitHeads, ShuffledGroups, MHABlock, lambda: MHABlock(add_bias_kv=True),
     CrossAttention],
    ids=["resnext", "grouped-chain", "split-heads", "shuffled-groups", "mha", "mha-bias-kv", "cross-attention"],
)
def test_weight_matching_of_unrelated_traced_models_takes_the_reference_steps(model_type):
    """Two unrelated models: the fast matcher's assignments of assignments (heads, grouped convolutions,
    blocks in place) are the plain reference's, sweep for sweep, in float32 and float64."""
    from pyperm.nn import trace_model
    from pyperm.nn.align._structured import reference_matching

    torch.manual_seed(0)
    a, b = model_type(), model_type()
    x = torch.randn(2, 6, 5) if isinstance(a, SEQUENCE_MODELS) else torch.randn(2, 3, 5, 5)
    spec = trace_model(a, x, composite="fix", structured=True).spec
    assert spec.blocks or any(isinstance(e, Tiled) for axes in spec.axes.values() for e in axes)
    sa, sb = a.state_dict(), b.state_dict()
    for dtype in (torch.float32, torch.float64):
        for seed in (0, 1):
            fast = weight_matching(spec, sa, sb, seed=seed, init="identity", dtype=dtype)
            plain = reference_matching(spec, sa, sb, seed=seed, dtype=dtype)
            assert fast.perms == plain.perms and fast.iterations == plain.iterations
            assert fast.objective[-1] == pytest.approx(matching_objective(spec, sa, sb, fast.perms), rel=1e-5)
