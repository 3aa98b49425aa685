"""VGG11 and VGG16 with BatchNorm for 32x32 images."""

from __future__ import annotations

import torch
from torch import nn

from pyperm._checks import check_positive_int
from pyperm.nn.models._builder import _SpecBuilder
from pyperm.nn.spec import PermutationSpec


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
        num_classes = check_positive_int(num_classes, "num_classes")
        width_multiplier = check_positive_int(width_multiplier, "width_multiplier")
        in_channels = check_positive_int(in_channels, "in_channels")
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
