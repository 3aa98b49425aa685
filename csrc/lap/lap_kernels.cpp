// Jonker-Volgenant shortest augmenting path solver for dense assignment problems.
//
// R. Jonker and A. Volgenant, "A shortest augmenting path algorithm for dense and
// sparse linear assignment problems", Computing 38, 325-340 (1987). Square problems
// run the paper's three phases: column reduction with reduction transfer, augmenting
// row reduction, and Dijkstra-like shortest augmenting paths. Wide problems (n < m)
// keep the column duals of unmatched columns at zero, which the rectangular problem's
// optimality needs (see D. F. Crouse, "On implementing 2D rectangular assignment
// algorithms", IEEE TAES 52(4), 2016): they start from a greedy row assignment with
// zero duals and go straight to the shortest paths.
//
// Only the column duals v are stored; a row's dual is implied by its assigned column.
// Every O(m) scan over a cost row is written with GCC vector extensions, so this one
// file becomes SSE2, AVX2 or AVX-512 code depending on the flags it is compiled with.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "lap/lap_kernels.h"

#ifndef PYPERM_ISA
#error "compile this file with -DPYPERM_ISA=<namespace>"
#endif

namespace pyperm::cpu::PYPERM_ISA {
namespace {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX2__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

// Lane-matched vector types: values of T, and integers of T's width (indices, masks).
template <typename T> struct Lanes;
template <> struct Lanes<double> {
  typedef double Vec __attribute__((vector_size(kVecBytes)));
  typedef int64_t IVec __attribute__((vector_size(kVecBytes)));
  typedef int64_t Index;
};
template <> struct Lanes<float> {
  typedef float Vec __attribute__((vector_size(kVecBytes)));
  typedef int32_t IVec __attribute__((vector_size(kVecBytes)));
  typedef int32_t Index;
};

template <typename V, typename S> inline V load(const S* p) { V r; std::memcpy(&r, p, sizeof(V)); return r; }
template <typename V, typename S> inline void store(S* p, const V& x) { std::memcpy(p, &x, sizeof(V)); }
template <typename V, typename S> inline V splat(S s) { return V{} + s; }
template <typename IV> inline IV iota_vec() {
  IV r;
  for (int k = 0; k < int(sizeof(IV) / sizeof(r[0])); ++k) r[k] = k;
  return r;
}

template <typename T> constexpr T kInf = std::numeric_limits<T>::infinity();

// Smallest value of row[j] - v[j] (ties: lowest j), and the second smallest.
template <typename T>
struct TwoSmallest { T u1, u2; int64_t j1, j2; };

template <typename T>
TwoSmallest<T> two_smallest(const T* row, const T* v, int64_t m) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  using IVec = typename L::IVec;
  constexpr int W = sizeof(Vec) / sizeof(T);
  Vec m1 = splat<Vec>(kInf<T>), m2 = m1;
  IVec i1 = splat<IVec>(-1), i2 = i1, idx = iota_vec<IVec>();
  const IVec step = splat<IVec>(W);
  int64_t j = 0;
  for (; j + W <= m; j += W) {
    Vec h = load<Vec>(row + j) - load<Vec>(v + j);
    auto lt1 = h < m1;
    auto lt2 = h < m2;
    // A new smallest pushes the old one to second place.
    m2 = lt1 ? m1 : (lt2 ? h : m2);
    i2 = lt1 ? i1 : (lt2 ? idx : i2);
    m1 = lt1 ? h : m1;
    i1 = lt1 ? idx : i1;
    idx += step;
  }
  TwoSmallest<T> r{kInf<T>, kInf<T>, -1, -1};
  auto offer = [&r](T h, int64_t jj) {
    if (jj < 0) return;
    if (h < r.u1 || (h == r.u1 && jj < r.j1)) {
      r.u2 = r.u1; r.j2 = r.j1; r.u1 = h; r.j1 = jj;
    } else if (h < r.u2 || (h == r.u2 && (r.j2 < 0 || jj < r.j2))) {
      r.u2 = h; r.j2 = jj;
    }
  };
  for (int k = 0; k < W; ++k) { offer(m1[k], i1[k]); offer(m2[k], i2[k]); }
  for (; j < m; ++j) offer(row[j] - v[j], j);
  // Entries equal to +inf never entered the lanes; fall back to any other column.
  if (r.j1 < 0 && m > 0) { r.j1 = 0; }
  if (r.j2 < 0 && m > 1) { r.j2 = (r.j1 == 0) ? 1 : 0; }
  return r;
}

// One Dijkstra step: d[k] = min(d[k], row[k] - v[k] - h), pred[k] = i where it improved.
// Finished columns carry v = -inf and d = +inf, so they neither change nor win.
// Returns the smallest new d (ties: lowest k) in best/best_j.
template <typename T>
void relax(const T* row, const T* v, T* d, typename Lanes<T>::Index* pred,
           typename Lanes<T>::Index i, T h, int64_t m, T& best, int64_t& best_j) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  using IVec = typename L::IVec;
  constexpr int W = sizeof(Vec) / sizeof(T);
  const Vec hv = splat<Vec>(h);
  const IVec iv = splat<IVec>(i);
  Vec bv = splat<Vec>(kInf<T>);
  IVec bi = splat<IVec>(-1), idx = iota_vec<IVec>();
  const IVec step = splat<IVec>(W);
  int64_t j = 0;
  for (; j + W <= m; j += W) {
    Vec cred = load<Vec>(row + j) - load<Vec>(v + j) - hv;
    Vec dj = load<Vec>(d + j);
    auto better = cred < dj;
    dj = better ? cred : dj;
    store(d + j, dj);
    store(pred + j, better ? iv : load<IVec>(pred + j));
    auto win = dj < bv;
    bv = win ? dj : bv;
    bi = win ? idx : bi;
    idx += step;
  }
  best = kInf<T>;
  best_j = -1;
  for (int k = 0; k < W; ++k)
    if (bv[k] < best || (bv[k] == best && bi[k] >= 0 && bi[k] < best_j)) { best = bv[k]; best_j = bi[k]; }
  for (; j < m; ++j) {
    T cred = row[j] - v[j] - h;
    if (cred < d[j]) { d[j] = cred; pred[j] = i; }
    if (d[j] < best) { best = d[j]; best_j = j; }
  }
}

template <typename T>
class Solver {
 public:
  using Index = typename Lanes<T>::Index;

  Solver(const T* cost, int64_t n, int64_t m)
      : c_(cost), n_(n), m_(m), v_(m, T(0)), d_(m), pred_(m), x_(n, -1), y_(m, -1) {}

  // warm: square only; start from the column duals in v (skips column reduction).
  Status run(int64_t* col_of_row, T* v_inout = nullptr) {
    std::vector<int64_t> free_rows;
    if (v_inout != nullptr) {
      std::copy(v_inout, v_inout + m_, v_.begin());
      for (int64_t i = 0; i < n_; ++i) free_rows.push_back(i);
      augmenting_row_reduction(free_rows);
      augmenting_row_reduction(free_rows);
    } else if (n_ == m_) {
      if (!column_reduction(free_rows)) return Status::Infeasible;
      augmenting_row_reduction(free_rows);
      augmenting_row_reduction(free_rows);
    } else {
      greedy_rows(free_rows);
    }
    for (int64_t j = 0; j < m_; ++j)
      if (y_[j] < 0) free_cols_.push_back(j);
    for (int64_t f : free_rows)
      if (!augment(f)) return Status::Infeasible;
    for (int64_t i = 0; i < n_; ++i) col_of_row[i] = x_[i];
    if (v_inout != nullptr) std::copy(v_.begin(), v_.end(), v_inout);
    return Status::Ok;
  }

 private:
  const T* row(int64_t i) const { return c_ + i * m_; }

  // Column reduction (v = column minima) with reduction transfer. Square only.
  bool column_reduction(std::vector<int64_t>& free_rows) {
    using L = Lanes<T>;
    using Vec = typename L::Vec;
    using IVec = typename L::IVec;
    constexpr int W = sizeof(Vec) / sizeof(T);
    const int64_t n = n_;
    std::vector<Index> arg(n, 0);
    std::fill(v_.begin(), v_.end(), kInf<T>);
    for (int64_t i = 0; i < n; ++i) {
      const T* r = row(i);
      const IVec iv = splat<IVec>(Index(i));
      int64_t j = 0;
      for (; j + W <= n; j += W) {
        Vec cv = load<Vec>(r + j), vv = load<Vec>(v_.data() + j);
        auto lt = cv < vv;
        store(v_.data() + j, lt ? cv : vv);
        store(arg.data() + j, lt ? iv : load<IVec>(arg.data() + j));
      }
      for (; j < n; ++j)
        if (r[j] < v_[j]) { v_[j] = r[j]; arg[j] = Index(i); }
      // Among tied rows, a column prefers its own index: a constant matrix gives the identity.
      if (r[i] == v_[i]) arg[i] = Index(i);
    }
    for (int64_t j = 0; j < n; ++j)
      if (v_[j] == kInf<T>) return false;  // a column with every entry forbidden
    std::vector<int> matches(n, 0);
    for (int64_t j = n - 1; j >= 0; --j) {
      int64_t i = arg[j];
      if (matches[i]++ == 0) {
        x_[i] = j; y_[j] = i;
      } else if (v_[j] < v_[x_[i]]) {  // keep the cheaper of the row's columns
        int64_t j1 = x_[i];
        x_[i] = j; y_[j] = i; y_[j1] = -1;
      }
    }
    // Reduction transfer: move each singly matched row's slack onto its column.
    for (int64_t i = 0; i < n; ++i) {
      if (matches[i] == 0) {
        free_rows.push_back(i);
      } else if (matches[i] == 1) {
        int64_t j1 = x_[i];
        TwoSmallest<T> t = two_smallest(row(i), v_.data(), n);
        T mu = (t.j1 == j1) ? t.u2 : t.u1;
        if (std::isfinite(mu)) v_[j1] -= mu - (row(i)[j1] - v_[j1]);
      }
    }
    return true;
  }

  // Augmenting row reduction: cheap alternating-path moves for free rows.
  void augmenting_row_reduction(std::vector<int64_t>& free_rows) {
    const int64_t n = n_;
    int64_t k = 0, todo = static_cast<int64_t>(free_rows.size()), kept = 0;
    // Bound on the moves: rounding can make the lowering of v stall, and nothing may hang.
    int64_t budget = todo * n + 16;
    while (k < todo) {
      int64_t i = free_rows[k++];
      TwoSmallest<T> t = two_smallest(row(i), v_.data(), n);
      if (!std::isfinite(t.u1)) { free_rows[kept++] = i; continue; }  // Dijkstra decides
      int64_t j1 = t.j1, i0 = y_[j1];
      bool lowers = t.u1 < t.u2 && std::isfinite(t.u2);
      if (lowers) {
        v_[j1] -= t.u2 - t.u1;
      } else if (i0 >= 0 && t.j2 >= 0 && t.u1 == t.u2) {
        j1 = t.j2; i0 = y_[j1];
      }
      if (i0 >= 0) x_[i0] = -1;
      x_[i] = j1; y_[j1] = i;
      if (i0 >= 0) {
        if (lowers && --budget > 0) free_rows[--k] = i0;  // try the displaced row at once
        else free_rows[kept++] = i0;
      }
    }
    free_rows.resize(kept);
  }

  // Wide problems: each row takes its cheapest column if still free (v stays 0).
  void greedy_rows(std::vector<int64_t>& free_rows) {
    for (int64_t i = 0; i < n_; ++i) {
      TwoSmallest<T> t = two_smallest(row(i), v_.data(), m_);
      if (std::isfinite(t.u1) && y_[t.j1] < 0) { x_[i] = t.j1; y_[t.j1] = i; }
      else free_rows.push_back(i);
    }
  }

  // Shortest augmenting path from free row f (Dijkstra on reduced costs), then the
  // dual update of the columns it finished and the augmentation along the path.
  bool augment(int64_t f) {
    const int64_t m = m_;
    std::fill(d_.begin(), d_.end(), kInf<T>);
    done_.clear();
    T best;
    int64_t j;
    relax(row(f), v_.data(), d_.data(), pred_.data(), Index(f), T(0), m, best, j);
    for (;;) {
      if (j < 0 || !(best < kInf<T>)) {  // nothing reachable: restore v and give up
        for (const Done& s : done_) v_[s.j] = s.v;
        return false;
      }
      if (y_[j] >= 0 && free_cols_.size() <= 64) {
        // Among equally short paths, end at a free column when one exists (fewer steps on ties).
        for (int64_t jf : free_cols_)
          if (d_[jf] == best) { j = jf; break; }
      }
      if (y_[j] < 0) break;
      int64_t i = y_[j];
      T h = row(i)[j] - v_[j] - best;
      done_.push_back({j, v_[j], best});
      v_[j] = -kInf<T>;
      d_[j] = kInf<T>;
      relax(row(i), v_.data(), d_.data(), pred_.data(), Index(i), h, m, best, j);
    }
    const int64_t sink = j;
    const T dist = best;
    for (const Done& s : done_) v_[s.j] = s.v + (s.d - dist);
    // Erase in place, keeping the list increasing so ties go to the lowest free column.
    for (size_t k = 0; k < free_cols_.size(); ++k)
      if (free_cols_[k] == sink) { free_cols_.erase(free_cols_.begin() + k); break; }
    for (;;) {
      int64_t i = pred_[j];
      y_[j] = i;
      int64_t prev = x_[i];
      x_[i] = j;
      if (i == f) break;
      j = prev;
    }
    return true;
  }

  struct Done { int64_t j; T v; T d; };

  const T* c_;
  int64_t n_, m_;
  std::vector<T> v_, d_;
  std::vector<Index> pred_;
  std::vector<int64_t> x_, y_, free_cols_;
  std::vector<Done> done_;
};

template <typename T>
Status solve(const T* cost, int64_t n, int64_t m, int64_t* col_of_row, T* v_inout = nullptr) {
  if (n == 0) return Status::Ok;
  Solver<T> solver(cost, n, m);
  return solver.run(col_of_row, v_inout);
}

}  // namespace

Status solve_dense(const double* cost, int64_t n, int64_t m, int64_t* col_of_row) {
  return solve(cost, n, m, col_of_row);
}
Status solve_dense(const float* cost, int64_t n, int64_t m, int64_t* col_of_row) {
  return solve(cost, n, m, col_of_row);
}
Status solve_square_warm(const double* cost, int64_t n, double* v, int64_t* col_of_row) {
  return solve(cost, n, n, col_of_row, v);
}
Status solve_square_warm(const float* cost, int64_t n, float* v, int64_t* col_of_row) {
  return solve(cost, n, n, col_of_row, v);
}

}  // namespace pyperm::cpu::PYPERM_ISA
