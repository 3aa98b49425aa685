"""Joining and splitting tensors: ``torch.cat``, ``torch.stack``, ``chunk``/``split``/``unbind``.

(Residual additions are elementwise: :mod:`pyperm.nn.trace.rules.pointwise` joins the
classes of their operands.) Concatenating along an axis of units builds an axis out of
several classes, and splitting one into parts of different classes: a *composite*.
Along any other axis the parts' classes join. A structured trace names both: a
concatenation is a ``Segments`` axis, and a split cuts the classes it goes through into
one class per piece (:meth:`~pyperm.nn.trace.labels.UnitClasses.cut`).
"""

from __future__ import annotations

from typing import Any

import torch

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.labels import CatAxis, Label, map_tensors, tensor_leaves, tensors
from pyperm.nn.trace.registry import register_all
from pyperm.nn.trace.sites import Role

__all__: list[str] = []

CAT_FUNCTIONS = (torch.cat, torch.concat, torch.concatenate)
SPLIT_FUNCTIONS = (torch.chunk, torch.split, torch.tensor_split, torch.unbind)
SPLIT_METHODS = ("chunk", "split", "tensor_split", "unbind")


def _parts(call: TraceCall) -> list[tuple[torch.Tensor, Label]]:
    values = call.get(0, "tensors")
    labels = call.get_label(0, "tensors")
    return tensor_leaves(list(values), list(labels))


def cat(call: TraceCall) -> Label:
    out_t = call.out_tensor()
    parts = [(t, lab) for t, lab in _parts(call) if not (t.ndim == 1 and t.numel() == 0)]  # legacy empty tensors
    d = int(call.get(1, "dim", 0)) % out_t.ndim
    call.role = Role.PASS
    if len(parts) == 1:
        return parts[0][1]
    out: list[Any] = []
    for k in range(out_t.ndim):
        atoms = [lab[k] for _, lab in parts]
        if k != d:
            out.append(call.join(*atoms) if any(a is not None for a in atoms) else None)
        elif call.structured and any(a is not None for a in atoms):
            out.append(_segments(call, [(lab[d], t.shape[d]) for t, lab in parts]))
        else:
            call.composite(f"concatenates along axis {d}, which carries permuted units", atoms)
            out.append(None)
    return Label(out)


def _segments(call: TraceCall, parts: list[tuple[Any, int]]) -> CatAxis:
    """A concatenation's axis: the parts in order, nested concatenations spliced in."""
    flat: list[tuple[Any, int]] = []
    for entry, length in parts:
        inner = call.structure(entry) if entry is not None else None
        if isinstance(inner, CatAxis):
            flat.extend(inner.parts)
        else:
            flat.append((entry, length))
    return CatAxis(tuple(flat))


def stack(call: TraceCall) -> Label:
    parts = _parts(call)
    out_t = call.out_tensor()
    d = int(call.get(1, "dim", 0)) % out_t.ndim
    joined = [call.join(*[lab[k] for _, lab in parts]) if any(lab[k] is not None for _, lab in parts) else None
              for k in range(out_t.ndim - 1)]  # fmt: skip
    call.role = Role.PASS
    return Label(joined[:d] + [None] + joined[d:])


def split(call: TraceCall) -> Any:
    x, lx = call.first()
    if call.target_name == "unbind":
        d = int(call.get(1, "dim", 0)) % x.ndim
        if lx[d] is not None:
            call.composite(f"unbinds axis {d}, which carries permuted units", [lx[d]])
        piece = Label(a for i, a in enumerate(lx) if i != d)
        return map_tensors(call.result, lambda v: piece)
    d = int(call.get(2, "dim", 0)) % x.ndim
    lab = lx
    pieces = tensors(call.result)
    call.role = Role.PASS
    if lx[d] is not None and any(p.shape[d] != x.shape[d] for p in pieces):
        cut = _cut(call, lx[d], [p.shape[d] for p in pieces]) if call.structured else None
        if cut is not None:
            labels = iter([Label(entry if i == d else a for i, a in enumerate(lx)) for entry in cut])
            return map_tensors(call.result, lambda v: next(labels))
        call.composite(f"splits axis {d}, which carries permuted units", [lx[d]])
        lab = Label(None if i == d else a for i, a in enumerate(lx))
    return map_tensors(call.result, lambda v: lab)


def _cut(call: TraceCall, entry: Any, sizes: list[int]) -> list[Any] | None:
    """The label of every piece of a split along units (empty pieces carry none), or None."""
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    cut = call.cut(entry, ends[:-1])
    if cut is None:
        return None
    pieces = iter(cut)  # one per non-empty piece, in order
    return [next(pieces) if n else None for n in sizes]


# torchvision's Swin patch merging (kept whole by torch.fx.wrap): the four pixels of every 2x2 patch
# concatenated along the channels, last axis.
PATCH_MERGING_NAMED = ("torchvision.models.swin_transformer._patch_merging_pad",)


def patch_merging(call: TraceCall) -> Label:
    """``_patch_merging_pad(x)``: ``(..., H, W, C)`` to ``(..., H/2, W/2, 4 C)``, four copies of the channels."""
    x, lx = call.first()
    if any(a is not None for a in lx[-3:-1]):
        call.composite("merges patches along axes that carry permuted units", lx[-3:-1])
    call.role = Role.PASS
    channels = lx[-1]
    if channels is not None and call.structured:
        channels = _segments(call, [(lx[-1], x.shape[-1])] * 4)
    elif channels is not None:
        call.composite(f"concatenates four copies of axis {x.ndim - 1}, which carries permuted units", [channels])
        channels = None
    return Label(tuple(lx[:-3]) + (None, None, channels))


register_all(CAT_FUNCTIONS, cat)
register_all(PATCH_MERGING_NAMED, patch_merging)
register_all([torch.stack], stack)
register_all(SPLIT_FUNCTIONS + SPLIT_METHODS, split)
