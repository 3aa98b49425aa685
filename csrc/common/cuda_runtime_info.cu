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

std::string runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

}  // namespace pyperm::cuda
