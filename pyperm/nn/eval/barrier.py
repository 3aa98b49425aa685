"""Loss and accuracy along the linear path between two models, and its barriers (``barrier``)."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pyperm._checks import check_bool, check_callable, check_fraction, check_int
from pyperm._progress import progress_bar
from pyperm.nn._checks import check_model_states, check_module
from pyperm.nn._ranks import data_group
from pyperm.nn._runtime import check_batches, eval_mode, mean_loss_and_accuracy, module_device
from pyperm.nn.eval.batchnorm import reset_bn_stats, resolve_bn_data
from pyperm.nn.eval.path import BarrierResult, chord
from pyperm.nn.state import interpolate

__all__ = ["barrier"]

logger = logging.getLogger(__name__)


def _own_copy(t: torch.Tensor, device: torch.device, in_model: set[int]) -> torch.Tensor:
    """``t`` on ``device``, copied when it shares storage with the model's own tensors."""
    moved = t.detach().to(device)
    return moved.clone() if moved.untyped_storage().data_ptr() in in_model else moved


def _check_ts(ts: Any, num_points: Any) -> np.ndarray:
    """The points of the path: ``num_points`` evenly spaced, or ``ts`` checked (0 first, 1 last, increasing)."""
    if ts is None:
        return np.linspace(0.0, 1.0, check_int(num_points, "num_points", 2))
    if isinstance(ts, (torch.Tensor, np.ndarray)):
        ts = ts.tolist()
    if isinstance(ts, (str, bytes)) or not isinstance(ts, Sequence):
        raise TypeError(f"ts must be a sequence of floats, got {type(ts).__name__}")
    out = np.asarray([check_fraction(t, f"ts[{k}]") for k, t in enumerate(ts)], dtype=np.float64)
    if out.size < 2:
        raise ValueError(f"ts must hold at least two points (0 and 1), got {out.size}")
    if out[0] != 0.0 or out[-1] != 1.0:
        raise ValueError(
            f"ts must start at 0 and end at 1 (the endpoints define the barrier), got {out[0]} ... {out[-1]}"
        )
    if np.any(np.diff(out) <= 0):
        raise ValueError("ts must be strictly increasing")
    return out


def barrier(
    model: nn.Module,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any],
    *,
    num_points: int = 11,
    ts: Sequence[float] | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    bn_data: Iterable[Any] | bool | None = None,
    device: str | torch.device | None = None,
    progress: bool = False,
    group: Any = None,
) -> BarrierResult:
    r"""Evaluate the linear path between two models and its loss and accuracy barriers.

    At each point :math:`t` the model is loaded with
    :math:`\Theta(t) = (1 - t)\,\Theta_A + t\,\Theta_B` (:func:`~pyperm.nn.state.interpolate`),
    its BatchNorm statistics are recomputed when ``bn_data`` is given, and its mean
    loss :math:`L(t)` and accuracy :math:`\mathrm{acc}(t)` over all samples of ``data``
    are measured. The barriers are Definition 2.2 of Git Re-Basin, with the chord
    between the endpoints in place of the plain mean (the two agree at the midpoint
    and the chord also covers endpoints of unequal loss):

    .. math::

        B_{\mathrm{loss}} = \max_t \; L(t) - \big((1 - t) L(0) + t L(1)\big), \qquad
        B_{\mathrm{acc}} = \max_t \; \big((1 - t)\,\mathrm{acc}(0) + t\,\mathrm{acc}(1)\big) - \mathrm{acc}(t).

    Parameters
    ----------
    model : torch.nn.Module
        A model of the architecture both states belong to. Its state, training flags
        and device are the same after the call as before (the state is saved and
        loaded back, also when an error is raised).
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints: the model's ``state_dict`` keys and shapes, with the same
        dtypes and devices as each other. Not modified.
    data : iterable of (inputs, targets, ...)
        The evaluation batches (a DataLoader, a list), read once per point, so it must
        be re-iterable. Inputs may be a tensor or a tuple of the forward's inputs. A
        bare tensor, or one batch ``(x, y)`` not wrapped in a list, is refused with a
        message that says so.
    num_points : int, default 11
        Evenly spaced points from 0 to 1, endpoints included; ignored when ``ts`` is
        given.
    ts : sequence of float, optional
        The points, strictly increasing from exactly 0 to exactly 1.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)`` returning the batch's mean loss;
        :func:`torch.nn.functional.cross_entropy` by default. Batch means are
        weighted by batch size, so ``loss`` is the mean over samples.
    bn_data : re-iterable of batches, or False, optional
        Batches (the training data, in the papers) over which
        :func:`~pyperm.nn.eval.batchnorm.reset_bn_stats` recomputes the BatchNorm
        statistics at every point. Required when the model has BatchNorm layers:
        interpolated running statistics do not describe the interpolated network.
        ``False`` evaluates with the interpolated running statistics knowingly.
        Ignored for a model without BatchNorm.
    device : str or torch.device, optional
        Where to evaluate; the model's own device by default. On another device a
        copy of the model is used and the model itself is not moved.
    progress : bool, default False
        Show a progress bar over the points (needs tqdm).
    group : torch.distributed.ProcessGroup, optional
        Split ``data`` and ``bn_data`` over the ranks of this process group: every rank
        calls with the same model, states and points and its own share of the batches;
        the BatchNorm statistics are all-reduced (exact counts,
        :func:`~pyperm.nn.eval.batchnorm.reset_bn_stats`), and so are the sample-weighted
        loss sums, the correct and labelled counts and the sample counts, so every rank
        returns the result one process returns on all the shares together
        (``num_samples`` counts every rank's). None (the default): this process alone.

    Returns
    -------
    BarrierResult
        ``ts``, ``loss``, ``accuracy`` (NaN when the targets are not class indices),
        ``num_samples`` (samples of ``data``), ``loss_barrier``, ``accuracy_barrier``,
        ``bn_reset``; ``plot(path)`` draws the path
        (:func:`~pyperm.nn.eval.path.plot_paths` several), ``to_dict()`` and
        ``to_markdown()`` render it.

    Raises
    ------
    TypeError
        ``model`` is not a module; a state is not a mapping of str to tensors; ``data``
        or ``bn_data`` is not a re-iterable of batches (a generator is refused: it
        would be empty on the second point); ``loss_fn`` is not callable; ``ts`` or
        ``num_points`` has the wrong type.
    ValueError
        The states do not pair up with each other or with the model (the message
        names the key); ``num_points`` < 2; ``ts`` is not increasing from 0 to 1;
        ``data`` yields no batches; the model has BatchNorm layers and ``bn_data``
        is None; ``loss_fn`` returns more than one value; ``group`` is given while
        torch.distributed is not initialised (TypeError: ``group`` is not a process group).

    Notes
    -----
    Evaluation runs in eval mode under ``torch.no_grad``; the BatchNorm reset in
    between runs the BatchNorms in train mode (see ``reset_bn_stats``). The work is
    ``len(ts)`` passes over ``data``, plus as many over ``bn_data``. While the call
    runs, ``model`` holds the interpolated weights (its own are saved on its device and
    loaded back at the end), so it must not be used from another thread meanwhile.

    References
    ----------
    .. [1] S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
       Permutation Symmetries", ICLR 2023, Definition 2.2.
    .. [2] J. Frankle, G. K. Dziugaite, D. Roy, M. Carbin, "Linear Mode Connectivity and
       the Lottery Ticket Hypothesis", ICML 2020.

    Examples
    --------
    >>> import torch
    >>> model = torch.nn.Linear(4, 3)
    >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    >>> a = model.state_dict()
    >>> result = barrier(model, a, a, [(x, y)], num_points=3)
    >>> result.loss_barrier
    0.0
    """
    check_module(model)
    ranks = data_group(group)
    check_model_states(model, state_a, state_b)
    check_batches(data, "data", reiterable=True)
    if bn_data is not None and not isinstance(bn_data, bool):
        check_batches(bn_data, "bn_data", supervised=False, reiterable=True)
    points = _check_ts(ts, num_points)
    loss_fn = F.cross_entropy if loss_fn is None else check_callable(loss_fn, "loss_fn")
    progress = check_bool(progress, "progress")
    reset_on = resolve_bn_data(model, bn_data)

    target = module_device(model) if device is None else torch.device(device)
    own = target != module_device(model)
    # On another device a copy runs, so the caller's model is never moved.
    runner = copy.deepcopy(model).to(target) if own else model
    saved = None if own else {k: v.detach().clone() for k, v in model.state_dict().items()}
    # The endpoints on the evaluation device once, so each point's interpolation is computed there.
    # An endpoint that shares memory with the model (``barrier(a, a.state_dict(), ...)``, the
    # usual call) is copied: loading each point into the model would otherwise move it too.
    in_model = {t.untyped_storage().data_ptr() for t in runner.state_dict().values()}
    a = {k: _own_copy(v, target, in_model) for k, v in state_a.items()}
    b = {k: _own_copy(v, target, in_model) for k, v in state_b.items()}

    losses, accuracies = [], []
    samples = 0
    bar = progress_bar(progress, len(points), "barrier", "point")
    try:
        for t in points:
            with torch.no_grad():
                runner.load_state_dict(interpolate(a, b, float(t)))
            if reset_on is not None:
                reset_bn_stats(runner, reset_on, group=group)
            with torch.no_grad(), eval_mode(runner):
                loss, acc, samples = mean_loss_and_accuracy(runner, data, loss_fn, target, ranks=ranks)
            losses.append(loss)
            accuracies.append(acc)
            logger.debug("barrier: t=%.4f loss=%.6g accuracy=%s", t, loss, acc)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if saved is not None:
            with torch.no_grad():
                model.load_state_dict(saved)

    loss_arr = np.asarray(losses, dtype=np.float64)
    # t = 0 is a point, where the difference is exactly 0, so the max is never negative (NaN propagates).
    loss_barrier = float(np.max(loss_arr - chord(points, loss_arr)))
    acc_arr = np.asarray(accuracies, dtype=np.float64)  # NaN at every point when the loss has no accuracy
    acc_barrier = float(np.max(chord(points, acc_arr) - acc_arr))
    if not math.isfinite(loss_barrier):
        logger.warning("barrier: the loss is not finite along the path (loss = %s)", loss_arr.tolist())
    return BarrierResult(
        ts=points,
        loss=loss_arr,
        accuracy=acc_arr,
        loss_barrier=loss_barrier,
        accuracy_barrier=acc_barrier,
        num_samples=samples,
        bn_reset=reset_on is not None,
    )
