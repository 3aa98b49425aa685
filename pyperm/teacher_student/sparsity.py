r"""The PQ index, the sparsity measure Zhan et al. (2025) use for GD solutions (Diao et al., 2023)."""

from __future__ import annotations

import torch

from pyperm._checks import check_positive_real
from pyperm.teacher_student._checks import DTYPE

__all__ = ["pq_index"]


def pq_index(W: torch.Tensor, p: float = 1, q: float = 2, *, rows: bool = True) -> torch.Tensor:
    r"""The PQ index of a vector, or of the neuron norms of a weight matrix.

    .. math::

        I_{p,q}(v) = 1 - n^{\frac1q - \frac1p} \frac{\lVert v\rVert_p}{\lVert v\rVert_q},
        \qquad 0 < p < q, \quad v \in \mathbb R^n \setminus \{0\}.

    It is 0 for a vector with all entries of one magnitude and
    :math:`1 - n^{1/q - 1/p}` (its maximum) for a vector with a single non-zero entry:
    the larger, the sparser. For a student weight matrix Zhan et al. offer two readings,
    both available: the PQ index of the row norms :math:`(\lVert w_1\rVert, \dots,
    \lVert w_m\rVert)` (``rows=True``, the default: at a global minimum every neuron has
    one non-zero entry, so this counts the neurons that carry weight) or of the flattened
    matrix (``rows=False``). The paper uses :math:`p = 1, q = 2`.

    Parameters
    ----------
    W : (n,) or (..., m, d) torch.Tensor
        A vector, or student weights (a batch in the leading dimensions).
    p, q : float, default 1 and 2
        The norms compared, ``0 < p < q`` (``q`` may be ``inf``).
    rows : bool, default True
        For a matrix: use the neuron norms (True) or all entries (False). Ignored for a vector.

    Returns
    -------
    torch.Tensor
        float64, shape ``()`` for a vector, ``W.shape[:-2]`` for a matrix.

    Raises
    ------
    TypeError
        ``W`` is not a floating-point tensor, or ``p``/``q`` are not numbers.
    ValueError
        ``p``/``q`` out of range, ``W`` empty, not finite, or all zero.

    References
    ----------
    E. Diao et al., "Pruning deep neural networks from a sparsity perspective", ICLR 2023;
    Zhan, Li and Wu (2025), Definition 7 and Section 5.
    """
    p = check_positive_real(p, "p")
    q = float("inf") if q == float("inf") else check_positive_real(q, "q")
    if not p < q:
        raise ValueError(f"pq_index needs p < q, got p={p}, q={q}")
    v = _as_vectors(W, rows)
    q_norm = torch.linalg.vector_norm(v, ord=q, dim=-1)
    if bool((q_norm == 0).any()):
        raise ValueError("W is all zero, where the PQ index is undefined")
    n = v.shape[-1]
    exponent = (0.0 if q == float("inf") else 1.0 / q) - 1.0 / p
    return 1.0 - n**exponent * torch.linalg.vector_norm(v, ord=p, dim=-1) / q_norm


def _as_vectors(W: object, rows: bool) -> torch.Tensor:
    """The vectors the index is taken of: ``(n,)`` as given, or ``(..., m)`` norms / ``(..., m*d)`` entries."""
    if not isinstance(W, torch.Tensor):
        raise TypeError(f"W must be a torch.Tensor, got {type(W).__name__}")
    if not W.is_floating_point():
        raise TypeError(f"W must have a real floating dtype, got {W.dtype}")
    if W.dim() == 0 or W.numel() == 0:
        raise ValueError(f"W must be a non-empty vector or (..., m, d) matrix, got shape {tuple(W.shape)}")
    if not bool(torch.isfinite(W).all()):
        raise ValueError("W contains NaN or infinite entries")
    W = W.detach().to(DTYPE)
    if W.dim() == 1:
        return W
    if rows:
        return torch.linalg.vector_norm(W, dim=-1)
    return W.reshape(*W.shape[:-2], -1)
