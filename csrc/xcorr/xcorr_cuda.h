// Streaming cross-correlation on the device: the twins of the CPU kernels in xcorr_cpu.h
// (read that header for the method and the references). One update of an accumulator is
//   1. batch_moments per side: shift the batch by a provisional centre K, write the shifted
//      batch, and reduce the column sums, sums of squares and ranges into float64 moments;
//   2. G = shifted_a^T shifted_b: a GEMM the caller runs (torch.matmul, cuBLAS);
//   3. merge_comoments: Chan, Golub and LeVeque's pairwise update of the float64 (or float32)
//      accumulator with G and the batch moments.
// Layouts match the CPU core: moments are 4 x dim row-major (mean, m2, min, max). Results are
// deterministic: every reduction runs in a fixed order. Declared without cuda_runtime.h.
#pragma once
#include <cstdint>

#include "common/status.h"

namespace pyperm::cuda {

// One side of one batch.
//   x         [in]  device, rows x cols, row stride ld (elements, >= cols), rows >= 1.
//   centred   [out] device, rows x cols contiguous: x - K rounded to T.
//   moments   [out] device, 4 x cols float64: mean, m2, min, max of the batch.
//   resid     [out] device, cols float64: column sums of `centred` as stored.
//   max_sumsq [out] host: the largest column sum of squares of `centred`.
// Returns XcorrError::None, NonFinite (NaN or infinity in x) or Overflow (finite x whose
// sums overflow); outputs are unspecified on error. Synchronises the stream.
template <typename T>
XcorrError xcorr_batch_moments(const T* x, int64_t rows, int64_t cols, int64_t ld, T* centred, double* moments,
                        double* resid, double* max_sumsq, int device, void* stream);

// Folds an incoming part (m samples: its moments, its co-moment G about its own means up to
// the centring residuals resid_a / resid_b) into an accumulator of n samples, in place:
//   C <- C + G - resid_a resid_b^T / m + (n m / (n + m)) delta_a delta_b^T  (C <- ... when n = 0)
// and the moments by Chan's update. resid_a and resid_b are both null (merging two
// accumulators) or both set (a fresh batch). All device pointers; dims >= 1, m >= 1.
// Returns XcorrError::None, or Overflow with nothing written when the merged moments would
// overflow the accumulator's type (the bound is checked on the host: synchronises).
template <typename TC, typename TG>
XcorrError xcorr_merge_comoments(int64_t dim_a, int64_t dim_b, int64_t n, double* moments_a, double* moments_b, TC* comoment,
                          int64_t m, const double* in_moments_a, const double* in_moments_b, const TG* in_comoment,
                          const double* resid_a, const double* resid_b, int device, void* stream);

}  // namespace pyperm::cuda
