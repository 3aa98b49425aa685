#include "lap/incremental_assignment.h"

#include <cmath>
#include <limits>

#include "lap/cost_range.h"
#include "lap/incremental_scans.h"
#include "lap/lap_cpu.h"

namespace pyperm::cpu {
namespace {

template <typename T> constexpr T kInf = std::numeric_limits<T>::infinity();

// The O(n) scans are in incremental_scans.cpp, compiled once per instruction set (SSE2,
// AVX2, AVX-512); the solver's Isa picks one at run time.
template <typename T, typename I>
void relax(Isa isa, const T* r, const T* v, T* d, I* pred, const I* free, I i, T h, int64_t n, T* best,
           int64_t* best_j) {
  PYPERM_ISA_DISPATCH(isa, relax(r, v, d, pred, free, i, h, n, best, best_j));
}

template <typename T, typename I>
TwoMin<T> two_min(Isa isa, const T* r, const T* v, int64_t n) {
  PYPERM_ISA_DISPATCH(isa, two_min(r, v, n));
}

template <typename T>
T min_reduced(Isa isa, const T* r, const T* v, int64_t n) {
  PYPERM_ISA_DISPATCH(isa, min_reduced(r, v, n));
}

}  // namespace

template <typename T>
IncrementalAssignment<T>::IncrementalAssignment(const T* cost, int64_t n, Isa isa)
    : c_(cost), n_(n), isa_(isa), v_(n, T(0)), d_(n), pred_(n), free_(n, Index(-1)), x_(n, -1), y_(n, -1) {
  done_.reserve(static_cast<size_t>(n));
}

template <typename T>
void IncrementalAssignment<T>::warm_start(const int64_t* col_of_row, const T* v) {
  for (int64_t j = 0; j < n_; ++j) set_y(j, -1);
  for (int64_t i = 0; i < n_; ++i) {
    const int64_t j = col_of_row[i];
    // Anything that is not a valid partial matching is dropped, not trusted.
    if (j >= 0 && j < n_ && y_[j] < 0) { x_[i] = j; set_y(j, i); }
    else x_[i] = -1;
  }
  for (int64_t j = 0; j < n_; ++j) v_[j] = std::isfinite(v[j]) ? v[j] : T(0);
  started_ = true;
}

template <typename T>
Status IncrementalAssignment<T>::solve(int64_t* col_of_row) {
  const int64_t n = n_;
  augmentations_ = 0;
  if (n == 0) return Status::Ok;
  // Costs too large for this solver's arithmetic in T (cost_range.h): a warm solve from the
  // duals held, which widens them, and its matching and duals are kept for the next solve.
  if (any_finite_beyond(c_, n * n, largest_direct_cost<T>(n, n))) {
    const Status s = solve_square_warm(c_, n, v_.data(), col_of_row, isa_);
    if (s != Status::Ok) return s;
    warm_start(col_of_row, v_.data());
    return Status::Ok;
  }
  if (!started_) {
    // Column reduction: v = column minima makes every reduced cost non-negative.
    std::fill(v_.begin(), v_.end(), kInf<T>);
    for (int64_t i = 0; i < n; ++i) {
      const T* r = row(i);
      for (int64_t j = 0; j < n; ++j) v_[j] = r[j] < v_[j] ? r[j] : v_[j];
    }
    for (int64_t j = 0; j < n; ++j)
      if (v_[j] == kInf<T>) return Status::Infeasible;  // a column with every entry forbidden
    started_ = true;
  }
  // Keep each matched edge that is still a minimum of its row's reduced costs (ties
  // allowed); give a free row its row minimum when that column is free. What is left
  // satisfies complementary slackness, the invariant the augmenting paths need.
  for (int64_t i = 0; i < n; ++i) {
    const T* r = row(i);
    const T best = min_reduced(isa_, r, v_.data(), n);
    const int64_t j = x_[i];
    if (j >= 0) {
      if (r[j] != kInf<T> && r[j] - v_[j] <= best) continue;
      x_[i] = -1;
      set_y(j, -1);
    }
    if (best == kInf<T>) continue;  // augment() reports the infeasibility
    for (int64_t k = 0; k < n; ++k)
      if (r[k] - v_[k] == best) {
        if (y_[k] < 0) { x_[i] = k; set_y(k, i); }
        break;
      }
  }
  std::vector<int64_t> free_rows;
  for (int64_t i = 0; i < n; ++i)
    if (x_[i] < 0) free_rows.push_back(i);
  // Cheap passes settle most free rows; shortest paths finish the rest. Four passes, not
  // two: weight matching's MLP-512 solves took 7% less (of the 80-230 rows a visit frees,
  // two passes left 22-55 to the shortest paths); eight were slower; BvN is unchanged.
  for (int pass = 0; pass < 4; ++pass) reduce_rows(free_rows);
  for (int64_t i : free_rows) {
    ++augmentations_;
    if (!augment(i)) return Status::Infeasible;
  }
  for (int64_t i = 0; i < n; ++i) col_of_row[i] = x_[i];
  return Status::Ok;
}

// Augmenting row reduction (Jonker-Volgenant): each free row takes its cheapest column,
// lowering that column's dual to the row's second-cheapest reduced cost so the edge is a
// row minimum, and displaces the column's row, which is retried at once when the dual
// moved. O(n) per move; a budget bounds the moves, since rounding can stall the lowering.
template <typename T>
void IncrementalAssignment<T>::reduce_rows(std::vector<int64_t>& free_rows) {
  const int64_t n = n_;
  int64_t k = 0, kept = 0;
  const int64_t todo = static_cast<int64_t>(free_rows.size());
  int64_t budget = 2 * todo + 16;
  while (k < todo) {
    const int64_t i = free_rows[k++];
    const TwoMin<T> t = two_min<T, Index>(isa_, row(i), v_.data(), n);
    if (!(t.u1 < kInf<T>)) { free_rows[kept++] = i; continue; }
    int64_t j = t.j1;
    const bool lowers = t.u1 < t.u2 && t.u2 < kInf<T>;
    if (lowers) {
      v_[j] -= t.u2 - t.u1;
    } else if (y_[j] >= 0 && t.j2 >= 0 && t.u2 == t.u1) {
      j = t.j2;
    }
    const int64_t i0 = y_[j];
    x_[i] = j;
    set_y(j, i);
    if (i0 < 0) continue;
    x_[i0] = -1;
    if (lowers && --budget > 0) free_rows[--k] = i0;
    else free_rows[kept++] = i0;
  }
  free_rows.resize(kept);
}

// Dijkstra on reduced costs from free row f to the nearest free column; then the duals of
// the columns it finished move by their distance (keeping every reduced cost non-negative
// and the new path tight), and the path is flipped.
template <typename T>
bool IncrementalAssignment<T>::augment(int64_t f) {
  const int64_t n = n_;
  T* d = d_.data();
  T* v = v_.data();
  Index* pred = pred_.data();
  const Index* free = free_.data();
  done_.clear();
  std::fill(d_.begin(), d_.end(), kInf<T>);
  T mu;
  int64_t j;
  relax(isa_, row(f), v, d, pred, free, Index(f), T(0), n, &mu, &j);
  for (;;) {
    if (j < 0 || mu == kInf<T>) {
      for (const Done& s : done_) v[s.j] = s.v;
      return false;
    }
    if (y_[j] < 0) break;
    // Column j is finished at distance mu; grow the tree through its row.
    const int64_t i = y_[j];
    const T h = row(i)[j] - v[j] - mu;
    done_.push_back({j, v[j], mu});
    v[j] = -kInf<T>;
    d[j] = kInf<T>;
    relax(isa_, row(i), v, d, pred, free, Index(i), h, n, &mu, &j);
  }
  for (const Done& s : done_) v[s.j] = s.v + (s.d - mu);
  for (;;) {
    const int64_t i = pred[j];
    const int64_t prev = x_[i];
    set_y(j, i);
    x_[i] = j;
    if (i == f) break;
    j = prev;
  }
  return true;
}

template class IncrementalAssignment<float>;
template class IncrementalAssignment<double>;

}  // namespace pyperm::cpu
