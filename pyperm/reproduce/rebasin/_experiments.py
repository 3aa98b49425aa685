"""The experiments of the Git Re-Basin report: endpoints, Figures 2-4 and Table 2.

Every endpoint is a fresh model from the registry, trained from its own seed (every layer
re-initialised, BatchNorm included), so two endpoints share nothing but the architecture,
as the paper's "separately train two models ... from different random initializations and
with different random batch orders" asks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pyperm.reproduce.rebasin._settings import RECIPES, fig4_models, mlp_name

__all__ = ["Endpoints", "EpochBar", "endpoints", "figure2", "figure3", "figure4", "table2", "train_endpoint"]

CONV_BATCH = 128  # the conv models of Fig. 4 on CIFAR (the paper gives no batch size for them)


class EpochBar:
    """One progress bar over every training epoch of the report (the bulk of its time)."""

    def __init__(self, enabled: bool, total: int) -> None:
        from pyperm._progress import progress_bar

        self.bar = progress_bar(enabled, total, "training", "epoch")

    def hook(self, then: Callable[[int, Any], None] | None = None) -> Callable[[int, Any], None]:
        """An ``on_epoch`` for :func:`~pyperm.nn._training.train_classifier`: moves the bar, then calls ``then``."""

        def on_epoch(done: int, model: Any) -> None:
            if self.bar is not None:
                self.bar.update(1)
            if then is not None:
                then(done, model)

        return on_epoch

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_endpoint(name: str, data: dict, recipe: str, batch: int, epochs: int, seed: int, device: Any,
                   on_epoch: Callable[[int, Any], None] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """A fresh model ``name`` trained from ``seed``: the model and a copy of its trained state."""
    from pyperm.nn._training import train_classifier
    from pyperm.nn.models import create_model

    model = create_model(name).to(device)
    state = train_classifier(model, (data["x_train"], data["y_train"]), batch_size=batch, epochs=epochs, seed=seed,
                             on_epoch=on_epoch, **RECIPES[recipe])  # fmt: skip
    return model, state


class Endpoints:
    """Table 2's models (the first two are Figure 2's pair) and the pair's snapshots for Figure 3."""

    def __init__(self, name: str, model: Any, states: list[dict], seeds: list[int],
                 snapshots: list[dict[int, dict]]) -> None:
        self.name, self.model, self.states, self.seeds, self.snapshots = name, model, states, seeds, snapshots


def endpoints(cfg: dict, data: dict, device: Any, seed: int, bar: EpochBar) -> Endpoints:
    """Train ``cfg["models"]`` MLPs from seeds ``1000 * seed + 1, + 2, ...``; snapshot the first two at ``cfg["marks"]``."""
    name = mlp_name(data, cfg["width"], cfg["depth"])
    seeds = [1000 * seed + k for k in range(1, max(2, cfg["models"]) + 1)]
    snapshots: list[dict[int, dict]] = [{}, {}]
    states, model = [], None
    for i, s in enumerate(seeds):

        def keep(done: int, m: Any, i: int = i) -> None:
            if i < 2 and done in cfg["marks"]:
                snapshots[i][done] = {k: v.detach().clone() for k, v in m.state_dict().items()}

        model, state = train_endpoint(name, data, cfg["recipe"], cfg["batch"], cfg["epochs"], s, device, bar.hook(keep))
        states.append(state)
    return Endpoints(name, model, states, seeds, snapshots)


def _loaded(model: Any, state: dict) -> Any:
    from pyperm.reproduce._train import loaded_copy

    return loaded_copy(model, state).eval()


def figure2(cfg: dict, data: dict, ends: Endpoints, seed: int, progress: bool) -> dict[str, Any]:
    """The naive, weight, activation and STE paths between the pair, on the test and the training split."""
    from pyperm import nn as pnn
    from pyperm._progress import progress_bar

    model, (sa, sb) = ends.model, ends.states[:2]
    spec = model.permutation_spec()
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
    ste = pnn.ste_matching(model, spec, sa, sb, data["ste"], epochs=cfg["ste_epochs"], lr=1e-3, seed=seed,
                           progress=progress)  # fmt: skip
    perms["ste"] = ste.perms
    seconds["ste"] = time.perf_counter() - t

    paths = {"naive": sb} | {m: pnn.apply_permutation(spec, p, sb) for m, p in perms.items()}
    results: dict[str, dict] = {"test": {}, "train": {}}
    bar = progress_bar(progress, 2 * len(paths), "Fig. 2 paths", "path")
    for split, batches in (("test", data["test"]), ("train", data["train_eval"])):
        for label, state_b in paths.items():
            results[split][label] = pnn.barrier(model, sa, state_b, batches, num_points=cfg["points"])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return {"results": results, "seconds": seconds, "ste_steps": ste.iterations}


def figure3(cfg: dict, data: dict, ends: Endpoints, seed: int, progress: bool) -> list[dict[str, Any]]:
    """Naive and weight-matched barriers between the pair's snapshots, epoch by epoch."""
    from pyperm import nn as pnn
    from pyperm._progress import progress_bar

    spec = ends.model.permutation_spec()
    k = cfg["fig3_train_batches"]
    train = data["train_eval"] if k is None else data["train_eval"][:k]
    rows = []
    marks = sorted(ends.snapshots[0])
    bar = progress_bar(progress, len(marks), "Fig. 3 epochs", "epoch")
    for epoch in marks:
        sa, sb = ends.snapshots[0][epoch], ends.snapshots[1][epoch]
        pb = pnn.apply_permutation(spec, pnn.weight_matching(spec, sa, sb, seed=seed).perms, sb)
        naive = pnn.barrier(ends.model, sa, sb, data["test"], num_points=cfg["points"])
        test = pnn.barrier(ends.model, sa, pb, data["test"], num_points=cfg["points"])
        fit = pnn.barrier(ends.model, sa, pb, train, num_points=cfg["points"])
        rows.append({"epoch": epoch, "naive_test_loss_barrier": naive.loss_barrier,
                     "weight_matching_test_loss_barrier": test.loss_barrier,
                     "weight_matching_train_loss_barrier": fit.loss_barrier,
                     "endpoint_test_loss": 0.5 * float(test.loss[0] + test.loss[-1])})  # fmt: skip
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows


def table2(data: dict, ends: Endpoints, seed: int, models: int) -> dict[str, Any]:
    """MergeMany (Algorithm 3) of the first ``models`` endpoints against each of them and their naive average."""
    from pyperm.nn import merge_many
    from pyperm.nn.state import average
    from pyperm.reproduce._train import evaluate

    spec = ends.model.permutation_spec()
    states = ends.states[:models]
    t = time.perf_counter()
    merged = merge_many(spec, states, seed=seed)
    seconds = time.perf_counter() - t
    named = [(f"seed {s}", st) for s, st in zip(ends.seeds, states)]
    named += [("naive average", average(states)), ("MergeMany", merged.merged)]
    rows = []
    for label, state in named:
        m = _loaded(ends.model, state)
        train_loss, train_acc = evaluate(m, data["train_eval"])
        test_loss, test_acc = evaluate(m, data["test"])
        rows.append({"model": label, "train_loss": train_loss, "train_accuracy": train_acc, "test_loss": test_loss,
                     "test_accuracy": test_acc})  # fmt: skip
    return {"rows": rows, "seconds": seconds, "rounds": merged.iterations, "converged": merged.converged}


def _has_batchnorm(model: Any) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def figure4(scale: str, cfg: dict, data: dict, ends: Endpoints, device: Any, seed: int,
            bar: EpochBar) -> list[dict[str, Any]]:
    """Naive and weight-matched test barriers against width (mean over ``cfg["pairs"]`` pairs).

    The pair of Figure 2 at the epoch ``width_epochs`` (a Figure 3 snapshot) stands for its
    own width when there is one, instead of training that pair again.
    """
    from pyperm import nn as pnn

    rows = []
    for label, name in fig4_models(scale, cfg, data):
        conv = not name.startswith("mlp")
        recipe, batch = ("sgd", CONV_BATCH) if conv else (cfg["recipe"], cfg["batch"])
        found: dict[str, list[float]] = {"naive": [], "matched": [], "acc_naive": [], "acc_matched": []}
        for pair in range(cfg["pairs"]):
            snap = cfg["width_epochs"]
            if pair == 0 and name == ends.name and snap in ends.snapshots[0]:
                model, sa, sb = ends.model, ends.snapshots[0][snap], ends.snapshots[1][snap]
            else:
                seeds = (1000 * seed + 100 + 2 * pair + 1, 1000 * seed + 100 + 2 * pair + 2)
                model, sa = train_endpoint(name, data, recipe, batch, cfg["width_epochs"], seeds[0], device, bar.hook())
                _, sb = train_endpoint(name, data, recipe, batch, cfg["width_epochs"], seeds[1], device, bar.hook())
            spec = model.permutation_spec()
            pb = pnn.apply_permutation(spec, pnn.weight_matching(spec, sa, sb, seed=seed).perms, sb)
            bn = data["train_eval"] if _has_batchnorm(model) else None  # statistics recomputed at every point
            r_naive = pnn.barrier(model, sa, sb, data["test"], num_points=cfg["points"], bn_data=bn)
            r_matched = pnn.barrier(model, sa, pb, data["test"], num_points=cfg["points"], bn_data=bn)
            found["naive"].append(r_naive.loss_barrier)
            found["matched"].append(r_matched.loss_barrier)
            found["acc_naive"].append(r_naive.accuracy_barrier)
            found["acc_matched"].append(r_matched.accuracy_barrier)
        n = cfg["pairs"]
        rows.append({"width": label, "model": name, "naive_loss_barrier": sum(found["naive"]) / n,
                     "weight_matching_loss_barrier": sum(found["matched"]) / n,
                     "naive_accuracy_barrier": sum(found["acc_naive"]) / n,
                     "weight_matching_accuracy_barrier": sum(found["acc_matched"]) / n, "pairs": n})  # fmt: skip
    return rows


def training_epochs(scale: str, cfg: dict, data: dict, fig2_name: str) -> list[tuple[str, int, int, str]]:
    """Every training run of the report as ``(model name, epochs, batch, recipe)`` (for the bar and the estimate)."""
    runs = [(fig2_name, cfg["epochs"], cfg["batch"], cfg["recipe"])] * max(2, cfg["models"])
    for _, name in fig4_models(scale, cfg, data):
        conv = not name.startswith("mlp")
        recipe, batch = ("sgd", CONV_BATCH) if conv else (cfg["recipe"], cfg["batch"])
        for pair in range(cfg["pairs"]):
            if pair == 0 and name == fig2_name and cfg["width_epochs"] in cfg["marks"]:
                continue
            runs += [(name, cfg["width_epochs"], batch, recipe)] * 2
    return runs
