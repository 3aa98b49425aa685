"""Birkhoff-von Neumann decomposition, permutation sampling, projection and Sinkhorn scaling."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment as scipy_lsa

import pyperm
from pyperm import _core
from pyperm.testing import planted  # a convex combination of k random permutations
from pyperm.testing import reconstruct, scipy_bottleneck_matching

try:  # the solvers need numpy alone; only the torch round-trips need torch
    import torch
except ImportError:  # pragma: no cover
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")

METHODS = ["max-weight", "bottleneck"]


# ----------------------------------------------------------------------------- helpers
def sinkhorn_reference(M: np.ndarray, iters: int = 5000, tol: float = 1e-13) -> np.ndarray:
    """Plain alternating row/column normalisation, the textbook Sinkhorn-Knopp."""
    X = np.array(M, dtype=np.float64)
    for _ in range(iters):
        X /= X.sum(axis=1, keepdims=True)
        X /= X.sum(axis=0, keepdims=True)
        if np.abs(X.sum(axis=1) - 1).max() < tol:
            break
    return X


def dense_ds(n: int, seed: int, scale: float = 2.0) -> np.ndarray:
    """The benchmark family: Sinkhorn of exp(scale * N(0, 1))."""
    rng = np.random.default_rng(seed)
    return sinkhorn_reference(np.exp(scale * rng.standard_normal((n, n))))


def bottleneck_value(R: np.ndarray) -> float | None:
    """max over perfect matchings on R > 0 of the smallest matched entry (binary search + scipy)."""
    found = scipy_bottleneck_matching(R)
    return None if found is None else found[0]


def max_weight_objective(R: np.ndarray) -> float:
    """Largest sum_i R[i, p(i)] over the perfect matchings inside the support of R."""
    cost = np.where(R > 0, -R, 1e6)  # a large finite cost keeps scipy on the support
    rows, cols = scipy_lsa(cost)
    assert (R[rows, cols] > 0).all()
    return float(R[rows, cols].sum())


def assert_permutations(perms: np.ndarray, n: int) -> None:
    assert perms.dtype == np.int64
    assert perms.ndim == 2 and perms.shape[1] == n
    assert (np.sort(perms, axis=1) == np.arange(n)).all()


# ----------------------------------------------------------------------------- decomposition
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [1, 2, 7, 48])
def test_dense_decomposition_reconstructs(method, n):
    D = dense_ds(n, seed=n)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method=method)
    assert coeffs.dtype == np.float64
    assert_permutations(perms, n)
    assert (coeffs > 0).all()
    assert 1 - 1e-9 - 1e-12 <= coeffs.sum() <= 1 + 1e-12
    residual = D - reconstruct(coeffs, perms, n)
    # The residual is what is left of D: non-negative up to rounding, at most tol per entry.
    assert residual.min() >= -1e-12
    assert residual.max() <= 1e-9 + 1e-12


@pytest.mark.parametrize("method", METHODS)
def test_float32_decomposition(method):
    D = dense_ds(32, seed=3).astype(np.float32)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method=method, tol=1e-6)
    assert coeffs.dtype == np.float32
    assert_permutations(perms, 32)
    assert (coeffs > 0).all()
    assert abs(float(coeffs.sum(dtype=np.float64)) - 1) < 1e-5
    assert np.abs(D - reconstruct(coeffs, perms, 32)).max() < 1e-5


def test_dense_bottleneck_n256_reconstructs():
    D = dense_ds(256, seed=0)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method="bottleneck")
    assert_permutations(perms, 256)
    assert np.abs(D - reconstruct(coeffs, perms, 256)).max() <= 1e-9 + 1e-12


@pytest.mark.parametrize("n", [256, 1024])
@pytest.mark.parametrize("k", [5, 20])
def test_planted_bottleneck_recovers_exactly_k_terms(n, k):
    D, weights, planted_perms = planted(n, k, seed=n + k)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method="bottleneck")
    assert len(coeffs) == k
    # The bottleneck of the residual is the largest remaining weight, so terms come out in
    # decreasing weight order, each one a planted permutation.
    order = np.argsort(-weights)
    np.testing.assert_allclose(coeffs, weights[order], rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(perms, planted_perms[order])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_planted_bottleneck_float_dtypes(dtype):
    D, weights, _ = planted(200, 8, seed=11, dtype=dtype)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method="bottleneck", tol=1e-6)
    assert len(coeffs) == 8
    np.testing.assert_allclose(coeffs, np.sort(weights)[::-1], rtol=1e-5 if dtype == np.float32 else 1e-12)


def test_every_bottleneck_term_is_a_bottleneck_matching():
    D = dense_ds(14, seed=5)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method="bottleneck")
    R = D.copy()
    rows = np.arange(14)
    for c, p in zip(coeffs, perms):
        # Residual entries of the removed support are exactly zero in the kernel; here they
        # are rounding-level, so compare against the reference on entries above that level.
        R_clean = np.where(R > 1e-13, R, 0.0)
        assert R[rows, p].min() == pytest.approx(c, rel=1e-12, abs=1e-15)
        assert c == pytest.approx(bottleneck_value(R_clean), rel=1e-9, abs=1e-15)
        R[rows, p] -= c


@pytest.mark.parametrize("n", [5, 30, 120])
@pytest.mark.parametrize("density", [0.15, 1.0])
def test_bottleneck_matching_against_scipy(n, density):
    rng = np.random.default_rng(n)
    for _ in range(5):
        A = rng.random((n, n)) * (rng.random((n, n)) < density)
        A[np.arange(n), rng.permutation(n)] += 0.01  # keep a perfect matching in the support
        cols, value = _core.bottleneck_matching(A)
        assert sorted(cols.tolist()) == list(range(n))
        assert A[np.arange(n), cols].min() == value
        assert value == bottleneck_value(A)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7).flatmap(lambda n: st.lists(st.integers(0, 3), min_size=n * n, max_size=n * n)))
def test_bottleneck_matching_with_ties_property(entries):
    n = int(round(len(entries) ** 0.5))
    A = np.array(entries, dtype=np.float64).reshape(n, n)
    ref = bottleneck_value(A)
    if ref is None:
        with pytest.raises(ValueError, match="no perfect matching"):
            _core.bottleneck_matching(A)
        return
    cols, value = _core.bottleneck_matching(A)
    assert sorted(cols.tolist()) == list(range(n))
    assert value == ref == A[np.arange(n), cols].min()


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 9).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.permutations(list(range(n))), min_size=1, max_size=6),
            st.lists(st.integers(1, 4), min_size=6, max_size=6),
        )
    ),
    st.sampled_from(METHODS),
)
def test_decomposition_of_integer_weighted_permutations_property(case, method):
    # Integer weights make many ties, the hard case for the sorted rows and the duals.
    n, perms_in, weights = case
    w = np.array(weights[: len(perms_in)], dtype=np.float64)
    w /= w.sum()
    D = reconstruct(w, perms_in, n)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method=method)
    assert_permutations(perms, n)
    assert (coeffs > 0).all()
    assert len(coeffs) <= np.count_nonzero(D)
    assert np.abs(D - reconstruct(coeffs, perms, n)).max() <= 1e-9 + 1e-12
    # Every term is optimal for the residual it was taken from.
    R = D.copy()
    rows = np.arange(n)
    for c, p in zip(coeffs, perms):
        R_clean = np.where(R > 1e-12, R, 0.0)
        if method == "max-weight":
            assert R[rows, p].sum() == pytest.approx(max_weight_objective(R_clean), abs=1e-12)
        else:
            assert R[rows, p].min() == pytest.approx(bottleneck_value(R_clean), abs=1e-12)
        R[rows, p] -= c


@pytest.mark.parametrize("method", METHODS)
def test_sparse_doubly_stochastic_reconstructs(method):
    # Sinkhorn on the union of a few permutations: a sparse pattern with total support.
    rng = np.random.default_rng(12)
    n = 80
    pattern = np.zeros((n, n), dtype=bool)
    for _ in range(4):
        pattern[np.arange(n), rng.permutation(n)] = True
    D = pyperm.sinkhorn(np.where(pattern, rng.random((n, n)) + 0.1, 0.0))
    coeffs, perms = pyperm.birkhoff_decomposition(D, method=method)
    assert pattern[np.arange(n), perms].all()  # every term stays on the support
    assert np.abs(D - reconstruct(coeffs, perms, n)).max() < 1e-8


def test_bottleneck_matching_infeasible_and_invalid():
    A = np.ones((3, 3))
    A[:, 1] = 0
    with pytest.raises(ValueError, match="no perfect matching"):
        _core.bottleneck_matching(A)
    with pytest.raises(ValueError, match="invalid numeric"):
        _core.bottleneck_matching(np.full((2, 2), np.nan))


def test_max_weight_terms_are_maximum_weight_matchings():
    D = dense_ds(64, seed=9)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method="max-weight", max_terms=6)
    rows = np.arange(64)
    # The first term is the projection of D onto the permutations (scipy's optimum).
    assert D[rows, perms[0]].sum() == pytest.approx(max_weight_objective(D), rel=1e-12)
    R = D.copy()
    for c, p in zip(coeffs, perms):
        assert R[rows, p].sum() == pytest.approx(max_weight_objective(np.where(R > 1e-13, R, 0)), rel=1e-12)
        assert R[rows, p].min() == pytest.approx(c, rel=1e-12)
        R[rows, p] -= c


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_max_weight_incremental_solver_agrees_with_lap_warm_start(dtype):
    # Two independent exact solvers (incremental JV vs lap_cpu's solve_square_warm) must
    # find the same unique optimum term after term.
    D = dense_ds(40, seed=13).astype(dtype)
    ours = _core.bvn_decompose(D, "max-weight", 25, 1e-9)
    lap = _core.bvn_decompose(D, "max-weight-lapwarm", 25, 1e-9)
    np.testing.assert_array_equal(ours[1], lap[1])
    np.testing.assert_array_equal(ours[0], lap[0])


@pytest.mark.parametrize("method", METHODS)
def test_results_do_not_depend_on_the_simd_variant(method):
    D = dense_ds(70, seed=14)
    runs = [_core.bvn_decompose(D, method, 40, 1e-9, None, isa) for isa in ("baseline", "avx2", "avx512")]
    for coeffs, perms, _, _ in runs[1:]:
        np.testing.assert_array_equal(coeffs, runs[0][0])
        np.testing.assert_array_equal(perms, runs[0][1])


def test_max_weight_float32_first_term():
    D = dense_ds(50, seed=4)
    _, perms = pyperm.birkhoff_decomposition(D.astype(np.float32), max_terms=1)
    assert D[np.arange(50), perms[0]].sum() == pytest.approx(max_weight_objective(D), rel=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_max_terms_truncates(method):
    D = dense_ds(20, seed=1)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method=method, max_terms=3)
    assert coeffs.shape == (3,) and perms.shape == (3, 20)
    assert coeffs.sum() < 1
    full, full_perms = pyperm.birkhoff_decomposition(D, method=method)
    np.testing.assert_array_equal(coeffs, full[:3])
    np.testing.assert_array_equal(perms, full_perms[:3])


@pytest.mark.parametrize("method", METHODS)
def test_tol_stops_early(method):
    D = dense_ds(20, seed=2)
    coeffs, _ = pyperm.birkhoff_decomposition(D, method=method, tol=0.1)
    assert 1 - coeffs.sum() <= 0.1
    assert 1 - coeffs[:-1].sum() > 0.1  # it stopped at the first term that got there


@pytest.mark.parametrize("method", METHODS)
def test_permutation_and_identity_inputs(method):
    P = np.eye(6)[[3, 1, 5, 0, 2, 4]]
    coeffs, perms = pyperm.birkhoff_decomposition(P, method=method)
    assert coeffs.tolist() == [1.0]
    assert perms.tolist() == [[3, 1, 5, 0, 2, 4]]
    coeffs, perms = pyperm.birkhoff_decomposition(np.full((4, 4), 0.25), method=method)
    assert len(coeffs) == 4 and coeffs.sum() == pytest.approx(1)
    assert_permutations(perms, 4)


def test_empty_matrix():
    coeffs, perms = pyperm.birkhoff_decomposition(np.zeros((0, 0)))
    assert coeffs.shape == (0,) and perms.shape == (0, 0) and perms.dtype == np.int64


@pytest.mark.parametrize("method", METHODS)
def test_deterministic(method):
    D = dense_ds(40, seed=8)
    a = pyperm.birkhoff_decomposition(D, method=method)
    b = pyperm.birkhoff_decomposition(D.copy(), method=method)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_integer_and_non_contiguous_input():
    D = np.eye(5, dtype=np.int32)[[1, 0, 2, 4, 3]]
    coeffs, perms = pyperm.birkhoff_decomposition(D)
    assert coeffs.dtype == np.float64 and coeffs.tolist() == [1.0]
    E = dense_ds(10, seed=0)
    a = pyperm.birkhoff_decomposition(np.asfortranarray(E))
    b = pyperm.birkhoff_decomposition(E)
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("method", METHODS)
def test_approximately_doubly_stochastic_input(method):
    D = dense_ds(30, seed=6)
    noisy = D * (1 + 1e-8 * np.random.default_rng(0).standard_normal(D.shape))
    coeffs, perms = pyperm.birkhoff_decomposition(noisy, method=method)
    assert_permutations(perms, 30)
    # It stops when the support runs out (or at tol): what is left is within the input's error.
    assert np.abs(noisy - reconstruct(coeffs, perms, 30)).max() < 1e-6
    tiny_negative = np.eye(3) - 1e-9
    tiny_negative[0, 0] += 3e-9
    coeffs, _ = pyperm.birkhoff_decomposition(tiny_negative, method=method)
    assert coeffs[0] == pytest.approx(1 - 1e-9)


@needs_torch
def test_torch_in_torch_out(device):
    D = torch.tensor(dense_ds(16, seed=7), device=device)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method="bottleneck")
    assert isinstance(coeffs, torch.Tensor) and isinstance(perms, torch.Tensor)
    assert coeffs.dtype == torch.float64 and perms.dtype == torch.int64
    assert coeffs.device == D.device and perms.device == D.device
    ref = pyperm.birkhoff_decomposition(D.cpu().numpy(), method="bottleneck")
    np.testing.assert_array_equal(perms.cpu().numpy(), ref[1])
    c32, _ = pyperm.birkhoff_decomposition(D.float(), max_terms=2)
    assert c32.dtype == torch.float32


def test_progress_callback_and_stop():
    D = dense_ds(24, seed=1)
    seen = []

    def record(terms, coeff, residual):
        seen.append((terms, coeff, residual))

    coeffs, _ = pyperm.birkhoff_decomposition(D, method="bottleneck", progress=record)
    assert [s[0] for s in seen] == list(range(1, len(coeffs) + 1))
    np.testing.assert_allclose([s[1] for s in seen], coeffs)
    np.testing.assert_allclose([s[2] for s in seen], 1 - np.cumsum(coeffs), atol=1e-12)

    def stop_after_five(terms, coeff, residual):
        if terms == 5:
            raise StopIteration

    coeffs, perms = pyperm.birkhoff_decomposition(D, progress=stop_after_five)
    assert len(coeffs) == 5 and perms.shape == (5, 24)

    def broken(terms, coeff, residual):
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        pyperm.birkhoff_decomposition(D, progress=broken)


def test_progress_bar(capsys):
    pytest.importorskip("tqdm")
    D = dense_ds(12, seed=1)
    coeffs, _ = pyperm.birkhoff_decomposition(D, progress=True)
    assert "Birkhoff (max-weight)" in capsys.readouterr().err
    coeffs_quiet, _ = pyperm.birkhoff_decomposition(D)
    np.testing.assert_array_equal(coeffs, coeffs_quiet)
    assert capsys.readouterr().err == ""


def test_debug_log_reports_stop_reason(caplog):
    with caplog.at_level(logging.DEBUG, logger="pyperm"):
        pyperm.birkhoff_decomposition(dense_ds(8, seed=0), max_terms=2)
    assert "stopped: max_terms" in caplog.text


@pytest.mark.parametrize(
    "D, exc, match",
    [
        (np.ones(4) / 4, ValueError, "D must be a 2-D array"),
        (np.ones((2, 2, 2)) / 2, ValueError, "D must be a 2-D array"),
        (np.ones((2, 3)) / 2, ValueError, "D must be square, got shape \\(2, 3\\)"),
        (np.array([[np.nan, 1.0], [1.0, 0.0]]), ValueError, "D contains NaN or infinite"),
        (np.array([[np.inf, 1.0], [1.0, 0.0]]), ValueError, "D contains NaN or infinite"),
        (np.array([[1.5, -0.5], [-0.5, 1.5]]), ValueError, "D must be non-negative: entry \\(0, 1\\) is -0.5"),
        (np.array([[0.5, 0.6], [0.5, 0.4]]), ValueError, "row sums are off from 1 by up to 0.1 \\(row 0\\)"),
        (np.array([[0.7, 0.3], [0.4, 0.6]]), ValueError, "column sums by up to 0.1 \\(column 0\\)"),
        (np.ones((2, 2), dtype=complex) / 2, ValueError, "D must be real"),
        (np.array([["a", "b"], ["c", "d"]]), ValueError, "D must contain numerical entries"),
    ],
)
def test_decomposition_input_errors(D, exc, match):
    with pytest.raises(exc, match=match):
        pyperm.birkhoff_decomposition(D)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"method": "hungarian"}, ValueError, "method must be one of 'max-weight', 'bottleneck', got 'hungarian'"),
        ({"method": 3}, TypeError, "method must be one of 'max-weight', 'bottleneck', got int"),
        ({"max_terms": 0}, ValueError, "max_terms must be at least 1, got 0"),
        ({"max_terms": -2}, ValueError, "max_terms must be at least 1"),
        ({"max_terms": 2.5}, TypeError, "max_terms must be an int or None"),
        ({"max_terms": True}, TypeError, "max_terms must be an int or None"),
        ({"tol": -1e-3}, ValueError, "tol must be finite and non-negative"),
        ({"tol": float("nan")}, ValueError, "tol must be finite and non-negative"),
        ({"tol": "small"}, TypeError, "tol must be a real number"),
        ({"atol": -1.0}, ValueError, "atol must be finite and non-negative"),
        ({"progress": "yes"}, TypeError, "progress must be a bool or a callable"),
    ],
)
def test_decomposition_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pyperm.birkhoff_decomposition(np.eye(3), **kwargs)


def test_atol_controls_the_check():
    D = np.array([[0.5, 0.5 + 1e-3], [0.5, 0.5 - 1e-3]])
    with pytest.raises(ValueError, match="tolerance atol=1e-06"):
        pyperm.birkhoff_decomposition(D)
    coeffs, _ = pyperm.birkhoff_decomposition(D, atol=1e-2)
    assert coeffs.sum() == pytest.approx(1, abs=2e-3)


def test_device_arrays_dispatch_to_cuda_or_are_rejected():
    class FakeDeviceArray:
        __cuda_array_interface__ = {"shape": (2, 2), "typestr": "<f8", "data": (8, False), "version": 3}

    # Bottleneck has no CUDA twin and reads only torch tensors back to the host.
    with pytest.raises(TypeError, match="D is a device array"):
        pyperm.birkhoff_decomposition(FakeDeviceArray(), method="bottleneck")
    if not pyperm.cuda_available():
        # Max-weight goes to the CUDA backend, which says why it cannot run.
        with pytest.raises(RuntimeError, match="CUDA"):
            pyperm.birkhoff_decomposition(FakeDeviceArray())


def test_core_rejects_non_finite_and_bad_method():
    with pytest.raises(ValueError, match="invalid numeric"):
        _core.bvn_decompose(np.array([[np.nan]]), "bottleneck", -1, 1e-9)
    with pytest.raises(ValueError, match="method must be"):
        _core.bvn_decompose(np.eye(2), "greedy", -1, 1e-9)
    with pytest.raises(ValueError, match="square"):
        _core.bvn_decompose(np.ones((2, 3)), "bottleneck", -1, 1e-9)


# ----------------------------------------------------------------------------- sampling
def three_term_matrix():
    n = 8
    shifts = [0, 3, 5]
    weights = np.array([0.5, 0.3, 0.2])
    perms = np.array([(np.arange(n) + s) % n for s in shifts])
    return reconstruct(weights, perms, n), weights, perms


def test_sample_permutations_reproducible():
    D = dense_ds(20, seed=0)
    a = pyperm.sample_permutations(D, 50, generator=123)
    b = pyperm.sample_permutations(D, 50, generator=123)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (50, 20) and a.dtype == np.int64
    assert_permutations(a, 20)
    g = np.random.default_rng(5)
    first = pyperm.sample_permutations(D, 50, generator=g)
    second = pyperm.sample_permutations(D, 50, generator=g)  # the generator advanced
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(first, pyperm.sample_permutations(D, 50, generator=np.random.default_rng(5)))
    # Every sample is one of the first max_terms terms of the max-weight decomposition.
    _, terms = pyperm.birkhoff_decomposition(D, max_terms=10)
    assert {tuple(p) for p in a} <= {tuple(p) for p in terms}
    unseeded = pyperm.sample_permutations(D, 3)
    assert_permutations(unseeded, 20)


def test_sample_permutations_follow_coefficients():
    D, weights, perms = three_term_matrix()
    num = 20000
    samples = pyperm.sample_permutations(D, num, generator=0)
    counts = np.array([(samples == p).all(axis=1).sum() for p in perms])
    assert counts.sum() == num
    sigma = np.sqrt(num * weights * (1 - weights))
    assert (np.abs(counts - num * weights) < 4 * sigma).all()
    # Truncation renormalises the kept coefficients.
    samples = pyperm.sample_permutations(D, num, max_terms=2, generator=1)
    counts = np.array([(samples == p).all(axis=1).sum() for p in perms])
    kept = weights[:2] / weights[:2].sum()
    assert counts[2] == 0
    assert (np.abs(counts[:2] - num * kept) < 4 * np.sqrt(num * kept * (1 - kept))).all()


@needs_torch
def test_sample_permutations_torch_and_edge_cases(device):
    D, _, _ = three_term_matrix()
    out = pyperm.sample_permutations(torch.tensor(D, device=device), 7, generator=0)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64 and out.device.type == device
    np.testing.assert_array_equal(out.cpu().numpy(), pyperm.sample_permutations(D, 7, generator=0))
    assert pyperm.sample_permutations(D, 0, generator=0).shape == (0, 8)
    assert pyperm.sample_permutations(np.zeros((0, 0)), 3).shape == (3, 0)
    bottleneck = pyperm.sample_permutations(D, 5, generator=0, method="bottleneck")
    assert_permutations(bottleneck, 8)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((-1,), {}, ValueError, "num_samples must be at least 0"),
        ((2.0,), {}, TypeError, "num_samples must be an int"),
        ((2,), {"max_terms": 0}, ValueError, "max_terms must be at least 1"),
        ((2,), {"max_terms": None}, TypeError, "max_terms must be an int"),
        ((2,), {"generator": "seed"}, TypeError, "generator must be a numpy Generator, an int seed or None"),
        ((2,), {"generator": np.random.RandomState(0)}, TypeError, "generator must be a numpy Generator"),
        ((2,), {"generator": -3}, ValueError, "generator seed must be non-negative"),
        ((2,), {"method": "best"}, ValueError, "method must be one of"),
    ],
)
def test_sample_permutations_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pyperm.sample_permutations(np.eye(3), *args, **kwargs)


def test_sample_permutations_checks_D():
    with pytest.raises(ValueError, match="not doubly stochastic"):
        pyperm.sample_permutations(np.ones((3, 3)), 2, generator=0)


# ----------------------------------------------------------------------------- projection
def project_reference(M: np.ndarray, iters: int) -> np.ndarray:
    """(I - J) X (I - J) + J, then max(., 0), with J = 11^T / n (explicit matrices)."""
    n = M.shape[-1]
    J = np.full((n, n), 1.0 / n)
    W = np.eye(n) - J
    X = M.astype(np.float64)
    for _ in range(iters):
        X = np.maximum(W @ X @ W + J, 0)
    return X


def ds_error(X) -> float:
    X = np.asarray(X, dtype=np.float64)
    return max(np.abs(X.sum(-1) - 1).max(), np.abs(X.sum(-2) - 1).max())


@pytest.mark.parametrize("iters", [0, 1, 5, 20])
def test_projection_matches_reference(iters):
    M = np.random.default_rng(iters).standard_normal((9, 9))
    np.testing.assert_allclose(pyperm.project_doubly_stochastic(M, iters), project_reference(M, iters), atol=1e-12)


def test_projection_output_doubly_stochastic():
    rng = np.random.default_rng(0)
    # A projected gradient step away from a doubly stochastic matrix (the PAM use): 20
    # iterations land on the doubly stochastic matrices.
    step = pyperm.sinkhorn(rng.random((30, 30))) + 0.01 * rng.standard_normal((30, 30))
    X = pyperm.project_doubly_stochastic(step, iters=20)
    assert X.min() >= 0
    assert ds_error(X) < 1e-12
    # Far from the set, the error shrinks with the iterations and reaches zero eventually.
    for M in (rng.random((30, 30)) + np.eye(30), rng.standard_normal((30, 30))):
        errors = [ds_error(pyperm.project_doubly_stochastic(M, iters=k)) for k in (5, 20, 100, 1000)]
        assert errors[0] > errors[1] > errors[2] > errors[3]
        assert errors[3] < 1e-12
        assert pyperm.project_doubly_stochastic(M, iters=1000).min() >= 0


def test_projection_fixed_points_and_batches():
    D = dense_ds(10, seed=1)
    np.testing.assert_allclose(pyperm.project_doubly_stochastic(D), D, atol=1e-14)
    P = np.eye(5)[[2, 0, 1, 4, 3]]
    np.testing.assert_allclose(pyperm.project_doubly_stochastic(P), P, atol=1e-15)
    M = np.random.default_rng(2).standard_normal((3, 2, 6, 6))
    X = pyperm.project_doubly_stochastic(M)
    assert X.shape == M.shape
    for idx in np.ndindex(3, 2):
        np.testing.assert_allclose(X[idx], project_reference(M[idx], 20), atol=1e-12)
    assert pyperm.project_doubly_stochastic(np.zeros((0, 0))).shape == (0, 0)
    M32 = M.astype(np.float32)
    assert pyperm.project_doubly_stochastic(M32).dtype == np.float32
    assert pyperm.project_doubly_stochastic(np.eye(3, dtype=int)).dtype == np.float64


def test_projection_does_not_modify_input():
    M = np.random.default_rng(3).standard_normal((5, 5))
    before = M.copy()
    pyperm.project_doubly_stochastic(M)
    np.testing.assert_array_equal(M, before)


@needs_torch
def test_projection_torch(device):
    M = np.random.default_rng(4).standard_normal((2, 7, 7))
    T = torch.tensor(M, device=device, requires_grad=True)
    X = pyperm.project_doubly_stochastic(T, iters=20)
    assert isinstance(X, torch.Tensor) and X.device == T.device and X.dtype == torch.float64
    np.testing.assert_allclose(X.detach().cpu().numpy(), pyperm.project_doubly_stochastic(M), atol=1e-12)
    X.sum().backward()  # differentiable
    assert T.grad is not None and T.grad.shape == T.shape
    assert pyperm.project_doubly_stochastic(torch.eye(3, dtype=torch.int64)).dtype == torch.float64


@pytest.mark.parametrize(
    "M, kwargs, exc, match",
    [
        (np.ones(3), {}, ValueError, "M must be a 2-D \\(n, n\\) or batched"),
        (np.ones((2, 3)), {}, ValueError, "M must be square, got shape \\(2, 3\\)"),
        (np.ones((4, 2, 3)), {}, ValueError, "M must be square in its last two dimensions, got shape \\(4, 2, 3\\)"),
        (np.array([[np.nan, 0], [0, 1]]), {}, ValueError, "M contains NaN or infinite"),
        (np.ones((2, 2), dtype=complex), {}, ValueError, "M must be real"),
        (np.eye(2), {"iters": -1}, ValueError, "iters must be at least 0"),
        (np.eye(2), {"iters": 2.5}, TypeError, "iters must be an int"),
        ([[1.0, 2.0], [3.0]], {}, ValueError, "M could not be read as an array"),
    ],
)
def test_projection_errors(M, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pyperm.project_doubly_stochastic(M, **kwargs)


@needs_torch
def test_projection_torch_errors():
    with pytest.raises(ValueError, match="M must be real"):
        pyperm.project_doubly_stochastic(torch.ones(2, 2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="M must be a 2-D"):
        pyperm.project_doubly_stochastic(torch.ones(3))
    with pytest.raises(ValueError, match="NaN"):
        pyperm.project_doubly_stochastic(torch.tensor([[float("inf"), 0.0], [0.0, 1.0]]))


# ----------------------------------------------------------------------------- sinkhorn
def test_sinkhorn_matches_reference_and_converges():
    M = np.exp(2 * np.random.default_rng(0).standard_normal((40, 40)))
    X = pyperm.sinkhorn(M)
    np.testing.assert_allclose(X.sum(axis=1), 1, atol=1e-12)
    assert np.abs(X.sum(axis=0) - 1).max() <= 1e-9
    np.testing.assert_allclose(X, sinkhorn_reference(M), atol=1e-9)
    # X = diag(r) M diag(c): log(X / M) is a sum of a row term and a column term.
    L = np.log(X / M)
    np.testing.assert_allclose(L - L[:, :1] - L[:1, :] + L[0, 0], 0, atol=1e-10)


def test_sinkhorn_tol_and_dtypes():
    M = np.random.default_rng(1).random((20, 20)) + 0.1
    loose = pyperm.sinkhorn(M, tol=1e-3)
    assert np.abs(loose.sum(axis=0) - 1).max() <= 1e-3
    X32 = pyperm.sinkhorn(M.astype(np.float32))
    assert X32.dtype == np.float32
    assert np.abs(X32.sum(axis=0) - 1).max() <= 1e-5
    assert pyperm.sinkhorn(np.ones((3, 3), dtype=int)).dtype == np.float64
    np.testing.assert_allclose(pyperm.sinkhorn(np.ones((3, 3))), np.full((3, 3), 1 / 3))
    assert pyperm.sinkhorn(np.zeros((0, 0))).shape == (0, 0)


def test_sinkhorn_with_zeros_and_batches():
    rng = np.random.default_rng(2)
    M = rng.random((4, 12, 12)) * (rng.random((4, 12, 12)) < 0.6) + np.eye(12)
    X = pyperm.sinkhorn(M, iters=20000)
    assert X.shape == M.shape
    for b in range(4):
        np.testing.assert_allclose(X[b], pyperm.sinkhorn(M[b], iters=20000), atol=1e-12)
        assert ds_error(X[b]) <= 1e-9
    assert (X[M == 0] == 0).all()


@needs_torch
def test_sinkhorn_torch(device):
    M = np.exp(np.random.default_rng(3).standard_normal((3, 9, 9)))
    T = torch.tensor(M, device=device)
    X = pyperm.sinkhorn(T)
    assert isinstance(X, torch.Tensor) and X.device == T.device and X.dtype == torch.float64
    np.testing.assert_allclose(X.cpu().numpy(), pyperm.sinkhorn(M), atol=1e-12)


def test_sinkhorn_not_converged_logs_a_warning(caplog):
    M = np.exp(3 * np.random.default_rng(4).standard_normal((30, 30)))
    with caplog.at_level(logging.WARNING, logger="pyperm"):
        X = pyperm.sinkhorn(M, iters=2)
    assert "sinkhorn: column sums still off" in caplog.text
    np.testing.assert_allclose(X.sum(axis=1), 1, atol=1e-12)  # rows stay exact


def test_sinkhorn_feeds_the_decomposition():
    X = pyperm.sinkhorn(np.exp(2 * np.random.default_rng(5).standard_normal((64, 64))))
    coeffs, perms = pyperm.birkhoff_decomposition(X, method="bottleneck")
    assert np.abs(X - reconstruct(coeffs, perms, 64)).max() < 1e-8


@pytest.mark.parametrize(
    "M, kwargs, exc, match",
    [
        (np.array([[1.0, -1.0], [1.0, 1.0]]), {}, ValueError, "M must be non-negative, its smallest entry is -1"),
        (np.array([[1.0, np.nan], [1.0, 1.0]]), {}, ValueError, "M contains NaN or infinite"),
        (np.array([[1.0, np.inf], [1.0, 1.0]]), {}, ValueError, "M contains NaN or infinite"),
        (np.array([[0.0, 0.0], [1.0, 1.0]]), {}, ValueError, "M has a row without a positive entry"),
        (np.array([[0.0, 1.0], [0.0, 1.0]]), {}, ValueError, "M has a column without a positive entry"),
        (np.ones((2, 3)), {}, ValueError, "M must be square"),
        (np.ones(3), {}, ValueError, "M must be a 2-D"),
        (np.ones((2, 2)), {"iters": 0}, ValueError, "iters must be at least 1"),
        (np.ones((2, 2)), {"iters": "5"}, TypeError, "iters must be an int"),
        (np.ones((2, 2)), {"tol": -1.0}, ValueError, "tol must be finite and non-negative"),
        (np.ones((2, 2)), {"tol": "x"}, TypeError, "tol must be a real number"),
    ],
)
def test_sinkhorn_errors(M, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pyperm.sinkhorn(M, **kwargs)
