"""``pyperm bench ste``: a step of STE matching against its floor and against re-matching from scratch.

An STE step (Git Re-Basin Algorithm 2) must project the free weights onto the
permutations of B, which needs every group's similarity rebuilt from the changed
weights, and run the model forward and backward at the midpoint. So its floor is one
plain training step of the model plus one sweep of similarity products. For each model,
on the same batches in one run:

- ``plain``: a training step (forward, backward, Adam) of the model alone;
- ``sweep``: one sweep of similarity products (every group's similarity computed once);
- ``ste``: a step of :func:`pyperm.nn.ste_matching` with its defaults (the time of a run
  over ``k`` batches minus a run over one batch, divided by ``k - 1``, so the starting
  weight matching and the judging of the start and of the last permutations are not
  counted). ``k - 1`` is a multiple of ``judge_every`` (by default ``k = 1 +
  judge_every``) and both runs judge on the same batches (the default number of the
  ``k`` training batches), so the periodic judging of the candidates (a forward pass
  over the judging batches) is counted at its rate per step, and so are the judged
  steps' projections run to convergence (the others are one sweep): in these runs the
  permutations change at every step, the costliest case;
- ``scratch``: a plain step plus pyperm's weight matching from scratch on the free
  weights: how the published implementation projects at every step, with pyperm's solver;
- ``published``: a plain step plus :func:`pyperm.testing.reference_weight_matching`, a
  plain Algorithm 1 as the published implementation runs it.

Ratios: ``ste / floor`` (target at most 1.3), ``scratch / ste`` and ``published / ste``
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

from pyperm._tables import text_table
from pyperm.benchmarks._report import time_call, time_calls
from pyperm._argtypes import choices_list, int_at_least, positive_int

MODELS = ("digits-mlp512", "resnet20x4")
TARGET_FLOOR_RATIO = 1.3
TARGET_SCRATCH_RATIO = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=choices_list(MODELS), default=list(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)}")
    # The default is resolved in run(): reading ste_matching's signature here would import torch
    # whenever the command line builds its parser.
    parser.add_argument("--steps", type=int_at_least(2), default=None,
                        help="STE steps per timed run (at least 2; default 1 + ste_matching's judge_every, so that "
                             "the periodic judging is counted at its rate)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="timed runs of each contender (median reported)")
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or the calling thread's CPU time with torch on one thread (steady on a "
                             "busy machine)")


def _judge_every() -> int:
    """:func:`~pyperm.nn.ste_matching`'s default ``judge_every`` (read from its signature: one source)."""
    import inspect

    from pyperm.nn.align.ste import ste_matching

    return inspect.signature(ste_matching).parameters["judge_every"].default


def _median_time(fn: Callable[[], object], repeat: int, clock: str) -> float:
    return time_call(fn, repeat, warmup=False, clock=clock).median


def _setup(name: str, batch_size: int, steps: int):
    """The model, two endpoint state dicts and ``steps`` batches."""
    import torch

    from pyperm.nn._training import train_classifier
    from pyperm.nn.models import create_model

    g = torch.Generator().manual_seed(0)
    if name == "digits-mlp512":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x / 16.0, dtype=torch.float32)
        y = torch.tensor(y, dtype=torch.int64)
        model = create_model("mlp:64,512,512,512,10")
        epoch = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]
        # Two epochs of Adam: endpoints that classify.
        states = [train_classifier(model, epoch, epochs=2, lr=1e-3, seed=seed) for seed in (1, 2)]
        order = torch.randperm(len(x), generator=g)[: steps * batch_size]
        batches = [(x[order[i : i + batch_size]], y[order[i : i + batch_size]])
                   for i in range(0, len(order), batch_size)]  # fmt: skip
    elif name == "resnet20x4":
        states = []
        for seed in (1, 2):
            with torch.random.fork_rng():  # untrained endpoints: the timing does not depend on the weights
                torch.manual_seed(seed)
                model = create_model("resnet20:4")
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
    """Every group's similarity computed once, whole (the products of one projection, no assignments)."""
    import torch

    from pyperm.nn.align._matcher import WeightMatcher

    perms = {g: torch.arange(n) for g, n in spec.sizes.items()}
    matcher = WeightMatcher(spec, sb)
    groups = matcher._arrange(sa)

    def run() -> None:
        for group in groups.values():
            group.built = False  # recomputed whole, as after a move of most units
            group.negated_similarity(perms, matcher._cache)

    return run


def run(args: argparse.Namespace) -> int:
    from pyperm.nn import ste_matching, weight_matching
    from pyperm.testing import reference_weight_matching

    if args.clock == "cpu":  # the thread's CPU time counts only what runs on it
        import torch

        torch.set_num_threads(1)
    rows = []
    failed = False
    steps = 1 + _judge_every() if args.steps is None else args.steps
    for name in args.models:
        model, sa, sb, batches = _setup(name, args.batch_size, steps)
        spec = model.permutation_spec()
        k = len(batches)
        # Alternated round by round, so that a busy spell of the machine hits the floor's parts and
        # the STE runs alike. Both STE runs judge on the same batches (by default each would judge
        # on its own data's first batches, and the difference would count the start's judging as steps).
        t = time_calls({
            "plain": _plain_steps(model, sa, batches),
            "sweep": _one_sweep(spec, sa, sb),
            "ste_k": lambda: ste_matching(model, spec, sa, sb, batches, judge_data=batches),
            "ste_1": lambda: ste_matching(model, spec, sa, sb, batches[:1], judge_data=batches),
        }, args.repeat, clock=args.clock, warmup=False)  # fmt: skip
        plain, sweep = t["plain"].median / k, t["sweep"].median
        ste = (t["ste_k"].median - t["ste_1"].median) / (k - 1)
        scratch = plain + _median_time(lambda: weight_matching(spec, sa, sb, init="identity"), args.repeat, args.clock)
        published = plain + _median_time(lambda: reference_weight_matching(spec, sa, sb), 1, args.clock)
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
    print(text_table(headers, rows))
    print(
        f"targets: ste/floor <= {TARGET_FLOOR_RATIO}, published/ste >= {TARGET_SCRATCH_RATIO} "
        "(medians of --repeat runs; the reference runs once)"
    )
    return 1 if failed else 0
