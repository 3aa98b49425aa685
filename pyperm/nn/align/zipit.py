r"""ZipIt!: merge two models trained on different tasks, within and across models (Stoica et al., ICLR 2024).

Permuting B onto A (Git Re-Basin) assumes both models compute the same features in another
order. Models trained on different tasks do not: some of A's features have no partner in B,
and are better merged with another feature of A. A *zip* of a permutation group of ``n``
units takes the ``2n`` features of both models, their correlation over data, and merges
them greedily into ``n`` (:mod:`~pyperm.nn.align._zip_pairing`): the merge matrix
:math:`M` (``n x 2n``) averages each cluster's features, the unmerge matrix :math:`U`
(``2n x n``) reads every original feature back as its cluster. A layer producing a zipped
group gets :math:`M` on its output axis, a layer reading one gets :math:`U` on its input axis:

.. math::

    W^* = M_A W_A U_A + M_B W_B U_B ,

with :math:`M = [M_A \; M_B]` and :math:`U = [U_A; U_B]`. A full zip gives one model of the
same architecture. A *partial zip* stops at a group: the groups up to it (in the order the
graph computes them) are zipped into a shared trunk, and each model keeps its own layers
after it, reading the trunk's merged features through its unmerge (folded into the first
layers of its tail): a model with one output per input model (:class:`ZippedModel`).

Where the groups come from: the spec and the activation sites of the tracer, as in
:func:`~pyperm.nn.activation_matching`, whose statistics pass this reuses (a group seen at
several sites, a residual stream, is zipped once on the mean of its sites' correlations).
Groups tied by a structured form (:class:`~pyperm.nn.spec.Blocks`: attention heads, the
channel groups of a grouped convolution or of a GroupNorm block; ``Tiled`` copies moved by a
group) are zipped as permutations, solved as activation matching solves them: merging two
units of different heads or blocks would mix what the structure keeps apart (a head's
softmax, a block's normalisation), so these groups take cross-model pairs only.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from pyperm._checks import check_bool
from pyperm.nn._checks import check_module, check_pair, check_spec
from pyperm.nn._runtime import iterate_batches, model_inputs, module_device, num_batches
from pyperm.nn.align._activations import Reading, collect_statistics
from pyperm.nn.align._joint import solve_joint
from pyperm.nn.align._zip_pairing import ZipPairing, zip_pairing
from pyperm.nn.align._zipped import ZippedModel
from pyperm.nn.align.activation import _group_sites, _plan_readings, _trace_models
from pyperm.nn.permutations import Permutations, apply_permutation
from pyperm.nn.spec import Blocks, Interleaved, PermutationSpec, Segments, Tiled, entry_groups
from pyperm.nn.trace import ActivationSite
from pyperm.nn.trace.tracer import build_graph

logger = logging.getLogger(__name__)

__all__ = ["ZipResult", "ZippedModel", "zipit"]


@dataclass
class ZipResult:
    """What :func:`zipit` found.

    Attributes
    ----------
    spec : PermutationSpec
        The spec zipped (the one passed in, or the traced one).
    merge, unmerge : dict of str to torch.Tensor
        Per group of ``n`` units, :math:`M` (``n x 2n``) and :math:`U` (``2n x n``); A's features are
        the first ``n`` columns of ``M`` (rows of ``U``), B's the last ``n``.
    pairings : dict of str to ZipPairing
        The greedy pairing of every plain group (its clusters and same-model merges).
    structured : tuple of str
        The groups zipped as permutations (tied by heads or blocks).
    stops : tuple of str
        The groups a partial zip may stop at, in the order the graph computes them.
    stop : str or None
        The group this zip stopped at (None: a full zip).
    zipped : tuple of str
        The groups merged: every group for a full zip, the trunk's for a partial zip.
    state : dict of str to torch.Tensor or None
        A full zip: the merged state dict, for model A's architecture. None for a partial zip.
    model : torch.nn.Module
        A full zip: a copy of model A holding ``state``. A partial zip: a :class:`ZippedModel`
        (shared trunk, one tail per model; its forward returns ``(output_a, output_b)``).
    sites : dict of str to tuple of ActivationSite
        Where each group's activations were read.
    num_batches : int
        Batches of ``data`` read.
    """

    spec: PermutationSpec
    merge: dict[str, torch.Tensor]
    unmerge: dict[str, torch.Tensor]
    pairings: dict[str, ZipPairing]
    structured: tuple[str, ...]
    stops: tuple[str, ...]
    stop: str | None
    zipped: tuple[str, ...]
    state: dict[str, torch.Tensor] | None
    model: nn.Module
    sites: dict[str, tuple[ActivationSite, ...]] = field(default_factory=dict)
    num_batches: int = 0
    _builder: Any = field(default=None, repr=False, compare=False)

    def partial(self, stop: str) -> ZippedModel:
        """The partial zip stopped at group ``stop`` (one of :attr:`stops`), from this zip's matrices (no data
        is read again): the groups up to ``stop`` zipped into a shared trunk, one tail per model after it.

        Raises
        ------
        ValueError
            ``stop`` is not one of :attr:`stops` (the message lists them).
        """
        self._check_stop(stop)
        return self._builder.partial(stop)

    def partial_states(self, stop: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The two heads of :meth:`partial` as state dicts of model A's architecture: head ``m`` is the zipped
        trunk, then model ``m``'s own layers reading it through its unmerge. Loaded into a copy of model A,
        head ``m`` computes output ``m`` of the partial zip; the trunk's entries are equal in both."""
        self._check_stop(stop)
        heads, _ = self._builder.partial_states(stop)
        return heads[0], heads[1]

    def _check_stop(self, stop: Any) -> None:
        if not isinstance(stop, str):
            raise TypeError(f"stop must be a group name, got {type(stop).__name__}")
        if stop not in self.spec.sizes:
            raise ValueError(f"stop {stop!r} is not a group of the spec (groups: {list(self.spec.groups)})")
        if stop not in self.stops:
            raise ValueError(f"a zip cannot stop at group {stop!r}: the groups before it are read by a layer that "
                             f"produces a later group; it can stop at {list(self.stops)}")  # fmt: skip

    def permutations(self) -> Permutations | None:
        """When every group's zip pairs each unit of A with one of B (same-model merges forbidden, ``alpha=0``):
        the permutations of B's units it amounts to (as :func:`activation_matching` returns them); else None."""
        perms: dict[str, torch.Tensor] = {}
        for g in self.spec.groups:
            u = self.unmerge[g]
            n = u.shape[1]
            a, b = u[:n], u[n:]
            one = torch.ones(n, dtype=u.dtype)
            if not torch.equal(a, torch.diag(one)) or not torch.equal(b.sum(0), one):
                return None
            perms[g] = b.argmax(0)
        return Permutations(self.spec, perms)


def zipit(
    model_a: nn.Module,
    model_b: nn.Module,
    spec: PermutationSpec | None,
    data: Iterable[Any],
    *,
    alpha: float = 0.3,
    beta: float = 0.125,
    stop: str | None = None,
    pre_activation: bool = False,
    max_batches: int | None = None,
    progress: bool = False,
    composite: str | None = None,
    dtype: Any = np.float64,
) -> ZipResult:
    r"""Zip two models of one architecture, merging features within and across them (ZipIt!, Stoica et al. 2024).

    For every plain group of ``n`` units, the correlation of all ``2n`` features of both models
    (streamed over ``data`` by :class:`pyperm.CrossCorrelation`, averaged over the group's sites)
    is paired greedily: the most correlated pair still allowed is merged, ``n`` times, with at
    most ``beta * n / 2`` merges of two features of one model per model and a merged feature's
    correlations scaled by ``alpha`` (:func:`~pyperm.nn.align._zip_pairing.zip_pairing`). Groups
    tied by heads or blocks are paired across models only (activation matching's permutation).

    Parameters
    ----------
    model_a, model_b : torch.nn.Module
        Two models of one architecture (trained on different tasks, say). Both run in eval mode
        under ``torch.no_grad``; neither is modified.
    spec : PermutationSpec or None
        The groups to zip (each a group of the traced spec, under any name). None: the traced spec.
    data : iterable
        Batches of inputs, as for :func:`~pyperm.nn.activation_matching`; iterated once.
    alpha : float in [0, 1], default 0.3
        The paper's :math:`\alpha`: a merged feature's correlations are scaled by it, so it is merged
        again only with features much alike. 0: a merged pair takes no further feature of a model it holds.
    beta : float in [0, 1], default 0.125
        The paper's :math:`\beta`: same-model merges allowed per model, as a fraction of ``n / 2``.
        0 forbids them (with ``alpha=0`` the zip is then a permutation: :meth:`ZipResult.permutations`).
    stop : str, optional
        A partial zip: the group of ``spec`` to stop at (one of ``ZipResult.stops``: where the
        groups zipped before it are read by no later layer's producer). None: a full zip.
    pre_activation : bool, default False
        Correlate the units before the nonlinearity instead of after it.
    max_batches : int, optional
        Use at most this many batches of ``data``.
    progress : bool, default False
        Show a progress bar over the batches.
    composite : {None, "fix", "raise"}, optional
        Passed to :func:`~pyperm.nn.trace_model`, as in :func:`~pyperm.nn.activation_matching`.
    dtype : {numpy.float64, numpy.float32}, default float64
        Accumulator precision.

    Returns
    -------
    ZipResult
        The merge and unmerge matrices, and the zipped model: ``state`` and ``model`` (a copy of
        A) for a full zip, a :class:`ZippedModel` for a partial one.

    Raises
    ------
    TypeError
        A model is not a module, ``spec`` is neither a PermutationSpec nor None, or an argument
        has the wrong type.
    ValueError
        The models differ in architecture; ``alpha`` or ``beta`` is outside [0, 1]; ``stop`` is not
        a group the zip can stop at (the message lists those); ``data`` holds no samples or an
        activation is not finite.

    Notes
    -----
    The zipped model's BatchNorm statistics are the merge of both models' (means and variances
    averaged like the weights); reset them on data (:func:`~pyperm.nn.reset_bn_stats`) as the
    paper does. Biases, norms and statistics of a zipped group are merged with :math:`M`; a
    layer whose output is no group (a classifier) takes the mean of both models' layers read
    through :math:`U`. Beside the authors' code: ``beta=0`` forbids every same-model merge (theirs
    lets each model merge one pair before its budget is found spent).

    References
    ----------
    G. Stoica, D. Bolya, J. Bjorner, P. Ramesh, T. Hearn, J. Hoffman, "ZipIt! Merging Models from
    Different Tasks without Training", ICLR 2024, sec. 4.

    Examples
    --------
    A zip of a model with itself gives the model back:

    >>> import torch
    >>> from pyperm.nn import zipit
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> result = zipit(a, a, None, [torch.randn(64, 4)])
    >>> x = torch.randn(5, 4)
    >>> torch.allclose(result.model(x), a(x), atol=1e-5)
    True
    """
    check_module(model_a, "model_a")
    check_module(model_b, "model_b")
    check_pair(model_a.state_dict(), model_b.state_dict(), ("model_a", "model_b"), strict=False)
    if spec is not None:
        check_spec(spec)
    alpha, beta = _fraction(alpha, "alpha"), _fraction(beta, "beta")
    check_bool(pre_activation, "pre_activation")
    if stop is not None and not isinstance(stop, str):
        raise TypeError(f"stop must be a group name or None, got {type(stop).__name__}")
    batches = iterate_batches(data, max_batches)
    _, first = next(batches)
    traced, graph_b = _trace_models(model_a, model_b, spec, first, composite)
    spec, sites = _group_sites(spec, traced, pre_activation)
    if stop is not None and stop not in spec.sizes:
        raise ValueError(f"stop {stop!r} is not a group of the spec (groups: {list(spec.groups)})")
    readings, of_group = _plan_readings(spec, sites)
    structured = _structured_groups(spec)
    plain = [i for i, r in enumerate(readings) if not (set(entry_groups(r.form)) & structured)]
    stats = collect_statistics(model_a, model_b, (traced.graph_module, graph_b), readings,
                               itertools.chain([(0, first)], batches), dtype=dtype, progress=progress,
                               total=num_batches(data, max_batches), concatenated=frozenset(plain),
                               method="zipit")  # fmt: skip
    accs, used = stats.accumulators, stats.num_batches

    merge: dict[str, torch.Tensor] = {}
    unmerge: dict[str, torch.Tensor] = {}
    pairings: dict[str, ZipPairing] = {}
    for g in spec.groups:
        if g in structured:
            continue
        n = spec.sizes[g]
        found = [i for i in of_group.get(g, []) if i in plain]
        if not found:  # no activation shows its units: A's and B's unit i are averaged
            pairing = ZipPairing(np.concatenate([np.arange(n), np.arange(n)]), np.zeros(2, np.int64), float("nan"))
        else:
            corr = np.mean([_correlation(accs[i]) for i in found], axis=0)
            pairing = zip_pairing(corr, alpha=alpha, beta=beta)
        pairings[g] = pairing
        merge[g] = torch.from_numpy(pairing.merge())
        unmerge[g] = torch.from_numpy(pairing.unmerge())
    perms = _solve_structured(spec, readings, accs, structured)
    for g, p in perms.items():  # a permutation as a zip: unit i of A with unit perm[i] of B
        n = spec.sizes[g]
        u = torch.zeros(2 * n, n, dtype=torch.float64)
        u[torch.arange(n), torch.arange(n)] = 1.0
        u[n + p, torch.arange(n)] = 1.0
        unmerge[g], merge[g] = u, (u / 2).T.contiguous()

    state_a = model_a.state_dict()
    # Structured groups become identities once B is permuted onto A: only plain groups need matrices.
    state_b = apply_permutation(spec, {g: perms.get(g, torch.arange(spec.sizes[g])) for g in spec.groups},
                                model_b.state_dict())  # fmt: skip
    producer = _producer_axes(model_a, spec)
    maps = {g: (merge[g].float(), unmerge[g].float()) for g in pairings}
    order = _group_order(spec, producer, traced.graph_module, list(state_a))
    builder = _Builder(model_a, spec, producer, (state_a, state_b), maps, order, first)
    stops = builder.stops()
    result = ZipResult(spec=spec, merge=merge, unmerge=unmerge, pairings=pairings, structured=tuple(sorted(structured)),
                       stops=stops, stop=None, zipped=tuple(spec.groups), state=None, model=model_a, sites=sites,
                       num_batches=used, _builder=builder)  # fmt: skip
    logger.debug("zipit: %d groups (%d structured), stop %s, %d batches", len(spec.groups), len(structured), stop, used)
    if stop is None:
        result.state = builder.full()
        result.model = copy.deepcopy(model_a)
        result.model.load_state_dict(result.state)
    else:
        result.model = result.partial(stop)
        result.stop, result.zipped = stop, tuple(order[: order.index(stop) + 1])
    return result


class _Builder:
    """What a zip needs to build its models once the matrices are found."""

    def __init__(self, model_a: nn.Module, spec: PermutationSpec, producer: Mapping[str, int | None],
                 states: tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]],
                 maps: Mapping[str, tuple[torch.Tensor, torch.Tensor]], order: list[str],
                 first: Any) -> None:  # fmt: skip
        self.model_a, self.spec, self.producer, self.states = model_a, spec, producer, states
        self.maps, self.order, self.first = maps, order, first

    def stops(self) -> tuple[str, ...]:
        return tuple(g for i, g in enumerate(self.order)
                     if _trunk_keys(self.spec, self.producer, set(self.order[: i + 1])) is not None)  # fmt: skip

    def full(self) -> dict[str, torch.Tensor]:
        groups = set(self.spec.groups)
        a, b = self.states
        return {k: _zip_tensor(self.spec, k, self.producer[k], (a[k], b[k]), self.maps, groups) for k in a}

    def partial_states(self, stop: str) -> tuple[list[dict[str, torch.Tensor]], set[str]]:
        zipped = set(self.order[: self.order.index(stop) + 1])
        return _partial_states(self.spec, self.producer, self.states, self.maps, zipped)

    def partial(self, stop: str) -> ZippedModel:
        heads, trunk = self.partial_states(stop)
        return _zipped_model(self.model_a, heads, trunk, self.first)


def _solve_structured(spec: PermutationSpec, readings: Sequence[Reading], accs: Any,
                      structured: set[str]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The structured groups' permutations, as activation matching finds them (a group no reading shows: identity)."""
    if not structured:
        return {}
    index = [i for i, r in enumerate(readings) if set(entry_groups(r.form)) & structured]
    shown = sorted({g for i in index for g in entry_groups(readings[i].form)}, key=spec.groups.index)
    found = {}
    if shown:
        found = solve_joint(spec, [readings[i].form for i in index], [_host(accs[i].correlation()) for i in index],
                            shown)  # fmt: skip
    return {g: found.get(g, torch.arange(spec.sizes[g])) for g in sorted(structured, key=spec.groups.index)}


def _correlation(acc: Any) -> np.ndarray:
    """The correlation of a plain reading's ``2u`` features, where two features constant over the data and
    equal are alike (the accumulator gives a feature of no variance a correlation of 0 with every other: a dead
    unit would then never be merged with its twin)."""
    corr = _host(acc.correlation())
    std, mean = _host(acc.std_a), _host(acc.mean_a)
    flat = np.flatnonzero(std <= 1e-12 * np.maximum(1.0, np.abs(mean)))
    if flat.size > 1:
        same = np.isclose(mean[flat, None], mean[None, flat], rtol=1e-9, atol=1e-12)
        corr[np.ix_(flat, flat)] = np.where(same, 1.0, corr[np.ix_(flat, flat)])
    return corr


def _host(matrix: Any) -> np.ndarray:
    if isinstance(matrix, torch.Tensor):
        matrix = matrix.detach().cpu().numpy()
    return np.asarray(matrix, dtype=np.float64)


# --------------------------------------------------------------------------- structure


def _leaves(entry: Any) -> list[Any]:
    if isinstance(entry, (Segments, Interleaved)):
        return [leaf for part in entry.parts for leaf in _leaves(part)]
    return [] if entry is None or isinstance(entry, int) else [entry]


def _structured_groups(spec: PermutationSpec) -> set[str]:
    """Groups of a Blocks form, of a Tiled form moved by a group or repeating a form: these move as a whole."""
    found: set[str] = set()
    for entries in spec.axes.values():
        for entry in entries:
            for leaf in _leaves(entry):
                if isinstance(leaf, Blocks) or (isinstance(leaf, Tiled) and not isinstance(leaf.group, str)) or (
                        isinstance(leaf, Tiled) and isinstance(leaf.outer, str)):  # fmt: skip
                    found |= set(entry_groups(leaf))
    return found


# Modules whose weight produces its units on another axis than the first.
_PRODUCER_AXIS = {"ConvTranspose1d": 1, "ConvTranspose2d": 1, "ConvTranspose3d": 1, "Embedding": 1,
                  "EmbeddingBag": 1, "Conv1D": 1}  # fmt: skip


def _producer_axes(model: nn.Module, spec: PermutationSpec) -> dict[str, int | None]:
    """For every state entry, the axis holding the units it produces (None: it produces no group's units).

    A layer's weight produces on its output axis (the first, but for transposed convolutions,
    embeddings and GPT-2's Conv1D); a vector (bias, norm, statistic) on its one axis. A tensor of
    another module produces on the one axis with a group, or the first when several have one."""
    modules = dict(model.named_modules())
    producer: dict[str, int | None] = {}
    for key, entries in spec.axes.items():
        path, _, name = key.rpartition(".")
        module = modules.get(path)
        axis = 0
        kind = type(module).__name__ if module is not None else ""
        if name == "weight" and kind in _PRODUCER_AXIS and len(entries) > 1:
            axis = _PRODUCER_AXIS[kind]
        elif module is None or not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd, nn.MultiheadAttention,
                                                        nn.RNNBase)):  # fmt: skip
            grouped = [i for i, e in enumerate(entries) if e is not None]
            if len(grouped) == 1:
                axis = grouped[0]
        producer[key] = axis if entries and entries[axis] is not None else None
    return producer


def _key_order(graph: fx.GraphModule, keys: Sequence[str]) -> dict[str, int]:
    """The position of every state entry in the order the graph first reads it (unread ones last)."""
    order: dict[str, int] = {}
    for node in graph.graph.nodes:
        if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
            for k in keys:
                if k not in order and (k == node.target or k.startswith(node.target + ".")):
                    order[k] = len(order)
    for k in keys:
        order.setdefault(k, len(order))
    return order


def _group_order(spec: PermutationSpec, producer: Mapping[str, int | None], graph: fx.GraphModule,
                 keys: Sequence[str]) -> list[str]:  # fmt: skip
    """The groups in the order their last producer is computed (a residual stream after its last block)."""
    order = _key_order(graph, keys)
    last: dict[str, int] = {}
    for k, axis in producer.items():
        if axis is not None:
            for g in entry_groups(spec.axes[k][axis]):
                last[g] = max(last.get(g, -1), order[k])
    for g in spec.groups:  # a group nothing produces: where it is first read
        if g not in last:
            last[g] = min(order[k] for k, _ in spec.group_axes[g])
    return sorted(spec.groups, key=lambda g: (last[g], spec.groups.index(g)))


def _trunk_keys(spec: PermutationSpec, producer: Mapping[str, int | None], zipped: set[str]) -> set[str] | None:
    """The state entries of the trunk (producing zipped units), or None when a trunk entry reads an unzipped group
    or produces zipped and unzipped units (the zip cannot stop there)."""
    trunk = set()
    for k, axis in producer.items():
        if axis is None:
            continue
        made = set(entry_groups(spec.axes[k][axis]))
        if not made & zipped:
            continue
        read = {g for i, e in enumerate(spec.axes[k]) if i != axis for g in entry_groups(e)}
        if not made <= zipped or not read <= zipped:
            return None
        trunk.add(k)
    return trunk


# --------------------------------------------------------------------------- merged tensors


def _map_axis(t: torch.Tensor, spec: PermutationSpec, key: str, axis: int, maps: Mapping[str, torch.Tensor],
              scale: float) -> torch.Tensor:  # fmt: skip
    """``t`` with every unit block of a mapped group along ``axis`` replaced by ``K @ block`` (``K = maps[g]``),
    every other entry of the axis scaled by ``scale``."""
    out = t * scale
    for g in entry_groups(spec.axes[key][axis]):
        if g not in maps:
            continue
        k = maps[g].to(t.dtype)
        pos = spec.unit_positions(key, axis, g)
        for c in range(pos.shape[1]):
            idx = pos[:, c].to(t.device)
            block = t.index_select(axis, idx).movedim(axis, 0)
            out.index_copy_(axis, idx, torch.tensordot(k.to(t.device), block, dims=1).movedim(0, axis))
    return out


def _zip_tensor(spec: PermutationSpec, key: str, producer: int | None, tensors: tuple[torch.Tensor, torch.Tensor],
                maps: Mapping[str, tuple[torch.Tensor, torch.Tensor]], zipped: set[str]) -> torch.Tensor:  # fmt: skip
    """One merged entry: ``sum_m M_m T_m U_m`` over both models (the mean when it produces no group)."""
    a, b = tensors
    if not a.is_floating_point():
        return a.clone()
    total = torch.zeros_like(a)
    for m, t in enumerate((a, b)):
        for axis, entry in enumerate(spec.axes[key]):
            if entry is None:
                continue
            if axis == producer:
                t = _map_axis(t, spec, key, axis, {g: _merge_of(maps[g][0], m) for g in maps if g in zipped}, 0.5)
            else:
                t = _map_axis(t, spec, key, axis, {g: _unmerge_of(maps[g][1], m).T for g in maps if g in zipped}, 1.0)
        total += t if producer is not None else t / 2
    return total


def _merge_of(mat: torch.Tensor, m: int) -> torch.Tensor:
    n = mat.shape[0]
    return mat[:, m * n : (m + 1) * n]


def _unmerge_of(u: torch.Tensor, m: int) -> torch.Tensor:
    n = u.shape[1]
    return u[m * n : (m + 1) * n]


def _tail_tensor(spec: PermutationSpec, key: str, producer: int | None, t: torch.Tensor, m: int,
                 maps: Mapping[str, tuple[torch.Tensor, torch.Tensor]], zipped: set[str]) -> torch.Tensor:  # fmt: skip
    """Model ``m``'s own entry, its reads of zipped groups through its unmerge ``U_m``."""
    if not t.is_floating_point():
        return t.clone()
    for axis, entry in enumerate(spec.axes[key]):
        if entry is not None and axis != producer:
            t = _map_axis(t, spec, key, axis, {g: _unmerge_of(maps[g][1], m).T for g in maps if g in zipped}, 1.0)
    return t


def _partial_states(spec: PermutationSpec, producer: Mapping[str, int | None],
                    states: tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]],
                    maps: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                    zipped: set[str]) -> tuple[list[dict[str, torch.Tensor]], set[str]]:  # fmt: skip
    """Both heads' states (the zipped trunk, then each model's tail reading it through its unmerge), and the
    trunk's keys."""
    trunk = _trunk_keys(spec, producer, zipped)
    assert trunk is not None  # the stop was checked
    merged = {k: _zip_tensor(spec, k, producer[k], (states[0][k], states[1][k]), maps, zipped) for k in trunk}
    heads = [{k: merged[k] if k in trunk else _tail_tensor(spec, k, producer[k], states[m][k], m, maps, zipped)
              for k in states[0]} for m in (0, 1)]  # fmt: skip
    return heads, trunk


def _zipped_model(model_a: nn.Module, heads: Sequence[Mapping[str, torch.Tensor]], trunk: set[str],
                  first: Any) -> ZippedModel:  # fmt: skip
    """The trunk and both tails as a :class:`ZippedModel` (copies of model A holding the heads' states)."""
    modules = []
    for state in heads:
        head = copy.deepcopy(model_a)
        head.load_state_dict(state)
        modules.append(head)
    inputs = tuple(t.to(module_device(model_a)) for t in model_inputs(first, 0))
    graph_a, frontend = build_graph(modules[0], inputs)
    graph_b, _ = build_graph(modules[1], inputs, frontend)
    shared = trunk | {k for k, t in heads[0].items() if not t.is_floating_point()}
    return ZippedModel(graph_a, graph_b, shared)


def _fraction(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)
