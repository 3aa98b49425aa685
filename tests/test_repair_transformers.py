"""repair (REPAIR) on Hugging Face transformers, traced by torch.export: GPT-2 (LayerNorm, Conv1D), ViT (LayerNorm,
Linear) and Llama (RMSNorm, a gated MLP without biases).

Small random float64 configurations of one block. A group that normalisation layers read (the residual stream) is
corrected at their outputs, the MLP's hidden units at their projections; the query, key and value units are left
as interpolated with one warning. At t = 0 every correction is the identity; at t = 0.5 every corrected unit's
mean and standard deviation, measured by hand with forward hooks, equal the interpolation of the endpoints'.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from _vision import import_transformers
from torch import nn

from pyperm.nn import repair
from pyperm.nn.models import single_output
from pyperm.nn.state import interpolate


transformers = import_transformers()

_GPT2 = {"vocab_size": 50, "n_positions": 16, "n_embd": 16, "n_layer": 1, "n_head": 2, "bos_token_id": 0,
         "eos_token_id": 0}
_VIT = {"image_size": 8, "patch_size": 2, "num_channels": 1, "hidden_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 32, "num_labels": 3}  # fmt: skip
_LLAMA = {"vocab_size": 50, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 16}  # fmt: skip

# name: (model class, config class, config, the modules taking a correction (with a bias?), the modules left)
CASES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", _GPT2,
             {"transformer.h.0.ln_1": True, "transformer.h.0.ln_2": True, "transformer.h.0.mlp.c_fc": True,
              "transformer.ln_f": True},
             ["transformer.h.0.attn.c_attn"]),
    "vit": ("ViTForImageClassification", "ViTConfig", _VIT,
            {"vit.layers.0.layernorm_before": True, "vit.layers.0.layernorm_after": True,
             "vit.layers.0.mlp.fc1": True, "vit.layernorm": True},
            ["vit.layers.0.attention.q_proj", "vit.layers.0.attention.k_proj", "vit.layers.0.attention.v_proj"]),
    "llama": ("LlamaForCausalLM", "LlamaConfig", _LLAMA,
              {"model.layers.0.input_layernorm": False, "model.layers.0.post_attention_layernorm": False,
               "model.layers.0.mlp.gate_proj": False, "model.layers.0.mlp.up_proj": False, "model.norm": False},
              ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
               "model.layers.0.self_attn.v_proj"]),
}  # fmt: skip
NAMES = sorted(CASES)


def _model(name: str, seed: int) -> nn.Module:
    model_cls, config_cls, kwargs, _, _ = CASES[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
        model = single_output(model).double().eval()
        with torch.no_grad():  # no zero biases, no unit norm weights: every unit's statistics its own
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p))
    return model


@functools.lru_cache(maxsize=None)
def _setting(name: str):
    """The model (A's weights), A's and B's states, and three batches."""
    model = _model(name, 0)
    sa, sb = model.state_dict(), _model(name, 1).state_dict()
    gen = torch.Generator().manual_seed(2)
    if name == "vit":
        data = [torch.randn(n, 1, 8, 8, generator=gen, dtype=torch.float64) for n in (5, 3, 4)]
    else:
        data = [torch.randint(0, 50, (n, 8), generator=gen) for n in (5, 3, 4)]
    return model, sa, sb, data


def _repair(name: str, t: float) -> tuple[dict, str]:
    """The repaired state and the one warning's message."""
    model, sa, sb, data = _setting(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = repair(model, None, sa, sb, data, t=t)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    return out, messages[0]


def _unit_stats(model: nn.Module, state: dict, paths, data) -> dict:
    """Per-unit mean and std (unbiased) of each module's output over every token of ``data`` (units last)."""
    probe = copy.deepcopy(model)
    probe.load_state_dict(state)
    seen = {p: [] for p in paths}
    hooks = [probe.get_submodule(p).register_forward_hook(lambda m, i, o, p=p: seen[p].append(o.detach()))
             for p in paths]  # fmt: skip
    with torch.no_grad():
        for x in data:
            probe(x)
    for h in hooks:
        h.remove()
    out = {}
    for p, chunks in seen.items():
        z = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks]).double()
        out[p] = (z.mean(0), z.std(0))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_at_an_endpoint_repair_gives_the_endpoint(name):
    _, sa, _, _ = _setting(name)
    out, _ = _repair(name, 0.0)
    for key, value in sa.items():
        torch.testing.assert_close(out[key], value, rtol=1e-9, atol=1e-12, msg=key)


@pytest.mark.parametrize("name", NAMES)
def test_corrected_units_match_their_targets(name):
    model, sa, sb, data = _setting(name)
    corrected, left = CASES[name][3], CASES[name][4]
    out, message = _repair(name, 0.5)
    plain = interpolate(sa, sb, 0.5)
    changed = {k.rpartition(".")[0] for k in sa if not torch.equal(out[k], plain[k])}
    assert changed == set(corrected)  # the embeddings, the residual writers and attention are the interpolation
    assert "query, key and value units" in message and all(repr(p) in message for p in left)

    paths = sorted(corrected)
    ends = [_unit_stats(model, s, paths, data) for s in (sa, sb)]
    got, before = _unit_stats(model, out, paths, data), _unit_stats(model, plain, paths, data)
    for p in paths:
        mean, std = (ends[0][p][i] / 2 + ends[1][p][i] / 2 for i in (0, 1))
        torch.testing.assert_close(got[p][1], std, rtol=1e-5, atol=0, msg=p)
        if corrected[p]:  # a module without a bias can have only its units' spread corrected
            assert torch.all((got[p][0] - mean).abs() <= 1e-5 * std), p
        assert not torch.allclose(before[p][1], std, rtol=1e-3), p  # not vacuous: the interpolation is off


@pytest.mark.parametrize("name", NAMES)
def test_attention_units_are_corrected_on_request(name):
    """``attention=True``: the query, key and value projections take a correction too, and their units reach the
    interpolation of the endpoints' statistics; nothing is left to warn about."""
    model, sa, sb, data = _setting(name)
    corrected, left = CASES[name][3], CASES[name][4]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = repair(model, None, sa, sb, data, attention=True)
    plain = interpolate(sa, sb, 0.5)
    changed = {k.rpartition(".")[0] for k in sa if not torch.equal(out[k], plain[k])}
    assert changed == set(corrected) | set(left)
    ends = [_unit_stats(model, s, left, data) for s in (sa, sb)]
    got = _unit_stats(model, out, left, data)
    for p in left:
        torch.testing.assert_close(got[p][1], ends[0][p][1] / 2 + ends[1][p][1] / 2, rtol=1e-5, atol=0, msg=p)
    with pytest.raises(TypeError, match="attention"):
        repair(model, None, sa, sb, data, attention="yes")
