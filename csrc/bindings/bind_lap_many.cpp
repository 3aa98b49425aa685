// Many assignment problems in one call (ragged lists, padded stacks with sizes), cost limits,
// and lap's lapjv result. Arrays arrive validated from pyperm.lap._ragged and
// pyperm.lap._lapjv: float32/float64 of one dtype per call, columns contiguous.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "bindings/register.h"
#include "bindings/status.h"
#include "lap/lap_many.h"

namespace py = pybind11;

namespace pyperm::bindings {
namespace {

cpu::CostLimit to_limit(std::optional<double> limit) {
  cpu::CostLimit out;
  if (limit) { out.has_limit = true; out.limit = *limit; }
  return out;
}

// A 2-D array of T with contiguous columns as a view (the caller keeps it alive).
template <typename T>
cpu::MatrixView<T> view_of(const py::array& a, size_t index) {
  const auto where = "costs[" + std::to_string(index) + "]";
  if (a.ndim() != 2) throw py::value_error(where + " must be 2-D");
  if (!py::isinstance<py::array_t<T>>(a)) throw py::type_error(where + " has another dtype than costs[0]");
  const int64_t n = a.shape(0), m = a.shape(1), size = static_cast<int64_t>(sizeof(T));
  if (n == 0 || m == 0) return {static_cast<const T*>(a.data()), n, m, m};  // numpy gives empty arrays any strides
  const int64_t row_stride = n > 1 ? a.strides(0) / size : m;
  if ((m > 1 && a.strides(1) != size) || (n > 1 && (a.strides(0) % size != 0 || row_stride < m)))
    throw py::value_error(where + " must have contiguous columns and non-negative row strides");
  return {static_cast<const T*>(a.data()), n, m, row_stride};
}

// Solves the views and returns (row_ind, col_ind, bounds): problem b's pairs are
// row_ind[bounds[b]:bounds[b + 1]], col_ind likewise.
template <typename T>
py::tuple solve_views(const std::vector<cpu::MatrixView<T>>& views, bool maximize, cpu::CostLimit limit,
                      int threads) {
  const int64_t count = static_cast<int64_t>(views.size());
  std::vector<int64_t> offsets(views.size()), matched(views.size());
  int64_t capacity = 0;
  for (size_t b = 0; b < views.size(); ++b) {
    offsets[b] = capacity;
    capacity += std::min(views[b].n_rows, views[b].n_cols);
  }
  std::vector<int64_t> rows(static_cast<size_t>(capacity)), cols(static_cast<size_t>(capacity));
  py::array_t<int64_t> bounds(count + 1);
  int64_t* bound = bounds.mutable_data();
  int64_t failed = -1;
  const cpu::Isa isa = cpu::best_isa();
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::solve_many(views.data(), count, maximize, limit, offsets.data(), rows.data(), cols.data(),
                        matched.data(), threads, isa, &failed);
    // Close the gaps left by problems that matched fewer pairs than they had room for.
    bound[0] = 0;
    if (s == Status::Ok) {
      for (int64_t b = 0; b < count; ++b) {
        std::copy_n(rows.begin() + offsets[b], matched[b], rows.begin() + bound[b]);
        std::copy_n(cols.begin() + offsets[b], matched[b], cols.begin() + bound[b]);
        bound[b + 1] = bound[b] + matched[b];
      }
    }
  }
  raise_for(s, "problem " + std::to_string(failed) + ": ");
  const int64_t total = bound[count];
  py::array_t<int64_t> row_out(total), col_out(total);
  std::copy_n(rows.begin(), total, row_out.mutable_data());
  std::copy_n(cols.begin(), total, col_out.mutable_data());
  return py::make_tuple(row_out, col_out, bounds);
}

template <typename T>
py::tuple solve_list_as(const py::list& costs, bool maximize, cpu::CostLimit limit, int threads) {
  std::vector<cpu::MatrixView<T>> views;
  views.reserve(costs.size());
  for (size_t b = 0; b < costs.size(); ++b) views.push_back(view_of<T>(costs[b].cast<py::array>(), b));
  return solve_views(views, maximize, limit, threads);
}

// A list of 2-D float32 arrays, or of 2-D float64 arrays (one dtype per call).
py::tuple solve_list(const py::list& costs, bool maximize, std::optional<double> limit, int threads) {
  const cpu::CostLimit lim = to_limit(limit);
  if (costs.size() > 0 && py::isinstance<py::array_t<float>>(costs[0]))
    return solve_list_as<float>(costs, maximize, lim, threads);
  return solve_list_as<double>(costs, maximize, lim, threads);
}

// A C-contiguous (B, N, M) stack; problem b is costs[b, :sizes[b, 0], :sizes[b, 1]].
template <typename T>
py::tuple solve_padded(py::array_t<T, py::array::c_style> costs,
                       py::array_t<int64_t, py::array::c_style> sizes, bool maximize,
                       std::optional<double> limit, int threads) {
  if (costs.ndim() != 3) throw py::value_error("costs must be 3-D");
  const int64_t count = costs.shape(0), n_max = costs.shape(1), m_max = costs.shape(2);
  if (sizes.ndim() != 2 || sizes.shape(0) != count || sizes.shape(1) != 2)
    throw py::value_error("sizes must have shape (B, 2)");
  const int64_t* size = sizes.data();
  std::vector<cpu::MatrixView<T>> views(static_cast<size_t>(count));
  for (int64_t b = 0; b < count; ++b) {
    const int64_t n = size[2 * b], m = size[2 * b + 1];
    if (n < 0 || n > n_max || m < 0 || m > m_max)
      throw py::value_error("sizes[" + std::to_string(b) + "] is out of range");
    views[b] = {costs.data() + b * n_max * m_max, n, m, m_max};
  }
  return solve_views(views, maximize, to_limit(limit), threads);
}

// One C-contiguous problem with a cost limit: (row_ind, col_ind) of its matched pairs.
template <typename T>
py::tuple solve_one(py::array_t<T, py::array::c_style> cost, bool maximize, double limit) {
  if (cost.ndim() != 2) throw py::value_error("cost must be 2-D");
  const int64_t n = cost.shape(0), m = cost.shape(1), k = std::min(n, m);
  const cpu::MatrixView<T> view{cost.data(), n, m, m};
  py::array_t<int64_t> rows(k), cols(k);
  int64_t* r = rows.mutable_data();
  int64_t* q = cols.mutable_data();
  int64_t offset = 0, matched = 0, failed = -1;
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::solve_many(&view, 1, maximize, to_limit(limit), &offset, r, q, &matched, 1, cpu::best_isa(), &failed);
  }
  raise_for(s, "");
  if (matched < k) {
    rows.resize({matched});
    cols.resize({matched});
  }
  return py::make_tuple(rows, cols);
}

// lap.lapjv's result (total, x, y): x[i] the column of row i, y[j] the row of column j,
// -1 where unmatched, int32 as in lap; total summed in double from `cost` itself.
template <typename T>
py::tuple lapjv(py::array_t<T, py::array::c_style> cost, std::optional<double> limit) {
  if (cost.ndim() != 2) throw py::value_error("cost must be 2-D");
  const int64_t n = cost.shape(0), m = cost.shape(1);
  const cpu::MatrixView<T> view{cost.data(), n, m, m};
  const int64_t k = std::min(n, m);
  std::vector<int64_t> rows(static_cast<size_t>(k)), cols(static_cast<size_t>(k));
  int64_t offset = 0, matched = 0, failed = -1;
  py::array_t<int32_t> x(n), y(m);
  int32_t* xs = x.mutable_data();
  int32_t* ys = y.mutable_data();
  double total = 0.0;
  Status s;
  {
    py::gil_scoped_release release;
    s = cpu::solve_many(&view, 1, false, to_limit(limit), &offset, rows.data(), cols.data(), &matched, 1,
                        cpu::best_isa(), &failed);
    std::fill_n(xs, n, -1);
    std::fill_n(ys, m, -1);
    for (int64_t p = 0; p < matched; ++p) {
      xs[rows[p]] = static_cast<int32_t>(cols[p]);
      ys[cols[p]] = static_cast<int32_t>(rows[p]);
      total += static_cast<double>(view.data[rows[p] * m + cols[p]]);
    }
  }
  raise_for(s, "");
  return py::make_tuple(total, x, y);
}

}  // namespace

void register_lap_many(py::module_& m) {
  m.def("lap_solve_many", &solve_list, py::arg("costs"), py::arg("maximize"), py::arg("limit"), py::arg("threads"));
  m.def("lap_solve_padded", &solve_padded<double>, py::arg("costs"), py::arg("sizes"), py::arg("maximize"),
        py::arg("limit"), py::arg("threads"));
  m.def("lap_solve_padded", &solve_padded<float>, py::arg("costs"), py::arg("sizes"), py::arg("maximize"),
        py::arg("limit"), py::arg("threads"));
  m.def("lap_solve_limited", &solve_one<double>, py::arg("cost"), py::arg("maximize"), py::arg("limit"));
  m.def("lap_solve_limited", &solve_one<float>, py::arg("cost"), py::arg("maximize"), py::arg("limit"));
  m.def("lap_lapjv", &lapjv<double>, py::arg("cost"), py::arg("limit"));
  m.def("lap_lapjv", &lapjv<float>, py::arg("cost"), py::arg("limit"));
}

}  // namespace pyperm::bindings
