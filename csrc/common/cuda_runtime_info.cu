#include <cuda_runtime.h>

#include "common/cuda_runtime_info.h"

namespace pyperm::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string device_error() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaSuccess) return "";
  cudaGetLastError();  // clear the sticky error, as device_count does
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

std::string runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

std::string driver_version() {
  int v = 0;
  // Needs no device, only libcuda; 0 (or an error) when there is no driver.
  if (cudaDriverGetVersion(&v) != cudaSuccess || v == 0) {
    cudaGetLastError();
    return "";
  }
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

int pointer_device(uintptr_t ptr) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(ptr)) != cudaSuccess) {
    cudaGetLastError();  // not a pointer the runtime knows: report, do not leave an error behind
    return -1;
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) return attr.device;
  return -1;
}

}  // namespace pyperm::cuda
