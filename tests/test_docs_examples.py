"""Every Python code block of README.md and of the documentation's pages runs, in order, as a reader pastes it.

Blocks are ```` ```python ```` fences in README.md and ``.. code-block:: python`` directives
in ``docs/**/*.rst``. The blocks of one file run in order in one namespace, in a temporary
working directory (so an example that writes a file writes it there): one test per block,
so a failure names its file, block and line. A block that needs names from earlier blocks
gets them by running those first, also when it is selected alone (``-k``); a block after
a failed one is skipped, naming the failure.

A block that cannot run on every machine carries an explicit marker right before it,
an RST comment in the docs or an HTML comment in README.md:

``.. docs-test: cuda`` / ``<!-- docs-test: cuda -->``
    needs a CUDA GPU and pyperm's CUDA kernels; runs where they are, skipped (with the
    reason) elsewhere. Such a block defines nothing that later blocks use.
``.. docs-test: skip REASON`` / ``<!-- docs-test: skip REASON -->``
    never run (e.g. it needs files the reader has and CI has not); the reason is shown.

The gallery scripts (``docs/examples/plot_*.py``) run in the documentation build
(``.ci/docs``); here they are only compiled.
"""

from __future__ import annotations

import os
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Generated or build output folders under docs/, never sources of examples.
SKIP_DIRS = {"_build", "auto_examples", "generated", "_templates", "_ext"}

MARKER_RST = re.compile(r"^\.\.\s+docs-test:\s*(?P<what>.*?)\s*$")
MARKER_MD = re.compile(r"^<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\.\s+(code-block|code|sourcecode)::\s*(?P<lang>\S*)\s*$")
PYTHON = {"python", "python3", "py"}


@dataclass
class Block:
    path: Path
    index: int  # among the file's Python blocks, from 1
    line: int  # first line of the code, from 1
    code: str
    marker: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}, block {self.index} (line {self.line})"

    def __repr__(self) -> str:
        return f"Block({self.where})"


def _marker(lines: list[str], start: int, pattern: re.Pattern) -> str | None:
    """The docs-test marker on the last non-blank line before ``start``, if any."""
    k = start - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k >= 0:
        m = pattern.match(lines[k].strip())
        if m:
            return m.group("what")
    return None


def markdown_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group("fence"), m.group("lang").lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if lang in PYTHON:
            code = "\n".join(lines[i + 1 : j])
            blocks.append(Block(path, len(blocks) + 1, i + 2, code, _marker(lines, start, MARKER_MD)))
        i = j + 1
    return blocks


def _indented_body(lines: list[str], j: int, indent: int) -> tuple[list[tuple[int, str]], int]:
    """The lines from ``j`` on that are blank or indented deeper than ``indent``, and the index after them."""
    body = []
    while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
        body.append((j + 1, lines[j]))
        j += 1
    return body, j


def rst_blocks(path: Path) -> list[Block]:
    """The ``code-block:: python`` bodies of an RST file; every literal block's body is skipped
    whole, so an example of RST source (shown in a ``code-block:: rst``) is not taken for code."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        m = DIRECTIVE.match(line)
        if m:
            j = i + 1
            while j < len(lines) and re.match(r"^\s+:[\w-]+:", lines[j]):  # directive options
                j += 1
            body, after = _indented_body(lines, j, indent)
            if m.group("lang").lower() in PYTHON:
                while body and not body[0][1].strip():
                    body.pop(0)
                while body and not body[-1][1].strip():
                    body.pop()
                width = min((len(t) - len(t.lstrip()) for _, t in body if t.strip()), default=0)
                code = "\n".join(t[width:] for _, t in body)
                first = body[0][0] if body else i + 1
                blocks.append(Block(path, len(blocks) + 1, first, code, _marker(lines, i, MARKER_RST)))
            i = after
        elif line.rstrip().endswith("::") and not line.lstrip().startswith(".. "):  # a literal block
            i = _indented_body(lines, i + 1, indent)[1]
        else:
            i += 1
    return blocks


def source_files() -> list[Path]:
    files = [ROOT / "README.md"]
    if DOCS.is_dir():
        for p in sorted(DOCS.rglob("*.rst")):
            if not SKIP_DIRS.intersection(p.relative_to(DOCS).parts):
                files.append(p)
    return [f for f in files if f.is_file()]


def all_blocks() -> dict[Path, list[Block]]:
    out = {}
    for f in source_files():
        blocks = markdown_blocks(f) if f.suffix == ".md" else rst_blocks(f)
        if blocks:
            out[f] = blocks
    return out


BLOCKS = all_blocks()
PARAMS = [
    pytest.param(b, id=f"{b.path.relative_to(ROOT)}::{b.index}") for blocks in BLOCKS.values() for b in blocks
]


@dataclass
class FileRun:
    """The state of one file's blocks: their namespace, folder, and how far they got."""

    folder: Path
    namespace: dict[str, Any] = field(default_factory=lambda: {"__name__": "__docs__"})
    done: int = 0  # blocks run so far (in order)
    failed: str | None = None


RUNS: dict[Path, FileRun] = {}


def _cuda_reason() -> str | None:
    """None when CUDA blocks can run here, else why not."""
    import pyperm

    try:
        import torch
    except ImportError:
        return "needs torch with CUDA"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch sees none)"
    if not pyperm.cuda_available():
        return f"needs pyperm's CUDA kernels: {pyperm.cuda_unavailable_reason()}"
    return None


def _skip_reason(block: Block) -> str | None:
    if block.marker is None:
        return None
    if block.marker == "cuda":
        return _cuda_reason()
    if block.marker.startswith("skip"):
        reason = block.marker[4:].strip(" :")
        if not reason:
            raise ValueError(f"{block.where}: 'docs-test: skip' needs a reason")
        return reason
    raise ValueError(f"{block.where}: unknown docs-test marker {block.marker!r} (use 'cuda' or 'skip REASON')")


class BlockFailed(Exception):
    """A block raised; the message says where, what, and the block's own lines of the traceback."""


def _run(block: Block, run: FileRun) -> None:
    """Run one block in its file's namespace and folder."""
    cwd = Path.cwd()
    os.chdir(run.folder)
    try:
        exec(compile(block.code, f"<{block.where}>", "exec"), run.namespace)
    except NameError as exc:
        raise BlockFailed(
            f"{block.where}: NameError: {exc} (no earlier block of the file defines it: a fragment missing its setup?)"
        ) from exc
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<")]
        where = "".join(traceback.format_list(frames[-3:]))
        raise BlockFailed(f"{block.where}: {type(exc).__name__}: {exc}\n{where}") from exc
    finally:
        os.chdir(cwd)


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """No plot windows; one torch thread, since spinning OpenMP workers slow the small models
    of the examples several times over on a busy 2-core machine (the guide's performance notes)."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    from pyperm.testing import one_thread

    with one_thread():
        yield


@pytest.mark.parametrize("block", PARAMS)
def test_block_runs(block: Block, tmp_path_factory: pytest.TempPathFactory) -> None:
    blocks = BLOCKS[block.path]
    run = RUNS.get(block.path)
    if run is None:
        run = RUNS[block.path] = FileRun(tmp_path_factory.mktemp(block.path.stem.replace(".", "_")))
    # The blocks before this one first, as a reader runs them (already done when run in order).
    for earlier in blocks[run.done : block.index - 1]:
        if run.failed:
            break
        if _skip_reason(earlier) is None:
            try:
                _run(earlier, run)
            except BlockFailed as exc:
                run.failed = str(exc).splitlines()[0]
        run.done = earlier.index
    if run.failed:
        pytest.skip(f"an earlier block of this file failed: {run.failed}")
    reason = _skip_reason(block)
    if reason:
        run.done = max(run.done, block.index)
        pytest.skip(f"{block.where}: {reason}")
    start, failure = time.perf_counter(), None
    try:
        _run(block, run)
    except BlockFailed as exc:
        failure = str(exc)
    run.done = max(run.done, block.index)
    if failure:
        run.failed = failure.splitlines()[0]
        pytest.fail(failure, pytrace=False)
    seconds = time.perf_counter() - start
    assert seconds < 60, f"{block.where} took {seconds:.0f} s; keep documentation examples small"


def test_blocks_found() -> None:
    """The README and the guide have Python blocks, and every marker is a known one."""
    assert ROOT / "README.md" in BLOCKS
    if DOCS.is_dir():
        assert any(p.is_relative_to(DOCS) for p in BLOCKS)
    for blocks in BLOCKS.values():
        for b in blocks:
            if b.marker is not None and b.marker != "cuda":
                assert b.marker.startswith("skip") and b.marker[4:].strip(" :"), f"{b.where}: bad marker {b.marker!r}"


GALLERY = sorted((DOCS / "examples").glob("plot_*.py")) if DOCS.is_dir() else []


@pytest.mark.parametrize("script", GALLERY, ids=[p.name for p in GALLERY])
def test_gallery_script_compiles(script: Path) -> None:
    compile(script.read_text(), str(script), "exec")
