"""Structured PermutationSpec axes (Segments, Tiled, Interleaved, one group on two axes): a planted permutation of a
small model written for each form leaves its function unchanged, and bad forms are refused when built."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn import Permutations, PermutationSpec, apply_permutation, matching_objective, weight_matching
from pyperm.nn.spec import Blocks, Interleaved, Segments, Tiled, entry_groups, rename_entry
from pyperm.testing import assert_same_function, random_permutations


def assert_exact_symmetry(model: nn.Module, spec: PermutationSpec, *inputs: torch.Tensor, seed: int = 0) -> None:
    """A random permutation of the form changes the weights but not the function, and its inverse
    restores the weights exactly."""
    perms = Permutations(spec, random_permutations(spec, seed))
    permuted = apply_permutation(spec, perms, model.state_dict())
    assert any(not torch.equal(permuted[k], v) for k, v in model.state_dict().items())
    assert_same_function(model, spec, *inputs, seed=seed)  # the same permutations: the same seed
    back = apply_permutation(spec, perms.inverse(), permuted)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def full_spec(model: nn.Module, sizes: dict[str, int], **axes) -> PermutationSpec:
    """Every state_dict key, with the given axes and all-None elsewhere (keys with dots written as __)."""
    given = {k.replace("__", "."): v for k, v in axes.items()}
    return PermutationSpec({k: given.get(k, (None,) * t.ndim) for k, t in model.state_dict().items()}, sizes)


# --------------------------------------------------------------------------- Segments


class TwoBranches(nn.Module):
    """DenseNet/U-Net style: two branches and the input concatenated along features."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 5), nn.Linear(3, 4)
        self.ln = nn.LayerNorm(12)
        self.head = nn.Linear(12, 2)

    def forward(self, x):
        h = torch.cat([torch.relu(self.a(x)), torch.tanh(self.b(x)), x], dim=1)
        return self.head(self.ln(h))


def segments_spec(model: TwoBranches) -> PermutationSpec:
    cat = Segments("a", "b", 3)
    return full_spec(
        model, {"a": 5, "b": 4}, a__weight=("a", None), a__bias=("a",), b__weight=("b", None), b__bias=("b",),
        ln__weight=(cat,), ln__bias=(cat,), head__weight=(None, cat),
    )  # fmt: skip


def test_segments_concatenation():
    torch.manual_seed(0)
    model = TwoBranches()
    spec = segments_spec(model)
    assert spec.structured and spec.axis_length("head.weight", 1) == 12
    assert spec.group_axes["a"] == (("a.weight", 0), ("a.bias", 0), ("ln.weight", 0), ("ln.bias", 0),
                                    ("head.weight", 1))  # fmt: skip
    assert_exact_symmetry(model, spec, torch.randn(4, 3))


class DenseBlock(nn.Module):
    """Two DenseNet layers on a convolutional stem: each layer reads the concatenation of all before it."""

    def __init__(self, c: int = 4, growth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        self.bn1, self.conv1 = nn.BatchNorm2d(c), nn.Conv2d(c, growth, 3, padding=1)
        self.bn2, self.conv2 = nn.BatchNorm2d(c + growth), nn.Conv2d(c + growth, growth, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(c + 2 * growth)
        self.fc = nn.Linear(c + 2 * growth, 3)

    def forward(self, x):
        h = self.stem(x)
        h = torch.cat([h, self.conv1(F.relu(self.bn1(h)))], 1)
        h = torch.cat([h, self.conv2(F.relu(self.bn2(h)))], 1)
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.bn3(h)), 1).flatten(1))


def dense_block_spec(model: DenseBlock) -> PermutationSpec:
    two, three = Segments("s", "g1"), Segments("s", "g1", "g2")
    bn = {f"bn{i}__{p}": (seg,) for i, seg in ((1, "s"), (2, two), (3, three))
          for p in ("weight", "bias", "running_mean", "running_var")}  # fmt: skip
    return full_spec(
        model, {"s": 4, "g1": 3, "g2": 3}, stem__weight=("s", None, None, None), stem__bias=("s",),
        conv1__weight=("g1", "s", None, None), conv1__bias=("g1",),
        conv2__weight=("g2", two, None, None), conv2__bias=("g2",), fc__weight=(None, three), **bn,
    )  # fmt: skip


def test_segments_dense_block():
    torch.manual_seed(0)
    model = DenseBlock()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    assert_exact_symmetry(model, dense_block_spec(model), torch.randn(2, 2, 5, 5))


# --------------------------------------------------------------------------- Tiled


class FlattenVGG(nn.Module):
    """A classifier on the flattened C x 3 x 3 feature map (torchvision's VGG flattens 512 x 7 x 7)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 5, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(3)
        self.fc1, self.fc2 = nn.Linear(5 * 9, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = self.pool(F.relu(self.conv2(F.relu(self.conv1(x)))))
        return self.fc2(F.relu(self.fc1(torch.flatten(h, 1))))


def flatten_spec(model: FlattenVGG) -> PermutationSpec:
    return full_spec(
        model, {"c1": 4, "c2": 5, "h": 6}, conv1__weight=("c1", None, None, None), conv1__bias=("c1",),
        conv2__weight=("c2", "c1", None, None), conv2__bias=("c2",), fc1__weight=("h", Tiled("c2", inner=9)),
        fc1__bias=("h",), fc2__weight=(None, "h"),
    )  # fmt: skip


def test_tiled_flatten_of_a_feature_map():
    torch.manual_seed(0)
    model = FlattenVGG()
    assert_exact_symmetry(model, flatten_spec(model), torch.randn(2, 3, 6, 6))


def attention_spec(model: nn.Module, heads: int = 2) -> PermutationSpec:
    """nn.MultiheadAttention: the stream, and head_dim units permuted alike in every head (q with k, v with out)."""
    qk, vo = Tiled("qk", outer=heads), Tiled("vo", outer=heads)
    qkv = Segments(qk, qk, vo)
    d = model.attn.embed_dim
    return full_spec(
        model, {"s": d, "qk": d // heads, "vo": d // heads}, embed__weight=("s", None), embed__bias=("s",),
        attn__in_proj_weight=(qkv, "s"), attn__in_proj_bias=(qkv,), attn__out_proj__weight=("s", vo),
        attn__out_proj__bias=("s",), head__weight=(None, "s"),
    )  # fmt: skip


class Attention(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(5, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


def test_tiled_head_dim_shared_by_every_head():
    torch.manual_seed(0)
    model = Attention()
    assert_exact_symmetry(model, attention_spec(model, 2), torch.randn(2, 4, 5))


class GroupedQueryAttention(nn.Module):
    """4 query heads over 2 key/value heads (each kv head read by a block of 2 query heads), head dim 3."""

    def __init__(self, d: int = 8, kv: int = 2, per_kv: int = 2, head_dim: int = 3) -> None:
        super().__init__()
        self.kv, self.per_kv, self.head_dim = kv, per_kv, head_dim
        self.embed = nn.Linear(5, d)
        self.q = nn.Linear(d, kv * per_kv * head_dim)
        self.k, self.v = nn.Linear(d, kv * head_dim), nn.Linear(d, kv * head_dim)
        self.o = nn.Linear(kv * per_kv * head_dim, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.embed(x)
        b, t, _ = h.shape
        q = self.q(h).view(b, t, self.kv * self.per_kv, self.head_dim).transpose(1, 2)
        k, v = (p(h).view(b, t, self.kv, self.head_dim).transpose(1, 2) for p in (self.k, self.v))
        k, v = (z.repeat_interleave(self.per_kv, dim=1) for z in (k, v))  # query head i reads kv head i // per_kv
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.head((h + self.o(a)).mean(1))


def grouped_query_spec(model: GroupedQueryAttention) -> PermutationSpec:
    """kv heads moved by one group, the query heads within every block by another, and the head dims of every
    query head alike by the head-dim groups of k and v: copies of a tiled unit."""
    qk, vo = Tiled(Tiled("qk", outer="q_heads"), outer="kv"), Tiled(Tiled("vo", outer="q_heads"), outer="kv")
    k, v = Tiled("qk", outer="kv"), Tiled("vo", outer="kv")
    sizes = {"s": 8, "kv": model.kv, "q_heads": model.per_kv, "qk": model.head_dim, "vo": model.head_dim}
    return full_spec(
        model, sizes, embed__weight=("s", None), embed__bias=("s",), q__weight=(qk, "s"), q__bias=(qk,),
        k__weight=(k, "s"), k__bias=(k,), v__weight=(v, "s"), v__bias=(v,), o__weight=("s", vo), o__bias=("s",),
        head__weight=(None, "s"),
    )  # fmt: skip


def test_tiled_unit_tiled_over_grouped_query_heads():
    torch.manual_seed(0)
    model = GroupedQueryAttention()
    assert_exact_symmetry(model, grouped_query_spec(model), torch.randn(2, 4, 5))


def test_tiled_unit_positions_and_relaxation():
    """Every unit of a tiled unit owns one entry per copy; the relaxation of permutation matrices is the permutation."""
    from pyperm.nn.align._relaxation import apply_relaxed, one_hot

    spec = PermutationSpec({"w": (Tiled(Tiled("d", outer="q"), outer="k", inner=2), None),
                            "v": (Tiled(Segments(1, "d"), outer="q"), None)}, {"k": 2, "q": 2, "d": 3})  # fmt: skip
    assert spec.axis_length("w", 0) == 24
    assert spec.unit_positions("w", 0, "k").tolist() == [list(range(12)), list(range(12, 24))]
    assert spec.unit_positions("w", 0, "q").sort(1).values.tolist() == [[0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17],
                                                                        [6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23]]
    assert sorted(spec.unit_positions("w", 0, "d")[0].tolist()) == [0, 1, 6, 7, 12, 13, 18, 19]
    perms = random_permutations(spec, 0)
    state = {"w": torch.randn(24, 3, dtype=torch.float64), "v": torch.randn(8, 3, dtype=torch.float64)}
    relaxed, permuted = apply_relaxed(spec, one_hot(spec, perms), state), apply_permutation(spec, perms, state)
    for key in state:
        torch.testing.assert_close(relaxed[key], permuted[key])


@pytest.mark.parametrize("form", ["tiled-grouped-query", "tiled-partial-rotary"])
def test_weight_matching_of_a_tiled_unit_takes_the_reference_steps(form):
    """Two unrelated models: the fast matcher over the lowered sub-axes (and their cuts) is the plain reference,
    sweep for sweep."""
    from pyperm.nn.align._structured import reference_matching

    torch.manual_seed(0)
    factory, make_spec = FORMS[form]
    a, b = factory(), factory()
    spec, sa, sb = make_spec(a), a.state_dict(), b.state_dict()
    for seed in (0, 1):
        fast = weight_matching(spec, sa, sb, seed=seed, init="identity", dtype=torch.float64)
        plain = reference_matching(spec, sa, sb, seed=seed, dtype=torch.float64)
        assert fast.perms == plain.perms and fast.iterations == plain.iterations
        assert fast.objective[-1] == pytest.approx(matching_objective(spec, sa, sb, fast.perms), rel=1e-9)


class PartialRotary(nn.Module):
    """4 heads whose first 2 query/key dims turn by the token's angle (in place), the other 2 passed through."""

    def __init__(self, d: int = 8, heads: int = 4, rotary: int = 2, passed: int = 2) -> None:
        super().__init__()
        self.heads, self.rotary, self.head_dim = heads, rotary, rotary + passed
        self.embed = nn.Linear(5, d)
        self.q, self.k = nn.Linear(d, heads * self.head_dim), nn.Linear(d, heads * self.head_dim)
        self.v, self.o = nn.Linear(d, heads * 3), nn.Linear(heads * 3, d)
        self.head = nn.Linear(d, 3)

    def _turned(self, z):
        b, t, _ = z.shape
        z = z.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        angle = torch.arange(t, dtype=z.dtype).view(t, 1)
        x, y, rest = z[..., 0:1], z[..., 1:2], z[..., self.rotary :]
        return torch.cat([x * angle.cos() - y * angle.sin(), x * angle.sin() + y * angle.cos(), rest], -1)

    def forward(self, x):
        h = self.embed(x)
        b, t, _ = h.shape
        v = self.v(h).view(b, t, self.heads, 3).transpose(1, 2)
        a = F.scaled_dot_product_attention(self._turned(self.q(h)), self._turned(self.k(h)), v)
        return self.head((h + self.o(a.transpose(1, 2).reshape(b, t, -1))).mean(1))


def partial_rotary_spec(model: PartialRotary) -> PermutationSpec:
    """Heads moved by one group; within every head the rotary dims in place and the rest moved alike."""
    qk, vo = Tiled(Segments(model.rotary, "qk"), outer="h"), Tiled("vo", outer="h")
    sizes = {"s": 8, "h": model.heads, "qk": model.head_dim - model.rotary, "vo": 3}
    return full_spec(
        model, sizes, embed__weight=("s", None), embed__bias=("s",), q__weight=(qk, "s"), q__bias=(qk,),
        k__weight=(qk, "s"), k__bias=(qk,), v__weight=(vo, "s"), v__bias=(vo,), o__weight=("s", vo), o__bias=("s",),
        head__weight=(None, "s"),
    )  # fmt: skip


def test_tiled_segments_unit_of_partial_rotary_heads():
    torch.manual_seed(0)
    model = PartialRotary()
    spec = partial_rotary_spec(model)
    assert_exact_symmetry(model, spec, torch.randn(2, 4, 5))
    assert spec.unit_positions("q.weight", 0, "qk").tolist() == [[2, 6, 10, 14], [3, 7, 11, 15]]
    # Swapping the two rotary dims of every head as well changes the function: the Segments unit is needed.
    axes = {k: (Tiled("qk", outer="h"),) + v[1:] if k[0] in "qk" else v for k, v in spec.axes.items()}
    wrong = PermutationSpec(axes, {**spec.sizes, "qk": 4})
    x, swapped = torch.randn(2, 4, 5), PartialRotary()
    swapped.load_state_dict(apply_permutation(wrong, {**wrong.identity(), "qk": torch.tensor([1, 0, 2, 3])},
                                              model.state_dict()))  # fmt: skip
    assert not torch.allclose(swapped(x), model(x))


# --------------------------------------------------------------------------- one group on two axes


class OneLayerResidual(nn.Module):
    """h + relu(W h): W is applied to the residual stream and writes back to it (P W P^T)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.out(h)


def two_axes_spec(model: OneLayerResidual) -> PermutationSpec:
    blocks = {f"blocks__{i}__weight": ("h", "h") for i in range(2)} | {f"blocks__{i}__bias": ("h",) for i in range(2)}
    return full_spec(model, {"h": 6}, inp__weight=("h", None), inp__bias=("h",), out__weight=(None, "h"), **blocks)


def test_same_group_on_two_axes():
    torch.manual_seed(0)
    model = OneLayerResidual()
    spec = two_axes_spec(model)
    assert spec.structured
    assert spec.group_axes["h"][:3] == (("inp.weight", 0), ("inp.bias", 0), ("blocks.0.weight", 0))
    assert ("blocks.0.weight", 1) in spec.group_axes["h"]
    assert_exact_symmetry(model, spec, torch.randn(4, 3))


class RecurrentClassifier(nn.Module):
    def __init__(self, kind: type = nn.LSTM) -> None:
        super().__init__()
        self.proj, self.rnn, self.head = nn.Linear(3, 4), kind(4, 5, batch_first=True), nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.rnn(torch.tanh(self.proj(x)))[0][:, -1])


def recurrent_spec(model: RecurrentClassifier) -> PermutationSpec:
    gates = {nn.RNN: 1, nn.GRU: 3, nn.LSTM: 4}[type(model.rnn)]
    stacked = Segments(*["h"] * gates) if gates > 1 else "h"
    return full_spec(
        model, {"p": 4, "h": 5}, proj__weight=("p", None), proj__bias=("p",), rnn__weight_ih_l0=(stacked, "p"),
        rnn__weight_hh_l0=(stacked, "h"), rnn__bias_ih_l0=(stacked,), rnn__bias_hh_l0=(stacked,),
        head__weight=(None, "h"),
    )  # fmt: skip


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM], ids=["rnn", "gru", "lstm"])
def test_recurrent_layer_gates_as_segments(kind):
    torch.manual_seed(0)
    model = RecurrentClassifier(kind)
    assert_exact_symmetry(model, recurrent_spec(model), torch.randn(2, 6, 3))


# --------------------------------------------------------------------------- Interleaved


class Shuffled(nn.Module):
    """ShuffleNet's channel shuffle of two branches (5 units each), then a chunk: the first half (units 0-2 of
    a, 0-1 of b, in turn) to one head, the second (b 2-4 and a 3-4, b first) through a layer to another."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 5), nn.Linear(3, 5)
        self.mid = nn.Linear(5, 4)
        self.head = nn.Linear(5 + 4, 2)

    def forward(self, x):
        h = torch.cat([torch.relu(self.a(x)), torch.tanh(self.b(x))], 1)
        h = h.view(-1, 2, 5).transpose(1, 2).reshape(-1, 10)
        first, second = h.split([5, 5], dim=1)
        return self.head(torch.cat([first, torch.relu(self.mid(second))], 1))


def interleaved_spec(model: Shuffled) -> PermutationSpec:
    # Groups a = a0 (3 units) + a1 (2), b = b0 (2) + b1 (3): each piece of the chunk holds some of each.
    return full_spec(
        model, {"a0": 3, "a1": 2, "b0": 2, "b1": 3, "m": 4},
        a__weight=(Segments("a0", "a1"), None), a__bias=(Segments("a0", "a1"),),
        b__weight=(Segments("b0", "b1"), None), b__bias=(Segments("b0", "b1"),),
        mid__weight=("m", Interleaved("b1", "a1")), mid__bias=("m",),
        head__weight=(None, Segments(Interleaved("a0", "b0"), "m")),
    )  # fmt: skip


def test_interleaved_halves():
    torch.manual_seed(0)
    model = Shuffled()
    spec = interleaved_spec(model)
    assert spec.structured and spec.axis_length("head.weight", 1) == 9
    assert spec.unit_positions("mid.weight", 1, "a1").tolist() == [[1], [3]]
    assert spec.unit_positions("head.weight", 1, "b0").tolist() == [[1], [3]]
    assert_exact_symmetry(model, spec, torch.randn(4, 3))


def test_interleaved_index_of_nested_parts():
    """Entry k*i + j is entry i of part j, parts may be forms (an interleave of interleaves) or fixed entries."""
    spec = PermutationSpec({"w": (Interleaved(Interleaved("a", "b"), "c", 3),)}, {"a": 2, "b": 1, "c": 3})
    perms = {"a": torch.tensor([1, 0]), "b": torch.tensor([0]), "c": torch.tensor([2, 1, 0])}
    # Layout: a0 c0 f0 b0 c1 f1 a1 c2 f2.
    assert spec.axis_index("w", 0, perms).tolist() == [6, 7, 2, 3, 4, 5, 0, 1, 8]
    assert spec.unit_positions("w", 0, "c").tolist() == [[1], [4], [7]]
    t = torch.arange(9.0)
    back = apply_permutation(spec, Permutations(spec, perms).inverse(), apply_permutation(spec, perms, {"w": t}))
    assert torch.equal(back["w"], t)


# --------------------------------------------------------------------------- errors and equivalence


def test_bad_forms_are_refused():
    with pytest.raises(ValueError, match="Segments needs at least one part"):
        Segments()
    with pytest.raises(TypeError, match="Segments parts must be group names, ints, Tiled, Blocks, Interleaved, got"):
        Segments("a", 2.0)
    with pytest.raises(ValueError, match="Interleaved needs at least two parts, got 1"):
        Interleaved("a")
    with pytest.raises(ValueError, match=r"tensor 'w' axis 0: Interleaved parts span \[2, 4\] entries"):
        PermutationSpec({"w": (Interleaved("a", "b"),)}, {"a": 2, "b": 4})
    with pytest.raises(ValueError, match="a fixed Segments part must be at least 1, got 0"):
        Segments("a", 0)
    with pytest.raises(ValueError, match="Tiled inner must be at least 1, got 0"):
        Tiled("a", inner=0)
    with pytest.raises(TypeError, match="Tiled outer must be a positive int, got float"):
        Tiled("a", outer=2.0)
    with pytest.raises(ValueError, match="Blocks outer must be at least 1, got 0"):
        Blocks(0, "d")
    with pytest.raises(TypeError, match=r"sizes\['a'\] must be a positive int, got float"):
        PermutationSpec({"w": ("a",)}, {"a": 2.0})
    with pytest.raises(ValueError, match=r"sizes\['a'\] must be at least 1, got 0"):
        PermutationSpec({"w": ("a",)}, {"a": 0})
    with pytest.raises(TypeError, match="Tiled group must be a group name, a Tiled form or a Segments of group names "
                                        "and ints, got 3"):  # fmt: skip
        Tiled(3)
    with pytest.raises(TypeError, match=r"Tiled group must be .*, got Segments\('a', Tiled"):
        Tiled(Segments("a", Tiled("b")), outer="c")
    with pytest.raises(TypeError, match=r"Tiled group must be .*, got Blocks"):
        Tiled(Blocks("h", "d"), outer=2)
    with pytest.raises(ValueError, match=r"Tiled outer must be another group than those of Tiled\(group='a'"):
        Tiled(Tiled("a", outer="b"), outer="b")
    with pytest.raises(ValueError, match=r"tensor 'w' axis 1 names unknown group 'b'"):
        PermutationSpec({"w": ("a", Segments("a", "b"))}, {"a": 2})
    with pytest.raises(TypeError, match=r"tensor 'w' axis 0: an axis entry must be .* got list"):
        PermutationSpec({"w": (["a"],)}, {"a": 2})
    spec = PermutationSpec({"w": (Segments("a", 3), Tiled("a", outer=2))}, {"a": 2})
    spec.check_state_dict({"w": torch.zeros(5, 4)})
    with pytest.raises(ValueError, match=r"state_dict\['w'\] axis 1 has size 3; Tiled\(group='a', outer=2, inner=1\)"):
        spec.check_state_dict({"w": torch.zeros(5, 3)})
    with pytest.raises(ValueError, match=r"unknown group 'z'"):
        spec.unit_positions("w", 0, "z")
    with pytest.raises(ValueError, match=r"group 'a' does not act on 'w' axis 1"):
        PermutationSpec({"w": ("a", None)}, {"a": 2}).unit_positions("w", 1, "a")


def test_numpy_integers_are_ints():
    """Counts may come from numpy arithmetic; the forms keep Python ints, so they compare and print as written."""
    assert Segments("a", np.int64(2)) == Segments("a", 2) and type(Segments("a", np.int64(2)).parts[1]) is int
    assert Tiled("a", outer=np.int32(2), inner=np.int64(3)) == Tiled("a", outer=2, inner=3)
    assert Blocks(np.int64(2), "d") == Blocks(2, "d")
    assert PermutationSpec({"w": ("a",)}, {"a": np.int64(2)}).sizes == {"a": 2}


def test_groups_and_renaming_of_every_form():
    forms = {
        "a": ("a",),
        None: (),
        Tiled("a", inner=4): ("a",),
        Tiled("a", outer="b"): ("a", "b"),
        Tiled(Tiled("a", outer="b"), outer="c", inner=2): ("a", "b", "c"),
        Tiled(Segments(2, "a", "b"), outer="c"): ("a", "b", "c"),
        Blocks("h", "d"): ("h", "d"),
        Blocks(2, "d"): ("d",),
        Segments("a", 3, Tiled("b", outer="c"), Blocks("h", "d"), "a"): ("a", "b", "c", "h", "d"),
        Interleaved(Interleaved("b", "a"), 2, "c"): ("b", "a", "c"),
    }
    mapping = {g: g.upper() for g in "abcdh"}
    for entry, groups in forms.items():
        assert entry_groups(entry) == groups
        if entry is not None and not isinstance(entry, str):
            assert entry.groups() == groups
        renamed = rename_entry(entry, mapping)
        assert entry_groups(renamed) == tuple(g.upper() for g in groups)
        assert rename_entry(renamed, {g.upper(): g for g in groups}) == entry
    assert rename_entry(Segments("a", 3), {"a": "x"}) == Segments("x", 3)
    with pytest.raises(KeyError):
        rename_entry(Tiled("a", outer="b"), {"a": "x"})  # every named group needs a new name


def test_structured_specs_compare_by_structure():
    a = PermutationSpec({"w": ("a", None), "v": ("b", None), "h": (None, Segments("a", "b", 2))}, {"a": 2, "b": 3})
    renamed = PermutationSpec({"w": ("x", None), "v": ("y", None), "h": (None, Segments("x", "y", 2))},
                              {"x": 2, "y": 3})  # fmt: skip
    swapped = PermutationSpec({"w": ("a", None), "v": ("b", None), "h": (None, Segments("b", "a", 2))},
                              {"a": 2, "b": 3})  # fmt: skip
    assert a.equivalent(renamed) and a.group_correspondence(renamed) == {"a": "x", "b": "y"}
    assert not a.equivalent(swapped)
    assert a.structured and a != renamed
    flat = PermutationSpec({"w": ("a", None)}, {"a": 2})
    assert not flat.structured


# --------------------------------------------------------------------------- weight matching


def planted_recovery(model: nn.Module, spec: PermutationSpec, seed: int = 3) -> None:
    """B is A with a planted permutation: weight matching finds the permutation back (B aligned equals A)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # spread the weights: no ties between units
    sa = model.state_dict()
    sb = apply_permutation(spec, random_permutations(spec, seed), sa)
    result = weight_matching(spec, sa, sb, seed=0)
    assert result.objective == sorted(result.objective)  # never decreases
    aligned = apply_permutation(spec, result.perms, sb)
    for key, t in sa.items():
        torch.testing.assert_close(aligned[key], t, msg=key)
    assert result.objective[-1] == pytest.approx(matching_objective(spec, sa, sa), rel=1e-5)


FORMS = {
    "segments": (TwoBranches, segments_spec),
    "dense-block": (DenseBlock, dense_block_spec),
    "tiled-flatten": (FlattenVGG, flatten_spec),
    "tiled-heads": (Attention, attention_spec),
    "tiled-grouped-query": (GroupedQueryAttention, grouped_query_spec),
    "tiled-partial-rotary": (PartialRotary, partial_rotary_spec),
    "two-axes": (OneLayerResidual, two_axes_spec),
    "interleaved": (Shuffled, interleaved_spec),
    "lstm": (RecurrentClassifier, recurrent_spec),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_weight_matching_recovers_a_planted_permutation(form):
    torch.manual_seed(0)
    factory, make_spec = FORMS[form]
    model = factory()
    planted_recovery(model, make_spec(model))


def test_entry_length_of_every_form():
    spec = PermutationSpec({"w": (Segments("a", Tiled("b", inner=3, outer=2), 4), None),
                            "v": (Interleaved("c", "c"), Blocks("e", "d"))},
                           {"a": 2, "b": 5, "c": 3, "d": 6, "e": 2})  # fmt: skip
    assert [spec.entry_length(e) for e in (None, 4, "a", Tiled("b", inner=3, outer=2))] == [None, 4, 2, 30]
    assert spec.entry_length(spec.axes["w"][0]) == 2 + 30 + 4 == spec.axis_length("w", 0)
    assert spec.entry_length(Interleaved("c", "c")) == 6 and spec.entry_length(Blocks("e", "d")) == 6
    assert spec.axis_length("w", 1) is None
