"""``pyperm bench lap --small``: the per-call cost of small problems, where pipelines call.

- per call: uniform float64 matrices of each size from 1 x 1 to 100 x 100, solved by
  ``pyperm.linear_sum_assignment`` on numpy and on a torch CPU tensor (when torch is
  installed), ``scipy.optimize.linear_sum_assignment`` and lapx's ``lap.lapjv`` (square sizes;
  ``extend_cost=True`` for the others), in microseconds per call. Each call of a sample solves
  a different matrix, as a detector or a tracker does: one matrix solved again and again
  teaches the processor's branch predictor that matrix's path, which halves some solvers'
  times at 20 x 20 and favours scalar code over vector code that real streams favour;
- many tiny problems: 10,000 problems of 8 x 8 in one ``batch_linear_sum_assignment`` call
  against a loop over the fastest peer.

Every answer is checked against scipy's objective first. Goals (issue 43): pyperm at most
scipy's time at every size, at most 0.5x from 20 x 20 up; torch within 1.5x the numpy path;
the batch at most 0.5x the fastest loop.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import pyperm
from pyperm._ext import core
from pyperm._tables import text_table
from pyperm.benchmarks._report import kernels, time_calls

SIZES = [(1, 1), (2, 2), (5, 8), (8, 8), (20, 20), (20, 30), (30, 40), (50, 50), (100, 100)]
BATCH = (10_000, 8, 8)
CALLS_PER_SAMPLE = 200  # calls timed together (one call is below the clock's resolution), each on its own matrix


def _peers() -> dict[str, object]:
    from scipy.optimize import linear_sum_assignment as scipy_lsa

    peers = {"scipy": scipy_lsa}
    try:
        import lap

        def lapjv(c):
            _, x, _ = lap.lapjv(c, extend_cost=c.shape[0] != c.shape[1])
            rows = np.flatnonzero(x >= 0)
            return rows, x[rows]

        peers["lapx"] = lapjv
    except ImportError:
        pass
    return peers


def _objective(cost: np.ndarray, rows, cols) -> float:
    return float(cost[np.asarray(rows), np.asarray(cols)].sum())


def _per_call_rows(rng: np.random.Generator, repeat: int, clock: str) -> list[list]:
    peers = _peers()
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            torch = None
    rows = []
    for n, m in SIZES:
        costs = [rng.random((n, m)) for _ in range(CALLS_PER_SAMPLE)]
        solvers = {"pyperm": pyperm.linear_sum_assignment}
        inputs = {"pyperm": costs}
        if torch is not None:
            solvers["pyperm (torch)"] = pyperm.linear_sum_assignment
            inputs["pyperm (torch)"] = [torch.from_numpy(c.copy()) for c in costs]
        solvers.update(peers)
        inputs.update({name: costs for name in peers})
        want = [_objective(c, *peers["scipy"](c)) for c in costs]
        for name, solve in solvers.items():
            for k, (cost, x) in enumerate(zip(costs, inputs[name])):
                if abs(_objective(cost, *solve(x)) - want[k]) > 1e-9 * max(1.0, abs(want[k])):
                    raise AssertionError(f"{n}x{m}: {name} disagrees with scipy's optimum on matrix {k}")
        loops = {name: (lambda s=solve, xs=inputs[name]: [s(x) for x in xs]) for name, solve in solvers.items()}
        us = {name: 1e6 * t.median / CALLS_PER_SAMPLE for name, t in time_calls(loops, repeat, clock=clock).items()}
        peer_best = min(us[name] for name in peers)
        rows.append([f"{n}x{m}", *(us.get(name) for name in ["pyperm", "pyperm (torch)", "scipy", "lapx"]),
                     us["pyperm"] / us["scipy"], us["pyperm"] / peer_best,
                     us["pyperm (torch)"] / us["pyperm"] if "pyperm (torch)" in us else None])
    return rows


def _batch_rows(rng: np.random.Generator, repeat: int, threads: int | None, clock: str) -> list[list]:
    peers = _peers()
    costs = rng.random(BATCH)
    loops = {f"{name} (loop)": (lambda f=f: [f(c) for c in costs]) for name, f in peers.items()}
    solvers = {"pyperm.batch": lambda: pyperm.batch_linear_sum_assignment(costs, threads=threads), **loops}
    want = [_objective(c, *peers["scipy"](c)) for c in costs]
    got_rows, got_cols = solvers["pyperm.batch"]()
    got = [_objective(c, r, k) for c, r, k in zip(costs, got_rows, got_cols)]
    if not np.allclose(got, want, rtol=1e-9, atol=1e-9):
        raise AssertionError("batch: pyperm disagrees with scipy's optima")
    # The batch runs on threads: only wall time sees them all.
    times = time_calls(solvers, repeat, clock="wall" if threads != 1 else clock)
    best_loop = min(t.median for name, t in times.items() if name != "pyperm.batch")
    return [[name, 1e3 * t.median, t.median / best_loop] for name, t in times.items()]


def run(args: argparse.Namespace) -> int:
    """Prints the per-call table (microseconds) and the batch of tiny problems."""
    repeat = max(args.repeat, 7)
    print(f"pyperm {pyperm.__version__}, kernels: {kernels()}, clock: {args.clock}, "
          f"medians of {repeat} samples of {CALLS_PER_SAMPLE} calls, each on a different uniform float64 matrix")
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    rows = _per_call_rows(rng, repeat, args.clock)
    print(text_table(["size", "pyperm us", "torch us", "scipy us", "lapx us", "/ scipy", "/ fastest peer",
                      "torch / numpy"], rows))
    met = all(r[5] <= 1.0 and (r[5] <= 0.5 or int(r[0].split("x")[0]) < 20) for r in rows)
    print(f"goal: <= 1x scipy at every size, <= 0.5x from 20x20 up: {'met' if met else 'missed'}")
    print()
    threads = args.threads or core.hardware_threads()
    batch = _batch_rows(rng, max(3, args.repeat), args.threads, args.clock)
    print(f"{BATCH[0]:,} problems of {BATCH[1]}x{BATCH[2]} in one call ({threads} threads, wall time) "
          "against a loop over each peer:")
    print(text_table(["solver", "median ms", "/ fastest loop"], batch))
    ratio = batch[0][2]
    print(f"goal: batch <= 0.5x the fastest loop: {'met' if ratio <= 0.5 else 'missed'} ({ratio:.2f}); "
          f"{time.perf_counter() - start:.0f} s in all")
    return 0
