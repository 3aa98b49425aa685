"""ZipIt! (Stoica et al., ICLR 2024): two models trained on disjoint halves of the classes, merged.

Model A learns the first half of the labels (digits 0-4; CIFAR-100's 0-49), model B the second,
each with the whole output layer (a model never sees the other half's labels). Both are merged
on the union of the training images by weight-matching permute, activation-matching permute,
a full zip (:func:`pyperm.nn.zipit`), the same zip with same-model merges forbidden (beta = 0),
and a partial zip stopped at every group the graph allows; beside them the two models alone and
their ensemble (the mean of their softmax outputs, as a partial zip's two heads are combined).
Every merge's BatchNorm statistics are recomputed on the zip's data, as the paper does.

Accuracy, as the paper counts it: *joint* is the top-1 accuracy over all classes on the whole
test split; *task A* (*task B*) the accuracy on the test images of A's (B's) classes, among those
classes only.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

TITLE = ("ZipIt! (Stoica et al. 2024): disjoint 5+5 category splits, full and partial zips against permute and the "
         "ensemble")  # fmt: skip
OUTPUTS = ("report.md", "report.json", "zip_layers.png")
DATASETS = ("digits", "mnist", "cifar10", "cifar100")

__all__ = ["DATASETS", "OUTPUTS", "SETTINGS", "TITLE", "run"]

# MLPs on digits and MNIST (the paper's MNIST MLP of Git Re-Basin at full and paper scale), ResNet-20s on CIFAR
# (the paper's ResNet-20 x4 on CIFAR-10 5+5; x8 on CIFAR-100 50+50 is our choice). Trained with
# reproduce's SGD recipe; the zip's alpha and beta are the authors' defaults (match_tensors_zipit).
SETTINGS: dict[str, dict[str, Any]] = {
    "smoke": {"width": 32, "depth": 2, "epochs": {"digits": 20, "mnist": 2}, "batch": 64, "resnet": {"cifar10": 1, "cifar100": 1},
              "resnet_epochs": 1, "zip_samples": 512, "eval_batch": 512, "alpha": 0.3, "beta": 0.125},
    "quick": {"width": 128, "depth": 3, "epochs": {"digits": 40, "mnist": 8}, "batch": 128, "resnet": {"cifar10": 2, "cifar100": 2},
              "resnet_epochs": 5, "zip_samples": 2048, "eval_batch": 1000, "alpha": 0.3, "beta": 0.125},
    "full": {"width": 512, "depth": 3, "epochs": {"digits": 40, "mnist": 10}, "batch": 128, "resnet": {"cifar10": 4, "cifar100": 4},
             "resnet_epochs": 20, "zip_samples": 5000, "eval_batch": 1000, "alpha": 0.3, "beta": 0.125},
    "paper": {"width": 512, "depth": 3, "epochs": {"digits": 40, "mnist": 20}, "batch": 128, "resnet": {"cifar10": 4, "cifar100": 8},
              "resnet_epochs": 100, "zip_samples": 5000, "eval_batch": 1000, "alpha": 0.3, "beta": 0.125},
}  # fmt: skip


def _model_name(scale: str, data: dict) -> tuple[str, int]:
    """The registry name of the architecture for ``data`` at ``scale``, and its training epochs."""
    from pyperm.reproduce.rebasin._settings import mlp_name

    cfg = SETTINGS[scale]
    if data["name"] in ("cifar10", "cifar100"):
        return f"resnet20:{cfg['resnet'][data['name']]},num_classes={data['num_classes']}", cfg["resnet_epochs"]
    return mlp_name(data, cfg["width"], cfg["depth"]), cfg["epochs"][data["name"]]


def _scores(predict: Any, test: Any, num_classes: int) -> dict[str, float]:
    """Joint and per-task accuracy of ``predict`` (inputs -> class probabilities) on the test batches."""
    import torch

    half = num_classes // 2
    joint = first = second = n_first = n_second = 0
    with torch.no_grad():
        for x, y in test:
            p = predict(x)
            joint += int((p.argmax(1) == y).sum())
            a, b = y < half, y >= half
            first += int((p[a, :half].argmax(1) == y[a]).sum())
            second += int((p[b, half:].argmax(1) + half == y[b]).sum())
            n_first, n_second = n_first + int(a.sum()), n_second + int(b.sum())
    n = n_first + n_second
    return {"joint": joint / n, "task_a": first / max(n_first, 1), "task_b": second / max(n_second, 1)}


def _softmax_of(*models: Any) -> Any:
    """Inputs -> the mean of the softmax outputs of ``models`` (a model returning a tuple counts each output)."""

    def predict(x: Any) -> Any:
        outs = []
        for m in models:
            o = m(x)
            outs += list(o) if isinstance(o, tuple) else [o]
        return sum(o.float().softmax(1) for o in outs) / len(outs)

    return predict


def _ready(model: Any, batches: list) -> Any:
    """The model in eval mode, its BatchNorm statistics (if any) recomputed on ``batches``."""
    import torch.nn as nn

    from pyperm.nn import reset_bn_stats

    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        reset_bn_stats(model, batches)
    return model.eval()


def run(out: Path, scale: str, *, device: Any = "cpu", seed: int = 0, progress: bool = True,
        data: str = "digits") -> Path:  # fmt: skip
    """Train the two task models, merge them every way, write ``report.md``, ``report.json`` and the figure.

    Raises
    ------
    ValueError
        An unknown ``scale`` or a malformed ``data``.
    """
    import torch

    from pyperm.datasets import to_batches
    from pyperm.nn import activation_matching, average, weight_matching, zipit
    from pyperm.nn._training import train_classifier
    from pyperm.nn.models import create_model
    from pyperm.reproduce._data import check_data, load_data
    from pyperm.reproduce._report import findings_section, settings_section, write_report
    from pyperm.reproduce._splits import split_data
    from pyperm.reproduce._train import SGD_COSINE, loaded_copy

    if scale not in SETTINGS:
        raise ValueError(f"unknown scale {scale!r}; expected one of {', '.join(SETTINGS)}")
    check_data(data, DATASETS)
    cfg = SETTINGS[scale]
    start = time.perf_counter()
    ds = load_data(data, device, cfg["eval_batch"])
    name, epochs = _model_name(scale, ds)
    num_classes = ds["num_classes"]
    parts = split_data(ds, (1.0, 0.0), seed)
    states = []
    model = create_model(name).to(device)
    for k, part in enumerate(parts):
        states.append(train_classifier(model, (part["x_train"], part["y_train"]), epochs=epochs, seed=seed * 1000 + k,
                                       batch_size=cfg["batch"], **SGD_COSINE))  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(ds["num_train"], generator=gen)[: cfg["zip_samples"]].to(ds["y_train"].device)
    zip_data = to_batches(ds["x_train"][pick].cpu().numpy(), ds["y_train"][pick].cpu().numpy(), cfg["batch"],
                          device=device)  # fmt: skip
    model_a, model_b = (loaded_copy(model, s).eval() for s in states)
    spec = model.permutation_spec()
    rows: dict[str, dict[str, float]] = {}
    rows["model A"] = _scores(_softmax_of(model_a), ds["test"], num_classes)
    rows["model B"] = _scores(_softmax_of(model_b), ds["test"], num_classes)
    rows["ensemble"] = _scores(_softmax_of(model_a, model_b), ds["test"], num_classes)
    rows["weight average (no alignment)"] = _merged_scores(model, average(states), zip_data, ds, num_classes)
    wm = weight_matching(spec, states[0], states[1], seed=seed).perms
    rows["permute (weight matching)"] = _merged_scores(model, average([states[0], wm.apply(states[1])]), zip_data, ds,
                                                       num_classes)  # fmt: skip
    am = activation_matching(model_a, model_b, spec, zip_data).perms
    rows["permute (activation matching)"] = _merged_scores(model, average([states[0], am.apply(states[1])]), zip_data,
                                                           ds, num_classes)  # fmt: skip
    zip_start = time.perf_counter()
    zipped = zipit(model_a, model_b, spec, zip_data, alpha=cfg["alpha"], beta=cfg["beta"])
    zip_seconds = time.perf_counter() - zip_start
    rows["ZipIt! full zip"] = _scores(_softmax_of(_ready(zipped.model, zip_data)), ds["test"], num_classes)
    beta0 = zipit(model_a, model_b, spec, zip_data, alpha=cfg["alpha"], beta=0.0)
    rows["ZipIt! full zip, beta = 0"] = _scores(_softmax_of(_ready(beta0.model, zip_data)), ds["test"], num_classes)
    partial: list[tuple[int, str, dict[str, float]]] = []
    order = list(zipped.stops)
    for stop in order:
        groups = len(_zipped_groups(zipped, stop))
        scores = _scores(_softmax_of(_ready(zipped.partial(stop), zip_data)), ds["test"], num_classes)
        partial.append((groups, stop, scores))
        rows[f"ZipIt! partial, {groups}/{len(spec.groups)} groups zipped (to {stop})"] = scores
    seconds = time.perf_counter() - start

    findings = _findings(rows, partial, len(spec.groups))
    _figure(out / "zip_layers.png", rows, partial, len(spec.groups), ds["description"])
    table = ["| merge | joint | task A | task B |", "| --- | ---: | ---: | ---: |"]
    table += [f"| {k} | {100 * v['joint']:.2f} | {100 * v['task_a']:.2f} | {100 * v['task_b']:.2f} |"
              for k, v in rows.items()]  # fmt: skip
    same = {g: p.same_model_merges.tolist() for g, p in zipped.pairings.items()}
    settings = {"data": ds["description"], "model": name, "epochs": epochs, "batch": cfg["batch"],
                "split": "A: the first half of the classes, B: the second (all of each half's examples)",
                "zip data": f"{cfg['zip_samples']} training images of both tasks, batches of {cfg['batch']}",
                "alpha": cfg["alpha"], "beta": cfg["beta"]}  # fmt: skip
    lines = [f"# {TITLE}", "", f"{ds['description']}; {name}.", "", "## Accuracy (%)", "", *table, "",
             "![accuracy against the groups zipped](zip_layers.png)", "",
             f"The full zip took {zip_seconds:.2f} s; same-model merges (A, B) per group: "
             + ", ".join(f"{g} {a}/{b}" for g, (a, b) in same.items()) + ".", "",
             findings_section(findings), "",
             settings_section(scale, settings, [] if scale == "paper" else [f"scale {scale}: narrower or shorter "
                                                                             "training than the paper"],
                              seconds, device)]  # fmt: skip
    return write_report(out, "zipit", lines, findings, scale=scale, seed=seed, seconds=seconds, settings=settings,
                        accuracy=rows, same_model_merges=same, zip_seconds=zip_seconds,
                        partial=[{"groups": g, "stop": s, **v} for g, s, v in partial])  # fmt: skip


def _zipped_groups(result: Any, stop: str) -> list[str]:
    """The groups a partial zip stopped at ``stop`` merges (the trunk's), in the graph's order."""
    builder = result._builder
    return builder.order[: builder.order.index(stop) + 1]


def _merged_scores(model: Any, state: dict, zip_data: list, ds: dict, num_classes: int) -> dict[str, float]:
    merged = copy.deepcopy(model)
    merged.load_state_dict(state)
    return _scores(_softmax_of(_ready(merged, zip_data)), ds["test"], num_classes)


def _findings(rows: dict, partial: list, num_groups: int) -> list:
    from pyperm.reproduce._report import Finding

    full = rows["ZipIt! full zip"]["joint"]
    best_permute = max(rows["permute (weight matching)"]["joint"], rows["permute (activation matching)"]["joint"])
    ensemble = rows["ensemble"]["joint"]
    beta0 = rows["ZipIt! full zip, beta = 0"]["joint"]
    joints = [s["joint"] for _, _, s in sorted(partial)]
    falls = all(later <= earlier + 0.01 for earlier, later in zip(joints, joints[1:]))
    closer = bool(joints) and abs(ensemble - joints[0]) < abs(ensemble - full)
    return [
        Finding("ZipIt! sec. 5, Table 1", "a full zip beats permuting one model onto the other on disjoint tasks "
                "(the paper: 20-60% over prior work)",
                f"full zip {100 * full:.1f}% joint, best permute {100 * best_permute:.1f}%",
                full >= best_permute + 0.10, "the full zip at least 10 points of joint accuracy above the best permute"),
        Finding("ZipIt! sec. 4.4 (partial zipping)", "zipping fewer layers moves the multi-head model toward the "
                "ensemble",
                "joint accuracy by groups zipped: " + ", ".join(f"{g}: {100 * s['joint']:.1f}%"
                                                               for g, _, s in sorted(partial))
                + f"; full zip {100 * full:.1f}%, ensemble {100 * ensemble:.1f}%",
                falls and closer, "joint accuracy never rises by more than 1 point as more groups are zipped, and the "
                "fewest-groups partial zip is closer to the ensemble than the full zip"),
        Finding("ZipIt! sec. 4.3 (same-model merges, beta)", "merging features within each model matters: forbidding "
                "same-model merges (beta = 0) is worse",
                f"beta = 0: {100 * beta0:.1f}% joint, default beta: {100 * full:.1f}%", beta0 < full,
                "the beta = 0 full zip below the default one in joint accuracy"),
    ]  # fmt: skip


def _figure(path: Path, rows: dict, partial: list, num_groups: int, title: str) -> None:
    from pyperm._plotting import agg_figure, save_figure

    fig = agg_figure(6.4, 4.2, layout="tight")
    ax = fig.add_subplot()
    xs = [g for g, _, _ in sorted(partial)] + [num_groups + 1]
    ys = [100 * s["joint"] for _, _, s in sorted(partial)] + [100 * rows["ZipIt! full zip"]["joint"]]
    ax.plot(xs, ys, "o-", label="ZipIt! (partial; last point: full zip)")
    for label, style in (("ensemble", "--"), ("permute (weight matching)", ":"),
                         ("permute (activation matching)", "-."), ("model A", (0, (1, 3)))):  # fmt: skip
        ax.axhline(100 * rows[label]["joint"], linestyle=style, color="grey", label=label)
    ax.set_xlabel("groups zipped (the rest: one tail per model)")
    ax.set_ylabel("joint test accuracy (%)")
    ax.set_xticks(xs, [str(x) for x in xs[:-1]] + ["full"])
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)
