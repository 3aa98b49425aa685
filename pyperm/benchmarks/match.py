"""``pyperm bench match``: weight matching (Git Re-Basin Algorithm 1), pyperm against a reference.

Four cases, each a pair of independently initialised models (seeded): MLP
784-512-512-512-10, MLP 784-[2048]x4-10, ResNet20 x16 (shortcut B, widths 256/512/1024)
and VGG16 with BatchNorm. ``pyperm.nn.weight_matching`` is timed against
:func:`reference_weight_matching`, a straightforward implementation in the style of the
public PyTorch port of Git Re-Basin: every step rebuilds its group's similarity from all
its weights (float32 torch matmuls) and solves it with
``scipy.optimize.linear_sum_assignment``. Both visit the groups in the same seeded order,
so their objectives are comparable; pyperm's must be at least the reference's.

Times are medians (and the best) of ``--repeat`` runs of the public API (validation
included), after one untimed run of pyperm per model; the speedup and the target check
use the medians. The objectives are both
computed by ``pyperm.nn.matching_objective``; ``same perms`` says whether the two found
identical permutations. Exit status 1 when pyperm's objective is below the reference's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pyperm.benchmarks._report import time_call
from pyperm.testing import reference_weight_matching

# Target seconds on the 2-core development machine (the pyperm.nn issue).
TARGETS = {"mlp512": 0.04, "mlp2048": 3.0, "resnet20x16": 1.0, "vgg16": 2.0}
DESCRIPTIONS = {
    "mlp512": "MLP 784-512-512-512-10",
    "mlp2048": "MLP 784-[2048]x4-10",
    "resnet20x16": "ResNet20 x16 (shortcut B)",
    "vgg16": "VGG16-BN (CIFAR)",
}


def build_model(name: str, seed: int):
    """One of the benchmark models, initialised from ``seed`` without touching the global RNG."""
    import torch

    from pyperm.nn.models import MLP, VGG16, ResNet20

    factories: dict[str, Callable[[], torch.nn.Module]] = {
        "mlp512": lambda: MLP([784, 512, 512, 512, 10]),
        "mlp2048": lambda: MLP([784, 2048, 2048, 2048, 2048, 10]),
        "resnet20x16": lambda: ResNet20(width_multiplier=16),
        "vgg16": lambda: VGG16(),
    }
    if name not in factories:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(factories)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factories[name]()


@dataclass
class Row:
    name: str
    params: int
    groups: int
    ours_s: float
    ours_best: float
    ours_sweeps: int
    ours_obj: float
    ref_s: float | None = None
    ref_sweeps: int | None = None
    ref_obj: float | None = None
    same_perms: bool | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of pyperm per model (median reported)")
    parser.add_argument(
        "--reference-repeat", type=int, default=1, help="timed runs of the (slow) reference per model (median)"
    )
    parser.add_argument(
        "--models",
        default=",".join(TARGETS),
        help=f"comma-separated subset of {','.join(TARGETS)} (default: all)",
    )
    parser.add_argument("--no-reference", action="store_true", help="time pyperm only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the visiting order")
    parser.add_argument("--model-seeds", type=int, nargs=2, default=(1, 2), metavar=("A", "B"))
    parser.add_argument("--plot", metavar="PNG", help="save a bar chart of the times to this file")


def run(args: argparse.Namespace) -> int:
    import torch

    import pyperm
    from pyperm.nn import matching_objective, weight_matching

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in TARGETS]
    if unknown:
        print(f"unknown models {unknown}; choose from {','.join(TARGETS)}", file=sys.stderr)
        return 2
    print(
        f"pyperm {pyperm.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"model seeds {tuple(args.model_seeds)}, order seed {args.seed}"
    )
    rows: list[Row] = []
    failures: list[str] = []
    for name in names:
        model_a = build_model(name, args.model_seeds[0])
        model_b = build_model(name, args.model_seeds[1])
        spec = model_a.permutation_spec()
        sa, sb = model_a.state_dict(), model_b.state_dict()
        # One untimed run first: the process's first call of weight matching pays about 12 ms
        # of one-time costs, a third of MLP-512's time. The identity start: Algorithm 1 as the
        # reference (and every other library) runs it; the default "best" also runs a second start.
        ours = time_call(lambda: weight_matching(spec, sa, sb, seed=args.seed, init="identity"), args.repeat)
        t_ours, best, res = ours.median, ours.best, ours.result
        row = Row(
            name=name,
            params=sum(p.numel() for p in model_a.parameters()),
            groups=len(spec.sizes),
            ours_s=t_ours,
            ours_best=best,
            ours_sweeps=res.sweeps,
            ours_obj=matching_objective(spec, sa, sb, res.perms),
        )
        if not args.no_reference:
            # The reference's runs last seconds, where one-time costs do not show: no warm-up.
            ref = time_call(
                lambda: reference_weight_matching(spec, sa, sb, seed=args.seed), args.reference_repeat, warmup=False
            )
            t_ref, (perm_ref, sweeps_ref) = ref.median, ref.result
            row.ref_s, row.ref_sweeps = t_ref, sweeps_ref
            row.ref_obj = matching_objective(spec, sa, sb, perm_ref)
            row.same_perms = all(torch.equal(perm_ref[g], res.perms[g]) for g in spec.sizes)
            if row.ours_obj < row.ref_obj - 1e-6 * abs(row.ref_obj):
                failures.append(f"{name}: objective {row.ours_obj:.9g} below the reference's {row.ref_obj:.9g}")
        rows.append(row)
        _print_row(row)
    _print_table(rows)
    if args.plot:
        _plot(rows, args.plot)
        print(f"plot saved to {args.plot}")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


def _print_row(row: Row) -> None:
    msg = f"  {row.name}: pyperm {row.ours_s:.3f} s, best {row.ours_best:.3f} s ({row.ours_sweeps} sweeps)"
    if row.ref_s is not None:
        msg += f", reference {row.ref_s:.3f} s ({row.ref_sweeps} sweeps)"
    print(msg, flush=True)


def _print_table(rows: list[Row]) -> None:
    head = (
        f"{'model':<28}{'params':>11}{'groups':>7}{'sweeps':>9}{'pyperm s':>10}{'best s':>9}{'ref s':>9}{'speedup':>9}"
        f"{'target s':>9}{'met':>5}{'objective (pyperm)':>21}{'objective (ref)':>19}{'same perms':>11}"
    )
    print()
    print(head)
    print("-" * len(head))
    for r in rows:
        sweeps = f"{r.ours_sweeps}" + (f"/{r.ref_sweeps}" if r.ref_sweeps is not None else "")
        ref_s = f"{r.ref_s:9.3f}" if r.ref_s is not None else f"{'-':>9}"
        speed = f"{r.ref_s / r.ours_s:8.1f}x" if r.ref_s is not None else f"{'-':>9}"
        ref_obj = f"{r.ref_obj:19.6f}" if r.ref_obj is not None else f"{'-':>19}"
        same = f"{str(r.same_perms):>11}" if r.same_perms is not None else f"{'-':>11}"
        target = TARGETS[r.name]
        met = "yes" if r.ours_s <= target else "no"
        print(
            f"{DESCRIPTIONS[r.name]:<28}{r.params:>11,}{r.groups:>7}{sweeps:>9}"
            f"{r.ours_s:10.3f}{r.ours_best:9.3f}{ref_s}{speed}"
            f"{target:9.2f}{met:>5}{r.ours_obj:21.6f}{ref_obj}{same}"
        )


def _plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [DESCRIPTIONS[r.name] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.8 + 2.2 * len(rows), 4))
    ax.bar([i - 0.2 for i in x], [r.ours_s for r in rows], width=0.4, label="pyperm")
    if any(r.ref_s is not None for r in rows):
        ax.bar([i + 0.2 for i in x], [r.ref_s or 0 for r in rows], width=0.4, label="reference (scipy LSA)")
    ax.scatter(list(x), [TARGETS[r.name] for r in rows], marker="_", s=600, color="k", label="target", zorder=3)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (median)")
    ax.set_xticks(list(x), labels, rotation=10)
    ax.set_title("weight matching, two independently initialised models")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":  # python -m pyperm.benchmarks.match
    _parser = argparse.ArgumentParser(prog="pyperm bench match", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
