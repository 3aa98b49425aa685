"""Small hand-written decoders with the attention variants of current language models, for the tracer's tests.

One configurable model (:class:`TinyLM`): token embedding, a residual stream through ``layers`` blocks
(pre-norm attention and MLP), a final norm and an output head, tied to the embedding or not. Each
variant of :data:`VARIANTS` switches one feature on: grouped-query or multi-query attention (key/value
heads repeated with ``expand`` + ``reshape`` as Hugging Face's ``repeat_kv`` does, or passed to SDPA
with ``enable_gqa``), rotary position embeddings (half-split as Llama, interleaved as GPT-J), a fused
q/k/v projection, GPT-2's ``Conv1D`` (``torch.addmm`` with a weight stored as (in, out)), RMSNorm
written out (pow, mean, rsqrt, mul), a SwiGLU or GELU MLP. Every forward is traceable by torch.fx.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VARIANTS", "TinyLM", "rope_tables", "tiny_lm"]


class Conv1D(nn.Module):
    """GPT-2's linear layer: ``x @ W + b`` with ``W`` stored as (in, out), computed by ``torch.addmm``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / math.sqrt(n_in))
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.flatten(0, -2), self.weight).unflatten(0, x.shape[:-1])


class RMSNorm(nn.Module):
    """RMSNorm written out as Llama's: ``weight * x * rsqrt(mean(x^2) + eps)``."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(length: Any, inv_freq: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position and head dim: pair ``i`` turns at frequency ``inv_freq[i]``.
    Half-split: pair ``i`` is dims ``(i, i + head_dim/2)``; interleaved: dims ``(2i, 2i + 1)``."""
    angles = torch.arange(length, dtype=inv_freq.dtype, device=inv_freq.device)[:, None] * inv_freq
    angles = torch.cat([angles, angles], -1) if layout == "half" else angles.repeat_interleave(2, -1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The second member of every rotary pair, turned by 90 degrees: ``(-x2, x1)``."""
    half = x.shape[-1] // 2
    if layout == "half":
        return torch.cat([-x[..., half:], x[..., :half]], -1)
    return torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, *, fused: bool = False, conv1d: bool = False,
                 rotary: str | None = None, gqa: str = "repeat", max_len: int = 16) -> None:  # fmt: skip
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.rotary, self.gqa, self.fused = rotary, gqa, fused
        linear = Conv1D if conv1d else nn.Linear
        sizes = [heads * self.hd, kv_heads * self.hd, kv_heads * self.hd]
        if fused:
            self.qkv = linear(d, sum(sizes))
            self.sizes = sizes
        else:
            self.q, self.k, self.v = (linear(d, n) for n in sizes)
        self.o = linear(heads * self.hd, d)
        if rotary:  # a buffer outside the state_dict, as Llama's
            freqs = 10000.0 ** (-torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
            self.register_buffer("inv_freq", freqs, persistent=False)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(x.shape[-2], self.inv_freq, self.rotary)  # type: ignore[arg-type]
        return x * cos.to(x.dtype) + _rotate(x, self.rotary) * sin.to(x.dtype)  # type: ignore[arg-type]

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        """Hugging Face's ``repeat_kv``: every key/value head expanded over the query heads it serves."""
        g = self.heads // self.kv_heads
        return x[:, :, None].expand(-1, -1, g, -1, -1).flatten(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            q, k, v = self.qkv(x).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (t.unflatten(-1, (-1, self.hd)).transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, hd)
        if self.rotary:
            q, k = self._rope(q), self._rope(k)
        gqa = self.kv_heads < self.heads
        if gqa and self.gqa == "repeat":
            k, v = self._repeat(k), self._repeat(v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa and self.gqa == "sdpa")
        return self.o(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int, kind: str, conv1d: bool = False) -> None:
        super().__init__()
        linear = Conv1D if conv1d else nn.Linear
        self.kind = kind
        if kind == "swiglu":
            self.gate, self.up, self.down = linear(d, hidden), linear(d, hidden), linear(hidden, d)
        else:
            self.fc, self.proj = linear(d, hidden), linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, norm: str, mlp: str, conv1d: bool, **attn) -> None:
        super().__init__()
        make_norm = (lambda: RMSNorm(d)) if norm == "rms" else (lambda: nn.LayerNorm(d))
        self.norm1, self.norm2 = make_norm(), make_norm()
        self.attn = Attention(d, heads, kv_heads, conv1d=conv1d, **attn)
        self.mlp = MLP(d, 2 * d, mlp, conv1d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, vocab: int = 40, d: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 4, *,
                 norm: str = "rms", mlp: str = "swiglu", tied: bool = True, conv1d: bool = False,
                 **attn) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads, norm, mlp, conv1d, **attn) for _ in range(layers))
        self.norm = RMSNorm(d) if norm == "rms" else nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


#: name -> TinyLM keyword arguments: one attention variant each (the default: multi-head attention,
#: RMSNorm, SwiGLU, tied embeddings).
VARIANTS = {
    "multi-head": {},
    "grouped-query": {"kv_heads": 2},
    "grouped-query-sdpa": {"kv_heads": 2, "gqa": "sdpa"},
    "multi-query": {"kv_heads": 1},
    "multi-query-sdpa": {"kv_heads": 1, "gqa": "sdpa"},
    "rotary-half": {"rotary": "half"},
    "rotary-interleaved": {"rotary": "interleaved"},
    "rotary-grouped-query": {"rotary": "half", "kv_heads": 2},
    "fused-qkv": {"fused": True},
    "gpt2-conv1d": {"fused": True, "conv1d": True, "norm": "layer", "mlp": "gelu"},
    "untied": {"tied": False},
}


def tiny_lm(variant: str, seed: int = 0) -> TinyLM:
    """The variant's model in float64 and eval mode, its weights drawn from ``seed``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TinyLM(**VARIANTS[variant]).double().eval()
        with torch.no_grad():  # no unit norm weights, no zero norm biases: a parameter left out of the spec shows
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model
