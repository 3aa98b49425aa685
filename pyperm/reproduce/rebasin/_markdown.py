"""The Git Re-Basin report's plots, settings section and markdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyperm.reproduce.rebasin._settings import PAPER_LINES, RECIPES

__all__ = ["markdown", "plot", "plot_split", "settings", "split_section"]


def plot(out: Path, arch: str, data: dict, fig2: dict, fig3: list[dict], fig4: list[dict]) -> None:
    """fig2_test.png, fig2_train.png (the four paths), fig3_epochs.png and fig4_width.png."""
    from pyperm._plotting import plot_lines
    from pyperm.nn import plot_paths

    for split in ("test", "train"):
        plot_paths(fig2["results"][split], out / f"fig2_{split}.png",
                   title=f"{arch} on {data['name']}, {split} split (cf. Git Re-Basin Fig. 2)")  # fmt: skip
    plot_lines(
        out / "fig3_epochs.png",
        [r["epoch"] for r in fig3],
        [("loss barrier", {"naive (test)": [r["naive_test_loss_barrier"] for r in fig3],
                           "weight matching (test)": [r["weight_matching_test_loss_barrier"] for r in fig3],
                           "weight matching (train)": [r["weight_matching_train_loss_barrier"] for r in fig3]})],
        xlabel="training epoch", title=f"barrier vs training time, {arch} on {data['name']} (cf. Git Re-Basin Fig. 3)",
        logx=True,
    )  # fmt: skip

    def both(key: str, scale: float = 1.0) -> dict[str, list[float]]:
        return {"naive": [scale * r[f"naive_{key}"] for r in fig4],
                "weight matching": [scale * r[f"weight_matching_{key}"] for r in fig4]}  # fmt: skip

    numeric = all(str(r["width"]).isdigit() for r in fig4)  # MLP widths; else ResNet/VGG multipliers by name
    plot_lines(
        out / "fig4_width.png",
        [int(r["width"]) for r in fig4] if numeric else list(range(len(fig4))),
        [("test loss barrier", both("loss_barrier")), ("test accuracy barrier (pp)", both("accuracy_barrier", 100))],
        xlabel="hidden width" if numeric else "model: " + ", ".join(str(r["width"]) for r in fig4),
        title=f"loss barrier vs width on {data['name']} (cf. Git Re-Basin Fig. 4)",
        logx=numeric,
    )


_PATH_LABELS = {"naive": "naive", "weight": "weight matching", "activation": "activation matching",
                "ste": "STE matching"}
_MODEL_LABELS = {"A": "model A", "B": "model B", "union": "union model", "ensemble": "ensemble (logits, t = 0.5)",
                 "merged": "merged (weight matching)"}


def plot_split(out: Path, data: dict, split: dict) -> None:
    """fig5_split_loss.png and fig9_split_accuracy.png (the paths, the ensemble and the union model against t) and
    fig10_calibration.png (reliability diagrams)."""
    from pyperm._plotting import agg_figure, plot_lines, save_figure

    ts, paths, scores = split["ts"], split["paths"], split["scores"]
    where = f"split {data['name']}"  # the model is named in the report (a long MLP name would not fit)
    for name, key, ylabel, scale in (("fig5_split_loss.png", "loss", "test loss (both halves of the labels)", 1.0),
                                     ("fig9_split_accuracy.png", "accuracy", "test accuracy (%)", 100.0)):
        lines = {_PATH_LABELS[m]: [scale * float(v) for v in getattr(r, key)] for m, r in paths.items()}
        lines["ensemble (logits)"] = [scale * v for v in split["ensemble"][key]]
        union = scores["union"]["test_loss" if key == "loss" else "test_accuracy"]
        lines["union model"] = [scale * union] * len(ts)
        figure = "Fig. 5" if key == "loss" else "Fig. 9"
        plot_lines(out / name, ts, [(ylabel, lines)], xlabel="t (0: model A, 1: model B)",
                   title=f"{where}: A to B (cf. Git Re-Basin {figure})")  # fmt: skip

    fig = agg_figure(5.2, 4.8, layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([0, 1], [0, 1], color="grey", linestyle="dotted", label="perfect calibration")
    for key, marker in (("A", "o"), ("B", "s"), ("ensemble", "2"), ("merged", "^")):
        cal = scores[key]["calibration"]
        full = [r for r in cal["bins"] if r["count"]]
        label = _MODEL_LABELS[key] + (f", t = {split['best_t']:.2f}" if key == "merged" else "")
        ax.plot([r["confidence"] for r in full], [r["accuracy"] for r in full], marker=marker, markersize=4,
                label=f"{label}: ECE {cal['ece']:.3f}")  # fmt: skip
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (top probability), mean per bin")
    ax.set_ylabel("accuracy per bin")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.suptitle(f"{where}: calibration (cf. Git Re-Basin Fig. 10)")
    save_figure(fig, out / "fig10_calibration.png")


def split_section(data: dict, models: Any, split: dict, training_seconds: float) -> list[str]:
    """The lines of the report's sec. 5.4 section."""
    from pyperm._tables import markdown_table

    a, b = models.halves["A"], models.halves["B"]
    k = data["num_classes"] // 2
    rows = []
    for key, label in _MODEL_LABELS.items():
        r = split["scores"][key]
        if key == "merged":
            label += f", t = {split['best_t']:.2f}"
        rows.append([label, r["test_loss"], 100 * r["test_accuracy"], 100 * r["accuracy_first_half"],
                     100 * r["accuracy_second_half"], r["calibration"]["ece"]])  # fmt: skip
    mid = len(split["ts"]) // 2
    path_rows = []
    for m, r in split["paths"].items():
        best = int(r.loss.argmin())
        path_rows.append([_PATH_LABELS[m], float(r.loss[mid]), 100 * float(r.accuracy[mid]), float(r.loss[best]),
                          float(r.ts[best]), 100 * float(r.accuracy[best]), r.loss_barrier])  # fmt: skip
    ens = split["ensemble"]
    low = min(range(len(ens["loss"])), key=ens["loss"].__getitem__)
    path_rows.append(["ensemble (logits)", ens["loss"][mid], 100 * ens["accuracy"][mid], ens["loss"][low],
                      split["ts"][low], 100 * ens["accuracy"][low], None])  # fmt: skip
    sec = split["matching_seconds"]
    return [
        "## Sec. 5.4: merging models trained on different data (Figures 5, 9 and 10)",
        "",
        f"Model A trains on {a[0]} examples of the labels 0-{k - 1} and {a[1]} of {k}-{2 * k - 1}; model B on the "
        f"other {b[0]} and {b[1]}; the union model ({models.union_source}) on all of them. The paths run from A "
        "(t = 0) to B (t = 1) on the whole test split.",
        "",
        "![test loss](fig5_split_loss.png)",
        "",
        "![test accuracy](fig9_split_accuracy.png)",
        "",
        markdown_table(["path", "test loss at t = 0.5", "test accuracy at t = 0.5 (%)", "lowest test loss",
                        "at t", "test accuracy there (%)", "loss barrier"], path_rows),  # fmt: skip
        "",
        "![calibration](fig10_calibration.png)",
        "",
        markdown_table(["model", "test loss", "test accuracy (%)", f"accuracy on labels 0-{k - 1} (%)",
                        f"accuracy on labels {k}-{2 * k - 1} (%)", "ECE (15 bins)"], rows),  # fmt: skip
        "",
        "The merged model is the weight-matched path's point of lowest test loss strictly between A and B (chosen "
        "on the test split, as the paper's figure reads it). Matching time: "
        + ", ".join(f"{m} {s:.3f} s" for m, s in sec.items())
        + f". Time of the experiment: training {training_seconds:.1f} s, matching and evaluation "
        f"{split['seconds']:.1f} s.",
    ]


def _recipe(name: str) -> str:
    recipe = RECIPES[name]
    if recipe["optimizer"] == "adam":
        return f"Adam lr {recipe['lr']:g}, constant"
    decay = f", weight decay {recipe['weight_decay']:g}" if recipe.get("weight_decay") else ""
    return f"SGD momentum {recipe['momentum']}, lr {recipe['lr']:g} cosine-decayed{decay}"


def settings(scale: str, cfg: dict, data: dict, arch: str, fig2: dict, table: dict, seed: int, seconds: float,
             device: Any, split_models: Any, split: dict) -> str:
    """The Settings section: what ran, each setting at ``paper`` beside the paper's line, and what is scaled down."""
    from pyperm.reproduce._report import settings_section

    opt = _recipe(cfg["recipe"])
    half = data["num_classes"] // 2
    k = cfg["fig3_train_batches"]
    fig3_train = data["num_train_eval"] if k is None else min(data["num_train_eval"], k * cfg["eval_batch"])
    seeds = ", ".join(str(r["model"]).removeprefix("seed ") for r in table["rows"][:-2])
    ours = {
        "data": f"{data['description']} images; pixels scaled to [0, 1]",
        "model": f"{arch}, ReLU; every endpoint a fresh model from its own seed (every layer re-initialised)",
        "optimizer": opt,
        "epochs and batch": f"{cfg['epochs']} epochs, batches of {cfg['batch']}, a new seeded order every epoch",
        "trained to": "see Table 2 (training loss and accuracy of every model)",
        "paths": f"{cfg['points']} evenly spaced points; test split, and {data['num_train_eval']} training images",
        "STE": f"pyperm's ste_matching: Adam lr 1e-3, {cfg['ste_epochs']} epochs of batches of {cfg['ste_batch']} "
               f"({fig2['ste_steps']} steps), start at Theta_A, weight matching every step, best judged permutation",
        "merging": f"MergeMany of {cfg['models']} models (seeds {seeds}), "
                   f"{table['rounds']} rounds, converged: {table['converged']}",
        "barrier vs epoch": f"the Fig. 2 pair after epochs {cfg['marks']}; weight matching at each; test split and "
                            f"{fig3_train} training images",
        "barrier vs width": f"models {', '.join(str(w) for w in cfg['widths'])} (hidden width, {cfg['depth']} layers) "
                            f"on {data['name']}, {cfg['width_epochs']} epochs, {cfg['pairs']} pair(s) each",
        "split data": f"model A: {100 * cfg['split_fractions'][0]:g}% of the examples labelled 0-{half - 1} and "
                      f"{100 * cfg['split_fractions'][1]:g}% of those labelled {half}-{2 * half - 1} (drawn from "
                      f"seed {seed}); "
                      "model B the others",
        "split models": f"{split_models.setting['name']}: {_recipe(split_models.setting['recipe'])}, "
                        f"{split_models.setting['epochs']} epochs, batches of {split_models.setting['batch']}; "
                        f"A, B from seeds {split_models.seeds['A']}, {split_models.seeds['B']}; union model: "
                        f"{split_models.union_source}",
        "split comparisons": f"naive, weight, activation and STE matching ({split_models.setting['ste_epochs']} "
                             f"STE epochs, {split['ste_steps']} steps), the logit ensemble and the union model; "
                             f"{cfg['split_points']} points, on the whole test split",
        "calibration": "top-label expected calibration error over 15 equal-width confidence bins",
    }  # fmt: skip
    if scale == "paper":
        lines = {name: f"{value}  \n  *paper:* \"{PAPER_LINES[name][0]}\" ({PAPER_LINES[name][1]})"
                 if name in PAPER_LINES else value for name, value in ours.items()}  # fmt: skip
    else:
        lines = ours
    scaled = []
    if data["name"] == "digits":
        scaled.append("MNIST (60k 28x28 images) -> scikit-learn digits (1400 8x8 training images): pass "
                      "--data mnist:DIR for the paper's data")  # fmt: skip
    if scale != "paper":
        scaled.append(f"`--scale {scale}`: SGD with a cosine schedule and {cfg['epochs']} epochs, not the paper's "
                      "recipe (--scale paper)")  # fmt: skip
    scaled.append(f"STE: {cfg['ste_epochs']} epochs with Adam 1e-3 (authors' code: 250 epochs of SGD 1e-2); STE costs "
                  "a weight matching per step")  # fmt: skip
    if data["name"] in ("digits", "mnist") or scale != "paper":
        scaled.append("Fig. 4: MLPs of growing hidden width on the same data (the paper: VGG16 and ResNet20 on "
                      f"CIFAR-10), trained {cfg['width_epochs']} epochs")  # fmt: skip
    if split_models.setting["name"].startswith("mlp"):
        scaled.append(f"Sec. 5.4: Figure 2's MLP on {data['name']} split at label {half} (the paper: ResNet20 on "
                      f"CIFAR-100 split at 50), {split_models.setting['epochs']} epochs")  # fmt: skip
    else:
        scaled.append("Sec. 5.4: the authors' ResNet20 recipe without its 5 warm-up epochs and augmentation (random "
                      "crops, flips, rotations)")  # fmt: skip
    scaled.append("Fig. 10: the top-label reliability diagram of the test split (the authors' plot bins every "
                  "class's probability, on the training and the test split)")  # fmt: skip
    return settings_section(scale, lines, scaled, seconds, device)


def markdown(title: str, data: dict, fig2: dict, table: dict, fig3: list[dict], fig4: list[dict],
             found: list, settings_text: str, split_lines: list[str]) -> list[str]:
    """The lines of report.md."""
    from pyperm._tables import markdown_table
    from pyperm.reproduce._report import findings_section

    path_rows = []
    for split in ("test", "train"):
        for label, r in fig2["results"][split].items():
            mid = len(r.ts) // 2
            path_rows.append([split, label, r.loss_barrier, 100 * r.accuracy_barrier, float(r.loss[mid]),
                              100 * float(r.accuracy[mid]), float(r.loss[0]), float(r.loss[-1])])  # fmt: skip
    table_rows = [[r["model"], r["train_loss"], 100 * r["train_accuracy"], r["test_loss"], 100 * r["test_accuracy"]]
                  for r in table["rows"]]  # fmt: skip
    epoch_rows = [[r["epoch"], r["naive_test_loss_barrier"], r["weight_matching_test_loss_barrier"],
                   r["weight_matching_train_loss_barrier"], r["endpoint_test_loss"]] for r in fig3]  # fmt: skip
    width_rows = [[r["width"], r["naive_loss_barrier"], r["weight_matching_loss_barrier"],
                   100 * r["naive_accuracy_barrier"], 100 * r["weight_matching_accuracy_barrier"]]
                  for r in fig4]  # fmt: skip
    return [
        f"# Git Re-Basin on {data['name']}: linear mode connectivity after permuting",
        "",
        title + ".",
        "",
        findings_section(found),
        "",
        "## Figure 2: paths between two models",
        "",
        "![test split](fig2_test.png)",
        "",
        "![training split](fig2_train.png)",
        "",
        markdown_table(["split", "path", "loss barrier", "accuracy barrier (pp)", "midpoint loss",
                        "midpoint accuracy (%)", "loss at A", "loss at B"], path_rows),  # fmt: skip
        "",
        "Matching time: " + ", ".join(f"{m} {s:.3f} s" for m, s in fig2["seconds"].items()),
        "",
        "## Table 2: merging many models",
        "",
        markdown_table(["model", "train loss", "train accuracy (%)", "test loss", "test accuracy (%)"], table_rows),
        "",
        f"MergeMany: {table['seconds']:.2f} s, {table['rounds']} rounds.",
        "",
        "## Figure 3: barrier against training epoch",
        "",
        "![epochs](fig3_epochs.png)",
        "",
        markdown_table(["epoch", "naive test loss barrier", "weight-matching test loss barrier",
                        "weight-matching train loss barrier", "endpoints' mean test loss"], epoch_rows),  # fmt: skip
        "",
        "## Figure 4: barrier against width",
        "",
        "![width](fig4_width.png)",
        "",
        markdown_table(["width", "naive loss barrier", "weight-matching loss barrier", "naive accuracy barrier (pp)",
                        "weight-matching accuracy barrier (pp)"], width_rows),  # fmt: skip
        "",
        *split_lines,
        "",
        settings_text,
    ]
