"""cost_limit decided as lap decides it, on every path: in float64 whatever the costs' dtype,
and one rule for maximising (lap's objective mirrored).

lap solves in float64, so a float32 cost at float32(0.1) is above a limit of 0.1, and a pair
at exactly the limit may go either way. The references here are lap itself (lapx) on the
float32 values read as float64, and scipy on lap's extended matrix; answers are compared by
the thresholded objective, summed in float64, with a tolerance far below one float32 ulp of
the costs so that a threshold decided in float32 fails.
"""

import math

import numpy as np
import pytest

import pyperm
from pyperm.lap import _padded_batch, lapjv
from pyperm.testing import iou_cost, limited_objective, limited_reference

lap = pytest.importorskip("lap")

TIGHT = 1e-12  # a float32 ulp near 1 is 6e-8: a float32 decision misses by far more


def _lap_objective(cost32, limit):
    """lap's optimum for float32 costs: lapx on their float64 values (as lap reads them)."""
    cost = cost32.astype(np.float64)
    _, x, _ = lap.lapjv(cost, extend_cost=True, cost_limit=limit)
    rows = np.flatnonzero(x >= 0)
    return limited_objective(cost, rows, x[rows], limit)


def _tracker_costs(rng, count, limit):
    """float32 1 - IoU costs as a tracker makes them, with some entries set to float32(limit):
    the ties at the threshold that a float32 comparison decides the wrong way."""
    for _ in range(count):
        n, m = (int(v) for v in rng.integers(1, 12, 2))
        cost = iou_cost(n, m, rng).astype(np.float32)
        cost[rng.random((n, m)) < 0.3] = np.float32(limit)
        yield cost


def _solvers(limit):
    """Every CPU path that takes a cost limit, each giving the matched (rows, cols) of one matrix."""
    torch = pytest.importorskip("torch")

    def by_lapjv(c):
        _, x, _ = lapjv(c, extend_cost=True, cost_limit=limit)
        rows = np.flatnonzero(x >= 0)
        return rows, x[rows]

    def padded(c):
        stack = np.full((1, c.shape[0] + 2, c.shape[1] + 1), np.nan, dtype=c.dtype)
        stack[0, : c.shape[0], : c.shape[1]] = c
        (pair,) = pyperm.batch_linear_sum_assignment(stack, sizes=[c.shape], cost_limit=limit)
        return pair

    def custom_op(c):
        pyperm.lap.register_torch_ops()
        rows, cols = torch.ops.pyperm.linear_sum_assignment_limited(torch.from_numpy(c), False, limit)
        return rows.numpy(), cols.numpy()

    def device_stack(c):  # the CUDA path's stack builder, run with the CPU stack solver
        problems = _padded_batch.sequence_problems([torch.from_numpy(c)], limit)
        ((rows, cols),) = _padded_batch.solve_problems(
            problems, False, limit, lambda s, mx: pyperm.batch_linear_sum_assignment(s, mx), "cost")
        return rows.numpy(), cols.numpy()

    return {
        "linear_sum_assignment": lambda c: pyperm.linear_sum_assignment(c, cost_limit=limit),
        "list": lambda c: pyperm.batch_linear_sum_assignment([c], cost_limit=limit)[0],
        "padded": padded,
        "lapjv": by_lapjv,
        "custom_op": custom_op,
        "device_stack": device_stack,
    }


@pytest.mark.parametrize("path", ["linear_sum_assignment", "list", "padded", "lapjv", "custom_op", "device_stack"])
def test_float32_thresholds_as_lap_decides_them(path):
    """ByteTrack-style float32 calls with costs at the threshold: lap's optimum on every path."""
    rng = np.random.default_rng(0)
    for limit in (0.8, 0.1, 0.7):
        solve = _solvers(limit)[path]
        for cost in _tracker_costs(rng, 150, limit):
            rows, cols = solve(cost)
            got = limited_objective(cost, rows, cols, limit)
            assert got == pytest.approx(_lap_objective(cost, limit), abs=TIGHT), (path, limit, cost)


def test_the_issues_reproductions():
    """float32(0.1) is above 0.1: nothing matched; 0.3f + 0.7f is below 0.3f + 0.7: both matched."""
    total, x, y = lapjv(np.array([[0.1, 5], [5, 0.1]], np.float32), cost_limit=0.1)
    assert x.tolist() == [-1, -1] and y.tolist() == [-1, -1] and total == 0.0
    _, x, _ = lapjv(np.array([[0.3, 0.3], [0.7, 1.0]], np.float32), cost_limit=0.7)
    assert sorted(x.tolist()) == [0, 1]


def test_a_limit_beyond_float32_range_stays_finite():
    """A float32 stack with a limit above FLT_MAX is the finite-limit problem, on the CPU and in
    the device stack builder (which raised): every pair is worth matching, forbidden ones stay out."""
    cost = np.array([[3e38, np.inf, 1.0], [np.inf, np.inf, -3e38]], dtype=np.float32)
    want = limited_reference(np.where(np.isinf(cost), 1e305, cost.astype(np.float64)), 1e300)
    for name, solve in _solvers(1e300).items():
        rows, cols = solve(cost)
        assert limited_objective(cost, rows, cols, 1e300) == pytest.approx(want, rel=1e-12), name


# ------------------------------------------------------------------ maximize with a cost limit


def test_maximize_mirrors_lap():
    """Maximising C with limit c maximises the matched values minus c / 2 per unmatched row and
    column: minimising -C with limit c, on each CPU form."""
    rng = np.random.default_rng(1)
    for limit in (0.0, 0.3, 1.0, 2.5):
        for _ in range(40):
            n, m = (int(v) for v in rng.integers(1, 8, 2))
            values = rng.uniform(-1.5, 1.5, (n, m))
            want = limited_reference(values, limit, maximize=True)
            assert want == pytest.approx(-limited_reference(-values, limit), abs=1e-9)
            padded = np.zeros((1, n + 1, m + 2))
            padded[0, :n, :m] = values
            answers = [pyperm.linear_sum_assignment(values, True, cost_limit=limit),
                       pyperm.batch_linear_sum_assignment([values], True, cost_limit=limit)[0],
                       pyperm.batch_linear_sum_assignment(padded, True, sizes=[(n, m)], cost_limit=limit)[0]]
            for rows, cols in answers:
                assert limited_objective(values, rows, cols, limit, maximize=True) == pytest.approx(want, abs=1e-9)


def test_maximize_device_stack_mirrors_the_cpu():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    costs = [rng.uniform(-1.0, 1.0, (int(n), int(m))) for n, m in rng.integers(0, 7, (30, 2))]
    for limit in (0.0, 0.4, 1.7):
        want = pyperm.batch_linear_sum_assignment(costs, True, cost_limit=limit)
        got = _padded_batch.solve_problems(
            _padded_batch.sequence_problems([torch.from_numpy(c) for c in costs], limit), True, limit,
            lambda s, mx: pyperm.batch_linear_sum_assignment(s, mx), "costs")
        for c, (r, k), (ref_r, ref_k) in zip(costs, got, want):
            assert limited_objective(c, r.numpy(), k.numpy(), limit, True) == pytest.approx(
                limited_objective(c, ref_r, ref_k, limit, True), abs=1e-9)


def test_maximize_matches_more_pairs_as_the_limit_grows_up_to_inf():
    """One rule from 0 to inf: a pair is matched when its value exceeds -limit, so the count of
    matched pairs never falls as the limit grows, and inf matches every row of the short side."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        n, m = (int(v) for v in rng.integers(1, 9, 2))
        values = rng.uniform(-3.0, 1.0, (n, m))
        counts = [len(pyperm.linear_sum_assignment(values, True, cost_limit=c)[0])
                  for c in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, math.inf)]
        assert counts == sorted(counts), counts
        assert counts[-1] == min(n, m)
    values = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert len(pyperm.linear_sum_assignment(-values, True, cost_limit=0.0)[0]) == 0
    assert len(pyperm.linear_sum_assignment(-values, True, cost_limit=1.5)[0]) == 1  # -1 > -1.5 only
    assert len(pyperm.linear_sum_assignment(-values, True, cost_limit=10.0)[0]) == 2
