"""Digits data and small trained models for the PAM and robustness tests.

scikit-learn's digits ship with it (no download): 1797 8x8 images, scaled here to
[0, 1]. Training is seeded plain SGD with momentum written out (torch.optim's first use
imports torch._dynamo, seconds on a loaded 2-core machine); a model takes about a second.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

TRAIN = 1400  # of the 1797 images; the rest are the test split


@functools.lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: (n, 64) floats in [0, 1], int64 labels, a fixed shuffle."""
    spec = importlib.util.find_spec("sklearn")
    path = None if spec is None or spec.origin is None else Path(spec.origin).parent / "datasets/data/digits.csv.gz"
    if path is not None and path.exists():  # the file load_digits reads, without importing sklearn.datasets
        table = np.loadtxt(path, delimiter=",")
        images, labels = table[:, :-1], table[:, -1].astype(np.int64)
    else:
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(labels))
    x = torch.from_numpy(images[order] / 16.0).float()
    y = torch.from_numpy(labels[order]).long()
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive ``(inputs, targets)`` batches of ``size`` samples."""
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(y), size)]


def mlp(width: int = 32) -> nn.Sequential:
    """64 -> width -> width -> 10 with ReLUs."""
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def cnn(channels: int = 8) -> nn.Sequential:
    """A small CNN on 1x8x8 images with BatchNorm: conv-BN-ReLU x2, global average pooling, Linear."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, 10),
    )


def train(model: nn.Module, seed: int, epochs: int = 10, batch_size: int = 64, lr: float = 0.05) -> dict:
    """Train ``model`` in place from a ``seed``-ed initialisation; returns a copy of its state (model left in eval)."""
    x, y, _, _ = digits()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                bound = 1.0 / (m.weight[0].numel() ** 0.5)
                m.weight.uniform_(-bound, bound, generator=gen)
                m.bias.uniform_(-bound, bound, generator=gen)
    params = [p for p in model.parameters() if p.requires_grad]
    velocity = [torch.zeros_like(p) for p in params]
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), batch_size):
            idx = order[i : i + batch_size]
            grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[idx]), y[idx]), params)
            with torch.no_grad():
                for p, v, g in zip(params, velocity, grads):
                    v.mul_(0.9).add_(g)
                    p.sub_(v, alpha=lr)
    model.eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Eval-mode accuracy (the model's flag is put back)."""
    flag = model.training
    model.eval()
    try:
        return float((model(x).argmax(1) == y).float().mean())
    finally:
        model.train(flag)
