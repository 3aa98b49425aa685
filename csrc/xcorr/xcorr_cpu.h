// Streaming cross-correlation of paired activations on the CPU.
//
// The accumulator of two activation streams A (dim_a channels) and B (dim_b channels) is
//   n                     samples seen,
//   mean_a, mean_b        channel means,
//   m2_a, m2_b            centred sums of squares  sum_s (x_s - mean)^2,
//   min/max               channel ranges (an exactly constant channel has min == max),
//   C (dim_a x dim_b)     the centred co-moment    sum_s (a_s - mean_a)(b_s - mean_b)^T.
// Pearson correlation (Tatro et al. 2020, eq. 3) is C_ij / sqrt(m2_a_i m2_b_j), and the
// uncentred Z_A Z_B^T of Git Re-Basin (Ainsworth et al. 2023, eq. 1) is C + n mean_a mean_b^T.
//
// One update is three steps; the middle one is a plain GEMM that the caller does with
// whatever BLAS it has (this core links none):
//   1. batch_moments: per side, one pass that writes the batch shifted by a provisional
//      centre K (the mean of a few rows spread over it) and sums the shifted values, their
//      squares and the channel ranges, checking finiteness on the way;
//   2. G = shifted_a^T shifted_b (caller, in the input precision);
//   3. merge_comoments: folds G into C with Chan, Golub and LeVeque's pairwise update
//        C <- C + G - r_a r_b^T / m + (n m / (n + m)) delta_a delta_b^T,
//      where r = the column sums of the shifted batch as actually stored (its rounding
//      included), so that G - r_a r_b^T / m is the co-moment about the exact batch mean,
//      and delta = batch mean - running mean. This touches the dim_a x dim_b accumulator
//      once per update.
// Merging two accumulators (data-parallel workers) is step 3 with G = the other C, r = 0.
//
// K within the batch's own spread keeps the shifted product free of cancellation (a shift
// far from the mean is what makes the textbook one-pass formula unstable); an exactly
// constant channel is shifted by its value, so its shifted values, sums and m2 are exactly
// zero and its correlation can be reported as 0 rather than rounding noise.
//
// References: T. F. Chan, G. H. Golub, R. J. LeVeque, "Algorithms for computing the sample
// variance: analysis and recommendations", The American Statistician 37(3), 1983 (the
// pairwise update); its bivariate form in P. Pebay, "Formulas for robust, one-pass parallel
// computation of covariances and arbitrary-order statistical moments", Sandia report
// SAND2008-6212, 2008.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "common/status.h"

namespace pyperm::cpu {

enum class Real : int { F32 = 0, F64 = 1 };

// Rows of the 4 x dim moment block that describes one side.
enum MomentRow : int64_t { kMean = 0, kM2 = 1, kMin = 2, kMax = 3 };

// One side (A or B) of one batch.
struct MomentsJob {
  const void* x = nullptr;   // [in]  rows x cols, row-major contiguous (one sample per row)
  Real dtype = Real::F64;    // [in]  element type of x and centred
  int64_t rows = 0;          // [in]  samples (>= 1)
  int64_t cols = 0;          // [in]  channels (>= 1)
  void* centred = nullptr;   // [out] rows x cols: x minus the provisional centre, rounded to dtype
  double* moments = nullptr; // [out] 4 x cols: mean, m2, min, max of the batch
  double* resid = nullptr;   // [out] cols: column sums of `centred` (feeds merge_comoments)
  double max_sumsq = 0.0;    // [out] largest column sum of squares of `centred`: with the other
                             //       side's, it bounds every entry of the product (Cauchy-Schwarz)
  XcorrError error = XcorrError::None;  // [out]
};

// Runs every job, on up to `threads` threads (<= 0: all hardware threads), with the loops
// compiled for `isa`. The result is the same for any thread count. Returns Invalid when a
// job's input is non-finite or overflows (its index in *failed, its reason in its `error`).
Status batch_moments(MomentsJob* jobs, int64_t n_jobs, int threads, Isa isa, int64_t* failed);

// Folds `in` (m samples) into an accumulator (n samples), in place.
struct MergeJob {
  int64_t dim_a = 0, dim_b = 0;
  // accumulator [in/out]
  int64_t n = 0;                      // samples so far (the caller adds m on success)
  double* moments_a = nullptr;        // 4 x dim_a
  double* moments_b = nullptr;        // 4 x dim_b
  void* comoment = nullptr;           // dim_a x dim_b row-major
  Real comoment_dtype = Real::F64;
  // incoming [in]
  int64_t m = 0;                      // samples in the incoming part (>= 1)
  const double* in_moments_a = nullptr;
  const double* in_moments_b = nullptr;
  const void* in_comoment = nullptr;  // dim_a x dim_b row-major, about the incoming means up to resid
  Real in_dtype = Real::F64;
  const double* resid_a = nullptr;    // dim_a or null: centring residual sums of a fresh batch
  const double* resid_b = nullptr;    // dim_b or null (both or neither)
  XcorrError error = XcorrError::None;  // [out]
};

// Runs every job, on up to `threads` threads. All jobs are checked before any accumulator is
// written: when the merged moments would overflow the accumulator type (or `in` already
// overflowed its own), returns Invalid with that job's index in *failed and nothing changed.
// The result is the same for any thread count.
Status merge_comoments(MergeJob* jobs, int64_t n_jobs, int threads, Isa isa, int64_t* failed);

// out_ij = row_scale_i * src_ij * col_scale_j + row_add_i * col_add_j, clipped to [-1, 1]
// when `clip`. src is the accumulator (dtype), out has the same dtype; both rows x cols.
// row_add/col_add may be null (no outer-product term).
void scale_comoment(const void* src, void* out, Real dtype, int64_t rows, int64_t cols,
                    const double* row_scale, const double* col_scale, const double* row_add,
                    const double* col_add, bool clip, int threads, Isa isa);

}  // namespace pyperm::cpu
