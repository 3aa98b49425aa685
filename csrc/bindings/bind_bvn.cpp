#include "bindings/register.h"

namespace pyperm::bindings {
void register_bvn(pybind11::module_& m) { (void)m; }  // filled by the Birkhoff-von Neumann kernel
}  // namespace pyperm::bindings
