"""Tatro et al. (NeurIPS 2020) Tables 1-2 and Figure 1 with a small CNN on scikit-learn's digits.

Two CNNs (with BatchNorm) trained from different seeds are joined by quadratic Bezier curves
four ways: unaligned (Garipov et al.), aligned (neuron alignment by post-activation correlation,
Algorithm 1, then curve finding), PAM from the identity ("PAM unaligned") and PAM from the
alignment ("PAM aligned"). Each curve's average and minimum test accuracy along it (Table 1) and
training loss (Table 2), and the correlation signature of the endpoints before and after
alignment and of each curve's midpoint to an endpoint (Figure 1).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

TITLE = "Tatro et al. Tables 1-2 (unaligned, aligned, PAM unaligned, PAM aligned curves) and Fig. 1 (correlation signature), small CNN on digits"
OUTPUTS = ("report.md", "report.json", "curves_test.png", "signature.png")

__all__ = ["OUTPUTS", "TITLE", "cnn", "run"]

# Per scale: CNN width, endpoint training epochs, curve epochs, PAM permutation steps, points, pairs of endpoints.
SETTINGS = {
    "smoke": {"width": 4, "epochs": 4, "curve_epochs": 1, "perm_steps": 4, "points": 5, "pairs": 1},
    "quick": {"width": 8, "epochs": 20, "curve_epochs": 30, "perm_steps": 40, "points": 11, "pairs": 3},
    "full": {"width": 16, "epochs": 40, "curve_epochs": 60, "perm_steps": 100, "points": 21, "pairs": 3},
}
BATCH = 64
EVAL_BATCH = 512
CURVE_LR = 0.01  # SGD with momentum 0.9, as the paper's curve training (1e-2)
KINDS = ("unaligned", "aligned", "PAM unaligned", "PAM aligned")


def cnn(width: int) -> Any:
    """A three-convolution CNN with BatchNorm for 8x8 one-channel images (a narrow TinyTen stand-in).

    TinyTen itself needs inputs of at least 16x16 (its last 3x3 convolution has no padding
    after two stride-2 layers); the digits are 8x8.
    """
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10),
    )  # fmt: skip


def digits_batches(device: Any) -> dict[str, Any]:
    """Digits as training batches of 64, evaluation batches of 512, and whole training tensors."""
    from pyperm.reproduce._train import digits_data

    return digits_data(device, EVAL_BATCH, train=BATCH, train_eval=EVAL_BATCH)


def _midpoint_model(model: Any, curve: Any, data: dict) -> Any:
    """The curve's midpoint network with its BatchNorm statistics recomputed on the training data."""
    from pyperm.nn import reset_bn_stats
    from pyperm.reproduce._train import loaded_copy

    mid = loaded_copy(model, {k: v.detach() for k, v in curve.state_at(0.5).items()})
    reset_bn_stats(mid, data["train_eval"])
    return mid.eval()


def _one_pair(cfg: dict, data: dict, device: Any, seed: int, pair: int, progress: bool) -> dict[str, Any]:
    """Train two endpoints and the four curves between them; evaluate everything."""
    from pyperm.nn import connect, correlation_signature, evaluate_curve, pam
    from pyperm.nn._training import train_classifier
    from pyperm.reproduce._train import SGD_COSINE, evaluate, loaded_copy

    model = cnn(cfg["width"]).to(device)
    seeds = (100 * seed + 2 * pair + 1, 100 * seed + 2 * pair + 2)
    train = (data["x_train"], data["y_train"])
    sa, sb = (
        train_classifier(model, train, batch_size=BATCH, epochs=cfg["epochs"], seed=s, **SGD_COSINE) for s in seeds
    )
    spec = _spec(model, data)
    common = {
        "epochs": cfg["curve_epochs"],
        "lr": CURVE_LR,
        "recipe": "garipov",  # the papers' curve training: Garipov et al.'s regulariser and schedule
        "seed": seed,
        "test_data": data["test"],
        "bn_data": data["train_eval"],
    }
    curves, test, seconds = {}, {}, {}
    for kind, align in (("unaligned", None), ("aligned", "activation")):
        t = time.perf_counter()
        res = connect(
            model, spec, sa, sb, data["train"], align=align, num_points=cfg["points"], progress=progress, **common
        )
        seconds[kind] = time.perf_counter() - t
        curves[kind], test[kind] = res.curve, res.result
    for kind, init in (("PAM unaligned", "identity"), ("PAM aligned", "activation")):
        t = time.perf_counter()
        res = pam(
            model,
            spec,
            sa,
            sb,
            data["train"],
            init=init,
            perm_steps=cfg["perm_steps"],
            curve_epochs=cfg["curve_epochs"],
            lr_curve=CURVE_LR,
            seed=seed,
            progress=progress,
        )
        seconds[kind] = time.perf_counter() - t
        curves[kind] = res.curve
        test[kind] = evaluate_curve(res.curve, data["test"], num_points=cfg["points"], bn_data=data["train_eval"])
    # Table 2: the training loss along each curve.
    train = {
        k: evaluate_curve(c, data["train_eval"], num_points=cfg["points"], bn_data=data["train_eval"])
        for k, c in curves.items()
    }
    model_a, model_b = loaded_copy(model, sa).eval(), loaded_copy(model, sb).eval()
    endpoints = correlation_signature(model_a, model_b, spec, data["train_eval"])
    midpoints = {
        k: correlation_signature(model_a, _midpoint_model(model, curves[k], data), spec, data["train_eval"])
        for k in ("unaligned", "aligned")
    }
    return {
        "test": test,
        "train": train,
        "seconds": seconds,
        "signature": endpoints,
        "midpoint_signature": midpoints,
        "endpoint_accuracy": [evaluate(m, data["test"])[1] for m in (model_a, model_b)],
    }


def _spec(model: Any, data: dict) -> Any:
    from pyperm.nn import PermutationSpec

    return PermutationSpec.from_model(model, data["test"][0][0][:2])


def _mean(values: list[float]) -> float:
    return float(np.mean(values))


def _std(values: list[float]) -> float:
    return float(np.std(values))


def _findings(pairs: list[dict]) -> list:
    from pyperm.reproduce._report import Finding

    def avg(kind: str, split: str = "test", attr: str = "average_accuracy") -> float:
        return _mean([getattr(p[split][kind], attr) for p in pairs])

    acc = {k: avg(k) for k in KINDS}
    low = {k: avg(k, attr="min_accuracy") for k in KINDS}
    loss = {k: avg(k, split="train", attr="average_loss") for k in KINDS}
    sig_before = _mean([float(np.mean(p["signature"].before)) for p in pairs])
    sig_after = _mean([float(np.mean(p["signature"].after)) for p in pairs])
    per_layer = all(bool(np.all(p["signature"].after >= p["signature"].before - 1e-9)) for p in pairs)
    mid_un = _mean([float(np.mean(p["midpoint_signature"]["unaligned"].before)) for p in pairs])
    mid_al = _mean([float(np.mean(p["midpoint_signature"]["aligned"].before)) for p in pairs])
    tol = 0.005  # half a percentage point: "comparable"
    return [
        Finding(
            "Tatro et al. Table 1",
            "Aligned curves outperform unaligned curves in average accuracy along the curve.",
            f"aligned {100 * acc['aligned']:.2f}% vs unaligned {100 * acc['unaligned']:.2f}%",
            acc["aligned"] > acc["unaligned"],
            "aligned average test accuracy > unaligned",
        ),
        Finding(
            "Tatro et al. Table 1",
            "Aligned curves do not suffer the generalisation gap of unaligned ones: a higher minimum accuracy along the curve.",
            f"min accuracy aligned {100 * low['aligned']:.2f}% vs unaligned {100 * low['unaligned']:.2f}%",
            low["aligned"] > low["unaligned"],
            "aligned minimum test accuracy > unaligned",
        ),
        Finding(
            "Tatro et al. Table 2",
            "Aligned curves reach a lower training loss than unaligned ones.",
            f"average training loss aligned {loss['aligned']:.4f} vs unaligned {loss['unaligned']:.4f}",
            loss["aligned"] < loss["unaligned"],
            "aligned average training loss < unaligned",
        ),
        Finding(
            "Tatro et al. Table 1, sec. 4",
            "PAM from the identity finds a better permutation than none: PAM unaligned beats unaligned.",
            f"PAM unaligned {100 * acc['PAM unaligned']:.2f}% vs unaligned {100 * acc['unaligned']:.2f}%",
            acc["PAM unaligned"] > acc["unaligned"],
            "PAM unaligned average accuracy > unaligned",
        ),
        Finding(
            "Tatro et al. Table 1, sec. 4",
            "PAM unaligned still does not beat the aligned curve.",
            f"PAM unaligned {100 * acc['PAM unaligned']:.2f}% vs aligned {100 * acc['aligned']:.2f}%",
            acc["PAM unaligned"] <= acc["aligned"] + tol,
            "PAM unaligned <= aligned + 0.5 pp",
        ),
        Finding(
            "Tatro et al. Table 1, sec. 4",
            "The alignment is nearly locally optimal: PAM aligned and aligned are comparable.",
            f"PAM aligned {100 * acc['PAM aligned']:.2f}% vs aligned {100 * acc['aligned']:.2f}%",
            abs(acc["PAM aligned"] - acc["aligned"]) <= 2 * tol,
            "within 1 pp",
        ),
        Finding(
            "Tatro et al. Fig. 1 (left)",
            "Alignment raises the mean correlation of corresponding units at every layer.",
            f"mean over layers {sig_before:.3f} before -> {sig_after:.3f} after; higher at every layer: {per_layer}",
            per_layer and sig_after > sig_before,
            "after >= before at every layer, for every pair",
        ),
        Finding(
            "Tatro et al. Fig. 1 (middle/right)",
            "Alignment makes the curve's midpoint more similar to the endpoint (higher signature before re-aligning the midpoint).",
            f"midpoint-to-A signature: aligned curve {mid_al:.3f}, unaligned curve {mid_un:.3f}",
            mid_al > mid_un,
            "aligned curve's midpoint signature > unaligned curve's",
        ),
    ]


def run(out: Path, scale: str, *, device: Any = "cpu", seed: int = 0, progress: bool = False) -> Path:
    """Train the endpoints and the curves, evaluate them, write the report.

    Parameters
    ----------
    out : pathlib.Path
        An existing folder; :data:`OUTPUTS` are written into it.
    scale : {"smoke", "quick", "full"}
        The settings of :data:`SETTINGS`.
    device : str or torch.device
        Where to train and evaluate.
    seed : int
        Offsets the endpoints' seeds and seeds curve training and PAM.
    progress : bool
        Progress bars.

    Returns
    -------
    pathlib.Path
        ``out / "report.md"``.
    """
    from pyperm.nn import plot_paths
    from pyperm.reproduce._report import write_report

    cfg = SETTINGS[scale]
    start = time.perf_counter()
    data = digits_batches(device)
    pairs = [_one_pair(cfg, data, device, seed, p, progress) for p in range(cfg["pairs"])]
    findings = _findings(pairs)
    seconds = time.perf_counter() - start

    plot_paths(pairs[0]["test"], out / "curves_test.png", title="test accuracy and loss along the curves (first pair)")
    _plot_signature(out / "signature.png", pairs[0])
    settings = _settings(scale, cfg, data, seconds, device)
    return write_report(
        out,
        "curves",
        _markdown(pairs, findings, settings),
        findings,
        scale=scale,
        seed=seed,
        seconds=seconds,
        settings=cfg,
        pairs=[
            {
                "test": {k: r.to_dict() for k, r in p["test"].items()},
                "train": {k: r.to_dict() for k, r in p["train"].items()},
                "seconds": p["seconds"],
                "signature": p["signature"].to_dict(),
                "midpoint_signature": {k: s.to_dict() for k, s in p["midpoint_signature"].items()},
                "endpoint_accuracy": p["endpoint_accuracy"],
            }
            for p in pairs
        ],
    )


def _settings(scale: str, cfg: dict, data: dict, seconds: float, device: Any) -> str:
    """The report's Settings section: what ran, and where it is smaller than the paper."""
    from pyperm.reproduce._report import settings_section

    settings = {
        "data": f"scikit-learn digits, {data['num_train']} training / {data['num_test']} test 8x8 images",
        "model": f"CNN 1-{cfg['width']}-{2 * cfg['width']}-{2 * cfg['width']} channels, BatchNorm, ReLU, global average pool, linear 10",
        "endpoints": f"{cfg['pairs']} pair(s), SGD momentum 0.9, lr 0.05 cosine, batch {BATCH}, {cfg['epochs']} epochs",
        "curves": f"quadratic Bezier, Garipov et al.'s recipe (SGD lr {CURVE_LR} momentum 0.9, point decay 5e-4, "
                  f"their lr schedule), {cfg['curve_epochs']} epochs, batch {BATCH}; "
        f"alignment: activation matching (correlation of post-activations) on the training split",
        "PAM": f"one outer iteration, {cfg['perm_steps']} projected SGD steps on the relaxed permutations, 32 BvN samples, "
        f"{cfg['curve_epochs']} curve epochs",
        "evaluation": f"{cfg['points']} evenly spaced points, BatchNorm statistics recomputed on the training split at each",
    }
    scaled = [
        "CIFAR-10/100 and Tiny ImageNet -> digits; TinyTen/ResNet32/GoogLeNet -> a 3-layer CNN (TinyTen needs 16x16 inputs or more)",
        f"curve training {cfg['curve_epochs']} epochs (paper: 250), {cfg['pairs']} pair(s) of endpoints (paper: several)",
    ]
    if scale != "full":
        scaled.append(f"`--{scale}`: narrower CNN, fewer epochs and PAM steps than the default")
    return settings_section(scale, settings, scaled, seconds, device)


def _markdown(pairs: list[dict], findings: list, settings: str) -> list[str]:
    """The lines of report.md: the findings, Tables 1-2 and Figure 1 with their plots, the settings."""
    from pyperm._tables import markdown_table
    from pyperm.reproduce._report import findings_section

    def row(kind: str) -> list[Any]:
        a = [100 * p["test"][kind].average_accuracy for p in pairs]
        m = [100 * p["test"][kind].min_accuracy for p in pairs]
        tl = [p["train"][kind].average_loss for p in pairs]
        return [kind, _mean(a), _std(a), _mean(m), _std(m), _mean(tl), _std(tl),
                _mean([p["seconds"][kind] for p in pairs])]  # fmt: skip

    endpoint_acc = [100 * a for p in pairs for a in p["endpoint_accuracy"]]
    sig = pairs[0]["signature"]
    mids = pairs[0]["midpoint_signature"]
    signature_rows = [
        [g, float(sig.before[i]), float(sig.after[i]), float(mids["unaligned"].before[i]),
         float(mids["aligned"].before[i])]
        for i, g in enumerate(sig.groups)
    ]  # fmt: skip
    return [
        "# Tatro et al. on digits: mode connectivity via neuron alignment",
        "",
        TITLE + ".",
        "",
        findings_section(findings),
        "",
        "## Tables 1-2: accuracy and training loss along the curves",
        "",
        f"Endpoints' test accuracy: {_mean(endpoint_acc):.2f}% ± {_std(endpoint_acc):.2f}.",
        "",
        markdown_table(
            ["curve", "average test accuracy (%)", "± std", "minimum test accuracy (%)", "± std",
             "average training loss", "± std", "seconds"],
            [row(k) for k in KINDS],
        ),  # fmt: skip
        "",
        "![curves](curves_test.png)",
        "",
        "## Figure 1: correlation signature",
        "",
        "![signature](signature.png)",
        "",
        markdown_table(
            ["layer (group)", "endpoints before", "endpoints after", "A vs unaligned midpoint",
             "A vs aligned midpoint"],
            signature_rows,
        ),  # fmt: skip
        "",
        settings,
    ]


def _plot_signature(path: Path, pair: dict) -> Path:
    from pyperm._plotting import plot_lines

    sig = pair["signature"]
    layers = list(range(1, len(sig.groups) + 1))
    mids = pair["midpoint_signature"]
    return plot_lines(
        path,
        layers,
        [
            ("mean correlation, A vs B", {"before alignment": sig.before, "after alignment": sig.after}),
            (
                "mean correlation, A vs curve midpoint",
                {"unaligned curve": mids["unaligned"].before, "aligned curve": mids["aligned"].before},
            ),
        ],
        xlabel="layer",
        title="correlation signature (cf. Tatro et al. Fig. 1)",
    )
