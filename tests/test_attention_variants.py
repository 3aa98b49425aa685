"""The attention variants of current language models, hand-written, through both front ends of the tracer.

Every variant of :data:`_attention_models.VARIANTS` (multi-head, grouped-query and multi-query attention
with ``repeat_kv`` or SDPA's ``enable_gqa``, half-split and interleaved rotary embeddings, a fused q/k/v
projection, GPT-2's Conv1D, RMSNorm written out, SwiGLU, tied embeddings) is traced by torch.fx and by
torch.export. The spec must keep the float64 function under a random permutation of every group, weight
matching must find a planted permutation back, and the groups must say what the variant allows.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _attention_models import VARIANTS, tiny_lm

from pyperm.nn import Permutations, apply_permutation, trace_model, weight_matching
from pyperm.nn.spec import Segments, Tiled, entry_groups
from pyperm.testing import random_permutations

FRONTENDS = ("fx", "export")
IDS = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))


@functools.lru_cache(maxsize=None)
def _traced(variant: str, frontend: str):
    model = tiny_lm(variant)
    return model, trace_model(model, IDS, composite="fix", frontend=frontend)


def _axes(variant: str, frontend: str, key: str) -> tuple:
    return _traced(variant, frontend)[1].spec.axes[key]


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_random_permutation_of_every_group_keeps_the_function(variant, frontend):
    model, result = _traced(variant, frontend)
    assert result.frontend == frontend
    spec = result.spec
    other = tiny_lm(variant)
    other.load_state_dict(apply_permutation(spec, random_permutations(spec, 1), model.state_dict()))
    ids = torch.randint(0, 40, (3, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(other(ids), model(ids), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_weight_matching_finds_a_planted_permutation(variant, frontend):
    model, result = _traced(variant, frontend)
    spec = result.spec
    sa = {k: v.float() for k, v in model.state_dict().items()}
    plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(2)))
    gen = torch.Generator().manual_seed(3)
    sb = {k: v + 1e-6 * torch.randn(v.shape, generator=gen) for k, v in plant.apply(sa).items()}
    assert weight_matching(spec, sa, sb).perms == plant.inverse()


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_residual_stream_is_one_group_norms_and_tied_embeddings_included(variant, frontend):
    """One group on the embedding's features, every norm, every layer writing into the stream and the
    head's inputs; a tied head is the embedding itself (one tensor, one entry)."""
    _, result = _traced(variant, frontend)
    axes = result.spec.axes
    group = axes["embed.weight"][1]
    assert group is not None and result.spec.sizes[group] == 32
    assert axes["head.weight"] == (None, group)
    for layer in (0, 1):
        p = f"blocks.{layer}."
        for key in (f"{p}norm1.weight", f"{p}norm2.weight"):
            assert axes[key] == (group,)
        conv1d = VARIANTS[variant].get("conv1d", False)  # weights stored (in, out)
        for writer in ("attn.o", "mlp.proj" if f"{p}mlp.proj.weight" in axes else "mlp.down"):
            assert axes[f"{p}{writer}.weight"][1 if conv1d else 0] == group
    assert axes["norm.weight"] == (group,)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_swiglu_gate_and_up_projections_share_the_intermediate_group(frontend):
    axes = _traced("multi-head", frontend)[1].spec.axes
    gate, up, down = (axes[f"blocks.0.mlp.{w}.weight"] for w in ("gate", "up", "down"))
    assert gate[0] == up[0] == down[1] is not None and gate[0] != down[0]


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_multi_head_attention_permutes_heads_and_the_dims_within_them(frontend):
    """q and k rows: head dims by one group within heads moved by another; v rows and o's columns: their own
    head-dim group within the same heads."""
    q, k, v = (_axes("multi-head", frontend, f"blocks.0.attn.{w}.weight")[0] for w in "qkv")
    o = _axes("multi-head", frontend, "blocks.0.attn.o.weight")[1]
    assert q == k and isinstance(q, Tiled) and isinstance(q.outer, str)
    assert v == o and v.outer == q.outer and v.group != q.group


@pytest.mark.parametrize("variant", ["grouped-query", "grouped-query-sdpa", "rotary-grouped-query"])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_grouped_query_attention_moves_a_kv_head_with_its_block_of_query_heads(variant, frontend):
    """k and v rows: the 2 key/value heads move with their head dims (by a group per projection); q rows and o's
    columns: blocks of 2 query heads moved by the same group, (where the trace sees the query heads apart:
    SDPA's enable_gqa, or the export's expand) the query heads within every block by a group of their own, and
    the head dims of every query head alike by k's and v's head-dim groups. Rotary q and k: head dims stay."""
    _, result = _traced(variant, frontend)
    spec, axes = result.spec, result.spec.axes
    k, v, q = (axes[f"blocks.0.attn.{w}.weight"][0] for w in "kvq")
    o = axes["blocks.0.attn.o.weight"][1]
    kv = v.outer
    assert isinstance(v, Tiled) and spec.sizes[kv] == 2 and spec.sizes[v.group] == 8
    within = variant.endswith("sdpa") or frontend == "export"
    query_heads = o.group.outer  # a group, or 2 query heads in place
    assert isinstance(query_heads, str) == within and (spec.sizes[query_heads] if within else query_heads) == 2
    assert o == Tiled(Tiled(v.group, query_heads), kv)  # every query head's value dims, alike
    if variant.startswith("rotary"):
        assert k == Tiled(kv, 1, 8) and q == (Tiled(query_heads, kv, 8) if within else Tiled(kv, 1, 16))
    else:
        assert k == Tiled(k.group, kv) and k.group != v.group and q == Tiled(Tiled(k.group, query_heads), kv)


@pytest.mark.parametrize("variant", ["multi-query", "multi-query-sdpa"])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_multi_query_attention_permutes_query_heads_and_head_dims(variant, frontend):
    """One key/value head serves every query head: the query heads move freely, and the head dims with the
    single key (and value) head's units."""
    _, result = _traced(variant, frontend)
    axes = result.spec.axes
    k, v, q = (axes[f"blocks.0.attn.{w}.weight"][0] for w in "kvq")
    assert isinstance(k, str) and isinstance(v, str) and k != v
    o = axes["blocks.0.attn.o.weight"][1]
    if variant == "multi-query" and frontend == "fx":  # torch.fx's expand fixes the query heads
        assert (q, o) == (Tiled(k, 4), Tiled(v, 4))
    else:
        assert isinstance(q, Tiled) and q.group == k and isinstance(q.outer, str) and o == Tiled(v, q.outer)


@pytest.mark.parametrize("variant", ["rotary-half", "rotary-interleaved"])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_rotary_embeddings_keep_query_and_key_head_dims_in_place(variant, frontend):
    """Rotary pair ``i`` turns at its own frequency, so no permutation of q/k head dims (pairs kept together
    or not) keeps the function: q and k rows move by whole heads only; v's head dims are still permuted."""
    q, k, v = (_axes(variant, frontend, f"blocks.0.attn.{w}.weight")[0] for w in "qkv")
    assert q == k and isinstance(q, Tiled) and (q.outer, q.inner) == (1, 8)
    assert isinstance(v, Tiled) and v.outer == q.group and v.inner == 1


@pytest.mark.parametrize("variant", ["rotary-half", "rotary-interleaved"])
def test_rotary_pairs_cannot_be_permuted(variant):
    """Why the head dims stay: moving rotary pairs (both members together, in q and k alike) changes the
    attention scores, since every pair turns at its own frequency."""
    model = tiny_lm(variant)
    pairs = torch.tensor([1, 0, 3, 2])  # swap pairs 0 and 1, and 2 and 3
    half = variant == "rotary-half"
    dims = torch.cat([pairs, pairs + 4]) if half else torch.stack([2 * pairs, 2 * pairs + 1], 1).flatten()
    rows = torch.cat([dims + 8 * h for h in range(4)])
    state = model.state_dict()
    for w in ("q", "k"):
        state[f"blocks.0.attn.{w}.weight"] = state[f"blocks.0.attn.{w}.weight"][rows]
    other = tiny_lm(variant)
    other.load_state_dict(state)
    with torch.no_grad():
        assert (other(IDS) - model(IDS)).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["fused-qkv", "gpt2-conv1d"])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_fused_projection_is_segments_of_q_k_and_v(variant, frontend):
    """One projection for q, k and v (GPT-2's Conv1D stores it as (in, out)): its output axis is three
    segments, q and k with one head-dim group, v with its own, all in the same heads."""
    conv1d = variant == "gpt2-conv1d"
    qkv = _axes(variant, frontend, "blocks.0.attn.qkv.weight")[1 if conv1d else 0]
    assert isinstance(qkv, Segments) and len(qkv.parts) == 3
    q, k, v = qkv.parts
    assert q == k and v.outer == q.outer and v.group != q.group
    assert _axes(variant, frontend, "blocks.0.attn.qkv.bias") == (qkv,)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_every_group_reaches_its_units_and_nothing_is_left_fixed_without_a_reason(frontend):
    """Multi-head and grouped-query attention leave nothing fixed."""
    assert _traced("multi-head", frontend)[1].composites == ()
    assert _traced("grouped-query", frontend)[1].composites == ()
    groups = set(_traced("multi-head", frontend)[1].spec.sizes)
    named = {g for entries in _traced("multi-head", frontend)[1].spec.axes.values() for e in entries
             for g in entry_groups(e)}  # fmt: skip
    assert groups == named


class _SharedHeadBias(torch.nn.Module):
    """Two attention layers adding one learned per-head bias to their scores through ``attn_mask`` (T5's
    relative positions): the bias's heads axis must move with the heads of every layer that reads it."""

    def __init__(self, width: int = 16, heads: int = 4, length: int = 6) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Linear(5, width)
        self.bias = torch.nn.Parameter(torch.randn(heads, length, length))
        self.q, self.k, self.v, self.out = (torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(2)])
                                            for _ in range(4))  # fmt: skip
        self.head = torch.nn.Linear(width, 3)

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        return z.reshape(z.shape[0], z.shape[1], self.heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for q, k, v, out in zip(self.q, self.k, self.v, self.out):
            a = torch.nn.functional.scaled_dot_product_attention(self._heads(q(h)), self._heads(k(h)), self._heads(v(h)),
                                                                 attn_mask=self.bias[None])  # fmt: skip
            h = h + out(a.transpose(1, 2).reshape(h.shape))
        return self.head(h.mean(1))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_per_head_score_bias_moves_with_the_heads(frontend):
    torch.manual_seed(0)
    model = _SharedHeadBias().double().eval()
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    spec = trace_model(model, x, frontend=frontend).spec
    assert spec.axes["bias"][0] is not None  # the bias's heads are permuted, with the heads of both layers
    for seed in range(3):
        permuted = apply_permutation(spec, random_permutations(spec, seed), model.state_dict())
        other = _SharedHeadBias().double().eval()
        other.load_state_dict(permuted)
        with torch.no_grad():
            torch.testing.assert_close(other(x), model(x), rtol=1e-10, atol=1e-12)
