// Linear sum assignment on CUDA devices: the semantics of lap_cpu.h (scipy's), on device
// memory and on the caller's stream. Declared without cuda_runtime.h so the bindings compile
// with the host compiler: streams are passed as void* (a cudaStream_t).
//
// Two strategies solve a batch of problems (a single problem is a batch of one):
//  - Block: one thread block per problem runs the whole Jonker-Volgenant solver of
//    csrc/lap/lap_kernels.cpp (column reduction with reduction transfer, augmenting row
//    reduction, shortest augmenting paths), every O(m) column scan spread over the block's
//    threads with a block-wide argmin. The matrix is staged in shared memory when that does
//    not cost occupancy the batch needs. Made for many small problems.
//  - Device: the initialisation runs on the whole device (column reduction, reduction
//    transfer, then augmenting row reduction as parallel rounds in which every free row of
//    every problem bids at once, a cooperative kernel with grid-wide barriers); then one
//    block of up to 1024 threads per problem finishes the few rows left with shortest
//    augmenting paths. Made for large problems (n in the thousands).
// Both give optimal assignments; ties are broken by lowest index, so results are
// deterministic for a given input, device and strategy.
#pragma once
#include <cstdint>

#include "common/status.h"

namespace pyperm::cuda {

enum class LapMethod : int { Auto = 0, Block = 1, Device = 2 };

// Tuning knobs; the defaults (all "auto") are what the Python API uses.
struct LapOptions {
  LapMethod method = LapMethod::Auto;
  int threads = 0;      // threads per block of the Block kernel: 0 = auto, else 32..1024, a power of 2
  int stage_cost = -1;  // Block kernel: -1 auto, 0 read the matrix from global memory, 1 stage it in shared memory
  int state_smem = -1;  // Block kernel: -1 auto, 0 keep the solver state in global memory, 1 in shared memory
  int max_rounds = -1;  // Device strategy: cap on parallel bidding rounds (-1 = auto)
  int patience = -1;    // Device strategy: stop bidding after this many rounds without a new low in free rows
};

// What a solve did, for benchmarks and tests (not part of the result).
struct LapStats {
  int method = 0;            // the LapMethod used
  int threads = 0;           // threads per block of the Block kernel
  int staged = 0;            // 1 when the matrix was staged in shared memory
  int state_in_shared = 0;   // 1 when the per-problem solver state lived in shared memory
  int rounds = 0;            // Device strategy: bidding rounds run
  int64_t free_rows = 0;     // Device strategy: rows left to the shortest-path phase (all problems)
};

// Solves `batch` independent problems.
//   cost        [in]  device pointer to element (0, 0, 0) of a batch x n_rows x n_cols array with
//                     element strides stride_b, stride_r, stride_c (any layout; copied when needed).
//                     +inf (-inf when maximizing) forbids a pair; NaN or the other infinity is Invalid.
//   maximize    [in]  maximise instead of minimise.
//   row_ind     [out] device, batch x min(n_rows, n_cols) int64, each row increasing.
//   col_ind     [out] device, batch x min(n_rows, n_cols) int64.
//   failed      [out] on failure, the lowest failing problem's index.
//   device      [in]  the CUDA device that holds the pointers.
//   stream      [in]  cudaStream_t to run on (the caller's); the call synchronises it before returning,
//                     because the status must be read back.
// Returns Ok, Infeasible or Invalid (of the lowest failing problem); NotConverged means an internal
// safety bound was hit (a bug, never expected). CUDA errors throw std::runtime_error.
template <typename T>
Status batch_linear_sum_assignment(const T* cost, int64_t batch, int64_t n_rows, int64_t n_cols,
                                   int64_t stride_b, int64_t stride_r, int64_t stride_c, bool maximize,
                                   int64_t* row_ind, int64_t* col_ind, int64_t* failed, int device,
                                   void* stream, const LapOptions& options = {}, LapStats* stats = nullptr);

// Square minimisation warm-started from column duals, for sequences of similar problems (the terms
// of a Birkhoff-von Neumann decomposition, PAM's permutation steps). The device twin of
// cpu::solve_square_warm, batched.
//   cost        [in]     device, contiguous batch x n x n, finite or +inf entries only (not checked).
//   v           [in,out] device, batch x n column duals: any finite values on entry (the previous
//                        solve's are a good start), the final duals on return.
//   col_of_row  [out]    device, batch x n int64.
//   failed      [out]    on failure, the lowest failing problem's index.
// Returns Ok or Infeasible, or Invalid when a NaN reached the search (NotConverged: internal
// safety bound, see above).
template <typename T>
Status batch_solve_square_warm(const T* cost, int64_t batch, int64_t n, T* v, int64_t* col_of_row,
                               int64_t* failed, int device, void* stream, const LapOptions& options = {},
                               LapStats* stats = nullptr);

}  // namespace pyperm::cuda
