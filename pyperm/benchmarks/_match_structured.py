"""``pyperm bench match --structured``: one pair of models matched with its flat and its structured spec.

A structured spec permutes units a flat one leaves in place (AlexNet's and VGG's flattened
classifier input: 256 channels over 6 x 6, 512 over 7 x 7), so it adds groups and their
similarity products. Each row gives those products for one sweep in which every similarity is
computed whole: a term of group ``g`` on a tensor of ``N`` entries costs ``2 n_g N`` flops. The
ratio of the two specs' flops is what the structured spec should cost beyond the flat one in the
first sweep. Later sweeps correct only the units that moved (k moved units of a neighbour cost
``2 n_g K k`` for a term of ``K`` entries per unit): ``run Gflop`` adds them up from the
permutations after each sweep, so the time ratio can be read against the flops the run needed.
ResNet20 x16 and MLP-512 with every axis written as ``Tiled(g)`` have the same groups in both
specs: there the structured spec must cost what the flat one does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyperm.benchmarks._report import time_calls


@dataclass(frozen=True)
class StructuredCase:
    """A model matched with both specs: what the table calls it and how its specs are made."""

    description: str
    specs: Callable[[Any, Any], tuple[Any, Any]]  # (model A, example input) -> (flat spec, structured spec)
    model: str  # a torchvision model of match.LIBRARY_INPUTS, or a bundled one of match.CASES


def _traced(model: Any, x: Any) -> tuple[Any, Any]:
    from pyperm.nn import PermutationSpec

    return (PermutationSpec.from_model(model, x, composite="fix", structured=False),
            PermutationSpec.from_model(model, x, composite="fix"))  # fmt: skip


def _in_forms(model: Any, _: Any) -> tuple[Any, Any]:
    """The bundled spec, and the same spec with every group named through ``Tiled(g)`` (the same groups)."""
    from pyperm.nn import PermutationSpec
    from pyperm.nn.spec import Tiled

    flat = model.permutation_spec()
    axes = {k: tuple(Tiled(e) if isinstance(e, str) else e for e in entries) for k, entries in flat.axes.items()}
    return flat, PermutationSpec(axes, flat.sizes)


CASES = {
    "alexnet": StructuredCase("AlexNet (torchvision)", _traced, "alexnet"),
    "vgg11_bn": StructuredCase("VGG11-BN (torchvision)", _traced, "vgg11_bn"),
    "resnet20x16-tiled": StructuredCase("ResNet20 x16, every axis Tiled(g)", _in_forms, "resnet20x16"),
    "mlp512-tiled": StructuredCase("MLP 784-512-512-512-10, every axis Tiled(g)", _in_forms, "mlp512"),
}
HEADERS = ["model", "spec", "groups", "units", "sweeps", "seconds", "best s", "s / sweep", "objective",
           "first sweep Gflop", "run Gflop", "vs flat: time", "per sweep", "first sweep flops", "run flops"]  # fmt: skip


def _pieces(spec: Any, state: Any) -> list[Any]:
    from pyperm.nn.align._pieces import lower

    keys = [k for k in spec.axes if state[k].is_floating_point()]
    return lower(spec, {k: tuple(state[k].shape) for k in keys}, keys)


def sweep_flops(spec: Any, state: Any) -> float:
    """Flops of one sweep in which every group's similarity is computed whole (the first one)."""
    total = 0
    for p in _pieces(spec, state):
        size = math.prod(p.shape)
        total += sum(2 * n * size for n, label in zip(p.shape, p.labels) if label is not None)
    return float(total)


def run_flops(spec: Any, state: Any, history: list[dict]) -> float:
    """Flops of the similarity products a run needed, estimated from the permutations after each sweep
    (``history``): every similarity whole in the first sweep; then, per sweep, each (tensor piece, axis)
    term corrected for the units of its other axis that moved in the sweep before (2 n K k flops for
    k moved units; recomputed whole when more than half moved, or when it has several other axes)."""
    from pyperm.nn.align._pieces import blocks_index

    pieces = _pieces(spec, state)
    total = sweep_flops(spec, state)

    def index(label: Any, perms: dict) -> Any:
        return perms[label] if isinstance(label, str) else blocks_index(label, perms)

    for before, after in zip(history, history[1:]):
        labels = {label for p in pieces for label in p.labels if label is not None}
        moved = {label: int((index(label, before) != index(label, after)).sum()) for label in labels}
        for p in pieces:
            size = math.prod(p.shape)
            for ax, label in enumerate(p.labels):
                others = [(a, o) for a, o in enumerate(p.labels) if o is not None and a != ax]
                if label is None or not others:
                    continue
                whole = 2 * p.shape[ax] * size
                if len(others) > 1:
                    total += whole if any(moved[o] for _, o in others) else 0
                else:
                    (a, o), = others
                    k = moved[o]
                    total += whole if 2 * k > p.shape[a] else whole * k // p.shape[a]
    return float(total)


def pair(name: str, seeds: tuple[int, int]) -> tuple[Any, Any, Any, Any]:
    """Model A, B's state dict, and the flat and structured specs of case ``name``."""
    from pyperm.benchmarks.match import LIBRARY_INPUTS, build_model, library_model

    case = CASES[name]
    if case.model in LIBRARY_INPUTS:
        a, x = library_model(case.model, seeds[0])
        b, _ = library_model(case.model, seeds[1])
    else:
        a, b, x = build_model(case.model, seeds[0]), build_model(case.model, seeds[1]), None
    flat, structured = case.specs(a, x)
    return a, b.state_dict(), flat, structured


def rows(names: list[str], seeds: tuple[int, int], repeat: int, clock: str, seed: int,
         report: Callable[[str], None]) -> list[list[Any]]:  # fmt: skip
    """The table's rows: two per case (flat, structured), the ratios on the structured one."""
    from pyperm.nn import weight_matching

    table = []
    for name in names:
        model, sb, flat, structured = pair(name, seeds)
        sa = model.state_dict()
        specs = {"flat": flat, "structured": structured}
        # Multi-second runs: one-time costs do not show, so no untimed run first.
        timings = time_calls(
            {kind: (lambda s=s: weight_matching(s, sa, sb, init="identity", seed=seed)) for kind, s in specs.items()},
            repeat, clock=clock, warmup=False,
        )  # fmt: skip
        measured = {}
        for kind, spec in specs.items():
            t = timings[kind]
            result = t.result
            history: list[dict] = []  # the permutations after each sweep, for the flops the run needed
            weight_matching(spec, sa, sb, init="identity", seed=seed,
                            callback=lambda _, perms, __: history.append({g: p.clone() for g, p in perms.items()}))
            first, needed = sweep_flops(spec, sa), run_flops(spec, sa, history)
            sweeps = max(1, result.iterations)
            measured[kind] = (t.median, t.median / sweeps, first, needed)
            row = [CASES[name].description, kind, len(spec.sizes), sum(spec.sizes.values()), result.iterations,
                   t.median, t.best, t.median / sweeps, f"{result.objective[-1]:.9g}", first / 1e9,
                   needed / 1e9]  # fmt: skip
            if kind == "structured":
                row += [f"{a / b:.3f}x" for a, b in zip(measured["structured"], measured["flat"])]
            else:
                row += [None] * 4
            table.append(row)
            report(f"  {name} {kind}: {t.median:.3f} s, {result.iterations} sweeps, {first / 1e9:.1f} Gflop in the "
                   f"first sweep, {needed / 1e9:.1f} Gflop in all")  # fmt: skip
    return table
