// The Jonker-Volgenant kernel, compiled once per instruction set (see CMakeLists.txt).
// Callers go through lap_cpu.h, which validates, transposes and dispatches.
#pragma once
#include <cstdint>

#include "common/status.h"

#define PYPERM_DECLARE_LAP_KERNELS(ISA)                                                        \
  namespace pyperm::cpu::ISA {                                                                 \
  /* Minimum-cost assignment of every row of a row-major n x m matrix (n <= m). NaN or -inf */ \
  /* give Invalid; +inf forbids a pair. col_of_row: output, n entries. threads: for the */      \
  /* passes over large matrices (<= 0: all cores). Returns Ok, Infeasible or Invalid. */         \
  Status solve_dense(const double* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads); \
  Status solve_dense(const float* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads);  \
  /* The same problem given as its m x n transpose (a tall matrix, read in place; n < m). */   \
  Status solve_dense_transposed(const double* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads); \
  Status solve_dense_transposed(const float* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads);  \
  /* Square n x n, warm-started from the column duals v (m entries), updated in place. One */ \
  /* thread: a warm start scans rows as it needs them, with no pass over the whole matrix. */    \
  Status solve_square_warm(const double* cost, int64_t n, double* v, int64_t* col_of_row);     \
  Status solve_square_warm(const float* cost, int64_t n, float* v, int64_t* col_of_row);       \
  }

PYPERM_DECLARE_LAP_KERNELS(baseline)
#if defined(PYPERM_X86)
PYPERM_DECLARE_LAP_KERNELS(avx2)
PYPERM_DECLARE_LAP_KERNELS(avx512)
#endif
