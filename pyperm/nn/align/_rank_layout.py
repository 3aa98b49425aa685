"""Which rank holds which entries of the pair: checked once, the same on every rank.

Every rank passes its share of A's and B's state dicts (any partition of the spec's keys). The
shares' keys, shapes and dtypes are gathered so that every rank knows the whole layout (which
rank holds each entry, and every entry's shape) without any tensor leaving its rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pyperm._comm import Channel
from pyperm.nn.spec import PermutationSpec

__all__ = ["Layout", "gather_layout"]


class Layout:
    """The whole pair's entries: ``owner[key]`` (a group rank) and ``meta[key]`` (a tensor on the
    meta device with the entry's shape and dtype)."""

    def __init__(self, owner: dict[str, int], meta: dict[str, torch.Tensor]) -> None:
        self.owner = owner
        self.meta = meta


def _share(name: str, state: Any) -> dict[str, torch.Tensor]:
    if not isinstance(state, Mapping):
        raise TypeError(f"{name} must be a mapping of str to torch.Tensor (this rank's share), got {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    return {k: v.detach() for k, v in state.items()}


def gather_layout(spec: PermutationSpec, state_a: Any, state_b: Any, chan: Channel) -> tuple[dict, dict, Layout]:
    """This rank's checked shares of A and B, and the layout of the whole pair.

    Raises ValueError on every rank alike (each sees the same gathered layout) when the shares
    hold other keys than the spec's, a key on two ranks or on none, or shapes that differ
    between A and B or from the spec.
    """
    sa, sb = _share("state_a", state_a), _share("state_b", state_b)
    if set(sa) != set(sb):
        only = sorted(set(sa) ^ set(sb))
        raise ValueError(f"state_a and state_b must hold the same keys on each rank; rank {chan.rank} differs in {only[:5]}")
    mine = {k: (tuple(sa[k].shape), tuple(sb[k].shape), str(sa[k].dtype).removeprefix("torch.")) for k in sa}
    shares = chan.all_gather_object(mine)
    owner: dict[str, int] = {}
    meta: dict[str, torch.Tensor] = {}
    for rank, share in enumerate(shares):
        for key, (shape_a, shape_b, dtype) in share.items():
            if key not in spec.axes:
                raise ValueError(f"rank {rank} holds {key!r}, which is not in the spec")
            if key in owner:
                raise ValueError(f"{key!r} is held by ranks {owner[key]} and {rank}: each key must live on one rank")
            if shape_a != shape_b:
                raise ValueError(f"state_a[{key!r}] has shape {shape_a} but state_b has {shape_b} (rank {rank})")
            owner[key] = rank
            meta[key] = torch.empty(shape_a, dtype=getattr(torch, dtype), device="meta")
    missing = [k for k in spec.axes if k not in owner]
    if missing:
        raise ValueError(f"no rank holds {len(missing)} of the spec's keys, e.g. {missing[:5]}")
    spec.check_state_dict(meta, "the ranks' shares")
    return sa, sb, Layout(owner, {k: meta[k] for k in spec.axes})
