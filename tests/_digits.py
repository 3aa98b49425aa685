"""Small MLPs and CNNs trained on scikit-learn's digits, shared by the nn tests.

The digits data ships with scikit-learn (no download). Training is seeded and runs on
the CPU in about a second per model; the tests cache the trained states per session.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

TRAIN = 1400  # of the 1797 images; the rest are the test split


def _load() -> tuple[np.ndarray, np.ndarray]:
    """The digits images (1797, 64) and labels, as ``sklearn.datasets.load_digits`` returns them.

    The CSV that scikit-learn ships is read directly: importing ``sklearn.datasets`` takes
    several seconds on a loaded 2-core machine, reading the file 0.1 s.
    """
    spec = importlib.util.find_spec("sklearn")
    path = (
        None
        if spec is None or spec.origin is None
        else Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    )
    if path is None or not path.exists():
        from sklearn.datasets import load_digits

        data = load_digits()
        return data.data, data.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


@functools.lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: 8x8 images as 64 features scaled to [0, 1], a fixed shuffle."""
    images, labels = _load()
    order = np.random.default_rng(0).permutation(len(labels))
    x = torch.from_numpy(images[order] / 16.0).float()
    y = torch.from_numpy(labels[order]).long()
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


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
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                bound = 1.0 / m.weight[0].numel() ** 0.5  # 1 / sqrt(fan_in), torch's default range
                m.weight.uniform_(-bound, bound, generator=gen)
                m.bias.uniform_(-bound, bound, generator=gen)
    # Plain SGD with heavy-ball momentum written out: torch.optim's first use imports torch._dynamo,
    # which costs seconds on a loaded 2-core machine.
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


@contextlib.contextmanager
def one_thread():
    """Run the block on one torch thread: on a loaded 2-core machine, two spinning OpenMP
    threads make these tiny matrix products 10-20 times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
