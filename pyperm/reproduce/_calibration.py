"""How well a classifier's probabilities are calibrated: expected calibration error and reliability diagrams.

A prediction's confidence is its top softmax probability. The confidences are binned into
equal-width bins of [0, 1] (a confidence on a bin's upper edge belongs to that bin); in each bin
the accuracy of the predictions is set against their mean confidence. The expected calibration
error is the mean gap, weighted by the bins' shares of the examples (Guo et al., 2017):

    ECE = sum_b (n_b / n) |accuracy_b - confidence_b|

A perfectly calibrated model, right 80% of the times it says 80%, has ECE 0.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BINS", "calibration", "logits_and_labels"]

BINS = 15  # Git Re-Basin's calibration plots bin probabilities into 15 equal-width bins


def calibration(logits: Any, labels: Any, bins: int = BINS) -> dict[str, Any]:
    """The expected calibration error of ``logits`` and its reliability diagram.

    Parameters
    ----------
    logits : tensor of shape (n, classes)
        The model's outputs (softmax is taken here).
    labels : tensor of shape (n,)
        The true classes.
    bins : int, default 15
        Equal-width confidence bins of [0, 1].

    Returns
    -------
    dict
        ``ece``; ``bins``: per bin its ``lower`` and ``upper`` edge, ``count``, mean
        ``confidence`` and ``accuracy`` (None for an empty bin).

    Raises
    ------
    ValueError
        Shapes that do not agree, no examples, or ``bins`` below 1.
    """
    from pyperm._checks import check_positive_int

    bins = check_positive_int(bins, "bins")
    logits = torch.as_tensor(logits).detach().double().cpu()
    labels = torch.as_tensor(labels).detach().cpu()
    if logits.ndim != 2 or labels.shape != (logits.shape[0],) or logits.shape[0] == 0:
        raise ValueError(f"logits must be (n, classes) and labels (n,) with n > 0, got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")  # fmt: skip
    probs = torch.softmax(logits, dim=-1)
    confidence, predicted = probs.max(dim=-1)
    correct = (predicted == labels).double()
    # Bin b holds (b / bins, (b + 1) / bins]; a confidence of exactly 0 cannot occur after a softmax.
    which = (torch.ceil(confidence * bins).long() - 1).clamp(0, bins - 1)
    n = len(labels)
    ece = 0.0
    rows = []
    for b in range(bins):
        members = which == b
        count = int(members.sum())
        row: dict[str, Any] = {"lower": b / bins, "upper": (b + 1) / bins, "count": count,
                               "confidence": None, "accuracy": None}  # fmt: skip
        if count:
            conf, acc = float(confidence[members].mean()), float(correct[members].mean())
            row["confidence"], row["accuracy"] = conf, acc
            ece += count / n * abs(acc - conf)
        rows.append(row)
    return {"ece": ece, "bins": rows}


def logits_and_labels(model: torch.nn.Module, batches: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of ``model`` (eval mode, no gradients) on every ``(inputs, targets)`` batch, and the targets,
    concatenated on the CPU."""
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    model.eval()
    outs, ys = [], []
    with torch.no_grad():
        for x, y, *_ in batches:
            outs.append(model(x.to(device)).float().cpu())
            ys.append(y.cpu())
    return torch.cat(outs), torch.cat(ys)
