r"""Cycle-consistent merging of many models: C2M3 (Crisostomi et al., NeurIPS 2024).

Every model :math:`a` gets one permutation per group that maps it into a shared *universe*,
:math:`U_a = \pi_a(\Theta_a)`, and the permutation from model :math:`b` to model :math:`a` is
:math:`\pi_a^{-1} \circ \pi_b`. Composing around any cycle of models then gives the identity by
construction, which pairwise matchings do not promise. The permutations of all models and all
groups are found together, by maximising the weight-matching similarity summed over the pairs,

.. math::

    F(\pi) = \sum_{a < b} w_a w_b \, \langle \pi_a(\Theta_a), \pi_b(\Theta_b) \rangle,

relaxed to doubly stochastic matrices and optimised by Frank-Wolfe:

1. the gradient of :math:`F` with respect to every (model, group) matrix is that group's
   weight-matching similarity between the model and the weighted sum of the others in the
   universe, the model's other groups held at their relaxed values;
2. the linearised problem is one assignment problem per (model, group), and per block of a
   :class:`~pyperm.nn.spec.Blocks` inner group: all of them solved by the compiled batch LAP
   (:func:`pyperm.batch_linear_sum_assignment`), one call per block size;
3. the step towards those permutations is the exact maximiser of :math:`F` on the segment:
   along it every model's tensors are polynomials in the step, of degree :math:`d`, the most
   matrices one tensor is multiplied by; known at both ends (the far end, where every model is at
   its permutations, by gathers) and multiplied out at :math:`d - 1` interior points, they give
   :math:`F`, of degree :math:`2d`, at any step through one Gram matrix of those points;
4. at the end each matrix is rounded to its nearest permutation (an assignment again), and all
   permutations are composed with the inverse of the first model's, so the merged model lives
   in the first model's basin (as :func:`~pyperm.nn.merge_many`'s does).

The relaxation is the one PAM uses (:mod:`pyperm.nn.align._relaxation`): each group's matrix is
multiplied into every axis it acts on, in every spec form (segments, tiles, blocks and the units
within them, one group on two axes), and a Blocks inner group has one matrix per block with the
outer group's matrix moving the blocks. A group's gradient is computed by automatic
differentiation of that product, which is exactly the weight-matching similarity when the
matrices are permutations.

:math:`F` over hard permutations is also MergeMany's objective (each of its matchings raises the
similarity of one model to the sum of the others); the two methods differ in how they search.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import pyperm
from pyperm._checks import (
    check_nonnegative_real,
    check_positive_int,
    torch_generator,
)
from pyperm._progress import progress_bar
from pyperm.lap.warm import WarmAssigner
from pyperm.nn._checks import check_spec
from pyperm.nn.align._relaxation import _multiply_axis, apply_relaxed, one_hot
from pyperm.nn.align.merge import MergeResult, check_merge_states
from pyperm.nn.align.weight import weight_matching
from pyperm.nn.permutations import Permutations, as_permutations, permute_entry
from pyperm.nn.spec import Blocks, PermutationSpec, Tiled
from pyperm.nn.state import average

__all__ = [
    "C2M3Result",
    "c2m3_merge",
    "cycle_consistency_error",
    "merge_objective",
    "pairwise_matchings",
]

logger = logging.getLogger(__name__)

INITS = ("matching", "identity", "barycenter")
# The paper's barycenter start: the uniform matrix plus uniform noise of this fraction of 1/n, made
# doubly stochastic again (the noise breaks the symmetry of the uniform matrix, whose gradient is flat).
_BARYCENTER_NOISE = 0.01


@dataclass
class C2M3Result(MergeResult):
    """What :func:`c2m3_merge` found: a :class:`~pyperm.nn.MergeResult` and the search's record.

    Attributes
    ----------
    perms, merged, iterations, converged
        As :class:`~pyperm.nn.MergeResult`'s: one :class:`~pyperm.nn.Permutations` per model
        (the first model's the identity), the weighted mean of the permuted models,
        the Frank-Wolfe iterations run and whether they stopped before ``max_iter``.
        ``history`` is left empty (it counts MergeMany's changed models per round).
    objective : list of float
        The relaxed objective :math:`F` at the start and after every iteration.
    step_sizes : list of float
        The step taken at every iteration, in [0, 1].
    gaps : list of float
        The Frank-Wolfe gap :math:`\\langle \\nabla F, D - X \\rangle` at every iteration (zero at a
        stationary point of the relaxation).
    final_objective : float
        :math:`F` at the rounded permutations (see :func:`merge_objective`).
    cycle_error : float
        :func:`cycle_consistency_error` of ``perms``: 0 by construction.
    kept_start : bool
        Whether the start's permutations were returned: the search's rounded permutations had a
        lower objective than the start's (a start at permutations only).
    seconds : float
        Wall time of the search and the rounding (not of building ``merged``).
    """

    objective: list[float] = field(default_factory=list)
    step_sizes: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    final_objective: float = float("nan")
    cycle_error: float = 0.0
    kept_start: bool = False
    seconds: float = 0.0


def c2m3_merge(
    spec: PermutationSpec,
    states: Sequence[Mapping[str, torch.Tensor]],
    *,
    weights: Sequence[float] | None = None,
    max_iter: int = 100,
    init: str | Sequence[Mapping[str, Any]] = "matching",
    tol: float = 1e-6,
    seed: int | torch.Generator = 0,
    progress: bool = False,
    anchor: bool = True,
) -> C2M3Result:
    r"""Merge several models through one universe, with cycle-consistent permutations (C2M3).

    Finds one permutation per group for every model, mapping it into a universe shared by
    all, by Frank-Wolfe on the doubly stochastic relaxation of

    .. math::

        \max_{\pi_1, \dots, \pi_N} \sum_{a < b} w_a w_b \,
        \operatorname{vec}(\pi_a(\Theta_a)) \cdot \operatorname{vec}(\pi_b(\Theta_b)),

    then returns :math:`\sum_a w_a \pi_a(\Theta_a)` (see the module notes for the steps).
    The permutation from model :math:`b` to model :math:`a` is
    ``perms[a].inverse().compose(perms[b])``; those compose to the identity around every
    cycle of models.

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups, any axis form (:class:`~pyperm.nn.spec.Segments`,
        :class:`~pyperm.nn.spec.Tiled`, :class:`~pyperm.nn.spec.Blocks`, one group on two axes).
    states : sequence of mapping of str to torch.Tensor
        At least two state dicts of one architecture (the spec's keys, equal shapes), on one
        device. The floating-point entries a group acts on enter the objective.
    weights : sequence of float, optional
        One positive weight per state, summing to 1 (within 1e-6): each model's share of the
        merge, and the pair weights :math:`w_a w_b` of the objective. Equal when omitted.
    max_iter : int, default 100
        Most Frank-Wolfe iterations.
    init : {"matching", "identity", "barycenter"} or sequence of Permutations, default "matching"
        The start: every model weight-matched to the first (``"matching"``,
        :func:`~pyperm.nn.weight_matching` with its default start; one of the authors' starts,
        "LAP"); every model as it is (``"identity"``); the uniform matrix with 1% noise, made
        doubly stochastic (``"barycenter"``, the start of the authors' merging runs, drawn from
        ``seed``); or one :class:`~pyperm.nn.Permutations` per model. From a start at
        permutations, the start is returned when the search's rounded permutations score lower.
    tol : float, default 1e-6
        The search stops when a step would raise the objective by at most ``tol`` times its
        magnitude (the step size is then 0, or the Frank-Wolfe gap is that small).
    seed : int or torch.Generator, default 0
        Seeds the weight matchings' group orders and the barycenter start's noise.
    progress : bool, default False
        Show a progress bar over the iterations.
    anchor : bool, default True
        Hold the first model at the identity: the universe is its space. The objective does not
        change when every model's permutations are composed with one common permutation, so this
        loses no solution; with every model free (``False``, as the authors' code runs) all
        models step at once towards each other's current places, and two models chase each
        other: the search then ends far below weight matching's objective.

    Returns
    -------
    C2M3Result
        ``perms`` (one per model, the first the identity), ``merged``, ``iterations``,
        ``converged``, the ``objective``, ``step_sizes`` and ``gaps`` of the search, the
        ``final_objective`` at the rounded permutations and their ``cycle_error`` (0).

    Raises
    ------
    TypeError, ValueError
        ``spec`` is not a PermutationSpec; ``states`` is not a sequence of at least two
        state dicts that fit the spec with equal shapes on one device, or has a non-finite
        entry; ``weights`` are not one positive weight per state summing to 1; ``max_iter``,
        ``tol`` or ``seed`` is invalid; ``init`` is an unknown start or not one set of
        permutations per model.

    Notes
    -----
    Each iteration costs one pass of relaxed products with their gradients over all models but
    the first, every product a dense ``(n, n)`` matrix times a tensor, where weight matching
    gathers rows: for a tensor two groups act on (a dense or convolution weight), five products
    in closed form, whose partial products also give the line search's interior points by
    gathers; after a full step to the vertex the three forward products are gathers too. Keys of
    other forms (tiles, blocks, segments) are differentiated automatically and multiplied out
    once more per interior point of the line search. Then one assignment per (model, group),
    each warm-started from the previous iteration's. The models are copied once into the working
    dtype (float64 if any matched entry is float64, else float32).

    References
    ----------
    D. Crisostomi, M. Fumero, D. Baieri, F. Bernard, E. Rodolà, "C2M3: Cycle-Consistent
    Multi-Model Merging", NeurIPS 2024.

    Examples
    --------
    >>> from pyperm.nn.align.c2m3 import c2m3_merge
    >>> from pyperm.nn.models import MLP
    >>> models = [MLP([8, 16, 4]) for _ in range(3)]
    >>> result = c2m3_merge(models[0].permutation_spec(), [m.state_dict() for m in models])
    >>> result.perms[0].is_identity(), result.cycle_error
    (True, 0.0)
    """
    started = time.perf_counter()
    spec, states, weights = _check_models(spec, states, weights)
    max_iter = check_positive_int(max_iter, "max_iter")
    tol = check_nonnegative_real(tol, "tol")
    gen = torch_generator(seed)

    def match(state_a: Mapping[str, torch.Tensor], state_b: Mapping[str, torch.Tensor], seed: int) -> Permutations:
        return weight_matching(spec, state_a, state_b, seed=seed).perms

    return search(spec, states, weights, max_iter=max_iter, init=init, tol=tol, gen=gen, progress=progress,
                  anchor=anchor, sums=ONE_PROCESS, match=match, started=started)  # fmt: skip


class Sums:
    """The sums of the search over where the models' tensors are: here one process holds every tensor, so each
    sum is its own part (:mod:`pyperm.nn.align.c2m3_over_ranks` adds the ranks' parts)."""

    def values(self, parts: list[float]) -> list[float]:
        """Floats summed over the holders of the tensors."""
        return parts

    def tensors(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors (the same shapes on every holder) summed over the holders."""
        return parts

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some holder."""
        return flag


ONE_PROCESS = Sums()


def search(spec: PermutationSpec, states: list[dict], weights: list[float] | None, *, max_iter: int, init: Any,
           tol: float, gen: torch.Generator, progress: bool, anchor: bool, sums: Sums,
           match: Any, started: float) -> C2M3Result:  # fmt: skip
    """:func:`c2m3_merge` on checked arguments, with every sum over the models' tensors completed by ``sums`` and the
    ``"matching"`` start's pairs matched by ``match(state_a, state_b, seed)`` (in one process, or over ranks where
    each holds a share of every model's keys)."""
    n = len(states)
    keys = _matched_keys(spec, states[0])
    wide = sums.any(any(s[k].dtype == torch.float64 for s in states for k in keys))
    dtype = torch.float64 if wide else torch.float32
    device = states[0][keys[0]].device if keys else torch.device("cpu")
    _warn_host_assignments(device)
    tensors = [{k: s[k].detach().to(dtype) for k in keys} for s in states]
    for i, t in enumerate(tensors):
        for k, v in t.items():
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"states[{i}][{k!r}] contains NaN or infinite values")
    w = [1.0] * n if weights is None else list(weights)
    start = _start_perms(spec, states, init, gen, match)
    matrices = _start(spec, init if start is None else start, n, gen, dtype, device)
    # The models' degree in the step along a segment (the most matrices one element is multiplied by), from
    # every key of the spec, so that it is the same wherever the tensors are (a lower degree is fitted exactly too).
    degree = max((_key_degree(spec, k) for k in spec.axes), default=0)
    if anchor:  # the universe is the first model's space: it stays as it is (no matrices, no products)
        matrices[0] = None

    def gradient_pass(at: list[dict | None], perms: list | None) -> tuple[float, list[dict | None], list, list]:
        value, grads, universe, partials = _gradient_pass(spec, tensors, at, w, keys, perms)
        held = [(a, g) for a in range(n) if grads[a] is not None for g in grads[a]]
        (value,) = sums.values([value])
        for (a, g), total in zip(held, sums.tensors([grads[a][g] for a, g in held])):
            grads[a][g] = total
        return value, grads, universe, partials

    objective, step_sizes, gaps = [], [], []
    warm: dict = {}  # the linear steps' solvers, warm from one iteration to the next
    converged = False
    iterations = 0
    bar = progress_bar(progress, max_iter, "c2m3", "iteration")
    try:
        # The matrices are permutation matrices at a start at permutations and after a full step (products by gathers).
        value, grads, here, partials = gradient_pass(matrices, None if start is None else start)
        objective.append(value)
        for _ in range(max_iter):
            iterations += 1
            free = [a for a in range(n) if matrices[a] is not None]
            targets = _assign(spec, [grads[a] for a in free], warm)
            directions: list[dict | None] = [None] * n
            vertex: list[dict | None] = [None] * n
            for a, p in zip(free, targets):
                vertex[a] = p
                directions[a] = {g: t - matrices[a][g] for g, t in one_hot(spec, p, dtype, device).items()}
            gap = sum(float((grads[a][g].double() * directions[a][g].double()).sum()) for a in free for g in grads[a])
            gaps.append(gap)
            small = tol * max(abs(value), 1e-300)
            step = 0.0
            if gap > small:
                # F at the segment's end, where every free model is at its permutations: gathers, no products
                ends = [ts if p is None else {k: permute_entry(spec, p, k, ts[k]) for k in keys}
                        for ts, p in zip(tensors, vertex)]  # fmt: skip
                step, gain = _line_search(spec, tensors, matrices, directions, w, keys, degree, here, ends, partials,
                                          vertex, sums)  # fmt: skip
                if gain <= small:
                    step = 0.0
            step_sizes.append(step)
            if step == 0.0:
                objective.append(value)
                converged = True
                break
            if step == 1.0:  # at the vertex: its permutation matrices exactly
                moved = [None if p is None else one_hot(spec, p, dtype, device) for p in vertex]
            else:
                moved = _moved(matrices, directions, step)
            new_value, new_grads, new_here, new_partials = gradient_pass(moved, vertex if step == 1.0 else None)
            if new_value < value:  # the fit's rounding promised a gain that is not there: stay
                step_sizes[-1] = 0.0
                objective.append(value)
                converged = True
                break
            matrices, value, grads, here, partials = moved, new_value, new_grads, new_here, new_partials
            objective.append(value)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(objective=f"{value:.6g}", step=f"{step:.3g}")
    finally:
        if bar is not None:
            bar.close()
    free = [a for a in range(n) if matrices[a] is not None]
    rounded = [Permutations.identity(spec)] * n
    for a, p in zip(free, _assign(spec, [{g: m.detach() for g, m in matrices[a].items()} for a in free])):
        rounded[a] = Permutations(spec, p)
    back = rounded[0].inverse()
    perms = [back.compose(p) for p in rounded]
    (final,) = sums.values([_objective(spec, states, perms, w)])
    kept_start = False
    if start is not None:  # a start at permutations: the rounding of the search never ends below it
        (at_start,) = sums.values([_objective(spec, states, start, w)])
        if at_start > final:
            back = start[0].inverse()
            perms, final, kept_start = [back.compose(p) for p in start], at_start, True
    seconds = time.perf_counter() - started
    merged = {}
    for key in states[0]:  # one key at a time: one permuted tensor of each model at once
        merged.update(average([{key: permute_entry(spec, p, key, s[key])} for p, s in zip(perms, states)], weights))
    logger.debug("c2m3: %d models, %d iterations, converged=%s, objective %.6g (rounded %.6g)",
                 n, iterations, converged, objective[-1], final)  # fmt: skip
    return C2M3Result(perms=perms, merged=merged, iterations=iterations, converged=converged, objective=objective,
                      step_sizes=step_sizes, gaps=gaps, final_objective=final,
                      cycle_error=cycle_consistency_error(spec, perms), kept_start=kept_start,
                      seconds=seconds)  # fmt: skip


def merge_objective(
    spec: PermutationSpec,
    states: Sequence[Mapping[str, torch.Tensor]],
    perms: Sequence[Mapping[str, Any]],
    *,
    weights: Sequence[float] | None = None,
) -> float:
    r"""The similarity of the permuted models summed over their pairs, :math:`\sum_{a<b} w_a w_b
    \operatorname{vec}(\pi_a(\Theta_a)) \cdot \operatorname{vec}(\pi_b(\Theta_b))`.

    The objective C2M3 maximises over the permutations, and MergeMany's (each of its matchings
    raises one model's term with the others): comparable across methods and across universes
    (composing every model's permutations with one common permutation leaves it unchanged).

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups.
    states : sequence of mapping of str to torch.Tensor
        At least two state dicts that fit the spec, equal shapes.
    perms : sequence of Permutations or mapping of str to (n,) int array
        One set of permutations per model, e.g. a :class:`~pyperm.nn.MergeResult`'s ``perms``.
    weights : sequence of float, optional
        As :func:`c2m3_merge`'s (equal weights of 1 when omitted).

    Returns
    -------
    float
        The sum over the floating-point entries that a group acts on, accumulated in float64.

    Raises
    ------
    TypeError, ValueError
        As :func:`c2m3_merge`, or ``perms`` is not one set of permutations per model.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import PermutationSpec, Permutations
    >>> from pyperm.nn.align.c2m3 import merge_objective
    >>> spec = PermutationSpec({"w": ("h", None)}, {"h": 2})
    >>> states = [{"w": torch.tensor([[1.0], [2.0]])}, {"w": torch.tensor([[2.0], [1.0]])}]
    >>> same = [Permutations.identity(spec), Permutations(spec, {"h": [1, 0]})]
    >>> merge_objective(spec, states, [Permutations.identity(spec)] * 2), merge_objective(spec, states, same)
    (4.0, 5.0)
    """
    spec, states, weights = _check_models(spec, states, weights)
    perms = _check_perm_sets(spec, perms, len(states), "perms")
    return _objective(spec, states, perms, [1.0] * len(states) if weights is None else list(weights))


def _objective(spec: PermutationSpec, states: Sequence[Mapping[str, torch.Tensor]],
               perms: Sequence[Permutations], w: list[float]) -> float:  # fmt: skip
    """:func:`merge_objective` of checked arguments (the part of the keys held here)."""
    total = 0.0
    for key in _matched_keys(spec, states[0]):
        permuted = [permute_entry(spec, p, key, s[key].detach()).double() for p, s in zip(perms, states)]
        whole = sum(wa * u for wa, u in zip(w, permuted))
        # sum_{a<b} w_a w_b <U_a, U_b> = (|sum_a w_a U_a|^2 - sum_a w_a^2 |U_a|^2) / 2, in float64
        own = sum(wa * wa * float((u * u).sum()) for wa, u in zip(w, permuted))
        total += 0.5 * (float((whole * whole).sum()) - own)
    return total


def cycle_consistency_error(
    spec: PermutationSpec,
    perms: Sequence[Mapping[str, Any]] | Mapping[tuple[int, int], Mapping[str, Any]],
) -> float:
    r"""How far pairwise permutations are from composing to the identity around cycles of models.

    For every cycle of three distinct models :math:`a \to c \to b \to a` (both orientations of
    every triple; for two models the cycle :math:`a \to b \to a`), the composition
    :math:`\pi_{a \leftarrow b} \circ \pi_{b \leftarrow c} \circ \pi_{c \leftarrow a}` is
    formed, and the fraction of units (over all groups) it moves is averaged over the cycles.

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups.
    perms : sequence of Permutations, or mapping of (int, int) to Permutations
        Either one set of permutations per model into a common space (a
        :class:`~pyperm.nn.MergeResult`'s or :class:`C2M3Result`'s ``perms``; then
        :math:`\pi_{a \leftarrow b} = \pi_a^{-1} \circ \pi_b` and the error is 0 by
        construction), or the pairwise permutations themselves: ``perms[a, b]`` permutes model
        ``b`` into model ``a``'s basin (``weight_matching(spec, states[a], states[b]).perms``),
        given for every ordered pair of distinct models (see :func:`pairwise_matchings`).

    Returns
    -------
    float
        In [0, 1]: 0 when every cycle composes to the identity.

    Raises
    ------
    TypeError, ValueError
        ``spec`` is not a PermutationSpec; ``perms`` holds fewer than two models, misses an
        ordered pair, or is not permutations of the spec.

    Examples
    --------
    >>> from pyperm.nn import PermutationSpec, Permutations
    >>> from pyperm.nn.align.c2m3 import cycle_consistency_error
    >>> spec = PermutationSpec({"w": ("h", None)}, {"h": 4})
    >>> p = Permutations(spec, {"h": [1, 0, 2, 3]})
    >>> i = Permutations.identity(spec)
    >>> cycle_consistency_error(spec, [i, p, p])
    0.0
    >>> pairwise = {(0, 1): p, (1, 0): p, (0, 2): i, (2, 0): i, (1, 2): i, (2, 1): i}
    >>> cycle_consistency_error(spec, pairwise)
    0.5
    """
    check_spec(spec)
    if isinstance(perms, Mapping):
        models = sorted({m for pair in perms for m in (pair if isinstance(pair, tuple) else (pair,))}, key=str)
        if not all(isinstance(m, int) and not isinstance(m, bool) for m in models):
            raise TypeError("perms, as a mapping, must have (int, int) keys: pairs of model indices")
        if len(models) < 2:
            raise ValueError(f"perms must relate at least two models, got {len(models)}")
        pairwise = {}
        for a, b in itertools.permutations(models, 2):
            if (a, b) not in perms:
                raise ValueError(f"perms misses the pair ({a}, {b}): every ordered pair of distinct models is needed")
            pairwise[a, b] = Permutations(spec, as_permutations(spec, perms[a, b], f"perms[{a}, {b}]"))
    else:
        sets = _check_perm_sets(spec, perms, None, "perms")
        models = list(range(len(sets)))
        inverses = [p.inverse() for p in sets]
        pairwise = {(a, b): inverses[a].compose(sets[b]) for a, b in itertools.permutations(models, 2)}
    if len(models) == 2:
        a, b = models
        cycles = [pairwise[a, b].compose(pairwise[b, a])]
    else:
        cycles = [pairwise[a, b].compose(pairwise[b, c].compose(pairwise[c, a]))
                  for a, b, c in itertools.permutations(models, 3) if a < b and a < c]  # fmt: skip
    units = sum(spec.sizes.values())
    if units == 0:
        return 0.0
    moved = [sum(int((p != torch.arange(p.numel())).sum()) for p in cycle.values()) for cycle in cycles]
    return sum(moved) / (units * len(cycles))


def pairwise_matchings(
    spec: PermutationSpec,
    states: Sequence[Mapping[str, torch.Tensor]],
    *,
    seed: int = 0,
    **options: Any,
) -> dict[tuple[int, int], Permutations]:
    """Weight matching of every ordered pair of models: ``{(a, b): perms}``, ``perms`` permuting
    model ``b`` into model ``a``'s basin (the input of :func:`cycle_consistency_error`).

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups.
    states : sequence of mapping of str to torch.Tensor
        At least two state dicts that fit the spec.
    seed : int, default 0
        Passed to every :func:`~pyperm.nn.weight_matching`.
    **options
        More keyword arguments of :func:`~pyperm.nn.weight_matching` (``init``, ``max_iter``, ...).

    Returns
    -------
    dict of (int, int) to Permutations
        ``N (N - 1)`` matchings of ``N`` models.

    Raises
    ------
    TypeError, ValueError
        As :func:`~pyperm.nn.weight_matching`, or ``states`` is not a sequence of at least two state dicts.
    """
    spec, states, _ = _check_models(spec, states, None)
    return {(a, b): weight_matching(spec, states[a], states[b], seed=seed, **options).perms
            for a, b in itertools.permutations(range(len(states)), 2)}  # fmt: skip


# ------------------------------------------------------------------ checks


def _check_models(spec: Any, states: Any, weights: Any) -> tuple[PermutationSpec, list[dict], list[float] | None]:
    weights = check_merge_states(spec, states, weights)
    first = states[0]
    devices = set()
    for i, state in enumerate(states):
        for k in spec.axes:
            if state[k].shape != first[k].shape:
                raise ValueError(f"states[{i}][{k!r}] has shape {tuple(state[k].shape)} but states[0] has "
                                 f"{tuple(first[k].shape)}")  # fmt: skip
            if state[k].is_floating_point():
                devices.add(state[k].device)
    if len(devices) > 1:
        raise ValueError(f"states must be on one device, found {sorted(map(str, devices))}")
    return spec, [dict(s) for s in states], weights


def _check_perm_sets(spec: PermutationSpec, perms: Any, count: int | None, name: str) -> list[Permutations]:
    if isinstance(perms, (Mapping, str, bytes)) or not isinstance(perms, Sequence):
        raise TypeError(f"{name} must be a sequence of permutations, one per model, got {type(perms).__name__}")
    if count is not None and len(perms) != count:
        raise ValueError(f"{name} must hold one set of permutations per model ({count}), got {len(perms)}")
    if len(perms) < 2:
        raise ValueError(f"{name} must hold at least two sets of permutations, got {len(perms)}")
    return [Permutations(spec, as_permutations(spec, p, f"{name}[{i}]")) for i, p in enumerate(perms)]


def _matched_keys(spec: PermutationSpec, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The floating-point entries here (all, or a rank's share) that some group acts on (the others add a constant
    to the objective)."""
    return [k for k in spec.axes
            if k in state and state[k].is_floating_point() and any(e is not None for e in spec.axes[k])]


# ------------------------------------------------------------------ the search


def _start_perms(spec: PermutationSpec, states: list[dict], init: Any, gen: torch.Generator,
                 match: Any) -> list[Permutations] | None:  # fmt: skip
    """The start's permutations of every model, or None for the barycenter start (not a permutation)."""
    n = len(states)
    if isinstance(init, str):
        if init not in INITS:
            raise ValueError(f"init must be one of {', '.join(map(repr, INITS))} or permutations, got {init!r}")
        if init == "barycenter":
            return None
        identity = Permutations.identity(spec)
        if init == "identity":
            return [identity] * n
        # Every model matched to the first (weight_matching's default start), the first held.
        seed = int(torch.randint(0, 2**62, (), generator=gen))
        return [identity] + [match(states[0], s, seed) for s in states[1:]]
    sets = _check_perm_sets(spec, init, n, "init")
    back = sets[0].inverse()  # the same universe up to one common permutation, the first model's the identity
    return [back.compose(p) for p in sets]


def _start(spec: PermutationSpec, init: Any, n: int, gen: torch.Generator, dtype: torch.dtype,
           device: torch.device) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """Every model's relaxed matrices at the start (see :func:`c2m3_merge`'s ``init``)."""
    if isinstance(init, str):  # the barycenter
        identity = one_hot(spec, spec.identity(), dtype, device)
        out = []
        for _ in range(n):
            ms = {}
            for g, m in identity.items():
                size = m.shape[-1]
                noise = torch.rand(m.shape, generator=gen, dtype=torch.float64) * (_BARYCENTER_NOISE / size)
                ms[g] = pyperm.sinkhorn(noise + 1.0 / size).to(dtype=dtype, device=device)
            out.append(ms)
        return out
    return [one_hot(spec, p, dtype, device) for p in init]


def _key_degree(spec: PermutationSpec, key: str) -> int:
    """How many matrices the relaxed product multiplies into one element of entry ``key``."""
    return sum(_entry_degree(e) for e in spec.axes[key])


def _entry_degree(entry: Any) -> int:
    if entry is None or isinstance(entry, int):
        return 0
    if isinstance(entry, str):
        return 1
    if isinstance(entry, Blocks):
        return 1 + isinstance(entry.outer, str)
    if isinstance(entry, Tiled):
        return _entry_degree(entry.group) + isinstance(entry.outer, str)
    return max((_entry_degree(p) for p in entry.parts), default=0)  # Segments, Interleaved: parts side by side


def _relaxed(spec: PermutationSpec, tensors: list[dict], matrices: list[dict | None], keys: list[str]) -> list[dict]:
    """Every model in the universe: its matrices multiplied in (None: the model held as it is)."""
    return [ts if ms is None else apply_relaxed(spec, ms, ts, keys) for ms, ts in zip(matrices, tensors)]


def _moved(matrices: list[dict | None], directions: list[dict | None], step: float) -> list[dict | None]:
    return [None if ms is None else {g: m + step * d[g] for g, m in ms.items()} for ms, d in zip(matrices, directions)]


def _pair_sum(universe: list[dict], w: list[float], keys: list[str]) -> tuple[float, dict[str, torch.Tensor]]:
    """F and the weighted sum of the models in the universe, per key."""
    total = {k: sum(wa * u[k] for wa, u in zip(w, universe)) for k in keys}
    value = 0.0
    for wa, u in zip(w, universe):
        for k in keys:
            # <U_a, sum of the others>, the others' sum formed elementwise (no cancellation of large norms)
            value += wa * float((u[k] * (total[k] - wa * u[k])).sum(dtype=torch.float64))
    return 0.5 * value, total


def _gradient_pass(spec: PermutationSpec, tensors: list[dict], matrices: list[dict], w: list[float],
                   keys: list[str], perms: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
                   ) -> tuple[float, list[dict[str, torch.Tensor]], list[dict], list[dict]]:  # fmt: skip
    """F at the matrices; its gradient with respect to every model's matrices (model ``a``'s is the similarity of
    its groups with ``w_a`` times the weighted sum of the others in the universe); every model in the universe at
    the matrices (the line search's start); and every free model's partial products of its plain keys (see
    :func:`_plain_forward`).

    The plain keys' products and gradients are formed in closed form, their products by gathers for a model
    whose matrices are the permutation matrices of ``perms[a]`` (given, not None); the other forms (tiles,
    blocks, segments) are differentiated automatically."""
    plain = {k: axes for k in keys if (axes := _plain_axes(spec, k)) is not None}
    rest = [k for k in keys if k not in plain]
    leaves = [None if ms is None else {g: m.detach().requires_grad_(bool(rest)) for g, m in ms.items()}
              for ms in matrices]  # fmt: skip
    universe, partials = [], []
    for ms, ts in zip(leaves, tensors):
        if ms is None:
            universe.append(ts)
            partials.append({})
            continue
        with torch.enable_grad():
            u = apply_relaxed(spec, ms, ts, rest) if rest else {}
        parts = {}
        hard = None if perms is None else perms[len(universe)]
        if hard is not None:  # permutation matrices: each product a gather along its axis
            along = _gather_along(hard)
        else:
            along = _multiply_along({g: m.detach() for g, m in ms.items()})
        for k, axes in plain.items():
            u[k], parts[k] = _plain_forward(along, ts[k], axes)
        universe.append(u)
        partials.append(parts)
    here = [{k: v.detach() for k, v in u.items()} for u in universe]
    value, total = _pair_sum(here, w, keys)
    outputs, seeds = [], []
    grads: list[dict | None] = [None if ms is None else {g: torch.zeros_like(m) for g, m in ms.items()}
                                for ms in leaves]  # fmt: skip
    for a, (wa, u) in enumerate(zip(w, universe)):
        if leaves[a] is None:
            continue
        for k in keys:
            seed = wa * (total[k] - wa * here[a][k])
            if k in plain:
                for g, grad in _plain_gradients(seed, tensors[a][k], partials[a][k], plain[k]):
                    grads[a][g] += grad
            elif u[k].requires_grad:
                outputs.append(u[k])
                seeds.append(seed)
    if outputs:
        torch.autograd.backward(outputs, seeds)
        for ms, gs in zip(leaves, grads):
            for g, m in (ms or {}).items():
                if m.grad is not None:
                    gs[g] += m.grad
    return value, grads, here, partials


def _plain_axes(spec: PermutationSpec, key: str) -> list[tuple[int, str]] | None:
    """The (axis, group) of every axis of ``key`` a group acts on, when each is one plain group and there are
    one or two of them (dense and convolution weights, biases, norms); None for the other forms."""
    axes = []
    for axis, entry in enumerate(spec.axes[key]):
        if entry is None or isinstance(entry, int):
            continue
        if not isinstance(entry, str):
            return None
        axes.append((axis, entry))
    return axes if len(axes) in (1, 2) else None


def _multiply_along(matrices: Mapping[str, torch.Tensor]) -> Any:
    """``along(group, x, axis)``: the group's matrix multiplied into ``x`` along ``axis``."""
    return lambda g, x, axis: _multiply_axis(matrices[g].to(x.dtype), x, axis)


def _gather_along(perms: Mapping[str, torch.Tensor]) -> Any:
    """``along(group, x, axis)`` at permutation matrices: ``x`` gathered along ``axis`` by the group's permutation."""
    return lambda g, x, axis: x.index_select(axis, perms[g].to(x.device))


def _plain_forward(along: Any, tensor: torch.Tensor, axes: list[tuple[int, str]]) -> tuple[torch.Tensor, tuple]:
    """A plain key in the universe, each group applied by ``along`` (:func:`_multiply_along` or
    :func:`_gather_along`), and the partial products its gradients and line search reuse: for one axis none; for
    two, ``A`` (the first axis's group applied) and ``B`` (the second's)."""
    if len(axes) == 1:
        (p, g), = axes
        return along(g, tensor, p), ()
    (p, g), (q, h) = axes
    a = along(g, tensor, p)
    return along(h, a, q), (a, along(h, tensor, q))


def _plain_gradients(seed: torch.Tensor, tensor: torch.Tensor, parts: tuple,
                     axes: list[tuple[int, str]]) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
    """The gradient of ``<U, seed>`` with respect to each matrix of a plain key's ``U``: the seed contracted with
    the tensor with every other matrix multiplied in, over every axis but the matrix's own."""
    if len(axes) == 1:
        (p, g), = axes
        return [(g, _contract(seed, tensor, p))]
    (p, g), (q, h) = axes
    a, b = parts
    return [(g, _contract(seed, b, p)), (h, _contract(seed, a, q))]


def _contract(seed: torch.Tensor, other: torch.Tensor, axis: int) -> torch.Tensor:
    """``out[i, j] = sum over every other index of seed[.., i, ..] * other[.., j, ..]`` (i, j on ``axis``)."""
    n = seed.shape[axis]
    return seed.movedim(axis, 0).reshape(n, -1) @ other.movedim(axis, 0).reshape(n, -1).T


def _plain_along(here: torch.Tensor, end: torch.Tensor, parts: tuple, vertex: Mapping[str, torch.Tensor],
                 axes: list[tuple[int, str]], t: float) -> torch.Tensor:  # fmt: skip
    """A plain key of a model moved ``t`` of the way from its matrices X to its vertex V: for one axis
    ``(1 - t) XW + t VW``; for two ``(1 - t)^2 XWX' + t (1 - t) (XWV' + VWX') + t^2 VWV'``, the mixed terms
    the partial products gathered by the vertex's permutations (no products)."""
    if len(axes) == 1:
        return (1 - t) * here + t * end
    (p, g), (q, h) = axes
    a, b = parts
    mixed = a.index_select(q, vertex[h].to(a.device)) + b.index_select(p, vertex[g].to(b.device))
    return (1 - t) ** 2 * here + (t * (1 - t)) * mixed + t**2 * end


@torch.no_grad()
def _line_search(spec: PermutationSpec, tensors: list[dict], matrices: list[dict], directions: list[dict],
                 w: list[float], keys: list[str], degree: int, here: list[dict], ends: list[dict], partials: list[dict],
                 vertex: list[dict | None], sums: Sums) -> tuple[float, float]:  # fmt: skip
    """The step in [0, 1] that maximises F along ``matrices + t * directions``, and its gain over t = 0.

    Every model's tensors in the universe are polynomials of degree at most ``degree`` in t (each
    element a product of that many matrices at most), known at t = 0 (``here``) and t = 1
    (``ends``) and multiplied out at ``degree - 1`` interior Chebyshev points: model ``a`` at t is
    ``sum_j L_j(t) K_aj`` (the Lagrange basis of those points). So F(t), a sum over pairs of models
    of their inner products, is ``sum_{a<b} w_a w_b sum_jl L_j(t) L_l(t) <K_aj, K_bl>``: one Gram
    matrix of every model's known points, summed over the keys in float64 (and over the holders of
    the keys, one message), gives F at any t (:func:`_gram`). F, of degree ``2 * degree``, is interpolated exactly
    through its values at Chebyshev points and maximised over the stationary points in the segment
    and its ends."""
    points = _lobatto(degree)
    plain = {k: axes for k in keys if (axes := _plain_axes(spec, k)) is not None}
    rest = [k for k in keys if k not in plain]
    known = [here]
    for t in points[1:-1]:  # the plain keys from the gradient pass's partial products, the others multiplied out
        at_t = _relaxed(spec, tensors, _moved(matrices, directions, t), rest)
        for a, parts in enumerate(partials):
            for k, kept in parts.items():
                at_t[a][k] = _plain_along(here[a][k], ends[a][k], kept, vertex[a], plain[k], t)
        known.append(at_t)
    known.append(ends)
    # The vectors of the Gram matrix: every free model's known points, a held model once (it does not move).
    slots = [(a, j) for a in range(len(tensors)) for j in (range(len(points)) if matrices[a] is not None else [0])]
    gram = torch.zeros(len(slots), len(slots), dtype=torch.float64)
    for k in keys:
        gram += _gram(torch.stack([known[j][a][k].reshape(-1) for a, j in slots])).cpu()
    (gram,) = sums.tensors([gram])
    model = torch.tensor([a for a, _ in slots])
    pairs = (model.view(-1, 1) < model.view(1, -1)).double()  # (a, b) with a < b: each pair once, no self terms
    nodes = _lobatto(2 * degree)
    values = []
    for t in nodes:
        basis = _lagrange(points, t)
        c = torch.tensor([w[a] * (basis[j] if matrices[a] is not None else 1.0) for a, j in slots], dtype=torch.float64)
        values.append(float(c @ (gram * pairs) @ c))
    x = 2.0 * np.asarray(nodes) - 1.0  # [0, 1] onto [-1, 1], where the Chebyshev basis is well conditioned
    poly = np.polynomial.Chebyshev.fit(x, values, 2 * degree, domain=[-1, 1], window=[-1, 1])
    candidates = [-1.0, 1.0] + [float(r.real) for r in poly.deriv().roots() if abs(r.imag) < 1e-9 and -1 < r.real < 1]
    best = max(candidates, key=lambda c: float(poly(c)))
    return (best + 1.0) / 2.0, float(poly(best)) - values[0]


def _gram(rows: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``rows @ rows.T`` in float64. Float32 rows are multiplied in float32 over chunks of ``chunk`` columns and
    the chunks' products summed in float64: within about 1e-8 of the largest entry (the float32 products'
    own rounding), where converting the rows to float64 first takes several times as long."""
    if rows.dtype == torch.float64:
        return rows @ rows.T
    whole = rows.shape[1] // chunk * chunk
    blocks = rows[:, :whole].reshape(rows.shape[0], -1, chunk).transpose(0, 1)
    rest = rows[:, whole:].double()
    return torch.bmm(blocks, blocks.transpose(1, 2)).sum(0, dtype=torch.float64) + rest @ rest.T


def _lobatto(degree: int) -> list[float]:
    """The ``degree + 1`` Chebyshev-Lobatto points of [0, 1], 0 and 1 included (both ends exactly)."""
    degree = max(degree, 1)
    return [0.0] + [0.5 - 0.5 * math.cos(math.pi * j / degree) for j in range(1, degree)] + [1.0]


def _lagrange(points: list[float], t: float) -> list[float]:
    """The Lagrange basis of ``points`` at ``t``: a polynomial through them takes ``sum(basis[j] * value[j])``;
    exactly one 1 and the rest 0 at one of the points."""
    if t in points:
        return [float(p == t) for p in points]
    return [math.prod((t - q) / (p - q) for j, q in enumerate(points) if j != i) for i, p in enumerate(points)]


def _warn_host_assignments(device: torch.device) -> None:
    """Say so when the tensors are on a GPU: the products run there, but :func:`_assign` solves the linear
    steps on the CPU, copying every gradient to the host each iteration."""
    if device.type != "cpu":
        warnings.warn(f"c2m3_merge: the Frank-Wolfe steps' assignments of these {device.type} tensors are solved on "
                      "the CPU (each iteration copies the gradients to the host); the products run on the device",
                      UserWarning, stacklevel=4)


def _assign(spec: PermutationSpec, scores: list[Mapping[str, torch.Tensor]],
            warm: dict | None = None) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """Every model's permutations maximising ``<score, P>`` per group (per block of a Blocks inner group):
    with ``warm`` (a dict kept across the calls of one search) every plain group's problem is warm-started
    from the last call's solver state for that (model, group), since the gradients change little from one
    Frank-Wolfe iteration to the next; the rest, all (model, group, block) problems of one size in one
    batched assignment."""
    by_size: dict[int, list[tuple[int, str]]] = {}
    out: list[dict[str, torch.Tensor]] = [{} for _ in scores]
    for a, ms in enumerate(scores):
        for g, m in ms.items():
            if warm is not None and m.dim() == 2:
                if (a, g) not in warm:
                    warm[a, g] = (WarmAssigner(), np.empty(m.shape, dtype=np.float64))
                assigner, cost = warm[a, g]
                np.negative(m.detach().cpu().double().numpy(), out=cost)  # in place: the bound solver reads it
                out[a][g] = torch.from_numpy(np.asarray(assigner.solve(cost), dtype=np.int64))
            else:
                by_size.setdefault(m.shape[-1], []).append((a, g))
    for size, problems in by_size.items():
        stacks = [scores[a][g].detach().reshape(-1, size, size) for a, g in problems]
        _, cols = pyperm.batch_linear_sum_assignment(torch.cat(stacks).to(torch.float64).cpu(), maximize=True)
        for (a, g), part in zip(problems, cols.split([s.shape[0] for s in stacks])):
            # A Blocks inner group: positions within each block, offset by the block's start.
            offsets = torch.arange(part.shape[0], dtype=torch.int64).view(-1, 1) * size
            out[a][g] = (part + offsets).reshape(-1)
    return out
