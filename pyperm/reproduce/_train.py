"""What the reproductions share around training: the endpoints' recipe, evaluation, the digits data.

The training loop itself is :func:`pyperm.nn._training.train_classifier`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SGD_COSINE", "digits_data", "evaluate", "loaded_copy"]

# How every reproduction trains its endpoints (train_classifier's options): SGD with
# momentum 0.9, the step 0.05 decayed to zero along a cosine.
SGD_COSINE = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "schedule": "cosine"}


def loaded_copy(model: nn.Module, state: Any) -> nn.Module:
    """A copy of ``model`` holding ``state`` (the model itself is left as it is)."""
    import copy

    other = copy.deepcopy(model)
    other.load_state_dict(state)
    return other


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
