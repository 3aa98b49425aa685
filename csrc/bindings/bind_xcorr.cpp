// Bindings of the streaming cross-correlation kernels. pyperm._xcorr validates what users
// pass; the checks here only keep memory safe (dtype, shape, contiguity, writability).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/register.h"
#include "bindings/status.h"
#include "xcorr/xcorr_cpu.h"

namespace py = pybind11;

namespace pyperm::bindings {
namespace {

using cpu::Real;

Real real_of(const py::array& a, const std::string& what) {
  // isinstance on array_t compares dtypes by equivalence (PyArray_EquivTypes), not identity:
  // an unpickled or foreign float64 array has an equal but distinct dtype object.
  if (py::isinstance<py::array_t<double>>(a)) return Real::F64;
  if (py::isinstance<py::array_t<float>>(a)) return Real::F32;
  throw py::type_error(what + " must be float32 or float64");
}

// Checks a C-contiguous array of the given shape (and dtype, when `dtype` is not null).
void require(const py::array& a, const std::vector<py::ssize_t>& shape, const std::string& what,
             bool writable, const Real* dtype = nullptr) {
  if (!(a.flags() & py::array::c_style)) throw py::value_error(what + " must be C-contiguous");
  // The vectorised loops assume naturally aligned elements.
  if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_)) throw py::value_error(what + " must be aligned");
  if (writable && !a.writeable()) throw py::value_error(what + " must be writable");
  if (a.ndim() != static_cast<py::ssize_t>(shape.size())) throw py::value_error(what + " has the wrong rank");
  for (size_t k = 0; k < shape.size(); ++k)
    if (a.shape(static_cast<py::ssize_t>(k)) != shape[k]) throw py::value_error(what + " has the wrong shape");
  if (dtype && real_of(a, what) != *dtype) throw py::type_error(what + " has the wrong dtype");
}

// An ndarray itself, never a converted copy: the merge writes into these arrays.
py::array ndarray(const py::handle& h, const std::string& what) {
  if (!py::isinstance<py::array>(h)) throw py::type_error(what + " must be a numpy array");
  return py::reinterpret_borrow<py::array>(h);
}

// xs[k] (rows x cols) -> centred[k] written in place;
// returns [(moments (4, cols), resid (cols,), max column sum of squares of centred[k])].
py::list moments(const std::vector<py::array>& xs, std::vector<py::array> centred,
                 const std::vector<std::string>& names, int threads, const std::string& isa_name) {
  const cpu::Isa isa = cpu::parse_isa(isa_name);
  const size_t n = xs.size();
  if (centred.size() != n || names.size() != n) throw py::value_error("xs, centred and names differ in length");
  std::vector<cpu::MomentsJob> jobs(n);
  std::vector<py::array_t<double>> mom, resid;
  py::list out;
  for (size_t k = 0; k < n; ++k) {
    const py::array& x = xs[k];
    if (x.ndim() != 2) throw py::value_error(names[k] + " must be 2-D");
    const Real dt = real_of(x, names[k]);
    const py::ssize_t rows = x.shape(0), cols = x.shape(1);
    if (rows < 1 || cols < 1) throw py::value_error(names[k] + " must not be empty");
    require(x, {rows, cols}, names[k], false, &dt);
    require(centred[k], {rows, cols}, "centred buffer of " + names[k], true, &dt);
    mom.emplace_back(std::vector<py::ssize_t>{4, cols});
    resid.emplace_back(cols);
    cpu::MomentsJob& j = jobs[k];
    j.x = x.data();
    j.dtype = dt;
    j.rows = rows;
    j.cols = cols;
    j.centred = centred[k].mutable_data();
    j.moments = mom.back().mutable_data();
    j.resid = resid.back().mutable_data();
  }
  int64_t failed = -1;
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::batch_moments(jobs.data(), static_cast<int64_t>(n), threads, isa, &failed);
  }
  if (s != Status::Ok) {
    if (failed < 0) throw std::runtime_error("cross-correlation moments failed");
    raise_for(jobs[static_cast<size_t>(failed)].error, names[static_cast<size_t>(failed)]);
  }
  for (size_t k = 0; k < n; ++k) out.append(py::make_tuple(mom[k], resid[k], jobs[k].max_sumsq));
  return out;
}

// Each job: (n, moments_a, moments_b, comoment, m, in_moments_a, in_moments_b, in_comoment,
// resid_a | None, resid_b | None). The accumulator arrays are updated in place.
void merge(const std::vector<py::tuple>& jobs_in, const std::vector<std::string>& names, int threads,
           const std::string& isa_name) {
  const cpu::Isa isa = cpu::parse_isa(isa_name);
  const size_t n = jobs_in.size();
  if (names.size() != n) throw py::value_error("jobs and names differ in length");
  std::vector<cpu::MergeJob> jobs(n);
  for (size_t k = 0; k < n; ++k) {
    const py::tuple& t = jobs_in[k];
    if (t.size() != 10) throw py::value_error("a merge job is a 10-tuple");
    const std::string& nm = names[k];
    py::array ma = ndarray(t[1], nm + ": moments_a"), mb = ndarray(t[2], nm + ": moments_b");
    py::array c = ndarray(t[3], nm + ": comoment");
    py::array ia = ndarray(t[5], nm + ": incoming moments_a"), ib = ndarray(t[6], nm + ": incoming moments_b");
    py::array g = ndarray(t[7], nm + ": incoming comoment");
    if (c.ndim() != 2) throw py::value_error(nm + ": comoment must be 2-D");
    const py::ssize_t da = c.shape(0), db = c.shape(1);
    const Real f64 = Real::F64;
    const Real ct = real_of(c, nm + ": comoment"), gt = real_of(g, nm + ": incoming comoment");
    require(ma, {4, da}, nm + ": moments_a", true, &f64);
    require(mb, {4, db}, nm + ": moments_b", true, &f64);
    require(c, {da, db}, nm + ": comoment", true, &ct);
    require(ia, {4, da}, nm + ": incoming moments_a", false, &f64);
    require(ib, {4, db}, nm + ": incoming moments_b", false, &f64);
    require(g, {da, db}, nm + ": incoming comoment", false, &gt);
    cpu::MergeJob& j = jobs[k];
    j.dim_a = da;
    j.dim_b = db;
    j.n = t[0].cast<int64_t>();
    j.m = t[4].cast<int64_t>();
    if (j.n < 0 || j.m < 0) throw py::value_error(nm + ": negative sample count");
    j.moments_a = static_cast<double*>(ma.mutable_data());
    j.moments_b = static_cast<double*>(mb.mutable_data());
    j.comoment = c.mutable_data();
    j.comoment_dtype = ct;
    j.in_moments_a = static_cast<const double*>(ia.data());
    j.in_moments_b = static_cast<const double*>(ib.data());
    j.in_comoment = g.data();
    j.in_dtype = gt;
    if (!t[8].is_none() || !t[9].is_none()) {
      if (t[8].is_none() || t[9].is_none()) throw py::value_error(nm + ": pass both residuals or neither");
      py::array ra = ndarray(t[8], nm + ": resid_a"), rb = ndarray(t[9], nm + ": resid_b");
      require(ra, {da}, nm + ": resid_a", false, &f64);
      require(rb, {db}, nm + ": resid_b", false, &f64);
      j.resid_a = static_cast<const double*>(ra.data());
      j.resid_b = static_cast<const double*>(rb.data());
    }
  }
  int64_t failed = -1;
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::merge_comoments(jobs.data(), static_cast<int64_t>(n), threads, isa, &failed);
  }
  if (s != Status::Ok) {
    if (failed < 0) throw std::runtime_error("cross-correlation merge failed");
    raise_for(jobs[static_cast<size_t>(failed)].error, names[static_cast<size_t>(failed)]);
  }
}

// out = diag(row_scale) src diag(col_scale) + row_add col_add^T, optionally clipped to [-1, 1].
py::array scale(const py::array& src, const py::array_t<double, py::array::c_style>& row_scale,
                const py::array_t<double, py::array::c_style>& col_scale, const py::object& row_add,
                const py::object& col_add, bool clip, int threads, const std::string& isa_name) {
  const cpu::Isa isa = cpu::parse_isa(isa_name);
  if (src.ndim() != 2) throw py::value_error("comoment must be 2-D");
  const Real dt = real_of(src, "comoment");
  const py::ssize_t rows = src.shape(0), cols = src.shape(1);
  require(src, {rows, cols}, "comoment", false, &dt);
  require(row_scale, {rows}, "row_scale", false);
  require(col_scale, {cols}, "col_scale", false);
  const double *ra = nullptr, *ca = nullptr;
  py::array_t<double, py::array::c_style> ra_arr, ca_arr;
  if (!row_add.is_none() || !col_add.is_none()) {
    ra_arr = row_add.cast<py::array_t<double, py::array::c_style>>();
    ca_arr = col_add.cast<py::array_t<double, py::array::c_style>>();
    require(ra_arr, {rows}, "row_add", false);
    require(ca_arr, {cols}, "col_add", false);
    ra = ra_arr.data();
    ca = ca_arr.data();
  }
  py::array out(src.dtype(), std::vector<py::ssize_t>{rows, cols});
  const void* s = src.data();
  void* o = out.mutable_data();
  const double *rs = row_scale.data(), *cs = col_scale.data();
  {
    py::gil_scoped_release release;
    cpu::scale_comoment(s, o, dt, rows, cols, rs, cs, ra, ca, clip, threads, isa);
  }
  return out;
}

}  // namespace

void register_xcorr(py::module_& m) {
  m.def("xcorr_moments", &moments, py::arg("xs"), py::arg("centred"), py::arg("names"), py::arg("threads"),
        py::arg("isa") = "auto", "Batch means, m2, ranges and shift residuals; writes the shifted batches.");
  m.def("xcorr_merge", &merge, py::arg("jobs"), py::arg("names"), py::arg("threads"), py::arg("isa") = "auto",
        "Chan's pairwise merge of co-moments into accumulators, in place.");
  m.def("xcorr_scale", &scale, py::arg("comoment"), py::arg("row_scale"), py::arg("col_scale"),
        py::arg("row_add"), py::arg("col_add"), py::arg("clip"), py::arg("threads"), py::arg("isa") = "auto",
        "diag(r) C diag(c) + a b^T, optionally clipped to [-1, 1].");
}

}  // namespace pyperm::bindings
