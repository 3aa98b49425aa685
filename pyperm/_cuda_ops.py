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
    "birkhoff_max_weight",
    "is_cuda_input",
    "is_dlpack_cuda",
    "linear_sum_assignment",
    "solve_square_warm",
    "xcorr_merge",
    "xcorr_new_state",
    "xcorr_update",
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


# --------------------------------------------------------------------------- BvN
def _torch_cuda_matrix(x: Any, name: str):
    """A torch CUDA tensor as float32/float64 (other real dtypes become float64)."""
    src = _as_device(x, name, 2)
    torch = sys.modules["torch"]
    t = src.owner if _is_torch(src.owner) else torch.as_tensor(src.owner, device=f"cuda:{src.device}")
    if t.dtype not in (torch.float32, torch.float64):
        t = t.to(torch.float64)
    return t.detach(), src.device, src.stream


def birkhoff_max_weight(
    D: Any, max_terms: int | None = None, tol: float = 1e-9, *, progress: Any = None
) -> tuple[Any, Any]:
    r"""Greedy max-weight Birkhoff-von Neumann decomposition on the device.

    The device twin of ``method="max-weight"`` in the CPU decomposition (Tatro et al.,
    eq. 54): each term is the perfect matching of largest total weight on the support of the
    residual :math:`R` (a warm-started assignment solve on the device with cost :math:`-R`,
    :math:`+\infty` off the support), its coefficient the smallest matched entry.

    Parameters
    ----------
    D : (n, n) torch.Tensor on a CUDA device
        A (nearly) doubly stochastic matrix; entries <= 0 are outside the support. The
        caller checks doubly-stochasticity; here only finiteness is checked.
    max_terms : int, optional
        Stop after this many terms (default: until the residual mass is at most ``tol``).
    tol : float, default 1e-9
        Stop when the residual mass :math:`\sum_{ij} R_{ij} / n` is at most ``tol``.
    progress : callable, optional
        Called after every term as ``progress(terms, coeff, residual_mass)``; returning
        False stops the decomposition.

    Returns
    -------
    coeffs : (k,) torch.Tensor of D's float dtype, on D's device
    perms : (k, n) torch.Tensor, int64, on D's device
        ``perms[t, i]`` is the column of row ``i`` in term ``t``.

    Raises
    ------
    ValueError
        ``D`` is not square, not finite, or ``max_terms`` / ``tol`` are out of range.

    Notes
    -----
    Every term synchronises the stream twice (the solver's status and the coefficient are
    read back), which the stopping rule needs anyway.

    Examples
    --------
    >>> import torch, pyperm._cuda_ops as ops  # doctest: +SKIP
    >>> D = torch.full((4, 4), 0.25, device="cuda", dtype=torch.float64)  # doctest: +SKIP
    >>> coeffs, perms = ops.birkhoff_max_weight(D)  # doctest: +SKIP
    >>> coeffs.tolist()  # doctest: +SKIP
    [0.25, 0.25, 0.25, 0.25]
    """
    R, device, stream = _torch_cuda_matrix(D, "D")
    torch = sys.modules["torch"]
    n = R.shape[0]
    if R.shape[1] != n:
        raise ValueError(f"D must be square, got shape {tuple(R.shape)}")
    if max_terms is not None and (isinstance(max_terms, bool) or int(max_terms) < 1):
        raise ValueError(f"max_terms must be a positive int or None, got {max_terms!r}")
    if not (float(tol) >= 0.0):
        raise ValueError(f"tol must be non-negative, got {tol!r}")
    if not bool(torch.isfinite(R).all()):
        raise ValueError("D contains NaN or infinity")
    dtype = "float32" if R.dtype == torch.float32 else "float64"
    coeffs: list[float] = []
    perms: list[Any] = []
    if n > 0:
        R = R.clamp_min(0).contiguous()  # a copy: D is never modified
        v = torch.zeros(n, dtype=R.dtype, device=R.device)
        cost = torch.empty_like(R)
        mod = cuda_module()
        limit = n * n if max_terms is None else int(max_terms)  # each term empties at least one entry
        for t in range(limit):
            mod.bvn_support_cost(R.data_ptr(), dtype, n, cost.data_ptr(), device, stream)
            perm = torch.empty(n, dtype=torch.int64, device=R.device)
            try:
                mod.lap_solve_square_warm(cost.data_ptr(), dtype, 1, n, v.data_ptr(), perm.data_ptr(), device,
                                          stream, False)
            except ValueError as exc:
                if "infeasible" not in str(exc):
                    raise
                break  # the residual's support has no perfect matching: only rounding noise is left
            alpha, mass = mod.bvn_subtract_term(R.data_ptr(), dtype, n, perm.data_ptr(), device, stream)
            coeffs.append(alpha)
            perms.append(perm)
            if progress is not None and progress(t + 1, alpha, mass) is False:
                break
            if mass <= tol:
                break
    out_perms = torch.stack(perms) if perms else torch.empty((0, n), dtype=torch.int64, device=R.device)
    return torch.tensor(coeffs, dtype=R.dtype, device=R.device), out_perms


# ----------------------------------------------------------------- cross-correlation
def xcorr_new_state(dim_a: int, dim_b: int, device: Any, dtype: Any = None) -> dict[str, Any]:
    """An empty device accumulator for :func:`xcorr_update`: float64 moments, float64 co-moment.

    Keys: ``count`` (int), ``moments_a`` (4, dim_a) and ``moments_b`` (4, dim_b) with rows
    mean, m2 (centred sum of squares), min, max, and ``comoment`` (dim_a, dim_b), the centred
    co-moment. Correlation is ``comoment / sqrt(m2_a[:, None] * m2_b[None, :])``.
    """
    torch = _require_torch("the cross-correlation accumulator")
    dtype = torch.float64 if dtype is None else dtype
    return {
        "count": 0,
        "moments_a": torch.zeros((4, dim_a), dtype=torch.float64, device=device),
        "moments_b": torch.zeros((4, dim_b), dtype=torch.float64, device=device),
        "comoment": torch.zeros((dim_a, dim_b), dtype=dtype, device=device),
    }


def _xcorr_side(x: Any):
    torch = sys.modules["torch"]
    t = x.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    elif t.dtype not in (torch.float32, torch.float64):
        t = t.double()
    if t.stride(1) != 1 or t.stride(0) < t.shape[1]:
        t = t.contiguous()
    return t


def xcorr_update(state: dict[str, Any], xa: Any, xb: Any) -> None:
    """Fold one batch of paired activations into a device accumulator, in place.

    The device twin of one ``CrossCorrelation.update``: the centring and moment kernels run
    on the device, the batch product is ``torch.matmul`` in the batch's precision, and the
    Chan merge into the float64 accumulator is a device kernel. Wiring it into
    ``pyperm.CrossCorrelation`` is left to that class.

    Parameters
    ----------
    state : dict
        From :func:`xcorr_new_state`.
    xa : (samples, dim_a) torch.Tensor on the accumulator's device
    xb : (samples, dim_b) torch.Tensor on the same device

    Raises
    ------
    ValueError
        Shapes that do not match the accumulator or each other, NaN or infinity in a batch,
        or moments that would overflow (the accumulator is then unchanged).
    """
    torch = _require_torch("xcorr_update")
    if not (_is_torch(xa) and _is_torch(xb)):
        raise TypeError("xa and xb must be torch tensors")
    da, db = state["moments_a"].shape[1], state["moments_b"].shape[1]
    if xa.dim() != 2 or xa.shape[1] != da:
        raise ValueError(f"xa must have shape (samples, {da}), got {tuple(xa.shape)}")
    if xb.dim() != 2 or xb.shape[1] != db:
        raise ValueError(f"xb must have shape (samples, {db}), got {tuple(xb.shape)}")
    if xa.shape[0] != xb.shape[0]:
        raise ValueError(f"xa and xb must have the same number of samples, got {xa.shape[0]} and {xb.shape[0]}")
    dev = state["comoment"].device
    if xa.device != dev or xb.device != dev:
        raise ValueError(f"xa and xb must be on the accumulator's device {dev}")
    rows = xa.shape[0]
    if rows == 0:
        return
    a, b = _xcorr_side(xa), _xcorr_side(xb)
    if a.dtype != b.dtype:  # a float32/float64 mix runs in float64
        a, b = a.double(), b.double()
    dtype = "float32" if a.dtype == torch.float32 else "float64"
    mod = cuda_module()
    device = dev.index if dev.index is not None else torch.cuda.current_device()
    stream = int(torch.cuda.current_stream(dev).cuda_stream)
    sides = []
    for t, name in ((a, "xa"), (b, "xb")):
        centred = torch.empty((rows, t.shape[1]), dtype=t.dtype, device=dev)
        moments = torch.empty((4, t.shape[1]), dtype=torch.float64, device=dev)
        resid = torch.empty(t.shape[1], dtype=torch.float64, device=dev)
        err, max_sumsq = mod.xcorr_batch_moments(t.data_ptr(), dtype, rows, t.shape[1], t.stride(0),
                                                 centred.data_ptr(), moments.data_ptr(), resid.data_ptr(), device,
                                                 stream)
        if err == 1:
            raise ValueError(f"{name} contains NaN or infinity")
        if err == 2:
            raise ValueError(f"{name} has values so large that its moments overflow")
        sides.append((centred, moments, resid, max_sumsq))
    (ca, ma, ra, sa), (cb, mb, rb, sb) = sides
    # Every entry of the product is bounded by sqrt(sumsq_a sumsq_b) (Cauchy-Schwarz).
    if (sa ** 0.5) * (sb ** 0.5) > float(torch.finfo(a.dtype).max) / 4:
        raise ValueError("xa and xb have values so large that their product overflows")
    g = torch.matmul(ca.t(), cb).contiguous()
    c = state["comoment"]
    err = mod.xcorr_merge_comoments(
        da, db, int(state["count"]), state["moments_a"].data_ptr(), state["moments_b"].data_ptr(), c.data_ptr(),
        "float32" if c.dtype == torch.float32 else "float64", rows, ma.data_ptr(), mb.data_ptr(), g.data_ptr(),
        dtype, ra.data_ptr(), rb.data_ptr(), device, stream)
    if err:
        raise ValueError("the accumulated moments would overflow the accumulator's dtype")
    state["count"] = int(state["count"]) + rows


def xcorr_merge(state: dict[str, Any], other: dict[str, Any]) -> None:
    """Add the samples of accumulator ``other`` to ``state`` (in place), on the device."""
    torch = _require_torch("xcorr_merge")
    if state["comoment"].shape != other["comoment"].shape:
        raise ValueError("the accumulators have different dimensions")
    m = int(other["count"])
    if m == 0:
        return
    dev = state["comoment"].device
    device = dev.index if dev.index is not None else torch.cuda.current_device()
    stream = int(torch.cuda.current_stream(dev).cuda_stream)
    c, g = state["comoment"], other["comoment"].contiguous()
    err = cuda_module().xcorr_merge_comoments(
        c.shape[0], c.shape[1], int(state["count"]), state["moments_a"].data_ptr(), state["moments_b"].data_ptr(),
        c.data_ptr(), "float32" if c.dtype == torch.float32 else "float64", m, other["moments_a"].data_ptr(),
        other["moments_b"].data_ptr(), g.data_ptr(), "float32" if g.dtype == torch.float32 else "float64", 0, 0,
        device, stream)
    if err:
        raise ValueError("the merged moments would overflow the accumulator's dtype")
    state["count"] = int(state["count"]) + m
