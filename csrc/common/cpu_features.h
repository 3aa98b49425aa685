// Run-time choice of the widest instruction set the CPU and OS support.
#pragma once
#include <string>

namespace pyperm::cpu {

enum class Isa : int { Baseline = 0, Avx2 = 1, Avx512 = 2 };

// The widest ISA this machine runs and this build compiled.
Isa best_isa();
// Parses "auto", "baseline", "avx2", "avx512". "auto" gives best_isa().
// Asking for more than the machine supports falls back to best_isa().
Isa parse_isa(const std::string& name);
const char* isa_name(Isa isa);

}  // namespace pyperm::cpu
