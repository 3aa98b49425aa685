r"""Projected gradient descent (PGD) attacks and robust accuracy (Madry et al.; Tatro et al. section 5).

An attack looks for a perturbation :math:`\delta` of bounded norm that maximises the loss,

.. math::

    \max_{\|\delta\| \le \epsilon,\ x + \delta \in [lo, hi]}\ \mathcal{L}\big(f(x + \delta), y\big),

by ``steps`` steps of projected gradient *ascent* from a uniformly random start in the
ball (Madry et al. 2018): for the :math:`\ell_\infty` norm

.. math::

    x^{(s+1)} = \Pi\big(x^{(s)} + \alpha\, \operatorname{sign} \nabla_x \mathcal{L}(f(x^{(s)}), y)\big),

for the :math:`\ell_2` norm the step is :math:`\alpha\, g / \|g\|_2` per sample; :math:`\Pi`
projects onto the ball around the clean input and clips to the valid input range. Tatro
et al. train and evaluate robust curves with this attack at every point of the curve.

References
----------
.. [1] A. Madry, A. Makelov, L. Schmidt, D. Tsipras, A. Vladu, "Towards Deep Learning
   Models Resistant to Adversarial Attacks", ICLR 2018.
.. [2] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment", NeurIPS
   2020, sections 2.3 and 5.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyperm._checks import (
    check_callable,
    check_choice,
    check_finite_real,
    check_int,
    check_nonnegative_real,
    torch_generator,
)
from pyperm.nn._checks import check_module
from pyperm.nn._runtime import eval_mode, inputs_and_targets, iterate_batches, module_device

__all__ = ["check_attack", "pgd_attack", "robust_accuracy"]

_NORMS = ("inf", "2")


def check_attack(attack: Any, name: str = "adversarial") -> dict[str, Any]:
    """A mapping of :func:`pgd_attack` keyword arguments, checked; a new dict.

    ``eps``, ``steps`` and ``step_size`` are required; ``norm``, ``seed``, ``clamp`` and
    ``loss_fn`` are optional. Raises TypeError/ValueError naming ``name``.
    """
    if not isinstance(attack, dict):
        raise TypeError(f"{name} must be a dict of pgd_attack arguments (eps, steps, step_size, ...), "
                        f"got {type(attack).__name__}")
    allowed = {"eps", "steps", "step_size", "norm", "seed", "clamp", "loss_fn"}
    unknown = sorted(set(attack) - allowed)
    missing = sorted({"eps", "steps", "step_size"} - set(attack))
    if unknown or missing:
        raise ValueError(f"{name} must have the keys eps, steps, step_size (and optionally norm, seed, clamp, "
                         f"loss_fn): missing {missing}, unknown {unknown}")
    out = dict(attack)
    prefix = f"{name}: "
    _check_options(out["eps"], out["steps"], out["step_size"], out.get("norm", "inf"), out.get("clamp", (0.0, 1.0)),
                   prefix=prefix)
    # Checked only: robust_accuracy derives one seed per batch from an int seed.
    torch_generator(out.get("seed", 0), prefix + "seed")
    check_callable(out.get("loss_fn"), prefix + "loss_fn", allow_none=True)
    return out


def _check_options(eps: Any, steps: Any, step_size: Any, norm: Any, clamp: Any, prefix: str = "") -> tuple:
    eps = check_nonnegative_real(eps, prefix + "eps")
    step_size = check_nonnegative_real(step_size, prefix + "step_size")
    steps = check_int(steps, prefix + "steps", 0)
    # The numbers 2 and inf name the same norms as the strings (as torch.linalg.norm's ord does).
    if isinstance(norm, (int, float)) and not isinstance(norm, bool) and norm in (2, float("inf")):
        norm = "2" if norm == 2 else "inf"
    norm = check_choice(norm, prefix + "norm", _NORMS)
    if clamp is not None:
        if not (isinstance(clamp, (tuple, list)) and len(clamp) == 2):
            raise TypeError(f"{prefix}clamp must be a pair (low, high) or None, got {clamp!r}")
        low, high = (check_finite_real(c, f"{prefix}clamp[{k}]") for k, c in enumerate(clamp))
        if not low < high:
            raise ValueError(f"{prefix}clamp must have low < high, got {clamp!r}")
        clamp = (low, high)
    return eps, steps, step_size, norm, clamp


def _per_sample_norm(x: torch.Tensor) -> torch.Tensor:
    """The l2 norm of every sample, shaped to broadcast against ``x``."""
    return x.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, *([1] * (x.ndim - 1)))


def _project(x_adv: torch.Tensor, x: torch.Tensor, eps: float, norm: str,
             clamp: tuple[float, float] | None) -> torch.Tensor:
    delta = x_adv - x
    if norm == "inf":
        delta = delta.clamp(-eps, eps)
    else:
        delta = delta * (eps / _per_sample_norm(delta)).clamp(max=1.0)
    out = x + delta
    return out if clamp is None else out.clamp(*clamp)


def pgd_attack(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    eps: float,
    steps: int,
    step_size: float,
    norm: str = "inf",
    seed: int | torch.Generator = 0,
    clamp: tuple[float, float] | None = (0.0, 1.0),
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    r"""Adversarial inputs by projected gradient ascent on the loss, from a random start.

    Parameters
    ----------
    model : torch.nn.Module or callable
        The classifier. A module is run in eval mode (its flags are restored, so
        BatchNorm statistics are neither used from the batch nor updated); any other
        callable ``model(x) -> outputs`` (e.g. ``lambda x: curve(x, t)``) is run as it is.
        Gradients are taken with respect to the inputs only: no ``.grad`` of a parameter
        is touched.
    inputs : torch.Tensor
        A batch of clean inputs (floating point), not modified.
    targets : torch.Tensor
        Their labels.
    eps : float
        Radius of the ball, :math:`\|\delta\| \le \epsilon` (0 returns the clean inputs,
        clipped to ``clamp``).
    steps : int
        Ascent steps after the random start (0: the random start alone).
    step_size : float
        :math:`\alpha`, the length of a step (per coordinate for ``norm="inf"``).
    norm : {"inf", "2"}, default "inf"
        :math:`\ell_\infty` (Madry et al.; the papers' attack) or per-sample :math:`\ell_2`.
    seed : int or torch.Generator, default 0
        The random start's generator (a CPU generator; the global RNG is not used).
    clamp : (float, float) or None, default (0, 1)
        The valid input range (images scaled to [0, 1]); None for no clipping.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)``, a scalar; cross-entropy by default.

    Returns
    -------
    torch.Tensor
        Adversarial inputs of the inputs' shape, dtype and device, detached: within
        ``eps`` of ``inputs`` in the chosen norm and inside ``clamp``.

    Raises
    ------
    TypeError
        ``model`` is not callable, ``inputs`` not a floating-point tensor, or an option
        of the wrong type.
    ValueError
        ``eps`` or ``step_size`` negative or not finite, ``steps`` negative, an unknown
        ``norm``, ``clamp`` with low >= high, or ``targets`` of another batch size.

    References
    ----------
    .. [1] A. Madry et al., "Towards Deep Learning Models Resistant to Adversarial
       Attacks", ICLR 2018.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.eval.robust import pgd_attack
    >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    >>> x, y = torch.rand(5, 1, 4, 4), torch.tensor([0, 1, 2, 0, 1])
    >>> adv = pgd_attack(net, x, y, eps=0.1, steps=5, step_size=0.03)
    >>> bool((adv - x).abs().max() <= 0.1 + 1e-6), bool(adv.min() >= 0), bool(adv.max() <= 1)
    (True, True, True)
    """
    check_callable(model, "model")
    if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point():
        raise TypeError(f"inputs must be a floating-point tensor, got "
                        f"{inputs.dtype if isinstance(inputs, torch.Tensor) else type(inputs).__name__}")
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a tensor, got {type(targets).__name__}")
    if inputs.ndim == 0 or targets.shape[:1] != inputs.shape[:1]:
        raise ValueError(f"targets must have one label per input: inputs {tuple(inputs.shape)}, targets "
                         f"{tuple(targets.shape)}")
    eps, steps, step_size, norm, clamp = _check_options(eps, steps, step_size, norm, clamp)
    generator = torch_generator(seed, "seed")
    loss_fn = F.cross_entropy if loss_fn is None else check_callable(loss_fn, "loss_fn")

    x = inputs.detach()
    if eps == 0.0:
        return x.clone() if clamp is None else x.clamp(*clamp)
    # The random start, drawn on the CPU (one sequence whatever the device), uniform in the ball.
    if norm == "inf":
        noise = (torch.rand(x.shape, generator=generator, dtype=torch.float64) * 2 - 1) * eps
    else:
        direction = torch.randn(x.shape, generator=generator, dtype=torch.float64)
        radius = torch.rand(x.shape[0], generator=generator, dtype=torch.float64) ** (1.0 / max(1, x[0].numel()))
        noise = direction / _per_sample_norm(direction) * (eps * radius).view(-1, *([1] * (x.ndim - 1)))
    x_adv = _project(x + noise.to(dtype=x.dtype, device=x.device), x, eps, norm, clamp)

    def run() -> torch.Tensor:
        nonlocal x_adv
        for _ in range(steps):
            x_adv.requires_grad_(True)
            with torch.enable_grad():
                loss = loss_fn(model(x_adv), targets)
                (grad,) = torch.autograd.grad(loss.sum() if loss.numel() > 1 else loss, x_adv)
            with torch.no_grad():
                step = grad.sign() if norm == "inf" else grad / _per_sample_norm(grad)
                x_adv = _project(x_adv.detach() + step_size * step, x, eps, norm, clamp)
        return x_adv.detach()

    if isinstance(model, nn.Module):
        with eval_mode(model):
            return run()
    return run()


def robust_accuracy(
    model: nn.Module,
    data: Iterable[Any],
    *,
    max_batches: int | None = None,
    **attack: Any,
) -> float:
    r"""Accuracy of ``model`` on PGD adversarial examples of ``data`` (eval mode).

    Every batch is attacked by :func:`pgd_attack` (keyword arguments ``attack``: ``eps``,
    ``steps``, ``step_size``, ``norm``, ``seed``, ``clamp``, ``loss_fn``; with an int
    seed, batch ``i`` uses ``seed + i``), then classified.

    Parameters
    ----------
    model : torch.nn.Module
        The classifier; run in eval mode, flags restored, parameters untouched.
    data : iterable of (inputs, targets, ...)
        Evaluation batches, moved to the model's device.
    max_batches : int, optional
        Use at most this many batches.
    **attack
        :func:`pgd_attack`'s keyword arguments (``eps``, ``steps`` and ``step_size``
        required).

    Returns
    -------
    float
        Fraction of samples classified correctly after the attack.

    Raises
    ------
    TypeError, ValueError
        As :func:`pgd_attack`; ``data`` yields no batches or no samples.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.eval.robust import robust_accuracy
    >>> net = torch.nn.Linear(4, 2)
    >>> data = [(torch.rand(8, 4), torch.randint(0, 2, (8,)))]
    >>> 0.0 <= robust_accuracy(net, data, eps=0.1, steps=3, step_size=0.05) <= 1.0
    True
    """
    check_module(model)
    attack = check_attack(attack, "attack")
    seed = attack.pop("seed", 0)
    device = module_device(model)
    correct = total = 0
    with eval_mode(model):
        for index, batch in iterate_batches(data, max_batches, "data"):
            inputs, targets = inputs_and_targets(batch, index, "data")
            x, y = inputs[0].to(device), targets.to(device)
            batch_seed = seed if isinstance(seed, torch.Generator) else int(seed) + index
            adv = pgd_attack(model, x, y, seed=batch_seed, **attack)
            with torch.no_grad():
                correct += int((model(adv).argmax(dim=-1) == y).sum())
            total += int(y.shape[0])
    if total == 0:
        raise ValueError("data holds no samples")
    return correct / total
