"""The one seeded training loop of small classifiers, shared by the tests, benchmarks and reproductions.

Endpoints for alignment experiments are trained the same way everywhere: every layer
re-initialised from the seed (Linear and Conv layers by torch's default scheme, drawn from a
generator of their own, not the global RNG; normalisation layers reset to their fresh state,
BatchNorm's running statistics included), then plain first-order steps. So two calls with the same
seed give the same network on every device, and different seeds give the independently
trained pairs that Git Re-Basin and Tatro et al. align.

The update rules are written out rather than taken from ``torch.optim``: the first step
of a ``torch.optim`` optimizer imports ``torch._dynamo``, about a second on a loaded
2-core machine, which is a good part of a smoke test's budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pyperm._checks import check_callable, check_choice, check_int, check_nonnegative_real, check_positive_int
from pyperm._checks import check_positive_real, torch_generator
from pyperm.nn._checks import check_module
from pyperm.nn._runtime import check_batches, inputs_and_targets

__all__ = ["init_weights", "train_classifier"]

OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("constant", "cosine", "halving")
HALVING_EPOCHS = 20  # "a learning rate of 1E-1 that decays by a factor of 0.5 every 20 epochs" (Tatro et al. sec. 5)


def init_weights(model: nn.Module, generator: torch.Generator) -> None:
    """Re-initialise every layer: Linear and Conv from ``generator``, normalisation layers to their fresh state.

    Weights and biases are uniform in :math:`\\pm 1/\\sqrt{\\text{fan-in}}`, the range of
    torch's default initialisation. The numbers are drawn on the CPU and copied, so a CPU
    generator seeds a model on any device and a seed gives the same network on every
    device. BatchNorm, LayerNorm and GroupNorm are reset as a new layer starts (scale 1,
    shift 0, running mean 0 and variance 1, no batches tracked): so a model that was
    trained before gives, from the same seed, the same network as a new one, and two
    endpoints trained in one model object are as independent as two fresh models. Layers
    of other kinds (embeddings, a library's own layers) keep their state: the reproductions
    build each endpoint as a new model, so theirs is the constructor's.
    """

    def uniform(t: torch.Tensor, bound: float) -> None:
        t.copy_(torch.empty(t.shape, dtype=t.dtype).uniform_(-bound, bound, generator=generator))

    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)):
                bound = 1.0 / m.weight[0].numel() ** 0.5
                uniform(m.weight, bound)
                if m.bias is not None:
                    uniform(m.bias, bound)
            elif isinstance(m, norms):
                m.reset_parameters()  # deterministic: ones, zeros and fresh running statistics


def train_classifier(
    model: nn.Module,
    batches: Any,
    *,
    epochs: int,
    lr: float,
    seed: int,
    optimizer: str = "adam",
    batch_size: int | None = None,
    schedule: str = "constant",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    perturb: Callable[[nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    on_epoch: Callable[[int, nn.Module], Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Train ``model`` in place from a seeded initialisation; return a copy of its trained state dict.

    Parameters
    ----------
    model : torch.nn.Module
        The classifier. Its Linear, Conv and normalisation layers are re-initialised from
        ``seed`` first (:func:`init_weights`); other layers keep their state.
    batches : iterable of (inputs, targets), or (inputs, targets) tensors
        Without ``batch_size``: the batches of one epoch, read in their order every epoch
        (a list or a DataLoader; a one-shot iterator is refused). With ``batch_size``: the
        whole training set as two tensors, cut into batches of ``batch_size`` in a new
        order every epoch, drawn from ``seed`` (on the CPU, so the same on every device).
    epochs : int
        Passes over the data.
    lr : float
        The step size (the peak of the cosine schedule).
    seed : int
        Seeds the initialisation and the shuffling.
    optimizer : {"adam", "sgd"}, default "adam"
        Adam (betas 0.9 and 0.999, eps 1e-8, as ``torch.optim.Adam``) or SGD with
        heavy-ball ``momentum`` (as ``torch.optim.SGD`` without dampening).
    batch_size : int, optional
        See ``batches``.
    schedule : {"constant", "cosine", "halving"}, default "constant"
        The step size over the run: ``lr`` throughout, decayed from ``lr`` to zero along
        half a cosine, or halved every 20 epochs (Tatro et al.'s endpoints).
    momentum : float, default 0.9
        SGD's momentum (0: plain gradient descent); ignored by Adam.
    weight_decay : float, default 0.0
        L2 penalty added to the gradients.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)``; cross-entropy by default.
    perturb : callable, optional
        ``perturb(model, inputs, targets, step)`` returns the inputs to train on in place
        of each batch's (adversarial training passes a PGD attack).
    on_epoch : callable, optional
        ``on_epoch(epochs_done, model)`` after every epoch (1 after the first), with the
        model in train mode; what it returns is ignored. Git Re-Basin's Figure 3 takes
        its snapshots of the weights this way.

    Returns
    -------
    dict of str to torch.Tensor
        A copy of the trained state dict. The model is left in eval mode.

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong type or out of range; the message names it.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn._training import train_classifier
    >>> from pyperm.nn.models import MLP
    >>> g = torch.Generator().manual_seed(0)
    >>> x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    >>> state = train_classifier(MLP([4, 8, 3]), (x, y), batch_size=16, epochs=2, lr=1e-2, seed=1)
    >>> sorted(state)[:2]
    ['layers.0.bias', 'layers.0.weight']
    """
    check_module(model, "model")
    epochs = check_positive_int(epochs, "epochs")
    lr = check_positive_real(lr, "lr")
    gen = torch_generator(check_int(seed, "seed", 0), "seed")
    optimizer = check_choice(optimizer, "optimizer", OPTIMIZERS)
    schedule = check_choice(schedule, "schedule", SCHEDULES)
    momentum = check_nonnegative_real(momentum, "momentum")
    weight_decay = check_nonnegative_real(weight_decay, "weight_decay")
    loss_fn = check_callable(loss_fn, "loss_fn", allow_none=True) or nn.functional.cross_entropy
    perturb = check_callable(perturb, "perturb", allow_none=True)
    on_epoch = check_callable(on_epoch, "on_epoch", allow_none=True)
    epoch, steps_per_epoch = _epoch_batches(batches, batch_size, gen)
    if schedule == "cosine" and steps_per_epoch is None:
        raise ValueError("schedule='cosine' needs batches with a length (a list or a DataLoader) or batch_size")
    total = max(1, epochs * (steps_per_epoch or 0))

    init_weights(model, gen)
    params = [p for p in model.parameters() if p.requires_grad]
    step_fn = _adam(params) if optimizer == "adam" else _sgd(params, momentum)
    step = 0
    model.train()
    for done in range(1, epochs + 1):
        for index, batch in enumerate(epoch()):
            (inputs, *rest), targets = inputs_and_targets(batch, index, "batches")
            if perturb is not None:
                inputs = perturb(model, inputs, targets, step)
            loss = loss_fn(model(inputs, *rest), targets)
            grads = torch.autograd.grad(loss, params)
            rate = _rate(schedule, lr, step, total, done)
            with torch.no_grad():
                if weight_decay:
                    grads = [g.add(p, alpha=weight_decay) for p, g in zip(params, grads)]
                step_fn(grads, rate)
            step += 1
        if on_epoch is not None:
            on_epoch(done, model)
            model.train()  # the callback may have evaluated the model
    model.eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rate(schedule: str, lr: float, step: int, total: int, epoch: int) -> float:
    """The step size of step ``step`` (from 0) of ``total``, in epoch ``epoch`` (from 1)."""
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + _cosine(step, total))
    if schedule == "halving":
        return lr * 0.5 ** ((epoch - 1) // HALVING_EPOCHS)
    return lr


def _cosine(step: int, total: int) -> float:
    """``cos(pi * step / total)``, taken in float32 as the reproductions' reports were computed
    (so that their numbers stay the same)."""
    return torch.cos(torch.tensor(math.pi * step / total)).item()


def _epoch_batches(
    batches: Any, batch_size: Any, gen: torch.Generator
) -> tuple[Callable[[], Iterator[Any]], int | None]:
    """A function giving the batches of one epoch (a new seeded order each call when shuffling), and
    how many there are (None when ``batches`` has no length)."""
    if batch_size is None:
        data: Iterable[Any] = check_batches(batches, "batches", reiterable=True)
        return (lambda: iter(data)), (len(data) if hasattr(data, "__len__") else None)
    batch_size = check_positive_int(batch_size, "batch_size")
    if not (isinstance(batches, (tuple, list)) and len(batches) == 2
            and all(isinstance(t, torch.Tensor) for t in batches)):  # fmt: skip
        raise TypeError("with batch_size, batches must be the pair (inputs, targets) of the whole training set")
    x, y = batches
    if len(x) != len(y):
        raise ValueError(f"batches: {len(x)} inputs but {len(y)} targets")
    if len(y) == 0:
        raise ValueError("batches: the training set is empty")

    def shuffled() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(y), generator=gen).to(y.device)  # drawn on the CPU: the same on every device
        for i in range(0, len(y), batch_size):
            idx = order[i : i + batch_size]
            yield x[idx], y[idx]

    return shuffled, -(-len(y) // batch_size)


def _sgd(params: list[torch.Tensor], momentum: float) -> Callable[[list[torch.Tensor], float], None]:
    """SGD with heavy-ball momentum: ``v = momentum * v + g; p -= rate * v``."""
    velocity = [torch.zeros_like(p) for p in params]

    def step(grads: list[torch.Tensor], rate: float) -> None:
        for p, v, g in zip(params, velocity, grads):
            if momentum:
                v.mul_(momentum).add_(g)
                p.sub_(v, alpha=rate)
            else:
                p.sub_(g, alpha=rate)

    return step


def _adam(params: list[torch.Tensor], betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
    """Adam with bias correction, as ``torch.optim.Adam`` computes it."""
    first = [torch.zeros_like(p) for p in params]
    second = [torch.zeros_like(p) for p in params]
    count = [0]

    def step(grads: list[torch.Tensor], rate: float) -> None:
        count[0] += 1
        c1 = 1 - betas[0] ** count[0]
        c2 = 1 - betas[1] ** count[0]
        for p, m, v, g in zip(params, first, second, grads):
            m.lerp_(g, 1 - betas[0])
            v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            denom = (v.sqrt() / math.sqrt(c2)).add_(eps)
            p.addcdiv_(m, denom, value=-rate / c1)

    return step
