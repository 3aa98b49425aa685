"""``pyperm bench ste``: a step of STE matching against its floor and against re-matching from scratch.

An STE step (Git Re-Basin Algorithm 2) must project the free weights onto the
permutations of B, which needs every group's similarity rebuilt from the changed
weights, and run the model forward and backward at the midpoint. So its floor is one
plain training step of the model plus one sweep of similarity products. For each model,
on the same batches in one run:

- ``plain``: a training step (forward, backward, Adam) of the model alone;
- ``sweep``: one sweep of similarity products (every group's similarity computed once);
- ``ste``: a step of :func:`pyperm.nn.ste_matching` (the time of a run over ``k`` batches
  minus a run over one batch, divided by ``k - 1``, so the starting weight matching is
  not counted);
- ``scratch``: a plain step plus pyperm's weight matching from scratch on the free
  weights: how the published implementation projects at every step, with pyperm's solver;
- ``published``: a plain step plus :func:`pyperm.testing.reference_weight_matching`, a
  plain Algorithm 1 as the published implementation runs it.

Ratios: ``ste / floor`` (target at most 1.5), ``scratch / ste`` and ``published / ste``
(target at least 5). ``scratch / ste`` cannot exceed ``scratch / floor``: a projection
needs every similarity rebuilt (the free weights all move at every step), and a weight
matching from scratch costs only a few sweeps' products.
Models: the digits MLP 64-512-512-512-10 at batch 64 (real digits data, endpoints
trained for two epochs), and ResNet20 x4 on random 32x32 images at batch 64
(untrained endpoints: the timing does not depend on the data).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pyperm.benchmarks._report import format_table, time_call

MODELS = ("digits-mlp512", "resnet20x4")
TARGET_FLOOR_RATIO = 1.5
TARGET_SCRATCH_RATIO = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=8, help="STE steps per timed run (at least 2)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each contender (median reported)")
    parser.add_argument("--batch-size", type=int, default=64)


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    return time_call(fn, repeat, warmup=False).median


def _setup(name: str, batch_size: int, steps: int):
    """The model, two endpoint state dicts and ``steps`` batches."""
    import torch
    import torch.nn.functional as F

    from pyperm.nn.models import MLP, ResNet20

    g = torch.Generator().manual_seed(0)
    if name == "digits-mlp512":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x / 16.0, dtype=torch.float32)
        y = torch.tensor(y, dtype=torch.int64)
        states = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            model = MLP([64, 512, 512, 512, 10])
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            for _ in range(2):
                for i in range(0, len(x), batch_size):
                    opt.zero_grad()
                    F.cross_entropy(model(x[i : i + batch_size]), y[i : i + batch_size]).backward()
                    opt.step()
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        order = torch.randperm(len(x), generator=g)[: steps * batch_size]
        batches = [(x[order[i : i + batch_size]], y[order[i : i + batch_size]]) for i in range(0, len(order), batch_size)]
    elif name == "resnet20x4":
        states = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            model = ResNet20(width_multiplier=4)
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        batches = [
            (torch.randn(batch_size, 3, 32, 32, generator=g), torch.randint(10, (batch_size,), generator=g))
            for _ in range(steps)
        ]
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    return model, states[0], states[1], batches


def _plain_steps(model, state, batches) -> Callable[[], None]:
    import copy

    import torch
    import torch.nn.functional as F

    def run() -> None:
        m = copy.deepcopy(model)
        m.load_state_dict(state)
        m.train()
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            opt.step()

    return run


def _one_sweep(spec, sa, sb) -> Callable[[], None]:
    """Every group's similarity computed once (the products alone, arranged beforehand)."""
    import torch

    from pyperm.nn.align._similarity import GroupSimilarity, Term

    perms = {g: torch.arange(n) for g, n in spec.sizes.items()}
    groups = []
    for g, n in spec.sizes.items():
        terms = [Term(axis, spec.axes[key], sa[key], sb[key], {}) for key, axis in spec.group_axes[g]]
        groups.append(GroupSimilarity(g, n, terms, torch.float32, torch.device("cpu")))

    def run() -> None:
        for group in groups:
            group.built = False
            for t in group.terms:
                t.value = None  # recomputed whole, as after a move of most units
            group.negated_similarity(perms)

    return run


def run(args: argparse.Namespace) -> int:
    from pyperm.nn import ste_matching, weight_matching
    from pyperm.testing import reference_weight_matching

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or args.steps < 2 or args.repeat < 1:
        print(f"choose models from {','.join(MODELS)}; --steps >= 2 and --repeat >= 1")
        return 2
    rows = []
    failed = False
    for name in names:
        model, sa, sb, batches = _setup(name, args.batch_size, args.steps)
        spec = model.permutation_spec()
        k = len(batches)
        plain = _median_time(_plain_steps(model, sa, batches), args.repeat) / k
        sweep = _median_time(_one_sweep(spec, sa, sb), args.repeat)
        ste_k = _median_time(lambda: ste_matching(model, spec, sa, sb, batches), args.repeat)
        ste_1 = _median_time(lambda: ste_matching(model, spec, sa, sb, batches[:1]), args.repeat)
        ste = (ste_k - ste_1) / (k - 1)
        scratch = plain + _median_time(lambda: weight_matching(spec, sa, sb, init="identity"), args.repeat)
        published = plain + _median_time(lambda: reference_weight_matching(spec, sa, sb), 1)
        floor = plain + sweep
        rows.append([
            name, plain * 1e3, sweep * 1e3, floor * 1e3, ste * 1e3, scratch * 1e3, published * 1e3,
            ste / floor, scratch / ste, published / ste,
        ])
        failed |= ste / floor > TARGET_FLOOR_RATIO or published / ste < TARGET_SCRATCH_RATIO
    headers = [
        "model", "plain ms", "sweep ms", "floor ms", "ste ms", "scratch ms", "published ms",
        "ste/floor", "scratch/ste", "published/ste",
    ]
    print(format_table(headers, rows))
    print(
        f"targets: ste/floor <= {TARGET_FLOOR_RATIO}, published/ste >= {TARGET_SCRATCH_RATIO} "
        "(medians of --repeat runs; the reference runs once)"
    )
    return 1 if failed else 0
