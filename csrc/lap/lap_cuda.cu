// Jonker-Volgenant linear assignment on CUDA devices (see lap_cuda.h for the two strategies).
//
// R. Jonker and A. Volgenant, "A shortest augmenting path algorithm for dense and sparse
// linear assignment problems", Computing 38, 325-340 (1987); rectangular problems as in
// D. F. Crouse, "On implementing 2D rectangular assignment algorithms", IEEE TAES 52(4),
// 2016. The algorithm is the one of csrc/lap/lap_kernels.cpp (read that first): only the
// column duals v are stored, a row's dual is implied by its assigned column, and the
// invariant every phase keeps is "each assigned row's column minimises c[i][j] - v[j]".
//
// Kernels, in the order a solve runs them:
//   prepare_kernel   validates (NaN / wrong infinity -> Invalid) and, when needed, copies the
//                    input into a contiguous minimisation with n <= m (negated, transposed).
//   device_init_kernel (Device strategy, cooperative) column reduction, reduction transfer
//                    (square) or greedy rows (wide), then augmenting row reduction as rounds
//                    of parallel bids (below).
//   block_kernel     one block per problem: initialisation (Block strategy), augmenting row
//                    reduction, and the shortest augmenting paths.
//   finalize_kernel  writes row_ind / col_ind (undoing the transposition).
//
// Parallel augmenting row reduction. The sequential JV step takes a free row i, its two
// smallest reduced costs u1 <= u2 (columns j1, j2), lowers v[j1] by u2 - u1 and gives j1 to
// i, displacing j1's owner. Run for all free rows at once it becomes a Jacobi auction with
// zero increment: every free row bids u2 - u1 for j1, each column goes to its highest bid
// (ties: lowest row) and drops v by that bid. The invariant survives: the winner's column
// now ties its second best, and every other v only decreased in the round, which only
// raises the winner's other reduced costs. Zero bids (u1 == u2) are accepted only for free
// columns, so no row is ever displaced without progress. Rounds stop when no rows are free,
// nothing was bid, or the free count has not reached a new low for `patience` rounds; the
// rows still free go to the shortest-path phase, which is exact whatever state it starts from.
#include "lap/lap_cuda.h"

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "common/cuda_device.cuh"
#include "common/cuda_host.h"

namespace pyperm::cuda {
namespace {

namespace cg = cooperative_groups;
using dev::ArgMin;
using dev::TwoMin;

// Per-problem status codes in device memory; the values of pyperm::Status.
constexpr int32_t kOk = static_cast<int32_t>(Status::Ok);
constexpr int32_t kInfeasible = static_cast<int32_t>(Status::Infeasible);
constexpr int32_t kInvalid = static_cast<int32_t>(Status::Invalid);
constexpr int32_t kGuard = static_cast<int32_t>(Status::NotConverged);  // a safety bound tripped

// Dijkstra keys: bit 31 set for assigned columns, so that among equally short paths the
// search ends at a free column (fewer steps), then at the lowest index.
constexpr uint32_t kAssignedBit = 0x80000000u;
constexpr int kMaxDim = 0x3fffffff;  // n, m must leave bit 31 of a key free

enum Mode : int { kCold = 0, kWarm = 1, kContinue = 2 };

// ============================================================================ prepare
// Tiles of 32 x 32 through shared memory so the transposed writes stay coalesced.
// Grid: (column tiles, row tiles, problems), each dimension looping grid-stride.
template <typename T>
__global__ void __launch_bounds__(256) prepare_kernel(const T* __restrict__ in, int64_t batch, int64_t rows,
                                                      int64_t cols, int64_t sb, int64_t sr, int64_t sc,
                                                      bool maximize, bool transpose, T* __restrict__ out,
                                                      int32_t* __restrict__ status) {
  __shared__ T tile[32][33];
  const T infinity = dev::inf<T>();
  const T forbidden = maximize ? -infinity : infinity;
  const T sign = maximize ? T(-1) : T(1);
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tiles_c = (cols + 31) / 32, tiles_r = (rows + 31) / 32;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    for (int64_t tr = blockIdx.y; tr < tiles_r; tr += gridDim.y) {
      for (int64_t tc = blockIdx.x; tc < tiles_c; tc += gridDim.x) {
        const int64_t r0 = tr * 32, c0 = tc * 32;
        bool bad = false;
#pragma unroll
        for (int k = 0; k < 32; k += 8) {
          const int64_t r = r0 + ty + k, c = c0 + tx;
          if (r < rows && c < cols) {
            const T val = in[b * sb + r * sr + c * sc];
            bad |= isnan(val) || (isinf(val) && val != forbidden);
            if (out != nullptr) {
              if (transpose)
                tile[ty + k][tx] = sign * val;
              else
                out[(b * rows + r) * cols + c] = sign * val;
            }
          }
        }
        if (bad) atomicExch(&status[b], kInvalid);
        if (out != nullptr && transpose) {  // uniform: kernel arguments
          __syncthreads();
#pragma unroll
          for (int k = 0; k < 32; k += 8) {
            const int64_t c = c0 + ty + k, r = r0 + tx;
            if (c < cols && r < rows) out[(b * cols + c) * rows + r] = tile[tx][ty + k];
          }
          __syncthreads();  // the tile is refilled by the next iteration
        }
      }
    }
  }
}

// ============================================================================ block kernel
template <typename T>
struct BlockArgs {
  const T* cost;  // batch x n x m, contiguous, n <= m, finite or +inf
  int n, m;
  int mode;        // Mode
  int arr_passes;  // sequential augmenting row reduction passes
  int stage;       // copy the problem's matrix into shared memory
  int state_smem;  // keep the solver state in shared memory (else the global scratch below)
  T* v;            // batch x m column duals (in for kWarm/kContinue, out always)
  int32_t* x;      // batch x n column of each row (in for kContinue, out always)
  int32_t* y;      // batch x m row of each column (in for kContinue)
  // Global scratch, used when !state_smem: batch x m, batch x m, batch x m, batch x n, batch x n,
  // batch x n entries.
  T* d;
  int32_t* pred;
  uint8_t* done;
  int32_t* rows;
  int32_t* rtmp;
  uint64_t* rkey;
  int32_t* status;  // batch
};

// Byte offsets of the dynamic shared memory of block_kernel; the host sizes the launch with
// the same code the kernel uses to find its arrays.
struct SmemLayout {
  size_t cost = 0, v = 0, d = 0, rkey = 0, pred = 0, y = 0, x = 0, rows = 0, rtmp = 0, done = 0, total = 0;
  __host__ __device__ static size_t take(size_t& off, size_t bytes) {
    const size_t at = off;
    off += (bytes + 15) / 16 * 16;
    return at;
  }
  __host__ __device__ SmemLayout(int64_t n, int64_t m, size_t tsize, bool stage_cost, bool state) {
    size_t off = 0;
    cost = take(off, stage_cost ? static_cast<size_t>(n * m) * tsize : 0);
    if (state) {
      v = take(off, m * tsize);
      d = take(off, m * tsize);
      rkey = take(off, n * sizeof(uint64_t));
      pred = take(off, m * sizeof(int32_t));
      y = take(off, m * sizeof(int32_t));
      x = take(off, n * sizeof(int32_t));
      rows = take(off, n * sizeof(int32_t));
      rtmp = take(off, n * sizeof(int32_t));
      done = take(off, m);
    }
    total = off;
  }
};

// One block solves one problem. Every thread owns the columns j = tid (mod BLOCK) of the
// column arrays (v, d, pred, y, done): only the owner writes them during a scan, so scans
// need no atomics; scalar updates are made by thread 0 between barriers.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK) block_kernel(BlockArgs<T> a) {
  constexpr int NW = BLOCK / 32;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ ArgMin<T> am_buf[2][32];
  __shared__ TwoMin<T> tm_buf[2][32];
  __shared__ int s_warp_counts[32];
  __shared__ int s_k, s_todo, s_kept, s_count, s_flag;
  __shared__ long long s_budget;

  const int b = blockIdx.x;
  if (a.status[b] != kOk) return;  // invalid input or failed earlier: whole block leaves
  const T infinity = dev::inf<T>();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = a.n, m = a.m;
  const int64_t nm = static_cast<int64_t>(n) * m;
  const SmemLayout L(n, m, sizeof(T), a.stage != 0, a.state_smem != 0);

  const T* c = a.cost + b * nm;
  if (a.stage) {
    T* sc = reinterpret_cast<T*>(smem + L.cost);
    for (int64_t k = tid; k < nm; k += BLOCK) sc[k] = c[k];
    c = sc;  // made visible by the barrier below
  }
  T* const gv = a.v + static_cast<int64_t>(b) * m;
  int32_t* const gx = a.x + static_cast<int64_t>(b) * n;
  int32_t* const gy = a.y + static_cast<int64_t>(b) * m;
  T *v, *d;
  int32_t *pred, *y, *x, *rows, *rtmp;
  uint64_t* rkey;
  uint8_t* done;
  if (a.state_smem) {
    v = reinterpret_cast<T*>(smem + L.v);
    d = reinterpret_cast<T*>(smem + L.d);
    rkey = reinterpret_cast<uint64_t*>(smem + L.rkey);
    pred = reinterpret_cast<int32_t*>(smem + L.pred);
    y = reinterpret_cast<int32_t*>(smem + L.y);
    x = reinterpret_cast<int32_t*>(smem + L.x);
    rows = reinterpret_cast<int32_t*>(smem + L.rows);
    rtmp = reinterpret_cast<int32_t*>(smem + L.rtmp);
    done = smem + L.done;
  } else {
    v = gv;
    x = gx;
    y = gy;
    d = a.d + static_cast<int64_t>(b) * m;
    pred = a.pred + static_cast<int64_t>(b) * m;
    done = a.done + static_cast<int64_t>(b) * m;
    rows = a.rows + static_cast<int64_t>(b) * n;
    rtmp = a.rtmp + static_cast<int64_t>(b) * n;
    rkey = a.rkey + static_cast<int64_t>(b) * n;
  }
  auto cost_at = [&](int i, int j) -> T { return c[static_cast<int64_t>(i) * m + j]; };
  int am_par = 0, tm_par = 0;

  // ------------------------------------------------------------------ initial state
  if (a.mode != kCold && a.state_smem) {
    for (int j = tid; j < m; j += BLOCK) v[j] = gv[j];
  }
  if (a.mode == kContinue && a.state_smem) {
    for (int j = tid; j < m; j += BLOCK) y[j] = gy[j];
    for (int i = tid; i < n; i += BLOCK) x[i] = gx[i];
  }
  if (a.mode == kWarm) {
    for (int j = tid; j < m; j += BLOCK) y[j] = -1;
    for (int i = tid; i < n; i += BLOCK) x[i] = -1;
  }
  if (tid == 0) s_flag = 0;
  __syncthreads();

  if (a.mode == kCold && n == m) {
    // Column reduction: v[j] = min_i c[i][j], argmin in pred[j] (first minimum; a column
    // prefers its own row among ties, so a constant matrix gives the identity).
    for (int j = tid; j < m; j += BLOCK) {
      T best = infinity;
      int arg = 0;
#pragma unroll 8
      for (int i = 0; i < n; ++i) {
        const T cij = cost_at(i, j);
        if (cij < best) {
          best = cij;
          arg = i;
        }
      }
      if (cost_at(j, j) == best) arg = j;
      v[j] = best;
      pred[j] = arg;
      if (!(best < infinity)) atomicExch(&s_flag, 1);  // a column with every entry forbidden
    }
    for (int i = tid; i < n; i += BLOCK) {
      x[i] = -1;
      rtmp[i] = 0;
      rkey[i] = ~0ull;
    }
    __syncthreads();
    if (s_flag) {
      if (tid == 0) a.status[b] = kInfeasible;
      return;
    }
    // A row chosen by several columns keeps the one with the smallest v (ties: highest j,
    // as the CPU solver's descending loop), found with two rounds of atomics so the choice
    // does not depend on thread timing.
    for (int j = tid; j < m; j += BLOCK) {
      atomicMin(reinterpret_cast<unsigned long long*>(&rkey[pred[j]]),
                static_cast<unsigned long long>(dev::order_key(v[j])));
      atomicAdd(&rtmp[pred[j]], 1);
    }
    __syncthreads();
    for (int j = tid; j < m; j += BLOCK)
      if (dev::order_key(v[j]) == rkey[pred[j]]) atomicMax(&x[pred[j]], j);
    __syncthreads();
    for (int j = tid; j < m; j += BLOCK) {
      y[j] = x[pred[j]] == j ? pred[j] : -1;
      d[j] = v[j];  // d holds the transferred duals until every row has read the old ones
    }
    __syncthreads();
    // Reduction transfer: a row matched once moves its slack (the gap to its second best
    // column) onto its column. Reading the duals from before any transfer gives a slack no
    // larger than the sequential one, which keeps every assigned column a row minimum.
    for (int i = warp; i < n; i += NW) {
      if (rtmp[i] != 1) continue;  // warp-uniform
      const int j1 = x[i];
      T mu = infinity;
      for (int j = lane; j < m; j += 32) {
        if (j == j1) continue;
        const T h = cost_at(i, j) - v[j];
        mu = h < mu ? h : mu;
      }
      mu = dev::warp_min(mu);
      if (lane == 0 && mu < infinity) d[j1] = v[j1] - (mu - (cost_at(i, j1) - v[j1]));
    }
    __syncthreads();
    for (int j = tid; j < m; j += BLOCK) v[j] = d[j];
    __syncthreads();
  } else if (a.mode == kCold) {
    // Wide problem: v = 0 and each row takes its cheapest column unless a lower row took it
    // first (the CPU solver's sequential greedy, decided with an atomicMin per column).
    for (int j = tid; j < m; j += BLOCK) {
      v[j] = T(0);
      y[j] = INT_MAX;
    }
    __syncthreads();
    for (int i = warp; i < n; i += NW) {
      ArgMin<T> p = dev::argmin_empty<T>();
      for (int j = lane; j < m; j += 32) {
        const T h = cost_at(i, j);
        const ArgMin<T> q{h, static_cast<uint32_t>(j)};
        if (h < infinity && dev::argmin_less(q, p)) p = q;
      }
      p = dev::warp_argmin(p);
      if (lane == 0) {
        const int j1 = p.val < infinity ? static_cast<int>(p.key) : -1;
        rtmp[i] = j1;
        if (j1 >= 0) atomicMin(&y[j1], i);
      }
    }
    __syncthreads();
    for (int i = tid; i < n; i += BLOCK) {
      const int j1 = rtmp[i];
      x[i] = (j1 >= 0 && y[j1] == i) ? j1 : -1;
    }
    __syncthreads();
    for (int j = tid; j < m; j += BLOCK)
      if (y[j] == INT_MAX) y[j] = -1;
    __syncthreads();
  }

  // Free rows, increasing (warm: all of them).
  int nfree;
  if (a.mode == kWarm) {
    for (int i = tid; i < n; i += BLOCK) rows[i] = i;
    nfree = n;
  } else {
    nfree = dev::block_compact<NW>(
        n, [&](int i) { return x[i] < 0; }, [&](int pos, int i) { rows[pos] = i; }, s_warp_counts);
  }
  if (tid == 0) s_count = nfree;
  __syncthreads();

  // ------------------------------------------------ augmenting row reduction (sequential)
  // Exactly the CPU solver's loop, with each two-smallest scan spread over the block.
  for (int pass = 0; pass < a.arr_passes; ++pass) {
    if (tid == 0) {
      s_k = 0;
      s_todo = s_count;
      s_kept = 0;
      // Bound on the immediate retries, the CPU solver's for full row scans (n + 16): long
      // displacement chains cost more than the shortest paths they replace; nothing may hang.
      s_budget = static_cast<long long>(n) + 16;
    }
    __syncthreads();
    for (;;) {
      const int k = s_k;
      if (k >= s_todo) break;  // uniform: shared values read after a barrier
      const int i = rows[k];
      TwoMin<T> t = dev::twomin_empty<T>();
#pragma unroll 4
      for (int j = tid; j < m; j += BLOCK) {
        const T h = cost_at(i, j) - v[j];
        if (h < infinity) dev::twomin_offer(t, h, j);
      }
      t = dev::block_twomin<T, NW>(t, tm_buf, tm_par);
      if (tid == 0) {
        int kk = k + 1, kept = s_kept;
        long long budget = s_budget;
        if (!(t.u1 < infinity)) {
          rows[kept++] = i;  // every column forbidden so far: the shortest paths decide
        } else {
          int j1 = t.j1, i0 = y[j1];
          bool lowers = t.u1 < t.u2 && t.u2 < infinity;
          if (lowers) {
            const T lowered = v[j1] - (t.u2 - t.u1);
            // In float32 a gap far below v[j1]'s last digit leaves it unchanged: no lowering, so
            // the displaced row is not retried (two rows would trade the column until the budget ends).
            if (lowered < v[j1])
              v[j1] = lowered;
            else
              lowers = false;
          } else if (i0 >= 0 && t.j2 >= 0 && t.u1 == t.u2) {
            j1 = t.j2;
            i0 = y[j1];
          }
          if (i0 >= 0) x[i0] = -1;
          x[i] = j1;
          y[j1] = i;
          if (i0 >= 0) {
            if (lowers && --budget > 0)
              rows[--kk] = i0;  // try the displaced row at once
            else
              rows[kept++] = i0;
          }
        }
        s_k = kk;
        s_kept = kept;
        s_budget = budget;
      }
      __syncthreads();
    }
    if (tid == 0) s_count = s_kept;
    __syncthreads();
  }

  // ------------------------------------------------------- shortest augmenting paths
  const int nrows = s_count;
  for (int q = 0; q < nrows; ++q) {
    const int f = rows[q];
    ArgMin<T> loc = dev::argmin_empty<T>();
    for (int j = tid; j < m; j += BLOCK) {
      const T dj = cost_at(f, j) - v[j];
      d[j] = dj;
      pred[j] = f;
      done[j] = 0;
      const ArgMin<T> cand{dj, (y[j] >= 0 ? kAssignedBit : 0u) | static_cast<uint32_t>(j)};
      if (dev::argmin_less(cand, loc)) loc = cand;
    }
    int sink = -1;
    T dist = T(0);
    int fail = 0;
    for (int step = 0;; ++step) {
      const ArgMin<T> g = dev::block_argmin<T, NW>(loc, am_buf, am_par);
      if (!(g.val < infinity)) {  // no column reachable: no complete matching exists
        // or a NaN, which the argmin puts first (see ArgMin): a NaN cost the caller did not
        // check (the warm solve's) or a reduced cost that overflowed. Either way no answer.
        fail = isnan(g.val) ? kInvalid : kInfeasible;
        break;
      }
      if (step > m) {  // every step finishes a column; more steps than columns is a bug
        fail = kGuard;
        break;
      }
      const int j = static_cast<int>(g.key & ~kAssignedBit);
      if (!(g.key & kAssignedBit)) {
        sink = j;
        dist = g.val;
        break;
      }
      // Column j is finished; scan the row it is assigned to. v is constant during the
      // search (the duals change only after it), so these reads need no barrier.
      const int i = y[j];
      const T h = cost_at(i, j) - v[j] - g.val;
      loc = dev::argmin_empty<T>();
#pragma unroll 4
      for (int jj = tid; jj < m; jj += BLOCK) {
        if (jj == j) done[jj] = 1;
        if (done[jj]) continue;
        const T cred = cost_at(i, jj) - v[jj] - h;
        T dj = d[jj];
        if (cred < dj) {
          dj = cred;
          d[jj] = cred;
          pred[jj] = i;
        }
        const ArgMin<T> cand{dj, (y[jj] >= 0 ? kAssignedBit : 0u) | static_cast<uint32_t>(jj)};
        if (dev::argmin_less(cand, loc)) loc = cand;
      }
    }
    if (fail) {  // uniform; v is untouched, so nothing to restore
      if (tid == 0) a.status[b] = fail;
      return;
    }
    // Dual update of the finished columns, then the augmentation along pred.
    for (int j = tid; j < m; j += BLOCK)
      if (done[j]) v[j] = v[j] + (d[j] - dist);
    __syncthreads();
    if (tid == 0) {
      int j = sink, ok = 0;
      for (int guard = 0; guard <= n; ++guard) {
        const int i = pred[j];
        y[j] = i;
        const int prev = x[i];
        x[i] = j;
        if (i == f) {
          ok = 1;
          break;
        }
        if (prev < 0) break;  // only f is unassigned on the path
        j = prev;
      }
      s_flag = ok;
    }
    __syncthreads();
    if (!s_flag) {
      if (tid == 0) a.status[b] = kGuard;
      return;
    }
  }

  if (a.state_smem) {
    for (int j = tid; j < m; j += BLOCK) gv[j] = v[j];
    for (int i = tid; i < n; i += BLOCK) gx[i] = x[i];
  }
}

// ============================================================================ device init
template <typename T>
struct InitArgs {
  const T* cost;  // batch x n x m as for the block kernel
  int batch, n, m;
  int mode;  // kCold or kWarm
  T* v;
  int32_t* x;
  int32_t* y;
  int32_t* status;
  // scratch
  uint64_t* rkey;    // batch x n
  int32_t* rtmp;     // batch x n
  int32_t* carg;     // batch x m
  T* vnew;           // batch x m
  uint64_t* bidkey;  // 2 x batch x m
  int32_t* bidwin;   // 2 x batch x m
  T* rdelta;         // batch x n
  int32_t* rtgt;     // batch x n
  unsigned long long* counters;  // 9
  int max_rounds, patience;
  long long* out_rounds;
  long long* out_free;
};

// Cooperative kernel over the whole device: grid-stride loops over the columns and rows of
// all problems, separated by grid-wide barriers. It never returns early (that would hang
// grid.sync): failed problems are skipped inside the loops.
template <typename T>
__global__ void __launch_bounds__(512) device_init_kernel(InitArgs<T> a) {
  cg::grid_group grid = cg::this_grid();
  const T infinity = dev::inf<T>();
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int lane = threadIdx.x & 31;
  const int64_t gwarp = tid >> 5, nwarps = nthreads >> 5;
  const int n = a.n, m = a.m;
  const int64_t ncols = static_cast<int64_t>(a.batch) * m, nrows = static_cast<int64_t>(a.batch) * n;
  const int64_t nm = static_cast<int64_t>(n) * m;
  auto row_ptr = [&](int b, int i) { return a.cost + b * nm + static_cast<int64_t>(i) * m; };

  if (tid < 9) a.counters[tid] = 0;
  for (int64_t q = tid; q < 2 * ncols; q += nthreads) {
    a.bidkey[q] = 0;
    a.bidwin[q] = INT_MAX;
  }
  if (a.mode == kCold && n == m) {
    for (int64_t r = tid; r < nrows; r += nthreads) {
      a.x[r] = -1;
      a.rtmp[r] = 0;
      a.rkey[r] = ~0ull;
    }
    // Column reduction (see block_kernel for the rules).
    for (int64_t q = tid; q < ncols; q += nthreads) {
      const int b = static_cast<int>(q / m), j = static_cast<int>(q % m);
      if (a.status[b] != kOk) continue;
      const T* cb = a.cost + b * nm;
      T best = infinity;
      int arg = 0;
#pragma unroll 8
      for (int i = 0; i < n; ++i) {
        const T cij = cb[static_cast<int64_t>(i) * m + j];
        if (cij < best) {
          best = cij;
          arg = i;
        }
      }
      if (cb[static_cast<int64_t>(j) * m + j] == best) arg = j;
      a.v[q] = best;
      a.carg[q] = arg;
      if (!(best < infinity)) atomicExch(&a.status[b], kInfeasible);
    }
    grid.sync();
    for (int64_t q = tid; q < ncols; q += nthreads) {
      const int b = static_cast<int>(q / m);
      if (a.status[b] != kOk) continue;
      const int64_t r = static_cast<int64_t>(b) * n + a.carg[q];
      atomicMin(reinterpret_cast<unsigned long long*>(&a.rkey[r]),
                static_cast<unsigned long long>(dev::order_key(a.v[q])));
      atomicAdd(&a.rtmp[r], 1);
    }
    grid.sync();
    for (int64_t q = tid; q < ncols; q += nthreads) {
      const int b = static_cast<int>(q / m), j = static_cast<int>(q % m);
      if (a.status[b] != kOk) continue;
      const int64_t r = static_cast<int64_t>(b) * n + a.carg[q];
      if (dev::order_key(a.v[q]) == a.rkey[r]) atomicMax(&a.x[r], j);
    }
    grid.sync();
    for (int64_t q = tid; q < ncols; q += nthreads) {
      const int b = static_cast<int>(q / m), j = static_cast<int>(q % m);
      if (a.status[b] != kOk) continue;
      const int arg = a.carg[q];
      a.y[q] = a.x[static_cast<int64_t>(b) * n + arg] == j ? arg : -1;
      a.vnew[q] = a.v[q];
    }
    grid.sync();
    // Reduction transfer, one warp per row.
    for (int64_t r = gwarp; r < nrows; r += nwarps) {
      const int b = static_cast<int>(r / n), i = static_cast<int>(r % n);
      if (a.status[b] != kOk || a.rtmp[r] != 1) continue;  // warp-uniform
      const int j1 = a.x[r];
      const T* row = row_ptr(b, i);
      const T* vb = a.v + static_cast<int64_t>(b) * m;
      T mu = infinity;
      for (int j = lane; j < m; j += 32) {
        if (j == j1) continue;
        const T h = row[j] - vb[j];
        mu = h < mu ? h : mu;
      }
      mu = dev::warp_min(mu);
      if (lane == 0 && mu < infinity) a.vnew[static_cast<int64_t>(b) * m + j1] = vb[j1] - (mu - (row[j1] - vb[j1]));
    }
    grid.sync();
    for (int64_t q = tid; q < ncols; q += nthreads) a.v[q] = a.vnew[q];
  } else if (a.mode == kCold) {
    // Wide problems: greedy rows with v = 0 (see block_kernel).
    for (int64_t r = tid; r < nrows; r += nthreads) a.x[r] = -1;
    for (int64_t q = tid; q < ncols; q += nthreads) {
      a.v[q] = T(0);
      a.y[q] = INT_MAX;
    }
    grid.sync();
    for (int64_t r = gwarp; r < nrows; r += nwarps) {
      const int b = static_cast<int>(r / n), i = static_cast<int>(r % n);
      if (a.status[b] != kOk) continue;
      const T* row = row_ptr(b, i);
      ArgMin<T> p = dev::argmin_empty<T>();
      for (int j = lane; j < m; j += 32) {
        const T h = row[j];
        const ArgMin<T> cand{h, static_cast<uint32_t>(j)};
        if (h < infinity && dev::argmin_less(cand, p)) p = cand;
      }
      p = dev::warp_argmin(p);
      if (lane == 0) {
        const int j1 = p.val < infinity ? static_cast<int>(p.key) : -1;
        a.rtmp[r] = j1;
        if (j1 >= 0) atomicMin(&a.y[static_cast<int64_t>(b) * m + j1], i);
      }
    }
    grid.sync();
    for (int64_t r = tid; r < nrows; r += nthreads) {
      const int b = static_cast<int>(r / n), i = static_cast<int>(r % n);
      const int j1 = a.rtmp[r];
      if (a.status[b] == kOk && j1 >= 0 && a.y[static_cast<int64_t>(b) * m + j1] == i) a.x[r] = j1;
    }
    grid.sync();
    for (int64_t q = tid; q < ncols; q += nthreads)
      if (a.y[q] == INT_MAX) a.y[q] = -1;
  } else {  // kWarm: the duals are given, every row is free
    for (int64_t r = tid; r < nrows; r += nthreads) a.x[r] = -1;
    for (int64_t q = tid; q < ncols; q += nthreads) a.y[q] = -1;
  }
  grid.sync();

  // ------------------------------------------------------------ rounds of parallel bids
  long long best_free = LLONG_MAX, last_free = -1;
  int best_round = 0, round = 0;
  while (round < a.max_rounds) {
    const int p = round & 1;
    uint64_t* bidkey = a.bidkey + p * ncols;
    int32_t* bidwin = a.bidwin + p * ncols;
    unsigned long long* cnt = a.counters + 3 * (round % 3);
    // The other parity's bid arrays and the next round's counters were last read before the
    // previous barrier: reset them now for the next round.
    {
      uint64_t* key_next = a.bidkey + (p ^ 1) * ncols;
      int32_t* win_next = a.bidwin + (p ^ 1) * ncols;
      for (int64_t q = tid; q < ncols; q += nthreads) {
        key_next[q] = 0;
        win_next[q] = INT_MAX;
      }
      if (tid < 3) a.counters[3 * ((round + 1) % 3) + tid] = 0;
    }
    // Phase A: every free row bids, one warp per row (the first rounds have thousands of
    // free rows, so they spread over the whole device).
    unsigned long long my_free = 0, my_bids = 0;
    for (int64_t row = gwarp; row < nrows; row += nwarps) {
      const int b = static_cast<int>(row / n), i = static_cast<int>(row % n);
      // Every lane loads the same words, so the branch is warp-uniform.
      if (a.status[b] != kOk || a.x[row] >= 0) {
        if (lane == 0) a.rtgt[row] = -1;
        continue;
      }
      const T* crow = row_ptr(b, i);
      const T* vb = a.v + static_cast<int64_t>(b) * m;
      TwoMin<T> t = dev::twomin_empty<T>();
#pragma unroll 4
      for (int j = lane; j < m; j += 32) {
        const T h = crow[j] - vb[j];
        if (h < infinity) dev::twomin_offer(t, h, j);
      }
      t = dev::warp_twomin(t);
      if (lane == 0) {
        const int32_t* yb = a.y + static_cast<int64_t>(b) * m;
        int tgt = -1;
        T delta = T(0);
        if (t.u1 < infinity) {
          if (t.u2 < infinity && t.u1 < t.u2) {
            tgt = t.j1;  // a positive bid may displace the owner
            delta = t.u2 - t.u1;
          } else if (t.u2 < infinity) {  // u1 == u2: only a free column, no displacement
            tgt = yb[t.j1] < 0 ? t.j1 : (yb[t.j2] < 0 ? t.j2 : -1);
          } else if (yb[t.j1] < 0) {  // a single usable column, and it is free
            tgt = t.j1;
            delta = infinity;
          }
        }
        a.rtgt[row] = tgt;
        if (tgt >= 0) {
          a.rdelta[row] = delta;
          atomicMax(reinterpret_cast<unsigned long long*>(&bidkey[static_cast<int64_t>(b) * m + tgt]),
                    static_cast<unsigned long long>(dev::order_key(delta)));
          ++my_bids;
        }
        ++my_free;
      }
    }
    if (my_free) atomicAdd(&cnt[0], my_free);
    if (my_bids) atomicAdd(&cnt[1], my_bids);
    grid.sync();
    // Phase B: among the highest bids for a column, the lowest row wins.
    for (int64_t rr = tid; rr < nrows; rr += nthreads) {
      const int tgt = a.rtgt[rr];
      if (tgt < 0) continue;
      const int b = static_cast<int>(rr / n), i = static_cast<int>(rr % n);
      const int64_t col = static_cast<int64_t>(b) * m + tgt;
      if (dev::order_key(a.rdelta[rr]) == bidkey[col]) atomicMin(&bidwin[col], i);
    }
    grid.sync();
    // Phase C: winners take their columns. Columns, winners and displaced rows are all
    // distinct, so the writes do not conflict.
    unsigned long long my_takes = 0;
    for (int64_t rr = tid; rr < nrows; rr += nthreads) {
      const int tgt = a.rtgt[rr];
      if (tgt < 0) continue;
      const int b = static_cast<int>(rr / n), i = static_cast<int>(rr % n);
      const int64_t col = static_cast<int64_t>(b) * m + tgt;
      if (bidwin[col] != i) continue;
      const int old = a.y[col];
      if (old >= 0)
        a.x[static_cast<int64_t>(b) * n + old] = -1;
      else
        ++my_takes;
      a.y[col] = i;
      a.x[rr] = tgt;
      const T delta = a.rdelta[rr];
      if (delta > T(0) && delta < infinity) a.v[col] -= delta;
    }
    if (my_takes) atomicAdd(&cnt[2], my_takes);
    grid.sync();
    // Every thread reads the same counters after the barrier, so the decision is uniform.
    const volatile unsigned long long* vc = cnt;
    const long long nfree = static_cast<long long>(vc[0]), nbids = static_cast<long long>(vc[1]),
                    takes = static_cast<long long>(vc[2]);
    last_free = nfree - takes;
    if (last_free < best_free) {
      best_free = last_free;
      best_round = round;
    }
    ++round;
    if (last_free <= 0 || nbids == 0 || round - 1 - best_round >= a.patience) break;
  }
  if (tid == 0) {
    *a.out_rounds = round;
    *a.out_free = last_free;
  }
}

// ============================================================================ finalize
// One block per problem (grid-stride). Transposed problems were solved as n_cols x n_rows:
// map original rows to their columns, then list the matched rows in increasing order.
__global__ void __launch_bounds__(256) finalize_kernel(const int32_t* __restrict__ x, int batch, int n, int m,
                                                       bool transposed, const int32_t* __restrict__ status,
                                                       int32_t* __restrict__ map, int64_t* __restrict__ row_ind,
                                                       int64_t* __restrict__ col_ind) {
  constexpr int NW = 256 / 32;
  __shared__ int warp_counts[32];
  for (int b = blockIdx.x; b < batch; b += gridDim.x) {
    if (status[b] != kOk) continue;  // uniform
    const int32_t* xb = x + static_cast<int64_t>(b) * n;
    int64_t* rb = row_ind + static_cast<int64_t>(b) * n;
    int64_t* cb = col_ind + static_cast<int64_t>(b) * n;
    if (!transposed) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        rb[i] = i;
        cb[i] = xb[i];
      }
      continue;
    }
    int32_t* mb = map + static_cast<int64_t>(b) * m;
    for (int r = threadIdx.x; r < m; r += blockDim.x) mb[r] = -1;
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const int r = xb[j];
      if (r >= 0 && r < m) mb[r] = j;
    }
    __syncthreads();
    dev::block_compact<NW>(
        m, [&](int r) { return mb[r] >= 0; },
        [&](int pos, int r) {
          if (pos < n) {
            rb[pos] = r;
            cb[pos] = mb[r];
          }
        },
        warp_counts);
  }
}

__global__ void widen_kernel(const int32_t* __restrict__ x, int64_t count, int64_t* __restrict__ out) {
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < count;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[q] = x[q];
}

// ============================================================================ host side
template <typename T>
using BlockKernelPtr = void (*)(BlockArgs<T>);

template <typename T>
BlockKernelPtr<T> block_kernel_for(int threads) {
  switch (threads) {
    case 32: return block_kernel<T, 32>;
    case 64: return block_kernel<T, 64>;
    case 128: return block_kernel<T, 128>;
    case 256: return block_kernel<T, 256>;
    case 512: return block_kernel<T, 512>;
    case 1024: return block_kernel<T, 1024>;
    default: throw std::invalid_argument("threads must be a power of two from 32 to 1024");
  }
}

int next_pow2(int64_t v) {
  int p = 32;
  while (p < v && p < 1024) p <<= 1;
  return p;
}

// How the Block kernel is launched for a batch.
struct BlockPlan {
  int threads = 32;
  bool stage = false, state_smem = false;
  size_t smem = 0;
};

template <typename T>
BlockPlan plan_block(const DeviceInfo& info, int64_t batch, int64_t n, int64_t m, int threads_opt,
                     int stage_opt, int state_opt, int default_threads) {
  BlockPlan plan;
  plan.threads = threads_opt > 0 ? threads_opt : default_threads;
  BlockKernelPtr<T> kernel = block_kernel_for<T>(plan.threads);
  cudaFuncAttributes attr{};
  PYPERM_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const size_t limit = info.max_smem_optin > static_cast<int>(attr.sharedSizeBytes)
                           ? info.max_smem_optin - attr.sharedSizeBytes
                           : 0;
  // Resident blocks per SM for a given dynamic shared memory size.
  // The attribute is a ceiling, not a request: always the device's limit, so concurrent
  // callers (several Python threads) never lower it under each other's launches.
  PYPERM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit)));
  auto resident = [&](size_t bytes) {
    if (bytes > limit) return 0;
    int blocks = 0;
    PYPERM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, plan.threads, bytes));
    return blocks;
  };
  const size_t state_bytes = SmemLayout(n, m, sizeof(T), false, true).total;
  const size_t staged_bytes = SmemLayout(n, m, sizeof(T), true, true).total;
  const int64_t want = std::min<int64_t>(batch, static_cast<int64_t>(info.sms) * 64);
  const int global_res = resident(0);
  const int state_res = resident(state_bytes);
  // State in shared memory unless that would cost resident problems the batch needs.
  plan.state_smem = state_res > 0 && static_cast<int64_t>(state_res) * info.sms >=
                                         std::min<int64_t>(want, static_cast<int64_t>(global_res) * info.sms);
  if (state_opt == 0 && stage_opt == 1)
    throw std::invalid_argument("staging the matrix (stage=1) needs the state in shared memory");
  if (state_opt == 1 && state_res <= 0)
    throw std::invalid_argument("the solver state does not fit in shared memory (state_smem=1)");
  if (state_opt >= 0) plan.state_smem = state_opt == 1;
  if (stage_opt == 1) {
    if (resident(staged_bytes) <= 0)
      throw std::invalid_argument("the cost matrix does not fit in shared memory (stage=1)");
    plan.stage = plan.state_smem = true;
  } else if (stage_opt == -1 && plan.state_smem) {
    // Staging makes every scan a shared-memory read, but it is worth it only while the
    // whole batch still fits in one wave of resident blocks.
    const int staged_res = resident(staged_bytes);
    plan.stage = staged_res > 0 && static_cast<int64_t>(staged_res) * info.sms >= batch;
  }
  plan.smem = plan.stage ? staged_bytes : (plan.state_smem ? state_bytes : 0);
  if (resident(plan.smem) <= 0) throw std::runtime_error("the assignment kernel cannot be launched on this device");
  return plan;
}

template <typename T>
void launch_block(const BlockPlan& plan, BlockArgs<T> args, int64_t batch, cudaStream_t stream) {
  BlockKernelPtr<T> kernel = block_kernel_for<T>(plan.threads);  // attribute set by plan_block
  args.stage = plan.stage ? 1 : 0;
  args.state_smem = plan.state_smem ? 1 : 0;
  kernel<<<static_cast<unsigned>(batch), plan.threads, plan.smem, stream>>>(args);
  PYPERM_CUDA_CHECK_LAUNCH("the assignment block kernel");
}

bool use_device_strategy(const LapOptions& opt, const DeviceInfo& info, int64_t batch, int64_t n, int64_t m) {
  if (opt.method == LapMethod::Block) return false;
  if (opt.method == LapMethod::Device) {
    if (!info.cooperative) throw std::runtime_error("this device does not support cooperative launches");
    return true;
  }
  // Auto: the sequential augmenting row reduction of one block is fine for small problems;
  // from a few hundred columns on, its long chains of moves are better spent as parallel
  // rounds over the whole device.
  if (!info.cooperative || n < 64) return false;
  return m >= 512 || (m >= 256 && batch < info.sms);
}

template <typename T>
void check_dims(int64_t batch, int64_t n, int64_t m) {
  if (n > kMaxDim || m > kMaxDim || batch > INT_MAX)
    throw std::length_error("the CUDA assignment solver takes at most 2^30 - 1 rows and columns and 2^31 - 1 "
                            "problems");
}

// Runs the chosen strategy on prepared input (contiguous n x m per problem, n <= m,
// minimisation). v/x/y/status are batch-sized device arrays.
template <typename T>
void run_solver(const T* cost, int64_t batch, int64_t n, int64_t m, bool warm, T* v, int32_t* x, int32_t* y,
                int32_t* status, const LapOptions& opt, const DeviceInfo& info, cudaStream_t stream, Arena& arena,
                LapStats* stats) {
  const bool device = use_device_strategy(opt, info, batch, n, m);
  const bool square = n == m;
  BlockArgs<T> args{};
  args.cost = cost;
  args.n = static_cast<int>(n);
  args.m = static_cast<int>(m);
  args.v = v;
  args.x = x;
  args.y = y;
  args.status = status;
  BlockPlan plan;
  if (device) {
    args.mode = kContinue;
    args.arr_passes = 0;
    plan = plan_block<T>(info, batch, n, m, opt.threads, opt.stage_cost, opt.state_smem, next_pow2((m + 3) / 4));
  } else {
    args.mode = warm ? kWarm : kCold;
    args.arr_passes = (warm || square) ? 2 : 0;  // as the CPU solver
    // Every step of the solver is a scan and a reduction; one warp per problem (up to 16
    // columns a lane) needs no cross-warp stage and no barrier in its reductions, which
    // costs less than the extra loads. Wider problems get more warps.
    const int cap = batch >= 2 * info.sms ? 256 : 1024;
    plan = plan_block<T>(info, batch, n, m, opt.threads, opt.stage_cost, opt.state_smem,
                         std::min(cap, next_pow2((m + 15) / 16)));
  }

  // Scratch for the global-memory variant of the block kernel and for the device init.
  const size_t h_d = arena.reserve<T>(plan.state_smem ? 0 : batch * m);
  const size_t h_pred = arena.reserve<int32_t>(plan.state_smem ? 0 : batch * m);
  const size_t h_done = arena.reserve<uint8_t>(plan.state_smem ? 0 : batch * m);
  const size_t h_rows = arena.reserve<int32_t>(plan.state_smem ? 0 : batch * n);
  const size_t h_rtmp = arena.reserve<int32_t>(plan.state_smem ? 0 : batch * n);
  const size_t h_rkey = arena.reserve<uint64_t>(plan.state_smem ? 0 : batch * n);
  const size_t c_rkey = arena.reserve<uint64_t>(device ? batch * n : 0);
  const size_t c_rtmp = arena.reserve<int32_t>(device ? batch * n : 0);
  const size_t c_carg = arena.reserve<int32_t>(device ? batch * m : 0);
  const size_t c_vnew = arena.reserve<T>(device ? batch * m : 0);
  const size_t c_bidkey = arena.reserve<uint64_t>(device ? 2 * batch * m : 0);
  const size_t c_bidwin = arena.reserve<int32_t>(device ? 2 * batch * m : 0);
  const size_t c_rdelta = arena.reserve<T>(device ? batch * n : 0);
  const size_t c_rtgt = arena.reserve<int32_t>(device ? batch * n : 0);
  const size_t c_counters = arena.reserve<unsigned long long>(device ? 9 : 0);
  const size_t c_diag = arena.reserve<long long>(2);
  arena.allocate();
  long long* diag = arena.get<long long>(c_diag);
  PYPERM_CUDA_CHECK(cudaMemsetAsync(diag, 0, 2 * sizeof(long long), stream));

  if (device) {
    InitArgs<T> ia{};
    ia.cost = cost;
    ia.batch = static_cast<int>(batch);
    ia.n = static_cast<int>(n);
    ia.m = static_cast<int>(m);
    ia.mode = warm ? kWarm : kCold;
    ia.v = v;
    ia.x = x;
    ia.y = y;
    ia.status = status;
    ia.rkey = arena.get<uint64_t>(c_rkey);
    ia.rtmp = arena.get<int32_t>(c_rtmp);
    ia.carg = arena.get<int32_t>(c_carg);
    ia.vnew = arena.get<T>(c_vnew);
    ia.bidkey = arena.get<uint64_t>(c_bidkey);
    ia.bidwin = arena.get<int32_t>(c_bidwin);
    ia.rdelta = arena.get<T>(c_rdelta);
    ia.rtgt = arena.get<int32_t>(c_rtgt);
    ia.counters = arena.get<unsigned long long>(c_counters);
    ia.max_rounds = opt.max_rounds >= 0 ? opt.max_rounds : static_cast<int>(std::min<int64_t>(4 * n + 64, 1 << 20));
    ia.patience = opt.patience >= 0 ? std::max(1, opt.patience) : 128;
    ia.out_rounds = diag;
    ia.out_free = diag + 1;
    auto kernel = device_init_kernel<T>;
    constexpr int kThreads = 512;
    int per_sm = 0;
    PYPERM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
    if (per_sm <= 0) throw std::runtime_error("the assignment init kernel cannot be launched on this device");
    // Two blocks per SM at most: grid-wide barriers get slower with more blocks, and 32 warps
    // per SM already cover the first rounds' thousands of free rows.
    const int64_t work = std::max(batch * m, batch * n * 32);
    const int64_t blocks =
        std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(std::min(per_sm, 2)) * info.sms,
                                               (work + kThreads - 1) / kThreads));
    void* kargs[] = {&ia};
    // The kernel works with any grid size. Fewer SMs than the occupancy query assumes (an
    // MPS client's share, say) make the launch "too large": halve the grid and retry.
    cudaError_t err = cudaSuccess;
    for (int64_t g = blocks;; g = (g + 1) / 2) {
      err = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(static_cast<unsigned>(g)),
                                        dim3(kThreads), kargs, 0, stream);
      if (err != cudaErrorCooperativeLaunchTooLarge || g == 1) break;
      cudaGetLastError();  // launch errors are not sticky: clear it and try a smaller grid
    }
    PYPERM_CUDA_CHECK(err);
  }
  args.d = arena.get<T>(h_d);
  args.pred = arena.get<int32_t>(h_pred);
  args.done = arena.get<uint8_t>(h_done);
  args.rows = arena.get<int32_t>(h_rows);
  args.rtmp = arena.get<int32_t>(h_rtmp);
  args.rkey = arena.get<uint64_t>(h_rkey);
  launch_block<T>(plan, args, batch, stream);

  if (stats != nullptr) {
    long long host_diag[2] = {0, 0};
    PYPERM_CUDA_CHECK(cudaMemcpyAsync(host_diag, diag, sizeof(host_diag), cudaMemcpyDeviceToHost, stream));
    PYPERM_CUDA_CHECK(cudaStreamSynchronize(stream));
    stats->method = static_cast<int>(device ? LapMethod::Device : LapMethod::Block);
    stats->threads = plan.threads;
    stats->staged = plan.stage ? 1 : 0;
    stats->state_in_shared = plan.state_smem ? 1 : 0;
    stats->rounds = static_cast<int>(host_diag[0]);
    stats->free_rows = host_diag[1];
  }
}

// Copies the per-problem status back (this synchronises the stream) and reports the lowest
// failing problem.
Status collect_status(const int32_t* status, int64_t batch, int64_t* failed, cudaStream_t stream) {
  std::vector<int32_t> host(static_cast<size_t>(batch));
  PYPERM_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), status, host.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  PYPERM_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int64_t b = 0; b < batch; ++b) {
    if (host[b] != kOk) {
      if (failed != nullptr) *failed = b;
      return static_cast<Status>(host[b]);
    }
  }
  return Status::Ok;
}

}  // namespace

template <typename T>
Status batch_linear_sum_assignment(const T* cost, int64_t batch, int64_t n_rows, int64_t n_cols, int64_t stride_b,
                                   int64_t stride_r, int64_t stride_c, bool maximize, int64_t* row_ind,
                                   int64_t* col_ind, int64_t* failed, int device, void* stream_handle,
                                   const LapOptions& options, LapStats* stats) {
  if (batch == 0 || n_rows == 0 || n_cols == 0) return Status::Ok;
  const bool transpose = n_rows > n_cols;
  const int64_t n = transpose ? n_cols : n_rows, m = transpose ? n_rows : n_cols;
  check_dims<T>(batch, n, m);
  DeviceGuard guard(device);
  const DeviceInfo info = device_info(device);
  cudaStream_t stream = as_stream(stream_handle);
  const bool contiguous =
      stride_c == 1 && stride_r == n_cols && (batch == 1 || stride_b == n_rows * n_cols);
  const bool copy = transpose || maximize || !contiguous;

  Arena arena(stream);
  const size_t h_status = arena.reserve<int32_t>(batch);
  const size_t h_work = arena.reserve<T>(copy ? batch * n * m : 0);
  const size_t h_v = arena.reserve<T>(batch * m);
  const size_t h_x = arena.reserve<int32_t>(batch * n);
  const size_t h_y = arena.reserve<int32_t>(batch * m);
  const size_t h_map = arena.reserve<int32_t>(transpose ? batch * m : 0);
  arena.allocate();
  int32_t* status = arena.get<int32_t>(h_status);
  T* work = copy ? arena.get<T>(h_work) : nullptr;
  PYPERM_CUDA_CHECK(cudaMemsetAsync(status, 0, batch * sizeof(int32_t), stream));

  {
    const int64_t tiles_c = (n_cols + 31) / 32, tiles_r = (n_rows + 31) / 32;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tiles_c, 1024)),
                    static_cast<unsigned>(std::min<int64_t>(tiles_r, 1024)),
                    static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
    prepare_kernel<T><<<grid, dim3(32, 8), 0, stream>>>(cost, batch, n_rows, n_cols, stride_b, stride_r, stride_c,
                                                        maximize, transpose, work, status);
    PYPERM_CUDA_CHECK_LAUNCH("the input check");
  }
  const T* prepared = copy ? work : cost;

  Arena solver_arena(stream);
  run_solver<T>(prepared, batch, n, m, false, arena.get<T>(h_v), arena.get<int32_t>(h_x), arena.get<int32_t>(h_y),
                status, options, info, stream, solver_arena, stats);

  finalize_kernel<<<static_cast<unsigned>(std::min<int64_t>(batch, 65535)), 256, 0, stream>>>(
      arena.get<int32_t>(h_x), static_cast<int>(batch), static_cast<int>(n), static_cast<int>(m), transpose, status,
      transpose ? arena.get<int32_t>(h_map) : nullptr, row_ind, col_ind);
  PYPERM_CUDA_CHECK_LAUNCH("the assignment output kernel");
  return collect_status(status, batch, failed, stream);
}

template <typename T>
Status batch_solve_square_warm(const T* cost, int64_t batch, int64_t n, T* v, int64_t* col_of_row, int64_t* failed,
                               int device, void* stream_handle, const LapOptions& options, LapStats* stats) {
  if (batch == 0 || n == 0) return Status::Ok;
  check_dims<T>(batch, n, n);
  DeviceGuard guard(device);
  const DeviceInfo info = device_info(device);
  cudaStream_t stream = as_stream(stream_handle);
  Arena arena(stream);
  const size_t h_status = arena.reserve<int32_t>(batch);
  const size_t h_x = arena.reserve<int32_t>(batch * n);
  const size_t h_y = arena.reserve<int32_t>(batch * n);
  arena.allocate();
  int32_t* status = arena.get<int32_t>(h_status);
  int32_t* x = arena.get<int32_t>(h_x);
  PYPERM_CUDA_CHECK(cudaMemsetAsync(status, 0, batch * sizeof(int32_t), stream));
  Arena solver_arena(stream);
  run_solver<T>(cost, batch, n, n, true, v, x, arena.get<int32_t>(h_y), status, options, info, stream, solver_arena,
                stats);
  widen_kernel<<<grid_for(batch * n, 256, 4096), 256, 0, stream>>>(x, batch * n, col_of_row);
  PYPERM_CUDA_CHECK_LAUNCH("the assignment output kernel");
  return collect_status(status, batch, failed, stream);
}

template Status batch_linear_sum_assignment<float>(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                   bool, int64_t*, int64_t*, int64_t*, int, void*, const LapOptions&,
                                                   LapStats*);
template Status batch_linear_sum_assignment<double>(const double*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                    int64_t, bool, int64_t*, int64_t*, int64_t*, int, void*,
                                                    const LapOptions&, LapStats*);
template Status batch_solve_square_warm<float>(const float*, int64_t, int64_t, float*, int64_t*, int64_t*, int, void*,
                                               const LapOptions&, LapStats*);
template Status batch_solve_square_warm<double>(const double*, int64_t, int64_t, double*, int64_t*, int64_t*, int,
                                                void*, const LapOptions&, LapStats*);

}  // namespace pyperm::cuda
