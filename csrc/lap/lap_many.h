// Many independent assignment problems of different shapes in one call (ragged batches, the
// padded stacks of object detectors), optionally with a cost limit (the thresholds of
// trackers). Built on the dense solver of lap_cpu.h.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "common/status.h"

namespace pyperm::cpu {

// One problem: an n_rows x n_cols matrix whose row i starts at data + i * row_stride
// (row_stride >= n_cols; columns are contiguous). Never written.
template <typename T>
struct MatrixView {
  const T* data;
  int64_t n_rows, n_cols, row_stride;
};

// The threshold of lap's lapjv: every row and every column left unmatched costs limit / 2.
//   has_limit  false: a full matching of min(n_rows, n_cols) pairs (scipy's semantics).
//   limit      a real number or +inf (pyperm.linear_sum_assignment asks for >= 0; lap allows
//              negative limits, which leave every pair unmatched unless it costs less).
//              Minimising, the solution minimises the sum of the matched costs plus
//              limit / 2 per unmatched row and column, so a pair is worth matching only
//              below the limit. Maximising mirrors it (minimising the negated values with
//              the same limit): the sum of the matched values minus limit / 2 per unmatched
//              row and column is maximised, so a pair is worth matching only above -limit.
//              A finite limit is compared in double whatever the costs' type, as lap
//              (which solves in float64) compares it. +inf asks for a
//              matching of maximum cardinality among the allowed pairs, best among those:
//              rows stay unmatched only where forbidden pairs force it.
struct CostLimit {
  bool has_limit = false;
  double limit = 0.0;
};

// Solves problems[0..count) on up to `threads` threads (<= 0: all cores), one problem per
// thread at a time.
//   maximize  [in]  maximise instead of minimise (-inf then forbids a pair).
//   offsets   [in]  count entries: problem b writes its pairs from row_ind + offsets[b];
//                   the caller reserves min(n_rows, n_cols) entries there.
//   row_ind   [out] the matched rows of each problem, increasing,
//   col_ind   [out] and their columns.
//   matched   [out] count entries: the number of pairs problem b wrote (min(n_rows, n_cols)
//                   without a limit).
//   failed    [out] on failure, the index of the lowest failing problem.
// Returns Ok, or the status of the lowest failing problem: Invalid (NaN, the wrong
// infinity) or Infeasible (no full matching avoids the forbidden pairs; only without a
// limit, since a limit lets rows stay unmatched).
template <typename T>
Status solve_many(const MatrixView<T>* problems, int64_t count, bool maximize, CostLimit limit,
                  const int64_t* offsets, int64_t* row_ind, int64_t* col_ind, int64_t* matched, int threads,
                  Isa isa, int64_t* failed);

}  // namespace pyperm::cpu
