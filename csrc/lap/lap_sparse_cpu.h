// Linear sum assignment of a sparse cost matrix on the CPU, with the semantics of
// scipy.sparse.csgraph.min_weight_full_bipartite_matching: only stored entries are edges.
//
// A shortest augmenting path solver in the manner of Jonker and Volgenant's LAPJVsp
// (R. Jonker, A. Volgenant, "A shortest augmenting path algorithm for dense and sparse
// linear assignment problems", Computing 38(4):325-340, 1987): column reduction and
// augmenting row reduction to start, then one Dijkstra search per free row over the
// stored edges with a 4-ary heap. When few free columns are left in a square problem, the
// nearest one is far and a search from the free row alone would settle most of the graph;
// a search that grows long is therefore joined by one backward from every free column over
// a transposed copy of the edges, and stops when the two frontiers' least distances sum to
// the best path found (bidirectional Dijkstra; I. Pohl, "Bi-directional search", Machine
// Intelligence 6:127-140, 1971). Rectangular problems follow D. F. Crouse, "On
// implementing 2D rectangular assignment algorithms", IEEE Trans. Aerospace and
// Electronic Systems 52(4):1679-1696, 2016: the duals of unmatched columns never move, so
// every partial matching is optimal for its rows. The matrix is never densified: memory
// is O(stored entries + n_rows + n_cols).
#pragma once
#include <cstdint>

#include "common/status.h"

namespace pyperm::cpu {

// Finds a matching of min(n_rows, n_cols) stored entries that minimises (or maximises)
// their sum.
//   indptr    [in]  n_rows + 1 offsets (CSR): row i's entries are [indptr[i], indptr[i+1]);
//                   indptr[0] == 0 and non-decreasing, else Invalid.
//   indices   [in]  indptr[n_rows] column indices in [0, n_cols) (else Invalid), in any
//                   order; a repeated (row, column) pair is two parallel edges.
//   data      [in]  indptr[n_rows] costs. An explicit zero is an edge. +inf (-inf when
//                   maximizing) is no edge; NaN or the other infinity is Invalid.
//   n_rows, n_cols  [in]  the shape; each below 2^31 (else Invalid).
//   maximize  [in]  maximise instead of minimise.
//   row_ind   [out] min(n_rows, n_cols) row indices, increasing.
//   col_ind   [out] the matching column of each row_ind entry.
// Returns Ok, Infeasible (no matching of that size uses only edges) or Invalid; the
// outputs are written only on Ok. One thread; no global state.
template <typename T, typename I>
Status sparse_linear_sum_assignment(const I* indptr, const I* indices, const T* data, int64_t n_rows,
                                    int64_t n_cols, bool maximize, int64_t* row_ind, int64_t* col_ind);

}  // namespace pyperm::cpu
