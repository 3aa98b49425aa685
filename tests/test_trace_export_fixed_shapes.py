"""trace_model(..., dynamic=False): torch.export with the example's shapes gives the spec of a dynamic export."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn import trace_model


class Conditioned(nn.Module):
    """Export-only (a branch on a shape) with a conditioning MLP whose input is made from the sample, as the
    ``--model hf`` forward of a diffusers UNet makes its timestep."""

    def __init__(self) -> None:
        super().__init__()
        self.embed1, self.embed2 = nn.Linear(4, 8), nn.Linear(8, 8)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 6:
            raise ValueError("six features")
        zero = x[:, :1] * 0
        condition = torch.cos(torch.arange(4, dtype=x.dtype)) + zero
        return self.fc2(F.relu(self.fc1(x)) + self.embed2(F.silu(self.embed1(condition))))


def test_fixed_shapes_give_the_dynamic_export_s_spec():
    model = Conditioned()
    x = torch.randn(3, 6)
    dynamic = trace_model(model, x)
    fixed = trace_model(model, x, dynamic=False)
    assert dynamic.frontend == fixed.frontend == "export"
    assert fixed.spec.axes == dynamic.spec.axes and fixed.spec.sizes == dynamic.spec.sizes
    assert fixed.spec.axes["embed2.weight"] == ("P_fc1", "P_embed1")  # the conditioning's units are hidden units
    torch.testing.assert_close(fixed.graph_module(x), model(x))
    other = torch.randn(5, 6)  # the dynamic graph runs other batch sizes
    torch.testing.assert_close(dynamic.graph_module(other), model(other))
