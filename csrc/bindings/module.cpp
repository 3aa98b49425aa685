#include "bindings/register.h"
#include "common/cpu_features.h"
#include "common/thread_pool.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "pyperm's compiled CPU core. Use the functions of the pyperm package, which validate input.";
  m.def("best_isa", [] { return std::string(pyperm::cpu::isa_name(pyperm::cpu::best_isa())); },
        "The widest SIMD instruction set the kernels use on this machine.");
  m.def("hardware_threads", &pyperm::cpu::hardware_threads);
  pyperm::bindings::register_lap(m);
  pyperm::bindings::register_xcorr(m);
  pyperm::bindings::register_bvn(m);
}
