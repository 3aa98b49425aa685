"""pytest-benchmark timings of a curve training step (run: pytest bench/test_bench_curves.py).

A plain SGD step of a model and one ``CurveTrainer.step`` of a 1-bend Bezier curve of the
same model, on the same batch, share a benchmark group, so pytest-benchmark's table shows
the curve's overhead directly (goal: at most 1.3x); ``pyperm bench curves`` prints the
ratios. Each case first checks that the curve at t = 0 computes the model's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyperm.benchmarks.curves import DEFAULT_BATCH, build_model
from pyperm.nn.curves import BezierCurve, CurveTrainer

pytest.importorskip("pytest_benchmark")

# ResNet20x4 steps take seconds on a CPU: a few rounds only.
ROUNDS = {"digits-cnn": None, "resnet20x4": 3}


def _setup(name: str):
    model, shape = build_model(name, 0)
    model.train()
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = {k: v.detach().clone() for k, v in build_model(name, 1)[0].state_dict().items()}
    g = torch.Generator().manual_seed(0)
    batch = DEFAULT_BATCH[(name, "cpu")]
    x = torch.randn((batch, *shape), generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return model, a, b, x, y


def _run(benchmark, name, fn):
    if ROUNDS[name] is None:
        benchmark(fn)
    else:
        benchmark.pedantic(fn, rounds=ROUNDS[name], iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("name", list(ROUNDS))
def test_bench_plain_step(benchmark, name):
    benchmark.group = f"training step {name}"
    model, _, _, x, y = _setup(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    _run(benchmark, name, step)


@pytest.mark.parametrize("name", list(ROUNDS))
def test_bench_curve_step(benchmark, name):
    benchmark.group = f"training step {name}"
    model, a, b, x, y = _setup(name)
    curve = BezierCurve(model, a, b).train()
    reference = build_model(name, 0)[0].train()
    reference.load_state_dict(a)
    with torch.no_grad():
        torch.testing.assert_close(curve(x, 0.0), reference(x))
    trainer = CurveTrainer(curve, lr=0.01, momentum=0.9, seed=0)
    _run(benchmark, name, lambda: trainer.step((x,), y))
