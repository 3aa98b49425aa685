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
from pyperm.nn.trace.labels import label_leaves
from pyperm.nn.trace.registry import register_all

__all__ = ["recurrent"]


def recurrent(call: TraceCall) -> Any:
    """Rule of ``nn.RNNBase``: the input units join the first layer's input weights; hidden units stay fixed."""
    m = call.module
    _, lx = call.first()
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
