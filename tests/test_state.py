"""State-dict operations: pair checks, interpolate, average."""

import pytest
import torch
from torch import nn

from pyperm.nn.state import average, interpolate
from pyperm.nn._checks import check_pair


def _states():
    gen = torch.Generator().manual_seed(0)
    a = {
        "w": torch.randn(3, 4, generator=gen),
        "b": torch.randn(3, generator=gen, dtype=torch.float64),
        "n": torch.tensor(7),
        "mask": torch.tensor([True, False]),
    }
    b = {
        "w": torch.randn(3, 4, generator=gen),
        "b": torch.randn(3, generator=gen, dtype=torch.float64),
        "n": torch.tensor(2),
        "mask": torch.tensor([False, False]),
    }
    return a, b


def _copy(state):
    return {k: v.clone() for k, v in state.items()}


def test_interpolate_is_the_line_with_exact_endpoints():
    a, b = _states()
    for t in (0.0, 0.3, 0.5, 1.0, 1.5, -0.25):
        out = interpolate(a, b, t)
        assert list(out) == list(a)
        for k in ("w", "b"):
            assert out[k].dtype == a[k].dtype
            torch.testing.assert_close(out[k], (1 - t) * a[k] + t * b[k])
        assert torch.equal(out["n"], a["n"]) and torch.equal(out["mask"], a["mask"])
    assert all(torch.equal(interpolate(a, b, 0)[k], a[k]) for k in a)
    assert torch.equal(interpolate(a, b, 1)["w"], b["w"])


def test_interpolate_leaves_inputs_alone_and_returns_new_tensors():
    a, b = _states()
    a0, b0 = _copy(a), _copy(b)
    out = interpolate(a, b, 0.0)
    for k in out:
        out[k].zero_() if out[k].dtype != torch.bool else out[k].fill_(False)
    assert all(torch.equal(a[k], a0[k]) and torch.equal(b[k], b0[k]) for k in a)


def test_interpolate_loads_into_a_batchnorm_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    a = _copy(model.state_dict())
    b = {k: (v + 1 if v.is_floating_point() else v + 5) for k, v in a.items()}
    model.load_state_dict(interpolate(a, b, 0.5))
    assert int(model[1].num_batches_tracked) == int(a["1.num_batches_tracked"])
    torch.testing.assert_close(model[0].bias.detach(), a["0.bias"] + 0.5)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b.pop("w"), "'w' is only in state_a"),
        (lambda b: b.update(extra=torch.zeros(1)), "'extra' is only in state_b"),
        (lambda b: b.update(w=torch.zeros(4, 3)), "differ in 'w': shapes"),
        (lambda b: b.update(w=torch.zeros(3, 4, dtype=torch.float64)), "differ in 'w': dtypes"),
    ],
)
def test_pair_mismatch_names_the_key(change, message):
    a, b = _states()
    change(b)
    with pytest.raises(ValueError, match=message):
        interpolate(a, b, 0.5)


def test_check_pair_without_strict_compares_keys_and_shapes_only():
    a, b = _states()
    b["w"] = b["w"].double()
    check_pair(a, b, strict=False)
    with pytest.raises(ValueError, match="dtypes"):
        check_pair(a, b)


def test_interpolate_bad_arguments():
    a, b = _states()
    with pytest.raises(TypeError, match="state_a must be a mapping"):
        interpolate([a], b, 0.5)
    with pytest.raises(TypeError, match=r"state_b\['w'\] must be a torch.Tensor"):
        interpolate(a, {**b, "w": [1.0]}, 0.5)
    with pytest.raises(TypeError, match="t must be a real number"):
        interpolate(a, b, "0.5")
    with pytest.raises(TypeError, match="t must be a real number"):
        interpolate(a, b, True)
    with pytest.raises(ValueError, match="t must be finite"):
        interpolate(a, b, float("nan"))


def test_average_weighted_mean():
    gen = torch.Generator().manual_seed(1)
    states = [{"w": torch.randn(5, generator=gen), "n": torch.tensor(i)} for i in range(3)]
    out = average(states)
    torch.testing.assert_close(out["w"], (states[0]["w"] + states[1]["w"] + states[2]["w"]) / 3)
    assert int(out["n"]) == 0
    out = average(states, weights=[1.0, 3.0, 0.0])
    torch.testing.assert_close(out["w"], 0.25 * states[0]["w"] + 0.75 * states[1]["w"])
    single = average(states[:1])
    assert torch.equal(single["w"], states[0]["w"]) and single["w"] is not states[0]["w"]


def test_average_accumulates_in_double_precision():
    # In float32, 1e8 / 3 has a spacing of 8: summing the weighted terms there would lose the 1 / 3.
    states = [{"w": torch.tensor([v], dtype=torch.float32)} for v in (1e8, 1.0, -1e8)]
    out = average(states)
    assert out["w"].dtype == torch.float32
    assert float(out["w"]) == pytest.approx(1.0 / 3.0, rel=1e-6)


def test_average_bad_arguments():
    a, b = _states()
    with pytest.raises(TypeError, match="states must be a sequence"):
        average(a)
    with pytest.raises(ValueError, match="at least one"):
        average([])
    with pytest.raises(ValueError, match=r"states\[0\] and states\[2\] differ in 'w'"):
        average([a, b, {**b, "w": torch.zeros(2)}])
    with pytest.raises(ValueError, match="weights has 1 entries for 2 states"):
        average([a, b], weights=[1.0])
    with pytest.raises(ValueError, match="non-negative"):
        average([a, b], weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="positive sum"):
        average([a, b], weights=[0.0, 0.0])
    with pytest.raises(TypeError, match=r"weights\[1\] must be a real number"):
        average([a, b], weights=[1.0, "x"])
    with pytest.raises(TypeError, match="weights must be a sequence"):
        average([a, b], weights=2.0)


def test_shared_tensors_groups_tied_weights_on_every_device_kind():
    """Tied weights (one tensor under two names) are grouped, views of another layout or offset and equal
    values are not; on the meta device, where every address is 0, the storage tells them apart."""
    from pyperm.nn.state import shared_tensors

    w = torch.ones(4, 3)
    state = {"a": w, "b": torch.ones(4, 3), "c": w, "t": w.T, "row": w[1], "empty": torch.empty(0), "e2": torch.empty(0)}
    assert shared_tensors(state) == [["a", "c"]]
    with torch.device("meta"):
        x, y = nn.Linear(3, 4), nn.Linear(3, 4)
    y.weight = x.weight
    meta = {"x.weight": x.weight, "x.bias": x.bias, "y.weight": y.weight, "y.bias": y.bias}
    assert shared_tensors(meta) == [["x.weight", "y.weight"]]
    assert shared_tensors({}) == []
