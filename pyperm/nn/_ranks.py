"""Data split over the ranks of a torch.distributed group: the ``group=`` keyword of the data methods.

Every method that reads data (``activation_matching``, ``repair``, ``reset_bn_stats``,
``barrier``, ``evaluate_curve``) takes ``group=``: None runs in this process alone; a process
group means that each of its ranks passes its own share of the data, and the statistics and sums
are all-reduced, so every rank returns what one process returns on all the shares together.

Only ``all_reduce`` (SUM and MAX) is used, on tensors on the group's device (the current CUDA
device for NCCL, the CPU for gloo), so NCCL serves as well as gloo. A rank whose local pass raises
tells the others through :meth:`Ranks.together` (one small all-reduce), so they raise too instead
of waiting in a collective it will never join.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pyperm._comm import RankFailedError, comm_device

__all__ = ["Ranks", "all_reduce_moments", "data_group"]


class Ranks:
    """The ranks of one process group that split a method's data."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.device = comm_device(group)

    def _reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        import torch.distributed as dist

        buf = t.detach().to(self.device, torch.float64).contiguous().clone()
        dist.all_reduce(buf, op=op, group=self.group)
        return buf.to(t.device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The float64 sum of ``t`` over the ranks, on ``t``'s device."""
        import torch.distributed as dist

        return self._reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """The float64 maximum of ``t`` over the ranks, on ``t``'s device."""
        import torch.distributed as dist

        return self._reduce(t, dist.ReduceOp.MAX)

    def same(self, values: Sequence[float], what: str) -> None:
        """Raise ValueError on every rank unless every rank gives the same ``values`` (small ints)."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        # The lengths first: all-reduced tensors of other lengths would fail (or hang) in the backend.
        n = self.max(torch.tensor([len(t), -len(t)], dtype=torch.float64))
        if n[0] != -n[1]:
            raise ValueError(f"group: the ranks differ in {what} (from {int(-n[1])} to {int(n[0])} values); "
                             "every rank must run the same models and method on its share of the data")
        both = self.max(torch.cat([t, -t]))
        high, low = both[: len(t)], -both[len(t):]
        if not torch.equal(high, low):
            raise ValueError(f"group: the ranks differ in {what} (from {low.tolist()} to {high.tolist()}); "
                             "every rank must run the same models and method on its share of the data")

    @contextlib.contextmanager
    def together(self, what: str) -> Iterator[None]:
        """Run this rank's local pass; if any rank's raised, every rank raises (this one its own error).

        One all-reduce of a flag per rank, after the block, so that no rank goes on into the
        collectives that follow while another has stopped.
        """
        flags = torch.zeros(self.world, dtype=torch.float64)
        try:
            yield
        except BaseException:
            flags[self.rank] = 1.0
            self.sum(flags)
            raise
        failed = [r for r, f in enumerate(self.sum(flags).tolist()) if f]
        if failed:
            raise RankFailedError(f"rank {self.rank}: {what} failed on rank(s) {failed} of the group "
                                  "(their own errors say why)")


def data_group(group: Any, name: str = "group") -> Ranks | None:
    """Check a ``group=`` argument: None (this process alone), or a process group this rank belongs to."""
    if group is None:
        return None
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError(f"{name}: this torch was built without torch.distributed; pass {name}=None")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD) "
                        f"or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise ValueError(f"{name} was given but torch.distributed is not initialised: call "
                         f"torch.distributed.init_process_group first, or pass {name}=None")
    try:
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
    except (RuntimeError, ValueError) as exc:  # a group destroyed, or of another job
        raise ValueError(f"{name}: not a live process group of this job ({exc})") from exc
    if rank < 0:
        raise ValueError(f"{name}: this process is not a member of the group")
    return Ranks(group, rank, world)


def all_reduce_moments(ranks: Ranks, moments: Sequence[Any], sizes: Sequence[int | None]) -> None:
    """Make every :class:`~pyperm.nn.eval._moments.Moments` hold the statistics of all ranks' samples.

    ``sizes``: each accumulator's number of units where this rank knows it (None: not reached here).
    Chan's merge moved to the common mean (the parallel-axis theorem) so that it becomes a sum:
    :math:`n = \\sum_k n_k`, :math:`\\mu = \\sum_k n_k \\mu_k / n`,
    :math:`M_2 = \\sum_k [M_{2,k} + n_k (\\mu_k - \\mu)^2]`: exact counts, batches of any size.
    Three all-reduces in all, of every accumulator at once.
    """
    local = [m.mean.numel() if m.mean is not None else (s or 0) for m, s in zip(moments, sizes)]
    units = [int(u) for u in ranks.max(torch.tensor(local, dtype=torch.float64)).tolist()]
    counts, firsts = [], []
    for m, u in zip(moments, units):
        n = float(m.count)
        mean = torch.zeros(u, dtype=torch.float64) if m.mean is None else m.mean.detach().cpu().to(torch.float64)
        if mean.numel() != u:
            raise ValueError(f"group: an accumulator has {mean.numel()} units on rank {ranks.rank}, {u} on another")
        counts.append(n)
        firsts.append(torch.cat([torch.tensor([n], dtype=torch.float64), mean * n]))
    summed = ranks.sum(torch.cat(firsts)) if firsts else torch.zeros(0, dtype=torch.float64)
    seconds, means, at = [], [], 0
    for m, u, n in zip(moments, units, counts):
        total = float(summed[at])
        mean = summed[at + 1: at + 1 + u] / total if total > 0 else torch.zeros(u, dtype=torch.float64)
        at += 1 + u
        means.append((total, mean))
        if m.mean is None:
            seconds.append(torch.zeros(u, dtype=torch.float64))
        else:
            delta = m.mean.detach().cpu().to(torch.float64) - mean
            seconds.append(m.m2.detach().cpu().to(torch.float64) + n * delta * delta)
    m2s = ranks.sum(torch.cat(seconds)) if seconds else torch.zeros(0, dtype=torch.float64)
    at = 0
    for m, u, (total, mean) in zip(moments, units, means):
        device = m.mean.device if m.mean is not None else torch.device("cpu")
        m2 = m2s[at: at + u]
        at += u
        if total > 0:
            m.count, m.mean, m.m2 = int(round(total)), mean.to(device), m2.to(device)
