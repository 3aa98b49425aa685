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
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

import pyperm
from pyperm._checks import torch_generator
from pyperm._progress import progress_bar
from pyperm.nn.align._objective import (
    WeightMatchingResult,
    _check_state,
    _objective,
    _objective_keys,
)
from pyperm.nn.align._similarity import (
    GroupSimilarity,
    Term,
    frobenius_norm,
)
from pyperm.nn.align._structured import (
    _check_sweeps,
    _match_structured,
    _signature_init,
)
from pyperm.nn.permutations import as_permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["WeightMatchingResult", "weight_matching", "matching_objective"]

logger = logging.getLogger(__name__)


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
    init: Mapping[str, Any] | str | None = "best",
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
    init : {"best", "identity", "signatures"} or mapping of str to (n,) int array, default "best"
        Where the search starts. ``"identity"`` (or None) is Algorithm 1 as published: B
        as it is. Its result depends on the other groups' order and can stall far from
        the optimum (a planted permutation of MobileNetV2 with torchvision's
        initialisation ends at 74% of its objective; a ViT's heads and head dims stall
        likewise). ``"signatures"`` matches every group's units on their own first, by
        signatures that no other group's order changes (64 order statistics of every
        slice a unit owns), and finds such planted permutations exactly. ``"best"`` runs
        from both starts and keeps the higher objective, so it never ends below
        Algorithm 1; it takes 2 to 3 times as long as ``"identity"`` (``callback`` sees
        both runs). A mapping gives the initial permutations themselves.
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
            run_seed = seed
            if isinstance(seed, torch.Generator):  # every start visits in the same orders, as with an int seed
                run_seed = torch.Generator(device=seed.device)
                run_seed.set_state(seed.get_state())
            runs.append(
                weight_matching(spec, state_a, state_b, max_iter, run_seed, first, progress, keys, tol, dtype, callback)
            )
        return max(runs, key=lambda r: r.objective[-1])  # the first (identity) on a tie
    if isinstance(spec, PermutationSpec) and spec.structured:
        return _match_structured(spec, state_a, state_b, max_iter, seed, init, keys, tol, dtype, callback)
    matcher = WeightMatcher(spec, state_b, keys=keys, dtype=dtype)
    return matcher.match(state_a, init=init, max_iter=max_iter, seed=seed, tol=tol, progress=progress, callback=callback)


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
