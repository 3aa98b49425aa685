"""Trace rules beyond the basic layers: more elementwise functions, recurrent and attention layers, and
rules that users register for their own modules, functions and methods."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from _vision import import_torchvision
from torch import nn

from pyperm.nn import PermutationSpec, TraceError, register_trace_rule, trace_model
from pyperm.nn.spec import Segments
from pyperm.nn.trace import Label, Role, TraceCall, TraceWarning, registry, rules
from pyperm.testing import assert_same_function


@pytest.fixture
def clean_registry():
    """Rules registered by a test are removed afterwards (the table is process-wide)."""
    tables = (registry._modules, registry._functions, registry._methods, registry._named_functions)
    saved = [dict(t) for t in tables]
    yield
    for table, before in zip(tables, saved):
        table.clear()
        table.update(before)


# --------------------------------------------------------------------------- elementwise


def stochastic_depth(x: torch.Tensor, p: float, mode: str, training: bool = True) -> torch.Tensor:
    """Stands in for torchvision's function of the same qualified name (torchvision is optional)."""
    if not training or p == 0.0:
        return x
    shape = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    return x * x.new_empty(shape).bernoulli_(1 - p) / (1 - p)


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")  # as torchvision does: the function stays one node of the graph


class ResidualMLP(nn.Module):
    """ResMLP-style affine layers (addcmul) and stochastic depth on the residual branch."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.alpha, self.beta = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d) * 0.1)
        self.fc1, self.fc2 = nn.Linear(d, 10), nn.Linear(10, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.embed(x)
        z = torch.addcmul(self.beta, self.alpha, h)
        z = self.fc2(torch.special.expit(self.fc1(z)).clamp_min(0.1).float_power(1).float())
        h = h + stochastic_depth(z, 0.2, "row", self.training)
        return self.head(torch.hypot(h, torch.ones_like(h)))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_addcmul_stochastic_depth_and_more_elementwise(train):
    torch.manual_seed(0)
    model = ResidualMLP().train(train)  # traced in this mode: stochastic_depth runs with training=train
    gm = torch.fx.symbolic_trace(model)
    assert any(n.target is stochastic_depth for n in gm.graph.nodes)
    with torch.random.fork_rng():
        spec = PermutationSpec.from_model(model, torch.randn(2, 4), composite="raise")
    assert spec.sizes == {"P_embed": 6, "P_fc1": 10}
    assert spec.axes["alpha"] == spec.axes["beta"] == ("P_embed",)
    assert spec.axes["fc2.weight"] == ("P_embed", "P_fc1")
    assert_same_function(model, spec, torch.randn(5, 4))


def test_torchvision_stochastic_depth():
    tv = import_torchvision()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.out = nn.Linear(3, 5), nn.Linear(5, 7), nn.Linear(7, 5), nn.Linear(5, 2)
            self.drop = tv.ops.StochasticDepth(0.1, "row")

        def forward(self, x):
            h = self.a(x)
            return self.out(h + self.drop(self.c(torch.relu(self.b(h)))))

    spec = PermutationSpec.from_model(Block(), torch.randn(2, 3), composite="raise")
    assert spec.sizes == {"P_a": 5, "P_b": 7}


def test_scaled_dot_product_attention():
    class SDPA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(5, 6), nn.Linear(5, 6), nn.Linear(5, 7)
            self.out = nn.Linear(7, 2)

        def forward(self, x):  # (batch, tokens, 5)
            return self.out(F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x)))

    torch.manual_seed(0)
    model = SDPA()
    spec = PermutationSpec.from_model(model, torch.randn(2, 3, 5), composite="raise")
    assert spec.axes["q.weight"][0] == spec.axes["k.weight"][0] == "P_q"
    assert spec.axes["v.weight"][0] == spec.axes["out.weight"][1] == "P_v"
    assert_same_function(model, spec, torch.randn(2, 4, 5))


class WindowAttention(nn.Module):
    """MaxViT's attention: a fused q, k, v chunked in three, heads split by a reshape, scores and mixing
    written as einsums, and a relative position bias read from a table by an index buffer."""

    def __init__(self, dim: int = 8, heads: int = 2, tokens: int = 3) -> None:
        super().__init__()
        self.heads, self.tokens = heads, tokens
        self.embed, self.qkv, self.out = nn.Linear(4, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, 2)
        self.table = nn.Parameter(torch.randn(2 * tokens - 1, heads))
        index = torch.arange(tokens).view(-1, 1) - torch.arange(tokens).view(1, -1) + tokens - 1
        self.register_buffer("index", index.reshape(-1))

    def forward(self, x):  # (batch, tokens, 4)
        b, t, _ = x.shape
        q, k, v = self.qkv(self.embed(x)).chunk(3, -1)
        q, k, v = [p.reshape(b, t, self.heads, -1).transpose(1, 2) for p in (q, k, v)]
        bias = self.table[self.index].view(t, t, -1).permute(2, 0, 1)
        scores = torch.einsum("b h i d, b h j d -> b h i j", q, k) + bias
        mixed = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)
        return self.out(mixed.transpose(1, 2).reshape(b, t, -1))


def test_einsum_attention_with_a_relative_position_bias_table():
    torch.manual_seed(0)
    model = WindowAttention().double()
    spec = trace_model(model, torch.randn(2, 3, 4, dtype=torch.float64), composite="raise").spec
    # The chunk cuts the fused projection in three groups' worth; the heads are one group for q, k, v and the
    # bias table's columns (the einsums contract q's and k's head dims, the sum adds the bias per head).
    assert spec.axes["table"][0] is None and isinstance(spec.axes["table"][1], str)
    heads = spec.axes["table"][1]
    assert spec.sizes[heads] == 2 and heads in str(spec.axes["qkv.weight"][0]) and heads in str(spec.axes["out.weight"])
    assert_same_function(model, spec, torch.randn(3, 3, 4, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_einsum_with_a_parameter_produces_units():
    class Einsum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 6))
            self.head = nn.Linear(6, 2)

        def forward(self, x):  # implicit output, an ellipsis: "...d,de->...e"
            return self.head(torch.relu(torch.einsum("...d,de", x, self.w)))

    torch.manual_seed(0)
    model = Einsum()
    result = trace_model(model, torch.randn(2, 3, 4), composite="raise")
    assert result.spec.sizes == {"P_w": 6} and result.spec.axes["w"] == (None, "P_w")
    assert result.post_activation_sites["P_w"][0].op == "torch.relu"
    assert_same_function(model, result.spec, torch.randn(2, 5, 4))


def test_gathering_units_by_an_index_is_reported():
    model = nn.Sequential(nn.Linear(4, 8), Gather(torch.tensor([3, 1, 2])), nn.Linear(3, 2))
    with pytest.raises(TraceError, match=r"operator\.getitem .*gathers axis 1, which carries permuted units"):
        trace_model(model, torch.randn(2, 4), composite="raise")


class Gather(nn.Module):
    def __init__(self, index: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("index", index)

    def forward(self, x):
        return x[:, self.index]


@pytest.mark.parametrize("version", [1, 2])
def test_torchvision_swin_window_attention(version):
    """Swin's attention and patch merging are functions torch.fx keeps whole: their rules name the heads (which
    carry the relative position bias and, v2, the logit scale) and the four copies of the merged channels."""
    from pyperm.nn import Permutations, apply_permutation, weight_matching
    from pyperm.testing import random_permutations

    tv = import_torchvision()
    swin = tv.models.swin_transformer
    v2 = {"block": swin.SwinTransformerBlockV2, "downsample_layer": swin.PatchMergingV2} if version == 2 else {}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = swin.SwinTransformer([2, 2], 8, [1, 1], [2, 2], [4, 4], num_classes=3, **v2).double().eval()
    model.head.is_head = True
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    spec = trace_model(model, x, composite="raise").spec
    attn = "features.1.0.attn"
    qkv = spec.axes[f"{attn}.qkv.weight"][0]
    assert isinstance(qkv, Segments) and len(qkv.parts) == 3 and qkv.parts[0] == qkv.parts[1] != qkv.parts[2]
    heads = qkv.parts[0].outer
    assert spec.sizes[heads] == 2 and spec.axes[f"{attn}.proj.weight"][1] == qkv.parts[2]
    table = f"{attn}.cpb_mlp.2.weight" if version == 2 else f"{attn}.relative_position_bias_table"
    assert spec.axes[table][1 - (version == 2)] == heads
    merged = spec.axes["features.2.reduction.weight"][1]
    assert isinstance(merged, Segments) and len(set(merged.parts)) == 1 and len(merged.parts) == 4
    assert_same_function(model, spec, x, rtol=1e-10, atol=1e-10)
    sa = {k: t + 0.1 * torch.randn_like(t) if t.is_floating_point() else t for k, t in model.state_dict().items()}
    planted = Permutations(spec, random_permutations(spec, 3))
    assert weight_matching(spec, sa, apply_permutation(spec, planted, sa), seed=0).perms == planted.inverse()


# --------------------------------------------------------------------------- recurrent layers


class RecurrentClassifier(nn.Module):
    def __init__(self, kind: type, bidirectional: bool = False, layers: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 6)
        self.proj = nn.Linear(6, 5)
        self.rnn = kind(5, 7, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(7 * (2 if bidirectional else 1), 3)

    def forward(self, ids):
        out = self.rnn(torch.tanh(self.proj(self.embed(ids))))[0]
        return self.head(out[:, -1])


@pytest.mark.parametrize(
    ("kind", "bidirectional", "layers"),
    [(nn.LSTM, False, 1), (nn.GRU, False, 1), (nn.RNN, False, 1), (nn.LSTM, True, 2), (nn.GRU, True, 1)],
    ids=["lstm", "gru", "rnn", "lstm-bi-2", "gru-bi"],
)
def test_recurrent_layers_keep_their_inputs_permutable(kind, bidirectional, layers):
    torch.manual_seed(0)
    model = RecurrentClassifier(kind, bidirectional, layers)
    ids = torch.randint(0, 13, (2, 4))
    with pytest.warns(TraceWarning, match=rf"{kind.__name__} \(graph node 'rnn', module 'rnn'\) keeps its hidden"):
        result = trace_model(model, ids, structured=False)
    spec = result.spec
    assert spec.sizes == {"P_embed": 6, "P_proj": 5}
    assert spec.axes["rnn.weight_ih_l0"] == (None, "P_proj")
    if bidirectional:
        assert spec.axes["rnn.weight_ih_l0_reverse"] == (None, "P_proj")
    hidden = [k for k in spec.axes if k.startswith("rnn.") and not k.startswith("rnn.weight_ih_l0")]
    assert hidden and all(g is None for k in hidden for g in spec.axes[k])
    assert [s.module for s in result.post_activation_sites["P_proj"]] == [""]  # the tanh
    assert_same_function(model, spec, torch.randint(0, 13, (3, 6)))
    with pytest.raises(TraceError, match=r"keeps its hidden units: .*stacked along one axis"):
        trace_model(model, ids, composite="raise", structured=False)


def test_recurrent_initial_state_is_fixed():
    class WithState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.init = nn.Linear(3, 4), nn.Linear(3, 6)
            self.gru, self.head = nn.GRU(4, 6), nn.Linear(6, 2)

        def forward(self, x):  # (time, batch, 3)
            h0 = torch.tanh(self.init(x[0])).unsqueeze(0)
            return self.head(self.gru(self.inp(x), h0)[1][0])

    torch.manual_seed(0)
    model = WithState()
    spec = PermutationSpec.from_model(model, torch.randn(5, 2, 3), composite="fix", structured=False)
    assert spec.sizes == {"P_inp": 4}  # init's units enter the GRU's hidden state: fixed
    assert spec.axes["init.weight"] == (None, None)
    assert_same_function(model, spec, torch.randn(4, 3, 3))


# --------------------------------------------------------------------------- attention


class EncoderBlock(nn.Module):
    """A pre-norm transformer encoder block with nn.MultiheadAttention and a residual stream."""

    def __init__(self, d: int = 8, heads: int = 2, cross: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(5, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        kdim = 6 if cross else None
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, kdim=kdim, vdim=kdim)
        self.memory = nn.Linear(5, 6) if cross else None
        self.fc1, self.fc2 = nn.Linear(d, 12), nn.Linear(12, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.embed(x)
        z = self.ln1(h)
        kv = torch.relu(self.memory(x)) if self.memory is not None else z
        h = h + self.attn(z, kv, kv, need_weights=False)[0]
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.head(h.mean(dim=1))


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_multihead_attention_in_an_encoder_block(cross):
    torch.manual_seed(0)
    model = EncoderBlock(cross=cross)
    with pytest.warns(
        TraceWarning, match=r"MultiheadAttention \(graph node 'attn', module 'attn'\) keeps its per-head"
    ):
        result = trace_model(model, torch.randn(2, 3, 5), structured=False)
    spec = result.spec
    stream = spec.axes["embed.weight"][0]
    assert stream is not None
    assert spec.axes["attn.out_proj.weight"] == (stream, None) and spec.axes["fc2.weight"][0] == stream
    if cross:
        assert spec.axes["attn.q_proj_weight"] == (None, stream)
        assert spec.axes["attn.k_proj_weight"] == spec.axes["attn.v_proj_weight"] == (None, "P_memory")
        assert spec.sizes == {"P_embed": 8, "P_memory": 6, "P_fc1": 12}
    else:
        assert spec.axes["attn.in_proj_weight"] == (None, stream)
        assert spec.sizes == {"P_embed": 8, "P_fc1": 12}
    assert_same_function(model, spec, torch.randn(2, 4, 5))


# --------------------------------------------------------------------------- user rules


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class ScaledLinear(nn.Module):
    """A user's linear layer: nn.Linear's parameters, and a forward the tracer would otherwise follow."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cout, cin) * 0.3)
        self.bias = nn.Parameter(torch.randn(cout) * 0.1)

    def forward(self, x):
        return 2.0 * F.linear(x, self.weight, self.bias)


class SortedGate(nn.Module):
    """Sorts its input along the units (order-dependent), then gates: no built-in rule can follow it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return x * torch.sigmoid(torch.sort(x, dim=-1).values.mean(-1, keepdim=True)) * self.gain


def sorted_gate_rule(call: TraceCall) -> Label:
    """The gate depends on the set of units (their sorted values), not their order: elementwise with ``gain``."""
    _, lx = call.first()
    call.join(lx[-1], call.param("gain")[0])
    call.role = Role.NONLINEAR
    return lx


def test_register_module_rules(clean_registry):
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(4, 8), Swish(), ScaledLinear(8, 6), SortedGate(6), nn.Linear(6, 2))
    with pytest.raises(TraceError, match=r"torch\.sort .*module '3'"):
        trace_model(model, torch.randn(3, 4))
    register_trace_rule(Swish, rules.nonlinear)
    register_trace_rule(ScaledLinear, rules.linear)
    register_trace_rule(SortedGate, sorted_gate_rule)
    result = trace_model(model, torch.randn(3, 4), composite="raise")
    spec = result.spec
    assert spec.sizes == {"P_0": 8, "P_2": 6}
    assert spec.axes["2.weight"] == ("P_2", "P_0") and spec.axes["3.gain"] == ("P_2",)
    # Registered modules are leaves: sites name them.
    assert [(s.module, s.op) for s in result.post_activation_sites["P_0"]] == [("1", "Swish")]
    assert [(s.module, s.op) for s in result.post_activation_sites["P_2"]] == [("3", "SortedGate")]
    assert_same_function(model, spec, torch.randn(5, 4))


def test_register_function_method_and_qualified_name(clean_registry):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.b(torch.fft.fft(self.a(x)).real.contiguous())

    with pytest.raises(TraceError, match=r"torch\._?fft"):
        trace_model(M(), torch.randn(2, 3))
    # Not a rule a real fft deserves (it mixes the units), but enough to show the lookup.
    register_trace_rule(torch.fft.fft, rules.elementwise)
    spec = trace_model(M(), torch.randn(2, 3), composite="raise").spec
    assert spec.sizes == {"P_a": 6}
    assert spec.axes["b.weight"] == (None, "P_a")
    # An order-independent function of the units (as a sum would be): b's input is invariant.
    register_trace_rule(torch.fft.fft, rules.invariant, replace=True)
    spec = trace_model(M(), torch.randn(2, 3), composite="raise").spec
    assert spec.sizes == {"P_a": 6} and spec.axes["b.weight"] == (None, None)
    # Methods by name, functions of unimported libraries by qualified name.
    register_trace_rule("Tensor.frobnicate", rules.same)
    assert registry.lookup_method("frobnicate") is rules.same
    register_trace_rule("somelib.ops.scale", rules.elementwise)

    def scale(x):
        return x

    scale.__module__, scale.__qualname__ = "somelib.ops", "scale"
    assert registry.lookup_function(scale) is rules.elementwise


def test_register_errors(clean_registry):
    with pytest.raises(TypeError, match="rule must be callable"):
        register_trace_rule(Swish, "nonlinear")
    with pytest.raises(TypeError, match="target must be a torch.nn.Module subclass, a function or a method name"):
        register_trace_rule(int, rules.same)
    with pytest.raises(TypeError, match="target must be"):
        register_trace_rule(3, rules.same)
    with pytest.raises(ValueError, match="neither a Tensor method name nor a qualified function name"):
        register_trace_rule("not a name", rules.same)
    with pytest.raises(ValueError, match="already has a trace rule.*replace=True"):
        register_trace_rule(nn.Linear, rules.same)
    register_trace_rule(Swish, rules.nonlinear)
    with pytest.raises(ValueError, match="already has a trace rule"):
        register_trace_rule(Swish, rules.elementwise)
    register_trace_rule(Swish, rules.elementwise, replace=True)
    assert registry.rule_for(Swish) is rules.elementwise


def test_subclass_of_a_registered_module_is_traced_into(clean_registry):
    class Doubled(ScaledLinear):
        def forward(self, x):
            return super().forward(x) * 2

    register_trace_rule(ScaledLinear, rules.linear)
    gm = trace_model(nn.Sequential(Doubled(3, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(2, 3)).graph_module
    assert not any(n.op == "call_module" and n.target == "0" for n in gm.graph.nodes)


@pytest.mark.parametrize(
    ("kind", "bidirectional", "layers"),
    [(nn.LSTM, True, 2), (nn.GRU, True, 1), (nn.RNN, False, 3)],
    ids=["lstm-bi-2", "gru-bi", "rnn-3"],
)
def test_structured_recurrent_layers(kind, bidirectional, layers):
    torch.manual_seed(0)
    model = RecurrentClassifier(kind, bidirectional, layers)
    spec = trace_model(model, torch.randint(0, 13, (2, 4)), composite="raise", structured=True).spec
    directions = ["", "_reverse"] if bidirectional else [""]
    assert set(spec.sizes) == {"P_embed", "P_proj"} | {f"P_rnn.l{i}{d}" for i in range(layers) for d in directions}
    top = [f"P_rnn.l{layers - 1}{d}" for d in directions]
    assert spec.axes["head.weight"][1] == (Segments(*top) if bidirectional else top[0])
    assert spec.axes[f"rnn.weight_hh_l0{directions[-1]}"][1] == f"P_rnn.l0{directions[-1]}"
    assert_same_function(model, spec, torch.randint(0, 13, (3, 6)))


class LastState(nn.Module):
    """A recurrent layer whose final state feeds the head: ``h_n[-1]`` (the top layer), or with
    ``both=True`` the top layer's two directions concatenated."""

    def __init__(self, rnn: nn.Module, both: bool = False) -> None:
        super().__init__()
        self.proj, self.rnn = nn.Linear(3, 4), rnn
        width = rnn.proj_size or rnn.hidden_size if isinstance(rnn, nn.LSTM) else rnn.hidden_size
        self.head = nn.Linear(width * (2 if both else 1), 2)
        self.both, self.lstm = both, isinstance(rnn, nn.LSTM)

    def forward(self, x):
        state = self.rnn(torch.tanh(self.proj(x)))[1]
        h = state[0] if self.lstm else state  # (h_n, c_n) or h_n
        return self.head(torch.cat([h[-2], h[-1]], dim=1) if self.both else h[-1])


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")  # torch's own notice
@pytest.mark.parametrize(
    "rnn",
    [nn.GRU(4, 5, num_layers=2), nn.LSTM(4, 5, num_layers=3), nn.LSTM(4, 6, proj_size=3),
     nn.LSTM(4, 6, num_layers=2, proj_size=3, bidirectional=True)],
    ids=["gru-2", "lstm-3", "lstm-proj", "lstm-proj-bi-2"],
)
def test_structured_recurrent_final_state_of_the_top_layer(rnn):
    """h_n[-1] carries the units of the last layer (and direction); with projections, the cell
    units and the projected units are two groups."""
    torch.manual_seed(0)
    model = LastState(rnn)
    spec = trace_model(model, torch.randn(4, 2, 3), composite="raise", structured=True).spec
    rows = rnn.num_layers * (2 if rnn.bidirectional else 1)
    last = f"P_rnn.l{rnn.num_layers - 1}" + ("_reverse" if rnn.bidirectional else "")
    assert spec.axes["head.weight"][1] == last
    if rnn.proj_size:
        assert len(spec.sizes) == 1 + 2 * rows and spec.sizes[last] == 3 and spec.sizes[f"{last}.cell"] == 6
        assert spec.axes["rnn.weight_hr_l0"] == ("P_rnn.l0", "P_rnn.l0.cell")
    else:
        assert len(spec.sizes) == 1 + rows
    assert_same_function(model, spec, torch.randn(5, 3, 3))


def test_structured_recurrent_final_state_of_several_rows_falls_back():
    torch.manual_seed(0)
    model = LastState(nn.GRU(4, 5, bidirectional=True), both=True)
    with pytest.warns(TraceWarning, match="GRU .*keeps its hidden units"):
        spec = trace_model(model, torch.randn(4, 2, 3), structured=True).spec
    assert spec.sizes == {"P_proj": 4}
    assert_same_function(model, spec, torch.randn(5, 3, 3))
