"""The weight-matching objective, its argument checks and its result type.

Shared by the fast implementation of Git Re-Basin's Algorithm 1
(:class:`pyperm.nn.align._matcher.WeightMatcher`), its starts and the plain reference it is
tested against (:mod:`pyperm.nn.align._structured`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pyperm._gather import index_select
from pyperm.nn._checks import check_state
from pyperm.nn.align._similarity import accurate_dot
from pyperm.nn.permutations import Permutations
from pyperm.nn.spec import PermutationSpec


@dataclass
class WeightMatchingResult:
    """What :func:`weight_matching` found.

    Attributes
    ----------
    perms : Permutations
        One permutation per group (int64 CPU tensors), to be used with
        :meth:`Permutations.apply` (or :func:`~pyperm.nn.apply_permutation`) on model B:
        unit ``i`` of the permuted model is unit ``perms[g][i]`` of B.
    objective : list of float
        ``vec(A) . vec(pi(B))`` over the matched tensors: ``objective[0]`` at the initial
        permutations (computed from the weights), ``objective[s]`` after sweep ``s``
        (``objective[0]`` plus the gains of the accepted steps, read off the similarity
        matrices, so exact up to their float32 rounding). Non-decreasing.
    iterations : int
        Sweeps over the groups that were run (at most ``max_iter``).
    converged : bool
        Whether the last sweep improved nothing (otherwise ``max_iter`` stopped the search).
    seconds : dict of str to float
        Where the sweeps' time went: ``"similarity"`` (building and correcting the
        similarity matrices), ``"assignment"`` (the assignment solves) and ``"total"``
        (host clock: on a GPU, work still queued is counted where it is waited for). Empty
        when no sweep ran (a start answered).
    """

    perms: Permutations
    objective: list[float] = field(default_factory=list)
    iterations: int = 0
    converged: bool = False
    seconds: dict[str, float] = field(default_factory=dict)


def _check_dtype(dtype: Any) -> torch.dtype:
    """The precision of the similarity matrices: the assignment solvers take float32 and float64."""
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    return dtype


def _check_state(spec: PermutationSpec, state: Any, name: str) -> dict[str, torch.Tensor]:
    """The spec's entries of ``state``, detached, once it is a state dict that fits the spec."""
    check_state(state, name)
    spec.check_state_dict(state, name)
    return {key: state[key].detach() for key in spec.axes}


def _objective_keys(spec: PermutationSpec, sa: Mapping[str, torch.Tensor], keys: Iterable[str] | None) -> list[str]:
    if keys is None:
        return [k for k in spec.axes if sa[k].is_floating_point()]
    if isinstance(keys, str):
        raise TypeError("keys must be an iterable of state_dict keys, not a single string")
    chosen = list(keys)
    for k in chosen:
        if k not in spec.axes:
            raise ValueError(f"keys names {k!r}, which is not in the spec")
        if not sa[k].is_floating_point():
            raise ValueError(f"keys names {k!r}, whose dtype {sa[k].dtype} is not floating point")
    return list(dict.fromkeys(chosen))


# Bytes of permuted B made at once by the objective (see _permuted_dot).
CHUNK_BYTES = 8 << 20


def _objective(
    spec: PermutationSpec,
    sa: Mapping[str, torch.Tensor],
    sb: Mapping[str, torch.Tensor],
    perms: Mapping[str, torch.Tensor],
    keys: Iterable[str],
) -> float:
    """The objective on validated state dicts; also the finiteness check of every entry it reads."""
    total = 0.0
    # Identity permutations (the usual start) need no gather of B.
    moved = {g for g, p in perms.items() if not torch.equal(p, torch.arange(p.numel(), device=p.device))}
    for key in keys:
        a = sa[key]
        b = sb[key]
        if a.shape != b.shape:
            raise ValueError(f"state_a[{key!r}] has shape {tuple(a.shape)} but state_b has {tuple(b.shape)}")
        indexes = {}
        for ax, g in enumerate(spec.axes[key]):
            if spec.structured:  # Segments, Tiled, Blocks: the spec builds the index
                index = spec.axis_index(key, ax, perms) if set(spec.group_axes) & moved else None
                if index is not None:
                    indexes[ax] = index.to(b.device)
            elif g in moved:
                indexes[ax] = perms[g].to(b.device)
        term = _permuted_dot(a, b, indexes)
        if not math.isfinite(term):
            # A NaN or infinity anywhere in either tensor makes its product non-finite.
            for name, t in (("state_a", sa[key]), ("state_b", sb[key])):
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name}[{key!r}] contains NaN or infinite values")
            raise ValueError(f"the product of state_a[{key!r}] and state_b[{key!r}] overflows")
        total += term
    return total


def _permuted_dot(a: torch.Tensor, b: torch.Tensor, indexes: dict[int, torch.Tensor]) -> float:
    """``sum(a * b')``, with ``b'`` B taken at ``indexes[ax]`` along each axis ``ax`` in it.

    Permuted B is made in chunks of rows (first axis) of at most ``CHUNK_BYTES``, never whole: a
    copy of each tensor in turn, of every size, left the heap 0.17x a Stable Diffusion UNet larger
    than before the objective of a second start (the freed copies are reused by no later request).
    A chunk holds a multiple of 1024 entries where it can, the rows accurate_dot takes, so that
    the sum is the whole tensors' up to the float64 additions of the chunks.
    """
    if not indexes or a.ndim == 0:
        return accurate_dot(a, b.to(a.device))
    per_row = max(a[0].numel(), 1) if a.shape[0] else 1
    align = 1024 // math.gcd(per_row, 1024)  # rows whose entries make whole rows of 1024
    step = max(1, CHUNK_BYTES // (per_row * b.element_size()) // align * align)
    first = indexes.get(0)
    total = 0.0
    for start in range(0, a.shape[0], step):
        count = min(step, a.shape[0] - start)
        part = b.narrow(0, start, count) if first is None else b.index_select(0, first[start:start + count])
        for ax, index in indexes.items():
            if ax:
                part = index_select(part, ax, index)
        total += accurate_dot(a.narrow(0, start, count), part.to(a.device))
    return total
