"""``pyperm bench teacher-student``: the width sweep of Zhan, Li and Wu (2025) against a 30 s target.

Times :func:`pyperm.teacher_student.width_sweep` with uniform samples for K = 5 (10 widths
from K to 100, 30 pairs each; the target is under 30 s on the 2-core machine), after
checking the answer (zero permuted barrier at m = K, matching never raising a barrier), and
prints the sweep's table. ``--gd`` adds a small GD sweep and ``--lr`` a learning-rate sweep of
the PQ index; ``--plot-dir`` writes their figures.

On a busy machine torch's OpenMP workers spin between operations and slow these small
operations several times over: ``OMP_WAIT_POLICY=PASSIVE`` in the environment (set before
Python starts) or ``--threads 1`` avoids it (measured with load ~7 on the 2 cores, median of
3: 9.7 s with 2 spinning threads, 4.0 s with 2 passive ones, 3.0 s with 1 thread).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from pyperm.benchmarks._report import time_call
from pyperm._argtypes import int_at_least, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--K", type=positive_int, default=5, help="teacher neurons (default 5)")
    parser.add_argument("--pairs", type=int_at_least(2), default=30, help="pairs of solutions per width (default 30)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="timed runs of the sweep (median reported)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--gd", action="store_true", help="also run a small GD sweep (widths 1..8K, 10 pairs)")
    parser.add_argument("--lr", action="store_true", help="also run a learning-rate sweep of the PQ index (m = 4K)")
    parser.add_argument("--plot-dir", default=None, help="write the figures (PNG) to this folder")


def _check(sweep) -> None:
    """The answer before the time: matching never raises a barrier; m = K is a permutation."""
    direct = sweep.barriers["direct"]
    for name in ("type", "lap"):
        if not np.all(sweep.barriers[name] <= direct + 1e-12):
            raise AssertionError(f"{name} matching raised a barrier above the direct one")
    if abs(sweep.mean("type")[0]) > 1e-12:
        raise AssertionError("the permuted barrier at m = K is not zero")


def run(args: argparse.Namespace) -> int:
    import torch

    from pyperm.teacher_student import learning_rate_sweep, width_sweep

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # the command owns its process; library calls never do this
    K = args.K
    widths = sorted({int(m) for m in np.linspace(K, 100, 10).round()})
    print(
        f"torch {torch.__version__}  threads {torch.get_num_threads()}  "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}  K={K}  widths {widths}  pairs {args.pairs}"
    )

    def sweep():
        return width_sweep(K, widths, source="uniform", pairs=args.pairs, seed=args.seed)

    timing = time_call(sweep, args.repeat)
    _check(timing.result)
    samples = ", ".join(f"{s:.2f}" for s in timing.samples)
    print(f"uniform width sweep: median {timing.median:.2f} s (runs: {samples}; target < 30 s)\n")
    print(timing.result)
    figures = {"uniform": timing.result}
    if args.gd:
        gd = width_sweep(K, list(range(1, 2 * K + 1)) + [3 * K, 4 * K, 8 * K], source="gd", pairs=10, seed=args.seed)
        print("\n" + str(gd))
        figures["gd"] = gd
    if args.lr:
        lr = learning_rate_sweep(K, 4 * K, [1.0, 2.0, 2.5, 2.7, 2.8, 2.9, 3.0, 3.1, 3.2, 3.3], runs=8, seed=args.seed)
        print("\n" + str(lr))
        figures["lr"] = lr
    if args.plot_dir:
        os.makedirs(args.plot_dir, exist_ok=True)
        for name, result in figures.items():
            path = result.plot(os.path.join(args.plot_dir, f"teacher_student_{name}_K{K}.png"))
            print(f"plot written to {path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
