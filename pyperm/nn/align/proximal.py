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
projections (:func:`pyperm.project_doubly_stochastic`). The last iterate is projected on
until it is doubly stochastic to 1e-7 (twenty projections leave its row and column sums
off by up to ~0.1 after large steps, and the decomposition below needs a doubly
stochastic matrix): that is :math:`D^*`, from which the candidate set of eq. 51 is built,

.. math::

    S = \{P^k,\ P_\Pi(D^*),\ R^{(1)}, \dots, R^{(M)}\},

the assignment projection of every block (eq. 52, :func:`pyperm.linear_sum_assignment`)
and ``num_samples`` block permutations drawn from the truncated max-weight
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
- The paper's "20 epochs of projected SGD" is ``perm_steps = 20 * len(data)`` here
  (steps, one batch each, cycling through ``data``); its single outer iteration is
  ``outer_iters=1``.
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
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pyperm._checks import check_positive_real
from pyperm._progress import progress_bar
from pyperm.nn._runtime import inputs_and_targets, iterate_batches, to_device, training_flags
from pyperm.nn._checks import check_model_states, check_module, check_reiterable
from pyperm.nn.align import _relaxation as relax
from pyperm.nn.curves.bezier import BezierCurve
from pyperm.nn.curves.train import train_curve
from pyperm.nn.permutations import Permutations, apply_permutation
from pyperm.nn.spec import PermutationSpec
from pyperm.nn.state import is_mixable

__all__ = ["PAMIteration", "PAMResult", "pam"]

logger = logging.getLogger(__name__)

_INITS = ("identity", "activation", "weight")
_FINAL_TOL = 1e-7  # how doubly stochastic the relaxed solution D* is made before the candidates


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
        ``lr_perm``), near 1 when it moved far.
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
        :math:`\\hat Q(\\phi^k, P^k)` for ``k = 0..outer_iters`` (the first at the
        initial permutation and the straight line).
    init : Permutations
        :math:`P^0`.
    iterations : list of PAMIteration
        One record per outer iteration.
    """

    perms: Permutations
    curve: BezierCurve
    objective: list[float]
    init: Permutations
    iterations: list[PAMIteration] = field(default_factory=list)

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per part, summed over the outer iterations."""
        total: dict[str, float] = {}
        for it in self.iterations:
            for k, v in it.timings.items():
                total[k] = total.get(k, 0.0) + v
        return total


# ---------------------------------------------------------------------- arguments


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def _initial_perms(init: Any, model: nn.Module, spec: PermutationSpec, sa: Mapping[str, torch.Tensor],
                   sb: Mapping[str, torch.Tensor], data: Iterable[Any], seed: int) -> Permutations:
    if isinstance(init, str):
        if init not in _INITS:
            raise ValueError(f"init must be one of {_INITS} or a mapping of permutations, got {init!r}")
        if init == "identity":
            return Permutations.identity(spec)
        if init == "weight":
            from pyperm.nn.align import weight_matching

            return Permutations(spec, weight_matching(spec, sa, sb, seed=seed).perms)
        from pyperm.nn.align import activation_matching

        # Private copies: the user's model is neither loaded nor run.
        model_a, model_b = copy.deepcopy(model), copy.deepcopy(model)
        model_a.load_state_dict(sa)
        model_b.load_state_dict(sb)
        return Permutations(spec, activation_matching(model_a, model_b, data, spec).perms)
    if isinstance(init, Mapping):
        return Permutations(spec, init)
    raise TypeError(f"init must be 'identity', 'activation', 'weight' or a mapping of permutations, "
                    f"got {type(init).__name__}")


# ---------------------------------------------------------------------- the relaxed curve


class _CurveFunction:
    r"""The network :math:`r(t; \tilde\theta_c, X) = (1-t)\theta_A + tX\theta_B + 2t(1-t)\tilde\theta_c`
    for a permutation or a relaxed (doubly stochastic) :math:`X`, run by ``functional_call``.

    Parameters move on the curve; floating-point buffers on the segment (no gradient);
    other buffers are A's (cloned per call: BatchNorm increments its counter in place).
    """

    def __init__(self, model: nn.Module, spec: PermutationSpec, sa: Mapping[str, torch.Tensor],
                 sb: Mapping[str, torch.Tensor], loss_fn: Callable[..., torch.Tensor]) -> None:
        self.model, self.spec, self.sa, self.sb, self.loss_fn = model, spec, sa, sb, loss_fn
        # functional_call takes each tensor once, under its first name (tied weights).
        self.params = [n for n, p in model.named_parameters() if is_mixable(p)]
        self.fixed_params = [n for n, p in model.named_parameters() if not is_mixable(p)]
        buffers = list(model.named_buffers())
        self.float_buffers = [n for n, b in buffers if is_mixable(b) and n in sa]
        self.int_buffers = [n for n, b in buffers if not is_mixable(b) and n in sa]
        moving = self.params + self.float_buffers
        self.permuted_keys = [k for k in moving if any(g is not None for g in spec.axes.get(k, ()))]

    def state(self, t: float, end: Mapping[str, torch.Tensor], offset: Mapping[str, torch.Tensor]) -> dict:
        """The point's tensors; ``end`` holds B's permuted (or relaxed) entries of ``permuted_keys``."""
        bend = 2.0 * t * (1.0 - t)
        out: dict[str, torch.Tensor] = {}
        for k in self.params:
            b = end.get(k, self.sb[k])
            out[k] = (1.0 - t) * self.sa[k] + t * b + bend * offset[k]
        with torch.no_grad():
            for k in self.float_buffers:
                b = end.get(k, self.sb[k])
                out[k] = torch.lerp(self.sa[k], b.detach(), t)
        for k in self.fixed_params + self.int_buffers:
            out[k] = self.sa[k].clone()
        return out

    def loss(self, state: Mapping[str, torch.Tensor], inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        with training_flags(self.model, train=True):
            outputs = torch.func.functional_call(self.model, dict(state), inputs, strict=False, tie_weights=True)
        loss = self.loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return the batch's mean loss as a one-element tensor")
        return loss.reshape(())

    def permuted_end(self, perms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """B's entries of ``permuted_keys``, permuted (index selection, no matrices)."""
        return {k: _permute(self.spec, perms, k, self.sb[k]) for k in self.permuted_keys}


def _permute(spec: PermutationSpec, perms: Mapping[str, torch.Tensor], key: str, tensor: torch.Tensor) -> torch.Tensor:
    for axis, g in enumerate(spec.axes[key]):
        if g is not None:
            tensor = tensor.index_select(axis, perms[g].to(tensor.device))
    return tensor


class _Judge:
    r""":math:`\hat Q(\tilde\theta_c, P)`: mean loss over fixed batches at fixed midpoint-rule nodes."""

    def __init__(self, fn: _CurveFunction, batches: list[tuple[tuple, torch.Tensor]], points: int) -> None:
        self.fn, self.batches = fn, batches
        self.ts = [(i + 0.5) / points for i in range(points)]

    @torch.no_grad()
    def __call__(self, offset: Mapping[str, torch.Tensor], perms: Mapping[str, torch.Tensor]) -> float:
        end = self.fn.permuted_end(perms)
        total, count = 0.0, 0
        for t in self.ts:
            state = self.fn.state(t, end, offset)
            for inputs, targets in self.batches:
                n = targets.shape[0] if targets.ndim else 1
                total += float(self.fn.loss(state, inputs, targets)) * n
                count += n
        return total / count


def _proximal_hooks(curve: BezierCurve, nu: float) -> list[Any]:
    r"""Add :math:`(\theta_c - \theta_c^k)/\nu` to the bends' gradients (the proximal term of eq. 34)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    # train_curve sums the processes' gradients: each adds its share of the proximal term.
    scale = 1.0 / (nu * (torch.distributed.get_world_size() if distributed else 1))
    handles = []
    for bend in curve.bends():
        anchor = bend.detach().clone()
        handles.append(bend.register_hook(lambda g, p=bend, a=anchor: g + (p.detach() - a) * scale))
    return handles


def _build_curve(model: nn.Module, sa: Mapping[str, torch.Tensor], end_state: Mapping[str, torch.Tensor],
                 offset_flat: list[torch.Tensor] | None) -> tuple[BezierCurve, list[torch.Tensor]]:
    """A Bezier curve A -> ``end_state`` with its bend at the midpoint plus ``offset_flat``.

    A new curve's bend starts exactly at the midpoint of its segment (BezierCurve's
    contract); the flat layout of the bends depends only on the model and the states'
    dtypes, so offsets carry over between curves of one model. Returns the curve and its
    midpoints (flat, as :meth:`BezierCurve.bends`).
    """
    curve = BezierCurve(model, sa, end_state, num_bends=1)
    mids = [b.detach().clone() for b in curve.bends()]
    if offset_flat is not None:
        with torch.no_grad():
            for bend, off in zip(curve.bends(), offset_flat):
                bend.add_(off)
    return curve, mids


def _keyed_offset(curve: BezierCurve, fn: _CurveFunction, sa: Mapping[str, torch.Tensor],
                  end_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r""":math:`\tilde\theta_c` by state-dict key: the bend minus the midpoint of the segment."""
    bend = curve.bend_state(0)
    return {k: bend[k] - 0.5 * (sa[k] + end_state[k]) for k in fn.params}


def _cycle(data: Iterable[Any], device: torch.device):
    while True:
        for index, batch in iterate_batches(data, name="data"):
            inputs, targets = inputs_and_targets(batch, index, "data")
            yield to_device(inputs, device), targets.to(device)


def _moved(new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor]) -> dict[str, int]:
    return {g: int((new[g] != old[g]).sum()) for g in old}


def _key(perms: Mapping[str, torch.Tensor]) -> tuple:
    return tuple(perms[g].numpy().tobytes() for g in sorted(perms))


# ---------------------------------------------------------------------- PAM


def pam(
    model: nn.Module,
    state_a: Mapping[str, torch.Tensor],
    state_b: Mapping[str, torch.Tensor],
    data: Iterable[Any],
    spec: PermutationSpec,
    *,
    init: str | Mapping[str, Any] = "identity",
    outer_iters: int = 1,
    perm_steps: int = 100,
    curve_epochs: int = 10,
    lr_perm: float = 1.0,
    lr_curve: float = 0.01,
    nu_perm: float = 1e3,
    nu_curve: float = 1e3,
    num_samples: int = 32,
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
) -> PAMResult:
    r"""Proximal alternating minimization over permutation and curve (Tatro et al. appendix E).

    Alternates the permutation step (projected SGD on the blockwise doubly stochastic
    relaxation, then the best of :math:`P^k`, the assignment projection and
    ``num_samples`` Birkhoff-von Neumann samples) and the curve step (training the
    offset :math:`\tilde\theta_c` of eq. 35 with a proximal term); see the module
    docstring for the equations and the assumptions made in reconstructing them.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture, run through :func:`torch.func.functional_call`; never modified
        (its training flags are restored).
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints' state dicts (``model.state_dict()`` keys; same shapes, dtypes and
        devices). Not modified; B is the model permuted.
    data : re-iterable of (inputs, targets, ...)
        Training batches (a DataLoader or a list): the permutation step cycles through
        them one batch per step, the curve step reads them ``curve_epochs`` times, and
        the first ``judge_batches`` judge the candidates.
    spec : PermutationSpec
        The permutation groups of the model.
    init : {"identity", "activation", "weight"} or mapping, default "identity"
        :math:`P^0`: the identity ("PAM Unaligned"), activation matching of the two
        models on ``data`` or weight matching ("PAM Aligned"), or given permutations.
    outer_iters : int, default 1
        Outer iterations :math:`K` (the paper uses one).
    perm_steps : int, default 100
        Projected SGD steps of the permutation step (one batch each).
    curve_epochs : int, default 10
        Epochs of curve training per curve step (the paper: 250).
    lr_perm, lr_curve : float
        Learning rates of the relaxed permutations and of the bend. The loss's gradient
        in :math:`D` scales with the weights it multiplies, so ``lr_perm`` is model
        dependent: ``PAMIteration.relaxed_spread`` near 0 means :math:`D^*` never left
        :math:`P^k` (e.g. 1 suits a digits MLP, 1000 a small digits CNN, 10 ResNet20).
    nu_perm, nu_curve : float
        :math:`\nu_P`, :math:`\nu_\phi` of eq. 34 (larger: weaker proximal pull). The
        proximal terms are taken as gradients, so ``lr / nu`` must be below 1 for both.
    num_samples : int, default 32
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

    Returns
    -------
    PAMResult
        ``perms`` (a :class:`~pyperm.nn.Permutations`), ``curve`` (a trained
        :class:`~pyperm.nn.curves.BezierCurve` from A to ``perms.apply(state_b)``),
        ``objective`` (:math:`\hat Q` per outer iteration, starting with the initial
        one), ``init`` and per-iteration records with timings.

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
    .. [1] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment",
       NeurIPS 2020, appendix E.
    .. [2] H. Attouch, J. Bolte, P. Redont, A. Soubeyran, "Proximal alternating
       minimization and projection methods for nonconvex problems", 2010.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn import PermutationSpec
    >>> from pyperm.nn.align.proximal import pam
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    >>> spec = PermutationSpec.from_model(net, torch.randn(2, 4))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: torch.randn_like(v) for k, v in a.items()}
    >>> g = torch.Generator().manual_seed(0)
    >>> data = [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(2)]
    >>> result = pam(net, a, b, data, spec, perm_steps=4, curve_epochs=1, num_samples=4)
    >>> len(result.objective), sorted(result.perms)
    (2, ['P_0'])
    """
    check_module(model, "model")
    if not isinstance(spec, PermutationSpec):
        raise TypeError(f"spec must be a PermutationSpec, got {type(spec).__name__}")
    spec.require_flat("pam")
    check_model_states(model, state_a, state_b)
    spec.check_state_dict(state_a, "state_a")
    data = check_reiterable(data, "data")
    outer_iters = _int(outer_iters, "outer_iters", 0)
    perm_steps = _int(perm_steps, "perm_steps", 0)
    curve_epochs = _int(curve_epochs, "curve_epochs", 0)
    num_samples = _int(num_samples, "num_samples", 0)
    max_terms = _int(max_terms, "max_terms", 1)
    seed = _int(seed, "seed", 0)
    judge_points = _int(judge_points, "judge_points", 1)
    if judge_batches is not None:
        judge_batches = _int(judge_batches, "judge_batches", 1)
    projection_iters = _int(projection_iters, "projection_iters", 1)
    if projection_tol is not None:
        projection_tol = check_positive_real(projection_tol, "projection_tol")
    lr_perm = check_positive_real(lr_perm, "lr_perm")
    lr_curve = check_positive_real(lr_curve, "lr_curve")
    nu_perm = check_positive_real(nu_perm, "nu_perm")
    nu_curve = check_positive_real(nu_curve, "nu_curve")
    anneal = check_positive_real(anneal, "anneal", upper=1.0)
    # The proximal terms enter as gradients (x - x^k) / nu of explicit steps, which overshoot
    # x^k (and, for the curve with momentum, oscillate) once lr / nu reaches 1.
    for lr, nu, names in ((lr_perm, nu_perm, "lr_perm / nu_perm"), (lr_curve, nu_curve, "lr_curve / nu_curve")):
        if lr / nu >= 1.0:
            raise ValueError(f"{names} must be below 1 (the proximal term is a gradient step), got {lr / nu:.3g}")
    if isinstance(momentum, bool) or not isinstance(momentum, Real):
        raise TypeError(f"momentum must be a real number, got {type(momentum).__name__}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if loss_fn is None:
        loss_fn = F.cross_entropy
    elif not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")

    # Private detached copies: the user's state dicts are never touched.
    sa = {k: v.detach().clone() for k, v in state_a.items()}
    sb = {k: v.detach().clone() for k, v in state_b.items()}
    device = next((v.device for v in sa.values() if v.is_floating_point()), torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    perms = _initial_perms(init, model, spec, sa, sb, data, seed)
    initial = perms
    fn = _CurveFunction(model, spec, sa, sb, loss_fn)
    judged = []
    for index, batch in iterate_batches(data, judge_batches, "data"):
        inputs, targets = inputs_and_targets(batch, index, "data")
        judged.append((to_device(inputs, device), targets.to(device)))
    judge = _Judge(fn, judged, judge_points)
    stream = _cycle(data, device)

    offset = {k: torch.zeros_like(sa[k]) for k in fn.params}
    offset_flat: list[torch.Tensor] | None = None
    objective = [judge(offset, perms)]
    logger.info("pam: initial objective %.6g (init=%s)", objective[0], init if isinstance(init, str) else "given")
    iterations: list[PAMIteration] = []
    curve: BezierCurve | None = None

    bar = progress_bar(progress, outer_iters, "PAM", "iteration")
    try:
        for k in range(outer_iters):
            timings = dict.fromkeys(("relaxed_forward_backward", "projection", "assignment", "bvn_sampling",
                                     "candidates", "curve_step"), 0.0)
            scale = anneal**k
            # ---- permutation step: projected SGD on the relaxation, then the best candidate
            anchor = relax.one_hot(perms, torch.float64, device)
            relaxed = {g: m.clone() for g, m in anchor.items()}
            for _ in range(perm_steps):
                start = time.perf_counter()
                inputs, targets = next(stream)
                t = float(torch.rand((), generator=gen, dtype=torch.float64))
                leaves = {g: m.detach().requires_grad_(True) for g, m in relaxed.items()}
                end = relax.apply_relaxed(spec, leaves, sb, fn.permuted_keys)
                loss = fn.loss(fn.state(t, end, offset), inputs, targets)
                grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
                grads = {g: torch.zeros_like(relaxed[g]) if v is None else v for g, v in grads.items()}
                mid = time.perf_counter()
                relaxed = relax.projected_step({g: m.detach() for g, m in leaves.items()}, grads, anchor,
                                               lr_perm * scale, nu_perm, projection_iters, projection_tol)
                timings["relaxed_forward_backward"] += mid - start
                timings["projection"] += time.perf_counter() - mid
            # D* doubly stochastic to rounding: the BvN decomposition of eq. 53 needs it.
            start = time.perf_counter()
            relaxed = relax.project_blocks(relaxed, projection_iters, _FINAL_TOL)
            timings["projection"] += time.perf_counter() - start
            residual = max((relax.defect(m) for m in relaxed.values()), default=0.0)
            units = sum(spec.sizes.values())
            spread = 1.0 - float(sum((relaxed[g] * anchor[g]).sum() for g in relaxed)) / units if units else 0.0

            start = time.perf_counter()
            candidates = [("previous", dict(perms.items())), ("projection", relax.nearest_permutations(relaxed))]
            timings["assignment"] += time.perf_counter() - start
            start = time.perf_counter()
            samples = relax.sample_candidates(relaxed, num_samples, max_terms, rng) if num_samples else []
            candidates += [(f"sample {i}", s) for i, s in enumerate(samples)]
            timings["bvn_sampling"] += time.perf_counter() - start

            start = time.perf_counter()
            seen: set[tuple] = set()
            best_name, best_perms, best_value, best_q = "previous", perms, math.inf, math.nan
            for name, cand in candidates:
                key = _key(cand)
                if key in seen:
                    continue  # BvN samples repeat: judge each permutation once
                seen.add(key)
                q = objective[-1] if name == "previous" else judge(offset, cand)
                value = q + sum(_moved(cand, perms).values()) / nu_perm  # ||P - P^k||^2 / (2 nu) = moved / nu
                if value < best_value:  # strict: ties keep the earlier (P^k first)
                    best_name, best_perms, best_value, best_q = name, cand, value, q
            timings["candidates"] += time.perf_counter() - start
            moved = _moved(best_perms, perms)
            perms = Permutations(spec, best_perms)
            logger.info("pam: iteration %d: relaxed mass off P^k %.3g; permutation step took %s (%d units moved), "
                        "objective %.6g", k + 1, spread, best_name, sum(moved.values()), best_q)

            # ---- curve step: train the offset from the midpoint of A and P^{k+1} B
            start = time.perf_counter()
            end_state = apply_permutation(spec, perms, sb)
            curve, mids = _build_curve(model, sa, end_state, offset_flat)
            history: list[float] = []
            if curve_epochs:
                handles = _proximal_hooks(curve, nu_curve)
                try:
                    history = train_curve(curve, data, epochs=curve_epochs, lr=lr_curve * scale, momentum=momentum,
                                          seed=int(torch.randint(0, 2**62, (), generator=gen)), loss_fn=loss_fn)
                finally:
                    for h in handles:
                        h.remove()
            offset_flat = [b.detach() - m for b, m in zip(curve.bends(), mids)]
            offset = _keyed_offset(curve, fn, sa, end_state)
            timings["curve_step"] += time.perf_counter() - start
            objective.append(judge(offset, perms))
            iterations.append(PAMIteration(
                objective_after_perm=best_q, objective=objective[-1], choice=best_name, moved=moved,
                candidates=len(seen), relaxed_defect=residual, relaxed_spread=spread, curve_loss=history, timings=timings,
            ))
            logger.info("pam: iteration %d: objective %.6g after the curve step", k + 1, objective[-1])
            if bar is not None:
                bar.update(1)
                bar.set_postfix(objective=f"{objective[-1]:.4g}")
    finally:
        if bar is not None:
            bar.close()
    if curve is None:  # no outer iteration: the straight line at the initial permutation
        curve, _ = _build_curve(model, sa, apply_permutation(spec, perms, sb), None)
    return PAMResult(perms=perms, curve=curve, objective=objective, init=initial, iterations=iterations)

