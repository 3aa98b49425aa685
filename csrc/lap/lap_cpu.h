// Linear sum assignment on the CPU: scipy.optimize.linear_sum_assignment semantics.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "common/status.h"

namespace pyperm::cpu {

// Solves min (or max) sum_k cost[row_ind[k], col_ind[k]] over matchings of size
// min(n_rows, n_cols).
//   cost      [in]  row-major, contiguous n_rows x n_cols matrix. +inf (-inf when
//                   maximizing) forbids a pair; NaN or the other infinity is Invalid.
//   maximize  [in]  maximise instead of minimise.
//   row_ind   [out] min(n_rows, n_cols) row indices, increasing.
//   col_ind   [out] the matching column of each row_ind entry.
//   isa       [in]  kernel variant (Isa from best_isa() unless testing).
//   threads   [in]  threads for the passes over a large matrix (<= 0: all cores).
// Returns Ok, Infeasible or Invalid; the outputs are written only on Ok.
template <typename T>
Status linear_sum_assignment(const T* cost, int64_t n_rows, int64_t n_cols, bool maximize,
                             int64_t* row_ind, int64_t* col_ind, Isa isa, int threads = 0);

// Square minimisation warm-started from column duals (for sequences of similar problems,
// e.g. the terms of a Birkhoff-von Neumann decomposition).
//   cost        [in]     row-major n x n; +inf forbids a pair, NaN or -inf is Invalid.
//   v           [in,out] n column duals: any values on entry (the previous solve's are a good
//                        start), the final duals on return.
//   col_of_row  [out]    n entries.
// One thread: a warm start scans rows as it needs them, with no pass over the whole matrix.
// Returns Ok, Infeasible or Invalid.
template <typename T>
Status solve_square_warm(const T* cost, int64_t n, T* v, int64_t* col_of_row, Isa isa);

// The work of solving one n_rows x n_cols problem, in thread_pool.h's units, for the cost model
// of batches: its entries, plus a fixed part for the solve's setup that dominates tiny problems.
// (Entries fit the kernels' times better than entries x min(n_rows, n_cols): uniform costs
// take a few units per entry from 20 x 20 to 512 x 512, the cubic count varies 25-fold.)
inline int64_t assignment_work(int64_t n_rows, int64_t n_cols) { return n_rows * n_cols + 512; }

// Solves `batch` independent problems stored one after another (batch x n_rows x n_cols),
// on up to `threads` threads (<= 0: all hardware threads). Outputs are batch x min(n_rows, n_cols).
// On failure returns the status of the lowest failing problem and its index in *failed.
template <typename T>
Status batch_linear_sum_assignment(const T* costs, int64_t batch, int64_t n_rows, int64_t n_cols,
                                   bool maximize, int64_t* row_ind, int64_t* col_ind, int threads,
                                   Isa isa, int64_t* failed);

}  // namespace pyperm::cpu
