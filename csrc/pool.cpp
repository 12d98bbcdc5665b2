// The forward pass's thread pool (pool.h): a job is open from its start until the caller's own
// share is done; workers join while it is open, and only those are waited for.
#include "pool.h"

#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <stdexcept>
#include <thread>

namespace qspec {

namespace {

constexpr uint64_t kClosed = uint64_t(1) << 31;
constexpr uint64_t kActive = kClosed - 1;
// A worker spins this long for the next job before it sleeps: the GEMMs of a forward follow each
// other within microseconds, the forwards of a decode loop within ~0.2-1 ms of Python.
constexpr auto kSpin = std::chrono::microseconds(300);

thread_local bool t_in_job = false;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() { __builtin_ia32_pause(); }

}  // namespace

Pool& Pool::instance() {
  // Never destroyed: its (detached) workers may still be waiting when the process exits.
  static Pool* pool = [] {
    Pool* p = new Pool();
    p->set_threads(omp_get_max_threads());  // OMP_NUM_THREADS, else the CPUs we may run on
    return p;
  }();
  return *pool;
}

void Pool::set_threads(int n) {
  if (n < 1) throw std::invalid_argument("threads must be >= 1");
  if (busy_.exchange(true, std::memory_order_acquire))
    throw std::runtime_error("set_threads: a forward pass is running");
  if (n < threads_) {
    stop_below_.store(n, std::memory_order_seq_cst);
    gen_.fetch_add(1, std::memory_order_seq_cst);  // no job has this generation: wakes, nobody joins
    futex_wake_all(&gen_);
    while (running_.load(std::memory_order_acquire) > n - 1) std::this_thread::yield();
  }
  stop_below_.store(1 << 30, std::memory_order_seq_cst);
  for (int slot = threads_; slot < n; ++slot) {
    running_.fetch_add(1, std::memory_order_acq_rel);
    std::thread([this, slot] { worker(slot); }).detach();
  }
  threads_ = n;
  busy_.store(false, std::memory_order_release);
}

void Pool::worker(int slot) {
  uint32_t seen = gen_.load(std::memory_order_acquire);
  for (;;) {
    // Checked before waiting too: a worker that starts after set_threads lowered the count
    // (and bumped gen_) would otherwise wait for a generation that never comes.
    if (slot >= stop_below_.load(std::memory_order_seq_cst)) break;
    uint32_t g = gen_.load(std::memory_order_acquire);
    auto t0 = std::chrono::steady_clock::now();
    for (unsigned i = 1; g == seen; ++i, g = gen_.load(std::memory_order_acquire)) {
      cpu_relax();
      if ((i & 255) == 0 && std::chrono::steady_clock::now() - t0 > kSpin) {
        // Registered as a sleeper before the last look at gen_: a job started after that look
        // sees the registration and wakes us; one started before it is seen here.
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (gen_.load(std::memory_order_seq_cst) == seen) futex_wait(&gen_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        t0 = std::chrono::steady_clock::now();
      }
    }
    seen = g;
    if (slot >= stop_below_.load(std::memory_order_seq_cst)) break;
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s >> 32) == g && !(s & kClosed)) {
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        // Joined job g: fn_/ctx_ were written before it opened and stay until it is over,
        // which it cannot be while we are active.
        joined_.fetch_add(1, std::memory_order_relaxed);
        t_in_job = true;
        fn_(ctx_, slot);
        t_in_job = false;
        state_.fetch_sub(1, std::memory_order_release);
        break;
      }
    }
  }
  running_.fetch_sub(1, std::memory_order_acq_rel);
}

int Pool::run_erased(void (*fn)(void*, int), void* ctx) {
  const bool own = !t_in_job && !busy_.exchange(true, std::memory_order_acquire);
  if (!own || threads_ <= 1) {  // nested, concurrent or single-threaded: the caller alone
    if (own) busy_.store(false, std::memory_order_release);
    const bool nested = t_in_job;
    t_in_job = true;
    fn(ctx, 0);
    t_in_job = nested;
    return 1;
  }
  t_in_job = true;
  fn_ = fn;
  ctx_ = ctx;
  joined_.store(0, std::memory_order_relaxed);
  const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;
  state_.store(uint64_t(g) << 32, std::memory_order_release);
  gen_.store(g, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&gen_);
  fn(ctx, 0);
  state_.fetch_or(kClosed, std::memory_order_acq_rel);  // no one joins from here on
  while ((state_.load(std::memory_order_acquire) & kActive) != 0) cpu_relax();
  const int team = 1 + joined_.load(std::memory_order_relaxed);
  t_in_job = false;
  busy_.store(false, std::memory_order_release);
  return team;
}

}  // namespace qspec
