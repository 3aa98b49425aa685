"""``pyperm bench match --starts``: where weight matching starts, and what the default pays for it.

For every model, ``init="identity"`` (Algorithm 1 as published), ``"signatures"`` and the
default ``"best"`` (the copy start when B is an exact permuted copy of A, else the identity
start, then the signature start only when the identity start stalled on a model related to A
by a permutation) are timed on the same pair. The default must never end below the identity
start (objectives computed afresh from the permutations), and cost at most 1.3 times it
(``default took``: the starts it ran).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pyperm.benchmarks._report import time_calls

# name: (what the table calls it, a bundled model of pyperm.benchmarks.match.CASES or a library model)
MODELS = {
    "mlp512": ("MLP 784-512-512-512-10", "bundled"),
    "mlp2048": ("MLP 784-[2048]x4-10", "bundled"),
    "resnet20x16": ("ResNet20 x16 (shortcut B)", "bundled"),
    "vgg16": ("VGG16-BN (CIFAR)", "bundled"),
    "mobilenet_v2": ("MobileNetV2 (torchvision)", "library"),
    "vit_tiny": ("ViT-Tiny/16 (timm)", "library"),
}
STARTS = ("identity", "signatures", "best")
HEADERS = ["model", "pair", "identity s", "identity objective", "signatures s", "signatures objective",
           "default s", "default objective", "default / identity", "default - identity", "default took"]  # fmt: skip


def pair(name: str, seeds: tuple[int, int], planted: bool) -> tuple[Any, Any, Any]:
    """The spec, A's and B's state dicts: two independent initialisations, or A and a permuted copy."""
    from pyperm.benchmarks.match import build_model, library_model
    from pyperm.nn import PermutationSpec, apply_permutation
    from pyperm.testing import random_permutations

    if MODELS[name][1] == "bundled":
        a = build_model(name, seeds[0])
        spec = a.permutation_spec()
        b = None if planted else build_model(name, seeds[1])
    else:
        a, x = library_model(name, seeds[0])
        spec = PermutationSpec.from_model(a, x, composite="fix", structured=True)
        b = None if planted else library_model(name, seeds[1])[0]
    sa = a.state_dict()
    sb = apply_permutation(spec, random_permutations(spec, seeds[1]), sa) if planted else b.state_dict()
    return spec, sa, sb


def rows(names: list[str], kinds: list[str], seeds: tuple[int, int], repeat: int, clock: str, seed: int,
         report: Callable[[str], None]) -> tuple[list[list[Any]], list[str]]:  # fmt: skip
    """The table's rows, and the failures (a default below the identity start)."""
    from pyperm.nn import matching_objective, weight_matching
    from pyperm.nn.align._starts import optimal_copy, stalled

    table, failures = [], []
    for name in names:
        for kind in kinds:
            spec, sa, sb = pair(name, seeds, kind == "planted")
            timings = time_calls(
                {start: (lambda s=start: weight_matching(spec, sa, sb, init=s, seed=seed)) for start in STARTS},
                repeat, clock=clock,
            )  # fmt: skip
            t = {start: timings[start].median for start in STARTS}
            # Each start's objective computed afresh from its permutations: a run's own record adds up
            # float32 gains, which drift from the exact value by ~1e-8 of it.
            obj = {start: matching_objective(spec, sa, sb, timings[start].result.perms) for start in STARTS}
            keys = [k for k in spec.axes if sa[k].is_floating_point()]
            tried = _what_the_default_took(spec, sa, sb, timings["identity"].result.perms, keys, optimal_copy, stalled)
            table.append([MODELS[name][0], kind, t["identity"], f"{obj['identity']:.9g}", t["signatures"],
                          f"{obj['signatures']:.9g}", t["best"], f"{obj['best']:.9g}",
                          f"{t['best'] / t['identity']:.2f}x", f"{obj['best'] - obj['identity']:.6g}", tried])  # fmt: skip
            if obj["best"] < obj["identity"]:
                failures.append(f"{name} ({kind}): the default ends at {obj['best']:.9g}, below the identity "
                                f"start's {obj['identity']:.9g}")  # fmt: skip
            report(f"  {name} {kind}: identity {t['identity']:.3f} s, signatures {t['signatures']:.3f} s, "
                   f"default {t['best']:.3f} s ({tried})")  # fmt: skip
    return table, failures


def _what_the_default_took(spec: Any, sa: Any, sb: Any, identity_perms: Any, keys: list[str], optimal_copy: Any,
                           stalled: Any) -> str:
    """Which starts ``init="best"`` ran: the copy start alone, the identity start, or both searches."""
    if optimal_copy(spec, sa, sb, keys) is not None:
        return "copy start"
    return "identity + signatures" if stalled(spec, sa, sb, identity_perms, keys) else "identity"
