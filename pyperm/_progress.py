"""The one progress contract of pyperm's long-running calls.

A ``progress=`` argument is

- ``False`` or ``None``: silent (the default of every library call);
- ``True``: a tqdm bar on stderr (tqdm is optional: without it a warning is logged on the
  ``pyperm`` logger and the call goes on without a bar);
- a callable: called after every step with the step number (counting from 1) and the
  call's own per-step values; it stops the call early by raising ``StopIteration``, and
  the results so far are returned. Any other exception propagates.

The compiled loops (the CPU Birkhoff decomposition) catch ``StopIteration`` in C++; Python
loops (the CUDA one) use :func:`keep_going`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("pyperm")

ProgressArg = bool | None | Callable[..., Any]

__all__ = ["ProgressArg", "keep_going", "progress_bar", "progress_callback"]


def progress_bar(enabled: bool, total: int | None, desc: str, unit: str) -> Any:
    """A tqdm bar when ``enabled`` and tqdm is installed, else None (with a logged warning)."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        logger.warning("progress=True needs tqdm (pip install tqdm); continuing without a progress bar")
        return None
    return tqdm(total=total, desc=desc, unit=unit)


def progress_callback(
    progress: ProgressArg,
    *,
    total: int | None,
    desc: str,
    unit: str,
    postfix: Callable[..., dict[str, str]] | None = None,
) -> tuple[Callable[..., Any] | None, Callable[[], None]]:
    """The per-step callable for ``progress`` (None when silent) and a function closing any bar.

    For ``progress=True`` the callable moves the bar to the step it is given and, when
    ``postfix`` is set, shows ``postfix(*values)`` beside it.
    """
    if progress is False or progress is None:
        return None, lambda: None
    if progress is not True:
        if not callable(progress):
            raise TypeError(f"progress must be a bool or a callable, got {type(progress).__name__}")
        return progress, lambda: None
    bar = progress_bar(True, total, desc, unit)
    if bar is None:
        return None, lambda: None

    def advance(step: int, *values: Any) -> None:
        bar.update(step - bar.n)
        if postfix is not None:
            bar.set_postfix(postfix(*values), refresh=False)

    return advance, bar.close


def keep_going(callback: Callable[..., Any] | None, step: int, *values: Any) -> bool:
    """Reports one step to ``callback``; False when it asked to stop (raised StopIteration)."""
    if callback is None:
        return True
    try:
        callback(step, *values)
    except StopIteration:
        return False
    return True
