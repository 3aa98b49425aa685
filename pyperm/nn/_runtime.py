"""Runtime helpers shared by the methods of :mod:`pyperm.nn`: modes, batches, devices.

Every method that runs a model (activation matching, barriers, BatchNorm resets, curves,
REPAIR, PAM) needs the same few things: run in eval or train mode and put every module's
flag back afterwards, read the inputs and targets out of whatever a data loader yields,
and find the device a model lives on. They live here once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn


def module_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for a stateless model."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


@contextlib.contextmanager
def training_flags(*models: nn.Module, train: bool) -> Iterator[None]:
    """Run the block with every module of ``models`` in train (or eval) mode, then put each
    module's own flag back (a model may mix modes on purpose, e.g. frozen BatchNorms)."""
    saved = [(m, m.training) for model in models for m in model.modules()]
    try:
        for model in models:
            model.train(train)
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def eval_mode(*models: nn.Module) -> contextlib.AbstractContextManager[None]:
    """``training_flags(*models, train=False)``."""
    return training_flags(*models, train=False)


def train_mode(*models: nn.Module) -> contextlib.AbstractContextManager[None]:
    """``training_flags(*models, train=True)``."""
    return training_flags(*models, train=True)


def model_inputs(batch: Any, index: int, name: str = "data") -> tuple:
    """The positional inputs of one batch: a tensor, or (input, target, ...) with input first.

    The input may itself be a tuple of tensors (a forward with several positional inputs).
    """
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
        if isinstance(first, torch.Tensor):
            return (first,)
        if isinstance(first, (tuple, list)) and first and all(isinstance(t, torch.Tensor) for t in first):
            return tuple(first)
    raise TypeError(
        f"{name}[{index}] must be a tensor of inputs or a sequence (inputs, targets, ...) whose first element is a "
        f"tensor or a tuple of tensors, got {type(batch).__name__}"
    )


def inputs_and_targets(batch: Any, index: int, name: str = "data") -> tuple[tuple, torch.Tensor]:
    """The positional inputs and the targets of a supervised batch ``(inputs, targets, ...)``."""
    if not (isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor)):
        raise TypeError(
            f"{name}[{index}] must be a sequence (inputs, targets, ...) with a tensor of targets, "
            f"got {type(batch).__name__}"
        )
    return model_inputs(batch, index, name), batch[1]


def to_device(tensors: tuple, device: torch.device) -> tuple:
    """The tensors moved to ``device`` (no copy when they are there already)."""
    return tuple(t.to(device) for t in tensors)


def iterate_batches(data: Any, max_batches: int | None = None, name: str = "data") -> Iterator[tuple[int, Any]]:
    """``(index, batch)`` for the batches of ``data``, at most ``max_batches`` of them.

    Raises TypeError when ``data`` is not iterable and ValueError when it yields nothing.
    """
    if max_batches is not None:
        if isinstance(max_batches, bool) or not isinstance(max_batches, int):
            raise TypeError(f"max_batches must be a positive int or None, got {type(max_batches).__name__}")
        if max_batches < 1:
            raise ValueError(f"max_batches must be at least 1, got {max_batches}")
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(f"{name} must be an iterable of batches (a DataLoader, a list), got {type(data).__name__}")
    count = 0
    for batch in data:
        if max_batches is not None and count >= max_batches:
            break
        yield count, batch
        count += 1
    if count == 0:
        raise ValueError(f"{name} yielded no batches")


def num_batches(data: Any, max_batches: int | None = None) -> int | None:
    """How many batches :func:`iterate_batches` will yield, when ``data`` knows its length."""
    try:
        total = len(data)
    except TypeError:
        return max_batches
    return total if max_batches is None else min(total, max_batches)


def mean_loss_and_accuracy(
    model: nn.Module, data: Iterable[Any], loss_fn: Callable[..., torch.Tensor], device: torch.device
) -> tuple[float, float | None, int]:
    """Mean loss over samples, accuracy (None when the targets are not class indices), and the sample count.

    The model runs as it is: callers choose its mode and wrap the call in ``torch.no_grad()``.
    ``data`` yields ``(inputs, targets)`` batches, moved to ``device``; ``loss_fn`` returns
    the batch's mean loss, weighted here by the batch size so the result averages over samples.
    """
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    samples = 0
    labelled = 0
    classify = True
    for i, batch in iterate_batches(data, name="data"):
        inputs, targets = inputs_and_targets(batch, i)
        inputs, targets = to_device(inputs, device), targets.to(device)
        outputs = model(*inputs)
        loss = loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(
                f"loss_fn must return the batch's mean loss (one value), got shape {tuple(loss.shape)}; "
                "use reduction='mean'"
            )
        n = targets.shape[0] if targets.ndim else 1
        # The loss is a mean over the batch: weighting it by the batch size averages over samples.
        loss_sum += loss.detach().reshape(()).to(torch.float64) * n
        samples += n
        if classify:
            classify = (
                isinstance(outputs, torch.Tensor)
                and outputs.ndim >= 2
                and not targets.is_floating_point()
                and not targets.is_complex()
                and targets.dtype != torch.bool
                and tuple(targets.shape) == tuple(outputs.shape[:1]) + tuple(outputs.shape[2:])
            )
            if classify:
                correct += (outputs.argmax(dim=1) == targets).sum()
                labelled += targets.numel()
    loss_value = float(loss_sum) / samples
    accuracy = float(correct) / labelled if classify and labelled else None
    return loss_value, accuracy, samples
