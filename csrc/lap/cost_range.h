// The range of costs the assignment solvers' arithmetic can take, and how larger ones are
// brought into it.
//
// The solvers compute reduced costs c - v, path lengths (sums of reduced costs along an
// alternating path) and dual updates. With finite costs in [-M, M], column duals stay within
// about (2n + 3) M of the costs (each is bounded through an alternating path of at most n
// rows to a column whose dual never moved), and path lengths within twice that, so every
// intermediate fits when M <= max / (8 (n + m + 2)). Beyond that (costs within a few orders of
// magnitude of the type's largest finite value) a dual update such as v -= u2 - u1 can
// overflow to -inf and the solver would go wrong. Such problems are solved in a wider form
// instead: float costs in double (whose range dwarfs any sum of floats), double costs
// multiplied by a power of two, which is exact for every entry that stays a normal number
// (only entries about 2^-1000 below the largest lose bits, far below what the solver can
// tell apart beside it).
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace pyperm::cpu {

// The largest magnitude a finite cost of a problem with n rows and m columns may have for the
// solvers to compute in T directly.
template <typename T>
inline T largest_direct_cost(int64_t n, int64_t m) {
  return std::numeric_limits<T>::max() / (T(8) * static_cast<T>(n + m + 2));
}

// Whether some finite entry of x[0, count) lies beyond +-bound (NaN and infinities do not
// count: the solvers report or skip those themselves). One branch-free pass; SSE2 on x86-64
// (GCC leaves the plain loop scalar for double, and turns the vector extensions' 64-bit
// compare masks into a branch per lane), the plain loop elsewhere.
template <typename T>
inline bool any_finite_beyond_scalar(const T* x, int64_t count, T bound) {
  const T inf = std::numeric_limits<T>::infinity();
  int beyond = 0;
  for (int64_t k = 0; k < count; ++k) {
    const T a = std::fabs(x[k]);
    beyond |= (a > bound) & (a != inf);
  }
  return beyond != 0;
}

#if defined(__SSE2__)
// |x| > bound and |x| < inf, lane by lane (NaN fails both): for x - x + x, which is x where x
// is finite and NaN where it is not, either comparison of +-bound does.
inline bool any_finite_beyond(const double* x, int64_t count, double bound) {
  const __m128d hi = _mm_set1_pd(bound), lo = _mm_set1_pd(-bound);
  __m128d beyond = _mm_setzero_pd();
  int64_t k = 0;
  for (; k + 2 <= count; k += 2) {
    const __m128d v = _mm_loadu_pd(x + k);
    const __m128d finite = _mm_add_pd(_mm_sub_pd(v, v), v);
    beyond = _mm_or_pd(beyond, _mm_or_pd(_mm_cmpgt_pd(finite, hi), _mm_cmplt_pd(finite, lo)));
  }
  return _mm_movemask_pd(beyond) != 0 || any_finite_beyond_scalar(x + k, count - k, bound);
}

inline bool any_finite_beyond(const float* x, int64_t count, float bound) {
  const __m128 hi = _mm_set1_ps(bound), lo = _mm_set1_ps(-bound);
  __m128 beyond = _mm_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= count; k += 4) {
    const __m128 v = _mm_loadu_ps(x + k);
    const __m128 finite = _mm_add_ps(_mm_sub_ps(v, v), v);
    beyond = _mm_or_ps(beyond, _mm_or_ps(_mm_cmpgt_ps(finite, hi), _mm_cmplt_ps(finite, lo)));
  }
  return _mm_movemask_ps(beyond) != 0 || any_finite_beyond_scalar(x + k, count - k, bound);
}
#else
template <typename T>
inline bool any_finite_beyond(const T* x, int64_t count, T bound) {
  return any_finite_beyond_scalar(x, count, bound);
}
#endif

// The largest finite magnitude of x[0, count) (0 if none).
template <typename T>
inline T largest_finite_magnitude(const T* x, int64_t count) {
  const T inf = std::numeric_limits<T>::infinity();
  T big = T(0);
  for (int64_t k = 0; k < count; ++k) {
    const T a = std::fabs(x[k]);
    if (a != inf && a > big) big = a;
  }
  return big;
}

// A power of two s with largest * s <= bound (largest > bound > 0, both finite).
inline double power_of_two_scale(double largest, double bound) {
  int e_largest = 0, e_bound = 0;
  std::frexp(largest, &e_largest);  // largest < 2^e_largest
  std::frexp(bound, &e_bound);      // bound >= 2^(e_bound - 1)
  return std::ldexp(1.0, e_bound - 1 - e_largest);
}

}  // namespace pyperm::cpu
