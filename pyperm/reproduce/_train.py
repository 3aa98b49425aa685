"""Seeded training and evaluation of small classifiers, shared by the reproductions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["evaluate", "init_weights", "train_classifier"]


def init_weights(model: nn.Module, generator: torch.Generator) -> None:
    """Re-initialise Linear and Conv layers from ``generator`` (torch's default scheme, without the global RNG).

    The numbers are drawn on the CPU and copied, so a CPU generator seeds a model on any
    device and the same seed gives the same network on every device.
    """

    def uniform(t: torch.Tensor, bound: float) -> None:
        t.copy_(torch.empty(t.shape, dtype=t.dtype).uniform_(-bound, bound, generator=generator))

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                bound = 1.0 / m.weight[0].numel() ** 0.5
                uniform(m.weight, bound)
                if m.bias is not None:
                    uniform(m.bias, bound)


def train_classifier(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    seed: int,
    epochs: int,
    batch_size: int = 64,
    lr: float = 0.05,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    perturb: Callable[[nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Train ``model`` in place by SGD with momentum and a cosine-decayed step from a seeded initialisation.

    ``perturb(model, inputs, targets, step)``, when given, replaces each batch's inputs
    before the step (adversarial training passes a PGD attack).

    The update is written out rather than taken from ``torch.optim``: the first use of
    ``torch.optim`` imports ``torch._dynamo``, which costs seconds on a loaded 2-core machine,
    a good part of a ``--smoke`` run's budget.

    Returns
    -------
    dict of str to torch.Tensor
        A copy of the trained state dict.
    """
    gen = torch.Generator().manual_seed(seed)
    init_weights(model, gen)
    params = [p for p in model.parameters() if p.requires_grad]
    velocity = [torch.zeros_like(p) for p in params]
    steps_per_epoch = (len(y) + batch_size - 1) // batch_size
    total = max(1, epochs * steps_per_epoch)
    step = 0
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen).to(x.device)  # drawn on the CPU: the same order on every device
        for i in range(0, len(y), batch_size):
            idx = order[i : i + batch_size]
            inputs = x[idx] if perturb is None else perturb(model, x[idx], y[idx], step)
            loss = nn.functional.cross_entropy(model(inputs), y[idx])
            grads = torch.autograd.grad(loss, params)
            rate = lr * 0.5 * (1.0 + torch.cos(torch.tensor(torch.pi * step / total)).item())
            with torch.no_grad():
                for p, v, g in zip(params, velocity, grads):
                    if weight_decay:
                        g = g.add(p, alpha=weight_decay)
                    v.mul_(momentum).add_(g)
                    p.sub_(v, alpha=rate)
            step += 1
    model.eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def evaluate(model: nn.Module, batches: Any) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` (eval mode) over ``(inputs, targets)`` batches."""
    from pyperm.nn._runtime import mean_loss_and_accuracy, module_device

    model.eval()
    with torch.no_grad():
        loss, accuracy, _ = mean_loss_and_accuracy(model, batches, nn.functional.cross_entropy, module_device(model))
    return loss, accuracy


def digits_data(device: Any, eval_batch: int, **train_batches: int) -> dict[str, Any]:
    """The digits split (``pyperm.datasets.load_digits(0)``) on ``device``.

    Returns the whole training tensors (``x_train``, ``y_train``), the test split in batches of
    ``eval_batch`` (``test``), the split sizes (``num_train``, ``num_test``), and the training
    split in batches of each named size of ``train_batches`` (``train=64`` gives ``"train"``).
    """
    from pyperm.datasets import load_digits, to_batches

    ds = load_digits(0)
    data = {
        "x_train": torch.from_numpy(ds.x_train).to(device),
        "y_train": torch.from_numpy(ds.y_train).to(device),
        "test": to_batches(ds.x_test, ds.y_test, eval_batch, device=device),
        "num_train": len(ds.y_train),
        "num_test": len(ds.y_test),
    }
    for name, size in train_batches.items():
        data[name] = to_batches(ds.x_train, ds.y_train, size, device=device)
    return data
