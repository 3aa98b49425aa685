// The Jonker-Volgenant solver for small dense problems (tens of rows: a detector's
// matching, a tracker's frame), compiled once per instruction set (see CMakeLists.txt).
// Callers go through lap_cpu.h, which validates, transposes, negates and dispatches.
//
// The solver of lap_kernels.h keeps row caches, a heap and thread bands that pay off from
// hundreds of rows; below that their set-up costs more than the solve. This one runs the
// same three phases on plain arrays, all inside one caller-provided scratch buffer, so a
// call allocates nothing.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace pyperm::cpu {

// Bytes of scratch solve_small needs for an n x m problem with entries of `entry_bytes`
// bytes (aligned for 8-byte entries).
inline size_t small_scratch_bytes(int64_t n, int64_t m, size_t entry_bytes) {
  const size_t values = 3 * static_cast<size_t>(m);                         // v, d, the search's duals
  const size_t indices = 2 * static_cast<size_t>(m) + 2 * static_cast<size_t>(n);  // y, pred; x, free rows
  return values * (entry_bytes < 8 ? 8 : entry_bytes) + indices * sizeof(int32_t) + 64;
}

}  // namespace pyperm::cpu

#define PYPERM_DECLARE_LAP_SMALL(ISA)                                                          \
  namespace pyperm::cpu::ISA {                                                                 \
  /* Minimum-cost assignment of every row of a row-major n x m matrix (n <= m, m < 2^31). */   \
  /* NaN or -inf give Invalid; +inf forbids a pair. col_of_row: output, n entries. scratch: */ \
  /* small_scratch_bytes(n, m, sizeof(T)) bytes, 8-byte aligned. Returns Ok, Infeasible or */   \
  /* Invalid. */                                                                               \
  Status solve_small(const double* cost, int64_t n, int64_t m, int64_t* col_of_row, void* scratch); \
  Status solve_small(const float* cost, int64_t n, int64_t m, int64_t* col_of_row, void* scratch);  \
  }

PYPERM_DECLARE_LAP_SMALL(baseline)
#if defined(PYPERM_X86)
PYPERM_DECLARE_LAP_SMALL(avx2)
PYPERM_DECLARE_LAP_SMALL(avx512)
#endif
