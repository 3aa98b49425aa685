// Jonker-Volgenant shortest augmenting path solver for dense assignment problems.
//
// R. Jonker and A. Volgenant, "A shortest augmenting path algorithm for dense and
// sparse linear assignment problems", Computing 38, 325-340 (1987). Square problems
// run the paper's three phases: column reduction (without the reduction transfer), augmenting
// row reduction, and Dijkstra-like shortest augmenting paths. Wide problems (n < m)
// keep the column duals of unmatched columns at zero, which the rectangular problem's
// optimality needs (see D. F. Crouse, "On implementing 2D rectangular assignment
// algorithms", IEEE TAES 52(4), 2016): they start from a greedy row assignment with
// zero duals and go straight to the shortest paths.
//
// Only the column duals v are stored; a row's dual is implied by its assigned column.
// Every O(m) scan over a cost row is written with vector extensions (GCC's, which Clang
// shares), so this one file becomes SSE2, AVX2 or AVX-512 code depending on the flags it
// is compiled with.
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
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <queue>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/isa_vector.h"
#include "common/thread_pool.h"
#include "lap/lap_kernels.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace pyperm::cpu::PYPERM_ISA {
namespace {

template <typename V, typename S> inline V load(const S* p) { V r; std::memcpy(&r, p, sizeof(V)); return r; }
template <typename V, typename S> inline void store(S* p, const V& x) { std::memcpy(p, &x, sizeof(V)); }
template <typename V, typename S> inline V splat(S s) { return V{} + s; }
template <typename IV> inline IV iota_vec() {
  IV r;
  for (int k = 0; k < int(sizeof(IV) / sizeof(r[0])); ++k) r[k] = k;
  return r;
}

template <typename T> constexpr T kInf = std::numeric_limits<T>::infinity();

// x with lane k taken from lane k ^ S (K: 0 .. lanes-1), one shuffle instruction. The lane
// numbers are constants, which __builtin_shufflevector needs: it is Clang's, and GCC's from
// GCC 12. Older GCC (the manylinux build uses GCC 10) has only __builtin_shuffle, which
// takes them as a vector of integers as wide as the lanes (IV).
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define PYPERM_SHUFFLEVECTOR 1
#endif
#endif
template <int S, typename IV, typename V, std::size_t... K>
inline V xor_lanes(const V& x, std::index_sequence<K...>) {
#if defined(PYPERM_SHUFFLEVECTOR)
  return __builtin_shufflevector(x, x, (int(K) ^ S)...);
#else
  return __builtin_shuffle(x, IV{(int(K) ^ S)...});
#endif
}

// The smallest (value, index) pair of the lanes, in every lane: ties go to the lower index.
// log2(lanes) shuffle-compare-blend steps (S = lanes/2, lanes/4, ..., 1), no branches. Lanes
// that never received an entry hold (+inf, -1); entries are finite, so those lanes lose to
// any entry.
template <int S, typename V, typename IV> inline void lanes_argmin_from(V& x, IV& ix) {
  if constexpr (S > 0) {
    constexpr auto lanes = std::make_index_sequence<sizeof(V) / sizeof(x[0])>{};
    const V y = xor_lanes<S, IV>(x, lanes);
    const IV iy = xor_lanes<S, IV>(ix, lanes);
    const auto take = (y < x) | ((y == x) & (iy < ix));
    x = take ? y : x;
    ix = take ? iy : ix;
    lanes_argmin_from<S / 2>(x, ix);
  }
}
template <typename V, typename IV> inline void lanes_argmin(V& x, IV& ix) {
  lanes_argmin_from<int(sizeof(V) / sizeof(x[0])) / 2>(x, ix);
}

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
// Below this many entries (about 181 x 181) a problem sits in L2 and full row scans beat
// the caches' bookkeeping (measured against lapjvr at n = 32-512).
constexpr int64_t kCacheFromSize = int64_t(1) << 15;
// The passes over the whole matrix are split across threads, one per this many entries (8 MiB
// of doubles) at most: they are bound by memory bandwidth, which one core does not saturate,
// but each thread is started for its pass, which cost about 46 us of the caller's CPU on the
// 2-core development VM, while one core's column reduction of 2^20 entries takes about 0.13 ms
// (a problem of 1024 x 1024 ran 0.06-0.1 ms longer, caller's CPU, with a second thread).
constexpr int64_t kEntriesPerThread = int64_t(1) << 20;

// The kCache smallest (value, index) pairs offered so far, ascending, ties in the order offered,
// in one vector of kCache lanes (empty lanes: +inf and -1). An insertion is a few vector
// instructions and no branch. These vectors are wider than an AVX2 or SSE2 register, which the
// compiler splits; no function here returns one (GCC warns that such returns change the ABI).
template <typename T>
struct SortedCache {
  static_assert(kCache == 8, "the lane shift below is written for 8 lanes");
  using Index = typename Lanes<T>::Index;
  typedef T V __attribute__((vector_size(kCache * sizeof(T))));
  typedef Index I __attribute__((vector_size(kCache * sizeof(T))));
  V val = V{} + kInf<T>;
  I idx = I{} - 1;

  T worst() const { return val[kCache - 1]; }
  // Inserts (x, j), x < worst(). Each lane above x takes its left neighbour (lane 0's is x)
  // if that one is above x too, else x: the lanes above x move up one lane and x takes the
  // first of them. Lanes equal to x stay: ties keep the order offered.
  void insert(T x, Index j) {
    const V xv = V{} + x;
    const I jv = I{} + j;
#if defined(PYPERM_SHUFFLEVECTOR)
    const V left = __builtin_shufflevector(val, xv, 8, 0, 1, 2, 3, 4, 5, 6);
    const I left_idx = __builtin_shufflevector(idx, jv, 8, 0, 1, 2, 3, 4, 5, 6);
#else
    const V left = __builtin_shuffle(val, xv, I{8, 0, 1, 2, 3, 4, 5, 6});
    const I left_idx = __builtin_shuffle(idx, jv, I{8, 0, 1, 2, 3, 4, 5, 6});
#endif
    const auto above = val > xv;
    const auto left_above = left > xv;
    idx = above ? (left_above ? left_idx : jv) : idx;
    val = above ? (left_above ? left : xv) : val;
  }
};

// Passes that stream a matrix from memory outrun the hardware's prefetching: they fetch this
// far ahead themselves (offer_row on 1000 x 4000 doubles: 2 KiB 15% slower, 16 KiB no faster).
constexpr uintptr_t kAheadBytes = 8192;
// Prefetches the cache lines of [at, at + kBytes). Addresses are integers: they can lie outside
// any array, which a prefetch tolerates but pointer arithmetic does not.
template <int kBytes> inline void fetch_lines(uintptr_t at) {
  for (int b = 0; b < kBytes; b += 64) __builtin_prefetch(reinterpret_cast<const void*>(at + b));
}

// The smallest T above x, for x below +inf (not NaN): std::nextafter(x, +inf) without its
// library call.
template <typename T> inline T next_up(T x) {
  using Bits = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;
  if (x == T(0)) return std::numeric_limits<T>::denorm_min();
  Bits b;
  std::memcpy(&b, &x, sizeof b);
  b = x > T(0) ? b + 1 : b - 1;  // away from zero above it, towards zero below it
  std::memcpy(&x, &b, sizeof b);
  return x;
}

// Offers every entry of row[j] - v[j] at or below `limit` to `best` (in order of j), in one
// pass: a vector of entries is compared with the current kCache-th smallest (or the limit),
// and the rare lanes below it are inserted. Returns whether an entry was NaN or -inf.
// next: the row scanned after this one, or null; it is fetched into cache towards the end of
// this one. Large rows come from memory, which the pass outruns: it fetches ahead.
template <typename T>
bool offer_row(const T* row, const T* v, int64_t m, T limit, const T* next, SortedCache<T>& best) {
  using Vec = typename Lanes<T>::Vec;
  using Index = typename Lanes<T>::Index;
  constexpr int W = sizeof(Vec) / sizeof(T);
  constexpr int64_t kAhead = kAheadBytes / sizeof(T);
  const uintptr_t here = reinterpret_cast<uintptr_t>(row);
  const uintptr_t there = reinterpret_cast<uintptr_t>(next) - uintptr_t(m) * sizeof(T);  // next, as if at row + m
  auto fetch = [](uintptr_t at) { fetch_lines<2 * W * sizeof(T)>(at); };
  // The value to beat: the smallest one above the limit until kCache entries are in.
  const T start = limit < kInf<T> ? next_up(limit) : kInf<T>;
  T worst = std::min(start, best.worst());
  Vec worst_v = splat<Vec>(worst);
  const Vec minus_inf = splat<Vec>(-kInf<T>);
  unsigned bad = 0;
  auto offer = [&](T r, int64_t j) {
    if (r < worst) {
      best.insert(r, Index(j));
      worst = std::min(start, best.worst());
    }
  };
  // Two vectors at a time, one branch for both.
  auto block = [&](int64_t j) {
    const Vec r0 = load<Vec>(row + j) - load<Vec>(v + j);
    const Vec r1 = load<Vec>(row + j + W) - load<Vec>(v + j + W);
    bad |= lane_mask<Cmp::NotGreater>(r0, minus_inf) | lane_mask<Cmp::NotGreater>(r1, minus_inf);
    if (uint64_t hits = lane_mask<Cmp::Less>(r0, worst_v) | lane_mask<Cmp::Less>(r1, worst_v) << W) {
      T r[2 * W];
      store(r, r0);
      store(r + W, r1);
      do {
        const int k = __builtin_ctzll(hits);
        hits &= hits - 1;
        offer(r[k], j + k);
      } while (hits != 0);
      worst_v = splat<Vec>(worst);
    }
  };
  int64_t j = 0;
  for (; j + 2 * W <= m && j + kAhead < m; j += 2 * W) {
    fetch(here + uintptr_t(j + kAhead) * sizeof(T));
    block(j);
  }
  if (next != nullptr)
    for (; j + 2 * W <= m; j += 2 * W) {
      fetch(there + uintptr_t(j + kAhead) * sizeof(T));
      block(j);
    }
  for (; j + 2 * W <= m; j += 2 * W) block(j);
  bool tail_bad = false;
  for (; j < m; ++j) {
    const T r = row[j] - v[j];
    tail_bad |= !(r > -kInf<T>);
    offer(r, j);
  }
  return tail_bad || bad != 0;
}

// The columns of the kCache smallest values of row[j] - v[j] (ascending; ties: lowest j)
// into cols, their costs row[j] into costs, returning how many are finite. *invalid
// says whether any row[j] - v[j] was NaN or -inf. *bound receives a value that every
// column left out is at least: the largest cached value, or +inf when the row has
// no other finite entries. next: the row scanned after this one, or null (see offer_row).
//
// *hint (in and out; +inf when nothing is known): a guess of a value that about 2 * kCache
// entries of the row are at or below, carried from one row to the next. Only entries at or
// below it are offered; if fewer than kCache are, the row is offered again in full. Random
// rows then insert about 16 entries instead of kCache * ln(m / kCache) (about 57 at m = 4000),
// and an insertion costs tens of cycles (a mispredicted branch, a dependent chain).
template <typename T, typename Index>
int k_smallest(const T* row, const T* v, int64_t m, Index* cols, T* costs, T* bound, bool* invalid, T* hint,
               const T* next = nullptr) {
  SortedCache<T> best;
  *invalid = offer_row(row, v, m, *hint, next, best);
  if (best.idx[kCache - 1] < 0 && *hint < kInf<T>) {
    best = SortedCache<T>();  // the guess was too low: every entry again (from cache now)
    *invalid = offer_row(row, v, m, kInf<T>, next, best);
  }
  int count = 0;
  while (count < kCache && best.idx[count] >= 0) {
    cols[count] = best.idx[count];
    ++count;
  }
  // Left-out columns are >= the kCache-th value, or +inf (all finite ones cached).
  *bound = count == kCache ? best.worst() : kInf<T>;
  for (int k = 0; k < count; ++k) costs[k] = row[cols[k]];
  // The next row's guess: this row's smallest plus three times the spread of its cache, which
  // about 2 * kCache entries of a random row are below (counted in a model of this scan on
  // uniform rows of 1024 and 4000: 16-18 insertions a row, 1-3% of rows offered twice; with
  // factor 2, 10% twice). Integer rows tie at their smallest value and use it. +inf where this
  // row tells nothing (or the guess is not a number).
  const T guess = best.val[0] + 3 * (best.val[kCache - 1] - best.val[0]);
  *hint = count == kCache && guess >= best.val[kCache - 1] ? guess : kInf<T>;
  return count;
}

// The caches of the transposed problem, built from one pass over the tall matrix `src`
// (m_src rows of n_src entries, row-major) at zero column duals: for each column j in
// [j0, j1), the rows of its kCache smallest entries (ascending; ties: lowest row) into
// cols[j * kCache ...], their values into costs, how many are finite into count[j], and
// the bound every other entry of the column is at least into bound[j] (as k_smallest).
// Rows are read whole and in order (a strided walk down each column would fetch a cache
// line per entry); a column's list is touched only by the rare entry below its current
// kCache-th value. `worst`: scratch, n_src entries. Returns whether any entry was NaN or -inf.
template <typename T, typename Index>
bool column_k_smallest(const T* src, int64_t m_src, int64_t n_src, int64_t j0, int64_t j1, Index* cols, T* costs,
                       int* count, T* bound, T* worst) {
  using Vec = typename Lanes<T>::Vec;
  constexpr int W = sizeof(Vec) / sizeof(T);
  std::fill(worst + j0, worst + j1, kInf<T>);
  std::fill(count + j0, count + j1, 0);
  auto insert = [&](int64_t j, T r, int64_t i) {
    T* vals = costs + j * kCache;
    Index* cj = cols + j * kCache;
    int p = count[j] < kCache ? count[j]++ : kCache - 1;
    while (p > 0 && vals[p - 1] > r) { vals[p] = vals[p - 1]; cj[p] = cj[p - 1]; --p; }
    vals[p] = r; cj[p] = Index(i);
    if (count[j] == kCache) worst[j] = vals[kCache - 1];
  };
  unsigned bad = 0;  // lanes that met NaN or -inf
  const Vec minus_inf = splat<Vec>(-kInf<T>);
  for (int64_t i = 0; i < m_src; ++i) {
    const T* r = src + i * n_src;
    int64_t j = j0;
    for (; j + W <= j1; j += W) {
      Vec x = load<Vec>(r + j);
      bad |= lane_mask<Cmp::NotGreater>(x, minus_inf);
      auto lt = x < load<Vec>(worst + j);
      if (any(lt))
        for (int k = 0; k < W; ++k)
          if (x[k] < worst[j + k]) insert(j + k, x[k], i);
    }
    for (; j < j1; ++j) {
      bad |= !(r[j] > -kInf<T>);
      if (r[j] < worst[j]) insert(j, r[j], i);
    }
  }
  for (int64_t j = j0; j < j1; ++j) bound[j] = count[j] == kCache ? worst[j] : kInf<T>;
  return bad != 0;
}

template <typename T>
struct Candidate {
  T d;
  int64_t key;  // 2j for a free column, 2j+1 for an assigned one
  int64_t column() const { return key >> 1; }
  // std heaps are max-heaps: "less" here means "farther", so the top is the nearest
  // column; among equally near ones a free column (the path can end there: many fewer
  // steps when costs tie, as integer costs do), then the lowest index.
  bool operator<(const Candidate& o) const {
    return d > o.d || (d == o.d && ((key & 1) > (o.key & 1) || ((key & 1) == (o.key & 1) && key > o.key)));
  }
};

// Smallest d[k] into best/best_j (best_j = -1 when every d is +inf), a free column when
// one is as near (the path can end there). Otherwise, when the minimum shows up in more
// than one lane (tied costs, as integer costs give), every other column as near is
// appended to `level`, so the search settles the whole level before its next O(m) pass.
// free[k]: all ones if column k is free, else 0.
// With kRelax, the same pass first relaxes row i at offset h (one full Dijkstra step:
// d[k] = min(d[k], row[k] - v[k] - h), pred[k] = i where it improved; finished columns
// carry v = -inf and d = +inf, so they neither change nor win): one pass over d instead
// of two for each row a dense search scans.
template <bool kRelax, typename T>
void argmin_impl(const T* d_in, const typename Lanes<T>::Index* free, int64_t m, T& best, int64_t& best_j,
                 std::vector<int64_t>& level, const T* row = nullptr, const T* v = nullptr,
                 typename Lanes<T>::Index* pred = nullptr, typename Lanes<T>::Index i = 0, T h = T(0)) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  using IVec = typename L::IVec;
  constexpr int W = sizeof(Vec) / sizeof(T);
  T* d = const_cast<T*>(d_in);  // written only with kRelax
  const Vec inf = splat<Vec>(kInf<T>);
  const Vec hv = splat<Vec>(h);
  const IVec iv = splat<IVec>(i);
  // The nearest (value, index) of all columns and of the free ones, per lane, in two sets for
  // alternate vectors: two dependency chains that overlap (a compare and a blend per vector on
  // each). Integer costs relax hundreds of rows of 1024: measured 15-20% faster than one set.
  Vec bv0 = inf, fv0 = inf, bv1 = inf, fv1 = inf;
  IVec bi0 = splat<IVec>(-1), fi0 = bi0, bi1 = bi0, fi1 = bi0, idx = iota_vec<IVec>();
  const IVec step = splat<IVec>(W);
  auto visit = [&](int64_t j, const IVec& at, Vec& bv, IVec& bi, Vec& fv, IVec& fi) {
    Vec dj = load<Vec>(d + j);
    if constexpr (kRelax) {
      Vec cred = load<Vec>(row + j) - load<Vec>(v + j) - hv;
      auto better = cred < dj;
      dj = better ? cred : dj;
      store(d + j, dj);
      store(pred + j, better ? iv : load<IVec>(pred + j));
    }
    auto win = dj < bv;
    bv = win ? dj : bv;
    bi = win ? at : bi;
    Vec df = load<IVec>(free + j) ? dj : inf;
    auto fwin = df < fv;
    fv = fwin ? df : fv;
    fi = fwin ? at : fi;
  };
  int64_t j = 0;
  for (; j + 2 * W <= m; j += 2 * W) {
    visit(j, idx, bv0, bi0, fv0, fi0);
    visit(j + W, idx + step, bv1, bi1, fv1, fi1);
    idx += step + step;
  }
  for (; j + W <= m; j += W) {
    visit(j, idx, bv0, bi0, fv0, fi0);
    idx += step;
  }
  // Lane by lane, the first of the two sets by (value, index); lanes that never took an entry
  // hold (+inf, -1), and entries that did are below +inf.
  auto merge = [](Vec& x0, IVec& i0, const Vec& x1, const IVec& i1) {
    const auto take = (x1 < x0) | ((x1 == x0) & (i1 < i0));
    x0 = take ? x1 : x0;
    i0 = take ? i1 : i0;
  };
  // Branch-free lane reductions: the nearest (value, lowest index) of all columns and of
  // the free ones, and whether another column in the lanes ties with the nearest (capped at
  // 2: only "fewer than two" matters below).
  Vec bv = bv0, fv = fv0;
  IVec bi = bi0, fi = fi0;
  merge(bv, bi, bv1, bi1);
  merge(fv, fi, fv1, fi1);
  Vec bmin = bv, fmin = fv;
  IVec bj = bi, fj = fi;
  lanes_argmin(bmin, bj);
  lanes_argmin(fmin, fj);
  best = bmin[0];
  best_j = bj[0];
  T fbest = fmin[0];
  int64_t fbest_j = fj[0];
  int lanes_at_best = best_j < 0 ? 0
                                 : 1 + any(((bv0 == bmin) & (bi0 >= 0) & (bi0 != bj)) |
                                           ((bv1 == bmin) & (bi1 >= 0) & (bi1 != bj)));
  for (; j < m; ++j) {
    if constexpr (kRelax) {
      T cred = row[j] - v[j] - h;
      if (cred < d[j]) { d[j] = cred; pred[j] = i; }
    }
    if (d[j] < best) { best = d[j]; best_j = j; lanes_at_best = 1; }
    else if (d[j] == best) ++lanes_at_best;
    if (free[j] && d[j] < fbest) { fbest = d[j]; fbest_j = j; }
  }
  if (best_j < 0) return;
  if (fbest_j >= 0 && fbest == best) { best_j = fbest_j; return; }
  if (lanes_at_best < 2 || kRelax) return;  // relax_argmin leaves the level to the next argmin
  const Vec target = splat<Vec>(best);
  for (j = 0; j + W <= m; j += W) {
    auto hit = load<Vec>(d + j) == target;
    if (any(hit))
      for (int k = 0; k < W; ++k)
        if (hit[k] && j + k != best_j) level.push_back(j + k);
  }
  for (; j < m; ++j)
    if (d[j] == best && j != best_j) level.push_back(j);
}

template <typename T>
void argmin(const T* d, const typename Lanes<T>::Index* free, int64_t m, T& best, int64_t& best_j,
            std::vector<int64_t>& level) {
  argmin_impl<false>(d, free, m, best, best_j, level);
}

// Relaxes row i into d and pred, then finds the nearest column as argmin() does, in one pass.
template <typename T>
void relax_argmin(const T* row, const T* v, T* d, typename Lanes<T>::Index* pred, typename Lanes<T>::Index i, T h,
                  const typename Lanes<T>::Index* free, int64_t m, T& best, int64_t& best_j,
                  std::vector<int64_t>& level) {
  argmin_impl<true>(d, free, m, best, best_j, level, row, v, pred, i, h);
}

// Whether any entry is NaN or -inf.
template <typename T>
bool has_invalid(const T* c, int64_t total) {
  using Vec = typename Lanes<T>::Vec;
  constexpr int W = sizeof(Vec) / sizeof(T);
  unsigned bad = 0;
  const Vec minus_inf = splat<Vec>(-kInf<T>);
  int64_t k = 0;
  for (; k + W <= total; k += W) bad |= lane_mask<Cmp::NotGreater>(load<Vec>(c + k), minus_inf);
  for (; k < total; ++k) bad |= !(c[k] > -kInf<T>);
  return bad != 0;
}

template <typename T>
struct TwoSmallest { T u1, u2; int64_t j1, j2; };

// Smallest value of row[j] - v[j] (ties: lowest j), and the second smallest, by a full
// scan of the row (small problems, where the row caches cost more than they save).
// kCheck: also set *invalid to whether the row holds NaN or -inf.
template <typename T, bool kCheck = false>
TwoSmallest<T> scan_two_smallest(const T* row, const T* v, int64_t m, bool* invalid = nullptr) {
  using L = Lanes<T>;
  using Vec = typename L::Vec;
  using IVec = typename L::IVec;
  constexpr int W = sizeof(Vec) / sizeof(T);
  // Per lane, the two smallest (earliest first on ties), kept in two sets of lanes for
  // alternate blocks so that their dependency chains overlap, then merged lane by lane.
  Vec m1 = splat<Vec>(kInf<T>), m2 = m1, n1 = m1, n2 = m1;
  IVec i1 = splat<IVec>(-1), i2 = i1, k1 = i1, k2 = i1, idx = iota_vec<IVec>();
  const IVec step = splat<IVec>(W);
  auto keep_two = [](Vec h, IVec at, Vec& a1, IVec& ia1, Vec& a2, IVec& ia2) {
    auto lt1 = h < a1;
    auto lt2 = h < a2;
    // A new smallest pushes the old one to second place.
    a2 = lt1 ? a1 : (lt2 ? h : a2);
    ia2 = lt1 ? ia1 : (lt2 ? at : ia2);
    a1 = lt1 ? h : a1;
    ia1 = lt1 ? at : ia1;
  };
  unsigned bad = 0;  // lanes that met NaN or -inf (kCheck)
  auto checked = [&bad](Vec r) {
    if constexpr (kCheck) bad |= lane_mask<Cmp::NotGreater>(r, splat<Vec>(-kInf<T>));
    else (void)bad;  // captured for kCheck only
    return r;
  };
  int64_t j = 0;
  for (; j + 2 * W <= m; j += 2 * W) {
    keep_two(checked(load<Vec>(row + j)) - load<Vec>(v + j), idx, m1, i1, m2, i2);
    keep_two(checked(load<Vec>(row + j + W)) - load<Vec>(v + j + W), idx + step, n1, k1, n2, k2);
    idx += step + step;
  }
  for (; j + W <= m; j += W) {
    keep_two(checked(load<Vec>(row + j)) - load<Vec>(v + j), idx, m1, i1, m2, i2);
    idx += step;
  }
  {
    // Lane-wise merge of two ordered pairs by (value, index).
    auto before = [](Vec x, IVec ix, Vec y, IVec iy) { return x < y || (x == y && ix < iy); };
    auto first = before(m1, i1, n1, k1);
    Vec c1 = first ? m1 : n1, cx = first ? m2 : m1, cy = first ? n1 : n2;
    IVec ic1 = first ? i1 : k1, icx = first ? i2 : i1, icy = first ? k1 : k2;
    auto second = before(cx, icx, cy, icy);
    m1 = c1;
    i1 = ic1;
    m2 = second ? cx : cy;
    i2 = second ? icx : icy;
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
  {
    // The lanes' first entries hold the smallest (value, index); the second smallest is the
    // smallest of the other lanes' first entries and that lane's second entry. Found with
    // branch-free lane reductions (the scalar version mispredicted its way through).
    Vec u1 = m1;
    IVec j1 = i1;
    lanes_argmin(u1, j1);
    const auto mine = i1 == j1;
    Vec u2 = mine ? m2 : m1;
    IVec j2 = mine ? i2 : i1;
    lanes_argmin(u2, j2);
    if (j1[0] >= 0) { r.u1 = u1[0]; r.j1 = j1[0]; }
    if (j2[0] >= 0) { r.u2 = u2[0]; r.j2 = j2[0]; }
  }
  bool tail_bad = false;
  for (; j < m; ++j) {
    if constexpr (kCheck) tail_bad |= !(row[j] > -kInf<T>);
    offer(row[j] - v[j], j);
  }
  if constexpr (kCheck) *invalid = tail_bad || bad != 0;
  // Entries equal to +inf never entered the lanes; fall back to any other column.
  if (r.j1 < 0 && m > 0) { r.j1 = 0; }
  if (r.j2 < 0 && m > 1) { r.j2 = (r.j1 == 0) ? 1 : 0; }
  return r;
}


template <typename T>
class Solver {
 public:
  using Index = typename Lanes<T>::Index;

  // transposed: `cost` is the m x n transpose of the problem (a tall matrix read in place).
  Solver(const T* cost, int64_t n, int64_t m, int threads, bool transposed = false)
      : c_(transposed ? nullptr : cost), src_(transposed ? cost : nullptr), n_(n), m_(m),
        cached_(n * m >= kCacheFromSize),
        threads_(int(std::clamp<int64_t>(n * m / kEntriesPerThread, 1, threads > 0 ? threads : hardware_threads()))),
        v_(m, T(0)), vscan_(m), d_(m), pred_(m),
        free_(m), x_(n, -1), y_(m, -1) {
    if (cached_) {
      cache_cols_.resize(n * kCache);
      cache_cost_.resize(n * kCache);
      cache_count_.assign(n, -1);
      cache_bound_.resize(n);
    }
  }

  // v_inout: square only; start from these column duals (skips column reduction) and
  // return the final ones.
  Status run(int64_t* col_of_row, T* v_inout = nullptr) {
    std::vector<int64_t> free_rows;
    if (src_ != nullptr && cached_) {
      // A tall matrix read in place: every row cache of its transpose from one pass over it
      // (v = 0, as the wide start needs), which also checks every entry; the transpose itself
      // is written only if a search must scan a whole row (see row()).
      const int bands = threads_;
      std::vector<char> band_bad(bands, 0);
      std::vector<T> worst(n_);
      parallel_for(bands, bands, [&](int64_t b) {
        band_bad[b] = column_k_smallest(src_, m_, n_, n_ * b / bands, n_ * (b + 1) / bands, cache_cols_.data(),
                                        cache_cost_.data(), cache_count_.data(), cache_bound_.data(), worst.data());
      });
      for (char b : band_bad) invalid_ |= b != 0;
      if (invalid_) return Status::Invalid;
      caches_built_ = true;
    } else if (src_ != nullptr) {
      row(0);  // small: the transpose, written at once
    }
    if (v_inout != nullptr) {
      std::copy(v_inout, v_inout + m_, v_.begin());
      for (int64_t i = 0; i < n_; ++i) free_rows.push_back(i);
      // Warm duals are nearly right, so most rows take their best column at ARR's first
      // look and never again need their smallest columns: a row's cache is built the
      // second time it is needed (ARR again, or a shortest-path search), and the first
      // look is a plain scan, which checks the row for NaN and -inf as the cache build
      // would (ARR looks at every row, all being free).
      // MLP 784-[2048]x4-10's weight matching: 0.66-0.73 s -> 0.42-0.45 s over 122 solves.
      lazy_caches_ = plain_first_looks_ = cached_;
      if (!cached_) invalid_ = has_invalid(c_, n_ * m_);
      if (lazy_caches_) looked_.assign(n_, 0);
      if (!invalid_) augmenting_row_reduction(free_rows);
      if (!invalid_) augmenting_row_reduction(free_rows);
      if (invalid_) return Status::Invalid;
    } else if (n_ == m_) {
      if (!column_reduction(free_rows)) return invalid_ ? Status::Invalid : Status::Infeasible;
      augmenting_row_reduction(free_rows);
      augmenting_row_reduction(free_rows);
    } else {
      // Cached rows are checked as they are first scanned; a small uncached problem here.
      if (!cached_) invalid_ = has_invalid(c_, n_ * m_);
      if (!invalid_) greedy_rows(free_rows);
      if (invalid_) return Status::Invalid;
    }
    std::copy(v_.begin(), v_.end(), vscan_.begin());
    for (int64_t j = 0; j < m_; ++j) free_[j] = y_[j] < 0 ? Index(-1) : Index(0);
    for (int64_t f : free_rows)
      if (!augment(f)) return Status::Infeasible;
    for (int64_t i = 0; i < n_; ++i) col_of_row[i] = x_[i];
    if (v_inout != nullptr) std::copy(v_.begin(), v_.end(), v_inout);
    return Status::Ok;
  }

 private:
  // Row i of the problem. A tall matrix read in place (src_) is transposed here, once, the
  // first time a whole row is needed: the row caches spare most solves that pass.
  const T* row(int64_t i) {
    if (c_ == nullptr) transpose_source();
    return c_ + i * m_;
  }
  // Entry (i, j) of the problem, without transposing a tall source.
  T at(int64_t i, int64_t j) const { return c_ != nullptr ? c_[i * m_ + j] : src_[j * n_ + i]; }

  void transpose_source() {
    transposed_.reset(new T[static_cast<size_t>(n_ * m_)]);
    T* out = transposed_.get();
    constexpr int64_t B = 64;  // bands of source rows: each output row segment written contiguously
    parallel_for((m_ + B - 1) / B, threads_, [&](int64_t band) {
      const int64_t i0 = band * B, i1 = std::min(i0 + B, m_);
      for (int64_t j = 0; j < n_; ++j)
        for (int64_t i = i0; i < i1; ++i) out[j * m_ + i] = src_[i * n_ + j];
    });
    c_ = out;
  }

  // Scans row i in full and caches its smallest reduced-cost columns.
  void build_cache(int64_t i) { invalid_ |= scan_row(i, &scan_hint_); }

  // Fills row i's cache; returns whether the row held NaN or -inf. Touches only row i's
  // slots, so rows can be scanned in parallel. next: the row to be scanned after this one,
  // if known (-1 if not), which the scan fetches ahead.
  // hint: see k_smallest (one per thread).
  bool scan_row(int64_t i, T* hint, int64_t next = -1) {
    bool invalid = false;
    cache_count_[i] = k_smallest(row(i), v_.data(), m_, &cache_cols_[i * kCache], &cache_cost_[i * kCache],
                                 &cache_bound_[i], &invalid, hint, next >= 0 ? row(next) : nullptr);
    return invalid;
  }

  // The two smallest reduced costs of row i (ties: lowest column), from its cache when
  // the cache proves them smallest, else from a fresh full scan.
  TwoSmallest<T> two_smallest(int64_t i) {
    if (!cached_) return scan_two_smallest(row(i), v_.data(), m_);
    if (lazy_caches_ && cache_count_[i] < 0) {
      if (!looked_[i] && plain_first_looks_) {
        looked_[i] = 1;
        bool bad = false;
        const TwoSmallest<T> t = scan_two_smallest<T, true>(row(i), v_.data(), m_, &bad);
        invalid_ |= bad;
        return t;
      }
      // Duals far from this problem's (a cold start from zeros, say) send most rows back:
      // then the first looks only add a scan to each row's cache build.
      if (looked_[i] && ++second_looks_ * 4 > n_) plain_first_looks_ = false;
    }
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

  // A free column among row i's cached ones whose reduced cost equals u, or -1.
  int64_t free_cached_column(int64_t i, T u) const {
    if (!cached_) return -1;
    const T* costs = &cache_cost_[i * kCache];
    const Index* cols = &cache_cols_[i * kCache];
    for (int k = 0; k < cache_count_[i]; ++k) {
      int64_t j = cols[k];
      if (y_[j] < 0 && costs[k] - v_[j] == u) return j;
    }
    return -1;
  }

  // Minima of the columns over rows [r0, r1) into v and the row of each into arg. Among
  // tied rows column j takes the first at or after row j, else the first: the columns of
  // tied costs (integer costs) then spread over the rows instead of piling onto the first
  // ones, which halves the rows left free (1024 x 1024 integers below 100: 734 -> 363), and
  // a constant matrix gives the identity. Returns whether an entry was NaN or -inf: the
  // first pass checks input.
  bool column_minima(int64_t r0, int64_t r1, T* v, Index* arg) {
    using L = Lanes<T>;
    using Vec = typename L::Vec;
    using IVec = typename L::IVec;
    constexpr int W = sizeof(Vec) / sizeof(T);
    const int64_t n = n_;
    std::fill(v, v + n, kInf<T>);
    std::fill(arg, arg + n, Index(r0));
    // Lanes that met NaN or -inf, as bits (a vector accumulator ended up on the stack, one
    // store-to-load round trip per vector: 2x slower at n = 1024).
    unsigned bad = 0;
    const Vec minus_inf = splat<Vec>(-kInf<T>);
    const IVec lane = iota_vec<IVec>();
    // Rows are consecutive: a cache line at a time, each fetched kAheadBytes ahead. A row
    // lowers few minima once the first rows are in (row i about 1 in i), so v and arg are
    // written only where it does: stores of unchanged minima were half the pass's traffic
    // (lowrank-2048's column reduction: 1.9 -> 0.84 ms with the fetches; 1024: 0.15 -> 0.10).
    constexpr int kLine = W * int(sizeof(T)) >= 64 ? W : 64 / int(sizeof(T));
    auto lower = [&](const T* r, int64_t j, const IVec& iv) {
      Vec cv = load<Vec>(r + j), vv = load<Vec>(v + j);
      bad |= lane_mask<Cmp::NotGreater>(cv, minus_inf);
      if (lane_mask<Cmp::Less>(cv, vv)) {
        auto lt = cv < vv;
        store(v + j, lt ? cv : vv);
        store(arg + j, lt ? iv : load<IVec>(arg + j));
      }
    };
    // Row i may take a tie only in columns j <= i whose row is still before j. Those lie in
    // [tied_from, i]: columns below tied_from have their row (a tie can no longer move it),
    // and most ties resolve within a few rows, so this slower visit (a tie is a taken branch
    // in every few vectors of integer costs) covers a narrow band of each row.
    int64_t tied_from = r0;
    auto lower_or_tie = [&](const T* r, int64_t j, const IVec& iv) {
      Vec cv = load<Vec>(r + j), vv = load<Vec>(v + j);
      bad |= lane_mask<Cmp::NotGreater>(cv, minus_inf);
      if (lane_mask<Cmp::NotGreater>(cv, vv)) {  // lower or tied (or NaN, which takes nothing)
        const IVec a = load<IVec>(arg + j), col = lane + Index(j);
        auto take = (cv < vv) | ((cv == vv) & (a < col) & (iv >= col));
        store(v + j, take ? cv : vv);
        store(arg + j, take ? iv : a);
      }
    };
    for (int64_t i = r0; i < r1; ++i) {
      const T* r = row(i);
      const IVec iv = splat<IVec>(Index(i));
      int64_t j = 0;
      for (; j + kLine <= n; j += kLine) {
        fetch_lines<kLine * sizeof(T)>(reinterpret_cast<uintptr_t>(r + j) + kAheadBytes);
        if (j + kLine > tied_from && j <= i) {
          for (int k = 0; k < kLine; k += W) lower_or_tie(r, j + k, iv);
        } else {
          for (int k = 0; k < kLine; k += W) lower(r, j + k, iv);
        }
      }
      for (; j + W <= n; j += W) lower_or_tie(r, j, iv);
      for (; j < n; ++j) {
        bad |= !(r[j] > -kInf<T>);
        if (r[j] < v[j] || (r[j] == v[j] && arg[j] < j && i >= j)) { v[j] = r[j]; arg[j] = Index(i); }
      }
      while (tied_from <= i && tied_from < n && arg[tied_from] >= tied_from) ++tied_from;
    }
    return bad != 0;
  }

  // Scans rows in full, in parallel when the problem is large, caching each one.
  void build_caches(const std::vector<int64_t>& rows) {
    if (!cached_ || caches_built_) return;
    const int bands = threads_;
    std::vector<char> band_bad(bands, 0);
    parallel_for(bands, bands, [&](int64_t b) {
      const int64_t k0 = int64_t(rows.size()) * b / bands, k1 = int64_t(rows.size()) * (b + 1) / bands;
      bool bad = false;
      T hint = kInf<T>;
      for (int64_t k = k0; k < k1; ++k) bad |= scan_row(rows[k], &hint, k + 1 < k1 ? rows[k + 1] : -1);
      band_bad[b] = bad;
    });
    for (char b : band_bad) invalid_ |= b != 0;
  }

  // Column reduction: v = column minima, each column offered to its cheapest row. Square only.
  bool column_reduction(std::vector<int64_t>& free_rows) {
    const int64_t n = n_;
    std::vector<Index> arg(n, 0);
    // Each thread reduces a band of rows; the bands' minima are merged below.
    const int bands = threads_;
    std::vector<std::vector<T>> band_v(bands - 1, std::vector<T>(n));
    std::vector<std::vector<Index>> band_arg(bands - 1, std::vector<Index>(n));
    std::vector<char> band_bad(bands, 0);
    parallel_for(bands, bands, [&](int64_t b) {
      T* v = b == 0 ? v_.data() : band_v[b - 1].data();
      Index* a = b == 0 ? arg.data() : band_arg[b - 1].data();
      band_bad[b] = column_minima(n * b / bands, n * (b + 1) / bands, v, a);
    });
    for (int b = 0; b < bands; ++b) invalid_ |= band_bad[b] != 0;
    if (invalid_) return false;
    for (int b = 1; b < bands; ++b) {
      const T* v = band_v[b - 1].data();
      const Index* a = band_arg[b - 1].data();
      for (int64_t j = 0; j < n; ++j)  // later bands hold later rows: column_minima's rule
        if (v[j] < v_[j] || (v[j] == v_[j] && arg[j] < j && a[j] >= j)) { v_[j] = v[j]; arg[j] = a[j]; }
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
    // No reduction transfer (JV's move of each singly matched row's slack onto its column):
    // it costs a second full pass over the matrix, and with cached rows the augmenting row
    // reduction reaches the same duals for less (measured: 2x faster on -(A@B.T) costs,
    // 10% on integer costs, equal on uniform ones).
    for (int64_t i = 0; i < n; ++i)
      if (matches[i] == 0) free_rows.push_back(i);
    return true;
  }

  // Augmenting row reduction: cheap alternating-path moves for free rows.
  void augmenting_row_reduction(std::vector<int64_t>& free_rows) {
    int64_t k = 0, todo = static_cast<int64_t>(free_rows.size()), kept = 0;
    // Bound on immediate retries: long displacement chains cost more than the shortest
    // paths they replace, and rounding can make the lowering of v stall; nothing may hang.
    // Measured on uniform costs: with cached rows each move costs O(kCache) and 16n beats 2n
    // by 1.5-2x (n = 1024-4096); with full row scans n is best (n = 32-256).
    int64_t budget = (cached_ ? 16 : 1) * n_ + 16;
    while (k < todo) {
      int64_t i = free_rows[k++];
      TwoSmallest<T> t = two_smallest(i);
      if (!std::isfinite(t.u1)) { free_rows[kept++] = i; continue; }  // Dijkstra decides
      int64_t j1 = t.j1, i0 = y_[j1];
      bool lowers = t.u1 < t.u2 && std::isfinite(t.u2);
      if (lowers) {
        v_[j1] -= t.u2 - t.u1;
      } else if (i0 >= 0) {
        // Tied: prefer any free cached column as cheap as the best (integer costs tie a lot).
        int64_t jf = free_cached_column(i, t.u1);
        if (jf >= 0) { j1 = jf; i0 = -1; }
        else if (t.j2 >= 0 && t.u1 == t.u2) { j1 = t.j2; i0 = y_[j1]; }
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
    std::vector<int64_t> all(n_);
    for (int64_t i = 0; i < n_; ++i) all[i] = i;
    build_caches(all);
    if (invalid_) return;
    for (int64_t i = 0; i < n_; ++i) {
      TwoSmallest<T> t = two_smallest(i);
      if (std::isfinite(t.u1) && y_[t.j1] < 0) { x_[i] = t.j1; y_[t.j1] = i; }
      else free_rows.push_back(i);
    }
  }

  // Adds row i (reached at offset h) to the search: its cached columns now, the rest of
  // the row once the search distance reaches bound - h.
  void expand(int64_t i, T h) {
    if (lazy_caches_ && cache_count_[i] < 0) build_cache(i);
    const int count = cached_ ? cache_count_[i] : -1;
    if (count < 0) {  // never scanned, or no caches: relax the whole row
      relax_full(i, h);
      // and cache it from L1 while it is there: later searches that reach this row then
      // relax its cached columns (1024 x 1024 integers: 1983 -> 444 whole rows relaxed)
      if (cached_) build_cache(i);
      return;
    }
    const T* costs = &cache_cost_[i * kCache];
    const Index* cols = &cache_cols_[i * kCache];
    for (int k = 0; k < count; ++k) {
      int64_t j = cols[k];
      T cred = costs[k] - vscan_[j] - h;
      if (cred < d_[j]) { d_[j] = cred; pred_[j] = Index(i); found_ = false; push({cred, 2 * j + (y_[j] >= 0)}); }
    }
    if (cache_bound_[i] < kInf<T>) pending_.push({cache_bound_[i] - h, i, h});
  }

  // A whole row relaxed: from here on this search finds its nearest column by a dense
  // scan of d, which costs less than keeping up to m new candidates in the heap.
  // The same pass finds the nearest column, which the nearest() call that always follows
  // returns without a scan of its own.
  void relax_full(int64_t i, T h) {
    dense_ = true;
    level_.clear();  // the row may have brought columns at or below the level: find it anew
    relax_argmin(row(i), vscan_.data(), d_.data(), pred_.data(), Index(i), h, free_.data(), m_, found_d_, found_j_,
                 level_);
    level_d_ = found_d_;
    found_ = true;
  }

  void push(Candidate<T> c) {
    if (dense_) {
      // Joins the level being settled, or, if nearer (rounding), makes the next pass find it.
      if (c.d == level_d_) level_.push_back(c.column());
      else if (c.d < level_d_) level_.clear();
      return;
    }
    heap_.push_back(c);
    std::push_heap(heap_.begin(), heap_.end());
  }

  // The nearest unfinished column (best_j = -1 if none), dropping stale heap entries:
  // a column's entry is current while it is unfinished and its d still equals it.
  void nearest(T& best, int64_t& best_j) {
    if (dense_) {
      if (found_) {  // d has not changed since relax_full found its nearest column
        found_ = false;
        best = found_d_;
        best_j = found_j_;
        return;
      }
      while (!level_.empty()) {  // free columns of the level were taken at once
        int64_t j = level_.back();
        level_.pop_back();
        if (vscan_[j] != -kInf<T> && d_[j] == level_d_) { best = level_d_; best_j = j; return; }
      }
      argmin(d_.data(), free_.data(), m_, best, best_j, level_);
      level_d_ = best;
      return;
    }
    while (!heap_.empty()) {
      const Candidate<T>& top = heap_.front();
      if (top.d == d_[top.column()]) { best = top.d; best_j = top.column(); return; }
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
    level_.clear();
    dense_ = false;
    found_ = false;
    pending_ = {};
    expand(f, T(0));
    T best;
    int64_t j;
    for (;;) {
      nearest(best, j);
      // Rows whose uncached columns could be closer than the best candidate are scanned in
      // full. A column merely as close may wait: Dijkstra may settle ties in any order.
      while (!pending_.empty() && pending_.top().limit < best) {
        Pending p = pending_.top();
        pending_.pop();
        relax_full(p.i, p.h);
        nearest(best, j);
      }
      if (j < 0 || !(best < kInf<T>)) {  // nothing reachable: restore and give up
        for (const Done& s : done_) vscan_[s.j] = v_[s.j];
        return false;
      }
      if (y_[j] < 0) break;
      const int64_t i = y_[j];
      const T h = at(i, j) - v_[j] - best;
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
    free_[sink] = 0;
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

  const T* c_;               // the n x m problem, row-major (null until a tall source is transposed)
  const T* src_;             // a tall source read in place (its m x n transpose), or null
  std::unique_ptr<T[]> transposed_;
  bool caches_built_ = false;  // every row cache filled before the solve
  T scan_hint_ = kInf<T>;     // k_smallest's guess for rows scanned on demand
  int64_t n_, m_;
  bool cached_;           // row caches on (large problems)
  int threads_;           // threads for the whole-matrix passes
  std::vector<T> v_;      // column duals
  std::vector<T> vscan_;  // v_ with the columns finished in the current search set to -inf
  std::vector<T> d_;
  std::vector<Index> pred_;
  std::vector<Index> free_;  // all ones for a column no row holds
  std::vector<int64_t> x_, y_;
  std::vector<Index> cache_cols_;  // kCache columns per row
  std::vector<T> cache_cost_;      // and their costs, so searches stay out of the big matrix
  std::vector<int> cache_count_;   // -1: row not scanned yet
  std::vector<T> cache_bound_;
  std::vector<Done> done_;
  std::priority_queue<Pending> pending_;
  std::vector<Candidate<T>> heap_;
  bool dense_ = false;    // this search has relaxed a whole row
  std::vector<int64_t> level_;  // dense mode: unsettled columns at distance level_d_
  T level_d_ = T(0);
  bool found_ = false;  // dense mode: relax_full's nearest column (found_d_, found_j_) is current
  T found_d_ = T(0);
  int64_t found_j_ = -1;
  bool invalid_ = false;  // the first pass met NaN or -inf
  bool lazy_caches_ = false;        // warm start: caches built when a row needs one (see run)
  bool plain_first_looks_ = false;  // lazy caches: a row's first look is a plain scan
  std::vector<char> looked_;        // lazy caches: the row had its plain first look
  int64_t second_looks_ = 0;        // lazy caches: rows ARR came back to after a plain look
};

template <typename T>
Status solve(const T* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads, T* v_inout = nullptr,
             bool transposed = false) {
  if (n == 0) return Status::Ok;
  Solver<T> solver(cost, n, m, threads, transposed);
  return solver.run(col_of_row, v_inout);
}

}  // namespace

Status solve_dense(const double* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads) {
  return solve(cost, n, m, col_of_row, threads);
}
Status solve_dense(const float* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads) {
  return solve(cost, n, m, col_of_row, threads);
}
Status solve_dense_transposed(const double* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads) {
  return solve<double>(cost, n, m, col_of_row, threads, nullptr, true);
}
Status solve_dense_transposed(const float* cost, int64_t n, int64_t m, int64_t* col_of_row, int threads) {
  return solve<float>(cost, n, m, col_of_row, threads, nullptr, true);
}
Status solve_square_warm(const double* cost, int64_t n, double* v, int64_t* col_of_row) {
  return solve(cost, n, n, col_of_row, /*threads=*/1, v);
}
Status solve_square_warm(const float* cost, int64_t n, float* v, int64_t* col_of_row) {
  return solve(cost, n, n, col_of_row, /*threads=*/1, v);
}

}  // namespace pyperm::cpu::PYPERM_ISA
