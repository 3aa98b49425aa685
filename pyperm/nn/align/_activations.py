"""The activation statistics of activation matching: what is read, where, and how it is accumulated.

A group's units appear as activations at *sites* (a traced node and an axis of its output,
:class:`~pyperm.nn.ActivationSite`). A site's axis may hold several parts (a
:class:`~pyperm.nn.spec.Segments` axis), and each part that holds units is a :class:`Reading`:
one streaming cross-correlation of A's activations of those units with B's.
:func:`collect_statistics` runs both models through their traced graphs once over the data
and feeds every reading's accumulator.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

import pyperm
from pyperm._progress import progress_bar
from pyperm.nn._runtime import eval_mode, model_inputs, module_device
from pyperm.nn.spec import Interleaved, PermutationSpec, Segments, Tiled, entry_groups
from pyperm.nn.trace import ActivationSite, TraceError
from pyperm.nn.trace.sites import Projection

__all__ = ["Reading", "Statistics", "collect_statistics", "readings_of"]


@dataclass(frozen=True)
class Reading:
    """A part of a site's axis that one accumulator reads.

    ``form`` is a group name (the part holds its units; a :class:`Tiled` part with fixed
    copies is read with the copies as extra samples) or a structured form over the whole
    part (``Blocks``, ``Tiled`` copies moved by a group), whose groups are solved together.
    """

    node: str
    axis: int
    start: int
    length: int
    form: Any
    copies: tuple[int, int] = (1, 1)  # (outer, inner) copies of a Tiled part folded into samples
    projection: Projection | None = None  # see ActivationSite.projection
    step: int = 1  # the part's entries are start, start + step, ... (a part of an Interleaved axis)

    @property
    def units(self) -> int:
        return self.length // (self.copies[0] * self.copies[1])

    @property
    def structured(self) -> bool:
        return not isinstance(self.form, str)

    @property
    def first_group(self) -> str:
        """The group that error messages name."""
        return entry_groups(self.form)[0]

    def take(self, z: torch.Tensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This part of a site's (samples, axis) activations, as (samples, units); a projected
        site's activations are computed with ``state``, the model's projection weights."""
        p = self.projection
        if p is not None:
            z = z @ state[p.weight][p.rows[0] : p.rows[1]].to(z.dtype).T
            if p.bias is not None:
                z = z + state[p.bias][p.bias_rows[0] : p.bias_rows[1]].to(z.dtype)  # type: ignore[index]
        z = z[:, self.start : self.start + self.step * (self.length - 1) + 1 : self.step]
        outer, inner = self.copies
        if outer * inner > 1:
            z = z.reshape(-1, outer, self.units, inner).transpose(2, 3).reshape(-1, self.units)
        return z.contiguous()


def readings_of(spec: PermutationSpec, site: ActivationSite) -> list[Reading]:
    """The parts of ``site``'s axis that hold units, each with its form (found through nested
    concatenations and interleaves, each part at its place: a slice, strided for an interleave)."""
    readings: list[Reading] = []

    def walk(entry: Any, start: int, step: int) -> None:
        if isinstance(entry, (Segments, Interleaved)):
            offset, k = 0, len(entry.parts)
            for j, part in enumerate(entry.parts):
                if isinstance(entry, Interleaved):  # part j's entry i sits at k * i + j
                    walk(part, start + j * step, step * k)
                else:
                    walk(part, start + offset * step, step)
                offset += spec.entry_length(part)
            return
        if isinstance(entry, int):
            return
        length = spec.entry_length(entry)
        if isinstance(entry, Tiled) and not isinstance(entry.outer, str):
            copies = (entry.outer, entry.inner)
            readings.append(Reading(site.node, site.axis, start, length, entry.group, copies, site.projection, step))
        else:
            readings.append(Reading(site.node, site.axis, start, length, entry, projection=site.projection, step=step))

    walk(site.form, 0, 1)
    return readings


@dataclass
class Statistics:
    """What :func:`collect_statistics` gathered: one accumulator per reading (indexed like the
    readings; a :class:`pyperm.CrossCorrelation` each) and the batches read."""

    accumulators: Any
    num_batches: int


def collect_statistics(
    model_a: nn.Module,
    model_b: nn.Module,
    graphs: tuple[fx.GraphModule, fx.GraphModule],
    readings: Sequence[Reading],
    batches: Iterable[tuple[int, Any]],
    *,
    dtype: Any,
    progress: Any,
    total: int | None,
    concatenated: frozenset[int] = frozenset(),
    method: str = "activation matching",
) -> Statistics:
    """Run both models (through their traced ``graphs``) on every batch and accumulate every reading.

    Reading ``i`` accumulates A's units against B's, or, for ``i`` in ``concatenated``, the
    ``2 * units`` features of both models against themselves (ZipIt's correlation). Both run in
    eval mode under ``torch.no_grad`` (their flags are restored). When both are on one CUDA
    device and pyperm's CUDA kernels are available, the activations stay there, one device
    accumulator per reading; otherwise they are copied to the host, where one
    :class:`pyperm.CrossCorrelationSet` updates every reading at once on the thread pool.
    ``method`` names the caller in the progress bar and in the warning of a host fallback.
    """
    dev_a, dev_b = module_device(model_a), module_device(model_b)
    on_device = dev_a.type == "cuda" and dev_b == dev_a and pyperm.cuda_available()
    if dev_a.type == "cuda" and dev_b == dev_a and not on_device:
        # stacklevel 3: the caller of the method, which calls this function.
        warnings.warn(f"{method}: {pyperm.cuda_unavailable_reason()}; the activations are copied to the "
                      "host and accumulated there (slower)", UserWarning, stacklevel=3)  # fmt: skip
    device = dev_a if on_device else torch.device("cpu")
    keys = range(len(readings))
    dims = {i: (2 * readings[i].units,) * 2 if i in concatenated else (readings[i].units,) * 2 for i in keys}
    if on_device:
        accs: Any = {i: pyperm.CrossCorrelation(*dims[i], dtype=dtype) for i in keys}
    else:
        accs = pyperm.CrossCorrelationSet(dims, dtype=dtype)
    watch: dict[str, list[tuple[Any, int]]] = {}  # node -> (key of its held activations, axis of units)
    for node, axis in dict.fromkeys((r.node, r.axis) for r in readings):
        watch.setdefault(node, []).append(((node, axis), axis))
    # A projected site (attention's query, key, value) is computed from its inputs and these weights.
    projected = {key for r in readings if r.projection is not None for key in (r.projection.weight, r.projection.bias)}
    weights = [{k: v.detach().to(device) for k, v in m.state_dict().items() if k in projected}
               for m in (model_a, model_b)]  # fmt: skip

    held: tuple[dict[Any, torch.Tensor], dict[Any, torch.Tensor]] = ({}, {})
    reader_a = _SiteReader(graphs[0], watch, held[0].__setitem__, device)
    reader_b = _SiteReader(graphs[1], watch, held[1].__setitem__, device)
    bar = progress_bar(progress, total, method, "batch")
    used = 0
    try:
        with eval_mode(model_a, model_b), torch.no_grad():
            for index, batch in batches:
                inputs = model_inputs(batch, index)
                reader_a.run(*(t.to(dev_a) for t in inputs))
                reader_b.run(*(t.to(dev_b) for t in inputs))
                _update(accs, readings, held, weights, on_device, concatenated)
                held[0].clear()
                held[1].clear()
                used += 1
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    for i in keys:
        if accs[i].count == 0:
            raise ValueError(f"data held no samples for group {readings[i].first_group!r}: every batch was empty")
    return Statistics(accs, used)


def _update(accs: Any, readings: Sequence[Reading], held: tuple[Mapping, Mapping],
            weights: Sequence[Mapping[str, torch.Tensor]], on_device: bool,
            concatenated: frozenset[int] = frozenset()) -> None:
    """One batch's held activations into every reading's accumulator.

    The readings whose indices are in ``concatenated`` (zipit's) feed both models' features side by side as both
    sides of the correlation.
    """
    pairs = {}
    for i, r in enumerate(readings):
        za, zb = r.take(held[0][(r.node, r.axis)], weights[0]), r.take(held[1][(r.node, r.axis)], weights[1])
        if i in concatenated:
            za = zb = torch.cat([za, zb], 1)
        pairs[i] = (za, zb)
    try:
        if on_device:
            for i, (za, zb) in pairs.items():
                accs[i].update(za, zb)
            for i in pairs:  # the device's errors, raised here while the batch can still name its site
                accs[i].check()
        else:
            accs.update(pairs)  # one call: the set runs every reading's kernel on the thread pool at once
    except ValueError:
        for i, (za, zb) in pairs.items():  # name the site whose activations are bad
            if not (bool(torch.isfinite(za).all()) and bool(torch.isfinite(zb).all())):
                raise ValueError(
                    f"activations of group {readings[i].first_group!r} at {readings[i].node!r} contain NaN or "
                    "infinite values"
                ) from None
        raise


def _samples(x: Any, axis: int, site: str, device: torch.device) -> torch.Tensor:
    """Activations as a C-contiguous (samples, units) tensor on ``device`` that no later op can modify."""
    if not isinstance(x, torch.Tensor):
        raise TraceError(f"the activations at node {site!r} are a {type(x).__name__}, not a tensor")
    x = x.detach()
    z = x.movedim(axis, -1).reshape(-1, x.shape[axis])
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    if z.device != device:
        return z.to(device)  # a copy
    if z.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        z = z.clone()  # an in-place op later in the graph (ReLU(inplace=True)) would overwrite it
    return z.contiguous()


class _SiteReader(fx.Interpreter):
    """Runs a traced model and hands the output of every watched node to ``sink``."""

    def __init__(self, gm: fx.GraphModule, watch: Mapping[str, list[tuple[Any, int]]], sink, device) -> None:
        super().__init__(gm)
        self.watch = watch
        self.sink = sink
        self.device = device  # where the activations are accumulated

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        for key, axis in self.watch.get(n.name, ()):
            self.sink(key, _samples(out, axis, n.name, self.device))
        return out
