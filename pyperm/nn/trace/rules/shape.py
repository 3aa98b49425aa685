"""Shape operations: reshape/flatten/view, permute/transpose, expand, indexing, attribute access, padding.

They move labels between axes. Axes of size 1 carry nothing; a reshape that merges an
axis of units with other axes (flatten of a feature map larger than 1x1) or slices,
indexes or pads it builds an axis a spec cannot name: a *composite*.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.labels import (
    CatAxis,
    InterleaveAxis,
    Label,
    MovedTileAxis,
    PartsAxis,
    TileAxis,
    has_atoms,
    invariant_label,
    is_label,
)
from pyperm.nn.trace.registry import register_all
from pyperm.nn.trace.sites import Role

__all__ = ["reshape_labels"]

# A split of an axis of units into (copies, blocks, units) moves the blocks when the copies are
# few (q, k and v: 3); beyond this, the copies share one permutation of the units only.
MAX_SPLIT_COPIES = 8

RESHAPE_FUNCTIONS = (torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze)
RESHAPE_METHODS = ("view", "reshape", "flatten", "squeeze", "unsqueeze", "view_as", "reshape_as", "unflatten",
                   "squeeze_", "unsqueeze_")  # fmt: skip
PERMUTE_FUNCTIONS = (torch.permute, torch.transpose, torch.t, torch.movedim, torch.moveaxis, torch.swapaxes,
                     torch.swapdims)  # fmt: skip
PERMUTE_METHODS = (
    "permute",
    "transpose",
    "t",
    "movedim",
    "moveaxis",
    "swapaxes",
    "swapdims",
)
PAD_MODULES = (
    nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d,
    nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d, nn.ReplicationPad1d, nn.ReplicationPad2d,
    nn.ReplicationPad3d,
)  # fmt: skip


def reshape_labels(call: TraceCall, src: tuple, dst: tuple, lx: Label) -> Label:
    """The label after reshaping shape ``src`` (labelled ``lx``) to ``dst``."""
    if not any(a is not None for a in lx):
        return Label.invariant(len(dst))
    if math.prod(src) == 0:
        call.fix(*lx)
        return Label.invariant(len(dst))
    # Axes of size 1 carry nothing; match the others block by block (equal products).
    for i, s in enumerate(src):
        if s == 1:
            call.fix(lx[i])
    si = [i for i, s in enumerate(src) if s != 1]
    di = [j for j, s in enumerate(dst) if s != 1]
    out: list[int | None] = [None] * len(dst)
    p = q = 0
    while p < len(si) or q < len(di):
        bi, bj = [si[p]], [di[q]]
        pi, pj = src[si[p]], dst[di[q]]
        p, q = p + 1, q + 1
        while pi != pj:
            if pi < pj:
                bi.append(si[p])
                pi *= src[si[p]]
                p += 1
            else:
                bj.append(di[q])
                pj *= dst[di[q]]
                q += 1
        atoms = [lx[i] for i in bi]
        if not any(a is not None for a in atoms):
            continue
        if any(isinstance(a, PartsAxis) for a in atoms):
            merged = _merge_parts(atoms) if len(bi) == 2 and len(bj) == 1 else None
            if merged is None:
                call.composite("reshapes the parts of a concatenation viewed as (parts, units) other than back "
                               "into one axis", atoms)  # fmt: skip
            out[bj[0]] = merged
            continue
        if len(bi) == 1 and len(bj) == 2 and call.structured and _split_parts(call, atoms[0], dst[bj[0]], out, bj):
            continue
        if len(bi) == 1 and len(bj) == 1:
            out[bj[0]] = atoms[0]
        elif len(bj) == 1 and call.structured and sum(a is not None for a in atoms) == 1:
            # Flatten of C x H x W (or heads x head_dim): one class repeated over a fixed block.
            k = next(i for i, a in enumerate(atoms) if a is not None)
            outer, inner = math.prod(src[i] for i in bi[:k]), math.prod(src[i] for i in bi[k + 1 :])
            out[bj[0]] = TileAxis(atoms[k], outer, inner) if (outer, inner) != (1, 1) else atoms[k]
        elif len(bj) == 1 and len(bi) == 2 and call.structured and all(a is not None for a in atoms):
            # The merge of a split (heads x head_dim back to features, a channel shuffle's
            # transposed groups): the first class moves whole blocks, the second the units
            # within every block alike.
            out[bj[0]] = MovedTileAxis(atoms[0], atoms[1])
        elif len(bj) == 1:
            others = [src[i] for i in bi if lx[i] is None]
            what = (f"merges an axis of permuted units with axes of sizes {others} into one axis (blocks of "
                    f"{math.prod(others)} features per unit: flatten of a convolution output larger "
                    "than 1x1?)")  # fmt: skip
            call.composite(what, atoms)
        elif len(bi) == 1 and call.structured:
            # A split (heads x head_dim, a channel shuffle's groups): the innermost new axis gets a
            # class of its own, the same in every block, and the blocks are a class too (heads move
            # as wholes). Split further (timm's fused q, k, v x heads x head_dim), the outer axes
            # stay in place: the axis is a few copies of the same heads (a concatenation); many
            # copies share one permutation of the innermost axis only.
            n, copies = dst[bj[-1]], math.prod(dst[j] for j in bj[:-2])
            name = f"{call.path or call.node.name}.{call.node.name}"
            inner = call.new_units(n, name)
            blocks = call.new_units(dst[bj[-2]], f"{name}.blocks") if copies <= MAX_SPLIT_COPIES else None
            if blocks is None:
                structure: Any = TileAxis(inner, src[bi[0]] // n, 1)
            elif copies == 1:
                structure = MovedTileAxis(blocks, inner)
            else:
                structure = CatAxis(((MovedTileAxis(blocks, inner), dst[bj[-2]] * n),) * copies)
            if call.join(atoms[0], structure) is not None:
                out[bj[-1]] = inner
                if blocks is not None:
                    out[bj[-2]] = blocks
                call.opened(inner)  # the split's output shows these units: their activation site
        elif len(bi) == 1:
            sizes = [dst[j] for j in bj]
            call.composite(f"splits an axis of permuted units into axes of sizes {sizes} (attention heads? a "
                           "channel shuffle?), which only a structured trace (structured=True) can name", atoms)  # fmt: skip
        else:
            raise TraceError(
                f"unsupported reshape {call.where()}: it mixes an axis of permuted units with other axes "
                f"(shape {src} -> {dst})"
            )
    return Label(out)


def _split_parts(call: TraceCall, atom: Any, k: int, out: list, bj: list[int]) -> bool:
    """A concatenation of ``k`` equal parts viewed as ``(k, n)`` (a channel shuffle's first step): the parts
    axis gets a fixed class of its own (the parts differ: they cannot move) and the units axis a
    :class:`PartsAxis` of the parts, so that merging the axes back transposed interleaves them, each part
    keeping its own permutation. False for any other split."""
    cat = call.structure(atom)
    if not isinstance(cat, CatAxis) or len(cat.parts) != k or len({n for _, n in cat.parts}) != 1:
        return False
    selector = call.new_units(k, f"{call.path or call.node.name}.{call.node.name}.parts")
    call.fix(selector)
    out[bj[0]], out[bj[1]] = selector, PartsAxis(selector, cat.parts)
    return True


def _merge_parts(atoms: list) -> Any:
    """Two axes merged, one of them a :class:`PartsAxis` beside its own parts axis: ``(units, parts)`` (the
    shuffle, transposed) interleaves the parts, ``(parts, units)`` concatenates them back. None otherwise."""
    first, second = atoms
    if isinstance(first, PartsAxis) and second == first.selector:
        return InterleaveAxis(first.parts)
    if isinstance(second, PartsAxis) and first == second.selector:
        return CatAxis(second.parts)
    return None


def reshape(call: TraceCall) -> Label:
    x, lx = call.first()
    out = call.out_tensor()
    call.role = Role.PASS
    return reshape_labels(call, tuple(x.shape), tuple(out.shape), lx)


def permute(call: TraceCall) -> Label:
    x, lx = call.first()
    nd = x.ndim
    name = call.target_name
    rest = list(call.args[1:])
    order = list(range(nd))
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        if not dims:
            dims = call.kwargs.get("dims")
        order = [int(d) % nd for d in dims]
    elif name in ("transpose", "swapaxes", "swapdims"):
        d0 = int(call.get(1, "dim0")) % nd
        d1 = int(call.get(2, "dim1")) % nd
        order[d0], order[d1] = order[d1], order[d0]
    elif name == "t":
        order.reverse()
    else:  # movedim / moveaxis
        src = call.get(1, "source")
        dst = call.get(2, "destination")
        src = [int(s) % nd for s in (src if isinstance(src, (list, tuple)) else [src])]
        dst = [int(s) % nd for s in (dst if isinstance(dst, (list, tuple)) else [dst])]
        rest_axes = iter([i for i in range(nd) if i not in src])
        place = dict(zip(dst, src))
        order = [place[j] if j in place else next(rest_axes) for j in range(nd)]
    call.role = Role.PASS
    return Label(lx[i] for i in order)


def expand(call: TraceCall) -> Label:
    x, lx = call.first()
    out = call.out_tensor()
    call.role = Role.PASS
    return call.broadcast([(x, lx)], tuple(out.shape))


def member(call: TraceCall) -> Any:
    """The label of an element picked out of a container (tuple, named tuple, list, dict)."""
    obj, lobj = call.args[0], call.largs[0]
    call.role = Role.PASS  # a layer's output picked out of the tuple it returns
    key = call.args[1] if len(call.args) > 1 else None
    if isinstance(obj, (tuple, list)) and isinstance(lobj, tuple) and len(lobj) == len(obj):
        if isinstance(key, slice) and call.node.target is operator.getitem:
            return lobj[key]
        for i, v in enumerate(obj):
            if v is call.result:
                return lobj[i]
    if isinstance(obj, Mapping) and isinstance(lobj, Mapping):
        for k, v in obj.items():
            if v is call.result and k in lobj:
                return lobj[k]
    if has_atoms(lobj):
        raise TraceError(f"{call.where()} picks something out of a container the tracer cannot follow")
    return invariant_label(call.result)


def get_attribute(call: TraceCall) -> Any:
    if not isinstance(call.args[0], torch.Tensor):
        return member(call)
    x, lab = call.first()
    name = call.args[1]
    if name in ("T", "mT", "mH", "H"):
        order = list(range(x.ndim))
        if name in ("T", "H"):
            order.reverse()
        elif x.ndim >= 2:
            order[-2], order[-1] = order[-1], order[-2]
        return Label(lab[i] for i in order)
    if name in ("data", "real", "imag"):  # elementwise views
        return lab
    if any(a is not None for a in lab):
        raise TraceError(f"unsupported attribute access Tensor.{name} at {call.where()}")
    return invariant_label(call.result)


def get_item(call: TraceCall) -> Any:
    obj, idx = call.args[0], call.args[1]
    lobj = call.largs[0]
    if not isinstance(obj, torch.Tensor):
        return member(call)
    lx = lobj if is_label(lobj) else Label.invariant(obj.ndim)
    call.role = Role.PASS
    return _index_labels(call, obj, lx, idx)


def _index_labels(call: TraceCall, x: torch.Tensor, lx: Label, idx: Any) -> Label:
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(it, (torch.Tensor, list, bool)) for it in items):
        gathered = _gather_labels(call, x, lx, items)
        if gathered is not None:
            return gathered
        if any(a is not None for a in lx):
            raise TraceError(f"unsupported advanced indexing {call.where()} of a tensor that carries permuted units")
        return invariant_label(call.result)
    used = sum(1 for it in items if it is not None and it is not Ellipsis)
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items = items[:e] + [slice(None)] * (x.ndim - used) + items[e + 1 :]
    items = items + [slice(None)] * (x.ndim - sum(1 for it in items if it is not None))
    out: list[int | None] = []
    axis = 0
    for it in items:
        if it is None:
            out.append(None)
            continue
        a = lx[axis]
        size = x.shape[axis]
        if isinstance(it, int):
            if a is not None:
                call.composite(
                    f"selects one unit of axis {axis}, which carries permuted units",
                    [a],
                )
        elif isinstance(it, slice):
            full = range(*it.indices(size)) == range(size)
            if full:
                out.append(a)
            else:
                if a is not None:
                    call.composite(f"slices axis {axis}, which carries permuted units", [a])
                out.append(None)
        else:
            raise TraceError(f"unsupported index {it!r} at {call.where()}")
        axis += 1
    return Label(out)


def _gather_labels(call: TraceCall, x: torch.Tensor, lx: Label, items: list) -> Label | None:
    """``x[..., index, ...]`` with one integer index tensor and full slices elsewhere (a relative position bias
    table read at every pair of positions): the index's axes replace the indexed one, invariant; the other axes
    keep their classes. None for any other advanced indexing."""
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items = items[:e] + [slice(None)] * (x.ndim - len(items) + 1) + items[e + 1 :]
    found = [k for k, it in enumerate(items) if isinstance(it, (torch.Tensor, list))]
    if len(found) != 1 or len(items) > x.ndim or any(
            it != slice(None) for k, it in enumerate(items) if k != found[0]):  # fmt: skip
        return None
    k = found[0]
    index = torch.as_tensor(items[k])
    if index.dtype in (torch.bool, torch.uint8) or index.is_floating_point():
        return None
    if lx[k] is not None and call.is_units(lx[k]):  # units picked by an index: their order matters
        call.composite(f"gathers axis {k}, which carries permuted units, by an index tensor", [lx[k]])
    call.fix(lx[k])  # the rows of a parameter table: not units, their order stays
    return Label(tuple(lx[:k]) + (None,) * index.ndim + tuple(lx[k + 1 :]))


def _pad_labels(call: TraceCall, lx: Label, pad: Sequence[int]) -> Label:
    out = list(lx)
    for i in range(len(pad) // 2):
        axis = len(lx) - 1 - i
        if (pad[2 * i] or pad[2 * i + 1]) and lx[axis] is not None:
            call.composite(f"pads axis {axis}, which carries permuted units", [lx[axis]])
            out[axis] = None
    call.role = Role.PASS
    return Label(out)


def pad_function(call: TraceCall) -> Label:
    _, lx = call.first()
    return _pad_labels(call, lx, list(call.get(1, "pad")))


def pad_module(call: TraceCall) -> Label:
    _, lx = call.first()
    return _pad_labels(call, lx, list(call.module.padding))  # type: ignore[union-attr]


register_all(RESHAPE_FUNCTIONS + RESHAPE_METHODS + (nn.Flatten, nn.Unflatten), reshape)
register_all(PERMUTE_FUNCTIONS + PERMUTE_METHODS, permute)
register_all(("expand", "expand_as"), expand)
register_all([operator.getitem], get_item)
register_all([getattr], get_attribute)
register_all([F.pad], pad_function)
register_all(PAD_MODULES, pad_module)
