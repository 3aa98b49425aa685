"""failure_guard with real processes: it ends the ranks of a group whose member failed, and only those."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks

import pyperm.distributed as pd
from pyperm.distributed import _failure


def _store():
    return _failure._store()


def _stay(seconds: float) -> str:
    """Stay inside a guard while its watchdog may end this process (it should not, or it should)."""
    time.sleep(seconds)
    return "not ended"


def _left_early(rank, world):
    with pd.failure_guard(timeout=1, grace=0):
        dist.barrier()
        if rank == 0:
            _store().wait(["test/left"])
            return _stay(3)
    _store().set("test/left", "1")
    return "left"


def test_a_rank_that_left_the_block_is_not_judged_dead(tmp_path):
    # Rank 1 leaves; rank 0 stays three timeouts longer.
    assert run_ranks(_left_early, 2, tmp_path, deadline=60) == [("ok", "not ended"), ("ok", "left")]


def _disjoint(rank, world):
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])
    if rank == 2:
        try:
            with pd.failure_guard(alone, timeout=1, grace=0):
                raise ValueError("rank 2 fails in its own group")
        finally:
            _store().set("test/failed", "1")
    with pd.failure_guard(pair, timeout=1, grace=0):
        _store().wait(["test/failed"])
        return _stay(2)


def test_only_the_given_group_is_watched(tmp_path):
    outcomes = run_ranks(_disjoint, 3, tmp_path, deadline=60)
    assert outcomes[:2] == [("ok", "not ended")] * 2
    assert outcomes[2][:2] == ("error", "ValueError: rank 2 fails in its own group")


def _killed_after_more_guards(rank, world):
    if rank == 0:
        for _ in range(2):  # rank 0 has entered the guard twice more than rank 1
            with pd.failure_guard(timeout=1, grace=0):
                pass
    dist.barrier()
    with pd.failure_guard(timeout=1, grace=0):
        if rank == 1:
            os.kill(os.getpid(), 9)
        return _stay(15)


def test_ranks_that_entered_guards_a_different_number_of_times_watch_each_other(tmp_path):
    assert run_ranks(_killed_after_more_guards, 2, tmp_path, deadline=60) == [("exit", 1), ("exit", -9)]


def _skewed(rank, world, skew):
    if rank == 0:
        real = time.time
        time.time = lambda: real() + skew  # this rank's wall clock is far off the other's
    with pd.failure_guard(timeout=1, grace=0):
        dist.barrier()
        _stay(2.5)
        dist.barrier()
    return "not ended"


@pytest.mark.parametrize("skew", [1e4, -1e4])
def test_clocks_that_differ_between_ranks_kill_nothing(tmp_path, skew):
    assert run_ranks(_skewed, 2, tmp_path, skew, deadline=60) == [("ok", "not ended")] * 2


def _out_of_memory(rank, world):
    with pd.failure_guard(timeout=30, grace=0):
        dist.barrier()
        if rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return _stay(15)


def test_a_ranks_own_error_is_recorded_at_once(tmp_path):
    # With a 30 s timeout, rank 0 ends long before it could judge rank 1's heartbeat stale.
    outcomes = run_ranks(_out_of_memory, 2, tmp_path, deadline=60)
    assert outcomes[0] == ("exit", 1)
    assert outcomes[1][:2] == ("error", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


def _nested(rank, world):
    with pd.failure_guard(timeout=5):
        with pytest.raises(ValueError, match="is running already in this process"):
            with pd.failure_guard(timeout=5):
                pass
    return True


def test_one_group_is_not_guarded_twice_at_once(tmp_path):
    assert run_ranks(_nested, 2, tmp_path, deadline=60) == [("ok", True)] * 2
