r"""Curves trained with Garipov et al.'s public code (``dnn-mode-connectivity``), as pyperm curves.

That code (which Tatro et al. build on) trains a ``CurveNet``: every layer of the model
rebuilt with one copy of each parameter per control point, ``<layer>.<name>_<k>`` for
control point ``k`` of ``n`` (``k = 0`` the start, ``n - 1`` the end, the others the
bends), under a ``net.`` prefix, beside the curve's coefficient buffers
(``coeff_layer.binom``, ``coeff_layer.range``, ``coeff_layer.rev_range`` for a Bezier
curve, ``coeff_layer.range`` alone for a polygonal chain). Its ``train.py`` saves
``{"epoch", "model_state", "optimizer_state"}`` with :func:`torch.save`.

:func:`load_garipov_curve` reads such a checkpoint given the *base* model (the plain
architecture): the control points of each parameter become the endpoints and bends of a
:class:`~pyperm.nn.curves.BezierCurve` or :class:`~pyperm.nn.curves.PolyChain` with the
same weights :math:`w_j(t)` (the same Bernstein polynomials, the same hat functions on
equispaced knots), so the two compute the same network at every ``t``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pyperm.nn._checks import check_module, check_state
from pyperm.nn.curves._base import Curve
from pyperm.nn.curves.checkpoint import CURVE_KINDS
from pyperm.nn.state import is_mixable

__all__ = ["load_garipov_curve"]

# The last component of a control point's name: "<parameter>_<k>".
_CONTROL_POINT = re.compile(r"^(?P<name>.+)_(?P<k>\d+)$")
_PREFIX = "net."


def _read(source: Any) -> Mapping[str, torch.Tensor]:
    """The CurveNet state dict in ``source``: a checkpoint file, the checkpoint's dict, or the state dict."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        try:
            # weights_only: a checkpoint cannot run code. The optimizer state loads as plain data.
            source = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"{path}: not a readable torch checkpoint ({' '.join(str(exc).split())})") from exc
    if not isinstance(source, Mapping):
        raise TypeError(f"source must be a checkpoint path, or a mapping (the checkpoint or its 'model_state'), "
                        f"got {type(source).__name__}")
    state = source.get("model_state", source)
    return check_state(state, "source's model_state")


def _control_points(state: Mapping[str, torch.Tensor]) -> dict[str, dict[int, torch.Tensor]]:
    """``{parameter name without the ``_<k>`` suffix: {k: tensor}}``, in the file's order."""
    points: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        head, _, last = key.rpartition(".")
        match = _CONTROL_POINT.match(last)
        if match is None or not value.is_floating_point() or key.startswith("coeff_layer."):
            continue  # buffers (BatchNorm statistics of the CurveNet) and the coefficients' buffers
        name = f"{head}.{match['name']}" if head else match["name"]
        points.setdefault(name, {})[int(match["k"])] = value
    if not points:
        raise ValueError("source holds no control points (parameters named '<layer>.<name>_<k>'): not a checkpoint "
                         "of Garipov et al.'s CurveNet")
    return points


def _kind(state: Mapping[str, torch.Tensor], kind: str | None) -> str:
    if kind is not None:
        if kind not in CURVE_KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, CURVE_KINDS))}, got {kind!r}")
        return kind
    if "coeff_layer.binom" in state:
        return "bezier"
    if "coeff_layer.range" in state:
        return "polychain"
    raise ValueError("source has no coeff_layer buffers to tell a Bezier curve from a polygonal chain: pass kind=")


def _match(points: dict[str, dict[int, torch.Tensor]], model: nn.Module) -> list[tuple[str, str]]:
    """Pairs (reference name, model parameter name): by name when the names agree, else in
    order (the reference's own ``import_base_parameters`` convention), shapes checked."""
    params = [(name, p) for name, p in model.named_parameters() if is_mixable(p)]
    if len(params) != len(points):
        raise ValueError(f"source has control points for {len(points)} parameters; the model has {len(params)} "
                         "floating-point parameters")
    # The CurveNet keeps the architecture under "net."; a curve architecture that mirrors the
    # base model's layer names then matches it name for name.
    stripped = {(name[len(_PREFIX):] if name.startswith(_PREFIX) else name): name for name in points}
    if set(stripped) == {name for name, _ in params}:
        pairs = [(stripped[name], name) for name, _ in params]
    else:
        pairs = list(zip(points, (name for name, _ in params)))
    shapes = dict(params)
    for ref, ours in pairs:
        got = tuple(next(iter(points[ref].values())).shape)
        want = tuple(shapes[ours].shape)
        if got != want:
            raise ValueError(f"source's {ref!r} (shape {got}) does not fit the model's {ours!r} (shape {want}); "
                             "the base model must be the architecture the curve was trained on")
    return pairs


def load_garipov_curve(source: str | Path | Mapping[str, Any], model: nn.Module, *, kind: str | None = None,
                       state_a: Mapping[str, torch.Tensor] | None = None,
                       state_b: Mapping[str, torch.Tensor] | None = None) -> Curve:
    r"""A curve saved by Garipov et al.'s ``dnn-mode-connectivity`` code, as a pyperm curve.

    Parameters
    ----------
    source : str, pathlib.Path or mapping
        A checkpoint of that code's ``train.py`` (``{"epoch", "model_state", ...}``), the
        loaded dict, or its ``model_state``: the ``CurveNet``'s state dict, whose
        parameter ``<layer>.<name>_<k>`` is control point ``k`` of ``n`` (``k = 0`` and
        ``n - 1`` the endpoints). Read with ``weights_only=True``.
    model : torch.nn.Module
        The base model: the plain architecture whose floating-point parameters the
        control points are. Control points are matched to its parameters by name
        (``net.`` and the ``_<k>`` suffix dropped) when the names agree, else in order
        (the reference's ``import_base_parameters`` convention), shapes checked.
    kind : {"bezier", "polychain"}, optional
        The curve's family; by default read from the ``coeff_layer`` buffers.
    state_a, state_b : mapping of str to torch.Tensor, optional
        The endpoints' own state dicts, for their buffers (BatchNorm running
        statistics; the CurveNet keeps one set for the whole curve, which describes no
        point). Their parameters are replaced by the checkpoint's first and last control
        points. By default the buffers are the model's own: the running statistics of
        a point are recomputed by :func:`~pyperm.nn.curves.evaluate_curve` anyway.

    Returns
    -------
    BezierCurve or PolyChain
        ``n - 2`` bends; the same network as the reference's curve at every ``t`` (in
        the dtype of the model's parameters, or of ``state_a`` when given).

    Raises
    ------
    TypeError
        ``model`` is not a module, ``source`` not a path or mapping.
    ValueError
        ``source`` has no control points, not the same number for every parameter,
        fewer than three (no bend), or parameters that do not fit ``model`` (the message
        names them); the kind cannot be told and ``kind`` is not given.

    Notes
    -----
    Tatro et al.'s code saves only the middle control point of a quadratic Bezier curve,
    as a checkpoint of the base model; load it with
    ``curve = BezierCurve(model, a, b_aligned)`` and
    ``curve.set_bend_state(0, torch.load(path)["model_state"])``.

    References
    ----------
    .. [1] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss
       Surfaces, Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018; code:
       github.com/timgaripov/dnn-mode-connectivity (``curves.py``).
    .. [2] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing
       Mode Connectivity via Neuron Alignment", NeurIPS 2020; code: github.com/IBM/NeuronAlignment.
    """
    check_module(model, "model")
    state = _read(source)
    points = _control_points(state)
    curve_cls = CURVE_KINDS[_kind(state, kind)]
    counts = {name: sorted(ks) for name, ks in points.items()}
    n = len(next(iter(counts.values())))
    for name, ks in counts.items():
        if ks != list(range(n)):
            raise ValueError(f"source's {name!r} has control points {ks}; every parameter needs 0..{n - 1}")
    if n < 3:
        raise ValueError(f"source has {n} control points per parameter: a curve needs at least 3 (one bend)")
    pairs = _match(points, model)

    def endpoint(given: Mapping[str, torch.Tensor] | None, k: int, name: str) -> dict[str, torch.Tensor]:
        """The endpoint's state: its buffers (given, or the model's), the control point ``k`` as its parameters."""
        base = model.state_dict() if given is None else check_state(given, name)
        out = {key: v.detach().clone() for key, v in base.items()}
        for ref, ours in pairs:
            if ours not in out:
                raise ValueError(f"{name} has no {ours!r}")
            out[ours] = points[ref][k].to(device=out[ours].device, dtype=out[ours].dtype)
        return out

    curve = curve_cls(model, endpoint(state_a, 0, "state_a"), endpoint(state_b, n - 1, "state_b"), num_bends=n - 2)
    for k in range(1, n - 1):
        curve.set_bend_state(k - 1, {ours: points[ref][k] for ref, ours in pairs})
    return curve
