// The scans of IncrementalAssignment (declared in incremental_scans.h), written once with
// GCC vector extensions as wide as the instruction set this file is compiled for
// (-DPYPERM_ISA=<namespace> and that ISA's flags). Everything here has internal linkage or
// lives in pyperm::cpu::PYPERM_ISA, so the variants never mix.
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/isa_vector.h"
#include "lap/incremental_scans.h"


namespace pyperm::cpu::PYPERM_ISA {
namespace {

template <typename T> constexpr T kInf = std::numeric_limits<T>::infinity();

// One Dijkstra step from row r (reached at offset h): d[k] = min(d[k], r[k] - v[k] - h),
// pred[k] = i where it improved. Finished columns carry v = -inf, so their candidate is
// +inf; their d is +inf too, so they never win. Returns the smallest d and where it is:
// a free column (free[k] all ones) when one is as near, since the path can end there (on
// tied costs that saves most of the search), else the lowest such k.
template <typename T, typename I, int B>
inline void relax_impl(const T* r, const T* v, T* d, I* pred, const I* free, I i, T h,
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
inline T min_reduced_impl(const T* r, const T* v, int64_t n) {
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

template <typename T, typename I, int B>
inline TwoMin<T> two_min_impl(const T* r, const T* v, int64_t n) {
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

}  // namespace

void relax(const double* r, const double* v, double* d, int64_t* pred, const int64_t* free, int64_t i, double h,
           int64_t n, double* best, int64_t* best_j) {
  relax_impl<double, int64_t, kVecBytes>(r, v, d, pred, free, i, h, n, best, best_j);
}
void relax(const float* r, const float* v, float* d, int32_t* pred, const int32_t* free, int32_t i, float h,
           int64_t n, float* best, int64_t* best_j) {
  relax_impl<float, int32_t, kVecBytes>(r, v, d, pred, free, i, h, n, best, best_j);
}
double min_reduced(const double* r, const double* v, int64_t n) { return min_reduced_impl<double, kVecBytes>(r, v, n); }
float min_reduced(const float* r, const float* v, int64_t n) { return min_reduced_impl<float, kVecBytes>(r, v, n); }
TwoMin<double> two_min(const double* r, const double* v, int64_t n) {
  return two_min_impl<double, int64_t, kVecBytes>(r, v, n);
}
TwoMin<float> two_min(const float* r, const float* v, int64_t n) {
  return two_min_impl<float, int32_t, kVecBytes>(r, v, n);
}

}  // namespace pyperm::cpu::PYPERM_ISA
