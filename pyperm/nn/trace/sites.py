"""Activation sites: where each group's units appear before and after the nonlinearity.

While labelling, every graph node gets a :class:`Role` from the rule that labels it. The
tracer records where each group's units are *produced* (the output axis of a Linear,
convolution, embedding or ``x @ W``). From every producer it follows the graph forward:
the *pre-activation* site is the producer's output, or the output of the normalisation
layers directly after it; the *post-activation* site is the first nonlinearity after
that, reached through normalisation, residual additions, pooling and dropout (for a
ResNet block: the ReLU after the residual addition). When a fork, a layer or the model
output comes first, the last tensor before it is the site.
:func:`pyperm.nn.activation_matching` hooks these sites.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import fx

from pyperm.nn.spec import entry_groups
from pyperm.nn.trace.labels import is_label

if TYPE_CHECKING:
    from pyperm.nn.trace.interpreter import Labeler

__all__ = ["ActivationSite", "Projection", "Role", "find_sites"]


class Role(str, enum.Enum):
    """What a graph node is for the activation sites (set by the rule that labels it)."""

    PRODUCER = "producer"  #: opens the units of a group (Linear, convolution, embedding, x @ W)
    NORM = "norm"  #: BatchNorm, LayerNorm, ...: still a pre-activation
    NONLINEAR = "nonlinear"  #: the post-activation
    PASS = "pass"  #: keeps units as they are (add, dropout, pooling, reshape, ...)
    OTHER = "other"  #: ends the walk (the default)


@dataclass(frozen=True)
class Projection:
    """Units a layer computes and never shows, as a projection of its input: ``x @ W[rows].T +
    b[bias_rows]`` with ``W = state_dict[weight]`` and ``b = state_dict[bias]`` (no bias when None)."""

    weight: str
    rows: tuple[int, int]
    bias: str | None = None
    bias_rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class ActivationSite:
    """One place where a group's units appear as activations.

    Attributes
    ----------
    node : str
        Name of the ``torch.fx`` node whose output holds the activations.
    module : str
        Path of the module that computes it (``""`` for the model itself).
    op : str
        Readable name of the operation (``"ReLU"``, ``"relu"``, ``"add"``, ...).
    axis : int
        The tensor axis that carries the group's units; every other axis indexes
        samples (batch, spatial positions, tokens).
    form : str, Tiled, Blocks or Segments
        How the axis is built out of groups, as a spec axis entry: the group's name when
        the axis holds exactly its units, else the structured form (``Blocks(outer,
        inner)`` after a grouped convolution, ``Tiled(group, outer)`` before one, ...).
    projection : Projection, optional
        For units a layer computes and never shows (the query, key and value heads of
        ``nn.MultiheadAttention``): the activations are the node's output (units along
        ``axis``) projected by rows of a ``state_dict`` weight.
    """

    node: str
    module: str
    op: str
    axis: int
    form: Any = None
    projection: Projection | None = None


def _carries(labeler: Labeler, node: fx.Node, root: int) -> int | None:
    """The axis of ``node``'s output that carries class ``root``, or None."""
    lab = labeler.labels.get(node)
    if not is_label(lab):
        return None
    for axis, a in enumerate(lab):
        if isinstance(a, int) and labeler.units.root(a) == root:  # not inside a structure: no site there
            return axis
    return None


def _samples_elsewhere(labeler: Labeler, node: fx.Node, axis: int) -> bool:
    """Whether every axis of ``node``'s output but ``axis`` indexes samples: no other axis carries
    units that are permuted (after a head split, the heads axis does: a head of A is not the same
    head of B, so its positions are not samples of the head dims)."""
    lab = labeler.labels.get(node)
    return all(a is None or labeler.units.is_fixed(a) for i, a in enumerate(lab) if i != axis)


def _next(labeler: Labeler, cur: fx.Node, root: int, roles: tuple[Role, ...]) -> fx.Node | None:
    """The node after ``cur`` on the walk from a producer, if it has one of ``roles`` and carries ``root``."""
    # Only a node's single user continues the walk: at a fork the site is here.
    users = list(cur.users)
    if len(users) == 1 and labeler.roles.get(users[0]) in roles and _carries(labeler, users[0], root) is not None:
        return users[0]
    return None


def _site(labeler: Labeler, node: fx.Node, axis: int, form: Any) -> ActivationSite:
    return ActivationSite(
        node=node.name,
        module=labeler.module_path(node),
        op=labeler.op_name(node),
        axis=axis,
        form=form,
    )


def find_sites(
    labeler: Labeler, groups: Mapping[str, int], form_of: Callable[[int], Any]
) -> tuple[dict[str, tuple[ActivationSite, ...]], dict[str, tuple[ActivationSite, ...]]]:
    """The pre- and post-activation sites of every group, in graph order.

    Parameters
    ----------
    labeler : Labeler
        The interpreter after its run.
    groups : mapping of str to int
        Every group's name and size.
    form_of : callable
        The spec entry of a producer's output atom: a group name, a structured form whose
        groups are all in ``groups``, or None (units that are never permuted).
    """
    order = {n: i for i, n in enumerate(labeler.module.graph.nodes)}
    # Sites keyed by (node, first projected row, or -1 for the node's own output).
    pre: dict[str, dict[tuple[fx.Node, int], ActivationSite]] = {g: {} for g in groups}
    post: dict[str, dict[tuple[fx.Node, int], ActivationSite]] = {g: {} for g in groups}
    for node, atom in labeler.producers:
        form = form_of(atom)
        members = entry_groups(form)
        if not members or any(g not in groups for g in members):
            continue
        root = labeler.units.root(atom)  # a class bound to a structure is still one class along the walk

        cur = node
        while _carries(labeler, cur, root) is None:  # a layer returning a tuple: its member holds the units
            nxt = _next(labeler, cur, root, (Role.PASS,))
            if nxt is None:
                break
            cur = nxt
        if _carries(labeler, cur, root) is None:
            continue
        while (nxt := _next(labeler, cur, root, (Role.NORM,))) is not None:
            cur = nxt
        axis = _carries(labeler, cur, root)
        if _samples_elsewhere(labeler, cur, axis):  # type: ignore[arg-type]
            for g in members:
                pre[g].setdefault((cur, -1), _site(labeler, cur, axis, form))  # type: ignore[arg-type]
        while labeler.roles.get(cur) != Role.NONLINEAR:
            nxt = _next(labeler, cur, root, (Role.NORM, Role.PASS, Role.NONLINEAR))
            if nxt is None:
                break
            cur = nxt
        axis = _carries(labeler, cur, root)
        if _samples_elsewhere(labeler, cur, axis):  # type: ignore[arg-type]
            for g in members:
                post[g].setdefault((cur, -1), _site(labeler, cur, axis, form))  # type: ignore[arg-type]

    for node, path, what, projection, units in labeler.projected:
        form = form_of(units)
        members = entry_groups(form)
        axis = len(labeler.labels[node]) - 1
        if not members or any(g not in groups for g in members) or not _samples_elsewhere(labeler, node, axis):
            continue
        site = ActivationSite(node.name, path, f"{labeler.op_name(node)} -> {what}", axis, form, projection)
        for g in members:  # one site per projection: keyed by (node, rows), since q and k read one node
            pre[g].setdefault((node, projection.rows[0]), site)
            post[g].setdefault((node, projection.rows[0]), site)

    def pack(sites: dict[str, dict[tuple[fx.Node, int], ActivationSite]]) -> dict[str, tuple[ActivationSite, ...]]:
        def place(item: Any) -> tuple[int, int]:
            (node, row), _ = item
            return order[node], row

        return {g: tuple(site for _, site in sorted(s.items(), key=place)) for g, s in sites.items()}

    return pack(pre), pack(post)
