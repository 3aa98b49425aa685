// The CUDA extension module: imported lazily by pyperm, only when CUDA input arrives.
//
// Device memory crosses this boundary as raw pointers (Python ints) with shapes, element
// strides, the device index and the caller's stream handle, so the module never links
// libtorch: pyperm/_cuda_ops.py takes them from torch tensors, __cuda_array_interface__
// or DLPack and allocates the outputs with the input's library. The wrapper has validated
// shapes, dtypes and pointers; the kernels check the numbers.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/cuda_runtime_info.h"
#include "lap/lap_cuda.h"

namespace py = pybind11;

namespace {

using pyperm::Status;
namespace pc = pyperm::cuda;

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

void raise_for(Status s, bool batched, int64_t failed) {
  const std::string where = batched ? "problem " + std::to_string(failed) + " of the batch: " : "";
  switch (s) {
    case Status::Ok: return;
    case Status::Invalid: throw py::value_error(where + "matrix contains invalid numeric entries");
    case Status::Infeasible: throw py::value_error(where + "cost matrix is infeasible");
    case Status::NotConverged:
      throw std::runtime_error(where + "the CUDA assignment solver hit an internal safety bound; "
                                       "please report this with the input that caused it");
  }
  throw std::runtime_error(where + "the CUDA assignment solver failed");
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

py::object lap_solve_batch(uintptr_t cost, const std::string& dtype, int64_t batch, int64_t n_rows, int64_t n_cols,
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
  raise_for(s, batched, failed);
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
  raise_for(s, batched, failed);
  if (want_stats) return stats_dict(st);
  return py::none();
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() =
      "pyperm's CUDA kernels (static CUDA runtime; imports without a driver). Use the functions of the "
      "pyperm package, which validate input; these take raw device pointers.";
  m.def("device_count", &pc::device_count, "Number of usable CUDA devices (0 without a driver or GPU).");
  m.def("runtime_version", &pc::runtime_version, "The CUDA runtime version this module was built with.");
  m.def("pointer_device", &pc::pointer_device, py::arg("ptr"),
        "The device owning a CUDA pointer, or -1 for memory that is not on a device.");

  m.def("lap_solve_batch", &lap_solve_batch, py::arg("cost"), py::arg("dtype"), py::arg("batch"), py::arg("n_rows"),
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
}
