"""The bundled models: shapes, hand-written specs, function-preserving permutations, the registry by name."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from pyperm.nn import PermutationSpec, apply_permutation
from pyperm.nn.models import (
    MLP,
    VGG,
    VGG11,
    VGG16,
    ResNet20,
    ResNet32,
    TinyTen,
    create_model,
    input_shape,
    model_names,
    parse_model_name,
)
from pyperm.testing import random_permutations


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Non-trivial BatchNorm affine parameters and running statistics (defaults are 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(1 + torch.rand(m.running_var.shape, generator=g))
                m.num_batches_tracked.fill_(7)
    return model


def _make(factory, seed: int) -> nn.Module:
    """Builds a model with seeded initialisation without touching the global RNG state."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory()


# (factory, input shape); small widths keep the whole file fast.
CASES = {
    "mlp-1hidden": (lambda: MLP([12, 7, 3]), (5, 12)),
    "mlp-3hidden": (lambda: MLP([1 * 6 * 6, 16, 9, 20, 4]), (5, 1, 6, 6)),
    "mlp-nohidden": (lambda: MLP([8, 3]), (5, 8)),
    "vgg11": (lambda: VGG11(), (2, 3, 32, 32)),
    "vgg16": (lambda: VGG16(num_classes=7), (2, 3, 32, 32)),
    "resnet20-B-w1": (lambda: ResNet20(), (3, 3, 32, 32)),
    "resnet20-B-w2": (lambda: ResNet20(width_multiplier=2, num_classes=5), (2, 3, 16, 16)),
    "resnet20-A-w1": (lambda: ResNet20(shortcut="A"), (3, 3, 32, 32)),
    "resnet20-A-w3": (lambda: ResNet20(width_multiplier=3, shortcut="A"), (2, 3, 16, 16)),
    "resnet32-B-w1": (lambda: ResNet32(num_classes=5), (2, 3, 16, 16)),
    "tinyten": (lambda: TinyTen(), (3, 3, 32, 32)),
    "tinyten-w2-nobias": (lambda: TinyTen(num_classes=100, width_multiplier=2, bias=False), (2, 3, 32, 32)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_spec_covers_state_dict(case):
    factory, _ = CASES[case]
    model = factory()
    spec = model.permutation_spec()
    sd = model.state_dict()
    assert list(spec.axes) == list(sd), "spec keys must be the state_dict keys, in torch's order"
    spec.check_state_dict(sd)
    for key, groups in spec.axes.items():
        if key.endswith("num_batches_tracked"):
            assert groups == ()
    # inputs and outputs are never permuted: the first layer's input axis and the last
    # layer's output axis carry no group
    keys = list(sd)
    first_w = next(k for k in keys if k.endswith("weight") and sd[k].ndim >= 2)
    last_w = [k for k in keys if k.endswith("weight") and sd[k].ndim >= 2][-1]
    assert spec.axes[first_w][1] is None
    assert spec.axes[last_w][0] is None
    assert spec.axes[keys[-1]] == (None,)  # the classifier bias


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_permutation_preserves_function(case, mode):
    factory, shape = CASES[case]
    # float64: in train mode a deep BatchNorm net amplifies float32 reordering noise past
    # any tolerance tight enough to catch a wrong permutation (VGG16: 1.8e-5 on outputs of 0.05)
    model = _randomize(_make(factory, 0), seed=1).double()
    spec = model.permutation_spec()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    permuted = copy.deepcopy(model)
    perms = random_permutations(spec, 3)
    new_sd = apply_permutation(spec, perms, model.state_dict())
    permuted.load_state_dict(new_sd)
    # a permutation that is not the identity actually changed the weights
    if spec.sizes:
        assert any(not torch.equal(new_sd[k], v) for k, v in model.state_dict().items())
    getattr(model, mode)()
    getattr(permuted, mode)()
    with torch.no_grad():
        y_a = model(x)
        y_b = permuted(x)
    torch.testing.assert_close(y_b, y_a, atol=1e-5, rtol=1e-4)
    if mode == "train":
        # BatchNorm running statistics are updated identically up to the permutation
        after = apply_permutation(spec, perms, model.state_dict())
        for key, value in permuted.state_dict().items():
            torch.testing.assert_close(value, after[key], atol=1e-5, rtol=1e-4)


def test_mlp_spec_exact():
    model = MLP([4, 3, 2, 5])
    spec = model.permutation_spec()
    assert spec.axes == {
        "layers.0.weight": ("hidden1", None),
        "layers.0.bias": ("hidden1",),
        "layers.1.weight": ("hidden2", "hidden1"),
        "layers.1.bias": ("hidden2",),
        "layers.2.weight": (None, "hidden2"),
        "layers.2.bias": (None,),
    }
    assert spec.sizes == {"hidden1": 3, "hidden2": 2}


def test_vgg_groups():
    assert len(VGG11().permutation_spec().sizes) == 8
    spec = VGG16().permutation_spec()
    assert list(spec.sizes) == [f"conv{i}" for i in range(1, 14)]
    assert spec.sizes["conv1"] == 64 and spec.sizes["conv13"] == 512
    assert spec.axes["features.1.running_var"] == ("conv1",)
    assert spec.axes["features.3.weight"] == ("conv2", "conv1", None, None)
    assert spec.axes["classifier.weight"] == (None, "conv13")
    assert VGG16(width_multiplier=2).permutation_spec().sizes["conv13"] == 1024


def test_resnet20_option_b_groups():
    model = ResNet20(width_multiplier=4)
    spec = model.permutation_spec()
    streams = {"stage1": 64, "stage2": 128, "stage3": 256}
    inner = {f"stage{s}.block{b}": w for s, w in zip((1, 2, 3), (64, 128, 256)) for b in range(3)}
    assert dict(spec.sizes) == {**streams, **inner}
    # residual-stream groups are shared by the stem, every block of a stage and the shortcut
    assert spec.axes["conv1.weight"] == ("stage1", None, None, None)
    assert spec.axes["layer1.2.conv2.weight"] == ("stage1", "stage1.block2", None, None)
    assert spec.axes["layer2.0.conv1.weight"] == ("stage2.block0", "stage1", None, None)
    assert spec.axes["layer2.0.shortcut.0.weight"] == ("stage2", "stage1", None, None)
    assert spec.axes["layer2.0.shortcut.1.running_mean"] == ("stage2",)
    assert spec.axes["layer3.2.bn2.bias"] == ("stage3",)
    assert spec.axes["fc.weight"] == (None, "stage3")
    assert "layer1.0.shortcut.0.weight" not in spec.axes  # identity shortcut in stage 1
    n_params = sum(p.numel() for p in ResNet20().parameters())
    assert 270_000 < n_params < 280_000  # ResNet20 + two projection shortcuts (~0.27M)


def test_resnet20_option_a_fixes_streams():
    model = ResNet20(shortcut="A")
    spec = model.permutation_spec()
    assert set(spec.sizes) == {f"stage{s}.block{b}" for s in (1, 2, 3) for b in range(3)}
    assert spec.axes["conv1.weight"] == (None, None, None, None)
    assert spec.axes["layer2.0.conv2.weight"] == (None, "stage2.block0", None, None)
    assert not any("shortcut" in k for k in model.state_dict())
    n_params = sum(p.numel() for p in model.parameters())
    assert 269_000 < n_params < 271_000  # the 0.27M of He et al.'s Table 6


def test_resnet20_option_a_stream_permutation_breaks_function():
    """Documents why option A fixes the streams: permuting a stream alone changes the output."""
    model = _randomize(_make(lambda: ResNet20(shortcut="A"), 0), seed=1).eval()
    # treat the stage-1 stream as if it were a free group, as option B's spec does
    ref = ResNet20(shortcut="B")
    b_spec = ref.permutation_spec()
    axes = {k: v for k, v in b_spec.axes.items() if k in model.state_dict()}
    axes = {k: tuple(g if g in ("stage1",) else None for g in v) for k, v in axes.items()}
    spec = PermutationSpec(axes, {"stage1": 16})
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(4))
    permuted = copy.deepcopy(model)
    permuted.load_state_dict(apply_permutation(spec, {"stage1": perm}, model.state_dict()))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert not torch.allclose(model(x), permuted(x), atol=1e-3)


def test_tinyten_shape_and_size():
    model = TinyTen()
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 10)
    n_params = sum(p.numel() for p in model.parameters())
    assert 80_000 < n_params < 100_000  # "0.09M" in Tatro et al. Table 1
    spec = model.permutation_spec()
    assert list(spec.sizes.values()) == [16, 16, 32, 32, 32, 64, 64, 64]
    assert spec.axes["layers.7.conv.weight"] == ("conv8", "conv7", None, None)
    assert spec.axes["dense.weight"] == (None, "conv8")


def test_output_shapes():
    assert MLP([784, 512, 512, 512, 10])(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert VGG16(num_classes=100)(torch.zeros(2, 3, 32, 32)).shape == (2, 100)
    assert ResNet20(width_multiplier=2, num_classes=100)(torch.zeros(2, 3, 32, 32)).shape == (2, 100)


@pytest.mark.parametrize(
    "factory, exc, match",
    [
        (lambda: MLP([5]), ValueError, "at least an input and an output"),
        (lambda: MLP([5, 0, 2]), ValueError, r"widths\[1\] must be at least 1"),
        (lambda: MLP([5, 2.5, 2]), TypeError, r"widths\[1\] must be a positive int"),
        (lambda: VGG("vgg19"), ValueError, "config must be one of"),
        (lambda: VGG16(width_multiplier=0), ValueError, "width_multiplier must be at least 1"),
        (lambda: ResNet20(shortcut="C"), ValueError, "shortcut must be 'A' or 'B'"),
        (lambda: ResNet20(width_multiplier=True), TypeError, "width_multiplier must be a positive int"),
        (lambda: TinyTen(num_classes=-1), ValueError, "num_classes must be at least 1"),
    ],
)
def test_constructor_errors(factory, exc, match):
    with pytest.raises(exc, match=match):
        factory()


def test_numpy_integers_are_ints():
    """Sizes go through pyperm._checks: numpy integers are accepted and stored as Python ints."""
    model = ResNet20(width_multiplier=np.int64(2), num_classes=np.int32(5))
    assert type(model.width_multiplier) is int and model.fc.out_features == 5
    assert MLP([np.int64(4), 3, 2]).widths == (4, 3, 2)


# ------------------------------------------------------------------------------ the registry


@pytest.mark.parametrize(
    "name, cls, check",
    [
        ("mlp:784,512,512,10", MLP, lambda m: m.widths == (784, 512, 512, 10)),
        ("MLP: 12, 7 ,3", MLP, lambda m: m.widths == (12, 7, 3)),
        ("resnet20", ResNet20, lambda m: m.width_multiplier == 1),
        ("resnet20:4", ResNet20, lambda m: m.width_multiplier == 4),
        ("resnet20:2,in_channels=1,num_classes=7", ResNet20, lambda m: m.conv1.in_channels == 1 and m.fc.out_features == 7),
        ("resnet20:width_multiplier=3", ResNet20, lambda m: m.width_multiplier == 3),
        ("resnet32:2,num_classes=100", ResNet32, lambda m: len(m.layer1) == 5 and m.fc.out_features == 100),
        ("vgg11", VGG11, lambda m: m.config == "vgg11"),
        ("vgg16:2,num_classes=100", VGG16, lambda m: m.classifier.out_features == 100),
        ("tinyten:2,bias=0", TinyTen, lambda m: m.layers[0].conv.bias is None and m.layers[0].conv.out_channels == 32),
    ],
)
def test_create_model(name, cls, check):
    model = create_model(name)
    assert type(model) is cls and check(model)
    spec = model.permutation_spec()
    assert list(spec.axes) == list(model.state_dict())
    with torch.no_grad():
        assert model(torch.zeros(input_shape(name))).shape[0] == 2


def test_model_names():
    from pyperm.nn.models import _registry

    # The bundled ones (a guide example run in the same process may have registered its own: register_model).
    bundled = [n for n in model_names() if _registry._ARCHITECTURES[n].factory.__module__.startswith("pyperm.")]
    assert bundled == ["mlp", "resnet20", "resnet32", "tinyten", "vgg11", "vgg16"]
    for arch in model_names():
        assert parse_model_name(arch if arch != "mlp" else "mlp:4,2")[0] == arch


@pytest.mark.parametrize(
    "name, match",
    [
        ("mlp:64,,10", r"'mlp:64,,10': option 2 is empty"),  # not an MLP with a hidden layer fewer
        ("mlp:64,10,", "option 3 is empty"),
        ("mlp:", "option 1 is empty"),
        ("mlp", "at least an input and an output width"),
        ("mlp:64", "at least an input and an output width"),
        ("mlp:64,0,10", r"'0' must be positive"),
        ("mlp:64,x,10", r"'x' is not an integer or key=integer"),
        ("mlp:64,10,bias=1", "mlp does not take 'bias'"),
        ("resnet20:x", r"'resnet20:x': 'x' is not an integer or key=integer"),
        ("resnet20:4,5", "takes one positional option"),
        ("resnet20:in_channels=1,4", "positional option '4' after a key=value option"),
        ("resnet20:4,width_multiplier=2", "width_multiplier given twice"),
        ("resnet20:4,depth=3", "resnet20 does not take 'depth'"),
        ("resnet56", "unknown architecture 'resnet56'; expected mlp:IN,HIDDEN"),
        ("", "unknown architecture ''"),
    ],
)
def test_malformed_model_names_are_refused(name, match):
    with pytest.raises(ValueError, match=match):
        parse_model_name(name)
    with pytest.raises(ValueError, match=match):
        create_model(name)


def test_out_of_range_options_name_the_model():
    with pytest.raises(ValueError, match=r"model 'vgg16:num_classes=0': num_classes must be at least 1"):
        create_model("vgg16:num_classes=0")
    with pytest.raises(TypeError, match="model name must be a str"):
        create_model(16)


def test_single_output_gives_a_model_a_one_tensor_forward():
    import torch

    from pyperm.nn.models import single_output

    class Outputs(torch.nn.Module):  # a forward returning an object with .logits, as transformers models do
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return type("Out", (), {"logits": self.lin(x), "last_hidden_state": x})()

    model = Outputs()
    keys = list(model.state_dict())
    x = torch.randn(4, 3)
    assert single_output(model) is model and torch.equal(model(x), model.lin(x))
    cls = type(model)
    assert single_output(model) is model and type(model) is cls  # not wrapped twice
    assert list(model.state_dict()) == keys
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        single_output(object())
