// Greedy Birkhoff-von Neumann decomposition on the CPU (see bvn_cpu.h for the references).
//
// What makes it fast is that consecutive terms are nearly the same problem: subtracting
// alpha P changes exactly one entry per row, so each term starts from the previous one.
//
// Bottleneck terms. The bottleneck value lambda* (the largest lambda for which the graph
// G(lambda) of entries >= lambda has a perfect matching) never increases from one term to the
// next, because entries only decrease. So the previous term's alpha is an upper bound; the
// search keeps the previous matching's edges that are still >= it, and re-matches the other
// rows one at a time by depth-first augmenting paths in G(lambda) (with the cheap-assignment
// lookahead of Duff's MC21). When no augmenting path from a free row f exists in G(lambda), the
// rows it reaches form a Hall violator, which proves lambda* < lambda; lambda drops to the
// largest entry leaving that set and the same search continues. A heap over the reached rows
// finds that entry, so one search is a widest-path search in disguise. Each row keeps its
// positive entries sorted in decreasing order, so a search only touches entries >= lambda:
// late in a decomposition G(lambda*) is sparse (a few entries per row) though R is dense.
// After a term, each row's one changed entry is moved down its sorted list.
//
// Max-weight terms. The min-cost assignment of cost -R (+inf off the support) is solved cold
// for the first term by lap_cpu's Jonker-Volgenant kernel, then term after term by a solver
// that keeps the matching and column duals (incremental_assignment.h): subtracting alpha P
// only raises the costs of the previous matching, so the duals stay feasible and only the
// rows whose edge stopped being a row minimum of the reduced costs are re-assigned.
#include "bvn/bvn_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <queue>
#include <utility>

#include "lap/incremental_assignment.h"
#include "lap/lap_cpu.h"

namespace pyperm::cpu {
namespace {

// Residual entries an update leaves within this many epsilons of zero (relative to the
// original entries involved) are rounding noise and leave the support.
constexpr double kZeroUlps = 32.0;

template <typename T>
bool all_finite(const T* a, int64_t count) {
  // Plain comparisons (no isfinite call) so that the loop vectorises.
  constexpr T big = std::numeric_limits<T>::max();
  int bad = 0;
  for (int64_t k = 0; k < count; ++k) bad |= !(a[k] >= -big && a[k] <= big);
  return bad == 0;
}

// Sum (in double, four independent accumulators so the additions pipeline) and maximum.
template <typename T>
void sum_and_max(const T* a, int64_t count, double* sum, double* max) {
  double s[4] = {0, 0, 0, 0};
  T m[4] = {0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 4 <= count; k += 4)
    for (int l = 0; l < 4; ++l) {
      s[l] += double(a[k + l]);
      m[l] = a[k + l] > m[l] ? a[k + l] : m[l];
    }
  for (; k < count; ++k) {
    s[0] += double(a[k]);
    m[0] = a[k] > m[0] ? a[k] : m[0];
  }
  *sum = (s[0] + s[1]) + (s[2] + s[3]);
  *max = double(std::max(std::max(m[0], m[1]), std::max(m[2], m[3])));
}

// ---------------------------------------------------------------- bottleneck matching
template <typename T>
class BottleneckMatcher {
 public:
  // R: the residual, n x n, owned by the caller and updated only through update().
  BottleneckMatcher(const T* R, int64_t n)
      : R_(R), n_(n), order_(static_cast<size_t>(n * n)), len_(n), col_(n, -1), row_(n, -1), pred_(n, -1),
        pos_(n, -1), pred_pos_(n, -1), visited_(n, 0), it_(n, 0), it_stamp_(n, 0), la_(n, 0), la_stamp_(n, 0) {
    std::vector<std::pair<T, int32_t>> tmp;
    tmp.reserve(static_cast<size_t>(n));
    lambda_ = std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = R + i * n;
      tmp.clear();
      for (int64_t j = 0; j < n; ++j)
        if (row[j] > T(0)) tmp.emplace_back(row[j], static_cast<int32_t>(j));
      // Decreasing value, ties by increasing column: a strict total order, so an entry's
      // position can be found again by binary search.
      std::sort(tmp.begin(), tmp.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      int32_t* ord = order(i);
      for (size_t k = 0; k < tmp.size(); ++k) ord[k] = tmp[k].second;
      len_[i] = static_cast<int64_t>(tmp.size());
      // lambda* <= the largest entry of every row (and column, below).
      lambda_ = std::min(lambda_, tmp.empty() ? T(0) : tmp[0].first);
    }
    std::vector<T> colmax(n, T(0));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) colmax[j] = std::max(colmax[j], R[i * n + j]);
    for (int64_t j = 0; j < n; ++j) lambda_ = std::min(lambda_, colmax[j]);
  }

  // A bottleneck perfect matching of the current residual; Infeasible when none exists.
  Status next(int64_t* col_of_row) {
    ++term_;
    free_.clear();
    for (int64_t i = 0; i < n_; ++i) {
      int64_t j = col_[i];
      if (j >= 0 && R_[i * n_ + j] < lambda_) { col_[i] = -1; row_[j] = -1; j = -1; }
      if (j < 0) free_.push_back(i);
    }
    for (int64_t f : free_)
      if (!search(f)) return Status::Infeasible;
    std::copy(col_.begin(), col_.end(), col_of_row);
    return Status::Ok;
  }

  // Row i's entry in column j went from old_value to new_value (0: left the support).
  // Call before the next next(), with R already holding new_value.
  void update(int64_t i, int64_t j, T old_value, T new_value) {
    int32_t* ord = order(i);
    const T* row = R_ + i * n_;
    const int64_t len = len_[i];
    const int32_t jj = static_cast<int32_t>(j);
    // Position of j: remembered when the edge was matched, else found under its old value
    // (R[i, j] already holds the new one).
    int64_t k = col_[i] == j ? pos_[i] : -1;
    if (k < 0 || k >= len || ord[k] != jj) k = lower_bound(ord, row, 0, len, old_value, jj);
    if (k >= len || ord[k] != jj) k = std::find(ord, ord + len, jj) - ord;  // never expected
    if (k >= len) return;
    if (new_value <= T(0)) {
      std::memmove(ord + k, ord + k + 1, sizeof(int32_t) * static_cast<size_t>(len - k - 1));
      len_[i] = len - 1;
      if (col_[i] == j) { col_[i] = -1; row_[j] = -1; }
      return;
    }
    // The entry only decreased, so its new place is further down.
    int64_t p = lower_bound(ord, row, k + 1, len, new_value, jj);
    std::memmove(ord + k, ord + k + 1, sizeof(int32_t) * static_cast<size_t>(p - 1 - k));
    ord[p - 1] = jj;
    if (col_[i] == j) pos_[i] = p - 1;
  }

 private:
  int32_t* order(int64_t i) { return order_.data() + i * n_; }

  // First position in ord[lo, hi) whose entry does not come before (value, col) in the
  // decreasing order. Column col itself is compared with `value`, as R may already hold its
  // new value.
  static int64_t lower_bound(const int32_t* ord, const T* row, int64_t lo, int64_t hi, T value, int32_t col) {
    while (lo < hi) {
      int64_t mid = lo + (hi - lo) / 2;
      int32_t c = ord[mid];
      T v = (c == col) ? value : row[c];
      bool before = v > value || (v == value && c < col);
      if (before) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  // Augments the matching by one row, from free row f, lowering lambda_ as little as the
  // matching needs. False when no augmenting path exists on the whole support.
  bool search(int64_t f) {
    ++stamp_;
    stack_.clear();
    heap_ = {};
    enter(f);
    stack_.push_back(f);
    for (;;) {
      while (!stack_.empty()) {
        const int64_t r = stack_.back();
        const int32_t* ord = order(r);
        const T* row = R_ + r * n_;
        const int64_t len = len_[r];
        // Lookahead: a free column among r's entries >= lambda ends the search at once.
        // Columns matched within a term stay matched, so the pointer only moves forward.
        if (la_stamp_[r] != term_) { la_stamp_[r] = term_; la_[r] = 0; }
        int64_t k = la_[r];
        for (; k < len; ++k) {
          const int32_t j = ord[k];
          if (row[j] < lambda_) break;
          if (row_[j] < 0) {
            la_[r] = k + 1;
            pred_[j] = r;
            pred_pos_[j] = k;
            augment(f, j);
            return true;
          }
        }
        la_[r] = k;
        // Depth-first step along the next unvisited (hence matched) column >= lambda.
        int64_t& p = it_[r];
        int64_t child = -1;
        while (p < len) {
          const int32_t j = ord[p];
          if (row[j] < lambda_) break;
          ++p;
          if (visited_[j] == stamp_) continue;
          visited_[j] = stamp_;
          pred_[j] = r;
          pred_pos_[j] = p - 1;
          child = row_[j];
          break;
        }
        if (child >= 0) {
          enter(child);
          stack_.push_back(child);
          continue;
        }
        // r is exhausted at lambda: remember its largest remaining entry.
        stack_.pop_back();
        while (p < len && visited_[ord[p]] == stamp_) ++p;
        if (p < len) heap_.push({row[ord[p]], r});
      }
      // No augmenting path in G(lambda): the rows reached are a Hall violator, so lambda* is
      // at most the largest entry leaving them. Lower lambda to it and go on from that row.
      for (;;) {
        if (heap_.empty()) return false;
        auto [value, r] = heap_.top();
        heap_.pop();
        const int32_t* ord = order(r);
        int64_t& p = it_[r];
        while (p < len_[r] && visited_[ord[p]] == stamp_) ++p;
        if (p >= len_[r]) continue;
        const T current = R_[r * n_ + ord[p]];
        if (current < value) { heap_.push({current, r}); continue; }  // stale key
        lambda_ = std::min(lambda_, current);
        stack_.push_back(r);
        break;
      }
    }
  }

  void enter(int64_t r) {
    if (it_stamp_[r] != stamp_) { it_stamp_[r] = stamp_; it_[r] = 0; }
  }

  // Flips the alternating path that ends at free column j (pred_ leads back to f).
  void augment(int64_t f, int64_t j) {
    for (;;) {
      const int64_t i = pred_[j];
      const int64_t next = col_[i];
      col_[i] = j;
      row_[j] = i;
      pos_[i] = pred_pos_[j];
      if (i == f) return;
      j = next;
    }
  }

  const T* R_;
  int64_t n_;
  std::vector<int32_t> order_;  // n x n: row i's positive entries' columns, decreasing value
  std::vector<int64_t> len_;    // number of positive entries of each row
  std::vector<int64_t> col_, row_, pred_;
  std::vector<int64_t> pos_;       // position of col_[i] in row i's order
  std::vector<int64_t> pred_pos_;  // position of column j in row pred_[j]'s order
  std::vector<uint64_t> visited_;  // == stamp_: column visited in the current search
  std::vector<int64_t> it_;        // per-row depth-first iterator (valid when it_stamp_ == stamp_)
  std::vector<uint64_t> it_stamp_;
  std::vector<int64_t> la_;        // per-row lookahead pointer (valid when la_stamp_ == term_)
  std::vector<uint64_t> la_stamp_;
  std::vector<int64_t> free_, stack_;
  std::priority_queue<std::pair<T, int64_t>> heap_;
  uint64_t stamp_ = 0, term_ = 0;
  T lambda_;
};

// ---------------------------------------------------------------- max-weight matching
template <typename T>
class MaxWeightMatcher {
 public:
  // lap_warm: solve every term with solve_square_warm (duals only) instead of the
  // incremental solver, for comparison.
  MaxWeightMatcher(const T* R, int64_t n, Isa isa, bool lap_warm)
      : n_(n), isa_(isa), lap_warm_(lap_warm), cost_(make_cost(R, n)), v_(n, T(0)), solver_(cost_.data(), n, isa) {}

  Status next(int64_t* col_of_row) {
    if (lap_warm_) return solve_square_warm(cost_.data(), n_, v_.data(), col_of_row, isa_);
    if (first_) {
      // The first term is a cold solve, which lap_cpu's kernel (column reduction, reduction
      // transfer, augmenting row reduction) does faster; its matching and duals then seed
      // the incremental solver.
      first_ = false;
      const Status s = solve_square_warm(cost_.data(), n_, v_.data(), col_of_row, isa_);
      if (s == Status::Ok) solver_.warm_start(col_of_row, v_.data());
      return s;
    }
    return solver_.solve(col_of_row);
  }

  void update(int64_t i, int64_t j, T /*old_value*/, T new_value) {
    cost_[i * n_ + j] = new_value > T(0) ? -new_value : std::numeric_limits<T>::infinity();
  }

 private:
  static std::vector<T> make_cost(const T* R, int64_t n) {
    std::vector<T> cost(static_cast<size_t>(n * n));
    for (int64_t k = 0; k < n * n; ++k) cost[k] = R[k] > T(0) ? -R[k] : std::numeric_limits<T>::infinity();
    return cost;
  }

  int64_t n_;
  Isa isa_;
  bool lap_warm_;
  std::vector<T> cost_;  // -R on the support, +inf off it; raised in place term by term
  std::vector<T> v_;     // column duals from solve_square_warm
  IncrementalAssignment<T> solver_;
  bool first_ = true;
};

// ---------------------------------------------------------------- the greedy loop
template <typename T, typename Matcher>
void decompose(const T* D, int64_t n, std::vector<T>& R, Matcher& matcher, int64_t max_terms,
               double tol, const BvnProgress* progress, BvnResult<T>* out) {
  double mass, d_max;  // mass: the sum of R, kept up to date term by term
  sum_and_max(R.data(), n * n, &mass, &d_max);
  std::vector<int64_t> col(n);
  const double zero_rel = kZeroUlps * std::numeric_limits<T>::epsilon();
  out->stop = BvnStop::Converged;
  int64_t terms = 0;
  for (;;) {
    if (mass / double(n) <= tol) { out->stop = BvnStop::Converged; break; }
    if (max_terms >= 0 && terms >= max_terms) { out->stop = BvnStop::MaxTerms; break; }
    if (matcher.next(col.data()) != Status::Ok) { out->stop = BvnStop::NoMatching; break; }
    int64_t argmin = 0;
    T alpha = std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      const T r = R[i * n + col[i]];
      if (r < alpha) { alpha = r; argmin = i; }
    }
    if (!(alpha > T(0))) { out->stop = BvnStop::NoMatching; break; }  // never expected
    out->coeffs.push_back(alpha);
    out->perms.insert(out->perms.end(), col.begin(), col.end());
    ++terms;
    // alpha may carry the rounding of the entry it came from, so an entry is rounding noise
    // when it is small next to both its own original value and that one.
    const double noise_ref = D[argmin * n + col[argmin]];
    // Only entries below this can be noise; the test saves reading D for all the others.
    const double maybe_noise = zero_rel * std::max(d_max, noise_ref);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = col[i];
      const T old_value = R[i * n + j];
      T new_value = old_value - alpha;
      if (i == argmin || new_value <= T(0) ||
          (double(new_value) <= maybe_noise &&
           double(new_value) <= zero_rel * std::max(double(D[i * n + j]), noise_ref)))
        new_value = T(0);
      R[i * n + j] = new_value;
      mass -= double(old_value) - double(new_value);
      matcher.update(i, j, old_value, new_value);
    }
    const double residual = std::max(mass, 0.0) / double(n);
    if (progress != nullptr && *progress && !(*progress)(terms, double(alpha), residual)) {
      out->stop = BvnStop::Cancelled;
      break;
    }
  }
  // Report the residual exactly rather than the running total.
  double exact, unused;
  sum_and_max(R.data(), n * n, &exact, &unused);
  out->residual_mass = n > 0 ? exact / double(n) : 0.0;
}

}  // namespace

template <typename T>
Status birkhoff_decomposition(const T* D, int64_t n, BvnMethod method, int64_t max_terms, double tol,
                              const BvnProgress* progress, Isa isa, BvnResult<T>* out) {
  if (!all_finite(D, n * n)) return Status::Invalid;
  out->coeffs.clear();
  out->perms.clear();
  out->residual_mass = 0;
  out->stop = BvnStop::Converged;
  if (n == 0) return Status::Ok;
  std::vector<T> R(static_cast<size_t>(n * n));
  for (int64_t k = 0; k < n * n; ++k) R[k] = D[k] > T(0) ? D[k] : T(0);
  if (method == BvnMethod::Bottleneck) {
    BottleneckMatcher<T> matcher(R.data(), n);
    decompose(D, n, R, matcher, max_terms, tol, progress, out);
  } else {
    MaxWeightMatcher<T> matcher(R.data(), n, isa, method == BvnMethod::MaxWeightLapWarm);
    decompose(D, n, R, matcher, max_terms, tol, progress, out);
  }
  return Status::Ok;
}

template <typename T>
Status bottleneck_matching(const T* A, int64_t n, int64_t* col_of_row, T* value) {
  if (!all_finite(A, n * n)) return Status::Invalid;
  *value = T(0);
  if (n == 0) return Status::Ok;
  std::vector<T> R(static_cast<size_t>(n * n));
  for (int64_t k = 0; k < n * n; ++k) R[k] = A[k] > T(0) ? A[k] : T(0);
  BottleneckMatcher<T> matcher(R.data(), n);
  Status s = matcher.next(col_of_row);
  if (s != Status::Ok) return s;
  T v = std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < n; ++i) v = std::min(v, R[i * n + col_of_row[i]]);
  *value = v;
  return Status::Ok;
}

template Status birkhoff_decomposition<float>(const float*, int64_t, BvnMethod, int64_t, double, const BvnProgress*,
                                              Isa, BvnResult<float>*);
template Status birkhoff_decomposition<double>(const double*, int64_t, BvnMethod, int64_t, double,
                                               const BvnProgress*, Isa, BvnResult<double>*);
template Status bottleneck_matching<float>(const float*, int64_t, int64_t*, float*);
template Status bottleneck_matching<double>(const double*, int64_t, int64_t*, double*);

}  // namespace pyperm::cpu
