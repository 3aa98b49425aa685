"""pyperm.nn: permutation specs and the alignment methods for PyTorch models (needs torch)."""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("pyperm.nn needs PyTorch: pip install torch (CPU-only: pip install torch==2.13.0)") from exc

from pyperm.nn import models
from pyperm.nn.activation_matching import ActivationMatchingResult, activation_matching
from pyperm.nn.permute import apply_permutation
from pyperm.nn.spec import PermutationSpec
from pyperm.nn.trace import ActivationSite, TraceError, TraceResult, trace_model
from pyperm.nn.weight_matching import WeightMatchingResult, matching_objective, weight_matching

__all__ = [
    "ActivationMatchingResult",
    "ActivationSite",
    "PermutationSpec",
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
