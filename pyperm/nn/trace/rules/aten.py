"""ATen operators: the graphs of the torch.export front end (:mod:`pyperm.nn.trace.export`).

torch.export records a model as ATen operators (``torch.ops.aten.*``). Most keep the name and the
argument order of their Python counterpart (``aten.transpose.int`` and ``torch.transpose``,
``aten.linear`` and ``F.linear``, ``aten.view`` and ``Tensor.view``), so the registry gives them the
counterpart's rule (:func:`pyperm.nn.trace.registry.lookup_function`), rules users registered for
those functions included. This module holds the rules of the operators that differ: another argument
order (``embedding``, ``batch_norm``, ``convolution``), operators Python code reaches under another
name (``addmm``: GPT-2's ``Conv1D``, whose weight is stored as (in, out); ``slice``, ``select`` and
``index`` for ``x[...]``), tuples of results (``native_dropout``, ``native_layer_norm``, batch norm
without training), and the copies, aliases and comparisons the export inserts.

Two rules see more than their torch counterparts: a slice along units cuts the class into pieces
(as ``split`` does), and ``expand`` of a tensor that carries units gives every axis it broadcasts a
class of its own. An expanded tensor is constant along such an axis, so any permutation of it leaves
the tensor as it is: the new class binds nothing, and lets the axis join others. That is what makes
grouped-query attention exact (``repeat_kv``: key/value heads expanded over the query heads they
serve, then merged into one axis of query heads).
"""

from __future__ import annotations

from typing import Any

import torch

from pyperm.nn.trace.call import TraceCall, node_name
from pyperm.nn.trace.labels import Label, MovedTileAxis, is_structure, map_tensors, tensor_leaves
from pyperm.nn.trace.registry import register_all
from pyperm.nn.trace.rules.combine import split
from pyperm.nn.trace.rules.conv import convolution
from pyperm.nn.trace.rules.norms import channel_norm, last_axes_norm
from pyperm.nn.trace.rules.pointwise import elementwise, nonlinear, same
from pyperm.nn.trace.rules.pooling import pooling, reduced
from pyperm.nn.trace.rules.shape import pad_function, reshape
from pyperm.nn.trace.sites import Role

__all__: list[str] = []

aten = torch.ops.aten


def _ops(*names: str) -> list[Any]:
    """The ATen operator packets of ``names`` that this torch has."""
    return [getattr(aten, name) for name in names if hasattr(aten, name)]


# ---- dense
def addmm(call: TraceCall) -> Label:
    """``bias + mat1 @ mat2`` (``aten.addmm``, ``torch.addmm``): a Linear whose weight is stored (in, out)
    when ``mat2`` is a parameter (GPT-2's ``Conv1D``, and ``nn.Linear`` itself in some exports)."""
    bias = call.get(0, "self")
    (lb, _), (lx, xdep), (lw, wdep) = call.arg(0, "self"), call.arg(1, "mat1"), call.arg(2, "mat2")
    call.join(lx[1], lw[0])  # the contracted axis
    out = Label((lx[0], lw[1]))
    if not wdep and lw[1] is not None:
        call.opened(lw[1], False, node_name(call.node.args[2]))  # x @ W: W's columns are new units
    elif not xdep and lx[0] is not None:
        call.opened(lx[0], False, node_name(call.node.args[1]))  # W @ x
    if isinstance(bias, torch.Tensor):  # added to every row: its classes join the output's
        shape = tuple(call.out_tensor().shape)
        out = call.broadcast([(torch.Size(shape), out), (bias, lb)], shape)
    return out


def embedding(call: TraceCall) -> Label:
    """``aten.embedding(weight, indices)``: the weight first. The lookup is elementwise over the indices,
    so classes on their axes carry over to the result's."""
    lw, wdep = call.arg(0, "weight")
    lidx, _ = call.arg(1, "indices")
    call.opened(lw[1], wdep, node_name(call.node.args[0]))  # type: ignore[index]
    return Label(tuple(lidx) + (lw[1],))  # type: ignore[arg-type,index]


# ---- normalisation
def _with_statistics(call: TraceCall, out: Label, stats: Label) -> Any:
    """The result of a normalisation returning ``(out, *statistics)``: ``out``, and ``stats`` on the
    statistics of ``stats``'s rank (per-channel or per-sample means and inverse deviations)."""
    if isinstance(call.result, torch.Tensor):
        return out
    _, *rest = call.result  # an empty statistic (batch norm without training saves none) carries nothing
    return (out,) + tuple(stats if r.ndim == len(stats) and r.numel() else Label.invariant(r.ndim) for r in rest)


def layer_norm(call: TraceCall) -> Any:
    """``layer_norm``/``native_layer_norm(input, normalized_shape, weight, bias, ...)``: the bias too,
    which ``F.layer_norm``'s rule reads by keyword."""
    _, lx = call.first()
    k = len(call.get(1, "normalized_shape"))
    out = last_axes_norm(call, lx, k, [call.arg(2, "weight")[0], call.arg(3, "bias")[0]])
    return _with_statistics(call, out, Label(tuple(lx[:-k]) + (None,) * k))


def batch_norm(call: TraceCall) -> Any:
    """``batch_norm``/``instance_norm`` and the batch norms without training: ``(input, weight, bias,
    running_mean, running_var, ...)``, in another order than ``F.batch_norm``."""
    _, lx = call.first()
    names = ("weight", "bias", "running_mean", "running_var")
    out = channel_norm(call, lx, [call.arg(i, name)[0] for i, name in enumerate(names, 1)])
    ch = 1 if len(lx) >= 2 else 0
    return _with_statistics(call, out, Label((out[ch],)))


# ---- convolution
def convolution_op(call: TraceCall) -> Label:
    """``aten.convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)``."""
    x, lx = call.first()
    w, wdep = call.arg(1, "weight")
    b, _ = call.arg(2, "bias")
    groups, transposed = int(call.get(8, "groups", 1)), bool(call.get(6, "transposed", False))
    return convolution(call, x, lx, w, b, groups, transposed, wdep)


# ---- shape and indexing
def expand(call: TraceCall) -> Label:
    """``expand``: a broadcast; an axis expanded out of a tensor that carries units gets a class of its
    own (the tensor is constant along it, so every permutation of the axis leaves it as it is)."""
    x, lx = call.first()
    out = call.out_tensor()
    label = list(call.broadcast([(x, lx)], tuple(out.shape)))
    call.role = Role.PASS
    if not (call.structured and lx.has_atoms()):  # masks, indices, positions: nothing to carry
        return Label(label)
    shift = out.ndim - x.ndim
    for k, n in enumerate(out.shape):
        if n > 1 and (k < shift or x.shape[k - shift] == 1):
            label[k] = call.new_units(n, f"{call.path or call.node.name}.{call.node.name}.{k}")
    return Label(label)


def repeat_interleave(call: TraceCall) -> Label:
    """``repeat_interleave(x, repeats, dim)``: every unit of ``dim`` repeated in place, i.e. ``expand``
    then merge: blocks moved by the units' class, the copies within by a class of their own."""
    x, lx = call.first()
    repeats, dim = call.get(1, "repeats"), call.get(2, "dim")
    call.role = Role.PASS
    if dim is None or not isinstance(repeats, int):
        return _fix_all(call, lx, "repeats the flattened tensor or by a tensor of counts")
    d = int(dim) % x.ndim
    a = lx[d]
    if a is None or repeats == 1:
        return Label(lx)
    if call.structured and not is_structure(a):
        copies = call.new_units(repeats, f"{call.path or call.node.name}.{call.node.name}")
        return Label(MovedTileAxis(a, copies) if i == d else e for i, e in enumerate(lx))
    call.composite(f"repeats the units of axis {d} in place", [a])
    return Label(None if i == d else e for i, e in enumerate(lx))


def _fix_all(call: TraceCall, lx: Label, what: str) -> Label:
    """Fixes every class of ``lx`` (listed as composites) and labels the result invariant."""
    if lx.has_atoms():
        call.composite(what, list(lx))
    return Label.invariant(call.out_tensor().ndim)


def _picked(call: TraceCall, what: str, atoms: list[Any]) -> None:
    """Entries picked out of an axis of units: fixed and listed as composites when the tensor is an
    activation; for a parameter or constant (a table read at fixed positions) its axis is just fixed."""
    if call.depends(call.node.args[0] if call.node.args else None):
        call.composite(what, atoms)
    else:
        call.fix(*atoms)


def slice_op(call: TraceCall) -> Label:
    """``x[..., start:end:step]`` along one axis: a contiguous slice along units cuts their class into
    pieces (like ``split``; a spec names them as segments), any other slice along units fixes it."""
    x, lx = call.first()
    d = int(call.get(1, "dim", 0)) % x.ndim
    lo, hi, step = slice(call.get(2, "start"), call.get(3, "end"), call.get(4, "step", 1)).indices(x.shape[d])
    call.role = Role.PASS
    a = lx[d]
    if a is None or (lo, hi, step) == (0, x.shape[d], 1):
        return Label(lx)
    if call.is_fixed(a):  # fixed before (rotary embeddings multiply by cos first): nothing to say
        return Label(None if i == d else e for i, e in enumerate(lx))
    if step == 1 and hi > lo and call.structured:
        pieces = call.cut(a, [lo, hi])
        if pieces is not None:
            return Label(pieces[1 if lo > 0 else 0] if i == d else e for i, e in enumerate(lx))
    _picked(call, f"slices axis {d}, which carries permuted units", [a])
    return Label(None if i == d else e for i, e in enumerate(lx))


def select(call: TraceCall) -> Label:
    """``x.select(dim, i)`` (``x[:, i]``): the axis goes; one unit picked out of many fixes their class."""
    x, lx = call.first()
    d = int(call.get(1, "dim")) % x.ndim
    if lx[d] is not None:
        _picked(call, f"selects one entry of axis {d}, which carries permuted units", [lx[d]])
    call.role = Role.PASS
    return Label(e for i, e in enumerate(lx) if i != d)


def index(call: TraceCall) -> Label:
    """``x[i0, i1, ...]`` with index tensors: the indexed axes become the indices' axes (invariant; those
    axes must not carry units), the other axes keep their classes."""
    x, lx = call.first()
    out = call.out_tensor()
    covered: list[list[int]] = []  # the axes of x each index covers (a boolean mask covers several)
    axis = 0
    for t in call.get(1, "indices"):
        width = t.ndim if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) else 1
        if t is not None:
            covered.append(list(range(axis, axis + width)))
        axis += width
    for _, lab in tensor_leaves(list(call.get(1, "indices")), call.get_label(1, "indices")):
        call.fix(*lab)  # index values, not units
    indexed = [i for axes in covered for i in axes]
    if any(lx[i] is not None for i in indexed):
        _picked(call, "indexes an axis that carries permuted units", [lx[i] for i in indexed])
    kept = [e for i, e in enumerate(lx) if i not in indexed]
    new = [None] * (out.ndim - len(kept))
    call.role = Role.PASS
    if indexed and indexed == list(range(indexed[0], indexed[-1] + 1)):  # adjacent: the new axes stay there
        return Label(list(lx[: indexed[0]]) + new + list(lx[indexed[-1] + 1 :]))
    return Label(new + kept)


def index_select(call: TraceCall) -> Label:
    """``x.index_select(dim, index)``: entries of one axis picked out by index (fixed when they are units)."""
    x, lx = call.first()
    d = int(call.get(1, "dim")) % x.ndim
    if lx[d] is not None:
        _picked(call, f"picks entries of axis {d}, which carries permuted units", [lx[d]])
    call.role = Role.PASS
    return Label(None if i == d else e for i, e in enumerate(lx))


def gather(call: TraceCall) -> Label:
    """``x.gather(dim, index)``: the result has the index's shape. Along ``dim`` it holds entries picked by
    value (fixed when they are units); along another axis, entry ``k`` of x where the index is as long as x
    there and permuted alike (joined: an index that varies along units in its own order fixes them)."""
    x, lx = call.first()
    d = int(call.get(1, "dim")) % x.ndim
    idx = call.get(2, "index")
    lidx, _ = call.arg(2, "index")
    lidx = lidx if lidx is not None else Label.invariant(idx.ndim)
    out: list[Any] = []
    for k, a in enumerate(lx):
        if k == d or idx.shape[k] != x.shape[k]:
            if a is not None:
                _picked(call, f"gathers along axis {k}, which carries permuted units", [a])
            call.fix(lidx[k])
            out.append(None)
        else:
            out.append(call.join(a, lidx[k]) if a is not None or lidx[k] is not None else None)
    call.role = Role.PASS
    return Label(out)


# ---- reductions and results that are tuples
def vector_norm(call: TraceCall) -> Label:
    """``linalg_vector_norm(x, ord, dim, keepdim)``: a norm over units is invariant under their permutation."""
    x, lx = call.first()
    out = call.out_tensor()
    dim = call.get(2, "dim")
    dim = [dim] if isinstance(dim, int) else dim
    dims = {int(d) % x.ndim for d in dim} if dim else set(range(x.ndim))  # None or []: every axis
    call.role = Role.PASS
    return reduced(lx, dims, keepdim=out.ndim == x.ndim)


def each_like_input(call: TraceCall) -> Any:
    """Results that are the input and a mask of its shape (``native_dropout``): the input's label on both."""
    _, lx = call.first()
    call.role = Role.PASS
    return map_tensors(call.result, lambda v: lx if v.ndim == len(lx) else Label.invariant(v.ndim))


# Operators whose result is their input (copies, aliases, checks); reshapes; elementwise comparisons and
# logical operators (masks); softmax kernels.
SAME = _ops("alias", "lift_fresh_copy", "lift_fresh", "detach_", "_to_copy", "_to_dim_order_copy", "contiguous")
RESHAPES = _ops("_unsafe_view", "_reshape_alias", "view_copy", "reshape_as", "view_as")
ELEMENTWISE = _ops(
    "le", "lt", "ge", "gt", "eq", "ne", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and",
    "bitwise_or", "bitwise_not", "bitwise_xor", "__and__", "__or__", "__xor__", "__invert__", "isnan", "isinf",
    "isfinite", "rsub", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "dropout_",
)  # fmt: skip
NONLINEAR = _ops("_softmax", "_log_softmax", "_safe_softmax")
UPSAMPLE = _ops("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
                "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact1d",
                "_upsample_nearest_exact2d", "_upsample_nearest_exact3d")  # fmt: skip
ADAPTIVE_POOL = {1: _ops("_adaptive_avg_pool1d"), 2: _ops("_adaptive_avg_pool2d"), 3: _ops("_adaptive_avg_pool3d")}
PADS = _ops("constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
            "replication_pad2d", "replication_pad3d")  # fmt: skip

register_all([aten.addmm, torch.addmm, "addmm"], addmm)  # torch.addmm too: Conv1D under torch.fx
register_all([aten.embedding], embedding)
register_all(_ops("layer_norm", "native_layer_norm"), layer_norm)
BATCH_NORMS = _ops("batch_norm", "instance_norm", "_native_batch_norm_legit_no_training", "native_batch_norm",
                   "_native_batch_norm_legit", "_batch_norm_with_update", "_batch_norm_no_update")  # fmt: skip
register_all(BATCH_NORMS, batch_norm)
register_all(_ops("convolution", "_convolution"), convolution_op)
register_all([aten.expand], expand)
register_all([aten.repeat_interleave], repeat_interleave)
register_all([aten.slice], slice_op)
register_all([aten.select], select)
register_all([aten.index], index)
register_all([aten.index_select], index_select)
register_all([aten.gather], gather)
register_all(_ops("split_with_sizes"), split)
register_all([aten.linalg_vector_norm], vector_norm)
register_all([aten.native_dropout], each_like_input)
register_all(SAME, same)
register_all(RESHAPES, reshape)
register_all(ELEMENTWISE, elementwise)
register_all(NONLINEAR, nonlinear)
register_all(UPSAMPLE, pooling(-1))
for _k, _targets in ADAPTIVE_POOL.items():
    register_all(_targets, pooling(_k))
register_all(PADS, pad_function)
