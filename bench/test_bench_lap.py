"""pytest-benchmark timings of the assignment solvers (run: pytest bench/test_bench_lap.py).

scipy's benchmark grid: shapes (square, wide, tall) x cost kinds, each solver checked
against scipy's optimum before it is timed, plus the batch and a threaded case that shows
whether the GIL is released. ``--benchmark-group-by=param:case`` puts the solvers of one
case side by side; ``pyperm bench lap`` prints the same comparison with ratios.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pyperm
from pyperm.benchmarks.lap import CASES, batch_solvers, single_solvers

pytest.importorskip("pytest_benchmark")
scipy_optimize = pytest.importorskip("scipy.optimize")

SHAPES = {"square": (512, 512), "wide": (256, 1024), "tall": (1024, 256)}
KINDS = {
    "uniform": lambda rng, s: rng.random(s),
    "spatial": lambda rng, s: np.sqrt(((rng.random((s[0], 1, 2)) - rng.random((1, s[1], 2))) ** 2).sum(-1)),
    "logarithmic": lambda rng, s: np.log(rng.random(s) + 1e-12),
    "integer": lambda rng, s: rng.integers(0, 100, s).astype(np.float64),
    "binary": lambda rng, s: rng.integers(0, 2, s).astype(np.float64),
}
SOLVERS = single_solvers()


def _objective(cost, rows, cols):
    return float(np.asarray(cost, dtype=np.float64)[np.asarray(rows), np.asarray(cols)].sum())


def _checked(solve, cost):
    out = solve(cost)
    if out is None:
        pytest.skip("solver does not take this shape")
    ref = _objective(cost, *scipy_optimize.linear_sum_assignment(cost))
    assert abs(_objective(cost, *out) - ref) <= 1e-6 * max(1.0, abs(ref))


@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_grid(benchmark, solver, kind, shape):
    cost = KINDS[kind](np.random.default_rng(0), SHAPES[shape])
    solve = SOLVERS[solver]
    _checked(solve, cost)
    benchmark.group = f"{shape}-{kind}"
    benchmark(solve, cost)


@pytest.mark.parametrize("solver", list(SOLVERS))
@pytest.mark.parametrize("case", ["uniform-2048", "integers-1024", "lowrank-2048", "float32-2048"])
def test_issue_cases(benchmark, solver, case):
    cost = CASES[case].make(np.random.default_rng(0))
    solve = SOLVERS[solver]
    _checked(solve, cost.astype(np.float64) if solver == "scipy" else cost)
    benchmark.group = case
    benchmark(solve, cost)


@pytest.mark.parametrize("solver", list(batch_solvers(None)))
def test_batch_256x128(benchmark, solver):
    costs = CASES["batch-256x128"].make(np.random.default_rng(0))
    solve = batch_solvers(None)[solver]
    rows, cols = solve(costs)
    ref = sum(_objective(c, *scipy_optimize.linear_sum_assignment(c)) for c in costs)
    assert abs(sum(_objective(c, r, k) for c, r, k in zip(costs, rows, cols)) - ref) < 1e-6
    benchmark.group = "batch-256x128"
    benchmark(solve, costs)


def test_threaded_calls_release_the_gil(benchmark):
    """Four Python threads each solving: near one solve's time per core if the GIL is released."""
    costs = [np.random.default_rng(k).random((600, 600)) for k in range(4)]

    def run():
        threads = [threading.Thread(target=pyperm.linear_sum_assignment, args=(c,)) for c in costs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    benchmark.group = "threaded"
    benchmark(run)
