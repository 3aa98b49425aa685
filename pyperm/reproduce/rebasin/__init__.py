"""Git Re-Basin (Ainsworth et al., ICLR 2023): Figures 2, 3, 4, 5, 9, 10 and Table 2, on digits, MNIST or CIFAR.

Figure 2: the loss and accuracy along the linear path between two independently trained
MLPs, naively and after weight, activation and STE matching, on the test and the training
split. Table 2: MergeMany (Algorithm 3) of five MLPs against each of them and their naive
average. Figure 3: the barrier between the pair epoch by epoch. Figure 4: the barrier after
weight matching against width (MLPs of growing hidden width; at ``--scale paper`` on CIFAR,
the paper's ResNet20 and VGG16 at width multipliers). Sec. 5.4 (Figures 5, 9 and 10): two models
trained on disjoint, biased shares of the data (A: 20% of the examples of the first half of the
labels and 80% of the second half's; B the rest), merged along the naive, weight, activation and
STE paths, beside their logit ensemble and a model trained on all the data, with calibration.

``--scale paper --data mnist:DIR`` is the paper's MNIST setting (see ``_settings``); the
default is the laptop setting on scikit-learn's digits.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from pyperm.reproduce.rebasin._settings import SETTINGS

TITLE = ("Git Re-Basin Fig. 2 (naive, weight, activation and STE paths), Table 2 (MergeMany), Fig. 3 (barrier vs "
         "epoch), Fig. 4 (barrier vs width) and sec. 5.4 (split data: Figs. 5, 9 and 10)")
OUTPUTS = ("report.md", "report.json", "fig2_test.png", "fig2_train.png", "fig3_epochs.png", "fig4_width.png",
           "fig5_split_loss.png", "fig9_split_accuracy.png", "fig10_calibration.png")
DATASETS = ("digits", "mnist", "cifar10", "cifar100")

__all__ = ["DATASETS", "OUTPUTS", "SETTINGS", "TITLE", "estimate_seconds", "run"]


def _load(scale: str, data: str, device: Any) -> dict[str, Any]:
    from pyperm.reproduce._data import load_data

    cfg = SETTINGS[scale]
    return load_data(data, device, cfg["eval_batch"], ste=cfg["ste_batch"])


def estimate_seconds(scale: str, data: str = "digits", device: Any = "cpu") -> float:
    """The expected wall time of :func:`run` on this machine, from a few timed training steps of each model.

    Raises
    ------
    ValueError
        An unknown ``scale`` or a malformed ``data`` (as :func:`run`).
    """
    from pyperm.datasets import load_dataset
    from pyperm.reproduce._data import check_data
    from pyperm.reproduce._estimate import forward_seconds, step_seconds
    from pyperm.reproduce.rebasin._experiments import training_epochs
    from pyperm.reproduce.rebasin._settings import fig4_models, mlp_name

    cfg = _config(scale)
    name = check_data(data, DATASETS)
    ds = load_dataset(data)
    info = {"name": name, "input_shape": ds.input_shape, "num_classes": ds.num_classes}
    n_train, n_test = len(ds.y_train), len(ds.y_test)
    shape = ds.input_shape
    fig2 = mlp_name(info, cfg["width"], cfg["depth"])
    total = 0.0
    for model, epochs, batch, _ in training_epochs(scale, cfg, info, fig2):
        total += epochs * math.ceil(n_train / batch) * step_seconds(model, shape, batch, device)
    # STE: a training step and a weight matching (about as long again, measured on MNIST MLPs) per batch.
    ste_steps = cfg["ste_epochs"] * math.ceil(n_train / cfg["ste_batch"])
    total += 2 * ste_steps * step_seconds(fig2, shape, cfg["ste_batch"], device)
    k = cfg["fig3_train_batches"]
    fig3_train = n_train if k is None else min(n_train, k * cfg["eval_batch"])
    samples = cfg["points"] * (4 * (n_train + n_test) + len(cfg["marks"]) * (2 * n_test + fig3_train))
    samples += 2 * (cfg["models"] + 2) * (n_train + n_test)  # Table 2
    total += forward_seconds(fig2, shape, samples, device)
    for _, model in fig4_models(scale, cfg, info):
        total += forward_seconds(model, shape, cfg["pairs"] * 2 * cfg["points"] * (n_test + n_train), device)
    return total + _split_seconds(scale, cfg, info, fig2, n_train, n_test, device)


def _split_seconds(scale: str, cfg: dict, info: dict, fig2: str, n_train: int, n_test: int, device: Any) -> float:
    """Sec. 5.4's part of :func:`estimate_seconds`: A's, B's (and the union model's) training, STE, the paths."""
    from pyperm.reproduce._estimate import forward_seconds, step_seconds
    from pyperm.reproduce.rebasin._settings import split_setting
    from pyperm.reproduce.rebasin._split import split_runs

    shape = info["input_shape"]
    total = 0.0
    runs = split_runs(scale, cfg, info, fig2)
    model, batch = runs[0][0], runs[0][2]
    for _, epochs, _, _, share in runs:
        total += epochs * math.ceil(share * n_train / batch) * step_seconds(model, shape, batch, device)
    setting = split_setting(scale, cfg, info)
    ste_steps = setting["ste_epochs"] * math.ceil(n_train / setting["ste_batch"])
    total += 2 * ste_steps * step_seconds(model, shape, setting["ste_batch"], device)
    # Four paths on the test split (and BatchNorm statistics on the training split for a conv model), timed
    # from the training step's probe (a probe of a wide ResNet at another batch would take minutes on a CPU).
    per_point = n_test + (0 if model.startswith("mlp") else n_train)
    samples = 4 * cfg["split_points"] * per_point + 4 * n_test
    return total + forward_seconds(model, shape, samples, device, batch=batch)


def _config(scale: str) -> dict[str, Any]:
    if scale not in SETTINGS:
        raise ValueError(f"scale must be one of {', '.join(SETTINGS)}, got {scale!r}")
    return SETTINGS[scale]


def run(out: Path, scale: str, *, data: str = "digits", device: Any = "cpu", seed: int = 0,
        progress: bool = False, split_fractions: Any = None) -> Path:
    """Train the models, evaluate Figures 2-4, Table 2 and sec. 5.4 (Figures 5, 9, 10), write the report.

    Parameters
    ----------
    out : pathlib.Path
        An existing folder; :data:`OUTPUTS` are written into it.
    scale : {"smoke", "quick", "full", "paper"}
        The settings of :data:`SETTINGS`; ``"paper"`` is Git Re-Basin's MNIST recipe.
    data : str, default "digits"
        ``"digits"``, ``"mnist:DIR"``, ``"cifar10:DIR"`` or ``"cifar100:DIR"``.
    device : str or torch.device
        Where to train and evaluate.
    seed : int
        Offsets every training seed and seeds the matchings.
    progress : bool
        Progress bars (training epochs, STE steps, paths).
    split_fractions : pair of float, optional
        Sec. 5.4's split: model A's shares of the examples of the first and of the second
        half of the labels (B holds the rest); the scale's setting, the paper's
        ``(0.2, 0.8)``, when None.

    Returns
    -------
    pathlib.Path
        ``out / "report.md"``.

    Raises
    ------
    ValueError
        An unknown ``scale``, a malformed ``data``, a dataset file that is missing or
        malformed (named), or ``split_fractions`` outside [0, 1] or leaving A or B without
        examples.
    TypeError
        ``split_fractions`` not a pair of numbers.
    """
    import torch

    from pyperm.reproduce._report import write_report
    from pyperm.reproduce._splits import check_fractions, split_indices
    from pyperm.reproduce.rebasin import _experiments as ex
    from pyperm.reproduce.rebasin._findings import findings
    from pyperm.reproduce.rebasin import _split as sp
    from pyperm.reproduce.rebasin._markdown import markdown, plot, plot_split, settings, split_section
    from pyperm.reproduce.rebasin._settings import mlp_name

    cfg = _config(scale)
    if split_fractions is not None:
        cfg = cfg | {"split_fractions": check_fractions(split_fractions, "split_fractions")}
    start = time.perf_counter()
    torch.manual_seed(seed)  # nothing here draws from the global RNG; this pins anything a dependency might
    loaded = _load(scale, data, device)
    split_indices(loaded["y_train"], loaded["num_classes"], cfg["split_fractions"], seed)  # refused before training
    arch = mlp_name(loaded, cfg["width"], cfg["depth"])
    epochs = sum(e for _, e, _, _ in ex.training_epochs(scale, cfg, loaded, arch))
    epochs += sum(e for _, e, _, _, _ in sp.split_runs(scale, cfg, loaded, arch))
    bar = ex.EpochBar(progress, epochs)
    try:
        ends = ex.endpoints(cfg, loaded, device, seed, bar)
        fig4 = ex.figure4(scale, cfg, loaded, ends, device, seed, bar)
        split_start = time.perf_counter()
        split_models = sp.train_split_models(scale, cfg, loaded, ends, device, seed, bar)
        split_training = time.perf_counter() - split_start
    finally:
        bar.close()
    fig2 = ex.figure2(cfg, loaded, ends, seed, progress)
    fig3 = ex.figure3(cfg, loaded, ends, seed, progress)
    table = ex.table2(loaded, ends, seed, cfg["models"])
    split_result = sp.split_experiment(cfg, loaded, split_models, seed, progress)
    found = findings(fig2, table, fig3, fig4, split_result)
    seconds = time.perf_counter() - start

    plot(out, arch, loaded, fig2, fig3, fig4)
    plot_split(out, loaded, split_result)
    text = settings(scale, cfg, loaded, arch, fig2, table, seed, seconds, device, split_models, split_result)
    split_lines = split_section(loaded, split_models, split_result, split_training)
    return write_report(
        out, "rebasin", markdown(TITLE, loaded, fig2, table, fig3, fig4, found, text, split_lines), found,
        scale=scale, seed=seed, seconds=seconds, settings=cfg | {"data": loaded["name"], "model": arch},
        figure2={split: {label: r.to_dict() for label, r in res.items()} for split, res in fig2["results"].items()}
        | {"matching_seconds": fig2["seconds"]},
        table2=table, figure3=fig3, figure4=fig4,
        split_data=sp.split_json(split_models, split_result) | {"training_seconds": split_training},
    )  # fmt: skip
