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

import dataclasses
import itertools
import logging
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

import pyperm
from pyperm._progress import progress_bar
from pyperm.nn._runtime import (
    eval_mode,
    iterate_batches,
    model_inputs,
    module_device,
    num_batches,
)
from pyperm.nn.align._joint import solve_joint
from pyperm.nn.spec import PermutationSpec, Segments, Tiled, _entry_groups, _rename
from pyperm.nn.trace import ActivationSite, TraceError, symbolic_trace
from pyperm.nn.trace.sites import Projection
from pyperm.nn.trace.tracer import _trace

logger = logging.getLogger(__name__)

__all__ = ["ActivationMatchingResult", "activation_matching"]

_COSTS = ("correlation", "ols")


@dataclass
class ActivationMatchingResult:
    """What :func:`activation_matching` found.

    Attributes
    ----------
    perms : dict of str to (n,) int64 torch.Tensor
        One permutation per group of ``spec`` (on the CPU), to be used with
        :func:`~pyperm.nn.apply_permutation` on model B: unit ``i`` of the permuted
        model is unit ``perms[g][i]`` of B.
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

    perms: dict[str, torch.Tensor]
    spec: PermutationSpec
    similarity: dict[str, float] = field(default_factory=dict)
    identity_similarity: dict[str, float] = field(default_factory=dict)
    sites: dict[str, tuple[ActivationSite, ...]] = field(default_factory=dict)
    num_batches: int = 0
    num_samples: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers


def _samples(x: Any, axis: int, site: str, device: torch.device) -> torch.Tensor:
    """Activations as a C-contiguous (samples, units) tensor on ``device`` that no later op can modify."""
    if not isinstance(x, torch.Tensor):
        raise TraceError(f"the activations at node {site!r} are a {type(x).__name__}, not a tensor")
    x = x.detach()
    z = x.movedim(axis, -1).reshape(-1, x.shape[axis])
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    if z.device != device:
        return z.to(device)  # a copy
    if z.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        z = z.clone()  # an in-place op later in the graph (ReLU(inplace=True)) would overwrite it
    return z.contiguous()


@dataclass(frozen=True)
class _Reading:
    """A part of a site's axis that one accumulator reads.

    ``form`` is a group name (the part holds its units; a :class:`Tiled` part with fixed
    copies is read with the copies as extra samples) or a structured form over the whole
    part (``Blocks``, ``Tiled`` copies moved by a group), whose groups are solved together.
    """

    node: str
    axis: int
    start: int
    length: int
    form: Any
    copies: tuple[int, int] = (1, 1)  # (outer, inner) copies of a Tiled part folded into samples
    projection: Projection | None = None  # see ActivationSite.projection

    @property
    def units(self) -> int:
        return self.length // (self.copies[0] * self.copies[1])

    @property
    def structured(self) -> bool:
        return not isinstance(self.form, str)

    def take(self, z: torch.Tensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This part of a site's (samples, axis) activations, as (samples, units); a projected
        site's activations are computed with ``state``, the model's CPU state dict."""
        p = self.projection
        if p is not None:
            z = z @ state[p.weight][p.rows[0] : p.rows[1]].to(z.dtype).T
            if p.bias is not None:
                z = z + state[p.bias][p.bias_rows[0] : p.bias_rows[1]].to(z.dtype)  # type: ignore[index]
        z = z[:, self.start : self.start + self.length]
        outer, inner = self.copies
        if outer * inner > 1:
            z = z.reshape(-1, outer, self.units, inner).transpose(2, 3).reshape(-1, self.units)
        return z.contiguous()


def _readings(spec: PermutationSpec, site: ActivationSite) -> list[_Reading]:
    """The parts of ``site``'s axis that hold units, each with its form."""
    parts = site.form.parts if isinstance(site.form, Segments) else (site.form,)
    readings, offset = [], 0
    for part in parts:
        length = part if isinstance(part, int) else spec._length(part)
        if isinstance(part, Tiled) and not isinstance(part.outer, str):
            copies = (part.outer, part.inner)
            readings.append(_Reading(site.node, site.axis, offset, length, part.group, copies, site.projection))
        elif not isinstance(part, int):
            readings.append(_Reading(site.node, site.axis, offset, length, part, projection=site.projection))
        offset += length
    return readings


class _SiteReader(fx.Interpreter):
    """Runs a traced model and hands the output of every watched node to ``sink``."""

    def __init__(self, gm: fx.GraphModule, watch: Mapping[str, list[tuple[Any, int]]], sink, device) -> None:
        super().__init__(gm)
        self.watch = watch
        self.sink = sink
        self.device = device  # where the activations are accumulated

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        for key, axis in self.watch.get(n.name, ()):
            self.sink(key, _samples(out, axis, n.name, self.device))
        return out


def _check_models(model_a: Any, model_b: Any) -> None:
    for name, m in (("model_a", model_a), ("model_b", model_b)):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{name} must be a torch.nn.Module, got {type(m).__name__}")
    sa, sb = model_a.state_dict(), model_b.state_dict()
    missing = [k for k in sa if k not in sb]
    extra = [k for k in sb if k not in sa]
    if missing or extra:
        raise ValueError(
            f"model_a and model_b have different state_dict keys: only in model_a {missing[:5]}, "
            f"only in model_b {extra[:5]}"
        )
    for k, t in sa.items():
        if t.shape != sb[k].shape:
            raise ValueError(f"model_a and model_b differ in {k!r}: shapes {tuple(t.shape)} and {tuple(sb[k].shape)}")


def _host(matrix: Any) -> np.ndarray:
    """A statistic of an accumulator (a numpy array, or a torch tensor on its device) as float64 numpy."""
    if isinstance(matrix, torch.Tensor):
        matrix = matrix.detach().cpu().numpy()
    return np.asarray(matrix, dtype=np.float64)


def _reading_index(spec: PermutationSpec, reading: _Reading, perms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The unit of B that each unit of a reading is matched with."""
    if not reading.structured:
        return perms[reading.form]
    return PermutationSpec({"r": (reading.form,)}, {g: spec.sizes[g] for g in _entry_groups(reading.form)}).axis_index(
        "r", 0, perms
    )


# --------------------------------------------------------------------------- entry point


def activation_matching(
    model_a: nn.Module,
    model_b: nn.Module,
    data: Iterable[Any],
    spec: PermutationSpec | None = None,
    cost: str = "correlation",
    *,
    pre_activation: bool = False,
    max_batches: int | None = None,
    progress: bool = False,
    composite: str | None = None,
    dtype: Any = np.float64,
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
    data : iterable
        Batches of inputs: each a tensor, or a sequence ``(inputs, targets, ...)`` whose
        first element is a tensor or a tuple of the forward's positional inputs (what a
        ``DataLoader`` yields). Iterated once; batches are moved to each model's device.
    spec : PermutationSpec, optional
        The groups to match (e.g. a bundled model's ``permutation_spec()``); each must be
        a group of the traced spec, under any name. Default: the traced spec.
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
        is the one matched (``spec=None``), and accepted silently when ``spec`` is given
        (it names the groups).
    dtype : {numpy.float64, numpy.float32}, default float64
        Accumulator precision of the cross-correlation matrices.

    Returns
    -------
    ActivationMatchingResult
        ``perms`` (int64 CPU tensors, one per group of ``spec``), the ``spec``, the
        matched and identity similarities, the sites read, and the batches and samples used.

    Raises
    ------
    TypeError
        A model is not a module, ``data`` is not iterable or yields something that is not
        a batch, or an argument has the wrong type.
    ValueError
        The models differ in state_dict keys, shapes or traced graph; ``data`` is empty or
        holds no samples; ``cost``, ``max_batches`` or ``composite`` is invalid; ``spec``
        names a group the tracer does not find; or an activation is not finite.
    pyperm.nn.TraceError
        The model cannot be traced (see :func:`~pyperm.nn.trace_model`).

    Notes
    -----
    The models are run through their traced graphs (``torch.fx``), which hand every
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
    pyperm.nn.apply_permutation : apply ``result.perms`` to model B's state dict.
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
    >>> result = activation_matching(a, b, data)
    >>> aligned = apply_permutation(result.spec, result.perms, b.state_dict())
    >>> all(torch.equal(aligned[k], v) for k, v in a.state_dict().items())
    True
    """
    _check_models(model_a, model_b)
    if cost not in _COSTS:
        raise ValueError(f"cost must be one of {_COSTS}, got {cost!r}")
    if not isinstance(pre_activation, bool):
        raise TypeError(f"pre_activation must be a bool, got {type(pre_activation).__name__}")
    if spec is not None and not isinstance(spec, PermutationSpec):
        raise TypeError(f"spec must be a PermutationSpec or None, got {type(spec).__name__}")
    batches = iterate_batches(data, max_batches)
    _, first = next(batches)  # TypeError, ValueError for data or max_batches

    dev_a, dev_b = module_device(model_a), module_device(model_b)
    inputs = model_inputs(first, 0)
    structured = spec is not None and spec.structured  # Segments, Tiled: the traced spec must have them too
    if composite is None and spec is not None:
        composite = "fix"  # the given spec names the groups: the tracer only finds their sites
    # A TraceWarning points at the caller of activation_matching (two frames up from _trace).
    traced = _trace(model_a, tuple(t.to(dev_a) for t in inputs), composite, stacklevel=2, structured=structured)
    gm_b = symbolic_trace(model_b)
    if str(gm_b.graph) != str(traced.graph_module.graph):
        raise ValueError("model_a and model_b trace to different graphs: activation matching needs one architecture")
    if spec is None:
        spec = traced.spec
        names = {g: g for g in spec.groups}
    else:
        names = spec.groups_in(traced.spec)
    traced_name = {t: g for g, t in names.items()}
    sites: dict[str, tuple[ActivationSite, ...]] = {}
    for g in spec.groups:
        mine = []
        for site in traced.sites(pre_activation)[names[g]]:
            if all(t in traced_name for t in _entry_groups(site.form)):  # else a group of the form is not matched
                mine.append(dataclasses.replace(site, form=_rename(site.form, traced_name)))
        sites[g] = tuple(mine)
    unseen = [g for g, where in sites.items() if not where]
    if unseen:
        # Units no activation shows (inside a layer with a rule of its own that records no
        # projected site, or behind a fork the walk cannot pass): they keep their order.
        warnings.warn(f"groups {unseen} have no activation site; they keep the identity", UserWarning, stacklevel=2)

    if not spec.sizes:
        return ActivationMatchingResult(perms={}, spec=spec)

    # One accumulator per reading (a part of a site's axis); a group has the readings that hold its units.
    readings: list[_Reading] = []
    of_group: dict[str, list[int]] = {}
    for g in spec.groups:
        for site in sites[g]:
            for r in _readings(spec, site):
                if g in _entry_groups(r.form):
                    if r not in readings:
                        readings.append(r)
                    of_group.setdefault(g, []).append(readings.index(r))
    keys = range(len(readings))
    # Models on one CUDA device: the activations stay there (one device accumulator per
    # reading); otherwise they are copied to the host, where one set updates every reading at once.
    on_device = dev_a.type == "cuda" and dev_b == dev_a and pyperm.cuda_available()
    if dev_a.type == "cuda" and dev_b == dev_a and not on_device:
        warnings.warn(f"activation_matching: {pyperm.cuda_unavailable_reason()}; the activations are copied to the "
                      "host and accumulated there (slower)", UserWarning, stacklevel=2)  # fmt: skip
    device = dev_a if on_device else torch.device("cpu")
    if on_device:
        accs: Any = {i: pyperm.CrossCorrelation(readings[i].units, readings[i].units, dtype=dtype) for i in keys}
    else:
        accs = pyperm.CrossCorrelationSet({i: (readings[i].units, readings[i].units) for i in keys}, dtype=dtype)
    watch: dict[str, list[tuple[Any, int]]] = {}  # node -> (key of its held activations, axis of units)
    for node, axis in dict.fromkeys((r.node, r.axis) for r in readings):
        watch.setdefault(node, []).append(((node, axis), axis))

    held_a: dict[Any, torch.Tensor] = {}
    held_b: dict[Any, torch.Tensor] = {}
    projected = {key for r in readings if r.projection is not None for key in (r.projection.weight, r.projection.bias)}
    state_a = {k: v.detach().to(device) for k, v in model_a.state_dict().items() if k in projected}
    state_b = {k: v.detach().to(device) for k, v in model_b.state_dict().items() if k in projected}

    def update_all() -> None:
        # One call per batch: the set runs every reading's kernel on the thread pool at once.
        pairs = {i: (r.take(held_a[(r.node, r.axis)], state_a), r.take(held_b[(r.node, r.axis)], state_b))
                 for i, r in enumerate(readings)}  # fmt: skip
        try:
            if on_device:
                for i, (za, zb) in pairs.items():
                    accs[i].update(za, zb)
            else:
                accs.update(pairs)
        except ValueError:
            for i, (za, zb) in pairs.items():  # name the site whose activations are bad
                if not (bool(torch.isfinite(za).all()) and bool(torch.isfinite(zb).all())):
                    groups = _entry_groups(readings[i].form)
                    raise ValueError(
                        f"activations of group {groups[0]!r} at {readings[i].node!r} contain NaN or infinite values"
                    ) from None
            raise

    reader_a = _SiteReader(traced.graph_module, watch, held_a.__setitem__, device)
    reader_b = _SiteReader(gm_b, watch, held_b.__setitem__, device)
    bar = progress_bar(progress, num_batches(data, max_batches), "activation matching", "batch")
    used_batches = 0
    try:
        with eval_mode(model_a, model_b), torch.no_grad():
            for index, batch in itertools.chain([(0, first)], batches):
                inputs = model_inputs(batch, index)
                reader_a.run(*(t.to(dev_a) for t in inputs))
                reader_b.run(*(t.to(dev_b) for t in inputs))
                update_all()
                held_a.clear()
                held_b.clear()
                used_batches += 1
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    for i, acc in enumerate(accs[k] for k in keys):
        if acc.count == 0:
            groups = _entry_groups(readings[i].form)
            raise ValueError(f"data held no samples for group {groups[0]!r}: every batch was empty")
    if cost == "correlation":
        mats = [_host(accs[i].correlation()) for i in keys]
    else:
        # Per-sample means, so that sites with more positions do not outweigh the others.
        mats = [_host(accs[i].cross_product()) / accs[i].count for i in keys]

    perms: dict[str, torch.Tensor] = {}
    joint = {g for r in readings if r.structured for g in _entry_groups(r.form)}
    for g in spec.groups:
        if g not in of_group:
            perms[g] = torch.arange(spec.sizes[g])
        elif g not in joint:
            m = np.mean([mats[i] for i in of_group[g]], axis=0)
            _, col = pyperm.linear_sum_assignment(m, maximize=True)
            perms[g] = torch.from_numpy(np.asarray(col, dtype=np.int64))
    if joint:
        forms = [r.form for r in readings]
        perms.update(solve_joint(spec, forms, mats, sorted(joint, key=spec.groups.index)))

    similarity: dict[str, float] = {}
    identity: dict[str, float] = {}
    num_samples: dict[str, int] = {}
    for g in spec.groups:
        num_samples[g] = sum(accs[i].count for i in of_group.get(g, []))
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
        "activation_matching: %d groups, %d batches, mean similarity %.4g -> %.4g",
        len(perms), used_batches, np.mean(list(identity.values()) or [0.0]), np.mean(list(similarity.values()) or [0.0]),
    )  # fmt: skip
    return ActivationMatchingResult(
        perms=perms,
        spec=spec,
        similarity=similarity,
        identity_similarity=identity,
        sites=sites,
        num_batches=used_batches,
        num_samples=num_samples,
    )
