"""pyperm.nn: permutation specs and the alignment methods for PyTorch models (needs torch)."""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("pyperm.nn needs PyTorch: pip install torch (CPU-only: pip install torch==2.13.0)") from exc

from pyperm.nn import models
from pyperm.nn.align import (
    ActivationMatchingResult,
    MergeResult,
    PAMResult,
    SinkhornMatchingResult,
    STEMatchingResult,
    WeightMatchingResult,
    activation_matching,
    matching_objective,
    merge_many,
    pam,
    sinkhorn_matching,
    ste_matching,
    weight_matching,
)
from pyperm.nn.curves import (
    BezierCurve,
    ConnectResult,
    CorrelationSignature,
    CurveResult,
    CurveTrainer,
    PlaneResult,
    PolyChain,
    connect,
    correlation_signature,
    evaluate_curve,
    garipov_schedule,
    load_curve,
    load_garipov_curve,
    loss_plane,
    save_curve,
    train_curve,
)
from pyperm.nn.eval import (
    BarrierResult,
    PathResult,
    barrier,
    pgd_attack,
    plot_paths,
    repair,
    reset_bn_stats,
    robust_accuracy,
    summary_table,
)
from pyperm.nn.permutations import Permutations, apply_permutation
from pyperm.nn.spec import PermutationSpec
from pyperm.nn.state import average, interpolate
from pyperm.nn.trace import ActivationSite, TraceError, TraceResult, TraceWarning, register_trace_rule, trace_model

__all__ = [
    "ActivationMatchingResult",
    "ActivationSite",
    "BarrierResult",
    "BezierCurve",
    "ConnectResult",
    "CorrelationSignature",
    "CurveResult",
    "CurveTrainer",
    "MergeResult",
    "PAMResult",
    "PathResult",
    "PermutationSpec",
    "Permutations",
    "PlaneResult",
    "PolyChain",
    "STEMatchingResult",
    "SinkhornMatchingResult",
    "TraceError",
    "TraceResult",
    "TraceWarning",
    "WeightMatchingResult",
    "activation_matching",
    "apply_permutation",
    "average",
    "barrier",
    "connect",
    "correlation_signature",
    "evaluate_curve",
    "garipov_schedule",
    "interpolate",
    "load_curve",
    "load_garipov_curve",
    "loss_plane",
    "matching_objective",
    "merge_many",
    "models",
    "pam",
    "pgd_attack",
    "plot_paths",
    "register_trace_rule",
    "repair",
    "reset_bn_stats",
    "robust_accuracy",
    "save_curve",
    "sinkhorn_matching",
    "ste_matching",
    "summary_table",
    "trace_model",
    "train_curve",
    "weight_matching",
]
