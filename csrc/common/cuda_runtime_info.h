// What the CUDA runtime sees. Declared without cuda_runtime.h so host code can include it.
#pragma once
#include <cstdint>
#include <string>

namespace pyperm::cuda {
// Number of usable CUDA devices; 0 when there is no driver or no GPU (never throws).
int device_count();
// Why cudaGetDeviceCount failed ("cudaErrorInsufficientDriver: ..."), or "" when it succeeded.
std::string device_error();
// Runtime version as "major.minor".
std::string runtime_version();
// The newest CUDA version the installed driver supports, "major.minor"; "" without a driver.
std::string driver_version();
// The device that owns a device (or managed) pointer; -1 for host or unknown memory.
int pointer_device(uintptr_t ptr);
}  // namespace pyperm::cuda
