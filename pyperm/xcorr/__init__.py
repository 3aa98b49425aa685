"""Streaming cross-correlation of paired activations (the statistics of activation matching).

- :mod:`~pyperm.xcorr.accumulator`: :class:`CrossCorrelation`, one pair of activation streams;
- :mod:`~pyperm.xcorr.collection`: :class:`CrossCorrelationSet`, every layer pair of two networks;
- :mod:`~pyperm.xcorr.distributed`: :func:`all_reduce_cross_correlation` across workers;
- :mod:`~pyperm.xcorr.samples`: :func:`conv_to_samples` and the validation of batches.

The statistics live on the host (the compiled CPU core updates them) or on a CUDA device
(the CUDA kernels do), chosen by where the first batch is (see :mod:`pyperm.xcorr._state`).
"""

from pyperm.xcorr.accumulator import CrossCorrelation
from pyperm.xcorr.collection import CrossCorrelationSet
from pyperm.xcorr.distributed import all_reduce_cross_correlation
from pyperm.xcorr.samples import conv_to_samples

__all__ = ["CrossCorrelation", "CrossCorrelationSet", "all_reduce_cross_correlation", "conv_to_samples"]
