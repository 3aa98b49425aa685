"""How long a reproduction will take on this machine, measured before it starts.

The command line says the expected time before a long run (and says when a machine cannot
run the paper's scale in reasonable time). The estimate times a few training steps of each
model the report trains, at the report's batch size, on the device it will use, with random
inputs of the data's shape, and multiplies by the steps of the plan; a forward pass of
evaluation is counted as a third of a training step. (Small probe batches mislead: on a CPU
a step of 32 samples costs several times more per sample than one of 500.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["REASONABLE_SECONDS", "describe_seconds", "forward_seconds", "step_seconds"]

# Longer than this, the command says the machine cannot run the setting in reasonable time.
REASONABLE_SECONDS = 2 * 3600
_SLOW_STEP = 1.0  # a probed step longer than this is timed once more only (a big model on a CPU)


_PROBED: dict[tuple, float] = {}  # (name, input shape, batch, device) -> seconds per sample


def _probe(name: str, input_shape: tuple[int, ...], batch: int, device: str, build: Callable[[], Any] | None) -> float:
    """Seconds per sample of one training step of model ``name`` (``build()``, or the registry's) on ``batch`` samples.

    The fastest of a few steps: the first pays for allocation and warm-up."""
    key = (name, input_shape, batch, device)
    if key not in _PROBED:
        _PROBED[key] = _time_steps(name, input_shape, batch, device, build)
    return _PROBED[key]


def _time_steps(name: str, input_shape: tuple[int, ...], batch: int, device: str,
                build: Callable[[], Any] | None) -> float:
    import torch

    from pyperm.nn.models import create_model

    model = (build() if build is not None else create_model(name)).to(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand((batch, *input_shape), generator=gen).to(device)
    with torch.no_grad():
        classes = model(x[:1]).shape[-1]
    y = torch.randint(0, classes, (batch,), generator=gen).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    times: list[float] = []
    while len(times) < 4 and not (len(times) >= 2 and min(times) > _SLOW_STEP):
        start = time.perf_counter()
        torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) / batch


def step_seconds(name: str, input_shape: tuple[int, ...], batch: int, device: Any,
                 build: Callable[[], Any] | None = None) -> float:
    """Seconds of one training step of ``name`` on a batch of ``batch`` samples (probed once per model and batch).

    ``build`` makes the model when ``name`` is not a registry name."""
    return batch * _probe(name, tuple(input_shape), batch, str(device), build)


def forward_seconds(name: str, input_shape: tuple[int, ...], samples: int, device: Any, batch: int = 500,
                    build: Callable[[], Any] | None = None) -> float:
    """Seconds to evaluate ``samples`` inputs (a forward pass is about a third of a training step)."""
    return samples * _probe(name, tuple(input_shape), batch, str(device), build) / 3


def describe_seconds(seconds: float) -> str:
    """``"about 25 min"``, ``"about 3.5 h"``, ``"about 40 s"``."""
    if seconds < 90:
        return f"about {seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"about {seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"about {seconds / 3600:.1f} h"
    return f"about {seconds / 86400:.1f} days"
