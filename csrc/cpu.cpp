#include "cpu.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace qspec {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // linux/arch/x86/include/uapi/asm/prctl.h
constexpr int kXfeatureXtiledata = 18;

uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}

CpuFeatures probe() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  const unsigned max_leaf = a;
  char vendor[13] = {};
  std::memcpy(vendor + 0, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  f.vendor = vendor;

  unsigned ext_max = __get_cpuid_max(0x80000000u, nullptr);
  if (ext_max >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      __get_cpuid(0x80000002u + i, &a, &b, &c, &d);
      std::memcpy(brand + 16 * i + 0, &a, 4);
      std::memcpy(brand + 16 * i + 4, &b, 4);
      std::memcpy(brand + 16 * i + 8, &c, 4);
      std::memcpy(brand + 16 * i + 12, &d, 4);
    }
    std::string s(brand);
    size_t first = s.find_first_not_of(' '), last = s.find_last_not_of(' ');
    f.model = first == std::string::npos ? "" : s.substr(first, last - first + 1);
  }

  __get_cpuid(1, &a, &b, &c, &d);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  const bool osxsave = c & (1u << 27);
  if (osxsave) {
    uint64_t xcr0 = read_xcr0();
    f.os_avx = (xcr0 & 0x6) == 0x6;
    f.os_avx512 = f.os_avx && (xcr0 & 0xE0) == 0xE0;
    f.os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);
  }
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = b & (1u << 5);
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512_vbmi = c & (1u << 1);
    f.avx512_vnni = c & (1u << 11);
    f.avx512_fp16 = d & (1u << 23);
    f.amx_bf16 = d & (1u << 22);
    f.amx_tile = d & (1u << 24);
    f.amx_int8 = d & (1u << 25);
    __cpuid_count(7, 1, a, b, c, d);
    f.avx_vnni = a & (1u << 4);
    f.avx512_bf16 = a & (1u << 5);
  }
  if (f.amx_tile && f.os_amx) {
    // Linux >= 5.16 requires each process to ask for the large tile-data state.
    f.amx_permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }
  return f;
}

Isa detect(const CpuFeatures& f) {
  const bool avx2 = f.os_avx && f.avx2 && f.fma && f.f16c;
#ifdef QSPEC_ISA_EMULATION
  if (avx2) return Isa::amx;  // test build: the AVX-512/AMX kernels run on emulated intrinsics
#endif
  const bool avx512 = avx2 && f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  const bool bf16 = avx512 && f.avx512_bf16;
  const bool amx = bf16 && f.avx512_vbmi && f.avx512_vnni && f.amx_tile && f.amx_bf16 && f.amx_int8 && f.os_amx &&
                   f.amx_permitted;
  if (amx) return Isa::amx;
  if (bf16) return Isa::avx512_bf16;
  if (avx512) return Isa::avx512;
  if (avx2) return Isa::avx2;
  return Isa::scalar;
}

Isa initial_selection() {
  Isa isa = isa_detected();
  if (const char* env = std::getenv("QSPEC_ISA"); env && *env) {
    Isa want = isa_from_name(env);  // an unknown name is a user error: reported, not ignored
    if (int(want) < int(isa)) isa = want;
  }
  return isa;
}

std::atomic<int>& selected_slot() {
  static std::atomic<int> slot{-1};
  return slot;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = probe();
  return f;
}

Isa isa_detected() {
  static const Isa isa = detect(cpu_features());
  return isa;
}

Isa isa_selected() {
  int v = selected_slot().load(std::memory_order_relaxed);
  if (v < 0) {
    v = int(initial_selection());
    selected_slot().store(v, std::memory_order_relaxed);
  }
  return Isa(v);
}

Isa set_isa_limit(Isa limit) {
  Isa isa = isa_detected();
  if (int(limit) < int(isa)) isa = limit;
  selected_slot().store(int(isa), std::memory_order_relaxed);
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::amx: return "amx";
  }
  return "?";
}

Isa isa_from_name(const std::string& name) {
  for (int i = 0; i <= int(Isa::amx); ++i)
    if (name == isa_name(Isa(i))) return Isa(i);
  throw std::invalid_argument("QSPEC_ISA='" + name +
                              "' is not one of scalar, avx2, avx512, avx512_bf16, amx");
}

bool env_switch(const char* var, const char* on, const char* off, bool unset) {
  const char* env = std::getenv(var);
  if (!env || !*env) return unset;
  if (std::string(env) == on) return true;
  if (std::string(env) == off) return false;
  throw std::invalid_argument(std::string(var) + "='" + env + "' is not one of " + on + ", " + off);
}

}  // namespace qspec
