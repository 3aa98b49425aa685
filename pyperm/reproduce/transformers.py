"""Transformers: the barrier between two independently trained models, naive and after alignment.

Two settings that need no download, each with two models trained from different seeds:

- character-level GPT-2s (Hugging Face ``GPT2LMHeadModel``, bytes as characters) trained on the
  Python standard library's source files and evaluated on held-out files;
- small ViTs (``ViTForImageClassification``, 2x2 patches) on scikit-learn's 8x8 digits.

For each, the loss along the linear path between the two models: naive, after weight matching,
after activation matching, and after weight matching with REPAIR at the midpoint (whose
statistics are LayerNorm's here). The spec is traced (``PermutationSpec.from_model``): the
residual stream, the MLP's hidden units, the attention heads and the head dimensions.

The published findings this is set beside: Verma and Elbayad ("Merging Text Transformer Models
from Different Initializations", TMLR 2024) align BERT-style models trained from different
initialisations and find that alignment lowers the barrier of the naive average markedly but does
not remove it (a barrier remains, unlike for wide MLPs and CNNs); Imfeld et al. ("Transformer
Fusion with Optimal Transport", ICLR 2024) find the same for ViTs: fused (aligned) models are far
better than the naive average, yet need fine-tuning to match the endpoints. Needs transformers.
"""

from __future__ import annotations

import logging
import sysconfig
import time
from pathlib import Path
from typing import Any

TITLE = "Transformers: barriers of character-level GPT-2s (Python's own source) and ViTs (digits), naive and aligned"
OUTPUTS = ("report.md", "report.json", "gpt2_paths.png", "vit_paths.png")

__all__ = ["OUTPUTS", "TITLE", "run"]

logger = logging.getLogger(__name__)

# Per scale: the GPT-2's layers, width, context, training steps and text (bytes); the ViT's layers,
# width and epochs; the points of every path.
SETTINGS = {
    "smoke": {"gpt2_layers": 1, "gpt2_width": 32, "context": 32, "gpt2_epochs": 1, "text_bytes": 200_000,
              "vit_layers": 1, "vit_width": 32, "vit_epochs": 3, "points": 3},
    "quick": {"gpt2_layers": 2, "gpt2_width": 128, "context": 64, "gpt2_epochs": 1, "text_bytes": 1_000_000,
              "vit_layers": 2, "vit_width": 64, "vit_epochs": 40, "points": 9},
    "full": {"gpt2_layers": 4, "gpt2_width": 256, "context": 128, "gpt2_epochs": 4, "text_bytes": 4_000_000,
             "vit_layers": 4, "vit_width": 128, "vit_epochs": 100, "points": 17},
}  # fmt: skip
INTRO = ("Two pairs of transformers, each trained from two seeds on data that needs no download: character-level "
         "GPT-2s (Hugging Face `GPT2LMHeadModel`, bytes as characters) on the Python standard library's own source "
         "files, evaluated on held-out files, and small ViTs (`ViTForImageClassification`, 2x2 patches) on "
         "scikit-learn's 8x8 digits. For each: the loss along the straight path between the two models, naively, "
         "after weight matching, after activation matching, and after weight matching with REPAIR at every point "
         "(LayerNorm statistics). The spec is traced (`PermutationSpec.from_model`, through torch.export): the "
         "residual stream, the MLP's hidden units, the attention heads and the head dimensions.")
HEADS = 4
BATCH = 32
EVAL_BATCHES = 8  # held-out text batches of every evaluation (and of activation matching, REPAIR)
METHODS = ("naive", "weight", "activation", "weight + REPAIR", "weight + REPAIR with q, k, v")


def _transformers() -> Any:
    from pyperm._optional_imports import import_torchvision

    import_torchvision()  # transformers imports torchvision when it is installed
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("pyperm reproduce transformers needs transformers: pip install 'pyperm[hf]'") from exc
    return transformers


# ------------------------------------------------------------------ data


def python_source_text(size: int) -> bytes:
    """``size`` bytes of the standard library's own ``.py`` files, in sorted order (no download)."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(folder.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= size:
            break
    return b"".join(chunks)[:size]


def text_batches(text: bytes, context: int, batch: int, device: Any) -> tuple[Any, Any]:
    """Inputs and next-byte targets, ``(n, context)`` int64 each, of non-overlapping windows of ``text``."""
    import torch

    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n = (ids.numel() - 1) // context
    x = ids[: n * context].view(n, context)
    y = ids[1 : n * context + 1].view(n, context)
    return x.to(device), y.to(device)


# ------------------------------------------------------------------ models


def _char_gpt(cfg: dict, seed: int) -> Any:
    import torch
    from torch import nn

    transformers = _transformers()
    config = transformers.GPT2Config(vocab_size=256, n_positions=cfg["context"], n_embd=cfg["gpt2_width"],
                                     n_layer=cfg["gpt2_layers"], n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip

    class CharGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.gpt(ids).logits.transpose(1, 2)

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return CharGPT()


def _vit(cfg: dict, seed: int) -> Any:
    import torch

    from pyperm.nn.models import single_output

    transformers = _transformers()
    config = transformers.ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=cfg["vit_width"],
                                    num_hidden_layers=cfg["vit_layers"], num_attention_heads=HEADS,
                                    intermediate_size=2 * cfg["vit_width"], num_labels=10, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return single_output(transformers.ViTForImageClassification(config))


# ------------------------------------------------------------------ the experiment


def _paths(model: Any, sa: dict, sb: dict, train: list, test: list, points: int, seed: int) -> dict[str, Any]:
    """The paths of :data:`METHODS` on ``test``, their matching seconds, and the traced spec's summary."""
    from pyperm.nn import PermutationSpec, activation_matching, barrier, weight_matching
    from pyperm.reproduce._train import loaded_copy

    example = train[0][0][:2]
    spec = PermutationSpec.from_model(model, example)
    results, seconds = {"naive": barrier(model, sa, sb, test, num_points=points)}, {}
    start = time.perf_counter()
    by_weight = weight_matching(spec, sa, sb, seed=seed).perms.apply(sb)
    seconds["weight"] = time.perf_counter() - start
    results["weight"] = barrier(model, sa, by_weight, test, num_points=points)
    start = time.perf_counter()
    model_a, model_b = loaded_copy(model, sa).eval(), loaded_copy(model, sb).eval()
    by_activation = activation_matching(model_a, model_b, spec, [x for x, _ in train]).perms.apply(sb)
    seconds["activation"] = time.perf_counter() - start
    results["activation"] = barrier(model, sa, by_activation, test, num_points=points)
    repair_error = None
    try:
        results["weight + REPAIR"] = _repaired_path(model, spec, sa, by_weight, train, test, points, False)
        results["weight + REPAIR with q, k, v"] = _repaired_path(model, spec, sa, by_weight, train, test, points,
                                                                 True)  # fmt: skip
    except ValueError as exc:  # no site of this model can take a folded correction
        repair_error = str(exc)
        logger.warning("transformers: REPAIR is not available here: %s", exc)
    units = sum(spec.sizes.values())
    return {"results": results, "seconds": seconds, "groups": len(spec.sizes), "units": units,
            "repair_error": repair_error}  # fmt: skip


def _repaired_path(model: Any, spec: Any, sa: dict, sb: dict, train: list, test: list, points: int,
                   attention: bool) -> Any:
    """The path of REPAIR's model: at every inner point t, the interpolation with its units'
    statistics renormalised (:func:`~pyperm.nn.repair`; ``attention``: the query, key and value
    units too); the endpoints as they are."""
    import warnings

    import numpy as np

    from pyperm.nn import BarrierResult, repair
    from pyperm.nn.eval.path import chord
    from pyperm.reproduce._train import evaluate, loaded_copy

    inputs = [x for x, _ in train]
    ts = np.linspace(0.0, 1.0, points)
    losses, accuracies = [], []
    for t in ts:
        with warnings.catch_warnings():  # units REPAIR cannot correct are listed in the report
            warnings.simplefilter("ignore", RuntimeWarning)
            state = (repair(model, spec, sa, sb, inputs, t=float(t), attention=attention) if 0.0 < t < 1.0
                     else (sa if t == 0 else sb))  # fmt: skip
        loss, accuracy = evaluate(loaded_copy(model, state), test)
        losses.append(loss)
        accuracies.append(accuracy)
    loss, accuracy = np.array(losses), np.array(accuracies)
    return BarrierResult(ts=ts, loss=loss, accuracy=accuracy, loss_barrier=float(np.max(loss - chord(ts, loss))),
                         accuracy_barrier=float(np.max(chord(ts, accuracy) - accuracy)),
                         num_samples=sum(len(y) for _, y in test), bn_reset=False)  # fmt: skip


def _gpt2_setting(cfg: dict, device: Any, seed: int) -> dict[str, Any]:
    """Two character-level GPT-2s on Python's source, their paths on held-out files."""
    from pyperm.nn._training import train_classifier

    text = python_source_text(cfg["text_bytes"])
    cut = int(0.9 * len(text))
    x, y = text_batches(text[:cut], cfg["context"], BATCH, device)
    hx, hy = text_batches(text[cut:], cfg["context"], BATCH, device)
    test = [(hx[i : i + BATCH], hy[i : i + BATCH]) for i in range(0, min(len(hx), EVAL_BATCHES * BATCH), BATCH)]
    train = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, EVAL_BATCHES * BATCH, BATCH)]
    states, models = [], []
    for k in range(2):
        model = _char_gpt(cfg, seed + k).to(device)
        states.append(train_classifier(model, (x, y), epochs=cfg["gpt2_epochs"], lr=3e-3, seed=seed + k,
                                       batch_size=BATCH, schedule="cosine"))  # fmt: skip
        models.append(model)
    out = _paths(models[0], states[0], states[1], train, test, cfg["points"], seed)
    out["data"] = {"train_bytes": cut, "held_out_bytes": len(text) - cut, "context": cfg["context"]}
    return out


def _vit_setting(cfg: dict, device: Any, seed: int) -> dict[str, Any]:
    """Two ViTs on digits, their paths on the test split."""
    from pyperm.nn._training import train_classifier
    from pyperm.reproduce._train import digits_data

    data = digits_data(device, 256, train=256)
    states, models = [], []
    for k in range(2):
        model = _vit(cfg, seed + k).to(device)
        states.append(train_classifier(model, (data["x_train"], data["y_train"]), epochs=cfg["vit_epochs"], lr=2e-3,
                                       seed=seed + k, batch_size=64, schedule="cosine"))  # fmt: skip
        models.append(model)
    out = _paths(models[0], states[0], states[1], data["train"], data["test"], cfg["points"], seed)
    out["data"] = {"train_samples": data["num_train"], "test_samples": data["num_test"]}
    return out


def _findings(gpt2: dict, vit: dict) -> list:
    from pyperm.reproduce._report import Finding

    findings = []
    for name, setting, source in (("GPT-2", gpt2, "Verma and Elbayad 2024"), ("ViT", vit, "Imfeld et al. 2024")):
        r = setting["results"]
        naive, weight, activation = (r[m].loss_barrier for m in ("naive", "weight", "activation"))
        best = min(weight, activation)
        findings.append(Finding(
            source, f"aligning {name}s trained from different initialisations lowers the barrier of the naive path",
            f"loss barrier naive {naive:.3f}, weight matching {weight:.3f}, activation matching {activation:.3f}",
            best < naive, "the better alignment's barrier below the naive one"))  # fmt: skip
        findings.append(Finding(
            source, f"a barrier remains after aligning {name}s (unlike wide MLPs and CNNs)",
            f"best aligned barrier {best:.3f} ({best / naive:.0%} of the naive {naive:.3f})" if naive > 0 else
            f"best aligned barrier {best:.3f}",
            best > 0.01, "the best aligned barrier above 0.01"))  # fmt: skip
    return findings


def _plot(out: Path, gpt2: dict, vit: dict) -> None:
    from pyperm.nn import plot_paths

    plot_paths(gpt2["results"], out / "gpt2_paths.png", title="character-level GPT-2s: held-out loss along the path")
    plot_paths(vit["results"], out / "vit_paths.png", title="ViTs on digits: test loss along the path")


def _table(setting: dict) -> list[str]:
    from pyperm._tables import markdown_table

    rows = []
    for method in (m for m in METHODS if m in setting["results"]):
        r = setting["results"][method]
        seconds = setting["seconds"].get(method.split(" ")[0])
        rows.append([method, f"{r.loss[0]:.4f}", f"{r.loss[len(r.ts) // 2]:.4f}", f"{r.loss[-1]:.4f}",
                     f"{r.loss_barrier:.4f}", f"{100 * r.accuracy_barrier:.2f}",
                     "" if seconds is None or "REPAIR" in method else f"{seconds:.2f}"])  # fmt: skip
    lines = [markdown_table(["path", "loss at A", "loss at the midpoint", "loss at B", "loss barrier",
                             "accuracy barrier (pp)", "matching s"], rows)]  # fmt: skip
    if setting["repair_error"]:
        lines += ["", f"REPAIR could not run on this model: {setting['repair_error']}"]
    return lines


def run(out: Path, scale: str, *, device: Any = "cpu", seed: int = 0, progress: bool = False) -> Path:
    """Train the two pairs, evaluate their paths, write the report (see the module notes).

    Parameters
    ----------
    out : pathlib.Path
        An existing folder; :data:`OUTPUTS` are written into it.
    scale : {"smoke", "quick", "full"}
        The settings of :data:`SETTINGS`.
    device : str or torch.device
        Where to train and evaluate.
    seed : int
        The first model's seed (the second's is ``seed + 1``); seeds the matchings.
    progress : bool
        Unused (the runs are short); kept for the common signature.

    Returns
    -------
    pathlib.Path
        ``out / "report.md"``.
    """
    from pyperm.reproduce._report import findings_section, settings_section, write_report

    cfg = SETTINGS[scale]
    start = time.perf_counter()
    gpt2 = _gpt2_setting(cfg, device, seed)
    vit = _vit_setting(cfg, device, seed)
    findings = _findings(gpt2, vit)
    seconds = time.perf_counter() - start
    _plot(out, gpt2, vit)
    lines = [f"# {TITLE}", "", INTRO, "",
             f"## Character-level GPT-2s ({cfg['gpt2_layers']} layers, width {cfg['gpt2_width']}, {HEADS} heads)", "",
             f"Traced spec: {gpt2['groups']} groups, {gpt2['units']} units. Loss in nats per byte on held-out files.",
             "", *_table(gpt2), "", "![GPT-2 paths](gpt2_paths.png)", "",
             f"## ViTs on digits ({cfg['vit_layers']} layers, width {cfg['vit_width']}, {HEADS} heads)", "",
             f"Traced spec: {vit['groups']} groups, {vit['units']} units.", "", *_table(vit), "",
             "![ViT paths](vit_paths.png)", "", findings_section(findings), "",
             "REPAIR corrects the statistics of the units it can fold a correction into: the LayerNorms' affine and "
             "the MLP's first layer, and with `attention=True` the query, key and value projections too.", "",
             settings_section(scale, cfg, ["models of 1-4 layers and widths of 32-256, trained for minutes on a CPU "
                                           "(the papers: BERT-base and ViT-B sized models, trained for days)"],
                              seconds, device)]  # fmt: skip
    results = {name: {"results": {m: r.to_dict() for m, r in s["results"].items()}, "matching_seconds": s["seconds"],
                      "groups": s["groups"], "units": s["units"], "data": s["data"], "repair_error": s["repair_error"]}
               for name, s in (("gpt2", gpt2), ("vit", vit))}  # fmt: skip
    return write_report(out, "transformers", lines, findings, scale=scale, seed=seed, seconds=seconds, settings=cfg,
                        **results)  # fmt: skip
