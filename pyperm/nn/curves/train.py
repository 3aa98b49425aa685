r"""Curve finding: Algorithm 2 of Tatro et al. (Garipov et al.'s training of the bends).

Each step draws :math:`t \sim U[0, 1]`, runs the network :math:`r_\phi(t)` on a batch and
takes an optimizer step on the bends :math:`\phi`, a stochastic gradient step on

.. math::

    \ell(\phi) = \mathbb{E}_{t \sim U[0,1]}\, \mathcal{L}\big(r_\phi(t)\big).

With Garipov et al.'s regulariser (``point_decay``, the papers' recipe) the loss of a step
is :math:`\mathcal{L}(r_\phi(t)) + \tfrac{\lambda}{2}\|r_\phi(t)\|^2`: the squared norm of
the *point* at the drawn ``t``, not of the bends.

Under torch.distributed every process reads the same global batches, keeps its shard of
each, draws the same ``t`` (one seed for all) and averages the gradients of the bends
with an all-reduce, so the bends follow the single-process run on the global batches.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from pyperm._checks import (
    callback_stops,
    check_callable,
    check_choice,
    check_int,
    check_nonnegative_real,
    check_positive_real,
    torch_generator,
)
from pyperm._progress import progress_bar
from pyperm.nn._runtime import (
    as_inputs,
    check_batches,
    describe,
    inputs_and_targets,
    iterate_batches,
    num_batches,
    to_device,
    training_flags,
)
from pyperm.nn.curves._base import Curve
from pyperm.nn.curves.recipes import resolve_recipe
from pyperm.nn.curves.schedules import SchedulerFactory, make_scheduler, step_scheduler
from pyperm.nn.eval.robust import check_attack, pgd_attack

__all__ = ["CurveTrainer", "train_curve"]

logger = logging.getLogger(__name__)

_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}

def check_curve(curve: Any, name: str = "curve") -> Curve:
    """``curve`` itself, or a TypeError naming ``name``."""
    if not isinstance(curve, Curve):
        raise TypeError(f"{name} must be a BezierCurve or PolyChain (a pyperm curve), got {type(curve).__name__}")
    return curve


def _make_optimizer(optimizer: Any, params: list[torch.nn.Parameter], lr: float, momentum: float,
                    bend_decay: float) -> torch.optim.Optimizer:
    if isinstance(optimizer, str):
        cls = _OPTIMIZERS[check_choice(optimizer, "optimizer", _OPTIMIZERS)]
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        cls = optimizer
    else:
        raise TypeError(
            f"optimizer must be 'sgd', 'adam' or a torch.optim.Optimizer class, got {type(optimizer).__name__}"
        )
    options: dict[str, float] = {"lr": lr}
    accepted = inspect.signature(cls).parameters
    # momentum means SGD's heavy ball; Adam and others keep their own defaults (betas).
    if "momentum" in accepted:
        options["momentum"] = momentum
    if "weight_decay" in accepted:
        options["weight_decay"] = bend_decay
    elif bend_decay:
        raise ValueError(f"bend_decay={bend_decay} given, but {cls.__name__} takes no weight_decay")
    return cls(params, **options)


def _all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` over the processes in place: one collective per (device, dtype)."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    for bucket in buckets.values():
        if len(bucket) == 1:
            torch.distributed.all_reduce(bucket[0])
            continue
        # Collectives cost latency more than bandwidth: one flat buffer, not one call each.
        flat = torch.cat([t.reshape(-1) for t in bucket])
        torch.distributed.all_reduce(flat)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))


def _shard(tensors: tuple, rank: int, world: int) -> tuple:
    # torch.tensor_split gives contiguous, near-equal shards; every process computes the
    # same split of the same global batch.
    return tuple(torch.tensor_split(t, world)[rank] for t in tensors)


class CurveTrainer:
    r"""One optimizer, one learning-rate schedule and one stream of points ``t`` for a curve: the step of Algorithm 2.

    :func:`train_curve` is a loop over epochs and batches around :meth:`step` and
    :meth:`end_epoch`; methods that interleave curve steps with other work (PAM alternates
    them with permutation updates) and benchmarks use the trainer directly. Arguments as
    in :func:`train_curve`, plus ``epochs``, which a schedule given as a function of the
    epoch fraction is measured against.

    Attributes
    ----------
    curve : BezierCurve or PolyChain
    optimizer : torch.optim.Optimizer
        Built over the curve's trainable bends; its state (momentum) persists across steps.
    scheduler : torch.optim.lr_scheduler.LRScheduler or None
        Stepped by :meth:`end_epoch`; None for a constant learning rate.
    point_decay, bend_decay : float
        The coefficients of the regulariser on the point of the curve and of the
        optimizer's decay of the bends.
    generator : torch.Generator
        Where the points ``t`` come from.
    distributed : bool
        Whether :func:`torch.distributed.is_initialized` was true when the trainer was
        built (the bends were then broadcast from rank 0).

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import BezierCurve, CurveTrainer
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: -v for k, v in a.items()}
    >>> trainer = CurveTrainer(BezierCurve(net, a, b), lr=0.1, recipe="garipov", epochs=10)
    >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    >>> loss_times_samples, samples = trainer.step(x, y)
    >>> samples
    16
    """

    def __init__(self, curve: Curve, *, lr: float, optimizer: str | type[torch.optim.Optimizer] = "sgd",
                 momentum: float = 0.9, point_decay: float | None = None, bend_decay: float = 0.0,
                 lr_schedule: str | Callable[[float], float] | None = None,
                 lr_scheduler: SchedulerFactory | None = None, epochs: int | None = None,
                 recipe: str | None = None, seed: int | torch.Generator = 0,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                 adversarial: dict[str, Any] | None = None) -> None:
        self.curve = check_curve(curve)
        self.adversarial = None if adversarial is None else check_attack(adversarial)
        if self.adversarial is not None:
            # The attacks' random starts have their own stream: the points t are those of clean training.
            self.attack_generator = torch_generator(self.adversarial.pop("seed", 0), "adversarial: seed")
        lr = check_positive_real(lr, "lr")
        momentum = check_nonnegative_real(momentum, "momentum")
        self.point_decay, lr_schedule = resolve_recipe(recipe, point_decay, lr_schedule, lr_scheduler)
        self.bend_decay = check_nonnegative_real(bend_decay, "bend_decay")
        self.epochs = None if epochs is None else check_int(epochs, "epochs", 0)
        self.generator = torch_generator(seed, "seed")
        self.loss_fn = F.cross_entropy if loss_fn is None else check_callable(loss_fn, "loss_fn")
        params = [p for p in curve.parameters() if p.requires_grad]
        if not params:
            raise ValueError("curve has no trainable bends (every bend has requires_grad=False)")
        self.optimizer = _make_optimizer(optimizer, params, lr, momentum, self.bend_decay)
        self.scheduler = make_scheduler(self.optimizer, lr_schedule, lr_scheduler, self.epochs)
        self.epochs_done = 0
        self.device = params[0].device
        self.distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.distributed:
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            with torch.no_grad():
                for p in params:
                    torch.distributed.broadcast(p.data, src=0)
        else:
            self.rank, self.world = 0, 1

    @property
    def lr(self) -> float:
        """The learning rate the next step takes (of the optimizer's first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, inputs: torch.Tensor | tuple, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        r"""One step on a global batch: draw ``t``, take this process's shard, step the bends.

        Parameters
        ----------
        inputs : torch.Tensor or tuple of torch.Tensor
            The model's input (a bare tensor), or a tuple of the forward's positional
            inputs; the whole global batch.
        targets : torch.Tensor
            The batch's targets (as many as the inputs have samples).

        Returns
        -------
        (torch.Tensor, int)
            This process's mean loss times its number of samples (a float64 tensor on the
            curve's device, without a host sync), and that number of samples. The loss
            is ``loss_fn``'s, without the regulariser.

        Raises
        ------
        TypeError
            ``inputs`` is neither a tensor nor a tuple of tensors, or ``targets`` is not a
            tensor.
        ValueError
            ``inputs`` and ``targets`` differ in their number of samples.

        Notes
        -----
        The curve runs in its own mode: call ``curve.train()`` first (as
        :func:`train_curve` does) for Algorithm 2's batch statistics. With
        ``point_decay`` :math:`\lambda > 0` the step descends
        :math:`\mathcal{L}(r_\phi(t)) + \frac{\lambda}{2}\|r_\phi(t)\|^2`.
        """
        curve, opt = self.curve, self.optimizer
        inputs = as_inputs(inputs, "inputs")
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a tensor, got {describe(targets)}")
        total = targets.shape[0] if targets.ndim else 1
        if inputs[0].ndim and targets.ndim and inputs[0].shape[0] != total:
            raise ValueError(f"inputs and targets must hold the same number of samples, got {inputs[0].shape[0]} "
                             f"inputs (shape {tuple(inputs[0].shape)}) and {total} targets")
        # Drawn before anything can skip the batch: every process sees one sequence.
        t = float(torch.rand((), generator=self.generator, dtype=torch.float64))
        weighted = torch.zeros((), dtype=torch.float64, device=self.device)
        if total == 0:
            return weighted, 0
        if self.distributed:
            inputs, (targets,) = _shard(inputs, self.rank, self.world), _shard((targets,), self.rank, self.world)
        inputs, targets = to_device(inputs, self.device), targets.to(self.device)
        local = targets.shape[0] if targets.ndim else 1
        opt.zero_grad(set_to_none=True)
        if local > 0:
            if self.adversarial is not None:
                # The robust loss (Tatro et al. section 5): PGD against the network at t.
                rest = inputs[1:]
                adv = pgd_attack(lambda x: curve((x, *rest), t), inputs[0], targets, seed=self.attack_generator,
                                 **self.adversarial)
                inputs = (adv, *rest)
            # The point's weights are built once, for the forward and (with the regulariser) its norm.
            outputs, sq_norm = curve._run_and_sq_norm(inputs, t, norm=self.point_decay > 0)
            loss = self.loss_fn(outputs, targets)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return the batch's mean loss as a one-element tensor")
            loss = loss.reshape(())
            objective = loss if sq_norm is None else loss + (0.5 * self.point_decay) * sq_norm.to(loss.device)
            # Each shard's mean weighted by its share: the sum over processes is the global mean
            # (and the regulariser, the same in every process, is counted once in the sum).
            (objective * (local / total) if local != total else objective).backward()
            weighted = loss.detach().to(torch.float64) * local
        active = [p for p in curve.active_parameters(t) if p.requires_grad]
        for p in active:
            if p.grad is None:
                # Same steps in every process, empty shard or not.
                p.grad = torch.zeros_like(p)
        if self.distributed:
            _all_reduce_sum([p.grad for p in active])
        opt.step()
        return weighted, local

    def end_epoch(self, loss: float = math.nan) -> None:
        """Close an epoch: step the learning-rate schedule (``loss``, the epoch's mean, is what
        :class:`~torch.optim.lr_scheduler.ReduceLROnPlateau` watches). After the last of
        ``epochs`` the schedule is left alone: a function of the epoch fraction is never read
        past 1."""
        self.epochs_done += 1
        if self.epochs is None or self.epochs_done < self.epochs:
            step_scheduler(self.scheduler, loss)


def train_curve(
    curve: Curve,
    data: Iterable[Any],
    *,
    epochs: int,
    lr: float,
    optimizer: str | type[torch.optim.Optimizer] = "sgd",
    momentum: float = 0.9,
    point_decay: float | None = None,
    bend_decay: float = 0.0,
    lr_schedule: str | Callable[[float], float] | None = None,
    lr_scheduler: SchedulerFactory | None = None,
    recipe: str | None = None,
    seed: int | torch.Generator = 0,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    progress: bool = False,
    callback: Callable[[int, float], bool | None] | None = None,
    adversarial: dict[str, Any] | None = None,
) -> list[float]:
    r"""Train a curve's bends (Tatro et al. Algorithm 2; Garipov et al. 2018, section 3).

    For every batch :math:`(x, y)` of every epoch, draw :math:`t \sim U[0, 1]` and take
    one optimizer step on the bends :math:`\phi` along

    .. math::

        \nabla_\phi \Big[\mathcal{L}\big(f(x;\, r_\phi(t)),\, y\big)
        + \frac{\lambda}{2}\, \big\|r_\phi(t)\big\|^2\Big],

    an unbiased estimate of the gradient of
    :math:`\mathbb{E}_{t}\big[\mathcal{L}(r_\phi(t)) + \frac{\lambda}{2}\|r_\phi(t)\|^2\big]`
    (Tatro et al. eq. 5 with the permutation fixed; the curve's endpoints never move).
    :math:`\lambda` is ``point_decay`` and :math:`\|r_\phi(t)\|^2` the squared norm of
    every floating-point parameter of the network at :math:`t` (the point of the curve,
    endpoints' share included; no buffer): Garipov et al.'s regulariser, which their code
    (and Tatro et al.'s, built on it) applies instead of optimizer weight decay. The curve
    runs in train mode: BatchNorm uses the statistics of each batch, as in the papers.

    **The papers' recipe** is ``recipe="garipov"``: SGD with momentum 0.9 (the
    defaults), ``point_decay=5e-4`` (their published curve runs' ``--wd``), no decay of
    the bends, and Garipov et al.'s schedule
    (:func:`~pyperm.nn.curves.schedules.garipov_schedule`: ``lr`` for the first half of
    the epochs, then linearly down to ``0.01 * lr`` at 90%, then constant). An argument
    given explicitly overrides the recipe's value.

    Parameters
    ----------
    curve : BezierCurve or PolyChain
        The curve; its bends are updated in place. Its training flag is restored.
    data : iterable of (inputs, targets, ...)
        The training batches (a DataLoader, a list), read once per epoch (so it must be
        re-iterable when ``epochs > 1``). Inputs may be a tensor or a tuple of the
        forward's inputs; batches are moved to the curve's device. A bare tensor is
        refused: it is not a batch.
    epochs : int
        Passes over ``data`` (0 trains nothing).
    lr : float
        The base learning rate (positive).
    optimizer : {"sgd", "adam"} or torch.optim.Optimizer subclass, default "sgd"
        Built over the bends with ``lr``, ``bend_decay`` (as its ``weight_decay``) and,
        when it takes one, ``momentum`` (SGD's heavy ball; ignored by Adam).
    momentum : float, default 0.9
    point_decay : float, optional
        :math:`\lambda` of the regulariser :math:`\frac{\lambda}{2}\|r_\phi(t)\|^2` on the
        point of the curve at the drawn :math:`t` (Garipov et al.'s ``l2_regularizer``).
        Default 0, or the recipe's.
    bend_decay : float, default 0.0
        Weight decay of the bends through the optimizer (each bend shrinks toward zero):
        another objective than ``point_decay``'s, which also pulls on the bends in
        proportion to their weight at :math:`t`.
    lr_schedule : {"constant", "garipov"} or callable, optional
        The learning rate of epoch :math:`e` of :math:`E` (from 1) is
        ``lr * lr_schedule(e / E)``: a function of the fraction of training done
        returning a non-negative factor, or a built-in by name
        (:data:`~pyperm.nn.curves.schedules.SCHEDULES`). Default constant, or the
        recipe's.
    lr_scheduler : callable, optional
        Instead of ``lr_schedule``: ``lr_scheduler(optimizer)`` returning any
        :mod:`torch.optim.lr_scheduler` scheduler (e.g.
        ``functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=epochs)``),
        stepped once after every epoch but the last
        (:class:`~torch.optim.lr_scheduler.ReduceLROnPlateau` with the epoch's loss).
    recipe : {"garipov"}, optional
        Fill ``point_decay`` and ``lr_schedule``, where not given, from a named recipe
        (above).
    seed : int or torch.Generator, default 0
        Seeds the CPU generator the points ``t`` are drawn from, one per batch as
        ``torch.rand((), generator=g, dtype=torch.float64)`` (the global RNG is not
        used). Under torch.distributed every process must pass the same seed.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)`` returning the batch's *mean* loss;
        :func:`torch.nn.functional.cross_entropy` by default.
    progress : bool, default False
        Show a tqdm progress bar over the batches.
    callback : callable, optional
        ``callback(epoch, loss)`` after each epoch (``epoch`` from 1, ``loss`` the epoch's
        mean training loss); returning ``True`` stops training, ``False`` or ``None`` goes
        on, anything else is a TypeError (the rule of every pyperm callback). A hook for logging,
        checkpoints and methods built on this one (PAM).
    adversarial : dict, optional
        Train on the robust loss (Tatro et al. section 5): each batch is replaced by PGD
        adversarial examples against the network at the batch's ``t``,
        :func:`~pyperm.nn.eval.robust.pgd_attack` with these keyword arguments
        (``eps``, ``steps``, ``step_size``; optionally ``norm``, ``clamp``, ``loss_fn``,
        and ``seed`` for the attacks' random starts). Each step then costs ``steps + 1``
        forward and backward passes.

    Returns
    -------
    list of float
        The mean training loss of each epoch (``loss_fn``'s, without the regulariser;
        over samples, and over processes under torch.distributed), one per epoch run.

    Raises
    ------
    TypeError
        ``curve`` is not a pyperm curve, ``data`` is not an iterable of
        ``(inputs, targets)`` batches (the message says what was given), a one-shot
        iterator is given for several epochs, or an argument has the wrong type.
    ValueError
        ``epochs`` is negative, ``lr`` is not positive, ``momentum``, ``point_decay``
        or ``bend_decay`` is negative or not finite, ``optimizer``, ``recipe`` or a
        schedule name is unknown, both ``lr_schedule`` and ``lr_scheduler`` are given,
        ``data`` yields no batches, or ``loss_fn`` returns more than one value.

    Notes
    -----
    **Data parallelism.** When :func:`torch.distributed.is_initialized` is true (e.g. a
    script launched with ``torchrun``; gloo on CPUs, NCCL on GPUs), every process
    iterates the same ``data``, keeps its shard of each batch
    (:func:`torch.tensor_split` along the first axis), scales its mean loss by its
    share of the batch and all-reduces (sums) the gradients of the bends, which is the
    gradient of the global batch's mean loss (the regulariser, the same in every
    process, counts once). The bends are broadcast from rank 0 first and ``t`` comes
    from the shared seed, so the processes stay identical. BatchNorm normalises each
    shard with its own statistics, as under
    :class:`~torch.nn.parallel.DistributedDataParallel` without ``SyncBatchNorm``.

    A bend whose weight is zero at the drawn ``t`` (a polygonal chain's bends off
    ``t``'s segment) gets no gradient and is not stepped (no momentum, no decay). Here a
    polygonal chain trained with momentum differs from Garipov et al.'s code, which
    gives such a bend a zero gradient and so still moves it by its momentum; Bezier
    curves, whose bends all have a weight at every ``0 < t < 1``, follow that code step
    for step.

    References
    ----------
    .. [1] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment",
       NeurIPS 2020, Algorithm 2 (appendix B).
    .. [2] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss
       Surfaces, Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018 (and
       their public code: ``curves.l2_regularizer``, ``train.learning_rate_schedule``).

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import BezierCurve, train_curve
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: v.flip(0) if v.ndim else v for k, v in a.items()}
    >>> g = torch.Generator().manual_seed(0)
    >>> data = [(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(4)]
    >>> history = train_curve(BezierCurve(net, a, b), data, epochs=2, lr=0.05, recipe="garipov")
    >>> len(history)
    2
    """
    check_curve(curve)
    epochs = check_int(epochs, "epochs", 0)
    check_batches(data, "data", supervised=True, reiterable=epochs > 1)
    check_callable(callback, "callback", allow_none=True)
    trainer = CurveTrainer(curve, lr=lr, optimizer=optimizer, momentum=momentum, point_decay=point_decay,
                           bend_decay=bend_decay, lr_schedule=lr_schedule, lr_scheduler=lr_scheduler, epochs=epochs,
                           recipe=recipe, seed=seed, loss_fn=loss_fn, adversarial=adversarial)

    history: list[float] = []
    per_epoch = num_batches(data)
    bar = progress_bar(progress, None if per_epoch is None else per_epoch * epochs, "curve training", "batch")
    try:
        with training_flags(curve, train=True):
            for epoch in range(1, epochs + 1):
                totals = torch.zeros(2, dtype=torch.float64, device=trainer.device)  # loss * samples, samples
                for index, batch in iterate_batches(data, name="data"):
                    weighted, local = trainer.step(*inputs_and_targets(batch, index, "data"))
                    totals[0] += weighted
                    totals[1] += local
                    if bar is not None:
                        bar.update(1)
                if trainer.distributed:
                    torch.distributed.all_reduce(totals)
                mean = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
                history.append(mean)
                logger.debug("train_curve: epoch %d/%d, lr %.4g, mean loss %.6g", epoch, epochs, trainer.lr, mean)
                if bar is not None:
                    bar.set_postfix(loss=f"{mean:.4g}")
                if callback is not None and callback_stops(callback(epoch, mean)):
                    break
                trainer.end_epoch(mean)
    finally:
        if bar is not None:
            bar.close()
    return history
