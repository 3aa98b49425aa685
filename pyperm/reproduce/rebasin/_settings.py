"""The settings of the Git Re-Basin report per scale, and the paper's lines that state them.

``paper`` is Git Re-Basin's MNIST setting. The paper's text names the model (Table 1: "MLP
(3 layers, 512 width)") and the results; the recipe is in the authors' public code
(``src/mnist_mlp_train.py``: Adam at 1e-3, 100 epochs, batches of 500; ``mnist_mlp_ste2.py``
for STE), which :data:`PAPER_LINES` quotes beside each of our settings.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PAPER_LINES", "RECIPES", "SETTINGS", "fig4_models", "mlp_name", "split_setting"]

# How the endpoints are trained (train_classifier's options).
RECIPES = {
    # The laptop reports' recipe: SGD with momentum 0.9, the step 0.05 decayed to zero along a cosine.
    "sgd": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "schedule": "cosine"},
    # Git Re-Basin's MNIST MLPs (authors' mnist_mlp_train.py, --optimizer adam --learning-rate 1e-3).
    "adam": {"optimizer": "adam", "lr": 1e-3, "schedule": "constant"},
    # Git Re-Basin's CIFAR-100 ResNet20s (authors' cifar100_resnet20_train.py: SGD momentum 0.9 at 0.1 on a
    # cosine, weight decay 1e-4; their 5 warm-up epochs and augmentation are not reproduced).
    "resnet_sgd": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "schedule": "cosine", "weight_decay": 1e-4},
}

# Per scale. width/depth: Figure 2's MLP; recipe, batch, epochs: every endpoint's training;
# marks: the epochs at which Figure 3 snapshots the pair; ste_epochs/ste_batch: STE matching;
# points: points per path; widths/width_epochs/pairs: Figure 4; models: Table 2's MergeMany;
# eval_batch: evaluation batches; fig3_train_batches: batches of the training split in Figure 3
# (None: all). Sec. 5.4's split data (Figs. 5, 9, 10): split_fractions: model A's shares of the examples of
# the first and of the second half of the labels (B holds the rest); split_epochs: A's and B's training (Fig. 2's
# model and recipe), split_points: points per path; split_conv (paper scale on CIFAR): the paper's ResNet20
# instead, with its own recipe, batch and epochs.
SETTINGS: dict[str, dict[str, Any]] = {
    "smoke": {"width": 32, "depth": 2, "recipe": "sgd", "batch": 64, "epochs": 10, "marks": [1, 5, 10],
              "ste_epochs": 1, "ste_batch": 128, "points": 5, "widths": [4, 32], "width_epochs": 10, "pairs": 1,
              "models": 3, "eval_batch": 512, "fig3_train_batches": None,
              "split_fractions": (0.2, 0.8), "split_epochs": 10, "split_points": 5},
    "quick": {"width": 512, "depth": 3, "recipe": "sgd", "batch": 64, "epochs": 30, "marks": [1, 2, 5, 10, 20, 30],
              "ste_epochs": 5, "ste_batch": 128, "points": 11, "widths": [4, 8, 16, 32, 64, 128, 256, 512],
              "width_epochs": 30, "pairs": 2, "models": 5, "eval_batch": 512, "fig3_train_batches": None,
              "split_fractions": (0.2, 0.8), "split_epochs": 30, "split_points": 11},
    "full": {"width": 512, "depth": 3, "recipe": "sgd", "batch": 64, "epochs": 60, "marks": [1, 2, 5, 10, 20, 40, 60],
             "ste_epochs": 10, "ste_batch": 128, "points": 21, "widths": [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
             "width_epochs": 60, "pairs": 3, "models": 5, "eval_batch": 512, "fig3_train_batches": None,
             "split_fractions": (0.2, 0.8), "split_epochs": 60, "split_points": 25},
    "paper": {"width": 512, "depth": 3, "recipe": "adam", "batch": 500, "epochs": 100,
              "marks": [1, 2, 5, 10, 20, 50, 100], "ste_epochs": 10, "ste_batch": 1000, "points": 25,
              "widths": [8, 16, 32, 64, 128, 256, 512], "width_epochs": 20, "pairs": 1, "models": 5,
              "eval_batch": 10_000, "fig3_train_batches": 1,
              # Fig. 4 on CIFAR: the paper's models at width multipliers (VGG16's 8x "exhausted GPU memory").
              "conv_widths": {"resnet20": [1, 2, 4, 8, 16], "vgg16": [1, 2, 4]},
              # Sec. 5.4 on MNIST: the Fig. 2 MLP and recipe for 20 epochs (the paper has no MNIST split run; 20
              # epochs, as Fig. 4's, keep the report within a tenth of its time). The union model is then Fig. 2's
              # first endpoint after 20 epochs (under a constant step, the same run as training 20 epochs).
              "split_fractions": (0.2, 0.8), "split_epochs": 20, "split_points": 25,
              # On CIFAR: ResNet20 at the authors' width (their Fig. 5 plot reads the "width multiplier = 32" runs).
              # STE there: one epoch of the training batches (each step a weight matching of a 32x ResNet20).
              "split_conv": {"width": 32, "recipe": "resnet_sgd", "batch": 100, "epochs": 250, "ste_epochs": 1}},
}  # fmt: skip

# Each setting at --scale paper beside the line of the paper (or of the authors' code) that states it.
PAPER_LINES = {
    "data": ("We present results for models trained on MNIST (LeCun et al., 1998), CIFAR-10 ...",
             "Git Re-Basin sec. 5.1; the authors' code reads MNIST as bytes scaled to [0, 1]"),
    "model": ("MLP (3 layers, 512 width)", "Git Re-Basin Table 1; ReLU, as the authors' MLPModel"),
    "optimizer": ("tx = optax.adam(config.learning_rate), --learning-rate 1e-3",
                  "authors' mnist_mlp_train.py (the paper's text gives no recipe; A.1 lists 'Adam and too high of a "
                  "learning rate' as a failure mode)"),
    "epochs and batch": ("config.num_epochs = 100; config.batch_size = 500", "authors' mnist_mlp_train.py"),
    "trained to": ("Train Loss 0.0000, Train Acc. 1.0000 (every seed)", "Git Re-Basin Table 2"),
    "paths": ("lambdas = jnp.linspace(0, 1, num=25); train and test sets in full",
              "authors' mnist_mlp_*_matching.py / interp plots"),
    "STE": ("SGD lr 1e-2, momentum 0.9, batch 1000, 250 epochs, start at Theta_A, weight matching every step",
            "authors' mnist_mlp_ste2.py; Algorithm 2"),
    "merging": ("We train five separate MLPs on MNIST. Using Algorithm 3 we merge all these models",
                "Git Re-Basin Table 2"),
    "barrier vs epoch": ("loss barriers per training time for MLPs trained on MNIST", "Git Re-Basin Fig. 3"),
    "barrier vs width": ("Training convolutional and ResNet architectures on CIFAR-10, we ablate their width",
                         "Git Re-Basin Fig. 4 (VGG16, ResNet20)"),
    "split data": ("dataset A, containing 20% examples labelled 0-49 and 80% labelled 50-99, and dataset B, vice versa",
                   "Git Re-Basin sec. 5.4 (CIFAR-100)"),
    "split models": ("ResNet20 models A and B were trained on their corresponding datasets; SGD 0.1, momentum 0.9, "
                     "warmup cosine, weight decay 1e-4, 250 epochs, batch 100; width multiplier 32",
                     "Git Re-Basin sec. 5.4; authors' cifar100_resnet20_train.py and split-data plot"),
    "split comparisons": ("we benchmark naive weight interpolation, ensembling of the model logits, and full-data "
                          "training; lambdas = np.linspace(0, 1, 25)", "Git Re-Basin sec. 5.4, Fig. 5"),
    "calibration": ("num_bins = 15", "authors' cifar100_calibration_plot.py (Fig. 10)"),
}  # fmt: skip


def mlp_name(data: dict, width: int, depth: int) -> str:
    """The registry name of the MLP for ``data``'s images (``mlp:784,512,512,512,10``)."""
    n_in = 1
    for d in data["input_shape"]:
        n_in *= d
    return "mlp:" + ",".join(map(str, [n_in] + [width] * depth + [data["num_classes"]]))


def fig4_models(scale: str, cfg: dict, data: dict) -> list[tuple[str, str]]:
    """Figure 4's ``(label, model name)`` pairs, narrowest first.

    MLPs of growing hidden width, except at ``--scale paper`` on CIFAR, where the paper's
    own models are used (``cfg["conv_widths"]``: ResNet20 at width multipliers 1 to 16 and
    VGG16 at 1 to 4, its 8x "exhausted GPU memory", footnote 4), trained with the ``"sgd"``
    recipe (the paper's text gives none for them).
    """
    if scale == "paper" and data["name"] in ("cifar10", "cifar100"):
        k = data["num_classes"]
        return [(f"{arch}x{w}", f"{arch}:{w},num_classes={k}")
                for arch, widths in cfg["conv_widths"].items() for w in widths]  # fmt: skip
    return [(str(w), mlp_name(data, w, cfg["depth"])) for w in cfg["widths"]]


def split_setting(scale: str, cfg: dict, data: dict) -> dict[str, Any]:
    """Sec. 5.4's models A, B and the union model: ``name``, ``recipe``, ``batch``, ``epochs``, and STE
    matching's ``ste_epochs`` and ``ste_batch``.

    Figure 2's MLP and recipe for ``split_epochs``, except at ``--scale paper`` on CIFAR,
    where the paper's ResNet20 is trained with the authors' recipe (``cfg["split_conv"]``).
    """
    if scale == "paper" and data["name"] in ("cifar10", "cifar100"):
        conv = cfg["split_conv"]
        return {"name": f"resnet20:{conv['width']},num_classes={data['num_classes']}", "recipe": conv["recipe"],
                "batch": conv["batch"], "epochs": conv["epochs"], "ste_epochs": conv.get("ste_epochs", 1),
                "ste_batch": conv["batch"]}  # fmt: skip
    return {"name": mlp_name(data, cfg["width"], cfg["depth"]), "recipe": cfg["recipe"], "batch": cfg["batch"],
            "epochs": cfg["split_epochs"], "ste_epochs": cfg["ste_epochs"], "ste_batch": cfg["ste_batch"]}  # fmt: skip
