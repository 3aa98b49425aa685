"""pyperm.nn.models.register_model: a user's architecture by name, in create_model and the command line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn

from pyperm.nn.models import _registry, create_model, input_shape, model_names, parse_model_name, register_model


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch):
    """Each test registers into its own copy of the bundled models (a guide example run earlier in the same
    process may have registered its own): nothing leaks into or out of these tests."""
    bundled = {k: v for k, v in _registry._ARCHITECTURES.items() if v.factory.__module__.startswith("pyperm.")}
    monkeypatch.setattr(_registry, "_ARCHITECTURES", bundled)


class Wide(nn.Module):
    """A user's model with options, and no permutation_spec(): the command line traces it."""

    def __init__(self, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


def test_register_as_a_call():
    assert register_model("wide", Wide, positional="width", keywords=("classes",), input_shape=(4,)) is Wide
    assert "wide" in model_names()
    model = create_model("wide:16,classes=5")
    assert isinstance(model, Wide) and model.net[0].out_features == 16 and model.net[2].out_features == 5
    assert parse_model_name("wide:16") == ("wide", {"width": 16})
    assert input_shape("wide:2", batch=7) == (7, 4)


def test_register_as_decorators():
    @register_model
    def tinynet():
        return nn.Linear(2, 2)

    @register_model("other-net", keywords=("width",))
    class OtherNet(nn.Module):
        def __init__(self, width=3):
            super().__init__()
            self.layer = nn.Linear(2, width)

    assert isinstance(create_model("tinynet"), nn.Linear)  # registered under its lower-cased __name__
    assert create_model("other-net:width=6").layer.out_features == 6
    assert OtherNet.__name__ == "OtherNet"  # the decorator leaves the class as it was


def test_registered_names_are_checked_like_bundled_ones():
    register_model("wide", Wide, keywords=("classes",))
    with pytest.raises(ValueError, match="takes no positional option"):
        create_model("wide:4")
    with pytest.raises(ValueError, match="does not take 'depth'"):
        create_model("wide:depth=2")
    with pytest.raises(ValueError, match="registered without input_shape"):
        input_shape("wide")


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("Bad Name", Wide), {}, ValueError, "name 'Bad Name'"),
        (("resnet20", Wide), {}, ValueError, "already registered; pass overwrite=True"),
        (("ok", 3), {}, TypeError, "factory must be callable"),
        (("ok", Wide), {"keywords": "classes"}, TypeError, "keywords must be a sequence of str"),
        (("ok", Wide), {"keywords": ("not valid",)}, ValueError, "not an identifier"),
        (("ok", Wide), {"positional": 3}, TypeError, "positional must be"),
        (("ok", Wide), {"input_shape": (4, 0)}, ValueError, "input_shape must be non-empty with positive"),
        (("ok", Wide), {"input_shape": "4"}, TypeError, "input_shape must be a sequence of int"),
    ],
)
def test_bad_registrations_are_refused(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        register_model(*args, **kwargs)
    assert "ok" not in model_names()


def test_overwrite_replaces():
    register_model("wide", Wide)
    register_model("wide", lambda: nn.Linear(1, 1), overwrite=True)
    assert isinstance(create_model("wide"), nn.Linear)


def test_a_factory_that_returns_no_module_is_named():
    register_model("nomodule", lambda: "a string")
    with pytest.raises(TypeError, match="'nomodule'.*returned a str"):
        create_model("nomodule")


def test_command_line_uses_a_registered_model(tmp_path, capsys):
    """``pyperm align --model NAME`` builds the registered architecture and traces its spec."""
    from pyperm.cli import main

    register_model("wide", Wide, positional="width", input_shape=(4,))
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        path = tmp_path / f"m{seed}.pt"
        torch.save(Wide(8).state_dict(), path)
        states.append(path)
    out = tmp_path / "aligned"
    code = main(["align", str(states[0]), str(states[1]), "--model", "wide:8", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    aligned = torch.load(out / "m2_permuted.pt", weights_only=True)
    b = torch.load(states[1], weights_only=True)
    # A permutation of B's hidden units: the same rows, reordered.
    rows = {tuple(r.tolist()) for r in b["net.0.weight"]}
    assert {tuple(r.tolist()) for r in aligned["net.0.weight"]} == rows
