"""``pyperm bench zipit``: the time of a whole zip of two ResNet-20-shaped models, and of its greedy matching next
to the authors' ``match_tensors_zipit`` on the same correlation matrices.

The zip (:func:`pyperm.nn.zipit`, a full zip) runs once; every group's correlation matrix is kept as the zip
hands it to its pairing, and the pairing's own time is summed (the matching's share of the whole zip). With
``--authors DIR`` (a checkout of gstoica27/ZipIt, never part of pyperm) the authors' matching function runs
on the same matrices with the same ``alpha`` and ``beta`` (theirs ``a`` and ``b``), and the table says whether
both found the same clusters. The models are freshly initialised (their BatchNorm statistics from the
data), the data random CIFAR-shaped images: the times depend on the widths, not on what the models learnt.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
import types
from typing import Any

import numpy as np

from pyperm._argtypes import positive_int

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=positive_int, default=4, help="ResNet-20 width multiplier (default 4)")
    parser.add_argument("--batches", type=positive_int, default=4, help="batches of random images (default 4)")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="images per batch (default 128)")
    parser.add_argument("--alpha", type=float, default=0.3, help="the zip's alpha (default 0.3, the authors')")
    parser.add_argument("--beta", type=float, default=0.125, help="the zip's beta (default 0.125, the authors')")
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="timed runs of each matching on each matrix (the fastest reported; default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--authors", metavar="DIR", default=None,
                        help="a checkout of gstoica27/ZipIt: time its match_tensors_zipit on the same matrices")  # fmt: skip
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")


def _import_authors(folder: str) -> Any:
    """The authors' ``matching_functions`` module, with stand-ins for the imports its ZipIt matching never uses."""
    for name in ("networkx", "sklearn", "sklearn.cluster"):
        if importlib.util.find_spec(name.split(".")[0]) is None:
            module = types.ModuleType(name)
            module.__dict__.update(Graph=object, AgglomerativeClustering=object, KMeans=object)
            sys.modules[name] = module
    spec = importlib.util.spec_from_file_location("zipit_authors_matching", f"{folder}/matching_functions.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"--authors {folder}: no matching_functions.py there")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        raise SystemExit(f"--authors {folder}: cannot load the authors' matching ({err})") from None
    return module


def _partition(clusters: np.ndarray) -> list[tuple[int, ...]]:
    return sorted(tuple(np.flatnonzero(clusters == c).tolist()) for c in np.unique(clusters))


def run(args: argparse.Namespace) -> int:
    import torch

    from pyperm.nn import reset_bn_stats, zipit
    from pyperm.nn.models import create_model

    # the module (pyperm.nn.align's attribute of that name is the function)
    zipit_module = importlib.import_module("pyperm.nn.align.zipit")

    if args.threads:
        torch.set_num_threads(args.threads)
    authors = _import_authors(args.authors) if args.authors else None
    gen = torch.Generator().manual_seed(args.seed)
    data = [torch.randn(args.batch_size, 3, 32, 32, generator=gen) for _ in range(args.batches)]
    models = []
    for k in range(2):
        torch.manual_seed(args.seed * 1000 + k)
        model = create_model(f"resnet20:{args.width}")
        reset_bn_stats(model, data)
        models.append(model.eval())

    seen: list[tuple[np.ndarray, Any, float]] = []
    pairing = zipit_module.zip_pairing

    def timed_pairing(similarity: np.ndarray, **kwargs: Any) -> Any:
        start = time.perf_counter()
        found = pairing(similarity, **kwargs)
        seen.append((similarity, found, time.perf_counter() - start))
        return found

    zipit_module.zip_pairing = timed_pairing
    try:
        start = time.perf_counter()
        zipit(models[0], models[1], models[0].permutation_spec(), data, alpha=args.alpha, beta=args.beta)
        whole = time.perf_counter() - start
    finally:
        zipit_module.zip_pairing = pairing
    in_zip = sum(s for _, _, s in seen)
    rows = []
    ours_total = theirs_total = 0.0
    for similarity, found, _ in seen:
        seconds = _fastest(lambda: pairing(similarity, alpha=args.alpha, beta=args.beta), args.repeat)
        ours_total += seconds
        row = {"features": similarity.shape[0], "pyperm_ms": 1e3 * seconds}
        if authors is not None:
            cov = torch.from_numpy(np.array(similarity, dtype=np.float32))
            theirs = _fastest(lambda: authors.match_tensors_zipit({"covariance": cov.clone()}, a=args.alpha,
                                                                  b=args.beta), args.repeat)  # fmt: skip
            theirs_total += theirs
            _, unmerge = authors.match_tensors_zipit({"covariance": cov.clone()}, a=args.alpha, b=args.beta)
            same = _partition(unmerge.numpy().argmax(1)) == _partition(found.cluster)
            row.update(authors_ms=1e3 * theirs, ratio=theirs / seconds, same_clusters=same)
        rows.append(row)
    heads = list(rows[0])
    lines = []
    if args.markdown:
        lines += ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
        lines += ["| " + " | ".join(_cell(r[h]) for h in heads) + " |" for r in rows]
    else:
        lines += ["  ".join(f"{h:>14}" for h in heads)]
        lines += ["  ".join(f"{_cell(r[h]):>14}" for h in heads) for r in rows]
    print("\n".join(lines))
    print(f"whole zip of two ResNet-20x{args.width} ({args.batches} batches of {args.batch_size}): {whole:.2f} s, "
          f"{len(rows)} groups; its matching {in_zip:.3f} s there ({100 * in_zip / whole:.1f}% of the zip), "
          f"{ours_total:.3f} s at best of {args.repeat}")  # fmt: skip
    if authors is not None:
        print(f"authors' match_tensors_zipit on the same matrices: {theirs_total:.3f} s at best of {args.repeat}, "
              f"{theirs_total / ours_total:.1f}x pyperm's matching; same clusters in "
              f"{sum(r['same_clusters'] for r in rows)}/{len(rows)} groups")  # fmt: skip
    return 0


def _fastest(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
