"""The Git Re-Basin report's plots, settings section and markdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyperm.reproduce.rebasin._settings import PAPER_LINES, RECIPES

__all__ = ["markdown", "plot", "settings"]


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


def settings(scale: str, cfg: dict, data: dict, arch: str, fig2: dict, table: dict, seed: int, seconds: float,
             device: Any) -> str:
    """The Settings section: what ran, each setting at ``paper`` beside the paper's line, and what is scaled down."""
    from pyperm.reproduce._report import settings_section

    recipe = RECIPES[cfg["recipe"]]
    opt = (f"Adam lr {recipe['lr']:g}, constant" if recipe["optimizer"] == "adam"
           else f"SGD momentum {recipe['momentum']}, lr {recipe['lr']:g} cosine-decayed")  # fmt: skip
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
    return settings_section(scale, lines, scaled, seconds, device)


def markdown(title: str, data: dict, fig2: dict, table: dict, fig3: list[dict], fig4: list[dict],
             found: list, settings_text: str) -> list[str]:
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
        settings_text,
    ]
