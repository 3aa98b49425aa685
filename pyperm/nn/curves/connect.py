r"""One call for the common case: align B to A, train a curve between them, evaluate it."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pyperm.nn._runtime import iterate_batches, model_inputs, module_device, to_device
from pyperm.nn._checks import check_module, check_pair
from pyperm.nn.curves._base import Curve
from pyperm.nn.curves.bezier import BezierCurve
from pyperm.nn.curves.evaluate import CurveResult, evaluate_curve
from pyperm.nn.curves.polychain import PolyChain
from pyperm.nn.curves.train import train_curve

__all__ = ["ConnectResult", "connect"]

logger = logging.getLogger(__name__)

_CURVES: dict[str, type[Curve]] = {"bezier": BezierCurve, "polychain": PolyChain}
_ALIGN = ("activation", "weight", None)


@dataclass
class ConnectResult:
    """What :func:`connect` returns; unpacks as ``aligned_state, curve, result``.

    Attributes
    ----------
    aligned_state : dict of str to torch.Tensor
        B's state permuted into A's basin (new tensors; B itself when ``align=None``).
    curve : BezierCurve or PolyChain
        The trained curve from A to ``aligned_state``.
    result : CurveResult
        Loss and accuracy along the trained curve.
    perms : dict of str to torch.Tensor or None
        The permutations applied to B (None when ``align=None``).
    history : list of float
        The mean training loss of each epoch.
    linear : CurveResult or None
        The straight line from A to ``aligned_state`` (the curve before training), when
        ``linear=True`` was passed.
    """

    aligned_state: dict[str, torch.Tensor]
    curve: Curve
    result: CurveResult
    perms: dict[str, torch.Tensor] | None = None
    history: list[float] = field(default_factory=list)
    linear: CurveResult | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.aligned_state, self.curve, self.result))


def _loaded_copy(model: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    clone = copy.deepcopy(model)
    clone.load_state_dict(state)
    return clone


def _align(model: nn.Module, state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor],
           align: str, data: Iterable[Any], spec: Any, align_batches: int | None, seed: int) -> dict:
    # Imported here: pyperm.nn imports this package, and its public names are complete
    # only once it has finished loading.
    import pyperm.nn as pnn

    if spec is None and callable(getattr(model, "permutation_spec", None)):
        spec = model.permutation_spec()
    if align == "activation":
        result = pnn.activation_matching(_loaded_copy(model, state_a), _loaded_copy(model, state_b), data, spec,
                                         max_batches=align_batches)
        return {"spec": result.spec, "perms": result.perms}
    if spec is None:
        _, first = next(iterate_batches(data, 1, "data"))
        spec = pnn.PermutationSpec.from_model(model, to_device(model_inputs(first, 0, "data"), module_device(model)))
    result = pnn.weight_matching(spec, state_a, state_b, seed=seed)
    return {"spec": spec, "perms": result.perms}


def connect(
    model: nn.Module,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any],
    *,
    epochs: int,
    lr: float,
    align: str | None = "activation",
    curve: str | type[Curve] = "bezier",
    num_bends: int = 1,
    optimizer: str | type[torch.optim.Optimizer] = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    seed: int = 0,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    test_data: Iterable[Any] | None = None,
    bn_data: Iterable[Any] | None = None,
    num_points: int = 21,
    spec: Any = None,
    align_data: Iterable[Any] | None = None,
    align_batches: int | None = None,
    linear: bool = False,
    progress: bool = False,
) -> ConnectResult:
    r"""Align model B to model A, learn a curve between them, and evaluate it (Tatro et al. section 3).

    Solves Tatro et al.'s eq. 5 the way the paper does: the permutation :math:`P` comes
    from neuron alignment (Algorithm 1, ``align="activation"``) or from weight matching
    (Git Re-Basin Algorithm 1, ``align="weight"``), then the curve
    :math:`r_\phi` from :math:`\theta_A` to :math:`P\theta_B` is trained with Algorithm 2
    (:func:`train_curve`) and evaluated with :func:`evaluate_curve`. ``align=None`` gives
    the unaligned curve of Garipov et al.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture of both endpoints; not modified.
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints' state dicts (``model.state_dict()`` keys); not modified.
    data : re-iterable of (inputs, targets, ...)
        Training batches: for the curve, for the alignment (unless ``align_data``), and
        for the BatchNorm statistics of each evaluated point (unless ``bn_data``).
    epochs, lr : int, float
        Curve training length and learning rate (the paper: 250 epochs of SGD at 1e-2).
    align : {"activation", "weight", None}, default "activation"
        How to find :math:`P` (see above).
    curve : {"bezier", "polychain"} or a curve class, default "bezier"
        The curve family.
    num_bends : int, default 1
        Bends of the curve.
    optimizer, momentum, weight_decay, seed, loss_fn
        Passed to :func:`train_curve` (``seed`` also seeds weight matching).
    test_data : re-iterable of batches, optional
        Where the curve is evaluated (default: ``data``).
    bn_data : re-iterable of batches, optional
        BatchNorm statistics of each evaluated point (default: ``data``).
    num_points : int, default 21
        Points of the evaluation.
    spec : PermutationSpec, optional
        The permutation groups; default ``model.permutation_spec()`` when the model has
        one, else traced (:meth:`PermutationSpec.from_model` on the first batch).
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
        ``aligned_state``, ``curve``, ``result`` (it unpacks as these three), plus
        ``perms``, ``history`` and ``linear``.

    Raises
    ------
    TypeError
        ``model`` is not a module, a state is not a mapping of str to tensors, ``curve``
        is not a name or curve class, or an argument of the steps has the wrong type.
    ValueError
        ``align`` or ``curve`` is unknown, the states do not pair up, or a step refuses
        its input (see :func:`train_curve`, :func:`evaluate_curve`,
        :func:`~pyperm.nn.activation_matching`, :func:`~pyperm.nn.weight_matching`).

    References
    ----------
    .. [1] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment",
       NeurIPS 2020, eq. 5, Algorithms 1-2, Table 1.
    .. [2] S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin", ICLR 2023, Algorithm 1.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import connect
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: torch.randn_like(v) for k, v in a.items()}
    >>> data = [(torch.randn(32, 4), torch.randint(0, 3, (32,))) for _ in range(4)]
    >>> aligned, curve, result = connect(net, a, b, data, epochs=1, lr=0.01, align="weight", num_points=3)
    >>> result.ts.tolist()
    [0.0, 0.5, 1.0]
    """
    check_module(model, "model")
    check_pair(state_a, state_b)
    if align not in _ALIGN:
        raise ValueError(f"align must be 'activation', 'weight' or None, got {align!r}")
    if isinstance(curve, str):
        if curve not in _CURVES:
            raise ValueError(f"curve must be 'bezier', 'polychain' or a curve class, got {curve!r}")
        curve_cls = _CURVES[curve]
    elif isinstance(curve, type) and issubclass(curve, Curve):
        curve_cls = curve
    else:
        raise TypeError(f"curve must be 'bezier', 'polychain' or a curve class, got {type(curve).__name__}")
    if not isinstance(linear, bool):
        raise TypeError(f"linear must be a bool, got {type(linear).__name__}")

    perms = None
    aligned: dict[str, torch.Tensor]
    if align is None:
        aligned = dict(state_b)
    else:
        import pyperm.nn as pnn

        found = _align(model, state_a, state_b, align, data if align_data is None else align_data, spec,
                       align_batches, seed)
        perms = found["perms"]
        aligned = pnn.apply_permutation(found["spec"], perms, state_b)
    path = curve_cls(model, state_a, aligned, num_bends=num_bends)
    test_data = data if test_data is None else test_data
    bn_data = data if bn_data is None else bn_data
    before = evaluate_curve(path, test_data, num_points=num_points, bn_data=bn_data, loss_fn=loss_fn,
                            progress=progress) if linear else None
    history = train_curve(path, data, epochs=epochs, lr=lr, optimizer=optimizer, momentum=momentum,
                          weight_decay=weight_decay, seed=seed, loss_fn=loss_fn, progress=progress)
    result = evaluate_curve(path, test_data, num_points=num_points, bn_data=bn_data, loss_fn=loss_fn,
                            progress=progress)
    logger.info("connect(align=%s, curve=%s): average accuracy %.4g, min accuracy %.4g", align,
                curve_cls.__name__, result.average_accuracy, result.min_accuracy)
    return ConnectResult(aligned_state=aligned, curve=path, result=result, perms=perms, history=history,
                         linear=before)
