// Outcome codes shared by the CPU and CUDA kernels. The kernels never throw across the
// language boundary for bad numbers; bindings/status.h turns these into exceptions.
#pragma once
#include <cstdint>

namespace pyperm {

enum class Status : int {
  Ok = 0,
  Infeasible = 1,  // no complete assignment avoids the forbidden (infinite) entries
  Invalid = 2,     // NaN, or an infinity of the wrong sign
  NotConverged = 3 // an iterative method stopped at its limit
};

// Why a cross-correlation job failed (its kernels return Status::Invalid, or this on the
// device, where the distinction is all there is to report).
enum class XcorrError : int32_t {
  None = 0,
  NonFinite = 1,  // the input holds NaN or +-inf
  Overflow = 2,   // finite input whose moments do not fit the floating-point type
};

}  // namespace pyperm
