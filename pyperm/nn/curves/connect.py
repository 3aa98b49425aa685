r"""One call for the common case: align B to A, train a curve between them, evaluate it."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pyperm._checks import check_bool, check_choice
from pyperm.nn._checks import check_model_states, check_module, check_spec
from pyperm.nn._runtime import check_batches, iterate_batches, model_inputs, module_device, to_device
from pyperm.nn.curves._base import Curve
from pyperm.nn.curves.bezier import BezierCurve
from pyperm.nn.curves.evaluate import evaluate_curve
from pyperm.nn.curves.polychain import PolyChain
from pyperm.nn.curves.train import train_curve
from pyperm.nn.eval.path import CurveResult
from pyperm.nn.permutations import Permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["ConnectResult", "connect"]

logger = logging.getLogger(__name__)

_CURVES: dict[str, type[Curve]] = {"bezier": BezierCurve, "polychain": PolyChain}
_ALIGN = ("activation", "weight")


@dataclass
class ConnectResult:
    """What :func:`connect` returns.

    Attributes
    ----------
    perms : Permutations
        The permutations applied to B, bound to the spec used (the identity when
        ``align=None``).
    aligned_state : dict of str to torch.Tensor
        B's state permuted into A's basin (new tensors; B's own when ``align=None``).
    curve : BezierCurve or PolyChain
        The trained curve from A to ``aligned_state``.
    result : CurveResult
        Loss and accuracy along the trained curve.
    history : list of float
        The mean training loss of each epoch.
    linear : CurveResult or None
        The straight line from A to ``aligned_state`` (the curve before training), when
        ``linear=True`` was passed.
    """

    perms: Permutations
    aligned_state: dict[str, torch.Tensor]
    curve: Curve
    result: CurveResult
    history: list[float] = field(default_factory=list)
    linear: CurveResult | None = None


def _loaded_copy(model: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    clone = copy.deepcopy(model)
    clone.load_state_dict(state)
    return clone


def _resolve_spec(model: nn.Module, spec: PermutationSpec | None, data: Iterable[Any]) -> PermutationSpec:
    """``spec``, else the model's own ``permutation_spec()``, else the spec traced on the first batch of ``data``."""
    if spec is not None:
        return spec
    if callable(getattr(model, "permutation_spec", None)):
        return model.permutation_spec()
    _, first = next(iterate_batches(data, 1, "data"))
    return PermutationSpec.from_model(model, to_device(model_inputs(first, 0, "data"), module_device(model)))


def _align(model: nn.Module, spec: PermutationSpec | None, state_a: Mapping[str, torch.Tensor],
           state_b: Mapping[str, torch.Tensor], align: str | None, data: Iterable[Any], align_batches: int | None,
           seed: int) -> Permutations:
    """The permutations of B's units that ``align`` finds (the identity for None)."""
    # Imported here: pyperm.nn.align imports the curves (PAM trains one), so a module-level
    # import would be circular.
    from pyperm.nn.align import activation_matching, weight_matching

    if align == "activation" and spec is None and not callable(getattr(model, "permutation_spec", None)):
        # activation_matching traces the model itself (sites and spec from one trace).
        return activation_matching(_loaded_copy(model, state_a), _loaded_copy(model, state_b), None, data,
                                   max_batches=align_batches).perms
    spec = _resolve_spec(model, spec, data)
    if align is None:
        return Permutations.identity(spec)
    if align == "activation":
        return activation_matching(_loaded_copy(model, state_a), _loaded_copy(model, state_b), spec, data,
                                   max_batches=align_batches).perms
    return weight_matching(spec, state_a, state_b, seed=seed).perms


def connect(
    model: nn.Module,
    spec: PermutationSpec | None,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any],
    *,
    align: str | None = "activation",
    epochs: int,
    lr: float,
    curve: str | type[Curve] = "bezier",
    num_bends: int = 1,
    optimizer: str | type[torch.optim.Optimizer] = "sgd",
    momentum: float = 0.9,
    point_decay: float | None = None,
    bend_decay: float = 0.0,
    lr_schedule: str | Callable[[float], float] | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    recipe: str | None = None,
    seed: int = 0,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    test_data: Iterable[Any] | None = None,
    bn_data: Iterable[Any] | bool | None = None,
    num_points: int = 21,
    align_data: Iterable[Any] | None = None,
    align_batches: int | None = None,
    linear: bool = False,
    progress: bool = False,
) -> ConnectResult:
    r"""Align model B to model A, learn a curve between them, and evaluate it (Tatro et al. 2020, section 3).

    Solves Tatro et al.'s eq. 5 the way the paper does: the permutation :math:`P` comes
    from neuron alignment (their Algorithm 1, ``align="activation"``) or from weight
    matching (Git Re-Basin's Algorithm 1, ``align="weight"``), then the curve
    :math:`r_\phi` from :math:`\theta_A` to :math:`P\theta_B` is trained with Algorithm 2
    (:func:`train_curve`) and evaluated with :func:`evaluate_curve`. ``align=None`` gives
    the unaligned curve of Garipov et al.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture of both endpoints; not modified.
    spec : PermutationSpec or None
        The permutation groups. None: ``model.permutation_spec()`` when the model has
        one (the bundled models), else traced (:meth:`PermutationSpec.from_model` on the
        first batch of ``data``; activation matching traces the model itself).
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints' state dicts (``model.state_dict()`` keys and shapes, the same
        dtypes and devices as each other); not modified.
    data : re-iterable of (inputs, targets, ...)
        Training batches: for the curve, for the alignment (unless ``align_data``), and
        for the BatchNorm statistics of each evaluated point (unless ``bn_data``).
    align : {"activation", "weight", None}, default "activation"
        How to find :math:`P` (see above).
    epochs, lr : int, float
        Curve training length and (base) learning rate (the paper: 250 epochs of SGD at
        1e-2).
    curve : {"bezier", "polychain"} or a curve class, default "bezier"
        The curve family.
    num_bends : int, default 1
        Bends of the curve.
    optimizer, momentum, point_decay, bend_decay, lr_schedule, lr_scheduler, recipe, seed, loss_fn
        Passed to :func:`train_curve` (``seed`` also seeds weight matching);
        ``recipe="garipov"`` trains the curve the way the papers do (Garipov et al.'s
        regulariser on the point of the curve and their learning-rate schedule).
    test_data : re-iterable of batches, optional
        Where the curve is evaluated (default: ``data``).
    bn_data : re-iterable of batches, or False, optional
        BatchNorm statistics of each evaluated point (default: ``data``); see
        :func:`evaluate_curve`.
    num_points : int, default 21
        Points of the evaluation.
    align_data : re-iterable of batches, optional
        Batches for activation matching (default: ``data``; the paper uses 20% of the
        training set).
    align_batches : int, optional
        Use at most this many batches for activation matching.
    linear : bool, default False
        Also evaluate the straight line from A to :math:`P\theta_B` (``result.linear``).
    progress : bool, default False
        Progress bars for training and evaluation.

    Returns
    -------
    ConnectResult
        ``perms`` (a :class:`~pyperm.nn.Permutations`), ``aligned_state``, ``curve``,
        ``result``, ``history`` and ``linear``.

    Raises
    ------
    TypeError
        ``model`` is not a module, ``spec`` is not a PermutationSpec or None, a state is
        not a mapping of str to tensors, ``curve`` is not a name or curve class,
        ``linear`` is not a bool, or an argument of the steps has the wrong type.
    ValueError
        ``align`` or ``curve`` is unknown, the states do not pair up with each other or
        with the model, or a step refuses its input (see :func:`train_curve`,
        :func:`evaluate_curve`, :func:`~pyperm.nn.activation_matching`,
        :func:`~pyperm.nn.weight_matching`).

    References
    ----------
    .. [1] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing
       Mode Connectivity via Neuron Alignment", NeurIPS 2020, eq. 5, Algorithms 1-2,
       Table 1.
    .. [2] S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
       Permutation Symmetries", ICLR 2023, Algorithm 1.
    .. [3] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss
       Surfaces, Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import PermutationSpec
    >>> from pyperm.nn.curves import connect
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> spec = PermutationSpec.from_model(net, torch.randn(2, 4))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: torch.randn_like(v) for k, v in a.items()}
    >>> data = [(torch.randn(32, 4), torch.randint(0, 3, (32,))) for _ in range(4)]
    >>> run = connect(net, spec, a, b, data, align="weight", epochs=1, lr=0.01, num_points=3)
    >>> run.result.ts.tolist(), sorted(run.perms) == sorted(spec.groups)
    ([0.0, 0.5, 1.0], True)
    """
    check_module(model, "model")
    if spec is not None:
        check_spec(spec)
    check_model_states(model, state_a, state_b)
    check_batches(data, "data", reiterable=True)
    if test_data is not None:
        check_batches(test_data, "test_data", reiterable=True)
    if align is not None:
        check_choice(align, "align", _ALIGN)
    if isinstance(curve, str):
        curve_cls = _CURVES[check_choice(curve, "curve", _CURVES)]
    elif isinstance(curve, type) and issubclass(curve, Curve):
        curve_cls = curve
    else:
        raise TypeError(f"curve must be 'bezier', 'polychain' or a curve class, got {type(curve).__name__}")
    linear = check_bool(linear, "linear")

    perms = _align(model, spec, state_a, state_b, align, data if align_data is None else align_data,
                   align_batches, seed)
    # align=None: B itself, not a permuted copy (the identity would only copy every tensor).
    aligned = dict(state_b) if align is None else perms.apply(state_b)
    path = curve_cls(model, state_a, aligned, num_bends=num_bends)
    test_data = data if test_data is None else test_data
    bn_data = data if bn_data is None else bn_data
    before = evaluate_curve(path, test_data, num_points=num_points, bn_data=bn_data, loss_fn=loss_fn,
                            progress=progress) if linear else None
    history = train_curve(path, data, epochs=epochs, lr=lr, optimizer=optimizer, momentum=momentum,
                          point_decay=point_decay, bend_decay=bend_decay, lr_schedule=lr_schedule,
                          lr_scheduler=lr_scheduler, recipe=recipe, seed=seed, loss_fn=loss_fn, progress=progress)
    result = evaluate_curve(path, test_data, num_points=num_points, bn_data=bn_data, loss_fn=loss_fn,
                            progress=progress)
    logger.info("connect(align=%s, curve=%s): average accuracy %.4g, min accuracy %.4g", align,
                curve_cls.__name__, result.average_accuracy, result.min_accuracy)
    return ConnectResult(perms=perms, aligned_state=aligned, curve=path, result=result, history=history,
                         linear=before)
