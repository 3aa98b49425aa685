r"""A trained curve in a file: :func:`save_curve` and :func:`load_curve` (safetensors).

The file holds what a curve adds to its two endpoints, in the model's own terms, so that
any safetensors reader can use it:

- tensors ``bends.<k>.<key>``: bend ``k`` (from 0) as a model-shaped state dict, one entry
  per floating-point parameter of the model (:attr:`~pyperm.nn.curves.BezierCurve.bend_keys`),
  in the curve's dtype;
- optionally ``a.<key>`` and ``b.<key>``: the endpoints' whole state dicts, so that the
  file alone rebuilds the curve;
- string metadata: ``format`` (``"pyperm.curve"``), ``format_version`` (``"1"``), ``kind``
  (``"bezier"`` or ``"polychain"``), ``num_bends``, ``model`` (the model's name as
  :func:`pyperm.nn.models.create_model` reads it, when known), ``model_class``, and
  ``endpoint_a`` / ``endpoint_b``: SHA-256 fingerprints of the endpoints (every key,
  dtype, shape and byte of their state dicts), checked on loading so that a curve is
  never put between endpoints other than its own.

A bend is stored bit for bit: ``load_curve(save_curve(curve, ...), ...)`` gives the same
bends, the same points and the same outputs. The file is read and written by
:mod:`pyperm.checkpoints` (pyperm's one code path for safetensors: the library's strict,
lazy reader; a writer staged beside the destination and renamed into place).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pyperm._checks import check_bool
from pyperm._staging import write_file
from pyperm.checkpoints import read_safetensors, read_safetensors_metadata, write_safetensors
from pyperm.nn._checks import check_module, check_state
from pyperm.nn.curves._base import Curve
from pyperm.nn.curves.bezier import BezierCurve
from pyperm.nn.curves.polychain import PolyChain
from pyperm.nn.curves.train import check_curve

__all__ = ["CURVE_KINDS", "curve_kind", "load_curve", "read_curve_metadata", "save_curve", "state_fingerprint"]

logger = logging.getLogger(__name__)

FORMAT = "pyperm.curve"
FORMAT_VERSION = "1"
CURVE_KINDS: dict[str, type[Curve]] = {"bezier": BezierCurve, "polychain": PolyChain}


def _check_path(path: Any, name: str = "path") -> Path:
    if not isinstance(path, (str, Path)):
        raise TypeError(f"{name} must be a str or pathlib.Path, got {type(path).__name__}")
    return Path(path)


def curve_kind(curve: Curve) -> str:
    """The name of ``curve``'s family in :data:`CURVE_KINDS` (``"bezier"`` or ``"polychain"``)."""
    check_curve(curve)
    for name, cls in CURVE_KINDS.items():
        if type(curve) is cls:
            return name
    raise TypeError(f"only BezierCurve and PolyChain curves have a file format, got {type(curve).__name__}")


def state_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a state dict: its keys in sorted order, each entry's dtype, shape and bytes.

    Two state dicts have one fingerprint when they hold the same tensors, bit for bit,
    wherever they live (the bytes are read on the CPU).
    """
    check_state(state, "state")
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key].detach()
        digest.update(f"{key}\0{value.dtype}\0{tuple(value.shape)}\0".encode())
        # As raw bytes: numpy has no bfloat16, and the bytes are what "the same tensor" means.
        digest.update(value.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_curve(curve: Curve, path: str | Path, *, model_name: str | None = None, endpoints: bool = False) -> Path:
    r"""Write a curve's bends, its kind, number of bends, model and endpoints' fingerprints to a safetensors file.

    Parameters
    ----------
    curve : BezierCurve or PolyChain
        The curve (trained or not).
    path : str or pathlib.Path
        The file to write (``.safetensors`` by convention); its folder must exist. An
        existing file is replaced in one rename, never partly and never through a symlink
        (the file is staged beside it first).
    model_name : str, optional
        The model's name as :func:`pyperm.nn.models.create_model` reads it (e.g.
        ``"resnet20:4"``; the ``--model`` of the command line): with it,
        :func:`load_curve` can build the model itself.
    endpoints : bool, default False
        Also store both endpoints' state dicts (``a.<key>``, ``b.<key>``), so that the
        file alone rebuilds the curve; without them the file holds the bends only and
        :func:`load_curve` needs the endpoints.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    TypeError
        ``curve`` is not a BezierCurve or PolyChain, ``path`` not a path, ``model_name``
        not a str, or ``endpoints`` not a bool.

    See Also
    --------
    load_curve : the inverse.
    BezierCurve.bend_state, BezierCurve.set_bend_state : one bend as a model-shaped state dict.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import BezierCurve, load_curve, save_curve
    >>> net = torch.nn.Linear(3, 2)
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: -v for k, v in a.items()}
    >>> curve = BezierCurve(net, a, b)
    >>> save_curve(curve, "curve.safetensors")  # doctest: +SKIP
    PosixPath('curve.safetensors')
    >>> again = load_curve("curve.safetensors", net, a, b)  # doctest: +SKIP
    """
    kind = curve_kind(curve)
    path = _check_path(path)
    if model_name is not None and not isinstance(model_name, str):
        raise TypeError(f"model_name must be a str or None, got {type(model_name).__name__}")
    endpoints = check_bool(endpoints, "endpoints")
    keys = curve.bend_keys
    tensors: dict[str, torch.Tensor] = {}
    for k in range(curve.num_bends):
        bend = curve.bend_state(k)
        # Copies: the entries of a bend are views of one flat vector, which safetensors refuses
        # as shared memory.
        tensors.update({f"bends.{k}.{key}": bend[key].to("cpu", copy=True) for key in keys})
    state_a, state_b = curve.state_at(0.0), curve.state_at(1.0)
    if endpoints:
        tensors.update({f"a.{key}": v.to("cpu", copy=True) for key, v in state_a.items()})
        tensors.update({f"b.{key}": v.to("cpu", copy=True) for key, v in state_b.items()})
    model = curve.model
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "num_bends": str(curve.num_bends),
        "model": model_name or "",
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "endpoint_a": state_fingerprint(state_a),
        "endpoint_b": state_fingerprint(state_b),
        "endpoints_stored": "1" if endpoints else "0",
    }
    names = {key: key for key in tensors}
    return write_file(path, lambda f: write_safetensors(f, names, tensors, metadata, path))


def read_curve_metadata(path: str | Path) -> dict[str, str]:
    """The metadata of a curve file written by :func:`save_curve` (no tensor is read).

    Raises
    ------
    ValueError
        The file is not a safetensors file, or not a pyperm curve (the message says so,
        and points to :func:`~pyperm.nn.curves.load_garipov_curve` for the reference
        implementation's checkpoints), or of a newer format version.
    """
    path = _check_path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    metadata = read_safetensors_metadata(path)  # a CheckpointError (a ValueError) names the file
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: not a pyperm curve file (no format={FORMAT!r} in its metadata); a checkpoint of "
                         "Garipov et al.'s dnn-mode-connectivity loads with load_garipov_curve")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: curve file format version {metadata.get('format_version')!r}; this pyperm reads "
                         f"version {FORMAT_VERSION}")
    return metadata


def load_curve(path: str | Path, model: nn.Module | None = None, state_a: Mapping[str, torch.Tensor] | None = None,
               state_b: Mapping[str, torch.Tensor] | None = None, *, check_endpoints: bool = True) -> Curve:
    r"""Read a curve written by :func:`save_curve`: the same kind, number of bends and bends, bit for bit.

    Parameters
    ----------
    path : str or pathlib.Path
        The curve file.
    model : torch.nn.Module, optional
        The architecture. By default built from the model name in the file
        (:func:`pyperm.nn.models.create_model`), when :func:`save_curve` was given one.
    state_a, state_b : mapping of str to torch.Tensor, optional
        The endpoints, as the curve was built with them (same dtypes; any device: the
        curve lives where they are). By default those stored in the file
        (``save_curve(..., endpoints=True)``).
    check_endpoints : bool, default True
        Refuse endpoints whose fingerprints differ from those in the file (another
        model, another alignment of B, another dtype): the bends of a curve mean nothing
        between other endpoints.

    Returns
    -------
    BezierCurve or PolyChain

    Raises
    ------
    TypeError
        An argument has the wrong type.
    ValueError
        The file is not a pyperm curve file; no model or no endpoints are given and the
        file has none; the bends do not fit the model (the message names the key); an
        endpoint's fingerprint differs from the file's (with ``check_endpoints``). A file
        the safetensors library refuses (or a missing safetensors package) is a
        :class:`~pyperm.checkpoints.CheckpointError`, a ValueError naming the file.
    """
    metadata = read_curve_metadata(path)
    check_endpoints = check_bool(check_endpoints, "check_endpoints")
    kind, name = metadata.get("kind"), metadata.get("model", "")
    if kind not in CURVE_KINDS:
        raise ValueError(f"{path}: unknown curve kind {kind!r} (expected one of {list(CURVE_KINDS)})")
    try:
        num_bends = int(metadata["num_bends"])
    except (KeyError, ValueError):
        raise ValueError(f"{path}: no valid num_bends in its metadata") from None
    if model is None:
        if not name:
            raise ValueError(f"{path}: the file names no model; pass the model")
        from pyperm.nn.models import create_model

        model = create_model(name)
    check_module(model, "model")
    tensors, _ = read_safetensors(Path(path), mmap=False)
    # In the model's order (a safetensors file lists its keys sorted): the curve lays out its
    # flat vectors in the order of state_a.
    order = {key: i for i, key in enumerate(model.state_dict())}
    stored = {
        side: dict(sorted(((k[2:], v) for k, v in tensors.items() if k.startswith(f"{side}.")),
                          key=lambda item: order.get(item[0], len(order))))
        for side in ("a", "b")
    }
    if state_a is None or state_b is None:
        if not stored["a"]:
            raise ValueError(f"{path}: the file holds no endpoints (saved without endpoints=True); pass state_a and "
                             "state_b")
        state_a = stored["a"] if state_a is None else state_a
        state_b = stored["b"] if state_b is None else state_b
    curve = CURVE_KINDS[kind](model, state_a, state_b, num_bends=num_bends)
    if check_endpoints:
        for side, t in (("a", 0.0), ("b", 1.0)):
            if state_fingerprint(curve.state_at(t)) != metadata.get(f"endpoint_{side}"):
                raise ValueError(
                    f"state_{side} is not the endpoint the curve in {path} was trained with (its fingerprint "
                    "differs: other weights, another alignment or another dtype); pass check_endpoints=False to "
                    "load the bends anyway"
                )
    for k in range(num_bends):
        prefix = f"bends.{k}."
        bend = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
        if not bend:
            raise ValueError(f"{path}: bend {k} of {num_bends} is missing")
        try:
            curve.set_bend_state(k, bend)
        except ValueError as exc:
            raise ValueError(f"{path}: bend {k} does not fit the model: {exc}") from exc
    return curve
