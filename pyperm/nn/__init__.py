"""pyperm.nn: permutation specs and the alignment methods for PyTorch models (needs torch)."""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("pyperm.nn needs PyTorch: pip install torch (CPU-only: pip install torch==2.13.0)") from exc

from pyperm.nn import models
from pyperm.nn.align import (
    ActivationMatchingResult,
    WeightMatchingResult,
    activation_matching,
    matching_objective,
    weight_matching,
)
from pyperm.nn.permutations import Permutations, apply_permutation
from pyperm.nn.spec import PermutationSpec
from pyperm.nn.trace import ActivationSite, TraceError, TraceResult, trace_model

__all__ = [
    "ActivationMatchingResult",
    "ActivationSite",
    "PermutationSpec",
    "Permutations",
    "TraceError",
    "TraceResult",
    "WeightMatchingResult",
    "activation_matching",
    "apply_permutation",
    "matching_objective",
    "models",
    "trace_model",
    "weight_matching",
]
