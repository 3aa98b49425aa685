"""``index_select`` of CPU tensors along an axis other than the first, by pyperm's compiled core.

torch's CPU ``index_select`` along an inner axis copies entry by entry on one thread: taking a
convolution's (1024, 1024, 3, 3) weight along its input channels costs 13 ms against 1.7 ms for
a plain copy, a bfloat16 linear layer's columns 6 ms against 0.2 ms. The core copies each unit
(the entries after the axis) as one run of bytes, prefetching the next row, over torch's
threads: 2-3 ms and 0.7-1.2 ms (csrc/common/gather.cpp). Weight matching gathers B this way at
every rebuild and correction of a similarity, and permuting a model does too.
"""

from __future__ import annotations

import math

import torch

from pyperm._ext import core

__all__ = ["index_select"]


def index_select(tensor: torch.Tensor, axis: int, index: torch.Tensor, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.index_select(tensor, axis, index, out=out)``: the same result (an index out of range
    raises IndexError here, RuntimeError in torch).

    The core takes it when it can read and write the tensors in place: a contiguous CPU tensor
    outside autograd, an inner axis, a contiguous ``out`` of the result's shape and dtype (or none);
    torch takes every other case (CUDA tensors, whose gathers run at the device's bandwidth).
    """
    axis = axis % tensor.ndim if tensor.ndim else axis
    if not _in_place(tensor, axis, index, out):
        if out is None:
            return torch.index_select(tensor, axis, index)
        return torch.index_select(tensor, axis, index, out=out)
    shape = (*tensor.shape[:axis], index.numel(), *tensor.shape[axis + 1:])
    if out is None:
        out = torch.empty(shape, dtype=tensor.dtype)
    outer = math.prod(tensor.shape[:axis])
    src = tensor.detach().reshape(outer, tensor.shape[axis], -1).view(torch.uint8)
    dst = out.view(outer, index.numel(), -1).view(torch.uint8)
    core.gather_units(src.numpy(), index.reshape(-1).to(torch.int64).contiguous().numpy(), dst.numpy(),
                      torch.get_num_threads())
    return out


def _in_place(tensor: torch.Tensor, axis: int, index: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether the core can take this gather (else torch does)."""
    if not (0 < axis < tensor.ndim and tensor.device.type == "cpu" and index.device.type == "cpu"):
        return False
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():
        return False
    if tensor.numel() == 0 or index.ndim > 1 or index.numel() == 0 or index.dtype not in (torch.int64, torch.int32):
        return False
    if tensor.requires_grad and torch.is_grad_enabled():
        return False
    if not tensor.is_contiguous():
        return False
    if out is None:
        return True
    if out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        return False  # writing into the tensor it reads: torch refuses it
    shape = (*tensor.shape[:axis], index.numel(), *tensor.shape[axis + 1:])
    return (out.device.type == "cpu" and out.dtype == tensor.dtype and tuple(out.shape) == shape
            and out.is_contiguous() and not out.requires_grad and out.layout == torch.strided)  # fmt: skip
