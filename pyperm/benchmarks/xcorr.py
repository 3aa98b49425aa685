"""``pyperm bench xcorr``: one CrossCorrelation.update against the bare BLAS product it contains.

For each (dim, batch) it times ``acc.update(xa, xb)`` on a (batch, dim) x (batch, dim) pair
and numpy's ``xa.T @ xb`` of the same data, alternating the two so that both see the same
machine load, and prints the medians and their ratio. The update does strictly more work
(centring, the product, the float64 merge), so the ratio is its overhead; the goal is at
most 1.5. ``--device cuda`` does the same on the GPU, with torch CUDA tensors, against
``torch.matmul(xa.T, xb)`` (goal 1.3), the stream synchronised after each call. Also runnable as
``python -m pyperm.benchmarks.xcorr``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from pyperm._plotting import save_figure
from pyperm._tables import text_table
from pyperm.benchmarks._report import cuda_device_name, kernels, time_calls, to_host
from pyperm._argtypes import int_at_least, positive_int

DEFAULT_DIMS = (512, 1024, 2048, 4096)
DEFAULT_BATCHES = (256, 1024, 4096)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dims", type=positive_int, nargs="+", default=list(DEFAULT_DIMS),
                        help="channels of both streams (dim_a = dim_b)")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=list(DEFAULT_BATCHES),
                        help="samples per update")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="input precision")
    parser.add_argument("--repeat", type=positive_int, default=7, help="timed runs of each (median reported)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="threads of pyperm's kernels (default: all cores; BLAS uses its own setting)")
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--quick", action="store_true", help="dims 512 1024, batches 256 1024, --repeat 3")
    parser.add_argument("--plot", metavar="PNG", default=None, help="also save a plot of the ratios")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: torch CUDA tensors, the update against torch.matmul on the GPU")



def _check(acc_cls: Any, xa: Any, xb: Any, threads: int | None) -> float:
    """Relative error of one update's co-moment against a float64 reference (a few rows)."""
    acc = acc_cls(xa.shape[1], xb.shape[1], threads=threads).update(xa, xb)
    rows = min(8, xa.shape[1])
    a = to_host(xa[:, :rows]).astype(np.float64)
    b = to_host(xb).astype(np.float64)
    ref = (a - a.mean(0)).T @ (b - b.mean(0))
    got = to_host(acc.covariance(ddof=0))[:rows] * xa.shape[0]
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-300))


def measure(dim: int, batch: int, dtype: np.dtype, repeat: int, threads: int | None,
            rng: np.random.Generator, device: str = "cpu") -> dict[str, float]:
    from pyperm import CrossCorrelation

    xa = rng.standard_normal((batch, dim), dtype=np.float32).astype(dtype, copy=False)
    xb = (0.5 * xa[:, ::-1] + rng.standard_normal((batch, dim), dtype=np.float32)).astype(dtype)
    product = lambda: xa.T @ xb  # noqa: E731
    sync = lambda: None  # noqa: E731
    if device == "cuda":
        import torch

        xa, xb = torch.from_numpy(xa).cuda(), torch.from_numpy(xb).cuda()
        product = lambda: torch.matmul(xa.T, xb)  # noqa: E731
        sync = torch.cuda.synchronize
    error = _check(CrossCorrelation, xa[: min(batch, 512)], xb[: min(batch, 512)], threads)
    acc = CrossCorrelation(dim, dim, threads=threads)

    def update():
        acc.update(xa, xb)
        sync()

    def blas():
        product()
        sync()

    # The warm-up update allocates the accumulator and the workspace.
    t = time_calls({"update": update, "blas": blas}, repeat)
    upd, blas = t["update"].samples, t["blas"].samples
    u, b = 1e3 * t["update"].median, 1e3 * t["blas"].median
    return {"dim": dim, "batch": batch, "update_ms": u, "blas_ms": b, "ratio": u / b,
            "min_ratio": min(upd) / min(blas), "gflops": 2.0 * batch * dim * dim / (u * 1e6), "check": error}


def run(args: argparse.Namespace) -> int:
    import pyperm
    from pyperm._ext import core

    dims = [512, 1024] if args.quick else args.dims
    batches = [256, 1024] if args.quick else args.batches
    repeat = 3 if args.quick else args.repeat
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    if args.device == "cuda" and not pyperm.cuda_available():
        print(f"--device cuda: {pyperm.cuda_unavailable_reason()}", file=sys.stderr)
        return 2
    where = "GPU " + cuda_device_name() if args.device == "cuda" else f"hardware threads {core.hardware_threads()}"
    print(f"pyperm {pyperm.__version__}  numpy {np.__version__}  kernels {kernels()}  {where}  "
          f"kernel threads {args.threads or 'all'}  dtype {dtype}  repeat {repeat}")
    if args.device == "cuda":
        print("on the GPU: blas = torch.matmul(xa.T, xb) of the same CUDA tensors; goal: ratio at most 1.3")
    print("update = CrossCorrelation.update(xa, xb); blas = xa.T @ xb on the same (batch, dim) data; "
          "median ms, alternating runs;\nratio = median update / median blas; (min) = fastest update / fastest "
          "blas, steadier on a busy machine; GFLOP/s of the update")
    results = []
    for dim in dims:
        for batch in batches:
            results.append(measure(dim, batch, dtype, repeat, args.threads, rng, args.device))
            print(f"dim {dim}, batch {batch}: ratio {results[-1]['ratio']:.2f}", file=sys.stderr, flush=True)
    keys = ("dim", "batch", "update_ms", "blas_ms", "ratio", "min_ratio", "gflops", "check")
    print(text_table(["dim", "batch", "update ms", "blas ms", "ratio", "(min)", "GFLOP/s", "check"],
                     [[r[k] for k in keys] for r in results]))  # fmt: skip
    worst = max(results, key=lambda r: r["ratio"])
    print(f"worst ratio {worst['ratio']:.2f} at dim {worst['dim']}, batch {worst['batch']} "
          f"(check: max relative error of the co-moment against float64 numpy)")
    if args.plot:
        _plot(results, dims, batches, args.plot, dtype)
        print(f"plot written to {args.plot}")
    return 0




def _plot(results: list[dict[str, float]], dims: list[int], batches: list[int], path: str,
          dtype: np.dtype) -> None:
    from pyperm._plotting import agg_figure

    fig = agg_figure(6, 4, layout="tight")
    ax = fig.add_subplot()
    for batch in batches:
        rows = [r for r in results if r["batch"] == batch]
        ax.plot([r["dim"] for r in rows], [r["ratio"] for r in rows], marker="o", label=f"batch {batch}")
    ax.axhline(1.5, color="grey", linestyle="--", linewidth=1, label="goal 1.5")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(dims, [str(d) for d in dims])
    ax.set_xlabel("dim (dim_a = dim_b)")
    ax.set_ylabel("update time / (xa.T @ xb) time")
    ax.set_title(f"CrossCorrelation.update overhead over BLAS ({dtype})")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyperm.benchmarks.xcorr", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
