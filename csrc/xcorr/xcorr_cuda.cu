// Streaming cross-correlation kernels (see xcorr_cuda.h; the CPU twins are in xcorr_cpu.cpp).
#include "xcorr/xcorr_cuda.h"

#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_device.cuh"
#include "common/cuda_host.h"

namespace pyperm::cuda {
namespace {

constexpr int64_t kShiftRows = 32;   // rows averaged for the provisional centre (as the CPU)
constexpr int64_t kRowBlock = 256;   // rows per partial sum
constexpr int kTileRows = 8;         // threadIdx.y extent of the moments tile

// K_c = x_0c + mean_i (x_ic - x_0c) over kShiftRows rows spread evenly over the batch:
// exactly x_0c for a constant column, and well inside the batch's spread otherwise.
template <typename T>
__global__ void centre_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                              double* __restrict__ shift) {
  const int64_t p = rows < kShiftRows ? rows : kShiftRows;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x0 = static_cast<double>(x[c]);
    double s = 0.0;
    for (int64_t i = 1; i < p; ++i) s += static_cast<double>(x[(i * rows / p) * ld + c]) - x0;
    shift[c] = x0 + s / static_cast<double>(p);
  }
}

// Block (32, kTileRows) per (32 columns, kRowBlock rows): shift, store, and reduce. The
// kTileRows partials of a column are combined in order, so the result is reproducible.
template <typename T>
__global__ void __launch_bounds__(32 * kTileRows) tile_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                                              int64_t ld, const double* __restrict__ shift,
                                                              T* __restrict__ centred, double* __restrict__ psum,
                                                              double* __restrict__ psq, double* __restrict__ pmn,
                                                              double* __restrict__ pmx) {
  __shared__ double s_sum[kTileRows][32], s_sq[kTileRows][32], s_mn[kTileRows][32], s_mx[kTileRows][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col_blocks = (cols + 31) / 32, row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  for (int64_t tile = blockIdx.x; tile < col_blocks * row_blocks; tile += gridDim.x) {
    const int64_t rb = tile / col_blocks, c = (tile % col_blocks) * 32 + tx;
    const int64_t r0 = rb * kRowBlock, r1 = r0 + kRowBlock < rows ? r0 + kRowBlock : rows;
    double sum = 0.0, sq = 0.0, mn = dev::inf<double>(), mx = -dev::inf<double>();
    if (c < cols) {
      const double k = shift[c];
      for (int64_t r = r0 + ty; r < r1; r += kTileRows) {
        const double v = static_cast<double>(x[r * ld + c]);
        const T d = static_cast<T>(v - k);
        centred[r * cols + c] = d;
        const double e = static_cast<double>(d);
        sum += e;
        sq += e * e;
        mn = v < mn ? v : mn;  // NaN slips past both; the sums catch it
        mx = v > mx ? v : mx;
      }
    }
    s_sum[ty][tx] = sum;
    s_sq[ty][tx] = sq;
    s_mn[ty][tx] = mn;
    s_mx[ty][tx] = mx;
    __syncthreads();
    if (ty == 0 && c < cols) {
      for (int k = 1; k < kTileRows; ++k) {
        sum += s_sum[k][tx];
        sq += s_sq[k][tx];
        mn = s_mn[k][tx] < mn ? s_mn[k][tx] : mn;
        mx = s_mx[k][tx] > mx ? s_mx[k][tx] : mx;
      }
      const int64_t at = rb * cols + c;
      psum[at] = sum;
      psq[at] = sq;
      pmn[at] = mn;
      pmx[at] = mx;
    }
    __syncthreads();  // the tile's shared arrays are refilled by the next iteration
  }
}

// Per column: the partials over row blocks in order, then the moments (as finish_moments).
template <typename T>
__global__ void finish_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                              const double* __restrict__ shift, const double* __restrict__ psum,
                              const double* __restrict__ psq, const double* __restrict__ pmn,
                              const double* __restrict__ pmx, double* __restrict__ moments,
                              double* __restrict__ resid, unsigned long long* __restrict__ work, int side) {
  const unsigned long long nonfinite_bit = side == 0 ? kXcorrNonFiniteA : kXcorrNonFiniteB;
  const unsigned long long overflow_bit = side == 0 ? kXcorrOverflowA : kXcorrOverflowB;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const double nrows = static_cast<double>(rows);
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double sum = 0.0, sq = 0.0, mn = dev::inf<double>(), mx = -dev::inf<double>();
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t at = rb * cols + c;
      sum += psum[at];
      sq += psq[at];
      mn = pmn[at] < mn ? pmn[at] : mn;
      mx = pmx[at] > mx ? pmx[at] : mx;
    }
    if (!isfinite(mn) || !isfinite(mx)) {
      atomicOr(&work[0], nonfinite_bit);
      continue;
    }
    if (!isfinite(sum) || !isfinite(sq)) {
      bool nonfinite = false;  // NaN hides from min/max; finite values can still overflow the sums
      for (int64_t r = 0; r < rows && !nonfinite; ++r) nonfinite = !isfinite(static_cast<double>(x[r * ld + c]));
      atomicOr(&work[0], nonfinite ? nonfinite_bit : overflow_bit);
      continue;
    }
    // sq >= 0, so its bits order like the value: an integer atomicMax finds the maximum.
    atomicMax(&work[1 + side], static_cast<unsigned long long>(__double_as_longlong(sq)));
    resid[c] = sum;
    moments[0 * cols + c] = shift[c] + sum / nrows;
    const double m2 = sq - sum * sum / nrows;  // the corrected two-pass formula
    moments[1 * cols + c] = m2 > 0.0 ? m2 : 0.0;
    moments[2 * cols + c] = mn;
    moments[3 * cols + c] = mx;
  }
}

// Chan's update of one side's moments into `merged`, and the coefficients of the two rank-1
// terms of the co-moment update: C += G + p q^T + u v^T with p = -resid_a / m, q = resid_b,
// u = w delta_a, v = delta_b (the row side carries the weight). Also the largest merged and
// incoming m2 (as bits; +inf for anything non-finite) for the host's overflow check.
__global__ void merge_side_kernel(int64_t dim, double n, double m, const double* __restrict__ mom,
                                  const double* __restrict__ in, const double* __restrict__ resid, bool row_side,
                                  double* __restrict__ merged, double* __restrict__ coef_resid,
                                  double* __restrict__ coef_delta, unsigned long long* __restrict__ max_bits) {
  const double total = n + m, w = n * m / total, frac = m / total;
  const unsigned long long inf_bits = static_cast<unsigned long long>(__double_as_longlong(dev::inf<double>()));
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < dim;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double in_mean = in[c], in_m2 = in[dim + c];
    if (n == 0.0) {
      merged[c] = in_mean;
      merged[dim + c] = in_m2;
      merged[2 * dim + c] = in[2 * dim + c];
      merged[3 * dim + c] = in[3 * dim + c];
      coef_delta[c] = 0.0;
    } else {
      const double delta = in_mean - mom[c];
      merged[c] = mom[c] + frac * delta;
      merged[dim + c] = mom[dim + c] + in_m2 + w * delta * delta;
      merged[2 * dim + c] = fmin(mom[2 * dim + c], in[2 * dim + c]);
      merged[3 * dim + c] = fmax(mom[3 * dim + c], in[3 * dim + c]);
      coef_delta[c] = row_side ? w * delta : delta;
    }
    coef_resid[c] = resid == nullptr ? 0.0 : (row_side ? -resid[c] / m : resid[c]);
    const double m2 = merged[dim + c];
    atomicMax(&max_bits[0],
              isfinite(m2) ? static_cast<unsigned long long>(__double_as_longlong(m2 > 0.0 ? m2 : 0.0)) : inf_bits);
    atomicMax(&max_bits[1], isfinite(in_m2) ? static_cast<unsigned long long>(
                                                  __double_as_longlong(in_m2 > 0.0 ? in_m2 : 0.0))
                                            : inf_bits);
  }
}

// Decides, on one thread, whether the merge may write: the batch's own failure bits (a fresh
// batch), its product's bound, and the merged moments' bound. |C_ij| <= sqrt(m2_a_i m2_b_j)
// (Cauchy-Schwarz), for every partial sum of the GEMM too; a margin of 4 leaves room for the
// rank-1 terms and rounding (the CPU core's rule). The first failure is kept in status.
__global__ void decide_kernel(const unsigned long long* __restrict__ work, long long* __restrict__ status,
                              bool fresh, double product_limit, double merge_limit, long long update,
                              long long count) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double w[kXcorrWorkWords];
  for (int k = 0; k < kXcorrWorkWords; ++k) w[k] = __longlong_as_double(static_cast<long long>(work[k]));
  long long code = fresh ? static_cast<long long>(work[0]) : 0;
  // Bounds written so that NaN (an overflowed m2 is stored as +inf bits) fails them.
  if (code == 0 && fresh && !(sqrt(w[1]) * sqrt(w[2]) <= product_limit)) code |= kXcorrProductOverflow;
  if (code == 0 && !(sqrt(w[4]) * sqrt(w[6]) <= product_limit && sqrt(w[3]) * sqrt(w[5]) <= merge_limit))
    code |= kXcorrMergeOverflow;
  if (code != 0 && status[0] == 0) {
    status[0] = code;
    status[1] = update;
    status[2] = count;
  }
}

template <typename TC, typename TG>
__global__ void merge_matrix_kernel(TC* __restrict__ c, const TG* __restrict__ g, int64_t dim_a, int64_t dim_b,
                                    bool fresh, const double* __restrict__ p, const double* __restrict__ q,
                                    const double* __restrict__ u, const double* __restrict__ v,
                                    const long long* __restrict__ status) {
  if (status[0] != 0) return;  // this update or an earlier one failed: the accumulator stays as it was
  const int64_t total = dim_a * dim_b;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / dim_b, j = k % dim_b;
    const double add = static_cast<double>(g[k]) + p[i] * q[j] + u[i] * v[j];
    c[k] = static_cast<TC>(fresh ? add : static_cast<double>(c[k]) + add);
  }
}

// The merged moments into the accumulator's, unless an update failed.
__global__ void copy_moments_kernel(double* __restrict__ dst, const double* __restrict__ src, int64_t count,
                                    const long long* __restrict__ status) {
  if (status[0] != 0) return;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < count;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[k] = src[k];
}

template <typename T>
constexpr double real_max() {
  return sizeof(T) == 4 ? static_cast<double>(FLT_MAX) : DBL_MAX;
}

}  // namespace

template <typename T>
void xcorr_batch_moments(const T* x, int64_t rows, int64_t cols, int64_t ld, T* centred, double* moments,
                         double* resid, unsigned long long* work, int side, int device, void* stream_handle) {
  if (rows <= 0 || cols <= 0) return;
  DeviceGuard guard(device);
  cudaStream_t stream = as_stream(stream_handle);
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock, col_blocks = (cols + 31) / 32;
  Arena arena(stream);
  const size_t h_shift = arena.reserve<double>(cols);
  const size_t h_part = arena.reserve<double>(4 * row_blocks * cols);
  arena.allocate();
  double* shift = arena.get<double>(h_shift);
  double* part = arena.get<double>(h_part);
  centre_kernel<T><<<grid_for(cols, 256, 4096), 256, 0, stream>>>(x, rows, cols, ld, shift);
  PYPERM_CUDA_CHECK_LAUNCH("the moments centre kernel");
  const int64_t pc = row_blocks * cols;
  tile_kernel<T><<<grid_for(row_blocks * col_blocks, 1, 65535), dim3(32, kTileRows), 0, stream>>>(
      x, rows, cols, ld, shift, centred, part, part + pc, part + 2 * pc, part + 3 * pc);
  PYPERM_CUDA_CHECK_LAUNCH("the moments tile kernel");
  finish_kernel<T><<<grid_for(cols, 256, 4096), 256, 0, stream>>>(
      x, rows, cols, ld, shift, part, part + pc, part + 2 * pc, part + 3 * pc, moments, resid, work, side);
  PYPERM_CUDA_CHECK_LAUNCH("the moments finish kernel");
}

template <typename TC, typename TG>
void xcorr_merge_comoments(int64_t dim_a, int64_t dim_b, int64_t n, double* moments_a, double* moments_b,
                           TC* comoment, int64_t m, const double* in_moments_a, const double* in_moments_b,
                           const TG* in_comoment, const double* resid_a, const double* resid_b,
                           unsigned long long* work, long long* status, int64_t update, int device,
                           void* stream_handle) {
  if (m <= 0 || dim_a <= 0 || dim_b <= 0) return;
  if ((resid_a == nullptr) != (resid_b == nullptr)) resid_a = resid_b = nullptr;
  const bool fresh = resid_a != nullptr;
  DeviceGuard guard(device);
  cudaStream_t stream = as_stream(stream_handle);
  Arena arena(stream);
  const size_t h_new_a = arena.reserve<double>(4 * dim_a), h_new_b = arena.reserve<double>(4 * dim_b);
  const size_t h_p = arena.reserve<double>(dim_a), h_u = arena.reserve<double>(dim_a);
  const size_t h_q = arena.reserve<double>(dim_b), h_v = arena.reserve<double>(dim_b);
  arena.allocate();
  // A merge of two accumulators has no batch words: start them at zero. A fresh batch's words
  // [0..2] come from batch_moments; the merge maxes [3..6] are zeroed either way.
  const int first = fresh ? 3 : 0;
  PYPERM_CUDA_CHECK(cudaMemsetAsync(work + first, 0, (kXcorrWorkWords - first) * sizeof(unsigned long long), stream));
  const double dn = static_cast<double>(n), dm = static_cast<double>(m);
  merge_side_kernel<<<grid_for(dim_a, 256, 4096), 256, 0, stream>>>(dim_a, dn, dm, moments_a, in_moments_a, resid_a,
                                                                    true, arena.get<double>(h_new_a),
                                                                    arena.get<double>(h_p), arena.get<double>(h_u),
                                                                    work + 3);
  PYPERM_CUDA_CHECK_LAUNCH("the merge kernel");
  merge_side_kernel<<<grid_for(dim_b, 256, 4096), 256, 0, stream>>>(dim_b, dn, dm, moments_b, in_moments_b, resid_b,
                                                                    false, arena.get<double>(h_new_b),
                                                                    arena.get<double>(h_q), arena.get<double>(h_v),
                                                                    work + 5);
  PYPERM_CUDA_CHECK_LAUNCH("the merge kernel");
  decide_kernel<<<1, 1, 0, stream>>>(work, status, fresh, real_max<TG>() / 4, real_max<TC>() / 4,
                                     static_cast<long long>(update), static_cast<long long>(n));
  PYPERM_CUDA_CHECK_LAUNCH("the merge decision kernel");
  merge_matrix_kernel<TC, TG><<<grid_for(dim_a * dim_b, 256, 8192), 256, 0, stream>>>(
      comoment, in_comoment, dim_a, dim_b, n == 0, arena.get<double>(h_p), arena.get<double>(h_q),
      arena.get<double>(h_u), arena.get<double>(h_v), status);
  PYPERM_CUDA_CHECK_LAUNCH("the merge kernel");
  copy_moments_kernel<<<grid_for(4 * dim_a, 256, 4096), 256, 0, stream>>>(moments_a, arena.get<double>(h_new_a),
                                                                          4 * dim_a, status);
  PYPERM_CUDA_CHECK_LAUNCH("the merge copy kernel");
  copy_moments_kernel<<<grid_for(4 * dim_b, 256, 4096), 256, 0, stream>>>(moments_b, arena.get<double>(h_new_b),
                                                                          4 * dim_b, status);
  PYPERM_CUDA_CHECK_LAUNCH("the merge copy kernel");
}

template void xcorr_batch_moments<float>(const float*, int64_t, int64_t, int64_t, float*, double*, double*,
                                         unsigned long long*, int, int, void*);
template void xcorr_batch_moments<double>(const double*, int64_t, int64_t, int64_t, double*, double*, double*,
                                          unsigned long long*, int, int, void*);
#define PYPERM_XCORR_MERGE(TC, TG)                                                                             \
  template void xcorr_merge_comoments<TC, TG>(int64_t, int64_t, int64_t, double*, double*, TC*, int64_t,       \
                                              const double*, const double*, const TG*, const double*,          \
                                              const double*, unsigned long long*, long long*, int64_t, int,    \
                                              void*);
PYPERM_XCORR_MERGE(double, double)
PYPERM_XCORR_MERGE(double, float)
PYPERM_XCORR_MERGE(float, double)
PYPERM_XCORR_MERGE(float, float)
#undef PYPERM_XCORR_MERGE

}  // namespace pyperm::cuda
