// A fork-join parallel loop. Threads are created per call and joined before it
// returns: no global pool, so callers on several Python threads never share state.
#pragma once
#include <cstdint>
#include <functional>

namespace pyperm::cpu {

// Number of hardware threads (at least 1).
int hardware_threads();

// Runs body(task) for task in [0, n_tasks) on up to `threads` threads
// (threads <= 0 means hardware_threads()). Tasks are handed out dynamically,
// so uneven tasks balance. The calling thread works too. If a body throws,
// the remaining tasks are skipped and the first exception is rethrown.
void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& body);

}  // namespace pyperm::cpu
