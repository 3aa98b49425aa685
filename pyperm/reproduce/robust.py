"""Tatro et al. (NeurIPS 2020) Figure 4: robust curves between adversarially trained models.

Two CNNs are trained adversarially (PGD, L-inf) from different seeds; quadratic Bezier curves
between them are trained adversarially too (each step attacks the network at the drawn point
``t``), once between the models as they are (unaligned) and once after neuron alignment
(aligned). Along each curve: clean and robust test accuracy (Figure 4, left/right); the robust
training loss of each curve epoch is in report.json.

Laptop scales use a small CNN on digits (``--data`` may name MNIST or CIFAR files);
``--scale paper`` uses the paper's TinyTen on ``--data cifar10:DIR`` or ``cifar100:DIR``
with an initial learning rate of 0.1 and PGD at radius 8/255 (a GPU's work). Every endpoint
is a fresh model from its own seed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

TITLE = "Tatro et al. Fig. 4: clean and robust accuracy along unaligned and aligned robust curves"
OUTPUTS = ("report.md", "report.json", "robust_curves.png")
DATASETS = ("digits", "mnist", "cifar10", "cifar100")

__all__ = ["DATASETS", "OUTPUTS", "TITLE", "run"]

# Per scale: CNN width, adversarial training epochs of the endpoints and of the curves,
# PGD steps in training and in evaluation, points on each curve, test samples attacked.
SETTINGS = {
    "smoke": {
        "width": 4,
        "epochs": 3,
        "curve_epochs": 1,
        "train_steps": 2,
        "eval_steps": 3,
        "points": 3,
        "test_samples": 128,
    },
    "quick": {
        "width": 8,
        "epochs": 15,
        "curve_epochs": 25,
        "train_steps": 5,
        "eval_steps": 10,
        "points": 11,
        "test_samples": 397,
    },
    "full": {
        "width": 16,
        "epochs": 30,
        "curve_epochs": 40,
        "train_steps": 7,
        "eval_steps": 20,
        "points": 21,
        "test_samples": 397,
    },
    # Tatro et al. sec. 5 (Fig. 4): "trained with the same scheme as in (Zhao et al., 2020), where we set the
    # initial learning rate to 1E-1"; 250 epochs as their other models. PGD at Madry et al.'s CIFAR radius.
    "paper": {
        "arch": "tinyten",
        "width": 1,
        "epochs": 250,
        "curve_epochs": 250,
        "train_steps": 10,
        "eval_steps": 20,
        "points": 21,
        "test_samples": 10_000,
        "eps": 8 / 255,
        "lr": 0.1,
        "curve_lr": 0.1,
        "batch": 128,
    },
}
BATCH = 64  # training batch size of the endpoints
EPS = 0.1  # L-inf radius on [0, 1] pixels (the digits' 17 grey levels are 1/16 apart)
CURVE_LR = 0.01


def estimate_seconds(scale: str, data: str = "digits", device: Any = "cpu") -> float:
    """The expected wall time of :func:`run` on this machine: every adversarial step costs its PGD steps
    plus one (forward and backward passes), timed on the model at the report's batch size."""
    import math

    from pyperm.datasets import load_dataset
    from pyperm.reproduce._data import check_data
    from pyperm.reproduce._estimate import step_seconds
    from pyperm.reproduce.curves import build_model

    if scale not in SETTINGS:
        raise ValueError(f"scale must be one of {', '.join(SETTINGS)}, got {scale!r}")
    name = check_data(data, DATASETS)
    cfg = SETTINGS[scale]
    ds = load_dataset(data)
    info = {"name": name, "input_shape": ds.input_shape, "num_classes": ds.num_classes}
    batch = cfg.get("batch", BATCH)
    arch = cfg.get("arch", "cnn")
    step = step_seconds(f"{arch}/{name}/{cfg['width']}", ds.input_shape, batch, device,
                        build=lambda: build_model(arch, cfg, info))  # fmt: skip
    steps = math.ceil(len(ds.y_train) / batch)
    train = (2 * cfg["epochs"] + 2 * 1.5 * cfg["curve_epochs"]) * steps * (cfg["train_steps"] + 1) * step
    attacked = 2 * cfg["points"] * min(cfg["test_samples"], len(ds.y_test)) * (cfg["eval_steps"] + 1) / batch * step
    return train + attacked


def _eps(cfg: dict) -> float:
    """The L-inf radius of the attacks: the paper's 8/255 on CIFAR at paper scale, else 0.1 (digits' grey levels)."""
    return cfg.get("eps", EPS)


def _attack(eps: float, steps: int, seed: int) -> dict[str, Any]:
    # Madry et al.'s step 2.5 eps / steps reaches the ball's surface from any random start.
    return {"eps": eps, "steps": steps, "step_size": 2.5 * eps / steps, "norm": "inf", "seed": seed}


def _along(curve: Any, data: dict, points: int, attack: dict) -> dict[str, list[float]]:
    """Clean and robust test accuracy and clean test loss at evenly spaced points of the curve.

    BatchNorm statistics are recomputed at every point on the clean training data
    (Tatro et al. appendix B), as :func:`~pyperm.nn.curves.evaluate_curve` does.
    """
    from pyperm.nn.curves import evaluate_curve

    result = evaluate_curve(curve, data["test"], num_points=points, bn_data=data["train_eval"], adversarial=attack)
    return {
        "ts": [float(t) for t in result.ts],
        "clean": [float(a) for a in result.accuracy],
        "robust": [float(a) for a in result.robust_accuracy],
        "clean_loss": [float(v) for v in result.loss],
    }


def _findings(paths: dict[str, dict]) -> list:
    from pyperm.reproduce._report import Finding

    un, al = paths["unaligned"], paths["aligned"]

    def mean(p: dict, key: str) -> float:
        return float(np.mean(p[key]))

    def ends(p: dict, key: str) -> float:
        return max(p[key][0], p[key][-1])

    def barrier(p: dict, key: str) -> float:
        chord = np.linspace(p[key][0], p[key][-1], len(p[key]))
        return float(np.max(chord - np.asarray(p[key])))

    mid = len(al["ts"]) // 2
    return [
        Finding(
            "Tatro et al. Fig. 4, sec. 5",
            "Alignment greatly reduces the robust loss barrier: the aligned robust curve has the higher robust accuracy along it.",
            f"mean robust accuracy aligned {100 * mean(al, 'robust'):.1f}% vs unaligned {100 * mean(un, 'robust'):.1f}%",
            mean(al, "robust") > mean(un, "robust"),
            "aligned mean robust test accuracy > unaligned",
        ),
        Finding(
            "Tatro et al. Fig. 4 (left)",
            "The aligned robust curve also has the higher clean accuracy along it.",
            f"mean clean accuracy aligned {100 * mean(al, 'clean'):.1f}% vs unaligned {100 * mean(un, 'clean'):.1f}%",
            mean(al, "clean") > mean(un, "clean"),
            "aligned mean clean test accuracy > unaligned",
        ),
        Finding(
            "Tatro et al. Fig. 4, sec. 5",
            "Only the aligned curve avoids a robust accuracy barrier.",
            f"robust accuracy barrier aligned {100 * barrier(al, 'robust'):.1f} pp, unaligned {100 * barrier(un, 'robust'):.1f} pp",
            barrier(al, "robust") < barrier(un, "robust") and barrier(al, "robust") <= 0.01,
            "aligned barrier < unaligned and <= 1 pp",
        ),
        Finding(
            "Tatro et al. Fig. 4, sec. 5",
            "A more accurate and more robust model than the endpoints lies on the aligned curve (e.g. its midpoint).",
            f"aligned midpoint clean {100 * al['clean'][mid]:.1f}% / robust {100 * al['robust'][mid]:.1f}% vs best endpoint "
            f"{100 * ends(al, 'clean'):.1f}% / {100 * ends(al, 'robust'):.1f}%",
            al["clean"][mid] > ends(al, "clean") and al["robust"][mid] > ends(al, "robust"),
            "midpoint beats the better endpoint in clean and robust accuracy",
        ),
    ]


def run(out: Path, scale: str, *, data: str = "digits", device: Any = "cpu", seed: int = 0,
        progress: bool = False) -> Path:
    """Adversarially train the endpoints and the curves, evaluate them, write the report.

    Parameters
    ----------
    out : pathlib.Path
        An existing folder; :data:`OUTPUTS` are written into it.
    scale : {"smoke", "quick", "full", "paper"}
        The settings of :data:`SETTINGS`.
    data : str, default "digits"
        ``"digits"``, ``"mnist:DIR"``, ``"cifar10:DIR"`` or ``"cifar100:DIR"``.
    device : str or torch.device
        Where to train and evaluate.
    seed : int
        Offsets the endpoints' seeds and seeds the attacks and curve training.
    progress : bool
        Progress bar over the curves.

    Returns
    -------
    pathlib.Path
        ``out / "report.md"``.
    """
    import torch

    from pyperm.reproduce._data import check_data
    from pyperm.reproduce._report import write_report
    from pyperm.reproduce._train import evaluate
    from pyperm.reproduce.curves import load

    if scale not in SETTINGS:
        raise ValueError(f"scale must be one of {', '.join(SETTINGS)}, got {scale!r}")
    check_data(data, DATASETS)
    cfg = SETTINGS[scale]
    start = time.perf_counter()
    data = load(data, device, cfg.get("batch", BATCH))
    # The attacked test samples, in one batch (PGD on every point is the costly part).
    n = cfg["test_samples"]
    data["test"] = [(torch.cat([x for x, _ in data["test"]])[:n], torch.cat([y for _, y in data["test"]])[:n])]
    model, models, ends = _endpoints(cfg, data, device, seed)
    paths, history, seconds = _curves(cfg, data, model, ends, device, seed, progress)
    endpoint = {name: {"clean": evaluate(m, data["test"])[1]} for name, m in models.items()}
    findings = _findings(paths)
    total = time.perf_counter() - start

    _plot(out / "robust_curves.png", paths, _eps(cfg))
    return write_report(
        out,
        "robust",
        _markdown(cfg, data, paths, endpoint, seconds, findings, _settings(scale, cfg, data, total, device)),
        findings,
        scale=scale,
        seed=seed,
        seconds=total,
        settings=cfg | {"eps": _eps(cfg), "data": data["name"]},
        paths=paths,
        curve_training_loss=history,
        endpoints=endpoint,
    )


def _endpoints(cfg: dict, data: dict, device: Any, seed: int) -> tuple[Any, dict[str, Any], dict[str, dict]]:
    """Two adversarially trained CNNs: the architecture, the two models (eval mode), and B's state unaligned
    and aligned to A by activation matching (each curve's far end), with A's state under ``"A"``."""
    import copy

    from pyperm import nn as pnn
    from pyperm.nn._training import train_classifier
    from pyperm.nn.eval.robust import pgd_attack
    from pyperm.reproduce._train import SGD_COSINE
    from pyperm.reproduce.curves import build_model

    train_attack = _attack(_eps(cfg), cfg["train_steps"], seed)

    def perturb(model: Any, x: Any, y: Any, step: int) -> Any:
        return pgd_attack(model, x, y, **dict(train_attack, seed=train_attack["seed"] + step))

    train = (data["x_train"], data["y_train"])
    # The paper's scheme (Zhao et al.'s): SGD from 0.1; the laptop scales: the reports' cosine recipe.
    recipe = SGD_COSINE | {"lr": cfg["lr"]} if "lr" in cfg else SGD_COSINE
    states = []
    for s in (1, 2):
        model = build_model(cfg.get("arch", "cnn"), cfg, data).to(device)  # a fresh model per endpoint
        states.append(train_classifier(model, train, batch_size=cfg.get("batch", BATCH), epochs=cfg["epochs"],
                                       seed=100 * seed + s, perturb=perturb, **recipe))  # fmt: skip
    sa, sb = states
    spec = pnn.PermutationSpec.from_model(model, data["test"][0][0][:2])
    models = {}
    for name, state in (("A", sa), ("B", sb)):
        models[name] = copy.deepcopy(model)
        models[name].load_state_dict(state)
        models[name].eval()
    perms = pnn.activation_matching(models["A"], models["B"], spec, data["train_eval"]).perms
    return model, models, {"A": sa, "unaligned": sb, "aligned": pnn.apply_permutation(spec, perms, sb)}


def _curves(
    cfg: dict, data: dict, model: Any, ends: dict[str, dict], device: Any, seed: int, progress: bool
) -> tuple[dict, dict, dict]:
    """Train the unaligned and the aligned robust curve; clean and robust accuracy along each, training
    losses and seconds, by kind."""
    from pyperm._progress import progress_bar
    from pyperm.nn.curves import BezierCurve, train_curve

    train_attack = _attack(_eps(cfg), cfg["train_steps"], seed)
    eval_attack = _attack(_eps(cfg), cfg["eval_steps"], 10_000 + seed)
    paths, history, seconds = {}, {}, {}
    kinds = ("unaligned", "aligned")
    bar = progress_bar(progress, len(kinds), "robust curves", "curve")
    for kind in kinds:
        t0 = time.perf_counter()
        curve = BezierCurve(model, ends["A"], ends[kind]).to(device)
        # Algorithm 2 on the robust loss: every batch attacked at its point t (Tatro et al. section 5).
        history[kind] = train_curve(
            curve, data["train"], epochs=cfg["curve_epochs"], lr=cfg.get("curve_lr", CURVE_LR), seed=seed,
            adversarial=train_attack,
        )
        paths[kind] = _along(curve, data, cfg["points"], eval_attack)
        seconds[kind] = time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return paths, history, seconds


def _plot(path: Path, paths: dict[str, dict], eps: float = EPS) -> None:
    from pyperm._plotting import plot_lines

    plot_lines(
        path,
        paths["aligned"]["ts"],
        [
            ("clean test accuracy (%)", {k: [100 * v for v in p["clean"]] for k, p in paths.items()}),
            ("robust test accuracy (%)", {k: [100 * v for v in p["robust"]] for k, p in paths.items()}),
        ],
        xlabel="t",
        title=f"robust curves, PGD L-inf eps {eps:.3g} (cf. Tatro et al. Fig. 4)",
    )


def _settings(scale: str, cfg: dict, data: dict, seconds: float, device: Any) -> str:
    """The report's Settings section: what ran, each setting at ``paper`` beside the paper's line, and where it is smaller."""
    from pyperm.reproduce._report import settings_section

    eps, c = _eps(cfg), data["input_shape"][0]
    paper = scale == "paper"
    model = (cfg["arch"] if paper else
             f"CNN {c}-{cfg['width']}-{2 * cfg['width']}-{2 * cfg['width']} channels with BatchNorm")  # fmt: skip
    lr = cfg.get("lr", 0.05)
    settings = {
        "data": f"{data['description']} images; {min(cfg['test_samples'], data['num_test'])} test images attacked",
        "model": f"{model}; each endpoint a fresh model from its own seed",
        "adversarial training": f"PGD L-inf eps {eps:.4g}, {cfg['train_steps']} steps of 2.5 eps/steps, random start; "
        f"endpoints {cfg['epochs']} epochs (SGD momentum 0.9, lr {lr:g} cosine), curves {cfg['curve_epochs']} epochs "
        f"(SGD lr {cfg.get('curve_lr', CURVE_LR):g})",
        "evaluation": f"PGD L-inf eps {eps:.4g}, {cfg['eval_steps']} steps; {cfg['points']} points per curve, BatchNorm "
        "statistics recomputed on clean training data",
        "alignment": "activation matching (correlation of post-activations) of the robust endpoints on the training split",
    }  # fmt: skip
    if paper:
        settings = {k: f"{v}  \n  *paper:* \"{PAPER_LINES[k]}\"" for k, v in settings.items()}
        scaled = ["ResNet32 and GoogLeNet are not run (TinyTen only); the PGD radius and steps are Madry et al.'s "
                  "CIFAR setting, which the paper's text does not state"]  # fmt: skip
    else:
        scaled = [
            "CIFAR-100 and TinyTen/ResNet32/GoogLeNet -> a 3-layer CNN (`--scale paper` runs TinyTen on --data "
            "cifar10:DIR or cifar100:DIR)",
            f"PGD {cfg['train_steps']} training steps, curves {cfg['curve_epochs']} epochs (paper: longer)",
        ]
    return settings_section(scale, settings, scaled, seconds, device)


# Each setting at --scale paper beside the line of Tatro et al. that states it.
PAPER_LINES = {
    "data": "For CIFAR100, alignment enables finding a more accurate model without sacrificing robust accuracy (sec. 5)",
    "model": "For TinyTen and ResNet32, it is clear that a more robust and accurate model can be found (Fig. 4)",
    "adversarial training": "These networks and curves are trained with the same scheme as in (Zhao et al., 2020), "
                            "where we set the initial learning rate to 1E-1",
    "evaluation": "the test accuracy of PGD adversarial examples (Madry et al., 2017), l-inf bounded noise",
    "alignment": "the curve itself is trained to minimize robust loss ... aligned curves (sec. 5)",
}  # fmt: skip


def _markdown(
    cfg: dict, data: dict, paths: dict, endpoint: dict, seconds: dict, findings: list, settings: str
) -> list[str]:
    """The lines of report.md: the findings, the accuracies along the curves, the settings."""
    from pyperm._tables import markdown_table
    from pyperm.reproduce._report import findings_section

    ts = paths["aligned"]["ts"]
    rows = [[f"{t:.2f}"] + [100 * paths[k][m][i] for k in paths for m in ("clean", "robust")] for i, t in enumerate(ts)]
    return [
        f"# Tatro et al. on {data['name']}: robust mode connectivity",
        "",
        TITLE + ".",
        "",
        findings_section(findings),
        "",
        "## Clean and robust test accuracy along the curves",
        "",
        "![robust curves](robust_curves.png)",
        "",
        markdown_table(["t"] + [f"{k} {m} (%)" for k in paths for m in ("clean", "robust")], rows),
        "",
        f"Endpoints' clean test accuracy with their own running statistics (from adversarial batches): "
        f"A {100 * endpoint['A']['clean']:.1f}%, B {100 * endpoint['B']['clean']:.1f}% "
        "(the table recomputes every point's statistics on clean training data, t = 0 and 1 included). "
        f"Curve training time: " + ", ".join(f"{k} {s:.1f} s" for k, s in seconds.items()),
        "",
        settings,
    ]
