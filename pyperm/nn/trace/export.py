"""The torch.export front end: a graph of ATen operators for models torch.fx cannot trace.

``torch.fx.symbolic_trace`` runs ``forward`` on proxies, so Python control flow that reads a
tensor (Hugging Face transformers check shapes, masks and caches everywhere) stops it.
``torch.export.export(model, args, strict=False)`` runs ``forward`` on the user's example input
instead (under fake tensors), records every torch operation it reaches as an ATen operator, and
keeps the branches that input took. :func:`export_graph` returns that graph as an ``fx.GraphModule``
whose parameters and buffers are read by ``get_attr`` nodes under their ``state_dict`` names (the
model's own tensors), so the labelling interpreter runs on it as on a ``torch.fx`` graph: ATen
operators get the rule of their Python counterpart or one of :mod:`pyperm.nn.trace.rules.aten`.

The batch and sequence sizes are exported as dynamic where the model allows it (``Dim.AUTO`` on
every axis of every input), so the graph also runs on batches of other sizes (activation matching
runs it on the data); a model that needs them fixed is exported with the example input's shapes.
A caller that runs the graph on the example alone (``PermutationSpec.from_model``: only the spec is
kept) asks for the example's shapes with ``dynamic=False``: symbolic shapes make export several times
slower on a large graph, and the operators, hence the spec, are the same.

Registered rules and leaf modules
---------------------------------
torch.export inlines every module. A module whose type has a rule of its own and whose ATen
operators the rules cannot follow (``nn.MultiheadAttention`` and the recurrent layers, whose
exports mix heads or gates with other axes, and every module type registered outside torch)
is kept whole instead: it is exported with ``preserve_module_call_signature``, and its operators
are replaced by one ``call_module`` node that calls the model's own module, so its rule labels it
as under torch.fx. Where that cannot be done (keyword arguments, non-tensor inputs or outputs, an
operator of the module used outside it) the module stays inlined and its operators are labelled
one by one. Modules of the simple torch.nn layers (Linear, convolutions, norms, activations, ...)
stay inlined: their ATen operators have rules. Rules registered for functions apply to ATen
operators of the same name (``F.gelu``'s to ``aten.gelu``; see
:func:`pyperm.nn.trace.registry.lookup_function`); rules for Python functions that are not torch
operators are never reached, since export traces through them.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import TensorArgument
from torch.utils import _pytree as pytree

from pyperm.nn.trace import registry
from pyperm.nn.trace.errors import TraceError

logger = logging.getLogger(__name__)

__all__ = ["export_graph"]


def _dynamic_shapes(args: tuple) -> tuple:
    """``Dim.AUTO`` on every axis of every tensor argument: export keeps dynamic what the model allows."""
    auto = torch.export.Dim.AUTO
    return tuple({i: auto for i in range(a.ndim)} if isinstance(a, torch.Tensor) and a.ndim else None for a in args)


# torch.nn modules whose exported operators the rules cannot follow (heads or gates merged with the batch
# axis, aten.gru): kept whole. Module types registered outside torch are kept whole too.
_TORCH_LEAVES = (nn.MultiheadAttention, nn.RNNBase)


def _leaves(model: nn.Module) -> tuple[str, ...]:
    """The paths of the modules to keep whole: of a type with a rule of its own that is a torch leaf
    or not a torch.nn module at all, and not inside another such module."""
    paths: list[str] = []
    for path, m in model.named_modules():
        if not path or any(path.startswith(p + ".") for p in paths) or not registry.is_registered_module(m):
            continue
        if isinstance(m, _TORCH_LEAVES) or not type(m).__module__.startswith("torch."):
            paths.append(path)
    return tuple(paths)


@contextlib.contextmanager
def _quiet_export_logs() -> Iterator[None]:
    """torch.export logs a warning for every dynamic axis the model specialises (a sequence of one token):
    expected here (the fallback to fixed shapes handles it), so kept from the user's terminal."""
    loggers = [logging.getLogger(name) for name in ("torch._export", "torch.export", "torch.fx.experimental")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _export(model: nn.Module, args: tuple, dynamic: bool) -> tuple[torch.export.ExportedProgram, tuple[str, ...]]:
    """The exported program and the modules it kept whole: dynamic shapes where the model allows them
    (when ``dynamic``), else the example's shapes; modules kept whole where export allows it, else none."""
    leaves = _leaves(model)
    shapes = [_dynamic_shapes(args), None] if dynamic else [None]
    attempts = [(kept, s) for kept in ([leaves, ()] if leaves else [()]) for s in shapes]
    for i, (kept, shapes) in enumerate(attempts):
        try:
            with _quiet_export_logs():
                program = torch.export.export(model, args, strict=False, dynamic_shapes=shapes,
                                              preserve_module_call_signature=kept)  # fmt: skip
            return program, kept
        except Exception as exc:  # shapes that must be fixed, a module that cannot be kept whole: try the next
            if i == len(attempts) - 1:
                raise
            logger.debug("pyperm.nn trace: export (dynamic shapes: %s, kept whole: %s) failed: %s",
                         shapes is not None, kept, exc)  # fmt: skip
    raise AssertionError("unreachable")


def export_graph(model: nn.Module, args: tuple, *, dynamic: bool = True) -> fx.GraphModule:
    """``model`` exported by ``torch.export`` (non-strict, in eval mode) on ``args``, as an fx graph.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its training flags are restored afterwards.
    args : tuple
        The positional inputs of its ``forward``.
    dynamic : bool, default True
        Export the inputs' sizes as dynamic where the model allows it (the graph then runs on
        batches of other sizes); False: the example's shapes only.

    Returns
    -------
    torch.fx.GraphModule
        The unlifted graph: parameters and buffers are ``get_attr`` nodes named as in the model's
        ``state_dict`` (the model's own tensors), its operators ATen operators.

    Raises
    ------
    TraceError
        torch.export cannot export the model (the message gives its reason).
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()  # dropout and batch norm as the labelling run and activation matching see them
        program, kept = _export(model, args, dynamic)
    except Exception as exc:
        raise TraceError(f"torch.export could not export {type(model).__name__} ({type(exc).__name__}: "
                         f"{_first_line(exc)})") from exc  # fmt: skip
    finally:
        for m, mode in modes:
            m.training = mode
    gm = program.module()
    _check_names(gm, model)
    calls = {entry.fqn: entry.signature for entry in program.module_call_graph if entry.fqn in kept}
    for path, signature in calls.items():
        if signature is None or not _keep_whole(gm, model, path, signature):
            logger.info("pyperm.nn trace: module %r stays inlined in the exported graph", path)
    gm.graph.lint()
    gm.recompile()
    return gm


def _inside(node: fx.Node, path: str) -> bool:
    """Whether ``node`` computes part of the module at ``path`` (or of one of its submodules)."""
    stack = node.meta.get("nn_module_stack") or {}
    return any(p == path or p.startswith(path + ".") for p, _ in stack.values())


def _keep_whole(gm: fx.GraphModule, model: nn.Module, path: str, signature: Any) -> bool:
    """Replace the operators of the module at ``path`` by one ``call_module`` node calling the model's own
    module on the inputs of its call; False (the graph untouched) when the call cannot be rebuilt."""
    nodes = {n.name: n for n in gm.graph.nodes}
    spec = signature.in_spec  # (args, kwargs)
    args_spec, kwargs_spec = (spec.children() if hasattr(spec, "children") else spec.children_specs) \
        if spec.num_children == 2 else (None, None)  # fmt: skip
    arguments = signature.inputs + signature.outputs
    if args_spec is None or kwargs_spec.num_leaves or not all(isinstance(a, TensorArgument) and a.name in nodes
                                                              for a in arguments):  # fmt: skip
        return False
    inputs = [nodes[a.name] for a in signature.inputs]
    outputs = [nodes[a.name] for a in signature.outputs]
    region = [n for n in gm.graph.nodes if n.op == "call_function" and _inside(n, path)]
    inside = set(region)
    if not region or not set(outputs) <= inside or any(u not in inside for n in region if n not in outputs
                                                       for u in n.users):  # fmt: skip
        return False  # an operator of the module feeds the rest of the graph other than through its outputs
    gm.add_submodule(path, model.get_submodule(path))  # the model's own (parents created where none hold parameters)
    with gm.graph.inserting_before(region[0]):
        call = gm.graph.call_module(path, tuple(pytree.tree_unflatten(inputs, args_spec)))
        call.meta["nn_module_stack"] = dict(region[0].meta.get("nn_module_stack") or {})
        leaves = pytree.tree_unflatten(list(range(len(outputs))), signature.out_spec)
        for out, where in zip(outputs, _leaf_paths(leaves)):
            value = call
            for i in where:  # the output's place in the module's (nested) result
                value = gm.graph.call_function(operator.getitem, (value, i))
            out.replace_all_uses_with(value, delete_user_cb=lambda user: user not in inside)
    for n in reversed(region):
        gm.graph.erase_node(n)
    for n in gm.graph.find_nodes(op="get_attr"):
        if not n.users and n.target.startswith(path + "."):  # the module's parameters, now read by its call
            gm.graph.erase_node(n)
    return True


def _leaf_paths(tree: Any, where: tuple = ()) -> list[tuple]:
    """The index paths of the leaves of a nested tuple or list, in leaf order."""
    if isinstance(tree, (tuple, list)):
        return [p for i, t in enumerate(tree) for p in _leaf_paths(t, where + (i,))]
    return [where]


def _first_line(exc: Exception) -> str:
    """The first line of an exception's message (torch.export's messages run to pages)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_names(gm: fx.GraphModule, model: nn.Module) -> None:
    """Every parameter the graph reads must be the model's own, under its ``state_dict`` name: the
    spec's keys are those names."""
    names = set(model.state_dict(keep_vars=True))
    for node in gm.graph.find_nodes(op="get_attr"):
        value = gm.get_submodule(node.target.rpartition(".")[0]) if "." in node.target else gm
        tensor = getattr(value, node.target.rpartition(".")[2], None)
        if isinstance(tensor, nn.Parameter) and node.target not in names:
            raise TraceError(f"torch.export renamed parameter {node.target!r}: it is not in the model's state_dict")

