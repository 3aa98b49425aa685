"""Git Re-Basin's findings beside ours: each with the paper's number (where it prints one) and the criterion."""

from __future__ import annotations

import itertools

from pyperm.reproduce._report import Finding

__all__ = ["findings"]

ZERO = 0.05  # a test loss barrier below this counts as "zero-barrier"


def _figure2(fig2: dict) -> list[Finding]:
    test = fig2["results"]["test"]
    b = {label: r.loss_barrier for label, r in test.items()}
    # The methods are ranked on the training split: on the test split a barrier is 0 as soon as the
    # path dips below its chord (the convex landscapes of sec. 5.1), so test barriers cannot rank them.
    fit = {label: r.loss_barrier for label, r in fig2["results"]["train"].items()}
    methods = ("weight", "activation", "ste")
    sec = fig2["seconds"]
    out = [
        Finding("Git Re-Basin Fig. 2", "Naive interpolation substantially degrades performance (a loss barrier).",
                f"naive test loss barrier {b['naive']:.3f}, accuracy barrier "
                f"{100 * test['naive'].accuracy_barrier:.1f} pp", b["naive"] > ZERO, f"naive loss barrier > {ZERO}"),
        Finding("Git Re-Basin Fig. 2",
                "Weight, activation and STE matching all achieve much better barriers than naive interpolation.",
                ", ".join(f"{m} {b[m]:.3f}" for m in methods), all(b[m] < 0.5 * b["naive"] for m in methods),
                "each matched barrier < half the naive one"),
        Finding("Git Re-Basin Fig. 2, sec. 5.1",
                "Zero-barrier linear mode connectivity on MNIST with all three methods.",
                ", ".join(f"{m} {b[m]:.3f}" for m in methods), all(b[m] < ZERO for m in methods),
                f"each matched test loss barrier < {ZERO}"),
        Finding("Git Re-Basin sec. 5.1",
                "Activation matching performs just slightly less favorably than weight and STE matching.",
                f"training loss barrier: activation {fit['activation']:.4f} vs weight {fit['weight']:.4f}, STE "
                f"{fit['ste']:.4f}",
                fit["activation"] > min(fit["weight"], fit["ste"]),
                "activation's training loss barrier > the lower of weight's and STE's"),
        Finding("Git Re-Basin Fig. 2, sec. 5.1",
                "STE matching performs best but is very computationally expensive; weight matching is orders of "
                "magnitude faster.",
                f"training loss barrier: STE {fit['ste']:.4f} in {sec['ste']:.1f} s; weight {fit['weight']:.4f} in "
                f"{sec['weight']:.2f} s; activation {fit['activation']:.4f}",
                fit["ste"] <= min(fit["weight"], fit["activation"]) and sec["ste"] > 10 * sec["weight"],
                "STE's training loss barrier the lowest, and STE > 10x weight matching's time"),
    ]  # fmt: skip
    for m in ("weight", "ste"):
        r = test[m]
        mid = float(r.loss[len(r.ts) // 2])
        ends = min(float(r.loss[0]), float(r.loss[-1]))
        out.append(Finding("Git Re-Basin sec. 5.1",
                           f"The test loss landscape becomes convex after {m} matching: the interpolation yields a "
                           "merged model that outperforms both models A and B.",
                           f"{m}: midpoint test loss {mid:.4f} vs the better endpoint's {ends:.4f}", mid < ends,
                           "midpoint test loss < both endpoints' test losses"))  # fmt: skip
    return out


def _table2(table: dict) -> list[Finding]:
    rows = {r["model"]: r for r in table["rows"]}
    seeds = [r for r in table["rows"] if r["model"].startswith("seed ")]
    merged, naive = rows["MergeMany"], rows["naive average"]
    best = min(r["test_loss"] for r in seeds)
    mean_loss = sum(r["test_loss"] for r in seeds) / len(seeds)
    mean_acc = sum(r["test_accuracy"] for r in seeds) / len(seeds)
    cut = 1 - merged["test_loss"] / mean_loss
    return [
        Finding("Git Re-Basin Table 2",
                "Merging five MLPs with MergeMany decreases test loss by 43%: 0.0727 against 0.1108-0.1531 for "
                "the five models.",
                f"MergeMany {merged['test_loss']:.4f} against {best:.4f}-{max(r['test_loss'] for r in seeds):.4f} "
                f"({100 * abs(cut):.0f}% {'below' if cut >= 0 else 'above'} the models' mean)",
                merged["test_loss"] < best,
                "merged test loss < every model's"),
        Finding("Git Re-Basin Table 2, sec. 1",
                "The merged model outperforms the inputs in test loss but not in accuracy: 98.31% against "
                "98.54-98.71%.",
                f"MergeMany {100 * merged['test_accuracy']:.2f}% against the models' mean {100 * mean_acc:.2f}%",
                mean_acc - 0.01 <= merged["test_accuracy"] <= max(r["test_accuracy"] for r in seeds) + 0.002,
                "merged test accuracy within 1 pp below the models' mean, not clearly above the best"),
        Finding("Git Re-Basin sec. 5.4",
                "Merging modulo permutations vastly outperforms naive weight averaging.",
                f"test loss MergeMany {merged['test_loss']:.4f} vs naive average {naive['test_loss']:.4f}; "
                f"accuracy {100 * merged['test_accuracy']:.2f}% vs {100 * naive['test_accuracy']:.2f}%",
                merged["test_loss"] < 0.5 * naive["test_loss"], "merged test loss < half the naive average's"),
    ]  # fmt: skip


def _figure3(rows: list[dict]) -> list[Finding]:
    matched = [r["weight_matching_test_loss_barrier"] for r in rows]
    first, last = rows[0], rows[-1]
    return [
        Finding("Git Re-Basin Fig. 3, sec. 5.2",
                "Linear mode connectivity is challenging at initialization and manifests gradually throughout "
                "training.",
                f"weight-matched test barrier {matched[0]:.3f} after epoch {first['epoch']} -> {matched[-1]:.3f} "
                f"after epoch {last['epoch']}", matched[-1] < 0.5 * matched[0],
                "barrier after the last epoch < half the barrier after the first"),
    ]  # fmt: skip


def _figure4(rows: list[dict]) -> list[Finding]:
    matched = [r["weight_matching_loss_barrier"] for r in rows]
    drops = sum(later <= earlier + 1e-3 for earlier, later in itertools.pairwise(matched))
    return [
        Finding("Git Re-Basin Fig. 4, sec. 5.3",
                "Wider models exhibit better linear mode connectivity: the barrier after weight matching falls "
                "with width, towards zero.",
                f"weight-matched barrier {matched[0]:.3f} at width {rows[0]['width']} -> {matched[-1]:.3f} at width "
                f"{rows[-1]['width']}; non-increasing in {drops} of {len(matched) - 1} steps",
                matched[-1] < matched[0] and drops >= (len(matched) - 1) / 2,
                "barrier at the widest < at the narrowest, and non-increasing in at least half the steps"),
        Finding("Git Re-Basin Fig. 4, sec. 5.3",
                "Thin (1x) models do not seem to exhibit linear mode connectivity even after matching.",
                f"weight-matched barrier {matched[0]:.3f} at width {rows[0]['width']}", matched[0] > ZERO,
                f"barrier at the narrowest width > {ZERO}"),
    ]  # fmt: skip


def _split(split: dict) -> list[Finding]:
    scores, paths = split["scores"], split["paths"]
    weight, naive = paths["weight"], paths["naive"]
    merged_loss = split["scores"]["merged"]["test_loss"]  # the lowest point of the path strictly between A and B
    a, b, merged = scores["A"], scores["B"], scores["merged"]
    inputs = min(a["test_loss"], b["test_loss"])
    mid = len(weight.ts) // 2  # t = 0.5 with an odd number of points
    t_mid = float(weight.ts[mid])
    ens, union = scores["ensemble"]["test_loss"], scores["union"]["test_loss"]
    ece = {k: scores[k]["calibration"]["ece"] for k in ("A", "B", "merged", "ensemble")}
    where = f"t = {split['best_t']:.2f}"
    return [
        Finding("Git Re-Basin sec. 5.4, Fig. 5",
                "Merged by weight matching, two models trained on disjoint, biased data give an interpolated model "
                "that outperforms both input models in test loss on the combined test set.",
                f"weight-matched path's lowest test loss {merged_loss:.4f} at {where}; model A {a['test_loss']:.4f}, "
                f"model B {b['test_loss']:.4f}", merged_loss < inputs,
                "lowest test loss along the weight-matched path (0 < t < 1) < both inputs' test losses"),
        Finding("Git Re-Basin sec. 5.4, Fig. 5",
                "Algorithm 1 (weight matching) vastly outperforms naive interpolation.",
                f"test loss at t = {t_mid:.2f}: weight matching {float(weight.loss[mid]):.4f}, naive "
                f"{float(naive.loss[mid]):.4f}", float(weight.loss[mid]) < 0.5 * float(naive.loss[mid]),
                "weight-matched test loss at t = 0.5 < half the naive one"),
        Finding("Git Re-Basin sec. 5.4, Fig. 5",
                "The merged model does not match an ensemble of the two models' logits nor a model trained on the "
                "full dataset.",
                f"test loss: ensemble {ens:.4f}, union model {union:.4f}, merged (weight matching, {where}) "
                f"{merged_loss:.4f}", ens < merged_loss and union < merged_loss,
                "the ensemble's (t = 0.5) and the union model's test losses < the merged model's lowest"),
        Finding("Git Re-Basin sec. 1, Fig. 9",
                "The merged model outperforms both inputs in test loss but not in top-1 accuracy.",
                f"test accuracy: merged ({where}) {100 * merged['test_accuracy']:.2f}%, model A "
                f"{100 * a['test_accuracy']:.2f}%, model B {100 * b['test_accuracy']:.2f}%",
                merged["test_accuracy"] <= max(a["test_accuracy"], b["test_accuracy"]),
                "merged test accuracy at its lowest-loss point <= the better input's"),
        Finding("Git Re-Basin sec. 5.4, Fig. 10",
                "The merged model's probability estimates are better calibrated than either of the input models.",
                f"expected calibration error (15 bins): merged {ece['merged']:.4f}, model A {ece['A']:.4f}, model B "
                f"{ece['B']:.4f} (ensemble {ece['ensemble']:.4f})", ece["merged"] < min(ece["A"], ece["B"]),
                "merged ECE < both inputs' ECE"),
    ]  # fmt: skip


def findings(fig2: dict, table: dict, fig3: list[dict], fig4: list[dict], split: dict) -> list[Finding]:
    """Every finding of the report, in the paper's order."""
    return _figure2(fig2) + _table2(table) + _figure3(fig3) + _figure4(fig4) + _split(split)

