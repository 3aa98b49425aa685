r"""C2M3 (:func:`pyperm.nn.align.c2m3.c2m3_merge`) with every model's tensors split over the ranks of a group.

Each rank holds the same keys of every model (any partition of the spec's keys, as
:func:`pyperm.distributed.merge_many` takes them). Everything the Frank-Wolfe search reads is a
sum over the tensors: the objective, its gradient with respect to every (model, group) matrix,
and the line search's Gram matrix of the models' points. Each rank computes the part of its own
tensors and the parts are all-reduced (the gradients as one float64 message per iteration, the
Gram matrix and the values as a few floats), so every rank then holds the same gradients and
solves the same assignment problems to the same permutations: the search sends these sums, not
the relaxed matrices or the models' tensors. The ``"matching"`` start is
:func:`pyperm.distributed.weight_matching` over the same ranks.

The search is one process's on the same arguments, up to the order of summation: the
permutations equal one process's except where a step is within rounding of a tie.
Bytes per iteration: the gradients, ``8 * (models - 1) * sum(n_g ** 2)`` over the groups (the first
model is held), a Blocks inner group's matrices counted per block; at most ``degree`` floats for
the line search.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pyperm._checks import check_nonnegative_real, check_positive_int, torch_generator
from pyperm._comm import Channel, check_same, shared_errors
from pyperm.nn.align._rank_layout import gather_layout
from pyperm.nn.align.c2m3 import C2M3Result, Sums, search
from pyperm.nn.align.over_ranks import _spec_facts, check_shares, weight_matching
from pyperm.nn.permutations import Permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["c2m3_merge"]


class _RankSums(Sums):
    """The search's sums completed over the ranks of a channel's group."""

    def __init__(self, chan: Channel) -> None:
        self.chan = chan

    def values(self, parts: list[float]) -> list[float]:
        return self.chan.all_reduce(parts)

    def tensors(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed as dist

        if not parts:
            return parts
        flat = torch.cat([p.detach().reshape(-1).to(self.chan.device, torch.float64) for p in parts])
        self.chan.bytes_sent += flat.numel() * flat.element_size()
        dist.all_reduce(flat, group=self.chan.group)
        return [t.view_as(p).to(p.device, p.dtype) for t, p in zip(flat.split([p.numel() for p in parts]), parts)]

    def any(self, flag: bool) -> bool:
        return self.chan.all_reduce([float(flag)])[0] > 0


def c2m3_merge(
    spec: PermutationSpec,
    states: Sequence[Mapping[str, torch.Tensor]],
    *,
    group: Any = None,
    weights: Sequence[float] | None = None,
    max_iter: int = 100,
    init: str | Sequence[Mapping[str, Any]] = "matching",
    tol: float = 1e-6,
    seed: int | torch.Generator = 0,
    progress: bool = False,
    anchor: bool = True,
) -> C2M3Result:
    """Cycle-consistent merging of many models (C2M3) with the models' tensors split over ranks (a collective).

    Every rank calls it with its share of every model; every rank returns the same permutations.
    See the module notes for what is sent.

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups (the same on every rank).
    states : sequence of mapping of str to torch.Tensor
        This rank's share of each of at least two models: the same keys in every one, each key on
        exactly one rank, every key of the spec on some rank; a rank may hold none. Tensors on the
        rank's device (the current CUDA device under NCCL).
    group : torch.distributed.ProcessGroup, optional
        The ranks (default: the world).
    weights, max_iter, init, tol, seed, progress, anchor
        As :func:`pyperm.nn.align.c2m3.c2m3_merge` (the same on every rank; ``init`` as permutations
        or a start's name).

    Returns
    -------
    C2M3Result
        As :func:`pyperm.nn.align.c2m3.c2m3_merge`, every rank the same permutations, objectives and
        steps; ``merged`` is this rank's share of the merged model (its keys).

    Raises
    ------
    TypeError, ValueError
        As :func:`pyperm.nn.align.c2m3.c2m3_merge`; or the ranks differ in their arguments.
    pyperm.distributed.RankFailedError
        Another rank failed (its error is named).

    Examples
    --------
    Under ``torchrun``, each rank passes the keys it holds::

        import pyperm.distributed as pd
        mine = [k for i, k in enumerate(spec.axes) if i % world == rank]
        result = pd.c2m3_merge(spec, [{k: s[k] for k in mine} for s in states])
    """
    started = time.perf_counter()
    weights = check_shares(spec, states, weights)
    max_iter = check_positive_int(max_iter, "max_iter")
    tol = check_nonnegative_real(tol, "tol")
    gen = torch_generator(seed)
    chan = Channel(group)
    with shared_errors(chan, "c2m3_merge"):
        check_same(chan, spec=_spec_facts(spec), models=len(states), weights=weights, max_iter=max_iter, tol=tol,
                   init=_fingerprint(init), anchor=anchor,
                   seed=hashlib.sha256(gen.get_state().numpy().tobytes()).hexdigest())  # fmt: skip
        shares = [dict(states[0])]
        for i in range(1, len(states)):  # every model's share against the first's, gathered: the same error everywhere
            try:
                shares.append(gather_layout(spec, states[0], states[i], chan)[1])
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"states[{i}] against states[0]: {exc}") from None

        def match(state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor], seed: int) -> Permutations:
            return weight_matching(spec, state_a, state_b, group=group, seed=seed).perms

        return search(spec, shares, weights, max_iter=max_iter, init=init, tol=tol, gen=gen,
                      progress=progress and chan.rank == 0, anchor=anchor, sums=_RankSums(chan), match=match,
                      started=started)  # fmt: skip


def _fingerprint(init: Any) -> Any:
    """What of ``init`` the ranks must agree on: a start's name, or a digest of the given permutations (for any
    other value its type's name: the search then names what is wrong with it)."""
    if isinstance(init, str):
        return init
    if isinstance(init, Mapping) or not isinstance(init, Sequence) or not all(isinstance(p, Mapping) for p in init):
        return type(init).__name__
    digest = hashlib.sha256()
    for p in init:
        for g in sorted(p):
            digest.update(g.encode() + torch.as_tensor(p[g]).to(torch.int64).numpy().tobytes())
    return digest.hexdigest()
