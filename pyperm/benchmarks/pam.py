"""``pyperm bench pam``: where the time of one PAM outer iteration goes.

One outer iteration of :func:`pyperm.nn.align.proximal.pam` (Tatro et al. appendix E) is
``--perm-steps`` projected SGD steps on the relaxed permutations, the candidate set
(assignment projection and ``--samples`` Birkhoff-von Neumann samples of every block,
judged by the curve's loss) and ``--curve-epochs`` epochs of curve training. PAM records
the seconds of each part; this command runs one outer iteration per model after an
untimed warm-up run (first calls pay one-time costs: torch.optim's imports, allocations)
and prints the split:

- ``relaxed f/b``: forward and backward passes of the relaxed curve (permutation step);
- ``projection``: the alternating projections onto the doubly stochastic matrices;
- ``assignment``: the assignment projections :math:`P_\\Pi(D^*)` (eq. 52);
- ``bvn``: the truncated max-weight BvN decompositions and the sampling (eq. 53-54);
- ``candidates``: forward passes judging the distinct candidates;
- ``curve step``: curve training (forward and backward passes);
- ``other``: the rest (judging the first and the last curve, building curves).

``judged`` is the number of distinct candidates judged and ``spread`` the relaxed mass
off the previous permutation (``PAMIteration.relaxed_spread``).

Target (the PAM issue): assignment plus BvN at most 20% of the iteration; exit status 1
otherwise. Models: a small CNN on scikit-learn's digits (8x8 images; endpoints trained
for a few epochs) and ResNet20 x1 on random 32x32 images (untrained endpoints: the time
of every part depends on the shapes, not on the data).
"""

from __future__ import annotations

import argparse
import logging
import time

from pyperm.benchmarks._report import format_table

MODELS = ("digits-cnn", "resnet20x1")
TARGET_SHARE = 0.20
# Step sizes of the relaxed permutations that move a fair share of the mass off the
# identity in a few steps (with nu_perm = 1e6, a weak proximal pull), so that the BvN
# decompositions and the candidates are not trivial: the loss's gradient in D scales with
# the model's weights.
LR_PERM = {"digits-cnn": 1000.0, "resnet20x1": 10.0}
PARTS = ("relaxed_forward_backward", "projection", "assignment", "bvn_sampling", "candidates", "curve_step", "other")
HEADERS = ("relaxed f/b", "projection", "assignment", "bvn", "candidates", "curve step", "other")

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--batches", type=int, default=8, help="training batches (the data of one epoch)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--perm-steps", type=int, default=8, help="projected SGD steps of the permutation step")
    parser.add_argument("--curve-epochs", type=int, default=1, help="epochs of the curve step")
    parser.add_argument("--samples", type=int, default=32, help="BvN samples (the paper's M = 32)")
    parser.add_argument("--judge-batches", type=int, default=1, help="batches judging each candidate")
    parser.add_argument("--lr-perm", type=float, default=None,
                        help=f"step size of the relaxed permutations (default per model: {LR_PERM})")


def digits_cnn():
    """A small CNN for 8x8 digits: two 3x3 convolutions (32, 64 channels), global average pooling, Linear."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def setup(name: str, batches: int, batch_size: int):
    """``(model, spec, state_a, state_b, data)`` for one benchmark model (seeded, no global RNG)."""
    import torch
    import torch.nn.functional as F

    from pyperm.nn import PermutationSpec
    from pyperm.nn.models import ResNet20

    g = torch.Generator().manual_seed(0)
    if name == "digits-cnn":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
        y = torch.tensor(y, dtype=torch.int64)
        order = torch.randperm(len(y), generator=g)
        x, y = x[order], y[order]
        data = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(y), batch_size)][:batches]
        states = []
        for seed in (1, 2):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                model = digits_cnn()
            params = list(model.parameters())
            for _ in range(3):  # a few epochs of plain SGD: endpoints that classify
                for xb, yb in data:
                    grads = torch.autograd.grad(F.cross_entropy(model(xb), yb), params)
                    with torch.no_grad():
                        for p, gr in zip(params, grads):
                            p.sub_(gr, alpha=0.5)
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        spec = PermutationSpec.from_model(model, x[:2])
    elif name == "resnet20x1":
        states = []
        for seed in (1, 2):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                model = ResNet20(width_multiplier=1)
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        spec = model.permutation_spec()
        data = [(torch.rand(batch_size, 3, 32, 32, generator=g), torch.randint(10, (batch_size,), generator=g))
                for _ in range(batches)]
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    return model, spec, states[0], states[1], data


def measure(name: str, args: argparse.Namespace) -> dict[str, float]:
    """Seconds of each part of one PAM outer iteration on model ``name`` (after a warm-up run)."""
    from pyperm.nn.align.proximal import pam

    model, spec, sa, sb, data = setup(name, args.batches, args.batch_size)
    options = {"outer_iters": 1, "perm_steps": args.perm_steps, "curve_epochs": args.curve_epochs,
               "num_samples": args.samples, "judge_batches": args.judge_batches,
               "lr_perm": LR_PERM[name] if args.lr_perm is None else args.lr_perm, "nu_perm": 1e6, "lr_curve": 0.01}
    pam(model, sa, sb, data[:1], spec, **{**options, "perm_steps": 1, "num_samples": 2, "judge_batches": 1})
    start = time.perf_counter()
    result = pam(model, sa, sb, data, spec, **options)
    total = time.perf_counter() - start
    parts = result.timings
    parts["other"] = total - sum(parts.values())  # judging P^0 and the final curve, building curves
    parts["total"] = total
    parts["candidates_judged"] = float(result.iterations[0].candidates)
    parts["spread"] = result.iterations[0].relaxed_spread
    return parts


def run(args: argparse.Namespace) -> int:
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or min(args.batches, args.batch_size, args.perm_steps, args.judge_batches) < 1 or args.samples < 0:
        print(f"choose models from {','.join(MODELS)}; --batches, --batch-size, --perm-steps, --judge-batches >= 1")
        return 2
    rows = []
    failed = False
    for name in names:
        parts = measure(name, args)
        total = parts["total"]
        share = (parts["assignment"] + parts["bvn_sampling"]) / total
        failed |= share > TARGET_SHARE
        rows.append([name] + [f"{parts[p] * 1e3:.0f} ({100 * parts[p] / total:.1f}%)" for p in PARTS]
                    + [f"{total * 1e3:.0f}", f"{100 * share:.2f}%", int(parts["candidates_judged"]),
                       f"{parts['spread']:.3f}"])
    print(format_table(["model", *(f"{h} ms" for h in HEADERS), "total ms", "lap+bvn", "judged", "spread"], rows))
    print(f"one outer iteration: {args.perm_steps} relaxed steps, {args.samples} BvN samples per block, "
          f"{args.curve_epochs} curve epoch(s) over {args.batches} batches of {args.batch_size}; "
          f"target: assignment + BvN <= {100 * TARGET_SHARE:.0f}% of the iteration")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
