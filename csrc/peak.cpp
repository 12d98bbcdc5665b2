// Compute-peak probe for bench/ (the "peak" a GEMM's GFLOP/s is taken against): every thread of
// the pool runs independent multiply-add chains of one instruction family, operands in registers
// (tiles), for a fixed time; the result is the FLOPs done over the wall time. A clock-based peak
// (threads x clock x FLOPs per cycle) needs the real clock and the instruction's issue rate,
// neither of which a VM shows: Zen 4 issues one 512-bit vdpbf16ps a cycle where Sapphire Rapids
// issues two, and a shared AMX unit moves by 2x from one minute to the next.
#include <pybind11/pybind11.h>

#include <chrono>
#include <stdexcept>
#include <string>

#include "bindings.h"
#include "cpu.h"
#include "peak_internal.h"
#include "pool.h"

namespace qspec {
namespace {

using PeakFn = double (*)(int64_t, float, float*);

struct PeakKind {
  const char* name;
  Isa needs;
  PeakFn fn;
};

constexpr PeakKind kKinds[] = {
    {"fma_avx2", Isa::avx2, detail::peak_fma_avx2},
    {"fma_avx512", Isa::avx512, detail::peak_fma_avx512},
    {"dpbf16", Isa::avx512_bf16, detail::peak_dpbf16_avx512},
    {"amx_bf16", Isa::amx, detail::peak_tdpbf16_amx},
};

const PeakKind& kind_of(const std::string& name) {
  for (const PeakKind& k : kKinds) {
    if (name != k.name) continue;
    if (isa_selected() < k.needs)
      throw std::invalid_argument("compute_peak: " + name + " needs the " + isa_name(k.needs) +
                                  " level (selected: " + isa_name(isa_selected()) + ")");
    return k;
  }
  throw std::invalid_argument("compute_peak: unknown kind '" + name +
                              "' (fma_avx2, fma_avx512, dpbf16, amx_bf16)");
}

// GFLOP/s of `kind` on every thread of the pool for about `seconds`. Each thread runs chunks of
// steps, doubling the chunk until one takes >= 1 ms (the emulation build is ~100x slower), until
// the deadline.
double compute_peak(const PeakKind& k, double seconds) {
  using clock = std::chrono::steady_clock;
  constexpr int kMaxSlots = 256;
  double flops[kMaxSlots] = {};
  float sink[kMaxSlots] = {};
  const auto t0 = clock::now();
  const auto deadline = t0 + std::chrono::duration<double>(seconds);
  auto body = [&](int slot) {
    if (slot >= kMaxSlots) return;
    int64_t steps = 256;
    for (auto t = clock::now(); t < deadline;) {
      flops[slot] += k.fn(steps, 1.0f + 1e-3f * float(slot), &sink[slot]);
      const auto t1 = clock::now();
      if (t1 - t < std::chrono::milliseconds(1)) steps *= 2;
      t = t1;
    }
  };
  Pool::instance().run(body);
  const double secs = std::chrono::duration<double>(clock::now() - t0).count();
  double total = 0;
  for (int i = 0; i < kMaxSlots; ++i) total += flops[i];
  return total / secs / 1e9;
}

}  // namespace

namespace py = pybind11;

void bind_peak(py::module_& m) {
  m.def("compute_peak", [](const std::string& kind, double seconds) {
    if (!(seconds > 0 && seconds <= 60)) throw std::invalid_argument("compute_peak: seconds in (0, 60]");
    const PeakKind& k = kind_of(kind);
    py::gil_scoped_release nogil;
    return compute_peak(k, seconds);
  }, py::arg("kind"), py::arg("seconds") = 0.25,
     "Measured GFLOP/s of one GEMM instruction family on all the pool's threads (register-only "
     "multiply-add chains for about `seconds`): fma_avx2, fma_avx512, dpbf16 (vdpbf16ps), amx_bf16 "
     "(TDPBF16PS). ValueError for an unknown kind or one above the selected ISA level.");
}

}  // namespace qspec
