r"""The loss barrier between two solutions against the student width (Zhan et al. 2025, Figures 2-4).

For each width :math:`m`, ``pairs`` independent pairs of solutions :math:`(W_A, W_B)` (uniform
samples from the manifold of minima, or GD solutions) give three barriers
(:func:`~pyperm.teacher_student.path_barrier`): *direct* (no permutation), *type* (B aligned by
the paper's Algorithm 1, defined for :math:`m \ge K`) and *LAP* (B aligned by an exact
assignment on the weights). The result holds every barrier and reports their means and
standard errors as a table and a plot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pyperm._checks import check_int, check_nonnegative_real, check_positive_int, check_positive_real
from pyperm._plotting import agg_figure, save_figure
from pyperm._progress import progress_bar
from pyperm._tables import markdown_table
from pyperm.teacher_student._checks import DTYPE, seed_list
from pyperm.teacher_student._report import mean_and_sem
from pyperm.teacher_student.barrier import barrier_from_losses, segment_losses
from pyperm.teacher_student.gd import descend, initial_weights
from pyperm.teacher_student.matching import lap_matching, type_matching
from pyperm.teacher_student.minima import sample_minimum, teacher_weights

__all__ = ["WidthSweep", "width_sweep"]

METHODS = ("direct", "type", "lap")
_LABELS = {"direct": "direct", "type": "type matching (Alg. 1)", "lap": "LAP matching"}
_COLORS = {"direct": "tab:blue", "type": "tab:orange", "lap": "tab:green"}
# A direct barrier below this is zero to rounding (e.g. m = 1, where GD finds one solution):
# no ratio is reported against it.
_NEGLIGIBLE = 1e-12


@dataclass
class WidthSweep:
    """The barriers of :func:`width_sweep`.

    Attributes
    ----------
    K, d : int
        Teacher neurons and input dimension.
    source : str
        ``"uniform"`` or ``"gd"``.
    widths : list of int
        The student widths, in the order given.
    barriers : dict of str to (len(widths), pairs) numpy.ndarray
        Every barrier, keyed by ``"direct"``, ``"type"`` and ``"lap"`` (NaN for type matching
        below ``m = K``, where neurons have no types).
    endpoint_loss : (len(widths),) numpy.ndarray
        Mean loss of the solutions (zero to rounding for uniform samples).
    converged, diverged, stationary : (len(widths),) numpy.ndarray
        Fraction of GD runs that converged (loss at most ``tol``), diverged, or stopped at a
        stationary point above ``tol`` (as below ``m = K``); 1, 0 and 0 for uniform samples.
    settings : dict
        The arguments that produced the sweep.
    """

    K: int
    d: int
    source: str
    widths: list[int]
    barriers: dict[str, np.ndarray]
    endpoint_loss: np.ndarray
    converged: np.ndarray
    diverged: np.ndarray
    stationary: np.ndarray
    settings: dict = field(default_factory=dict)

    def mean(self, method: str) -> np.ndarray:
        """Mean barrier per width for ``method`` in ``("direct", "type", "lap")``."""
        return np.array([mean_and_sem(row)[0] for row in self._rows(method)])

    def sem(self, method: str) -> np.ndarray:
        """Standard error of the mean barrier per width."""
        return np.array([mean_and_sem(row)[1] for row in self._rows(method)])

    def _rows(self, method: str) -> np.ndarray:
        if method not in self.barriers:
            raise ValueError(f"method must be one of {sorted(self.barriers)}, got {method!r}")
        return self.barriers[method]

    def rows(self) -> list[dict[str, float]]:
        """One dict per width: ``m``, ``<method>_mean`` and ``<method>_sem`` for every method, and the
        GD fractions (a table for pandas or csv)."""
        stats = {name: (self.mean(name), self.sem(name)) for name in METHODS}
        table = []
        for i, m in enumerate(self.widths):
            row: dict[str, float] = {"m": m}
            for name, (mean, sem) in stats.items():
                row[f"{name}_mean"], row[f"{name}_sem"] = float(mean[i]), float(sem[i])
            row["endpoint_loss"] = float(self.endpoint_loss[i])
            row["converged"], row["stationary"], row["diverged"] = (
                float(self.converged[i]),
                float(self.stationary[i]),
                float(self.diverged[i]),
            )
            table.append(row)
        return table

    def to_markdown(self) -> str:
        """One row per width: mean ± standard error of each barrier, and the permuted/direct ratios."""
        headers = ["m", "direct", "± se", "type", "± se", "LAP", "± se", "type/direct", "LAP/direct", "loss(ends)"]
        if self.source == "gd":
            headers += ["converged", "stationary", "diverged"]
        stats = {name: (self.mean(name), self.sem(name)) for name in METHODS}
        rows = []
        for i, m in enumerate(self.widths):
            direct = stats["direct"][0][i]
            row: list[object] = [m]
            for name in METHODS:
                row += [stats[name][0][i], stats[name][1][i]]
            row += [_ratio(stats["type"][0][i], direct), _ratio(stats["lap"][0][i], direct), self.endpoint_loss[i]]
            if self.source == "gd":
                row += [self.converged[i], self.stationary[i], self.diverged[i]]
            rows.append(row)
        return markdown_table(headers, rows)

    def __str__(self) -> str:
        pairs = self.settings.get("pairs")
        title = f"Barrier against width: K={self.K}, d={self.d}, {self.source} solutions, {pairs} pairs"
        return title + "\n\n" + self.to_markdown()

    def plot(self, path: str) -> str:
        """Write a PNG: all barriers, the permuted ones alone, and permuted / direct, against width."""
        fig = agg_figure(15.0, 4.2)
        every, permuted, ratio = fig.subplots(1, 3)
        widths = np.asarray(self.widths)
        direct = self.mean("direct")
        for name in METHODS:
            mean, sem = self.mean(name), self.sem(name)
            style = {"marker": "o", "ms": 3, "color": _COLORS[name], "label": _LABELS[name]}
            every.errorbar(widths, mean, yerr=sem, capsize=2, **style)
            if name != "direct":
                permuted.errorbar(widths, mean, yerr=sem, capsize=2, **style)
                ratio.plot(widths, [_ratio(a, b) for a, b in zip(mean, direct, strict=True)], **style)
        for ax in (every, permuted, ratio):
            ax.axvline(self.K, color="grey", lw=0.8, ls=":")
            ax.axvline(2 * self.K, color="grey", lw=0.8, ls="--")
            ax.set_xlabel("student width m (dotted: K, dashed: 2K)")
            ax.legend(fontsize=8)
        every.set_ylabel("loss barrier")
        every.set_title(f"K={self.K}, d={self.d}, {self.source} solutions")
        permuted.set_title("modulo permutation")
        ratio.set_ylabel("permuted barrier / direct barrier")
        ratio.set_title("normalised")
        fig.tight_layout()
        save_figure(fig, path)
        return path


def _ratio(num: float, den: float) -> float:
    return num / den if den > _NEGLIGIBLE and not math.isnan(num) else math.nan


def _check_widths(widths: object, K: int, source: str) -> list[int]:
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or len(widths) == 0:
        raise TypeError("widths must be a non-empty sequence of ints")
    checked = [check_positive_int(m, f"widths[{i}]") for i, m in enumerate(widths)]
    if source == "uniform" and min(checked) < K:
        raise ValueError(f"uniform samples need every width >= K = {K}, got widths with {min(checked)}")
    return checked


def _run_seeds(seed: int, m: int, count: int) -> list[int]:
    """Seeds of the runs at width m: independent across widths, reproducible from ``seed``."""
    return [int(s) for s in np.random.SeedSequence([seed, m]).generate_state(count)]


@dataclass
class _Solutions:
    weights: torch.Tensor
    converged: float = 1.0
    stationary: float = 0.0
    diverged: float = 0.0


def _uniform_solutions(wt: torch.Tensor, m: int, seeds: list[int]) -> _Solutions:
    return _Solutions(sample_minimum(wt, m, seed=seeds))


def _gd_solutions(wt: torch.Tensor, m: int, seeds: list[int], gd: dict) -> _Solutions:
    eta = gd["lr"] if gd["lr"] is not None else gd["c"] / m
    W0 = initial_weights(seeds, m, wt.shape[1], gd["init_scale"], wt.device)
    etas = torch.full((len(seeds),), eta, dtype=DTYPE, device=wt.device)
    out = descend(W0, wt, etas, gd["steps"], gd["tol"], gd["grad_tol"])
    fraction = {name: float(out[name].double().mean()) for name in ("converged", "stationary", "diverged")}
    return _Solutions(out["weights"], **fraction)


def _barriers_at_width(A: torch.Tensor, B: torch.Tensor, wt: torch.Tensor, num_points: int) -> dict[str, np.ndarray]:
    """Direct, type-matched and LAP-matched barriers of the pairs (A[i], B[i]), in one batch."""
    m = A.shape[-2]
    aligned = {"direct": B, "lap": torch.gather(B, 1, lap_matching(A, B)[..., None].expand_as(B))}
    if m >= wt.shape[0]:
        aligned["type"] = torch.gather(B, 1, type_matching(A, B, wt)[..., None].expand_as(B))
    names = list(aligned)
    ends_b = torch.stack([aligned[name] for name in names])
    t = torch.linspace(0.0, 1.0, num_points, dtype=A.dtype, device=A.device)
    with torch.no_grad():
        # Permuting B leaves its loss unchanged: the endpoints are evaluated once, not per method.
        end_losses = segment_losses(A, B, wt, t[[0, -1]])
        inner = segment_losses(A.expand_as(ends_b), ends_b, wt, t[1:-1])
        ends = end_losses.expand(len(names), *end_losses.shape)
        losses = torch.cat([ends[..., :1], inner, ends[..., 1:]], dim=-1)
    values = barrier_from_losses(t, losses).cpu().numpy()
    result = {name: values[i] for i, name in enumerate(names)}
    result.setdefault("type", np.full(A.shape[0], np.nan))
    result["ends"] = end_losses.cpu().numpy()
    return result


def width_sweep(
    K: int,
    widths: Sequence[int],
    *,
    source: str = "uniform",
    pairs: int = 30,
    seed: int = 0,
    d: int | None = None,
    num_points: int = 11,
    lr: float | None = None,
    c: float | None = 1.0,
    steps: int = 20000,
    init_scale: float = 1e-2,
    tol: float = 1e-6,
    grad_tol: float = 1e-9,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> WidthSweep:
    r"""Barriers between pairs of solutions, directly and modulo permutation, against width.

    For every width :math:`m`, draws ``2 * pairs`` solutions, pairs them up and computes

    .. math::

        B_{\text{direct}} = B(W_A, W_B), \quad
        B_{\text{type}} = B(W_A, \pi_{\text{type}} W_B), \quad
        B_{\text{LAP}} = B(W_A, \pi_{\text{LAP}} W_B)

    with :math:`B` the barrier of :func:`~pyperm.teacher_student.path_barrier` (exact loss),
    :math:`\pi_{\text{type}}` from :func:`~pyperm.teacher_student.type_matching` (only for
    :math:`m \ge K`) and :math:`\pi_{\text{LAP}}` from
    :func:`~pyperm.teacher_student.lap_matching`.

    Parameters
    ----------
    K : int
        Teacher neurons (the teacher is :func:`~pyperm.teacher_student.teacher_weights`).
    widths : sequence of int
        Student widths; at least ``K`` each for ``source="uniform"``.
    source : {"uniform", "gd"}, default "uniform"
        Uniform samples from the manifold of minima
        (:func:`~pyperm.teacher_student.sample_minimum`) or GD solutions (as
        :func:`~pyperm.teacher_student.train_gd`, all ``2 * pairs`` runs of a width batched).
    pairs : int, default 30
        Pairs of solutions per width (at least 2, for a standard error).
    seed : int, default 0
        Seeds every run: the runs at width ``m`` use seeds drawn from
        ``numpy.random.SeedSequence([seed, m])``.
    d : int, optional
        Input dimension (default ``2 * K``).
    num_points : int, default 11
        Points on each path (Zhan et al.: steps of 0.1).
    lr, c, steps, init_scale, tol, grad_tol
        GD settings (``source="gd"`` only): the step ``lr``, or ``c / m`` when ``lr`` is None
        (default ``c = 1``); as in :func:`~pyperm.teacher_student.train_gd`, except that the
        default ``tol`` is 1e-6 (GD approaches the degenerate minima only polynomially fast).
    device : torch.device or str, optional
        Where to compute (default: the CPU).
    progress : bool, default False
        Show a tqdm progress bar over the widths.

    Returns
    -------
    WidthSweep
        The barriers, with ``mean``/``sem`` per method, ``rows()``, ``to_markdown()`` and
        ``plot(path)``.

    Notes
    -----
    Cost: every path point is one exact loss, :math:`O((m + K)^2 d)`; the K = 5 sweep of 10
    widths up to 100 with 30 pairs evaluates about 26 000 of them. Measured on a shared
    2-core machine (load ~7, median of 3): 3.0 s with one torch thread, 4.0 s with two under
    ``OMP_WAIT_POLICY=PASSIVE``, 9.7 s with two under the default policy, whose spinning
    OpenMP workers compete with the work on a busy machine. GD sweeps cost what their
    ``2 * pairs`` runs per width cost (one batched run per width).

    References
    ----------
    Zhan, Li and Wu (2025), Sections 3-4, Figures 2-4 and Appendix B.1.
    """
    K = check_positive_int(K, "K")
    if source not in ("uniform", "gd"):
        raise ValueError(f"source must be 'uniform' or 'gd', got {source!r}")
    widths = _check_widths(widths, K, source)
    pairs = check_int(pairs, "pairs", 2)
    seeds_given, batched = seed_list(seed)
    if batched:
        raise TypeError("seed must be one int for width_sweep")
    seed = seeds_given[0]
    num_points = check_int(num_points, "num_points", 2)
    wt = teacher_weights(K, d, device=device)
    gd = _gd_settings(lr, c, steps, init_scale, tol, grad_tol) if source == "gd" else {}

    barriers = {name: np.empty((len(widths), pairs)) for name in METHODS}
    ends, converged, stationary, diverged = (np.empty(len(widths)) for _ in range(4))
    bar = progress_bar(progress, len(widths), f"width sweep ({source})", "width")
    for i, m in enumerate(widths):
        seeds = _run_seeds(seed, m, 2 * pairs)
        sols = _uniform_solutions(wt, m, seeds) if source == "uniform" else _gd_solutions(wt, m, seeds, gd)
        row = _barriers_at_width(sols.weights[:pairs], sols.weights[pairs:], wt, num_points)
        for name in METHODS:
            barriers[name][i] = row[name]
        ends[i] = float(np.mean(row["ends"]))
        converged[i], stationary[i], diverged[i] = sols.converged, sols.stationary, sols.diverged
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    settings = {"pairs": pairs, "seed": seed, "num_points": num_points, **gd}
    return WidthSweep(K, wt.shape[1], source, widths, barriers, ends, converged, diverged, stationary, settings)


def _gd_settings(lr: object, c: object, steps: object, init_scale: object, tol: object, grad_tol: object) -> dict:
    if lr is not None:
        lr, c = check_positive_real(lr, "lr"), None
    else:
        if c is None:
            raise ValueError("give lr or c for source='gd'")
        c = check_positive_real(c, "c")
    return {
        "lr": lr,
        "c": c,
        "steps": check_positive_int(steps, "steps"),
        "init_scale": check_positive_real(init_scale, "init_scale"),
        "tol": check_positive_real(tol, "tol"),
        "grad_tol": check_nonnegative_real(grad_tol, "grad_tol"),
    }
