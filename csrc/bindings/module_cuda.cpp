// The CUDA extension module: imported lazily by pyperm, only when CUDA input arrives.
#include <pybind11/pybind11.h>

#include "common/cuda_runtime_info.h"

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "pyperm's CUDA kernels (static CUDA runtime; imports without a driver).";
  m.def("device_count", &pyperm::cuda::device_count);
  m.def("runtime_version", &pyperm::cuda::runtime_version);
}
