r"""Correlation signatures: how well the units of two models correspond, layer by layer (Tatro et al. Figure 1)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from pyperm._plotting import agg_figure, save_figure
from pyperm.nn._checks import check_module, check_spec
from pyperm.nn.permutations import apply_permutation
from pyperm.nn.spec import PermutationSpec

__all__ = ["CorrelationSignature", "correlation_signature"]


@dataclass
class CorrelationSignature:
    """Mean correlation of corresponding units per permutation group, before and after alignment.

    Attributes
    ----------
    groups : tuple of str
        The permutation groups (layers), in the spec's order.
    before : (g,) numpy.ndarray
        Mean over units ``i`` of the correlation of unit ``i`` of A with unit ``i`` of B.
    after : (g,) numpy.ndarray
        The same with B's units permuted (by the matching, or by the ``perms`` given).
    """

    groups: tuple[str, ...]
    before: np.ndarray
    after: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values, ready for ``json.dump``."""
        return {"groups": list(self.groups), "before": self.before.tolist(), "after": self.after.tolist()}

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """The signature before and after alignment against the layer, as a PNG."""
        fig = agg_figure(max(5.0, 0.5 * len(self.groups) + 2), 3.8)
        ax = fig.subplots()
        layers = np.arange(1, len(self.groups) + 1)
        ax.plot(layers, self.before, marker="o", label="before alignment")
        ax.plot(layers, self.after, marker="o", label="after alignment")
        ax.set_xticks(layers)
        ax.set_xticklabels(self.groups, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("mean correlation of matched units")
        ax.set_ylim(min(0.0, float(np.min(self.before))) - 0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend()
        if title:
            ax.set_title(title)
        fig.tight_layout()
        path = Path(path)
        save_figure(fig, path)
        return path


def correlation_signature(
    model_a: nn.Module,
    model_b: nn.Module,
    spec: PermutationSpec | None,
    data: Iterable[Any],
    *,
    perms: Mapping[str, Any] | None = None,
    max_batches: int | None = None,
    pre_activation: bool = False,
) -> CorrelationSignature:
    r"""The correlation signature of two models, before and after alignment (Tatro et al. 2020, Figure 1).

    For every permutation group :math:`l` (a layer's units), with :math:`\rho_{ij}` the
    Pearson correlation over ``data`` of unit ``i`` of A and unit ``j`` of B (eq. 3, post-
    activation by default),

    .. math::

        \text{before}_l = \frac{1}{K_l} \sum_i \rho_{i\,i}, \qquad
        \text{after}_l = \frac{1}{K_l} \sum_i \rho_{i\,\pi_l(i)},

    where :math:`\pi` is the matching of :func:`~pyperm.nn.activation_matching` (Tatro et
    al.'s Algorithm 1), or the permutations ``perms`` given (e.g. from weight matching).

    Parameters
    ----------
    model_a, model_b : torch.nn.Module
        Two models of one architecture (e.g. an endpoint and a curve's midpoint loaded
        into a copy of the model); not modified.
    spec : PermutationSpec or None
        The groups; None: the traced spec (then ``perms`` must use its group names).
    data : iterable of batches
        Inputs, as for activation matching (read twice when ``perms`` is given: a
        one-shot iterator is first copied into a list).
    perms : Permutations or mapping of str to permutation, optional
        Permutations of B's units to measure instead of the matching's.
    max_batches : int, optional
        Use at most this many batches.
    pre_activation : bool, default False
        Correlate the units before the nonlinearity.

    Returns
    -------
    CorrelationSignature
        ``groups``, ``before``, ``after``; ``plot(path)``.

    Raises
    ------
    TypeError, ValueError
        As :func:`~pyperm.nn.activation_matching`; ``perms`` not one permutation per group.

    References
    ----------
    .. [1] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing
       Mode Connectivity via Neuron Alignment", NeurIPS 2020, eq. 3 and Figure 1.

    Examples
    --------
    >>> import torch
    >>> from pyperm.nn.curves import correlation_signature
    >>> _ = torch.manual_seed(0)
    >>> a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> b = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> sig = correlation_signature(a, b, None, [torch.randn(64, 4)])
    >>> len(sig.groups), bool(sig.after[0] >= sig.before[0])
    (1, True)
    """
    # Imported here: pyperm.nn.align imports the curves (PAM trains one), so a module-level
    # import would be circular.
    from pyperm.nn.align import activation_matching

    check_module(model_a, "model_a")
    check_module(model_b, "model_b")
    if spec is not None:
        check_spec(spec)
    if perms is not None and not isinstance(perms, Mapping):
        raise TypeError(f"perms must be a Permutations or a mapping of group names to permutations, "
                        f"got {type(perms).__name__}")
    if perms is not None and isinstance(data, Iterator):
        data = list(data)  # read twice below
    matched = activation_matching(model_a, model_b, spec, data, max_batches=max_batches,
                                  pre_activation=pre_activation)
    groups = tuple(matched.spec.groups)
    before = np.array([matched.identity_similarity[g] for g in groups])
    if perms is None:
        after = np.array([matched.similarity[g] for g in groups])
    else:
        permuted = copy.deepcopy(model_b)
        permuted.load_state_dict(apply_permutation(matched.spec, perms, model_b.state_dict()))
        again = activation_matching(model_a, permuted, matched.spec, data, max_batches=max_batches,
                                    pre_activation=pre_activation)
        after = np.array([again.identity_similarity[g] for g in groups])
    return CorrelationSignature(groups=groups, before=before, after=after)
