"""Alignment methods: find the permutations that bring model B into model A's basin.

Each returns a result whose ``perms`` is a :class:`~pyperm.nn.Permutations` (one
permutation per group of the :class:`~pyperm.nn.PermutationSpec`; ``merge_many``: one per
model), takes its start as ``init=`` and counts what it ran in ``iterations``:
weight matching (Git Re-Basin Algorithm 1), activation matching (Git Re-Basin eq. 1,
Tatro et al. Algorithm 1), straight-through-estimator matching (Git Re-Basin
Algorithm 2), Sinkhorn re-basin (Pena et al. 2023), merging many models (Git Re-Basin
Algorithm 3, and C2M3's cycle-consistent Frank-Wolfe in a universe, Crisostomi et al. 2024)
and PAM, the proximal alternating minimization over permutations and a curve (Tatro et al.
appendix E).

References
----------
S. K. Ainsworth, J. Hayase, S. Srinivasa, "Git Re-Basin: Merging Models modulo Permutation
Symmetries", ICLR 2023. N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai,
"Optimizing Mode Connectivity via Neuron Alignment", NeurIPS 2020.
"""

from pyperm.nn.align.activation import ActivationMatchingResult, activation_matching
from pyperm.nn.align.c2m3 import C2M3Result, c2m3_merge, cycle_consistency_error, merge_objective, pairwise_matchings
from pyperm.nn.align.merge import MergeResult, merge_many
from pyperm.nn.align.proximal import PAMIteration, PAMResult, pam
from pyperm.nn.align.sinkhorn import SinkhornMatchingResult, sinkhorn_matching
from pyperm.nn.align.ste import STEMatchingResult, ste_matching
from pyperm.nn.align.weight import (
    WeightMatchingResult,
    matching_objective,
    weight_matching,
)
from pyperm.nn.align.zipit import ZippedModel, ZipResult, zipit

__all__ = [
    "ActivationMatchingResult",
    "C2M3Result",
    "MergeResult",
    "PAMIteration",
    "PAMResult",
    "STEMatchingResult",
    "SinkhornMatchingResult",
    "WeightMatchingResult",
    "ZipResult",
    "ZippedModel",
    "activation_matching",
    "c2m3_merge",
    "cycle_consistency_error",
    "matching_objective",
    "merge_many",
    "merge_objective",
    "pairwise_matchings",
    "pam",
    "sinkhorn_matching",
    "ste_matching",
    "weight_matching",
    "zipit",
]
