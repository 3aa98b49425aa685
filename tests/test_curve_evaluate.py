"""evaluate_curve on several data sets: one BatchNorm recomputation per point for all of them.

The papers' tables report the training loss and the test accuracy along a curve; each point's
BatchNorm statistics are recomputed on the training data once and both are measured on that
network (as Garipov et al.'s eval_curve.py does), not recomputed per data set.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pyperm.nn import plot_paths, summary_table
from pyperm.nn.curves import BezierCurve, CurveResult, evaluate_curve
from pyperm.testing import one_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


class Counting:
    """A re-iterable list of batches that counts its passes."""

    def __init__(self, batches):
        self.batches, self.passes = batches, 0

    def __iter__(self):
        self.passes += 1
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = {k: torch.randn_like(v) if v.is_floating_point() else v.clone() for k, v in a.items()}
    b["1.running_var"] = b["1.running_var"].abs() + 0.5
    g = torch.Generator().manual_seed(2)

    def batches(n):
        return [(torch.rand(16, 1, 4, 4, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]

    return BezierCurve(model, a, b), batches(3), batches(2)


def test_one_batchnorm_pass_per_point_for_every_data_set():
    curve, train, test = problem()
    bn = Counting(train)
    both = evaluate_curve(curve, {"train": train, "test": test}, num_points=4, bn_data=bn)
    assert bn.passes == 4  # one per point, not one per point and data set
    assert list(both) == ["train", "test"] and all(isinstance(r, CurveResult) for r in both.values())
    for name, data in (("train", train), ("test", test)):
        alone = evaluate_curve(curve, data, num_points=4, bn_data=train)
        np.testing.assert_array_equal(both[name].loss, alone.loss)
        np.testing.assert_array_equal(both[name].accuracy, alone.accuracy)
        assert both[name].num_samples == alone.num_samples == 16 * len(data)
    # one data set as before: a CurveResult, not a mapping
    assert isinstance(evaluate_curve(curve, test, num_points=2, bn_data=train), CurveResult)
    # the mapping is what plot_paths and summary_table take
    assert summary_table(both).count("\n") == 3


def test_robust_accuracy_for_every_data_set(tmp_path):
    curve, train, test = problem()
    attack = {"eps": 0.1, "steps": 2, "step_size": 0.05}
    both = evaluate_curve(curve, {"train": train, "test": test}, num_points=2, bn_data=train, adversarial=attack)
    for name, data in (("train", train), ("test", test)):
        assert both[name].has_robust_accuracy
        alone = evaluate_curve(curve, data, num_points=2, bn_data=train, adversarial=attack)
        np.testing.assert_array_equal(both[name].robust_accuracy, alone.robust_accuracy)
        assert np.all(both[name].robust_accuracy <= both[name].accuracy + 1e-12)
    assert plot_paths(both, tmp_path / "both.png").stat().st_size > 1000


def test_bad_data_sets():
    curve, train, test = problem()
    with pytest.raises(ValueError, match="data must name at least one data set"):
        evaluate_curve(curve, {}, bn_data=train)
    with pytest.raises(TypeError, match="data must be keyed by data set names"):
        evaluate_curve(curve, {0: test}, bn_data=train)
    with pytest.raises(TypeError, match=r"data\['test'\] is read several times and must be re-iterable"):
        evaluate_curve(curve, {"train": train, "test": iter(test)}, bn_data=train)
    with pytest.raises(ValueError, match="bn_data"):
        evaluate_curve(curve, {"test": test})
