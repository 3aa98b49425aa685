// The thread pool's state and cost model, and a probe loop for its tests.
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings/register.h"
#include "common/thread_pool.h"

namespace py = pybind11;

namespace pyperm::bindings {
namespace {

// Runs parallel_for(n_tasks, threads[, work]) with the GIL released. Task `throw_at` throws
// std::runtime_error; with `nested`, each task runs a loop of two tasks of its own; with
// `rendezvous`, each task waits (10 s at most) until every task has started, which only
// several threads at once can pass. Returns (how many times each task ran, how many distinct
// threads ran tasks, whether every rendezvous was met).
py::tuple probe(int64_t n_tasks, int threads, int64_t throw_at, bool nested, bool rendezvous, int64_t work) {
  if (n_tasks < 0) throw py::value_error("n_tasks must be >= 0");
  std::vector<std::atomic<int>> runs(static_cast<size_t>(n_tasks));
  std::vector<std::thread::id> ran_on(static_cast<size_t>(n_tasks));
  std::atomic<int64_t> started{0};
  std::atomic<bool> met{true};
  auto task = [&](int64_t t) {
    if (t == throw_at) throw std::runtime_error("task " + std::to_string(t) + " failed");
    if (rendezvous) {
      started.fetch_add(1);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (started.load() < n_tasks) {
        if (std::chrono::steady_clock::now() > deadline) { met.store(false); break; }
        std::this_thread::yield();
      }
    }
    if (nested) cpu::parallel_for(2, 2, [](int64_t) {});
    runs[t].fetch_add(1);
    ran_on[t] = std::this_thread::get_id();
  };
  {
    py::gil_scoped_release release;
    if (work >= 0) cpu::parallel_for(n_tasks, threads, work, task);
    else cpu::parallel_for(n_tasks, threads, task);
  }
  std::vector<int> counts(static_cast<size_t>(n_tasks));
  std::vector<std::thread::id> seen;
  for (int64_t t = 0; t < n_tasks; ++t) {
    counts[t] = runs[t].load();
    if (counts[t] == 0) continue;
    bool known = false;
    for (auto id : seen) known |= id == ran_on[t];
    if (!known) seen.push_back(ran_on[t]);
  }
  return py::make_tuple(counts, static_cast<int>(seen.size()), met.load());
}

}  // namespace

void register_thread_pool(py::module_& m) {
  m.def("pool_workers", &cpu::pool_workers,
        "Worker threads of the parallel loops' pool running in this process (0 until first used).");
  m.def("work_per_thread", [] { return cpu::kWorkPerThread; },
        "The cost model's work per thread (thread_pool.h): loops below twice it run on the calling thread.");
  m.def("set_cost_model", &cpu::set_cost_model, py::arg("on"),
        "Switches the parallel loops' cost model off (every loop on the threads asked) or on; returns whether it "
        "was on. For measurements and tests.");
  m.def("threads_for_work", &cpu::threads_for_work, py::arg("threads"), py::arg("work"),
        "The threads the cost model gives a loop of `work` units asked to run on `threads` (<= 0: all).");
  m.def("parallel_for_probe", &probe, py::arg("n_tasks"), py::arg("threads"), py::arg("throw_at") = -1,
        py::arg("nested") = false, py::arg("rendezvous") = false, py::arg("work") = -1,
        "For the pool's tests: (runs of each task, distinct threads that ran tasks, rendezvous met); "
        "work >= 0 runs the loop through the cost model.");
}

}  // namespace pyperm::bindings
