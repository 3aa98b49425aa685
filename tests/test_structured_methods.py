"""Every method on every structured spec form: STE matching, PAM (its relaxation and BvN candidates over
segments, tiles, blocks and the units within them), REPAIR, curves (connect) and barriers, on a small model
of each kind (concatenation, flatten, grouped convolution, attention heads, recurrent layer).

Each test checks function preservation (B permuted as the method says computes what B computed) and,
where a planted permutation exists, that the method finds it back. merge_many and weight matching have
their own structured tests (test_merge.py, test_spec_forms.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from _structured_models import STRUCTURED, outputs, structured_model

from pyperm.nn import Permutations, apply_permutation, barrier, connect, repair, weight_matching
from pyperm.nn.align import _relaxation as relax
from pyperm.nn.align.proximal import pam
from pyperm.nn.align.ste import ste_matching
from pyperm.testing import random_permutations

KINDS = sorted(STRUCTURED)


def _pair(name: str, planted: bool):
    """A model, its structured spec, A's and B's states, the planted permutations (planted: B is A under
    them; else B is an unrelated model and they are None) and supervised batches."""
    model, spec, x = structured_model(name, seed=0)
    sa = model.state_dict()
    if planted:
        plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(1)))
        sb = plant.apply(sa)
    else:
        plant, sb = None, structured_model(name, seed=1)[0].state_dict()
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(x.shape, generator=gen, dtype=x.dtype), torch.randint(0, 3, (x.shape[0],), generator=gen))
            for _ in range(3)]  # fmt: skip
    return model, spec, sa, sb, plant, data


def _same_function(model, spec, perms, sb, data):
    """B permuted by ``perms`` computes what B computes."""
    x = data[0][0]
    torch.testing.assert_close(outputs(model, perms.apply(sb), x), outputs(model, sb, x))
    assert perms.spec is spec


# ------------------------------------------------------------------ the relaxation of PAM on every form


@pytest.mark.parametrize("name", KINDS)
def test_relaxation_of_permutation_matrices_is_the_permutation(name):
    """With one-hot matrices the relaxed D theta is apply_permutation in every form, and the candidates
    taken from them (assignment projection, BvN samples) are the permutations themselves."""
    _, spec, sa, _, _, _ = _pair(name, planted=False)
    perms = random_permutations(spec, torch.Generator().manual_seed(3))
    matrices = relax.one_hot(spec, perms)
    relaxed = relax.apply_relaxed(spec, matrices, sa)
    exact = apply_permutation(spec, perms, sa)
    for key in sa:
        torch.testing.assert_close(relaxed[key], exact[key], rtol=0, atol=1e-12, msg=key)
    for g in spec.blocks:  # a Blocks inner group: one matrix per block
        assert matrices[g].shape == (spec.num_blocks(g), spec.block_size(g), spec.block_size(g))
    nearest = relax.nearest_permutations(spec, matrices)
    samples = relax.sample_candidates(spec, matrices, 3, 5, np.random.default_rng(0))
    for candidate in [nearest, *samples]:
        assert Permutations(spec, candidate) == Permutations(spec, perms)


@pytest.mark.parametrize("name", KINDS)
def test_relaxed_blocks_mix_units_within_their_block_only(name):
    """A doubly stochastic matrix per block (and across blocks for the outer group): every unit of the
    relaxed B is a convex combination of units, and the projected step keeps each block doubly stochastic."""
    _, spec, sa, _, _, _ = _pair(name, planted=False)
    gen = torch.Generator().manual_seed(4)
    anchor = relax.one_hot(spec, random_permutations(spec, gen))
    grads = {g: torch.randn(m.shape, generator=gen, dtype=torch.float64) for g, m in anchor.items()}
    stepped = relax.projected_step(anchor, grads, anchor, lr=0.5, nu=10.0, tol=1e-9)
    for g, d in stepped.items():
        assert d.shape == anchor[g].shape and relax.defect(d) <= 1e-8, g
    ones = {k: torch.ones_like(v) for k, v in sa.items()}
    for key, t in relax.apply_relaxed(spec, stepped, ones).items():
        if any(e is not None for e in spec.axes[key]):  # rows and columns sum to one: ones stay ones
            torch.testing.assert_close(t, ones[key], rtol=0, atol=1e-7, msg=key)


# ------------------------------------------------------------------ the default start of weight matching


@pytest.mark.parametrize("name", KINDS)
def test_the_default_start_recognises_a_permuted_copy(name):
    """B an exact permuted copy of A: the copy start pairs the units by fingerprint and stops at the bound
    (no sweep); B with the slightest noise is not a copy, and gets the sweeps."""
    model, spec, sa, sb, plant, _ = _pair(name, planted=True)
    result = weight_matching(spec, sa, sb)
    assert result.iterations == 0 and result.converged and result.perms == plant.inverse()
    gen = torch.Generator().manual_seed(5)
    noisy = {k: v + 1e-6 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in sb.items()}
    result = weight_matching(spec, sa, noisy)
    assert result.iterations >= 1 and result.perms == plant.inverse()


# ------------------------------------------------------------------ STE matching


@pytest.mark.parametrize("name", KINDS)
def test_ste_matching_recovers_a_planted_permutation(name):
    """STE, not its start, finds the plant: it starts from the plant with two units of every group
    swapped, on batches labelled by model A (so that the midpoint's loss tells the plant apart; random
    labels do not), and its answer is a later step's candidate."""
    model, spec, sa, sb, plant, data = _pair(name, planted=True)
    gen = torch.Generator().manual_seed(6)
    inputs = [torch.randn((16, *data[0][0].shape[1:]), generator=gen, dtype=data[0][0].dtype) for _ in range(3)]
    data = [(x, outputs(model, sa, x).argmax(-1)) for x in inputs]
    target = plant.inverse()
    start = {}
    for g, p in target.items():
        start[g] = p.clone()
        start[g][[0, 1]] = p[[1, 0]]
    start = Permutations(spec, start)
    assert start != target
    result = ste_matching(model, spec, sa, sb, data, init=start, lr=1e-2, judge_every=1)
    assert result.iterations == len(data)
    assert result.perms == target and result.best_step > 0


@pytest.mark.parametrize("name", KINDS)
def test_ste_matching_keeps_the_function_of_an_unrelated_model(name):
    model, spec, sa, sb, _, data = _pair(name, planted=False)
    result = ste_matching(model, spec, sa, sb, data, lr=1e-1, epochs=2, judge_every=1)
    _same_function(model, spec, result.perms, sb, data)
    assert result.judged[result.best_step] <= result.judged[0]


# ------------------------------------------------------------------ PAM


@pytest.mark.parametrize("name", KINDS)
def test_pam_starts_from_the_planted_permutation_and_its_curve_ends_at_b(name):
    """Weight matching's start finds the planted permutation back; the permutation step never raises the
    objective, moves B only within the spec's symmetry, and the curve ends at B under the chosen permutation."""
    model, spec, sa, sb, plant, data = _pair(name, planted=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the relaxation of two equal models hardly moves
        result = pam(model, spec, sa, sb, data, init="weight", perm_steps=4, curve_epochs=1, perm_samples=3,
                     judge_batches=1, lr_curve=1e-3)  # fmt: skip
    assert result.init_perms == plant.inverse()
    assert result.history[0].objective_after_perm <= result.objective[0]
    _same_function(model, spec, result.perms, sb, data)
    end = result.curve.state_at(1.0)
    for key, t in result.perms.apply(sb).items():
        torch.testing.assert_close(end[key], t, msg=key)


@pytest.mark.parametrize("name", KINDS)
def test_pam_on_unrelated_models_never_raises_its_objective(name):
    model, spec, sa, sb, _, data = _pair(name, planted=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = pam(model, spec, sa, sb, data, perm_steps=5, curve_epochs=1, perm_samples=4, judge_batches=2,
                     lr_curve=1e-3, nu_perm=1e6)  # fmt: skip
    step = result.history[0]
    assert step.objective_after_perm <= result.objective[0] + 1e-12
    assert step.relaxed_defect <= 1e-4 and step.candidates >= 2
    _same_function(model, spec, result.perms, sb, data)


# ------------------------------------------------------------------ REPAIR, curves, barriers


@pytest.mark.parametrize("name", KINDS)
def test_repair_at_an_endpoint_gives_the_endpoint(name):
    """At t = 0 the targets are A's statistics, measured in A: every correction is the identity."""
    model, spec, sa, sb, _, data = _pair(name, planted=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repaired = repair(model, spec, sa, sb, [x for x, _ in data], t=0.0)
    for key, t in sa.items():
        torch.testing.assert_close(repaired[key], t, msg=key)
    inside = [w for w in caught if "inside a layer" in str(w.message)]
    # Units computed inside attention and recurrent layers are left as interpolated, and the user is told.
    assert bool(inside) == (name in ("attention-heads", "recurrent"))


@pytest.mark.parametrize("name", KINDS)
def test_repair_restores_the_statistics_of_every_structured_group(name):
    """REPAIR at the midpoint changes the interpolation (it corrects something) and keeps it finite."""
    model, spec, sa, sb, _, data = _pair(name, planted=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        repaired = repair(model, spec, sa, apply_permutation(spec, weight_matching(spec, sa, sb).perms, sb),
                          [x for x, _ in data])  # fmt: skip
    assert all(bool(torch.isfinite(t).all()) for t in repaired.values())
    middle = {k: (sa[k] + sb[k]) / 2 for k in sa}
    assert any(not torch.allclose(repaired[k], middle[k]) for k in sa)


@pytest.mark.parametrize("name", KINDS)
def test_connect_recovers_a_planted_permutation_and_the_barrier_vanishes(name):
    model, spec, sa, sb, plant, data = _pair(name, planted=True)
    run = connect(model, spec, sa, sb, data, align="weight", epochs=1, lr=1e-3, num_points=3)
    assert run.perms == plant.inverse()
    aligned = run.perms.apply(sb)
    path = barrier(model, sa, aligned, data, num_points=3)
    np.testing.assert_allclose(path.loss, path.loss[0], rtol=1e-9)  # A, A, A: no barrier at all
    naive = barrier(model, sa, sb, data, num_points=3)
    assert naive.loss[1] != pytest.approx(naive.loss[0])


@pytest.mark.parametrize("name", KINDS)
def test_connect_with_activation_matching_keeps_the_function(name):
    model, spec, sa, sb, _, data = _pair(name, planted=False)
    run = connect(model, spec, sa, sb, data, align="activation", epochs=1, lr=1e-3, num_points=3)
    _same_function(model, spec, run.perms, sb, data)
