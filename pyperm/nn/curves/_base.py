r"""The shared machinery of parametric curves between two trained models.

A curve :math:`r_\phi : [0, 1] \to \mathbb{R}^N` is written as a weighted sum of its
control points, the two fixed endpoints :math:`\theta_A = P_0`, :math:`\theta_B = P_{K+1}`
and :math:`K` trainable bends :math:`P_1, \dots, P_K`:

.. math::

    r_\phi(t) = \sum_{j=0}^{K+1} w_j(t)\, P_j, \qquad \sum_j w_j(t) = 1,\quad
    w(0) = e_0,\quad w(1) = e_{K+1}.

The subclasses only say what the weights are (Bernstein polynomials for
:class:`~pyperm.nn.curves.BezierCurve`, hat functions for
:class:`~pyperm.nn.curves.PolyChain`). Everything else lives here: the state of the
user's model, split into entries that move along the curve (floating-point parameters),
entries that follow the straight line (floating-point buffers: BatchNorm running
statistics, which evaluation recomputes anyway), and entries copied from A (integer
buffers such as ``num_batches_tracked``); flat storage of each kind, so that one curve
point costs a handful of vector operations whatever the number of layers; and the forward
pass through :func:`torch.func.functional_call`, which runs the user's model, unchanged,
on the weights of the point.

References
----------
.. [1] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss Surfaces,
   Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018, section 3.
.. [2] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing Mode
   Connectivity via Neuron Alignment", NeurIPS 2020, section 2.1, eq. 5 and 7.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pyperm._checks import check_int, check_positive_int
from pyperm.nn._checks import check_module, check_pair, check_state, check_t
from pyperm.nn._runtime import training_flags
from pyperm.nn.state import is_mixable

__all__ = ["Curve"]

# How an entry of the state moves along the curve (see the module docstring).
_CURVE, _LINEAR, _FIXED = "curve", "linear", "fixed"


class _Group(nn.Module):
    """The entries of one kind, dtype and device, stored as flat vectors.

    ``start``/``end`` are buffers (fixed, moved by ``.to()``, saved with the curve);
    the bends of a ``"curve"`` group are one flat :class:`~torch.nn.Parameter` each.
    """

    def __init__(self, kind: str, keys: list[str], start: torch.Tensor, end: torch.Tensor, num_bends: int) -> None:
        super().__init__()
        self.kind = kind
        self.keys = keys
        self.shapes = [s.shape for s in start]
        self.numels = [s.numel() for s in start]
        flat_a = torch.cat([s.reshape(-1) for s in start]) if len(start) > 1 else start[0].reshape(-1).clone()
        self.register_buffer("start", flat_a)
        if kind == _FIXED:
            self.end = None
            self.bends = nn.ParameterList()
            return
        flat_b = torch.cat([s.reshape(-1) for s in end]) if len(end) > 1 else end[0].reshape(-1).clone()
        self.register_buffer("end", flat_b)
        bends = []
        if kind == _CURVE:
            # Bends equispaced on the segment A-B: with them a Bezier curve and a polygonal
            # chain both *are* the straight line (1 - t) A + t B (Bernstein polynomials
            # reproduce linear functions), the initialisation of Algorithm 2.
            for k in range(1, num_bends + 1):
                s = k / (num_bends + 1)
                bends.append(nn.Parameter(torch.lerp(flat_a, flat_b, s) if flat_a.is_floating_point()
                                          else (1 - s) * flat_a + s * flat_b))
        self.bends = nn.ParameterList(bends)

    def combine(self, weights: Sequence[float], t: float) -> torch.Tensor:
        """The flat entries at a point of the curve (differentiable in the bends)."""
        if self.kind == _FIXED:
            # A copy: BatchNorm in train mode increments num_batches_tracked in place.
            return self.start.clone()
        if self.kind == _LINEAR:
            terms = [(1.0 - t, self.start), (t, self.end)]
        else:
            terms = [(weights[0], self.start), (weights[-1], self.end)]
            terms += [(w, bend) for w, bend in zip(weights[1:-1], self.bends)]
        out = None
        for w, tensor in terms:
            if w == 0.0:
                continue  # exact endpoints at t = 0 and 1; no graph for bends off the segment
            out = tensor * w if out is None else out.add(tensor, alpha=w)
        return out if out is not None else torch.zeros_like(self.start)

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The entries of a flat vector: views, one per key, in the entries' shapes."""
        return {k: v.view(shape) for k, v, shape in zip(self.keys, flat.split(self.numels), self.shapes)}


class Curve(nn.Module):
    r"""A curve of networks between two trained models of one architecture (base class).

    The curve owns three kinds of tensors: the fixed endpoints (buffers, not in
    :meth:`parameters`), the bends (the only :class:`~torch.nn.Parameter`\ s, initialised
    on the straight line from A to B), and nothing of the model itself: ``model`` is a
    template run through :func:`torch.func.functional_call` with the weights of the point
    ``t``; its own tensors are never used (except non-persistent buffers) and never changed.

    Subclasses define :meth:`weights`.

    ``curve.to(device_or_dtype)`` moves the endpoints and bends; the point's tensors then
    live there and replace the model's parameters and persistent buffers in the forward,
    wherever the model itself is (its non-persistent buffers, if any, must be on the same
    device as the curve).

    Parameters
    ----------
    model : torch.nn.Module
        The architecture. Kept by reference, not as a submodule: the curve's
        :meth:`parameters`, ``state_dict`` and ``.to()`` do not include it.
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints: ``model.state_dict()``-shaped, with the same keys, shapes, dtypes
        and devices. Copied: later changes to them do not affect the curve.
    num_bends : int, default 1
        Number of trainable bends :math:`K \geq 1`.

    Attributes
    ----------
    num_bends : int
        :math:`K`.
    keys : tuple of str
        The state-dict keys, in the order of ``state_a``.
    """

    def __init__(self, model: nn.Module, state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor],
                 *, num_bends: int = 1) -> None:
        super().__init__()
        check_module(model, "model")
        num_bends = check_positive_int(num_bends, "num_bends")
        check_pair(state_a, state_b)
        expected = model.state_dict(keep_vars=True)
        missing = [k for k in expected if k not in state_a]
        extra = [k for k in state_a if k not in expected]
        if missing or extra:
            raise ValueError(
                f"state_a does not match model.state_dict(): missing keys {missing[:5]}, unexpected keys {extra[:5]}"
            )
        for key, ref in expected.items():
            if isinstance(ref, torch.Tensor) and tuple(state_a[key].shape) != tuple(ref.shape):
                raise ValueError(f"state_a[{key!r}] has shape {tuple(state_a[key].shape)}; the model's is "
                                 f"{tuple(ref.shape)}")
        # Kept outside the module tree on purpose (see the class docstring).
        object.__setattr__(self, "_model", model)
        # Its modules, whose train/eval flags the forward compares with the curve's (see _run_and_sq_norm).
        self._model_modules = tuple(model.modules())
        self.num_bends = num_bends
        self.keys = tuple(state_a)

        # Each parameter/buffer is stored once, under its first name; tied weights and other
        # aliases in the state dict map to that name.
        canonical: dict[int, str] = {}
        kinds: dict[str, str] = {}
        for name, p in model.named_parameters():
            canonical.setdefault(id(p), name)
            kinds[name] = _CURVE if is_mixable(p) else _FIXED
        for name, b in model.named_buffers():
            canonical.setdefault(id(b), name)
            kinds.setdefault(name, _LINEAR if is_mixable(b) else _FIXED)
        self._alias: dict[str, str] = {}
        for key, ref in expected.items():
            name = canonical.get(id(ref))
            if name is None:  # a tensor the model saves outside its parameters and buffers
                self._alias[key] = key
                kinds[key] = _FIXED
            elif name in state_a:
                self._alias[key] = name
            else:  # pragma: no cover - a state dict lists every parameter and persistent buffer
                raise ValueError(f"model parameter {name!r} is not in state_a")
        # Every name the forward looks tensors up by, aliases included, resolved once here so
        # that functional_call need not search for tied weights at every step
        # (tie_weights=False); non-persistent buffers stay the model's own.
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        self._call_names = [(name, canonical[id(t)]) for name, t in named if canonical[id(t)] in state_a]

        # One flat group per (kind, dtype, device): one curve point is a few vector ops.
        buckets: dict[tuple[str, torch.dtype, torch.device], list[str]] = {}
        for key in self.keys:
            if self._alias[key] != key:
                continue
            t = state_a[key]
            buckets.setdefault((kinds[key], t.dtype, t.device), []).append(key)
        groups = []
        with torch.no_grad():
            for (kind, _, _), keys in buckets.items():
                start = [state_a[k].detach() for k in keys]
                end = [state_b[k].detach() for k in keys]
                groups.append(_Group(kind, keys, start, end, num_bends))
        self.groups = nn.ModuleList(groups)
        if not any(g.kind == _CURVE for g in self.groups):
            raise ValueError("model has no floating-point parameters: there is nothing for a curve to move")

    # ------------------------------------------------------------------ the curve

    def weights(self, t: float) -> list[float]:
        r"""The weights :math:`w_0(t), \dots, w_{K+1}(t)` of A, the bends and B (sum 1)."""
        raise NotImplementedError

    @property
    def model(self) -> nn.Module:
        """The user's model (the architecture the curve runs)."""
        return self._model

    @property
    def bend_keys(self) -> tuple[str, ...]:
        """The state-dict keys a bend holds: the model's floating-point parameters (tied
        weights once, under their first name), in the order of ``state_a``."""
        held = {k for g in self.groups if g.kind == _CURVE for k in g.keys}
        return tuple(k for k in self.keys if k in held)

    def bends(self) -> list[torch.nn.Parameter]:
        """The trainable tensors: bend ``k`` of every flat group, bend by bend."""
        return [g.bends[k] for k in range(self.num_bends) for g in self.groups if g.kind == _CURVE]

    def active_parameters(self, t: float) -> list[torch.nn.Parameter]:
        """The bends with a non-zero weight at ``t`` (those a loss at ``t`` reaches)."""
        w = self.weights(check_t(t))
        return [bend for g in self.groups for k, bend in enumerate(g.bends) if w[k + 1] != 0.0]

    def _flat_state(self, t: float) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer at ``t``, once each (differentiable)."""
        w = self.weights(t)
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            out.update(g.split(g.combine(w, t)))
        return out

    def state_at(self, t: float) -> dict[str, torch.Tensor]:
        r"""The state dict of the network :math:`r_\phi(t)`.

        Parameters
        ----------
        t : float
            A point of the curve, in [0, 1].

        Returns
        -------
        dict of str to torch.Tensor
            New tensors (detached), keyed like ``state_a``: floating-point parameters on
            the curve, floating-point buffers on the straight line
            :math:`(1 - t)\,A + t\,B` (BatchNorm statistics of the point must be
            recomputed: :func:`~pyperm.nn.eval.batchnorm.reset_bn_stats`), integer buffers
            copied from A. ``model.load_state_dict`` accepts it; ``t = 0`` and ``t = 1``
            give A and B exactly.
        """
        t = check_t(t)
        with torch.no_grad():
            flat = self._flat_state(t)
        return {key: flat[self._alias[key]] for key in self.keys}

    def _check_index(self, index: Any) -> int:
        """``index`` as the number of a bend, in ``[0, num_bends)``."""
        index = check_int(index, "index", 0)
        if index >= self.num_bends:
            raise ValueError(f"index must be in [0, {self.num_bends}), got {index}")
        return index

    def bend_state(self, index: int) -> dict[str, torch.Tensor]:
        """The state dict of bend ``index`` (0-based): a control point, not a point of the curve.

        Floating-point buffers are those of the straight line at the bend's knot
        ``(index + 1) / (num_bends + 1)`` and integer buffers are A's.
        """
        index = self._check_index(index)
        s = (index + 1) / (self.num_bends + 1)
        flat: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for g in self.groups:
                if g.kind == _CURVE:
                    flat.update(g.split(g.bends[index].detach().clone()))
                else:
                    flat.update(g.split(g.combine((), s)))
        return {key: flat[self._alias[key]] for key in self.keys}

    def set_bend_state(self, index: int, state: Mapping[str, torch.Tensor]) -> None:
        """Set bend ``index`` (0-based) from a model-shaped state dict: the inverse of :meth:`bend_state`.

        Parameters
        ----------
        index : int
            The bend, in ``[0, num_bends)``.
        state : mapping of str to torch.Tensor
            Keyed like ``model.state_dict()``: a value for every floating-point parameter
            of the model (the entries a bend holds), in the model's shapes; converted to
            the bend's dtype and device. Entries a bend does not hold (buffers such as
            BatchNorm running statistics, integer entries) may be present and are ignored,
            so ``curve.set_bend_state(k, curve.bend_state(k))`` changes nothing, and a
            bend saved as a whole model checkpoint (Tatro et al.'s code saves the curve's
            middle control point so) loads as it is.

        Raises
        ------
        TypeError
            ``state`` is not a mapping of str to tensors, or ``index`` not an int.
        ValueError
            ``index`` is out of range, a parameter is missing or has another shape, a
            key is not one of the model's, or a value is not finite.
        """
        index = self._check_index(index)
        check_state(state, "state")
        unknown = [k for k in state if k not in self._alias]
        if unknown:
            raise ValueError(f"state has keys that are not in the model's state dict: {unknown[:5]}")
        flats = []
        for g in self.groups:
            if g.kind != _CURVE:
                continue
            parts = []
            for key, shape in zip(g.keys, g.shapes):
                value = state.get(key)
                if value is None:
                    raise ValueError(f"state has no {key!r}: a bend needs every floating-point parameter of the model")
                if tuple(value.shape) != tuple(shape):
                    raise ValueError(f"state[{key!r}] has shape {tuple(value.shape)}; the model's is {tuple(shape)}")
                parts.append(value.detach().reshape(-1).to(device=g.start.device, dtype=g.start.dtype))
            flat = torch.cat(parts)
            if flat.is_floating_point() and not bool(torch.isfinite(flat).all()):
                raise ValueError("state holds non-finite values in the bend's parameters")
            flats.append((g.bends[index], flat))
        # Checked in full before anything changes: a refused state leaves the curve as it was.
        with torch.no_grad():
            for bend, flat in flats:
                bend.copy_(flat)

    def point_sq_norm(self, t: float) -> torch.Tensor:
        r"""The squared norm :math:`\|r_\phi(t)\|^2` of the trainable weights of the point
        (every floating-point parameter of the model, no buffer), differentiable in the
        bends: the term of Garipov et al.'s regulariser (see :func:`~pyperm.nn.curves.train_curve`)."""
        return self._run_and_sq_norm(None, check_t(t))[1]

    def _run_and_sq_norm(self, x: Any, t: float, *, norm: bool = True) -> tuple[Any, torch.Tensor | None]:
        """The model's output at ``t`` (None when ``x`` is None) and, with ``norm``, the point's
        squared parameter norm, both from one evaluation of the point's flat weights."""
        w = self.weights(t)
        flat: dict[str, torch.Tensor] = {}
        sq_norm = None
        for g in self.groups:
            if x is None and g.kind != _CURVE:
                continue  # the norm alone reads only the trainable weights
            values = g.combine(w, t)
            if norm and g.kind == _CURVE:
                # One flat vector per group: the norm is one reduction, not one per layer.
                s = values.square().sum()
                sq_norm = s if sq_norm is None else sq_norm + s.to(sq_norm.device)
            flat.update(g.split(values))
        if x is None:
            return None, sq_norm
        state = {name: flat[key] for name, key in self._call_names}
        args = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        if all(m.training == self.training for m in self._model_modules):
            # The usual case, checked first: setting and restoring every flag cost a tenth of a
            # digits CNN's training step (40 us).
            out = torch.func.functional_call(self._model, state, args, strict=False, tie_weights=False)
        else:
            with training_flags(self._model, train=self.training):
                out = torch.func.functional_call(self._model, state, args, strict=False, tie_weights=False)
        return out, sq_norm

    def forward(self, x: Any, t: float) -> Any:
        r"""The model's output at :math:`r_\phi(t)`: ``model(x)`` run with the point's weights.

        Parameters
        ----------
        x : torch.Tensor or tuple
            The model's input, or a tuple of its positional inputs.
        t : float
            The point, in [0, 1].

        Notes
        -----
        The model runs in the curve's mode (``curve.train()``/``curve.eval()``); every
        module's own flag is put back afterwards. In train mode BatchNorm uses batch
        statistics (as Algorithm 2 does); the running statistics it updates are those of
        the point, discarded after the call. In eval mode the running statistics are the
        straight line's, which are not the statistics of the network at ``t``: evaluate
        with :func:`~pyperm.nn.curves.evaluate_curve`, which recomputes them.
        """
        return self._run_and_sq_norm(x, check_t(t), norm=False)[0]

    def extra_repr(self) -> str:
        sizes = sum(g.start.numel() for g in self.groups if g.kind == _CURVE)
        return f"model={type(self._model).__name__}, num_bends={self.num_bends}, parameters_per_point={sizes}"


def binomial_weights(t: float, degree: int) -> list[float]:
    """Bernstein basis polynomials of ``degree`` at ``t`` (exact 0/1 at the ends)."""
    return [math.comb(degree, j) * t**j * (1.0 - t) ** (degree - j) for j in range(degree + 1)]
