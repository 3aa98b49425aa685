"""The multilayer perceptron of Git Re-Basin's MNIST experiments."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pyperm._checks import check_positive_int
from pyperm.nn.models._builder import _SpecBuilder
from pyperm.nn.spec import PermutationSpec


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
        widths = [check_positive_int(w, f"widths[{i}]") for i, w in enumerate(widths)]
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
