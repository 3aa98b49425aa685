"""REPAIR: renormalising the units of an interpolated network (Jordan et al., 2023)."""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pyperm.nn._checks import check_model_states, check_module, check_spec, check_t
from pyperm.nn._runtime import check_batches, eval_mode, iterate_batches, model_inputs, module_device, to_device
from pyperm.nn.eval._moments import Moments
from pyperm.nn.spec import PermutationSpec
from pyperm.nn.state import interpolate
from pyperm.nn.trace import ActivationSite, TraceResult, trace_model

__all__ = ["repair"]

logger = logging.getLogger(__name__)

# Modules whose output is an affine function of a weight scaled along the unit axis plus a bias:
# a per-unit correction y -> a y + c folds into them as weight * a, bias * a + c.
_PRODUCERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

# A unit whose standard deviation is below this fraction of its site's largest is constant
# (a dead or zeroed unit): it is only shifted, never divided by (almost) zero.
_FLAT = 1e-6


@dataclass
class _Site:
    """One pre-activation site to renormalise and where its correction folds in."""

    group: str
    node: str
    path: str
    module: nn.Module
    axis: int
    weight: str | None
    bias: str | None
    running: bool  # a BatchNorm with running statistics: measured at its input, reset and folded into the affine

    def describe(self) -> str:
        return f"{type(self.module).__name__} {self.path!r} (group {self.group!r})"



def _make_site(
    group: str, site: ActivationSite, model: nn.Module, state: Mapping[str, torch.Tensor], calls: Mapping[str, int]
) -> _Site:
    """Where the correction of ``site`` folds in; ValueError when it cannot be folded."""
    where = f"pre-activation site {site.node!r} of group {group!r}"
    try:
        module = model.get_submodule(site.module) if site.module else model
    except AttributeError:
        module = None
    if calls.get(site.module, 0) != 1 or module is None or not isinstance(module, _PRODUCERS + _NORMS):
        raise ValueError(
            f"repair cannot fold a correction into the {where}: it must be the output of a Linear, Conv1d/2d/3d, "
            f"BatchNorm, LayerNorm or GroupNorm module called once in the forward, got {site.op!r} "
            f"(module {site.module!r})"
        )
    prefix = f"{site.module}." if site.module else ""
    weight = prefix + "weight" if getattr(module, "weight", None) is not None else None
    bias = prefix + "bias" if getattr(module, "bias", None) is not None else None
    running = isinstance(module, _BATCHNORMS) and module.track_running_stats
    if weight is None:
        raise ValueError(
            f"repair cannot fold a correction into the {where}: {type(module).__name__} "
            f"{site.module!r} has no affine weight"
        )
    for key in (weight, bias) + ((prefix + "running_mean", prefix + "running_var") if running else ()):
        if key is not None and key not in state:
            raise ValueError(f"repair: {key!r} of the {where} is not in the state dicts")
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
        raise ValueError(
            f"repair cannot fold a correction into the {where}: LayerNorm {site.module!r} normalises "
            f"over {tuple(module.normalized_shape)}, not one axis of units"
        )
    if bias is None:
        logger.warning(
            "repair: %s %r has no bias; only the standard deviation of its units is corrected",
            type(module).__name__,
            site.module,
        )
    return _Site(group, site.node, site.module, module, site.axis, weight, bias, running)


def _order(traced: TraceResult, sites: list[_Site]) -> list[int]:
    """For each site, a bit mask of the sites upstream of it in the graph."""
    index = {s.node: k for k, s in enumerate(sites)}
    upstream: dict[str, int] = {}
    for node in traced.graph_module.graph.nodes:
        mask = 0
        for parent in node.all_input_nodes:
            mask |= upstream.get(parent.name, 0)
            if parent.name in index:
                mask |= 1 << index[parent.name]
        upstream[node.name] = mask
    return [upstream[s.node] for s in sites]


class _Done(Exception):
    """Raised by the last site hook of a batch: the rest of the forward is not needed."""


def _measure(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    sites: list[_Site],
    data: Iterable[Any],
    max_batches: int | None,
    device: torch.device,
) -> list[Moments]:
    """Per-unit moments at each site over ``data``, the model running ``state`` in eval mode.

    A site is read at its module's output, except a BatchNorm with running statistics,
    which is read at its input: its eval-mode output is an affine function of that input
    whose coefficients the caller knows. Each batch's forward stops as soon as every site
    has been read (an early layer's round costs a fraction of a full pass).
    """
    moments = [Moments() for _ in sites]
    fired: set[int] = set()
    hooks = []

    def reader(k: int, site: _Site):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            x = args[0] if site.running else output
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"repair: {site.describe()} did not compute a tensor")
            moments[k].update(x, 1 if site.running else site.axis)
            fired.add(k)
            if len(fired) == len(sites):
                raise _Done

        return hook

    try:
        for k, site in enumerate(sites):
            hooks.append(site.module.register_forward_hook(reader(k, site)))
        with torch.no_grad(), eval_mode(model):
            for i, batch in iterate_batches(data, max_batches, name="data"):
                fired.clear()
                try:
                    torch.func.functional_call(model, state, to_device(model_inputs(batch, i), device))
                except _Done:
                    pass
    finally:
        for h in hooks:
            h.remove()
    for site, acc in zip(sites, moments):
        if acc.count < 2:
            raise ValueError(f"repair: {site.describe()} saw {acc.count} value(s) per unit; need at least two")
    return moments


def _bn_affine(site: _Site, state: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, shift)`` of an eval-mode BatchNorm: ``y = scale * x + shift`` per channel, in float64."""
    p = f"{site.path}." if site.path else ""
    gamma = state[site.weight].to(torch.float64)
    beta = state[site.bias].to(torch.float64) if site.bias else torch.zeros_like(gamma)
    scale = gamma / (state[p + "running_var"].to(torch.float64) + site.module.eps).sqrt()
    return scale, beta - scale * state[p + "running_mean"].to(torch.float64)


def _output_stats(site: _Site, acc: Moments, state: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit mean and standard deviation of the site's output."""
    if not site.running:
        return acc.mean, acc.std()
    scale, shift = _bn_affine(site, state)
    return scale * acc.mean + shift, scale.abs() * acc.std()


def _fold(site: _Site, acc: Moments, mean: torch.Tensor, std: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
    r"""Fold ``y -> (y - mu) * std / sigma + mean`` at ``site`` into ``state`` (in place)."""

    def put(key: str, value: torch.Tensor) -> None:
        state[key] = value.to(state[key].dtype)

    if site.running:
        # Running statistics := the input's exact statistics (mu_x, v_x); then the eval-mode output
        # gamma' (x - mu_x) / sqrt(v_x + eps) + beta' has mean beta' and std |gamma'| sqrt(v_x / (v_x + eps)).
        p = f"{site.path}." if site.path else ""
        var = acc.var()
        sd = var.sqrt()
        gamma = state[site.weight].to(torch.float64)
        flat = sd <= _FLAT * sd.max()
        sign = torch.where(gamma < 0, -1.0, 1.0).to(torch.float64)
        new_gamma = torch.where(flat, gamma, sign * std * (var + site.module.eps).sqrt() / sd.clamp_min(1e-300))
        put(p + "running_mean", acc.mean)
        put(p + "running_var", var)
        put(site.weight, new_gamma)
        if site.bias:
            put(site.bias, mean)
        return
    mu, sigma = acc.mean, acc.std()
    flat = sigma <= _FLAT * sigma.max()
    a = torch.where(flat, torch.ones_like(sigma), std / sigma.clamp_min(1e-300))
    w = state[site.weight].to(torch.float64)
    put(site.weight, w * a.reshape((-1,) + (1,) * (w.ndim - 1)))
    if site.bias:
        put(site.bias, (state[site.bias].to(torch.float64) - mu) * a + mean)


def _inside_a_layer(traced: TraceResult, site: ActivationSite) -> bool:
    """Whether ``site``'s units are computed inside a layer and shown only through it: the query, key and
    value heads of an attention layer (a projection), or a member of a layer's tuple output (a recurrent
    layer's hidden states, an attention layer's output)."""
    if site.projection is not None:
        return True
    node = next(n for n in traced.graph_module.graph.nodes if n.name == site.node)
    parent = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(parent, torch.fx.Node) and parent.op == "call_module"


def _sites(traced: TraceResult, groups: Mapping[str, str], model: nn.Module, state: Mapping[str, torch.Tensor],
           calls: Mapping[str, int]) -> list[_Site]:
    """The sites of ``groups`` (spec group -> traced group), each once (a layer's output can hold the units of
    several groups of a structured spec: segments of a concatenation, blocks and the units within them).

    Units computed inside a layer (:func:`_inside_a_layer`) cannot take a folded correction: they are left
    as interpolated, with a warning naming them. Any other site that cannot take one is an error."""
    found: dict[str, tuple[ActivationSite, list[str]]] = {}
    for g, h in groups.items():
        for site in traced.sites(pre_activation=True)[h]:
            found.setdefault(site.node, (site, []))[1].append(g)
    sites, skipped = [], []
    for site, names in found.values():
        if _inside_a_layer(traced, site):
            skipped.append(f"{site.op!r} ({', '.join(map(repr, names))})")
        else:
            sites.append(_make_site(", ".join(names), site, model, state, calls))
    if skipped:
        warnings.warn(f"repair leaves the units at {len(skipped)} site(s) as interpolated: they are computed inside "
                      f"a layer whose weights cannot take a folded correction: {'; '.join(skipped)}", RuntimeWarning,
                      stacklevel=3)  # fmt: skip
    return sites


def repair(
    model: nn.Module,
    spec: PermutationSpec | None,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any],
    *,
    t: float = 0.5,
    max_batches: int | None = None,
) -> dict[str, torch.Tensor]:
    r"""REPAIR: the interpolated model with its units' statistics renormalised to the endpoints'.

    Interpolating two aligned networks shrinks the spread of their hidden units
    ("variance collapse"): a unit of :math:`\Theta(t) = (1 - t)\Theta_A + t\Theta_B`
    has a smaller standard deviation than the same unit in A and B, the shrinkage
    compounds with depth, and the barrier follows. REPAIR (Jordan et al., 2023) restores
    the statistics: at every pre-activation site :math:`z_u` of a unit :math:`u` that a
    permutation group acts on, the interpolated model's mean :math:`\mu_u` and standard
    deviation :math:`\sigma_u` are made equal to the interpolation of the endpoints'

    .. math::

        m_u = (1 - t)\,\mu_u^A + t\,\mu_u^B, \qquad s_u = (1 - t)\,\sigma_u^A + t\,\sigma_u^B,

    by the per-unit affine map :math:`z_u \mapsto (z_u - \mu_u)\, s_u / \sigma_u + m_u`,
    folded into the layer computing :math:`z_u`, so the result is a plain state dict
    of the same architecture. Statistics are over all samples of ``data`` (and spatial
    positions or tokens), standard deviations from the unbiased variance.

    Sites are corrected layer by layer from the input: each round measures, in one pass
    over ``data``, the sites with no uncorrected site upstream of them in the graph, and
    folds their corrections. So each site is measured in the model as it will be
    returned (the earlier layers already repaired), and after the call every repaired
    unit's statistics equal their targets up to floating-point rounding.

    Parameters
    ----------
    model : torch.nn.Module
        A model of the endpoints' architecture, traced with
        :func:`~pyperm.nn.trace_model` to find the sites. It is run with
        :func:`torch.func.functional_call` in eval mode: its own parameters, buffers
        and training flags are never changed.
    spec : PermutationSpec or None
        Repair only the units of these groups (each must be a group the traced model
        has, under any name); None: every traced group.
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints, B already permuted into A's basin (e.g. by
        :func:`~pyperm.nn.weight_matching` and :func:`~pyperm.nn.apply_permutation`):
        the model's keys and shapes, the same dtypes and devices as each other. Not
        modified.
    data : iterable of batches
        Inputs (a tensor, or ``(inputs, targets, ...)``), e.g. the training data; read
        once per endpoint and once per round, so it must be re-iterable.
    t : float, default 0.5
        The point of the path, in [0, 1] (the midpoint, where Jordan et al. measure).
    max_batches : int, optional
        Read at most this many batches of ``data`` in each pass.

    Returns
    -------
    dict of str to torch.Tensor
        The repaired state dict: ``interpolate(state_a, state_b, t)`` with the
        corrections folded in, new tensors on the states' device in their dtypes.

    Raises
    ------
    TypeError
        ``model`` is not a module; a state is not a mapping of str to tensors; ``t``
        is not a real number; ``data`` is not a re-iterable of batches; ``spec`` is
        not a PermutationSpec.
    ValueError
        The states do not pair up with each other or with the model (the message
        names the key); ``t`` is outside [0, 1]; ``data`` yields no batches; a group of
        ``spec`` is not a group of the traced model; a site's correction cannot be
        folded (see Notes).
    pyperm.nn.TraceError
        The model cannot be traced.

    Notes
    -----
    Where the correction :math:`z \mapsto a z + c` (per unit, :math:`a = s/\sigma`,
    :math:`c = m - a\mu`) goes, by the module that computes the site:

    - Linear, Conv1d/2d/3d: the weight's output rows are scaled by :math:`a` and the bias
      becomes :math:`a (b - \mu) + m`. Without a bias only the standard deviation can
      be corrected (a warning is logged).
    - BatchNorm with running statistics (the pre-activation site is then the
      BatchNorm's output): its running mean and variance are set to the exact
      statistics :math:`(\mu_x, v_x)` of its input in the interpolated model (what
      :func:`~pyperm.nn.eval.batchnorm.reset_bn_stats` would compute, but measured in
      eval mode), and the affine to :math:`\gamma' = \operatorname{sign}(\gamma)\,
      s \sqrt{(v_x + \epsilon)/v_x}`, :math:`\beta' = m`. The endpoints' statistics are
      those of their BatchNorm outputs in eval mode, with their own running
      statistics. So for a BatchNorm network REPAIR amounts to a BatchNorm reset plus
      a rescaling of the affine, as the paper observes; evaluate the result as it is
      (a further ``reset_bn_stats`` on the same data changes it only by the
      difference between train- and eval-mode statistics of the deeper layers).
    - LayerNorm (over the last axis), GroupNorm, BatchNorm without running
      statistics: the affine weight is scaled by :math:`a` and the bias becomes
      :math:`a(\beta - \mu) + m`.

    A site computed by a function rather than a module (``x @ W``), by a module called
    more than once, or by a normalisation without an affine weight raises ValueError.
    A unit that is constant over ``data`` is only shifted to its target mean. Units
    computed inside a layer and shown only through its output (the query, key and value
    heads of ``nn.MultiheadAttention``, its output, a recurrent layer's hidden states) are
    left as interpolated, with a RuntimeWarning naming them. A layer whose output holds the
    units of several groups of a structured spec (the segments of a concatenation, the
    blocks of a grouped convolution and the units within them) is corrected once, every
    unit of it.

    References
    ----------
    .. [1] K. Jordan, H. Sedghi, O. Saukh, R. Entezari, B. Neyshabur, "REPAIR:
       REnormalizing Permuted Activations for Interpolation Repair", ICLR 2023.
    .. [2] S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
       Permutation Symmetries", ICLR 2023.

    Examples
    --------
    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> a = {k: v.clone() for k, v in model.state_dict().items()}
    >>> b = {k: torch.randn_like(v) for k, v in a.items()}
    >>> x = torch.randn(64, 4)
    >>> repaired = repair(model, None, a, b, [x], t=0.5)
    >>> z = x @ repaired["0.weight"].T + repaired["0.bias"]
    >>> za, zb = model[0](x), torch.nn.functional.linear(x, b["0.weight"], b["0.bias"])
    >>> torch.allclose(z.std(0), (za.std(0) + zb.std(0)) / 2, atol=1e-5)
    True
    """
    check_module(model)
    check_model_states(model, state_a, state_b)
    t = check_t(t)
    check_batches(data, "data", supervised=False, reiterable=True)
    if spec is not None:
        check_spec(spec)
    device = module_device(model)
    _, first = next(iterate_batches(data, max_batches, name="data"))
    # Groups that a composite axis fixes are not groups of the spec, hence not repaired: say so quietly.
    structured = spec is None or spec.structured  # a flat spec's groups are groups of the flat trace
    traced = trace_model(model, to_device(model_inputs(first, 0), device), composite="fix", structured=structured)
    if spec is None:
        groups = {g: g for g in traced.spec.groups}
    else:
        spec.check_state_dict(state_a, "state_a")
        groups = spec.groups_in(traced.spec)

    calls: dict[str, int] = {}
    for node in traced.graph_module.graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    sites = _sites(traced, groups, model, state_a, calls)

    working = {k: v.detach().to(device) for k, v in interpolate(state_a, state_b, t).items()}
    if not sites:
        logger.info("repair: the model has no permuted units to repair; returning the interpolation")
        return {k: v.to(state_a[k].device) for k, v in working.items()}

    # Targets from the endpoints, every site in one pass each.
    on_device = [{k: v.detach().to(device) for k, v in s.items()} for s in (state_a, state_b)]
    ends = [_measure(model, s, sites, data, max_batches, device) for s in on_device]
    targets = []
    for k, site in enumerate(sites):
        mean_a, std_a = _output_stats(site, ends[0][k], on_device[0])
        mean_b, std_b = _output_stats(site, ends[1][k], on_device[1])
        targets.append(((1.0 - t) * mean_a + t * mean_b, (1.0 - t) * std_a + t * std_b))

    upstream = _order(traced, sites)
    pending = (1 << len(sites)) - 1
    rounds = 0
    while pending:
        ready = [k for k in range(len(sites)) if pending >> k & 1 and not upstream[k] & pending]
        if not ready:  # pragma: no cover - graph order makes the first pending site always ready
            raise RuntimeError("repair: the sites' dependencies are cyclic")
        measured = _measure(model, working, [sites[k] for k in ready], data, max_batches, device)
        for k, acc in zip(ready, measured):
            _fold(sites[k], acc, targets[k][0], targets[k][1], working)
            pending &= ~(1 << k)
        rounds += 1
    logger.debug("repair: %d sites of %d groups in %d rounds at t=%g", len(sites), len(groups), rounds, t)
    return {k: v.to(state_a[k].device) for k, v in working.items()}
