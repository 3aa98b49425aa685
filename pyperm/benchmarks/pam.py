"""``pyperm bench pam``: where the time of PAM goes, and what its permutation step finds.

One outer iteration of :func:`pyperm.nn.align.proximal.pam` (Tatro et al. appendix E) is
``--perm-steps`` projected SGD steps on the relaxed permutations, the candidate set
(assignment projection and ``--samples`` Birkhoff-von Neumann samples of every block,
judged by the curve's loss) and ``--curve-epochs`` epochs of curve training. PAM records
the seconds of each part; this command runs ``--iterations`` outer iterations per model
and step size (``--lr-perm``: ``auto``, PAM's default, and any numbers to compare it
with) after an untimed warm-up run (first calls pay one-time costs: torch.optim's
imports, allocations) and prints two tables.

The split of the time:

- ``relaxed f/b``: forward and backward passes of the relaxed curve (permutation step);
- ``projection``: the alternating projections onto the doubly stochastic matrices;
- ``assignment``: the assignment projections :math:`P_\\Pi(D^*)` (eq. 52);
- ``bvn``: the truncated max-weight BvN decompositions and the sampling (eq. 53-54);
- ``candidates``: forward passes judging the distinct candidates;
- ``curve step``: curve training (forward and backward passes);
- ``other``: the rest (judging the first and the last curve, building curves).

What it found: PAM's objective :math:`\\hat Q` (at the start, then after each outer
iteration), the objective after the first permutation step, the units moved and the
candidate taken, the relaxed mass off the previous permutation
(``PAMIteration.relaxed_spread``: near 0, the relaxation did not move), the relaxed steps
undone because they diverged, and the step sizes used (with ``auto``, those scaled to
the gradient).

Target: assignment plus BvN at most 20% of the iteration; exit status 1 otherwise.
Models (``--models``): ``digits-cnn``, a small CNN on scikit-learn's digits (two 3x3
convolutions, no BatchNorm, endpoints after a few plain gradient steps: small weights and
small gradients), and ``resnet20x1``, ResNet20 x1 on random 32x32 images (untrained
endpoints: the time of every part depends on the shapes, not on the data), time the
parts; ``digits-mlp`` (64-128-128-10), ``digits-cnn-bn`` (three 3x3 convolutions of 32,
64 and 64 channels, each with BatchNorm) and ``resnet20x1-digits`` (ResNet20 x1 on the
digits enlarged to 32x32, endpoints trained for three epochs, about a minute on a laptop
CPU) are trained with Adam and show what the permutation step finds.
"""

from __future__ import annotations

import argparse
import logging
import time

from pyperm._argtypes import choices_list, nonnegative_int, positive_float, positive_int
from pyperm._tables import text_table

MODELS = ("digits-cnn", "resnet20x1", "digits-mlp", "digits-cnn-bn", "resnet20x1-digits")
DEFAULT_MODELS = ("digits-cnn", "resnet20x1")
TARGET_SHARE = 0.20
PARTS = ("relaxed_forward_backward", "projection", "assignment", "bvn_sampling", "candidates", "curve_step", "other")
HEADERS = ("relaxed f/b", "projection", "assignment", "bvn", "candidates", "curve step", "other")

logger = logging.getLogger(__name__)


def _lr_list(text: str) -> list[float | str]:
    """``auto`` or positive numbers, comma-separated."""
    out: list[float | str] = []
    for item in text.split(","):
        out.append("auto" if item.strip() == "auto" else positive_float(item))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=choices_list(MODELS), default=list(DEFAULT_MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)} (default {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--batches", type=positive_int, default=8, help="training batches (the data of one epoch)")
    parser.add_argument("--batch-size", type=positive_int, default=128)
    parser.add_argument("--iterations", type=positive_int, default=1, help="PAM's outer iterations (max_iter)")
    parser.add_argument("--perm-steps", type=positive_int, default=8,
                        help="projected SGD steps of the permutation step")
    parser.add_argument("--curve-epochs", type=positive_int, default=1, help="epochs of the curve step")
    parser.add_argument("--samples", type=nonnegative_int, default=32, help="BvN samples (the paper's M = 32)")
    parser.add_argument("--judge-batches", type=positive_int, default=1, help="batches judging each candidate")
    parser.add_argument("--lr-perm", type=_lr_list, default=["auto"],
                        help="step sizes of the relaxed permutations, comma-separated: 'auto' (PAM's default, "
                             "scaled to the gradient) or numbers; one row per model and step size")
    parser.add_argument("--nu-perm", type=positive_float, default=1e3, help="the proximal weight nu_P (PAM's default)")


def digits_cnn():
    """A small CNN for 8x8 digits: two 3x3 convolutions (32, 64 channels), global average pooling, Linear."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def digits_cnn_bn():
    """A CNN for 8x8 digits with BatchNorm: three 3x3 convolutions (32, 64, 64 channels), each followed by
    BatchNorm and ReLU, global average pooling, Linear."""
    from torch import nn

    layers: list[nn.Module] = []
    channels = 1
    for out in (32, 64, 64):
        layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def _digits(batches: int, batch_size: int, size: int = 8):
    """Shuffled digits batches (seeded): 1x8x8 images, or ``size`` x ``size`` on three channels."""
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    if size != 8:  # each pixel repeated: the task ResNet20 learns in a few epochs
        k = size // 8
        x = x.repeat_interleave(k, 2).repeat_interleave(k, 3).expand(-1, 3, -1, -1).contiguous()
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(y), batch_size)][:batches]


def setup(name: str, batches: int, batch_size: int):
    """``(model, spec, state_a, state_b, data)`` for one benchmark model (seeded, no global RNG)."""
    import torch

    from pyperm.nn import PermutationSpec
    from pyperm.nn._training import train_classifier
    from pyperm.nn.models import create_model

    if name == "digits-cnn":
        data = _digits(batches, batch_size)
        model = digits_cnn()
        # A few epochs of plain gradient descent: endpoints that classify.
        states = [
            train_classifier(model, data, epochs=3, lr=0.5, seed=seed, optimizer="sgd", momentum=0.0)
            for seed in (1, 2)
        ]
        spec = PermutationSpec.from_model(model, data[0][0][:2])
    elif name in ("digits-mlp", "digits-cnn-bn", "resnet20x1-digits"):
        size, epochs = (32, 3) if name == "resnet20x1-digits" else (8, 20 if name == "digits-mlp" else 10)
        data = _digits(batches, batch_size, size)
        model = {"digits-mlp": lambda: create_model("mlp:64,128,128,10"), "digits-cnn-bn": digits_cnn_bn,
                 "resnet20x1-digits": lambda: create_model("resnet20:1")}[name]()  # fmt: skip
        states = [train_classifier(model, data, epochs=epochs, lr=1e-3, seed=seed) for seed in (1, 2)]
        spec = PermutationSpec.from_model(model, data[0][0][:2])
    elif name == "resnet20x1":
        g = torch.Generator().manual_seed(0)
        states = []
        for seed in (1, 2):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                model = create_model("resnet20:1")
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        spec = model.permutation_spec()
        data = [(torch.rand(batch_size, 3, 32, 32, generator=g), torch.randint(10, (batch_size,), generator=g))
                for _ in range(batches)]
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    return model, spec, states[0], states[1], data


def measure(setup_: tuple, lr_perm: float | str, args: argparse.Namespace) -> tuple[dict[str, float], object]:
    """Seconds of each part of PAM's outer iterations on one model and step size, and PAM's result."""
    import warnings

    from pyperm.nn.align.proximal import pam

    model, spec, sa, sb, data = setup_
    options = {"max_iter": args.iterations, "perm_steps": args.perm_steps, "curve_epochs": args.curve_epochs,
               "perm_samples": args.samples, "judge_batches": args.judge_batches, "lr_perm": lr_perm,
               "nu_perm": args.nu_perm, "lr_curve": 0.01}  # fmt: skip
    start = time.perf_counter()
    with warnings.catch_warnings():
        # A step size to compare may be far off: its warnings are the table's backoffs and spread.
        warnings.simplefilter("ignore", RuntimeWarning)
        result = pam(model, spec, sa, sb, data, **options)
    total = time.perf_counter() - start
    parts = result.timings
    parts["other"] = total - sum(parts.values())  # judging P^0 and the final curve, building curves
    parts["total"] = total
    return parts, result


def _warm_up(setup_: tuple) -> None:
    """One tiny run: the first call pays one-time costs (imports, allocations)."""
    from pyperm.nn.align.proximal import pam

    model, spec, sa, sb, data = setup_
    pam(model, spec, sa, sb, data[:1], max_iter=1, perm_steps=1, curve_epochs=1, perm_samples=2, judge_batches=1)


def _found(name: str, lr_perm: float | str, result) -> list[object]:
    """The row of the second table: what the permutation steps found."""
    first = result.history[0]
    rates = [v for it in result.history for v in it.lr_perm.values()]
    return [
        name, lr_perm, " -> ".join(f"{q:.4f}" for q in result.objective), f"{first.objective_after_perm:.4f}",
        sum(first.moved.values()), first.choice, " ".join(f"{it.relaxed_spread:.3f}" for it in result.history),
        sum(it.backoffs for it in result.history), f"{min(rates):.3g}-{max(rates):.3g}" if rates else "-",
    ]


def run(args: argparse.Namespace) -> int:
    times, found = [], []
    failed = False
    for name in args.models:
        setup_ = setup(name, args.batches, args.batch_size)
        _warm_up(setup_)
        for lr_perm in args.lr_perm:
            parts, result = measure(setup_, lr_perm, args)
            total = parts["total"]
            share = (parts["assignment"] + parts["bvn_sampling"]) / total
            failed |= share > TARGET_SHARE
            times.append([name, lr_perm] + [f"{parts[p] * 1e3:.0f} ({100 * parts[p] / total:.1f}%)" for p in PARTS]
                         + [f"{total * 1e3:.0f}", f"{100 * share:.2f}%",
                            sum(it.candidates for it in result.history)])  # fmt: skip
            found.append(_found(name, lr_perm, result))
    print(text_table(["model", "lr_perm", *(f"{h} ms" for h in HEADERS), "total ms", "lap+bvn", "judged"], times))
    print(f"{args.iterations} outer iteration(s): {args.perm_steps} relaxed steps, {args.samples} BvN samples per "
          f"block, {args.curve_epochs} curve epoch(s) over {args.batches} batches of {args.batch_size}; "
          f"target: assignment + BvN <= {100 * TARGET_SHARE:.0f}% of the time")  # fmt: skip
    print()
    print(text_table(["model", "lr_perm", "objective", "after 1st perm step", "moved", "taken", "spread",
                      "backoffs", "steps used"], found))  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
