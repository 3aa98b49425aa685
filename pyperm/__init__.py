"""pyperm: fast tools for the permutation symmetry of neural networks.

The solvers (``pyperm.linear_sum_assignment`` and friends) need numpy alone;
``pyperm.nn`` (alignment, merging, barriers, curves) needs torch.
"""

from pyperm._config import show_config
from pyperm._config import version as _version
from pyperm._ext import cuda_available, cuda_built, cuda_unavailable_reason
from pyperm.bvn import birkhoff_decomposition, project_doubly_stochastic, sample_permutations, sinkhorn
from pyperm.lap import ResultFormWarning, batch_linear_sum_assignment, linear_sum_assignment
from pyperm.xcorr import (
    CrossCorrelation,
    CrossCorrelationSet,
    all_reduce_cross_correlation,
    conv_to_samples,
)

# One source of truth: the version in pyproject.toml, read from the installed metadata.
__version__ = _version()

__all__ = [
    "CrossCorrelation",
    "CrossCorrelationSet",
    "ResultFormWarning",
    "all_reduce_cross_correlation",
    "batch_linear_sum_assignment",
    "birkhoff_decomposition",
    "conv_to_samples",
    "cuda_available",
    "cuda_built",
    "cuda_unavailable_reason",
    "linear_sum_assignment",
    "project_doubly_stochastic",
    "sample_permutations",
    "show_config",
    "sinkhorn",
]
