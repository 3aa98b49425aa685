"""Building a :class:`~pyperm.nn.PermutationSpec` by tracing a model with :mod:`torch.fx`.

How it works
------------
The model is traced symbolically (``torch.fx.symbolic_trace``; the standard ``torch.nn``
layers stay leaves) and the graph is then run once on the example input by an
interpreter that labels every tensor it computes: for each axis of the tensor, the
*unit class* acting on that axis, or ``None`` when the axis is invariant (not permuted).

Unit classes live in a union-find over *atoms*; an atom is one axis of one
``state_dict`` tensor. A parameter read by the graph is labelled with its own atoms, so
``Linear`` turns an input labelled ``(.., a)`` into an output labelled ``(.., W0)``
and joins ``a`` with ``W1`` (the weight's input axis); BatchNorm, LayerNorm, biases,
elementwise products with parameters and residual additions join classes the same way.
A join with an invariant axis (the model input, a constant, a buffer outside the
``state_dict``) *fixes* the class: it is never permuted. The model's outputs fix every
class they carry, so a model's inputs and outputs are never permuted.

After the run, every class that reaches an activation (an input-dependent tensor) and
is not fixed becomes one permutation group; the axes of its atoms are the spec's axes.
Axes never reached (convolution kernels, an embedding's vocabulary) are ``None``.

Composite axes
--------------
:class:`PermutationSpec` names one group per axis. Some operations build a channel axis
out of several groups or out of parts of one: ``torch.cat`` along channels, ``F.pad``
or slicing along channels (ResNet "option A" shortcuts), and ``flatten`` of a
convolution output whose spatial extent is larger than 1x1 (the next Linear's input
then holds blocks of ``H*W`` features per channel). A spec cannot name such an axis.
With ``composite="fix"`` (the default) every group that enters such an axis is fixed,
which keeps the spec exact (the permuted model computes the same function) at the price
of leaving those units unaligned; with ``composite="raise"`` the operation raises
:class:`TraceError`. A flatten whose spatial extent is 1 (global pooling, then
flatten: the common case) is not composite: the features are the channels. The same
policy covers a group that would act on two axes of one tensor (a layer applied to its
own output, or weights tied across layers: ``P W P^T``), which a spec cannot name either,
and a grouped convolution of the model input (its units may only be permuted within
their channel group). Every group fixed this way is listed in ``TraceResult.composites``.

Operations that cannot be handled at all (a reshape that splits a channel axis, an
order-dependent operation such as ``sort``/``cumsum``/``flip`` along channels, an
unknown function or module applied to permuted channels, a grouped convolution) raise
:class:`TraceError` naming the operation, the graph node and the module path. Unknown
operations applied only to invariant tensors are accepted: their results are invariant.

Activation sites
----------------
While labelling, the tracer records where each group's units are *produced*
(the output axis of a Linear, convolution, embedding or ``x @ W``). From every producer
it follows the graph forward: the *pre-activation* site is the producer's output, or
the output of the normalisation layers directly after it; the *post-activation* site is
the first nonlinearity after that, reached through normalisation, residual additions,
pooling and dropout (for a ResNet block: the ReLU after the residual addition). When a
fork, a layer or the model output comes first, the last tensor before it is the site.
:func:`pyperm.nn.activation_matching` hooks these sites.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from pyperm.nn.spec import PermutationSpec

logger = logging.getLogger(__name__)

__all__ = ["ActivationSite", "TraceError", "TraceResult", "trace_model"]


class TraceError(ValueError):
    """A model cannot be described by a :class:`PermutationSpec`.

    Raised when the model cannot be traced, or when an operation acts on permutable
    channels in a way the tracer cannot follow. The message names the operation, the
    ``torch.fx`` node and the module path.
    """


@dataclass(frozen=True)
class ActivationSite:
    """One place where a group's units appear as activations.

    Attributes
    ----------
    node : str
        Name of the ``torch.fx`` node whose output holds the activations.
    module : str
        Path of the module that computes it (``""`` for the model itself).
    op : str
        Readable name of the operation (``"ReLU"``, ``"relu"``, ``"add"``, ...).
    axis : int
        The tensor axis that carries the group's units; every other axis indexes
        samples (batch, spatial positions, tokens).
    """

    node: str
    module: str
    op: str
    axis: int


@dataclass(frozen=True)
class TraceResult:
    """What :func:`trace_model` found.

    Attributes
    ----------
    spec : PermutationSpec
        The permutation spec of the model.
    graph_module : torch.fx.GraphModule
        The traced graph; its submodules are the model's own modules (not copies).
    pre_activation_sites, post_activation_sites : mapping of str to tuple of ActivationSite
        For every group of ``spec``, where its units appear before and after the
        nonlinearity, in graph order.
    composites : tuple of str
        One description per composite axis whose groups were fixed (``composite="fix"``).
    """

    spec: PermutationSpec
    graph_module: fx.GraphModule
    pre_activation_sites: Mapping[str, tuple[ActivationSite, ...]]
    post_activation_sites: Mapping[str, tuple[ActivationSite, ...]]
    composites: tuple[str, ...] = ()

    def sites(self, pre_activation: bool = False) -> Mapping[str, tuple[ActivationSite, ...]]:
        """The pre- or post-activation sites of every group."""
        return self.pre_activation_sites if pre_activation else self.post_activation_sites


# --------------------------------------------------------------------------- labels


class _TL(tuple):
    """The label of one tensor: per axis, an atom id (a unit class) or None (invariant)."""


def _is_tl(x: Any) -> bool:
    return isinstance(x, _TL)


def _tensor_leaves(value: Any, label: Any) -> list[tuple[torch.Tensor, _TL]]:
    """Pairs (tensor, label) of every tensor inside a (possibly nested) argument."""
    out: list[tuple[torch.Tensor, _TL]] = []
    if isinstance(value, torch.Tensor):
        out.append((value, label if _is_tl(label) else _TL((None,) * value.ndim)))
    elif isinstance(value, (list, tuple)):
        labels = label if isinstance(label, (list, tuple)) and len(label) == len(value) else [None] * len(value)
        for v, lab in zip(value, labels):
            out.extend(_tensor_leaves(v, lab))
    elif isinstance(value, Mapping):
        labels = label if isinstance(label, Mapping) else {}
        for k, v in value.items():
            out.extend(_tensor_leaves(v, labels.get(k)))
    return out


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` of every tensor in ``value``; tuples (named ones too) and lists become tuples, dicts dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return None


def _invariant_label(value: Any) -> Any:
    """A label with every tensor axis invariant, mirroring ``value``'s structure."""
    return _map_tensors(value, lambda v: _TL((None,) * v.ndim))


def _has_atoms(label: Any) -> bool:
    return any(a is not None for leaf in pytree.tree_leaves(label, is_leaf=_is_tl) if _is_tl(leaf) for a in leaf)


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (tuples, named tuples, lists and dicts are searched)."""
    found: list[torch.Tensor] = []
    _map_tensors(value, found.append)
    return found


def _nodes_in(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, lambda n: found.append(n) or n)
    return found


class _UnionFind:
    def __init__(self) -> None:
        self.parent: list[int] = []
        self.size: list[int] = []
        self.fixed: list[bool] = []
        self.active: list[bool] = []

    def new(self, size: int) -> int:
        self.parent.append(len(self.parent))
        self.size.append(int(size))
        self.fixed.append(False)
        self.active.append(False)
        return len(self.parent) - 1

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:  # path compression
            self.parent[a], a = root, self.parent[a]
        return root

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if self.size[ra] != self.size[rb]:
            raise AssertionError(f"joining unit classes of sizes {self.size[ra]} and {self.size[rb]}")
        self.parent[rb] = ra
        self.fixed[ra] = self.fixed[ra] or self.fixed[rb]
        self.active[ra] = self.active[ra] or self.active[rb]
        return ra


# --------------------------------------------------------------------------- op tables

# Elementwise operations: every tensor argument broadcasts against the others; a unit
# class survives an axis only if every non-broadcast operand carries it there.
_NONLINEAR_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid,
    nn.Tanh, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.LogSigmoid,
    nn.Tanhshrink, nn.Softshrink, nn.Hardshrink, nn.Threshold, nn.RReLU, nn.Softmax, nn.LogSoftmax,
    nn.Softmin,
)  # fmt: skip
_PASSTHROUGH_MODULES = (
    nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)  # fmt: skip
_POOL_MODULES = {
    nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3,
    nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3, nn.AdaptiveMaxPool1d: 1,
    nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3, nn.LPPool1d: 1, nn.LPPool2d: 2,
    nn.FractionalMaxPool2d: 2, nn.FractionalMaxPool3d: 3, nn.Upsample: -1, nn.UpsamplingNearest2d: 2,
    nn.UpsamplingBilinear2d: 2,
}  # fmt: skip
_PAD_MODULES = (
    nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d,
    nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d, nn.ReplicationPad1d, nn.ReplicationPad2d,
    nn.ReplicationPad3d,
)  # fmt: skip
_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONVT_MODULES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
               nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)  # fmt: skip
_RMS_NORM = getattr(nn, "RMSNorm", None)

_NONLINEAR_FUNCS = {
    F.relu, torch.relu, F.relu_, torch.relu_, F.relu6, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish,
    F.leaky_relu, F.hardtanh, F.hardswish, F.hardsigmoid, F.logsigmoid, F.softplus, F.softsign, F.tanhshrink,
    F.softshrink, F.hardshrink, F.threshold, F.rrelu, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, torch.exp,
    torch.log, torch.abs, torch.sqrt, torch.rsqrt, torch.square, torch.clamp, torch.clip, torch.sin, torch.cos,
    torch.erf, torch.reciprocal, torch.sign, torch.log1p, torch.expm1, F.softmax, F.log_softmax, F.softmin,
    torch.softmax, torch.log_softmax, torch.pow, operator.pow, torch.maximum, torch.minimum, F.normalize,
}  # fmt: skip
_LINEAR_ELEMENTWISE_FUNCS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.iadd, operator.isub, operator.imul,
    operator.itruediv, operator.neg, operator.pos, torch.add, torch.sub, torch.mul, torch.div, torch.neg,
    torch.where, torch.lerp, torch.nan_to_num, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
    F.alpha_dropout, F.feature_alpha_dropout, torch.masked_fill,
}  # fmt: skip
_NONLINEAR_METHODS = {
    "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "exp", "log", "abs", "sqrt", "rsqrt", "square",
    "clamp", "clamp_", "clip", "pow", "softmax", "log_softmax", "sin", "cos", "erf", "reciprocal", "sign",
    "log1p", "expm1", "maximum", "minimum",
}  # fmt: skip
_LINEAR_ELEMENTWISE_METHODS = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "lerp", "masked_fill", "masked_fill_",
    "nan_to_num", "where",
}  # fmt: skip
# Methods whose result is the first argument, other arguments only give dtype or device.
_SAME_METHODS = {"contiguous", "clone", "detach", "float", "double", "half", "bfloat16", "to", "type", "type_as",
                 "cpu", "cuda", "requires_grad_"}  # fmt: skip
_RESHAPE_FUNCS = {torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze}
_RESHAPE_METHODS = {"view", "reshape", "flatten", "squeeze", "unsqueeze", "view_as", "reshape_as", "unflatten",
                    "squeeze_", "unsqueeze_"}  # fmt: skip
_REDUCE_FUNCS = {torch.mean, torch.sum, torch.amax, torch.amin, torch.std, torch.var, torch.logsumexp,
                 torch.prod, torch.norm}  # fmt: skip
_REDUCE_METHODS = {"mean", "sum", "amax", "amin", "std", "var", "logsumexp", "prod", "norm"}
_ORDER_FUNCS = {torch.sort: "sort", torch.argsort: "argsort", torch.cumsum: "cumsum", torch.cumprod: "cumprod",
                torch.flip: "flip", torch.roll: "roll", torch.topk: "topk", torch.argmax: "argmax",
                torch.argmin: "argmin", torch.cummax: "cummax", torch.cummin: "cummin"}  # fmt: skip
_ORDER_METHODS = {"sort", "argsort", "cumsum", "cumprod", "flip", "roll", "topk", "argmax", "argmin", "cummax",
                  "cummin"}  # fmt: skip
_POOL_FUNCS = {
    F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3,
    F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3, F.adaptive_max_pool1d: 1,
    F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3, F.lp_pool1d: 1, F.lp_pool2d: 2, F.interpolate: -1,
    F.upsample: -1, F.max_pool1d_with_indices: 1, F.max_pool2d_with_indices: 2, F.max_pool3d_with_indices: 3,
}  # fmt: skip
_CONV_FUNCS = {F.conv1d, F.conv2d, F.conv3d}
_CONVT_FUNCS = {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_MATMUL_FUNCS = {torch.matmul, operator.matmul, torch.mm, torch.bmm}
_LIKE_FUNCS = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
               torch.randn_like}  # fmt: skip
_NEW_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}

_KIND_PRODUCER = "producer"  # opens the units of a group (Linear, convolution, embedding, x @ W)
_KIND_NORM = "norm"  # BatchNorm, LayerNorm, ...: still a pre-activation
_KIND_NONLINEAR = "nonlinear"  # the post-activation
_KIND_PASS = "pass"  # keeps units as they are (add, dropout, pooling, reshape, ...)
_KIND_OTHER = "other"


def _get(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _op_name(node: fx.Node, module: nn.Module | None) -> str:
    if module is not None:
        return type(module).__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    mod = getattr(target, "__module__", None) or ""
    if mod.startswith("torch.nn.functional"):
        return f"F.{name}"
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    if mod.startswith("torch"):
        return f"torch.{name}"
    return name


def _module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return str(path)
    return ""


def _node_name(node: Any) -> str | None:
    """A get_attr node's attribute path (minus ".weight"), or the node's name."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        target = str(node.target)
        return target[: -len(".weight")] if target.endswith(".weight") else target
    return node.name


def _dims(dim: Any, ndim: int) -> list[int] | None:
    """Normalised reduction dims; None means every dim."""
    if dim is None:
        return None
    if isinstance(dim, int):
        dim = [dim]
    if isinstance(dim, (list, tuple)) and len(dim) == 0:
        return None
    return sorted({int(d) % ndim for d in dim}) if ndim else []


# --------------------------------------------------------------------------- the tracer


@dataclass
class _Ctx:
    node: fx.Node
    args: tuple
    kwargs: dict
    largs: tuple
    lkwargs: dict
    result: Any
    module: nn.Module | None
    path: str
    opname: str

    def where(self) -> str:
        path = self.path or "<model>"
        return f"{self.opname} (graph node '{self.node.name}', module '{path}')"


class _Labeler(fx.Interpreter):
    """Runs the traced graph once and labels every value it computes."""

    def __init__(self, gm: fx.GraphModule, state_dict: Mapping[str, torch.Tensor], composite: str) -> None:
        super().__init__(gm)
        self.uf = _UnionFind()
        self.composite = composite
        self.composites: list[str] = []
        self.labels: dict[fx.Node, Any] = {}
        self.dep: dict[fx.Node, bool] = {}
        self.kind: dict[fx.Node, str] = {}
        self.producers: list[tuple[fx.Node, int]] = []  # (node, atom of the produced units)
        self.openers: dict[int, str] = {}  # atom -> state_dict key it belongs to
        self.state_dict = state_dict
        self._atoms: dict[tuple[str, int], int] = {}
        # Tied parameters (one tensor under two names) must be permuted alike.
        self._canon: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for key, t in state_dict.items():
            ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else None
            if ident is not None and ident in seen:
                self._canon[key] = seen[ident]
            else:
                if ident is not None:
                    seen[ident] = key
                self._canon[key] = key

    # ---- atoms and classes
    def atom(self, key: str, axis: int) -> int:
        key = self._canon[key]
        a = self._atoms.get((key, axis))
        if a is None:
            a = self._atoms[(key, axis)] = self.uf.new(self.state_dict[key].shape[axis])
        return a

    def param_label(self, key: str | None) -> _TL | None:
        if key is None or key not in self.state_dict:
            return None
        t = self.state_dict[key]
        return _TL(self.atom(key, i) for i in range(t.ndim))

    def atom_of_key(self, key: str, axis: int) -> int | None:
        return self._atoms.get((self._canon[key], axis))

    def fix(self, *atoms: int | None) -> None:
        for a in atoms:
            if a is not None:
                self.uf.fixed[self.uf.find(a)] = True

    def join(self, *atoms: int | None) -> int | None:
        """Joins classes that must be permuted alike; an invariant (None) among them fixes them all."""
        if not atoms:
            return None
        if any(a is None for a in atoms):
            self.fix(*atoms)
            return None
        root = atoms[0]
        for a in atoms[1:]:
            if self.uf.size[self.uf.find(root)] != self.uf.size[self.uf.find(a)]:
                raise TraceError(
                    f"unit classes of sizes {self.uf.size[self.uf.find(root)]} and {self.uf.size[self.uf.find(a)]} "
                    "meet on one axis"
                )
            root = self.uf.union(root, a)
        return root

    def fix_label(self, label: Any) -> None:
        for leaf in pytree.tree_leaves(label, is_leaf=_is_tl):
            if _is_tl(leaf):
                self.fix(*leaf)

    # ---- the interpreter loop
    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        result = getattr(self, n.op)(n.target, args, kwargs)
        largs = fx.node.map_arg(n.args, lambda a: self.labels[a])
        lkwargs = fx.node.map_arg(n.kwargs, lambda a: self.labels[a])
        module = self.module.get_submodule(n.target) if n.op == "call_module" else None
        ctx = _Ctx(n, tuple(args), dict(kwargs), tuple(largs), dict(lkwargs), result, module, _module_path(n),
                   _op_name(n, module))  # fmt: skip
        dep = n.op == "placeholder" or any(self.dep.get(a, False) for a in n.all_input_nodes)
        self.dep[n] = dep
        self.kind[n] = _KIND_OTHER
        label = self._label(ctx)
        self.labels[n] = label
        if dep:  # these classes reach an activation: they are units, not just parameter axes
            for leaf in pytree.tree_leaves(label, is_leaf=_is_tl):
                for a in leaf if _is_tl(leaf) else ():
                    if a is not None:
                        self.uf.active[self.uf.find(a)] = True
        return result

    def _label(self, c: _Ctx) -> Any:
        n = c.node
        if n.op == "placeholder":
            return _invariant_label(c.result)
        if n.op == "get_attr":
            if isinstance(c.result, torch.Tensor) and n.target in self.state_dict:
                return self.param_label(str(n.target))
            return _invariant_label(c.result)  # a constant: never permuted
        if n.op == "output":
            self.fix_label(c.largs)  # the model's outputs are never permuted
            return None
        if not _tensors(c.result):
            return None  # sizes, dtypes, Python numbers: nothing to permute
        handler = self._handler(c)
        if handler is not None:
            return handler(c)
        return self._unknown(c)

    def _unknown(self, c: _Ctx) -> Any:
        """An operation the tracer does not know: fine on invariant activations only."""
        inputs = list(zip(c.node.args, c.args, c.largs)) + [
            (c.node.kwargs[k], v, c.lkwargs.get(k)) for k, v in c.kwargs.items()
        ]
        for node_arg, value, lab in inputs:
            leaves = _tensor_leaves(value, lab)
            dep = any(self.dep.get(a, False) for a in _nodes_in(node_arg))
            if dep and any(a is not None for _, l in leaves for a in l):
                raise TraceError(
                    f"unsupported operation {c.where()}: it acts on permuted units and the tracer does not know "
                    "how it treats them"
                )
        # Parameters fed to it (directly or inside a leaf module) cannot be permuted.
        for _, value, lab in inputs:
            for _, l in _tensor_leaves(value, lab):
                self.fix(*l)
        if c.module is not None:
            for name, _ in c.module.named_parameters():
                key = f"{c.path}.{name}" if c.path else name
                if key in self.state_dict:
                    self.fix(*self.param_label(key))
        return _invariant_label(c.result)

    # ---- dispatch
    def _handler(self, c: _Ctx) -> Callable[[_Ctx], Any] | None:
        n, m = c.node, c.module
        if m is not None:
            if isinstance(m, nn.Linear):
                return self._linear_module
            if isinstance(m, _CONV_MODULES):
                return self._conv_module
            if isinstance(m, _CONVT_MODULES):
                return self._convt_module
            if isinstance(m, _BN_MODULES):
                return self._bn_module
            if isinstance(m, nn.LayerNorm) or (_RMS_NORM is not None and isinstance(m, _RMS_NORM)):
                return self._ln_module
            if isinstance(m, nn.GroupNorm):
                return self._gn_module
            if isinstance(m, nn.Embedding):
                return self._embedding_module
            if isinstance(m, nn.PReLU):
                return self._prelu_module
            if isinstance(m, _NONLINEAR_MODULES):
                return self._elementwise_nonlinear
            if isinstance(m, _PASSTHROUGH_MODULES):
                return self._elementwise_linear
            if isinstance(m, (nn.Flatten, nn.Unflatten)):
                return self._reshape
            for cls, k in _POOL_MODULES.items():
                if type(m) is cls:
                    return lambda c, k=k: self._pool(c, k)
            if isinstance(m, _PAD_MODULES):
                return self._pad_module
            return None
        if n.op == "call_method":
            name = str(n.target)
            if name in _NONLINEAR_METHODS:
                return self._elementwise_nonlinear
            if name in _LINEAR_ELEMENTWISE_METHODS:
                return self._elementwise_linear
            if name in _SAME_METHODS:
                return self._same
            if name in _RESHAPE_METHODS:
                return self._reshape
            if name in _REDUCE_METHODS:
                return self._reduce
            if name in ("max", "min"):
                return self._maxmin
            if name in _ORDER_METHODS:
                return self._order
            if name in ("permute", "transpose", "t", "movedim", "moveaxis", "swapaxes", "swapdims"):
                return self._permute
            if name in ("expand", "expand_as"):
                return self._expand
            if name in ("matmul", "mm", "bmm"):
                return self._matmul
            if name in ("chunk", "split", "tensor_split", "unbind"):
                return self._split
            if name in _NEW_METHODS:
                return lambda c: _invariant_label(c.result)
            return None
        # call_function
        f = n.target
        if f is operator.getitem:
            return self._getitem
        if f is getattr:
            return self._getattr
        if f in _NONLINEAR_FUNCS:
            return self._elementwise_nonlinear
        if f in _LINEAR_ELEMENTWISE_FUNCS:
            return self._elementwise_linear
        if f in _RESHAPE_FUNCS:
            return self._reshape
        if f in _REDUCE_FUNCS:
            return self._reduce
        if f in (torch.max, torch.min):
            return self._maxmin
        if f in _ORDER_FUNCS:
            return self._order
        if f in (torch.permute, torch.transpose, torch.t, torch.movedim, torch.moveaxis, torch.swapaxes,
                 torch.swapdims):  # fmt: skip
            return self._permute
        if f in _POOL_FUNCS:
            k = _POOL_FUNCS[f]
            return lambda c: self._pool(c, k)
        if f in (torch.cat, torch.concat, torch.concatenate):
            return self._cat
        if f is torch.stack:
            return self._stack
        if f in (torch.chunk, torch.split, torch.tensor_split, torch.unbind):
            return self._split
        if f is F.pad:
            return self._pad
        if f is F.linear:
            return self._linear_function
        if f in _CONV_FUNCS:
            return self._conv_function
        if f in _CONVT_FUNCS:
            return self._convt_function
        if f in (F.batch_norm, F.instance_norm):
            return self._bn_function
        if f is F.layer_norm or f is getattr(F, "rms_norm", None):
            return self._ln_function
        if f is F.group_norm:
            return self._gn_function
        if f is F.embedding:
            return self._embedding_function
        if f is F.prelu:
            return self._prelu_function
        if f in _MATMUL_FUNCS:
            return self._matmul
        if f in _LIKE_FUNCS:
            return lambda c: _invariant_label(c.result)
        return None

    # ---- helpers
    def _composite_or_raise(self, c: _Ctx, what: str, atoms: Sequence[int | None]) -> None:
        atoms = [a for a in atoms if a is not None]
        if not atoms:
            return
        sizes = sorted({self.uf.size[self.uf.find(a)] for a in atoms})
        if self.composite == "raise":
            raise TraceError(
                f"{c.where()} {what}: the result's channel axis is a composite of permuted units (unit counts "
                f"{sizes}), which a PermutationSpec cannot name; pass composite='fix' to leave these units unpermuted"
            )
        self.fix(*atoms)
        note = f"{c.where()} {what}: units fixed (composite axis)"
        self.composites.append(note)
        logger.info("pyperm.nn trace: %s", note)

    def _first(self, c: _Ctx) -> tuple[torch.Tensor, _TL]:
        x = c.args[0] if c.args else next(iter(c.kwargs.values()))
        lab = c.largs[0] if c.args else next(iter(c.lkwargs.values()))
        if not isinstance(x, torch.Tensor):
            raise TraceError(f"{c.where()} expected a tensor as its first argument")
        return x, lab if _is_tl(lab) else _TL((None,) * x.ndim)

    def _out_tensor(self, c: _Ctx) -> torch.Tensor:
        if not isinstance(c.result, torch.Tensor):
            raise TraceError(f"{c.where()} returned {type(c.result).__name__}; the tracer expected a tensor")
        return c.result

    def _broadcast(self, operands: Sequence[tuple[torch.Tensor | torch.Size, _TL]], out_shape: Sequence[int]) -> _TL:
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
                    self.fix(lab[j])  # a one-unit class broadcast over many units
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
        return _TL(out)

    def _label_like(self, result: Any, label: _TL) -> Any:
        """``label`` for every tensor of ``result`` of the same rank (ops returning (values, indices))."""
        return _map_tensors(result, lambda v: label if v.ndim == len(label) else _TL((None,) * v.ndim))

    # ---- elementwise
    def _elementwise(self, c: _Ctx, kind: str) -> Any:
        out = self._out_tensor(c)
        ops = [(t, lab) for t, lab in _tensor_leaves(c.args, c.largs)]
        for k, v in c.kwargs.items():
            ops.extend(_tensor_leaves(v, c.lkwargs.get(k)))
        self.kind[c.node] = kind
        return self._broadcast(ops, tuple(out.shape))

    def _elementwise_nonlinear(self, c: _Ctx) -> Any:
        return self._elementwise(c, _KIND_NONLINEAR)

    def _elementwise_linear(self, c: _Ctx) -> Any:
        return self._elementwise(c, _KIND_PASS)

    def _same(self, c: _Ctx) -> Any:
        _, lab = self._first(c)
        self.kind[c.node] = _KIND_PASS
        return lab

    def _member(self, c: _Ctx) -> Any:
        """The label of an element picked out of a container (tuple, named tuple, list, dict)."""
        obj, lobj = c.args[0], c.largs[0]
        key = c.args[1] if len(c.args) > 1 else None
        if isinstance(obj, (tuple, list)) and isinstance(lobj, tuple) and len(lobj) == len(obj):
            if isinstance(key, slice) and c.node.target is operator.getitem:
                return lobj[key]
            for i, v in enumerate(obj):
                if v is c.result:
                    return lobj[i]
        if isinstance(obj, Mapping) and isinstance(lobj, Mapping):
            for k, v in obj.items():
                if v is c.result and k in lobj:
                    return lobj[k]
        if _has_atoms(lobj):
            raise TraceError(f"{c.where()} picks something out of a container the tracer cannot follow")
        return _invariant_label(c.result)

    def _getattr(self, c: _Ctx) -> Any:
        if not isinstance(c.args[0], torch.Tensor):
            return self._member(c)
        x, lab = self._first(c)
        name = c.args[1]
        if name in ("T", "mT", "mH", "H"):
            order = list(range(x.ndim))
            if name in ("T", "H"):
                order.reverse()
            elif x.ndim >= 2:
                order[-2], order[-1] = order[-1], order[-2]
            return _TL(lab[i] for i in order)
        if name in ("data",):
            return lab
        if any(a is not None for a in lab):
            raise TraceError(f"unsupported attribute access Tensor.{name} at {c.where()}")
        return _invariant_label(c.result)

    # ---- layers
    def _linear(self, c: _Ctx, x: torch.Tensor, lx: _TL, w: _TL | None, b: _TL | None, wdep: bool) -> _TL:
        if w is None:
            raise TraceError(f"{c.where()}: the weight is not a tensor the tracer can follow")
        self.join(lx[-1], w[1])
        if b is not None:
            self.join(w[0], b[0])
        self._opened(c, w[0], wdep, self._weight_name(c))
        return _TL(tuple(lx[:-1]) + (w[0],))

    def _opened(self, c: _Ctx, atom: int | None, weight_dep: bool, name: str | None = None) -> None:
        """``atom`` holds freshly produced units (unless the weight itself depends on the input).

        ``name`` names the producer: the module path, or the weight's attribute for a
        functional layer.
        """
        if atom is None or weight_dep:
            self.kind[c.node] = _KIND_OTHER
            return
        self.kind[c.node] = _KIND_PRODUCER
        self.producers.append((c.node, atom))
        self.openers.setdefault(atom, name or c.path or c.node.name)

    def _weight_name(self, c: _Ctx) -> str | None:
        if c.node.op == "call_module":
            return c.path or c.node.name
        w = c.node.args[1] if len(c.node.args) > 1 else c.node.kwargs.get("weight")
        return _node_name(w)

    def _mod_param(self, c: _Ctx, name: str) -> _TL | None:
        if getattr(c.module, name, None) is None:
            return None
        key = f"{c.path}.{name}" if c.path else name
        if key not in self.state_dict:
            raise TraceError(
                f"{c.where()}: its {name} is not in the model's state_dict under {key!r} "
                "(a parametrized or lazily initialised module?)"
            )
        return self.param_label(key)

    def _arg_label(self, c: _Ctx, i: int, name: str) -> tuple[_TL | None, bool]:
        """The label of a tensor argument and whether it depends on the input."""
        node = c.node.args[i] if len(c.node.args) > i else c.node.kwargs.get(name)
        value = _get(c.args, c.kwargs, i, name)
        if not isinstance(value, torch.Tensor):
            return None, False
        lab = _get(c.largs, c.lkwargs, i, name)
        dep = isinstance(node, fx.Node) and self.dep.get(node, False)
        return (lab if _is_tl(lab) else _TL((None,) * value.ndim)), dep

    def _linear_module(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        return self._linear(c, x, lx, self._mod_param(c, "weight"), self._mod_param(c, "bias"), False)

    def _linear_function(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        w, wdep = self._arg_label(c, 1, "weight")
        b, _ = self._arg_label(c, 2, "bias")
        return self._linear(c, x, lx, w, b, wdep)

    def _conv(self, c: _Ctx, x: torch.Tensor, lx: _TL, w: _TL | None, b: _TL | None, groups: int,
              transposed: bool, wdep: bool) -> _TL:  # fmt: skip
        if w is None:
            raise TraceError(f"{c.where()}: the weight is not a tensor the tracer can follow")
        wt = c.module.weight if c.module is not None else _get(c.args, c.kwargs, 1, "weight")
        spatial = wt.ndim - 2
        ch = x.ndim - spatial - 1  # 1 for batched input, 0 for unbatched
        if any(a is not None for a in lx[ch + 1 :]):
            raise TraceError(f"{c.where()} convolves over an axis that carries permuted units")
        c_in = x.shape[ch]
        if groups == 1:
            out_atom = w[0]
            if transposed:  # weight (in, out, *k)
                self.join(lx[ch], w[0])
                out_atom = w[1]
            else:  # weight (out, in, *k)
                self.join(lx[ch], w[1])
            if b is not None:
                self.join(out_atom, b[0])
            self._opened(c, out_atom, wdep, self._weight_name(c))
            return _TL(tuple(lx[:ch]) + (out_atom,) + tuple(lx[ch + 1 :]))
        if not transposed and groups == c_in and wt.shape[0] == c_in:
            # Depthwise: output channel i depends on input channel i alone, so one group runs through.
            unit = self.join(lx[ch], w[0])
            if b is not None:
                unit = self.join(unit, b[0])
            self.kind[c.node] = _KIND_PASS
            return _TL(tuple(lx[:ch]) + (unit,) + tuple(lx[ch + 1 :]))
        if lx[ch] is None and not transposed:
            # Grouped convolution of an invariant input: its output units may only be permuted
            # within their channel group, which a spec cannot say.
            self._composite_or_raise(c, f"is a grouped convolution (groups={groups})", [w[0]])
            self.fix(*w)
            if b is not None:
                self.fix(*b)
            return _TL(tuple(lx[:ch]) + (None,) + tuple(lx[ch + 1 :]))
        raise TraceError(
            f"unsupported grouped convolution (groups={groups}) at {c.where()}: permutations would have to "
            "respect the channel groups"
        )

    def _conv_module(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        m = c.module
        return self._conv(c, x, lx, self._mod_param(c, "weight"), self._mod_param(c, "bias"), m.groups, False, False)

    def _convt_module(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        m = c.module
        return self._conv(c, x, lx, self._mod_param(c, "weight"), self._mod_param(c, "bias"), m.groups, True, False)

    def _conv_function(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        w, wdep = self._arg_label(c, 1, "weight")
        b, _ = self._arg_label(c, 2, "bias")
        return self._conv(c, x, lx, w, b, int(_get(c.args, c.kwargs, 6, "groups", 1)), False, wdep)

    def _convt_function(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        w, wdep = self._arg_label(c, 1, "weight")
        b, _ = self._arg_label(c, 2, "bias")
        return self._conv(c, x, lx, w, b, int(_get(c.args, c.kwargs, 6, "groups", 1)), True, wdep)

    def _channel_norm(self, c: _Ctx, lx: _TL, params: Sequence[_TL | None]) -> _TL:
        """BatchNorm/InstanceNorm/PReLU style: per-channel parameters on axis 1."""
        ch = 1 if len(lx) >= 2 else 0
        unit = lx[ch]
        for p in params:
            if p is not None:
                unit = self.join(unit, p[0])
        self.kind[c.node] = _KIND_NORM
        return _TL(tuple(lx[:ch]) + (unit,) + tuple(lx[ch + 1 :]))

    def _bn_module(self, c: _Ctx) -> _TL:
        _, lx = self._first(c)
        names = ("weight", "bias", "running_mean", "running_var")
        return self._channel_norm(c, lx, [self._mod_param(c, k) for k in names])

    def _bn_function(self, c: _Ctx) -> _TL:
        _, lx = self._first(c)
        names = ("running_mean", "running_var", "weight", "bias")
        params = [self._arg_label(c, i, k)[0] for i, k in enumerate(names, 1)]
        return self._channel_norm(c, lx, params)

    def _ln(self, c: _Ctx, lx: _TL, k: int, params: Sequence[_TL | None]) -> _TL:
        """Normalisation over the last ``k`` axes; its parameters cover exactly those axes."""
        out = list(lx)
        for j in range(k):
            axis = len(lx) - k + j
            atoms = [out[axis]] + [p[j] for p in params if p is not None]
            out[axis] = self.join(*atoms) if any(p is not None for p in params) else out[axis]
        self.kind[c.node] = _KIND_NORM
        return _TL(out)

    def _ln_module(self, c: _Ctx) -> _TL:
        _, lx = self._first(c)
        k = len(c.module.normalized_shape)  # type: ignore[union-attr]
        return self._ln(c, lx, k, [self._mod_param(c, "weight"), self._mod_param(c, "bias")])

    def _ln_function(self, c: _Ctx) -> _TL:
        _, lx = self._first(c)
        shape = _get(c.args, c.kwargs, 1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(shape)
        if c.node.target is F.layer_norm:
            params = [self._arg_label(c, 2, "weight")[0], self._arg_label(c, 3, "bias")[0]]
        else:
            params = [self._arg_label(c, 2, "weight")[0]]
        return self._ln(c, lx, k, params)

    def _gn(self, c: _Ctx, x: torch.Tensor, lx: _TL, groups: int, params: Sequence[_TL | None]) -> _TL:
        ch = 1
        if groups not in (1, x.shape[ch]) and lx[ch] is not None:
            raise TraceError(
                f"unsupported GroupNorm with {groups} groups of {x.shape[ch]} channels at {c.where()}: its "
                "statistics mix channels within a group, so permutations would have to respect the groups"
            )
        if groups not in (1, x.shape[ch]):
            for p in params:
                if p is not None:
                    self.fix(*p)
            self.kind[c.node] = _KIND_NORM
            return lx
        return self._channel_norm(c, lx, params)

    def _gn_module(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        params = [self._mod_param(c, "weight"), self._mod_param(c, "bias")]
        return self._gn(c, x, lx, c.module.num_groups, params)  # type: ignore[union-attr]

    def _gn_function(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        params = [self._arg_label(c, 2, "weight")[0], self._arg_label(c, 3, "bias")[0]]
        return self._gn(c, x, lx, int(_get(c.args, c.kwargs, 1, "num_groups")), params)

    def _embedding(self, c: _Ctx, lidx: _TL, w: _TL | None, wdep: bool) -> _TL:
        if w is None:
            raise TraceError(f"{c.where()}: the weight is not a tensor the tracer can follow")
        if any(a is not None for a in lidx):
            raise TraceError(f"{c.where()} looks up indices that carry permuted units")
        self._opened(c, w[1], wdep, self._weight_name(c))
        return _TL(tuple(lidx) + (w[1],))

    def _embedding_module(self, c: _Ctx) -> _TL:
        _, lidx = self._first(c)
        return self._embedding(c, lidx, self._mod_param(c, "weight"), False)

    def _embedding_function(self, c: _Ctx) -> _TL:
        _, lidx = self._first(c)
        w, wdep = self._arg_label(c, 1, "weight")
        return self._embedding(c, lidx, w, wdep)

    def _prelu(self, c: _Ctx, lx: _TL, w: _TL | None, n: int) -> _TL:
        out = self._channel_norm(c, lx, [w] if n > 1 else [])
        self.kind[c.node] = _KIND_NONLINEAR
        return out

    def _prelu_module(self, c: _Ctx) -> _TL:
        _, lx = self._first(c)
        return self._prelu(c, lx, self._mod_param(c, "weight"), c.module.num_parameters)  # type: ignore[union-attr]

    def _prelu_function(self, c: _Ctx) -> _TL:
        _, lx = self._first(c)
        w, _ = self._arg_label(c, 1, "weight")
        return self._prelu(c, lx, w, int(c.args[1].numel()))

    def _matmul(self, c: _Ctx) -> _TL:
        a, la = self._first(c)
        name = "mat2" if c.node.target in (torch.mm, torch.bmm) or c.node.target in ("mm", "bmm") else "other"
        b = _get(c.args, c.kwargs, 1, name)
        if not isinstance(b, torch.Tensor):
            raise TraceError(f"{c.where()} expected two tensors")
        lb, bdep = self._arg_label(c, 1, name)
        node_a = c.node.args[0]
        adep = isinstance(node_a, fx.Node) and self.dep.get(node_a, False)
        # 1-D operands are promoted to matrices and the added axis dropped afterwards.
        la2 = _TL(la) if a.ndim >= 2 else _TL((None,) + tuple(la))
        lb2 = _TL(lb) if b.ndim >= 2 else _TL(tuple(lb) + (None,))
        sa = tuple(a.shape) if a.ndim >= 2 else (1,) + tuple(a.shape)
        sb = tuple(b.shape) if b.ndim >= 2 else tuple(b.shape) + (1,)
        # The contracted axis: sum_k a_k b_k is invariant when both sides permute k alike.
        self.join(la2[-1], lb2[-2])
        batch_shape = tuple(torch.broadcast_shapes(sa[:-2], sb[:-2]))
        out = list(self._broadcast([(torch.Size(sa[:-2]), _TL(la2[:-2])), (torch.Size(sb[:-2]), _TL(lb2[:-2]))],
                                   batch_shape))  # fmt: skip
        if a.ndim >= 2:
            out.append(la2[-2])
        if b.ndim >= 2:
            out.append(lb2[-1])
        self.kind[c.node] = _KIND_OTHER
        weight = c.node.args[1] if len(c.node.args) > 1 else c.node.kwargs.get(name)
        if not bdep and b.ndim >= 2 and lb2[-1] is not None:
            self._opened(c, lb2[-1], False, _node_name(weight))  # x @ W: W's columns are new units
        elif not adep and a.ndim >= 2 and la2[-2] is not None:
            self._opened(c, la2[-2], False, _node_name(node_a))  # W @ x
        return _TL(out)

    # ---- shapes
    def _reshape(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        out = self._out_tensor(c)
        self.kind[c.node] = _KIND_PASS
        return self._reshape_labels(c, tuple(x.shape), tuple(out.shape), lx)

    def _reshape_labels(self, c: _Ctx, src: tuple, dst: tuple, lx: _TL) -> _TL:
        if not any(a is not None for a in lx):
            return _TL((None,) * len(dst))
        if math.prod(src) == 0:
            self.fix(*lx)
            return _TL((None,) * len(dst))
        # Axes of size 1 carry nothing; match the others block by block (equal products).
        for i, s in enumerate(src):
            if s == 1:
                self.fix(lx[i])
        si = [i for i, s in enumerate(src) if s != 1]
        di = [j for j, s in enumerate(dst) if s != 1]
        out: list[int | None] = [None] * len(dst)
        p = q = 0
        while p < len(si) or q < len(di):
            bi, bj = [si[p]], [di[q]]
            pi, pj = src[si[p]], dst[di[q]]
            p, q = p + 1, q + 1
            while pi != pj:
                if pi < pj:
                    bi.append(si[p])
                    pi *= src[si[p]]
                    p += 1
                else:
                    bj.append(di[q])
                    pj *= dst[di[q]]
                    q += 1
            atoms = [lx[i] for i in bi]
            if not any(a is not None for a in atoms):
                continue
            if len(bi) == 1 and len(bj) == 1:
                out[bj[0]] = atoms[0]
            elif len(bj) == 1:
                others = [src[i] for i in bi if lx[i] is None]
                what = (f"merges an axis of permuted units with axes of sizes {others} into one axis (blocks of "
                        f"{math.prod(others)} features per unit: flatten of a convolution output larger "
                        "than 1x1?)")  # fmt: skip
                self._composite_or_raise(c, what, atoms)
            else:
                raise TraceError(
                    f"unsupported reshape {c.where()}: it splits or mixes an axis of permuted units "
                    f"(shape {src} -> {dst})"
                )
        return _TL(out)

    def _permute(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        nd = x.ndim
        name = c.node.target if c.node.op == "call_method" else c.node.target.__name__
        rest = list(c.args[1:])
        order = list(range(nd))
        if name == "permute":
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
            if not dims:
                dims = c.kwargs.get("dims")
            order = [int(d) % nd for d in dims]
        elif name in ("transpose", "swapaxes", "swapdims"):
            d0 = int(_get(c.args, c.kwargs, 1, "dim0")) % nd
            d1 = int(_get(c.args, c.kwargs, 2, "dim1")) % nd
            order[d0], order[d1] = order[d1], order[d0]
        elif name == "t":
            order.reverse()
        else:  # movedim / moveaxis
            src = _get(c.args, c.kwargs, 1, "source")
            dst = _get(c.args, c.kwargs, 2, "destination")
            src = [int(s) % nd for s in (src if isinstance(src, (list, tuple)) else [src])]
            dst = [int(s) % nd for s in (dst if isinstance(dst, (list, tuple)) else [dst])]
            rest_axes = iter([i for i in range(nd) if i not in src])
            place = dict(zip(dst, src))
            order = [place[j] if j in place else next(rest_axes) for j in range(nd)]
        self.kind[c.node] = _KIND_PASS
        return _TL(lx[i] for i in order)

    def _expand(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        out = self._out_tensor(c)
        self.kind[c.node] = _KIND_PASS
        return self._broadcast([(x, lx)], tuple(out.shape))

    def _reduce(self, c: _Ctx) -> _TL:
        x, lx = self._first(c)
        out = self._out_tensor(c)
        name = c.node.target if c.node.op == "call_method" else c.node.target.__name__
        if name == "norm":
            dim = c.kwargs.get("dim", c.args[2] if len(c.args) > 2 else None)
        else:
            dim = c.kwargs.get("dim", c.kwargs.get("axis"))
            if dim is None and len(c.args) > 1 and isinstance(c.args[1], (int, list, tuple)) and not isinstance(
                c.args[1], bool
            ):
                dim = c.args[1]
        dims = _dims(dim, x.ndim)
        dims = list(range(x.ndim)) if dims is None else dims
        # Sums, means, maxima over units are invariant under a permutation of those units.
        self.kind[c.node] = _KIND_PASS
        if out.ndim == x.ndim:  # keepdim
            return _TL(None if i in dims else a for i, a in enumerate(lx))
        return _TL(a for i, a in enumerate(lx) if i not in dims)

    def _maxmin(self, c: _Ctx) -> Any:
        x, lx = self._first(c)
        other = _get(c.args, c.kwargs, 1, "other", _get(c.args, c.kwargs, 1, "dim"))
        if isinstance(other, torch.Tensor):
            return self._elementwise(c, _KIND_NONLINEAR)
        if other is None:
            return _invariant_label(c.result)  # the maximum of everything: invariant
        d = int(other) % x.ndim
        if lx[d] is not None:
            raise TraceError(
                f"unsupported {c.where()} along an axis of permuted units: the indices it returns depend on the "
                "order of the units (use amax/amin for the values alone)"
            )
        keep = bool(_get(c.args, c.kwargs, 2, "keepdim", False))
        lab = _TL(lx) if keep else _TL(a for i, a in enumerate(lx) if i != d)
        return self._label_like(c.result, lab)

    def _order(self, c: _Ctx) -> Any:
        x, lx = self._first(c)
        name = c.node.target if c.node.op == "call_method" else c.node.target.__name__
        if name in ("flip", "roll"):
            dims = _get(c.args, c.kwargs, 1 if name == "flip" else 2, "dims")
            dims = list(range(x.ndim)) if dims is None and name == "flip" else _dims(dims, x.ndim)
            if dims is None:  # roll without dims rolls the flattened tensor
                dims = list(range(x.ndim))
        elif name == "topk":
            dims = _dims(_get(c.args, c.kwargs, 2, "dim", -1), x.ndim)
        elif name in ("argmax", "argmin"):
            dims = _dims(_get(c.args, c.kwargs, 1, "dim"), x.ndim)
            dims = list(range(x.ndim)) if dims is None else dims
        else:
            dims = _dims(_get(c.args, c.kwargs, 1, "dim", -1), x.ndim)
        bad = [d for d in dims if lx[d] is not None]
        if bad:
            raise TraceError(
                f"unsupported {c.where()} along axis {bad[0]}, which carries permuted units: its result depends on "
                "the order of the units"
            )
        out = c.result
        if name in ("argmax", "argmin"):
            keep = isinstance(out, torch.Tensor) and out.ndim == x.ndim
            return _TL(None if i in dims else a for i, a in enumerate(lx)) if keep else _TL(
                a for i, a in enumerate(lx) if i not in dims
            )
        self.kind[c.node] = _KIND_PASS
        return self._label_like(out, lx)

    def _pool(self, c: _Ctx, k: int) -> Any:
        x, lx = self._first(c)
        if k < 0:  # interpolate/Upsample: every axis after the channels is spatial
            k = max(x.ndim - 2, 1)
        if any(a is not None for a in lx[len(lx) - k :]):
            raise TraceError(f"unsupported {c.where()}: it pools over an axis that carries permuted units")
        self.kind[c.node] = _KIND_PASS
        return self._label_like(c.result, lx)

    def _pad_labels(self, c: _Ctx, lx: _TL, pad: Sequence[int]) -> _TL:
        out = list(lx)
        for i in range(len(pad) // 2):
            axis = len(lx) - 1 - i
            if (pad[2 * i] or pad[2 * i + 1]) and lx[axis] is not None:
                self._composite_or_raise(c, f"pads axis {axis}, which carries permuted units", [lx[axis]])
                out[axis] = None
        self.kind[c.node] = _KIND_PASS
        return _TL(out)

    def _pad(self, c: _Ctx) -> _TL:
        _, lx = self._first(c)
        return self._pad_labels(c, lx, list(_get(c.args, c.kwargs, 1, "pad")))

    def _pad_module(self, c: _Ctx) -> _TL:
        _, lx = self._first(c)
        return self._pad_labels(c, lx, list(c.module.padding))  # type: ignore[union-attr]

    def _cat(self, c: _Ctx) -> _TL:
        tensors = _get(c.args, c.kwargs, 0, "tensors")
        labels = _get(c.largs, c.lkwargs, 0, "tensors")
        parts = _tensor_leaves(list(tensors), list(labels))
        out_t = self._out_tensor(c)
        parts = [(t, lab) for t, lab in parts if not (t.ndim == 1 and t.numel() == 0)]  # legacy empty tensors
        d = int(_get(c.args, c.kwargs, 1, "dim", 0)) % out_t.ndim
        if len(parts) == 1:
            self.kind[c.node] = _KIND_PASS
            return parts[0][1]
        out: list[int | None] = []
        for k in range(out_t.ndim):
            atoms = [lab[k] for _, lab in parts]
            if k != d:
                out.append(self.join(*atoms) if any(a is not None for a in atoms) else None)
            else:
                self._composite_or_raise(c, f"concatenates along axis {d}, which carries permuted units", atoms)
                out.append(None)
        self.kind[c.node] = _KIND_PASS
        return _TL(out)

    def _stack(self, c: _Ctx) -> _TL:
        tensors = _get(c.args, c.kwargs, 0, "tensors")
        labels = _get(c.largs, c.lkwargs, 0, "tensors")
        parts = _tensor_leaves(list(tensors), list(labels))
        out_t = self._out_tensor(c)
        d = int(_get(c.args, c.kwargs, 1, "dim", 0)) % out_t.ndim
        joined = [self.join(*[lab[k] for _, lab in parts]) if any(lab[k] is not None for _, lab in parts) else None
                  for k in range(out_t.ndim - 1)]  # fmt: skip
        self.kind[c.node] = _KIND_PASS
        return _TL(joined[:d] + [None] + joined[d:])

    def _split(self, c: _Ctx) -> Any:
        x, lx = self._first(c)
        name = c.node.target if c.node.op == "call_method" else c.node.target.__name__
        if name == "unbind":
            d = int(_get(c.args, c.kwargs, 1, "dim", 0)) % x.ndim
            if lx[d] is not None:
                self._composite_or_raise(c, f"unbinds axis {d}, which carries permuted units", [lx[d]])
            piece = _TL(a for i, a in enumerate(lx) if i != d)
            return _map_tensors(c.result, lambda v: piece)
        d = int(_get(c.args, c.kwargs, 2, "dim", 0)) % x.ndim
        lab = lx
        pieces = _tensors(c.result)
        if lx[d] is not None and any(isinstance(p, torch.Tensor) and p.shape[d] != x.shape[d] for p in pieces):
            self._composite_or_raise(c, f"splits axis {d}, which carries permuted units", [lx[d]])
            lab = _TL(None if i == d else a for i, a in enumerate(lx))
        self.kind[c.node] = _KIND_PASS
        return _map_tensors(c.result, lambda v: lab)

    def _getitem(self, c: _Ctx) -> Any:
        obj, idx = c.args[0], c.args[1]
        lobj = c.largs[0]
        if not isinstance(obj, torch.Tensor):
            return self._member(c)
        lx = lobj if _is_tl(lobj) else _TL((None,) * obj.ndim)
        self.kind[c.node] = _KIND_PASS
        return self._index_labels(c, obj, lx, idx)

    def _index_labels(self, c: _Ctx, x: torch.Tensor, lx: _TL, idx: Any) -> _TL:
        items = list(idx) if isinstance(idx, tuple) else [idx]
        if any(isinstance(it, (torch.Tensor, list)) or (isinstance(it, bool)) for it in items):
            if any(a is not None for a in lx):
                raise TraceError(f"unsupported advanced indexing {c.where()} of a tensor that carries permuted units")
            return _invariant_label(c.result)
        used = sum(1 for it in items if it is not None and it is not Ellipsis)
        if Ellipsis in items:
            e = items.index(Ellipsis)
            items = items[:e] + [slice(None)] * (x.ndim - used) + items[e + 1 :]
        items = items + [slice(None)] * (x.ndim - sum(1 for it in items if it is not None))
        out: list[int | None] = []
        axis = 0
        for it in items:
            if it is None:
                out.append(None)
                continue
            a = lx[axis]
            size = x.shape[axis]
            if isinstance(it, int):
                if a is not None:
                    self._composite_or_raise(c, f"selects one unit of axis {axis}, which carries permuted units", [a])
            elif isinstance(it, slice):
                full = range(*it.indices(size)) == range(size)
                if full:
                    out.append(a)
                else:
                    if a is not None:
                        self._composite_or_raise(c, f"slices axis {axis}, which carries permuted units", [a])
                    out.append(None)
            else:
                raise TraceError(f"unsupported index {it!r} at {c.where()}")
            axis += 1
        return _TL(out)


# --------------------------------------------------------------------------- sites


def _carries(labeler: _Labeler, node: fx.Node, root: int) -> int | None:
    """The axis of ``node``'s output that carries class ``root``, or None."""
    lab = labeler.labels.get(node)
    if not _is_tl(lab):
        return None
    for axis, a in enumerate(lab):
        if a is not None and labeler.uf.find(a) == root:
            return axis
    return None


def _site(labeler: _Labeler, node: fx.Node, axis: int) -> ActivationSite:
    module = labeler.module.get_submodule(node.target) if node.op == "call_module" else None
    return ActivationSite(node=node.name, module=_module_path(node), op=_op_name(node, module), axis=axis)


def _find_sites(labeler: _Labeler, group_roots: Mapping[str, int]) -> tuple[dict, dict]:
    order = {n: i for i, n in enumerate(labeler.module.graph.nodes)}
    pre: dict[str, dict[fx.Node, int]] = {g: {} for g in group_roots}
    post: dict[str, dict[fx.Node, int]] = {g: {} for g in group_roots}
    root_to_group = {r: g for g, r in group_roots.items()}
    for node, atom in labeler.producers:
        g = root_to_group.get(labeler.uf.find(atom))
        if g is None:
            continue
        root = group_roots[g]

        def next_node(cur: fx.Node, kinds: tuple[str, ...]) -> fx.Node | None:
            users = list(cur.users)
            if len(users) == 1 and labeler.kind.get(users[0]) in kinds:
                if _carries(labeler, users[0], root) is not None:
                    return users[0]
            return None

        cur = node
        while (nxt := next_node(cur, (_KIND_NORM,))) is not None:
            cur = nxt
        pre[g].setdefault(cur, _carries(labeler, cur, root))  # type: ignore[arg-type]
        while labeler.kind.get(cur) != _KIND_NONLINEAR:
            nxt = next_node(cur, (_KIND_NORM, _KIND_PASS, _KIND_NONLINEAR))
            if nxt is None:
                break
            cur = nxt
        post[g].setdefault(cur, _carries(labeler, cur, root))  # type: ignore[arg-type]

    def pack(sites: dict[str, dict[fx.Node, int]]) -> dict[str, tuple[ActivationSite, ...]]:
        return {g: tuple(_site(labeler, n, ax) for n, ax in sorted(s.items(), key=lambda kv: order[kv[0]]))
                for g, s in sites.items()}  # fmt: skip

    return pack(pre), pack(post)


# --------------------------------------------------------------------------- entry point


def _fix_self_loops(labeler: _Labeler, state_dict: Mapping[str, torch.Tensor], composite: str) -> None:
    """A class acting on two axes of one tensor (a layer applied twice, or weights tied
    across layers) would need ``P W P^T``, which a spec cannot say: fix it, or raise."""
    uf = labeler.uf
    for key, t in state_dict.items():
        seen: dict[int, int] = {}
        for axis in range(t.ndim):
            a = labeler.atom_of_key(key, axis)
            if a is None:
                continue
            r = uf.find(a)
            if uf.fixed[r] or not uf.active[r]:
                continue
            if r in seen:
                what = (f"parameter {key!r} needs the same permutation on axes {seen[r]} and {axis} (a layer "
                        "applied to its own output, or weights tied across layers)")  # fmt: skip
                if composite == "raise":
                    raise TraceError(f"{what}, which a PermutationSpec cannot name; pass composite='fix' to leave "
                                     "these units unpermuted")  # fmt: skip
                uf.fixed[r] = True
                labeler.composites.append(f"{what}: units fixed")
                logger.info("pyperm.nn trace: %s: units fixed", what)
            seen[r] = axis


def _as_args(example_input: Any) -> tuple:
    if isinstance(example_input, torch.Tensor):
        return (example_input,)
    if isinstance(example_input, (tuple, list)):
        return tuple(example_input)
    raise TypeError(
        "example_input must be a tensor or a tuple of the model's positional inputs, "
        f"got {type(example_input).__name__}"
    )


def symbolic_trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with errors turned into :class:`TraceError`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        return fx.symbolic_trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, ... on dynamic code
        raise TraceError(
            f"torch.fx could not trace {type(model).__name__} ({type(exc).__name__}: {exc}); data-dependent "
            "control flow cannot be traced: move it into a leaf module or pass a hand-written PermutationSpec"
        ) from exc


def trace_model(model: nn.Module, example_input: Any, *, composite: str = "fix") -> TraceResult:
    """Trace ``model`` and build its permutation spec and activation sites.

    Parameters
    ----------
    model : torch.nn.Module
        The model. It is traced with :func:`torch.fx.symbolic_trace` and run once in
        eval mode under ``torch.no_grad`` on ``example_input``; its training flags and
        state are left as they were.
    example_input : torch.Tensor or tuple
        One input batch (or a tuple of the forward's positional inputs) on the
        model's device.
    composite : {"fix", "raise"}, default "fix"
        What to do with an axis built out of several groups or parts of one
        (``torch.cat`` or ``F.pad`` along channels, channel slicing, flatten of a
        convolution output larger than 1x1): leave the units involved unpermuted, or
        raise :class:`TraceError`.

    Returns
    -------
    TraceResult
        The spec, the traced graph module, and the activation sites of every group.

    Raises
    ------
    TypeError
        ``model`` is not a module, or ``example_input`` is neither a tensor nor a tuple.
    ValueError
        ``composite`` is not "fix" or "raise".
    TraceError
        The model cannot be traced, or an operation acts on permutable units in a way
        the tracer cannot follow (the message names the operation and module path).

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.trace import trace_model
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> result = trace_model(model, torch.randn(3, 4))
    >>> dict(result.spec.sizes)
    {'P_0': 8}
    >>> result.post_activation_sites["P_0"][0].module
    '1'
    """
    if composite not in ("fix", "raise"):
        raise ValueError(f"composite must be 'fix' or 'raise', got {composite!r}")
    args = _as_args(example_input)
    gm = symbolic_trace(model)
    state_dict = model.state_dict(keep_vars=True)
    state_dict = {k: v.detach() for k, v in state_dict.items()}
    labeler = _Labeler(gm, state_dict, composite)
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            labeler.run(*args)
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(f"running the traced {type(model).__name__} on example_input failed: {exc}") from exc
    finally:
        for m, mode in modes:
            m.training = mode

    uf = labeler.uf
    _fix_self_loops(labeler, state_dict, composite)
    # One group per class that reaches an activation and is not fixed, named after
    # the first layer (in graph order) that produces its units.
    names: dict[int, str] = {}
    for atom, where in labeler.openers.items():
        r = uf.find(atom)
        if r not in names and uf.active[r] and not uf.fixed[r]:
            names[r] = f"P_{where}"
    axes: dict[str, tuple[str | None, ...]] = {}
    sizes: dict[str, int] = {}
    roots: dict[str, int] = {}
    for key, t in state_dict.items():
        groups: list[str | None] = []
        for axis in range(t.ndim):
            a = labeler.atom_of_key(key, axis)
            r = uf.find(a) if a is not None else None
            if r is None or uf.fixed[r] or not uf.active[r]:
                groups.append(None)
                continue
            if r not in names:  # a class without a producing layer (a free parameter, say)
                names[r] = f"P_{key}_{axis}"
            groups.append(names[r])
            sizes.setdefault(names[r], uf.size[r])
            roots.setdefault(names[r], r)
        axes[key] = tuple(groups)
    # Keep the groups in graph order of their first producer, then the rest.
    ordered = {}
    for node, atom in labeler.producers:
        r = uf.find(atom)
        if r in names and names[r] in sizes:
            ordered.setdefault(names[r], sizes[names[r]])
    for g, n in sizes.items():
        ordered.setdefault(g, n)
    spec = PermutationSpec(axes, ordered)
    pre, post = _find_sites(labeler, {g: roots[g] for g in ordered})
    return TraceResult(spec=spec, graph_module=gm, pre_activation_sites=pre, post_activation_sites=post,
                       composites=tuple(labeler.composites))  # fmt: skip
