// Jonker-Volgenant for small dense problems, on plain arrays in one scratch buffer.
//
// R. Jonker and A. Volgenant, "A shortest augmenting path algorithm for dense and sparse
// linear assignment problems", Computing 38, 325-340 (1987). The phases and their rules are
// those of lap_kernels.cpp, whose header explains them; what differs is only the machinery:
// full row scans instead of row caches, a linear scan for the nearest column instead of a
// heap, no threads, and no allocation. Square problems: column reduction (a constant matrix
// gives the identity), two rounds of augmenting row reduction, then a shortest augmenting
// path for each row still free. Wide problems (n < m) keep every unmatched column's dual at
// zero, as the rectangular problem's optimality needs (Crouse, IEEE TAES 52(4), 2016): a
// greedy start with zero duals, the augmenting row reduction (which lowers only the duals of
// columns that stay matched), then the shortest paths.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "common/isa_vector.h"
#include "lap/lap_small.h"

namespace pyperm::cpu::PYPERM_ISA {
namespace {

template <typename T> constexpr T kInf = std::numeric_limits<T>::infinity();

template <typename T>
struct Work {
  T* v;             // column duals
  T* d;             // shortest-path distances of the current search, then the search's duals (2m)
  int32_t* y;       // the row holding each column, -1 if free
  int32_t* pred;    // column reduction: each column's cheapest row; searches: the row a column is reached from
  int32_t* x;       // the column of each row, -1 if free
  int32_t* free_rows;

  Work(void* scratch, int64_t n, int64_t m) {
    char* p = static_cast<char*>(scratch);
    const size_t value_bytes = sizeof(T) < 8 ? 8 : sizeof(T);
    v = reinterpret_cast<T*>(p);
    d = reinterpret_cast<T*>(p + m * value_bytes);
    int32_t* ints = reinterpret_cast<int32_t*>(p + 3 * m * value_bytes);
    y = ints;
    pred = y + m;
    x = pred + m;
    free_rows = x + n;
  }
};

// Column reduction: v = column minima, each column offered to its cheapest row (a row
// offered several keeps the cheapest). Checks every entry: false with *status set when one
// is NaN or -inf, or a column has every entry forbidden. Writes the free rows.
template <typename T>
bool column_reduction(const T* c, int64_t n, Work<T>& w, int64_t& free_count, Status* status) {
  typedef typename Lanes<T>::Vec Vec;
  typedef typename Lanes<T>::Index I;
  typedef typename Lanes<T>::IVec IVec;
  constexpr int W = kVecBytes / int(sizeof(T));
  T* v = w.v;
  I* arg = reinterpret_cast<I*>(w.d);  // the searches' distances are not in use yet
  for (int64_t j = 0; j < n; ++j) { v[j] = kInf<T>; arg[j] = 0; }
  const Vec minus_inf = Vec{} - kInf<T>;
  IVec bad_lanes = IVec{};
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const T* row = c + i * n;
    const IVec iv = IVec{} + I(i);
    int64_t j = 0;
    for (; j + W <= n; j += W) {  // whole vectors, branch-free (GCC leaves the loop scalar)
      Vec cv, vv;
      IVec av;
      std::memcpy(&cv, row + j, sizeof(Vec));
      std::memcpy(&vv, v + j, sizeof(Vec));
      std::memcpy(&av, arg + j, sizeof(IVec));
      bad_lanes |= ~(cv > minus_inf);
      const auto lower = cv < vv;
      vv = lower ? cv : vv;
      av = lower ? iv : av;
      std::memcpy(v + j, &vv, sizeof(Vec));
      std::memcpy(arg + j, &av, sizeof(IVec));
    }
    for (; j < n; ++j) {
      const T cij = row[j];
      bad |= !(cij > -kInf<T>);
      const bool lower = cij < v[j];
      v[j] = lower ? cij : v[j];
      arg[j] = lower ? I(i) : arg[j];
    }
    if (row[i] == v[i]) arg[i] = I(i);  // ties go to the diagonal
  }
  for (int k = 0; k < W; ++k) bad |= bad_lanes[k] != 0;
  if (bad) { *status = Status::Invalid; return false; }
  for (int64_t j = 0; j < n; ++j)
    if (v[j] == kInf<T>) { *status = Status::Infeasible; return false; }
  for (int64_t j = n - 1; j >= 0; --j) {
    const int32_t i = int32_t(arg[j]);
    if (w.x[i] < 0) {
      w.x[i] = int32_t(j); w.y[j] = i;
    } else if (v[j] < v[w.x[i]]) {
      w.y[w.x[i]] = -1;
      w.x[i] = int32_t(j); w.y[j] = i;
    }
  }
  free_count = 0;
  for (int64_t i = 0; i < n; ++i)
    if (w.x[i] < 0) w.free_rows[free_count++] = int32_t(i);
  return true;
}

// The two smallest reduced costs of a row, u1 <= u2, and their columns (ties: the lowest
// columns; -1 where the row has fewer finite entries). Each vector lane keeps its own two
// smallest with their columns, branch-free, and the lanes are merged at the end: from a few
// tens of columns this beats a scalar loop, whose data-dependent branches mispredict.
template <typename T>
void two_smallest(const T* row, const T* v, int64_t m, T& u1, int32_t& j1, T& u2, int32_t& j2) {
  typedef typename Lanes<T>::Vec Vec;
  typedef typename Lanes<T>::Index I;
  typedef typename Lanes<T>::IVec IVec;
  constexpr int W = kVecBytes / int(sizeof(T));
  Vec first = Vec{} + kInf<T>, second = first;
  IVec first_j = IVec{} - 1, second_j = first_j, at;
  for (int k = 0; k < W; ++k) at[k] = I(k);
  auto take = [&](const Vec& c, const Vec& vj) {  // reduced costs of columns at..at+W-1
    const Vec h = c - vj;
    const auto lt1 = h < first, lt2 = h < second;
    second = lt1 ? first : (lt2 ? h : second);
    second_j = lt1 ? first_j : (lt2 ? at : second_j);
    first = lt1 ? h : first;
    first_j = lt1 ? at : first_j;
  };
  int64_t j = 0;
  for (; j + W <= m; j += W, at += I(W)) {
    Vec c, vj;
    std::memcpy(&c, row + j, sizeof(Vec));
    std::memcpy(&vj, v + j, sizeof(Vec));
    take(c, vj);
  }
  if (j < m) {  // the tail as one more vector, padded with +inf (never below a real entry)
    Vec c = Vec{} + kInf<T>, vj = Vec{};
    std::memcpy(&c, row + j, sizeof(T) * (m - j));
    std::memcpy(&vj, v + j, sizeof(T) * (m - j));
    take(c, vj);
  }
  // The smallest (value, column) over the lanes; then, with the winning lane's first
  // replaced by its second, the next smallest.
  int win = 0;
  for (int k = 1; k < W; ++k)
    if (first[k] < first[win] || (first[k] == first[win] && first_j[k] < first_j[win])) win = k;
  u1 = first[win];
  j1 = int32_t(first_j[win]);
  first[win] = second[win];
  first_j[win] = second_j[win];
  int next = 0;
  for (int k = 1; k < W; ++k)
    if (first[k] < first[next] || (first[k] == first[next] && first_j[k] < first_j[next])) next = k;
  u2 = first[next];
  j2 = int32_t(first_j[next]);
  if (!(u1 < kInf<T>)) j1 = -1;
  if (!(u2 < kInf<T>)) j2 = -1;
}

// The same by one scalar pass: fewer instructions than the lanes' merge on short rows.
template <typename T>
void two_smallest_scalar(const T* row, const T* v, int64_t m, T& u1, int32_t& j1, T& u2, int32_t& j2) {
  u1 = u2 = kInf<T>;
  j1 = j2 = -1;
  for (int64_t j = 0; j < m; ++j) {
    const T h = row[j] - v[j];
    if (h < u2) {
      if (h < u1) { u2 = u1; j2 = j1; u1 = h; j1 = int32_t(j); }
      else { u2 = h; j2 = int32_t(j); }
    }
  }
}

// Vectors of a row two_smallest_short takes at most: it keeps them all in registers.
constexpr int kShortVectors = 8;

// two_smallest for rows of m columns, W <= m <= V * W (W: lanes of a vector), with no branch
// that depends on the data: the reduced costs stay in V registers, the smallest value is a
// vector minimum and its lowest column the first set bit of the lanes equal to it; the
// second smallest is the next such bit, or the minimum of the other lanes. The last vector
// is read at column m - W, overlapping the one before it; its repeated lanes are set to +inf
// (inserting a partial tail lane by lane stalled on store forwarding).
template <int V, typename T>
void two_smallest_short(const T* row, const T* v, int64_t m, T& u1, int32_t& j1, T& u2, int32_t& j2) {
  typedef typename Lanes<T>::Vec Vec;
  typedef typename Lanes<T>::Index I;
  typedef typename Lanes<T>::IVec IVec;
  constexpr int W = kVecBytes / int(sizeof(T));
  const Vec inf = Vec{} + kInf<T>;
  const int64_t last = m - W;  // the column of the last vector's first lane
  Vec h[V];
  for (int k = 0; k < V; ++k) {
    const int64_t at = k + 1 < V ? int64_t(k) * W : last;
    Vec c, vj;
    std::memcpy(&c, row + at, sizeof(Vec));
    std::memcpy(&vj, v + at, sizeof(Vec));
    h[k] = c - vj;
  }
  IVec lane;
  for (int l = 0; l < W; ++l) lane[l] = I(l);
  h[V - 1] = lane < I(int64_t(V - 1) * W - last) ? inf : h[V - 1];  // lanes the vector before holds
  auto smallest = [](const Vec* x) {
    Vec low = x[0];
    for (int k = 1; k < V; ++k) low = x[k] < low ? x[k] : low;
    T s = low[0];
    for (int l = 1; l < W; ++l) s = low[l] < s ? low[l] : s;
    return s;
  };
  auto lanes_equal = [last](const Vec* x, T u) {
    const Vec uv = Vec{} + u;
    uint64_t bits = 0;
    for (int k = 0; k + 1 < V; ++k) bits |= lane_mask<Cmp::Equal>(x[k], uv) << (k * W);
    return bits | lane_mask<Cmp::Equal>(x[V - 1], uv) << last;
  };
  u1 = smallest(h);
  if (!(u1 < kInf<T>)) { u2 = u1; j1 = j2 = -1; return; }
  const uint64_t at_u1 = lanes_equal(h, u1);
  j1 = int32_t(__builtin_ctzll(at_u1));
  const uint64_t rest = at_u1 & (at_u1 - 1);
  if (rest != 0) { u2 = u1; j2 = int32_t(__builtin_ctzll(rest)); return; }
  for (int k = 0; k < V; ++k) h[k] = h[k] == u1 ? inf : h[k];  // u1 is in one lane only
  u2 = smallest(h);
  j2 = u2 < kInf<T> ? int32_t(__builtin_ctzll(lanes_equal(h, u2))) : -1;
}

// Rows of at most this many columns go to two_smallest_short (its bit masks hold 64 lanes).
// Rows of fewer than kLaneScanFrom columns never do, so they hold a whole vector.
template <typename T>
constexpr int64_t short_row_columns() {
  constexpr int64_t w = kVecBytes / int64_t(sizeof(T));
  return kShortVectors * w < 64 ? kShortVectors * w : 64;
}

// m >= W.
template <typename T>
void two_smallest_short(const T* row, const T* v, int64_t m, T& u1, int32_t& j1, T& u2, int32_t& j2) {
  constexpr int64_t W = kVecBytes / int64_t(sizeof(T));
  switch ((m + W - 1) / W) {
    case 1: return two_smallest_short<1>(row, v, m, u1, j1, u2, j2);
    case 2: return two_smallest_short<2>(row, v, m, u1, j1, u2, j2);
    case 3: return two_smallest_short<3>(row, v, m, u1, j1, u2, j2);
    case 4: return two_smallest_short<4>(row, v, m, u1, j1, u2, j2);
    case 5: return two_smallest_short<5>(row, v, m, u1, j1, u2, j2);
    case 6: return two_smallest_short<6>(row, v, m, u1, j1, u2, j2);
    case 7: return two_smallest_short<7>(row, v, m, u1, j1, u2, j2);
    default: return two_smallest_short<8>(row, v, m, u1, j1, u2, j2);
  }
}

// Rows from this many columns are scanned by lanes, up to short_row_columns() by two_smallest_short
// (measured on streams of different random problems, where the scalar pass's branches
// mispredict: 20 x 20 and 20 x 30 a third faster from 16 than from 32; 8 x 8 faster scalar).
constexpr int64_t kLaneScanFrom = 16;

// Augmenting row reduction: each free row takes its cheapest reduced-cost column, lowering
// that column's dual to the row's second cheapest, and a row it displaces goes next.
// Valid for wide problems too: it lowers only the dual of the column a row takes, which
// stays matched, so unmatched columns keep their zero duals and the others stay below.
template <typename T>
void augmenting_row_reduction(const T* c, int64_t n, int64_t m, Work<T>& w, int64_t& free_count) {
  int64_t k = 0, kept = 0;
  const int64_t todo = free_count;
  int64_t budget = n + 16;  // long displacement chains cost more than the searches they save
  while (k < todo) {
    const int32_t i = w.free_rows[k++];
    T u1, u2;
    int32_t j1, j2;
    if (m > short_row_columns<T>()) two_smallest(c + i * m, w.v, m, u1, j1, u2, j2);
    else if (m >= kLaneScanFrom) two_smallest_short(c + i * m, w.v, m, u1, j1, u2, j2);
    else two_smallest_scalar(c + i * m, w.v, m, u1, j1, u2, j2);
    if (!std::isfinite(u1)) { w.free_rows[kept++] = i; continue; }  // the search decides
    int32_t i0 = w.y[j1];
    const bool lowers = u1 < u2 && std::isfinite(u2);
    if (lowers) {
      w.v[j1] -= u2 - u1;
    } else if (i0 >= 0 && j2 >= 0 && u1 == u2) {
      j1 = j2;
      i0 = w.y[j1];
    }
    if (i0 >= 0) w.x[i0] = -1;
    w.x[i] = j1;
    w.y[j1] = i;
    if (i0 >= 0) {
      if (lowers && --budget > 0) w.free_rows[--k] = i0;
      else w.free_rows[kept++] = i0;
    }
  }
  free_count = kept;
}

// Wide problems: each row takes its cheapest column if still free (duals stay zero).
// Checks every entry; false when one is NaN or -inf.
template <typename T>
bool greedy_rows(const T* c, int64_t n, int64_t m, Work<T>& w, int64_t& free_count) {
  bool bad = false;
  free_count = 0;
  for (int64_t j = 0; j < m; ++j) w.v[j] = T(0);
  for (int64_t i = 0; i < n; ++i) {
    const T* row = c + i * m;
    T best = kInf<T>;
    int64_t best_j = -1;
    for (int64_t j = 0; j < m; ++j) {
      const T cij = row[j];
      bad |= !(cij > -kInf<T>);
      if (cij < best) { best = cij; best_j = j; }
    }
    if (best_j >= 0 && w.y[best_j] < 0) { w.x[i] = int32_t(best_j); w.y[best_j] = int32_t(i); }
    else w.free_rows[free_count++] = int32_t(i);
  }
  return !bad;
}

// One Dijkstra step over every column at once: relaxes row i at offset h into d (columns
// finished in this search carry vs = -inf, so they neither change nor win) and returns the
// smallest distance of an unfinished column. Written with vector extensions: GCC does not
// vectorise a floating-point minimum without -ffast-math.
template <typename T>
T relax_min(const T* ri, const T* vs, T* d, int32_t* pred, int32_t i, T h, int64_t m) {
  typedef T Vec __attribute__((vector_size(kVecBytes)));
  constexpr int W = kVecBytes / int(sizeof(T));
  const Vec inf = Vec{} + kInf<T>, minus_inf = -inf, hv = Vec{} + h;
  Vec best = inf;
  int64_t j = 0;
  for (; j + W <= m; j += W) {
    Vec c, v, dj;
    std::memcpy(&c, ri + j, sizeof(Vec));
    std::memcpy(&v, vs + j, sizeof(Vec));
    std::memcpy(&dj, d + j, sizeof(Vec));
    const Vec nd = hv + c - v;
    const auto better = nd < dj;
    for (int k = 0; k < W; ++k)  // rare: a row improves few columns
      if (better[k]) pred[j + k] = i;
    dj = better ? nd : dj;
    std::memcpy(d + j, &dj, sizeof(Vec));
    const Vec key = v == minus_inf ? inf : dj;
    best = key < best ? key : best;
  }
  T out = kInf<T>;
  for (int k = 0; k < W; ++k) out = best[k] < out ? best[k] : out;
  for (; j < m; ++j) {
    const T nd = h + ri[j] - vs[j];
    if (nd < d[j]) { d[j] = nd; pred[j] = i; }
    if (vs[j] != -kInf<T> && d[j] < out) out = d[j];
  }
  return out;
}

// The unfinished column at distance `best` to take next: the first free one, else the first.
template <typename T>
int64_t column_at(const T* d, const T* vs, const int32_t* y, int64_t m, T best) {
  int64_t first = -1;
  for (int64_t j = 0; j < m; ++j) {
    if (d[j] != best || vs[j] == -kInf<T>) continue;
    if (y[j] < 0) return j;
    if (first < 0) first = j;
  }
  return first;
}

// Shortest augmenting path from free row f (Dijkstra on reduced costs; among equally near
// columns a free one ends the search at once), then the duals of the finished columns and
// the augmentation. False when no free column can be reached (infeasible).
template <typename T>
bool augment(const T* c, int64_t m, Work<T>& w, int32_t f) {
  T* vs = w.d + m;  // the duals, -inf for columns this search finished
  for (int64_t j = 0; j < m; ++j) { w.d[j] = kInf<T>; vs[j] = w.v[j]; }
  T best = relax_min(c + f * m, vs, w.d, w.pred, f, T(0), m);
  int64_t j;
  for (;;) {
    if (!(best < kInf<T>)) return false;
    j = column_at(w.d, vs, w.y, m, best);
    if (w.y[j] < 0) break;
    vs[j] = -kInf<T>;
    const int32_t i = w.y[j];
    const T* ri = c + i * m;
    best = relax_min(ri, vs, w.d, w.pred, i, best - (ri[j] - w.v[j]), m);
  }
  for (int64_t k = 0; k < m; ++k)
    if (vs[k] == -kInf<T>) w.v[k] += w.d[k] - best;
  for (int32_t col = int32_t(j);;) {
    const int32_t i = w.pred[col];
    w.y[col] = i;
    const int32_t next = w.x[i];
    w.x[i] = col;
    if (i == f) break;
    col = next;
  }
  return true;
}

template <typename T>
Status solve(const T* c, int64_t n, int64_t m, int64_t* col_of_row, void* scratch) {
  if (n == 0) return Status::Ok;
  Work<T> w(scratch, n, m);
  for (int64_t j = 0; j < m; ++j) w.y[j] = -1;
  for (int64_t i = 0; i < n; ++i) w.x[i] = -1;
  int64_t free_count = 0;
  if (n == m) {
    Status status = Status::Ok;
    if (!column_reduction(c, n, w, free_count, &status)) return status;
  } else if (!greedy_rows(c, n, m, w, free_count)) {
    return Status::Invalid;
  }
  augmenting_row_reduction(c, n, m, w, free_count);
  augmenting_row_reduction(c, n, m, w, free_count);
  for (int64_t k = 0; k < free_count; ++k)
    if (!augment(c, m, w, w.free_rows[k])) return Status::Infeasible;
  for (int64_t i = 0; i < n; ++i) col_of_row[i] = w.x[i];
  return Status::Ok;
}

}  // namespace

Status solve_small(const double* cost, int64_t n, int64_t m, int64_t* col_of_row, void* scratch) {
  return solve(cost, n, m, col_of_row, scratch);
}
Status solve_small(const float* cost, int64_t n, int64_t m, int64_t* col_of_row, void* scratch) {
  return solve(cost, n, m, col_of_row, scratch);
}

}  // namespace pyperm::cpu::PYPERM_ISA
