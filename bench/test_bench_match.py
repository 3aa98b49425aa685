"""pytest-benchmark timings of weight matching (run: pytest bench/test_bench_match.py).

Each case first checks pyperm against the plain reference implementation (same seeded
visiting order: same permutations, hence the same objective), then times pyperm alone.
``pyperm bench match`` prints the same cases with the reference's times and the ratios.
"""

from __future__ import annotations

import pytest
import torch

from pyperm.benchmarks.match import build_model
from pyperm.testing import random_permutations, reference_weight_matching
from pyperm.nn import apply_permutation, matching_objective, weight_matching
from pyperm.nn.models import ResNet20

pytest.importorskip("pytest_benchmark")


def _pair(name: str):
    a, b = build_model(name, 1), build_model(name, 2)
    return a.permutation_spec(), a.state_dict(), b.state_dict()


@pytest.mark.parametrize("name", ["mlp512", "vgg16", "resnet20x16", "mlp2048"])
def test_bench_weight_matching(benchmark, name):
    spec, sa, sb = _pair(name)
    # The identity start: Algorithm 1 as the reference and the other libraries run it.
    result = weight_matching(spec, sa, sb, seed=0, init="identity")
    if name == "mlp512":  # the reference is minutes for the others: checked there by `pyperm bench match`
        ref, sweeps = reference_weight_matching(spec, sa, sb, seed=0)
        assert result.iterations == sweeps
        assert matching_objective(spec, sa, sb, result.perms) >= matching_objective(spec, sa, sb, ref) - 1e-9
    benchmark.extra_info["iterations"] = result.iterations
    benchmark.extra_info["objective"] = result.objective[-1]
    benchmark.pedantic(weight_matching, args=(spec, sa, sb), kwargs={"seed": 0, "init": "identity"}, rounds=3,
                       iterations=1)


def test_bench_planted_resnet20x4(benchmark):
    """Recovering a planted permutation (converges in a few sweeps)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = ResNet20(width_multiplier=4)
    spec = model.permutation_spec()
    sa = model.state_dict()
    g = torch.Generator().manual_seed(1)
    planted = random_permutations(spec, g)
    sb = {
        k: (v + 0.01 * v.std() * torch.randn(v.shape, generator=g)) if v.is_floating_point() and v.numel() > 1 else v
        for k, v in apply_permutation(spec, planted, sa).items()
    }
    result = weight_matching(spec, sa, sb)
    assert all(torch.equal(result.perms[k], torch.argsort(planted[k])) for k in spec.sizes)
    benchmark.pedantic(weight_matching, args=(spec, sa, sb), rounds=3, iterations=1)


@pytest.mark.parametrize("name", ["alexnet", "resnet20x16-tiled"])
def test_bench_structured_weight_matching(benchmark, name):
    """The structured spec of a pair (AlexNet: its flattened classifier input permuted too; ResNet20 x16: every
    axis written as Tiled(g), the same groups): ``pyperm bench match --structured`` sets it against the flat one."""
    from pyperm.benchmarks._match_structured import pair

    try:
        model, sb, flat, structured = pair(name, (1, 2))
    except ModuleNotFoundError:
        pytest.skip("torchvision is not installed")
    del flat  # timed by `pyperm bench match --structured`, beside this spec
    sa = model.state_dict()
    result = weight_matching(structured, sa, sb, seed=0, init="identity")
    assert result.objective == sorted(result.objective)
    assert result.objective[-1] == pytest.approx(matching_objective(structured, sa, sb, result.perms), rel=1e-5)
    benchmark.extra_info["iterations"] = result.iterations
    benchmark.pedantic(weight_matching, args=(structured, sa, sb), kwargs={"seed": 0, "init": "identity"}, rounds=3,
                       iterations=1)


@pytest.mark.parametrize("name", ["mlp512", "mlp2048"])
def test_bench_default_start(benchmark, name):
    """The default start on unrelated models: the identity start's answer, and a look at it (a few percent)."""
    spec, sa, sb = _pair(name)
    identity = weight_matching(spec, sa, sb, seed=0, init="identity")
    default = weight_matching(spec, sa, sb, seed=0)
    assert default.perms == identity.perms
    benchmark.pedantic(weight_matching, args=(spec, sa, sb), kwargs={"seed": 0}, rounds=3, iterations=1)
