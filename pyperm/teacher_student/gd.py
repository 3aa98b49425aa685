r"""Full-batch gradient descent on the exact population loss, many seeds on one tensor.

.. math::

    W^{(0)}_{jk} \sim \mathcal N(0, \sigma^2) \text{ i.i.d.}, \qquad
    W^{(t+1)} = W^{(t)} - \eta\, \nabla L\big(W^{(t)}\big), \qquad \eta = c / m
    \text{ when } c \text{ is given},

with the closed-form gradient of :mod:`pyperm.teacher_student.loss` (no sampling: this is
gradient descent on the population loss, the paper's GD). Runs with different seeds are
stacked on a leading dimension and advance together, one batched gradient per step; each has
its own generator and stops on its own (converged or diverged) by being frozen, so a run's
trajectory does not depend on the other runs of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyperm._checks import check_nonnegative_real, check_positive_int, check_positive_real
from pyperm._progress import progress_bar
from pyperm.teacher_student._checks import DTYPE, as_teacher, generator, seed_list
from pyperm.teacher_student.loss import signed_stack, stack_loss_and_grad

__all__ = ["GDResult", "train_gd"]

# A run whose loss exceeds this multiple of the larger of its initial loss and L(0) diverged.
_DIVERGENCE_FACTOR = 1e4
# Steps between checks of the stopping flags (each check is a host-device sync on a GPU).
_CHECK_EVERY = 25


@dataclass(frozen=True)
class GDResult:
    """What :func:`train_gd` returns.

    Attributes
    ----------
    weights : (m, d) or (R, m, d) torch.Tensor
        Final weights (the weights at which a run stopped); ``(R, m, d)`` when ``seed`` was a
        sequence of ``R`` seeds.
    loss : () or (R,) torch.Tensor
        The exact loss at ``weights``.
    converged : () or (R,) torch.Tensor
        bool: the loss reached ``tol``.
    diverged : () or (R,) torch.Tensor
        bool: the loss became non-finite or exceeded ``1e4`` times the larger of its initial
        value and the loss of the zero student (the run was frozen there).
    stationary : () or (R,) torch.Tensor
        bool: the run stopped at a point whose gradient norm is at most ``grad_tol`` without
        reaching ``tol`` (a minimum of a student narrower than the teacher, or a saddle).
    steps : () or (R,) torch.Tensor
        int64: gradient steps taken by each run.
    lr : float
        The step size used.
    seeds : tuple of int
        The seeds, in the order of the runs.
    """

    weights: torch.Tensor
    loss: torch.Tensor
    converged: torch.Tensor
    diverged: torch.Tensor
    stationary: torch.Tensor
    steps: torch.Tensor
    lr: float
    seeds: tuple[int, ...]


def _step_size(lr: object, c: object, m: int) -> float:
    if (lr is None) == (c is None):
        raise ValueError("give exactly one of lr (the step) and c (the step is c / m)")
    if lr is not None:
        return check_positive_real(lr, "lr")
    return check_positive_real(c, "c") / m


def initial_weights(seeds: list[int], m: int, d: int, scale: float, device: torch.device) -> torch.Tensor:
    runs = [torch.randn(m, d, generator=generator(s, device), dtype=DTYPE, device=device) for s in seeds]
    return torch.stack(runs) * scale


def train_gd(
    W_teacher: torch.Tensor,
    m: int,
    *,
    lr: float | None = None,
    c: float | None = None,
    steps: int = 20000,
    init_scale: float = 1e-2,
    seed: int | list[int] = 0,
    tol: float = 1e-8,
    grad_tol: float = 1e-9,
    progress: bool = False,
) -> GDResult:
    r"""Train students by full-batch gradient descent on the exact population loss.

    .. math::

        W^{(t+1)} = W^{(t)} - \eta \nabla L\big(W^{(t)}\big), \qquad
        W^{(0)}_{jk} \sim \mathcal N(0, \sigma^2), \qquad \eta = c / m \text{ if } c \text{ is given}.

    Parameters
    ----------
    W_teacher : (K, d) torch.Tensor
        Teacher weights; the students live on its device.
    m : int
        Student width (any ``m >= 1``; below ``K`` no run reaches zero loss).
    lr : float, optional
        Step size :math:`\eta`. Give exactly one of ``lr`` and ``c``.
    c : float, optional
        Width-scaled step: :math:`\eta = c / m` (Zhan et al. 2025, Section 5).
    steps : int, default 20000
        Maximum number of gradient steps.
    init_scale : float, default 1e-2
        Standard deviation :math:`\sigma` of the Gaussian initialisation (Zhan et al. 2025, B.1).
    seed : int or sequence of int, default 0
        One seed per run. A sequence of ``R`` seeds trains ``R`` runs at once on one
        ``(R, m, d)`` tensor; run ``r`` equals the single run with ``seed=seeds[r]``.
    tol : float, default 1e-8
        A run has converged, and stops, once its loss is at most ``tol``.
    grad_tol : float, default 1e-9
        A run also stops once the norm of its gradient is at most ``grad_tol`` (0 disables
        this): below ``m = K`` the loss cannot reach ``tol``.
    progress : bool, default False
        Show a tqdm progress bar over the steps.

    Returns
    -------
    GDResult
        ``weights``, ``loss``, ``converged``, ``diverged``, ``stationary``, ``steps``, ``lr``,
        ``seeds``.

    Raises
    ------
    TypeError, ValueError
        A bad teacher, ``m < 1``, both or neither of ``lr`` and ``c``, non-positive
        ``steps``, ``init_scale``, ``lr``, ``c`` or ``tol``, or a bad seed.

    References
    ----------
    Zhan, Li and Wu (2025), Section 4 (GD solutions), Section 5 (learning rate ``c / m``) and Appendix B.1.
    """
    wt = as_teacher(W_teacher).detach()
    m = check_positive_int(m, "m")
    eta = _step_size(lr, c, m)
    steps = check_positive_int(steps, "steps")
    scale = check_positive_real(init_scale, "init_scale")
    tol = check_positive_real(tol, "tol")
    grad_tol = check_nonnegative_real(grad_tol, "grad_tol")
    seeds, batched = seed_list(seed)

    W = initial_weights(seeds, m, wt.shape[1], scale, wt.device)
    etas = torch.full((len(seeds),), eta, dtype=DTYPE, device=wt.device)
    out = descend(W, wt, etas, steps, tol, grad_tol, progress)
    if not batched:
        out = {name: value[0] for name, value in out.items()}
    return GDResult(lr=eta, seeds=tuple(seeds), **out)


def descend(
    W: torch.Tensor,
    wt: torch.Tensor,
    etas: torch.Tensor,
    steps: int,
    tol: float,
    grad_tol: float,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """The GD loop on a batch ``(R, m, d)`` with one step size per run.

    A run that stops (converged, stationary or diverged) takes zero steps from then on, and at
    the next check it is written to the output and dropped from the working batch, so the
    runs still moving do not pay for the finished ones. Returns the tensor fields of
    :class:`GDResult`, by name.
    """
    m = W.shape[1]
    out_w, out_loss, out_grad = W.clone(), W.new_empty(W.shape[0]), W.new_empty(W.shape[0])
    taken = torch.zeros(W.shape[0], dtype=torch.int64, device=W.device)
    runs = torch.arange(W.shape[0], device=W.device)  # which output row each working row is
    loss, grad = stack_loss_and_grad(*signed_stack(W, wt))
    zero_loss = stack_loss_and_grad(*signed_stack(torch.zeros_like(W[:1]), wt))[0][0]
    ceiling_all = _DIVERGENCE_FACTOR * torch.maximum(loss, zero_loss)
    ceiling = ceiling_all
    moving = torch.ones(W.shape[0], dtype=torch.bool, device=W.device)
    bar = progress_bar(progress, steps, "gradient descent", "step")
    for step in range(steps + 1):
        grad_norm = _grad_norm(grad, m)
        moving &= torch.isfinite(loss) & (loss <= ceiling) & (loss > tol) & (grad_norm > grad_tol)
        if step == steps:
            moving = torch.zeros_like(moving)
        if step == steps or step % _CHECK_EVERY == 0:
            # The only host-device sync of the loop: retire the runs that stopped.
            stopped = ~moving
            if bool(stopped.any()):
                done = runs[stopped]
                out_w[done], out_loss[done], out_grad[done] = W[stopped], loss[stopped], grad_norm[stopped]
                W, loss, grad, etas, ceiling, runs, moving = (
                    x[moving] for x in (W, loss, grad, etas, ceiling, runs, moving)
                )
            if runs.numel() == 0:
                break
        W = W - (etas * moving)[:, None, None] * grad[:, :m, :]
        taken.index_add_(0, runs, moving.to(torch.int64))
        loss, grad = stack_loss_and_grad(*signed_stack(W, wt))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    converged = out_loss <= tol
    diverged = ~torch.isfinite(out_loss) | (out_loss > ceiling_all)
    stationary = ~converged & ~diverged & (out_grad <= grad_tol)
    return {
        "weights": out_w,
        "loss": out_loss,
        "converged": converged,
        "diverged": diverged,
        "stationary": stationary,
        "steps": taken,
    }


def _grad_norm(grad: torch.Tensor, m: int) -> torch.Tensor:
    """Norm of each run's gradient with respect to the student (the stack also holds the teacher)."""
    return torch.linalg.vector_norm(grad[:, :m, :].reshape(grad.shape[0], -1), dim=-1)
