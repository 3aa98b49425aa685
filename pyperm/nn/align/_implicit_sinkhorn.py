r"""Sinkhorn's operator in log space, differentiated implicitly at its fixed point.

For scores :math:`Z` (``(..., n, n)``), Sinkhorn's operator is the doubly stochastic
matrix

.. math::

    S_{ij} = \exp(Z_{ij} + f_i + g_j), \qquad S\mathbf 1 = \mathbf 1, \quad S^\top\mathbf 1 = \mathbf 1,

found by alternately fitting the row potentials :math:`f` and the column potentials
:math:`g` (a log-sum-exp each), in log space so that sharp scores neither overflow nor
underflow (:func:`pyperm.sinkhorn` scales a non-negative matrix in linear space, which
``exp(Z)`` of sharp scores is not, and differentiates by unrolling).

The backward pass does not go back through the iterations (whose memory and time grow
with their number): it differentiates the fixed point itself. A change :math:`dZ` moves
:math:`S` by :math:`dS = S \circ (dZ + df\,\mathbf 1^\top + \mathbf 1\,dg^\top)`, and the
row sums :math:`r` and column sums :math:`c` stay put, a linear system in :math:`(df, dg)`:

.. math::

    \begin{pmatrix} D_r & S \\ S^\top & D_c \end{pmatrix}
    \begin{pmatrix} df \\ dg \end{pmatrix}
    = -\begin{pmatrix} (S \circ dZ)\mathbf 1 \\ (S \circ dZ)^\top \mathbf 1 \end{pmatrix}.

For a loss gradient :math:`G = \partial L / \partial S`, with :math:`H = G \circ S`, the
adjoint :math:`(y_r, y_c)` solves the same (symmetric) system with right-hand side
:math:`(H\mathbf 1, H^\top\mathbf 1)`, and
:math:`\partial L / \partial Z = H - S \circ (y_r\mathbf 1^\top + \mathbf 1 y_c^\top)`
(Eisenberger et al. 2022, as Pena et al. 2023 use it). The system is solved through its
Schur complement, an ``n x n`` system
:math:`(D_c - S^\top D_r^{-1} S)\,y_c = H^\top\mathbf 1 - S^\top D_r^{-1} H\mathbf 1` instead
of the ``(2n - 1)``-square one: its matrix has the constant vector as its null space
(shifting :math:`f` up and :math:`g` down leaves :math:`S` alone) and the right-hand side
sums to zero, so adding :math:`\mathbf 1\mathbf 1^\top / n` makes it regular without
changing the answer. It is solved in float64: near a permutation its small eigenvalues
are the ones that carry the gradient.

References
----------
.. [1] M. Eisenberger, A. Toker, L. Leal-Taixe, F. Bernard, D. Cremers, "A Unified
   Framework for Implicit Sinkhorn Differentiation", CVPR 2022.
.. [2] F. A. G. Pena, H. R. Medeiros, T. Dubail, M. Aminbeidokhti, E. Granger,
   M. Pedersoli, "Re-basin via implicit Sinkhorn differentiation", CVPR 2023.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Potentials", "implicit_sinkhorn", "log_sinkhorn"]


class Potentials:
    """The potentials ``f`` (rows) and ``g`` (columns) of one batch of scores, kept between calls:
    the next scores start from them (a warm start), and ``iterations`` says what the last call ran."""

    def __init__(self) -> None:
        self.f: torch.Tensor | None = None
        self.g: torch.Tensor | None = None
        self.iterations = 0
        self.error = float("nan")


@torch.no_grad()
def log_sinkhorn(z: torch.Tensor, iters: int, tol: float, potentials: Potentials | None = None) -> torch.Tensor:
    r"""The log of Sinkhorn's doubly stochastic matrix of the scores ``z`` (``(..., n, n)``).

    Starts from ``potentials`` (zeros when they are empty or of another shape), fits the
    rows, then alternates columns and rows until every column sum is within ``tol`` of 1
    (the rows are exact after each row fit) or ``iters`` column fits were made. The
    potentials reached, the column fits made and the last column error are written back
    into ``potentials``.
    """
    pot = potentials if potentials is not None else Potentials()
    batch = z.shape[:-1]
    g = pot.g if pot.g is not None and pot.g.shape == batch and pot.g.dtype == z.dtype else z.new_zeros(batch)
    f = -torch.logsumexp(z + g.unsqueeze(-2), dim=-1)
    done, error = 0, float("inf")
    while True:
        columns = torch.logsumexp(z + f.unsqueeze(-1), dim=-2)  # log of the column sums without g
        error = float((columns + g).exp().sub_(1).abs_().max()) if z.numel() else 0.0
        if error <= tol or done >= iters:
            break
        g = -columns
        f = -torch.logsumexp(z + g.unsqueeze(-2), dim=-1)
        done += 1
    pot.f, pot.g, pot.iterations, pot.error = f, g, done, error
    return z + f.unsqueeze(-1) + g.unsqueeze(-2)


class _ImplicitSinkhorn(torch.autograd.Function):
    """Forward: :func:`log_sinkhorn`, exponentiated. Backward: the fixed point's adjoint system."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, iters: int, tol: float, potentials: Potentials | None) -> torch.Tensor:
        s = log_sinkhorn(z.detach(), iters, tol, potentials).exp_()
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx: Any, grad_s: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (s,) = ctx.saved_tensors
        return _fixed_point_grad(s, grad_s), None, None, None


def _fixed_point_grad(s: torch.Tensor, grad_s: torch.Tensor) -> torch.Tensor:
    """``dL/dZ`` at the fixed point ``s`` for ``grad_s = dL/dS`` (see the module docstring)."""
    n = s.shape[-1]
    if n == 0:
        return torch.zeros_like(s)
    s64 = s.to(torch.float64)
    h = grad_s.to(torch.float64) * s64
    h_rows, h_cols = h.sum(-1), h.sum(-2)
    rows, cols = s64.sum(-1), s64.sum(-2)
    scaled = s64 / rows.unsqueeze(-1)  # D_r^{-1} S
    schur = torch.diag_embed(cols) - s64.transpose(-1, -2) @ scaled + 1.0 / n
    rhs = h_cols - (scaled.transpose(-1, -2) @ h_rows.unsqueeze(-1)).squeeze(-1)
    y_cols, info = torch.linalg.solve_ex(schur, rhs.unsqueeze(-1))
    if bool((info != 0).any()):  # singular in float64: S is a permutation up to rounding
        y_cols = torch.linalg.pinv(schur, hermitian=True) @ rhs.unsqueeze(-1)
    y_cols = y_cols.squeeze(-1)
    y_rows = (h_rows - (s64 @ y_cols.unsqueeze(-1)).squeeze(-1)) / rows
    grad_z = h - s64 * (y_rows.unsqueeze(-1) + y_cols.unsqueeze(-2))
    return grad_z.to(grad_s.dtype)


def implicit_sinkhorn(z: torch.Tensor, iters: int = 100, tol: float = 1e-6,
                      potentials: Potentials | None = None) -> torch.Tensor:
    """Sinkhorn's doubly stochastic matrix of the scores ``z`` (``(..., n, n)``), differentiable in ``z``
    through the implicit function theorem at the fixed point (no unrolled iterations)."""
    return _ImplicitSinkhorn.apply(z, iters, tol, potentials)
