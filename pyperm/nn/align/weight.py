r"""Weight matching: Git Re-Basin's permutation coordinate descent (Ainsworth et al. 2023, Algorithm 1).

Finds one permutation per group of a :class:`~pyperm.nn.PermutationSpec` so that model B,
permuted, is as close as possible to model A in weight space:

.. math::

    \max_\pi \; \operatorname{vec}(\Theta_A) \cdot \operatorname{vec}(\pi(\Theta_B)).

Holding every group but one fixed turns the problem into a linear assignment problem
(eq. 2 of the paper) whose similarity matrix sums, over the tensor axes the group acts on,
A's tensor (that axis first, flattened) times B's tensor permuted by the other groups.
The groups are visited in a seeded random order, sweep after sweep, until a full sweep
improves nothing.

What makes this implementation fast (the published implementations rebuild every
similarity matrix from every weight at every step):

- every tensor is arranged once (contiguous, in the similarity's dtype, in a layout where
  permuting the other group is a gather of whole blocks and every product below is one
  matrix multiplication) so a step only gathers and multiplies;
- each group keeps the contribution of every (tensor, axis) pair between visits. When a
  neighbouring group's permutation changed in ``k`` of its ``m`` units, a contribution is
  updated by the rank-``k`` correction ``A[:, S] (B[:, new(S)] - B[:, old(S)])^T`` instead
  of being recomputed, contributions that involve no other group are computed once, and
  those whose other group did not move are reused as they are. Groups made of linear
  layers keep only their sum, and a visit corrects it with one product for all its terms;
- a group none of whose neighbours changed since its last assignment is not solved again
  (the answer could not change), so the last, confirming sweep is nearly free;
- on the CPU every assignment is warm-started from the group's previous one (its matching
  or its column duals), since a group's similarity changes little from visit to visit;
  CUDA tensors are solved on their GPU when pyperm's CUDA core is available.

Measured with ``pyperm bench match`` (2-core machine): the similarity products are most
of the time, and they are bounded by the machine's float32 matrix-multiply rate.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import pyperm
from pyperm._checks import torch_generator
from pyperm._progress import progress_bar
from pyperm.nn.align._similarity import (
    GroupSimilarity,
    Term,
    accurate_dot,
    frobenius_norm,
)
from pyperm.nn.permutations import as_permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["WeightMatchingResult", "weight_matching", "matching_objective"]

logger = logging.getLogger(__name__)


@dataclass
class WeightMatchingResult:
    """What :func:`weight_matching` found.

    Attributes
    ----------
    perms : dict of str to (n,) int64 torch.Tensor
        One permutation per group (on the CPU), to be used with
        :func:`~pyperm.nn.apply_permutation` on model B: unit ``i`` of the permuted model
        is unit ``perms[g][i]`` of B.
    objective : list of float
        ``vec(A) . vec(pi(B))`` over the matched tensors: ``objective[0]`` at the initial
        permutations (computed from the weights), ``objective[s]`` after sweep ``s``
        (``objective[0]`` plus the gains of the accepted steps, read off the similarity
        matrices, so exact up to their float32 rounding). Non-decreasing.
    sweeps : int
        Sweeps over the groups that were run.
    converged : bool
        Whether the last sweep improved nothing (otherwise ``max_iter`` stopped the search).
    """

    perms: dict[str, torch.Tensor]
    objective: list[float] = field(default_factory=list)
    sweeps: int = 0
    converged: bool = False

def _check_state(spec: PermutationSpec, state: Any, name: str, flat: bool = True) -> dict[str, torch.Tensor]:
    if not isinstance(state, Mapping):
        raise TypeError(f"{name} must be a mapping of names to tensors, got {type(state).__name__}")
    for key in spec.axes:
        if key in state and not isinstance(state[key], torch.Tensor):
            raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(state[key]).__name__}")
    if flat:
        spec.require_flat("WeightMatcher")  # structured axes (Segments, Tiled, Blocks, P W P^T): _match_structured
    spec.check_state_dict(state, name)
    return {key: state[key].detach() for key in spec.axes}


def _objective_keys(spec: PermutationSpec, sa: Mapping[str, torch.Tensor], keys: Iterable[str] | None) -> list[str]:
    if keys is None:
        return [k for k in spec.axes if sa[k].is_floating_point()]
    if isinstance(keys, str):
        raise TypeError("keys must be an iterable of state_dict keys, not a single string")
    chosen = list(keys)
    for k in chosen:
        if k not in spec.axes:
            raise ValueError(f"keys names {k!r}, which is not in the spec")
        if not sa[k].is_floating_point():
            raise ValueError(f"keys names {k!r}, whose dtype {sa[k].dtype} is not floating point")
    return list(dict.fromkeys(chosen))


def _objective(
    spec: PermutationSpec,
    sa: Mapping[str, torch.Tensor],
    sb: Mapping[str, torch.Tensor],
    perms: Mapping[str, torch.Tensor],
    keys: Iterable[str],
) -> float:
    """The objective on validated state dicts; also the finiteness check of every entry it reads."""
    total = 0.0
    # Identity permutations (the usual start) need no gather of B.
    moved = {g for g, p in perms.items() if not torch.equal(p, torch.arange(p.numel(), device=p.device))}
    for key in keys:
        a = sa[key]
        b = sb[key]
        if a.shape != b.shape:
            raise ValueError(f"state_a[{key!r}] has shape {tuple(a.shape)} but state_b has {tuple(b.shape)}")
        for ax, g in enumerate(spec.axes[key]):
            if spec.structured:  # Segments, Tiled, Blocks: the spec builds the index
                index = spec.axis_index(key, ax, perms) if set(spec.group_axes) & moved else None
                b = b if index is None else b.index_select(ax, index.to(b.device))
            elif g in moved:
                b = b.index_select(ax, perms[g].to(b.device))
        term = accurate_dot(a, b.to(a.device))
        if not math.isfinite(term):
            # A NaN or infinity anywhere in either tensor makes its product non-finite.
            for name, t in (("state_a", sa[key]), ("state_b", sb[key])):
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name}[{key!r}] contains NaN or infinite values")
            raise ValueError(f"the product of state_a[{key!r}] and state_b[{key!r}] overflows")
        total += term
    return total


def matching_objective(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    perms: Mapping[str, Any] | None = None,
    keys: Iterable[str] | None = None,
) -> float:
    r"""The weight-matching objective :math:`\operatorname{vec}(\Theta_A) \cdot \operatorname{vec}(\pi(\Theta_B))`.

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups.
    state_a, state_b : mapping of str to torch.Tensor
        State dicts with exactly the spec's keys and equal shapes.
    perms : mapping of str to (n,) int array, optional
        One permutation per group applied to B (default: the identity).
    keys : iterable of str, optional
        The entries that count (default: every floating-point entry).

    Returns
    -------
    float
        The sum over ``keys`` of the elementwise products (float32 products accumulated
        in float64).

    Raises
    ------
    ValueError, TypeError
        As :func:`weight_matching`.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import PermutationSpec, matching_objective
    >>> spec = PermutationSpec({"w": ("h", None)}, {"h": 2})
    >>> a = {"w": torch.tensor([[1.0], [2.0]])}
    >>> b = {"w": torch.tensor([[2.0], [1.0]])}
    >>> matching_objective(spec, a, b), matching_objective(spec, a, b, {"h": [1, 0]})
    (4.0, 5.0)
    """
    if not isinstance(spec, PermutationSpec):
        raise TypeError(f"spec must be a PermutationSpec, got {type(spec).__name__}")
    sa = _check_state(spec, state_a, "state_a", flat=False)
    sb = _check_state(spec, state_b, "state_b", flat=False)
    checked = as_permutations(spec, perms) if perms is not None else spec.identity()
    return _objective(spec, sa, sb, checked, _objective_keys(spec, sa, keys))


def weight_matching(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    max_iter: int = 100,
    seed: int | torch.Generator = 0,
    init: Mapping[str, Any] | None = None,
    progress: bool = False,
    keys: Iterable[str] | None = None,
    tol: float = 1e-12,
    dtype: torch.dtype = torch.float32,
    callback: Callable[[int, Mapping[str, torch.Tensor], float], bool | None] | None = None,
) -> WeightMatchingResult:
    r"""Permute model B into model A's basin by matching weights (Git Re-Basin, Algorithm 1).

    Maximises :math:`\operatorname{vec}(\Theta_A) \cdot \operatorname{vec}(\pi(\Theta_B))`
    over one permutation per group by coordinate ascent: each step solves, for one group
    ``g`` with the others fixed, the linear assignment problem

    .. math::

        \max_{P_g} \langle P_g, \textstyle\sum_{(k, d)} A_k^{(d)} \,
        \bigl(\pi_{\neg g}(B_k)^{(d)}\bigr)^\top \rangle_F,

    where ``(k, d)`` runs over the tensors and axes ``g`` acts on and :math:`X^{(d)}` is
    ``X`` with axis ``d`` moved first and the rest flattened. Groups are visited in a
    random order drawn anew each sweep from ``seed``; the search stops after a sweep in
    which no step improved the objective by more than ``tol`` (relatively), or after
    ``max_iter`` sweeps.

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups (e.g. ``model.permutation_spec()`` of a bundled
        model, or :meth:`PermutationSpec.from_model`). A structured spec runs a plain
        reference implementation of the same search; there a
        :class:`~pyperm.nn.spec.Blocks` outer group (attention heads) moves with its inner
        groups in one step: the units of every pair of blocks are matched, then the blocks
        on the values of those matchings (an assignment of assignments).
    state_a, state_b : mapping of str to torch.Tensor
        The two models' state dicts, exactly the spec's keys, equal shapes, finite values,
        all on one device. B is the model to be permuted.
    max_iter : int, default 100
        Most sweeps over the groups.
    seed : int or torch.Generator, default 0
        Seeds the order in which the groups are visited (the global RNG is never used).
    init : mapping of str to (n,) int array, or {"identity", "signatures", "best"}, optional
        Initial permutations (default: the identity). ``"signatures"`` matches every
        group's units on their own, by signatures that no other group's order changes
        (the sorted entries of every slice a unit owns), which escapes the stalls of the
        identity start (on MobileNetV2 with torchvision's initialisation, a planted
        permutation ends at 74% of its objective from the identity and is found exactly
        from the signatures); ``"best"`` runs from both starts and keeps the higher
        objective, so it never ends below the identity start (about twice the time;
        ``callback`` sees both runs).
    progress : bool, default False
        Show a tqdm progress bar over the sweeps (needs tqdm).
    keys : iterable of str, optional
        The state-dict entries that enter the objective (default: every floating-point
        entry, BatchNorm running statistics included). Entries without a permuted axis
        only add a constant.
    tol : float, default 1e-12
        A step is taken only when it raises its group's similarity by more than ``tol``
        times its magnitude (ties and float64 summation noise keep the current
        permutation); a sweep without such a step ends the search.
    dtype : torch.dtype, default torch.float32
        Precision of the similarity matrices (float32 or float64).
    callback : callable, optional
        Called after every sweep as ``callback(sweep, perms, objective)`` with the sweep's
        number (from 1), the current permutations (read-only: on the state's device) and
        the objective. Returning ``True`` stops the search after that sweep (the result
        then has ``converged=False`` unless the sweep improved nothing). Meant for
        logging and early stopping by the methods built on this one.

    Returns
    -------
    WeightMatchingResult
        ``perms`` (int64 CPU tensors, one per group), the ``objective`` history,
        ``sweeps`` and ``converged``.

    Raises
    ------
    TypeError
        ``spec`` is not a PermutationSpec, an entry is not a tensor, or ``seed``,
        ``max_iter``, ``keys`` or ``dtype`` has the wrong type.
    ValueError
        A state dict does not match the spec, the two differ in shape, a matched entry is
        not finite, the tensors are on several devices, ``init`` is not one permutation
        per group, or ``max_iter``, ``seed`` or ``tol`` is out of range.

    See Also
    --------
    pyperm.nn.apply_permutation : apply ``result.perms`` to model B's state dict.

    References
    ----------
    S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
    Permutation Symmetries", ICLR 2023, section 3.2 and Algorithm 1.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import apply_permutation, weight_matching
    >>> from pyperm.nn.models import MLP
    >>> a, b = MLP([16, 32, 32, 4]), MLP([16, 32, 32, 4])
    >>> spec = a.permutation_spec()
    >>> result = weight_matching(spec, a.state_dict(), b.state_dict(), seed=0)
    >>> b.load_state_dict(apply_permutation(spec, result.perms, b.state_dict()))
    <All keys matched successfully>
    >>> result.objective[-1] >= result.objective[0]
    True
    """
    if isinstance(init, str):
        if init not in ("identity", "signatures", "best"):
            raise ValueError(f"init must be a mapping of permutations, 'identity', 'signatures' or 'best', got {init!r}")
        starts = {"identity": [None], "signatures": ["signatures"], "best": [None, "signatures"]}[init]
        runs = []
        for start in starts:
            first = _signature_init(spec, state_a, state_b, keys) if start else None
            runs.append(
                weight_matching(spec, state_a, state_b, max_iter, seed, first, progress, keys, tol, dtype, callback)
            )
        return max(runs, key=lambda r: r.objective[-1])  # the first (identity) on a tie
    if isinstance(spec, PermutationSpec) and spec.structured:
        return _match_structured(spec, state_a, state_b, max_iter, seed, init, keys, tol, dtype, callback)
    matcher = WeightMatcher(spec, state_b, keys=keys, dtype=dtype)
    return matcher.match(state_a, init=init, max_iter=max_iter, seed=seed, tol=tol, progress=progress, callback=callback)


def _signature_init(
    spec: PermutationSpec, state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor], keys: Any
) -> dict[str, torch.Tensor]:
    """Every group's units matched on their own, whatever the other groups' order.

    A unit's signature is the sorted entries of every slice it owns (its rows of every
    tensor the group acts on): permuting any other axis only reorders a slice, so the
    signature of a unit of B permuted by ``P`` is that of the unit it came from. Units
    are paired by the smallest total squared distance between signatures (exact for a
    planted permutation of distinct units).
    """
    if not isinstance(spec, PermutationSpec):
        raise TypeError(f"spec must be a PermutationSpec, got {type(spec).__name__}")
    sa = _check_state(spec, state_a, "state_a", flat=False)
    sb = _check_state(spec, state_b, "state_b", flat=False)
    chosen = set(_objective_keys(spec, sa, keys))
    perms: dict[str, torch.Tensor] = {}
    costs: dict[str, torch.Tensor] = {}
    for g, n in spec.sizes.items():
        sig_a, sig_b = [], []
        for key, axis in spec.group_axes[g]:
            if key not in chosen:
                continue
            pos = spec.unit_positions(key, axis, g).reshape(-1)
            for t, out in ((sa[key], sig_a), (sb[key], sig_b)):
                rows = t.index_select(axis, pos.to(t.device)).movedim(axis, 0).reshape(n, -1)
                out.append(torch.sort(rows.double().cpu(), dim=1).values)
        if not sig_a:
            perms[g] = torch.arange(n)
            continue
        cost = torch.cdist(torch.cat(sig_a, 1), torch.cat(sig_b, 1)) ** 2
        if g in spec.blocks:  # solved below, within the blocks its outer group pairs
            costs[g] = cost
            continue
        _, cols = pyperm.linear_sum_assignment(cost.numpy())
        perms[g] = torch.as_tensor(cols, dtype=torch.int64)
    for inner, outer in spec.blocks.items():
        # An outer unit's signature covers its whole block, whatever the order within it,
        # so the blocks are paired first; then each pair of blocks pairs its units.
        nb, bs = spec.num_blocks(inner), spec.block_size(inner)
        if inner not in costs:
            perms[inner] = torch.arange(spec.sizes[inner])
            continue
        paired = perms[outer] if isinstance(outer, str) else torch.arange(nb)  # fixed blocks pair with themselves
        pairs = costs[inner].view(nb, bs, nb, bs)[torch.arange(nb), :, paired]  # (nb, bs, bs)
        _, cols = pyperm.batch_linear_sum_assignment(pairs.contiguous().numpy())
        perms[inner] = _inner_of_pairs(paired, torch.as_tensor(cols, dtype=torch.int64))
    return perms


def _inner_of_pairs(outer: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The block-diagonal inner permutation that pairs unit ``l`` of A's block ``i`` with unit
    ``cols[i, l]`` of B's block ``outer[i]`` (``cols``: (nb, bs), local indices)."""
    nb, bs = cols.shape
    inner = torch.empty(nb * bs, dtype=torch.int64)
    # The inner permutation belongs to B's block: block outer[i] of it is that block's order.
    inner.view(nb, bs)[outer] = outer.view(-1, 1) * bs + cols
    return inner


def _row_similarity(
    spec: PermutationSpec,
    sa: Mapping[str, torch.Tensor],
    sb: Mapping[str, torch.Tensor],
    perms: Mapping[str, torch.Tensor],
    key: str,
    axis: int,
    held: Mapping[str, torch.Tensor],
    pos: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The products of A's rows at ``pos`` (n, k) along ``axis`` with B's, B permuted by
    ``perms`` along every axis and by ``{**perms, **held}`` along this one: (n, n)."""
    b = sb[key]
    for ax in range(b.ndim):
        index = spec.axis_index(key, ax, perms if ax != axis else {**perms, **held})
        if index is not None:
            b = b.index_select(ax, index.to(b.device))
    n = pos.shape[0]
    rows_a = sa[key].index_select(axis, pos.reshape(-1).to(sa[key].device)).movedim(axis, 0)
    rows_b = b.index_select(axis, pos.reshape(-1).to(b.device)).movedim(axis, 0)
    return (rows_a.reshape(n, -1).to(dtype) @ rows_b.reshape(n, -1).to(dtype).T).cpu()


def _blocks_step(
    spec: PermutationSpec,
    sa: Mapping[str, torch.Tensor],
    sb: Mapping[str, torch.Tensor],
    perms: Mapping[str, torch.Tensor],
    outer: str | int,
    chosen: set[str],
    dtype: torch.dtype,
    fixed_inner: str | None = None,
) -> dict[str, torch.Tensor]:
    """The best outer permutation of ``outer`` and inner permutations of its Blocks groups, the
    other groups held: an assignment of assignments.

    With ``fixed_inner`` (a Blocks group whose ``outer`` blocks stay in place) only that
    group's blocks are matched, each with itself.

    For every inner group and every pair (block ``i`` of A, block ``j`` of B) the units of
    the two blocks are paired by one assignment problem (all ``nb * nb`` of them in one
    batched solve); the best values, summed over the inner groups and added to the
    outer group's own similarity on its other axes, are the outer assignment's
    similarity; each block then keeps the inner assignment of the pair it is matched in.
    """
    inners = [fixed_inner] if fixed_inner is not None else [d for d, o in spec.blocks.items() if o == outer]
    nb = spec.num_blocks(inners[0])
    held = {d: torch.arange(spec.sizes[d]) for d in inners}
    outer_sim = torch.zeros(nb, nb, dtype=torch.float64)
    if fixed_inner is None:
        held[outer] = torch.arange(nb)  # type: ignore[index]
        for key, axis in spec.group_axes[outer]:  # type: ignore[index]
            pos = spec.unit_positions(key, axis, outer, outer_blocks=False)  # type: ignore[arg-type]
            if key in chosen and pos.shape[1]:
                outer_sim += _row_similarity(spec, sa, sb, perms, key, axis, held, pos, dtype).double()
    pairs = {}
    for d in inners:
        n, bs = spec.sizes[d], spec.block_size(d)
        sim = torch.zeros(n, n, dtype=dtype)
        for key, axis in spec.group_axes[d]:
            if key in chosen:
                sim += _row_similarity(spec, sa, sb, perms, key, axis, held, spec.unit_positions(key, axis, d), dtype)
        # (A block i, B block j) -> the (bs, bs) similarity of their units.
        stack = sim.double().view(nb, bs, nb, bs).permute(0, 2, 1, 3).reshape(nb * nb, bs, bs).contiguous()
        _, cols = pyperm.batch_linear_sum_assignment(stack.numpy(), maximize=True)
        cols = torch.as_tensor(cols, dtype=torch.int64)
        outer_sim += stack.gather(2, cols.unsqueeze(2)).sum((1, 2)).view(nb, nb)
        pairs[d] = cols.view(nb, nb, bs)
    if fixed_inner is not None:  # the blocks stay: each keeps the matching with itself
        best = torch.arange(nb)
        step = {}
    else:
        _, cols_outer = pyperm.linear_sum_assignment(outer_sim.numpy(), maximize=True)
        best = torch.as_tensor(cols_outer, dtype=torch.int64)
        step = {outer: best}
    for d, cols in pairs.items():
        step[d] = _inner_of_pairs(best, cols[torch.arange(nb), best])
    return step


def _check_sweeps(max_iter: Any, tol: Any) -> None:
    """The checks of ``max_iter`` and ``tol`` shared by both matchers."""
    if isinstance(max_iter, bool) or not isinstance(max_iter, (int, np.integer)):
        raise TypeError(f"max_iter must be an int, got {type(max_iter).__name__}")
    if max_iter < 0:
        raise ValueError(f"max_iter must be non-negative, got {max_iter}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol must be a non-negative finite number, got {tol!r}")


def _match_structured(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    max_iter: int,
    seed: Any,
    init: Mapping[str, Any] | None,
    keys: Iterable[str] | None,
    tol: float,
    dtype: torch.dtype,
    callback: Callable[[int, Mapping[str, torch.Tensor], float], bool | None] | None,
) -> WeightMatchingResult:
    """Algorithm 1 on a spec with structured axes: a plain reference implementation, not the fast matcher.

    A group's similarity sums, over every axis it acts on, the products of the rows its
    units own there (:meth:`PermutationSpec.unit_positions`) with B permuted along every
    other axis. A group acting on two axes of one tensor makes the objective quadratic
    in its permutation; each step then solves the linearisation with the other
    occurrence held at its current value (coordinate descent), and a step is kept only
    if the exact objective rises, so the objective never decreases. A :class:`~pyperm.nn.spec.Blocks` outer
    group and its inner groups move in one step (:func:`_blocks_step`), kept likewise only
    if the exact objective rises.
    """
    _check_sweeps(max_iter, tol)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    gen = torch_generator(seed)
    sa = _check_state(spec, state_a, "state_a", flat=False)
    sb = _check_state(spec, state_b, "state_b", flat=False)
    chosen = _objective_keys(spec, sa, keys)
    perms = as_permutations(spec, init) if init is not None else dict(spec.identity())
    objective = [_objective(spec, sa, sb, perms, chosen)]
    current = objective[0]
    chosen_set = set(chosen)
    # Groups acting on two axes of one tensor make the objective quadratic in their permutation.
    quadratic = {g for g, where in spec.group_axes.items() if len({k for k, _ in where}) < len(where)}
    block_outers = {o for o in spec.blocks.values() if isinstance(o, str)}
    sweeps, converged = 0, max_iter == 0
    for sweeps in range(1, max_iter + 1):
        improved = False
        for gi in torch.randperm(len(spec.groups), generator=gen).tolist():
            g = spec.groups[gi]
            n = spec.sizes[g]
            fixed_blocks = g in spec.blocks and not isinstance(spec.blocks[g], str)
            if g in spec.blocks and not fixed_blocks:  # moved with its outer group (alone it would cross blocks)
                continue
            if g in block_outers or fixed_blocks:
                step = _blocks_step(spec, sa, sb, perms, spec.blocks[g] if fixed_blocks else g, chosen_set, dtype,
                                    fixed_inner=g if fixed_blocks else None)  # fmt: skip
                if all(torch.equal(p, perms[h]) for h, p in step.items()):
                    continue
                value = _objective(spec, sa, sb, {**perms, **step}, chosen)
                if value > current + tol * max(abs(current), 1.0):
                    perms.update(step)
                    current, improved = value, True
                continue
            sim = torch.zeros(n, n, dtype=dtype)
            for key, axis in spec.group_axes[g]:
                if key in chosen_set:
                    # B permuted everywhere except where g sits on this axis (the other groups
                    # of the axis are not read: only g's rows enter).
                    pos = spec.unit_positions(key, axis, g)
                    sim += _row_similarity(spec, sa, sb, perms, key, axis, {g: torch.arange(n)}, pos, dtype)
            _, cols = pyperm.linear_sum_assignment(sim.double().numpy(), maximize=True)
            candidate = torch.as_tensor(cols, dtype=torch.int64)
            if torch.equal(candidate, perms[g]):
                continue
            if g in quadratic:  # the step changed the other occurrence too: evaluate it exactly
                value = _objective(spec, sa, sb, {**perms, g: candidate}, chosen)
            else:  # linear in P_g: the gain reads off the similarity
                rows = torch.arange(n)
                value = current + float(sim[rows, candidate].double().sum() - sim[rows, perms[g]].double().sum())
            if value > current + tol * max(abs(current), 1.0):
                perms[g], current, improved = candidate, value, True
        objective.append(current)
        stop = callback(sweeps, perms, current) if callback is not None else None
        if not improved:
            converged = True
            break
        if stop:
            break
    return WeightMatchingResult(perms={g: p.cpu() for g, p in perms.items()}, objective=objective, sweeps=sweeps,
                                converged=converged)  # fmt: skip



class WeightMatcher:
    """Weight matching of any number of models A against one model B, reusing all it can.

    Holds B's tensors arranged for the similarity products, the similarity buffers and
    every group's warm-started assignment solver. :meth:`match` arranges a new A and runs
    Algorithm 1 from the given permutations; between calls with nearby A's (the free
    weights of successive STE steps, the mean of the other models in ``merge_many``) the
    solvers start from the previous answer, so a match costs about one sweep of
    similarity products. :func:`weight_matching` is one match of a fresh matcher.

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups.
    state_b : mapping of str to torch.Tensor
        The model to be permuted: the spec's keys, finite values, one device.
    keys : iterable of str, optional
        The entries that enter the objective (default: every floating-point entry).
    dtype : torch.dtype, default torch.float32
        Precision of the similarity matrices.
    """

    def __init__(
        self,
        spec: PermutationSpec,
        state_b: Mapping[str, torch.Tensor],
        *,
        keys: Iterable[str] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not isinstance(spec, PermutationSpec):
            raise TypeError(f"spec must be a PermutationSpec, got {type(spec).__name__}")
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.spec = spec
        self.dtype = dtype
        self.state_b = _check_state(spec, state_b, "state_b")
        self.keys = _objective_keys(spec, self.state_b, keys)
        devices = {self.state_b[k].device for k in self.keys}
        if len(devices) > 1:
            raise ValueError(f"state_b must be on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        key_set = set(self.keys)
        self._matched = {g: [(k, ax) for k, ax in spec.group_axes[g] if k in key_set] for g in spec.sizes}
        self._norms_b: dict[str, float] | None = None  # ||B|| of the grouped entries (overflow bounds)
        self._groups: dict[str, GroupSimilarity] | None = None  # built at the first match (they need an A)
        self._scratch: dict = {}

    def _arrange(self, sa: Mapping[str, torch.Tensor]) -> dict[str, GroupSimilarity]:
        """Every group's similarity state for a new A (built once, then re-pointed at each A)."""
        spec, dtype = self.spec, self.dtype
        if self._groups is None:
            self._groups = {}
            for g, n in spec.sizes.items():
                terms = [
                    Term(axis, spec.axes[key], sa[key].to(dtype), self.state_b[key].to(dtype), self._scratch)
                    for key, axis in self._matched[g]
                ]
                self._groups[g] = GroupSimilarity(g, n, terms, dtype, self.device)
        else:
            for g, group in self._groups.items():
                for t, (key, _) in zip(group.all_terms, self._matched[g]):
                    t.set_a(sa[key].to(dtype))
                group.a_changed()
        if self._norms_b is None:
            grouped = {k for where in self._matched.values() for k, _ in where}
            self._norms_b = {k: frobenius_norm(self.state_b[k]) for k in grouped}
        largest = torch.finfo(dtype).max
        norms_a = {k: frobenius_norm(sa[k]) for k in self._norms_b}
        for g, group in self._groups.items():
            # By Cauchy-Schwarz no similarity entry (nor partial sum) exceeds this bound: below
            # it, the matrices need no finiteness check.
            bound = sum(norms_a[k] * self._norms_b[k] for k, _ in self._matched[g])
            group.may_overflow = not bound < largest / 2
        return self._groups

    def match(
        self,
        state_a: Mapping[str, torch.Tensor],
        *,
        init: Mapping[str, Any] | None = None,
        max_iter: int = 100,
        seed: int | torch.Generator = 0,
        tol: float = 1e-12,
        progress: bool = False,
        callback: Callable[[int, Mapping[str, torch.Tensor], float], bool | None] | None = None,
    ) -> WeightMatchingResult:
        """Permutations of B maximising its match with ``state_a`` (see :func:`weight_matching`)."""
        spec = self.spec
        _check_sweeps(max_iter, tol)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
        gen = torch_generator(seed)
        sa = _check_state(spec, state_a, "state_a")
        sb = self.state_b
        devices = {sa[k].device for k in self.keys} | ({self.device} if self.keys else set())
        if len(devices) > 1:
            raise ValueError(f"state_a and state_b must be on one device, found {sorted(map(str, devices))}")
        device = self.device
        start = as_permutations(spec, init, "init") if init is not None else spec.identity()
        perms = {g: p.to(device) for g, p in start.items()}
        # Validates shapes and finiteness of every matched entry in the same pass.
        objective = _objective(spec, sa, sb, perms, self.keys)
        groups = self._arrange(sa)
        # Every group is visited (in the seeded order), even one whose similarity is all zero:
        # its assignment then changes nothing, and the visiting order matches the reference
        # implementation's for a given seed.
        names = list(spec.sizes)
        dependents = {g: [h for h in names if g in groups[h].neighbours] for g in names}
        cpu_fallback = device.type == "cuda" and not pyperm.cuda_available()
        if cpu_fallback:
            warnings.warn(
                "weight_matching: pyperm's CUDA solvers are not available, so the assignments of these CUDA "
                "tensors are solved on the CPU (slower); see pyperm.cuda_available()",
                UserWarning,
                stacklevel=3,
            )

        history = [objective]
        bar = progress_bar(progress, max_iter, "weight matching", "sweep")
        converged = False
        sweeps = 0
        try:
            for _ in range(max_iter):
                sweeps += 1
                improved = False
                order = [names[i] for i in torch.randperm(len(names), generator=gen).tolist()] if names else []
                for g in order:
                    group = groups[g]
                    if not group.stale:
                        continue  # no neighbour moved since its last solve: the same answer
                    group.stale = False
                    cost = group.negated_similarity(perms)
                    if group.may_overflow and not bool(torch.isfinite(cost).all()):
                        raise ValueError(
                            f"the similarity matrix of group {g!r} is not finite: the weights are too large "
                            f"for {self.dtype}; rescale them or pass dtype=torch.float64"
                        )
                    if cpu_fallback:
                        new = pyperm.linear_sum_assignment(cost.cpu())[1].to(device)
                    else:
                        new = group.assign()
                    old = perms[g]
                    if torch.equal(new, old):
                        continue
                    # The similarity is minus the cost.
                    old_val = -float(cost.gather(1, old[:, None]).double().sum())
                    new_val = -float(cost.gather(1, new[:, None]).double().sum())
                    gain = new_val - old_val
                    if gain <= tol * max(abs(old_val), abs(new_val)):
                        continue  # a tie, or rounding: keep the current permutation
                    perms[g] = new
                    objective += gain
                    improved = True
                    for other in dependents[g]:
                        groups[other].stale = True
                history.append(objective)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(objective=f"{objective:.6g}")
                stop = callback is not None and bool(callback(sweeps, perms, objective))
                if not improved:
                    converged = True
                    break
                if stop:
                    break
        finally:
            if bar is not None:
                bar.close()
        logger.debug("weight_matching: %d sweeps, converged=%s, objective %.6g", sweeps, converged, history[-1])
        return WeightMatchingResult(
            perms={g: p.cpu() for g, p in perms.items()}, objective=history, sweeps=sweeps, converged=converged
        )
