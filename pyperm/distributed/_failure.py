"""A rank that fails ends every rank of its group, with an error that names it, instead of leaving the others waiting.

A rank blocked in a collective or a receive cannot be interrupted from Python, and a killed rank
cannot say that it died. So, inside :func:`failure_guard`, every rank of the group keeps a state in
the default group's key-value store (the one ``init_process_group`` made: a file or a TCP store),
under a key of its own that its group's name scopes, and a watchdog thread reads the others':

- ``beat <n>``: inside the block; ``n`` grows every half second while the rank lives;
- ``left``: out of the block (it ended normally, or has not entered it yet): not watched;
- ``failed <error>``: its code raised; the error is recorded at once, before it is re-raised.

A watchdog that sees another rank's ``failed``, or a heartbeat that it has not seen change for
``timeout`` seconds of its own monotonic clock (a rank killed, or stuck), gives its own rank
``grace`` seconds to notice by itself (a collective with a dead peer usually fails at once under
gloo) and then ends the process with the error naming that rank (exit status 1), so that nothing
waits for the process group's own timeout. Staleness is judged only from what this rank saw and
when, so clocks that differ between machines do not matter, and the keys do not depend on how many
times each rank entered a guard before.

A rank whose collective fails because of another rank (a communication error: torch's
``DistError``, or gloo's and NCCL's ``RuntimeError``) raises :class:`RankFailedError` naming that
rank once its record or its stale heartbeat is seen (:class:`RankFailedError` is the communication
layer's, :mod:`pyperm._comm`, which :func:`~pyperm._comm.shared_errors` raises too).
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

from pyperm._comm import RankFailedError, check_group, communication_error

__all__ = ["failure_guard"]

_PREFIX = "pyperm/guard"
_BEAT = 0.5  # seconds between heartbeats
_beats = itertools.count(1)  # every beat of this process a new value, across guards
_active: set[str] = set()  # the groups guarded in this process now (no nesting on one group)


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class _Watch:
    """The heartbeat and the watchdog of one guarded block."""

    def __init__(self, store: Any, prefix: str, rank: int, ranks: list[int], timeout: float, grace: float) -> None:
        self.store, self.prefix, self.rank, self.others = store, prefix, rank, [r for r in ranks if r != rank]
        self.timeout, self.grace = timeout, grace
        self.seen: dict[int, tuple[bytes, float]] = {}  # rank: (its last state, when it was first seen here)
        self.done = threading.Event()
        self.lock = threading.Lock()  # the thread's beat never overwrites the block's "failed" or "left"
        self.beat()
        self.thread = threading.Thread(target=self._run, name="pyperm-failure-watchdog", daemon=True)
        self.thread.start()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def beat(self) -> None:
        with self.lock:
            if not self.done.is_set():
                self.store.set(self._key(self.rank), f"beat {next(_beats)}")

    def _final(self, state: str) -> None:
        with self.lock, contextlib.suppress(Exception):  # a store gone away: the others see that by themselves
            self.done.set()
            self.store.set(self._key(self.rank), state)

    def failed(self, exc: BaseException) -> None:
        self._final(f"failed {type(exc).__name__}: {exc}"[:2000])

    def left(self) -> None:
        self._final("left")

    def failure(self) -> str | None:
        """Which other rank failed, and how (None: none known)."""
        now = time.monotonic()
        for r in self.others:
            key = self._key(r)
            if not self.store.check([key]):
                continue  # not entered yet
            state = self.store.get(key)
            if state.startswith(b"failed "):
                return f"rank {r} failed: {state[7:].decode(errors='replace')}"
            last = self.seen.get(r)
            if last is None or last[0] != state:
                self.seen[r] = (state, now)
            elif state.startswith(b"beat ") and now - last[1] > self.timeout:
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
                noticed = None
                continue
            noticed = noticed or time.monotonic()
            if time.monotonic() - noticed >= self.grace and not self.done.is_set():
                print(f"pyperm: rank {self.rank} ends: {reason}", file=sys.stderr, flush=True)
                os._exit(1)

    def wait_for_cause(self) -> str | None:
        """Another rank's failure, looked for until a killed rank's heartbeat would be stale."""
        deadline = time.monotonic() + self.timeout + 2 * _BEAT
        reason = self.failure()
        while reason is None and time.monotonic() < deadline:
            time.sleep(0.1)  # its record may be on its way
            reason = self.failure()
        return reason

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


@contextlib.contextmanager
def failure_guard(group: Any = None, *, timeout: float = 60.0, grace: float = 5.0) -> Iterator[None]:
    """Run a block on every rank of a group so that one rank's failure ends them all, naming it.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        The ranks watched (default: the world); the keys live in the default group's store. Guards
        of disjoint groups do not see each other; one group may not be guarded twice at once.
    timeout : float, default 60
        Seconds without a heartbeat seen to change (on this rank's monotonic clock) after which
        another rank counts as dead.
    grace : float, default 5
        Seconds a rank gets, once another's failure is known, to raise by itself before its
        watchdog ends the process.

    Raises
    ------
    RankFailedError
        Another rank failed and this one's communication failed with it (this rank's own
        exceptions pass through unchanged, after being written to the store at once).
    ValueError
        A bad ``timeout`` or ``grace``, or ``group`` is guarded already in this process.
    """
    import torch.distributed as dist

    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not (isinstance(grace, (int, float)) and grace >= 0):
        raise ValueError(f"grace must be a non-negative number of seconds, got {grace!r}")
    group, rank, _ = check_group(group)
    pg = dist.group.WORLD if group is None else group
    name = pg.group_name
    if name in _active:
        raise ValueError(f"group: a failure_guard of this group ({name!r}) is running already in this process")
    watch = _Watch(_store(), f"{_PREFIX}/{name}", dist.get_rank(), dist.get_process_group_ranks(pg),
                   float(timeout), float(grace))  # fmt: skip
    _active.add(name)
    try:
        yield
    except RankFailedError:
        watch.left()  # the cause is recorded by the rank that failed
        raise
    except BaseException as exc:
        reason = watch.wait_for_cause() if communication_error(exc) else None
        if reason is not None:
            watch.left()
            raise RankFailedError(f"rank {rank}: {reason}") from exc
        watch.failed(exc)
        raise
    else:
        watch.left()
    finally:
        watch.stop()
        _active.discard(name)
