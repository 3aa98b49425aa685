r"""Linear mode connectivity modulo permutation in a two-layer ReLU teacher-student model.

The model of Zhan, Li and Wu, "Analyzing the Role of Permutation Invariance in Linear Mode
Connectivity" (AISTATS 2025) [1]_: a teacher :math:`f^*(x) = \sum_{k=1}^K \sigma(w_k^{*\top} x)` and a
student :math:`f(x) = \sum_{j=1}^m \sigma(w_j^\top x)`, :math:`\sigma(z) = \max(z, 0)`, output
weights fixed at one, inputs :math:`x \sim \mathcal N(0, I_d)`, and the population loss
:math:`L(W) = \mathbb E (f(x) - f^*(x))^2`, computed exactly through the arc-cosine kernel.

Public names
------------
- :func:`teacher_weights`, :func:`sample_minimum` (uniform on the manifold of minima)
- :func:`population_loss` (exact, differentiable), :func:`monte_carlo_loss`
- :func:`train_gd` (full-batch GD, many seeds on one tensor) -> :class:`GDResult`
- :func:`neuron_types`, :func:`type_matching` (Algorithm 1), :func:`lap_matching`
- :func:`interpolation_losses`, :func:`path_barrier` (Git Re-Basin, Definition 2.2)
- :func:`pq_index`, :func:`hessian`, :func:`sharpness`
- :func:`width_sweep` -> :class:`WidthSweep`, :func:`learning_rate_sweep` -> :class:`LearningRateSweep`

Everything is torch float64 and runs on the device of its inputs; randomness comes from
explicit seeds (one ``torch.Generator`` per run), never from the global random state.

What was reconstructed (the paper's formulas were partly lost in the text extraction)
-------------------------------------------------------------------------------------
- **Loss (eq. 3).** :math:`L(W) = \mathbb E_x(\sum_j \sigma(w_j^\top x) - \sum_k
  \sigma(w_k^{*\top} x))^2` with no factor 1/2 (the paper's eq. 3 as printed). The teacher of Assumption 1
  is :math:`w^*_k = e_k` in :math:`\mathbb R^d` (default :math:`d = 2K`).
- **Closed form (eqs. 7-8).** :math:`\mathbb E\,\sigma(u^\top x)\sigma(v^\top x) =
  \frac{\lVert u\rVert\lVert v\rVert}{2\pi}(\sin\theta + (\pi - \theta)\cos\theta)` (Cho and
  Saul's first-order arc-cosine kernel, divided by 2), computed as
  :math:`\tfrac12 u^\top v + \frac{\lVert u\rVert\lVert v\rVert}{2\pi}(\sin\theta - \theta\cos\theta)`
  for accuracy at parallel neurons (see :mod:`pyperm.teacher_student.loss`). A Monte Carlo
  estimate agrees within its standard error (tested).
- **Gradient and Hessian.** Closed forms (derived here; checked against finite differences in
  the tests), with :math:`\sigma'(0) = 0` at zero neurons.
- **Global minima (Lemma 2).** Every neuron is :math:`a_j w^*_{\tau(j)}` with
  :math:`a_j \ge 0`, the :math:`a_j` of each type summing to 1, every type present.
- **"Uniform" on the minima (Assumption 3, Lemma 8, B.1).** Type counts
  :math:`1 + \mathrm{Multinomial}(m - K; 1/K, \dots, 1/K)`, multiples within a type uniform on
  the simplex (normalised Exp(1) draws), types dealt to random neuron positions.
- **Barrier.** Git Re-Basin's Definition 2.2 (the loss on the segment minus the chord of the
  endpoint losses), on 11 points (the paper's step 0.1).
- **Algorithm 1 (type matching).** Types by the largest cosine with a teacher neuron; within a
  type both students' neurons sorted by norm, largest first, and paired rank by rank; zero
  neurons paired with zero neurons; leftovers paired in index order.
- **PQ index (Definition 7, Diao et al. 2023).** :math:`1 - n^{1/q - 1/p}\lVert v\rVert_p /
  \lVert v\rVert_q` with :math:`p = 1, q = 2`, of the neurons' norms by default.
- **GD (Section 5, B.1).** Full-batch GD on the exact loss from
  :math:`\mathcal N(0, \sigma^2)` entries (default :math:`\sigma = 10^{-2}`; the paper's value
  was lost), step :math:`c / m`; a run stops when its loss reaches ``tol``, its gradient norm
  ``grad_tol`` (below :math:`m = K`), or it diverges.
- **Sharpness.** The largest eigenvalue of the closed-form Hessian; its Gauss-Newton part is
  also available (it is what sits at :math:`2/\eta` past the edge of stability, while the full
  Hessian is inflated by near-zero neurons).

References
----------
.. [1] K. Zhan, P. Li and L. Wu, "Analyzing the Role of Permutation Invariance in Linear Mode
   Connectivity", AISTATS 2025.
.. [2] Z. Lin, P. Li and L. Wu, "Exploring neural network landscapes: star-shaped and geodesic
   connectivity", 2024 (the manifold of minima).
.. [3] Y. Cho and L. Saul, "Kernel methods for deep learning", NeurIPS 2009.
.. [4] S. Ainsworth, J. Hayase and S. Srinivasa, "Git Re-Basin", ICLR 2023 (Definition 2.2).
.. [5] E. Diao et al., "Pruning deep neural networks from a sparsity perspective", ICLR 2023.
"""

from pyperm.teacher_student.barrier import interpolation_losses, path_barrier
from pyperm.teacher_student.curvature import hessian, sharpness
from pyperm.teacher_student.gd import GDResult, train_gd
from pyperm.teacher_student.loss import monte_carlo_loss, population_loss
from pyperm.teacher_student.lr_sweep import LearningRateSweep, learning_rate_sweep
from pyperm.teacher_student.matching import lap_matching, neuron_types, type_matching
from pyperm.teacher_student.minima import sample_minimum, teacher_weights
from pyperm.teacher_student.sparsity import pq_index
from pyperm.teacher_student.width_sweep import WidthSweep, width_sweep

__all__ = [
    "GDResult",
    "LearningRateSweep",
    "WidthSweep",
    "hessian",
    "interpolation_losses",
    "lap_matching",
    "learning_rate_sweep",
    "monte_carlo_loss",
    "neuron_types",
    "path_barrier",
    "population_loss",
    "pq_index",
    "sample_minimum",
    "sharpness",
    "teacher_weights",
    "train_gd",
    "type_matching",
    "width_sweep",
]
