r"""Straight-through-estimator matching (Ainsworth et al. 2023, section 3.3 and Algorithm 2).

Learns free weights :math:`\tilde\Theta_B` whose projection onto the permutations of B,

.. math::

    \operatorname{proj}(\tilde\Theta_B) = \pi^\star(\Theta_B), \qquad
    \pi^\star = \arg\max_\pi \operatorname{vec}(\tilde\Theta_B) \cdot \operatorname{vec}(\pi(\Theta_B)),

minimises the loss at the midpoint :math:`\frac12(\Theta_A + \operatorname{proj}(\tilde\Theta_B))`.
The forward pass uses the projection, the backward pass treats it as the identity, so
the gradient reaches :math:`\tilde\Theta_B`. :math:`\tilde\Theta_B` starts at
:math:`\Theta_A`, whose projection is weight matching's answer (Algorithm 1, from the identity).

Which permutation is returned: the training loop sees one batch per step, and a step's
batch loss says more about how easy that batch was than about the permutation (on two
digits MLPs the lowest batch loss was the same easy batch of the first epoch whether
one or ten epochs were run). So the candidates, the start and the projection every
``judge_every`` steps and at the end of every epoch, are judged the way PAM judges its
candidates: by the midpoint loss over fixed batches (:class:`~._proximal_curve.Judge`),
once per distinct permutation. The start is a candidate, so the answer is never worse
than weight matching's on that estimate; a run's candidates include those of every
shorter run with the same data and seed, so more epochs never make it worse.

What makes it cheap: the published implementation runs weight matching from scratch at
every step. Here each projection is weight matching warm-started from the previous
step's permutations, and between judgements it is one sweep over the groups: the
coordinate ascent of Algorithm 1 is continued at the next step rather than run to its
end at each. A second sweep would revisit only the groups whose neighbours moved after
their visit, with similarities that the next step's sweep rebuilds from the moved free
weights anyway; on the digits MLP 64-512x3-10 those partial sweeps were a tenth of a
step. The permutations that are judged (every ``judge_every`` steps and at the end of
every epoch) are projections run to convergence, as Algorithm 2's. So a step costs
about one forward and backward pass, one sweep of similarity products (and its
assignments) and a share of the judging (see ``pyperm bench ste``); the midpoint's
entries are recomputed only where the projection moved a group.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from pyperm._checks import check_callable, check_int, check_positive_int, check_positive_real, torch_generator
from pyperm._progress import progress_bar
from pyperm.nn._checks import check_module, check_pair, check_spec
from pyperm.nn._runtime import (
    check_batches,
    inputs_and_targets,
    iterate_batches,
    module_device,
    num_batches,
    to_device,
    train_mode,
)
from pyperm.nn.align._proximal_curve import CurveFunction, Judge, fixed_batches, perms_key
from pyperm.nn.align.weight import WeightMatcher
from pyperm.nn.permutations import Permutations, as_permutations, permute_entry
from pyperm.nn.spec import PermutationSpec, entry_groups

__all__ = ["STEMatchingResult", "ste_matching"]

logger = logging.getLogger(__name__)

# The projections whose permutations are judged run weight matching to convergence, within its own limit.
_MAX_SWEEPS = 100
_END = object()


@dataclass
class STEMatchingResult:
    """What :func:`ste_matching` found.

    Steps are counted by the updates of the free weights: the permutations of step ``k``
    are the projection of the free weights after ``k`` updates (step 0: the start,
    ``init_perms``), and step ``k`` (for ``k < iterations``) trains on them.

    Attributes
    ----------
    perms : Permutations
        The candidate with the lowest midpoint loss on the judging batches: the
        permutations of step ``best_step``.
    loss : list of float
        The midpoint loss of every step on that step's training batch, before its
        update (a record of the training; the answer is chosen on the judging batches).
    best_step : int
        The step whose permutations are returned (0: the start).
    init_perms : Permutations
        Where the search started: ``init``, or weight matching's answer from the
        identity start (Algorithm 1).
    iterations : int
        Optimisation steps taken (``len(loss)``).
    projection_iterations : list of int
        Weight-matching sweeps of the projection after each update, ``iterations`` of
        them: 1 at the steps whose permutations are not judged (one sweep, continued at
        the next step); at the judged ones, the sweeps to convergence (1 when nothing
        moved).
    judged : dict of int to float
        The midpoint loss on the judging batches of every step whose permutations were
        judged (the first step that reached each distinct candidate), in step order;
        ``judged[best_step]`` is the answer's.
    """

    perms: Permutations
    loss: list[float] = field(default_factory=list)
    best_step: int = 0
    init_perms: Permutations | None = None
    iterations: int = 0
    projection_iterations: list[int] = field(default_factory=list)
    judged: dict[int, float] = field(default_factory=dict)


def ste_matching(
    model: nn.Module,
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any],
    *,
    init: Permutations | Mapping[str, Any] | None = None,
    epochs: int = 1,
    lr: float = 1e-3,
    seed: int | torch.Generator = 0,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    max_batches: int | None = None,
    judge_data: Iterable[Any] | None = None,
    judge_batches: int | None = 10,
    judge_every: int = 20,
    progress: bool = False,
) -> STEMatchingResult:
    r"""Learn the permutation of B that makes the midpoint with A best (Git Re-Basin, Algorithm 2).

    Each step, on one batch of ``data``:

    1. the loss :math:`\mathcal{L}(\frac12(\Theta_A + \pi(\Theta_B)))` on the batch;
    2. its gradient with :math:`\tilde\Theta_B` in place of :math:`\pi(\Theta_B)`
       (the straight-through estimator), and an Adam step on :math:`\tilde\Theta_B`;
    3. :math:`\pi \leftarrow \operatorname{proj}(\tilde\Theta_B)`: weight matching of B
       onto the free weights, warm-started from the previous :math:`\pi`: one sweep over
       the groups, or until convergence where the step's permutations are judged (see
       Notes).

    The answer is the best of the candidates on a fixed estimate: the midpoint loss over
    the judging batches (``judge_data``, or the first ``judge_batches`` batches of
    ``data``), the same for every candidate.

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
    data : re-iterable of (inputs, targets)
        Training batches (a DataLoader, a list); re-iterated every epoch, and the first
        ``judge_batches`` of them judge the candidates when ``judge_data`` is None.
    init : Permutations or mapping of str to (n,) int array, optional
        The permutations of the first step. Default: weight matching of B onto A from
        the identity (Algorithm 1), the projection of the free weights' start
        :math:`\tilde\Theta_B = \Theta_A`, as Algorithm 2 starts.
    epochs : int, default 1
        Passes over ``data``.
    lr : float, default 1e-3
        Adam's learning rate for the free weights.
    seed : int or torch.Generator, default 0
        Seeds weight matching's group orders.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)`` to the batch's mean loss; cross-entropy by default.
        It also judges the candidates.
    max_batches : int, optional
        At most this many batches of ``data`` per epoch.
    judge_data : iterable of (inputs, targets), optional
        Batches that judge the candidates (read once, at the start), e.g. a part of the
        training set held out from ``data``. Default: ``data``'s first batches. Judging
        on the batches trained on favours permutations that fit them; held-out batches
        estimate the midpoint's loss without that bias.
    judge_batches : int or None, default 10
        How many batches of the judging data are read (None: all). Each judgement is a
        forward pass over them, so they cost ``judge_batches / judge_every`` forward
        passes per step when the permutations keep changing (a tenth to a sixth of a
        step's cost: a step is a forward and backward pass and a projection).
    judge_every : int, default 20
        The permutations are judged every ``judge_every`` steps and at the end of every
        epoch (each distinct permutation once). 1 judges every step's; larger values
        cost less. On two digits MLPs 10 and 20 chose equally good permutations (there
        the permutations changed at about one step in eight). Judging at fixed steps, never on the
        training loss, is what makes more epochs never worse on the estimate.
    progress : bool, default False
        Show a progress bar over the steps.

    Returns
    -------
    STEMatchingResult
        ``perms`` of the candidate with the lowest judged midpoint loss (never above the
        start's, ``init_perms``), its step (``best_step``), the judged losses, the
        training loss of every step, the steps taken and the projections' sweep counts.

    Raises
    ------
    TypeError, ValueError
        Bad ``model``, ``spec`` (a structured one included), states, ``data`` (not
        re-iterable included), ``init``, ``epochs``, ``lr``, ``loss_fn``,
        ``max_batches``, ``judge_data``, ``judge_batches`` or ``judge_every``.

    Notes
    -----
    Git Re-Basin returns the permutations of the step with the lowest training loss.
    That loss is measured on a different batch at every step, so its minimum picks the
    easiest batch more than the best permutation, and training longer need not change
    it. Judging on fixed batches compares the candidates on equal terms; the guarantee
    holds on the judging estimate, and the more and the more representative its
    batches, the closer it is to the loss on the whole data.

    The projection between two judgements is one sweep of weight matching, not a run to
    convergence: the next step's sweep continues the coordinate ascent on free weights
    that moved little, and rebuilds every similarity that a second sweep would have
    corrected. The training steps may therefore see permutations one sweep short of a
    local optimum; every judged candidate (the answer included) is a converged
    projection. On digits MLPs (64-256x3-10 and 64-512x3-10, six seeds, six epochs) the
    judged and held-out midpoint losses of the answers moved by less than the spread
    between seeds (means within 2%, in both directions).

    References
    ----------
    S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
    Permutation Symmetries", ICLR 2023, section 3.3 and Algorithm 2.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import ste_matching
    >>> from pyperm.nn.models import MLP
    >>> a, b = MLP([8, 16, 3]), MLP([8, 16, 3])
    >>> data = [(torch.randn(32, 8), torch.randint(0, 3, (32,))) for _ in range(4)]
    >>> result = ste_matching(a, a.permutation_spec(), a.state_dict(), b.state_dict(), data, lr=1e-2)
    >>> result.iterations, len(result.loss), sorted(result.perms)
    (4, 4, ['hidden1'])
    >>> result.judged[result.best_step] <= result.judged[0]  # never worse than the start
    True
    """
    check_module(model)
    check_spec(spec)
    check_pair(state_a, state_b)
    spec.check_state_dict(state_a, "state_a")
    data = check_batches(data, "data", reiterable=True)
    epochs = check_positive_int(epochs, "epochs")
    lr = check_positive_real(lr, "lr")
    loss_fn = check_callable(loss_fn, "loss_fn", allow_none=True) or nn.functional.cross_entropy
    judge_batches = check_int(judge_batches, "judge_batches", 1, allow_none=True)
    judge_every = check_positive_int(judge_every, "judge_every")
    if judge_data is not None:
        check_batches(judge_data, "judge_data")
    gen = torch_generator(seed)
    device = module_device(model)
    sa = {k: v.detach().to(device) for k, v in state_a.items()}
    sb = {k: v.detach().to(device) for k, v in state_b.items()}
    params = {name for name, _ in model.named_parameters()}
    trainable = [k for k in spec.axes if k in params and sa[k].is_floating_point()]
    # The judging batches, read once: one point t = 1/2 and no bend is the midpoint of eq. 3.
    source, name = (data, "data") if judge_data is None else (judge_data, "judge_data")
    judge = Judge(CurveFunction(model, spec, sa, sb, loss_fn), fixed_batches(source, judge_batches, device, name), 1)
    candidates = _Candidates(judge)

    # One matcher for every projection: B's arrangement and the warm solvers are kept.
    # No trims of the allocator between steps: they would return the training's freed activations.
    matcher = WeightMatcher(spec, sb, trim_memory=False)
    # The free weights start at A: their projection is weight matching's answer, Algorithm 2's start.
    if init is None:
        perms = matcher.match(sa, seed=gen).perms
    else:
        perms = Permutations(spec, as_permutations(spec, init, "init"))
    result = STEMatchingResult(perms=perms, init_perms=perms)
    candidates.consider(0, perms)
    free = {k: sa[k].clone().requires_grad_(True) for k in trainable}
    optimizer = torch.optim.Adam(list(free.values()), lr=lr)
    midpoints = _Midpoint(spec, sa, sb, free)
    bar = progress_bar(progress, _total_steps(data, max_batches, epochs), "STE matching", "step")
    try:
        with train_mode(model):  # BatchNorm on batch statistics, as in training
            for _ in range(epochs):
                for (index, batch), last in _flag_last(iterate_batches(data, max_batches)):
                    inputs, targets = inputs_and_targets(batch, index)
                    inputs, targets = to_device(inputs, device), targets.to(device)
                    midpoint, leaves = midpoints.at(perms)
                    loss = loss_fn(functional_call(model, midpoint, inputs), targets)
                    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
                    for k, g in zip(leaves, grads):
                        # Straight-through: the midpoint's gradient in pi(B), taken as the free weights'.
                        free[k].grad = None if g is None else g.mul_(0.5)
                    optimizer.step()
                    result.loss.append(float(loss.detach()))
                    result.iterations += 1
                    # The projection of the updated free weights: the next step's permutations. One
                    # sweep, continued at the next step; to convergence where they will be judged.
                    judged = last or result.iterations % judge_every == 0
                    anchor = {k: free[k].detach() if k in free else sa[k] for k in spec.axes}
                    projection = matcher.match(anchor, init=perms, seed=gen, objective=False,
                                               max_iter=_MAX_SWEEPS if judged else 1)  # fmt: skip
                    perms = projection.perms
                    result.projection_iterations.append(projection.iterations)
                    if result.iterations % judge_every == 0:
                        candidates.consider(result.iterations, perms)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{result.loss[-1]:.4g}", judged=f"{candidates.best_value:.4g}")
                candidates.consider(result.iterations, perms)  # every epoch's last permutations
    finally:
        if bar is not None:
            bar.close()
    result.best_step, result.perms, result.judged = candidates.best_step, candidates.best, candidates.judged
    logger.debug("ste_matching: %d steps, %d candidates judged, best midpoint loss %.4g at step %d (start %.4g)",
                 result.iterations, len(result.judged), candidates.best_value, result.best_step, result.judged[0])
    return result


class _Midpoint:
    r""":math:`\frac12(\Theta_A + \pi(\Theta_B))` at the current permutations, and its entries that the
    free weights stand for, as leaves; kept between steps.

    The straight-through estimator makes the free weights' gradient the midpoint's gradient
    in :math:`\pi(\Theta_B)`, half its gradient in the midpoint: the caller takes the
    leaves' gradients and halves them, which costs no more graph than the forward pass.
    Only the entries that a group moved since the last step permutes are computed again
    (B permuted and added to A): between two steps the projection moves a few groups, or none.
    """

    def __init__(self, spec: PermutationSpec, sa: Mapping[str, torch.Tensor], sb: Mapping[str, torch.Tensor],
                 free: Mapping[str, torch.Tensor]) -> None:
        self.spec, self.sa, self.sb = spec, sa, sb
        self.free = dict.fromkeys(k for k in sa if k in free)  # in the state's order (the leaves' order)
        self.groups_of = {k: {g for entry in spec.axes.get(k, ()) for g in entry_groups(entry)} for k in sa}
        self.perms: Mapping[str, torch.Tensor] | None = None
        self.entries: dict[str, torch.Tensor] = {}  # the floating-point entries at self.perms

    def at(self, perms: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The midpoint's state dict at ``perms`` and its leaves (the same tensors while their entries stay)."""
        if self.perms is None:
            moved = set(self.spec.sizes)
        else:
            moved = {g for g, p in perms.items() if not torch.equal(p, self.perms[g])}
        for k, a in self.sa.items():
            if a.is_floating_point() and (k not in self.entries or self.groups_of[k] & moved):
                b = permute_entry(self.spec, perms, k, self.sb[k]) if k in self.spec.axes else self.sb[k]
                self.entries[k] = torch.add(a, b).mul_(0.5)
                if k in self.free:
                    self.entries[k].requires_grad_(True)
        self.perms = perms
        midpoint = {}
        for k, a in self.sa.items():
            if k in self.entries:
                # Buffers are copies: BatchNorm updates its running statistics in place.
                midpoint[k] = self.entries[k] if k in self.free else self.entries[k].clone()
            else:
                midpoint[k] = a.clone()  # BatchNorm counts its batches in place
        return midpoint, {k: self.entries[k] for k in self.free}


class _Candidates:
    """The permutations judged so far and the best of them (ties keep the earlier: the start first)."""

    def __init__(self, judge: Judge) -> None:
        self.judge = judge
        self.seen: set[tuple] = set()
        self.judged: dict[int, float] = {}
        self.best: Permutations | None = None
        self.best_step = 0
        self.best_value = math.inf

    def consider(self, step: int, perms: Permutations) -> None:
        """Judge ``perms`` (step ``step``'s) unless an earlier step had the same permutations."""
        key = perms_key(perms)
        if key in self.seen:
            return
        self.seen.add(key)
        value = self.judge(None, perms)
        self.judged[step] = value
        score = value if not math.isnan(value) else math.inf  # a NaN loss never wins
        if self.best is None or score < self.best_value:
            self.best, self.best_step, self.best_value = perms, step, score


def _flag_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)`` for the items of ``items`` (each read one ahead)."""
    ahead = next(items, _END)
    while ahead is not _END:
        item, ahead = ahead, next(items, _END)
        yield item, ahead is _END


def _total_steps(data: Any, max_batches: int | None, epochs: int) -> int | None:
    per_epoch = num_batches(data, max_batches)
    return None if per_epoch is None else per_epoch * epochs
