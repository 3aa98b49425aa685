"""Weighted merges: ``merge_many(..., weights=...)`` and ``pyperm merge --weights``.

A weight is each aligned model's share of the merge: the merged state is the weighted sum of the models permuted
by the permutations MergeMany found (with two models they do not depend on the weights).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from pyperm.checkpoints import load_checkpoint
from pyperm.cli import main
from pyperm.nn import average, merge_many
from pyperm.nn.models import MLP

WIDTHS = [6, 10, 10, 3]


def _states(count: int) -> list[dict]:
    states = []
    for seed in range(count):
        torch.manual_seed(seed)
        states.append(MLP(WIDTHS).state_dict())
    return states


def _spec():
    return MLP(WIDTHS).permutation_spec()


def test_two_models_weighted_are_the_weighted_sum_of_the_aligned_models():
    spec, states = _spec(), _states(2)
    plain = merge_many(spec, states)
    weighted = merge_many(spec, states, weights=[0.7, 0.3])
    assert weighted.perms == plain.perms  # the weights change the mix, not the alignment of two models
    aligned = [p.apply(s) for p, s in zip(weighted.perms, states)]
    for key, value in weighted.merged.items():
        torch.testing.assert_close(value, 0.7 * aligned[0][key] + 0.3 * aligned[1][key])


def test_equal_weights_are_the_default():
    spec, states = _spec(), _states(3)
    plain = merge_many(spec, states, seed=4)
    equal = merge_many(spec, states, weights=[1 / 3] * 3, seed=4)
    assert equal.perms == plain.perms and equal.history == plain.history
    for key, value in plain.merged.items():
        torch.testing.assert_close(equal.merged[key], value)


def test_three_models_are_matched_to_the_weighted_mean_of_the_others():
    """The merge is the weighted sum of the aligned models, and at convergence no model moves when matched to the
    weighted mean of the others."""
    from pyperm.nn import weight_matching

    spec, states = _spec(), _states(3)
    weights = [0.5, 0.3, 0.2]
    result = merge_many(spec, states, weights=weights, seed=1)
    assert result.converged
    aligned = [p.apply(s) for p, s in zip(result.perms, states)]
    for key, value in average(aligned, weights).items():
        torch.testing.assert_close(result.merged[key], value)
    for i in range(3):
        rest = [j for j in range(3) if j != i]
        others = average([aligned[j] for j in rest], [weights[j] for j in rest])
        assert weight_matching(spec, others, aligned[i]).perms.is_identity()


@pytest.mark.parametrize(("weights", "error", "match"), [
    ([0.5, 0.5, 0.0], ValueError, r"weights\[2\] must be a finite positive number"),
    ([1.2, -0.2], ValueError, r"weights\[1\] must be a finite positive number"),
    ([0.5, math.nan], ValueError, r"weights\[1\] must be a finite positive number"),
    ([0.5, 0.4], ValueError, r"weights must sum to 1 \(within 1e-6\)"),
    ([0.2, 0.3, 0.5], ValueError, "one weight per model: got 3 weights for 2 models"),
    ("0.5,0.5", TypeError, "weights must be a sequence of real numbers"),
    ([0.5, "0.5"], TypeError, r"weights\[1\] must be a real number"),
])  # fmt: skip
def test_bad_weights_are_refused(weights, error, match):
    with pytest.raises(error, match=match):
        merge_many(_spec(), _states(2), weights=weights)


def test_merge_command_with_weights(tmp_path, capsys):
    paths = []
    for i, state in enumerate(_states(2)):
        paths.append(tmp_path / f"m{i}.pt")
        torch.save(state, paths[-1])
    model = "mlp:" + ",".join(map(str, WIDTHS))
    out = tmp_path / "out"
    base = ["merge", *map(str, paths), "--model", model, "--no-progress"]
    assert main([*base, "--weights", "0.7,0.3", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["weights"] == [0.7, 0.3] and "weights (each aligned model's share" in (out / "report.md").read_text()
    merged = load_checkpoint(out / "merged.pt").state
    want = merge_many(_spec(), _states(2), weights=[0.7, 0.3]).merged
    for key, value in want.items():
        torch.testing.assert_close(merged[key], value)
    assert main([*base, "--out", str(tmp_path / "plain")]) == 0
    assert json.loads((tmp_path / "plain" / "report.json").read_text())["weights"] == [0.5, 0.5]
    capsys.readouterr()
    assert main([*base, "--weights", "0.6,0.3", "--out", str(tmp_path / "bad")]) != 0
    assert "--weights must sum to 1" in capsys.readouterr().err
    assert main([*base, "--weights", "0.2,0.3,0.5", "--out", str(tmp_path / "bad")]) != 0
    assert "--weights must hold one weight per model: got 3 weights for 2 models" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--weights", "0.7,-0.3", "--out", str(tmp_path / "bad")])
    assert "argument --weights: expected comma-separated finite positive numbers" in capsys.readouterr().err


@pytest.mark.parametrize("weights", [None, [0.7, 0.3]])
def test_two_models_are_each_matched_to_the_other_exactly_as_to_the_weighted_mean_of_the_others(monkeypatch, weights):
    """With two models no running float64 sum is kept: each one's target is the other model as permuted now.
    It is the same tensor, entry for entry, as the weighted mean of the others made from the float64 sum."""
    from pyperm.nn.align._matcher import WeightMatcher

    states = _states(2)
    key = next(iter(states[0]))
    w = [1.0, 1.0] if weights is None else weights
    targets = []
    real = WeightMatcher.match

    def match(self, state_a, **options):
        i = 0 if self.state_b[key].data_ptr() == states[0][key].data_ptr() else 1  # the model matched (B)
        targets.append((i, {k: v.clone() for k, v in state_a.items()}))
        return real(self, state_a, **options)

    monkeypatch.setattr(WeightMatcher, "match", match)
    merge_many(_spec(), states, weights=weights, seed=2)
    i, target = targets[0]  # the first matching: neither model permuted yet
    total = {k: w[0] * states[0][k].double() + w[1] * states[1][k].double() for k in target}
    want = {k: ((total[k] - w[i] * states[i][k].double()) / w[1 - i]).float() for k in target}
    assert all(torch.equal(target[k], want[k]) for k in target)


def test_no_matcher_keeps_an_earlier_matchings_target_alive(monkeypatch):
    """MergeMany gives each matching a new target (the mean of the others, a whole model's worth of tensors); the
    matchers let go of it when the matching ends, so the targets of earlier matchings are not kept alive, one
    model per matcher, until that matcher's next matching."""
    from pyperm.nn.align._matcher import WeightMatcher

    matchers: set = set()
    checked = []
    real = WeightMatcher.match

    def holds_a(m) -> bool:
        terms = [t for g in (m._groups or {}).values() for t in g.all_terms]
        return bool(m._state_a) or any(t.a is not None and t.order is None for t in terms)

    def match(self, state_a, **options):
        checked.append([holds_a(m) for m in matchers if m is not self])
        matchers.add(self)
        return real(self, state_a, **options)

    monkeypatch.setattr(WeightMatcher, "match", match)
    merge_many(_spec(), _states(3), seed=1)
    assert sum(map(len, checked)) >= 4 and not any(any(c) for c in checked)


def test_a_stalled_first_matching_is_restarted_from_the_signatures():
    """Each model's first matching runs from the identity (Algorithm 3) and, as weight_matching's default, looks
    for a stall: a planted copy of MobileNetV2 plus noise, on which the identity start alone stalls, is merged
    back into the first model's units."""
    from _planted import planted_mobilenet_v2

    spec, a, b, planted = planted_mobilenet_v2(torch.Generator().manual_seed(1))
    result = merge_many(spec, [a, b], seed=3)
    assert result.perms[1] == planted.inverse()
