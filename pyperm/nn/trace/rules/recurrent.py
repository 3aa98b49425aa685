"""Recurrent layers: ``nn.RNN``, ``nn.LSTM``, ``nn.GRU``.

The input features are contracted with the input-to-hidden weights, so the units of the
input stay permutable (joined with the column axis of ``weight_ih_l0``, and of its
reverse direction). The hidden units are not: the gates are stacked along one axis
(``4H`` rows for an LSTM) and the hidden-to-hidden weight needs ``P W P^T``, forms a
flat spec cannot name. They are left unpermuted and listed in ``TraceResult.composites``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.labels import CatAxis, Label, label_leaves
from pyperm.nn.trace.registry import register_all

__all__ = ["recurrent"]


GATES = {nn.RNN: 1, nn.GRU: 3, nn.LSTM: 4}


def _structured(call: TraceCall, lx: Label) -> Any:
    """One layer, one direction: the hidden units are a group, the gates its segments."""
    m = call.module
    h = call.param("weight_hh_l0")[1]  # type: ignore[index]
    gates = next(n for cls, n in GATES.items() if isinstance(m, cls))
    stacked = CatAxis(((h, m.hidden_size),) * gates) if gates > 1 else h  # type: ignore[union-attr]
    call.join(lx[-1], call.param("weight_ih_l0")[1])  # type: ignore[index]
    for name in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"):
        lab = call.param(name)
        if lab is not None:
            call.join(lab[0], stacked)
    for lab in label_leaves(call.largs[1:]) + label_leaves(list(call.lkwargs.values())):
        call.join(lab[-1], h)  # an initial state holds hidden units
        call.fix(*lab[:-1])
    call.opened(h, False, call.path or call.node.name)
    output, state = call.result
    states = state if isinstance(state, tuple) else (state,)
    labels = tuple(Label((None,) * (t.ndim - 1) + (h,)) for t in states)
    return (Label((None,) * (output.ndim - 1) + (h,)), labels if isinstance(state, tuple) else labels[0])


def recurrent(call: TraceCall) -> Any:
    """Rule of ``nn.RNNBase``: the input units join the first layer's input weights; hidden units stay fixed.

    With ``structured=True``, a one-layer, one-direction layer's hidden units are a group
    acting on both axes of ``weight_hh_l0``, with the gates as segments.
    """
    m = call.module
    _, lx = call.first()
    simple = m.num_layers == 1 and not m.bidirectional and not getattr(m, "proj_size", 0)  # type: ignore[union-attr]
    if call.structured and simple and type(m) in GATES and not any(a is not None for a in lx[:-1]):
        return _structured(call, lx)
    firsts = ["weight_ih_l0"] + (["weight_ih_l0_reverse"] if m.bidirectional else [])  # type: ignore[union-attr]
    call.join(lx[-1], *[call.param(name)[1] for name in firsts])  # type: ignore[index]
    if any(a is not None for a in lx[:-1]):  # time or batch axes carrying units: no permutation follows them
        call.composite("runs over an axis that carries permuted units", lx[:-1])
    hidden: list[int | None] = []
    for name, _ in m.named_parameters():  # type: ignore[union-attr]
        lab = call.param(name)
        hidden.extend(lab[:1] if name in firsts else lab)  # the input axis stays joined  # type: ignore[index]
    for lab in label_leaves(call.largs[1:]) + label_leaves(list(call.lkwargs.values())):
        hidden.extend(lab)  # an initial state carries hidden units
    call.leave_unpermuted(
        "keeps its hidden units",
        hidden,
        "its gates are stacked along one axis and its hidden-to-hidden weights need the same permutation on "
        "both axes, which a flat PermutationSpec cannot name",
        "recurrent hidden units",
    )
    return call.invariant()


register_all([nn.RNN, nn.LSTM, nn.GRU], recurrent)
