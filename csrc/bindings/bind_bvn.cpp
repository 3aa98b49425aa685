#include <pybind11/numpy.h>

#include <chrono>
#include <exception>
#include <string>

#include "bindings/register.h"
#include "bindings/status.h"
#include "bvn/bvn_cpu.h"

namespace py = pybind11;

namespace pyperm::bindings {
namespace {

cpu::BvnMethod parse_method(const std::string& method) {
  if (method == "max-weight") return cpu::BvnMethod::MaxWeight;
  if (method == "bottleneck") return cpu::BvnMethod::Bottleneck;
  if (method == "max-weight-lapwarm") return cpu::BvnMethod::MaxWeightLapWarm;  // comparison only
  throw py::value_error("method must be 'max-weight' or 'bottleneck', got '" + method + "'");
}

const char* stop_name(cpu::BvnStop s) {
  switch (s) {
    case cpu::BvnStop::Converged: return "converged";
    case cpu::BvnStop::MaxTerms: return "max_terms";
    case cpu::BvnStop::NoMatching: return "no_matching";
    case cpu::BvnStop::Cancelled: return "cancelled";
  }
  return "unknown";
}

// Arrays arrive validated from pyperm._bvn: C-contiguous, square, float32/float64, finite,
// non-negative, doubly stochastic within the caller's tolerance.
// progress: None, or a callable (terms, coeff, residual_mass) that may raise StopIteration
// to stop early. Runs without the GIL; takes it back after each term when there is a
// callback, and every 50 ms otherwise to let Ctrl-C interrupt a long decomposition.
template <typename T>
py::tuple decompose(py::array_t<T, py::array::c_style> D, const std::string& method, int64_t max_terms, double tol,
                    py::object progress, const std::string& isa_name) {
  if (D.ndim() != 2 || D.shape(0) != D.shape(1)) throw py::value_error("D must be a square 2-D array");
  const int64_t n = D.shape(0);
  const cpu::BvnMethod m = parse_method(method);
  const cpu::Isa isa = cpu::parse_isa(isa_name);
  const bool has_callback = !progress.is_none();
  std::exception_ptr error;
  auto last_check = std::chrono::steady_clock::now();
  cpu::BvnProgress hook = [&](int64_t terms, double coeff, double mass) -> bool {
    const auto now = std::chrono::steady_clock::now();
    if (!has_callback && now - last_check < std::chrono::milliseconds(50)) return true;
    last_check = now;
    py::gil_scoped_acquire gil;
    try {
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      if (has_callback) progress(terms, coeff, mass);
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_StopIteration)) error = std::current_exception();
      return false;
    }
    return true;
  };
  cpu::BvnResult<T> result;
  const T* d = D.data();
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::birkhoff_decomposition(d, n, m, max_terms, tol, &hook, isa, &result);
  }
  if (error) std::rethrow_exception(error);
  raise_for(s, "D: ");
  const int64_t k = static_cast<int64_t>(result.coeffs.size());
  py::array_t<T> coeffs(k);
  py::array_t<int64_t> perms({k, n});
  std::copy(result.coeffs.begin(), result.coeffs.end(), coeffs.mutable_data());
  std::copy(result.perms.begin(), result.perms.end(), perms.mutable_data());
  return py::make_tuple(coeffs, perms, result.residual_mass, stop_name(result.stop));
}

template <typename T>
py::tuple bottleneck(py::array_t<T, py::array::c_style> A) {
  if (A.ndim() != 2 || A.shape(0) != A.shape(1)) throw py::value_error("A must be a square 2-D array");
  const int64_t n = A.shape(0);
  py::array_t<int64_t> cols(n);
  const T* a = A.data();
  int64_t* c = cols.mutable_data();
  T value = T(0);
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::bottleneck_matching(a, n, c, &value);
  }
  raise_for(s, "", "the support of the matrix has no perfect matching");
  return py::make_tuple(cols, value);
}

}  // namespace

void register_bvn(py::module_& m) {
  m.def("bvn_decompose", &decompose<double>, py::arg("D"), py::arg("method"), py::arg("max_terms"), py::arg("tol"),
        py::arg("progress") = py::none(), py::arg("isa") = "auto");
  m.def("bvn_decompose", &decompose<float>, py::arg("D"), py::arg("method"), py::arg("max_terms"), py::arg("tol"),
        py::arg("progress") = py::none(), py::arg("isa") = "auto");
  m.def("bottleneck_matching", &bottleneck<double>, py::arg("A"));
  m.def("bottleneck_matching", &bottleneck<float>, py::arg("A"));
}

}  // namespace pyperm::bindings
