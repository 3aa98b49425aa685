"""Attention: ``nn.MultiheadAttention`` and ``F.scaled_dot_product_attention``.

``nn.MultiheadAttention`` contracts its query, key and value features with the columns
of its input projections, so those units stay permutable (and the three inputs join one
class when they share ``in_proj_weight``); its output projection produces fresh units.
The units inside (query/key/value features split into heads) need a permutation of
heads and of units within each head, which a flat spec cannot name: they are left
unpermuted and listed in ``TraceResult.composites``, unless the trace is structured;
then they are :class:`~pyperm.nn.spec.Blocks` axes (the heads as blocks, and the units of
every head permuted on their own).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.labels import BlockAxis, CatAxis, Label, label_leaves
from pyperm.nn.trace.registry import register_all

__all__ = ["multihead_attention"]


def multihead_attention(call: TraceCall) -> Any:
    """Rule of ``nn.MultiheadAttention``."""
    m = call.module
    inputs = [call.get(i, name) for i, name in enumerate(("query", "key", "value"))]
    labels = [call.get_label(i, name) for i, name in enumerate(("query", "key", "value"))]
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TraceError(f"{call.where()} expected query, key and value tensors")
    labels = [lab if isinstance(lab, Label) else Label.invariant(t.ndim) for t, lab in zip(inputs, labels)]
    if m._qkv_same_embed_dim:  # type: ignore[union-attr]
        w = call.param("in_proj_weight")
        call.join(*[lab[-1] for lab in labels], w[1])  # type: ignore[index]
        inner = list(w[:1])  # type: ignore[index]
    else:
        inner = []
        for lab, name in zip(labels, ("q_proj_weight", "k_proj_weight", "v_proj_weight")):
            w = call.param(name)
            call.join(lab[-1], w[1])  # type: ignore[index]
            inner.append(w[0])  # type: ignore[index]
    for lab in labels:
        if any(a is not None for a in lab[:-1]):
            call.composite("attends over an axis that carries permuted units", lab[:-1])
    out_w, out_b = call.param("out_proj.weight"), call.param("out_proj.bias")
    if call.structured:
        # The heads move as blocks in q, k, v and the output projection's columns; within every
        # head, query and key units are permuted alike (their dot product stays) and value units
        # with the output projection's columns, each head its own permutation.
        heads = call.new_units(m.num_heads, f"{call.path}.heads")  # type: ignore[union-attr]
        qk = BlockAxis(heads, call.new_units(m.embed_dim, f"{call.path}.qk"))  # type: ignore[union-attr]
        vo = BlockAxis(heads, call.new_units(m.embed_dim, f"{call.path}.vo"))  # type: ignore[union-attr]
        qkv = CatAxis(((qk, m.embed_dim), (qk, m.embed_dim), (vo, m.embed_dim)))  # type: ignore[union-attr]
        if m._qkv_same_embed_dim:  # type: ignore[union-attr]
            call.join(inner[0], qkv)
        else:  # q_proj_weight, k_proj_weight, v_proj_weight
            for atom, tiled in zip(inner, (qk, qk, vo)):
                call.join(atom, tiled)
        if call.param("in_proj_bias") is not None:
            call.join(call.param("in_proj_bias")[0], qkv)  # type: ignore[index]
        # The projected query, key and value are never shown: their sites are the inputs projected.
        e = m.embed_dim  # type: ignore[union-attr]
        for i, (name, units) in enumerate(zip(("query", "key", "value"), (qk, qk, vo))):
            rows = (i * e, (i + 1) * e)  # of in_proj_bias, and of in_proj_weight when q, k, v share it
            if m._qkv_same_embed_dim:  # type: ignore[union-attr]
                call.projected(i, name, name, units, "in_proj_weight", rows, "in_proj_bias", rows)
            else:
                call.projected(i, name, name, units, f"{name[0]}_proj_weight", (0, e), "in_proj_bias", rows)
        if m.bias_k is not None:  # add_bias_kv: one more key and value, (1, 1, embed_dim) each  # type: ignore[union-attr]
            call.join(call.param("bias_k")[-1], qk)  # type: ignore[index]
            call.join(call.param("bias_v")[-1], vo)  # type: ignore[index]
        call.join(out_w[1], vo)  # type: ignore[index]
    else:
        inner.append(out_w[1])  # type: ignore[index]
        for name in ("in_proj_bias", "bias_k", "bias_v"):
            inner.extend(call.param(name) or ())
        call.leave_unpermuted(
            "keeps its per-head units",
            inner,
            "its query, key and value units are split into heads, which a flat PermutationSpec cannot name",
            "attention heads",
        )
    for lab in label_leaves(call.largs[3:]) + label_leaves(list(call.lkwargs.values())):
        call.fix(*lab)  # masks
    if out_b is not None:
        call.join(out_w[0], out_b[0])  # type: ignore[index]
    call.opened(out_w[0], False, call.path or call.node.name)  # type: ignore[index]
    out = Label(tuple(labels[0][:-1]) + (out_w[0],))  # type: ignore[index]
    result = call.result
    return (out,) + tuple(Label.invariant(r.ndim) if isinstance(r, torch.Tensor) else None for r in result[1:])


def scaled_dot_product_attention(call: TraceCall) -> Label:
    """``softmax(q k^T) v``: the query and key features join; the result carries the value features."""
    q, lq = call.first()
    k, v = call.get(1, "key"), call.get(2, "value")
    lk, lv = call.arg(1, "key")[0], call.arg(2, "value")[0]
    if lk is None or lv is None:
        raise TraceError(f"{call.where()} expected query, key and value tensors")
    call.join(lq[-1], lk[-1])  # the scores contract the features of query and key
    call.join(lk[-2], lv[-2])  # and the weights those of the key and value positions
    out = call.out_tensor()
    batch = call.broadcast(
        [(torch.Size(q.shape[:-2]), Label(lq[:-2])), (torch.Size(k.shape[:-2]), Label(lk[:-2])),
         (torch.Size(v.shape[:-2]), Label(lv[:-2]))],
        tuple(out.shape[:-2]),
    )  # fmt: skip
    if lq[-2] is not None:
        call.composite("attends from an axis that carries permuted units", [lq[-2]])
    for lab in label_leaves(call.largs[3:]) + label_leaves(list(call.lkwargs.values())):
        call.fix(*lab)  # masks
    return Label(tuple(batch) + (None, lv[-1]))


register_all([nn.MultiheadAttention], multihead_attention)
if hasattr(F, "scaled_dot_product_attention"):
    register_all([F.scaled_dot_product_attention], scaled_dot_product_attention)
