"""Git Re-Basin sec. 5.4 (Figs. 5, 9, 10): merging two models trained on biased, disjoint shares of the data.

Model A trains on its share of the training split (``split_fractions`` of the examples of each
half of the labels, :func:`~pyperm.reproduce._splits.split_indices`), model B on the rest, and
a third model on both (the union), all with the same recipe. Along the linear path from A to
B, naively and after weight, activation and STE matching, the loss and accuracy are measured
on the whole test split (both halves of the labels), beside the logit ensemble
``(1 - t) logits_A + t logits_B`` (the authors' ensembling curve) and the union model.
Calibration: the ECE and reliability bins of A, B, the weight-matched merge at its lowest test
loss strictly between them, and the equal-weight ensemble.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pyperm.reproduce.rebasin._settings import RECIPES, split_setting

__all__ = ["SplitModels", "split_experiment", "split_json", "split_runs", "train_split_models"]

SEED_OFFSET = 200  # A, B and a trained union model start from seeds 1000 * seed + 201, 202, 203


class SplitModels:
    """Models A and B, the union model, and where each came from.

    Attributes: ``model`` (a module of the architecture), ``setting``
    (:func:`~pyperm.reproduce.rebasin._settings.split_setting`), ``states`` (``"A"``, ``"B"``,
    ``"union"``), ``halves`` (A's and B's examples of each half of the labels), ``seeds``,
    ``union_source`` (a phrase: trained for it, or which endpoint of Figure 2 it is).
    """

    def __init__(self, model: Any, setting: dict, states: dict, halves: dict, seeds: dict, union_source: str) -> None:
        self.model, self.setting, self.states = model, setting, states
        self.halves, self.seeds, self.union_source = halves, seeds, union_source


def _union_is_an_endpoint(cfg: dict, setting: dict, fig2_name: str) -> str | None:
    """``"final"`` or ``"snapshot"`` when Figure 2's first endpoint is a union model already, else None.

    The endpoints train on the whole training split, which is the union of A's and B's. The
    first one is the union model when it has the same model, recipe and batch and was trained
    for ``epochs``: its final state, or, under a constant step size (where training for fewer
    epochs is the same run stopped early), its Figure 3 snapshot after ``epochs``.
    """
    if (setting["name"], setting["recipe"], setting["batch"]) != (fig2_name, cfg["recipe"], cfg["batch"]):
        return None
    if setting["epochs"] == cfg["epochs"]:
        return "final"
    if RECIPES[setting["recipe"]]["schedule"] == "constant" and setting["epochs"] in cfg["marks"]:
        return "snapshot"
    return None


def split_runs(scale: str, cfg: dict, data: dict, fig2_name: str) -> list[tuple[str, int, int, str, float]]:
    """The training runs of sec. 5.4 as ``(model name, epochs, batch, recipe, share of the training split)``."""
    setting = split_setting(scale, cfg, data)
    f_first, f_second = cfg["split_fractions"]
    share_a = (f_first + f_second) / 2  # the halves of the labels hold about half the examples each
    run = (setting["name"], setting["epochs"], setting["batch"], setting["recipe"])
    runs = [(*run, share_a), (*run, 1.0 - share_a)]
    if _union_is_an_endpoint(cfg, setting, fig2_name) is None:
        runs.append((*run, 1.0))
    return runs


def train_split_models(scale: str, cfg: dict, data: dict, ends: Any, device: Any, seed: int, bar: Any) -> SplitModels:
    """Split the training data, train A and B (and the union model unless Figure 2 has it)."""
    from pyperm.reproduce._splits import split_data
    from pyperm.reproduce.rebasin._experiments import train_endpoint

    setting = split_setting(scale, cfg, data)
    part_a, part_b = split_data(data, cfg["split_fractions"], seed)
    seeds = {k: 1000 * seed + SEED_OFFSET + i for i, k in enumerate(("A", "B", "union"), start=1)}
    states, model = {}, None
    for label, part in (("A", part_a), ("B", part_b)):
        model, states[label] = train_endpoint(setting["name"], part, setting["recipe"], setting["batch"],
                                              setting["epochs"], seeds[label], device, bar.hook())  # fmt: skip
    reuse = _union_is_an_endpoint(cfg, setting, ends.name)
    if reuse == "final":
        states["union"], seeds["union"] = ends.states[0], ends.seeds[0]
        source = f"Figure 2's first endpoint (seed {ends.seeds[0]}), trained on the whole training split"
    elif reuse == "snapshot":
        states["union"], seeds["union"] = ends.snapshots[0][setting["epochs"]], ends.seeds[0]
        source = (f"Figure 2's first endpoint (seed {ends.seeds[0]}) after {setting['epochs']} epochs (its Figure 3 "
                  "snapshot: under a constant step size, the same run as training that long)")  # fmt: skip
    else:
        _, states["union"] = train_endpoint(setting["name"], data, setting["recipe"], setting["batch"],
                                            setting["epochs"], seeds["union"], device, bar.hook())  # fmt: skip
        source = f"trained on the whole training split from seed {seeds['union']}"
    halves = {"A": part_a["halves"], "B": part_b["halves"]}
    return SplitModels(model, setting, states, halves, seeds, source)


def _scores(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, Any]:
    from pyperm.reproduce._calibration import calibration
    from pyperm.reproduce._splits import accuracy_by_half

    first, second = accuracy_by_half(logits, labels, num_classes)
    return {"test_loss": float(torch.nn.functional.cross_entropy(logits.double(), labels)),
            "test_accuracy": float((logits.argmax(-1) == labels).double().mean()),
            "accuracy_first_half": first, "accuracy_second_half": second,
            "calibration": calibration(logits, labels)}  # fmt: skip


def split_experiment(cfg: dict, data: dict, models: SplitModels, seed: int, progress: bool) -> dict[str, Any]:
    """The four paths between A and B, the ensemble curve, and the scores and calibration of every model."""
    from pyperm import nn as pnn
    from pyperm._progress import progress_bar
    from pyperm.reproduce._calibration import logits_and_labels
    from pyperm.reproduce.rebasin._experiments import _has_batchnorm, _loaded

    if cfg["split_points"] < 3:
        raise ValueError(f"split_points must be at least 3 (a point between A and B), got {cfg['split_points']}")
    start = time.perf_counter()
    model, states = models.model, models.states
    sa, sb = states["A"], states["B"]
    spec = model.permutation_spec()
    bn = data["train_eval"] if _has_batchnorm(model) else None  # statistics recomputed at every merged point
    perms: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    perms["weight"] = pnn.weight_matching(spec, sa, sb, seed=seed).perms
    seconds["weight"] = time.perf_counter() - t
    t = time.perf_counter()
    perms["activation"] = pnn.activation_matching(_loaded(model, sa), _loaded(model, sb), spec,
                                                  data["train_eval"]).perms  # fmt: skip
    seconds["activation"] = time.perf_counter() - t
    t = time.perf_counter()
    size = models.setting["ste_batch"]
    if size == cfg["ste_batch"]:
        ste_data = data["ste"]
    else:
        ste_data = [(data["x_train"][i : i + size], data["y_train"][i : i + size])
                    for i in range(0, len(data["y_train"]), size)]  # fmt: skip
    ste = pnn.ste_matching(model, spec, sa, sb, ste_data, epochs=models.setting["ste_epochs"], lr=1e-3, seed=seed,
                           progress=progress)  # fmt: skip
    perms["ste"] = ste.perms
    seconds["ste"] = time.perf_counter() - t

    ends_b = {"naive": sb} | {m: pnn.apply_permutation(spec, p, sb) for m, p in perms.items()}
    paths = {}
    bar = progress_bar(progress, len(ends_b), "Sec. 5.4 paths", "path")
    for label, state_b in ends_b.items():
        paths[label] = pnn.barrier(model, sa, state_b, data["test"], num_points=cfg["split_points"], bn_data=bn)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    ts = [float(v) for v in paths["weight"].ts]

    logits = {}
    for label in ("A", "B", "union"):
        logits[label], labels = logits_and_labels(_loaded(model, states[label]), data["test"])
    ensemble: dict[str, list[float]] = {"loss": [], "accuracy": []}
    for t_ in ts:
        mixed = (1 - t_) * logits["A"].double() + t_ * logits["B"].double()
        ensemble["loss"].append(float(torch.nn.functional.cross_entropy(mixed, labels)))
        ensemble["accuracy"].append(float((mixed.argmax(-1) == labels).double().mean()))

    # The merged model: the weight-matched path's point of lowest test loss strictly between A and B (at the
    # ends the "merge" would be an input itself).
    best = 1 + int(paths["weight"].loss[1:-1].argmin())
    merged = _loaded(model, pnn.interpolate(sa, ends_b["weight"], ts[best]))
    if bn is not None:
        pnn.reset_bn_stats(merged, bn)
    logits["merged"], _ = logits_and_labels(merged, data["test"])
    logits["ensemble"] = 0.5 * (logits["A"] + logits["B"])
    k = data["num_classes"]
    scores = {label: _scores(values, labels, k) for label, values in logits.items()}
    return {"ts": ts, "paths": paths, "ensemble": ensemble, "scores": scores, "best_t": ts[best],
            "matching_seconds": seconds, "ste_steps": ste.iterations,
            "seconds": time.perf_counter() - start}  # fmt: skip


def split_json(models: SplitModels, result: dict) -> dict[str, Any]:
    """What report.json keeps of the experiment."""
    return {"model": models.setting["name"], "epochs": models.setting["epochs"], "recipe": models.setting["recipe"],
            "batch": models.setting["batch"], "ste_epochs": models.setting["ste_epochs"], "halves": models.halves, "seeds": models.seeds,
            "union_model": models.union_source, "ts": result["ts"],
            "paths": {label: r.to_dict() for label, r in result["paths"].items()}, "ensemble": result["ensemble"],
            "scores": result["scores"], "best_t": result["best_t"], "matching_seconds": result["matching_seconds"],
            "ste_steps": result["ste_steps"], "evaluation_seconds": result["seconds"]}  # fmt: skip
