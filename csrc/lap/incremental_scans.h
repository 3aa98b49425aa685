// The O(n) scans of IncrementalAssignment (incremental_assignment.h), compiled once per
// instruction set (see CMakeLists.txt: the PYPERM_ISA_SOURCES object libraries) and chosen at
// run time from the solver's Isa.
#pragma once
#include <cstdint>

namespace pyperm::cpu {

// The two smallest r[k] - v[k] (ties: lowest k first) and where they are.
template <typename T>
struct TwoMin {
  T u1, u2;
  int64_t j1, j2;
};

}  // namespace pyperm::cpu

#define PYPERM_DECLARE_INCREMENTAL_SCANS(ISA)                                                           \
  namespace pyperm::cpu::ISA {                                                                         \
  /* One Dijkstra step from row r reached at offset h: d[k] = min(d[k], r[k] - v[k] - h), pred[k] = i */ \
  /* where it improved; the smallest d, preferring a free column (free[k] all ones), and where. */       \
  void relax(const double* r, const double* v, double* d, int64_t* pred, const int64_t* free, int64_t i, \
             double h, int64_t n, double* best, int64_t* best_j);                                        \
  void relax(const float* r, const float* v, float* d, int32_t* pred, const int32_t* free, int32_t i,    \
             float h, int64_t n, float* best, int64_t* best_j);                                          \
  /* min_k r[k] - v[k]. */                                                                             \
  double min_reduced(const double* r, const double* v, int64_t n);                                     \
  float min_reduced(const float* r, const float* v, int64_t n);                                        \
  /* The two smallest r[k] - v[k] (ties: lowest k first) and where they are. */                        \
  TwoMin<double> two_min(const double* r, const double* v, int64_t n);                                 \
  TwoMin<float> two_min(const float* r, const float* v, int64_t n);                                    \
  }

PYPERM_DECLARE_INCREMENTAL_SCANS(baseline)
#if defined(PYPERM_X86)
PYPERM_DECLARE_INCREMENTAL_SCANS(avx2)
PYPERM_DECLARE_INCREMENTAL_SCANS(avx512)
#endif
