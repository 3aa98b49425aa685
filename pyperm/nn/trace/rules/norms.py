"""Normalisation layers: BatchNorm, InstanceNorm, LayerNorm, RMSNorm, GroupNorm.

Their per-channel parameters (and BatchNorm's running statistics) join the class of the
axis they scale; statistics over a set of units are invariant under a permutation of
those units, so the units pass through. GroupNorm's statistics are per group of channels:
its channels pass through too, and the tracer keeps every group whole once the graph has
run (:mod:`pyperm.nn.trace.channel_groups`: blocks of a spec's ``Blocks``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.labels import Label
from pyperm.nn.trace.registry import register_all
from pyperm.nn.trace.sites import Role

__all__ = ["channel_norm", "last_axes_norm"]

BATCH_NORM_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                      nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)  # fmt: skip
LAYER_NORM_MODULES = tuple(m for m in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if m is not None)
LAYER_NORM_FUNCTIONS = tuple(f for f in (F.layer_norm, getattr(F, "rms_norm", None)) if f is not None)


def channel_norm(call: TraceCall, lx: Label, params: Sequence[Label | None]) -> Label:
    """BatchNorm/InstanceNorm/PReLU style: per-channel parameters on axis 1 (axis 0 if unbatched)."""
    ch = 1 if len(lx) >= 2 else 0
    unit = lx[ch]
    for p in params:
        if p is not None:
            unit = call.join(unit, p[0])
    call.role = Role.NORM
    return Label(tuple(lx[:ch]) + (unit,) + tuple(lx[ch + 1 :]))


def last_axes_norm(call: TraceCall, lx: Label, k: int, params: Sequence[Label | None]) -> Label:
    """Normalisation over the last ``k`` axes; its parameters cover exactly those axes."""
    out = list(lx)
    for j in range(k):
        axis = len(lx) - k + j
        atoms = [out[axis]] + [p[j] for p in params if p is not None]
        out[axis] = call.join(*atoms) if any(p is not None for p in params) else out[axis]
    call.role = Role.NORM
    return Label(out)


def batch_norm_module(call: TraceCall) -> Label:
    _, lx = call.first()
    names = ("weight", "bias", "running_mean", "running_var")
    return channel_norm(call, lx, [call.param(k) for k in names])


def batch_norm_function(call: TraceCall) -> Label:
    _, lx = call.first()
    names = ("running_mean", "running_var", "weight", "bias")
    return channel_norm(call, lx, [call.arg(i, k)[0] for i, k in enumerate(names, 1)])


def layer_norm_module(call: TraceCall) -> Label:
    _, lx = call.first()
    k = len(call.module.normalized_shape)  # type: ignore[union-attr]
    return last_axes_norm(call, lx, k, [call.param("weight"), call.param("bias")])


def layer_norm_function(call: TraceCall) -> Label:
    _, lx = call.first()
    shape = call.get(1, "normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    if call.node.target is F.layer_norm:
        params = [call.arg(2, "weight")[0], call.arg(3, "bias")[0]]
    else:  # rms_norm(input, normalized_shape, weight, eps)
        params = [call.arg(2, "weight")[0]]
    return last_axes_norm(call, lx, k, params)


def _group_norm(
    call: TraceCall,
    x: torch.Tensor,
    lx: Label,
    groups: int,
    params: Sequence[Label | None],
) -> Label:
    ch = 1
    if groups in (1, x.shape[ch]) or lx[ch] is None:  # statistics over all channels, or each alone
        return channel_norm(call, lx, params)
    if call.structured:
        # Per-group statistics, per-channel affine: a channel may move only with its group, or
        # within it. The tracer lays the groups over the channels' classes once the graph has run.
        label = channel_norm(call, lx, params)
        call.group_channels(label[ch], x.shape[ch] // groups)
        return label
    call.leave_unpermuted(
        f"normalises {groups} groups of {x.shape[ch] // groups} permuted channels",
        [lx[ch]],
        "units may only be permuted within their group, which a flat PermutationSpec cannot name "
        "(structured=True names it)",
        "channel groups",
    )
    for p in params:
        if p is not None:
            call.fix(*p)
    call.role = Role.NORM
    return Label(tuple(lx[:ch]) + (None,) + tuple(lx[ch + 1 :]))


def group_norm_module(call: TraceCall) -> Label:
    x, lx = call.first()
    params = [call.param("weight"), call.param("bias")]
    return _group_norm(call, x, lx, call.module.num_groups, params)  # type: ignore[union-attr]


def group_norm_function(call: TraceCall) -> Label:
    x, lx = call.first()
    params = [call.arg(2, "weight")[0], call.arg(3, "bias")[0]]
    return _group_norm(call, x, lx, int(call.get(1, "num_groups")), params)


register_all(BATCH_NORM_MODULES, batch_norm_module)
register_all((F.batch_norm, F.instance_norm), batch_norm_function)
register_all(LAYER_NORM_MODULES, layer_norm_module)
register_all(LAYER_NORM_FUNCTIONS, layer_norm_function)
register_all([nn.GroupNorm], group_norm_module)
register_all([F.group_norm], group_norm_function)
