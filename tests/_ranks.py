"""Run a function on N ranks (gloo, or NCCL on GPUs) (torch.multiprocessing, a file store), with a deadline: never hangs.

``fork`` where no GPU is visible (spawned interpreters spend seconds importing torch again);
``spawn`` where one is (torch refuses backward in a child forked after autograd's device threads
start). Each rank's return value (or its exception's text) comes back through a file.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pyperm._comm import init_process_group


def _entry(rank: int, fn, world: int, tmp: str, args: tuple, backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":  # one device per rank, round robin
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        # Every rank's connections are up before any runs fn: a rank that fails on purpose at
        # once (killed, say) would otherwise break a slower rank's set-up, outside what is tested.
        dist.barrier()
        outcome = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # reported to the test, which decides
        outcome = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(outcome, f)
    if outcome[0] == "ok":
        dist.destroy_process_group()
    else:
        os._exit(1)  # as a failed process would: the others' watchdogs or collectives notice


def run_ranks(fn, world: int, tmp, *args, deadline: float = 120.0, backend: str = "gloo") -> list:
    """``fn(rank, world, *args)`` on every rank of a ``backend`` group; per rank ``("ok", value)``, ``("error", text, traceback)``
    or ``("exit", exitcode)`` when it wrote nothing (killed, or ended by its watchdog)."""
    start = "spawn" if torch.cuda.is_available() else "fork"
    ctx = mp.start_processes(_entry, args=(fn, world, str(tmp), args, backend), nprocs=world, join=False,
                             start_method=start)  # fmt: skip
    end = time.monotonic() + deadline
    for p in ctx.processes:
        p.join(max(0.0, end - time.monotonic()))
    hung = [p for p in ctx.processes if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    if hung:
        raise AssertionError(f"{len(hung)} rank(s) still running after {deadline} s")
    out = []
    for rank, p in enumerate(ctx.processes):
        path = f"{tmp}/rank{rank}.pkl"
        if os.path.exists(path):
            with open(path, "rb") as f:
                out.append(pickle.load(f))
        else:
            out.append(("exit", p.exitcode))
    return out


def values(outcomes: list) -> list:
    """The ranks' return values, or the first error as an assertion."""
    for rank, o in enumerate(outcomes):
        assert o[0] == "ok", f"rank {rank}: {o}"
    return [o[1] for o in outcomes]
