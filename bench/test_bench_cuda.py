"""GPU rows beside CPU rows for the assignment solvers (pytest-benchmark).

    pytest bench/test_bench_cuda.py --benchmark-group-by=param:case --benchmark-columns=min,median,max

Cases (and their targets, on an H100 against pyperm's CPU solver on 16 cores):
- ``batch1024x128``: 1024 problems of 128 x 128, float32; GPU >= 10x faster than the CPU batch.
- ``single4096``: one 4096 x 4096 problem, float32; GPU <= 0.5x the CPU time.
plus ``batch5x1024`` (the case torch-linear-assignment is reported 20x slower than its CPU
fallback on) and the two GPU strategies forced, to show what the automatic choice picks from.
Every GPU call synchronises (the status flag is read back), so wall-clock timing is fair.
Answers are checked against the CPU solver before anything is timed.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyperm
from pyperm.lap import _cuda as lap_cuda

torch = pytest.importorskip("torch")

CASES = {
    "batch1024x128": (1024, 128, 128),
    "batch5x1024": (5, 1024, 1024),
    "single4096": (None, 4096, 4096),
}
requires_cuda = pytest.mark.skipif(not pyperm.cuda_available(), reason="needs a CUDA device and pyperm's CUDA build")


def _cost(case: str) -> np.ndarray:
    b, n, m = CASES[case]
    rng = np.random.default_rng(0)
    shape = (n, m) if b is None else (b, n, m)
    return rng.random(shape, dtype=np.float32)


def _objective(cost: np.ndarray, cols: np.ndarray) -> np.ndarray:
    cost = cost.reshape(-1, *cost.shape[-2:]).astype(np.float64)
    cols = cols.reshape(len(cost), -1)
    return np.array([c[np.arange(len(k)), k].sum() for c, k in zip(cost, cols)])


def _solve_cpu(cost: np.ndarray):
    if cost.ndim == 2:
        return pyperm.linear_sum_assignment(cost)
    return pyperm.batch_linear_sum_assignment(cost)


@pytest.mark.parametrize("case", list(CASES))
def test_cpu(benchmark, case):
    cost = _cost(case)
    benchmark.extra_info["device"] = "cpu"
    benchmark.pedantic(_solve_cpu, args=(cost,), rounds=3, iterations=1, warmup_rounds=0)


@requires_cuda
@pytest.mark.parametrize("method", ["auto", "block", "device"])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda(benchmark, case, method):
    cost = _cost(case)
    dev = torch.from_numpy(cost).cuda()
    solve = lap_cuda.linear_sum_assignment if cost.ndim == 2 else lap_cuda.batch_linear_sum_assignment

    # Agreement first: the same objective as the CPU solver, problem by problem.
    _, cols, stats = solve(dev, method=method, return_stats=True)
    _, cpu_cols = _solve_cpu(cost)
    np.testing.assert_allclose(_objective(cost, cols.cpu().numpy()), _objective(cost, cpu_cols), rtol=1e-4)
    benchmark.extra_info.update({"device": torch.cuda.get_device_name(), **stats})

    benchmark.pedantic(lambda: solve(dev, method=method), rounds=5, iterations=1, warmup_rounds=1)
