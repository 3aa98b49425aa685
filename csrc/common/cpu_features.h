// Run-time choice of the widest instruction set the CPU and OS support.
#pragma once
#include <string>

namespace pyperm::cpu {

enum class Isa : int { Baseline = 0, Avx2 = 1, Avx512 = 2 };

// The environment variable that caps the ISA the kernels use ("baseline", "avx2" or
// "avx512"), read once, as numpy's NPY_DISABLE_CPU_FEATURES: for running and measuring the
// narrower kernels on a wide machine.
inline constexpr const char* kIsaCapVariable = "PYPERM_MAX_SIMD";

// The widest ISA this machine runs and this build compiled.
Isa hardware_isa();
// The cap set by kIsaCapVariable (Avx512, i.e. none, when unset).
Isa isa_cap();
// The ISA the kernels use: the narrower of hardware_isa() and isa_cap().
Isa best_isa();
// Parses "auto", "baseline", "avx2", "avx512". "auto" gives best_isa().
// Asking for more than best_isa() (the machine or the cap) falls back to best_isa().
Isa parse_isa(const std::string& name);
const char* isa_name(Isa isa);

}  // namespace pyperm::cpu

// `return <ns>::CALL;` for the variant of `isa` compiled into this build, <ns> being the
// namespace an ISA source of CMakeLists.txt's PYPERM_ISA_SOURCES defines it in (baseline,
// avx2, avx512): the one run-time dispatch of every vectorised kernel. Use it as the body
// of a function returning CALL's type, e.g. PYPERM_ISA_DISPATCH(isa, solve_dense(c, n, m)).
#if defined(PYPERM_X86)
#define PYPERM_ISA_DISPATCH(isa, CALL)                                     \
  switch (isa) {                                                          \
    case ::pyperm::cpu::Isa::Avx512: return avx512::CALL;                 \
    case ::pyperm::cpu::Isa::Avx2: return avx2::CALL;                     \
    case ::pyperm::cpu::Isa::Baseline: break;                             \
  }                                                                       \
  return baseline::CALL
#else
#define PYPERM_ISA_DISPATCH(isa, CALL) \
  (void)(isa);                         \
  return baseline::CALL
#endif
