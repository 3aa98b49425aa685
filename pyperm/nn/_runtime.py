"""Runtime helpers shared by the methods of :mod:`pyperm.nn`: modes, batches, devices.

Every method that runs a model (activation matching, barriers, BatchNorm resets, curves,
REPAIR, PAM) needs the same few things: run in eval or train mode and put every module's
flag back afterwards, read the inputs and targets out of whatever a data loader yields
(and refuse, where data enters, what is not batches, saying what was given and what a
batch must be), and find the device a model lives on. They live here once.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from pyperm._checks import check_positive_int


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


def describe(value: Any) -> str:
    """What a user passed, in a few words for an error message: a tensor's shape and dtype, a
    sequence's length and the types of its first items, or the type's name."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(describe(v) if isinstance(v, torch.Tensor) else type(v).__name__ for v in value[:3])
        more = ", ..." if len(value) > 3 else ""
        return f"a {type(value).__name__} of {len(value)} ({kinds}{more})"
    return f"a {type(value).__name__}"


# What a batch must look like, for the messages below.
_SUPERVISED = "a sequence (inputs, targets, ...): inputs a tensor or a tuple of tensors, targets a tensor"
_UNSUPERVISED = "a tensor of inputs or a sequence (inputs, targets, ...) whose inputs are a tensor or a tuple of tensors"


def _looks_like_one_batch(data: Any) -> bool:
    """Whether ``data`` is a bare (inputs, targets) pair rather than a collection of them."""
    return (isinstance(data, (tuple, list)) and len(data) >= 2
            and all(isinstance(t, torch.Tensor) and t.ndim >= 1 for t in data)
            and len({t.shape[0] for t in data}) == 1)


def as_inputs(inputs: Any, name: str = "inputs") -> tuple:
    """The positional inputs of a forward: a bare tensor is the model's single input; a tuple or
    list of tensors, several inputs. Anything else is refused, naming what was given."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(t, torch.Tensor) for t in inputs):
        return tuple(inputs)
    raise TypeError(
        f"{name} must be the model's input tensor or a tuple of its positional input tensors, got {describe(inputs)}"
    )


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
    raise TypeError(f"{name}[{index}] must be {_UNSUPERVISED}; got {describe(batch)}")


def inputs_and_targets(batch: Any, index: int, name: str = "data") -> tuple[tuple, torch.Tensor]:
    """The positional inputs and the targets of a supervised batch ``(inputs, targets, ...)``."""
    if not (isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor)):
        hint = ""
        if isinstance(batch, torch.Tensor):
            # The usual slip: the whole inputs tensor (or the pair itself) passed as the data,
            # which iterates row by row.
            hint = (f" (a bare tensor is read as inputs without targets; {name} must yield (inputs, targets) "
                    f"pairs: e.g. [(x, y)] for one batch, or a DataLoader)")
        raise TypeError(f"{name}[{index}] must be {_SUPERVISED}; got {describe(batch)}{hint}")
    return model_inputs(batch, index, name), batch[1]


def check_batches(data: Any, name: str = "data", *, supervised: bool = True, reiterable: bool = False) -> Any:
    """``data`` itself when it is an iterable of batches; else a TypeError that names ``name``,
    says what was given and what a batch must be.

    ``supervised``: batches are ``(inputs, targets, ...)``; otherwise a bare tensor batch is
    the model's single input. ``reiterable``: refuse one-shot iterators (data read more than
    once). A list or tuple has its first batch checked here, before any work; other iterables
    (a DataLoader) are checked batch by batch as they are read.
    """
    expected = _SUPERVISED if supervised else _UNSUPERVISED
    if isinstance(data, torch.Tensor):
        one = "[(x, y)]" if supervised else "[x] (or [(x, y)])"
        raise TypeError(
            f"{name} must be an iterable of batches (a DataLoader, a list of batches), got {describe(data)}: "
            f"a bare tensor would be read row by row; to pass one batch, wrap it in a list, {one}"
        )
    if isinstance(data, (str, bytes, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(f"{name} must be an iterable of batches (a DataLoader, a list of batches), got {describe(data)}")
    if reiterable and isinstance(data, Iterator):
        raise TypeError(
            f"{name} is read several times and must be re-iterable (a DataLoader, a list), "
            f"got a one-shot {type(data).__name__}: wrap it in list(...)"
        )
    if isinstance(data, (tuple, list)) and data:
        if supervised and _looks_like_one_batch(data) and not _looks_like_one_batch(data[0]):
            raise TypeError(
                f"{name} must be an iterable of batches, each {expected}; got {describe(data)}, "
                "which looks like one batch: wrap it in a list, [(inputs, targets)]"
            )
        if supervised:
            inputs_and_targets(data[0], 0, name)
        else:
            model_inputs(data[0], 0, name)
    return data


def to_device(tensors: tuple, device: torch.device) -> tuple:
    """The tensors moved to ``device`` (no copy when they are there already)."""
    return tuple(t.to(device) for t in tensors)


def iterate_batches(data: Any, max_batches: int | None = None, name: str = "data") -> Iterator[tuple[int, Any]]:
    """``(index, batch)`` for the batches of ``data``, at most ``max_batches`` of them.

    Raises TypeError when ``data`` is not iterable and ValueError when it yields nothing.
    """
    max_batches = None if max_batches is None else check_positive_int(max_batches, "max_batches")
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        check_batches(data, name, supervised=False)  # raises, saying what was given
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
    model: nn.Module, data: Iterable[Any], loss_fn: Callable[..., torch.Tensor], device: torch.device,
    name: str = "data", ranks: Any = None,
) -> tuple[float, float, int]:
    """Mean loss over samples, accuracy (NaN when the targets are not class indices), and the sample count.

    The model runs as it is: callers choose its mode and wrap the call in ``torch.no_grad()``.
    ``data`` yields ``(inputs, targets)`` batches, moved to ``device``; ``loss_fn`` returns
    the batch's mean loss, weighted here by the batch size so the result averages over samples.
    ``ranks`` (a :class:`pyperm.nn._ranks.Ranks`): ``data`` is this rank's share; the loss sum,
    the samples, the correct and labelled counts are all-reduced, so every rank returns the
    values of all the shares together (the sample count too).
    """
    with contextlib.nullcontext() if ranks is None else ranks.together(f"the evaluation on {name}"):
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        samples = 0
        labelled = 0
        classify = True
        for i, batch in iterate_batches(data, name=name):
            inputs, targets = inputs_and_targets(batch, i, name)
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
    if ranks is not None:  # sample-weighted sums and their counts, over every rank's share
        local = torch.tensor([float(loss_sum), float(samples), float(correct), float(labelled),
                              0.0 if classify else 1.0], dtype=torch.float64)
        total = ranks.sum(local).tolist()
        loss_sum, samples, correct, labelled = total[0], int(total[1]), int(total[2]), int(total[3])
        classify = total[4] == 0
    loss_value = float(loss_sum) / samples
    accuracy = float(correct) / labelled if classify and labelled else math.nan
    return loss_value, accuracy, samples
