"""The entry points: trace a model, label it, and turn the unit classes into a spec.

After the labelling run, every class that reaches an activation and is not fixed
becomes one permutation group, named ``P_`` + the path of the first layer producing its
units; the axes of its atoms are the spec's axes. Axes never reached (convolution
kernels, an embedding's vocabulary) are ``None``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from pyperm.nn.spec import Blocks, Interleaved, PermutationSpec, Segments, Tiled
from pyperm.nn.trace import registry
from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.export import export_graph
from pyperm.nn.trace.interpreter import COMPOSITE_POLICIES, Labeler
from pyperm.nn.trace.labels import BlockAxis, InterleaveAxis, MovedTileAxis, PartsAxis, TileAxis
from pyperm.nn.trace.sites import ActivationSite, find_sites

logger = logging.getLogger(__name__)

__all__ = ["FRONTENDS", "TraceResult", "TraceWarning", "build_graph", "symbolic_trace", "trace_model"]

#: The front ends that build a model's graph, in the order they are tried.
FRONTENDS = ("fx", "export")


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
        One line per cause of units left unpermuted although they reach an activation
        (a composite axis, a group on two axes of one tensor, a module without a trace
        rule), naming the operation and its module path.
    frontend : {"fx", "export"}
        What built ``graph_module``: ``torch.fx`` (call_module nodes, the model's own
        modules) or ``torch.export`` (ATen operators, the model's own parameters).
    """

    spec: PermutationSpec
    graph_module: fx.GraphModule
    pre_activation_sites: Mapping[str, tuple[ActivationSite, ...]]
    post_activation_sites: Mapping[str, tuple[ActivationSite, ...]]
    composites: tuple[str, ...] = ()
    frontend: str = "fx"

    def sites(self, pre_activation: bool = False) -> Mapping[str, tuple[ActivationSite, ...]]:
        """The pre- or post-activation sites of every group."""
        return self.pre_activation_sites if pre_activation else self.post_activation_sites


class _Tracer(fx.Tracer):
    """``torch.fx``'s tracer, with modules that have a registered rule kept whole."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return registry.is_registered_module(m) or super().is_leaf_module(m, module_qualified_name)


def symbolic_trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with registered module types as leaves and errors turned into :class:`TraceError`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        tracer = _Tracer()
        graph = tracer.trace(model)
        return fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, ... on dynamic code
        raise TraceError(
            f"torch.fx could not trace {type(model).__name__} ({type(exc).__name__}: {exc}); data-dependent "
            "control flow cannot be traced: move it into a leaf module or pass a hand-written PermutationSpec"
        ) from exc


def build_graph(model: nn.Module, example_input: Any, frontend: str | None = None, *,
                dynamic: bool = True) -> tuple[fx.GraphModule, str]:  # fmt: skip
    """The graph of ``model`` and the front end that built it: ``torch.fx`` (``"fx"``), ``torch.export`` on
    ``example_input`` (``"export"``), or (None) torch.fx and, where it cannot trace the model, torch.export
    (with dynamic sizes where the model allows them when ``dynamic``: :func:`export_graph`).

    Raises TypeError for a model that is not a module, ValueError for another ``frontend``, and TraceError
    when the front end (both, for None) cannot build the graph, with the reason of each.
    """
    if frontend is not None and frontend not in FRONTENDS:
        raise ValueError(f"frontend must be 'fx' or 'export' (or None: fx, else export), got {frontend!r}")
    if frontend != "export":
        try:
            return symbolic_trace(model), "fx"
        except TraceError as exc:
            if frontend == "fx":
                raise
            fx_error = exc
    try:
        return export_graph(model, _as_args(example_input), dynamic=dynamic), "export"
    except TraceError as exc:
        if frontend == "export":
            raise
        raise TraceError(f"neither torch.fx nor torch.export can trace {type(model).__name__}: {fx_error}; {exc}"
                         ) from exc  # fmt: skip


def _as_args(example_input: Any) -> tuple:
    if isinstance(example_input, torch.Tensor):
        return (example_input,)
    if isinstance(example_input, (tuple, list)):
        return tuple(example_input)
    raise TypeError(
        "example_input must be a tensor or a tuple of the model's positional inputs, "
        f"got {type(example_input).__name__}"
    )


def _fix_self_loops(labeler: Labeler, composite: str) -> None:
    """A class acting on two axes of one tensor (a layer applied twice, or weights tied
    across layers) would need ``P W P^T``, which a spec cannot say: fix it, or raise."""
    units = labeler.units
    for key in units.state_dict:
        seen: dict[int, int] = {}
        for axis, a in units.atoms_of(key):
            if a is None or not units.is_group(a):
                continue
            r = units.root(a)
            if r in seen:
                module = key.rpartition(".")[0] or "<model>"
                what = (f"parameter {key!r} needs the same permutation on axes {seen[r]} and {axis} (module "
                        f"'{module}': a layer applied to its own output, or weights tied across layers)")  # fmt: skip
                if composite == "raise":
                    raise TraceError(f"{what}, which a PermutationSpec cannot name; pass composite='fix' to leave "
                                     "these units unpermuted")  # fmt: skip
                units.fix(a)
                labeler.note(f"{what}: units fixed")
            seen[r] = axis


class _SpecEntries:
    """The spec's entry for an axis label: a group name, a structured form, or None.

    Classes the spec cannot name (a concatenation repeated over a block, say) are
    collected in :attr:`unnamed` while the entries are built; :func:`_build_spec` fixes
    them and builds again.
    """

    def __init__(self, labeler: Labeler) -> None:
        self.units = labeler.units
        self.names: dict[int, str] = {}
        self.producers: dict[int, str] = {}  # class -> its first producer
        for atom, where in labeler.openers.items():
            r = self.units.root(atom)
            self.producers.setdefault(r, where)
            if r not in self.names and self.units.is_group(atom):
                self.names[r] = self._unique(f"P_{where}")
        # A class cut into pieces (UnitClasses.cut) names its pieces: its name, then the piece.
        self.pieces: dict[int, tuple[int, int]] = {}
        for sub, (cut, i) in self.units.pieces.items():
            self.pieces.setdefault(self.units.root(sub), (cut, i))
        self.sizes: dict[str, int] = {}
        self.unnamed: list[tuple[str, Any]] = []

    def reset(self) -> None:
        self.sizes.clear()
        self.unnamed.clear()

    def _unique(self, name: str) -> str:
        """``name``, or with a suffix when another class has it: two groups never share a name."""
        taken = set(self.names.values())
        k, unique = 1, name
        while unique in taken:
            unique, k = f"{name}~{k}", k + 1
        return unique

    def _base(self, r: int, seen: frozenset = frozenset()) -> str | None:
        """What class ``r`` is named after: its first producer, or the class it was cut from and its piece."""
        if r in self.producers:
            return self.producers[r]
        if r in self.pieces and r not in seen:
            cut, i = self.pieces[r]
            base = self._base(self.units.root(cut), seen | {r})
            return None if base is None else f"{base}_{i}"
        return None

    def group(self, a: int, where: str) -> str:
        r = self.units.root(a)
        if r not in self.names:  # a class without a producing layer (a piece of one, a free parameter)
            self.names[r] = self._unique(f"P_{self._base(r) or where}")
        self.sizes.setdefault(self.names[r], self.units.size(a))
        return self.names[r]

    def __call__(self, a: Any, where: str, key: str = "") -> Any:
        """The entry for an axis labelled ``a`` of ``state_dict[key]`` (``where`` names new groups)."""
        units = self.units
        if a is None:
            return None
        structure = units.structure(a)
        if structure is None:
            return self.group(a, where) if units.is_group(a) and units.is_active(a) else None
        if units.is_fixed(a):
            return None
        structure = units.canonical(structure)
        if isinstance(structure, (BlockAxis, MovedTileAxis)):
            outer = self(structure.outer, where, key)
            inner = self(structure.inner if isinstance(structure, BlockAxis) else structure.atom, where, key)
            if isinstance(outer, str) and isinstance(inner, str):
                return Blocks(outer, inner) if isinstance(structure, BlockAxis) else Tiled(inner, outer)
            if (isinstance(outer, str) and isinstance(inner, Tiled)
                    and (inner.outer, inner.inner) == (self.sizes[outer], 1)):  # fmt: skip
                return Tiled(inner.group, outer)  # blocks whose inner permutation was made one for all
            if outer is None and isinstance(inner, str) and units.is_fixed(structure.outer):
                # The blocks cannot move; their units still can.
                count = units.size(structure.outer)
                return Blocks(count, inner) if isinstance(structure, BlockAxis) else Tiled(inner, count)
            if isinstance(structure, MovedTileAxis) and _is_unit(inner):
                # Every block's units alike: a form of its own (partial rotary head dims: a fixed part, then a
                # group) in blocks moved by a group, in place, or by a structured class (query heads tiled over
                # the key/value heads they read).
                if isinstance(outer, str):
                    return Tiled(inner, outer)
                if outer is None and units.is_fixed(structure.outer):
                    return Tiled(inner, units.size(structure.outer))
                if isinstance(outer, Tiled):
                    return _tiled_over(inner, outer)
            self.unnamed.append((key, a))  # the spec cannot name it: its units are fixed
            return None
        if isinstance(structure, PartsAxis):  # never merged back: its parts were fixed
            return None
        if isinstance(structure, InterleaveAxis):  # every part its own entry, fixed ones a number of entries
            turns = [self(part, f"{where}_{i}", key) for i, (part, _) in enumerate(structure.parts)]
            if all(e is None for e in turns):
                return None
            return Interleaved(*[length if e is None else e for e, (_, length) in zip(turns, structure.parts)])
        if isinstance(structure, TileAxis):
            inner = self(structure.atom, where, key)
            tiled = None if inner is None else _tiled(inner, structure.outer, structure.inner)
            if tiled is None and inner is not None:
                self.unnamed.append((key, a))  # the spec cannot name it: its units are fixed
            return tiled
        parts: list[Any] = []
        for i, (part, length) in enumerate(structure.parts):
            e = self(part, f"{where}_{i}", key)
            if isinstance(e, Segments):
                parts.extend(e.parts)
            else:
                parts.append(length if e is None else e)
        if all(isinstance(p, int) for p in parts):
            return None
        merged: list[Any] = []
        for p in parts:  # neighbouring fixed parts are one fixed part
            if isinstance(p, int) and merged and isinstance(merged[-1], int):
                merged[-1] += p
            else:
                merged.append(p)
        return Segments(*merged)


def _tiled(entry: Any, outer: int, inner: int) -> Any:
    """The spec entry of an axis entry repeated over ``outer`` copies of blocks of ``inner`` (a tile of
    a class that is itself structured: the flatten of a concatenation, a tile of a tile, a class cut
    into pieces), or None when no axis form says it."""
    if (outer, inner) == (1, 1):
        return entry
    if isinstance(entry, str):
        return Tiled(entry, outer, inner)
    if isinstance(entry, Tiled) and isinstance(entry.outer, int):  # copies of copies, blocks of blocks
        return Tiled(entry.group, outer * entry.outer, entry.inner * inner)
    if isinstance(entry, Tiled) and outer == 1:  # copies moved by a group, every entry a block
        return Tiled(entry.group, entry.outer, entry.inner * inner)
    if isinstance(entry, Segments) and outer == 1:  # every part's entries become blocks
        parts = [part * inner if isinstance(part, int) else _tiled(part, 1, inner) for part in entry.parts]
        return None if any(part is None for part in parts) else Segments(*parts)
    if _is_unit(entry):  # copies of a concatenation of groups and fixed entries
        return Tiled(entry, outer, inner)
    return None


def _is_unit(entry: Any) -> bool:
    """Whether ``entry`` can be the repeated unit of a Tiled form: a group, a Tiled form, or a Segments of
    groups and fixed entries."""
    if isinstance(entry, Segments):
        return all(isinstance(part, (str, int)) for part in entry.parts)
    return isinstance(entry, (str, Tiled))


def _tiled_over(unit: str | Tiled | Segments, copies: str | Tiled) -> Tiled:
    """The spec entry of copies of ``unit`` moved by the index of the entry ``copies`` (one copy per entry): a
    Tiled copies form ``(outer, n, inner)`` is copies of copies, the innermost tiling the unit."""
    if isinstance(copies, str):
        return Tiled(unit, copies)
    unit = Tiled(unit, copies.inner) if copies.inner > 1 else unit  # entries of one unit of the copies' group
    tiled = _tiled_over(unit, copies.group)
    return tiled if copies.outer == 1 else Tiled(tiled, copies.outer)  # one copy in place: the unit itself


def _build_spec(labeler: Labeler) -> tuple[PermutationSpec, _SpecEntries]:
    """One group per class that reaches an activation and is not fixed, and the entries that
    name the form of other axes (the activation sites) alike."""
    units = labeler.units
    entries = _SpecEntries(labeler)
    axes: dict[str, tuple[Any, ...]] = {}
    for _ in range(len(units.state_dict) + 1):  # each pass fixes at least one class
        entries.reset()
        for key in units.state_dict:
            axes[key] = tuple(entries(a, f"{key}_{axis}", key) for axis, a in units.atoms_of(key))
        if not entries.unnamed:
            break
        for key, a in entries.unnamed:  # fixing them may change other entries: build again
            units.fix(a)
            labeler.note(f"parameter {key!r} would need a concatenation repeated over a block, which a "
                         "PermutationSpec cannot name: units fixed")  # fmt: skip
    sizes = entries.sizes
    # Keep the groups in graph order of their first producer, then the rest.
    ordered: dict[str, int] = {}
    for _, atom in labeler.producers:
        r = units.root(atom)
        if r in entries.names and entries.names[r] in sizes:
            ordered.setdefault(entries.names[r], sizes[entries.names[r]])
    for g, n in sizes.items():
        ordered.setdefault(g, n)
    return PermutationSpec(axes, ordered), entries


class TraceWarning(UserWarning):
    """The traced spec leaves units unpermuted that a richer description could align.

    Issued by :func:`trace_model` and :meth:`PermutationSpec.from_model` unless
    ``composite="fix"`` is passed explicitly; one line per cause, with its module path.
    """


# Warnings point at the first frame outside this package: the user's call of from_model,
# trace_model, activation_matching or any other entry point that traces, however deep.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _outside_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the caller point at the first frame outside pyperm."""
    frame, level = sys._getframe(1), 1  # level 1: the frame calling warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _warn(composites: Sequence[str], structured: bool) -> None:
    if not composites:
        return
    lines = "\n".join(f"  - {line}" for line in composites)
    hint = "" if structured else (
        "structured=True (the default) names most of these (concatenations, flattened feature maps, attention heads, "
        "recurrent and grouped layers, layers applied to their own output). "
    )
    warnings.warn(
        f"the traced permutation spec leaves units unpermuted ({len(composites)} cause(s)); the permuted model still "
        f"computes the same function, but these units will not be aligned:\n{lines}\n{hint}"
        "Pass composite='fix' to accept this silently, or composite='raise' to stop at the first cause.",
        TraceWarning,
        stacklevel=_outside_stacklevel(),
    )


def trace_model(
    model: nn.Module,
    example_input: Any,
    *,
    composite: str | None = None,
    structured: bool = True,
    frontend: str | None = None,
    dynamic: bool = True,
) -> TraceResult:
    """Trace ``model`` and build its permutation spec and activation sites.

    Parameters
    ----------
    model : torch.nn.Module
        The model. It is traced with :func:`torch.fx.symbolic_trace`, or where that
        cannot trace it (Python control flow, as in Hugging Face transformers) exported
        by :func:`torch.export.export` on ``example_input`` (:mod:`pyperm.nn.trace.export`),
        and run once in eval mode under ``torch.no_grad`` on ``example_input``; its
        training flags and state are left as they were. The model's outputs are never
        permuted, so a model returning more than it needs (a key/value cache) fixes
        those units too: return the logits alone.
    example_input : torch.Tensor or tuple
        One input batch (or a tuple of the forward's positional inputs) on the
        model's device.
    composite : {None, "fix", "raise"}, default None
        What to do with units a spec cannot name (an axis built out of several groups
        or parts of one: ``torch.cat`` or ``F.pad`` along channels, channel slicing,
        flatten of a convolution output larger than 1x1; a group on two axes of one
        tensor; a module without a trace rule): leave them unpermuted and say so with
        a :class:`TraceWarning` (None), leave them unpermuted silently ("fix"), or
        raise :class:`TraceError` ("raise"). Either way they are listed in
        ``TraceResult.composites``.
    structured : bool, default True
        Describe concatenations along units, flattened feature maps, splits of an axis
        of units (attention heads, channel shuffles), ``chunk``/``split`` along units (a
        group cut into one group per piece) and layers applied to their own
        output with structured spec axes (:class:`~pyperm.nn.spec.Segments`,
        :class:`~pyperm.nn.spec.Tiled`, :class:`~pyperm.nn.spec.Blocks` for the heads of
        ``nn.MultiheadAttention`` and the channel groups of grouped convolutions, one
        group on two axes), so that their units are permuted too. ``structured=False``
        gives the flat spec (one group per axis), with those units left unpermuted as
        ``composite`` says.
    frontend : {None, "fx", "export"}, default None
        What builds the graph: torch.fx, then torch.export where torch.fx fails (None),
        or only the one named.
    dynamic : bool, default True
        torch.export only: export the batch and sequence sizes as dynamic where the model
        allows it, so that ``TraceResult.graph_module`` runs on batches of other sizes.
        False exports the example's shapes, which is faster; the spec is the same.

    Returns
    -------
    TraceResult
        The spec, the traced graph module, and the activation sites of every group.

    Raises
    ------
    TypeError
        ``model`` is not a module, or ``example_input`` is neither a tensor nor a tuple.
    ValueError
        ``composite`` is not None, "fix" or "raise".
    TraceError
        Neither front end can trace the model (the message gives both reasons), or an
        operation acts on permutable units in a way the tracer cannot follow (the
        message names the operation and module path).

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
    if composite is not None and composite not in COMPOSITE_POLICIES:
        raise ValueError(f"composite must be 'fix' or 'raise' (or None: fix and warn), got {composite!r}")
    warn = composite is None
    composite = "fix" if composite is None else composite
    args = _as_args(example_input)
    gm, frontend = build_graph(model, args, frontend, dynamic=dynamic)
    state_dict = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
    if not isinstance(structured, bool):
        raise TypeError(f"structured must be a bool, got {type(structured).__name__}")
    labeler = Labeler(gm, state_dict, composite, structured)
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            labeler.run(*args)
        labeler.resolve_channel_groups()
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(f"running the traced {type(model).__name__} on example_input failed: {exc}") from exc
    finally:
        for m, mode in modes:
            m.training = mode
    if not structured:  # a structured spec names the group on both axes
        _fix_self_loops(labeler, composite)
    spec, entries = _build_spec(labeler)
    pre, post = find_sites(labeler, spec.sizes, lambda atom: entries(atom, "", ""))
    if warn:
        _warn(labeler.composites, structured)
    return TraceResult(spec=spec, graph_module=gm, pre_activation_sites=pre, post_activation_sites=post,
                       composites=tuple(labeler.composites), frontend=frontend)  # fmt: skip
