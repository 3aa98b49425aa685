"""Git Re-Basin (Ainsworth et al., ICLR 2023) Figures 2 and 4 with MLPs on scikit-learn's digits.

Figure 2: the loss and accuracy along the linear path between two independently trained MLPs,
naively and after weight matching, activation matching and STE matching. Figure 4: the loss
barrier after weight matching against the width of the models (the paper's Figure 4 uses VGG16
and ResNet20 on CIFAR-10; here MLPs on digits, so that it runs on a laptop).
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any

TITLE = "Git Re-Basin Fig. 2 (naive, weight, activation and STE paths) and Fig. 4 (barrier vs width), MLPs on digits"
OUTPUTS = ("report.md", "report.json", "fig2_test.png", "fig2_train.png", "fig4_width.png")

__all__ = ["OUTPUTS", "TITLE", "run"]

logger = logging.getLogger(__name__)

# Per scale: Figure 2's hidden width and depth, training epochs, STE epochs, points per path,
# and Figure 4's hidden widths and the pairs of models per width.
SETTINGS = {
    "smoke": {"width": 32, "depth": 2, "epochs": 10, "ste_epochs": 1, "points": 5, "widths": [4, 32], "pairs": 1},
    "quick": {
        "width": 512,
        "depth": 3,
        "epochs": 30,
        "ste_epochs": 5,
        "points": 11,
        "widths": [4, 8, 16, 32, 64, 128, 256, 512],
        "pairs": 2,
    },
    "full": {
        "width": 512,
        "depth": 3,
        "epochs": 60,
        "ste_epochs": 10,
        "points": 21,
        "widths": [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
        "pairs": 3,
    },
}
BATCH = 64  # training batch size
STE_BATCH = 128  # STE matching's batches: one projection per batch, so more steps per epoch than EVAL_BATCH gives
EVAL_BATCH = 512


def _mlp(width: int, depth: int) -> Any:
    from pyperm.nn.models import create_model

    return create_model("mlp:" + ",".join(map(str, [64] + [width] * depth + [10])))


def _pair(
    width: int, depth: int, epochs: int, seeds: tuple[int, int], data: dict, device: Any
) -> tuple[Any, dict, dict]:
    """Two MLPs trained from different seeds (initialisation and batch order)."""
    from pyperm.nn._training import train_classifier
    from pyperm.reproduce._train import SGD_COSINE

    model = _mlp(width, depth).to(device)
    train = (data["x_train"], data["y_train"])
    states = [
        train_classifier(model, train, batch_size=BATCH, epochs=epochs, seed=s, **SGD_COSINE) for s in seeds
    ]
    return model, states[0], states[1]


def _figure2(cfg: dict, data: dict, device: Any, seed: int, progress: bool) -> dict[str, Any]:
    """The four paths between one pair of models, on the test and the training split."""
    from pyperm import nn as pnn

    model, state_a, state_b = _pair(
        cfg["width"], cfg["depth"], cfg["epochs"], (2 * seed + 1, 2 * seed + 2), data, device
    )
    spec = model.permutation_spec()
    perms: dict[str, Any] = {}
    seconds: dict[str, float] = {}

    t = time.perf_counter()
    perms["weight"] = pnn.weight_matching(spec, state_a, state_b, seed=seed).perms
    seconds["weight"] = time.perf_counter() - t

    model_a, model_b = _mlp(cfg["width"], cfg["depth"]).to(device), _mlp(cfg["width"], cfg["depth"]).to(device)
    model_a.load_state_dict(state_a)
    model_b.load_state_dict(state_b)
    t = time.perf_counter()
    perms["activation"] = pnn.activation_matching(model_a, model_b, spec, data["train"]).perms
    seconds["activation"] = time.perf_counter() - t

    t = time.perf_counter()
    ste = pnn.ste_matching(
        model, spec, state_a, state_b, data["ste"], epochs=cfg["ste_epochs"], lr=1e-3, seed=seed, progress=progress
    )
    perms["ste"] = ste.perms
    seconds["ste"] = time.perf_counter() - t

    paths = {"naive": state_b} | {m: pnn.apply_permutation(spec, p, state_b) for m, p in perms.items()}
    results = {}
    for split in ("test", "train"):
        results[split] = {
            label: pnn.barrier(model, state_a, sb, data[split], num_points=cfg["points"]) for label, sb in paths.items()
        }
    return {"results": results, "seconds": seconds, "ste_steps": ste.iterations}


def _figure4(cfg: dict, data: dict, device: Any, seed: int, progress: bool) -> dict[str, Any]:
    """Naive and weight-matched test loss barriers against hidden width (mean over pairs)."""
    from pyperm import nn as pnn

    rows = []
    widths = cfg["widths"]
    bar = _bar(progress, len(widths) * cfg["pairs"], "Fig. 4 widths")
    for width in widths:
        naive, matched, acc_naive, acc_matched = [], [], [], []
        for pair in range(cfg["pairs"]):
            seeds = (1000 + 2 * pair + 100 * seed, 1001 + 2 * pair + 100 * seed)
            model, sa, sb = _pair(width, cfg["depth"], cfg["epochs"], seeds, data, device)
            spec = model.permutation_spec()
            pb = pnn.apply_permutation(spec, pnn.weight_matching(spec, sa, sb, seed=seed).perms, sb)
            r_naive = pnn.barrier(model, sa, sb, data["test"], num_points=cfg["points"])
            r_matched = pnn.barrier(model, sa, pb, data["test"], num_points=cfg["points"])
            naive.append(r_naive.loss_barrier)
            matched.append(r_matched.loss_barrier)
            acc_naive.append(r_naive.accuracy_barrier)
            acc_matched.append(r_matched.accuracy_barrier)
            if bar is not None:
                bar.update(1)
        n = len(naive)
        rows.append(
            {
                "width": width,
                "naive_loss_barrier": sum(naive) / n,
                "weight_matching_loss_barrier": sum(matched) / n,
                "naive_accuracy_barrier": sum(acc_naive) / n,
                "weight_matching_accuracy_barrier": sum(acc_matched) / n,
                "pairs": n,
            }
        )
    if bar is not None:
        bar.close()
    return {"rows": rows}


def _bar(enabled: bool, total: int, desc: str) -> Any:
    from pyperm._progress import progress_bar

    return progress_bar(enabled, total, desc, "model pairs")


def _findings(fig2: dict, fig4: dict) -> list:
    from pyperm.reproduce._report import Finding

    test = fig2["results"]["test"]
    b = {label: r.loss_barrier for label, r in test.items()}
    methods = ("weight", "activation", "ste")
    findings = [
        Finding(
            "Git Re-Basin Fig. 2",
            "Naive interpolation substantially degrades performance (a loss barrier).",
            f"naive test loss barrier {b['naive']:.3f}, accuracy barrier {100 * test['naive'].accuracy_barrier:.1f} pp",
            b["naive"] > 0.05,
            "naive loss barrier > 0.05",
        ),
        Finding(
            "Git Re-Basin Fig. 2",
            "Weight, activation and STE matching all achieve much better barriers than naive interpolation.",
            ", ".join(f"{m} {b[m]:.3f}" for m in methods),
            all(b[m] < 0.5 * b["naive"] for m in methods),
            "each matched barrier < half the naive one",
        ),
        Finding(
            "Git Re-Basin Fig. 2, sec. 5.1",
            "Zero-barrier linear mode connectivity on MNIST MLPs with all three methods.",
            ", ".join(f"{m} {b[m]:.3f}" for m in methods),
            all(b[m] < 0.05 for m in methods),
            "each matched test loss barrier < 0.05",
        ),
        Finding(
            "Git Re-Basin sec. 5.1",
            "Activation matching performs slightly less favourably than weight and STE matching.",
            f"activation {b['activation']:.3f} vs weight {b['weight']:.3f}, STE {b['ste']:.3f}",
            b["activation"] >= min(b["weight"], b["ste"]),
            "activation barrier >= the lower of weight and STE",
        ),
        Finding(
            "Git Re-Basin Fig. 2",
            "STE matching performs best but is very computationally expensive; weight matching is orders of magnitude faster.",
            f"STE barrier {b['ste']:.3f} in {fig2['seconds']['ste']:.2f} s; weight {b['weight']:.3f} in {fig2['seconds']['weight']:.3f} s "
            f"({fig2['seconds']['ste'] / max(fig2['seconds']['weight'], 1e-9):.0f}x faster)",
            b["ste"] <= min(b["weight"], b["activation"]) + 1e-3
            and fig2["seconds"]["ste"] > 10 * fig2["seconds"]["weight"],
            "STE barrier lowest (within 1e-3) and STE > 10x weight matching's time",
        ),
    ]
    for m in ("weight", "ste"):
        r = test[m]
        mid = len(r.ts) // 2
        chord = 0.5 * (r.loss[0] + r.loss[-1])
        findings.append(
            Finding(
                "Git Re-Basin sec. 5.1",
                f"After {m} matching the test loss landscape becomes convex: the midpoint beats the endpoints.",
                f"{m}: midpoint test loss {r.loss[mid]:.4f} vs endpoints' mean {chord:.4f}",
                bool(r.loss[mid] < chord),
                "midpoint test loss < mean of the endpoints' test losses",
            )
        )
    rows = fig4["rows"]
    matched = [r["weight_matching_loss_barrier"] for r in rows]
    drops = sum(later <= earlier + 1e-3 for earlier, later in itertools.pairwise(matched))
    findings.append(
        Finding(
            "Git Re-Basin Fig. 4",
            "Wider models exhibit better linear mode connectivity: the barrier after weight matching falls with width, towards zero.",
            f"weight-matched barrier {matched[0]:.3f} at width {rows[0]['width']} -> {matched[-1]:.3f} at width {rows[-1]['width']}; "
            f"non-increasing in {drops} of {len(matched) - 1} steps",
            matched[-1] < matched[0] and drops >= (len(matched) - 1) / 2,
            "barrier at the widest < at the narrowest, and non-increasing in at least half the steps",
        )
    )
    findings.append(
        Finding(
            "Git Re-Basin Fig. 4",
            "Thin (1x) models do not seem to exhibit linear mode connectivity even after matching.",
            f"weight-matched barrier {matched[0]:.3f} at width {rows[0]['width']}",
            matched[0] > 0.05,
            "barrier at the narrowest width > 0.05",
        )
    )
    return findings


def run(out: Path, scale: str, *, device: Any = "cpu", seed: int = 0, progress: bool = False) -> Path:
    """Train the MLPs, evaluate the paths and the width sweep, write the report.

    Parameters
    ----------
    out : pathlib.Path
        An existing folder; :data:`OUTPUTS` are written into it.
    scale : {"smoke", "quick", "full"}
        The settings of :data:`SETTINGS`.
    device : str or torch.device
        Where to train and evaluate.
    seed : int
        Offsets every training seed and seeds the matchings.
    progress : bool
        Progress bars.

    Returns
    -------
    pathlib.Path
        ``out / "report.md"``.
    """
    import torch

    from pyperm.reproduce._report import write_report
    from pyperm.reproduce._train import digits_data

    cfg = SETTINGS[scale]
    start = time.perf_counter()
    torch.manual_seed(seed)  # nothing here draws from the global RNG; this pins anything a dependency might
    data = digits_data(device, EVAL_BATCH, train=EVAL_BATCH, ste=STE_BATCH)
    fig2 = _figure2(cfg, data, device, seed, progress)
    fig4 = _figure4(cfg, data, device, seed, progress)
    findings = _findings(fig2, fig4)
    seconds = time.perf_counter() - start

    _plot(out, cfg, fig2, fig4)
    settings = _settings(scale, cfg, data, fig2, seed, seconds, device)
    return write_report(
        out,
        "rebasin",
        _markdown(cfg, fig2, fig4, findings, settings),
        findings,
        scale=scale,
        seed=seed,
        seconds=seconds,
        settings=cfg,
        figure2={
            split: {label: r.to_dict() for label, r in res.items()} for split, res in fig2["results"].items()
        }
        | {"matching_seconds": fig2["seconds"]},
        figure4=fig4["rows"],
    )


def _arch(cfg: dict) -> str:
    return "64-" + "-".join([str(cfg["width"])] * cfg["depth"]) + "-10"


def _plot(out: Path, cfg: dict, fig2: dict, fig4: dict) -> None:
    """fig2_test.png, fig2_train.png (the four paths) and fig4_width.png (barriers against width)."""
    from pyperm._plotting import plot_lines
    from pyperm.nn import plot_paths

    for split in ("test", "train"):
        plot_paths(
            fig2["results"][split],
            out / f"fig2_{split}.png",
            title=f"MLP {_arch(cfg)} on digits, {split} split (cf. Git Re-Basin Fig. 2)",
        )
    rows = fig4["rows"]

    def both(key: str, scale: float = 1.0) -> dict[str, list[float]]:
        return {
            "naive": [scale * r[f"naive_{key}"] for r in rows],
            "weight matching": [scale * r[f"weight_matching_{key}"] for r in rows],
        }

    plot_lines(
        out / "fig4_width.png",
        [r["width"] for r in rows],
        [("test loss barrier", both("loss_barrier")), ("test accuracy barrier (pp)", both("accuracy_barrier", 100))],
        xlabel="hidden width",
        title=f"loss barrier vs width, {cfg['depth']} hidden layers on digits (cf. Git Re-Basin Fig. 4)",
        logx=True,
    )


def _settings(scale: str, cfg: dict, data: dict, fig2: dict, seed: int, seconds: float, device: Any) -> str:
    """The report's Settings section: what ran, and where it is smaller than the paper."""
    from pyperm.reproduce._report import settings_section

    arch = _arch(cfg)
    settings = {
        "data": f"scikit-learn digits, 8x8 images, {data['num_train']} training / {data['num_test']} test images (fixed shuffle, seed 0)",
        "Fig. 2 models": f"MLP {arch}, ReLU, SGD momentum 0.9, lr 0.05 cosine-decayed, batch {BATCH}, {cfg['epochs']} epochs, seeds {2 * seed + 1} and {2 * seed + 2}",
        "matching": f"weight matching (Alg. 1); activation matching (eq. 1, Pearson correlation of post-activations over the training split); "
        f"STE matching (Alg. 2, Adam lr 1e-3, {cfg['ste_epochs']} epochs of batches of {STE_BATCH}, {fig2['ste_steps']} steps)",
        "Fig. 4 models": f"MLP 64-W x{cfg['depth']}-10 for W in {cfg['widths']}, {cfg['pairs']} pair(s) per width, same training",
        "paths": f"{cfg['points']} evenly spaced points; barriers as Definition 2.2 (height above the chord between the endpoints)",
    }
    scaled = [
        "MNIST (60k 28x28 images) -> scikit-learn digits (1400 8x8 training images), so that no download is needed",
        f"Fig. 2 MLP 512x3 on MNIST -> {arch} on digits; Fig. 4 VGG16/ResNet20 on CIFAR-10 -> MLPs of growing width on digits",
    ]
    if scale != "full":
        scaled.append(
            f"`--{scale}`: fewer epochs ({cfg['epochs']}), STE epochs ({cfg['ste_epochs']}), widths and pairs than the default"
        )
    return settings_section(scale, settings, scaled, seconds, device)


def _markdown(cfg: dict, fig2: dict, fig4: dict, findings: list, settings: str) -> list[str]:
    """The lines of report.md: the findings, Figure 2's and Figure 4's tables and plots, the settings."""
    from pyperm._tables import markdown_table
    from pyperm.reproduce._report import findings_section

    path_rows = []
    for split in ("test", "train"):
        for label, r in fig2["results"][split].items():
            mid = len(r.ts) // 2
            path_rows.append([
                split, label, r.loss_barrier, 100 * r.accuracy_barrier, float(r.loss[mid]),
                100 * float(r.accuracy[mid]), float(r.loss[0]), float(r.loss[-1]),
            ])  # fmt: skip
    width_rows = [
        [r["width"], r["naive_loss_barrier"], r["weight_matching_loss_barrier"], 100 * r["naive_accuracy_barrier"],
         100 * r["weight_matching_accuracy_barrier"]]
        for r in fig4["rows"]
    ]  # fmt: skip
    return [
        "# Git Re-Basin on digits: linear mode connectivity after permuting",
        "",
        TITLE + ".",
        "",
        findings_section(findings),
        "",
        "## Figure 2: paths between two MLPs",
        "",
        "![test split](fig2_test.png)",
        "",
        "![training split](fig2_train.png)",
        "",
        markdown_table(
            ["split", "path", "loss barrier", "accuracy barrier (pp)", "midpoint loss", "midpoint accuracy (%)",
             "loss at A", "loss at B"],
            path_rows,
        ),  # fmt: skip
        "",
        "Matching time: " + ", ".join(f"{m} {s:.3f} s" for m, s in fig2["seconds"].items()),
        "",
        "## Figure 4: barrier against width",
        "",
        "![width](fig4_width.png)",
        "",
        markdown_table(
            ["hidden width", "naive loss barrier", "weight-matching loss barrier", "naive accuracy barrier (pp)",
             "weight-matching accuracy barrier (pp)"],
            width_rows,
        ),  # fmt: skip
        "",
        settings,
    ]
