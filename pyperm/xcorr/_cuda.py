"""The CUDA backend of the cross-correlation accumulator: moments and merges on the device.

A device accumulator is a dict of torch tensors (float64 moments, a co-moment in the
accumulator's dtype) that these functions update in place; :mod:`pyperm.xcorr._state`
wraps it for :class:`pyperm.CrossCorrelation`.

An update never waits for the device: NaN or infinity in a batch, moments or a product that
would overflow, are found by the kernels, which record the first failing update in the
accumulator's ``status`` words and from then on leave the statistics as they were. The host
reads those words only in :func:`check`, which ``CrossCorrelation.check``, the readers of the
statistics and :func:`merge` call: the ValueError then names the update, and the accumulator
holds the samples before it. So a loop of updates on the device runs without a single host
synchronisation. Work on one accumulator from several streams is serialised (:func:`serialise`).
"""

from __future__ import annotations

import sys
from typing import Any

from pyperm._arrays import is_torch_tensor
from pyperm._cuda_arrays import dtype_name, require_torch, torch_launch
from pyperm._ext import cuda_module

__all__ = ["check", "merge", "new_state", "serialise", "update"]


def new_state(dim_a: int, dim_b: int, device: Any, dtype: Any = None) -> dict[str, Any]:
    """An empty device accumulator for :func:`update`: float64 moments, float64 co-moment.

    Keys: ``count`` (int), ``moments_a`` (4, dim_a) and ``moments_b`` (4, dim_b) with rows
    mean, m2 (centred sum of squares), min, max, and ``comoment`` (dim_a, dim_b), the centred
    co-moment. Correlation is ``comoment / sqrt(m2_a[:, None] * m2_b[None, :])``.
    """
    torch = require_torch("the cross-correlation accumulator")
    dtype = torch.float64 if dtype is None else dtype
    return {
        "count": 0,
        "moments_a": torch.zeros((4, dim_a), dtype=torch.float64, device=device),
        "moments_b": torch.zeros((4, dim_b), dtype=torch.float64, device=device),
        "comoment": torch.zeros((dim_a, dim_b), dtype=dtype, device=device),
        # The device's own checks (csrc/xcorr/xcorr_cuda.h): sticky status, per-update work words.
        "status": torch.zeros(_STATUS_WORDS, dtype=torch.int64, device=device),
        "work": torch.zeros(_WORK_WORDS, dtype=torch.int64, device=device),
        "updates": 0,
        "prefix": "",
        "stream": None,  # the stream of the last update, merge or check (see serialise)
    }


def serialise(state: dict[str, Any]) -> None:
    """Order the work on ``state`` issued on the current stream after the work issued on the stream before.

    The kernels read and write the accumulator in place, and the host reads the status words:
    two streams doing that at once would race, so a stream other than the last one waits for it.
    """
    torch = require_torch("the cross-correlation accumulator")
    current = torch.cuda.current_stream(state["comoment"].device)
    last = state.get("stream")
    if last is not None and last != current:
        current.wait_stream(last)
    state["stream"] = current


_STATUS_WORDS, _WORK_WORDS = 3, 7
# The failure bits of status[0] (XcorrFailure in csrc/xcorr/xcorr_cuda.h), as the messages say them.
_FAILURES = [
    (1, "{p}xa contains NaN or infinity"),
    (2, "{p}xb contains NaN or infinity"),
    (4, "{p}xa has values too large to accumulate (its moments overflow); pass float64 data or rescale it"),
    (8, "{p}xb has values too large to accumulate (its moments overflow); pass float64 data or rescale it"),
    (16, "{p}xa and {p}xb have values so large that their product overflows"),
    (32, "{m} has values too large to accumulate (its moments overflow); pass float64 data or rescale it"),
]


def check(state: dict[str, Any]) -> None:
    """Raise the first failure the device recorded since the last check (one 24-byte read back).

    Raises
    ------
    ValueError
        Naming the failed update and what was wrong with it. The accumulator then holds, and
        counts, the samples of the updates before that one; the status is cleared, so it can
        go on accumulating.
    """
    serialise(state)
    status = state["status"]
    code, update, count = status.tolist()  # the only synchronisation of the device path
    if code == 0:
        return
    status.zero_()
    state["count"] = int(count)
    p = state.get("prefix", "")
    m = "merge" if update < 0 else (p.strip() or "batch")  # what the merge's overflow is named after
    what = "; ".join(text.format(p=p, m=m) for bit, text in _FAILURES if code & bit)
    where = "a merge of accumulators" if update < 0 else f"update {update} of this accumulator"
    raise ValueError(f"{what} ({where}, found on the device; the accumulator keeps the {count} samples before it)")


def _xcorr_side(x: Any):
    torch = sys.modules["torch"]
    t = x.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    elif t.dtype not in (torch.float32, torch.float64):
        t = t.double()
    if t.stride(1) != 1 or t.stride(0) < t.shape[1]:
        t = t.contiguous()  # (a one-row batch may keep any row stride: torch calls it contiguous)
    return t


def _row_stride(t: Any) -> int:
    """The kernels' row stride: a one-row batch (a transposed column, say) may report any stride."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def update(state: dict[str, Any], xa: Any, xb: Any, prefix: str = "") -> None:
    """Fold one batch of paired activations into a device accumulator, in place.

    The device twin of one ``CrossCorrelation.update``: the centring and moment kernels run
    on the device, the batch product is ``torch.matmul`` in the batch's precision, and the
    Chan merge into the float64 accumulator is a device kernel.

    Parameters
    ----------
    state : dict
        From :func:`new_state`.
    xa : (samples, dim_a) torch.Tensor on the accumulator's device
    xb : (samples, dim_b) torch.Tensor on the same device
    prefix : str
        Put before "xa" and "xb" in error messages (which pair of a set failed).

    Raises
    ------
    ValueError
        Shapes that do not match the accumulator or each other. NaN or infinity in a batch, or
        moments that would overflow, are found on the device and raised by the next
        :func:`check` (the accumulator then holds the samples before that batch).
    """
    torch = require_torch("xcorr_update")
    if not (is_torch_tensor(xa) and is_torch_tensor(xb)):
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
    serialise(state)
    a, b = _xcorr_side(xa), _xcorr_side(xb)
    if a.dtype != b.dtype:  # a float32/float64 mix runs in float64
        a, b = a.double(), b.double()
    dtype = dtype_name(a)
    mod = cuda_module()
    device, stream = torch_launch(state["comoment"])
    work = state["work"]
    work.zero_()
    sides = []
    for side, t in enumerate((a, b)):
        centred = torch.empty((rows, t.shape[1]), dtype=t.dtype, device=dev)
        moments = torch.empty((4, t.shape[1]), dtype=torch.float64, device=dev)
        resid = torch.empty(t.shape[1], dtype=torch.float64, device=dev)
        mod.xcorr_batch_moments(t.data_ptr(), dtype, rows, t.shape[1], _row_stride(t), centred.data_ptr(),
                                moments.data_ptr(), resid.data_ptr(), work.data_ptr(), side, device, stream)
        sides.append((centred, moments, resid))
    (ca, ma, ra), (cb, mb, rb) = sides
    # Computed whatever the batch holds: a kernel decides on the device whether it may be merged.
    g = torch.matmul(ca.t(), cb).contiguous()
    c = state["comoment"]
    state["updates"] = int(state["updates"]) + 1
    state["prefix"] = prefix
    mod.xcorr_merge_comoments(
        da, db, int(state["count"]), state["moments_a"].data_ptr(), state["moments_b"].data_ptr(), c.data_ptr(),
        dtype_name(c), rows, ma.data_ptr(), mb.data_ptr(), g.data_ptr(), dtype, ra.data_ptr(), rb.data_ptr(),
        work.data_ptr(), state["status"].data_ptr(), state["updates"], device, stream)
    state["count"] = int(state["count"]) + rows


def merge(state: dict[str, Any], other: dict[str, Any]) -> None:
    """Add the samples of accumulator ``other`` to ``state`` (in place), on the device.

    Checks both first (:func:`check`), and ``state`` after (a merge whose moments would overflow
    is refused at once, the accumulator unchanged): a merge synchronises, an update does not.
    """
    require_torch("xcorr_merge")
    if state["comoment"].shape != other["comoment"].shape:
        raise ValueError("the accumulators have different dimensions")
    check(other)
    check(state)
    m = int(other["count"])
    if m == 0:
        return
    device, stream = torch_launch(state["comoment"])
    c, g = state["comoment"], other["comoment"].contiguous()
    cuda_module().xcorr_merge_comoments(
        c.shape[0], c.shape[1], int(state["count"]), state["moments_a"].data_ptr(), state["moments_b"].data_ptr(),
        c.data_ptr(), dtype_name(c), m, other["moments_a"].data_ptr(), other["moments_b"].data_ptr(), g.data_ptr(),
        dtype_name(g), 0, 0, state["work"].data_ptr(), state["status"].data_ptr(), -1, device, stream)
    state["count"] = int(state["count"]) + m
    check(state)
