#include "lap/lap_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "common/thread_pool.h"
#include "lap/cost_range.h"
#include "lap/lap_kernels.h"
#include "lap/lap_small.h"

namespace pyperm::cpu {
namespace {

template <typename T>
Status dispatch(Isa isa, const T* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads) {
  PYPERM_ISA_DISPATCH(isa, solve_dense(cost, n, m, col_of_row, threads));
}

template <typename T>
Status dispatch_transposed(Isa isa, const T* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads) {
  PYPERM_ISA_DISPATCH(isa, solve_dense_transposed(cost, n, m, col_of_row, threads));
}

// The kernel wants a minimisation with n <= m and only +inf as a forbidden mark. When
// the input is already that, it is used in place and the kernel's first pass checks it;
// otherwise it is checked while being copied (negated and/or transposed).
template <typename T>
Status prepare(const T* cost, int64_t n_rows, int64_t n_cols, bool maximize, int threads, std::unique_ptr<T[]>& work,
               const T** out) {
  const bool transpose = n_rows > n_cols;
  if (!transpose && !maximize) {
    *out = cost;
    return Status::Ok;
  }
  const int64_t total = n_rows * n_cols;
  // Uninitialised: a zero-filled vector would write the whole matrix once more.
  work.reset(new T[static_cast<size_t>(total)]);
  const T sign = maximize ? T(-1) : T(1);
  const T inf = std::numeric_limits<T>::infinity();
  // Bands of 64 source rows, spread over threads when the matrix is large (the copy is
  // bound by memory bandwidth, which one core does not saturate).
  constexpr int64_t B = 64;
  const int64_t bands = (n_rows + B - 1) / B;
  std::vector<char> band_bad(static_cast<size_t>(bands), 0);
  parallel_for(bands, total >= (int64_t(1) << 20) ? threads : 1, [&](int64_t band) {
    const int64_t i0 = band * B, i1 = std::min(i0 + B, n_rows);
    int bad = 0;  // valid entries end above -inf; NaN fails the comparison too (branch-free)
    if (transpose) {
      // Each output row segment is written contiguously; the band's source rows are read
      // down a column, and the cache lines they bring serve the next columns too (writing
      // along a source row instead touches one output page per entry: measured 15% slower
      // on 4000 x 1000).
      for (int64_t j = 0; j < n_cols; ++j) {
        T* out_row = work.get() + j * n_rows;
        for (int64_t i = i0; i < i1; ++i) {
          T c = sign * cost[i * n_cols + j];
          out_row[i] = c;
          bad |= !(c > -inf);
        }
      }
    } else {
      for (int64_t k = i0 * n_cols; k < i1 * n_cols; ++k) {
        T c = sign * cost[k];
        work[k] = c;
        bad |= !(c > -inf);
      }
    }
    band_bad[band] = static_cast<char>(bad);
  });
  for (char b : band_bad)
    if (b) return Status::Invalid;
  *out = work.get();
  return Status::Ok;
}

// Problems up to this many entries go to the small solver (lap_small.h): below it the row
// caches, heap and threads of the large one cost more than they save.
constexpr int64_t kSmallEntries = 4096;

template <typename T>
Status dispatch_small(Isa isa, const T* cost, int64_t n, int64_t m, int64_t* col_of_row, void* scratch) {
  PYPERM_ISA_DISPATCH(isa, solve_small(cost, n, m, col_of_row, scratch));
}

// A small problem in one thread-local buffer that grows to the largest seen (a few tens of
// KiB at most): its (negated, transposed) copy when one is needed, the solver's scratch and
// the column of each row. Nothing is allocated per call once the buffer has grown.
template <typename T>
Status solve_small_problem(const T* cost, int64_t n_rows, int64_t n_cols, bool maximize, int64_t* row_ind,
                           int64_t* col_ind, Isa isa) {
  const bool transposed = n_rows > n_cols;
  const int64_t n = transposed ? n_cols : n_rows, m = transposed ? n_rows : n_cols;
  const bool copy = transposed || maximize;
  auto words = [](size_t bytes) { return (bytes + 7) / 8; };
  const size_t copy_words = copy ? words(sizeof(T) * n * m) : 0, cols_words = transposed ? size_t(n) : 0;
  const size_t scratch_words = words(small_scratch_bytes(n, m, sizeof(T)));
  thread_local std::vector<uint64_t> buffer;
  if (buffer.size() < copy_words + cols_words + scratch_words) buffer.resize(copy_words + cols_words + scratch_words);
  uint64_t* at = buffer.data();
  const T* c = cost;
  if (copy) {
    T* out = reinterpret_cast<T*>(at);
    const T sign = maximize ? T(-1) : T(1);
    if (transposed) {
      for (int64_t i = 0; i < n_rows; ++i)
        for (int64_t j = 0; j < n_cols; ++j) out[j * n_rows + i] = sign * cost[i * n_cols + j];
    } else {
      for (int64_t k = 0; k < n * m; ++k) out[k] = sign * cost[k];
    }
    c = out;  // the solver checks every entry: negated NaN stays NaN, a maximised +inf is -inf
  }
  int64_t* col_of_row = transposed ? reinterpret_cast<int64_t*>(at + copy_words) : col_ind;
  const Status s = dispatch_small(isa, c, n, m, col_of_row, at + copy_words + cols_words);
  if (s != Status::Ok) return s;
  if (!transposed) {
    for (int64_t i = 0; i < n; ++i) row_ind[i] = i;
    return Status::Ok;
  }
  // Solved the transpose: col_of_row maps original columns to original rows; the rows are
  // listed in increasing order by a pass over the m original rows.
  int64_t* col_of_orig_row = reinterpret_cast<int64_t*>(at + copy_words + cols_words);  // reuses the scratch
  for (int64_t i = 0; i < n_rows; ++i) col_of_orig_row[i] = -1;
  for (int64_t j = 0; j < n; ++j) col_of_orig_row[col_of_row[j]] = j;
  int64_t k = 0;
  for (int64_t i = 0; i < n_rows; ++i)
    if (col_of_orig_row[i] >= 0) { row_ind[k] = i; col_ind[k] = col_of_orig_row[i]; ++k; }
  return Status::Ok;
}

template <typename T>
Status dispatch_warm(Isa isa, const T* cost, int64_t n, T* v, int64_t* col_of_row) {
  PYPERM_ISA_DISPATCH(isa, solve_square_warm(cost, n, v, col_of_row));
}

// solve_square_warm for costs or duals beyond largest_direct_cost (cost_range.h): on double
// copies of both, scaled by a power of two for double input. The final duals come back in T,
// clamped to its finite range: any finite duals are a valid start for the next solve.
template <typename T>
Status solve_square_warm_wide(const T* cost, int64_t n, T* v, int64_t* col_of_row, Isa isa) {
  double scale = 1.0;
  if (std::is_same<T, double>::value) {
    const double largest = std::max<double>(largest_finite_magnitude(cost, n * n), largest_finite_magnitude(v, n));
    scale = power_of_two_scale(largest, largest_direct_cost<double>(n, n));
  }
  std::unique_ptr<double[]> wide_cost(new double[static_cast<size_t>(n * n)]);
  std::vector<double> wide_v(static_cast<size_t>(n));
  for (int64_t k = 0; k < n * n; ++k) wide_cost[k] = static_cast<double>(cost[k]) * scale;
  for (int64_t j = 0; j < n; ++j) wide_v[j] = static_cast<double>(v[j]) * scale;
  const Status s = dispatch_warm(isa, wide_cost.get(), n, wide_v.data(), col_of_row);
  const double top = static_cast<double>(std::numeric_limits<T>::max());
  for (int64_t j = 0; j < n; ++j) v[j] = static_cast<T>(std::max(-top, std::min(top, wide_v[j] / scale)));
  return s;
}

}  // namespace

template <typename T>
Status solve_square_warm(const T* cost, int64_t n, T* v, int64_t* col_of_row, Isa isa) {
  if (n == 0) return Status::Ok;
  const T bound = largest_direct_cost<T>(n, n);
  if (any_finite_beyond(cost, n * n, bound) || any_finite_beyond(v, n, bound))
    return solve_square_warm_wide(cost, n, v, col_of_row, isa);
  return dispatch_warm(isa, cost, n, v, col_of_row);
}

namespace {

// Costs beyond largest_direct_cost (cost_range.h): float in double, double scaled by a power of
// two, each into a copy that the solver then takes as any other input.
Status solve_wide(const float* cost, int64_t n_rows, int64_t n_cols, bool maximize, int64_t* row_ind,
                  int64_t* col_ind, Isa isa, int threads) {
  const int64_t total = n_rows * n_cols;
  std::unique_ptr<double[]> wide(new double[static_cast<size_t>(total)]);
  for (int64_t k = 0; k < total; ++k) wide[k] = static_cast<double>(cost[k]);
  return linear_sum_assignment(wide.get(), n_rows, n_cols, maximize, row_ind, col_ind, isa, threads);
}

Status solve_wide(const double* cost, int64_t n_rows, int64_t n_cols, bool maximize, int64_t* row_ind,
                  int64_t* col_ind, Isa isa, int threads) {
  const int64_t total = n_rows * n_cols;
  const double scale = power_of_two_scale(largest_finite_magnitude(cost, total),
                                          largest_direct_cost<double>(n_rows, n_cols));
  std::unique_ptr<double[]> scaled(new double[static_cast<size_t>(total)]);
  for (int64_t k = 0; k < total; ++k) scaled[k] = cost[k] * scale;
  return linear_sum_assignment(scaled.get(), n_rows, n_cols, maximize, row_ind, col_ind, isa, threads);
}

}  // namespace

template <typename T>
Status linear_sum_assignment(const T* cost, int64_t n_rows, int64_t n_cols, bool maximize,
                             int64_t* row_ind, int64_t* col_ind, Isa isa, int threads) {
  if (n_rows == 0 || n_cols == 0) return Status::Ok;
  if (any_finite_beyond(cost, n_rows * n_cols, largest_direct_cost<T>(n_rows, n_cols)))
    return solve_wide(cost, n_rows, n_cols, maximize, row_ind, col_ind, isa, threads);
  if (n_rows * n_cols <= kSmallEntries)
    return solve_small_problem(cost, n_rows, n_cols, maximize, row_ind, col_ind, isa);
  const bool transposed = n_rows > n_cols;
  const int64_t n = transposed ? n_cols : n_rows, m = transposed ? n_rows : n_cols;
  std::vector<int64_t> col_of_row(n);
  Status s;
  if (transposed && !maximize) {
    // A tall minimisation is read in place: the kernel builds its row caches from one pass
    // over the rows and transposes only if a search needs a whole row (4000 x 1000 uniform:
    // one pass instead of a copy, a write and a pass).
    s = dispatch_transposed(isa, cost, n, m, col_of_row.data(), threads);
  } else {
    std::unique_ptr<T[]> work;
    const T* c = nullptr;
    s = prepare(cost, n_rows, n_cols, maximize, threads, work, &c);
    if (s != Status::Ok) return s;
    s = dispatch(isa, c, n, m, col_of_row.data(), threads);
  }
  if (s != Status::Ok) return s;
  if (!transposed) {
    for (int64_t i = 0; i < n; ++i) { row_ind[i] = i; col_ind[i] = col_of_row[i]; }
  } else {
    // Solved the transpose: col_of_row maps original columns to original rows.
    std::vector<int64_t> col_of_orig_row(n_rows, -1);
    for (int64_t j = 0; j < n; ++j) col_of_orig_row[col_of_row[j]] = j;
    int64_t k = 0;
    for (int64_t i = 0; i < n_rows; ++i)
      if (col_of_orig_row[i] >= 0) { row_ind[k] = i; col_ind[k] = col_of_orig_row[i]; ++k; }
  }
  return Status::Ok;
}

template <typename T>
Status batch_linear_sum_assignment(const T* costs, int64_t batch, int64_t n_rows, int64_t n_cols,
                                   bool maximize, int64_t* row_ind, int64_t* col_ind, int threads,
                                   Isa isa, int64_t* failed) {
  const int64_t k = std::min(n_rows, n_cols), stride = n_rows * n_cols;
  std::vector<Status> status(static_cast<size_t>(batch), Status::Ok);
  parallel_for(batch, threads, batch * assignment_work(n_rows, n_cols), [&](int64_t b) {
    // One thread per problem: the batch is already spread over the threads.
    status[b] = linear_sum_assignment(costs + b * stride, n_rows, n_cols, maximize, row_ind + b * k,
                                      col_ind + b * k, isa, 1);
  });
  for (int64_t b = 0; b < batch; ++b)
    if (status[b] != Status::Ok) { *failed = b; return status[b]; }
  return Status::Ok;
}

template Status linear_sum_assignment<float>(const float*, int64_t, int64_t, bool, int64_t*, int64_t*, Isa, int);
template Status linear_sum_assignment<double>(const double*, int64_t, int64_t, bool, int64_t*, int64_t*, Isa, int);
template Status solve_square_warm<float>(const float*, int64_t, float*, int64_t*, Isa);
template Status solve_square_warm<double>(const double*, int64_t, double*, int64_t*, Isa);
template Status batch_linear_sum_assignment<float>(const float*, int64_t, int64_t, int64_t, bool, int64_t*,
                                                   int64_t*, int, Isa, int64_t*);
template Status batch_linear_sum_assignment<double>(const double*, int64_t, int64_t, int64_t, bool, int64_t*,
                                                    int64_t*, int, Isa, int64_t*);

}  // namespace pyperm::cpu
