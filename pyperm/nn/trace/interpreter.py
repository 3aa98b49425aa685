"""The interpreter: runs a traced graph once and labels every value it computes.

Placeholders (the model's inputs) are invariant, parameters read by the graph carry
their own atoms, constants are invariant, and the model's outputs fix every class they
carry, so a model's inputs and outputs are never permuted. Every other node is labelled
by the rule registered for its module type, function or Tensor method
(:mod:`pyperm.nn.trace.registry`); a node without a rule is accepted only when it acts
on invariant activations (its parameters are then fixed, and its result invariant).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from pyperm.nn.trace import registry
from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.channel_groups import ChannelGroups
from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.labels import Label, UnitClasses, invariant_label, tensor_leaves, tensors
from pyperm.nn.trace.sites import Role

logger = logging.getLogger(__name__)

__all__ = ["COMPOSITE_POLICIES", "Labeler"]

#: What to do with units a spec cannot name: fix them, or raise.
COMPOSITE_POLICIES = ("fix", "raise")


def _nodes_in(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, lambda n: found.append(n) or n)
    return found


class Labeler(fx.Interpreter):
    """Runs the traced graph once and labels every value it computes.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        The traced model.
    state_dict : mapping of str to torch.Tensor
        The model's detached ``state_dict``; its axes are the atoms.
    composite : {"fix", "raise"}
        The policy for units a spec cannot name.
    structured : bool, default False
        Label concatenated and flattened axes with structures (spec axis forms) instead
        of fixing their units.

    Attributes
    ----------
    units : UnitClasses
        The atoms and their classes.
    labels : dict of torch.fx.Node to label
        The label of every node's value.
    dep : dict of torch.fx.Node to bool
        Whether a node's value depends on the model's input.
    roles : dict of torch.fx.Node to Role
        What each node is for the activation sites.
    producers : list of (torch.fx.Node, int)
        Nodes that produce units, with the atom of the produced units.
    openers : dict of int to str
        Atom of produced units -> name of its first producer.
    projected : list of tuple
        Units a layer computes inside and never shows (nn.MultiheadAttention's q, k and v):
        ``(input node, layer path, name, Projection, atom or structure)``; their activation
        site is the input projected.
    composites : list of str
        One line per set of units fixed because a spec cannot name them.
    channel_groups : ChannelGroups
        The channel partitions of GroupNorms, laid over the classes by :meth:`resolve_channel_groups`.
    """

    def __init__(
        self, gm: fx.GraphModule, state_dict: Mapping[str, torch.Tensor], composite: str, structured: bool = False
    ) -> None:
        super().__init__(gm)
        self.structured = structured
        self.units = UnitClasses(state_dict)
        self.composite_policy = composite
        self.composites: list[str] = []
        self.labels: dict[fx.Node, Any] = {}
        self.dep: dict[fx.Node, bool] = {}
        self.roles: dict[fx.Node, Role] = {}
        self.producers: list[tuple[fx.Node, int]] = []
        self.openers: dict[int, str] = {}
        self.projected: list[tuple[Any, ...]] = []
        self.channel_groups = ChannelGroups()

    # ---- names
    def module_path(self, node: fx.Node) -> str:
        """The path of the module a node belongs to (``""`` for the model itself)."""
        if node.op == "call_module":
            return str(node.target)
        stack = node.meta.get("nn_module_stack")
        if stack:
            return str(list(stack.values())[-1][0])
        return ""

    def op_name(self, node: fx.Node, module: nn.Module | None = None) -> str:
        """A readable name of a node's operation."""
        if node.op == "call_module":
            module = module if module is not None else self.module.get_submodule(node.target)
            return type(module).__name__
        if node.op == "call_method":
            return f"Tensor.{node.target}"
        target = node.target
        if hasattr(target, "overloadpacket"):  # an operator of torch.export's graphs: "aten.view"
            return f"{target.namespace}.{target.overloadpacket.__name__}"
        name = getattr(target, "__name__", None) or str(target)
        mod = getattr(target, "__module__", None) or ""
        if mod.startswith("torch.nn.functional"):
            return f"F.{name}"
        if mod in ("_operator", "operator"):
            return f"operator.{name}"
        if mod.startswith("torch"):
            return f"torch.{name}"
        return name

    # ---- what rules report
    def add_producer(self, node: fx.Node, atom: int, name: str) -> None:
        self.producers.append((node, atom))
        self.openers.setdefault(atom, name)

    def composite(self, call: TraceCall, what: str, atoms: Sequence[int | None]) -> None:
        """Fixes ``atoms`` and lists them, or raises, as the composite policy says."""
        atoms = [a for a in atoms if a is not None]
        if not atoms:
            return
        sizes = sorted({self.units.size(a) for a in atoms})
        self.leave_unpermuted(
            call,
            what,
            atoms,
            f"the result's channel axis is a composite of permuted units (unit counts {sizes}), which a "
            "PermutationSpec cannot name",
            "composite axis",
        )

    def leave_unpermuted(self, call: TraceCall, what: str, atoms: Sequence[int | None], why: str, short: str) -> None:
        """Fixes the classes of ``atoms`` and lists the cause, or raises under ``composite="raise"``.

        Parameters
        ----------
        call : TraceCall
            The operation responsible.
        what : str
            What it does, completing "<operation> (graph node, module) ...".
        atoms : sequence of int or None
            The classes to fix.
        why : str
            Why a spec cannot follow it (for the error).
        short : str
            The cause in a few words (for the composites list).
        """
        if self.composite_policy == "raise":
            raise TraceError(f"{call.where()} {what}: {why}; pass composite='fix' to leave these units unpermuted")
        self.units.fix(*atoms)
        self.note(f"{call.where()} {what}: units fixed ({short})")

    def resolve_channel_groups(self) -> None:
        """Binds the classes GroupNorms normalised to their channel groups (once the graph has run);
        a partition no structure can take fixes its units, listed or raised as the policy says."""

        def new_units(size: int, name: str) -> int:
            atom = self.units.new_class(size)
            self.openers.setdefault(atom, name)
            self.units.activate(Label((atom,)))
            return atom

        for line in self.channel_groups.resolve(self.units, new_units):
            if self.composite_policy == "raise":
                raise TraceError(f"{line}; pass composite='fix' to leave these units unpermuted")
            self.note(f"{line}: units fixed (channel groups)")

    def note(self, line: str) -> None:
        """Lists one cause of units left unpermuted."""
        if line not in self.composites:
            self.composites.append(line)
            logger.info("pyperm.nn trace: %s", line)

    # ---- the interpreter loop
    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        result = getattr(self, n.op)(n.target, args, kwargs)
        dep = n.op == "placeholder" or any(self.dep.get(a, False) for a in n.all_input_nodes)
        self.dep[n] = dep
        label, role = self._label(n, tuple(args), dict(kwargs), result)
        self.labels[n] = label
        self.roles[n] = role
        if dep:  # these classes reach an activation: they are units, not just parameter axes
            self.units.activate(label)
        return result

    def _label(self, n: fx.Node, args: tuple, kwargs: dict, result: Any) -> tuple[Any, Role]:
        if n.op == "placeholder":
            return invariant_label(result), Role.OTHER
        if n.op == "get_attr":
            if isinstance(result, torch.Tensor) and n.target in self.units.state_dict:
                return self.units.param_label(str(n.target)), Role.OTHER
            return invariant_label(result), Role.OTHER  # a constant: never permuted
        if n.op == "output":
            self.units.fix_label(fx.node.map_arg(n.args, lambda a: self.labels[a]))
            return None, Role.OTHER
        if not tensors(result):
            return None, Role.OTHER  # sizes, dtypes, Python numbers: nothing to permute
        largs = fx.node.map_arg(n.args, lambda a: self.labels[a])
        lkwargs = fx.node.map_arg(n.kwargs, lambda a: self.labels[a])
        module = self.module.get_submodule(n.target) if n.op == "call_module" else None
        call = TraceCall(self, n, args, kwargs, tuple(largs), dict(lkwargs), result, module)
        rule = self._rule(call)
        label = rule(call) if rule is not None else self._unknown(call)
        for conflict in self.units.conflicts:
            self.note(f"{call.where()}: {conflict}: units fixed")
        self.units.conflicts.clear()
        return label, call.role

    def _rule(self, call: TraceCall) -> registry.Rule | None:
        n = call.node
        if call.module is not None:
            return registry.lookup_module(call.module)
        if n.op == "call_method":
            return registry.lookup_method(str(n.target))
        return registry.lookup_function(n.target)

    def _unknown(self, c: TraceCall) -> Any:
        """An operation without a rule: fine on invariant activations only."""
        inputs = list(zip(c.node.args, c.args, c.largs)) + [
            (c.node.kwargs[k], v, c.lkwargs.get(k)) for k, v in c.kwargs.items()
        ]
        for node_arg, value, lab in inputs:
            leaves = tensor_leaves(value, lab)
            dep = any(self.dep.get(a, False) for a in _nodes_in(node_arg))
            if dep and any(a is not None for _, l in leaves for a in l):
                raise TraceError(
                    f"unsupported operation {c.where()}: it acts on permuted units and the tracer does not know "
                    "how it treats them"
                )
        # Parameters fed to it (directly or inside a leaf module) cannot be permuted.
        fixed: list[int | None] = []
        for _, value, lab in inputs:
            for _, l in tensor_leaves(value, lab):
                fixed.extend(l)
        keys = []
        if c.module is not None:
            for name, _ in c.module.named_parameters():
                key = c.param_key(name)
                if key in self.units.state_dict:
                    fixed.extend(self.units.param_label(key))
                    keys.append(key)
        if any(a is not None and not self.units.is_fixed(a) for a in fixed):
            params = f"its parameters {keys}" if keys else "the parameters passed to it"
            self.leave_unpermuted(
                c,
                f"has no trace rule: {params} stay unpermuted",
                fixed,
                "the tracer cannot see how its units are used (register a rule with pyperm.nn.register_trace_rule)",
                "no trace rule",
            )
        return invariant_label(c.result)
