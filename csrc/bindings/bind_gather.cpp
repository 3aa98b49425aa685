#include <pybind11/numpy.h>

#include <string>

#include "bindings/register.h"
#include "common/gather.h"

namespace py = pybind11;

namespace pyperm::bindings {
namespace {

// An array used in place: a conversion would copy it (and write the output into the copy).
void check_in_place(const py::array& a, const py::dtype& dtype, const char* name) {
  if (!a.dtype().is(dtype) || !(a.flags() & py::array::c_style))
    throw py::type_error(std::string("gather_units: ") + name + " must be a C-contiguous " +
                         std::string(py::str(dtype)) + " array");
}

// src (outer, n, unit bytes) and out (outer, k, unit bytes): the bytes of C-contiguous tensors, as
// pyperm._gather.index_select passes them; index (k,) int64. Checked here too: a wrong shape or an index
// out of range raises instead of writing out of bounds.
void gather_units(const py::array& src, const py::array& index, py::array& out, int threads) {
  check_in_place(src, py::dtype::of<uint8_t>(), "src");
  check_in_place(out, py::dtype::of<uint8_t>(), "out");
  check_in_place(index, py::dtype::of<int64_t>(), "index");
  if (!out.writeable()) throw py::value_error("gather_units: out is read-only");
  if (src.ndim() != 3 || out.ndim() != 3 || index.ndim() != 1)
    throw py::value_error("gather_units: src and out must be 3-D, index 1-D");
  const int64_t outer = src.shape(0), n = src.shape(1), unit = src.shape(2), k = index.shape(0);
  if (out.shape(0) != outer || out.shape(1) != k || out.shape(2) != unit)
    throw py::value_error("gather_units: out must have shape (src.shape[0], len(index), src.shape[2])");
  const auto* s = static_cast<const unsigned char*>(src.data());
  const auto* idx = static_cast<const int64_t*>(index.data());
  auto* o = static_cast<unsigned char*>(out.mutable_data());
  bool ok;
  {
    py::gil_scoped_release release;
    ok = cpu::gather_units(s, outer, n, unit, idx, k, o, threads);
  }
  if (!ok) throw py::index_error("gather_units: index out of range for an axis of length " + std::to_string(n));
}

}  // namespace

void register_gather(py::module_& m) {
  m.def("gather_units", &gather_units, py::arg("src"), py::arg("index"), py::arg("out"), py::arg("threads"),
        "out[o, j] = src[o, index[j]] over the bytes of units: weight matching's gathers along a middle axis.");
}

}  // namespace pyperm::bindings
