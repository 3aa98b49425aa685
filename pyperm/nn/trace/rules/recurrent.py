"""Recurrent layers: ``nn.RNN``, ``nn.LSTM``, ``nn.GRU``.

The input features are contracted with the input-to-hidden weights, so the units of the
input stay permutable (joined with the column axis of ``weight_ih_l0``, and of its
reverse direction). The hidden units are not, in a flat spec: the gates are stacked along
one axis (``4H`` rows for an LSTM) and the hidden-to-hidden weight needs ``P W P^T``,
forms only a structured spec can name. They are left unpermuted and listed in
``TraceResult.composites`` unless the trace is structured.
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


def _state_rows(call: TraceCall) -> set[int] | None:
    """The rows of the final state (``h_n``, ``c_n``: one row per layer and direction) the graph
    reads, when every read picks one row by an int index (``h_n[-1]``); None for any other use."""
    m = call.module
    count = m.num_layers * (2 if m.bidirectional else 1)  # type: ignore[union-attr]
    rows: set[int] = set()

    def picks(node: Any, length: int) -> list[Any] | None:
        """The users of ``node`` if every one is ``node[k]`` with an int ``k`` (negative ones normalised)."""
        users = list(node.users)
        if not all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                   for u in users):  # fmt: skip
            return None
        return [(u, u.args[1] % length) for u in users]

    top = picks(call.node, 2)  # (output, state)
    if top is None:
        return None
    for node, index in top:
        if index == 0:
            continue  # the output sequence
        tensors = [node]
        if isinstance(m, nn.LSTM):  # (h_n, c_n)
            pairs = picks(node, 2)
            if pairs is None:
                return None
            tensors = [u for u, _ in pairs]
        for t in tensors:
            read = picks(t, count)
            if read is None:
                return None
            rows.update(k for _, k in read)
    return rows


def _structured(call: TraceCall, lx: Label, row: int | None) -> Any:
    """Hidden units of every layer and direction are a group, the gates its segments; with
    projections (``proj_size``) the cell units are a group and the projected output another."""
    m = call.module
    gates = next(n for cls, n in GATES.items() if isinstance(m, cls))
    size = m.hidden_size  # type: ignore[union-attr]
    width = getattr(m, "proj_size", 0) or size  # the units of the output and of h
    suffixes = ["", "_reverse"] if m.bidirectional else [""]  # type: ignore[union-attr]
    below: Any = lx[-1]  # what each layer reads: the input, then the layer below (both directions)
    outputs, cells = [], []  # per layer and direction, in the final state's row order
    for layer in range(m.num_layers):  # type: ignore[union-attr]
        outs = []
        for sfx in suffixes:
            hh = call.param(f"weight_hh_l{layer}{sfx}")
            if width != size:  # h = W_hr c: the cell units feed a projection
                hr = call.param(f"weight_hr_l{layer}{sfx}")
                cell, out = hr[1], hr[0]  # type: ignore[index]
                call.join(hh[1], out)  # type: ignore[index]
            else:
                cell = out = hh[1]  # type: ignore[index]
            stacked = CatAxis(((cell, size),) * gates) if gates > 1 else cell
            call.join(below, call.param(f"weight_ih_l{layer}{sfx}")[1])  # type: ignore[index]
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                lab = call.param(f"{name}_l{layer}{sfx}")
                if lab is not None:
                    call.join(lab[0], stacked)
            where = f"{call.path or call.node.name}.l{layer}{sfx}"
            call.opened(cell, False, where if cell == out else f"{where}.cell")
            call.opened(out, False, where)
            call.activate(cell)
            call.activate(out)
            outs.append(out)
            outputs.append(out)
            cells.append(cell)
        below = CatAxis(tuple((h, width) for h in outs)) if len(outs) > 1 else outs[0]
    initial = label_leaves(call.largs[1:]) + label_leaves(list(call.lkwargs.values()))
    for i, lab in enumerate(initial):  # an initial state holds hidden units (h0, then c0 for an LSTM)
        if len(outputs) == 1:
            call.join(lab[-1], (cells if i == 1 else outputs)[0])
        call.fix(*(lab[:-1] if len(outputs) == 1 else lab))
    output, state = call.result
    states = state if isinstance(state, tuple) else (state,)
    # The final state stacks every layer and direction along its first axis, one class per row,
    # which a label cannot say: it carries the class of the one row the graph reads (h_n[-1]).
    labels = tuple(
        Label((None,) * (t.ndim - 1) + ((cells if i == 1 else outputs)[row] if row is not None else None,))
        for i, t in enumerate(states)
    )
    return (Label((None,) * (output.ndim - 1) + (below,)), labels if isinstance(state, tuple) else labels[0])


def recurrent(call: TraceCall) -> Any:
    """Rule of ``nn.RNNBase``: the input units join the first layer's input weights; hidden units stay fixed.

    With ``structured=True``, the hidden units of every layer and direction are a group
    acting on both axes of its ``weight_hh``, with the gates as segments (with projections,
    the cell units and the projected units are two groups), unless the graph reads the
    final state of several layers or directions, or uses it other than by picking a row.
    """
    m = call.module
    _, lx = call.first()
    one = m.num_layers == 1 and not m.bidirectional  # type: ignore[union-attr]
    rows = {0} if one else _state_rows(call)
    if call.structured and rows is not None and len(rows) <= 1 and type(m) in GATES and not any(
        a is not None for a in lx[:-1]
    ):
        return _structured(call, lx, next(iter(rows), None))
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
