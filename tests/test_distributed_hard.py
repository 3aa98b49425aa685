"""Over ranks against one process on the cases where they could part: an exact permuted copy (one process's
``init="best"`` recognises it at once), dead and duplicate units (ties), and MergeMany of three such models.
What the docs promise there: the same permutations for a copy; with ties, an objective equal up to summation
order (the permutations may differ among tied units, which leaves the permuted model's function unchanged)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks, values

import pyperm.distributed as pd
from pyperm.nn import apply_permutation, merge_many, weight_matching
from pyperm.nn.models import MLP
from pyperm.testing import random_permutations

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with the gloo backend")  # fmt: skip


def _mlp(seed: int, dead: bool = False) -> dict:
    torch.manual_seed(seed)
    state = MLP([12, 24, 24, 4]).state_dict()
    if dead:  # units 0-3 of each hidden layer dead (all zero), units 4-5 duplicates of unit 6
        for layer in ("layers.0", "layers.1"):
            w, b = state[f"{layer}.weight"], state[f"{layer}.bias"]
            w[:4], b[:4] = 0.0, 0.0
            w[4:6], b[4:6] = w[6].clone(), b[6].clone()
    return state


def _spec():
    return MLP([12, 24, 24, 4]).permutation_spec()


def _share(keys, rank, world):
    return keys[rank::world]


def _match(rank, world, a, b, init):
    spec = _spec()
    mine = _share(list(spec.axes), rank, world)
    r = pd.weight_matching(spec, {k: a[k] for k in mine}, {k: b[k] for k in mine}, seed=1, init=init)
    return dict(r.perms.items()), r.objective[-1]


@pytest.mark.parametrize("init", ["best", "identity"])
def test_an_exact_permuted_copy_gives_one_process_permutations(tmp_path, init):
    spec, a = _spec(), _mlp(0)
    planted = random_permutations(spec, torch.Generator().manual_seed(5))
    b = apply_permutation(spec, planted, a)
    one = weight_matching(spec, a, b, seed=1, init=init)
    for perms, objective in values(run_ranks(_match, 2, tmp_path, a, b, init)):
        assert all(torch.equal(perms[g], one.perms[g]) for g in spec.sizes)
        assert objective == pytest.approx(one.objective[-1], rel=1e-6)


def test_dead_and_duplicate_units_give_one_process_objective_and_function(tmp_path):
    spec, a = _spec(), _mlp(0, dead=True)
    b = apply_permutation(spec, random_permutations(spec, torch.Generator().manual_seed(5)), _mlp(0, dead=True))
    b = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(2)) for k, v in b.items()}
    one = weight_matching(spec, a, b, seed=1, init="best")
    x = torch.randn(5, 12)
    for perms, objective in values(run_ranks(_match, 2, tmp_path, a, b, "best")):
        assert objective == pytest.approx(one.objective[-1], rel=1e-6)
        model = MLP([12, 24, 24, 4])
        model.load_state_dict(apply_permutation(spec, perms, b))
        reference = MLP([12, 24, 24, 4])
        reference.load_state_dict(apply_permutation(spec, one.perms, b))
        torch.testing.assert_close(model(x), reference(x))


def _merge(rank, world, states):
    spec = _spec()
    mine = _share(list(spec.axes), rank, world)
    r = pd.merge_many(spec, [{k: s[k] for k in mine} for s in states], seed=4)
    return r.merged, r.history


def test_a_three_model_merge_with_ties_equals_one_process(tmp_path):
    spec = _spec()
    states = [_mlp(s, dead=True) for s in (0, 1, 2)]
    one = merge_many(spec, states, seed=4)
    merged = {}
    for share, history in values(run_ranks(_merge, 2, tmp_path, states)):
        assert history == pytest.approx(one.history, rel=1e-6)
        merged.update(share)
    for k, v in one.merged.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6)
