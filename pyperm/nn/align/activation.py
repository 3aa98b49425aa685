r"""Activation matching: align model B's units to model A's by the statistics of their activations.

Both models see the same inputs; for every permutation group, the activations of its
units in A and in B are compared through :class:`pyperm.CrossCorrelation`, and one
linear assignment per group picks the permutation of B's units that best matches A's:

- ``cost="correlation"``: the Pearson correlation of every unit of A with every unit of
  B (Tatro et al. 2020, eq. 3 and Algorithm 1), post-activation by default;
- ``cost="ols"``: the uncentred product :math:`Z^{(A)} Z^{(B)\top}` of Git Re-Basin
  (Ainsworth et al. 2023, eq. 1), whose maximiser is the least-squares match
  :math:`\arg\min_P \|Z^{(A)} - P Z^{(B)}\|_F^2`.

Where the units of a group appear is found by tracing (:func:`pyperm.nn.trace_model`):
after the nonlinearity by default, or the Linear/convolution/BatchNorm output with
``pre_activation=True``. A group that appears in several places, the residual stream of a
ResNet stage for instance, is matched once on the average of its sites' matrices (Tatro
et al., appendix D). Unlike weight matching, the groups are independent: one pass over
the data, one assignment per group.

Structured groups (:class:`~pyperm.nn.spec.Blocks`: the channel groups of a grouped
convolution, the heads of ``nn.MultiheadAttention``; :class:`~pyperm.nn.spec.Tiled` copies
moved by a group: a grouped convolution's input, split heads) are read from the whole axis
they shape and solved together with the groups they share it with: a Blocks outer group
and its inner groups by an assignment of assignments, the others by coordinate ascent of
the summed similarities (the structured weight-matching solver, applied to the similarity
matrices, from a start no group's order biases). ``nn.MultiheadAttention`` never shows its
projected query, key and value: they are computed from its inputs and ``in_proj_weight``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

import pyperm
from pyperm._checks import check_bool, check_choice
from pyperm.nn._checks import check_module, check_pair, check_spec
from pyperm.nn._ranks import Ranks, data_group
from pyperm.nn._runtime import iterate_batches, model_inputs, module_device, num_batches
from pyperm.nn.align._activations import Reading, Statistics, collect_statistics, readings_of
from pyperm.nn.align._joint import solve_joint
from pyperm.nn.permutations import Permutations
from pyperm.nn.spec import PermutationSpec, entry_groups, rename_entry
from pyperm.nn.trace import ActivationSite, TraceResult, trace_model
from pyperm.nn.trace.tracer import build_graph

logger = logging.getLogger(__name__)

__all__ = ["ActivationMatchingResult", "activation_matching"]

_COSTS = ("correlation", "ols")


@dataclass
class ActivationMatchingResult:
    """What :func:`activation_matching` found.

    Attributes
    ----------
    perms : Permutations
        One permutation per group of ``spec``, to be used with :meth:`Permutations.apply`
        on model B's state dict: unit ``i`` of the permuted model is unit ``perms[g][i]`` of B.
    spec : PermutationSpec
        The spec the permutations belong to (the one passed in, or the traced one).
    similarity : dict of str to float
        Per group, the mean over units of the matched entries of the (site-averaged)
        similarity matrix: correlation in [-1, 1], or the mean product
        :math:`\\frac{1}{n}\\sum_s a_{si} b_{s\\pi(i)}` for ``"ols"``.
    identity_similarity : dict of str to float
        The same before matching (B's units in their own order).
    sites : dict of str to tuple of ActivationSite
        Where each group's activations were read.
    num_batches : int
        Batches of ``data`` used.
    num_samples : dict of str to int
        Activation samples per group and site (batch times spatial positions or tokens),
        summed over the group's sites.
    """

    perms: Permutations
    spec: PermutationSpec
    similarity: dict[str, float] = field(default_factory=dict)
    identity_similarity: dict[str, float] = field(default_factory=dict)
    sites: dict[str, tuple[ActivationSite, ...]] = field(default_factory=dict)
    num_batches: int = 0
    num_samples: dict[str, int] = field(default_factory=dict)


def activation_matching(
    model_a: nn.Module,
    model_b: nn.Module,
    spec: PermutationSpec | None,
    data: Iterable[Any],
    *,
    cost: str = "correlation",
    pre_activation: bool = False,
    max_batches: int | None = None,
    progress: bool = False,
    composite: str | None = None,
    dtype: Any = np.float64,
    group: Any = None,
) -> ActivationMatchingResult:
    r"""Permute model B's units to match model A's activations (Tatro et al. Alg. 1; Git Re-Basin eq. 1).

    For every group ``g`` with sites :math:`s = 1..S_g` (the places its units appear as
    activations), the permutation maximises

    .. math::

        \pi_g = \arg\max_{\pi} \sum_i M_{i\,\pi(i)}, \qquad
        M = \frac{1}{S_g} \sum_{s} M^{(s)},

    where :math:`M^{(s)}_{ij}` is the Pearson correlation of unit ``i`` of A with unit
    ``j`` of B at site ``s`` (``cost="correlation"``), or their mean product
    :math:`\frac{1}{n}\sum_t a_{ti} b_{tj}` (``cost="ols"``, :math:`Z^{(A)} Z^{(B)\top}`
    up to the sample count). Every sample of the data is one row; a convolution's
    activations contribute one row per image and spatial position, a sequence model's
    one per token.

    Parameters
    ----------
    model_a, model_b : torch.nn.Module
        Two models of one architecture (the same traced graph and state_dict shapes).
        Both run in eval mode under ``torch.no_grad``; their training flags are restored
        afterwards and their state is not modified. B is the model to be permuted.
    spec : PermutationSpec or None
        The groups to match (e.g. a bundled model's ``permutation_spec()``); each must be
        a group of the traced spec, under any name. None: the traced spec.
    data : iterable
        Batches of inputs: each a tensor, or a sequence ``(inputs, targets, ...)`` whose
        first element is a tensor or a tuple of the forward's positional inputs (what a
        ``DataLoader`` yields). Iterated once; batches are moved to each model's device.
    cost : {"correlation", "ols"}, default "correlation"
        The similarity of two units (see above).
    pre_activation : bool, default False
        Read the units before the nonlinearity (the Linear/convolution output, or the
        BatchNorm after it) instead of after it.
    max_batches : int, optional
        Use at most this many batches of ``data``.
    progress : bool, default False
        Show a tqdm progress bar over the batches.
    composite : {None, "fix", "raise"}, optional
        Passed to :func:`~pyperm.nn.trace_model`. By default, units the traced spec leaves
        unpermuted are reported by a :class:`~pyperm.nn.TraceWarning` when the traced spec
        is the one matched (``spec`` None), and accepted silently when ``spec`` is given
        (it names the groups).
    dtype : {numpy.float64, numpy.float32}, default float64
        Accumulator precision of the cross-correlation matrices.
    group : torch.distributed.ProcessGroup, optional
        Split ``data`` over the ranks of this process group, both models on every rank:
        every rank calls with the same models and spec and its own share of the batches
        (at least one); each reading's cross-correlation statistics are all-reduced exactly
        (:func:`pyperm.all_reduce_cross_correlation`: counts, means, centred co-moments),
        so every rank solves the same assignments and returns what one process returns on
        all the shares together (``num_batches`` counts every rank's). None (the default):
        this process alone.

    Returns
    -------
    ActivationMatchingResult
        ``perms`` (a :class:`~pyperm.nn.Permutations` of ``spec``), the ``spec``, the
        matched and identity similarities, the sites read, and the batches and samples used.

    Raises
    ------
    TypeError
        A model is not a module, ``spec`` is neither a PermutationSpec nor None, ``data``
        is not iterable or yields something that is not a batch, ``group`` is not a
        process group, or an argument has the wrong type.
    ValueError
        The models differ in state_dict keys, shapes or traced graph; ``data`` is empty or
        holds no samples; ``cost``, ``max_batches`` or ``composite`` is invalid; ``spec``
        names a group the tracer does not find; an activation is not finite; ``group`` is
        given while torch.distributed is not initialised, or the ranks read different
        activations.
    pyperm.nn.TraceError
        The model cannot be traced (see :func:`~pyperm.nn.trace_model`).

    Notes
    -----
    The models are run through their traced graphs (``torch.fx``, or ``torch.export`` for
    models torch.fx cannot trace, such as Hugging Face transformers), which hand every
    site's output to the accumulators as soon as it is computed, so an in-place
    operation after a site (``ReLU(inplace=True)`` after a pre-activation) cannot alter
    it. Both models' site activations of one batch are held, then accumulated in ``dtype``
    (float64 by default) and released. When both models are on one CUDA device (and
    pyperm's CUDA kernels are available) they stay there, in one device accumulator per
    site; otherwise they are copied to the host and go into a
    :class:`pyperm.CrossCorrelationSet` in one call, which updates every site's
    accumulator on the thread pool at once.

    See Also
    --------
    pyperm.nn.Permutations.apply : apply ``result.perms`` to model B's state dict.
    pyperm.CrossCorrelation : the streaming statistics behind the matrices.

    References
    ----------
    N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment", NeurIPS 2020,
    eq. 3, Algorithm 1 and appendix D. S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git
    Re-Basin: Merging Models modulo Permutation Symmetries", ICLR 2023, eq. 1.

    Examples
    --------
    >>> import copy, torch
    >>> from pyperm.nn import PermutationSpec, activation_matching, apply_permutation
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> a = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    >>> spec = PermutationSpec.from_model(a, torch.randn(1, 4))
    >>> b = copy.deepcopy(a)
    >>> b.load_state_dict(apply_permutation(spec, {"P_0": torch.randperm(16)}, a.state_dict()))
    <All keys matched successfully>
    >>> data = [torch.randn(64, 4) for _ in range(4)]
    >>> result = activation_matching(a, b, None, data)
    >>> aligned = result.perms.apply(b.state_dict())
    >>> all(torch.equal(aligned[k], v) for k, v in a.state_dict().items())
    True
    """
    _check_arguments(model_a, model_b, spec, cost, pre_activation)
    ranks = data_group(group)
    batches = iterate_batches(data, max_batches)
    _, first = next(batches)  # TypeError, ValueError for data or max_batches
    traced, graph_b = _trace_models(model_a, model_b, spec, first, composite)
    spec, sites = _group_sites(spec, traced, pre_activation)
    if not spec.sizes:
        return ActivationMatchingResult(perms=Permutations(spec, {}), spec=spec)
    readings, of_group = _plan_readings(spec, sites)
    if ranks is not None:  # the same readings everywhere, or the all-reduces below would not pair up
        ranks.same([len(readings), *(r.units for r in readings)], "the activations read (one architecture?)")
    with contextlib.nullcontext() if ranks is None else ranks.together("activation_matching's pass over data"):
        stats = collect_statistics(model_a, model_b, (traced.graph_module, graph_b), readings,
                                   itertools.chain([(0, first)], batches), dtype=dtype, progress=progress,
                                   total=num_batches(data, max_batches))  # fmt: skip
    if ranks is not None:
        stats = _all_reduce_statistics(stats, ranks)
    mats = _similarities(stats, cost)
    perms = _solve_plain_groups(spec, readings, of_group, mats)
    perms.update(_solve_structured_groups(spec, readings, mats))
    return _result(spec, Permutations(spec, perms), sites, readings, of_group, mats, stats)


# --------------------------------------------------------------------------- the phases


def _check_arguments(model_a: Any, model_b: Any, spec: Any, cost: Any, pre_activation: Any) -> None:
    """The checks made before any batch is read (``data`` and ``max_batches`` are checked as they are read)."""
    check_module(model_a, "model_a")
    check_module(model_b, "model_b")
    check_pair(model_a.state_dict(), model_b.state_dict(), ("model_a", "model_b"), strict=False)
    if spec is not None:
        check_spec(spec)
    check_choice(cost, "cost", _COSTS)
    check_bool(pre_activation, "pre_activation")


def _trace_models(
    model_a: nn.Module, model_b: nn.Module, spec: PermutationSpec | None, first: Any, composite: str | None
) -> tuple[TraceResult, fx.GraphModule]:
    """A traced on the first batch (its spec and sites), and B's graph, which must be A's."""
    inputs = model_inputs(first, 0)
    # The traced spec must have the given spec's forms (a flat spec's groups are the flat trace's); no spec:
    # the default, structured trace.
    structured = spec is None or spec.structured
    if composite is None and spec is not None:
        composite = "fix"  # the given spec names the groups: the tracer only finds their sites
    device = module_device(model_a)
    traced = trace_model(model_a, tuple(t.to(device) for t in inputs), composite=composite, structured=structured)
    # B's graph from A's front end (torch.export runs B on the batch too): the same graph, or not one architecture.
    graph_b, _ = build_graph(model_b, tuple(t.to(module_device(model_b)) for t in inputs), traced.frontend)
    if str(graph_b.graph) != str(traced.graph_module.graph):
        raise ValueError("model_a and model_b trace to different graphs: activation matching needs one architecture")
    return traced, graph_b


def _group_sites(
    spec: PermutationSpec | None, traced: TraceResult, pre_activation: bool
) -> tuple[PermutationSpec, dict[str, tuple[ActivationSite, ...]]]:
    """The spec matched (the given one, or the traced one) and where each of its groups is read,
    the traced sites' forms renamed to the spec's groups."""
    if spec is None:
        spec = traced.spec
        names = {g: g for g in spec.groups}
    else:
        names = spec.groups_in(traced.spec)
    traced_name = {t: g for g, t in names.items()}
    sites: dict[str, tuple[ActivationSite, ...]] = {}
    for g in spec.groups:
        sites[g] = tuple(
            dataclasses.replace(site, form=rename_entry(site.form, traced_name))
            for site in traced.sites(pre_activation)[names[g]]
            if all(t in traced_name for t in entry_groups(site.form))  # else a group of the form is not matched
        )
    unseen = [g for g, where in sites.items() if not where]
    if unseen:
        # Units no activation shows (inside a layer with a rule of its own that records no
        # projected site, or behind a fork the walk cannot pass): they keep their order.
        # stacklevel 3: the caller of activation_matching.
        warnings.warn(f"groups {unseen} have no activation site; they keep the identity", UserWarning, stacklevel=3)
    return spec, sites


def _plan_readings(
    spec: PermutationSpec, sites: Mapping[str, Sequence[ActivationSite]]
) -> tuple[list[Reading], dict[str, list[int]]]:
    """One accumulator per reading (a part of a site's axis), each once; a group has the readings
    that hold its units (indices into the list)."""
    readings: list[Reading] = []
    of_group: dict[str, list[int]] = {}
    for g in spec.groups:
        for site in sites[g]:
            for r in readings_of(spec, site):
                if g in entry_groups(r.form):
                    if r not in readings:
                        readings.append(r)
                    of_group.setdefault(g, []).append(readings.index(r))
    return readings, of_group


def _all_reduce_statistics(stats: Statistics, ranks: Ranks) -> Statistics:
    """Every rank's accumulators made those of all the ranks' data (the exact merge of
    :func:`pyperm.all_reduce_cross_correlation`), and the batches of all ranks."""
    for i in range(len(stats.accumulators)):
        acc = stats.accumulators[i]
        # On the group's device (NCCL: the current CUDA device); the accumulator keeps its own.
        pyperm.all_reduce_cross_correlation(acc, ranks.group, device=ranks.device)
    total = int(ranks.sum(torch.tensor([float(stats.num_batches)])).item())
    return dataclasses.replace(stats, num_batches=total)


def _similarities(stats: Statistics, cost: str) -> list[np.ndarray]:
    """Every reading's similarity matrix (A's units by B's), as float64 numpy."""
    accs = [stats.accumulators[i] for i in range(len(stats.accumulators))]
    if cost == "correlation":
        return [_host(acc.correlation()) for acc in accs]
    # Per-sample means, so that sites with more positions do not outweigh the others.
    return [_host(acc.cross_product()) / acc.count for acc in accs]


def _solve_plain_groups(
    spec: PermutationSpec, readings: Sequence[Reading], of_group: Mapping[str, list[int]], mats: Sequence[np.ndarray]
) -> dict[str, torch.Tensor]:
    """One assignment per group read on its own, on the mean of its readings' matrices (Tatro et
    al., appendix D); a group no activation shows keeps the identity."""
    joint = _joint_groups(readings)
    perms: dict[str, torch.Tensor] = {}
    for g in spec.groups:
        if g not in of_group:
            perms[g] = torch.arange(spec.sizes[g])
        elif g not in joint:
            m = np.mean([mats[i] for i in of_group[g]], axis=0)
            _, col = pyperm.linear_sum_assignment(m, maximize=True)
            perms[g] = torch.from_numpy(np.asarray(col, dtype=np.int64))
    return perms


def _solve_structured_groups(
    spec: PermutationSpec, readings: Sequence[Reading], mats: Sequence[np.ndarray]
) -> dict[str, torch.Tensor]:
    """The groups tied together by structured readings (Blocks, Tiled copies moved by a group), solved together."""
    joint = _joint_groups(readings)
    if not joint:
        return {}
    return solve_joint(spec, [r.form for r in readings], mats, sorted(joint, key=spec.groups.index))


def _result(
    spec: PermutationSpec,
    perms: Permutations,
    sites: dict[str, tuple[ActivationSite, ...]],
    readings: Sequence[Reading],
    of_group: Mapping[str, list[int]],
    mats: Sequence[np.ndarray],
    stats: Statistics,
) -> ActivationMatchingResult:
    """The result: the permutations with the similarities they reach and what was read."""
    similarity: dict[str, float] = {}
    identity: dict[str, float] = {}
    num_samples: dict[str, int] = {}
    for g in spec.groups:
        num_samples[g] = sum(stats.accumulators[i].count for i in of_group.get(g, []))
        if g not in of_group:
            continue
        matched, kept = [], []
        for i in of_group[g]:
            n = mats[i].shape[0]
            index = _reading_index(spec, readings[i], perms).numpy()
            matched.append(mats[i][np.arange(n), index].mean())
            kept.append(np.trace(mats[i]) / n)
        similarity[g], identity[g] = float(np.mean(matched)), float(np.mean(kept))
    logger.debug(
        "activation_matching: %d groups, %d batches, mean similarity %.4g -> %.4g", len(perms), stats.num_batches,
        np.mean(list(identity.values()) or [0.0]), np.mean(list(similarity.values()) or [0.0]),
    )  # fmt: skip
    return ActivationMatchingResult(
        perms=perms,
        spec=spec,
        similarity=similarity,
        identity_similarity=identity,
        sites=sites,
        num_batches=stats.num_batches,
        num_samples=num_samples,
    )


# --------------------------------------------------------------------------- helpers


def _joint_groups(readings: Sequence[Reading]) -> set[str]:
    """The groups some structured reading ties to others."""
    return {g for r in readings if r.structured for g in entry_groups(r.form)}


def _host(matrix: Any) -> np.ndarray:
    """A statistic of an accumulator (a numpy array, or a torch tensor on its device) as float64 numpy."""
    if isinstance(matrix, torch.Tensor):
        matrix = matrix.detach().cpu().numpy()
    return np.asarray(matrix, dtype=np.float64)


def _reading_index(spec: PermutationSpec, reading: Reading, perms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The unit of B that each unit of a reading is matched with."""
    if not reading.structured:
        return perms[reading.form]
    groups = {g: spec.sizes[g] for g in entry_groups(reading.form)}
    return PermutationSpec({"r": (reading.form,)}, groups).axis_index("r", 0, perms)
