"""diffusers models traced with their GroupNorms as structures (tiny random configurations, no download).

An SD-1.x-style UNet2DConditionModel (cross-attention, GEGLU feed-forward, time embedding, down/up sampling,
skip concatenations), an SDXL-style one (added text/time conditioning, linear projections) and an AutoencoderKL:
every hidden unit sits on a permuted axis, no TraceWarning, the function is kept under a random permutation of
every group (float64: to rounding), and weight matching finds a planted permutation back.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from pyperm.nn import Permutations, trace_model, weight_matching
from pyperm.nn.spec import Blocks
from pyperm.testing import random_permutations

pytest.importorskip("diffusers")

from _diffusion import moved_share, tiny_unet, tiny_vae  # noqa: E402

MODELS = ["sd", "sdxl", "vae"]
OUTPUTS = {"sd": ("conv_out",), "sdxl": ("conv_out",), "vae": ("decoder.conv_out",)}


def _build(name: str, seed: int = 0):
    return tiny_vae(seed) if name == "vae" else tiny_unet(name, seed)


@functools.cache
def _traced(name: str):
    model, inputs = _build(name)
    return model, inputs, trace_model(model, inputs)  # filterwarnings=error: a TraceWarning fails the test


def _output(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs, return_dict=False)[0]


@pytest.mark.parametrize("name", MODELS)
def test_every_hidden_unit_of_a_diffusers_model_is_permuted(name):
    model, _, result = _traced(name)
    assert result.composites == ()
    assert moved_share(model, result.spec, OUTPUTS[name]) >= 0.9
    blocks = [e for axes in result.spec.axes.values() for e in axes if isinstance(e, Blocks)]
    assert blocks  # the GroupNorms' channel groups move as wholes somewhere


@pytest.mark.parametrize("name", MODELS)
def test_a_permuted_diffusers_model_computes_the_same_function(name):
    model, inputs, result = _traced(name)
    model = copy.deepcopy(model).double()
    doubled = tuple(x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    if name == "sdxl":
        doubled = doubled[:-1] + ({k: v.double() for k, v in inputs[-1].items()},)
    other, _ = _build(name, seed=1)
    other = other.double()
    other.load_state_dict(Permutations(result.spec, random_permutations(result.spec, 1)).apply(model.state_dict()))
    want = _output(model, doubled)
    torch.testing.assert_close(_output(other, doubled), want, rtol=0, atol=1e-10 * want.abs().max().item())


@pytest.mark.parametrize("name", MODELS)
def test_weight_matching_finds_a_planted_permutation_of_a_diffusers_model(name):
    model, _, result = _traced(name)
    spec = result.spec
    sa = {k: v.double() for k, v in model.state_dict().items()}
    plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(2)))
    assert weight_matching(spec, sa, plant.apply(sa)).perms == plant.inverse()
