"""The hand-written spec builder shared by the bundled models."""

from __future__ import annotations

from torch import nn

from pyperm.nn.spec import PermutationSpec


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
