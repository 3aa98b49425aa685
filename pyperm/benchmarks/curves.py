"""``pyperm bench curves``: one curve training step against one plain training step of the same model.

For each model and device, on one fixed batch:

- *plain*: ``model(x)``, cross-entropy, backward, an SGD (momentum 0.9) step on the
  model's parameters;
- *curve*: one :meth:`pyperm.nn.curves.CurveTrainer.step` of a quadratic Bezier curve
  (one bend) between two states of that model: draw ``t``, build the point's weights
  from the flat endpoints and bend, run the same model through
  ``torch.func.functional_call``, backward into the bend, an SGD step on the bend.

The two are run alternately so that both see the same machine load; the table gives the
median (and best) milliseconds and their ratio, the curve's overhead. The goal is at most
1.3. It also gives each step's page faults: torch frees a step's activations and glibc
returns the top of its heap to the system when enough of it is free, so the next step faults
those pages in again. Which of two alternating steps pays for it depends on the order of
their allocations, not on their work (on the digits CNN, 200-400 faults a step, about 0.3 ms,
moving from one step to the other between runs of the same code); a ratio whose fault counts
differ much measures the heap as well as the step. Before timing, the curve's output at
``t = 0`` is checked against the model loaded with the first endpoint (train mode, same batch).
Models: a small CNN with BatchNorm for the 8x8 digits (``digits-cnn``) and
``ResNet20(width_multiplier=4)`` on 32x32 images (``resnet20x4``). Also runnable as ``python -m pyperm.benchmarks.curves``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pyperm._tables import text_table
from pyperm.benchmarks._report import minor_faults, time_calls
from pyperm._argtypes import int_at_least, positive_int

TARGET_RATIO = 1.3
MODELS = ("digits-cnn", "resnet20x4")
# Batch sizes per device: ResNet20x4 takes about 2 GFLOP per image and step, so the
# CPU batch is small enough for a 2-core machine.
DEFAULT_BATCH = {("digits-cnn", "cpu"): 128, ("digits-cnn", "cuda"): 128,
                 ("resnet20x4", "cpu"): 16, ("resnet20x4", "cuda"): 128}
# Timed steps of each kind: many of the millisecond steps (their medians are noisy on a
# shared machine), a few of the seconds-long ones.
DEFAULT_REPEAT = {"digits-cnn": 41, "resnet20x4": 7}


def build_model(name: str, seed: int):
    """The benchmark model ``name`` and its input shape, initialised from ``seed`` (global RNG untouched)."""
    import torch
    from torch import nn

    from pyperm.nn.models import create_model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name == "digits-cnn":
            model = nn.Sequential(
                nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
            )  # fmt: skip
            return model, (1, 8, 8)
        if name == "resnet20x4":
            return create_model("resnet20:4"), (3, 32, 32)
    raise ValueError(f"unknown model {name!r}; choose from {list(MODELS)}")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, device: str = "cpu", batch: int | None = None, repeat: int | None = None, seed: int = 0,
            clock: str = "wall") -> dict[str, Any]:
    """Median and best seconds of a plain and a curve training step, alternated, and their ratios.

    ``clock="cpu"`` times the calling thread's CPU time instead of the wall clock: with one
    torch thread (``torch.set_num_threads(1)``) on a CPU, it ignores the time the process
    spends descheduled on a busy machine.
    """
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    import torch
    import torch.nn.functional as F

    from pyperm.nn.curves import BezierCurve, CurveTrainer

    dev = torch.device(device)
    batch = batch or DEFAULT_BATCH[(name, dev.type)]
    repeat = repeat or DEFAULT_REPEAT[name]
    model, shape = build_model(name, seed)
    model = model.to(dev).train()
    state_a = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state_b = {k: v.detach().clone() for k, v in build_model(name, seed + 1)[0].to(dev).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, *shape), generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)

    curve = BezierCurve(model, state_a, state_b).train()
    with torch.no_grad():
        check = (curve(x, 0.0) - model(x)).abs().max().item()
        model.load_state_dict(state_a)  # the plain forward above updated the running statistics
    if check > 1e-4:
        raise AssertionError(f"{name}: the curve at t=0 differs from the model by {check:.3g}")
    trainer = CurveTrainer(curve, lr=0.01, momentum=0.9, seed=seed)
    plain_opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def plain_step() -> None:
        plain_opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        plain_opt.step()
        _sync(dev)

    def curve_step() -> None:
        trainer.step((x,), y)
        _sync(dev)

    faults = {"plain": [0, 0], "curve": [0, 0]}  # page faults, calls

    def counted(name: str, step: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            before = minor_faults()
            step()
            if before is not None:
                faults[name][0] += minor_faults() - before
                faults[name][1] += 1
        return call

    # Alternated, after a warm-up call of each (allocators, optimizer state, kernels).
    t = time_calls({"plain": counted("plain", plain_step), "curve": counted("curve", curve_step)}, repeat, clock=clock)
    plain, curve_times = t["plain"].samples, t["curve"].samples
    p, c = t["plain"].median, t["curve"].median
    return {
        "model": name, "device": dev.type, "batch": batch,
        "parameters": sum(q.numel() for q in model.parameters()),
        "repeat": repeat, "plain_ms": 1e3 * p, "curve_ms": 1e3 * c, "ratio": c / p,
        "best_ratio": min(curve_times) / min(plain), "check": check,
        **{f"{k}_faults": n / calls if calls else None for k, (n, calls) in faults.items()},
    }  # fmt: skip


def bench(models: Sequence[str] = MODELS, devices: Sequence[str] | None = None, batch: int | None = None,
          repeat: int | None = None, seed: int = 0, report: Callable[[dict[str, Any]], None] | None = None,
          clock: str = "wall") -> list[dict[str, Any]]:
    """:func:`measure` for every model and device (CPU, and CUDA when available by default)."""
    import torch

    if devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for device in devices:
        for name in models:
            row = measure(name, device, batch, repeat, seed, clock)
            rows.append(row)
            if report is not None:
                report(row)
    return rows


HEADERS = ["model", "device", "batch", "params", "plain ms", "curve ms", "ratio", "(best)", "goal",
           "page faults / step (plain, curve)"]


def table_row(row: dict[str, Any]) -> list[Any]:
    """One row of the table, in the order of :data:`HEADERS`."""
    goal = "ok" if row["ratio"] <= TARGET_RATIO else "over"
    faults = "n/a" if row["plain_faults"] is None else f"{row['plain_faults']:.0f}, {row['curve_faults']:.0f}"
    return [row["model"], row["device"], row["batch"], row["parameters"], row["plain_ms"], row["curve_ms"],
            row["ratio"], row["best_ratio"], goal, faults]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="models to time")
    parser.add_argument("--devices", nargs="+", choices=["cpu", "cuda"], default=None,
                        help="devices (default: cpu, and cuda when available)")
    parser.add_argument("--batch", type=positive_int, default=None,
                        help="batch size (default: 128; ResNet20x4 on the CPU: 16)")
    parser.add_argument("--repeat", type=positive_int, default=None,
                        help="timed steps of each kind, median reported (default: 41 digits-cnn, 7 resnet20x4)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the thread's CPU time (with --threads 1 on a busy CPU machine)")
    parser.add_argument("--quick", action="store_true", help="--repeat 5")


def run(args: argparse.Namespace) -> int:
    import torch

    import pyperm

    if args.devices and "cuda" in args.devices and not torch.cuda.is_available():
        print("no CUDA device: drop --devices cuda", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"pyperm {pyperm.__version__}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"clock {args.clock}  goal: curve step <= {TARGET_RATIO} x plain step")
    print("plain = SGD step of the model; curve = CurveTrainer.step of a 1-bend Bezier curve of the same model "
          "on the same batch;\nmedian ms of alternating runs; ratio = curve / plain; (best) = fastest / fastest",
          flush=True)
    rows = bench(args.models, args.devices, args.batch, 5 if args.quick else args.repeat, args.seed,
                 report=lambda row: print(f"{row['model']} on {row['device']}: ratio {row['ratio']:.2f}",
                                          file=sys.stderr, flush=True),
                 clock=args.clock)
    print(text_table(HEADERS, [table_row(r) for r in rows]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyperm.benchmarks.curves", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
