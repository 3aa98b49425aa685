"""Tatro et al. (NeurIPS 2020) Tables 1-2 and Figure 1: a small CNN on digits, or their models on CIFAR.

Two CNNs (with BatchNorm) trained from different seeds are joined by quadratic Bezier curves
four ways: unaligned (Garipov et al.), aligned (neuron alignment by post-activation correlation,
Algorithm 1, then curve finding), PAM from the identity ("PAM unaligned") and PAM from the
alignment ("PAM aligned"). Each curve's average and minimum test accuracy along it (Table 1) and
training loss (Table 2), and the correlation signature of the endpoints before and after
alignment and of each curve's midpoint to an endpoint (Figure 1).

``--scale paper`` runs the paper's section 5 setting on the data given (``--data
cifar10:DIR`` or ``cifar100:DIR``): TinyTen and ResNet32, endpoints trained 250 epochs by
SGD at 0.1 halved every 20 epochs with weight decay 5e-4, curves trained 250 epochs with
batches of 128 at 1e-2 (1e-1 on CIFAR-100) on the authors' schedule, PAM with 20 epochs of
projected SGD and the authors' curve step (``pam(recipe="tatro")``), three pairs per
architecture. Every endpoint is a fresh model from its own seed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

TITLE = "Tatro et al. Tables 1-2 (unaligned, aligned, PAM unaligned, PAM aligned curves) and Fig. 1 (correlation signature)"
OUTPUTS = ("report.md", "report.json", "curves_test.png", "signature.png")
DATASETS = ("digits", "mnist", "cifar10", "cifar100")

__all__ = ["DATASETS", "OUTPUTS", "TITLE", "cnn", "run"]

# Per scale: the architectures ("cnn": the small CNN below, of width ``width``), endpoint
# training epochs, curve epochs, PAM permutation steps (None: perm_epochs passes over the
# training batches), points, pairs of endpoints per architecture, training batch size.
SETTINGS = {
    "smoke": {"archs": ["cnn"], "width": 4, "epochs": 4, "curve_epochs": 1, "perm_steps": 4, "points": 5, "pairs": 1,
              "batch": 64},
    "quick": {"archs": ["cnn"], "width": 8, "epochs": 20, "curve_epochs": 30, "perm_steps": 40, "points": 11,
              "pairs": 3, "batch": 64},
    "full": {"archs": ["cnn"], "width": 16, "epochs": 40, "curve_epochs": 60, "perm_steps": 100, "points": 21,
             "pairs": 3, "batch": 64},
    # Tatro et al. sec. 5: "trained for 250 epochs"; "Curves are trained for 250 epochs using SGD with a learning
    # rate of 1E-2 and a batch size of 128"; appendix E: "20 epochs of projected stochastic gradient descent".
    "paper": {"archs": ["tinyten", "resnet32"], "width": 1, "epochs": 250, "curve_epochs": 250, "perm_steps": None,
              "perm_epochs": 20, "points": 21, "pairs": 3, "batch": 128},
}  # fmt: skip
EVAL_BATCH = 512
CURVE_LR = 0.01  # SGD with momentum 0.9, as the paper's curve training (1e-2)
CURVE_LR_CIFAR100 = 0.1  # "For CIFAR100 curves, this learning rate was set to 1E-1"
# The endpoints at --scale paper: "SGD ... a learning rate of 1E-1 that decays by a factor of 0.5 every 20 epochs.
# Weight decay of 5E-4" (momentum 0.9, as their code's train_model.py).
PAPER_ENDPOINTS = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "schedule": "halving", "weight_decay": 5e-4}
KINDS = ("unaligned", "aligned", "PAM unaligned", "PAM aligned")


def cnn(width: int, in_channels: int = 1, num_classes: int = 10) -> Any:
    """A three-convolution CNN with BatchNorm for small images (a narrow TinyTen stand-in).

    TinyTen itself needs inputs of at least 16x16 (its last 3x3 convolution has no padding
    after two stride-2 layers); the digits are 8x8.
    """
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes),
    )  # fmt: skip


def build_model(arch: str, cfg: dict, data: dict) -> Any:
    """A fresh model of ``arch`` for ``data``'s images: the small CNN, or a registry model (TinyTen, ResNet32)."""
    from pyperm.nn.models import create_model

    channels, classes = data["input_shape"][0], data["num_classes"]
    if arch == "cnn":
        return cnn(cfg["width"], channels, classes)
    return create_model(f"{arch}:{cfg['width']},num_classes={classes},in_channels={channels}")


def load(data: str, device: Any, batch: int = 64) -> dict[str, Any]:
    """The data as training batches of ``batch``, evaluation batches of 512, and whole training tensors."""
    from pyperm.reproduce._data import load_data

    return load_data(data, device, EVAL_BATCH, train=batch)


def estimate_seconds(scale: str, data: str = "digits", device: Any = "cpu") -> float:
    """The expected wall time of :func:`run` on this machine, from a few timed training steps of each model.

    Curve training is counted at 1.5 training steps per batch (the point of the curve is built
    every step), a relaxed PAM step at two, an evaluation pass at a third.
    """
    import math

    from pyperm.datasets import load_dataset
    from pyperm.reproduce._data import check_data
    from pyperm.reproduce._estimate import step_seconds

    if scale not in SETTINGS:
        raise ValueError(f"scale must be one of {', '.join(SETTINGS)}, got {scale!r}")
    name = check_data(data, DATASETS)
    cfg = SETTINGS[scale]
    ds = load_dataset(data)
    info = {"name": name, "input_shape": ds.input_shape, "num_classes": ds.num_classes}
    n = len(ds.y_train)
    steps = math.ceil(n / cfg["batch"])
    perm_steps = cfg["perm_steps"] or cfg["perm_epochs"] * steps
    total = 0.0
    for arch in cfg["archs"]:
        step = step_seconds(f"{arch}/{name}/{cfg['width']}", ds.input_shape, cfg["batch"], device,
                            build=lambda arch=arch: build_model(arch, cfg, info))  # fmt: skip
        per_pair = (2 * cfg["epochs"] * steps + 4 * cfg["curve_epochs"] * steps * 1.5 + 2 * perm_steps * 2) * step
        # Evaluation: 8 curves x points x (BatchNorm reset on the training split + the split itself), forward only.
        per_pair += 8 * cfg["points"] * 2 * (n + len(ds.y_test)) / cfg["batch"] * step / 3
        total += cfg["pairs"] * per_pair
    return total


def digits_batches(device: Any) -> dict[str, Any]:
    """Digits as training batches of 64, evaluation batches of 512, and whole training tensors."""
    return load("digits", device)


def _midpoint_model(model: Any, curve: Any, data: dict) -> Any:
    """The curve's midpoint network with its BatchNorm statistics recomputed on the training data."""
    from pyperm.nn import reset_bn_stats
    from pyperm.reproduce._train import loaded_copy

    mid = loaded_copy(model, {k: v.detach() for k, v in curve.state_at(0.5).items()})
    reset_bn_stats(mid, data["train_eval"])
    return mid.eval()


def _endpoint(arch: str, cfg: dict, data: dict, device: Any, seed: int, paper: bool) -> tuple[Any, dict]:
    """A fresh model from its own seed, trained: the model and its state."""
    from pyperm.nn._training import train_classifier
    from pyperm.reproduce._train import SGD_COSINE

    model = build_model(arch, cfg, data).to(device)
    recipe = PAPER_ENDPOINTS if paper else SGD_COSINE
    state = train_classifier(model, (data["x_train"], data["y_train"]), batch_size=cfg["batch"], epochs=cfg["epochs"],
                             seed=seed, **recipe)  # fmt: skip
    return model, state


def curve_options(cfg: dict, data: dict, paper: bool) -> dict[str, Any]:
    """How the curves are trained: Garipov et al.'s recipe on the laptop scales, Tatro et al.'s at paper scale."""
    if not paper:
        return {"lr": CURVE_LR, "recipe": "garipov"}  # Garipov et al.'s regulariser and schedule
    from pyperm.nn.align._tatro_curve import POINT_DECAY, tatro_scheduler

    lr = CURVE_LR_CIFAR100 if data["name"] == "cifar100" else CURVE_LR
    return {"lr": lr, "point_decay": POINT_DECAY, "lr_scheduler": tatro_scheduler()}


def _one_pair(cfg: dict, data: dict, device: Any, seed: int, pair: int, progress: bool, arch: str = "cnn",
              paper: bool = False) -> dict[str, Any]:
    """Train two endpoints (fresh models, own seeds) and the four curves between them; evaluate everything."""
    from pyperm.nn import connect, correlation_signature, evaluate_curve, pam
    from pyperm.reproduce._train import evaluate, loaded_copy

    seeds = (100 * seed + 2 * pair + 1, 100 * seed + 2 * pair + 2)
    model, sa = _endpoint(arch, cfg, data, device, seeds[0], paper)
    _, sb = _endpoint(arch, cfg, data, device, seeds[1], paper)
    spec = _spec(model, data)
    options = curve_options(cfg, data, paper)
    common = {
        "epochs": cfg["curve_epochs"],
        **options,
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
            perm_steps=cfg["perm_steps"] or cfg["perm_epochs"] * len(data["train"]),
            curve_epochs=cfg["curve_epochs"],
            lr_curve=options["lr"],
            recipe="tatro",  # the authors' curve step (their nu, schedule and regulariser)
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

    if hasattr(model, "permutation_spec"):  # the registry's models carry their hand-written spec
        return model.permutation_spec()
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


def run(out: Path, scale: str, *, data: str = "digits", device: Any = "cpu", seed: int = 0,
        progress: bool = False) -> Path:
    """Train the endpoints and the curves, evaluate them, write the report.

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

    from pyperm.reproduce._data import check_data

    if scale not in SETTINGS:
        raise ValueError(f"scale must be one of {', '.join(SETTINGS)}, got {scale!r}")
    check_data(data, DATASETS)
    cfg = SETTINGS[scale]
    paper = scale == "paper"
    start = time.perf_counter()
    loaded = load(data, device, cfg["batch"])
    by_arch = {arch: [_one_pair(cfg, loaded, device, seed, p, progress, arch, paper) for p in range(cfg["pairs"])]
               for arch in cfg["archs"]}  # fmt: skip
    findings = []
    for arch, arch_pairs in by_arch.items():
        found = _findings(arch_pairs)
        if len(by_arch) > 1:
            for f in found:
                f.source += f" ({arch})"
        findings += found
    seconds = time.perf_counter() - start

    first = next(iter(by_arch))
    pairs = by_arch[first]
    plot_paths(pairs[0]["test"], out / "curves_test.png",
               title=f"test accuracy and loss along the curves ({first}, first pair)")  # fmt: skip
    _plot_signature(out / "signature.png", pairs[0])
    settings = _settings(scale, cfg, loaded, seconds, device)
    lines = _markdown(by_arch[first], findings, settings, loaded["name"])
    for arch in list(by_arch)[1:]:
        lines[-1:-1] = [f"## Tables 1-2 for {arch}", "", *_tables(by_arch[arch]), ""]
    return write_report(
        out,
        "curves",
        lines,
        findings,
        scale=scale,
        seed=seed,
        seconds=seconds,
        settings=cfg | {"data": loaded["name"]},
        pairs=[
            {
                "test": {k: r.to_dict() for k, r in p["test"].items()},
                "train": {k: r.to_dict() for k, r in p["train"].items()},
                "seconds": p["seconds"],
                "signature": p["signature"].to_dict(),
                "midpoint_signature": {k: s.to_dict() for k, s in p["midpoint_signature"].items()},
                "endpoint_accuracy": p["endpoint_accuracy"],
                "architecture": arch,
            }
            for arch, arch_pairs in by_arch.items()
            for p in arch_pairs
        ],
    )


def _settings(scale: str, cfg: dict, data: dict, seconds: float, device: Any) -> str:
    """The report's Settings section: what ran, and where it is smaller than the paper."""
    from pyperm.reproduce._report import settings_section

    paper = scale == "paper"
    lr = curve_options(cfg, data, paper)["lr"]
    batch = cfg["batch"]
    steps = cfg["perm_steps"] or f"{cfg['perm_epochs']} epochs of"
    c = data["input_shape"][0]
    models = ", ".join(cfg["archs"]) if paper else (
        f"CNN {c}-{cfg['width']}-{2 * cfg['width']}-{2 * cfg['width']} channels, BatchNorm, ReLU, global average "
        f"pool, linear {data['num_classes']}")  # fmt: skip
    endpoints = ("SGD momentum 0.9, lr 0.1 halved every 20 epochs, weight decay 5e-4" if paper
                 else "SGD momentum 0.9, lr 0.05 cosine")  # fmt: skip
    curves = (f"SGD lr {lr:g} momentum 0.9, point decay 5e-4, lr x 0.5^(e//20) x 0.9996^e (the authors' code)" if paper
              else f"Garipov et al.'s recipe (SGD lr {lr:g} momentum 0.9, point decay 5e-4, their lr schedule)")  # fmt: skip
    ours = {
        "data": f"{data['description']} images",
        "model": models,
        "endpoints": f"{cfg['pairs']} pair(s) per model, each endpoint a fresh model from its own seed; {endpoints}, "
                     f"batch {batch}, {cfg['epochs']} epochs",
        "curves": f"quadratic Bezier, {curves}, {cfg['curve_epochs']} epochs, batch {batch}; alignment: activation "
                  "matching (correlation of post-activations) on the training split",
        "PAM": f"one outer iteration, {steps} projected SGD steps on the relaxed permutations, 32 BvN samples, "
               f"{cfg['curve_epochs']} curve epochs with the authors' curve step (pam recipe='tatro', nu 1e3)",
        "evaluation": f"{cfg['points']} evenly spaced points, BatchNorm statistics recomputed on the training split at each",
    }  # fmt: skip
    if paper:
        lines = {k: f"{v}  \n  *paper:* \"{PAPER_LINES[k]}\"" for k, v in ours.items()}
        scaled = [] if data["name"] in ("cifar10", "cifar100") else [
            f"the paper's data is CIFAR-10/100 and Tiny ImageNet; ran on {data['name']}"]  # fmt: skip
        scaled.append("GoogLeNet and Tiny ImageNet are not run")
    else:
        lines = ours
        scaled = [
            "CIFAR-10/100 and Tiny ImageNet, TinyTen/ResNet32/GoogLeNet -> a 3-layer CNN (`--scale paper` runs "
            "TinyTen and ResNet32 on --data cifar10:DIR or cifar100:DIR)",
            f"curve training {cfg['curve_epochs']} epochs (paper: 250), {cfg['pairs']} pair(s) of endpoints",
        ]
        if scale != "full":
            scaled.append(f"`--{scale}`: narrower CNN, fewer epochs and PAM steps than the default")
    return settings_section(scale, lines, scaled, seconds, device)


# Each setting at --scale paper beside the line of Tatro et al. that states it.
PAPER_LINES = {
    "data": "CIFAR10, CIFAR100, Tiny ImageNet (Table 1)",
    "model": "TinyTen (0.09M) ... ResNet32 (0.47M) ... GoogLeNet (10.24M) (Table 1)",
    "endpoints": "trained using SGD. We set a learning rate of 1E-1 that decays by a factor of 0.5 every 20 epochs. "
                 "Weight decay of 5E-4 ... trained for 250 epochs; we train 6 models ... 3 independent model pairs",
    "curves": "Curves are trained for 250 epochs using SGD with a learning rate of 1E-2 and a batch size of 128. The "
              "rate anneals by a factor of 0.5 every 20 epochs ... For CIFAR100 curves ... 1E-1",
    "PAM": "a single outer iteration of PAM ... 20 epochs of projected stochastic gradient descent ... 250 epochs of "
           "SGD (appendix E)",
    "evaluation": "BatchNorm statistics ... recomputed for each point (appendix B)",
}  # fmt: skip


def _tables(pairs: list[dict]) -> list[str]:
    """Tables 1-2 of one architecture: the endpoints' accuracy, and accuracy and training loss along each curve."""
    from pyperm._tables import markdown_table

    def row(kind: str) -> list[Any]:
        a = [100 * p["test"][kind].average_accuracy for p in pairs]
        m = [100 * p["test"][kind].min_accuracy for p in pairs]
        tl = [p["train"][kind].average_loss for p in pairs]
        return [kind, _mean(a), _std(a), _mean(m), _std(m), _mean(tl), _std(tl),
                _mean([p["seconds"][kind] for p in pairs])]  # fmt: skip

    endpoint_acc = [100 * a for p in pairs for a in p["endpoint_accuracy"]]
    return [
        f"Endpoints' test accuracy: {_mean(endpoint_acc):.2f}% ± {_std(endpoint_acc):.2f}.",
        "",
        markdown_table(
            ["curve", "average test accuracy (%)", "± std", "minimum test accuracy (%)", "± std",
             "average training loss", "± std", "seconds"],
            [row(k) for k in KINDS],
        ),  # fmt: skip
    ]


def _markdown(pairs: list[dict], findings: list, settings: str, data_name: str = "digits") -> list[str]:
    """The lines of report.md: the findings, Tables 1-2 and Figure 1 with their plots, the settings."""
    from pyperm._tables import markdown_table
    from pyperm.reproduce._report import findings_section

    sig = pairs[0]["signature"]
    mids = pairs[0]["midpoint_signature"]
    signature_rows = [
        [g, float(sig.before[i]), float(sig.after[i]), float(mids["unaligned"].before[i]),
         float(mids["aligned"].before[i])]
        for i, g in enumerate(sig.groups)
    ]  # fmt: skip
    return [
        f"# Tatro et al. on {data_name}: mode connectivity via neuron alignment",
        "",
        TITLE + ".",
        "",
        findings_section(findings),
        "",
        "## Tables 1-2: accuracy and training loss along the curves",
        "",
        *_tables(pairs),
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
