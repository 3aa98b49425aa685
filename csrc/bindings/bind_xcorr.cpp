#include "bindings/register.h"

namespace pyperm::bindings {
void register_xcorr(pybind11::module_& m) { (void)m; }  // filled by the cross-correlation kernel
}  // namespace pyperm::bindings
