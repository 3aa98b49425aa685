"""``pyperm align|merge --model hf`` on diffusers pipeline folders (``model_index.json``).

A pipeline is aligned or merged component by component. Each model component (a folder with a
``config.json`` and weights whose library is diffusers or transformers: the UNet, the VAE, the text
encoders) runs through the command itself on the component folders, as if the user had named them,
with its own reports in ``OUT/<component>/``; its weights go into the output pipeline,
``OUT/<B>_permuted/`` (align) or ``OUT/merged/`` (merge). Everything else (scheduler, tokenizer,
feature extractor, a safety checker, the top-level files) is copied from B (align) or from the first
pipeline (merge); ``model_index.json`` last, so that a run that fails part way leaves no folder that
looks like a whole pipeline. ``OUT/report.json`` and ``OUT/report.md`` name each component's groups
and objective.

Both sides must be pipelines of one class listing the same components with the same classes, and
every listed component folder must exist: otherwise a CommandError names the file.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pyperm.commands._common import CommandError, peak_memory_lines
from pyperm.commands._diffusers import read_json_object

__all__ = ["INDEX", "Component", "is_pipeline", "read_pipelines", "run_pipeline"]

INDEX = "model_index.json"
#: The libraries whose components are models pyperm reads (the others are copied).
MODEL_LIBRARIES = ("diffusers", "transformers")
_PAST = {"align": "aligned", "merge": "merged"}


@dataclass(frozen=True)
class Component:
    """One entry of a pipeline's model_index.json: ``name`` (the sub-folder), its library and class."""

    name: str
    library: str
    class_name: str


def is_pipeline(path: str | Path) -> bool:
    """Whether ``path`` is a diffusers pipeline folder (``model_index.json``, no ``config.json`` of its own)."""
    folder = Path(path)
    return folder.is_dir() and (folder / INDEX).is_file() and not (folder / "config.json").is_file()


def _read_index(folder: Path) -> tuple[str, list[Component]]:
    """The pipeline class and the components (null entries left out) of ``folder``'s model_index.json."""
    index = folder / INDEX
    data = read_json_object(index)
    if not isinstance(data.get("_class_name"), str):
        raise CommandError(f"--model hf: {index} is not a diffusers pipeline index (no _class_name)")
    components = []
    for name, value in data.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] is None:
            continue  # _class_name, _diffusers_version, options such as requires_safety_checker, null components
        components.append(Component(name, str(value[0]), str(value[1])))
    return data["_class_name"], components


def read_pipelines(paths: list[str]) -> tuple[str, list[Component]]:
    """The pipeline class and components of the folders ``paths``, checked to be pipelines of one class with the
    same components, each present on disk; a CommandError names the file otherwise."""
    folders = [Path(p) for p in paths]
    first = folders[0]
    for folder in folders:
        if not is_pipeline(folder):
            raise CommandError(f"--model hf: {folder} is not a diffusers pipeline folder (no {INDEX}) but {first} "
                               f"is: give pipeline folders on every side, or component folders on every side")  # fmt: skip
    class_name, components = _read_index(first)
    for folder in folders[1:]:
        other_class, others = _read_index(folder)
        if other_class != class_name:
            raise CommandError(f"--model hf: {folder / INDEX} is a {other_class} but {first / INDEX} is a {class_name}")
        mine, theirs = {c.name: c for c in components}, {c.name: c for c in others}
        for name in sorted(mine.keys() | theirs.keys()):
            if name not in theirs:
                raise CommandError(f"--model hf: {folder / INDEX} lists no component {name!r}, which {first / INDEX} "
                                   f"lists ({mine[name].class_name})")  # fmt: skip
            if name not in mine:
                raise CommandError(f"--model hf: {folder / INDEX} lists a component {name!r} "
                                   f"({theirs[name].class_name}) that {first / INDEX} does not")  # fmt: skip
            if mine[name].class_name != theirs[name].class_name:
                raise CommandError(f"--model hf: {folder / INDEX} has a {theirs[name].class_name} as {name!r}, "
                                   f"{first / INDEX} a {mine[name].class_name}")  # fmt: skip
    for folder in folders:
        for c in components:
            if not (folder / c.name).is_dir():
                raise CommandError(f"--model hf: {folder / c.name} is missing: {folder / INDEX} lists the component "
                                   f"{c.name!r} ({c.class_name})")  # fmt: skip
    return class_name, components


def _is_model(folder: Path, component: Component) -> bool:
    """Whether a component folder holds a model pyperm aligns: a config.json and weights, from diffusers or
    transformers (a tokenizer, a scheduler or a safety checker is copied)."""
    from pyperm.commands._hf import is_weights

    return (component.library in MODEL_LIBRARIES and (folder / "config.json").is_file()
            and any(is_weights(p) for p in folder.iterdir()))  # fmt: skip


def _copies(source: Path, dest: Path, models: set[str]) -> list[tuple[Path, Path]]:
    """Every file of the pipeline ``source`` outside its model components, with its place under ``dest``;
    ``model_index.json`` last."""
    pairs = [(p, dest / p.relative_to(source)) for p in sorted(source.rglob("*"))
             if p.is_file() and p.relative_to(source).parts[0] not in models]  # fmt: skip
    return sorted(pairs, key=lambda pair: pair[0].name == INDEX and pair[0].parent == source)


@dataclass
class PipelineRun:
    """What one command does with pipelines: its name, the component run, the inputs and the output's name."""

    command: str
    inputs: list[str]
    copy_from: str  # the pipeline whose other components are copied
    output_name: str  # the output pipeline's folder in --out
    component_args: Callable[[argparse.Namespace, list[str]], None]  # puts the component folders into the args
    run_one: Callable[[argparse.Namespace], int]  # the command's own run, undecorated


def run_pipeline(args: argparse.Namespace, job: PipelineRun) -> int:
    """Run ``job`` on every model component of the pipelines, copy the rest, write the pipeline's reports."""
    from pyperm._json import write_json
    from pyperm._memory import peak_resident
    from pyperm._staging import write_text
    from pyperm.commands._hf import copy_files
    from pyperm.commands._over_ranks import launched

    if launched():
        raise CommandError(f"--model hf: pipeline folders are {_PAST[job.command]} in one process; under torchrun give "
                           f"one component folder at a time")  # fmt: skip
    # Pipelines are weight-matched (align) or merged by MergeMany (merge): each command's default method.
    if getattr(args, "data", None) or getattr(args, "method", "weight") not in ("weight", "mergemany"):
        raise CommandError(f"--model hf: pipeline folders are {_PAST[job.command]} by weight matching without --data; "
                           f"give a component folder for the other methods")  # fmt: skip
    if len(job.inputs) < 2:
        raise CommandError(f"{job.command} needs at least two pipelines, got {len(job.inputs)}")
    class_name, components = read_pipelines(job.inputs)
    source = Path(job.copy_from)
    out = Path(args.out)
    dest = out / job.output_name
    inputs = {Path(p).resolve() for p in job.inputs}
    if dest.resolve() in inputs or any(p in inputs for p in dest.resolve().parents):
        raise CommandError(f"--out {out}: the output pipeline {dest} would be an input's folder; choose another --out")
    models = [c for c in components if _is_model(source / c.name, c)]
    copies = _copies(source, dest, {c.name for c in models})
    for name in ["report.json", "report.md"] + [str(d.relative_to(out)) for _, d in copies]:
        if (out / name).exists() and not args.force:
            raise CommandError(f"{out / name}: exists; pass --force to overwrite it")

    rows = []
    for c in models:
        sub = argparse.Namespace(**vars(args))
        job.component_args(sub, [str(Path(p) / c.name) for p in job.inputs])
        sub.out = str(out / c.name)
        sub.output_stem = f"../{job.output_name}/{c.name}"  # the weights into the output pipeline
        print(f"{c.name} ({c.class_name}):")
        try:
            job.run_one(sub)
        except CommandError as exc:
            raise CommandError(f"component {c.name!r} ({c.class_name}): {exc}") from exc
        report = json.loads((out / c.name / "report.json").read_text())
        rows.append(_component_row(c, report))
    for c in components:
        if c not in models:
            rows.append({"name": c.name, "class": c.class_name, "action": f"copied from {source / c.name}"})
    dest.mkdir(parents=True, exist_ok=True)
    for _, d in copies:
        d.parent.mkdir(parents=True, exist_ok=True)
    copy_files(copies)  # model_index.json last

    # The process's peak: every component ran in it, one after another.
    report = {"command": job.command, "pipeline": class_name, "inputs": job.inputs, "output": str(dest),
              "components": rows, "peak_rss_bytes": [peak_resident()]}  # fmt: skip
    write_json(out / "report.json", report)
    write_text(out / "report.md", _markdown(report))
    print(f"pipeline ({class_name}): {dest}")
    print(f"report: {out / 'report.md'}")
    return 0


def _component_row(c: Component, report: dict[str, Any]) -> dict[str, Any]:
    """What the pipeline's report says of one model component, from the component's own report.json."""
    row: dict[str, Any] = {"name": c.name, "class": c.class_name, "action": _PAST[report["command"]],
                           "report": f"{c.name}/report.md", "groups": report.get("groups", [])}  # fmt: skip
    if report["command"] == "align":
        info = report["matching"]
        row["objective"] = {"before": info["identity_objective"], "after": info["objective"],
                            "sweeps": info.get("iterations")}  # fmt: skip
        row["max_output_change_of_b"] = report["max_output_change_of_b"]
    else:
        row["rounds"] = report["iterations"]
        row["converged"] = report["converged"]
    return row


def _markdown(report: dict[str, Any]) -> str:
    from pyperm._tables import markdown_table

    align = report["command"] == "align"
    lines = [f"# pyperm {report['command']}: {report['pipeline']} pipelines, component by component", "",
             f"- inputs: {', '.join(f'`{p}`' for p in report['inputs'])}", f"- written: `{report['output']}`",
             *peak_memory_lines(report.get("peak_rss_bytes", [])), ""]  # fmt: skip
    rows = []
    for r in report["components"]:
        if "groups" not in r:
            rows.append([r["name"], r["class"], r["action"], "", "", ""])
            continue
        units = sum(g["size"] for g in r["groups"])
        if align:
            o = r["objective"]
            rows.append([r["name"], r["class"], f"aligned ([report]({r['report']}))", f"{len(r['groups'])} ({units} units)",
                         f"{o['before']:.6g} -> {o['after']:.6g}", r["max_output_change_of_b"]])  # fmt: skip
        else:
            rows.append([r["name"], r["class"], f"merged ([report]({r['report']}))", f"{len(r['groups'])} ({units} units)",
                         f"{r['rounds']} rounds, converged: {r['converged']}", ""])  # fmt: skip
    last = ["objective vec(A).vec(pi(B))", "largest change of B's outputs"] if align else ["merge_many", ""]
    lines.append(markdown_table(["component", "class", "done", "groups", *last], rows))
    for r in report["components"]:
        if r.get("groups"):
            lines += ["", f"## {r['name']}: groups", ""]
            head = ["group", "units", "units moved"]
            lines.append(markdown_table(head, [[g["name"], g["size"], g["units_moved"]] for g in r["groups"]]))
    return "\n".join(lines) + "\n"
