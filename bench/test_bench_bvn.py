"""pytest-benchmark timings of the Birkhoff-von Neumann decomposition (run: pytest bench/test_bench_bvn.py).

Each case checks its answer before it is timed. The same cases, with the scipy-based
reference and the ratios, are printed by ``pyperm bench bvn``.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyperm
from pyperm.testing import dense_doubly_stochastic, planted, reconstruct, scipy_max_weight_greedy

pytest.importorskip("pytest_benchmark")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_bench_dense256_bottleneck_full(benchmark, dtype):
    D = dense_doubly_stochastic(256, 0, dtype)
    tol = 1e-9 if dtype == np.float64 else 1e-6
    coeffs, perms = pyperm.birkhoff_decomposition(D, method="bottleneck", tol=tol)
    assert np.abs(D - reconstruct(coeffs, perms)).max() < 10 * tol
    benchmark.extra_info["terms"] = len(coeffs)
    benchmark(pyperm.birkhoff_decomposition, D, method="bottleneck", tol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_bench_dense1024_max_weight_10_terms(benchmark, dtype):
    D = dense_doubly_stochastic(1024, 1, dtype)
    coeffs, perms = pyperm.birkhoff_decomposition(D, method="max-weight", max_terms=10)
    _, ref_perms = scipy_max_weight_greedy(D, 1)
    rows = np.arange(1024)
    D64 = D.astype(np.float64)
    assert D64[rows, perms[0]].sum() == pytest.approx(D64[rows, ref_perms[0]].sum(), rel=1e-6)
    benchmark(pyperm.birkhoff_decomposition, D, method="max-weight", max_terms=10)


@pytest.mark.parametrize("n, k", [(256, 5), (1024, 20)])
def test_bench_planted_bottleneck(benchmark, n, k):
    D, weights, _ = planted(n, k, 2)
    coeffs, _ = pyperm.birkhoff_decomposition(D, method="bottleneck")
    assert len(coeffs) == k
    benchmark(pyperm.birkhoff_decomposition, D, method="bottleneck")


def test_bench_sample_permutations(benchmark):
    D = dense_doubly_stochastic(512, 3)
    out = pyperm.sample_permutations(D, 32, generator=0)
    assert out.shape == (32, 512)
    benchmark(pyperm.sample_permutations, D, 32, generator=0)


def test_bench_sinkhorn_and_projection(benchmark):
    M = np.exp(2.0 * np.random.default_rng(4).standard_normal((512, 512)))

    def both():
        return pyperm.project_doubly_stochastic(pyperm.sinkhorn(M), iters=20)

    X = both()
    assert np.abs(X.sum(axis=0) - 1).max() < 1e-8
    benchmark(both)
