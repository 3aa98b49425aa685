"""pytest-benchmark timings of CrossCorrelation (run: pytest bench/test_bench_xcorr.py).

Each case checks its answer before it is timed. ``update`` and the bare BLAS product
``xa.T @ xb`` of the same data share a benchmark group per shape, so pytest-benchmark's
table shows the overhead of the update directly; ``pyperm bench xcorr`` prints the ratios.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyperm

pytest.importorskip("pytest_benchmark")

SHAPES = [(512, 256), (512, 2048), (1024, 1024), (2048, 256)]


def _pair(dim: int, batch: int, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    xa = rng.standard_normal((batch, dim), dtype=np.float32)
    xb = 0.5 * xa[:, ::-1] + rng.standard_normal((batch, dim), dtype=np.float32)
    return xa.astype(dtype), xb.astype(dtype)


def _check_update(xa: np.ndarray, xb: np.ndarray) -> None:
    acc = pyperm.CrossCorrelation(xa.shape[1], xb.shape[1]).update(xa, xb)
    a, b = xa[:, :16].astype(np.float64), xb.astype(np.float64)
    ref = np.corrcoef(a.T, b.T)[:16, 16:]
    np.testing.assert_allclose(acc.correlation()[:16], ref, atol=1e-5)


@pytest.mark.parametrize(("dim", "batch"), SHAPES)
def test_bench_update(benchmark, dim, batch):
    benchmark.group = f"update dim={dim} batch={batch}"
    xa, xb = _pair(dim, batch)
    _check_update(xa, xb)
    acc = pyperm.CrossCorrelation(dim, dim)
    acc.update(xa, xb)  # allocate the workspace outside the timing
    benchmark(acc.update, xa, xb)


@pytest.mark.parametrize(("dim", "batch"), SHAPES)
def test_bench_blas_product(benchmark, dim, batch):
    benchmark.group = f"update dim={dim} batch={batch}"
    xa, xb = _pair(dim, batch)
    benchmark(np.matmul, xa.T, xb)


def test_bench_update_many_network(benchmark):
    # The layer pairs of a small CNN (conv channels as samples of every position) in one call.
    dims = [64, 64, 128, 128, 256, 256, 512]
    rng = np.random.default_rng(1)
    pairs = [(rng.standard_normal((1024, d), dtype=np.float32), rng.standard_normal((1024, d), dtype=np.float32))
             for d in dims]
    accs = pyperm.CrossCorrelationSet([(d, d) for d in dims])
    single = [pyperm.CrossCorrelation(d, d).update(a, b) for d, (a, b) in zip(dims, pairs)]
    accs.update(pairs)
    for one, batched in zip(single, accs.values()):
        np.testing.assert_array_equal(one.correlation(), batched.correlation())
    benchmark(accs.update, pairs)


@pytest.mark.parametrize("dim", [512, 2048])
def test_bench_correlation(benchmark, dim):
    xa, xb = _pair(dim, 512)
    acc = pyperm.CrossCorrelation(dim, dim).update(xa, xb)
    assert np.abs(acc.correlation()).max() <= 1.0
    benchmark(acc.correlation)


@pytest.mark.parametrize("dim", [512, 2048])
def test_bench_merge(benchmark, dim):
    xa, xb = _pair(dim, 256)
    left = pyperm.CrossCorrelation(dim, dim).update(xa[:128], xb[:128])
    right = pyperm.CrossCorrelation(dim, dim).update(xa[128:], xb[128:])
    whole = pyperm.CrossCorrelation(dim, dim).update(xa, xb)
    merged = pyperm.CrossCorrelation(dim, dim).merge(left).merge(right)
    np.testing.assert_allclose(merged.covariance(), whole.covariance(), atol=1e-5)
    benchmark(lambda: pyperm.CrossCorrelation(dim, dim).merge(left).merge(right))
