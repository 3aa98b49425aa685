"""Batches checked where they enter: a bare tensor is the model's single input or a clear refusal.

Before, ``CurveTrainer.step(x, y)`` with a bare tensor ``x`` split the batch row by row and
failed inside the model (``forward() takes 2 positional arguments but 129 were given``);
data given as a bare tensor or as one unwrapped batch ``(x, y)`` failed with messages that
did not say what was given. Every message here names the argument, what was given (a
tensor's shape) and what is expected.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from pyperm.nn import barrier
from pyperm.nn.curves import BezierCurve, CurveTrainer, evaluate_curve, loss_plane, train_curve
from pyperm.testing import one_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = {k: torch.randn_like(v) if v.is_floating_point() else v.clone() for k, v in a.items()}
    b["1.running_var"] = b["1.running_var"].abs() + 0.5
    x, y = torch.randn(129, 1, 4, 4), torch.randint(0, 3, (129,))
    return model, a, b, x, y


def test_step_takes_a_bare_tensor_as_the_single_input():
    model, a, b, x, y = problem()
    runs = []
    for inputs in (x, (x,), [x]):
        curve = BezierCurve(model, a, b).train()
        weighted, samples = CurveTrainer(curve, lr=0.1, seed=0).step(inputs, y)
        runs.append((float(weighted), [p.detach().clone() for p in curve.parameters()]))
        assert samples == 129
    for loss, bends in runs[1:]:
        assert loss == runs[0][0] and all(torch.equal(p, q) for p, q in zip(bends, runs[0][1]))


def test_step_refuses_what_is_not_a_batch():
    model, a, b, x, y = problem()
    trainer = CurveTrainer(BezierCurve(model, a, b), lr=0.1)
    with pytest.raises(TypeError, match=r"inputs must be the model's input tensor or a tuple of its positional input "
                                        r"tensors, got a list of 2 \(int, int\)"):
        trainer.step([1, 2], y)
    with pytest.raises(TypeError, match=r"inputs must be .* got a tuple of 0"):
        trainer.step((), y)
    with pytest.raises(TypeError, match=r"targets must be a tensor, got a list"):
        trainer.step(x, [0, 1])
    with pytest.raises(ValueError, match=r"same number of samples, got 129 inputs \(shape \(129, 1, 4, 4\)\) and 64 "
                                         r"targets"):
        trainer.step(x, y[:64])


def test_data_that_is_not_batches_says_what_it_is():
    model, a, b, x, y = problem()
    curve = BezierCurve(model, a, b)
    bare = r"data must be an iterable of batches \(a DataLoader, a list of batches\), got a tensor of shape " \
           r"\(129, 1, 4, 4\) and dtype torch.float32: a bare tensor would be read row by row; to pass one batch, " \
           r"wrap it in a list, \[\(x, y\)\]"
    one_batch = r"must be an iterable of batches, each a sequence \(inputs, targets, ...\).*; got a tuple of 2 " \
                r"\(a tensor of shape \(129, 1, 4, 4\).*a tensor of shape \(129,\).*\), which looks like one batch: " \
                r"wrap it in a list, \[\(inputs, targets\)\]"
    inputs_only = r"\[0\] must be a sequence \(inputs, targets, ...\).*; got a tensor of shape \(129, 1, 4, 4\) " \
                  r"and dtype torch.float32 \(a bare tensor is read as inputs without targets"
    calls = {
        "data": {
            "train_curve": lambda data: train_curve(curve, data, epochs=1, lr=0.1),
            "evaluate_curve": lambda data: evaluate_curve(curve, data, num_points=2, bn_data=[x]),
            "barrier": lambda data: barrier(model, a, b, data, num_points=2, bn_data=[x]),
            "loss_plane": lambda data: loss_plane(model, [a, b, {k: v * 2 for k, v in b.items()}], data, grid=2,
                                                  bn_data=[x]),
        },
        "data['test']": {
            "evaluate_curve": lambda data: evaluate_curve(curve, {"test": data}, num_points=2, bn_data=[x]),
        },
    }
    for name, entry_points in calls.items():
        escaped = re.escape(name)
        for call in entry_points.values():
            for data, message in ((x, escaped + " " + bare[len("data "):]), ((x, y), escaped + " " + one_batch),
                                  ([x], escaped + inputs_only)):
                with pytest.raises(TypeError, match=message):
                    call(data)


def test_batchnorm_data_of_bare_tensors():
    model, a, b, x, y = problem()
    curve = BezierCurve(model, a, b)
    # batches of inputs alone are what BatchNorm statistics need: a list of bare tensors is fine
    result = evaluate_curve(curve, [(x, y)], num_points=2, bn_data=[x[:64], x[64:]])
    assert result.ts.shape == (2,)
    barrier(model, a, b, [(x, y)], num_points=2, bn_data=[x])
    with pytest.raises(TypeError, match=r"bn_data must be an iterable of batches .* got a tensor of shape "
                                        r"\(129, 1, 4, 4\).*wrap it in a list, \[x\]"):
        evaluate_curve(curve, [(x, y)], num_points=2, bn_data=x)
    with pytest.raises(TypeError, match=r"bn_data must be an iterable of batches .* got a tensor of shape"):
        barrier(model, a, b, [(x, y)], num_points=2, bn_data=x)
    with pytest.raises(TypeError, match=r"bn_data\[0\] must be a tensor of inputs or a sequence .* got a str"):
        barrier(model, a, b, [(x, y)], num_points=2, bn_data=["images"])
    with pytest.raises(TypeError, match="bn_data is read several times and must be re-iterable"):
        evaluate_curve(curve, [(x, y)], num_points=2, bn_data=iter([x]))
