"""Where a :class:`pyperm.CrossCorrelation` keeps its statistics: host or CUDA memory.

Both kinds hold the same numbers: the sample count, a (4, dim) float64 block of moments per
side (rows mean, m2 = centred sum of squares, min, max) and the (dim_a, dim_b) centred
co-moment in the accumulator's dtype. :class:`HostMoments` keeps numpy arrays that the
compiled CPU core updates in place; :class:`CudaMoments` keeps torch tensors on one device
that :mod:`pyperm.xcorr._cuda` updates. Each state writes only its own fields; the
accumulator reaches them through these methods.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from pyperm._ext import core

__all__ = ["M2", "MAX", "MEAN", "MIN", "CudaMoments", "HostMoments", "from_fields"]

# Rows of the (4, dim) moment block of each side.
MEAN, M2, MIN, MAX = 0, 1, 2, 3

# Instruction set of the CPU core's loops: "auto" picks the widest this CPU runs. Tests set
# it to compare the variants.
ISA = "auto"

# The keys of fields(): the accumulator as plain host arrays.
FIELD_NAMES = ("count", "mean_a", "mean_b", "m2_a", "m2_b", "min_a", "max_a", "min_b", "max_b", "comoment")


class _Workspace:
    """Scratch buffers reused across updates: fresh multi-megabyte allocations each batch
    would pay the kernel's page faults again and again."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        size = math.prod(shape)
        buf = self._bufs.get(key)
        if buf is None or buf.dtype != dtype or buf.size < size:
            buf = np.empty(size, dtype=dtype)
            self._bufs[key] = buf
        return buf[:size].reshape(shape)


def _inverse_std(m2: Any, varies: Any, xp: Any) -> Any:
    """1/sqrt(m2) where the channel varies, else 0 (so its correlations are 0, not NaN)."""
    safe = xp.where(varies, m2, xp.ones_like(m2))
    return xp.where(varies, 1.0 / xp.sqrt(safe), xp.zeros_like(m2))


# --------------------------------------------------------------------------- host


class HostMoments:
    """The statistics in numpy arrays, updated by the compiled CPU core."""

    device = None  # host memory

    def __init__(self, dim_a: int, dim_b: int, dtype: np.dtype) -> None:
        self.count = 0
        self.moments_a = self._empty_moments(dim_a)
        self.moments_b = self._empty_moments(dim_b)
        # calloc'ed pages: untouched until the first batch overwrites them (the core never
        # reads an empty accumulator).
        self.comoment = np.zeros((dim_a, dim_b), dtype=dtype)
        self._ws = _Workspace()

    @staticmethod
    def _empty_moments(dim: int) -> np.ndarray:
        mom = np.zeros((4, dim), dtype=np.float64)
        mom[MIN] = np.inf
        mom[MAX] = -np.inf
        return mom

    def empty_like(self) -> HostMoments:
        """A state of the same shape and dtype with no samples (the workspace is kept)."""
        fresh = HostMoments(self.moments_a.shape[1], self.moments_b.shape[1], self.comoment.dtype)
        fresh._ws = self._ws
        return fresh

    def release_workspace(self) -> None:
        self._ws = _Workspace()

    def check(self) -> None:
        """Nothing pending: a host update raises its own errors."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_ws"]  # scratch, not statistics
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ws = _Workspace()

    # ----------------------------------------------------------------- reading

    def row(self, side: str, which: int) -> np.ndarray:
        """A copy of one row (MEAN, M2, MIN, MAX) of side "a" or "b"."""
        return (self.moments_a if side == "a" else self.moments_b)[which].copy()

    def std(self, side: str) -> np.ndarray:
        return np.sqrt((self.moments_a if side == "a" else self.moments_b)[M2] / self.count)

    def fields(self) -> dict[str, Any]:
        """The statistics as host arrays (copies), keyed as :data:`FIELD_NAMES`."""
        out: dict[str, Any] = {"count": self.count}
        for side, mom in (("a", self.moments_a), ("b", self.moments_b)):
            for name, row in (("mean", MEAN), ("m2", M2), ("min", MIN), ("max", MAX)):
                out[f"{name}_{side}"] = mom[row].copy()
        out["comoment"] = self.comoment.copy()
        return out

    def load(self, fields: dict[str, Any]) -> None:
        """Sets the statistics from validated host arrays (as :meth:`fields` gives them)."""
        self.count = int(fields["count"])
        self.comoment[...] = fields["comoment"]
        for side, mom in (("a", self.moments_a), ("b", self.moments_b)):
            for name, row in (("mean", MEAN), ("m2", M2), ("min", MIN), ("max", MAX)):
                mom[row] = fields[f"{name}_{side}"]

    def _scale(self, row_scale, col_scale, row_add, col_add, clip: bool, threads: int) -> np.ndarray:
        return core.xcorr_scale(self.comoment, row_scale, col_scale, row_add, col_add, clip, threads, ISA)

    def covariance(self, ddof: int, threads: int) -> np.ndarray:
        scale = np.full(self.comoment.shape[0], 1.0 / (self.count - ddof))
        return self._scale(scale, np.ones(self.comoment.shape[1]), None, None, False, threads)

    def correlation(self, threads: int) -> np.ndarray:
        inv = [
            _inverse_std(m[M2], (m[M2] > 0) & (m[MAX] > m[MIN]), np)
            for m in (self.moments_a, self.moments_b)
        ]
        return self._scale(inv[0], inv[1], None, None, True, threads)

    def cross_product(self, threads: int) -> np.ndarray:
        dim_a, dim_b = self.comoment.shape
        return self._scale(
            np.ones(dim_a), np.ones(dim_b), self.count * self.moments_a[MEAN], self.moments_b[MEAN], False, threads
        )

    # ----------------------------------------------------------------- writing, many states at once

    @staticmethod
    def update_many(states: list[HostMoments], batches: list[tuple[np.ndarray, np.ndarray, str]],
                    threads: int) -> None:
        """Folds one validated (xa, xb, name prefix) batch into each state; all or none change.

        The centring and merge kernels of all pairs run together on the core's thread pool;
        the batch products run in numpy's BLAS.
        """
        xs: list[np.ndarray] = []
        centred: list[np.ndarray] = []
        names: list[str] = []
        for st, (a, b, prefix) in zip(states, batches):
            xs += [a, b]
            centred += [st._ws.get("centred_a", a.shape, a.dtype), st._ws.get("centred_b", b.shape, b.dtype)]
            names += [f"{prefix}xa", f"{prefix}xb"]
        # Validates finiteness while it centres: raises before any accumulator changes.
        moments = core.xcorr_moments(xs, centred, names, threads, ISA)
        for k, (a, _, prefix) in enumerate(batches):
            # |(shifted_a^T shifted_b)_ij| <= sqrt(sum_s a_si^2 sum_s b_sj^2) bounds every partial sum
            # of the product (Cauchy-Schwarz); refuse a batch whose product could overflow.
            if math.sqrt(moments[2 * k][2]) * math.sqrt(moments[2 * k + 1][2]) > float(np.finfo(a.dtype).max) / 4:
                raise ValueError(
                    f"{prefix}xa and {prefix}xb have values too large to accumulate in {a.dtype}: their product "
                    "would overflow; pass float64 data or rescale it"
                )
        jobs = []
        for k, (st, (a, _, _)) in enumerate(zip(states, batches)):
            ca, cb = centred[2 * k], centred[2 * k + 1]
            product = st._ws.get("product", st.comoment.shape, a.dtype)
            # The only O(samples * dim_a * dim_b) step: BLAS, in the input precision, GIL released.
            np.matmul(ca.T, cb, out=product)
            (mom_a, resid_a, _), (mom_b, resid_b, _) = moments[2 * k], moments[2 * k + 1]
            jobs.append((st.count, st.moments_a, st.moments_b, st.comoment,
                         a.shape[0], mom_a, mom_b, product, resid_a, resid_b))
        core.xcorr_merge(jobs, [prefix.strip() or "batch" for _, _, prefix in batches], threads, ISA)
        for st, (a, _, _) in zip(states, batches):
            st.count += a.shape[0]

    @staticmethod
    def merge_many(states: list[HostMoments], others: list[HostMoments], threads: int) -> None:
        """Adds the samples of ``others[k]`` to ``states[k]`` (one core call for all)."""
        jobs, names, pairs = [], [], []
        for k, (st, other) in enumerate(zip(states, others)):
            if other.count == 0:
                continue
            comoment, mom_a, mom_b = other.comoment, other.moments_a, other.moments_b
            if other is st:  # the core's in-place loops assume the two sides do not alias
                comoment, mom_a, mom_b = comoment.copy(), mom_a.copy(), mom_b.copy()
            jobs.append((st.count, st.moments_a, st.moments_b, st.comoment, other.count, mom_a, mom_b, comoment,
                         None, None))
            names.append(f"merge[{k}]" if len(states) > 1 else "merge")
            pairs.append((st, other.count))
        if not jobs:
            return
        core.xcorr_merge(jobs, names, threads, ISA)
        for st, added in pairs:
            st.count += added  # merging a state into itself doubles it: its data now counts twice


# --------------------------------------------------------------------------- CUDA


class CudaMoments:
    """The statistics in torch tensors on one CUDA device, updated by the CUDA kernels.

    Statistics are returned as torch tensors on that device. Updates never wait for the device;
    every reader first checks what the device found (:func:`pyperm.xcorr._cuda.check`: one small
    read back), so a bad batch is reported at the first read after it.
    """

    def __init__(self, dim_a: int, dim_b: int, dtype: np.dtype, device: Any) -> None:
        from pyperm.xcorr import _cuda

        torch = sys.modules["torch"]
        self._dtype = np.dtype(dtype)
        tdtype = torch.float32 if self._dtype == np.float32 else torch.float64
        self.device = torch.device(device)
        self._acc = _cuda.new_state(dim_a, dim_b, self.device, tdtype)

    @property
    def count(self) -> int:
        self._check()
        return int(self._acc["count"])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_acc"] = {**self._acc, "stream": None}  # a stream belongs to this process
        return state

    def check(self) -> None:
        from pyperm.xcorr import _cuda

        _cuda.check(self._acc)

    _check = check

    def empty_like(self) -> CudaMoments:
        return CudaMoments(self._acc["moments_a"].shape[1], self._acc["moments_b"].shape[1], self._dtype,
                           self.device)

    def release_workspace(self) -> None:
        """Nothing to free: the CUDA path allocates its scratch per update."""

    # ----------------------------------------------------------------- reading

    def _moments(self, side: str) -> Any:
        self._check()
        return self._acc["moments_a" if side == "a" else "moments_b"]

    def row(self, side: str, which: int) -> Any:
        return self._moments(side)[which].clone()

    def std(self, side: str) -> Any:
        acc = self._stats()  # one check for the moments and the count
        return (acc["moments_a" if side == "a" else "moments_b"][M2] / acc["count"]).sqrt()

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"count": self.count}  # checked first
        for side in ("a", "b"):
            mom = self._moments(side).cpu().numpy()
            for name, row in (("mean", MEAN), ("m2", M2), ("min", MIN), ("max", MAX)):
                out[f"{name}_{side}"] = mom[row].copy()
        out["comoment"] = self._acc["comoment"].cpu().numpy().copy()
        return out

    def load(self, fields: dict[str, Any]) -> None:
        torch = sys.modules["torch"]
        self._acc["status"].zero_()  # whatever the device found before, these statistics replace it
        self._acc["count"] = int(fields["count"])
        self._acc["comoment"].copy_(torch.as_tensor(fields["comoment"]))
        for side in ("a", "b"):
            rows = [fields[f"{name}_{side}"] for name in ("mean", "m2", "min", "max")]
            self._moments(side).copy_(torch.as_tensor(np.stack(rows)))

    def _out(self, x: Any) -> Any:
        return x.to(self._acc["comoment"].dtype)

    def _stats(self) -> dict[str, Any]:
        """The device accumulator, checked."""
        self._check()
        return self._acc

    def covariance(self, ddof: int, threads: int) -> Any:
        acc = self._stats()
        return self._out(acc["comoment"].double() / (acc["count"] - ddof))

    def correlation(self, threads: int) -> Any:
        torch = sys.modules["torch"]
        acc = self._stats()
        inv = [_inverse_std(m[M2], (m[M2] > 0) & (m[MAX] > m[MIN]), torch) for m in (acc["moments_a"], acc["moments_b"])]
        # Rounding can push |r| of (nearly) collinear channels past 1; numpy.corrcoef clips too.
        return self._out(inv[0][:, None] * acc["comoment"].double() * inv[1][None, :]).clamp_(-1, 1)

    def cross_product(self, threads: int) -> Any:
        acc = self._stats()
        mean_a, mean_b = acc["moments_a"][MEAN], acc["moments_b"][MEAN]
        return self._out(acc["comoment"].double() + acc["count"] * mean_a[:, None] * mean_b[None, :])

    # ----------------------------------------------------------------- writing

    @staticmethod
    def update_many(states: list[CudaMoments], batches: list[tuple[Any, Any, str]], threads: int) -> None:
        """One batch per state, pair after pair (the device runs them in stream order)."""
        from pyperm.xcorr import _cuda

        for st, (a, b, prefix) in zip(states, batches):
            _cuda.update(st._acc, a, b, prefix)

    @staticmethod
    def merge_many(states: list[CudaMoments], others: list[CudaMoments], threads: int) -> None:
        from pyperm.xcorr import _cuda

        for st, other in zip(states, others):
            incoming = other._acc
            if other is st:  # the kernels assume the two sides do not alias
                incoming = {k: (v.clone() if hasattr(v, "clone") else v) for k, v in incoming.items()}
            _cuda.merge(st._acc, incoming)


def from_fields(like: HostMoments | CudaMoments, fields: dict[str, Any]) -> HostMoments | CudaMoments:
    """A state of ``like``'s kind, device, dims and dtype holding ``fields`` (host arrays)."""
    state = like.empty_like()
    state.load(fields)
    return state
