// Host-side helpers shared by the .cu files: the current-device guard, one stream-ordered
// scratch allocation per call, and the device properties the launch heuristics need.
// Only CUDA sources include this header (it includes cuda_runtime.h).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cuda_check.h"

namespace pyperm::cuda {

// Makes `device` current for the lifetime of the guard and restores the caller's device,
// so a call on cuda:1 never leaves the caller's thread pointed at another GPU.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    PYPERM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      PYPERM_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);  // no throwing from a destructor
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Bytes of freed scratch pyperm's pool keeps for the next call instead of returning them
// to the driver at every synchronisation (the default pool's threshold is 0).
constexpr uint64_t kPoolKeepBytes = uint64_t(256) << 20;

// pyperm's own stream-ordered memory pool on `device` (created on first use, kept for the
// process): scratch freed by one call serves the next, and the process's default pool, which
// other libraries share, keeps its settings. nullptr where pools are unsupported (the
// default pool is used then).
inline cudaMemPool_t scratch_pool(int device) {
  static std::mutex mutex;
  static std::vector<cudaMemPool_t> pools;
  static std::vector<bool> tried;
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(pools.size()) <= device) {
    pools.resize(device + 1, nullptr);
    tried.resize(device + 1, false);
  }
  if (!tried[device]) {
    tried[device] = true;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
      uint64_t keep = kPoolKeepBytes;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      pools[device] = pool;
    } else {
      cudaGetLastError();  // unsupported: fall back to the default pool, leave no error behind
    }
  }
  return pools[device];
}

// Scratch memory for one call: the sizes are collected first, then a single stream-ordered
// allocation from pyperm's pool on the caller's stream serves them all (one allocation
// instead of a dozen), and the destructor frees it on the same stream, also when an
// exception unwinds. It is outside torch's caching allocator (torch's memory statistics do
// not show it), so running out says so and how to free torch's cache.
class Arena {
 public:
  explicit Arena(cudaStream_t stream) : stream_(stream) {}
  ~Arena() {
    if (base_ != nullptr) cudaFreeAsync(base_, stream_);
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Reserves `count` elements of T; returns a handle to pass to get() after allocate().
  template <typename T>
  size_t reserve(size_t count) {
    const size_t offset = total_;
    total_ += round_up(count * sizeof(T));
    offsets_.push_back(offset);
    return offsets_.size() - 1;
  }
  void allocate() {
    if (total_ == 0) return;
    int device = 0;
    PYPERM_CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool = scratch_pool(device);
    const cudaError_t err = pool != nullptr ? cudaMallocFromPoolAsync(&base_, total_, pool, stream_)
                                            : cudaMallocAsync(&base_, total_, stream_);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      base_ = nullptr;
      throw std::runtime_error("CUDA out of memory: pyperm needs " + std::to_string((total_ + (1 << 20) - 1) >> 20) +
                               " MiB of scratch on device " + std::to_string(device) +
                               "; memory torch's caching allocator holds is not available to it "
                               "(torch.cuda.empty_cache() returns that memory)");
    }
    PYPERM_CUDA_CHECK(err);
  }
  template <typename T>
  T* get(size_t handle) const {
    return reinterpret_cast<T*>(static_cast<char*>(base_) + offsets_[handle]);
  }
  size_t bytes() const { return total_; }

 private:
  static size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }
  cudaStream_t stream_;
  void* base_ = nullptr;
  size_t total_ = 0;
  std::vector<size_t> offsets_;
};

struct DeviceInfo {
  int sms = 1;                 // streaming multiprocessors
  int max_smem_optin = 48 << 10;  // dynamic + static shared memory one block may opt into
  int max_smem_per_sm = 64 << 10;
  bool cooperative = false;    // supports cudaLaunchCooperativeKernel
};

inline DeviceInfo device_info(int device) {
  DeviceInfo info;
  int v = 0;
  PYPERM_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
  info.sms = v > 0 ? v : 1;
  PYPERM_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  info.max_smem_optin = v;
  PYPERM_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  info.max_smem_per_sm = v;
  PYPERM_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrCooperativeLaunch, device));
  info.cooperative = v != 0;
  return info;
}

inline cudaStream_t as_stream(void* handle) { return static_cast<cudaStream_t>(handle); }

inline unsigned grid_for(int64_t work, int threads, int64_t cap = 65535LL * 16) {
  int64_t blocks = (work + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > cap) blocks = cap;  // kernels loop grid-stride over the rest
  return static_cast<unsigned>(blocks);
}

}  // namespace pyperm::cuda
