#include "lap/lap_many.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "common/thread_pool.h"
#include "lap/lap_cpu.h"

namespace pyperm::cpu {
namespace {

// Buffers one worker thread reuses from problem to problem.
template <typename T>
struct Scratch {
  std::vector<T> cost;         // a block's copy, or the matrix with dummy columns
  std::vector<double> wide;    // the +inf limit's fallback, always in double
  std::vector<int64_t> rows, cols, row_of;  // the extended problem's answer, reordered
};

// Solves the problem with the short side s = min(n, m) as rows, copied (transposed when
// n > m) into `buf` as sign * scale * cost, the layout the kernel reads fastest.
//
// With `dummy`, this is lap's cost limit without its (n + m) x (n + m) matrix: s dummy
// columns that all cost *dummy follow the l = max(n, m) real ones, and a row sent to one is
// unmatched. That row's partner column, and every other column of the long side left over,
// then go unmatched too; the leftover count is fixed by the short side's, so the
// objectives of the two formulations differ by a constant and their optima coincide.
template <typename T, typename W>
Status solve_short_side_first(const MatrixView<T>& p, W sign, W scale, const W* dummy, Isa isa, std::vector<W>& buf,
                              Scratch<T>& s, int64_t* row_ind, int64_t* col_ind, int64_t* matched) {
  const bool transposed = p.n_rows > p.n_cols;
  const int64_t n = transposed ? p.n_cols : p.n_rows, l = transposed ? p.n_rows : p.n_cols;
  const int64_t w = dummy ? l + n : l;
  const W factor = sign * scale;
  buf.resize(static_cast<size_t>(n * w));
  for (int64_t i = 0; i < n; ++i) {
    W* out = buf.data() + i * w;
    if (transposed) {
      for (int64_t j = 0; j < l; ++j) out[j] = factor * static_cast<W>(p.data[j * p.row_stride + i]);
    } else {
      const T* in = p.data + i * p.row_stride;
      for (int64_t j = 0; j < l; ++j) out[j] = factor * static_cast<W>(in[j]);
    }
    if (dummy) std::fill(out + l, out + w, *dummy);
  }
  s.rows.resize(static_cast<size_t>(n));
  s.cols.resize(static_cast<size_t>(n));
  // With dummy columns every row can be placed, so the only failure is an invalid entry.
  const Status st = linear_sum_assignment(buf.data(), n, w, false, s.rows.data(), s.cols.data(), isa, 1);
  if (st != Status::Ok) return st;
  int64_t k = 0;
  if (!transposed) {
    for (int64_t i = 0; i < n; ++i)
      if (s.cols[i] < l) { row_ind[k] = i; col_ind[k] = s.cols[i]; ++k; }
  } else {
    // Rows of the extended problem are original columns: sort the pairs by original row.
    s.row_of.assign(static_cast<size_t>(l), -1);
    for (int64_t j = 0; j < n; ++j)
      if (s.cols[j] < l) s.row_of[s.cols[j]] = j;
    for (int64_t i = 0; i < l; ++i)
      if (s.row_of[i] >= 0) { row_ind[k] = i; col_ind[k] = s.row_of[i]; ++k; }
  }
  *matched = k;
  return Status::Ok;
}

// Limit +inf when no full matching exists: a matching of maximum cardinality, cheapest
// among those. Dummy columns that cost more than any pair could save make one more pair
// always worth it: with the finite costs x in [lo, hi], a matching with one pair more
// costs at most hi + (n - 1) (hi - lo) more in pairs and one dummy less, so any dummy
// above that bound works. The costs are first scaled by a power of two to magnitude about
// 1 (exact, but for entries some 300 orders of magnitude below the largest), so the bound
// stays finite whatever the input's range. Subnormal costs are scaled by 2^1022 at most
// (2^-exponent itself would be +inf below 2^-1024), which leaves them above 2^-53 and the
// margin relative to them.
template <typename T>
Status solve_max_cardinality(const MatrixView<T>& p, bool maximize, Isa isa, Scratch<T>& s, int64_t* row_ind,
                             int64_t* col_ind, int64_t* matched) {
  const double sign = maximize ? -1.0 : 1.0, inf = std::numeric_limits<double>::infinity();
  double lo = inf, hi = -inf;
  for (int64_t i = 0; i < p.n_rows; ++i) {
    const T* row = p.data + i * p.row_stride;
    for (int64_t j = 0; j < p.n_cols; ++j) {
      const double x = sign * static_cast<double>(row[j]);
      if (!(x > -inf)) return Status::Invalid;  // NaN or the wrong infinity
      if (x < inf) { lo = std::min(lo, x); hi = std::max(hi, x); }
    }
  }
  if (lo > hi) { *matched = 0; return Status::Ok; }  // every pair is forbidden
  int exponent = 0;
  const double magnitude = std::max(std::fabs(lo), std::fabs(hi));
  if (magnitude > 0) std::frexp(magnitude, &exponent);
  const double scale = std::ldexp(1.0, -std::max(exponent, std::numeric_limits<double>::min_exponent - 1));
  lo *= scale;
  hi *= scale;
  const int64_t n = std::min(p.n_rows, p.n_cols);
  // Relative to the costs (an absolute 1 would swallow costs scaled to 2^-53); 1 when every
  // allowed pair costs 0.
  double margin = (hi - lo) + std::max(std::fabs(lo), std::fabs(hi));
  if (margin == 0) margin = 1.0;
  const double dummy = hi + static_cast<double>(n + 1) * margin;
  return solve_short_side_first<T, double>(p, sign, scale, &dummy, isa, s.wide, s, row_ind, col_ind, matched);
}

template <typename T>
Status solve_one(const MatrixView<T>& p, bool maximize, CostLimit limit, Isa isa, Scratch<T>& s, int64_t* row_ind,
                 int64_t* col_ind, int64_t* matched) {
  *matched = 0;
  if (p.n_rows == 0 || p.n_cols == 0) return Status::Ok;
  const T sign = maximize ? T(-1) : T(1);
  if (limit.has_limit && std::isfinite(limit.limit)) {
    // In double whatever T, as lap decides (it solves in float64): a float32 cost is above or
    // below the limit as the two doubles compare (float32(0.1) > 0.1), and a limit beyond
    // FLT_MAX stays finite. Maximising mirrors lap's objective: the values are negated and
    // the limit kept, so the solution maximises the matched values minus limit / 2 per
    // unmatched row and column, and a larger limit never matches fewer pairs (inf, below,
    // matches as many as the allowed pairs permit).
    const double dummy = limit.limit;
    return solve_short_side_first<T, double>(p, static_cast<double>(sign), 1.0, &dummy, isa, s.wide, s, row_ind,
                                             col_ind, matched);
  }
  Status st;
  if (p.row_stride == p.n_cols || p.n_rows <= 1) {
    st = linear_sum_assignment(p.data, p.n_rows, p.n_cols, maximize, row_ind, col_ind, isa, 1);
  } else {
    // A block of a padded stack must be copied anyway: copy it in the wide orientation.
    st = solve_short_side_first<T, T>(p, sign, T(1), nullptr, isa, s.cost, s, row_ind, col_ind, matched);
  }
  if (st == Status::Ok) {
    *matched = std::min(p.n_rows, p.n_cols);
    return st;
  }
  if (st == Status::Infeasible && limit.has_limit) return solve_max_cardinality(p, maximize, isa, s, row_ind, col_ind, matched);
  return st;
}

}  // namespace

template <typename T>
Status solve_many(const MatrixView<T>* problems, int64_t count, bool maximize, CostLimit limit,
                  const int64_t* offsets, int64_t* row_ind, int64_t* col_ind, int64_t* matched, int threads,
                  Isa isa, int64_t* failed) {
  if (count <= 0) return Status::Ok;
  std::vector<Status> status(static_cast<size_t>(count), Status::Ok);
  // Batches of a few small problems stay on the calling thread (the cost model of thread_pool.h).
  int64_t work = 0;
  for (int64_t b = 0; b < count; ++b) work += assignment_work(problems[b].n_rows, problems[b].n_cols);
  const int64_t workers = std::min<int64_t>(threads_for_work(threads, work), count);
  std::atomic<int64_t> next{0};
  // One task per worker, each pulling problems until none is left: uneven problems balance,
  // and each worker keeps its scratch buffers from one problem to the next.
  parallel_for(workers, static_cast<int>(workers), [&](int64_t) {
    Scratch<T> scratch;
    for (int64_t b = next.fetch_add(1); b < count; b = next.fetch_add(1))
      status[b] = solve_one(problems[b], maximize, limit, isa, scratch, row_ind + offsets[b], col_ind + offsets[b],
                            matched + b);
  });
  for (int64_t b = 0; b < count; ++b)
    if (status[b] != Status::Ok) { *failed = b; return status[b]; }
  return Status::Ok;
}

template Status solve_many<float>(const MatrixView<float>*, int64_t, bool, CostLimit, const int64_t*, int64_t*,
                                  int64_t*, int64_t*, int, Isa, int64_t*);
template Status solve_many<double>(const MatrixView<double>*, int64_t, bool, CostLimit, const int64_t*, int64_t*,
                                   int64_t*, int64_t*, int, Isa, int64_t*);

}  // namespace pyperm::cpu
