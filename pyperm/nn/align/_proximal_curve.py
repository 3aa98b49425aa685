r"""The pieces of PAM that run the network: the curve for a permutation or its relaxation, and the estimate of Q.

:class:`CurveFunction` is the network on the curve of Tatro et al. eq. 35,
:math:`r(t; \tilde\theta_c, X) = (1-t)\theta_A + tX\theta_B + 2t(1-t)\tilde\theta_c`, for a
permutation or a relaxed (doubly stochastic) :math:`X`; :class:`Judge` is :math:`\hat Q`, the
loss that judges the permutation step's candidates, over batches read once by
:func:`fixed_batches`; :func:`build_curve`, :func:`proximal_hooks` and :func:`keyed_offset`
are the curve step's pieces. The driver is :func:`pyperm.nn.align.proximal.pam`.

STE matching (:func:`pyperm.nn.align.ste.ste_matching`) judges its candidates with the
same :class:`Judge` at the one point :math:`t = 1/2` with no offset: the midpoint
:math:`\frac12(\theta_A + P\theta_B)` of Git Re-Basin's eq. 3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from pyperm.nn._runtime import inputs_and_targets, iterate_batches, to_device, training_flags
from pyperm.nn.curves.bezier import BezierCurve
from pyperm.nn.permutations import permute_entry
from pyperm.nn.spec import PermutationSpec
from pyperm.nn.state import is_mixable

__all__ = [
    "CurveFunction",
    "Judge",
    "build_curve",
    "cycle",
    "fixed_batches",
    "keyed_offset",
    "moved_units",
    "perms_key",
    "proximal_hooks",
]


class CurveFunction:
    r"""The network :math:`r(t; \tilde\theta_c, X) = (1-t)\theta_A + tX\theta_B + 2t(1-t)\tilde\theta_c`
    for a permutation or a relaxed (doubly stochastic) :math:`X`, run by ``functional_call``.

    Parameters move on the curve; floating-point buffers on the segment (no gradient);
    other buffers are A's (cloned per call: BatchNorm increments its counter in place).
    """

    def __init__(self, model: nn.Module, spec: PermutationSpec, sa: Mapping[str, torch.Tensor],
                 sb: Mapping[str, torch.Tensor], loss_fn: Callable[..., torch.Tensor]) -> None:
        self.model, self.spec, self.sa, self.sb, self.loss_fn = model, spec, sa, sb, loss_fn
        # functional_call takes each tensor once, under its first name (tied weights).
        self.params = [n for n, p in model.named_parameters() if is_mixable(p)]
        self.fixed_params = [n for n, p in model.named_parameters() if not is_mixable(p)]
        buffers = list(model.named_buffers())
        self.float_buffers = [n for n, b in buffers if is_mixable(b) and n in sa]
        self.int_buffers = [n for n, b in buffers if not is_mixable(b) and n in sa]
        moving = self.params + self.float_buffers
        self.permuted_keys = [k for k in moving if any(g is not None for g in spec.axes.get(k, ()))]

    def state(self, t: float, end: Mapping[str, torch.Tensor],
              offset: Mapping[str, torch.Tensor] | None = None) -> dict:
        """The point's tensors; ``end`` holds B's permuted (or relaxed) entries of ``permuted_keys``;
        no ``offset``: the point on the segment."""
        bend = 2.0 * t * (1.0 - t)
        out: dict[str, torch.Tensor] = {}
        for k in self.params:
            b = end.get(k, self.sb[k])
            out[k] = (1.0 - t) * self.sa[k] + t * b
            if offset is not None:
                out[k] = out[k] + bend * offset[k]
        with torch.no_grad():
            for k in self.float_buffers:
                b = end.get(k, self.sb[k])
                out[k] = torch.lerp(self.sa[k], b.detach(), t)
        for k in self.fixed_params + self.int_buffers:
            out[k] = self.sa[k].clone()
        return out

    def loss(self, state: Mapping[str, torch.Tensor], inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        with training_flags(self.model, train=True):
            outputs = torch.func.functional_call(self.model, dict(state), inputs, strict=False, tie_weights=True)
        loss = self.loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return the batch's mean loss as a one-element tensor")
        return loss.reshape(())

    def permuted_end(self, perms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """B's entries of ``permuted_keys``, permuted (index selection, no matrices)."""
        return {k: permute_entry(self.spec, perms, k, self.sb[k]) for k in self.permuted_keys}


class Judge:
    r""":math:`\hat Q(\tilde\theta_c, P)`: mean loss over fixed batches at fixed midpoint-rule nodes.

    The same batches and points for every candidate, so the comparison is not decided by
    which batch happened to be easy; the network runs in train mode (BatchNorm on batch
    statistics, as in training; none of its running statistics is kept). With one point
    the node is :math:`t = 1/2`.
    """

    def __init__(self, fn: CurveFunction, batches: list[tuple[tuple, torch.Tensor]], points: int) -> None:
        self.fn, self.batches = fn, batches
        self.ts = [(i + 0.5) / points for i in range(points)]

    @torch.no_grad()
    def __call__(self, offset: Mapping[str, torch.Tensor] | None, perms: Mapping[str, torch.Tensor]) -> float:
        end = self.fn.permuted_end(perms)
        total, count = 0.0, 0
        for t in self.ts:
            state = self.fn.state(t, end, offset)
            for inputs, targets in self.batches:
                n = targets.shape[0] if targets.ndim else 1
                total += float(self.fn.loss(state, inputs, targets)) * n
                count += n
        return total / count


def proximal_hooks(curve: BezierCurve, nu: float) -> list[Any]:
    r"""Add :math:`(\theta_c - \theta_c^k)/\nu` to the bends' gradients (the proximal term of eq. 34)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    # train_curve sums the processes' gradients: each adds its share of the proximal term.
    scale = 1.0 / (nu * (torch.distributed.get_world_size() if distributed else 1))
    handles = []
    for bend in curve.bends():
        anchor = bend.detach().clone()
        handles.append(bend.register_hook(lambda g, p=bend, a=anchor: g + (p.detach() - a) * scale))
    return handles


def build_curve(model: nn.Module, sa: Mapping[str, torch.Tensor], end_state: Mapping[str, torch.Tensor],
                 offset_flat: list[torch.Tensor] | None) -> tuple[BezierCurve, list[torch.Tensor]]:
    """A Bezier curve A -> ``end_state`` with its bend at the midpoint plus ``offset_flat``.

    A new curve's bend starts exactly at the midpoint of its segment (BezierCurve's
    contract); the flat layout of the bends depends only on the model and the states'
    dtypes, so offsets carry over between curves of one model. Returns the curve and its
    midpoints (flat, as :meth:`BezierCurve.bends`).
    """
    curve = BezierCurve(model, sa, end_state, num_bends=1)
    mids = [b.detach().clone() for b in curve.bends()]
    if offset_flat is not None:
        with torch.no_grad():
            for bend, off in zip(curve.bends(), offset_flat):
                bend.add_(off)
    return curve, mids


def keyed_offset(curve: BezierCurve, fn: CurveFunction, sa: Mapping[str, torch.Tensor],
                  end_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r""":math:`\tilde\theta_c` by state-dict key: the bend minus the midpoint of the segment."""
    bend = curve.bend_state(0)
    return {k: bend[k] - 0.5 * (sa[k] + end_state[k]) for k in fn.params}


def fixed_batches(data: Iterable[Any], max_batches: int | None, device: torch.device,
                  name: str = "data") -> list[tuple[tuple, torch.Tensor]]:
    """The first ``max_batches`` (None: all) ``(inputs, targets)`` batches of ``data``, read once, on ``device``."""
    out = []
    for index, batch in iterate_batches(data, max_batches, name):
        inputs, targets = inputs_and_targets(batch, index, name)
        out.append((to_device(inputs, device), targets.to(device)))
    return out


def cycle(data: Iterable[Any], device: torch.device) -> Iterator[tuple[tuple, torch.Tensor]]:
    """``(inputs, targets)`` on ``device``, through ``data`` again and again (one batch per SGD step)."""
    while True:
        for index, batch in iterate_batches(data, name="data"):
            inputs, targets = inputs_and_targets(batch, index, "data")
            yield to_device(inputs, device), targets.to(device)


def moved_units(new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Per group, the units ``new`` moves against ``old``."""
    return {g: int((new[g] != old[g]).sum()) for g in old}


def perms_key(perms: Mapping[str, torch.Tensor]) -> tuple:
    """A hashable key of one permutation per group (BvN samples repeat: each is judged once)."""
    return tuple(perms[g].numpy().tobytes() for g in sorted(perms))
