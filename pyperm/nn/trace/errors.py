"""The one exception of the tracer (its own module, so every part of the tracer can raise it)."""

from __future__ import annotations

__all__ = ["TraceError"]


class TraceError(ValueError):
    """A model cannot be described by a :class:`~pyperm.nn.PermutationSpec`.

    Raised when the model cannot be traced, or when an operation acts on permutable
    channels in a way the tracer cannot follow. The message names the operation, the
    ``torch.fx`` node and the module path.
    """
