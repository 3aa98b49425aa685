"""The similarity matrices of weight matching, kept in sync with the permutations.

Each group's linear assignment problem (Git Re-Basin eq. 2) sums, over the tensor axes the
group acts on, a product of A's tensor with B's tensor permuted by the other groups. A
:class:`Term` is one such (tensor piece, axis) product and a :class:`GroupSimilarity` their sum
with the group's warm-started solver; :mod:`pyperm.nn.align._matcher` drives the sweeps over
them, on the pieces :mod:`pyperm.nn.align._pieces` lowers every spec form to (the labels of a
piece's axes are group names or Blocks forms; a Term only reads them as keys of ``perms``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from pyperm.lap.warm import WarmAssigner

# A rank-k correction costs two gathers and a subtraction more per moved unit than a
# recomputation; past this fraction of moved units a term is recomputed from scratch, and
# after _MAX_CORRECTIONS corrections too (recomputing clears the float rounding that
# corrections accumulate).
_REBUILD_FRACTION = 0.5
_MAX_CORRECTIONS = 64
# Groups up to this size keep one incremental assignment solver between visits (see GroupSimilarity.assign).
_INCREMENTAL_UP_TO = 1024


class Term:
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
        "axis", "other", "general_axes", "a", "b", "gather_dim", "snap", "value", "corrections", "scratch",
        "arrangement",
    )

    def __init__(self, axis: int, groups: tuple, ta: torch.Tensor, tb: torch.Tensor, scratch: dict) -> None:
        self.axis = axis
        others = [(ax, g) for ax, g in enumerate(groups) if g is not None and ax != axis]
        self.other: str | None = None
        self.general_axes: list[tuple[int, str]] | None = None
        self.snap: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.corrections = 0  # rank-k corrections applied to value since it was computed whole
        self.scratch = scratch  # gather buffers shared by the terms of one matcher
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
            self.arrangement: tuple = (order, shape)
            self.b = tb.permute(order).reshape(shape).contiguous()
            if others:
                self.other = others[0][1]
        else:
            self.general_axes = others
            self.arrangement = ([axis, *(ax for ax in range(ta.ndim) if ax != axis)], (n, -1))
            self.b = tb
        self.set_a(ta)

    def set_a(self, ta: torch.Tensor) -> None:
        """Arrange a new tensor of model A; the contribution is then recomputed whole at its next use."""
        order, shape = self.arrangement
        self.a = ta.permute(order).reshape(shape).contiguous()
        self.value = None
        self.snap = None
        self.corrections = 0

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

    def _permuted_b(self, index: torch.Tensor) -> torch.Tensor:
        """``b`` permuted by the other group: itself at the identity (the usual start), which
        saves a copy of the whole tensor."""
        if bool((index == torch.arange(index.numel(), device=index.device)).all()):
            return self.b
        return self._gather(index, 0)

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
            y = self.rows(self.b if self.other is None else self._permuted_b(perms[self.other]))
        out = self.value if self.value is not None else x.new_empty((x.shape[0], y.shape[0]))
        return torch.addmm(out, x, y.T, beta=0, alpha=-1, out=out)

    def add_full_to(self, out: torch.Tensor, perms: Mapping[str, torch.Tensor]) -> None:
        """Subtracts the whole contribution at the given permutations from ``out`` and
        records them in ``snap`` (row-layout terms, see ``GroupSimilarity.summed``)."""
        x, y = self.rows(self.a), self.rows(self._permuted_b(perms[self.other]))
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


class GroupSimilarity:
    """A group's similarity matrix, kept in sync with its neighbours' permutations."""

    def __init__(self, name: str, n: int, terms: list[Term], dtype: torch.dtype, device: torch.device) -> None:
        self.name = name
        self.n = n
        self.all_terms = list(terms)  # in the caller's order, for Term.set_a
        self.terms = [t for t in terms if t.other is not None or t.general_axes is not None]
        # Minus the sum of the terms that involve no other group (biases, BatchNorm vectors,
        # the model's input and output layers): one product over their joined columns.
        self.fixed = [t for t in terms if t.other is None and t.general_axes is None]
        self.const: torch.Tensor | None = None
        self.neighbours = {t.other for t in self.terms if t.other is not None}
        self.neighbours |= {g for t in self.terms if t.general_axes for _, g in t.general_axes}
        self.stale = True  # whether the neighbours moved since the last assignment
        self.cost = torch.empty((n, n), dtype=dtype, device=device)  # minus the similarity, rewritten at each visit
        # Warm-started solves of cost: its state survives new A tensors (see a_changed), so the
        # projections of STE matching and the matchings of merge_many start warm too.
        self.assigner = WarmAssigner(incremental_up_to=_INCREMENTAL_UP_TO)
        self.may_overflow = True  # whether its similarity entries could overflow the dtype
        # Summed mode (see negated_similarity): every term in the row layout (m, r, n).
        self.summed = bool(self.terms) and all(t.general_axes is None and t.gather_dim == 0 for t in self.terms)
        self.built = False  # summed mode: cost holds the similarity at the terms' snaps
        self.corrections = 0  # summed mode: corrections applied to cost since it was built
        self.a_changed()

    def a_changed(self) -> None:
        """Model A's tensors were replaced (``Term.set_a``): recompute everything at the next visit."""
        if self.fixed:
            x = torch.cat([t.rows(t.a) for t in self.fixed], dim=1)
            y = torch.cat([t.rows(t.b) for t in self.fixed], dim=1)
            if self.const is None:
                self.const = x.new_empty((self.n, self.n))
            torch.addmm(self.const, x, y.T, beta=0, alpha=-1, out=self.const)
        self.stale = True
        self.built = False
        self.corrections = 0

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
        if not parts:  # no entry of the objective reads this group (``keys`` left them out)
            self.cost.zero_()
        elif len(parts) == 1:
            self.cost.copy_(parts[0])
        elif len(parts) > 1:
            torch.add(parts[0], parts[1], out=self.cost)
            for part in parts[2:]:
                self.cost += part
        return self.cost

    def assign(self) -> torch.Tensor:
        """The minimising assignment (column of each row) of ``cost``, on its device.

        Successive costs of a group differ little, so solves are warm-started
        (:class:`pyperm.lap.warm.WarmAssigner`): up to 1024 units one solver stays bound to
        ``cost`` and keeps its matching and duals between visits; larger matrices start JV
        from the previous column duals. Measured on MLP 784-[2048]x4-10: 4.5 ms against
        9 ms per cold solve. At 512 units: 0.5 ms against 0.85 ms.
        """
        return self.assigner.solve(self.cost)


def accurate_dot(a: torch.Tensor, b: torch.Tensor) -> float:
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


def frobenius_norm(t: torch.Tensor) -> float:
    """Frobenius norm (inf when it overflows float32, which only makes the bound conservative)."""
    return float(torch.linalg.vector_norm(t if t.dtype == torch.float64 else t.float()))
