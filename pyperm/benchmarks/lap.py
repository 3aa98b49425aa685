"""``pyperm bench lap``: pyperm's assignment solvers against scipy and the installed peers.

Every solver gets the same matrices in one run; each answer is checked against scipy's
optimal objective before it is timed, and a solver that disagrees is reported, not timed.
Peers: scipy (always), lapx (``import lap``: lapjv, lapjvs, lapjvh, lapjvr and their
batch forms; plain ``lap`` gives lapjv only) and lapjv. ``pip install "pyperm[bench]"``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import pyperm
from pyperm._ext import core
from pyperm._tables import text_table
from pyperm.benchmarks._report import cuda_device_name, kernels, save_bar_plot, time_call, to_host
from pyperm._argtypes import choices_list, int_at_least, positive_int

Solver = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass
class Case:
    name: str
    make: Callable[[np.random.Generator], np.ndarray]
    batch: bool = False


def _uniform(n: int, m: int | None = None, dtype=np.float64):
    return lambda rng: rng.random((n, n if m is None else m)).astype(dtype)


def _integers(n: int, high: int = 100):
    return lambda rng: rng.integers(0, high, (n, n)).astype(np.float64)


def _low_rank(n: int, rank: int = 16, dtype=np.float64):
    """-(A @ B.T) where B is a noisy, permuted copy of A: a planted matching, like weight matching."""

    def make(rng):
        a = rng.standard_normal((n, rank)).astype(dtype)
        b = a[rng.permutation(n)] + 0.1 * rng.standard_normal((n, rank)).astype(dtype)
        return -(a @ b.T)

    return make


CASES = {
    "uniform-1024": Case("uniform-1024", _uniform(1024)),
    "uniform-2048": Case("uniform-2048", _uniform(2048)),
    "uniform-4096": Case("uniform-4096", _uniform(4096)),
    "wide-1000x4000": Case("wide-1000x4000", _uniform(1000, 4000)),
    "tall-4000x1000": Case("tall-4000x1000", _uniform(4000, 1000)),
    "integers-1024": Case("integers-1024", _integers(1024)),
    "lowrank-2048": Case("lowrank-2048", _low_rank(2048)),
    "float32-2048": Case("float32-2048", _uniform(2048, dtype=np.float32)),
    "batch-256x128": Case("batch-256x128", lambda rng: rng.random((256, 128, 128)), batch=True),
}
DEFAULT = list(CASES)
# The sizes weight matching solves on current language models (hidden 2048; MLP 5632, 8192, 11008,
# 14336): float32 similarities of a planted pair (``--matching``; not in the default run).
MATCHING = [f"similarity-{n}" for n in (2048, 5632, 8192, 11008, 14336)]
for _name in MATCHING:
    CASES[_name] = Case(_name, _low_rank(int(_name.split("-")[1]), rank=64, dtype=np.float32))
QUICK = ["uniform-1024", "wide-1000x4000", "integers-1024", "batch-256x128"]
# The GPU's targets (``--device cuda``): a batch of 1024 problems of 128 x 128 and one uniform 4096, in
# float32, against pyperm's CPU solvers on the same machine; not in the default run.
CASES["batch-1024x128-f32"] = Case("batch-1024x128-f32", lambda rng: rng.random((1024, 128, 128), dtype=np.float32),
                                   batch=True)  # fmt: skip
CASES["float32-4096"] = Case("float32-4096", _uniform(4096, dtype=np.float32))
GPU = ["batch-1024x128-f32", "float32-4096", "uniform-1024", "uniform-4096", "wide-1000x4000", "tall-4000x1000",
       "lowrank-2048", "float32-2048", "batch-256x128"]  # fmt: skip
# (case, goal of pyperm's CUDA time over its CPU time on the same machine)
GPU_GOALS = {"batch-1024x128-f32": 0.1, "float32-4096": 0.5}


# ----------------------------------------------------------------------------- peers
def _rows_cols_from_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = np.flatnonzero(x >= 0)
    return rows, np.asarray(x)[rows]


def single_solvers() -> dict[str, Solver]:
    """Every installed single-problem solver, pyperm first, as cost -> (rows, cols)."""
    solvers: dict[str, Solver] = {"pyperm": pyperm.linear_sum_assignment}
    try:
        from scipy.optimize import linear_sum_assignment as scipy_lsa

        solvers["scipy"] = scipy_lsa
    except ImportError:
        pass
    lap = _optional("lap")
    if lap is not None:
        solvers["lap.lapjv"] = lambda c: _rows_cols_from_x(lap.lapjv(c, extend_cost=c.shape[0] != c.shape[1],
                                                                     return_cost=False)[0])
        # lapx's newer solvers keep float32 in float32 with precision="native".
        for name in ("lapjvs", "lapjvh", "lapjvr"):
            fn = getattr(lap, name, None)
            if fn is not None:
                solvers[f"lapx.{name}"] = _lapx_adapter(fn)
    lapjv = _optional("lapjv")
    if lapjv is not None:  # square only
        solvers["lapjv"] = lambda c: (np.arange(c.shape[0]), lapjv.lapjv(c)[0]) if c.shape[0] == c.shape[1] else None
    return solvers


def batch_solvers(threads: int | None) -> dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]]:
    """Batch solvers: pyperm's, the lapx batch functions, and per-problem loops of the rest."""
    solvers = {"pyperm.batch": lambda c: pyperm.batch_linear_sum_assignment(c, threads=threads)}
    lap = _optional("lap")
    if lap is not None:
        for name in ("lapjvs_batch", "lapjvh_batch", "lapjvr_batch"):
            fn = getattr(lap, name, None)
            if fn is not None:
                solvers[f"lapx.{name}"] = _lapx_batch_adapter(fn, threads)
    for name, single in single_solvers().items():
        if name != "pyperm":
            solvers[f"{name} (loop)"] = _loop(single)
    return solvers


def _lapx_adapter(fn):
    def solve(c):
        rows, cols = fn(c, extend_cost=c.shape[0] != c.shape[1], return_cost=False)
        return np.asarray(rows), np.asarray(cols)

    return solve


def _lapx_batch_adapter(fn, threads):
    def solve(c):
        out = fn(c, return_cost=False, n_threads=threads or 0)
        rows = np.stack([np.asarray(r) for r in out[0]])
        cols = np.stack([np.asarray(k) for k in out[1]])
        return rows, cols

    return solve


def _loop(single: Solver):
    def solve(c):
        pairs = [single(p) for p in c]
        if any(p is None for p in pairs):
            return None
        return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])

    return solve


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# ----------------------------------------------------------------------------- running
def _objective(cost: np.ndarray, rows, cols) -> float:
    rows, cols = np.asarray(rows), np.asarray(cols)
    if cost.ndim == 3:
        return float(sum(cost[b][rows[b], cols[b]].sum() for b in range(cost.shape[0])))
    return float(cost[rows, cols].astype(np.float64).sum())



def cuda_solver(cost: np.ndarray, batch: bool) -> Solver:
    """pyperm's CUDA solver on a device copy of ``cost`` made once, here (the copy is not timed): the call
    returns CUDA tensors after the stream is synchronised (the solver reads its status back anyway)."""
    import torch

    dev = torch.from_numpy(cost).cuda()
    solve = pyperm.batch_linear_sum_assignment if batch else pyperm.linear_sum_assignment

    def call(_c):
        out = solve(dev)
        torch.cuda.synchronize(dev.device)
        return out

    return call


def _valid(cost: np.ndarray, rows, cols) -> bool:
    rows, cols = np.atleast_2d(np.asarray(rows)), np.atleast_2d(np.asarray(cols))
    k = min(cost.shape[-2:])
    return all(len(np.unique(r)) == k and len(np.unique(c)) == k for r, c in zip(rows, cols))


def run_case(case: Case, rng: np.random.Generator, repeat: int, threads: int | None, clock: str,
             device: str = "cpu", peers: bool = True):  # fmt: skip
    """Times every solver on one case; returns rows (solver, seconds or None, note). ``device="cuda"``
    adds pyperm's CUDA solver (``pyperm.cuda``) on the same matrices; ``peers=False`` times pyperm's
    solvers alone (checked against pyperm's CPU answer)."""
    cost = case.make(rng)
    solvers = batch_solvers(threads) if case.batch else single_solvers()
    if not peers:
        solvers = {name: solve for name, solve in solvers.items() if name.startswith("pyperm")}
    if device == "cuda":
        solvers["pyperm.cuda"] = cuda_solver(cost, case.batch)
    # The reference objective, in float64: scipy's, else pyperm's.
    ref_solver = solvers.get("scipy (loop)" if case.batch else "scipy") or next(iter(solvers.values()))
    reference = _objective(cost.astype(np.float64), *ref_solver(cost.astype(np.float64)))
    tol = 1e-6 * max(1.0, abs(reference)) if cost.dtype == np.float64 else 1e-4 * max(1.0, abs(reference))
    results = []
    for name, solve in solvers.items():
        try:
            out = solve(cost)
        except Exception as exc:  # a peer that rejects this input is reported, not fatal
            results.append((name, None, f"error: {type(exc).__name__}"))
            continue
        if out is None:
            results.append((name, None, "unsupported"))
            continue
        out = tuple(to_host(x) for x in out)
        if not _valid(cost, *out) or abs(_objective(cost.astype(np.float64), *out) - reference) > tol:
            results.append((name, None, "WRONG answer"))
            continue
        # Threaded batch solvers work off the calling thread: only wall time sees them.
        # The GPU works off the calling thread too.
        wall = case.batch or name == "pyperm.cuda"
        results.append((name, time_call(lambda: solve(cost), repeat, clock="wall" if wall else clock).median, ""))
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", type=choices_list(list(CASES)), default=DEFAULT,
                        help=f"comma-separated cases (default: all but the --matching ones): {', '.join(CASES)}")
    parser.add_argument("--matching", action="store_true",
                        help=f"only the sizes weight matching solves on language models: {', '.join(MATCHING)}")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--no-peers", action="store_true",
                        help="time pyperm's solvers only (scipy takes about 10 s per n=4096 problem)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: also pyperm's CUDA solver on every case (row pyperm.cuda) and the GPU table; "
                             f"without --cases, the GPU's cases: {', '.join(GPU)}")
    parser.add_argument("--repeat", type=positive_int, default=5,
                        help="timed calls per solver and case (median reported)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="threads for the batch solvers (default: all cores)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or the calling thread's CPU time (steadier on a busy machine; "
                             "single-threaded solvers only)")
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--plot", metavar="PNG", help="also save a bar chart of time / scipy per case")
    parser.add_argument("--small", action="store_true",
                        help="the per-call table of small problems (1x1 to 100x100, microseconds) against scipy "
                             "and lapx, and many tiny problems in one batch (pyperm.benchmarks.lap_small)")
    parser.add_argument("--sparse", action="store_true",
                        help="scipy.sparse input: pyperm against scipy's min_weight_full_bipartite_matching "
                             "and lap's lapmod (pyperm.benchmarks.lap_sparse)")
    parser.add_argument("--pipelines", action="store_true",
                        help="the pipelines' calls: a DETR-shaped padded batch with sizes against scipy's "
                             "per-image loop, and a tracker's lapjv with cost_limit against lap's "
                             "(pyperm.benchmarks.lap_pipelines)")
    parser.add_argument("--threads-goal", action="store_true",
                        help="default threads against threads=1 on DETR's list batch and a 256 x 128 x 128 stack "
                             "(pyperm.benchmarks.lap_threads_goal)")
    parser.add_argument("--load", type=int_at_least(0), default=0,
                        help="--threads-goal: spinning processes to run beside the measurement (a busy machine)")
    parser.add_argument("--crossover", action="store_true",
                        help="--threads-goal: also the measurement behind the thread pool's cost model")


# Tables of their own, run instead of the dense cases when asked for (any combination).
SECTIONS = ("small", "sparse", "pipelines", "threads_goal")


def run(args: argparse.Namespace) -> int:
    sections = [name for name in SECTIONS if getattr(args, name, False)]
    if sections:
        status = 0
        for name in sections:
            status = max(status, importlib.import_module(f"pyperm.benchmarks.lap_{name}").run(args))
        return status
    if args.device == "cuda" and not pyperm.cuda_available():
        print(f"--device cuda: {pyperm.cuda_unavailable_reason()}", file=sys.stderr)
        return 2
    gpu_default = args.device == "cuda" and args.cases is DEFAULT
    names = QUICK if args.quick else MATCHING if args.matching else GPU if gpu_default else args.cases
    print(f"pyperm {pyperm.__version__}, kernels: {kernels()}, "
          f"threads: {args.threads or core.hardware_threads()}, clock: {args.clock}, medians of {args.repeat}")
    rng = np.random.default_rng(args.seed)
    table, plot_series, summary, gpu = [], {}, [], []
    for name in names:
        case = CASES[name]
        results = run_case(case, rng, args.repeat, args.threads, args.clock, args.device, not args.no_peers)
        times = {s: t for s, t, _ in results if t is not None}
        ours = "pyperm.batch" if case.batch else "pyperm"
        scipy_key = "scipy (loop)" if case.batch else "scipy"
        if "pyperm.cuda" in times and ours in times:
            goal = GPU_GOALS.get(name)
            ratio = times["pyperm.cuda"] / times[ours]
            gpu.append([name, 1e3 * times[ours], 1e3 * times["pyperm.cuda"], ratio, times[ours] / times["pyperm.cuda"],
                        goal, None if goal is None else ("yes" if ratio <= goal else "no")])  # fmt: skip
        peers = {s: t for s, t in times.items() if s not in (ours, "pyperm.cuda")}
        fastest = min(peers, key=peers.get) if peers else None
        for solver, t, note in results:
            vs_scipy = t / times[scipy_key] if t is not None and scipy_key in times else None
            vs_fastest = t / peers[fastest] if t is not None and fastest and solver == ours else None
            table.append([name, solver, None if t is None else 1e3 * t, vs_scipy, vs_fastest, note])
            plot_series.setdefault(solver.replace(" (loop)", "").replace("_batch", "").replace(".batch", ""), {})[name] = vs_scipy
        if ours in times and fastest:
            summary.append([name, times[ours] / times.get(scipy_key, float("nan")), fastest, times[ours] / peers[fastest]])
    print(text_table(["case", "solver", "median ms", "/ scipy", "/ fastest peer", "note"], table))
    print()
    print(text_table(["case", "pyperm / scipy", "fastest peer", "pyperm / fastest peer"], summary))
    if gpu:
        print()
        print(f"GPU: {cuda_device_name()} against pyperm's CPU solvers on this machine's {core.hardware_threads()} "
              "hardware threads (cuda / cpu: lower is faster)")
        print(text_table(["case", "pyperm cpu ms", "pyperm cuda ms", "cuda / cpu", "speed-up", "goal", "met"], gpu))
    if args.plot:
        series = {s: [vals.get(n) for n in names] for s, vals in plot_series.items()}
        save_bar_plot(args.plot, "assignment solvers: time relative to scipy (lower is faster)", names, series,
                      "time / scipy")
        print(f"plot saved to {args.plot}")
    return 0


