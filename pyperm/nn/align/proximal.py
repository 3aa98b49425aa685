r"""PAM: proximal alternating minimization over the permutation and the curve (Tatro et al. appendix E).

The joint problem (Tatro et al. eq. 5) looks for a curve from :math:`\theta_A` to a
permuted :math:`P\theta_B` and the permutation together,

.. math::

    \min_{\phi, P}\ Q(\phi, P) = \mathbb{E}_{t \sim U[0,1]}\, \mathcal{L}\big(r(t; \phi, P)\big),
    \qquad P = \operatorname{blockdiag}(P_1, \dots, P_{L-1}),\ P_l \in \Pi_{|K_l|},

with the quadratic Bezier curve whose control point is an *offset* from the midpoint of
the segment (eq. 35),

.. math::

    r(t; \tilde\theta_c, P) = (1-t)^2\theta_A + t^2 P\theta_B
        + 2(1-t)t\Big(\frac{\theta_A + P\theta_B}{2} + \tilde\theta_c\Big)
      = (1-t)\,\theta_A + t\,P\theta_B + 2t(1-t)\,\tilde\theta_c .

PAM (eq. 34; Attouch et al. 2010) alternates two proximal subproblems,

.. math::

    P^{k+1} &= \arg\min_{P} Q(\phi^k, P) + \tfrac{1}{2\nu_P}\|P - P^k\|_F^2, \\
    \phi^{k+1} &= \arg\min_{\phi} Q(\phi, P^{k+1}) + \tfrac{1}{2\nu_\phi}\|\phi - \phi^k\|_2^2,

with :math:`\phi = \tilde\theta_c`, zero at the start (the first curve is the straight
line from :math:`\theta_A` to :math:`P^0\theta_B`). Theorem E.1 gives
:math:`Q(\phi^{k+1}, P^{k+1}) + \text{proximal terms} \le Q(\phi^k, P^k)` for exact
subproblem solutions.

**The permutation step** (E.2, E.4). Each block :math:`P_g` is relaxed to a doubly
stochastic :math:`D_g`, started at :math:`P^k_g`, and ``perm_steps`` steps of projected
SGD are taken on :math:`\mathcal{L}(r(t; \phi^k, D)) + \frac{1}{2\nu_P}\|D - P^k\|_F^2`
(one batch and one :math:`t \sim U[0,1]` per step; :math:`D\theta_B` multiplies every
axis a group acts on by its :math:`D_g`, so a unit of :math:`D\theta_B` is a convex
combination of units of :math:`\theta_B`), each step projected back by 20 alternating
projections (:func:`pyperm.project_doubly_stochastic`). The gradient in :math:`D_g` scales
with the weights it multiplies, so one step size suits one model only: by default
(``lr_perm="auto"``) every group's step is scaled to a running mean of its gradient's
norm, and a step whose iterate diverges is undone and its group's step halved (a diverged
iterate never reaches the decomposition below). The last iterate is projected on
until it is doubly stochastic to 1e-7 (twenty projections leave its row and column sums
off by up to ~0.1 after large steps, and the decomposition below needs a doubly
stochastic matrix): that is :math:`D^*`, from which the candidate set of eq. 51 is built,

.. math::

    S = \{P^k,\ P_\Pi(D^*),\ R^{(1)}, \dots, R^{(M)}\},

the assignment projection of every block (eq. 52, :func:`pyperm.linear_sum_assignment`)
and ``perm_samples`` block permutations drawn from the truncated max-weight
Birkhoff-von Neumann decompositions (eq. 53-54, ``max_terms`` terms,
:func:`pyperm.sample_permutations`), and :math:`P^{k+1}` is the candidate of least
:math:`\hat Q(\phi^k, P) + \frac{1}{2\nu_P}\|P - P^k\|_F^2`. Because :math:`P^k` is a
candidate, this never increases :math:`\hat Q`.

**The curve step**. A :class:`~pyperm.nn.curves.BezierCurve` from :math:`\theta_A` to
:math:`P^{k+1}\theta_B` is built with its bend at
:math:`(\theta_A + P^{k+1}\theta_B)/2 + \tilde\theta_c^k` and trained by
:func:`~pyperm.nn.curves.train_curve` for ``curve_epochs`` epochs; the proximal term's
gradient :math:`(\theta_c - \theta_c^k)/\nu_\phi` is added to the bend's gradient by a
hook (with the midpoint fixed during the step, :math:`\theta_c - \theta_c^k =
\tilde\theta_c - \tilde\theta_c^k`). Both learning rates are multiplied by ``anneal``
after every outer iteration ("the learning rates are annealed with each iteration of
PAM", E.2).

**The estimate of Q** that judges the candidates and is reported per outer iteration,
:math:`\hat Q`, is the mean training loss over the first ``judge_batches`` batches of
``data`` at the ``judge_points`` midpoint-rule nodes :math:`t_i = (i + 1/2)/m`, with the
network in train mode (BatchNorm on batch statistics, as in curve training; no running
statistic of anything is kept). It is deterministic, so every candidate is compared on
the same batches and points.

Assumptions (the text extraction of appendix E garbled the formulas; reconstructed from
the prose):

- Eq. 35's offset :math:`\tilde\theta_c` is *not* permuted when :math:`P` changes: it is
  the curve variable :math:`\phi`, held fixed by the permutation subproblem of eq. 34,
  while the midpoint :math:`(\theta_A + P\theta_B)/2` follows :math:`P` ("the control
  point is a function of the permutation P ... this coupling ... is critical"). So a new
  :math:`P` changes the curve; only the offset carries over.
- The norms of eq. 34 are Frobenius norms summed over the blocks; for permutations
  :math:`\|P - P^k\|_F^2 = 2 \times` (units moved).
- The paper does not say how the proximal term enters projected SGD; it is stepped
  exactly (an implicit step, stable for any step size), the loss by its gradient.
- The paper gives no step size for the relaxed permutations; ``lr_perm="auto"`` is
  pyperm's (see ``lr_perm``).
- The paper's "20 epochs of projected SGD" is ``perm_steps = 20 * len(data)`` here
  (steps, one batch each, cycling through ``data``); its single outer iteration is
  ``max_iter=1``.
- BatchNorm running statistics of the relaxed network are :math:`(1-t)\theta_A +
  tD\theta_B` (they play no part in the train-mode loss).

References
----------
.. [1] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing Mode
   Connectivity via Neuron Alignment", NeurIPS 2020, section 3.1, appendix E (eq. 34-35,
   51-55).
.. [2] H. Attouch, J. Bolte, P. Redont, A. Soubeyran, "Proximal alternating minimization
   and projection methods for nonconvex problems", Mathematics of Operations Research 35,
   2010.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pyperm._checks import check_callable, check_choice, check_fraction, check_int, check_positive_real
from pyperm._progress import progress_bar
from pyperm.nn._checks import check_model_states, check_module, check_spec
from pyperm.nn._runtime import check_batches
from pyperm.nn.align import _relaxation as relax
from pyperm.nn.align._proximal_curve import (
    CurveFunction,
    Judge,
    build_curve,
    cycle,
    fixed_batches,
    keyed_offset,
    moved_units,
    perms_key,
    proximal_hooks,
)
from pyperm.nn.curves.bezier import BezierCurve
from pyperm.nn.curves.train import train_curve
from pyperm.nn.permutations import Permutations, apply_permutation, as_permutations
from pyperm.nn.spec import PermutationSpec

__all__ = ["PAMIteration", "PAMResult", "pam"]

logger = logging.getLogger(__name__)

_INITS = ("identity", "activation", "weight")
_RECIPES = ("tatro",)
_FINAL_TOL = 1e-7  # how doubly stochastic the relaxed solution D* is made before the candidates
_TIMINGS = ("relaxed_forward_backward", "projection", "assignment", "bvn_sampling", "candidates", "curve_step")
# lr_perm="auto": how far a step moves each unit's row of D (L2 norm, before the projection).
# Chosen on PAM Unaligned for a digits MLP, a digits CNN with BatchNorm and ResNet20 x1 on the
# digits (pyperm bench pam --lr-perm auto,0.1,1,10,100,1000): after two outer iterations its
# objective was within 1% of the best fixed step's on the MLP, 9% above it on the CNN and 10%
# below it on ResNet20. 0.5 suited the CNN better but left the MLP and ResNet20 where they
# started (D spread too thin to sample a better permutation from); 0.1 moved the CNN little.
AUTO_STEP = 0.2
# An iterate farther than this from doubly stochastic after its projections has diverged
# (twenty projections leave up to ~0.1 after a large step that is sound); its step is undone
# and its group's step halved.
_DIVERGED = 0.5
# Halvings of one group's step before PAM gives up on it (a step 2**-30 of the given one).
_MAX_BACKOFFS = 30
# A relaxed solution with less mass than this off P^k did not move: every candidate is P^k or
# next to it.
_STILL = 1e-3


@dataclass
class PAMIteration:
    """What one outer iteration of PAM did.

    Attributes
    ----------
    objective_after_perm : float
        :math:`\\hat Q(\\phi^k, P^{k+1})`, after the permutation step (at most the
        previous objective).
    objective : float
        :math:`\\hat Q(\\phi^{k+1}, P^{k+1})`, after the curve step.
    choice : str
        The candidate taken: ``"previous"`` (:math:`P^k`), ``"projection"``
        (:math:`P_\\Pi(D^*)`) or ``"sample i"``.
    moved : dict of str to int
        Units each group moved, :math:`P^{k+1}` against :math:`P^k`.
    candidates : int
        Distinct candidates judged.
    relaxed_defect : float
        How far the last relaxed blocks were from doubly stochastic (largest row or
        column sum error or negative entry).
    relaxed_spread : float
        Mass of the relaxed solution off the previous permutation,
        :math:`1 - \\sum_g \\operatorname{tr}(P_g^{k\\top} D^*_g) / \\sum_g n_g`: 0 when
        :math:`D^*` stayed at :math:`P^k` (then every candidate is :math:`P^k`; raise
        ``lr_perm``, PAM warns below 1e-3), near 1 when it moved far.
    lr_perm : dict of str to float
        The step size of each group's relaxed matrix in the last relaxed step (with
        ``lr_perm="auto"``, the one scaled to the gradient; after any back-off).
    backoffs : int
        Relaxed steps undone because the iterate diverged (its group's step halved).
    curve_loss : list of float
        :func:`~pyperm.nn.curves.train_curve`'s mean training loss per epoch.
    timings : dict of str to float
        Seconds spent in ``"relaxed_forward_backward"``, ``"projection"``,
        ``"assignment"``, ``"bvn_sampling"``, ``"candidates"`` (judging them, forward
        passes) and ``"curve_step"``.
    """

    objective_after_perm: float
    objective: float
    choice: str
    moved: dict[str, int]
    candidates: int
    relaxed_defect: float
    relaxed_spread: float
    lr_perm: dict[str, float]
    backoffs: int
    curve_loss: list[float]
    timings: dict[str, float]


@dataclass
class PAMResult:
    """The outcome of :func:`pam`.

    Attributes
    ----------
    perms : Permutations
        :math:`P^K`: B permuted by it (:meth:`Permutations.apply`) is the curve's end.
    curve : BezierCurve
        The curve from A to :math:`P^K\\theta_B`, bend at
        :math:`(\\theta_A + P^K\\theta_B)/2 + \\tilde\\theta_c^K`.
    objective : list of float
        :math:`\\hat Q(\\phi^k, P^k)` for ``k = 0..iterations`` (the first at the
        initial permutation and the straight line).
    init_perms : Permutations
        :math:`P^0`, where the search started (``init``).
    iterations : int
        Outer iterations run (``max_iter``).
    history : list of PAMIteration
        One record per outer iteration.
    """

    perms: Permutations
    curve: BezierCurve
    objective: list[float]
    init_perms: Permutations
    iterations: int = 0
    history: list[PAMIteration] = field(default_factory=list)

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per part, summed over the outer iterations."""
        total: dict[str, float] = {}
        for it in self.history:
            for k, v in it.timings.items():
                total[k] = total.get(k, 0.0) + v
        return total


# ---------------------------------------------------------------------- PAM


def pam(
    model: nn.Module,
    spec: PermutationSpec,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any],
    *,
    init: str | Mapping[str, Any] = "identity",
    max_iter: int = 1,
    perm_steps: int = 100,
    curve_epochs: int = 10,
    lr_perm: float | str = "auto",
    lr_curve: float = 0.01,
    nu_perm: float = 1e3,
    nu_curve: float = 1e3,
    perm_samples: int = 32,
    max_terms: int = 10,
    seed: int = 0,
    progress: bool = False,
    momentum: float = 0.9,
    anneal: float = 0.5,
    judge_points: int = 3,
    judge_batches: int | None = 10,
    projection_iters: int = 20,
    projection_tol: float | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    recipe: str | None = None,
) -> PAMResult:
    r"""Proximal alternating minimization over permutation and curve (Tatro et al. appendix E).

    Alternates the permutation step (projected SGD on the blockwise doubly stochastic
    relaxation, then the best of :math:`P^k`, the assignment projection and
    ``perm_samples`` Birkhoff-von Neumann samples) and the curve step (training the
    offset :math:`\tilde\theta_c` of eq. 35 with a proximal term); see the module
    docstring for the equations and the assumptions made in reconstructing them.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture, run through :func:`torch.func.functional_call`; never modified
        (its training flags are restored).
    spec : PermutationSpec
        The permutation groups of the model, in any spec form (flat, ``Segments``,
        ``Tiled``, ``Blocks``, a group on two axes).
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints' state dicts (``model.state_dict()`` keys; same shapes, dtypes and
        devices). Not modified; B is the model permuted.
    data : re-iterable of (inputs, targets, ...)
        Training batches (a DataLoader or a list): the permutation step cycles through
        them one batch per step, the curve step reads them ``curve_epochs`` times, and
        the first ``judge_batches`` judge the candidates.
    init : {"identity", "activation", "weight"}, Permutations or mapping, default "identity"
        :math:`P^0`: the identity ("PAM Unaligned"), activation matching of the two
        models on ``data`` or weight matching ("PAM Aligned"), or the permutations
        themselves (a :class:`~pyperm.nn.Permutations` or one permutation per group).
    max_iter : int, default 1
        Outer iterations :math:`K` (the paper uses one; 0: none, the result is the
        straight line at :math:`P^0`).
    perm_steps : int, default 100
        Projected SGD steps of the permutation step (one batch each).
    curve_epochs : int, default 10
        Epochs of curve training per curve step (the paper: 250).
    lr_perm : float or "auto", default "auto"
        Step size of projected SGD on the relaxed permutations. The loss's gradient in
        :math:`D` scales with the weights it multiplies, so a fixed number suits one
        model only (about 1 for a digits MLP, 1000 for a small digits CNN, 10 for
        ResNet20, measured on pyperm's benchmark models). ``"auto"`` scales every
        group's step to a running mean of its gradient's norm, so that a step moves each
        unit's row of :math:`D_g` by about 0.2 (``AUTO_STEP``); its choice is recorded in
        ``PAMIteration.lr_perm``. A number gives plain projected SGD with that step, as
        the paper runs it. Either way a step whose iterate diverges (no longer near
        doubly stochastic after its projections, or not finite) is undone and its
        group's step halved, with a warning (``PAMIteration.backoffs``), and PAM warns
        when the relaxation did not move (``PAMIteration.relaxed_spread`` below 1e-3).
    lr_curve : float, default 0.01
        Learning rate of the bend (SGD with ``momentum``).
    nu_perm, nu_curve : float
        :math:`\nu_P`, :math:`\nu_\phi` of eq. 34 (larger: weaker proximal pull). The
        permutation's proximal term is stepped exactly, so any ``lr_perm`` suits it;
        the curve's enters as a gradient, so ``lr_curve / nu_curve`` must be below 1.
    perm_samples : int, default 32
        :math:`M`, block permutations sampled from the BvN decompositions.
    max_terms : int, default 10
        Terms of each block's decomposition kept for sampling.
    seed : int, default 0
        Seeds every random choice (the points :math:`t`, the samples, curve training);
        the global RNGs are not used.
    progress : bool, default False
        A progress bar over the outer iterations.
    momentum : float, default 0.9
        SGD momentum of the curve step.
    anneal : float, default 0.5
        Factor applied to both learning rates after every outer iteration (in (0, 1]).
    judge_points : int, default 3
        Points :math:`t` of the estimate :math:`\hat Q` (midpoint rule).
    judge_batches : int or None, default 10
        Batches of ``data`` in :math:`\hat Q` (None: all).
    projection_iters : int, default 20
        Alternating projections per step (the paper's 20).
    projection_tol : float or None, default None
        None: exactly ``projection_iters`` projections per step, as the paper does (they
        leave the iterates' row and column sums off by up to ~0.1 after large steps).
        A number: go on projecting, ``projection_iters`` at a time (at most 50 rounds),
        until every sum is within this of 1 (exact projected SGD, at several times the
        cost of the projections). Either way the relaxed solution :math:`D^*` is
        projected to within 1e-7 before the candidates are drawn from it.
    loss_fn : callable, optional
        ``loss_fn(outputs, targets)``, the batch's mean loss; cross-entropy by default.
    recipe : {"tatro"}, optional
        The curve step as Tatro et al.'s code (IBM/NeuronAlignment) runs it: SGD with
        Nesterov ``momentum``, their schedule ``lr_curve * 0.5**(e // 20) * 0.9996**e``
        over the curve epochs ``e`` (continued, not annealed, from one outer iteration to
        the next), the regulariser :math:`\frac{\lambda}{2}\|r(t)\|^2` on the point of the
        curve with :math:`\lambda = 5\cdot 10^{-4}` (``train_curve``'s ``point_decay``),
        and the proximal term as its exact proximal map after every step, outside the
        optimizer, so that ``nu_curve`` is their :math:`\nu` (their runs: ``lr_curve=0.1``,
        ``nu_curve=1e3``, 250 curve epochs). Default (None): heavy-ball momentum, a
        constant rate annealed by ``anneal``, no regulariser, and the proximal term as a
        gradient (which the momentum then carries: about ten times stronger at the same
        ``nu_curve``). The permutation step is the same either way.

    Returns
    -------
    PAMResult
        ``perms`` (a :class:`~pyperm.nn.Permutations`), ``curve`` (a trained
        :class:`~pyperm.nn.curves.BezierCurve` from A to ``perms.apply(state_b)``),
        ``objective`` (:math:`\hat Q` per outer iteration, starting with the initial
        one), ``init_perms`` (:math:`P^0`), the ``iterations`` run and their ``history``
        (one :class:`PAMIteration` each, with timings).

    Raises
    ------
    TypeError
        ``model`` is not a module, ``spec`` not a PermutationSpec, ``data`` not a
        re-iterable of batches, ``init`` of another type, or a number of the wrong type.
    ValueError
        The states do not match each other, the model or the spec; ``init`` is an
        unknown string or not one permutation per group; a count or rate is out of range.

    Notes
    -----
    The permutation step never increases :math:`\hat Q + \frac{1}{2\nu_P}\|P-P^k\|^2`
    (its current permutation is a candidate); the curve step is stochastic, so the
    objective may rise by the noise of SGD between outer iterations.

    References
    ----------
    .. [1] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing
       Mode Connectivity via Neuron Alignment", NeurIPS 2020, appendix E.
    .. [2] H. Attouch, J. Bolte, P. Redont, A. Soubeyran, "Proximal alternating
       minimization and projection methods for nonconvex problems", 2010.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import PermutationSpec, pam
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    >>> spec = PermutationSpec.from_model(net, torch.randn(2, 4))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: torch.randn_like(v) for k, v in a.items()}
    >>> g = torch.Generator().manual_seed(0)
    >>> data = [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(2)]
    >>> result = pam(net, spec, a, b, data, perm_steps=4, curve_epochs=1, perm_samples=4)
    >>> result.iterations, len(result.objective), sorted(result.perms)
    (1, 2, ['P_0'])
    """
    opts = _Options.checked(
        max_iter=max_iter, perm_steps=perm_steps, curve_epochs=curve_epochs, lr_perm=lr_perm, lr_curve=lr_curve,
        nu_perm=nu_perm, nu_curve=nu_curve, perm_samples=perm_samples, max_terms=max_terms, seed=seed,
        momentum=momentum, anneal=anneal, judge_points=judge_points, judge_batches=judge_batches,
        projection_iters=projection_iters, projection_tol=projection_tol, loss_fn=loss_fn, recipe=recipe,
    )  # fmt: skip
    run = _start(model, spec, state_a, state_b, data, init, opts)
    history: list[PAMIteration] = []
    bar = progress_bar(progress, opts.max_iter, "PAM", "iteration")
    try:
        for k in range(opts.max_iter):
            history.append(_outer_iteration(run, opts, k))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(objective=f"{run.objective[-1]:.4g}")
    finally:
        if bar is not None:
            bar.close()
    return _result(run, history)


# ---------------------------------------------------------------------- the phases


@dataclass(frozen=True)
class _Options:
    """PAM's numeric options, checked."""

    max_iter: int
    perm_steps: int
    curve_epochs: int
    lr_perm: float | None  # None: "auto"
    lr_curve: float
    nu_perm: float
    nu_curve: float
    perm_samples: int
    max_terms: int
    seed: int
    momentum: float
    anneal: float
    judge_points: int
    judge_batches: int | None
    projection_iters: int
    projection_tol: float | None
    loss_fn: Callable[..., torch.Tensor]
    recipe: str | None

    @classmethod
    def checked(cls, **values: Any) -> _Options:
        """The options, each checked (TypeError or ValueError naming it) and in its canonical type."""
        minimum = {"max_iter": 0, "perm_steps": 0, "curve_epochs": 0, "perm_samples": 0, "max_terms": 1, "seed": 0,
                   "judge_points": 1, "projection_iters": 1}  # fmt: skip
        for name, least in minimum.items():
            values[name] = check_int(values[name], name, least)
        values["judge_batches"] = check_int(values["judge_batches"], "judge_batches", 1, allow_none=True)
        values["lr_perm"] = _check_lr_perm(values["lr_perm"])
        for name in ("lr_curve", "nu_perm", "nu_curve"):
            values[name] = check_positive_real(values[name], name)
        values["anneal"] = check_positive_real(values["anneal"], "anneal", upper=1.0)
        if values["projection_tol"] is not None:
            values["projection_tol"] = check_positive_real(values["projection_tol"], "projection_tol")
        values["momentum"] = check_fraction(values["momentum"], "momentum")
        if values["momentum"] == 1.0:  # a momentum of 1 never forgets a gradient: SGD does not converge
            raise ValueError("momentum must lie in [0, 1), got 1.0")
        values["loss_fn"] = check_callable(values["loss_fn"], "loss_fn", allow_none=True) or F.cross_entropy
        if values["recipe"] is not None:
            values["recipe"] = check_choice(values["recipe"], "recipe", _RECIPES)
        # The curve's proximal term enters as a gradient (x - x^k) / nu of explicit steps, which
        # overshoot x^k (and, with momentum, oscillate) once lr / nu reaches 1. (The permutation's
        # is stepped exactly: any lr_perm suits it; so is the curve's under recipe="tatro".)
        if values["recipe"] is None and values["lr_curve"] / values["nu_curve"] >= 1.0:
            raise ValueError("lr_curve / nu_curve must be below 1 (the proximal term is a gradient step), "
                             f"got {values['lr_curve'] / values['nu_curve']:.3g}")
        return cls(**values)


def _check_lr_perm(value: Any) -> float | None:
    """``lr_perm``: a positive number, or None for ``"auto"``."""
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"lr_perm must be 'auto' or a finite positive number, got {value!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"lr_perm must be 'auto' or a finite positive number, got {type(value).__name__}")
    return check_positive_real(value, "lr_perm")


@dataclass
class _Run:
    """What PAM carries from one outer iteration to the next, and what it reads throughout."""

    model: nn.Module
    spec: PermutationSpec
    sa: dict[str, torch.Tensor]  # private detached copies of the endpoints
    sb: dict[str, torch.Tensor]
    data: Iterable[Any]
    device: torch.device  # where the endpoints' floating-point entries live
    fn: CurveFunction
    judge: Judge
    stream: Iterator[tuple[tuple, torch.Tensor]]  # the permutation step's batches, cycling
    gen: torch.Generator  # the points t and the curve step's seeds
    rng: np.random.Generator  # the BvN samples
    init_perms: Permutations
    perms: Permutations  # P^k
    offset: dict[str, torch.Tensor]  # the bend's offset from the midpoint, by key (phi^k)
    offset_flat: list[torch.Tensor] | None = None  # the same, laid out as BezierCurve.bends()
    objective: list[float] = field(default_factory=list)
    curve: BezierCurve | None = None


def _start(model: Any, spec: Any, state_a: Any, state_b: Any, data: Any, init: Any, opts: _Options) -> _Run:
    r"""Check the model, spec, states and data; private copies of the states, :math:`P^0`, the
    judge :math:`\hat Q` and its value on the straight line at :math:`P^0`."""
    check_module(model, "model")
    check_spec(spec)
    check_model_states(model, state_a, state_b)
    spec.check_state_dict(state_a, "state_a")
    data = check_batches(data, "data", reiterable=True)
    # Private detached copies: the user's state dicts are never touched.
    sa = {k: v.detach().clone() for k, v in state_a.items()}
    sb = {k: v.detach().clone() for k, v in state_b.items()}
    device = next((v.device for v in sa.values() if v.is_floating_point()), torch.device("cpu"))
    perms = _initial_perms(init, model, spec, sa, sb, data, opts.seed)
    fn = CurveFunction(model, spec, sa, sb, opts.loss_fn)
    judged = fixed_batches(data, opts.judge_batches, device)
    run = _Run(model=model, spec=spec, sa=sa, sb=sb, data=data, device=device, fn=fn,
               judge=Judge(fn, judged, opts.judge_points), stream=cycle(data, device),
               gen=torch.Generator().manual_seed(opts.seed),
               rng=np.random.default_rng(opts.seed), init_perms=perms, perms=perms,
               offset={k: torch.zeros_like(sa[k]) for k in fn.params})  # fmt: skip
    run.objective.append(run.judge(run.offset, perms))
    logger.info("pam: initial objective %.6g (init=%s)", run.objective[0], init if isinstance(init, str) else "given")
    return run


def _initial_perms(init: Any, model: nn.Module, spec: PermutationSpec, sa: Mapping[str, torch.Tensor],
                   sb: Mapping[str, torch.Tensor], data: Iterable[Any], seed: int) -> Permutations:
    """:math:`P^0` from ``init``: a start's name, or the permutations themselves."""
    if isinstance(init, str):
        check_choice(init, "init", _INITS)
        if init == "identity":
            return Permutations.identity(spec)
        if init == "weight":
            from pyperm.nn.align.weight import weight_matching

            return weight_matching(spec, sa, sb, seed=seed).perms
        from pyperm.nn.align.activation import activation_matching

        # Private copies: the user's model is neither loaded nor run.
        model_a, model_b = copy.deepcopy(model), copy.deepcopy(model)
        model_a.load_state_dict(sa)
        model_b.load_state_dict(sb)
        return activation_matching(model_a, model_b, spec, data).perms
    if isinstance(init, Mapping):
        return Permutations(spec, as_permutations(spec, init, "init"))  # errors name init
    raise TypeError(f"init must be one of {', '.join(map(repr, _INITS))}, a Permutations or a mapping of "
                    f"permutations, got {type(init).__name__}")  # fmt: skip


def _outer_iteration(run: _Run, opts: _Options, k: int) -> PAMIteration:
    r"""Outer iteration ``k`` (from 0): the permutation step, then the curve step, then :math:`\hat Q`."""
    timings = dict.fromkeys(_TIMINGS, 0.0)
    scale = opts.anneal**k  # both learning rates are annealed each outer iteration (E.2)
    step = _permutation_step(run, opts, scale, timings)
    start = time.perf_counter()
    curve_loss = _curve_step(run, opts, scale, k)
    timings["curve_step"] += time.perf_counter() - start
    run.objective.append(run.judge(run.offset, run.perms))
    logger.info("pam: iteration %d: objective %.6g after the curve step", k + 1, run.objective[-1])
    return PAMIteration(objective_after_perm=step.objective, objective=run.objective[-1], choice=step.choice,
                        moved=step.moved, candidates=step.candidates, relaxed_defect=step.defect,
                        relaxed_spread=step.spread, lr_perm=step.lr_perm, backoffs=step.backoffs,
                        curve_loss=curve_loss, timings=timings)  # fmt: skip


@dataclass
class _PermutationStep:
    """What the permutation step chose, for the iteration's record."""

    choice: str
    objective: float  # Q-hat at the chosen permutation (the curve unchanged)
    moved: dict[str, int]
    candidates: int
    defect: float
    spread: float
    lr_perm: dict[str, float]
    backoffs: int


def _permutation_step(run: _Run, opts: _Options, scale: float, timings: dict[str, float]) -> _PermutationStep:
    """:math:`P^{k+1}`: projected SGD on the relaxation, then the best candidate (eq. 51); sets ``run.perms``."""
    anchor = relax.one_hot(run.spec, run.perms, torch.float64, run.device)
    steps = relax.StepSizes(run.spec.sizes, None if opts.lr_perm is None else opts.lr_perm * scale, AUTO_STEP * scale)
    relaxed = _relaxed_solution(run, opts, anchor, steps, timings)
    defect = max((relax.defect(m) for m in relaxed.values()), default=0.0)
    units = sum(run.spec.sizes.values())
    spread = 1.0 - float(sum((relaxed[g] * anchor[g]).sum() for g in relaxed)) / units if units else 0.0
    _warn_about_steps(opts, steps, spread)
    candidates = _candidates(run, opts, relaxed, timings)
    start = time.perf_counter()
    choice, chosen, value, judged = _best_candidate(run, candidates, opts.nu_perm)
    timings["candidates"] += time.perf_counter() - start
    moved = moved_units(chosen, run.perms)
    run.perms = Permutations(run.spec, chosen)
    logger.info("pam: relaxed mass off P^k %.3g; the permutation step took %s (%d units moved), objective %.6g",
                spread, choice, sum(moved.values()), value)  # fmt: skip
    return _PermutationStep(choice, value, moved, judged, defect, spread, dict(steps.last), steps.backoffs)


def _relaxed_solution(run: _Run, opts: _Options, anchor: Mapping[str, torch.Tensor], steps: relax.StepSizes,
                      timings: dict[str, float]) -> dict[str, torch.Tensor]:
    """:math:`D^*`: ``perm_steps`` steps of projected SGD on the relaxed subproblem from :math:`P^k`
    (E.2, E.4), projected on until doubly stochastic to rounding.

    A step whose iterate diverged is undone and its group's step halved (``steps.back_off``):
    a diverged iterate must never reach the Birkhoff-von Neumann decomposition."""
    relaxed = {g: m.clone() for g, m in anchor.items()}
    fn = run.fn
    for _ in range(opts.perm_steps):
        start = time.perf_counter()
        inputs, targets = next(run.stream)
        t = float(torch.rand((), generator=run.gen, dtype=torch.float64))
        leaves = {g: m.detach().requires_grad_(True) for g, m in relaxed.items()}
        end = relax.apply_relaxed(run.spec, leaves, run.sb, fn.permuted_keys)
        loss = fn.loss(fn.state(t, end, run.offset), inputs, targets)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
        grads = {g: torch.zeros_like(relaxed[g]) if v is None else v for g, v in grads.items()}
        mid = time.perf_counter()
        stepped = relax.projected_step(relaxed, grads, anchor, steps(grads), opts.nu_perm, opts.projection_iters,
                                       opts.projection_tol)  # fmt: skip
        relaxed = _undo_diverged(relaxed, stepped, steps, opts)
        timings["relaxed_forward_backward"] += mid - start
        timings["projection"] += time.perf_counter() - mid
    # D* doubly stochastic to rounding: the BvN decomposition of eq. 53 needs it.
    start = time.perf_counter()
    relaxed = relax.project_blocks(relaxed, opts.projection_iters, _FINAL_TOL)
    timings["projection"] += time.perf_counter() - start
    for g, m in relaxed.items():
        # Every accepted iterate was near doubly stochastic, so this does not happen; if it did,
        # the decomposition would fail on it with a message that says nothing of the cause.
        if not bool(torch.isfinite(m).all()) or relax.defect(m) > 1e-4:
            raise ValueError(f"pam: the relaxed permutations of group {g!r} did not converge to a doubly stochastic "
                             f"matrix (defect {relax.defect(m):.3g}): {_describe_lr(opts)} is too large for this "
                             "model; lower it or pass lr_perm='auto'")  # fmt: skip
    return relaxed


def _undo_diverged(previous: Mapping[str, torch.Tensor], stepped: dict[str, torch.Tensor], steps: relax.StepSizes,
                   opts: _Options) -> dict[str, torch.Tensor]:
    """``stepped``, with the iterate of every group that diverged (not finite, or far from doubly
    stochastic after its projections) put back to ``previous`` and that group's step halved."""
    for g, m in stepped.items():
        if bool(torch.isfinite(m).all()) and relax.defect(m) <= _DIVERGED:
            continue
        stepped[g] = previous[g]
        steps.back_off(g)
        if steps.factor[g] < 2.0**-_MAX_BACKOFFS:
            raise ValueError(f"pam: the relaxed permutations of group {g!r} diverged at every step size down to "
                             f"2**-{_MAX_BACKOFFS} of {_describe_lr(opts)}: the loss's gradient in them is not "
                             "finite, or lr_perm is far too large")  # fmt: skip
    return stepped


def _describe_lr(opts: _Options) -> str:
    return "lr_perm='auto'" if opts.lr_perm is None else f"lr_perm={opts.lr_perm:g}"


def _warn_about_steps(opts: _Options, steps: relax.StepSizes, spread: float) -> None:
    """Warn when relaxed steps were undone (too large), or when the relaxation did not move (too small)."""
    if steps.backoffs:
        halved = ", ".join(repr(g) for g, f in steps.factor.items() if f < 1.0)
        cause = ("the loss's gradient in them was not finite" if opts.lr_perm is None else
                 f"lr_perm={opts.lr_perm:g} is too large for this model (lr_perm='auto' scales the step to the "
                 "gradient)")  # fmt: skip
        warnings.warn(f"pam: {steps.backoffs} relaxed permutation step(s) diverged and were undone, halving the "
                      f"step of {halved}: {cause}", RuntimeWarning, stacklevel=5)  # fmt: skip
    if opts.perm_steps and spread < _STILL:
        larger = ("a number lr_perm above the steps 'auto' chose (PAMIteration.lr_perm)" if opts.lr_perm is None
                  else f"raise lr_perm={opts.lr_perm:g}")  # fmt: skip
        warnings.warn(f"pam: the relaxed permutations did not move (relaxed_spread {spread:.2g} < {_STILL:g}), so "
                      f"every candidate is at or next to the previous permutation: {larger}, or raise "
                      f"nu_perm={opts.nu_perm:g} (a small nu_perm holds them there)", RuntimeWarning,
                      stacklevel=5)  # fmt: skip


def _candidates(run: _Run, opts: _Options, relaxed: Mapping[str, torch.Tensor],
                timings: dict[str, float]) -> list[tuple[str, Mapping[str, torch.Tensor]]]:
    """Eq. 51: :math:`P^k`, the assignment projection of :math:`D^*` and ``perm_samples`` BvN samples."""
    start = time.perf_counter()
    candidates = [("previous", dict(run.perms.items())), ("projection", relax.nearest_permutations(run.spec, relaxed))]
    timings["assignment"] += time.perf_counter() - start
    start = time.perf_counter()
    samples = (relax.sample_candidates(run.spec, relaxed, opts.perm_samples, opts.max_terms, run.rng)
               if opts.perm_samples else [])  # fmt: skip
    candidates += [(f"sample {i}", s) for i, s in enumerate(samples)]
    timings["bvn_sampling"] += time.perf_counter() - start
    return candidates


def _best_candidate(run: _Run, candidates: list[tuple[str, Mapping[str, torch.Tensor]]],
                    nu_perm: float) -> tuple[str, Mapping[str, torch.Tensor], float, int]:
    r"""The candidate of least :math:`\hat Q + \|P - P^k\|_F^2 / (2\nu_P)` (ties keep the earlier,
    :math:`P^k` first): its name, permutations and :math:`\hat Q`, and how many distinct candidates were judged."""
    seen: set[tuple] = set()
    best_name, best_perms, best_value, best_q = "previous", dict(run.perms.items()), math.inf, math.nan
    for name, cand in candidates:
        key = perms_key(cand)
        if key in seen:
            continue  # BvN samples repeat: judge each permutation once
        seen.add(key)
        q = run.objective[-1] if name == "previous" else run.judge(run.offset, cand)
        value = q + sum(moved_units(cand, run.perms).values()) / nu_perm  # ||P - P^k||^2 / (2 nu) = moved / nu
        if value < best_value:  # strict: ties keep the earlier (P^k first)
            best_name, best_perms, best_value, best_q = name, cand, value, q
    return best_name, best_perms, best_q, len(seen)


def _curve_step(run: _Run, opts: _Options, scale: float, k: int) -> list[float]:
    r""":math:`\phi^{k+1}`: the curve to :math:`P^{k+1}\theta_B`, its bend at the midpoint plus
    the offset, trained with the proximal term; sets ``run.curve`` and the offsets and
    returns :func:`~pyperm.nn.curves.train_curve`'s loss per epoch."""
    end_state = apply_permutation(run.spec, run.perms, run.sb)
    curve, mids = build_curve(run.model, run.sa, end_state, run.offset_flat)
    losses: list[float] = []
    if opts.curve_epochs and opts.recipe == "tatro":
        from pyperm.nn.align import _tatro_curve as tatro

        # The proximal map is taken by the optimizer after each step (no gradient hook); the
        # schedule goes on from the epochs of the earlier outer iterations.
        losses = train_curve(curve, run.data, epochs=opts.curve_epochs, lr=opts.lr_curve,
                             optimizer=tatro.proximal_nesterov_sgd(opts.nu_curve), momentum=opts.momentum,
                             point_decay=tatro.POINT_DECAY, lr_scheduler=tatro.tatro_scheduler(k * opts.curve_epochs),
                             seed=int(torch.randint(0, 2**62, (), generator=run.gen)),
                             loss_fn=opts.loss_fn)  # fmt: skip
    elif opts.curve_epochs:
        handles = proximal_hooks(curve, opts.nu_curve)
        try:
            losses = train_curve(curve, run.data, epochs=opts.curve_epochs, lr=opts.lr_curve * scale,
                                 momentum=opts.momentum, seed=int(torch.randint(0, 2**62, (), generator=run.gen)),
                                 loss_fn=opts.loss_fn)  # fmt: skip
        finally:
            for h in handles:
                h.remove()
    run.offset_flat = [b.detach() - m for b, m in zip(curve.bends(), mids)]
    run.offset = keyed_offset(curve, run.fn, run.sa, end_state)
    run.curve = curve
    return losses


def _result(run: _Run, history: list[PAMIteration]) -> PAMResult:
    """The result; with no outer iteration the curve is the straight line at :math:`P^0`."""
    curve = run.curve
    if curve is None:
        curve, _ = build_curve(run.model, run.sa, apply_permutation(run.spec, run.perms, run.sb), None)
    return PAMResult(perms=run.perms, curve=curve, objective=run.objective, init_perms=run.init_perms,
                     iterations=len(history), history=history)  # fmt: skip
