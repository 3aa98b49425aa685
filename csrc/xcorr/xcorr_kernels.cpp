// The cross-correlation CPU loops (declared in xcorr_kernels.h), compiled once per
// instruction set with -DPYPERM_ISA=<namespace> and that ISA's flags. Everything here has
// internal linkage or lives in pyperm::cpu::PYPERM_ISA, so the variants never mix.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "xcorr/xcorr_kernels.h"

#ifndef PYPERM_ISA
#error "compile this file with -DPYPERM_ISA=<namespace>"
#endif

namespace pyperm::cpu::PYPERM_ISA {
namespace {

// Pointer arguments (not struct fields) so that __restrict reaches the vectoriser.
template <typename T>
inline void tile_moments_body(const T* __restrict x, T* __restrict out, int64_t cols, int64_t r0,
                                            int64_t r1, int64_t w, const double* __restrict shift,
                                            double* __restrict sum, double* __restrict sq, double* __restrict mn,
                                            double* __restrict mx) {
  for (int64_t c = 0; c < w; ++c) {
    sum[c] = sq[c] = 0.0;
    mn[c] = std::numeric_limits<double>::infinity();
    mx[c] = -std::numeric_limits<double>::infinity();
  }
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict row = x + r * cols;
    T* __restrict dst = out + r * cols;
    for (int64_t c = 0; c < w; ++c) {
      const double v = static_cast<double>(row[c]);
      const T d = static_cast<T>(v - shift[c]);
      dst[c] = d;
      const double e = static_cast<double>(d);
      sum[c] += e;
      sq[c] += e * e;
      // `v < m ? v : m` is exactly x86 min/max semantics, so it vectorises without
      // -ffast-math. NaN slips past both; the sums catch it.
      mn[c] = v < mn[c] ? v : mn[c];
      mx[c] = v > mx[c] ? v : mx[c];
    }
  }
}

template <typename TC, typename TG>
inline void merge_rows_body(TC* __restrict c, const TG* __restrict g, int64_t i0, int64_t i1,
                                          int64_t n, bool fresh, const double* __restrict p,
                                          const double* __restrict q, const double* __restrict u,
                                          const double* __restrict v) {
  for (int64_t i = i0; i < i1; ++i) {
    TC* __restrict crow = c + i * n;
    const TG* __restrict grow = g + i * n;
    const double pi = p[i], ui = u[i];
    if (fresh) {
      // The accumulator is empty: write without reading it.
      for (int64_t j = 0; j < n; ++j)
        crow[j] = static_cast<TC>(static_cast<double>(grow[j]) + pi * q[j] + ui * v[j]);
    } else {
      for (int64_t j = 0; j < n; ++j)
        crow[j] = static_cast<TC>(static_cast<double>(crow[j]) + static_cast<double>(grow[j]) + pi * q[j] +
                                  ui * v[j]);
    }
  }
}

template <typename T>
inline void scale_rows_body(const T* __restrict src, T* __restrict out, int64_t i0, int64_t i1,
                                          int64_t n, const double* __restrict rs, const double* __restrict cs,
                                          const double* __restrict ra, const double* __restrict ca, bool clip) {
  for (int64_t i = i0; i < i1; ++i) {
    const T* __restrict s = src + i * n;
    T* __restrict o = out + i * n;
    const double r = rs[i], add = ra ? ra[i] : 0.0;
    if (ca) {
      for (int64_t j = 0; j < n; ++j) o[j] = static_cast<T>(r * static_cast<double>(s[j]) * cs[j] + add * ca[j]);
    } else {
      for (int64_t j = 0; j < n; ++j) o[j] = static_cast<T>(r * static_cast<double>(s[j]) * cs[j]);
    }
    if (clip) {
      // Rounding can push |r| of (nearly) collinear channels past 1; numpy.corrcoef clips too.
      for (int64_t j = 0; j < n; ++j) o[j] = std::min(T(1), std::max(T(-1), o[j]));
    }
  }
}

}  // namespace

void tile_moments(const TileArgs<float>& a) {
  tile_moments_body(a.x + a.c0, a.out + a.c0, a.cols, a.r0, a.r1, a.c1 - a.c0, a.shift, a.sum, a.sq, a.mn, a.mx);
}
void tile_moments(const TileArgs<double>& a) {
  tile_moments_body(a.x + a.c0, a.out + a.c0, a.cols, a.r0, a.r1, a.c1 - a.c0, a.shift, a.sum, a.sq, a.mn, a.mx);
}

template <typename TC, typename TG>
void merge_rows_of(const MergeArgs<TC, TG>& a) {
  merge_rows_body(a.c, a.g, a.i0, a.i1, a.dim_b, a.fresh, a.p, a.q, a.u, a.v);
}
void merge_rows(const MergeArgs<double, double>& a) { merge_rows_of(a); }
void merge_rows(const MergeArgs<double, float>& a) { merge_rows_of(a); }
void merge_rows(const MergeArgs<float, double>& a) { merge_rows_of(a); }
void merge_rows(const MergeArgs<float, float>& a) { merge_rows_of(a); }

void scale_rows(const ScaleArgs<float>& a) {
  scale_rows_body(a.src, a.out, a.i0, a.i1, a.cols, a.rs, a.cs, a.ra, a.ca, a.clip);
}
void scale_rows(const ScaleArgs<double>& a) {
  scale_rows_body(a.src, a.out, a.i0, a.i1, a.cols, a.rs, a.cs, a.ra, a.ca, a.clip);
}

}  // namespace pyperm::cpu::PYPERM_ISA
