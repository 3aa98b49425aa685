"""``pyperm bench lap --sparse``: pyperm's sparse solver against scipy and lap's ``lapmod``.

Every solver gets the same ``scipy.sparse`` CSR matrix: pyperm's
``linear_sum_assignment`` (which never densifies it), scipy's
``min_weight_full_bipartite_matching`` and lapx's ``lap.lapmod`` (square problems only;
it takes the CSR arrays as ``lapmod(n, data, indptr, indices)``). Each answer is checked
against scipy's objective before it is timed, and the solvers are timed in alternation.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import pyperm
from pyperm._ext import core
from pyperm._tables import text_table
from pyperm.benchmarks._report import kernels, time_calls

# The target on the 20,000 x 20,000 case: pyperm at most this fraction of scipy's time.
SCIPY_GOAL = 0.3


@dataclass
class SparseCase:
    name: str
    n_rows: int
    n_cols: int
    per_row: int


CASES = {
    "2000x2000/10": SparseCase("2000x2000/10", 2000, 2000, 10),
    "20000x20000/20": SparseCase("20000x20000/20", 20000, 20000, 20),
    "5000x20000/20": SparseCase("5000x20000/20", 5000, 20000, 20),
    "20000x5000/5": SparseCase("20000x5000/5", 20000, 5000, 5),
}
GOALS = {"20000x20000/20": SCIPY_GOAL}


def make_problem(case: SparseCase, rng: np.random.Generator):
    """A feasible CSR matrix: ``per_row`` uniform random entries in [1, 2) per row plus a random
    full matching (so that one exists); duplicate positions are summed, none is zero."""
    from scipy import sparse

    n, m = case.n_rows, case.n_cols
    k = min(n, m)
    rows = np.concatenate([np.repeat(np.arange(n), case.per_row), rng.permutation(n)[:k]])
    cols = np.concatenate([rng.integers(0, m, n * case.per_row), rng.permutation(m)[:k]])
    data = 1.0 + rng.random(rows.size)
    cost = sparse.csr_array((data, (rows, cols)), shape=(n, m))
    cost.sum_duplicates()
    return cost


def solvers(cost) -> dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]]:
    """The contenders on ``cost``; lapmod only where lapx is installed and the problem is square."""
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching

    out = {
        "pyperm": lambda: pyperm.linear_sum_assignment(cost),
        "scipy": lambda: min_weight_full_bipartite_matching(cost),
    }
    try:
        import lap
    except ImportError:
        return out
    if hasattr(lap, "lapmod") and cost.shape[0] == cost.shape[1]:
        n = cost.shape[0]

        def lapmod():
            x, _ = lap.lapmod(n, cost.data, cost.indptr, cost.indices, return_cost=False)
            return np.arange(n), np.asarray(x)

        out["lapmod"] = lapmod
    return out


def _objective(cost, rows, cols) -> float | None:
    """The matching's total, or None unless it is a full matching of stored entries."""
    rows, cols = np.asarray(rows), np.asarray(cols)
    k = min(cost.shape)
    if rows.shape != (k,) or len(np.unique(rows)) != k or len(np.unique(cols)) != k:
        return None
    values = np.asarray(cost[rows, cols]).ravel()
    return float(values.sum()) if bool(np.all(values != 0)) else None  # the generated data has no zeros


def run_case(case: SparseCase, rng: np.random.Generator, repeat: int, clock: str) -> list[tuple[str, float | None, str]]:
    """Rows (solver, median seconds or None, note) for one case."""
    cost = make_problem(case, rng)
    contenders = solvers(cost)
    reference = _objective(cost, *contenders["scipy"]())
    checked, results = {}, []
    for name, solve in contenders.items():
        got = _objective(cost, *solve())
        if got is None or reference is None or abs(got - reference) > 1e-9 * max(1.0, abs(reference)):
            results.append((name, None, "WRONG answer"))
        else:
            checked[name] = solve
    timings = time_calls(checked, repeat, clock=clock)
    results += [(name, timings[name].median, "") for name in checked]
    if "lapmod" not in contenders:
        results.append(("lapmod", None, "square only" if case.n_rows != case.n_cols else "not installed"))
    return results


def run(args: argparse.Namespace) -> int:
    """Prints the per-solver table and the ratios; uses ``args.repeat``, ``args.seed``, ``args.clock``
    and ``args.quick`` (the smallest case only)."""
    names = ["2000x2000/10"] if args.quick else list(CASES)
    print(f"pyperm {pyperm.__version__}, sparse solver (one thread), kernels: {kernels()}, "
          f"clock: {args.clock}, medians of {args.repeat}")  # fmt: skip
    rng = np.random.default_rng(args.seed)
    table, summary = [], []
    for name in names:
        case = CASES[name]
        results = run_case(case, rng, args.repeat, args.clock)
        times = {s: t for s, t, _ in results if t is not None}
        for solver, t, note in results:
            table.append([name, solver, None if t is None else 1e3 * t, note])
        ours = times.get("pyperm")
        vs_scipy = ours / times["scipy"] if ours and "scipy" in times else None
        vs_lapmod = ours / times["lapmod"] if ours and "lapmod" in times else None
        goal = GOALS.get(name)
        met = None if goal is None or vs_scipy is None else ("yes" if vs_scipy <= goal else "no")
        summary.append([name, vs_scipy, vs_lapmod, goal, met])
    print(text_table(["case (rows x cols / entries per row)", "solver", "median ms", "note"], table))
    print()
    print(text_table(["case", "pyperm / scipy", "pyperm / lapmod", "goal / scipy", "met"], summary))
    return 0
