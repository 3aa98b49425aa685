// The one translation of the kernels' outcome codes into Python exceptions, for the CPU
// module (_core) and the CUDA module (_cuda) alike. Header-only: the two modules are
// separate shared libraries.
#pragma once
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "common/status.h"

namespace pyperm::bindings {

// Throws for anything but Status::Ok. `where` prefixes the message ("problem 3 of the
// batch: "); the wording is scipy's ("matrix contains invalid numeric entries", "cost
// matrix is infeasible"), which pyperm.linear_sum_assignment promises. `infeasible`
// replaces the latter for problems that are not cost matrices.
inline void raise_for(Status s, const std::string& where = "",
                      const std::string& infeasible = "cost matrix is infeasible") {
  switch (s) {
    case Status::Ok: return;
    case Status::Invalid: throw pybind11::value_error(where + "matrix contains invalid numeric entries");
    case Status::Infeasible: throw pybind11::value_error(where + infeasible);
    case Status::NotConverged:
      throw std::runtime_error(where + "a solver hit an internal safety bound; please report this with the input "
                                       "that caused it");
  }
  throw std::runtime_error(where + "the solver failed");
}

// Throws ValueError naming `name` (an argument, "pairs[2] xa", "merge") for a failed
// cross-correlation job.
inline void raise_for(XcorrError e, const std::string& name) {
  switch (e) {
    case XcorrError::None: return;
    case XcorrError::NonFinite: throw pybind11::value_error(name + " contains NaN or infinity");
    case XcorrError::Overflow:
      throw pybind11::value_error(name + " has values too large to accumulate (its moments overflow); "
                                         "pass float64 data or rescale it");
  }
  throw std::runtime_error(name + ": cross-correlation failed");
}

}  // namespace pyperm::bindings
