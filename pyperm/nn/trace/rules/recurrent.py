"""Recurrent layers: ``nn.RNN``, ``nn.LSTM``, ``nn.GRU``.

The input features are contracted with the input-to-hidden weights, so the units of the
input stay permutable (joined with the column axis of ``weight_ih_l0``, and of its
reverse direction). The hidden units are not: the gates are stacked along one axis
(``4H`` rows for an LSTM) and the hidden-to-hidden weight needs ``P W P^T``, forms a
flat spec cannot name. They are left unpermuted and listed in ``TraceResult.composites``.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import nn

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.labels import CatAxis, Label, label_leaves
from pyperm.nn.trace.registry import register_all

__all__ = ["recurrent"]


GATES = {nn.RNN: 1, nn.GRU: 3, nn.LSTM: 4}


def _uses_state(call: TraceCall) -> bool:
    """Whether the graph reads the final state (``h_n``, ``c_n``), not only the output sequence."""
    return any(not (u.target is operator.getitem and u.args[1] == 0) for u in call.node.users)


def _structured(call: TraceCall, lx: Label) -> Any:
    """Hidden units of every layer and direction are a group, the gates its segments."""
    m = call.module
    gates = next(n for cls, n in GATES.items() if isinstance(m, cls))
    size = m.hidden_size  # type: ignore[union-attr]
    suffixes = ["", "_reverse"] if m.bidirectional else [""]  # type: ignore[union-attr]
    below: Any = lx[-1]  # what each layer reads: the input, then the layer below (both directions)
    hidden = []
    for layer in range(m.num_layers):  # type: ignore[union-attr]
        outs = []
        for sfx in suffixes:
            h = call.param(f"weight_hh_l{layer}{sfx}")[1]  # type: ignore[index]
            stacked = CatAxis(((h, size),) * gates) if gates > 1 else h
            call.join(below, call.param(f"weight_ih_l{layer}{sfx}")[1])  # type: ignore[index]
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                lab = call.param(f"{name}_l{layer}{sfx}")
                if lab is not None:
                    call.join(lab[0], stacked)
            call.opened(h, False, f"{call.path or call.node.name}.l{layer}{sfx}")
            call.activate(h)
            outs.append(h)
            hidden.append(h)
        below = CatAxis(tuple((h, size) for h in outs)) if len(outs) > 1 else outs[0]
    for lab in label_leaves(call.largs[1:]) + label_leaves(list(call.lkwargs.values())):
        if len(hidden) == 1:  # an initial state holds hidden units
            call.join(lab[-1], hidden[0])
        call.fix(*(lab[:-1] if len(hidden) == 1 else lab))
    output, state = call.result
    states = state if isinstance(state, tuple) else (state,)
    # The final state stacks every layer and direction along its first axis: one class per row,
    # which a label cannot say unless there is one row (_uses_state falls back otherwise).
    last = hidden[0] if len(hidden) == 1 else None
    labels = tuple(Label((None,) * (t.ndim - 1) + (last,)) for t in states)
    return (Label((None,) * (output.ndim - 1) + (below,)), labels if isinstance(state, tuple) else labels[0])


def recurrent(call: TraceCall) -> Any:
    """Rule of ``nn.RNNBase``: the input units join the first layer's input weights; hidden units stay fixed.

    With ``structured=True``, the hidden units of every layer and direction are a group
    acting on both axes of its ``weight_hh``, with the gates as segments (unless the graph
    reads the final state of several layers or directions, or the layer has projections).
    """
    m = call.module
    _, lx = call.first()
    one = m.num_layers == 1 and not m.bidirectional  # type: ignore[union-attr]
    simple = not getattr(m, "proj_size", 0) and (one or not _uses_state(call))
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
