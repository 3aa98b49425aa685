"""PYPERM_MAX_SIMD: the kernels capped at each SIMD level this machine runs give scipy's optima.

Each level runs in a fresh interpreter (the core reads the variable once); the solver calls
cover each path: the small-problem solver, the large one (square, wide, tall, maximised), the
batch, ragged batches with a cost limit, and sparse input.
"""

import os
import subprocess
import sys

import pytest

from pyperm._ext import core

LEVELS = ["baseline", "avx2", "avx512"]
# Children run from the tests folder: from the repository root, `-c` would import the source
# folder, which has no compiled module (the installed wheel is what is tested).
HERE = os.path.dirname(os.path.abspath(__file__))
RUNS_HERE = LEVELS[: LEVELS.index(core.hardware_isa()) + 1]

CHECK = r"""
import numpy as np, scipy.sparse as sp
from scipy.optimize import linear_sum_assignment as ref
import pyperm
from pyperm._ext import core

assert core.best_isa() == "{level}", core.best_isa()
assert pyperm.show_config(mode="dicts")["simd"]["cap"] == "PYPERM_MAX_SIMD={level}"
rng = np.random.default_rng(0)

def objective(c, rows, cols):
    return float(np.asarray(c, dtype=np.float64)[rows, cols].sum())

for shape in [(1, 1), (7, 7), (20, 30), (30, 20), (64, 64), (200, 200), (150, 600), (600, 150)]:
    for dtype in (np.float64, np.float32):
        c = rng.random(shape).astype(dtype)
        for maximize in (False, True):
            want = objective(c, *ref(c.astype(np.float64), maximize=maximize))
            got = objective(c, *pyperm.linear_sum_assignment(c, maximize=maximize))
            assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (shape, dtype, maximize, got, want)
stack = rng.random((16, 9, 12))
rows, cols = pyperm.batch_linear_sum_assignment(stack)
for b in range(16):
    assert abs(objective(stack[b], rows[b], cols[b]) - objective(stack[b], *ref(stack[b]))) < 1e-9
ragged = [rng.random((n, m)) for n, m in [(0, 3), (4, 6), (9, 2), (5, 5)]]
for c, (r, k) in zip(ragged, pyperm.batch_linear_sum_assignment(ragged)):
    assert abs(objective(c, r, k) - objective(c, *ref(c))) < 1e-9

def lap_reference(c, limit):
    # lap's objective on its (n + m) x (n + m) extension: C, limit / 2 for every row and
    # column left unmatched, 0 between the dummies; solved by scipy.
    n, m = c.shape
    ext = np.full((n + m, n + m), limit / 2)
    ext[:n, :m] = c
    ext[n:, m:] = 0
    return objective(ext, *ref(ext))

def lap_objective(c, rows, cols, limit):
    assert len(set(rows.tolist())) == len(rows) and len(set(cols.tolist())) == len(cols)
    assert np.all(np.isfinite(c[rows, cols]))
    return objective(c, rows, cols) + limit / 2 * (sum(c.shape) - 2 * len(rows))

for limit in (0.05, 0.3, 0.7):
    for shape in [(10, 12), (30, 20), (64, 64), (70, 80)]:
        c = rng.random(shape)
        want = lap_reference(c, limit)
        got = lap_objective(c, *pyperm.linear_sum_assignment(c, cost_limit=limit), limit)
        assert abs(got - want) < 1e-9, (limit, shape, got, want)
    ragged = [rng.random(shape) for shape in [(0, 3), (4, 6), (9, 2), (5, 5), (40, 60), (70, 70)]]
    ragged[3][rng.random((5, 5)) < 0.3] = np.inf
    for c, (r, k) in zip(ragged, pyperm.batch_linear_sum_assignment(ragged, cost_limit=limit)):
        got, want = lap_objective(c, r, k, limit), lap_reference(c, limit)
        assert abs(got - want) < 1e-9, (limit, c.shape, got, want)
dense = rng.random((300, 300)) + 1.0
mask = rng.random((300, 300)) < 0.05
mask[np.arange(300), rng.permutation(300)] = True
sparse = sp.csr_array(np.where(mask, dense, 0.0))
got = objective(np.where(mask, dense, np.inf), *pyperm.linear_sum_assignment(sparse))
want = objective(dense, *ref(np.where(mask, dense, 1e9)))
assert abs(got - want) < 1e-6, (got, want)
print("ok")
"""


@pytest.mark.parametrize("level", RUNS_HERE)
def test_every_simd_level_this_machine_runs_gives_scipys_optima(level):
    env = {**os.environ, "PYPERM_MAX_SIMD": level}
    out = subprocess.run([sys.executable, "-c", CHECK.replace("{level}", level)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=HERE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_a_cap_above_the_cpu_gives_the_cpus_widest():
    env = {**os.environ, "PYPERM_MAX_SIMD": "avx512"}
    code = "from pyperm._ext import core; print(core.best_isa(), core.hardware_isa())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=HERE)
    chosen, hardware = out.stdout.split()
    assert chosen == hardware


def test_an_unknown_level_fails_at_import_naming_the_variable():
    env = {**os.environ, "PYPERM_MAX_SIMD": "sse4"}
    out = subprocess.run([sys.executable, "-c", "import pyperm"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=HERE)
    assert out.returncode != 0
    assert "PYPERM_MAX_SIMD must be one of baseline, avx2, avx512" in out.stderr
    assert "'sse4'" in out.stderr
