"""The CUDA assignment solver: parity with the CPU solver, semantics, array plumbing, errors.

Tests marked ``cuda`` need a GPU and skip without one; the others check, on any machine,
that a CUDA build imports cleanly, that the CPU path is untouched by it, and that asking
for CUDA where none can run fails with a clear error.
"""

from __future__ import annotations

import functools
import importlib.util
import zlib

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment as scipy_lsa

import pyperm
from pyperm._arrays import is_cuda_input, is_dlpack_cuda
from pyperm.lap import _cuda as lap_cuda
from pyperm.testing import limited_objective
from pyperm.xcorr import _cuda as xcorr_cuda

requires_cuda = pytest.mark.skipif(
    not pyperm.cuda_available(), reason=f"needs a CUDA device and pyperm's CUDA build: {pyperm.cuda_unavailable_reason()}"
)
cuda = [requires_cuda, pytest.mark.cuda]

METHODS = ["auto", "block", "device"]
DTYPES = ["float32", "float64"]


# ----------------------------------------------------------------------------- helpers
def seed_of(*parts) -> int:
    """A seed that is the same in every run (unlike hash(), which Python randomises)."""
    return zlib.crc32(repr(parts).encode())


def _torch():
    return pytest.importorskip("torch")


def make_cost(kind: str, n: int, m: int, rng: np.random.Generator, dtype: str = "float64") -> np.ndarray:
    """The case families of the parity tests (as numpy, then moved to the device)."""
    if kind == "uniform":
        c = rng.random((n, m))
    elif kind == "ties":  # integer costs with many ties
        c = rng.integers(0, 4, size=(n, m)).astype(np.float64)
    elif kind == "lowrank":  # -(A @ B.T): the similarity matrices of weight matching
        a, b = rng.standard_normal((n, 8)), rng.standard_normal((m, 8))
        c = -(a @ b.T)
    elif kind == "offsets":  # hard instances: random row and column offsets
        c = rng.random((n, m)) + 100 * rng.random((n, 1)) + 100 * rng.random((1, m))
    elif kind == "forbidden":  # +inf marks forbidden pairs; the diagonal keeps it feasible
        c = rng.random((n, m))
        c[rng.random((n, m)) < 0.3] = np.inf
        k = min(n, m)
        c[np.arange(k), np.arange(k)] = rng.random(k)
    else:  # pragma: no cover - a typo in a parametrisation
        raise ValueError(kind)
    return c.astype(dtype)


def objective(cost: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> float:
    return float(cost[rows, cols].astype(np.float64).sum())


def objective_tolerance(cost: np.ndarray) -> float:
    """How far a solver working in the cost's precision may end from the exact optimum: n rounding
    errors of reduced costs, each a few eps of the largest |entry|. Not relative to the objective:
    on the "offsets" family a large constant would hide a wrong matching."""
    finite = np.abs(cost[np.isfinite(cost)])
    scale = max(float(finite.max()) if finite.size else 0.0, 1.0)
    return 4 * min(cost.shape[-2:]) * float(np.finfo(cost.dtype).eps) * scale


def assert_optimal(cost: np.ndarray, rows, cols, maximize: bool = False) -> None:
    """A sorted matching of size min(n, m) with scipy's objective (in the cost's precision)."""
    rows, cols = np.asarray(rows), np.asarray(cols)
    n, m = cost.shape
    assert rows.shape == cols.shape == (min(n, m),)
    assert np.all(np.diff(rows) > 0)
    assert len(np.unique(cols)) == len(cols)
    r_ref, c_ref = scipy_lsa(cost.astype(np.float64), maximize=maximize)
    want = objective(cost, r_ref, c_ref)
    got = objective(cost, rows, cols)
    assert abs(got - want) <= objective_tolerance(cost), (got, want)


def to_cuda(a: np.ndarray):
    torch = _torch()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def cpu(t) -> np.ndarray:
    return t.cpu().numpy()


class CudaArrayInterfaceOnly:
    """A device array known only through __cuda_array_interface__ (as Numba or CuPy give)."""

    def __init__(self, t):
        self._t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


class DLPackOnly:
    """A device array known only through DLPack (as JAX gives)."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, *args, **kwargs):
        return self._t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


# ------------------------------------------------------------- tests that run anywhere
def test_cuda_build_imports_and_reports_itself():
    built = importlib.util.find_spec("pyperm._cuda") is not None
    assert pyperm.cuda_built() is built
    if built:
        from pyperm import _cuda

        assert _cuda.device_count() >= 0  # 0 without a driver or GPU, never a crash
        assert _cuda.runtime_version().count(".") == 1
        assert pyperm.cuda_available() is (_cuda.device_count() > 0)


def test_unusable_cuda_says_why():
    """No silent skip: where the CUDA kernels cannot run, pyperm says why (the runtime's own error, such
    as a driver older than the CUDA 13 runtime), and the error of a CUDA call says the same."""
    from pyperm._ext import cuda_module

    reason = pyperm.cuda_unavailable_reason()
    assert (reason is None) is pyperm.cuda_available()
    if reason is None:
        return
    assert isinstance(reason, str) and reason
    if pyperm.cuda_built():
        from pyperm import _cuda

        error = _cuda.device_error()
        assert error == "" if _cuda.device_count() > 0 else error in reason
    with pytest.raises(RuntimeError) as raised:
        cuda_module()
    assert str(raised.value) == reason


def test_pyperm_can_use_the_gpu_torch_sees():
    """Fails (rather than every GPU test skipping) when torch has a GPU that pyperm's CUDA build cannot use."""
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    assert pyperm.cuda_available(), pyperm.cuda_unavailable_reason()


def test_parity_tolerance_catches_a_wrong_matching():
    """The parity checks' tolerance is not relative to the objective: on "offsets" costs (a large
    constant in every matching) one swapped pair must still fail, while the CPU optimum passes."""
    cost = make_cost("offsets", 128, 128, np.random.default_rng(3), "float32")
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert_optimal(cost, rows, cols)
    wrong = cols.copy()
    wrong[[0, 1]] = wrong[[1, 0]]
    assert objective(cost, rows, wrong) - objective(cost, rows, cols) < 1e-4 * objective(cost, rows, cols)
    with pytest.raises(AssertionError):
        assert_optimal(cost, rows, wrong)


def test_cpu_solver_works_with_cuda_module_present():
    if pyperm.cuda_built():
        from pyperm import _cuda  # noqa: F401  (loaded, as after a CUDA call)
    cost = np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert rows.tolist() == [0, 1, 2] and cols.tolist() == [1, 0, 2]
    rows, cols = pyperm.batch_linear_sum_assignment(np.stack([cost, cost.T]))
    assert rows.shape == cols.shape == (2, 3)


@pytest.mark.skipif(pyperm.cuda_available(), reason="checks the error without a usable GPU")
def test_cuda_input_without_gpu_raises_runtime_error():
    # A fake device array: the dispatch must stop at "no CUDA" before touching the pointer.
    fake = type("Fake", (), {"__cuda_array_interface__": {"shape": (3, 3), "typestr": "<f4", "data": (8, False),
                                                          "version": 3, "strides": None}})()
    with pytest.raises(RuntimeError, match="CUDA"):
        pyperm.linear_sum_assignment(fake)
    fake3 = type("Fake", (), {"__cuda_array_interface__": {"shape": (2, 3, 3), "typestr": "<f8", "data": (8, False),
                                                           "version": 3, "strides": None}})()
    with pytest.raises(RuntimeError, match="CUDA"):
        pyperm.batch_linear_sum_assignment(fake3)


def test_cuda_input_validation_before_device_access():
    bad_rank = type("Fake", (), {"__cuda_array_interface__": {"shape": (3,), "typestr": "<f4", "data": (8, False),
                                                              "version": 3}})()
    with pytest.raises(ValueError, match="cost must be a 2-D array"):
        pyperm.linear_sum_assignment(bad_rank)
    complex_ = type("Fake", (), {"__cuda_array_interface__": {"shape": (2, 2), "typestr": "<c8", "data": (8, False),
                                                              "version": 3}})()
    with pytest.raises(ValueError, match="must be real"):
        pyperm.linear_sum_assignment(complex_)
    strings = type("Fake", (), {"__cuda_array_interface__": {"shape": (2, 2), "typestr": "<U1", "data": (8, False),
                                                             "version": 3}})()
    with pytest.raises(ValueError, match="numerical entries"):
        pyperm.linear_sum_assignment(strings)
    with pytest.raises(ValueError, match="method must be one of 'auto', 'block', 'device', got 'fastest'"):
        lap_cuda.linear_sum_assignment(bad_rank, method="fastest")
    for option in ("threads", "stage", "state_smem", "max_rounds", "patience"):  # no silent truncation
        with pytest.raises(TypeError, match=f"{option} must be an int, got float"):
            lap_cuda.linear_sum_assignment(bad_rank, **{option: 1.5})
    with pytest.raises(TypeError, match="maximize must be a bool"):
        lap_cuda.linear_sum_assignment(bad_rank, maximize="yes")
    with pytest.raises(TypeError, match="not a CUDA array"):
        lap_cuda.linear_sum_assignment(np.zeros((2, 2)))


def test_dlpack_cuda_detection():
    assert not is_dlpack_cuda(np.zeros(3))
    assert not is_dlpack_cuda([1, 2])
    fake = type("Fake", (), {"__dlpack_device__": lambda self: (2, 0)})()
    assert is_dlpack_cuda(fake)
    broken = type("Fake", (), {"__dlpack_device__": lambda self: 1 / 0})()
    assert not is_dlpack_cuda(broken)
    assert is_cuda_input(fake)
    assert not is_cuda_input(np.zeros(3))


def test_torch_cpu_tensor_stays_on_cpu():
    torch = _torch()
    cost = torch.tensor([[4.0, 1.0], [2.0, 0.0]])
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert isinstance(rows, torch.Tensor) and rows.device.type == "cpu"
    assert cols.tolist() == [1, 0]


def test_warm_start_rejects_non_tensors():
    with pytest.raises(TypeError, match="torch tensors"):
        lap_cuda.solve_square_warm(np.zeros((2, 2)), np.zeros(2))


# ------------------------------------------------------------------- GPU: parity
FAMILIES = ["uniform", "ties", "lowrank", "offsets", "forbidden"]
SHAPES = [(1, 1), (1, 7), (7, 1), (3, 3), (5, 8), (8, 5), (64, 64), (100, 37), (37, 100), (257, 300)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
@pytest.mark.cuda
@requires_cuda
def test_parity_single(dtype, kind, shape, method, maximize):
    rng = np.random.default_rng(seed_of(dtype, kind, shape, method, maximize))
    cost = make_cost(kind, *shape, rng, dtype)
    if maximize:
        cost = np.where(np.isinf(cost), -np.inf, cost).astype(dtype)
    rows, cols = lap_cuda.linear_sum_assignment(to_cuda(cost), maximize, method=method)
    assert_optimal(cost, cpu(rows), cpu(cols), maximize)


@functools.lru_cache(maxsize=None)
def large_case(dtype: str, kind: str, n: int) -> tuple[np.ndarray, float]:
    """A large square problem and its optimal objective by the CPU solver (computed once)."""
    cost = make_cost(kind, n, n, np.random.default_rng(seed_of(kind, n)), dtype)
    ref_rows, ref_cols = pyperm.linear_sum_assignment(cost)
    return cost, objective(cost, ref_rows, ref_cols)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["uniform", "ties", "lowrank", "offsets"])
@pytest.mark.parametrize("n", [512, 1024, 2048])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.cuda
@requires_cuda
def test_parity_large(dtype, kind, n, method):
    """Offsets in float32 are the hard case of the augmenting row reduction: lowerings too small to move
    a dual once let two rows trade a column until a budget of n moves per free row ran out (seconds)."""
    if kind != "uniform" and n == 2048 and dtype == "float64":
        pytest.skip("the CPU reference is slow here; float32 covers this size")
    if method == "block" and n == 2048 and kind != "uniform":
        pytest.skip("one block per problem is the small-problem strategy; 1024 covers it")
    cost, want = large_case(dtype, kind, n)
    rows, cols = lap_cuda.linear_sum_assignment(to_cuda(cost), method=method)
    got = objective(cost, cpu(rows), cpu(cols))
    assert abs(got - want) <= objective_tolerance(cost), (got, want)
    assert np.array_equal(np.sort(cpu(cols)), np.arange(n))


@pytest.mark.parametrize("shape", [(1024, 1500), (1500, 1024)], ids=["wide", "tall"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.cuda
@requires_cuda
def test_parity_large_rectangular(shape, method):
    cost = make_cost("uniform", *shape, np.random.default_rng(7), "float32")
    rows, cols = lap_cuda.linear_sum_assignment(to_cuda(cost), method=method)
    assert_optimal(cost, cpu(rows), cpu(cols))


@pytest.mark.slow
@pytest.mark.cuda
@requires_cuda
def test_parity_8192():
    cost = np.random.default_rng(8192).random((8192, 8192), dtype=np.float32)
    rows, cols = pyperm.linear_sum_assignment(to_cuda(cost))
    ref_rows, ref_cols = pyperm.linear_sum_assignment(cost)
    want = objective(cost, ref_rows, ref_cols)
    assert abs(objective(cost, cpu(rows), cpu(cols)) - want) <= objective_tolerance(cost)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (16, 5, 5), (64, 32, 32), (33, 20, 45), (33, 45, 20), (256, 128, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.cuda
@requires_cuda
def test_parity_batch(dtype, kind, shape, method):
    rng = np.random.default_rng(seed_of(dtype, kind, shape))
    b, n, m = shape
    costs = np.stack([make_cost(kind, n, m, rng, dtype) for _ in range(b)])
    rows, cols = lap_cuda.batch_linear_sum_assignment(to_cuda(costs), method=method)
    assert rows.shape == cols.shape == (b, min(n, m))
    rows, cols = cpu(rows), cpu(cols)
    ref_rows, ref_cols = pyperm.batch_linear_sum_assignment(costs)
    for k in range(b):
        want = objective(costs[k], ref_rows[k], ref_cols[k])
        got = objective(costs[k], rows[k], cols[k])
        assert abs(got - want) <= objective_tolerance(costs[k]), (k, got, want)
        assert np.all(np.diff(rows[k]) > 0) and len(np.unique(cols[k])) == min(n, m)


@pytest.mark.parametrize("variant", [
    {"stage": 1}, {"stage": 0, "state_smem": 1}, {"stage": 0, "state_smem": 0},
    {"threads": 32}, {"threads": 1024}, {"method": "device", "patience": 1}, {"method": "device", "max_rounds": 0},
    {"method": "device", "state_smem": 0},
], ids=str)
@pytest.mark.cuda
@requires_cuda
def test_kernel_variants_agree(variant):
    """Every launch configuration the heuristics can pick gives optimal answers."""
    rng = np.random.default_rng(11)
    costs = np.stack([make_cost(k, 96, 96, rng, "float32") for k in FAMILIES for _ in range(4)])
    kwargs = {"method": "block", **variant}
    rows, cols, stats = lap_cuda.batch_linear_sum_assignment(to_cuda(costs), return_stats=True, **kwargs)
    assert stats["method"] == kwargs["method"]
    if "stage" in variant:
        assert stats["staged"] is bool(variant["stage"])
    if "state_smem" in variant:
        assert stats["state_in_shared"] is bool(variant["state_smem"])
    for k in range(len(costs)):
        assert_optimal(costs[k], cpu(rows[k]), cpu(cols[k]))


# --------------------------------------------------------------- GPU: semantics
@pytest.mark.cuda
@requires_cuda
def test_output_is_int64_on_input_device():
    torch = _torch()
    cost = torch.rand(6, 9, device="cuda")
    rows, cols = pyperm.linear_sum_assignment(cost)
    for t in (rows, cols):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device == cost.device
    rows, cols = pyperm.batch_linear_sum_assignment(cost[None].expand(3, 6, 9))
    assert rows.shape == (3, 6) and rows.dtype == torch.int64 and rows.device == cost.device


@pytest.mark.cuda
@requires_cuda
def test_second_device():
    torch = _torch()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cost = torch.rand(50, 50, device="cuda:1")
    rows, cols = pyperm.linear_sum_assignment(cost)
    assert rows.device == cost.device and torch.cuda.current_device() == 0
    assert_optimal(cost.cpu().numpy(), cpu(rows), cpu(cols))


@pytest.mark.cuda
@requires_cuda
def test_constant_matrix_gives_identity():
    torch = _torch()
    for method in METHODS:
        rows, cols = lap_cuda.linear_sum_assignment(torch.ones(300, 300, device="cuda"), method=method)
        assert torch.equal(cols.cpu(), torch.arange(300))


@pytest.mark.cuda
@requires_cuda
def test_deterministic():
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(0)
    cost = torch.randint(0, 5, (700, 700), device="cuda", generator=g).float()
    for method in METHODS:
        first = lap_cuda.linear_sum_assignment(cost, method=method)[1]
        for _ in range(3):
            assert torch.equal(lap_cuda.linear_sum_assignment(cost, method=method)[1], first)


@pytest.mark.cuda
@requires_cuda
def test_non_default_stream():
    torch = _torch()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Produced on the side stream and solved there, without synchronising by hand.
        cost = torch.rand(400, 400, device="cuda") * 3 + torch.arange(400, device="cuda")[:, None] * 1e-3
        rows, cols = pyperm.linear_sum_assignment(cost)
        brows, bcols = pyperm.batch_linear_sum_assignment(cost.view(4, 100, 400))
    stream.synchronize()
    assert_optimal(cost.cpu().numpy(), cpu(rows), cpu(cols))
    for k in range(4):
        assert_optimal(cost.view(4, 100, 400)[k].cpu().numpy(), cpu(brows[k]), cpu(bcols[k]))


@pytest.mark.cuda
@requires_cuda
def test_strided_and_converted_inputs():
    torch = _torch()
    base = torch.rand(40, 60, device="cuda", dtype=torch.float64)
    for view in (base.t(), base[::2, 1::3], base[:, :30]):
        rows, cols = pyperm.linear_sum_assignment(view)
        assert_optimal(view.cpu().numpy(), cpu(rows), cpu(cols))
    ints = torch.randint(0, 9, (30, 30), device="cuda")
    for t in (ints, ints.to(torch.float16), ints > 4):
        rows, cols = pyperm.linear_sum_assignment(t)
        assert_optimal(t.double().cpu().numpy(), cpu(rows), cpu(cols))
    batch = torch.rand(5, 20, 30, device="cuda").transpose(1, 2)  # (5, 30, 20), non-contiguous
    rows, cols = pyperm.batch_linear_sum_assignment(batch)
    for k in range(5):
        assert_optimal(batch[k].cpu().numpy(), cpu(rows[k]), cpu(cols[k]))


@pytest.mark.cuda
@requires_cuda
def test_cuda_array_interface_and_dlpack_inputs():
    torch = _torch()
    t = torch.rand(25, 31, device="cuda")
    for wrapped in (CudaArrayInterfaceOnly(t), DLPackOnly(t)):
        rows, cols = pyperm.linear_sum_assignment(wrapped)
        assert isinstance(rows, torch.Tensor) and rows.device == t.device
        assert_optimal(t.cpu().numpy(), cpu(rows), cpu(cols))
    tb = torch.rand(3, 8, 8, device="cuda", dtype=torch.float64).transpose(1, 2)
    rows, cols = pyperm.batch_linear_sum_assignment(CudaArrayInterfaceOnly(tb))
    for k in range(3):
        assert_optimal(tb[k].cpu().numpy(), cpu(rows[k]), cpu(cols[k]))


@pytest.mark.cuda
@requires_cuda
def test_empty_shapes():
    torch = _torch()
    for shape in [(0, 0), (0, 5), (5, 0)]:
        rows, cols = pyperm.linear_sum_assignment(torch.zeros(shape, device="cuda"))
        assert rows.shape == cols.shape == (0,) and rows.is_cuda
    for shape in [(0, 3, 3), (2, 0, 3), (2, 3, 0)]:
        rows, cols = pyperm.batch_linear_sum_assignment(torch.zeros(shape, device="cuda"))
        assert rows.shape == (shape[0], min(shape[1:])) and rows.is_cuda


# ------------------------------------------------------------------- GPU: errors
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.cuda
@requires_cuda
def test_invalid_entries(dtype, method):
    torch = _torch()
    dt = getattr(torch, dtype)
    for bad, maximize in [(float("nan"), False), (float("-inf"), False), (float("inf"), True), (float("nan"), True)]:
        cost = torch.rand(300, 300, device="cuda", dtype=dt)
        cost[123, 45] = bad
        with pytest.raises(ValueError, match="matrix contains invalid numeric entries"):
            lap_cuda.linear_sum_assignment(cost, maximize, method=method)
    costs = torch.rand(4, 6, 6, device="cuda", dtype=dt)
    costs[2, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="problem 2 of the batch: matrix contains invalid numeric entries"):
        lap_cuda.batch_linear_sum_assignment(costs, method=method)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(1, 1), (300, 300), (5, 300), (300, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.cuda
@requires_cuda
def test_infeasible(dtype, method, shape):
    torch = _torch()
    dt = getattr(torch, dtype)
    n, m = shape
    cost = torch.rand(n, m, device="cuda", dtype=dt)
    if n <= m:
        cost[: min(2, n)] = float("inf")  # rows with no allowed column
    else:
        cost[:, : min(2, m)] = float("inf")
    with pytest.raises(ValueError, match="cost matrix is infeasible"):
        lap_cuda.linear_sum_assignment(cost, method=method)
    # Forbidden (-inf) when maximising: the same.
    with pytest.raises(ValueError, match="cost matrix is infeasible"):
        lap_cuda.linear_sum_assignment(-cost, True, method=method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.cuda
@requires_cuda
def test_infeasible_subtle(method):
    """Every row and column has an allowed entry, yet no perfect matching exists."""
    torch = _torch()
    cost = torch.full((400, 400), float("inf"), device="cuda")
    cost[:, 0] = 1.0  # rows 0..398 can only use column 0 ...
    cost[399] = 2.0  # ... and row 399 can use anything
    with pytest.raises(ValueError, match="cost matrix is infeasible"):
        lap_cuda.linear_sum_assignment(cost, method=method)
    costs = torch.rand(3, 50, 50, device="cuda")
    costs[1, :, :] = float("inf")
    costs[1, :, 0] = 1.0
    with pytest.raises(ValueError, match="problem 1 of the batch: cost matrix is infeasible"):
        lap_cuda.batch_linear_sum_assignment(costs, method=method)


@pytest.mark.cuda
@requires_cuda
def test_batch_reports_lowest_failing_problem():
    torch = _torch()
    costs = torch.rand(6, 10, 10, device="cuda")
    costs[4, 3, 3] = float("nan")
    costs[2, :2] = float("inf")
    with pytest.raises(ValueError, match="problem 2 of the batch: cost matrix is infeasible"):
        pyperm.batch_linear_sum_assignment(costs)


# ----------------------------------------------------------------- the pipeline forms on the device
def _limited_or_plain(cost, rows, cols, limit, maximize):
    cost = np.asarray(cost, dtype=np.float64)
    return objective(cost, rows, cols) if limit is None else limited_objective(cost, rows, cols, limit, maximize)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("limit", [None, 0.4])
@pytest.mark.parametrize("maximize", [False, True])
def test_ragged_forms_on_the_device(maximize, limit):
    """A list of device tensors, a padded stack with sizes (DETR's shape) and one matrix with a
    limit: answers on the device, with the CPU path's objectives."""
    torch = _torch()
    rng = np.random.default_rng(seed_of("ragged", maximize, limit))
    blocks = [rng.random((int(n), int(m))).astype(np.float32) for n, m in rng.integers(0, 40, (12, 2))]
    want = pyperm.batch_linear_sum_assignment(blocks, maximize, cost_limit=limit)
    got = pyperm.batch_linear_sum_assignment([to_cuda(b) for b in blocks], maximize, cost_limit=limit)
    stack = rng.standard_normal((64, 300, 50)).astype(np.float32)
    sizes = np.stack([np.full(64, 300), rng.integers(0, 51, 64)], axis=1)
    views = [stack[b, :n, :m] for b, (n, m) in enumerate(sizes)]
    want += pyperm.batch_linear_sum_assignment(views, maximize, cost_limit=limit)
    got += pyperm.batch_linear_sum_assignment(to_cuda(stack), maximize, sizes=sizes, cost_limit=limit)
    for b, (cost, (rows, cols), (ref_rows, ref_cols)) in enumerate(zip(blocks + views, got, want)):
        assert rows.device.type == "cuda" and rows.dtype == torch.int64 and cols.dtype == torch.int64
        rows, cols = cpu(rows), cpu(cols)
        assert np.all(np.diff(rows) > 0) and len(np.unique(cols)) == len(cols), b
        got_value, want_value = (_limited_or_plain(cost, r, c, limit, maximize)
                                 for r, c in ((rows, cols), (ref_rows, ref_cols)))
        assert abs(got_value - want_value) <= objective_tolerance(cost) + 1e-4, (b, got_value, want_value)
    if limit is not None:
        rows, cols = pyperm.linear_sum_assignment(to_cuda(blocks[0]), maximize, cost_limit=limit)
        ref_rows, ref_cols = pyperm.linear_sum_assignment(blocks[0], maximize, cost_limit=limit)
        assert rows.device.type == "cuda"
        assert abs(_limited_or_plain(blocks[0], cpu(rows), cpu(cols), limit, maximize)
                   - _limited_or_plain(blocks[0], ref_rows, ref_cols, limit, maximize)) <= 1e-4


@pytest.mark.cuda
@requires_cuda
def test_ragged_forms_on_the_device_name_their_errors():
    torch = _torch()
    bad = torch.ones(2, 2, device="cuda")
    bad[0] = float("inf")
    good = torch.ones(2, 3, device="cuda")
    with pytest.raises(ValueError, match="problem 1 of the batch: cost matrix is infeasible"):
        pyperm.batch_linear_sum_assignment([good, bad])
    with pytest.raises(ValueError, match="cost_limit=inf, a problem of costs .* largest matching"):
        pyperm.batch_linear_sum_assignment([good, bad], cost_limit=float("inf"))
    with pytest.raises(ValueError, match=r"costs\[1\] is not a CUDA array but costs\[0\] is"):
        pyperm.batch_linear_sum_assignment([good, np.ones((2, 2))])
    with pytest.raises(ValueError, match=r"costs\[1\] must be a 2-D array"):
        pyperm.batch_linear_sum_assignment([good, torch.ones(3, device="cuda")])
    # NaN outside a problem's sizes is padding, never read.
    stack = torch.full((2, 3, 3), float("nan"), device="cuda")
    stack[:, :2, :2] = 1.0
    assert len(pyperm.batch_linear_sum_assignment(stack, sizes=[(2, 2), (1, 2)])) == 2
    # Other device array types: the answers come back in the input's kind (torch for DLPack).
    rows, _ = pyperm.batch_linear_sum_assignment([DLPackOnly(good), CudaArrayInterfaceOnly(good)])[1]
    assert rows.device.type == "cuda" and rows.tolist() == [0, 1]


@pytest.mark.cuda
@requires_cuda
def test_errors_name_the_argument():
    torch = _torch()
    with pytest.raises(ValueError, match="cost must be a 2-D array"):
        pyperm.linear_sum_assignment(torch.rand(3, device="cuda"))
    with pytest.raises(ValueError, match="costs must be a 3-D array"):
        pyperm.batch_linear_sum_assignment(torch.rand(3, 3, device="cuda"))
    with pytest.raises(ValueError, match="cost must be real"):
        pyperm.linear_sum_assignment(torch.rand(3, 3, device="cuda", dtype=torch.complex64))
    with pytest.raises(ValueError, match="threads must be"):
        lap_cuda.linear_sum_assignment(torch.rand(3, 3, device="cuda"), threads=48)
    with pytest.raises(ValueError, match="stage must be"):
        lap_cuda.linear_sum_assignment(torch.rand(3, 3, device="cuda"), stage=2)


# -------------------------------------------------------------- GPU: warm start
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, 200, 700])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.cuda
@requires_cuda
def test_warm_start(dtype, n, method):
    torch = _torch()
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(n)
    cost = torch.rand(n, n, device="cuda", dtype=dt, generator=g)
    v = torch.zeros(n, device="cuda", dtype=dt)
    cols = lap_cuda.solve_square_warm(cost, v, method=method)
    c = cost.cpu().numpy()
    assert_optimal(c, np.arange(n), cpu(cols))
    # The returned duals certify optimality: reduced costs are non-negative, zero on the matching.
    vv = v.cpu().numpy().astype(np.float64)
    u = c[np.arange(n), cpu(cols)] - vv[cpu(cols)]
    assert (c - vv[None, :] - u[:, None]).min() > -1e-3
    # A perturbed problem warm-started from those duals.
    cost2 = cost + 0.01 * torch.rand(n, n, device="cuda", dtype=dt, generator=g)
    cols2 = lap_cuda.solve_square_warm(cost2, v, method=method)
    assert_optimal(cost2.cpu().numpy(), np.arange(n), cpu(cols2))


@pytest.mark.cuda
@requires_cuda
def test_warm_start_batched_and_infeasible():
    torch = _torch()
    cost = torch.rand(4, 30, 30, device="cuda", dtype=torch.float64)
    v = torch.randn(4, 30, device="cuda", dtype=torch.float64)
    cols = lap_cuda.solve_square_warm(cost, v)
    for k in range(4):
        assert_optimal(cost[k].cpu().numpy(), np.arange(30), cpu(cols[k]))
    cost[2, :, 1:] = float("inf")
    with pytest.raises(ValueError, match="problem 2 of the batch: cost matrix is infeasible"):
        lap_cuda.solve_square_warm(cost, torch.zeros(4, 30, device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match="v must have shape"):
        lap_cuda.solve_square_warm(cost, torch.zeros(30, device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match="v contains NaN or infinite entries"):
        lap_cuda.solve_square_warm(cost[0], torch.full((30,), float("nan"), device="cuda", dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.cuda
@requires_cuda
def test_warm_start_stops_at_a_nan_that_reaches_the_search(dtype):
    # The warm solve does not check its costs for NaN (the callers' are finite). A row of NaN has no finite
    # column, so it reaches the shortest-path search, whose argmin puts NaN first (both warp versions: see
    # ArgMin in csrc/common/cuda_device.cuh) and stops with Invalid, not "infeasible" nor an answer.
    torch = _torch()
    cost = torch.rand(40, 40, device="cuda", dtype=getattr(torch, dtype))
    cost[3] = float("nan")
    with pytest.raises(ValueError, match="invalid numeric entries"):
        lap_cuda.solve_square_warm(cost, torch.zeros(40, device="cuda", dtype=cost.dtype))


# ---------------------------------------------------------------------- GPU: BvN
def _doubly_stochastic(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    w = rng.random(k) + 0.1
    w /= w.sum()
    d = np.zeros((n, n))
    for t in range(k):
        d[np.arange(n), rng.permutation(n)] += w[t]
    return d


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 6, 64, 300])
@pytest.mark.cuda
@requires_cuda
def test_birkhoff_max_weight(dtype, n):
    torch = _torch()
    d = _doubly_stochastic(n, 6, np.random.default_rng(n)).astype(dtype)
    D = torch.from_numpy(d).cuda()
    coeffs, perms = pyperm.birkhoff_decomposition(D, tol=1e-12 if dtype == "float64" else 1e-6)
    assert coeffs.device == D.device and coeffs.dtype == D.dtype and perms.dtype == torch.int64
    c, p = coeffs.cpu().numpy().astype(np.float64), perms.cpu().numpy()
    assert np.all(c > 0) and p.shape == (len(c), n)
    recon = np.zeros((n, n))
    for t in range(len(c)):
        assert np.array_equal(np.sort(p[t]), np.arange(n))
        recon[np.arange(n), p[t]] += c[t]
    assert np.abs(recon - d).max() <= (1e-9 if dtype == "float64" else 1e-5)
    # The CPU's zeroing rule and stopping order: no more terms than the CPU, none far below its smallest
    # (the CUDA loop used to add terms of rounding noise, 1e-17).
    cpu_coeffs, _ = pyperm.birkhoff_decomposition(d, method="max-weight", tol=1e-12 if dtype == "float64" else 1e-6)
    assert len(c) <= len(cpu_coeffs) + 1 and c.min() >= 0.1 * cpu_coeffs.min(), (len(c), len(cpu_coeffs), c.min())
    # The first term is the max-weight matching of D (eq. 54): scipy's on the support.
    cost = np.where(d > 0, -d.astype(np.float64), np.inf)
    r, col = scipy_lsa(cost)
    assert abs(d[np.arange(n), p[0]].sum() - d[r, col].sum()) <= 1e-5
    # max_terms and the progress callback stop it early.
    seen = []
    coeffs2, perms2 = pyperm.birkhoff_decomposition(D, max_terms=2, progress=lambda *a: seen.append(a))
    assert len(coeffs2) == min(2, len(c)) and len(seen) == len(coeffs2)
    def stop(*args):
        raise StopIteration  # the progress contract of pyperm._progress

    coeffs3, _ = pyperm.birkhoff_decomposition(D, progress=stop)
    assert len(coeffs3) == 1


@pytest.mark.cuda
@requires_cuda
def test_birkhoff_errors():
    torch = _torch()
    with pytest.raises(ValueError, match="D must be square"):
        pyperm.birkhoff_decomposition(torch.ones(2, 3, device="cuda"))
    with pytest.raises(ValueError, match="NaN or infinite"):
        pyperm.birkhoff_decomposition(torch.full((2, 2), float("nan"), device="cuda"))
    with pytest.raises(ValueError, match="max_terms"):
        pyperm.birkhoff_decomposition(torch.eye(2, device="cuda"), max_terms=0)
    coeffs, perms = pyperm.birkhoff_decomposition(torch.zeros(0, 0, device="cuda"))
    assert coeffs.shape == (0,) and perms.shape == (0, 0)


# ------------------------------------------------------------ GPU: cross-correlation
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.cuda
@requires_cuda
def test_xcorr_update_matches_numpy(dtype):
    torch = _torch()
    rng = np.random.default_rng(3)
    z = rng.standard_normal((900, 1))
    a = (1e3 + z * np.arange(12) + rng.standard_normal((900, 12))).astype(dtype)  # far from 0: cancellation test
    b = (z + 0.5 * rng.standard_normal((900, 9))).astype(dtype)
    b[:, 0] = 5.0  # a constant channel: exactly zero variance
    state = xcorr_cuda.new_state(12, 9, "cuda")
    for lo, hi in [(0, 1), (1, 300), (300, 301), (301, 900)]:
        xcorr_cuda.update(state, torch.from_numpy(a[lo:hi]).cuda(), torch.from_numpy(b[lo:hi]).cuda())
    assert state["count"] == 900
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ma, mb = state["moments_a"].cpu().numpy(), state["moments_b"].cpu().numpy()
    rtol = 1e-9 if dtype == "float64" else 1e-4
    np.testing.assert_allclose(ma[0], a64.mean(0), rtol=rtol)
    np.testing.assert_allclose(ma[1], ((a64 - a64.mean(0)) ** 2).sum(0), rtol=rtol)
    np.testing.assert_allclose(ma[2], a64.min(0))
    np.testing.assert_allclose(ma[3], a64.max(0))
    assert mb[1, 0] == 0.0
    cov = (a64 - a64.mean(0)).T @ (b64 - b64.mean(0))
    np.testing.assert_allclose(state["comoment"].cpu().numpy(), cov, rtol=rtol * 10, atol=rtol * 10 * np.abs(cov).max())
    # Merging two accumulators equals accumulating everything in one.
    left, right = xcorr_cuda.new_state(12, 9, "cuda"), xcorr_cuda.new_state(12, 9, "cuda")
    xcorr_cuda.update(left, torch.from_numpy(a[:400]).cuda(), torch.from_numpy(b[:400]).cuda())
    xcorr_cuda.update(right, torch.from_numpy(a[400:]).cuda(), torch.from_numpy(b[400:]).cuda())
    xcorr_cuda.merge(left, right)
    assert left["count"] == 900
    np.testing.assert_allclose(left["comoment"].cpu().numpy(), cov, rtol=rtol * 10, atol=rtol * 10 * np.abs(cov).max())


@pytest.mark.cuda
@requires_cuda
def test_xcorr_errors_leave_state_unchanged():
    """Shapes are refused at once; what is wrong with the values is found on the device and raised by the
    next check, which names the first bad update: that update and every later one are left out."""
    torch = _torch()
    state = xcorr_cuda.new_state(3, 2, "cuda")
    x = torch.randn(10, 3, device="cuda", dtype=torch.float64)
    xcorr_cuda.update(state, x, x[:, :2])
    before = {k: state[k].clone() for k in ("moments_a", "moments_b", "comoment")}
    with pytest.raises(ValueError, match="same number of samples"):
        xcorr_cuda.update(state, x, x[:5, :2])
    with pytest.raises(ValueError, match=r"xb must have shape \(samples, 2\)"):
        xcorr_cuda.update(state, x, x)
    bad = x.clone()
    bad[4, 1] = float("nan")
    xcorr_cuda.update(state, bad, x[:, :2], prefix="pair 1 ")  # no error yet: the update does not wait
    xcorr_cuda.update(state, x, x[:, :2])  # skipped: an earlier update failed
    with pytest.raises(ValueError, match=r"pair 1 xa contains NaN or infinity \(update 2 of this accumulator.*"
                                         r"keeps the 10 samples before it\)"):  # fmt: skip
        xcorr_cuda.check(state)
    assert state["count"] == 10
    for k, v in before.items():
        assert torch.equal(state[k], v), k
    xcorr_cuda.check(state)  # cleared: the accumulator goes on
    xcorr_cuda.update(state, x, x[:, :2])
    xcorr_cuda.check(state)
    assert state["count"] == 20
    # Values whose moments overflow float32, and a product that would.
    small = xcorr_cuda.new_state(2, 2, "cuda", torch.float32)
    huge = torch.full((4, 2), 3e38, device="cuda")
    huge[0] = -3e38
    xcorr_cuda.update(small, huge, huge[:, :2])
    with pytest.raises(ValueError, match="xa has values too large to accumulate"):
        xcorr_cuda.check(small)
    assert small["count"] == 0


@pytest.mark.cuda
@requires_cuda
def test_xcorr_updates_never_copy_to_the_host():
    """Many updates, then a read: the only device-to-host copy is the read's check."""
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile

    acc = pyperm.CrossCorrelation(64, 32)
    xs = [torch.randn(128, 64, device="cuda") for _ in range(8)]
    acc.update(xs[0], xs[0][:, :32])  # first use: kernel loads, pools
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x in xs:
            acc.update(x, x[:, :32])
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "DtoH" in e.name or "Device -> Host" in e.name]
    assert copies == [], copies
    assert acc.count == 9 * 128


@pytest.mark.cuda
@requires_cuda
def test_birkhoff_dispatch_keeps_cuda_input_on_the_device():
    torch = _torch()
    d = _doubly_stochastic(40, 5, np.random.default_rng(4))
    D = torch.from_numpy(d).cuda()
    coeffs, perms = pyperm.birkhoff_decomposition(D)
    assert coeffs.device == D.device and perms.device == D.device
    ref_coeffs, _ = pyperm.birkhoff_decomposition(d)
    assert abs(float(coeffs.sum()) - float(ref_coeffs.sum())) <= 1e-9
    samples = pyperm.sample_permutations(D, 7, generator=0)
    assert samples.device == D.device and samples.shape == (7, 40)
    with pytest.raises(ValueError, match="not doubly stochastic"):
        pyperm.birkhoff_decomposition(D * 1.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.cuda
@requires_cuda
def test_cross_correlation_accumulates_cuda_tensors_on_the_device(dtype):
    torch = _torch()
    rng = np.random.default_rng(5)
    a = (3.0 + rng.standard_normal((500, 6))).astype(dtype)
    b = (a[:, ::-1] + 0.1 * rng.standard_normal((500, 6))).astype(dtype)
    on_gpu = pyperm.CrossCorrelation(6, 6)
    on_cpu = pyperm.CrossCorrelation(6, 6)
    for lo, hi in [(0, 200), (200, 500)]:
        on_gpu.update(torch.from_numpy(a[lo:hi]).cuda(), torch.from_numpy(b[lo:hi]).cuda())
        on_cpu.update(a[lo:hi], b[lo:hi])
    assert on_gpu.count == 500
    tol = 1e-9 if dtype == "float64" else 1e-4
    for name in ("correlation", "covariance", "cross_product"):
        got = getattr(on_gpu, name)()
        assert got.device.type == "cuda"
        np.testing.assert_allclose(got.cpu().numpy(), getattr(on_cpu, name)(), rtol=tol, atol=tol)
    np.testing.assert_allclose(on_gpu.std_a.cpu().numpy(), on_cpu.std_a, rtol=tol)
    # A one-row batch whose row stride is 1 (as a row cut from a column can have: a size-1 dimension's
    # stride is arbitrary, and torch versions differ in what they give) is one more sample. Made with
    # as_strided: copies (.cuda(), .T of a copy) choose their own strides for size-1 dimensions.
    row_a = torch.from_numpy(a[0].copy()).cuda().as_strided((1, 6), (1, 1))
    row_b = torch.from_numpy(b[0].copy()).cuda().as_strided((1, 6), (1, 1))
    assert row_a.shape == (1, 6) and row_a.stride(0) == 1
    on_gpu.update(row_a, row_b)
    on_cpu.update(a[:1], b[:1])
    assert on_gpu.count == 501
    np.testing.assert_allclose(on_gpu.correlation().cpu().numpy(), on_cpu.correlation(), rtol=tol, atol=tol)
    # merge brings host statistics to the device; state() is host arrays
    on_gpu.merge(on_cpu)
    assert on_gpu.count == 1002 and on_gpu.mean_a.device.type == "cuda"
    assert isinstance(on_gpu.state()["comoment"], np.ndarray)
    with pytest.raises(ValueError, match="holds CPU statistics"):
        on_cpu.update(torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda())
