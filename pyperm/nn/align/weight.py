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
similarity matrix from every weight at every step) is :class:`WeightMatcher`
(:mod:`pyperm.nn.align._matcher`): every spec form is lowered to plain tensor pieces
(:mod:`pyperm.nn.align._pieces`), the similarity products read the stored tensors in blocks
(views; no tensor is copied or converted whole, so a model's extra memory is a fraction of
its size), each group's similarity is kept up to date by rank-``k`` corrections when ``k``
units of a neighbour move (:mod:`pyperm.nn.align._similarity`), a group none of whose neighbours moved is
not solved again, and every assignment is warm-started from the group's previous one. Where the
identity start stalls, the default start adds the signature start
(:mod:`pyperm.nn.align._starts`).

Measured with ``pyperm bench match`` (2-core machine): the similarity products are most
of the time, and they are bounded by the machine's float32 matrix-multiply rate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from pyperm._checks import check_callable, check_choice, check_int, check_nonnegative_real, torch_generator
from pyperm.nn._checks import check_spec
from pyperm.nn.align._objective import (
    WeightMatchingResult,
    _check_dtype,
    _check_state,
    _objective,
    _objective_keys,
)
from pyperm.nn.align._matcher import WeightMatcher
from pyperm.nn.align._starts import STARTS, match_from
from pyperm.nn.permutations import as_permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["WeightMatchingResult", "weight_matching", "matching_objective"]


def matching_objective(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    perms: Mapping[str, Any] | None = None,
    *,
    keys: Iterable[str] | None = None,
) -> float:
    r"""The weight-matching objective :math:`\operatorname{vec}(\Theta_A) \cdot \operatorname{vec}(\pi(\Theta_B))`.

    Parameters
    ----------
    spec : PermutationSpec
        The models' permutation groups.
    state_a, state_b : mapping of str to torch.Tensor
        State dicts with exactly the spec's keys and equal shapes.
    perms : Permutations or mapping of str to (n,) int array, optional
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
    check_spec(spec)
    sa = _check_state(spec, state_a, "state_a")
    sb = _check_state(spec, state_b, "state_b")
    checked = as_permutations(spec, perms) if perms is not None else spec.identity()
    return _objective(spec, sa, sb, checked, _objective_keys(spec, sa, keys))


def weight_matching(
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    *,
    init: Mapping[str, Any] | str | None = "best",
    max_iter: int = 100,
    seed: int | torch.Generator = 0,
    progress: bool = False,
    keys: Iterable[str] | None = None,
    tol: float = 1e-12,
    dtype: torch.dtype = torch.float32,
    product_dtype: torch.dtype | None = None,
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
        model, or :meth:`PermutationSpec.from_model`), any axis form. A
        :class:`~pyperm.nn.spec.Blocks` outer group (attention heads, the groups of a grouped
        convolution) moves with its inner groups in one step: the units of every pair of
        blocks are matched, then the blocks on the values of those matchings (an assignment
        of assignments). A group on two axes of one tensor (``P W P^T``) makes the objective
        quadratic in it: its step solves the linearisation and is kept only when the exact
        objective rises.
    state_a, state_b : mapping of str to torch.Tensor
        The two models' state dicts, exactly the spec's keys, equal shapes, finite values,
        all on one device. B is the model to be permuted.
    init : {"best", "identity", "signatures"}, Permutations or mapping of str to (n,) int array, default "best"
        Where the search starts. ``"identity"`` (or None) is Algorithm 1 as published: B
        as it is. Its result depends on the other groups' order and can stall far from
        the optimum (a planted permutation of MobileNetV2 with torchvision's
        initialisation ends at 74% of its objective; a ViT's heads and head dims stall
        likewise). ``"signatures"`` matches every group's units on their own first, by
        signatures that no other group's order changes (64 order statistics of every
        slice a unit owns), and finds such planted permutations exactly. ``"best"`` first
        checks whether B is an exact permuted copy of A (every tensor's norm equal to its
        counterpart's): then it pairs every group's units by a fingerprint no other group's
        order changes, and when that attains the objective's upper bound
        :math:`\\sum_k \\|A_k\\|\\,\\|B_k\\|` returns it with no sweep (``iterations == 0``:
        no permutation can do better). Otherwise it runs the identity start and then, only
        when B looks like a permuted copy of A that the identity start left partly
        unaligned (some tensor aligned almost exactly, or every tensor's norm equal to its
        counterpart's, and some tensor far from aligned), the signature start too, keeping
        the higher objective: it never ends below Algorithm 1, and costs a few percent more
        than ``"identity"`` when it does not try the signature start (``callback`` sees
        both runs when it does; none when the copy check answers). A :class:`~pyperm.nn.Permutations`
        (or a mapping of one permutation per group) gives the initial permutations themselves.
    max_iter : int, default 100
        Most sweeps over the groups (0: none, the result is the start).
    seed : int or torch.Generator, default 0
        Seeds the order in which the groups are visited (the global RNG is never used).
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
    product_dtype : torch.dtype, optional
        The dtype the similarity products run in. By default a bfloat16 model's run in
        bfloat16 (the hardware accumulates in float32: this CPU's AVX512_BF16, a GPU's
        tensor cores) and each block of at most 32 MiB of entries is rounded once to
        bfloat16 before it is added into the float32 similarity; every other model's run in
        ``dtype``. ``torch.float32`` converts bfloat16/float16 blocks first (exact products,
        float32 speed). The tensors themselves are never converted whole.
    callback : callable, optional
        Called after every sweep as ``callback(sweep, perms, objective)`` with the sweep's
        number (from 1), the current permutations (read-only: on the state's device) and
        the objective. Returning ``True`` stops the search after that sweep, ``False`` or
        ``None`` goes on, anything else is a TypeError (as for every pyperm callback; the result
        then has ``converged=False`` unless the sweep improved nothing). Meant for
        logging and early stopping by the methods built on this one.

    Returns
    -------
    WeightMatchingResult
        ``perms`` (a :class:`~pyperm.nn.Permutations`), the ``objective`` history, the
        ``iterations`` (sweeps) run and whether the search ``converged``.

    Raises
    ------
    TypeError
        ``spec`` is not a PermutationSpec, an entry is not a tensor, or ``seed``,
        ``max_iter``, ``tol``, ``keys``, ``dtype`` or ``callback`` has the wrong type.
    ValueError
        A state dict does not match the spec, the two differ in shape, a matched entry is
        not finite, the tensors are on several devices, ``init`` is an unknown start or
        not one permutation per group, or ``max_iter``, ``seed`` or ``tol`` is out of range.

    See Also
    --------
    pyperm.nn.Permutations.apply : apply ``result.perms`` to model B's state dict.

    References
    ----------
    S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo
    Permutation Symmetries", ICLR 2023, section 3.2 and Algorithm 1.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import weight_matching
    >>> from pyperm.nn.models import MLP
    >>> a, b = MLP([16, 32, 32, 4]), MLP([16, 32, 32, 4])
    >>> spec = a.permutation_spec()
    >>> result = weight_matching(spec, a.state_dict(), b.state_dict(), seed=0)
    >>> b.load_state_dict(result.perms.apply(b.state_dict()))
    <All keys matched successfully>
    >>> result.objective[-1] >= result.objective[0]
    True
    """
    check_spec(spec)
    options = {
        "max_iter": check_int(max_iter, "max_iter", 0),
        "tol": check_nonnegative_real(tol, "tol"),
        "dtype": _check_dtype(dtype),
        "product_dtype": product_dtype,
        "callback": check_callable(callback, "callback", allow_none=True),
        "keys": keys,
        "progress": progress,
    }
    torch_generator(seed)  # a bad seed fails here, before any start is computed
    if isinstance(init, str):
        return match_from(check_choice(init, "init", STARTS), spec, state_a, state_b, seed, **options)
    start = None if init is None else as_permutations(spec, init, "init")
    matcher = WeightMatcher(spec, state_b, keys=options.pop("keys"), dtype=options.pop("dtype"),
                            product_dtype=options.pop("product_dtype"))
    return matcher.match(state_a, init=start, seed=seed, **options)
