"""``pyperm bench lap --threads-goal``: whether the default threads ever lose to one thread.

- detr: DETR's matcher batch, 64 images of 100 queries and 0-50 targets as a list of float32
  views, default threads against ``threads=1``. Goal: at most 1.1x, also while other processes
  keep every core busy (``--load N`` starts N spinning processes for the run and stops them after).
- stack: 256 uniform 128 x 128 float64 problems in one (B, n, m) stack. Goal: the default at
  least 1.6x faster than one thread on a quiet machine.
- ``--crossover``: the measurement behind the cost model's kWorkPerThread (csrc/common/thread_pool.h).
  With the model switched off, batches of B small problems (100 x 25, DETR's typical block) are
  timed on two threads and on one, for growing B; the crossover is the work of the smallest batch
  from which on the two-thread median beats one thread's. Run it where the cores are idle (or
  under ``chrt -f 1``, which gives the benchmark's threads the cores as on a quiet machine).

The two settings of each case are timed alternately, call by call, so that a change in the
machine's load shows in both; every answer is checked against ``threads=1``'s objective first.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

import pyperm
from pyperm._ext import core
from pyperm._tables import text_table
from pyperm.benchmarks._report import kernels

GOALS = {"detr": ("<=", 1.1), "stack": (">=", 1.6)}  # default's speed-up over threads=1: "detr" as a time ratio
SMALL = (100, 25)  # the crossover's problem: DETR's typical block


def problem_work(n: int, m: int) -> int:
    """The C++ cost model's estimate of one problem (lap_cpu.h, assignment_work)."""
    return n * m + 512


def detr_blocks(rng: np.random.Generator, images: int = 64, queries: int = 100, max_targets: int = 50) -> list:
    costs = rng.random((images, queries, max_targets), dtype=np.float32)
    targets = rng.integers(0, max_targets + 1, images)
    return [costs[b, :, :t] for b, t in enumerate(targets)]


def objective(costs, answers) -> float:
    return float(sum(np.asarray(c, np.float64)[r, k].sum() for c, (r, k) in zip(costs, answers)))


def alternate(calls: dict[str, Callable[[], object]], repeat: int) -> dict[str, list[float]]:
    """Seconds of each call, the calls taken in turn ``repeat`` times (after one warm-up each)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def spread(samples: list[float]) -> str:
    """The quartiles' spread around the median, as a percentage (how noisy the samples were)."""
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return f"{100 * (q3 - q1) / statistics.median(samples):.0f}%"


def compare(name: str, solve: Callable[[int | None], object], check: Callable[[object], float], repeat: int) -> list:
    want = check(solve(1))
    got = check(solve(None))
    if not np.isclose(got, want, rtol=1e-9, atol=1e-9):
        raise AssertionError(f"{name}: the default threads' objective {got} differs from threads=1's {want}")
    times = alternate({"default": lambda: solve(None), "threads=1": lambda: solve(1)}, repeat)
    d, one = (statistics.median(times[k]) for k in ("default", "threads=1"))
    return [name, 1e3 * d, 1e3 * one, d / one, one / d, spread(times["default"]), spread(times["threads=1"])]


def crossover(rng: np.random.Generator, repeat: int) -> list:
    """Rows (B, work, two-thread ms, one-thread ms, ratio) for growing batches, the model off."""
    n, m = SMALL
    rows = []
    before = core.set_cost_model(False)
    try:
        for batch in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96):
            stack = rng.random((batch, n, m))
            times = alternate({t: (lambda t=t: pyperm.batch_linear_sum_assignment(stack, threads=t)) for t in (2, 1)},
                              repeat)  # fmt: skip
            two, one = statistics.median(times[2]), statistics.median(times[1])
            rows.append([batch, batch * problem_work(n, m), 1e3 * two, 1e3 * one, two / one])
    finally:
        core.set_cost_model(before)
    return rows


def start_load(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def run(args: argparse.Namespace) -> int:
    """Prints the default / threads=1 table of both cases (and the crossover table when asked)."""
    repeat = max(args.repeat, 5)
    load = getattr(args, "load", 0) or 0
    rng = np.random.default_rng(args.seed)
    model = f"{core.work_per_thread()} units per thread" if hasattr(core, "work_per_thread") else "none"
    print(f"pyperm {pyperm.__version__} ({pyperm.__file__}), kernels: {kernels()}, hardware threads: "
          f"{core.hardware_threads()}, cost model: {model}, medians of {repeat} alternating calls, "
          f"{load} spinning processes beside")
    blocks = detr_blocks(rng)
    stack = rng.random((256, 128, 128))
    procs = start_load(load)
    try:
        time.sleep(0.5 if load else 0)  # let the spinners reach the cores
        rows = [
            compare("detr (64 x 100 x 0-50, list)", lambda t: pyperm.batch_linear_sum_assignment(blocks, threads=t),
                    lambda a: objective(blocks, a), repeat),
            compare("stack (256 x 128 x 128 float64)",
                    lambda t: pyperm.batch_linear_sum_assignment(stack, threads=t),
                    lambda a: objective(stack, zip(*a)), max(3, repeat // 4)),
        ]  # fmt: skip
        cross = crossover(rng, repeat) if getattr(args, "crossover", False) and hasattr(core, "set_cost_model") else None
    finally:
        stop_load(procs)
    print(text_table(["case", "default ms", "threads=1 ms", "default / 1", "speed-up", "spread default",
                      "spread 1"], rows))  # fmt: skip
    print()
    summary = []
    for row, (case, (sense, goal)) in zip(rows, GOALS.items()):
        value = row[3] if sense == "<=" else row[4]
        met = value <= goal if sense == "<=" else value >= goal
        summary.append([case, "default / threads=1" if sense == "<=" else "threads=1 / default", value,
                        f"{sense} {goal}", "yes" if met else "no"])
    print(text_table(["case", "ratio", "value", "goal", "met"], summary))
    if cross is not None:
        print(f"\ncrossover, cost model off: B problems of {SMALL[0]} x {SMALL[1]} float64, 2 threads against 1")
        print(text_table(["B", "work units", "2 threads ms", "1 thread ms", "2 / 1"], cross))
        # The smallest batch from which on two threads win at every size (noise may flip one small row).
        first = next((k for k in range(len(cross)) if all(row[4] < 1 for row in cross[k:])), None)
        print(f"crossover: {'none' if first is None else cross[first][1]} work units; "
              f"kWorkPerThread = {core.work_per_thread()} (loops below {2 * core.work_per_thread()} stay serial)")
    return 0


if __name__ == "__main__":
    # Also runs as a script, against any build of pyperm on the path (an older one: no crossover).
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    sys.exit(run(parser.parse_args()))
