r"""The Hessian of the exact loss in closed form, and its largest eigenvalue (sharpness).

Differentiating the kernel gradient of :mod:`pyperm.teacher_student.loss` once more gives two
kinds of blocks. With :math:`\bar u, \bar v` the unit directions, :math:`\theta` their angle,
:math:`\delta = \bar u - \bar v`, :math:`\varsigma = \bar u + \bar v` (so
:math:`\lVert\delta\rVert = 2\sin\frac\theta2`, :math:`\lVert\varsigma\rVert = 2\cos\frac\theta2`)
and :math:`p = \bar v - (\bar u^\top \bar v)\,\bar u` (:math:`\lVert p\rVert = \sin\theta`):

.. math::

    \frac{\partial^2 k}{\partial u\, \partial v^\top}
      = \mathbb E\,\mathbb 1[u^\top x > 0]\,\mathbb 1[v^\top x > 0]\, x x^\top
      = \frac{1}{2\pi}\Big((\pi - \theta) I
        + \frac{\lVert\delta\rVert}{2\lVert\varsigma\rVert} \varsigma\varsigma^\top
        - \frac{\lVert\varsigma\rVert}{2\lVert\delta\rVert} \delta\delta^\top\Big),

.. math::

    \frac{\partial^2 k}{\partial u\, \partial u^\top}
      = \frac{\lVert v\rVert}{2\pi \lVert u\rVert}
        \Big(\sin\theta\,(I - \bar u\bar u^\top) + \frac{p p^\top}{\sin\theta}\Big).

(The first is the second moment of :math:`x` on the wedge where both neurons fire: its
in-plane part is a reflection that swaps :math:`\bar u` and :math:`\bar v`, scaled by
:math:`\sin\theta`.) The Hessian of :math:`L` with respect to the student rows is then

.. math::

    \nabla^2_{w_a w_b} L = 2\, \frac{\partial^2 k(w_a, w_b)}{\partial u\,\partial v^\top}
      + 2\,\delta_{ab} \sum_{c} s_c\, \frac{\partial^2 k(w_a, v_c)}{\partial u\,\partial u^\top},

the sum running over student and teacher rows with their signs. Both blocks are written with
vectors computed from the rows themselves (no :math:`0/0` at parallel or antiparallel pairs,
where the terms vanish), and every block that touches a zero neuron is zero (the convention
:math:`\sigma'(0) = 0`, as in the gradient). The loss is :math:`C^2` at parallel pairs (the
kernel behaves like :math:`\theta^3`), so this is the Hessian at the global minima too, where
the second (curvature) term cancels type by type and the Hessian is the Gauss-Newton matrix.

References
----------
Zhan, Li and Wu (2025), Section 5 (sharpness and the edge of stability, learning rates ``c / m``).
"""

from __future__ import annotations

import math

import torch

from pyperm.teacher_student._checks import as_teacher, as_weights, check_pair
from pyperm.teacher_student.loss import signed_stack

__all__ = ["hessian", "sharpness"]

_INV_2PI = 1.0 / (2.0 * math.pi)


def _safe_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``den > 0``, else 0 (the terms it scales vanish there)."""
    positive = den > 0
    return torch.where(positive, num / torch.where(positive, den, 1.0), 0.0)


def _units(V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    norms = torch.linalg.vector_norm(V, dim=-1)
    return norms, V / torch.where(norms > 0, norms, 1.0)[..., None]


def _cross_blocks(unit: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """``(..., m, m, d, d)``: the mixed second derivative of k for every pair of student rows."""
    ua, ub = unit[..., :, None, :], unit[..., None, :, :]
    diff, summ = ua - ub, ua + ub
    alpha = torch.linalg.vector_norm(diff, dim=-1)
    beta = torch.linalg.vector_norm(summ, dim=-1)
    # Kahan's angle: accurate near 0 and pi, unlike arccos of a rounded cosine.
    theta = 2.0 * torch.atan2(alpha, beta)
    eye = torch.eye(unit.shape[-1], dtype=unit.dtype, device=unit.device)
    block = (
        (math.pi - theta)[..., None, None] * eye
        + (_safe_ratio(alpha, 2.0 * beta)[..., None, None] * summ[..., :, None] * summ[..., None, :])
        - (_safe_ratio(beta, 2.0 * alpha)[..., None, None] * diff[..., :, None] * diff[..., None, :])
    )
    both_alive = alive[..., :, None] & alive[..., None, :]
    return block * (_INV_2PI * both_alive)[..., None, None]


def _curvature_blocks(unit: torch.Tensor, norms: torch.Tensor, signs: torch.Tensor, m: int) -> torch.Tensor:
    """``(..., m, d, d)``: the signed sum over all rows c of the second derivative of k(w_a, v_c) in w_a."""
    ua = unit[..., :m, None, :]
    vc = unit[..., None, :, :]
    p = vc - (ua * vc).sum(dim=-1, keepdim=True) * ua
    sin = torch.linalg.vector_norm(p, dim=-1)
    weight = _safe_ratio(signs * norms[..., None, :], 2.0 * math.pi * norms[..., :m, None])
    eye = torch.eye(unit.shape[-1], dtype=unit.dtype, device=unit.device)
    u = unit[..., :m, :]
    tangent = eye - u[..., :, None] * u[..., None, :]
    first = (weight * sin).sum(dim=-1)[..., None, None] * tangent
    second = torch.einsum("...ac,...aci,...acj->...aij", _safe_ratio(weight, sin), p, p)
    return first + second


def hessian(W: torch.Tensor, W_teacher: torch.Tensor, *, gauss_newton: bool = False) -> torch.Tensor:
    r"""The Hessian of the exact population loss with respect to the student weights.

    .. math::

        H_{(a,i),(b,j)} = \frac{\partial^2 L}{\partial W_{ai}\, \partial W_{bj}},

    in closed form (see this module's docstring), with the student flattened row by row.
    With ``gauss_newton=True``, only its Gauss-Newton part

    .. math::

        G_{(a,i),(b,j)} = 2\, \mathbb E\, \mathbb 1[w_a^\top x > 0]\, \mathbb 1[w_b^\top x > 0]\, x_i x_j,

    which equals the Hessian at a global minimum and, unlike it, stays bounded near neurons
    whose norm goes to zero.

    Parameters
    ----------
    W : (..., m, d) torch.Tensor
        Student weights (a batch in the leading dimensions).
    W_teacher : (K, d) torch.Tensor
        Teacher weights.
    gauss_newton : bool, default False
        Return the Gauss-Newton matrix instead of the full Hessian.

    Returns
    -------
    (..., m * d, m * d) torch.Tensor
        Symmetric, float64, on ``W``'s device. Rows and columns of a zero neuron are zero.

    Raises
    ------
    TypeError, ValueError
        As :func:`~pyperm.teacher_student.population_loss`.
    """
    W = as_weights(W, "W")
    wt = as_teacher(W_teacher)
    check_pair(W, "W", wt)
    return hessian_unchecked(W.detach(), wt.detach(), gauss_newton=bool(gauss_newton))


def hessian_unchecked(W: torch.Tensor, W_teacher: torch.Tensor, *, gauss_newton: bool = False) -> torch.Tensor:
    m, d = W.shape[-2:]
    V, signs = signed_stack(W, W_teacher)
    norms, unit = _units(V)
    alive = norms[..., :m] > 0
    blocks = 2.0 * _cross_blocks(unit[..., :m, :], alive)
    if not gauss_newton:
        diagonal = blocks.diagonal(dim1=-4, dim2=-3)  # (..., d, d, m): a view, so the add lands in blocks
        diagonal += 2.0 * _curvature_blocks(unit, norms, signs, m).movedim(-3, -1)
    H = blocks.transpose(-3, -2).reshape(*W.shape[:-2], m * d, m * d)
    return 0.5 * (H + H.mT)


def sharpness(W: torch.Tensor, W_teacher: torch.Tensor, *, gauss_newton: bool = False) -> torch.Tensor:
    r"""The largest eigenvalue of the Hessian of the exact loss (the sharpness).

    .. math::

        \lambda_{\max}\big(\nabla^2 L(W)\big)
        \quad \text{or, with } \texttt{gauss\_newton=True}, \quad \lambda_{\max}(G).

    Gradient descent with step ``lr`` cannot stay at a minimum sharper than ``2 / lr``: the
    edge of stability that Zhan et al. (2025, Section 5) relates to the jump in the sparsity of GD
    solutions. Near a minimum with near-zero neurons the full Hessian has large eigenvalues
    along those neurons' directions (its curvature term grows like :math:`1/\lVert w_j\rVert`
    off the manifold), which GD hardly feels; the Gauss-Newton sharpness is the one that sits
    at :math:`2 / \eta` past the edge of stability.

    Parameters
    ----------
    W : (..., m, d) torch.Tensor
        Student weights (a batch in the leading dimensions).
    W_teacher : (K, d) torch.Tensor
        Teacher weights.
    gauss_newton : bool, default False
        The largest eigenvalue of the Gauss-Newton matrix instead (see :func:`hessian`).

    Returns
    -------
    torch.Tensor
        Shape ``W.shape[:-2]``, float64.

    References
    ----------
    Zhan, Li and Wu (2025), Section 5 and Figure 6.
    """
    H = hessian(W, W_teacher, gauss_newton=gauss_newton)
    return torch.linalg.eigvalsh(H)[..., -1]
