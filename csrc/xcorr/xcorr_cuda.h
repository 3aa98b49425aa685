// Streaming cross-correlation on the device: the twins of the CPU kernels in xcorr_cpu.h
// (read that header for the method and the references). One update of an accumulator is
//   1. batch_moments per side: shift the batch by a provisional centre K, write the shifted
//      batch, and reduce the column sums, sums of squares and ranges into float64 moments;
//   2. G = shifted_a^T shifted_b: a GEMM the caller runs (torch.matmul, cuBLAS);
//   3. merge_comoments: Chan, Golub and LeVeque's pairwise update of the float64 (or float32)
//      accumulator with G and the batch moments.
// None of it synchronises the stream: the checks are decided on the device (see work/status).
// Layouts match the CPU core: moments are 4 x dim row-major (mean, m2, min, max). Results are
// deterministic: every reduction runs in a fixed order. Declared without cuda_runtime.h.
#pragma once
#include <cstdint>


namespace pyperm::cuda {

// An update never waits for the device. Its checks run on the device and land in two small
// device arrays of the accumulator, which the host reads only when it reads the statistics:
//   work   (kXcorrWorkWords x uint64, per update): [0] the batch's failure bits, [1] and [2] side a's
//          and side b's largest column sum of squares (float64 bits), [3..6] the merge's largest m2s.
//   status (kXcorrStatusWords x int64, sticky): [0] the first failing update's XcorrFailure bits (0
//          while healthy), [1] its update number, [2] the count of samples before it. Once set, every
//          later merge is skipped, so the accumulator keeps the samples before that update.
constexpr int kXcorrWorkWords = 7;
constexpr int kXcorrStatusWords = 3;

// Failure bits of status[0].
enum XcorrFailure : int64_t {
  kXcorrNonFiniteA = 1,       // side a of the batch holds NaN or +-inf
  kXcorrNonFiniteB = 2,
  kXcorrOverflowA = 4,        // side a's finite values overflow their moments
  kXcorrOverflowB = 8,
  kXcorrProductOverflow = 16, // the batch product would overflow its dtype
  kXcorrMergeOverflow = 32,   // the merged moments would overflow the accumulator's dtype
};

// One side (0: a, 1: b) of one batch; never synchronises.
//   x         [in]  device, rows x cols, row stride ld (elements, >= cols), rows >= 1.
//   centred   [out] device, rows x cols contiguous: x - K rounded to T.
//   moments   [out] device, 4 x cols float64: mean, m2, min, max of the batch.
//   resid     [out] device, cols float64: column sums of `centred` as stored.
//   work      [in,out] device, the update's work words (zeroed by the caller before side 0):
//             the side's failure bits are ORed into work[0], its largest column sum of squares
//             of `centred` into work[1 + side].
template <typename T>
void xcorr_batch_moments(const T* x, int64_t rows, int64_t cols, int64_t ld, T* centred, double* moments,
                         double* resid, unsigned long long* work, int side, int device, void* stream);

// Folds an incoming part (m samples: its moments, its co-moment G about its own means up to
// the centring residuals resid_a / resid_b) into an accumulator of n samples, in place:
//   C <- C + G - resid_a resid_b^T / m + (n m / (n + m)) delta_a delta_b^T  (C <- ... when n = 0)
// and the moments by Chan's update. resid_a and resid_b are both null (merging two
// accumulators: work is then zeroed here) or both set (a fresh batch, whose work words
// batch_moments filled). All device pointers; dims >= 1, m >= 1. Never synchronises: a kernel
// decides on the device whether the batch failed (its bits in work[0]), its product or the
// merged moments overflow, and records the first failure in `status` with `update` and n;
// the merge then writes nothing, now or for any later update, until the host clears status.
template <typename TC, typename TG>
void xcorr_merge_comoments(int64_t dim_a, int64_t dim_b, int64_t n, double* moments_a, double* moments_b,
                           TC* comoment, int64_t m, const double* in_moments_a, const double* in_moments_b,
                           const TG* in_comoment, const double* resid_a, const double* resid_b,
                           unsigned long long* work, long long* status, int64_t update, int device, void* stream);

}  // namespace pyperm::cuda
