// The cross-correlation CPU loops, compiled once per instruction set (see CMakeLists.txt:
// the PYPERM_ISA_SOURCES object libraries) and chosen at run time by xcorr_cpu.cpp. They are
// memory- or conversion-bound; the compiler vectorises them for the ISA it is given.
#pragma once
#include <cstdint>

namespace pyperm::cpu {

// One tile of the moments pass: shifts by K, stores, and sums in double what was stored.
template <typename T>
struct TileArgs {
  const T* x;
  T* out;
  int64_t cols, r0, r1, c0, c1;
  const double* shift;                   // cols c0..c1
  double *sum, *sq, *mn, *mx;            // cols c0..c1 of this row block's partials
};

// rows i0..i1 of C += G + p q^T + u v^T (or C = ... when the accumulator is empty).
template <typename TC, typename TG>
struct MergeArgs {
  TC* c;
  const TG* g;
  int64_t i0, i1, dim_b;
  bool fresh;
  const double *p, *q, *u, *v;
};

// rows i0..i1 of out = diag(rs) src diag(cs) + ra ca^T, optionally clipped to [-1, 1].
template <typename T>
struct ScaleArgs {
  const T* src;
  T* out;
  int64_t i0, i1, cols;
  const double *rs, *cs, *ra, *ca;
  bool clip;
};

}  // namespace pyperm::cpu

#define PYPERM_DECLARE_XCORR_KERNELS(ISA)                                                 \
  namespace pyperm::cpu::ISA {                                                           \
  /* One tile of the moments pass: shift by K, store, and sum in double what was stored. */ \
  void tile_moments(const TileArgs<float>& a);                                           \
  void tile_moments(const TileArgs<double>& a);                                          \
  /* Rows i0..i1 of C += G + p q^T + u v^T (C = ... when the accumulator is empty). */     \
  void merge_rows(const MergeArgs<double, double>& a);                                   \
  void merge_rows(const MergeArgs<double, float>& a);                                    \
  void merge_rows(const MergeArgs<float, double>& a);                                    \
  void merge_rows(const MergeArgs<float, float>& a);                                     \
  /* Rows i0..i1 of out = diag(rs) src diag(cs) + ra ca^T, optionally clipped to [-1, 1]. */ \
  void scale_rows(const ScaleArgs<float>& a);                                            \
  void scale_rows(const ScaleArgs<double>& a);                                           \
  }

PYPERM_DECLARE_XCORR_KERNELS(baseline)
#if defined(PYPERM_X86)
PYPERM_DECLARE_XCORR_KERNELS(avx2)
PYPERM_DECLARE_XCORR_KERNELS(avx512)
#endif
