"""pytest-benchmark timings of the teacher-student analysis (run: pytest bench/test_bench_teacher_student.py).

Each case checks its answer before it is timed. The target: the full uniform width
sweep for K = 5 (10 widths from K to 100, 30 pairs each) in under 30 s on a 2-core machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyperm.teacher_student import population_loss, sample_minimum, teacher_weights, train_gd, width_sweep

pytest.importorskip("pytest_benchmark")

WIDTHS_K5 = [int(m) for m in np.linspace(5, 100, 10).round()]  # 5, 16, 26, ..., 100


def test_bench_width_sweep_uniform_k5(benchmark):
    sweep = width_sweep(5, WIDTHS_K5, source="uniform", pairs=30, seed=0)
    assert sweep.mean("type")[0] == pytest.approx(0.0, abs=1e-14)  # m = K: a permutation of the teacher
    assert np.all(sweep.barriers["type"] <= sweep.barriers["direct"] + 1e-12)
    assert np.all(sweep.barriers["lap"] <= sweep.barriers["direct"] + 1e-12)
    benchmark.pedantic(
        width_sweep, args=(5, WIDTHS_K5), kwargs={"source": "uniform", "pairs": 30, "seed": 0}, rounds=3, iterations=1
    )


def test_bench_exact_loss_batch(benchmark):
    # One width of the sweep: 3 alignments x 30 pairs x 11 points of a width-100 student.
    Wt = teacher_weights(5)
    W = sample_minimum(Wt, 100, seed=list(range(990)))
    assert population_loss(W, Wt).abs().max() < 1e-13
    benchmark(population_loss, W, Wt)


def test_bench_gd_steps(benchmark):
    # 50 steps of 60 runs of width 50 on one tensor (a tiny tol: none stops early).
    Wt = teacher_weights(5)
    kwargs = {"c": 1.0, "steps": 50, "init_scale": 1e-2, "seed": list(range(60)), "tol": 1e-30, "grad_tol": 0.0}
    result = train_gd(Wt, 50, **kwargs)
    assert torch.all(result.steps == 50) and not bool(result.diverged.any())
    benchmark.pedantic(train_gd, args=(Wt, 50), kwargs=kwargs, rounds=3, iterations=1)
