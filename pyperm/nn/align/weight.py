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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import pyperm
from pyperm._lap import incremental_solver, solve_square_warm
from pyperm._progress import progress_bar
from pyperm.nn.permute import as_permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["WeightMatchingResult", "weight_matching", "matching_objective"]

logger = logging.getLogger(__name__)

# A rank-k correction costs two gathers and a subtraction more per moved unit than a
# recomputation; past this fraction of moved units a term is recomputed from scratch, and
# after _MAX_CORRECTIONS corrections too (recomputing clears the float rounding that
# corrections accumulate).
_REBUILD_FRACTION = 0.5
_MAX_CORRECTIONS = 64
# Groups up to this size keep one incremental assignment solver between visits (see _Group.assign).
_INCREMENTAL_UP_TO = 1024


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


class _Term:
    """One (tensor, axis) pair of a group: its contribution to the group's similarity.

    ``a`` and ``b`` are arranged so that the contribution and its rank-``k`` corrections
    are single matrix products of ``(n, K)`` views (:meth:`rows`): ``(n, m, r)`` (the
    group's axis first, the axis of the one other group second, everything else flattened
    into ``r``) for a convolution's output axis and for any first axis without another
    group (views, and gathers copy blocks of ``r``), else ``(m, r, n)`` (a view for a
    linear layer's input axis; a linear layer's output axis is transposed once, so that
    its gathers copy whole rows). ``m = 1`` when there is no other group; permuting it is
    one gather along axis ``gather_dim``. A
    tensor with two or more other groups (rare) is kept as it is and its term recomputed
    whole when any of them changes. ``value`` is minus the (n, n) contribution at the
    permutations in ``snap`` (the solvers minimise; a product with ``alpha=-1`` rounds
    exactly like the negated product, so the sign costs nothing).
    """

    __slots__ = (
        "axis", "other", "general_axes", "a", "b", "gather_dim", "snap", "value", "corrections", "scratch"
    )

    def __init__(self, axis: int, groups: tuple, ta: torch.Tensor, tb: torch.Tensor, scratch: dict) -> None:
        self.axis = axis
        others = [(ax, g) for ax, g in enumerate(groups) if g is not None and ax != axis]
        self.other: str | None = None
        self.general_axes: list[tuple[int, str]] | None = None
        self.snap: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.corrections = 0  # rank-k corrections applied to value since it was computed whole
        self.scratch = scratch  # gather buffers shared by the terms of one weight_matching call
        n = ta.shape[axis]
        if len(others) <= 1:
            middle = [ax for ax, _ in others]
            rest = [ax for ax in range(ta.ndim) if ax != axis and ax not in middle]
            m = ta.shape[middle[0]] if middle else 1
            r = math.prod(ta.shape[ax] for ax in rest)
            if axis == 0 and (r > 1 or not others):  # a view: no copy
                order, shape, self.gather_dim = [axis, *middle, *rest], (n, m, -1), 1
            else:
                order, shape, self.gather_dim = [*middle, *rest, axis], (m, -1, n), 0
            self.a = ta.permute(order).reshape(shape).contiguous()
            self.b = tb.permute(order).reshape(shape).contiguous()
            if others:
                self.other = others[0][1]
        else:
            self.general_axes = others
            self.a = ta.movedim(axis, 0).reshape(n, -1).contiguous()
            self.b = tb

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (arranged like ``a``) as an (n, K) matrix view, the group's units as rows."""
        return x.view(x.shape[0], -1) if self.gather_dim == 1 else x.view(-1, x.shape[-1]).T

    def _gather(self, index: torch.Tensor, slot: int) -> torch.Tensor:
        """``b`` with ``index`` taken along ``gather_dim``, written into a reused buffer
        (fresh allocations of this size cost page faults comparable to the copy itself)."""
        shape = list(self.b.shape)
        shape[self.gather_dim] = index.numel()
        key = (tuple(shape), self.b.dtype, self.b.device, slot)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = torch.empty(shape, dtype=self.b.dtype, device=self.b.device)
        return torch.index_select(self.b, self.gather_dim, index, out=buf)

    def full(self, perms: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Minus the whole contribution at the given permutations (into ``value`` when it exists)."""
        if self.general_axes is not None:
            n = self.a.shape[0]
            b = self.b
            for ax, g in self.general_axes:
                b = b.index_select(ax, perms[g])
            x, y = self.a, b.movedim(self.axis, 0).reshape(n, -1)
        else:
            x = self.rows(self.a)
            y = self.rows(self.b if self.other is None else self._gather(perms[self.other], 0))
        out = self.value if self.value is not None else x.new_empty((x.shape[0], y.shape[0]))
        return torch.addmm(out, x, y.T, beta=0, alpha=-1, out=out)

    def add_full_to(self, out: torch.Tensor, perms: Mapping[str, torch.Tensor]) -> None:
        """Subtracts the whole contribution at the given permutations from ``out`` and
        records them in ``snap`` (row-layout terms, see ``_Group.summed``)."""
        x, y = self.rows(self.a), self.rows(self._gather(perms[self.other], 0))
        torch.addmm(out, x, y.T, alpha=-1, out=out)
        self.snap = perms[self.other].clone()

    def change(self, cur: torch.Tensor, idx: torch.Tensor, reuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Minus the contribution's change since ``snap`` is ``-X @ Y.T``, for the units
        ``idx`` of the other group that moved to ``cur``; returns ``(X, Y)``, each (n, K),
        and advances ``snap``.

        ``A[S] (B[cur(S)] - B[snap(S)])^T`` over the moved units ``S``: rank ``k`` (times
        ``r``). ``reuse``: gather into the reused buffers (the result must then be used
        before the next gather of this call), else into fresh tensors.
        """
        if reuse:
            diff = self._gather(cur[idx], 1).sub_(self._gather(self.snap[idx], 2))
        else:
            diff = self.b.index_select(self.gather_dim, cur[idx]).sub_(
                self.b.index_select(self.gather_dim, self.snap[idx])
            )
        moved = self.a.index_select(self.gather_dim, idx)
        self.snap = cur.clone()
        return self.rows(moved), self.rows(diff)

    def current(self, perms: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.general_axes is not None:
            return torch.cat([perms[g] for _, g in self.general_axes])
        return perms[self.other]

    def update(self, perms: Mapping[str, torch.Tensor]) -> bool:
        """Brings ``value`` up to date; returns whether it changed."""
        cur = self.current(perms)
        if self.value is None:
            self.value = self.full(perms)
            self.snap = cur.clone()
            return True
        if self.general_axes is not None:
            if torch.equal(cur, self.snap):
                return False
            self.value = self.full(perms)
            self.snap = cur.clone()
            return True
        idx = torch.nonzero(cur != self.snap).flatten()
        k = idx.numel()
        if k == 0:
            return False
        if k > _REBUILD_FRACTION * self.a.shape[self.gather_dim] or self.corrections >= _MAX_CORRECTIONS:
            # Most units moved: recompute (exact, and clears the rounding corrections accumulate).
            self.full(perms)
            self.corrections = 0
            self.snap = cur.clone()
        else:
            # Only the k moved units of the other group: a rank-k (times r) correction.
            x, y = self.change(cur, idx, reuse=True)
            self.value.addmm_(x, y.T, alpha=-1)
            self.corrections += 1
        return True


class _Group:
    """A group's similarity matrix, kept in sync with its neighbours' permutations."""

    def __init__(self, name: str, n: int, terms: list[_Term], dtype: torch.dtype, device: torch.device) -> None:
        self.name = name
        self.n = n
        self.terms = [t for t in terms if t.other is not None or t.general_axes is not None]
        # Minus the sum of the terms that involve no other group (biases, BatchNorm vectors,
        # the model's input and output layers): one product over their joined columns.
        fixed = [t for t in terms if t.other is None and t.general_axes is None]
        self.const: torch.Tensor | None = None
        if fixed:
            x = torch.cat([t.rows(t.a) for t in fixed], dim=1)
            y = torch.cat([t.rows(t.b) for t in fixed], dim=1)
            self.const = torch.addmm(x.new_empty((n, n)), x, y.T, beta=0, alpha=-1)
        self.neighbours = {t.other for t in self.terms if t.other is not None}
        self.neighbours |= {g for t in self.terms if t.general_axes for _, g in t.general_axes}
        self.stale = True  # whether the neighbours moved since the last assignment
        self.cost = torch.empty((n, n), dtype=dtype, device=device)  # minus the similarity, rewritten at each visit
        self.solver: Any = None  # the CPU solver bound to cost (small groups)
        self.duals: np.ndarray | None = None  # column duals of the last JV solve (large groups)
        self.may_overflow = True  # whether its similarity entries could overflow the dtype
        # Summed mode (see negated_similarity): every term in the row layout (m, r, n).
        self.summed = bool(self.terms) and all(t.general_axes is None and t.gather_dim == 0 for t in self.terms)
        self.built = False  # summed mode: cost holds the similarity at the terms' snaps
        self.corrections = 0  # summed mode: corrections applied to cost since it was built

    def negated_similarity(self, perms: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Minus the similarity matrix at the current permutations (the solvers minimise),
        written into this group's own ``cost`` matrix.

        Summed mode (every term in the row layout, as in MLPs): ``cost`` itself is kept, and
        a visit applies the changes of all its terms as one product whose inner dimension
        concatenates their moved units. No term keeps its own value and no sum is taken per
        visit; a term whose other group moved almost entirely is corrected all the same (as
        many operations as recomputing it, gathers of whole rows). After _MAX_CORRECTIONS
        corrections, ``cost`` is rebuilt from scratch, which clears their rounding.

        Otherwise each term keeps its value (corrected in place, or recomputed when most of
        its other group moved, which a convolution's output layout makes cheaper than a
        correction), and ``cost`` is summed afresh from them at each visit.
        """
        if self.summed:
            if self.built and self.corrections < _MAX_CORRECTIONS:
                changes = []
                for t in self.terms:
                    cur = perms[t.other]
                    idx = torch.nonzero(cur != t.snap).flatten()
                    if idx.numel():
                        changes.append(t.change(cur, idx, reuse=False))
                if changes:
                    # Row-layout operands are transposed views of (K, n) blocks: joined as such.
                    x = torch.cat([c[0].T for c in changes]).T
                    y = torch.cat([c[1].T for c in changes]).T
                    self.cost.addmm_(x, y.T, alpha=-1)
                    self.corrections += 1
                return self.cost
            if self.const is None:
                self.cost.zero_()
            else:
                self.cost.copy_(self.const)
            for t in self.terms:
                t.add_full_to(self.cost, perms)
            self.built = True
            self.corrections = 0
            return self.cost
        for t in self.terms:
            t.update(perms)
        parts = ([self.const] if self.const is not None else []) + [t.value for t in self.terms]
        if len(parts) == 1:
            self.cost.copy_(parts[0])
        elif len(parts) > 1:
            torch.add(parts[0], parts[1], out=self.cost)
            for part in parts[2:]:
                self.cost += part
        return self.cost

    def assign(self) -> torch.Tensor:
        """The minimising assignment (column of each row) of ``cost``, on the CPU.

        Successive costs of a group differ little, so solves are warm-started. Up to
        ``_INCREMENTAL_UP_TO`` units one solver stays bound to ``cost`` and keeps its
        matching and column duals from visit to visit, re-assigning only the rows whose
        matched entry stopped being a minimum of their reduced row. Larger matrices do not
        fit in cache, and the JV solver started from the previous column duals is faster
        there: it builds a row's cache of smallest columns only when the row needs more
        than one look. Measured on MLP 784-[2048]x4-10: 4.5 ms against 9 ms per solve. At
        512 units: 0.5 ms against 0.85 ms, and first solves 0.6-0.8 ms against 1.7-1.9 ms.
        """
        cost = self.cost.numpy()
        if self.n <= _INCREMENTAL_UP_TO:
            if self.solver is None:
                self.solver = incremental_solver(cost)
            return torch.from_numpy(self.solver.solve())
        if self.duals is None:
            self.duals = cost.min(axis=0)
        return torch.from_numpy(solve_square_warm(cost, self.duals))


def _check_state(spec: PermutationSpec, state: Any, name: str) -> dict[str, torch.Tensor]:
    if not isinstance(state, Mapping):
        raise TypeError(f"{name} must be a mapping of names to tensors, got {type(state).__name__}")
    for key in spec.axes:
        if key in state and not isinstance(state[key], torch.Tensor):
            raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(state[key]).__name__}")
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


def _make_generator(seed: int | torch.Generator) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int or a torch.Generator, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    return torch.Generator().manual_seed(int(seed))


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """``sum(a * b)`` of two equal-shape tensors: float32 dot products of rows of 1024,
    accumulated in float64 (as accurate as a float64 dot here, without float64 copies)."""
    a = a.reshape(-1)
    b = b.reshape(-1)
    if a.dtype == torch.float64 or b.dtype == torch.float64:
        return float(torch.dot(a.double(), b.double()))
    a = a.float()
    b = b.float()
    k = a.numel() // 1024 * 1024
    total = 0.0
    if k:
        total += float(torch.linalg.vecdot(a[:k].view(-1, 1024), b[:k].view(-1, 1024)).double().sum())
    if k < a.numel():
        total += float(torch.dot(a[k:].double(), b[k:].double()))
    return total


def _norm(t: torch.Tensor) -> float:
    """Frobenius norm (inf when it overflows float32, which only makes the bound conservative)."""
    return float(torch.linalg.vector_norm(t if t.dtype == torch.float64 else t.float()))


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
            if g in moved:
                b = b.index_select(ax, perms[g].to(b.device))
        term = _dot(a, b.to(a.device))
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
    sa = _check_state(spec, state_a, "state_a")
    sb = _check_state(spec, state_b, "state_b")
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
        model, or :meth:`PermutationSpec.from_model`).
    state_a, state_b : mapping of str to torch.Tensor
        The two models' state dicts, exactly the spec's keys, equal shapes, finite values,
        all on one device. B is the model to be permuted.
    max_iter : int, default 100
        Most sweeps over the groups.
    seed : int or torch.Generator, default 0
        Seeds the order in which the groups are visited (the global RNG is never used).
    init : mapping of str to (n,) int array, optional
        Initial permutations (default: the identity).
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
    if not isinstance(spec, PermutationSpec):
        raise TypeError(f"spec must be a PermutationSpec, got {type(spec).__name__}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, (int, np.integer)):
        raise TypeError(f"max_iter must be an int, got {type(max_iter).__name__}")
    if max_iter < 0:
        raise ValueError(f"max_iter must be non-negative, got {max_iter}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol must be a non-negative finite number, got {tol!r}")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    gen = _make_generator(seed)
    sa = _check_state(spec, state_a, "state_a")
    sb = _check_state(spec, state_b, "state_b")
    obj_keys = _objective_keys(spec, sa, keys)
    devices = {t.device for k in obj_keys for t in (sa[k], sb[k])}
    if len(devices) > 1:
        raise ValueError(f"state_a and state_b must be on one device, found {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    start = as_permutations(spec, init, "init") if init is not None else spec.identity()
    perms = {g: p.to(device) for g, p in start.items()}
    # Validates shapes and finiteness of every matched entry in the same pass.
    objective = _objective(spec, sa, sb, perms, obj_keys)

    # Arrange every (tensor, axis) pair once.
    key_set = set(obj_keys)
    groups: dict[str, _Group] = {}
    scratch: dict = {}
    largest = torch.finfo(dtype).max
    # ||A|| ||B|| of each entry that some group acts on, once per entry.
    grouped = [key for key in obj_keys if any(g is not None for g in spec.axes[key])]
    norms = {key: _norm(sa[key]) * _norm(sb[key]) for key in grouped}
    for g, n in spec.sizes.items():
        matched = [(key, axis) for key, axis in spec.group_axes[g] if key in key_set]
        terms = [_Term(axis, spec.axes[key], sa[key].to(dtype), sb[key].to(dtype), scratch) for key, axis in matched]
        groups[g] = _Group(g, n, terms, dtype, device)
        # By Cauchy-Schwarz no similarity entry (nor partial sum) exceeds this bound: below
        # it, the matrices need no finiteness check.
        bound = sum(norms[key] for key, _ in matched)
        groups[g].may_overflow = not bound < largest / 2
    # Every group is visited (in the seeded order), even one whose similarity is all zero:
    # its assignment then changes nothing, and the visiting order matches the reference
    # implementation's for a given seed.
    names = list(spec.sizes)
    dependents = {g: [h for h in names if g in groups[h].neighbours] for g in names}

    history = [objective]
    use_cuda = device.type == "cuda" and pyperm.cuda_available()
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
                        f"for {dtype}; rescale them or pass dtype=torch.float64"
                    )
                if device.type == "cpu":
                    new = group.assign()
                elif use_cuda:
                    new = pyperm.linear_sum_assignment(cost)[1]
                else:
                    new = pyperm.linear_sum_assignment(cost.cpu())[1].to(device)
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
            if not improved:
                converged = True
                break
    finally:
        if bar is not None:
            bar.close()
    logger.debug("weight_matching: %d sweeps, converged=%s, objective %.6g", sweeps, converged, history[-1])
    return WeightMatchingResult(
        perms={g: p.cpu() for g, p in perms.items()}, objective=history, sweeps=sweeps, converged=converged
    )

