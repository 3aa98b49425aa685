"""What kind of array the caller passed, and the host-side conversions that follow from it.

Every public function classifies its input here, once: a CUDA array (a torch CUDA tensor,
an object exposing ``__cuda_array_interface__``, or one whose DLPack device is a CUDA GPU)
goes to the CUDA backend of its kernel family; anything else is read on the host as numpy
(torch CPU tensors without a copy). torch is never imported here unless the caller already
passed a torch tensor, so the solvers need numpy alone.

Errors follow scipy where scipy defines them (``scipy.optimize.linear_sum_assignment``'s
tests match on its messages), and always name the argument.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = [
    "ArrayDTypeError",
    "check_finite",
    "check_ndim",
    "check_real_dtype",
    "check_square",
    "is_cuda_input",
    "is_dlpack_cuda",
    "is_torch_tensor",
    "like",
    "real_float_array",
    "real_float_tensor",
    "to_numpy",
]

_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged


class ArrayDTypeError(TypeError, ValueError):
    """An array whose dtype cannot be read as real numbers (strings, objects, complex).

    scipy raises TypeError here; pyperm raised ValueError before it followed scipy, so this
    is both, and code catching either keeps working.
    """


def is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_dlpack_cuda(x: Any) -> bool:
    """True for an object whose DLPack device is a CUDA GPU."""
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None or not callable(dev):
        return False
    try:
        kind = int(dev()[0])
    except Exception:  # a broken __dlpack_device__ is not a CUDA array
        return False
    return kind in _DLPACK_CUDA_DEVICES


def is_cuda_input(x: Any) -> bool:
    """Whether ``x`` lives on a CUDA device, so that a CUDA backend must take it."""
    if is_torch_tensor(x):
        return x.device.type == "cuda"
    return hasattr(x, "__cuda_array_interface__") or is_dlpack_cuda(x)


def to_numpy(x: Any, name: str) -> np.ndarray:
    """A numpy view (or copy) of a host array-like; rejects device arrays it cannot read."""
    if is_torch_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name} is on device {x.device}; pass a CPU tensor or a CUDA tensor")
        if x.is_complex():
            raise ArrayDTypeError(f"{name} must be real, got complex dtype {x.dtype}")
        if x.is_quantized:
            raise ArrayDTypeError(f"{name} must contain numerical entries, got dtype {x.dtype}")
        x = x.detach()
        torch = sys.modules["torch"]
        if x.is_floating_point() and x.dtype not in (torch.float16, torch.float32, torch.float64):
            # bfloat16 and the float8 formats have no numpy dtype: read them in float64 (exact).
            x = x.to(torch.float64)
        return x.resolve_conj().resolve_neg().numpy()
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except Exception as exc:  # ragged lists, objects numpy cannot read
        raise ValueError(f"{name} could not be read as an array: {exc}") from None


def check_real_dtype(dtype: np.dtype, name: str) -> None:
    """Raises ArrayDTypeError, with scipy's wording, unless ``dtype`` holds real numbers."""
    kind = dtype.kind
    if kind in "biuf":
        return
    cast = f"Cannot cast array data from {dtype!r} to dtype('float64') according to the rule 'safe'"
    if kind == "c":
        raise ArrayDTypeError(f"{name} must be real, got complex dtype {dtype} ({cast})")
    raise ArrayDTypeError(f"{name} must contain numerical entries, got dtype {dtype} ({cast})")


def check_ndim(shape: tuple[int, ...], ndim: int | tuple[int, ...], name: str) -> None:
    """Raises ValueError unless ``shape`` has one of the ranks ``ndim``."""
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if len(shape) in dims:
        return
    want = " or ".join(f"{d}-D" for d in dims)
    scipy_wording = " (expected a matrix)" if dims == (2,) else ""
    raise ValueError(f"{name} must be a {want} array{scipy_wording}, got shape {tuple(shape)}")


def check_square(shape: tuple[int, ...], name: str) -> None:
    """Raises ValueError unless the last two dimensions of ``shape`` (at least 2-D) are equal."""
    shape = tuple(shape)
    if shape[-1] != shape[-2]:
        where = "" if len(shape) == 2 else " in its last two dimensions"
        raise ValueError(f"{name} must be square{where}, got shape {shape}")


def check_finite(x: Any, name: str) -> None:
    """Raises ValueError if the numpy array or torch tensor ``x`` holds NaN or an infinity (read on its device)."""
    finite = sys.modules["torch"].isfinite(x).all() if is_torch_tensor(x) else np.isfinite(x).all()
    if not bool(finite):
        raise ValueError(f"{name} contains NaN or infinite entries")


def real_float_tensor(t: Any, name: str) -> Any:
    """A torch tensor of real numbers as float32/float64, on its device (autograd kept).

    float32 and float64 keep their precision; bool, integers and half precision go to
    float64. Complex and quantized tensors raise ArrayDTypeError naming ``name``.
    """
    torch = sys.modules["torch"]
    if t.is_complex():
        raise ArrayDTypeError(f"{name} must be real, got complex dtype {t.dtype}")
    if t.is_quantized:
        raise ArrayDTypeError(f"{name} must contain numerical entries, got dtype {t.dtype}")
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float64)


def real_float_array(x: Any, name: str, ndim: int | tuple[int, ...]) -> np.ndarray:
    """Validates and converts to a C-contiguous float32/float64 array.

    float32 and float64 keep their precision; bool, integers and other real floats go
    to float64. Wrong rank raises ValueError, a non-real dtype ArrayDTypeError, both
    naming ``name``.
    """
    arr = to_numpy(x, name)
    check_ndim(arr.shape, ndim, name)
    check_real_dtype(arr.dtype, name)
    if arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float64)
    if not (arr.flags.c_contiguous and arr.flags.aligned and arr.dtype.isnative):
        # The core reads native, aligned entries in place; a fresh copy is both.
        arr = np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C")
    return arr


def like(template: Any, *arrays: np.ndarray):
    """Returns ``arrays`` as torch tensors on ``template``'s device when it was a tensor, else unchanged."""
    if is_torch_tensor(template):
        import torch

        out = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
        if template.device.type != "cpu":  # .to() of the same device still costs a dispatch
            out = tuple(t.to(template.device) for t in out)
    else:
        out = arrays
    return out[0] if len(out) == 1 else out
