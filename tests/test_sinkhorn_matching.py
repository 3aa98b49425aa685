"""sinkhorn_matching (Sinkhorn re-basin, Pena et al. 2023): the implicit gradient, the answer, both losses,
every spec form, the device, its arguments."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import scipy.optimize
import torch
import torch.nn.functional as F
from _digits import batches, digits, train
from _structured_models import STRUCTURED, outputs, structured_model

from pyperm.nn import Permutations, SinkhornMatchingResult, interpolate, sinkhorn_matching
from pyperm.nn.align import _implicit_sinkhorn as implicit_module
from pyperm.nn.align._implicit_sinkhorn import Potentials, implicit_sinkhorn, sinkhorn
from pyperm.nn.models import MLP
from pyperm.testing import one_thread, random_permutations


@pytest.fixture(autouse=True)
def _one_thread():
    """Small models: one torch thread (two spinning threads on a loaded 2-core machine are many times slower)."""
    with one_thread():
        yield

# ------------------------------------------------------------------ the implicit Sinkhorn layer


def _unrolled_sinkhorn(z: torch.Tensor, iters: int = 3000) -> torch.Tensor:
    """Sinkhorn in log space with autograd through every iteration (the reference gradient)."""
    g = torch.zeros(z.shape[:-1], dtype=z.dtype)
    for _ in range(iters):
        f = -torch.logsumexp(z + g.unsqueeze(-2), -1)
        g = -torch.logsumexp(z + f.unsqueeze(-1), -2)
    f = -torch.logsumexp(z + g.unsqueeze(-2), -1)
    return (z + f.unsqueeze(-1) + g.unsqueeze(-2)).exp()


@pytest.mark.parametrize("solver", ["conjugate gradients", "factored"])
@pytest.mark.parametrize("shape, scale", [((5, 5), 1.0), ((3, 4, 4), 1.0), ((6, 6), 4.0), ((1, 1), 1.0)])
def test_implicit_gradient_equals_the_unrolled_gradient(shape, scale, solver, monkeypatch):
    """Both ways of solving the adjoint system: conjugate gradients (here on small matrices, which are
    otherwise factored at once; they must converge: factoring is refused), and the factored Schur
    complement."""
    if solver == "factored":
        monkeypatch.setattr(implicit_module, "_CG_STEPS", 0)
    else:
        monkeypatch.setattr(implicit_module, "_FACTOR_UP_TO", 0)

        def refuse(*args, **kwargs):
            raise AssertionError("the conjugate gradients did not converge")

        monkeypatch.setattr(torch.linalg, "solve_ex", refuse)
    gen = torch.Generator().manual_seed(0)
    z = (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    s = implicit_sinkhorn(z, iters=100_000, tol=1e-14)
    (implicit,) = torch.autograd.grad((s * w).sum(), z)
    reference = _unrolled_sinkhorn(z)
    (unrolled,) = torch.autograd.grad((reference * w).sum(), z)
    torch.testing.assert_close(s, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(implicit, unrolled, rtol=0, atol=1e-10)


def test_schur_diagonal_is_the_formed_matrix_diagonal():
    """The conjugate gradients' preconditioner is the diagonal of the matrix the factored solve forms."""
    s = implicit_sinkhorn(3 * torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64),
                          1000, 1e-12)
    rows, cols = s.sum(-1), s.sum(-2)
    formed = torch.diag_embed(cols) - s.mT @ (s / rows.unsqueeze(-1)) + 1.0 / 6
    torch.testing.assert_close(implicit_module._schur_diagonal(s, rows, cols), formed.diagonal(0, -2, -1))


@pytest.mark.parametrize("scale", [1.0, 6.0])
def test_float32_gradient_by_conjugate_gradients_matches_the_factored_float64_one(scale, monkeypatch):
    """A float32 S (the conjugate gradients stop at their float32 tolerance): the gradient agrees with the
    factored solve of the float64 S to float32's rounding, soft and near a permutation (scale 6)."""
    gen = torch.Generator().manual_seed(5)
    z64 = scale * torch.randn(2, 130, 130, generator=gen, dtype=torch.float64)
    w = torch.randn(2, 130, 130, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(implicit_module, "_FACTOR_UP_TO", 1000)
    z = z64.clone().requires_grad_(True)
    (reference,) = torch.autograd.grad((implicit_sinkhorn(z, 100_000, 1e-7) * w).sum(), z)
    monkeypatch.setattr(implicit_module, "_FACTOR_UP_TO", 0)
    monkeypatch.setattr(torch.linalg, "solve_ex", lambda *a, **k: pytest.fail("the conjugate gradients stalled"))
    z32 = z64.float().requires_grad_(True)
    (got,) = torch.autograd.grad((implicit_sinkhorn(z32, 100_000, 1e-7) * w.float()).sum(), z32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference, rtol=0, atol=2e-6 * float(reference.abs().max()))


def test_implicit_gradient_passes_gradcheck():
    """Against finite differences of the converged forward (float64)."""
    z = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: implicit_sinkhorn(x, 100_000, 1e-15), (z,), eps=1e-6, atol=1e-7)


def test_sinkhorn_is_doubly_stochastic_and_warm_starts():
    z = torch.randn(3, 7, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    pot = Potentials()
    s = sinkhorn(z, 1000, 1e-12, pot)
    torch.testing.assert_close(s.sum(-1), torch.ones(3, 7, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(s.sum(-2), torch.ones(3, 7, dtype=torch.float64), rtol=0, atol=1e-12)
    assert pot.iterations > 1 and pot.error <= 1e-12
    again = sinkhorn(z, 1000, 1e-12, pot)  # from the fixed point: nothing left to fit
    assert pot.iterations == 0
    torch.testing.assert_close(again, s, rtol=0, atol=1e-12)
    # A row-and-column shift of the scores leaves the matrix alone.
    shifted = sinkhorn(z + torch.arange(7.0, dtype=torch.float64).view(7, 1), 1000, 1e-12)
    torch.testing.assert_close(shifted, s, rtol=0, atol=1e-10)


def _log_space_sinkhorn(z: torch.Tensor, iters: int, tol: float) -> tuple[torch.Tensor, int]:
    """The reference: potentials fitted by log-sum-exps, from zero, to the same stopping rule."""
    g = torch.zeros(z.shape[:-1], dtype=z.dtype)
    f = -torch.logsumexp(z + g.unsqueeze(-2), -1)
    done = 0
    while True:
        columns = torch.logsumexp(z + f.unsqueeze(-1), -2)
        if float((columns + g).exp().sub(1).abs().max()) <= tol or done >= iters:
            return (z + f.unsqueeze(-1) + g.unsqueeze(-2)).exp(), done
        g = -columns
        f = -torch.logsumexp(z + g.unsqueeze(-2), -1)
        done += 1


@pytest.mark.parametrize("fold", [None, 1.5])
@pytest.mark.parametrize("offset", [0.0, 40.0])
def test_sinkhorn_scalings_make_the_log_space_iterates(offset, fold, monkeypatch):
    """The products with exp(Z) fit the same iterates as log-sum-exps, also from a start so far off (columns
    shifted by e^40, which leaves the matrix alone) that the scalings leave float's range and that column fit
    is made in log space (forced at every step by a small fold bound)."""
    if fold is not None:
        monkeypatch.setattr(implicit_module, "_FOLD", fold)
    gen = torch.Generator().manual_seed(3)
    z = 2 * torch.randn(2, 9, 9, generator=gen, dtype=torch.float64)
    z = z + offset * torch.randn(2, 1, 9, generator=gen, dtype=torch.float64)
    calls = []
    fit_rows = implicit_module._fit_rows
    monkeypatch.setattr(implicit_module, "_fit_rows", lambda *args: calls.append(1) or fit_rows(*args))
    for iters, tol in ((3, 1e-12), (100_000, 1e-12)):
        expected, done = _log_space_sinkhorn(z, iters, tol)
        pot = Potentials()
        got = sinkhorn(z, iters, tol, pot)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        assert pot.iterations == done
    assert pot.error <= 1e-12 and 3 < done < 1000
    torch.testing.assert_close(pot.f.unsqueeze(-1) + pot.g.unsqueeze(-2) + z, got.log(), rtol=0, atol=1e-9)
    assert (len(calls) > 2) == (offset > 0 or fold is not None)  # the log-space fits happened where they must


# ------------------------------------------------------------------ the weight distance


def _planted_mlp(widths, seed=0):
    model = MLP(widths)
    spec = model.permutation_spec()
    sa = model.state_dict()
    plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(seed)))
    return model, spec, sa, plant.apply(sa), plant


def test_distance_loss_recovers_a_planted_permutation():
    model, spec, sa, sb, plant = _planted_mlp([16, 24, 24, 5])
    saved = [{k: v.clone() for k, v in s.items()} for s in (sa, sb)]
    result = sinkhorn_matching(None, spec, sa, sb, loss="distance", epochs=60)
    assert isinstance(result, SinkhornMatchingResult)
    assert isinstance(result.perms, Permutations) and result.perms.spec is spec
    assert result.init_perms == Permutations.identity(spec)
    assert result.perms == plant.inverse()
    assert result.iterations == len(result.loss) == len(result.sinkhorn_iterations) == 60
    assert result.loss[-1] < 0.1 * result.loss[0]
    for before, after in zip(saved, (sa, sb)):  # the caller's states are unchanged
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_iterations_stopped_by_the_cap_warn():
    """Sinkhorn stopped at sinkhorn_iters short of sinkhorn_tol is said, not silent."""
    model, spec, sa, sb, _ = _planted_mlp([5, 12, 3])
    with pytest.warns(UserWarning, match=r"in [23] of 3 Sinkhorn solves .* sinkhorn_iters=1 "):
        sinkhorn_matching(None, spec, sa, sb, loss="distance", epochs=2, sinkhorn_iters=1, sinkhorn_tol=1e-12)


def test_hard_answer_is_the_assignment_of_the_soft_permutations():
    """Each group's answer is a permutation maximising tr(P^T S) (compared by objective with scipy), and S
    is doubly stochastic."""
    model = MLP([16, 24, 24, 5])
    spec = model.permutation_spec()
    sa, sb = model.state_dict(), MLP([16, 24, 24, 5]).state_dict()
    result = sinkhorn_matching(model, spec, sa, sb, loss="distance", epochs=10, sinkhorn_tol=1e-6)
    for g, p in result.perms.items():
        s = result.soft[g].double()
        assert sorted(p.tolist()) == list(range(spec.sizes[g]))
        assert float((s.sum(-1) - 1).abs().max()) <= 1e-5 and float((s.sum(-2) - 1).abs().max()) <= 1e-5
        rows, cols = scipy.optimize.linear_sum_assignment(s.numpy(), maximize=True)
        assert float(s[torch.arange(len(p)), p].sum()) == pytest.approx(float(s.numpy()[rows, cols].sum()), abs=1e-9)


# ------------------------------------------------------------------ the midpoint's loss on data

WIDTHS = [64, 64, 64, 10]


@pytest.fixture(scope="module")
def pair():
    x, y, _, _ = digits()
    model = MLP(WIDTHS)
    with one_thread():
        sa, sb = train(model, 0, epochs=10), train(model, 1, epochs=10)
    return model, model.permutation_spec(), sa, sb, batches(x, y, 128)


def _midpoint_loss(model, sa, sb, perms, data):
    m = copy.deepcopy(model)
    m.load_state_dict(interpolate(sa, perms.apply(sb), 0.5))
    with torch.no_grad():
        total = sum(float(F.cross_entropy(m(x), y, reduction="sum")) for x, y in data)
    return total / sum(len(y) for _, y in data)


def test_midpoint_loss_lowers_the_midpoint_loss_below_the_identity(pair):
    model, spec, sa, sb, data = pair
    result = sinkhorn_matching(model, spec, sa, sb, data, epochs=3)
    assert result.iterations == 3 * len(data)
    identity = Permutations.identity(spec)
    x, y, _, _ = digits()
    whole = [(x, y)]
    assert _midpoint_loss(model, sa, sb, result.perms, whole) < 0.5 * _midpoint_loss(model, sa, sb, identity, whole)


def test_midpoint_from_weight_matching_starts_there(pair):
    from pyperm.nn import weight_matching

    model, spec, sa, sb, data = pair
    result = sinkhorn_matching(model, spec, sa, sb, data, init="weight", max_batches=2, seed=3)
    assert result.init_perms == weight_matching(spec, sa, sb, seed=3).perms
    assert result.iterations == 2


def test_midpoint_loss_with_a_custom_loss_fn(pair):
    model, spec, sa, sb, data = pair
    seen = []

    def loss_fn(outputs, targets):
        seen.append(outputs.shape)
        return F.cross_entropy(outputs, targets)

    result = sinkhorn_matching(model, spec, sa, sb, data, loss_fn=loss_fn, max_batches=2)
    assert len(seen) == result.iterations == 2


# ------------------------------------------------------------------ every spec form


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_every_spec_form_distance_recovers_a_plant(name):
    model, spec, _ = structured_model(name, seed=0)
    sa = model.state_dict()
    plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(1)))
    sb = plant.apply(sa)
    result = sinkhorn_matching(model, spec, sa, sb, loss="distance", epochs=60)
    assert result.perms == plant.inverse()


@pytest.mark.parametrize("name", sorted(STRUCTURED))
def test_every_spec_form_midpoint_keeps_the_function(name):
    model, spec, x = structured_model(name, seed=0)
    sa, sb = model.state_dict(), structured_model(name, seed=1)[0].state_dict()
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(x.shape, generator=gen, dtype=x.dtype), torch.randint(0, 3, (x.shape[0],), generator=gen))
            for _ in range(2)]  # fmt: skip
    result = sinkhorn_matching(model, spec, sa, sb, data, epochs=2)
    assert result.perms.spec is spec and np.isfinite(result.loss).all()
    for g, s in result.soft.items():
        assert s.shape[-1] == s.shape[-2] and float((s.sum(-1) - 1).abs().max()) <= 1e-5, g
    torch.testing.assert_close(outputs(model, result.perms.apply(sb), x), outputs(model, sb, x))


# ------------------------------------------------------------------ the device


def test_runs_on_the_device(device):
    model, spec, sa, sb, plant = _planted_mlp([16, 24, 24, 5])
    sa = {k: v.to(device) for k, v in sa.items()}
    sb = {k: v.to(device) for k, v in sb.items()}
    result = sinkhorn_matching(None, spec, sa, sb, loss="distance", epochs=60)
    assert all(s.device.type == device for s in result.soft.values())
    assert result.perms == plant.inverse()
    # The states on the CPU, the work on the device.
    cpu = {k: v.cpu() for k, v in sb.items()}
    on_device = sinkhorn_matching(None, spec, {k: v.cpu() for k, v in sa.items()}, cpu, loss="distance",
                                  epochs=60, device=device)  # fmt: skip
    assert all(s.device.type == device for s in on_device.soft.values())
    assert on_device.perms == plant.inverse()


# ------------------------------------------------------------------ arguments


def test_bad_arguments_name_themselves(pair):
    model, spec, sa, sb, data = pair
    cases = [
        (dict(loss="l2"), ValueError, "loss"),
        (dict(data=None), ValueError, "data"),
        (dict(epochs=0), ValueError, "epochs"),
        (dict(lr=0.0), ValueError, "lr"),
        (dict(tau=-1.0), ValueError, "tau"),
        (dict(sinkhorn_iters=0), ValueError, "sinkhorn_iters"),
        (dict(sinkhorn_tol=0.0), ValueError, "sinkhorn_tol"),
        (dict(init="random"), ValueError, "init"),
        (dict(init=3), TypeError, "init"),
        (dict(init={"hidden1": torch.zeros(64, dtype=torch.int64)}), ValueError, "init"),
        (dict(loss_fn="ce"), TypeError, "loss_fn"),
        (dict(max_batches=0), ValueError, "max_batches"),
        (dict(device=3), TypeError, "device"),
        (dict(seed="zero"), TypeError, "seed"),
        (dict(device="gpu7"), ValueError, "device"),
        (dict(data=iter(data)), TypeError, "data"),
    ]
    for kwargs, error, name in cases:
        args = dict(data=data) | kwargs
        with pytest.raises(error, match=name):
            sinkhorn_matching(model, spec, sa, sb, args.pop("data"), **args)
    with pytest.raises(TypeError, match="model"):
        sinkhorn_matching("mlp", spec, sa, sb, data)
    with pytest.raises(TypeError, match="spec"):
        sinkhorn_matching(model, {"hidden1": 64}, sa, sb, data)
    with pytest.raises(ValueError, match="state"):
        sinkhorn_matching(model, spec, sa, {k: v for k, v in sb.items() if k != "layers.0.bias"}, data)
    for name, value in (("data", data), ("loss_fn", F.cross_entropy), ("max_batches", 2)):
        with pytest.raises(ValueError, match=name):
            sinkhorn_matching(model, spec, sa, sb, **{name: value}, loss="distance")


def test_progress_bar_counts_the_steps(capsys):
    pytest.importorskip("tqdm")
    _, spec, sa, sb, _ = _planted_mlp([8, 12, 3])
    result = sinkhorn_matching(None, spec, sa, sb, loss="distance", epochs=3, progress=True)
    assert result.iterations == 3
    assert "Sinkhorn matching" in capsys.readouterr().err
