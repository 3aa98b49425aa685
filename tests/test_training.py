"""pyperm.nn._training.train_classifier: the one seeded training loop of the tests, benchmarks and reproductions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyperm.nn._training import init_weights, train_classifier
from pyperm.nn.models import MLP
from pyperm.testing import one_thread


def _data(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # three separable classes
    return x, y


def _batches(x, y, size=16):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(y), size)]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_seeded_and_learns(optimizer):
    x, y = _data()
    lr = 1e-2 if optimizer == "adam" else 0.1
    with one_thread():
        first = train_classifier(MLP([6, 16, 3]), _batches(x, y), epochs=20, lr=lr, seed=3, optimizer=optimizer)
        again = train_classifier(MLP([6, 16, 3]), _batches(x, y), epochs=20, lr=lr, seed=3, optimizer=optimizer)
        other = train_classifier(MLP([6, 16, 3]), _batches(x, y), epochs=20, lr=lr, seed=4, optimizer=optimizer)
    assert _same(first, again) and not _same(first, other)
    model = MLP([6, 16, 3])
    model.load_state_dict(first)
    with torch.no_grad():
        assert (model(x).argmax(1) == y).float().mean() > 0.9


def test_the_model_state_does_not_matter():
    """The seed decides the initialisation: training a used model gives what a fresh one gives."""
    x, y = _data()
    used = MLP([6, 8, 3])
    train_classifier(used, (x, y), batch_size=32, epochs=2, lr=0.1, seed=1, optimizer="sgd")
    assert _same(train_classifier(used, (x, y), batch_size=32, epochs=2, lr=0.1, seed=7, optimizer="sgd"),
                 train_classifier(MLP([6, 8, 3]), (x, y), batch_size=32, epochs=2, lr=0.1, seed=7, optimizer="sgd"))
    assert not used.training  # left in eval mode


def _bn_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))  # fmt: skip


def test_every_layer_is_fresh_batchnorm_included():
    """Two endpoints trained in one object are as independent as two new models (issue 34, item 11):
    BatchNorm's affine parameters and running statistics, and LayerNorm's, start fresh from the seed too."""
    x, y = _data()
    used = _bn_net()
    first = train_classifier(used, (x, y), batch_size=32, epochs=2, lr=0.1, seed=1, optimizer="sgd")
    assert float(first["1.running_mean"].abs().sum()) > 0 and int(first["1.num_batches_tracked"]) > 0
    again = train_classifier(used, (x, y), batch_size=32, epochs=2, lr=0.1, seed=7, optimizer="sgd")
    fresh = train_classifier(_bn_net(), (x, y), batch_size=32, epochs=2, lr=0.1, seed=7, optimizer="sgd")
    assert _same(again, fresh)
    assert int(again["1.num_batches_tracked"]) == int(first["1.num_batches_tracked"])  # counted from zero again


def test_on_epoch_sees_every_epoch():
    x, y = _data()
    seen = []
    train_classifier(MLP([6, 4, 3]), (x, y), batch_size=32, epochs=3, lr=0.1, seed=0,
                     on_epoch=lambda done, model: seen.append((done, model.training)))  # fmt: skip
    assert seen == [(1, True), (2, True), (3, True)]
    with pytest.raises(TypeError, match="on_epoch"):
        train_classifier(MLP([6, 4, 3]), (x, y), batch_size=32, epochs=1, lr=0.1, seed=0, on_epoch=3)


def test_adam_is_torch_adam():
    """The written-out Adam takes torch.optim.Adam's steps (without importing torch._dynamo)."""
    x, y = _data()
    batches = _batches(x, y)
    reference = MLP([6, 16, 3])
    init_weights(reference, torch.Generator().manual_seed(5))
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(3):
        for xb, yb in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(reference(xb), yb).backward()
            opt.step()
    ours = train_classifier(MLP([6, 16, 3]), batches, epochs=3, lr=1e-2, seed=5, weight_decay=1e-3)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=1e-6, atol=1e-7)


def test_sgd_momentum_and_cosine_schedule():
    """SGD with heavy-ball momentum as torch.optim.SGD, the step decayed along half a cosine."""
    x, y = _data()
    batches = _batches(x, y, 32)
    reference = MLP([6, 8, 3])
    init_weights(reference, torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    total = 2 * len(batches)
    for step in range(total):
        for group in opt.param_groups:
            group["lr"] = 0.1 * 0.5 * (1 + np.cos(np.pi * step / total))
        xb, yb = batches[step % len(batches)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(xb), yb).backward()
        opt.step()
    ours = train_classifier(MLP([6, 8, 3]), batches, epochs=2, lr=0.1, seed=2, optimizer="sgd", schedule="cosine")
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6)


def test_shuffled_batches_are_a_new_seeded_order_every_epoch():
    x, y = _data()
    seen = []

    def record(model, inputs, targets, step):
        seen.append(targets.clone())
        return inputs

    train_classifier(MLP([6, 4, 3]), (x, y), batch_size=48, epochs=2, lr=0.1, seed=0, perturb=record)
    assert len(seen) == 4 and all(len(t) == 48 for t in seen)
    first, second = torch.cat(seen[:2]), torch.cat(seen[2:])
    assert sorted(first.tolist()) == sorted(y.tolist()) and not torch.equal(first, second)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"epochs": 0}, ValueError, "epochs must be at least 1"),
        ({"lr": -1.0}, ValueError, "lr must be a finite positive"),
        ({"seed": -1}, ValueError, "seed must be at least 0"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"optimizer": "rmsprop"}, ValueError, "optimizer must be one of 'adam', 'sgd'"),
        ({"schedule": "step"}, ValueError, "schedule must be one of"),
        ({"momentum": -0.1}, ValueError, "momentum must be finite and non-negative"),
        ({"loss_fn": "ce"}, TypeError, "loss_fn must be a callable"),
        ({"batch_size": 0}, ValueError, "batch_size must be at least 1"),
        ({"batches": iter([])}, TypeError, "batches is read several times"),
        ({"batches": torch.zeros(3, 6)}, TypeError, "batches must be an iterable of batches"),
        ({"batches": [(torch.zeros(2, 6), torch.zeros(2).long())], "batch_size": 2}, TypeError,
         r"with batch_size, batches must be the pair \(inputs, targets\)"),
        ({"batches": (torch.zeros(3, 6), torch.zeros(2).long()), "batch_size": 2}, ValueError,
         "3 inputs but 2 targets"),
    ],
)  # fmt: skip
def test_bad_arguments_name_themselves(kwargs, exc, match):
    x, y = _data(8)
    args = {"batches": _batches(x, y), "epochs": 1, "lr": 0.1, "seed": 0, **kwargs}
    with pytest.raises(exc, match=match):
        train_classifier(MLP([6, 4, 3]), **args)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        train_classifier("mlp", _batches(x, y), epochs=1, lr=0.1, seed=0)


def test_cosine_needs_the_length_of_an_epoch():
    class Stream:  # re-iterable, but with no len()
        def __init__(self, batches):
            self.batches = batches

        def __iter__(self):
            return iter(self.batches)

    x, y = _data(32)
    model = MLP([6, 4, 3])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="schedule='cosine' needs batches with a length"):
        train_classifier(model, Stream(_batches(x, y)), epochs=1, lr=0.1, seed=0, schedule="cosine")
    assert _same(model.state_dict(), before)  # refused before touching the model
    assert train_classifier(model, Stream(_batches(x, y)), epochs=1, lr=0.1, seed=0).keys() == before.keys()
