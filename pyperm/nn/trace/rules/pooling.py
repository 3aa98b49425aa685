"""Pooling, upsampling, reductions, and operations that depend on the order of the units.

Pooling and upsampling act on spatial axes only and keep the channels; sums, means and
maxima over an axis of units are invariant under a permutation of those units. Sorting,
cumulative sums, flips, rolls, top-k and arg-max along an axis of units depend on the
order of the units, so they raise :class:`~pyperm.nn.trace.TraceError` there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.labels import Label
from pyperm.nn.trace.registry import register_all
from pyperm.nn.trace.rules.pointwise import elementwise_with_role
from pyperm.nn.trace.sites import Role

__all__ = ["pooling"]

# Number of pooled (trailing) axes; -1: every axis after the channels (interpolate, Upsample).
POOL_MODULES = {
    nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3,
    nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3, nn.AdaptiveMaxPool1d: 1,
    nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3, nn.LPPool1d: 1, nn.LPPool2d: 2,
    nn.FractionalMaxPool2d: 2, nn.FractionalMaxPool3d: 3, nn.Upsample: -1, nn.UpsamplingNearest2d: 2,
    nn.UpsamplingBilinear2d: 2,
}  # fmt: skip
POOL_FUNCTIONS = {
    F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3,
    F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3, F.adaptive_max_pool1d: 1,
    F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3, F.lp_pool1d: 1, F.lp_pool2d: 2, F.interpolate: -1,
    F.upsample: -1, F.max_pool1d_with_indices: 1, F.max_pool2d_with_indices: 2, F.max_pool3d_with_indices: 3,
}  # fmt: skip
REDUCE_FUNCTIONS = (torch.mean, torch.sum, torch.amax, torch.amin, torch.std, torch.var, torch.logsumexp,
                    torch.prod, torch.norm)  # fmt: skip
REDUCE_METHODS = (
    "mean",
    "sum",
    "amax",
    "amin",
    "std",
    "var",
    "logsumexp",
    "prod",
    "norm",
)
ORDER_FUNCTIONS = (torch.sort, torch.argsort, torch.cumsum, torch.cumprod, torch.flip, torch.roll, torch.topk,
                   torch.argmax, torch.argmin, torch.cummax, torch.cummin)  # fmt: skip
ORDER_METHODS = ("sort", "argsort", "cumsum", "cumprod", "flip", "roll", "topk", "argmax", "argmin", "cummax",
                 "cummin")  # fmt: skip


def _dims(dim: Any, ndim: int) -> list[int] | None:
    """Normalised reduction dims; None means every dim."""
    if dim is None:
        return None
    if isinstance(dim, int):
        dim = [dim]
    if isinstance(dim, (list, tuple)) and len(dim) == 0:
        return None
    return sorted({int(d) % ndim for d in dim}) if ndim else []


def pooling(k: int):
    """The rule of a pooling or resampling operation over the last ``k`` axes (-1: all after the channels)."""

    def rule(call: TraceCall) -> Any:
        x, lx = call.first()
        n = max(x.ndim - 2, 1) if k < 0 else k
        if any(a is not None for a in lx[len(lx) - n :]):
            raise TraceError(f"unsupported {call.where()}: it pools over an axis that carries permuted units")
        call.role = Role.PASS
        return call.label_like(lx)

    rule.__name__ = rule.__qualname__ = f"pooling({k})"
    return rule


def reduce(call: TraceCall) -> Label:
    x, lx = call.first()
    out = call.out_tensor()
    if call.target_name == "norm":
        dim = call.kwargs.get("dim", call.args[2] if len(call.args) > 2 else None)
    else:
        dim = call.kwargs.get("dim", call.kwargs.get("axis"))
        arg = call.args[1] if len(call.args) > 1 else None
        if dim is None and isinstance(arg, (int, list, tuple)) and not isinstance(arg, bool):
            dim = arg
    dims = _dims(dim, x.ndim)
    dims = list(range(x.ndim)) if dims is None else dims
    call.role = Role.PASS
    return reduced(lx, dims, keepdim=out.ndim == x.ndim)


def reduced(lx: Label, dims: Any, keepdim: bool) -> Label:
    """The label of a reduction of ``lx`` over ``dims``: sums, means, maxima and norms over units are invariant
    under a permutation of those units, so the reduced axes go (or stay, with one entry, under ``keepdim``)."""
    if keepdim:
        return Label(None if i in dims else a for i, a in enumerate(lx))
    return Label(a for i, a in enumerate(lx) if i not in dims)


def max_min(call: TraceCall) -> Any:
    x, lx = call.first()
    other = call.get(1, "other", call.get(1, "dim"))
    if isinstance(other, torch.Tensor):
        return elementwise_with_role(call, Role.NONLINEAR)
    if other is None:
        return call.invariant()  # the maximum of everything: invariant
    d = int(other) % x.ndim
    if lx[d] is not None:
        raise TraceError(
            f"unsupported {call.where()} along an axis of permuted units: the indices it returns depend on the "
            "order of the units (use amax/amin for the values alone)"
        )
    keep = bool(call.get(2, "keepdim", False))
    lab = Label(lx) if keep else Label(a for i, a in enumerate(lx) if i != d)
    return call.label_like(lab)


def order_dependent(call: TraceCall) -> Any:
    x, lx = call.first()
    name = call.target_name
    if name in ("flip", "roll"):
        dims = call.get(1 if name == "flip" else 2, "dims")
        dims = list(range(x.ndim)) if dims is None and name == "flip" else _dims(dims, x.ndim)
        if dims is None:  # roll without dims rolls the flattened tensor
            dims = list(range(x.ndim))
    elif name == "topk":
        dims = _dims(call.get(2, "dim", -1), x.ndim)
    elif name in ("argmax", "argmin"):
        dims = _dims(call.get(1, "dim"), x.ndim)
        dims = list(range(x.ndim)) if dims is None else dims
    else:
        dims = _dims(call.get(1, "dim", -1), x.ndim)
    bad = [d for d in dims if lx[d] is not None]
    if bad:
        raise TraceError(
            f"unsupported {call.where()} along axis {bad[0]}, which carries permuted units: its result depends on "
            "the order of the units"
        )
    out = call.result
    if name in ("argmax", "argmin"):
        keep = isinstance(out, torch.Tensor) and out.ndim == x.ndim
        if keep:
            return Label(None if i in dims else a for i, a in enumerate(lx))
        return Label(a for i, a in enumerate(lx) if i not in dims)
    call.role = Role.PASS
    return call.label_like(lx)


for _target, _k in {**POOL_MODULES, **POOL_FUNCTIONS}.items():
    register_all([_target], pooling(_k))
register_all(REDUCE_FUNCTIONS + REDUCE_METHODS, reduce)
register_all((torch.max, torch.min, "max", "min"), max_min)
register_all(ORDER_FUNCTIONS + ORDER_METHODS, order_dependent)
