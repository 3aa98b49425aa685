"""Small MLPs and CNNs trained on scikit-learn's digits, shared by the nn tests.

The digits data ships with scikit-learn (no download). Training is seeded and runs on
the CPU in about a second per model; the tests cache the trained states per session.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pyperm.datasets import load_digits
from pyperm.nn._training import train_classifier
from pyperm.testing import one_thread


@functools.lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: 8x8 images as 64 features scaled to [0, 1], a fixed shuffle
    (:func:`pyperm.datasets.load_digits` with seed 0, flattened)."""
    ds = load_digits(0)
    flat = [torch.from_numpy(x.reshape(len(x), -1)) for x in (ds.x_train, ds.x_test)]
    return flat[0], torch.from_numpy(ds.y_train), flat[1], torch.from_numpy(ds.y_test)


def batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive ``(inputs, targets)`` batches of ``size`` samples (the last one shorter)."""
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(y), size)]


def mlp(width: int = 128, depth: int = 2, batchnorm: bool = False) -> nn.Sequential:
    """64 -> ``depth`` hidden ReLU layers of ``width`` units (each with a BatchNorm1d if asked) -> 10."""
    layers: list[nn.Module] = []
    fan_in = 64
    for _ in range(depth):
        layers.append(nn.Linear(fan_in, width))
        if batchnorm:
            layers.append(nn.BatchNorm1d(width))
        layers.append(nn.ReLU())
        fan_in = width
    layers.append(nn.Linear(fan_in, 10))
    return nn.Sequential(*layers)


def cnn(channels: int = 8) -> nn.Sequential:
    """A small CNN on 1x8x8 images with BatchNorm: conv-BN-ReLU x2, global average pooling, Linear."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, 10),
    )


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Eval-mode accuracy (the model's flag is put back)."""
    flag = model.training
    model.eval()
    try:
        return float((model(x).argmax(1) == y).float().mean())
    finally:
        model.train(flag)


def train(
    model: nn.Module, seed: int, epochs: int = 20, batch_size: int = 64, lr: float = 0.05
) -> dict[str, torch.Tensor]:
    """Train ``model`` in place by SGD with momentum from a ``seed``-ed initialisation; returns a copy of its state."""
    x, y, _, _ = digits()
    return train_classifier(model, (x, y), batch_size=batch_size, epochs=epochs, lr=lr, seed=seed, optimizer="sgd")


@functools.cache
def trained_pair(width: int = 64, depth: int = 2, epochs: int = 10, batchnorm: bool = False):
    """``(model, state_a, state_b, state_b_matched)``: two MLPs trained from seeds 1 and 2, and B
    permuted into A's basin by weight matching. Cached for the session; callers must not modify them."""
    from pyperm.nn import PermutationSpec, apply_permutation, weight_matching

    model = mlp(width, depth, batchnorm)
    with one_thread():
        state_a = train(model, seed=1, epochs=epochs)
        state_b = train(model, seed=2, epochs=epochs)
        spec = PermutationSpec.from_model(model, digits()[0][:2])
        perms = weight_matching(spec, state_a, state_b).perms
        matched = apply_permutation(spec, perms, state_b)
    return model, state_a, state_b, matched
