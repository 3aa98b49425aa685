"""Curves in files: save_curve/load_curve round trips, set_bend_state, and Garipov et al.'s checkpoints.

The reference implementation's CurveNet checkpoint is written here from its published layout
(``net.<layer>.<name>_<k>`` for control point ``k``, ``coeff_layer.*`` buffers, BatchNorm
buffers once for the whole curve, under ``model_state``), with layer names of its own (the
reference rebuilds every layer) so the converter must match parameters by order; its point at
``t`` is computed here from the control points with the reference's coefficients.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")

from pyperm.nn.curves import BezierCurve, PolyChain, load_curve, load_garipov_curve, save_curve, train_curve
from pyperm.nn.curves.checkpoint import read_curve_metadata, state_fingerprint
from pyperm.testing import one_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def cnn(seed: int, dtype=torch.float32) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3),
        ).to(dtype)  # fmt: skip


def endpoints(dtype=torch.float32):
    model = cnn(0, dtype)
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = {k: v.detach().clone() for k, v in cnn(1, dtype).state_dict().items()}
    b["1.running_mean"] += 0.5  # endpoints with their own statistics
    return model, a, b


def batches(n: int = 3, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 1, 6, 6, generator=g, dtype=dtype), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def trained(cls=BezierCurve, num_bends=1, dtype=torch.float32):
    model, a, b = endpoints(dtype)
    curve = cls(model, a, b, num_bends=num_bends)
    train_curve(curve, batches(dtype=dtype), epochs=2, lr=0.2, recipe="garipov")
    return curve, model, a, b


# --------------------------------------------------------------------------- set_bend_state


def test_set_bend_state_is_the_inverse_of_bend_state():
    curve, model, a, b = trained(PolyChain, num_bends=2)
    other = PolyChain(model, a, b, num_bends=2)
    for k in range(2):
        other.set_bend_state(k, curve.bend_state(k))  # the whole model-shaped dict, buffers included
    for p, q in zip(curve.parameters(), other.parameters()):
        assert torch.equal(p, q)
    before = [p.clone() for p in other.parameters()]
    other.set_bend_state(1, other.bend_state(1))
    assert all(torch.equal(p, q) for p, q in zip(before, other.parameters()))
    # a bend saved as a plain model checkpoint (Tatro et al.'s turning point) loads as it is
    mid = cnn(7).state_dict()
    other.set_bend_state(0, mid)
    for key in ("0.weight", "4.bias"):
        assert torch.equal(other.bend_state(0)[key], mid[key])


def test_set_bend_state_refuses_bad_states_and_changes_nothing():
    curve, model, a, b = trained()
    bend = curve.bend_state(0)
    before = [p.clone() for p in curve.parameters()]
    cases = [
        ({k: v for k, v in bend.items() if k != "4.bias"}, ValueError, "state has no '4.bias'"),
        ({**bend, "4.bias": bend["4.bias"][:2]}, ValueError, r"state\['4.bias'\] has shape \(2,\)"),
        ({**bend, "5.weight": bend["4.bias"]}, ValueError, "not in the model's state dict"),
        ({**bend, "4.weight": bend["4.weight"] * math.nan}, ValueError, "non-finite"),
        ({**bend, "4.bias": [1.0, 2.0, 3.0]}, TypeError, r"state\['4.bias'\] must be a torch.Tensor"),
    ]
    for state, error, message in cases:
        with pytest.raises(error, match=message):
            curve.set_bend_state(0, state)
    with pytest.raises(ValueError, match="index"):
        curve.set_bend_state(1, bend)
    assert all(torch.equal(p, q) for p, q in zip(before, curve.parameters()))


# --------------------------------------------------------------------------- save_curve / load_curve


@pytest.mark.parametrize("cls, num_bends", [(BezierCurve, 1), (BezierCurve, 3), (PolyChain, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_round_trip_is_exact(tmp_path, cls, num_bends, dtype):
    curve, model, a, b = trained(cls, num_bends, dtype)
    path = save_curve(curve, tmp_path / "curve.safetensors", model_name="custom")
    again = load_curve(path, model, a, b)
    assert type(again) is cls and again.num_bends == num_bends
    for p, q in zip(curve.parameters(), again.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)
    x = batches(1, dtype)[0][0]
    curve.eval(), again.eval()
    with torch.no_grad():
        for t in (0.0, 0.3, 0.5, 1.0):
            assert torch.equal(curve(x, t), again(x, t))
            for key, value in curve.state_at(t).items():
                assert torch.equal(value, again.state_at(t)[key]), key
    meta = read_curve_metadata(path)
    assert meta["kind"] == ("bezier" if cls is BezierCurve else "polychain")
    assert meta["num_bends"] == str(num_bends) and meta["model"] == "custom"
    assert meta["endpoint_a"] == state_fingerprint(a) and meta["endpoint_b"] == state_fingerprint(b)


def test_endpoints_in_the_file_and_a_model_by_name(tmp_path):
    from pyperm.nn.models import create_model

    model = create_model("mlp:8,6,3")
    a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = {k: torch.randn_like(v) for k, v in a.items()}
    curve = BezierCurve(model, a, b)
    with torch.no_grad():
        curve.bends()[0].add_(0.25)
    path = save_curve(curve, tmp_path / "c.safetensors", model_name="mlp:8,6,3", endpoints=True)
    again = load_curve(path)  # the model from its name, the endpoints from the file
    for p, q in zip(curve.parameters(), again.parameters()):
        assert torch.equal(p, q)
    x = torch.randn(4, 8)
    assert torch.equal(curve(x, 0.4), again(x, 0.4))
    # without endpoints in the file they must be given
    bare = save_curve(curve, tmp_path / "bare.safetensors")
    with pytest.raises(ValueError, match="names no model"):
        load_curve(bare)
    with pytest.raises(ValueError, match="holds no endpoints"):
        load_curve(bare, model)


def test_load_refuses_other_endpoints_and_other_files(tmp_path):
    curve, model, a, b = trained()
    path = save_curve(curve, tmp_path / "curve.safetensors")
    shifted = {k: v + 1e-3 if v.is_floating_point() else v for k, v in b.items()}
    with pytest.raises(ValueError, match="state_b is not the endpoint the curve"):
        load_curve(path, model, a, shifted)
    with pytest.raises(ValueError, match="state_a is not the endpoint"):
        load_curve(path, model, b, a)
    with pytest.raises(ValueError, match="state_a is not the endpoint"):  # the same weights in another dtype
        load_curve(path, model.double(), {k: v.double() if v.is_floating_point() else v for k, v in a.items()},
                   {k: v.double() if v.is_floating_point() else v for k, v in b.items()})
    loose = load_curve(path, cnn(0), a, shifted, check_endpoints=False)
    assert torch.equal(loose.bend_state(0)["4.weight"], curve.bend_state(0)["4.weight"])
    import safetensors.torch

    plain = tmp_path / "model.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in a.items()}, str(plain))
    with pytest.raises(ValueError, match="not a pyperm curve file.*load_garipov_curve"):
        load_curve(plain, model, a, b)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_curve(tmp_path / "junk.safetensors", model, a, b)
    with pytest.raises(ValueError, match="no such file"):
        load_curve(tmp_path / "missing.safetensors", model, a, b)
    small = save_curve(BezierCurve(nn.Linear(3, 2), *_linear_pair(3)), tmp_path / "small.safetensors")
    with pytest.raises(ValueError, match=r"bend 0 does not fit the model: state\['weight'\] has shape \(2, 3\)"):
        load_curve(small, nn.Linear(4, 2), *_linear_pair(4), check_endpoints=False)
    with pytest.raises(TypeError, match="only BezierCurve and PolyChain"):
        save_curve(_Cubic(nn.Linear(3, 2), *_linear_pair(3)), tmp_path / "x.safetensors")


def _linear_pair(inputs: int):
    a = {"weight": torch.zeros(2, inputs), "bias": torch.zeros(2)}
    return a, {k: v + 1 for k, v in a.items()}


class _Cubic(BezierCurve):
    """A user's own curve family: no file format for it."""


# --------------------------------------------------------------------------- Garipov et al.'s checkpoints


def reference_checkpoint(curve_kind: str, n: int, seed: int = 0) -> dict:
    """A ``train.py`` checkpoint of the reference's CurveNet over :func:`cnn` (its own layer names)."""
    g = torch.Generator().manual_seed(seed)
    layers = [("net.conv1", [("weight", (4, 1, 3, 3)), ("bias", (4,))]),
              ("net.bn1", [("weight", (4,)), ("bias", (4,))]),
              ("net.fc2", [("weight", (3, 144)), ("bias", (3,))])]  # fmt: skip
    state = {}
    for layer, params in layers:
        for name, shape in params:  # registration order: every control point of one parameter together
            for k in range(n):
                state[f"{layer}.{name}_{k}"] = torch.randn(shape, generator=g)
        if layer == "net.bn1":
            state.update({"net.bn1.running_mean": torch.randn(4, generator=g), "net.bn1.running_var": torch.ones(4),
                          "net.bn1.num_batches_tracked": torch.tensor(17)})
    state["coeff_layer.range"] = torch.arange(0, float(n))
    if curve_kind == "bezier":
        state["coeff_layer.binom"] = torch.tensor([float(math.comb(n - 1, j)) for j in range(n)])
        state["coeff_layer.rev_range"] = torch.arange(float(n - 1), -1, -1)
    return {"epoch": 600, "model_state": state, "optimizer_state": {"state": {}, "param_groups": []}}


def reference_point(state: dict, curve_kind: str, n: int, t: float) -> list[torch.Tensor]:
    """The reference's weights at ``t``, in its parameter order: sum_k coeff_k(t) * point_k."""
    t = torch.tensor(t)
    j = torch.arange(0, float(n))
    if curve_kind == "bezier":
        coeffs = state["coeff_layer.binom"] * t**j * (1.0 - t) ** state["coeff_layer.rev_range"]
    else:
        coeffs = torch.clamp(1.0 - torch.abs(t * (n - 1) - j), min=0.0)
    names = list(dict.fromkeys(k.rsplit("_", 1)[0] for k in state if k.rsplit("_", 1)[-1].isdigit()))
    return [sum(coeffs[k] * state[f"{name}_{k}"] for k in range(n)) for name in names]


@pytest.mark.parametrize("curve_kind, n", [("bezier", 3), ("bezier", 5), ("polychain", 4)])
def test_garipov_checkpoint_loads_as_the_same_curve(tmp_path, curve_kind, n):
    checkpoint = reference_checkpoint(curve_kind, n)
    path = tmp_path / "checkpoint-600.pt"
    torch.save(checkpoint, path)
    model, a, b = endpoints()
    curve = load_garipov_curve(path, model, state_a=a, state_b=b)
    assert type(curve) is (BezierCurve if curve_kind == "bezier" else PolyChain) and curve.num_bends == n - 2
    params = [k for k, _ in model.named_parameters()]
    for t in (0.0, 0.2, 0.5, 0.9, 1.0):
        point = curve.state_at(t)
        for key, ref in zip(params, reference_point(checkpoint["model_state"], curve_kind, n, t)):
            torch.testing.assert_close(point[key], ref, rtol=1e-6, atol=1e-6)
    # the endpoints' buffers are those given, the parameters the first and last control points
    assert torch.equal(curve.state_at(1.0)["1.running_mean"], b["1.running_mean"])
    assert torch.equal(curve.state_at(0.0)["0.bias"], checkpoint["model_state"]["net.conv1.bias_0"])
    # the dict itself, or its model_state, work too; the kind can be forced
    again = load_garipov_curve(checkpoint["model_state"], model)
    assert torch.equal(again.bend_state(0)["4.weight"], curve.bend_state(0)["4.weight"])
    if curve_kind == "bezier":
        chain = load_garipov_curve(checkpoint, model, kind="polychain")
        assert isinstance(chain, PolyChain)


def test_garipov_names_that_match_the_model_are_matched_by_name():
    model, a, b = endpoints()
    state = {}
    params = list(model.named_parameters())
    for name, p in reversed(params):  # a file in another order: the names decide
        for k in range(3):
            state[f"net.{name}_{k}"] = torch.full_like(p, float(k))
    state["coeff_layer.binom"] = torch.tensor([1.0, 2.0, 1.0])
    curve = load_garipov_curve(state, model)
    assert torch.equal(curve.bend_state(0)["0.weight"], torch.ones_like(params[0][1]))
    assert torch.equal(curve.state_at(1.0)["4.bias"], torch.full((3,), 2.0))


def test_garipov_bad_checkpoints():
    model, a, b = endpoints()
    good = reference_checkpoint("bezier", 3)["model_state"]
    with pytest.raises(ValueError, match="no control points"):
        load_garipov_curve({"fc.weight": torch.zeros(3, 3)}, model)
    with pytest.raises(ValueError, match="at least 3"):
        load_garipov_curve({k: v for k, v in good.items() if not k[-1] == "2"}, model)
    with pytest.raises(ValueError, match=r"has control points \[0, 1\]; every parameter needs 0..2"):
        load_garipov_curve({k: v for k, v in good.items() if k != "net.fc2.bias_2"}, model)
    with pytest.raises(ValueError, match="pass kind="):
        load_garipov_curve({k: v for k, v in good.items() if not k.startswith("coeff_layer")}, model)
    with pytest.raises(ValueError, match="kind must be one of"):
        load_garipov_curve(good, model, kind="spline")
    with pytest.raises(ValueError, match="control points for 6 parameters; the model has 4"):
        load_garipov_curve(good, nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    wrong = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    with pytest.raises(ValueError, match=r"'net.fc2.weight' \(shape \(3, 144\)\) does not fit the model's '4.weight'"):
        load_garipov_curve(good, wrong)
    with pytest.raises(TypeError, match="source must be a checkpoint path"):
        load_garipov_curve(3, model)
    with pytest.raises(ValueError, match="no such file"):
        load_garipov_curve("missing.pt", model)
