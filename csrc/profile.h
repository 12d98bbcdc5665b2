// Timers behind Model::forward's profile (where one forward's time goes): the GEMM driver and the
// attention driver add what their calls spend to accumulators of the calling thread, and the
// Model reads and clears them around each call. Timers only: a few clock reads per call and per
// thread of a parallel region; nothing the arithmetic depends on.
//
// Included by the baseline drivers only (gemm.cpp, attention.cpp, model.cpp), never by the ISA
// files, so its inline functions are always compiled for the baseline.
#pragma once
#include <chrono>
#include <cstdint>

namespace qspec {

using ProfClock = std::chrono::steady_clock;

inline double seconds_between(ProfClock::time_point a, ProfClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline int64_t nanoseconds_between(ProfClock::time_point a, ProfClock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

// Idle and synchronisation time of parallel regions: each thread times its own stretch of work
// (from its first claim of work to its last piece done); what the team does not spend working,
// threads x region wall - sum of those stretches, is idle: waking the team, waiting at the end for
// the slowest thread, and a thread's time without a core on a shared machine.
struct RegionTiming {
  double idle_thread_s = 0;  // sum over regions of threads x wall - busy thread-seconds
  double idle_s = 0;         // the same divided by each region's team size: its share of the wall time
  void add(double wall_s, double busy_thread_s, int threads) {
    const double idle = threads * wall_s - busy_thread_s;
    idle_thread_s += idle;
    idle_s += idle / threads;
  }
};

struct GemmTiming {
  double prep_s = 0;  // activation preparation before the kernels: Q8 quantization, bf16 rounding, K padding
  RegionTiming region;
};

GemmTiming& gemm_timing();    // this thread's GEMM accumulators (csrc/gemm.cpp)
RegionTiming& attn_timing();  // this thread's attention accumulators (csrc/attention.cpp)

}  // namespace qspec
