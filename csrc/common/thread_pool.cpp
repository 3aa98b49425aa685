#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace pyperm::cpu {

int hardware_threads() {
  // Read once: glibc answers hardware_concurrency() by opening and parsing
  // /sys/devices/system/cpu/online, a few microseconds of system calls that every solve of a
  // small matrix paid when this was asked per call.
  static const int count = [] {
    unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : static_cast<int>(n);
  }();
  return count;
}

void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& body) {
  if (n_tasks <= 0) return;
  if (threads <= 0) threads = hardware_threads();
  threads = static_cast<int>(std::min<int64_t>(threads, n_tasks));
  if (threads == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) body(t);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    for (;;) {
      int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= n_tasks || failed.load(std::memory_order_relaxed)) return;
      try {
        body(t);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true);
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int k = 1; k < threads; ++k) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace pyperm::cpu
