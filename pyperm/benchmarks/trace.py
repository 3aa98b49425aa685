"""``pyperm bench trace``: tracing real torchvision and timm models, against their targets.

Builds each model at random initialisation (seeded), traces it flat and with
``structured=True`` (median of ``--repeat`` runs each, one thread), and reports the share of
hidden units each spec permutes, the causes of units left unpermuted, and whether the
structured spec keeps the function (a random permutation of every group, in float64).
Targets (on the 2-core machine): resnet50 traces in under 1 s and densenet121 in under 2 s;
every model of the listed ones (``LISTED``) permutes at least 95% of its hidden units.
Needs torchvision (and timm for ``timm:`` models).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings

from pyperm._tables import text_table
from pyperm.benchmarks._report import time_call
from pyperm._argtypes import int_at_least, positive_int

DEFAULT_MODELS = (
    "resnet18", "resnet50", "vgg11_bn", "densenet121", "mobilenet_v2", "efficientnet_b0", "convnext_tiny",
    "resnext50_32x4d", "regnet_y_400mf", "squeezenet1_0", "alexnet", "shufflenet_v2_x1_0",
    "timm:vit_tiny_patch16_224",
)  # fmt: skip
# Seconds to trace (structured): the targets.
TARGETS = {"resnet50": 1.0, "densenet121": 2.0}
# The listed models: at least this share of hidden units permuted by the structured spec.
SHARE_TARGET = 0.95
LISTED = {"resnet18", "vgg11_bn", "densenet121", "mobilenet_v2", "efficientnet_b0", "convnext_tiny",
          "timm:vit_tiny_patch16_224"}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated torchvision model names, or timm:<name> (default: the listed and more)")
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="timed traces per model and mode (median reported)")
    parser.add_argument("--size", type=positive_int, default=64, help="input height and width of the CNNs (default 64)")
    parser.add_argument("--seed", type=int_at_least(0), default=0)


def build(name: str, size: int, seed: int):
    """The model at random initialisation, its output layer marked, and an input batch of 2."""
    import torch
    from torch import nn

    from pyperm.testing import import_torchvision

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name.startswith("timm:"):
            import_torchvision()
            import timm

            model = timm.create_model(name[5:], pretrained=False)
            cfg = model.pretrained_cfg.get("input_size", (3, 224, 224))
            x = torch.randn(2, *cfg)
        else:
            tv = import_torchvision()
            if name not in tv.models.list_models():
                raise ValueError(f"unknown torchvision model {name!r}")
            model = tv.models.get_model(name, weights=None)
            x = torch.randn(2, 3, size, size)
    last = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))][-1]
    last.is_head = True  # produces the model's output: not a hidden unit
    return model.eval(), x


def same_function(model, spec, x, seed: int) -> bool:
    """Whether a random permutation of every group leaves the outputs unchanged (float64)."""
    import torch

    from pyperm.nn import apply_permutation
    from pyperm.testing import random_permutations

    a = copy.deepcopy(model).double()
    b = copy.deepcopy(a)
    b.load_state_dict(apply_permutation(spec, random_permutations(spec, torch.Generator().manual_seed(seed)),
                                        a.state_dict()))  # fmt: skip
    with torch.no_grad():
        return bool(torch.allclose(a(x.double()), b(x.double()), rtol=1e-9, atol=1e-9))


def run(args: argparse.Namespace) -> int:
    import torch

    from pyperm.nn import trace_model
    from pyperm.testing import permutable_share

    torch.set_num_threads(1)  # the command owns its process; library calls never do this
    rows, failures = [], []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        try:
            model, x = build(name, args.size, args.seed)
        except ModuleNotFoundError as exc:
            print(f"{name}: skipped ({exc})", file=sys.stderr)
            continue
        except (ValueError, RuntimeError) as exc:  # an unknown name (timm raises RuntimeError for one)
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
        cells = [name, f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"]
        for structured in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the causes are counted below
                timing = time_call(lambda s=structured: trace_model(model, x, composite="fix", structured=s),
                                   args.repeat)  # fmt: skip
            result = timing.result
            share = permutable_share(model, result.spec)
            cells += [f"{share:.1%}", len(result.composites), f"{timing.median:.2f}"]
        kept = same_function(model, result.spec, x, args.seed)
        target = TARGETS.get(name)
        cells += ["yes" if kept else "NO", f"{timing.median / target:.2f}" if target else ""]
        rows.append(cells)
        if not kept:
            failures.append(f"{name}: the structured spec changes the function")
        if target and timing.median > target:
            failures.append(f"{name}: traced in {timing.median:.2f} s, over the {target:g} s target")
        if name in LISTED and share < SHARE_TARGET:
            failures.append(f"{name}: {share:.1%} of hidden units permutable, under {SHARE_TARGET:.0%}")
        print(f"{name} done", file=sys.stderr, flush=True)
    headers = ["model", "params", "flat", "causes", "s", "structured", "causes", "s", "function kept",
               "time/target"]  # fmt: skip
    print(f"torch {torch.__version__}, one thread, median of {args.repeat}; shares of hidden units permuted")
    print(text_table(headers, rows))
    for line in failures:
        print(f"FAILED: {line}")
    return 1 if failures else 0
