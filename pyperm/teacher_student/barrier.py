r"""The loss along the straight line between two students, and its barrier.

Definition 2.2 of Git Re-Basin, with the exact population loss:

.. math::

    B(W_A, W_B) = \max_{t \in [0, 1]} \Big( L\big((1 - t) W_A + t W_B\big)
                  - \big((1 - t) L(W_A) + t L(W_B)\big) \Big),

evaluated on ``num_points`` evenly spaced values of :math:`t` (Zhan et al. use steps of 0.1,
i.e. 11 points, and finds the path smooth enough for that). Between two global minima the
endpoint losses are zero and the barrier is the largest loss on the path.
"""

from __future__ import annotations

import torch

from pyperm._checks import check_int
from pyperm.teacher_student._checks import as_teacher, as_weights, check_pair, check_same_shape
from pyperm.teacher_student.loss import loss_unchecked

__all__ = ["interpolation_losses", "path_barrier"]


def _chunk_entries() -> int:
    """Entries of the (n, n) angle matrices evaluated per chunk of path points.

    Measured on the shared 2-core machine (K = 5 sweep, median of 3): one thread is fastest
    with chunks near the cache (2**19: 3.4 s against 4.4 s at 2**21); with a thread pool every
    operation wakes it, which costs milliseconds on a busy machine, so fewer, bigger chunks win
    there (2**21: 17 s against 32 s at 2**19). Reads the thread count, never sets it.
    """
    return 1 << 19 if torch.get_num_threads() == 1 else 1 << 21


def interpolation_losses(
    W_a: torch.Tensor, W_b: torch.Tensor, W_teacher: torch.Tensor, num_points: int = 11
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The exact loss at ``num_points`` evenly spaced points of the segment from A to B.

    .. math::

        L_i = L\big((1 - t_i) W_A + t_i W_B\big), \qquad t_i = \frac{i}{\mathrm{num\_points} - 1}.

    Parameters
    ----------
    W_a, W_b : (..., m, d) torch.Tensor
        The endpoints (a batch of pairs in the leading dimensions).
    W_teacher : (K, d) torch.Tensor
        Teacher weights.
    num_points : int, default 11
        Points on the segment, endpoints included (at least 2).

    Returns
    -------
    t : (num_points,) torch.Tensor
    losses : (..., num_points) torch.Tensor
        float64; differentiable with respect to the endpoints.
    """
    A = as_weights(W_a, "W_a")
    B = as_weights(W_b, "W_b")
    check_same_shape(A, B, "W_a", "W_b")
    wt = as_teacher(W_teacher)
    check_pair(A, "W_a", wt)
    num_points = check_int(num_points, "num_points", 2)
    return _path_losses(A, B, wt, num_points)


def _path_losses(
    A: torch.Tensor, B: torch.Tensor, wt: torch.Tensor, num_points: int
) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.linspace(0.0, 1.0, num_points, dtype=A.dtype, device=A.device)
    return t, segment_losses(A, B, wt, t)


def segment_losses(A: torch.Tensor, B: torch.Tensor, wt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Losses ``(..., len(t))`` at the points ``(1 - t) A + t B`` of checked endpoints ``(..., m, d)``."""
    s = t[:, None, None]
    points = ((1.0 - s) * A[..., None, :, :] + s * B[..., None, :, :]).reshape(-1, *A.shape[-2:])
    n = A.shape[-2] + wt.shape[0]
    per_chunk = max(1, _chunk_entries() // (n * n))
    losses = [loss_unchecked(points[i : i + per_chunk], wt) for i in range(0, points.shape[0], per_chunk)]
    return torch.cat(losses).reshape(*A.shape[:-2], len(t))


def barrier_from_losses(t: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """Definition 2.2 from the losses on the path: the largest excess over the chord."""
    chord = (1.0 - t) * losses[..., :1] + t * losses[..., -1:]
    return (losses - chord).amax(dim=-1)


def path_barrier(W_a: torch.Tensor, W_b: torch.Tensor, W_teacher: torch.Tensor, num_points: int = 11) -> torch.Tensor:
    r"""The loss barrier on the straight line between two students (Git Re-Basin, Def. 2.2).

    .. math::

        B(W_A, W_B) = \max_{t} \Big( L\big((1 - t) W_A + t W_B\big)
                      - \big((1 - t) L(W_A) + t L(W_B)\big) \Big),
        \qquad t \in \Big\{0, \tfrac{1}{\mathrm{num\_points} - 1}, \dots, 1\Big\},

    with :math:`L` the exact population loss. Align B first (``W_b[..., perm, :]`` with a
    permutation from :func:`type_matching` or :func:`lap_matching`) for the barrier modulo
    permutation.

    Parameters
    ----------
    W_a, W_b : (..., m, d) torch.Tensor
        The endpoints (a batch of pairs in the leading dimensions).
    W_teacher : (K, d) torch.Tensor
        Teacher weights.
    num_points : int, default 11
        Points on the segment, endpoints included (at least 2); 11 is the paper's step 0.1.

    Returns
    -------
    torch.Tensor
        Shape ``W_a.shape[:-2]``, float64, never negative (the endpoints give 0).

    References
    ----------
    Ainsworth, Hayase and Srinivasa, "Git Re-Basin", ICLR 2023, Definition 2.2; Zhan, Li and Wu (2025),
    Section 2 (the linear barrier between two minima).
    """
    t, losses = interpolation_losses(W_a, W_b, W_teacher, num_points)
    return barrier_from_losses(t, losses)
