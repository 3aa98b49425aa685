r"""Streaming cross-correlation of paired activations (activation matching statistics).

Activation matching compares the units of two networks through the statistics of their
activations on the same inputs: the Pearson correlation of Tatro et al. (2020, eq. 3) or the
uncentred product :math:`Z^{(A)} Z^{(B)\top}` of Git Re-Basin (Ainsworth et al., 2023, eq. 1).
:class:`CrossCorrelation` accumulates what both need in one pass over the data, batch by
batch, without ever holding the activations of the whole data set:

.. math::

    n, \quad \mu_A, \mu_B, \quad M_A = \sum_s (a_s - \mu_A)^{\circ 2}, \quad
    C = \sum_s (a_s - \mu_A)(b_s - \mu_B)^\top .

Each batch is centred on its own mean, multiplied by BLAS (numpy's matmul) in the input
precision, and folded into float64 accumulators with the pairwise update of Chan, Golub and
LeVeque (1983), so that a large common offset in the activations costs no accuracy. The
C++ core does the centring and the merge with the GIL released; the merge reads and writes
the ``dim_a x dim_b`` accumulator once per batch.

Data-parallel workers each accumulate their share and combine with
:func:`all_reduce_cross_correlation` (torch.distributed) or :meth:`CrossCorrelation.merge`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pyperm import _core
from pyperm._arrays import check_threads, is_cuda_array, is_torch_tensor, to_numpy

__all__ = [
    "CrossCorrelation",
    "CrossCorrelationSet",
    "all_reduce_cross_correlation",
    "conv_to_samples",
]

# Rows of the (4, dim) moment block the core keeps per side.
_MEAN, _M2, _MIN, _MAX = 0, 1, 2, 3

# Instruction set of the core's loops: "auto" picks the widest this CPU runs. Tests set it
# to compare the variants.
_ISA = "auto"


# --------------------------------------------------------------------------- validation


def _check_dim(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def _check_accumulator_dtype(dtype: Any) -> np.dtype:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        dtype = {torch.float32: np.float32, torch.float64: np.float64}.get(dtype, dtype)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dt not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dt}")
    return dt


def _half_to_float(x: Any) -> Any:
    """torch half and bfloat16 have no numpy view; they are accumulated as float32."""
    if is_torch_tensor(x):
        import torch

        if x.dtype in (torch.float16, torch.bfloat16):
            return x.detach().float()
    return x


def _samples(x: Any, name: str, dim: int | None, dim_name: str) -> np.ndarray:
    """A C-contiguous float32/float64 (samples, dim) view or copy of ``x``."""
    if is_cuda_array(x):
        raise ValueError(
            f"{name} is a CUDA array; CrossCorrelation accumulates on the CPU: pass {name}.cpu() "
            "(a device-side accumulator is part of pyperm's CUDA extension)"
        )
    arr = to_numpy(_half_to_float(x), name)
    kind = arr.dtype.kind
    if kind not in "biuf":
        what = "complex" if kind == "c" else "non-numeric"
        raise TypeError(f"{name} must hold real numbers, got {what} dtype {arr.dtype}")
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


def _pair(xa: Any, xb: Any, dim_a: int, dim_b: int, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    a = _samples(xa, f"{prefix}xa", dim_a, "dim_a")
    b = _samples(xb, f"{prefix}xb", dim_b, "dim_b")
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"{prefix}xa and {prefix}xb must hold the same number of samples (rows), "
            f"got {a.shape[0]} and {b.shape[0]}"
        )
    if a.dtype != b.dtype:
        # One GEMM needs one precision: the wider one.
        a, b = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    return a, b


def _vector(x: Any, name: str, dim: int | None) -> np.ndarray:
    arr = np.asarray(to_numpy(x, name))
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1 or (dim is not None and arr.shape[0] != dim):
        want = f"({dim},)" if dim is not None else "1-D"
        raise ValueError(f"{name} must have shape {want}, got {arr.shape}")
    return np.array(arr, dtype=np.float64)


# --------------------------------------------------------------------------- workspace


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


# --------------------------------------------------------------------------- accumulator


class CrossCorrelation:
    r"""Streaming cross-correlation of two paired activation streams.

    Feed it the activations of the same inputs in network A (``dim_a`` channels) and network
    B (``dim_b`` channels), one batch at a time; read the statistics whenever you like. Only
    the ``dim_a x dim_b`` centred co-moment and per-channel moments are stored:

    .. math::

        C = \sum_s (a_s - \mu_A)(b_s - \mu_B)^\top, \qquad
        \rho_{ij} = \frac{C_{ij}}{\sqrt{M_{A,i} M_{B,j}}}, \qquad
        Z^{(A)} Z^{(B)\top} = C + n\, \mu_A \mu_B^\top.

    Parameters
    ----------
    dim_a, dim_b : int
        Channels of the two streams (units of a dense layer, filters of a convolution).
    dtype : {numpy.float64, numpy.float32}, default float64
        Precision of the ``dim_a x dim_b`` co-moment accumulator. The per-channel moments are
        always float64. float32 halves the memory of very wide layers and keeps about seven
        significant digits.
    threads : int, optional
        Threads for the centring and merge kernels (default: all cores). The batch product
        itself runs in numpy's BLAS, with the threads that BLAS is configured for.

    Notes
    -----
    *Accuracy.* Each batch is centred on its own mean before its product is formed, and the
    batch is merged into the running statistics by the pairwise update of Chan, Golub and
    LeVeque (1983); the co-moment form is that of Pebay (2008). Activations with a large
    common offset (mean 1e4, spread 1e-2) therefore lose nothing: float64 input matches
    :func:`numpy.corrcoef` of the concatenated data to about 1e-11 even then. The product of a
    float32 batch is formed in float32 (BLAS speed) and accumulated in float64: expect
    correlations accurate to about 1e-6 (cast the batches to float64 for more).

    *Zero variance.* A channel whose values are all identical (a dead ReLU unit, say) has no
    correlation; :meth:`correlation` reports 0 for it, never NaN, and :attr:`std_a` is exactly
    0. Such a channel is recognised exactly (its minimum equals its maximum), not by a
    threshold.

    *Output.* Statistics are returned as new numpy arrays whatever the input was (numpy or
    torch CPU tensors): float64 for per-channel vectors, the accumulator ``dtype`` for the
    ``dim_a x dim_b`` matrices. Torch users wrap them with ``torch.from_numpy``; most pass
    ``correlation()`` straight to :func:`pyperm.linear_sum_assignment` with ``maximize=True``.

    *Threads.* An accumulator may be read from several threads but must be updated from one
    at a time. Pairs of accumulators are updated together, in parallel, by
    :meth:`update_many` or :class:`CrossCorrelationSet`.

    *Memory.* Besides the accumulator, scratch buffers for the centred batch and its product
    (``dim_a x dim_b`` in the input precision) are kept between updates; pickling and
    :meth:`state` leave them out, and :meth:`release_workspace` frees them.

    References
    ----------
    .. [1] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment", NeurIPS
       2020, eq. 3 and Algorithm 1.
    .. [2] S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
       Permutation Symmetries", ICLR 2023, eq. 1.
    .. [3] T. F. Chan, G. H. Golub, R. J. LeVeque, "Algorithms for computing the sample
       variance: analysis and recommendations", The American Statistician 37(3), 1983.
    .. [4] P. Pebay, "Formulas for robust, one-pass parallel computation of covariances and
       arbitrary-order statistical moments", Sandia report SAND2008-6212, 2008.

    Examples
    --------
    >>> import numpy as np, pyperm
    >>> rng = np.random.default_rng(0)
    >>> acc = pyperm.CrossCorrelation(8, 8)
    >>> for _ in range(4):
    ...     xa = rng.standard_normal((32, 8))
    ...     xb = xa[:, ::-1] + 0.1 * rng.standard_normal((32, 8))  # B is A with units reversed
    ...     _ = acc.update(xa, xb)
    >>> acc.count
    128
    >>> rows, cols = pyperm.linear_sum_assignment(acc.correlation(), maximize=True)
    >>> cols.tolist()
    [7, 6, 5, 4, 3, 2, 1, 0]
    """

    def __init__(self, dim_a: int, dim_b: int, *, dtype: Any = np.float64, threads: int | None = None) -> None:
        self._dim_a = _check_dim(dim_a, "dim_a")
        self._dim_b = _check_dim(dim_b, "dim_b")
        self._dtype = _check_accumulator_dtype(dtype)
        self._threads = check_threads(threads)
        self._ws = _Workspace()
        self.reset()

    # ----------------------------------------------------------------- state

    def reset(self) -> CrossCorrelation:
        """Forget every sample (the workspace is kept). Returns ``self``."""
        self._count = 0
        self._mom_a = self._empty_moments(self._dim_a)
        self._mom_b = self._empty_moments(self._dim_b)
        # calloc'ed pages: untouched until the first batch overwrites them (the core never
        # reads an empty accumulator).
        self._comoment = np.zeros((self._dim_a, self._dim_b), dtype=self._dtype)
        return self

    @staticmethod
    def _empty_moments(dim: int) -> np.ndarray:
        mom = np.zeros((4, dim), dtype=np.float64)
        mom[_MIN] = np.inf
        mom[_MAX] = -np.inf
        return mom

    def release_workspace(self) -> None:
        """Free the scratch buffers kept between updates (they are re-created on demand)."""
        self._ws = _Workspace()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_ws"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ws = _Workspace()

    def __repr__(self) -> str:
        return (
            f"CrossCorrelation(dim_a={self._dim_a}, dim_b={self._dim_b}, dtype={self._dtype.name}, "
            f"count={self._count})"
        )

    @property
    def dim_a(self) -> int:
        """Channels of stream A."""
        return self._dim_a

    @property
    def dim_b(self) -> int:
        """Channels of stream B."""
        return self._dim_b

    @property
    def dtype(self) -> np.dtype:
        """Precision of the co-moment accumulator."""
        return self._dtype

    @property
    def count(self) -> int:
        """Number of samples (rows) accumulated so far."""
        return self._count

    # ----------------------------------------------------------------- update

    def update(self, xa: Any, xb: Any) -> CrossCorrelation:
        """Accumulate one batch of paired activations.

        Parameters
        ----------
        xa : (samples, dim_a) array-like or torch.Tensor
            Activations of network A, one sample per row. float32 and float64 are used in
            their own precision (the batch product runs in it); half precision becomes
            float32, integers and bool float64. A float32/float64 mix runs in float64.
            Convolution activations go through :func:`conv_to_samples` first.
        xb : (samples, dim_b) array-like or torch.Tensor
            Activations of network B on the same inputs, row for row.

        Returns
        -------
        CrossCorrelation
            ``self``, updated. A batch with zero rows changes nothing.

        Raises
        ------
        ValueError
            Wrong number of dimensions or channels, different numbers of samples, NaN or
            infinity in a batch, values so large that the moments overflow, or a CUDA tensor.
            The accumulator is unchanged when it raises.
        TypeError
            A non-numeric or complex array.

        Examples
        --------
        >>> import numpy as np, pyperm
        >>> acc = pyperm.CrossCorrelation(3, 2)
        >>> acc.update(np.ones((5, 3)), np.zeros((5, 2))).count
        5
        """
        _update_many([self], [(xa, xb)], self._threads, single=True)
        return self

    @staticmethod
    def update_many(
        accumulators: Sequence[CrossCorrelation], pairs: Sequence[tuple[Any, Any]], threads: int | None = None
    ) -> None:
        """Update several accumulators at once, e.g. every layer pair of a network.

        The centring and merge kernels of all pairs run together on the thread pool with the
        GIL released; the batch products run one after another in numpy's BLAS (which is
        itself multi-threaded). The result equals ``acc.update(xa, xb)`` pair by pair.

        Parameters
        ----------
        accumulators : sequence of CrossCorrelation
            Distinct accumulators.
        pairs : sequence of (xa, xb)
            One pair of batches per accumulator, with the rules of :meth:`update`. Different
            pairs may have different numbers of samples.
        threads : int, optional
            Threads for the kernels (default: all cores).

        Raises
        ------
        ValueError
            Lengths differ, an accumulator is listed twice, or a pair is invalid (as in
            :meth:`update`; the message names ``pairs[k]``). Nothing is updated then.
        TypeError
            An element is not a CrossCorrelation or a pair is not a 2-sequence.

        Examples
        --------
        >>> import numpy as np, pyperm
        >>> rng = np.random.default_rng(0)
        >>> accs = [pyperm.CrossCorrelation(4, 4), pyperm.CrossCorrelation(6, 6)]
        >>> x1, x2 = rng.standard_normal((10, 4)), rng.standard_normal((10, 6))
        >>> pyperm.CrossCorrelation.update_many(accs, [(x1, x1), (x2, x2)])
        >>> [a.count for a in accs]
        [10, 10]
        """
        _update_many(list(accumulators), list(pairs), check_threads(threads), single=False)

    def merge(self, other: CrossCorrelation) -> CrossCorrelation:
        """Add the samples accumulated by ``other`` (exactly as if this one had seen them).

        This is the combine step of data-parallel accumulation: each worker accumulates its
        shard, then the states are merged, here in-process or across processes with
        :func:`all_reduce_cross_correlation`. ``other`` is not modified.

        Parameters
        ----------
        other : CrossCorrelation
            An accumulator of the same ``dim_a`` and ``dim_b`` (its dtype may differ).

        Returns
        -------
        CrossCorrelation
            ``self``, updated.

        Raises
        ------
        TypeError
            ``other`` is not a CrossCorrelation.
        ValueError
            The dimensions differ, or the merged moments would overflow the accumulator.

        Examples
        --------
        >>> import numpy as np, pyperm
        >>> x = np.random.default_rng(0).standard_normal((100, 3))
        >>> left = pyperm.CrossCorrelation(3, 3).update(x[:40], x[:40])
        >>> right = pyperm.CrossCorrelation(3, 3).update(x[40:], x[40:])
        >>> whole = pyperm.CrossCorrelation(3, 3).update(x, x)
        >>> bool(np.allclose(left.merge(right).covariance(), whole.covariance()))
        True
        """
        _merge_many([self], [other], self._threads)
        return self

    # ----------------------------------------------------------------- statistics

    def _require_samples(self, what: str, at_least: int = 1) -> None:
        if self._count < at_least:
            raise ValueError(
                f"{what} needs at least {at_least} accumulated sample{'s' if at_least > 1 else ''}, "
                f"have {self._count}: call update() first"
            )

    @property
    def mean_a(self) -> np.ndarray:
        """(dim_a,) float64: channel means of stream A."""
        self._require_samples("mean_a")
        return self._mom_a[_MEAN].copy()

    @property
    def mean_b(self) -> np.ndarray:
        """(dim_b,) float64: channel means of stream B."""
        self._require_samples("mean_b")
        return self._mom_b[_MEAN].copy()

    @property
    def std_a(self) -> np.ndarray:
        """(dim_a,) float64: population standard deviations (ddof=0, as :func:`numpy.std`) of A."""
        self._require_samples("std_a")
        return np.sqrt(self._mom_a[_M2] / self._count)

    @property
    def std_b(self) -> np.ndarray:
        """(dim_b,) float64: population standard deviations (ddof=0) of stream B."""
        self._require_samples("std_b")
        return np.sqrt(self._mom_b[_M2] / self._count)

    @property
    def min_a(self) -> np.ndarray:
        """(dim_a,) float64: smallest value seen per channel of A (-inf when unknown, see :meth:`from_state`)."""
        self._require_samples("min_a")
        return self._mom_a[_MIN].copy()

    @property
    def max_a(self) -> np.ndarray:
        """(dim_a,) float64: largest value seen per channel of A (+inf when unknown)."""
        self._require_samples("max_a")
        return self._mom_a[_MAX].copy()

    @property
    def min_b(self) -> np.ndarray:
        """(dim_b,) float64: smallest value seen per channel of B."""
        self._require_samples("min_b")
        return self._mom_b[_MIN].copy()

    @property
    def max_b(self) -> np.ndarray:
        """(dim_b,) float64: largest value seen per channel of B."""
        self._require_samples("max_b")
        return self._mom_b[_MAX].copy()

    def covariance(self, ddof: int = 1) -> np.ndarray:
        """The (dim_a, dim_b) cross-covariance ``C / (count - ddof)``.

        Parameters
        ----------
        ddof : int, default 1
            Delta degrees of freedom; 1 (the default) matches :func:`numpy.cov`, whose
            off-diagonal block ``np.cov(xa.T, xb.T)[:dim_a, dim_a:]`` this equals.

        Returns
        -------
        (dim_a, dim_b) numpy.ndarray of the accumulator dtype

        Raises
        ------
        ValueError
            ``count <= ddof``, or ``ddof`` is negative.
        """
        if isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer)):
            raise TypeError(f"ddof must be an int, got {type(ddof).__name__}")
        if ddof < 0:
            raise ValueError(f"ddof must be non-negative, got {ddof}")
        self._require_samples("covariance", int(ddof) + 1)
        scale = np.full(self._dim_a, 1.0 / (self._count - int(ddof)))
        ones = np.ones(self._dim_b)
        return _core.xcorr_scale(self._comoment, scale, ones, None, None, False, self._threads, _ISA)

    def correlation(self) -> np.ndarray:
        r"""The (dim_a, dim_b) Pearson correlation of every channel of A with every channel of B.

        .. math:: \rho_{ij} = \frac{\sum_s (a_{si} - \mu_{A,i})(b_{sj} - \mu_{B,j})}
                                   {\sqrt{\sum_s (a_{si} - \mu_{A,i})^2 \sum_s (b_{sj} - \mu_{B,j})^2}}

        (Tatro et al. 2020, eq. 3). Equals ``numpy.corrcoef(xa.T, xb.T)[:dim_a, dim_a:]`` of the
        concatenated batches, except that a channel with zero variance gives 0 instead of NaN.
        Values are clipped to [-1, 1], as numpy does.

        Returns
        -------
        (dim_a, dim_b) numpy.ndarray of the accumulator dtype

        Raises
        ------
        ValueError
            Nothing has been accumulated yet.
        """
        self._require_samples("correlation")
        return _core.xcorr_scale(
            self._comoment,
            _inverse_std(self._mom_a),
            _inverse_std(self._mom_b),
            None,
            None,
            True,
            self._threads,
            _ISA,
        )

    def cross_product(self) -> np.ndarray:
        r"""The uncentred (dim_a, dim_b) product :math:`\sum_s a_s b_s^\top = Z^{(A)} Z^{(B)\top}`.

        The matrix of Git Re-Basin's activation matching (Ainsworth et al. 2023, eq. 1):
        ``xa.T @ xb`` of the concatenated batches. Maximise ``<P, cross_product()>`` with
        :func:`pyperm.linear_sum_assignment` (``maximize=True``) to match the units.

        Returns
        -------
        (dim_a, dim_b) numpy.ndarray of the accumulator dtype

        Raises
        ------
        ValueError
            Nothing has been accumulated yet.
        """
        self._require_samples("cross_product")
        return _core.xcorr_scale(
            self._comoment,
            np.ones(self._dim_a),
            np.ones(self._dim_b),
            self._count * self._mom_a[_MEAN],
            self._mom_b[_MEAN],
            False,
            self._threads,
            _ISA,
        )

    # ----------------------------------------------------------------- state as arrays

    def state(self) -> dict[str, Any]:
        """The accumulator as plain arrays (copies), e.g. to all-reduce or to save.

        Returns
        -------
        dict
            ``count`` (int); ``mean_a``, ``m2_a``, ``min_a``, ``max_a`` (dim_a,) float64;
            the same for ``b``; ``comoment`` (dim_a, dim_b) of the accumulator dtype, the centred
            co-moment ``sum_s (a_s - mean_a)(b_s - mean_b)^T``; ``m2`` are the centred sums of
            squares. An empty accumulator has count 0 and zero means.
            :meth:`from_state` rebuilds the accumulator from it.
        """
        return {
            "count": self._count,
            "mean_a": self._mom_a[_MEAN].copy(),
            "mean_b": self._mom_b[_MEAN].copy(),
            "m2_a": self._mom_a[_M2].copy(),
            "m2_b": self._mom_b[_M2].copy(),
            "min_a": self._mom_a[_MIN].copy(),
            "max_a": self._mom_a[_MAX].copy(),
            "min_b": self._mom_b[_MIN].copy(),
            "max_b": self._mom_b[_MAX].copy(),
            "comoment": self._comoment.copy(),
        }

    @classmethod
    def from_state(
        cls,
        count: int,
        mean_a: Any,
        mean_b: Any,
        comoment: Any,
        m2_a: Any,
        m2_b: Any,
        min_a: Any = None,
        max_a: Any = None,
        min_b: Any = None,
        max_b: Any = None,
        *,
        threads: int | None = None,
    ) -> CrossCorrelation:
        """Rebuild an accumulator from the arrays of :meth:`state` (numpy or torch CPU).

        Parameters
        ----------
        count : int
            Number of samples.
        mean_a, mean_b : (dim_a,), (dim_b,) array-like
            Channel means.
        comoment : (dim_a, dim_b) array-like
            Centred co-moment; its dtype (float32 or float64; others become float64) is the
            accumulator's.
        m2_a, m2_b : (dim_a,), (dim_b,) array-like
            Centred sums of squares, non-negative.
        min_a, max_a, min_b, max_b : array-like, optional
            Channel ranges. Without them a range is unknown (-inf, +inf), and a channel counts
            as constant only when its ``m2`` is exactly 0.
        threads : int, optional
            As in the constructor.

        Returns
        -------
        CrossCorrelation

        Raises
        ------
        ValueError
            Shapes disagree, a value is NaN or infinite (ranges may be infinite), ``count`` is
            negative, or ``m2`` is negative.
        TypeError
            ``count`` is not an int or an array is not numeric.
        """
        if is_torch_tensor(count) or isinstance(count, np.ndarray):
            count = count.item()
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            if isinstance(count, (float, np.floating)) and float(count).is_integer():
                count = int(count)  # an all-reduced count may come back as a float
            else:
                raise TypeError(f"count must be an int, got {type(count).__name__}")
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        c = to_numpy(comoment, "comoment")
        if c.dtype.kind not in "biuf":
            raise TypeError(f"comoment must hold real numbers, got dtype {c.dtype}")
        if c.ndim != 2 or 0 in c.shape:
            raise ValueError(f"comoment must be a non-empty 2-D array, got shape {c.shape}")
        dim_a, dim_b = c.shape
        dtype = c.dtype if c.dtype in (np.float32, np.float64) else np.dtype(np.float64)
        acc = cls(dim_a, dim_b, dtype=dtype, threads=threads)
        fields = {
            "mean_a": (_vector(mean_a, "mean_a", dim_a), True),
            "mean_b": (_vector(mean_b, "mean_b", dim_b), True),
            "m2_a": (_vector(m2_a, "m2_a", dim_a), True),
            "m2_b": (_vector(m2_b, "m2_b", dim_b), True),
        }
        for name, value, dim, default in (
            ("min_a", min_a, dim_a, -np.inf),
            ("max_a", max_a, dim_a, np.inf),
            ("min_b", min_b, dim_b, -np.inf),
            ("max_b", max_b, dim_b, np.inf),
        ):
            fields[name] = (np.full(dim, default) if value is None else _vector(value, name, dim), False)
        for name, (arr, must_be_finite) in fields.items():
            bad = ~np.isfinite(arr) if must_be_finite else np.isnan(arr)
            if bad.any():
                raise ValueError(f"{name} contains {'NaN or infinity' if must_be_finite else 'NaN'}")
        if not np.isfinite(c).all():
            raise ValueError("comoment contains NaN or infinity")
        for name in ("m2_a", "m2_b"):
            if (fields[name][0] < 0).any():
                raise ValueError(f"{name} must be non-negative (a sum of squares)")
        acc._count = int(count)
        acc._comoment[...] = c
        for mom, side in ((acc._mom_a, "a"), (acc._mom_b, "b")):
            mom[_MEAN] = fields[f"mean_{side}"][0]
            mom[_M2] = fields[f"m2_{side}"][0]
            mom[_MIN] = fields[f"min_{side}"][0]
            mom[_MAX] = fields[f"max_{side}"][0]
        if count == 0:
            acc.reset()
        return acc


def _inverse_std(mom: np.ndarray) -> np.ndarray:
    """1/sqrt(m2), and 0 for a channel without variance (so its correlations are 0, not NaN)."""
    m2 = mom[_M2]
    varies = (m2 > 0) & (mom[_MAX] > mom[_MIN])
    out = np.zeros_like(m2)
    np.divide(1.0, np.sqrt(m2, where=varies, out=np.zeros_like(m2)), out=out, where=varies)
    return out


# --------------------------------------------------------------------------- batched core calls


def _update_many(accs: list[CrossCorrelation], pairs: list[Any], threads: int, single: bool) -> None:
    if len(accs) != len(pairs):
        raise ValueError(f"got {len(accs)} accumulators but {len(pairs)} pairs")
    seen: set[int] = set()
    xs: list[np.ndarray] = []
    names: list[str] = []
    work: list[tuple[CrossCorrelation, np.ndarray, np.ndarray, str]] = []
    for k, (acc, pair) in enumerate(zip(accs, pairs)):
        prefix = "" if single else f"pairs[{k}] "
        if not isinstance(acc, CrossCorrelation):
            raise TypeError(f"accumulators[{k}] must be a CrossCorrelation, got {type(acc).__name__}")
        if id(acc) in seen:
            raise ValueError(f"accumulators[{k}] is listed twice; each accumulator takes one pair per call")
        seen.add(id(acc))
        if is_torch_tensor(pair) or isinstance(pair, np.ndarray) or not isinstance(pair, (tuple, list)):
            raise TypeError(f"pairs[{k}] must be an (xa, xb) tuple, got {type(pair).__name__}")
        if len(pair) != 2:
            raise ValueError(f"pairs[{k}] must be an (xa, xb) pair, got {len(pair)} items")
        a, b = _pair(pair[0], pair[1], acc._dim_a, acc._dim_b, prefix)
        if a.shape[0] == 0:
            continue
        work.append((acc, a, b, prefix))
    if not work:
        return

    centred: list[np.ndarray] = []
    for acc, a, b, prefix in work:
        xs += [a, b]
        centred += [acc._ws.get("centred_a", a.shape, a.dtype), acc._ws.get("centred_b", b.shape, b.dtype)]
        names += [f"{prefix}xa", f"{prefix}xb"]
    # Validates finiteness while it centres: raises before any accumulator changes.
    moments = _core.xcorr_moments(xs, centred, names, threads, _ISA)
    for k, (_, a, _, prefix) in enumerate(work):
        # |(shifted_a^T shifted_b)_ij| <= sqrt(sum_s a_si^2 sum_s b_sj^2) bounds every partial sum
        # of the product (Cauchy-Schwarz); refuse a batch whose product could overflow.
        if math.sqrt(moments[2 * k][2]) * math.sqrt(moments[2 * k + 1][2]) > float(np.finfo(a.dtype).max) / 4:
            raise ValueError(
                f"{prefix}xa and {prefix}xb have values too large to accumulate in {a.dtype}: their product "
                "would overflow; pass float64 data or rescale it"
            )

    jobs = []
    for k, (acc, a, b, prefix) in enumerate(work):
        ca, cb = centred[2 * k], centred[2 * k + 1]
        product = acc._ws.get("product", (acc._dim_a, acc._dim_b), a.dtype)
        # The only O(samples * dim_a * dim_b) step: BLAS, in the input precision, GIL released.
        np.matmul(ca.T, cb, out=product)
        (mom_a, resid_a, _), (mom_b, resid_b, _) = moments[2 * k], moments[2 * k + 1]
        jobs.append(
            (acc._count, acc._mom_a, acc._mom_b, acc._comoment,
             a.shape[0], mom_a, mom_b, product, resid_a, resid_b)
        )
    _core.xcorr_merge(jobs, [prefix.strip() or "batch" for _, _, _, prefix in work], threads, _ISA)
    for acc, a, _, _ in work:
        acc._count += a.shape[0]


def _merge_many(targets: list[CrossCorrelation], sources: list[Any], threads: int) -> None:
    jobs = []
    names = []
    for k, (acc, other) in enumerate(zip(targets, sources)):
        if not isinstance(other, CrossCorrelation):
            raise TypeError(f"can only merge a CrossCorrelation, got {type(other).__name__}")
        if (other._dim_a, other._dim_b) != (acc._dim_a, acc._dim_b):
            raise ValueError(
                f"cannot merge a CrossCorrelation of dims ({other._dim_a}, {other._dim_b}) into one of "
                f"dims ({acc._dim_a}, {acc._dim_b})"
            )
        if other._count == 0:
            continue
        comoment, mom_a, mom_b = other._comoment, other._mom_a, other._mom_b
        if other is acc:  # the core's in-place loops assume the two sides do not alias
            comoment, mom_a, mom_b = comoment.copy(), mom_a.copy(), mom_b.copy()
        jobs.append(
            (acc._count, acc._mom_a, acc._mom_b, acc._comoment, other._count, mom_a, mom_b, comoment, None, None)
        )
        names.append(f"merge[{k}]" if len(targets) > 1 else "merge")
    if not jobs:
        return
    _core.xcorr_merge(jobs, names, threads, _ISA)
    for acc, other in zip(targets, sources):
        acc._count += other._count  # `other is acc` doubles it: its data now counts twice


# --------------------------------------------------------------------------- set of pairs


class CrossCorrelationSet:
    """The accumulators of every layer pair of two networks, updated together.

    Aligning two networks by their activations needs one :class:`CrossCorrelation` per
    permutation group (layer). This container keeps them under names and updates all of them
    from one call per batch, running the kernels of all pairs on the thread pool at once, so a
    single pass over the data gathers every statistic.

    Parameters
    ----------
    dims : mapping of name -> (dim_a, dim_b), or sequence of (dim_a, dim_b)
        The layer pairs. A sequence is keyed 0, 1, ...
    dtype : {numpy.float64, numpy.float32}, default float64
        Accumulator precision, as in :class:`CrossCorrelation`.
    threads : int, optional
        Threads for the kernels (default: all cores).

    Raises
    ------
    TypeError, ValueError
        A dimension is not a positive int, or ``dims`` is empty.

    Examples
    --------
    >>> import numpy as np, pyperm
    >>> rng = np.random.default_rng(0)
    >>> accs = pyperm.CrossCorrelationSet({"fc1": (16, 16), "fc2": (8, 8)})
    >>> h1, h2 = rng.standard_normal((64, 16)), rng.standard_normal((64, 8))
    >>> _ = accs.update({"fc1": (h1, h1), "fc2": (h2, h2[:, ::-1])})
    >>> accs["fc2"].count, sorted(accs)
    (64, ['fc1', 'fc2'])
    >>> pyperm.linear_sum_assignment(accs["fc2"].correlation(), maximize=True)[1].tolist()
    [7, 6, 5, 4, 3, 2, 1, 0]
    """

    def __init__(self, dims: Mapping[Any, tuple[int, int]] | Sequence[tuple[int, int]], *, dtype: Any = np.float64,
                 threads: int | None = None) -> None:
        self._threads = check_threads(threads)
        if isinstance(dims, Mapping):
            items = list(dims.items())
        elif isinstance(dims, Sequence) and not isinstance(dims, (str, bytes)):
            items = list(enumerate(dims))
        else:
            raise TypeError(f"dims must be a mapping or a sequence of (dim_a, dim_b), got {type(dims).__name__}")
        if not items:
            raise ValueError("dims must name at least one layer pair")
        self._accs: dict[Any, CrossCorrelation] = {}
        for key, pair in items:
            try:
                dim_a, dim_b = pair
            except (TypeError, ValueError):
                raise ValueError(f"dims[{key!r}] must be a (dim_a, dim_b) pair, got {pair!r}") from None
            self._accs[key] = CrossCorrelation(dim_a, dim_b, dtype=dtype, threads=threads)
        self._sequence = not isinstance(dims, Mapping)

    def __getitem__(self, key: Any) -> CrossCorrelation:
        return self._accs[key]

    def __len__(self) -> int:
        return len(self._accs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._accs)

    def __contains__(self, key: Any) -> bool:
        return key in self._accs

    def keys(self):
        return self._accs.keys()

    def values(self):
        return self._accs.values()

    def items(self):
        return self._accs.items()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: ({a.dim_a}, {a.dim_b})" for k, a in self._accs.items())
        return f"CrossCorrelationSet({{{inner}}})"

    def update(self, pairs: Mapping[Any, tuple[Any, Any]] | Sequence[tuple[Any, Any]]) -> CrossCorrelationSet:
        """Accumulate one batch for several layer pairs at once.

        Parameters
        ----------
        pairs : mapping of name -> (xa, xb), or sequence of (xa, xb)
            A mapping may name any subset of the layer pairs; a sequence gives one pair per
            layer, in order. Each pair follows the rules of :meth:`CrossCorrelation.update`.

        Returns
        -------
        CrossCorrelationSet
            ``self``. Nothing is updated when any pair is invalid.

        Raises
        ------
        KeyError
            A mapping names an unknown layer.
        ValueError, TypeError
            As :meth:`CrossCorrelation.update_many`.
        """
        if isinstance(pairs, Mapping):
            unknown = [k for k in pairs if k not in self._accs]
            if unknown:
                raise KeyError(f"unknown layer pair(s) {unknown!r}; known: {list(self._accs)!r}")
            keys = list(pairs)
            values = [pairs[k] for k in keys]
        else:
            values = list(pairs)
            if len(values) != len(self._accs):
                raise ValueError(f"got {len(values)} pairs for {len(self._accs)} layer pairs")
            keys = list(self._accs)
        _update_many([self._accs[k] for k in keys], values, self._threads, single=False)
        return self

    def merge(self, other: CrossCorrelationSet) -> CrossCorrelationSet:
        """Merge another set with the same layer names and dims into this one (in one core call).

        Raises
        ------
        TypeError
            ``other`` is not a CrossCorrelationSet.
        ValueError
            The layer names or dims differ.
        """
        if not isinstance(other, CrossCorrelationSet):
            raise TypeError(f"can only merge a CrossCorrelationSet, got {type(other).__name__}")
        if list(other._accs) != list(self._accs):
            raise ValueError(f"layer names differ: {list(self._accs)!r} vs {list(other._accs)!r}")
        keys = list(self._accs)
        _merge_many([self._accs[k] for k in keys], [other._accs[k] for k in keys], self._threads)
        return self

    def reset(self) -> CrossCorrelationSet:
        """Forget every sample of every pair."""
        for acc in self._accs.values():
            acc.reset()
        return self


# --------------------------------------------------------------------------- helpers


def conv_to_samples(x: Any) -> Any:
    """Turn (N, C, *spatial) activations into (N * prod(spatial), C) samples.

    Every spatial position of every image is one sample of the C channels (as in Tatro et
    al.'s alignment of convolutional filters), so the result feeds :meth:`CrossCorrelation.update`
    with ``dim = C``. A 2-D (N, C) input is returned as is.

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


def all_reduce_cross_correlation(acc: CrossCorrelation, group: Any = None, device: Any = None) -> CrossCorrelation:
    r"""All-reduce an accumulator across data-parallel workers with ``torch.distributed``.

    Every rank calls it (a collective) after accumulating its own shard; afterwards every
    rank's ``acc`` holds the statistics of all shards together, exactly as if one process had
    seen all the data. Chan's merge is not a plain sum, so the co-moments are first moved to
    the common mean (the parallel-axis theorem), which makes them summable:

    .. math::

        n = \sum_k n_k, \quad \mu = \frac{1}{n}\sum_k n_k \mu_k, \quad
        C = \sum_k \big[ C_k + n_k (\mu_{A,k} - \mu_A)(\mu_{B,k} - \mu_B)^\top \big],

    and likewise for the sums of squares; ranges reduce with MIN and MAX. Each term is centred
    near the global mean, so the sum keeps the accuracy of the single-process accumulator.
    That is four small all-reduces per side plus one of the ``dim_a x dim_b`` matrix (in the
    accumulator dtype). The same recipe works with any all-reduce: take :meth:`~CrossCorrelation.state`,
    reduce as above, rebuild with :meth:`~CrossCorrelation.from_state`.

    Parameters
    ----------
    acc : CrossCorrelation
        This rank's accumulator; updated in place. Ranks that saw no data take part too.
    group : torch.distributed.ProcessGroup, optional
        The process group (default: the world).
    device : torch.device or str, optional
        Where the reduction buffers live: CPU by default (gloo); pass the rank's CUDA device
        for the NCCL backend.

    Returns
    -------
    CrossCorrelation
        ``acc``.

    Raises
    ------
    TypeError
        ``acc`` is not a CrossCorrelation.
    RuntimeError
        torch.distributed is not initialised.

    Examples
    --------
    In each worker of a ``torchrun`` job::

        acc = pyperm.CrossCorrelation(512, 512)
        for xa, xb in my_shard:                      # this rank's activations
            acc.update(xa, xb)
        pyperm.all_reduce_cross_correlation(acc)     # every rank now has the global statistics
        perm = pyperm.linear_sum_assignment(acc.correlation(), maximize=True)[1]
    """
    if not isinstance(acc, CrossCorrelation):
        raise TypeError(f"acc must be a CrossCorrelation, got {type(acc).__name__}")
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    dev = torch.device("cpu") if device is None else torch.device(device)
    f64 = dict(dtype=torch.float64, device=dev)
    SUM, MIN, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX
    s = acc.state()
    n_local = float(s["count"])
    total = torch.tensor([n_local], **f64)
    dist.all_reduce(total, op=SUM, group=group)
    n_total = float(total.item())
    if n_total == 0:
        return acc

    deltas = {}
    out: dict[str, Any] = {"count": int(round(n_total))}
    for side in ("a", "b"):
        mean_k = torch.as_tensor(s[f"mean_{side}"], **f64)
        mean = mean_k * n_local
        dist.all_reduce(mean, op=SUM, group=group)
        mean /= n_total
        delta = mean_k - mean
        m2 = torch.as_tensor(s[f"m2_{side}"], **f64) + n_local * delta * delta
        dist.all_reduce(m2, op=SUM, group=group)
        lo = torch.as_tensor(s[f"min_{side}"], **f64)
        hi = torch.as_tensor(s[f"max_{side}"], **f64)
        dist.all_reduce(lo, op=MIN, group=group)
        dist.all_reduce(hi, op=MAX, group=group)
        deltas[side] = delta
        out.update({f"mean_{side}": mean, f"m2_{side}": m2, f"min_{side}": lo, f"max_{side}": hi})

    comoment = torch.as_tensor(s["comoment"], device=dev)
    if n_local > 0:
        comoment += (n_local * torch.outer(deltas["a"], deltas["b"])).to(comoment.dtype)
    dist.all_reduce(comoment, op=SUM, group=group)
    out["comoment"] = comoment
    merged = CrossCorrelation.from_state(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in out.items()},
                                         threads=acc._threads or None)
    for name in ("_count", "_mom_a", "_mom_b", "_comoment"):
        setattr(acc, name, getattr(merged, name))
    return acc

