// The vector width of the instruction set an ISA source is being compiled for (one of
// CMakeLists.txt's PYPERM_ISA_SOURCES, built once per ISA with -DPYPERM_ISA=<namespace>).
#pragma once

#include <cstdint>

#ifndef PYPERM_ISA
#error "compile this file with -DPYPERM_ISA=<namespace>"
#endif

namespace pyperm::cpu::PYPERM_ISA {

// Bytes of one SIMD register: GCC vector extensions of this size compile to single
// instructions of the ISA.
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX2__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

// Lane-matched vector types: values of T, and integers of T's width (indices, masks).
template <typename T> struct Lanes;
template <> struct Lanes<double> {
  typedef double Vec __attribute__((vector_size(kVecBytes)));
  typedef int64_t IVec __attribute__((vector_size(kVecBytes)));
  typedef int64_t Index;
};
template <> struct Lanes<float> {
  typedef float Vec __attribute__((vector_size(kVecBytes)));
  typedef int32_t IVec __attribute__((vector_size(kVecBytes)));
  typedef int32_t Index;
};

}  // namespace pyperm::cpu::PYPERM_ISA
