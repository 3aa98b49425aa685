"""The pipeline forms as one uniform stack (pyperm.lap._padded_batch), the path of CUDA arrays.

The module is device-agnostic, so these tests run it on CPU tensors with the CPU stack solver
and compare every problem with the CPU's own ragged path, by objective (ties allow several
optima). tests/test_cuda.py runs the same forms through the public functions on a GPU.
"""

import math

import numpy as np
import pytest

import pyperm
from pyperm.lap import _padded_batch as pb
from pyperm.testing import iou_cost, limited_objective

torch = pytest.importorskip("torch")


def solve_stack(stack, maximize):
    """The uniform-stack solver the CUDA path uses, here the CPU one."""
    assert stack.dim() == 3 and stack.shape[1] <= stack.shape[2], "the stack puts each problem's smaller side in rows"
    return pyperm.batch_linear_sum_assignment(stack, maximize)


def _objective(cost, rows, cols, limit, maximize):
    cost = np.asarray(cost, dtype=np.float64)
    if limit is None or limit == math.inf:
        return float(cost[rows, cols].sum())
    return limited_objective(cost, rows, cols, limit, maximize)


def _assert_same_optima(costs, got, want, limit, maximize=False):
    assert len(got) == len(want) == len(costs)
    for b, (cost, (rows, cols), (ref_rows, ref_cols)) in enumerate(zip(costs, got, want)):
        assert rows.dtype == cols.dtype == torch.int64, b
        rows, cols = rows.numpy(), cols.numpy()
        assert np.all(np.diff(rows) > 0) and len(np.unique(cols)) == len(cols), b
        if limit is None or limit == math.inf:
            assert len(rows) == min(cost.shape), b
        assert np.all(np.isfinite(np.asarray(cost, dtype=np.float64)[rows, cols])), b
        value = _objective(cost, rows, cols, limit, maximize)
        ref = _objective(cost, ref_rows, ref_cols, limit, maximize)
        assert value == pytest.approx(ref, rel=1e-5, abs=1e-5), (b, value, ref)


def _random_costs(rng, count, max_side=9, forbid=0.0):
    costs = []
    for k in range(count):
        n, m = (int(v) for v in rng.integers(0, max_side + 1, 2))
        cost = iou_cost(n, m, rng) if k % 2 else rng.standard_normal((n, m))
        if forbid:
            cost[rng.random(cost.shape) < forbid] = np.inf
        costs.append(cost)
    return costs


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("limit", [None, 0.0, 0.5, 2.0, math.inf])
def test_sequence_matches_the_cpu_path(limit, maximize):
    rng = np.random.default_rng(1)
    for _ in range(20):
        costs = _random_costs(rng, int(rng.integers(0, 7)))
        if maximize:
            costs = [-c for c in costs]
        want = pyperm.batch_linear_sum_assignment(costs, maximize, cost_limit=limit)
        problems = pb.sequence_problems([torch.from_numpy(c) for c in costs], limit)
        got = pb.solve_problems(problems, maximize, limit, solve_stack, "costs")
        _assert_same_optima(costs, got, want, limit, maximize)


@pytest.mark.parametrize("limit", [None, 0.3, math.inf])
def test_forbidden_pairs_and_limits(limit):
    """Forbidden pairs that leave rows unmatched under a limit, against the CPU path; every
    problem keeps a complete matching (the diagonal) so that an infinite limit has lap's answer."""
    rng = np.random.default_rng(2)
    for _ in range(20):
        costs = _random_costs(rng, 5, forbid=0.4)
        for c in costs:
            k = min(c.shape)
            c[np.arange(k), np.arange(k)] = rng.random(k)
        want = pyperm.batch_linear_sum_assignment(costs, cost_limit=limit)
        got = pb.solve_problems(pb.sequence_problems([torch.from_numpy(c) for c in costs], limit), False, limit,
                                solve_stack, "costs")
        _assert_same_optima(costs, got, want, limit)


@pytest.mark.parametrize("limit", [None, 0.5])
def test_padded_stack_with_sizes_of_both_orientations(limit):
    """Tall, wide, square and empty problems in one stack; the padding holds NaN, which no
    problem reads."""
    rng = np.random.default_rng(3)
    stack = rng.random((6, 7, 9))
    sizes = np.array([(7, 9), (7, 2), (3, 9), (0, 5), (4, 4), (6, 0)], dtype=np.int64)
    for b, (n, m) in enumerate(sizes):
        stack[b, n:, :] = np.nan
        stack[b, :, m:] = np.nan
    blocks = [stack[b, :n, :m] for b, (n, m) in enumerate(sizes)]
    want = pyperm.batch_linear_sum_assignment(blocks, cost_limit=limit)
    got = pb.solve_problems(pb.padded_problems(torch.from_numpy(stack), sizes, limit), False, limit, solve_stack, "costs")
    _assert_same_optima(blocks, got, want, limit)
    assert [len(r) for r, _ in got][:6] == ([7, 2, 3, 0, 4, 0] if limit is None else [len(r) for r, _ in got])


def test_padded_stack_without_sizes_and_a_detr_shape():
    rng = np.random.default_rng(4)
    queries = rng.standard_normal((8, 30, 5)).astype(np.float32)
    targets = rng.integers(0, 6, 8)
    sizes = np.stack([np.full(8, 30), targets], axis=1)
    blocks = [queries[b, :, :t] for b, t in enumerate(targets)]
    got = pb.solve_problems(pb.padded_problems(torch.from_numpy(queries), sizes, None), False, None, solve_stack, "costs")
    _assert_same_optima(blocks, got, pyperm.batch_linear_sum_assignment(blocks), None)
    full = pb.solve_problems(pb.padded_problems(torch.from_numpy(queries), None, None), True, None, solve_stack, "costs")
    rows, cols = pyperm.batch_linear_sum_assignment(queries, maximize=True)
    _assert_same_optima(list(queries), full, list(zip(rows, cols)), None)


def test_dtypes_follow_the_cpu_rule():
    """float32 stays float32 (all elements float32), anything else is solved in float64; a
    float64 limit keeps its digits."""
    f32 = [torch.ones(2, 3, dtype=torch.float32), torch.zeros(1, 1, dtype=torch.float32)]
    assert pb.sequence_problems(f32, None).flat.dtype == torch.float32
    mixed = [torch.ones(2, 3, dtype=torch.float32), torch.ones(2, 2, dtype=torch.int64)]
    assert pb.sequence_problems(mixed, None).flat.dtype == torch.float64
    assert pb.padded_problems(torch.ones(2, 2, 2, dtype=torch.float16), None, None).flat.dtype == torch.float64
    # 0.1 + 0.2 costs just more than 0.3 in float64 (left unmatched); rounded to float32 the
    # limit would exceed it (matched).
    cost = torch.tensor([[0.1 + 0.2, 5.0], [5.0, 5.0]], dtype=torch.float64)
    (rows, _), = pb.solve_problems(pb.sequence_problems([cost], 0.3), False, 0.3, solve_stack, "cost")
    assert rows.numel() == 0
    limit = 0.3000000000000001
    (rows, cols), = pb.solve_problems(pb.sequence_problems([cost], limit), False, limit, solve_stack, "cost")
    assert rows.tolist() == [0] and cols.tolist() == [0]


def test_limit_zero_matches_only_negative_costs():
    cost = torch.tensor([[-1.0, 2.0, 0.5], [3.0, -0.25, 4.0]], dtype=torch.float64)
    (rows, cols), = pb.solve_problems(pb.sequence_problems([cost], 0.0), False, 0.0, solve_stack, "cost")
    assert rows.tolist() == [0, 1] and cols.tolist() == [0, 1]
    (rows, cols), = pb.solve_problems(pb.sequence_problems([-cost], 0.0), True, 0.0, solve_stack, "cost")
    assert rows.tolist() == [0, 1] and cols.tolist() == [0, 1]


def test_errors_name_the_problem():
    bad = torch.ones(2, 2, dtype=torch.float64)
    bad[0] = math.inf
    good = torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="problem 2 .*infeasible"):
        pb.solve_problems(pb.sequence_problems([good, torch.ones(0, 2), bad], None), False, None, solve_stack, "costs")
    with pytest.raises(ValueError, match="problem 1 .*invalid numeric entries"):
        pb.solve_problems(pb.sequence_problems([good, torch.tensor([[math.nan]])], None), False, None, solve_stack, "costs")
    with pytest.raises(ValueError, match="invalid numeric entries"):  # the wrong infinity when maximising
        pb.solve_problems(pb.sequence_problems([good, bad], None), True, None, solve_stack, "costs")
    # A finite limit leaves the forbidden row unmatched; an infinite one says what it cannot do.
    (_, _), (rows, _) = pb.solve_problems(pb.sequence_problems([good, bad], 5.0), False, 5.0, solve_stack, "costs")
    assert rows.tolist() == [1]
    with pytest.raises(ValueError, match="cost_limit=inf, a problem of costs .* largest matching"):
        pb.solve_problems(pb.sequence_problems([good, bad], math.inf), False, math.inf, solve_stack, "costs")


def test_empty_forms():
    assert pb.solve_problems(pb.sequence_problems([], None), False, None, solve_stack, "costs") == []
    answers = pb.solve_problems(pb.sequence_problems([torch.ones(0, 3), torch.ones(4, 0)], 1.0), False, 1.0,
                                solve_stack, "costs")
    assert [(r.numel(), c.numel()) for r, c in answers] == [(0, 0), (0, 0)]
    assert pb.solve_problems(pb.padded_problems(torch.ones(0, 3, 3), None, None), False, None, solve_stack, "costs") == []


def test_cuda_forms_without_a_gpu_say_why():
    if pyperm.cuda_available():
        pytest.skip("checks the error without a usable GPU")
    fake = type("Fake", (), {"__cuda_array_interface__": {"shape": (2, 2, 2), "typestr": "<f8", "data": (8, False),
                                                          "version": 3, "strides": None}})()
    fake2 = type("Fake", (), {"__cuda_array_interface__": {"shape": (2, 2), "typestr": "<f8", "data": (8, False),
                                                           "version": 3, "strides": None}})()
    with pytest.raises(RuntimeError, match="CUDA"):
        pyperm.batch_linear_sum_assignment(fake, sizes=[(2, 2), (1, 1)])
    with pytest.raises(RuntimeError, match="CUDA"):
        pyperm.batch_linear_sum_assignment([fake2, fake2])
    with pytest.raises(RuntimeError, match="CUDA"):
        pyperm.linear_sum_assignment(fake2, cost_limit=1.0)


def test_host_and_device_matrices_do_not_mix():
    fake = type("Fake", (), {"__cuda_array_interface__": {"shape": (2, 2), "typestr": "<f8", "data": (8, False),
                                                          "version": 3, "strides": None}})()
    with pytest.raises(ValueError, match=r"costs\[0\] is not a CUDA array but costs\[1\] is"):
        pyperm.batch_linear_sum_assignment([np.ones((2, 2)), fake])


def test_the_public_functions_reach_the_device_path(monkeypatch):
    """The CUDA branches of pyperm.lap._ragged, run here on CPU tensors standing in for device
    ones, with the CPU stack solver standing in for the CUDA one."""
    from pyperm.lap import _cuda, _ragged

    calls = []

    def device_solver(stack, maximize):
        calls.append(tuple(stack.shape))
        return solve_stack(stack, maximize)

    monkeypatch.setattr(_ragged, "is_cuda_input", lambda x: isinstance(x, torch.Tensor))
    monkeypatch.setattr(_ragged, "as_cuda_tensor", lambda x, name, ndim: (x.to(torch.float64), "torch"))
    monkeypatch.setattr(_cuda, "batch_linear_sum_assignment", device_solver)
    rng = np.random.default_rng(5)
    blocks = _random_costs(rng, 6)
    got = pyperm.batch_linear_sum_assignment([torch.from_numpy(b) for b in blocks], cost_limit=0.5)
    _assert_same_optima(blocks, got, pyperm.batch_linear_sum_assignment(blocks, cost_limit=0.5), 0.5)
    stack = rng.random((3, 6, 4))
    sizes = [(6, 4), (2, 3), (0, 0)]
    got = pyperm.batch_linear_sum_assignment(torch.from_numpy(stack), sizes=sizes)
    views = [stack[b, :n, :m] for b, (n, m) in enumerate(sizes)]
    _assert_same_optima(views, got, pyperm.batch_linear_sum_assignment(views), None)
    rows, cols = pyperm.linear_sum_assignment(torch.from_numpy(blocks[0]), cost_limit=0.5)
    ref_rows, ref_cols = pyperm.linear_sum_assignment(blocks[0], cost_limit=0.5)
    assert _objective(blocks[0], rows.numpy(), cols.numpy(), 0.5, False) == pytest.approx(
        _objective(blocks[0], ref_rows, ref_cols, 0.5, False))
    assert len(calls) == 3  # one stack solve per call
    with pytest.raises(ValueError, match=r"sizes\[1\] = \(7, 3\) is out of range"):
        pyperm.batch_linear_sum_assignment(torch.from_numpy(stack), sizes=[(6, 4), (7, 3), (0, 0)])
