"""ResNet20 for 32x32 images, with residual streams shared by the blocks of a stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyperm._checks import check_positive_int
from pyperm.nn.models._builder import _SpecBuilder
from pyperm.nn.spec import PermutationSpec


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

    BLOCKS = 3  # residual blocks per stage: depth 6 * BLOCKS + 2

    def __init__(
        self, width_multiplier: int = 1, num_classes: int = 10, shortcut: str = "B", in_channels: int = 3
    ) -> None:
        super().__init__()
        width_multiplier = check_positive_int(width_multiplier, "width_multiplier")
        num_classes = check_positive_int(num_classes, "num_classes")
        in_channels = check_positive_int(in_channels, "in_channels")
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
            for i in range(self.BLOCKS):
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


class ResNet32(ResNet20):
    """The CIFAR ResNet32 of He et al. (2016) that Tatro et al. align: :class:`ResNet20` with five
    blocks per stage instead of three (the same options, groups ``"stage{s}.block{0..4}"``).

    Examples
    --------
    >>> from pyperm.nn.models import ResNet32
    >>> sum(p.numel() for p in ResNet32(shortcut="A").parameters() if p.ndim > 1) > 460_000
    True
    """

    BLOCKS = 5


# ----------------------------------------------------------------------------------------
# TinyTen
# ----------------------------------------------------------------------------------------

# (out channels at width 1, kernel, stride, padding) of the eight convolutions.
