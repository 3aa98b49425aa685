"""The parts every reproduction report shares: findings beside the paper's, settings, markdown."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pyperm._json import write_json
from pyperm._staging import write_text
from pyperm._tables import markdown_table

__all__ = ["Finding", "findings_section", "settings_section", "write_report"]


@dataclass
class Finding:
    """One claim of a paper, what we measured, and whether the two agree.

    Attributes
    ----------
    source : str
        Where the paper says it (``"Git Re-Basin Fig. 2"``).
    paper : str
        The paper's finding, in a sentence.
    ours : str
        Our measurement, with the numbers.
    agrees : bool
        Whether ours agrees, by the test stated in ``test``.
    test : str
        The criterion used for ``agrees``.
    """

    source: str
    paper: str
    ours: str
    agrees: bool
    test: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def findings_section(findings: list[Finding]) -> str:
    """A markdown table of the findings and a line saying how many agree (and which do not)."""
    rows = [[f.source, f.paper, f.ours, "yes" if f.agrees else "**no**", f.test] for f in findings]
    agree = sum(f.agrees for f in findings)
    lines = [
        "## The papers' findings and ours",
        "",
        markdown_table(["source", "paper", "ours", "agrees", "criterion"], rows),
        "",
        f"{agree} of {len(findings)} findings agree.",
    ]
    disagree = [f for f in findings if not f.agrees]
    if disagree:
        lines.append(
            "Where ours does not agree: " + "; ".join(f"{f.source}: {f.paper} (ours: {f.ours})" for f in disagree) + "."
        )
    return "\n".join(lines)


def settings_section(scale: str, settings: dict[str, Any], scaled_down: list[str], seconds: float, device: Any) -> str:
    """The settings used and where they are smaller than the paper's."""
    lines = [
        "## Settings",
        "",
        f"- scale: `{scale}`; device: {device}; {seconds:.1f} s on {platform.machine()} / Python {platform.python_version()}",
    ]
    lines += [f"- {k}: {v}" for k, v in settings.items()]
    if scaled_down:
        lines += ["", "Scaled down from the paper:", ""] + [f"- {s}" for s in scaled_down]
    return "\n".join(lines)


def write_report(
    out: Path,
    name: str,
    lines: list[str],
    findings: list[Finding],
    *,
    scale: str,
    seed: int,
    seconds: float,
    settings: dict[str, Any],
    **results: Any,
) -> Path:
    """Write ``report.md`` (``lines``) and ``report.json`` (the run's settings, ``results`` and
    findings) into ``out``; returns the markdown report's path."""
    write_text(out / "report.md", "\n".join(lines) + "\n")
    write_json(
        out / "report.json",
        {"report": name, "scale": scale, "seed": seed, "seconds": seconds, "settings": settings, **results,
         "findings": [f.to_dict() for f in findings]},
    )  # fmt: skip
    return out / "report.md"
