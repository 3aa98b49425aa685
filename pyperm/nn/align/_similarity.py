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
from collections.abc import Callable, Mapping

import torch

from pyperm._gather import index_select
from pyperm.lap.warm import WarmAssigner

# Past this fraction of a group's moved columns its cost is rebuilt rather than corrected, and after
# _MAX_CORRECTIONS corrections too (rebuilding clears the float rounding corrections accumulate). A
# correction multiplies the moved units only (plus two gathers and a subtraction of them, small next
# to a product at these widths); a rebuild multiplies every unit of every term, moved or not. At 0.5
# a residual stream whose one neighbour moved entirely was rebuilt whole (ResNet20x16: 410 GFLOP a
# match; 384 at 0.9, as the matcher that kept every term's product separately).
_REBUILD_FRACTION = 0.9
_MAX_CORRECTIONS = 64
# Groups up to this size keep one incremental assignment solver between visits (GroupSimilarity.assigner).
_INCREMENTAL_UP_TO = 1024
# Bytes of one block of a tensor taken into a product: the bound on every work buffer, enough columns
# for the products to run at the matrix-multiply rate (1489 in float32 at n = 5632). A bfloat16 block
# has twice the entries: each block's product is added into the float32 similarity in one more pass,
# which costs 5% of the product at n = 5632 (11% with blocks of half this size).
BLOCK_BYTES = 32 << 20
# Entries of the float32 buffer of one band of a mixed-dtype subtraction (see Products.subtract): 1 MiB, in cache.
_SUBTRACT_ELEMENTS = 1 << 18
# Entries per block of a bfloat16 or float16 tensor converted to float32 in accurate_dot.
_CONVERT_ELEMENTS = 1 << 18
# Blocks narrower than this many columns are joined with others into one product (see Pending).
_NARROW = 128


def block_elements(dtype: torch.dtype) -> int:
    """Entries of ``dtype`` in one block (BLOCK_BYTES)."""
    return BLOCK_BYTES // torch.empty((), dtype=dtype).element_size()


class Work:
    """Flat buffers reused by every product of a matcher, one per (slot, dtype, device), grown on demand:
    blocks of tensors are gathered and arranged into them instead of fresh allocations (whose page
    faults cost as much as the copy). Each holds one block at most, except the (n, n) product of a
    narrower dtype (see :class:`Products`)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, slot: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        key = (slot, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class Products:
    """``out -= X @ Y.T`` for (n, K) blocks into a similarity matrix ``out``, in the chosen precision.

    ``compute``: the dtype the products run in. Blocks of another dtype are converted into work
    buffers first; a product whose dtype is narrower than ``out``'s (bfloat16 blocks into a float32
    similarity) is one matrix multiply in that dtype, which accumulates in float32 and rounds its
    result once (torch has no float32 output for it on the CPU), added into ``out`` in float32.
    """

    def __init__(self, out_dtype: torch.dtype, compute: torch.dtype, work: Work) -> None:
        self.out_dtype = out_dtype
        self.compute = compute
        self.work = work
        # A similarity whose old values are void (being rebuilt): the next product into it
        # overwrites it, which spares zeroing it first (see GroupSimilarity.negated_similarity).
        self.fresh: torch.Tensor | None = None

    def subtract(self, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        overwrite = self.fresh is out
        if overwrite:
            self.fresh = None
        if x.dtype != self.compute:
            x = self.work.get("x_cast", x.shape, self.compute, x.device).copy_(x)
        if y.dtype != self.compute:
            y = self.work.get("y_cast", y.shape, self.compute, y.device).copy_(y)
        if self.compute == out.dtype:
            out.addmm_(x, y.T, beta=0 if overwrite else 1, alpha=-1)
            return
        product = self.work.get("product", out.shape, self.compute, out.device)
        torch.mm(x, y.T, out=product)
        if overwrite:  # one converting pass (torch.mul writes a float32 out from bfloat16)
            torch.mul(product, -1.0, out=out)
            return
        # torch's mixed-dtype subtraction is slow on the CPU (a 3072 x 3072 bfloat16 operand: 24 ms,
        # against 2 ms to convert it and 3 ms to subtract in float32), so each band of rows is
        # converted into a float32 buffer that stays in cache, then subtracted.
        rows = max(1, _SUBTRACT_ELEMENTS // max(out.shape[1], 1))
        band = self.work.get("band", (min(rows, out.shape[0]), out.shape[1]), out.dtype, out.device)
        for start in range(0, out.shape[0], rows):
            part = product[start:start + rows]
            out[start:start + rows].sub_(band[:part.shape[0]].copy_(part))


class Pending:
    """Moved units' (n, k) blocks of several terms, joined along k until one product takes them all:
    a visit's small corrections cost one pass over the similarity instead of one per term."""

    def __init__(self, n: int, products: Products, device: torch.device, columns: int) -> None:
        self.n = n
        self.products = products
        # A block's worth of columns, or fewer when fewer will come (``columns``: at most what will).
        self.capacity = max(1, min(block_elements(products.compute) // max(n, 1), columns))
        self.x = products.work.get("pending_x", (self.capacity, n), products.compute, device)
        self.y = products.work.get("pending_y", (self.capacity, n), products.compute, device)
        self.k = 0

    def add(self, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        """Queues ``-x @ y.T`` (x, y: (n, K)); flushes into ``out`` when full."""
        k = x.shape[1]
        if k > self.capacity - self.k:
            self.flush(out)
        if k >= _NARROW or k > self.capacity:  # wide enough to be its own product: no copy into the queue
            self.products.subtract(out, x, y)
            return
        self.x[self.k:self.k + k].copy_(x.T)
        self.y[self.k:self.k + k].copy_(y.T)
        self.k += k

    def flush(self, out: torch.Tensor) -> None:
        if self.k:
            self.products.subtract(out, self.x[:self.k].T, self.y[:self.k].T)
            self.k = 0


class Term:
    """One (tensor piece, axis) pair of a group: its contribution to the group's similarity.

    ``a`` and ``b`` are the stored tensors themselves (views, never copies): the contribution
    ``A_(n, K) @ pi(B)_(n, K).T`` (the group's axis as rows, every other axis flattened into
    ``K``, B permuted by the other groups) is summed over blocks of the *block axis* (the axis
    of the one other group, else the longest other axis), each block of B gathered by the
    other group's permutation into a reused buffer (:class:`Work`) and arranged there only
    when its layout cannot be read as a matrix as it is (a linear layer's blocks never are).
    A correction for ``k`` moved units of the other group is the same product over those
    ``k`` units: ``A[S] (B[cur(S)] - B[snap(S)])^T``. A tensor with two or more other groups
    (rare) has every axis but the block axis permuted in each block, and its group rebuilds
    the similarity whenever one of them moves.
    """

    __slots__ = ("axis", "other", "general_axes", "block_axis", "a", "b", "snap", "work", "block", "may_hold", "order",
                 "held_a", "source_a", "whole")

    def __init__(self, axis: int, groups: tuple, ta: torch.Tensor, tb: torch.Tensor, work: Work) -> None:
        self.axis = axis
        others = [(ax, g) for ax, g in enumerate(groups) if g is not None and ax != axis]
        self.other: str | None = others[0][1] if len(others) == 1 else None
        self.general_axes: list[tuple[int, str]] | None = others if len(others) > 1 else None
        rest = [ax for ax in range(ta.ndim) if ax != axis]
        if others:
            self.block_axis: int | None = others[0][0]
        else:
            self.block_axis = max(rest, key=lambda ax: ta.shape[ax]) if rest else None
        self.b = tb
        self.work = work
        # A block that cannot be read as a matrix (a convolution's input-channel axis) is arranged
        # at every product. From its second whole product on (the first would not repay the copy:
        # ResNet20x16 converges in 3 sweeps) such a term holds arranged copies of A and B instead,
        # (block axis, other axes, group axis) in that order, when the cache's ``hold`` grants their bytes: its
        # blocks, gathers and corrections are then (K, n) views, as in the matcher that kept every
        # tensor arranged, within the similarity budget.
        self.may_hold = self.general_axes is None and bool(rest) and not _reads_as_matrix(ta, axis)
        self.order: list[int] | None = None
        self.held_a: torch.Tensor | None = None
        self.source_a = ta
        self.whole = 0  # whole products taken
        # Units of the block axis per block: BLOCK_BYTES at most (one unit at least).
        per_unit = ta.numel() // ta.shape[self.block_axis] if self.block_axis is not None and ta.numel() else 1
        self.block = max(1, block_elements(ta.dtype) // max(per_unit, 1))
        self.snap: torch.Tensor | None = None
        self.set_a(ta)

    def set_a(self, ta: torch.Tensor) -> None:
        """A new tensor of model A; the contribution is then computed whole at its next use."""
        self.source_a = ta
        if self.order is not None:  # into the held copy (the same bytes for every A)
            ta = self.held_a.copy_(ta.permute(self.order))
        self.a = ta
        self.snap = None

    def release_a(self) -> None:
        """Drops the views of model A's tensor until the next :meth:`set_a` (a held copy is kept)."""
        self.source_a = None
        if self.order is None:
            self.a = None
        self.snap = None

    def _take_arranged(self, hold: Callable[[int], bool]) -> None:
        """Holds arranged copies of A and B (see ``__init__``), if ``hold`` grants their bytes."""
        ta = self.source_a
        self.may_hold = False  # asked once
        if not hold(2 * ta.numel() * ta.element_size()):
            return
        rest = [ax for ax in range(ta.ndim) if ax not in (self.axis, self.block_axis)]
        self.order = [self.block_axis, *rest, self.axis]
        self.b = self.b.permute(self.order).contiguous()
        self.held_a = self.a = ta.permute(self.order).contiguous()
        self.axis, self.block_axis = ta.ndim - 1, 0

    @property
    def columns(self) -> int:
        """K: the columns of the contribution's product."""
        return self.a.numel() // max(self.a.shape[self.axis], 1)

    def matrix(self, t: torch.Tensor, slot: str) -> torch.Tensor:
        """A block (axes as ``a``'s) as an (n, K) matrix: a view when its strides allow, else arranged in ``slot``."""
        if self.order is not None:  # held arranged: every block is contiguous, the group's axis last
            return t.view(-1, t.shape[-1]).T
        moved = t.movedim(self.axis, 0)
        try:
            return moved.view(moved.shape[0], -1)
        except RuntimeError:
            buf = self.work.get(slot, moved.shape, t.dtype, t.device)
            return buf.copy_(moved).view(moved.shape[0], -1)

    def _gather(self, index: torch.Tensor, slot: str) -> torch.Tensor:
        """``b`` taken at ``index`` along the block axis, into a work buffer."""
        shape = list(self.b.shape)
        shape[self.block_axis] = index.numel()
        buf = self.work.get(slot, tuple(shape), self.b.dtype, self.b.device)
        return index_select(self.b, self.block_axis, index, out=buf)

    def current(self, perms: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The permutations this contribution depends on (None: none)."""
        if self.general_axes is not None:
            return torch.cat([perms[g] for _, g in self.general_axes])
        return perms[self.other] if self.other is not None else None

    def add_full_to(self, out: torch.Tensor, perms: Mapping[str, torch.Tensor], pending: Pending,
                    hold: Callable[[int], bool] | None = None) -> None:  # fmt: skip
        """Subtracts the whole contribution at the given permutations from ``out`` (narrow blocks are
        queued in ``pending``, whose caller flushes it); records the permutations in ``snap``."""
        if self.block_axis is None:  # a vector: one column
            pending.add(out, self.a.reshape(-1, 1), self.b.reshape(-1, 1))
            return
        self.whole += 1
        if self.may_hold and hold is not None and self.whole == 2:
            self._take_arranged(hold)
        index = perms[self.other] if self.other is not None else None
        if self.general_axes is not None:
            index = perms[self.general_axes[0][1]]
            # The other axes that are not in place (none at the usual identity start: GPT-2's first sweep
            # in bfloat16 spent 3% of its time copying attention blocks unchanged).
            permuted = [(ax, g) for ax, g in self.general_axes[1:] if not _is_range(perms[g], 0)]
        size = self.a.shape[self.block_axis]
        for start in range(0, size, self.block):
            length = min(self.block, size - start)
            x = self.a.narrow(self.block_axis, start, length)
            rows = None if index is None else index[start:start + length]
            if rows is None or _is_range(rows, start):
                y = self.b.narrow(self.block_axis, start, length)
            else:
                y = self._gather(rows, "gather")
            if self.general_axes is not None:  # the other axes permuted too, into work buffers
                for j, (ax, g) in enumerate(permuted):
                    buf = self.work.get(f"general_{j % 2}", y.shape, y.dtype, y.device)
                    y = index_select(y, ax, perms[g], out=buf)
            x, y = self.matrix(x, "arrange_x"), self.matrix(y, "arrange_y")
            if x.shape[1] < _NARROW:
                pending.add(out, x, y)
            else:
                pending.products.subtract(out, x, y)
        cur = self.current(perms)
        self.snap = None if cur is None else cur.clone()

    def add_change_to(self, out: torch.Tensor, cur: torch.Tensor, idx: torch.Tensor, pending: Pending) -> None:
        """Queues minus the contribution's change since ``snap`` for the moved units ``idx`` of the other
        group (now at ``cur``) and advances ``snap``: ``A[S] (B[cur(S)] - B[snap(S)])^T``, in blocks."""
        for start in range(0, idx.numel(), self.block):
            part = idx[start:start + self.block]
            # The slots of a whole product's gathers (add_full_to), free again here: a correction's
            # own slots would add three blocks to the memory the matcher keeps.
            diff = self._gather(cur[part], "gather").sub_(self._gather(self.snap[part], "general_0"))
            moved = index_select(self.a, self.block_axis, part,
                                 out=self.work.get("general_1", diff.shape, self.a.dtype, self.a.device))
            pending.add(out, self.matrix(moved, "arrange_x"), self.matrix(diff, "arrange_y"))
        self.snap = cur.clone()


def _reads_as_matrix(t: torch.Tensor, axis: int) -> bool:
    """Whether ``t`` with ``axis`` first views as an (n, K) matrix (a linear layer's axes do; a
    convolution's input-channel axis does not)."""
    moved = t.movedim(axis, 0)
    try:
        moved.view(moved.shape[0], -1)
    except RuntimeError:
        return False
    return True


def _is_range(index: torch.Tensor, start: int) -> bool:
    """Whether ``index`` is ``start, start + 1, ...`` (B's block is then a view)."""
    return bool((index == torch.arange(start, start + index.numel(), device=index.device)).all())


class CostCache:
    """The similarity matrices kept between visits, within a budget of bytes.

    A kept similarity is corrected by the moved units at the next visit; one evicted (the least
    recently used first, never one used by the current step) is rebuilt from the tensors.
    """

    def __init__(self, budget: int, work: Work | None = None) -> None:
        self.budget = budget
        self.held: dict[GroupSimilarity, int] = {}  # in order of use
        self.step = 0
        self.reserve = 0  # bytes hold() leaves to the similarities
        self.work = work  # the matcher's work buffers: what they take, hold() does not grant

    def hold(self, nbytes: int) -> bool:
        """Takes ``nbytes`` out of the budget for good (arranged copies of tensors, see :class:`Term`)
        when what stays covers the similarities (``reserve``) and the work buffers as they are now
        (grown by the first whole products); whether it did. The work buffers count: on a model whose
        similarities nearly fill the budget (Stable Diffusion's UNet), arranged copies granted beyond
        them took the matcher past its budget by the buffers' size."""
        work = self.work.nbytes() if self.work is not None else 0
        if nbytes > self.budget - self.reserve - work:
            return False
        self.budget -= nbytes
        return True

    def next_step(self) -> None:
        self.step += 1

    def release(self) -> None:
        """Gives every kept similarity back (each is rebuilt at its next visit)."""
        for group in self.held:
            group.evict()
        self.held.clear()

    def claim(self, group: GroupSimilarity) -> torch.Tensor:
        if group.cost is not None:
            self.held.pop(group)
            self.held[group] = self.step
            return group.cost
        need = group.n * group.n * torch.empty((), dtype=group.dtype).element_size()
        held = sum(o.cost.numel() * o.cost.element_size() for o in self.held)
        reuse = None
        for other in list(self.held):
            if held + need <= self.budget:
                break
            if self.held[other] != self.step:
                held -= other.cost.numel() * other.cost.element_size()
                del self.held[other]
                # An evicted matrix of the same shape is taken over: fresh pages would be faulted in
                # by the first write (GPT-2's 3072 x 3072 similarities: 19 ms a rebuild).
                same = (other.cost.shape, other.cost.dtype, other.cost.device) == ((group.n, group.n), group.dtype,
                                                                                   group.device)  # fmt: skip
                if reuse is None and same:
                    reuse = other.cost
                other.evict()
        group.cost = reuse if reuse is not None else torch.empty((group.n, group.n), dtype=group.dtype,
                                                                 device=group.device)  # fmt: skip
        self.held[group] = self.step
        return group.cost


class GroupSimilarity:
    """A group's similarity matrix, kept in sync with its neighbours' permutations."""

    def __init__(self, name: str, n: int, terms: list[Term], products: Products, device: torch.device) -> None:
        self.name = name
        self.n = n
        self.dtype = products.out_dtype
        self.device = device
        self.products = products
        self.all_terms = list(terms)
        self.moving = [t for t in terms if t.other is not None or t.general_axes is not None]
        self.neighbours = {t.other for t in self.moving if t.other is not None}
        self.neighbours |= {g for t in self.moving if t.general_axes for _, g in t.general_axes}
        self.columns = sum(t.columns for t in self.moving)
        self.stale = True  # whether the neighbours moved since the last assignment
        self.cost: torch.Tensor | None = None  # minus the similarity, held while the cache keeps it
        # Warm-started solves of cost: its state survives new A tensors (see a_changed), so the
        # projections of STE matching and the matchings of merge_many start warm too.
        self.assigner = WarmAssigner(incremental_up_to=_INCREMENTAL_UP_TO)
        self.may_overflow = True  # whether its similarity entries could overflow the dtype
        self.built = False  # cost holds the similarity at the terms' snaps
        self.corrections = 0  # corrections applied to cost since it was built

    def a_changed(self) -> None:
        """Model A's tensors were replaced (``Term.set_a``): recompute everything at the next visit."""
        self.stale = True
        self.built = False

    def evict(self) -> None:
        """The cache took the similarity back: rebuilt at the next visit, solved cold."""
        self.cost = None
        self.built = False
        self.assigner.reset()

    def negated_similarity(self, perms: Mapping[str, torch.Tensor], cache: CostCache) -> torch.Tensor:
        """Minus the similarity matrix at the current permutations (the solvers minimise), in ``cost``.

        A kept similarity is corrected: the moved units of every term are queued and applied
        as few products as their number allows (:class:`Pending`); it is rebuilt from the
        tensors when it was evicted, when more than half of its columns moved, when a term
        with several other groups changed, and after _MAX_CORRECTIONS corrections.
        """
        # The cache is passed in, not kept: it holds the groups, and a group holding it back would make a
        # reference cycle that keeps the similarities and the views of A and B alive after weight_matching
        # returns, until Python's cyclic collector happens to run.
        cost = cache.claim(self)
        if self.built and self.corrections < _MAX_CORRECTIONS:
            changes, moved, rebuild = [], 0, False
            for t in self.moving:
                cur = t.current(perms)
                if t.general_axes is not None:
                    rebuild |= not torch.equal(cur, t.snap)
                    continue
                idx = torch.nonzero(cur != t.snap).flatten()
                if idx.numel():
                    changes.append((t, cur, idx))
                    moved += idx.numel() * (t.columns // t.a.shape[t.block_axis])
            if not rebuild and moved <= _REBUILD_FRACTION * self.columns:
                if changes:
                    pending = Pending(self.n, self.products, self.device, moved)
                    for t, cur, idx in changes:
                        t.add_change_to(cost, cur, idx, pending)
                    pending.flush(cost)
                    self.corrections += 1
                return cost
        self.products.fresh = cost  # the first product overwrites it
        narrow = sum(t.columns for t in self.all_terms if t.block_axis is None or t.columns < _NARROW)
        pending = Pending(self.n, self.products, self.device, narrow)
        for t in self.all_terms:
            t.add_full_to(cost, perms, pending, cache.hold)
        pending.flush(cost)
        if self.products.fresh is cost:  # no product at all
            self.products.fresh = None
            cost.zero_()
        self.built = True
        self.corrections = 0
        return cost


def accurate_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """``sum(a * b)`` of two equal-shape tensors: float32 dot products of rows of 1024,
    accumulated in float64 (as accurate as a float64 dot here, without float64 copies), taken in
    blocks so that no more than a block of either tensor is ever converted."""
    a = a.reshape(-1)
    b = b.reshape(-1)
    if a.dtype == torch.float64 or b.dtype == torch.float64:
        return float(torch.dot(a.double(), b.double()))
    total = 0.0
    # Converted operands in blocks of 1 MiB: allocations that small are reused from the heap, while a
    # converted block of BLOCK_BYTES is fresh pages every time (GPT-2's bfloat16 embedding: 220 -> 23 ms).
    step = block_elements(torch.float32) if a.dtype == b.dtype == torch.float32 else _CONVERT_ELEMENTS
    for start in range(0, a.numel(), step):
        x = a[start:start + step].float()
        y = b[start:start + step].float()
        k = x.numel() // 1024 * 1024
        if k:
            total += float(torch.linalg.vecdot(x[:k].view(-1, 1024), y[:k].view(-1, 1024)).double().sum())
        if k < x.numel():
            total += float(torch.dot(x[k:].double(), y[k:].double()))
    return total


def frobenius_norm(t: torch.Tensor) -> float:
    """Frobenius norm, or a bound a little above it (inf when it overflows, which only makes the bound
    conservative)."""
    if t.dtype in (torch.float64, torch.float32):
        return float(torch.linalg.vector_norm(t))
    # Narrower floats: torch accumulates in float32 and rounds the result to the tensor's dtype, so
    # the result is raised by more than that rounding. (Asking for a float32 result converts the
    # whole tensor first: 74 ms against 3 ms on GPT-2's bfloat16 embedding.)
    return float(torch.linalg.vector_norm(t)) * (1 + 2.0**-6)
