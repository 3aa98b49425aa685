"""The accumulators of every layer pair of two networks, under names, updated together."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pyperm._checks import check_threads
from pyperm.xcorr.accumulator import CrossCorrelation, _merge_pairs, _update_pairs

__all__ = ["CrossCorrelationSet"]


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
        _update_pairs([self._accs[k] for k in keys], values, self._threads, single=False)
        return self

    def merge(self, other: CrossCorrelationSet) -> CrossCorrelationSet:
        """Merge another set with the same layer names and dims into this one (host pairs in one core call).

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
        _merge_pairs([self._accs[k] for k in keys], [other._accs[k] for k in keys], self._threads)
        return self

    def reset(self) -> CrossCorrelationSet:
        """Forget every sample of every pair."""
        for acc in self._accs.values():
            acc.reset()
        return self
