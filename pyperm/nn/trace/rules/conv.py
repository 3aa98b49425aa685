"""Convolutions and transposed convolutions (modules and functions), including depthwise ones.

A convolution is a Linear over the channel axis, applied at every position: the input
channels join the weight's input axis and the output channels are fresh units. A
depthwise convolution (one filter per channel) keeps its input's class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.labels import BlockAxis, Label, MovedTileAxis
from pyperm.nn.trace.registry import register_all
from pyperm.nn.trace.sites import Role

__all__ = ["convolution"]

CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSE_MODULES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CONV_FUNCTIONS = (F.conv1d, F.conv2d, F.conv3d)
CONV_TRANSPOSE_FUNCTIONS = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)


def convolution(call: TraceCall, x: torch.Tensor, lx: Label, w: Label | None, b: Label | None, groups: int,
                transposed: bool, weight_dep: bool = False) -> Label:  # fmt: skip
    """Labels of a convolution of ``x`` with weight ``w`` (out, in/groups, *k) or, transposed, (in, out/groups, *k)."""
    if w is None:
        raise TraceError(f"{call.where()}: the weight is not a tensor the tracer can follow")
    wt = call.module.weight if call.module is not None else call.get(1, "weight")
    spatial = wt.ndim - 2
    ch = x.ndim - spatial - 1  # 1 for batched input, 0 for unbatched
    if any(a is not None for a in lx[ch + 1 :]):
        raise TraceError(f"{call.where()} convolves over an axis that carries permuted units")
    c_in = x.shape[ch]
    if groups == 1:
        out_atom = w[0]
        if transposed:  # weight (in, out, *k)
            call.join(lx[ch], w[0])
            out_atom = w[1]
        else:  # weight (out, in, *k)
            call.join(lx[ch], w[1])
        if b is not None:
            call.join(out_atom, b[0])
        call.opened(out_atom, weight_dep, call.weight_name())
        return Label(tuple(lx[:ch]) + (out_atom,) + tuple(lx[ch + 1 :]))
    if not transposed and groups == c_in and wt.shape[0] == c_in:
        # Depthwise: output channel i depends on input channel i alone, so one group runs through.
        unit = call.join(lx[ch], w[0])
        if b is not None:
            unit = call.join(unit, b[0])
        call.role = Role.PASS
        return Label(tuple(lx[:ch]) + (unit,) + tuple(lx[ch + 1 :]))
    # Grouped convolution (depthwise with a channel multiplier too): output channel block b sees
    # input channel block b alone, so units may only be permuted within their channel group
    # (and blocks as a whole). A flat spec cannot say so: the channels on both sides stay fixed.
    # A structured one names it: the groups move as blocks on both sides; the input channels
    # move alike within every group (every filter of a group reads them in one order: the
    # weight's input axis), the output channels each group on its own (Blocks).
    if call.structured and not transposed and c_in // groups > 1:
        c_out = wt.shape[0]
        blocks = call.new_units(groups, f"{call.weight_name()}.groups")
        inside = call.new_units(c_in // groups, f"{call.weight_name()}.in")
        outside = call.new_units(c_out, f"{call.weight_name()}.out")
        call.join(lx[ch], MovedTileAxis(blocks, inside))
        call.join(w[1], inside)
        out = call.join(w[0], BlockAxis(blocks, outside))
        if b is not None:
            call.join(b[0], out)
        call.opened(out, weight_dep, call.weight_name())
        return Label(tuple(lx[:ch]) + (out,) + tuple(lx[ch + 1 :]))
    call.leave_unpermuted(
        f"is a grouped convolution (groups={groups})" + (" of permuted channels" if lx[ch] is not None else ""),
        [lx[ch], w[0]],
        "units may only be permuted within their channel group, which a PermutationSpec cannot name",
        "channel groups",
    )
    call.fix(*w)
    if b is not None:
        call.fix(*b)
    return Label(tuple(lx[:ch]) + (None,) + tuple(lx[ch + 1 :]))


def conv_module(call: TraceCall) -> Label:
    x, lx = call.first()
    m = call.module
    return convolution(call, x, lx, call.param("weight"), call.param("bias"), m.groups, False)  # type: ignore


def conv_transpose_module(call: TraceCall) -> Label:
    x, lx = call.first()
    m = call.module
    return convolution(call, x, lx, call.param("weight"), call.param("bias"), m.groups, True)  # type: ignore


def conv_function(call: TraceCall) -> Label:
    x, lx = call.first()
    w, wdep = call.arg(1, "weight")
    b, _ = call.arg(2, "bias")
    return convolution(call, x, lx, w, b, int(call.get(6, "groups", 1)), False, wdep)


def conv_transpose_function(call: TraceCall) -> Label:
    x, lx = call.first()
    w, wdep = call.arg(1, "weight")
    b, _ = call.arg(2, "bias")
    return convolution(call, x, lx, w, b, int(call.get(6, "groups", 1)), True, wdep)


register_all(CONV_MODULES, conv_module)
register_all(CONV_TRANSPOSE_MODULES, conv_transpose_module)
register_all(CONV_FUNCTIONS, conv_function)
register_all(CONV_TRANSPOSE_FUNCTIONS, conv_transpose_function)
