"""Data over ranks (``group=``): activation_matching, repair, reset_bn_stats, barrier and
evaluate_curve on 2 gloo ranks, each with its own share of the batches (of unequal sizes and
numbers), give what one process gives on all the batches; a rank that fails ends the others."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks, values
from torch import nn

from pyperm.nn import activation_matching, barrier, repair, reset_bn_stats
from pyperm.nn.curves import BezierCurve, evaluate_curve

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with the gloo backend")  # fmt: skip


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 12), nn.BatchNorm1d(12),
                         nn.ReLU(), nn.Linear(12, 3)).eval()  # fmt: skip


def _shares():
    """Each rank's batches: rank 0 has an extra, short batch (8, 8, 3 against 8, 5 samples)."""
    g = torch.Generator().manual_seed(1)
    sizes = (8, 8, 3, 8, 5)
    batches = [(torch.randn(n, 6, generator=g) * 2 + 1, torch.randint(0, 3, (n,), generator=g)) for n in sizes]
    return [batches[:3], batches[3:]]


def _methods(a: nn.Module, b: nn.Module, data, group):
    """Every data method on ``data``: what a test compares (tensors and floats)."""
    out = {}
    out["perms"] = dict(activation_matching(a, b, None, data, group=group).perms.items())
    bn = reset_bn_stats(_copy(a), data, group=group)
    out["bn"] = {k: v.clone() for k, v in bn.state_dict().items() if "running" in k or "tracked" in k}
    out["repair"] = repair(a, None, a.state_dict(), b.state_dict(), data, group=group)
    r = barrier(_copy(a), a.state_dict(), b.state_dict(), data, num_points=3, bn_data=data, group=group)
    out["barrier"] = (r.loss, r.accuracy, r.num_samples)
    c = evaluate_curve(BezierCurve(_copy(a), a.state_dict(), b.state_dict()), {"x": data}, num_points=3,
                       bn_data=data, group=group)["x"]  # fmt: skip
    out["curve"] = (c.loss, c.accuracy, c.num_samples)
    return out


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _rank(rank, world, shares):
    return _methods(_net(0), _net(1), shares[rank], dist.group.WORLD)


def test_data_over_ranks_equal_one_process(tmp_path):
    shares = _shares()
    one = _methods(_net(0), _net(1), shares[0] + shares[1], None)
    for got in values(run_ranks(_rank, 2, tmp_path, shares, deadline=90)):
        for g, p in one["perms"].items():
            assert torch.equal(got["perms"][g], p), g
        for k, v in one["bn"].items():
            assert torch.allclose(got["bn"][k], v, rtol=1e-5, atol=1e-6), k
        assert int(got["bn"]["1.num_batches_tracked"]) == 5
        for k, v in one["repair"].items():
            assert torch.allclose(got["repair"][k], v, rtol=1e-4, atol=1e-5), k
        for what in ("barrier", "curve"):
            (loss, acc, n), (loss1, acc1, n1) = got[what], one[what]
            assert n == n1 == 32
            assert loss == pytest.approx(loss1, rel=1e-5)
            assert acc == pytest.approx(acc1, abs=1e-12)


def _fail(rank, world, shares):
    from pyperm.distributed import RankFailedError

    data = shares[rank] if rank == 0 else []  # rank 1 has no batches: ValueError there
    try:
        reset_bn_stats(_net(0), [] if rank == 1 else data, group=dist.group.WORLD)
    except RankFailedError as exc:
        return f"RankFailedError: {exc}"
    return "no error"


def test_a_failing_rank_ends_the_others(tmp_path):
    out = run_ranks(_fail, 2, tmp_path, _shares(), deadline=60)
    assert out[0] == ("ok", out[0][1]) and "failed on rank(s) [1]" in out[0][1], out[0]
    assert out[1][0] == "error" and "yielded no batches" in out[1][1], out[1]


def test_bad_group():
    a, data = _net(0), _shares()[0]
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        reset_bn_stats(a, data, group="world")
    with pytest.raises(TypeError, match="group must be"):
        barrier(a, a.state_dict(), a.state_dict(), data, bn_data=data, group=1)
    unused = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a group object, but no process group initialised
    for call in (lambda: reset_bn_stats(a, data, group=unused),
                 lambda: activation_matching(a, _net(1), None, data, group=unused),
                 lambda: repair(a, None, a.state_dict(), a.state_dict(), data, group=unused),
                 lambda: evaluate_curve(BezierCurve(a, a.state_dict(), a.state_dict()), data, bn_data=data,
                                        group=unused)):  # fmt: skip
        with pytest.raises(ValueError, match="group was given but torch.distributed is not initialised"):
            call()
