// A min-cost square assignment solver that keeps its matching and duals between solves,
// for sequences of problems where entries only get more expensive: the terms of a
// max-weight Birkhoff-von Neumann decomposition, where each term raises the cost of the n
// entries of the previous matching.
//
// Jonker-Volgenant (Computing 38, 1987) with only column duals v stored: a matched row's
// dual is implied by its column, u_i = c[i, x_i] - v[x_i]. Before each solve the invariant
// "every matched edge is a minimum of its row's reduced costs" is restored by un-matching
// the rows whose edge stopped being one; only those rows are re-assigned (four bounded
// passes of augmenting row reduction, then shortest augmenting paths), and all other rows
// and every column dual carry over.
//
// Why not lap_cpu.h's solve_square_warm: it restarts from the duals alone, with every row
// free, and its augmenting row reduction can spend many O(n) moves per row on these
// near-degenerate problems (measured on dense n = 1024 decompositions: 30 ms per term at
// the median, up to 1 s for some terms). Keeping the matching makes each term re-augment
// only the rows that lost optimality (about a third of them on those matrices, and row
// reduction settles most of those: 1-7 ms per term with AVX-512). The decomposition still
// uses solve_square_warm for its first, cold, solve (faster than this solver's cold start)
// and hands the result over with warm_start().
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/cpu_features.h"
#include "common/status.h"

namespace pyperm::cpu {

template <typename T>
class IncrementalAssignment {
 public:
  // Index type of the predecessor array: as wide as T, so the SIMD lanes line up.
  using Index = std::conditional_t<sizeof(T) == 8, int64_t, int32_t>;

  // cost: row-major n x n, finite or +inf (forbidden) entries, owned by the caller, who may
  // raise entries (never lower them) between solve() calls. It must outlive this object.
  // isa: which SIMD variant the O(n) scans use.
  IncrementalAssignment(const T* cost, int64_t n, Isa isa);

  // Starts from a given assignment and column duals (e.g. another solver's optimum). Any
  // values are accepted: solve() un-matches whatever violates the invariant.
  void warm_start(const int64_t* col_of_row, const T* v);

  // Minimum-cost perfect matching of the current costs. col_of_row: [out] n entries.
  // Returns Ok, or Infeasible when no matching avoids the +inf entries (the state is then
  // unspecified: make a new solver).
  Status solve(int64_t* col_of_row);

  // Rows the last solve() needed a shortest augmenting path for (for benchmarks).
  int64_t last_augmentations() const { return augmentations_; }

 private:
  bool augment(int64_t f);
  void reduce_rows(std::vector<int64_t>& free_rows);
  const T* row(int64_t i) const { return c_ + i * n_; }
  // Every write of y_ goes through here, so that free_ mirrors it.
  void set_y(int64_t j, int64_t i) {
    y_[j] = i;
    free_[j] = i < 0 ? Index(-1) : Index(0);
  }

  struct Done { int64_t j; T v; T d; };

  const T* c_;
  int64_t n_;
  Isa isa_;
  bool started_ = false;
  int64_t augmentations_ = 0;
  std::vector<T> v_, d_;
  std::vector<Index> pred_;
  std::vector<Index> free_;  // all ones for a column no row holds (the SIMD scans read it)
  std::vector<int64_t> x_, y_;
  std::vector<Done> done_;
};

}  // namespace pyperm::cpu
