r"""Sinkhorn re-basin (Pena et al., CVPR 2023): permutations learned by gradient through Sinkhorn's operator.

Every permutation group :math:`g` gets a matrix of free scores :math:`X_g` (a
:class:`~pyperm.nn.spec.Blocks` inner group: one per block). Its soft permutation is
Sinkhorn's doubly stochastic matrix :math:`S_g = \operatorname{Sinkhorn}(X_g / \tau)`,
multiplied into every axis the group acts on (:func:`~._relaxation.apply_relaxed`, every
spec form), which gives a relaxed :math:`S(\Theta_B)` whose units are convex combinations
of B's. The scores follow Adam on a loss of the relaxed B:

- ``loss="distance"``: the weight distance
  :math:`\lVert \Theta_A - S(\Theta_B) \rVert^2` (mean over the entries), weight
  matching's objective relaxed;
- ``loss="midpoint"``: the loss on data of the midpoint
  :math:`\frac12(\Theta_A + S(\Theta_B))`, the objective of STE matching (Git Re-Basin
  Algorithm 2) and the paper's :math:`\mathcal L_{\text{mid}}`.

Sinkhorn's iterations keep their potentials in log space, warm-started at every step from
the previous step's potentials, and are differentiated implicitly at their fixed point
(:mod:`._implicit_sinkhorn`): the backward pass solves one linear system per group
instead of going back through the iterations. The hard answer is the assignment
projection of the final soft permutations,
:math:`\arg\max_P \operatorname{tr}(P^\top S_g)` (pyperm's batch LAP, every block in one
call).

What is taken from the authors' code (fagp/sinkhorn-rebasin): scores that start at the
start's permutation matrix, :math:`\tau = 1`, Adam at 0.1. What differs: the iterations
run to a tolerance from the previous step's potentials rather than a fixed 20 from zero
(the implicit gradient is the derivative of the fixed point, which 20 iterations from
zero need not reach on wide layers); the implicit system is solved through its ``n x n``
Schur complement in float64 (by conjugate gradients preconditioned by its diagonal), not as
the ``(2n - 1)``-square system; the relaxation is
pyperm's spec, so every traced model and spec form is covered without a hand-written map.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pyperm._checks import (
    check_callable,
    check_choice,
    check_int,
    check_positive_int,
    check_positive_real,
    torch_generator,
)
from pyperm._progress import progress_bar
from pyperm.nn._checks import check_module, check_pair, check_spec
from pyperm.nn._runtime import check_batches, inputs_and_targets, iterate_batches, module_device, num_batches, to_device
from pyperm.nn.align import _relaxation as relax
from pyperm.nn.align._implicit_sinkhorn import Potentials, implicit_sinkhorn
from pyperm.nn.align._proximal_curve import CurveFunction
from pyperm.nn.permutations import Permutations, as_permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["SinkhornMatchingResult", "sinkhorn_matching"]

logger = logging.getLogger(__name__)

_LOSSES = ("midpoint", "distance")
_INITS = ("identity", "weight")
# Steps of the distance loss when epochs is not given (it reads no data: an epoch is one step).
_DISTANCE_STEPS = 100


@dataclass
class SinkhornMatchingResult:
    """What :func:`sinkhorn_matching` found.

    Attributes
    ----------
    perms : Permutations
        The assignment projection of the final soft permutations.
    soft : dict of str to torch.Tensor
        The final soft permutations, one doubly stochastic matrix per group
        (``(n, n)``; a Blocks inner group ``(blocks, size, size)``), detached, on the
        device the optimisation ran on. ``perms`` maximises ``tr(P^T soft[g])``.
    loss : list of float
        The relaxed loss of every step, before its update.
    init_perms : Permutations
        Where the scores started.
    iterations : int
        Adam steps taken (``len(loss)``).
    sinkhorn_iterations : list of int
        Per step, the most column fits of Sinkhorn's iterations over the groups.
    """

    perms: Permutations
    soft: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: list[float] = field(default_factory=list)
    init_perms: Permutations | None = None
    iterations: int = 0
    sinkhorn_iterations: list[int] = field(default_factory=list)


def sinkhorn_matching(
    model: nn.Module | None,
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any] | None = None,
    *,
    loss: str = "midpoint",
    init: str | Permutations | Mapping[str, Any] = "identity",
    epochs: int | None = None,
    lr: float = 0.1,
    tau: float = 1.0,
    sinkhorn_iters: int = 100,
    sinkhorn_tol: float = 1e-4,
    seed: int | torch.Generator = 0,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    max_batches: int | None = None,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> SinkhornMatchingResult:
    r"""Learn the permutation of B by gradient through Sinkhorn's operator (Sinkhorn re-basin).

    Each step: the soft permutations :math:`S_g = \operatorname{Sinkhorn}(X_g/\tau)` of the
    scores, the loss of the relaxed B (the weight distance to A, or the midpoint's loss on
    one batch of ``data``), its gradient in the scores by implicit differentiation of
    Sinkhorn's fixed point, and an Adam step on the scores. At the end every group's
    soft permutation is projected onto the permutations by a linear assignment.

    Parameters
    ----------
    model : torch.nn.Module or None
        The architecture, run through :func:`torch.func.functional_call` (never modified)
        for ``loss="midpoint"``; not used, and may be None, for ``loss="distance"``.
    spec : PermutationSpec
        The permutation groups, in any spec form (flat, ``Segments``, ``Tiled``,
        ``Blocks``, a group on two axes).
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints' state dicts (same keys, shapes, dtypes and devices); not modified.
        B is the model permuted.
    data : re-iterable of (inputs, targets, ...), optional
        Training batches for ``loss="midpoint"`` (one step per batch); must be None for
        ``loss="distance"``, which reads no data.
    loss : {"midpoint", "distance"}, default "midpoint"
        The midpoint's loss on ``data`` (:math:`\mathcal L(\frac12(\Theta_A + S(\Theta_B)))`,
        with the network in train mode: BatchNorm on batch statistics), or the weight
        distance :math:`\lVert\Theta_A - S(\Theta_B)\rVert^2` over every floating-point
        entry that a group permutes (the mean over their elements).
    init : {"identity", "weight"}, Permutations or mapping, default "identity"
        The permutations whose matrices the scores start at: the identity (the paper's
        start), weight matching's answer (:func:`~pyperm.nn.weight_matching`, seeded by
        ``seed``), or the permutations themselves.
    epochs : int, optional
        Passes over ``data`` (``loss="midpoint"``, default 1); with
        ``loss="distance"``, steps on the whole objective (default 100).
    lr : float, default 0.1
        Adam's learning rate for the scores (the authors' code: 0.1).
    tau : float, default 1.0
        Sinkhorn's temperature: the scores are divided by it (smaller: sharper).
    sinkhorn_iters : int, default 100
        Most column fits of Sinkhorn's iterations per step (they start from the previous
        step's potentials: few while the soft permutations are soft, more as they sharpen;
        a warning says when this cap stopped them short of ``sinkhorn_tol``).
    sinkhorn_tol : float, default 1e-4
        Largest column-sum error at which the iterations stop (the row sums are exact).
    seed : int or torch.Generator, default 0
        Seeds weight matching's group order for ``init="weight"``; nothing else is drawn.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)`` to the batch's mean loss; cross-entropy by default.
        Only with ``loss="midpoint"``.
    max_batches : int, optional
        At most this many batches of ``data`` per epoch. Only with ``loss="midpoint"``.
    device : str or torch.device, optional
        Where the optimisation runs (the scores, B's and A's tensors, the batches): the
        model's device by default (``state_a``'s without a model). The model is never moved
        and must be on that device for ``loss="midpoint"``.
    progress : bool, default False
        Show a progress bar over the steps.

    Returns
    -------
    SinkhornMatchingResult
        ``perms`` (the projection of the final soft permutations), ``soft``, the loss of
        every step, ``init_perms``, the steps taken and Sinkhorn's iterations per step.

    Raises
    ------
    TypeError, ValueError
        Bad ``model``, ``spec`` (a structured one included), states, ``data`` (missing
        for the midpoint loss, given for the distance loss, not re-iterable), ``loss``,
        ``init``, ``epochs``, ``lr``, ``tau``, ``sinkhorn_iters``, ``sinkhorn_tol``,
        ``loss_fn``, ``max_batches`` or ``device``; a model on another device than
        ``device``.

    Warns
    -----
    UserWarning
        When Sinkhorn's iterations stopped at ``sinkhorn_iters`` before ``sinkhorn_tol`` in
        some steps (their gradient is that of a point short of the fixed point).

    Notes
    -----
    The gradient is the derivative of Sinkhorn's fixed point, so it is exact when the
    iterations have converged, and the backward pass costs one ``n x n`` solve per group
    (a Blocks group: per block) whatever the number of iterations. Small ``tau`` or long
    runs make the soft permutations nearly hard, where the gradient vanishes; the
    answer is then the permutation they are near.

    References
    ----------
    F. A. G. Pena, H. R. Medeiros, T. Dubail, M. Aminbeidokhti, E. Granger, M. Pedersoli,
    "Re-basin via implicit Sinkhorn differentiation", CVPR 2023.
    M. Eisenberger, A. Toker, L. Leal-Taixe, F. Bernard, D. Cremers, "A Unified Framework
    for Implicit Sinkhorn Differentiation", CVPR 2022.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import sinkhorn_matching
    >>> from pyperm.nn.models import MLP
    >>> from pyperm.nn import Permutations
    >>> from pyperm.testing import random_permutations
    >>> a = MLP([8, 16, 3])
    >>> spec = a.permutation_spec()
    >>> plant = Permutations(spec, random_permutations(spec, torch.Generator().manual_seed(0)))
    >>> b = plant.apply(a.state_dict())  # B: A with its hidden units shuffled
    >>> result = sinkhorn_matching(None, spec, a.state_dict(), b, loss="distance")
    >>> result.perms == plant.inverse()
    True
    """
    check_spec(spec)
    check_pair(state_a, state_b)
    spec.check_state_dict(state_a, "state_a")
    loss = check_choice(loss, "loss", _LOSSES)
    lr = check_positive_real(lr, "lr")
    tau = check_positive_real(tau, "tau")
    sinkhorn_iters = check_positive_int(sinkhorn_iters, "sinkhorn_iters")
    sinkhorn_tol = check_positive_real(sinkhorn_tol, "sinkhorn_tol")
    if epochs is None:
        epochs = 1 if loss == "midpoint" else _DISTANCE_STEPS
    epochs = check_positive_int(epochs, "epochs")
    if loss == "midpoint":
        check_module(model)
        if data is None:
            raise ValueError("data is needed for loss='midpoint' (the midpoint's loss is measured on it)")
        data = check_batches(data, "data", reiterable=True)
        loss_fn = check_callable(loss_fn, "loss_fn", allow_none=True) or nn.functional.cross_entropy
        max_batches = check_int(max_batches, "max_batches", 1, allow_none=True)
    else:
        if model is not None:
            check_module(model)
        for name, value in (("data", data), ("loss_fn", loss_fn), ("max_batches", max_batches)):
            if value is not None:
                raise ValueError(f"{name} is not used by loss='distance' (it reads no data); pass None")
    gen = torch_generator(seed)
    target = _target_device(model, state_a, device, loss)

    sa = {k: v.detach().to(target) for k, v in state_a.items()}
    sb = {k: v.detach().to(target) for k, v in state_b.items()}
    start = _initial_perms(init, spec, sa, sb, gen)
    scores = _Scores(spec, start, _score_dtype(sa), target, sinkhorn_iters, sinkhorn_tol, tau)
    objective = _midpoint_loss(model, spec, sa, sb, loss_fn) if loss == "midpoint" else _distance_loss(spec, sa, sb)
    optimizer = torch.optim.Adam(scores.parameters(), lr=lr)
    result = SinkhornMatchingResult(perms=start, init_perms=start)
    batches = (lambda: _epoch_batches(data, max_batches, target)) if loss == "midpoint" else (lambda: [None])
    total = epochs * (num_batches(data, max_batches) or 0) if loss == "midpoint" else epochs
    bar = progress_bar(progress, total or None, "Sinkhorn matching", "step")
    try:
        for _ in range(epochs):
            for batch in batches():
                soft = scores.soft()
                value = objective(soft, batch)
                optimizer.zero_grad(set_to_none=True)
                value.backward()
                optimizer.step()
                result.loss.append(float(value.detach()))
                result.sinkhorn_iterations.append(scores.last_iterations)
                result.iterations += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{result.loss[-1]:.4g}")
    finally:
        if bar is not None:
            bar.close()
    with torch.no_grad():
        soft = scores.soft()
    result.soft = {g: s.detach() for g, s in soft.items()}
    result.perms = Permutations(spec, relax.nearest_permutations(spec, result.soft))
    if scores.unconverged:
        warnings.warn(f"sinkhorn_matching: in {scores.unconverged} of {result.iterations + 1} Sinkhorn solves the "
                      f"iterations stopped at sinkhorn_iters={sinkhorn_iters} with a column sum off by up to "
                      f"{scores.worst_error:.2g} (> sinkhorn_tol={sinkhorn_tol:g}), so their gradient is that of a point "
                      "short of the fixed point; raise sinkhorn_iters for the exact one", UserWarning, stacklevel=2)
    logger.debug("sinkhorn_matching: %d steps, loss %.4g -> %.4g", result.iterations,
                 result.loss[0] if result.loss else float("nan"), result.loss[-1] if result.loss else float("nan"))
    return result


def _target_device(model: nn.Module | None, state_a: Mapping[str, torch.Tensor], device: Any,
                   loss: str) -> torch.device:
    """Where the optimisation runs: ``device``, else the model's, else ``state_a``'s."""
    if device is not None:
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
        try:
            target = torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"device {device!r} is not a torch device: {err}") from None
    elif model is not None:
        target = module_device(model)
    else:
        target = next((v.device for v in state_a.values()), torch.device("cpu"))
    if loss == "midpoint" and model is not None and not _same_device(module_device(model), target):
        raise ValueError(f"model is on {module_device(model)}, device is {target}: move the model there "
                         "(the midpoint runs through it)")  # fmt: skip
    return target


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device (``cuda`` is the current CUDA device)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _score_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    """float64 scores for float64 models, else float32 (half-precision models included)."""
    return torch.float64 if any(v.dtype == torch.float64 for v in state.values()) else torch.float32


def _initial_perms(init: Any, spec: PermutationSpec, sa: Mapping[str, torch.Tensor],
                   sb: Mapping[str, torch.Tensor], seed: Any) -> Permutations:
    if isinstance(init, str):
        check_choice(init, "init", _INITS)
        if init == "identity":
            return Permutations.identity(spec)
        from pyperm.nn.align.weight import weight_matching

        return weight_matching(spec, sa, sb, seed=seed).perms
    if isinstance(init, Mapping):
        return Permutations(spec, as_permutations(spec, init, "init"))
    raise TypeError(f"init must be 'identity', 'weight', a Permutations or a mapping of permutations, "
                    f"got {type(init).__name__}")  # fmt: skip


class _Scores:
    r"""The free scores :math:`X_g` of every group, kept as one ``(k, n, n)`` stack per size ``n``
    (a Blocks inner group adds its blocks), so that one Sinkhorn call and one batched solve serve
    every group of a size."""

    def __init__(self, spec: PermutationSpec, start: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, iters: int, tol: float, tau: float) -> None:
        self.iters, self.tol, self.tau = iters, tol, tau
        matrices = relax.one_hot(spec, start, dtype=dtype, device=device)
        self.shapes = {g: m.shape for g, m in matrices.items()}
        by_size: dict[int, list[str]] = {}
        for g, m in matrices.items():
            by_size.setdefault(m.shape[-1], []).append(g)
        self.stacks: dict[int, torch.Tensor] = {}
        self.slices: dict[str, tuple[int, slice]] = {}
        for n, names in by_size.items():
            flat = [matrices[g].reshape(-1, n, n) for g in names]
            offset = 0
            for g, m in zip(names, flat):
                self.slices[g] = (n, slice(offset, offset + m.shape[0]))
                offset += m.shape[0]
            self.stacks[n] = torch.cat(flat).requires_grad_(True)
        self.potentials = {n: Potentials() for n in self.stacks}
        self.last_iterations = 0
        # Calls whose iterations stopped at the cap before the tolerance, and their largest column error.
        self.unconverged, self.worst_error = 0, 0.0

    def parameters(self) -> list[torch.Tensor]:
        return list(self.stacks.values())

    def soft(self) -> dict[str, torch.Tensor]:
        """Every group's soft permutation (differentiable in the scores)."""
        stacked = {n: implicit_sinkhorn(x / self.tau, self.iters, self.tol, self.potentials[n])
                   for n, x in self.stacks.items()}  # fmt: skip
        self.last_iterations = max((p.iterations for p in self.potentials.values()), default=0)
        error = max((p.error for p in self.potentials.values()), default=0.0)
        if not error <= self.tol:  # stopped at sinkhorn_iters
            self.unconverged += 1
            self.worst_error = max(self.worst_error, error)
        return {g: stacked[n][part].reshape(self.shapes[g]) for g, (n, part) in self.slices.items()}


def _distance_loss(spec: PermutationSpec, sa: Mapping[str, torch.Tensor],
                   sb: Mapping[str, torch.Tensor]) -> Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor]:
    """The mean squared distance between A and the relaxed B over the entries a group permutes."""
    keys = [k for k, axes in spec.axes.items() if sa[k].is_floating_point() and any(e is not None for e in axes)]
    count = sum(sa[k].numel() for k in keys)

    def objective(soft: Mapping[str, torch.Tensor], _batch: Any) -> torch.Tensor:
        relaxed = relax.apply_relaxed(spec, soft, sb, keys)
        total = sum((relaxed[k] - sa[k]).square().sum() for k in keys)
        return total / max(count, 1)

    return objective


def _midpoint_loss(model: nn.Module, spec: PermutationSpec, sa: Mapping[str, torch.Tensor],
                   sb: Mapping[str, torch.Tensor],
                   loss_fn: Callable[..., torch.Tensor]) -> Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor]:
    """The loss of the midpoint of A and the relaxed B on one batch (the network in train mode)."""
    fn = CurveFunction(model, spec, sa, sb, loss_fn)

    def objective(soft: Mapping[str, torch.Tensor], batch: tuple[tuple, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        end = relax.apply_relaxed(spec, soft, sb, fn.permuted_keys)
        return fn.loss(fn.state(0.5, end), inputs, targets)

    return objective


def _epoch_batches(data: Iterable[Any], max_batches: int | None, device: torch.device):
    for index, batch in iterate_batches(data, max_batches):
        inputs, targets = inputs_and_targets(batch, index)
        yield to_device(inputs, device), targets.to(device)
