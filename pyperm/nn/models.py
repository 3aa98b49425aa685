"""Bundled reference models, each with its hand-written :class:`~pyperm.nn.PermutationSpec`.

The models are the ones the papers pyperm implements experiment with: MLPs (Git Re-Basin's
MNIST experiments), VGG11/VGG16 with BatchNorm and ResNet20 for 32x32 CIFAR images, and
TinyTen (Kornblith et al. 2019, used by Tatro et al. 2020). Every class exposes
``permutation_spec()``, whose keys are exactly the model's ``state_dict`` keys as torch
names them, BatchNorm ``running_mean``/``running_var`` included and
``num_batches_tracked`` left untouched (its axes tuple is empty). A model's inputs and
outputs are never permuted.

Group names say what each group permutes: ``"hidden2"`` is the second hidden layer of an
MLP, ``"conv3"`` the output channels of the third convolution (and of the BatchNorm after
it), ``"stage2"`` the residual stream shared by every block of a ResNet stage, and
``"stage2.block1"`` the inner channels of one residual block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.spec import PermutationSpec

__all__ = ["MLP", "VGG", "VGG11", "VGG16", "ResNet20", "TinyTen"]


class _SpecBuilder:
    """Collects the axes of a state dict layer by layer (why: keeps each spec readable)."""

    def __init__(self) -> None:
        self.axes: dict[str, tuple] = {}
        self.sizes: dict[str, int] = {}

    def group(self, name: str | None, size: int) -> str | None:
        if name is not None:
            if self.sizes.setdefault(name, size) != size:  # pragma: no cover - a bug in a spec below
                raise AssertionError(f"group {name!r} used with sizes {self.sizes[name]} and {size}")
        return name

    def linear(self, prefix: str, layer: nn.Linear, out_g: str | None, in_g: str | None) -> None:
        self.group(out_g, layer.out_features)
        self.group(in_g, layer.in_features)
        self.axes[f"{prefix}.weight"] = (out_g, in_g)
        if layer.bias is not None:
            self.axes[f"{prefix}.bias"] = (out_g,)

    def conv(self, prefix: str, layer: nn.Conv2d, out_g: str | None, in_g: str | None) -> None:
        self.group(out_g, layer.out_channels)
        self.group(in_g, layer.in_channels)
        self.axes[f"{prefix}.weight"] = (out_g, in_g) + (None,) * (layer.weight.ndim - 2)
        if layer.bias is not None:
            self.axes[f"{prefix}.bias"] = (out_g,)

    def norm(self, prefix: str, layer: nn.Module, g: str | None) -> None:
        for name, tensor in layer.state_dict().items():
            # num_batches_tracked is a 0-d counter: no axes, never permuted.
            self.axes[f"{prefix}.{name}"] = (g,) if tensor.ndim == 1 else (None,) * tensor.ndim
            if tensor.ndim == 1:
                self.group(g, tensor.shape[0])

    def spec(self) -> PermutationSpec:
        return PermutationSpec(axes=self.axes, sizes=self.sizes)


def _positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


# ----------------------------------------------------------------------------------------
# MLP
# ----------------------------------------------------------------------------------------


class MLP(nn.Module):
    """A multi-layer perceptron with ReLU between its Linear layers.

    Inputs are flattened from the second axis on, so MNIST images of shape (N, 1, 28, 28)
    can be passed directly.

    Parameters
    ----------
    widths : sequence of int
        ``[in_features, hidden_1, ..., hidden_k, out_features]``, at least two entries.
        ``MLP([784, 512, 512, 512, 10])`` is the MNIST MLP of Git Re-Basin.

    Notes
    -----
    Layer ``i`` is ``layers.{i}``; the spec has one group per hidden layer, ``"hidden1"``
    to ``"hidden{k}"``, acting on the rows of ``layers.{i-1}.weight`` and ``.bias`` and
    on the columns of ``layers.{i}.weight``.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.models import MLP
    >>> model = MLP([784, 512, 512, 10])
    >>> model(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
    >>> model.permutation_spec().sizes
    {'hidden1': 512, 'hidden2': 512}
    """

    def __init__(self, widths: Sequence[int]) -> None:
        super().__init__()
        widths = list(widths)
        if len(widths) < 2:
            raise ValueError(f"widths needs at least an input and an output size, got {widths}")
        for i, w in enumerate(widths):
            _positive_int(w, f"widths[{i}]")
        self.widths = tuple(widths)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.relu(x)
        return x

    def permutation_spec(self) -> PermutationSpec:
        """The hand-written spec: one group per hidden layer."""
        b = _SpecBuilder()
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            out_g = f"hidden{i + 1}" if i + 1 < n else None
            in_g = f"hidden{i}" if i > 0 else None
            b.linear(f"layers.{i}", layer, out_g, in_g)
        return b.spec()


# ----------------------------------------------------------------------------------------
# VGG
# ----------------------------------------------------------------------------------------

_VGG_CONFIGS: dict[str, tuple] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
}


class VGG(nn.Module):
    """VGG with BatchNorm for 32x32 inputs (CIFAR), as in Git Re-Basin's VGG experiments.

    ``features`` is an ``nn.Sequential`` of Conv2d(3x3, padding 1, bias) - BatchNorm2d -
    ReLU triples and 2x2 max pools; five pools take a 32x32 image to 1x1, so the
    ``classifier`` is one Linear layer on the ``8 * width`` features of the last
    convolution.

    Parameters
    ----------
    config : {"vgg11", "vgg16"}
        The layer configuration (Simonyan & Zisserman 2015, configurations A and D).
    num_classes : int, default 10
        Outputs of the classifier.
    width_multiplier : int, default 1
        Every convolution has ``width_multiplier`` times its standard channels.
    in_channels : int, default 3
        Input image channels.

    Notes
    -----
    The spec has one group per convolution, ``"conv1"``, ``"conv2"``, ..., acting on that
    convolution's output channels, its BatchNorm (weight, bias, running statistics) and the
    input channels of the next convolution (or of the classifier).
    """

    def __init__(
        self, config: str = "vgg16", num_classes: int = 10, width_multiplier: int = 1, in_channels: int = 3
    ) -> None:
        super().__init__()
        if config not in _VGG_CONFIGS:
            raise ValueError(f"config must be one of {sorted(_VGG_CONFIGS)}, got {config!r}")
        _positive_int(num_classes, "num_classes")
        _positive_int(width_multiplier, "width_multiplier")
        _positive_int(in_channels, "in_channels")
        self.config = config
        layers: list[nn.Module] = []
        c = in_channels
        for item in _VGG_CONFIGS[config]:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                out = int(item) * width_multiplier
                layers += [nn.Conv2d(c, out, kernel_size=3, padding=1), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
                c = out
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))

    def permutation_spec(self) -> PermutationSpec:
        """The hand-written spec: one group per convolution, ``conv1`` to ``conv{k}``."""
        b = _SpecBuilder()
        prev: str | None = None
        k = 0
        modules = list(self.features)
        for i, m in enumerate(modules):
            if isinstance(m, nn.Conv2d):
                k += 1
                g = f"conv{k}"
                b.conv(f"features.{i}", m, g, prev)
                b.norm(f"features.{i + 1}", modules[i + 1], g)
                prev = g
        b.linear("classifier", self.classifier, None, prev)
        return b.spec()


class VGG11(VGG):
    """VGG11 with BatchNorm for 32x32 inputs (8 convolutions); see :class:`VGG`."""

    def __init__(self, num_classes: int = 10, width_multiplier: int = 1, in_channels: int = 3) -> None:
        super().__init__("vgg11", num_classes, width_multiplier, in_channels)


class VGG16(VGG):
    """VGG16 with BatchNorm for 32x32 inputs (13 convolutions); see :class:`VGG`."""

    def __init__(self, num_classes: int = 10, width_multiplier: int = 1, in_channels: int = 3) -> None:
        super().__init__("vgg16", num_classes, width_multiplier, in_channels)


# ----------------------------------------------------------------------------------------
# ResNet20
# ----------------------------------------------------------------------------------------


class _PadShortcut(nn.Module):
    """He et al.'s option A shortcut: subsample by ``stride``, zero-pad the new channels.

    The ``pad`` extra channels are split evenly on both sides, so input channel ``c`` lands
    on output channel ``c + pad // 2``.
    """

    def __init__(self, stride: int, pad: int) -> None:
        super().__init__()
        self.stride = stride
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        lo = self.pad // 2
        return F.pad(x, (0, 0, 0, 0, lo, self.pad - lo))


class BasicBlock(nn.Module):
    """The two-convolution residual block of the CIFAR ResNets (He et al. 2016, section 4.2).

    ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``; the shortcut is the identity
    when shapes agree, otherwise option ``"A"`` (strided subsampling and zero channels, no
    parameters) or ``"B"`` (a strided 1x1 convolution and BatchNorm, ``shortcut.0`` and
    ``shortcut.1``).
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1, shortcut: str = "B") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.projects = stride != 1 or in_planes != planes
        if not self.projects:
            self.shortcut: nn.Module = nn.Identity()
        elif shortcut == "A":
            self.shortcut = _PadShortcut(stride, planes - in_planes)
        else:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """The CIFAR ResNet20 of He et al. (2016), with a width multiplier.

    A 3x3 stem convolution with BatchNorm and ReLU, three stages of three
    :class:`BasicBlock` each with ``16, 32, 64`` times ``width_multiplier`` channels (the
    first block of stages 2 and 3 has stride 2), global average pooling and a Linear
    classifier ``fc``. Convolutions have no bias (a BatchNorm follows each).

    Parameters
    ----------
    width_multiplier : int, default 1
        Channels of every layer times this (Git Re-Basin uses up to 32).
    num_classes : int, default 10
        Outputs of the classifier.
    shortcut : {"B", "A"}, default "B"
        How a block that changes the number of channels adds its input: ``"B"`` a strided
        1x1 convolution and BatchNorm (projection), ``"A"`` the parameter-free identity with
        strided subsampling and zero-padded extra channels (He et al.'s CIFAR choice).
    in_channels : int, default 3
        Input image channels.

    Notes
    -----
    Symmetry with option B (the spec's groups): a residual addition forces both summands
    to share one permutation, so the stem's output and the output of every block of stage
    1 form the group ``"stage1"``; ``"stage2"`` and ``"stage3"`` are the residual streams
    of the later stages (the projection shortcut's 1x1 convolution maps one stream to the
    next, so the streams are independent). Each block also has its own inner group
    ``"stage{s}.block{b}"`` (the output channels of ``conv1``/``bn1``).

    Symmetry with option A: the zero-padded shortcut places channel ``c`` of the stage-s
    stream on channel ``c + pad/2`` of the wider stage-(s+1) stream. A permutation
    ``P_{s+1}`` of the wider stream therefore preserves the function only if it maps the
    embedded channels onto themselves exactly as ``P_s`` permutes the narrower stream,
    while the ``pad`` zero-padded channels may be permuted among themselves: the true
    symmetry is a block structure ``P_{s+1} = P_s (+) Q_s``, which chains through every
    stage. A :class:`PermutationSpec` gives each tensor axis one whole-axis group, so it
    cannot express that coupling; the hand-written spec of option A therefore keeps every
    residual stream fixed (``None``) and permutes only the nine inner groups
    ``"stage{s}.block{b}"``. This is a correct subgroup of the true symmetry, not all of
    it; use option B when matching should also align the residual streams.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.models import ResNet20
    >>> model = ResNet20(width_multiplier=2)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    >>> sorted(model.permutation_spec().sizes)[:4]
    ['stage1', 'stage1.block0', 'stage1.block1', 'stage1.block2']
    """

    def __init__(
        self, width_multiplier: int = 1, num_classes: int = 10, shortcut: str = "B", in_channels: int = 3
    ) -> None:
        super().__init__()
        _positive_int(width_multiplier, "width_multiplier")
        _positive_int(num_classes, "num_classes")
        _positive_int(in_channels, "in_channels")
        if shortcut not in ("A", "B"):
            raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}")
        self.width_multiplier = width_multiplier
        self.shortcut = shortcut
        widths = [16 * width_multiplier, 32 * width_multiplier, 64 * width_multiplier]
        self.conv1 = nn.Conv2d(in_channels, widths[0], kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        in_planes = widths[0]
        stages = []
        for s, planes in enumerate(widths):
            blocks = []
            for i in range(3):
                stride = 2 if (s > 0 and i == 0) else 1
                blocks.append(BasicBlock(in_planes, planes, stride, shortcut))
                in_planes = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(widths[2], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean(dim=(2, 3)))

    def permutation_spec(self) -> PermutationSpec:
        """The hand-written spec; see the class notes for the groups of each shortcut option."""
        b = _SpecBuilder()
        free_streams = self.shortcut == "B"
        stream: str | None = "stage1" if free_streams else None
        b.conv("conv1", self.conv1, stream, None)
        b.norm("bn1", self.bn1, stream)
        for s, layer in enumerate((self.layer1, self.layer2, self.layer3), start=1):
            out_stream = f"stage{s}" if free_streams else None
            for i, block in enumerate(layer):
                p = f"layer{s}.{i}"
                inner = f"stage{s}.block{i}"
                b.conv(f"{p}.conv1", block.conv1, inner, stream)
                b.norm(f"{p}.bn1", block.bn1, inner)
                b.conv(f"{p}.conv2", block.conv2, out_stream, inner)
                b.norm(f"{p}.bn2", block.bn2, out_stream)
                if block.projects and isinstance(block.shortcut, nn.Sequential):
                    b.conv(f"{p}.shortcut.0", block.shortcut[0], out_stream, stream)
                    b.norm(f"{p}.shortcut.1", block.shortcut[1], out_stream)
                stream = out_stream
        b.linear("fc", self.fc, None, stream)
        return b.spec()


# ----------------------------------------------------------------------------------------
# TinyTen
# ----------------------------------------------------------------------------------------

# (out channels at width 1, kernel, stride, padding) of the eight convolutions.
_TINYTEN_LAYERS = (
    (16, 3, 1, 1),
    (16, 3, 1, 1),
    (32, 3, 2, 1),
    (32, 3, 1, 1),
    (32, 3, 1, 1),
    (64, 3, 2, 1),
    (64, 3, 1, 0),
    (64, 1, 1, 0),
)


class ConvBNReLU(nn.Module):
    """Conv2d - BatchNorm2d - ReLU, the unit TinyTen is built from (``conv``, ``bn``)."""

    def __init__(self, in_planes: int, planes: int, kernel: int, stride: int, padding: int, bias: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_planes, planes, kernel, stride=stride, padding=padding, bias=bias)
        self.bn = nn.BatchNorm2d(planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class TinyTen(nn.Module):
    """TinyTen (Tiny-10), the narrow all-convolutional network of Kornblith et al. (2019).

    Eight Conv-BN-ReLU units, ``16, 16, 32/s2, 32, 32, 64/s2, 64 (3x3, no padding), 64
    (1x1)`` channels, then global average pooling and a Linear classifier ``dense``: ten
    layers counting the pooling and the classifier, about 0.09M parameters at width 1, as
    used by Tatro et al. (2020) for CIFAR-10/100 and Tiny ImageNet.

    Parameters
    ----------
    num_classes : int, default 10
        Outputs of the classifier.
    width_multiplier : int, default 1
        Channels of every convolution times this.
    bias : bool, default True
        Whether the convolutions have a bias (Tatro et al.'s code keeps it).
    in_channels : int, default 3
        Input image channels.

    Notes
    -----
    The spec has one group per convolution, ``"conv1"`` to ``"conv8"``, acting on its
    output channels, its BatchNorm and the next layer's input channels.
    """

    def __init__(
        self, num_classes: int = 10, width_multiplier: int = 1, bias: bool = True, in_channels: int = 3
    ) -> None:
        super().__init__()
        _positive_int(num_classes, "num_classes")
        _positive_int(width_multiplier, "width_multiplier")
        _positive_int(in_channels, "in_channels")
        c = in_channels
        layers = []
        for out, kernel, stride, padding in _TINYTEN_LAYERS:
            out *= width_multiplier
            layers.append(ConvBNReLU(c, out, kernel, stride, padding, bool(bias)))
            c = out
        self.layers = nn.ModuleList(layers)
        self.dense = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.dense(x.mean(dim=(2, 3)))

    def permutation_spec(self) -> PermutationSpec:
        """The hand-written spec: ``conv1`` to ``conv8``."""
        b = _SpecBuilder()
        prev: str | None = None
        for i, layer in enumerate(self.layers):
            g = f"conv{i + 1}"
            b.conv(f"layers.{i}.conv", layer.conv, g, prev)
            b.norm(f"layers.{i}.bn", layer.bn, g)
            prev = g
        b.linear("dense", self.dense, None, prev)
        return b.spec()
