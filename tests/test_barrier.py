"""barrier and BarrierResult: Definition 2.2 along the linear path, state restored, BatchNorm, digits."""

import json
import math

import numpy as np
import pytest
import torch
from _digits import batches, digits, trained_pair
from torch import nn

from pyperm.nn.eval.barrier import barrier
from pyperm.nn.eval.batchnorm import reset_bn_stats
from pyperm.nn.eval.path import BarrierResult, PathResult, plot_paths
from pyperm.testing import one_thread


def _model(seed=0, batchnorm=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 12)] + ([nn.BatchNorm1d(12)] if batchnorm else []) + [nn.ReLU(), nn.Linear(12, 4)]
    return nn.Sequential(*layers)


def _random_state(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone())
        for k, v in model.state_dict().items()
    }


def _data(seed=0, sizes=(9, 20, 3)):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=gen), torch.randint(0, 4, (n,), generator=gen)) for n in sizes]


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [m.training for m in model.modules()]


def _assert_unchanged(model, snapshot):
    state, flags = snapshot
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == flags


def test_a_model_with_itself_has_no_barrier():
    model = _model()
    a = _random_state(model, 1)
    result = barrier(model, a, a, _data(), num_points=7)
    assert result.loss_barrier == pytest.approx(0.0, abs=1e-6)
    assert result.accuracy_barrier == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(result.loss, result.loss[0], rtol=1e-6)


def test_numbers_equal_a_hand_written_loop():
    model = _model()
    a, b = _random_state(model, 1), _random_state(model, 2)
    data = _data()
    ts = [0.0, 0.2, 0.5, 0.9, 1.0]
    result = barrier(model, a, b, data, ts=ts)
    # By hand: load each point, sum per-sample losses and hits over the unequal batches.
    losses, accs = [], []
    probe = _model(seed=5)
    for t in ts:
        probe.load_state_dict({k: (1 - t) * a[k] + t * b[k] for k in a})
        with torch.no_grad():
            out = [(probe(x), y) for x, y in data]
        n = sum(len(y) for _, y in out)
        losses.append(sum(nn.functional.cross_entropy(o, y, reduction="sum").item() for o, y in out) / n)
        accs.append(sum((o.argmax(1) == y).sum().item() for o, y in out) / n)
    losses, accs = np.array(losses), np.array(accs)
    np.testing.assert_allclose(result.ts, ts)
    np.testing.assert_allclose(result.loss, losses, rtol=1e-5)
    np.testing.assert_allclose(result.accuracy, accs)
    t = np.array(ts)
    assert result.loss_barrier == pytest.approx(np.max(losses - ((1 - t) * losses[0] + t * losses[-1])), rel=1e-5)
    assert result.accuracy_barrier == pytest.approx(np.max((1 - t) * accs[0] + t * accs[-1] - accs))
    assert result.num_samples == 32 and not result.bn_reset
    assert np.all((result.accuracy >= 0) & (result.accuracy <= 1))


def test_endpoint_sharing_the_models_memory():
    """The usual call, barrier(a, a.state_dict(), b_state), passes tensors that alias the
    model's own parameters: loading the points into the model must not move endpoint A."""
    model = _model()
    model.load_state_dict(_random_state(model, 1))
    b = _random_state(model, 2)
    data = _data()
    copied = barrier(model, {k: v.clone() for k, v in model.state_dict().items()}, b, data, num_points=6)
    aliased = barrier(model, model.state_dict(), b, data, num_points=6)
    np.testing.assert_allclose(aliased.loss, copied.loss, rtol=1e-6)
    np.testing.assert_allclose(aliased.accuracy, copied.accuracy)


def test_model_state_and_modes_are_restored_even_on_error():
    model = _model()
    model.train()
    model[1].eval()
    before = _snapshot(model)
    a, b = _random_state(model, 1), _random_state(model, 2)
    a_copy = {k: v.clone() for k, v in a.items()}
    barrier(model, a, b, _data(), num_points=3)
    _assert_unchanged(model, before)
    assert all(torch.equal(a[k], a_copy[k]) for k in a)

    calls = []

    def failing_loss(outputs, targets):
        calls.append(1)
        if len(calls) > 4:
            raise RuntimeError("boom")
        return nn.functional.cross_entropy(outputs, targets)

    with pytest.raises(RuntimeError, match="boom"):
        barrier(model, a, b, _data(), num_points=3, loss_fn=failing_loss)
    _assert_unchanged(model, before)


def test_batchnorm_model_needs_bn_data():
    model = _model(batchnorm=True)
    a, b = _random_state(model, 1), _random_state(model, 2)
    with pytest.raises(ValueError, match=r"BatchNorm layers \('1'\).*pass bn_data="):
        barrier(model, a, b, _data())
    # bn_data=False evaluates the interpolated running statistics knowingly.
    assert not barrier(model, a, b, _data(), num_points=2, bn_data=False).bn_reset
    with pytest.raises(TypeError, match="bn_data must be an iterable of batches, False or None, not True"):
        barrier(model, a, b, _data(), bn_data=True)
    with pytest.raises(TypeError, match="bn_data is read several times"):
        barrier(model, a, b, _data(), bn_data=iter(_data()))
    with pytest.raises(TypeError, match="unexpected keyword argument 'reset_bn'"):
        barrier(model, a, b, _data(), reset_bn=_data())


def test_batchnorm_reset_at_every_point_equals_a_hand_written_loop():
    model = _model(batchnorm=True)
    a, b = _random_state(model, 1), _random_state(model, 2)
    a["1.running_var"], b["1.running_var"] = a["1.running_var"].abs(), b["1.running_var"].abs()
    data, train = _data(0), [x for x, _ in _data(1, sizes=(16, 5, 11))]
    before = _snapshot(model)
    result = barrier(model, a, b, data, ts=[0.0, 0.5, 1.0], bn_data=train)
    _assert_unchanged(model, before)
    probe = _model(seed=5, batchnorm=True)
    for k, t in enumerate([0.0, 0.5, 1.0]):
        probe.load_state_dict(
            {key: (1 - t) * a[key] + t * b[key] if a[key].is_floating_point() else a[key] for key in a}
        )
        reset_bn_stats(probe, train)
        probe.eval()
        with torch.no_grad():
            loss = sum(nn.functional.cross_entropy(probe(x), y, reduction="sum").item() for x, y in data) / 32
        assert result.loss[k] == pytest.approx(loss, rel=1e-5)
    assert result.bn_reset


def _product_model():
    """x -> w2 * w1 * x: a path from (w1, w2) to (-w1, -w2) passes through the zero network."""
    return nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))


def test_barrier_is_the_largest_rise_above_the_chord_of_unequal_endpoints():
    """A case small enough to write out: the loss along the path is a polynomial in t."""
    model = _product_model()
    a = {"0.weight": torch.tensor([[1.0]]), "1.weight": torch.tensor([[1.0]])}
    b = {"0.weight": torch.tensor([[-1.0]]), "1.weight": torch.tensor([[-2.0]])}
    data = [(torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [2.0]]))]
    ts = [0.0, 0.25, 0.5, 0.75, 1.0]
    result = barrier(model, a, b, data, ts=ts, loss_fn=nn.functional.mse_loss)
    # f(x; t) = (1 - 2t)(1 - 3t) x, so the loss is ((1 - 2t)(1 - 3t) - 1)^2 * mean(x^2), mean(x^2) = 2.5.
    t = np.array(ts)
    loss = ((1 - 2 * t) * (1 - 3 * t) - 1) ** 2 * 2.5
    np.testing.assert_allclose(result.loss, loss, rtol=1e-6)
    rise = loss - ((1 - t) * loss[0] + t * loss[-1])  # L(0) = 0, L(1) = 2.5: the chord is 2.5 t
    assert result.loss_barrier == pytest.approx(rise.max(), rel=1e-6)
    # Written out at t = 0.25: L = 2.5 (0.5 * 0.25 - 1)^2 = 1.9140625, the chord 0.625. The midpoint's
    # rise, 2.5 - 1.25, is smaller: the barrier is the largest rise over the points, not the midpoint's.
    assert result.loss_barrier == pytest.approx(1.2890625, rel=1e-6)
    assert result.loss_barrier_t == 0.25


def test_regression_targets_give_nan_accuracy():
    model = _model()
    a, b = _random_state(model, 1), _random_state(model, 2)
    data = [(x, torch.randn(len(x), 4)) for x, _ in _data()]
    result = barrier(model, a, b, data, num_points=3, loss_fn=nn.functional.mse_loss)
    assert result.accuracy.shape == (3,) and np.isnan(result.accuracy).all()
    assert math.isnan(result.accuracy_barrier) and not result.has_accuracy
    assert np.isfinite(result.loss).all()


def test_rendering_and_plot(tmp_path):
    model = _model()
    result = barrier(model, _random_state(model, 1), _random_state(model, 2), _data(), num_points=5)
    assert isinstance(result, PathResult)
    as_dict = json.loads(json.dumps(result.to_dict()))
    assert as_dict["loss"] == pytest.approx(result.loss.tolist())
    assert as_dict["loss_barrier"] == pytest.approx(result.loss_barrier)
    assert as_dict["bn_reset"] is False and as_dict["num_samples"] == 32
    assert set(as_dict) >= {"ts", "loss", "accuracy", "loss_barrier", "accuracy_barrier", "loss_barrier_t"}
    text = result.to_markdown()
    assert text.startswith("| t | loss | accuracy (%) |") and text.count("\n| ") == 5
    assert f"loss barrier: {result.loss_barrier:.4f}" in text and str(result) == text
    assert f"accuracy barrier: {100 * result.accuracy_barrier:.2f} pp" in text
    path = result.plot(tmp_path / "path.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError, match="path must be"):
        result.plot(3)
    other = barrier(model, _random_state(model, 1), _random_state(model, 1), _data(), num_points=3)
    both = plot_paths({"random": result, "same": other}, tmp_path / "both.png", title="two paths")
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar(capsys):
    model = _model()
    a = _random_state(model, 1)
    barrier(model, a, a, _data(), num_points=3, progress=True)
    assert "barrier" in capsys.readouterr().err


def test_evaluation_device(device):
    model = _model()
    a, b = _random_state(model, 1), _random_state(model, 2)
    here = barrier(model, a, b, _data(), num_points=3)
    there = barrier(model, a, b, _data(), num_points=3, device=device)
    np.testing.assert_allclose(there.loss, here.loss, rtol=1e-4)
    assert next(model.parameters()).device.type == "cpu"


def test_result_is_a_barrier_result():
    model = _model()
    assert isinstance(
        barrier(model, _random_state(model, 1), _random_state(model, 2), _data(), num_points=2), BarrierResult
    )


def test_bad_arguments():
    model = _model()
    a, b = _random_state(model, 1), _random_state(model, 2)
    data = _data()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        barrier(None, a, b, data)
    with pytest.raises(ValueError, match="'0.bias' is only in state_a"):
        barrier(model, a, {k: v for k, v in b.items() if k != "0.bias"}, data)
    with pytest.raises(ValueError, match=r"differ in '2.weight': shapes"):
        wrong = {k: v.clone() for k, v in a.items()}
        wrong["2.weight"] = torch.zeros(4, 13)
        barrier(model, wrong, {**b, "2.weight": torch.zeros(4, 13)}, data)
    with pytest.raises(TypeError, match="data is read several times"):
        barrier(model, a, b, iter(data))
    with pytest.raises(TypeError, match="data must be an iterable"):
        barrier(model, a, b, torch.zeros(3))
    with pytest.raises(ValueError, match="data yielded no batches"):
        barrier(model, a, b, [])
    with pytest.raises(TypeError, match=r"data\[0\] must be a sequence \(inputs, targets"):
        barrier(model, a, b, [torch.randn(3, 6)])
    with pytest.raises(ValueError, match="num_points must be at least 2"):
        barrier(model, a, b, data, num_points=1)
    with pytest.raises(TypeError, match="num_points must be an int"):
        barrier(model, a, b, data, num_points=2.0)
    with pytest.raises(ValueError, match="ts must start at 0 and end at 1"):
        barrier(model, a, b, data, ts=[0.1, 1.0])
    with pytest.raises(ValueError, match="ts must be strictly increasing"):
        barrier(model, a, b, data, ts=[0.0, 0.5, 0.5, 1.0])
    with pytest.raises(TypeError, match=r"ts\[1\] must be a real number"):
        barrier(model, a, b, data, ts=[0.0, "a", 1.0])
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        barrier(model, a, b, data, loss_fn="ce")
    with pytest.raises(ValueError, match="loss_fn must return the batch's mean loss"):
        barrier(model, a, b, data, loss_fn=lambda o, y: nn.functional.cross_entropy(o, y, reduction="none"))
    with pytest.raises(ValueError, match=r"ts\[0\] must lie in \[0, 1\]"):
        barrier(model, a, b, data, ts=[-0.5, 0.0, 1.0])
    with pytest.raises(TypeError, match="progress must be a bool"):
        barrier(model, a, b, data, progress=1)
    with pytest.raises(TypeError, match="takes 4 positional arguments"):
        barrier(model, a, b, data, 5)


@pytest.fixture(scope="module")
def digits_pair():
    return trained_pair()


def test_weight_matching_cuts_the_digits_barrier_fivefold(digits_pair):
    model, a, b, b_matched = digits_pair
    x, y, _, _ = digits()
    train = batches(x, y, 350)
    with one_thread():
        naive = barrier(model, a, b, train, num_points=5)
        matched = barrier(model, a, b_matched, train, num_points=5)
    assert naive.loss_barrier > 0.2
    assert matched.loss_barrier < naive.loss_barrier / 5
    assert matched.accuracy_barrier < naive.accuracy_barrier
