"""A model and a planted permutation of it plus noise: the pairs the tests of the starts share."""

from __future__ import annotations

import torch

from pyperm.nn import Permutations, apply_permutation, trace_model
from pyperm.testing import random_permutations


def planted_pair(model: torch.nn.Module, example: torch.Tensor, generator: torch.Generator, noise: float = 0.01):
    """``(spec, a, b, planted)``: B is A permuted by ``planted`` (drawn from ``generator``) plus ``noise`` times
    each tensor's standard deviation of normal noise, so not an exact copy (the default start runs its starts)."""
    spec = trace_model(model, example).spec
    a = model.state_dict()
    planted = Permutations(spec, random_permutations(spec, generator))
    b = apply_permutation(spec, planted, a)
    b = {k: t + noise * t.float().std() * torch.randn(t.shape, generator=generator)
         if t.is_floating_point() and t.numel() > 1 else t for k, t in b.items()}  # fmt: skip
    return spec, a, b, planted


def planted_mobilenet_v2(generator: torch.Generator):
    """MobileNetV2 (seed 0) and a planted copy of it plus 1% noise: the identity start stalls there."""
    from test_architectures import MobileNetV2

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MobileNetV2()
    return planted_pair(model, torch.randn(1, 3, 32, 32), generator)
