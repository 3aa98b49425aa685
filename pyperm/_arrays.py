"""Array plumbing shared by the solvers: numpy and torch in, the same kind out.

torch is never imported here unless the caller already passed a torch tensor, so the
solvers need numpy alone.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_cuda_array(x: Any) -> bool:
    """True for a torch CUDA tensor or any object exposing ``__cuda_array_interface__``."""
    if is_torch_tensor(x):
        return x.device.type == "cuda"
    return hasattr(x, "__cuda_array_interface__")


def to_numpy(x: Any, name: str) -> np.ndarray:
    """A numpy view (or copy) of a CPU array-like; rejects device arrays it cannot read."""
    if is_torch_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name} is on device {x.device}; pass a CPU tensor or a CUDA tensor")
        return x.detach().resolve_conj().resolve_neg().numpy()
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except Exception as exc:  # ragged lists, objects numpy cannot read
        raise ValueError(f"{name} could not be read as an array: {exc}") from None


def real_float_array(x: Any, name: str, ndim: int | tuple[int, ...]) -> np.ndarray:
    """Validates and converts to a C-contiguous float32/float64 array.

    float32 and float64 keep their precision; bool, integers and other real floats go
    to float64. Wrong rank or a non-real dtype raises ValueError naming ``name``.
    """
    arr = to_numpy(x, name)
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if arr.ndim not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be a {want} array, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "c":
        raise ValueError(f"{name} must be real, got complex dtype {arr.dtype}")
    if kind not in "biuf":
        raise ValueError(f"{name} must contain numerical entries, got dtype {arr.dtype}")
    if arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float64)
    return np.ascontiguousarray(arr)


def check_threads(threads: Any) -> int:
    """A ``threads=`` argument: None gives 0 (all hardware threads), else a positive int."""
    if threads is None:
        return 0
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)):
        raise TypeError(f"threads must be a positive int or None, got {type(threads).__name__}")
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    return int(threads)


def like(template: Any, *arrays: np.ndarray):
    """Returns ``arrays`` as torch tensors on ``template``'s device when it was a tensor, else unchanged."""
    if is_torch_tensor(template):
        import torch

        out = tuple(torch.from_numpy(np.ascontiguousarray(a)).to(template.device) for a in arrays)
    else:
        out = arrays
    return out[0] if len(out) == 1 else out
