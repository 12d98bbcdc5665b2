// The threads of the forward pass (GEMMs, attention, row-wise loops).
//
// A job runs body(slot) on the calling thread (slot 0) and on every worker (slots 1..threads-1)
// that joins while the job is open. The body claims its own pieces of work from a counter it
// shares with the other participants and returns when none are left. The caller returns once
// its own body has returned and every worker that joined has left; a worker that has not joined
// by then is not waited for: the job closes without it.
//
// Why not OpenMP: a parallel region ends in a barrier that waits for every thread of the team.
// On a machine with other load, a thread that lost its core joins a scheduler tick later, and
// every GEMM of a decode step waited for it (8960x1536 BF16 GEMV at load 6 on 2 cores: 12.9 ms
// with 2 OpenMP threads, 2.5 ms on one). Here the caller just does that thread's share.
//
// Which thread runs a piece never changes its result (every kernel computes an output whole), so
// outputs are the same bits whoever joins.
#pragma once

#include <atomic>
#include <cstdint>

namespace qspec {

class Pool {
 public:
  static Pool& instance();

  int threads() const { return threads_; }  // the caller included
  void set_threads(int n);                   // n >= 1; stops or starts workers

  // Runs body(slot) as described above; returns how many threads took part (>= 1). A job started
  // from inside a job (or while another thread runs one) runs on its caller alone.
  template <class F>
  int run(F& body) {
    return run_erased([](void* ctx, int slot) { (*static_cast<F*>(ctx))(slot); }, &body);
  }

 private:
  Pool() = default;
  int run_erased(void (*fn)(void*, int), void* ctx);
  void worker(int slot);

  int threads_ = 1;
  // state_: generation (high 32 bits) | closed (bit 31) | active workers (low 31 bits)
  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> gen_{0};       // the newest job's generation: workers wait on it
  std::atomic<int> joined_{0};         // workers that joined the current job
  std::atomic<int> sleepers_{0};       // workers blocked in futex_wait on gen_
  std::atomic<int> running_{0};        // worker threads alive
  std::atomic<int> stop_below_{1 << 30};  // workers with slot >= this exit
  void (*fn_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<bool> busy_{false};      // a job is running (one at a time)
};

// Pieces [0, n) in chunks of `grain`, claimed from a shared counter: f(slot, begin, end).
template <class F>
int parallel_for(int64_t n, int64_t grain, F&& f) {
  std::atomic<int64_t> next{0};
  auto body = [&](int slot) {
    for (int64_t b = next.fetch_add(grain, std::memory_order_relaxed); b < n;
         b = next.fetch_add(grain, std::memory_order_relaxed))
      f(slot, b, b + grain < n ? b + grain : n);
  };
  return Pool::instance().run(body);
}

}  // namespace qspec
