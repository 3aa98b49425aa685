"""pyperm.CrossCorrelation: streaming statistics checked against numpy on the concatenated data."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyperm
from pyperm import CrossCorrelation, CrossCorrelationSet, conv_to_samples


def _batches(rng, sizes, dim_a, dim_b, dtype=np.float64, loc=0.0, scale=1.0):
    """Correlated batches: B mixes A's channels, so correlations are far from 0."""
    mix = rng.standard_normal((dim_a, dim_b)) / np.sqrt(dim_a)
    out = []
    for m in sizes:
        za = rng.standard_normal((m, dim_a))
        zb = za @ mix + 0.5 * rng.standard_normal((m, dim_b))
        out.append(((loc + scale * za).astype(dtype), (-2 * loc + scale * zb).astype(dtype)))
    return out


def _reference(batches):
    xa = np.concatenate([a for a, _ in batches]).astype(np.float64)
    xb = np.concatenate([b for _, b in batches]).astype(np.float64)
    da = xa.shape[1]
    with np.errstate(invalid="ignore", divide="ignore"):  # numpy's NaN for constant channels
        corr = np.corrcoef(xa.T, xb.T)[:da, da:]
    cov = np.cov(xa.T, xb.T)[:da, da:]
    return xa, xb, corr, cov


def _accumulate(batches, dim_a, dim_b, **kwargs):
    acc = CrossCorrelation(dim_a, dim_b, **kwargs)
    for a, b in batches:
        acc.update(a, b)
    return acc


# --------------------------------------------------------------------------- agreement with numpy


@pytest.mark.parametrize("sizes", [[64, 64, 64], [1, 7, 300, 2, 33], [513]], ids=["equal", "unequal", "one"])
@pytest.mark.parametrize("dims", [(5, 7), (16, 16), (3, 1)])
def test_matches_numpy_float64(sizes, dims):
    rng = np.random.default_rng(0)
    batches = _batches(rng, sizes, *dims)
    acc = _accumulate(batches, *dims)
    xa, xb, corr, cov = _reference(batches)
    assert acc.count == sum(sizes)
    np.testing.assert_allclose(acc.correlation(), corr, rtol=0, atol=1e-9)
    np.testing.assert_allclose(acc.covariance(), cov, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(acc.covariance(ddof=0), np.cov(xa.T, xb.T, ddof=0)[: dims[0], dims[0]:], rtol=1e-9)
    np.testing.assert_allclose(acc.cross_product(), xa.T @ xb, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(acc.mean_a, xa.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(acc.mean_b, xb.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(acc.std_a, xa.std(0), rtol=1e-10)
    np.testing.assert_allclose(acc.std_b, xb.std(0), rtol=1e-10)
    np.testing.assert_array_equal(acc.min_a, xa.min(0))
    np.testing.assert_array_equal(acc.max_b, xb.max(0))
    for stat in (acc.correlation(), acc.covariance(), acc.cross_product()):
        assert stat.dtype == np.float64 and stat.shape == dims and isinstance(stat, np.ndarray)


def test_large_mean_small_spread_float64():
    # Naive sums of squares lose every digit here: mean 1e4, spread 1e-2 leaves
    # (1e-2 / 1e4)^2 = 1e-12 of the raw second moment to the variance.
    rng = np.random.default_rng(1)
    batches = _batches(rng, [100, 3, 250, 47], 6, 9, loc=1e4, scale=1e-2)
    acc = _accumulate(batches, 6, 9)
    xa, xb, corr, cov = _reference(batches)
    np.testing.assert_allclose(acc.correlation(), corr, rtol=0, atol=1e-9)
    np.testing.assert_allclose(acc.covariance(), cov, rtol=0, atol=1e-9 * np.abs(cov).max())
    np.testing.assert_allclose(acc.std_a, xa.std(0), rtol=1e-9)
    np.testing.assert_allclose(acc.mean_b, xb.mean(0), rtol=1e-14)


def test_large_mean_small_spread_float32():
    rng = np.random.default_rng(2)
    batches = _batches(rng, [128, 5, 300], 8, 4, dtype=np.float32, loc=1e4, scale=1e-2)
    acc = _accumulate(batches, 8, 4)
    _, _, corr, cov = _reference(batches)
    # The float32 data is exact; only the float32 batch product rounds.
    np.testing.assert_allclose(acc.correlation(), corr, rtol=0, atol=1e-5)
    np.testing.assert_allclose(acc.covariance(), cov, rtol=1e-4, atol=1e-4 * np.abs(cov).max())


def test_float32_drifting_and_sorted_batches():
    # The stream's mean jumps between batches and inside a batch (a batch sorted by class):
    # centring per batch about a centre spread over the batch keeps float32 accurate.
    rng = np.random.default_rng(20)
    batches = []
    for offset in (0.0, 5e3, -2e3):
        za = rng.standard_normal((400, 6))
        zb = za[:, :4] + 0.3 * rng.standard_normal((400, 4))
        shift = np.where(np.arange(400) < 200, 0.0, 50.0)[:, None]  # sorted: two clusters
        batches.append(((za + offset + shift).astype(np.float32), (zb - offset + shift).astype(np.float32)))
    acc = _accumulate(batches, 6, 4)
    _, _, corr, cov = _reference(batches)
    np.testing.assert_allclose(acc.correlation(), corr, atol=1e-5)
    np.testing.assert_allclose(acc.covariance(), cov, rtol=1e-5, atol=1e-5 * np.abs(cov).max())


@pytest.mark.parametrize("sizes", [[200, 200], [17, 300, 1]])
def test_float32_inputs(sizes):
    rng = np.random.default_rng(3)
    batches = _batches(rng, sizes, 12, 10, dtype=np.float32, loc=3.0)
    acc = _accumulate(batches, 12, 10)
    xa, xb, corr, cov = _reference(batches)
    np.testing.assert_allclose(acc.correlation(), corr, atol=1e-5)
    np.testing.assert_allclose(acc.covariance(), cov, atol=1e-5)
    np.testing.assert_allclose(acc.mean_a, xa.mean(0), atol=1e-6)
    assert acc.correlation().dtype == np.float64


def test_integer_bool_and_mixed_dtypes_use_float64():
    rng = np.random.default_rng(4)
    xa = rng.integers(-5, 5, size=(50, 4))
    xb = rng.random((50, 3)) > 0.5
    acc = CrossCorrelation(4, 3).update(xa, xb)
    _, _, corr, _ = _reference([(xa, xb)])
    np.testing.assert_allclose(acc.correlation(), corr, atol=1e-12)
    # float32 with float64: computed in float64, so as exact as float64.
    a32, b64 = _batches(rng, [40], 4, 3, dtype=np.float32)[0][0], rng.standard_normal((40, 3))
    acc = CrossCorrelation(4, 3).update(a32, b64)
    _, _, corr, _ = _reference([(a32, b64)])
    np.testing.assert_allclose(acc.correlation(), corr, atol=1e-12)


def test_non_native_layouts():
    # big-endian, misaligned, non-contiguous and Fortran-ordered inputs are copied, not misread
    x = np.random.default_rng(21).standard_normal((50, 3))
    raw = np.zeros(x.size * 8 + 1, dtype=np.uint8)
    misaligned = np.frombuffer(raw.data, dtype=np.float64, count=x.size, offset=1).reshape(x.shape)
    misaligned[...] = x
    assert not misaligned.flags.aligned
    wide = np.zeros((50, 6))
    wide[:, ::2] = x
    want = np.corrcoef(x.T)
    for xa, xb in [(x.astype(">f8"), misaligned), (wide[:, ::2], np.asfortranarray(x)), (x.astype(">f4"), x)]:
        acc = CrossCorrelation(3, 3).update(xa, xb)
        np.testing.assert_allclose(acc.correlation(), want, atol=1e-6 if xa.dtype.itemsize == 4 else 1e-12)


def test_accumulator_float32():
    rng = np.random.default_rng(5)
    batches = _batches(rng, [64, 64], 6, 5)
    acc = _accumulate(batches, 6, 5, dtype=np.float32)
    _, _, corr, _ = _reference(batches)
    assert acc.dtype == np.float32 and acc.correlation().dtype == np.float32
    assert acc.mean_a.dtype == np.float64
    np.testing.assert_allclose(acc.correlation(), corr, atol=1e-5)


def test_multi_tile_shapes_and_thread_independence():
    # Rows beyond one 256-row block and channels beyond one 512-column block; the result must
    # not depend on the number of threads (fixed blocks, fixed summation order).
    rng = np.random.default_rng(6)
    batches = _batches(rng, [700, 300], 530, 40)
    one = _accumulate(batches, 530, 40, threads=1)
    two = _accumulate(batches, 530, 40, threads=2)
    for name in ("correlation", "covariance", "cross_product"):
        np.testing.assert_array_equal(getattr(one, name)(), getattr(two, name)())
    _, _, corr, _ = _reference(batches)
    np.testing.assert_allclose(one.correlation(), corr, atol=1e-9)


@pytest.mark.parametrize("acc_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_instruction_set_variants_agree(monkeypatch, dtype, acc_dtype):
    # The core's loops are compiled for several instruction sets (FMA contraction may round
    # differently); every variant this CPU runs must give the same statistics.
    import pyperm.xcorr._state as xcorr_state

    rng = np.random.default_rng(19)
    batches = _batches(rng, [300, 70], 530, 33, dtype=dtype, loc=1e3)
    results = {}
    for isa in ("baseline", "avx2", "avx512"):
        monkeypatch.setattr(xcorr_state, "ISA", isa)
        acc = _accumulate(batches, 530, 33, dtype=acc_dtype)
        acc.merge(_accumulate(batches[:1], 530, 33))
        results[isa] = (acc.correlation(), acc.cross_product(), acc.covariance(), acc.mean_a, acc.std_b)
    tol = 1e-9 if dtype == acc_dtype == np.float64 else 1e-5
    for isa in ("avx2", "avx512"):
        for got, want in zip(results[isa], results["baseline"]):
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    monkeypatch.setattr(xcorr_state, "ISA", "sse9")
    with pytest.raises(ValueError, match="isa must be"):
        CrossCorrelation(2, 2).update(np.eye(2), np.eye(2))


def test_identical_streams_give_unit_diagonal():
    rng = np.random.default_rng(7)
    x = (1e3 + rng.standard_normal((300, 20))).astype(np.float32)
    acc = CrossCorrelation(20, 20).update(x, x)
    corr = acc.correlation()
    assert np.all(np.abs(corr) <= 1.0)
    np.testing.assert_allclose(np.diag(corr), 1.0, atol=1e-6)


def test_empty_batch_is_a_no_op():
    acc = CrossCorrelation(3, 2)
    acc.update(np.zeros((0, 3)), np.zeros((0, 2)))
    assert acc.count == 0
    acc.update(np.ones((4, 3)), np.arange(8.0).reshape(4, 2)).update(np.zeros((0, 3)), np.zeros((0, 2)))
    assert acc.count == 4


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    dim_a=st.integers(1, 6),
    dim_b=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_batching_matches_numpy(sizes, dim_a, dim_b, seed):
    rng = np.random.default_rng(seed)
    batches = [(rng.standard_normal((m, dim_a)) * 3 + 1, rng.standard_normal((m, dim_b))) for m in sizes]
    acc = _accumulate(batches, dim_a, dim_b)
    xa, xb = np.concatenate([a for a, _ in batches]), np.concatenate([b for _, b in batches])
    n = xa.shape[0]
    cov0 = (xa - xa.mean(0)).T @ (xb - xb.mean(0)) / n
    np.testing.assert_allclose(acc.covariance(ddof=0), cov0, atol=1e-10)
    np.testing.assert_allclose(acc.cross_product(), xa.T @ xb, atol=1e-9)


# --------------------------------------------------------------------------- zero variance


def test_zero_variance_channel_gives_zero_correlation():
    rng = np.random.default_rng(8)
    batches = _batches(rng, [30, 1, 50], 4, 5)
    for a, b in batches:
        a[:, 1] = 0.1  # a dead unit: constant, and 0.1 is not exact in binary
        b[:, 3] = -7.25e6
    acc = _accumulate(batches, 4, 5)
    corr = acc.correlation()
    assert not np.isnan(corr).any()
    assert np.all(corr[1, :] == 0) and np.all(corr[:, 3] == 0)
    assert acc.std_a[1] == 0.0 and acc.std_b[3] == 0.0
    assert acc.mean_a[1] == 0.1 and acc.mean_b[3] == -7.25e6
    _, _, ref, _ = _reference(batches)
    keep_a, keep_b = [0, 2, 3], [0, 1, 2, 4]
    np.testing.assert_allclose(corr[np.ix_(keep_a, keep_b)], ref[np.ix_(keep_a, keep_b)], atol=1e-9)
    np.testing.assert_array_equal(acc.covariance()[1], 0.0)


def test_constant_within_batches_but_not_across_has_variance():
    acc = CrossCorrelation(1, 1)
    acc.update(np.full((3, 1), 2.0), np.full((3, 1), 5.0))
    acc.update(np.full((2, 1), 4.0), np.full((2, 1), 1.0))
    xa = np.array([2.0] * 3 + [4.0] * 2)
    xb = np.array([5.0] * 3 + [1.0] * 2)
    np.testing.assert_allclose(acc.correlation(), [[-1.0]], atol=1e-12)
    np.testing.assert_allclose(acc.std_a, [xa.std()], rtol=1e-12)
    np.testing.assert_allclose(acc.covariance(), [[np.cov(xa, xb)[0, 1]]], rtol=1e-12)


def test_single_sample_has_zero_correlation_everywhere():
    acc = CrossCorrelation(3, 2).update([[1.0, 2.0, 3.0]], [[4.0, 5.0]])
    np.testing.assert_array_equal(acc.correlation(), np.zeros((3, 2)))
    np.testing.assert_array_equal(acc.std_a, np.zeros(3))
    np.testing.assert_allclose(acc.cross_product(), np.outer([1, 2, 3], [4, 5]))


# --------------------------------------------------------------------------- torch inputs


def test_torch_inputs():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    xa = torch.randn(100, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    xb = torch.randn(100, 4, generator=gen, dtype=torch.float64) + xa[:, :4].detach()
    acc = CrossCorrelation(6, 4).update(xa[:60], xb[:60]).update(xa[60:], xb[60:])
    _, _, corr, _ = _reference([(xa.detach().numpy(), xb.numpy())])
    out = acc.correlation()
    assert isinstance(out, np.ndarray)  # documented: statistics are numpy arrays
    np.testing.assert_allclose(out, corr, atol=1e-9)
    # float32 and half precision tensors; a non-contiguous view
    acc32 = CrossCorrelation(6, 4).update(xa.detach().float(), xb.float().T.contiguous().T)
    np.testing.assert_allclose(acc32.correlation(), corr, atol=1e-5)
    acc16 = CrossCorrelation(6, 4).update(xa.detach().bfloat16(), xb.half())
    np.testing.assert_allclose(acc16.correlation(), corr, atol=5e-2)


def test_torch_conv_activations():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    fa = torch.randn(4, 3, 5, 6, generator=gen)
    fb = torch.randn(4, 2, 5, 6, generator=gen) + fa[:, :2]
    sa, sb = conv_to_samples(fa), conv_to_samples(fb)
    assert isinstance(sa, torch.Tensor) and sa.shape == (4 * 5 * 6, 3) and sa.is_contiguous()
    torch.testing.assert_close(sa[5 * 6 + 2 * 6 + 4], fa[1, :, 2, 4])  # sample order: n, h, w
    acc = CrossCorrelation(3, 2).update(sa, sb)
    ref = np.corrcoef(fa.permute(1, 0, 2, 3).reshape(3, -1).numpy(), fb.permute(1, 0, 2, 3).reshape(2, -1).numpy())
    np.testing.assert_allclose(acc.correlation(), ref[:3, 3:], atol=1e-5)


def test_conv_to_samples_numpy():
    x = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)
    s = conv_to_samples(x)
    assert s.shape == (8, 3) and s.flags.c_contiguous and s.dtype == np.float32
    np.testing.assert_array_equal(s[5], x[1, :, 0, 1])
    assert conv_to_samples(np.zeros((4, 3, 7))).shape == (28, 3)  # Conv1d
    two_d = np.zeros((4, 3))
    assert conv_to_samples(two_d) is two_d
    with pytest.raises(ValueError, match=r"x must have shape \(N, C, \.\.\.\)"):
        conv_to_samples(np.zeros(5))


# --------------------------------------------------------------------------- merge


def test_merge_equals_single_stream():
    rng = np.random.default_rng(9)
    batches = _batches(rng, [50, 7, 120, 33, 1], 7, 5, loc=50.0)
    whole = _accumulate(batches, 7, 5)
    left, right = _accumulate(batches[:2], 7, 5), _accumulate(batches[2:], 7, 5)
    merged = left.merge(right)
    assert merged is left and merged.count == whole.count
    np.testing.assert_allclose(merged.correlation(), whole.correlation(), atol=1e-12)
    np.testing.assert_allclose(merged.covariance(), whole.covariance(), rtol=1e-11)
    np.testing.assert_allclose(merged.mean_a, whole.mean_a, rtol=1e-13)
    np.testing.assert_allclose(merged.std_b, whole.std_b, rtol=1e-11)
    np.testing.assert_array_equal(merged.min_a, whole.min_a)
    np.testing.assert_array_equal(merged.max_b, whole.max_b)
    assert right.count == sum(len(a) for a, _ in batches[2:])  # other unchanged


def test_merge_with_empty_sides_and_self():
    rng = np.random.default_rng(10)
    batches = _batches(rng, [40], 3, 3)
    full = _accumulate(batches, 3, 3)
    empty = CrossCorrelation(3, 3)
    empty.merge(full)
    np.testing.assert_array_equal(empty.covariance(), full.covariance())
    before = full.covariance()
    full.merge(CrossCorrelation(3, 3))
    np.testing.assert_array_equal(full.covariance(), before)
    # Merging an accumulator with itself counts its data twice.
    doubled = _accumulate(batches + batches, 3, 3)
    full.merge(full)
    assert full.count == 80
    np.testing.assert_allclose(full.covariance(), doubled.covariance(), rtol=1e-12)


def test_merge_across_dtypes():
    rng = np.random.default_rng(11)
    batches = _batches(rng, [30, 30], 4, 4)
    a64 = _accumulate(batches[:1], 4, 4)
    a32 = _accumulate(batches[1:], 4, 4, dtype=np.float32)
    a64.merge(a32)
    np.testing.assert_allclose(a64.correlation(), _reference(batches)[2], atol=1e-6)


# --------------------------------------------------------------------------- batched API


def test_update_many_equals_individual_updates():
    rng = np.random.default_rng(12)
    dims = [(8, 8), (3, 11), (600, 20)]
    singles = [CrossCorrelation(a, b) for a, b in dims]
    many = [CrossCorrelation(a, b) for a, b in dims]
    for step in range(3):
        pairs = [_batches(rng, [20 + 7 * k + step], a, b, dtype=[np.float64, np.float32][k % 2])[0]
                 for k, (a, b) in enumerate(dims)]
        for acc, (xa, xb) in zip(singles, pairs):
            acc.update(xa, xb)
        CrossCorrelation.update_many(many, pairs)
    for one, batched in zip(singles, many):
        assert one.count == batched.count
        np.testing.assert_array_equal(one.correlation(), batched.correlation())
        np.testing.assert_array_equal(one.cross_product(), batched.cross_product())


def test_cross_correlation_set_mapping_and_sequence():
    rng = np.random.default_rng(13)
    accs = CrossCorrelationSet({"conv1": (4, 4), "fc": (6, 2)}, threads=2)
    assert len(accs) == 2 and "fc" in accs and list(accs) == ["conv1", "fc"]
    assert "conv1" in repr(accs)
    h1 = rng.standard_normal((30, 4))
    h2a, h2b = rng.standard_normal((25, 6)), rng.standard_normal((25, 2))
    accs.update({"conv1": (h1, h1[:, ::-1]), "fc": (h2a, h2b)})
    accs.update({"fc": (h2a, h2b)})  # a subset
    assert accs["conv1"].count == 30 and accs["fc"].count == 50
    _, cols = pyperm.linear_sum_assignment(accs["conv1"].correlation(), maximize=True)
    assert cols.tolist() == [3, 2, 1, 0]
    seq = CrossCorrelationSet([(4, 4), (6, 2)])
    seq.update([(h1, h1[:, ::-1]), (h2a, h2b)]).update([(h1[:0], h1[:0]), (h2a, h2b)])
    assert [a.count for a in seq.values()] == [30, 50]
    np.testing.assert_array_equal(seq[1].covariance(), accs["fc"].covariance())
    other = CrossCorrelationSet({"conv1": (4, 4), "fc": (6, 2)}).update({"conv1": (h1, h1)})
    accs.merge(other)
    assert accs["conv1"].count == 60 and accs["fc"].count == 50
    accs.reset()
    assert all(a.count == 0 for _, a in accs.items())


def test_batched_errors_leave_everything_unchanged():
    rng = np.random.default_rng(14)
    accs = CrossCorrelationSet([(3, 3), (2, 2)])
    good = rng.standard_normal((10, 3))
    bad = rng.standard_normal((10, 2))
    bad[4, 1] = np.nan
    with pytest.raises(ValueError, match=r"pairs\[1\] xb contains NaN or infinity"):
        accs.update([(good, good), (np.ones((10, 2)), bad)])
    assert [a.count for a in accs.values()] == [0, 0]
    with pytest.raises(ValueError, match=r"pairs\[0\] xa and pairs\[0\] xb must hold the same number of samples"):
        accs.update([(good, good[:5]), (bad, bad)])
    with pytest.raises(ValueError, match=r"got 1 pairs for 2 layer pairs"):
        accs.update([(good, good)])
    with pytest.raises(KeyError, match="unknown layer pair"):
        accs.update({7: (good, good)})
    acc = CrossCorrelation(3, 3)
    with pytest.raises(ValueError, match="listed twice"):
        CrossCorrelation.update_many([acc, acc], [(good, good), (good, good)])
    with pytest.raises(ValueError, match="got 1 accumulators but 2 pairs"):
        CrossCorrelation.update_many([acc], [(good, good), (good, good)])
    with pytest.raises(TypeError, match=r"accumulators\[0\] must be a CrossCorrelation"):
        CrossCorrelation.update_many(["x"], [(good, good)])
    with pytest.raises(TypeError, match=r"pairs\[0\] must be an \(xa, xb\) tuple"):
        CrossCorrelation.update_many([acc], [good])
    with pytest.raises(ValueError, match=r"pairs\[0\] must be an \(xa, xb\) pair, got 3 items"):
        CrossCorrelation.update_many([acc], [(good, good, good)])
    with pytest.raises(TypeError, match="can only merge a CrossCorrelationSet"):
        accs.merge(acc)
    with pytest.raises(ValueError, match="layer names differ"):
        accs.merge(CrossCorrelationSet([(3, 3)]))
    with pytest.raises(ValueError, match="at least one layer pair"):
        CrossCorrelationSet([])
    with pytest.raises(ValueError, match=r"dims\['x'\] must be a \(dim_a, dim_b\) pair"):
        CrossCorrelationSet({"x": 5})
    with pytest.raises(TypeError, match="dims must be a mapping or a sequence"):
        CrossCorrelationSet(5)


# --------------------------------------------------------------------------- state and distribution


def test_state_round_trip_and_pickle():
    rng = np.random.default_rng(15)
    batches = _batches(rng, [40, 9], 5, 3)
    acc = _accumulate(batches, 5, 3)
    state = acc.state()
    assert set(state) == {"count", "mean_a", "mean_b", "m2_a", "m2_b", "min_a", "max_a", "min_b", "max_b",
                          "comoment"}
    rebuilt = CrossCorrelation.from_state(**state)
    np.testing.assert_array_equal(rebuilt.correlation(), acc.correlation())
    np.testing.assert_array_equal(rebuilt.min_b, acc.min_b)
    # the state is a copy
    state["comoment"][:] = 0
    assert acc.covariance().any()
    clone = pickle.loads(pickle.dumps(acc))
    np.testing.assert_array_equal(clone.cross_product(), acc.cross_product())
    clone.update(*batches[0])
    assert clone.count == acc.count + 40
    assert repr(acc) == "CrossCorrelation(dim_a=5, dim_b=3, dtype=float64, count=49)"
    acc.release_workspace()
    acc.update(*batches[1])
    assert acc.count == 58


def test_from_state_without_ranges_and_from_torch():
    torch = pytest.importorskip("torch")
    acc = CrossCorrelation(2, 2).update([[1.0, 3.0], [2.0, 3.0], [4.0, 3.0]], [[0.0, 1.0], [1.0, 0.0], [5.0, 5.0]])
    s = acc.state()
    t = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else torch.tensor(float(v))) for k, v in s.items()}
    bare = CrossCorrelation.from_state(t["count"], t["mean_a"], t["mean_b"], t["comoment"], t["m2_a"], t["m2_b"])
    assert bare.count == 3
    assert np.isneginf(bare.min_a).all() and np.isposinf(bare.max_b).all()
    # the constant channel a[:, 1] still gives 0 (its m2 is exactly 0)
    np.testing.assert_array_equal(bare.correlation(), acc.correlation())


def test_from_state_errors():
    s = CrossCorrelation(2, 3).update(np.eye(3)[:, :2], np.eye(3)).state()
    with pytest.raises(TypeError, match="count must be an int"):
        CrossCorrelation.from_state(**{**s, "count": "3"})
    with pytest.raises(ValueError, match="count must be at least 0, got -1"):
        CrossCorrelation.from_state(**{**s, "count": -1})
    with pytest.raises(ValueError, match=r"mean_a must have shape \(2,\)"):
        CrossCorrelation.from_state(**{**s, "mean_a": np.zeros(3)})
    with pytest.raises(ValueError, match="m2_b must be non-negative"):
        CrossCorrelation.from_state(**{**s, "m2_b": -np.ones(3)})
    with pytest.raises(ValueError, match="comoment contains NaN or infinity"):
        CrossCorrelation.from_state(**{**s, "comoment": np.full((2, 3), np.inf)})
    with pytest.raises(ValueError, match="mean_b contains NaN or infinity"):
        CrossCorrelation.from_state(**{**s, "mean_b": np.full(3, np.nan)})
    with pytest.raises(ValueError, match="min_a contains NaN"):
        CrossCorrelation.from_state(**{**s, "min_a": np.full(2, np.nan)})
    with pytest.raises(ValueError, match="comoment must be a non-empty 2-D array"):
        CrossCorrelation.from_state(**{**s, "comoment": np.zeros(6)})
    with pytest.raises(TypeError, match="comoment must contain numerical entries, got dtype <U1"):
        CrossCorrelation.from_state(**{**s, "comoment": np.full((2, 3), "x")})
    empty = CrossCorrelation.from_state(**CrossCorrelation(2, 3).state())
    assert empty.count == 0


def test_recentred_sum_equals_single_stream():
    # The arithmetic of all_reduce_cross_correlation, with the all-reduce done by hand:
    # co-moments moved to the global mean add up.
    rng = np.random.default_rng(16)
    batches = _batches(rng, [31, 1, 90, 45], 4, 6, loc=1e3)
    workers = [_accumulate(batches[:1], 4, 6), _accumulate(batches[1:3], 4, 6), _accumulate(batches[3:], 4, 6),
               CrossCorrelation(4, 6)]
    states = [w.state() for w in workers]
    n = sum(s["count"] for s in states)
    mean_a = sum(s["count"] * s["mean_a"] for s in states) / n
    mean_b = sum(s["count"] * s["mean_b"] for s in states) / n
    comoment = sum(s["comoment"] + s["count"] * np.outer(s["mean_a"] - mean_a, s["mean_b"] - mean_b)
                   for s in states)
    m2_a = sum(s["m2_a"] + s["count"] * (s["mean_a"] - mean_a) ** 2 for s in states)
    m2_b = sum(s["m2_b"] + s["count"] * (s["mean_b"] - mean_b) ** 2 for s in states)
    glob = CrossCorrelation.from_state(n, mean_a, mean_b, comoment, m2_a, m2_b)
    whole = _accumulate(batches, 4, 6)
    np.testing.assert_allclose(glob.correlation(), whole.correlation(), atol=1e-12)
    np.testing.assert_allclose(glob.covariance(), whole.covariance(), rtol=1e-10)


def _all_reduce_worker(rank, world, init_file, batches, out_file):  # pragma: no cover - runs in a subprocess
    import torch.distributed as dist

    from pyperm._comm import init_process_group

    init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        acc = CrossCorrelation(4, 3)
        for a, b in batches[rank::world]:
            acc.update(a, b)
        pyperm.all_reduce_cross_correlation(acc)
        if rank == 0:
            np.savez(out_file, corr=acc.correlation(), cov=acc.covariance(), count=acc.count,
                     min_a=acc.min_a, max_b=acc.max_b)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_reduce_with_torch_distributed(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    rng = np.random.default_rng(17)
    batches = _batches(rng, [20, 7, 33], 4, 3, loc=100.0)  # rank 1 gets one batch, rank 0 two
    out = tmp_path / "result.npz"
    mp.spawn(_all_reduce_worker, args=(2, str(tmp_path / "init"), batches, str(out)), nprocs=2, join=True)
    res = np.load(out)
    xa, xb, corr, cov = _reference(batches)
    assert int(res["count"]) == 60
    np.testing.assert_allclose(res["corr"], corr, atol=1e-9)
    np.testing.assert_allclose(res["cov"], cov, rtol=1e-9)
    np.testing.assert_array_equal(res["min_a"], xa.min(0))
    np.testing.assert_array_equal(res["max_b"], xb.max(0))
    del torch


def test_all_reduce_needs_initialised_torch_distributed():
    pytest.importorskip("torch")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        pyperm.all_reduce_cross_correlation(CrossCorrelation(2, 2))
    with pytest.raises(TypeError, match="acc must be a CrossCorrelation"):
        pyperm.all_reduce_cross_correlation("acc")


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("xa", "xb", "error", "match"),
    [
        (np.zeros(5), np.zeros((5, 2)), ValueError,
         r"xa must be a 2-D \(samples, dim_a\) array, got shape \(5,\)"),
        (np.zeros((5, 3)), np.zeros((5, 2, 1)), ValueError, r"xb must be a 2-D \(samples, dim_b\) array"),
        (np.zeros((2, 3, 4, 4)), np.zeros((2, 2)), ValueError, "use pyperm.conv_to_samples"),
        (np.zeros((5, 4)), np.zeros((5, 2)), ValueError, r"xa has 4 channels \(shape \(5, 4\)\) but dim_a is 3"),
        (np.zeros((5, 3)), np.zeros((5, 3)), ValueError, "xb has 3 channels .* but dim_b is 2"),
        (np.zeros((5, 3)), np.zeros((4, 2)), ValueError,
         "xa and xb must hold the same number of samples.*5 and 4"),
        (np.full((5, 3), "a"), np.zeros((5, 2)), TypeError, "xa must contain numerical entries, got dtype <U1"),
        (np.zeros((5, 3)), np.zeros((5, 2), dtype=complex), TypeError, "xb must be real, got complex dtype complex128"),
        (np.array([[None] * 3] * 5), np.zeros((5, 2)), TypeError,
         "xa must contain numerical entries, got dtype object"),
        ([[1, 2], [3]], np.zeros((2, 2)), ValueError, "xa could not be read as an array"),
    ],
)
def test_update_rejects_bad_shapes_and_types(xa, xb, error, match):
    acc = CrossCorrelation(3, 2)
    with pytest.raises(error, match=match):
        acc.update(xa, xb)
    assert acc.count == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("side", ["xa", "xb"])
def test_update_rejects_non_finite(dtype, bad, side):
    rng = np.random.default_rng(18)
    acc = CrossCorrelation(3, 600)  # 600 channels: the bad value sits in the second column block
    xa, xb = rng.standard_normal((300, 3)).astype(dtype), rng.standard_normal((300, 600)).astype(dtype)
    acc.update(xa, xb)
    before = acc.state()
    (xa if side == "xa" else xb)[290, -1] = bad
    with pytest.raises(ValueError, match=f"{side} contains NaN or infinity"):
        acc.update(xa, xb)
    after = acc.state()
    assert after["count"] == before["count"]
    np.testing.assert_array_equal(after["comoment"], before["comoment"])
    np.testing.assert_array_equal(after["mean_b"], before["mean_b"])


def test_update_rejects_overflow():
    acc = CrossCorrelation(2, 2)
    x32 = np.array([[1e30, 0.0], [-1e30, 1.0]], dtype=np.float32)
    with pytest.raises(ValueError, match="too large to accumulate"):
        acc.update(x32, x32)  # squares of 1e30 do not fit float32
    x64 = np.array([[1e300, 0.0], [-1e300, 1.0]])
    with pytest.raises(ValueError, match="xa has values too large to accumulate"):
        acc.update(x64, np.zeros((2, 2)))
    with pytest.raises(ValueError, match="xa has values too large to accumulate"):
        acc.update(np.array([[1.5e308, 0.0], [-1.5e308, 1.0]]), np.zeros((2, 2)))  # the spread overflows
    assert acc.count == 0
    # a huge but constant channel is fine: it is shifted by its own value
    huge = CrossCorrelation(2, 2).update(np.array([[1.5e308, 0.0], [1.5e308, 1.0]]), np.eye(2))
    assert huge.mean_a[0] == 1.5e308 and huge.std_a[0] == 0.0
    acc.update(x32.astype(np.float64), x32.astype(np.float64))  # fine in float64
    np.testing.assert_allclose(acc.correlation(), [[1.0, -1.0], [-1.0, 1.0]])
    small = CrossCorrelation(1, 1, dtype=np.float32)
    with pytest.raises(ValueError, match="too large to accumulate"):
        small.update(np.array([[1e25], [-1e25]]), np.array([[1e25], [-1e25]]))


def test_cuda_arrays_go_to_the_device_or_are_refused():
    class FakeCuda:
        __cuda_array_interface__ = {"shape": (2, 2), "typestr": "<f4", "data": (0, False), "version": 3}

    # An empty accumulator would move to the batch's device, which only torch tensors name.
    with pytest.raises(TypeError, match="xa must be a torch CUDA tensor"):
        CrossCorrelation(2, 2).update(FakeCuda(), np.zeros((2, 2)))
    # One holding CPU statistics keeps them there.
    acc = CrossCorrelation(2, 2).update(np.eye(2), np.eye(2))
    with pytest.raises(ValueError, match=r"xb is a CUDA array, but this accumulator holds CPU statistics: pass xb.cpu\(\)"):
        acc.update(np.zeros((2, 2)), FakeCuda())
    with pytest.raises(ValueError, match=r"pairs\[1\] xa is a CUDA array"):
        CrossCorrelation.update_many([CrossCorrelation(2, 2), acc], [(np.eye(2), np.eye(2)), (FakeCuda(), np.eye(2))])
    assert acc.count == 2


@pytest.mark.parametrize(
    "stat", ["mean_a", "mean_b", "std_a", "std_b", "min_a", "max_a", "min_b", "max_b", "correlation()",
             "covariance()", "cross_product()"]
)
def test_reading_statistics_before_any_update_raises(stat):
    acc = CrossCorrelation(2, 2)
    acc.update(np.zeros((0, 2)), np.zeros((0, 2)))
    name = stat.rstrip("()")
    with pytest.raises(ValueError, match=rf"{name} needs at least \d accumulated samples?, have 0: call update"):
        value = getattr(acc, name)
        if stat.endswith("()"):
            value()


def test_covariance_ddof_errors():
    acc = CrossCorrelation(2, 2).update(np.ones((1, 2)), np.ones((1, 2)))
    with pytest.raises(ValueError, match="covariance needs at least 2 accumulated samples, have 1"):
        acc.covariance()
    np.testing.assert_array_equal(acc.covariance(ddof=0), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="ddof must be at least 0, got -1"):
        acc.covariance(ddof=-1)
    with pytest.raises(TypeError, match="ddof must be an int"):
        acc.covariance(ddof=0.5)


def test_merge_errors():
    acc = CrossCorrelation(3, 2)
    with pytest.raises(ValueError, match=r"of dims \(2, 3\) into one of dims \(3, 2\)"):
        acc.merge(CrossCorrelation(2, 3).update(np.ones((2, 2)), np.ones((2, 3))))
    with pytest.raises(TypeError, match="can only merge a CrossCorrelation, got dict"):
        acc.merge({})
    # m2 = 5e37 fits float32 (with the kernel's margin of 4), twice that does not
    big = CrossCorrelation(1, 1, dtype=np.float32).update(np.array([[5e18], [-5e18]]), np.array([[5e18], [-5e18]]))
    with pytest.raises(ValueError, match="merge has values too large to accumulate"):
        big.merge(big)
    assert acc.count == 0 and big.count == 2
    np.testing.assert_allclose(big.covariance(), [[5e37]], rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dim_a": 0, "dim_b": 2}, ValueError, "dim_a must be at least 1, got 0"),
        ({"dim_a": 2, "dim_b": 2.0}, TypeError, "dim_b must be a positive int, got float"),
        ({"dim_a": True, "dim_b": 2}, TypeError, "dim_a must be a positive int, got bool"),
        ({"dim_a": 2, "dim_b": 2, "dtype": np.int64}, TypeError, "dtype must be float32 or float64, got int64"),
        ({"dim_a": 2, "dim_b": 2, "dtype": "nonsense"}, TypeError, "dtype must be float32 or float64"),
        ({"dim_a": 2, "dim_b": 2, "threads": 0}, ValueError, "threads must be at least 1, got 0"),
        ({"dim_a": 2, "dim_b": 2, "threads": "4"}, TypeError, "threads must be a positive int or None"),
    ],
)
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        CrossCorrelation(**kwargs)


def test_constructor_accepts_dtype_spellings():
    assert CrossCorrelation(1, 1, dtype="float32").dtype == np.float32
    torch = pytest.importorskip("torch")
    assert CrossCorrelation(1, 1, dtype=torch.float64).dtype == np.float64
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        CrossCorrelation(1, 1, dtype=torch.int32)
