"""The solvers as torch custom operators: opcheck, torch.compile(fullgraph=True), torch.export.

The operators are ``torch.ops.pyperm.linear_sum_assignment`` and
``torch.ops.pyperm.batch_linear_sum_assignment``; the public functions call them only while
torch compiles or exports. Answers are compared by objective value (scipy's), not indices.

The last part prototypes the forms whose output size depends on the data (a threshold that
keeps only some pairs, a padded stack whose sizes are a tensor) with stand-in operators
defined here, not in the package, to record what torch captures and what still breaks.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment as scipy_lsa

torch = pytest.importorskip("torch")

import pyperm  # noqa: E402

pyperm.lap.register_torch_ops()  # pyperm may have been imported before torch

LSA = torch.ops.pyperm.linear_sum_assignment.default
BATCH_LSA = torch.ops.pyperm.batch_linear_sum_assignment.default


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graph or recompile count carries over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _scipy_objective(cost, maximize=False):
    c = cost.detach().cpu().double().numpy()
    rows, cols = scipy_lsa(c, maximize=maximize)
    return float(c[rows, cols].sum())


def _objective(cost, rows, cols):
    return float(cost.detach().cpu().double()[rows.cpu(), cols.cpu()].sum())


class GraphRecorder:
    """A torch.compile backend that runs the captured graphs eagerly and keeps them."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [node.target for gm in self.graphs for node in gm.graph.nodes if node.op == "call_function"]


# --- the operators themselves -------------------------------------------------------------

SHAPES = [(4, 6), (6, 4), (5, 5), (1, 1), (0, 3), (3, 0), (0, 0)]
BATCH_SHAPES = [(3, 4, 6), (2, 6, 4), (0, 3, 3), (2, 0, 3), (2, 3, 0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("maximize", [False, True])
def test_opcheck_single(device, shape, dtype, maximize):
    cost = torch.rand(shape, dtype=dtype, device=device)
    torch.library.opcheck(LSA, (cost, maximize))


@pytest.mark.parametrize("shape", BATCH_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("maximize", [False, True])
def test_opcheck_batch(device, shape, dtype, maximize):
    costs = torch.rand(shape, dtype=dtype, device=device)
    torch.library.opcheck(BATCH_LSA, (costs, maximize, 1))


@pytest.mark.parametrize("kind", ["int64", "bool", "transposed"])
def test_opcheck_other_real_inputs(kind):
    # Integers and bools are solved in float64, strided views read through a copy, as in eager mode.
    gen = torch.Generator().manual_seed(1)
    cost = {
        "int64": torch.randint(0, 9, (4, 6), generator=gen),
        "bool": torch.rand(5, 5, generator=gen) > 0.5,
        "transposed": torch.rand(6, 4, generator=gen).t(),
    }[kind]
    torch.library.opcheck(LSA, (cost, False))
    rows, cols = LSA(cost, False)
    assert _objective(cost, rows, cols) == pytest.approx(_scipy_objective(cost))


def test_operators_stay_out_of_cuda_graphs():
    # Their CUDA kernels synchronise the stream, which a CUDA graph cannot capture.
    for op in (LSA, BATCH_LSA):
        assert torch.Tag.cudagraph_unsafe in op.tags


def test_opcheck_with_a_cost_that_requires_grad():
    # Integer outputs carry no gradient; the operator must still accept such a cost.
    torch.library.opcheck(LSA, (torch.rand(4, 5, requires_grad=True), False))


@pytest.mark.parametrize("maximize", [False, True])
def test_operators_solve_optimally(device, maximize):
    gen = torch.Generator().manual_seed(0)
    cost = torch.rand(7, 9, generator=gen, dtype=torch.float64).to(device)
    rows, cols = LSA(cost, maximize)
    assert rows.device == cost.device and rows.dtype == torch.int64 and rows.shape == (7,)
    assert _objective(cost, rows, cols) == pytest.approx(_scipy_objective(cost, maximize), rel=1e-12)

    costs = torch.rand(4, 6, 5, generator=gen, dtype=torch.float32).to(device)
    rows, cols = BATCH_LSA(costs, maximize, 0)
    assert rows.device == costs.device and rows.shape == cols.shape == (4, 5)
    for b in range(4):
        assert _objective(costs[b], rows[b], cols[b]) == pytest.approx(_scipy_objective(costs[b], maximize), rel=1e-5)


def test_operators_raise_the_solvers_errors():
    with pytest.raises(ValueError, match="invalid numeric entries"):
        LSA(torch.tensor([[float("nan"), 1.0], [1.0, 0.0]]), False)
    with pytest.raises(ValueError, match=r"cost must be a 2-D array"):
        LSA(torch.rand(3), False)
    with pytest.raises(ValueError, match=r"costs must be a 3-D array"):
        BATCH_LSA(torch.rand(3, 3), False, 0)


def test_fake_implementations_give_shapes_and_check_rank():
    rows, cols = LSA(torch.empty(5, 3, device="meta"), False)
    assert rows.shape == cols.shape == (3,) and rows.dtype == torch.int64 and rows.device.type == "meta"
    rows, cols = BATCH_LSA(torch.empty(2, 4, 7, dtype=torch.float64, device="meta"), True, 0)
    assert rows.shape == cols.shape == (2, 4) and cols.dtype == torch.int64
    with pytest.raises(ValueError, match=r"cost must be a 2-D array"):
        LSA(torch.empty(2, 3, 4, device="meta"), False)
    with pytest.raises(TypeError, match="cost must be real"):
        LSA(torch.empty(2, 3, dtype=torch.complex64, device="meta"), False)


def test_eager_calls_do_not_go_through_the_operators(monkeypatch):
    # The dispatcher's cost is paid only while compiling: eager calls reach the backend directly.
    from pyperm.lap import _torch_ops

    def fail(*args):
        raise AssertionError("eager call went through the custom operator")

    monkeypatch.setattr(_torch_ops, "linear_sum_assignment", fail)
    monkeypatch.setattr(_torch_ops, "batch_linear_sum_assignment", fail)
    rows, cols = pyperm.linear_sum_assignment(torch.rand(3, 4))
    assert isinstance(rows, torch.Tensor) and rows.shape == (3,)
    rows, cols = pyperm.batch_linear_sum_assignment(torch.rand(2, 3, 4))
    assert rows.shape == (2, 3)


# --- torch.compile -------------------------------------------------------------------------


def matched_cost(a, b, maximize=False):
    """Build a cost from two point sets, solve it, gather the matched entries."""
    cost = torch.cdist(a, b)
    rows, cols = pyperm.linear_sum_assignment(cost, maximize=maximize)
    return cost[rows, cols].sum()


def batch_matched_cost(a, b):
    """The batched twin: (B, n, d) and (B, m, d) point sets, one total per problem."""
    cost = torch.cdist(a, b)
    rows, cols = pyperm.batch_linear_sum_assignment(cost)
    batch = torch.arange(cost.shape[0], device=cost.device).unsqueeze(1)
    return cost[batch, rows, cols].sum(dim=1)


def _points(device, *shape, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=gen, dtype=dtype).to(device)


@pytest.mark.parametrize("maximize", [False, True])
def test_compile_fullgraph_captures_one_graph(device, maximize):
    recorder = GraphRecorder()
    compiled = torch.compile(matched_cost, fullgraph=True, backend=recorder)
    a, b = _points(device, 7, 2, seed=1), _points(device, 9, 2, seed=2)
    got = compiled(a, b, maximize)
    assert len(recorder.graphs) == 1
    assert LSA in recorder.targets()
    assert float(got) == pytest.approx(_scipy_objective(torch.cdist(a, b), maximize), rel=1e-12)
    assert float(got) == pytest.approx(float(matched_cost(a, b, maximize)), rel=1e-12)


def test_compile_dynamic_shapes_do_not_recompile(device):
    recorder = GraphRecorder()
    compiled = torch.compile(matched_cost, fullgraph=True, backend=recorder, dynamic=True)
    for n, m in [(5, 8), (9, 6), (4, 4), (0, 3)]:
        a, b = _points(device, n, 2, seed=n), _points(device, m, 2, seed=m + 10)
        assert float(compiled(a, b)) == pytest.approx(float(matched_cost(a, b)), rel=1e-12)
    assert len(recorder.graphs) <= 2  # sizes 0 and 1 are specialised: at most one more graph


def test_compile_batched(device):
    recorder = GraphRecorder()
    compiled = torch.compile(batch_matched_cost, fullgraph=True, backend=recorder)
    a, b = _points(device, 5, 6, 3, seed=3), _points(device, 5, 4, 3, seed=4)
    got = compiled(a, b)
    assert len(recorder.graphs) == 1 and BATCH_LSA in recorder.targets()
    cost = torch.cdist(a, b)
    want = [_scipy_objective(cost[i]) for i in range(5)]
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-12)


def test_compile_gradients_flow_through_the_gathered_entries():
    a = _points("cpu", 6, 2, seed=5).requires_grad_()
    b = _points("cpu", 8, 2, seed=6)
    compiled = torch.compile(matched_cost, fullgraph=True, backend="aot_eager")
    (grad_compiled,) = torch.autograd.grad(compiled(a, b), a)
    (grad_eager,) = torch.autograd.grad(matched_cost(a, b), a)
    torch.testing.assert_close(grad_compiled, grad_eager)


def _cxx_runs() -> bool:
    """Whether the C++ compiler inductor would use runs (CI's test environment sets CXX=/bin/false)."""
    import os
    import shutil

    cxx = os.environ.get("CXX") or shutil.which("g++") or "c++"
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def test_compile_inductor(device):
    if device == "cpu" and not _cxx_runs():
        pytest.skip("inductor on the CPU compiles C++ at run time, and no C++ compiler runs here")
    compiled = torch.compile(matched_cost, fullgraph=True)
    a, b = _points(device, 6, 2, seed=7, dtype=torch.float32), _points(device, 8, 2, seed=8, dtype=torch.float32)
    assert float(compiled(a, b)) == pytest.approx(_scipy_objective(torch.cdist(a, b)), rel=1e-5)


def test_compile_raises_the_solvers_errors():
    compiled = torch.compile(lambda c: pyperm.linear_sum_assignment(c), fullgraph=True, backend="eager")
    with pytest.raises(ValueError, match="invalid numeric entries"):
        compiled(torch.tensor([[float("nan"), 1.0], [1.0, 0.0]]))


def _run_python(code):
    # From the tests folder: from the repository root, `-c` would import the source folder,
    # which has no compiled module (the installed wheel is what is tested).
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    assert result.returncode == 0, result.stderr[-3000:]


def test_first_call_inside_a_compiled_function_with_pyperm_imported_before_torch():
    # pyperm imported first registers nothing (it must not import torch); the first compile
    # registers the operators from inside Dynamo's trace, and the graph still has no break.
    _run_python(
        """
        import sys
        import pyperm
        assert "torch" not in sys.modules, "importing pyperm imported torch"
        import torch
        assert not hasattr(torch.ops.pyperm, "linear_sum_assignment")

        def f(a, b):
            cost = torch.cdist(a, b)
            rows, cols = pyperm.linear_sum_assignment(cost)
            return cost[rows, cols].sum()

        a, b = torch.rand(5, 2, dtype=torch.float64), torch.rand(7, 2, dtype=torch.float64)
        got = torch.compile(f, fullgraph=True, backend="eager")(a, b)
        assert torch.isclose(got, f(a, b)), (got, f(a, b))
        assert hasattr(torch.ops.pyperm, "batch_linear_sum_assignment")
        """
    )


# --- torch.export --------------------------------------------------------------------------


class Matcher(torch.nn.Module):
    def forward(self, a, b):
        return matched_cost(a, b)


class BatchMatcher(torch.nn.Module):
    def forward(self, a, b):
        return batch_matched_cost(a, b)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(("module", "op", "shapes"), [
    (Matcher(), LSA, ((6, 2), (8, 2))),
    (BatchMatcher(), BATCH_LSA, ((3, 6, 2), (3, 5, 2))),
])
def test_export_captures_the_operator(device, strict, module, op, shapes):
    example = tuple(_points(device, *s, seed=i) for i, s in enumerate(shapes))
    program = torch.export.export(module, example, strict=strict)
    assert op in [node.target for node in program.graph.nodes]
    fresh = tuple(_points(device, *s, seed=10 + i) for i, s in enumerate(shapes))
    torch.testing.assert_close(program.module()(*fresh), module(*fresh))


def test_exported_program_saves_and_loads(tmp_path):
    example = (_points("cpu", 6, 2, seed=1), _points("cpu", 8, 2, seed=2))
    path = tmp_path / "matcher.pt2"
    torch.export.save(torch.export.export(Matcher(), example), path)
    torch.testing.assert_close(torch.export.load(path).module()(*example), Matcher()(*example))
    # In a process that imported pyperm before torch, register_torch_ops() makes it loadable.
    _run_python(
        f"""
        import pyperm
        import torch
        pyperm.lap.register_torch_ops()
        program = torch.export.load({str(path)!r})
        a, b = torch.rand(6, 2, dtype=torch.float64), torch.rand(8, 2, dtype=torch.float64)
        cost = torch.cdist(a, b)
        rows, cols = pyperm.linear_sum_assignment(cost)
        assert torch.isclose(program.module()(a, b), cost[rows, cols].sum())
        """
    )


class CostMatcher(torch.nn.Module):
    # The cost itself is the input: torch.cdist would add its own guards on the sizes.
    def forward(self, cost):
        rows, cols = pyperm.linear_sum_assignment(cost)
        return cost[rows, cols].sum()


def test_export_with_dynamic_sizes():
    n, m = torch.export.Dim("n", min=2), torch.export.Dim("m", min=2)
    program = torch.export.export(CostMatcher(), (_points("cpu", 6, 8),), dynamic_shapes=({0: n, 1: m},))
    for rows, cols in [(3, 9), (9, 3), (40, 40)]:
        cost = _points("cpu", rows, cols, seed=rows)
        assert float(program.module()(cost)) == pytest.approx(_scipy_objective(cost), rel=1e-12)


# --- forms whose output size depends on the data: pyperm's own operator -------------------
#
# lap's cost_limit keeps only the pairs worth matching, so the output's size is known only
# at run time: pyperm.linear_sum_assignment(cost, cost_limit=...) is captured as
# torch.ops.pyperm.linear_sum_assignment_limited, whose fake implementation asks for a new
# unbacked size bounded by the full matching's. These tests run that operator through the
# public function, as a user's compiled code does.

LIMIT = 0.25
LIMITED_OP = "linear_sum_assignment_limited"


def thresholded_cost(a, b):
    """lap's objective: matched costs plus limit / 2 for every unmatched row and column."""
    cost = torch.cdist(a, b)
    rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=LIMIT)
    unmatched = cost.shape[0] + cost.shape[1] - 2 * rows.shape[0]
    return cost[rows, cols].sum() + LIMIT / 2 * unmatched


def branch_on_count(a, b):
    cost = torch.cdist(a, b)
    rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=LIMIT)
    if rows.shape[0] == 0:  # Python control flow on a size known only at run time
        return cost.new_zeros(())
    return cost[rows, cols].mean()


def cond_on_count(a, b):
    cost = torch.cdist(a, b)
    rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=LIMIT)
    return torch.cond(
        rows.shape[0] == 0,
        lambda c, r, k: c.new_zeros(()),
        lambda c, r, k: c[r, k].mean(),
        (cost, rows, cols),
    )


def _threshold_inputs():
    """Point sets whose matchings keep some pairs under LIMIT and drop others, and one keeping none."""
    close = (_points("cpu", 6, 2, seed=1), _points("cpu", 8, 2, seed=2))
    far = (_points("cpu", 6, 2, seed=3), _points("cpu", 8, 2, seed=4) + 10.0)  # shapes as close's: for export
    counts = [pyperm.linear_sum_assignment(torch.cdist(*pts), cost_limit=LIMIT)[0].shape[0] for pts in (close, far)]
    assert 0 < counts[0] < 6 and counts[1] == 0
    return close, far


@pytest.mark.parametrize("dynamic", [None, True])
def test_data_dependent_threshold_compiles_fullgraph(dynamic):
    recorder = GraphRecorder()
    compiled = torch.compile(thresholded_cost, fullgraph=True, backend=recorder, dynamic=dynamic)
    for a, b in _threshold_inputs():
        torch.testing.assert_close(compiled(a, b), thresholded_cost(a, b))
    assert getattr(torch.ops.pyperm, LIMITED_OP).default in recorder.targets()


def test_data_dependent_threshold_breaks_the_graph_without_fullgraph_unless_captured():
    a, b = _threshold_inputs()[0]
    explained = torch._dynamo.explain(thresholded_cost)(a, b)
    assert explained.graph_break_count == 1
    assert "Dynamic shape operator" in str(explained.break_reasons[0].reason)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        assert torch._dynamo.explain(thresholded_cost)(a, b).graph_break_count == 0


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("fn", [thresholded_cost, cond_on_count])
def test_data_dependent_forms_export(strict, fn):
    class Module(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    close, far = _threshold_inputs()
    program = torch.export.export(Module(), close, strict=strict)
    assert getattr(torch.ops.pyperm, LIMITED_OP).default in [node.target for node in program.graph.nodes]
    torch.testing.assert_close(program.module()(*close), fn(*close))
    torch.testing.assert_close(program.module()(*far), fn(*far))  # the example kept some pairs; this keeps none


def pairs_as_list(a, b):
    cost = torch.cdist(a, b)
    rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=LIMIT)
    return [cost[i, j] for i, j in zip(rows.tolist(), cols.tolist())]


@pytest.mark.parametrize("fn", [branch_on_count, pairs_as_list])
def test_python_control_flow_on_a_data_dependent_count_breaks_fullgraph(fn):
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    a, b = _threshold_inputs()[0]
    with pytest.raises((torch._dynamo.exc.UserError, GuardOnDataDependentSymNode), match="data-dependent expression"):
        torch.compile(fn, fullgraph=True, backend="eager")(a, b)


def test_torch_cond_on_a_data_dependent_count_compiles_fullgraph():
    compiled = torch.compile(cond_on_count, fullgraph=True, backend="eager")
    for a, b in _threshold_inputs():  # both branches: some pairs kept, none kept
        torch.testing.assert_close(compiled(a, b), cond_on_count(a, b))


def ragged_total(a, b0, b1):
    costs = [torch.cdist(a, b0), torch.cdist(a, b1)]
    return torch.stack([c[r, k].sum() for c, (r, k) in zip(costs, pyperm.batch_linear_sum_assignment(costs))])


def test_ragged_lists_compile_with_a_graph_break():
    """A list of matrices has no operator yet: compiled code runs it eagerly, with the eager answer."""
    a, b0, b1 = _points("cpu", 5, 2, seed=6), _points("cpu", 7, 2, seed=7), _points("cpu", 3, 2, seed=8)
    torch.testing.assert_close(torch.compile(ragged_total, backend="eager")(a, b0, b1), ragged_total(a, b0, b1))


# ---------------------------------------------------------------- cost_limit: a data-dependent size
def limited_cost(a, b, limit=0.5):
    """Lap's objective of a thresholded matching: the matched costs plus limit/2 per unmatched row and column."""
    cost = torch.cdist(a, b)
    rows, cols = pyperm.linear_sum_assignment(cost, cost_limit=limit)
    return cost[rows, cols].sum() + limit / 2 * (cost.shape[0] + cost.shape[1] - 2 * rows.shape[0])


@pytest.mark.parametrize("maximize", [False, True])
def test_opcheck_limited(maximize):
    cost = torch.rand(9, 13, dtype=torch.float64)
    torch.library.opcheck(torch.ops.pyperm.linear_sum_assignment_limited, (cost, maximize, 0.4))


def test_compile_fullgraph_captures_a_cost_limit(device):
    a, b = _points(device, 30, 2), _points(device, 20, 2, seed=1)
    recorder = GraphRecorder()
    compiled = torch.compile(limited_cost, fullgraph=True, backend=recorder)
    assert torch.allclose(compiled(a, b), limited_cost(a, b))
    assert len(recorder.graphs) == 1


def test_export_captures_a_cost_limit():
    class Limited(torch.nn.Module):
        def forward(self, a, b):
            return limited_cost(a, b)

    a, b = _points("cpu", 30, 2), _points("cpu", 20, 2, seed=1)
    program = torch.export.export(Limited(), (a, b))
    assert "pyperm.linear_sum_assignment_limited" in str(program.graph)
    assert torch.allclose(program.module()(a, b), limited_cost(a, b))
