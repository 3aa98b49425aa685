// Device kernels for the greedy Birkhoff-von Neumann decomposition (see bvn_cpu.h for the
// method). One term of the max-weight variant (Tatro et al., eq. 54) on the device is
//   bvn_support_cost   cost = -R on the support of the residual R (R > 0), +inf off it;
//   lap_cuda.h's batch_solve_square_warm on that cost, warm-started from the previous
//                      term's column duals (the terms change little from one to the next);
//   bvn_subtract_term  alpha = min_i R[i, perm[i]], R -= alpha P, and the residual mass.
// The loop over terms (stopping rules, progress reporting) is pyperm/bvn/_cuda.py's.
// Declared without cuda_runtime.h: streams are void* (a cudaStream_t).
#pragma once
#include <cstdint>

namespace pyperm::cuda {

// cost[i][j] = R[i][j] > 0 ? -R[i][j] : +inf, for contiguous n x n device matrices.
template <typename T>
void bvn_support_cost(const T* residual, int64_t n, T* cost, int device, void* stream);

// One term: alpha = min_i R[i, perm[i]] over the n matched entries (all > 0), then
// R[i, perm[i]] -= alpha, with bvn_cpu.cpp's zeroing rule: the entry that gave alpha becomes
// exactly 0, and so does an entry left at rounding noise, small next to 32 machine epsilons of
// both max(d_max, noise_ref) and max(D[i, perm[i]], noise_ref), where noise_ref is the
// original value of the entry that gave alpha (alpha carries its rounding). Also computes the
// residual mass sum(R) / n after the update (in double, in a fixed order: deterministic).
//   residual [in,out] device, contiguous n x n.
//   original [in]     device, contiguous n x n: the matrix being decomposed (D).
//   d_max    [in]     max_ij D[i, j].
//   perm     [in]     device, n int64: the column of each row (a permutation).
//   alpha    [out]    host: the coefficient.
//   mass     [out]    host: the residual mass.
// Synchronises the stream (the two numbers are read back).
template <typename T>
void bvn_subtract_term(T* residual, const T* original, double d_max, int64_t n, const int64_t* perm, T* alpha,
                       double* mass, int device, void* stream);

}  // namespace pyperm::cuda
