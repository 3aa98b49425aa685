"""The data a reproduction runs on: ``--data digits|mnist:DIR|cifar10:DIR|cifar100:DIR``, as torch batches.

One loader for every report that takes ``--data``, so that a name means the same split,
scaling and batches in each. Nothing is downloaded: MNIST and CIFAR come from files the
user has (:mod:`pyperm.datasets` reads them).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DATASETS", "check_data", "load_data"]

# The datasets a report can take, by the name before the colon.
DATASETS = ("digits", "mnist", "cifar10", "cifar100")

_DESCRIPTION = {
    "digits": "scikit-learn digits, 8x8 grey images",
    "mnist": "MNIST, 28x28 grey images",
    "cifar10": "CIFAR-10, 32x32 colour images",
    "cifar100": "CIFAR-100 (fine labels), 32x32 colour images",
}


def check_data(data: Any, accepted: tuple[str, ...] = DATASETS) -> str:
    """The dataset's name (``"mnist"`` for ``"mnist:DIR"``), after checking the form of ``data``.

    Raises
    ------
    TypeError
        ``data`` is not a str.
    ValueError
        An unknown dataset, one the report does not take, or a file dataset without its directory.
    """
    if not isinstance(data, str):
        raise TypeError(f"data must be a str such as 'digits' or 'mnist:DIR', got {type(data).__name__}")
    name, _, root = data.partition(":")
    if name not in accepted:
        names = ", ".join(n if n == "digits" else n + ":DIR" for n in accepted)
        raise ValueError(f"data {data!r}: expected one of {names}")
    if name != "digits" and not root:
        raise ValueError(f"data {data!r}: {name} needs the directory of its files, {name}:DIR")
    return name


def load_data(data: str, device: Any, eval_batch: int, *, train_eval: int | None = None,
              **train_batches: int) -> dict[str, Any]:
    """The dataset ``data`` (``"digits"``, ``"mnist:DIR"``, ...) on ``device``.

    Returns
    -------
    dict
        ``x_train``, ``y_train`` (the whole training split as tensors), ``test`` (the test
        split in batches of ``eval_batch``), ``train_eval`` (the first ``train_eval``
        training samples, all when None, in batches of ``eval_batch``: the training split
        that the paths and curves are evaluated on), one list of training batches per
        keyword of ``train_batches`` (``train=64`` gives ``"train"``), and ``name``,
        ``description``, ``input_shape`` (C, H, W), ``num_classes``, ``num_train``,
        ``num_test``, ``num_train_eval``.

    Raises
    ------
    ValueError
        A malformed ``data`` or a dataset file that is missing or malformed (the message
        names the file).
    """
    from pyperm.datasets import load_dataset, to_batches

    name = check_data(data)
    ds = load_dataset(data)
    n_eval = len(ds.y_train) if train_eval is None else min(train_eval, len(ds.y_train))
    out = {
        "name": name,
        "description": f"{_DESCRIPTION[name]}, {len(ds.y_train)} training / {len(ds.y_test)} test",
        "input_shape": ds.input_shape,
        "num_classes": ds.num_classes,
        "x_train": torch.from_numpy(ds.x_train).to(device),
        "y_train": torch.from_numpy(ds.y_train).to(device),
        "test": to_batches(ds.x_test, ds.y_test, eval_batch, device=device),
        "train_eval": to_batches(ds.x_train[:n_eval], ds.y_train[:n_eval], eval_batch, device=device),
        "num_train": len(ds.y_train),
        "num_test": len(ds.y_test),
        "num_train_eval": n_eval,
    }
    for key, size in train_batches.items():
        out[key] = to_batches(ds.x_train, ds.y_train, size, device=device)
    return out
