#include "xcorr/xcorr_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/thread_pool.h"

namespace pyperm::cpu {
namespace {

// Tiles of the sample matrix: a row block of samples by a column block of channels. Fixed
// sizes (never derived from the thread count) keep the summation order, and so the result,
// independent of how many threads run.
constexpr int64_t kRowBlock = 256;
constexpr int64_t kColBlock = 512;
// Elements of work per thread below which starting one costs more than it saves
// (threads are started per call; see common/thread_pool.h).
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

// ------------------------------------------------------------------ moments

// Per-job scratch: per-row-block partial sums, so each tile writes its own slots.
struct MomentsScratch {
  int64_t row_blocks = 0, col_blocks = 0;
  std::vector<double> part0, part1, part2;  // row_blocks x cols each
  std::vector<double> shift;                // cols
  std::vector<int32_t> error;               // col_blocks
};

// Pass 1 over one tile: column sums, minima and maxima.
template <typename T>
void tile_range(const T* __restrict x, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                double* __restrict sum, double* __restrict mn, double* __restrict mx) {
  const int64_t w = c1 - c0;
  for (int64_t c = 0; c < w; ++c) {
    sum[c] = 0.0;
    mn[c] = std::numeric_limits<double>::infinity();
    mx[c] = -std::numeric_limits<double>::infinity();
  }
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict row = x + r * cols + c0;
    for (int64_t c = 0; c < w; ++c) {
      const double v = static_cast<double>(row[c]);
      sum[c] += v;
      mn[c] = v < mn[c] ? v : mn[c];
      mx[c] = v > mx[c] ? v : mx[c];
    }
  }
}

// Pass 2 over one tile: writes x - shift in T and sums the stored values and their squares.
// The sums use the rounded values, so that they describe exactly what the GEMM will see.
template <typename T>
void tile_centre(const T* __restrict x, T* __restrict out, int64_t cols, int64_t r0, int64_t r1,
                 int64_t c0, int64_t c1, const double* __restrict shift, double* __restrict sum,
                 double* __restrict sq) {
  const int64_t w = c1 - c0;
  for (int64_t c = 0; c < w; ++c) sum[c] = sq[c] = 0.0;
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict row = x + r * cols + c0;
    T* __restrict dst = out + r * cols + c0;
    for (int64_t c = 0; c < w; ++c) {
      const T d = static_cast<T>(static_cast<double>(row[c]) - shift[c]);
      dst[c] = d;
      const double e = static_cast<double>(d);
      sum[c] += e;
      sq[c] += e * e;
    }
  }
}

template <typename T>
bool column_has_nonfinite(const T* x, int64_t rows, int64_t cols, int64_t c) {
  for (int64_t r = 0; r < rows; ++r)
    if (!std::isfinite(x[r * cols + c])) return true;
  return false;
}

}  // namespace

Status batch_moments(MomentsJob* jobs, int64_t n_jobs, int threads, int64_t* failed) {
  if (failed) *failed = -1;
  if (n_jobs <= 0) return Status::Ok;
  std::vector<MomentsScratch> scratch(static_cast<size_t>(n_jobs));
  TaskMap tiles(static_cast<size_t>(n_jobs)), colblocks(static_cast<size_t>(n_jobs));
  int64_t work = 0;
  for (int64_t k = 0; k < n_jobs; ++k) {
    MomentsJob& j = jobs[k];
    j.error = XcorrError::None;
    MomentsScratch& s = scratch[k];
    s.row_blocks = ceil_div(j.rows, kRowBlock);
    s.col_blocks = ceil_div(j.cols, kColBlock);
    const size_t part = static_cast<size_t>(s.row_blocks * j.cols);
    s.part0.resize(part);
    s.part1.resize(part);
    s.part2.resize(part);
    s.shift.resize(static_cast<size_t>(j.cols));
    s.error.assign(static_cast<size_t>(s.col_blocks), 0);
    tiles.start[k + 1] = tiles.start[k] + s.row_blocks * s.col_blocks;
    colblocks.start[k + 1] = colblocks.start[k] + s.col_blocks;
    work += j.rows * j.cols;
  }
  const int nthreads = clamp_threads(threads, work);

  auto dispatch = [&](const MomentsJob& j, auto&& f32, auto&& f64) {
    if (j.dtype == Real::F32) f32(static_cast<const float*>(j.x), static_cast<float*>(j.centred));
    else f64(static_cast<const double*>(j.x), static_cast<double*>(j.centred));
  };

  // Pass 1: partial sums and ranges per tile.
  parallel_for(tiles.total(), nthreads, [&](int64_t t) {
    const auto [k, local] = tiles.locate(t);
    const MomentsJob& j = jobs[k];
    MomentsScratch& s = scratch[k];
    const int64_t rb = local / s.col_blocks, cb = local % s.col_blocks;
    const int64_t r0 = rb * kRowBlock, r1 = std::min(j.rows, r0 + kRowBlock);
    const int64_t c0 = cb * kColBlock, c1 = std::min(j.cols, c0 + kColBlock);
    double* sum = s.part0.data() + rb * j.cols + c0;
    double* mn = s.part1.data() + rb * j.cols + c0;
    double* mx = s.part2.data() + rb * j.cols + c0;
    auto run = [&](const auto* x, auto*) { tile_range(x, j.cols, r0, r1, c0, c1, sum, mn, mx); };
    dispatch(j, run, run);
  });

  // Reduce pass 1 over row blocks, in order; choose each column's shift. An exactly
  // constant column is shifted by its value, so its centred values, sums and m2 are
  // exactly zero and its correlation can be reported as 0 rather than rounding noise.
  // (rows/kRowBlock * cols work: cheaper on this thread than starting others.)
  parallel_for(colblocks.total(), 1, [&](int64_t t) {
    const auto [k, cb] = colblocks.locate(t);
    MomentsJob& j = jobs[k];
    MomentsScratch& s = scratch[k];
    const int64_t c0 = cb * kColBlock, c1 = std::min(j.cols, c0 + kColBlock);
    int32_t err = 0;
    for (int64_t c = c0; c < c1; ++c) {
      double sum = 0.0, mn = std::numeric_limits<double>::infinity(), mx = -mn;
      for (int64_t rb = 0; rb < s.row_blocks; ++rb) {
        sum += s.part0[rb * j.cols + c];
        mn = std::min(mn, s.part1[rb * j.cols + c]);
        mx = std::max(mx, s.part2[rb * j.cols + c]);
      }
      if (!std::isfinite(sum) || !std::isfinite(mn) || !std::isfinite(mx)) {
        // NaN hides from min/max, and finite values can sum past the largest double.
        bool nonfinite = !std::isfinite(mn) || !std::isfinite(mx);
        if (!nonfinite) {
          auto scan = [&](const auto* x, auto*) { nonfinite = column_has_nonfinite(x, j.rows, j.cols, c); };
          dispatch(j, scan, scan);
        }
        err = std::max<int32_t>(err, nonfinite ? static_cast<int32_t>(XcorrError::NonFinite)
                                               : static_cast<int32_t>(XcorrError::Overflow));
        s.shift[c] = 0.0;
        continue;
      }
      s.shift[c] = (mn == mx) ? mn : sum / static_cast<double>(j.rows);
      j.moments[kMin * j.cols + c] = mn;
      j.moments[kMax * j.cols + c] = mx;
    }
    s.error[cb] = err;
  });

  for (int64_t k = 0; k < n_jobs; ++k) {
    // NonFinite outranks Overflow: it names the actual fault in the data.
    XcorrError err = XcorrError::None;
    for (int32_t e : scratch[k].error) {
      if (e == static_cast<int32_t>(XcorrError::NonFinite)) err = XcorrError::NonFinite;
      else if (e != 0 && err == XcorrError::None) err = XcorrError::Overflow;
    }
    if (err != XcorrError::None) {
      jobs[k].error = err;
      if (failed) *failed = k;
      return Status::Invalid;
    }
  }

  // Pass 2: centre, and sum what was stored.
  parallel_for(tiles.total(), nthreads, [&](int64_t t) {
    const auto [k, local] = tiles.locate(t);
    const MomentsJob& j = jobs[k];
    MomentsScratch& s = scratch[k];
    const int64_t rb = local / s.col_blocks, cb = local % s.col_blocks;
    const int64_t r0 = rb * kRowBlock, r1 = std::min(j.rows, r0 + kRowBlock);
    const int64_t c0 = cb * kColBlock, c1 = std::min(j.cols, c0 + kColBlock);
    double* sum = s.part0.data() + rb * j.cols + c0;
    double* sq = s.part1.data() + rb * j.cols + c0;
    auto run = [&](const auto* x, auto* out) {
      tile_centre(x, out, j.cols, r0, r1, c0, c1, s.shift.data() + c0, sum, sq);
    };
    dispatch(j, run, run);
  });

  // Reduce pass 2. With r = sum of the stored centred values, the batch mean is
  // shift + r/rows and m2 = sum sq - r^2/rows (the corrected two-pass formula of
  // Chan, Golub and LeVeque), exact up to the rounding of the products themselves.
  parallel_for(colblocks.total(), 1, [&](int64_t t) {
    const auto [k, cb] = colblocks.locate(t);
    MomentsJob& j = jobs[k];
    MomentsScratch& s = scratch[k];
    const int64_t c0 = cb * kColBlock, c1 = std::min(j.cols, c0 + kColBlock);
    const double rows = static_cast<double>(j.rows);
    int32_t err = 0;
    for (int64_t c = c0; c < c1; ++c) {
      double r = 0.0, sq = 0.0;
      for (int64_t rb = 0; rb < s.row_blocks; ++rb) {
        r += s.part0[rb * j.cols + c];
        sq += s.part1[rb * j.cols + c];
      }
      if (!std::isfinite(sq)) err = static_cast<int32_t>(XcorrError::Overflow);
      j.resid[c] = r;
      j.moments[kMean * j.cols + c] = s.shift[c] + r / rows;
      j.moments[kM2 * j.cols + c] = std::max(0.0, sq - r * r / rows);
    }
    s.error[cb] = err;
  });
  for (int64_t k = 0; k < n_jobs; ++k) {
    for (int32_t e : scratch[k].error) {
      if (e != 0) {
        jobs[k].error = XcorrError::Overflow;
        if (failed) *failed = k;
        return Status::Invalid;
      }
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
void merge_rows(TC* __restrict c, const TG* __restrict g, int64_t i0, int64_t i1, int64_t dim_b,
                bool fresh, const double* __restrict p, const double* __restrict q,
                const double* __restrict u, const double* __restrict v) {
  for (int64_t i = i0; i < i1; ++i) {
    TC* __restrict crow = c + i * dim_b;
    const TG* __restrict grow = g + i * dim_b;
    const double pi = p[i], ui = u[i];
    if (fresh) {
      // The accumulator is empty: write without reading it.
      for (int64_t j = 0; j < dim_b; ++j)
        crow[j] = static_cast<TC>(static_cast<double>(grow[j]) + pi * q[j] + ui * v[j]);
    } else {
      for (int64_t j = 0; j < dim_b; ++j)
        crow[j] = static_cast<TC>(static_cast<double>(crow[j]) + static_cast<double>(grow[j]) + pi * q[j] +
                                  ui * v[j]);
    }
  }
}

void merge_block(const MergeJob& j, const MergeScratch& s, int64_t i0, int64_t i1) {
  const bool fresh = j.n == 0;
  const double *p = s.p.data(), *q = s.q.data(), *u = s.u.data(), *v = s.v.data();
  if (j.comoment_dtype == Real::F64) {
    auto* c = static_cast<double*>(j.comoment);
    if (j.in_dtype == Real::F64) merge_rows(c, static_cast<const double*>(j.in_comoment), i0, i1, j.dim_b, fresh, p, q, u, v);
    else merge_rows(c, static_cast<const float*>(j.in_comoment), i0, i1, j.dim_b, fresh, p, q, u, v);
  } else {
    auto* c = static_cast<float*>(j.comoment);
    if (j.in_dtype == Real::F64) merge_rows(c, static_cast<const double*>(j.in_comoment), i0, i1, j.dim_b, fresh, p, q, u, v);
    else merge_rows(c, static_cast<const float*>(j.in_comoment), i0, i1, j.dim_b, fresh, p, q, u, v);
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

Status merge_comoments(MergeJob* jobs, int64_t n_jobs, int threads, int64_t* failed) {
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

  parallel_for(blocks.total(), clamp_threads(threads, work), [&](int64_t t) {
    const auto [k, b] = blocks.locate(t);
    const MergeJob& j = jobs[k];
    const MergeScratch& s = scratch[k];
    const int64_t i0 = b * s.row_block, i1 = std::min(j.dim_a, i0 + s.row_block);
    merge_block(j, s, i0, i1);
  });

  for (int64_t k = 0; k < n_jobs; ++k) {
    if (jobs[k].m <= 0) continue;
    std::copy(scratch[k].new_a.begin(), scratch[k].new_a.end(), jobs[k].moments_a);
    std::copy(scratch[k].new_b.begin(), scratch[k].new_b.end(), jobs[k].moments_b);
  }
  return Status::Ok;
}

// ------------------------------------------------------------------ output
namespace {

template <typename T>
void scale_rows(const T* __restrict src, T* __restrict out, int64_t i0, int64_t i1, int64_t cols,
                const double* __restrict rs, const double* __restrict cs, const double* __restrict ra,
                const double* __restrict ca, bool clip) {
  for (int64_t i = i0; i < i1; ++i) {
    const T* __restrict s = src + i * cols;
    T* __restrict o = out + i * cols;
    const double r = rs[i], a = ra ? ra[i] : 0.0;
    if (ca) {
      for (int64_t j = 0; j < cols; ++j) o[j] = static_cast<T>(r * static_cast<double>(s[j]) * cs[j] + a * ca[j]);
    } else {
      for (int64_t j = 0; j < cols; ++j) o[j] = static_cast<T>(r * static_cast<double>(s[j]) * cs[j]);
    }
    if (clip) {
      // Rounding can push |r| of (nearly) collinear channels past 1; numpy.corrcoef clips too.
      for (int64_t j = 0; j < cols; ++j) o[j] = std::min(T(1), std::max(T(-1), o[j]));
    }
  }
}

}  // namespace

void scale_comoment(const void* src, void* out, Real dtype, int64_t rows, int64_t cols, const double* row_scale,
                    const double* col_scale, const double* row_add, const double* col_add, bool clip,
                    int threads) {
  if (rows <= 0 || cols <= 0) return;
  if (!row_add || !col_add) row_add = col_add = nullptr;
  const int64_t row_block = std::max<int64_t>(1, kTask / cols);
  parallel_for(ceil_div(rows, row_block), clamp_threads(threads, rows * cols), [&](int64_t b) {
    const int64_t i0 = b * row_block, i1 = std::min(rows, i0 + row_block);
    if (dtype == Real::F64)
      scale_rows(static_cast<const double*>(src), static_cast<double*>(out), i0, i1, cols, row_scale, col_scale,
                 row_add, col_add, clip);
    else
      scale_rows(static_cast<const float*>(src), static_cast<float*>(out), i0, i1, cols, row_scale, col_scale,
                 row_add, col_add, clip);
  });
}

}  // namespace pyperm::cpu
