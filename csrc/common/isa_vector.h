// The vector width of the instruction set an ISA source is being compiled for (one of
// CMakeLists.txt's PYPERM_ISA_SOURCES, built once per ISA with -DPYPERM_ISA=<namespace>).
#pragma once

#include <cstdint>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

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

// The comparisons lane_mask makes. NotGreater is !(a > b): true where a lane is NaN.
enum class Cmp { Less, NotGreater, Equal };

// Bit k set where lane k of a and b compares true: one compare-to-mask instruction (AVX-512),
// or a compare and a movemask; the scans use it to find which lanes hit without a store.
template <Cmp C, typename V> inline uint64_t lane_mask(const V& a, const V& b) {
  constexpr int lanes = int(sizeof(V) / sizeof(a[0]));
  static_assert(sizeof(V) == kVecBytes, "one register");
#if defined(__AVX512F__)
  constexpr int pred = C == Cmp::Less ? _CMP_LT_OQ : C == Cmp::NotGreater ? _CMP_NGT_UQ : _CMP_EQ_OQ;
  if constexpr (lanes == 8) return _mm512_cmp_pd_mask(reinterpret_cast<__m512d>(a), reinterpret_cast<__m512d>(b), pred);
  else return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), pred);
#elif defined(__SSE2__)
  const auto hit = [&] {
    if constexpr (C == Cmp::Less) return a < b;
    else if constexpr (C == Cmp::NotGreater) return ~(a > b);
    else return a == b;
  }();
#if defined(__AVX2__)
  if constexpr (lanes == 4) return uint64_t(_mm256_movemask_pd(reinterpret_cast<__m256d>(hit)));
  else return uint64_t(_mm256_movemask_ps(reinterpret_cast<__m256>(hit)));
#else
  if constexpr (lanes == 2) return uint64_t(_mm_movemask_pd(reinterpret_cast<__m128d>(hit)));
  else return uint64_t(_mm_movemask_ps(reinterpret_cast<__m128>(hit)));
#endif
#else
  uint64_t bits = 0;
  for (int k = 0; k < lanes; ++k) {
    const bool hit = C == Cmp::Less ? a[k] < b[k] : C == Cmp::NotGreater ? !(a[k] > b[k]) : a[k] == b[k];
    bits |= uint64_t(hit) << k;
  }
  return bits;
#endif
}

}  // namespace pyperm::cpu::PYPERM_ISA
