"""The process group pyperm talks over, the counted messages between its ranks, and the error of a rank that failed.

The communication layer: it knows nothing of the methods. The methods over ranks
(:mod:`pyperm.nn.align.over_ranks`, the data methods' ``group=``) import it, and so does
:mod:`pyperm.distributed`, the public face, which hands on :class:`Channel`, :func:`check_same` and
:class:`RankFailedError`; nothing here imports either back.

Only operations NCCL has too (``send``/``recv``, ``all_reduce``, ``broadcast``, ``all_gather_object``)
on tensors on the rank's device: CPU tensors for gloo, the rank's current CUDA device for NCCL.
Every tensor sent is counted in :attr:`Channel.bytes_sent` (the payload; the transport's own headers
are not), so that a caller can report the bytes communicated per sweep.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Channel", "RankFailedError", "check_group", "check_same", "comm_device", "communication_error",
           "import_group_defaults", "init_process_group", "shared_errors"]


class RankFailedError(RuntimeError):
    """Another rank of the job failed (raised, was killed, or stopped answering)."""


def import_group_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` unless a process group exists already.

    Its functions take ``group=group.WORLD`` as default arguments, evaluated when the module is
    first imported. Imported after ``init_process_group`` (``torch.export`` imports it through
    ``torch._dynamo``, and pyperm traces models with ``torch.export``), they hold the default group
    for good: ``destroy_process_group`` cannot free it, gloo's threads live on into the
    interpreter's shutdown, and the one that releases a finished collective's tensors there
    aborts the process ("terminate called without an active exception", SIGABRT; torch 2.13).
    Imported before, the defaults are None. Imported after, it would capture the group itself:
    then it is left to whoever imports it.

    Called by :func:`init_process_group` and when :mod:`pyperm.distributed` is imported (which a
    script does before it initialises its group), never by importing :mod:`pyperm.nn`: a library
    import should not import parts of torch the caller did not ask for. A script that initialises
    its own group and uses only :mod:`pyperm.nn` (the data methods' ``group=``) imports
    :mod:`pyperm.distributed`, or this module of torch's, before ``init_process_group`` when it
    destroys the group and traces a model later (see the guide page "Across processes and machines").
    """
    import importlib

    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        importlib.import_module("torch.distributed.nn.functional")


def init_process_group(backend: str, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` for pyperm's own ranks (the command line, the
    benchmarks, the tests), with torch's group defaults imported first (:func:`import_group_defaults`),
    so that ``destroy_process_group`` frees the group whatever is imported later."""
    import torch.distributed as dist

    import_group_defaults()
    dist.init_process_group(backend, **kwargs)


def check_group(group: Any) -> tuple[Any, int, int]:
    """``(group, rank, world size)`` of an initialised process group (None: the world)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of it")
    return group, rank, dist.get_world_size(group)


def comm_device(group: Any) -> torch.device:
    """Where the messages of ``group`` live: the current CUDA device for NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Channel:
    """Counted messages between the ranks of one group (ranks are group ranks)."""

    def __init__(self, group: Any) -> None:
        self.group, self.rank, self.world = check_group(group)
        self.device = comm_device(group)
        self.bytes_sent = 0

    def _global(self, rank: int) -> int:
        import torch.distributed as dist

        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        t = tensor.to(self.device).contiguous()
        self.bytes_sent += t.numel() * t.element_size()
        dist.send(t, self._global(dst), group=self.group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        import torch.distributed as dist

        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, self._global(src), group=self.group)
        return t

    def send_values(self, values: list[float], dst: int) -> None:
        self.send(torch.tensor(values, dtype=torch.float64), dst)

    def recv_values(self, count: int, src: int) -> list[float]:
        return self.recv((count,), torch.float64, src).cpu().tolist()

    def all_reduce(self, values: list[float]) -> list[float]:
        """The sums over the ranks of a few float64 values (counted as one send of them)."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.bytes_sent += t.numel() * t.element_size()
        dist.all_reduce(t, group=self.group)
        return t.cpu().tolist()

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        import torch.distributed as dist

        t = tensor.to(self.device).contiguous()
        if self.rank == src:
            self.bytes_sent += t.numel() * t.element_size()
        dist.broadcast(t, self._global(src), group=self.group)
        return t

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def check_same(chan: Channel | Any = None, **facts: Any) -> None:
    """Refuse to go on unless every rank states the same ``facts`` (and runs the same pyperm).

    ``chan``: a :class:`Channel`, a process group, or None (the world). A collective: every rank raises the same ValueError, naming the ranks that differ from rank 0
    and in what, before any work is done.
    """
    import pyperm

    if not isinstance(chan, Channel):  # a process group, or None for the world
        chan = Channel(chan)
    mine = {"pyperm version": pyperm.__version__, **{k: repr(v) for k, v in facts.items()}}
    every = chan.all_gather_object(mine)
    for rank, theirs in enumerate(every):
        for what in mine:
            if theirs.get(what) != every[0].get(what):
                raise ValueError(f"rank {rank} differs from rank 0 in its {what}: {theirs.get(what)} against "
                                 f"{every[0].get(what)}; every rank must run the same pyperm on the same inputs")


def communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective or message (then another rank may be the cause)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    # gloo and NCCL raise plain RuntimeErrors that name their sources ("gloo/transport/tcp/pair.cc").
    text = str(exc).lower()
    return type(exc) is RuntimeError and ("gloo" in text or "nccl" in text)


_ERRORS = "pyperm/errors"


@contextlib.contextmanager
def shared_errors(chan: Channel, what: str) -> Iterator[None]:
    """Make one rank's error every rank's clear error: the ``RankFailedError`` of the others names it and its cause.

    A collective: enter it on every rank of ``chan``'s group before its first collective. A rank
    whose code raises (anything but a failed communication) records its error in the default
    group's key-value store before re-raising it unchanged; a rank whose communication then fails
    (the failed process ended, so its connections closed) reads that record and raises
    :class:`RankFailedError` naming the rank and the cause, instead of gloo's
    or NCCL's bare "Connection closed by peer". A rank that catches its error and lives on leaves
    the others waiting until the process group's own timeout (as any collective it skips would).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    pg = dist.group.WORLD if chan.group is None else chan.group
    ranks = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    key = f"{_ERRORS}/{pg.group_name}/{{}}"
    store.set(key.format(me), "")  # no record of an earlier call: the collectives below start after every rank's
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, RankFailedError):
            raise
        if not communication_error(exc):
            with contextlib.suppress(Exception):  # the store gone: the others see their own errors
                store.set(key.format(me), f"{type(exc).__name__}: {exc}"[:2000])
            raise
        deadline = time.monotonic() + 1.0  # a record is written before its rank's connections close
        while True:
            for r in ranks:
                if r != me and store.check([key.format(r)]) and (text := store.get(key.format(r))):
                    raise RankFailedError(f"rank {chan.rank}: {what} failed on rank {ranks.index(r)}: "
                                          f"{text.decode(errors='replace')}") from exc
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
