"""pyperm.teacher_student (Zhan, Li and Wu 2025): loss, minima, GD, matchings, barriers, PQ index, sharpness."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.optimize
import torch

from pyperm.teacher_student import (
    hessian,
    interpolation_losses,
    lap_matching,
    learning_rate_sweep,
    monte_carlo_loss,
    neuron_types,
    path_barrier,
    population_loss,
    pq_index,
    sample_minimum,
    sharpness,
    teacher_weights,
    train_gd,
    type_matching,
    width_sweep,
)

F64 = torch.float64


def _random(shape, seed, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(device)


def _reference_loss(W, Wt):
    """The arc-cosine form sum_ab s_a s_b |v_a||v_b| (sin t + (pi - t) cos t) / 2pi, by plain autograd.

    Independent of the library's formula (which splits off the linear part); the diagonal is
    |v|^2 / 2 written directly, so arccos never sees a parallel pair at a generic point.
    """
    V = torch.cat([W, Wt])
    s = torch.cat([torch.ones(len(W), dtype=F64), -torch.ones(len(Wt), dtype=F64)])
    n = V.norm(dim=1)
    off = ~torch.eye(len(V), dtype=torch.bool)
    cos = (V @ V.T)[off] / (n[:, None] * n[None, :])[off]
    theta = torch.arccos(cos)
    kern = (n[:, None] * n[None, :])[off] * (torch.sin(theta) + (math.pi - theta) * cos) / (2 * math.pi)
    return (s[:, None] * s[None, :])[off].mul(kern).sum() + 0.5 * (n**2).sum()


def _grad(W, Wt):
    W = W.detach().clone().requires_grad_(True)
    return torch.autograd.grad(population_loss(W, Wt), W)[0]


def _fd_hessian(W, Wt, eps):
    """Central differences of the closed-form gradient, column by column."""
    flat = W.reshape(-1)
    cols = []
    for i in range(flat.numel()):
        step = torch.zeros_like(flat)
        step[i] = eps
        plus = _grad((flat + step).reshape(W.shape), Wt)
        minus = _grad((flat - step).reshape(W.shape), Wt)
        cols.append(((plus - minus) / (2 * eps)).reshape(-1))
    return torch.stack(cols, dim=1)


# --- teacher and exact loss -------------------------------------------------------------


def test_teacher_weights_are_orthonormal_with_default_d():
    Wt = teacher_weights(4)
    assert Wt.shape == (4, 8) and Wt.dtype == F64
    torch.testing.assert_close(Wt @ Wt.T, torch.eye(4, dtype=F64))
    assert teacher_weights(3, 3).shape == (3, 3)


@pytest.mark.parametrize(
    "K, d, exc", [(0, None, ValueError), (2.0, None, TypeError), (True, None, TypeError), (3, 2, ValueError)]
)
def test_teacher_weights_rejects_bad_sizes(K, d, exc):
    with pytest.raises(exc, match="K|d"):
        teacher_weights(K, d)


def test_exact_loss_matches_monte_carlo_within_standard_error(device):
    Wt = teacher_weights(3, 5, device=device)
    W = torch.stack([_random((4, 5), 1, device), 0.5 * _random((4, 5), 2, device)])
    exact = population_loss(W, Wt)
    estimate, stderr = monte_carlo_loss(W, Wt, 200_000, seed=7, return_stderr=True)
    assert exact.shape == estimate.shape == (2,)
    assert torch.all((exact - estimate).abs() < 4 * stderr)
    assert torch.all(stderr < 0.02 * exact)


def test_exact_loss_equals_independent_arccos_formula_and_zero_student():
    Wt = teacher_weights(3, 5)
    W = _random((4, 5), 3)
    torch.testing.assert_close(population_loss(W, Wt), _reference_loss(W, Wt))
    # The zero student: E f*(x)^2 = K/2 + K(K-1)/(2 pi) for an orthonormal teacher.
    torch.testing.assert_close(
        population_loss(torch.zeros(2, 5, dtype=F64), Wt), torch.tensor(1.5 + 3 / math.pi, dtype=F64)
    )


def test_loss_is_zero_at_sampled_minima_and_at_permuted_teachers():
    Wt = teacher_weights(4)
    minima = sample_minimum(Wt, 11, seed=list(range(5)))
    assert population_loss(minima, Wt).abs().max() < 1e-14
    assert population_loss(Wt[[3, 1, 0, 2]], Wt).abs() < 1e-15
    rotated = torch.linalg.qr(_random((6, 6), 4))[0][:3]  # any orthonormal teacher
    assert population_loss(sample_minimum(rotated, 7, seed=1), rotated).abs() < 1e-14


def test_gradient_passes_gradcheck_for_student_and_teacher():
    W = _random((4, 5), 5).requires_grad_(True)
    Wt = (teacher_weights(3, 5) + 0.1 * _random((3, 5), 6)).requires_grad_(True)
    assert torch.autograd.gradcheck(population_loss, (W, Wt))


def test_gradient_equals_autograd_of_independent_formula():
    Wt = teacher_weights(3, 5)
    W = _random((4, 5), 8).requires_grad_(True)
    reference = torch.autograd.grad(_reference_loss(W, Wt), W)[0]
    torch.testing.assert_close(_grad(W, Wt), reference)


def test_gradient_vanishes_at_a_minimum_and_on_zero_neurons():
    Wt = teacher_weights(3)
    assert _grad(sample_minimum(Wt, 8, seed=2), Wt).abs().max() < 1e-14
    W = _random((4, 6), 9)
    W[2] = 0.0
    g = _grad(W, Wt)
    assert torch.all(g[2] == 0) and g[0].abs().max() > 0.1  # sigma'(0) = 0, as autograd's relu


def test_batched_loss_equals_loss_of_each_student():
    Wt = teacher_weights(2, 3)
    W = _random((2, 3, 4, 3), 10)
    batched = population_loss(W, Wt)
    assert batched.shape == (2, 3)
    torch.testing.assert_close(batched[1, 2], population_loss(W[1, 2], Wt))


def test_float32_input_is_computed_in_float64():
    Wt = teacher_weights(2)
    W = _random((3, 4), 11)
    assert population_loss(W.float(), Wt.float()).dtype == F64


@pytest.mark.parametrize(
    "W, Wt, exc, match",
    [
        ([[1.0, 0.0]], torch.eye(1, 2, dtype=F64), TypeError, "W must be a torch.Tensor"),
        (torch.ones(2, 2, dtype=torch.int64), torch.eye(1, 2, dtype=F64), TypeError, "W must have a real floating"),
        (torch.ones(2, dtype=F64), torch.eye(1, 2, dtype=F64), ValueError, "W must have shape"),
        (torch.ones(2, 3, dtype=F64), torch.eye(1, 2, dtype=F64), ValueError, "input dimension"),
        (torch.tensor([[1.0, float("nan")]], dtype=F64), torch.eye(1, 2, dtype=F64), ValueError, "W contains NaN"),
        (torch.ones(2, 2, dtype=F64), torch.zeros(1, 2, dtype=F64), ValueError, "W_teacher has a zero row"),
        (torch.ones(2, 2, dtype=F64), torch.ones(2, 1, 2, dtype=F64), ValueError, "W_teacher must have shape"),
        (torch.ones(2, 2, dtype=F64), torch.tensor([[float("inf"), 0.0]]), ValueError, "W_teacher contains"),
    ],
)
def test_population_loss_rejects_bad_input(W, Wt, exc, match):
    with pytest.raises(exc, match=match):
        population_loss(W, Wt)


def test_monte_carlo_loss_rejects_bad_arguments():
    Wt = teacher_weights(2)
    W = _random((3, 4), 12)
    with pytest.raises(ValueError, match="num_samples"):
        monte_carlo_loss(W, Wt, 1, seed=0)
    with pytest.raises(TypeError, match="seed"):
        monte_carlo_loss(W, Wt, 10, seed=[1, 2])
    with pytest.raises(TypeError, match="seed"):
        monte_carlo_loss(W, Wt, 10, seed=1.5)


# --- Hessian and sharpness ----------------------------------------------------------------


def test_hessian_matches_finite_differences_at_a_generic_point():
    Wt = teacher_weights(2, 3)
    W = _random((3, 3), 13)
    torch.testing.assert_close(hessian(W, Wt), _fd_hessian(W, Wt, 1e-6), atol=1e-6, rtol=1e-6)


def test_sharpness_matches_finite_difference_hessian_at_a_minimum():
    Wt = teacher_weights(2, 3)
    W = sample_minimum(Wt, 4, seed=3)
    # The loss is C^2 but not C^3 at a minimum (the kernel goes like theta^3), so central
    # differences are only first-order accurate there: a small step and a matching tolerance.
    fd = _fd_hessian(W, Wt, 1e-7)
    torch.testing.assert_close(hessian(W, Wt), fd, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sharpness(W, Wt), torch.linalg.eigvalsh(0.5 * (fd + fd.T))[-1], atol=1e-5, rtol=1e-5)


def test_gauss_newton_part_equals_the_hessian_at_a_minimum_only():
    Wt = teacher_weights(2, 3)
    W = sample_minimum(Wt, 5, seed=4)
    torch.testing.assert_close(hessian(W, Wt, gauss_newton=True), hessian(W, Wt), atol=1e-12, rtol=0)
    W = _random((3, 3), 18)
    assert (hessian(W, Wt, gauss_newton=True) - hessian(W, Wt)).abs().max() > 1e-2
    assert sharpness(W, Wt, gauss_newton=True).shape == ()


def test_sharpness_at_the_teacher_and_of_a_batch():
    # At W = W* with one neuron per type the Hessian is 2 E[1 1 x x^T] blocks; for K = 1 that is I,
    # so the sharpness is 1.
    assert sharpness(teacher_weights(1, 2), teacher_weights(1, 2)).item() == pytest.approx(1.0)
    Wt = teacher_weights(2)
    batch = sample_minimum(Wt, 3, seed=[0, 1, 2])
    values = sharpness(batch, Wt)
    assert values.shape == (3,)
    torch.testing.assert_close(values[1], sharpness(batch[1], Wt))


# --- uniform minima -------------------------------------------------------------------------


def test_sample_minimum_lies_on_the_manifold_of_minima(device):
    K, m = 3, 10
    Wt = teacher_weights(K, device=device)
    W = sample_minimum(Wt, m, seed=4)
    assert W.shape == (m, 2 * K) and W.device.type == device
    assert torch.all((W != 0).sum(dim=1) == 1) and torch.all(W >= 0)
    torch.testing.assert_close(W.sum(dim=0)[:K], torch.ones(K, dtype=F64, device=device))
    assert torch.all(W[:, K:] == 0)


def test_sample_minimum_is_seeded_and_batches_equal_single_draws():
    Wt = teacher_weights(3)
    batch = sample_minimum(Wt, 7, seed=[5, 6])
    assert torch.equal(batch[1], sample_minimum(Wt, 7, seed=6))
    assert not torch.equal(batch[0], batch[1])
    assert torch.equal(sample_minimum(Wt, 3, seed=0).abs().sum(dim=0)[:3], torch.ones(3, dtype=F64))


def test_numpy_integers_are_integers():
    """Counts go through pyperm._checks, which reads numpy integers as ints (as the rest of pyperm does)."""
    assert teacher_weights(np.int64(3), d=np.int32(4)).shape == (3, 4)
    assert sample_minimum(teacher_weights(2), np.int64(3), seed=np.uint8(1)).shape == (3, 4)


def test_sample_minimum_rejects_widths_below_K_and_bad_seeds():
    Wt = teacher_weights(3)
    with pytest.raises(ValueError, match="m must be >= K"):
        sample_minimum(Wt, 2, seed=0)
    with pytest.raises(TypeError, match="seed"):
        sample_minimum(Wt, 4, seed="0")
    with pytest.raises(ValueError, match="seed"):
        sample_minimum(Wt, 4, seed=-1)


# --- matchings and barriers -------------------------------------------------------------------


def test_type_matching_recovers_a_planted_permutation_with_zero_barrier():
    Wt = teacher_weights(4)
    W_a = sample_minimum(Wt, 13, seed=7)
    planted = torch.randperm(13, generator=torch.Generator().manual_seed(0))
    W_b = W_a[planted]
    perm = type_matching(W_a, W_b, Wt)
    assert perm.dtype == torch.int64
    assert torch.equal(W_b[perm], W_a)
    assert path_barrier(W_a, W_b[perm], Wt).abs() < 1e-14
    assert path_barrier(W_a, W_b, Wt) > 1e-3


def test_type_matching_of_two_permutations_of_one_solution_gives_barrier_zero():
    # Equal norms within a type (ties) still give barrier 0: any pairing within a type does.
    Wt = teacher_weights(3)
    base = torch.cat([Wt / 2, Wt / 2])
    gen = torch.Generator().manual_seed(1)
    W_a, W_b = base[torch.randperm(6, generator=gen)], base[torch.randperm(6, generator=gen)]
    perm = type_matching(W_a, W_b, Wt)
    assert sorted(perm.tolist()) == list(range(6))
    assert path_barrier(W_a, W_b[perm], Wt) < 1e-14


def test_type_matching_pairs_largest_neurons_of_a_type_and_zero_neurons():
    Wt = teacher_weights(2, 2)
    W_a = torch.tensor([[0.0, 0.0], [0.9, 0.0], [0.1, 0.0], [0.0, 1.0]], dtype=F64)
    W_b = torch.tensor([[0.0, 1.0], [0.2, 0.0], [0.0, 0.0], [0.8, 0.0]], dtype=F64)
    assert type_matching(W_a, W_b, Wt).tolist() == [2, 3, 1, 0]
    assert neuron_types(W_a, Wt).tolist() == [-1, 0, 0, 1]


def test_matching_never_increases_the_barrier_on_random_pairs():
    Wt = teacher_weights(3)
    for m in (3, 5, 12):
        A = sample_minimum(Wt, m, seed=list(range(10)))
        B = sample_minimum(Wt, m, seed=list(range(100, 110)))
        direct = path_barrier(A, B, Wt)
        for perm in (type_matching(A, B, Wt), lap_matching(A, B)):
            aligned = torch.gather(B, 1, perm[..., None].expand_as(B))
            assert torch.all(path_barrier(A, aligned, Wt) <= direct + 1e-12)


def test_matching_never_increases_the_barrier_between_gd_solutions():
    Wt = teacher_weights(2, 3)
    runs = train_gd(Wt, 4, c=2.0, steps=1500, init_scale=0.1, seed=list(range(8)), tol=1e-6).weights
    A, B = runs[:4], runs[4:]
    direct = path_barrier(A, B, Wt)
    for perm in (type_matching(A, B, Wt), lap_matching(A, B)):
        aligned = torch.gather(B, 1, perm[..., None].expand_as(B))
        assert torch.all(path_barrier(A, aligned, Wt) <= direct + 1e-12)


def test_lap_matching_is_an_optimal_assignment(device):
    A = _random((3, 9, 4), 14, device)
    B = _random((3, 9, 4), 15, device)
    perm = lap_matching(A, B)
    assert perm.shape == (3, 9) and perm.device.type == device
    for i in range(3):
        sim = (A[i] @ B[i].T).cpu().numpy()
        _, cols = scipy.optimize.linear_sum_assignment(sim, maximize=True)
        assert sim[np.arange(9), perm[i].cpu().numpy()].sum() == pytest.approx(sim[np.arange(9), cols].sum())
    planted = torch.randperm(9, generator=torch.Generator().manual_seed(2)).to(device)
    assert torch.equal(B[0][planted][lap_matching(B[0], B[0][planted])], B[0])


def test_matchings_reject_mismatched_pairs():
    Wt = teacher_weights(2)
    with pytest.raises(ValueError, match="W_a and W_b must have the same shape"):
        lap_matching(torch.ones(3, 4, dtype=F64), torch.ones(4, 4, dtype=F64))
    with pytest.raises(ValueError, match="input dimension"):
        type_matching(torch.ones(3, 5, dtype=F64), torch.ones(3, 5, dtype=F64), Wt)
    with pytest.raises(TypeError, match="W_b must be a torch.Tensor"):
        lap_matching(torch.ones(3, 4, dtype=F64), np.ones((3, 4)))


def test_path_barrier_follows_definition_2_2():
    Wt = teacher_weights(2)
    A = _random((3, 4), 16)
    B = _random((3, 4), 17)
    t, losses = interpolation_losses(A, B, Wt, num_points=5)
    torch.testing.assert_close(losses[[0, -1]], torch.stack([population_loss(A, Wt), population_loss(B, Wt)]))
    expected = (losses - ((1 - t) * losses[0] + t * losses[-1])).max()
    torch.testing.assert_close(path_barrier(A, B, Wt, num_points=5), expected)
    assert 0 <= path_barrier(A, A, Wt) < 1e-12  # (1 - t) A + t A is A only to rounding
    with pytest.raises(ValueError, match="num_points"):
        path_barrier(A, B, Wt, num_points=1)


# --- GD ----------------------------------------------------------------------------------


def test_train_gd_batches_equal_single_runs_and_converge():
    Wt = teacher_weights(2, 3)
    batch = train_gd(Wt, 3, c=2.0, steps=2000, init_scale=0.1, seed=[3, 4], tol=1e-7)
    single = train_gd(Wt, 3, c=2.0, steps=2000, init_scale=0.1, seed=4, tol=1e-7)
    assert batch.weights.shape == (2, 3, 3) and single.weights.shape == (3, 3)
    torch.testing.assert_close(batch.weights[1], single.weights, atol=1e-12, rtol=0)
    assert bool(batch.converged.all()) and not bool(batch.diverged.any())
    assert torch.all(population_loss(batch.weights, Wt) <= 1e-7)
    assert batch.lr == pytest.approx(2.0 / 3) and batch.seeds == (3, 4)


def test_train_gd_stops_at_a_stationary_point_below_K():
    result = train_gd(teacher_weights(2), 1, c=1.0, steps=5000, init_scale=0.1, seed=[0, 1], grad_tol=1e-6)
    assert bool(result.stationary.all()) and not bool(result.converged.any())
    assert torch.all(result.steps < 5000) and torch.all(result.loss > 0.1)


def test_train_gd_flags_divergence():
    result = train_gd(teacher_weights(2), 4, lr=50.0, steps=200, init_scale=0.1, seed=[0, 1])
    assert bool(result.diverged.all()) and not bool(result.converged.any())


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"lr": 0.1, "c": 1.0}, ValueError, "exactly one of lr"),
        ({}, ValueError, "exactly one of lr"),
        ({"lr": -0.1}, ValueError, "lr must be"),
        ({"c": 1.0, "steps": 0}, ValueError, "steps"),
        ({"c": 1.0, "init_scale": 0.0}, ValueError, "init_scale"),
        ({"c": 1.0, "seed": []}, ValueError, "seed"),
        ({"c": 1.0, "seed": 1.0}, TypeError, "seed"),
    ],
)
def test_train_gd_rejects_bad_arguments(kwargs, exc, match):
    kwargs = {"steps": 10, "init_scale": 0.1, "seed": 0, **kwargs}
    with pytest.raises(exc, match=match):
        train_gd(teacher_weights(2), 3, **kwargs)


# --- PQ index ------------------------------------------------------------------------------


def test_pq_index_hand_values():
    assert pq_index(torch.tensor([1.0, 0, 0, 0])).item() == pytest.approx(0.5)  # 1 - 4^(1/2 - 1)
    assert pq_index(torch.ones(7)).item() == pytest.approx(0.0, abs=1e-15)
    assert pq_index(torch.tensor([3.0, 4.0])).item() == pytest.approx(1 - 7 / 5 / math.sqrt(2))
    assert pq_index(torch.tensor([1.0, 0, 0]), p=1, q=float("inf")).item() == pytest.approx(1 - 1 / 3)
    W = torch.tensor([[0.0, 2.0], [0.0, 0.0], [0.0, 0.0]], dtype=F64)
    assert pq_index(W).item() == pytest.approx(1 - 1 / math.sqrt(3))  # of the norms (2, 0, 0)
    assert pq_index(W, rows=False).item() == pytest.approx(1 - 1 / math.sqrt(6))
    assert pq_index(torch.stack([W, torch.ones(3, 2, dtype=F64)])).tolist() == pytest.approx(
        [1 - 1 / math.sqrt(3), 0.0]
    )


def test_pq_index_rejects_bad_arguments():
    with pytest.raises(ValueError, match="p < q"):
        pq_index(torch.ones(3), p=2, q=1)
    with pytest.raises(ValueError, match="all zero"):
        pq_index(torch.zeros(3))
    with pytest.raises(TypeError, match="W must be a torch.Tensor"):
        pq_index([1.0, 2.0])
    with pytest.raises(ValueError, match="p must be"):
        pq_index(torch.ones(3), p=0)


# --- width sweep -----------------------------------------------------------------------------


def test_width_sweep_uniform_table_and_plot(tmp_path):
    sweep = width_sweep(2, [2, 3, 6], source="uniform", pairs=4, seed=1)
    assert sweep.barriers["direct"].shape == (3, 4)
    assert np.all(sweep.mean("type") <= sweep.mean("direct"))
    assert sweep.mean("type")[0] == pytest.approx(0.0, abs=1e-14)  # m = K: every pair is a permutation
    text = sweep.to_markdown()
    assert text.count("\n") == 4 and "| m |" in text
    assert "uniform" in str(sweep)
    rows = sweep.rows()
    assert [r["m"] for r in rows] == [2, 3, 6] and rows[1]["lap_mean"] == pytest.approx(sweep.mean("lap")[1])
    path = sweep.plot(str(tmp_path / "sweep.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    again = width_sweep(2, [2, 3, 6], source="uniform", pairs=4, seed=1)
    assert np.array_equal(again.barriers["lap"], sweep.barriers["lap"])


def test_width_sweep_gd_below_and_above_K():
    sweep = width_sweep(2, [1, 2], source="gd", pairs=2, seed=0, d=3, c=2.0, steps=300, init_scale=0.1)
    assert np.isnan(sweep.barriers["type"][0]).all() and not np.isnan(sweep.barriers["lap"]).any()
    table = sweep.to_markdown()
    assert "converged" in table and "n/a" in table  # no type matching below K: a missing value, not a number


def test_learning_rate_sweep_table_and_plot(tmp_path):
    sweep = learning_rate_sweep(2, 3, [1.0, 200.0], runs=2, seed=0, steps=300, init_scale=0.1)
    assert sweep.pq.shape == sweep.sharpness.shape == sweep.gn_sharpness.shape == (2, 2)
    assert not sweep.diverged[0].any() and sweep.diverged[1].all()
    assert np.isfinite(sweep.pq[0]).all() and np.isnan(sweep.pq[1]).all()
    assert 0 <= sweep.uniform_pq < 1 and "| c |" in sweep.to_markdown()
    with open(sweep.plot(str(tmp_path / "lr.png")), "rb") as f:
        assert f.read(4) == b"\x89PNG"
    with pytest.raises(ValueError, match=r"cs\[1\]"):
        learning_rate_sweep(2, 3, [1.0, -1.0])


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"widths": [1, 3]}, ValueError, "width"),
        ({"widths": []}, TypeError, "widths"),
        ({"widths": [3], "source": "sgd"}, ValueError, "source"),
        ({"widths": [3], "pairs": 1}, ValueError, "pairs"),
        ({"widths": [3], "seed": [1]}, TypeError, "seed"),
    ],
)
def test_width_sweep_rejects_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        width_sweep(2, **kwargs)
