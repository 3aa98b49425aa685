"""Layers that produce units from a weight matrix: Linear, ``x @ W`` (and ``torch.einsum``), Embedding.

A Linear turns an input labelled ``(.., a)`` into an output labelled ``(.., W0)`` and
joins ``a`` with ``W1`` (the weight's input axis); its output axis holds fresh units, so
the node is a *producer* for the activation sites.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.trace.call import TraceCall, node_name
from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.labels import Label
from pyperm.nn.trace.registry import register_all
from pyperm.nn.trace.sites import Role

__all__ = ["linear", "linear_layer"]

MATMUL_FUNCTIONS = (torch.matmul, operator.matmul, torch.mm, torch.bmm)
MATMUL_METHODS = ("matmul", "mm", "bmm")


def linear_layer(
    call: TraceCall,
    lx: Label,
    w: Label | None,
    b: Label | None,
    weight_dep: bool = False,
) -> Label:
    """``x W^T + b`` on the last axis of ``x``: labels for a weight ``w`` of shape (out, in) and a bias ``b``."""
    if w is None:
        raise TraceError(f"{call.where()}: the weight is not a tensor the tracer can follow")
    call.join(lx[-1], w[1])
    if b is not None:
        call.join(w[0], b[0])
    call.opened(w[0], weight_dep, call.weight_name())
    return Label(tuple(lx[:-1]) + (w[0],))


def linear(call: TraceCall) -> Label:
    """Rule: a module with ``weight`` (out, in) and optional ``bias`` (out,), applied to the last axis like nn.Linear."""
    _, lx = call.first()
    return linear_layer(call, lx, call.param("weight"), call.param("bias"))


def linear_function(call: TraceCall) -> Label:
    _, lx = call.first()
    w, wdep = call.arg(1, "weight")
    b, _ = call.arg(2, "bias")
    return linear_layer(call, lx, w, b, wdep)


def matmul(call: TraceCall) -> Label:
    """``a @ b``: the contracted axes join; a parameter's free axis is a producer."""
    a, la = call.first()
    name = "mat2" if call.target_name in ("mm", "bmm") else "other"
    b = call.get(1, name)
    if not isinstance(b, torch.Tensor):
        raise TraceError(f"{call.where()} expected two tensors")
    lb, bdep = call.arg(1, name)
    node_a = call.node.args[0]
    adep = call.depends(node_a)
    # 1-D operands are promoted to matrices and the added axis dropped afterwards.
    la2 = Label(la) if a.ndim >= 2 else Label((None,) + tuple(la))
    lb2 = Label(lb) if b.ndim >= 2 else Label(tuple(lb) + (None,))
    sa = tuple(a.shape) if a.ndim >= 2 else (1,) + tuple(a.shape)
    sb = tuple(b.shape) if b.ndim >= 2 else tuple(b.shape) + (1,)
    # The contracted axis: sum_k a_k b_k is invariant when both sides permute k alike.
    call.join(la2[-1], lb2[-2])
    batch_shape = tuple(torch.broadcast_shapes(sa[:-2], sb[:-2]))
    out = list(call.broadcast([(torch.Size(sa[:-2]), Label(la2[:-2])), (torch.Size(sb[:-2]), Label(lb2[:-2]))],
                              batch_shape))  # fmt: skip
    if a.ndim >= 2:
        out.append(la2[-2])
    if b.ndim >= 2:
        out.append(lb2[-1])
    call.role = Role.OTHER
    weight = call.node.args[1] if len(call.node.args) > 1 else call.node.kwargs.get(name)
    if not bdep and b.ndim >= 2 and lb2[-1] is not None:
        call.opened(lb2[-1], False, node_name(weight))  # x @ W: W's columns are new units
    elif not adep and a.ndim >= 2 and la2[-2] is not None:
        call.opened(la2[-2], False, node_name(node_a))  # W @ x
    return Label(out)


def einsum(call: TraceCall) -> Label:
    """``torch.einsum``: every index letter is one class wherever it appears (a contracted letter sums over
    units permuted alike, a kept one carries them to the output); letters of parameters alone are new units."""
    operands, labels, nodes = list(call.args[1:]), list(call.largs[1:]), list(call.node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):  # torch.einsum(equation, [a, b])
        operands, labels, nodes = list(operands[0]), list(labels[0] or ()), list(nodes[0])
    if not isinstance(call.args[0], str) or not all(isinstance(t, torch.Tensor) for t in operands):
        raise TraceError(f"{call.where()} expected an equation and tensors")
    letters, output = _einsum_letters(call.args[0], [t.ndim for t in operands])
    found: dict[str, list[tuple[Any, int, bool]]] = {}  # letter -> (label, size, input-dependent) per occurrence
    for t, lab, node, subscript in zip(operands, labels, nodes, letters):
        lab = lab if isinstance(lab, Label) else Label.invariant(t.ndim)
        for axis, letter in enumerate(subscript):
            found.setdefault(letter, []).append((lab[axis], t.shape[axis], call.depends(node)))
    classes = {letter: _einsum_class(call, seen) for letter, seen in found.items()}
    for letter in output:  # a parameter's letter that no activation has: units the einsum produces
        if classes[letter] is not None and not any(dep for _, _, dep in found[letter]):
            call.opened(classes[letter], False, node_name(nodes[next(i for i, s in enumerate(letters) if letter in s)]))
    return Label(classes[letter] for letter in output)


def _einsum_class(call: TraceCall, seen: list[tuple[Any, int, bool]]) -> Any:
    """One letter's class: its occurrences joined; broadcast ones (size 1) and an invariant one fix the rest."""
    n = max(size for _, size, _ in seen)
    for atom, size, _ in seen:
        if size == 1 and n != 1:
            call.fix(atom)
    atoms = [atom for atom, size, _ in seen if size == n]
    if any(a is None for a in atoms):
        call.fix(*atoms)
        return None
    return call.join(*atoms)


def _einsum_letters(equation: str, ndims: list[int]) -> tuple[list[str], str]:
    """The index letters of every operand and of the output, an ellipsis spelled out as letters of its own."""
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    subscripts = inputs.split(",")
    if len(subscripts) != len(ndims):
        raise TraceError(f"einsum equation {equation!r} names {len(subscripts)} operands, got {len(ndims)}")
    extra = max((n - len(s) + 3 for s, n in zip(subscripts, ndims) if "..." in s), default=0)
    ellipsis = "".join(chr(0x3B1 + i) for i in range(extra))  # Greek letters: never in an equation
    letters = [s.replace("...", ellipsis[extra - (n - len(s) + 3):]) for s, n in zip(subscripts, ndims)]
    if not arrow:  # implicit output: the ellipsis, then the letters used once, in alphabetical order
        counts = "".join(s.replace("...", "") for s in subscripts)
        output = "..." * bool(extra) + "".join(sorted(c for c in set(counts) if counts.count(c) == 1))
    return letters, output.replace("...", ellipsis)


def _embedding(call: TraceCall, lidx: Label, w: Label | None, weight_dep: bool) -> Label:
    if w is None:
        raise TraceError(f"{call.where()}: the weight is not a tensor the tracer can follow")
    if any(a is not None for a in lidx):
        raise TraceError(f"{call.where()} looks up indices that carry permuted units")
    call.opened(w[1], weight_dep, call.weight_name())
    return Label(tuple(lidx) + (w[1],))


def embedding_module(call: TraceCall) -> Label:
    _, lidx = call.first()
    return _embedding(call, lidx, call.param("weight"), False)


def embedding_function(call: TraceCall) -> Label:
    _, lidx = call.first()
    w, wdep = call.arg(1, "weight")
    return _embedding(call, lidx, w, wdep)


register_all([nn.Linear], linear)
register_all([F.linear], linear_function)
register_all(MATMUL_FUNCTIONS + MATMUL_METHODS, matmul)
register_all([torch.einsum], einsum)
register_all([nn.Embedding], embedding_module)
register_all([F.embedding], embedding_function)
