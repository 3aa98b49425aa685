"""pytest-benchmark timings of STE matching (run: pytest bench/test_bench_ste.py).

The case first checks what STE matching guarantees (valid permutations; the answer's
midpoint loss on the judging batches is at most the start's, weight matching's), then
times a run over ``1 + judge_every`` batches of the digits MLP 64-512-512-512-10.
``pyperm bench ste`` prints the cost per step against its floor (a plain training step
plus one sweep of similarity products) and checks the target, at most 1.5 times the floor.
"""

from __future__ import annotations

import pytest
import torch

from pyperm.benchmarks.ste import _judge_every, _setup
from pyperm.nn import ste_matching

pytest.importorskip("pytest_benchmark")


def test_bench_ste_digits_mlp512(benchmark):
    model, sa, sb, batches = _setup("digits-mlp512", 64, 1 + _judge_every())
    spec = model.permutation_spec()
    result = ste_matching(model, spec, sa, sb, batches)
    for g, n in spec.sizes.items():
        assert torch.equal(torch.sort(result.perms[g]).values, torch.arange(n))
    assert result.judged[result.best_step] <= result.judged[0]
    benchmark.extra_info["judged"] = len(result.judged)
    benchmark.extra_info["best_step"] = result.best_step
    benchmark.pedantic(ste_matching, args=(model, spec, sa, sb, batches), rounds=3, iterations=1)
