"""pyperm.nn: permutation specs and the alignment methods for PyTorch models (needs torch)."""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("pyperm.nn needs PyTorch: pip install torch (CPU-only: pip install torch==2.13.0)") from exc

from pyperm.nn import models
from pyperm.nn.align import (
    ActivationMatchingResult,
    MergeResult,
    STEMatchingResult,
    WeightMatchingResult,
    activation_matching,
    matching_objective,
    merge_many,
    ste_matching,
    weight_matching,
)
from pyperm.nn.eval import BarrierResult, barrier, repair, reset_bn_stats
from pyperm.nn.permutations import Permutations, apply_permutation
from pyperm.nn.spec import PermutationSpec
from pyperm.nn.state import average, interpolate
from pyperm.nn.trace import ActivationSite, TraceError, TraceResult, TraceWarning, register_trace_rule, trace_model

__all__ = [
    "ActivationMatchingResult",
    "ActivationSite",
    "BarrierResult",
    "MergeResult",
    "PermutationSpec",
    "Permutations",
    "STEMatchingResult",
    "TraceError",
    "TraceResult",
    "TraceWarning",
    "WeightMatchingResult",
    "activation_matching",
    "apply_permutation",
    "average",
    "barrier",
    "interpolate",
    "matching_objective",
    "merge_many",
    "models",
    "register_trace_rule",
    "repair",
    "reset_bn_stats",
    "ste_matching",
    "trace_model",
    "weight_matching",
]
