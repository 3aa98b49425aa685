"""PermutationSpec.from_model / trace_model: traced specs preserve the function, and errors name the op."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pyperm.nn import PermutationSpec, TraceError, models, trace_model
from pyperm.nn.spec import Segments
from pyperm.nn.trace import TraceWarning
from pyperm.testing import assert_same_function


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics and affine parameters, so a wrong spec shows."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model


# --------------------------------------------------------------------------- models


def mlp(widths=(6, 16, 12, 3)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SmallVGG(nn.Module):
    def __init__(self, w: int = 8, pool_to: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )  # fmt: skip
        self.pool = nn.AdaptiveAvgPool2d(pool_to)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(2 * w * pool_to * pool_to, 10))

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)))


class Block(nn.Module):
    """A CIFAR ResNet basic block; shortcut "B" projects with a 1x1 conv, "A" zero-pads channels."""

    def __init__(self, cin: int, cout: int, stride: int, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.kind = shortcut
        self.pad = (cout - cin) // 2
        self.shortcut = nn.Sequential()
        if (stride != 1 or cin != cout) and shortcut == "B":
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.kind == "A" and self.pad:
            short = F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))
        else:
            short = self.shortcut(x)
        return F.relu(out + short)


class TinyResNet(nn.Module):
    def __init__(self, shortcut: str = "B", w: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, w, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.layer1 = nn.Sequential(Block(w, w, 1, shortcut), Block(w, w, 1, shortcut))
        self.layer2 = nn.Sequential(Block(w, 2 * w, 2, shortcut), Block(2 * w, 2 * w, 1, shortcut))
        self.linear = nn.Linear(2 * w, 10)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer2(self.layer1(out))
        out = F.avg_pool2d(out, out.size()[3])
        return self.linear(out.view(out.size(0), -1))


class Concat(nn.Module):
    """Two branches concatenated along features, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.a1, self.a2 = nn.Linear(5, 7), nn.Linear(7, 4)
        self.b1, self.b2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.head1, self.head2 = nn.Linear(7, 9), nn.Linear(9, 2)

    def forward(self, x):
        a = self.a2(torch.relu(self.a1(x)))
        b = self.b2(torch.relu(self.b1(x)))
        h = torch.relu(torch.cat([a, b], dim=1))
        return self.head2(torch.relu(self.head1(h)))


class Functional(nn.Module):
    """Bare parameters and functional calls only: F.linear, @, F.conv2d, F.batch_norm, F.layer_norm."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.cw = nn.Parameter(torch.randn(6, 3, 3, 3, generator=g) * 0.3)
        self.cb = nn.Parameter(torch.randn(6, generator=g) * 0.1)
        self.register_buffer("rm", torch.randn(6, generator=g) * 0.1)
        self.register_buffer("rv", torch.rand(6, generator=g) + 0.5)
        self.bw = nn.Parameter(torch.rand(6, generator=g) + 0.5)
        self.bb = nn.Parameter(torch.randn(6, generator=g) * 0.1)
        self.w1 = nn.Parameter(torch.randn(10, 6, generator=g) * 0.3)
        self.b1 = nn.Parameter(torch.randn(10, generator=g) * 0.1)
        self.lw = nn.Parameter(torch.rand(10, generator=g) + 0.5)
        self.lb = nn.Parameter(torch.randn(10, generator=g) * 0.1)
        self.w2 = nn.Parameter(torch.randn(10, 8, generator=g) * 0.3)  # used as x @ w2
        self.gain = nn.Parameter(torch.rand(8, generator=g) + 0.5)
        self.w3 = nn.Parameter(torch.randn(2, 8, generator=g) * 0.3)

    def forward(self, x):
        x = F.conv2d(x, self.cw, self.cb, padding=1)
        x = F.batch_norm(x, self.rm, self.rv, self.bw, self.bb, training=False)
        x = torch.relu(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)
        x = F.linear(x, self.w1, self.b1)
        x = F.gelu(F.layer_norm(x, (10,), self.lw, self.lb))
        h = torch.tanh(x @ self.w2) * self.gain
        h = h + 0.5 * F.silu(h)
        return F.linear(h, self.w3)


class Attention(nn.Module):
    """Single-head self-attention over tokens with a residual stream and LayerNorm."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(5, d)
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = nn.Linear(d, 6), nn.Linear(d, 6), nn.Linear(d, 7), nn.Linear(7, d)
        self.mlp1, self.mlp2 = nn.Linear(d, 12), nn.Linear(12, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):  # (batch, tokens, 5)
        h = self.embed(x)
        z = self.ln(h)
        att = torch.softmax(self.q(z) @ self.k(z).transpose(-2, -1) / 6**0.5, dim=-1)
        h = h + self.o(att @ self.v(z))
        h = h + self.mlp2(F.gelu(self.mlp1(h)))
        return self.head(h.mean(dim=1))


class TiedEmbedding(nn.Module):
    def __init__(self, hidden: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.hidden = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(hidden)])
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.emb.weight  # tied weights

    def forward(self, ids):
        return self.out(self.hidden(self.emb(ids)))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.rec, self.out = nn.Linear(3, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.rec(h))
        h = torch.tanh(self.rec(h))  # the same layer on its own output
        return self.out(h)


class Depthwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pw1 = nn.Conv2d(3, 8, 1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn = nn.BatchNorm2d(8)
        self.pw2 = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.pw2(F.relu6(self.bn(self.dw(F.relu(self.pw1(x))))))


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(2, 6, 3, padding=1)
        self.n1 = nn.GroupNorm(1, 6)
        self.c2 = nn.Conv1d(6, 5, 3, padding=1)
        self.n2 = nn.InstanceNorm1d(5, affine=True)
        self.prelu = nn.PReLU(5)
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        x = F.elu(self.n1(self.c1(x)))
        x = self.prelu(self.n2(self.c2(x)))
        return self.fc(x.amax(dim=-1))


class KitchenSink(nn.Module):
    """Many shape and container operations that keep the channels where the tracer can follow them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pw = nn.Linear(8, 6)  # applied channels-last
        self.ln = nn.LayerNorm(6)
        self.conv2 = nn.Conv2d(6, 5, 1)
        self.gain = nn.Parameter(torch.rand(1, 5, 1, 1) + 0.5)
        self.fc = nn.Linear(5, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        h, _ = F.max_pool2d(h, 2, return_indices=True)
        h = h.permute(0, 2, 3, 1)  # (N, H, W, 8)
        h = self.ln(F.gelu(self.pw(h)))
        h = h.movedim(-1, 1).contiguous()  # (N, 6, H, W)
        top, bottom = h.chunk(2, dim=2)  # along H: the channels stay whole
        h = torch.cat([top, bottom], dim=2)
        h = torch.sigmoid(self.conv2(h)) * self.gain
        h = torch.stack(h.unbind(0), 0).unsqueeze(1).squeeze(1)
        h = h.mean(dim=(-1, -2), keepdim=True).flatten(1)  # (N, 5)
        h = torch.clamp(self.fc(h), -3, 3) * 0.5 + 1
        h = h.transpose(0, 1).t()
        return {"logits": self.out(torch.tanh(h)), "total": h.sum(dim=1)}


# --------------------------------------------------------------------------- specs


def test_mlp_spec_and_function():
    torch.manual_seed(0)
    model = mlp()
    spec = PermutationSpec.from_model(model, torch.randn(4, 6))
    want = PermutationSpec(
        {"0.weight": ("h1", None), "0.bias": ("h1",), "2.weight": ("h2", "h1"), "2.bias": ("h2",),
         "4.weight": (None, "h2"), "4.bias": (None,)},
        {"h1": 16, "h2": 12},
    )  # fmt: skip
    assert spec.equivalent(want)
    assert spec.groups == ("P_0", "P_2")
    assert_same_function(model, spec, torch.randn(5, 6), train=True)


def test_vgg_with_batchnorm():
    torch.manual_seed(0)
    model = randomize_bn(SmallVGG())
    spec = PermutationSpec.from_model(model, torch.randn(2, 3, 16, 16))
    assert spec.sizes == {"P_features.0": 8, "P_features.4": 16}
    for key in ("features.1.weight", "features.1.bias", "features.1.running_mean", "features.1.running_var"):
        assert spec.axes[key] == ("P_features.0",)
    assert spec.axes["features.1.num_batches_tracked"] == ()
    assert spec.axes["features.0.weight"] == ("P_features.0", None, None, None)
    assert spec.axes["classifier.1.weight"] == (None, "P_features.4")
    assert_same_function(model, spec, torch.randn(4, 3, 16, 16), train=True)


@pytest.mark.parametrize("shortcut", ["A", "B"])
def test_residual_groups_are_merged(shortcut):
    torch.manual_seed(0)
    model = randomize_bn(TinyResNet(shortcut))
    if shortcut == "A":
        with pytest.warns(TraceWarning, match=r"F\.pad \(graph node 'pad', module 'layer2\.0'\) pads axis 1"):
            result = trace_model(model, torch.randn(2, 3, 8, 8))
    else:
        result = trace_model(model, torch.randn(2, 3, 8, 8))
    spec = result.spec
    stem = spec.axes["conv1.weight"][0]
    inner = {spec.axes[f"layer{i}.{j}.conv1.weight"][0] for i in (1, 2) for j in (0, 1)}
    assert None not in inner and len(inner) == 4  # every block's inner units are their own group
    # Stage 1's residual stream: the stem and both blocks' second convs share one group.
    assert spec.axes["layer1.0.conv2.weight"][0] == stem == spec.axes["layer1.1.conv2.weight"][0]
    if shortcut == "B":
        assert stem is not None
        stream2 = spec.axes["layer2.0.conv2.weight"][0]
        assert stream2 is not None and stream2 != stem
        assert spec.axes["layer2.0.shortcut.0.weight"] == (stream2, stem, None, None)
        assert spec.axes["layer2.0.shortcut.1.running_var"] == (stream2,)
        assert spec.axes["layer2.1.conv2.weight"][0] == stream2
        assert spec.axes["linear.weight"] == (None, stream2)
        assert result.composites == ()
    else:
        # Zero-padding the channels makes the stage-2 stream a composite of stage 1's units and
        # padding; neither can be named by a spec, so both streams stay fixed (documented).
        assert stem is None and spec.axes["layer2.0.conv2.weight"][0] is None
        assert len(result.composites) == 1 and "F.pad" in result.composites[0]
    assert_same_function(model, spec, torch.randn(4, 3, 8, 8), train=True)


def test_residual_activation_sites():
    model = TinyResNet("B")
    result = trace_model(model, torch.randn(2, 3, 8, 8))
    stem = result.spec.axes["conv1.weight"][0]
    post = result.post_activation_sites[stem]
    # The stem's ReLU and the ReLU after each of the two residual additions of stage 1.
    assert [s.module for s in post] == ["", "layer1.0", "layer1.1"]
    assert all(s.op == "F.relu" and s.axis == 1 for s in post)
    pre = result.pre_activation_sites[stem]
    assert [s.module for s in pre] == ["bn1", "layer1.0.bn2", "layer1.1.bn2"]
    inner = result.spec.axes["layer1.0.conv1.weight"][0]
    assert [s.module for s in result.pre_activation_sites[inner]] == ["layer1.0.bn1"]
    assert [s.node for s in result.post_activation_sites[inner]] != []
    assert set(result.post_activation_sites) == set(result.spec.groups)


def test_mlp_sites_are_the_relus():
    result = trace_model(mlp(), torch.randn(2, 6))
    assert [s.module for g in result.spec.groups for s in result.post_activation_sites[g]] == ["1", "3"]
    assert [s.module for g in result.spec.groups for s in result.pre_activation_sites[g]] == ["0", "2"]
    assert result.sites(pre_activation=True) is result.pre_activation_sites


def test_concatenation_fixes_the_concatenated_groups():
    torch.manual_seed(0)
    model = Concat()
    with pytest.warns(TraceWarning, match=r"\(1 cause\(s\)\).*\n  - torch\.cat \(graph node 'cat', module '<model>'\)"):
        result = trace_model(model, torch.randn(3, 5), structured=False)
    spec = result.spec
    # The branches' inner layers stay free, the concatenated outputs are fixed, the head is free.
    assert spec.axes["a1.weight"] == ("P_a1", None)
    assert spec.axes["b1.weight"] == ("P_b1", None)
    assert spec.axes["a2.weight"] == (None, "P_a1")
    assert spec.axes["b2.weight"] == (None, "P_b1")
    assert spec.axes["head1.weight"] == ("P_head1", None)
    assert len(result.composites) == 1 and "torch.cat" in result.composites[0]
    assert_same_function(model, spec, torch.randn(6, 5), train=True)
    with pytest.raises(TraceError, match=r"torch\.cat .*module '<model>'.*composite"):
        trace_model(model, torch.randn(3, 5), composite="raise", structured=False)


def test_concatenation_along_batch_joins_groups():
    class BatchCat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.out(torch.relu(torch.cat([self.a(x), self.b(x)], dim=0)))

    torch.manual_seed(0)
    model = BatchCat()
    spec = PermutationSpec.from_model(model, torch.randn(3, 4), composite="raise")
    assert spec.axes["a.weight"][0] == spec.axes["b.weight"][0] == spec.axes["out.weight"][1] is not None
    assert len(spec.sizes) == 1
    assert_same_function(model, spec, torch.randn(3, 4), train=True)


def test_functional_model():
    torch.manual_seed(0)
    model = Functional()
    spec = PermutationSpec.from_model(model, torch.randn(2, 3, 6, 6))
    assert spec.axes["cw"] == ("P_cw", None, None, None)
    for key in ("cb", "rm", "rv", "bw", "bb"):
        assert spec.axes[key] == ("P_cw",)
    assert spec.axes["w1"] == ("P_w1", "P_cw")
    assert spec.axes["lw"] == spec.axes["lb"] == spec.axes["b1"] == ("P_w1",)
    assert spec.axes["w2"] == ("P_w1", "P_w2") and spec.axes["gain"] == ("P_w2",)
    assert spec.axes["w3"] == (None, "P_w2")
    assert_same_function(model, spec, torch.randn(3, 3, 6, 6), train=True)


def test_attention_and_layernorm():
    torch.manual_seed(0)
    model = Attention()
    spec = PermutationSpec.from_model(model, torch.randn(2, 4, 5))
    stream = spec.axes["embed.weight"][0]
    assert stream is not None
    assert spec.axes["ln.weight"] == (stream,) and spec.axes["o.weight"][0] == stream
    assert spec.axes["mlp2.weight"][0] == stream and spec.axes["head.weight"] == (None, stream)
    # q and k are contracted with each other: one shared group.
    assert spec.axes["q.weight"][0] == spec.axes["k.weight"][0] is not None
    assert spec.axes["v.weight"][0] == spec.axes["o.weight"][1] is not None
    assert len(spec.sizes) == 4
    assert_same_function(model, spec, torch.randn(3, 4, 5), train=True)


def test_tied_weights_are_permuted_alike():
    torch.manual_seed(0)
    model = TiedEmbedding()
    spec = PermutationSpec.from_model(model, torch.randint(0, 11, (2, 5)))
    # The tie makes the embedding's units those of the last hidden layer.
    emb = spec.axes["emb.weight"][1]
    assert spec.axes["emb.weight"] == spec.axes["out.weight"] == (None, emb) and emb is not None
    assert spec.axes["hidden.1.0.weight"] == (emb, "P_hidden.0.0")
    assert spec.axes["hidden.0.0.weight"] == ("P_hidden.0.0", emb)
    assert_same_function(model, spec, torch.randint(0, 11, (3, 5)), train=True)


@pytest.mark.parametrize("model", [TiedEmbedding(hidden=1), Recurrent()], ids=["tied", "recurrent"])
def test_same_group_on_two_axes_is_fixed(model):
    torch.manual_seed(0)
    example = torch.randint(0, 11, (2, 5)) if isinstance(model, TiedEmbedding) else torch.randn(2, 3)
    key = "hidden.0.0.weight" if isinstance(model, TiedEmbedding) else "rec.weight"
    with pytest.warns(TraceWarning, match=f"parameter '{key}' needs the same permutation on axes 0 and 1"):
        result = trace_model(model, example, structured=False)
    assert result.spec.axes[key] == (None, None)
    assert "needs the same permutation on axes 0 and 1" in result.composites[0]
    if isinstance(model, Recurrent):
        assert result.spec.sizes == {}
    with pytest.raises(TraceError, match=f"parameter '{key}' needs the same permutation on axes 0 and 1"):
        trace_model(model, example, composite="raise", structured=False)


def test_untied_embedding_opens_a_group():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 3))
    spec = PermutationSpec.from_model(model, torch.randint(0, 11, (2, 5)))
    assert spec.axes["0.weight"] == (None, "P_0") and spec.axes["1.weight"] == (None, "P_0")
    assert_same_function(model, spec, torch.randint(0, 11, (3, 5)), train=True)


def test_depthwise_convolution_keeps_the_group():
    torch.manual_seed(0)
    model = randomize_bn(Depthwise())
    spec = PermutationSpec.from_model(model, torch.randn(2, 3, 6, 6))
    assert spec.axes["dw.weight"] == ("P_pw1", None, None, None)
    assert spec.axes["dw.bias"] == spec.axes["bn.weight"] == ("P_pw1",)
    assert spec.axes["pw2.weight"] == (None, "P_pw1", None, None)
    assert_same_function(model, spec, torch.randn(3, 3, 6, 6), train=True)


def test_conv1d_groupnorm_instancenorm_prelu():
    torch.manual_seed(0)
    model = Conv1dNet()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    spec = PermutationSpec.from_model(model, torch.randn(2, 2, 9))
    assert spec.axes["n1.weight"] == ("P_c1",) and spec.axes["c2.weight"] == ("P_c2", "P_c1", None)
    assert spec.axes["n2.weight"] == spec.axes["prelu.weight"] == ("P_c2",)
    assert_same_function(model, spec, torch.randn(3, 2, 9), train=True)


def test_flatten_larger_than_one_by_one():
    torch.manual_seed(0)
    model = randomize_bn(SmallVGG(pool_to=2))
    result = trace_model(model, torch.randn(2, 3, 16, 16), composite="fix", structured=False)
    # The last conv's units reach the classifier as blocks of 2x2 features: fixed.
    assert result.spec.sizes == {"P_features.0": 8}
    assert result.spec.axes["classifier.1.weight"] == (None, None)
    assert "Flatten" in result.composites[0]
    assert_same_function(model, result.spec, torch.randn(4, 3, 16, 16), train=True)
    where = r"Flatten \(graph node 'classifier_0', module 'classifier\.0'\)"
    with pytest.raises(TraceError, match=where + r".*sizes \[2, 2\].*blocks of 4"):
        trace_model(model, torch.randn(2, 3, 16, 16), composite="raise", structured=False)


def test_kitchen_sink():
    torch.manual_seed(0)
    model = KitchenSink()
    spec = PermutationSpec.from_model(model, torch.randn(2, 3, 8, 8), composite="raise")
    assert spec.sizes == {"P_conv": 8, "P_pw": 6, "P_conv2": 5, "P_fc": 4}
    assert spec.axes["pw.weight"] == ("P_pw", "P_conv") and spec.axes["ln.bias"] == ("P_pw",)
    assert spec.axes["gain"] == (None, "P_conv2", None, None)
    assert spec.axes["out.weight"] == (None, "P_fc")
    assert_same_function(model, spec, torch.randn(3, 3, 8, 8), train=True)


def test_split_along_channels():
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(3, 8), nn.Linear(4, 5), nn.Linear(4, 5)

        def forward(self, x):
            left, right = torch.split(torch.relu(self.a(x)), 4, dim=1)
            return self.b(left) + self.c(right)

    # Structured (the default), the split cuts the class in two: each half its own group.
    torch.manual_seed(0)
    model = Split()
    result = trace_model(model, torch.randn(2, 3), composite="raise")
    assert result.spec.sizes == {"P_a_0": 4, "P_a_1": 4} and result.composites == ()
    assert result.spec.axes["a.weight"] == (Segments("P_a_0", "P_a_1"), None)
    assert result.spec.axes["b.weight"] == (None, "P_a_0") and result.spec.axes["c.weight"] == (None, "P_a_1")
    assert_same_function(model, result.spec, torch.randn(3, 3), train=True)
    # Flat, it is reported (or raises).
    with pytest.raises(TraceError, match=r"torch\.split .*splits axis 1"):
        trace_model(Split(), torch.randn(2, 3), composite="raise", structured=False)
    result = trace_model(Split(), torch.randn(2, 3), composite="fix", structured=False)
    assert result.spec.sizes == {} and "torch.split" in result.composites[0]


def test_inputs_and_outputs_are_never_permuted():
    class Skip(nn.Module):
        """The input is added to a hidden layer, and a hidden layer is also returned."""

        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = nn.Linear(4, 4), nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 2)

        def forward(self, x):
            h = torch.relu(self.a(x)) + x
            g = torch.relu(self.c(torch.relu(self.b(h))))
            return self.d(g), g

    spec = PermutationSpec.from_model(Skip(), torch.randn(2, 4))
    assert spec.axes["a.weight"] == (None, None)  # joined with the input
    assert spec.axes["c.weight"] == (None, "P_b")  # its output is a model output
    assert spec.sizes == {"P_b": 6}


def test_model_left_untouched():
    model = randomize_bn(SmallVGG()).train()
    model.features[1].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace_model(model, torch.randn(2, 3, 16, 16))
    assert model.training and not model.features[1].training and model.features[2].training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_unknown_op_on_invariant_tensors_is_fine():
    class Pre(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            x = torch.fft.fft(x).real  # an operation the tracer does not know, on the raw input
            return self.fc2(torch.relu(self.fc1(x)))

    spec = PermutationSpec.from_model(Pre(), torch.randn(2, 4))
    assert spec.sizes == {"P_fc1": 8}


def test_multiple_inputs():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(3, 5), nn.Linear(4, 5), nn.Linear(5, 2)

        def forward(self, x, y):
            return self.out(F.relu(self.a(x) + self.b(y)))

    torch.manual_seed(0)
    model = Two()
    x, y = torch.randn(2, 3), torch.randn(2, 4)
    spec = PermutationSpec.from_model(model, (x, y))
    assert spec.axes["a.weight"][0] == spec.axes["b.weight"][0] == "P_a"
    assert_same_function(model, spec, x, y, train=True)


# --------------------------------------------------------------------------- bundled models

BUNDLED = {
    "mlp": (lambda: models.MLP([1 * 6 * 6, 16, 9, 20, 4]), (2, 1, 6, 6)),
    "mlp-nohidden": (lambda: models.MLP([8, 3]), (2, 8)),
    "vgg11": (lambda: models.VGG11(), (1, 3, 32, 32)),
    "vgg16": (lambda: models.VGG16(num_classes=7), (1, 3, 32, 32)),
    "resnet20-B": (lambda: models.ResNet20(), (1, 3, 32, 32)),
    "resnet20-B-w2": (lambda: models.ResNet20(width_multiplier=2, num_classes=5), (1, 3, 16, 16)),
    "resnet20-A": (lambda: models.ResNet20(shortcut="A"), (1, 3, 32, 32)),
    "resnet20-A-w3": (lambda: models.ResNet20(width_multiplier=3, shortcut="A"), (1, 3, 16, 16)),
    "tinyten": (lambda: models.TinyTen(), (1, 3, 32, 32)),
    "tinyten-w2-nobias": (lambda: models.TinyTen(num_classes=100, width_multiplier=2, bias=False), (1, 3, 32, 32)),
}


@pytest.mark.parametrize("case", sorted(BUNDLED))
def test_bundled_traced_spec_equals_hand_written(case):
    factory, shape = BUNDLED[case]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = factory()
    result = trace_model(model, torch.randn(shape), composite="fix")  # resnet20-A pads its shortcuts
    hand = model.permutation_spec()
    assert result.spec.equivalent(hand), case
    mapping = result.spec.group_correspondence(hand)
    assert mapping is not None and sorted(mapping.values()) == sorted(hand.sizes)
    if case.startswith("resnet20-B"):
        # The residual stream of stage 1: the stem's ReLU and the ReLU ending each block.
        stage1 = next(g for g, h in mapping.items() if h == "stage1")
        assert [s.module for s in result.post_activation_sites[stage1]] == ["", "layer1.0", "layer1.1", "layer1.2"]


def test_bundled_traced_spec_preserves_the_function():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = randomize_bn(models.ResNet20(num_classes=5))
    spec = PermutationSpec.from_model(model, torch.randn(1, 3, 16, 16))
    assert_same_function(model, spec, torch.randn(3, 3, 16, 16), train=True)


# --------------------------------------------------------------------------- errors


class MultiHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x):  # (batch, tokens, 8)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, 8))


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module, cin: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(cin, cin)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.fc(x))


class ChannelShuffle(nn.Module):
    def forward(self, x):
        n, c, h, w = x.shape
        return x.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)


class Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_flat_trace_reports_a_head_split():
    """Flat, a split of an axis of units (attention heads) is fixed and reported, or raises under "raise"."""
    where = r"Tensor\.view \(graph node 'view', module '<model>'\) splits an axis of permuted units"
    with pytest.warns(TraceWarning, match=where):
        result = trace_model(MultiHead(), torch.randn(2, 3, 8), structured=False)
    assert len(result.composites) == 1
    with pytest.raises(TraceError, match=where):
        trace_model(MultiHead(), torch.randn(2, 3, 8), composite="raise", structured=False)


def test_attention_module_keeps_its_inputs_permutable():
    class MHA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x)[0]

    torch.manual_seed(0)
    model = Wrapper(MHA())
    with pytest.warns(TraceWarning, match=r"MultiheadAttention .*module 'inner\.attn'\) keeps its per-head units"):
        spec = PermutationSpec.from_model(model, torch.randn(2, 3, 8), structured=False)
    # The query/key/value features are contracted with in_proj_weight's columns; the heads stay fixed.
    assert spec.sizes == {"P_fc": 8}
    assert spec.axes["inner.attn.in_proj_weight"] == (None, "P_fc")
    assert spec.axes["inner.attn.out_proj.weight"] == (None, None)  # a model output
    assert_same_function(model, spec, torch.randn(3, 4, 8), train=True)
    with pytest.raises(TraceError, match=r"MultiheadAttention .*keeps its per-head units.*composite='fix'"):
        trace_model(model, torch.randn(2, 3, 8), composite="raise", structured=False)


def test_attention_module_on_the_input_is_fine():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(self.attn(x, x, x)[0])))

    with pytest.warns(TraceWarning, match=r"MultiheadAttention \(graph node 'attn', module 'attn'\) keeps its per"):
        spec = PermutationSpec.from_model(M(), torch.randn(2, 3, 4), structured=False)
    # The output projection produces units of its own.
    assert spec.sizes == {"P_attn": 4, "P_fc1": 6}
    assert spec.axes["attn.out_proj.weight"] == ("P_attn", None) and spec.axes["attn.out_proj.bias"] == ("P_attn",)
    assert spec.axes["attn.in_proj_weight"] == (None, None) and spec.axes["fc1.weight"] == ("P_fc1", "P_attn")


def test_flat_trace_reports_a_channel_shuffle():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), ChannelShuffle(), nn.Conv2d(8, 2, 1))
    with pytest.warns(TraceWarning, match=r"Tensor\.view .*module '1'\) splits an axis of permuted units"):
        spec = trace_model(model, torch.randn(1, 3, 4, 4), structured=False).spec
    assert spec.sizes == {}
    with pytest.raises(TraceError, match=r"Tensor\.view .*module '1'\) splits an axis of permuted units"):
        trace_model(model, torch.randn(1, 3, 4, 4), composite="raise", structured=False)


@pytest.mark.parametrize(
    ("fn", "op", "width"),
    [
        (lambda x: torch.sort(x, dim=1).values, r"torch\.sort", 8),
        (lambda x: torch.cumsum(x, 1), r"torch\.cumsum", 8),
        (lambda x: x.flip(-1), r"Tensor\.flip", 8),
        (lambda x: x.argmax(dim=1, keepdim=True).float(), r"Tensor\.argmax", 1),
        (lambda x: torch.max(x, 1)[0].unsqueeze(1), r"torch\.max", 1),
        (lambda x: x.roll(1, 1), r"Tensor\.roll", 8),
    ],
)
def test_error_order_dependent_ops(fn, op, width):
    model = nn.Sequential(nn.Linear(4, 8), Lambda(fn), nn.Linear(width, 2))
    with pytest.raises(TraceError, match=op + r" \(graph node '.*', module '1'\)"):
        trace_model(model, torch.randn(2, 4))


def test_order_ops_on_other_axes_are_fine():
    model = nn.Sequential(nn.Linear(4, 8), Lambda(lambda x: torch.sort(x, dim=0).values.cumsum(0)), nn.Linear(8, 2))
    spec = PermutationSpec.from_model(model, torch.randn(3, 4))
    assert spec.sizes == {"P_0": 8}
    assert_same_function(model, spec, torch.randn(3, 4), train=True)


def test_error_unknown_function_on_channels():
    model = nn.Sequential(nn.Linear(4, 8), Lambda(lambda x: torch.fft.fft(x).real), nn.Linear(8, 2))
    with pytest.raises(TraceError, match=r"unsupported operation torch\._?fft.*module '1'"):
        trace_model(model, torch.randn(2, 4))


@pytest.mark.parametrize(
    ("layer", "what"),
    [
        (nn.Conv2d(8, 8, 3, padding=1, groups=2), r"Conv2d .*module '1'\) is a grouped convolution \(groups=2\)"),
        (nn.GroupNorm(2, 8), r"GroupNorm .*module '1'\) normalises 2 groups of 4 permuted channels"),
    ],
    ids=["grouped-conv", "groupnorm"],
)
def test_channel_groups_fix_their_channels(layer, what):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), layer, nn.ReLU(), nn.Conv2d(8, 6, 1), nn.ReLU(), nn.Conv2d(6, 2, 1))
    with pytest.warns(TraceWarning, match=what):
        spec = PermutationSpec.from_model(model, torch.randn(1, 3, 5, 5), structured=False)
    assert spec.sizes == {"P_3": 6}
    assert_same_function(model, spec, torch.randn(2, 3, 5, 5), train=True)
    with pytest.raises(TraceError, match=what):
        trace_model(model, torch.randn(1, 3, 5, 5), composite="raise", structured=False)


def test_error_channel_slice_in_raise_mode():
    model = nn.Sequential(nn.Linear(4, 8), Lambda(lambda x: x[:, :4]), nn.Linear(4, 2))
    with pytest.raises(TraceError, match=r"operator\.getitem .*module '1'.*slices axis 1"):
        trace_model(model, torch.randn(2, 4), composite="raise")
    with pytest.warns(TraceWarning, match=r"operator\.getitem .*module '1'.*slices axis 1"):
        spec = PermutationSpec.from_model(model, torch.randn(2, 4))
    assert spec.sizes == {}


def test_error_untraceable_model():
    class Dynamic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return self.fc(x)
            return x

    with pytest.raises(TraceError, match=r"torch\.fx could not trace Dynamic"):
        trace_model(Dynamic(), torch.randn(2, 3))


def test_error_bad_arguments():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        PermutationSpec.from_model(lambda x: x, torch.randn(2, 3))
    with pytest.raises(TypeError, match="example_input must be a tensor or a tuple"):
        PermutationSpec.from_model(mlp(), {"x": torch.randn(2, 6)})
    with pytest.raises(ValueError, match="composite must be 'fix' or 'raise'"):
        PermutationSpec.from_model(mlp(), torch.randn(2, 6), composite="ignore")
    with pytest.raises(TraceError, match="running the traced Sequential on example_input failed"):
        PermutationSpec.from_model(mlp(), torch.randn(2, 5))


# --------------------------------------------------------------------------- equivalent


def test_equivalent():
    a = PermutationSpec({"w1": ("h", None), "b1": ("h",), "w2": (None, "h")}, {"h": 3})
    renamed = PermutationSpec({"w1": ("x", None), "b1": ("x",), "w2": (None, "x")}, {"x": 3})
    assert a.equivalent(renamed) and renamed.equivalent(a)
    assert a.group_correspondence(renamed) == {"h": "x"}
    assert a.equivalent(a)
    # Different partitions, a missing key, a different rank, an axis left unpermuted.
    split = PermutationSpec({"w1": ("h", None), "b1": ("g",), "w2": (None, "h")}, {"h": 3, "g": 3})
    fewer = PermutationSpec({"w1": ("h", None), "w2": (None, "h")}, {"h": 3})
    rank = PermutationSpec({"w1": ("h", None), "b1": ("h", None), "w2": (None, "h")}, {"h": 3})
    fixed = PermutationSpec({"w1": ("h", None), "b1": (None,), "w2": (None, "h")}, {"h": 3})
    for other in (split, fewer, rank, fixed):
        assert not a.equivalent(other) and not other.equivalent(a)
        assert a.group_correspondence(other) is None
    with pytest.raises(TypeError, match="other must be a PermutationSpec"):
        a.equivalent({"w1": ("h", None)})


# --------------------------------------------------------------------------- warnings


def test_warning_lists_every_cause_and_points_at_the_caller():
    class Two(nn.Module):
        """A concatenation and a flatten of a 2x2 feature map: two causes, two modules."""

        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 5, 1)
            self.head = nn.Sequential(nn.Conv2d(9, 6, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
            self.out = nn.Linear(24, 2)

        def forward(self, x):
            return self.out(self.head(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)))

    with pytest.warns(TraceWarning) as record:
        spec = PermutationSpec.from_model(Two(), torch.randn(2, 3, 4, 4), structured=False)
    assert len(record) == 1 and record[0].filename == __file__
    message = str(record[0].message)
    assert "(2 cause(s))" in message
    lines = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(lines) == 2
    assert "torch.cat (graph node 'cat', module '<model>')" in lines[0]
    assert "Flatten (graph node 'head_3', module 'head.3')" in lines[1]
    assert spec.sizes == {}
    # Passing composite="fix" explicitly accepts the same result silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = PermutationSpec.from_model(Two(), torch.randn(2, 3, 4, 4), composite="fix", structured=False)
        result = trace_model(Two(), torch.randn(2, 3, 4, 4), composite="fix", structured=False)
    assert fixed == spec and len(result.composites) == 2
    with pytest.warns(TraceWarning) as record:
        trace_model(Two(), torch.randn(2, 3, 4, 4), structured=False)
    assert record[0].filename == __file__


def test_no_warning_without_causes():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = trace_model(TinyResNet("B"), torch.randn(2, 3, 8, 8))
    assert result.composites == ()


def test_module_without_rule_holding_parameters_is_listed():
    class Opaque(nn.Module):
        """A module of torch.nn the tracer has no rule for, on the model input."""

        def __init__(self) -> None:
            super().__init__()
            self.bilinear = nn.Bilinear(3, 3, 5)
            self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(self.bilinear(x, x))))

    with pytest.warns(TraceWarning, match=r"Bilinear \(graph node 'bilinear', module 'bilinear'\) has no trace rule"):
        result = trace_model(Opaque(), torch.randn(2, 3))
    assert result.spec.sizes == {"P_fc1": 6}
    with pytest.raises(TraceError, match=r"Bilinear .*has no trace rule.*register_trace_rule"):
        trace_model(Opaque(), torch.randn(2, 3), composite="raise")
