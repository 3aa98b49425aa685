"""Exact BatchNorm running statistics for a model's current weights (``reset_bn_stats``).

Also the one reading of a ``bn_data=`` argument (:func:`resolve_bn_data`), shared by every
evaluation of points between two models (barriers, curves, planes).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pyperm.nn._checks import check_module
from pyperm.nn._ranks import all_reduce_moments, data_group
from pyperm.nn._runtime import check_batches, eval_mode, iterate_batches, model_inputs, module_device, to_device
from pyperm.nn.eval._moments import Moments

__all__ = ["batchnorm_modules", "reset_bn_stats", "resolve_bn_data"]

logger = logging.getLogger(__name__)

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def batchnorm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every BatchNorm of ``model`` that keeps running statistics."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BATCHNORMS) and m.track_running_stats and m.running_mean is not None
    ]


def resolve_bn_data(model: nn.Module, bn_data: Any, name: str = "bn_data") -> Iterable[Any] | None:
    """The batches to recompute ``model``'s BatchNorm statistics on at every point, or None for no reset.

    ``bn_data`` is a re-iterable of batches (read once per point), None, or False. A
    model with BatchNorm layers needs batches: the running statistics of the endpoints,
    or their interpolation, do not describe the networks between them (Tatro et al.,
    "Optimizing Mode Connectivity via Neuron Alignment", 2020, appendix B), so None
    raises ValueError; False evaluates with the statistics the point's state holds,
    knowingly. A model without BatchNorm needs no reset, and the batches given are
    only checked.
    """
    if bn_data is True:
        raise TypeError(f"{name} must be an iterable of batches, False or None, not True")
    if bn_data is not None and bn_data is not False:
        check_batches(bn_data, name, supervised=False, reiterable=True)
    bns = batchnorm_modules(model)
    if bns and bn_data is None:
        names = ", ".join(repr(path) for path, _ in bns[:3])
        raise ValueError(
            f"the model has BatchNorm layers ({names}{', ...' if len(bns) > 3 else ''}): the statistics of the "
            f"endpoints do not describe the networks between them, so pass {name}= (batches of the training data) "
            f"to recompute them at every point, or {name}=False to use the interpolated ones knowingly"
        )
    return bn_data if bns and bn_data is not False else None


def reset_bn_stats(
    model: nn.Module, data: Iterable[Any], *, max_batches: int | None = None, group: Any = None
) -> nn.Module:
    r"""Recompute every BatchNorm's running statistics exactly over the samples of ``data``.

    After interpolating (or permuting and averaging) weights, the running statistics
    of the BatchNorm layers no longer describe the activations the network computes,
    and a model evaluated with them can look far worse than it is (Tatro et al.,
    appendix B; Git Re-Basin, section 4, "the BatchNorm statistics are recomputed").
    This function runs the model once over ``data`` with its BatchNorms in train mode
    and sets, for each BatchNorm and channel :math:`c`,

    .. math::

        \mu_c = \frac{1}{N} \sum_{i=1}^{N} x_{ic}, \qquad
        \sigma^2_c = \frac{1}{N - 1} \sum_{i=1}^{N} (x_{ic} - \mu_c)^2,

    where :math:`x_{ic}` runs over every sample of every batch (and every spatial
    position) of the BatchNorm's input: the mean and unbiased variance of all samples
    together, each batch weighted by its size. (Torch's ``momentum=None`` instead
    averages the per-batch means and variances with equal weights, which
    over-weights a short last batch and leaves out the spread between batch means.)
    The moments are accumulated in float64 with pairwise merging.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its BatchNorm1d/2d/3d (and SyncBatchNorm) modules with
        ``track_running_stats=True`` are reset in place.
    data : iterable
        Batches of inputs: tensors, or sequences ``(inputs, targets, ...)`` whose first
        element is the input tensor (or a tuple of the forward's inputs), as a
        DataLoader yields them. Moved to the model's device.
    max_batches : int, optional
        Read at most this many batches (on each rank, with ``group``).
    group : torch.distributed.ProcessGroup, optional
        The data is split over the ranks of this process group: every rank calls with the
        same model and its own share of the batches, the per-channel counts, means and
        centred sums of squares are all-reduced (Chan's merge, exact for batches and shares
        of any size), and every rank's model gets the statistics of all the shares together,
        as one process computes them on the concatenated data. ``num_batches_tracked`` is then
        the batches of all ranks. None (the default): this process's data alone.

    Returns
    -------
    torch.nn.Module
        ``model`` itself. Its parameters are unchanged; each BatchNorm's
        ``running_mean`` and ``running_var`` hold the statistics above (in their own
        dtype) and ``num_batches_tracked`` the number of batches read; every module's
        training flag and each BatchNorm's momentum are as before. A model without
        BatchNorm is returned untouched (and ``data`` is not read).

    Raises
    ------
    TypeError
        ``model`` is not a module, ``data`` not an iterable of batches,
        ``max_batches`` not an int, or ``group`` not a process group.
    ValueError
        ``data`` yields no batches, ``max_batches`` is below 1, a BatchNorm saw
        fewer than two values per channel (no variance can be estimated), or ``group``
        is given while torch.distributed is not initialised.
    pyperm.distributed.RankFailedError
        With ``group``: another rank's pass over its data raised (that rank raises its own error).

    Notes
    -----
    Only the BatchNorm modules run in train mode; every other module runs in eval
    mode, so dropout is off and the statistics are those of the network as it is
    evaluated, and deterministic. As in training, and in every published reset, a
    BatchNorm normalises its batch with the batch's own statistics while they are
    collected, so a deeper BatchNorm sees its input as the earlier layers compute it
    in train mode. The forward runs under ``torch.no_grad``. The pass sets each
    BatchNorm's momentum to 0 so that the module's own exponential update leaves the
    buffers alone until the exact values are written.

    References
    ----------
    .. [1] N. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment",
       NeurIPS 2020, appendix B.
    .. [2] S. Ioffe, C. Szegedy, "Batch Normalization: Accelerating Deep Network
       Training by Reducing Internal Covariate Shift", ICML 2015.

    Examples
    --------
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    >>> x = torch.randn(10, 3)
    >>> _ = reset_bn_stats(model, [x[:7], x[7:]])
    >>> h = model[0](x).detach()
    >>> torch.allclose(model[1].running_mean, h.mean(0), atol=1e-6)
    True
    >>> torch.allclose(model[1].running_var, h.var(0), atol=1e-5)
    True
    """
    check_module(model)
    ranks = data_group(group)
    bns = batchnorm_modules(model)
    if not bns:
        logger.debug(
            "reset_bn_stats: %s has no BatchNorm with running statistics; nothing to reset", type(model).__name__
        )
        return model
    device = module_device(model)
    moments = {name: Moments() for name, _ in bns}
    saved = [(m, m.momentum, m.num_batches_tracked.clone()) for _, m in bns]
    hooks = []

    def collect(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.ndim >= 2:  # anything else: the module raises its own error
                moments[name].update(x, 1)

        return hook

    batches = 0
    try:
        for name, m in bns:
            m.momentum = 0.0
            hooks.append(m.register_forward_pre_hook(collect(name)))
        with ranks.together("reset_bn_stats") if ranks is not None else contextlib.nullcontext():
            with torch.no_grad(), eval_mode(model):
                for _, m in bns:
                    m.train()
                for i, batch in iterate_batches(data, max_batches):
                    model(*to_device(model_inputs(batch, i), device))
                    batches += 1
        if ranks is not None:  # every rank: the moments of all the shares
            all_reduce_moments(ranks, [moments[name] for name, _ in bns], [m.running_mean.numel() for _, m in bns])
            batches = int(ranks.sum(torch.tensor([float(batches)])).item())
        for name, _ in bns:
            if 0 < moments[name].count < 2:
                raise ValueError(
                    f"BatchNorm {name!r} saw one value per channel in data; its variance needs at least two"
                )
    except BaseException:
        for m, _, tracked in saved:
            m.num_batches_tracked.copy_(tracked)
        raise
    finally:
        for h in hooks:
            h.remove()
        for m, momentum, _ in saved:
            m.momentum = momentum

    with torch.no_grad():
        for name, m in bns:
            acc = moments[name]
            if acc.count == 0:
                logger.warning("reset_bn_stats: BatchNorm %r was not reached by the forward; left as it was", name)
                continue
            m.running_mean.copy_(acc.mean.to(m.running_mean.dtype))
            m.running_var.copy_(acc.var(unbiased=True).to(m.running_var.dtype))
            m.num_batches_tracked.fill_(batches)
    logger.debug("reset_bn_stats: %d BatchNorm modules over %d batches", len(bns), batches)
    return model
