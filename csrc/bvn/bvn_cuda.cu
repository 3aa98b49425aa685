// Birkhoff-von Neumann decomposition kernels (see bvn_cuda.h).
#include "bvn/bvn_cuda.h"

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_device.cuh"
#include "common/cuda_host.h"

namespace pyperm::cuda {
namespace {

template <typename T>
__global__ void support_cost_kernel(const T* __restrict__ r, int64_t total, T* __restrict__ cost) {
  const T infinity = dev::inf<T>();
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const T x = r[k];
    cost[k] = x > T(0) ? -x : infinity;
  }
}

template <typename T>
struct Eps;
template <>
struct Eps<float> {
  static constexpr double value = FLT_EPSILON;
};
template <>
struct Eps<double> {
  static constexpr double value = DBL_EPSILON;
};

// One block: the minimum over the matched entries and the first row that has it, then the
// subtraction with bvn_cpu.cpp's zeroing rule (barriers apart).
template <typename T>
__global__ void __launch_bounds__(1024) subtract_term_kernel(T* __restrict__ r, const T* __restrict__ d, double d_max,
                                                             int64_t n, const int64_t* __restrict__ perm,
                                                             T* __restrict__ alpha) {
  __shared__ T part[32];
  __shared__ unsigned long long first_row;
  const T infinity = dev::inf<T>();
  T mn = infinity;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const T x = r[i * n + perm[i]];
    mn = x < mn ? x : mn;
  }
  mn = dev::warp_min(mn);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) part[warp] = mn;
  if (threadIdx.x == 0) first_row = static_cast<unsigned long long>(n);
  __syncthreads();
  T a = lane < nw ? part[lane] : infinity;
  a = dev::warp_min(a);  // every warp computes the same block minimum
  if (threadIdx.x == 0) *alpha = a;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    if (r[i * n + perm[i]] == a) atomicMin(&first_row, static_cast<unsigned long long>(i));
  __syncthreads();
  const int64_t argmin = static_cast<int64_t>(first_row);
  // alpha may carry the rounding of the entry it came from, so an entry is rounding noise when
  // it is small next to both its own original value and that one (as on the CPU).
  const double zero_rel = 32.0 * Eps<T>::value;
  const double noise_ref = static_cast<double>(d[argmin * n + perm[argmin]]);
  const double maybe_noise = zero_rel * (d_max > noise_ref ? d_max : noise_ref);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t k = i * n + perm[i];
    const T now = r[k] - a;
    const double own = static_cast<double>(d[k]);
    const bool noise = static_cast<double>(now) <= maybe_noise &&
                       static_cast<double>(now) <= zero_rel * (own > noise_ref ? own : noise_ref);
    r[k] = (i == argmin || now <= T(0) || noise) ? T(0) : now;
  }
}

// Residual mass in two fixed-shape stages (partials per block, then one block in order),
// so the sum is the same on every run.
constexpr int kMassBlocks = 256;

template <typename T>
__global__ void __launch_bounds__(256) mass_partial_kernel(const T* __restrict__ r, int64_t total,
                                                           double* __restrict__ partial) {
  __shared__ double part[8];
  double s = 0.0;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)
    s += static_cast<double>(r[k]);
  s = dev::warp_sum(s);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int w = 0; w < 8; ++w) t += part[w];
    partial[blockIdx.x] = t;
  }
}

__global__ void mass_final_kernel(const double* __restrict__ partial, int count, int64_t n, double* __restrict__ mass) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double t = 0.0;
    for (int k = 0; k < count; ++k) t += partial[k];
    *mass = t / static_cast<double>(n);
  }
}

}  // namespace

template <typename T>
void bvn_support_cost(const T* residual, int64_t n, T* cost, int device, void* stream_handle) {
  if (n <= 0) return;
  DeviceGuard guard(device);
  cudaStream_t stream = as_stream(stream_handle);
  support_cost_kernel<T><<<grid_for(n * n, 256, 4096), 256, 0, stream>>>(residual, n * n, cost);
  PYPERM_CUDA_CHECK_LAUNCH("the BvN cost kernel");
}

template <typename T>
void bvn_subtract_term(T* residual, const T* original, double d_max, int64_t n, const int64_t* perm, T* alpha,
                       double* mass, int device, void* stream_handle) {
  *alpha = T(0);
  *mass = 0.0;
  if (n <= 0) return;
  DeviceGuard guard(device);
  cudaStream_t stream = as_stream(stream_handle);
  Arena arena(stream);
  const size_t h_alpha = arena.reserve<T>(1);
  const size_t h_partial = arena.reserve<double>(kMassBlocks);
  const size_t h_mass = arena.reserve<double>(1);
  arena.allocate();
  subtract_term_kernel<T><<<1, 1024, 0, stream>>>(residual, original, d_max, n, perm, arena.get<T>(h_alpha));
  PYPERM_CUDA_CHECK_LAUNCH("the BvN term kernel");
  mass_partial_kernel<T><<<kMassBlocks, 256, 0, stream>>>(residual, n * n, arena.get<double>(h_partial));
  PYPERM_CUDA_CHECK_LAUNCH("the BvN mass kernel");
  mass_final_kernel<<<1, 32, 0, stream>>>(arena.get<double>(h_partial), kMassBlocks, n, arena.get<double>(h_mass));
  PYPERM_CUDA_CHECK_LAUNCH("the BvN mass kernel");
  PYPERM_CUDA_CHECK(cudaMemcpyAsync(alpha, arena.get<T>(h_alpha), sizeof(T), cudaMemcpyDeviceToHost, stream));
  PYPERM_CUDA_CHECK(cudaMemcpyAsync(mass, arena.get<double>(h_mass), sizeof(double), cudaMemcpyDeviceToHost, stream));
  PYPERM_CUDA_CHECK(cudaStreamSynchronize(stream));
}

template void bvn_support_cost<float>(const float*, int64_t, float*, int, void*);
template void bvn_support_cost<double>(const double*, int64_t, double*, int, void*);
template void bvn_subtract_term<float>(float*, const float*, double, int64_t, const int64_t*, float*, double*, int,
                                       void*);
template void bvn_subtract_term<double>(double*, const double*, double, int64_t, const int64_t*, double*, double*, int,
                                        void*);

}  // namespace pyperm::cuda
