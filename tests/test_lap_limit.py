"""cost_limit= (lap's threshold) and pyperm.lap.lapjv, against scipy on lap's extended matrix,
a brute force, and lapx's lap.lapjv.

Answers are compared on the thresholded objective (matched costs plus cost_limit / 2 per
unmatched row and column), never on indices: ties allow several optima.
"""

import itertools
import math

import numpy as np
import pytest

import pyperm
from pyperm.lap import lapjv
from pyperm.testing import iou_cost, limited_objective, limited_reference

lap = pytest.importorskip("lap")

LIMITS = [0.2, 0.5, 0.8, 1.5]


def _check_pairs(cost, rows, cols):
    """Matched pairs only: rows increasing, columns distinct, no forbidden pair."""
    n, m = cost.shape
    assert rows.dtype == np.int64 and cols.dtype == np.int64 and rows.shape == cols.shape
    assert np.all(np.diff(rows) > 0)
    assert len(np.unique(cols)) == len(cols)
    assert np.all((rows >= 0) & (rows < n)) and np.all((cols >= 0) & (cols < m))
    assert np.all(np.isfinite(np.asarray(cost, dtype=np.float64)[rows, cols]))


def _check_lapjv_result(cost, x, y):
    """x and y describe one matching, -1 where unmatched."""
    n, m = cost.shape
    assert x.dtype == np.int32 and y.dtype == np.int32 and x.shape == (n,) and y.shape == (m,)
    for i, j in enumerate(x):
        assert j == -1 or (0 <= j < m and y[j] == i)
    for j, i in enumerate(y):
        assert i == -1 or (0 <= i < n and x[i] == j)


def _random_problems(rng, count, max_side=40):
    """Tracker-shaped and uniform costs, 0 to max_side rows and columns."""
    for k in range(count):
        n, m = (int(v) for v in rng.integers(0, max_side + 1, 2))
        if k % 3 == 2:
            yield rng.random((n, m)) * 2.0
        else:
            yield iou_cost(n, m, rng)


def _objective_close(got, want, scale=1.0):
    assert got == pytest.approx(want, rel=1e-9, abs=1e-9 * max(1.0, scale))


# ----------------------------------------------------------------------------- cost_limit


@pytest.mark.parametrize("maximize", [False, True])
def test_limit_matches_extended_matrix(maximize):
    rng = np.random.default_rng(0)
    for cost in _random_problems(rng, 600):
        limit = float(rng.choice(LIMITS))
        if maximize:
            cost = 1.0 - cost  # IoU-like values: high is good
        rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize, cost_limit=limit)
        _check_pairs(cost, rows, cols)
        got = limited_objective(cost, rows, cols, limit, maximize)
        _objective_close(got, limited_reference(cost, limit, maximize), cost.size)


def test_limit_matches_lapx():
    rng = np.random.default_rng(1)
    for cost in _random_problems(rng, 1500):
        limit = float(rng.uniform(0.2, 1.2))
        total, x, y = lapjv(cost, extend_cost=True, cost_limit=limit)
        ref_total, ref_x, ref_y = lap.lapjv(cost, extend_cost=True, cost_limit=limit)
        _check_lapjv_result(cost, x, y)
        rows = np.flatnonzero(x >= 0)
        ref_rows = np.flatnonzero(ref_x >= 0)
        assert total == pytest.approx(float(cost[rows, x[rows]].sum()), rel=1e-12, abs=1e-12)
        # Continuous random costs leave no ties: the same pairs, hence the same total.
        assert total == pytest.approx(ref_total, rel=1e-9, abs=1e-9)
        got = limited_objective(cost, rows, x[rows], limit)
        want = limited_objective(cost, ref_rows, ref_x[ref_rows], limit)
        _objective_close(got, want, cost.size)


def test_limit_inf_without_forbidden_pairs_is_a_full_matching():
    """cost_limit=inf: min(n, m) pairs, scipy's optimum, and lapx's with extend_cost."""
    from scipy.optimize import linear_sum_assignment as scipy_lsa

    rng = np.random.default_rng(2)
    for cost in _random_problems(rng, 300):
        rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=math.inf)
        _check_pairs(cost, rows, cols)
        assert len(rows) == min(cost.shape)
        ref = cost[scipy_lsa(cost)].sum()
        assert cost[rows, cols].sum() == pytest.approx(ref, rel=1e-9, abs=1e-9)
        total, x, _ = lapjv(cost, extend_cost=True)
        ref_total, ref_x, _ = lap.lapjv(cost, extend_cost=True)
        assert total == pytest.approx(ref_total, rel=1e-9, abs=1e-9)
        assert np.count_nonzero(x >= 0) == np.count_nonzero(ref_x >= 0)


def _brute_force(cost, limit, maximize):
    """Best thresholded objective over all matchings (limit inf: most pairs first, then best total)."""
    n, m = cost.shape
    sign = -1.0 if maximize else 1.0
    best = None
    for k in range(min(n, m) + 1):
        for rows in itertools.combinations(range(n), k):
            for cols in itertools.permutations(range(m), k):
                values = cost[list(rows), list(cols)]
                if not np.all(np.isfinite(values)):
                    continue
                if math.isinf(limit):
                    key = (-k, sign * values.sum())
                else:
                    key = (0, sign * limited_objective(cost, list(rows), list(cols), limit, maximize))
                best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("limit", [0.0, 0.6, 2.0, math.inf])
def test_limit_with_forbidden_pairs_against_brute_force(limit, maximize):
    """Forbidden pairs stay unmatched; with inf, as many pairs as they allow, the best of those."""
    rng = np.random.default_rng(3)
    forbidden = -np.inf if maximize else np.inf
    sign = -1.0 if maximize else 1.0
    for _ in range(120):
        n, m = (int(v) for v in rng.integers(0, 5, 2))
        cost = np.round(rng.uniform(-0.5, 1.5, (n, m)), 2)
        cost[rng.random((n, m)) < 0.5] = forbidden
        rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize, cost_limit=limit)
        _check_pairs(cost, rows, cols)
        values = cost[rows, cols]
        if math.isinf(limit):
            got = (-len(rows), sign * values.sum())
        else:
            got = (0, sign * limited_objective(cost, rows, cols, limit, maximize))
        want = _brute_force(cost, limit, maximize)
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-9)


def test_limit_inf_max_cardinality_with_extreme_values():
    """The fallback that weighs one more pair against any total stays exact over a huge range."""
    cost = np.array([[1e300, np.inf, -1e300], [np.inf, np.inf, 5.0], [2.0, np.inf, np.inf]])
    rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=np.inf)  # column 1 is all forbidden
    assert rows.tolist() == [0, 2] and cols.tolist() == [2, 0]
    cost = np.array([[1e300, np.inf], [-1e300, np.inf], [np.inf, np.inf]])
    rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=np.inf)
    assert rows.tolist() == [1] and cols.tolist() == [0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_limit_keeps_precision_and_types(dtype):
    rng = np.random.default_rng(4)
    cost = iou_cost(30, 40, rng).astype(dtype)
    rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=0.7)
    _check_pairs(cost, rows, cols)
    got = limited_objective(cost, rows, cols, 0.7)
    assert got == pytest.approx(limited_reference(cost, 0.7), rel=1e-5 if dtype == np.float32 else 1e-12)
    torch = pytest.importorskip("torch")
    t_rows, t_cols = pyperm.linear_sum_assignment(torch.from_numpy(cost), cost_limit=0.7)
    assert isinstance(t_rows, torch.Tensor) and t_rows.dtype == torch.int64
    assert limited_objective(cost, t_rows.numpy(), t_cols.numpy(), 0.7) == pytest.approx(got)


def test_limit_on_every_batch_form():
    rng = np.random.default_rng(5)
    stack = rng.random((6, 7, 9))
    for result, problems in [
        (pyperm.batch_linear_sum_assignment(stack, cost_limit=0.3), list(stack)),
        (pyperm.batch_linear_sum_assignment(list(stack[:, :4]), cost_limit=0.3), list(stack[:, :4])),
        (pyperm.batch_linear_sum_assignment(stack, sizes=[(7, 9), (0, 3), (2, 9), (7, 1), (5, 5), (7, 0)],
                                            cost_limit=0.3),
         [stack[0], stack[1, :0, :3], stack[2, :2], stack[3, :, :1], stack[4, :5, :5], stack[5, :, :0]]),
    ]:
        assert isinstance(result, list) and len(result) == len(problems)
        for cost, (rows, cols) in zip(problems, result):
            _check_pairs(cost, rows, cols)
            _objective_close(limited_objective(cost, rows, cols, 0.3), limited_reference(cost, 0.3))


def test_limit_empty_and_one_sided():
    for shape in [(0, 0), (0, 5), (5, 0)]:
        rows, cols = pyperm.linear_sum_assignment(np.zeros(shape), cost_limit=1.0)
        assert rows.shape == cols.shape == (0,)


def test_limit_zero_matches_only_negative_costs():
    cost = np.array([[-1.0, 0.5], [0.2, -0.1]])
    rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=0.0)
    assert rows.tolist() == [0, 1] and cols.tolist() == [0, 1]


@pytest.mark.parametrize(
    ("limit", "error", "match"),
    [
        (math.nan, ValueError, "cost_limit must be non-negative"),
        (-0.5, ValueError, "cost_limit must be non-negative"),
        (-math.inf, ValueError, "cost_limit must be non-negative"),
        ([0.5, 1.0], ValueError, r"cost_limit must be a scalar, got shape \(2,\)"),
        (np.array([0.5]), ValueError, r"cost_limit must be a scalar, got shape \(1,\)"),
        ("0.5", TypeError, "cost_limit must be a real number, got str"),
        (1j, TypeError, "cost_limit must be a real number, got complex"),
    ],
)
def test_bad_cost_limit(limit, error, match):
    with pytest.raises(error, match=match):
        pyperm.linear_sum_assignment(np.ones((2, 2)), cost_limit=limit)
    with pytest.raises(error, match=match):
        pyperm.batch_linear_sum_assignment(np.ones((1, 2, 2)), cost_limit=limit)


def test_limit_rejects_invalid_entries():
    with pytest.raises(ValueError, match="matrix contains invalid numeric entries"):
        pyperm.linear_sum_assignment(np.array([[np.nan, 1.0]]), cost_limit=1.0)
    with pytest.raises(ValueError, match="matrix contains invalid numeric entries"):
        pyperm.linear_sum_assignment(np.array([[-np.inf, 1.0]]), cost_limit=np.inf)
    with pytest.raises(ValueError, match="matrix contains invalid numeric entries"):
        pyperm.linear_sum_assignment(np.array([[np.inf, 1.0]]), maximize=True, cost_limit=1.0)


def test_lapjv_of_a_cuda_array_is_refused():
    class FakeCuda:
        __cuda_array_interface__ = {"shape": (2, 2), "typestr": "<f8", "data": (0, False), "version": 3}

    with pytest.raises(ValueError, match="not supported on CUDA yet"):
        lapjv(FakeCuda())


# ----------------------------------------------------------------------------- lapjv


@pytest.mark.parametrize("shape", [(0, 0), (0, 3), (3, 0), (1, 1), (4, 4)])
@pytest.mark.parametrize(("extend", "limit"), [(False, math.inf), (True, math.inf), (False, 0.5), (True, 0.5)])
def test_lapjv_small_shapes_as_lapx(shape, extend, limit):
    cost = np.random.default_rng(6).random(shape)
    got = lapjv(cost, extend, limit)
    want = lap.lapjv(cost, extend, limit)
    assert got[0] == pytest.approx(want[0], abs=1e-12)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    assert got[1].dtype == want[1].dtype == np.int32


def test_lapjv_return_cost_false_and_positional_arguments():
    cost = np.array([[0.1, 0.9, 0.8], [0.7, 0.95, 0.2]])
    x, y = lapjv(cost, True, 0.5, False)
    ref_x, ref_y = lap.lapjv(cost, True, 0.5, False)
    np.testing.assert_array_equal(x, ref_x)
    np.testing.assert_array_equal(y, ref_y)


def test_lapjv_negative_limit_as_lapx():
    cost = np.array([[-2.0, 0.5], [0.3, -0.2]])
    total, x, y = lapjv(cost, cost_limit=-1.0)
    ref_total, ref_x, ref_y = lap.lapjv(cost, cost_limit=-1.0)
    assert total == ref_total and x.tolist() == ref_x.tolist() and y.tolist() == ref_y.tolist()


def test_lapjv_types_and_torch():
    cost = np.array([[1, 2], [3, 0]])
    total, x, y = lapjv(cost)
    assert isinstance(total, float) and total == 1.0 and x.tolist() == [0, 1]
    total, x, y = lapjv(cost.astype(np.float32), extend_cost=np.True_, cost_limit=np.float32(2.5))
    assert total == 1.0
    torch = pytest.importorskip("torch")
    total, x, y = lapjv(torch.tensor([[1.0, 2.0], [3.0, 0.0]]), cost_limit=2.5)
    assert isinstance(x, torch.Tensor) and x.tolist() == [0, 1] and y.tolist() == [0, 1] and total == 1.0


def test_lapjv_leaves_rows_unmatched_where_forbidden_pairs_force_it():
    """lap matches a forbidden pair here and reports inf; pyperm leaves it out."""
    cost = np.array([[1.0, np.inf], [np.inf, np.inf]])
    total, x, y = lapjv(cost)
    assert total == 1.0 and x.tolist() == [0, -1] and y.tolist() == [0, -1]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((np.ones((2, 3)),), {}, ValueError, r"cost must be square unless extend_cost=True or cost_limit is finite"),
        ((np.ones((3, 2)),), {}, ValueError, "cost must be square"),
        ((np.ones(3),), {}, ValueError, "cost must be a 2-D array"),
        ((np.ones((2, 2, 2)),), {}, ValueError, "cost must be a 2-D array"),
        ((np.ones((2, 2)),), {"cost_limit": math.nan}, ValueError, "cost_limit must be finite or"),
        ((np.ones((2, 2)),), {"cost_limit": -math.inf}, ValueError, "cost_limit must be finite or"),
        ((np.ones((2, 2)),), {"cost_limit": None}, TypeError, "cost_limit must be a real number"),
        ((np.ones((2, 2)),), {"cost_limit": "a"}, TypeError, "cost_limit must be a real number"),
        ((np.ones((2, 2)),), {"extend_cost": "yes"}, TypeError, "extend_cost must be a bool"),
        ((np.ones((2, 2)),), {"return_cost": None}, TypeError, "return_cost must be a bool"),
        ((np.array([["a", "b"], ["c", "d"]]),), {}, ValueError, "cost must contain numerical entries"),
    ],
)
def test_lapjv_bad_input_raises_as_lapx(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        lapjv(*args, **kwargs)
    with pytest.raises(error):
        lap.lapjv(*args, **kwargs)


def test_lapjv_rejects_nan():
    with pytest.raises(ValueError, match="matrix contains invalid numeric entries"):
        lapjv(np.array([[np.nan, 1.0], [1.0, 2.0]]))
