r"""Sparsity of GD solutions against the learning rate (Zhan et al. 2025, Section 5, Figures 5-6).

GD with step :math:`\eta = c / m` from one set of initialisations, for several :math:`c`; for
each, the PQ index of the solutions' neuron norms, the fraction of (nearly) zero neurons, and
the sharpness :math:`\lambda_{\max}(\nabla^2 L)` of the solution next to the edge of stability
:math:`2 / \eta`, beyond which GD cannot settle. Every (c, run) pair is one run of one batched
GD (:func:`~pyperm.teacher_student.train_gd`'s loop with a step size per run).

At an exact minimum the Hessian is the Gauss-Newton matrix, which depends only on how many
neurons each type has (not on their norms). Past the edge of stability GD ends near minima
with near-zero neurons, and off the exact manifold the curvature term of such a neuron grows
like :math:`1 / \lVert w_j\rVert`; so the sharpness measured at a solution that stopped at a
loss of ``tol`` can exceed :math:`2 / \eta` there (seen for K = 5, m = 20, c >= 2.9), while
the Gauss-Newton sharpness, also recorded, sits at :math:`2 / \eta`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pyperm._checks import check_int, check_nonnegative_real, check_positive_int, check_positive_real
from pyperm._plotting import agg_figure, save_figure
from pyperm._tables import markdown_table
from pyperm.teacher_student._checks import DTYPE, seed_list
from pyperm.teacher_student._report import mean_and_sem
from pyperm.teacher_student.curvature import hessian_unchecked
from pyperm.teacher_student.gd import descend, initial_weights
from pyperm.teacher_student.minima import sample_minimum, teacher_weights
from pyperm.teacher_student.sparsity import pq_index

__all__ = ["LearningRateSweep", "learning_rate_sweep"]


@dataclass
class LearningRateSweep:
    """What :func:`learning_rate_sweep` returns (one entry per ``c``; NaN where every run diverged).

    Attributes
    ----------
    K, d, m : int
        Teacher neurons, input dimension, student width.
    cs : (C,) numpy.ndarray
        The width-scaled learning rates; the step is ``cs / m``.
    pq : (C, runs) numpy.ndarray
        PQ index (p=1, q=2) of each solution's neuron norms (NaN for a diverged run).
    small_neurons : (C, runs) numpy.ndarray
        Fraction of each solution's neurons with norm below ``small``.
    sharpness : (C, runs) numpy.ndarray
        Largest Hessian eigenvalue of the exact loss at each solution.
    gn_sharpness : (C, runs) numpy.ndarray
        Largest eigenvalue of the Gauss-Newton matrix at each solution.
    loss, converged, diverged : (C, runs) numpy.ndarray
        Final loss and flags of each run.
    uniform_pq : float
        Mean PQ index of as many uniform samples of the minima (the paper's baseline).
    settings : dict
        The arguments of the sweep.
    """

    K: int
    d: int
    m: int
    cs: np.ndarray
    pq: np.ndarray
    small_neurons: np.ndarray
    sharpness: np.ndarray
    gn_sharpness: np.ndarray
    loss: np.ndarray
    converged: np.ndarray
    diverged: np.ndarray
    uniform_pq: float
    settings: dict = field(default_factory=dict)

    def to_markdown(self) -> str:
        """One row per ``c``: step, edge of stability 2/step, PQ index, small neurons, sharpness, flags."""
        headers = [
            "c",
            "lr",
            "2/lr",
            "PQI",
            "± se",
            "small neurons",
            "sharpness",
            "± se",
            "GN sharpness",
            "loss",
            "converged",
            "diverged",
        ]
        rows = []
        for i, c in enumerate(self.cs):
            pq, pq_se = _finite_stats(self.pq[i])
            sharp, sharp_se = _finite_stats(self.sharpness[i])
            lr = c / self.m
            rows.append(
                [
                    float(c),
                    lr,
                    2 / lr,
                    pq,
                    pq_se,
                    _finite_stats(self.small_neurons[i])[0],
                    sharp,
                    sharp_se,
                    _finite_stats(self.gn_sharpness[i])[0],
                    _finite_stats(self.loss[i])[0],
                    float(self.converged[i].mean()),
                    float(self.diverged[i].mean()),
                ]
            )
        return markdown_table(headers, rows)

    def __str__(self) -> str:
        title = (
            f"PQ index of GD solutions against the learning rate c/m: K={self.K}, d={self.d}, m={self.m}, "
            f"{self.pq.shape[1]} runs per c (uniform samples: PQI {self.uniform_pq:.3g})"
        )
        return title + "\n\n" + self.to_markdown()

    def plot(self, path: str) -> str:
        """Write a PNG: PQ index against c (left), sharpnesses and the edge of stability 2m/c (right)."""
        fig = agg_figure(11.0, 4.2)
        left, right = fig.subplots(1, 2)
        pq = np.array([_finite_stats(row) for row in self.pq])
        sharp = np.array([_finite_stats(row) for row in self.sharpness])
        left.errorbar(self.cs, pq[:, 0], yerr=pq[:, 1], marker="o", ms=3, capsize=2, label="GD solutions")
        left.axhline(self.uniform_pq, color="grey", ls="--", lw=0.8, label="uniform samples")
        left.set_ylabel("PQ index of neuron norms (p=1, q=2)")
        gn = np.array([_finite_stats(row) for row in self.gn_sharpness])
        right.errorbar(self.cs, sharp[:, 0], yerr=sharp[:, 1], marker="o", ms=3, capsize=2, label="sharpness")
        right.errorbar(self.cs, gn[:, 0], yerr=gn[:, 1], marker="s", ms=3, capsize=2, label="Gauss-Newton sharpness")
        right.plot(self.cs, 2 * self.m / self.cs, color="black", lw=0.8, label="2 / lr (edge of stability)")
        right.set_yscale("log")
        right.set_ylabel("largest Hessian eigenvalue")
        for ax in (left, right):
            ax.set_xscale("log")
            ax.set_xlabel("c (learning rate c / m)")
            ax.legend(fontsize=8)
        left.set_title(f"K={self.K}, d={self.d}, m={self.m}")
        fig.tight_layout()
        save_figure(fig, path)
        return path


def _finite_stats(values: np.ndarray) -> tuple[float, float]:
    values = np.asarray(values, dtype=np.float64)
    return mean_and_sem(values[np.isfinite(values)])


def learning_rate_sweep(
    K: int,
    m: int,
    cs: Sequence[float],
    *,
    runs: int = 10,
    seed: int = 0,
    d: int | None = None,
    steps: int = 20000,
    init_scale: float = 1e-2,
    tol: float = 1e-6,
    grad_tol: float = 1e-9,
    small: float = 1e-3,
    device: torch.device | str | None = None,
) -> LearningRateSweep:
    r"""Sparsity and sharpness of GD solutions for several learning rates :math:`c / m`.

    For each :math:`c` and each of ``runs`` initialisations (the same for every :math:`c`),
    GD on the exact loss with :math:`\eta = c / m`; then

    .. math::

        \mathrm{PQI}(W) = 1 - m^{-1/2} \frac{\sum_j \lVert w_j\rVert}{\big(\sum_j \lVert w_j\rVert^2\big)^{1/2}},
        \qquad \lambda_{\max}\big(\nabla^2 L(W)\big) \text{ against } 2 / \eta.

    Parameters
    ----------
    K, m : int
        Teacher neurons and student width.
    cs : sequence of float
        Width-scaled learning rates (positive).
    runs : int, default 10
        Initialisations per learning rate (at least 2).
    seed : int, default 0
        Seeds the initialisations (``numpy.random.SeedSequence([seed, m])``) and the uniform
        baseline.
    d : int, optional
        Input dimension (default ``2 * K``).
    steps, init_scale, tol, grad_tol
        As in :func:`~pyperm.teacher_student.train_gd` (default ``tol`` 1e-6).
    small : float, default 1e-3
        Norm below which a neuron counts as zero.
    device : torch.device or str, optional
        Where to compute (default: the CPU).

    Returns
    -------
    LearningRateSweep
        Per-run values, ``to_markdown()`` and ``plot(path)``.

    References
    ----------
    Zhan, Li and Wu (2025), Section 5, Figures 5 and 6.
    """
    K, m = check_positive_int(K, "K"), check_positive_int(m, "m")
    cs = _check_cs(cs)
    runs = check_int(runs, "runs", 2)
    seeds, batched = seed_list(seed)
    if batched:
        raise TypeError("seed must be one int for learning_rate_sweep")
    small = check_positive_real(small, "small")
    wt = teacher_weights(K, d, device=device)
    run_seeds = [int(s) for s in np.random.SeedSequence([seeds[0], m]).generate_state(runs)]

    W0 = initial_weights(run_seeds, m, wt.shape[1], check_positive_real(init_scale, "init_scale"), wt.device)
    etas = torch.tensor(np.repeat(cs / m, runs), dtype=DTYPE, device=wt.device)
    out = descend(
        W0.repeat(len(cs), 1, 1),
        wt,
        etas,
        check_positive_int(steps, "steps"),
        check_positive_real(tol, "tol"),
        check_nonnegative_real(grad_tol, "grad_tol"),
    )
    W, ok = out["weights"], ~out["diverged"]

    def per_c(values: torch.Tensor) -> np.ndarray:
        values = torch.where(ok, values, torch.nan)
        return values.reshape(len(cs), runs).cpu().numpy()

    safe = torch.where(ok[:, None, None], W, 1.0)  # diverged runs: placeholders, masked above
    norms = torch.linalg.vector_norm(safe, dim=-1)
    sharp = torch.linalg.eigvalsh(hessian_unchecked(safe, wt))[..., -1]
    gn_sharp = torch.linalg.eigvalsh(hessian_unchecked(safe, wt, gauss_newton=True))[..., -1]
    uniform = pq_index(sample_minimum(wt, m, seed=list(range(runs)))).mean() if m >= K else torch.tensor(np.nan)
    return LearningRateSweep(
        K,
        wt.shape[1],
        m,
        cs,
        pq=per_c(pq_index(safe)),
        small_neurons=per_c((norms < small).to(DTYPE).mean(dim=-1)),
        sharpness=per_c(sharp),
        gn_sharpness=per_c(gn_sharp),
        loss=per_c(out["loss"]),
        converged=out["converged"].reshape(len(cs), runs).cpu().numpy(),
        diverged=out["diverged"].reshape(len(cs), runs).cpu().numpy(),
        uniform_pq=float(uniform),
        settings={"runs": runs, "seed": seeds[0], "steps": steps, "init_scale": init_scale, "tol": tol},
    )


def _check_cs(cs: object) -> np.ndarray:
    if isinstance(cs, (str, bytes)) or not isinstance(cs, Sequence) or len(cs) == 0:
        raise TypeError("cs must be a non-empty sequence of positive numbers")
    return np.array([check_positive_real(c, f"cs[{i}]") for i, c in enumerate(cs)])
