r"""Bezier curves between two trained models (Garipov et al. 2018; Tatro et al. 2020, eq. 7)."""

from __future__ import annotations

from pyperm.nn.curves._base import Curve, binomial_weights
from pyperm.nn._checks import check_t

__all__ = ["BezierCurve"]


class BezierCurve(Curve):
    r"""A Bezier curve of networks from A to B with ``num_bends`` trainable control points.

    With :math:`K` bends :math:`\theta_1, \dots, \theta_K` between the fixed endpoints
    :math:`\theta_0 = \theta_A` and :math:`\theta_{K+1} = \theta_B`,

    .. math::

        r_\phi(t) = \sum_{j=0}^{K+1} \binom{K+1}{j}\, t^j (1 - t)^{K+1-j}\, \theta_j,
        \qquad t \in [0, 1],

    which for one bend is the quadratic curve of Tatro et al. eq. 7,
    :math:`r_\phi(t) = (1-t)^2 \theta_A + 2t(1-t)\,\theta_c + t^2 \theta_B`. The bends
    start at :math:`\theta_A + \frac{j}{K+1}(\theta_B - \theta_A)`, where the curve is the
    straight line :math:`(1 - t)\,\theta_A + t\,\theta_B` (the initialisation of Algorithm
    2); they are the curve's only parameters.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture: any module whose ``state_dict`` the states match. It is run
        unchanged through :func:`torch.func.functional_call` and never modified.
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints' state dicts (same keys, shapes, dtypes and devices), copied.
        For an aligned curve, ``state_b`` is B permuted into A's basin (eq. 5).
    num_bends : int, default 1
        Number of control points between the endpoints (the degree is ``num_bends + 1``).

    Raises
    ------
    TypeError
        ``model`` is not a module, a state is not a mapping of str to tensors, or
        ``num_bends`` is not an int.
    ValueError
        The states do not pair up with each other or with ``model.state_dict()`` (the
        message names the key), ``num_bends`` is below 1, or the model has no
        floating-point parameter.

    See Also
    --------
    PolyChain : the polygonal chain through the bends.
    train_curve, evaluate_curve : Algorithm 2, and the loss and accuracy along the curve.

    References
    ----------
    .. [1] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss
       Surfaces, Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018.
    .. [2] N. J. Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment",
       NeurIPS 2020, eq. 7 and Algorithm 2.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import BezierCurve
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> a = {k: v.clone() for k, v in net.state_dict().items()}
    >>> b = {k: torch.randn_like(v) for k, v in a.items()}
    >>> curve = BezierCurve(net, a, b)
    >>> x = torch.randn(3, 4)
    >>> torch.equal(curve(x, 0.0), net(x))
    True
    >>> sum(p.numel() for p in curve.parameters()) == sum(p.numel() for p in net.parameters())
    True
    """

    def weights(self, t: float) -> list[float]:
        r"""The Bernstein weights :math:`\binom{K+1}{j} t^j (1-t)^{K+1-j}`, ``j = 0..K+1``."""
        return binomial_weights(check_t(t), self.num_bends + 1)
