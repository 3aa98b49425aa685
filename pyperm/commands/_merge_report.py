"""The reports of ``pyperm merge`` (one process or over ranks): report.json's fields and report.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyperm._tables import markdown_table
from pyperm.commands._common import peak_memory_lines

__all__ = ["merge_markdown", "merge_report"]


def merge_report(ckpts: list, loaded: Any, result: Any, seconds: float, outputs: list[Path],
                 weights: list[float] | None = None, method: str = "mergemany") -> dict[str, Any]:  # fmt: skip
    """What report.json says of a merge (one process or over ranks); ``weights`` None: equal ones."""
    import torch

    report = {
        "command": "merge",
        "method": method,
        "inputs": [str(c.path) for c in ckpts],
        "weights": list(weights) if weights is not None else [1 / len(ckpts)] * len(ckpts),
        "model": loaded.name,
        # Per group, how many units each model's permutation moves (the first model's: none).
        "groups": [{"name": g, "size": int(n), "units_moved": [int((p[g] != torch.arange(n)).sum()) for p in result.perms]}
                   for g, n in loaded.spec.sizes.items()],  # fmt: skip
        "iterations": result.iterations,
        "converged": result.converged,
        "changed_per_round": list(result.history),
        "seconds": seconds,
        "outputs": [str(p) for p in outputs],
    }
    if method == "c2m3":
        report["c2m3"] = {"objective": result.final_objective, "relaxed_objective": result.objective,
                          "step_sizes": result.step_sizes, "cycle_error": result.cycle_error,
                          "kept_start": result.kept_start}  # fmt: skip
    return report


def merge_markdown(report: dict[str, Any]) -> str:
    """report.md of a merge."""
    lines = [
        f"# pyperm merge: {len(report['inputs'])} checkpoints of `{report['model']}`",
        "",
        f"- inputs: {', '.join(f'`{p}`' for p in report['inputs'])}",
        f"- weights (each aligned model's share of the merge): {', '.join(f'{w:g}' for w in report['weights'])}",
        (
            f"- {report['iterations']} Frank-Wolfe iterations of C2M3 (converged: {report['converged']}), "
            f"{report['seconds']:.3f} s; objective summed over pairs {report['c2m3']['objective']:.6g}, "
            f"cycle-consistency error {report['c2m3']['cycle_error']:g}"
            if report.get("method") == "c2m3" else
            f"- {report['iterations']} rounds of merge_many (converged: {report['converged']}), {report['seconds']:.3f} s;"
            f" permutations changed per round: {report['changed_per_round']}"
        ),
        f"- written: {', '.join(f'`{p}`' for p in report['outputs'])}",
    ]
    lines += peak_memory_lines(report.get("peak_rss_bytes", []))
    if "evaluation" in report:
        d = report["data"]
        lines += ["", f"## Test split of {d['name']} ({d['test_samples']} samples)", ""]
        rows = [[name, e["loss"], 100 * e["accuracy"]] for name, e in report["evaluation"].items()]
        lines.append(markdown_table(["model", "loss", "accuracy (%)"], rows))
    return "\n".join(lines) + "\n"
