"""Hugging Face transformers through the torch.export front end: exact specs, planted permutations found back.

Small random configurations (2 layers, width 32) of GPT-2, BERT (masked LM: BertModel returns its residual
stream, which a model's outputs never permute), Llama with grouped-query attention (4 query heads, 2
key/value heads), Mistral, Qwen2, Phi (partial rotary embeddings) and ViT. torch.fx cannot trace them
(Python control flow), so the tracer exports them; the spec must keep the function of the float64 model
under a random permutation of every group, weight matching must find a planted permutation back, every
hidden unit must sit on a permuted axis, and the groups must be the architecture's: the residual stream one
group through every block (norms, embeddings and the tied output head included), the MLP's intermediate
units (SwiGLU's gate and up projections sharing theirs), the heads and the units within them.
"""

from __future__ import annotations

import functools
import re
import time
import warnings

import pytest
import torch
from _vision import import_transformers
from torch import nn

from pyperm.nn import (
    Permutations,
    PermutationSpec,
    activation_matching,
    apply_permutation,
    trace_model,
    weight_matching,
)
from pyperm.nn.spec import Segments, Tiled
from pyperm.testing import random_permutations


transformers = import_transformers()


class Logits(nn.Module):
    """The model's logits (or last hidden state) alone: outputs are never permuted, so a model that also
    returned its key/value cache would fix the units of its keys and values."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.m(x)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


_TEXT = {"vocab_size": 50, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
_DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 16, **_TEXT}  # fmt: skip
CONFIGS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 16, **_TEXT}),
    "bert": ("BertForMaskedLM", "BertConfig", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                         "num_attention_heads": 4, "max_position_embeddings": 16, **_TEXT}),
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DECODER),
    "mistral": ("MistralForCausalLM", "MistralConfig", _DECODER),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _DECODER),
    "phi": ("PhiForCausalLM", "PhiConfig", {**_DECODER, "num_key_value_heads": 4, "partial_rotary_factor": 0.5}),
    "vit": ("ViTForImageClassification", "ViTConfig", {"hidden_size": 32, "intermediate_size": 64,
                                                       "num_hidden_layers": 2, "num_attention_heads": 4,
                                                       "image_size": 16, "patch_size": 4, "num_labels": 3}),
}  # fmt: skip
# Llama, Mistral and Qwen2 compute their RMSNorm in float32 whatever the model's dtype: a permuted
# residual stream sums its squares in another order, which float32 rounds differently.
TOLERANCE = {"llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6}
NAMES = sorted(CONFIGS)


def _model(name: str, seed: int) -> nn.Module:
    model_cls, config_cls, kwargs = CONFIGS[name]
    config = getattr(transformers, config_cls)(**kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Logits(getattr(transformers, model_cls)(config)).double().eval()
        with torch.no_grad():  # no zero biases, no unit norm weights: a parameter left out of the spec shows
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model


def _inputs(name: str, seed: int = 0, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if name == "vit":
        return torch.randn(batch, 3, 16, 16, generator=gen, dtype=torch.float64)
    return torch.randint(1, 50, (batch, 8), generator=gen)


@functools.lru_cache(maxsize=None)
def _traced(name: str):
    """The model, its trace, and the seconds the trace took (each model is traced once per session)."""
    model = _model(name, 0)
    start = time.perf_counter()
    result = trace_model(model, _inputs(name), composite="fix")
    return model, result, time.perf_counter() - start


def _produced(model: nn.Module) -> list[tuple[str, int]]:
    """(state_dict key, axis) of every layer's produced units, the output heads (the logits) excepted."""
    produced = []
    for path, m in model.named_modules():
        if path.endswith(("lm_head", "classifier", "decoder")):
            continue
        if isinstance(m, nn.Linear):
            produced.append((f"{path}.weight", 0))
        elif isinstance(m, nn.Embedding) or type(m).__name__ == "Conv1D":  # Conv1D: weight (in, out)
            produced.append((f"{path}.weight", 1))
        elif isinstance(m, nn.Conv2d):
            produced.append((f"{path}.weight", 0))
    return produced


def _share(model: nn.Module, spec) -> float:
    sd = model.state_dict()
    produced = _produced(model)
    total = sum(sd[k].shape[a] for k, a in produced)
    return sum(sd[k].shape[a] for k, a in produced if spec.axes[k][a] is not None) / total


@pytest.mark.parametrize("name", NAMES)
def test_hugging_face_models_are_exported_and_keep_their_function(name):
    model, result, seconds = _traced(name)
    assert result.frontend == "export" and seconds < 30
    spec = result.spec
    other = _model(name, 0)
    other.load_state_dict(apply_permutation(spec, random_permutations(spec, 1), model.state_dict()))
    x = _inputs(name, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=TOLERANCE.get(name, 1e-12), atol=TOLERANCE.get(name, 1e-12))


@pytest.mark.parametrize("name", NAMES)
def test_every_hidden_unit_sits_on_a_permuted_axis(name):
    model, result, _ = _traced(name)
    assert _share(model, result.spec) == 1.0


@pytest.mark.parametrize("name", [n for n in NAMES if n != "phi"])  # Phi's parallel blocks: one norm each
def test_the_residual_stream_is_one_group_through_every_block(name):
    """Every norm's weight, every embedding's features and every layer writing into the stream carry one group."""
    model, result, _ = _traced(name)
    axes = result.spec.axes
    norms = [k for k in axes if re.search(r"(norm[a-z_]*|ln_\d|ln_f|LayerNorm)\.weight$", k)]
    assert len(norms) >= 5, norms
    (group,) = {axes[k][0] for k in norms}
    assert group is not None
    pattern = r"(wte|wpe|embed_tokens|_embeddings|cls_token)(\.weight)?$"  # ViT's are parameters of their own
    embeddings = [k for k in axes if re.search(pattern, k)]
    assert embeddings and all(axes[k][-1] == group for k in embeddings), {k: axes[k] for k in embeddings}
    writers = [k for k in axes if re.search(r"(o_proj|down_proj|c_proj|output\.dense|fc2)\.weight$", k)]
    assert len(writers) == 4
    for k in writers:
        out_axis = 1 if "c_proj" in k else 0  # GPT-2's Conv1D stores (in, out)
        assert axes[k][out_axis] == group, k


def test_from_model_falls_back_to_torch_export_without_a_warning():
    """GPT-2 leaves nothing unpermuted, so the default composite policy has nothing to warn about."""
    model, result, _ = _traced("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = PermutationSpec.from_model(model, _inputs("gpt2"))
    assert spec.axes == result.spec.axes and spec.sizes == result.spec.sizes


def test_tied_embedding_and_output_head_share_one_group():
    model, result, _ = _traced("gpt2")
    axes = result.spec.axes
    assert axes["m.transformer.wte.weight"] == axes["m.lm_head.weight"] == (None, axes["m.transformer.ln_f.weight"][0])


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_grouped_query_attention_moves_key_value_heads_with_their_query_heads(name):
    """A key/value head moves its block of 2 query heads (q carries the kv group as the outer group of a Tiled
    form), the query heads move within their block (alike in every block); the query and key head dims stay
    (the rotary embedding turns every pair at its own frequency). The value head dims move by one group
    (v's rows ``Tiled(dims, outer=kv)``), read by every query head alike: o's columns are copies of the query
    heads' value dims, ``Tiled(Tiled(dims, outer=query_heads), outer=kv)``; nothing is left fixed. SwiGLU's
    gate and up projections share the intermediate group."""
    model, result, _ = _traced(name)
    spec, axes = result.spec, result.spec.axes
    for layer in (0, 1):
        p = f"m.model.layers.{layer}."
        k_rows, v_rows, q_rows = (axes[f"{p}self_attn.{w}_proj.weight"][0] for w in "kvq")
        assert isinstance(k_rows, Tiled) and k_rows.inner == 8
        kv = k_rows.group
        assert spec.sizes[kv] == 2
        assert isinstance(q_rows, Tiled) and q_rows.outer == kv and q_rows.inner == 8 and spec.sizes[q_rows.group] == 2
        assert v_rows == Tiled(v_rows.group, kv) and spec.sizes[v_rows.group] == 8
        assert axes[f"{p}self_attn.o_proj.weight"][1] == Tiled(Tiled(v_rows.group, q_rows.group), kv)
        gate, up, down = (axes[f"{p}mlp.{w}_proj.weight"] for w in ("gate", "up", "down"))
        assert gate[0] == up[0] == down[1] and spec.sizes[gate[0]] == 64
    assert result.composites == ()


def test_partial_rotary_heads_move_with_their_pass_through_dims():
    """Phi turns the first half of every query/key head's dims (rotary, in place) and passes the rest: q's and
    k's rows are ``Tiled(Segments(rotary, dims), outer=heads)``, the heads moved by the group that moves v's
    and the output projection's heads; nothing is left fixed."""
    model, result, _ = _traced("phi")
    spec, axes = result.spec, result.spec.axes
    for layer in (0, 1):
        p = f"m.model.layers.{layer}.self_attn."
        q, k, v = (axes[f"{p}{w}_proj.weight"][0] for w in "qkv")
        assert q == k and isinstance(q, Tiled) and isinstance(q.group, Segments) and q.group.parts[0] == 4
        assert q.outer == v.outer and spec.sizes[q.outer] == 4 and spec.sizes[q.group.parts[1]] == 4
        assert axes[f"{p}dense.weight"][1] == v == Tiled(v.group, q.outer)
    assert result.composites == ()


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])
def test_multi_head_attention_permutes_heads_and_head_dims(name):
    """Heads move as blocks in q, k, v and the output projection; query/key head dims share one group,
    value head dims another (one permutation shared by every head); nothing is left fixed."""
    model, result, _ = _traced(name)
    spec = result.spec
    entries = [e for axes in spec.axes.values() for e in axes]
    parts = [p for e in entries for p in (e.parts if isinstance(e, Segments) else [e])]
    forms = {p for p in parts if isinstance(p, Tiled)}
    heads = {f.outer for f in forms if isinstance(f.outer, str)}
    dims = {f.group for f in forms if isinstance(f.outer, str)}
    assert len(heads) == 2 and {spec.sizes[h] for h in heads} == {4}
    assert len(dims) == 4 and {spec.sizes[d] for d in dims} == {8}
    assert result.composites == ()


@pytest.mark.parametrize("name", NAMES)
def test_weight_matching_finds_a_planted_permutation(name):
    model, result, _ = _traced(name)
    spec = result.spec
    sa = {k: v.float() for k, v in model.state_dict().items()}
    plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(2)))
    gen = torch.Generator().manual_seed(5)
    sb = {k: v + 1e-6 * torch.randn(v.shape, generator=gen) for k, v in plant.apply(sa).items()}
    found = weight_matching(spec, sa, sb)
    assert found.perms == plant.inverse()


@pytest.mark.parametrize("name", ["gpt2", "llama", "phi"])
def test_activation_matching_finds_a_planted_permutation_in_an_exported_model(name):
    """Both models run through their exported graphs on batches of other sizes than the traced one (Llama's
    and Phi's heads read through tiled units: query heads over key/value heads, partial rotary dims)."""
    model, result, _ = _traced(name)
    spec = result.spec
    plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(2)))
    other = _model(name, 0)
    other.load_state_dict(plant.apply(model.state_dict()))
    data = [_inputs(name, seed=10 + i, batch=4) for i in range(3)] + [_inputs(name, seed=20, batch=3)]
    found = activation_matching(model, other, None, data, composite="fix")
    assert found.perms == plant.inverse()
