#include "common/cpu_features.h"

#include <cstdlib>
#include <stdexcept>

namespace pyperm::cpu {

Isa hardware_isa() {
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

Isa isa_cap() {
  // Read once, at the first solve (the Python layer reads it at import and refuses any
  // value but these three, so an unknown one here means no cap).
  static const Isa cap = [] {
    const char* value = std::getenv(kIsaCapVariable);
    const std::string name = value == nullptr ? "" : value;
    if (name == "baseline") return Isa::Baseline;
    if (name == "avx2") return Isa::Avx2;
    return Isa::Avx512;
  }();
  return cap;
}

Isa best_isa() {
  static const Isa chosen = static_cast<int>(isa_cap()) < static_cast<int>(hardware_isa()) ? isa_cap() : hardware_isa();
  return chosen;
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
