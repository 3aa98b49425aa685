r"""Polygonal chains between two trained models (Garipov et al. 2018, section 3.2)."""

from __future__ import annotations

import math

from pyperm.nn.curves._base import Curve
from pyperm.nn._checks import check_t

__all__ = ["PolyChain"]


class PolyChain(Curve):
    r"""A polygonal chain of networks from A through ``num_bends`` trainable bends to B.

    The vertices :math:`\theta_0 = \theta_A, \theta_1, \dots, \theta_K, \theta_{K+1} =
    \theta_B` sit at the equispaced knots :math:`t_j = j / (K + 1)`; between two knots the
    chain is the straight segment

    .. math::

        r_\phi(t) = (1 - s)\,\theta_j + s\,\theta_{j+1}, \qquad
        s = (K + 1)\,t - j, \quad t \in [t_j, t_{j+1}],

    so one bend gives Garipov et al.'s chain :math:`r_\phi(t) = 2(t\,\theta + (1/2 - t)\,
    \theta_A)` on :math:`[0, 1/2]` and :math:`2((t - 1/2)\,\theta_B + (1 - t)\,\theta)` on
    :math:`[1/2, 1]`. The bends start on the straight line, at
    :math:`\theta_A + t_j (\theta_B - \theta_A)`; a loss at ``t`` reaches only the (at
    most two) bends of its segment.

    Parameters
    ----------
    model : torch.nn.Module
        The architecture, run unchanged through :func:`torch.func.functional_call`.
    state_a, state_b : mapping of str to torch.Tensor
        The endpoints' state dicts (same keys, shapes, dtypes and devices), copied.
    num_bends : int, default 1
        Number of bends (the chain has ``num_bends + 1`` segments).

    Raises
    ------
    TypeError, ValueError
        As :class:`BezierCurve`.

    See Also
    --------
    BezierCurve : the smooth curve with the same control points.

    References
    ----------
    .. [1] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss
       Surfaces, Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018,
       section 3.2 ("Polygonal chain").

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import PolyChain
    >>> net = torch.nn.Linear(3, 2)
    >>> a = {k: torch.zeros_like(v) for k, v in net.state_dict().items()}
    >>> b = {k: torch.ones_like(v) for k, v in net.state_dict().items()}
    >>> chain = PolyChain(net, a, b, num_bends=1)
    >>> chain.weights(0.25)
    [0.5, 0.5, 0.0]
    >>> chain.state_at(0.25)["bias"]
    tensor([0.2500, 0.2500])
    """

    def weights(self, t: float) -> list[float]:
        """Hat-function weights: at most two non-zero, those of ``t``'s segment."""
        t = check_t(t)
        segments = self.num_bends + 1
        s = t * segments
        j = min(math.floor(s), segments - 1)  # t = 1 belongs to the last segment
        f = s - j
        w = [0.0] * (segments + 1)
        w[j] = 1.0 - f
        w[j + 1] = f
        return w
