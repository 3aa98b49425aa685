"""The warm-started solvers behind weight matching: optimal on every problem of a sequence."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment as scipy_lsa

from pyperm import _core
from pyperm.lap.warm import incremental_solver, solve_square_warm


def _best(cost):
    return float(cost[scipy_lsa(cost)].sum())


def _assert_optimal(cost, cols, rtol=1e-9):
    n = cost.shape[0]
    assert cols.dtype == np.int64 and cols.shape == (n,)
    assert np.array_equal(np.sort(cols), np.arange(n)), "not a permutation"
    got = float(cost.astype(np.float64)[np.arange(n), cols].sum())
    ref = _best(cost.astype(np.float64))
    assert abs(got - ref) <= rtol * max(1.0, float(np.abs(cost).sum())), (got, ref)


def _similarity_sequence(rng, n, steps, dtype):
    """Minus weight-matching similarities A P B^T as one group's neighbour moves a few units
    at a time (the sequences weight matching solves), plus some uniform noise."""
    a = rng.standard_normal((n, 3 * n))
    b = rng.standard_normal((n, 3 * n))
    perm = np.arange(3 * n)
    for _ in range(steps):
        moved = rng.choice(3 * n, size=max(2, n // 8), replace=False)
        perm[moved] = perm[rng.permutation(moved)]
        yield (-(a @ b[:, perm].T) + 0.01 * rng.random((n, n))).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 181, 300, 1030])
def test_warm_solve_is_optimal_from_any_duals(n, dtype):
    rng = np.random.default_rng(n)
    cost = rng.random((n, n)).astype(dtype)
    for start in (cost.min(axis=0), np.zeros(n, dtype), rng.standard_normal(n).astype(dtype) * 10):
        duals = np.ascontiguousarray(start, dtype=dtype)
        _assert_optimal(cost, solve_square_warm(cost, duals), rtol=1e-5 if dtype == np.float32 else 1e-9)


@pytest.mark.parametrize("kind", ["zeros", "integers", "binary"])
@pytest.mark.parametrize("n", [300, 1030])
def test_warm_solve_tied_costs(kind, n):
    """Large warm problems scan each row once and cache it only when it is needed again;
    tied costs send rows back and forth between ties and through shortest paths."""
    rng = np.random.default_rng(n)
    cost = {
        "zeros": np.zeros((n, n)),
        "integers": rng.integers(0, 3, (n, n)).astype(float),
        "binary": rng.integers(0, 2, (n, n)).astype(float),
    }[kind]
    for start in (cost.min(axis=0), rng.integers(0, 3, n).astype(float)):
        duals = np.ascontiguousarray(start)
        _assert_optimal(cost, solve_square_warm(cost, duals))
        # Its own final duals again, as weight matching does with the next similarity.
        _assert_optimal(cost, solve_square_warm(cost, duals))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n", [5, 90, 256])
def test_warm_sequence_carries_duals(n, dtype):
    rng = np.random.default_rng(1)
    duals = None
    for cost in _similarity_sequence(rng, n, 6, dtype):
        if duals is None:
            duals = cost.min(axis=0)
        _assert_optimal(cost, solve_square_warm(cost, duals), rtol=1e-5 if dtype == np.float32 else 1e-9)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n", [1, 3, 40, 200])
def test_incremental_solver_follows_in_place_changes(n, dtype):
    """Entries go up and down between solves; every answer is optimal for the current costs."""
    rng = np.random.default_rng(n + 7)
    buffer = np.empty((n, n), dtype)
    solver = None
    for cost in _similarity_sequence(rng, n, 8, dtype):
        buffer[...] = cost
        if solver is None:
            duals = buffer.min(axis=0)
            cols = solve_square_warm(buffer, duals)
            solver = incremental_solver(buffer)
            solver.warm_start(cols, duals)
        else:
            cols = solver.solve()
        _assert_optimal(buffer, cols, rtol=1e-5 if dtype == np.float32 else 1e-9)


def test_incremental_solver_accepts_equal_dtype_objects():
    """An unpickled array's dtype equals float32 without being the same object."""
    cost = pickle.loads(pickle.dumps(np.random.default_rng(3).random((5, 5)).astype(np.float32)))
    _assert_optimal(cost, incremental_solver(cost).solve(), rtol=1e-6)


@pytest.mark.parametrize("kind", ["zeros", "integers", "binary", "column-offsets"])
def test_incremental_solver_tied_costs(kind):
    """Tied costs: the shortest-path search ends at a free column as near as any other."""
    rng = np.random.default_rng(5)
    n = 300
    cost = {
        "zeros": np.zeros((n, n)),
        "integers": rng.integers(0, 3, (n, n)).astype(float),
        "binary": rng.integers(0, 2, (n, n)).astype(float),
        "column-offsets": np.zeros((n, 1)) + rng.integers(0, 4, (1, n)),
    }[kind]
    solver = incremental_solver(cost)
    _assert_optimal(cost, solver.solve())
    cost += rng.integers(0, 2, (n, n))  # then changed in place
    _assert_optimal(cost, solver.solve())


def test_incremental_solver_cold_start_and_ties():
    buffer = np.zeros((6, 6))
    solver = incremental_solver(buffer)
    _assert_optimal(buffer, solver.solve())
    buffer[...] = np.random.default_rng(0).integers(0, 3, (6, 6))
    _assert_optimal(buffer, solver.solve())


def test_warm_errors():
    cost = np.random.default_rng(0).random((4, 4))
    with pytest.raises(TypeError, match="cost must be a float32 or float64"):
        solve_square_warm(cost.astype(np.int64), np.zeros(4))
    with pytest.raises(ValueError, match="square"):
        solve_square_warm(cost[:3], np.zeros(4))
    with pytest.raises(ValueError, match="duals must be a"):
        solve_square_warm(cost, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="duals must be a"):
        solve_square_warm(cost, np.zeros(3))
    with pytest.raises(ValueError, match="writeable C-contiguous"):
        solve_square_warm(cost, np.zeros(8)[::2])
    with pytest.raises(ValueError, match="finite"):
        solve_square_warm(cost, np.array([0.0, np.nan, 0.0, 0.0]))
    for bad in (np.nan, -np.inf):
        broken = cost.copy()
        broken[2, 1] = bad
        with pytest.raises(ValueError, match="invalid numeric entries"):
            solve_square_warm(broken, np.zeros(4))
    big = np.random.default_rng(1).random((300, 300))
    big[299, 5] = np.nan  # a cached-row problem: found as the rows are scanned
    with pytest.raises(ValueError, match="invalid numeric entries"):
        solve_square_warm(big, np.zeros(300))
    # From good duals most rows get one plain scan and no cache: that scan must check too.
    for bad in (np.nan, -np.inf):
        good = np.random.default_rng(2).random((300, 300))
        duals = good.min(axis=0)
        solve_square_warm(good, duals)
        good[123, 45] = bad
        with pytest.raises(ValueError, match="invalid numeric entries"):
            solve_square_warm(good, duals.copy())
    forbidden = np.full((3, 3), np.inf)
    forbidden[0, 0] = 1.0
    with pytest.raises(ValueError, match="infeasible"):
        solve_square_warm(forbidden, np.zeros(3))


def test_incremental_errors():
    with pytest.raises(TypeError, match="float32 or float64"):
        incremental_solver(np.zeros((3, 3), np.int32))
    with pytest.raises(ValueError, match="square C-contiguous"):
        incremental_solver(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="square C-contiguous"):
        incremental_solver(np.asfortranarray(np.arange(16.0).reshape(4, 4)))
    # The binding itself never binds to a converted copy.
    with pytest.raises(TypeError, match="wrong dtype"):
        _core.IncrementalAssignmentF64(np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.IncrementalAssignmentF32(np.zeros((3, 3), np.float32).T.copy(order="F"))
    solver = incremental_solver(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="one entry per row"):
        solver.warm_start(np.arange(2), np.zeros(3))


@pytest.mark.parametrize("incremental_up_to", [1024, 1])  # a bound incremental solver / duals-only warm starts
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_warm_assigner_solves_a_sequence_changed_in_place(incremental_up_to, dtype):
    from pyperm.lap.warm import WarmAssigner

    rng = np.random.default_rng(11)
    assigner = WarmAssigner(incremental_up_to)
    cost = np.empty((40, 40), dtype=dtype)
    for step in _similarity_sequence(rng, 40, 6, dtype):
        cost[...] = step  # the caller changes one buffer in place, as weight matching does
        _assert_optimal(cost, assigner.solve(cost), rtol=1e-9 if dtype == np.float64 else 1e-5)
    assigner.reset()
    _assert_optimal(cost, assigner.solve(cost.copy()), rtol=1e-9 if dtype == np.float64 else 1e-5)


def test_warm_assigner_torch_in_torch_out_and_errors():
    torch = pytest.importorskip("torch")
    from pyperm.lap.warm import WarmAssigner

    cost = torch.tensor([[4.0, 1.0], [2.0, 0.0]])
    cols = WarmAssigner().solve(cost)
    assert isinstance(cols, torch.Tensor) and cols.tolist() == [1, 0]
    with pytest.raises(TypeError, match="cost must be a float32 or float64"):
        WarmAssigner().solve(np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="cost must be a square matrix"):
        WarmAssigner().solve(np.ones((2, 3)))
    with pytest.raises(ValueError, match="incremental_up_to must be at least 1"):
        WarmAssigner(0)
