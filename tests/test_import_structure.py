"""pyperm's import structure: no import cycles, no private names across package folders.

The graph is read from the source with :mod:`ast`, without importing pyperm. Only the
imports that run when a module is imported count (module level, class bodies, ``try`` and
``if`` blocks), not those inside functions (deferred on purpose, such as the tracer in
``PermutationSpec.from_model``) nor those under ``if TYPE_CHECKING:``.
``from pyperm.x import y`` is an edge to the module ``pyperm.x.y`` when ``y`` is a module,
else to ``pyperm.x``.

Two kinds of cycle are refused:

- between modules: ``a`` imports ``b`` imports ... imports ``a``;
- between the parts of one package (its modules and subpackages, each subpackage taken
  whole): ``pyperm/commands/`` importing ``pyperm/reproduce/`` while ``pyperm/reproduce/``
  imports ``pyperm/commands/`` is a cycle even when no module is on both sides. A package's
  ``__init__`` is not one of its parts: it re-exports them.

Layers hold for every import, deferred ones too: an import inside a function makes no cycle
when the module is imported, but it ties the layers together all the same (``pyperm/_comm.py``
importing ``RankFailedError`` from ``pyperm.distributed`` inside a function closed a circle of
eight files through the methods over ranks). :data:`LAYERS` names the parts that must never
import another, in any way.

Privacy follows Python's convention. A private module (``pyperm/nn/_checks.py``) serves its
package and every package below it. A private name defined in a module
(a ``_helper`` in ``pyperm/nn/spec.py``) serves the modules of that module's own folder only; a
neighbouring package that needs it needs a public name.

Run as a script to print what it finds (exit status 1 when it finds anything)::

    python tests/test_import_structure.py               # this checkout's pyperm/
    python tests/test_import_structure.py OTHER/pyperm  # another tree, e.g. a git worktree of an older commit
"""

from __future__ import annotations

import ast
import sys
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "pyperm"

# Private imports across package folders that stay, as (importing module, imported dotted name): why.
# Every entry is a name that should get a public spelling; keep the list short.
ALLOWED_PRIVATE: dict[tuple[str, str], str] = {}

# Parts that never import another, not even inside a function or for type checking only, as
# (lower part, higher part, why); a part is a module or a package with everything below it.
LAYERS: list[tuple[str, str, str]] = [
    ("pyperm._comm", "pyperm.nn", "the communication layer knows nothing of the methods"),
    ("pyperm._comm", "pyperm.distributed", "the public face hands the communication layer on; it is not imported back"),
    ("pyperm.nn", "pyperm.distributed", "the methods import the communication layer (pyperm._comm), not the public "
     "face built on them"),
]


@dataclass(frozen=True)
class Import:
    """One imported name: ``importer`` imports module ``target``, and ``name`` from it unless None."""

    importer: str
    target: str
    name: str | None
    path: Path
    line: int
    text: str

    @property
    def dotted(self) -> str:
        """What is imported, as one dotted name (``pyperm.nn.spec.entry_groups``)."""
        return self.target if self.name is None else f"{self.target}.{self.name}"

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root.parent)}:{self.line}: {self.text}"


Edges = dict[str, dict[str, Import]]  # node -> {node it imports: the first import making the edge}


@dataclass
class ImportGraph:
    """The modules of one package (dotted name -> file) and their import-time imports of it."""

    root: Path
    modules: dict[str, Path]  # source modules and compiled ones (their file is the binary)
    packages: set[str]
    imports: list[Import]  # those that run when the importer is imported
    deferred: list[Import] = field(default_factory=list)  # inside functions, or for type checking only

    def __repr__(self) -> str:  # short: pytest prints the fixture beside a failure
        return f"ImportGraph({str(self.root)!r}, {len(self.modules)} modules, {len(self.imports)} imports)"

    def folder(self, module: str) -> str:
        """The package whose folder holds ``module``'s file (a package's own name for its ``__init__``)."""
        return module if module in self.packages else module.rpartition(".")[0]

    def module_edges(self) -> Edges:
        out: Edges = {m: {} for m in self.modules}
        for imp in self.imports:
            if imp.target in self.modules and imp.target != imp.importer:
                out[imp.importer].setdefault(imp.target, imp)
        return out

    def part_edges(self) -> Edges:
        """Edges between the parts (modules, subpackages) of one package: the part holding the
        importer imports the part holding the target, both below their closest common package."""
        out: Edges = {}
        for imp in self.imports:
            if imp.target not in self.modules:
                continue
            a, b = imp.importer.split("."), imp.target.split(".")
            # The closest package holding both: a package's __init__ belongs to the package itself.
            depth = 0
            while depth < min(len(a), len(b)) and a[depth] == b[depth]:
                depth += 1
            if depth == len(a) or depth == len(b):
                continue  # one is the other's package (or the same module): not two parts of one package
            src, dst = ".".join(a[: depth + 1]), ".".join(b[: depth + 1])
            out.setdefault(src, {}).setdefault(dst, imp)
            out.setdefault(dst, {})
        return out


# --------------------------------------------------------------------------- reading the source


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported (nested blocks flattened)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node  # binds its name; its body runs when called
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_time(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _import_time([n for n in inner if isinstance(n, ast.AST)])


def _bound_names(statements: list[ast.stmt]) -> set[str]:
    """The names a module binds at import time (to tell ``from pkg import x`` of a name from that of a submodule)."""
    names: set[str] = set()
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            targets += [item.optional_vars for item in getattr(node, "items", [])]
            names.update(n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name of ``from <node.module> import ...`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def build_graph(root: Path) -> ImportGraph:
    """Parse every module of the package at ``root`` and collect its import-time imports of the package."""
    root = Path(root).resolve()
    top = root.name
    sources = {_module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    packages = {_module_name(root, p) for p in root.rglob("__init__.py")}
    with warnings.catch_warnings():  # a bad escape in a docstring is not this check's business
        warnings.simplefilter("ignore")
        trees = {m: ast.parse(p.read_text(encoding="utf-8"), filename=str(p)) for m, p in sources.items()}
    statements = {m: list(_import_time(tree.body)) for m, tree in trees.items()}
    bound = {m: _bound_names(statements[m]) for m in packages}
    modules = dict(sources)
    imports, deferred = [], []
    for module, path in sources.items():
        source = path.read_text(encoding="utf-8")
        at_import = {id(node) for node in statements[module]}
        every = sorted((n for n in ast.walk(trees[module]) if isinstance(n, (ast.Import, ast.ImportFrom))),
                       key=lambda n: (n.lineno, n.col_offset))  # fmt: skip
        for node in every:
            text = " ".join(ast.get_source_segment(source, node).split())
            if isinstance(node, ast.Import):
                found = [(alias.name, None) for alias in node.names]
            else:
                base, found = _absolute(module, module in packages, node), []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub not in sources and base in packages and alias.name not in bound[base] | {"*"}:
                        modules.setdefault(sub, path)  # not bound by the package: a compiled submodule (_core)
                    found.append((sub, None) if sub in modules else (base, None if alias.name == "*" else alias.name))
            for target, name in found:
                if target == top or target.startswith(top + "."):
                    (imports if id(node) in at_import else deferred).append(
                        Import(module, target, name, path, node.lineno, text))
    return ImportGraph(root, modules, packages, imports, deferred)


# --------------------------------------------------------------------------- the checks


def _cycles(edges: Edges) -> list[list[tuple[str, Import]]]:
    """One cycle per group of nodes that reach each other (a strongly connected component):
    the shortest way round from the group's first node, as (node, the import it makes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(edges):  # Tarjan's algorithm, iterative (no recursion limit to mind)
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = stack[stack.index(v):]
                del stack[stack.index(v):]
                if len(component) > 1:
                    components.append(sorted(component))
    cycles = []
    for component in sorted(components):
        members, start = set(component), component[0]
        came_from: dict[str, tuple[str, Import]] = {}
        frontier, closing = [start], None
        while closing is None:  # breadth first: the shortest way back to start
            nxt = []
            for v in frontier:
                for w, imp in sorted(edges[v].items()):
                    if w == start and closing is None:
                        closing = (v, imp)
                    elif w in members and w != start and w not in came_from:
                        came_from[w] = (v, imp)
                        nxt.append(w)
            frontier = nxt
        path = [closing]
        while path[0][0] != start:
            path.insert(0, came_from[path[0][0]])
        cycles.append(path)
    return cycles


def find_cycles(graph: ImportGraph) -> list[list[tuple[str, Import]]]:
    """Cycles between modules, then cycles between the parts of a package that involve a subpackage
    (a cycle of plain modules is a cycle between modules, found already)."""
    parts = [c for c in _cycles(graph.part_edges()) if any(node in graph.packages for node, _ in c)]
    return _cycles(graph.module_edges()) + parts


def private_imports(graph: ImportGraph, allowed: dict[tuple[str, str], str] | None = None) -> list[tuple[Import, str]]:
    """The imports of a private name from outside the place it serves, with the reason each is refused."""
    allowed = ALLOWED_PRIVATE if allowed is None else allowed
    found, seen = [], set()
    for imp in graph.imports:
        if (imp.importer, imp.dotted) in allowed:
            continue
        parts = imp.dotted.split(".")
        for i, part in enumerate(parts):
            if not part.startswith("_") or (part.startswith("__") and part.endswith("__")):
                continue
            owner, private = ".".join(parts[:i]), ".".join(parts[: i + 1])
            if private in graph.modules:  # a private module: for its package and the packages below
                why = None if imp.importer == owner or imp.importer.startswith(owner + ".") else (
                    f"{private} is a private module of {owner}")  # fmt: skip
            else:  # a private name: for its module's folder
                why = None if graph.folder(imp.importer) == graph.folder(owner) else (
                    f"{part} is private to {owner}, in folder {graph.folder(owner)}")  # fmt: skip
            if why is not None:
                if (imp.path, imp.line, private) not in seen:  # once per statement and private name
                    seen.add((imp.path, imp.line, private))
                    found.append((imp, why))
                break
    return found


def _within(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def layer_breaks(graph: ImportGraph, layers: list[tuple[str, str, str]] | None = None) -> list[tuple[Import, str]]:
    """The imports, deferred ones included, of a higher part from a lower one, with the layer's reason."""
    layers = LAYERS if layers is None else layers
    found = []
    for imp in graph.imports + graph.deferred:
        for lower, higher, why in layers:
            if _within(imp.importer, lower) and _within(imp.target, higher):
                found.append((imp, f"{lower} never imports {higher}: {why}"))
    return sorted(found, key=lambda f: (str(f[0].path), f[0].line))


def describe_cycle(cycle: list[tuple[str, Import]], root: Path) -> str:
    nodes = [node for node, _ in cycle] + [cycle[0][0]]
    return " -> ".join(nodes) + "".join(f"\n    {imp.where(root)}" for _, imp in cycle)


def report(graph: ImportGraph, layers: list[tuple[str, str, str]] | None = None) -> str:
    """The cycles, private imports and imports across a layer (:data:`LAYERS` unless given) of ``graph``, for people."""
    cycles = find_cycles(graph)
    private = private_imports(graph)
    layers = layer_breaks(graph, layers)
    lines = [f"import cycles: {len(cycles)}"]
    lines += ["  " + describe_cycle(cycle, graph.root).replace("\n", "\n  ") for cycle in cycles]
    lines.append(f"private names imported across package folders: {len(private)}")
    lines += [f"  {imp.where(graph.root)}\n    ({why})" for imp, why in private]
    lines.append(f"imports across a layer (deferred ones too): {len(layers)}")
    lines += [f"  {imp.where(graph.root)}\n    ({why})" for imp, why in layers]
    return "\n".join(lines)


# --------------------------------------------------------------------------- pyperm itself


@pytest.fixture(scope="module")
def pyperm_graph() -> ImportGraph:
    return build_graph(PACKAGE_DIR)


def test_the_graph_covers_the_package(pyperm_graph):
    # A reader that silently saw nothing would pass every check below.
    assert {"pyperm", "pyperm.nn.spec", "pyperm.nn.trace.tracer", "pyperm.lap", "pyperm._core"} <= set(
        pyperm_graph.modules
    )
    assert "pyperm.nn.spec" in pyperm_graph.module_edges()["pyperm.nn.trace.tracer"]


def test_no_import_cycles(pyperm_graph):
    cycles = find_cycles(pyperm_graph)
    if cycles:
        message = "\n".join(describe_cycle(cycle, pyperm_graph.root) for cycle in cycles)
        pytest.fail(f"{len(cycles)} import cycle(s) in pyperm:\n{message}", pytrace=False)


def test_the_layers_hold_for_deferred_imports_too(pyperm_graph):
    assert any(imp.importer == "pyperm._comm" for imp in pyperm_graph.deferred)  # the reader sees inside functions
    found = layer_breaks(pyperm_graph)
    if found:
        message = "\n".join(f"{imp.where(pyperm_graph.root)}  ({why})" for imp, why in found)
        pytest.fail(f"{len(found)} import(s) across a layer:\n{message}", pytrace=False)


def test_no_private_names_across_package_folders(pyperm_graph):
    found = private_imports(pyperm_graph)
    if found:
        message = "\n".join(f"{imp.where(pyperm_graph.root)}  ({why})" for imp, why in found)
        pytest.fail(f"{len(found)} private import(s) from outside the importer's package folder:\n{message}",
                    pytrace=False)


def test_the_allow_list_has_no_stale_entries(pyperm_graph):
    present = {(imp.importer, imp.dotted) for imp in pyperm_graph.imports}
    assert set(ALLOWED_PRIVATE) <= present, "allowed private imports that no longer exist: remove them"


# --------------------------------------------------------------------------- the checker, on made-up packages


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def test_a_module_cycle_is_found_with_the_imports_that_close_it(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import f\n",
        "b.py": "import os\nfrom pkg import c\n",
        "c.py": "import pkg.a\n",
        "d.py": "from pkg.a import g\n",  # imports into the cycle without being in it
    })  # fmt: skip
    graph = build_graph(root)
    cycles = _cycles(graph.module_edges())
    assert [[node for node, _ in c] for c in cycles] == [["pkg.a", "pkg.b", "pkg.c"]]
    assert [imp.target for _, imp in cycles[0]] == ["pkg.b", "pkg.c", "pkg.a"]  # `from pkg import c` is pkg.c
    assert cycles[0][1][1].where(root) == "pkg/b.py:2: from pkg import c"
    assert "pkg.a -> pkg.b -> pkg.c -> pkg.a" in report(graph)
    assert find_cycles(graph) == cycles  # the modules are the package's parts: the same cycle, once


def test_a_cycle_between_subpackages_is_found_without_a_module_cycle(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "commands/__init__.py": "",
        "commands/_common.py": "X = 1\n",
        "commands/run.py": "from pkg.reports import REPORTS\n",
        "reports/__init__.py": "REPORTS = {}\n",
        "reports/write.py": "from pkg.commands._common import X\n",
        "nn/__init__.py": "from pkg.nn.spec import Spec\nSIZE = 1\n",
        "nn/spec.py": "from pkg.nn import SIZE\n",  # a module cycle through the package's __init__
        "nn/align.py": "from pkg.nn.spec import Spec\n",  # a part importing its sibling, not back
    })  # fmt: skip
    graph = build_graph(root)
    assert [[node for node, _ in c] for c in _cycles(graph.part_edges())] == [["pkg.commands", "pkg.reports"]]
    assert [[node for node, _ in c] for c in _cycles(graph.module_edges())] == [["pkg.nn", "pkg.nn.spec"]]
    text = report(graph)
    assert "pkg.commands -> pkg.reports -> pkg.commands" in text
    assert "pkg/commands/run.py:1: from pkg.reports import REPORTS" in text
    assert "pkg/reports/write.py:1: from pkg.commands._common import X" in text


def test_deferred_and_type_checking_imports_are_no_edges(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "spec.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.trace import trace
            else:
                import json

            def from_model():
                from pkg.trace import trace
            class Spec:
                def build(self):
                    import pkg.trace
        """,
        "trace.py": "from pkg.spec import Spec\n",
    })  # fmt: skip
    graph = build_graph(root)
    assert find_cycles(graph) == []
    assert {imp.target for imp in graph.imports} == {"pkg.spec"}
    assert [(imp.importer, imp.target, imp.line) for imp in graph.deferred] == [
        ("pkg.spec", "pkg.trace", 4), ("pkg.spec", "pkg.trace", 9), ("pkg.spec", "pkg.trace", 12),
    ]  # fmt: skip


def test_a_layer_is_broken_by_a_deferred_import_too(tmp_path):
    # The circle of pyperm's ranks code, in small: the lower layer reached the face only inside a function.
    root = _package(tmp_path, {
        "__init__.py": "",
        "_comm.py": """
            def shared_errors():
                from pkg.distributed import RankFailedError
        """,
        "distributed/__init__.py": "from pkg._comm import shared_errors\nfrom pkg.methods.ranks import merge\n",
        "methods/__init__.py": "",
        "methods/ranks.py": "from pkg._comm import shared_errors\n",
        "methods/data.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.distributed\n",
    })  # fmt: skip
    graph = build_graph(root)
    assert find_cycles(graph) == []  # no cycle when modules are imported: the import-time check misses it
    layers = [("pkg._comm", "pkg.methods", "a"), ("pkg._comm", "pkg.distributed", "b"),
              ("pkg.methods", "pkg.distributed", "c")]  # fmt: skip
    found = [(imp.where(root), why) for imp, why in layer_breaks(graph, layers)]
    assert found == [
        ("pkg/_comm.py:3: from pkg.distributed import RankFailedError", "pkg._comm never imports pkg.distributed: b"),
        ("pkg/methods/data.py:3: import pkg.distributed", "pkg.methods never imports pkg.distributed: c"),
    ]  # fmt: skip
    assert "imports across a layer (deferred ones too): 2" in report(graph, layers)


def test_import_time_blocks_count(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from . import a\nfrom pkg import _core\n",  # _core: compiled, no source
        "a.py": """
            try:
                from .b import x
            except ImportError:
                x = None
            class K:
                from pkg import b
        """,
        "b.py": "if True:\n    from pkg.a import K\n",
    })  # fmt: skip
    graph = build_graph(root)
    assert {(imp.importer, imp.dotted) for imp in graph.imports} == {
        ("pkg", "pkg.a"), ("pkg", "pkg._core"), ("pkg.a", "pkg.b.x"), ("pkg.a", "pkg.b"), ("pkg.b", "pkg.a.K"),
    }  # fmt: skip
    assert [[node for node, _ in c] for c in find_cycles(graph)] == [["pkg.a", "pkg.b"]]


def test_private_names_serve_their_folder_and_private_modules_their_tree(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "_util.py": "def helper(): pass\n",
        "spec.py": "def _groups(): pass\n",
        "same.py": "from pkg.spec import _groups\nfrom pkg._util import helper\n",
        "sub/__init__.py": "from pkg.sub.impl import run\n",
        "sub/_impl_detail.py": "X = 1\n",
        "sub/impl.py": """
            from pkg.spec import _groups
            from pkg import _util
            from pkg.sub._impl_detail import X
            from pkg.sub import _impl_detail
        """,
        "other/__init__.py": "",
        "other/user.py": "from pkg.sub._impl_detail import X, Y\nimport pkg._util\n",
    })  # fmt: skip
    graph = build_graph(root)
    found = {(imp.importer, imp.dotted): why for imp, why in private_imports(graph, allowed={})}
    assert found == {
        ("pkg.sub.impl", "pkg.spec._groups"): "_groups is private to pkg.spec, in folder pkg",
        ("pkg.other.user", "pkg.sub._impl_detail.X"): "pkg.sub._impl_detail is a private module of pkg.sub",
    }  # one line for X and Y: both come from the one private module
    allowed = {("pkg.sub.impl", "pkg.spec._groups"): "why", ("pkg.other.user", "pkg.sub._impl_detail.X"): "why",
               ("pkg.other.user", "pkg.sub._impl_detail.Y"): "why"}  # fmt: skip
    assert private_imports(graph, allowed=allowed) == []


if __name__ == "__main__":
    graph = build_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE_DIR)
    print(report(graph))
    sys.exit(1 if find_cycles(graph) or private_imports(graph) or layer_breaks(graph) else 0)
