"""``type=`` converters for the options of ``pyperm`` and ``pyperm bench``.

The checks themselves are :mod:`pyperm._checks`' (and the model registry's); here they run
while argparse reads the command line, so a bad value is a usage error, exit status 2, with
a message that names the option (``pyperm align: error: argument --num-points: expected an
integer >= 2, got '1'``) before any work starts. No torch at import: ``pyperm --help`` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from pyperm._checks import check_int, check_nonnegative_real, check_positive_real

__all__ = [
    "choices_list",
    "int_at_least",
    "model_name",
    "nonnegative_float",
    "nonnegative_int",
    "positive_float",
    "positive_floats",
    "positive_int",
    "shape",
]


def _converter(convert: Callable[[str], Any], check: Callable[[Any], Any], expected: str, name: str):
    def parse(text: str) -> Any:
        try:
            return check(convert(text))
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None

    parse.__name__ = name  # argparse names the converter in some of its messages
    return parse


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer of at least ``minimum``."""
    return _converter(int, lambda v: check_int(v, "value", minimum), f"an integer >= {minimum}", "int_at_least")


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
positive_float = _converter(float, lambda v: check_positive_real(v, "value"), "a finite positive number",
                            "positive_float")  # fmt: skip
nonnegative_float = _converter(float, lambda v: check_nonnegative_real(v, "value"), "a finite number >= 0",
                               "nonnegative_float")  # fmt: skip


def positive_floats(text: str) -> list[float]:
    """Comma-separated finite positive numbers (``0.7,0.3``), as a list."""
    try:
        return [check_positive_real(float(v), "value") for v in text.split(",")]
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite positive numbers, got {text!r}") from None


def choices_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A comma-separated, non-empty subset of ``choices`` (``--models a,b``), as a list."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}, got {text!r}")
        return names

    parse.__name__ = "choices_list"
    return parse


def shape(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers (``1,3,32,32``), as a tuple."""
    try:
        dims = tuple(check_int(int(d), "dimension", 1) for d in text.split(","))
    except (TypeError, ValueError):
        expected = "comma-separated positive integers (e.g. 1,3,32,32)"
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    return dims


def model_name(text: str) -> str:
    """A ``--model``: a name of the model registry (its syntax checked here), ``path/to/file.py:ClassName`` or ``hf``.

    A user's file is checked when it is loaded (it may not exist yet while the command line is read).
    """
    if ".py:" in text or text == "hf":  # a user's file, or Hugging Face folders
        return text
    from pyperm.nn.models import parse_model_name

    try:
        parse_model_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
