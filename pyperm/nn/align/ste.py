r"""Straight-through-estimator matching (Ainsworth et al. 2023, section 3.3 and Algorithm 2).

Learns free weights :math:`\tilde\Theta_B` whose projection onto the permutations of B,

.. math::

    \operatorname{proj}(\tilde\Theta_B) = \pi^\star(\Theta_B), \qquad
    \pi^\star = \arg\max_\pi \operatorname{vec}(\tilde\Theta_B) \cdot \operatorname{vec}(\pi(\Theta_B)),

minimises the loss at the midpoint :math:`\frac12(\Theta_A + \operatorname{proj}(\tilde\Theta_B))`.
The forward pass uses the projection, the backward pass treats it as the identity, so
the gradient reaches :math:`\tilde\Theta_B`. :math:`\tilde\Theta_B` starts at
:math:`\Theta_A`, whose projection is weight matching's answer (Algorithm 1, from the identity).

What makes it cheap: the published implementation runs weight matching from scratch at
every step. Here each projection is a weight matching warm-started from the previous
step's permutations; the free weights move little per step, so it ends after one or
two sweeps, and a step costs about one forward and backward pass plus one sweep of
similarity products (see ``pyperm bench ste``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from pyperm._checks import check_positive_real, torch_generator
from pyperm._progress import progress_bar
from pyperm.nn._runtime import (
    inputs_and_targets,
    iterate_batches,
    module_device,
    num_batches,
    to_device,
    train_mode,
)
from pyperm.nn._checks import check_module, check_pair
from pyperm.nn.align.weight import WeightMatcher
from pyperm.nn.permutations import Permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["STEMatchingResult", "ste_matching"]

logger = logging.getLogger(__name__)


@dataclass
class STEMatchingResult:
    """What :func:`ste_matching` found.

    Attributes
    ----------
    perms : Permutations
        The permutations of B of the step with the lowest midpoint loss (int64 CPU
        tensors, as :func:`~pyperm.nn.weight_matching` returns them); the starting
        weight-matching answer counts as a step.
    loss : list of float
        The midpoint loss of every step, on that step's batch (before its update).
    best_step : int
        Index into ``loss`` of the step whose permutations are returned.
    initial_perms : Permutations
        Weight matching's answer from the identity start (Algorithm 1), where the search started.
    sweeps : list of int
        Weight-matching sweeps each projection took (1 when nothing moved).
    """

    perms: Permutations
    loss: list[float] = field(default_factory=list)
    best_step: int = 0
    initial_perms: Permutations | None = None
    sweeps: list[int] = field(default_factory=list)


def ste_matching(
    model: nn.Module,
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any],
    *,
    epochs: int = 1,
    lr: float = 1e-3,
    seed: int | torch.Generator = 0,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    max_batches: int | None = None,
    progress: bool = False,
) -> STEMatchingResult:
    r"""Learn the permutation of B that makes the midpoint with A best (Git Re-Basin, Algorithm 2).

    Each step, on one batch of ``data``:

    1. :math:`\pi \leftarrow \operatorname{proj}(\tilde\Theta_B)`: weight matching of B
       onto the free weights, warm-started from the previous :math:`\pi`;
    2. the loss :math:`\mathcal{L}(\frac12(\Theta_A + \pi(\Theta_B)))` on the batch;
    3. its gradient with :math:`\tilde\Theta_B` in place of :math:`\pi(\Theta_B)`
       (the straight-through estimator), and an Adam step on :math:`\tilde\Theta_B`.

    Parameters
    ----------
    model : torch.nn.Module
        A module of the architecture; its own weights are not used or changed (it is
        run through :func:`torch.func.functional_call` in train mode, so BatchNorm uses
        batch statistics, as in training).
    spec : PermutationSpec
        The permutation groups (e.g. ``model.permutation_spec()``).
    state_a, state_b : mapping of str to torch.Tensor
        The two models; B is the one permuted. The spec's keys, equal shapes, on the
        model's device.
    data : iterable of (inputs, targets)
        Training batches (a DataLoader, a list); re-iterated every epoch.
    epochs : int, default 1
        Passes over ``data``.
    lr : float, default 1e-3
        Adam's learning rate for the free weights.
    seed : int or torch.Generator, default 0
        Seeds weight matching's group orders.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)`` to a scalar; cross-entropy by default.
    max_batches : int, optional
        At most this many batches of ``data`` per epoch.
    progress : bool, default False
        Show a progress bar over the steps.

    Returns
    -------
    STEMatchingResult
        ``perms`` of the step with the lowest midpoint batch loss, the loss history and
        the projections' sweep counts.

    Raises
    ------
    TypeError, ValueError
        Bad ``model``, ``spec``, states, ``data``, ``epochs`` or ``lr``.

    References
    ----------
    S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
    Permutation Symmetries", ICLR 2023, section 3.3 and Algorithm 2.
    """
    check_module(model)
    if not isinstance(spec, PermutationSpec):
        raise TypeError(f"spec must be a PermutationSpec, got {type(spec).__name__}")
    spec.require_flat("ste_matching")
    check_pair(state_a, state_b)
    spec.check_state_dict(state_a, "state_a")
    if isinstance(epochs, bool) or not isinstance(epochs, int):
        raise TypeError(f"epochs must be an int, got {type(epochs).__name__}")
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    lr = check_positive_real(lr, "lr")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    loss_fn = loss_fn or nn.functional.cross_entropy
    gen = torch_generator(seed)
    device = module_device(model)
    sa = {k: v.detach().to(device) for k, v in state_a.items()}
    sb = {k: v.detach().to(device) for k, v in state_b.items()}
    params = {name for name, _ in model.named_parameters()}
    trainable = [k for k in spec.axes if k in params and sa[k].is_floating_point()]

    # One matcher for every projection: B's arrangement and the warm solvers are kept.
    matcher = WeightMatcher(spec, sb)
    perms = Permutations(spec, matcher.match(sa, seed=gen).perms)
    initial = perms
    # The free weights start at A: their projection is weight matching's answer.
    free = {k: sa[k].clone().requires_grad_(True) for k in trainable}
    optimizer = torch.optim.Adam(list(free.values()), lr=lr)
    result = STEMatchingResult(perms=perms, initial_perms=initial)
    best = math.inf
    bar = progress_bar(progress, _total_steps(data, max_batches, epochs), "STE matching", "step")
    try:
        with train_mode(model):  # BatchNorm on batch statistics, as in training
            for _ in range(epochs):
                for index, batch in iterate_batches(data, max_batches):
                    inputs, targets = inputs_and_targets(batch, index)
                    inputs, targets = to_device(inputs, device), targets.to(device)
                    if result.loss:  # the first step's projection is the starting weight matching
                        anchor = {k: free[k].detach() if k in free else sa[k] for k in spec.axes}
                        projection = matcher.match(anchor, init=perms, seed=gen)
                        perms = Permutations(spec, projection.perms)
                        result.sweeps.append(projection.sweeps)
                    projected = perms.apply(sb)
                    midpoint = {}
                    for k, a in sa.items():
                        if k in free:
                            # Straight-through: the value of pi(B), the gradient of the free weights.
                            b = projected[k] + (free[k] - free[k].detach())
                            midpoint[k] = 0.5 * (a + b)
                        elif a.is_floating_point():
                            midpoint[k] = 0.5 * (a + projected[k])
                        else:
                            midpoint[k] = a.clone()
                    loss = loss_fn(functional_call(model, midpoint, inputs), targets)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    value = float(loss.detach())
                    if value < best:
                        best, result.perms, result.best_step = value, perms, len(result.loss)
                    result.loss.append(value)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{value:.4g}")
    finally:
        if bar is not None:
            bar.close()
    logger.debug("ste_matching: %d steps, best midpoint loss %.4g at step %d", len(result.loss), best, result.best_step)
    return result


def _total_steps(data: Any, max_batches: int | None, epochs: int) -> int | None:
    per_epoch = num_batches(data, max_batches)
    return None if per_epoch is None else per_epoch * epochs
