"""Training sets split by label halves, for merging models trained on different data.

The classes are cut into a first and a second half (0-4 / 5-9 of ten classes, 0-49 / 50-99 of
a hundred). Model A gets a share of each half's training examples and model B the rest, so the
two sets are disjoint and together make the whole training split:

- ``fractions=(0.2, 0.8)`` is Git Re-Basin's biased split (sec. 5.4): A holds 20% of the
  examples of the first half's labels and 80% of the second half's, B the reverse;
- ``fractions=(1.0, 0.0)`` gives disjoint tasks (ZipIt's 5+5 split): A sees only the first
  half's classes, B only the second's.

The shares are drawn at random (from ``seed``) within each half, so a split does not depend on
the order of the files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["accuracy_by_half", "check_fractions", "first_half", "split_data", "split_indices"]


def check_fractions(fractions: Any, name: str = "fractions") -> tuple[float, float]:
    """``fractions`` as two floats in [0, 1]: model A's shares of the first and the second half.

    Raises
    ------
    TypeError
        Not a pair of real numbers.
    ValueError
        A share outside [0, 1].
    """
    from pyperm._checks import check_fraction

    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Sequence) or len(fractions) != 2:
        raise TypeError(f"{name} must be a pair (share of the first half, share of the second half), got {fractions!r}")
    return check_fraction(fractions[0], f"{name}[0]"), check_fraction(fractions[1], f"{name}[1]")


def first_half(labels: Any, num_classes: int) -> np.ndarray:
    """A boolean mask of the labels in the first half of the classes (``label < num_classes // 2``)."""
    return np.asarray(labels) < num_classes // 2


def _labels(labels: Any, num_classes: Any) -> np.ndarray:
    from pyperm._checks import check_int

    num_classes = check_int(num_classes, "num_classes", 2)
    if hasattr(labels, "detach"):  # a torch tensor, on any device
        labels = labels.detach().cpu().numpy()
    y = np.asarray(labels)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise TypeError(f"labels must be a 1-D array of class indices, got shape {y.shape} and dtype {y.dtype}")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}, got {y.min()}..{y.max()}")
    return y


def split_indices(labels: Any, num_classes: int, fractions: Any = (0.2, 0.8), seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The training examples of model A and of model B, as sorted index arrays.

    Parameters
    ----------
    labels : 1-D array or tensor of int
        The class of every training example.
    num_classes : int
        The number of classes (at least 2); the first half is ``0 .. num_classes // 2 - 1``.
    fractions : pair of float, default (0.2, 0.8)
        Model A's share of the examples of the first half's labels and of the second half's
        (each rounded to the nearest whole number of examples); B gets the rest.
    seed : int, default 0
        Draws which examples of each half go to A.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        A's indices and B's: disjoint, and together every index of ``labels``.

    Raises
    ------
    TypeError
        ``labels`` not a 1-D integer array, or ``fractions`` not a pair of reals.
    ValueError
        A label outside ``0 .. num_classes - 1``, a share outside [0, 1], or a split that
        leaves A or B without examples.
    """
    from pyperm._checks import check_int

    y = _labels(labels, num_classes)
    shares = check_fractions(fractions)
    rng = np.random.default_rng(check_int(seed, "seed", 0))
    first = first_half(y, num_classes)
    a_parts, b_parts = [], []
    for half, share in ((first, shares[0]), (~first, shares[1])):
        members = rng.permutation(np.flatnonzero(half))
        k = int(round(share * len(members)))
        a_parts.append(members[:k])
        b_parts.append(members[k:])
    idx_a, idx_b = np.sort(np.concatenate(a_parts)), np.sort(np.concatenate(b_parts))
    for label, idx in (("A", idx_a), ("B", idx_b)):
        if len(idx) == 0:
            raise ValueError(f"fractions {shares} leave model {label} without training examples "
                             f"({int(first.sum())} + {int((~first).sum())} examples in the two halves)")  # fmt: skip
    return idx_a, idx_b


def split_data(data: dict[str, Any], fractions: Any = (0.2, 0.8), seed: int = 0) -> tuple[dict, dict]:
    """Models A's and B's training sets from a reproduction's data (:func:`~pyperm.reproduce._data.load_data`).

    Returns
    -------
    (dict, dict)
        For A and for B: ``x_train`` and ``y_train`` (their share of the training tensors, on
        the same device), ``indices`` (into the whole training split), ``num_train``, and
        ``halves`` (its examples of the first and of the second half's labels).
    """
    y = data["y_train"]
    parts = split_indices(y, data["num_classes"], fractions, seed)
    out = []
    for idx in parts:
        index = _as_index(idx, y)
        first = int(first_half(_labels(y, data["num_classes"])[idx], data["num_classes"]).sum())
        out.append({"x_train": data["x_train"][index], "y_train": y[index], "indices": idx,
                    "num_train": len(idx), "halves": (first, len(idx) - first)})  # fmt: skip
    return out[0], out[1]


def _as_index(idx: np.ndarray, like: Any) -> Any:
    if hasattr(like, "device"):
        import torch

        return torch.from_numpy(idx).to(like.device)
    return idx


def accuracy_by_half(logits: Any, labels: Any, num_classes: int) -> tuple[float, float]:
    """Top-1 accuracy on the examples of the first half's labels and on the second half's (NaN for an empty half)."""
    import torch

    logits = torch.as_tensor(logits)
    y = torch.as_tensor(labels).to(logits.device)
    correct = (logits.argmax(dim=-1) == y).cpu().numpy()
    first = first_half(y.cpu().numpy(), num_classes)
    first_acc, second_acc = (float(correct[m].mean()) if m.any() else float("nan") for m in (first, ~first))
    return first_acc, second_acc
