"""``pyperm bench merge``: many models merged by MergeMany and by C2M3, with and without REPAIR.

The models are the ones ``pyperm reproduce rebasin`` trains at the same ``--scale`` and
``--data`` (its MLP and recipe, seeds ``1000 * seed + 1, + 2, ...``). For each count of
``--models`` (the first 3, 5, 10 of them), in one run:

- ``MergeMany``: :func:`pyperm.nn.merge_many` (Git Re-Basin Algorithm 3);
- ``C2M3``: :func:`pyperm.nn.align.c2m3.c2m3_merge` with its defaults (cycle-consistent
  Frank-Wolfe in a universe; ``merge_many(..., method="c2m3")`` runs it);
- ``... + REPAIR``: either merge renormalised by :func:`pyperm.nn.repair_many` on the
  training split (the time adds REPAIR's);
- ``pairwise WM``: weight matching of every ordered pair, for its cycle-consistency error and
  the barriers of pairs matched directly (no merge);
- with ``--authors DIR`` (the ``src`` folder of a checkout of
  crisostomi/cycle-consistent-model-merging): the authors' Frank-Wolfe
  (``frank_wolfe_synchronized_matching``, their merging settings: 200 iterations at most,
  every model free) on the same state dicts from their two starts, beside ours run the same
  way (``anchor=False`` and the same start); their code calls ``.cuda()``, which this run makes a
  no-op on the CPU.

Columns: the merged model's test loss and accuracy; the mean over pairs of models of the
test loss barrier between the two as the method aligned them (:func:`pyperm.nn.barrier`);
the cycle-consistency error (:func:`pyperm.nn.align.c2m3.cycle_consistency_error`: 0 for both
merges, which map every model to one space); the objective summed over pairs
(:func:`pyperm.nn.align.c2m3.merge_objective`, the same for all rows); the seconds.
The goals printed below: C2M3's merged test loss at or below MergeMany's for 5 and 10 models,
in at most MergeMany's time; the authors' Frank-Wolfe at least 5x slower than ours at an
objective no better.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

from pyperm._argtypes import positive_int
from pyperm._staging import write_file
from pyperm._tables import markdown_table, text_table

SCALES = ("smoke", "quick", "full", "paper")
HEADERS = ["models", "method", "test loss", "test acc", "pair barrier", "cycle error", "objective", "seconds"]
AUTHORS_MAX_ITER = 200  # their merger's max_iter (conf/matching/merger/frank_wolfe_to_universe.yaml)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts such as 3,5,10, got {text!r}") from None
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"every count must be at least 2, got {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="digits", help="digits (default) or mnist:DIR, as pyperm reproduce rebasin")
    parser.add_argument("--scale", choices=SCALES, default="smoke", help="the models of pyperm reproduce rebasin")
    parser.add_argument("--models", type=_counts, default=[3, 5, 10], help="counts of models merged (default 3,5,10)")
    parser.add_argument("--seed", type=int, default=0, help="the models' seeds are 1000 * seed + 1, + 2, ...")
    parser.add_argument("--epochs", type=positive_int, default=None,
                        help="train the models this many epochs (default: the scale's, 100 at paper scale)")
    parser.add_argument("--cache", metavar="DIR", default=None,
                        help="keep the trained models in DIR and reuse them (one file per seed)")
    parser.add_argument("--points", type=positive_int, default=None,
                        help="points on each pair's line for the barriers (default: the scale's, 25 at paper scale)")
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="timed runs of each merge (median reported; the answers are the same)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--authors", metavar="DIR", default=None,
                        help="the src folder of crisostomi/cycle-consistent-model-merging: add the authors' rows")
    parser.add_argument("--authors-models", type=_counts, default=[3],
                        help="the counts of --models at which the authors' code runs (default 3: theirs is slow)")
    parser.add_argument("--authors-iter", type=positive_int, default=AUTHORS_MAX_ITER,
                        help="most Frank-Wolfe iterations of theirs and of ours beside it "
                             f"(default {AUTHORS_MAX_ITER}, their merging setting)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--write", metavar="DIR", default=None,
                        help="also write the table as DIR/bench-merge-<data>-<scale>.md (the docs include "
                             "docs/_generated/)")


def _models(scale: str, data: str, count: int, seed: int, cache: str | None,
            epochs: int | None = None) -> tuple[Any, list[dict], dict, dict]:  # fmt: skip
    """The report's model, ``count`` trained states, its data and its settings (``epochs``: the scale's unless
    given)."""
    import pathlib

    import torch

    from pyperm.reproduce._data import load_data
    from pyperm.reproduce.rebasin._experiments import train_endpoint
    from pyperm.reproduce.rebasin._settings import SETTINGS, mlp_name

    cfg = dict(SETTINGS[scale])
    trained = "" if epochs is None or epochs == cfg["epochs"] else f"-epochs{epochs}"
    cfg["epochs"] = cfg["epochs"] if epochs is None else epochs
    loaded = load_data(data, "cpu", cfg["eval_batch"], repair=cfg["eval_batch"])
    name = mlp_name(loaded, cfg["width"], cfg["depth"])
    from pyperm.nn.models import create_model

    model, states = create_model(name), []
    for k in range(1, count + 1):
        path = None
        if cache is not None:
            path = pathlib.Path(cache) / f"{loaded['name']}-{scale}-{name.replace(':', '_')}{trained}-{1000 * seed + k}.pt"
        if path is not None and path.exists():
            states.append(torch.load(path, weights_only=True))
            continue
        model, state = train_endpoint(name, loaded, cfg["recipe"], cfg["batch"], cfg["epochs"], 1000 * seed + k, "cpu")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, lambda f, state=state: torch.save(state, f))
        states.append(state)
    return model, states, loaded, cfg


def _timed(fn: Any, repeat: int) -> tuple[Any, float]:
    """``fn()``'s answer and the median seconds of ``repeat`` runs."""
    import statistics

    seconds, answer = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        answer = fn()
        seconds.append(time.perf_counter() - started)
    return answer, statistics.median(seconds)


def _evaluate(model: Any, state: dict, batches: Any) -> tuple[float, float]:
    from pyperm.reproduce._train import evaluate, loaded_copy

    return evaluate(loaded_copy(model, state).eval(), batches)


def _pair_barrier(model: Any, aligned: list[dict], batches: Any, points: int) -> float:
    """The mean test loss barrier over the pairs of aligned models."""
    values = [_barrier(model, aligned[a], aligned[b], batches, points)
              for a, b in itertools.combinations(range(len(aligned)), 2)]  # fmt: skip
    return sum(values) / len(values)


def _barrier(model: Any, sa: dict, sb: dict, batches: Any, points: int) -> float:
    from pyperm.nn import barrier

    return barrier(model, sa, sb, batches, num_points=points).loss_barrier


def _import_authors(folder: str) -> Any:
    """The authors' ``frank_wolfe_sync_matching`` module from their checkout (never part of pyperm), with
    stand-ins for the training stack its package imports and the matching does not use."""
    import enum
    import functools
    import importlib.util
    import sys
    import types

    def stub(name: str, **attrs: Any) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        module.__path__ = []
        sys.modules[name] = module
        return module

    stub("pytorch_lightning", LightningModule=object, seed_everything=lambda *a, **k: None)
    stub("backports")
    stub("backports.strenum", StrEnum=enum.StrEnum)
    for name in ("ccmm", "ccmm.matching", "ccmm.utils"):
        stub(name)
    stub("ccmm.utils.utils", get_model=lambda m: m, to_np=lambda x: x.detach().cpu().numpy(), ModelParams=dict)
    stub("ccmm.utils.perm_graph", get_perm_dict=None, graph_permutations_to_layer_and_axes_to_perm=None)
    stub("ccmm.matching.permutation_spec", PermutationSpec=object)

    def load(name: str, relative: str) -> Any:
        spec = importlib.util.spec_from_file_location(name, f"{folder}/ccmm/{relative}")
        if spec is None or spec.loader is None:
            raise SystemExit(f"--authors {folder}: no ccmm/{relative} there (give the checkout's src folder)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    try:
        load("ccmm.matching.utils", "matching/utils.py")
        load("ccmm.matching.weight_matching", "matching/weight_matching.py")
        helpers = load("ccmm.matching.frank_wolfe_matching", "matching/frank_wolfe_matching.py")
        sync = load("ccmm.matching.frank_wolfe_sync_matching", "matching/frank_wolfe_sync_matching.py")
    except (ImportError, FileNotFoundError) as err:
        raise SystemExit(f"--authors {folder}: cannot load the authors' matching ({err})") from None
    # Their barycenter start makes its matrices on "cuda" by default: on the CPU here.
    sync.initialize_perm_matrices = functools.partial(helpers.initialize_perm_matrices, device="cpu")
    helpers.initialize_perturbed_uniform = functools.partial(helpers.initialize_perturbed_uniform, device="cpu")
    return sync


class _AuthorsSpec:
    """Their spec's two maps, read off a flat pyperm spec (a weight's axes (out, in), a bias's (out,))."""

    def __init__(self, spec: Any) -> None:
        self.layer_and_axes_to_perm = {k: tuple(axes) for k, axes in spec.axes.items()}
        self.perm_to_layers_and_axes: dict[str, list] = {}
        for k, axes in spec.axes.items():
            for ax, g in enumerate(axes):
                if g is not None:
                    self.perm_to_layers_and_axes.setdefault(g, []).append((k, ax))


def _authors_merge(sync: Any, spec: Any, states: list[dict], init: str, max_iter: int) -> tuple[list[Any], float, int]:
    """Their Frank-Wolfe on ``states``: our permutations of the models into their universe, seconds, iterations."""
    import torch

    from pyperm.nn import Permutations

    params = {str(i): {k: v.detach().float() for k, v in s.items()} for i, s in enumerate(states)}
    symbols = list(params)
    pairs = [(a, b) for a, b in itertools.combinations(symbols, 2)]
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # their update moves each matrix with .cuda()
    torch.manual_seed(0)  # their barycenter start draws from the global generator
    try:
        started = time.perf_counter()
        indices, info = sync.frank_wolfe_synchronized_matching(
            params=params, perm_spec=_AuthorsSpec(spec), symbols=symbols, combinations=pairs,
            max_iter=max_iter, initialization_method=init, device="cpu")  # fmt: skip
        seconds = time.perf_counter() - started
    finally:
        torch.Tensor.cuda = cuda
    # Their P_a (P[i, idx[i]] = 1) takes model a into the universe as P_a^T W_a: the universe's unit j is a's
    # unit i where idx[i] = j, so pyperm's index of model a into the universe is the inverse, argsort(idx).
    perms = [Permutations(spec, {g: torch.argsort(indices[s][g]) for g in spec.sizes}) for s in symbols]
    return perms, seconds, len(info["obj_values"])


def run(args: argparse.Namespace) -> int:
    import torch

    from pyperm.nn import Permutations, merge_many
    from pyperm.nn.align.c2m3 import c2m3_merge, cycle_consistency_error, merge_objective, pairwise_matchings
    from pyperm.nn.eval.repair import repair_many
    from pyperm.nn.state import average

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sync = _import_authors(args.authors) if args.authors else None
    model, all_states, loaded, cfg = _models(args.scale, args.data, max(args.models), args.seed, args.cache,
                                                  args.epochs)  # fmt: skip
    spec = model.permutation_spec()
    test, points = loaded["test"], args.points or cfg["points"]
    repair_data = [x for x, _ in loaded["repair"]]
    rows, goals = [], []
    for count in args.models:
        states = all_states[:count]

        def row(method: str, merged: dict | None, perms: list | None, seconds: float, barrier: float | None = None,
                cycle: float | None = None) -> list:  # fmt: skip
            loss, acc = _evaluate(model, merged, test) if merged is not None else (None, None)
            if perms is not None and barrier is None:
                barrier = _pair_barrier(model, [p.apply(s) for p, s in zip(perms, states)], test, points)
            if perms is not None and cycle is None:
                cycle = cycle_consistency_error(spec, perms)
            objective = merge_objective(spec, states, perms) if perms is not None else None
            # The objectives of the methods differ in their fifth or sixth digit: all of them shown.
            out = [count, method, loss, acc, barrier, cycle, None if objective is None else f"{objective:.8g}", seconds]
            print(" | ".join(map(str, out)), file=sys.stderr, flush=True)  # progress, the table comes at the end
            return out

        ends = [_evaluate(model, s, test) for s in states]
        rows.append([count, "endpoints (mean)", sum(e[0] for e in ends) / count, sum(e[1] for e in ends) / count,
                     None, None, None, None])  # fmt: skip
        rows.append(row("naive average", average(states), [Permutations.identity(spec)] * count, 0.0))

        mm, mm_seconds = _timed(lambda: merge_many(spec, states, seed=args.seed), args.repeat)
        rows.append(row("MergeMany", mm.merged, mm.perms, mm_seconds))

        c2, c2_seconds = _timed(lambda: c2m3_merge(spec, states, seed=args.seed), args.repeat)
        rows.append(row(f"C2M3 ({c2.iterations} it)", c2.merged, c2.perms, c2_seconds))

        for label, result, seconds in (("MergeMany", mm, mm_seconds), ("C2M3", c2, c2_seconds)):
            started = time.perf_counter()
            repaired = repair_many(model, spec, [p.apply(s) for p, s in zip(result.perms, states)], repair_data)
            rows.append(row(f"{label} + REPAIR", repaired, None, seconds + time.perf_counter() - started))

        started = time.perf_counter()
        pairwise = pairwise_matchings(spec, states, seed=args.seed)
        wm_seconds = time.perf_counter() - started
        barriers = [_barrier(model, states[a], pairwise[a, b].apply(states[b]), test, points)
                    for a, b in itertools.combinations(range(count), 2)]  # fmt: skip
        rows.append([count, "pairwise WM", None, None, sum(barriers) / len(barriers),
                     cycle_consistency_error(spec, pairwise), None, wm_seconds])  # fmt: skip

        if sync is not None and count in args.authors_models:
            for init, ours in (("identity", "identity"), ("sinkhorn", "barycenter")):
                perms, seconds, iters = _authors_merge(sync, spec, states, init, args.authors_iter)
                merged = average([p.apply(s) for p, s in zip(perms, states)])
                rows.append(row(f"authors' FW, {init} start ({iters} it)", merged, perms, seconds))
                mine, mine_seconds = _timed(lambda: c2m3_merge(spec, states, init=ours, anchor=False,
                                                               max_iter=args.authors_iter, seed=args.seed),
                                            args.repeat)  # fmt: skip
                rows.append(row(f"C2M3, their form, {ours} start ({mine.iterations} it)", mine.merged, mine.perms,
                                mine_seconds))  # fmt: skip
                goals.append(f"{count} models, {init} start: the authors' FW took {seconds / mine_seconds:.1f}x ours "
                             f"(goal >= 5x); objective theirs {merge_objective(spec, states, perms):.6g}, ours "
                             f"{mine.final_objective:.6g}")  # fmt: skip
        if count >= 5:
            c2_row = next(r for r in rows if r[0] == count and r[1].startswith("C2M3 ("))
            mm_row = next(r for r in rows if r[0] == count and r[1] == "MergeMany")
            mm_loss, c2_loss = mm_row[2], c2_row[2]
            goals.append(f"{count} models: C2M3's test loss {c2_loss:.4f} vs MergeMany's {mm_loss:.4f} "
                         f"({'met' if c2_loss <= mm_loss else 'not met'}); time {c2_row[-1]:.2f} s vs "
                         f"{mm_row[-1]:.2f} s ({'met' if c2_row[-1] <= mm_row[-1] else 'not met'})")  # fmt: skip
    goals.append(f"models: {cfg['epochs']} epochs of training each (seeds {1000 * args.seed + 1} to "
                 f"{1000 * args.seed + max(args.models)}); barriers on {points} points of each pair's line; times on "
                 f"{torch.get_num_threads()} torch thread(s)")
    table = (markdown_table if args.markdown else text_table)(HEADERS, rows)
    print(table)
    for line in goals:
        print(line)
    if args.write:
        from pyperm.benchmarks._report import write_generated

        name = f"bench-merge-{loaded['name']}-{args.scale}" + (f"-epochs{cfg['epochs']}" if args.epochs else "")
        write_generated(args.write, name, markdown_table(HEADERS, rows) + "\n\n" + "\n".join(f"- {g}" for g in goals))
    return 0

