"""Architectures nobody in this project wrote, as small stand-ins: each traces (no error), every cause of
units left unpermuted is reported, the traced spec keeps the function, and the share of hidden units it can
permute is at least what the tracer reaches today (the table in the issue 12 notes).

torchvision and timm are optional: their models are checked when installed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _vision import import_timm, import_torchvision
from torch import nn

from pyperm.nn import (
    Permutations,
    TraceError,
    TraceResult,
    activation_matching,
    apply_permutation,
    matching_objective,
    trace_model,
    weight_matching,
)
from pyperm.nn.spec import Segments, Tiled
from pyperm.testing import assert_same_function, permutable_share, random_permutations

# --------------------------------------------------------------------------- helpers


def head(layer: nn.Module) -> nn.Module:
    layer.is_head = True  # produces the model's output: never permuted
    return layer


# --------------------------------------------------------------------------- models


class DenseNetBlock(nn.Module):
    def __init__(self, c: int = 8, growth: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.bns = nn.ModuleList(nn.BatchNorm2d(c + i * growth) for i in range(layers))
        self.convs = nn.ModuleList(nn.Conv2d(c + i * growth, growth, 3, padding=1) for i in range(layers))
        self.fc = head(nn.Linear(c + layers * growth, 5))

    def forward(self, x):
        h = self.stem(x)
        for bn, conv in zip(self.bns, self.convs):
            h = torch.cat([h, conv(F.relu(bn(h)))], 1)
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class UNet(nn.Module):
    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.down1, self.down2 = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, 2 * c, 3, padding=1)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = nn.Conv2d(2 * c, c, 3, padding=1)
        self.out = head(nn.Conv2d(c, 2, 1))

    def forward(self, x):
        d1 = F.relu(self.down1(x))
        d2 = F.relu(self.down2(F.max_pool2d(d1, 2)))
        u = torch.cat([F.relu(self.up(d2)), d1], 1)  # the skip connection
        return self.out(F.relu(self.dec(u)))


class VGGFlatten(nn.Module):
    """torchvision's VGG head: adaptive pooling to 7x7, flatten, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(7))  # fmt: skip
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8 * 49, 16), nn.ReLU(), head(nn.Linear(16, 5)))

    def forward(self, x):
        return self.classifier(self.features(x))


class ResidualMLP(nn.Module):
    """One-layer residual branches h + relu(W h): W needs P on both axes."""

    def __init__(self, d: int = 12, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.out = head(nn.Linear(d, 3))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + F.relu(block(h))
        return self.out(h)


class RecurrentClassifier(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.rnn = kind(8, 10, batch_first=True)
        self.fc = head(nn.Linear(10, 3))

    def forward(self, ids):
        return self.fc(self.rnn(self.embed(ids))[0][:, -1])


class EncoderMHA(nn.Module):
    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(6, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.out = head(nn.Linear(d, 3))

    def forward(self, x):
        h = self.embed(x)
        z = self.ln1(h)
        h = h + self.attn(z, z, z, need_weights=False)[0]
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.out(h.mean(1))


class EncoderFusedQKV(nn.Module):
    """timm/HF style attention: one qkv Linear, a reshape that splits heads, scaled dot-product attention."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Linear(6, d)
        self.ln = nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.out = head(nn.Linear(d, 3))

    def forward(self, x):
        h = self.embed(x)
        b, t, d = h.shape
        qkv = self.qkv(self.ln(h)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        return self.out((h + self.proj(a)).mean(1))


class GroupedConvBlock(nn.Module):
    """ResNeXt/RegNet style bottleneck: 1x1, grouped 3x3, 1x1, with a residual stream."""

    def __init__(self, c: int = 8, width: int = 8, groups: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.a = nn.Conv2d(c, width, 1)
        self.b = nn.Conv2d(width, width, 3, padding=1, groups=groups)
        self.c = nn.Conv2d(width, c, 1)
        self.fc = head(nn.Linear(c, 4))

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = F.relu(h + self.c(F.relu(self.b(F.relu(self.a(h))))))
        return self.fc(h.mean((2, 3)))


class InvertedResidual(nn.Module):
    """MobileNetV2 / EfficientNet: expand, depthwise, squeeze-excite, project, residual."""

    def __init__(self, c: int = 8, expand: int = 24) -> None:
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c)
        self.expand, self.bn1 = nn.Conv2d(c, expand, 1), nn.BatchNorm2d(expand)
        self.dw, self.bn2 = nn.Conv2d(expand, expand, 3, padding=1, groups=expand), nn.BatchNorm2d(expand)
        self.se1, self.se2 = nn.Conv2d(expand, 6, 1), nn.Conv2d(6, expand, 1)
        self.project, self.bn3 = nn.Conv2d(expand, c, 1), nn.BatchNorm2d(c)
        self.fc = head(nn.Linear(c, 4))

    def forward(self, x):
        h = F.relu6(self.bn0(self.stem(x)))
        z = F.silu(self.bn2(self.dw(F.silu(self.bn1(self.expand(h))))))
        z = z * torch.sigmoid(self.se2(F.silu(self.se1(F.adaptive_avg_pool2d(z, 1)))))
        h = h + self.bn3(self.project(z))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, channels-last LayerNorm and MLP, layer scale (a parameter times the branch)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.ln = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))
        self.out = head(nn.Linear(c, 4))

    def forward(self, x):
        h = self.stem(x)
        z = self.dw(h).permute(0, 2, 3, 1)
        z = self.gamma * self.fc2(F.gelu(self.fc1(self.ln(z))))
        h = h + z.permute(0, 3, 1, 2)
        return self.out(h.mean((2, 3)))


class ShuffleUnits(nn.Module):
    """ShuffleNetV2: a unit concatenating two branches, then two halving their input (the first half passes on,
    the second through a branch), each channel-shuffled; torchvision's without BatchNorm, with GELU (no dead units
    for activation matching to tie)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left, self.right = nn.Conv2d(8, c // 2, 1), nn.Conv2d(8, c // 2, 1)
        self.branches = nn.ModuleList(nn.Sequential(nn.Conv2d(c // 2, c // 2, 1), nn.GELU(),
                                                    nn.Conv2d(c // 2, c // 2, 3, padding=1, groups=c // 2),
                                                    nn.Conv2d(c // 2, c // 2, 1), nn.GELU()) for _ in range(2))
        self.fc = head(nn.Linear(c, 4))

    @staticmethod
    def shuffle(h: torch.Tensor) -> torch.Tensor:
        n, c, hh, ww = h.shape
        return h.view(n, 2, c // 2, hh, ww).transpose(1, 2).reshape(n, c, hh, ww)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = self.shuffle(torch.cat((F.relu(self.left(h)), F.relu(self.right(h))), 1))
        for branch in self.branches:
            passed, rest = h.chunk(2, dim=1)
            h = self.shuffle(torch.cat((passed, branch(rest)), 1))
        return self.fc(h.mean((2, 3)))


# name: (factory, example input shape or a callable making it, share of hidden units permuted: flat, structured)
CASES = {
    "densenet-block": (DenseNetBlock, (2, 3, 8, 8), 0.0, 1.0),
    "unet": (UNet, (2, 3, 8, 8), 0.6, 1.0),
    "vgg-7x7-flatten": (VGGFlatten, (2, 3, 14, 14), 0.75, 1.0),
    "residual-mlp-1-layer": (ResidualMLP, (2, 6), 0.0, 1.0),
    "lstm-classifier": (lambda: RecurrentClassifier(nn.LSTM), lambda: torch.randint(0, 20, (2, 5)), 0.44, 1.0),
    "gru-classifier": (lambda: RecurrentClassifier(nn.GRU), lambda: torch.randint(0, 20, (2, 5)), 0.44, 1.0),
    "encoder-mha": (EncoderMHA, (2, 5, 6), 0.62, 1.0),
    "encoder-fused-qkv": (EncoderFusedQKV, (2, 5, 6), 0.4, 1.0),
    "grouped-conv-block": (GroupedConvBlock, (2, 3, 8, 8), 0.5, 1.0),
    "inverted-residual-se": (InvertedResidual, (2, 3, 8, 8), 1.0, 1.0),
    "convnext-block": (ConvNeXtBlock, (2, 3, 16, 16), 1.0, 1.0),
    "shufflenet-units": (ShuffleUnits, (2, 3, 8, 8), 0.56, 1.0),
}


def example(case: str) -> torch.Tensor:
    shape = CASES[case][1]
    return shape() if callable(shape) else torch.randn(shape)


def traced(case: str, structured: bool) -> tuple[nn.Module, TraceResult]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = CASES[case][0]()
        x = example(case)
    return model, trace_model(model, x, composite="fix", structured=structured)


@pytest.mark.parametrize("structured", [False, True], ids=["flat", "structured"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_architecture(case, structured):
    want = CASES[case][3 if structured else 2]
    model, result = traced(case, structured)
    share = permutable_share(model, result.spec)
    assert share == pytest.approx(want, abs=0.01), (case, share, result.composites)
    if share < 1.0:
        assert result.composites, "units left unpermuted must be reported"
    else:
        assert result.composites == ()
    assert result.spec.structured == (structured and case in STRUCTURED)
    if result.spec.sizes:  # a spec with no group keeps the function trivially
        with torch.random.fork_rng():
            torch.manual_seed(1)
            assert_same_function(model, result.spec, example(case))


# The cases whose full symmetry needs structured axes.
STRUCTURED = {"densenet-block", "unet", "vgg-7x7-flatten", "residual-mlp-1-layer", "lstm-classifier",
              "gru-classifier", "encoder-mha", "encoder-fused-qkv", "grouped-conv-block",
              "shufflenet-units"}  # fmt: skip


def test_fused_qkv_heads_move_as_wholes():
    """timm's reshape(b, t, 3, heads, head_dim): q, k and v are three copies of the same heads, which
    move as wholes (one group), the head dims alike in every head (another); flat, the split is reported."""
    model, result = traced("encoder-fused-qkv", structured=True)
    qkv = result.spec.axes["qkv.weight"][0]
    assert isinstance(qkv, Segments) and len(qkv.parts) == 3 and len(set(qkv.parts)) == 1
    part = qkv.parts[0]
    assert isinstance(part, Tiled) and isinstance(part.outer, str) and result.spec.sizes[part.outer] == 4
    assert result.spec.axes["proj.weight"][1] == part
    with pytest.raises(TraceError, match=r"Tensor\.reshape .*splits an axis of permuted units into axes of sizes "
                                         r"\[3, 4, 4\] .*structured=True"):  # fmt: skip
        trace_model(model, example("encoder-fused-qkv"), composite="raise", structured=False)


def test_channel_shuffle_is_a_split_then_a_merge():
    class Shuffle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.fc = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 6, 1), head(nn.Linear(6, 2))

        def forward(self, x):
            h = F.relu(self.a(x))
            n, c, hh, ww = h.shape
            h = h.view(n, 2, c // 2, hh, ww).transpose(1, 2).reshape(n, c, hh, ww)  # ShuffleNet's shuffle
            return self.fc(F.relu(self.b(h)).mean((2, 3)))

    torch.manual_seed(0)
    model = Shuffle()
    spec = trace_model(model, torch.randn(2, 3, 4, 4), structured=True).spec
    assert permutable_share(model, spec) == 1.0
    a, b = spec.axes["a.weight"][0], spec.axes["b.weight"][1]
    # The split's two halves move as wholes (one group) and the channels within them alike (another);
    # after the transpose the roles swap: the within-half channel is the outer index.
    assert isinstance(a, Tiled) and isinstance(b, Tiled) and a.inner == b.inner == 1
    assert (b.group, b.outer) == (a.outer, a.group) and spec.sizes[a.outer] == 2
    assert_same_function(model, spec, torch.randn(2, 3, 4, 4))


# --------------------------------------------------------------------------- torchvision, timm (optional)

# Models of the issue (and RegNet, for grouped convolutions): the share of hidden units a structured
# trace permutes must be at least 95%.
TORCHVISION = ["resnet18", "vgg11_bn", "densenet121", "mobilenet_v2", "efficientnet_b0", "convnext_tiny",
               "regnet_y_400mf"]  # fmt: skip


def check_library_model(model: nn.Module, x: torch.Tensor, planted: bool = True) -> None:
    """At least 95% of the hidden units permutable, the function kept, and a planted permutation found back."""
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    head(last)
    model.eval()
    result = trace_model(model, x, composite="fix", structured=True)
    spec = result.spec
    assert permutable_share(model, spec) >= 0.95, result.composites
    assert_same_function(model, spec, x)
    if not planted:
        return
    gen = torch.Generator().manual_seed(1)
    # Spread the weights (random-init BatchNorm and LayerNorm parameters are all equal: ties between units).
    sa = {k: (t.double() + 0.5 * torch.randn(t.shape, generator=gen, dtype=torch.float64)) if t.is_floating_point()
          else t for k, t in model.state_dict().items()}  # fmt: skip
    planted_perms = random_permutations(spec, gen)
    sb = apply_permutation(spec, planted_perms, sa)
    found = weight_matching(spec, sa, sb, seed=0)
    assert found.perms == Permutations(spec, planted_perms).inverse()


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_models(name):
    tv = import_torchvision()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = getattr(tv.models, name)(weights=None)
    # VGG's 25088 x 4096 classifier costs about a minute of float64 similarity products per sweep: not here
    # (pyperm bench match --structured times it).
    check_library_model(model, torch.randn(2, 3, 64, 64), planted=name != "vgg11_bn")


@pytest.mark.slow
def test_timm_vit():
    timm = import_timm()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    check_library_model(model, torch.randn(2, 3, 224, 224))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["regnet_y_400mf", "vit_tiny_patch16_224"])
def test_activation_matching_on_library_models(name):
    """A planted permutation of every group, grouped convolutions' blocks and ViT heads included, is
    undone from pre-activations (post-activation, random-init ReLU networks have dead units: ties)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        if name.startswith("vit"):
            model, shape = import_timm().create_model(name, pretrained=False), (3, 224, 224)
        else:
            model, shape = getattr(import_torchvision().models, name)(weights=None), (3, 64, 64)
        x = torch.randn(2, *shape)
        data = [torch.randn(8, *shape) for _ in range(2)]
    head([m for m in model.modules() if isinstance(m, nn.Linear)][-1])
    model.eval()
    spec = trace_model(model, x, composite="fix", structured=True).spec
    planted = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(3)))
    other = copy.deepcopy(model)
    other.load_state_dict(apply_permutation(spec, planted, model.state_dict()))
    found = activation_matching(model, other, spec, data, pre_activation=True)
    assert all(found.sites[g] for g in spec.groups)
    assert found.perms == planted.inverse()


@pytest.mark.parametrize("case", sorted(STRUCTURED))
def test_traced_structured_spec_planted_recovery(case):
    """Weight matching on the traced structured spec finds a planted permutation back."""
    model, result = traced(case, structured=True)
    spec = result.spec
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # spread the weights: no ties between units
    sa = model.state_dict()
    gen = torch.Generator().manual_seed(3)
    sb = apply_permutation(spec, random_permutations(spec, gen), sa)
    found = weight_matching(spec, sa, sb, seed=0)
    aligned = apply_permutation(spec, found.perms, sb)
    for key, t in sa.items():
        torch.testing.assert_close(aligned[key], t, msg=key)


@pytest.mark.parametrize("case", sorted(STRUCTURED))
def test_weight_matching_of_unrelated_traced_models_takes_the_reference_steps(case):
    """Two unrelated models with their traced structured spec (concatenations, flattens, heads, grouped
    convolutions, recurrent weights): the fast matcher finds what the plain reference finds, sweep for sweep."""
    from pyperm.nn.align._structured import reference_matching

    with torch.random.fork_rng():
        torch.manual_seed(5)
        a, b = CASES[case][0](), CASES[case][0]()
        spec = trace_model(a, example(case), composite="fix", structured=True).spec
    sa, sb = a.state_dict(), b.state_dict()
    for seed in (0, 1):
        fast = weight_matching(spec, sa, sb, seed=seed, init="identity", dtype=torch.float64)
        plain = reference_matching(spec, sa, sb, seed=seed, dtype=torch.float64)
        assert fast.perms == plain.perms and fast.iterations == plain.iterations
        assert fast.objective[-1] == pytest.approx(matching_objective(spec, sa, sb, fast.perms), rel=1e-6)


@pytest.mark.parametrize("case", ["densenet-block", "unet", "vgg-7x7-flatten", "encoder-fused-qkv", "encoder-mha",
                                  "residual-mlp-1-layer", "lstm-classifier", "gru-classifier", "grouped-conv-block",
                                  "shufflenet-units"])
def test_activation_matching_on_traced_structured_specs(case):
    """Activation matching with a structured spec recovers a planted permutation of every group it sees."""
    model, result = traced(case, structured=True)
    spec = result.spec
    gen = torch.Generator().manual_seed(3)
    planted = random_permutations(spec, gen)
    other = copy.deepcopy(model)
    other.load_state_dict(apply_permutation(spec, planted, model.state_dict()))
    with torch.random.fork_rng():
        torch.manual_seed(2)
        data = [example(case).repeat_interleave(8, 0) for _ in range(4)]
    found = activation_matching(model, other, spec, data)
    # nn.MultiheadAttention's heads are read from its inputs projected by in_proj_weight's rows.
    seen = list(spec.groups)
    assert all(found.sites[g] for g in seen)
    undo = Permutations(spec, planted).inverse()  # the permutation that undoes the planted one
    for g in seen:
        assert found.perms[g].equal(undo[g]), g


# --------------------------------------------------------------------------- the weight-matching stall


def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU6())  # fmt: skip


class InvertedResidualV2(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers = [conv_bn(cin, hidden, 1)] if expand != 1 else []
        layers += [conv_bn(hidden, hidden, 3, stride, hidden), nn.Conv2d(hidden, cout, 1, bias=False),
                   nn.BatchNorm2d(cout)]  # fmt: skip
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileNetV2(nn.Module):
    """torchvision's MobileNetV2 at half width, with its initialisation (BatchNorm weights 1, biases 0)."""

    def __init__(self, width: float = 0.5) -> None:
        super().__init__()
        c = int(32 * width)
        blocks: list[nn.Module] = [conv_bn(3, c, 3, 2)]
        for expand, cout, repeats, stride in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                                              (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):  # fmt: skip
            for i in range(repeats):
                blocks.append(InvertedResidualV2(c, int(cout * width), stride if i == 0 else 1, expand))
                c = int(cout * width)
        blocks.append(conv_bn(c, 320, 1))
        self.features = nn.Sequential(*blocks)
        self.classifier = head(nn.Linear(320, 10))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


def test_weight_matching_escapes_the_mobilenet_v2_stall():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MobileNetV2()
    spec = trace_model(model, torch.randn(1, 3, 32, 32)).spec
    assert permutable_share(model, spec) == 1.0
    sa = model.state_dict()
    gen = torch.Generator().manual_seed(1)
    sb = apply_permutation(spec, random_permutations(spec, gen), sa)
    target = matching_objective(spec, sa, sa)
    plain = weight_matching(spec, sa, sb, seed=0, init="identity")
    assert plain.objective[-1] < 0.9 * target  # Algorithm 1 from the identity stalls (the 87%)
    for init in ("signatures", "best"):  # "best" is the default
        found = weight_matching(spec, sa, sb, seed=0, init=init)
        assert found.objective[-1] == pytest.approx(target, rel=1e-6)
        aligned = apply_permutation(spec, found.perms, sb)
        assert all(torch.equal(aligned[k], v) for k, v in sa.items())


def test_best_start_never_ends_below_the_identity_start():
    """Two unrelated models: "best" keeps whichever start ends higher, so never below plain Algorithm 1."""
    for case in ("inverted-residual-se", "encoder-mha", "unet"):
        with torch.random.fork_rng():
            torch.manual_seed(5)
            a, b = CASES[case][0](), CASES[case][0]()
            spec = trace_model(a, example(case), composite="fix").spec
        plain = weight_matching(spec, a.state_dict(), b.state_dict(), seed=0, init="identity")
        best = weight_matching(spec, a.state_dict(), b.state_dict(), seed=0)
        assert best.objective[-1] >= plain.objective[-1]
    with pytest.raises(ValueError, match="init must be one of 'best', 'identity', 'signatures', got 'random'"):
        weight_matching(spec, a.state_dict(), b.state_dict(), init="random")


@pytest.mark.slow
def test_bench_trace_runs(capsys):
    import argparse

    from pyperm.benchmarks import trace

    import_torchvision()
    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    code = trace.run(parser.parse_args(["--models", "resnet18,squeezenet1_0", "--repeat", "1"]))
    out = capsys.readouterr().out
    assert code == 0, out
    # squeezenet's fire modules concatenate: 14% flat, 100% structured; both keep the function
    assert "squeezenet1_0" in out and "100.0%" in out and "NO" not in out and "FAILED" not in out
    assert trace.run(parser.parse_args(["--models", "resnet18,nope"])) == 2
    assert "unknown torchvision model 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # a non-positive --repeat is refused by the parser
        parser.parse_args(["--repeat", "0"])
    assert refused.value.code == 2 and "--repeat" in capsys.readouterr().err
