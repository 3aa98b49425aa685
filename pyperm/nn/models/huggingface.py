"""Hugging Face ``transformers`` models as pyperm runs them: one tensor in, one tensor out.

A ``transformers`` model takes keyword inputs and returns a ``ModelOutput``; pyperm's tracer,
barriers, curves and the command line call ``model(x)`` and read a tensor.
:func:`single_output` gives a model a forward of that shape without wrapping it, so its
``state_dict`` keys stay the ones ``save_pretrained`` writes.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["single_output"]


@functools.cache
def _single_output_class(cls: type) -> type:
    """A subclass of ``cls`` whose forward maps one tensor to one tensor."""

    def forward(self: Any, inputs: Any) -> Any:
        out = cls.forward(self, inputs)
        for name in ("logits", "last_hidden_state"):
            value = getattr(out, name, None)
            if value is not None:
                return value
        return out[0] if isinstance(out, tuple) else out

    forward.__doc__ = f"{cls.__name__}.forward on one input tensor, returning its logits (or last hidden state)."
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__, "_pyperm_single_output": True})


def single_output(model: Any) -> Any:
    """Make a ``transformers`` model map one tensor (token ids, or pixel values) to one tensor.

    The model's class is replaced by a subclass whose ``forward(inputs)`` calls the original
    forward with ``inputs`` as its first argument and returns the output's ``logits`` (or
    ``last_hidden_state`` for a model without a head). Parameters, buffers, ``state_dict``
    keys, ``save_pretrained`` and ``config`` are unchanged.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model; changed in place.

    Returns
    -------
    transformers.PreTrainedModel
        ``model`` itself.

    Raises
    ------
    TypeError
        ``model`` is not a torch module.

    Examples
    --------
    >>> import torch
    >>> class Toy(torch.nn.Module):  # any module whose forward returns an object with .logits
    ...     def forward(self, x):
    ...         return type("Out", (), {"logits": x * 2})()
    >>> single_output(Toy())(torch.ones(2)).tolist()
    [2.0, 2.0]
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not getattr(type(model), "_pyperm_single_output", False):  # not twice
        model.__class__ = _single_output_class(type(model))
    return model
