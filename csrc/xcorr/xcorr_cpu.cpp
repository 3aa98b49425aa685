#include "xcorr/xcorr_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/thread_pool.h"
#include "xcorr/xcorr_kernels.h"

namespace pyperm::cpu {
namespace {

// Tiles of the sample matrix: a row block of samples by a column block of channels. Fixed
// sizes (never derived from the thread count) keep the summation order, and so the result,
// independent of how many threads run.
constexpr int64_t kRowBlock = 256;
constexpr int64_t kColBlock = 512;
// Elements of work per thread below which waking one of the pool's workers costs more than it
// saves (see common/thread_pool.h; the pool also keeps to idle cores).
constexpr int64_t kGrain = int64_t{1} << 18;
// Elements per task of the matrix kernels: small enough to balance, large enough to amortise.
constexpr int64_t kTask = int64_t{1} << 15;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int clamp_threads(int threads, int64_t work) {
  if (threads <= 0) threads = hardware_threads();
  const int64_t useful = std::max<int64_t>(1, work / kGrain);
  return static_cast<int>(std::min<int64_t>(threads, useful));
}

double real_max(Real t) {
  return t == Real::F32 ? static_cast<double>(std::numeric_limits<float>::max())
                        : std::numeric_limits<double>::max();
}

// Maps a flat task index to (job, task within job) given prefix sums of tasks per job.
struct TaskMap {
  std::vector<int64_t> start;  // start[k] = first task of job k; start.back() = total
  explicit TaskMap(size_t jobs) : start(jobs + 1, 0) {}
  int64_t total() const { return start.back(); }
  std::pair<int64_t, int64_t> locate(int64_t t) const {
    const auto it = std::upper_bound(start.begin(), start.end(), t);
    const int64_t job = static_cast<int64_t>(it - start.begin()) - 1;
    return {job, t - start[job]};
  }
};

// ------------------------------------------------------------------ kernels
//
// The loops themselves are in xcorr_kernels.cpp, compiled once per instruction set (x86-64
// baseline, AVX2+FMA, AVX-512) and chosen here from the caller's Isa, so the build never
// needs -march=native.
template <typename Args>
void tile_moments(Isa isa, const Args& a) {
  PYPERM_ISA_DISPATCH(isa, tile_moments(a));
}

template <typename Args>
void merge_rows(Isa isa, const Args& a) {
  PYPERM_ISA_DISPATCH(isa, merge_rows(a));
}

template <typename Args>
void scale_rows(Isa isa, const Args& a) {
  PYPERM_ISA_DISPATCH(isa, scale_rows(a));
}

// ------------------------------------------------------------------ moments

// Rows averaged for the provisional centre: enough that it sits well inside the batch's
// spread (|mean - K| ~ sigma / sqrt(32)), few enough to cost nothing. They are spread over
// the whole batch, so a batch sorted by class (or drifting) still gets a central K.
constexpr int64_t kShiftRows = 32;

// Per-job scratch: per-row-block partials, so each tile writes its own slots.
struct MomentsScratch {
  int64_t row_blocks = 0, col_blocks = 0;
  std::vector<double> sum, sq, mn, mx;  // row_blocks x cols each
  std::vector<double> shift;            // cols
};

// K_c = x_0c + mean_i (x_ic - x_0c) over kShiftRows rows spread evenly over the batch:
// exactly x_0c for a constant column.
template <typename T>
void provisional_centre(const T* x, int64_t rows, int64_t cols, double* shift) {
  const int64_t p = std::min(rows, kShiftRows);
  for (int64_t c = 0; c < cols; ++c) shift[c] = 0.0;
  for (int64_t i = 1; i < p; ++i) {
    const T* row = x + (i * rows / p) * cols;
    for (int64_t c = 0; c < cols; ++c) shift[c] += static_cast<double>(row[c]) - static_cast<double>(x[c]);
  }
  for (int64_t c = 0; c < cols; ++c) shift[c] = static_cast<double>(x[c]) + shift[c] / static_cast<double>(p);
}

template <typename T>
bool column_has_nonfinite(const T* x, int64_t rows, int64_t cols, int64_t c) {
  for (int64_t r = 0; r < rows; ++r)
    if (!std::isfinite(x[r * cols + c])) return true;
  return false;
}

template <typename F>
void with_type(const MomentsJob& j, F&& f) {
  if (j.dtype == Real::F32) f(static_cast<const float*>(j.x), static_cast<float*>(j.centred));
  else f(static_cast<const double*>(j.x), static_cast<double*>(j.centred));
}

// Combines one job's partials over row blocks (in order, so independent of the threads) and
// writes its moments; returns its error.
XcorrError finish_moments(MomentsJob& j, const MomentsScratch& s) {
  const double rows = static_cast<double>(j.rows);
  XcorrError err = XcorrError::None;
  for (int64_t c = 0; c < j.cols; ++c) {
    double sum = 0.0, sq = 0.0, mn = std::numeric_limits<double>::infinity(), mx = -mn;
    for (int64_t rb = 0; rb < s.row_blocks; ++rb) {
      const int64_t at = rb * j.cols + c;
      sum += s.sum[at];
      sq += s.sq[at];
      mn = std::min(mn, s.mn[at]);
      mx = std::max(mx, s.mx[at]);
    }
    if (!std::isfinite(mn) || !std::isfinite(mx)) return XcorrError::NonFinite;
    if (!std::isfinite(sum) || !std::isfinite(sq)) {
      // NaN hides from min/max; finite values can still overflow the shifted sums.
      bool nonfinite = false;
      with_type(j, [&](const auto* x, auto*) { nonfinite = column_has_nonfinite(x, j.rows, j.cols, c); });
      if (nonfinite) return XcorrError::NonFinite;
      err = XcorrError::Overflow;
      continue;
    }
    j.max_sumsq = std::max(j.max_sumsq, sq);
    j.resid[c] = sum;
    j.moments[kMean * j.cols + c] = s.shift[c] + sum / rows;
    // The corrected two-pass formula (Chan, Golub and LeVeque): exact up to the rounding of
    // the squares themselves, and sum is small because K is near the mean.
    j.moments[kM2 * j.cols + c] = std::max(0.0, sq - sum * sum / rows);
    j.moments[kMin * j.cols + c] = mn;
    j.moments[kMax * j.cols + c] = mx;
  }
  return err;
}

}  // namespace

Status batch_moments(MomentsJob* jobs, int64_t n_jobs, int threads, Isa isa, int64_t* failed) {
  if (failed) *failed = -1;
  if (n_jobs <= 0) return Status::Ok;
  std::vector<MomentsScratch> scratch(static_cast<size_t>(n_jobs));
  TaskMap tiles(static_cast<size_t>(n_jobs));
  int64_t work = 0;
  for (int64_t k = 0; k < n_jobs; ++k) {
    MomentsJob& j = jobs[k];
    j.error = XcorrError::None;
    j.max_sumsq = 0.0;
    MomentsScratch& s = scratch[k];
    s.row_blocks = ceil_div(j.rows, kRowBlock);
    s.col_blocks = ceil_div(j.cols, kColBlock);
    const size_t part = static_cast<size_t>(s.row_blocks * j.cols);
    for (auto* v : {&s.sum, &s.sq, &s.mn, &s.mx}) v->resize(part);
    s.shift.resize(static_cast<size_t>(j.cols));
    with_type(j, [&](const auto* x, auto*) { provisional_centre(x, j.rows, j.cols, s.shift.data()); });
    tiles.start[k + 1] = tiles.start[k] + s.row_blocks * s.col_blocks;
    work += j.rows * j.cols;
  }

  // The one pass over the data.
  parallel_for(tiles.total(), clamp_threads(threads, work), [&](int64_t t) {
    const auto [k, local] = tiles.locate(t);
    const MomentsJob& j = jobs[k];
    MomentsScratch& s = scratch[k];
    const int64_t rb = local / s.col_blocks, cb = local % s.col_blocks;
    const int64_t r0 = rb * kRowBlock, r1 = std::min(j.rows, r0 + kRowBlock);
    const int64_t c0 = cb * kColBlock, c1 = std::min(j.cols, c0 + kColBlock);
    const int64_t at = rb * j.cols + c0;
    with_type(j, [&](const auto* x, auto* out) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
      const TileArgs<T> args{x, out, j.cols, r0, r1, c0, c1, s.shift.data() + c0,
                             s.sum.data() + at, s.sq.data() + at, s.mn.data() + at, s.mx.data() + at};
      tile_moments(isa, args);
    });
  });

  // rows / kRowBlock * cols work per job: cheaper on this thread than starting others.
  for (int64_t k = 0; k < n_jobs; ++k) {
    const XcorrError err = finish_moments(jobs[k], scratch[k]);
    if (err != XcorrError::None) {
      jobs[k].error = err;
      if (failed) *failed = k;
      return Status::Invalid;
    }
  }
  return Status::Ok;
}

// ------------------------------------------------------------------- merge
namespace {

struct MergeScratch {
  // coefficient vectors of the two rank-1 terms: C += G + p q^T + u v^T
  std::vector<double> p, q, u, v;
  std::vector<double> new_a, new_b;  // 4 x dim merged moments, written back after the matrix
  int64_t row_block = 1;
};

template <typename TC, typename TG>
void merge_typed(TC* c, const TG* g, const MergeJob& j, const MergeScratch& s, int64_t i0, int64_t i1, Isa isa) {
  const MergeArgs<TC, TG> args{c, g, i0, i1, j.dim_b, j.n == 0, s.p.data(), s.q.data(), s.u.data(), s.v.data()};
  merge_rows(isa, args);
}

void merge_block(const MergeJob& j, const MergeScratch& s, int64_t i0, int64_t i1, Isa isa) {
  if (j.comoment_dtype == Real::F64) {
    auto* c = static_cast<double*>(j.comoment);
    if (j.in_dtype == Real::F64) merge_typed(c, static_cast<const double*>(j.in_comoment), j, s, i0, i1, isa);
    else merge_typed(c, static_cast<const float*>(j.in_comoment), j, s, i0, i1, isa);
  } else {
    auto* c = static_cast<float*>(j.comoment);
    if (j.in_dtype == Real::F64) merge_typed(c, static_cast<const double*>(j.in_comoment), j, s, i0, i1, isa);
    else merge_typed(c, static_cast<const float*>(j.in_comoment), j, s, i0, i1, isa);
  }
}

// Chan's pairwise update of one side's moments; fills the rank-1 coefficients of that side.
// Returns the largest merged m2 (inf or NaN when it overflowed).
double merge_side(int64_t dim, double n, double m, const double* mom, const double* in, const double* resid,
                  bool is_row_side, std::vector<double>& coef_resid, std::vector<double>& coef_delta,
                  std::vector<double>& merged, double* in_max_m2) {
  const double total = n + m;
  const double w = n * m / total;  // 0 for an empty accumulator: delta then drops out
  const double frac = m / total;
  coef_resid.assign(static_cast<size_t>(dim), 0.0);
  coef_delta.resize(static_cast<size_t>(dim));
  merged.resize(static_cast<size_t>(4 * dim));
  double max_m2 = 0.0, max_in = 0.0;
  for (int64_t c = 0; c < dim; ++c) {
    const double in_mean = in[kMean * dim + c], in_m2 = in[kM2 * dim + c];
    if (n == 0.0) {
      merged[kMean * dim + c] = in_mean;
      merged[kM2 * dim + c] = in_m2;
      merged[kMin * dim + c] = in[kMin * dim + c];
      merged[kMax * dim + c] = in[kMax * dim + c];
      coef_delta[c] = 0.0;
    } else {
      const double delta = in_mean - mom[kMean * dim + c];
      merged[kMean * dim + c] = mom[kMean * dim + c] + frac * delta;
      merged[kM2 * dim + c] = mom[kM2 * dim + c] + in_m2 + w * delta * delta;
      merged[kMin * dim + c] = std::min(mom[kMin * dim + c], in[kMin * dim + c]);
      merged[kMax * dim + c] = std::max(mom[kMax * dim + c], in[kMax * dim + c]);
      // The row side carries the weight, the column side the bare delta.
      coef_delta[c] = is_row_side ? w * delta : delta;
    }
    if (resid) coef_resid[c] = is_row_side ? -resid[c] / m : resid[c];
    // max() ignores NaN in its second operand; keep any non-finite value visible.
    const double m2 = merged[kM2 * dim + c];
    max_m2 = std::isfinite(m2) ? std::max(max_m2, m2) : std::numeric_limits<double>::infinity();
    max_in = std::isfinite(in_m2) ? std::max(max_in, in_m2) : std::numeric_limits<double>::infinity();
  }
  *in_max_m2 = max_in;
  return max_m2;
}

}  // namespace

Status merge_comoments(MergeJob* jobs, int64_t n_jobs, int threads, Isa isa, int64_t* failed) {
  if (failed) *failed = -1;
  if (n_jobs <= 0) return Status::Ok;
  std::vector<MergeScratch> scratch(static_cast<size_t>(n_jobs));
  TaskMap blocks(static_cast<size_t>(n_jobs));
  int64_t work = 0;
  // Check every job before writing any accumulator, so a failure leaves all of them as they were.
  for (int64_t k = 0; k < n_jobs; ++k) {
    MergeJob& j = jobs[k];
    j.error = XcorrError::None;
    MergeScratch& s = scratch[k];
    blocks.start[k + 1] = blocks.start[k];
    if (j.m <= 0) continue;  // nothing incoming: no tasks, nothing written back
    const double n = static_cast<double>(j.n), m = static_cast<double>(j.m);
    double in_a = 0.0, in_b = 0.0;
    const double max_a = merge_side(j.dim_a, n, m, j.moments_a, j.in_moments_a, j.resid_a, true, s.p, s.u,
                                    s.new_a, &in_a);
    const double max_b = merge_side(j.dim_b, n, m, j.moments_b, j.in_moments_b, j.resid_b, false, s.q, s.v,
                                    s.new_b, &in_b);
    // |C_ij| <= sqrt(m2_a_i m2_b_j) (Cauchy-Schwarz), and every partial sum of the GEMM obeys
    // the same bound; a margin of 4 leaves room for the rank-1 terms and rounding.
    const bool in_ok = std::sqrt(in_a) * std::sqrt(in_b) <= real_max(j.in_dtype) / 4;
    const bool acc_ok = std::sqrt(max_a) * std::sqrt(max_b) <= real_max(j.comoment_dtype) / 4;
    if (!in_ok || !acc_ok) {
      j.error = XcorrError::Overflow;
      if (failed) *failed = k;
      return Status::Invalid;
    }
    s.row_block = std::max<int64_t>(1, kTask / std::max<int64_t>(1, j.dim_b));
    blocks.start[k + 1] += ceil_div(j.dim_a, s.row_block);
    work += j.dim_a * j.dim_b;
  }

  // Memory-bound: a thread pays off only with a few megabytes of its own to stream.
  parallel_for(blocks.total(), clamp_threads(threads, work / 4), [&](int64_t t) {
    const auto [k, b] = blocks.locate(t);
    const MergeJob& j = jobs[k];
    const MergeScratch& s = scratch[k];
    const int64_t i0 = b * s.row_block, i1 = std::min(j.dim_a, i0 + s.row_block);
    merge_block(j, s, i0, i1, isa);
  });

  for (int64_t k = 0; k < n_jobs; ++k) {
    if (jobs[k].m <= 0) continue;
    std::copy(scratch[k].new_a.begin(), scratch[k].new_a.end(), jobs[k].moments_a);
    std::copy(scratch[k].new_b.begin(), scratch[k].new_b.end(), jobs[k].moments_b);
  }
  return Status::Ok;
}

// ------------------------------------------------------------------ output

void scale_comoment(const void* src, void* out, Real dtype, int64_t rows, int64_t cols, const double* row_scale,
                    const double* col_scale, const double* row_add, const double* col_add, bool clip,
                    int threads, Isa isa) {
  if (rows <= 0 || cols <= 0) return;
  if (!row_add || !col_add) row_add = col_add = nullptr;
  const int64_t row_block = std::max<int64_t>(1, kTask / cols);
  parallel_for(ceil_div(rows, row_block), clamp_threads(threads, rows * cols), [&](int64_t b) {
    const int64_t i0 = b * row_block, i1 = std::min(rows, i0 + row_block);
    if (dtype == Real::F64) {
      const ScaleArgs<double> args{static_cast<const double*>(src), static_cast<double*>(out), i0, i1, cols,
                                   row_scale, col_scale, row_add, col_add, clip};
      scale_rows(isa, args);
    } else {
      const ScaleArgs<float> args{static_cast<const float*>(src), static_cast<float*>(out), i0, i1, cols,
                                  row_scale, col_scale, row_add, col_add, clip};
      scale_rows(isa, args);
    }
  });
}

}  // namespace pyperm::cpu
