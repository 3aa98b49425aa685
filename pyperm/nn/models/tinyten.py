"""TinyTen (Kornblith et al. 2019), the small CNN of Tatro et al. 2020."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyperm._checks import check_positive_int
from pyperm.nn.models._builder import _SpecBuilder
from pyperm.nn.spec import PermutationSpec


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
        num_classes = check_positive_int(num_classes, "num_classes")
        width_multiplier = check_positive_int(width_multiplier, "width_multiplier")
        in_channels = check_positive_int(in_channels, "in_channels")
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
