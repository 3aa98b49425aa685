"""Per-unit mean and variance of activations, accumulated exactly over batches."""

from __future__ import annotations

import torch

__all__ = ["Moments"]


class Moments:
    """Streaming per-unit count, mean and sum of squared deviations, in float64.

    Each batch's centred moments are merged into the running ones with Chan et al.'s
    pairwise formula, so the result equals the mean and variance of all samples
    concatenated (each batch weighs by its number of samples) without the cancellation
    of a plain sum of squares.

    References
    ----------
    .. [1] T. F. Chan, G. H. Golub, R. J. LeVeque, "Updating Formulae and a Pairwise
       Algorithm for Computing Sample Variances", COMPSTAT 1982.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def update(self, x: torch.Tensor, axis: int) -> None:
        """Add the samples of ``x``: every index of the other axes is a sample of the units on ``axis``."""
        x = x.detach()
        z = x.movedim(axis, -1).reshape(-1, x.shape[axis]).to(torch.float64)
        n = z.shape[0]
        if n == 0:
            return
        mean = z.mean(dim=0)
        m2 = (z - mean).square_().sum(dim=0)
        if self.mean is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        if mean.shape != self.mean.shape or mean.device != self.mean.device:
            raise ValueError(
                f"activations with {mean.shape[0]} units on {mean.device} after {self.mean.shape[0]} units "
                f"on {self.mean.device}"
            )
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta.square() * (self.count * n / total)
        self.count = total

    def var(self, unbiased: bool = True) -> torch.Tensor:
        """Per-unit variance: ``m2 / (count - 1)`` (unbiased, the default) or ``m2 / count``."""
        if self.m2 is None:
            raise ValueError("no samples were accumulated")
        return self.m2 / (self.count - 1 if unbiased else self.count)

    def std(self) -> torch.Tensor:
        """Per-unit standard deviation (the square root of the unbiased variance)."""
        return self.var().sqrt()
