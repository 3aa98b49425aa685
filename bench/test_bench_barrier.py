"""pytest-benchmark timings of barrier, reset_bn_stats and repair (run: pytest bench/test_bench_barrier.py).

Each function shares a benchmark group with its floor, the plain PyTorch loop doing the
same forward passes (loading each interpolated state, or running the BatchNorms in train
mode), so the table shows the overhead of the checks, the float64 statistics and the
state bookkeeping directly. Every case checks its answer against the floor's before it is
timed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pyperm.nn.eval.barrier import barrier
from pyperm.nn.eval.batchnorm import reset_bn_stats
from pyperm.nn.eval.repair import repair

pytest.importorskip("pytest_benchmark")

POINTS = 11


def _mlp(width: int = 256, depth: int = 3, batchnorm: bool = False, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    fan_in = 784
    for _ in range(depth):
        layers += [nn.Linear(fan_in, width)] + ([nn.BatchNorm1d(width)] if batchnorm else []) + [nn.ReLU()]
        fan_in = width
    return nn.Sequential(*layers, nn.Linear(fan_in, 10))


def _data(samples: int = 2048, batch: int = 256, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 784, generator=gen)
    y = torch.randint(0, 10, (samples,), generator=gen)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, samples, batch)]


def _states(model: nn.Module):
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    other = _mlp(seed=1, batchnorm=any(isinstance(m, nn.BatchNorm1d) for m in model.modules()))
    return a, {k: v.detach().clone() for k, v in other.state_dict().items()}


def _floor_barrier(model: nn.Module, a, b, data) -> np.ndarray:
    """The same evaluation written plainly: load each point, sum the batch losses."""
    losses = []
    model.eval()
    with torch.no_grad():
        for t in np.linspace(0.0, 1.0, POINTS):
            model.load_state_dict({k: (1 - t) * a[k] + t * b[k] if a[k].is_floating_point() else a[k] for k in a})
            total = sum(nn.functional.cross_entropy(model(x), y, reduction="sum").item() for x, y in data)
            losses.append(total / sum(len(y) for _, y in data))
    model.load_state_dict(a)
    return np.asarray(losses)


def test_bench_barrier(benchmark):
    benchmark.group = f"barrier: MLP 784-256x3-10, {POINTS} points x 2048 samples"
    model, data = _mlp(), _data()
    a, b = _states(model)
    np.testing.assert_allclose(
        barrier(model, a, b, data, num_points=POINTS).loss, _floor_barrier(model, a, b, data), rtol=1e-5
    )
    benchmark(barrier, model, a, b, data, num_points=POINTS)


def test_bench_barrier_floor(benchmark):
    benchmark.group = f"barrier: MLP 784-256x3-10, {POINTS} points x 2048 samples"
    model, data = _mlp(), _data()
    a, b = _states(model)
    benchmark(_floor_barrier, model, a, b, data)


def _floor_reset(model: nn.Module, data) -> None:
    """torch's own reset: cumulative averages of the batch statistics (momentum=None), train mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for x, _ in data:
            model(x)
    model.eval()


def test_bench_reset_bn_stats(benchmark):
    benchmark.group = "reset_bn_stats: MLP 784-256x3-10 with BatchNorm, 2048 samples"
    model, data = _mlp(batchnorm=True), _data()
    reset_bn_stats(model, data)
    x = torch.cat([x for x, _ in data])
    with torch.no_grad():
        h = model[0](x)
    torch.testing.assert_close(model[1].running_mean, h.mean(0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model[1].running_var, h.var(0), rtol=1e-4, atol=1e-4)
    benchmark(reset_bn_stats, model, data)


def test_bench_reset_bn_stats_floor(benchmark):
    benchmark.group = "reset_bn_stats: MLP 784-256x3-10 with BatchNorm, 2048 samples"
    model, data = _mlp(batchnorm=True), _data()
    benchmark(_floor_reset, model, data)


def test_bench_repair(benchmark):
    # 2 endpoint passes plus 3 rounds (one per hidden layer, each stopping after its layer).
    benchmark.group = "repair: MLP 784-256x3-10, 2048 samples"
    model, data = _mlp(), _data()
    a, b = _states(model)
    repaired = repair(model, None, a, b, data, t=0.5)  # spec None: traced
    assert set(repaired) == set(a)
    benchmark(repair, model, None, a, b, data, t=0.5)


def test_bench_repair_floor(benchmark):
    # Five plain forward passes over the data: what repair's passes cost at the least.
    benchmark.group = "repair: MLP 784-256x3-10, 2048 samples"
    model, data = _mlp(), _data()
    model.eval()

    def passes():
        with torch.no_grad():
            for _ in range(5):
                for x, _ in data:
                    model(x)

    benchmark(passes)
