// A stress run of csrc/common/thread_pool.cpp alone, built with a sanitizer by
// tests/test_thread_pool.py: several threads run loops at once (some nested, some throwing),
// then a forked child runs a loop on a pool of its own. Exits 0 when every task ran once,
// every exception reached its caller and the child's loop was right.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/thread_pool.h"

using pyperm::cpu::parallel_for;

int main() {
  pyperm::cpu::set_cost_model(false);  // every loop on the pool, whatever the machine's load
  std::atomic<long> wrong{0};
  auto caller = [&](int id) {
    for (int it = 0; it < 300; ++it) {
      const int n = 1 + (it * 7 + id) % 97;
      std::vector<std::atomic<int>> runs(n);
      parallel_for(n, 0, [&](int64_t t) {
        if (t % 5 == 0) parallel_for(3, 2, [](int64_t) {});
        runs[t]++;
      });
      for (auto& r : runs) wrong += r != 1;
      try {
        parallel_for(50, 0, [](int64_t t) {
          if (t == 13) throw std::runtime_error("task 13");
        });
        ++wrong;
      } catch (const std::runtime_error&) {
      }
    }
  };
  std::vector<std::thread> callers;
  for (int k = 0; k < 4; ++k) callers.emplace_back(caller, k);
  for (auto& t : callers) t.join();
  const pid_t pid = fork();
  if (pid == 0) {
    std::atomic<int> sum{0};
    parallel_for(100, 0, [&](int64_t t) { sum += int(t); });
    _exit(sum == 4950 ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  const bool child_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  std::printf("wrong=%ld child=%s workers=%d\n", wrong.load(), child_ok ? "ok" : "failed",
              pyperm::cpu::pool_workers());
  return wrong == 0 && child_ok ? 0 : 1;
}
