// Outcome codes shared by the CPU and CUDA kernels. The kernels never throw
// across the language boundary for bad numbers; the bindings translate these.
#pragma once

namespace pyperm {

enum class Status : int {
  Ok = 0,
  Infeasible = 1,  // no complete assignment avoids the forbidden (infinite) entries
  Invalid = 2,     // NaN, or an infinity of the wrong sign
  NotConverged = 3 // an iterative method stopped at its limit
};

}  // namespace pyperm
