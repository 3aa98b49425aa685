"""batch_linear_sum_assignment on ragged sequences and padded stacks with sizes, against scipy.

Answers are compared by objective value, not indices: ties allow several optima.
"""

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment as scipy_lsa

import pyperm


def _assert_optimal(cost, rows, cols, maximize=False, rtol=1e-9):
    """A full matching of min(n, m) pairs, rows increasing, with scipy's objective."""
    cost = np.asarray(cost, dtype=np.float64)
    rows, cols = np.asarray(rows), np.asarray(cols)
    k = min(cost.shape)
    assert rows.dtype == np.int64 and cols.dtype == np.int64
    assert rows.shape == cols.shape == (k,)
    assert np.all(np.diff(rows) > 0) and len(np.unique(cols)) == k
    ref_rows, ref_cols = scipy_lsa(cost, maximize=maximize)
    want = cost[ref_rows, ref_cols].sum()
    assert cost[rows, cols].sum() == pytest.approx(want, rel=rtol, abs=rtol)


SHAPES = [(3, 5), (0, 0), (0, 4), (4, 0), (1, 1), (6, 2), (7, 7), (40, 13), (2, 30)]


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("container", [list, tuple])
def test_ragged_sequence_against_scipy(container, maximize):
    rng = np.random.default_rng(0)
    costs = container(rng.random(shape) for shape in SHAPES)
    result = pyperm.batch_linear_sum_assignment(costs, maximize=maximize, threads=2)
    assert isinstance(result, list) and len(result) == len(SHAPES)
    for cost, (rows, cols) in zip(costs, result):
        _assert_optimal(cost, rows, cols, maximize)


def test_ragged_many_random_problems():
    rng = np.random.default_rng(1)
    costs = [rng.integers(0, 20, tuple(rng.integers(0, 25, 2))).astype(np.float64) for _ in range(300)]
    for cost, (rows, cols) in zip(costs, pyperm.batch_linear_sum_assignment(costs)):
        _assert_optimal(cost, rows, cols)


def test_ragged_empty_sequence():
    assert pyperm.batch_linear_sum_assignment([]) == []


def test_ragged_views_and_dtypes():
    """Strided views are read in place; float32 stays float32 when every element is float32."""
    rng = np.random.default_rng(2)
    padded = rng.random((4, 30, 12))
    lengths = [12, 0, 5, 9]
    views = [padded[b, :, :n] for b, n in enumerate(lengths)]
    for cost, (rows, cols) in zip(views, pyperm.batch_linear_sum_assignment(views)):
        _assert_optimal(cost, rows, cols)
    reversed_rows = [padded[0, ::-1], padded[1].T]
    for cost, (rows, cols) in zip(reversed_rows, pyperm.batch_linear_sum_assignment(reversed_rows)):
        _assert_optimal(cost, rows, cols)
    mixed = [padded[0].astype(np.float32), np.arange(12).reshape(3, 4), [[1.0, 2.0], [0.5, 3.0]], padded[2] > 0.5]
    for cost, (rows, cols) in zip(mixed, pyperm.batch_linear_sum_assignment(mixed)):
        _assert_optimal(cost, rows, cols)
    f32 = [c.astype(np.float32) for c in views]
    for cost, (rows, cols) in zip(f32, pyperm.batch_linear_sum_assignment(f32)):
        _assert_optimal(cost, rows, cols, rtol=1e-5)


def test_ragged_torch_elements_give_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    costs = [torch.rand(5, 3, dtype=torch.float64), rng.random((2, 4)), torch.rand(0, 3), torch.rand(6, 6)]
    result = pyperm.batch_linear_sum_assignment(costs)
    for cost, (rows, cols) in zip(costs, result):
        is_tensor = isinstance(cost, torch.Tensor)
        assert isinstance(rows, torch.Tensor) == is_tensor and isinstance(cols, torch.Tensor) == is_tensor
        if is_tensor:
            assert rows.dtype == torch.int64
            cost, rows, cols = cost.numpy(), rows.numpy(), cols.numpy()
        _assert_optimal(cost, rows, cols, rtol=1e-5)


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_padded_with_sizes_against_scipy(dtype, maximize):
    """DETR's form: queries x padded targets, problem b is costs[b, :n_b, :m_b]."""
    rng = np.random.default_rng(4)
    costs = rng.random((12, 30, 8)).astype(dtype)
    sizes = np.stack([rng.integers(0, 31, 12), rng.integers(0, 9, 12)], axis=1)
    sizes[0] = (30, 8)
    sizes[1] = (0, 0)
    sizes[2] = (30, 0)
    sizes[3] = (0, 5)
    result = pyperm.batch_linear_sum_assignment(costs, maximize=maximize, sizes=sizes)
    assert isinstance(result, list) and len(result) == 12
    for b, (rows, cols) in enumerate(result):
        n, m = sizes[b]
        _assert_optimal(costs[b, :n, :m], rows, cols, maximize, rtol=1e-5 if dtype == np.float32 else 1e-9)


def test_padded_sizes_forms_and_torch():
    torch = pytest.importorskip("torch")
    costs = torch.rand(3, 5, 4)
    for sizes in ([(5, 4), (2, 3), (0, 1)], torch.tensor([[5, 4], [2, 3], [0, 1]]), np.array([[5, 4], [2, 3], [0, 1]])):
        result = pyperm.batch_linear_sum_assignment(costs, sizes=sizes)
        for b, (rows, cols) in enumerate(result):
            assert isinstance(rows, torch.Tensor) and isinstance(cols, torch.Tensor)
            n, m = (int(v) for v in np.asarray(sizes)[b])
            _assert_optimal(costs[b, :n, :m].numpy(), rows.numpy(), cols.numpy(), rtol=1e-5)


def test_padded_non_contiguous_stack():
    rng = np.random.default_rng(5)
    costs = rng.random((6, 9, 10))[:, ::2, 1:]
    sizes = [(5, 9), (1, 1), (3, 7), (5, 0), (2, 9), (4, 4)]
    for b, (rows, cols) in enumerate(pyperm.batch_linear_sum_assignment(costs, sizes=sizes)):
        n, m = sizes[b]
        _assert_optimal(costs[b, :n, :m], rows, cols)


def test_padded_empty_batch():
    assert pyperm.batch_linear_sum_assignment(np.ones((0, 3, 4)), sizes=[]) == []
    assert pyperm.batch_linear_sum_assignment(np.ones((0, 3, 4)), cost_limit=1.0) == []


def test_stack_without_sizes_keeps_its_arrays():
    costs = np.random.default_rng(6).random((3, 4, 6))
    rows, cols = pyperm.batch_linear_sum_assignment(costs)
    assert rows.shape == cols.shape == (3, 4)


def test_infeasible_and_invalid_problems_are_named():
    bad = np.ones((2, 2))
    bad[0] = np.inf
    with pytest.raises(ValueError, match="problem 2: cost matrix is infeasible"):
        pyperm.batch_linear_sum_assignment([np.ones((2, 3)), np.ones((0, 2)), bad, bad])
    with pytest.raises(ValueError, match="problem 1: matrix contains invalid numeric entries"):
        pyperm.batch_linear_sum_assignment([np.ones((2, 3)), np.array([[np.nan]])])
    stack = np.ones((3, 2, 2))
    stack[1, 1, 1] = np.nan
    with pytest.raises(ValueError, match="problem 1: matrix contains invalid"):
        pyperm.batch_linear_sum_assignment(stack, sizes=[(2, 2), (2, 2), (1, 1)])
    # The NaN lies outside problem 1's (1, 1) block, so nothing is wrong.
    assert len(pyperm.batch_linear_sum_assignment(stack, sizes=[(2, 2), (1, 1), (1, 1)])) == 3


@pytest.mark.parametrize(
    ("costs", "error", "match"),
    [
        ([np.ones((2, 2)), np.ones(3)], ValueError, r"costs\[1\] must be a 2-D array, got shape \(3,\)"),
        ([np.ones((2, 2, 2))], ValueError, r"costs\[0\] must be a 2-D array"),
        ([np.ones((2, 2)), 5.0], ValueError, r"costs\[1\] must be a 2-D array, got shape \(\)"),
        ([np.ones((2, 2)), np.array([["a"]])], TypeError, r"costs\[1\] must contain numerical entries"),
        ([np.ones((2, 2)), np.ones((2, 2), complex)], TypeError, r"costs\[1\] must be real"),
        ([[[1.0, 2.0], [3.0]]], ValueError, r"costs\[0\] could not be read as an array"),
    ],
)
def test_bad_ragged_elements(costs, error, match):
    with pytest.raises(error, match=match):
        pyperm.batch_linear_sum_assignment(costs)


@pytest.mark.parametrize(
    ("sizes", "error", "match"),
    [
        ([(2, 2), (2, 2)], ValueError, r"sizes must have shape \(B, 2\) = \(3, 2\).*got shape \(2, 2\)"),
        ([2, 2, 2], ValueError, r"sizes must have shape \(B, 2\)"),
        ([(2, 2), (4, 1), (1, 1)], ValueError, r"sizes\[1\] = \(4, 1\) is out of range .* 0 <= n_b <= 3"),
        ([(2, 2), (1, 1), (1, -1)], ValueError, r"sizes\[2\] = \(1, -1\) is out of range"),
        ([(2, 2), (1, 1), (1, 5)], ValueError, r"sizes\[2\] = \(1, 5\) is out of range"),
        ([(2.0, 2.0), (1, 1), (1, 1)], TypeError, "sizes must hold integers"),
        ("ab", TypeError, "sizes must hold integers"),
    ],
)
def test_bad_sizes(sizes, error, match):
    with pytest.raises(error, match=match):
        pyperm.batch_linear_sum_assignment(np.ones((3, 3, 4)), sizes=sizes)


def test_sizes_need_a_padded_stack():
    with pytest.raises(ValueError, match="sizes applies to a padded"):
        pyperm.batch_linear_sum_assignment([np.ones((2, 2))], sizes=[(2, 2)])
    with pytest.raises(ValueError, match="costs must be a 3-D array"):
        pyperm.batch_linear_sum_assignment(np.ones((2, 2)), sizes=[(2, 2)])


def test_threads_give_the_same_answers():
    """Enough work to spread over threads: each problem's answer does not depend on them."""
    rng = np.random.default_rng(7)
    costs = rng.random((48, 120, 40))
    sizes = np.stack([rng.integers(0, 121, 48), rng.integers(0, 41, 48)], axis=1)
    one = pyperm.batch_linear_sum_assignment(costs, sizes=sizes, threads=1)
    for threads in (2, 4, None):
        for (r1, c1), (r2, c2) in zip(one, pyperm.batch_linear_sum_assignment(costs, sizes=sizes, threads=threads)):
            np.testing.assert_array_equal(r1, r2)
            np.testing.assert_array_equal(c1, c2)
    for b, (rows, cols) in enumerate(one):
        n, m = sizes[b]
        _assert_optimal(costs[b, :n, :m], rows, cols)


def test_pipelines_bench_runs(capsys):
    """``pyperm bench lap --pipelines`` checks every answer before timing, then prints its tables."""
    pytest.importorskip("lap")
    from pyperm.cli import main

    assert main(["bench", "lap", "--pipelines", "--repeat", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "pyperm (padded + sizes)" in out and "pyperm.lap.lapjv" in out and "goal" in out
