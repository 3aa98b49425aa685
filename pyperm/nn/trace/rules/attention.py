"""Attention: ``nn.MultiheadAttention``, ``F.scaled_dot_product_attention`` and torchvision's Swin attention.

``nn.MultiheadAttention`` contracts its query, key and value features with the columns
of its input projections, so those units stay permutable (and the three inputs join one
class when they share ``in_proj_weight``); its output projection produces fresh units.
The units inside (query/key/value features split into heads) need a permutation of
heads and of units within each head, which a flat spec cannot name: they are left
unpermuted and listed in ``TraceResult.composites``, unless the trace is structured;
then they are :class:`~pyperm.nn.spec.Blocks` axes (the heads as blocks, and the units of
every head permuted on their own).

``F.scaled_dot_product_attention`` with ``enable_gqa=True`` and fewer key/value heads than
query heads serves every block of query heads with one key/value head: the query heads' axis
becomes blocks moved by the key/value heads' class, with the query heads within every block
moved alike by a class of their own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.labels import BlockAxis, CatAxis, Label, MovedTileAxis, label_leaves
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
    k = call.get(1, "key")
    lk, lv = call.arg(1, "key")[0], call.arg(2, "value")[0]
    if lk is None or lv is None:
        raise TraceError(f"{call.where()} expected query, key and value tensors")
    call.join(lq[-1], lk[-1])  # the scores contract the features of query and key
    call.join(lk[-2], lv[-2])  # and the weights those of the key and value positions
    out = call.out_tensor()
    kv_shape, lk, lv = _grouped_query_heads(call, q, k, lk, lv)
    operands = [(torch.Size(q.shape[:-2]), Label(lq[:-2])), (kv_shape, Label(lk[:-2])), (kv_shape, Label(lv[:-2]))]
    mask, lmask = call.get(3, "attn_mask"), call.arg(3, "attn_mask")[0]
    if lmask is not None and mask.ndim > 2:
        # A mask (or an additive bias, as T5's relative positions) is added to the scores of every head:
        # its leading axes broadcast with the heads, so a per-head bias must move with them.
        operands.append((torch.Size(mask.shape[:-2]), Label(lmask[:-2])))
    batch = call.broadcast(operands, tuple(out.shape[:-2]))
    if lq[-2] is not None:
        call.composite("attends from an axis that carries permuted units", [lq[-2]])
    for lab in ([lmask[-2:]] if lmask is not None else []) + label_leaves(call.largs[4:]):
        call.fix(*lab)  # the mask's query and key positions, and any other tensor argument
    for name, lab in call.lkwargs.items():
        for leaf in label_leaves([lab]) if name != "attn_mask" else []:
            call.fix(*leaf)
    return Label(tuple(batch) + (None, lv[-1]))


def _grouped_query_heads(call: TraceCall, q: torch.Tensor, k: torch.Tensor, lk: Label, lv: Label
                         ) -> tuple[torch.Size, Label, Label]:  # fmt: skip
    """The batch shape and labels of key and value as the query heads see them.

    With ``enable_gqa=True`` and fewer key/value heads than query heads, key/value head ``j`` serves
    the ``g`` query heads ``j*g .. j*g+g-1`` (``repeat_interleave`` over the heads): the query heads
    are blocks moved by the key/value heads' class, and the query heads within every block are
    permuted alike by a class of their own (one for key and value, which serve the same heads).
    """
    shape = torch.Size(k.shape[:-2])
    if not call.kwargs.get("enable_gqa", False) or min(k.ndim, q.ndim) < 3 or k.shape[-3] in (1, q.shape[-3]):
        return shape, lk, lv  # one key/value head broadcasts over every query head
    g = q.shape[-3] // k.shape[-3]
    name = f"{call.path or call.node.name}.{call.node.name}.query_heads"
    copies = call.new_units(g, name) if call.structured else None

    def widen(lab: Label) -> Label:
        head = lab[-3]
        if head is not None and (copies is None or not isinstance(head, int)):  # no form for it
            call.composite("serves several query heads with each key/value head", [head])
            head = None
        elif head is not None:
            head = MovedTileAxis(head, copies)
        return Label(tuple(lab[:-3]) + (head,) + tuple(lab[-2:]))

    return shape[:-1] + (q.shape[-3],), widen(lk), widen(lv)


# torchvision's Swin Transformer computes its window attention in one function that torch.fx keeps whole
# (torch.fx.wrap), from the weights of its module and a relative position bias read from a table by another.
SWIN_ATTENTION = ("torchvision.models.swin_transformer.shifted_window_attention",)
SWIN_BIAS = ("torchvision.models.swin_transformer._get_relative_position_bias",)


def relative_position_bias(call: TraceCall) -> Label:
    """``_get_relative_position_bias(table, index, window_size)``: the table's rows read at every pair of
    positions of a window, as ``(1, heads, N, N)``; the heads keep the class of the table's columns."""
    _, table = call.first()
    call.fix(table[0])  # relative positions, not units: their order stays
    return Label((None, table[1], None, None))


def shifted_window_attention(call: TraceCall) -> Label:
    """Swin's window attention (v1 and v2): multi-head self-attention over the tokens of every window, like
    ``nn.MultiheadAttention`` with a fused ``qkv`` weight (rows q, k, v), plus a relative position bias and
    (v2) a logit scale per head, which move with the heads."""
    x, lx = call.first()
    (w_qkv, _), (w_proj, _), (bias, _) = call.arg(1, "qkv_weight"), call.arg(2, "proj_weight"), \
        call.arg(3, "relative_position_bias")  # fmt: skip
    b_qkv, b_proj, scale = (call.arg(i, name)[0] for i, name in ((9, "qkv_bias"), (10, "proj_bias"),
                                                                 (11, "logit_scale")))  # fmt: skip
    if w_qkv is None or w_proj is None or bias is None:
        raise TraceError(f"{call.where()} expected the qkv and projection weights and a relative position bias")
    if any(a is not None for a in lx[:-1]):
        call.composite("attends over an axis that carries permuted units", lx[:-1])
    call.join(lx[-1], w_qkv[1])
    per_head = [w_qkv[0], w_proj[1], bias[1]] + list(b_qkv or ()) + list(scale or ())
    if call.structured:
        _swin_heads(call, int(call.get(5, "num_heads")), x.shape[-1], w_qkv, w_proj, bias, b_qkv, scale)
    else:
        call.leave_unpermuted("keeps its per-head units", per_head, "its query, key and value units are split "
                              "into heads, which a flat PermutationSpec cannot name", "attention heads")  # fmt: skip
    if b_proj is not None:
        call.join(w_proj[0], b_proj[0])
    call.opened(w_proj[0], False, call.path or call.node.name)
    return Label(tuple(lx[:-1]) + (w_proj[0],))


def _swin_heads(call: TraceCall, heads: int, c: int, w_qkv: Label, w_proj: Label, bias: Label, b_qkv: Label | None,
                scale: Label | None) -> None:  # fmt: skip
    """As for ``nn.MultiheadAttention``: heads move as blocks, q and k units alike within every head, v units with
    the projection's columns; the bias (1, heads, N, N) and the logit scale (heads, 1, 1) move with the heads."""
    where = call.path or call.node.name
    heads_atom = call.new_units(heads, f"{where}.heads")
    qk = BlockAxis(heads_atom, call.new_units(c, f"{where}.qk"))
    vo = BlockAxis(heads_atom, call.new_units(c, f"{where}.vo"))
    qkv = CatAxis(((qk, c), (qk, c), (vo, c)))
    call.join(w_qkv[0], qkv)
    if b_qkv is not None:
        call.join(b_qkv[0], qkv)
    call.join(w_proj[1], vo)
    call.join(bias[1], heads_atom)
    if scale is not None:
        call.join(scale[0], heads_atom)
    weight = call.node.args[1] if len(call.node.args) > 1 else call.node.kwargs.get("qkv_weight")
    prefix = f"{call.path}." if call.path else ""
    name = str(getattr(weight, "target", ""))
    if name.startswith(prefix):  # the projected q, k and v are never shown: their sites are the input projected
        for i, (what, units) in enumerate((("query", qk), ("key", qk), ("value", vo))):
            call.projected(0, "input", what, units, name[len(prefix):], (i * c, (i + 1) * c))


register_all([nn.MultiheadAttention], multihead_attention)
register_all(SWIN_ATTENTION, shifted_window_attention)
register_all(SWIN_BIAS, relative_position_bias)
if hasattr(F, "scaled_dot_product_attention"):
    register_all([F.scaled_dot_product_attention], scaled_dot_product_attention)
