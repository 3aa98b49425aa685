r"""The streaming cross-correlation accumulator (activation matching statistics).

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
statistics live in a backend state (:mod:`pyperm.xcorr._state`): host arrays updated by the
C++ core with the GIL released, or tensors on a CUDA device updated by the CUDA kernels.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from pyperm._arrays import check_real_dtype, is_cuda_input, is_torch_tensor, to_numpy
from pyperm._checks import check_int, check_positive_int, check_threads
from pyperm.xcorr._state import MAX, MEAN, MIN, CudaMoments, HostMoments, from_fields
from pyperm.xcorr.samples import as_pair, as_vector

__all__ = ["CrossCorrelation"]


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

    *Output.* Statistics are returned as new numpy arrays whatever the host input was (numpy
    or torch CPU tensors): float64 for per-channel vectors, the accumulator ``dtype`` for the
    ``dim_a x dim_b`` matrices. Torch users wrap them with ``torch.from_numpy``; most pass
    ``correlation()`` straight to :func:`pyperm.linear_sum_assignment` with ``maximize=True``.

    *Devices.* An empty accumulator takes the device of the first batch it is given: torch
    CUDA tensors are accumulated on their device by pyperm's CUDA kernels (the batch product
    in ``torch.matmul``), and the statistics are then torch tensors on that device. Later
    batches must be on the same device. :meth:`merge` brings the other accumulator's
    statistics to this one's device; :meth:`state` always gives host arrays.

    *Errors in the data.* A batch with NaN or infinity, or values whose moments or product
    would overflow, is never accumulated, on any device, and its ValueError (naming the
    failing update) is raised no later than the next :meth:`check`, which every read of the
    statistics (and :meth:`merge`) calls first; the accumulator then holds the samples of the
    updates before it, and accumulates again after the error is raised. On the CPU the update
    itself raises. On CUDA an update does not wait for the device: the kernels record the
    first failing update and skip the later ones until the error is raised, so call
    :meth:`check` after an update to learn of it there (one small read back).

    *Threads and streams.* An accumulator may be read from several threads but must be updated
    from one at a time. On CUDA, updates, merges and reads issued on different streams are
    serialised (each waits for the stream of the one before). Pairs of accumulators are
    updated together, in parallel, by :meth:`update_many` or :class:`CrossCorrelationSet`.

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
        self._dim_a = check_positive_int(dim_a, "dim_a")
        self._dim_b = check_positive_int(dim_b, "dim_b")
        self._dtype = _check_accumulator_dtype(dtype)
        self._threads = check_threads(threads)
        self._state: HostMoments | CudaMoments = HostMoments(self._dim_a, self._dim_b, self._dtype)

    # ----------------------------------------------------------------- state

    def reset(self) -> CrossCorrelation:
        """Forget every sample (the workspace and the device are kept). Returns ``self``."""
        self._state = self._state.empty_like()
        return self

    def _device_state_for(self, xa: Any, name: str) -> CudaMoments:
        """The CUDA state a device batch goes into: this accumulator's, or a new one on the
        batch's device when this one is empty (it is kept only once the update succeeds)."""
        if isinstance(self._state, CudaMoments):
            return self._state
        if self.count > 0:
            raise ValueError(f"{name} is a CUDA array, but this accumulator holds CPU statistics: pass {name}.cpu()")
        if not is_torch_tensor(xa) or xa.device.type != "cuda":
            raise TypeError(f"{name} must be a torch CUDA tensor to accumulate on the device")
        return CudaMoments(self._dim_a, self._dim_b, self._dtype, xa.device)

    def release_workspace(self) -> None:
        """Free the scratch buffers kept between updates (they are re-created on demand)."""
        self._state.release_workspace()

    def check(self) -> CrossCorrelation:
        """Raise the error of a bad batch accumulated since the last check, if any (see the class notes).

        Returns
        -------
        CrossCorrelation
            ``self``, when every update so far was accumulated.

        Raises
        ------
        ValueError
            An update's batch held NaN or infinity, or values whose moments or product would
            overflow (found on the device); the message names the update. The accumulator holds
            the samples of the updates before it and accepts updates again.
        """
        self._state.check()
        return self

    def __repr__(self) -> str:
        where = "" if self._state.device is None else f", device={self._state.device}"
        return (
            f"CrossCorrelation(dim_a={self._dim_a}, dim_b={self._dim_b}, dtype={self._dtype.name}, "
            f"count={self.count}{where})"
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
        return self._state.count

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
            infinity in a batch, values so large that the moments overflow, or a batch on
            another device than the accumulator's statistics. The accumulator is unchanged
            when it raises.
        TypeError
            A non-numeric or complex array.

        Examples
        --------
        >>> import numpy as np, pyperm
        >>> acc = pyperm.CrossCorrelation(3, 2)
        >>> acc.update(np.ones((5, 3)), np.zeros((5, 2))).count
        5
        """
        _update_pairs([self], [(xa, xb)], self._threads, single=True)
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
        _update_pairs(list(accumulators), list(pairs), check_threads(threads), single=False)

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
        _merge_pairs([self], [other], self._threads)
        return self

    # ----------------------------------------------------------------- statistics

    def _require_samples(self, what: str, at_least: int = 1) -> None:
        if self.count < at_least:
            raise ValueError(
                f"{what} needs at least {at_least} accumulated sample{'s' if at_least > 1 else ''}, "
                f"have {self.count}: call update() first"
            )

    @property
    def mean_a(self) -> np.ndarray:
        """(dim_a,) float64: channel means of stream A."""
        self._require_samples("mean_a")
        return self._state.row("a", MEAN)

    @property
    def mean_b(self) -> np.ndarray:
        """(dim_b,) float64: channel means of stream B."""
        self._require_samples("mean_b")
        return self._state.row("b", MEAN)

    @property
    def std_a(self) -> np.ndarray:
        """(dim_a,) float64: population standard deviations (ddof=0, as :func:`numpy.std`) of A."""
        self._require_samples("std_a")
        return self._state.std("a")

    @property
    def std_b(self) -> np.ndarray:
        """(dim_b,) float64: population standard deviations (ddof=0) of stream B."""
        self._require_samples("std_b")
        return self._state.std("b")

    @property
    def min_a(self) -> np.ndarray:
        """(dim_a,) float64: smallest value seen per channel of A (-inf when unknown, see :meth:`from_state`)."""
        self._require_samples("min_a")
        return self._state.row("a", MIN)

    @property
    def max_a(self) -> np.ndarray:
        """(dim_a,) float64: largest value seen per channel of A (+inf when unknown)."""
        self._require_samples("max_a")
        return self._state.row("a", MAX)

    @property
    def min_b(self) -> np.ndarray:
        """(dim_b,) float64: smallest value seen per channel of B."""
        self._require_samples("min_b")
        return self._state.row("b", MIN)

    @property
    def max_b(self) -> np.ndarray:
        """(dim_b,) float64: largest value seen per channel of B."""
        self._require_samples("max_b")
        return self._state.row("b", MAX)

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
        ddof = check_int(ddof, "ddof", 0)
        self._require_samples("covariance", ddof + 1)
        return self._state.covariance(ddof, self._threads)

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
        return self._state.correlation(self._threads)

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
        return self._state.cross_product(self._threads)

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
        return self._state.fields()

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
        if isinstance(count, (float, np.floating)) and float(count).is_integer():
            count = int(count)  # an all-reduced count may come back as a float
        count = check_int(count, "count", 0)
        c = to_numpy(comoment, "comoment")
        check_real_dtype(c.dtype, "comoment")
        if c.ndim != 2 or 0 in c.shape:
            raise ValueError(f"comoment must be a non-empty 2-D array, got shape {c.shape}")
        dim_a, dim_b = c.shape
        dtype = c.dtype if c.dtype in (np.float32, np.float64) else np.dtype(np.float64)
        acc = cls(dim_a, dim_b, dtype=dtype, threads=threads)
        fields = {
            "mean_a": (as_vector(mean_a, "mean_a", dim_a), True),
            "mean_b": (as_vector(mean_b, "mean_b", dim_b), True),
            "m2_a": (as_vector(m2_a, "m2_a", dim_a), True),
            "m2_b": (as_vector(m2_b, "m2_b", dim_b), True),
        }
        for name, value, dim, default in (
            ("min_a", min_a, dim_a, -np.inf),
            ("max_a", max_a, dim_a, np.inf),
            ("min_b", min_b, dim_b, -np.inf),
            ("max_b", max_b, dim_b, np.inf),
        ):
            fields[name] = (np.full(dim, default) if value is None else as_vector(value, name, dim), False)
        for name, (arr, must_be_finite) in fields.items():
            bad = ~np.isfinite(arr) if must_be_finite else np.isnan(arr)
            if bad.any():
                raise ValueError(f"{name} contains {'NaN or infinity' if must_be_finite else 'NaN'}")
        if not np.isfinite(c).all():
            raise ValueError("comoment contains NaN or infinity")
        for name in ("m2_a", "m2_b"):
            if (fields[name][0] < 0).any():
                raise ValueError(f"{name} must be non-negative (a sum of squares)")
        if count > 0:
            acc._state.load({"count": int(count), "comoment": c, **{k: v for k, (v, _) in fields.items()}})
        return acc


# --------------------------------------------------------------------------- many accumulators at once


def _update_pairs(accs: list[CrossCorrelation], pairs: list[Any], threads: int, single: bool) -> None:
    """One batch per accumulator: validates everything, then updates host states in one core
    call (all or none change) and CUDA states pair by pair."""
    if len(accs) != len(pairs):
        raise ValueError(f"got {len(accs)} accumulators but {len(pairs)} pairs")
    seen: set[int] = set()
    host: list[tuple[CrossCorrelation, tuple[np.ndarray, np.ndarray, str]]] = []
    device: list[tuple[CrossCorrelation, HostMoments | CudaMoments, tuple[Any, Any, str]]] = []
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
        xa, xb = pair
        if isinstance(acc._state, CudaMoments) or is_cuda_input(xa) or is_cuda_input(xb):
            x, name = (xb, "xb") if is_cuda_input(xb) and not is_cuda_input(xa) else (xa, "xa")
            device.append((acc, acc._device_state_for(x, f"{prefix}{name}"), (xa, xb, prefix)))
            continue
        a, b = as_pair(xa, xb, acc._dim_a, acc._dim_b, prefix)
        if a.shape[0] > 0:
            host.append((acc, (a, b, prefix)))
    if host:
        HostMoments.update_many([acc._state for acc, _ in host], [batch for _, batch in host], threads)
    for acc, state, batch in device:
        CudaMoments.update_many([state], [batch], threads)
        acc._state = state  # an empty host accumulator moves to the device of its first batch


def _merge_pairs(targets: list[CrossCorrelation], sources: list[Any], threads: int) -> None:
    """Adds ``sources[k]``'s samples to ``targets[k]``, in its device (host pairs in one core call)."""
    host: tuple[list, list] = ([], [])
    device: tuple[list, list] = ([], [])
    for acc, other in zip(targets, sources):
        if not isinstance(other, CrossCorrelation):
            raise TypeError(f"can only merge a CrossCorrelation, got {type(other).__name__}")
        if (other._dim_a, other._dim_b) != (acc._dim_a, acc._dim_b):
            raise ValueError(
                f"cannot merge a CrossCorrelation of dims ({other._dim_a}, {other._dim_b}) into one of "
                f"dims ({acc._dim_a}, {acc._dim_b})"
            )
        incoming = other._state
        if type(incoming) is not type(acc._state) or incoming.device != acc._state.device:
            incoming = from_fields(acc._state, incoming.fields())  # to this accumulator's device
        group = device if isinstance(acc._state, CudaMoments) else host
        group[0].append(acc._state)
        group[1].append(incoming)
    if host[0]:
        HostMoments.merge_many(host[0], host[1], threads)
    if device[0]:
        CudaMoments.merge_many(device[0], device[1], threads)
