"""The torch.export front end of the tracer: when it is used, what it keeps whole, and its ATen rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn import Permutations, TraceError, activation_matching, apply_permutation, trace_model
from pyperm.nn.spec import Segments
from pyperm.nn.trace import registry, rules
from pyperm.testing import random_permutations


class ShapeBranch(nn.Module):
    """An MLP whose forward branches on an input's shape: torch.fx cannot trace it (a Proxy in an ``if``),
    torch.export can (the branch its example takes)."""

    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 12), nn.Linear(12, 3)
        self.act = act if act is not None else nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 6:
            x = self.act(self.fc1(x))
        return self.fc3(F.gelu(self.fc2(x)))


def _same_function(model: nn.Module, other: nn.Module, spec, *inputs) -> None:
    """``other`` loaded with ``model``'s state permuted by a random permutation of every group computes alike."""
    other.load_state_dict(apply_permutation(spec, random_permutations(spec, 1), model.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(other.eval()(*inputs), model.eval()(*inputs), rtol=1e-12, atol=1e-12)


def test_torch_fx_is_tried_first():
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    result = trace_model(model, torch.randn(4, 6))
    assert result.frontend == "fx" and dict(result.spec.sizes) == {"P_0": 16}


def test_torch_export_traces_what_torch_fx_cannot():
    model = ShapeBranch().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    result = trace_model(model, x)
    assert result.frontend == "export"
    assert dict(result.spec.sizes) == {"P_fc1": 16, "P_fc2": 12}
    assert result.spec.axes["fc2.weight"] == ("P_fc2", "P_fc1")
    _same_function(model, ShapeBranch().double(), result.spec, x)


def test_both_front_ends_give_one_spec():
    """Batch norm's ATen operator takes its arguments in another order; aten.silu_ (in place) gets F.silu's rule."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(inplace=True), nn.Flatten(), nn.Linear(128, 5))
    x = torch.randn(2, 3, 6, 6)
    fx_spec = trace_model(model, x, frontend="fx").spec
    export_spec = trace_model(model, x, frontend="export").spec
    assert export_spec.axes == fx_spec.axes and export_spec.sizes == fx_spec.sizes


def test_neither_front_end_raises_with_both_reasons():
    class ValueBranch(nn.Module):  # a branch on a value: torch.export cannot take it either
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else -x

    with pytest.raises(TraceError, match=r"neither torch\.fx nor torch\.export.*torch\.fx.*torch\.export"):
        trace_model(ValueBranch(), torch.randn(2, 4))
    with pytest.raises(TraceError, match="torch.fx could not trace"):
        trace_model(ShapeBranch(), torch.randn(2, 6), frontend="fx")
    with pytest.raises(ValueError, match="frontend must be"):
        trace_model(ShapeBranch(), torch.randn(2, 6), frontend="jit")


def test_the_exported_graph_runs_other_batch_sizes_and_leaves_the_model_as_it_was():
    model = ShapeBranch().train()
    result = trace_model(model, torch.randn(4, 6))
    assert model.training and all(m.training for m in model.modules())
    x = torch.randn(7, 6)
    torch.testing.assert_close(result.graph_module(x), model.eval()(x))


def test_activation_matching_finds_a_planted_permutation_through_exported_graphs():
    model = ShapeBranch().double().eval()
    spec = trace_model(model, torch.randn(4, 6, dtype=torch.float64)).spec
    plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(2)))
    other = ShapeBranch().double()
    other.load_state_dict(plant.apply(model.state_dict()))
    gen = torch.Generator().manual_seed(3)
    data = [torch.randn(n, 6, generator=gen, dtype=torch.float64) for n in (32, 32, 9)]
    result = activation_matching(model, other, None, data)
    assert result.perms == plant.inverse()
    assert {s.op for sites in result.sites.values() for s in sites} == {"aten.relu", "aten.gelu"}


# ------------------------------------------------------------------ registered rules under torch.export


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


@pytest.fixture
def private_registry(monkeypatch):
    """Rules registered in a test stay in the test."""
    for table in ("_modules", "_functions", "_methods", "_named_functions"):
        monkeypatch.setattr(registry, table, dict(getattr(registry, table)))


def test_a_registered_module_stays_a_leaf_of_the_exported_graph(private_registry):
    registry.register_trace_rule(Swish, rules.nonlinear)
    model = ShapeBranch(Swish()).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    result = trace_model(model, x)
    assert result.frontend == "export"
    calls = [n for n in result.graph_module.graph.nodes if n.op == "call_module" and n.target == "act"]
    assert len(calls) == 1 and result.graph_module.get_submodule("act") is model.act
    assert [s.op for s in result.post_activation_sites["P_fc1"]] == ["Swish"]
    _same_function(model, ShapeBranch(Swish()).double(), result.spec, x)


def test_multihead_attention_is_kept_whole_under_export():
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
            self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

        def forward(self, x):
            h = self.inp(x)
            return self.out(h + self.mha(h, h, h)[0])

    model, x = Encoder().eval(), torch.randn(2, 5, 6)
    by_fx, by_export = (trace_model(model, x, frontend=f) for f in ("fx", "export"))
    assert by_export.spec.axes == by_fx.spec.axes and by_export.composites == ()
    assert any(n.op == "call_module" and n.target == "mha" for n in by_export.graph_module.graph.nodes)


def test_a_function_rule_applies_to_its_aten_operator(private_registry):
    class Sinc(ShapeBranch):
        def forward(self, x):
            if x.shape[-1] == 6:
                x = torch.sinc(self.fc1(x))
            return self.fc3(F.gelu(self.fc2(x)))

    x = torch.randn(4, 6)
    with pytest.raises(TraceError, match="unsupported operation aten.sinc"):
        trace_model(Sinc(), x)
    registry.register_trace_rule(torch.sinc, rules.nonlinear)
    assert trace_model(Sinc(), x).spec.axes["fc2.weight"] == ("P_fc2", "P_fc1")


# ------------------------------------------------------------------ ATen operators with rules of their own


class Sliced(nn.Module):
    """Slices along units (a Segments axis), picks a position (select), gathers and indexes positions,
    and GPT-2's Conv1D: torch.addmm with a weight stored (in, out)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 16)
        self.w = nn.Parameter(torch.randn(10, 12))
        self.b = nn.Parameter(torch.randn(12))
        self.head = nn.Linear(12, 3)

    def forward(self, x):  # x: (batch, seq, 6)
        if x.shape[1] < 2:
            raise ValueError("too short")
        h = self.fc(x)
        h = torch.cat([torch.relu(h[..., :10]), torch.tanh(h[..., 10:])], -1)[..., :10]
        h = torch.addmm(self.b, h.flatten(0, 1), self.w).unflatten(0, (x.shape[0], x.shape[1]))
        first = h.select(1, 0) + h[:, torch.tensor([1])].squeeze(1)
        return self.head(first + h.gather(1, torch.zeros_like(h[:, :1], dtype=torch.long)).squeeze(1))


def test_aten_slices_selects_gathers_and_addmm():
    model = Sliced().double()
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    result = trace_model(model, x)
    assert result.frontend == "export" and result.composites == ()
    rows = result.spec.axes["fc.weight"][0]
    assert isinstance(rows, Segments) and [result.spec.entry_length(p) for p in rows.parts] == [10, 6]
    assert result.spec.axes["w"] == (rows.parts[0], result.spec.axes["head.weight"][1])
    _same_function(model, Sliced().double(), result.spec, x)
