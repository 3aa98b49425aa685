"""pyperm.linear_sum_assignment and batch_linear_sum_assignment against scipy.

Answers are compared by objective value, not indices: ties allow several optima.
"""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.optimize import linear_sum_assignment as scipy_lsa

import pyperm
from pyperm import _core

from _matchings import check_full_matching

ISAS = ["baseline", "avx2", "avx512"]


def _objective(cost, rows, cols):
    return float(np.asarray(cost, dtype=np.float64)[rows, cols].sum())


def _check_matching(cost, rows, cols):
    check_full_matching(cost.shape, rows, cols)


def _assert_optimal(cost, rows, cols, maximize=False, rtol=1e-9):
    _check_matching(cost, rows, cols)
    ref = _objective(cost, *scipy_lsa(np.asarray(cost, dtype=np.float64), maximize=maximize))
    got = _objective(cost, rows, cols)
    scale = max(1.0, float(np.abs(np.asarray(cost, dtype=np.float64)[np.isfinite(cost)]).sum(initial=0.0)))
    assert abs(got - ref) <= rtol * scale, (got, ref)


# ------------------------------------------------------------------ cost families
def uniform(rng, n, m):
    return rng.random((n, m))


def integers_with_ties(rng, n, m):
    return rng.integers(0, 5, (n, m)).astype(float)


def low_rank_planted(rng, n, m):
    k = 4
    a = rng.standard_normal((n, k))
    b = rng.standard_normal((m, k))
    b[: min(n, m)] = a[rng.permutation(n)[: min(n, m)]] + 0.05 * rng.standard_normal((min(n, m), k))
    return -(a @ b.T)


def euclidean(rng, n, m):
    x, y = rng.random((n, 2)), rng.random((m, 2))
    return np.sqrt(((x[:, None] - y[None]) ** 2).sum(-1))


def logarithmic(rng, n, m):
    return np.log(rng.random((n, m)) + 1e-12)


def binary(rng, n, m):
    return rng.integers(0, 2, (n, m)).astype(float)


def offsets(rng, n, m):
    """Random row and column offsets on top of uniform noise: hard for greedy starts."""
    return rng.random((n, m)) + 100 * rng.random((n, 1)) + 100 * rng.random((1, m))


FAMILIES = [uniform, integers_with_ties, low_rank_planted, euclidean, logarithmic, binary, offsets]
SHAPES = [(1, 1), (2, 2), (7, 7), (33, 33), (100, 100), (5, 17), (17, 5), (40, 130), (130, 40), (257, 257)]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("maximize", [False, True])
def test_matches_scipy_float64(family, shape, maximize):
    rng = np.random.default_rng(hash((family.__name__, shape, maximize)) % 2**32)
    cost = family(rng, *shape)
    rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize)
    _assert_optimal(cost, rows, cols, maximize)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(50, 50), (30, 70), (70, 30), (200, 200)], ids=str)
def test_float32_solved_in_own_precision(family, shape):
    rng = np.random.default_rng(7)
    cost = family(rng, *shape).astype(np.float32)
    rows, cols = pyperm.linear_sum_assignment(cost)
    # float32 rounding of the duals may cost a few ulps of the total.
    _assert_optimal(cost, rows, cols, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 3), (9, 9), (64, 64), (61, 97), (97, 61), (300, 300)], ids=str)
def test_every_kernel_variant(isa, dtype, shape):
    """Each SIMD variant (one falls back to the best the CPU has) finds an optimum, tails included."""
    rng = np.random.default_rng(3)
    for family in (uniform, integers_with_ties, offsets):
        cost = family(rng, *shape).astype(dtype)
        rows, cols = _core.lap_solve(np.ascontiguousarray(cost), False, isa)
        _assert_optimal(cost, rows, cols, rtol=1e-5 if dtype == np.float32 else 1e-9)


def test_larger_problems():
    rng = np.random.default_rng(11)
    for family in (uniform, integers_with_ties, low_rank_planted, offsets):
        cost = family(rng, 700, 700)
        _assert_optimal(cost, *pyperm.linear_sum_assignment(cost))
    cost = uniform(rng, 300, 1200)
    _assert_optimal(cost, *pyperm.linear_sum_assignment(cost))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tall_problems_read_in_place(isa, dtype):
    """A tall minimisation with row caches (from 32768 entries) is solved on the matrix as it is stored:
    its caches come from one pass over the rows, and a search that needs a whole row transposes it then.
    Forbidden entries, ties, odd widths (vector tails) and invalid entries go through that pass."""
    rng = np.random.default_rng(5)
    for shape in [(1200, 300), (997, 61), (5000, 7)]:
        for family in (uniform, integers_with_ties, low_rank_planted, offsets):
            cost = family(rng, *shape).astype(dtype)
            if family is uniform:
                cost[rng.random(shape) < 0.5] = np.inf
            rows, cols = _core.lap_solve(np.ascontiguousarray(cost), False, isa)
            _assert_optimal(cost, rows, cols, rtol=1e-5 if dtype == np.float32 else 1e-9)
    cost = uniform(rng, 1200, 301).astype(dtype)
    cost[1100, 300] = np.nan
    with pytest.raises(ValueError, match="invalid"):
        pyperm.linear_sum_assignment(cost)
    cost[1100, 300] = -np.inf
    with pytest.raises(ValueError, match="invalid"):
        pyperm.linear_sum_assignment(cost)
    cost[1100, 300] = 0.5
    cost[:, 17] = np.inf
    with pytest.raises(ValueError, match="infeasible"):
        pyperm.linear_sum_assignment(cost)


def rows_of_scales(rng, n, m):
    """Uniform rows scaled by factors from 1e-3 to 1e3: the row scans' guess of a row's smallest entries,
    carried over from the row before, is often too low (the row is scanned again) or far too high."""
    return rng.random((n, m)) * 10.0 ** rng.uniform(-3, 3, (n, 1)) - 10.0 ** rng.uniform(-3, 3, (n, 1))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_caches_of_wide_and_square_problems(isa, dtype):
    """Problems with row caches (from 32768 entries) fill each row's cache in one pass, which guesses from
    the row before which entries can be among the smallest and scans the row again when it guessed too low;
    from 2^21 entries the rows are split over threads. Guesses that miss, rows with fewer finite entries
    than a cache holds, ties, odd widths (vector tails) and invalid entries go through that pass."""
    rng = np.random.default_rng(9)
    for shape in [(300, 1200), (61, 997), (7, 5000), (300, 300), (700, 3000)]:
        for family in (uniform, integers_with_ties, low_rank_planted, offsets, rows_of_scales):
            cost = family(rng, *shape).astype(dtype)
            if family is uniform:
                finite = cost.copy()
                cost[rng.random(shape) < 0.5] = np.inf
                cost[::3] = np.inf  # rows with 5 finite entries
                for i in range(0, shape[0], 3):
                    keep = rng.choice(shape[1], 4)
                    cost[i, keep] = finite[i, keep]
                diagonal = np.arange(shape[0])
                cost[diagonal, diagonal] = finite[diagonal, diagonal]  # feasible
            rows, cols = _core.lap_solve(np.ascontiguousarray(cost), False, isa)
            _assert_optimal(cost, rows, cols, rtol=1e-5 if dtype == np.float32 else 1e-9)
    for shape in [(300, 1201), (700, 3000), (400, 400)]:
        for where in [(shape[0] // 2, shape[1] - 1), (shape[0] - 1, 0), (0, shape[1] - 1)]:
            for bad in (np.nan, -np.inf):
                cost = uniform(rng, *shape).astype(dtype)
                cost[where] = bad
                with pytest.raises(ValueError, match="invalid"):
                    _core.lap_solve(cost, False, isa)
        cost = uniform(rng, *shape).astype(dtype)
        cost[:, : shape[1] - 10] = np.inf
        cost[:12, -10:] = np.inf  # 12 rows with no finite entry left
        with pytest.raises(ValueError, match="infeasible"):
            _core.lap_solve(cost, False, isa)


def test_constant_matrix_gives_identity():
    for n in (1, 2, 8, 100):
        rows, cols = pyperm.linear_sum_assignment(np.ones((n, n)))
        np.testing.assert_array_equal(rows, np.arange(n))
        np.testing.assert_array_equal(cols, np.arange(n))
    rows, cols = pyperm.linear_sum_assignment(np.full((3, 8), 2.5))
    np.testing.assert_array_equal(cols, [0, 1, 2])
    rows, cols = pyperm.linear_sum_assignment(np.full((8, 3), 2.5))
    np.testing.assert_array_equal(rows, [0, 1, 2])


def test_planted_permutation_recovered():
    rng = np.random.default_rng(5)
    n = 500
    perm = rng.permutation(n)
    cost = rng.random((n, n)) + 10.0
    cost[np.arange(n), perm] = 0.0
    rows, cols = pyperm.linear_sum_assignment(cost)
    np.testing.assert_array_equal(cols, perm)


@pytest.mark.parametrize("shape", [(0, 0), (0, 3), (3, 0)])
def test_empty(shape):
    rows, cols = pyperm.linear_sum_assignment(np.zeros(shape))
    assert rows.shape == (0,) and cols.shape == (0,)
    assert rows.dtype == np.int64 and cols.dtype == np.int64


@pytest.mark.parametrize("dtype", [bool, np.int8, np.int32, np.int64, np.uint16, np.float16])
def test_other_real_dtypes_go_to_float64(dtype):
    cost = (np.arange(16).reshape(4, 4) % 3).astype(dtype)
    rows, cols = pyperm.linear_sum_assignment(cost)
    _assert_optimal(cost.astype(np.float64), rows, cols)


def test_lists_and_non_contiguous_input():
    cost = [[4, 1, 3], [2, 0, 5], [3, 2, 2]]
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert cols.tolist() == [1, 0, 2]
    big = np.random.default_rng(0).random((60, 80))
    view = big[::2, ::3]  # strided
    _assert_optimal(view, *pyperm.linear_sum_assignment(view))
    _assert_optimal(big.T, *pyperm.linear_sum_assignment(big.T))  # Fortran order


def test_input_is_not_modified():
    cost = np.random.default_rng(0).random((20, 30))
    before = cost.copy()
    pyperm.linear_sum_assignment(cost, maximize=True)
    pyperm.linear_sum_assignment(cost.T)
    np.testing.assert_array_equal(cost, before)


# ------------------------------------------------------------------ forbidden pairs and errors
def test_forbidden_entries_are_avoided():
    inf = np.inf
    cost = np.array([[inf, 1, 5], [1, inf, 2], [3, 4, inf]])
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert np.isfinite(cost[rows, cols]).all()
    _assert_optimal(cost, rows, cols)
    rows, cols = pyperm.linear_sum_assignment(-cost, maximize=True)
    assert np.isfinite(cost[rows, cols]).all()


def test_forbidden_random_sparse_pattern():
    rng = np.random.default_rng(2)
    for shape in [(60, 60), (40, 90), (90, 40)]:
        cost = rng.random(shape)
        mask = rng.random(shape) < 0.7
        cost[mask] = np.inf
        try:
            ref = scipy_lsa(cost)
        except ValueError:
            with pytest.raises(ValueError, match="infeasible"):
                pyperm.linear_sum_assignment(cost)
            continue
        rows, cols = pyperm.linear_sum_assignment(cost)
        assert abs(_objective(cost, rows, cols) - _objective(cost, *ref)) < 1e-9


@pytest.mark.parametrize(
    "cost",
    [
        [[np.inf, np.inf], [1.0, 2.0]],  # a row with nothing allowed
        [[np.inf, 1.0], [np.inf, 2.0]],  # a column with nothing allowed
        [[1.0, np.inf, np.inf], [2.0, np.inf, np.inf], [3.0, 4.0, 5.0]],  # Hall's condition fails
        [[1.0, 2.0, 3.0], [np.inf, np.inf, np.inf]],  # wide, one row blocked
    ],
)
def test_infeasible(cost):
    with pytest.raises(ValueError, match="cost matrix is infeasible"):
        pyperm.linear_sum_assignment(np.array(cost))


@pytest.mark.parametrize(
    "cost, maximize",
    [
        ([[1.0, np.nan], [0.0, 1.0]], False),
        ([[1.0, np.nan], [0.0, 1.0]], True),
        ([[1.0, -np.inf], [0.0, 1.0]], False),
        ([[1.0, np.inf], [0.0, 1.0]], True),
        ([[1.0, 2.0, np.nan], [0.0, 1.0, 2.0]], False),  # wide
        ([[1.0, 2.0], [0.0, 1.0], [-np.inf, 2.0]], False),  # tall
    ],
)
def test_invalid_numeric_entries(cost, maximize):
    with pytest.raises(ValueError, match="invalid numeric entries"):
        pyperm.linear_sum_assignment(np.array(cost), maximize=maximize)


@pytest.mark.parametrize("cost", [np.zeros(3), np.zeros((2, 2, 2)), np.float64(1.0)])
def test_wrong_rank(cost):
    with pytest.raises(ValueError, match="cost must be a 2-D array"):
        pyperm.linear_sum_assignment(cost)


def test_non_numeric():
    with pytest.raises(ValueError, match="numerical entries"):
        pyperm.linear_sum_assignment(np.array([["a", "b"], ["c", "d"]]))
    with pytest.raises(ValueError, match="numerical entries"):
        pyperm.linear_sum_assignment(np.array([[object(), 1], [2, 3]], dtype=object))
    with pytest.raises(ValueError, match="complex"):
        pyperm.linear_sum_assignment(np.ones((2, 2), dtype=complex))
    with pytest.raises(ValueError, match="could not be read"):
        pyperm.linear_sum_assignment([[1, 2], [3]])


# ------------------------------------------------------------------ hypothesis
finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=64)
special = st.sampled_from([0.0, -0.0, 1e-300, -1e-300, 1e300, -1e300, np.inf, -np.inf, np.nan])


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=12), elements=finite),
       st.booleans())
def test_property_optimal_on_arbitrary_finite(cost, maximize):
    rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize)
    _assert_optimal(cost, rows, cols, maximize, rtol=1e-9)


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=8),
                  elements=st.one_of(finite, special)), st.booleans())
def test_property_never_crashes_and_agrees_on_errors(cost, maximize):
    """Special values: either both solvers raise ValueError or both succeed with one optimum."""
    try:
        ref = scipy_lsa(cost, maximize=maximize)
    except ValueError:
        with pytest.raises(ValueError):
            pyperm.linear_sum_assignment(cost, maximize=maximize)
        return
    rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize)
    _check_matching(cost, rows, cols)
    got, want = _objective(cost, rows, cols), _objective(cost, *ref)
    if np.isfinite(want) and abs(want) < 1e200:
        assert abs(got - want) <= 1e-9 * max(1.0, abs(want)) + 1e-9 * np.abs(cost[np.isfinite(cost)]).sum(initial=0)


# ------------------------------------------------------------------ torch
def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    cost = torch.rand(30, 40, dtype=torch.float32)
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert isinstance(rows, torch.Tensor) and rows.dtype == torch.int64
    _assert_optimal(cost.numpy(), rows.numpy(), cols.numpy(), rtol=1e-5)
    grad = torch.rand(5, 5, requires_grad=True)
    rows, cols = pyperm.linear_sum_assignment(grad)
    _assert_optimal(grad.detach().numpy(), rows.numpy(), cols.numpy(), rtol=1e-5)
    rows, cols = pyperm.batch_linear_sum_assignment(torch.rand(3, 6, 6, dtype=torch.float64))
    assert isinstance(cols, torch.Tensor) and cols.shape == (3, 6)


# ------------------------------------------------------------------ batch
@pytest.mark.parametrize("shape", [(5, 1, 1), (8, 20, 20), (6, 10, 25), (6, 25, 10), (0, 4, 4), (3, 0, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batch_equals_single(shape, dtype):
    rng = np.random.default_rng(1)
    costs = rng.integers(0, 4, shape).astype(dtype)
    rows, cols = pyperm.batch_linear_sum_assignment(costs, threads=3)
    k = min(shape[1], shape[2])
    assert rows.shape == (shape[0], k) and cols.shape == (shape[0], k)
    for b in range(shape[0]):
        r1, c1 = pyperm.linear_sum_assignment(costs[b])
        np.testing.assert_array_equal(rows[b], r1)
        np.testing.assert_array_equal(cols[b], c1)


def test_batch_maximize_and_default_threads():
    costs = np.random.default_rng(4).random((40, 16, 16))
    rows, cols = pyperm.batch_linear_sum_assignment(costs, maximize=True)
    for b in range(0, 40, 7):
        _assert_optimal(costs[b], rows[b], cols[b], maximize=True)


def test_batch_errors_name_the_problem():
    costs = np.random.default_rng(0).random((5, 3, 3))
    costs[3, 0, 0] = np.nan
    with pytest.raises(ValueError, match="problem 3 of the batch: matrix contains invalid numeric entries"):
        pyperm.batch_linear_sum_assignment(costs)
    costs = np.ones((4, 2, 2))
    costs[2, :, 0] = np.inf
    with pytest.raises(ValueError, match="problem 2 of the batch: cost matrix is infeasible"):
        pyperm.batch_linear_sum_assignment(costs)
    with pytest.raises(ValueError, match="costs must be a 3-D array"):
        pyperm.batch_linear_sum_assignment(np.ones((3, 3)))
    with pytest.raises(ValueError, match="threads must be at least 1"):
        pyperm.batch_linear_sum_assignment(np.ones((1, 2, 2)), threads=0)
    with pytest.raises(TypeError, match="threads must be a positive int"):
        pyperm.batch_linear_sum_assignment(np.ones((1, 2, 2)), threads=1.5)


# ------------------------------------------------------------------ threads
def test_concurrent_calls_from_python_threads():
    rng = np.random.default_rng(9)
    costs = [rng.random((150, 150)) for _ in range(8)]
    expected = [_objective(c, *scipy_lsa(c)) for c in costs]
    errors = []

    def work(k):
        try:
            for _ in range(3):
                got = _objective(costs[k], *pyperm.linear_sum_assignment(costs[k]))
                assert abs(got - expected[k]) < 1e-9
            rows, cols = pyperm.batch_linear_sum_assignment(np.stack(costs[:3]), threads=2)
            assert abs(_objective(costs[0], rows[0], cols[0]) - expected[0]) < 1e-9
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_large_problems_take_the_parallel_path():
    """From 2^21 entries (one thread per 2^20 at most) the whole-matrix passes run on several threads:
    same answers."""
    rng = np.random.default_rng(12)
    for shape in [(1500, 1500), (2200, 1000), (1000, 2200)]:
        for family in (uniform, integers_with_ties, offsets):
            cost = family(rng, *shape)
            _assert_optimal(cost, *pyperm.linear_sum_assignment(cost))
    for shape in [(1500, 1500), (2200, 1000)]:  # negated (and transposed) copies, made in bands
        cost = rng.random(shape)
        _assert_optimal(cost, *pyperm.linear_sum_assignment(cost, maximize=True), maximize=True)
    rows, cols = pyperm.linear_sum_assignment(np.ones((1500, 1500)))
    np.testing.assert_array_equal(cols, np.arange(1500))
    for shape in [(1500, 1500), (1300, 1700)]:
        cost = rng.random(shape)
        cost[shape[0] - 3, 5] = np.nan  # in the last thread's band
        with pytest.raises(ValueError, match="invalid numeric entries"):
            pyperm.linear_sum_assignment(cost)
