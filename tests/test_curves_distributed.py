"""train_curve under torch.distributed: two gloo processes follow the single-process run.

Each process reads the same global batches and keeps its half of each; the all-reduced
gradients are those of the global batch, so the bends (and the loss history) must equal,
to rounding, those of one process training on the whole batches. The model has no
BatchNorm (whose per-shard statistics would differ by design, as under DDP).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pyperm._comm import init_process_group
from pyperm.nn.curves import BezierCurve, PolyChain, train_curve

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with the gloo backend"),
    pytest.mark.slow,  # gloo collectives: 10-20 s on a busy 2-core machine
]

CURVES = {"bezier": (BezierCurve, 1), "polychain": (PolyChain, 2)}


def _problem():
    """The same model, endpoints and global batches in every process (seeded)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    other = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    b = {k: v.detach().clone() for k, v in other.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    # The last batch is odd-sized: shards of 4 and 3 must be weighted by their sizes.
    data = [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (30, 7)]
    return model, a, b, data


def _train(name: str):
    cls, bends = CURVES[name]
    model, a, b, data = _problem()
    curve = cls(model, a, b, num_bends=bends)
    history = train_curve(curve, data, epochs=2, lr=0.1, momentum=0.9, point_decay=1e-3, bend_decay=1e-3, lr_schedule="garipov", seed=7)
    return [p.detach().clone() for p in curve.parameters()], history


def _worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {name: _train(name) for name in CURVES}
        torch.save(results, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_processes_follow_one(tmp_path):
    init_file, out_file = str(tmp_path / "init"), str(tmp_path / "bends")
    # fork: spawned interpreters would spend most of the test importing torch and pyperm
    # again. The workers use one intra-op thread (no OpenMP team inherited across the fork),
    # and a watchdog ends them if they ever hang rather than hanging the test run. Where a GPU
    # is visible, autograd keeps a thread per device once anything has run backward, and torch
    # refuses backward in a child forked after that (seen on an H200): spawn there.
    start = "spawn" if torch.cuda.is_available() else "fork"
    context = mp.start_processes(_worker, args=(2, init_file, out_file), nprocs=2, join=False, start_method=start)
    deadline = time.monotonic() + 300
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.terminate()
            pytest.fail("the two training processes did not finish within 300 s")
    ranks = [torch.load(f"{out_file}.{r}") for r in range(2)]
    assert not dist.is_initialized()
    for name in CURVES:
        single_bends, single_history = _train(name)
        for rank in ranks:
            bends, history = rank[name]
            assert len(bends) == len(single_bends)
            for got, want in zip(bends, single_bends):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert history == pytest.approx(single_history, rel=1e-5)
        # the processes hold identical bends
        for p, q in zip(ranks[0][name][0], ranks[1][name][0]):
            assert torch.equal(p, q)
