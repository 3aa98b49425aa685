"""What a trace rule sees: one graph node, its inputs, their labels, and the operations on unit classes.

A rule is a callable ``rule(call: TraceCall) -> label``. It reads the node's concrete
argument values (``call.args``/``call.kwargs``, computed on the example input) and their
labels (``call.largs``/``call.lkwargs``), joins or fixes unit classes through the call,
sets :attr:`TraceCall.role` for the activation sites, and returns the label of the
node's result (a :class:`~pyperm.nn.trace.labels.Label` per tensor, in the structure of
the result).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.labels import Label, is_label, map_tensors
from pyperm.nn.trace.sites import Projection, Role

if TYPE_CHECKING:
    from pyperm.nn.trace.interpreter import Labeler

__all__ = ["TraceCall", "node_name"]


def node_name(node: Any) -> str | None:
    """A get_attr node's attribute path (minus ".weight"), or the node's name."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        target = str(node.target)
        return target.removesuffix(".weight")
    return node.name


class TraceCall:
    """One ``call_module``, ``call_function`` or ``call_method`` node, as a rule sees it.

    Attributes
    ----------
    node : torch.fx.Node
        The graph node.
    module : torch.nn.Module or None
        The called module (``call_module`` nodes), else None.
    path : str
        The module path of the node (``""`` for the model itself).
    opname : str
        A readable name of the operation (``"Linear"``, ``"torch.cat"``, ``"Tensor.view"``).
    args, kwargs : tuple, dict
        The argument values computed on the example input.
    largs, lkwargs : tuple, dict
        Their labels, in the same structure (None for non-tensors).
    result : Any
        The node's output value.
    role : Role
        What the node is for the activation sites; :attr:`Role.OTHER` unless the rule sets it.
    """

    __slots__ = (
        "_labeler",
        "args",
        "kwargs",
        "largs",
        "lkwargs",
        "module",
        "node",
        "opname",
        "path",
        "result",
        "role",
    )  # fmt: skip

    def __init__(self, labeler: Labeler, node: fx.Node, args: tuple, kwargs: dict, largs: tuple, lkwargs: dict,
                 result: Any, module: nn.Module | None) -> None:  # fmt: skip
        self._labeler = labeler
        self.node = node
        self.module = module
        self.path = labeler.module_path(node)
        self.opname = labeler.op_name(node, module)
        self.args = args
        self.kwargs = kwargs
        self.largs = largs
        self.lkwargs = lkwargs
        self.result = result
        self.role = Role.OTHER

    # ---- reading arguments
    def where(self) -> str:
        """The operation, graph node and module path, for error messages."""
        path = self.path or "<model>"
        return f"{self.opname} (graph node '{self.node.name}', module '{path}')"

    @property
    def target_name(self) -> str:
        """The method or function name of the node (``"view"``, ``"cat"``)."""
        t = self.node.target
        if isinstance(t, str):
            return t
        t = getattr(t, "overloadpacket", t)  # an ATen operator: its name without the overload ("view")
        return getattr(t, "__name__", str(t))

    def get(self, i: int, name: str, default: Any = None) -> Any:
        """Argument ``i`` (positional) or ``name`` (keyword), else ``default``."""
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(name, default)

    def get_label(self, i: int, name: str) -> Any:
        """The label of argument ``i`` or ``name``."""
        if len(self.largs) > i:
            return self.largs[i]
        return self.lkwargs.get(name)

    def first(self) -> tuple[torch.Tensor, Label]:
        """The first argument, which must be a tensor, and its label."""
        x = self.args[0] if self.args else next(iter(self.kwargs.values()))
        lab = self.largs[0] if self.args else next(iter(self.lkwargs.values()))
        if not isinstance(x, torch.Tensor):
            raise TraceError(f"{self.where()} expected a tensor as its first argument")
        return x, lab if is_label(lab) else Label.invariant(x.ndim)

    def out_tensor(self) -> torch.Tensor:
        """The result, which must be one tensor."""
        if not isinstance(self.result, torch.Tensor):
            raise TraceError(f"{self.where()} returned {type(self.result).__name__}; the tracer expected a tensor")
        return self.result

    def depends(self, node: Any) -> bool:
        """Whether graph node ``node`` depends on the model's input (an activation, not a parameter)."""
        return isinstance(node, fx.Node) and self._labeler.dep.get(node, False)

    def arg(self, i: int, name: str) -> tuple[Label | None, bool]:
        """The label of tensor argument ``i``/``name`` (None if not a tensor) and whether it depends on the input."""
        node = self.node.args[i] if len(self.node.args) > i else self.node.kwargs.get(name)
        value = self.get(i, name)
        if not isinstance(value, torch.Tensor):
            return None, False
        lab = self.get_label(i, name)
        return (lab if is_label(lab) else Label.invariant(value.ndim)), self.depends(node)

    def param(self, name: str) -> Label | None:
        """The label of the called module's parameter or buffer ``name`` (None if the module has none).

        ``name`` may be a path into a submodule (``"out_proj.weight"``).
        """
        obj: Any = self.module
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            return None
        key = f"{self.path}.{name}" if self.path else name
        if key not in self._labeler.units.state_dict:
            raise TraceError(
                f"{self.where()}: its {name} is not in the model's state_dict under {key!r} "
                "(a parametrized or lazily initialised module?)"
            )
        return self._labeler.units.param_label(key)

    def param_key(self, name: str) -> str:
        """The ``state_dict`` key of the called module's parameter ``name``."""
        return f"{self.path}.{name}" if self.path else name

    def projected(self, i: int, name: str, what: str, units: Any, weight: str, rows: tuple[int, int],
                  bias: str | None = None, bias_rows: tuple[int, int] | None = None) -> None:  # fmt: skip
        """Units computed inside the layer and never shown: input ``i``/``name`` projected by rows
        ``rows`` of parameter ``weight`` (plus rows ``bias_rows`` of ``bias``, when the layer has
        it) is their activation site."""
        node = self.node.args[i] if len(self.node.args) > i else self.node.kwargs.get(name)
        if isinstance(node, fx.Node):
            has_bias = bias is not None and self.param(bias) is not None
            projection = Projection(self.param_key(weight), rows, self.param_key(bias) if has_bias else None,  # type: ignore[arg-type]
                                    bias_rows if has_bias else None)  # fmt: skip
            self._labeler.projected.append((node, self.path, what, projection, units))

    def weight_name(self) -> str | None:
        """The name of a layer's producer: the module path, or a functional layer's weight attribute."""
        if self.node.op == "call_module":
            return self.path or self.node.name
        w = self.node.args[1] if len(self.node.args) > 1 else self.node.kwargs.get("weight")
        return node_name(w)

    # ---- unit classes
    def join(self, *atoms: int | None) -> int | None:
        """Joins classes that must be permuted alike; an invariant (None) among them fixes them all."""
        return self._labeler.units.join(*atoms)

    def fix(self, *atoms: int | None) -> None:
        """Fixes the classes of ``atoms``: they are never permuted."""
        self._labeler.units.fix(*atoms)

    def fix_label(self, label: Any) -> None:
        """Fixes every class of a (possibly nested) label."""
        self._labeler.units.fix_label(label)

    def is_units(self, atom: Any) -> bool:
        """Whether ``atom``'s class has reached an activation so far (units, not only a parameter's axis)."""
        return self._labeler.units.reaches_activation(atom)

    def size(self, atom: int) -> int:
        """The number of units of ``atom``'s class."""
        return self._labeler.units.size(atom)

    def is_fixed(self, atom: Any) -> bool:
        """Whether ``atom``'s class (every class of a structure) is fixed: never permuted."""
        return self._labeler.units.is_fixed(atom)

    def opened(self, atom: int | None, weight_dep: bool = False, name: str | None = None) -> None:
        """Marks ``atom`` as freshly produced units (unless the weight itself depends on the input).

        ``name`` names the producer (the group is named after its first producer): the
        module path, or the weight's attribute for a functional layer.
        """
        if atom is None or weight_dep:
            self.role = Role.OTHER
            return
        self.role = Role.PRODUCER
        self._labeler.add_producer(self.node, atom, name or self.path or self.node.name)

    def activate(self, *atoms: int | None) -> None:
        """Marks classes as units of activations the operation computes inside (a recurrent layer's
        lower layers): they become groups although no labelled tensor shows them."""
        self._labeler.units.activate(Label(atoms))

    def new_units(self, size: int, name: str) -> int:
        """A new class of ``size`` units named ``name`` (for units no ``state_dict`` axis holds alone)."""
        atom = self._labeler.units.new_class(size)
        self._labeler.openers.setdefault(atom, name)
        self._labeler.units.activate(Label((atom,)))  # units of the activations inside the operation
        return atom

    def group_channels(self, entry: Any, group_size: int) -> None:
        """The axis labelled ``entry`` is normalised in consecutive groups of ``group_size`` units
        (GroupNorm): once the graph has run, whole groups may move and the units within each group
        too, each group on its own (:mod:`pyperm.nn.trace.channel_groups`)."""
        self._labeler.channel_groups.add(entry, group_size, self.where(), self.path or self.node.name)

    def composite(self, what: str, atoms: Sequence[int | None]) -> None:
        """Units that a spec cannot name: fix them (listed in the composites) or raise, as the policy says.

        Parameters
        ----------
        what : str
            What the operation does, completing "<operation> (graph node, module) ...".
        atoms : sequence of int or None
            The classes involved.
        """
        self._labeler.composite(self, what, atoms)

    def leave_unpermuted(self, what: str, atoms: Sequence[int | None], why: str, short: str) -> None:
        """Fix units on purpose, listing the cause in ``TraceResult.composites`` (or raise under "raise").

        For rules that know the units exist but cannot describe their symmetry (the
        hidden units of a recurrent layer, say). ``what`` completes "<operation> (graph
        node, module) ...", ``why`` explains the error, ``short`` names the cause in a
        few words.
        """
        self._labeler.leave_unpermuted(self, what, atoms, why, short)

    # ---- building labels
    def broadcast(
        self,
        operands: Sequence[tuple[torch.Tensor | torch.Size, Label]],
        out_shape: Sequence[int],
    ) -> Label:
        """The label of an elementwise result: operands broadcast against each other.

        A unit class survives an axis only if every operand that is not broadcast along
        it carries it there; a one-unit class broadcast over many units is fixed.
        """
        rank = len(out_shape)
        out: list[int | None] = []
        for k in range(rank):
            atoms: list[int] = []
            plain = False
            for t, lab in operands:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)
                j = k - (rank - len(shape))
                if j < 0:
                    continue
                if shape[j] == 1 and out_shape[k] != 1:
                    self.fix(lab[j])
                    continue
                if lab[j] is None:
                    plain = True
                else:
                    atoms.append(lab[j])
            if plain or not atoms:
                self.fix(*atoms)
                out.append(None)
            else:
                out.append(self.join(*atoms))
        return Label(out)

    def label_like(self, label: Label) -> Any:
        """``label`` for every tensor of the result of the same rank (ops returning (values, indices))."""
        return map_tensors(
            self.result,
            lambda v: label if v.ndim == len(label) else Label.invariant(v.ndim),
        )

    def invariant(self) -> Any:
        """An all-invariant label for the result."""
        return map_tensors(self.result, lambda v: Label.invariant(v.ndim))

    @property
    def structured(self) -> bool:
        """Whether the trace describes concatenated and flattened axes with spec axis forms."""
        return self._labeler.structured

    def cut(self, entry: Any, points: Sequence[int]) -> list[Any] | None:
        """The labels of the pieces of an axis labelled ``entry`` between ``points``, classes cut
        through refined into one class per piece; None when the spec has no form for a piece."""
        return self._labeler.units.cut(entry, points)

    def structure(self, atom: Any) -> Any:
        """The structure (concatenation or tiling) a class is bound to, or None."""
        return self._labeler.units.structure(atom)

    @property
    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """The model's detached ``state_dict``."""
        return self._labeler.units.state_dict
