"""The built-in trace rules, one module per operation family, and the ones users can reuse.

Importing this package registers every built-in rule: ``dense`` (Linear, ``x @ W``,
Embedding), ``conv`` (convolutions), ``norms`` (BatchNorm, LayerNorm, GroupNorm, ...),
``pointwise`` (activations, arithmetic, residual additions, dropout), ``pooling``
(pooling, reductions, order-dependent operations), ``shape`` (reshape, transpose,
indexing, padding), ``combine`` (cat, stack, split), ``recurrent`` (RNN, LSTM, GRU)
and ``attention`` (MultiheadAttention, scaled dot-product attention); ``aten`` holds the ATen operators
of graphs from torch.export whose name or arguments differ from their Python counterparts (the others
get their counterpart's rule). A new layer means one new rule
in the module of its family; a user's own module type gets a rule through
:func:`pyperm.nn.register_trace_rule`, often one of these:

- :func:`elementwise`: a function of each unit alone (arithmetic, dropout, a residual add);
- :func:`nonlinear`: the same, marked as an activation (the post-activation site);
- :func:`same`: the result is the first argument (copies, dtype or device changes);
- :func:`invariant`: the result does not depend on the order of any units;
- :func:`linear`: a module with ``weight`` (out, in) and optional ``bias``, applied to the
  last axis like ``nn.Linear``.
"""

from pyperm.nn.trace.rules import (  # noqa: F401
    aten,
    attention,
    combine,
    conv,
    dense,
    norms,
    pointwise,
    pooling,
    recurrent,
    shape,
)
from pyperm.nn.trace.rules.dense import linear
from pyperm.nn.trace.rules.pointwise import elementwise, invariant, nonlinear, same

__all__ = ["elementwise", "invariant", "linear", "nonlinear", "same"]
