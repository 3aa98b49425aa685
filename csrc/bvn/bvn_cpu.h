// Birkhoff-von Neumann decomposition of doubly stochastic matrices on the CPU.
//
// Every doubly stochastic D is a convex combination sum_t alpha_t P_t of permutation
// matrices (Birkhoff 1946, von Neumann 1953). The greedy heuristics here build one term at
// a time: take a perfect matching P on the support of the residual R (initially D), set
// alpha to the smallest entry of R on it, subtract alpha P, repeat. They differ in the
// matching (Tatro et al., "Optimizing Mode Connectivity via Neuron Alignment", NeurIPS 2020,
// appendix E.4; Dufosse and Ucar, "Notes on Birkhoff-von Neumann decomposition of doubly
// stochastic matrices", Linear Algebra Appl. 497, 2016):
//   MaxWeight   eq. 54: the matching of largest total weight sum_i R[i, P(i)], solved as a
//               min-cost assignment (cost -R, +inf off the support): the first term cold by
//               lap_cpu.h's solve_square_warm, the others by a solver that keeps the previous
//               term's matching and column duals (incremental_assignment.h).
//   Bottleneck  eq. 55: the matching whose smallest entry is largest (the classic greedy
//               Birkhoff heuristic), found by a threshold search that repairs the previous
//               term's matching (see bvn_cpu.cpp).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "common/cpu_features.h"
#include "common/status.h"

namespace pyperm::cpu {

enum class BvnMethod : int {
  MaxWeight = 0,
  Bottleneck = 1,
  // The same terms as MaxWeight, each solved by lap_cpu.h's solve_square_warm from the
  // previous column duals alone. Kept to compare the two warm starts (pyperm bench bvn).
  MaxWeightLapWarm = 2,
};

// Why a decomposition stopped.
enum class BvnStop : int {
  Converged = 0,   // residual mass <= tol
  MaxTerms = 1,    // max_terms terms were taken
  NoMatching = 2,  // the residual's support has no perfect matching: what is left is rounding
                   // noise, or D was only approximately doubly stochastic
  Cancelled = 3,   // the progress callback returned false
};

// Called after each term with (terms so far, that term's coefficient, residual mass).
// Returning false stops the decomposition after that term.
using BvnProgress = std::function<bool(int64_t, double, double)>;

template <typename T>
struct BvnResult {
  std::vector<T> coeffs;       // k coefficients, in the order the terms were found
  std::vector<int64_t> perms;  // k x n, row-major: perms[t * n + i] is the column of row i in term t
  double residual_mass = 0;    // sum of the residual's entries divided by n, when it stopped
  BvnStop stop = BvnStop::Converged;
};

// Greedy Birkhoff-von Neumann decomposition.
//   D          [in]  row-major, contiguous n x n matrix; entries <= 0 are outside the support.
//                    The caller checks that D is (close to) doubly stochastic; the kernel only
//                    needs finite entries.
//   n          [in]  order of D (n >= 0).
//   method     [in]  MaxWeight or Bottleneck.
//   max_terms  [in]  stop after this many terms (< 0: no limit; each term removes at least one
//                    entry from the support, so there are at most nnz(D) terms).
//   tol        [in]  stop when the residual mass sum(R) / n is <= tol.
//   progress   [in]  optional (may be null), see BvnProgress. Exceptions it throws propagate.
//   isa        [in]  kernel variant of the assignment solver (MaxWeight only).
//   out        [out] coefficients, permutations, residual mass and stop reason.
// Entries of R that an update leaves within 32 machine epsilons of zero (relative to the
// entries involved) are removed from the support, so that rounding never adds spurious terms.
// Returns Ok, or Invalid when D contains NaN or an infinity (out is then untouched).
template <typename T>
Status birkhoff_decomposition(const T* D, int64_t n, BvnMethod method, int64_t max_terms, double tol,
                              const BvnProgress* progress, Isa isa, BvnResult<T>* out);

// Bottleneck perfect matching of a non-negative n x n matrix A (row-major): a permutation
// maximising min_i A[i, col_of_row[i]] over the matchings inside the support (A > 0).
// col_of_row [out] n entries. *value [out] the bottleneck value.
// Returns Ok, Infeasible (no perfect matching on the support) or Invalid (NaN or infinity).
template <typename T>
Status bottleneck_matching(const T* A, int64_t n, int64_t* col_of_row, T* value);

}  // namespace pyperm::cpu
