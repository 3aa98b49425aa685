"""When the public solvers hand a torch tensor to the custom operators of :mod:`._torch_ops`.

Only while torch compiles or exports (``torch.compiler.is_compiling()``, which Dynamo reads
as True while it traces and ``torch.export`` sets while it runs the function): there the
solve must be one operator in the graph. In eager mode the public functions call the
backends directly, because the dispatcher would add its cost to every call and capture
nothing. This module never imports torch unless asked to register the operators.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

__all__ = ["operators", "register_if_torch_imported", "register_torch_ops", "traced"]


def _has_custom_ops(torch: ModuleType) -> bool:
    # torch.library.custom_op arrived in torch 2.4; older versions solve eagerly (a graph break).
    # A torch still being imported (pyperm imported from within it) has no torch.library yet.
    return hasattr(torch, "library") and hasattr(torch.library, "custom_op")


def traced(x: Any) -> bool:
    """True when ``x`` is a torch tensor and torch is compiling or exporting the caller."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return False
    return _has_custom_ops(torch) and torch.compiler.is_compiling()


def operators() -> ModuleType:
    """The operators' module, imported (so registered) on first use.

    Dynamo runs an import it meets while tracing instead of tracing it, so the operators
    can be registered even when the first solve on a tensor is inside a compiled function.
    """
    from pyperm.lap import _torch_ops

    return _torch_ops


def register_if_torch_imported() -> None:
    """Registers the operators now if torch is imported; otherwise a compile or export does."""
    torch = sys.modules.get("torch")
    if torch is not None and _has_custom_ops(torch):
        operators()


def register_torch_ops() -> None:
    """Register pyperm's torch custom operators (importing torch).

    ``torch.ops.pyperm.linear_sum_assignment`` and
    ``torch.ops.pyperm.batch_linear_sum_assignment`` are registered when pyperm is imported
    after torch, and by the first ``torch.compile`` or ``torch.export`` of a solve otherwise.
    Call this only to use them before either, e.g. to ``torch.export.load`` a saved program
    that holds them in a process that imported pyperm before torch.

    Raises
    ------
    RuntimeError
        The installed torch is older than 2.4, which has no ``torch.library.custom_op``.
    """
    import torch

    if not _has_custom_ops(torch):
        raise RuntimeError(f"pyperm's torch operators need torch 2.4 or newer, found {torch.__version__}")
    operators()
