// Host-side helpers shared by the .cu files: the current-device guard, one stream-ordered
// scratch allocation per call, and the device properties the launch heuristics need.
// Only CUDA sources include this header (it includes cuda_runtime.h).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
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

// Scratch memory for one call: the sizes are collected first, then a single
// cudaMallocAsync on the caller's stream serves them all (one allocation instead of a
// dozen), and the destructor frees it on the same stream, also when an exception unwinds.
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
    if (total_ > 0) PYPERM_CUDA_CHECK(cudaMallocAsync(&base_, total_, stream_));
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
