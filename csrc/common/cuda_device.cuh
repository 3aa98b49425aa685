// Device-side building blocks shared by the CUDA kernels: order-preserving keys for
// floating-point atomics, deterministic warp and block reductions, and stream compaction.
// Every reduction here is a minimum under a total order (value, then index), so its result
// does not depend on the order in which threads combine: results are reproducible.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace pyperm::cuda::dev {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
__device__ __forceinline__ T inf() {
  return static_cast<T>(__builtin_huge_val());
}

// Maps a non-NaN float/double to an unsigned integer with the same order, so atomicMin /
// atomicMax on integers give the floating-point extremum (and equal keys mean equal values).
__device__ __forceinline__ uint64_t order_key(float f) {
  uint32_t u = __float_as_uint(f);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return static_cast<uint64_t>(u);
}
__device__ __forceinline__ uint64_t order_key(double d) {
  uint64_t u = static_cast<uint64_t>(__double_as_longlong(d));
  return (u >> 63) ? ~u : (u | (1ull << 63));
}

// ----------------------------------------------------------------------------- argmin
// A value with a 32-bit key that breaks ties (smaller key wins). The empty element is
// (+inf, 0xffffffff), which loses to everything.
//
// NaN comes first: it is below every number, NaNs tie with each other whatever their bits, and
// the key breaks the tie as usual. The order must be total for the result not to depend on the
// order in which lanes combine (with `<` alone a NaN is neither below nor above anything, and
// each lane of a shuffle would keep its own), and the shuffle and the integer-reduction
// versions below must agree. NaN first rather than last: a NaN that reaches a search (a
// reduced cost that overflowed, an unchecked warm-start cost) then wins it, and the search's
// `!(val < infinity)` check stops it with an error, instead of the NaN being passed over and
// a wrong assignment returned.
template <typename T>
struct ArgMin {
  T val;
  uint32_t key;
};

template <typename T>
__device__ __forceinline__ ArgMin<T> argmin_empty() {
  return ArgMin<T>{inf<T>(), 0xffffffffu};
}

template <typename T>
__device__ __forceinline__ bool argmin_less(const ArgMin<T>& a, const ArgMin<T>& b) {
  if (isnan(b.val)) return isnan(a.val) && a.key < b.key;
  // b is a number: a is below it when a < b or a is NaN, which is what !(a >= b) says.
  return !(a.val >= b.val) || (a.val == b.val && a.key < b.key);
}

template <typename T>
__device__ __forceinline__ ArgMin<T> warp_argmin_shuffle(ArgMin<T> p) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    ArgMin<T> o;
    o.val = __shfl_xor_sync(kFullMask, p.val, off);
    o.key = __shfl_xor_sync(kFullMask, p.key, off);
    if (argmin_less(o, p)) p = o;
  }
  return p;  // the same in every lane
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// The same minimum with the warp's integer min-reductions (sm_80 and later): the value as an
// order key, then the smallest tie-breaking key among the lanes that hold the minimum. Adding
// +0 makes -0 into +0 first, so that the two zeros tie as argmin_less has them tie. Every NaN
// gets key 0, below every number's (order_key puts -inf at 0x007fffff..., and only NaN bit
// patterns map lower), so NaNs come first and tie, as argmin_less has them; key 0 maps back
// to the all-ones pattern, a NaN. The value returned is the minimum's (a -0 comes back as +0,
// which compares equal; a NaN as that one NaN).
__device__ __forceinline__ ArgMin<float> warp_argmin_reduce(ArgMin<float> p) {
  const uint32_t k = isnan(p.val) ? 0u : static_cast<uint32_t>(order_key(p.val + 0.0f));
  const uint32_t kmin = __reduce_min_sync(kFullMask, k);
  const uint32_t key = __reduce_min_sync(kFullMask, k == kmin ? p.key : 0xffffffffu);
  const uint32_t bits = (kmin & 0x80000000u) ? (kmin & 0x7fffffffu) : ~kmin;
  return ArgMin<float>{__uint_as_float(bits), key};
}

__device__ __forceinline__ ArgMin<double> warp_argmin_reduce(ArgMin<double> p) {
  const uint64_t k = isnan(p.val) ? 0ull : order_key(p.val + 0.0);
  const uint32_t hi = static_cast<uint32_t>(k >> 32), lo = static_cast<uint32_t>(k);
  const uint32_t hmin = __reduce_min_sync(kFullMask, hi);
  const uint32_t lmin = __reduce_min_sync(kFullMask, hi == hmin ? lo : 0xffffffffu);
  const bool holds = hi == hmin && lo == lmin;
  const uint32_t key = __reduce_min_sync(kFullMask, holds ? p.key : 0xffffffffu);
  const uint64_t kmin = (static_cast<uint64_t>(hmin) << 32) | lmin;
  const uint64_t bits = (kmin >> 63) ? (kmin & ~(1ull << 63)) : ~kmin;
  return ArgMin<double>{__longlong_as_double(static_cast<long long>(bits)), key};
}
#endif

template <typename T>
__device__ __forceinline__ ArgMin<T> warp_argmin(ArgMin<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return warp_argmin_reduce(p);
#else
  return warp_argmin_shuffle(p);
#endif
}

// Block-wide argmin, returned to every thread. `buf` holds 2 x 32 entries in shared memory
// and `parity` is a per-thread counter that every thread advances identically: alternating
// halves lets each reduction use one barrier, because a half is written again only after
// a later barrier that every thread passes once it has read the half.
// Must be called by all threads of the block (uniform control flow).
template <typename T, int NW>
__device__ __forceinline__ ArgMin<T> block_argmin(ArgMin<T> p, ArgMin<T> (*buf)[32], int& parity) {
  p = warp_argmin(p);
  if constexpr (NW == 1) {
    __syncwarp();
    return p;
  } else {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) buf[parity][warp] = p;
    __syncthreads();
    ArgMin<T> q = lane < NW ? buf[parity][lane] : argmin_empty<T>();
    parity ^= 1;
    return warp_argmin(q);
  }
}

// ----------------------------------------------------------------------- two smallest
// The two smallest values with their indices (ties: lower index first); j < 0 marks an
// empty slot, whose value is +inf. Only finite values are ever offered.
template <typename T>
struct TwoMin {
  T u1, u2;
  int32_t j1, j2;
};

template <typename T>
__device__ __forceinline__ TwoMin<T> twomin_empty() {
  return TwoMin<T>{inf<T>(), inf<T>(), -1, -1};
}

// (x, jx) precedes (y, jy): present, and smaller value or equal value and lower index.
template <typename T>
__device__ __forceinline__ bool precedes(T x, int32_t jx, T y, int32_t jy) {
  return jx >= 0 && (jy < 0 || x < y || (x == y && jx < jy));
}

template <typename T>
__device__ __forceinline__ void twomin_offer(TwoMin<T>& t, T h, int32_t j) {
  if (precedes(h, j, t.u1, t.j1)) {
    t.u2 = t.u1;
    t.j2 = t.j1;
    t.u1 = h;
    t.j1 = j;
  } else if (precedes(h, j, t.u2, t.j2)) {
    t.u2 = h;
    t.j2 = j;
  }
}

template <typename T>
__device__ __forceinline__ TwoMin<T> twomin_merge(const TwoMin<T>& a, const TwoMin<T>& b) {
  TwoMin<T> r;
  if (precedes(b.u1, b.j1, a.u1, a.j1)) {
    r.u1 = b.u1;
    r.j1 = b.j1;
    const bool a_first = precedes(a.u1, a.j1, b.u2, b.j2);
    r.u2 = a_first ? a.u1 : b.u2;
    r.j2 = a_first ? a.j1 : b.j2;
  } else {
    r.u1 = a.u1;
    r.j1 = a.j1;
    const bool b_first = precedes(b.u1, b.j1, a.u2, a.j2);
    r.u2 = b_first ? b.u1 : a.u2;
    r.j2 = b_first ? b.j1 : a.j2;
  }
  return r;
}

template <typename T>
__device__ __forceinline__ TwoMin<T> warp_twomin(TwoMin<T> t) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    TwoMin<T> o;
    o.u1 = __shfl_xor_sync(kFullMask, t.u1, off);
    o.u2 = __shfl_xor_sync(kFullMask, t.u2, off);
    o.j1 = __shfl_xor_sync(kFullMask, t.j1, off);
    o.j2 = __shfl_xor_sync(kFullMask, t.j2, off);
    t = twomin_merge(t, o);
  }
  return t;
}

// Block-wide two smallest; the same double-buffer contract as block_argmin.
template <typename T, int NW>
__device__ __forceinline__ TwoMin<T> block_twomin(TwoMin<T> t, TwoMin<T> (*buf)[32], int& parity) {
  t = warp_twomin(t);
  if constexpr (NW == 1) {
    __syncwarp();
    return t;
  } else {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) buf[parity][warp] = t;
    __syncthreads();
    TwoMin<T> q = lane < NW ? buf[parity][lane] : twomin_empty<T>();
    parity ^= 1;
    return warp_twomin(q);
  }
}

// ------------------------------------------------------------------------- reductions
template <typename T>
__device__ __forceinline__ T warp_min(T x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    T o = __shfl_xor_sync(kFullMask, x, off);
    x = o < x ? o : x;
  }
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// ------------------------------------------------------------------------- compaction
// Calls emit(position, i), in increasing order of i, for every i in [0, n) with flag(i)
// true, where position counts the kept indices before i; returns the count to every
// thread. `warp_counts` is a 32-entry shared array. Must be called by the whole block.
template <int NW, typename Flag, typename Emit>
__device__ int block_compact(int n, Flag flag, Emit emit, int* warp_counts) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned below = (1u << lane) - 1u;
  int base = 0;
  for (int i0 = 0; i0 < n; i0 += NW * 32) {
    const int i = i0 + static_cast<int>(threadIdx.x);
    const bool keep = i < n && flag(i);
    const unsigned mask = __ballot_sync(kFullMask, keep);
    if (lane == 0) warp_counts[warp] = __popc(mask);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < NW; ++w) {
      const int c = warp_counts[w];
      before += w < warp ? c : 0;
      total += c;
    }
    if (keep) emit(base + before + __popc(mask & below), i);
    base += total;
    __syncthreads();  // warp_counts is rewritten by the next chunk
  }
  return base;
}

}  // namespace pyperm::cuda::dev
