// A fork-join parallel loop on one persistent pool of worker threads per process.
//
// The workers are started on first use (hardware_threads() - 1 of them: the calling thread
// works too) and sleep between loops. A loop never waits for a worker to start: the caller
// takes tasks itself from the first one on, workers join while tasks are left, and the
// caller waits only for tasks a worker has already taken. A loop also takes no more helpers
// than there are idle cores (by the kernel's count of runnable threads): on a machine whose
// cores are busy, a woken worker waits for a turn and the caller then waits for it, so there a
// loop runs on its calling thread alone.
//
// Safe from several threads at once: one loop at a time owns the workers; a loop that finds
// them busy (another caller's, or a loop nested in a task) runs on its calling thread alone.
// After fork() the child starts a new pool on first use (the parent's workers do not exist
// there). At exit, idle workers are stopped and joined; busy ones are left to the exit.
#pragma once
#include <cstdint>
#include <functional>

namespace pyperm::cpu {

// Number of hardware threads (at least 1).
int hardware_threads();

// The cost model. Work is counted in units of about one cost-matrix entry scanned by the
// assignment kernels (callers with other kinds of work convert to it). A loop gets one
// thread per kWorkPerThread units at most, so it stays on the calling thread below twice
// that. Why this value: it is about the crossover, the work from which on two threads of this
// pool beat one, measured on the 2-core development machine by `pyperm bench lap
// --threads-goal --crossover` (batches of 100 x 25 problems, DETR's size) with the benchmark
// run under `chrt -f 1` so that its threads find the cores idle as on a quiet machine: two
// threads won from about 18,000 units on, and by a third at twice that. A second thread comes
// only at twice the crossover, where its gain covers the worker's wake-up with room for noise.
constexpr int64_t kWorkPerThread = int64_t(1) << 14;

// How many threads a loop of `work` units may use: at most `threads` (<= 0: all hardware
// threads), at most one per kWorkPerThread units, at least 1.
int threads_for_work(int threads, int64_t work);

// Switches the cost model (the work per thread and the idle-core limit) off or back on, and
// returns whether it was on: with it off, every loop runs on the threads asked whatever its
// work and the machine's load. For measuring the crossover and for testing the pool.
bool set_cost_model(bool on);

// Runs body(task) for task in [0, n_tasks) on up to `threads` threads (threads <= 0 means
// hardware_threads()), the calling thread included. Tasks are handed out dynamically, so
// uneven tasks balance. If a body throws, the remaining tasks are skipped and the first
// exception is rethrown once every task taken has finished.
void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& body);

// The same, on threads_for_work(threads, work) threads: `work` estimates the whole loop's
// work in the units above.
void parallel_for(int64_t n_tasks, int threads, int64_t work, const std::function<void(int64_t)>& body);

// The number of the pool's workers running (for tests: 0 before the first parallel loop, and in
// a child after fork() until its first one).
int pool_workers();

}  // namespace pyperm::cpu
