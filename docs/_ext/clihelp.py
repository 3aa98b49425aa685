"""``.. program-help:: pyperm align``: the ``--help`` text of a ``pyperm`` sub-command, as a literal block.

Taken from the parser the command itself builds (``pyperm.cli.build_parser``), so the
command-line page never drifts from the options the command accepts. With ``:recursive:``,
the help of the command and of every sub-command below it, each under its own heading, so a
new sub-command appears on the page without an edit.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

WIDTH = "92"  # argparse wraps the help text to $COLUMNS


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise ValueError(f"{parser.prog} has no sub-command {name!r}")


def _children(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def help_texts(words: list[str], recursive: bool = False) -> list[tuple[str, str]]:
    """``(command, help text)`` of ``words`` (and, recursively, of its sub-commands)."""
    from pyperm.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        if words[0] != "pyperm":
            raise ValueError(f"program-help takes a pyperm command, got {' '.join(words)!r}")
        for word in words[1:]:
            parser = _subparser(parser, word)
        out, todo = [], [(" ".join(words), parser)]
        while todo:
            name, p = todo.pop(0)
            out.append((name, p.format_help()))
            if recursive:
                todo = [(f"{name} {sub}", q) for sub, q in _children(p)] + todo
        return out
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


class ProgramHelp(SphinxDirective):
    required_arguments = 1
    final_argument_whitespace = True
    option_spec = {"recursive": directives.flag}

    def run(self) -> list[nodes.Node]:
        recursive = "recursive" in self.options
        try:
            texts = help_texts(self.arguments[0].split(), recursive)
        except ValueError as exc:
            raise self.error(str(exc)) from exc
        out: list[nodes.Node] = []
        for name, text in texts:
            if recursive:
                out.append(nodes.rubric(name, "", nodes.literal(name, name)))
            block = nodes.literal_block(text, text)
            block["language"] = "text"
            out.append(block)
        return out


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("program-help", ProgramHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
