#include <pybind11/numpy.h>

#include <algorithm>
#include <string>

#include "bindings/register.h"
#include "bindings/status.h"
#include "lap/lap_sparse_cpu.h"

namespace py = pybind11;

namespace pyperm::bindings {
namespace {

// A CSR matrix's three arrays, as pyperm.lap._sparse passes them: data float32/float64,
// indptr and indices of one integer type (int32 or int64), all C-contiguous. The lengths
// are checked here, since the core trusts them; the core checks everything else.
template <typename T, typename I>
py::tuple solve_sparse(py::array_t<I, py::array::c_style> indptr, py::array_t<I, py::array::c_style> indices,
                       py::array_t<T, py::array::c_style> data, int64_t n_rows, int64_t n_cols, bool maximize) {
  if (n_rows < 0 || n_cols < 0) throw py::value_error("cost must have a non-negative shape");
  if (indptr.ndim() != 1 || indices.ndim() != 1 || data.ndim() != 1)
    throw py::value_error("cost's indptr, indices and data must be 1-D");
  if (indptr.shape(0) != n_rows + 1) throw py::value_error("cost's indptr must have n_rows + 1 entries");
  if (indices.shape(0) != data.shape(0)) throw py::value_error("cost's indices and data must have one length");
  if (static_cast<int64_t>(indptr.at(n_rows)) != data.shape(0))
    throw py::value_error("cost's indptr must end at the number of stored entries");
  const int64_t k = std::min(n_rows, n_cols);
  py::array_t<int64_t> rows(k), cols(k);
  const I* p = indptr.data();
  const I* q = indices.data();
  const T* d = data.data();
  int64_t* r = rows.mutable_data();
  int64_t* c = cols.mutable_data();
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::sparse_linear_sum_assignment(p, q, d, n_rows, n_cols, maximize, r, c);
  }
  raise_for(s, "", "no full matching exists: cost's stored entries admit no matching of min(n_rows, n_cols) pairs");
  return py::make_tuple(rows, cols);
}

template <typename T, typename I>
void def_solve(py::module_& m) {
  m.def("lap_solve_sparse", &solve_sparse<T, I>, py::arg("indptr"), py::arg("indices"), py::arg("data"),
        py::arg("n_rows"), py::arg("n_cols"), py::arg("maximize"));
}

}  // namespace

void register_lap_sparse(py::module_& m) {
  def_solve<double, int32_t>(m);
  def_solve<double, int64_t>(m);
  def_solve<float, int32_t>(m);
  def_solve<float, int64_t>(m);
}

}  // namespace pyperm::bindings
