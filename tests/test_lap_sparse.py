"""pyperm.linear_sum_assignment on scipy.sparse input, against
scipy.sparse.csgraph.min_weight_full_bipartite_matching.

Answers are compared by objective value, not indices: ties allow several optima. scipy
removes explicit zeros (with a warning) where pyperm keeps them as edges, so its reference
is taken on the data shifted away from zero: every full matching has min(n, m) pairs, so a
constant shift does not change which matchings are optimal.
"""

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

import pyperm
from pyperm.lap._sparse import is_scipy_sparse, linear_sum_assignment_sparse

from _matchings import check_full_matching

FORMATS = ["csr", "csc", "coo", "lil", "dok", "bsr"]


def random_problem(rng, n, m, per_row, kind="uniform", zeros=False):
    """A feasible (n, m) csr_array: `per_row` random entries per row plus a random full matching."""
    rows = np.repeat(np.arange(n), per_row)
    cols = rng.integers(0, m, size=rows.size) if m else np.zeros(0, dtype=np.int64)
    k = min(n, m)
    rows = np.concatenate([rows, rng.permutation(n)[:k]])
    cols = np.concatenate([cols, rng.permutation(m)[:k]])
    # One value per distinct position (a duplicate would be summed by the conversion).
    key = np.unique(rows * max(m, 1) + cols)
    rows, cols = key // max(m, 1), key % max(m, 1)
    if kind == "uniform":
        data = rng.random(rows.size)
    elif kind == "negative":
        data = rng.normal(size=rows.size) * 100
    elif kind == "integer":
        data = rng.integers(-5, 6, size=rows.size).astype(np.float64)
    else:
        raise ValueError(kind)
    if zeros:
        data[rng.random(rows.size) < 0.3] = 0.0
    return sp.csr_array((data, (rows, cols)), shape=(n, m))


def reference_objective(cost, maximize=False):
    """scipy's optimum over the stored entries of csr `cost`, explicit zeros included."""
    shifted = cost.copy()
    if shifted.nnz:
        data = shifted.data
        shifted.data = data - data.min() + 1.0 if not maximize else data - data.max() - 1.0
    rows, cols = min_weight_full_bipartite_matching(shifted, maximize=maximize)
    return float(cost[rows, cols].sum())


def check_matching(cost, rows, cols):
    """A valid full matching that uses stored entries only."""
    check_full_matching(cost.shape, rows, cols)
    coo = sp.coo_array(cost)
    stored = set(zip(coo.row.tolist(), coo.col.tolist()))
    assert all((r, c) in stored for r, c in zip(rows.tolist(), cols.tolist()))


def assert_optimal(cost, rows, cols, maximize=False):
    csr = sp.csr_array(cost)
    check_matching(csr, rows, cols)
    ref = reference_objective(csr, maximize)
    got = float(csr[rows, cols].sum()) if len(rows) else 0.0
    assert got == pytest.approx(ref, rel=1e-9, abs=1e-9)


SHAPES = [(1, 1), (2, 2), (5, 5), (8, 3), (3, 8), (30, 30), (40, 25), (25, 40), (200, 200), (150, 400), (400, 150)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_row", [0, 1, 3, 10])
@pytest.mark.parametrize("kind", ["uniform", "negative", "integer"])
@pytest.mark.parametrize("maximize", [False, True])
def test_matches_scipy_objective(shape, per_row, kind, maximize):
    rng = np.random.default_rng([shape[0], shape[1], per_row, len(kind), maximize])
    for _ in range(3):
        cost = random_problem(rng, *shape, per_row, kind)
        rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize)
        assert_optimal(cost, rows, cols, maximize)


@pytest.mark.parametrize("seed", range(40))
def test_many_random_problems_with_explicit_zeros(seed):
    rng = np.random.default_rng(seed)
    n, m = (int(x) for x in rng.integers(1, 60, size=2))
    cost = random_problem(rng, n, m, int(rng.integers(1, 8)), ["uniform", "negative", "integer"][seed % 3], zeros=True)
    for maximize in (False, True):
        rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize)
        assert_optimal(cost, rows, cols, maximize)


def test_explicit_zero_is_an_edge():
    # Row 0's only entry is a stored zero: without it there is no full matching.
    cost = sp.csr_array((np.array([0.0, 5.0, 1.0]), np.array([0, 0, 1]), np.array([0, 1, 3])), shape=(2, 2))
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert rows.tolist() == [0, 1] and cols.tolist() == [0, 1]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cls", ["array", "matrix"])
@pytest.mark.parametrize("shape", [(20, 20), (12, 30), (30, 12)])
def test_every_format_and_class(fmt, cls, shape):
    rng = np.random.default_rng(7)
    csr = random_problem(rng, *shape, 4, "negative")
    cost = getattr(sp, f"{fmt}_{cls}")(csr)
    assert is_scipy_sparse(cost)
    for maximize in (False, True):
        rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize)
        assert isinstance(rows, np.ndarray) and isinstance(cols, np.ndarray)
        assert_optimal(csr, rows, cols, maximize)


def test_coo_duplicates_are_summed():
    # (0, 0) is stored twice: 3 + 4 = 7 makes the other diagonal (1 + 1) the optimum.
    cost = sp.coo_array(
        (np.array([3.0, 4.0, 1.0, 1.0, 2.0]), (np.array([0, 0, 0, 1, 1]), np.array([0, 0, 1, 0, 1]))), shape=(2, 2)
    )
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert cols.tolist() == [1, 0]
    rows, cols = pyperm.linear_sum_assignment(cost, maximize=True)
    assert cols.tolist() == [0, 1]


def test_csr_duplicates_and_unsorted_indices():
    rng = np.random.default_rng(3)
    ref = random_problem(rng, 40, 40, 5, "negative")
    # Each row's entries reversed, and every entry split into two halves stored apart.
    indptr, indices, data = ref.indptr, ref.indices, ref.data
    new_indices, new_data, new_indptr = [], [], [0]
    for i in range(40):
        idx, dat = indices[indptr[i] : indptr[i + 1]][::-1], data[indptr[i] : indptr[i + 1]][::-1]
        new_indices += [*idx, *idx]
        new_data += [*(dat / 2), *(dat / 2)]
        new_indptr.append(len(new_indices))
    messy = sp.csr_array((np.array(new_data), np.array(new_indices), np.array(new_indptr)), shape=(40, 40))
    assert not messy.has_canonical_format
    for maximize in (False, True):
        rows, cols = pyperm.linear_sum_assignment(messy, maximize=maximize)
        assert_optimal(ref, rows, cols, maximize)
    for fmt in ("csc", "coo"):
        rows, cols = pyperm.linear_sum_assignment(getattr(messy, f"to{fmt}")(), maximize=False)
        assert_optimal(ref, rows, cols)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.bool_, np.uint8, np.longdouble])
def test_dtypes(dtype):
    rng = np.random.default_rng(11)
    csr = random_problem(rng, 30, 35, 4, "integer")
    csr.data = np.abs(csr.data) + 1
    cost = csr.astype(dtype)
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert_optimal(cost.astype(np.float64), rows, cols)


def test_float32_is_solved_in_float32():
    # 1 + 2^-30 is 1 in float32: the two matchings tie there, and either is optimal.
    data32 = np.array([1.0, 1.0 + 2.0**-30, 1.0, 1.0])
    cost = sp.csr_array((data32, np.array([0, 1, 0, 1]), np.array([0, 2, 4])), shape=(2, 2))
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert cols.tolist() == [0, 1]
    rows, cols = pyperm.linear_sum_assignment(cost.astype(np.float32))
    assert sorted(cols.tolist()) == [0, 1]


@pytest.mark.parametrize("shape", [(0, 0), (0, 4), (4, 0)])
def test_empty_shapes(shape):
    rows, cols = pyperm.linear_sum_assignment(sp.csr_array(shape))
    assert rows.shape == (0,) and cols.shape == (0,)
    assert rows.dtype == np.int64 and cols.dtype == np.int64


def test_one_by_one():
    rows, cols = pyperm.linear_sum_assignment(sp.csr_array(np.array([[-2.5]])))
    assert rows.tolist() == [0] and cols.tolist() == [0]
    with pytest.raises(ValueError, match="no full matching exists"):
        pyperm.linear_sum_assignment(sp.csr_array((1, 1)))


@pytest.mark.parametrize(
    "cost",
    [
        sp.csr_array(np.array([[1.0, 0.0], [2.0, 0.0]])),  # column 1 has no entry
        sp.csr_array(np.array([[1.0, 2.0], [0.0, 0.0]])),  # row 1 has no entry
        sp.csr_array(np.array([[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]])),  # wide: both rows want column 0
        sp.csr_array(np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])),  # tall: every row has only column 0
        sp.csr_array((3, 5)),
    ],
)
def test_infeasible(cost):
    with pytest.raises(ValueError, match="no full matching exists.*cost"):
        pyperm.linear_sum_assignment(cost)
    with pytest.raises(ValueError, match="no full matching exists"):
        pyperm.linear_sum_assignment(cost.tocsc(), maximize=True)


def test_infeasible_large():
    rng = np.random.default_rng(5)
    cost = random_problem(rng, 300, 300, 3, "uniform").tolil()
    cost[:, 17] = 0  # no row reaches column 17
    with pytest.raises(ValueError, match="no full matching exists"):
        pyperm.linear_sum_assignment(cost.tocsr())


def test_forbidden_infinity_is_no_edge():
    rng = np.random.default_rng(9)
    cost = random_problem(rng, 50, 50, 6, "negative")
    mask = rng.random(cost.nnz) < 0.2
    for maximize, inf in ((False, np.inf), (True, -np.inf)):
        with_inf = cost.copy()
        with_inf.data[mask] = inf
        without = with_inf.copy()
        without.data[mask] = 0
        without.eliminate_zeros()
        try:
            ref = reference_objective(without, maximize)
        except ValueError:
            with pytest.raises(ValueError, match="no full matching exists"):
                pyperm.linear_sum_assignment(with_inf, maximize=maximize)
            continue
        rows, cols = pyperm.linear_sum_assignment(with_inf, maximize=maximize)
        check_matching(without, rows, cols)
        assert float(without[rows, cols].sum()) == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize(
    ("value", "maximize", "match"),
    [
        (np.nan, False, "invalid numeric entries.*NaN"),
        (np.nan, True, "invalid numeric entries.*NaN"),
        (-np.inf, False, "invalid numeric entries.*-inf.*minimizing"),
        (np.inf, True, "invalid numeric entries.*inf.*maximizing"),
    ],
)
@pytest.mark.parametrize("fmt", ["csr", "csc", "coo"])
def test_invalid_entries(value, maximize, match, fmt):
    cost = sp.csr_array(np.array([[1.0, 2.0], [3.0, 4.0]]))
    cost.data[1] = value
    with pytest.raises(ValueError, match=match):
        pyperm.linear_sum_assignment(getattr(cost, f"to{fmt}")(), maximize=maximize)


def test_not_two_dimensional():
    with pytest.raises(ValueError, match="cost must be a 2-D array"):
        pyperm.linear_sum_assignment(sp.coo_array(np.array([1.0, 2.0])))


def test_complex_data():
    with pytest.raises(TypeError, match="cost must be real"):
        pyperm.linear_sum_assignment(sp.csr_array(np.array([[1 + 1j, 2.0], [3.0, 4.0]])))


def test_broken_structure():
    cost = sp.csr_array((np.array([1.0, 2.0]), np.array([0, 1]), np.array([0, 1, 2])), shape=(2, 2))
    cost.indices[1] = 7  # out of range, which scipy's constructor does not see once built
    with pytest.raises(ValueError, match="invalid sparse structure"):
        pyperm.linear_sum_assignment(cost)


def test_core_rejects_bad_lengths():
    from pyperm._ext import core

    indptr, indices, data = np.array([0, 1, 3]), np.array([0, 1]), np.array([1.0, 2.0])
    with pytest.raises(ValueError, match="indptr must end"):
        core.lap_solve_sparse(indptr, indices, data, 2, 2, False)
    with pytest.raises(ValueError, match="n_rows \\+ 1"):
        core.lap_solve_sparse(indptr, indices, data, 3, 2, False)


def test_direct_call_and_detection():
    cost = sp.csr_matrix(np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]]))
    rows, cols = linear_sum_assignment_sparse(cost, maximize=False)
    assert cols.tolist() == [1, 0, 2]
    assert not is_scipy_sparse(cost.toarray())
    assert not is_scipy_sparse([[1.0]])


def test_long_augmenting_paths():
    # A chain where each row's cheap column is the next row's: a greedy start matches
    # badly and the solver must augment along long paths.
    n = 500
    rows = np.concatenate([np.arange(n), np.arange(n)])
    cols = np.concatenate([np.arange(n), (np.arange(n) + 1) % n])
    data = np.concatenate([np.full(n, 1.0), np.full(n, 0.5)])
    data[n - 1] = 0.25
    cost = sp.csr_array((data, (rows, cols)), shape=(n, n))
    for maximize in (False, True):
        rows_, cols_ = pyperm.linear_sum_assignment(cost, maximize=maximize)
        assert_optimal(cost, rows_, cols_, maximize)


@pytest.mark.parametrize("kind", ["uniform", "negative", "integer"])
def test_square_problems_past_the_two_way_switch(kind):
    # Square and big enough that more rows stay free after the row reductions than the
    # two-way search takes on: the one-way searches run first, the two-way ones finish.
    rng = np.random.default_rng(len(kind))
    cost = random_problem(rng, 6000, 6000, 3, kind, zeros=True)
    for maximize in (False, True):
        rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize)
        assert_optimal(cost, rows, cols, maximize)


@pytest.mark.parametrize("n", [300, 6000])
def test_infeasible_by_hall_condition(n):
    # Every row and column has an edge, but rows 0 and 1 share their only column.
    rng = np.random.default_rng(n)
    cost = random_problem(rng, n, n, 3, "uniform").tolil()
    cost[0, :] = 0
    cost[1, :] = 0
    cost[0, 5] = 1.0
    cost[1, 5] = 2.0
    with pytest.raises(ValueError, match="no full matching exists"):
        pyperm.linear_sum_assignment(cost.tocsr())
