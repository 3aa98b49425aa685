"""pyperm.distributed.c2m3_merge on 2 and 3 gloo ranks: the permutations, objectives and merged model of one process,
whatever the split of the keys; bad shares refused on every rank alike."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks, values
from _structured_models import structured_model

import pyperm.distributed as pd
from pyperm.nn.align.c2m3 import c2m3_merge
from pyperm.nn.models import MLP

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with the gloo backend")  # fmt: skip


def _mlps(count=4):
    torch.manual_seed(0)
    models = [MLP([16, 32, 32, 4]) for _ in range(count)]
    return models[0].permutation_spec(), [m.state_dict() for m in models]


def _share(keys, rank, world, how):
    if how == "strided":  # most groups span ranks
        return keys[rank::world]
    return keys if rank == 0 else []  # "one": everything on rank 0, the others hold nothing


def _merge(rank, world, spec, states, how, options):
    mine = _share(list(spec.axes), rank, world, how)
    r = pd.c2m3_merge(spec, [{k: s[k] for k in mine} for s in states], **options)
    return [dict(p.items()) for p in r.perms], r.merged, r.iterations, r.objective, r.step_sizes, r.final_objective


def _check_equal(outcomes, one, spec):
    merged = {}
    for perms, share, iterations, objective, steps, final in outcomes:
        assert iterations == one.iterations
        for p, q in zip(perms, one.perms):
            assert all(torch.equal(p[g], q[g]) for g in spec.sizes)
        torch.testing.assert_close(torch.tensor(objective), torch.tensor(one.objective), rtol=1e-9, atol=0)
        torch.testing.assert_close(torch.tensor(steps), torch.tensor(one.step_sizes), rtol=1e-6, atol=1e-9)
        assert final == pytest.approx(one.final_objective, rel=1e-12)
        assert not set(merged) & set(share)
        merged.update(share)
    assert sorted(merged) == sorted(one.merged)
    for k, v in one.merged.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("world", "how", "options"), [
    (2, "strided", {"max_iter": 15}),
    (3, "strided", {"max_iter": 15, "init": "identity"}),
    (2, "one", {"max_iter": 15, "init": "barycenter", "seed": 3}),
    (2, "strided", {"max_iter": 15, "weights": [0.4, 0.3, 0.2, 0.1], "anchor": False}),
], ids=["2-ranks", "3-ranks-identity", "all-on-one-rank-barycenter", "weights-free"])  # fmt: skip
def test_c2m3_over_ranks_is_one_process(tmp_path, world, how, options):
    spec, states = _mlps()
    one = c2m3_merge(spec, states, **options)
    assert one.iterations > 1  # several Frank-Wolfe steps: the summed gradients and line searches are exercised
    _check_equal(values(run_ranks(_merge, world, tmp_path, spec, states, how, options)), one, spec)


@pytest.mark.parametrize("name", ["attention-heads", "grouped-convolution"])
def test_c2m3_over_ranks_on_structured_specs(tmp_path, name):
    """Blocks and heads: a group's matrices per block, summed over ranks as one process sums them."""
    (m0, spec, _), (m1, _, _), (m2, _, _) = (structured_model(name, seed) for seed in range(3))
    states = [m.state_dict() for m in (m0, m1, m2)]
    one = c2m3_merge(spec, states, max_iter=8)
    _check_equal(values(run_ranks(_merge, 2, tmp_path, spec, states, "strided", {"max_iter": 8})), one, spec)


def _bad(rank, world, spec, states, what):
    keys = list(spec.axes)
    mine = keys[rank::world]
    shares = [{k: s[k] for k in mine} for s in states]
    if what == "overlap":  # rank 1 also holds rank 0's first key
        shares = [{**share, keys[0]: s[keys[0]]} for share, s in zip(shares, states)] if rank == 1 else shares
    elif what == "missing" and rank == 1:
        shares = [{k: v for k, v in share.items() if k != mine[0]} for share in shares]
    elif what == "other-keys" and rank == 1:  # model 2's share misses a key the others hold
        shares[2] = {k: v for k, v in shares[2].items() if k != mine[0]}
    try:
        pd.c2m3_merge(spec, shares, max_iter=3)
    except (ValueError, pd.RankFailedError) as exc:  # a rank's own error, or the others' naming it
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(("what", "message"), [
    ("overlap", "is held by ranks 0 and 1"),
    ("missing", "no rank holds 1 of the spec's keys"),
    ("other-keys", "states[2] against states[0]: state_a and state_b must hold the same keys"),
])  # fmt: skip
def test_bad_shares_are_refused_on_every_rank(tmp_path, what, message):
    spec, states = _mlps(3)
    texts = values(run_ranks(_bad, 2, tmp_path, spec, states, what))
    assert all(message in t for t in texts), texts


def _differ(rank, world, spec, states):
    mine = list(spec.axes)[rank::world]
    try:
        pd.c2m3_merge(spec, [{k: s[k] for k in mine} for s in states], max_iter=3 + rank)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_differ_in_their_arguments_are_refused(tmp_path):
    spec, states = _mlps(3)
    assert all("rank 1 differs from rank 0 in its max_iter" in t
               for t in values(run_ranks(_differ, 2, tmp_path, spec, states)))  # fmt: skip


def test_bad_arguments_name_themselves_before_any_collective():
    spec, states = _mlps(3)
    with pytest.raises(TypeError, match="states must be a sequence"):
        pd.c2m3_merge(spec, states[0])
    with pytest.raises(ValueError, match="at least two"):
        pd.c2m3_merge(spec, states[:1])
    with pytest.raises(ValueError, match="weights"):
        pd.c2m3_merge(spec, states, weights=[1.0])
    with pytest.raises(ValueError, match="max_iter"):
        pd.c2m3_merge(spec, states, max_iter=0)
