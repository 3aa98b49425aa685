"""Write the API reference pages from the public modules' ``__all__`` before Sphinx reads the sources.

One page per module (its docstring and a summary table) and one per public name, under
``docs/api/generated/`` (not in git). A name that several modules export is documented
once, under the first module of ``MODULES`` that exports it, so the reference follows the
package's own public names as they are, with nothing to update by hand when one is added,
renamed or removed.

A cross-reference may name an object by any path it can be imported from
(``pyperm.nn.eval.batchnorm.reset_bn_stats``, as the docstrings do): it resolves to the
page of the same object under its public name (``pyperm.nn.reset_bn_stats``).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from sphinx.util import logging

logger = logging.getLogger(__name__)

# (module, title, names): names None means the module's __all__.
MODULES: list[tuple[str, str, list[str] | None]] = [
    ("pyperm", "pyperm: assignment, Birkhoff-von Neumann, cross-correlation", None),
    ("pyperm.lap", "pyperm.lap: assignment in pipelines (lap's lapjv, torch operators)", None),
    ("pyperm.nn", "pyperm.nn: specs, alignment, barriers, curves", None),
    ("pyperm.nn.models", "pyperm.nn.models: the bundled models", None),
    ("pyperm.nn.spec", "pyperm.nn.spec: structured axes", ["Segments", "Tiled", "Blocks", "Interleaved"]),
    ("pyperm.nn.align", "pyperm.nn.align: alignment methods", None),
    ("pyperm.nn.eval", "pyperm.nn.eval: barriers, BatchNorm, REPAIR, robustness", None),
    ("pyperm.nn.curves", "pyperm.nn.curves: mode-connecting curves", None),
    ("pyperm.nn.state", "pyperm.nn.state: state-dict operations", None),
    ("pyperm.nn.trace", "pyperm.nn.trace: the tracer and its rules", None),
    ("pyperm.teacher_student", "pyperm.teacher_student: the two-layer teacher-student analysis", None),
    ("pyperm.datasets", "pyperm.datasets: digits, MNIST and CIFAR-10 files", None),
    ("pyperm.checkpoints", "pyperm.checkpoints: reading and writing checkpoints", None),
    ("pyperm.distributed", "pyperm.distributed: weight matching and merging over ranks", None),
]


def _heading(text: str, char: str = "=") -> str:
    return f"{text}\n{char * len(text)}\n"


def _write(path: Path, text: str) -> None:
    """Write only on a change, so an unchanged page is not rebuilt."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _kind(obj: Any) -> str | None:
    if inspect.ismodule(obj):
        return None  # sub-packages get their own page (or none)
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if callable(obj):
        return "function"
    return "data"


def _stub(module: str, name: str, kind: str) -> str:
    directive = {"class": "autoclass", "exception": "autoexception", "function": "autofunction", "data": "autodata"}
    lines = [_heading(name), f".. currentmodule:: {module}", "", f".. {directive[kind]}:: {name}"]
    if kind == "class":
        lines.append("   :members:")
    return "\n".join(lines) + "\n"


# id(object) -> the public name it is documented under (filled by write_reference).
DOCUMENTED: dict[int, str] = {}


def _import(path: str) -> Any:
    """The object at a dotted path (a module, then attributes), or None."""
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except Exception:
            continue
        try:
            for name in parts[k:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def resolve_alias(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """A Python cross-reference to another import path of a documented object: link to its page."""
    if node.get("refdomain") != "py" or not node.get("reftarget", "").startswith("pyperm."):
        return None
    obj = _import(node["reftarget"])
    public = DOCUMENTED.get(id(obj)) if obj is not None else None
    if public is None or public == node["reftarget"]:
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], public, node, contnode)


def write_reference(app: Any) -> None:
    out = Path(app.srcdir) / "api" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    seen = DOCUMENTED
    seen.clear()
    keep: set[str] = set()
    for module_name, title, names in MODULES:
        module = importlib.import_module(module_name)
        if names is None:
            names = list(getattr(module, "__all__", []))
        rows = []
        for name in names:
            obj = getattr(module, name, None)
            if obj is None:
                logger.warning("api reference: %s has no public name %r", module_name, name)
                continue
            kind = _kind(obj)
            if kind is None or id(obj) in seen:
                continue
            seen[id(obj)] = f"{module_name}.{name}"
            rows.append(name)
            stub = f"{module_name}.{name}"
            keep.add(stub)
            _write(out / f"{stub}.rst", _stub(module_name, name, kind))
        body = [
            f".. _api-{module_name}:",
            "",
            _heading(title),
            f".. automodule:: {module_name}",
            "   :no-members:",
            "",
            f".. currentmodule:: {module_name}",
            "",
        ]
        if rows:
            body += [".. autosummary::", "   :nosignatures:", ""] + [f"   {r}" for r in rows] + [""]
            body += [".. toctree::", "   :hidden:", ""] + [f"   {module_name}.{r}" for r in rows] + [""]
        keep.add(module_name)
        _write(out / f"{module_name}.rst", "\n".join(body))
    for old in out.glob("*.rst"):  # names that are no longer public
        if old.stem not in keep:
            old.unlink()


def setup(app: Any) -> dict[str, Any]:
    # Before autosummary's own builder-inited handler (priority 500) reads the sources.
    app.connect("builder-inited", write_reference, priority=400)
    app.connect("missing-reference", resolve_alias)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
