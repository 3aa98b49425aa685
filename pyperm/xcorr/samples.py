"""Activations as the accumulator reads them: (samples, channels) host arrays.

:func:`conv_to_samples` turns convolution activations into samples; the other functions
validate what :class:`pyperm.CrossCorrelation` is given, with messages naming the argument.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pyperm._arrays import check_real_dtype, is_torch_tensor, to_numpy

__all__ = ["as_pair", "as_samples", "as_vector", "conv_to_samples"]


def conv_to_samples(x: Any) -> Any:
    """Turn ``(N, C, *spatial)`` activations into ``(N * prod(spatial), C)`` samples.

    Every spatial position of every image is one sample of the C channels, as Tatro et al.
    align convolutional filters in "Optimizing Mode Connectivity via Neuron Alignment"
    (NeurIPS 2020), so the result feeds :meth:`CrossCorrelation.update` with ``dim = C``.
    A 2-D (N, C) input is returned as is.

    Parameters
    ----------
    x : (N, C, ...) numpy.ndarray or torch.Tensor
        Channels-first activations, e.g. (N, C, H, W) from a Conv2d or (N, C, L) from a Conv1d.

    Returns
    -------
    (N * H * W, C) array of the same kind and dtype
        C-contiguous (a copy unless ``x`` was 2-D).

    Raises
    ------
    ValueError
        ``x`` has fewer than 2 dimensions.

    Examples
    --------
    >>> import numpy as np, pyperm
    >>> pyperm.conv_to_samples(np.zeros((8, 16, 5, 5))).shape
    (200, 16)
    """
    if is_torch_tensor(x):
        if x.ndim < 2:
            raise ValueError(f"x must have shape (N, C, ...), got {tuple(x.shape)}")
        if x.ndim == 2:
            return x
        return x.movedim(1, -1).reshape(-1, x.shape[1]).contiguous()
    arr = np.asarray(x)
    if arr.ndim < 2:
        raise ValueError(f"x must have shape (N, C, ...), got {arr.shape}")
    if arr.ndim == 2:
        return arr
    return np.ascontiguousarray(np.moveaxis(arr, 1, -1).reshape(-1, arr.shape[1]))


def _half_to_float(x: Any) -> Any:
    """torch half and bfloat16 have no numpy view; they are accumulated as float32."""
    if is_torch_tensor(x):
        import torch

        if x.dtype in (torch.float16, torch.bfloat16):
            return x.detach().float()
    return x


def as_samples(x: Any, name: str, dim: int | None, dim_name: str) -> np.ndarray:
    """A C-contiguous float32/float64 (samples, dim) view or copy of host array ``x``
    (the accumulator sends CUDA arrays to its device state before this)."""
    arr = to_numpy(_half_to_float(x), name)
    check_real_dtype(arr.dtype, name)
    if arr.ndim != 2:
        hint = " (use pyperm.conv_to_samples for (N, C, H, W) activations)" if arr.ndim == 4 else ""
        raise ValueError(f"{name} must be a 2-D (samples, {dim_name}) array, got shape {arr.shape}{hint}")
    if dim is not None and arr.shape[1] != dim:
        raise ValueError(f"{name} has {arr.shape[1]} channels (shape {arr.shape}) but {dim_name} is {dim}")
    if arr.dtype == np.float16:
        arr = arr.astype(np.float32)
    elif arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float64)
    if not arr.flags.aligned or arr.dtype.byteorder not in "=|":
        arr = arr.astype(arr.dtype.newbyteorder("="))  # an aligned, native-order copy
    return np.ascontiguousarray(arr)


def as_pair(xa: Any, xb: Any, dim_a: int, dim_b: int, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    a = as_samples(xa, f"{prefix}xa", dim_a, "dim_a")
    b = as_samples(xb, f"{prefix}xb", dim_b, "dim_b")
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"{prefix}xa and {prefix}xb must hold the same number of samples (rows), "
            f"got {a.shape[0]} and {b.shape[0]}"
        )
    if a.dtype != b.dtype:
        # One GEMM needs one precision: the wider one.
        a, b = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    return a, b


def as_vector(x: Any, name: str, dim: int | None) -> np.ndarray:
    arr = np.asarray(to_numpy(x, name))
    check_real_dtype(arr.dtype, name)
    if arr.ndim != 1 or (dim is not None and arr.shape[0] != dim):
        want = f"({dim},)" if dim is not None else "1-D"
        raise ValueError(f"{name} must have shape {want}, got {arr.shape}")
    return np.array(arr, dtype=np.float64)
