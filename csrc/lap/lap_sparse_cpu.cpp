#include "lap/lap_sparse_cpu.h"

#include "lap/cost_range.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace pyperm::cpu {
namespace {

// A square problem's search is joined by a backward search once it has settled
// kTwoWayScansPerFreeColumn columns per free column, and at least kTwoWayMinScans plus one
// in kTwoWayColumnShare of all columns: starting the backward search costs a scan of every
// free column, which only a long search repays.
constexpr size_t kTwoWayScansPerFreeColumn = 4;
constexpr size_t kTwoWayMinScans = 16;
constexpr size_t kTwoWayColumnShare = 64;

// A stored entry of the working problem: its cost and column, side by side so that a row
// scan reads one stream.
template <typename T>
struct Edge {
  T cost;
  int32_t col;
};

// The problem the solver works on: a minimisation with n <= m, only finite edges, rows as
// CSR. Indices are 32-bit (each dimension is below 2^31), offsets 64-bit.
template <typename T>
struct Graph {
  int32_t n = 0, m = 0;
  std::vector<int64_t> start;  // n + 1 offsets into edges
  std::vector<Edge<T>> edges;
};

// Copies the caller's CSR into g as W, times `scale` (a power of two): negated when
// maximizing, forbidden entries dropped, and transposed (a counting sort by column) when the
// matrix is tall, so that every row can be matched. The structure and the numbers are
// checked on the way; *largest is the largest magnitude of a stored finite cost.
template <typename W, typename T, typename I>
Status build_graph(const I* indptr, const I* indices, const T* data, int64_t n_rows, int64_t n_cols,
                   bool maximize, bool transpose, W scale, Graph<W>& g, W* largest) {
  const W inf = std::numeric_limits<W>::infinity();
  const W sign = maximize ? -scale : scale;
  *largest = W(0);
  if (indptr[0] != 0) return Status::Invalid;
  for (int64_t i = 0; i < n_rows; ++i)
    if (indptr[i + 1] < indptr[i]) return Status::Invalid;
  const int64_t n = transpose ? n_cols : n_rows;
  g.n = static_cast<int32_t>(n);
  g.m = static_cast<int32_t>(transpose ? n_rows : n_cols);
  // First pass: check, and count the edges each working row keeps.
  g.start.assign(static_cast<size_t>(n + 1), 0);
  for (int64_t i = 0; i < n_rows; ++i) {
    for (int64_t k = indptr[i]; k < indptr[i + 1]; ++k) {
      const int64_t j = indices[k];
      if (j < 0 || j >= n_cols) return Status::Invalid;
      const W c = sign * static_cast<W>(data[k]);
      if (!(c > -inf)) return Status::Invalid;  // NaN fails the comparison too
      if (c == inf) continue;                   // a forbidden pair is no edge
      *largest = std::max(*largest, std::fabs(c));
      ++g.start[static_cast<size_t>((transpose ? j : i) + 1)];
    }
  }
  for (int64_t r = 0; r < n; ++r) g.start[r + 1] += g.start[r];
  g.edges.resize(static_cast<size_t>(g.start[n]));
  // Second pass: place the edges (a cursor per working row).
  std::vector<int64_t> cursor(g.start.begin(), g.start.end() - 1);
  for (int64_t i = 0; i < n_rows; ++i) {
    for (int64_t k = indptr[i]; k < indptr[i + 1]; ++k) {
      const W c = sign * static_cast<W>(data[k]);
      if (c == inf) continue;
      const int64_t j = indices[k];
      const int64_t row = transpose ? j : i;
      g.edges[cursor[row]++] = Edge<W>{c, static_cast<int32_t>(transpose ? i : j)};
    }
  }
  return Status::Ok;
}

// A 4-ary min-heap of (distance, column): half the depth of a binary heap, and a node's
// children lie side by side. Stale entries are the caller's to skip (lazy deletion).
template <typename T>
class MinHeap {
 public:
  struct Item {
    T dist;
    int32_t col;
  };
  void clear() { items_.clear(); }
  bool empty() const { return items_.empty(); }
  size_t size() const { return items_.size(); }
  const Item& top() const { return items_[0]; }
  void push(Item x) {
    size_t i = items_.size();
    items_.push_back(x);
    while (i > 0) {
      const size_t parent = (i - 1) / 4;
      if (!(x.dist < items_[parent].dist)) break;
      items_[i] = items_[parent];
      i = parent;
    }
    items_[i] = x;
  }
  void pop() {
    const Item last = items_.back();
    items_.pop_back();
    const size_t n = items_.size();
    if (n == 0) return;
    size_t i = 0;
    for (;;) {
      const size_t first = 4 * i + 1;
      if (first >= n) break;
      const size_t end = std::min(first + 4, n);
      size_t best = first;
      for (size_t c = first + 1; c < end; ++c)
        if (items_[c].dist < items_[best].dist) best = c;
      if (!(items_[best].dist < last.dist)) break;
      items_[i] = items_[best];
      i = best;
    }
    items_[i] = last;
  }

 private:
  std::vector<Item> items_;
};

// Shortest augmenting paths over the stored edges. The duals are column prices v; a matched
// row's own dual is implicit: u_r = cost of its matched edge - v[its column]. The invariant
// every phase keeps: a matched row's edge has the least reduced cost (c - v) of the row's
// edges, and (rectangular problems) every unmatched column keeps its starting price of 0,
// the highest of all prices, which is what makes each partial matching optimal for the
// rows it covers (Crouse 2016, section III).
template <typename T>
class SparseSolver {
 public:
  explicit SparseSolver(const Graph<T>& g)
      : g_(g),
        cols_(static_cast<size_t>(g.m), Column{T(0), T(0), T(0), 0u, 0u}),
        row_cost_(static_cast<size_t>(g.n), T(0)),
        col_of_row_(static_cast<size_t>(g.n), -1),
        row_of_col_(static_cast<size_t>(g.m), -1),
        pred_(static_cast<size_t>(g.m)) {}

  Status solve() {
    for (int32_t i = 0; i < g_.n; ++i)
      if (g_.start[i] == g_.start[i + 1]) return Status::Infeasible;  // a row with no edge
    std::vector<int32_t> free_rows;
    if (g_.n == g_.m) {
      // Column reduction moves the prices of unmatched columns, which only a square
      // problem allows (all its columns end up matched).
      Status s = reduce_columns(free_rows);
      if (s != Status::Ok) return s;
    } else {
      free_rows.resize(static_cast<size_t>(g_.n));
      for (int32_t i = 0; i < g_.n; ++i) free_rows[i] = i;
    }
    for (int pass = 0; pass < 2 && !free_rows.empty(); ++pass) {
      std::vector<int32_t> still_free;
      Status s = reduce_rows(free_rows, still_free);
      if (s != Status::Ok) return s;
      free_rows.swap(still_free);
    }
    // A square problem's searches may grow from both ends (augment_square); that moves the
    // prices of free columns, which a rectangular problem must keep (augment).
    if (g_.n == g_.m && !free_rows.empty()) start_square_searches();
    for (int32_t i : free_rows) {
      Status s = g_.n == g_.m ? augment_square(i) : augment(i);
      if (s != Status::Ok) return s;
    }
    return Status::Ok;
  }

  const std::vector<int32_t>& col_of_row() const { return col_of_row_; }

 private:
  // What a search reads for every edge it looks at, together in one cache line: the
  // column's price, its distance, and which search last touched it (`mark`: 2 * search
  // when reached, 2 * search + 1 when its distance is final); the same for the backward
  // search of augment_square (`back_dist`: to the nearest free column).
  struct Column {
    T price;
    T dist;
    T back_dist;
    uint32_t mark;
    uint32_t back_mark;
  };
  // How a search reached a column, written only when its distance improves.
  struct Pred {
    T cost;  // of the edge from pred row
    int32_t row;
  };

  void assign(int32_t i, int32_t j, T cost) {
    col_of_row_[i] = j;
    row_of_col_[j] = i;
    row_cost_[i] = cost;
  }

  // The least and second least reduced costs of row i (second: +inf when the row has one
  // edge), the least one's column and edge cost, and the second's column (-1 if none).
  // Every row has an edge and its reduced costs are finite while the costs stay within
  // cost_range.h's bound, so j1 is a column; were a price ever to overflow, j1 would be -1,
  // and the callers stop with NotConverged rather than index a column -1.
  struct RowMin {
    T u1, u2, c1;
    int32_t j1, j2;
  };
  RowMin row_min(int32_t i) const {
    const T inf = std::numeric_limits<T>::infinity();
    RowMin r{inf, inf, inf, -1, -1};
    for (int64_t k = g_.start[i]; k < g_.start[i + 1]; ++k) {
      const Edge<T> e = g_.edges[k];
      const T h = e.cost - cols_[e.col].price;
      if (h < r.u2) {
        if (h < r.u1) {
          r.u2 = r.u1;
          r.j2 = r.j1;
          r.u1 = h;
          r.j1 = e.col;
          r.c1 = e.cost;
        } else {
          r.u2 = h;
          r.j2 = e.col;
        }
      }
    }
    return r;
  }

  // The cost of row i's edge to column j, the cheapest of parallel ones (j is an edge).
  T edge_cost(int32_t i, int32_t j) const {
    T best = std::numeric_limits<T>::infinity();
    for (int64_t k = g_.start[i]; k < g_.start[i + 1]; ++k)
      if (g_.edges[k].col == j) best = std::min(best, g_.edges[k].cost);
    return best;
  }

  // Column reduction and reduction transfer (JV 1987, section 4): each column's price is
  // its cheapest entry, the column goes to that row when the row is still free, and a row
  // holding a column passes its slack to the other columns by lowering its column's price.
  // Appends the rows left free.
  Status reduce_columns(std::vector<int32_t>& free_rows) {
    const T inf = std::numeric_limits<T>::infinity();
    std::vector<int32_t> best_row(static_cast<size_t>(g_.m), -1);
    for (Column& c : cols_) c.price = inf;
    for (int32_t i = 0; i < g_.n; ++i) {
      for (int64_t k = g_.start[i]; k < g_.start[i + 1]; ++k) {
        const Edge<T> e = g_.edges[k];
        if (e.cost < cols_[e.col].price) {
          cols_[e.col].price = e.cost;
          best_row[e.col] = i;
        }
      }
    }
    for (int32_t j = g_.m - 1; j >= 0; --j) {
      const int32_t i = best_row[j];
      if (i < 0) return Status::Infeasible;  // a column with no edge in a square problem
      if (col_of_row_[i] < 0) assign(i, j, cols_[j].price);
    }
    for (int32_t i = 0; i < g_.n; ++i) {
      const int32_t j1 = col_of_row_[i];
      if (j1 < 0) {
        free_rows.push_back(i);
        continue;
      }
      T mu = inf;
      for (int64_t k = g_.start[i]; k < g_.start[i + 1]; ++k) {
        const Edge<T> e = g_.edges[k];
        if (e.col != j1) mu = std::min(mu, e.cost - cols_[e.col].price);
      }
      if (mu < inf) cols_[j1].price -= mu;  // row i's matched edge now costs mu, still its least
    }
    return Status::Ok;
  }

  // Augmenting row reduction (JV 1987, section 4): a free row takes the column of its least
  // reduced cost and lowers that column's price until its second least ties, pushing out the
  // column's previous row, which is handled next if the price fell (it then has a new
  // least) and left for the next pass otherwise. Prices only fall and unmatched columns are
  // never lowered unless taken, so the invariant holds. Appends the rows still free.
  Status reduce_rows(std::vector<int32_t> rows, std::vector<int32_t>& still_free) {
    const T inf = std::numeric_limits<T>::infinity();
    // Displaced rows are retried at once only within a budget of row scans, so a pass stays
    // linear in the matrix size; the rest go to the shortest path phase.
    int64_t budget = 2 * static_cast<int64_t>(rows.size()) + 16;
    size_t k = 0;
    while (k < rows.size()) {
      const int32_t i = rows[k++];
      RowMin r = row_min(i);
      if (r.j1 < 0) return Status::NotConverged;  // an overflowed price (see row_min)
      int32_t j = r.j1;
      T cost = r.c1;
      int32_t previous = row_of_col_[j];
      bool lowered = false;
      if (r.u2 < inf && r.u1 < r.u2) {
        cols_[j].price -= r.u2 - r.u1;
        lowered = true;
      } else if (previous >= 0 && r.j2 >= 0) {
        // A tie: take the second column instead, which may be free.
        j = r.j2;
        cost = edge_cost(i, j);
        previous = row_of_col_[j];
      } else if (previous >= 0) {
        still_free.push_back(i);  // a single edge to a taken column
        continue;
      }
      if (previous >= 0) col_of_row_[previous] = -1;
      assign(i, j, cost);
      if (previous >= 0) {
        if (lowered && budget-- > 0)
          rows[--k] = previous;
        else
          still_free.push_back(previous);
      }
    }
    return Status::Ok;
  }

  // Reaches column k at `dist` through row `row`'s edge of cost `cost`. Nothing at or past
  // the nearest free column found so far (`bound_`) can shorten the path, so it is dropped;
  // a free column becomes that bound instead of entering the heap.
  void reach(int32_t k, T dist, int32_t row, T cost, uint32_t reached) {
    if (!(dist < bound_)) return;
    Column& c = cols_[k];
    if (c.mark >= reached && !(dist < c.dist)) return;
    c.dist = dist;
    c.mark = reached;
    pred_[k] = Pred{cost, row};
    if (row_of_col_[k] < 0) {
      bound_ = dist;
      sink_ = k;
      return;
    }
    heap_.push({dist, k});
  }

  // One Dijkstra search from the free row i0 over reduced costs to the nearest free column,
  // then the price update that keeps reduced costs non-negative and the swap along the path.
  Status augment(int32_t i0) {
    const RowMin first = row_min(i0);
    if (first.j1 < 0) return Status::NotConverged;  // an overflowed price (see row_min)
    if (row_of_col_[first.j1] < 0) {  // its cheapest column is free: no search needed
      assign(i0, first.j1, first.c1);
      return Status::Ok;
    }
    ++search_;
    const uint32_t reached = 2u * static_cast<uint32_t>(search_), final_mark = reached + 1;
    heap_.clear();
    scanned_.clear();
    bound_ = std::numeric_limits<T>::infinity();
    sink_ = -1;
    for (int64_t k = g_.start[i0]; k < g_.start[i0 + 1]; ++k) {
      const Edge<T> e = g_.edges[k];
      reach(e.col, e.cost - cols_[e.col].price, i0, e.cost, reached);
    }
    // Every column popped is matched (free ones never enter the heap) and nearer than the
    // bound; the search ends when the heap holds nothing nearer.
    while (!heap_.empty() && heap_.top().dist < bound_) {
      const typename MinHeap<T>::Item top = heap_.top();
      heap_.pop();
      Column& c = cols_[top.col];
      if (c.mark == final_mark || top.dist > c.dist) continue;  // a stale heap entry
      c.mark = final_mark;
      scanned_.push_back(top.col);
      // Row r's reduced costs, shifted so that its matched edge (its least) costs top.dist.
      const int32_t r = row_of_col_[top.col];
      const T base = top.dist - (row_cost_[r] - cols_[top.col].price);
      for (int64_t k = g_.start[r]; k < g_.start[r + 1]; ++k) {
        const Edge<T> e = g_.edges[k];
        if (cols_[e.col].mark == final_mark) continue;
        reach(e.col, base + e.cost - cols_[e.col].price, r, e.cost, reached);
      }
    }
    if (sink_ < 0) return Status::Infeasible;
    const T total = bound_;
    for (int32_t j : scanned_) cols_[j].price += cols_[j].dist - total;
    for (int32_t j = sink_;;) {
      const Pred p = pred_[j];
      const int32_t r = p.row, next = col_of_row_[r];
      assign(r, j, p.cost);
      if (r == i0) break;
      j = next;
    }
    return Status::Ok;
  }

  // What augment_square keeps between searches: the free columns (where a backward search
  // starts) and each row's state.
  void start_square_searches() {
    succ_.resize(static_cast<size_t>(g_.m));
    row_state_.resize(static_cast<size_t>(g_.n));
    for (int32_t i = 0; i < g_.n; ++i) update_row_state(i);
    on_back_path_.assign(static_cast<size_t>(g_.m), 0u);
    free_pos_.assign(static_cast<size_t>(g_.m), -1);
    for (int32_t j = 0; j < g_.m; ++j)
      if (row_of_col_[j] < 0) {
        free_pos_[j] = static_cast<int32_t>(free_cols_.size());
        free_cols_.push_back(j);
      }
  }

  // The transposed edges (each column's rows) for the backward searches, built when the
  // first one starts.
  void build_transpose() {
    by_col_start_.assign(static_cast<size_t>(g_.m) + 1, 0);
    for (const Edge<T>& e : g_.edges) ++by_col_start_[static_cast<size_t>(e.col) + 1];
    for (int32_t j = 0; j < g_.m; ++j) by_col_start_[j + 1] += by_col_start_[j];
    by_col_.resize(g_.edges.size());
    std::vector<int64_t> cursor(by_col_start_.begin(), by_col_start_.end() - 1);
    for (int32_t i = 0; i < g_.n; ++i)
      for (int64_t k = g_.start[i]; k < g_.start[i + 1]; ++k) {
        const Edge<T> e = g_.edges[k];
        by_col_[cursor[e.col]++] = Edge<T>{e.cost, i};  // `col` holds the row here
      }
  }

  // The least valid key of a heap whose stale entries are those `is_stale` says, which are
  // dropped on the way; +inf when it is empty.
  template <typename Stale>
  T heap_min(MinHeap<T>& heap, Stale is_stale) {
    while (!heap.empty() && is_stale(heap.top())) heap.pop();
    return heap.empty() ? std::numeric_limits<T>::infinity() : heap.top().dist;
  }

  // A shortest augmenting path from free row i0 of a square problem: a Dijkstra search over
  // reduced costs forward from i0 (distances df, as in augment), joined when it grows long
  // by one backward from every free column (db: the distance from a column to the nearest
  // free column, over the reversed edges); one side or the other grows until the least
  // unsettled distances of the two sides (0 for the backward side before it starts) sum to
  // at least the best path found, D (bidirectional Dijkstra). The prices then
  // move by phi(j) = min(df(j), max(s, D - db(j))) with s = min(least unsettled df, D): phi
  // is the minimum of two feasible potentials (hence feasible), equals the distance along
  // every shortest path (so the path is tight), and differs from the constant s only on
  // the settled columns, which keeps the update O(touched). Free columns get phi = D: their
  // prices rise, which a square problem allows.
  Status augment_square(int32_t i0) {
    const T inf = std::numeric_limits<T>::infinity();
    const RowMin first = row_min(i0);
    if (first.j1 < 0) return Status::NotConverged;  // an overflowed price (see row_min)
    if (row_of_col_[first.j1] < 0) {
      assign(i0, first.j1, first.c1);
      update_row_state(i0);
      drop_free_col(first.j1);
      return Status::Ok;
    }
    ++search_;
    const uint32_t reached = 2u * static_cast<uint32_t>(search_), final_mark = reached + 1;
    heap_.clear();
    back_heap_.clear();
    scanned_.clear();
    back_scanned_.clear();
    best_ = inf;
    meet_ = -1;
    for (int64_t k = g_.start[i0]; k < g_.start[i0 + 1]; ++k) {
      const Edge<T> e = g_.edges[k];
      reach_forward(e.col, e.cost - cols_[e.col].price - first.u1, i0, e.cost, reached);
    }
    auto stale_forward = [&](const typename MinHeap<T>::Item& x) {
      const Column& c = cols_[x.col];
      return c.mark == final_mark || x.dist > c.dist;
    };
    auto stale_backward = [&](const typename MinHeap<T>::Item& x) {
      const Column& c = cols_[x.col];
      return c.back_mark == final_mark || x.dist > c.back_dist;
    };
    // Forward only at first (the free columns at backward distance 0): most searches end
    // soon. A long one is joined by the backward search.
    const size_t switch_after = std::max(kTwoWayMinScans + static_cast<size_t>(g_.m) / kTwoWayColumnShare,
                                         kTwoWayScansPerFreeColumn * free_cols_.size());
    bool two_way = false;
    T top_forward = heap_min(heap_, stale_forward), top_backward = T(0);
    while (top_forward + top_backward < best_) {
      if (!two_way && scanned_.size() >= switch_after) {
        if (by_col_.empty()) build_transpose();
        for (int32_t j : free_cols_) {
          cols_[j].back_dist = T(0);
          cols_[j].back_mark = reached;
          back_heap_.push({T(0), j});
        }
        two_way = true;
      }
      // The side with the smaller frontier grows. The backward heap starts with every free
      // column and gains more entries per settled column (many sources), so it counts for
      // half: the backward side then settles a larger share, which takes fewer scans.
      if (!two_way || 2 * heap_.size() <= back_heap_.size()) {
        scan_forward(final_mark, reached);
        top_forward = heap_min(heap_, stale_forward);
      } else {
        scan_backward(final_mark, reached);
        top_backward = heap_min(back_heap_, stale_backward);
      }
    }
    if (meet_ < 0) return Status::Infeasible;
    const T total = best_, split = std::min(top_forward, total);
    for (int32_t j : scanned_)
      if (cols_[j].dist < split) cols_[j].price += cols_[j].dist - split;
    for (int32_t j : back_scanned_)
      if (cols_[j].back_dist < total - split) cols_[j].price += total - cols_[j].back_dist - split;
    swap_along_path(i0);
    // The rows whose column or column price changed.
    for (int32_t j : scanned_)
      if (row_of_col_[j] >= 0) update_row_state(row_of_col_[j]);
    for (int32_t j : back_scanned_)
      if (row_of_col_[j] >= 0) update_row_state(row_of_col_[j]);
    for (const Move& mv : moves_) update_row_state(mv.row);
    return Status::Ok;
  }

  // Forward label of column k (as `reach`, with the best path instead of the nearest free
  // column as the bound): a column the backward search has labelled closes a path.
  void reach_forward(int32_t k, T dist, int32_t row, T cost, uint32_t reached) {
    if (!(dist < best_)) return;
    Column& c = cols_[k];
    if (c.mark >= reached && !(dist < c.dist)) return;
    c.dist = dist;
    c.mark = reached;
    pred_[k] = Pred{cost, row};
    if (row_of_col_[k] < 0) {  // a free column (backward distance 0) ends a path here
      best_ = dist;
      meet_ = k;
      return;
    }
    heap_.push({dist, k});
    if (c.back_mark >= reached && dist + c.back_dist < best_) {
      best_ = dist + c.back_dist;
      meet_ = k;
    }
  }

  void scan_forward(uint32_t final_mark, uint32_t reached) {
    const typename MinHeap<T>::Item top = heap_.top();
    heap_.pop();
    Column& c = cols_[top.col];
    c.mark = final_mark;
    scanned_.push_back(top.col);
    const int32_t r = row_of_col_[top.col];
    const T base = top.dist - (row_cost_[r] - c.price);
    for (int64_t k = g_.start[r]; k < g_.start[r + 1]; ++k) {
      const Edge<T> e = g_.edges[k];
      if (cols_[e.col].mark == final_mark) continue;
      reach_forward(e.col, base + e.cost - cols_[e.col].price, r, e.cost, reached);
    }
    if (!heap_.empty()) {
      const int32_t next = row_of_col_[heap_.top().col];
      prefetch(g_.edges.data() + g_.start[next], g_.edges.data() + g_.start[next + 1]);
    }
  }

  // Asks for the edges in [first, last) ahead of use: the next column to settle is most
  // likely the heap's top now, and its edges lie anywhere in memory.
  static void prefetch(const Edge<T>* first, const Edge<T>* last) {
    constexpr size_t kPerLine = 64 / sizeof(Edge<T>);
    for (; first < last; first += kPerLine) __builtin_prefetch(first);
  }

  // Settles the nearest backward column b: every matched row r with an edge to b could move
  // there from its column a, at reduced cost (c(r, b) - v_b) - u_r >= 0.
  void scan_backward(uint32_t final_mark, uint32_t reached) {
    const typename MinHeap<T>::Item top = back_heap_.top();
    back_heap_.pop();
    const int32_t b = top.col;
    cols_[b].back_mark = final_mark;
    back_scanned_.push_back(b);
    const T base = top.dist - cols_[b].price;
    for (int64_t k = by_col_start_[b]; k < by_col_start_[b + 1]; ++k) {
      const Edge<T> e = by_col_[k];
      const RowState row = row_state_[e.col];
      const int32_t a = row.col;
      if (a < 0 || a == b) continue;  // a free row (the search's own is the other side's)
      Column& c = cols_[a];
      if (c.back_mark == final_mark) continue;
      const T dist = base + e.cost - row.u;
      if (!(dist < best_)) continue;
      if (c.back_mark >= reached && !(dist < c.back_dist)) continue;
      c.back_dist = dist;
      c.back_mark = reached;
      succ_[a] = Succ{e.cost, b};
      back_heap_.push({dist, a});
      if (c.mark >= reached && c.dist + dist < best_) {
        best_ = c.dist + dist;
        meet_ = a;
      }
    }
    if (!back_heap_.empty()) {
      const int32_t next = back_heap_.top().col;
      prefetch(by_col_.data() + by_col_start_[next], by_col_.data() + by_col_start_[next + 1]);
    }
  }

  // Moves every row on the path i0 -> meet_ (forward tree) -> a free column (backward tree).
  // Should the two halves share a column x (possible through zero-length cycles), the path
  // through the first such x from i0 is taken: it is no longer and is simple.
  void swap_along_path(int32_t i0) {
    ++path_stamp_;
    for (int32_t a = meet_;;) {
      on_back_path_[a] = path_stamp_;
      if (row_of_col_[a] < 0) break;
      a = succ_[a].col;
    }
    forward_path_.clear();  // columns from meet_ back to i0's first column
    for (int32_t j = meet_;;) {
      forward_path_.push_back(j);
      const int32_t r = pred_[j].row;
      if (r == i0) break;
      j = col_of_row_[r];
    }
    size_t cut = forward_path_.size() - 1;  // the first column from i0 on both halves
    while (on_back_path_[forward_path_[cut]] != path_stamp_) --cut;
    const int32_t x = forward_path_[cut];
    // Backward half first (its rows leave columns the forward half does not touch).
    int32_t sink = x;
    moves_.clear();
    while (row_of_col_[sink] >= 0) {
      const Succ next = succ_[sink];
      moves_.push_back(Move{row_of_col_[sink], next.col, next.cost});
      sink = next.col;
    }
    for (size_t k = cut;; ++k) {
      const int32_t j = forward_path_[k];
      moves_.push_back(Move{pred_[j].row, j, pred_[j].cost});
      if (k + 1 == forward_path_.size()) break;
    }
    for (const Move& mv : moves_) assign(mv.row, mv.col, mv.cost);
    drop_free_col(sink);
  }

  void update_row_state(int32_t i) {
    const int32_t j = col_of_row_[i];
    row_state_[i] = RowState{j < 0 ? T(0) : row_cost_[i] - cols_[j].price, j};
  }

  void drop_free_col(int32_t j) {
    const int32_t pos = free_pos_[j], last = free_cols_.back();
    free_cols_[pos] = last;
    free_pos_[last] = pos;
    free_cols_.pop_back();
    free_pos_[j] = -1;
  }

  // How the backward search reached a column: its row moves on to column `col` over an
  // edge of cost `cost` on the way to a free column.
  struct Succ {
    T cost;
    int32_t col;
  };
  // What the backward search reads of a row, in one place: its column (-1 if free) and its
  // dual u = c(row, col) - v_col, the least reduced cost of its edges.
  struct RowState {
    T u;
    int32_t col;
  };
  struct Move {
    int32_t row, col;
    T cost;
  };

  const Graph<T>& g_;
  std::vector<Column> cols_;      // prices and search state
  std::vector<T> row_cost_;       // cost of each matched row's edge
  std::vector<int32_t> col_of_row_, row_of_col_;
  std::vector<Pred> pred_;
  MinHeap<T> heap_;               // stale entries are skipped when popped
  std::vector<int32_t> scanned_;  // columns whose distance became final before the sink's
  T bound_ = T(0);      // the distance of the nearest free column reached in this search
  int32_t sink_ = -1;   // that column
  int64_t search_ = 0;
  // augment_square's state (square problems only).
  std::vector<int64_t> by_col_start_;
  std::vector<Edge<T>> by_col_;
  std::vector<Succ> succ_;
  std::vector<RowState> row_state_;  // kept up to date by augment_square
  std::vector<int32_t> free_cols_, free_pos_, back_scanned_, forward_path_;
  std::vector<uint32_t> on_back_path_;
  std::vector<Move> moves_;
  MinHeap<T> back_heap_;
  uint32_t path_stamp_ = 0;
  T best_ = T(0);
  int32_t meet_ = -1;
};

// Solves g and writes the pairs in the caller's row order (g is the transpose when `transposed`).
template <typename W>
Status solve_graph(const Graph<W>& g, bool transposed, int64_t n_rows, int64_t* row_ind, int64_t* col_ind) {
  SparseSolver<W> solver(g);
  Status s = solver.solve();
  if (s != Status::Ok) return s;
  const std::vector<int32_t>& col_of_row = solver.col_of_row();
  if (!transposed) {
    for (int32_t i = 0; i < g.n; ++i) {
      row_ind[i] = i;
      col_ind[i] = col_of_row[i];
    }
  } else {
    // Solved the transpose: col_of_row maps original columns to original rows.
    std::vector<int32_t> col_of_orig_row(static_cast<size_t>(n_rows), -1);
    for (int32_t j = 0; j < g.n; ++j) col_of_orig_row[col_of_row[j]] = j;
    int64_t k = 0;
    for (int64_t i = 0; i < n_rows; ++i)
      if (col_of_orig_row[i] >= 0) {
        row_ind[k] = i;
        col_ind[k] = col_of_orig_row[i];
        ++k;
      }
  }
  return Status::Ok;
}

}  // namespace

template <typename T, typename I>
Status sparse_linear_sum_assignment(const I* indptr, const I* indices, const T* data, int64_t n_rows,
                                    int64_t n_cols, bool maximize, int64_t* row_ind, int64_t* col_ind) {
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (n_rows < 0 || n_cols < 0 || n_rows >= kMaxDim || n_cols >= kMaxDim) return Status::Invalid;
  const bool transposed = n_rows > n_cols;
  T largest = T(0);
  {
    Graph<T> g;
    const Status s = build_graph(indptr, indices, data, n_rows, n_cols, maximize, transposed, T(1), g, &largest);
    if (s != Status::Ok || g.n == 0) return s;
    if (!(largest > largest_direct_cost<T>(g.n, g.m))) return solve_graph(g, transposed, n_rows, row_ind, col_ind);
  }
  // Costs too large for the prices' arithmetic in T (cost_range.h): float in double, double
  // scaled by a power of two.
  const int64_t n = transposed ? n_cols : n_rows, m = transposed ? n_rows : n_cols;
  const double bound = largest_direct_cost<double>(n, m);
  const double scale = static_cast<double>(largest) > bound ? power_of_two_scale(largest, bound) : 1.0;
  Graph<double> g;
  double scaled_largest = 0.0;
  const Status s = build_graph(indptr, indices, data, n_rows, n_cols, maximize, transposed, scale, g, &scaled_largest);
  if (s != Status::Ok) return s;
  return solve_graph(g, transposed, n_rows, row_ind, col_ind);
}

template Status sparse_linear_sum_assignment<float, int32_t>(const int32_t*, const int32_t*, const float*, int64_t,
                                                             int64_t, bool, int64_t*, int64_t*);
template Status sparse_linear_sum_assignment<float, int64_t>(const int64_t*, const int64_t*, const float*, int64_t,
                                                             int64_t, bool, int64_t*, int64_t*);
template Status sparse_linear_sum_assignment<double, int32_t>(const int32_t*, const int32_t*, const double*,
                                                              int64_t, int64_t, bool, int64_t*, int64_t*);
template Status sparse_linear_sum_assignment<double, int64_t>(const int64_t*, const int64_t*, const double*,
                                                              int64_t, int64_t, bool, int64_t*, int64_t*);

}  // namespace pyperm::cpu
