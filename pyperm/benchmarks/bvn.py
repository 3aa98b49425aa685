"""``pyperm bench bvn``: the Birkhoff-von Neumann decomposition against a scipy-based greedy.

Three cases, each checked for agreement with the reference before it is timed:

* ``dense256-bottleneck``: a dense n=256 doubly stochastic matrix (Sinkhorn of
  exp(2 N(0, 1))) fully decomposed by the bottleneck heuristic (tol 1e-9). The reference
  greedy (a bottleneck matching per term by binary search over the residual's values, with
  scipy's Hopcroft-Karp) needs minutes for the full decomposition, so it is timed on the
  first ``--reference-terms`` terms, and the ratio is taken against pyperm on those same
  terms.
* ``dense1024-maxweight10``: the first 10 max-weight terms of a dense n=1024 matrix; the
  reference solves every term from scratch with ``scipy.optimize.linear_sum_assignment``.
  Also shown: the same terms warm-started through ``lap_cpu``'s ``solve_square_warm``
  (column duals only) instead of pyperm's incremental solver (matching and duals).
* ``planted1024-k20-bottleneck``: a convex combination of 20 random permutations of
  n=1024, decomposed by the bottleneck heuristic (exactly 20 terms).

Times are the best of ``--repeat`` runs of the public API (input validation included).
``--device cuda`` gives pyperm the matrices as CUDA tensors (made before timing; the answers are
copied back inside the timed call, which is also what waits for the GPU); the references stay
on the CPU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import numpy as np

import pyperm
from pyperm._ext import core
from pyperm._tables import text_table
from pyperm.benchmarks._report import kernels, time_call, to_host
from pyperm._argtypes import int_at_least, nonnegative_int, positive_int
from pyperm.testing import (
    dense_doubly_stochastic,
    planted,
    reconstruct,
    scipy_bottleneck_greedy,
    scipy_max_weight_greedy,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=positive_int, default=3, help="timed runs per measurement (best is reported)")
    parser.add_argument(
        "--reference-terms",
        type=nonnegative_int,
        default=200,
        help="terms of the dense n=256 case the scipy greedy is timed on (0: skip it)",
    )
    parser.add_argument("--no-reference", action="store_true", help="time pyperm only")
    parser.add_argument(
        "--matrices", type=positive_int, default=5, help="dense n=1024 matrices the max-weight case runs on"
    )
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: pyperm decomposes CUDA tensors (the references stay on the CPU)")


def best_time(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Best seconds of ``repeat`` calls (no warm-up: the first call is one of them) and the result."""
    t = time_call(fn, repeat, warmup=False)
    return t.best, t.result



def _decompose(device: str, D: np.ndarray) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    """``birkhoff_decomposition`` of ``D`` on ``device`` (moved there once, here), answers as numpy."""
    on_device = D
    if device != "cpu":
        import torch

        on_device = torch.from_numpy(D).to(device)

    def call(**kwargs):
        coeffs, perms = pyperm.birkhoff_decomposition(on_device, **kwargs)
        return to_host(coeffs), to_host(perms)

    return call


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def run(args: argparse.Namespace) -> int:
    dtype = np.dtype(args.dtype)
    tol = 1e-9 if dtype == np.float64 else 1e-6
    reference = not args.no_reference
    if args.device == "cuda" and not pyperm.cuda_available():
        print(f"--device cuda: {pyperm.cuda_unavailable_reason()}", file=sys.stderr)
        return 2
    rows_out = []
    failures = []

    # 1. dense n=256, full bottleneck decomposition.
    D = dense_doubly_stochastic(256, args.seed, dtype)
    decompose = _decompose(args.device, D)
    t_full, (coeffs, perms) = best_time(lambda: decompose(method="bottleneck", tol=tol), args.repeat)
    err = float(np.abs(D.astype(np.float64) - reconstruct(coeffs, perms)).max())
    if err > 10 * tol:
        failures.append(f"dense256-bottleneck: reconstruction error {err:.3g}")
    t_ref = ratio = None
    note = f"{len(coeffs)} terms, max error {err:.1e}"
    if reference and args.reference_terms > 0:
        k = min(args.reference_terms, len(coeffs))
        t_ours, (c_ours, _) = best_time(lambda: decompose(method="bottleneck", tol=tol, max_terms=k), args.repeat)
        t_ref, (c_ref, _) = best_time(lambda: scipy_bottleneck_greedy(D, max_terms=k, tol=tol), 1)
        # Ties aside the matchings may differ, but each term's bottleneck value is unique.
        if not np.isclose(c_ref[0], c_ours[0], rtol=1e-6):
            failures.append("dense256-bottleneck: first coefficient differs from the scipy greedy")
        ratio = t_ref / t_ours
        note += f"; ratio on the first {k} terms ({t_ours * 1e3:.1f} ms vs {t_ref * 1e3:.0f} ms)"
    rows_out.append(("dense256-bottleneck", 256, len(coeffs), t_full, t_ref, ratio, "< 600 ms", note))

    # 2. dense n=1024, first 10 max-weight terms, on several matrices (the time per term
    # varies with the matrix): the worst one is reported against the target.
    ours_t, ref_t, lap_t = [], [], []
    for s in range(args.matrices):
        D = dense_doubly_stochastic(1024, args.seed + 1 + s, dtype)
        decompose = _decompose(args.device, D)
        t, (coeffs, perms) = best_time(lambda: decompose(method="max-weight", max_terms=10), args.repeat)
        ours_t.append(t)
        if not reference:
            continue
        t, (c_ref, p_ref) = best_time(lambda: scipy_max_weight_greedy(D, 10), 1)
        ref_t.append(t)
        rows = np.arange(1024)
        ours = D.astype(np.float64)[rows, perms[0]].sum()
        theirs = D.astype(np.float64)[rows, p_ref[0]].sum()
        if not np.isclose(ours, theirs, rtol=1e-6):
            failures.append(f"dense1024-maxweight10: first term weight {ours} vs scipy {theirs}")
        if args.device != "cpu":
            continue
        # The same terms with lap_cpu's solve_square_warm (warm from the column duals only).
        t, (c_lw, _, _, _) = best_time(
            lambda: core.bvn_decompose(np.ascontiguousarray(D), "max-weight-lapwarm", 10, tol), 1
        )
        lap_t.append(t)
        if not np.allclose(c_lw, coeffs, rtol=1e-5):
            failures.append("dense1024-maxweight10: lap warm start found other coefficients")
    spread = f"{len(ours_t)} matrices, median {np.median(ours_t) * 1e3:.1f} ms"
    if reference:
        ratio = max(ref_t) / max(ours_t)
        rows_out.append(
            ("dense1024-maxweight10", 1024, 10, max(ours_t), max(ref_t), ratio, "< 100 ms",
             f"worst of {spread}; reference: scipy linear_sum_assignment per term")
        )
        if lap_t:
            rows_out.append(
                ("  same, lap solve_square_warm", 1024, 10, max(lap_t), None, None, "",
                 f"duals-only warm start, worst of {len(lap_t)}, median {np.median(lap_t) * 1e3:.1f} ms")
            )
    else:
        rows_out.append(("dense1024-maxweight10", 1024, 10, max(ours_t), None, None, "< 100 ms", f"worst of {spread}"))

    # 3. planted k=20, n=1024, bottleneck.
    D, weights, planted_perms = planted(1024, 20, args.seed + 2, dtype)
    decompose = _decompose(args.device, D)
    t_pl, (coeffs, perms) = best_time(lambda: decompose(method="bottleneck", tol=tol), args.repeat)
    if len(coeffs) != 20:
        failures.append(f"planted1024-k20-bottleneck: {len(coeffs)} terms instead of 20")
    t_ref = ratio = None
    note = "exactly 20 terms" if len(coeffs) == 20 else f"{len(coeffs)} terms"
    if reference:
        t_ref, (c_ref, _) = best_time(lambda: scipy_bottleneck_greedy(D, tol=tol), 1)
        if len(c_ref) != len(coeffs) or not np.allclose(c_ref, coeffs, rtol=1e-5):
            failures.append("planted1024-k20-bottleneck: coefficients differ from the scipy greedy")
        ratio = t_ref / t_pl
    rows_out.append(("planted1024-k20-bottleneck", 1024, len(coeffs), t_pl, t_ref, ratio, "< 50 ms", note))

    print(f"pyperm {pyperm.__version__}, kernels: {kernels()}, dtype {dtype.name}, "
          f"best of {args.repeat}, device {args.device}")
    rows = [[name, n, terms, _ms(t), _ms(tr), r, target] for name, n, terms, t, tr, r, target, _ in rows_out]
    print(text_table(["case", "n", "terms", "pyperm ms", "scipy ms", "ratio", "target"], rows))
    for name, *_, note in rows_out:
        print(f"{name.strip()}: {note}")
    for f in failures:
        print(f"MISMATCH: {f}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyperm.benchmarks.bvn", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
