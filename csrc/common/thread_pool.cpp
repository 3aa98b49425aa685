#include "common/thread_pool.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
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

namespace {
std::atomic<bool> g_cost_model{true};
}  // namespace

int threads_for_work(int threads, int64_t work) {
  if (threads <= 0) threads = hardware_threads();
  if (!g_cost_model.load(std::memory_order_relaxed)) return threads;
  const int64_t useful = std::max<int64_t>(1, work / kWorkPerThread);
  return static_cast<int>(std::min<int64_t>(threads, useful));
}

bool set_cost_model(bool on) { return g_cost_model.exchange(on); }

namespace {

// Runs tasks of one loop until none is left; the caller and every worker that joins call it.
struct Loop {
  const std::function<void(int64_t)>* body = nullptr;
  int64_t n_tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr error;

  void run_tasks() {
    for (;;) {
      if (failed.load(std::memory_order_relaxed)) return;
      const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= n_tasks) return;
      try {
        (*body)(t);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
      }
    }
  }
};

class Pool {
 public:
  explicit Pool(int workers) {
    // Workers block every signal, so that Python's handlers (Ctrl-C) run on its threads.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    threads_.reserve(static_cast<size_t>(workers));
    try {
      for (int k = 0; k < workers; ++k) threads_.emplace_back([this] { work(); });
    } catch (...) {
      // No more threads could be started: run with those that were.
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }

  int workers() const { return static_cast<int>(threads_.size()); }

  // Workers not asleep: each is one of the kernel's runnable threads, though not a competitor.
  int awake() const { return awake_.load(std::memory_order_relaxed); }

  // Runs the loop with up to `helpers` workers beside the calling thread, or returns false
  // without running anything when another loop owns the workers.
  bool try_run(Loop& loop, int helpers) {
    if (owned_.exchange(true, std::memory_order_acquire)) return false;
    helpers = std::min(helpers, workers());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      loop_ = &loop;
      open_seats_ = helpers;
      ++generation_;
    }
    if (helpers == workers()) wake_.notify_all();
    else
      for (int k = 0; k < helpers; ++k) wake_.notify_one();
    loop.run_tasks();
    {
      // Close the loop to late workers, then wait for those inside it.
      std::unique_lock<std::mutex> lock(mutex_);
      open_seats_ = 0;
      done_.wait(lock, [&] { return inside_ == 0; });
      loop_ = nullptr;
    }
    owned_.store(false, std::memory_order_release);
    return true;
  }

  // At exit: stops and joins the workers if no loop owns them (an exit while another thread
  // is inside a loop leaves its workers to the end of the process instead of waiting).
  void shut_down() {
    if (owned_.exchange(true, std::memory_order_acquire)) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    // owned_ stays set: later loops (from other exit handlers) run on their calling thread.
  }

 private:
  void work() {
    uint64_t seen = 0;
    awake_.fetch_add(1, std::memory_order_relaxed);
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      awake_.fetch_sub(1, std::memory_order_relaxed);
      wake_.wait(lock, [&] { return stopping_ || (generation_ != seen && open_seats_ > 0); });
      awake_.fetch_add(1, std::memory_order_relaxed);
      if (stopping_) return;
      seen = generation_;
      --open_seats_;
      ++inside_;
      Loop* loop = loop_;
      lock.unlock();
      loop->run_tasks();
      lock.lock();
      if (--inside_ == 0 && open_seats_ == 0) done_.notify_one();
    }
  }

  std::atomic<bool> owned_{false};  // whether a loop (or the shutdown) owns the workers
  std::atomic<int> awake_{0};
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  Loop* loop_ = nullptr;  // the loop being run, while one is
  uint64_t generation_ = 0;  // loops started so far: a worker joins each at most once
  int open_seats_ = 0;  // workers that may still join the current loop
  int inside_ = 0;  // workers inside the current loop
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// The process's pool, created on first use and never freed: a child after fork() and the
// exit both leave it alone rather than destroy mutexes or threads another thread may hold.
std::atomic<Pool*> g_pool{nullptr};
std::once_flag g_atfork_once;
std::mutex g_create_mutex;
std::atomic<bool> g_exiting{false};

// Cores with nothing to run, by the kernel's count of runnable threads (the fourth field of
// /proc/loadavg, "running/total"), the calling thread and `own` awake workers of the pool being
// among them; -1 when unknown. On a machine whose cores are all busy a woken worker waits for a
// turn, often longer than the loop takes serially, so a loop takes helpers only for idle cores.
int idle_cores(int own) {
  static const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);  // pread: no shared offset
  static const int cpus = std::max(1, get_nprocs());
  if (fd < 0) return -1;
  char buf[128];
  const ssize_t got = pread(fd, buf, sizeof(buf) - 1, 0);
  if (got <= 0) return -1;
  buf[got] = '\0';
  const char* slash = std::strchr(buf, '/');
  if (slash == nullptr) return -1;
  const char* p = slash;
  while (p > buf && p[-1] >= '0' && p[-1] <= '9') --p;
  if (p == slash) return -1;
  const long running = std::strtol(p, nullptr, 10);
  return static_cast<int>(std::max<long>(0, cpus - std::max<long>(1, running - own)));
}

void forget_pool_in_child() {
  // The parent's workers do not exist in the child, and its locks may have been held at the
  // fork: leak the parent's pool (its memory is the child's copy) and start afresh.
  g_pool.store(nullptr, std::memory_order_relaxed);
  new (&g_create_mutex) std::mutex();
}

// Stops the workers when the module's statics are destroyed at exit.
struct ShutDownAtExit {
  ~ShutDownAtExit() {
    g_exiting.store(true);
    if (Pool* p = g_pool.load(std::memory_order_acquire)) p->shut_down();
  }
} g_shut_down_at_exit;

Pool* pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return p;
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  std::lock_guard<std::mutex> lock(g_create_mutex);
  p = g_pool.load(std::memory_order_acquire);
  if (p == nullptr) {
    p = new Pool(hardware_threads() - 1);
    g_pool.store(p, std::memory_order_release);
  }
  return p;
}

}  // namespace

void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& body) {
  if (n_tasks <= 0) return;
  if (threads <= 0) threads = hardware_threads();
  threads = static_cast<int>(std::min<int64_t>({threads, n_tasks, hardware_threads()}));
  Loop loop;
  loop.body = &body;
  loop.n_tasks = n_tasks;
  int helpers = threads - 1;
  if (helpers > 0 && g_cost_model.load(std::memory_order_relaxed)) {
    const Pool* p = g_pool.load(std::memory_order_acquire);
    const int idle = idle_cores(p == nullptr ? 0 : p->awake());
    if (idle >= 0) helpers = std::min(helpers, idle);
  }
  if (helpers <= 0 || g_exiting.load(std::memory_order_relaxed) || !pool()->try_run(loop, helpers))
    loop.run_tasks();  // serial: one thread asked or useful, or the workers are busy with another loop
  if (loop.error) std::rethrow_exception(loop.error);
}

void parallel_for(int64_t n_tasks, int threads, int64_t work, const std::function<void(int64_t)>& body) {
  parallel_for(n_tasks, threads_for_work(threads, work), body);
}

int pool_workers() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  return p == nullptr ? 0 : p->workers();
}

}  // namespace pyperm::cpu
