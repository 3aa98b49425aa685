"""The persistent thread pool of the CPU core's parallel loops (csrc/common/thread_pool.h).

Most tests switch the cost model off (``core.set_cost_model(False)``), so that loops of these
small inputs do run on the pool's workers whatever the machine's load; none asserts a time.
"""

import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest

import pyperm
from pyperm._ext import core

TWO_CORES = pytest.mark.skipif(core.hardware_threads() < 2, reason="one hardware thread: the pool has no workers")


@pytest.fixture
def pool_forced():
    before = core.set_cost_model(False)
    yield
    core.set_cost_model(before)


def _objectives(costs, answers):
    return [float(np.asarray(c, np.float64)[r, k].sum()) for c, (r, k) in zip(costs, answers)]


def _ragged(rng, count=40):
    return [rng.random((int(rng.integers(1, 60)), int(rng.integers(1, 60)))) for _ in range(count)]


# ---------------------------------------------------------------- the cost model

def test_cost_model_gives_one_thread_per_unit_of_work():
    w = core.work_per_thread()
    all_threads = core.hardware_threads()
    assert core.threads_for_work(0, 2 * w - 1) == 1
    assert core.threads_for_work(0, 0) == 1
    assert core.threads_for_work(0, 2 * w) == min(2, all_threads)
    assert core.threads_for_work(0, 1000 * w) == all_threads
    # threads= is a ceiling: 1 is serial, k at most k, whatever the work.
    assert core.threads_for_work(1, 1000 * w) == 1
    assert core.threads_for_work(3, 1000 * w) == 3


def test_small_loops_and_one_thread_stay_on_the_calling_thread():
    counts, threads, _ = core.parallel_for_probe(8, 0, work=core.work_per_thread())
    assert counts == [1] * 8 and threads == 1
    before = core.set_cost_model(False)
    try:
        counts, threads, _ = core.parallel_for_probe(8, 1)
    finally:
        core.set_cost_model(before)
    assert counts == [1] * 8 and threads == 1


# ---------------------------------------------------------------- the pool itself

@TWO_CORES
def test_workers_run_tasks_beside_the_caller(pool_forced):
    # Each task waits until both have started: only two threads at once get through.
    counts, threads, met = core.parallel_for_probe(2, 2, rendezvous=True)
    assert met and counts == [1, 1] and threads == 2
    assert core.pool_workers() == core.hardware_threads() - 1


def test_every_task_runs_once(pool_forced):
    for n in (1, 2, 3, 17, 1000):
        counts, _, _ = core.parallel_for_probe(n, 0)
        assert counts == [1] * n


def test_an_exception_in_a_task_propagates_and_the_pool_still_works(pool_forced):
    with pytest.raises(RuntimeError, match="task 37 failed"):
        core.parallel_for_probe(200, 0, throw_at=37)
    counts, _, _ = core.parallel_for_probe(50, 0)
    assert counts == [1] * 50


def test_nested_loops_do_not_deadlock(pool_forced):
    counts, _, _ = core.parallel_for_probe(64, 0, nested=True)
    assert counts == [1] * 64


def test_loops_from_several_python_threads_at_once(pool_forced):
    results, errors = [], []

    def loops():
        try:
            for _ in range(50):
                results.append(core.parallel_for_probe(40, 0, nested=True)[0])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=loops) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert len(results) == 200 and all(r == [1] * 40 for r in results)


# ---------------------------------------------------------------- the solvers on the pool

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("maximize", [False, True])
def test_stack_batch_matches_one_thread(pool_forced, dtype, maximize):
    costs = np.random.default_rng(0).random((33, 20, 30)).astype(dtype)
    want = pyperm.batch_linear_sum_assignment(costs, maximize=maximize, threads=1)
    got = pyperm.batch_linear_sum_assignment(costs, maximize=maximize)
    np.testing.assert_array_equal(got[1], want[1])
    assert _objectives(costs, zip(*got)) == _objectives(costs, zip(*want))


@pytest.mark.parametrize("cost_limit", [None, 0.3])
def test_ragged_batch_matches_one_thread(pool_forced, cost_limit):
    costs = _ragged(np.random.default_rng(1))
    want = pyperm.batch_linear_sum_assignment(costs, threads=1, cost_limit=cost_limit)
    for threads in (None, 2):
        got = pyperm.batch_linear_sum_assignment(costs, threads=threads, cost_limit=cost_limit)
        assert _objectives(costs, got) == _objectives(costs, want)


@pytest.mark.parametrize("shape", [(1500, 1500), (2200, 1000)])
def test_large_solver_bands_match_one_thread(pool_forced, shape):
    # Above 2^21 entries the large solver splits its passes (row caches, column reduction,
    # the copy of a tall matrix) into bands over the threads; a batch of one solves it on one.
    cost = np.random.default_rng(2).random(shape, dtype=np.float32)
    rows, cols = pyperm.batch_linear_sum_assignment(cost[None], threads=1)
    got = pyperm.linear_sum_assignment(cost)
    assert _objectives([cost], [got]) == _objectives([cost], [(rows[0], cols[0])])


def test_bvn_from_several_python_threads(pool_forced):
    rng = np.random.default_rng(3)
    D = pyperm.project_doubly_stochastic(rng.random((30, 30)), iters=200)
    want = pyperm.birkhoff_decomposition(D)
    answers = []

    def decompose():
        answers.append(pyperm.birkhoff_decomposition(D))
        pyperm.batch_linear_sum_assignment(rng.random((16, 40, 40)))

    threads = [threading.Thread(target=decompose) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answers) == 4
    for coeffs, perms in answers:
        np.testing.assert_array_equal(coeffs, want[0])
        np.testing.assert_array_equal(perms, want[1])


def test_solvers_from_several_python_threads(pool_forced):
    rng = np.random.default_rng(4)
    problems = [(rng.random((24, 30, 30)), _ragged(rng, 20)) for _ in range(4)]
    wanted = [(_objectives(s, zip(*pyperm.batch_linear_sum_assignment(s, threads=1))),
               _objectives(r, pyperm.batch_linear_sum_assignment(r, threads=1))) for s, r in problems]
    wrong, errors = [], []

    def solve(k):
        stack, ragged = problems[k]
        try:
            for _ in range(10):
                got = (_objectives(stack, zip(*pyperm.batch_linear_sum_assignment(stack))),
                       _objectives(ragged, pyperm.batch_linear_sum_assignment(ragged)))
                if got != wanted[k]:
                    wrong.append(k)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=solve, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not wrong


# ---------------------------------------------------------------- fork and exit

def _child_solves(costs):
    # In the child: the cost model is off as in the parent (its state is copied by fork).
    counts, _, _ = core.parallel_for_probe(50, 0)
    answers = pyperm.batch_linear_sum_assignment(costs)
    return counts == [1] * 50, _objectives(costs, zip(*answers)), core.parallel_for_probe(2, 2, rendezvous=True)[2]


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_solves_on_a_pool_of_its_own(pool_forced):
    costs = np.random.default_rng(5).random((40, 25, 25))
    want = _objectives(costs, zip(*pyperm.batch_linear_sum_assignment(costs, threads=1)))
    core.parallel_for_probe(100, 0)  # the parent's workers exist when it forks
    assert core.hardware_threads() < 2 or core.pool_workers() > 0
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a multi-threaded process may deadlock: the pool's
        # atfork handler is what this test checks.
        warnings.simplefilter("ignore", DeprecationWarning)
        with multiprocessing.get_context("fork").Pool(1) as pool:
            ran_once, got, met = pool.apply_async(_child_solves, (costs,)).get(timeout=120)
    assert ran_once and got == want
    assert met or core.hardware_threads() < 2


def test_exit_with_the_workers_started_does_not_hang():
    # The workers sleep on the pool's condition variable; the exit stops and joins them.
    script = textwrap.dedent("""
        import numpy as np
        import pyperm
        from pyperm._ext import core

        core.set_cost_model(False)
        pyperm.batch_linear_sum_assignment(np.random.default_rng(0).random((64, 30, 30)))
        print("workers", core.pool_workers(), flush=True)
    """)
    # From the tests folder: from the repository root, -c would import the source folder, which has
    # no compiled module (the installed package is what is tested).
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=here)
    assert proc.returncode == 0, proc.stderr
    assert f"workers {core.hardware_threads() - 1}" in proc.stdout


def test_bench_threads_goal_prints_its_tables(capsys):
    from pyperm.cli import main

    assert main(["bench", "lap", "--threads-goal", "--crossover", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "default / threads=1" in out and "crossover:" in out


@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_pool_alone_under_a_sanitizer(tmp_path, sanitizer):
    # The pool's source built on its own with a stress run (tests/cpp/thread_pool_stress.cpp):
    # ThreadSanitizer reports any data race between callers, workers and the fork.
    import os
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pool = os.path.join(root, "csrc", "common", "thread_pool.cpp")
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None or not os.path.exists(pool):
        pytest.skip("needs a C++ compiler and pyperm's source tree")
    exe = tmp_path / "stress"
    build = subprocess.run([compiler, "-std=c++17", "-O1", "-g", f"-fsanitize={sanitizer}",
                            "-I", os.path.join(root, "csrc"), os.path.join(root, "tests", "cpp", "thread_pool_stress.cpp"),
                            pool, "-o", str(exe), "-lpthread"], capture_output=True, text=True, timeout=300)  # fmt: skip
    if build.returncode != 0:
        pytest.skip(f"this compiler cannot build with -fsanitize={sanitizer}: {build.stderr.strip()[-200:]}")
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 die_after_fork=0", ASAN_OPTIONS="detect_leaks=0")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "wrong=0 child=ok" in run.stdout
