#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>

#include "bindings/register.h"
#include "bindings/status.h"
#include "lap/incremental_assignment.h"
#include "lap/lap_cpu.h"

namespace py = pybind11;

namespace pyperm::bindings {
namespace {

// Arrays arrive validated from pyperm._lap: C-contiguous, float32/float64.
template <typename T>
py::tuple solve(py::array_t<T, py::array::c_style> cost, bool maximize, const std::string& isa_name) {
  if (cost.ndim() != 2) throw py::value_error("cost must be 2-D");
  const int64_t n = cost.shape(0), m = cost.shape(1), k = std::min(n, m);
  const cpu::Isa isa = cpu::parse_isa(isa_name);
  py::array_t<int64_t> rows(k), cols(k);
  const T* c = cost.data();
  int64_t* r = rows.mutable_data();
  int64_t* q = cols.mutable_data();
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::linear_sum_assignment(c, n, m, maximize, r, q, isa);
  }
  raise_for(s, "");
  return py::make_tuple(rows, cols);
}

template <typename T>
py::tuple solve_batch(py::array_t<T, py::array::c_style> costs, bool maximize, int threads,
                      const std::string& isa_name) {
  if (costs.ndim() != 3) throw py::value_error("costs must be 3-D");
  const int64_t b = costs.shape(0), n = costs.shape(1), m = costs.shape(2), k = std::min(n, m);
  const cpu::Isa isa = cpu::parse_isa(isa_name);
  py::array_t<int64_t> rows({b, k}), cols({b, k});
  const T* c = costs.data();
  int64_t* r = rows.mutable_data();
  int64_t* q = cols.mutable_data();
  int64_t failed = -1;
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::batch_linear_sum_assignment(c, b, n, m, maximize, r, q, threads, isa, &failed);
  }
  raise_for(s, "problem " + std::to_string(failed) + " of the batch: ");
  return py::make_tuple(rows, cols);
}

// Problems below this many entries are solved holding the GIL: releasing and taking it back
// costs about as much as solving them, and other threads wait no longer than a solve.
constexpr int64_t kReleaseGilFrom = 4096;

// Whether a numpy array's entries can be read in place as T: native byte order, aligned,
// C-contiguous (a view with other strides, or a swapped or packed dtype, is converted by
// the Python layer).
bool readable_in_place(PyObject* obj, int type_num) {
  const auto* arr = py::detail::array_proxy(obj);
  const auto* descr = py::detail::array_descriptor_proxy(arr->descr);
  constexpr int kFlags = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_ALIGNED_;
  const char order = descr->byteorder;
  const uint16_t one = 1;
  const char native = *reinterpret_cast<const char*>(&one) == 1 ? '<' : '>';
  return descr->type_num == type_num && (arr->flags & kFlags) == kFlags && (order == '=' || order == native);
}

template <typename T>
py::tuple solve_in_place(PyObject* obj, bool maximize) {
  const auto* arr = py::detail::array_proxy(obj);
  const int64_t n = arr->dimensions[0], m = arr->dimensions[1], k = std::min(n, m);
  py::array_t<int64_t> rows(k), cols(k);
  const T* c = reinterpret_cast<const T*>(arr->data);
  int64_t* r = rows.mutable_data();
  int64_t* q = cols.mutable_data();
  Status s;
  if (n * m >= kReleaseGilFrom) {
    py::gil_scoped_release release;
    s = cpu::linear_sum_assignment(c, n, m, maximize, r, q, cpu::best_isa());
  } else {
    s = cpu::linear_sum_assignment(c, n, m, maximize, r, q, cpu::best_isa());
  }
  raise_for(s, "");
  return py::make_tuple(std::move(rows), std::move(cols));
}

// pyperm.linear_sum_assignment's path for the commonest input, a 2-D float64 or float32
// numpy array readable in place: one call, no conversion, no argument parsing beyond a type
// check. Returns None for anything else, which the Python layer then classifies, converts
// and checks. The array is held by the caller for the whole call (the GIL is released only
// while the caller's reference keeps it alive).
py::object solve_plain(py::handle cost, bool maximize) {
  PyObject* obj = cost.ptr();
  if (!py::detail::npy_api::get().PyArray_Check_(obj) || py::detail::array_proxy(obj)->nd != 2) return py::none();
  if (readable_in_place(obj, py::detail::npy_api::NPY_DOUBLE_)) return solve_in_place<double>(obj, maximize);
  if (readable_in_place(obj, py::detail::npy_api::NPY_FLOAT_)) return solve_in_place<float>(obj, maximize);
  return py::none();
}

// Square minimisation from the column duals v (updated in place): for sequences of similar
// problems, such as the steps of weight matching. Arrays arrive validated from pyperm._lap.
template <typename T>
py::array_t<int64_t> solve_warm(py::array_t<T, py::array::c_style> cost, py::array_t<T, py::array::c_style> v,
                                const std::string& isa_name) {
  if (cost.ndim() != 2 || cost.shape(0) != cost.shape(1)) throw py::value_error("cost must be square");
  const int64_t n = cost.shape(0);
  if (v.ndim() != 1 || v.shape(0) != n) throw py::value_error("v must have one entry per column");
  const cpu::Isa isa = cpu::parse_isa(isa_name);
  py::array_t<int64_t> cols(n);
  const T* c = cost.data();
  T* dual = v.mutable_data();
  int64_t* q = cols.mutable_data();
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::solve_square_warm(c, n, dual, q, isa);
  }
  raise_for(s, "");
  return cols;
}

// A solver bound to a cost matrix the caller changes in place between solves (the steps of
// weight matching), keeping its matching and column duals. Takes the array itself, never a
// converted copy: a copy would not see the caller's changes.
template <typename T>
class BoundIncrementalAssignment {
 public:
  BoundIncrementalAssignment(py::array cost, const std::string& isa_name)
      : cost_(checked(cost)), solver_(static_cast<const T*>(cost_.data()), cost_.shape(0), cpu::parse_isa(isa_name)) {}

  // Starts from an assignment and column duals (e.g. from lap_solve_warm).
  void warm_start(py::array_t<int64_t, py::array::c_style | py::array::forcecast> col_of_row,
                  py::array_t<T, py::array::c_style | py::array::forcecast> v) {
    const int64_t n = cost_.shape(0);
    if (col_of_row.ndim() != 1 || col_of_row.shape(0) != n || v.ndim() != 1 || v.shape(0) != n)
      throw py::value_error("col_of_row and v must have one entry per row");
    solver_.warm_start(col_of_row.data(), v.data());
  }

  py::array_t<int64_t> solve() {
    py::array_t<int64_t> cols(cost_.shape(0));
    int64_t* q = cols.mutable_data();
    Status s;
    {
      py::gil_scoped_release release;
      s = solver_.solve(q);
    }
    raise_for(s, "");
    return cols;
  }

 private:
  static py::array checked(py::array cost) {
    // Compared by type number: equal dtypes can be distinct objects (an unpickled array's).
    if (cost.dtype().num() != py::dtype::of<T>().num()) throw py::type_error("cost has the wrong dtype");
    if (!(cost.flags() & py::array::c_style)) throw py::value_error("cost must be C-contiguous");
    if (cost.ndim() != 2 || cost.shape(0) != cost.shape(1)) throw py::value_error("cost must be square");
    return cost;
  }

  py::array cost_;  // keeps the caller's buffer alive
  cpu::IncrementalAssignment<T> solver_;
};

template <typename T>
void register_incremental(py::module_& m, const char* name) {
  py::class_<BoundIncrementalAssignment<T>>(m, name)
      .def(py::init<py::array, const std::string&>(), py::arg("cost"), py::arg("isa") = "auto")
      .def("warm_start", &BoundIncrementalAssignment<T>::warm_start, py::arg("col_of_row"), py::arg("v"))
      .def("solve", &BoundIncrementalAssignment<T>::solve);
}

}  // namespace

void register_lap(py::module_& m) {
  m.def("lap_solve_plain", &solve_plain, py::arg("cost"), py::arg("maximize"));
  m.def("lap_solve", &solve<double>, py::arg("cost"), py::arg("maximize"), py::arg("isa") = "auto");
  m.def("lap_solve", &solve<float>, py::arg("cost"), py::arg("maximize"), py::arg("isa") = "auto");
  m.def("lap_solve_warm", &solve_warm<double>, py::arg("cost"), py::arg("v"), py::arg("isa") = "auto");
  m.def("lap_solve_warm", &solve_warm<float>, py::arg("cost"), py::arg("v"), py::arg("isa") = "auto");
  register_incremental<double>(m, "IncrementalAssignmentF64");
  register_incremental<float>(m, "IncrementalAssignmentF32");
  m.def("lap_solve_batch", &solve_batch<double>, py::arg("costs"), py::arg("maximize"), py::arg("threads"),
        py::arg("isa") = "auto");
  m.def("lap_solve_batch", &solve_batch<float>, py::arg("costs"), py::arg("maximize"), py::arg("threads"),
        py::arg("isa") = "auto");
}

}  // namespace pyperm::bindings
