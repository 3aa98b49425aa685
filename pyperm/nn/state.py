"""State-dict operations: checking that two state dicts pair up, interpolating, averaging.

A state dict here is a mapping of names to tensors, as ``model.state_dict()`` returns.
Floating (and complex) entries are parameters and running statistics, which mix
linearly; integer and boolean entries are counters and masks (``num_batches_tracked``),
which have no meaningful mixture and are taken from the first state. Nothing here
modifies its inputs: every result holds new tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pyperm._checks import check_finite_real, check_nonnegative_real
from pyperm.nn._checks import check_pair, check_state

__all__ = ["average", "interpolate", "is_mixable", "shared_tensors"]


def shared_tensors(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The groups of keys that name one tensor (tied weights), each group in the state's order.

    Two keys name one tensor when they view the same memory the same way: the same storage,
    offset, dtype, shape and strides. On the meta device, where every address is 0 (a model built
    there only to be traced), the storage object itself tells them apart. Empty tensors are
    never grouped.

    Parameters
    ----------
    state : mapping of str to torch.Tensor
        A state dict, e.g. ``model.state_dict()``.

    Returns
    -------
    list of list of str
        Every group of two or more keys.

    Examples
    --------
    >>> import torch
    >>> w = torch.ones(2, 3)
    >>> shared_tensors({"embed": w, "head": w, "bias": torch.zeros(3)})
    [['embed', 'head']]
    """
    groups: dict[tuple, list[str]] = {}
    for key, t in state.items():
        if t.numel():
            where = t.untyped_storage()._cdata if t.device.type == "meta" else t.data_ptr()
            ident = (t.device, where, t.storage_offset(), t.dtype, tuple(t.shape), tuple(t.stride()))
            groups.setdefault(ident, []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def is_mixable(tensor: torch.Tensor) -> bool:
    """Whether an entry mixes linearly (floating or complex) rather than being copied (integers, booleans)."""
    return tensor.is_floating_point() or tensor.is_complex()


def interpolate(
    state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor], t: float
) -> dict[str, torch.Tensor]:
    r"""The state dict on the line through two models: :math:`(1 - t)\,\Theta_A + t\,\Theta_B`.

    Parameters
    ----------
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints: the same keys, and per key the same shape, dtype and device.
    t : float
        The position on the line: 0 gives A, 1 gives B; values outside [0, 1]
        extrapolate.

    Returns
    -------
    dict of str to torch.Tensor
        New tensors, in ``state_a``'s key order. Floating and complex entries are
        :math:`(1 - t) A + t B` computed in their own dtype (so ``t=0`` and ``t=1``
        give A and B exactly); integer and boolean entries (``num_batches_tracked``)
        are copies of A's. Interpolated BatchNorm running statistics are not the
        statistics of the interpolated network: see
        :func:`pyperm.nn.eval.batchnorm.reset_bn_stats`.

    Raises
    ------
    TypeError
        A state is not a mapping of str to tensors, or ``t`` is not a real number.
    ValueError
        The keys differ, or an entry differs in shape, dtype or device (the message
        names the key); ``t`` is not finite.

    References
    ----------
    .. [1] S. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
       Permutation Symmetries", ICLR 2023, Definition 2.2.

    Examples
    --------
    >>> import torch
    >>> a = {"w": torch.zeros(2), "n": torch.tensor(3)}
    >>> b = {"w": torch.ones(2), "n": torch.tensor(5)}
    >>> mid = interpolate(a, b, 0.25)
    >>> mid["w"], mid["n"]
    (tensor([0.2500, 0.2500]), tensor(3))
    """
    check_pair(state_a, state_b)
    t = check_finite_real(t, "t")
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, a in state_a.items():
            a = a.detach()
            if is_mixable(a):
                out[key] = (1.0 - t) * a + t * state_b[key].detach()
            else:
                out[key] = a.clone()
    return out


def average(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    r"""The weighted mean of several state dicts: :math:`\sum_i w_i \Theta_i / \sum_i w_i`.

    Parameters
    ----------
    states : sequence of mapping of str to torch.Tensor
        At least one state dict; all have the same keys, and per key the same shape,
        dtype and device.
    weights : sequence of float, optional
        One non-negative weight per state, with a positive sum; equal weights when
        omitted. They are normalised to sum to 1.

    Returns
    -------
    dict of str to torch.Tensor
        New tensors, in the first state's key order. Floating and complex entries are
        the weighted mean, accumulated in double precision (float64 / complex128) and
        cast back to the entry's dtype; integer and boolean entries are copies of the
        first state's.

    Raises
    ------
    TypeError
        ``states`` is not a sequence of state dicts (a single state dict is refused),
        or ``weights`` is not a sequence of real numbers.
    ValueError
        ``states`` is empty, the states do not pair up (the message names the key),
        or ``weights`` has the wrong length, a negative or non-finite entry, or a
        zero sum.

    Examples
    --------
    >>> import torch
    >>> s = [{"w": torch.tensor([0.0])}, {"w": torch.tensor([1.0])}, {"w": torch.tensor([5.0])}]
    >>> average(s)["w"], average(s, weights=[1, 1, 0])["w"]
    (tensor([2.]), tensor([0.5000]))
    """
    if isinstance(states, (Mapping, str, bytes)) or not isinstance(states, Sequence):
        raise TypeError(f"states must be a sequence of state dicts, got {type(states).__name__}")
    if len(states) == 0:
        raise ValueError("states must hold at least one state dict, got an empty sequence")
    check_state(states[0], "states[0]")
    for i in range(1, len(states)):
        check_pair(states[0], states[i], ("states[0]", f"states[{i}]"))
    if weights is None:
        w = [1.0 / len(states)] * len(states)
    else:
        if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, (Sequence, torch.Tensor)):
            raise TypeError(f"weights must be a sequence of real numbers or None, got {type(weights).__name__}")
        if isinstance(weights, torch.Tensor):
            weights = weights.tolist()
        if len(weights) != len(states):
            raise ValueError(f"weights has {len(weights)} entries for {len(states)} states")
        raw = [check_nonnegative_real(x, f"weights[{i}]") for i, x in enumerate(weights)]
        total = sum(raw)
        if total <= 0:
            raise ValueError("weights must have a positive sum")
        w = [x / total for x in raw]
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, first in states[0].items():
            first = first.detach()
            if not is_mixable(first):
                out[key] = first.clone()
                continue
            wide = torch.complex128 if first.is_complex() else torch.float64
            acc = torch.zeros(first.shape, dtype=wide, device=first.device)
            for wi, state in zip(w, states):
                if wi != 0.0:
                    acc.add_(state[key].detach().to(wide), alpha=wi)
            out[key] = acc.to(first.dtype)
    return out
