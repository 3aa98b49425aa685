r"""The population loss of a ReLU student against a ReLU teacher, exactly and by Monte Carlo.

With :math:`x \sim \mathcal N(0, I_d)` and output weights fixed at one,

.. math::

    L(W) = \mathbb E_x \Big(\sum_{j=1}^m \sigma(w_j^\top x) - \sum_{k=1}^K \sigma(w_k^{*\top} x)\Big)^2,
    \qquad \sigma(z) = \max(z, 0).

Stack the student and teacher rows into :math:`v_1, \dots, v_n` (:math:`n = m + K`) with signs
:math:`s_a = +1` (student) and :math:`-1` (teacher); then
:math:`L = \sum_{a,b} s_a s_b\, k(v_a, v_b)` with the first-order arc-cosine kernel of Cho and
Saul (2009),

.. math::

    k(u, v) = \mathbb E\,\sigma(u^\top x)\,\sigma(v^\top x)
            = \frac{\lVert u\rVert \lVert v\rVert}{2\pi}\big(\sin\theta + (\pi - \theta)\cos\theta\big)
            = \tfrac12 u^\top v + \frac{\lVert u\rVert \lVert v\rVert}{2\pi}\, h(\theta),
    \qquad h(\theta) = \sin\theta - \theta\cos\theta,

where :math:`\theta` is the angle between :math:`u` and :math:`v`. The second form (from
:math:`\sigma(z) = (z + |z|)/2`) is the one computed: :math:`h(\theta) = \theta^3/3 + O(\theta^5)`
is flat where neurons are nearly parallel, which is exactly where the angle computed from a
Gram matrix is least accurate (an error of :math:`10^{-8}` in :math:`\theta` costs
:math:`10^{-24}`), so the loss is zero to rounding at a global minimum. Summed,

.. math::

    L(W) = \tfrac12 \Big\lVert \sum_a s_a v_a \Big\rVert^2
         + \frac{1}{2\pi} \sum_{a,b} s_a s_b \lVert v_a\rVert \lVert v_b\rVert\, h(\theta_{ab}).

The gradient is the closed form
:math:`\nabla_u k(u, v) = \mathbb E\,\mathbb 1[u^\top x > 0]\, x\, \sigma(v^\top x)
= \tfrac{1}{2\pi}\big((\pi - \theta) v + \lVert v\rVert \sin\theta\, \bar u\big)`
(:math:`\bar u = u / \lVert u\rVert`), so
:math:`\nabla_{v_a} L = 2 s_a \sum_b s_b \nabla_{v_a} k(v_a, v_b)`. At a zero neuron it is taken
to be zero, the convention :math:`\sigma'(0) = 0` that autograd uses for ``torch.relu`` (so the
exact gradient is the limit of the Monte Carlo one, and GD never revives a dead neuron).

References
----------
.. [1] Y. Cho and L. Saul, "Kernel methods for deep learning", NeurIPS 2009.
.. [2] K. Zhan, P. Li and L. Wu, "Analyzing the Role of Permutation Invariance in Linear
   Mode Connectivity", AISTATS 2025, eqs. (3), (7), (8) and Appendix A.2.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from pyperm._checks import check_int
from pyperm.teacher_student._checks import as_teacher, as_weights, check_pair, generator, seed_list

__all__ = ["monte_carlo_loss", "population_loss"]

_INV_2PI = 1.0 / (2.0 * math.pi)
# Monte Carlo samples are drawn in chunks of at most this many (sample, neuron) activations.
_MC_CHUNK_ENTRIES = 1 << 22


def signed_stack(W: torch.Tensor, W_teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Student rows then teacher rows, ``(..., m + K, d)``, and their signs (+1 student, -1 teacher)."""
    m, K = W.shape[-2], W_teacher.shape[0]
    V = torch.cat([W, W_teacher.expand(*W.shape[:-2], *W_teacher.shape)], dim=-2)
    signs = torch.cat([W.new_ones(m), W.new_full((K,), -1.0)])
    return V, signs


def _norms_and_cosines(V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row norms and pairwise cosines of ``V`` (cosine 0 against a zero row, 1 on the diagonal)."""
    norms = torch.linalg.vector_norm(V, dim=-1)
    inverse = torch.where(norms > 0, 1.0 / norms, 0.0)
    # In place: these (..., n, n) buffers dominate a sweep, and fresh allocations cost page faults.
    cos = (V @ V.mT).mul_(inverse[..., :, None]).mul_(inverse[..., None, :]).clamp_(-1.0, 1.0)
    # A row against itself is exactly parallel; rounding would otherwise give theta ~ 1e-8.
    cos.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    return norms, cos


def _quadratic_form(x: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``x^T M x`` over the last dimensions."""
    return ((M @ x[..., None]).squeeze(-1) * x).sum(dim=-1)


@torch.no_grad()
def stack_loss(V: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The loss of a signed stack (no autograd through this path: it backs the custom Function)."""
    norms, cos = _norms_and_cosines(V)
    theta = torch.arccos(cos)
    h = torch.sin(theta).sub_(theta.mul_(cos))  # sin(theta) - theta cos(theta)
    linear = 0.5 * (signs[:, None] * V).sum(dim=-2).square().sum(dim=-1)
    return linear + _quadratic_form(signs * norms, h) * _INV_2PI


@torch.no_grad()
def stack_loss_and_grad(V: torch.Tensor, signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The loss of a signed stack and its gradient with respect to every row of ``V``.

    Uses :math:`\sum_b s_b \nabla_{v_a} k(v_a, v_b) = \tfrac12 S + \tfrac1{2\pi}\big(
    (\sin\Theta\, (s \odot n))_a\, \bar v_a - (\Theta\, (s \odot V))_a\big)` with
    :math:`S = \sum_b s_b v_b`: two matrix products, no pairwise ``(n, n, d)`` tensor.
    """
    norms, cos = _norms_and_cosines(V)
    theta = torch.arccos(cos)
    sin = torch.sin(theta)
    sn = signs * norms
    signed_rows = signs[:, None] * V
    total = signed_rows.sum(dim=-2)
    loss = 0.5 * total.square().sum(dim=-1) + _quadratic_form(sn, sin - theta * cos) * _INV_2PI
    alive = norms > 0
    unit = V / torch.where(alive, norms, 1.0)[..., None]
    pull = (sin @ sn[..., None]) * unit - theta @ signed_rows
    grad = 2.0 * signs[:, None] * (0.5 * total[..., None, :] + _INV_2PI * pull)
    # sigma'(0) = 0: a zero neuron is inactive on almost every input and gets no gradient.
    return loss, grad * alive[..., None]


class _PopulationLoss(torch.autograd.Function):
    """Closed-form loss with the closed-form gradient (autograd through arccos would give NaN
    wherever two neurons are parallel, i.e. at every global minimum)."""

    @staticmethod
    def forward(ctx, W: torch.Tensor, W_teacher: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(W, W_teacher)
        return stack_loss(*signed_stack(W, W_teacher))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        W, W_teacher = ctx.saved_tensors
        _, grad = stack_loss_and_grad(*signed_stack(W, W_teacher))
        grad = grad * grad_out[..., None, None]
        m = W.shape[-2]
        grad_w = grad[..., :m, :] if ctx.needs_input_grad[0] else None
        grad_t = grad[..., m:, :].reshape(-1, *W_teacher.shape).sum(dim=0) if ctx.needs_input_grad[1] else None
        return grad_w, grad_t


def population_loss(W: torch.Tensor, W_teacher: torch.Tensor) -> torch.Tensor:
    r"""The exact population loss of a student against the teacher (differentiable once).

    .. math::

        L(W) = \mathbb E_{x \sim \mathcal N(0, I_d)}
        \Big(\sum_{j=1}^m \sigma(w_j^\top x) - \sum_{k=1}^K \sigma(w_k^{*\top} x)\Big)^2
        = \tfrac12 \Big\lVert \sum_j w_j - \sum_k w^*_k \Big\rVert^2
        + \frac{1}{2\pi} \sum_{a,b} s_a s_b \lVert v_a\rVert \lVert v_b\rVert\,
          (\sin\theta_{ab} - \theta_{ab}\cos\theta_{ab})

    over the stacked rows :math:`v = (w_1, \dots, w_m, w^*_1, \dots, w^*_K)` with signs
    :math:`s = (+1, \dots, +1, -1, \dots, -1)` (see the module docstring for the derivation
    through the arc-cosine kernel). No factor 1/2 in front of the square.

    Parameters
    ----------
    W : (..., m, d) torch.Tensor
        Student weights, one neuron per row; leading dimensions are a batch of students.
        Any real floating dtype; computed in float64, on ``W``'s device.
    W_teacher : (K, d) torch.Tensor
        Teacher weights, on the same device.

    Returns
    -------
    torch.Tensor
        Shape ``W.shape[:-2]``, float64. Gradients flow to ``W`` and ``W_teacher`` through
        the closed-form gradient (``torch.autograd.grad`` works; a second derivative does
        not: use :func:`~pyperm.teacher_student.hessian`).

    Raises
    ------
    TypeError
        An argument is not a floating-point tensor.
    ValueError
        A shape is wrong, the input dimensions or devices differ, an entry is not finite,
        or a teacher row is zero.

    References
    ----------
    Zhan, Li and Wu (2025), eqs. (3), (7) and (8); Cho and Saul (2009).

    Examples
    --------
    >>> import torch
    >>> from pyperm.teacher_student import population_loss, teacher_weights
    >>> Wt = teacher_weights(3)
    >>> float(population_loss(Wt[[2, 0, 1]], Wt))
    0.0
    """
    W = as_weights(W, "W")
    wt = as_teacher(W_teacher)
    check_pair(W, "W", wt)
    return _PopulationLoss.apply(W, wt)


def loss_unchecked(W: torch.Tensor, W_teacher: torch.Tensor) -> torch.Tensor:
    """:func:`population_loss` for arguments already checked (inner loops of the sweeps)."""
    return _PopulationLoss.apply(W, W_teacher)


def monte_carlo_loss(
    W: torch.Tensor,
    W_teacher: torch.Tensor,
    num_samples: int,
    seed: int,
    *,
    return_stderr: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""A Monte Carlo estimate of the population loss, to check :func:`population_loss` against.

    .. math::

        \hat L = \frac1N \sum_{i=1}^N \Big(\sum_j \sigma(w_j^\top x_i) - \sum_k \sigma(w_k^{*\top} x_i)\Big)^2,
        \qquad x_i \sim \mathcal N(0, I_d) \text{ i.i.d.},

    with standard error :math:`\hat s / \sqrt N` (:math:`\hat s` the sample standard deviation
    of the squared residuals). Differentiable through ``torch.relu``.

    Parameters
    ----------
    W : (..., m, d) torch.Tensor
        Student weights; a batch of students shares the same inputs.
    W_teacher : (K, d) torch.Tensor
        Teacher weights.
    num_samples : int
        Number of Gaussian inputs, at least 2.
    seed : int
        Seed of the ``torch.Generator`` (on ``W``'s device) that draws the inputs; the global
        random state is not touched. CPU and CUDA draw different inputs for the same seed.
    return_stderr : bool, default False
        Also return the standard error of the estimate.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        The estimate, shape ``W.shape[:-2]``, and with ``return_stderr`` its standard error.

    References
    ----------
    Zhan, Li and Wu (2025), eq. (3).
    """
    W = as_weights(W, "W")
    wt = as_teacher(W_teacher)
    check_pair(W, "W", wt)
    num_samples = check_int(num_samples, "num_samples", 2)
    gen = generator(_check_seed(seed), W.device)
    per_sample = max(1, W[..., 0, 0].numel() * (W.shape[-2] + wt.shape[0]))
    chunk = max(1, _MC_CHUNK_ENTRIES // per_sample)
    total = W.new_zeros(W.shape[:-2])
    total_sq = W.new_zeros(W.shape[:-2])
    for start in range(0, num_samples, chunk):
        x = torch.randn(min(chunk, num_samples - start), W.shape[-1], generator=gen, device=W.device, dtype=W.dtype)
        teacher_out = torch.relu(x @ wt.T).sum(dim=-1)
        student_out = torch.relu(x @ W.mT).sum(dim=-1)
        sq = (student_out - teacher_out).square()
        total = total + sq.sum(dim=-1)
        total_sq = total_sq + sq.square().sum(dim=-1)
    mean = total / num_samples
    if not return_stderr:
        return mean
    variance = (total_sq - num_samples * mean.square()).clamp_min(0.0) / (num_samples - 1)
    return mean, (variance / num_samples).sqrt()


def _check_seed(seed: object) -> int:
    seeds, is_sequence = seed_list(seed)
    if is_sequence:
        raise TypeError("seed must be one int for monte_carlo_loss")
    return seeds[0]
