"""Weight matching and MergeMany with the pair's tensors split over ranks (implemented beside the one-process matcher,
in :mod:`pyperm.nn.align.over_ranks`, whose pieces it drives)."""

from pyperm.nn.align.over_ranks import DistributedMatchingResult, merge_many, weight_matching

__all__ = ["DistributedMatchingResult", "merge_many", "weight_matching"]
