"""CUDA arrays as the compiled ``pyperm._cuda`` module takes them: raw pointers, not tensors.

``pyperm._cuda`` never links libtorch. It takes device pointers (as ints), shapes, element
strides, the device index and the caller's stream. This module gets them from

- torch CUDA tensors (the stream is ``torch.cuda.current_stream(device)``),
- objects exposing ``__cuda_array_interface__`` (CuPy, Numba, ...; the stream is the one the
  interface names, or the legacy default stream when it names none),
- objects exposing DLPack on a CUDA device (read through ``torch.from_dlpack``),

and allocates outputs with the input's own library: torch tensors for torch input, CuPy
arrays for CuPy input, torch tensors otherwise. The ``_cuda.py`` backend of each kernel
family is its only user; torch is imported only when an input needs it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyperm._arrays import check_ndim, check_real_dtype, is_dlpack_cuda, is_torch_tensor, real_float_tensor
from pyperm._ext import cuda_module

__all__ = [
    "DeviceArray", "as_cuda_tensor", "as_device_array", "dtype_name", "empty_int64_like", "like_input", "require_torch",
    "torch_launch",
]

_CAI_DEFAULT_STREAM = 0  # legacy default stream: orders with every blocking stream


def require_torch(what: str):
    """torch, or a TypeError saying that ``what`` needs it."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is present wherever CUDA tests run
        raise TypeError(f"{what} needs torch to read this kind of device array; install torch") from None
    return torch


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "cupy"


@dataclass
class DeviceArray:
    """A device array the kernels can read: pointer, shape, element strides, dtype, device, stream."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # "float32" or "float64"
    device: int
    stream: int
    owner: Any  # keeps the memory alive (the original or a converted copy)
    kind: str  # "torch" or "cupy": which library allocates the outputs


def dtype_name(t: Any) -> str:
    """The kernels' name of a float32/float64 torch tensor's dtype."""
    return "float32" if t.dtype == sys.modules["torch"].float32 else "float64"


def torch_launch(t: Any) -> tuple[int, int]:
    """(device index, current stream handle) of a torch CUDA tensor: where its kernels run."""
    torch = sys.modules["torch"]
    device = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return device, int(torch.cuda.current_stream(t.device).cuda_stream)


def _from_torch(t: Any, name: str, ndim: int) -> DeviceArray:
    if t.device.type != "cuda":
        raise ValueError(f"{name} is on device {t.device}, not a CUDA device")
    check_ndim(tuple(t.shape), ndim, name)
    # bool, integers, half precision: solved in float64 like the CPU path.
    t = real_float_tensor(t.detach(), name).resolve_neg()
    device, stream = torch_launch(t)
    return DeviceArray(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype_name(t), device, stream, t, "torch")


def _checked_cai(x: Any, name: str, ndim: int) -> tuple[dict, tuple[int, ...], np.dtype, int, int]:
    """``x``'s ``__cuda_array_interface__`` with its rank, dtype and pointer checked (before any device
    access): the interface, shape, dtype, pointer and device index."""
    cai = x.__cuda_array_interface__
    shape = tuple(int(s) for s in cai["shape"])
    check_ndim(shape, ndim, name)
    dtype = np.dtype(cai["typestr"])
    check_real_dtype(dtype, name)
    ptr = int(cai["data"][0])
    device = cuda_module().pointer_device(ptr) if ptr else 0
    if device < 0:
        raise ValueError(f"{name} exposes __cuda_array_interface__ but its pointer is not CUDA device memory")
    return cai, shape, dtype, ptr, device


def _from_cai(x: Any, name: str, ndim: int) -> DeviceArray:
    cai, shape, dtype, ptr, device = _checked_cai(x, name, ndim)
    kind = "cupy" if _is_cupy(x) else "torch"
    stream = cai.get("stream")
    if dtype not in (np.float32, np.float64) or dtype.byteorder not in ("=", "|", "<"):
        # Convert with the array's own library (or torch), on the array's device, after the
        # stream it names (its producer may still be writing: the protocol asks the consumer to wait).
        if kind == "cupy":
            import cupy

            with cupy.cuda.Device(device):
                if stream:
                    cupy.cuda.ExternalStream(int(stream)).synchronize()
                return _from_cai(cupy.ascontiguousarray(x, dtype=cupy.float64), name, ndim)
        torch = require_torch(f"{name} of dtype {dtype}")
        if stream:
            torch.cuda.ExternalStream(int(stream), device=torch.device("cuda", device)).synchronize()
        return _from_torch(torch.as_tensor(x, device=torch.device("cuda", device)).to(torch.float64), name, ndim)
    itemsize = dtype.itemsize
    if cai.get("strides") is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        elem_strides = tuple(reversed(strides))
    else:
        byte_strides = tuple(int(s) for s in cai["strides"])
        if any(s % itemsize for s in byte_strides):
            raise ValueError(f"{name} has strides {byte_strides} that are not multiples of its item size")
        elem_strides = tuple(s // itemsize for s in byte_strides)
    stream = _CAI_DEFAULT_STREAM if stream is None else int(stream)  # the kernels run on the named stream
    dt = "float32" if dtype == np.float32 else "float64"
    return DeviceArray(ptr, shape, elem_strides, dt, device, stream, x, kind)


def as_device_array(x: Any, name: str, ndim: int) -> DeviceArray:
    """Validates rank and dtype of a CUDA array (before any device access) and returns its view."""
    if is_torch_tensor(x):
        return _from_torch(x, name, ndim)
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cai(x, name, ndim)
    if is_dlpack_cuda(x):
        torch = require_torch(f"{name} (a DLPack array)")
        return _from_torch(torch.from_dlpack(x), name, ndim)
    raise TypeError(f"{name} is not a CUDA array (torch tensor, __cuda_array_interface__ or DLPack)")


def empty_int64_like(src: DeviceArray, shape: tuple[int, ...]) -> tuple[Any, int]:
    """An int64 device array of ``shape`` next to ``src``, made by its library, and its pointer."""
    if src.kind == "cupy":
        import cupy

        with cupy.cuda.Device(src.device):
            out = cupy.empty(shape, dtype=cupy.int64)
        return out, int(out.data.ptr)
    torch = require_torch("the output arrays")
    out = torch.empty(shape, dtype=torch.int64, device=torch.device("cuda", src.device))
    return out, int(out.data_ptr())


def as_cuda_tensor(x: Any, name: str, ndim: int) -> tuple[Any, str]:
    """A CUDA array as a real float32/float64 torch tensor on its device (no copy where torch can
    read it in place), and which library its outputs belong to ("torch" or "cupy").

    For code that works in torch operations (the pipeline forms of the assignment solver);
    the rank and dtype are checked before any device access, as in :func:`as_device_array`.
    """
    cuda_module()  # a RuntimeError saying why, before anything touches the device
    torch = require_torch(name)
    if is_torch_tensor(x):
        if x.device.type != "cuda":
            raise ValueError(f"{name} is on device {x.device}, not a CUDA device")
        t, kind = x, "torch"
    else:
        if hasattr(x, "__cuda_array_interface__"):
            _checked_cai(x, name, ndim)
        t = torch.from_dlpack(x) if hasattr(x, "__dlpack__") else torch.as_tensor(x, device="cuda")
        kind = "cupy" if _is_cupy(x) else "torch"
    check_ndim(tuple(t.shape), ndim, name)
    return real_float_tensor(t.detach(), name).resolve_neg(), kind


def like_input(kind: str, t: Any) -> Any:
    """``t`` (a torch CUDA tensor) as the library ``kind`` names: CuPy input gets CuPy output."""
    if kind == "cupy":
        import cupy

        return cupy.from_dlpack(t)
    return t
