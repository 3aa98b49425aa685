"""Every CPU entry point of the LAP solvers over the whole finite range of float32 and float64.

Costs are drawn from the range's edges: +-max finite, +-max/3, +-1, the smallest subnormals,
0, random mixes of magnitudes from subnormal to max, and +inf (forbidden) entries. Answers
are checked against brute force over all matchings, summed exactly (every float is an
integer multiple of 2^-1074, so the sums are Python integers) where the sizes allow, and
against scipy on a rescaled copy for the large solver. The solvers compute in floating
point, so an answer may miss the exact optimum by rounding: it must lie within
`slack` = 4 (n + m)^2 * eps * (largest magnitude) of it, far below what the defects this file
guards gave (an optimum missed by about the largest magnitude, "no full matching" where
one exists, or a read before a buffer).

The last test runs a quick share of the checks in a fresh interpreter per SIMD level this
machine supports (PYPERM_MAX_SIMD).
"""

import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.optimize import linear_sum_assignment as scipy_lsa

import pyperm
from pyperm.lap import lapjv

DTYPES = [np.float32, np.float64]
SCALE_BITS = 1074  # 2^1074 times any float64 (and float32) is an integer


# --------------------------------------------------------------------------- exact arithmetic
def exact(x):
    """x * 2^1074 as an exact Python integer (x finite)."""
    num, den = float(x).as_integer_ratio()
    return num * ((1 << SCALE_BITS) // den)


def show(x):
    """An exact sum for a failure message: as a float, or its size where it has none."""
    try:
        return x / 2**SCALE_BITS
    except OverflowError:
        return f"{'-' if x < 0 else ''}2^{abs(x).bit_length() - SCALE_BITS}"


def exact_sum(cost, rows, cols):
    return sum(exact(cost[i, j]) for i, j in zip(rows, cols))


def slack(cost, dtype):
    """How far from the exact optimum rounding may leave an answer, as an exact integer."""
    finite = np.abs(cost[np.isfinite(cost)].astype(np.float64))
    largest = float(finite.max()) if finite.size else 0.0
    n, m = cost.shape
    eps = float(np.finfo(dtype).eps)
    return exact(min(4.0 * (n + m) ** 2 * eps * largest, float(np.finfo(np.float64).max)))


def matchings(n, m, full):
    """Every matching of an n x m problem as (rows, cols) tuples: the full ones (min(n, m)
    pairs), or all of them, the empty one included."""
    sizes = [min(n, m)] if full else range(min(n, m) + 1)
    for k in sizes:
        for rows in itertools.combinations(range(n), k):
            for cols in itertools.permutations(range(m), k):
                yield rows, cols


def brute_force(cost, maximize=False, limit=None):
    """The exact optimum (an integer, see exact) and whether any matching is allowed.

    Without `limit`: over full matchings avoiding forbidden pairs. With a finite `limit`:
    lap's objective, the matched costs plus limit / 2 per unmatched row and column (maximising:
    mirrored, the matched values minus limit / 2 per unmatched one, as minimising -cost). With
    limit inf: the largest matchings avoiding forbidden pairs, best among them.
    """
    n, m = cost.shape
    forbidden = np.isinf(cost)
    values = [[0 if forbidden[i, j] else exact(cost[i, j]) for j in range(m)] for i in range(n)]
    sign = -1 if maximize else 1
    best = None
    for rows, cols in matchings(n, m, full=limit is None):
        if any(forbidden[i, j] for i, j in zip(rows, cols)):
            continue
        total = sign * sum(values[i][j] for i, j in zip(rows, cols))
        if limit is not None and math.isfinite(limit):
            total += exact(limit) * (n + m - 2 * len(rows)) // 2
            key = total
        elif limit is not None:  # inf: more pairs first
            key = (-len(rows), total)
        else:
            key = total
        if best is None or key < best[0]:
            best = (key, total)
    if best is None:
        return None
    return sign * best[1]


# ------------------------------------------------------------------------------ costs
def palette(dtype):
    """The range's landmarks: +-max, +-max/3, +-1, +-smallest subnormal and one larger, 0."""
    info = np.finfo(dtype)
    tiny = float(np.nextafter(dtype(0), dtype(1)))
    sub = float(info.smallest_normal) / 7
    vals = [float(info.max), float(info.max) / 3, 1.0, tiny, sub, 0.0]
    return np.array(sorted({v for x in vals for v in (x, -x)}), dtype=dtype)


def mixed_magnitudes(rng, shape, dtype):
    """Random signs and magnitudes log-uniform from the smallest subnormal to max."""
    info = np.finfo(dtype)
    lo = math.log2(float(np.nextafter(dtype(0), dtype(1))))
    hi = math.log2(float(info.max))
    mag = np.exp2(rng.uniform(lo, hi, size=shape))
    with np.errstate(over="ignore"):
        out = (rng.choice([-1.0, 1.0], size=shape) * mag).astype(dtype)
    return np.where(np.isfinite(out), out, dtype(info.max)).astype(dtype)


def edge_costs(rng, shape, dtype, kind, forbid=0.0):
    if kind == "palette":
        c = rng.choice(palette(dtype), size=shape)
    elif kind == "extremes":  # +-max only (and 0): sums of two overflow
        info = np.finfo(dtype)
        c = rng.choice(np.array([-info.max, info.max, 0], dtype=dtype), size=shape)
    elif kind == "mixed":
        c = mixed_magnitudes(rng, shape, dtype)
    elif kind == "huge":  # magnitudes from max / 2^20 to max: every dual update near the top
        c = (rng.choice([-1.0, 1.0], size=shape) * np.exp2(rng.uniform(-20, 0, size=shape))
             * float(np.finfo(dtype).max)).astype(dtype)
    elif kind == "threshold":  # up to the largest the solvers take without widening (cost_range.h)
        bound = float(np.finfo(dtype).max) / (8 * (shape[-2] + shape[-1] + 2))
        c = (rng.choice([-1.0, 1.0], size=shape) * np.exp2(rng.uniform(-20, 0, size=shape)) * bound).astype(dtype)
        c[..., 0, 0] = dtype(bound) if dtype(bound) <= bound else np.nextafter(dtype(bound), dtype(0))
    elif kind == "ints":  # small integers times max / 32, as the reproduction
        c = (rng.integers(-32, 33, size=shape) * (float(np.finfo(dtype).max) / 32)).astype(dtype)
    elif kind == "tiny":  # subnormals only
        c = (rng.integers(-40, 41, size=shape) * float(np.nextafter(dtype(0), dtype(1)))).astype(dtype)
    else:
        raise ValueError(kind)
    c = np.asarray(c, dtype=dtype)
    if forbid:
        c[rng.random(shape) < forbid] = np.inf
    return c


KINDS = ["palette", "extremes", "ints", "mixed", "huge", "tiny", "threshold"]
SMALL_SHAPES = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (3, 5), (5, 3), (2, 6), (6, 6)]


def check_full(cost, rows, cols, maximize, dtype, want=None, approximate=False):
    """A full matching avoiding forbidden pairs, within slack of the exact optimum `want`
    (brute force's when not given; with `approximate`, `want` is another solver's answer,
    which may itself miss the optimum by slack)."""
    n, m = cost.shape
    rows, cols = np.asarray(rows), np.asarray(cols)
    assert len(rows) == len(cols) == min(n, m)
    assert len(set(rows.tolist())) == len(rows) and len(set(cols.tolist())) == len(cols)
    assert np.all(np.isfinite(cost[rows, cols])), "a forbidden pair was matched"
    if want is None:
        want = brute_force(cost, maximize)
    got = exact_sum(cost, rows, cols)
    gap = (want - got) if maximize else (got - want)
    room = slack(cost, dtype)
    assert (-room if approximate else 0) <= gap <= room, (cost, rows, cols, show(got), show(want))


def flip(cost, maximize):
    """The forbidden mark for the sense: +inf minimising, -inf maximising."""
    return np.where(np.isinf(cost), -np.inf, cost).astype(cost.dtype) if maximize else cost


def cases(seed, count, shapes=SMALL_SHAPES, forbid=(0.0, 0.3)):
    rng = np.random.default_rng(seed)
    for k in range(count):
        dtype = DTYPES[k % 2]
        shape = shapes[rng.integers(len(shapes))]
        kind = KINDS[rng.integers(len(KINDS))]
        f = forbid[rng.integers(len(forbid))]
        yield dtype, kind, edge_costs(rng, shape, dtype, kind, f), bool(rng.integers(2))


def solve_or_none(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        assert "infeasible" in str(e) or "no full matching" in str(e), e
        return None


# --------------------------------------------------------------- the reproductions
def test_sparse_costs_spanning_more_than_float32_are_solved_as_scipy_does():
    m = sp.csr_matrix((np.array([-3e38, 3e38, 1.0], np.float32), [0, 1, 0], [0, 2, 3]), shape=(2, 3))
    rows, cols = pyperm.linear_sum_assignment(m)
    assert rows.tolist() == [0, 1] and cols.tolist() == [1, 0]


def test_small_float32_beyond_half_max_gives_scipys_optimum():
    c = np.array([[24, 21, -26, 32], [16, 14, -22, 29], [-7, 30, -18, -28]], np.float32) * np.float32(1e37)
    r, k = scipy_lsa(c.astype(np.float64))
    want = float(c.astype(np.float64)[r, k].sum())
    rows, cols = pyperm.linear_sum_assignment(c)
    assert float(c.astype(np.float64)[rows, cols].sum()) == want
    c = np.array([[-1e38, 3e38, np.inf], [1, np.inf, np.inf]], np.float32)
    rows, cols = pyperm.linear_sum_assignment(c)
    assert cols.tolist() == [1, 0]


@pytest.mark.parametrize("entry", ["linear_sum_assignment", "lapjv", "batch"])
def test_subnormal_costs_with_an_infinite_limit_are_solved(entry):
    c = np.array([[0.0, 1e-310], [np.inf, np.inf]])
    if entry == "linear_sum_assignment":
        rows, cols = pyperm.linear_sum_assignment(c, cost_limit=np.inf)
    elif entry == "lapjv":
        _, x, _ = lapjv(c, cost_limit=np.inf)
        rows = np.flatnonzero(x >= 0)
        cols = x[rows]
    else:
        [(rows, cols)] = pyperm.batch_linear_sum_assignment([c], cost_limit=np.inf)
    assert rows.tolist() == [0] and cols.tolist() == [0]
    # Only subnormals, and the cheaper of two subnormals.
    c = np.array([[3e-323, 1e-323], [np.inf, 2e-323]])
    rows, cols = pyperm.linear_sum_assignment(c, cost_limit=np.inf)
    assert rows.tolist() == [0, 1] and cols.tolist() == [0, 1]
    c = np.array([[3e-323, 1e-323], [np.inf, np.inf]])
    rows, cols = pyperm.linear_sum_assignment(c, cost_limit=np.inf)
    assert rows.tolist() == [0] and cols.tolist() == [1]


# ------------------------------------------------------------------- property tests
def test_small_solver_over_the_whole_range():
    for dtype, kind, cost, maximize in cases(1, 800):
        cost = flip(cost, maximize)
        got = solve_or_none(pyperm.linear_sum_assignment, cost, maximize=maximize)
        want = brute_force(cost, maximize)
        assert (got is None) == (want is None), (kind, cost, maximize)
        if got is not None:
            check_full(cost, *got, maximize, dtype, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["palette", "mixed", "huge", "extremes", "ints", "threshold"])
@pytest.mark.parametrize("shape", [(70, 70), (50, 120), (120, 50)])
def test_large_solver_over_the_whole_range(dtype, kind, shape):
    """Above 4096 entries: against scipy on the costs times 2^-64 in float64 (exact for every
    entry but those near the subnormals, which cannot change an optimum by more than slack)."""
    rng = np.random.default_rng([KINDS.index(kind), shape[0], shape[1], DTYPES.index(dtype)])
    for maximize in (False, True):
        cost = flip(edge_costs(rng, shape, dtype, kind, forbid=0.1), maximize)
        rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize)
        scaled = np.ldexp(cost.astype(np.float64), -64)
        r, k = scipy_lsa(scaled, maximize=maximize)
        check_full(cost, rows, cols, maximize, dtype, want=exact_sum(cost, r, k), approximate=True)


def test_batch_stack_over_the_whole_range():
    rng = np.random.default_rng(2)
    for k in range(80):
        dtype = DTYPES[k % 2]
        kind = KINDS[k % len(KINDS)]
        stack = flip(edge_costs(rng, (6, 5, 5) if k % 4 else (6, 4, 5), dtype, kind, forbid=0.2 * (k % 2)),
                     maximize := bool(k % 3 == 0))
        got = solve_or_none(pyperm.batch_linear_sum_assignment, stack, maximize=maximize)
        if got is None:  # one problem has no full matching: each on its own says which
            assert any(brute_force(c, maximize) is None for c in stack)
            continue
        rows, cols = got
        for b in range(len(stack)):
            check_full(stack[b], rows[b], cols[b], maximize, dtype)


def test_ragged_list_over_the_whole_range():
    rng = np.random.default_rng(3)
    for k in range(30):
        dtype = DTYPES[k % 2]
        problems = [edge_costs(rng, SMALL_SHAPES[rng.integers(len(SMALL_SHAPES))], dtype, KINDS[rng.integers(len(KINDS))])
                    for _ in range(5)]
        maximize = bool(k % 2)
        for cost, (rows, cols) in zip(problems, pyperm.batch_linear_sum_assignment(problems, maximize=maximize)):
            check_full(cost, rows, cols, maximize, dtype)


def test_padded_stack_with_sizes_over_the_whole_range():
    rng = np.random.default_rng(4)
    for k in range(30):
        dtype = DTYPES[k % 2]
        stack = edge_costs(rng, (5, 6, 6), dtype, KINDS[k % len(KINDS)])
        sizes = rng.integers(0, 7, size=(5, 2))
        maximize = bool(k % 2)
        out = pyperm.batch_linear_sum_assignment(stack, maximize=maximize, sizes=sizes)
        for b, (rows, cols) in enumerate(out):
            n, m = sizes[b]
            check_full(stack[b, :n, :m], rows, cols, maximize, dtype)


def check_limited(cost, rows, cols, limit, maximize, dtype):
    """A matching avoiding forbidden pairs, lap-optimal within slack for `limit`."""
    rows, cols = np.asarray(rows), np.asarray(cols)
    assert len(rows) == len(cols) <= min(cost.shape)
    assert len(set(rows.tolist())) == len(rows) and len(set(cols.tolist())) == len(cols)
    assert np.all(np.isfinite(cost[rows, cols]))
    want = brute_force(cost, maximize, limit)
    if math.isinf(limit):
        assert len(rows) == max(len(r) for r, c in matchings(*cost.shape, full=False)
                                if np.all(np.isfinite(cost[list(r), list(c)])))
        got = exact_sum(cost, rows, cols)
    else:
        unmatched_cost = exact(limit) * (sum(cost.shape) - 2 * len(rows)) // 2
        got = exact_sum(cost, rows, cols) + (-unmatched_cost if maximize else unmatched_cost)
    gap = (want - got) if maximize else (got - want)
    extra = np.abs(np.array([limit if math.isfinite(limit) else 0.0], np.float64))
    room = max(slack(cost, dtype), exact(min(float(extra.max()) * 4 * sum(cost.shape) ** 2 * float(np.finfo(dtype).eps),
                                             float(np.finfo(np.float64).max))))
    assert 0 <= gap <= room, (cost, limit, maximize, rows, cols, show(got), show(want))


# Limits far from every cost the palettes hold (their magnitudes are 0, subnormal, 1, max/3
# and max), so that a float32 cost never meets the limit where float32 and float64 rounding
# could decide differently.
LIMITS = [0.0, 0.5, 2.0, 1e30, 1e300, math.inf]
LIMIT_SHAPES = [(1, 1), (2, 2), (3, 3), (2, 4), (4, 2), (4, 4), (3, 4)]


def limited_cases(seed, count):
    rng = np.random.default_rng(seed)
    for k in range(count):
        dtype = np.float64 if k % 3 else np.float32
        limit = LIMITS[rng.integers(len(LIMITS))]
        if dtype == np.float32 and limit == 1e300:
            limit = 1e30
        shape = LIMIT_SHAPES[rng.integers(len(LIMIT_SHAPES))]
        kind = ["palette", "extremes", "mixed", "tiny", "threshold"][rng.integers(5)]
        cost = edge_costs(rng, shape, dtype, kind, forbid=[0.0, 0.4, 0.6][rng.integers(3)])
        yield dtype, cost, limit


def test_cost_limit_over_the_whole_range():
    for dtype, cost, limit in limited_cases(5, 250):
        rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=limit)
        check_limited(cost, rows, cols, limit, False, dtype)


def test_cost_limit_maximising_over_the_whole_range():
    """lap's objective mirrored: the same matching as minimising -cost with the same limit."""
    for dtype, cost, limit in limited_cases(6, 120):
        cost = flip(cost, True)
        rows, cols = pyperm.linear_sum_assignment(cost, maximize=True, cost_limit=limit)
        check_limited(cost, rows, cols, limit, True, dtype)


def test_cost_limit_of_a_ragged_list_over_the_whole_range():
    problems = list(limited_cases(7, 60))
    for limit in (0.5, 1e30, math.inf):
        costs = [c for d, c, _ in problems if d == np.float64]
        out = pyperm.batch_linear_sum_assignment(costs, cost_limit=limit)
        for cost, (rows, cols) in zip(costs, out):
            check_limited(cost, rows, cols, limit, False, np.float64)


def test_lapjv_over_the_whole_range():
    for dtype, cost, limit in limited_cases(8, 150):
        total, x, y = lapjv(cost, extend_cost=True, cost_limit=limit)
        rows = np.flatnonzero(x >= 0)
        cols = x[rows]
        assert np.all(y[cols] == rows)
        check_limited(cost, rows, cols, limit, False, dtype)


def test_lapjv_square_without_limit_over_the_whole_range():
    """lap's default limit (inf): every row matched where the forbidden pairs allow it."""
    for dtype, kind, cost, _ in cases(9, 120, shapes=[(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]):
        _, x, y = lapjv(cost)
        rows = np.flatnonzero(x >= 0)
        assert np.all(y[x[rows]] == rows)
        check_limited(cost, rows, x[rows], math.inf, False, dtype)


def test_sparse_over_the_whole_range():
    rng = np.random.default_rng(10)
    for k in range(200):
        dtype = DTYPES[k % 2]
        shape = SMALL_SHAPES[rng.integers(len(SMALL_SHAPES))]
        dense = edge_costs(rng, shape, dtype, KINDS[rng.integers(len(KINDS))])
        stored = rng.random(shape) < 0.6
        maximize = bool(rng.integers(2))
        # Stored entries are the allowed pairs (explicit zeros included); the rest are forbidden.
        i, j = np.nonzero(stored)
        csr = sp.csr_array((dense[i, j], (i, j)), shape=shape)
        want_cost = np.where(stored, dense, np.inf if not maximize else -np.inf).astype(dtype)
        got = solve_or_none(pyperm.linear_sum_assignment, csr, maximize=maximize)
        want = brute_force(want_cost, maximize)
        assert (got is None) == (want is None), (want_cost, maximize)
        if got is not None:
            check_full(want_cost, *got, maximize, dtype, want)


def test_sparse_large_over_the_whole_range():
    rng = np.random.default_rng(11)
    for dtype in DTYPES:
        for kind in ("huge", "palette", "mixed", "threshold"):
            n = 300
            dense = edge_costs(rng, (n, n), dtype, kind)
            stored = rng.random((n, n)) < 0.05
            stored[np.arange(n), rng.permutation(n)] = True
            i, j = np.nonzero(stored)
            csr = sp.csr_array((dense[i, j], (i, j)), shape=(n, n))
            rows, cols = pyperm.linear_sum_assignment(csr)
            scaled = np.where(stored, np.ldexp(dense.astype(np.float64), -64), np.inf)
            r, k = scipy_lsa(scaled)
            check_full(np.where(stored, dense, np.inf).astype(dtype), rows, cols, False, dtype,
                       want=exact_sum(dense, r, k), approximate=True)


def test_torch_custom_ops_over_the_whole_range():
    torch = pytest.importorskip("torch")
    import pyperm.lap._torch_ops  # noqa: F401  (registers torch.ops.pyperm.*)

    ops = torch.ops.pyperm
    for dtype, kind, cost, maximize in cases(12, 80):
        cost = flip(cost, maximize)
        t = torch.from_numpy(cost)
        want = brute_force(cost, maximize)
        got = solve_or_none(ops.linear_sum_assignment, t, maximize)
        assert (got is None) == (want is None)
        if got is not None:
            check_full(cost, got[0].numpy(), got[1].numpy(), maximize, dtype, want)
    rng = np.random.default_rng(13)
    for dtype in DTYPES:
        stack = edge_costs(rng, (4, 5, 5), dtype, "huge")
        rows, cols = ops.batch_linear_sum_assignment(torch.from_numpy(stack), False, 0)
        for b in range(4):
            check_full(stack[b], rows[b].numpy(), cols[b].numpy(), False, dtype)
    for dtype, cost, limit in limited_cases(14, 40):
        rows, cols = ops.linear_sum_assignment_limited(torch.from_numpy(cost), False, limit)
        check_limited(cost, rows.numpy(), cols.numpy(), limit, False, dtype)


def test_warm_start_solvers_over_the_whole_range():
    """solve_square_warm and the incremental solver (weight matching, BvN) on costs at the
    range's edges, started from column minima as WarmAssigner does."""
    from pyperm.lap.warm import WarmAssigner, incremental_solver, solve_square_warm

    rng = np.random.default_rng(15)
    for k in range(120):
        dtype = DTYPES[k % 2]
        n = int(rng.integers(1, 7))
        cost = edge_costs(rng, (n, n), dtype, KINDS[k % len(KINDS)])
        want = brute_force(cost)
        duals = np.ascontiguousarray(cost.min(axis=0))
        cols = solve_square_warm(cost, duals)
        check_full(cost, np.arange(n), cols, False, dtype, want)
        cols = incremental_solver(cost).solve()
        check_full(cost, np.arange(n), cols, False, dtype, want)
        cols = WarmAssigner(incremental_up_to=1).solve(cost)
        check_full(cost, np.arange(n), cols, False, dtype, want)


# ------------------------------------------------------------------- every SIMD level
QUICK = [
    "test_sparse_costs_spanning_more_than_float32_are_solved_as_scipy_does",
    "test_small_float32_beyond_half_max_gives_scipys_optimum",
    "test_small_solver_over_the_whole_range",
    "test_batch_stack_over_the_whole_range",
    "test_cost_limit_over_the_whole_range",
    "test_sparse_over_the_whole_range",
]

LEVELS = ["baseline", "avx2", "avx512"]
HERE = os.path.dirname(os.path.abspath(__file__))


def _levels_here():
    from pyperm._ext import core

    return LEVELS[: LEVELS.index(core.hardware_isa()) + 1]


@pytest.mark.parametrize("level", LEVELS)
def test_every_simd_level_over_the_whole_range(level):
    """The quick checks above, plus the large solver on the huge kind, in a fresh interpreter
    capped at `level` (the core reads PYPERM_MAX_SIMD once)."""
    from pyperm._ext import core

    if level not in _levels_here():
        pytest.skip(f"this CPU does not run {level}")
    if level == core.best_isa():
        pytest.skip(f"the tests above ran at {level}, this process's level")
    code = (
        "import numpy as np, test_lap_range as t\n"
        "from pyperm._ext import core\n"
        f"assert core.best_isa() == {level!r}, core.best_isa()\n"
        + "".join(f"t.{name}()\n" for name in QUICK)
        + "for d in t.DTYPES:\n    t.test_large_solver_over_the_whole_range(d, 'huge', (70, 70))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYPERM_MAX_SIMD": level}
    # From the tests folder: from the repository root, `-c` would import the source folder,
    # which has no compiled module.
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=HERE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
