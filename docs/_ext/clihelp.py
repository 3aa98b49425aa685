"""``.. program-help:: pyperm align``: the ``--help`` text of a ``pyperm`` sub-command, as a literal block.

Taken from the parser the command itself builds (``pyperm.cli.build_parser``), so the
command-line page never drifts from the options the command accepts.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

WIDTH = "92"  # argparse wraps the help text to $COLUMNS


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise ValueError(f"{parser.prog} has no sub-command {name!r}")


def help_text(words: list[str]) -> str:
    from pyperm.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        if words[0] != "pyperm":
            raise ValueError(f"program-help takes a pyperm command, got {' '.join(words)!r}")
        for word in words[1:]:
            parser = _subparser(parser, word)
        return parser.format_help()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


class ProgramHelp(SphinxDirective):
    required_arguments = 1
    final_argument_whitespace = True

    def run(self) -> list[nodes.Node]:
        try:
            text = help_text(self.arguments[0].split())
        except ValueError as exc:
            raise self.error(str(exc)) from exc
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("program-help", ProgramHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
