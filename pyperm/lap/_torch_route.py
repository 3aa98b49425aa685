"""When the public solvers hand a torch tensor to the custom operators of :mod:`._torch_ops`.

Only while torch compiles or exports (``torch.compiler.is_compiling()``, which Dynamo reads
as True while it traces and ``torch.export`` sets while it runs the function): there the
solve must be one operator in the graph. In eager mode the public functions call the
backends directly, because the dispatcher would add its cost to every call and capture
nothing. This module never imports torch.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

__all__ = ["operators", "register_if_torch_imported", "traced"]


def traced(x: Any) -> bool:
    """True when ``x`` is a torch tensor and torch is compiling or exporting the caller."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and torch.compiler.is_compiling()


def operators() -> ModuleType:
    """The operators' module, imported (so registered) on first use.

    Dynamo runs an import it meets while tracing instead of tracing it, so the operators
    can be registered even when the first solve on a tensor is inside a compiled function.
    """
    from pyperm.lap import _torch_ops

    return _torch_ops


def register_if_torch_imported() -> None:
    """Registers the operators now if torch is imported, so that ``torch.export.load``
    finds them in programs saved earlier; otherwise registration waits for a compile."""
    torch = sys.modules.get("torch")
    # A torch still being imported (pyperm imported from within it) has no torch.library yet.
    if torch is not None and hasattr(torch, "library"):
        operators()
