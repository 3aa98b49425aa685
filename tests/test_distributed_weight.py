"""pyperm.distributed.weight_matching on 2 and 4 gloo ranks: the same permutations as one process,
the objective equal up to summation order, and a failing rank ending every rank (never a hang)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks, values
from _structured_models import structured_model

import pyperm.distributed as pd
from pyperm.nn import weight_matching
from pyperm.nn.models import MLP

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with the gloo backend")  # fmt: skip

STRUCTURED = ["concatenation", "flatten", "grouped-convolution", "attention-heads", "recurrent", "channel-shuffle"]


def _mlp():
    torch.manual_seed(0)
    a, b = MLP([16, 32, 32, 32, 4]), MLP([16, 32, 32, 32, 4])
    return a.permutation_spec(), a.state_dict(), b.state_dict()


def _llama():
    transformers = pytest.importorskip("transformers")
    from test_hf_attention import Logits

    from pyperm.nn import trace_model

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=16, vocab_size=50,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    a, b = Logits(transformers.LlamaForCausalLM(config)).eval(), Logits(transformers.LlamaForCausalLM(config)).eval()
    spec = trace_model(a, torch.randint(1, 50, (2, 8)), composite="fix").spec
    return spec, a.state_dict(), b.state_dict()


def _problems():
    out = {"mlp": _mlp(), "llama": _llama()}
    for name in STRUCTURED:
        (ma, spec, _), (mb, _, _) = structured_model(name, 0), structured_model(name, 1)
        out[name] = (spec, ma.state_dict(), mb.state_dict())
    return out


def _share(keys: list[str], rank: int, world: int, how: str) -> list[str]:
    if how == "ranges":  # contiguous ranges of the keys, as layers split over ranks
        return [k for i, k in enumerate(keys) if i * world // len(keys) == rank]
    if how == "strided":  # every world-th key: most groups span ranks
        return keys[rank::world]
    return keys if rank == 0 else []  # "one": everything on rank 0


def _match(rank, world, problems, how, concurrent, init="identity"):
    out = {}
    for name, (spec, a, b) in problems.items():
        mine = _share(list(spec.axes), rank, world, how)
        r = pd.weight_matching(spec, {k: a[k] for k in mine}, {k: b[k] for k in mine}, seed=3, concurrent=concurrent,
                               init=init)  # fmt: skip
        out[name] = (dict(r.perms.items()), r.objective, r.iterations, r.bytes_per_sweep)
    return out


def _check_equal(problems, results, init="identity"):
    for name, (spec, a, b) in problems.items():
        one = weight_matching(spec, a, b, seed=3, init=init)
        for rank_result in results:
            perms, objective, iterations, _ = rank_result[name]
            for g in spec.sizes:
                assert torch.equal(perms[g], one.perms[g]), (name, g)
            assert iterations == one.iterations, name
            assert objective == pytest.approx(one.objective, rel=1e-6), name


@pytest.mark.parametrize("concurrent", [False, True])
def test_two_ranks_match_one_process(tmp_path, concurrent):
    problems = _problems()
    results = values(run_ranks(_match, 2, tmp_path, problems, "ranges", concurrent))
    _check_equal(problems, results)
    # Every group of the MLP spans the two ranks' layers somewhere: something is sent each sweep.
    assert all(b > 24 * 2 for b in results[0]["mlp"][3])


def test_four_ranks_strided_match_one_process(tmp_path):
    problems = {k: v for k, v in _problems().items() if k in ("mlp", "llama", "attention-heads", "recurrent")}
    results = values(run_ranks(_match, 4, tmp_path, problems, "strided", False))
    _check_equal(problems, results)


def _planted():
    """MobileNetV2 and a permuted copy of it plus 1% noise: the identity start stalls there (one process)."""
    from _planted import planted_mobilenet_v2, planted_pair
    from test_groupnorm import GNResNet

    from pyperm.nn.align._starts import stalled

    g = torch.Generator().manual_seed(1)
    spec, a, b, _ = planted_mobilenet_v2(g)
    one = weight_matching(spec, a, b, seed=3, init="identity")
    assert stalled(spec, a, b, one.perms, list(spec.axes)), "the identity start should stall here"
    problems = {"mobilenet_v2": (spec, a, b)}
    # GroupNorm: Blocks groups whose whole groups move too (an outer group), solved one cost at a time.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GNResNet()
    spec, a, b, _ = planted_pair(model, torch.randn(1, 3, 8, 8), g)
    assert any(isinstance(outer, str) for outer in spec.blocks.values())
    problems["gn_resnet"] = (spec, a, b)
    return problems


@pytest.mark.parametrize("init", ["best", "signatures"])
def test_the_starts_that_read_whole_tensors_match_one_process(tmp_path, init):
    problems = _planted()
    _check_equal(problems, values(run_ranks(_match, 2, tmp_path, problems, "strided", False, init)), init)


def _merge(rank, world, spec, states):
    mine = _share(list(spec.axes), rank, world, "strided")
    r = pd.merge_many(spec, [{k: s[k] for k in mine} for s in states], seed=4)
    return [dict(p.items()) for p in r.perms], r.merged, r.iterations, r.history


def test_merge_many_over_ranks_matches_one_process(tmp_path):
    from pyperm.nn import merge_many

    torch.manual_seed(0)
    models = [MLP([16, 32, 32, 4]) for _ in range(3)]
    spec, states = models[0].permutation_spec(), [m.state_dict() for m in models]
    one = merge_many(spec, states, seed=4)
    assert one.iterations > 1  # more than one round: the warm starts and the shared generator are exercised
    merged = {}
    for perms, share, iterations, history in values(run_ranks(_merge, 2, tmp_path, spec, states)):
        assert (iterations, history) == (one.iterations, one.history)
        for p, q in zip(perms, one.perms):
            assert all(torch.equal(p[g], q[g]) for g in spec.sizes)
        merged.update(share)
    assert sorted(merged) == sorted(one.merged)
    for k, v in one.merged.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-6, atol=1e-7)


def _keeps_init(rank, world, spec, a, b):
    from pyperm.testing import random_permutations

    init = random_permutations(spec, 7)
    before = {g: p.clone() for g, p in init.items()}
    mine = _share(list(spec.axes), rank, world, "ranges")
    pd.weight_matching(spec, {k: a[k] for k in mine}, {k: b[k] for k in mine}, init=init)
    return all(torch.equal(init[g], before[g]) for g in before)


def test_the_callers_start_is_not_written_into(tmp_path):
    assert values(run_ranks(_keeps_init, 2, tmp_path, *_mlp())) == [True, True]


def test_groups_on_one_rank_send_nothing(tmp_path):
    problems = {"mlp": _mlp()}
    results = values(run_ranks(_match, 2, tmp_path, problems, "one", False))
    _check_equal(problems, results)
    # Only each sweep's three sums (objective gain, moves, bytes) per rank: no similarity, no permutation.
    assert results[0]["mlp"][3] == [24 * 2] * len(results[0]["mlp"][3])


# --------------------------------------------------------------------------- failures


def _failing(rank, world, mode):
    spec, a, b = _mlp()
    mine = _share(list(spec.axes), rank, world, "strided")
    with pd.failure_guard(timeout=3, grace=2):
        if rank == 1 and mode == "raise":
            raise ValueError("rank 1 fails on purpose")
        if rank == 1 and mode == "kill":
            os.kill(os.getpid(), 9)
        if rank == 1 and mode == "version":
            import pyperm

            pyperm.__version__ = "0.0.0-other"
        if rank == 1 and mode == "inputs":
            b = {k: v + 1 for k, v in b.items()}
        pd.check_same(checkpoint=float(sum(v.double().sum() for v in b.values())))
        return pd.weight_matching(spec, {k: a[k] for k in mine}, {k: b[k] for k in mine}, seed=3).iterations


@pytest.mark.parametrize(("mode", "expected"), [
    ("raise", "rank 1 failed: ValueError: rank 1 fails on purpose"),
    ("kill", "rank 1 stopped"),
    ("version", "rank 1 differs from rank 0 in its pyperm version"),
    ("inputs", "rank 1 differs from rank 0 in its checkpoint"),
])  # fmt: skip
def test_a_failing_rank_ends_every_rank(tmp_path, mode, expected):
    outcomes = run_ranks(_failing, 3, tmp_path, mode, deadline=60)
    assert all(o[0] != "ok" for o in outcomes), outcomes
    for rank, o in enumerate(outcomes):
        if mode == "kill" and rank == 1:
            assert o == ("exit", -9)
        elif mode == "raise" and rank == 1:  # its own error, unchanged
            assert o[:2] == ("error", "ValueError: rank 1 fails on purpose")
        else:
            assert o[0] == "error" and expected in o[1], (rank, o)


def test_bad_arguments_are_refused(tmp_path):
    outcomes = run_ranks(_bad, 2, tmp_path)
    for rank, o in enumerate(outcomes):
        assert o == ("ok", True), (rank, o)


def _bad(rank, world):
    spec, a, b = _mlp()
    keys = list(spec.axes)
    errors = [
        (dict(init="nearest"), ValueError, "init must be one of 'best', 'identity', 'signatures'"),
        (dict(concurrent=1), TypeError, "concurrent must be a bool"),
    ]
    for kwargs, error, match in errors:
        with pytest.raises(error, match=match):
            pd.weight_matching(spec, {}, {}, **kwargs)
    # Both ranks claim every key.
    with pytest.raises(ValueError, match="is held by ranks 0 and 1"):
        pd.weight_matching(spec, a, b)
    # Nobody holds the last key.
    with pytest.raises(ValueError, match="no rank holds 1 of the spec's keys"):
        mine = _share(keys[:-1], rank, world, "ranges")
        pd.weight_matching(spec, {k: a[k] for k in mine}, {k: b[k] for k in mine})
    mine = _share(keys, rank, world, "ranges")
    with pytest.raises(ValueError, match="at least two state dicts"):
        pd.merge_many(spec, [{k: a[k] for k in mine}])
    with pytest.raises(ValueError, match=r"states\[1\] must hold the same keys as states\[0\]"):
        pd.merge_many(spec, [{k: a[k] for k in mine}, {k: b[k] for k in mine[1:]}])
    with pytest.raises(TypeError, match="states must be a sequence"):
        pd.merge_many(spec, a)
    return True


def _merge_planted(rank, world, spec, states):
    mine = _share(list(spec.axes), rank, world, "strided")
    r = pd.merge_many(spec, [{k: s[k] for k in mine} for s in states], seed=3)
    return [dict(p.items()) for p in r.perms], r.iterations, r.history


def test_merge_many_over_ranks_restarts_a_stall_as_one_process(tmp_path):
    """A planted MobileNetV2 copy, on which the identity start alone stalls: the matchings over the ranks look for
    the stall as one process's do, and the merge finds the planted units."""
    from _planted import planted_mobilenet_v2

    from pyperm.nn import merge_many

    spec, a, b, planted = planted_mobilenet_v2(torch.Generator().manual_seed(1))
    one = merge_many(spec, [a, b], seed=3)
    assert one.perms[1] == planted.inverse()
    for perms, iterations, history in values(run_ranks(_merge_planted, 2, tmp_path, spec, [a, b])):
        assert (iterations, history) == (one.iterations, one.history)
        for p, q in zip(perms, one.perms):
            assert all(torch.equal(p[g], q[g]) for g in spec.sizes)
