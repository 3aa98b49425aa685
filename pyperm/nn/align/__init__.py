"""Alignment methods: find the permutations that bring model B into model A's basin.

Each returns one permutation per group of a :class:`~pyperm.nn.PermutationSpec`:
weight matching (Git Re-Basin Algorithm 1), activation matching (Git Re-Basin eq. 1,
Tatro et al. Algorithm 1), straight-through-estimator matching (Git Re-Basin
Algorithm 2), merging many models (Git Re-Basin Algorithm 3) and PAM, the proximal
alternating minimization over permutations and a curve (Tatro et al. appendix E).
"""

from pyperm.nn.align.activation import ActivationMatchingResult, activation_matching
from pyperm.nn.align.merge import MergeResult, merge_many
from pyperm.nn.align.proximal import PAMIteration, PAMResult, pam
from pyperm.nn.align.ste import STEMatchingResult, ste_matching
from pyperm.nn.align.weight import (
    WeightMatchingResult,
    matching_objective,
    weight_matching,
)

__all__ = [
    "ActivationMatchingResult",
    "MergeResult",
    "PAMIteration",
    "PAMResult",
    "STEMatchingResult",
    "WeightMatchingResult",
    "activation_matching",
    "matching_objective",
    "merge_many",
    "pam",
    "ste_matching",
    "weight_matching",
]
