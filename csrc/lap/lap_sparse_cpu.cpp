#include "lap/lap_sparse_cpu.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace pyperm::cpu {
namespace {

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

// Copies the caller's CSR into g: negated when maximizing, forbidden entries dropped, and
// transposed (a counting sort by column) when the matrix is tall, so that every row can
// be matched. The structure and the numbers are checked on the way.
template <typename T, typename I>
Status build_graph(const I* indptr, const I* indices, const T* data, int64_t n_rows, int64_t n_cols,
                   bool maximize, bool transpose, Graph<T>& g) {
  const T inf = std::numeric_limits<T>::infinity();
  const T sign = maximize ? T(-1) : T(1);
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
      const T c = sign * data[k];
      if (!(c > -inf)) return Status::Invalid;  // NaN fails the comparison too
      if (c == inf) continue;                   // a forbidden pair is no edge
      ++g.start[static_cast<size_t>((transpose ? j : i) + 1)];
    }
  }
  for (int64_t r = 0; r < n; ++r) g.start[r + 1] += g.start[r];
  g.edges.resize(static_cast<size_t>(g.start[n]));
  // Second pass: place the edges (a cursor per working row).
  std::vector<int64_t> cursor(g.start.begin(), g.start.end() - 1);
  for (int64_t i = 0; i < n_rows; ++i) {
    for (int64_t k = indptr[i]; k < indptr[i + 1]; ++k) {
      const T c = sign * data[k];
      if (c == inf) continue;
      const int64_t j = indices[k];
      const int64_t row = transpose ? j : i;
      g.edges[cursor[row]++] = Edge<T>{c, static_cast<int32_t>(transpose ? i : j)};
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
        cols_(static_cast<size_t>(g.m), Column{T(0), T(0), 0u}),
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
    for (int pass = 0; pass < 2 && !free_rows.empty(); ++pass) free_rows = reduce_rows(free_rows);
    for (int32_t i : free_rows) {
      Status s = augment(i);
      if (s != Status::Ok) return s;
    }
    return Status::Ok;
  }

  const std::vector<int32_t>& col_of_row() const { return col_of_row_; }

 private:
  // What a search reads for every edge it looks at, together in one cache line: the
  // column's price, its distance, and which search last touched it (`mark`: 2 * search
  // when reached, 2 * search + 1 when its distance is final).
  struct Column {
    T price;
    T dist;
    uint32_t mark;
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
  // never lowered unless taken, so the invariant holds. Returns the rows still free.
  std::vector<int32_t> reduce_rows(std::vector<int32_t> rows) {
    const T inf = std::numeric_limits<T>::infinity();
    std::vector<int32_t> still_free;
    // Displaced rows are retried at once only within a budget of row scans, so a pass stays
    // linear in the matrix size; the rest go to the shortest path phase.
    int64_t budget = 2 * static_cast<int64_t>(rows.size()) + 16;
    size_t k = 0;
    while (k < rows.size()) {
      const int32_t i = rows[k++];
      RowMin r = row_min(i);
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
    return still_free;
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
};

}  // namespace

template <typename T, typename I>
Status sparse_linear_sum_assignment(const I* indptr, const I* indices, const T* data, int64_t n_rows,
                                    int64_t n_cols, bool maximize, int64_t* row_ind, int64_t* col_ind) {
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (n_rows < 0 || n_cols < 0 || n_rows >= kMaxDim || n_cols >= kMaxDim) return Status::Invalid;
  const bool transposed = n_rows > n_cols;
  Graph<T> g;
  Status s = build_graph(indptr, indices, data, n_rows, n_cols, maximize, transposed, g);
  if (s != Status::Ok || g.n == 0) return s;
  SparseSolver<T> solver(g);
  s = solver.solve();
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

template Status sparse_linear_sum_assignment<float, int32_t>(const int32_t*, const int32_t*, const float*, int64_t,
                                                             int64_t, bool, int64_t*, int64_t*);
template Status sparse_linear_sum_assignment<float, int64_t>(const int64_t*, const int64_t*, const float*, int64_t,
                                                             int64_t, bool, int64_t*, int64_t*);
template Status sparse_linear_sum_assignment<double, int32_t>(const int32_t*, const int32_t*, const double*,
                                                              int64_t, int64_t, bool, int64_t*, int64_t*);
template Status sparse_linear_sum_assignment<double, int64_t>(const int64_t*, const int64_t*, const double*,
                                                              int64_t, int64_t, bool, int64_t*, int64_t*);

}  // namespace pyperm::cpu
