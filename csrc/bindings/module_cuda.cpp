// The CUDA extension module: imported lazily by pyperm, only when CUDA input arrives.
//
// Device memory crosses this boundary as raw pointers (Python ints) with shapes, element
// strides, the device index and the caller's stream handle, so the module never links
// libtorch: pyperm/_cuda_arrays.py takes them from torch tensors, __cuda_array_interface__
// or DLPack and allocates the outputs with the input's library. The wrapper has validated
// shapes, dtypes and pointers; the kernels check the numbers.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "bindings/status.h"
#include "bvn/bvn_cuda.h"
#include "common/cuda_runtime_info.h"
#include "lap/lap_cuda.h"
#include "xcorr/xcorr_cuda.h"

namespace py = pybind11;

namespace {

using pyperm::Status;
using pyperm::XcorrError;
using pyperm::bindings::raise_for;
namespace pc = pyperm::cuda;

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// The failing problem's index, for the message of a batch.
std::string batch_prefix(bool batched, int64_t failed) {
  return batched ? "problem " + std::to_string(failed) + " of the batch: " : "";
}

pc::LapOptions make_options(const std::string& method, int threads, int stage, int state_smem, int max_rounds,
                            int patience) {
  pc::LapOptions o;
  if (method == "auto")
    o.method = pc::LapMethod::Auto;
  else if (method == "block")
    o.method = pc::LapMethod::Block;
  else if (method == "device")
    o.method = pc::LapMethod::Device;
  else
    throw py::value_error("method must be 'auto', 'block' or 'device', got '" + method + "'");
  if (threads != 0 && (threads < 32 || threads > 1024 || (threads & (threads - 1)) != 0))
    throw py::value_error("threads must be 0 (auto) or a power of two from 32 to 1024, got " +
                          std::to_string(threads));
  if (stage < -1 || stage > 1) throw py::value_error("stage must be -1 (auto), 0 or 1");
  if (state_smem < -1 || state_smem > 1) throw py::value_error("state_smem must be -1 (auto), 0 or 1");
  o.threads = threads;
  o.stage_cost = stage;
  o.state_smem = state_smem;
  o.max_rounds = max_rounds;
  o.patience = patience;
  return o;
}

py::dict stats_dict(const pc::LapStats& st) {
  py::dict d;
  d["method"] = st.method == static_cast<int>(pc::LapMethod::Device) ? "device" : "block";
  d["threads"] = st.threads;
  d["staged"] = st.staged != 0;
  d["state_in_shared"] = st.state_in_shared != 0;
  d["rounds"] = st.rounds;
  d["free_rows"] = st.free_rows;
  return d;
}

bool is_double(const std::string& dtype) {
  if (dtype == "float64") return true;
  if (dtype == "float32") return false;
  throw py::value_error("dtype must be 'float32' or 'float64', got '" + dtype + "'");
}

py::object lap_solve_strided(uintptr_t cost, const std::string& dtype, int64_t batch, int64_t n_rows, int64_t n_cols,
                           int64_t stride_b, int64_t stride_r, int64_t stride_c, bool maximize, uintptr_t row_ind,
                           uintptr_t col_ind, int device, uintptr_t stream, bool batched, const std::string& method,
                           int threads, int stage, int state_smem, int max_rounds, int patience, bool want_stats) {
  const bool dbl = is_double(dtype);
  const pc::LapOptions opt = make_options(method, threads, stage, state_smem, max_rounds, patience);
  pc::LapStats st;
  int64_t failed = -1;
  Status s;
  {
    py::gil_scoped_release release;
    auto* r = static_cast<int64_t*>(as_ptr(row_ind));
    auto* c = static_cast<int64_t*>(as_ptr(col_ind));
    if (dbl)
      s = pc::batch_linear_sum_assignment(static_cast<const double*>(as_ptr(cost)), batch, n_rows, n_cols, stride_b,
                                          stride_r, stride_c, maximize, r, c, &failed, device, as_ptr(stream), opt,
                                          want_stats ? &st : nullptr);
    else
      s = pc::batch_linear_sum_assignment(static_cast<const float*>(as_ptr(cost)), batch, n_rows, n_cols, stride_b,
                                          stride_r, stride_c, maximize, r, c, &failed, device, as_ptr(stream), opt,
                                          want_stats ? &st : nullptr);
  }
  raise_for(s, batch_prefix(batched, failed));
  if (want_stats) return stats_dict(st);
  return py::none();
}

py::object lap_solve_square_warm(uintptr_t cost, const std::string& dtype, int64_t batch, int64_t n, uintptr_t v,
                                 uintptr_t col_of_row, int device, uintptr_t stream, bool batched,
                                 const std::string& method, int threads, int stage, int state_smem, int max_rounds,
                                 int patience, bool want_stats) {
  const bool dbl = is_double(dtype);
  const pc::LapOptions opt = make_options(method, threads, stage, state_smem, max_rounds, patience);
  pc::LapStats st;
  int64_t failed = -1;
  Status s;
  {
    py::gil_scoped_release release;
    auto* out = static_cast<int64_t*>(as_ptr(col_of_row));
    if (dbl)
      s = pc::batch_solve_square_warm(static_cast<const double*>(as_ptr(cost)), batch, n,
                                      static_cast<double*>(as_ptr(v)), out, &failed, device, as_ptr(stream), opt,
                                      want_stats ? &st : nullptr);
    else
      s = pc::batch_solve_square_warm(static_cast<const float*>(as_ptr(cost)), batch, n,
                                      static_cast<float*>(as_ptr(v)), out, &failed, device, as_ptr(stream), opt,
                                      want_stats ? &st : nullptr);
  }
  raise_for(s, batch_prefix(batched, failed));
  if (want_stats) return stats_dict(st);
  return py::none();
}

// ---------------------------------------------------------------- Birkhoff-von Neumann
void bvn_support_cost(uintptr_t residual, const std::string& dtype, int64_t n, uintptr_t cost, int device,
                      uintptr_t stream) {
  const bool dbl = is_double(dtype);
  py::gil_scoped_release release;
  if (dbl)
    pc::bvn_support_cost(static_cast<const double*>(as_ptr(residual)), n, static_cast<double*>(as_ptr(cost)), device,
                         as_ptr(stream));
  else
    pc::bvn_support_cost(static_cast<const float*>(as_ptr(residual)), n, static_cast<float*>(as_ptr(cost)), device,
                         as_ptr(stream));
}

py::tuple bvn_subtract_term(uintptr_t residual, uintptr_t original, double d_max, const std::string& dtype, int64_t n,
                            uintptr_t perm, int device, uintptr_t stream) {
  const bool dbl = is_double(dtype);
  double alpha = 0.0, mass = 0.0;
  {
    py::gil_scoped_release release;
    const auto* p = static_cast<const int64_t*>(as_ptr(perm));
    if (dbl) {
      pc::bvn_subtract_term(static_cast<double*>(as_ptr(residual)), static_cast<const double*>(as_ptr(original)),
                            d_max, n, p, &alpha, &mass, device, as_ptr(stream));
    } else {
      float a = 0.0f;
      pc::bvn_subtract_term(static_cast<float*>(as_ptr(residual)), static_cast<const float*>(as_ptr(original)), d_max,
                            n, p, &a, &mass, device, as_ptr(stream));
      alpha = a;
    }
  }
  return py::make_tuple(alpha, mass);
}

// ------------------------------------------------------------------- cross-correlation
double xcorr_batch_moments(uintptr_t x, const std::string& dtype, int64_t rows, int64_t cols, int64_t ld,
                           uintptr_t centred, uintptr_t moments, uintptr_t resid, int device, uintptr_t stream,
                           const std::string& name) {
  const bool dbl = is_double(dtype);
  if (rows < 1 || cols < 1 || ld < cols) throw py::value_error("xcorr_batch_moments: bad shape or row stride");
  double max_sumsq = 0.0;
  XcorrError err;
  {
    py::gil_scoped_release release;
    auto* mo = static_cast<double*>(as_ptr(moments));
    auto* re = static_cast<double*>(as_ptr(resid));
    if (dbl)
      err = pc::xcorr_batch_moments(static_cast<const double*>(as_ptr(x)), rows, cols, ld,
                                    static_cast<double*>(as_ptr(centred)), mo, re, &max_sumsq, device, as_ptr(stream));
    else
      err = pc::xcorr_batch_moments(static_cast<const float*>(as_ptr(x)), rows, cols, ld,
                                    static_cast<float*>(as_ptr(centred)), mo, re, &max_sumsq, device, as_ptr(stream));
  }
  raise_for(err, name);
  return max_sumsq;
}

template <typename TC, typename TG>
XcorrError merge_typed(int64_t dim_a, int64_t dim_b, int64_t n, uintptr_t moments_a, uintptr_t moments_b,
                uintptr_t comoment, int64_t m, uintptr_t in_moments_a, uintptr_t in_moments_b, uintptr_t in_comoment,
                uintptr_t resid_a, uintptr_t resid_b, int device, uintptr_t stream) {
  return pc::xcorr_merge_comoments<TC, TG>(
      dim_a, dim_b, n, static_cast<double*>(as_ptr(moments_a)), static_cast<double*>(as_ptr(moments_b)),
      static_cast<TC*>(as_ptr(comoment)), m, static_cast<const double*>(as_ptr(in_moments_a)),
      static_cast<const double*>(as_ptr(in_moments_b)), static_cast<const TG*>(as_ptr(in_comoment)),
      resid_a ? static_cast<const double*>(as_ptr(resid_a)) : nullptr,
      resid_b ? static_cast<const double*>(as_ptr(resid_b)) : nullptr, device, as_ptr(stream));
}

void xcorr_merge_comoments(int64_t dim_a, int64_t dim_b, int64_t n, uintptr_t moments_a, uintptr_t moments_b,
                           uintptr_t comoment, const std::string& comoment_dtype, int64_t m, uintptr_t in_moments_a,
                           uintptr_t in_moments_b, uintptr_t in_comoment, const std::string& in_dtype,
                           uintptr_t resid_a, uintptr_t resid_b, int device, uintptr_t stream,
                           const std::string& name) {
  const bool c64 = is_double(comoment_dtype), g64 = is_double(in_dtype);
  if (dim_a < 1 || dim_b < 1 || n < 0 || m < 1) throw py::value_error("xcorr_merge_comoments: bad sizes");
  XcorrError err;
  {
    py::gil_scoped_release release;
    if (c64 && g64)
      err = merge_typed<double, double>(dim_a, dim_b, n, moments_a, moments_b, comoment, m, in_moments_a,
                                        in_moments_b, in_comoment, resid_a, resid_b, device, stream);
    else if (c64)
      err = merge_typed<double, float>(dim_a, dim_b, n, moments_a, moments_b, comoment, m, in_moments_a,
                                       in_moments_b, in_comoment, resid_a, resid_b, device, stream);
    else if (g64)
      err = merge_typed<float, double>(dim_a, dim_b, n, moments_a, moments_b, comoment, m, in_moments_a,
                                       in_moments_b, in_comoment, resid_a, resid_b, device, stream);
    else
      err = merge_typed<float, float>(dim_a, dim_b, n, moments_a, moments_b, comoment, m, in_moments_a,
                                      in_moments_b, in_comoment, resid_a, resid_b, device, stream);
  }
  raise_for(err, name);
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() =
      "pyperm's CUDA kernels (static CUDA runtime; imports without a driver). Use the functions of the "
      "pyperm package, which validate input; these take raw device pointers.";
  m.def("device_count", &pc::device_count, "Number of usable CUDA devices (0 without a driver or GPU).");
  m.def("device_error", &pc::device_error,
        "Why the CUDA runtime found no device (its error name and text), or an empty string.");
  m.def("runtime_version", &pc::runtime_version, "The CUDA runtime version this module was built with.");
  m.def("pointer_device", &pc::pointer_device, py::arg("ptr"),
        "The device owning a CUDA pointer, or -1 for memory that is not on a device.");

  m.def("lap_solve_strided", &lap_solve_strided, py::arg("cost"), py::arg("dtype"), py::arg("batch"), py::arg("n_rows"),
        py::arg("n_cols"), py::arg("stride_b"), py::arg("stride_r"), py::arg("stride_c"), py::arg("maximize"),
        py::arg("row_ind"), py::arg("col_ind"), py::arg("device"), py::arg("stream"), py::arg("batched"),
        py::arg("method") = "auto", py::arg("threads") = 0, py::arg("stage") = -1, py::arg("state_smem") = -1, py::arg("max_rounds") = -1,
        py::arg("patience") = -1, py::arg("stats") = false,
        "Solves batch x n_rows x n_cols assignment problems on the device (strides in elements). Writes "
        "batch x min(n_rows, n_cols) int64 row_ind and col_ind. Synchronises the stream.");
  m.def("lap_solve_square_warm", &lap_solve_square_warm, py::arg("cost"), py::arg("dtype"), py::arg("batch"),
        py::arg("n"), py::arg("v"), py::arg("col_of_row"), py::arg("device"), py::arg("stream"),
        py::arg("batched"), py::arg("method") = "auto", py::arg("threads") = 0, py::arg("stage") = -1,
        py::arg("state_smem") = -1, py::arg("max_rounds") = -1, py::arg("patience") = -1, py::arg("stats") = false,
        "Square minimisations warm-started from column duals v (batch x n, updated in place); contiguous "
        "batch x n x n cost with finite or +inf entries. Writes batch x n int64 col_of_row.");

  m.def("bvn_support_cost", &bvn_support_cost, py::arg("residual"), py::arg("dtype"), py::arg("n"), py::arg("cost"),
        py::arg("device"), py::arg("stream"), "cost = -R on the support of R (R > 0), +inf elsewhere (n x n).");
  m.def("bvn_subtract_term", &bvn_subtract_term, py::arg("residual"), py::arg("original"), py::arg("d_max"),
        py::arg("dtype"), py::arg("n"), py::arg("perm"), py::arg("device"), py::arg("stream"),
        "One Birkhoff-von Neumann term: alpha = min_i R[i, perm[i]], R -= alpha P, rounding noise left by the "
        "subtraction zeroed as on the CPU (original: the decomposed matrix, d_max its largest entry). Returns "
        "(alpha, residual mass). Synchronises the stream.");
  m.def("xcorr_batch_moments", &xcorr_batch_moments, py::arg("x"), py::arg("dtype"), py::arg("rows"), py::arg("cols"),
        py::arg("ld"), py::arg("centred"), py::arg("moments"), py::arg("resid"), py::arg("device"), py::arg("stream"),
        py::arg("name"),
        "Shifted batch and float64 moments (4 x cols) of one side. Returns the max column sum of squares; raises "
        "ValueError naming `name` for NaN, infinity or overflowing moments. Synchronises the stream.");
  m.def("xcorr_merge_comoments", &xcorr_merge_comoments, py::arg("dim_a"), py::arg("dim_b"), py::arg("n"),
        py::arg("moments_a"), py::arg("moments_b"), py::arg("comoment"), py::arg("comoment_dtype"), py::arg("m"),
        py::arg("in_moments_a"), py::arg("in_moments_b"), py::arg("in_comoment"), py::arg("in_dtype"),
        py::arg("resid_a"), py::arg("resid_b"), py::arg("device"), py::arg("stream"), py::arg("name"),
        "Chan merge of an incoming part into an accumulator in place (resid pointers 0 when merging two "
        "accumulators). Raises ValueError naming `name` when the merged moments would overflow (nothing is "
        "written then). Synchronises the stream.");
}
