"""Zhan, Li and Wu, "Analyzing the Role of Permutation Invariance in Linear Mode Connectivity" (2025), in its setting.

A two-layer ReLU teacher with ``K`` neurons and students of width ``m``, the exact population
loss (:mod:`pyperm.teacher_student`): the barrier between two solutions with and without
permutation against ``m``, for GD solutions and for uniform samples on the manifold of minima
(Figures 2-3), the double descent below and above ``K`` (Figure 4), and the PQ index of GD
solutions against the learning rate (Figures 5-6).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

TITLE = "Zhan et al. (2025): barrier modulo permutation against student width (GD and uniform minima), double descent, PQ index against learning rate"
OUTPUTS = ("report.md", "report.json", "width_uniform.png", "width_gd.png", "pq_index.png")

__all__ = ["OUTPUTS", "TITLE", "run"]

# K teacher neurons; GD width sweep (widths below K too), uniform sweep (widths >= K);
# learning-rate sweep at width lr_m over cs (step c / m).
SETTINGS = {
    "smoke": {
        "K": 2,
        "gd_widths": [1, 2, 3, 4, 6],
        "gd_pairs": 2,
        "steps": 600,
        "uniform_widths": [2, 3, 4, 6, 8, 16],
        "uniform_pairs": 6,
        "lr_m": 8,
        "cs": [0.5, 1.0, 2.0],
        "runs": 2,
    },
    "quick": {
        "K": 4,
        "gd_widths": [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32],
        "gd_pairs": 8,
        "steps": 5000,
        "uniform_widths": [4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 128],
        "uniform_pairs": 30,
        "lr_m": 16,
        "cs": [0.25, 0.5, 1.0, 1.5, 2.0, 2.25, 2.5, 2.75, 3.0],
        "runs": 8,
    },
    "full": {
        "K": 5,
        "gd_widths": [1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50],
        "gd_pairs": 10,
        "steps": 20000,
        "uniform_widths": [5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 75, 100, 150, 200],
        "uniform_pairs": 30,
        "lr_m": 20,
        "cs": [0.25, 0.5, 1.0, 1.5, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5],
        "runs": 10,
    },
}


def _findings(gd: Any, uniform: Any, lr: Any, K: int) -> list:
    from pyperm.reproduce._report import Finding

    findings = []
    # Fig. 2: permutation cuts the barrier, at every width from K on.
    ratios = []
    for sweep in (gd, uniform):
        direct, lap = sweep.mean("direct"), sweep.mean("lap")
        for i, m in enumerate(sweep.widths):
            if m >= K and direct[i] > 0:
                ratios.append(lap[i] / direct[i])
    worst = max(ratios) if ratios else math.nan
    findings.append(
        Finding(
            "Zhan et al. Fig. 2",
            "The barrier significantly decreases after the optimal permutation.",
            f"permuted/direct barrier at m >= K: at most {worst:.3f} (median {float(np.median(ratios)):.3f}) over GD and uniform widths",
            bool(worst < 0.5),
            "permuted (LAP) barrier < half the direct one at every width m >= K",
        )
    )
    # Fig. 2-3: permuted barrier rises, peaks, then falls towards zero (uniform minima).
    type_mean = uniform.mean("type")
    widths = uniform.widths
    peak = int(np.nanargmax(type_mean))
    rises_then_falls = 0 < peak < len(widths) - 1 and type_mean[-1] < 0.5 * type_mean[peak]
    findings.append(
        Finding(
            "Zhan et al. Fig. 2-3, Thm. 6",
            "With uniform minima the barrier after permutation first increases with m, peaks, then decreases to 0.",
            f"type-matched barrier {type_mean[0]:.2e} at m={widths[0]}, peak {type_mean[peak]:.2e} at m={widths[peak]} "
            f"(K={K}, 2K={2 * K}), {type_mean[-1]:.2e} at m={widths[-1]}",
            bool(rises_then_falls),
            "peak strictly inside the widths and the widest < half the peak",
        )
    )
    findings.append(
        Finding(
            "Zhan et al. Thm. 6 (peak position)",
            "The peak sits at a width fixed by K (the exact position is lost in our text copy of the paper; pyperm.teacher_student marks 2K).",
            f"peak at m={widths[peak]}, K={K}",
            bool(K < widths[peak] <= 3 * K),
            "K < peak width <= 3K",
        )
    )
    # Fig. 2: GD's sparser solutions give a slightly lower permuted barrier than uniform samples at large m.
    common = [m for m in gd.widths if m in widths and m >= 2 * K]
    if common:
        m = common[-1]
        g = float(gd.mean("lap")[gd.widths.index(m)])
        u = float(uniform.mean("lap")[widths.index(m)])
        findings.append(
            Finding(
                "Zhan et al. Fig. 2",
                "For relatively large m the permuted barrier of GD solutions is slightly smaller than of uniform samples.",
                f"m={m}: GD {g:.2e}, uniform {u:.2e}",
                bool(g < u - 1e-9),
                "GD permuted barrier < uniform permuted barrier at the widest common width >= 2K",
            )
        )
    # Fig. 4: double descent of GD solutions' permuted barrier across m = K.
    lap = gd.mean("lap")
    below = [(m, lap[i]) for i, m in enumerate(gd.widths) if m < K]
    at_k = float(lap[gd.widths.index(K)]) if K in gd.widths else math.nan
    above = [(m, lap[i]) for i, m in enumerate(gd.widths) if m > K]
    if below and above:
        # Differences below 1e-9 are rounding of barriers that are zero (exact minima).
        first = max(v for _, v in below) > at_k + 1e-9
        m_peak, v_peak = max(above, key=lambda mv: mv[1])
        second = v_peak > at_k + 1e-9 and above[-1][1] < v_peak - 1e-9
        findings.append(
            Finding(
                "Zhan et al. Fig. 4",
                "Double descent: the permuted barrier falls as m grows to K, rises to a peak above K, then falls again.",
                f"GD, LAP-matched: max {max(v for _, v in below):.2e} below K, {at_k:.2e} at m=K={K}, peak {v_peak:.2e} at m={m_peak}, "
                f"{above[-1][1]:.2e} at m={above[-1][0]}",
                bool(first and second),
                "max below K > value at K < peak above K > value at the widest",
            )
        )
    # Fig. 5-6: PQ index against the learning rate.
    pq = np.array([np.nanmean(row) if np.isfinite(row).any() else np.nan for row in lr.pq])
    ok = np.isfinite(pq)
    cs = lr.cs[ok]
    pq_ok = pq[ok]
    if len(pq_ok) >= 2:
        findings.append(
            Finding(
                "Zhan et al. Fig. 5-6",
                "GD solutions get sparser (higher PQ index) as the learning rate grows, sharply past a threshold.",
                f"m={lr.m}: PQI {pq_ok[0]:.3f} at c={cs[0]:g} -> {pq_ok[-1]:.3f} at c={cs[-1]:g} (largest c that did not diverge); "
                f"largest jump between neighbouring c: {float(np.max(np.diff(pq_ok))):.3f}",
                bool(pq_ok[-1] > pq_ok[0] and np.max(np.diff(pq_ok)) > 0.5 * (pq_ok[-1] - pq_ok[0])),
                "PQI rises from the smallest to the largest stable c, half of it in one step",
            )
        )
        findings.append(
            Finding(
                "Zhan et al. Fig. 5",
                "Uniformly sampled minima have the smallest PQI (least sparse).",
                f"uniform PQI {lr.uniform_pq:.3f}; GD PQI {float(np.min(pq_ok)):.3f} to {float(np.max(pq_ok)):.3f}",
                bool(lr.uniform_pq <= np.min(pq_ok)),
                "uniform PQI <= every GD PQI",
            )
        )
    return findings


def run(out: Path, scale: str, *, device: Any = "cpu", seed: int = 0, progress: bool = False) -> Path:
    """Run the width sweeps and the learning-rate sweep, write the report.

    Parameters
    ----------
    out : pathlib.Path
        An existing folder; :data:`OUTPUTS` are written into it.
    scale : {"smoke", "quick", "full"}
        The settings of :data:`SETTINGS`.
    device : str or torch.device
        Where to compute.
    seed : int
        Seeds every run.
    progress : bool
        Progress bars over the widths.

    Returns
    -------
    pathlib.Path
        ``out / "report.md"``.
    """
    from pyperm import teacher_student as ts
    from pyperm.reproduce._report import findings_section, settings_section, write_report

    cfg = SETTINGS[scale]
    K = cfg["K"]
    start = time.perf_counter()
    gd = ts.width_sweep(
        K,
        cfg["gd_widths"],
        source="gd",
        pairs=cfg["gd_pairs"],
        steps=cfg["steps"],
        seed=seed,
        device=device,
        progress=progress,
    )
    uniform = ts.width_sweep(
        K,
        cfg["uniform_widths"],
        source="uniform",
        pairs=cfg["uniform_pairs"],
        seed=seed,
        device=device,
        progress=progress,
    )
    lr = ts.learning_rate_sweep(
        K, cfg["lr_m"], cfg["cs"], runs=cfg["runs"], steps=cfg["steps"], seed=seed, device=device
    )
    findings = _findings(gd, uniform, lr, K)
    seconds = time.perf_counter() - start

    uniform.plot(str(out / "width_uniform.png"))
    gd.plot(str(out / "width_gd.png"))
    lr.plot(str(out / "pq_index.png"))
    settings = {
        "teacher": f"K={K} ReLU neurons w*_k = e_k in R^{2 * K}, output weights 1; exact population loss (arc-cosine kernel)",
        "GD": f"full-batch GD, step c/m with c=1, {cfg['steps']} steps at most, init N(0, 1e-4); widths {cfg['gd_widths']}, {cfg['gd_pairs']} pairs each",
        "uniform minima": f"widths {cfg['uniform_widths']}, {cfg['uniform_pairs']} pairs each",
        "matching": "type matching (Algorithm 1) and the optimal assignment (LAP) of neuron weights; barriers on 11 points",
        "learning rates": f"m={cfg['lr_m']}, c in {cfg['cs']}, {cfg['runs']} runs each",
    }
    scaled = [f"GD at most {cfg['steps']} steps (paper: until convergence)"] if cfg["steps"] < 20000 else []
    if scale != "full":
        scaled.append(f"`--{scale}`: K={K}, fewer widths and pairs than the default (K=5, 10-30 pairs)")
    lines = [
        "# Zhan, Li and Wu (2025): linear mode connectivity modulo permutation, teacher-student",
        "",
        TITLE + ".",
        "",
        findings_section(findings),
        "",
        "## Barrier against width: uniform samples on the minima (Fig. 2-3)",
        "",
        "![uniform](width_uniform.png)",
        "",
        uniform.to_markdown(),
        "",
        "## Barrier against width: GD solutions, below and above K (Fig. 2 and 4)",
        "",
        "![gd](width_gd.png)",
        "",
        gd.to_markdown(),
        "",
        "## PQ index against the learning rate (Fig. 5-6)",
        "",
        "![pq](pq_index.png)",
        "",
        lr.to_markdown(),
        "",
        settings_section(scale, settings, scaled, seconds, device),
    ]

    def sweep_dict(s: Any) -> dict:
        return {"widths": s.widths, **{m: [float(v) for v in s.mean(m)] for m in ("direct", "type", "lap")}}

    return write_report(
        out,
        "teacher-student",
        lines,
        findings,
        scale=scale,
        seed=seed,
        seconds=seconds,
        settings=cfg,
        gd=sweep_dict(gd),
        uniform=sweep_dict(uniform),
        learning_rate={
            "m": lr.m,
            "cs": [float(c) for c in lr.cs],
            "pq": [float(np.nanmean(r)) if np.isfinite(r).any() else math.nan for r in lr.pq],  # NaN: null in json
            "uniform_pq": lr.uniform_pq,
        },
    )
