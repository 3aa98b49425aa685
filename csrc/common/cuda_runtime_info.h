// What the CUDA runtime sees. Declared without cuda_runtime.h so host code can include it.
#pragma once
#include <string>

namespace pyperm::cuda {
// Number of usable CUDA devices; 0 when there is no driver or no GPU (never throws).
int device_count();
// Runtime version as "major.minor".
std::string runtime_version();
}  // namespace pyperm::cuda
