// Each kernel family registers its functions on the _core module from its own file.
// Only the files in bindings/ include pybind11.
#pragma once
#include <pybind11/pybind11.h>

namespace pyperm::bindings {
void register_lap(pybind11::module_& m);
void register_lap_sparse(pybind11::module_& m);
void register_lap_many(pybind11::module_& m);
void register_xcorr(pybind11::module_& m);
void register_bvn(pybind11::module_& m);
void register_gather(pybind11::module_& m);
void register_thread_pool(pybind11::module_& m);
}  // namespace pyperm::bindings
