"""The table of trace rules: which rule labels a module type, a function or a Tensor method.

The built-in rules (``pyperm.nn.trace.rules``) register themselves here when imported;
users add rules for their own modules with :func:`register_trace_rule`. A module type
with a rule is a leaf of the trace (its ``forward`` is not traced into), so the rule
sees the whole module call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from pyperm.nn.trace.call import TraceCall

__all__ = [
    "Rule",
    "Target",
    "is_registered_module",
    "lookup_function",
    "lookup_method",
    "lookup_module",
    "register_all",
    "register_trace_rule",
    "rule_for",
]

#: A rule: labels one graph node (see :class:`~pyperm.nn.trace.call.TraceCall`).
Rule = Callable[["TraceCall"], Any]
#: What a rule is registered for: a module type, a function, or a Tensor method name.
Target = type | Callable[..., Any] | str

_lock = threading.Lock()
_modules: dict[type, Rule] = {}
_functions: dict[Any, Rule] = {}
_methods: dict[str, Rule] = {}
_named_functions: dict[str, Rule] = {}


def _qualified_name(fn: Any) -> str | None:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}.{name}" if module and name else None


def _table(target: Target) -> tuple[dict, Any]:
    if isinstance(target, type):
        if not issubclass(target, nn.Module):
            raise TypeError(
                f"target must be a torch.nn.Module subclass, a function or a method name, got class {target.__name__}"
            )
        return _modules, target
    if isinstance(target, str):
        name = target.removeprefix("Tensor.")
        if name.isidentifier():
            return _methods, name
        if all(part.isidentifier() for part in target.split(".")):
            return _named_functions, target
        raise ValueError(f"target {target!r} is neither a Tensor method name nor a qualified function name")
    if callable(target):
        return _functions, target
    raise TypeError(
        f"target must be a torch.nn.Module subclass, a function or a method name, got {type(target).__name__}"
    )


def register_trace_rule(target: Target, rule: Rule, *, replace: bool = False) -> None:
    """Register ``rule`` as the way the tracer labels ``target``.

    Parameters
    ----------
    target : type, callable or str
        A ``torch.nn.Module`` subclass (its instances become leaves of the trace: the
        rule sees the whole module call; a subclass is traced into unless it has a rule
        of its own, since it may compute something else), a function called in ``forward`` (matched by identity, e.g.
        ``torch.addcmul``), the qualified name of a function (``module.qualname``,
        e.g. ``"torchvision.ops.stochastic_depth.stochastic_depth"``, so a library need
        not be imported to register its functions), or the name of a Tensor method
        (``"view"`` or ``"Tensor.view"``).
    rule : callable
        ``rule(call)`` with a :class:`~pyperm.nn.trace.TraceCall`; returns the label of
        the result. The ready-made rules of :mod:`pyperm.nn.trace.rules` cover common
        cases: ``rules.elementwise`` (a function of each unit alone, such as an
        activation), ``rules.nonlinear`` (the same, marked as a post-activation site),
        ``rules.linear`` (a module with ``weight`` of shape (out, in) and optional
        ``bias``, applied to the last axis), ``rules.fixed`` (leave every unit the module
        touches unpermuted, reported in ``TraceResult.composites``).
    replace : bool, default False
        Replace an existing rule for ``target`` (built-in or registered before) instead
        of raising.

    Raises
    ------
    TypeError
        ``target`` is none of the above, or ``rule`` is not callable.
    ValueError
        ``target`` already has a rule and ``replace`` is False.

    Notes
    -----
    The table is shared by the whole process (like ``copyreg`` or torch's pytree
    registrations): register a module's rule once, where the module is defined.

    Examples
    --------
    A custom activation is a function of each unit alone:

    >>> import torch
    >>> from pyperm.nn import PermutationSpec, register_trace_rule
    >>> from pyperm.nn.trace import rules
    >>> class Swish(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * torch.sigmoid(x)
    >>> register_trace_rule(Swish, rules.nonlinear)
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), Swish(), torch.nn.Linear(8, 2))
    >>> PermutationSpec.from_model(model, torch.randn(3, 4)).sizes
    {'P_0': 8}
    """
    if not callable(rule):
        raise TypeError(f"rule must be callable, got {type(rule).__name__}")
    table, key = _table(target)
    with _lock:
        if key in table and not replace:
            raise ValueError(f"{target!r} already has a trace rule ({table[key]!r}); pass replace=True to replace it")
        table[key] = rule


def register_all(targets: Any, rule: Rule) -> None:
    """Register ``rule`` for every target of an iterable (for the built-in rules).

    Aliases (``F.hardshrink`` is ``torch.hardshrink``) given the same rule twice are
    fine; a target claimed by two different rules still raises, so clashes show at import.
    """
    for target in dict.fromkeys(targets):
        if rule_for(target) is not rule:  # torch aliases one function under two names now and then
            register_trace_rule(target, rule)


def rule_for(target: Target) -> Rule | None:
    """The rule registered for exactly ``target`` (no lookup through base classes), or None."""
    table, key = _table(target)
    return table.get(key)


def is_registered_module(module: nn.Module) -> bool:
    """Whether ``type(module)`` itself has a rule (then it is a leaf of the trace)."""
    return type(module) in _modules


def lookup_module(module: nn.Module) -> Rule | None:
    """The rule of the nearest class in ``type(module)``'s method resolution order that has one.

    Only leaf modules are looked up: torch's own (``torch.fx`` keeps ``torch.nn``
    modules whole, so a torch subclass of ``nn.Linear`` gets the Linear rule) and those
    registered exactly.
    """
    for cls in type(module).__mro__:
        rule = _modules.get(cls)
        if rule is not None:
            return rule
    return None


def lookup_function(fn: Any) -> Rule | None:
    """The rule of a function: by identity, else by qualified name (functions of libraries not imported); an
    ATen operator (``torch.ops.aten.view.default``): its own rule, its packet's (``torch.ops.aten.view``), else
    the rule of its Python counterpart (:func:`_counterpart`)."""
    try:
        rule = _functions.get(fn)
    except TypeError:  # an unhashable callable object
        rule = None
    if rule is None and _named_functions:
        name = _qualified_name(fn)
        rule = _named_functions.get(name) if name is not None else None
    packet = getattr(fn, "overloadpacket", None)
    if rule is None and packet is not None:  # an ATen operator of a graph from torch.export
        rule = _functions.get(packet) or _counterpart(packet.__name__)
    return rule


def _counterpart(name: str) -> Rule | None:
    """The rule of the ``torch.nn.functional`` function, ``torch`` function or Tensor method named like an
    ATen operator: rules registered for those apply to graphs from torch.export too, whose operators keep
    the name and the argument order of their Python counterparts (operators that differ have rules of their
    own in :mod:`pyperm.nn.trace.rules.aten`); an in-place operator (``aten.silu_``) gets the rule of its
    out-of-place one, which labels the same result."""
    import torch
    import torch.nn.functional as F

    for namespace in (F, torch):
        fn = getattr(namespace, name, None)
        rule = _functions.get(fn) if callable(fn) else None
        if rule is not None:
            return rule
    rule = _methods.get(name)
    if rule is None and name.endswith("_") and not name.endswith("__"):  # in place (aten.silu_): as its result
        rule = _counterpart(name[:-1])
    return rule


def lookup_method(name: str) -> Rule | None:
    return _methods.get(name)
