r"""Curve finding: Algorithm 2 of Tatro et al. (Garipov et al.'s training of the bends).

Each step draws :math:`t \sim U[0, 1]`, runs the network :math:`r_\phi(t)` on a batch and
takes an optimizer step on the bends :math:`\phi`, a stochastic gradient step on

.. math::

    \ell(\phi) = \mathbb{E}_{t \sim U[0,1]}\, \mathcal{L}\big(r_\phi(t)\big).

Under torch.distributed every process reads the same global batches, keeps its shard of
each, draws the same ``t`` (one seed for all) and averages the gradients of the bends
with an all-reduce, so the bends follow the single-process run on the global batches.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from pyperm._checks import check_nonnegative_real, check_positive_real
from pyperm._progress import progress_bar
from pyperm.nn._runtime import (
    inputs_and_targets,
    iterate_batches,
    num_batches,
    to_device,
    training_flags,
)
from pyperm.nn.curves._base import Curve
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
                    weight_decay: float) -> torch.optim.Optimizer:
    if isinstance(optimizer, str):
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be 'sgd', 'adam' or a torch.optim.Optimizer class, got {optimizer!r}")
        cls = _OPTIMIZERS[optimizer]
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
        options["weight_decay"] = weight_decay
    elif weight_decay:
        raise ValueError(f"weight_decay={weight_decay} given, but {cls.__name__} takes no weight_decay")
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
    r"""One optimizer and one stream of points ``t`` for a curve: the step of Algorithm 2.

    :func:`train_curve` is a loop over epochs and batches around :meth:`step`; methods
    that interleave curve steps with other work (PAM alternates them with permutation
    updates) and benchmarks use the trainer directly. Arguments as in
    :func:`train_curve`.

    Attributes
    ----------
    curve : BezierCurve or PolyChain
    optimizer : torch.optim.Optimizer
        Built over the curve's trainable bends; its state (momentum) persists across steps.
    generator : torch.Generator
        Where the points ``t`` come from.
    distributed : bool
        Whether :func:`torch.distributed.is_initialized` was true when the trainer was
        built (the bends were then broadcast from rank 0).
    """

    def __init__(self, curve: Curve, *, lr: float, optimizer: str | type[torch.optim.Optimizer] = "sgd",
                 momentum: float = 0.9, weight_decay: float = 0.0, seed: int | torch.Generator = 0,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                 adversarial: dict[str, Any] | None = None) -> None:
        self.curve = check_curve(curve)
        self.adversarial = None if adversarial is None else check_attack(adversarial)
        if self.adversarial is not None:
            # The attacks' random starts have their own stream: the points t are those of clean training.
            attack_seed = self.adversarial.pop("seed", 0)
            self.attack_generator = (attack_seed if isinstance(attack_seed, torch.Generator)
                                     else torch.Generator().manual_seed(attack_seed))
        lr = check_positive_real(lr, "lr")
        momentum = check_nonnegative_real(momentum, "momentum")
        weight_decay = check_nonnegative_real(weight_decay, "weight_decay")
        if isinstance(seed, torch.Generator):
            self.generator = seed
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or a torch.Generator, got {type(seed).__name__}")
        else:
            self.generator = torch.Generator().manual_seed(seed)
        if loss_fn is None:
            loss_fn = F.cross_entropy
        elif not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        params = [p for p in curve.parameters() if p.requires_grad]
        if not params:
            raise ValueError("curve has no trainable bends (every bend has requires_grad=False)")
        self.optimizer = _make_optimizer(optimizer, params, lr, momentum, weight_decay)
        self.device = params[0].device
        self.distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.distributed:
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            with torch.no_grad():
                for p in params:
                    torch.distributed.broadcast(p.data, src=0)
        else:
            self.rank, self.world = 0, 1

    def step(self, inputs: tuple, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One step on a global batch: draw ``t``, take this process's shard, step the bends.

        Parameters
        ----------
        inputs : tuple of torch.Tensor
            The forward's positional inputs (the whole global batch).
        targets : torch.Tensor
            The batch's targets.

        Returns
        -------
        (torch.Tensor, int)
            This process's mean loss times its number of samples (a float64 tensor on the
            curve's device, without a host sync), and that number of samples.

        Notes
        -----
        The curve runs in its own mode: call ``curve.train()`` first (as
        :func:`train_curve` does) for Algorithm 2's batch statistics.
        """
        curve, opt = self.curve, self.optimizer
        # Drawn before anything can skip the batch: every process sees one sequence.
        t = float(torch.rand((), generator=self.generator, dtype=torch.float64))
        total = targets.shape[0] if targets.ndim else 1
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
            loss = self.loss_fn(curve(inputs, t), targets)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return the batch's mean loss as a one-element tensor")
            loss = loss.reshape(())
            # Each shard's mean weighted by its share: the sum over processes is the global mean.
            (loss * (local / total) if local != total else loss).backward()
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


def train_curve(
    curve: Curve,
    data: Iterable[Any],
    *,
    epochs: int,
    lr: float,
    optimizer: str | type[torch.optim.Optimizer] = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
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

        \nabla_\phi\, \mathcal{L}\big(f(x;\, r_\phi(t)),\, y\big),

    an unbiased estimate of the gradient of :math:`\mathbb{E}_{t}\,\mathcal{L}(r_\phi(t))`
    (Tatro et al. eq. 5 with the permutation fixed; the curve's endpoints never move).
    The curve runs in train mode: BatchNorm uses the statistics of each batch, as in the
    papers.

    Parameters
    ----------
    curve : BezierCurve or PolyChain
        The curve; its bends are updated in place. Its training flag is restored.
    data : iterable of (inputs, targets, ...)
        The training batches (a DataLoader, a list), read once per epoch. Inputs may be
        a tensor or a tuple of the forward's inputs; batches are moved to the curve's
        device.
    epochs : int
        Passes over ``data`` (0 trains nothing).
    lr : float
        Learning rate (positive).
    optimizer : {"sgd", "adam"} or torch.optim.Optimizer subclass, default "sgd"
        Built over the bends with ``lr``, ``weight_decay`` and, when it takes one,
        ``momentum`` (SGD's heavy ball; ignored by Adam).
    momentum : float, default 0.9
    weight_decay : float, default 0.0
        L2 penalty on the bends, through the optimizer.
    seed : int or torch.Generator, default 0
        Seeds the CPU generator the points ``t`` are drawn from (the global RNG is not
        used). Under torch.distributed every process must pass the same seed.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)`` returning the batch's *mean* loss;
        :func:`torch.nn.functional.cross_entropy` by default.
    progress : bool, default False
        Show a tqdm progress bar over the batches.
    callback : callable, optional
        ``callback(epoch, loss)`` after each epoch (``epoch`` from 1, ``loss`` the epoch's
        mean training loss); returning ``True`` stops training. A hook for schedules,
        logging and methods built on this one (PAM).
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
        The mean training loss of each epoch (over samples, and over processes under
        torch.distributed), one per epoch run.

    Raises
    ------
    TypeError
        ``curve`` is not a pyperm curve, ``data`` is not an iterable of
        ``(inputs, targets)`` batches, or an argument has the wrong type.
    ValueError
        ``epochs`` is negative, ``lr`` is not positive, ``momentum`` or
        ``weight_decay`` is negative or not finite, ``optimizer`` is unknown, ``data``
        yields no batches (e.g. a generator on its second epoch), or ``loss_fn``
        returns more than one value.

    Notes
    -----
    **Data parallelism.** When :func:`torch.distributed.is_initialized` is true (e.g. a
    script launched with ``torchrun``; gloo on CPUs, NCCL on GPUs), every process
    iterates the same ``data``, keeps its shard of each batch
    (:func:`torch.tensor_split` along the first axis), scales its mean loss by its
    share of the batch and all-reduces (sums) the gradients of the bends, which is the
    gradient of the global batch's mean loss. The bends are broadcast from rank 0 first
    and ``t`` comes from the shared seed, so the processes stay identical. BatchNorm
    normalises each shard with its own statistics, as under
    :class:`~torch.nn.parallel.DistributedDataParallel` without ``SyncBatchNorm``.

    A bend whose weight is zero at the drawn ``t`` (a polygonal chain's bends off
    ``t``'s segment) gets no gradient and is not stepped (no momentum, no decay).

    References
    ----------
    .. [1] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment",
       NeurIPS 2020, Algorithm 2 (appendix B).
    .. [2] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss
       Surfaces, Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import BezierCurve, train_curve
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: v.flip(0) if v.ndim else v for k, v in a.items()}
    >>> g = torch.Generator().manual_seed(0)
    >>> data = [(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(4)]
    >>> history = train_curve(BezierCurve(net, a, b), data, epochs=2, lr=0.05)
    >>> len(history)
    2
    """
    check_curve(curve)
    if isinstance(epochs, bool) or not isinstance(epochs, int):
        raise TypeError(f"epochs must be an int, got {type(epochs).__name__}")
    if epochs < 0:
        raise ValueError(f"epochs must be non-negative, got {epochs}")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable, got {type(callback).__name__}")
    trainer = CurveTrainer(curve, lr=lr, optimizer=optimizer, momentum=momentum, weight_decay=weight_decay,
                           seed=seed, loss_fn=loss_fn, adversarial=adversarial)

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
                logger.debug("train_curve: epoch %d/%d, mean loss %.6g", epoch, epochs, mean)
                if bar is not None:
                    bar.set_postfix(loss=f"{mean:.4g}")
                if callback is not None and callback(epoch, mean) is True:
                    break
    finally:
        if bar is not None:
            bar.close()
    return history
