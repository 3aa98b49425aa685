"""What the solvers accept and refuse at their edges: torch's low-precision floats, the forms
numpy would misread, unaligned arrays, the two-matrix list whose meaning changed, and the SIMD
cap's environment variable changed after import."""

import math
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.optimize import linear_sum_assignment as scipy_lsa

import pyperm
from pyperm._ext import core
from pyperm.lap import lapjv

torch = pytest.importorskip("torch")

LOW_PRECISION = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def _objective(cost, rows, cols):
    return float(np.asarray(cost, dtype=np.float64)[np.asarray(rows), np.asarray(cols)].sum())


# ------------------------------------------------------------- bfloat16, float16 and float8 tensors


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_low_precision_tensors_are_solved_in_float64(dtype):
    """Every CPU entry point and custom operator; the values the tensor holds, read exactly."""
    pyperm.lap.register_torch_ops()
    t = torch.rand(6, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
    exact = t.to(torch.float64).numpy()
    want = _objective(exact, *scipy_lsa(exact))
    answers = {
        "linear_sum_assignment": pyperm.linear_sum_assignment(t),
        "maximize": None,
        "stack": tuple(a[0] for a in pyperm.batch_linear_sum_assignment(t[None])),
        "list": pyperm.batch_linear_sum_assignment([t, t[:3]])[0],
        "padded": pyperm.batch_linear_sum_assignment(t[None], sizes=[(6, 6)])[0],
        "limit": pyperm.linear_sum_assignment(t, cost_limit=math.inf),
        "op": torch.ops.pyperm.linear_sum_assignment(t, False),
        "batch_op": tuple(a[0] for a in torch.ops.pyperm.batch_linear_sum_assignment(t[None], False, 0)),
        "limited_op": torch.ops.pyperm.linear_sum_assignment_limited(t, False, math.inf),
    }
    rows, cols = pyperm.linear_sum_assignment(t, maximize=True)
    assert _objective(exact, rows, cols) == pytest.approx(_objective(exact, *scipy_lsa(exact, maximize=True)))
    del answers["maximize"]
    for name, (rows, cols) in answers.items():
        assert isinstance(rows, torch.Tensor) and rows.dtype == torch.int64, name
        assert _objective(exact, rows, cols) == pytest.approx(want), name
    total, x, _ = lapjv(t)
    assert total == pytest.approx(want) and sorted(x.tolist()) == list(range(6))


def test_weight_matching_under_bfloat16_autocast():
    """A matcher's similarities come out of autocast in bfloat16; the solve takes them."""
    from pyperm.nn import PermutationSpec, weight_matching

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    spec = PermutationSpec.from_model(model, torch.randn(2, 8))
    state_a = model.state_dict()
    state_b = {k: v + 0.01 * torch.randn_like(v) for k, v in state_a.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = weight_matching(spec, state_a, state_b, seed=0)
    for perm in result.perms.values():
        assert sorted(perm.tolist()) == list(range(len(perm)))


def test_complex_and_quantized_tensors_are_refused():
    with pytest.raises(TypeError, match="cost must be real"):
        pyperm.linear_sum_assignment(torch.ones(2, 2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"costs\[0\] must be real"):
        pyperm.batch_linear_sum_assignment([torch.ones(2, 2, dtype=torch.complex128)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch deprecates quantized tensors
        q = torch.quantize_per_tensor(torch.ones(2, 2), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="numerical entries"):
        pyperm.linear_sum_assignment(q)


# ---------------------------------------------------------------- forms numpy would misread


def test_forms_numpy_would_misread_name_the_argument():
    with pytest.raises(TypeError, match=r"costs\[1\] is a scipy.sparse matrix"):
        pyperm.batch_linear_sum_assignment([np.eye(2), sp.csr_matrix(np.eye(2))])
    with pytest.raises(TypeError, match="costs is a numpy object array of shape \\(2,\\)"):
        pyperm.batch_linear_sum_assignment(np.array([np.eye(2), np.eye(3)], dtype=object))
    with pytest.raises(TypeError, match="got generator: pass list"):
        pyperm.batch_linear_sum_assignment(c for c in [np.eye(2)])
    with pytest.raises(TypeError, match="got list_iterator"):
        pyperm.batch_linear_sum_assignment(iter([np.eye(2)]))
    for limit in (np.array("0.5"), np.array(b"1"), np.array([0.5], dtype=object).reshape(()), "0.5"):
        with pytest.raises(TypeError, match="cost_limit must be a real number"):
            pyperm.linear_sum_assignment(np.eye(2), cost_limit=limit)
    with pytest.raises(TypeError, match="cost_limit must be a real number"):
        pyperm.linear_sum_assignment(np.eye(2), cost_limit=torch.tensor(0.5 + 0j))


def test_a_sparse_side_beyond_32_bit_indices_says_so():
    wide = sp.csr_matrix((np.array([1.0]), np.array([0]), np.array([0, 1, 1])), shape=(2, 2**31 - 1))
    tall = sp.csc_matrix((np.array([1.0]), np.array([0]), np.array([0, 1, 1, 1])), shape=(2**31, 3))
    for cost in (wide, tall):
        with pytest.raises(ValueError, match=r"sides below 2\*\*31 - 1"):
            pyperm.linear_sum_assignment(cost)


def test_unaligned_arrays_reach_the_core_aligned(monkeypatch):
    """The core reads entries in place: every array it is handed is aligned (a spy on the real
    functions, which still solve)."""
    raw = np.zeros(8 * 25 + 1, dtype=np.uint8)
    unaligned = np.frombuffer(raw[1:], dtype=np.float64).reshape(5, 5)
    unaligned[...] = np.random.default_rng(0).random((5, 5))
    assert not unaligned.flags.aligned
    seen = []

    def spy(name):
        real = getattr(core, name)

        def wrapped(*args, **kwargs):
            for a in args:
                for arr in (a if isinstance(a, list) else [a]):
                    if isinstance(arr, np.ndarray):
                        seen.append((name, arr.flags.aligned))
            return real(*args, **kwargs)

        monkeypatch.setattr(core, name, wrapped)

    for name in ("lap_solve", "lap_solve_many", "lap_solve_limited", "lap_lapjv", "lap_solve_batch"):
        spy(name)
    want = _objective(unaligned, *scipy_lsa(unaligned))
    answers = [pyperm.linear_sum_assignment(unaligned.copy(order="F")[::1]),
               pyperm.batch_linear_sum_assignment([unaligned])[0],
               pyperm.linear_sum_assignment(unaligned, cost_limit=10.0)]
    general = np.lib.stride_tricks.as_strided(unaligned, unaligned.shape, unaligned.strides)
    answers.append(pyperm.linear_sum_assignment(general, maximize=np.bool_(False)))
    for rows, cols in answers:
        assert _objective(unaligned, rows, cols) == pytest.approx(want)
    stack = np.frombuffer(raw[1:], dtype=np.float64).reshape(1, 5, 5)
    pyperm.batch_linear_sum_assignment(stack)
    lapjv(unaligned)
    assert seen and all(aligned for _, aligned in seen), seen


# ----------------------------------------------------- the two-matrix list whose meaning changed


def test_unpacking_two_pairs_as_a_stack_is_warned():
    costs = [np.eye(3), np.ones((3, 3)) - np.eye(3)]
    with pytest.warns(pyperm.ResultFormWarning, match="unpacked into two names"):
        rows, cols = pyperm.batch_linear_sum_assignment(costs)
    assert len(rows) == 2 and len(cols) == 2  # each is one problem's pair


def test_other_uses_of_a_two_matrix_list_are_not_warned():
    costs = [np.eye(3), np.ones((3, 3))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (r0, c0), (r1, c1) = pyperm.batch_linear_sum_assignment(costs)
        pairs = pyperm.batch_linear_sum_assignment(costs)
        for rows, cols in pyperm.batch_linear_sum_assignment(costs):
            assert len(rows) == 3
        a, b = pyperm.batch_linear_sum_assignment([np.eye(3), np.eye(2)])  # never a stack
        rows, cols = pyperm.batch_linear_sum_assignment(np.stack(costs))  # a stack: (B, k) arrays
    assert len(pairs) == 2 and rows.shape == (2, 3)
    assert _objective(costs[0], r0, c0) == 0.0 and _objective(costs[1], r1, c1) == 3.0


# ---------------------------------------------------------------- the SIMD cap's environment


def test_a_simd_cap_set_after_import_is_reported_not_silently_ignored(monkeypatch):
    from pyperm._ext import simd_cap

    in_force = simd_cap()
    other = "baseline" if in_force != "baseline" else "avx2"
    monkeypatch.setenv("PYPERM_MAX_SIMD", other)
    with pytest.warns(RuntimeWarning, match="kernels keep the cap read at import"):
        cap = pyperm.show_config(mode="dicts")["simd"]["cap"]
    assert "in force since import" in cap and f"now {other!r}" in cap
    assert simd_cap() == in_force
