#include "lap/incremental_assignment.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace pyperm::cpu {
namespace {

template <typename T> constexpr T kInf = std::numeric_limits<T>::infinity();

// The two O(n) scans, written once with GCC vector extensions of B bytes and compiled
// three times below (SSE2, AVX2, AVX-512) through target attributes, so this file needs no
// special flags and the choice is made at run time from the Isa.

// One Dijkstra step from row r (reached at offset h): d[k] = min(d[k], r[k] - v[k] - h),
// pred[k] = i where it improved. Finished columns carry v = -inf, so their candidate is
// +inf; their d is +inf too, so they never win. Returns the smallest d and where it is:
// a free column (free[k] all ones) when one is as near, since the path can end there (on
// tied costs that saves most of the search), else the lowest such k.
template <typename T, typename I, int B>
__attribute__((always_inline)) inline void relax_impl(const T* r, const T* v, T* d, I* pred, const I* free, I i, T h,
                                                      int64_t n, T* best_out, int64_t* best_j_out) {
  typedef T Vec __attribute__((vector_size(B)));
  typedef I IVec __attribute__((vector_size(B)));
  constexpr int W = B / sizeof(T);
  const Vec hv = Vec{} + h;
  const IVec iv = IVec{} + i;
  const Vec inf = Vec{} + kInf<T>;
  Vec bv = inf, fv = inf;  // nearest of all columns, and of the free ones
  IVec bi = IVec{} - 1, fi = bi;
  IVec idx;
  for (int k = 0; k < W; ++k) idx[k] = I(k);
  int64_t k = 0;
  for (; k + W <= n; k += W) {
    Vec rv, vv, dv;
    IVec pv, freev;
    std::memcpy(&rv, r + k, B);
    std::memcpy(&vv, v + k, B);
    std::memcpy(&dv, d + k, B);
    std::memcpy(&pv, pred + k, B);
    std::memcpy(&freev, free + k, B);
    const Vec cand = rv - vv - hv;
    const auto better = cand < dv;
    dv = better ? cand : dv;
    pv = better ? iv : pv;
    std::memcpy(d + k, &dv, B);
    std::memcpy(pred + k, &pv, B);
    const auto win = dv < bv;
    bv = win ? dv : bv;
    bi = win ? idx : bi;
    const Vec df = freev ? dv : inf;
    const auto fwin = df < fv;
    fv = fwin ? df : fv;
    fi = fwin ? idx : fi;
    idx += I(W);
  }
  T best = kInf<T>, fbest = kInf<T>;
  int64_t best_j = -1, fbest_j = -1;
  for (int l = 0; l < W; ++l) {
    if (bi[l] >= 0 && (bv[l] < best || (bv[l] == best && bi[l] < best_j))) { best = bv[l]; best_j = bi[l]; }
    if (fi[l] >= 0 && (fv[l] < fbest || (fv[l] == fbest && fi[l] < fbest_j))) { fbest = fv[l]; fbest_j = fi[l]; }
  }
  for (; k < n; ++k) {
    const T cand = r[k] - v[k] - h;
    if (cand < d[k]) { d[k] = cand; pred[k] = i; }
    if (d[k] < best) { best = d[k]; best_j = k; }
    if (free[k] && d[k] < fbest) { fbest = d[k]; fbest_j = k; }
  }
  *best_out = best;
  *best_j_out = fbest_j >= 0 && fbest == best ? fbest_j : best_j;
}

// min_k r[k] - v[k].
template <typename T, int B>
__attribute__((always_inline)) inline T min_reduced_impl(const T* r, const T* v, int64_t n) {
  typedef T Vec __attribute__((vector_size(B)));
  constexpr int W = B / sizeof(T);
  Vec m = Vec{} + kInf<T>;
  int64_t k = 0;
  for (; k + W <= n; k += W) {
    Vec rv, vv;
    std::memcpy(&rv, r + k, B);
    std::memcpy(&vv, v + k, B);
    const Vec red = rv - vv;
    m = red < m ? red : m;
  }
  T best = kInf<T>;
  for (int l = 0; l < W; ++l) best = m[l] < best ? m[l] : best;
  for (; k < n; ++k) best = (r[k] - v[k]) < best ? (r[k] - v[k]) : best;
  return best;
}

// The two smallest r[k] - v[k] (ties: lowest k first) and where they are.
template <typename T>
struct TwoMin {
  T u1, u2;
  int64_t j1, j2;
};

template <typename T, typename I, int B>
__attribute__((always_inline)) inline TwoMin<T> two_min_impl(const T* r, const T* v, int64_t n) {
  typedef T Vec __attribute__((vector_size(B)));
  typedef I IVec __attribute__((vector_size(B)));
  constexpr int W = B / sizeof(T);
  Vec m1 = Vec{} + kInf<T>, m2 = m1;
  IVec i1 = IVec{} - 1, i2 = i1, idx;
  for (int k = 0; k < W; ++k) idx[k] = I(k);
  int64_t k = 0;
  for (; k + W <= n; k += W) {
    Vec rv, vv;
    std::memcpy(&rv, r + k, B);
    std::memcpy(&vv, v + k, B);
    const Vec red = rv - vv;
    const auto lt1 = red < m1;
    const auto lt2 = red < m2;
    // A new smallest pushes the old one to second place (per lane).
    m2 = lt1 ? m1 : (lt2 ? red : m2);
    i2 = lt1 ? i1 : (lt2 ? idx : i2);
    m1 = lt1 ? red : m1;
    i1 = lt1 ? idx : i1;
    idx += I(W);
  }
  TwoMin<T> t{kInf<T>, kInf<T>, -1, -1};
  auto offer = [&t](T u, int64_t j) {
    if (j < 0) return;
    if (u < t.u1 || (u == t.u1 && j < t.j1)) {
      t.u2 = t.u1; t.j2 = t.j1; t.u1 = u; t.j1 = j;
    } else if (u < t.u2 || (u == t.u2 && (t.j2 < 0 || j < t.j2))) {
      t.u2 = u; t.j2 = j;
    }
  };
  for (int l = 0; l < W; ++l) { offer(m1[l], i1[l]); offer(m2[l], i2[l]); }
  for (; k < n; ++k) offer(r[k] - v[k], k);
  return t;
}

#define PYPERM_IA_KERNELS(SUFFIX, ATTR, BYTES)                                                        \
  template <typename T, typename I>                                                                 \
  ATTR void relax_##SUFFIX(const T* r, const T* v, T* d, I* pred, const I* free, I i, T h, int64_t n, \
                           T* best, int64_t* best_j) {                                              \
    relax_impl<T, I, BYTES>(r, v, d, pred, free, i, h, n, best, best_j);                            \
  }                                                                                                 \
  template <typename T>                                                                             \
  ATTR T min_reduced_##SUFFIX(const T* r, const T* v, int64_t n) {                                  \
    return min_reduced_impl<T, BYTES>(r, v, n);                                                     \
  }                                                                                                 \
  template <typename T, typename I>                                                                 \
  ATTR TwoMin<T> two_min_##SUFFIX(const T* r, const T* v, int64_t n) {                              \
    return two_min_impl<T, I, BYTES>(r, v, n);                                                      \
  }

PYPERM_IA_KERNELS(baseline, , 16)
#if defined(PYPERM_X86)
PYPERM_IA_KERNELS(avx2, __attribute__((target("avx2,fma"))), 32)
PYPERM_IA_KERNELS(avx512, __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma"))), 64)
#endif
#undef PYPERM_IA_KERNELS

template <typename T, typename I>
void relax(Isa isa, const T* r, const T* v, T* d, I* pred, const I* free, I i, T h, int64_t n, T* best,
           int64_t* best_j) {
#if defined(PYPERM_X86)
  if (isa == Isa::Avx512) return relax_avx512(r, v, d, pred, free, i, h, n, best, best_j);
  if (isa == Isa::Avx2) return relax_avx2(r, v, d, pred, free, i, h, n, best, best_j);
#endif
  (void)isa;
  relax_baseline(r, v, d, pred, free, i, h, n, best, best_j);
}

template <typename T, typename I>
TwoMin<T> two_min(Isa isa, const T* r, const T* v, int64_t n) {
#if defined(PYPERM_X86)
  if (isa == Isa::Avx512) return two_min_avx512<T, I>(r, v, n);
  if (isa == Isa::Avx2) return two_min_avx2<T, I>(r, v, n);
#endif
  (void)isa;
  return two_min_baseline<T, I>(r, v, n);
}

template <typename T>
T min_reduced(Isa isa, const T* r, const T* v, int64_t n) {
#if defined(PYPERM_X86)
  if (isa == Isa::Avx512) return min_reduced_avx512(r, v, n);
  if (isa == Isa::Avx2) return min_reduced_avx2(r, v, n);
#endif
  (void)isa;
  return min_reduced_baseline(r, v, n);
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
