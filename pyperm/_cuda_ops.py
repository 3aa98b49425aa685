"""The Python side of the CUDA kernels: device arrays in, raw pointers to the core, device arrays out.

The compiled ``pyperm._cuda`` module never links libtorch. It takes device pointers (as
ints), shapes, element strides, the device index and the caller's stream. This module gets
them from

- torch CUDA tensors (the stream is ``torch.cuda.current_stream(device)``),
- objects exposing ``__cuda_array_interface__`` (CuPy, Numba, ...; the stream is the one the
  interface names, or the legacy default stream when it names none),
- objects exposing DLPack on a CUDA device (read through ``torch.from_dlpack``),

and allocates the outputs with the input's own library: torch tensors for torch input,
CuPy arrays for CuPy input, torch tensors otherwise. Every solve reads a status flag back
from the device, so each call synchronises the stream it ran on before returning.

torch is imported only when an input needs it; nothing here runs at ``import pyperm``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyperm._device import cuda_module

__all__ = [
    "batch_linear_sum_assignment",
    "is_cuda_input",
    "is_dlpack_cuda",
    "linear_sum_assignment",
    "solve_square_warm",
]

_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged
_CAI_DEFAULT_STREAM = 0  # legacy default stream: orders with every blocking stream


def is_dlpack_cuda(x: Any) -> bool:
    """True for an object whose DLPack device is a CUDA GPU (and that is not a torch tensor)."""
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None or not callable(dev):
        return False
    try:
        kind = int(dev()[0])
    except Exception:  # a broken __dlpack_device__ is not a CUDA array
        return False
    return kind in _DLPACK_CUDA_DEVICES


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "cupy"


def is_cuda_input(x: Any) -> bool:
    """Whether ``x`` is a device array the CUDA kernels take."""
    if _is_torch(x):
        return x.device.type == "cuda"
    return hasattr(x, "__cuda_array_interface__") or is_dlpack_cuda(x)


def _require_torch(what: str):
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is present wherever CUDA tests run
        raise TypeError(f"{what} needs torch to read this kind of device array; install torch") from None
    return torch


@dataclass
class _Dev:
    """A device array the kernels can read: pointer, shape, element strides, dtype, device, stream."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # "float32" or "float64"
    device: int
    stream: int
    owner: Any  # keeps the memory alive (the original or a converted copy)
    kind: str  # "torch" or "cupy": which library allocates the outputs


def _check_kind(dtype: np.dtype, name: str) -> None:
    if dtype.kind == "c":
        raise ValueError(f"{name} must be real, got complex dtype {dtype}")
    if dtype.kind not in "biuf":
        raise ValueError(f"{name} must contain numerical entries, got dtype {dtype}")


def _check_ndim(shape: tuple[int, ...], ndim: int, name: str) -> None:
    if len(shape) != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got shape {tuple(shape)}")


def _from_torch(t: Any, name: str, ndim: int) -> _Dev:
    torch = sys.modules["torch"]
    if t.device.type != "cuda":
        raise ValueError(f"{name} is on device {t.device}, not a CUDA device")
    _check_ndim(tuple(t.shape), ndim, name)
    t = t.detach()
    if t.is_complex():
        raise ValueError(f"{name} must be real, got complex dtype {t.dtype}")
    if t.is_quantized:
        raise ValueError(f"{name} must contain numerical entries, got dtype {t.dtype}")
    t = t.resolve_neg()
    if t.dtype not in (torch.float32, torch.float64):
        t = t.to(torch.float64)  # bool, integers, half precision: solved in float64 like the CPU path
    dtype = "float32" if t.dtype == torch.float32 else "float64"
    device = t.device.index if t.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(t.device).cuda_stream
    return _Dev(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, device, int(stream), t, "torch")


def _from_cai(x: Any, name: str, ndim: int) -> _Dev:
    cai = x.__cuda_array_interface__
    shape = tuple(int(s) for s in cai["shape"])
    _check_ndim(shape, ndim, name)
    dtype = np.dtype(cai["typestr"])
    _check_kind(dtype, name)
    kind = "cupy" if _is_cupy(x) else "torch"
    if dtype not in (np.float32, np.float64) or dtype.byteorder not in ("=", "|", "<"):
        # Convert on the device with the array's own library (or torch).
        if kind == "cupy":
            import cupy

            return _from_cai(cupy.ascontiguousarray(x, dtype=cupy.float64), name, ndim)
        torch = _require_torch(f"{name} of dtype {dtype}")
        return _from_torch(torch.as_tensor(x, device="cuda").to(torch.float64), name, ndim)
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
    ptr = int(cai["data"][0])
    stream = cai.get("stream")
    stream = _CAI_DEFAULT_STREAM if stream is None else int(stream)
    device = cuda_module().pointer_device(ptr) if ptr else 0
    if device < 0:
        raise ValueError(f"{name} exposes __cuda_array_interface__ but its pointer is not CUDA device memory")
    return _Dev(ptr, shape, elem_strides, "float32" if dtype == np.float32 else "float64", device, stream, x, kind)


def _as_device(x: Any, name: str, ndim: int) -> _Dev:
    if _is_torch(x):
        return _from_torch(x, name, ndim)
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cai(x, name, ndim)
    if is_dlpack_cuda(x):
        torch = _require_torch(f"{name} (a DLPack array)")
        return _from_torch(torch.from_dlpack(x), name, ndim)
    raise TypeError(f"{name} is not a CUDA array (torch tensor, __cuda_array_interface__ or DLPack)")


def _empty_int64(src: _Dev, shape: tuple[int, ...]) -> tuple[Any, int]:
    """An int64 device array of ``shape`` next to ``src``, and its pointer."""
    if src.kind == "cupy":
        import cupy

        with cupy.cuda.Device(src.device):
            out = cupy.empty(shape, dtype=cupy.int64)
        return out, int(out.data.ptr)
    torch = _require_torch("the output arrays")
    out = torch.empty(shape, dtype=torch.int64, device=torch.device("cuda", src.device))
    return out, int(out.data_ptr())


def _check_maximize(maximize: Any) -> bool:
    if not isinstance(maximize, (bool, np.bool_)):
        raise TypeError(f"maximize must be a bool, got {type(maximize).__name__}")
    return bool(maximize)


def _solve(costs: Any, maximize: bool, name: str, batched: bool, tuning: dict[str, Any]):
    src = _as_device(costs, name, 3 if batched else 2)
    if batched:
        batch, n_rows, n_cols = src.shape
        sb, sr, sc = src.strides
    else:
        batch, (n_rows, n_cols) = 1, src.shape
        sb, (sr, sc) = 0, src.strides
    k = min(n_rows, n_cols)
    out_shape = (batch, k) if batched else (k,)
    rows, rows_ptr = _empty_int64(src, out_shape)
    cols, cols_ptr = _empty_int64(src, out_shape)
    stats = None
    if batch > 0 and k > 0:
        stats = cuda_module().lap_solve_batch(
            src.ptr,
            src.dtype,
            batch,
            n_rows,
            n_cols,
            sb,
            sr,
            sc,
            maximize,
            rows_ptr,
            cols_ptr,
            src.device,
            src.stream,
            batched,
            stats=bool(tuning.pop("return_stats", False)),
            **tuning,
        )
    return rows, cols, stats


def _tuning(
    method: str, threads: int, stage: int, state_smem: int, max_rounds: int, patience: int, return_stats: bool
) -> dict:
    if method not in ("auto", "block", "device"):
        raise ValueError(f"method must be 'auto', 'block' or 'device', got {method!r}")
    return {
        "method": method,
        "threads": int(threads),
        "stage": int(stage),
        "state_smem": int(state_smem),
        "max_rounds": int(max_rounds),
        "patience": int(patience),
        "return_stats": bool(return_stats),
    }


def linear_sum_assignment(
    cost: Any,
    maximize: bool = False,
    *,
    method: str = "auto",
    threads: int = 0,
    stage: int = -1,
    state_smem: int = -1,
    max_rounds: int = -1,
    patience: int = -1,
    return_stats: bool = False,
):
    """Solve one assignment problem on its CUDA device (see :func:`pyperm.linear_sum_assignment`).

    The keyword arguments tune the kernels (benchmarks and tests use them; the defaults
    choose automatically): ``method`` "block" (one thread block per problem) or "device"
    (whole-device initialisation, then one block per problem), ``threads`` per block,
    ``stage`` the matrix in shared memory (-1 auto, 0, 1), ``state_smem`` the solver state in
    shared memory (-1 auto, 0, 1), ``max_rounds`` and ``patience`` of
    the parallel bidding rounds. ``return_stats`` adds a dict describing what ran.

    Synchronises the stream: the validity / feasibility flag is read back from the device.
    """
    maximize = _check_maximize(maximize)
    rows, cols, stats = _solve(
        cost, maximize, "cost", False, _tuning(method, threads, stage, state_smem, max_rounds, patience, return_stats)
    )
    return (rows, cols, stats) if return_stats else (rows, cols)


def batch_linear_sum_assignment(
    costs: Any,
    maximize: bool = False,
    *,
    method: str = "auto",
    threads: int = 0,
    stage: int = -1,
    state_smem: int = -1,
    max_rounds: int = -1,
    patience: int = -1,
    return_stats: bool = False,
):
    """Solve a (B, n, m) stack on its CUDA device (see :func:`pyperm.batch_linear_sum_assignment`).

    Keyword arguments as :func:`linear_sum_assignment`. Synchronises the stream.
    """
    maximize = _check_maximize(maximize)
    rows, cols, stats = _solve(
        costs, maximize, "costs", True, _tuning(method, threads, stage, state_smem, max_rounds, patience, return_stats)
    )
    return (rows, cols, stats) if return_stats else (rows, cols)


def solve_square_warm(
    cost: Any,
    v: Any,
    *,
    method: str = "auto",
    threads: int = 0,
    stage: int = -1,
    state_smem: int = -1,
    max_rounds: int = -1,
    patience: int = -1,
):
    """Square minimisation warm-started from column duals, on the device (torch tensors).

    The device twin of the CPU core's ``solve_square_warm``, for sequences of similar
    problems (Birkhoff-von Neumann terms, PAM permutation steps): pass the previous solve's
    duals ``v`` and the next solve starts close to its answer.

    Parameters
    ----------
    cost : (n, n) or (B, n, n) torch.Tensor, float32 or float64, on a CUDA device
        Finite entries, or ``+inf`` for forbidden pairs (NaN is not checked here).
    v : (n,) or (B, n) torch.Tensor of the same dtype and device
        Column duals, any finite values (zeros for a cold start); updated in place with the
        final duals.

    Returns
    -------
    col_of_row : (n,) or (B, n) torch.Tensor, int64
        The column assigned to each row.

    Raises
    ------
    ValueError
        Mismatched shapes, dtypes or devices, non-finite ``v``, or "cost matrix is infeasible".
    TypeError
        ``cost`` or ``v`` is not a torch tensor.

    Examples
    --------
    >>> import torch, pyperm._cuda_ops as ops  # doctest: +SKIP
    >>> c = torch.rand(64, 64, device="cuda"); v = torch.zeros(64, device="cuda")  # doctest: +SKIP
    >>> cols = ops.solve_square_warm(c, v)  # doctest: +SKIP
    """
    if not (_is_torch(cost) and _is_torch(v)):
        raise TypeError("solve_square_warm takes torch tensors for cost and v")
    torch = sys.modules["torch"]
    batched = cost.dim() == 3
    if cost.dim() not in (2, 3) or cost.shape[-1] != cost.shape[-2]:
        raise ValueError(f"cost must be (n, n) or (B, n, n), got shape {tuple(cost.shape)}")
    if cost.device.type != "cuda" or v.device != cost.device:
        raise ValueError(f"cost and v must be on the same CUDA device, got {cost.device} and {v.device}")
    if cost.dtype not in (torch.float32, torch.float64) or v.dtype != cost.dtype:
        raise ValueError(f"cost and v must both be float32 or both float64, got {cost.dtype} and {v.dtype}")
    if tuple(v.shape) != tuple(cost.shape[:-1]):
        raise ValueError(f"v must have shape {tuple(cost.shape[:-1])}, got {tuple(v.shape)}")
    if not v.is_contiguous():
        raise ValueError("v must be contiguous (it is updated in place)")
    if not bool(torch.isfinite(v).all()):
        raise ValueError("v must be finite")
    cost = cost.detach().contiguous()
    n = cost.shape[-1]
    batch = cost.shape[0] if batched else 1
    out = torch.empty(tuple(cost.shape[:-1]), dtype=torch.int64, device=cost.device)
    if batch == 0 or n == 0:
        return out
    tuning = _tuning(method, threads, stage, state_smem, max_rounds, patience, False)
    tuning.pop("return_stats")
    cuda_module().lap_solve_square_warm(
        cost.data_ptr(),
        "float32" if cost.dtype == torch.float32 else "float64",
        batch,
        n,
        v.data_ptr(),
        out.data_ptr(),
        cost.device.index if cost.device.index is not None else torch.cuda.current_device(),
        int(torch.cuda.current_stream(cost.device).cuda_stream),
        batched,
        **tuning,
    )
    return out
