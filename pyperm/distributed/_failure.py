"""A rank that fails ends every rank, with an error that names it, instead of leaving the others waiting.

A rank blocked in a collective or a receive cannot be interrupted from Python, and a killed rank
cannot say that it died. So, inside :func:`failure_guard`, every rank keeps a heartbeat in the
process group's key-value store (the one ``init_process_group`` made: a file or a TCP store, nothing
else) and a watchdog thread reads the others':

- a rank whose code raises writes its error to the store before re-raising it;
- a watchdog that sees another rank's error, or a heartbeat older than ``timeout`` seconds (a rank
  killed, or stuck), gives its own rank ``grace`` seconds to notice by itself (a collective with a
  dead peer usually fails at once under gloo) and then ends the process with the error naming that
  rank (exit status 1), so that nothing waits for the process group's own timeout.

A rank that notices a failed collective raises :class:`RankFailedError` naming the failed rank.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["RankFailedError", "failure_guard"]

_PREFIX = "pyperm/guard"
_BEAT = 0.5  # seconds between heartbeats
_generation = itertools.count()


class RankFailedError(RuntimeError):
    """Another rank of the job failed (raised, was killed, or stopped answering)."""


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class _Watch:
    """The heartbeat and the watchdog of one guarded block."""

    def __init__(self, store: Any, rank: int, world: int, timeout: float, grace: float) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout, self.grace = timeout, grace
        self.prefix = f"{_PREFIX}/{next(_generation)}"
        self.done = threading.Event()
        self.beat()
        self.thread = threading.Thread(target=self._run, name="pyperm-failure-watchdog", daemon=True)
        self.thread.start()

    def beat(self) -> None:
        self.store.set(f"{self.prefix}/alive/{self.rank}", repr(time.time()))

    def failed(self, exc: BaseException) -> None:
        self.store.set(f"{self.prefix}/failed/{self.rank}", f"{type(exc).__name__}: {exc}"[:2000])

    def failure(self) -> str | None:
        """Which other rank failed, and how (None: none known)."""
        now = time.time()
        for r in range(self.world):
            if r == self.rank:
                continue
            key = f"{self.prefix}/failed/{r}"
            if self.store.check([key]):
                return f"rank {r} failed: {self.store.get(key).decode(errors='replace')}"
            alive = f"{self.prefix}/alive/{r}"
            if self.store.check([alive]) and now - float(self.store.get(alive)) > self.timeout:
                return f"rank {r} stopped (no heartbeat for {self.timeout:g} s: killed, or stuck)"
        return None

    def _run(self) -> None:
        noticed = None
        while not self.done.wait(_BEAT):
            try:
                self.beat()
                reason = self.failure()
            except Exception:  # the store itself went away (the rank that held a TCP store died)
                reason = "the job's key-value store went away (the rank that held it died?)"
            if reason is None:
                continue
            noticed = noticed or time.monotonic()
            if time.monotonic() - noticed > self.grace and not self.done.is_set():
                print(f"pyperm: rank {self.rank} ends: {reason}", file=sys.stderr, flush=True)
                os._exit(1)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


@contextlib.contextmanager
def failure_guard(group: Any = None, *, timeout: float = 60.0, grace: float = 5.0) -> Iterator[None]:
    """Run a block on every rank so that one rank's failure ends them all, naming it.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        Its ranks are watched (default: the world); the store is the default group's.
    timeout : float, default 60
        Seconds without a heartbeat after which a rank counts as dead.
    grace : float, default 5
        Seconds a rank gets, once another's failure is known, to raise by itself before its
        watchdog ends the process.

    Raises
    ------
    RankFailedError
        Another rank failed and this one's communication failed with it (this rank's own
        exceptions pass through unchanged, after being written to the store).
    """
    import torch.distributed as dist

    from pyperm._comm import check_group

    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not (isinstance(grace, (int, float)) and grace >= 0):
        raise ValueError(f"grace must be a non-negative number of seconds, got {grace!r}")
    group, rank, world = check_group(group)
    watch = _Watch(_store(), dist.get_rank(), dist.get_world_size(), float(timeout), float(grace))
    try:
        yield
    except RankFailedError:
        raise
    except BaseException as exc:
        if isinstance(exc, RuntimeError):  # torch.distributed's errors: another rank's failure seen here?
            # A raising rank's record comes at once; a killed rank's heartbeat goes stale within timeout.
            deadline = time.monotonic() + timeout + 2 * _BEAT
            reason = watch.failure()
            while reason is None and time.monotonic() < deadline:
                time.sleep(0.1)  # its record may be on its way
                reason = watch.failure()
            if reason is not None:
                raise RankFailedError(f"rank {rank}: {reason}") from exc
        watch.failed(exc)
        raise
    finally:
        watch.stop()
