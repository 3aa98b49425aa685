"""The distributed paths with the tensors on CUDA devices: NCCL with one rank per device, and gloo
with ranks sharing one device (NCCL refuses two ranks on one GPU). Weight matching over ranks
gives the permutations of one process on the device; the data methods over ranks give what one
process gives on all the batches. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks, values
from test_distributed_data import _methods, _net, _shares
from test_distributed_weight import _llama, _mlp, _share

import pyperm
import pyperm.distributed as pd
from pyperm.nn import weight_matching

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not pyperm.cuda_available() or not dist.is_available(),
                       reason="needs a CUDA device, pyperm's CUDA build and torch.distributed"),  # fmt: skip
]

# (backend, ranks): NCCL gets one rank per device; gloo runs two ranks on the first device.
SETUPS = [("nccl", max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1), ("gloo", 2)]


def _device(backend: str, rank: int) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device() if backend == "nccl" else 0)


def _on(state: dict, device) -> dict:
    return {k: v.to(device) for k, v in state.items()}


def _match(rank, world, problems, backend):
    dev = _device(backend, rank)
    out = {}
    for name, (spec, a, b) in problems.items():
        mine = _share(list(spec.axes), rank, world, "ranges")
        r = pd.weight_matching(spec, _on({k: a[k] for k in mine}, dev), _on({k: b[k] for k in mine}, dev), seed=3)
        out[name] = ({g: p.cpu() for g, p in r.perms.items()}, r.objective, r.bytes_per_sweep)
    return out


@pytest.mark.parametrize(("backend", "world"), SETUPS)
def test_weight_matching_over_ranks_on_the_device(tmp_path, backend, world):
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("torch was built without NCCL")
    problems = {"mlp": _mlp(), "llama": _llama()}
    results = values(run_ranks(_match, world, tmp_path, problems, backend, backend=backend, deadline=180))
    for name, (spec, a, b) in problems.items():
        one = weight_matching(spec, _on(a, "cuda"), _on(b, "cuda"), seed=3, init="identity")
        for rank_result in results:
            perms, objective, _ = rank_result[name]
            for g in spec.sizes:
                assert torch.equal(perms[g], one.perms[g].cpu()), (backend, name, g)
            assert objective == pytest.approx(one.objective, rel=1e-5), (backend, name)


def _data_rank(rank, world, shares, backend):
    dev = _device(backend, rank)
    mine = [(x.to(dev), y.to(dev)) for x, y in shares[rank % len(shares)]]
    got = _methods(_net(0).to(dev), _net(1).to(dev), mine, dist.group.WORLD)
    return {k: ({n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in got.items()}


@pytest.mark.parametrize(("backend", "world"), SETUPS)
def test_data_methods_over_ranks_on_the_device(tmp_path, backend, world):
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("torch was built without NCCL")
    shares = _shares()
    if world == 1:
        shares = [shares[0] + shares[1]]
    one = _methods(_net(0).cuda(), _net(1).cuda(), [(x.cuda(), y.cuda()) for x, y in _shares()[0] + _shares()[1]],
                   None)  # fmt: skip
    for got in values(run_ranks(_data_rank, world, tmp_path, shares, backend, backend=backend, deadline=180)):
        for g, p in one["perms"].items():
            assert torch.equal(got["perms"][g], p.cpu()), (backend, g)
        for k, v in one["bn"].items():
            assert torch.allclose(got["bn"][k], v.cpu(), rtol=1e-5, atol=1e-6), (backend, k)
        for k, v in one["repair"].items():
            assert torch.allclose(got["repair"][k], v.cpu(), rtol=1e-4, atol=1e-5), (backend, k)
        for what in ("barrier", "curve"):
            for x, y in zip(got[what], one[what]):
                assert x == pytest.approx(y, rel=1e-5, abs=1e-6), (backend, what)
