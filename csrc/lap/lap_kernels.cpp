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
//
// Large dense problems are bound by memory traffic: each O(m) scan streams a cost row
// from DRAM. The solver avoids most scans with one invariant: the column duals only
// ever decrease (column reduction sets them, every later step lowers them), so the
// reduced costs c[i][j] - v[j] only ever increase. A row scanned once keeps its K
// smallest reduced-cost columns and the K-th value as a bound that every other column
// of the row stays above for the rest of the solve. Augmenting row reduction then
// looks at K entries instead of m, and the shortest-path search relaxes a row's cached
// columns at once and its whole row only when the search distance reaches the row's
// bound (often never). The search stays an exact Dijkstra.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <queue>
#include <limits>
#include <vector>

#include "lap/lap_kernels.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

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


// True if any lane of a comparison mask is set: one test instruction per ISA.
template <typename M> inline bool any(const M& mask) {
#if defined(__AVX512F__)
  static_assert(sizeof(M) == 64, "mask width");
  __m512i x = reinterpret_cast<__m512i>(mask);
  return _mm512_test_epi64_mask(x, x) != 0;
#elif defined(__AVX2__)
  static_assert(sizeof(M) == 32, "mask width");
  __m256i x = reinterpret_cast<__m256i>(mask);
  return !_mm256_testz_si256(x, x);
#elif defined(__SSE2__)
  static_assert(sizeof(M) == 16, "mask width");
  return _mm_movemask_epi8(reinterpret_cast<__m128i>(mask)) != 0;
#else
  for (int k = 0; k < int(sizeof(M) / sizeof(mask[0])); ++k)
    if (mask[k]) return true;
  return false;
#endif
}


// Columns cached per row (see the file comment). 8 measured faster than 4, 16 and 32.
constexpr int kCache = 8;

// The columns of the kCache smallest values of row[j] - v[j] (ascending; ties: lowest j)
// into cols, their costs row[j] into costs, returning how many are finite. *bound receives a value that every
// column left out is at least: the largest cached value, or +inf when the row has
// no other finite entries.
template <typename T, typename Index>
int k_smallest(const T* row, const T* v, int64_t m, Index* cols, T* costs, T* bound) {
  T vals[kCache];
  using Vec = typename Lanes<T>::Vec;
  constexpr int W = sizeof(Vec) / sizeof(T);
  int count = 0;
  T worst = kInf<T>;  // the value a newcomer must beat
  auto insert = [&](T r, int64_t j) {
    int p = count < kCache ? count++ : kCache - 1;
    while (p > 0 && vals[p - 1] > r) { vals[p] = vals[p - 1]; cols[p] = cols[p - 1]; --p; }
    vals[p] = r; cols[p] = Index(j);
    if (count == kCache) worst = vals[kCache - 1];
  };
  int64_t j = 0;
  for (; j + W <= m; j += W) {
    Vec r = load<Vec>(row + j) - load<Vec>(v + j);
    auto lt = r < splat<Vec>(worst);
    if (any(lt))
      for (int k = 0; k < W; ++k)
        if (r[k] < worst) insert(r[k], j + k);
  }
  for (; j < m; ++j) {
    T r = row[j] - v[j];
    if (r < worst) insert(r, j);
  }
  // Left-out columns are >= worst: the kCache-th value, or +inf (all finite ones cached).
  *bound = count == kCache ? worst : kInf<T>;
  for (int k = 0; k < count; ++k) costs[k] = row[cols[k]];
  return count;
}

template <typename T>
struct Candidate {
  T d;
  int64_t j;
  // std heaps are max-heaps: "less" here means "farther", so the top is the nearest
  // column, and the lowest index among equally near ones.
  bool operator<(const Candidate& o) const { return d > o.d || (d == o.d && j > o.j); }
};

// One full Dijkstra step: d[k] = min(d[k], row[k] - v[k] - h), pred[k] = i where it
// improved, and each improved column appended to `improved`.
// Finished columns carry v = -inf and d = +inf, so they neither change nor win.
template <typename T>
void relax(const T* row, const T* v, T* d, typename Lanes<T>::Index* pred,
           typename Lanes<T>::Index i, T h, int64_t m, std::vector<Candidate<T>>& improved) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  using IVec = typename L::IVec;
  constexpr int W = sizeof(Vec) / sizeof(T);
  const Vec hv = splat<Vec>(h);
  const IVec iv = splat<IVec>(i);
  int64_t j = 0;
  for (; j + W <= m; j += W) {
    Vec cred = load<Vec>(row + j) - load<Vec>(v + j) - hv;
    Vec dj = load<Vec>(d + j);
    auto better = cred < dj;
    if (any(better)) {  // late in a search most blocks improve nothing: skip the stores
      store(d + j, better ? cred : dj);
      store(pred + j, better ? iv : load<IVec>(pred + j));
      for (int k = 0; k < W; ++k)
        if (better[k]) improved.push_back({cred[k], j + k});
    }
  }
  for (; j < m; ++j) {
    T cred = row[j] - v[j] - h;
    if (cred < d[j]) { d[j] = cred; pred[j] = i; improved.push_back({cred, j}); }
  }
}

template <typename T>
struct TwoSmallest { T u1, u2; int64_t j1, j2; };

template <typename T>
class Solver {
 public:
  using Index = typename Lanes<T>::Index;

  Solver(const T* cost, int64_t n, int64_t m)
      : c_(cost), n_(n), m_(m), v_(m, T(0)), vscan_(m), d_(m), pred_(m), x_(n, -1), y_(m, -1),
        cache_cols_(n * kCache), cache_cost_(n * kCache), cache_count_(n, -1), cache_bound_(n) {}

  // v_inout: square only; start from these column duals (skips column reduction) and
  // return the final ones.
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
    std::copy(v_.begin(), v_.end(), vscan_.begin());
    for (int64_t f : free_rows)
      if (!augment(f)) return Status::Infeasible;
    for (int64_t i = 0; i < n_; ++i) col_of_row[i] = x_[i];
    if (v_inout != nullptr) std::copy(v_.begin(), v_.end(), v_inout);
    return Status::Ok;
  }

 private:
  const T* row(int64_t i) const { return c_ + i * m_; }

  // Scans row i in full and caches its smallest reduced-cost columns.
  void build_cache(int64_t i) {
    cache_count_[i] = k_smallest(row(i), v_.data(), m_, &cache_cols_[i * kCache], &cache_cost_[i * kCache],
                                 &cache_bound_[i]);
  }

  // The two smallest reduced costs of row i (ties: lowest column), from its cache when
  // the cache proves them smallest, else from a fresh full scan.
  TwoSmallest<T> two_smallest(int64_t i) {
    for (int attempt = 0;; ++attempt) {
      if (cache_count_[i] < 0 || attempt > 0) build_cache(i);
      TwoSmallest<T> t{kInf<T>, kInf<T>, -1, -1};
      const T* costs = &cache_cost_[i * kCache];
      const Index* cols = &cache_cols_[i * kCache];
      for (int k = 0; k < cache_count_[i]; ++k) {
        int64_t j = cols[k];
        T h = costs[k] - v_[j];
        if (h < t.u1 || (h == t.u1 && j < t.j1)) {
          t.u2 = t.u1; t.j2 = t.j1; t.u1 = h; t.j1 = j;
        } else if (h < t.u2 || (h == t.u2 && j < t.j2)) {
          t.u2 = h; t.j2 = j;
        }
      }
      // Columns outside the cache are >= the bound, so these two are the row's smallest.
      if (t.u2 <= cache_bound_[i] || attempt > 0) return t;
    }
  }

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
        TwoSmallest<T> t = two_smallest(i);
        T mu = (t.j1 == j1) ? t.u2 : t.u1;
        T slack = mu - (row(i)[j1] - v_[j1]);
        if (std::isfinite(slack) && slack > 0) v_[j1] -= slack;  // duals only decrease
      }
    }
    return true;
  }

  // Augmenting row reduction: cheap alternating-path moves for free rows.
  void augmenting_row_reduction(std::vector<int64_t>& free_rows) {
    int64_t k = 0, todo = static_cast<int64_t>(free_rows.size()), kept = 0;
    // Bound on immediate retries: long displacement chains cost more than the shortest
    // paths they replace, and rounding can make the lowering of v stall; nothing may hang.
    // Measured on uniform costs, n = 1024-4096: 16n beats 2n by 1.5-2x once rows are cached.
    int64_t budget = 16 * n_ + 16;
    while (k < todo) {
      int64_t i = free_rows[k++];
      TwoSmallest<T> t = two_smallest(i);
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
      TwoSmallest<T> t = two_smallest(i);
      if (std::isfinite(t.u1) && y_[t.j1] < 0) { x_[i] = t.j1; y_[t.j1] = i; }
      else free_rows.push_back(i);
    }
  }

  // Adds row i (reached at offset h) to the search: its cached columns now, the rest of
  // the row once the search distance reaches bound - h.
  void expand(int64_t i, T h) {
    const int count = cache_count_[i];
    if (count < 0) {  // never scanned: relax the whole row
      relax_full(i, h);
      return;
    }
    const T* costs = &cache_cost_[i * kCache];
    const Index* cols = &cache_cols_[i * kCache];
    for (int k = 0; k < count; ++k) {
      int64_t j = cols[k];
      T cred = costs[k] - vscan_[j] - h;
      if (cred < d_[j]) { d_[j] = cred; pred_[j] = Index(i); push({cred, j}); }
    }
    if (cache_bound_[i] < kInf<T>) pending_.push({cache_bound_[i] - h, i, h});
  }

  void relax_full(int64_t i, T h) {
    improved_.clear();
    relax(row(i), vscan_.data(), d_.data(), pred_.data(), Index(i), h, m_, improved_);
    for (const Candidate<T>& c : improved_) push(c);
  }

  void push(Candidate<T> c) {
    heap_.push_back(c);
    std::push_heap(heap_.begin(), heap_.end());
  }

  // The nearest unfinished column (best_j = -1 if none), dropping stale heap entries:
  // a column's entry is current while it is unfinished and its d still equals it.
  void nearest(T& best, int64_t& best_j) {
    while (!heap_.empty()) {
      const Candidate<T>& top = heap_.front();
      if (top.d == d_[top.j]) { best = top.d; best_j = top.j; return; }
      std::pop_heap(heap_.begin(), heap_.end());
      heap_.pop_back();
    }
    best = kInf<T>;
    best_j = -1;
  }

  // Shortest augmenting path from free row f (Dijkstra on reduced costs), then the
  // dual update of the columns it finished and the augmentation along the path.
  bool augment(int64_t f) {
    std::fill(d_.begin(), d_.end(), kInf<T>);
    done_.clear();
    heap_.clear();
    pending_ = {};
    expand(f, T(0));
    T best;
    int64_t j;
    for (;;) {
      nearest(best, j);
      // Rows whose uncached columns could be as close as the best candidate are scanned in full.
      while (!pending_.empty() && !(best < pending_.top().limit)) {
        Pending p = pending_.top();
        pending_.pop();
        relax_full(p.i, p.h);
        nearest(best, j);
      }
      if (j < 0 || !(best < kInf<T>)) {  // nothing reachable: restore and give up
        for (const Done& s : done_) vscan_[s.j] = v_[s.j];
        return false;
      }
      if (y_[j] >= 0 && free_cols_.size() <= 64) {
        // Among equally short paths, end at a free column when one exists (fewer steps on ties).
        for (int64_t jf : free_cols_)
          if (d_[jf] == best) { j = jf; break; }
      }
      if (y_[j] < 0) break;
      const int64_t i = y_[j];
      const T h = row(i)[j] - v_[j] - best;
      done_.push_back({j, best});
      vscan_[j] = -kInf<T>;
      d_[j] = kInf<T>;  // its heap entries are stale from now on
      expand(i, h);
    }
    const int64_t sink = j;
    const T dist = best;
    // Never raise a dual, even by a rounding error: the row caches rely on it.
    for (const Done& s : done_) {
      v_[s.j] += std::min(T(0), s.d - dist);
      vscan_[s.j] = v_[s.j];
    }
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

  struct Done { int64_t j; T d; };
  struct Pending {
    T limit;  // no uncached column of row i is closer than this
    int64_t i;
    T h;
    bool operator<(const Pending& o) const { return limit > o.limit; }  // min-heap
  };

  const T* c_;
  int64_t n_, m_;
  std::vector<T> v_;      // column duals
  std::vector<T> vscan_;  // v_ with the columns finished in the current search set to -inf
  std::vector<T> d_;
  std::vector<Index> pred_;
  std::vector<int64_t> x_, y_, free_cols_;
  std::vector<Index> cache_cols_;  // kCache columns per row
  std::vector<T> cache_cost_;      // and their costs, so searches stay out of the big matrix
  std::vector<int> cache_count_;   // -1: row not scanned yet
  std::vector<T> cache_bound_;
  std::vector<Done> done_;
  std::priority_queue<Pending> pending_;
  std::vector<Candidate<T>> heap_, improved_;
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
