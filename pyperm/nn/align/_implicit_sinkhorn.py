r"""Sinkhorn's operator on scores, differentiated implicitly at its fixed point.

For scores :math:`Z` (``(..., n, n)``), Sinkhorn's operator is the doubly stochastic
matrix

.. math::

    S_{ij} = \exp(Z_{ij} + f_i + g_j), \qquad S\mathbf 1 = \mathbf 1, \quad S^\top\mathbf 1 = \mathbf 1,

found by alternately fitting the row potentials :math:`f` and the column potentials
:math:`g`. The potentials are kept in log space, so that sharp scores neither overflow nor
underflow (:func:`pyperm.sinkhorn` scales a non-negative matrix, which ``exp(Z)`` of sharp
scores is not, and differentiates by unrolling); within one call, the matrix is formed once
from the starting potentials and the iterations fit scalings of it by matrix-vector
products, which cost far less than a log-sum-exp over every entry.

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
changing the answer. It is symmetric positive definite, so conjugate gradients solve it by
products with :math:`S` alone, preconditioned by its diagonal (which evens out the columns
as :math:`S` nears a permutation, where the matrix shrinks towards zero unevenly), to a
residual near the gradient's rounding; where they still have not converged, it is formed
and factored. All in float64: near a permutation its small eigenvalues are the ones that
carry the gradient.

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

__all__ = ["Potentials", "implicit_sinkhorn", "sinkhorn"]


class Potentials:
    """The potentials ``f`` (rows) and ``g`` (columns) of one batch of scores, kept between calls:
    the next scores start from them (a warm start), and ``iterations`` says what the last call ran."""

    def __init__(self) -> None:
        self.f: torch.Tensor | None = None
        self.g: torch.Tensor | None = None
        self.iterations = 0
        self.error = float("nan")


# Scaling factors further than this from 1 (either way) are folded back into the potentials, through
# one exponential of the scores, so that the linear-space iterations neither overflow nor underflow.
_FOLD = 1e8


@torch.no_grad()
def sinkhorn(z: torch.Tensor, iters: int, tol: float, potentials: Potentials | None = None) -> torch.Tensor:
    r"""Sinkhorn's doubly stochastic matrix of the scores ``z`` (``(..., n, n)``).

    Starts from ``potentials`` (zeros when they are empty or of another shape), fits the
    rows, then alternates columns and rows until every column sum is within ``tol`` of 1
    (the rows are exact after each row fit) or ``iters`` column fits were made. The
    potentials reached, the column fits made and the last column error are written back
    into ``potentials``.

    The matrix is formed once, :math:`K = \exp(Z + f_0\mathbf 1^\top + \mathbf 1 g_0^\top)`
    from the starting potentials (the rows fitted in log space, so every entry is at most
    1), and the iterations then fit scaling vectors :math:`u = e^{f - f_0}`,
    :math:`v = e^{g - g_0}` by products with :math:`K`: the same iterates as fitting the
    potentials by log-sum-exps, at the cost of a product instead of an exponential of
    every entry. A column fit whose scalings would stray beyond ``1e8`` either way (a start
    far from the fixed point) is made in log space instead, and the matrix formed again.
    """
    pot = potentials if potentials is not None else Potentials()
    batch = z.shape[:-1]
    g = pot.g if pot.g is not None and pot.g.shape == batch and pot.g.dtype == z.dtype else z.new_zeros(batch)
    k, f = _fit_rows(z, g)
    u, v = torch.ones_like(f), torch.ones_like(g)
    done, error = 0, float("inf")
    while True:
        columns = _vecmat(u, k)  # the column sums without v
        error = float((columns * v).sub_(1).abs_().max()) if z.numel() else 0.0
        if error <= tol or done >= iters:
            break
        fitted = columns.reciprocal()
        spread = float(torch.maximum(fitted.amax(), fitted.amin().reciprocal())) if z.numel() else 1.0
        if spread <= _FOLD:
            # v within bounds keeps u = 1 / (K v) within them too (K's rows sum to 1).
            v = fitted
            u = _matvec(k, v).reciprocal_()
        else:  # NaN included: a column whose sum underflowed to zero. This fit in log space instead.
            g = -torch.logsumexp(z + (f + u.log()).unsqueeze(-1), dim=-2)
            k, f = _fit_rows(z, g)
            u, v = torch.ones_like(f), torch.ones_like(g)
        done += 1
    pot.f, pot.g, pot.iterations, pot.error = f + u.log(), g + v.log(), done, error
    return k.mul_(u.unsqueeze(-1)).mul_(v.unsqueeze(-2))


def _fit_rows(z: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(z + f 1^T + 1 g^T)`` with the row potentials ``f`` that make its rows sum to 1, and ``f``."""
    shifted = z + g.unsqueeze(-2)
    top = shifted.amax(-1, keepdim=True) if z.shape[-1] else shifted.sum(-1, keepdim=True)
    k = shifted.sub_(top).exp_()
    sums = k.sum(-1)
    k.div_(sums.unsqueeze(-1))
    return k, -(top.squeeze(-1) + sums.log())


def _vecmat(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-2) @ m).squeeze(-2)


class _ImplicitSinkhorn(torch.autograd.Function):
    """Forward: :func:`sinkhorn`. Backward: the fixed point's adjoint system."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, iters: int, tol: float, potentials: Potentials | None) -> torch.Tensor:
        s = sinkhorn(z.detach(), iters, tol, potentials)
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
    # The entrywise work in S's dtype; the sums and the adjoint system in float64.
    grad_s = grad_s.to(s.dtype)
    h = (grad_s * s).to(torch.float64)
    h_rows, h_cols = h.sum(-1), h.sum(-2)
    s64 = s.to(torch.float64)
    rows, cols = s64.sum(-1), s64.sum(-2)
    rhs = h_cols - _matvec(s64.transpose(-1, -2), h_rows / rows)
    y_cols = _schur_solve(s64, rows, cols, rhs, _CG_TOL.get(s.dtype, _CG_TOL_SINGLE))
    y_rows = (h_rows - _matvec(s64, y_cols)) / rows
    # H - S o (y_r 1^T + 1 y_c^T), as S o (G - y_r 1^T - 1 y_c^T): no difference of large terms.
    return s * (grad_s - (y_rows.unsqueeze(-1) + y_cols.unsqueeze(-2)).to(s.dtype))


# Both products are taken with x as a row: torch's batched product of a matrix by a column takes a
# slower path on the CPU than the row's product with the matrix or its transposed view.
def _matvec(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-2) @ m.mT).squeeze(-2)


# Preconditioned conjugate-gradient steps before the Schur complement is formed and factored instead
# (about what forming and factoring costs at the widths of the MLPs measured).
_CG_STEPS = 150
# The residual, relative to the right-hand side's, at which the conjugate gradients stop: where the
# gradient is float64, near its rounding; where it is float32 (or less), 1e-8, below float32's rounding
# of the gradient (the adjoint's error is of the order of the residual once preconditioned).
_CG_TOL = {torch.float64: 1e-11}
_CG_TOL_SINGLE = 1e-8
# Up to this size the complement is formed and factored at once: its n^3 work costs less than the
# fixed cost of the conjugate-gradient steps' small operations (the crossover was near 100 units on
# the development machine).
_FACTOR_UP_TO = 96


def _schur_solve(s: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, rhs: torch.Tensor,
                 tol: float) -> torch.Tensor:
    r"""Solve :math:`(D_c - S^\top D_r^{-1} S + \mathbf 1\mathbf 1^\top/n)\,y = b` for every matrix of the batch.

    The matrix is symmetric positive definite, so conjugate gradients solve it with products
    by :math:`S` alone (``n^2`` each, where forming it costs ``n^3``), preconditioned by its
    diagonal: :math:`D_c - S^\top D_r^{-1} S` is the Laplacian of a graph on the columns
    (the weight of :math:`j, k` is :math:`\sum_i S_{ij} S_{ik} / r_i`), and as :math:`S` nears
    a permutation its degrees shrink unevenly, column by column, which the diagonal evens
    out. They stop at a residual of ``tol`` relative to the right-hand side's. Where they
    have not converged in ``_CG_STEPS`` steps, and at once for small ``n``, the matrix is
    formed and factored (float64 throughout).
    """
    n = s.shape[-1]

    def apply(y: torch.Tensor) -> torch.Tensor:
        return cols * y - _matvec(s.transpose(-1, -2), _matvec(s, y) / rows) + y.mean(-1, keepdim=True)

    y = torch.zeros_like(rhs)
    residual = rhs.clone()
    bound = tol**2 * residual.square().sum(-1)
    steps = 0 if n <= _FACTOR_UP_TO else _CG_STEPS
    if steps:
        diagonal = _schur_diagonal(s, rows, cols)
        preconditioned = residual / diagonal
        direction = preconditioned.clone()
        product = (residual * preconditioned).sum(-1)
    for _ in range(steps):
        if bool((residual.square().sum(-1) <= bound).all()):
            return y
        moved = apply(direction)
        curvature = (direction * moved).sum(-1)
        step = torch.where(curvature > 0, product / curvature.clamp_min(1e-300), torch.zeros_like(product))
        y = y + step.unsqueeze(-1) * direction
        residual = residual - step.unsqueeze(-1) * moved
        preconditioned = residual / diagonal
        new_product = (residual * preconditioned).sum(-1)
        ratio = torch.where(product > 0, new_product / product.clamp_min(1e-300), torch.zeros_like(product))
        direction = preconditioned + ratio.unsqueeze(-1) * direction
        product = new_product
    if bool((residual.square().sum(-1) <= bound).all()):
        return y
    schur = torch.diag_embed(cols) - s.transpose(-1, -2) @ (s / rows.unsqueeze(-1)) + 1.0 / n
    solved, info = torch.linalg.solve_ex(schur, rhs.unsqueeze(-1))
    if bool((info != 0).any()):  # singular in float64: S is a permutation up to rounding
        solved = torch.linalg.pinv(schur, hermitian=True) @ rhs.unsqueeze(-1)
    return solved.squeeze(-1)


def _schur_diagonal(s: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The diagonal of the regularised Schur complement: the degrees ``sum_k W_jk`` (``k != j``), which are
    at least 0 (clamped there against rounding), and the ``1/n`` of the constant term."""
    return (cols - _vecmat(rows.reciprocal(), s.square())).clamp_min_(0.0) + 1.0 / s.shape[-1]


def implicit_sinkhorn(z: torch.Tensor, iters: int = 100, tol: float = 1e-6,
                      potentials: Potentials | None = None) -> torch.Tensor:
    """Sinkhorn's doubly stochastic matrix of the scores ``z`` (``(..., n, n)``), differentiable in ``z``
    through the implicit function theorem at the fixed point (no unrolled iterations)."""
    return _ImplicitSinkhorn.apply(z, iters, tol, potentials)
