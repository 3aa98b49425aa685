#include "common/cpu_features.h"

#include <stdexcept>

namespace pyperm::cpu {

Isa best_isa() {
#if defined(PYPERM_X86) && (defined(__GNUC__) || defined(__clang__))
  // libgcc's checks include the OS's XSAVE support for the wide registers.
  static const Isa detected = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
      return Isa::Avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
    return Isa::Baseline;
  }();
  return detected;
#else
  return Isa::Baseline;
#endif
}

Isa parse_isa(const std::string& name) {
  Isa wanted;
  if (name == "auto") return best_isa();
  if (name == "baseline") wanted = Isa::Baseline;
  else if (name == "avx2") wanted = Isa::Avx2;
  else if (name == "avx512") wanted = Isa::Avx512;
  else throw std::invalid_argument("isa must be 'auto', 'baseline', 'avx2' or 'avx512', got '" + name + "'");
  Isa best = best_isa();
  return static_cast<int>(wanted) <= static_cast<int>(best) ? wanted : best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace pyperm::cpu
